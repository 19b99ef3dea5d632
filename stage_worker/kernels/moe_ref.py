"""Plain PyTorch references for the fused MoE decode kernels in `moe.py` (002 §3.3): the test oracle.

Vectorised over tokens (no Python loop), fp32 throughout. `fused_moe_ref` gathers the selected experts' weights into a
[T, k, ...] copy, so it is meant for small T (tests, CPU decode), not for prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class HostRows:
    """Slots [first, E) of a layer's expert table, in their own tensors (w13 [E - first, 2I, H], w2 [E - first, H, I],
    pinned host memory on a GPU machine): slot s is row s - first. Slots below `first` are the main table's."""

    w13: torch.Tensor
    w2: torch.Tensor
    first: int


@dataclass
class RouteCounts:
    """Where the router adds its selections: `counts` fp32 [E] per slot, `host_reads` int64 [1] the selections of
    slots >= `first` (host rows). With `claim` (int32 [1]) and `threshold` (fp32 [1]), `expert_move_async`'s moves
    on read: a selected host slot whose count passes the threshold is written to `claim` (if it holds -1), and the
    decode kernels that read that slot store its rows into the table's free device slot as they go
    (`expert_moves.py`)."""

    counts: torch.Tensor
    host_reads: torch.Tensor
    first: int
    claim: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    # C claims a step (`expert_move_claims` > 1): claim int32 [C], and spare int64 [C] the free slot entry j's rows go
    # into (-1: entry j takes no claim this step)
    spare: torch.Tensor | None = None
    # `expert_prefetch`: this layer's prefetch slots, filled this step by the previous MoE layer's launches
    # (`kernels/expert_prefetch_ref.Prefetch`); a selected host slot found ready there is read from VRAM
    prefetch: object | None = None


