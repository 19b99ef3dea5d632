"""Paged decode attention in Triton: split-K flash decoding over the block table, one launch (plus a small reduce).

Why: the reference path loops over sequences in Python and gathers the whole context; decode must be one launch per
step with no host sync, reading only the K/V rows it needs: every position before the token, or with QSA only the
`budget + ratio - 1` selected ones, a bounded number whatever the context length (001 §1).

Structure: grid (B, kv_heads, num_splits). A program loads the query heads of one GQA group (padded to 16 rows for
`tl.dot`), walks its share of the positions (or of the `selected` entries) in tiles of BLOCK_N, gathers those K/V
rows through the block table and keeps an online softmax in fp32 (exp2, log2 units). It writes its partial output,
normalised, and its log-sum-exp; `_reduce_kernel` merges the splits per (sequence, head). With one split the first
kernel writes the output itself. The number of splits comes from tensor shapes only (max context or S), never from
tensor values, so nothing waits on the GPU.
With the kernel flag `pdl` (`common.pdl_usable`) both kernels launch as programmatic dependents and wait
(`common.pdl_wait`) first thing: q, the context lengths, the tables, the caches (the new token's rows were just
written), the row cache's state and the partials are all written by earlier kernels; the reduce, launched while the
split kernel runs, waits for it there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from stage_worker.kernels.common import INTERPRET as _INTERPRET
from stage_worker.kernels.common import fix_interpreter_loop_bounds, pdl_usable, pdl_wait, sm_count
from stage_worker.kernels.rmsnorm import round_to


if _INTERPRET:
    fix_interpreter_loop_bounds()


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """fp32 operands: exact fp32 products (no TF32). The interpreter multiplies bf16 operands as raw uint16 bits, so
    there bf16 operands are widened first: exact, and the same math as the GPU's bf16 MMA with fp32 accumulation."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, sel_ptr, part_ptr, lse_ptr, out_ptr,
                  rk_ptr, rv_ptr, tag_ptr, hitmark_ptr, claim_ptr, epoch_ptr, n_slots,
                  scale_log2, n_sel,
                  s_qb, s_qh, s_kr, s_kh, s_vr, s_vh, s_tb, s_sb, s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh,
                  s_rr, s_rh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_SEL: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr, CACHED: tl.constexpr,
                  PDL: tl.constexpr = False, gate_ptr=None, s_gb=0, GATE: tl.constexpr = False):
    pdl_wait(PDL)                 # first: every load here reads what an earlier kernel wrote
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    if HAS_SEL:
        total = n_sel
    else:
        total = ctx
    chunk = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, total)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if CACHED:
        epoch = tl.load(epoch_ptr)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_range = j < end
        if HAS_SEL:
            pos = tl.load(sel_ptr + b.to(tl.int64) * s_sb + j, mask=in_range, other=-1)
            ok = in_range & (pos >= 0) & (pos < ctx)
        else:
            pos = j
            ok = in_range
        pos = tl.where(ok, pos, 0)
        page = tl.load(tables_ptr + b.to(tl.int64) * s_tb + pos // PAGE, mask=ok, other=0)
        row = page.to(tl.int64) * PAGE + pos % PAGE
        kv_mask = ok[:, None] & d_ok[None, :]
        k_at = k_ptr + row[:, None] * s_kr + kvh * s_kh + offs_d[None, :]
        v_at = v_ptr + row[:, None] * s_vr + kvh * s_vh + offs_d[None, :]
        if CACHED:      # the row cache (kv_row_cache.py): a hit loads VRAM, a miss host memory, through one pointer
            slot = tl.where(ok, row % n_slots, 0)
            mark = tl.load(hitmark_ptr + slot, mask=ok, other=-1)
            hit = ok & (mark == epoch) & (tl.load(tag_ptr + slot, mask=ok, other=-1) == row)
            r_at = slot[:, None] * s_rr + kvh * s_rh + offs_d[None, :]
            k_at = tl.where(hit[:, None], rk_ptr + r_at, k_at)
            v_at = tl.where(hit[:, None], rv_ptr + r_at, v_at)
        k = tl.load(k_at, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_F32) * scale_log2                             # [BLOCK_G, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                       # a tile with no visible key
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_at, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m_i = m_new
        if CACHED:      # a miss fills its slot if its claim won and no column hit the slot this step
            claim = tl.load(claim_ptr + slot, mask=ok, other=-1)
            fill = ok & ~hit & (mark != epoch) & (claim == ((epoch << 32) | row))
            tl.store(rk_ptr + r_at, k, mask=fill[:, None] & d_ok[None, :])
            tl.store(rv_ptr + r_at, v, mask=fill[:, None] & d_ok[None, :])
            tl.store(tag_ptr + slot, row, mask=fill)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_mask = g_ok[:, None] & d_ok[None, :]
    if DIRECT:
        res = o.to(out_ptr.dtype.element_ty)
        if GATE:
            res = _gated(res, gate_ptr + b.to(tl.int64) * s_gb + heads[:, None] * HEAD_DIM + offs_d[None, :],
                         out_mask)
        tl.store(out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_d[None, :], res, mask=out_mask)
    else:
        base = b.to(tl.int64) * s_pb + split * s_ps
        tl.store(part_ptr + base + heads[:, None] * s_ph + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * s_lb + heads * s_lh + split, lse, mask=g_ok)


@triton.jit
def _gated(res, gate_at, mask):
    """res (the output's dtype) times the gate at `gate_at`, rounded once as PyTorch's product of the two rounds it
    (fp32 math, one rounding to nearest even): the same bits as `out * gate` after the kernel."""
    g = tl.load(gate_at, mask=mask, other=0.0)
    return round_to(res.to(tl.float32) * g.to(tl.float32), res.dtype).to(res.dtype)


@triton.jit
def _reduce_kernel(part_ptr, lse_ptr, out_ptr, s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh,
                   HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr = False, gate_ptr=None, s_gb=0,
                   GATE: tl.constexpr = False):
    pdl_wait(PDL)                 # first: the split kernel's partials and log-sum-exps
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + b * s_lb + h * s_lh + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))                    # 0 for empty splits
    part = tl.load(part_ptr + b * s_pb + h * s_ph + offs_s[:, None] * s_ps + offs_d[None, :],
                   mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    res = o.to(out_ptr.dtype.element_ty)
    if GATE:
        res = _gated(res, gate_ptr + b * s_gb + h * HEAD_DIM + offs_d, offs_d < HEAD_DIM)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, res, mask=offs_d < HEAD_DIM)


