"""Decode prologue of gated attention in one launch: per-head RMSNorm + partial RoPE of q and k, the K/V (and QSA
index key) cache writes, the QSA indexer query's norm + RoPE, and sigmoid of the output gate.

Why: in PyTorch these are ~35 small kernels per attention layer (two norms of four ops each, two rotate-half RoPEs
of six, three index_put writes, the indexer's norm and RoPE, the gate's sigmoid and a reshape copy), each a few
microseconds of launch-bound work at decode, for a few KB of data (docs/performance.md).

Input is the one GEMV output row per token, [T, N] = [q|gate interleaved per head (q_proj) | k | v | indexer q |
indexer raw key] (the column offsets are arguments, so separate projections work too). Grid (T, roles): program j
of a token handles
    j < NH                      query head j: norm, RoPE -> q_out; sigmoid(gate head j) -> gate_out
    NH <= j < NH + KVH          key head: norm, RoPE -> k_cache[slot]; its value head -> v_cache[slot]
    next NI programs            indexer query head: norm, RoPE -> iq_out
    the last (with an indexer)  indexer raw key -> index_keys[slot]
Rounding follows `GatedAttention.forward`: the norm's output, each product of the RoPE and their sum, the sigmoid,
all round to the activation dtype where the PyTorch ops store them. cos/sin are the step's (already rounded) tables.
With the kernel flag `pdl` (`common.pdl_usable`) this kernel and `qsa_pool_update`'s launch as programmatic
dependents and wait (`common.pdl_wait`) first thing: the norm weights are the only loads no earlier kernel writes,
and they sit among the row's loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stage_worker.kernels.attention_prep_ref import PrepLayout
from stage_worker.kernels.common import pdl_usable, pdl_wait
from stage_worker.kernels.rmsnorm import round_to


@triton.jit
def _rotate_half(n, n_p, c, s, offs, RD: tl.constexpr, dt: tl.constexpr):
    """Rotate-half RoPE of the normed features `n` (partners `n_p`) on the first RD, rounding where
    `apply_rotary`'s bf16 ops round: each product, then their sum."""
    rotated = tl.where(offs < RD // 2, -n_p, n_p)
    return tl.where(offs < RD, round_to(round_to(n * c, dt) + round_to(rotated * s, dt), dt), n)


@triton.jit
def _norm_rope(src, w_ptr, cos_row, sin_row, eps, D: tl.constexpr, RD: tl.constexpr, BLOCK: tl.constexpr,
               dt: tl.constexpr):
    """Zero-centred RMSNorm of D features at `src`, then rotate-half RoPE on the first RD of them."""
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    n = round_to((x * rstd) * (1.0 + tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)), dt)
    if RD > 0:
        half: tl.constexpr = RD // 2
        in_rot = offs < RD
        partner = tl.where(offs < half, offs + half, offs - half)
        xp = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
        n_p = round_to((xp * rstd) * (1.0 + wp), dt)
        c = tl.load(cos_row + offs, mask=in_rot, other=0.0).to(tl.float32)
        s = tl.load(sin_row + offs, mask=in_rot, other=0.0).to(tl.float32)
        n = _rotate_half(n, n_p, c, s, offs, RD, dt)
    return n


