"""Per-step metadata for a flat, unpadded batch of sequences.

Each sequence contributes a contiguous run of tokens: a prefill chunk or one decode token. Layers read only this
object and the caches; they never see requests, schedulers or sockets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from stage_worker.host_copy import to_device
from stage_worker.model.ragged import Ragged


class BlockTable:
    """One sequence's KV block ids, grown in place and read as an int32 array without a copy. A 262k-token sequence
    has 16,384 blocks; rebuilding each decode step's tables from Python lists cost ~0.4 ms a sequence of host time
    with the GPU idle (H200, full shape: 5.45 against 3.62 ms a step at 262k against 4k context, batch 1). A view
    taken before a later `extend` keeps the ids it saw (appends land past its end; growing copies to a new buffer),
    so a step built ahead of the next plan's blocks is unaffected."""

    __slots__ = ("_buf", "_n")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._buf = np.empty(16, dtype=np.int32)
        self._n = 0
        self.extend(ids)

    def extend(self, ids: Iterable[int]) -> None:
        new = np.asarray(ids if isinstance(ids, (np.ndarray, Sequence)) else list(ids), dtype=np.int32).reshape(-1)
        end = self._n + new.size
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n:end] = new
        self._n = end

    def view(self) -> np.ndarray:
        return self._buf[: self._n]

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(self.view().tolist())

    def __getitem__(self, i):
        return self.view()[i]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"BlockTable({self.view().tolist()})"


def _ids(table: BlockTable | Sequence[int]) -> np.ndarray:
    """A block table as an int32 array: a BlockTable's view (no copy), anything else converted."""
    return table.view() if isinstance(table, BlockTable) else np.asarray(table, dtype=np.int32).reshape(-1)


class _OnDevice:
    """A StepBatch tensor copied to the device on first use from the host array `host(batch)` gives (int64): a decode
    step replayed from a CUDA graph with `staged_inputs` never uses it, so it pays no pinned allocation and queued
    copy for it. Assigning a tensor sets it (a graph's static buffer), None drops it (made again when next used)."""

    def __init__(self, host) -> None:
        self.host = host

    def __set_name__(self, owner, name: str) -> None:
        self.key = "_" + name

    def __get__(self, batch, owner=None):
        if batch is None:
            return self
        value = batch.__dict__.get(self.key)
        if value is None:
            value = batch.__dict__[self.key] = to_device(torch.from_numpy(self.host(batch)), torch.long,
                                                         batch._device)
        return value

    def __set__(self, batch, value: torch.Tensor | None) -> None:
        batch.__dict__[self.key] = value


