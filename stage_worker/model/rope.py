"""Rotary position embedding on the first `rotary_dim` features of each head (partial RoPE, rotate-half layout)."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_frequencies(dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin factor) as transformers' `ROPE_INIT_FUNCTIONS` compute them, for `dim` =
    int(head_dim * partial_rotary_factor) (odd: ceil(dim / 2) frequencies, over `dim`). `scaling`: the config's
    normalised `rope_scaling` (`shared.model_config`), empty or None for plain RoPE. Always on the CPU."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, inv_freq, scaling)
    return inv_freq, 1.0           # default, mrope (text positions), dynamic (within max_position_embeddings)


def _yarn(dim: int, theta: float, inv_freq: torch.Tensor, p: dict) -> tuple[torch.Tensor, float]:
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


class Rotary(nn.Module):
    """Computes cos/sin per position on the fly: positions are arbitrary per token in a flat batch.

    Text-only input has identical temporal/height/width positions, so Qwen3.5's multimodal RoPE sections reduce to
    this plain form. `rotary_dim` is the rotated width (even); `dim`, when given, the config's int(head_dim *
    partial_rotary_factor), which transformers divides by even when it is odd (then rotary_dim = dim + 1).
    """

    def __init__(self, rotary_dim: int, theta: float, scaling: dict | None = None, dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta, self.scaling, self.dim = theta, dict(scaling or {}), dim or rotary_dim
        # Computed on the CPU even inside `with torch.device("meta")` (the loader builds models there): arange on
        # the meta device first imports torch's reference decompositions, ~4 s of every stage process's start-up.
        inv_freq, self.attention_scaling = rope_frequencies(self.dim, theta, self.scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        """The inverse frequencies (CPU), for refilling the buffer after `to_empty`."""
        return rope_frequencies(self.dim, self.theta, self.scaling)[0]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:          # YaRN: transformers scales cos and sin (fp32, then the cast)
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, dim]; cos/sin: [T, rotary_dim]. Features past rotary_dim pass through."""
    d = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
