"""Fused MoE decode (002 §3.3): router top-k and the selected experts in three Triton launches, no host sync.

Decode is memory-bandwidth bound, so a step must read each selected expert's rows once and nothing else, with no
`.item()`/`.tolist()` so the step can be captured in a CUDA graph:

* `route`: one program per token row; softmax in fp32, top-k by repeated max over an order-preserving int64 key
  (logit bits << 32 | E-1-id) so equal logits go to the lower expert id, as in 002 §3.3.
* `fused_moe` phase 1, grid (T*k, cdiv(I, BLOCK_I)): act[t, j] = silu(x_t . Wg_e) * (x_t . Wu_e) in fp32.
* `fused_moe` phase 2, grid (T, cdiv(H, BLOCK_H)): out[t] = sum_j w[t, j] * (act[t, j] . W2_e), summed in fp32 in a
  fixed order (no atomics), so the result is deterministic.

The shared expert rides along as one more slot (002 §3.3): its gate row is appended to the router weight (one GEMV
gives E routed logits and the shared gate logit), `route` writes sigmoid(shared logit) as slot k's weight with id -1,
and the expert kernels read the shared expert's gate/up rows and down rows from their own tensors for that slot. That
removes the shared expert's ~9 separate launches per layer (two GEMVs, the gate GEMV, SiLU, two multiplies, the down
GEMV, sigmoid, the add). It needs the shared expert's intermediate size to equal the routed experts' (true for every
preset and for Qwen3-Next-80B); otherwise the caller runs the shared expert in PyTorch.

Large T (prefill, T*k > DECODE_MAX_TK) and machines without Triton take `grouped_moe`, a PyTorch path that sorts the
(token, slot) pairs by expert and runs two GEMMs per present expert; it syncs with the host once (the per-expert
counts), which is fine for prefill and not graph-capturable.

Experts in host RAM (issue 16): with `HostRows`, slots from `first` on live in a second table (pinned host memory
the GPU reads over PCIe), so the kernels take two base pointers and pick by slot; the router's rows are in slot
order (`stage_worker.model.expert_table`), so it selects slots and nothing else changes. With `RouteCounts` the
router kernel also counts each slot's selections and the selections of host slots (run-time moves and /metrics),
inside the CUDA graph, with no host read-back. Float8 experts (`fused_moe_fp8`) take host slots the same way: a host
slot's float8 rows and its block scales both come from the host table (`expert_rows` picks the scales' base too).
Store on claim (`fused_moe`'s and `fused_moe_fp8`'s `claim`, the kernels' CLAIM): the rows the decode kernels read
of one claimed slot (float8: its bytes and block scales) are also stored into a free device slot, so a host expert
moves to the device with no PCIe copy of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stage_worker.kernels.common import pow2 as _pow2
from stage_worker.kernels.common import pdl_usable, triton_usable
from stage_worker.kernels.moe_ref import (Fp8Experts, HostRows, RouteCounts, count_ref, dequantize_fp8_block,
                                          dequantize_fp8_w13, route_ref, shared_gate_ref)

try:
    from stage_worker.kernels.rmsnorm import round_to
except ImportError:   # no Triton
    round_to = None

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux: everything falls back to PyTorch
    triton = None

DECODE_MAX_TK = 256      # T*k above this takes grouped_moe: the per-(token, slot) kernels re-read shared experts
MAX_EXPERTS = 1024       # route keeps a whole row of logits in one program

# Tunables per token-count bucket (1, <=4, more), clipped to the next power of two of tiny test shapes: rows per
# program / columns per load / warps. Winners of `bench/tune_kernels.py` on the H200 (2026-11-29, H=2560, I=640,
# k=10 + shared): up 20.1 / 63.2 / 217 us at T=1 / 4 / 16 (3.6-4.2 TB/s of the selected experts' bytes, as fast as
# a cuBLAS GEMV over the same bytes), down 10.1 / 35.3 / 118 us.
UP_CFG = {1: (8, 128, 8), 4: (16, 128, 8), 16: (16, 128, 8)}       # BLOCK_I, BLOCK_H, warps
DOWN_CFG = {1: (8, 128, 8), 4: (16, 256, 4), 16: (8, 128, 8)}      # BLOCK_H, BLOCK_I, warps
NUM_WARPS = 4                                                      # the router kernel
_ROUTE_KEY32 = False     # kernel flag `route_key32` (process-wide, as pdl: StageModel.set_kernels), `_key32`


def set_route_key32(on: bool) -> None:
    global _ROUTE_KEY32
    _ROUTE_KEY32 = bool(on)


def route_key32_enabled() -> bool:
    return _ROUTE_KEY32


def _bucket(t: int) -> int:
    return 1 if t == 1 else 4 if t <= 4 else 16


@dataclass
class SharedExpert:
    """The shared expert's weights in the routed experts' layout: w13 [2I, H] (gate rows then up rows, typically a
    view over the module's gate_proj/up_proj storage), w2 [H, I]; its gate logit is the router GEMV's last column."""

    w13: torch.Tensor
    w2: torch.Tensor



# H and I are constexpr in the expert kernels: one compile per model shape, loops with known trip counts, and the
# Triton 3.6 interpreter under numpy >= 2.4 cannot run `range` to a runtime bound (int() of a 1-element array).
SKIP = -2                # a routed slot of a padding row: no expert (see `route`'s `valid`)

if triton is not None:
    from stage_worker.kernels.common import pdl_wait
    from stage_worker.kernels.split_reduce import last_of

    _KEY_MIN = tl.constexpr(-(2 ** 63))
    _KEY32_MIN = tl.constexpr(-(2 ** 31))
    SKIP_ID = tl.constexpr(SKIP)

    @triton.jit
    def claim_spare(e, claim_ptr, spare_ptr, NC: tl.constexpr):
        """Moves on read with NC claims a step: the spare slot the rows of slot(s) e go into, spare_ptr[j] where
        claim_ptr[j] == e (claims are distinct: one j at most; an entry -1 or with spare -1 matches nothing), else
        -1. e a scalar or a vector (the INT4 down kernel's columns)."""
        sp = e.to(tl.int64) * 0 - 1
        for j in tl.static_range(NC):
            cj = tl.load(claim_ptr + j).to(tl.int64)
            sj = tl.load(spare_ptr + j)
            sp = tl.where((e == cj) & (cj >= 0) & (sj >= 0), sj, sp)
        return sp

    @triton.jit
    def expert_rows(e, w_ptr, shared_ptr, host_ptr, stride_we, FIRST_HOST):
        """Where slot e's rows start: the host table's from FIRST_HOST on (`HostRows`), the shared expert's for
        id -1, else the device table's. The MoE decode and prefill kernels all take their expert this way."""
        if e >= FIRST_HOST:
            base = host_ptr + (e - FIRST_HOST) * stride_we
        elif e >= 0:
            base = w_ptr + e * stride_we
        else:
            base = shared_ptr
        return base

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr, valid_ptr, map_ptr, E, stride_t,
                      FIRST_HOST, TOP_K: tl.constexpr, SHARED: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, COUNT: tl.constexpr, VALID: tl.constexpr,
                      SLOT_MAP: tl.constexpr = False, PDL: tl.constexpr = False, claim_ptr=None, thr_ptr=None,
                      CLAIM: tl.constexpr = False, spare_ptr=None, NC: tl.constexpr = 1,
                      KEY32: tl.constexpr = False, pf_slot_ptr=None, pf_ready_ptr=None, pf_hits_ptr=None,
                      PF_FIRST=0, PF: tl.constexpr = 0, BLOCK_P: tl.constexpr = 1):
        """A program a token row (`_route_row`). PDL (kernel flag `pdl`): launched as a programmatic dependent, it
        waits first thing (`common.pdl_wait`: it reads only what earlier kernels wrote)."""
        pdl_wait(PDL)
        _route_row(tl.program_id(0).to(tl.int64), logits_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr,
                   valid_ptr, map_ptr, E, stride_t, FIRST_HOST, TOP_K, SHARED, RENORM, BLOCK_E, BLOCK_K, COUNT,
                   VALID, SLOT_MAP, claim_ptr, thr_ptr, CLAIM, spare_ptr, NC, False, KEY32, pf_slot_ptr,
                   pf_ready_ptr, pf_hits_ptr, PF_FIRST, PF, BLOCK_P)

    @triton.jit
    def _route_row(t, logits_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr, valid_ptr, map_ptr, E, stride_t,
                   FIRST_HOST, TOP_K: tl.constexpr, SHARED: tl.constexpr, RENORM: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, COUNT: tl.constexpr, VALID: tl.constexpr,
                   SLOT_MAP: tl.constexpr, claim_ptr, thr_ptr, CLAIM: tl.constexpr, spare_ptr, NC: tl.constexpr,
                   CG: tl.constexpr, KEY32: tl.constexpr, pf_slot_ptr=None, pf_ready_ptr=None, pf_hits_ptr=None,
                   PF_FIRST=0, PF: tl.constexpr = 0, BLOCK_P: tl.constexpr = 1):
        """One token row: fp32 softmax statistics and top-k by repeated max over (logit bits, E-1-id) keys; with
        SHARED, column E is the shared expert's gate logit: slot TOP_K gets sigmoid of it (rounded to the logits'
        dtype, as `torch.sigmoid` on them would) and id -1. With COUNT, +1 to each selected slot's count and the
        number of selected slots >= FIRST_HOST to the host-read counter (adds of 1: the order does not matter).
        With VALID, rows from valid_ptr[0] on (a CUDA graph's padding) select no routed expert: ids SKIP, weight
        0, nothing counted; the expert kernels skip those slots, so padding reads no expert rows. With SLOT_MAP,
        each selected router index i becomes the slot map_ptr[i] before it is stored and counted (an expert
        table's slot map: router index -> the slot holding that expert now). CLAIM (with COUNT, `expert_move_async`):
        this token's best-ranked selected host slot whose count, after its own add, exceeds thr_ptr[0] is written
        to claim_ptr[0] if that still holds -1 (one compare-and-swap: the first token wins). NC > 1 claims
        (`expert_move_claims`): each of the token's selected host slots past the threshold, best first, is tried
        against entries j = 0..NC-1 whose spare spare_ptr[j] is a slot (>= 0) with a compare-and-swap, stopping at
        the entry it takes or finds already holding it: entries are never cleared within a step, so the step's
        claims are distinct, up to NC of them.
        CG: the logits are loaded past the SM's L1 (other programs of the launch wrote them). KEY32 (bf16 logits,
        E <= 65536: `_key32`): the keys are int32, the value's order in the high half and E-1-id in the low (the
        fp32 of a bf16 has its low 16 bits zero): the same selection as the int64 keys, and each of the
        ten block-wide max reductions moves half the bits (the router kernel cost more than cuBLAS's GEMV of
        the router's 2.6 MB: 4.4 against 3.67 us on the H100, h100-33).
        PF > 0 (`expert_prefetch`, `kernels/expert_prefetch.py`): the PF prefetch slots of this layer's table, slot
        PF_FIRST + p holding host slot pf_slot_ptr[p] once pf_ready_ptr[p] != 0 (read with acquire: the copy
        kernel on another stream released it after its rows); a selected host slot found there is stored as that
        device slot, so the expert kernels read it from VRAM. It is still counted as its own slot (the moves'
        statistics), but neither as a host read nor as a claim (its rows are not read over PCIe); pf_hits_ptr
        counts the redirections."""
        if PF:          # first: the flags' load overlaps the top-k below
            pp = tl.arange(0, BLOCK_P)
            pf_ok = tl.atomic_add(pf_ready_ptr + pp, tl.zeros([BLOCK_P], tl.int32), mask=pp < PF, sem="acquire")
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        if CG:      # written by the other programs of this launch (`_router_route_kernel`): past the SM's L1
            logit = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
        else:
            logit = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf"))
        logit = logit.to(tl.float32)
        logit = tl.where(logit == 0.0, 0.0, logit)              # -0.0 == +0.0 must give equal keys
        bits = logit.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int order == float order
        kk = tl.arange(0, BLOCK_K)
        top_logit = tl.full([BLOCK_K], float("-inf"), tl.float32)
        top_id = tl.zeros([BLOCK_K], tl.int32)
        if KEY32:
            key32 = (ordered & -65536) | (E - 1 - offs)        # (a negative's low half is 0xFFFF: cleared)
            key32 = tl.where(valid, key32, _KEY32_MIN)
            for j in tl.static_range(TOP_K):
                best = tl.max(key32, axis=0)
                idx = E - 1 - (best & 0xFFFF)
                hi = best & -65536
                val = tl.where(hi < 0, (hi ^ 0x7FFFFFFF) & -65536, hi).to(tl.float32, bitcast=True)
                top_logit = tl.where(kk == j, val, top_logit)
                top_id = tl.where(kk == j, idx, top_id)
                key32 = tl.where(offs == idx, _KEY32_MIN, key32)
        else:
            key = (ordered.to(tl.int64) << 32) | (E - 1 - offs).to(tl.int64)
            key = tl.where(valid, key, _KEY_MIN)
            for j in tl.static_range(TOP_K):
                best = tl.max(key, axis=0)
                idx = E - 1 - best.to(tl.int32)                   # truncation keeps the low word: E-1-id
                hi = (best >> 32).to(tl.int32)
                val = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)
                top_logit = tl.where(kk == j, val, top_logit)
                top_id = tl.where(kk == j, idx, top_id)
                key = tl.where(offs == idx, _KEY_MIN, key)

        row_max = tl.max(logit, axis=0)
        p = tl.exp(top_logit - row_max)                         # lanes >= TOP_K: exp(-inf) = 0
        if RENORM:
            denom = tl.sum(p, axis=0)                           # the full softmax denominator cancels
        else:
            denom = tl.sum(tl.where(valid, tl.exp(logit - row_max), 0.0), axis=0)
        out = t * (TOP_K + SHARED) + kk
        w = p / denom
        picked = kk < TOP_K
        if SLOT_MAP:
            top_id = tl.load(map_ptr + top_id, mask=picked, other=0)
        if VALID:
            real = t < tl.load(valid_ptr)
            top_id = tl.where(real, top_id, SKIP_ID)
            w = tl.where(real, w, 0.0)
            picked = picked & real
        tl.store(weights_ptr + out, w, mask=kk < TOP_K)
        if PF:
            pf_s = tl.load(pf_slot_ptr + pp, mask=pp < PF, other=-1)
            pf_s = tl.where((pf_ok != 0) & (pp < PF), pf_s, -1)
            match = (top_id[:, None] == pf_s[None, :]) & (pf_s[None, :] >= FIRST_HOST)
            which = tl.min(tl.where(match, pp[None, :], BLOCK_P), axis=1)
            pf_hit = picked & (which < BLOCK_P)
            tl.store(ids_ptr + out, tl.where(pf_hit, PF_FIRST + which, top_id), mask=kk < TOP_K)
            tl.atomic_add(pf_hits_ptr, tl.sum(tl.where(pf_hit, 1, 0), axis=0).to(tl.int64))
        else:
            pf_hit = kk < 0
            tl.store(ids_ptr + out, top_id, mask=kk < TOP_K)
        if COUNT:
            before = tl.atomic_add(counts_ptr + top_id, tl.full([BLOCK_K], 1.0, tl.float32), mask=picked)
            on_host = picked & (top_id >= FIRST_HOST) & ~pf_hit
            host = tl.sum(tl.where(on_host, 1, 0), axis=0)
            tl.atomic_add(reads_ptr, host.to(tl.int64))
            if CLAIM:
                over = on_host & (before + 1.0 > tl.load(thr_ptr))
                if NC == 1:
                    first = tl.min(tl.where(over, kk, BLOCK_K), axis=0)
                    if first < BLOCK_K:
                        tl.atomic_cas(claim_ptr, -1, tl.sum(tl.where(kk == first, top_id, 0), axis=0))
                else:
                    for r in tl.static_range(TOP_K):
                        if tl.sum(tl.where((kk == r) & over, 1, 0), axis=0) > 0:
                            cand = tl.sum(tl.where(kk == r, top_id, 0), axis=0)
                            placed = cand * 0                       # 1 once taken or found
                            for j in tl.static_range(NC):
                                go = (placed == 0) & (tl.load(spare_ptr + j) >= 0)
                                # an entry not tried compares with -3, which no entry holds: the swap is a no-op
                                old = tl.atomic_cas(claim_ptr + j, tl.where(go, -1, -3), cand)
                                placed = tl.where(go & ((old == -1) | (old == cand)), 1, placed)
        if SHARED:
            if CG:
                sl = tl.load(logits_ptr + t * stride_t + E, cache_modifier=".cg").to(tl.float32)
            else:
                sl = tl.load(logits_ptr + t * stride_t + E).to(tl.float32)
            sg = round_to(1.0 / (1.0 + tl.exp(-sl)), logits_ptr.dtype.element_ty)
            tl.store(weights_ptr + t * (TOP_K + SHARED) + TOP_K, sg)
            tl.store(ids_ptr + t * (TOP_K + SHARED) + TOP_K, -1)

    @triton.jit
    def router_logits(x_ptr, w_ptr, logits_ptr, rows, mask_r, w_first, R, stride_xt, stride_wr, H: tl.constexpr,
                      T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        """logits[t, rows] = x_t . W[rows] for all T tokens (fp32 sums, stored in the logits' dtype, rows R
        apart), the rows' first BLOCK_H columns already loaded (`w_first`). The router GEMV of the fused router
        launch and of the prefetch's prediction (`expert_prefetch._predict_kernel`)."""
        offs_h = tl.arange(0, BLOCK_H)
        offs_t = tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        acc = tl.zeros([BLOCK_R, BLOCK_T, BLOCK_H], tl.float32)
        for h0 in tl.static_range(0, H, BLOCK_H):
            mask_h = h0 + offs_h < H
            if h0 == 0:
                w = w_first.to(tl.float32)
            else:
                w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wr + h0 + offs_h[None, :],
                            mask=mask_r[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs_t[:, None] * stride_xt + h0 + offs_h[None, :],
                        mask=mask_t[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            acc += w[:, None, :] * x[None, :, :]
        logit = tl.sum(acc, axis=2)                                 # [BLOCK_R, BLOCK_T]
        tl.store(logits_ptr + offs_t[None, :] * R + rows[:, None], logit.to(logits_ptr.dtype.element_ty),
                 mask=mask_r[:, None] & mask_t[None, :])

    @triton.jit
    def _router_route_kernel(x_ptr, w_ptr, logits_ptr, lock_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr,
                             valid_ptr, map_ptr, E, stride_xt, stride_wr, FIRST_HOST, H: tl.constexpr,
                             T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                             TOP_K: tl.constexpr, SHARED: tl.constexpr, RENORM: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, COUNT: tl.constexpr,
                             VALID: tl.constexpr, SLOT_MAP: tl.constexpr, NPROG: tl.constexpr,
                             PDL: tl.constexpr = False,
                             claim_ptr=None, thr_ptr=None, CLAIM: tl.constexpr = False, spare_ptr=None,
                             NC: tl.constexpr = 1, KEY32: tl.constexpr = False, pf_slot_ptr=None,
                             pf_ready_ptr=None, pf_hits_ptr=None, PF_FIRST=0, PF: tl.constexpr = 0,
                             BLOCK_P: tl.constexpr = 1):
        """The router GEMV and `_route_row` in one launch (kernel flag `fused_router`): program p computes the
        logits of router rows p*BLOCK_R .. +BLOCK_R (E routed rows, then the shared gate's with SHARED) for all T
        tokens (fp32 sums, stored rounded to x's dtype as F.linear would give them), and the last program to finish
        (`split_reduce.last_of`) routes the T rows from them. Saves the cuBLAS GEMV's launch and the gap it leaves
        in a PDL chain (it is no programmatic dependent). The first BLOCK_H columns of the program's router rows
        load before `pdl_wait` (weights: no earlier kernel writes them), so they stream in while that kernel ends;
        with BLOCK_H >= H that is the whole row."""
        R = E + SHARED
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = rows < R
        offs_h = tl.arange(0, BLOCK_H)
        w_first = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wr + offs_h[None, :],
                          mask=mask_r[:, None] & (offs_h < H)[None, :], other=0.0)
        pdl_wait(PDL)
        router_logits(x_ptr, w_ptr, logits_ptr, rows, mask_r, w_first, R, stride_xt, stride_wr, H, T, BLOCK_T,
                      BLOCK_R, BLOCK_H)
        if last_of(lock_ptr, NPROG):
            for t in tl.static_range(T):
                _route_row(t, logits_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr, valid_ptr, map_ptr, E, R,
                           FIRST_HOST, TOP_K, SHARED, RENORM, BLOCK_E, BLOCK_K, COUNT, VALID, SLOT_MAP, claim_ptr,
                           thr_ptr, CLAIM, spare_ptr, NC, True, KEY32, pf_slot_ptr, pf_ready_ptr, pf_hits_ptr,
                           PF_FIRST, PF, BLOCK_P)

    @triton.jit
    def _moe_up_kernel(x_ptr, ids_ptr, w13_ptr, sw13_ptr, hw13_ptr, act_ptr, stride_xt, stride_we, stride_wr,
                       FIRST_HOST, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                       BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, scale_ptr=None, hscale_ptr=None,
                       NB_R: tl.constexpr = 1, NB_C: tl.constexpr = 1, BR: tl.constexpr = 1, BC: tl.constexpr = 1,
                       FP8: tl.constexpr = False, ROW_SCALE: tl.constexpr = False, claim_ptr=None,
                       spare_ptr=None, CLAIM: tl.constexpr = False, NC: tl.constexpr = 1):
        """act[t, j, i-block] = silu(Wg_e x_t) * (Wu_e x_t): reads BLOCK_I gate and up rows of expert ids[t, j]
        (id -1: the shared expert's rows; ids >= FIRST_HOST: the host table's rows). TOP_K counts every slot, the
        shared one included. FP8: the rows are float8_e4m3fn bytes (uint8), each weight converted and times its
        block's scale in registers (scale_ptr: float32 [E, 2, NB_R, NB_C], blocks BR x BC, gate's then up's; a
        host slot's scales at hscale_ptr, by the rows' FIRST_HOST rule); no shared slot then. ROW_SCALE (BC a multiple of BLOCK_H: a tile's columns lie in one column block):
        one scale a row, a [BLOCK_I] load a step, instead of a gathered scale per weight. CLAIM: if e is the
        claimed slot claim_ptr[0] (>= 0), the rows loaded are also stored, as loaded, at the same places of device
        slot spare_ptr[0]: the grid's programs together copy the whole w13 row block. FP8: the raw bytes, and the
        scales loaded into scale_ptr's row spare (every block of gate and up is loaded by some program, with
        ROW_SCALE too: the h loop meets every column block). NC > 1 claims: e's spare is the one of the claim
        entry holding e (`claim_spare`)."""
        tj = tl.program_id(0)
        t = tj // TOP_K
        e = tl.load(ids_ptr + tj).to(tl.int64)
        if e == SKIP_ID:
            return
        base = expert_rows(e, w13_ptr, sw13_ptr, hw13_ptr, stride_we, FIRST_HOST)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        gate_rows = base + offs_i[:, None].to(tl.int64) * stride_wr
        up_rows = gate_rows + I * stride_wr
        if CLAIM:
            if NC == 1:
                c = tl.load(claim_ptr)
                spare = tl.load(spare_ptr)
                hit = (e == c) & (c >= 0) & (spare >= 0)     # -1: no claim (also the shared expert's id), no spare
            else:
                spare = claim_spare(e, claim_ptr, spare_ptr, NC)
                hit = spare >= 0
            spare_gate = w13_ptr + spare * stride_we + offs_i[:, None].to(tl.int64) * stride_wr
            if FP8:
                spare_sb = scale_ptr + spare * (2 * NB_R * NB_C)
        acc_g = tl.zeros([BLOCK_I, BLOCK_H], tl.float32)    # 2-D: FMAs in the loop, one reduction at the end
        acc_u = tl.zeros([BLOCK_I, BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < H
            xv = tl.load(x_ptr + t * stride_xt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            m = mask_i[:, None] & mask_h[None, :]
            if FP8:
                sb = expert_rows(e, scale_ptr, scale_ptr, hscale_ptr, 2 * NB_R * NB_C, FIRST_HOST)
                wg = tl.load(gate_rows + offs_h[None, :], mask=m, other=0)
                wu = tl.load(up_rows + offs_h[None, :], mask=m, other=0)
                if ROW_SCALE:
                    sidx = (offs_i // BR) * NB_C + h0 // BC
                    sm = mask_i
                else:
                    sidx = (offs_i // BR)[:, None] * NB_C + (offs_h // BC)[None, :]
                    sm = m
                sg = tl.load(sb + sidx, mask=sm, other=0.0)
                su = tl.load(sb + NB_R * NB_C + sidx, mask=sm, other=0.0)
                if CLAIM:
                    if hit:         # the bytes before their bitcast, the scales as loaded
                        tl.store(spare_gate + offs_h[None, :], wg, mask=m)
                        tl.store(spare_gate + I * stride_wr + offs_h[None, :], wu, mask=m)
                        tl.store(spare_sb + sidx, sg, mask=sm)
                        tl.store(spare_sb + NB_R * NB_C + sidx, su, mask=sm)
                if ROW_SCALE:
                    sg = sg[:, None]
                    su = su[:, None]
                wg = wg.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sg
                wu = wu.to(tl.float8e4nv, bitcast=True).to(tl.float32) * su
            else:
                wg = tl.load(gate_rows + offs_h[None, :], mask=m, other=0.0)
                wu = tl.load(up_rows + offs_h[None, :], mask=m, other=0.0)
                if CLAIM:
                    if hit:
                        tl.store(spare_gate + offs_h[None, :], wg, mask=m)
                        tl.store(spare_gate + I * stride_wr + offs_h[None, :], wu, mask=m)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g += wg * xv[None, :]
            acc_u += wu * xv[None, :]
        g = tl.sum(acc_g, axis=1)
        act = g * tl.sigmoid(g) * tl.sum(acc_u, axis=1)
        tl.store(act_ptr + tj * I + offs_i, act, mask=mask_i)

    @triton.jit
    def _moe_down_kernel(act_ptr, ids_ptr, wts_ptr, w2_ptr, sw2_ptr, hw2_ptr, out_ptr, stride_we, stride_wh,
                         stride_ot, FIRST_HOST, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, scale_ptr=None, hscale_ptr=None,
                         NB_R: tl.constexpr = 1, NB_C: tl.constexpr = 1, BR: tl.constexpr = 1, BC: tl.constexpr = 1,
                         FP8: tl.constexpr = False, ROW_SCALE: tl.constexpr = False, add_ptr=None,
                         ADD: tl.constexpr = False, claim_ptr=None, spare_ptr=None, CLAIM: tl.constexpr = False,
                         NC: tl.constexpr = 1):
        """out[t, h-block] = sum_j w[t, j] * W2_e[h-block] act[t, j]: k experts summed in order, in fp32. FP8: as
        in `_moe_up_kernel`, scales float32 [E, NB_R, NB_C] (a host slot's at hscale_ptr; ROW_SCALE: BC a multiple of BLOCK_I), and the router
        weights rounded to the output's dtype first (as the CPU path uses them). ADD: + add_ptr's row (the shared
        expert's output, rows of stride_ot) before the one rounding to the output dtype. CLAIM: as in
        `_moe_up_kernel`, the claimed slot's rows h-block (all I columns) also stored into device slot
        spare_ptr[0] (FP8: the raw bytes and the scales loaded, into scale_ptr's row spare): the programs of a
        token together copy the whole w2 and all its scale blocks. NC > 1 claims: each selected slot's spare is
        looked up among the entries (`claim_spare`), its spare rows addressed per slot."""
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        if CLAIM and NC == 1:
            c = tl.load(claim_ptr)
            spare = tl.load(spare_ptr)
            claimed = (c >= 0) & (spare >= 0)           # -1: no claim (also the shared expert's id), no spare
            spare_rows = w2_ptr + spare * stride_we + offs_h[:, None].to(tl.int64) * stride_wh
            if FP8:
                spare_sb = scale_ptr + spare * (NB_R * NB_C)
        acc = tl.zeros([BLOCK_H, BLOCK_I], tl.float32)       # 2-D: FMAs in the loops, one reduction at the end
        for j in range(TOP_K):
            tj = t * TOP_K + j
            e = tl.load(ids_ptr + tj).to(tl.int64)
            wt = tl.load(wts_ptr + tj).to(tl.float32)
            if FP8:
                wt = round_to(wt, out_ptr.dtype.element_ty)
            if e != SKIP_ID:
                base = expert_rows(e, w2_ptr, sw2_ptr, hw2_ptr, stride_we, FIRST_HOST)
                rows = base + offs_h[:, None].to(tl.int64) * stride_wh
                if CLAIM:
                    if NC == 1:
                        hit = (e == c) & claimed
                    else:
                        spare = claim_spare(e, claim_ptr, spare_ptr, NC)
                        hit = spare >= 0
                        spare_rows = w2_ptr + spare * stride_we + offs_h[:, None].to(tl.int64) * stride_wh
                        if FP8:
                            spare_sb = scale_ptr + spare * (NB_R * NB_C)
                if FP8:
                    sb = expert_rows(e, scale_ptr, scale_ptr, hscale_ptr, NB_R * NB_C, FIRST_HOST)
                for i0 in range(0, I, BLOCK_I):
                    offs_i = i0 + tl.arange(0, BLOCK_I)
                    mask_i = offs_i < I
                    a = tl.load(act_ptr + tj * I + offs_i, mask=mask_i, other=0.0)
                    m = mask_h[:, None] & mask_i[None, :]
                    if FP8:
                        w = tl.load(rows + offs_i[None, :], mask=m, other=0)
                        if ROW_SCALE:
                            sidx = (offs_h // BR) * NB_C + i0 // BC
                            sm = mask_h
                        else:
                            sidx = (offs_h // BR)[:, None] * NB_C + (offs_i // BC)[None, :]
                            sm = m
                        sc = tl.load(sb + sidx, mask=sm, other=0.0)
                        if CLAIM:       # predicates as below: the bytes before their bitcast, the scales
                            tl.store(spare_rows + offs_i[None, :], w, mask=m & hit)
                            tl.store(spare_sb + sidx, sc, mask=sm & hit)
                        if ROW_SCALE:
                            sc = sc[:, None]
                        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
                    else:
                        w = tl.load(rows + offs_i[None, :], mask=m, other=0.0)
                        if CLAIM:       # a predicate, not a branch: one in this loop stops its unrolling
                            tl.store(spare_rows + offs_i[None, :], w, mask=m & hit)
                    acc += w.to(tl.float32) * (wt * a)[None, :]
        out = tl.sum(acc, axis=1)
        if ADD:
            out += tl.load(add_ptr + t * stride_ot + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_ot + offs_h, out.to(out_ptr.dtype.element_ty), mask=mask_h)


def _check_slot_map(slot_map: torch.Tensor | None, E: int) -> None:
    if slot_map is not None and (slot_map.shape != (E,) or slot_map.dtype != torch.int32):
        raise ValueError(f"slot_map {tuple(slot_map.shape)} {slot_map.dtype} for {E} router rows: int32 [E]")


def _kernel_counts(counts: RouteCounts | None, weights: torch.Tensor, ids: torch.Tensor,
                   E: int) -> tuple[RouteCounts, int]:
    """The RouteCounts the router kernels take (stand-in pointers when not counting) and its claims a step."""
    c = counts or RouteCounts(weights, ids, E)
    nc = 1 if c.claim is None else c.claim.numel()
    if nc > 1 and (c.spare is None or c.spare.numel() != nc):
        raise ValueError(f"{nc} claims need as many spares (RouteCounts.spare)")
    return c, nc


def _prefetch_args(c: RouteCounts) -> dict:
    """The router kernels' prefetch arguments (`_route_row`'s PF): none, or this layer's prefetch slots
    (`RouteCounts.prefetch`, `kernels/expert_prefetch_ref.Prefetch`)."""
    pf = c.prefetch
    if pf is None:
        return {}
    n = pf.slot.numel()
    return dict(pf_slot_ptr=pf.slot, pf_ready_ptr=pf.ready, pf_hits_ptr=pf.hits, PF_FIRST=pf.first, PF=n,
                BLOCK_P=_pow2(n))


def _key32(logits: torch.Tensor, experts: int) -> bool:
    """Whether `_route_row` ranks with int32 keys: kernel flag `route_key32`, bf16 logits (their fp32 has its low
    16 bits zero; an fp16's has only 13), ids in 16 bits. Otherwise the int64 keys (the same selection either way)."""
    return logits.dtype == torch.bfloat16 and experts <= 1 << 16 and route_key32_enabled()


def route(logits: torch.Tensor, top_k: int, renormalise: bool, shared: bool = False,
          counts: RouteCounts | None = None, valid: torch.Tensor | None = None,
          slot_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32), best first, ties to the lower id; = route_ref.

    With `shared` the last column is the shared expert's gate logit: the result has k + 1 slots, the last one
    (sigmoid of that logit, id -1) for the shared expert. With `counts`, the selections are added to it. With
    `valid` (int32 [1] on the device: a CUDA graph's real rows), rows from valid[0] on get id SKIP and weight 0 in
    their routed slots (the kernel path only). With `slot_map` (int32 [E] on the device: an expert table's router
    index -> slot), the ids returned and counted are slots: slot_map[router index]. A `counts` with a claim
    (`RouteCounts.claim`) also claims a host slot for a move on read (`expert_move_async`)."""
    T, E = logits.shape
    E -= int(shared)
    _check_slot_map(slot_map, E)
    if not triton_usable(logits) or E > MAX_EXPERTS:
        w, ids = route_ref(logits[:, :E], top_k, renormalise)
        if slot_map is not None:
            ids = slot_map[ids.long()]
        if counts is not None:
            count_ref(ids, counts)
        if shared:
            w = torch.cat([w, shared_gate_ref(logits[:, E:]).float()], dim=1)
            ids = torch.cat([ids, torch.full_like(ids[:, :1], -1)], dim=1)
        return w, ids
    if not 0 < top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..{E}")
    slots = top_k + int(shared)
    weights = torch.empty(T, slots, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, slots, dtype=torch.int32, device=logits.device)
    if T:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        c, nc = _kernel_counts(counts, weights, ids, E)
        pdl = pdl_usable(logits)
        _route_kernel[(T,)](logits, weights, ids, c.counts, c.host_reads, ids if valid is None else valid,
                            ids if slot_map is None else slot_map, E, logits.stride(0), c.first, TOP_K=top_k,
                            SHARED=int(shared), RENORM=bool(renormalise), BLOCK_E=_pow2(E), BLOCK_K=_pow2(top_k),
                            COUNT=counts is not None, VALID=valid is not None, SLOT_MAP=slot_map is not None,
                            num_warps=NUM_WARPS, PDL=pdl, launch_pdl=pdl, claim_ptr=c.claim, thr_ptr=c.threshold,
                            CLAIM=c.claim is not None, NC=nc, spare_ptr=c.spare if nc > 1 else None,
                            KEY32=_key32(logits, E), **_prefetch_args(c))
    return weights, ids


# `router_route`'s fused launch: up to this many tokens (its last program routes them one after another), router
# rows a program, hidden columns a load. h100-33 (`bench/tune_kernels.py --only fused_router --rows 1,4`, the full
# shape's 513 x 2560 rows from HBM): one row a program (513 programs), 1024 columns a load, 4 warps: 7.36 us at one
# token (the best, (1, 1024, 1), 7.25) and the best at four, 17.12 us; the previous (4, 512, 4) took 8.48 / 19.5 us.
# cuBLAS's GEMV plus the router kernel, which the flag replaces: 8.08 / 14.42 us.
FUSED_ROUTER_MAX_T = 4
FUSED_ROUTER_CFG = (1, 1024, 4)                                    # BLOCK_R, BLOCK_H, warps
_router_locks: dict[torch.device, torch.Tensor] = {}


def router_lock(device: torch.device) -> torch.Tensor:
    """The counter the fused router launch counts its programs in (one per device; each launch leaves it at 0). Its
    own, not `split_reduce.split_locks`: the side stream's split GEMVs may run beside it. One counter serves every
    layer because fused router launches on a device never overlap: each runs on the forward's stream, in layer
    order (a second stream routing at the same time would need its own). Make it before a graph capture
    (SparseMoE.prepare_kernels)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _router_locks:
        _router_locks[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _router_locks[device]


def router_route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool, shared: bool = False,
                 counts: RouteCounts | None = None, valid: torch.Tensor | None = None,
                 slot_map: torch.Tensor | None = None, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(F.linear(x, router), ...)`. With `fused` (kernel flag `fused_router`), on CUDA at up to
    FUSED_ROUTER_MAX_T tokens, one launch (`_router_route_kernel`) computes the logits (fp32 sums rounded to x's
    dtype: the same values up to cuBLAS's order of summation) and routes them."""
    T, H = x.shape
    R = router.shape[0]
    E = R - int(shared)
    if not (fused and triton_usable(x) and 0 < T <= FUSED_ROUTER_MAX_T and E <= MAX_EXPERTS and 0 < top_k <= E
            and router.dtype == x.dtype and router.stride(-1) == 1 and x.stride(-1) == 1):
        return route(F.linear(x, router), top_k, renormalise, shared=shared, counts=counts, valid=valid,
                     slot_map=slot_map)
    _check_slot_map(slot_map, E)
    slots = top_k + int(shared)
    logits = torch.empty(T, R, dtype=x.dtype, device=x.device)
    weights = torch.empty(T, slots, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, slots, dtype=torch.int32, device=x.device)
    c, nc = _kernel_counts(counts, weights, ids, E)
    br, bh, warps = FUSED_ROUTER_CFG
    bh = min(bh, _pow2(H))
    nprog = -(-R // br)
    pdl = pdl_usable(x)
    _router_route_kernel[(nprog,)](
        x, router, logits, router_lock(x.device), weights, ids, c.counts, c.host_reads,
        ids if valid is None else valid, ids if slot_map is None else slot_map, E, x.stride(0), router.stride(0),
        c.first, H=H, T=T, BLOCK_T=_pow2(T), BLOCK_R=br, BLOCK_H=bh, TOP_K=top_k, SHARED=int(shared),
        RENORM=bool(renormalise), BLOCK_E=_pow2(E), BLOCK_K=_pow2(top_k), COUNT=counts is not None,
        VALID=valid is not None, SLOT_MAP=slot_map is not None, NPROG=nprog, PDL=pdl, launch_pdl=pdl,
        claim_ptr=c.claim, thr_ptr=c.threshold, CLAIM=c.claim is not None, NC=nc,
        spare_ptr=c.spare if nc > 1 else None, KEY32=_key32(logits, E), num_warps=warps, **_prefetch_args(c))
    return weights, ids


def grouped_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, shared: SharedExpert | None = None, kernel: bool = False,
                host: HostRows | None = None) -> torch.Tensor:
    """Prefill path: (token, slot) pairs sorted by expert, two GEMMs per present expert, a fixed-order combine.

    With `kernel`, the two grouped GEMM launches of `moe_prefill.py`; otherwise a Python loop over the present
    experts with one host sync (the per-expert counts), which copies each present host expert to the device once.
    Deterministic either way (no atomics). With `shared`, the last slot (id -1) is the shared expert: one GEMM
    pair over every token.
    """
    if shared is not None:
        k = ids.shape[1] - 1
        g, u = F.linear(x, shared.w13).float().chunk(2, dim=-1)
        shared_down = F.linear((F.silu(g) * u).to(x.dtype), shared.w2)
        routed = grouped_moe(x, ids[:, :k], weights[:, :k], w13, w2, kernel=kernel, host=host)
        both = torch.stack([routed, shared_down], dim=1)                      # [T, 2, H]
        ones = torch.ones_like(weights[:, :1])
        return torch.bmm(torch.cat([ones, weights[:, k:]], dim=1).to(x.dtype).unsqueeze(1), both).squeeze(1)
    if kernel:
        from stage_worker.kernels.moe_prefill import grouped_moe_triton

        return grouped_moe_triton(x, ids, weights, w13, w2, host)
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    slots = w13.shape[0] + (host.w13.shape[0] if host is not None else 0)
    counts = torch.bincount(flat, minlength=slots).tolist()   # host sync: acceptable for prefill only
    down = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        if host is not None and e >= host.first:
            up_w, down_w = (t.to(x.device, non_blocking=True) for t in (host.w13[e - host.first],
                                                                         host.w2[e - host.first]))
        else:
            up_w, down_w = w13[e], w2[e]
        g, u = F.linear(x[pairs // k], up_w).float().chunk(2, dim=-1)
        down[pairs] = F.linear((F.silu(g) * u).to(x.dtype), down_w)
    return torch.bmm(weights.to(x.dtype).unsqueeze(1), down.view(T, k, -1)).squeeze(1)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, shared: SharedExpert | None = None, prefill_kernel: bool = True,
              host: HostRows | None = None,
              claim: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, k], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in x.dtype; = fused_moe_ref.

    Decode (T*k <= DECODE_MAX_TK, Triton usable): two launches, no host sync. Otherwise `grouped_moe` (its grouped
    GEMM kernels with `prefill_kernel` and Triton). With `shared`, slot k (id -1) is the shared expert (see
    `route`). With `host`, ids >= host.first are rows of the host table (w13 then holds the first host.first).
    With `claim` = (claimed slot int32 [1], spare int64 [1]), both on the device: if some id is the claimed slot
    (>= 0; -1: none), its w13 and w2 rows end up copied, bit for bit, into device slot spare (a free one) as well:
    the kernels store the rows they read anyway (a move with no PCIe copy of its own), the other paths copy them
    (`copy_claimed`). The output does not change. bf16/fp16/fp32 tables only (float8 ones: `fused_moe_fp8`).
    """
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w13.shape
    I = two_i // 2
    if w13.shape != (E, 2 * I, H) or w2.shape != (E, H, I) or weights.shape != ids.shape or ids.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)} ids {tuple(ids.shape)} weights {tuple(weights.shape)} "
                         f"w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}")
    if host is not None and (host.first != E or host.w13.shape[1:] != w13.shape[1:] or
                             host.w2.shape[1:] != w2.shape[1:] or host.w13.stride() != w13.stride() or
                             host.w2.stride() != w2.stride()):
        raise ValueError(f"host rows w13 {tuple(host.w13.shape)} / w2 {tuple(host.w2.shape)} from slot {host.first} "
                         f"do not continue the device table w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}")
    if shared is not None and (tuple(shared.w13.shape) != (2 * I, H) or tuple(shared.w2.shape) != (H, I)):
        raise ValueError(f"shared expert w13 {tuple(shared.w13.shape)} / w2 {tuple(shared.w2.shape)} do not match "
                         f"the routed experts' [{2 * I}, {H}] / [{H}, {I}]")
    check_claim(claim, w13.device)
    if claim is not None and (not w13.is_floating_point() or w13.element_size() == 1):
        raise ValueError(f"a claim needs a bf16/fp16/fp32 table (float8 experts claim through fused_moe_fp8), "
                         f"not {w13.dtype}")
    if T * k > DECODE_MAX_TK or not triton_usable(x):
        if claim is not None:
            copy_claimed(claim, ids, E, [(w13, None if host is None else host.w13),
                                         (w2, None if host is None else host.w2)])
        return grouped_moe(x, ids, weights, w13, w2, shared, kernel=prefill_kernel and triton_usable(x), host=host)
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13 and w2 need a contiguous last dimension")   # never copy the expert tables
    sw13, sw2 = (w13, w2) if shared is None else (shared.w13, shared.w2)
    if shared is not None and (sw13.stride() != w13.stride()[1:] or sw2.stride() != w2.stride()[1:]):
        raise ValueError("the shared expert's weights need the routed experts' row strides")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    x, ids, weights, act = decode_operands(x, ids, weights, I)
    bi, bh, up_warps = UP_CFG[_bucket(T)]
    bi, bh = min(bi, _pow2(I)), min(bh, _pow2(H))
    hw13, hw2, first = (w13, w2, E) if host is None else (host.w13, host.w2, host.first)
    claim_ptr, spare_ptr = (None, None) if claim is None else claim
    nc = 1 if claim is None else claim[0].numel()
    _moe_up_kernel[(T * k, triton.cdiv(I, bi))](x, ids, w13, sw13, hw13, act, x.stride(0), w13.stride(0),
                                               w13.stride(1), first, H=H, I=I, TOP_K=k, BLOCK_I=bi, BLOCK_H=bh,
                                               claim_ptr=claim_ptr, spare_ptr=spare_ptr, CLAIM=claim is not None,
                                               NC=nc,
                                               num_warps=up_warps)
    bh, bi, down_warps = DOWN_CFG[_bucket(T)]
    bh, bi = min(bh, _pow2(H)), min(bi, _pow2(I))
    _moe_down_kernel[(T, triton.cdiv(H, bh))](act, ids, weights, w2, sw2, hw2, out, w2.stride(0), w2.stride(1),
                                             out.stride(0), first, H=H, I=I, TOP_K=k, BLOCK_H=bh, BLOCK_I=bi,
                                             claim_ptr=claim_ptr, spare_ptr=spare_ptr, CLAIM=claim is not None,
                                             NC=nc,
                                             num_warps=down_warps)
    return out


def check_claim(claim: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device) -> None:
    """The decode launches' `claim`: C claimed slots and C spares (C >= 1, `expert_move_claims`; entry j's rows go
    into spare j), contiguous, on the table's device."""
    if claim is not None and (claim[0].numel() != claim[1].numel() or not claim[0].numel() or any(
            c.device != device or not c.is_contiguous() for c in claim)):
        raise ValueError("a claim is C slots and C spares, contiguous, on the table's device")


def part_pairs(experts, host) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(device part, host part or None) of packed experts (INT4 `PackedExperts`, float8 `Fp8Experts`: q13, s13, q2,
    s2), as `copy_claimed` takes them."""
    return [(getattr(experts, n), None if host is None else getattr(host, n)) for n in ("q13", "s13", "q2", "s2")]


def copy_claimed(claim: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, first: int,
                 tables: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """A claim (see `fused_moe`) where the decode kernels do not run, so every path leaves the same tables: if
    claim[0] >= 0 is among ids, its row of each (device table, host table from slot `first`) pair is copied into
    the device table's row spare[0] (-1: no spare, nothing). Reads the claim on the host: these paths sync anyway."""
    for slot, spare in zip(*(c.reshape(-1).tolist() for c in claim)):     # C entries (C claims a step)
        if slot < 0 or spare < 0 or not bool((ids == slot).any()):
            continue
        for dev, hst in tables:
            dev[spare].copy_(dev[slot] if slot < first else hst[slot - first])


def decode_operands(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    inter: int) -> tuple[torch.Tensor, ...]:
    """What the two-phase decode kernels (bf16 here, INT4 in moe_int4.py) take: contiguous x, int32 ids and
    weights, and the fp32 activations [T, k, inter] between the phases."""
    return (x.contiguous(), ids.to(torch.int32).contiguous(), weights.contiguous(),
            torch.empty(*ids.shape, inter, dtype=torch.float32, device=x.device))


def moe_forward(x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                renormalise: bool, shared: SharedExpert | None = None, prefill_kernel: bool = True,
                host: HostRows | None = None, counts: RouteCounts | None = None,
                valid: torch.Tensor | None = None, slot_map: torch.Tensor | None = None,
                claim: tuple[torch.Tensor, torch.Tensor] | None = None,
                fused_router: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer: x [..., H] -> (out [..., H], routed ids [..., k] int32). Without `shared` only the routed
    experts (the shared expert is the caller's); with it `gate_weight` is [E + 1, H], its last row the shared
    expert's gate. Router weights are cast to x.dtype before the combine, as SparseMoE does. No
    `.item()`/`.tolist()` on the decode path (Triton usable and T*k <= DECODE_MAX_TK). `host`: slots in host RAM;
    `counts`: where the router counts its selections; `valid`: a CUDA graph's real rows; `slot_map`: router index
    -> slot; `claim`: (claim, spare) of moves on read (see `fused_moe`, `route`); `fused_router`: the router
    GEMV and top-k in one launch (`router_route`).
    """
    x2 = x.reshape(-1, x.shape[-1])
    weights, ids = router_route(x2, gate_weight, top_k, renormalise, shared=shared is not None, counts=counts,
                                valid=valid if x2.shape[0] * top_k <= DECODE_MAX_TK else None, slot_map=slot_map,
                                fused=fused_router)
    out = fused_moe(x2, ids, weights.to(x.dtype), w13, w2, shared, prefill_kernel, host, claim=claim)
    return out.view(x.shape), ids[:, :top_k].reshape(*x.shape[:-1], top_k)


def grouped_moe_fp8(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Fp8Experts,
                    host: Fp8Experts | None = None, first_host: int | None = None,
                    expert_of_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill and CPU path of float8 experts (issue 17): each present expert dequantized once (float32 products,
    then x.dtype) and two GEMMs over its tokens, in expert order, as `moe_int4.grouped_moe_int4` and SparseMoE's CPU
    loop sum (one host sync: the present experts). Slots with id < 0 are skipped.

    An expert table (cold experts, issue 16): slots from `first_host` on are `host`'s rows (pinned host memory),
    each present one's bytes and scales copied to x's device once a call; with `expert_of_slot` the present slots
    are taken in the order of the experts they hold, so the sums are those of the model without a table."""
    out = torch.zeros_like(x)
    flat = ids.long()
    slots = torch.unique(flat[flat >= 0])
    if expert_of_slot is not None:
        slots = slots[torch.argsort(expert_of_slot.to(slots.device).long()[slots])]
    first = experts.q13.shape[0] if host is None else first_host
    for s in slots.tolist():
        tok, j = torch.where(flat == s)
        src, row = (experts, s) if s < first else (host, s - first)
        q13, s13, q2, s2 = (t[row].to(x.device, non_blocking=True) for t in (src.q13, src.s13, src.q2, src.s2))
        w13 = dequantize_fp8_w13(q13, s13, experts.block).to(x.dtype)
        w2 = dequantize_fp8_block(q2, s2, experts.block).to(x.dtype)
        g, u = F.linear(x[tok], w13).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, w2) * weights[tok, j, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def fused_moe_fp8(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Fp8Experts,
                  add: torch.Tensor | None = None, host: Fp8Experts | None = None,
                  first_host: int | None = None,
                  claim: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, k] (routed slots only; SKIP for padding rows), float8 experts -> [T, H] in x.dtype
    (+ `add`, e.g. the shared expert's output); = fused_moe_fp8_ref.

    Decode (T*k <= DECODE_MAX_TK, Triton usable): the two bf16 decode kernels in FP8 mode (float8 bytes converted
    and scaled per block in registers, fp32 sums in a fixed order: deterministic), no host sync. Otherwise
    `grouped_moe_fp8` (the tensor-core prefill kernel for float8 experts is not written yet). The router weights are
    rounded to x.dtype first, as the CPU path uses them (in the down launch; `add` too is added there, before the
    output's one rounding). `host`: an expert table's slots from `first_host` (= the device slots' count) on, the
    same parts in (pinned) host memory: the kernels read a host slot's bytes and scales over UVA in the same
    launches (`expert_rows`), the loop copies them once a call. `claim`: as in `fused_moe` (moves on read), the
    claimed slot's q13, s13, q2 and s2 rows all end up in device slot spare: the kernels store the bytes and the
    block scales they load (the device scales must then be float32 and contiguous: stored in place), the loop
    copies them (`copy_claimed`)."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = experts.q13.shape
    I = two_i // 2
    br, bc = experts.block
    if experts.q13.shape != (E, 2 * I, H) or experts.q2.shape != (E, H, I) or weights.shape != ids.shape or \
            tuple(experts.s13.shape) != (E, 2, -(-I // br), -(-H // bc)) or \
            tuple(experts.s2.shape) != (E, -(-H // br), -(-I // bc)) or experts.q13.dtype != torch.uint8:
        raise ValueError(f"shapes: x {tuple(x.shape)} ids {tuple(ids.shape)} weights {tuple(weights.shape)} q13 "
                         f"{tuple(experts.q13.shape)} {experts.q13.dtype} s13 {tuple(experts.s13.shape)} q2 "
                         f"{tuple(experts.q2.shape)} s2 {tuple(experts.s2.shape)} blocks {experts.block}")
    if host is not None and (first_host != E or host.block != experts.block or any(
            a.shape[1:] != b.shape[1:] or a.dtype != b.dtype or not a.is_contiguous() or not b.is_contiguous()
            for a, b in zip((host.q13, host.s13, host.q2, host.s2),
                            (experts.q13, experts.s13, experts.q2, experts.s2)))):
        raise ValueError(f"host slots q13 {tuple(host.q13.shape)} s13 {tuple(host.s13.shape)} from slot {first_host} "
                         f"do not continue the device slots q13 {tuple(experts.q13.shape)} s13 "
                         f"{tuple(experts.s13.shape)} as contiguous rows of one layout")
    check_claim(claim, experts.q13.device)
    if T * k > DECODE_MAX_TK or not triton_usable(x):
        if claim is not None:
            copy_claimed(claim, ids, E, part_pairs(experts, host))
        out = grouped_moe_fp8(x, ids, weights.to(x.dtype), experts, host, first_host)
        return out if add is None else out + add
    q13, q2 = experts.q13, experts.q2
    s13, s2 = experts.s13.float().contiguous(), experts.s2.float().contiguous()
    if q13.stride(-1) != 1 or q2.stride(-1) != 1:
        raise ValueError("q13 and q2 need a contiguous last dimension")
    if claim is not None and (s13 is not experts.s13 or s2 is not experts.s2):
        raise ValueError(f"a claim stores the scales in place: float32 contiguous s13/s2, not {experts.s13.dtype}")
    h = experts if host is None else host      # the host table's pointers (unused without host slots)
    hs13, hs2, first = (s13, s2, E) if host is None else (host.s13, host.s2, first_host)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    if add is not None and (add.shape != (T, H) or add.stride() != out.stride()):
        raise ValueError(f"add {tuple(add.shape)} / {add.stride()} must be [T, H] like the output")
    x, ids, weights, act = decode_operands(x, ids, weights, I)
    claim_ptr, spare_ptr = (None, None) if claim is None else claim
    nc = 1 if claim is None else claim[0].numel()
    bi, bh, up_warps = UP_CFG[_bucket(T)]
    bi, bh = min(bi, _pow2(I)), min(bh, _pow2(H))
    _moe_up_kernel[(T * k, triton.cdiv(I, bi))](x, ids, q13, q13, h.q13, act, x.stride(0), q13.stride(0),
                                               q13.stride(1), first, H=H, I=I, TOP_K=k, BLOCK_I=bi, BLOCK_H=bh,
                                               scale_ptr=s13, hscale_ptr=hs13, NB_R=s13.shape[2], NB_C=s13.shape[3], BR=br, BC=bc,
                                               FP8=True, ROW_SCALE=bc % bh == 0, claim_ptr=claim_ptr,
                                               spare_ptr=spare_ptr, CLAIM=claim is not None, NC=nc,
                                               num_warps=up_warps)
    bh, bi, down_warps = DOWN_CFG[_bucket(T)]
    bh, bi = min(bh, _pow2(H)), min(bi, _pow2(I))
    _moe_down_kernel[(T, triton.cdiv(H, bh))](act, ids, weights, q2, q2, h.q2, out, q2.stride(0), q2.stride(1),
                                             out.stride(0), first, H=H, I=I, TOP_K=k, BLOCK_H=bh, BLOCK_I=bi,
                                             scale_ptr=s2, hscale_ptr=hs2, NB_R=s2.shape[1], NB_C=s2.shape[2], BR=br, BC=bc,
                                             FP8=True, ROW_SCALE=bc % bi == 0, add_ptr=add, ADD=add is not None,
                                             claim_ptr=claim_ptr, spare_ptr=spare_ptr, CLAIM=claim is not None,
                                             NC=nc,
                                             num_warps=down_warps)
    return out
