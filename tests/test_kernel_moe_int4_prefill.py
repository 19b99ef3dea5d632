"""The grouped INT4 MoE prefill kernels (stage_worker/kernels/moe_int4_prefill.py) against their dequantize-then-
matmul reference and the per-expert loop they replace, with device and host slots mixed; the switch in SparseMoE on a
packed-INT4 model with cold experts (chunked prefill and greedy decode equal to the loop's). Without CUDA the kernels
run under TRITON_INTERPRET=1 (tests/conftest.py turns it on) on small shapes; with CUDA, also at the full shape."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from stage_worker.kernels import moe_int4_prefill as P  # noqa: E402
from stage_worker.kernels.moe_int4 import grouped_moe_int4  # noqa: E402
from stage_worker.kernels.moe_int4_ref import PackedExperts, fused_moe_int4_ref, pack_fp4, pack_int4  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _experts(E: int, H: int, I: int, g: int, g2: int, seed: int, dtype=torch.float32,
             asym: bool = False, fp4: bool = False) -> PackedExperts:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device=DEV) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen, device=DEV) / I ** 0.5).to(dtype)
    if fp4:                                          # E2M1 codes, float32 scales
        return PackedExperts(*pack_fp4(w13, g), *pack_fp4(w2, g2), g, g2, fp4=True)
    if asym:                                         # skewed weights: zero points far from the middle
        w13, w2 = w13 + w13.abs().mean(), w2 - w2.abs().mean()
    return PackedExperts(*pack_int4(w13, g, asym), *pack_int4(w2, g2, asym), g, g2)


def _split(ex: PackedExperts, hot: int) -> tuple[PackedExperts, PackedExperts]:
    """Slots [0, hot) on the device, the rest in (pinned, on a GPU) host memory, as an expert table holds them."""
    pin = (lambda a: a.cpu().pin_memory()) if CUDA else (lambda a: a.clone())
    parts = (ex.q13, ex.s13, ex.q2, ex.s2)
    return (PackedExperts(*(a[:hot].contiguous() for a in parts), ex.group, ex.group2, ex.fp4),
            PackedExperts(*(pin(a[hot:]) for a in parts), ex.group, ex.group2, ex.fp4))


def _routing(T: int, E: int, k: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids.to(DEV), w.to(DEV, dtype)


def _reference(x, ids, w, ex: PackedExperts) -> torch.Tensor:
    """fused_moe_int4_ref with the pairs of no expert (negative ids) weighted 0."""
    return fused_moe_int4_ref(x, ids.clamp_min(0), torch.where(ids < 0, 0, w), ex)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("g,g2,block_k,modes,asym", [
    (64, 16, 128, (1, 1), False),   # groups divide BLOCK_K: scale tiles; H 96 = 64 + a partial group of 32
    (32, 16, 16, (0, 0), False),    # BLOCK_K divides the groups: one scale a row a step, after the dot
    (24, 24, 32, (2, 2), False),    # neither: a scale per element (steps of 32 across groups of 24: half the steps
                                    # of 16, the same gathers); I 40 = 24 + a partial group of 16
    (64, 16, 128, (1, 1), True),    # each mode again with zero points
    (32, 16, 16, (0, 0), True),
    (24, 24, 32, (2, 2), True),
])
def test_kernel_matches_the_reference_with_host_slots_and_dropped_pairs(monkeypatch, g, g2, block_k, modes, asym):
    """21 tokens (not a multiple of any block), top-3 of 12 experts, slots 7.. in host memory, a few pairs of no
    expert (negative ids: SKIP and -1); every scale mode, groups that do not divide H or I, symmetric and
    asymmetric; once also without host slots."""
    E, H, I, k, T, hot = 12, 96, 40, 3, 21, 7
    monkeypatch.setattr(P, "CFG", {key: (32, block_k, 4, 2) for key in P.CFG})
    bk_up, bk_down = (min(P.CFG[kind][1], max(16, 1 << (n - 1).bit_length()))
                      for kind, n in ((("dev", "up"), H), (("dev", "down"), I)))
    assert (P.scale_mode(g, bk_up), P.scale_mode(g2, bk_down)) == modes
    ex = _experts(E, H, I, g, g2, seed=g + g2, asym=asym)
    ids, w = _routing(T, E, k, seed=g)
    ids[3, 1] = -2
    ids[10, :] = -1
    ids[20, 0] = -2
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DEV)
    ref = _reference(x, ids, w, ex)
    dev, host = _split(ex, hot)
    out = P.grouped_moe_int4_triton(x, ids, w, dev, host, hot)
    assert out.shape == ref.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[10], torch.zeros_like(out[10]))
    if modes == (1, 1):
        torch.testing.assert_close(P.grouped_moe_int4_triton(x, ids, w, ex), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("g,g2,block_k,modes", [
    (16, 16, 64, (1, 1)),           # NVFP4's groups in scale tiles; I 40 = 2 groups + a partial one of 8
    (32, 16, 16, (0, 0)),           # MXFP4's / NVFP4's, one scale a row a step
    (24, 24, 32, (2, 2)),           # not an FP4 format's group, but the per-element gather takes it
])
def test_fp4_kernel_matches_the_reference(monkeypatch, g, g2, block_k, modes):
    """FP4 experts (E2M1 codes, float32 scales) through the same kernels: each scale mode, host slots, dropped
    pairs, float32."""
    E, H, I, k, T, hot = 12, 96, 40, 3, 21, 7
    monkeypatch.setattr(P, "CFG", {key: (32, block_k, 4, 2) for key in P.CFG})
    ex = _experts(E, H, I, g, g2, seed=g + g2 + 1, fp4=True)
    ids, w = _routing(T, E, k, seed=g)
    ids[3, 1] = -2
    ids[10, :] = -1
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DEV)
    ref = _reference(x, ids, w, ex)
    dev, host = _split(ex, hot)
    out = P.grouped_moe_int4_triton(x, ids, w, dev, host, hot)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[10], torch.zeros_like(out[10]))
    if modes == (1, 1):
        torch.testing.assert_close(P.grouped_moe_int4_triton(x, ids, w, ex), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,g,g2,mode,hots,asym", [
    (torch.bfloat16, 64, 32, 0, (0, 3), False),  # one scale a step: the tile built from the bits of 128.0 (no
                                                 # int-to-float)
    (torch.float16, 64, 32, 0, (3,), False),     # the same from 1024.0
    (torch.bfloat16, 32, 16, 1, (3, 8), False),  # scale tiles
    (torch.bfloat16, 64, 32, 0, (3,), True),     # zero points taken off with the row sums
    (torch.float16, 32, 16, 1, (3,), True),      # zero points in the tile
    (torch.bfloat16, 64, 32, 0, (3,), "fp4"),    # FP4: no MAGIC tile, the codes' values then the scale
    (torch.float16, 16, 16, 1, (3,), "fp4"),     # FP4 in scale tiles
])
def test_half_precision_and_all_slots_in_host_memory(dtype, g, g2, mode, hots, asym):
    """bf16 / fp16 activations and scales (the serving dtypes) within their rounding of the reference and of the
    per-expert loop (2e-2 on the CPU: the interpreter rounds fp32 to bf16 by truncation, twice the GPU's error);
    a split table (both launch kinds) in every case, a table whose slots are all in host memory (no device slot)
    and one with no host slot once each (which launches run does not depend on the dtype); asymmetric too."""
    E, H, I, k, T = 8, 64, 32, 2, 20
    assert P.scale_mode(g, min(P.CFG["dev", "up"][1], H)) == P.scale_mode(g2, min(P.CFG["dev", "down"][1], I)) == mode
    ex = _experts(E, H, I, g, g2, seed=4, dtype=dtype, asym=asym is True, fp4=asym == "fp4")
    ids, w = _routing(T, E, k, seed=2, dtype=dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    ref = _reference(x, ids, w, ex)
    loop = grouped_moe_int4(x, ids, w, ex)
    tol = 1e-2 if CUDA or dtype == torch.float16 else 2e-2
    for hot in hots:
        dev, host = _split(ex, hot)
        out = P.grouped_moe_int4_triton(x, ids, w, dev, host if hot < E else None, hot)
        assert out.dtype == dtype
        assert _rel(out, ref) < tol and _rel(out, loop) < tol


def test_empty_and_unrouted_chunks():
    ex = _experts(4, 64, 32, 64, 32, seed=0)
    x = torch.randn(5, 64).to(DEV)
    none = torch.full((5, 2), -1, dtype=torch.int32, device=DEV)
    assert torch.equal(P.grouped_moe_int4_triton(x, none, torch.ones(5, 2, device=DEV), ex), torch.zeros_like(x))
    empty = P.grouped_moe_int4_triton(x[:0], none[:0], torch.ones(0, 2, device=DEV), ex)
    assert empty.shape == (0, 64)
    with pytest.raises(ValueError, match="multiples of 8"):
        P.grouped_moe_int4_triton(torch.zeros(1, 60, device=DEV), none[:1], torch.ones(1, 2, device=DEV), ex)
    dev, host = _split(ex, 2)
    with pytest.raises(ValueError, match="do not continue"):
        P.grouped_moe_int4_triton(x, none, torch.ones(5, 2, device=DEV), dev, host, 3)


def test_align_range_blocks_one_slot_each_and_every_taken_pair_once():
    g = torch.Generator().manual_seed(3)
    T, k, E, lo, hi, bm = 50, 3, 10, 4, 9, 16
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[:20, 0] = 5                                        # slot 5: several blocks
    ids[7, :] = -2
    sorted_ids, block_slot = (a.cpu() for a in P.align_range(ids.to(DEV), lo, hi, bm))
    tk = ids.numel()
    flat = ids.reshape(-1)
    taken = ((flat >= lo) & (flat < hi)).nonzero().flatten()
    real = sorted_ids[sorted_ids < tk]
    assert sorted(real.tolist()) == taken.tolist()          # every pair of the range once, no other pair
    for b, s in enumerate(block_slot.tolist()):
        rows = sorted_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < tk].long()
        if s < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == lo + s).all())
    counts = torch.bincount(flat[taken].long() - lo, minlength=hi - lo)
    assert int((block_slot >= 0).sum()) == int(((counts + bm - 1) // bm).sum())


@pytest.mark.parametrize("T", [5, 44, 128, 300])
def test_each_host_slot_is_one_block_of_the_host_launch(T):
    """What makes a host expert cross PCIe once per chunk: in the host launch every present host slot is one block
    (the N tiles split its rows, so no byte of it is read twice), as long as at most 128 tokens picked it."""
    E, k, hot = 64, 8, 16
    ids, _ = _routing(T, E, k, seed=T)
    if T > 128:
        ids[:, 0] = E - 1                                    # picked by every token: ceil(T / 128) blocks
    bm = P.host_block_m(T)
    _, block_slot = P.align_range(ids, hot, E, bm)
    blocks = torch.bincount(block_slot[block_slot >= 0].long().cpu(), minlength=E - hot)
    present = torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)[hot:]
    want = torch.where(present > 0, (present + bm - 1) // bm, 0)
    assert torch.equal(blocks, want)
    assert int(blocks.max()) == (1 if T <= 128 else -(-T // 128))


def test_the_launch_configs_compile_for_the_h200():
    """Triton compiles the kernels for sm_90 without a GPU (a subprocess: the interpreter is off there), so what
    only the GPU compiler rejects shows here: the device launch at BLOCK_M 64 with no register spills, the host
    launch at BLOCK_M 128 (bf16, one scale a step, tiles built from 128.0's bits), and the fp16 / fp32 / per-element
    scale variants; shared memory within the H200's 227 KB a block."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import moe_int4_prefill as P

def build(dt, K, N, gated, group, bm, cfg, zcol=0, fp4=False):
    bn, bk, warps, stages = cfg
    mode = P.scale_mode(group, bk)
    magic, offset = P.MAGIC.get(dt, (0, 0.0)) if mode == 0 and not fp4 else (0, 0.0)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dt]
    sig = dict(a_ptr="*" + name, sorted_ptr="*i32", block_expert_ptr="*i32", q_ptr="*i32",
               s_ptr="*fp32" if fp4 else "*" + name,
               out_ptr="*" + name, stride_a="i32", stride_qe="i32", stride_qr="i32", stride_se="i32",
               stride_sr="i32", TK="i32")
    const = dict(K=K, N=N, ROW_DIV=10 if gated else 1, GATED=gated, GROUP=group, MODE=mode, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, MAGIC=magic, OFFSET=offset, INTERPRET=False, IEEE=dt == torch.float32, ZCOL=zcol,
                 FP4=fp4)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(P._int4_gemm_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    spill = ptxas_info(k.asm["ptx"])["spill"]
    return dict(shared=k.metadata.shared, spill=spill)

H, I = 2560, 640
print(json.dumps(dict(
    dev=build(torch.bfloat16, H, I, True, 128, 64, P.CFG["dev", "up"]),
    host=build(torch.bfloat16, I, H, False, 128, 128, P.CFG["host", "down"]),
    asym=build(torch.bfloat16, H, I, True, 128, 64, P.CFG["dev", "up"], zcol=H // 128),
    fp4=build(torch.bfloat16, H, I, True, 16, 64, P.CFG["dev", "up"], fp4=True),
    fp4_host=build(torch.bfloat16, I, H, False, 32, 128, P.CFG["host", "down"], fp4=True),
    others=[build(dt, 96, 40, True, g, 16, (32, 64, 4, 2)) for dt, g in
            ((torch.float16, 128), (torch.float32, 32), (torch.bfloat16, 24))])))
"""
    got = run_compile_script(script, timeout=300)
    assert got["dev"]["spill"] == got["asym"]["spill"] == got["fp4"]["spill"] == 0
    assert all(c["shared"] <= 227 * 1024 for c in [got["dev"], got["host"], got["asym"], got["fp4"], got["fp4_host"],
                                                   *got["others"]])


# ---- the switch in the model ---------------------------------------------------------------------------------

def test_chunked_prefill_of_packed_cold_experts_equals_the_loop(tiny_checkpoint, monkeypatch):
    """The tiny preset with dummy INT4 experts kept packed and half of every layer's experts in host memory: chunked
    prefill (5 + 3 tokens) and a greedy decode step with `moe_int4_prefill` on (the kernels, interpreted on the
    CPU) give the loop's logits (1e-4, float32) and tokens; the kernels ran for every MoE layer of every step."""
    from expert_tables import random_cold
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.local_engine import LocalEngine
    from stage_worker.model.moe import SparseMoE

    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32,
                                                    dummy_int4=dummy_groups(cfg),
                                                    cold_experts=random_cold(cfg, 0.5, seed=2)), cfg)
    tables = [m.table for m in model.moe_layers().values()]
    assert tables and all(t is not None and t.packed and 0 < t.hot < t.num_experts for t in tables)
    prompt = [(11 * i + 5) % 2000 + 7 for i in range(8)]
    calls = []
    real = P.grouped_moe_int4_triton
    monkeypatch.setattr(P, "grouped_moe_int4_triton", lambda *a: calls.append(a[4] is not None) or real(*a))
    monkeypatch.setattr(SparseMoE, "interpret_on_cpu", True)

    def run(flags: str):
        model.set_kernels(KernelFlags.parse(flags))
        eng = LocalEngine([model], max_seqs=2)
        eng.add(0)
        logits = [eng.step([(0, prompt[:5])]), eng.step([(0, prompt[5:])])]
        token = int(logits[-1][-1].argmax())
        logits.append(eng.step([(0, [token])]))
        return torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in logits]), [token, int(logits[-1][-1].argmax())]

    want, want_tokens = run("none")
    assert calls == []
    got, tokens = run("moe_int4_prefill")
    assert calls == [True] * (3 * len(tables))              # 3 steps x every MoE layer, host slots passed
    assert tokens == want_tokens
    assert (got - want).abs().max().item() < 1e-4


