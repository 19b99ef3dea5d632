"""Allowed-token masks as they travel from the gateway's grammar matcher to the sampling stage.

A mask is packed little-endian bits: bit i of the byte string (byte i // 8, bit i % 8) says whether token id i may be
sampled. That is the byte image of the int32 bitmask words grammar engines fill (word i // 32, bit i % 32) on a
little-endian host, so the gateway sends `words.tobytes()` and the stage unpacks without knowing the engine. Ids
beyond the mask (a model vocabulary wider than the grammar's) are not allowed.
"""

from __future__ import annotations

import numpy as np
import torch


def unpack_mask(data: bytes, vocab: int) -> np.ndarray:
    """Packed bytes -> bool [vocab]."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little").astype(bool)
    if bits.size >= vocab:
        return bits[:vocab]
    return np.concatenate([bits, np.zeros(vocab - bits.size, dtype=bool)])


def apply_mask(logits: torch.Tensor, data: bytes | None) -> torch.Tensor:
    """Logits of one row with disallowed ids at -inf. A mask that allows nothing is ignored (the gateway's matcher
    then refuses the sampled token and fails the request with a clear error instead of the sampler crashing)."""
    if data is None:
        return logits
    allowed = torch.from_numpy(unpack_mask(data, logits.shape[-1])).to(logits.device)
    if not bool(allowed.any()):
        return logits
    return logits.masked_fill(~allowed, float("-inf"))
