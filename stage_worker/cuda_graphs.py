"""CUDA graphs of decode steps, captured for a ladder of batch sizes; a step replays the smallest that fits.

A decode step of a 48-layer model is thousands of small kernels; launched one by one from Python the GPU idles
between them (001 §5.6, 002 §3: full CUDA graphs were one of the three fixes that took decode from 29% of the
bandwidth roofline). Capture needs a step with no host synchronisation and fixed-shape inputs: every input the step
reads is a static buffer here, refilled before each replay. Batches smaller than a graph are padded with entries
that write only to a scratch slot and a scratch KV block reserved for that purpose.

A stage holding PLE layers is graphed too (001 §5.6: 45 -> 80 tok/s): the graph reads each PLE layer's table rows
from a static device buffer, filled before the replay from the PLE service's ring (the runner's `batch.ple_rows`)
or, without the service, gathered by the stage itself (`PLEBranch.decode_embeddings`: the one host round trip of
the row ids happens there, outside the graph). The n-gram hashing and context update stay inside the graph: they
run on the device. With a `PleMailbox` (`ple_launch_ahead`) the graph starts with `host_wait.wait_and_copy`
instead: it is replayed before its rows exist and copies them from pinned memory once the host has written them
(with `ple_launch_ahead_across_stages`, on a first stage that does not sample, the input ids as well).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.expert_offload import uncounted
from stage_worker.graph_inputs import PAD_LENGTH, PAD_POSITION, InputLayout, Padding, StagedInputs
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import ModelCache
from stage_worker.model.model import StageModel
from stage_worker.model.moe import SparseMoE

CAPTURED_SIZES = (1, 2, 4, 8, 16)      # batch sizes with a decode graph (issue 14: the fused kernels go to 16 too)


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes a server of `max_num_seqs` sequences can use (at least 1)."""
    return tuple(s for s in CAPTURED_SIZES if s <= max_num_seqs) or (1,)


@dataclass
class _Graph:
    size: int
    graph: torch.cuda.CUDAGraph
    batch: StepBatch
    hidden_in: torch.Tensor | None
    out: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    ple_rows: dict[int, torch.Tensor]   # layer -> [size, heads, head_dim]: the rows the graph's PLE branches read
    expert_ids: list        # each MoE layer's routing output inside this graph (for routing statistics)
    inputs: torch.Tensor | None = None  # `staged_inputs`: the buffer lens, slots, positions, KV rows view


