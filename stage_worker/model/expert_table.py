"""One MoE layer's routed experts as a table of slots: slots [0, hot) in device memory, [hot, E) in host RAM.

Why slots (issue 16; 000 §4.2): the router's gate rows are kept in slot order, so the router selects slots and the
fused kernels read a slot's rows from whichever table holds it; there is no remapping step between routing and the
experts, and one kernel serves every split. `expert_of_slot` says which expert each slot holds (for loading, route
traces and run-time moves, which swap two slots' rows, gate rows, counts and map entries:
`stage_worker/kernels/expert_moves.py`).

The host rows are one pinned allocation per stage (`stage_worker.expert_offload`); the GPU reads a selected host
row over PCIe, nothing is held twice. Routing equal logits goes to the lower slot (not the lower expert id), the
one observable difference from a model without a table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.kernels.moe_ref import HostRows, RouteCounts


# Only decode-sized steps are counted (tokens x top_k at most this, the fused decode path's limit): the reports
# found counting prefill too changed nothing (000 §4.3: 2.20 -> 2.18 reads a token), and a prompt's chunk would
# swamp a conversation's decode counts. So /metrics' host reads are decode's.
COUNT_MAX_TK = 256


@dataclass
class ExpertTable:
    w13: torch.Tensor               # [hot, 2I, H] device
    w2: torch.Tensor                # [hot, H, I] device
    host_w13: torch.Tensor          # [E - hot, 2I, H] host (pinned when a GPU reads it)
    host_w2: torch.Tensor           # [E - hot, H, I] host
    expert_of_slot: torch.Tensor    # int32 [E] on the device: the expert each slot holds now
    counts: torch.Tensor            # fp32 [E] on the device: selections per slot (decayed by the move policy)
    host_reads: torch.Tensor        # int64 [1] on the device: selections of host slots since start
    moves: torch.Tensor             # int64 [1] on the device: slot swaps done
    initial: tuple[int, ...]        # expert of each slot at load time (hot experts, then cold, each ascending)

    @property
    def hot(self) -> int:
        return self.w13.shape[0]

    @property
    def num_experts(self) -> int:
        return len(self.initial)

    def host_rows(self) -> HostRows:
        return HostRows(self.host_w13, self.host_w2, self.hot)

    def route_counts(self, tokens: int, top_k: int) -> RouteCounts | None:
        """Where a step of `tokens` counts its selections; None for prefill-sized steps (see COUNT_MAX_TK)."""
        if tokens * top_k > COUNT_MAX_TK:
            return None
        return RouteCounts(self.counts, self.host_reads, self.hot)

    def full_shape(self, kind: str) -> tuple[int, ...]:
        t = self.w13 if kind == "w13" else self.w2
        return (self.num_experts, *t.shape[1:])

    def slot_rows(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 row, w2 row) of a slot, wherever it lives."""
        if slot < self.hot:
            return self.w13[slot], self.w2[slot]
        return self.host_w13[slot - self.hot], self.host_w2[slot - self.hot]

    def loaded_row(self, kind: str, expert: int) -> torch.Tensor:
        """Where expert `expert`'s w13 or w2 row is at load time (before any move)."""
        slot = self.initial.index(expert)
        return self.slot_rows(slot)[0 if kind == "w13" else 1]

    @torch.no_grad()
    def order_gate(self, gate_weight: torch.Tensor) -> None:
        """Router rows [E(+1), H] from expert order into slot order (rows past E, the shared gate, stay)."""
        E = self.num_experts
        perm = torch.tensor(self.initial, device=gate_weight.device)
        gate_weight[:E].copy_(gate_weight[:E][perm].clone())

    def experts_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot ids (what the router returns) -> expert ids."""
        return self.expert_of_slot[slots.long()].to(slots.dtype)


class ExpertRows:
    """A loader's view of a table as the [E, ...] parameter it replaces: `rows[e, ...]` is expert e's row (for the
    per-expert on-disk tensors), `rows.copy_(full)` scatters a fused [E, ...] tensor into the slots."""

    def __init__(self, table: ExpertTable, kind: str) -> None:
        self.table, self.kind = table, kind
        self.shape = torch.Size(table.full_shape(kind))
        self.dtype = table.w13.dtype

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        row = self.table.loaded_row(self.kind, int(index[0]))
        return row[index[1:]] if len(index) > 1 else row

    @torch.no_grad()
    def copy_(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"{self.kind}: {tuple(full.shape)} for a table of {tuple(self.shape)}")
        for e in range(self.shape[0]):
            self.table.loaded_row(self.kind, e).copy_(full[e])
