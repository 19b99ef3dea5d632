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
from dataclasses import dataclass

import numpy as np
import torch

from shared.ngram_hash import hash_windows_numpy, hide_behind_eos, ngram_rows_numpy_batch, numpy_constants
from shared.ple_table import uint_view
from stage_worker.host_copy import to_device
from stage_worker.profiling import phase


class DecodeRowGather:
    """The rows of this stage's PLE layers for one decode step, computed in this process."""

    def __init__(self, model, cache, layers: list[int], device: torch.device, numpy: bool = True) -> None:
        self.branches = {layer: model.layers[str(layer)].ple for layer in layers}
        self.contexts = cache.ple[layers[0]].context      # every PLE layer's context holds the same token ids
        self.device = device
        self.steps = 0
        self.seconds = 0.0
        # The host path in numpy alone (`_fast`): one set of n-gram windows a step (`_windows`), each layer's hash
        # constants and its table's `gather_into`. Why: h100-33 measured this gather at 0.22 ms a step (4 streams)
        # in a served run where it takes ~34 us back to back on the 2-core VM; with the CPU caches emptied between
        # steps, as a served step's other work leaves them, the torch path took 221 us there (hash 55, index_select
        # 82, the rest and the pinned copy 82) and this one 95 (hash 60, gather 22, the rest 13;
        # bench/ple_decode_gather.py --thrash-mib 64, bench/results/ple-decode-gather-1): a torch op's dispatch is a
        # long walk through cold code; h100-34, served: 0.09-0.11 ms a step. A table without `gather_into` keeps the
        # torch path, as `numpy` False does (`ple_gather_numpy`, MOEPIPE_PLE_GATHER_NUMPY=0: the A/B).
        first = next(iter(self.branches.values()))
        self._fast = numpy and all(hasattr(b.table, "gather_into") for b in self.branches.values()) and \
            all(b.spec.ngram_size == first.spec.ngram_size and b.spec.eos_token_id == first.spec.eos_token_id
                for b in self.branches.values())
        if self._fast:                            # (layer order: each layer's hash constants and table)
            self._consts = [(numpy_constants(b.spec), b.table) for b in self.branches.values()]
            for b in self.branches.values():      # a procedural table builds its host block now, not in a step
                b.table.gather_into(np.zeros(1, dtype=np.int64))

    def __call__(self, slots: list[int], token_ids: list[int]) -> dict[int, torch.Tensor]:
        """Layer -> rows [B, heads, head_dim] on the device, for sequences in `slots` feeding `token_ids`; the
        n-gram contexts are read, not advanced (the forward advances them)."""
        t0 = time.perf_counter()
        # Named phases for MOEPIPE_PROFILE's tables: h200-20 timed the whole at 0.28-0.46 ms a step against ~40 us
        # of hashing and gathering on a slow CPU alone, so the rest (the contexts' read-back, the pinned copy) is
        # what a served profile should show.
        with phase("ple.contexts"):
            contexts = self.contexts.cpu().numpy()
        out = {}
        if self._fast:
            windows = self._windows(contexts, slots, token_ids)
            for layer, (consts, table) in zip(self.branches, self._consts):
                with phase("ple.gather"):
                    emb = torch.from_numpy(table.gather_into(hash_windows_numpy(windows, consts))).view(table.dtype)
                with phase("ple.to_device"):
                    out[layer] = to_device(emb, emb.dtype, self.device)
        else:
            for layer, emb in self._host_rows(contexts, slots, token_ids):
                with phase("ple.to_device"):
                    out[layer] = to_device(emb, emb.dtype, self.device)
        self.steps += 1
        self.seconds += time.perf_counter() - t0
        return out

    def _windows(self, contexts: np.ndarray, slots: list[int], token_ids: list[int]) -> np.ndarray:
        """Each sequence's n-gram window [B, ngram_size], newest first (the token, then its context backwards),
        passed through `ngram_hash.hide_behind_eos`: one for every PLE layer of the step (`_fast` checked that
        their specs differ only in the hash constants), each hashed by `ngram_hash.hash_windows_numpy`."""
        spec = next(iter(self.branches.values())).spec
        w = np.empty((len(slots), spec.ngram_size), dtype=np.int64)
        w[:, 0] = token_ids
        w[:, 1:] = contexts[slots, ::-1]
        return hide_behind_eos(w, spec.eos_token_id)

    def _host_rows(self, contexts: np.ndarray, slots: list[int], token_ids: list[int]):
        """(layer, rows [B, heads, head_dim] on the host) of each PLE layer, hashed against `contexts` (every
        slot's, as a host array): the torch path, for tables without `gather_into`."""
        contexts = contexts[slots]
        tokens = np.asarray(token_ids, dtype=np.int64)
        for layer, branch in self.branches.items():
            with phase("ple.hash"):
                rows, _ = ngram_rows_numpy_batch(branch.spec, contexts, tokens)
            with phase("ple.gather"):
                yield layer, branch.table.gather(torch.from_numpy(rows))

    def publish(self, box: "PleMailbox", slots: list[int], token_ids: list[int], seq: int) -> None:
        """`ple_launch_ahead`: the rows of a step already launched (its graph waiting in `host_wait`), hashed against
        the contexts the step before left (`box.contexts`, copied out behind that step: reading the live ones
        would wait behind the waiting graph), written into the pinned rows, then the flag set to the step's
        number. The flag is set even if the gather fails, so the device never waits for rows that will not come
        (that step's tokens are then wrong; the error propagates to the caller)."""
        t0 = time.perf_counter()
        if box.host is None:                  # numpy views of the mailbox's pinned memory, made once
            box.host = (box.contexts.numpy(),
                        uint_view(box.rows) if self._fast and box.rows.dtype == self._consts[0][1].dtype else None,
                        None if box.ids is None else box.ids.numpy(), box.flag.numpy())
        contexts, rows, ids, flag = box.host
        try:
            n = len(slots)
            if rows is not None:
                windows = self._windows(contexts, slots, token_ids)
                for li, (consts, table) in enumerate(self._consts):      # straight into the pinned rows
                    table.gather_into(hash_windows_numpy(windows, consts), rows[:n, li])
            else:
                for li, (_, emb) in enumerate(self._host_rows(contexts, slots, token_ids)):
                    box.rows[:n, li].copy_(emb)
            if ids is not None:               # the graph's input ids too (padding rows: 0)
                ids[:] = 0
                ids[: len(token_ids)] = token_ids
        finally:
            flag[0] = seq                     # (a plain store, after the rows' stores: x86 keeps them in order)
            self.steps += 1
            self.seconds += time.perf_counter() - t0


