"""The fused router launch (kernel flag `fused_router`, `moe.router_route`): the router GEMV and the top-k in one
launch, whose last program routes. Against the router kernel on logits summed in fp32 (`_exact_route`) on inputs
whose sums are exact in fp32 (small integers), so the logits are the same whatever the order of summation and every
id, weight, count and claim must match exactly (not against cuBLAS's bf16 GEMV, which may reduce partly in bf16:
PyTorch's allow_bf16_reduced_precision_reduction); random inputs within rounding.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU the same tests also replay it
from a CUDA graph, where the counter protocol shows its races.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels.moe_ref import RouteCounts  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _integers(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _exact_route(x: torch.Tensor, router: torch.Tensor, *args, **kw):
    """The two-launch path with the logits summed in fp32 (exact here) and rounded to x's dtype once."""
    return K.route((x.float() @ router.float().T).to(x.dtype), *args, **kw)


def _counts(e: int, first: int, claims: int = 0) -> RouteCounts:
    c = RouteCounts(torch.zeros(e, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), first)
    if claims:
        c.claim = torch.full((claims,), -1, dtype=torch.int32, device=DEV)
        c.threshold = torch.zeros(1, device=DEV)
        if claims > 1:
            c.spare = torch.arange(claims, dtype=torch.int64, device=DEV)
    return c


@pytest.mark.parametrize("t,e,h,shared,dtype", [(1, 16, 40, True, torch.bfloat16), (3, 20, 64, False, torch.float32),
                                                (4, 16, 600, True, torch.bfloat16), (2, 13, 130, True, torch.float32)])
def test_fused_router_routes_as_the_gemv_and_the_router_kernel(t, e, h, shared, dtype):
    """Ids, weights (the shared slot's too), counts and host reads equal the two-launch path's; H not a multiple of
    the column block and E not a power of two included."""
    x = _integers((t, h), seed=t, dtype=dtype)
    router = _integers((e + int(shared), h), seed=100 + e, dtype=dtype)
    first = e - 5
    fused_counts, plain_counts = _counts(e, first), _counts(e, first)
    w, ids = K.router_route(x, router, 4, True, shared=shared, counts=fused_counts, fused=True)
    w_ref, ids_ref = _exact_route(x, router, 4, True, shared=shared, counts=plain_counts)
    assert torch.equal(ids, ids_ref)
    assert torch.equal(w, w_ref)
    assert torch.equal(fused_counts.counts, plain_counts.counts)
    assert torch.equal(fused_counts.host_reads, plain_counts.host_reads) and plain_counts.host_reads.item() > 0


def test_fused_router_padding_rows_slot_map_and_claims():
    """A graph's padding rows (`valid`) select nothing and count nothing; a slot map turns router indices into
    slots; claims (one and several a step) are taken as the two-launch path takes them (h100-30: on a GPU that
    path's claim is a race between its token programs, so there the claims are checked for validity). A second launch after the
    first finds the counter back at 0 (else its last program would never route)."""
    t, e, h, k = 4, 16, 96, 3
    x = _integers((t, h), seed=7, dtype=torch.bfloat16)
    router = _integers((e + 1, h), seed=8, dtype=torch.bfloat16)
    valid = torch.tensor([3], dtype=torch.int32, device=DEV)
    slot_map = torch.randperm(e, generator=torch.Generator().manual_seed(3)).to(DEV, torch.int32)
    for claims in (1, 3):
        got, want = _counts(e, 8, claims), _counts(e, 8, claims)
        out = [K.router_route(x, router, k, False, shared=True, counts=got, valid=valid, slot_map=slot_map,
                              fused=True),
               _exact_route(x, router, k, False, shared=True, counts=want, valid=valid, slot_map=slot_map)]
        (w, ids), (w_ref, ids_ref) = out
        assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
        assert (ids[3:, :k] == K.SKIP).all() and (w[3:, :k] == 0).all()
        assert torch.equal(got.counts, want.counts) and got.counts.sum().item() == 3 * k
        # The two-launch path routes each token in its own program, so on a GPU which token's compare-and-swap
        # claims first is a race (any winner is a valid claim); the fused launch routes them in order, as the
        # interpreter runs the two-launch path's programs. Equal there; on a GPU both must be valid claims.
        if CUDA:
            for c in (got, want):
                claimed = [s for s in c.claim.tolist() if s >= 0]
                picked = set(ids[:3, :k].flatten().tolist())
                assert claimed and len(set(claimed)) == len(claimed) and all(s >= 8 and s in picked for s in claimed)
        else:
            assert torch.equal(got.claim, want.claim) and (got.claim >= 0).any()
    again = K.router_route(x, router, k, False, shared=True, valid=valid, slot_map=slot_map, fused=True)
    assert torch.equal(again[1], ids_ref)