def choose_num_splits(programs: int, length: int, device: torch.device, min_per_split: int = 64) -> int:
    """Enough splits for about two programs per SM, but no split shorter than `min_per_split` positions."""
    want = triton.cdiv(2 * sm_count(device, cpu=8), max(programs, 1))
    return max(1, min(want, triton.cdiv(length, min_per_split), 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, block_size: int,
                           selected: torch.Tensor | None = None, *, max_context_len: int | None = None,
                           num_splits: int | None = None, block_n: int | None = None,
                           row_cache=None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [rows, kv_heads, D]; block_tables [B, max_blocks] int32; context_lens [B] int32 (the
    new token's K/V already written); selected [B, S] int32 positions, -1 = padding. Returns [B, Hq, D] like q.

    `max_context_len` (a host-side bound the scheduler knows) only sizes the split; without it the table width is
    used. `num_splits` / `block_n` override the heuristics (tests). `row_cache` (`kv_row_cache.RowCache`, with
    `selected`): hits read its region, misses host memory and fill it; `invalidate` and `plan` of this step must
    have run (`kv_row_cache.py`). Same output bits either way. `gate` ([B, Hq * D] or [B, Hq, D], rows
    contiguous, q's dtype: gated attention's sigmoid gate): the result is out * gate, the same bits as that product
    after the call, with no launch of its own."""
    B, Hq, D = q.shape
    kv_heads = k_cache.shape[1]
    assert Hq % kv_heads == 0 and k_cache.shape[2] == D and v_cache.shape == k_cache.shape
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "cast the query to the cache's dtype"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    group = Hq // kv_heads
    if selected is not None:
        assert selected.dtype == torch.int32 and selected.stride(-1) == 1
        length = selected.shape[1]
    else:
        length = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    block_n = block_n or (64 if D <= 128 else 32)
    splits = num_splits or choose_num_splits(B * kv_heads, length, q.device)
    out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    else:
        part = lse = out                              # neither read nor written: the kernel stores `out` itself
    sel = selected if selected is not None else context_lens
    rc = row_cache
    assert rc is None or (selected is not None and rc.k.dtype == k_cache.dtype and rc.k.shape[1:] == k_cache.shape[1:]
                          and rc.k.is_contiguous() and rc.v.is_contiguous())
    if gate is not None:
        assert gate.dtype == q.dtype and gate.shape[0] == B and gate[0].numel() == Hq * D and gate.is_contiguous()
    gated = {"gate_ptr": gate, "s_gb": Hq * D, "GATE": True} if gate is not None else {}
    block_d = max(16, triton.next_power_of_2(D))
    pdl = pdl_usable(q)
    _split_kernel[(B, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, sel, part, lse, out,
        *((rc.k, rc.v, rc.tag, rc.hitmark, rc.claim, rc.epoch, rc.n_slots) if rc is not None else
          (k_cache, v_cache, context_lens, context_lens, context_lens, context_lens, 1)),
        scale * math.log2(math.e), length if selected is not None else 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), sel.stride(0),
        *(part.stride()[:3] if splits > 1 else (0, 0, 0)), *(lse.stride()[:2] if splits > 1 else (0, 0)),
        out.stride(0), out.stride(1), *((rc.k.stride(0), rc.k.stride(1)) if rc is not None else (0, 0)),
        GROUP=group, HEAD_DIM=D, PAGE=block_size, NUM_SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_SEL=selected is not None, DIRECT=splits == 1,
        DOT_F32=q.dtype == torch.float32 or _INTERPRET, CACHED=rc is not None, num_warps=4, PDL=pdl,
        launch_pdl=pdl, **(gated if splits == 1 else {}))
    if splits > 1:
        _reduce_kernel[(B, Hq)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=D, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4,
            PDL=pdl, launch_pdl=pdl, **gated)
    return out
