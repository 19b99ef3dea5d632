"""The fused GatedResidual kernels (002 §3.3) against their PyTorch reference, and the reference against the model.

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported): tiny shapes,
few cases. With CUDA the same tests run natively and the `gpu` test adds the real decode shapes.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import hyper_connection as K  # noqa: E402
from stage_worker.kernels import hyper_connection_ref as ref  # noqa: E402
from stage_worker.kernels.flags import NONE, KernelFlags  # noqa: E402
from stage_worker.model.hyper_connection import GatedResidual  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
EPS = 1e-6


def _weights(hidden: int, hc: int, rank: int, inject: bool, dtype: torch.dtype, seed: int) -> list:
    """hc_norm_w, down_w, up_w, inject_w: scaled so every sigmoid and silu sees O(1) inputs, not a flat tail."""
    g = torch.Generator().manual_seed(seed)
    width = hc * hidden
    ws = [torch.randn(width, generator=g) * 0.1, torch.randn(rank, width, generator=g) / width ** 0.5,
          torch.randn(width, rank, generator=g) * 2 / rank ** 0.5,
          torch.randn(hc, width, generator=g) * 2 / width ** 0.5 if inject else None]
    return [w.to(DEV, dtype) if w is not None else None for w in ws]


def _streams(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 3).to(DEV, dtype)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.02) -> None:
    """Within bf16 tolerance, and bit-equal almost everywhere: a rounding point that moved shifts a third or more of
    the elements by one ulp, which a tolerance alone would let through."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    frac = (got != want).float().mean().item()
    assert frac <= max_mismatch, f"{frac:.1%} of elements differ from the reference: a rounding point moved?"


def _module(hidden: int, hc: int, rank: int, inject: bool) -> GatedResidual:
    module = GatedResidual(hidden, hc, rank, EPS, inject=inject).to(DEV)
    with torch.no_grad():
        for p, w in zip(_module_weights(module), _weights(hidden, hc, rank, inject, torch.float32, seed=hidden)):
            if p is not None:
                p.copy_(w)
    return module


def _module_weights(module: GatedResidual) -> list:
    """hc_norm_w, down_w, up_w, inject_w, as `hc_mix` takes them."""
    inject = module.block_inject_weight
    return [module.hc_norm.weight, module.input_mix_weight_down.weight, module.input_mix_weight_up.weight,
            None if inject is None else inject.weight]


@pytest.mark.parametrize("inject", [True, False], ids=["block", "final_mixer"])
def test_reference_is_the_model(inject):
    module = _module(32, 4, 8, inject)
    streams = _streams(5, 128, torch.float32, seed=1)
    with torch.no_grad():
        mixed, weights = module.mix(streams)
        got_mixed, got_weights = ref.hc_mix(streams, *_module_weights(module), 4, EPS)
    torch.testing.assert_close(got_mixed, mixed, rtol=0, atol=1e-6)
    if inject:
        torch.testing.assert_close(got_weights, weights, rtol=0, atol=1e-6)
        out = _streams(5, 32, torch.float32, seed=2)
        torch.testing.assert_close(ref.hc_inject(streams, out, weights), GatedResidual.inject(streams, out, weights),
                                   rtol=0, atol=1e-6)
    else:
        assert got_weights is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,hc,rank,inject", [
    (1, 32, 4, 8, True),      # one decode token
    (3, 32, 4, 8, False),     # the final mixer: no inject tile
    (5, 40, 3, 6, True),      # nothing a power of two: every mask
    (17, 24, 4, 5, True),     # two row blocks
])
def test_mix_kernels_match_reference(dtype, rows, hidden, hc, rank, inject):
    streams = _streams(rows, hc * hidden, dtype, seed=rows)
    weights = _weights(hidden, hc, rank, inject, dtype, seed=rows + hidden)
    mixed, weights_out = K.hc_mix(streams, *weights, hc, EPS)
    want_mixed, want_weights = ref.hc_mix(streams, *weights, hc, EPS)
    assert mixed.dtype == dtype and mixed.shape == (rows, hidden)
    pairs = [(mixed, want_mixed)] + ([(weights_out, want_weights)] if inject else [])
    assert (weights_out is None) == (not inject)
    for got, want in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_bf16_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,hc,rank", [(1, 32, 4, 8), (5, 40, 3, 6)])
