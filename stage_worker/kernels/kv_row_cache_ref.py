"""The row cache's protocol in plain PyTorch, one step's phases one after another: the oracle of `kv_row_cache.py` and of the
split-K kernel's `CACHED` path.

The protocol's outcome does not depend on the order the GPU's programs run in (that is what the epoch, the hitmark
and the claim are for), so phases run one after another give the exact state a step must leave: tags, hitmarks, claims,
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
    """Mark hits, claim misses' slots (the largest epoch << 32 | row per slot), count; returns the columns' hits."""
    epoch = int(cache.epoch)
    slots = rows % cache.n_slots
    hit = cache.tag[slots] == rows
    cache.hitmark[slots[hit]] = epoch
    cache.claim.scatter_reduce_(0, slots[~hit], (epoch << ROW_BITS) | rows[~hit], "amax")
    cache.counts[0] += int(hit.sum())
    cache.counts[1] += rows.numel()
    return hit


def fill_ref(cache: RowCache, rows: torch.Tensor, hit: torch.Tensor, host_k: torch.Tensor,
             host_v: torch.Tensor) -> None:
    """What the attention's misses write: the winning claim's row and tag, where no column hit the slot (columns
    that win one slot all name the same row, so the order of writes does not matter)."""
    epoch = int(cache.epoch)
    rows = rows[~hit]
    slots = rows % cache.n_slots
    win = (cache.hitmark[slots] != epoch) & (cache.claim[slots] == (epoch << ROW_BITS) | rows)
    slots, rows = slots[win], rows[win]
    cache.k[slots] = host_k[rows].to(cache.k.device)
    cache.v[slots] = host_v[rows].to(cache.v.device)
    cache.tag[slots] = rows


def step_ref(cache: RowCache, written: torch.Tensor, selected: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor, block_size: int, host_k: torch.Tensor, host_v: torch.Tensor) -> torch.Tensor:
    """One layer's decode step on the cache (invalidate, plan, fill); returns the columns' hit flags."""
    invalidate_ref(cache, written)
    rows = selected_rows(selected, block_tables, context_lens, block_size)
    hit = plan_ref(cache, rows)
    fill_ref(cache, rows, hit, host_k, host_v)
    return hit
