"""Layer-ahead expert prefetch (issue 16, `expert_prefetch`): the state one MoE layer's table keeps for it, and the
pure-PyTorch references of its three steps (the kernels: `kernels/expert_prefetch.py`).

Why: with cold experts in host RAM, a selected host expert is read over PCIe inside the decode kernels, on the
step's critical path (~50 us an INT4 expert at the full shape), because a layer's experts are known only after its
own router. The NEXT layer's router applied to THIS layer's MoE input names most of them a layer early (the
residual stream changes little between layers: recall of top-k 0.49-0.80 on the trained demo model, CPU study in
docs/performance.md), so their rows can be copied into spare VRAM slots beside the step.

The three steps, for a layer L and the next MoE layer L' of its stage:
1. `predict_ref` (at L, on a side stream): L''s router on L's input, top-k per token, through L''s slot map; the
   host slots among them, rank-major (every token's best first) and distinct, the first P of them -> `slot`;
   `ready` cleared.
2. `copy_ref` (on a second side stream, while L's experts and L''s token mixer run): each named host slot's rows
   (every part of the table) into prefetch slot `first + p` of L''s device tier; `ready[p]` set when done.
3. `redirect_ref` (L''s router, `_route_row`'s PF): a selected host slot whose prefetch is ready is read from the
   prefetch slot instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stage_worker.kernels.moe_ref import route_ref

# Decode steps of at most this many tokens predict (the CUDA graphs' largest batch): the predict launch's scratch
# has this many rows, and a larger step (still decode-sized) runs without the prefetch.
PREFETCH_MAX_T = 16


@dataclass
class Prefetch:
    """One MoE layer's prefetch slots: the last P slots of its table's device tier (`first`..`first + P - 1`; no
    expert lives there: `expert_of_slot` -1, never a victim or a spare), and what the previous layer's launches
    put in them this step."""

    slot: torch.Tensor      # int32 [P] the host slot prefetch slot p receives this step (-1: none)
    ready: torch.Tensor     # int32 [P] != 0 once its rows are copied (copy kernel; predict clears it)
    done: torch.Tensor      # int32 [P] the copy programs finished with entry p (back to 0 after each copy)
    first: int              # the table slot of prefetch slot 0
    hits: torch.Tensor      # int64 [1] selections read from a prefetch slot (not over PCIe), since start
    issued: torch.Tensor    # int64 [1] host slots named for a copy, since start
    lock: torch.Tensor      # int32 [1] the predict launch's program counter (`split_reduce.last_of`)
    # the predict launch's scratch, [max tokens, E] logits and [max tokens, k] router weights and slots
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    # host side, per forward: the previous layer predicted and copied for this layer in this forward, so its
    # router may redirect (a stale `ready` from an earlier step must never be read: that prefetch slot's host
    # slot may hold another expert since)
    armed: bool = field(default=False)
    # each token's best `top` predicted experts are candidates (`expert_prefetch_top`; the layer's top-k by default)
    top: int = 0
    # decode steps of fewer tokens do not predict (`expert_prefetch_min_batch`: at one token the launches cost more
    # than the reads they save)
    min_tokens: int = 1

    @classmethod
    def allocate(cls, slots: int, first: int, experts: int, top_k: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device, issued: torch.Tensor | None = None,
                 hits: torch.Tensor | None = None, top: int = 0, min_tokens: int = 1) -> "Prefetch":
        """Zeroed state on `device`; `issued` / `hits` int64 [1] (views of a stage's per-layer counters) or new."""
        def z(*shape, dt=torch.int32):
            return torch.zeros(*shape, dtype=dt, device=device)

        return cls(slot=torch.full((slots,), -1, dtype=torch.int32, device=device), ready=z(slots), done=z(slots),
                   first=first, hits=z(1, dt=torch.int64) if hits is None else hits,
                   issued=z(1, dt=torch.int64) if issued is None else issued, lock=z(1),
                   logits=z(max_tokens, experts, dt=dtype), weights=z(max_tokens, top_k, dt=torch.float32),
                   ids=z(max_tokens, top_k), top=min(top, top_k) if top > 0 else top_k,
                   min_tokens=max(1, min_tokens))

    @property
    def slots(self) -> int:
        return self.slot.numel()

    @property
    def max_tokens(self) -> int:
        return self.logits.shape[0]


def predict_ref(logits: torch.Tensor, top_k: int, first_host: int, slots: int,
                slot_map: torch.Tensor | None = None, valid: int | None = None) -> torch.Tensor:
    """logits [T, E] (the next layer's router on this layer's input) -> int32 [slots]: the distinct host slots
    (>= first_host, after `slot_map`) among each token's top-k, rank-major (rank 0 of every token, then rank 1,
    ...), the first `slots` of them, -1 after. `valid`: rows from it on are a graph's padding (no prediction)."""
    _, ids = route_ref(logits, top_k, True)
    if slot_map is not None:
        ids = slot_map.to(ids.device)[ids.long()]
    if valid is not None:
        ids = ids[:valid]
    out: list[int] = []
    for s in ids.t().reshape(-1).tolist():       # rank-major
        if s >= first_host and s not in out and len(out) < slots:
            out.append(s)
    return torch.tensor(out + [-1] * (slots - len(out)), dtype=torch.int32)


def copy_ref(pf: Prefetch, dev: list[torch.Tensor], host: list[torch.Tensor], first_host: int) -> None:
    """Each named host slot's rows of every part (`dev[i]` [hot, ...] device rows, `host[i]` [E - hot, ...]) into
    prefetch slot `pf.first + p`, and `ready[p]` set."""
    for p, s in enumerate(pf.slot.tolist()):
        if s < 0:
            continue
        for d, h in zip(dev, host):
            d[pf.first + p].copy_(h[s - first_host])
        pf.ready[p] = 1


def redirect_ref(ids: torch.Tensor, pf: Prefetch, first_host: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] selected slots -> (ids with each ready prefetched host slot replaced by its prefetch slot, the
    bool mask of those replaced)."""
    out = ids.clone()
    hit = torch.zeros_like(ids, dtype=torch.bool)
    for p, (s, r) in enumerate(zip(pf.slot.tolist(), pf.ready.tolist())):
        if r and s >= first_host:
            m = ids == s
            out[m] = pf.first + p
            hit |= m
    return out, hit
