"""Logits of a whole model, step by step, in one process: the harness of the parity tests and kernel benchmarks.

No scheduler, no sampler: the caller says which tokens each sequence takes next and gets the logits back, to compare
with transformers or with what the served path sampled. Generation (tests, `moepipe generate`, the server) goes
through the engine core instead (`shared/engine_core.py`); blocks and slots come from the same block manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.block_manager import BlockManager
from shared.kv_layout import resolve_block_size
from stage_worker.model.batch import BlockTable, StepBatch
from stage_worker.model.cache import CacheSpec
from stage_worker.model.model import StageModel


@dataclass
class _Seq:
    slot: int
    blocks: BlockTable = field(default_factory=BlockTable)
    length: int = 0


class LocalEngine:
    def __init__(self, stages: list[StageModel], *, max_seqs: int = 8, block_size: int | None = None,
                 max_tokens: int = 4096, cuda_graphs: bool = False, sparse_prefill: bool = True,
                 kv_offload: bool = False, row_cache_mib: int = 0, batched_prefill: bool = True) -> None:
        """`block_size` None: derived from the model (`shared.kv_layout`), as the served cluster does;
        `sparse_prefill`: the cluster key `qsa_sparse_prefill` (StepBatch.sparse_prefill); `kv_offload`: the
        cluster key `qsa_kv_offload` (QSA K/V in host RAM, `CacheSpec.kv_offload`); `row_cache_mib`: with it on a
        GPU, the VRAM row cache of those rows (cluster keys `kv_row_cache`, `kv_row_cache_mib`; 0 = none);
        `batched_prefill`: the cluster key (StepBatch.batched_prefill: off, prefill loops over sequences)."""
        self.sparse_prefill = sparse_prefill
        self.batched_prefill = batched_prefill
        if not stages or not stages[0].has_embedding or not stages[-1].has_head:
            raise ValueError("stages must run from the embedding to the head")
        block_size = resolve_block_size(stages[0].cfg, block_size)
        self.stages, self.block_size = stages, block_size
        p = next(stages[0].parameters())
        max_blocks = -(-max_tokens // block_size)
        num_blocks = max_seqs * max_blocks
        # One more slot and block than requests can own: scratch space for CUDA-graph padding entries.
        spec = CacheSpec(num_blocks=num_blocks + 1, block_size=block_size, num_slots=max_seqs + 1, dtype=p.dtype,
                         device=p.device, kv_offload=kv_offload, row_cache_bytes=row_cache_mib << 20)
        self.device = p.device
        self.caches = [s.new_cache(spec) for s in stages]
        self.blocks = BlockManager(num_blocks, max_seqs)
        self.seqs: dict[int, _Seq] = {}
        self.graphs = None
        self.replays = 0                  # decode steps run from a CUDA graph (benchmarks report it)
        flags = getattr(stages[0], "kernel_flags", None)
        # Capture needs a step with no host synchronisation: the MoE and attention kernels must be on.
        if cuda_graphs and p.device.type == "cuda" and len(stages) == 1 and flags is not None and flags.moe \
                and flags.attention:
            from stage_worker.cuda_graphs import DecodeGraphs, graph_sizes

            self.graphs = DecodeGraphs(stages[0], self.caches[0], max_blocks_per_seq=max_blocks,
                                       scratch_slot=max_seqs, scratch_block=num_blocks,
                                       sizes=graph_sizes(max_seqs))

    def add(self, seq_id: int) -> None:
        self.seqs[seq_id] = _Seq(slot=self.blocks.allocate_slot())

    def release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self.blocks.release(list(seq.blocks))
        self.blocks.release_slot(seq.slot)

    @torch.no_grad()
    def fill_context(self, seq_id: int, length: int, generator: torch.Generator) -> None:
        """Give a sequence `length` tokens of context without running them: its blocks are allocated and every
        attention layer's rows filled with random values (K/V and raw indexer keys copied from one random block, so
        a long context fills at copy speed on either tier; every pooled key drawn, so QSA's selection ranks real
        scores). Recurrent and PLE states stay as they are. For decode benchmarks at long context
        (`bench/decode.py --fill random`), where running a 262k-token prefill first would take minutes."""
        seq = self.seqs[seq_id]
        if seq.length:
            raise ValueError(f"sequence {seq_id} already has {seq.length} tokens")
        seq.blocks.extend(self.blocks.allocate(-(-length // self.block_size)))
        blocks = torch.from_numpy(seq.blocks.view().astype("int64"))
        for cache in self.caches:
            for att in cache.attention.values():
                for t in (att.k, att.v, att.index_keys):
                    if t is None:
                        continue
                    paged = t.view(-1, self.block_size, *t.shape[1:])
                    pattern = torch.randn(paged.shape[1:], generator=generator).to(t.dtype) * 0.5
                    paged[blocks.to(t.device)] = pattern.to(t.device)
                if att.pooled_keys is not None:
                    per_block = self.block_size // (att.k.shape[0] // att.pooled_keys.shape[0])
                    rows = (blocks[:, None] * per_block + torch.arange(per_block)).reshape(-1)
                    values = torch.randn((rows.numel(), att.pooled_keys.shape[1]), generator=generator)
                    att.pooled_keys[rows.to(att.pooled_keys.device)] = values.to(att.pooled_keys)
        seq.length = length

    @torch.no_grad()
    def step(self, feeds: list[tuple[int, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """feeds: (seq_id, tokens) each. Returns logits of each feed's last token (or of every token)."""
        rows = []
        for seq_id, tokens in feeds:
            seq = self.seqs[seq_id]
            need = -(-(seq.length + len(tokens)) // self.block_size) - len(seq.blocks)
            if need > 0:
                seq.blocks.extend(self.blocks.allocate(need))
            rows.append((tokens, seq.length, seq.slot, seq.blocks))
        batch = StepBatch.build(rows, self.block_size, self.device, all_logits=all_logits)
        batch.sparse_prefill = self.sparse_prefill
        batch.batched_prefill = self.batched_prefill
        if self.graphs is not None and not all_logits and batch.is_decode:
            if not self.graphs.graphs:
                self.graphs.capture()
            if self.graphs.fits(batch):
                # A copy: the graph's output buffer is overwritten by the next replay (`.float()` of float32
                # logits would return that very buffer).
                logits = self.graphs.run(batch).to(torch.float32, copy=True)
                self.replays += 1
                for seq_id, tokens in feeds:
                    self.seqs[seq_id].length += len(tokens)
                return logits
        hidden = None
        for stage, cache in zip(self.stages, self.caches):
            hidden = stage(batch, cache, hidden)
        for seq_id, tokens in feeds:
            self.seqs[seq_id].length += len(tokens)
        return self.stages[-1].logits(hidden, batch).float()
