"""Quantized Linear weights as checkpoints store them, and their dequantization (issue 17).

Four on-disk forms, all read here without the compressed-tensors library (a serving machine needs only this):
* compressed-tensors `pack-quantized` (INT1-8): `weight_packed` int32 [rows, words], `weight_scale` [rows, groups]
  (one column per channel, one value per tensor), `weight_shape` [rows, in], and for asymmetric schemes
  `weight_zero_point` packed along its rows. Values are stored as `q + 2^(bits-1)`. The library has packed densely
  since 0.20 (value i of a row at bit i*bits of the row's word stream, crossing words); older releases put
  32 // bits values in each word. The two agree for 1, 2, 4 and 8 bits; for other widths the word count says which
  (dense, where both fit).
  GPTQ with `actorder: group` (llm-compressor before compressed-tensors dropped it) adds `weight_g_idx` int32 [in]:
  the scale (and zero point) column of each input, so groups are sets of inputs, not runs (a -1 in it: runs).
* compressed-tensors `int-quantized` / `naive-quantized`: `weight` int8 [rows, in] holding the values themselves,
  `weight_scale` (and `weight_zero_point`) as above, unpacked.
* float8 (`float-quantized` in compressed-tensors, or transformers' `fp8` with `weight_block_size`): a float8 weight
  and a float32 scale per block of rows x columns (`weight_scale`, or `weight_scale_inv` for `fp8`), edge blocks
  cut where the weight's rows or columns are not a multiple of the block.
* compressed-tensors FP4 (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`): `weight_packed` uint8 [rows, in / 2],
  two E2M1 codes a byte, low nibble first (bit 3 the sign, bits 0-2 an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6);
  `weight_scale` [rows, in / group]: float8_e4m3 for NVFP4 (over a float32 `weight_global_scale` [1]), E8M0
  exponents (uint8, 2^(e - 127)) for MXFP4. Dequantized at load, except routed experts, which the INT4 expert
  kernels take packed (`checkpoint/packed_experts.py`, scale rows from `fp4_group_scales`).

`dequantize` gives the weight the model's layers hold today; it is also the reference the quantized kernels are
tested against (dequantize, then matmul).
"""

from __future__ import annotations

import torch

from shared.bit_fields import unpack_fields
from shared.quant_scheme import QuantSchemeError, WeightQuant

# a quantized module's on-disk tensors: `<module>.<part>`
QUANT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_scale_inv", "weight",
               "weight_g_idx", "weight_global_scale")
CHUNK = 1 << 22                       # elements unpacked at a time: a 152k x 4096 lm_head never in int64 at once


