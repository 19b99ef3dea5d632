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
            assert_bf16_close(got, want, 0.02)


@pytest.mark.parametrize("splits,rows,int8,rank", [
    (2, 1, False, 12), (2, 1, True, 12), (3, 3, False, 12), (3, 3, True, 12),
    (6, 5, False, 12),      # the largest config bucket (16: more than 4 rows), one partial row block
    (5, 17, True, 4),       # two row blocks (the second holds one row): a counter a tile and row block
], ids=["2-1-bf16", "2-1-int8", "3-3-bf16", "3-3-int8", "6-5-bf16", "5-17-int8"])
def test_down_split_over_inputs_matches_reference(monkeypatch, splits, rows, int8, rank):
    """The down GEMV with its inputs cut over several programs a tile (the last adds the partial sums): the
    reference's values, the injection rows too, and the same result on a second call (the counters are left at 0).
    3 slices of 4 x 40 inputs do not divide evenly; 6 (of 32 each) leave the last with nothing to read. bf16 and
    INT8 weights share the split's sums and counters: two row blocks (17 rows, the costliest case under the
    interpreter) are checked on INT8 alone, at rank 4 (two down tiles and two injection tiles, each with a counter
    per row block: half rank 12's programs)."""
    hidden, hc = 40, 4
    cfg = K.DOWN_CFG_Q8 if int8 else K.DOWN_CFG
    for bucket in (1, 4, 16):
        monkeypatch.setitem(cfg, bucket, (2, 32, 4, splits))
    streams = _streams(rows, hc * hidden, torch.bfloat16, seed=60 + rows)
    weights = _weights(hidden, hc, rank, True, torch.bfloat16, seed=61)
    if int8:
        weights = _int8(weights)
    mixed, w = K.hc_mix(streams, *weights, hc, EPS)
    want_mixed, want_w = ref.hc_mix(streams, *weights, hc, EPS)
    for got, want in ((mixed, want_mixed), (w, want_w)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    again = K.hc_mix(streams, *weights, hc, EPS)
    assert torch.equal(again[0], mixed) and torch.equal(again[1], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,hc,rank", [(1, 32, 4, 8), (5, 40, 3, 6), (17, 24, 4, 5)])
def test_inject_then_mix_in_one_call_matches_reference(dtype, rows, hidden, hc, rank):
    """The previous block's injection fused into the mix's first kernel = inject, then mix (reference)."""
    streams = _streams(rows, hc * hidden, dtype, seed=40 + rows)
    out = _streams(rows, hidden, dtype, seed=41 + rows)
    inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(42))).to(DEV, dtype)
    weights = _weights(hidden, hc, rank, True, dtype, seed=43)
    new, mixed, w = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS)
    want_new = ref.hc_inject(streams, out, inj)
    want_mixed, want_w = ref.hc_mix(want_new, *weights, hc, EPS)
    assert torch.equal(new, want_new)
    for got, want in ((mixed, want_mixed), (w, want_w)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_bf16_close(got, want, 0.02)
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
    """`hc_mix_module` gives `GatedResidual.mix`, through the kernels at decode sizes (and up to `EAGER_ROWS` outside
    a graph capture) and the reference above them;
    with the module's flag on, `mix` itself (on CUDA) goes through it and must not come back."""
    module = _module(32, 4, 8, inject)
    for rows in (2, K.DECODE_ROWS + 1, K.EAGER_ROWS + 1):
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
@pytest.mark.parametrize("splits", [0, 5], ids=["shipped", "5slices"])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_real_shapes_int8(rows, splits, monkeypatch):
    """Qwen4-Exp at decode with the reports' INT8 per-channel down / up: the kernels against the reference on the
    same packed weights (the shipped launch configs, and the down GEMV's inputs in 5 slices, whose last-program
    sum only shows its races on a GPU: ten calls give the same bits)."""
    hidden, hc, rank = 2560, 4, 320
    if splits:
        for bucket in (1, 4, 16):
            monkeypatch.setitem(K.DOWN_CFG_Q8, bucket, (2, 2048, 4, splits))
    streams = _streams(rows, hc * hidden, torch.bfloat16, seed=rows)
    weights = _int8(_weights(hidden, hc, rank, True, torch.bfloat16, seed=rows))
    mixed, weights_out = K.hc_mix(streams, *weights, hc, EPS)
    want_mixed, want_weights = ref.hc_mix(streams, *weights, hc, EPS)
    torch.testing.assert_close(mixed.float(), want_mixed.float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(weights_out.float(), want_weights.float(), rtol=2e-2, atol=1e-2)
    for _ in range(10):
        again = K.hc_mix(streams, *weights, hc, EPS)
        assert torch.equal(again[0], mixed) and torch.equal(again[1], weights_out)


@pytest.mark.gpu
@pytest.mark.parametrize("inject", [True, False], ids=["block", "final_mixer"])
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
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
