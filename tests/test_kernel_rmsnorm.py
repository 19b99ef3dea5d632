"""The RMSNorm kernel against its PyTorch reference, and the reference against the model's norm.

Without CUDA the kernel runs on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported): tiny shapes,
few cases. With CUDA the same tests run natively and the `gpu` test adds the real widths.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import rmsnorm as K  # noqa: E402
from stage_worker.kernels.rmsnorm_ref import rmsnorm as rmsnorm_ref  # noqa: E402
from stage_worker.model.norms import ZeroCentredRMSNorm  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
EPS = 1e-6


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3
    w = torch.randn(width, generator=g) * 0.1   # as hf_oracle's noise: the norm is not the identity
    return x.to(DEV, dtype), w.to(DEV, dtype)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.02) -> None:
    """Within bf16 tolerance, and bit-equal almost everywhere: a rounding point that moved shifts a third or more of
    the elements by one ulp, which a tolerance alone would let through."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    frac = (got != want).float().mean().item()
    assert frac <= max_mismatch, f"{frac:.1%} of elements differ from the reference: a rounding point moved?"


@pytest.mark.parametrize("group_size", [None, 8])
def test_reference_is_the_model_norm(group_size):
    norm = ZeroCentredRMSNorm(32, EPS, group_size=group_size)
    x, w = _inputs(5, 32, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(w.cpu())
        assert torch.equal(rmsnorm_ref(x.cpu(), norm.weight, EPS, group_size), norm(x.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,group_size,zero_centred", [
    (72, None, True),       # one group, non-power-of-two width
    (72, 24, True),         # three streams of 24
    (2200, 1100, True),     # groups wider than one 1024 block: the chunk loop and its mask
    (40, None, False),      # weight applied as is
])
def test_kernel_matches_reference(dtype, width, group_size, zero_centred):
    x, w = _inputs(3, width, dtype, seed=width)
    got = K.rmsnorm(x, w, EPS, group_size, zero_centred)
    want = rmsnorm_ref(x, w, EPS, group_size, zero_centred)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_close(got, want)


def test_kernel_takes_strided_rows_and_leading_dims():
    x, w = _inputs(6, 48, torch.float32)
    x = x.view(2, 3, 48)[:, :2]                 # rows not packed
    torch.testing.assert_close(K.rmsnorm(x, w, EPS, 16), rmsnorm_ref(x, w, EPS, 16), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("width,group_size", [(10240, 2560), (2560, None), (256, None)])
def test_real_widths_bf16(rows, width, group_size):
    """hc_norm (4 x 2560), a hidden-width norm, a per-head q/k norm."""
    x, w = _inputs(rows, width, torch.bfloat16, seed=rows)
    assert_bf16_close(K.rmsnorm(x, w, EPS, group_size), rmsnorm_ref(x, w, EPS, group_size), max_mismatch=0.01)


@pytest.mark.parametrize("dtype,width", [(torch.float32, 48), (torch.bfloat16, 40),
                                         pytest.param(torch.bfloat16, 2048, marks=pytest.mark.gpu)])
def test_add_rmsnorm_matches_reference_and_the_model(dtype, width):
    """The fused residual add + norm equals the add, then the norm (reference and `ZeroCentredRMSNorm.add_forward`
    on the PyTorch path)."""
    from stage_worker.kernels.rmsnorm_ref import add_rmsnorm as add_rmsnorm_ref

    x, w = _inputs(3, width, dtype, seed=4)
    r, _ = _inputs(3, width, dtype, seed=5)
    s, y = K.add_rmsnorm(x, r, w, EPS)
    s_ref, y_ref = add_rmsnorm_ref(x, r, w, EPS)
    norm = ZeroCentredRMSNorm(width, EPS).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        s_mod, y_mod = norm.add_forward(x, r)       # kernel flags off: the PyTorch path
    for got, want in ((s, s_ref), (y, y_ref), (s_mod, s_ref), (y_mod, y_ref)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_bf16_close(got, want)