def dense_words(n: int, bits: int) -> int:
    return -(-n * bits // 32)


def legacy_words(n: int, bits: int) -> int:
    return -(-n // (32 // bits))


def is_dense(words: int, bits: int, n: int) -> bool:
    """Which layout `words` int32 words a row of `n` `bits`-bit values are in: True for the dense bit stream
    (compressed-tensors >= 0.20; also where both layouts have the same word count, as for 1, 2, 4 and 8 bits, whose
    bits are then placed identically), False for the older 32 // bits values a word."""
    if words == dense_words(n, bits):
        return True
    if words == legacy_words(n, bits):
        return False
    raise QuantSchemeError(f"{words} int32 words a row cannot hold {n} {bits}-bit values (dense packing needs "
                           f"{dense_words(n, bits)}, the older layout {legacy_words(n, bits)})")


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int8 values [rows, n] of `packed` int32 [rows, words] (either layout; see the module docstring)."""
    if packed.dtype != torch.int32:
        raise QuantSchemeError(f"packed weights must be int32, got {packed.dtype}")
    rows, words = packed.shape
    dense = is_dense(words, bits, n)
    out = torch.empty(rows, n, dtype=torch.int8, device=packed.device)
    if rows == 0 or n == 0:
        return out
    per = 32 // bits
    idx = torch.arange(n, dtype=torch.int64, device=packed.device)
    word, off = idx // per, (idx % per) * bits                  # the older layout: no field crosses a word
    mask, offset = (1 << bits) - 1, 1 << (bits - 1)
    step = max(1, CHUNK // n)
    for r0 in range(0, rows, step):
        if dense:
            v = unpack_fields(packed[r0:r0 + step], bits, n)
        else:
            v = ((packed[r0:r0 + step].to(torch.int64) & 0xFFFFFFFF)[:, word] >> off) & mask
        out[r0:r0 + step] = (v - offset).to(torch.int8)
    return out


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """A tensor packed along its first dimension (compressed-tensors' zero points): int8 [rows, columns]."""
    return unpack(packed.t().contiguous(), bits, rows).t()


def dequantize_int(parts: dict[str, torch.Tensor], wq: WeightQuant, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [rows, in] of one module's tensors, computed in the scale's dtype as the library does:
    pack-quantized (`weight_packed`, `weight_shape`) or one integer an element (`int-quantized` /
    `naive-quantized`: `weight` int8 [rows, in], the values themselves), `weight_scale`, and `weight_zero_point`
    when asymmetric (packed along its rows in the packed format)."""
    if wq.format == "pack-quantized":
        rows, n = (int(v) for v in parts["weight_shape"].tolist())
        q = unpack(parts["weight_packed"], wq.bits, n)
        if q.shape[0] != rows:
            raise QuantSchemeError(f"weight_packed has {q.shape[0]} rows, weight_shape says {rows}")
    else:
        q = parts["weight"]
        rows, n = q.shape
    scale = parts["weight_scale"]
    zp = None
    if not wq.symmetric:
        if "weight_zero_point" not in parts:
            raise QuantSchemeError(f"{wq.describe()}: asymmetric, but no weight_zero_point")
        zp = parts["weight_zero_point"]
        if zp.dtype == torch.int32 and wq.strategy in ("group", "channel") and wq.format == "pack-quantized":
            zp = unpack_rows(zp, wq.bits, rows)
    g_idx = parts.get("weight_g_idx")
    if g_idx is not None and wq.strategy == "group" and not bool((g_idx == -1).any()):      # -1: column order
        return _dequantize_g_idx(q, scale, zp, g_idx, wq, dtype)
    if wq.strategy == "tensor":
        scale = scale.reshape(1, 1)
        zp = None if zp is None else zp.reshape(1, 1)
    elif scale.dim() == 1:
        scale = scale[:, None]
        zp = None if zp is None else zp.reshape(scale.shape)
    groups = scale.shape[1]
    g = wq.group_size if wq.strategy == "group" else n
    if wq.strategy == "group" and groups != -(-n // g):
        raise QuantSchemeError(f"{wq.describe()}: {groups} scale columns for {n} inputs")
    pad = groups * g - n if wq.strategy == "group" else 0
    x = torch.nn.functional.pad(q, (0, pad)).to(scale.dtype).view(rows, groups, -1) if groups > 1 or pad else \
        q.to(scale.dtype).view(rows, 1, n)
    if zp is not None:
        x = x - zp.to(scale.dtype)[..., None]
    x = x * scale[..., None]
    return x.reshape(rows, -1)[:, :n].to(dtype)


def _dequantize_g_idx(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, g_idx: torch.Tensor,
                      wq: WeightQuant, dtype: torch.dtype) -> torch.Tensor:
    """Activation-ordered groups: input j takes scale column g_idx[j] (and its zero point), as GPTQ wrote it and
    vLLM and the library before 0.20 read it."""
    rows, n = q.shape
    g = g_idx.reshape(-1).to(torch.int64)
    if g.numel() != n or int(g.min()) < 0 or int(g.max()) >= scale.shape[-1]:
        raise QuantSchemeError(f"{wq.describe()}: weight_g_idx has {g.numel()} entries in "
                               f"[{int(g.min())}, {int(g.max())}] for {n} inputs and {scale.shape[-1]} scale columns")
    x = q.to(scale.dtype)
    if zp is not None:
        x = x - zp.reshape(rows, -1).to(scale.dtype)[:, g]
    return (x * scale.reshape(rows, -1)[:, g]).to(dtype)


def dequantize_float(weight: torch.Tensor, scale: torch.Tensor, wq: WeightQuant, dtype: torch.dtype) -> torch.Tensor:
    """A float8 weight times its per-block (or per-channel, per-tensor) scale, in float32, then `dtype`."""
    rows, cols = weight.shape
    s = scale.float()
    if wq.strategy == "block":
        br, bc = wq.block
        want = (-(-rows // br), -(-cols // bc))
        if tuple(s.shape) != want:
            raise QuantSchemeError(f"float8 block {wq.block}: scale is {list(s.shape)}, expected {list(want)} for a "
                                   f"{rows} x {cols} weight")
        s = s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    elif wq.strategy == "channel":
        s = s.reshape(rows, 1)
    else:
        s = s.reshape(1, 1)
    return (weight.float() * s).to(dtype)


# the E2M1 value of each 4-bit code: codes 8-15 are 0-7 negated (8: negative zero, as the library unpacks it)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_VALUES = torch.cat([_E2M1, -_E2M1])


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2 * bytes] of `packed` uint8 [..., bytes]: two E2M1 codes a byte, the low nibble first."""
    if packed.dtype != torch.uint8:
        raise QuantSchemeError(f"FP4 weight_packed must be uint8, got {packed.dtype}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return E2M1_VALUES.to(packed.device)[codes.long()]


def fp4_scale(scale: torch.Tensor, wq: WeightQuant) -> torch.Tensor:
    """The group scales in bfloat16, the library's FP4 compute dtype: NVFP4's float8 values as they are, MXFP4's
    E8M0 exponents as powers of two (`e8m0_scale`)."""
    return e8m0_scale(scale) if wq.format == "mxfp4-pack-quantized" else scale.to(torch.bfloat16)


def e8m0_scale(scale: torch.Tensor) -> torch.Tensor:
    """MXFP4's uint8 exponents as 2^(e - 127) in bfloat16 (255 reads as inf, as the library reads it)."""
    return torch.exp2(scale.to(torch.int32).float() - 127).to(torch.bfloat16)


def fp4_group_scales(scale: torch.Tensor, glob: torch.Tensor | None) -> torch.Tensor:
    """The effective float32 group scales s of an FP4 module, with which the library's weight is bf16(code * s):
    bf16(scale) / global for NVFP4 (float8 scales, a float32 global), bf16(2^(e - 127)) for MXFP4 (uint8
    exponents, `glob` None). Exact in float32, so packed FP4 experts keep them in their scale rows."""
    if scale.dtype == torch.uint8:
        return e8m0_scale(scale).float()
    if glob is None or glob.numel() != 1:
        raise QuantSchemeError(f"NVFP4 scales need one weight_global_scale, got "
                               f"{None if glob is None else list(glob.shape)}")
    return scale.to(torch.bfloat16) / glob.reshape(1)


def dequantize_fp4(parts: dict[str, torch.Tensor], wq: WeightQuant, dtype: torch.dtype) -> torch.Tensor:
    """An FP4 module's weight, computed as the library's decompressor does, so bit for bit equal to it: values and
    scales in bfloat16, NVFP4's scale divided by its float32 global scale (promoting to float32), the product cast
    to bfloat16, then `dtype`. A block of rows at a time, so a wide module is never in float32 at once."""
    packed, scale = parts["weight_packed"], fp4_scale(parts["weight_scale"], wq)
    rows, n = packed.shape[0], 2 * packed.shape[-1]
    g = wq.group_size
    if packed.dim() != 2 or tuple(scale.shape) != (rows, -(-n // g)):
        raise QuantSchemeError(f"{wq.describe()}: weight_scale is {list(scale.shape)} for weight_packed "
                               f"{list(packed.shape)}: expected {[rows, -(-n // g)]}")
    if wq.strategy == "tensor_group":
        glob = parts.get("weight_global_scale")
        if glob is None or glob.numel() != 1:
            raise QuantSchemeError(f"{wq.describe()}: weight_global_scale must be one value, got "
                                   f"{None if glob is None else list(glob.shape)}")
        scale = scale / glob.reshape(1)
    out = torch.empty(rows, n, dtype=dtype)
    step = max(1, CHUNK // max(n, 1))
    for r0 in range(0, rows, step):
        x = unpack_fp4(packed[r0:r0 + step]).to(torch.bfloat16).to(scale.dtype)
        s = scale[r0:r0 + step].repeat_interleave(g, dim=1)[:, :n]
        out[r0:r0 + step] = (x * s).to(torch.bfloat16).to(dtype)
    return out


def dequantize(parts: dict[str, torch.Tensor], wq: WeightQuant, dtype: torch.dtype) -> torch.Tensor:
    """One module's on-disk tensors (names without the module prefix) -> its float weight."""
    if wq.fp4:
        return dequantize_fp4(parts, wq, dtype)
    if wq.kind == "int":
        return dequantize_int(parts, wq, dtype)
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    if scale is None or "weight" not in parts:
        raise QuantSchemeError(f"{wq.describe()}: weight or its scale missing")
    return dequantize_float(parts["weight"], scale, wq, dtype)


def needed(wq: WeightQuant, method: str, g_idx: bool = False) -> set[str]:
    """The on-disk tensors of one module that `dequantize` waits for (`g_idx`: the files hold its `weight_g_idx`)."""
    if wq.fp4:
        return {"weight_packed", "weight_scale"} | ({"weight_global_scale"} if wq.strategy == "tensor_group" else set())
    if wq.kind == "float":
        return {"weight", "weight_scale_inv" if method == "fp8" else "weight_scale"}
    out = {"weight_packed", "weight_scale", "weight_shape"} if wq.format == "pack-quantized" else \
        {"weight", "weight_scale"}
    out = out | {"weight_g_idx"} if g_idx else out
    return out if wq.symmetric else out | {"weight_zero_point"}
