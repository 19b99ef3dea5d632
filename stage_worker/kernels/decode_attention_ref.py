"""Paged decode attention in plain PyTorch: the oracle the Triton kernel is tested against.

One query token per sequence reads its own K/V rows through the block table, either every position before it
(dense) or only the positions QSA selected, so that with QSA a decode step reads a bounded number of K/V rows
(001 §1). Same math as `GatedAttention._attend` (softmax in fp32); here q/k/v are upcast to fp32 throughout, so
bf16 inputs give the exact answer the fp32-accumulating kernel aims at. Vectorised over the batch: pad and mask.
"""

from __future__ import annotations

import torch


def paged_rows(block_tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """Flat K/V row of each position, `table[pos // bs] * bs + pos % bs`; row 0 where not valid (padding)."""
    pos = torch.where(valid, positions, 0)
    page = torch.gather(block_tables.long(), 1, pos // block_size)
    return torch.where(valid, page * block_size + pos % block_size, 0)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               block_size: int, selected: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [rows, kv_heads, D]; block_tables [B, max_blocks]; context_lens [B] (the new token
    included); selected [B, S] positions or -1. Returns [B, Hq, D] in q's dtype; a query that sees no key gets 0."""
    B, Hq, D = q.shape
    kv_heads = k_cache.shape[1]
    ctx = context_lens.long()[:, None]
    if selected is None:
        length = block_tables.shape[1] * block_size
        positions = torch.arange(length, device=q.device).expand(B, length)
        valid = positions < ctx
    else:
        positions = selected.long()
        valid = (positions >= 0) & (positions < ctx)
    rows = paged_rows(block_tables, positions, valid, block_size)           # [B, L]
    k = k_cache[rows].float()                                                # [B, L, kv, D]
    v = v_cache[rows].float()
    qg = q.float().view(B, kv_heads, Hq // kv_heads, D)                      # head h reads kv head h // group
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(B, Hq, D).to(q.dtype)
