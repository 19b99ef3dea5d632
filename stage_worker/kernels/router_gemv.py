"""The router GEMV and the router in one launch (decode, 1-16 tokens): a MoE layer's first two launches made one.

Today a MoE decode layer starts with a cuBLAS GEMV for the router logits (and the shared expert's gate logit: the
[E + 1, H] tensor `SparseMoE.prepare_kernels` lays out) and then `moe.route`'s kernel over those logits: 4.1 + 3.9
us a layer at batch 1 on the H200 (bench/results/h200-17/call3/decode_mixed.log), both far longer than their bytes
(2.6 MB of router rows at the full shape) because a graphed decode step is bound by launches, not by HBM.

`router_route` does both in one launch, grid cdiv(N, BLOCK_N) over the weight's N = E (+ 1 with the shared column)
rows: each program reads BLOCK_N rows once for all T tokens (fp32 sums), stores its logits rounded to x's dtype
(where `F.linear` in that dtype rounds: the reference path's logits are bf16), and counts itself in on one counter
of `split_reduce.split_locks` (`split_reduce.last_of`: a barrier, then an acq_rel atomic; the counter goes back to 0
for the next launch and for CUDA-graph replays). The last program to finish sees every program's logits (read past
the SM's L1, `.cg`) and routes all T rows, ROUTE_ROWS rows at a time, with `moe.route_rows`: the same code as
`moe.route`'s kernel (top-k by repeated max over (logit bits, E-1-id) keys, softmax statistics, the shared slot's
sigmoid, COUNT and VALID), so both paths route the stored logits identically. The fp32 sums' order differs from
cuBLAS's, so the logits may differ from cuBLAS's by a rounding; routing the kernel's own logits with `moe.route`
gives the kernel's ids and weights exactly.

Behind `ROUTER_FUSED` (MOEPIPE_ROUTER_FUSED=1, read once at import), off until the H200 times it against the two
launches (tests/test_kernel_router_gemv.py's gpu test); `SparseMoE`'s INT4/FP8 decode call sites take it when it is
on and `fused_usable` says yes (Triton on the tensors, 1..FUSED_MAX_T tokens, the weight in x's dtype with
contiguous rows). Anything else: `F.linear` and `moe.route`, the two launches.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from stage_worker.kernels.common import pow2, triton_usable
from stage_worker.kernels.moe import MAX_EXPERTS, route
from stage_worker.kernels.moe_ref import RouteCounts
from stage_worker.kernels.split_reduce import split_locks

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux: the two-launch path (PyTorch there)
    triton = None

ROUTER_FUSED = os.environ.get("MOEPIPE_ROUTER_FUSED") == "1"   # default off until the H200 times it
FUSED_MAX_T = 16        # the last program routes every row: decode sizes only; more tokens take the two launches
# (BLOCK_N router rows a program, BLOCK_H inputs a load, warps, ROUTE_ROWS rows the last program routes at a time)
# by token bucket (1, <= 4, <= 16). Guesses until the H200 sweep (the gpu test prints one): at the full shape
# (513 x 2560) BLOCK_N 4 gives 129 programs, about one an SM, each reading 20 KB in H / BLOCK_H loads unrolled.
CFG = {1: (4, 512, 4, 1), 4: (4, 256, 4, 4), 16: (4, 128, 8, 4)}


def _bucket(t: int) -> int:
    return 1 if t == 1 else 4 if t <= 4 else 16


if triton is not None:
    from stage_worker.kernels.moe import route_rows
    from stage_worker.kernels.split_reduce import last_of

    @triton.jit
    def _router_gemv_kernel(x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr, valid_ptr,
                            lock_ptr, T, N, E, stride_xt, stride_wn, stride_lt, FIRST_HOST, H: tl.constexpr,
                            TP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, NPROG: tl.constexpr,
                            ROUTE_ROWS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                            RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                            COUNT: tl.constexpr, VALID: tl.constexpr):
        """logits[t, rows] = W[rows] . x[t] for the program's BLOCK_N rows and all T (<= TP) tokens, fp32 sums
        ([TP, BLOCK_N, BLOCK_H] FMAs, one reduction at the end), stored in the logits' dtype; then the last of the
        NPROG programs routes rows 0..T-1 (`moe.route_rows`)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        rows64 = rows.to(tl.int64)
        offs_t = tl.arange(0, TP)
        mask_t = offs_t < T
        acc = tl.zeros([TP, BLOCK_N, BLOCK_H], tl.float32)
        for h0 in tl.static_range(0, H, BLOCK_H):          # unrolled: every load of the rows issued up front
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < H
            w = tl.load(w_ptr + rows64[:, None] * stride_wn + offs_h[None, :],
                        mask=mask_n[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :],
                         mask=mask_t[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            acc += w[None, :, :] * xv[:, None, :]
        logit = tl.sum(acc, axis=2)                                            # [TP, BLOCK_N]
        tl.store(logits_ptr + offs_t[:, None] * stride_lt + rows64[None, :],
                 logit.to(logits_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])
        if last_of(lock_ptr, NPROG):
            for r0 in range(0, TP, ROUTE_ROWS):
                t = (r0 + tl.arange(0, ROUTE_ROWS)).to(tl.int64)
                # rows past T (T not a multiple of ROUTE_ROWS) repeat row T-1, all of their stores and counts
                # masked off (no all -inf row, no NaN)
                route_rows(logits_ptr, weights_ptr, ids_ptr, counts_ptr, reads_ptr, valid_ptr,
                           tl.minimum(t, T - 1), t < T, E,
                           stride_lt, FIRST_HOST, TOP_K, SHARED, RENORM, BLOCK_E, BLOCK_K, COUNT, VALID, True)


def fused_usable(x: torch.Tensor, weight: torch.Tensor, top_k: int, shared: bool = False) -> bool:
    """Whether `router_route` takes the one launch: Triton runs x (CUDA, or the interpreter on the CPU), 1 to
    FUSED_MAX_T token rows, a [E (+ 1), H] weight in x's dtype and device with contiguous rows, 0 < top_k <= E <=
    moe.MAX_EXPERTS."""
    if x.dim() != 2 or weight.dim() != 2 or not triton_usable(x):
        return False
    E = weight.shape[0] - int(shared)
    return (0 < x.shape[0] <= FUSED_MAX_T and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype and
            weight.device == x.device and weight.stride(-1) == 1 and 0 < top_k <= E <= MAX_EXPERTS)


def router_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalise: bool, shared: bool = False,
                 counts: RouteCounts | None = None, valid: torch.Tensor | None = None,
                 cfg: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E (+ 1 with `shared`: the shared expert's gate row last), H] -> (weights [T, k (+1)]
    fp32, ids int32, logits [T, E (+ 1)] in x's dtype) = `moe.route(F.linear(x, weight), ...)` (`counts`, `valid`
    as there), in one launch where `fused_usable` says so, else those two. `cfg` overrides the CFG entry."""
    if not fused_usable(x, weight, top_k, shared):
        logits = F.linear(x, weight)
        weights, ids = route(logits, top_k, renormalise, shared=shared, counts=counts, valid=valid)
        return weights, ids, logits
    T, H = x.shape
    N = weight.shape[0]
    E = N - int(shared)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_n, block_h, warps, route_rows_ = cfg or CFG[_bucket(T)]
    tp = pow2(T)
    block_n, block_h, route_rows_ = min(block_n, pow2(N)), min(block_h, pow2(H)), min(route_rows_, tp)
    nprog = triton.cdiv(N, block_n)
    slots = top_k + int(shared)
    logits = torch.empty(T, N, dtype=x.dtype, device=x.device)
    weights = torch.empty(T, slots, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, slots, dtype=torch.int32, device=x.device)
    c = counts or RouteCounts(weights, ids, E)              # unused pointers when not counting
    _router_gemv_kernel[(nprog,)](x, weight, logits, weights, ids, c.counts, c.host_reads,
                                  ids if valid is None else valid, split_locks(x.device), T, N, E, x.stride(0),
                                  weight.stride(0), logits.stride(0), c.first, H=H, TP=tp, BLOCK_N=block_n,
                                  BLOCK_H=block_h, NPROG=nprog, ROUTE_ROWS=route_rows_, TOP_K=top_k,
                                  SHARED=int(shared), RENORM=bool(renormalise), BLOCK_E=pow2(E),
                                  BLOCK_K=pow2(top_k), COUNT=counts is not None, VALID=valid is not None,
                                  num_warps=warps)
    return weights, ids, logits


def gate_and_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalise: bool, shared: bool = False,
                   counts: RouteCounts | None = None,
                   valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route(F.linear(x, weight), ...)`: `router_route`'s one launch when ROUTER_FUSED is on (read at the
    call, so a test may switch it), the two launches otherwise. The model's decode call sites call this."""
    if ROUTER_FUSED:
        return router_route(x, weight, top_k, renormalise, shared=shared, counts=counts, valid=valid)[:2]
    return route(F.linear(x, weight), top_k, renormalise, shared=shared, counts=counts, valid=valid)
