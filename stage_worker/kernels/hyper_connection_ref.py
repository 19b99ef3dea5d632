"""PyTorch reference of the fused hyper-connection kernels in `hyper_connection.py`.

Written from weights rather than from a `GatedResidual` so the kernels and this reference take the same arguments;
the ops, and therefore the points where bf16 rounds, are those of `GatedResidual.mix` and `GatedResidual.inject`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stage_worker.kernels.rmsnorm_ref import rmsnorm


def hc_mix(streams: torch.Tensor, hc_norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
           inject_w: torch.Tensor | None, hc: int, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc], or None for the final mixer); down_w
    and up_w float, or `PackedWeight`s."""
    hidden = streams.shape[-1] // hc
    normed = rmsnorm(streams, hc_norm_w, eps, group_size=hidden)
    w = F.silu(_linear(normed, down_w) / hc)
    w = torch.sigmoid(_linear(w, up_w)).unflatten(-1, (hc, hidden))
    mixed = (w * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    if inject_w is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(F.linear(normed, inject_w) / hc)


def _linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w^T for a float weight, or a packed one (`PackedWeight`: a reports-mixed checkpoint's INT8 down / up) as
    `PackedLinear` runs it."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    from stage_worker.model.quant_linear import packed_matmul

    return packed_matmul(x, w)


def hc_inject(streams: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams [T, hc*H] + the block output [T, H] scaled per stream by inject [T, hc] -> new streams."""
    return streams + (out[:, None, :] * inject[:, :, None]).flatten(-2)
