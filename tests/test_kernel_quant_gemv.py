"""The W4/W6/W8A16 GEMVs over packed dense weights (stage_worker/kernels/quant_gemv.py) against their
dequantize-then-matmul reference, and the reference's packing against compressed-tensors' own and the loader's
reader. Without CUDA the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py turns it on); with CUDA, also at
the full shape's sizes, timed against cuBLAS on the bf16 weight, with a launch-config sweep."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from stage_worker.kernels import quant_gemv as Q  # noqa: E402
from stage_worker.kernels.quant_gemv_ref import (PackedWeight, dequantize_packed, pack_values,  # noqa: E402
                                                 quant_gemv_ref, quantize_rtn, swiglu_input, unpack_values)
from stage_worker.kernels.split_reduce import split_locks  # noqa: E402
from stage_worker.model import quant_weight as qw  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
SMALL = (64, 64, 4)                 # interpreter: one row block, two K tiles (each program costs ~40 ms there)


def _values(N: int, K: int, bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << bits - 1), 1 << bits - 1, (N, K), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_packing_is_the_librarys_and_the_loader_reads_it(bits):
    """pack_values' dense stream is compressed-tensors' pack_to_int32; both layouts unpack through the loader's
    reader (quant_weight.unpack) and unpack_values to the same values."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for K in (24, 40, 100, 130):
        q = _values(5, K, bits, K)
        dense = pack_values(q, bits, dense=True)
        assert torch.equal(dense, pack_to_int32(q.to(torch.int8), bits)), K
        layouts = [dense]
        if qw.legacy_words(K, bits) != qw.dense_words(K, bits):       # else the reader takes it as dense
            layouts.append(pack_values(q, bits, dense=False))
        for words in layouts:
            assert torch.equal(qw.unpack(words, bits, K).int(), q)
            assert torch.equal(unpack_values(words, bits, K).int(), q)


# (bits, dense): 4 and 8 bits place values alike in both layouts; 6 bits has the dense stream and the older
# 5-a-word layout
LAYOUTS = [(4, True), (6, True), (6, False), (8, True)]


@pytest.mark.parametrize("bits,dense", LAYOUTS)
def test_kernel_matches_the_reference(bits, dense):
    """T = 1 / 3 / 16 on the FMA path (one unpack a tile for every token, tokens past T masked at 3) and 4 / 16 on
    the tl.dot path (kernel flag quant_gemv_fma off), per-channel scales, groups of 32 (one scale a tile) and of 24
    (one gathered per value, 100 inputs: a last group of 4), 40 rows (a partial row block)."""
    N, K = 40, 100
    g = torch.Generator().manual_seed(bits)
    for group in (None, 32, 24):
        pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense)
        pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, pw.group)
        assert pw.dense == (dense or bits in (4, 8))
        for t, fma in ((1, True), (3, True), (16, True), (4, False), (16, False)):
            x = torch.randn(t, K, generator=g).to(DEV)
            out = Q.quant_gemv(x, pw, cfg=SMALL, fma=fma)
            torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4, msg=f"{group} {t} {fma}")


def test_half_precision_activations():
    """16-bit activations and scales (the GPU's case; fp16 here: the interpreter's bf16 dot is wrong) on both paths,
    the output in x.dtype."""
    N, K = 40, 100
    g = torch.Generator().manual_seed(11)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 6, 32, scale_dtype=torch.float16)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 6, K, 32)
    for t in (1, 4):
        x = torch.randn(t, K, generator=g).to(DEV, torch.float16)
        out = Q.quant_gemv(x, pw, cfg=SMALL)
        ref = quant_gemv_ref(x, pw)
        assert out.dtype == torch.float16
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3


@pytest.mark.parametrize("prefetch", [True, False])
def test_row_blocks_and_k_slices(monkeypatch, prefetch):
    """Several row blocks and K split into slices of two tiles each (fp32 partial sums added by the last
    program), with the next tile's words loading while one is computed (PREFETCH; not past a slice's end) or
    not, with the minimum slice lowered so a small K splits."""
    monkeypatch.setattr(Q, "MIN_SPLIT_K", 64)
    monkeypatch.setattr(Q, "PREFETCH", prefetch)
    N, K = 24, 256
    g = torch.Generator().manual_seed(3)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 6, 64)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 6, K, 64)
    for t in (1, 3):
        x = torch.randn(t, K, generator=g).to(DEV)
        c = Q.launch_config(t, N, K, 64, x.device, (8, 32, 4))
        assert c["splits"] == 4 and c["SCALE"] == 1 and c["K_SLICE"] == 2 * c["BLOCK_K"]
        out = Q.quant_gemv(x, pw, cfg=(8, 32, 4))
        torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4)
        # the slices are added in one launch by the last program of a row block, in a fixed order: the counters
        # are back at 0 and a second launch gives the same bits
        assert not split_locks(x.device).any()
        assert torch.equal(Q.quant_gemv(x, pw, cfg=(8, 32, 4)), out)


