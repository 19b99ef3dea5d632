"""A sequence's block table as the stages keep it (`BlockTable`): grown in place, read without a copy, and a step
built from it sees exactly the ids it had when built."""

from __future__ import annotations

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
    # built once a step: every attention layer of the stage asks for the same rows
    assert a.context_rows(0, 6) is a.context_rows(0, 6) and a.context_rows(0, 5).tolist() == [36, 37, 38, 39, 8]


def test_a_step_reads_a_block_table_without_copying_it():
    """A 262k-token sequence's 16,384 block ids are not copied or converted per step: the step's table is a view of
    the BlockTable's own buffer (lists were copied, padded and converted every step: ~1 ms a sequence)."""
    tables = [BlockTable(range(i, 4 * 16384, 4)) for i in range(4)]
    batch = StepBatch.build([([1], 16384 * 16 - 1, i, t) for i, t in enumerate(tables)], 16)
    for seen, table in zip(batch.block_tables, tables):
        assert np.shares_memory(seen, table.view()) and len(seen) == 16384
    assert batch.device_tables()[0].shape == (4, 16384)
