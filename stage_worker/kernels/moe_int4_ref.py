"""PyTorch reference for `moe_int4.py`: the routed experts of a layer in the reports' INT4 form (compressed-tensors
pack-quantized, symmetric, one scale per `group` inputs), dequantized, then `fused_moe_ref`.

Layout (`PackedExperts`): q13 int32 [E, 2I, H/8] (gate rows then up rows), s13 [E, 2I, ceil(H/g)]; q2 int32
[E, H, I/8], s2 [E, H, ceil(I/g)]. Input column c of a row is the 4 bits at 4*(c % 8) of word c // 8, stored as
q + 8 (so 0..15 means -8..7), the library's packing for 4 bits (`stage_worker/model/quant_weight.py`).

Asymmetric experts (AutoAWQ, GPTQ `sym: false`, compressed-tensors W4A16_ASYM) carry a zero point z per row and
group (signed, -8..7, the library's value: the weight is (q - z) * s): it rides in the scale rows, after the scales,
in the scales' dtype (s13 [E, 2I, 2 ceil(H/g)], s2 [E, H, 2 ceil(I/g2)]; integers of this size are exact in bf16 and
fp16). So every copy of an expert's rows (the tables' tiers, run-time moves, claims) carries them with no part of
their own; `PackedExperts.asym` reads the form from the widths. Kept packed they cost a quarter of bf16's bytes, as
symmetric experts do, where dequantizing at load cost four times that.

FP4 experts (`fp4`: compressed-tensors NVFP4A16 / MXFP4A16) use the same words: nibble n of word w is the E2M1 code
of input 8w + n (bit 3 the sign, bits 0-2 an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), which is the checkpoint's
`weight_packed` bytes (two codes a byte, low nibble first) read as little-endian int32. Their scale rows are
float32, one column a group of 16 (NVFP4) or 32 (MXFP4), holding the effective scale s = bf16(scale) / global
(MXFP4: 2^(e - 127)), which is exact in float32, so `dequantize_packed` gives the library's bf16(code * s) bit for
bit, while the kernels compute code * s in fp32 without rounding each weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.kernels.moe_ref import fused_moe_ref
from stage_worker.model.quant_weight import unpack_fp4


@dataclass
class PackedExperts:
    q13: torch.Tensor
    s13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor
    group: int                    # inputs per scale of w13 (the hidden size's groups)
    group2: int | None = None     # of w2 (the expert width's); None: the same
    fp4: bool = False             # E2M1 codes and float32 scales (NVFP4 / MXFP4), not INT4

    @property
    def down_group(self) -> int:
        return self.group2 or self.group

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, H, I)."""
        E, two_i, words = self.q13.shape
        return E, words * 8, two_i // 2

    @property
    def asym(self) -> bool:
        """Zero points after the scales in the scale rows (see the module docstring); scale rows of any other width
        than the groups' (or twice that, in both parts alike; FP4: only the groups') are refused."""
        _, H, inter = self.shape
        cols = (self.s13.shape[-1], self.s2.shape[-1])
        for asym in (False,) if self.fp4 else (False, True):
            if cols == (scale_columns(H, self.group, asym), scale_columns(inter, self.down_group, asym)):
                return asym
        raise ValueError(f"scale rows of {cols[0]} / {cols[1]} columns do not fit (E, H, I) {self.shape} in groups "
                         f"of {self.group} / {self.down_group}")

    def nbytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.q13, self.s13, self.q2, self.s2))


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int8 [..., 8W] in -8..7."""
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    return (((q[..., None] >> shifts) & 0xF) - 8).to(torch.int8).flatten(-2)


def unpack_e2m1(q: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] of E2M1 codes -> float32 [..., 8W], their values: the words are the checkpoint's bytes read
    little-endian, so this is `quant_weight.unpack_fp4` of them."""
    return unpack_fp4(q.contiguous().view(torch.uint8))