def route_ref(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32), best first.

    Equal logits go to the lower expert id: a stable descending sort keeps equal keys in index order. Selecting on
    logits rather than probabilities is the same order (softmax is monotone) without the rounding of exp().
    With `renormalise` the full softmax denominator cancels, so the weights are a softmax over the k chosen logits.
    """
    lf = logits.float()
    order = torch.sort(lf, dim=-1, descending=True, stable=True)
    top, ids = order.values[:, :top_k], order.indices[:, :top_k]
    if renormalise:
        weights = torch.softmax(top, dim=-1)
    else:
        weights = torch.softmax(lf, dim=-1).gather(-1, ids)
    return weights, ids.to(torch.int32)


def fused_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, shared=None) -> torch.Tensor:
    """x [T, H], ids/weights [T, k], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in x.dtype.

    out[t] = sum_j weights[t, j] * W2[e] @ (silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])), e = ids[t, j], all in fp32.
    Only the selected experts are gathered, so an expert no token picked is never read. Slots with id -1 use
    `shared.w13` / `shared.w2` (the shared expert, see `moe.SharedExpert`).
    """
    sel = ids.long()
    xf = x.float()
    w13_sel, w2_sel = w13[sel.clamp_min(0)].float(), w2[sel.clamp_min(0)].float()
    if shared is not None:
        is_shared = (sel < 0)[:, :, None, None]
        w13_sel = torch.where(is_shared, shared.w13.float()[None, None], w13_sel)
        w2_sel = torch.where(is_shared, shared.w2.float()[None, None], w2_sel)
    gate_up = torch.einsum("th,tkrh->tkr", xf, w13_sel)                   # [T, k, 2I]
    g, u = gate_up.chunk(2, dim=-1)
    act = F.silu(g) * u                                                   # [T, k, I]
    down = torch.einsum("tki,tkhi->tkh", act, w2_sel)                     # [T, k, H]
    return (down * weights.float()[..., None]).sum(dim=1).to(x.dtype)


def shared_gate_ref(logit: torch.Tensor) -> torch.Tensor:
    """The shared expert's weight from its gate logit: sigmoid in the logits' dtype, as SparseMoE computes it."""
    return torch.sigmoid(logit)


def count_ref(ids: torch.Tensor, counts) -> None:
    """What the router kernel counts (`moe.RouteCounts`): +1 per selection of each slot in ids [T, k], and the
    selections of slots >= counts.first added to counts.host_reads. Device ops only (no host sync)."""
    flat = ids.reshape(-1).long()
    counts.counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=counts.counts.dtype, device=flat.device))
    counts.host_reads.add_((flat >= counts.first).sum().to(counts.host_reads.dtype))
    if counts.claim is not None:
        claim_ref(flat, counts)


def claim_ref(flat: torch.Tensor, counts) -> None:
    """The router kernel's claim after counting: the first selected host slot (token by token, best first) whose
    count passes `counts.threshold` goes into `counts.claim` if no slot is claimed yet. Device ops, no host sync (a
    graph may capture it). (The kernel's tokens race and test each count as their own add left it, so at batch > 1
    it may claim another qualifying slot: the layout differs, the outputs do not.)"""
    n = flat.numel()
    if n == 0:
        return
    ok = (flat >= counts.first) & (counts.counts[flat.clamp_min(0)] > counts.threshold)
    if counts.claim.numel() > 1:
        claims_ref(flat, ok, counts)
        return
    pos = torch.where(ok, torch.arange(n, device=flat.device), n).min()
    pick = flat.index_select(0, pos.clamp(max=n - 1).reshape(1)).squeeze(0).to(counts.claim.dtype)  # no .item()
    counts.claim.copy_(torch.where((counts.claim < 0) & (pos < n), pick, counts.claim))


def claims_ref(flat: torch.Tensor, ok: torch.Tensor, counts) -> None:
    """`claim_ref` with C > 1 claims (claim [C], spare [C]): entry by entry, an empty entry (-1) whose spare is a
    slot takes the first qualifying selection (ok [n], token by token, best first) that no entry holds yet: up to C
    distinct host slots a step, first come first (`expert_cache_sim._replay_claims`). Device ops, no host sync. (The
    kernel's tokens race, as at one claim.)"""
    n = flat.numel()
    idx = torch.arange(n, device=flat.device)
    claim = counts.claim.reshape(-1)
    spare = counts.spare.reshape(-1) if counts.spare is not None else torch.zeros_like(claim)
    for j in range(claim.numel()):
        free = (claim[j] < 0) & (spare[j] >= 0)
        mine = ok & ~(flat[:, None] == claim[None, :].to(flat.dtype)).any(1)
        pos = torch.where(mine, idx, n).min()
        pick = flat.index_select(0, pos.clamp(max=n - 1).reshape(1)).squeeze(0).to(claim.dtype)
        claim[j:j + 1].copy_(torch.where(free & (pos < n), pick, claim[j]).reshape(1))


@dataclass
class Fp8Experts:
    """Routed experts kept in a block-FP8 checkpoint's form (issue 17, `SparseMoE.use_fp8`): q13 uint8 [E, 2I, H]
    and q2 uint8 [E, H, I], the float8_e4m3fn bytes of w13 (gate rows then up rows) and w2; s13 float32
    [E, 2, ceil(I/br), ceil(H/bc)] (gate's blocks, then up's: each projection is blocked on its own, so an I that
    is not a multiple of br does not mix the two), s2 float32 [E, ceil(H/br), ceil(I/bc)]; block = (br, bc)."""

    q13: torch.Tensor
    s13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor
    block: tuple[int, int]

    def w13(self, e: int) -> torch.Tensor:
        """Expert e's gate and up rows [2I, H], dequantized in float32."""
        return dequantize_fp8_w13(self.q13[e], self.s13[e], self.block)

    def w2(self, e: int) -> torch.Tensor:
        """Expert e's down rows [H, I], dequantized in float32."""
        return dequantize_fp8_block(self.q2[e], self.s2[e], self.block)


def dequantize_fp8_w13(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """One expert's gate and up rows [2I, H] in float32 from its bytes [2I, H] and scales [2, ...] (gate's blocks,
    up's): what an expert table's slot holds, wherever it lives (`moe.grouped_moe_fp8`)."""
    inter = q.shape[0] // 2
    return torch.cat([dequantize_fp8_block(q[:inter], scale[0], block),
                      dequantize_fp8_block(q[inter:], scale[1], block)])


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn bytes q (uint8 or float8) [rows, cols] times its block scales [ceil(rows/br), ceil(cols/bc)],
    in float32: what `quant_weight.dequantize_float` gives at load (the same products)."""
    rows, cols = q.shape
    br, bc = block
    w = (q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q).float()
    s = scale.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w * s


def fused_moe_fp8_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Fp8Experts) -> torch.Tensor:
    """The FP8 decode kernel's oracle: the selected experts dequantized (float32), then `fused_moe_ref`. Slots with
    id < 0 (padding) contribute nothing."""
    sel = ids.long()
    present = torch.unique(sel[sel >= 0]).tolist()
    E = experts.q13.shape[0]
    inter, H = experts.q13.shape[1] // 2, experts.q13.shape[2]
    w13 = torch.zeros(E, 2 * inter, H, dtype=torch.float32, device=x.device)
    w2 = torch.zeros(E, H, inter, dtype=torch.float32, device=x.device)
    for e in present:
        w13[e], w2[e] = experts.w13(e), experts.w2(e)
    w = torch.where(sel >= 0, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    return fused_moe_ref(x, sel.clamp_min(0), w, w13, w2)
