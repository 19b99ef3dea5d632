"""Plain PyTorch reference of the expert-move swap (`expert_moves.py`): the test oracle, and the path of machines
where the Triton kernel cannot run (a CPU cluster). It reads the decisions back to the host, once a round."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSet:
    """One kind of row for every layer: layer l's slot s < split[l] is `dev[l][s]`, else `host[l][s - split[l]]`
    (dev and host the same tensor for the router, whose split is past the last slot). A kind is one part of the
    expert tables (w13, w2, or INT4 words / scales: `expert_table.PACKED_PARTS`) or the router rows; every row of a
    kind has one shape and dtype."""
    dev: list[torch.Tensor]
    host: list[torch.Tensor]
    split: list[int]


def _row(rows: RowSet, layer: int, slot: int) -> torch.Tensor:
    split = rows.split[layer]
    return rows.dev[layer][slot] if slot < split else rows.host[layer][slot - split]


@torch.no_grad()
def swap_rows_ref(rows: RowSet, dec: torch.Tensor) -> None:
    for layer, (i, j, go) in enumerate(dec.tolist()):
        if go:
            a, b = _row(rows, layer, i), _row(rows, layer, j)
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)


@torch.no_grad()
def settle_ref(counts: torch.Tensor, expert_of_slot: torch.Tensor, moves: torch.Tensor, dec: torch.Tensor) -> None:
    """After the rows: swap the decided slots' counts and slot-map entries, count the moves (counts [L, E],
    expert_of_slot [L, E], moves [L], dec [L, 3]; in place, on the device, nothing read back)."""
    pair, go = dec[:, :2], dec[:, 2:].bool()
    for t in (counts, expert_of_slot):
        vals = t.gather(1, pair)
        t.scatter_(1, pair, torch.where(go, vals.flip(1), vals))
    moves.add_(dec[:, 2])


@torch.no_grad()
def claim_round_ref(counts: torch.Tensor, expert_of_slot: torch.Tensor, slot_map: torch.Tensor, hot: torch.Tensor,
                    moves: torch.Tensor, state: torch.Tensor, claim: torch.Tensor, threshold: torch.Tensor,
                    decay: float, margin: float) -> None:
    """`expert_moves.claim_round` (`expert_move_async`'s round), layer by layer on the host: the oracle of
    `_claim_round_kernel` and a CPU cluster's round. Arguments as there (state [L, 4C]: free slots [2C], victims [C],
    their host slots [C]; claim [L, C], or [L] with C = 1); a victim's ties: the lowest expert id."""
    L, S = counts.shape
    C = state.shape[1] // 4
    claims = claim.view(L, C)
    for layer in range(L):
        c, eos, smap = counts[layer], expert_of_slot[layer], slot_map[layer]
        row = state[layer].tolist()
        free, victims, dests = row[:2 * C], row[2 * C:3 * C], row[3 * C:]
        for victim, dest in zip(victims, dests):
            if victim >= 0:                    # its write-back is done: route it to its host slot
                x = int(eos[victim])
                smap[x], eos[dest], c[dest] = dest, x, c[victim]
                eos[victim], c[victim] = -1, 0.0
                free[free.index(-1)] = victim  # the first free entry (the list is kept compact)
        c.mul_(decay)
        n_hot = int(hot[layer])
        n_live = sum(1 for s in range(n_hot) if eos[s] >= 0)
        used, filled, dests = [], [], []
        for j in range(C):                     # claim j: the step stored slot cl's rows into free[j]
            cl = int(claims[layer, j])
            if cl >= 0 and free[j] >= 0 and len(used) < n_live:       # a victim for each
                spare = free[j]
                x = int(eos[cl])
                smap[x], eos[spare], c[spare] = spare, x, c[cl]
                eos[cl], c[cl] = -1, 0.0
                used.append(j)
                filled.append(spare)
                dests.append(cl)
        moves[layer] += len(used)
        live = [s for s in range(n_hot) if eos[s] >= 0 and s not in filled]
        victims = sorted(live, key=lambda s: (float(c[s]), int(eos[s])))[:len(used)]
        claims[layer] = -1
        free = [f for k, f in enumerate(free) if f >= 0 and k not in used]
        free += [-1] * (2 * C - len(free))
        live = [float(c[s]) for s in range(n_hot) if eos[s] >= 0]
        threshold[layer] = min(live) + margin if free[0] >= 0 and live and n_hot < S else float("inf")
        victims += [-1] * (C - len(victims))
        dests += [-1] * (C - len(dests))
        state[layer] = torch.tensor(free + victims + dests, dtype=state.dtype)


@torch.no_grad()
def write_back_ref(rows: RowSet, state: torch.Tensor) -> None:
    """`expert_moves.write_back`: state [L, 4C] (free slots [2C], victims [C], their host slots [C]; C = 1: spare,
    reserve, victim, host slot); where a victim is pending, its row into its host slot."""
    C = state.shape[1] // 4
    for layer, row in enumerate(state.tolist()):
        for victim, dest in zip(row[2 * C:3 * C], row[3 * C:]):
            if victim >= 0:
                _row(rows, layer, dest).copy_(_row(rows, layer, victim))