def scale_columns(inputs: int, group: int, asym: bool = False) -> int:
    """Columns of a packed part's scale rows: one a group, twice that with zero points (asymmetric)."""
    return (2 if asym else 1) * -(-inputs // group)


def zcol(inputs: int, group: int, experts: PackedExperts) -> int:
    """The kernels' ZCOL: columns from a scale to its zero point in the scale rows (asymmetric), else 0."""
    return scale_columns(inputs, group) if experts.asym else 0


def dequantize_int4(q: torch.Tensor, s: torch.Tensor, group: int, fp4: bool = False) -> torch.Tensor:
    """[..., R, W] words and [..., R, G] scales (or [..., R, 2G]: scales, then zero points) -> [..., R, 8W] in the
    scales' dtype, computed as the library does: (q - z) in the scale dtype times the scale. `fp4`: E2M1 codes
    times their float32 scales, in float32 (what the kernels compute; `dequantize_packed` rounds as the library)."""
    v = unpack_e2m1(q) if fp4 else unpack_int4(q)
    n = v.shape[-1]
    G = -(-n // group)
    x = v.to(s.dtype)
    if s.shape[-1] == 2 * G and not fp4:
        x = x - s[..., G:].repeat_interleave(group, dim=-1)[..., :n]
    elif s.shape[-1] != G:
        raise ValueError(f"{s.shape[-1]} scale columns for {n} inputs in groups of {group}")
    return x * s[..., :G].repeat_interleave(group, dim=-1)[..., :n]


def dequantize_packed(q: torch.Tensor, s: torch.Tensor, group: int, fp4: bool, dtype: torch.dtype) -> torch.Tensor:
    """Words and scale rows -> the weight in `dtype` as the checkpoint's library gives it, for the per-expert CPU
    loops: FP4 rounded to bfloat16 first (compressed-tensors' bf16(code * s)), so packed and dequantized-at-load
    experts compute the same model bit for bit."""
    w = dequantize_int4(q, s, group, fp4)
    return (w.to(torch.bfloat16) if fp4 else w).to(dtype)


def pack_int4(w: torch.Tensor, group: int, asym: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., R, C] (C a multiple of 8) -> (words, scales): symmetric round to nearest with scale =
    max|w| / 7.5 per group (tests and benchmarks make their weights so; checkpoints come from the library). `asym`:
    scale = (max - min) / 15 and a zero point per group (min to -8), the scales followed by the zero points."""
    *lead, R, C = w.shape
    G = -(-C // group)
    wf = torch.nn.functional.pad(w.float(), (0, G * group - C)).view(*lead, R, G, group)
    if asym:
        lo, hi = wf.amin(-1).clamp_max(0), wf.amax(-1).clamp_min(0)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        zero = torch.clamp(torch.round(-lo / scale) - 8, -8, 7)
    else:
        scale = (wf.abs().amax(-1) / 7.5).clamp_min(1e-8)
        zero = torch.zeros_like(scale)
    q = torch.clamp(torch.round(wf / scale[..., None]) + zero[..., None], -8, 7)
    q = q.view(*lead, R, G * group)[..., :C].to(torch.int32)
    u = (q + 8).view(*lead, R, C // 8, 8)
    words = (u << torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)).sum(-1, dtype=torch.int64)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words, (torch.cat([scale, zero], -1) if asym else scale).to(w.dtype)


def pack_fp4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., R, C] (C a multiple of 8) -> (words of E2M1 codes, float32 scales): scale = max|w| / 6
    per group and the nearest E2M1 value (tests and benchmarks; checkpoints come from the library)."""
    *lead, R, C = w.shape
    G = -(-C // group)
    wf = torch.nn.functional.pad(w.float(), (0, G * group - C)).view(*lead, R, G, group)
    scale = (wf.abs().amax(-1) / 6).clamp_min(1e-8)
    y = (wf / scale[..., None]).view(*lead, R, G * group)[..., :C]
    mag = torch.zeros(y.shape, dtype=torch.int32, device=w.device)      # the nearest value's index (ties: lower),
    for mid in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):                  # by the midpoints: no [..., 8] temporary
        mag += y.abs() > mid
    codes = (mag | torch.where(y < 0, 8, 0).to(torch.int32)).view(*lead, R, C // 8, 8)
    words = (codes << torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)).sum(-1, dtype=torch.int64)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words, scale


def fused_moe_int4_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: PackedExperts) -> torch.Tensor:
    """x [T, H], ids/weights [T, k] (routed slots only) -> [T, H] in x.dtype."""
    sel = ids.long().clamp_min(0)
    used = torch.unique(sel)
    w13 = torch.zeros(experts.q13.shape[0], experts.q13.shape[1], experts.shape[1], dtype=torch.float32,
                      device=x.device)
    w2 = torch.zeros(experts.q2.shape[0], experts.q2.shape[1], experts.shape[2], dtype=torch.float32,
                     device=x.device)
    w13[used] = dequantize_int4(experts.q13[used], experts.s13[used], experts.group, experts.fp4).float()
    w2[used] = dequantize_int4(experts.q2[used], experts.s2[used], experts.down_group, experts.fp4).float()
    return fused_moe_ref(x, ids, weights, w13, w2)
