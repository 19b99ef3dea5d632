"""The VRAM row cache of QSA K/V in host RAM: its state, and the two small kernels of the protocol around a decode
step's attention (issue 18 deliverable 3; 002 §5).

Why: with `qsa_kv_offload` a decode step reads its selected K/V rows over PCIe (4 MiB a sequence and layer at the
full shape, 84 us on the H200, serial with the step), and consecutive steps select mostly the same rows (the
reports: 0.72 overlap with the previous step, 86-91% hit rate with a region). A region of VRAM keeps recently read
rows; the split-K kernel (`decode_attention.py`, `CACHED`) loads a hit from the region and a miss from host memory
through one pointer, `where(hit, region, host)`, and fills the region with the rows it missed. A hit reads the same
bytes as the host copy and the tile arithmetic is unchanged, so the output is the uncached kernel's bit for bit.

Direct-mapped, keyed by the physical K/V row (`slot = row % n_slots`): one tag a column, no replacement state, and
the claim below picks one writer per slot with a single `atomic_max`. A set-associative region would choose a victim
per set among all the columns that miss into it in one step, which needs an ordering of those columns (an LRU state
updated by every column, or a per-set top-k of claims), not one atomic. Consecutive rows map to consecutive slots,
so a compression block (4 rows) or a K/V page never collides with itself; conflicts are between far-apart rows, and
the region is sized (`kv_row_cache_mib`) to a few times the rows a step selects. The hit rate is counted on the
device so that the choice can be measured (`moepipe_kv_row_cache_hits_total` / `_lookups_total`).

The protocol, per layer and step (002 §5), with an `epoch` that grows by one each step so nothing needs clearing:
1. `invalidate(rows)`: every row just written to host memory (the decode prologue, prefill's row scatter) drops its
   slot's tag if the tag names it; then epoch += 1.
2. `plan(...)`: a column (a selected position of a sequence) whose slot's tag names its row hits and marks the slot
   (`hitmark = epoch`); a column that misses claims its slot, `claim = atomic_max(claim, epoch << 32 | row)`.
3. attention (`paged_decode_attention(..., row_cache=...)`): a column is a hit iff `hitmark == epoch` and the tag
   names its row; a miss loads host memory and writes its row and the tag only if its claim won and no column hit
   the slot this step. A slot that was hit is never written in the step, and the tag of a slot that may be written
   decides nothing (its hitmark is not the epoch), so reading and writing tags in one kernel is safe; only the plan
   needs every column to have finished, and a kernel boundary gives that. No host sync: capturable in a CUDA graph.

With the kernel flag `pdl` both kernels are programmatic dependents that wait first thing (they read only what
earlier kernels wrote), so they no longer break the decode chain's early launches (h100-28: at 262k the QSA
layers' chain kept 0.07 ms of PDL's 0.18 ms saving at 4k).

Rows must be below 2^32 and epochs below 2^31 (2^31 steps: 250 days at 100 steps/s). Reference: `kv_row_cache_ref.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stage_worker.kernels.common import pdl_usable, pdl_wait

ROW_BITS = 32                 # claim = epoch << ROW_BITS | row
SLOT_STATE_BYTES = 3 * 8      # tag, hitmark, claim (int64) a slot, beside its K and V rows


@dataclass
class RowCache:
    """One QSA layer's region and its tags. `k`, `v` [n_slots, kv_heads, head_dim] in the cache dtype; `tag` the row a
    slot holds (-1: none), `hitmark` the last epoch a column hit it, `claim` the last epoch's winning claim; `epoch`
    [1]; `counts` [2] (hits, lookups), shared by the stage's layers."""

    k: torch.Tensor
    v: torch.Tensor
    tag: torch.Tensor
    hitmark: torch.Tensor
    claim: torch.Tensor
    epoch: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def new(cls, n_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
            counts: torch.Tensor | None = None) -> "RowCache":
        def ints(n: int, fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=device)

        return cls(k=torch.zeros((n_slots, kv_heads, head_dim), dtype=dtype, device=device),
                   v=torch.zeros((n_slots, kv_heads, head_dim), dtype=dtype, device=device),
                   tag=ints(n_slots, -1), hitmark=ints(n_slots, 0), claim=ints(n_slots, 0), epoch=ints(1, 0),
                   counts=counts if counts is not None else ints(2, 0))

    @property
    def n_slots(self) -> int:
        return self.tag.shape[0]

    def clear(self) -> None:
        """Drop every tag (whatever overwrote the region, its rows are no longer trusted)."""
        self.tag.fill_(-1)