def test_inject_then_mix_in_one_call_matches_reference(dtype, rows, hidden, hc, rank):
    """The previous block's injection fused into the mix's first kernel = inject, then mix (reference)."""
    streams = _streams(rows, hc * hidden, dtype, seed=40 + rows)
    out = _streams(rows, hidden, dtype, seed=41 + rows)
    inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(42))).to(DEV, dtype)
    weights = _weights(hidden, hc, rank, True, dtype, seed=43)
    new, mixed, w = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS)
    want_new = ref.hc_inject(streams, out, inj)
    want_mixed, want_w = ref.hc_mix(want_new, *weights, hc, EPS)
    for got, want in ((new, want_new), (mixed, want_mixed), (w, want_w)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_bf16_close(got, want)
    assert torch.equal(streams, _streams(rows, hc * hidden, dtype, seed=40 + rows))   # input left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inject_kernel_matches_reference(dtype):
    streams = _streams(3, 3 * 40, dtype, seed=7)
    out = _streams(3, 40, dtype, seed=8)
    weights = (2 * torch.rand(3, 3, generator=torch.Generator().manual_seed(9))).to(DEV, dtype)
    got, want = K.hc_inject(streams, out, weights), ref.hc_inject(streams, out, weights)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_close(got, want, max_mismatch=0.0)


@pytest.mark.parametrize("inject", [True, False], ids=["block", "final_mixer"])
def test_module_entry_point(inject):
    """`hc_mix_module` gives `GatedResidual.mix`, through the kernels at decode sizes and the reference above them;
    with the module's flag on, `mix` itself (on CUDA) goes through it and must not come back."""
    module = _module(32, 4, 8, inject)
    for rows in (2, K.DECODE_ROWS + 1):
        streams = _streams(rows, 128, torch.float32, seed=rows)
        with torch.no_grad():
            module.kernels = NONE
            want = module.mix(streams)
            module.kernels = KernelFlags(hyper_connection=True)
            for got in (K.hc_mix_module(module, streams), module.mix(streams)):
                torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
                if inject:
                    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def _int8(weights: list) -> list:
    """down and up as a reports-mixed checkpoint keeps them: INT8 per channel (PackedWeight), scales in the
    weights' dtype."""
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn

    out = list(weights)
    for i in (1, 2):
        pw = quantize_rtn(weights[i].float().cpu(), 8, None, scale_dtype=weights[i].dtype)
        out[i] = type(pw)(pw.words.to(DEV), pw.scales.to(DEV), 8, pw.in_features, pw.group)
    return out


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.bfloat16, 3)])
def test_int8_mix_weights_are_read_in_place(dtype, rows):
    """INT8 per-channel down / up (their words viewed as bytes, the stored value less 128, one scale a row applied
    to the row's sum) give the reference on the same packed weights (dequantized there), with the injection in
    the first kernel; a packed scheme the kernels do not read is refused by name."""
    hidden, hc, rank = 32, 4, 8
    streams = _streams(rows, hc * hidden, dtype, seed=50 + rows)
    out = _streams(rows, hidden, dtype, seed=51)
    inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(52))).to(DEV, dtype)
    weights = _int8(_weights(hidden, hc, rank, True, dtype, seed=53))
    new, mixed, w = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS)
    want_mixed, want_w = ref.hc_mix(ref.hc_inject(streams, out, inj), *weights, hc, EPS)
    for got, want in ((mixed, want_mixed), (w, want_w)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        else:       # the reference rounds each dequantized weight to bf16, the kernel scales the row's sum
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn

    six = quantize_rtn(torch.ones(rank, hc * hidden), 6, 16)
    assert not K.kernel_form(six)
    with pytest.raises(ValueError, match="INT8 per-channel"):
        K.hc_mix(streams, weights[0], six, weights[2], weights[3], hc, EPS)


def _folded_oracle(streams: torch.Tensor, hc_norm_w, down_w, up_w, inject_w, hc: int, eps: float) -> tuple:
    """`ref.hc_mix` with the two-launch mix's rounding points (`fold_norm`, module docstring): the down and
    block_inject GEMVs read the normed streams unrounded (fp32: r_s is only known after the loop), and INT8 weights
    are dequantized in fp32 (the kernels scale each row's fp32 sum; the reference rounds each weight to the scales'
    dtype). Everything else as the reference: bf16 rounding after each op. The yardstick for misplaced rounding
    points; `ref.hc_mix` stays the oracle the tolerance is taken against."""
    import torch.nn.functional as F

    from stage_worker.kernels.quant_gemv_ref import PackedWeight, dequantize_packed
    from stage_worker.kernels.rmsnorm_ref import rmsnorm

    def linear(x, w):
        if isinstance(w, PackedWeight):
            w = dequantize_packed(PackedWeight(w.words, w.scales.float(), w.bits, w.in_features, w.group))
        return F.linear(x.float(), w.float()).to(streams.dtype)

    hidden = streams.shape[-1] // hc
    normed32 = rmsnorm(streams.float(), hc_norm_w, eps, group_size=hidden)
    normed = normed32.to(streams.dtype).unflatten(-1, (hc, hidden))
    w = F.silu(linear(normed32, down_w) / hc)
    w = torch.sigmoid(linear(w, up_w)).unflatten(-1, (hc, hidden))
    mixed = (w * normed).mean(dim=-2)
    return mixed, None if inject_w is None else 2 * torch.sigmoid(linear(normed32, inject_w) / hc)


# (rows, previous block's injection, block_inject rows, INT8 down / up, dtype, (hidden, hc, rank), shipped tiles):
# every pair of rows x injection x block_inject x weights once; hc 3 / hidden 24 pads the stream and H tiles (every
# mask). Without shipped tiles: programs of 4 down rows and 16-wide H tiles (the shipped configs: 1 row, 4-8 wide),
# the same code, masks and first-program stores over fewer programs for the interpreter.
FOLD_CASES = [(1, True, True, False, torch.bfloat16, (16, 4, 4), False),
              (1, False, False, True, torch.bfloat16, (16, 4, 4), False),
              (3, True, False, True, torch.bfloat16, (24, 3, 8), True),
              (3, False, True, False, torch.bfloat16, (24, 3, 8), False),
              (4, True, True, True, torch.bfloat16, (16, 4, 4), False),
              (4, False, False, False, torch.bfloat16, (16, 4, 4), False),
              (3, True, True, False, torch.float32, (24, 3, 8), False),
              (4, True, True, True, torch.float32, (16, 4, 4), False)]


@pytest.mark.parametrize("rows,injection,block,int8,dtype,shape,shipped", FOLD_CASES,
                         ids=[f"T{c[0]}-{'inj' if c[1] else 'noinj'}-{'block' if c[2] else 'final'}-"
                              f"{'int8' if c[3] else 'float'}-{str(c[4])[6:]}{'-shipped' if c[6] else ''}"
                              for c in FOLD_CASES])
def test_folded_norm_mix_matches_reference(monkeypatch, rows, injection, block, int8, dtype, shape, shipped):
    """The two-launch mix (`fold_norm=True`: the RMSNorm folded into the down GEMV, normed formed again in the up
    kernel) against the reference: the file's tolerances (fp32: 1e-5; bf16: the bf16 tolerance, with its one moved
    rounding point; the injected streams bit-equal) and, bf16, bit-equal almost everywhere to `_folded_oracle`."""
    hidden, hc, rank = shape
    if not shipped:
        monkeypatch.setattr(K, "FOLD_DOWN_CFG", {b: (4, 16, 4) for b in (1, 4, 16)})
        monkeypatch.setattr(K, "UP_CFG", {b: (16, 512, 4) for b in (1, 4, 16)})
    streams = _streams(rows, hc * hidden, dtype, seed=60 + rows)
    weights = _weights(hidden, hc, rank, block, dtype, seed=61 + rows)
    weights = _int8(weights) if int8 else weights
    if injection:
        out = _streams(rows, hidden, dtype, seed=62 + rows)
        inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(63))).to(DEV, dtype)
        new, mixed, w = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS, fold_norm=True)
        want_new = ref.hc_inject(streams, out, inj)
        assert torch.equal(new, want_new)
        assert torch.equal(streams, _streams(rows, hc * hidden, dtype, seed=60 + rows))   # input left alone
    else:
        mixed, w = K.hc_mix(streams, *weights, hc, EPS, fold_norm=True)
        want_new = streams
    assert mixed.dtype == dtype and mixed.shape == (rows, hidden) and (w is None) == (not block)
    want = ref.hc_mix(want_new, *weights, hc, EPS)
    oracle = _folded_oracle(want_new, *weights, hc, EPS)
    for got, ref_want, fold_want in ((mixed, want[0], oracle[0]), (w, want[1], oracle[1]))[: 1 + block]:
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref_want, rtol=1e-4 if int8 else 1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), ref_want.float(), rtol=2e-2, atol=1e-2)
            assert_bf16_close(got, fold_want)


