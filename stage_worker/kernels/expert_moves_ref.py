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
    `_claim_round_kernel` and a CPU cluster's round. Arguments as there; a victim's ties: the lowest expert id."""
    S = counts.shape[1]
    for layer in range(counts.shape[0]):
        c, eos, smap = counts[layer], expert_of_slot[layer], slot_map[layer]
        spare, reserve, victim, dest = state[layer].tolist()
        if victim >= 0:                        # its write-back is done: route it to its host slot
            x = int(eos[victim])
            smap[x], eos[dest], c[dest] = dest, x, c[victim]
            eos[victim], c[victim] = -1, 0.0
            if spare < 0:
                spare = victim
            else:
                reserve = victim
            victim, dest = -1, -1
        c.mul_(decay)
        n_hot = int(hot[layer])
        cl = int(claim[layer])
        if cl >= 0 and spare >= 0:             # the step stored slot cl's rows into the spare
            x = int(eos[cl])
            smap[x], eos[spare], c[spare] = spare, x, c[cl]
            eos[cl], c[cl] = -1, 0.0
            moves[layer] += 1
            live = [s for s in range(n_hot) if eos[s] >= 0 and s != spare]
            victim = min(live, key=lambda s: (float(c[s]), int(eos[s])))
            dest, spare, reserve = cl, reserve, -1
        claim[layer] = -1
        live = [float(c[s]) for s in range(n_hot) if eos[s] >= 0]
        threshold[layer] = min(live) + margin if spare >= 0 and live and n_hot < S else float("inf")
        state[layer] = torch.tensor([spare, reserve, victim, dest], dtype=state.dtype)


@torch.no_grad()
def write_back_ref(rows: RowSet, state: torch.Tensor) -> None:
    """`expert_moves.write_back`: state [L, 4] (spare, reserve, victim, host slot); where a victim is pending, its
    row into the host slot."""
    for layer, (_, _, victim, dest) in enumerate(state.tolist()):
        if victim >= 0:
            _row(rows, layer, dest).copy_(_row(rows, layer, victim))
