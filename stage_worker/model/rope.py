"""Rotary position embedding on the first `rotary_dim` features of each head (partial RoPE, rotate-half layout)."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Computes cos/sin per position on the fly: positions are arbitrary per token in a flat batch.

    Text-only input has identical temporal/height/width positions, so Qwen3.5's multimodal RoPE sections reduce to
    this plain form.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # Computed on the CPU even inside `with torch.device("meta")` (the loader builds models there): arange on
        # the meta device first imports torch's reference decompositions, ~4 s of every stage process's start-up.
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, dim]; cos/sin: [T, rotary_dim]. Features past rotary_dim pass through."""
    d = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
