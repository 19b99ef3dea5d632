"""Grouped MoE for prefill: every present expert's tokens in two Triton GEMM launches, no host sync.

The PyTorch prefill path (`moe.grouped_moe`) loops over the present experts in Python, a handful of launches each:
with 512 experts nearly every expert is present in a prompt's chunk, so a 48-layer stage launched ~150,000 small
kernels per chunk, and a 60-token prefill of the 20-layer full-shape model took ~1 s on the H200 (TTFT at 4
streams, bench/results/served-speed-4). Here, as in vLLM's fused MoE and SGLang's, the (token, slot) pairs are
sorted by expert on the device and each expert's run is padded to a multiple of BLOCK_M (`align`), so every
BLOCK_M rows of the sorted order belong to one expert; one launch computes act = silu(x Wg^T) * (x Wu^T) for all
blocks and one the down projection, each program reading only its block's expert. Blocks past the used length
exit at once, so the grid can be sized without knowing the counts on the host. The combine (weights times the
pairs' outputs) stays a fixed-order batched matmul: deterministic, no atomics.

Reference: `moe_ref.fused_moe_ref` (and `moe.grouped_moe`, the PyTorch path it replaces); test:
tests/test_kernel_moe_prefill.py (CPU under TRITON_INTERPRET=1). Switch: kernel flag `moe_prefill`.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from stage_worker.kernels.moe import expert_rows


def block_m(pairs: int, experts: int) -> int:
    """Rows per block: small when each expert gets few pairs (padding is wasted work), 16 at least (tl.dot)."""
    per_expert = pairs / max(experts, 1)
    return 16 if per_expert < 16 else 32 if per_expert < 48 else 64


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [L] int32, padded with T*k; expert of each BLOCK_M block [L / bm] int32, -1 past the end).

    Pair p = t * k + j is token t's j-th routed slot. L = T*k + E*(bm - 1), rounded up to bm: the most any
    routing can need, so nothing here waits for the device."""
    flat = ids.reshape(-1).long()
    tk = flat.numel()
    dev = ids.device
    order = torch.argsort(flat, stable=True)
    # not torch.bincount: on CUDA it reads the largest id back to size its output (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    expert_of = flat[order]
    pos = (padded_end - padded)[expert_of] + torch.arange(tk, device=dev) - start[expert_of]
    length = -(-(tk + num_experts * (bm - 1)) // bm) * bm
    sorted_ids = torch.full((length,), tk, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    first_row = torch.arange(0, length, bm, device=dev)
    block_expert = torch.searchsorted(padded_end, first_row, right=True)
    block_expert = torch.where(first_row < padded_end[-1], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _block(sorted_ptr, block_expert_ptr, TK, BLOCK_M: tl.constexpr):
    """This program's block: its expert (-1: past the used length), its rows' pair ids and which rows are real."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    pair = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, pair, pair < TK


@triton.jit
def _up_kernel(x_ptr, sorted_ptr, block_expert_ptr, w13_ptr, hw13_ptr, act_ptr, stride_x, stride_we, stride_wn, TK,
               FIRST_HOST, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    e, pair, valid = _block(sorted_ptr, block_expert_ptr, TK, BLOCK_M)
    if e < 0:
        return
    tok = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    w_base = expert_rows(e, w13_ptr, w13_ptr, hw13_ptr, stride_we, FIRST_HOST)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < H
        xa = tl.load(x_ptr + tok[:, None] * stride_x + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & cmask[None, :]
        wg = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (cols[None, :] + I).to(tl.int64) * stride_wn + ks[:, None], mask=wmask, other=0.0)
        if DOT_F32:
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(xa, wg)
        acc_u += tl.dot(xa, wu)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out = act_ptr + pair[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(act_ptr, sorted_ptr, block_expert_ptr, w2_ptr, hw2_ptr, down_ptr, stride_we, stride_wh, TK,
                 FIRST_HOST, H: tl.constexpr, I: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    e, pair, valid = _block(sorted_ptr, block_expert_ptr, TK, BLOCK_M)
    if e < 0:
        return
    p64 = pair.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < H
    w_base = expert_rows(e, w2_ptr, w2_ptr, hw2_ptr, stride_we, FIRST_HOST)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < I
        a = tl.load(act_ptr + p64[:, None] * I + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wh + ks[:, None],
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w)
    out = down_ptr + p64[:, None] * H + cols[None, :]
    tl.store(out, acc.to(down_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


def grouped_moe_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, host=None) -> torch.Tensor:
    """x [T, H], routed ids/weights [T, k], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in x.dtype (= fused_moe_ref
    without a shared expert). The activation between the two GEMMs is kept in x.dtype, as the PyTorch path does.
    With `host` (`moe.HostRows`), slots >= host.first are read from the host table: once per BLOCK_M block of
    their pairs (an expert with at most BLOCK_M pairs in a chunk, the common case at 512 experts, once)."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w13.shape
    I = two_i // 2
    hw13, hw2, first = (w13, w2, E) if host is None else (host.w13, host.w2, host.first)
    E += 0 if host is None else host.w13.shape[0]
    if T == 0:
        return torch.empty_like(x)
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13 and w2 need a contiguous last dimension")   # never copy the expert tables
    x = x.contiguous()
    tk = T * k
    bm = block_m(tk, E)
    sorted_ids, block_expert = align(ids, E, bm)
    act = torch.empty(tk, I, dtype=x.dtype, device=x.device)
    down = torch.empty(tk, H, dtype=x.dtype, device=x.device)
    bn, bk = 64, 64
    blocks = block_expert.numel()
    f32 = bool(triton.knobs.runtime.interpret)   # the interpreter's bf16 tl.dot is wrong (triton 3.6): upcast there
    _up_kernel[(blocks, triton.cdiv(I, bn))](x, sorted_ids, block_expert, w13, hw13, act, x.stride(0),
                                             w13.stride(0), w13.stride(1), tk, first, H=H, I=I, TOP_K=k, BLOCK_M=bm,
                                             BLOCK_N=bn, BLOCK_K=bk, DOT_F32=f32, num_warps=4)
    _down_kernel[(blocks, triton.cdiv(H, bn))](act, sorted_ids, block_expert, w2, hw2, down, w2.stride(0),
                                               w2.stride(1), tk, first, H=H, I=I, BLOCK_M=bm, BLOCK_N=bn,
                                               BLOCK_K=bk, DOT_F32=f32, num_warps=4)
    return torch.bmm(weights.to(x.dtype).unsqueeze(1), down.view(T, k, H)).squeeze(1)
