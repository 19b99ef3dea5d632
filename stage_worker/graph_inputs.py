"""A decode graph's integer inputs in one device buffer, written by one queued copy from pinned host memory.

Why: h200-36 split the synced decode step's host share (1.0-1.3 ms a step on the 48-layer model): the graph's launch
was 0.02-0.29 ms of it, the rest the inputs: a pinned allocation and a queued copy for each of the block tables,
their lengths and the state slots, then a device copy into each of the graph's static buffers and six padding
fills, about fifteen operations a step before the replay. Here the host writes positions, KV rows, slots, lengths
and the block tables (as wide as the step's longest), padding included, into pinned memory with numpy; one copy
moves them, the graph reads views of the device buffer, and one device copy puts the tables into the graph's
(kernel flag `staged_inputs`; off: the copies above).

A decode step's inputs all follow from three host lists: each sequence's context length (its position; its length
after the step is one more), its block table (its KV row: the block holding the position) and its state slot.
The pinned buffers form a ring, each reused only after the copy that last read it has run (an event): the host
can prepare step t+1 while step t's copy is still queued behind the GPU's work (launch-ahead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

RING = 4          # pinned buffers: more than the steps a stage queues ahead (launch_depth 2)


@dataclass(frozen=True)
class InputLayout:
    """Where each input of a graph of `size` rows lies in its buffer: positions, KV rows and slots as int64
    [size], lengths int32 [size], then the step's block tables int32 [size, width] packed to the batch's longest
    table. The graph's own tables [size, max_blocks] are a separate tensor that a device copy fills [:, :width]
    from the packed ones: a server sized for 262k tokens has 16,384 blocks a row, and copying whole rows each step
    (1 MiB at 16 rows) would cost more than the copies this replaces."""
    size: int
    max_blocks: int

    @property
    def lens_at(self) -> int:
        return 24 * self.size

    @property
    def tables_at(self) -> int:
        return -(-(self.lens_at + 4 * self.size) // 8) * 8

    def nbytes(self, width: int | None = None) -> int:
        """Bytes of the inputs with tables `width` wide (default the widest, `max_blocks`)."""
        return self.tables_at + 4 * self.size * (self.max_blocks if width is None else width)

    def views(self, buf, width: int | None = None):
        """(positions, rows, slots, lens, tables [size, width]) of a uint8 buffer: numpy arrays for a numpy buffer,
        tensors for a tensor."""
        n, w = self.size, self.max_blocks if width is None else width
        if isinstance(buf, np.ndarray):
            i64, i32 = (lambda a, b: buf[a:b].view(np.int64)), (lambda a, b: buf[a:b].view(np.int32))
        else:
            i64, i32 = (lambda a, b: buf[a:b].view(torch.int64)), (lambda a, b: buf[a:b].view(torch.int32))
        return (i64(0, 8 * n), i64(8 * n, 16 * n), i64(16 * n, 24 * n), i32(self.lens_at, self.lens_at + 4 * n),
                self.tables(buf, w))

    def tables(self, buf, width: int):
        """The block tables [size, width] of a uint8 buffer (numpy or tensor, as `views`)."""
        part = buf[self.tables_at:self.nbytes(width)]
        return (part.view(np.int32) if isinstance(buf, np.ndarray) else part.view(torch.int32)).reshape(self.size,
                                                                                                         width)


PAD_POSITION = 1    # a padding row's token: position 1 of the scratch block (context 1: the decode kernels apply)
PAD_LENGTH = 2      # ... so its context is 2 tokens long after the step


@dataclass(frozen=True)
class Padding:
    """What a graph's rows past the batch hold: they write only the scratch slot and the scratch KV block."""
    scratch_slot: int
    scratch_block: int
    block_size: int

    @property
    def kv_row(self) -> int:
        return self.scratch_block * self.block_size + PAD_POSITION


def table_width(block_tables: Sequence[np.ndarray]) -> int:
    """The packed tables' width for a step: its longest block table (at least 1: a padding row's scratch block)."""
    return max([len(t) for t in block_tables] + [1])


def pack(buf: np.ndarray, layout: InputLayout, pad: Padding, context_lens: Sequence[int],
         block_tables: Sequence[np.ndarray], slots: Sequence[int]) -> int:
    """Write a decode step's inputs (one token a sequence at position context_len) into `buf`, rows past the batch
    as padding, the tables `table_width` wide (entries past a sequence's blocks 0, as `StepBatch.device_tables`
    pads them); the values the eager path's StepBatch tensors hold. Returns the width."""
    width = table_width(block_tables)
    positions, rows, slot_ids, lens, tables = layout.views(buf, width)
    n, bs = len(context_lens), pad.block_size
    ctx = np.asarray(context_lens, dtype=np.int64)
    tables[:n] = 0
    for i, t in enumerate(block_tables):
        tables[i, : len(t)] = t
    tables[n:] = pad.scratch_block
    positions[:n] = ctx
    positions[n:] = PAD_POSITION
    rows[:n] = tables[np.arange(n), ctx // bs].astype(np.int64) * bs + ctx % bs
    rows[n:] = pad.kv_row
    slot_ids[:n] = slots
    slot_ids[n:] = pad.scratch_slot
    lens[:n] = ctx + 1
    lens[n:] = PAD_LENGTH
    return width


class StagedInputs:
    """The ring of pinned buffers, sized for the largest graph, and the copies into a graph's buffers."""

    def __init__(self, nbytes: int, pad: Padding) -> None:
        self.pad = pad
        self.ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(RING)]
        self.arrays = [b.numpy() for b in self.ring]
        self.done = [torch.cuda.Event() for _ in range(RING)]      # (waiting on one never recorded returns)
        self.next = 0

    def copy(self, layout: InputLayout, dst: torch.Tensor, tables: torch.Tensor, context_lens: Sequence[int],
             block_tables: Sequence[np.ndarray], slots: Sequence[int]) -> None:
        """Pack into the next pinned buffer (once its last copy has run), queue one copy into `dst` (a buffer of
        `layout.nbytes()`) and one device copy of the packed tables into `tables` [size, max_blocks][:, :width]
        (past the width: what earlier steps left, read by no one: each row's length bounds its reads)."""
        k = self.next
        self.next = (k + 1) % RING
        self.done[k].synchronize()
        width = pack(self.arrays[k], layout, self.pad, context_lens, block_tables, slots)
        nbytes = layout.nbytes(width)
        dst[:nbytes].copy_(self.ring[k][:nbytes], non_blocking=True)
        self.done[k].record()
        tables[:, :width].copy_(layout.tables(dst, width))