def test_fold_norm_switch_reaches_the_module_entry_points(monkeypatch):
    """`FOLD_NORM` (MOEPIPE_HC_FOLD_NORM, off unless set) picks the path `hc_mix_module` / `hc_inject_mix_module`
    (what `GatedResidual` calls with its kernel flag on) take: the two-launch mix's bits when on, the three
    launches' when off (in bf16 they differ: the moved rounding point)."""
    if "MOEPIPE_HC_FOLD_NORM" not in __import__("os").environ:
        assert not K.FOLD_NORM
    monkeypatch.setattr(K, "FOLD_DOWN_CFG", {b: (4, 16, 4) for b in (1, 4, 16)})
    monkeypatch.setattr(K, "UP_CFG", {b: (16, 512, 4) for b in (1, 4, 16)})
    module = _module(16, 4, 4, True).to(torch.bfloat16)
    streams, out = _streams(2, 64, torch.bfloat16, seed=80), _streams(2, 16, torch.bfloat16, seed=81)
    inj = (2 * torch.rand(2, 4, generator=torch.Generator().manual_seed(82))).to(DEV, torch.bfloat16)
    w = _module_weights(module)
    got = {}
    with torch.no_grad():
        for fold in (False, True):
            monkeypatch.setattr(K, "FOLD_NORM", fold)
            got[fold] = K.hc_mix_module(module, streams) + K.hc_inject_mix_module(module, streams, out, inj)
            want = K.hc_mix(streams, *w, 4, EPS, fold_norm=fold) + K.hc_inject_mix(streams, out, inj, *w, 4, EPS,
                                                                                  fold_norm=fold)
            assert all(torch.equal(a, b) for a, b in zip(got[fold], want))
    assert not torch.equal(got[True][0], got[False][0])


