"""Fused MoE decode over INT4 experts (issue 17, item 2): the routed experts' gate/up and down GEMVs read the packed
words and their group scales directly and dequantize in registers, so a step reads a quarter of the bf16 bytes.

Same two phases as `moe.fused_moe` (grid (T*k, cdiv(I, BLOCK_I)) for act = silu(x.Wg) * (x.Wu) in fp32, then
(T, cdiv(H, BLOCK_H)) for the weighted sum over the k experts in a fixed order), on `moe_int4_ref.PackedExperts`.
A block of BLOCK_W words per row is loaded once and unpacked by eight shifts (nibble n of word w is input column
8w + n), multiplied by the matching inputs and, per word, its group's scale, so no 3-D reshape is needed; groups are
multiples of 8 columns. Host rows (issue 16) come through the same `expert_rows` helper as the bf16 kernels, for
the words and the scales alike. The shared expert is not a slot here: it is quantized differently in the reports'
release (INT6), and runs beside this launch. Reference: `moe_int4_ref.fused_moe_int4_ref`; tests:
tests/test_kernel_moe_int4.py (CPU under TRITON_INTERPRET=1, H200 with real shapes).
"""

from __future__ import annotations

import torch

from stage_worker.kernels.moe import SKIP, _bucket, _pow2, decode_operands, expert_rows, triton, triton_usable
from stage_worker.kernels.moe_int4_ref import PackedExperts, dequantize_int4

