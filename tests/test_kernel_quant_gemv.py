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
    """T = 1 / 2 / 3 / 8 with the tokens as the FMA tiles' inner dimension (TP 1, 2 and 4, padded to a power of two
    and masked at 3; 8 with the wide kernel off, `wide=False`: two token groups, each a program) and 4 on the tl.dot
    variant (kernel flag quant_gemv_fma off; 12 of its 16 tokens masked), 16 there once (none masked), per-channel
    scales, groups of 32 and of 24 (a scale a period where the group is a multiple of the period, else one a value;
    100 inputs: a last group of 4 and a partial tile), 40 rows (a partial row block). (4 and 16 FMA tokens took the
    TP-4 program of 3 and the token groups of 8 again, 6 of 12 programs a group: dropped.)"""
    N, K = 40, 100
    g = torch.Generator().manual_seed(bits)
    for group in (None, 32, 24):
        pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense)
        pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, pw.group)
        assert pw.dense == (dense or bits in (4, 8))
        for t, fma in ((1, True), (2, True), (3, True), (8, True), (4, False)) + (((16, False),) if group is None
                                                                                 else ()):
            c = Q.launch_config(t, N, K, pw.group, torch.device(DEV), SMALL, fma=fma, bits=bits, dense=dense)
            assert c["TP"] == (16 if not fma else min(4, 1 << (t - 1).bit_length()))       # TP 1, 2, 4, 4, 16
            x = torch.randn(t, K, generator=g).to(DEV)
            out = Q.quant_gemv(x, pw, cfg=SMALL, fma=fma, wide=False)
            torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4, msg=f"{group} {t} {fma}")


@pytest.mark.parametrize("bits,dense", LAYOUTS)
def test_wide_kernel_matches_the_reference(bits, dense):
    """The wide kernel (WIDE_MIN_T-16 tokens, one program over all of them, each tile decoded once and fed to
    tl.dot): T = 5 / 8 / 13 / 16 (the tokens past T masked in the 16-wide dot; one kernel for all), per-channel
    scales, groups of 32 and of 24 (a scale a period or a value), 100 inputs (a partial last tile; for the older INT6 layout, 3 padding
    positions a period), 40 rows of a 64-row block; `fma` does not matter to it."""
    N, K = 40, 100
    g = torch.Generator().manual_seed(bits + dense)
    for group, ts in ((None, (5, 16)), (32, (8,)), (24, (13,))):      # T is a mask in the kernel, not a constant
        pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense)
        pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, pw.group)
        for t in ts:
            x = torch.randn(t, K, generator=g).to(DEV)
            out = Q.quant_gemv(x, pw, cfg=(64, 64, 4), fma=t % 2 == 0, wide=True)
            torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4, msg=f"{group} {t}")


@pytest.mark.parametrize("K,group,dense", [(128, 32, False), (120, 24, True)])
def test_wide_kernel_reads_no_scale_past_the_last_input(K, group, dense):
    """A scale a value (group not a multiple of the period) with a last period running past K: the values past K
    must not load a scale. The scales sit at the end of a buffer whose tail is NaN, so a read past the last row's
    last scale column turns the output NaN (on the H200 it was an illegal address, h200-14)."""
    N, bits = 40, 6
    g = torch.Generator().manual_seed(K)
    pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense)
    assert Q.launch_config(5, N, K, group, torch.device(DEV), bits=bits, dense=dense, wide=True)["SCALE"] == 2
    buf = torch.full((pw.scales.numel() + 64,), float("nan"), dtype=pw.scales.dtype)
    buf[: pw.scales.numel()] = pw.scales.flatten()
    buf = buf.to(DEV)
    pw = PackedWeight(pw.words.to(DEV), buf[: pw.scales.numel()].view(N, -1), bits, K, group)
    x = torch.randn(5, K, generator=g).to(DEV)
    out = Q.quant_gemv(x, pw, cfg=(64, 64, 4), wide=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4)


def test_periods_and_scale_modes():
    """A period is the smallest run of whole words with whole values (INT6 stream: 16 in 3 words); a group scale is
    loaded once a period when the group is a multiple of it, else once a value; tiles are whole periods, a power
    of two of them, and K slices whole tiles."""
    assert Q.period(6, True) == (16, 3) and Q.period(6, False) == (5, 1)
    assert Q.period(4, True) == Q.period(4, False) == (8, 1) and Q.period(8, True) == (4, 1)
    dev = torch.device("cpu")
    for bits, dense, group, scale in ((6, True, 128, 1), (6, True, 24, 2), (6, True, 8, 2), (6, False, 128, 2),
                                      (6, False, 40, 1), (4, True, 24, 1), (8, True, 8, 1), (8, True, 2560, 0)):
        c = Q.launch_config(1, 2560, 2560, group, dev, (32, 512, 4), bits=bits, dense=dense)
        p, wp = Q.period(bits, dense)
        assert c["SCALE"] == scale, (bits, dense, group)
        assert c["BLOCK_K"] == c["NPER"] * p and c["NPER"] & (c["NPER"] - 1) == 0 and c["BLOCK_K"] <= 512
        assert c["K_SLICE"] % c["BLOCK_K"] == 0 and c["splits"] * c["K_SLICE"] >= 2560
    d = Q.launch_config(4, 2560, 2560, 128, dev, fma=False)
    assert d["DOT"] and d["NPER"] >= 16 and d["BLOCK_N"] >= 16 and d["TP"] == 16
    assert [Q.launch_config(t, 2560, 2560, 128, dev)["TP"] for t in (1, 2, 3, 4, 8, 16)] == [1, 2, 4, 4, 4, 4]
    for bits, dense, pp in ((6, True, 16), (6, False, 8), (4, True, 8), (8, True, 4)):
        w = Q.launch_config(16, 2560, 2560, 128, dev, bits=bits, dense=dense, wide=True)
        assert w["WIDE"] and not w["DOT"] and w["TP"] == 16 and w["PP"] == pp and w["BLOCK_N"] >= 16
        assert w["NPER"] * pp >= 16 and w["K_SLICE"] % w["BLOCK_K"] == 0
    tiny = Q.launch_config(16, 40, 20, 20, dev, (8, 8, 4), bits=6, dense=False, wide=True)
    assert tiny["BLOCK_N"] == 16 and tiny["NPER"] * tiny["PP"] == 16


