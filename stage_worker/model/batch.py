"""Per-step metadata for a flat, unpadded batch of sequences.

Each sequence contributes a contiguous run of tokens: a prefill chunk or one decode token. Layers read only this
object and the caches; they never see requests, schedulers or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stage_worker.host_copy import to_device


@dataclass
class StepBatch:
    token_ids: torch.Tensor          # [T] int64, the tokens being fed (every stage gets them: PLE needs them)
    positions: torch.Tensor          # [T] int64, absolute position of each token in its sequence
    seq_lens: list[int]              # tokens each sequence feeds this step
    context_lens: list[int]          # tokens each sequence already has in the caches before this step
    slots: list[int]                 # per-sequence state slot (Gated DeltaNet, PLE conv and n-gram context)
    block_tables: list[list[int]]    # per-sequence KV block ids, covering context_len + seq_len tokens
    block_size: int
    slot_mapping: torch.Tensor = field(init=False)   # [T] flat KV row of each token
    # Rows already gathered by the PLE service, keyed by global layer index: [T, heads, head_dim].
    ple_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # Which token rows the last stage turns into logits: default the last token of each sequence.
    logits_indices: torch.Tensor | None = None
    # Same-length new sequences may run as one [B, L] batch (`fresh_equal`); off: the per-sequence loop (A/B,
    # cluster key `batched_prefill`).
    batched_prefill: bool = True
    # QSA prefill reads only each query's selected keys once the context is long (GatedAttention._attend_selected);
    # off: the dense masked scores over the whole context (A/B, cluster key `qsa_sparse_prefill`).
    sparse_prefill: bool = True

    def __post_init__(self) -> None:
        rows = []
        for table, ctx, n in zip(self.block_tables, self.context_lens, self.seq_lens):
            for p in range(ctx, ctx + n):
                rows.append(table[p // self.block_size] * self.block_size + p % self.block_size)
        self.slot_mapping = to_device(rows, torch.long, self.token_ids.device)
        if self.logits_indices is None:
            ends = torch.tensor(self.seq_lens, dtype=torch.long).cumsum(0) - 1
            self.logits_indices = to_device(ends, torch.long, self.token_ids.device)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each with context in the caches: the fast decode kernels apply."""
        return all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.context_lens)

    @property
    def fresh_equal(self) -> bool:
        """Several new sequences of one length (training windows, same-length prompts): layers may treat the step
        as a [B, L] batch, one batched call instead of a loop over sequences (what makes training launch-bound)."""
        n = self.seq_lens[0] if self.seq_lens else 0
        return (self.batched_prefill and len(self.seq_lens) > 1 and n > 1
                and all(c == 0 for c in self.context_lens) and all(s == n for s in self.seq_lens))

    def device_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [B, max_blocks] int32 (padded with 0) and lengths after this step [B] int32, on the device."""
        if getattr(self, "_tables", None) is None:
            width = max(len(t) for t in self.block_tables)
            dev = self.token_ids.device
            bt = to_device([t + [0] * (width - len(t)) for t in self.block_tables], torch.int32, dev)
            lens = to_device([c + n for c, n in zip(self.context_lens, self.seq_lens)], torch.int32, dev)
            self._tables = (bt, lens)
        return self._tables

    def device_slots(self) -> torch.Tensor:
        """Per-sequence state slots [B] int64 on the device (built once per step; static under CUDA graphs)."""
        if getattr(self, "_slots", None) is None:
            self._slots = to_device(self.slots, torch.long, self.token_ids.device)
        return self._slots

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    def context_rows(self, i: int, length: int) -> torch.Tensor:
        """Flat KV rows of the first `length` tokens of sequence i."""
        bs = self.block_size
        pos = torch.arange(length)
        table = torch.tensor(self.block_tables[i], dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.token_ids.device)

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int, list[int]]], block_size: int,
              device: torch.device | str = "cpu", all_logits: bool = False) -> "StepBatch":
        """seqs: (tokens fed this step, context_len, slot, block_table) per sequence."""
        ids, pos = [], []
        for tokens, ctx, _, _ in seqs:
            ids.extend(tokens)
            pos.extend(range(ctx, ctx + len(tokens)))
        n = len(ids)
        return cls(
            token_ids=to_device(ids, torch.long, device),
            positions=to_device(pos, torch.long, device),
            seq_lens=[len(s[0]) for s in seqs], context_lens=[s[1] for s in seqs],
            slots=[s[2] for s in seqs], block_tables=[list(s[3]) for s in seqs], block_size=block_size,
            logits_indices=torch.arange(n, device=device) if all_logits else None,
        )
