"""Run-time expert moves (issue 16; 000 §4.3-4.4): per MoE layer, swap the most used host slot with the least used
device slot, for every layer of a stage in a few launches on the forward's stream, with no host read-back.

`decide` (PyTorch ops on the device, all layers at once): decay the selection counts the router kernel keeps, pick
per layer the device slot with the lowest count and the host slot with the highest, and move only when the host
slot's count beats the device slot's by `margin` (hysteresis: two experts of equal use do not trade places every
round). `swap_rows` (Triton): each layer's two rows of w13, w2 and the router exchange places (INT4 experts kept
packed, issue 17: the words and the scales of w13 and of w2, four kinds of row, at their packed size); a layer that
does not move returns at once. The rows live in separate tensors (device tables, one pinned host allocation, each
layer's router), so every row is addressed as an element offset from one anchor tensor: one launch per kind of
row reaches all layers, on the device and in host memory alike (UVA). Then the counts, the slot -> expert map and
the move counters are swapped with gathers and scatters on the device.

With `expert_move_fused` (MOEPIPE_EXPERT_MOVE_FUSED=1) `decide_settle` does `decide` and that bookkeeping in one
launch (one program per layer: decay, pick, counts / slot-map / move-counter swap, `dec` written for the swap
launches), and a kind of row that covers only some layers reads its layers' decisions through an index instead of an
`index_select`: a round is one launch plus one per kind of row instead of ~30 eager launches, each a few us of host
time between steps. The bookkeeping may run before the rows move because the swap kernels read only `dec` and the
rows. Bit for bit the same counts, slot map, move counters, decisions and rows (tests/test_expert_moves_fused.py).

With `expert_move_async` (moves on read; two spare device slots per layer, the router through a slot map) no row is
copied on the forward's stream for its own sake: the router kernel claims a host slot it selects whose count passes
the layer's threshold (`moe.route`, `RouteCounts.claim`), and the decode kernels that read that slot over PCIe in
that step anyway store the rows they load into the free spare (VRAM writes only). `claim_round`
(`_claim_round_kernel`, one program a layer) then commits the claim through the slot map, picks the least-used
device slot as the victim and records it as pending; `write_back` (`_write_back_kernel`, one launch per kind of
row, on a side stream) copies the victim's row into the host slot the claimed expert left while the other spare
takes the next claim, and the next round makes the victim's slot a spare again. Reference: `claim_round_ref`,
`write_back_ref`.

C claims a layer a step (`expert_move_claims`, issue 16 at batch >= 4; C = 1 is the layout above, bit for bit): a
table gets 2C spares (C being written back, C receiving); `ExpertTable.claim` is int32 [C] and `spare` the first C
entries of the layer's free list. The route kernel (`moe._route_kernel`, NC > 1; reference `moe_ref.claims_ref`)
tries each of a token's selected host slots past the threshold, best first, against entries 0..C-1 whose spare is a
slot, one compare-and-swap each, stopping where it takes the entry or finds the slot already there: entries are never
cleared within a step, so a step claims at most C distinct host slots (first come first, as
`bench/expert_cache_sim._replay_claims`; on a GPU the tokens race for the order, as at C = 1). The decode kernels
(`moe.claim_spare`) compare each selected slot with the C claims and store its rows into the matching entry's spare
(the INT4 down kernel per column). The round (state [L, 4C]: free slots [2C] kept compact, victims [C], their host
slots [C]) routes every pending victim to its host slot and frees its slot into the first free entry, decays,
commits claim j into free slot j while a victim is left for it (no more claims than live device slots), picks as
many distinct least-used other live device slots as victims (C masked min-reductions, ties: the lowest expert), the
i-th written back into the i-th committed claim's host slot, compacts the free list and sets the threshold while a
slot is free; `write_back` copies every pending victim of a layer. The counts' half-life may be counted in tokens
(`expert_move_half_life_unit`, `expert_offload.round_decay`): the decay is a float baked into a captured round, and
`StageExperts` keeps a captured round per decay (one per batch size).

Reference: `expert_moves_ref.swap_rows_ref` and `settle_ref` (with `decide`, the whole round); tests:
tests/test_expert_table.py, tests/test_expert_moves_fused.py, tests/test_expert_moves_async.py (CPU under
TRITON_INTERPRET=1). Switches: cluster keys `expert_moves` (MOEPIPE_EXPERT_MOVES=0), `expert_move_fused`,
`expert_move_graph`, `expert_move_async`, `expert_move_claims` and `expert_move_half_life_unit`
(MOEPIPE_EXPERT_MOVE_FUSED / _GRAPH / _ASYNC / _CLAIMS / _HALF_LIFE_UNIT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stage_worker.kernels.common import INTERPRET, fix_interpreter_loop_bounds
from stage_worker.kernels.expert_moves_ref import RowSet
from stage_worker.kernels.moe import triton

if INTERPRET:
    fix_interpreter_loop_bounds()      # the write-back kernel's loop starts at a program id

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _slot_offset(slot, layer, split_ptr, dev_off_ptr, host_off_ptr, N):
        """Element offset (from the plan's anchor) of the layer's slot: row `slot` at dev_off below the split, else
        row slot - split at host_off."""
        split = tl.load(split_ptr + layer)
        return tl.where(slot < split, tl.load(dev_off_ptr + layer) + slot * N,
                        tl.load(host_off_ptr + layer) + (slot - split) * N)

    @triton.jit
    def _decision_row(layers_ptr, HAS_LAYERS: tl.constexpr):
        """This program's layer (program_id(0)) and the decision row it reads: layers[layer] with HAS_LAYERS (a kind
        of row that covers only some layers), else the layer's own."""
        layer = tl.program_id(0)
        if HAS_LAYERS:
            row = tl.load(layers_ptr + layer)
        else:
            row = layer
        return layer, row

    @triton.jit
    def _swap_kernel(anchor_ptr, dev_off_ptr, host_off_ptr, split_ptr, dec_ptr, layers_ptr, N, BLOCK: tl.constexpr,
                     HAS_LAYERS: tl.constexpr):
        """Layer program_id(0): if its decision says move, swap the BLOCK elements program_id(1) of the rows of
        slots i and j. Slot s < split is row s at dev_off, else row s - split at host_off (element offsets from
        anchor_ptr). HAS_LAYERS: the plan's layer k reads decision row layers[k] (a kind of row that covers only
        some layers), else row k."""
        layer, row = _decision_row(layers_ptr, HAS_LAYERS)
        go = tl.load(dec_ptr + row * 3 + 2)
        if go != 0:
            a = _slot_offset(tl.load(dec_ptr + row * 3), layer, split_ptr, dev_off_ptr, host_off_ptr, N)
            b = _slot_offset(tl.load(dec_ptr + row * 3 + 1), layer, split_ptr, dev_off_ptr, host_off_ptr, N)
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            x = tl.load(anchor_ptr + a + offs, mask=mask)
            y = tl.load(anchor_ptr + b + offs, mask=mask)
            tl.store(anchor_ptr + a + offs, y, mask=mask)
            tl.store(anchor_ptr + b + offs, x, mask=mask)

    @triton.jit
    def _write_back_kernel(anchor_ptr, dev_off_ptr, host_off_ptr, split_ptr, state_ptr, layers_ptr, N,
                           BLOCK: tl.constexpr, HAS_LAYERS: tl.constexpr, NC: tl.constexpr = 1):
        """`expert_move_async`'s write-back: layer program_id(0) copies each pending victim's row (state row of 4 NC:
        free slots [2 NC], victims [NC], their host slots [NC]; a victim >= 0) into its host slot, program_id(1)
        taking every num_programs(1)-th BLOCK of it. Reads a live row and writes a slot nothing routes to: steps
        run beside it. Addressing as `_swap_kernel`."""
        layer, row = _decision_row(layers_ptr, HAS_LAYERS)
        for i in tl.static_range(NC):
            victim = tl.load(state_ptr + row * (4 * NC) + 2 * NC + i)
            if victim >= 0:
                a = _slot_offset(victim, layer, split_ptr, dev_off_ptr, host_off_ptr, N)
                b = _slot_offset(tl.load(state_ptr + row * (4 * NC) + 3 * NC + i), layer, split_ptr, dev_off_ptr,
                                 host_off_ptr, N)
                for start in range(tl.program_id(1) * BLOCK, N, tl.num_programs(1) * BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < N
                    tl.store(anchor_ptr + b + offs, tl.load(anchor_ptr + a + offs, mask=mask), mask=mask)

    @triton.jit
    def _claim_round_kernel(counts_ptr, eos_ptr, slot_map_ptr, hot_ptr, moves_ptr, state_ptr, claim_ptr, thr_ptr,
                            S, E, decay, margin, BLOCK_S: tl.constexpr, NC: tl.constexpr, BLOCK_F: tl.constexpr):
        """Layer program_id(0)'s round with moves on read, as `expert_moves_ref.claim_round_ref` on its row (state
        [4 NC]: free slots [2 NC], kept compact, victims [NC], their host slots [NC]; NC = 1: spare, reserve spare,
        victim, its host slot): (1) each pending victim (its row now in its host slot h) is routed there and its
        device slot goes into the first free entry; (2) the counts decay; (3) claim j (a host slot whose rows the step
        stored into free slot j) is routed to that slot, its count and expert going with it, the move counted, while
        a victim is left for it (no more claims than live device slots); then as many of the least-used other live
        device slots (ties: the lowest expert) become the pending victims, the i-th to be written back into the
        i-th committed claim's host slot, and the free list loses the filled slots; (4) the next step's threshold:
        the least live device count + margin while a slot is free, else +inf."""
        layer = tl.program_id(0)
        base = layer.to(tl.int64) * S
        offs = tl.arange(0, BLOCK_S)
        valid = offs < S
        c = tl.load(counts_ptr + base + offs, mask=valid, other=0.0)
        eos = tl.load(eos_ptr + base + offs, mask=valid, other=-1)
        hot = tl.load(hot_ptr + layer)
        srow = state_ptr + layer * (4 * NC)
        fo = tl.arange(0, BLOCK_F)
        fmask = fo < 2 * NC
        free = tl.load(srow + fo, mask=fmask, other=-1)
        vo = tl.arange(0, BLOCK_F)
        vmask = vo < NC
        # (1) the victims' write-backs are done (the forward's stream waited for them)
        for i in tl.static_range(NC):
            victim = tl.load(srow + 2 * NC + i)
            dest = tl.load(srow + 3 * NC + i)
            fin = victim >= 0
            x = tl.sum(tl.where(offs == victim, eos, 0), axis=0)
            cv = tl.sum(tl.where(offs == victim, c, 0.0), axis=0)
            tl.store(slot_map_ptr + layer * E + x, dest.to(tl.int32), mask=fin)
            eos = tl.where(fin & (offs == dest), x, tl.where(fin & (offs == victim), -1, eos))
            c = tl.where(fin & (offs == dest), cv, tl.where(fin & (offs == victim), 0.0, c))
            first = tl.min(tl.where(fmask & (free < 0), fo, BLOCK_F), axis=0)
            free = tl.where(fin & (fo == first), victim, free)
        # (2)
        c = c * decay
        # (3)
        n_live = tl.sum(tl.where(valid & (offs < hot) & (eos >= 0), 1, 0), axis=0)
        n_go = n_live * 0
        used = tl.zeros([BLOCK_F], tl.int32)
        filled = tl.zeros([BLOCK_S], tl.int32)
        dests = tl.full([BLOCK_F], -1, tl.int64)
        for j in tl.static_range(NC):
            cl = tl.load(claim_ptr + layer * NC + j).to(tl.int64)
            spare = tl.sum(tl.where(fo == j, free, 0), axis=0)
            got = (cl >= 0) & (spare >= 0) & (n_go < n_live)
            x = tl.sum(tl.where(offs == cl, eos, 0), axis=0)
            cc = tl.sum(tl.where(offs == cl, c, 0.0), axis=0)
            tl.store(slot_map_ptr + layer * E + x, spare.to(tl.int32), mask=got)
            eos = tl.where(got & (offs == spare), x, tl.where(got & (offs == cl), -1, eos))
            c = tl.where(got & (offs == spare), cc, tl.where(got & (offs == cl), 0.0, c))
            filled = tl.where(got & (offs == spare), 1, filled)
            used = tl.where(got & (fo == j), 1, used)
            dests = tl.where(got & (vo == n_go), cl, dests)
            n_go += got.to(tl.int32)
            tl.store(claim_ptr + layer * NC + j, -1)
        live_dev = valid & (offs < hot) & (eos >= 0)
        cand = live_dev & (filled == 0)
        victims = tl.full([BLOCK_F], -1, tl.int64)
        for i in tl.static_range(NC):
            dc = tl.where(cand, c, float("inf"))
            cmin = tl.min(dc, axis=0)
            # ties: the lowest expert id (what `expert_cache_sim._replay_claims` picks, so the two agree exactly)
            low_e = tl.min(tl.where(cand & (dc == cmin), eos, 2 ** 30), axis=0)
            low = tl.min(tl.where(live_dev & (eos == low_e), offs, BLOCK_S), axis=0).to(tl.int64)
            pick = i < n_go
            victims = tl.where(pick & (vo == i), low, victims)
            cand = cand & ((offs != low) | (i >= n_go))
        tl.store(moves_ptr + layer, tl.load(moves_ptr + layer) + n_go.to(tl.int64))
        # the free list without the filled slots, compacted (entry k: the kept one with k kept before it)
        keep = fmask & (free >= 0) & (used == 0)
        rank = tl.sum(tl.where(keep[None, :] & (fo[None, :] < fo[:, None]), 1, 0), axis=1)
        nxt = tl.full([BLOCK_F], -1, tl.int64)
        for k in tl.static_range(2 * NC):
            at = keep & (rank == k)
            has = tl.sum(tl.where(at, 1, 0), axis=0) > 0
            nxt = tl.where((fo == k) & has, tl.sum(tl.where(at, free, 0), axis=0), nxt)
        # (4)
        tmin = tl.min(tl.where(live_dev, c, float("inf")), axis=0)
        spare0 = tl.sum(tl.where(fo == 0, nxt, 0), axis=0)
        thr = tl.where((spare0 >= 0) & (hot < S), tmin + margin, float("inf"))
        tl.store(thr_ptr + layer, thr)
        tl.store(counts_ptr + base + offs, c, mask=valid)
        tl.store(eos_ptr + base + offs, eos, mask=valid)
        tl.store(srow + fo, nxt, mask=fmask)
        tl.store(srow + 2 * NC + vo, victims, mask=vmask)
        tl.store(srow + 3 * NC + vo, dests, mask=vmask)

    @triton.jit
    def _decide_settle_kernel(counts_ptr, slot_map_ptr, hot_ptr, moves_ptr, dec_ptr, E, decay, margin,
                              BLOCK_E: tl.constexpr):
        """Layer program_id(0)'s round bookkeeping, as `decide` then `settle_ref` on its row: decay its counts (one
        fp32 multiply, as `counts.mul_(decay)`), pick the device slot i < hot with the lowest count and the host slot
        j >= hot with the highest (ties: the lowest slot, as torch's argmin / argmax; no device slot: i = 0, no host
        slot: j = 0), go = counts[j] > counts[i] + margin and 0 < hot < E; write (i, j, go) to dec, and on go swap
        the counts and slot-map entries of i and j and add 1 to the layer's move counter."""
        layer = tl.program_id(0)
        base = layer.to(tl.int64) * E
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        c = tl.load(counts_ptr + base + offs, mask=valid, other=0.0) * decay
        hot = tl.load(hot_ptr + layer)
        is_hot = offs < hot
        dc = tl.where(valid & is_hot, c, float("inf"))
        hc = tl.where(valid & (offs >= hot), c, float("-inf"))
        ci = tl.min(dc, axis=0)                            # an element of c, or inf (no device slot)
        cj = tl.max(hc, axis=0)                            # an element of c, or -inf (no host slot)
        i = tl.min(tl.where(valid & (dc == ci), offs, BLOCK_E), axis=0)
        j = tl.min(tl.where(valid & (hc == cj), offs, BLOCK_E), axis=0)
        go = (cj > ci + margin) & (hot > 0) & (hot < E)
        tl.store(dec_ptr + layer * 3, i.to(tl.int64))
        tl.store(dec_ptr + layer * 3 + 1, j.to(tl.int64))
        tl.store(dec_ptr + layer * 3 + 2, go.to(tl.int64))
        # the slots that trade places (-1: none); with go, ci and cj are counts[i] and counts[j]
        ii = tl.where(go, i, -1)
        jj = tl.where(go, j, -1)
        c = tl.where(offs == ii, cj, tl.where(offs == jj, ci, c))
        tl.store(counts_ptr + base + offs, c, mask=valid)          # every lane decayed, the pair swapped
        pair = valid & ((offs == ii) | (offs == jj))
        m = tl.load(slot_map_ptr + base + offs, mask=pair, other=0)
        mi = tl.sum(tl.where(offs == ii, m, 0), axis=0)
        mj = tl.sum(tl.where(offs == jj, m, 0), axis=0)
        tl.store(slot_map_ptr + base + offs, tl.where(offs == ii, mj, mi), mask=pair)
        tl.store(moves_ptr + layer, tl.load(moves_ptr + layer) + go.to(tl.int64))


@dataclass
class SwapPlan:
    """A RowSet as the swap kernel reads it, built once (the rows never move in memory): element offsets from
    `anchor` on the device, so a move round copies nothing from the host."""
    anchor: torch.Tensor
    dev_off: torch.Tensor           # int64 [L]
    host_off: torch.Tensor          # int64 [L]
    split: torch.Tensor             # int64 [L]
    row_elems: int

    @classmethod
    def build(cls, rows: RowSet, device: torch.device) -> "SwapPlan":
        # a layer whose experts are all cold has an empty device part (its rows never move: `decide`); the offsets
        # are taken from the first non-empty part
        anchor = next((t for t in rows.dev + rows.host if t.numel()), rows.dev[0])
        item, base = anchor.element_size(), anchor.data_ptr()
        for t in rows.dev + rows.host:
            if t.dtype != anchor.dtype or (t.data_ptr() - base) % item or not t.is_contiguous():
                raise ValueError("swap rows must be contiguous tensors of one dtype")
            if t.shape[1:] != anchor.shape[1:]:
                raise ValueError(f"swap rows of one kind must have one shape: {tuple(t.shape[1:])} and "
                                 f"{tuple(anchor.shape[1:])}")

        def offsets(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.tensor([(t.data_ptr() - base) // item if t.numel() else 0 for t in ts], dtype=torch.int64,
                                device=device)

        return cls(anchor, offsets(rows.dev), offsets(rows.host),
                   torch.tensor(rows.split, dtype=torch.int64, device=device), math.prod(anchor.shape[1:]))


def decide(counts: torch.Tensor, hot: torch.Tensor, decay: float, margin: float) -> torch.Tensor:
    """counts fp32 [L, E] (decayed in place), hot int64 [L] -> decisions int64 [L, 3]: (device slot, host slot,
    move?) per layer. Ties: the lowest slot."""
    counts.mul_(decay)
    L, E = counts.shape
    is_hot = torch.arange(E, device=counts.device)[None, :] < hot[:, None]
    i = torch.where(is_hot, counts, torch.inf).argmin(1)
    j = torch.where(is_hot, -torch.inf, counts).argmax(1)
    go = counts.gather(1, j[:, None])[:, 0] > counts.gather(1, i[:, None])[:, 0] + margin
    go &= (hot > 0) & (hot < E)          # a layer with no device slot (all cold) or no host slot has nothing to swap
    return torch.stack([i, j, go.long()], dim=1)


def claim_round(counts: torch.Tensor, expert_of_slot: torch.Tensor, slot_map: torch.Tensor, hot: torch.Tensor,
                moves: torch.Tensor, state: torch.Tensor, claim: torch.Tensor, threshold: torch.Tensor, decay: float,
                margin: float) -> None:
    """`expert_move_async`'s round for every layer in one launch (`_claim_round_kernel`): counts fp32 [L, S],
    expert_of_slot int32 [L, S], slot_map int32 [L, E], hot int64 [L] (device slots, the spare among them), moves
    int64 [L], state int64 [L, 4C] (free slots [2C] kept compact, victims [C], their host slots [C]: -1 where none;
    C = 1: spare, reserve spare, victim, its host slot), claim int32 [L, C] (C = 1: [L] too), threshold fp32 [L];
    all in place, contiguous, on one device; nothing read back."""
    L, S = counts.shape
    for t in (counts, expert_of_slot, slot_map, hot, moves, state, claim, threshold):
        if not t.is_contiguous():
            raise ValueError("claim_round takes contiguous tensors")
    nc = claims_of(state)
    if claim.numel() != L * nc:
        raise ValueError(f"claim {tuple(claim.shape)} for state {tuple(state.shape)}: [L, C] (C = 1: [L] too)")
    block = triton.next_power_of_2(S)
    _claim_round_kernel[(L,)](counts, expert_of_slot, slot_map, hot, moves, state, claim, threshold, S,
                              slot_map.shape[1], float(decay), float(margin), BLOCK_S=block, NC=nc,
                              BLOCK_F=triton.next_power_of_2(2 * nc), num_warps=4 if block <= 1024 else 8)


def claims_of(state: torch.Tensor) -> int:
    """C, the claims a layer a step, of a claim state [L, 4C] (`expert_move_claims`)."""
    if state.dim() != 2 or state.shape[1] % 4 or not state.shape[1]:
        raise ValueError(f"a claim state is [L, 4C], not {tuple(state.shape)}")
    return state.shape[1] // 4


# Programs a written-back row gets (`write_back`): the copy runs beside the forward's kernels, and a handful of
# programs keep the PCIe direction busy without taking the SMs the steps need (the swap kernel, on the forward's own
# stream, takes a program per block instead).
WRITE_BACK_PROGRAMS = 4


def write_back(plan: SwapPlan, state: torch.Tensor, block: int = 4096, layers: torch.Tensor | None = None,
               programs: int = WRITE_BACK_PROGRAMS) -> None:
    """`expert_move_async`: for every layer l and each of its pending victims (state [L, 4C], `claim_round`), the
    victim slot's row into its host slot, in one launch (`_write_back_kernel`); `layers` as `swap_rows`."""
    n = plan.row_elems
    block = min(block, triton.next_power_of_2(n))
    _write_back_kernel[(plan.dev_off.numel(), max(1, min(programs, triton.cdiv(n, block))))](
        plan.anchor, plan.dev_off, plan.host_off, plan.split, state, state if layers is None else layers, n,
        BLOCK=block, HAS_LAYERS=layers is not None, NC=claims_of(state))


def swap_rows(plan: SwapPlan, dec: torch.Tensor, block: int = 4096, layers: torch.Tensor | None = None) -> None:
    """Exchange slots dec[l, 0] and dec[l, 1] of every layer l with dec[l, 2] != 0 (see `_swap_kernel`). `layers`
    (int64 [plan's layers], on the device): the plan's k-th layer takes decision row layers[k] of a stage-wide `dec`
    (the same as passing `dec.index_select(0, layers)`, without that launch)."""
    n = plan.row_elems
    block = min(block, triton.next_power_of_2(n))
    _swap_kernel[(plan.dev_off.numel(), triton.cdiv(n, block))](
        plan.anchor, plan.dev_off, plan.host_off, plan.split, dec, dec if layers is None else layers, n,
        BLOCK=block, HAS_LAYERS=layers is not None)


def decide_settle(counts: torch.Tensor, hot: torch.Tensor, expert_of_slot: torch.Tensor, moves: torch.Tensor,
                  decay: float, margin: float) -> torch.Tensor:
    """`decide` and `expert_moves_ref.settle_ref` in one launch (`_decide_settle_kernel`, one program per layer):
    counts fp32 [L, E] (decayed, and the moving slots' counts swapped, in place), hot int64 [L], expert_of_slot
    int32 [L, E] (the moving slots' entries swapped), moves int64 [L] (+1 where a layer moves) -> decisions int64
    [L, 3] for `swap_rows`, equal to `decide`'s. All contiguous, on one device."""
    L, E = counts.shape
    for t in (counts, hot, expert_of_slot, moves):
        if not t.is_contiguous():
            raise ValueError("decide_settle takes contiguous tensors")
    dec = torch.empty(L, 3, dtype=torch.int64, device=counts.device)
    block = triton.next_power_of_2(E)
    _decide_settle_kernel[(L,)](counts, expert_of_slot, hot, moves, dec, E, float(decay), float(margin),
                                BLOCK_E=block, num_warps=4 if block <= 1024 else 8)
    return dec


def swap_usable(t: torch.Tensor) -> bool:
    """The kernel runs for CUDA tables; a CPU cluster swaps with `swap_rows_ref` (tests call the kernel directly
    under the interpreter)."""
    return triton is not None and t.is_cuda