def test_a_shape_entry_overrides_the_token_count_entry_only_where_it_applies():
    """CFG_SHAPE (out_proj INT6 at one token, from the H200 and H100 sweeps) is taken for its shape, bits and token
    counts only; other shapes, bits and larger token counts keep CFG; an explicit cfg beats both."""
    dev = torch.device("cpu")
    (n, k, bits), table = next(iter(Q.CFG_SHAPE.items()))

    def bn(t: int, n: int = n, k: int = k, bits: int = bits, cfg: tuple | None = None) -> int:
        return Q.launch_config(t, n, k, 128, dev, cfg, bits=bits)["BLOCK_N"]

    assert bn(1) == table[1][0] != Q.CFG[1][0]
    assert bn(1, k=k + 2048) == bn(1, bits=4) == Q.CFG[1][0]           # o_proj's K, another width: CFG
    assert bn(4) == Q.CFG[4][0] and bn(64) == Q.CFG[16][0]                # past the shape's keys: CFG
    assert bn(1, cfg=(8, 256, 4)) == 8


@pytest.mark.parametrize("bits,dense,group", [(6, True, 16), (6, False, 40), (4, True, 8), (8, True, 4)])
def test_row_blocks_not_dividing_n_and_odd_widths(bits, dense, group):
    """Row blocks of 16 over 21 rows (the last holds 5), K = 84 (not a multiple of the tile or, for the stream, of
    the INT6 period: the last word part padding), a scale a period, 1 and 3 tokens (TP 1, and TP 4 with a masked
    token; TP 2 and token groups are test_kernel_matches_the_reference's, over a partial row block and tile): the
    padding bits decode to values whose x is masked to 0."""
    N, K = 21, 84
    g = torch.Generator().manual_seed(group)
    pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, pw.group)
    assert Q.launch_config(1, N, K, group, torch.device(DEV), (16, 32, 4), bits=bits, dense=dense)["SCALE"] == 1
    for t in (1, 3):
        x = torch.randn(t, K, generator=g).to(DEV)
        out = Q.quant_gemv(x, pw, cfg=(16, 32, 4))
        torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4, msg=f"{t}")


def test_half_precision_activations():
    """16-bit activations and scales (the GPU's case; fp16 here: the interpreter's bf16 dot is wrong) on both paths,
    the output in x.dtype."""
    N, K = 40, 100
    g = torch.Generator().manual_seed(11)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 6, 32, scale_dtype=torch.float16)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 6, K, 32)
    for t, fma in ((1, True), (4, True), (4, False), (16, True)):                # 16: the wide kernel
        x = torch.randn(t, K, generator=g).to(DEV, torch.float16)
        out = Q.quant_gemv(x, pw, cfg=SMALL, fma=fma, wide=True)
        ref = quant_gemv_ref(x, pw)
        assert out.dtype == torch.float16
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3


@pytest.mark.parametrize("prefetch", [True, False])
def test_row_blocks_and_k_slices(monkeypatch, prefetch):
    """Several row blocks and K split into slices of two tiles each (four with 8 tokens: two token groups, so
    twice the output tiles; 13 on the wide kernel, one program a row block and slice; fp32 partial sums added by
    the last program of each), with the next tile's words
    loading while one is computed (PREFETCH; not past a slice's end) or not, with the minimum slice lowered so a
    small K splits. INT8: the same tiles, slices and grid as INT6 in groups of 64, with a quarter of the values a
    tile to unroll (the interpreter's time is its unrolled operations: 2.7x faster); INT6's three-word periods are
    the tests above."""
    monkeypatch.setattr(Q, "MIN_SPLIT_K", 64)
    monkeypatch.setattr(Q, "PREFETCH", prefetch)
    N, K, bits = 24, 256, 8
    g = torch.Generator().manual_seed(3)
    pw = quantize_rtn(torch.randn(N, K, generator=g), bits, 64)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, 64)
    for t, wide in ((1, False), (8, False), (13, True)) if prefetch else ((1, False), (3, False), (13, True)):
        x = torch.randn(t, K, generator=g).to(DEV)       # 8: two token groups, each its own counters; 13: wide
        c = Q.launch_config(t, N, K, 64, x.device, (8, 32, 4), bits=bits, wide=wide)
        assert c["SCALE"] == 1 and c["splits"] * c["K_SLICE"] == K and c["splits"] == (2 if t == 8 else 4)
        assert c["K_SLICE"] == (4 if t == 8 else 2) * c["BLOCK_K"]            # two tiles a slice (four at 8)
        assert c["BLOCK_N"] == (16 if wide else 8)        # wide: 16 rows a block at least (the second holds 8)
        out = Q.quant_gemv(x, pw, cfg=(8, 32, 4), wide=wide)
        torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4)
        # the slices are added in one launch by the last program of a row block, in a fixed order: the counters
        # are back at 0 and a second launch gives the same bits (relaunched past 1 token: token groups, a masked
        # token, the wide kernel; 1 token's slices are the same counters)
        assert not split_locks(x.device).any()
        if t > 1:
            assert torch.equal(Q.quant_gemv(x, pw, cfg=(8, 32, 4), wide=wide), out)


