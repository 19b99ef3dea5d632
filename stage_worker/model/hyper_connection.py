"""Hyper-connections: the residual is `hc_count` streams of `hidden_size`.

Before a block, each stream is RMS-normalised, per-feature mixing weights come from a rank-`hc_lowrank` bottleneck,
the weighted streams are averaged into the block input, and each stream receives its own share of the block output.
At 001 §2's precision these weights are ~23% of what a decode step reads, so they matter for speed later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stage_worker.kernels.flags import NONE, KernelFlags
from stage_worker.model.norms import ZeroCentredRMSNorm


class GatedResidual(nn.Module):
    kernels: KernelFlags = NONE

    def __init__(self, hidden: int, hc_count: int, rank: int, eps: float, inject: bool = True) -> None:
        super().__init__()
        self.hidden, self.hc = hidden, hc_count
        width = hidden * hc_count
        self.hc_norm = ZeroCentredRMSNorm(width, eps, group_size=hidden)
        self.input_mix_weight_down = nn.Linear(width, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, hc_count, bias=False) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, hc*H] -> (block input [T, H], per-stream injection weights [T, hc] or None)."""
        if self.kernels.hyper_connection and streams.is_cuda:
            from stage_worker.kernels.hyper_connection import hc_mix_module

            return hc_mix_module(self, streams)
        normed = self.hc_norm(streams)
        w = F.silu(self.input_mix_weight_down(normed) / self.hc)
        w = torch.sigmoid(self.input_mix_weight_up(w)).unflatten(-1, (self.hc, self.hidden))
        mixed = (w * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)

    def inject_mix(self, streams: torch.Tensor, block_out: torch.Tensor,
                   weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`inject` of the previous block's output, then `mix`: (new streams, block input, injection weights).
        One call so the kernels can do the injection inside the mix's first launch."""
        if self.kernels.hyper_connection and streams.is_cuda:
            from stage_worker.kernels.hyper_connection import hc_inject_mix_module

            return hc_inject_mix_module(self, streams, block_out, weights)
        streams = self.inject(streams, block_out, weights)
        return (streams, *self.mix(streams))

    @staticmethod
    def inject(streams: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return streams + (block_out[:, None, :] * weights[:, :, None]).flatten(-2)

    def inject_fast(self, streams: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`inject` in one launch when the kernel flag is on (the last injection of a stage's layers)."""
        if self.kernels.hyper_connection and streams.is_cuda:
            from stage_worker.kernels.hyper_connection import hc_inject

            return hc_inject(streams, block_out, weights)
        return self.inject(streams, block_out, weights)
