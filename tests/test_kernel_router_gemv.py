"""The router GEMV and the router in one launch (stage_worker/kernels/router_gemv.py) against `F.linear` and
`moe.route` / `route_ref` on the kernel's own logits. Without CUDA the kernel runs under TRITON_INTERPRET=1 (tests/
conftest.py turns it on): tiny shapes, a launch config of few programs (each costs tens of ms there) but always
more than one, so the last-program protocol routes what the others stored. With CUDA, also the full shape (513 x
2560, top-10) against cuBLAS + `route`, in a CUDA graph, timed against the two launches (`-m gpu`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels import router_gemv as RG  # noqa: E402
from stage_worker.kernels.moe_ref import RouteCounts, route_ref  # noqa: E402
from stage_worker.kernels.split_reduce import split_locks  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _counts(e: int, first: int) -> RouteCounts:
    return RouteCounts(torch.zeros(e, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), first)


def _case(t: int, e: int, h: int, shared: bool, seed: int, tie: tuple[int, int] | None):
    """x [t, h], router [e (+1), h] in float32; with `tie` (a, b) rows a and b are equal and point along token 0,
    so their logits tie exactly and top token 0's list."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w = torch.randn(e + int(shared), h, generator=g) / h ** 0.5
    if tie is not None:
        a, b = tie
        w[a] = w[b] = 3 * x[0] / x[0].norm()
    return x.to(DEV), w.to(DEV)


# (T, E, H, top_k, shared, count, valid rows (None: no VALID), renormalise, tie, cfg: BLOCK_N, BLOCK_H, warps,
# ROUTE_ROWS): every case spans 2-3 programs and several H tiles; ROUTE_ROWS 2 at T = 3 leaves a row past T
CASES = [
    (1, 16, 64, 2, False, False, None, True, (9, 4), (8, 32, 4, 1)),
    (3, 64, 128, 4, True, True, 2, False, (40, 7), (32, 64, 4, 2)),
    (4, 16, 256, 3, True, True, None, True, None, (8, 128, 4, 4)),
    (4, 64, 96, 4, False, True, 3, True, (63, 0), (32, 32, 4, 4)),
]


@pytest.mark.parametrize("t,e,h,k,shared,count,real,renorm,tie,cfg", CASES)
def test_one_launch_routes_its_own_logits_as_route_does(t, e, h, k, shared, count, real, renorm, tie, cfg):
    x, w = _case(t, e, h, shared, seed=t * 1000 + e + h, tie=tie)
    first = e - 4                                                  # the last 4 slots count as host reads
    counts = _counts(e, first) if count else None
    valid = None if real is None else torch.tensor([real], dtype=torch.int32, device=DEV)
    assert RG.fused_usable(x, w, k, shared)
    wts, ids, logits = RG.router_route(x, w, k, renorm, shared=shared, counts=counts, valid=valid, cfg=cfg)
    assert not split_locks(x.device).any()                         # the counter is back at 0 for the next launch
    assert logits.shape == (t, e + int(shared)) and logits.dtype == x.dtype
    torch.testing.assert_close(logits, F.linear(x, w), rtol=1e-5, atol=1e-5)
    if tie is not None:
        a, b = tie
        assert torch.equal(logits[:, a], logits[:, b])             # equal rows: equal logits, bit for bit
        assert ids[0, :2].tolist() == [min(a, b), max(a, b)]       # ties to the lower id

    want_counts = _counts(e, first) if count else None
    w2, ids2 = K.route(logits, k, renorm, shared=shared, counts=want_counts, valid=valid)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(wts, w2, rtol=0, atol=1e-6)
    n = t if real is None else real
    w_ref, ids_ref = route_ref(logits[:n, :e], k, renorm)
    assert torch.equal(ids[:n, :k], ids_ref)
    torch.testing.assert_close(wts[:n, :k], w_ref, rtol=0, atol=1e-6)
    if real is not None:
        assert (ids[real:, :k] == K.SKIP).all() and (wts[real:, :k] == 0).all()
    if shared:
        assert (ids[:, k] == -1).all()
        torch.testing.assert_close(wts[:, k], torch.sigmoid(logits[:, e]), rtol=0, atol=1e-6)
    if count:
        assert torch.equal(counts.counts, want_counts.counts)
        assert torch.equal(counts.host_reads, want_counts.host_reads)
        assert counts.counts.sum().item() == n * k


def test_shapes_the_launch_cannot_take_take_the_two_launches():
    x, w = _case(17, 16, 64, True, seed=3, tie=None)
    assert not RG.fused_usable(x, w, 2, True)                      # more than FUSED_MAX_T tokens
    assert not RG.fused_usable(x[:4], w.double(), 2, True)          # another dtype than x
    assert not RG.fused_usable(x[:4], w.t().contiguous().t(), 2, True)   # rows not contiguous
    assert not RG.fused_usable(x[:4], w, 17, True)                 # top_k > E
    assert not RG.fused_usable(x[:0], w, 2, True)
    wts, ids, logits = RG.router_route(x, w, 2, True, shared=True)
    w2, ids2 = K.route(F.linear(x, w), 2, True, shared=True)
    assert torch.equal(logits, F.linear(x, w)) and torch.equal(ids, ids2) and torch.equal(wts, w2)