class DecodeGraphs:
    def __init__(self, model: StageModel, cache: ModelCache, *, max_blocks_per_seq: int, scratch_slot: int,
                 scratch_block: int, sizes: tuple[int, ...], ple_graph: bool = True,
                 skip_padding: bool = True, mailbox=None) -> None:
        self.model, self.cache = model, cache
        self.block_size = cache.spec.block_size
        self.max_blocks = max_blocks_per_seq
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.sizes = tuple(sorted(sizes))
        self.device = next(model.parameters()).device
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.ple = {int(i): layer.ple for i, layer in model.layers.items() if getattr(layer, "ple", None) is not None}
        self.ple_graph = ple_graph
        self.mailbox = mailbox                 # a PleMailbox: rows come in the graph (ple_decode_rows.py)
        # Listed once: walking the module tree (551 modules at 20 full-shape layers) took ~1.1 ms of host time per
        # replay on a slow CPU, with the GPU waiting for the next step's launch.
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        # Padding rows route to no expert (`SparseMoE.valid_rows`): a batch of 9 replayed as 16 would otherwise
        # read the experts of 7 rows nobody wants (expert bytes are most of a decode step's). Off: `graph_skip_padding`.
        self.valid = torch.zeros(1, dtype=torch.int32, device=self.device) if skip_padding else None
        self.pad = Padding(scratch_slot, scratch_block, self.block_size)
        # Kernel flag `staged_inputs` (graph_inputs.py): the integer inputs in one buffer a graph, one copy a step.
        self.staged = None
        if getattr(getattr(model, "kernel_flags", None), "staged_inputs", False):
            self.staged = StagedInputs(InputLayout(self.sizes[-1], self.max_blocks).nbytes(), self.pad)

    def capture(self) -> None:
        moes = self.moes
        for m in moes:
            m.valid_rows = self.valid
        try:
            with uncounted(self.model):                   # the warm-up runs are no request's traffic
                for size in reversed(self.sizes):         # largest first: smaller graphs reuse its memory pool
                    if self.valid is not None:
                        self.valid.fill_(size)            # the warm-up runs take every row
                    self.graphs[size] = self._capture(size)
        finally:
            for m in moes:
                m.valid_rows = None                       # eager steps (prefill, steps that do not fit) take all rows

    def _static_batch(self, size: int) -> tuple[StepBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self.device
        seqs = [([0], PAD_POSITION, self.scratch_slot, [self.scratch_block]) for _ in range(size)]
        batch = StepBatch.build(seqs, self.block_size, dev)
        tables = torch.full((size, self.max_blocks), self.scratch_block, dtype=torch.int32, device=dev)
        if self.staged is not None:                 # views of one buffer, filled as an empty batch pads it
            layout = InputLayout(size, self.max_blocks)
            batch._inputs = torch.empty(layout.nbytes(), dtype=torch.uint8, device=dev)
            self.staged.copy(layout, batch._inputs, tables, [], [], [])
            batch.positions, batch.slot_mapping, slots, lens, _ = layout.views(batch._inputs)
        else:                                       # made now: a lazy copy must not happen inside the capture
            batch.positions, batch.slot_mapping = batch.positions, batch.slot_mapping
            lens = torch.full((size,), PAD_LENGTH, dtype=torch.int32, device=dev)
            slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=dev)
        batch._tables = (tables, lens)
        batch._slots = slots
        batch.logits_indices = torch.arange(size, device=dev)
        dtype = next(self.model.parameters()).dtype
        if self.mailbox is not None:               # one buffer the prologue fills, a view a layer
            rows = torch.zeros(size, *self.mailbox.rows.shape[1:], dtype=dtype, device=dev)
            batch.ple_rows = {i: rows[:, li] for li, i in enumerate(sorted(self.ple))}
            batch._mailbox_rows = rows
        else:
            batch.ple_rows = {i: torch.zeros(size, ple.heads, ple.head_dim, dtype=dtype, device=dev)
                              for i, ple in self.ple.items()}
        return batch, tables, lens, slots

    def _run(self, batch: StepBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        box = self.mailbox
        if box is not None:
            from stage_worker.kernels.host_wait import wait_and_copy

            dst = batch._mailbox_rows
            wait_and_copy(box.flag, box.expected, box.rows[: dst.shape[0]], dst, box.timed_out)
            if box.ids is not None:                 # the ids came with the rows (the flag is reached: no wait)
                wait_and_copy(box.flag, box.expected, box.ids[: dst.shape[0]], batch.token_ids, box.timed_out)
        out = self.model(batch, self.cache, hidden)
        return self.model.logits(out, batch) if self.model.has_head else out

    def _capture(self, size: int) -> _Graph:
        batch, tables, lens, slots = self._static_batch(size)
        hidden_in = None
        if not self.model.has_embedding:
            hidden_in = torch.zeros(size, self.model.stream_width, dtype=next(self.model.parameters()).dtype,
                                    device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):                         # warm-up: Triton autotuning and lazy init happen here
                self._run(batch, hidden_in)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(batch, hidden_in)
        self.pool = graph.pool()
        ids = [m.last_expert_ids for m in self.moes]
        return _Graph(size, graph, batch, hidden_in, out, tables, lens, slots, batch.ple_rows, ids,
                      getattr(batch, "_inputs", None))

    def fits(self, batch: StepBatch) -> bool:
        """`ple_graph` off (`MOEPIPE_PLE_GRAPH=0`): a stage with PLE layers runs its decode steps eagerly."""
        return bool(self.graphs) and batch.is_decode and batch.num_seqs <= self.sizes[-1] and \
            all(len(t) <= self.max_blocks for t in batch.block_tables) and (self.ple_graph or not self.ple)

    @torch.inference_mode()
    def run(self, batch: StepBatch, hidden: torch.Tensor | None = None, wait_seq: int | None = None) -> torch.Tensor:
        """Replay for `batch` (which `fits`); returns logits [B, vocab] (last stage) or hidden [B, width]. With a
        mailbox, `wait_seq` is the number the graph waits for before it copies the rows."""
        n = batch.num_seqs
        g = self.graphs[next(s for s in self.sizes if s >= n)]
        sb = g.batch
        ids_in_graph = self.mailbox is not None and self.mailbox.ids is not None
        if not ids_in_graph:
            sb.token_ids[:n].copy_(batch.token_ids, non_blocking=True)
            if n < g.size:
                sb.token_ids[n:].zero_()
        if g.inputs is not None:                        # padding included: scratch slot, scratch block
            self.staged.copy(InputLayout(g.size, self.max_blocks), g.inputs, g.tables, batch.context_lens,
                             batch.block_tables, batch.slots)
        else:
            sb.positions[:n].copy_(batch.positions, non_blocking=True)
            sb.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
            tables, lens = batch.device_tables()
            g.tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
            g.lens[:n].copy_(lens, non_blocking=True)
            g.slots[:n].copy_(batch.device_slots(), non_blocking=True)
            if n < g.size:                              # padding entries: scratch slot, scratch block
                sb.positions[n:].fill_(PAD_POSITION)
                sb.slot_mapping[n:].fill_(self.pad.kv_row)
                g.tables[n:].fill_(self.scratch_block)
                g.lens[n:].fill_(PAD_LENGTH)
                g.slots[n:].fill_(self.scratch_slot)
        if self.mailbox is not None:                    # the graph copies the rows once the host has them
            self.mailbox.expected.fill_(wait_seq)
        else:
            for i, buf in g.ple_rows.items():
                rows = batch.ple_rows.get(i)
                if rows is None:                        # no PLE service: the stage gathers the rows itself
                    rows = self.ple[i].decode_embeddings(batch, self.cache.ple[i])
                buf[:n].copy_(rows, non_blocking=True)
                buf[n:].zero_()
        if g.hidden_in is not None:
            g.hidden_in[:n].copy_(hidden, non_blocking=True)
        if self.valid is not None:
            self.valid.fill_(n)
        g.graph.replay()
        if ids_in_graph:                                # the ids the graph read, for the next stage (a copy queued
            batch.token_ids = sb.token_ids[:n].clone()  # behind the replay: the next replay rewrites the buffer)
        for m, ids in zip(self.moes, g.expert_ids):
            m.last_expert_ids = ids if ids is None or n == g.size else ids[:n]
        return g.out[:n]