def test_out_writes_columns_of_a_wider_tensor(monkeypatch):
    """`out=`: the kernels store into a column slice of a wider tensor (attention's q/k/v beside the indexer's
    columns: no cat launch), with K slices too; the dequantize path (past the kernels' tokens) copies into it; the
    columns beside are untouched; a wrong shape or dtype is refused."""
    monkeypatch.setattr(Q, "MIN_SPLIT_K", 64)
    N, K, bits = 24, 256, 8
    g = torch.Generator().manual_seed(4)
    pw = quantize_rtn(torch.randn(N, K, generator=g), bits, 64)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, 64)
    for t in (1, 3, Q.DECODE_MAX_T + 1):
        x = torch.randn(t, K, generator=g).to(DEV)
        wide = torch.full((t, N + 5), 9.0, device=DEV)
        got = Q.quant_gemv(x, pw, cfg=(8, 32, 4), out=wide[:, :N])
        assert got.data_ptr() == wide.data_ptr()
        assert torch.equal(wide[:, :N], Q.quant_gemv(x, pw, cfg=(8, 32, 4))) and (wide[:, N:] == 9.0).all()
    with pytest.raises(ValueError, match="out"):
        Q.quant_gemv(x, pw, out=torch.empty(t, N, dtype=torch.float64, device=DEV))


@pytest.mark.parametrize("t,fma", [(1, True), (3, True), (4, False), (13, True)])
def test_the_swiglu_input_is_computed_as_it_loads(t, fma):
    """`swiglu=w`: x holds a shared expert's gate and up outputs [T, 2K] and the kernel's input is
    silu(gate) * up * w[t] (`swiglu_input`), with w a strided column as the router writes it; 16-bit, 1 and 3
    tokens (FMA path), 4 (the tl.dot variant) and 13 (the wide kernel)."""
    N, K = 48, 64
    g = torch.Generator().manual_seed(t)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 6, 32)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 6, K, 32)
    # fp16 under the interpreter: its float -> bf16 casts truncate (every output 1-2% small here), the GPU rounds
    gate_up = torch.randn(t, 2 * K, generator=g).to(DEV, torch.bfloat16 if CUDA else torch.float16)
    w = torch.rand(t, 3, generator=g).to(DEV)[:, 2]
    got = Q.quant_gemv(gate_up, pw, cfg=SMALL, swiglu=w, fma=fma, wide=True)
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


# (inputs a scale, (scales' dtype, output dtype) pairs) for the dequantize kernel: the product rounded to the scales'
# dtype, then to the output's (fp32 -> bf16 or fp16: a second rounding; bf16 -> fp32 exact). Each pair once, each
# scale layout with bf16 and fp32 scales (per-call interpreter time, not coverage, keeps it from the full product).
BF, F32, F16 = torch.bfloat16, torch.float32, torch.float16
DEQUANT_CASES = [(None, [(BF, BF), (F32, F32), (F32, BF)]), (32, [(BF, F32), (F16, F16), (F32, BF)]),
                 (24, [(F32, F16), (BF, BF)])]


