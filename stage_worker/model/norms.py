"""RMS norms of the family. All compute in float32 and return the input dtype, as the reference does."""

from __future__ import annotations

import torch
from torch import nn

from stage_worker.kernels.flags import NONE, KernelFlags
from stage_worker.model.activations import activation as act_fn


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored around zero and applied as (1 + w).

    With `group_size` the last dimension is normalised in independent groups (one per hyper-connection stream) but
    scaled by one weight vector over the full width.
    """

    kernels: KernelFlags = NONE

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.rmsnorm and x.is_cuda:
            from stage_worker.kernels.rmsnorm import rmsnorm

            return rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, self.group_size).view_as(x)
        h = x.float()
        if self.group_size is not None:
            h = h.unflatten(-1, (-1, self.group_size))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group_size is not None:
            h = h.flatten(-2)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm of the sum): the residual add that ends one block and the norm that starts the next,
        one launch with the kernel flag on."""
        if self.kernels.rmsnorm and x.is_cuda and self.group_size is None and x.shape[-1] <= 16384:
            from stage_worker.kernels.rmsnorm import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        s = x + residual
        return s, self(s)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the Gated DeltaNet output, multiplied by act(gate). Weight is applied as-is (not 1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.act = act_fn(activation)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * self.act(gate.float())).to(dtype)
