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
