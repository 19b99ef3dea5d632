"""PyTorch reference of the zero-centred (optionally grouped) RMSNorm kernel in `rmsnorm.py`.

The same ops in the same order as `stage_worker.model.norms.ZeroCentredRMSNorm`, so it equals the model's norm bit
for bit in float32; the Triton kernel is tested against this function.
"""

from __future__ import annotations

import torch


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None,
            zero_centred: bool = True) -> torch.Tensor:
    """x [..., D] -> [..., D]: each group of `group_size` features (all D if None) normalised in fp32, scaled by
    (1 + weight) (or weight as is when not zero-centred) over the full width, cast back to x's dtype."""
    h = x.float()
    if group_size is not None:
        h = h.unflatten(-1, (-1, group_size))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        h = h.flatten(-2)
    scale = 1.0 + weight.float() if zero_centred else weight.float()
    return (h * scale).to(x.dtype)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add (rounded to x's dtype) and the zero-centred norm of the sum."""
    s = x + residual
    return s, rmsnorm(s, weight, eps)