def test_fused_router_random_inputs_within_rounding():
    """Random bf16 inputs: the logits differ from cuBLAS's at most by the order of an fp32 sum, so the weights of
    the ids both pick agree to bf16 rounding, and where the ids differ, the two picks' logits are within a few ulps."""
    g = torch.Generator().manual_seed(11)
    t, e, h, k = 4, 64, 512, 6
    x = torch.randn(t, h, generator=g).to(DEV, torch.bfloat16)
    router = (torch.randn(e + 1, h, generator=g) / h ** 0.5).to(DEV, torch.bfloat16)
    w, ids = K.router_route(x, router, k, True, shared=True, fused=True)
    logits = (x.double() @ router.double().T)
    for row in range(t):
        mine = logits[row, ids[row, :k].long()]
        best = logits[row, :e].topk(k).values
        torch.testing.assert_close(mine.sort(descending=True).values, best, atol=0.05, rtol=0)
    torch.testing.assert_close(w[:, k], torch.sigmoid(logits[:, e]).float(), atol=1e-2, rtol=0)


def test_more_tokens_than_the_fused_launch_takes_use_the_two_launch_path(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the fused launch ran past FUSED_ROUTER_MAX_T tokens")

    monkeypatch.setattr(K, "_router_route_kernel", NoLaunch())
    t = K.FUSED_ROUTER_MAX_T + 1
    x = _integers((t, 32), seed=1, dtype=torch.float32)
    router = _integers((9, 32), seed=2, dtype=torch.float32)
    w, ids = K.router_route(x, router, 2, True, shared=True, fused=True)
    w_ref, ids_ref = K.route(x @ router.T, 2, True, shared=True)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 4])
def test_fused_router_real_shape_from_a_graph(t):
    """512 experts and the shared gate over 2560 columns, replayed from a CUDA graph ten times: the same ids and
    weights each time, equal to the two-launch path's on integer inputs."""
    x = _integers((t, 2560), seed=5, dtype=torch.bfloat16)
    router = _integers((513, 2560), seed=6, dtype=torch.bfloat16)
    want = _exact_route(x, router, 10, True, shared=True)
    K.router_lock(x.device)
    K.router_route(x, router, 10, True, shared=True, fused=True)        # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = K.router_route(x, router, 10, True, shared=True, fused=True)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_fused_router_with_int32_keys_routes_as_with_int64(monkeypatch):
    """Kernel flag `route_key32` in the fused launch's routing tail: the same ids, weights and counts as the int64
    keys (bf16 logits; ties among the small-integer sums)."""
    x = _integers((3, 96), seed=9, dtype=torch.bfloat16)
    router = _integers((17, 96), seed=10, dtype=torch.bfloat16)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(K, "_ROUTE_KEY32", on)
        counts = _counts(16, 11)
        w, ids = K.router_route(x, router, 4, True, shared=True, counts=counts, fused=True)
        outs.append((w, ids, counts.counts, counts.host_reads))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