def slots_for(budget_bytes: int, layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Slots a layer's region gets when `layers` QSA layers share `budget_bytes` (its K and V rows and its state)."""
    per_slot = 2 * kv_heads * head_dim * itemsize + SLOT_STATE_BYTES
    return budget_bytes // (max(layers, 1) * per_slot) if budget_bytes > 0 else 0


@triton.jit
def _invalidate_kernel(rows_ptr, n, tag_ptr, epoch_ptr, n_slots, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                        # everything it reads an earlier kernel (or the step's input copy) wrote
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = tl.load(rows_ptr + i, mask=ok, other=-1).to(tl.int64)
    ok = ok & (row >= 0)
    slot = tl.where(ok, row % n_slots, 0)
    tag = tl.load(tag_ptr + slot, mask=ok, other=-1)
    tl.store(tag_ptr + slot, tl.full([BLOCK], -1, tl.int64), mask=ok & (tag == row))
    if tl.program_id(0) == 0:
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


@triton.jit
def _plan_kernel(sel_ptr, tables_ptr, ctx_ptr, tag_ptr, hitmark_ptr, claim_ptr, epoch_ptr, counts_ptr, n_sel, n_slots,
                 s_sb, s_tb, PAGE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                        # the selection, the tags and the epoch are earlier kernels' outputs
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ctx = tl.load(ctx_ptr + b)
    pos = tl.load(sel_ptr + b.to(tl.int64) * s_sb + j, mask=j < n_sel, other=-1)
    ok = (j < n_sel) & (pos >= 0) & (pos < ctx)                 # the split kernel's visible columns
    pos = tl.where(ok, pos, 0)
    page = tl.load(tables_ptr + b.to(tl.int64) * s_tb + pos // PAGE, mask=ok, other=0)
    row = page.to(tl.int64) * PAGE + pos % PAGE
    slot = tl.where(ok, row % n_slots, 0)
    epoch = tl.load(epoch_ptr)
    hit = ok & (tl.load(tag_ptr + slot, mask=ok, other=-1) == row)
    tl.store(hitmark_ptr + slot, tl.zeros([BLOCK], tl.int64) + epoch, mask=hit)
    tl.atomic_max(claim_ptr + slot, (epoch << 32) | row, mask=ok & ~hit)
    tl.atomic_add(counts_ptr, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(ok.to(tl.int64), axis=0))


def invalidate(cache: RowCache, rows: torch.Tensor) -> None:
    """Step 1: rows [N] (int32/int64, -1 ignored) were just written to host memory; also starts the next epoch."""
    n = rows.numel()
    block = 128
    pdl = pdl_usable(cache.tag)
    _invalidate_kernel[(max(1, triton.cdiv(n, block)),)](rows, n, cache.tag, cache.epoch, cache.n_slots,
                                                         BLOCK=block, num_warps=4, PDL=pdl, launch_pdl=pdl)


def plan(cache: RowCache, selected: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
         block_size: int) -> None:
    """Step 2 for a decode step's selection (`selected` [B, S] int32 positions, -1 = padding, as the split kernel
    reads them): mark the hits, claim the misses' slots, count both."""
    B, S = selected.shape
    assert selected.dtype == torch.int32 and selected.stride(-1) == 1 and block_tables.dtype == torch.int32
    block = 128
    pdl = pdl_usable(selected)
    _plan_kernel[(B, max(1, triton.cdiv(S, block)))](
        selected, block_tables, context_lens, cache.tag, cache.hitmark, cache.claim, cache.epoch, cache.counts, S,
        cache.n_slots, selected.stride(0), block_tables.stride(0), PAGE=block_size, BLOCK=block, num_warps=4,
        PDL=pdl, launch_pdl=pdl)
