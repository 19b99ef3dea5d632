"""Give a stage's MoE layers expert tables with their cold experts in host RAM (issue 16): one exact-size pinned
allocation for all of the stage's host rows, device tables for the rest, counters for moves and /metrics.

Called by the loader on the meta-device model, before anything is allocated on the device: the routed experts'
[E, ...] parameters are replaced by tables (`SparseMoE.use_table`), so neither the device nor the host ever holds
an expert twice (the reports' first offload loaded everything, then copied the cold rows out: 000 §5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.host_memory import HostBuffer, allocate
from stage_worker.kernels.expert_moves_ref import RowSet, swap_rows_ref
from stage_worker.model.expert_table import ExpertTable, ExpertRows


@dataclass
class StageExperts:
    """The stage's tables by layer, and the state every table holds a view of: one tensor each for all layers, so
    a move round is a few launches and /metrics one read-back."""
    tables: dict[int, ExpertTable]
    counts: torch.Tensor          # fp32 [L, E] selections per slot, decayed each move round
    expert_of_slot: torch.Tensor  # int32 [L, E]
    hot: torch.Tensor             # int64 [L] device slots per layer
    host_reads: torch.Tensor      # int64 [L]
    moves: torch.Tensor           # int64 [L]
    host: HostBuffer | None
    _plans: tuple | None = None   # (router data_ptrs, SwapPlans) of the last move round
    _copy: tuple | None = None    # (pinned [2, L] host tensor, event) of the counters' last read-back
    _last: tuple[list[int], list[int]] | None = None   # host reads and moves per layer, as last read back

    @property
    def layers(self) -> list[int]:
        return list(self.tables)

    def host_bytes(self) -> int:
        return sum(t.host_w13.nbytes + t.host_w2.nbytes for t in self.tables.values())

    def device_bytes(self) -> int:
        return sum(t.w13.nbytes + t.w2.nbytes for t in self.tables.values())

    def snapshot(self) -> None:
        """Queue a copy of the host-read and move counters to the host, and keep the previous copy's values once it
        has landed; called from the runner's thread between steps (nothing waits, nothing runs during a capture)."""
        if self.counts.device.type != "cuda":
            self._last = (self.host_reads.tolist(), self.moves.tolist())
            return
        if self._copy is None:
            self._copy = (torch.empty(2, len(self.tables), dtype=torch.int64, pin_memory=True), None)
        buf, event = self._copy
        if event is not None:
            if not event.query():
                return                                   # the previous copy is still on its way
            self._last = (buf[0].tolist(), buf[1].tolist())
        buf[0].copy_(self.host_reads, non_blocking=True)
        buf[1].copy_(self.moves, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copy = (buf, event)

    def stats(self) -> dict[str, float]:
        """For the heartbeat (/metrics): bytes by tier, and per layer the host reads and moves last read back."""
        out = {"expert_bytes_vram": float(self.device_bytes()), "expert_bytes_host": float(self.host_bytes())}
        if self._last is not None:
            for layer, reads, moves in zip(self.tables, *self._last):
                out[f"expert_host_reads:{layer}"] = float(reads)
                out[f"expert_moves:{layer}"] = float(moves)
        return out

    def row_sets(self, gates: list[torch.Tensor]) -> list[RowSet]:
        ts = list(self.tables.values())
        hot = [t.hot for t in ts]
        return [RowSet([t.w13 for t in ts], [t.host_w13 for t in ts], hot),
                RowSet([t.w2 for t in ts], [t.host_w2 for t in ts], hot),
                RowSet(gates, gates, [t.num_experts for t in ts])]

    @torch.no_grad()
    def move_round(self, gates: list[torch.Tensor], decay: float, margin: float) -> torch.Tensor:
        """Decay the counts and swap, per layer, the most used host slot with the least used device slot if it
        beats it by `margin` (rows, router rows, counts, slot map); `gates` are the layers' router weights [E, H]
        (slot order). Queued on the current stream; nothing waits. Returns the decisions [L, 3]."""
        from stage_worker.kernels.expert_moves import SwapPlan, decide, swap_rows, swap_usable   # Triton: lazily

        dec = decide(self.counts, self.hot, decay, margin)
        if swap_usable(self.counts):
            ptrs = tuple(g.data_ptr() for g in gates)
            if self._plans is None or self._plans[0] != ptrs:      # built once: rows never move in memory
                self._plans = (ptrs, [SwapPlan.build(r, self.counts.device) for r in self.row_sets(gates)])
            for plan in self._plans[1]:
                swap_rows(plan, dec)
        else:
            for r in self.row_sets(gates):
                swap_rows_ref(r, dec)
        pair, go = dec[:, :2], dec[:, 2:].bool()
        for t in (self.counts, self.expert_of_slot):
            vals = t.gather(1, pair)
            t.scatter_(1, pair, torch.where(go, vals.flip(1), vals))
        self.moves.add_(dec[:, 2])
        return dec


def attach_tables(model, cold: dict[int, list[int]], device: torch.device | str,
                  dtype: torch.dtype) -> StageExperts | None:
    """Tables for this stage's layers that have cold experts; None when none of them has."""
    layers = model.moe_layers()
    mine = {layer: ids for layer, ids in sorted(cold.items()) if layer in layers and ids}
    if not mine:
        return None
    device = torch.device(device)
    first = next(iter(layers.values()))
    E, two_i, H = first.w13.shape
    inter = two_i // 2
    item = torch.empty((), dtype=dtype).element_size()
    row13, row2 = two_i * H * item, H * inter * item
    host_bytes = sum(len(ids) for ids in mine.values()) * (row13 + row2)
    host = allocate(host_bytes, what=f"cold experts of layers {min(mine)}-{max(mine)}",
                    pin=device.type == "cuda")
    n = len(mine)
    counts = torch.zeros(n, E, dtype=torch.float32, device=device)
    reads = torch.zeros(n, dtype=torch.int64, device=device)
    moves = torch.zeros(n, dtype=torch.int64, device=device)
    orders = [tuple([e for e in range(E) if e not in set(ids)] + sorted(ids)) for ids in mine.values()]
    expert_of_slot = torch.tensor(orders, dtype=torch.int32, device=device)
    tables: dict[int, ExpertTable] = {}
    offset = 0
    for i, (layer, ids) in enumerate(mine.items()):
        moe = layers[layer]
        order = orders[i]
        hot, c = E - len(ids), len(ids)
        host_w13 = host.tensor[offset:offset + c * row13].view(dtype).view(c, two_i, H)
        offset += c * row13
        host_w2 = host.tensor[offset:offset + c * row2].view(dtype).view(c, H, inter)
        offset += c * row2
        table = ExpertTable(
            w13=torch.empty(hot, two_i, H, dtype=dtype, device=device),
            w2=torch.empty(hot, H, inter, dtype=dtype, device=device),
            host_w13=host_w13, host_w2=host_w2,
            expert_of_slot=expert_of_slot[i], counts=counts[i], host_reads=reads[i:i + 1], moves=moves[i:i + 1],
            initial=order)
        moe.use_table(table)
        tables[layer] = table
    hot = torch.tensor([E - len(ids) for ids in mine.values()], dtype=torch.int64, device=device)
    return StageExperts(tables=tables, counts=counts, expert_of_slot=expert_of_slot, hot=hot, host_reads=reads,
                        moves=moves, host=host)


def gates(model) -> list[torch.Tensor]:
    """The router weights of the layers with tables, in `StageExperts.tables` order."""
    layers = model.moe_layers()
    return [layers[layer].gate.weight for layer in model.experts.tables]


def loader_targets(model) -> dict[str, ExpertRows]:
    """`layers.N.mlp.w13` / `.w2` -> the table standing in for that parameter, for layers that have one."""
    out = {}
    for layer, moe in model.moe_layers().items():
        if moe.table is not None:
            out[f"layers.{layer}.mlp.w13"] = ExpertRows(moe.table, "w13")
            out[f"layers.{layer}.mlp.w2"] = ExpertRows(moe.table, "w2")
    return out


@torch.no_grad()
def order_gates(model) -> None:
    """After loading: every table's router rows into slot order (the fused router, once built, is a view of them
    too, so this runs before `prepare_kernels`)."""
    for moe in model.moe_layers().values():
        if moe.table is not None:
            moe.table.order_gate(moe.gate.weight)