@dataclass
class StepBatch:
    """`positions`, `slot_mapping` and `logits_indices` are device tensors made on first use from host arrays
    (`_OnDevice`): a decode step replayed from a CUDA graph with `staged_inputs` reads the packed copy instead
    (graph_inputs.py)."""
    token_ids: torch.Tensor          # [T] int64, the tokens being fed (every stage gets them: PLE needs them)
    host_positions: np.ndarray       # [T] int64, absolute position of each token in its sequence (`positions`)
    seq_lens: list[int]              # tokens each sequence feeds this step
    context_lens: list[int]          # tokens each sequence already has in the caches before this step
    slots: list[int]                 # per-sequence state slot (Gated DeltaNet, PLE conv and n-gram context)
    block_tables: list[np.ndarray]   # per-sequence KV block ids (int32), covering context_len + seq_len tokens
    block_size: int
    # Rows already gathered by the PLE service, keyed by global layer index: [T, heads, head_dim].
    ple_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # A prefill step's sequences run as one padded [B, Lmax] batch in each layer (`ragged`); off: the per-sequence
    # loop (A/B, cluster key `batched_prefill`).
    batched_prefill: bool = True
    # QSA prefill reads only each query's selected keys once the context is long (GatedAttention._attend_selected);
    # off: the dense masked scores over the whole context (A/B, cluster key `qsa_sparse_prefill`).
    sparse_prefill: bool = True

    def __post_init__(self) -> None:
        self.block_tables = [_ids(t) for t in self.block_tables]
        self._logits_rows = None
        self._device = self.token_ids.device     # the lazy tensors' (token_ids may later be a host copy)

    def _kv_rows(self) -> np.ndarray:
        """Each token's flat KV row: its block's id * block_size + its offset there."""
        parts = []
        for table, ctx, n in zip(self.block_tables, self.context_lens, self.seq_lens):
            pos = np.arange(ctx, ctx + n, dtype=np.int64)
            parts.append(table[pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _last_rows(self) -> np.ndarray:
        """The rows `select_logits` chose, else each sequence's last token."""
        if self._logits_rows is not None:
            return self._logits_rows
        return np.cumsum(np.asarray(self.seq_lens, dtype=np.int64)) - 1

    # [T] int64 on the device, made on first use; each may be set to a tensor (a graph's static buffers)
    positions = _OnDevice(lambda b: b.host_positions)            # absolute position of each token in its sequence
    slot_mapping = _OnDevice(_kv_rows)                           # each token's flat KV row
    logits_indices = _OnDevice(_last_rows)                       # the token rows the last stage turns into logits

    def select_logits(self, rows: Sequence[int]) -> None:
        """The token rows the last stage turns into logits (prompt logprobs: every row of an entry), copied to the
        device when first used: a graphed step reads its graph's own rows."""
        self._logits_rows = np.asarray(rows, dtype=np.int64)
        self.logits_indices = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each with context in the caches: the fast decode kernels apply."""
        return all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.context_lens)

    def ragged(self) -> Ragged:
        """The step's padding indices (`stage_worker/model/ragged.py`), built once per step and shared by layers."""
        if getattr(self, "_ragged", None) is None:
            self._ragged = Ragged(self.seq_lens, self.token_ids.device, self.context_lens)
        return self._ragged

    def device_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [B, max_blocks] int32 (padded with 0) and lengths after this step [B] int32, on the device."""
        if getattr(self, "_tables", None) is None:
            width = max(len(t) for t in self.block_tables)
            dev = self.token_ids.device
            padded = np.zeros((len(self.block_tables), width), dtype=np.int32)
            for row, t in zip(padded, self.block_tables):
                row[: len(t)] = t
            bt = to_device(torch.from_numpy(padded), torch.int32, dev)
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
        """Flat KV rows of the first `length` tokens of sequence i, computed on the step's device from the block
        table (one queued copy of it) and kept for the step: every attention layer of a stage asks for the same
        rows. Before, each layer built them on the host and copied them with a synchronous `.to(device)`, so a GPU
        prefill chunk waited for the GPU five times (the QSA layers) and built 262k-entry index arrays on the host."""
        cache = self.__dict__.setdefault("_context_rows", {})
        if (i, length) not in cache:
            bs = self.block_size
            dev = self.token_ids.device
            table = to_device(torch.from_numpy(self.block_tables[i][: -(-length // bs)].astype(np.int64)),
                              torch.long, dev)
            pos = torch.arange(length, device=dev)
            cache[(i, length)] = table[pos // bs] * bs + pos % bs
        return cache[(i, length)]

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int, list[int]]], block_size: int,
              device: torch.device | str = "cpu", all_logits: bool = False) -> "StepBatch":
        """seqs: (tokens fed this step, context_len, slot, block_table) per sequence; a `BlockTable` is read without
        a copy, a list is converted."""
        ids, pos = [], []
        for tokens, ctx, _, _ in seqs:
            ids.extend(tokens)
            pos.extend(range(ctx, ctx + len(tokens)))
        batch = cls(
            token_ids=to_device(ids, torch.long, device), host_positions=np.asarray(pos, dtype=np.int64),
            seq_lens=[len(s[0]) for s in seqs], context_lens=[s[1] for s in seqs],
            slots=[s[2] for s in seqs], block_tables=[_ids(s[3]) for s in seqs], block_size=block_size,
        )
        if all_logits:
            batch.logits_indices = torch.arange(len(ids), device=device)
        return batch