@pytest.mark.parametrize("t", [1, 3])
def test_the_swiglu_input_is_computed_as_it_loads(t):
    """`swiglu=w`: x holds a shared expert's gate and up outputs [T, 2K] and the kernel's input is
    silu(gate) * up * w[t] (`swiglu_input`), with w a strided column as the router writes it; 16-bit, 1 and 3
    tokens (FMA path)."""
    N, K = 48, 64
    g = torch.Generator().manual_seed(t)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 6, 32)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 6, K, 32)
    # fp16 under the interpreter: its float -> bf16 casts truncate (every output 1-2% small here), the GPU rounds
    gate_up = torch.randn(t, 2 * K, generator=g).to(DEV, torch.bfloat16 if CUDA else torch.float16)
    w = torch.rand(t, 3, generator=g).to(DEV)[:, 2]
    got = Q.quant_gemv(gate_up, pw, cfg=SMALL, swiglu=w)
    want = quant_gemv_ref(swiglu_input(gate_up, w), pw).float()
    assert ((got.float() - want).norm() / want.norm()).item() < 5e-3       # 16-bit outputs: an ulp apart at most
    assert ((got.float() - want).abs() <= want.abs() / 128 + 1e-2).all()
    with pytest.raises(ValueError, match="swiglu"):
        Q.quant_gemv(gate_up[:, :K], pw, swiglu=w)


def test_prefill_path_dequantizes_blocks_of_rows(monkeypatch):
    """More than DECODE_MAX_T tokens: blocks of rows dequantized as the loader would (the scales' dtype, then
    x.dtype) and multiplied; the same result whatever the block."""
    N, K = 37, 48
    pw = quantize_rtn(torch.randn(N, K, generator=torch.Generator().manual_seed(4)), 8, 16,
                      scale_dtype=torch.bfloat16)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 8, K, 16)
    x = torch.randn(20, K).to(DEV)
    whole = torch.nn.functional.linear(x, dequantize_packed(pw, x.dtype))
    parts = {"weight_packed": pw.words.cpu(), "weight_scale": pw.scales.cpu(), "weight_shape": torch.tensor([N, K])}
    from shared.quant_scheme import WeightQuant

    at_load = qw.dequantize(parts, WeightQuant(bits=8, kind="int", group_size=16), torch.float32)
    assert torch.equal(dequantize_packed(pw, torch.float32).cpu(), at_load)
    monkeypatch.setattr(Q, "CHUNK", 5 * K)
    torch.testing.assert_close(Q.quant_gemv(x, pw), whole, rtol=1e-5, atol=1e-5)


def test_shapes_the_kernel_cannot_take_are_refused():
    pw = quantize_rtn(torch.randn(8, 32), 8, None)
    with pytest.raises(ValueError, match="inputs"):
        Q.quant_gemv(torch.zeros(1, 30), pw)
    from shared.quant_scheme import QuantSchemeError

    with pytest.raises(QuantSchemeError, match="cannot hold"):
        PackedWeight(pw.words[:, :5], pw.scales, 8, 32, 32).check()


# The full shape (make_model's `full-shape` preset): name, (N, K), bits, group (None: per channel), dense.
# Kept packed by this step: o_proj, out_proj, the shared expert beside INT4 experts, lm_head; the others are the
# fused sites still dequantized at load (q/k/v + indexer rows, the DeltaNet in-projections, the hyper-connection
# mix), timed here for the next step.
FULL = [("o_proj int6", (2560, 6144), 6, 128, True), ("out_proj int6", (2560, 4096), 6, 128, True),
        ("out_proj int6 old layout", (2560, 4096), 6, 128, False), ("shared gate+up int6", (1280, 2560), 6, 128, True),
        ("shared down int6", (2560, 640), 6, 128, True), ("lm_head int8", (248320, 2560), 8, None, True),
        ("out_proj int4", (2560, 4096), 4, 128, True), ("out_proj int8", (2560, 4096), 8, None, True),
        ("qkv+indexer int6 (fused site)", (17536, 2560), 6, 128, True),
        ("deltanet in-proj int6 (fused site)", (12352, 2560), 6, 128, True),
        ("hc down int8 (fused site)", (320, 10240), 8, None, True), ("hc up int8 (fused site)", (10240, 320), 8, None,
                                                                     True)]
L2_SPAN = 256 << 20        # copies of a weight the timed calls cycle through, so no call reads it from L2


