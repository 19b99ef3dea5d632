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
def copy_rows_ref(rows: RowSet, dec: torch.Tensor) -> None:
    """`expert_moves.copy_rows` (`expert_move_async`): dec [L, 5] (d, h, go, device spare, host spare); where go,
    h's row into the device spare's, d's into the host spare's."""
    for layer, (d, h, go, dev_spare, host_spare) in enumerate(dec.tolist()):
        if go:
            _row(rows, layer, dev_spare).copy_(_row(rows, layer, h))
            _row(rows, layer, host_spare).copy_(_row(rows, layer, d))
