"""The row cache's protocol in plain PyTorch, one column after another: the oracle of `kv_row_cache.py` and of the
split-K kernel's `CACHED` path.

The protocol's outcome does not depend on the order the GPU's programs run in (that is what the epoch, the hitmark
and the claim are for), so a sequential model gives the exact state a step must leave: tags, hitmarks, claims,
epoch, counters, and the region rows of every tagged slot (equal to the host row the tag names). Attention through
the cache is attention over the host rows, whatever the region holds: `paged_decode_attention_ref` over host K/V.
"""

from __future__ import annotations

import torch

from stage_worker.kernels.decode_attention_ref import paged_rows
from stage_worker.kernels.kv_row_cache import ROW_BITS, RowCache


def invalidate_ref(cache: RowCache, rows: torch.Tensor) -> None:
    for row in rows.tolist():
        if row >= 0 and int(cache.tag[row % cache.n_slots]) == row:
            cache.tag[row % cache.n_slots] = -1
    cache.epoch += 1


def selected_rows(selected: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """The physical row of every visible column (flattened, in column order), as the kernels see them."""
    pos = selected.long()
    valid = (pos >= 0) & (pos < context_lens.long()[:, None])
    return paged_rows(block_tables, pos, valid, block_size)[valid]


def plan_ref(cache: RowCache, rows: torch.Tensor) -> torch.Tensor:
    """Mark hits, claim misses' slots, count; returns the hit flag of every column."""
    epoch = int(cache.epoch)
    slots = rows % cache.n_slots
    hit = cache.tag[slots] == rows
    cache.hitmark[slots[hit]] = epoch
    for slot, row in zip(slots[~hit].tolist(), rows[~hit].tolist()):
        cache.claim[slot] = max(int(cache.claim[slot]), epoch << ROW_BITS | row)
    cache.counts[0] += int(hit.sum())
    cache.counts[1] += rows.numel()
    return hit


def fill_ref(cache: RowCache, rows: torch.Tensor, hit: torch.Tensor, host_k: torch.Tensor,
             host_v: torch.Tensor) -> None:
    """What the attention's misses write: the winning claim's row and tag, where no column hit the slot."""
    epoch = int(cache.epoch)
    for row in rows[~hit].tolist():
        slot = row % cache.n_slots
        if int(cache.hitmark[slot]) != epoch and int(cache.claim[slot]) == epoch << ROW_BITS | row:
            cache.k[slot] = host_k[row].to(cache.k.device)
            cache.v[slot] = host_v[row].to(cache.v.device)
            cache.tag[slot] = row


def step_ref(cache: RowCache, written: torch.Tensor, selected: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor, block_size: int, host_k: torch.Tensor, host_v: torch.Tensor) -> torch.Tensor:
    """One layer's decode step on the cache (invalidate, plan, fill); returns the columns' hit flags."""
    invalidate_ref(cache, written)
    rows = selected_rows(selected, block_tables, context_lens, block_size)
    hit = plan_ref(cache, rows)
    fill_ref(cache, rows, hit, host_k, host_v)
    return hit