def _graph_us(fns) -> float:
    """Microseconds per call of `fns` (cycled) replayed from one CUDA graph (median of 5 replays)."""
    import statistics

    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    reps = max(20, len(fns))
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / reps)
    return statistics.median(times)


def _copies(N: int, K: int, bits: int, group, dense: bool) -> list[PackedWeight]:
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    pw = quantize_rtn(w, bits, group, dense=dense, scale_dtype=torch.bfloat16)
    n = max(1, min(16, L2_SPAN // pw.nbytes()))
    return [pw] + [PackedWeight(pw.words.clone(), pw.scales.clone(), bits, K, pw.group) for _ in range(n - 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_full_shape_on_the_gpu():
    """Agreement with the reference at the full shape's sizes in bf16 (relative error of the output), and the time
    of each against cuBLAS reading the same weight in bf16 (both from HBM: the calls cycle through copies that
    together exceed L2). Prints a table: us, TB/s of the packed bytes, and the time as a share of bf16's."""
    rows = []
    for name, (N, K), bits, group, dense in FULL:
        pws = _copies(N, K, bits, group, dense)
        bf = [dequantize_packed(p, torch.bfloat16) for p in pws[: max(1, min(len(pws), L2_SPAN // (N * K * 2)))]]
        for t in (1, 4, 16):
            x = torch.randn(t, K, device="cuda").to(torch.bfloat16)
            out = Q.quant_gemv(x, pws[0])
            ref = quant_gemv_ref(x, pws[0])
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, (name, t, err)
            graph = torch.cuda.CUDAGraph()            # K slices summed in one launch: replays give the same bits
            with torch.cuda.graph(graph):
                replayed = Q.quant_gemv(x, pws[0])
            for _ in range(2):
                replayed.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(replayed, out), (name, t)
            assert not split_locks(x.device).any()
            us = _graph_us([lambda p=p: Q.quant_gemv(x, p) for p in pws])
            us_bf16 = _graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf])
            rows.append((name, t, us, pws[0].nbytes() / us / 1e6, us_bf16, N * K * 2 / us_bf16 / 1e6, err))
        del pws, bf
        torch.cuda.empty_cache()
    print(f"\n{'weight':36} {'T':>3} {'packed us':>10} {'TB/s':>6} {'bf16 us':>8} {'TB/s':>6} {'packed/bf16':>11} "
          f"{'rel err':>8}")
    for name, t, us, tbs, ub, tbb, err in rows:
        print(f"{name:36} {t:3d} {us:10.1f} {tbs:6.2f} {ub:8.1f} {tbb:6.2f} {us / ub:11.2f} {err:8.1e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_swiglu_input_at_the_shared_expert_s_shape_on_the_gpu():
    """A reports-mixed shared expert's down projection (INT6 group 128, [2560, 640]) with its activation and gate
    computed as the kernel loads (`swiglu=`), bf16, 1 / 4 / 16 tokens, against the reference."""
    (pw,) = _copies(2560, 640, 6, 128, True)[:1]
    for t in (1, 4, 16):
        gate_up = torch.randn(t, 2 * 640, device="cuda").to(torch.bfloat16)
        w = torch.rand(t, 11, device="cuda")[:, 10]
        got = Q.quant_gemv(gate_up, pw, swiglu=w).float()
        want = quant_gemv_ref(swiglu_input(gate_up, w), pw).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, t


SWEEP = [(8, 64, 1), (8, 128, 1), (16, 128, 1), (8, 128, 2), (16, 64, 2), (16, 128, 2), (16, 128, 4), (16, 256, 4),
         (32, 128, 4), (32, 256, 8), (64, 128, 4), (16, 128, 2, 1), (16, 128, 4, 2), (32, 128, 4, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_sweep_launch_configs_on_the_gpu():
    """Each (BLOCK_N, BLOCK_K, warps) of SWEEP on the kept-packed shapes at 1 and 16 tokens: prints every time and
    the best per row, the input for quant_gemv.CFG (no assertion on speed)."""
    print()
    for name, (N, K), bits, group, dense in FULL[:6]:
        pws = _copies(N, K, bits, group, dense)
        for t in (1, 16):
            x = torch.randn(t, K, device="cuda").to(torch.bfloat16)
            times = {}
            for cfg in SWEEP:
                if cfg[0] < 16 and t > 1:
                    continue                                  # tl.dot needs 16 rows
                times[cfg] = _graph_us([lambda p=p, c=cfg: Q.quant_gemv(x, p, cfg=c) for p in pws])
            best = min(times, key=times.get)
            print(f"{name:28} T={t:2d} best {best} {times[best]:.1f} us ({pws[0].nbytes() / times[best] / 1e6:.2f}"
                  f" TB/s) | " + " ".join(f"{c}:{u:.1f}" for c, u in times.items()))
        del pws
        torch.cuda.empty_cache()