def test_switch_is_read_from_the_environment_and_off_by_default():
    from stage_worker.kernels.flags import NAMES

    assert RG.ROUTER_FUSED == (os.environ.get("MOEPIPE_ROUTER_FUSED") == "1")
    assert not any("router" in n for n in NAMES)                   # not a `kernels` item: `all` leaves it off


def _packed_layer():
    """A tiny SparseMoE with INT4 experts and a bf16-kernel shared expert, laid out for `_packed_decode`."""
    from stage_worker.model.moe import SparseMoE

    torch.manual_seed(0)
    E, H, I = 8, 64, 32
    moe = SparseMoE(H, I, E, 2, I, renormalise=True)
    moe.use_packed(32, 32)
    g = torch.Generator().manual_seed(1)
    for name in ("q13", "q2"):
        buf = getattr(moe, name)
        buf.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, buf.shape, generator=g, dtype=torch.int64).to(torch.int32))
    moe.s13.copy_(torch.rand(moe.s13.shape, generator=g) * 0.02)
    moe.s2.copy_(torch.rand(moe.s2.shape, generator=g) * 0.02)
    moe.to(DEV)
    moe.prepare_kernels()                          # after the move: `.to` would rebind the fused views
    assert moe._packed_router() is not None and moe._packed_shared() is not None
    return moe, H


def test_the_int4_layer_takes_the_one_launch_under_the_switch(monkeypatch):
    """`SparseMoE._packed_decode` with MOEPIPE_ROUTER_FUSED on calls the one launch ([E + 1, H] router, the shared
    slot) and gives the output and ids of the two launches. The routed INT4 pair is its PyTorch reference here
    (the interpreter takes seconds over it; tests/test_kernel_moe_int4.py checks it): the router's slots and the
    shared output are what this test is about."""
    from stage_worker.kernels.moe_int4_ref import fused_moe_int4_ref

    moe, H = _packed_layer()
    monkeypatch.setattr(moe, "_routed_decode", lambda x2, ids, w, add=None:
                        fused_moe_int4_ref(x2, ids, w, moe.packed()) + add)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(2)).to(DEV)
    with torch.inference_mode():
        off = moe._packed_decode(x, None)
        ids_off = moe.last_expert_ids.clone()
        calls = []
        real = RG.router_route

        def spy(x2, router, *a, **kw):
            calls.append(RG.fused_usable(x2, router, a[0], kw.get("shared", False)))
            return real(x2, router, *a, **kw)

        monkeypatch.setattr(RG, "ROUTER_FUSED", True)
        monkeypatch.setattr(RG, "router_route", spy)
        on = moe._packed_decode(x, None)
    assert calls == [True]
    assert torch.equal(moe.last_expert_ids, ids_off)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(CUDA, reason="the GPU tests compile natively")
def test_compiles_for_sm90_without_spills():
    """Triton compiles the one launch for sm_90 without a GPU (a subprocess: the interpreter is off there) at the
    full shape, one token and four (the shared column, COUNT and VALID on; then off), and the refactored router
    kernel; no register spills."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import moe as K
from stage_worker.kernels import router_gemv as RG

def fused(t, shared, on):
    bn, bh, warps, rr = RG.CFG[RG._bucket(t)]
    tp = triton.next_power_of_2(t)
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i32",
               counts_ptr="*fp32", reads_ptr="*i64", valid_ptr="*i32", lock_ptr="*i32", T="i32", N="i32", E="i32",
               stride_xt="i32", stride_wn="i32", stride_lt="i32", FIRST_HOST="i32")
    const = dict(H=2560, TP=tp, BLOCK_N=bn, BLOCK_H=bh, NPROG=triton.cdiv(512 + shared, bn),
                 ROUTE_ROWS=min(rr, tp), TOP_K=10, SHARED=shared, RENORM=True, BLOCK_E=512, BLOCK_K=16, COUNT=on,
                 VALID=on)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(RG._router_gemv_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    return dict(kernel="router_gemv", t=t, shared=shared, **ptxas_info(k.asm["ptx"]))

def route():
    sig = dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i32", counts_ptr="*fp32", reads_ptr="*i64",
               valid_ptr="*i32", E="i32", stride_t="i32", FIRST_HOST="i32")
    const = dict(TOP_K=10, SHARED=1, RENORM=True, BLOCK_E=512, BLOCK_K=16, COUNT=True, VALID=True)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(K._route_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=K.NUM_WARPS))
    return dict(kernel="route", **ptxas_info(k.asm["ptx"]))

print(json.dumps([route(), fused(1, 1, True), fused(4, 0, False)]))
"""
    got = run_compile_script(script, timeout=300)
    print("\n" + "\n".join(map(str, got)))
    assert len(got) == 3 and all(c["spill"] == 0 for c in got), got


