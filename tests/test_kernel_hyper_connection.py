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
@pytest.mark.parametrize("rows", [1, 4, 64])
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


# ------------------------------------------------------------------ hc_fold_norm: the mix in two launches (no P)

def _fold_reference(streams, hc_norm_w, down_w, up_w, inject_w, hc: int, eps: float):
    """`hyper_connection_ref.hc_mix` with the one change the fold makes by design: the down and block_inject GEMVs
    read the normed rows unrounded (fp32; the fold computes sum_s rstd_s * sum_k D[r, k] x_k (1 + w_k), which equals
    this up to fp32 reassociation) and round once after the dot; every other rounding point is the reference's (the
    up GEMV's gate multiplies the bf16 normed rows, as B recomputes them)."""
    import torch.nn.functional as F

    dt, hidden = streams.dtype, streams.shape[-1] // hc
    h = streams.float().unflatten(-1, (hc, hidden))
    exact = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * (1.0 + hc_norm_w.float())
    normed = exact.to(dt)                                   # = rmsnorm_ref.rmsnorm: the same ops in the same order
    w = F.silu(F.linear(exact, down_w.float()).to(dt) / hc)
    w = torch.sigmoid(F.linear(w, up_w)).unflatten(-1, (hc, hidden))
    mixed = (w * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    if inject_w is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(F.linear(exact, inject_w.float()).to(dt) / hc)


def assert_fold_close(got: torch.Tensor, want_fold: torch.Tensor, want_ref: torch.Tensor) -> None:
    """bf16 output of the two-launch mix: bf16-close to the fold reference (`assert_bf16_close`: every rounding
    point but the fold's own in place), and to the true reference within the bound the fold's reordering allows.
    That bound: the reference's down input is normed_k = n_k (1 + d_k), |d_k| <= 2^-8 (bf16, to nearest), so its
    fp32 dot differs from the fold's by sum_k D[r, k] n_k d_k: at most 2^-8 sum_k |D[r, k] n_k| (worst case), about
    2^-8 / sqrt(3) * ||D[r] * n|| for random signs, i.e. ~0.2% of a typical |a| -- below one bf16 ulp (2^-8 relative),
    so `a` and the block_inject weights move by at most ~1 ulp, and what follows (up GEMV over R values, sigmoid,
    gate * normed, the mean) by a few ulps: rtol 2e-2 / atol 1e-2 as the other bf16 tests, with no bound on the
    share of elements one ulp off (tiny shapes: up to ~20% of them, 5-12% typical)."""
    assert_bf16_close(got, want_fold)
    torch.testing.assert_close(got.float(), want_ref.float(), rtol=2e-2, atol=1e-2)


FOLD_CASES = [
    # rows, hidden, hc, rank, block_inject rows, injection first, K chunk of a stream (None: the launch table's)
    (1, 32, 4, 8, True, False, None),      # one decode token
    (3, 40, 3, 6, False, True, None),      # the final mixer, hc 3, H not a power of two (masked chunk)
    (4, 48, 4, 24, True, True, None),      # the demo model's mixer
    (1, 48, 4, 24, False, True, None),
    (4, 40, 3, 6, True, False, 16),        # three chunks a stream, the last one half masked
    (3, 48, 4, 24, True, True, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,hc,rank,block_inject,injection,chunk", FOLD_CASES)
def test_fold_norm_matches_reference(monkeypatch, dtype, rows, hidden, hc, rank, block_inject, injection, chunk):
    """The two-launch mix (`fold=True`) against the reference (fp32: tightly; bf16: `assert_fold_close`), with and
    without the previous block's injection and the block_inject rows; its new streams are the three-launch path's,
    bit for bit."""
    if chunk is not None:
        monkeypatch.setattr(K, "FOLD_DOWN_CFG", {b: (1, chunk, 4) for b in (1, 4)})
    streams = _streams(rows, hc * hidden, dtype, seed=60 + rows)
    weights = _weights(hidden, hc, rank, block_inject, dtype, seed=61 + hidden)
    if injection:
        out = _streams(rows, hidden, dtype, seed=62)
        inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(63))).to(DEV, dtype)
        new, mixed, w = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS, fold=True)
        new3 = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS)[0]
        assert torch.equal(new, new3)
        want_new = ref.hc_inject(streams, out, inj)
        if dtype == torch.float32:
            torch.testing.assert_close(new, want_new, rtol=1e-6, atol=1e-6)
        else:
            assert_bf16_close(new, want_new, max_mismatch=0.0)
    else:
        mixed, w = K.hc_mix(streams, *weights, hc, EPS, fold=True)
        want_new = streams
    assert (w is None) == (not block_inject)
    want = ref.hc_mix(want_new, *weights, hc, EPS)
    want_fold = _fold_reference(want_new, *weights, hc, EPS)
    for i, got in enumerate((mixed, w) if block_inject else (mixed,)):
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-5)
        else:
            assert_fold_close(got, want_fold[i], want[i])
    assert torch.equal(streams, _streams(rows, hc * hidden, dtype, seed=60 + rows))   # input left alone


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.bfloat16, 3), (torch.bfloat16, 4)])
def test_fold_norm_int8_weights(dtype, rows):
    """INT8 per-channel down / up (reports-mixed) through the two launches, the injection on and odd sizes (H 48,
    R 24, hc 4, the demo model's): the reference on the same packed weights (tolerances of
    `test_int8_mix_weights_are_read_in_place`: the reference rounds each dequantized weight), the three-launch path's
    new streams bit for bit."""
    hidden, hc, rank = 48, 4, 24
    streams = _streams(rows, hc * hidden, dtype, seed=70 + rows)
    out = _streams(rows, hidden, dtype, seed=71)
    inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(72))).to(DEV, dtype)
    weights = _int8(_weights(hidden, hc, rank, True, dtype, seed=73))
    new, mixed, w = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS, fold=True)
    new3, mixed3, w3 = K.hc_inject_mix(streams, out, inj, *weights, hc, EPS)
    assert torch.equal(new, new3)
    want_mixed, want_w = ref.hc_mix(ref.hc_inject(streams, out, inj), *weights, hc, EPS)
    for got, want, three in ((mixed, want_mixed, mixed3), (w, want_w, w3)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got, three, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
            torch.testing.assert_close(got.float(), three.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_norm_rstd_is_each_streams_own(dtype):
    """Streams whose norms differ by 10^4 (x 0.01, 1, 30, 100): each stream's products must be scaled by its own
    rstd. One applied to the wrong stream, or a norm over the whole row instead of a stream, would be off by orders
    of magnitude, far outside these tolerances; the norm weight differing by stream checks that (1 + w) goes with
    its stream too."""
    rows, hidden, hc, rank = 3, 40, 4, 8
    scale = torch.tensor([0.01, 1.0, 30.0, 100.0]).repeat_interleave(hidden)
    streams = (_streams(rows, hc * hidden, torch.float32, seed=80).cpu() * scale).to(DEV, dtype)
    weights = _weights(hidden, hc, rank, True, dtype, seed=81)
    weights[0] = (torch.tensor([-0.5, 0.0, 0.5, 1.0]).repeat_interleave(hidden) + weights[0].float().cpu()).to(DEV,
                                                                                                              dtype)
    # the down / inject rows weigh each stream alike, so every stream's term matters in every output
    mixed, w = K.hc_mix(streams, *weights, hc, EPS, fold=True)
    want = ref.hc_mix(streams, *weights, hc, EPS)
    if dtype == torch.float32:
        torch.testing.assert_close(mixed, want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, want[1], rtol=1e-5, atol=1e-5)
    else:
        want_fold = _fold_reference(streams, *weights, hc, EPS)
        assert_fold_close(mixed, want_fold[0], want[0])
        assert_fold_close(w, want_fold[1], want[1])


def test_fold_norm_flag_routes_the_module(monkeypatch):
    """`hc_fold_norm` (named only, not in "all") takes `GatedResidual`'s kernel mixes through the two launches at
    decode sizes; off, or above DECODE_ROWS (eager batches: a BLOCK_T of 16 spills thousands of bytes in the fold),
    the three kernels."""
    from stage_worker.kernels.flags import NOT_IN_ALL

    assert "hc_fold_norm" in NOT_IN_ALL and not KernelFlags.parse("all").hc_fold_norm
    assert KernelFlags.parse("all,hc_fold_norm").hc_fold_norm
    calls = []
    real = K._mix_fold
    monkeypatch.setattr(K, "_mix_fold", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    module = _module(32, 4, 8, True)
    with torch.no_grad():
        for flags, fold in ((KernelFlags(hyper_connection=True), False),
                            (KernelFlags(hyper_connection=True, hc_fold_norm=True), True)):
            module.kernels = flags
            for rows in (1, K.DECODE_ROWS + 1):
                calls.clear()
                streams = _streams(rows, 128, torch.float32, seed=90 + rows)
                out = _streams(rows, 32, torch.float32, seed=91)
                inj = torch.rand(rows, 4, generator=torch.Generator().manual_seed(92)).to(DEV)
                mixed, w = K.hc_mix_module(module, streams)
                new, mixed2, w2 = K.hc_inject_mix_module(module, streams, out, inj)
                assert calls == ([rows, rows] if fold and rows <= K.DECODE_ROWS else [])
                want = ref.hc_mix(streams, *_module_weights(module), 4, EPS)
                want_new = ref.hc_inject(streams, out, inj)
                want2 = ref.hc_mix(want_new, *_module_weights(module), 4, EPS)
                for got, exp in ((mixed, want[0]), (w, want[1]), (new, want_new), (mixed2, want2[0]), (w2, want2[1])):
                    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pdl,l2pf,contiguous", [(True, True, True), (True, False, True), (False, False, True),
                                                 (True, True, False)])
def test_fold_norm_launches_take_pdl(monkeypatch, pdl, l2pf, contiguous):
    """The two launches take PDL and the L2 prefetch as the three do (`pdl_usable`, `l2_prefetch_usable`; the
    weight tile before the wait), and neither where a weight is copied for the mix."""
    from stage_worker.kernels import common

    monkeypatch.setattr(common, "_PDL", pdl)
    monkeypatch.setattr(common, "_L2PF", l2pf)
    monkeypatch.setattr(common, "_pdl_device", lambda x: True)          # a CUDA device of compute capability 9
    calls = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.name, kw["PDL"], kw["L2PF"], kw["launch_pdl"]))

    for name in ("_hc_prep_kernel", "_hc_down_kernel", "_hc_up_mix_kernel", "_hc_down_fold_kernel",
                 "_hc_up_mix_fold_kernel"):
        monkeypatch.setattr(K, name, Spy(name))
    hc, H, R = 4, 32, 8
    down = torch.randn(R, hc * H) if contiguous else torch.randn(hc * H, R).t()
    K.hc_inject_mix(torch.randn(1, hc * H), torch.randn(1, H), torch.rand(1, hc), torch.randn(hc * H), down,
                    torch.randn(hc * H, R), torch.randn(hc, hc * H), hc, EPS, fold=True)
    on = pdl and contiguous
    assert calls == [("_hc_down_fold_kernel", on, on and l2pf, on), ("_hc_up_mix_fold_kernel", on, on and l2pf, on)]