@pytest.mark.parametrize("bits,dense", LAYOUTS)
def test_dequant_kernel_is_the_reference_bit_for_bit(bits, dense):
    """`quant_dequant.dequantize_into` (one launch a block of rows) equals `dequantize_packed` bit for bit: every
    value of the width (random ints, not a rounding of floats), random scales with full mantissas (so the fp32
    product is rounded, and ties to even happen), per-channel scales and groups of 32 and of 24 over 100 inputs (a
    last group of 4; 24 not a multiple of INT6's stream period), the (scales, output) dtype pairs of DEQUANT_CASES,
    rows [5, 38) of 40 into a strided output (its pad columns must stay NaN). One program a call (64 x 128 tiles;
    ~0.05-0.1 s under the interpreter), then once on 16 x 64 tiles: 3 row blocks x 2 K tiles, a partial one each."""
    from stage_worker.kernels.quant_dequant import dequantize_into

    N, K = 40, 100
    q = _values(N, K, bits, 7 * bits + dense)
    words = pack_values(q, bits, dense)
    g = torch.Generator().manual_seed(bits)
    cases = [(group or K, sd, od, (64, 128, 4)) for group, pairs in DEQUANT_CASES for sd, od in pairs]
    cases.append((24, BF, BF, (16, 64, 4)))
    for group, sd, od, cfg in cases:
        scales = (torch.rand(N, -(-K // group), generator=g) * 0.02 + 1e-3).to(sd)
        pw = PackedWeight(words.to(DEV), scales.to(DEV), bits, K, group)
        buf = torch.full((33, K + 3), float("nan"), dtype=od, device=DEV)
        out = dequantize_into(pw, buf[:, :K], 5, cfg)
        want = dequantize_packed(pw, od, 5, 38)
        assert torch.equal(out, want), (group, sd, od, cfg, (out != want).sum().item())
        assert buf[:, K:].isnan().all()


def test_dequant_kernel_refuses_what_it_cannot_take():
    from stage_worker.kernels.quant_dequant import dequantize_into

    pw = quantize_rtn(torch.randn(8, 32), 8, None)
    with pytest.raises(ValueError, match="dequantize_into"):
        dequantize_into(pw, torch.empty(4, 30), 0)                   # not K columns
    with pytest.raises(ValueError, match="dequantize_into"):
        dequantize_into(pw, torch.empty(4, 32), 6)                   # past the last row
    with pytest.raises(ValueError, match="dequantize_into"):
        dequantize_into(pw, torch.empty(32, 4).t(), 0)               # strided columns


@pytest.mark.parametrize("t,bits,dense,group", [(17, 6, True, 32), (29, 6, False, None), (40, 4, True, 24)])
def test_wide_kernel_past_16_tokens(t, bits, dense, group):
    """17-40 tokens with the wide flag on take the wide kernel (two or three programs a row block, one a group of
    16 tokens), within the wide kernel's tolerance of the reference; the older INT6 layout per channel and INT4 in
    groups of 24 (a scale a period) beside the INT6 stream."""
    N, K = 40, 100
    g = torch.Generator().manual_seed(t)
    pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, pw.group)
    x = torch.randn(t, K, generator=g).to(DEV)
    out = Q.quant_gemv(x, pw, cfg=(64, 64, 4), wide=True)
    torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4)


def test_wide_kernel_token_groups_with_k_slices(monkeypatch):
    """20 tokens (two token groups) with K split in two slices: each (token group, row block) output tile has its
    own counter and partial sums, all back at 0 after the launch; a relaunch gives the same bits."""
    monkeypatch.setattr(Q, "MIN_SPLIT_K", 64)
    N, K = 16, 128
    g = torch.Generator().manual_seed(20)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 8, 64)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 8, K, 64)
    x = torch.randn(20, K, generator=g).to(DEV)
    c = Q.launch_config(20, N, K, 64, x.device, (8, 32, 4), bits=8, wide=True)
    assert c["splits"] == 2 and c["K_SLICE"] == 2 * c["BLOCK_K"] and c["BLOCK_N"] == 16
    out = Q.quant_gemv(x, pw, cfg=(8, 32, 4), wide=True)
    torch.testing.assert_close(out, quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4)
    assert not split_locks(x.device).any()
    assert torch.equal(Q.quant_gemv(x, pw, cfg=(8, 32, 4), wide=True), out)


def test_token_counts_route_to_the_wide_kernel_or_dequant_matmul(monkeypatch):
    """With `wide`, DECODE_MAX_T < T <= WIDE_MAX_T is the wide kernel's, past it `dequant_matmul`; without, past
    DECODE_MAX_T. The swiglu input alike: the wide kernel computes it as it loads (the shared expert's down
    projection at 20 tokens), past the limit `swiglu_input` then `dequant_matmul`."""
    calls = []
    real = Q.dequant_matmul
    monkeypatch.setattr(Q, "dequant_matmul", lambda x, pw: calls.append(x.shape[0]) or real(x, pw))
    monkeypatch.setattr(Q, "WIDE_MAX_T", 24)
    N, K = 16, 32
    g = torch.Generator().manual_seed(5)
    pw = quantize_rtn(torch.randn(N, K, generator=g), 8, None)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), 8, K, pw.group)
    for t, wide, via in ((20, True, False), (25, True, True), (17, False, True)):
        calls.clear()
        x = torch.randn(t, K, generator=g).to(DEV)
        torch.testing.assert_close(Q.quant_gemv(x, pw, wide=wide), quant_gemv_ref(x, pw), rtol=1e-5, atol=1e-4)
        assert calls == ([t] if via else []), (t, wide)
    for t, via in ((20, False), (25, True)):
        calls.clear()
        gate_up = torch.randn(t, 2 * K, generator=g).to(DEV, torch.float16)
        w = torch.rand(t, generator=g).to(DEV)
        got = Q.quant_gemv(gate_up, pw, swiglu=w, wide=True)
        want = quant_gemv_ref(swiglu_input(gate_up, w), pw).float()
        assert ((got.float() - want).norm() / want.norm()).item() < 5e-3, t
        assert calls == ([t] if via else []), t


