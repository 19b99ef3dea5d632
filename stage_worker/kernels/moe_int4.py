"""Fused MoE decode over INT4 experts (issue 17, item 2): the routed experts' gate/up and down GEMVs read the packed
words and their group scales directly and dequantize in registers, so a step reads a quarter of the bf16 bytes.

Two launches, as `moe.fused_moe`: the up phase, grid (T*k, cdiv(I, BLOCK_I)), writes act = w * silu(x.Wg) * (x.Wu)
in fp32, nibble-major; the down phase, grid (T, cdiv(H, BLOCK_H)), sums the k experts in a fixed order (one 2-D fp32
accumulator, reduced at the end). Decoding costs three instructions a nibble (`_nibble`: shift, one mask-and-or into
a float in [1, 2), the FMA) and no int-to-float conversion; the -8 offset and the group scale are applied once per
word and per QW-word quad. Tiles are [rows, BLOCK_W words] with 16-byte loads and several rows a thread (so each x
value a thread gathers serves them all), the next block's words loaded before the current one is computed. Host rows
(issue 16) come through `expert_rows` (up) and the same device/host choice per column (down). The shared expert is
not a slot here: it is quantized differently in the reports' release (INT6), and runs beside this launch. Reference:
`moe_int4_ref.fused_moe_int4_ref`; tests: tests/test_kernel_moe_int4.py (CPU under TRITON_INTERPRET=1, H200 with
real shapes); numbers: docs/performance.md, "INT4 experts (issue 17)".
With the kernel flag `pdl` (`common.pdl_usable`) both launch as programmatic dependents and wait
(`common.pdl_wait`) first thing: every load depends on the routing ids, and the expert tables themselves are
rewritten between steps by the expert-move swap kernels, so nothing may be read before the wait (what PDL saves
here is the launch and ramp-up, not a weight prologue).
With CLAIM (`fused_moe_int4`'s `claim`, issue 16) the kernels also store the words and scales they read of one
claimed slot into a free device slot: the expert moves to the device with no copy of its own (as `moe.fused_moe`).
FP4 experts (NVFP4 / MXFP4, `moe_int4_ref`) take the same kernels with FP4 on: each nibble an E2M1 code turned into
its value by `common.e2m1_scaled` (no table, no int-to-float), float32 scales, no offset; claims copy them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from stage_worker.kernels.common import pow2 as _pow2
from stage_worker.kernels.common import pdl_usable, triton_usable
from stage_worker.kernels.moe import (SKIP, _bucket, check_claim, claim_spare, copy_claimed, expert_rows, part_pairs,
                                     triton)
from stage_worker.kernels.moe_int4_ref import PackedExperts, dequantize_packed, zcol

if triton is not None:
    import triton.language as tl

    from stage_worker.kernels.common import e2m1_scaled, pdl_wait

    SKIP_ID = tl.constexpr(SKIP)

    @triton.jit
    def _nibble(q, one, N: tl.constexpr):
        """1 + (nibble N of the words q) / 16 in fp32, exactly: the nibble moved to the top four mantissa bits
        (19..22) by a multiply (a left shift the compiler issues on the FMA pipe), then masked and given the
        exponent of 1.0 in one logic op (`one` = 0x3F800000 comes as a kernel argument, so it sits in a register
        and the mask-and-or is one LOP3, not two). No int-to-float conversion: three instructions a nibble with the
        FMA (nibbles 5..7 shift right)."""
        if N < 5:
            v = q * (1 << (19 - 4 * N))
        else:
            v = q >> (4 * N - 19)
        return ((v & 0x00780000) | one).to(tl.float32, bitcast=True)

    @triton.jit
    def _up_words(qbase, rg, ru, stride_qr, ow, mask_i, W: tl.constexpr):
        """The gate and up rows' words ow (masked off past the row's end)."""
        m = mask_i[:, None] & (ow < W)[None, :]
        return (tl.load(qbase + rg * stride_qr + ow[None, :], mask=m, other=0),
                tl.load(qbase + ru * stride_qr + ow[None, :], mask=m, other=0))

    @triton.jit
    def _int4_up_kernel(x_ptr, ids_ptr, wts_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, act_ptr, stride_it, stride_wt,
                        stride_qe, stride_qr, stride_se, stride_sr, FIRST_HOST, ONE, H: tl.constexpr,
                        I: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr, QW: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr,
                        PDL: tl.constexpr = False, claim_ptr=None, spare_ptr=None, CLAIM: tl.constexpr = False,
                        NC: tl.constexpr = 1, ZCOL: tl.constexpr = 0, FP4: tl.constexpr = False):
        """act[t, j, i-block] = w[t, j] * silu(Wg_e x_t) * (Wu_e x_t), W in INT4 words and group scales, stored
        nibble-major (act_p[t, j, i % 8, i // 8]) for the down kernel's contiguous loads. CLAIM: if e is the
        claimed slot claim_ptr[0] (>= 0), the words and scales of the block being computed are also stored, as
        loaded, into device slot spare_ptr[0] (`moe.fused_moe`'s claim): the grid together copies q13 and s13.
        NC > 1 claims: the spare of the entry holding e (`moe.claim_spare`).

        An iteration takes [BLOCK_I, BLOCK_W] words of the gate rows and of the up rows (16-byte loads; a thread
        holds several rows, so the x values it gathers serve all of them); the words of the next PREFETCH (0, 1
        or 2) blocks are already loading while one is computed. Per word: d = sum_n (1 + q_n/16) x_n (the
        `_nibble` floats) and sum_n (q_n - 8) x_n = 16 (d - 1.5 sum_n x_n); a thread's QW words share a scale,
        applied once to their sum; the 16 at the end. ZCOL > 0 (asymmetric experts): the zero point z of a row's
        group sits ZCOL columns after its scale, and sum_n (q_n - 8 - z) x_n = 16 (d - (1.5 + z/16) sum_n x_n).
        FP4: the words hold E2M1 codes (`common.e2m1_scaled`) and the scales are float32; d = sum_n 2^-14 v_n x_n,
        no offset, and 2^14 at the end."""
        pdl_wait(PDL)                 # first: the ids, x and the expert tables (swapped between steps) all wait
        tj = tl.program_id(0)
        t = tj // TOP_K
        e = tl.load(ids_ptr + t * stride_it + tj % TOP_K).to(tl.int64)
        if e == SKIP_ID:
            return
        qbase = expert_rows(e, q_ptr, q_ptr, hq_ptr, stride_qe, FIRST_HOST)
        sbase = expert_rows(e, s_ptr, s_ptr, hs_ptr, stride_se, FIRST_HOST)
        W: tl.constexpr = H // 8                                # words per row
        NQ: tl.constexpr = BLOCK_W // QW                        # scale quads a block
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        rg = offs_i[:, None].to(tl.int64)
        ru = rg + I
        offs_w = tl.arange(0, BLOCK_W)
        offs_q = tl.arange(0, NQ) * QW
        if CLAIM:
            if NC == 1:
                c = tl.load(claim_ptr)
                spare = tl.load(spare_ptr)
                hit = (e == c) & (c >= 0) & (spare >= 0)     # -1: no claim, no spare
            else:
                spare = claim_spare(e, claim_ptr, spare_ptr, NC)
                hit = spare >= 0
            qspare = q_ptr + spare * stride_qe
            sspare = s_ptr + spare * stride_se
        if PREFETCH >= 1:
            qg, qu = _up_words(qbase, rg, ru, stride_qr, offs_w, mask_i, W)
        if PREFETCH >= 2:
            qg1, qu1 = _up_words(qbase, rg, ru, stride_qr, BLOCK_W + offs_w, mask_i, W)
        acc_g = tl.zeros([BLOCK_I, NQ], tl.float32)
        acc_u = tl.zeros([BLOCK_I, NQ], tl.float32)
        for w0 in range(0, W, BLOCK_W):
            ow = w0 + offs_w
            mw = ow < W
            oq = w0 + offs_q
            mq = mask_i[:, None] & (oq < W)[None, :]
            grp = ((oq * 8) // GROUP)[None, :]
            sg_raw = tl.load(sbase + rg * stride_sr + grp, mask=mq, other=0.0)
            sg = sg_raw.to(tl.float32)
            su_raw = tl.load(sbase + ru * stride_sr + grp, mask=mq, other=0.0)
            su = su_raw.to(tl.float32)
            if ZCOL:
                zg_raw = tl.load(sbase + rg * stride_sr + ZCOL + grp, mask=mq, other=0.0)
                zu_raw = tl.load(sbase + ru * stride_sr + ZCOL + grp, mask=mq, other=0.0)
            if PREFETCH == 0:
                qg, qu = _up_words(qbase, rg, ru, stride_qr, ow, mask_i, W)
            else:
                qg_n, qu_n = _up_words(qbase, rg, ru, stride_qr, ow + PREFETCH * BLOCK_W, mask_i, W)
            if CLAIM:
                if hit:                 # qg, qu: this block's words (`_up_words`' mask); quads sharing a group
                    m = mask_i[:, None] & mw[None, :]                   # store its scale twice, the same bits
                    tl.store(qspare + rg * stride_qr + ow[None, :], qg, mask=m)
                    tl.store(qspare + ru * stride_qr + ow[None, :], qu, mask=m)
                    tl.store(sspare + rg * stride_sr + grp, sg_raw, mask=mq)
                    tl.store(sspare + ru * stride_sr + grp, su_raw, mask=mq)
                    if ZCOL:
                        tl.store(sspare + rg * stride_sr + ZCOL + grp, zg_raw, mask=mq)
                        tl.store(sspare + ru * stride_sr + ZCOL + grp, zu_raw, mask=mq)
            xs = tl.zeros([BLOCK_W], tl.float32)
            dg = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
            du = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
            for n in tl.static_range(8):
                xn = tl.load(x_ptr + t * H + ow * 8 + n, mask=mw, other=0.0).to(tl.float32)
                if FP4:
                    dg += e2m1_scaled(qg, n) * xn[None, :]
                    du += e2m1_scaled(qu, n) * xn[None, :]
                else:
                    xs += xn
                    dg += _nibble(qg, ONE, n) * xn[None, :]
                    du += _nibble(qu, ONE, n) * xn[None, :]
            if FP4:
                acc_g += tl.sum(tl.reshape(dg, [BLOCK_I, NQ, QW]), axis=2) * sg
                acc_u += tl.sum(tl.reshape(du, [BLOCK_I, NQ, QW]), axis=2) * su
            else:
                xq = tl.sum(tl.reshape(xs, [NQ, QW]), axis=1)[None, :]
                if ZCOL:
                    off_g = -(1.5 + zg_raw.to(tl.float32) * 0.0625) * xq
                    off_u = -(1.5 + zu_raw.to(tl.float32) * 0.0625) * xq
                else:
                    off_g = -1.5 * xq
                    off_u = off_g
                acc_g += (tl.sum(tl.reshape(dg, [BLOCK_I, NQ, QW]), axis=2) + off_g) * sg
                acc_u += (tl.sum(tl.reshape(du, [BLOCK_I, NQ, QW]), axis=2) + off_u) * su
            if PREFETCH == 1:
                qg = qg_n
                qu = qu_n
            if PREFETCH == 2:
                qg = qg1
                qu = qu1
                qg1 = qg_n
                qu1 = qu_n
        if FP4:
            g = tl.sum(acc_g, axis=1) * 16384.0
            u = tl.sum(acc_u, axis=1) * 16384.0
        else:
            g = tl.sum(acc_g, axis=1) * 16.0
            u = tl.sum(acc_u, axis=1) * 16.0
        # rounded to x's dtype first: fp32 router weights give what a cast before the launch gives
        wt = tl.load(wts_ptr + t * stride_wt + tj % TOP_K).to(x_ptr.dtype.element_ty).to(tl.float32)
        act = g * tl.sigmoid(g) * u * wt
        tl.store(act_ptr + tj * I + (offs_i % 8) * (I // 8) + offs_i // 8, act, mask=mask_i)

    @triton.jit
    def _col_slots(ids_ptr, stride_it, t, col, I: tl.constexpr, TOP_K: tl.constexpr):
        """For columns of a token's k experts' rows seen as one row of k * I/8 words: the slot j, the word within
        the expert's row, and the expert id (SKIP past the end)."""
        WPE: tl.constexpr = I // 8
        j = col // WPE
        e = tl.load(ids_ptr + t * stride_it + j, mask=col < TOP_K * WPE, other=SKIP_ID).to(tl.int64)
        return j, col - j * WPE, e

    @triton.jit
    def _down_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, col, rows, mask_h, stride_qe, stride_qh, FIRST_HOST,
                    I: tl.constexpr, TOP_K: tl.constexpr):
        """(j, w, e, words) of columns `col` for `rows` (`_col_slots`; the words from the device or host table,
        SKIP columns masked: not read)."""
        j, w, e = _col_slots(ids_ptr, stride_it, t, col, I, TOP_K)
        qb = tl.where(e >= FIRST_HOST, hq_ptr + (e - FIRST_HOST) * stride_qe, q_ptr + e * stride_qe)
        m = mask_h[:, None] & (e != SKIP_ID)[None, :]
        return j, w, e, tl.load(qb[None, :] + rows * stride_qh + w[None, :], mask=m, other=0)

    @triton.jit
    def _int4_down_kernel(act_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, out_ptr, add_ptr, stride_it, stride_qe,
                          stride_qh, stride_se, stride_sh, stride_ot, stride_at, FIRST_HOST, ONE, H: tl.constexpr,
                          I: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr, QW: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr, ADD: tl.constexpr,
                          PDL: tl.constexpr = False, claim_ptr=None, spare_ptr=None, CLAIM: tl.constexpr = False,
                          NC: tl.constexpr = 1, ZCOL: tl.constexpr = 0, FP4: tl.constexpr = False):
        """out[t, h-block] = sum_j W2_e[h-block] act_p[t, j] (the router weight is in act), in fp32.

        A token's k experts' rows are one long row of k * I/8 words, BLOCK_W of them an iteration: a block spans
        experts, so a program streams all k experts' rows with no per-expert loop (and the next PREFETCH blocks
        in flight); the act_p loads are contiguous. Columns of a SKIP slot are masked: neither their words nor
        their activations (never written) are read. With ADD, add[t] (the shared expert's output) is added before
        the store. CLAIM: as in `_int4_up_kernel`, the words and scales of the columns whose slot is the claimed
        one also stored into device slot spare_ptr[0] (masked stores, no branch: a block spans experts). NC > 1
        claims: each column's spare looked up among the entries (`moe.claim_spare`), the stores addressed per
        column. ZCOL > 0: zero points ZCOL columns after the scales, and FP4 (E2M1 codes), as in `_int4_up_kernel`."""
        pdl_wait(PDL)                 # first: the ids, act and the expert tables all wait
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        rows = offs_h[:, None].to(tl.int64)
        WPE: tl.constexpr = I // 8                               # words per expert row
        NQ: tl.constexpr = BLOCK_W // QW                        # scale quads a block
        offs_w = tl.arange(0, BLOCK_W)
        offs_q = tl.arange(0, NQ) * QW
        if CLAIM and NC == 1:
            c = tl.load(claim_ptr)
            spare = tl.load(spare_ptr)
            c = tl.where((c >= 0) & (spare >= 0), c, SKIP_ID - 1)     # no claim or no spare: an id no column has
            qspare = q_ptr + spare * stride_qe
            sspare = s_ptr + spare * stride_se
        if PREFETCH >= 1:
            j, w, e, q = _down_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, offs_w, rows, mask_h, stride_qe,
                                     stride_qh, FIRST_HOST, I, TOP_K)
        if PREFETCH >= 2:
            j1, w1, e1, q1 = _down_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, BLOCK_W + offs_w, rows, mask_h,
                                         stride_qe, stride_qh, FIRST_HOST, I, TOP_K)
        acc = tl.zeros([BLOCK_H, NQ], tl.float32)
        for c0 in range(0, TOP_K * WPE, BLOCK_W):
            if PREFETCH == 0:
                j, w, e, q = _down_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, c0 + offs_w, rows, mask_h,
                                         stride_qe, stride_qh, FIRST_HOST, I, TOP_K)
            else:
                j_n, w_n, e_n, q_n = _down_words(q_ptr, hq_ptr, ids_ptr, stride_it, t,
                                                 c0 + PREFETCH * BLOCK_W + offs_w, rows, mask_h, stride_qe,
                                                 stride_qh, FIRST_HOST, I, TOP_K)
            jq, wq, eq = _col_slots(ids_ptr, stride_it, t, c0 + offs_q, I, TOP_K)     # the quads' scales
            sb = tl.where(eq >= FIRST_HOST, hs_ptr + (eq - FIRST_HOST) * stride_se, s_ptr + eq * stride_se)
            sc = tl.load(sb[None, :] + rows * stride_sh + ((wq * 8) // GROUP)[None, :],
                         mask=mask_h[:, None] & (eq != SKIP_ID)[None, :], other=0.0)
            if ZCOL:
                zc = tl.load(sb[None, :] + rows * stride_sh + ZCOL + ((wq * 8) // GROUP)[None, :],
                             mask=mask_h[:, None] & (eq != SKIP_ID)[None, :], other=0.0)
            # The stores sit behind a test of the whole block (does any column hold a claimed slot?): masked stores
            # with every lane off still cost the down kernel 5.6 us a layer at four tokens (h100-35, claim- 30.9
            # against 25.3 us), and nearly every block of nearly every step claims nothing.
            if CLAIM and NC == 1:       # this block's words q, as `_down_words` masks them, of the claimed slot
                if tl.max((e == c).to(tl.int32), axis=0) > 0:
                    tl.store(qspare + rows * stride_qh + w[None, :], q, mask=mask_h[:, None] & (e == c)[None, :])
                if tl.max((eq == c).to(tl.int32), axis=0) > 0:
                    tl.store(sspare + rows * stride_sh + ((wq * 8) // GROUP)[None, :], sc,
                             mask=mask_h[:, None] & (eq == c)[None, :])
                    if ZCOL:
                        tl.store(sspare + rows * stride_sh + ZCOL + ((wq * 8) // GROUP)[None, :], zc,
                                 mask=mask_h[:, None] & (eq == c)[None, :])
            if CLAIM and NC > 1:        # each column to the spare of the entry holding its slot, if one does
                sp = claim_spare(e, claim_ptr, spare_ptr, NC)
                if tl.max(sp, axis=0) >= 0:
                    tl.store(q_ptr + sp[None, :] * stride_qe + rows * stride_qh + w[None, :], q,
                             mask=mask_h[:, None] & (sp >= 0)[None, :])
                spq = claim_spare(eq, claim_ptr, spare_ptr, NC)
                if tl.max(spq, axis=0) >= 0:
                    tl.store(s_ptr + spq[None, :] * stride_se + rows * stride_sh + ((wq * 8) // GROUP)[None, :],
                             sc, mask=mask_h[:, None] & (spq >= 0)[None, :])
                    if ZCOL:
                        tl.store(s_ptr + spq[None, :] * stride_se + rows * stride_sh + ZCOL +
                                 ((wq * 8) // GROUP)[None, :], zc, mask=mask_h[:, None] & (spq >= 0)[None, :])
            sc = sc.to(tl.float32)
            ab = act_ptr + (t * TOP_K + j) * I + w             # act_p[t, j, 0, w]
            mc = e != SKIP_ID
            xs = tl.zeros([BLOCK_W], tl.float32)
            d = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
            for n in tl.static_range(8):
                a = tl.load(ab + n * WPE, mask=mc, other=0.0)
                if FP4:
                    d += e2m1_scaled(q, n) * a[None, :]
                else:
                    xs += a
                    d += _nibble(q, ONE, n) * a[None, :]
            if FP4:
                acc += tl.sum(tl.reshape(d, [BLOCK_H, NQ, QW]), axis=2) * sc
            else:
                xq = tl.sum(tl.reshape(xs, [NQ, QW]), axis=1)[None, :]
                if ZCOL:
                    off = -(1.5 + zc.to(tl.float32) * 0.0625) * xq
                else:
                    off = -1.5 * xq
                acc += (tl.sum(tl.reshape(d, [BLOCK_H, NQ, QW]), axis=2) + off) * sc
            if PREFETCH == 1:
                j = j_n
                w = w_n
                e = e_n
                q = q_n
            if PREFETCH == 2:
                j = j1
                w = w1
                e = e1
                q = q1
                j1 = j_n
                w1 = w_n
                e1 = e_n
                q1 = q_n
        if FP4:
            out = tl.sum(acc, axis=1) * 16384.0
        else:
            out = tl.sum(acc, axis=1) * 16.0
        _store_out(out, out_ptr, add_ptr, t, offs_h, mask_h, stride_ot, stride_at, ADD)

    @triton.jit
    def _store_out(out, out_ptr, add_ptr, t, offs_h, mask_h, stride_ot, stride_at, ADD: tl.constexpr):
        """out[t] = the routed experts' sum (+ add[t], rounded to its dtype first as a separate add would)."""
        y = out.to(out_ptr.dtype.element_ty)
        if ADD:
            y = (y.to(tl.float32) + tl.load(add_ptr + t * stride_at + offs_h, mask=mask_h).to(tl.float32))
        tl.store(out_ptr + t * stride_ot + offs_h, y.to(out_ptr.dtype.element_ty), mask=mask_h)


# (BLOCK_I, BLOCK_W, warps) for the up phase and (BLOCK_H, BLOCK_W, warps) for the down phase per token bucket, and
# the prefetch depth: `bench/moe_int4.py --sweep` on the H200, bench/results/moe-int4-3 and (the same winners again,
# plus the depth sweep) moe-int4-4: 21.6 / 56.4 / 167.7 us at 1 / 4 / 16 tokens against bf16's 36.9 / 101.4 / 329.4.
# One-warp programs win the up phase by far (4 or 8 warps a program: up to 2x slower at 16 tokens); depth 2 loses
# everywhere (25.6 vs 21.6 us at 1 token), depth 0 vs 1 at 16 tokens is within noise (167.7 vs 169.1).
UP_CFG = {1: (8, 32, 1), 4: (8, 32, 1), 16: (16, 32, 1)}
DOWN_CFG = {1: (4, 256, 2), 4: (4, 128, 1), 16: (8, 128, 1)}
# Token x slot pairs up to which prefill also takes these kernels (a short prompt's chunk; above: the grouped tensor-core
# kernels of moe_int4_prefill.py). h200-21 (bench/moe_int4_prefill.py, full shape, one layer, random routing): these
# 0.28 / 0.42 / 0.54 / 0.99 / 1.87 ms at 16 / 26 / 46 / 100 / 200 tokens against the grouped path's 2.09 / 2.51 /
# 3.40 / 4.13 / 4.47 ms (its sort and launches, host included); with 10% of the experts in host RAM 3.92 against
# 6.65 ms at 100 tokens but 10.85 against 7.45 at 200 (each pair re-reads its host rows over PCIe). Was 256.
DECODE_MAX_TK = 1000
ONE_F32 = 0x3F800000           # the bits of 1.0f (see `_nibble`)
PREFETCH = {1: 1, 4: 1, 16: 0}  # blocks of words loading ahead of the one computed (0, 1, 2; both phases)


def activations(T: int, k: int, inter: int, device: torch.device) -> torch.Tensor:
    """The fp32 activations between the phases, [T, k, I] (nibble-major within a slot)."""
    return torch.empty(T, k, inter, dtype=torch.float32, device=device)


def quad_words(words: int, group: int) -> int:
    """Words a thread's 16-byte load holds that share one scale: the largest power of two up to 4 that divides
    the row's words and the group's (the kernels apply the scale once per such quad)."""
    g = math.gcd(math.gcd(words, group // 8), 4)
    return g & -g


def fused_moe_int4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: PackedExperts,
                   host: PackedExperts | None = None, first_host: int | None = None,
                   add: torch.Tensor | None = None,
                   claim: tuple[torch.Tensor, torch.Tensor] | None = None,
                   before_down: Callable[[], None] | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, k] (routed slots; SKIP skipped) -> [T, H] in x.dtype; = fused_moe_int4_ref (+ add).
    ids and weights may be column slices of wider tensors (the router's k + 1 slots: read in place); fp32 weights
    are rounded to x.dtype in the kernel (no cast launch). `host`: the
    slots from `first_host` on, packed the same way in (pinned) host memory. `add` [T, H]: added to the result inside the
    down launch (the shared expert's output: no separate add). `claim` = (slot int32 [1], spare int64 [1]) on the
    device, as `moe.fused_moe`'s: a selected claimed slot's q13, s13, q2 and s2 also end up in device slot spare
    (stored by the kernels as they read them; copied first where the kernels do not run). `before_down`: called
    between the two launches, where the down launch starts to read `add` (a stream join when another stream writes
    it: the shared expert beside the up launch, kernel flag `side_stream`)."""
    T, H = x.shape
    E, H_, I = experts.shape
    k = ids.shape[1]
    g, g2 = experts.group, experts.down_group
    if H_ != H or H % 8 or I % 8 or g % 8 or g2 % 8 or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)} ids {tuple(ids.shape)} experts (E, H, I) {(E, H_, I)} "
                         f"group {g} (H, I and the group must be multiples of 8)")
    check_claim(claim, experts.q13.device)
    if not triton_usable(x) or T * k > DECODE_MAX_TK:
        if claim is not None:
            copy_claimed(claim, ids, E if host is None else first_host, part_pairs(experts, host))
        if host is not None:
            raise ValueError("host rows of INT4 experts need the kernel path")
        out = grouped_moe_int4(x, ids, weights, experts)
        if before_down is not None:
            before_down()
        return out if add is None else out + add
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        if before_down is not None:
            before_down()
        return out
    x = x.contiguous()
    ids = ids if ids.dtype == torch.int32 and ids.stride(1) == 1 else ids.to(torch.int32).contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    act = activations(T, k, I, x.device)
    if add is not None and (add.shape != x.shape or add.stride(1) != 1):
        raise ValueError(f"add {tuple(add.shape)} must be [T, H] with contiguous rows")
    h = host or experts
    first = E if host is None else first_host
    pdl = pdl_usable(x)
    claim_ptr, spare_ptr = (None, None) if claim is None else claim
    nc = 1 if claim is None else claim[0].numel()
    b = _bucket(T)
    bi, bw, warps = UP_CFG[b]
    bi, bw = min(bi, _pow2(I)), min(bw, _pow2(H // 8))
    _int4_up_kernel[(T * k, triton.cdiv(I, bi))](
        x, ids, weights, experts.q13, experts.s13, h.q13, h.s13, act, ids.stride(0), weights.stride(0),
        experts.q13.stride(0), experts.q13.stride(1), experts.s13.stride(0), experts.s13.stride(1), first, ONE_F32,
        H=H, I=I, TOP_K=k, GROUP=g, QW=quad_words(H // 8, g), BLOCK_I=bi, BLOCK_W=bw, PREFETCH=PREFETCH[b],
        claim_ptr=claim_ptr, spare_ptr=spare_ptr, CLAIM=claim is not None, NC=nc, num_warps=warps, PDL=pdl,
        launch_pdl=pdl, ZCOL=zcol(H, g, experts), FP4=experts.fp4)
    bh, bw, warps = DOWN_CFG[b]
    bh, bw = min(bh, _pow2(H)), min(bw, _pow2(k * I // 8))
    if before_down is not None:
        before_down()
    _int4_down_kernel[(T, triton.cdiv(H, bh))](
        act, ids, experts.q2, experts.s2, h.q2, h.s2, out, out if add is None else add, ids.stride(0),
        experts.q2.stride(0), experts.q2.stride(1), experts.s2.stride(0), experts.s2.stride(1), out.stride(0),
        out.stride(0) if add is None else add.stride(0), first, ONE_F32, H=H, I=I, TOP_K=k, GROUP=g2,
        QW=quad_words(I // 8, g2), BLOCK_H=bh, BLOCK_W=bw, PREFETCH=PREFETCH[b], ADD=add is not None,
        claim_ptr=claim_ptr, spare_ptr=spare_ptr, CLAIM=claim is not None, NC=nc, num_warps=warps, PDL=pdl,
        launch_pdl=pdl, ZCOL=zcol(I, g2, experts), FP4=experts.fp4)
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
        w13 = dequantize_packed(experts.q13[e], experts.s13[e], experts.group, experts.fp4, x.dtype)
        w2 = dequantize_packed(experts.q2[e], experts.s2[e], experts.down_group, experts.fp4, x.dtype)
        g, u = torch.nn.functional.linear(x[tok], w13).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w2) * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out
