"""A sequence's block table as the stages keep it (`BlockTable`): grown in place, read without a copy, and a step
built from it sees exactly the ids it had when built."""

from __future__ import annotations

import time

import numpy as np
import torch

from stage_worker.model.batch import BlockTable, StepBatch


def test_a_view_keeps_what_it_saw_when_the_table_grows():
    t = BlockTable([3, 1])
    early = t.view()
    t.extend([7])                       # within the first buffer: lands past the early view's end
    assert early.tolist() == [3, 1] and t.view().tolist() == [3, 1, 7]
    mid = t.view()
    t.extend(range(100, 140))           # grows: a new buffer, the old views keep theirs
    assert mid.tolist() == [3, 1, 7] and len(t) == 43 and t[42] == 139 and list(t)[:4] == [3, 1, 7, 100]
    assert t == [3, 1, 7, *range(100, 140)] and t.view().dtype == np.int32
    t.extend(np.array([5], dtype=np.int64))
    assert t[-1] == 5 and BlockTable() == []


def test_a_step_from_block_tables_equals_one_from_lists():
    """Slot mapping, padded device tables, context rows: the same from BlockTables and from lists, for a prefill
    chunk and decode rows of different lengths."""
    bs = 4
    lists = [[9, 2, 5], [4], [0, 8, 6, 1, 3]]
    seqs = [([11, 12, 13], 6, 0), ([7], 2, 1), ([5], 17, 2)]          # (tokens, context, slot)
    a = StepBatch.build([(tk, c, s, lst) for (tk, c, s), lst in zip(seqs, lists)], bs)
    b = StepBatch.build([(tk, c, s, BlockTable(lst)) for (tk, c, s), lst in zip(seqs, lists)], bs)
    want = [2 * bs + 2, 2 * bs + 3, 5 * bs + 0, 4 * bs + 2, 3 * bs + 1]
    assert a.slot_mapping.tolist() == b.slot_mapping.tolist() == want
    for x, y in zip(a.device_tables(), b.device_tables()):
        assert torch.equal(x, y) and x.dtype == torch.int32
    assert a.device_tables()[0].tolist() == [[9, 2, 5, 0, 0], [4, 0, 0, 0, 0], [0, 8, 6, 1, 3]]
    assert torch.equal(a.context_rows(2, 18), b.context_rows(2, 18))
    assert a.context_rows(0, 6).tolist() == [36, 37, 38, 39, 8, 9]


def test_a_long_context_step_builds_in_well_under_a_millisecond():
    """Four sequences of 16,384 blocks (262k tokens each): a decode step's batch and its device tables from
    BlockTables, where the lists took ~0.4 ms a sequence (a loose bound: this is a correctness test of the path's
    shape, the H200 bench measures the step)."""
    tables = [BlockTable(range(i, 4 * 16384, 4)) for i in range(4)]
    rows = [([1], 16384 * 16 - 1, i, t) for i, t in enumerate(tables)]
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        StepBatch.build(rows, 16).device_tables()
        best = min(best, time.perf_counter() - t0)
    assert best < 0.02, best
