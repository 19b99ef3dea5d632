"""A PLE stage gathers its own decode rows (`ple_decode_in_stage`, issue 14).

With the PLE service, each decode step's rows took a round trip after the sampled token reached the host: stage ->
service (hash, gather into the ring) -> stage, two ZeroMQ hops and two Python loops. The next step's rows depend on
that token, so nothing could overlap it: ~0.8 ms a step at one stream on the H200 (full shape, stages waiting for
rows 17% of the time, bench/results/served-speed-9), the whole gap between the served TPOT and the in-process step.

A decode step needs one row per table head per sequence. The stage has the token ids on the host already and maps
the same table file the service maps (one page cache). So here it hashes them on the host against the n-gram
contexts its own cache holds (one small device-to-host copy: the step before is complete, since a stage fed PLE
rows runs one step at a time) and gathers the rows itself, microseconds of work. The service still gathers every
prefill chunk, where a gather of thousands of rows belongs off the stage's critical path, and still prefetches
prompts; the rows it puts in the ring for a decode step are simply not read. Switch: `ple_decode_in_stage`
(`MOEPIPE_PLE_DECODE_IN_STAGE=0` restores the service's rows for every step); `ple_decode_in_stage_max_seqs` N
keeps the service's rows for decode steps of more than N sequences (0, the default: none; 2 until h200-16, where
those steps waited ~1.2 ms each for the round trip at 4 streams, 15% of the run).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shared.ngram_hash import ngram_rows_numpy_batch
from stage_worker.host_copy import to_device
from stage_worker.profiling import phase


class DecodeRowGather:
    """The rows of this stage's PLE layers for one decode step, computed in this process."""

    def __init__(self, model, cache, layers: list[int], device: torch.device) -> None:
        self.branches = {layer: model.layers[str(layer)].ple for layer in layers}
        self.contexts = cache.ple[layers[0]].context      # every PLE layer's context holds the same token ids
        self.device = device
        self.steps = 0
        self.seconds = 0.0

    def __call__(self, slots: list[int], token_ids: list[int]) -> dict[int, torch.Tensor]:
        """Layer -> rows [B, heads, head_dim] on the device, for sequences in `slots` feeding `token_ids`; the
        n-gram contexts are read, not advanced (the forward advances them)."""
        t0 = time.perf_counter()
        # Named phases for MOEPIPE_PROFILE's tables: h200-20 timed the whole at 0.28-0.46 ms a step against ~40 us
        # of hashing and gathering on a slow CPU alone, so the rest (the contexts' read-back, the pinned copy) is
        # what a served profile should show.
        with phase("ple.contexts"):
            contexts = self.contexts.cpu().numpy()[slots]
        tokens = np.asarray(token_ids, dtype=np.int64)
        out = {}
        for layer, branch in self.branches.items():
            with phase("ple.hash"):
                rows, _ = ngram_rows_numpy_batch(branch.spec, contexts, tokens)
            with phase("ple.gather"):
                emb = branch.table.gather(torch.from_numpy(rows))
            with phase("ple.to_device"):
                out[layer] = to_device(emb, emb.dtype, self.device)
        self.steps += 1
        self.seconds += time.perf_counter() - t0
        return out
