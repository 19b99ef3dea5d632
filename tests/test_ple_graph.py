"""The PLE stage under the decode graph (issue 14): a graph reads each PLE layer's table rows from a static buffer
filled before the replay, so `PLEBranch.decode_embeddings` must give exactly the rows the eager forward gathers,
without advancing the n-gram context (the graph advances it). On the CPU with the tiny checkpoint's real,
memory-mapped table; the captured graphs themselves are checked on a GPU (tests/test_gpu_model.py)."""

from __future__ import annotations

import copy

import torch

from stage_worker.checkpoint.loader import load_model
from stage_worker.local_engine import LocalEngine
from stage_worker.model.batch import StepBatch


def test_rows_gathered_before_the_step_equal_the_forward_s_own(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    ples = {int(i): layer.ple for i, layer in model.layers.items() if getattr(layer, "ple", None) is not None}
    assert ples, "the tiny preset has PLE layers"
    engine = LocalEngine([model], max_seqs=2, block_size=16, max_tokens=64)
    for s in (0, 1):
        engine.add(s)
    with torch.inference_mode():
        engine.step([(0, list(range(20, 31))), (1, list(range(40, 45)))])
        seqs = [engine.seqs[0], engine.seqs[1]]

        def decode_batch():
            return StepBatch.build([([77], seqs[0].length, seqs[0].slot, seqs[0].blocks),
                                    ([91], seqs[1].length, seqs[1].slot, seqs[1].blocks)], 16)

        cache = engine.caches[0]
        copied = copy.deepcopy(cache)
        eager = decode_batch()
        ref = model.logits(model(eager, cache), eager)
        staged = decode_batch()
        before = {i: copied.ple[i].context.clone() for i in ples}
        staged.ple_rows = {i: ple.decode_embeddings(staged, copied.ple[i]) for i, ple in ples.items()}
        for i in ples:                       # gathering did not touch the context
            assert torch.equal(copied.ple[i].context, before[i])
        out = model.logits(model(staged, copied), staged)
    assert torch.equal(out, ref)
    for i in ples:
        assert torch.equal(copied.ple[i].context, cache.ple[i].context)
        assert torch.equal(copied.ple[i].conv, cache.ple[i].conv)