@pytest.fixture
def fp32_matmul_reduction():
    """cuBLAS may otherwise reduce bf16 split-K partial sums in bf16: a rounding point the model path does not
    promise and the kernels do not copy."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction = saved


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_real_shapes_int8(rows):
    """Qwen4-Exp at decode with the reports' INT8 per-channel down / up: the kernels against the reference on the
    same packed weights."""
    hidden, hc, rank = 2560, 4, 320
    streams = _streams(rows, hc * hidden, torch.bfloat16, seed=rows)
    weights = _int8(_weights(hidden, hc, rank, True, torch.bfloat16, seed=rows))
    mixed, weights_out = K.hc_mix(streams, *weights, hc, EPS)
    want_mixed, want_weights = ref.hc_mix(streams, *weights, hc, EPS)
    torch.testing.assert_close(mixed.float(), want_mixed.float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(weights_out.float(), want_weights.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("inject", [True, False], ids=["block", "final_mixer"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_real_shapes_bf16(rows, inject, fp32_matmul_reduction):
    """Qwen4-Exp at decode: 4 streams of 2560, rank 320, bf16 weights and streams."""
    hidden, hc, rank = 2560, 4, 320
    streams = _streams(rows, hc * hidden, torch.bfloat16, seed=rows)
    weights = _weights(hidden, hc, rank, inject, torch.bfloat16, seed=rows)
    mixed, weights_out = K.hc_mix(streams, *weights, hc, EPS)
    want_mixed, want_weights = ref.hc_mix(streams, *weights, hc, EPS)
    assert_bf16_close(mixed, want_mixed, max_mismatch=0.05)
    if inject:
        assert_bf16_close(weights_out, want_weights, max_mismatch=0.05)
        out = _streams(rows, hidden, torch.bfloat16, seed=rows + 1)
        assert_bf16_close(K.hc_inject(streams, out, weights_out), ref.hc_inject(streams, out, weights_out),
                          max_mismatch=0.0)


# F's tiles the timing test tries beside FOLD_DOWN_CFG: (rows a program, H tile, warps)
FOLD_VARIANTS = [(1, 512, 4), (1, 512, 8), (1, 1024, 4), (2, 1024, 8)]


@pytest.mark.gpu
def test_folded_norm_timing(monkeypatch):
    """The two-launch mix (`fold_norm`) against the three-launch one (h200-17: 2.5 + 4.3 + 5.3 us a mix, 97 mixes a
    step) at the full shape: 4 streams of 2560, rank 320, block_inject rows and the previous block's injection (the
    call most layers make), INT8 per-channel and bf16 down / up, 1 and 4 rows. Both agree with the reference first;
    then each is timed inside one CUDA graph (`conftest.graph_us`), cycling through copies of the weights that
    together exceed L2, so every mix reads its weights from HBM as in a step. Prints us a mix for three launches, two
    (FOLD_DOWN_CFG) and two with FOLD_VARIANTS' tiles, and the saving over a step's 97 mixes: the numbers that decide
    `FOLD_NORM`'s default (and F's tiles)."""
    from conftest import graph_us

    hidden, hc, rank = 2560, 4, 320
    lines = []
    for int8 in (True, False):
        base = _weights(hidden, hc, rank, True, torch.bfloat16, seed=70)
        base = _int8(base) if int8 else base
        nbytes = sum(p.words.nbytes + p.scales.nbytes if hasattr(p, "words") else p.nbytes for p in base[1:3])
        copies = []
        for _ in range(max(1, min(16, (256 << 20) // nbytes))):
            copies.append([base[0]] + [type(p)(p.words.clone(), p.scales.clone(), 8, p.in_features, p.group)
                                       if hasattr(p, "words") else p.clone() for p in base[1:3]] + [base[3]])
        for rows in (1, 4):
            streams = _streams(rows, hc * hidden, torch.bfloat16, seed=71 + rows)
            out = _streams(rows, hidden, torch.bfloat16, seed=72 + rows)
            inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(73))).to(DEV, torch.bfloat16)
            want_new = ref.hc_inject(streams, out, inj)
            want, oracle = ref.hc_mix(want_new, *base, hc, EPS), _folded_oracle(want_new, *base, hc, EPS)
            for fold in (False, True):
                new, mixed, w = K.hc_inject_mix(streams, out, inj, *base, hc, EPS, fold_norm=fold)
                assert torch.equal(new, want_new)
                for got, ref_want, fold_want in ((mixed, want[0], oracle[0]), (w, want[1], oracle[1])):
                    torch.testing.assert_close(got.float(), ref_want.float(), rtol=2e-2, atol=1e-2)
                    if fold:
                        assert_bf16_close(got, fold_want, max_mismatch=0.05)

            def timed(fold: bool) -> float:
                def call(i):
                    K.hc_inject_mix(streams, out, inj, *copies[i % len(copies)], hc, EPS, fold_norm=fold)
                return graph_us(call, calls=max(20, len(copies)), runs=5, warmup=len(copies))

            three, two = timed(False), timed(True)
            tries = []
            for cfg in FOLD_VARIANTS:
                with monkeypatch.context() as m:
                    m.setitem(K.FOLD_DOWN_CFG, K._bucket(rows), cfg)
                    tries.append(f"{cfg}: {timed(True):.1f}")
            lines.append(f"{'int8' if int8 else 'bf16'} T={rows}: three launches {three:.1f} us, two (folded, "
                         f"{K.FOLD_DOWN_CFG[K._bucket(rows)]}) {two:.1f} us, x97 mixes {97 * (three - two):+.0f} us a "
                         f"step saved | folded tiles " + ", ".join(tries))
        copies.clear()
        torch.cuda.empty_cache()
    print("\nGatedResidual mix, full shape, one CUDA graph, weights from HBM:\n" + "\n".join(lines))


def test_the_mix_kernels_compile_for_the_h200():
    """The interpreter runs none of the GPU compiler: compile the folded down kernel (INT8 weights, injection on) and
    the up kernel with FOLD, not yet run on a GPU, for sm_90 at the full shape (hc 4, H 2560, r 320) at one token,
    so a compile error or a spill shows before a device call."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import hyper_connection as M