def test_wide_launch_configs_take_every_token_count(monkeypatch):
    """No ValueError and no more split counters than LOCKS for any T up to WIDE_MAX_T (wide) or DECODE_MAX_T at a
    model's shapes (lm_head 248,320 x 2560, o_proj 2560 x 4096 / 6144, the shared expert's down 2560 x 640, the mix
    weights 320 x 10240 and 10240 x 320) with the H200's 132 SMs: past 16 tokens the wide kernel's token groups
    multiply the output tiles, and split K only comes with few of them."""
    from stage_worker.kernels.split_reduce import LOCKS

    monkeypatch.setattr(Q, "sm_count", lambda device, cpu: 132)
    dev = torch.device("cpu")
    for N, K, bits, group in ((248320, 2560, 8, 2560), (2560, 4096, 6, 128), (2560, 6144, 6, 128),
                              (2560, 640, 6, 128), (320, 10240, 8, 10240), (10240, 320, 8, 320)):
        for t in range(1, Q.WIDE_MAX_T + 1):
            for wide in (True, False) if t <= Q.DECODE_MAX_T else (True,):
                c = Q.launch_config(t, N, K, group, dev, bits=bits, wide=wide)
                tiles = -(-t // c["TP"]) * -(-N // c["BLOCK_N"])
                assert c["splits"] == 1 or tiles <= LOCKS, (N, K, t, wide)
                assert c["splits"] * c["K_SLICE"] >= K and c["K_SLICE"] % c["BLOCK_K"] == 0
        assert Q.launch_config(512, N, K, group, dev, bits=bits)["TP"] == Q.TOKENS_PER_PROGRAM   # no KeyError


@pytest.mark.parametrize("bits,dense,group", [(6, True, 32), (8, True, None)])
def test_dequant_matmul_with_the_kernel_is_the_pytorch_path(monkeypatch, bits, dense, group):
    """`dequant_matmul` with the Triton dequantize (the GPU's path, here under the interpreter) gives the PyTorch
    path's bits: the same weights, the same matmuls; 37 rows in one block and in blocks of 16 (the last of 5, the
    kernel's buffer reused), fp32 and fp16 activations (the weights dequantized to x's dtype)."""
    N, K = 37, 64
    g = torch.Generator().manual_seed(bits)
    pw = quantize_rtn(torch.randn(N, K, generator=g), bits, group, dense=dense, scale_dtype=torch.bfloat16)
    pw = PackedWeight(pw.words.to(DEV), pw.scales.to(DEV), bits, K, pw.group)
    for chunk, dt in ((N * K, torch.float32), (16 * K, torch.float32), (16 * K, torch.float16)):
        monkeypatch.setattr(Q, "CHUNK", chunk)
        x = torch.randn(20, K, generator=g).to(DEV, dt)
        got = Q.dequant_matmul(x, pw, kernel=True)
        want = Q.dequant_matmul(x, pw, kernel=False)
        assert got.dtype == dt and torch.equal(got, want), (chunk, dt)


def test_shapes_the_kernel_cannot_take_are_refused():
    pw = quantize_rtn(torch.randn(8, 32), 8, None)
    with pytest.raises(ValueError, match="inputs"):
        Q.quant_gemv(torch.zeros(1, 30), pw)


def test_the_kernel_compiles_for_the_h200():
    """Triton compiles the kernel for sm_90 without a GPU (a subprocess: the interpreter is off there), so what only
    the GPU compiler rejects shows before a device call: the full shape's variants at the default configs (INT6
    stream group 128 at 1 / 4 / 16 tokens and the tl.dot variant, INT8 and INT4, the older INT6 layout with a scale
    a value, the swiglu input, K slices; the wide kernel at 16 tokens for each packing, one dot a tile), no register
    spills, and in the FMA and wide variants no layout conversion in the loop
    (the words, values, scales, x and accumulator share one layout, the periods
    across a warp's threads; a 2-D tile broadcast into the 3-D accumulator compiled to a shared-memory conversion
    per value)."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import quant_gemv as Q

def build(N, K, bits, group, dense, T, fma=True, swiglu=False, splits=None, wide=False):
    c = Q.launch_config(T, N, K, group, torch.device("cpu"), fma=fma, bits=bits, dense=dense, wide=wide)
    W = -(-K * bits // 32) if dense else -(-K // (32 // bits))
    sig = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
               w_ptr="*fp32" if swiglu else "*bf16", N="i32", T="i32", stride_xt="i32", stride_qn="i32",
               stride_sn="i32", stride_ot="i32", stride_wt="i32", one="i32")
    const = dict(K=K, W=W, BITS=bits, P=c["P"], WP=c["WP"], GROUP=group, SCALE=c["SCALE"], K_SLICE=c["K_SLICE"],
                 SPLITS=splits or c["splits"], BLOCK_N=c["BLOCK_N"], NPER=c["NPER"],
                 TP=c["TP"], PRECISION="tf32", SWIGLU=swiglu, PREFETCH=Q.PREFETCH)
    const.update(dict(PP=c["PP"]) if wide else dict(DOT=c["DOT"]))
    if splits:
        const["K_SLICE"] = -(-K // splits // (c["BLOCK_K"])) * c["BLOCK_K"]
    sig.update(dict.fromkeys(const, "constexpr"))
    fn = Q._quant_gemm_kernel if wide else Q._quant_gemv_kernel
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=c["warps"], num_stages=c["stages"]))
    info = ptxas_info(k.asm["ptx"])
    spill, regs = info["spill"], info["regs"]
    return dict(T=T, bits=bits, dense=dense, fma=fma, wide=wide, shared=k.metadata.shared, spill=spill, regs=regs,
                converts=loop_converts(k.asm["ttgir"]), mma=k.asm["ttgir"].count("warp_group_dot ") + k.asm[
                    "ttgir"].count("tt.dot "))

def loop_converts(ttgir):
    body = ttgir.split("scf.for", 1)[1].split("scf.yield", 1)[0]
    return body.count("convert_layout")


out = [build(2560, 6144, 6, 128, True, t) for t in (1, 4, 16)]
out += [build(2560, 6144, 6, 128, True, 16, fma=False), build(248320, 2560, 8, 2560, True, 1),
        build(2560, 4096, 4, 128, True, 1), build(2560, 4096, 6, 128, False, 1),
        build(2560, 640, 6, 128, True, 1, swiglu=True), build(2560, 6144, 6, 128, True, 4, splits=4)]
out += [build(2560, 6144, 6, 128, True, 16, wide=True, splits=4), build(2560, 4096, 4, 128, True, 16, wide=True),
        build(248320, 2560, 8, 2560, True, 16, wide=True), build(2560, 4096, 6, 128, False, 16, wide=True),
        build(2560, 640, 6, 128, True, 16, wide=True, swiglu=True), build(2560, 4096, 6, 24, True, 16, wide=True)]
print(json.dumps(out))
"""
    got = run_compile_script(script, timeout=600)
    print("\n" + "\n".join(map(str, got)))
    assert all(c["spill"] == 0 for c in got)
    assert all(c["converts"] == 0 for c in got if c["fma"]), got
    assert all(c["mma"] == 1 for c in got if c["wide"]), got          # the wide kernel: one tensor-core dot a tile


def test_the_dequant_kernel_compiles_for_the_h200():
    """`quant_dequant._dequant_kernel` compiles for sm_90 (no GPU: a subprocess without the interpreter) at its
    default config, with the divisibility a launch on torch's tensors gets (16-aligned pointers and strides), for
    the sites prefill dequantizes most: the INT6 stream in groups of 128, bf16 (a scale a period, PP = P): no
    register spills, 16-byte vector stores along K. (One build: a cold compile is 1-2 s on the CI machine; the
    other layouts' code is the interpreter tests'.)"""
    from sm90_compile import run_compile_script

    script = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import quant_dequant as D

def build(N, K, bits, group, dense, sdt):
    c = D.launch_config(N, K, bits, dense, group)
    W = -(-K * bits // 32) if dense else -(-K // (32 // bits))
    sig = dict(q_ptr="*i32", s_ptr="*" + sdt, out_ptr="*bf16", rows="i32", stride_qn="i32", stride_sn="i32",
               stride_on="i32", one="i32")
    const = dict(K=K, W=W, BITS=bits, P=c["P"], PP=c["PP"], WP=c["WP"], GROUP=group, SCALE=c["SCALE"],
                 BLOCK_N=c["BLOCK_N"], NPER=c["NPER"])
    sig.update(dict.fromkeys(const, "constexpr"))
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 5, 6)}
    k = triton.compile(ASTSource(D._dequant_kernel, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=c["warps"]))
    info = ptxas_info(k.asm["ptx"])
    return dict(bits=bits, dense=dense, scale=c["SCALE"], sdt=sdt, spill=info["spill"], regs=info["regs"],
                stores=sorted(set(re.findall(r"st\.global[.\w]*", k.asm["ptx"]))))

