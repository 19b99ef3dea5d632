"""Kernel flag `staged_inputs` (stage_worker/graph_inputs.py): the packed buffer a decode graph reads holds what the
eager path's StepBatch tensors and the graph's padding held, row for row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stage_worker.graph_inputs import InputLayout, Padding, pack
from stage_worker.kernels.flags import KernelFlags
from stage_worker.model.batch import StepBatch


def _decode_batch(rng: np.random.Generator, n: int, block_size: int, max_blocks: int) -> StepBatch:
    seqs = []
    for _ in range(n):
        ctx = int(rng.integers(1, block_size * max_blocks))        # the token fed sits at position ctx
        blocks = rng.choice(10_000, size=ctx // block_size + 1, replace=False).tolist()
        seqs.append(([int(rng.integers(0, 500))], ctx, int(rng.integers(0, 64)), blocks))
    return StepBatch.build(seqs, block_size, "cpu")


@pytest.mark.parametrize("seed", range(6))
def test_packed_inputs_equal_the_step_batch_s_and_the_padding(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 3, 16, 64]))
    max_blocks = int(rng.integers(1, 40))
    size = int(rng.choice([1, 2, 4, 8, 16]))
    n = int(rng.integers(0, size + 1))
    batch = _decode_batch(rng, n, block_size, max_blocks)
    layout, pad = InputLayout(size, max_blocks), Padding(scratch_slot=99, scratch_block=12_345, block_size=block_size)
    buf = np.full(layout.nbytes(), 0xA5, dtype=np.uint8)             # stale bytes of an earlier step
    width = pack(buf, layout, pad, batch.context_lens, batch.block_tables, batch.slots)
    assert width == max([len(t) for t in batch.block_tables] + [1])
    positions, rows, slots, lens, tables = layout.views(buf, width)
    assert batch.is_decode or n == 0
    assert positions[:n].tolist() == batch.positions.tolist()
    assert rows[:n].tolist() == batch.slot_mapping.tolist()
    assert slots[:n].tolist() == batch.slots
    if n:
        want_tables, want_lens = batch.device_tables()
        assert lens[:n].tolist() == want_lens.tolist()
        assert tables[:n].tolist() == want_tables.tolist()             # as wide, padded with 0 as it pads
    # padding rows: position 1 in the scratch block, the scratch slot, a length of 2
    assert set(positions[n:].tolist()) <= {1} and set(lens[n:].tolist()) <= {2}
    assert set(rows[n:].tolist()) <= {12_345 * block_size + 1} and set(slots[n:].tolist()) <= {99}
    assert (tables[n:] == 12_345).all()


def test_the_views_of_a_tensor_are_the_numpy_views():
    layout = InputLayout(4, 7)
    host = np.zeros(layout.nbytes(), dtype=np.uint8)
    width = pack(host, layout, Padding(5, 6, 16), [17, 40], [np.array([3, 9], np.int32),
                                                             np.array([1, 2, 8], np.int32)], [0, 3])
    assert width == 3
    dev = torch.from_numpy(host.copy())
    for a, t in zip(layout.views(host, width), layout.views(dev, width)):
        assert t.dtype == {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}[a.dtype]
        assert t.tolist() == a.tolist()
    assert layout.tables_at % 8 == 0 and layout.nbytes() == layout.tables_at + 4 * 4 * 7
    assert layout.nbytes(width) == layout.tables_at + 4 * 4 * 3      # what a step copies: not 7-wide rows


def test_staged_inputs_is_named_only():
    """Not in `all` until a GPU has run the graphs with it (tests/test_gpu_staged_inputs.py) and timed it."""
    assert not KernelFlags.parse("all").staged_inputs
    assert KernelFlags.parse("all,staged_inputs").staged_inputs