@triton.jit
def _attn_prep_kernel(p_ptr, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, iqn_ptr,
                      q_out, g_out, k_cache, v_cache, iq_out, ik_cache,
                      stride_p, stride_c, eps,
                      NH: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
                      NI: tl.constexpr, DI: tl.constexpr,
                      Q_OFF: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr,
                      IQ_OFF: tl.constexpr, IK_OFF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                 # first: the projection row, cos/sin, the slots; every role stores after it
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = p_ptr + t * stride_p
    cos_row = cos_ptr + t * stride_c
    sin_row = sin_ptr + t * stride_c
    dt: tl.constexpr = q_out.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if j < NH:
        src = row + Q_OFF + j * 2 * HD
        q = _norm_rope(src, qn_ptr, cos_row, sin_row, eps, HD, RD, BLOCK, dt)
        tl.store(q_out + (t * NH + j) * HD + offs, q.to(dt), mask=offs < HD)
        g = tl.load(src + HD + offs, mask=offs < HD, other=0.0).to(tl.float32)
        tl.store(g_out + (t * NH + j) * HD + offs, round_to(1.0 / (1.0 + tl.exp(-g)), dt).to(dt), mask=offs < HD)
    elif j < NH + KVH:
        kh = j - NH
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k = _norm_rope(row + K_OFF + kh * HD, kn_ptr, cos_row, sin_row, eps, HD, RD, BLOCK, dt)
        dst = (slot * KVH + kh) * HD + offs
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=offs < HD)
        v = tl.load(row + V_OFF + kh * HD + offs, mask=offs < HD, other=0.0)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=offs < HD)
    elif j < NH + KVH + NI:
        ih = j - NH - KVH
        iq = _norm_rope(row + IQ_OFF + ih * DI, iqn_ptr, cos_row, sin_row, eps, DI, RD, BLOCK, dt)
        tl.store(iq_out + (t * NI + ih) * DI + offs, iq.to(dt), mask=offs < DI)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        raw = tl.load(row + IK_OFF + offs, mask=offs < DI, other=0.0)
        tl.store(ik_cache + slot * DI + offs, raw.to(ik_cache.dtype.element_ty), mask=offs < DI)


