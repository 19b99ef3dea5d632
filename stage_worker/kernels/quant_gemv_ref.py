"""PyTorch reference for `quant_gemv.py`: a dense Linear weight kept as compressed-tensors writes it
(`pack-quantized`, symmetric INT4/6/8, one scale per row or per group of inputs), dequantized, then matmul.

Layout (`PackedWeight`): `words` int32 [N, W], `scales` [N, G] (G = 1: one scale a row; else G = ceil(K / group),
a last group shorter than `group` taking its own column). Input column k of a row is stored as q + 2^(bits-1) (0 ..
2^bits - 1 means -2^(bits-1) .. 2^(bits-1) - 1), either in the dense bit stream (compressed-tensors >= 0.20: value
k at bit k * bits of the row, crossing words) or, in older checkpoints, 32 // bits values a word; the word count
tells them apart (`quant_weight.is_dense`; the two are the same placement for 4 and 8 bits). The loader's reader
(`stage_worker/model/quant_weight.py`) is the one authority on the layout: this module reuses it, and adds a faster
unpack for the layouts whose values never cross a word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stage_worker.model import quant_weight as qw

CHUNK = 1 << 22          # weight elements dequantized at a time (a 248k x 2560 lm_head never held in float at once)


@dataclass
class PackedWeight:
    words: torch.Tensor            # int32 [N, W]
    scales: torch.Tensor           # [N, G], the checkpoint's dtype
    bits: int                      # 4, 6 or 8
    in_features: int               # K
    group: int                     # inputs per scale column (K: one scale a row)

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    @property
    def dense(self) -> bool:
        return qw.is_dense(self.words.shape[1], self.bits, self.in_features)

    @property
    def groups(self) -> int:
        return self.scales.shape[1]

    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() * self.scales.element_size()


def unpack_values(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The signed values [rows, k] of `words` (int8), in int32 arithmetic on whole columns (the CPU and prefill
    path's hot loop: 2-3x faster than `quant_weight.unpack`'s int64 gathers). Where whole values sit in each word
    (4 and 8 bits, or the older layout), one broadcast shift; the dense stream of other widths by its period (6 bits:
    16 values in 3 words), each value of the period from static shifts of one or two word columns."""
    if words.dtype != torch.int32 or bits > 8:
        return qw.unpack(words, bits, k)
    N, W = words.shape
    dense = qw.is_dense(W, bits, k)
    mask = (1 << bits) - 1
    if not dense or 32 % bits == 0:
        shifts = torch.arange(0, 32 // bits * bits, bits, dtype=torch.int32, device=words.device)
        u = ((words[..., None] >> shifts) & mask).flatten(-2)
    else:
        g = math.gcd(bits, 32)
        per, span = 32 // g, bits // g                       # values, words of a period
        wp = torch.nn.functional.pad(words, (0, -W % span)).view(N, -1, span)
        cols = []
        for j in range(per):
            c, off = divmod(j * bits, 32)
            v = (wp[..., c] >> off) & ((1 << min(bits, 32 - off)) - 1)    # (the mask drops the sign fill)
            if off + bits > 32:
                v = v | ((wp[..., c + 1] & ((1 << off + bits - 32) - 1)) << (32 - off))
            cols.append(v)
        u = torch.stack(cols, -1).flatten(-2)
    return (u[:, :k] - (1 << bits - 1)).to(torch.int8)


def dequantize_packed(pw: PackedWeight, dtype: torch.dtype = torch.float32, start: int = 0,
                      end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of the float weight [N, K] in `dtype`, computed in the scales' dtype as the library (and
    the loader's dequantize-at-load path) does, so both paths give the same weights."""
    end = pw.out_features if end is None else end
    q = unpack_values(pw.words[start:end], pw.bits, pw.in_features)
    s = pw.scales[start:end]
    K, g = pw.in_features, pw.group
    if s.shape[1] == 1:
        return (q.to(s.dtype) * s).to(dtype)
    G = s.shape[1]
    pad = G * g - K
    v = torch.nn.functional.pad(q, (0, pad)).to(s.dtype).view(q.shape[0], G, g) * s[..., None]
    return v.view(q.shape[0], G * g)[:, :K].to(dtype)


def quant_gemv_ref(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x [T, K] -> x @ W^T [T, N] in x.dtype, W dequantized (in the scales' dtype), the product in float32."""
    return (x.float() @ dequantize_packed(pw, torch.float32).t()).to(x.dtype)


def swiglu_input(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2K] -> silu(gate) * up * weights[t] [T, K] in gate_up's dtype, each product rounded to it (the
    input `quant_gemv(..., swiglu=weights)` computes as it loads; a shared expert's activation with its gate)."""
    g, u = gate_up.chunk(2, dim=-1)
    dt = gate_up.dtype
    return ((torch.nn.functional.silu(g.float()).to(dt).float() * u.float()).to(dt).float()
            * weights.float()[:, None]).to(dt)


def pack_values(q: torch.Tensor, bits: int, dense: bool = True) -> torch.Tensor:
    """int values [N, K] in -2^(bits-1) .. 2^(bits-1) - 1 -> int32 words [N, W], in the library's dense bit stream
    or the older 32 // bits values a word (tests and benchmarks; checkpoints come from the library)."""
    N, K = q.shape
    u = (q.to(torch.int64) + (1 << bits - 1)) & ((1 << bits) - 1)
    if dense:
        W = qw.dense_words(K, bits)
        bit = torch.arange(K, device=q.device) * bits
        words = torch.zeros(N, W + 1, dtype=torch.int64, device=q.device)
        words.index_add_(1, bit // 32, u << (bit % 32))                # low part (bits past 32 spill below)
        words.index_add_(1, bit // 32 + 1, u >> (32 - bit % 32))       # the part that continues in the next word
        words = words[:, :W] & 0xFFFFFFFF
    else:
        per = 32 // bits
        W = qw.legacy_words(K, bits)
        u = torch.nn.functional.pad(u, (0, W * per - K)).view(N, W, per)
        words = (u << (torch.arange(per, device=q.device) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def quantize_rtn(w: torch.Tensor, bits: int, group: int | None, dense: bool = True,
                 scale_dtype: torch.dtype | None = None) -> PackedWeight:
    """A float weight [N, K] -> its symmetric round-to-nearest PackedWeight, scale = max|w| / ((2^bits - 1) / 2)
    per group (the library's symmetric rule); `group` None: one scale a row."""
    N, K = w.shape
    g = K if group is None else group
    G = -(-K // g)
    wf = torch.nn.functional.pad(w.float(), (0, G * g - K)).view(N, G, g)
    scale = (wf.abs().amax(-1) / (((1 << bits) - 1) / 2)).clamp_min(1e-8).to(scale_dtype or w.dtype)
    lo, hi = -(1 << bits - 1), (1 << bits - 1) - 1
    q = torch.clamp(torch.round(wf / scale.float()[..., None]), lo, hi).view(N, G * g)[:, :K].to(torch.int32)
    return PackedWeight(pack_values(q, bits, dense), scale, bits, K, g)