@dataclass
class PleMailbox:
    """Where a launched-ahead decode step's PLE rows wait for its graph (`ple_launch_ahead`,
    `stage_worker/kernels/host_wait.py`): pinned rows the graph's first kernel copies once `flag` reaches the number
    in `expected`, and a pinned copy of the n-gram contexts that the host hashes against. `ids`
    (`ple_launch_ahead_across_stages`): on a first stage that does not sample, the step's input ids come this way
    too (the last stage's Sampled brings them to the host); one stage reads them from its own sampled tokens on the
    device instead."""

    rows: torch.Tensor        # pinned [max_seqs, layers, heads, head_dim]: this stage's PLE layers, in order
    flag: torch.Tensor        # pinned [1] int64: the last step whose rows are in `rows`
    expected: torch.Tensor    # device [1] int64: the step the next replay waits for (set before each replay)
    timed_out: torch.Tensor   # device [1] int64: the number of the last step whose graph gave up waiting
    contexts: torch.Tensor    # pinned copy of the contexts, taken behind every launched step
    ids: torch.Tensor | None = None   # pinned [max_seqs] int64: the step's input ids (None: not this way)
    seq: int = 0
    host: tuple | None = None         # (contexts, rows, ids, flag): numpy views of the same memory (first publish)

    @classmethod
    def create(cls, gather: DecodeRowGather, max_seqs: int, dtype: torch.dtype,
               device: torch.device, with_ids: bool = False) -> "PleMailbox":
        first = next(iter(gather.branches.values()))

        def host(t: torch.Tensor) -> torch.Tensor:       # what the device reads or writes behind the host's back
            return t.pin_memory() if device.type == "cuda" else t

        rows = host(torch.zeros(max_seqs, len(gather.branches), first.heads, first.head_dim, dtype=dtype))
        box = cls(rows, host(torch.zeros(1, dtype=torch.int64)),
                  torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                  host(torch.empty(gather.contexts.shape, dtype=gather.contexts.dtype)))
        box.contexts.copy_(gather.contexts)       # at start nothing is queued: a plain copy
        if with_ids:                              # (graph sizes never exceed max_seqs: rows[:size] as ids[:size])
            box.ids = host(torch.zeros(max_seqs, dtype=torch.int64))
        return box