def _ulp_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within one bf16 rounding of either (the kernel's fp32 sums run in another order than cuBLAS's)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2 ** -7 + 1e-6).all())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("shared", [True, False])
def test_full_shape_against_cublas_and_route_timed_in_a_graph(t, shared):
    """E 512 (+1: the shared gate), H 2560, top-10, bf16 (the full-shape preset): the one launch's logits within a
    bf16 rounding of cuBLAS's, its ids and weights those of `route` on its own logits exactly, and those of cuBLAS +
    `route` except where logits tie within bf16 rounding (checked on the logits then); replayed from a CUDA graph
    with counts and padding rows (the counter back at 0 after each replay); then timed against the two launches
    (F.linear + route), both in a CUDA graph, printed in microseconds."""
    from conftest import cuda_us, graph_us

    e, h, k = 512, 2560, 10
    g = torch.Generator(device="cuda").manual_seed(t + 10 * shared)
    w = (torch.randn(e + int(shared), h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    assert RG.fused_usable(x, w, k, shared)
    wts, ids, logits = RG.router_route(x, w, k, True, shared=shared)
    ref = F.linear(x, w)
    assert _ulp_close(logits, ref)
    w2, ids2 = K.route(logits, k, True, shared=shared)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(wts, w2, rtol=0, atol=1e-6)
    w_cu, ids_cu = K.route(ref, k, True, shared=shared)
    for r in range(t):
        if not torch.equal(ids[r], ids_cu[r]):                     # a tie within bf16 rounding moved a pick
            got, want = ref[r, ids[r, :k].long()].float(), ref[r, ids_cu[r, :k].long()].float()
            assert _ulp_close(got.sort().values, want.sort().values), r
        else:
            torch.testing.assert_close(wts[r], w_cu[r], rtol=0, atol=2e-2)

    real = max(1, t - 1)
    valid = torch.tensor([real], dtype=torch.int32, device="cuda")
    counts = _counts(e, e - 64)
    RG.router_route(x, w, k, True, shared=shared, counts=counts, valid=valid)      # compile outside the capture
    torch.cuda.synchronize()
    counts.counts.zero_()
    counts.host_reads.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_w, g_ids, g_logits = RG.router_route(x, w, k, True, shared=shared, counts=counts, valid=valid)
    for rep in range(3):
        x.copy_(torch.randn(t, h, device="cuda", generator=g).bfloat16())
        before = (counts.counts.clone(), counts.host_reads.clone())
        graph.replay()
        torch.cuda.synchronize()
        assert not split_locks(x.device).any(), rep
        want_counts = _counts(e, e - 64)
        w3, ids3 = K.route(g_logits, k, True, shared=shared, counts=want_counts, valid=valid)
        assert torch.equal(g_ids, ids3), rep
        torch.testing.assert_close(g_w, w3, rtol=0, atol=1e-6)
        assert _ulp_close(g_logits, F.linear(x, w)), rep
        assert torch.equal(counts.counts - before[0], want_counts.counts), rep
        assert torch.equal(counts.host_reads - before[1], want_counts.host_reads), rep
        assert counts.counts.sum().item() == (rep + 1) * real * k

    def two():
        return K.route(F.linear(x, w), k, True, shared=shared, counts=counts, valid=valid)

    def one():
        return RG.router_route(x, w, k, True, shared=shared, counts=counts, valid=valid)

    print(f"\nrouter E={e}{'+1' if shared else ''} H={h} k={k} T={t:2d}: one launch {graph_us(lambda i: one()):6.2f} us "
          f"graph / {cuda_us(one):6.2f} eager | F.linear + route {graph_us(lambda i: two()):6.2f} us graph / "
          f"{cuda_us(two):6.2f} eager (cfg {RG.CFG[RG._bucket(t)]})")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_sweep_launch_configs_on_the_gpu():
    """Graph-replayed microseconds of the one launch over a grid of (BLOCK_N, BLOCK_H, warps, ROUTE_ROWS) at the
    full shape with the shared column, T = 1, 4, 16, beside the two launches: what CFG should hold (each config's
    ids those of `route` on its own logits; configs whose fp32 accumulator would take more than 128 registers a
    thread are left out)."""
    from conftest import graph_us

    e, h, k = 512, 2560, 10
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(e + 1, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    print()
    for t in (1, 4, 16):
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        two = graph_us(lambda i: K.route(F.linear(x, w), k, True, shared=True))
        rows = []
        for bn in (2, 4, 8):
            for bh in (128, 256, 512):
                for warps in (4, 8):
                    for rr in sorted({min(4, t), t}):
                        if t * bn * bh > 128 * 32 * warps:
                            continue
                        cfg = (bn, bh, warps, rr)
                        wts, ids, logits = RG.router_route(x, w, k, True, shared=True, cfg=cfg)
                        assert torch.equal(ids, K.route(logits, k, True, shared=True)[1]), cfg
                        rows.append((graph_us(lambda i: RG.router_route(x, w, k, True, shared=True, cfg=cfg)), cfg))
        rows.sort()
        print(f"T={t:2d} two launches {two:6.2f} us; best: " +
              ", ".join(f"{us:6.2f} us {cfg}" for us, cfg in rows[:5]) + f"; worst {rows[-1][0]:6.2f} {rows[-1][1]}")