print(json.dumps([build(2560, 6144, 6, 128, True, "bf16")]))
"""
    got = run_compile_script(script, timeout=300)
    print("\n" + "\n".join(map(str, got)))
    assert got[0]["spill"] == 0 and got[0]["scale"] == 1 and got[0]["stores"] == ["st.global.v4.b32"], got


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
    from conftest import graph_us

    return graph_us(lambda i: fns[i % len(fns)](), calls=max(20, len(fns)), runs=5, warmup=len(fns))


def _copies(N: int, K: int, bits: int, group, dense: bool) -> list[PackedWeight]:
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    pw = quantize_rtn(w, bits, group, dense=dense, scale_dtype=torch.bfloat16)
    n = max(1, min(16, L2_SPAN // pw.nbytes()))
    return [pw] + [PackedWeight(pw.words.clone(), pw.scales.clone(), bits, K, pw.group) for _ in range(n - 1)]


# The first kernel's times (per-value gathers for INT6, tl.dot at 4 and 16 tokens; H200, bench/results/quant-decode-1)
OLD_US = {"o_proj int6": (56.8, 357.1, 359.4), "out_proj int6": (39.5, 276.0, 277.6),
          "out_proj int6 old layout": (18.9, 148.3, 147.7), "out_proj int4": (23.9, 22.6, 22.4),
          "out_proj int8": (24.8, 22.7, 22.6), "qkv+indexer int6 (fused site)": (152.7, 1057.1, 1039.6),
          "deltanet in-proj int6 (fused site)": (119.2, 638.5, 627.2), "lm_head int8": (902.4, 898.0, 881.9)}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_full_shape_on_the_gpu(monkeypatch):
    """Agreement with the reference at the full shape's sizes in bf16 (relative error of the output), and the time
    of each against cuBLAS reading the same weight in bf16 (both from HBM: the calls cycle through copies that
    together exceed L2): the FMA kernel ("packed", `wide=False`), its tl.dot variant (fma=False, "dot") at 4 / 8 / 16
    tokens, the wide kernel ("wide": one program over all the tokens, each tile decoded once, one tl.dot a tile; at
    4 tokens forced with WIDE_MIN_T = 1) and the first kernel's time. Graph replays give eager's bits on every path
    (K slices summed in one launch). Prints a table: us, TB/s of the packed bytes, packed's and wide's time as a
    share of bf16's."""
    rows = []
    for name, (N, K), bits, group, dense in FULL:
        pws = _copies(N, K, bits, group, dense)
        bf = [dequantize_packed(p, torch.bfloat16) for p in pws[: max(1, min(len(pws), L2_SPAN // (N * K * 2)))]]
        for t in (1, 4, 8, 16):
            x = torch.randn(t, K, device="cuda").to(torch.bfloat16)
            ref = quant_gemv_ref(x, pws[0])
            variants = [(True, False)] + ([(False, False), (True, True)] if t > 1 else [])     # (fma, wide)
            errs = []
            with monkeypatch.context() as m:
                m.setattr(Q, "WIDE_MIN_T", 1)
                for fma, wide in variants:
                    out = Q.quant_gemv(x, pws[0], fma=fma, wide=wide)
                    errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
                    assert errs[-1] < 1e-2, (name, t, fma, wide, errs[-1])
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        replayed = Q.quant_gemv(x, pws[0], fma=fma, wide=wide)
                    for _ in range(2):
                        replayed.zero_()
                        graph.replay()
                        torch.cuda.synchronize()
                        assert torch.equal(replayed, out), (name, t, fma, wide)
                    assert not split_locks(x.device).any()
                us_wide = _graph_us([lambda p=p: Q.quant_gemv(x, p, wide=True) for p in pws]) if t > 1 else float("nan")
            us = _graph_us([lambda p=p: Q.quant_gemv(x, p, wide=False) for p in pws])
            us_dot = _graph_us([lambda p=p: Q.quant_gemv(x, p, fma=False, wide=False) for p in pws]) if t > 1 \
                else float("nan")
            us_bf16 = _graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf])
            old = dict(zip((1, 4, 16), OLD_US.get(name, (float("nan"),) * 3))).get(t, float("nan"))
            rows.append((name, t, us, pws[0].nbytes() / us / 1e6, us_dot, us_wide, pws[0].nbytes() / us_wide / 1e6,
                         old, us_bf16, N * K * 2 / us_bf16 / 1e6, max(errs)))
        del pws, bf
        torch.cuda.empty_cache()
    print(f"\n{'weight':36} {'T':>3} {'packed us':>10} {'TB/s':>6} {'dot us':>7} {'wide us':>8} {'TB/s':>6} "
          f"{'first us':>9} {'bf16 us':>8} {'TB/s':>6} {'packed/bf16':>11} {'wide/bf16':>9} {'rel err':>8}")
    for name, t, us, tbs, ud, uw, tbw, old, ub, tbb, err in rows:
        print(f"{name:36} {t:3d} {us:10.1f} {tbs:6.2f} {ud:7.1f} {uw:8.1f} {tbw:6.2f} {old:9.1f} {ub:8.1f} "
              f"{tbb:6.2f} {us / ub:11.2f} {uw / ub:9.2f} {err:8.1e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_swiglu_input_at_the_shared_expert_s_shape_on_the_gpu():
    """A reports-mixed shared expert's down projection (INT6 group 128, [2560, 640]) with its activation and gate
    computed as the kernel loads (`swiglu=`), bf16, 1 / 4 / 8 / 16 tokens (8 and 16: the wide kernel), against the
    reference."""
    (pw,) = _copies(2560, 640, 6, 128, True)[:1]
    for t in (1, 4, 8, 16):
        gate_up = torch.randn(t, 2 * 640, device="cuda").to(torch.bfloat16)
        w = torch.rand(t, 11, device="cuda")[:, 10]
        got = Q.quant_gemv(gate_up, pw, swiglu=w, wide=True).float()
        want = quant_gemv_ref(swiglu_input(gate_up, w), pw).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, t


# (BLOCK_N, BLOCK_K inputs, warps): a thread holds BLOCK_N * BLOCK_K / period / (32 warps) (row, period) cells
SWEEP = [(16, 128, 2), (16, 256, 4), (32, 256, 4), (64, 256, 4), (16, 512, 4), (32, 512, 4), (64, 512, 8),
         (32, 1024, 8)]


def _sweep(rows: list[int], tokens: tuple[int, ...], configs: list[tuple[int, int, int]], wide: bool) -> None:
    """Time each config on FULL[rows] at each token count; print every time and the best per row."""
    print()
    for name, (N, K), bits, group, dense in [FULL[i] for i in rows]:
        pws = _copies(N, K, bits, group, dense)
        for t in tokens:
            x = torch.randn(t, K, device="cuda").to(torch.bfloat16)
            times = {cfg: _graph_us([lambda p=p, c=cfg: Q.quant_gemv(x, p, cfg=c, wide=wide) for p in pws])
                     for cfg in configs}
            best = min(times, key=times.get)
            print(f"{name:28} T={t:2d} best {best} {times[best]:.1f} us ({pws[0].nbytes() / times[best] / 1e6:.2f}"
                  f" TB/s) | " + " ".join(f"{c}:{u:.1f}" for c, u in times.items()), flush=True)
        del pws
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_sweep_launch_configs_on_the_gpu():
    """Each (BLOCK_N, BLOCK_K, warps) of SWEEP on four kept-packed shapes at 1, 4 and 16 tokens (the FMA kernel):
    prints every time and the best per row, the input for quant_gemv.CFG (no assertion on speed)."""
    _sweep([0, 3, 5, 6], (1, 4, 16), SWEEP, wide=False)


# the wide kernel's (BLOCK_N, BLOCK_K inputs, warps): a thread decodes BLOCK_N * BLOCK_K / (32 warps) values a tile
SWEEP_WIDE = [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8), (64, 128, 8), (128, 64, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_sweep_wide_configs_on_the_gpu():
    """Each config of SWEEP_WIDE for the wide kernel on five kept-packed shapes at 8 and 16 tokens: prints every
    time and the best per row, the input for quant_gemv.CFG_WIDE (no assertion on speed)."""
    _sweep([0, 3, 5, 6, 8], (8, 16), SWEEP_WIDE, wide=True)


def _eager_ms(fns, runs: int = 5) -> float:
    """Milliseconds per call of `fns` (cycled, one call of each a run) to a synchronize, eagerly (prefill runs
    outside CUDA graphs: the host's launches count), the median of `runs` after one warm-up run."""
    import statistics
    import time

    times = []
    for run in range(runs + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        if run:
            times.append((time.perf_counter() - t0) / len(fns))
    return 1e3 * statistics.median(times)


# Prefill's dense sites at their full size: the most common (o_proj, INT6 stream in groups of 128) and the largest
# (a 248,320 x 2560 lm_head, INT8 per channel: it reads one row a sequence, `logits_indices`, so it reaches
# dequant_matmul only past WIDE_MAX_T sequences a step, but it bounds the blocks and their memory).
PREFILL = [FULL[0], FULL[5]]
PREFILL_T = (17, 32, 46, 64, 96, 128, 512)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_prefill_dequant_on_the_gpu(monkeypatch):
    """The prefill path on the H200 at PREFILL's weights (bf16 scales and activations): the Triton dequantize equals
    `dequantize_packed` bit for bit (o_proj whole, also from fp32 scales to bf16 and fp32; the lm_head's first and
    last GPU_CHUNK blocks); `dequant_matmul` (kernel), its PyTorch path and the wide kernel (WIDE_MAX_T raised to
    128) agree with cuBLAS on the dequantized weight. Times, eager ms a call cycling through copies that exceed L2:
    the PyTorch path (the old prefill), `dequant_matmul` with the kernel, the wide kernel (T <= 128) and cuBLAS on
    the bf16 weight (the floor) at T = 17 .. 512; the block size (GPU_CHUNK, 8M-64M elements) at 46 and 512 tokens;
    the dequantize alone (TB/s of packed bytes read + bf16 written). Prints the tables that set WIDE_MAX_T,
    GPU_CHUNK and quant_dequant.CFG (no assertion on speed)."""
    from stage_worker.kernels import quant_dequant as D

    bf, chunk0 = torch.bfloat16, Q.GPU_CHUNK
    monkeypatch.setattr(Q, "WIDE_MAX_T", 128)
    rows, sweep = [], []
    for name, (N, K), bits, group, dense in PREFILL:
        pws = _copies(N, K, bits, group, dense)
        pw = pws[0]
        block = min(N, Q.GPU_CHUNK // K)
        for r0 in sorted({0, N - block}):
            got = D.dequantize_into(pw, torch.empty(block, K, dtype=bf, device="cuda"), r0)
            assert torch.equal(got, dequantize_packed(pw, bf, r0, r0 + block)), (name, r0)
        if N * K <= Q.GPU_CHUNK:
            w32 = quantize_rtn(dequantize_packed(pw), bits, group, dense=dense, scale_dtype=torch.float32)
            for dt in (bf, torch.float32):
                got = D.dequantize_into(w32, torch.empty(N, K, dtype=dt, device="cuda"))
                assert torch.equal(got, dequantize_packed(w32, dt)), (name, dt)
            del w32
        buf = torch.empty(block, K, dtype=bf, device="cuda")
        us = 1e3 * _eager_ms([lambda p=p: D.dequantize_into(p, buf) for p in pws], runs=10)
        tbs = (pw.nbytes() * block / N + block * K * 2) / us / 1e6
        print(f"\n{name}: dequantize {block} x {K} rows: {us:.1f} us, {tbs:.2f} TB/s (packed read + bf16 written)")
        wbf = [dequantize_packed(p, bf) for p in pws[: max(1, min(len(pws), L2_SPAN // (N * K * 2)))]]
        for t in PREFILL_T:
            x = torch.randn(t, K, device="cuda").to(bf)
            ref = torch.nn.functional.linear(x, wbf[0]).float()
            outs = {"kernel": Q.dequant_matmul(x, pw), "torch": Q.dequant_matmul(x, pw, kernel=False)}
            if t <= Q.WIDE_MAX_T:
                outs["wide"] = Q.quant_gemv(x, pw, wide=True)
            errs = {k: ((v.float() - ref).norm() / ref.norm()).item() for k, v in outs.items()}
            assert all(e < 1e-2 for e in errs.values()), (name, t, errs)
            ms = {"torch": _eager_ms([lambda p=p: Q.dequant_matmul(x, p, kernel=False) for p in pws]),
                  "kernel": _eager_ms([lambda p=p: Q.dequant_matmul(x, p) for p in pws]),
                  "wide": _eager_ms([lambda p=p: Q.quant_gemv(x, p, wide=True) for p in pws])
                  if t <= Q.WIDE_MAX_T else float("nan"),
                  "bf16": _eager_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in wbf])}
            rows.append((name, t, ms, max(errs.values())))
            if t in (46, 512):
                for chunk in (1 << 23, 1 << 24, 1 << 25, 1 << 26):
                    monkeypatch.setattr(Q, "GPU_CHUNK", chunk)
                    sweep.append((name, t, chunk, _eager_ms([lambda p=p: Q.dequant_matmul(x, p) for p in pws])))
                monkeypatch.setattr(Q, "GPU_CHUNK", chunk0)
        pws = pw = wbf = buf = None
        torch.cuda.empty_cache()
    print(f"\n{'weight':14} {'T':>4} {'torch ms':>9} {'kernel ms':>10} {'wide ms':>8} {'bf16 ms':>8} "
          f"{'torch/kernel':>12} {'kernel/bf16':>11} {'wide/kernel':>11} {'rel err':>8}")
    for name, t, ms, err in rows:
        print(f"{name:14} {t:4d} {ms['torch']:9.3f} {ms['kernel']:10.3f} {ms['wide']:8.3f} {ms['bf16']:8.3f} "
              f"{ms['torch'] / ms['kernel']:12.1f} {ms['kernel'] / ms['bf16']:11.2f} {ms['wide'] / ms['kernel']:11.2f} "
              f"{err:8.1e}")
    print(f"\n{'weight':14} {'T':>4} {'GPU_CHUNK':>10} {'kernel ms':>10}")
    for name, t, chunk, ms in sweep:
        print(f"{name:14} {t:4d} {chunk:10d} {ms:10.3f}")