# ---- on the GPU --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("T,share", [(44, 0.78), (512, 0.0), (512, 0.78)])
def test_full_shape_against_the_reference_and_the_loop(T, share, asym=False, fp4=False):
    """The reports' shape (H 2560, I 640, 512 experts top-10, group 128, bf16) at prefill sizes (44 tokens: the
    4-stream TTFT prompts; a 512-token chunk), with `share` of the slots in pinned host memory: agreement with the
    reference and with the per-expert loop (`ExpertTable.moe_int4`, what the switch turns off), timed beside it.
    bench/moe_int4_prefill.py adds the PCIe bandwidth and the staged design's floor."""
    import sys

    from conftest import ROOT, cuda_us

    sys.path.insert(0, str(ROOT / "bench"))
    from moe_int4_prefill import table

    E, H, I, k = 512, 2560, 640, 10
    hot = E - round(E * share)
    g13 = 16 if fp4 else 128
    ex = _experts(E, H, I, g13, g13, seed=3, dtype=torch.bfloat16, asym=asym, fp4=fp4)
    t = table(ex, hot)
    dev, host = t.packed_experts()
    host = host if hot < E else None
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), dim=-1).bfloat16()
    out = P.grouped_moe_int4_triton(x, ids, w, dev, host, hot)
    ref = fused_moe_int4_ref(x[:64], ids[:64], w[:64], ex)        # the reference gathers [T, k, ...]: 64 rows
    assert _rel(out[:64], ref) < 1e-2
    loop = t.moe_int4(x, ids, w)
    assert _rel(out, loop) < 2e-2                                  # two bf16 paths, each ~0.5% off fp32
    kernel_us = cuda_us(lambda: P.grouped_moe_int4_triton(x, ids, w, dev, host, hot), warmup=2, reps=10)
    loop_us = cuda_us(lambda: t.moe_int4(x, ids, w), warmup=1, reps=3)
    n_host = int((torch.unique(ids) >= hot).sum())
    mb = n_host * ex.nbytes_per_expert() / 1e6
    print(f"\nT={T}, {share:.0%} of slots in host memory: grouped INT4 kernels {kernel_us:.0f} us, per-expert loop "
          f"{loop_us:.0f} us ({loop_us / kernel_us:.1f}x); {n_host} host experts, {mb:.0f} MB"
          + (f" = {mb / kernel_us * 1e3:.1f} GB/s over the kernels' time" if n_host else ""))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_full_shape_with_zero_points():
    """The same with asymmetric experts (zero points in the scale rows), a 512-token chunk, 78% in host memory."""
    test_full_shape_against_the_reference_and_the_loop(512, 0.78, asym=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("T,share", [(44, 0.0), (512, 0.78)])
def test_fp4_full_shape(T, share):
    """The same with FP4 experts in NVFP4's groups of 16 (E2M1 codes, float32 scales), with and without host
    slots."""
    test_full_shape_against_the_reference_and_the_loop(T, share, fp4=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_no_host_sync():
    """A chunk with host slots runs without the host waiting for the device (torch's sync debug mode raises on any
    read-back): the sort, the block layout and the launches are all queued."""
    E, H, I, k, T = 64, 256, 128, 8, 300
    ex = _experts(E, H, I, 128, 128, seed=1, dtype=torch.bfloat16)
    dev, host = _split(ex, 40)
    ids, w = _routing(T, E, k, seed=1, dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    want = P.grouped_moe_int4_triton(x, ids, w, dev, host, 40)         # compiled before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = P.grouped_moe_int4_triton(x, ids, w, dev, host, 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_chunked_prefill_with_cold_packed_experts_equals_the_loop(tiny_checkpoint, monkeypatch):
    """On the GPU with every kernel on: the tiny preset's dummy INT4 experts, half of each layer's in registered
    host memory, two 70-token chunks (x top-4 > the decode kernel's 256: the prefill path) and 8 greedy decode
    steps give the loop's greedy tokens and logits (float32: 1e-4) with `moe_int4_prefill` on and off."""
    from expert_tables import random_cold
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.local_engine import LocalEngine

    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, LoadOptions(device="cuda", load_format="dummy", dummy_int4=dummy_groups(cfg),
                                                    cold_experts=random_cold(cfg, 0.5, seed=3)), cfg)
    assert model.experts is not None and model.experts.host.pinned
    prompt = [(7 * i + 3) % 2000 + 10 for i in range(140)]
    calls = []
    real = P.grouped_moe_int4_triton
    monkeypatch.setattr(P, "grouped_moe_int4_triton", lambda *a: calls.append(1) or real(*a))

    def run(flags: str):
        model.set_kernels(KernelFlags.parse(flags))
        eng = LocalEngine([model], max_seqs=2)
        eng.add(0)
        logits = [eng.step([(0, prompt[:70])]), eng.step([(0, prompt[70:])])]
        tokens = []
        for _ in range(8):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(eng.step([(0, [tokens[-1]])]))
        return torch.cat([lg.reshape(-1, lg.shape[-1]).float() for lg in logits]), tokens

    want, want_tokens = run("all,-moe_int4_prefill")
    assert calls == []
    got, tokens = run("all")
    assert len(calls) == 2 * len(model.experts.tables)
    assert tokens == want_tokens
    assert (got - want).abs().max().item() < 1e-4