def build(fn, sig, const, warps):
    sig = dict(sig, **dict.fromkeys(const, "constexpr"))
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))

info = {}
br, bh, warps = M.FOLD_DOWN_CFG[1]
k = build(M._hc_fold_down_kernel, dict(x_ptr="*bf16", o_ptr="*bf16", g_ptr="*bf16", y_ptr="*bf16", r_ptr="*fp32",
          nw_ptr="*bf16", down_ptr="*u8", ds_ptr="*bf16", inj_ptr="*bf16", a_ptr="*bf16", gi_ptr="*bf16", T="i32",
          stride_x="i32", stride_o="i32", stride_y="i32", eps="fp32"),
          dict(H=2560, R=320, HC=4, HC_P=4, INJECT=True, BLOCK_T=1, BLOCK_R=br, BLOCK_H=bh, Q8=True), warps)
info["fold_down"] = ptxas_info(k.asm["ptx"])
bh, bj, warps = M.UP_CFG[1]
k = build(M._hc_up_mix_kernel, dict(n_ptr="*bf16", a_ptr="*bf16", up_ptr="*u8", us_ptr="*bf16", y_ptr="*bf16",
          r_ptr="*fp32", nw_ptr="*bf16", T="i32", stride_n="i32", stride_y="i32"),
          dict(H=2560, R=320, HC=4, BLOCK_T=1, BLOCK_H=bh, BLOCK_J=bj, Q8=True, FOLD=True), warps)
info["up_fold"] = ptxas_info(k.asm["ptx"])
print(json.dumps(info))
"""
    info = run_compile_script(script, timeout=300)
    assert all(v["spill"] == 0 for v in info.values()), info