def attention_decode_prep(proj: torch.Tensor, layout: PrepLayout, cos: torch.Tensor, sin: torch.Tensor,
                          slot_mapping: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                          idx_q_norm_w: torch.Tensor | None = None, index_keys: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """proj [T, N] -> (q [T, NH, HD], sigmoid(gate) [T, NH * HD], indexer q [T, NI, DI] or None); writes the new
    tokens' K, V (and index key) rows at `slot_mapping`. Equals `attention_prep_ref.attention_decode_prep_ref`."""
    L = layout
    T = proj.shape[0]
    if L.rotary_dim > L.head_dim or (L.idx_heads and L.rotary_dim > L.idx_dim):
        raise ValueError(f"rotary_dim {L.rotary_dim} is wider than a head ({L.head_dim} / indexer {L.idx_dim})")
    if proj.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("proj, cos and sin need contiguous rows (cos and sin with the same strides)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V cache must be contiguous")
    dev, dt = proj.device, proj.dtype
    q = torch.empty((T, L.n_heads, L.head_dim), dtype=dt, device=dev)
    gate = torch.empty((T, L.n_heads * L.head_dim), dtype=dt, device=dev)
    iq = torch.empty((T, L.idx_heads, L.idx_dim), dtype=dt, device=dev) if L.idx_heads else None
    roles = L.n_heads + L.kv_heads + (L.idx_heads + 1 if L.idx_heads else 0)
    if T == 0:
        return q, gate, iq
    block = triton.next_power_of_2(max(L.head_dim, L.idx_dim))
    pdl = pdl_usable(proj)
    _attn_prep_kernel[(T, roles)](
        proj, cos, sin, slot_mapping, q_norm_w, k_norm_w, idx_q_norm_w if idx_q_norm_w is not None else q_norm_w,
        q, gate, k_cache, v_cache, iq if iq is not None else q, index_keys if index_keys is not None else k_cache,
        proj.stride(0), cos.stride(0), eps,
        NH=L.n_heads, KVH=L.kv_heads, HD=L.head_dim, RD=min(L.rotary_dim, cos.shape[-1]), NI=L.idx_heads,
        DI=L.idx_dim, Q_OFF=L.q_off, K_OFF=L.k_off, V_OFF=L.v_off, IQ_OFF=L.iq_off, IK_OFF=L.ik_off, BLOCK=block,
        num_warps=2, PDL=pdl, launch_pdl=pdl)
    return q, gate, iq


@triton.jit
def _pool_kernel(ik_ptr, pooled_ptr, tables_ptr, lens_ptr, w_ptr, inv_freq_ptr, eps, s_tb, n_table,
                 D: tl.constexpr, RATIO: tl.constexpr, PAGE: tl.constexpr, RD: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False, zero_ptr=None,
                 ZERO_N: tl.constexpr = 0, ZERO_BLOCK: tl.constexpr = 1):
    pdl_wait(PDL)                 # first: the lengths, the tables and the index-key cache all wait
    b = tl.program_id(0).to(tl.int64)
    if ZERO_N > 0:                # row b of the selection's histograms (`qsa_pool_update(zero=)`), after the wait
        zo = tl.arange(0, ZERO_BLOCK)
        for z0 in tl.static_range(0, ZERO_N, ZERO_BLOCK):
            tl.store(zero_ptr + b * ZERO_N + z0 + zo, tl.zeros([ZERO_BLOCK], tl.int32), mask=z0 + zo < ZERO_N)
    first = (tl.load(lens_ptr + b).to(tl.int64) - 1) // RATIO * RATIO
    i = tl.arange(0, BLOCK_R)
    pos = first + i
    page = tl.load(tables_ptr + b * s_tb + tl.minimum(pos // PAGE, n_table - 1), mask=i < RATIO, other=0)
    rows = page.to(tl.int64) * PAGE + pos % PAGE
    offs = tl.arange(0, BLOCK)
    m = offs < D
    dt: tl.constexpr = pooled_ptr.dtype.element_ty
    raw = tl.load(ik_ptr + rows[:, None] * D + offs[None, :], mask=(i < RATIO)[:, None] & m[None, :], other=0.0)
    mean = round_to(tl.sum(raw.to(tl.float32), axis=0) / RATIO, dt)
    rstd = tl.math.rsqrt(tl.sum(mean * mean, axis=0) / D + eps)
    n = round_to((mean * rstd) * (1.0 + tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)), dt)
    if RD > 0:
        half: tl.constexpr = RD // 2
        in_rot = offs < RD
        # The partner feature's normed value, from the same mean row (rotate-half pairs i and i +- half).
        partner = tl.where(offs < half, offs + half, offs - half)
        raw_p = tl.load(ik_ptr + rows[:, None] * D + partner[None, :],
                        mask=(i < RATIO)[:, None] & in_rot[None, :], other=0.0)
        mean_p = round_to(tl.sum(raw_p.to(tl.float32), axis=0) / RATIO, dt)
        n_p = round_to((mean_p * rstd) * (1.0 + tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)),
                       dt)
        f = first.to(tl.float32) * tl.load(inv_freq_ptr + offs % half, mask=in_rot, other=0.0)
        n = _rotate_half(n, n_p, round_to(tl.cos(f), dt), round_to(tl.sin(f), dt), offs, RD, dt)
    row0 = tl.sum(tl.where(i == 0, rows, 0), axis=0)
    tl.store(pooled_ptr + (row0 // RATIO) * D + offs, n.to(dt), mask=m)


def qsa_pool_update(index_keys: torch.Tensor, pooled_keys: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    k_norm_w: torch.Tensor, inv_freq: torch.Tensor, eps: float, block_size: int, ratio: int,
                    rotary_dim: int, zero: torch.Tensor | None = None) -> None:
    """Re-pool the compression block holding each sequence's newest token (mean of its raw index keys, norm,
    RoPE at the block's first position) into `pooled_keys`; one program per sequence, no host sync.
    Equals `attention_prep_ref.qsa_pool_update_ref`. `zero` (int32, contiguous, B rows: the QSA selection's radix
    histograms, `qsa.empty_histograms`) is zeroed too, so the step needs no memset launch of its own."""
    B, D = lens.shape[0], index_keys.shape[1]
    if B == 0:
        return
    extra = {}
    if zero is not None:
        assert zero.dtype == torch.int32 and zero.is_contiguous() and zero.shape[0] == B
        n = zero[0].numel()
        extra = {"zero_ptr": zero, "ZERO_N": n, "ZERO_BLOCK": min(triton.next_power_of_2(n), 2048)}
    pdl = pdl_usable(index_keys)
    _pool_kernel[(B,)](index_keys, pooled_keys, tables, lens, k_norm_w, inv_freq.float().contiguous(), eps,
                       tables.stride(0), tables.shape[1], D=D, RATIO=ratio, PAGE=block_size,
                       RD=min(rotary_dim, D), BLOCK_R=triton.next_power_of_2(ratio),
                       BLOCK=triton.next_power_of_2(D), num_warps=2, PDL=pdl, launch_pdl=pdl, **extra)
