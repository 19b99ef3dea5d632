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
"""

from __future__ import annotations

import math

import torch

from stage_worker.kernels.moe import SKIP, _bucket, _pow2, expert_rows, triton, triton_usable
from stage_worker.kernels.moe_int4_ref import PackedExperts, dequantize_int4

if triton is not None:
    import triton.language as tl

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
                        BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr):
        """act[t, j, i-block] = w[t, j] * silu(Wg_e x_t) * (Wu_e x_t), W in INT4 words and group scales, stored
        nibble-major (act_p[t, j, i % 8, i // 8]) for the down kernel's contiguous loads.

        An iteration takes [BLOCK_I, BLOCK_W] words of the gate rows and of the up rows (16-byte loads; a thread
        holds several rows, so the x values it gathers serve all of them); the words of the next PREFETCH (0, 1
        or 2) blocks are already loading while one is computed. Per word: d = sum_n (1 + q_n/16) x_n (the
        `_nibble` floats) and sum_n (q_n - 8) x_n = 16 (d - 1.5 sum_n x_n); a thread's QW words share a scale,
        applied once to their sum; the 16 at the end."""
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
            sg = tl.load(sbase + rg * stride_sr + grp, mask=mq, other=0.0).to(tl.float32)
            su = tl.load(sbase + ru * stride_sr + grp, mask=mq, other=0.0).to(tl.float32)
            if PREFETCH == 0:
                qg, qu = _up_words(qbase, rg, ru, stride_qr, ow, mask_i, W)
            else:
                qg_n, qu_n = _up_words(qbase, rg, ru, stride_qr, ow + PREFETCH * BLOCK_W, mask_i, W)
            xs = tl.zeros([BLOCK_W], tl.float32)
            dg = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
            du = tl.zeros([BLOCK_I, BLOCK_W], tl.float32)
            for n in tl.static_range(8):
                xn = tl.load(x_ptr + t * H + ow * 8 + n, mask=mw, other=0.0).to(tl.float32)
                xs += xn
                dg += _nibble(qg, ONE, n) * xn[None, :]
                du += _nibble(qu, ONE, n) * xn[None, :]
            off = (-1.5 * tl.sum(tl.reshape(xs, [NQ, QW]), axis=1))[None, :]
            acc_g += (tl.sum(tl.reshape(dg, [BLOCK_I, NQ, QW]), axis=2) + off) * sg
            acc_u += (tl.sum(tl.reshape(du, [BLOCK_I, NQ, QW]), axis=2) + off) * su
            if PREFETCH == 1:
                qg = qg_n
                qu = qu_n
            if PREFETCH == 2:
                qg = qg1
                qu = qu1
                qg1 = qg_n
                qu1 = qu_n
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
                          BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr, ADD: tl.constexpr):
        """out[t, h-block] = sum_j W2_e[h-block] act_p[t, j] (the router weight is in act), in fp32.

        A token's k experts' rows are one long row of k * I/8 words, BLOCK_W of them an iteration: a block spans
        experts, so a program streams all k experts' rows with no per-expert loop (and the next PREFETCH blocks
        in flight); the act_p loads are contiguous. Columns of a SKIP slot are masked: neither their words nor
        their activations (never written) are read. With ADD, add[t] (the shared expert's output) is added before
        the store."""
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        rows = offs_h[:, None].to(tl.int64)
        WPE: tl.constexpr = I // 8                               # words per expert row
        NQ: tl.constexpr = BLOCK_W // QW                        # scale quads a block
        offs_w = tl.arange(0, BLOCK_W)
        offs_q = tl.arange(0, NQ) * QW
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
                         mask=mask_h[:, None] & (eq != SKIP_ID)[None, :], other=0.0).to(tl.float32)
            ab = act_ptr + (t * TOP_K + j) * I + w             # act_p[t, j, 0, w]
            mc = e != SKIP_ID
            xs = tl.zeros([BLOCK_W], tl.float32)
            d = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
            for n in tl.static_range(8):
                a = tl.load(ab + n * WPE, mask=mc, other=0.0)
                xs += a
                d += _nibble(q, ONE, n) * a[None, :]
            off = (-1.5 * tl.sum(tl.reshape(xs, [NQ, QW]), axis=1))[None, :]
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
        _store_out(tl.sum(acc, axis=1) * 16.0, out_ptr, add_ptr, t, offs_h, mask_h, stride_ot, stride_at, ADD)

    @triton.jit
    def _store_out(out, out_ptr, add_ptr, t, offs_h, mask_h, stride_ot, stride_at, ADD: tl.constexpr):
        """out[t] = the routed experts' sum (+ add[t], rounded to its dtype first as a separate add would)."""
        y = out.to(out_ptr.dtype.element_ty)
        if ADD:
            y = (y.to(tl.float32) + tl.load(add_ptr + t * stride_at + offs_h, mask=mask_h).to(tl.float32))
        tl.store(out_ptr + t * stride_ot + offs_h, y.to(out_ptr.dtype.element_ty), mask=mask_h)


    # ---- the split-K geometry (`splitk`, kernel flag moe_int4_splitk; issue 17) ----------------------------------
    # A tile is 4-D, [LR, KS, R, BW]: LR rows across lanes, KS slices of K, R rows a thread (so the x or
    # activation values it loads serve R rows), BW words a slice (16-byte loads of 4 words a thread). Triton's
    # coalescing fills lanes and warps in the order of contiguity, ties by dimension (the words, then LR, KS, R):
    # BW/4 lanes along the words, LR along the rows, the rest of the warp and all the warps along KS, R in each
    # thread. So the warps of a program split each row's words between them instead of taking other rows, and
    # the slices' partial sums meet once, in the program's fixed-order reduction over KS at the end
    # (deterministic, no atomics, no extra buffer). Slice s takes chunks of BW words s, s + KS, s + 2 KS, ...
    # The x / activation values and the slices' ids are loaded as 2-D [KS, BW] / [KS, 1] tensors and broadcast:
    # loaded 4-D, the compiler converted the [LR, KS, R, BW] products instead of the small vectors (sm_90 TTGIR).

    @triton.jit
    def _tile4(R: tl.constexpr, KS: tl.constexpr, LR: tl.constexpr, BW: tl.constexpr):
        """The index tensors of a [LR, KS, R, BW] tile: row within the program (r * LR + lr), slice, word; and
        the slice and word indices as 2-D [KS, BW] (`_vec`)."""
        lr = tl.arange(0, LR)[:, None, None, None]
        s = tl.arange(0, KS)[None, :, None, None]
        r = tl.arange(0, R)[None, None, :, None]
        ow = tl.arange(0, BW)[None, None, None, :]
        return r * LR + lr, s, ow, tl.arange(0, KS)[:, None], tl.arange(0, BW)[None, :]

    @triton.jit
    def _rows2(pid, R: tl.constexpr, LR: tl.constexpr):
        """The program's rows as [LR, R] (the layout of a tile summed over its words and slices)."""
        return pid * (R * LR) + tl.arange(0, R)[None, :] * LR + tl.arange(0, LR)[:, None]

    @triton.jit
    def _up_split_words(qbase, rg, ru, stride_qr, c, ow, mask_i, W: tl.constexpr, NC: tl.constexpr,
                        BW: tl.constexpr):
        """Gate and up words of chunks c (masked past the row's end / the last chunk)."""
        w = c * BW + ow
        m = mask_i & (w < W) & (c < NC)
        return (tl.load(qbase + rg * stride_qr + w, mask=m, other=0),
                tl.load(qbase + ru * stride_qr + w, mask=m, other=0))

    @triton.jit
    def _int4_up_split_kernel(x_ptr, ids_ptr, wts_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, act_ptr, stride_it, stride_wt,
                              stride_qe, stride_qr, stride_se, stride_sr, FIRST_HOST, ONE, H: tl.constexpr,
                              I: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                              KS: tl.constexpr, LR: tl.constexpr, BW: tl.constexpr, PREFETCH: tl.constexpr):
        """`_int4_up_kernel`'s result with the [R, KS, LR, BW] tile: grid (T * k, cdiv(I, R * LR)), KS slices of
        each row's words in flight at once (across the program's warps); the next round's words load while one
        is computed (PREFETCH 1). With GROUP a multiple of 8 BW words a chunk has one scale a row (loaded once a
        chunk), else one a word."""
        tj = tl.program_id(0)
        t = tj // TOP_K
        e = tl.load(ids_ptr + t * stride_it + tj % TOP_K).to(tl.int64)
        if e == SKIP_ID:
            return
        qbase = expert_rows(e, q_ptr, q_ptr, hq_ptr, stride_qe, FIRST_HOST)
        sbase = expert_rows(e, s_ptr, s_ptr, hs_ptr, stride_se, FIRST_HOST)
        W: tl.constexpr = H // 8
        NC: tl.constexpr = (W + BW - 1) // BW                  # chunks a row
        ROUNDS: tl.constexpr = (NC + KS - 1) // KS
        CHUNK_SCALE: tl.constexpr = GROUP % (8 * BW) == 0
        ri, s, ow, s2, ow2 = _tile4(R, KS, LR, BW)
        offs_i = tl.program_id(1) * (R * LR) + ri               # [LR, 1, R, 1]
        mask_i = offs_i < I
        rg = offs_i.to(tl.int64)
        ru = rg + I
        if PREFETCH:
            qg, qu = _up_split_words(qbase, rg, ru, stride_qr, s, ow, mask_i, W, NC, BW)
        acc_g = tl.zeros([LR, KS, R, BW], tl.float32)
        acc_u = tl.zeros([LR, KS, R, BW], tl.float32)
        for rnd in range(ROUNDS):
            c = rnd * KS + s                                    # [1, KS, 1, 1]
            w = c * BW + ow
            mw = (w < W) & (c < NC)
            w2 = (rnd * KS + s2) * BW + ow2                     # [KS, BW]
            mw2 = (w2 < W) & (rnd * KS + s2 < NC)
            if PREFETCH:
                qg_n, qu_n = _up_split_words(qbase, rg, ru, stride_qr, c + KS, ow, mask_i, W, NC, BW)
            else:
                qg, qu = _up_split_words(qbase, rg, ru, stride_qr, c, ow, mask_i, W, NC, BW)
            if CHUNK_SCALE:
                grp = (c * BW * 8) // GROUP
                ms = mask_i & (c < NC)
            else:
                grp = (w * 8) // GROUP
                ms = mask_i & mw
            sg = tl.load(sbase + rg * stride_sr + grp, mask=ms, other=0.0).to(tl.float32)
            su = tl.load(sbase + ru * stride_sr + grp, mask=ms, other=0.0).to(tl.float32)
            xs = tl.zeros([KS, BW], tl.float32)
            dg = tl.zeros([LR, KS, R, BW], tl.float32)
            du = tl.zeros([LR, KS, R, BW], tl.float32)
            for n in tl.static_range(8):
                x2 = tl.load(x_ptr + t * H + w2 * 8 + n, mask=mw2, other=0.0).to(tl.float32)
                xs += x2
                xn = x2[None, :, None, :]
                dg += _nibble(qg, ONE, n) * xn
                du += _nibble(qu, ONE, n) * xn
            off = (-1.5 * xs)[None, :, None, :]
            acc_g += (dg + off) * sg
            acc_u += (du + off) * su
            if PREFETCH:
                qg = qg_n
                qu = qu_n
        g = tl.sum(tl.sum(acc_g, axis=3), axis=1) * 16.0       # [LR, R]: the fixed-order sum over the slices
        u = tl.sum(tl.sum(acc_u, axis=3), axis=1) * 16.0
        wt = tl.load(wts_ptr + t * stride_wt + tj % TOP_K).to(x_ptr.dtype.element_ty).to(tl.float32)
        act = g * tl.sigmoid(g) * u * wt
        oi = _rows2(tl.program_id(1), R, LR)
        tl.store(act_ptr + tj * I + (oi % 8) * (I // 8) + oi // 8, act, mask=oi < I)

    @triton.jit
    def _down_split_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, c, ow, rows, mask_h, stride_qe, stride_qh,
                          FIRST_HOST, TOP_K: tl.constexpr, WPE: tl.constexpr, NCE: tl.constexpr, BW: tl.constexpr):
        """(first word cw, expert e, words) of chunks c of a token's k experts' rows, NCE chunks an
        expert (a chunk never spans two experts: one expert id and one table, device or host, a slice); SKIP
        slots and chunks past the last are masked: not read."""
        j = c // NCE
        e = tl.load(ids_ptr + t * stride_it + j, mask=j < TOP_K, other=SKIP_ID).to(tl.int64)     # [1, KS, 1, 1]
        cw = (c - j * NCE) * BW
        qb = tl.where(e >= FIRST_HOST, hq_ptr + (e - FIRST_HOST) * stride_qe, q_ptr + e * stride_qe)
        m = mask_h & (e != SKIP_ID) & (cw + ow < WPE)
        return cw, e, tl.load(qb + rows * stride_qh + cw + ow, mask=m, other=0)

    @triton.jit
    def _int4_down_split_kernel(act_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, out_ptr, add_ptr, stride_it,
                                stride_qe, stride_qh, stride_se, stride_sh, stride_ot, stride_at, FIRST_HOST, ONE,
                                H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr,
                                R: tl.constexpr, KS: tl.constexpr, LR: tl.constexpr, BW: tl.constexpr,
                                PREFETCH: tl.constexpr, ADD: tl.constexpr):
        """`_int4_down_kernel`'s result with the [R, KS, LR, BW] tile: grid (T, cdiv(H, R * LR)); the k experts'
        rows cut into chunks of BW words that stay within one expert (so a slice's words are 16-byte loads from
        one table, with one id load a slice, not one a column), KS chunks in flight a round; activations are
        16-byte loads too (nibble-major act_p)."""
        t = tl.program_id(0)
        WPE: tl.constexpr = I // 8
        NCE: tl.constexpr = (WPE + BW - 1) // BW              # chunks an expert
        NC: tl.constexpr = TOP_K * NCE
        ROUNDS: tl.constexpr = (NC + KS - 1) // KS
        CHUNK_SCALE: tl.constexpr = GROUP % (8 * BW) == 0
        ri, s, ow, s2, ow2 = _tile4(R, KS, LR, BW)
        offs_h = tl.program_id(1) * (R * LR) + ri
        mask_h = offs_h < H
        rows = offs_h.to(tl.int64)
        if PREFETCH:
            cw, e, q = _down_split_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, s, ow, rows, mask_h, stride_qe,
                                         stride_qh, FIRST_HOST, TOP_K, WPE, NCE, BW)
        acc = tl.zeros([LR, KS, R, BW], tl.float32)
        for rnd in range(ROUNDS):
            c = rnd * KS + s
            if PREFETCH:
                cw_n, e_n, q_n = _down_split_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, c + KS, ow, rows,
                                                       mask_h, stride_qe, stride_qh, FIRST_HOST, TOP_K, WPE, NCE,
                                                       BW)
            else:
                cw, e, q = _down_split_words(q_ptr, hq_ptr, ids_ptr, stride_it, t, c, ow, rows, mask_h,
                                             stride_qe, stride_qh, FIRST_HOST, TOP_K, WPE, NCE, BW)
            w = cw + ow
            live = (e != SKIP_ID) & (w < WPE)                   # [1, KS, 1, BW]
            sb = tl.where(e >= FIRST_HOST, hs_ptr + (e - FIRST_HOST) * stride_se, s_ptr + e * stride_se)
            if CHUNK_SCALE:
                sc = tl.load(sb + rows * stride_sh + (cw * 8) // GROUP, mask=mask_h & (e != SKIP_ID),
                             other=0.0).to(tl.float32)
            else:
                sc = tl.load(sb + rows * stride_sh + (w * 8) // GROUP, mask=mask_h & live, other=0.0).to(tl.float32)
            # the activations as [KS, BW]: the slices' slot and first word again, 2-D (see above)
            c2 = rnd * KS + s2
            j2 = c2 // NCE
            e2 = tl.load(ids_ptr + t * stride_it + j2, mask=j2 < TOP_K, other=SKIP_ID)
            w2 = (c2 - j2 * NCE) * BW + ow2
            ab = act_ptr + (t * TOP_K + j2) * I + w2            # act_p[t, j, 0, w]
            live2 = (e2 != SKIP_ID) & (w2 < WPE)
            xs = tl.zeros([KS, BW], tl.float32)
            d = tl.zeros([LR, KS, R, BW], tl.float32)
            for n in tl.static_range(8):
                a = tl.load(ab + n * WPE, mask=live2, other=0.0)
                xs += a
                d += _nibble(q, ONE, n) * a[None, :, None, :]
            acc += (d - 1.5 * xs[None, :, None, :]) * sc
            if PREFETCH:
                cw = cw_n
                e = e_n
                q = q_n
        out = tl.sum(tl.sum(acc, axis=3), axis=1) * 16.0       # [LR, R]: the fixed-order sum over the slices
        oh = _rows2(tl.program_id(1), R, LR)
        mh = oh < H
        y = out.to(out_ptr.dtype.element_ty)
        if ADD:
            y = (y.to(tl.float32) + tl.load(add_ptr + t * stride_at + oh, mask=mh).to(tl.float32))
        tl.store(out_ptr + t * stride_ot + oh, y.to(out_ptr.dtype.element_ty), mask=mh)


# (BLOCK_I, BLOCK_W, warps) for the up phase and (BLOCK_H, BLOCK_W, warps) for the down phase per token bucket, and
# the prefetch depth: `bench/moe_int4.py --sweep` on the H200, bench/results/moe-int4-3 and (the same winners again,
# plus the depth sweep) moe-int4-4: 21.6 / 56.4 / 167.7 us at 1 / 4 / 16 tokens against bf16's 36.9 / 101.4 / 329.4.
# One-warp programs win the up phase by far (4 or 8 warps a program: up to 2x slower at 16 tokens); depth 2 loses
# everywhere (25.6 vs 21.6 us at 1 token), depth 0 vs 1 at 16 tokens is within noise (167.7 vs 169.1).
UP_CFG = {1: (8, 32, 1), 4: (8, 32, 1), 16: (16, 32, 1)}
DOWN_CFG = {1: (4, 256, 2), 4: (4, 128, 1), 16: (8, 128, 1)}
DECODE_MAX_TK = 256
ONE_F32 = 0x3F800000           # the bits of 1.0f (see `_nibble`)
PREFETCH = {1: 1, 4: 1, 16: 0}  # blocks of words loading ahead of the one computed (0, 1, 2; both phases)


# The split-K geometry (`splitk`, up to SPLITK_MAX_T tokens): (R rows a thread, LR rows across lanes, BW words a
# slice) per phase and token bucket; the warps a program (and with them KS, the slices: 32 * warps / (LR * BW / 4))
# come from the SM count (`split_warps`). GPU-unverified guesses: the GPU test times them
# (tests/test_kernel_moe_int4.py, bench/results/moe-int4-6/next.txt). At the full shape, 1 token: the up phase
# 800 programs of 2 warps (4 slices of 16 words, 5 rounds: H/8 = 320 words = 20 chunks), the down phase 320 of 4
# (8 slices, 50 chunks of 16 words, 7 rounds), against 800 one-warp and 640 two-warp programs before (6 and 9
# warps an SM; ncu, bench/results/moe-int4-4).
UP_SPLIT_CFG = {1: (2, 4, 16), 4: (2, 4, 16)}
DOWN_SPLIT_CFG = {1: (2, 4, 16), 4: (4, 4, 16)}
SPLITK_MAX_T = 4
SPLITK_WARPS_PER_SM = 16        # warps a launch aims at an SM (register-bound occupancy allows ~20 at ~96 registers)
SPLITK_MAX_WASTE = 0.25         # most of a launch's chunk slots a last partial round may leave idle
H200_SMS = 132                  # the SM count off CUDA (interpreter tests take the H200's geometry)
_sms: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's SM count (cached; no sync), H200_SMS off CUDA."""
    if device.type != "cuda":
        return H200_SMS
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _sms:
        _sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _sms[i]


def split_warps(programs: int, chunks: int, LR: int, BW: int, sms: int) -> tuple[int, int]:
    """(warps a program, KS slices) for a split launch of `programs` programs over rows of `chunks` chunks: the
    most warps (a power of two up to 8) that keep the launch at or under SPLITK_WARPS_PER_SM warps an SM, fewer where
    the slices' last round would leave more than SPLITK_MAX_WASTE of the chunk slots idle; KS at least 1."""
    lanes = max(1, 32 // max(1, LR * BW // 4))      # slices a warp holds
    warps = 8
    while warps > 1 and programs * warps > SPLITK_WARPS_PER_SM * sms:
        warps //= 2
    while warps > 1:
        ks = lanes * warps
        if ks * -(-chunks // ks) <= chunks * (1 + SPLITK_MAX_WASTE):
            break
        warps //= 2
    return warps, lanes * warps


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
                   add: torch.Tensor | None = None, splitk: bool = True) -> torch.Tensor:
    """x [T, H], ids/weights [T, k] (routed slots; SKIP skipped) -> [T, H] in x.dtype; = fused_moe_int4_ref (+ add).
    ids and weights may be column slices of wider tensors (the router's k + 1 slots: read in place); fp32 weights
    are rounded to x.dtype in the kernel (no cast launch). `host`: the
    slots from `first_host` on, packed the same way in (pinned) host memory. `add` [T, H]: added to the result inside the
    down launch (the shared expert's output: no separate add). `splitk` (kernel flag moe_int4_splitk): up to
    SPLITK_MAX_T tokens, the split-K kernels (each row's words across a program's warps, the grid from the SM
    count); off, or more tokens: the row-block kernels."""
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
        out = grouped_moe_int4(x, ids, weights, experts)
        return out if add is None else out + add
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    x = x.contiguous()
    ids = ids if ids.dtype == torch.int32 and ids.stride(1) == 1 else ids.to(torch.int32).contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    act = activations(T, k, I, x.device)
    if add is not None and (add.shape != x.shape or add.stride(1) != 1):
        raise ValueError(f"add {tuple(add.shape)} must be [T, H] with contiguous rows")
    h = host or experts
    first = E if host is None else first_host
    b = _bucket(T)
    if splitk and T <= SPLITK_MAX_T:
        _launch_split(x, ids, weights, experts, h, first, act, out, add, b)
        return out
    bi, bw, warps = UP_CFG[b]
    bi, bw = min(bi, _pow2(I)), min(bw, _pow2(H // 8))
    _int4_up_kernel[(T * k, triton.cdiv(I, bi))](
        x, ids, weights, experts.q13, experts.s13, h.q13, h.s13, act, ids.stride(0), weights.stride(0),
        experts.q13.stride(0), experts.q13.stride(1), experts.s13.stride(0), experts.s13.stride(1), first, ONE_F32,
        H=H, I=I, TOP_K=k, GROUP=g, QW=quad_words(H // 8, g), BLOCK_I=bi, BLOCK_W=bw, PREFETCH=PREFETCH[b],
        num_warps=warps)
    bh, bw, warps = DOWN_CFG[b]
    bh, bw = min(bh, _pow2(H)), min(bw, _pow2(k * I // 8))
    _int4_down_kernel[(T, triton.cdiv(H, bh))](
        act, ids, experts.q2, experts.s2, h.q2, h.s2, out, out if add is None else add, ids.stride(0),
        experts.q2.stride(0), experts.q2.stride(1), experts.s2.stride(0), experts.s2.stride(1), out.stride(0),
        out.stride(0) if add is None else add.stride(0), first, ONE_F32, H=H, I=I, TOP_K=k, GROUP=g2,
        QW=quad_words(I // 8, g2), BLOCK_H=bh, BLOCK_W=bw, PREFETCH=PREFETCH[b], ADD=add is not None,
        num_warps=warps)
    return out


def _launch_split(x, ids, weights, experts: PackedExperts, h: PackedExperts, first: int, act, out, add, b: int):
    """The split-K pair (`_int4_up_split_kernel`, `_int4_down_split_kernel`) at token bucket b."""
    T, H = x.shape
    I = experts.shape[2]
    k = ids.shape[1]
    sms = sm_count(x.device)
    R, LR, BW = UP_SPLIT_CFG[b]
    BW = min(BW, _pow2(H // 8))
    LR = min(LR, 32 // max(1, BW // 4))
    programs = triton.cdiv(I, R * LR)
    warps, ks = split_warps(T * k * programs, triton.cdiv(H // 8, BW), LR, BW, sms)
    _int4_up_split_kernel[(T * k, programs)](
        x, ids, weights, experts.q13, experts.s13, h.q13, h.s13, act, ids.stride(0), weights.stride(0),
        experts.q13.stride(0), experts.q13.stride(1), experts.s13.stride(0), experts.s13.stride(1), first, ONE_F32,
        H=H, I=I, TOP_K=k, GROUP=experts.group, R=R, KS=ks, LR=LR, BW=BW, PREFETCH=1, num_warps=warps)
    R, LR, BW = DOWN_SPLIT_CFG[b]
    BW = min(BW, _pow2(I // 8))
    LR = min(LR, 32 // max(1, BW // 4))
    programs = triton.cdiv(H, R * LR)
    warps, ks = split_warps(T * programs, k * triton.cdiv(I // 8, BW), LR, BW, sms)
    _int4_down_split_kernel[(T, programs)](
        act, ids, experts.q2, experts.s2, h.q2, h.s2, out, out if add is None else add, ids.stride(0),
        experts.q2.stride(0), experts.q2.stride(1), experts.s2.stride(0), experts.s2.stride(1), out.stride(0),
        out.stride(0) if add is None else add.stride(0), first, ONE_F32, H=H, I=I, TOP_K=k,
        GROUP=experts.down_group, R=R, KS=ks, LR=LR, BW=BW, PREFETCH=1, ADD=add is not None, num_warps=warps)


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
