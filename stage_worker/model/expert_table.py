"""One MoE layer's routed experts as a table of slots: slots [0, hot) in device memory, [hot, E) in host RAM.

Why slots (issue 16; 000 §4.2): the router's gate rows are kept in slot order, so the router selects slots and the
fused kernels read a slot's rows from whichever table holds it; there is no remapping step between routing and the
experts, and one kernel serves every split. `expert_of_slot` says which expert each slot holds (for loading, route
traces and run-time moves, which swap two slots' rows, gate rows, counts and map entries:
`stage_worker/kernels/expert_moves.py`). A table may instead carry a `slot_map` (router index -> slot), which the
router kernel applies to each selection before the experts and the counters see it: rows can then change slots
without their gate rows (moves on read, `expert_move_async`: docs/architecture.md section 6).

A slot's rows are one row of each of the table's parts: `w13` [2I, H] and `w2` [H, I] in the compute dtype, or,
for an INT4 checkpoint's experts kept packed (issue 17, `SparseMoE.use_packed`), `q13` int32 [2I, H/8], `s13`
[2I, ceil(H/g)], `q2` int32 [H, I/8], `s2` [H, ceil(I/g2)] (`stage_worker/kernels/moe_int4_ref.py`): the host
tier then holds a quarter of the bf16 bytes and a host read moves a quarter of them over PCIe. A block-FP8
checkpoint's experts kept float8 (`SparseMoE.use_fp8`, `fp8_block`) are the third kind: the same four part names,
`q13` uint8 [2I, H] and `q2` uint8 [H, I] (the float8_e4m3fn bytes), `s13` float32 [2, ceil(I/br), ceil(H/bc)] and
`s2` float32 [ceil(H/br), ceil(I/bc)] (`kernels.moe_ref.Fp8Experts`): half the bf16 bytes in either tier.

The host rows are one pinned allocation per stage (`stage_worker.expert_offload`); the GPU reads a selected host
row over PCIe, nothing is held twice. Routing equal logits goes to the lower slot (not the lower expert id), the
one observable difference from a model without a table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stage_worker.kernels.moe_ref import HostRows, RouteCounts


# Only decode-sized steps are counted (tokens x top_k at most this, the fused decode path's limit): the reports
# found counting prefill too changed nothing (000 §4.3: 2.20 -> 2.18 reads a token), and a prompt's chunk would
# swamp a conversation's decode counts. So /metrics' host reads are decode's.
COUNT_MAX_TK = 256


def counted_tokens(tokens: int, top_k: int) -> int:
    """The tokens of a step of `tokens` the router counts (`route_counts`): all of a decode-sized step, none of a
    prefill-sized one. What a half-life counted in tokens decays by (`expert_move_half_life_unit`)."""
    return tokens if tokens * top_k <= COUNT_MAX_TK else 0

PARTS = ("w13", "w2")                          # a table of experts in the compute dtype
PACKED_PARTS = ("q13", "s13", "q2", "s2")      # INT4 experts: words and group scales of w13, then of w2
FP8_PARTS = PACKED_PARTS                       # float8 experts: bytes and block scales (SparseMoE's buffer names)


@dataclass
class ExpertTable:
    dev: dict[str, torch.Tensor]    # part -> [hot, ...] device rows (PARTS; PACKED_PARTS with `groups` or
    #                                 FP8_PARTS with `fp8_block`)
    host: dict[str, torch.Tensor]   # part -> [E - hot, ...] host rows (pinned when a GPU reads them)
    expert_of_slot: torch.Tensor    # int32 [E] on the device: the expert each slot holds now
    counts: torch.Tensor            # fp32 [E] on the device: selections per slot (decayed by the move policy)
    host_reads: torch.Tensor        # int64 [1] on the device: selections of host slots since start
    moves: torch.Tensor             # int64 [1] on the device: slot swaps done
    initial: tuple[int, ...]        # expert of each slot at load time (hot experts, then cold, each ascending;
    #                                 -1: a spare slot, with `expert_move_async`)
    groups: tuple[int, int] | None = None   # INT4 experts: inputs per scale of w13 / of w2
    fp4: bool = False                          # with `groups`: E2M1 codes and float32 scales (NVFP4 / MXFP4)
    fp8_block: tuple[int, int] | None = None   # float8 experts: (rows, columns) of a scale block
    # int32 [E] on the device: router index -> the slot that holds its expert, applied by the router (`route`'s
    # slot_map). None: the identity, router index == slot, which moves that swap rows and gate rows keep true.
    slot_map: torch.Tensor | None = None
    # `expert_move_async` (moves on read): int32 [C] the host slots a step claimed (-1: none; C claims a step,
    # `expert_move_claims`), fp32 [1] the count a selected host slot must pass to be claimed, int64 [C] the free
    # device slot each claim's rows are stored into (-1: none)
    claim: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    spare: torch.Tensor | None = None
    # `expert_prefetch`: the last P device slots receive host rows the previous MoE layer predicted for this step
    # (`kernels/expert_prefetch_ref.Prefetch`)
    prefetch: object | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.dev)

    @property
    def packed(self) -> bool:
        """INT4 slots (words and group scales)."""
        return self.groups is not None

    @property
    def fp8(self) -> bool:
        """Float8 slots (bytes and block scales)."""
        return self.fp8_block is not None

    @property
    def hot(self) -> int:
        return next(iter(self.dev.values())).shape[0]

    @property
    def num_experts(self) -> int:
        """The layer's experts (router rows); `num_slots` counts the spares too."""
        return sum(e >= 0 for e in self.initial)

    @property
    def num_slots(self) -> int:
        return len(self.initial)

    def slot_of_expert(self) -> list[int]:
        """Expert id -> the slot holding it now (one read-back: the CPU and prefill loops)."""
        out = [0] * self.num_experts
        for slot, e in enumerate(self.expert_of_slot.tolist()):
            if e >= 0:
                out[e] = slot
        return out

    # the compute-dtype table's parts by name (what the bf16 kernels and older callers take)
    @property
    def w13(self) -> torch.Tensor:
        return self.dev["w13"]

    @property
    def w2(self) -> torch.Tensor:
        return self.dev["w2"]

    @property
    def device(self) -> torch.device:
        return self.expert_of_slot.device

    def device_bytes(self) -> int:
        return sum(t.nbytes for t in self.dev.values())

    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.host.values())

    def host_rows(self) -> HostRows:
        return HostRows(self.host["w13"], self.host["w2"], self.hot)

    def packed_experts(self):
        """(device slots, host slots) as the INT4 kernels take them (`moe_int4.fused_moe_int4(..., host,
        first_host=hot)`)."""
        from stage_worker.kernels.moe_int4_ref import PackedExperts

        g13, g2 = self.groups
        return (PackedExperts(*(self.dev[p] for p in PACKED_PARTS), g13, g2, self.fp4),
                PackedExperts(*(self.host[p] for p in PACKED_PARTS), g13, g2, self.fp4))

    def fp8_experts(self):
        """(device slots, host slots) as the FP8 kernels take them (`moe.fused_moe_fp8(..., host, first_host=hot)`)."""
        from stage_worker.kernels.moe_ref import Fp8Experts

        return (Fp8Experts(*(self.dev[p] for p in FP8_PARTS), self.fp8_block),
                Fp8Experts(*(self.host[p] for p in FP8_PARTS), self.fp8_block))

    def moe_fp8(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Float8 experts, the CPU path and a GPU's prefill (`moe.grouped_moe_fp8` over both tiers): each present
        slot's bytes and scales read once (a host slot's copied to x's device once a call), dequantized to x.dtype,
        two GEMMs over its tokens, experts in id order as without a table. ids [T, k] are slots (negative: none)."""
        from stage_worker.kernels.moe import grouped_moe_fp8

        dev, host = self.fp8_experts()
        return grouped_moe_fp8(x, ids, weights, dev, host, self.hot, self.expert_of_slot)

    def route_counts(self, tokens: int, top_k: int) -> RouteCounts | None:
        """Where a step of `tokens` counts its selections; None for prefill-sized steps (see COUNT_MAX_TK)."""
        pf = self.prefetch
        if pf is not None:
            # this forward's prediction for this layer, used once (`Prefetch.armed`), and consumed by every call: a
            # later forward that did not predict must not read what an earlier one copied
            armed, pf.armed = pf.armed, False
            pf = pf if armed else None
        if tokens * top_k > COUNT_MAX_TK:
            return None
        return RouteCounts(self.counts, self.host_reads, self.hot, self.claim, self.threshold, self.spare, pf)

    def claimed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(claim, spare) for the decode kernels that store a claimed host slot's rows as they read them."""
        return None if self.claim is None else (self.claim, self.spare)

    @torch.no_grad()
    def copy_claimed(self, ids: torch.Tensor) -> None:
        """The store of moves on read where no decode kernel runs (the CPU paths): the claimed host slot's rows, if
        ids [T, k] (slots) select it, into the free spare device slot (`kernels.moe.copy_claimed`, one read-back)."""
        if self.claim is not None:
            from stage_worker.kernels.moe import copy_claimed

            copy_claimed((self.claim, self.spare), ids, self.hot, [(self.dev[k], self.host[k]) for k in self.parts])

    def full_shape(self, kind: str) -> tuple[int, ...]:
        return (self.num_experts, *self.dev[kind].shape[1:])

    def slot_part(self, slot: int, kind: str) -> torch.Tensor:
        """Part `kind`'s row of a slot, wherever it lives."""
        return self.dev[kind][slot] if slot < self.hot else self.host[kind][slot - self.hot]

    def slot_rows(self, slot: int) -> tuple[torch.Tensor, ...]:
        """The slot's row of every part, in `parts` order ((w13, w2) or (q13, s13, q2, s2), INT4 or float8)."""
        return tuple(self.slot_part(slot, kind) for kind in self.parts)

    def loaded_row(self, kind: str, expert: int) -> torch.Tensor:
        """Where expert `expert`'s row of part `kind` is at load time (before any move)."""
        return self.slot_part(self.initial.index(expert), kind)

    @torch.no_grad()
    def order_gate(self, gate_weight: torch.Tensor) -> None:
        """Router rows [E(+1), H] from expert order into slot order (rows past E, the shared gate, stay); with a slot
        map (spare slots) they stay in expert order: router index == expert id, `slot_map[e]` its slot."""
        if self.slot_map is not None:
            return
        E = self.num_experts
        perm = torch.tensor(self.initial, device=gate_weight.device)     # no spare slots without a slot map
        gate_weight[:E].copy_(gate_weight[:E][perm].clone())

    def slots_of(self, router_ids: torch.Tensor) -> torch.Tensor:
        """Router indices (a PyTorch route's ids) -> slots, through `slot_map`."""
        return router_ids if self.slot_map is None else self.slot_map[router_ids.long()].to(router_ids.dtype)

    def experts_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot ids (what the router returns) -> expert ids."""
        return self.expert_of_slot[slots.long()].to(slots.dtype)

    def moe_int4(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """INT4 experts, the CPU path and the GPU's prefill with kernel flag `moe_int4_prefill` off (on: the grouped
        GEMMs of `kernels/moe_int4_prefill.py`; = `moe_int4.grouped_moe_int4` on the whole table): each present
        expert's words and scales read once (a host slot's copied to x's device once per call), dequantized to
        x.dtype, two GEMMs over its tokens. Experts in id order, as without a table, so the sums are the same.
        One host sync (the present experts). ids [T, k] are slots (negative: none)."""
        from stage_worker.kernels.moe_int4_ref import dequantize_packed

        g13, g2 = self.groups
        out = torch.zeros_like(x)
        flat = ids.long()
        present = flat >= 0
        by_expert = torch.where(present, self.expert_of_slot.to(x.device)[flat.clamp_min(0)], -1)
        slot_of = self.slot_of_expert()
        for e in torch.unique(by_expert[present]).tolist():
            tok, j = torch.where(by_expert == e)
            q13, s13, q2, s2 = (r.to(x.device, non_blocking=True) for r in self.slot_rows(slot_of[e]))
            w13 = dequantize_packed(q13, s13, g13, self.fp4, x.dtype)
            w2 = dequantize_packed(q2, s2, g2, self.fp4, x.dtype)
            g, u = F.linear(x[tok], w13).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, w2) * weights[tok, j, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out


class ExpertRows:
    """A loader's view of a table's part as the [E, ...] parameter or buffer it replaces: `rows[e, ...]` is expert
    e's row (for the per-expert on-disk tensors), `rows.copy_(full)` scatters a fused [E, ...] tensor into the
    slots."""

    def __init__(self, table: ExpertTable, kind: str) -> None:
        self.table, self.kind = table, kind
        self.shape = torch.Size(table.full_shape(kind))
        self.dtype = table.dev[kind].dtype

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