# Compiled for sm_90 in a process without the interpreter (tests/sm90_compile.py): the three-launch kernels and the
# two fold kernels at the full shape (H 2560, hc 4, R 320, INT8 down / up, the injection on, PDL), T = 1 and 4 with
# the launch tables' entries: registers, spills, and the PDL prologue (weight loads, no store, before the wait).
FOLD_COMPILE = r"""
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import hyper_connection as K

def build(name, fn, sig, const, num_warps):
    sig = dict(sig)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=1))
    ptx = k.asm["ptx"]
    head = ptx.split(".entry", 1)[1].split("griddepcontrol.wait", 1)[0]
    return dict(name=name, waits=ptx.count("griddepcontrol.wait"), loads_before=head.count("ld.global"),
                stores_before=head.count("st.global"), **ptxas_info(ptx))

H, HC, R, B = 2560, 4, 320, "*bf16"
out = []
for T in (1, 4):
    bt = triton.next_power_of_2(T)
    br, bk, wd = K.DOWN_CFG_Q8[K._bucket(T)]
    fr, fk, fd = K.FOLD_DOWN_CFG_Q8[K._bucket(T)]
    bh, bj, wu = K.UP_CFG_Q8[K._bucket(T)]
    out += [
        build(f"P T={T}", K._hc_prep_kernel, dict(x_ptr=B, o_ptr=B, g_ptr=B, y_ptr=B, nw_ptr=B, n_ptr=B, stride_x="i32",
              stride_o="i32", stride_y="i32", eps="fp32"), dict(H=H, HC=HC, INJECT=True, BLOCK=4096, PDL=True), 8),
        build(f"A T={T}", K._hc_down_kernel, dict(n_ptr=B, down_ptr="*u8", ds_ptr=B, inj_ptr=B, a_ptr=B, g_ptr=B,
              T="i32"), dict(H=H, R=R, HC=HC, BLOCK_T=bt, BLOCK_R=br, BLOCK_K=bk, Q8=True, PDL=True), wd),
        build(f"B T={T}", K._hc_up_mix_kernel, dict(n_ptr=B, a_ptr=B, up_ptr="*u8", us_ptr=B, y_ptr=B, T="i32",
              stride_y="i32"), dict(H=H, R=R, HC=HC, BLOCK_T=bt, BLOCK_H=bh, BLOCK_J=bj, Q8=True, PDL=True), wu),
        build(f"A_fold T={T}", K._hc_down_fold_kernel, dict(x_ptr=B, o_ptr=B, gin_ptr=B, nw_ptr=B, down_ptr="*u8",
              ds_ptr=B, inj_ptr=B, a_ptr=B, g_ptr=B, rstd_ptr="*fp32", T="i32", stride_x="i32", stride_o="i32",
              eps="fp32"), dict(H=H, R=R, HC=HC, HCP=4, INJECT=True, BLOCK_T=bt, BLOCK_R=fr, BLOCK_K=fk,
              Q8=True, PDL=True), fd),
        build(f"B_fold T={T}", K._hc_up_mix_fold_kernel, dict(x_ptr=B, o_ptr=B, gin_ptr=B, nw_ptr=B,
              rstd_ptr="*fp32", a_ptr=B, up_ptr="*u8", us_ptr=B, y_ptr=B, ns_ptr=B, T="i32", stride_x="i32",
              stride_o="i32", stride_y="i32", stride_ns="i32"), dict(H=H, R=R, HC=HC, INJECT=True, BLOCK_T=bt,
              BLOCK_H=bh, BLOCK_J=bj, Q8=True, PDL=True), wu)]
print(json.dumps(out))
"""


