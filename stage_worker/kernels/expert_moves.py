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

Asynchronous moves (`expert_moves_async`, `StageExperts.start_async`): the same round one layer at a time, on a side
stream while other layers compute. `decide_layer` is one launch (decay, pick, and the counts / slot-map / move-counter
swap), then `swap_rows` with the layer's `SwapPlan.layer` per kind of row; a flag on the device (`armed`) says
whether this step has a round, so the launches can sit in a CUDA graph.

Reference: `expert_moves_ref.swap_rows_ref` (and the whole round, `move_round_ref`); test: tests/test_expert_moves.py
(CPU under TRITON_INTERPRET=1). Switch: cluster key `expert_moves` (MOEPIPE_EXPERT_MOVES=0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.kernels.expert_moves_ref import RowSet
from stage_worker.kernels.moe import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swap_kernel(anchor_ptr, dev_off_ptr, host_off_ptr, split_ptr, dec_ptr, N, BLOCK: tl.constexpr):
        """Layer program_id(0): if its decision says move, swap the BLOCK elements program_id(1) of the rows of
        slots i and j. Slot s < split is row s at dev_off, else row s - split at host_off (element offsets from
        anchor_ptr)."""
        layer = tl.program_id(0)
        go = tl.load(dec_ptr + layer * 3 + 2)
        if go != 0:
            i = tl.load(dec_ptr + layer * 3)
            j = tl.load(dec_ptr + layer * 3 + 1)
            split = tl.load(split_ptr + layer)
            dev = tl.load(dev_off_ptr + layer)
            host = tl.load(host_off_ptr + layer)
            a = tl.where(i < split, dev + i * N, host + (i - split) * N)
            b = tl.where(j < split, dev + j * N, host + (j - split) * N)
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            x = tl.load(anchor_ptr + a + offs, mask=mask)
            y = tl.load(anchor_ptr + b + offs, mask=mask)
            tl.store(anchor_ptr + a + offs, y, mask=mask)
            tl.store(anchor_ptr + b + offs, x, mask=mask)

    @triton.jit
    def _decide_layer_kernel(counts_ptr, map_ptr, moves_ptr, dec_ptr, armed_ptr, hot, E, decay, margin,
                             BLOCK_E: tl.constexpr):
        """One layer's round, as `decide` + the bookkeeping of `move_round` on its row: if armed, decay the counts,
        pick the least used device slot i and the most used host slot j (ties: the lowest slot), go if
        counts[j] > counts[i] + margin; write (i, j, go) to dec, and on go swap counts[i] / counts[j] and the slot
        map's entries and add 1 to the move counter. Not armed: go = 0, nothing else changes."""
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        armed = tl.load(armed_ptr)
        if armed != 0:
            c = tl.load(counts_ptr + offs, mask=valid, other=0.0) * decay
            dc = tl.where(valid & (offs < hot), c, float("inf"))
            hc = tl.where(valid & (offs >= hot), c, float("-inf"))
            i = tl.min(tl.where(dc == tl.min(dc, axis=0), offs, BLOCK_E), axis=0)
            j = tl.min(tl.where(hc == tl.max(hc, axis=0), offs, BLOCK_E), axis=0)
            ci = tl.sum(tl.where(offs == i, c, 0.0), axis=0)
            cj = tl.sum(tl.where(offs == j, c, 0.0), axis=0)
            go = cj > ci + margin
            tl.store(dec_ptr, i.to(tl.int64))
            tl.store(dec_ptr + 1, j.to(tl.int64))
            tl.store(dec_ptr + 2, go.to(tl.int64))
            ii = tl.where(go, i, -1)                      # the slots that trade places (-1: none)
            jj = tl.where(go, j, -1)
            c = tl.where(offs == ii, cj, tl.where(offs == jj, ci, c))
            tl.store(counts_ptr + offs, c, mask=valid)
            m = tl.load(map_ptr + offs, mask=valid, other=0)
            mi = tl.sum(tl.where(offs == i, m, 0), axis=0)
            mj = tl.sum(tl.where(offs == j, m, 0), axis=0)
            m = tl.where(offs == ii, mj, tl.where(offs == jj, mi, m))
            tl.store(map_ptr + offs, m, mask=valid)
            tl.store(moves_ptr, tl.load(moves_ptr) + go.to(tl.int64))
        else:
            tl.store(dec_ptr + 2, tl.full([], 0, tl.int64))


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
        anchor = rows.dev[0]
        item, base = anchor.element_size(), anchor.data_ptr()
        for t in rows.dev + rows.host:
            if t.dtype != anchor.dtype or (t.data_ptr() - base) % item or not t.is_contiguous():
                raise ValueError("swap rows must be contiguous tensors of one dtype")
            if t.shape[1:] != anchor.shape[1:]:
                raise ValueError(f"swap rows of one kind must have one shape: {tuple(t.shape[1:])} and "
                                 f"{tuple(anchor.shape[1:])}")

        def offsets(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.tensor([(t.data_ptr() - base) // item for t in ts], dtype=torch.int64, device=device)

        return cls(anchor, offsets(rows.dev), offsets(rows.host),
                   torch.tensor(rows.split, dtype=torch.int64, device=device), anchor[0].numel())

    def layer(self, k: int) -> "SwapPlan":
        """The plan of its k-th layer alone (views: `swap_rows` with that layer's decision row dec[l:l+1])."""
        return SwapPlan(self.anchor, self.dev_off[k:k + 1], self.host_off[k:k + 1], self.split[k:k + 1],
                        self.row_elems)


def decide(counts: torch.Tensor, hot: torch.Tensor, decay: float, margin: float) -> torch.Tensor:
    """counts fp32 [L, E] (decayed in place), hot int64 [L] -> decisions int64 [L, 3]: (device slot, host slot,
    move?) per layer. Ties: the lowest slot."""
    counts.mul_(decay)
    L, E = counts.shape
    is_hot = torch.arange(E, device=counts.device)[None, :] < hot[:, None]
    i = torch.where(is_hot, counts, torch.inf).argmin(1)
    j = torch.where(is_hot, -torch.inf, counts).argmax(1)
    go = counts.gather(1, j[:, None])[:, 0] > counts.gather(1, i[:, None])[:, 0] + margin
    return torch.stack([i, j, go.long()], dim=1)


def decide_layer(counts: torch.Tensor, expert_of_slot: torch.Tensor, moves: torch.Tensor, dec: torch.Tensor,
                 armed: torch.Tensor, hot: int, decay: float, margin: float) -> None:
    """One layer's decision and bookkeeping in one launch (`_decide_layer_kernel`): counts fp32 [E] and
    expert_of_slot int32 [E] (changed in place), moves int64 [1], dec int64 [3] (written), armed int32 [1]."""
    E = counts.numel()
    _decide_layer_kernel[(1,)](counts, expert_of_slot, moves, dec, armed, hot, E, float(decay), float(margin),
                               BLOCK_E=triton.next_power_of_2(E), num_warps=4)


def swap_rows(plan: SwapPlan, dec: torch.Tensor, block: int = 4096) -> None:
    """Exchange slots dec[l, 0] and dec[l, 1] of every layer l with dec[l, 2] != 0 (see `_swap_kernel`)."""
    n = plan.row_elems
    block = min(block, triton.next_power_of_2(n))
    _swap_kernel[(plan.dev_off.numel(), triton.cdiv(n, block))](plan.anchor, plan.dev_off, plan.host_off,
                                                                plan.split, dec, n, BLOCK=block)


def swap_usable(t: torch.Tensor) -> bool:
    """The kernel runs for CUDA tables; a CPU cluster swaps with `swap_rows_ref` (tests call the kernel directly
    under the interpreter)."""
    return triton is not None and t.is_cuda