if triton is not None:
    import triton.language as tl

    SKIP_ID = tl.constexpr(SKIP)

    @triton.jit
    def _int4_up_kernel(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, act_ptr, stride_qe, stride_qr, stride_se,
                        stride_sr, FIRST_HOST, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr):
        """act[t, j, i-block] = silu(Wg_e x_t) * (Wu_e x_t) with W in INT4 words and group scales."""
        tj = tl.program_id(0)
        t = tj // TOP_K
        e = tl.load(ids_ptr + tj).to(tl.int64)
        if e == SKIP_ID:
            return
        qbase = expert_rows(e, q_ptr, q_ptr, hq_ptr, stride_qe, FIRST_HOST)
        sbase = expert_rows(e, s_ptr, s_ptr, hs_ptr, stride_se, FIRST_HOST)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        rows_g = offs_i[:, None].to(tl.int64)
        rows_u = rows_g + I
        acc_g = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
        for w0 in range(0, H // 8, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            mask_w = offs_w < H // 8
            m = mask_i[:, None] & mask_w[None, :]
            qg = tl.load(qbase + rows_g * stride_qr + offs_w[None, :], mask=m, other=0)
            qu = tl.load(qbase + rows_u * stride_qr + offs_w[None, :], mask=m, other=0)
            part_g = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
            part_u = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
            for n in tl.static_range(8):
                xv = tl.load(x_ptr + t * H + offs_w * 8 + n, mask=mask_w, other=0.0).to(tl.float32)
                part_g += (((qg >> (4 * n)) & 0xF) - 8).to(tl.float32) * xv[None, :]
                part_u += (((qu >> (4 * n)) & 0xF) - 8).to(tl.float32) * xv[None, :]
            grp = (offs_w * 8) // GROUP                      # a group spans whole words: one scale per word
            sg = tl.load(sbase + rows_g * stride_sr + grp[None, :], mask=m, other=0.0).to(tl.float32)
            su = tl.load(sbase + rows_u * stride_sr + grp[None, :], mask=m, other=0.0).to(tl.float32)
            acc_g += part_g * sg
            acc_u += part_u * su
        g = tl.sum(acc_g, axis=1)
        act = g * tl.sigmoid(g) * tl.sum(acc_u, axis=1)
        tl.store(act_ptr + tj * I + offs_i, act, mask=mask_i)

    @triton.jit
    def _int4_down_kernel(act_ptr, ids_ptr, wts_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, out_ptr, stride_qe, stride_qh,
                          stride_se, stride_sh, stride_ot, FIRST_HOST, H: tl.constexpr, I: tl.constexpr,
                          TOP_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
        """out[t, h-block] = sum_j w[t, j] * W2_e[h-block] act[t, j], the k experts summed in order, in fp32."""
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        rows = offs_h[:, None].to(tl.int64)
        acc = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
        for j in range(TOP_K):
            tj = t * TOP_K + j
            e = tl.load(ids_ptr + tj).to(tl.int64)
            wt = tl.load(wts_ptr + tj).to(tl.float32)
            if e != SKIP_ID:
                qbase = expert_rows(e, q_ptr, q_ptr, hq_ptr, stride_qe, FIRST_HOST)
                sbase = expert_rows(e, s_ptr, s_ptr, hs_ptr, stride_se, FIRST_HOST)
                for w0 in range(0, I // 8, BLOCK_W):
                    offs_w = w0 + tl.arange(0, BLOCK_W)
                    mask_w = offs_w < I // 8
                    m = mask_h[:, None] & mask_w[None, :]
                    q = tl.load(qbase + rows * stride_qh + offs_w[None, :], mask=m, other=0)
                    part = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
                    for n in tl.static_range(8):
                        a = tl.load(act_ptr + tj * I + offs_w * 8 + n, mask=mask_w, other=0.0)
                        part += (((q >> (4 * n)) & 0xF) - 8).to(tl.float32) * (wt * a)[None, :]
                    sc = tl.load(sbase + rows * stride_sh + ((offs_w * 8) // GROUP)[None, :], mask=m,
                                 other=0.0).to(tl.float32)
                    acc += part * sc
        out = tl.sum(acc, axis=1)
        tl.store(out_ptr + t * stride_ot + offs_h, out.to(out_ptr.dtype.element_ty), mask=mask_h)


# (BLOCK_I, BLOCK_W, warps) for the up phase and (BLOCK_H, BLOCK_W, warps) for the down phase per token bucket:
# `bench/moe_int4.py --sweep` on the H200 for 1 and 4 tokens (bench/results/moe-int4-1; with them, moe-int4-2:
# 44.0 / 94.5 / 353 us at 1 / 4 / 16 tokens against bf16's 36.6 / 99.6 / 328); 16 is a guess. The kernel reads at
# 12-22% of HBM bandwidth: an int-to-float-free unpack (the 2^23 mantissa trick) changed nothing, so the bound is
# elsewhere (see docs/performance.md).
UP_CFG = {1: (4, 32, 2), 4: (16, 32, 2), 16: (16, 16, 8)}
DOWN_CFG = {1: (4, 32, 4), 4: (8, 16, 2), 16: (16, 16, 8)}
DECODE_MAX_TK = 256


def fused_moe_int4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: PackedExperts,
                   host: PackedExperts | None = None, first_host: int | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, k] (routed slots; SKIP skipped) -> [T, H] in x.dtype; = fused_moe_int4_ref.
    `host`: the slots from `first_host` on, packed the same way in (pinned) host memory."""
    T, H = x.shape
    E, H_, I = experts.shape
    k = ids.shape[1]
    g, g2 = experts.group, experts.down_group
    if H_ != H or H % 8 or I % 8 or g % 8 or g2 % 8 or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)} ids {tuple(ids.shape)} experts (E, H, I) {(E, H_, I)} "
                         f"group {g} (H, I and the group must be multiples of 8)")
    if not triton_usable(x) or T * k > DECODE_MAX_TK:
        if host is not None:
            raise ValueError("host rows of INT4 experts need the kernel path")
        return grouped_moe_int4(x, ids, weights, experts)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    x, ids, weights, act = decode_operands(x, ids, weights, I)
    h = host or experts
    first = E if host is None else first_host
    bi, bw, warps = UP_CFG[_bucket(T)]
    bi, bw = min(bi, _pow2(I)), min(bw, _pow2(H // 8))
    _int4_up_kernel[(T * k, triton.cdiv(I, bi))](
        x, ids, experts.q13, experts.s13, h.q13, h.s13, act, experts.q13.stride(0), experts.q13.stride(1),
        experts.s13.stride(0), experts.s13.stride(1), first, H=H, I=I, TOP_K=k, GROUP=g, BLOCK_I=bi, BLOCK_W=bw,
        num_warps=warps)
    bh, bw, warps = DOWN_CFG[_bucket(T)]
    bh, bw = min(bh, _pow2(H)), min(bw, _pow2(I // 8))
    _int4_down_kernel[(T, triton.cdiv(H, bh))](
        act, ids, weights, experts.q2, experts.s2, h.q2, h.s2, out, experts.q2.stride(0), experts.q2.stride(1),
        experts.s2.stride(0), experts.s2.stride(1), out.stride(0), first, H=H, I=I, TOP_K=k, GROUP=g2,
        BLOCK_H=bh, BLOCK_W=bw, num_warps=warps)
    return out


def grouped_moe_int4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     experts: PackedExperts) -> torch.Tensor:
    """Prefill and CPU path: each present expert dequantized once (to x.dtype) and two GEMMs over its tokens, in
    expert order, as `moe.grouped_moe`'s loop and SparseMoE's CPU loop sum (one host sync: the present experts)."""
    T, k = ids.shape
    out = torch.zeros_like(x)
    flat = ids.long()
    for e in torch.unique(flat[flat >= 0]).tolist():
        tok, slot = torch.where(flat == e)
        w13 = dequantize_int4(experts.q13[e], experts.s13[e], experts.group).to(x.dtype)
        w2 = dequantize_int4(experts.q2[e], experts.s2[e], experts.down_group).to(x.dtype)
        g, u = torch.nn.functional.linear(x[tok], w13).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w2) * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out
