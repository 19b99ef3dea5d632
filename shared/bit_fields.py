"""Fields of `bits` bits in a stream of little-endian int32 words, value i of a row at bit i * bits, a field crossing
into the next word where it does not fit: compressed-tensors' dense packing (since 0.20) and, transposed, GPTQ's
`qweight` / `qzeros` (`shared/gptq_files.py`). One reader and one writer for both: the loader's dequantization
(`stage_worker/model/quant_weight.py`) and the GPTQ view read with `unpack_fields`."""

from __future__ import annotations

import torch

from shared.quant_scheme import QuantSchemeError


def unpack_fields(words: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """The first `n` (default: every whole) unsigned `bits`-bit fields of int32 `words` [rows, w], along each row:
    int64 [rows, n]."""
    rows, w = words.shape
    n = w * 32 // bits if n is None else n
    bit = torch.arange(n, dtype=torch.int64, device=words.device) * bits
    word, off = bit // 32, bit % 32
    u = words.to(torch.int64) & 0xFFFFFFFF
    v = u[:, word] >> off
    v = v | (u[:, torch.clamp(word + 1, max=w - 1)] << (32 - off))     # a field continuing in the next word
    return v & ((1 << bits) - 1)


def pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `unpack_fields`: unsigned values int [rows, n] (n * bits a multiple of 32) -> int32 words."""
    rows, n = values.shape
    if n * bits % 32:
        raise QuantSchemeError(f"{n} {bits}-bit values do not fill whole int32 words")
    w = n * bits // 32
    bit = torch.arange(n, dtype=torch.int64) * bits
    word, off = bit // 32, bit % 32
    v = values.to(torch.int64) & ((1 << bits) - 1)
    out = torch.zeros(rows, w + 1, dtype=torch.int64)
    out.index_add_(1, word, (v << off) & 0xFFFFFFFF)
    out.index_add_(1, word + 1, v >> (32 - off))            # the high bits of a field crossing a word (0 if none)
    out = out[:, :w]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)
