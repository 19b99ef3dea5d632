"""Fused MoE decode kernels (002 §3.3) against their PyTorch references and the model's SparseMoE.

Without CUDA the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported): tiny
shapes, few cases, since the interpreter runs every program in Python. With CUDA the same tests run natively, and the
`gpu` test checks the real shapes, the absence of host syncs and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels.moe_ref import fused_moe_ref, route_ref  # noqa: E402
from stage_worker.model.moe import SparseMoE  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
E, TOP_K = 16, 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts(h: int, i: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    w13 = torch.randn(E, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(E, h, i, generator=g) / i ** 0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert _rel(out, ref) < 2e-2


def test_triton_path_is_taken():
    assert K.triton_usable(torch.empty(1, device=DEV))


@pytest.mark.parametrize("t,e,renormalise,dtype", [(1, 16, True, torch.float32), (3, 16, False, torch.float32),
                                                    (8, 20, True, torch.float32), (8, 16, False, torch.bfloat16)])
def test_route_matches_ref(t, e, renormalise, dtype):
    logits = torch.randn(t, e, generator=_gen(t * 100 + e)).to(DEV, dtype)
    w, ids = K.route(logits, TOP_K, renormalise)
    w_ref, ids_ref = route_ref(logits, TOP_K, renormalise)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)
    if renormalise:
        torch.testing.assert_close(w.sum(-1), torch.ones(t, device=DEV), rtol=0, atol=1e-6)


@pytest.mark.parametrize("renormalise", [True, False])
def test_route_ties_go_to_lower_id(renormalise):
    logits = torch.randn(3, E, generator=_gen(7)).clamp(-2, 2)
    logits[0] = 0.0
    logits[0, 0::2] = -0.0                                    # -0.0 == +0.0: a tie too
    logits[1, 9] = logits[1, 3] = 5.0                         # tie for first place
    logits[2, 14], logits[2, 1] = 6.0, 5.0                    # two clear winners, then three equal for two slots
    logits[2, 11] = logits[2, 2] = logits[2, 7] = 4.0
    w, ids = K.route(logits.to(DEV), TOP_K, renormalise)
    w_ref, ids_ref = route_ref(logits.to(DEV), TOP_K, renormalise)
    assert ids.tolist() == ids_ref.tolist()
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1, :2].tolist() == [3, 9]
    assert ids[2].tolist() == [14, 1, 2, 7]
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("t,h,i,dtype", [(1, 64, 32, torch.float32), (3, 48, 24, torch.float32),
                                         (8, 64, 32, torch.bfloat16), (3, 48, 24, torch.bfloat16)])
def test_fused_moe_matches_ref(t, h, i, dtype):
    w13, w2 = _experts(h, i, dtype, seed=t + h)
    g = _gen(t * h)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    weights, ids = route_ref(torch.randn(t, E, generator=g).to(DEV), TOP_K, True)
    weights = weights.to(dtype)
    ref = fused_moe_ref(x, ids, weights, w13, w2)
    _check(K.fused_moe(x, ids, weights, w13, w2), ref)
    _check(K.grouped_moe(x, ids, weights, w13, w2), ref)


def test_prefill_takes_grouped_path():
    t = K.DECODE_MAX_TK // TOP_K + 5
    w13, w2 = _experts(48, 24, torch.float32, seed=3)
    g = _gen(4)
    x = torch.randn(t, 48, generator=g).to(DEV)
    weights, ids = route_ref(torch.randn(t, E, generator=g).to(DEV), TOP_K, False)
    _check(K.fused_moe(x, ids, weights, w13, w2), fused_moe_ref(x, ids, weights, w13, w2))


@pytest.mark.parametrize("dtype,renormalise", [(torch.float32, True), (torch.bfloat16, False)])
def test_moe_forward_matches_sparse_moe(dtype, renormalise):
    torch.manual_seed(11)
    m = SparseMoE(48, 24, E, TOP_K, shared_intermediate=0, renormalise=renormalise)
    with torch.no_grad():
        m.w13.normal_(0, 48 ** -0.5)
        m.w2.normal_(0, 24 ** -0.5)
    m = m.to(DEV, dtype)
    x = torch.randn(3, 48, generator=_gen(12)).to(DEV, dtype)
    with torch.no_grad():
        want = m(x)   # the PyTorch path: kernel flags off
        out, ids = K.moe_forward(x, m.gate.weight, m.w13, m.w2, TOP_K, renormalise)
    assert ids.tolist() == m.last_expert_ids.tolist()
    _check(out, want)


def test_unselected_expert_is_never_read():
    t, h, i = 3, 48, 24
    w13, w2 = _experts(h, i, torch.float32, seed=5)
    unused = [0, 6, E - 1]
    w13[unused] = float("nan")
    w2[unused] = float("nan")
    g = _gen(6)
    logits = torch.randn(t, E, generator=g)
    logits[:, unused] = -1e4
    weights, ids = K.route(logits.to(DEV), TOP_K, True)
    assert not set(ids.flatten().tolist()) & set(unused)
    x = torch.randn(t, h, generator=g).to(DEV)
    out = K.fused_moe(x, ids, weights, w13, w2)
    assert torch.isfinite(out).all()
    _check(out, fused_moe_ref(x, ids, weights, w13, w2))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
def test_real_shapes_on_gpu(t):
    h, i, e, k = 2560, 640, 512, 10
    g = torch.Generator(device="cuda").manual_seed(t)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).bfloat16()
    gate = (torch.randn(e, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    logits = torch.nn.functional.linear(x, gate)

    w, ids = K.route(logits, k, True)
    w_ref, ids_ref = route_ref(logits, k, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)
    ref = fused_moe_ref(x, ids_ref, w_ref.bfloat16(), w13, w2)
    assert _rel(K.fused_moe(x, ids, w.bfloat16(), w13, w2), ref) < 2e-2

    out, _ = K.moe_forward(x, gate, w13, w2, k, True)          # compile before the sync check and the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")                     # any host sync on the decode path raises
    try:
        out, ids2 = K.moe_forward(x, gate, w13, w2, k, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(ids2, ids)
    assert _rel(out, ref) < 2e-2

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _ = K.moe_forward(x, gate, w13, w2, k, True)
    x.copy_(torch.randn(t, h, device="cuda", generator=g).bfloat16())
    graph.replay()
    want, _ = K.moe_forward(x, gate, w13, w2, k, True)
    assert _rel(g_out, want) < 1e-3                             # the replay computed the new input


def _shared(h: int, i: int, dtype: torch.dtype, seed: int) -> "K.SharedExpert":
    g = _gen(seed)
    return K.SharedExpert((torch.randn(2 * i, h, generator=g) / h ** 0.5).to(DEV, dtype),
                          (torch.randn(h, i, generator=g) / i ** 0.5).to(DEV, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_with_shared_slot(dtype):
    logits = torch.randn(5, E + 1, generator=_gen(21)).to(DEV, dtype)
    w, ids = K.route(logits, TOP_K, True, shared=True)
    w_ref, ids_ref = route_ref(logits[:, :E], TOP_K, True)
    assert w.shape == (5, TOP_K + 1) and ids.shape == (5, TOP_K + 1)
    assert torch.equal(ids[:, :TOP_K], ids_ref) and (ids[:, TOP_K] == -1).all()
    torch.testing.assert_close(w[:, :TOP_K], w_ref, rtol=0, atol=1e-6)
    want = torch.sigmoid(logits[:, E]).float()          # rounded to the logits' dtype, as SparseMoE's sigmoid
    torch.testing.assert_close(w[:, TOP_K], want, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_fused_moe_with_shared_expert_matches_ref(t, dtype):
    h, i = 48, 24
    w13, w2 = _experts(h, i, dtype, seed=31 + t)
    shared = _shared(h, i, dtype, seed=32 + t)
    g = _gen(33 + t)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    weights, ids = K.route(torch.randn(t, E + 1, generator=g).to(DEV), TOP_K, False, shared=True)
    weights = weights.to(dtype)
    ref = fused_moe_ref(x, ids, weights, w13, w2, shared)
    _check(K.fused_moe(x, ids, weights, w13, w2, shared), ref)
    _check(K.grouped_moe(x, ids, weights, w13, w2, shared), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_fused_matches_sparse_moe(dtype):
    """prepare_kernels lays the shared expert out as views (state dict unchanged) and the fused path with the
    shared slot equals SparseMoE's PyTorch path (routed experts plus the sigmoid-gated shared SwiGLU)."""
    torch.manual_seed(13)
    m = SparseMoE(48, 24, E, TOP_K, shared_intermediate=24, renormalise=True)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 48 ** -0.5)
    m = m.to(DEV, dtype)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.prepare_kernels()
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    router, shared = m._fused_shared()
    assert router.data_ptr() == m.gate.weight.data_ptr() and shared.w13.data_ptr() == m.shared_expert.gate_proj.weight.data_ptr()
    x = torch.randn(3, 48, generator=_gen(14)).to(DEV, dtype)
    with torch.no_grad():
        want = m(x) if not CUDA else None
        if CUDA:       # the module itself would take the kernels: compute its PyTorch path by hand
            m.kernels = type(m.kernels)()
            want = m(x)
        out, ids = K.moe_forward(x, router, m.w13, m.w2, TOP_K, True, shared)
    assert ids.tolist() == m.last_expert_ids.tolist()
    _check(out, want)
    m.gate.weight = torch.nn.Parameter(m.gate.weight.detach().clone())   # rebinding un-fuses: no stale copy used
    assert m._fused_shared() is None


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
def test_shared_slot_real_shapes_on_gpu(t):
    h, i, e, k = 2560, 640, 512, 10
    g = torch.Generator(device="cuda").manual_seed(100 + t)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).bfloat16()
    router = (torch.randn(e + 1, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    shared = K.SharedExpert((torch.randn(2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16(),
                            (torch.randn(h, i, device="cuda", generator=g) / i ** 0.5).bfloat16())
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w, ids = K.route(torch.nn.functional.linear(x, router), k, True, shared=True)
    ref = fused_moe_ref(x, ids, w.bfloat16(), w13, w2, shared)
    out, _ = K.moe_forward(x, router, w13, w2, k, True, shared)
    assert _rel(out, ref) < 2e-2
    assert _rel(K.grouped_moe(x, ids, w.bfloat16(), w13, w2, shared), ref) < 2e-2


def test_graph_padding_rows_route_to_no_expert_and_read_none():
    """`valid` (a CUDA graph's real rows): padding rows get SKIP ids and weight 0, are not counted, and the expert
    kernels never read the experts their logits would pick (NaN rows here); the real rows are unchanged."""
    from stage_worker.kernels.moe_ref import RouteCounts

    t, h, i, real = 5, 48, 24, 3
    w13, w2 = _experts(h, i, torch.float32, seed=8)
    poisoned = [2, 9]
    w13[poisoned] = float("nan")
    w2[poisoned] = float("nan")
    g = _gen(9)
    logits = torch.randn(t, E, generator=g)
    logits[:real, poisoned] = -1e4                             # real rows never pick them...
    logits[real:, poisoned] = 1e4                              # ...padding rows would
    valid = torch.tensor([real], dtype=torch.int32, device=DEV)
    counts = RouteCounts(torch.zeros(E, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), E - 4)
    w, ids = K.route(logits.to(DEV), TOP_K, True, counts=counts, valid=valid)
    w_ref, ids_ref = route_ref(logits[:real].to(DEV), TOP_K, True)
    assert torch.equal(ids[:real], ids_ref) and (ids[real:] == K.SKIP).all() and (w[real:] == 0).all()
    assert counts.counts.sum().item() == real * TOP_K
    x = torch.randn(t, h, generator=g).to(DEV)
    out = K.fused_moe(x, ids, w, w13, w2)
    assert torch.isfinite(out).all()
    _check(out[:real], fused_moe_ref(x[:real], ids_ref, w_ref, w13, w2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_key32_ranks_as_the_int64_keys(dtype, monkeypatch):
    """Kernel flag `route_key32`: bf16 logits ranked by int32 keys (the value's order in the high half, the id in
    the low) pick the same ids in the same order with the same weights and counts as the int64 keys, through ties
    (to the lower id), +0/-0, -inf, negatives, the shared slot, a slot map and padding rows. fp16 logits keep the
    int64 keys (their fp32 has only 13 low bits zero: truncating to 16 changed the weights)."""
    from stage_worker.kernels.moe_ref import RouteCounts

    e = 20
    logits = torch.randn(6, e + 1, generator=_gen(31)).mul(4)
    logits[0, :e] = 0.0
    logits[0, 1:e:3] = -0.0
    logits[1, 5] = logits[1, 2] = logits[1, 17] = 50.0          # a three-way tie for first place
    logits[2, :e] = -1.5
    logits[2, 7] = float("-inf")
    logits[3, :e] = -torch.arange(e, dtype=torch.float32)      # all negative, distinct
    logits[4, 12] = 1e4
    logits = logits.to(DEV, dtype)
    slot_map = torch.randperm(e, generator=_gen(5)).to(DEV, torch.int32)
    valid = torch.tensor([5], dtype=torch.int32, device=DEV)   # the last row is padding
    outs = []
    for on in (False, True):
        monkeypatch.setattr(K, "_ROUTE_KEY32", on)
        assert K._key32(logits, e) is (on and dtype == torch.bfloat16)   # fp16: 13 low bits only, int64 keys
        counts = RouteCounts(torch.zeros(e, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), e - 6)
        w, ids = K.route(logits, TOP_K, True, shared=True, counts=counts, valid=valid, slot_map=slot_map)
        plain = K.route(logits[:, :e].contiguous(), TOP_K, False)
        outs.append((w, ids, counts.counts.clone(), counts.host_reads.clone(), *plain))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    ids_ref = route_ref(logits[:, :e], TOP_K, False)[1]
    assert torch.equal(outs[1][5], ids_ref)
    assert outs[1][5][1, :3].tolist() == [2, 5, 17]