def test_fold_kernels_compile_for_the_h200():
    """Both fold kernels compile for sm_90 at the full shape with the launch tables' entries: no spill, a wait
    (each program passes one), weight loads and no store before it. Prints registers and spills of P, A, B and the
    two fold kernels."""
    from sm90_compile import run_compile_script

    got = {g["name"]: g for g in run_compile_script(FOLD_COMPILE, timeout=900)}
    print("\n" + "\n".join(f"{n}: {g['regs']} registers, {g['spill']} bytes spilled" for n, g in got.items()))
    for name in ("A_fold T=1", "B_fold T=1", "A_fold T=4", "B_fold T=4"):
        g = got[name]
        assert g["waits"] >= 1 and g["loads_before"] > 0 and g["stores_before"] == 0, g   # A: one a branch
        assert g["spill"] == 0, g


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] >= 9), reason="PDL needs compute capability 9")
@pytest.mark.parametrize("rows", [1, 4])
def test_fold_norm_timed_in_a_graph_with_pdl(rows):
    """The full-shape inject + mix (hc 4, H 2560, rank 320, INT8 down / up as reports-mixed, bf16 streams) in three
    launches and in two (`hc_fold_norm`), each replayed from a CUDA graph with PDL, every call on the next of 16
    weight sets so the weights come from HBM as in the model (`bench/tune_kernels.py --only hc_q8`'s setup): both
    times printed; the new streams bit for bit, the outputs within `assert_fold_close`'s bound of each other."""
    from conftest import graph_us

    from stage_worker.kernels import common

    hc, hidden, rank, dt = 4, 2560, 320, torch.bfloat16
    sets = [_int8(_weights(hidden, hc, rank, True, dt, seed=i)) for i in range(16)]
    streams = _streams(rows, hc * hidden, dt, seed=1)
    out = _streams(rows, hidden, dt, seed=2)
    inj = (2 * torch.rand(rows, hc, generator=torch.Generator().manual_seed(3))).to(DEV, dt)
    before = common._PDL
    common.set_pdl(True)
    try:
        results, times = [], []
        for fold in (False, True):
            results.append(K.hc_inject_mix(streams, out, inj, *sets[0], hc, EPS, fold=fold))
            times.append(graph_us(lambda i: K.hc_inject_mix(streams, out, inj, *sets[i % 16], hc, EPS, fold=fold),
                                  calls=48, runs=7, warmup=2))
    finally:
        common.set_pdl(before)
    print(f"\ninject + mix T={rows} INT8 full shape, graph + PDL: three launches {times[0]:.2f} us, two "
          f"(hc_fold_norm) {times[1]:.2f} us")
    (new3, mixed3, w3), (new2, mixed2, w2) = results
    assert torch.equal(new3, new2)
    for a, b in ((mixed2, mixed3), (w2, w3)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2)
