"""Gated DeltaNet decode step in two Triton kernels (reference: `deltanet_decode_ref.py`).

Why: in PyTorch a decode step of one GatedDeltaNet layer is ~40 small kernels (gates, the conv step's gather, cat,
index_put, multiply, sum and SiLU, splits and copies, the state gather/scatter, the recurrence, ~8 for the gated
RMSNorm); at decode they are launch-bound, not byte-bound. Here the layer is one GEMV (the four input projections
fused into one weight by `GatedDeltaNet.fuse_projections`), these two kernels, and out_proj.

`_gdn_recurrence_kernel`, grid (B, nv, dv / BV): one program per (sequence, value head, block of BV value columns).
It recomputes from the OLD conv tails, without writing them, everything its state block needs: its key head's q and
k conv step, SiLU and L2 norm (redundant across the 2*nv/nk*dv/BV programs reading that key head; a few KB from L2),
its BV v channels' conv step and SiLU, and the head's gates. The delta rule is column-separable (column j of S
[dk, dv] only meets v[j]), so the program decays, predicts, corrects and reads out its [dk, BV] fp32 block of S
alone, writes the block back in place and writes its BV outputs (rounded to the activation dtype) to a scratch
[B, nv, dv]. At the real shapes (nv=32, dv=128, BV=32) that is 128 programs per sequence with 4K fp32 of state
each, instead of 16 programs each holding a whole 64 KB state and walking nv/nk heads in turn.

`_gdn_norm_kernel`, grid (B, nv): the gated RMSNorm over the head's full dv row of the scratch, -> out [B, nv*dv];
and the conv tails' update for this step, in place at the sequence's slot: program (b, h) writes the new tails of
head h's v channels, and the first program of each key head's group (h % (nv/nk) == 0) those of the key head's q
and k channels. Why the tails wait for the second launch: in the first one, many programs of one grid (unordered)
read each q/k tail, so no program could overwrite one without racing the others' reads. The second launch starts
after the first has finished (stream order, also inside a CUDA graph), and in it every tail channel has exactly one
program that reads (for the shift) and writes it; a barrier inside that program orders its reads before its writes.

Rounding to the activation dtype happens where the PyTorch path stores a tensor of that dtype (conv products, their
sum, SiLU, beta, the delta-rule output, the normed row, the weighted row, the gated output), so bf16 results agree
with `GatedDeltaNet` to within bf16 noise. No host sync and shapes only from tensor sizes: CUDA-graph capturable.
`BV`, `RECURRENCE_WARPS` and `NORM_WARPS` are read at each call, so a sweep can set them.
With the kernel flag `pdl` (`common.pdl_usable`) both kernels launch as programmatic dependents and wait
(`common.pdl_wait`) first thing: every load but the small conv weight / A_log / dt_bias / norm weight ones reads
the projection output or the states, and those weight loads sit among them; what PDL saves here is the launch and
ramp-up. The in-projection GEMV before them is `quant_gemv` (which takes `pdl` itself) or cuBLAS.
"""

from __future__ import annotations

import torch

from stage_worker.kernels.common import pow2 as _pow2
from stage_worker.kernels.common import pdl_usable, triton_usable
from stage_worker.kernels.deltanet_decode_ref import L2_EPS, gdn_decode_ref, split_sizes

try:
    import triton
    import triton.language as tl

    from stage_worker.kernels.common import pdl_wait
    from stage_worker.kernels.rmsnorm import round_to
except ImportError:   # CPU-only installs off Linux: gdn_decode falls back to the reference
    triton = None

BV = 32                 # value columns of S per recurrence program (a power of two; capped at dv)
RECURRENCE_WARPS = 4    # a [dk, BV] = [128, 32] fp32 block: 32 state registers per thread at 4 warps
NORM_WARPS = 4



if triton is not None:
    @triton.jit
    def _conv_channels(mixed_row, tail_row, w_ptr, ch, taps, stride_c1, stride_c2, stride_w0, stride_w1,
                       KW: tl.constexpr, ROUND_PROD: tl.constexpr):
        """SiLU(causal conv) of channels `ch` for this token, from the stored (old) tail; writes nothing.
        Window = [tail, token] in the cache dtype, cast to the activation dtype, times the weight."""
        x_dt: tl.constexpr = mixed_row.dtype.element_ty
        c_dt: tl.constexpr = tail_row.dtype.element_ty
        new = round_to(tl.load(mixed_row + ch).to(tl.float32), c_dt)                      # [D]
        tail = tail_row + ch.to(tl.int64)[:, None] * stride_c1
        old = tl.load(tail + taps[None, :] * stride_c2, mask=taps[None, :] < KW - 1, other=0.0).to(tl.float32)
        window = tl.where(taps[None, :] == KW - 1, new[:, None], old)                     # [D, KP]
        w = tl.load(w_ptr + ch.to(tl.int64)[:, None] * stride_w0 + taps[None, :] * stride_w1,
                    mask=taps[None, :] < KW, other=0.0).to(tl.float32)
        prod = round_to(window, x_dt) * w
        if ROUND_PROD:                       # weight and activation share a dtype: products and sum round to it
            prod = round_to(prod, x_dt)
        acc = tl.sum(prod, axis=1)
        if ROUND_PROD:
            acc = round_to(acc, x_dt)
        out = acc / (1.0 + tl.exp(-acc))
        if ROUND_PROD:
            out = round_to(out, x_dt)
        return out

    @triton.jit
    def _next_tail(mixed_row, tail_row, ch, taps, live, stride_c1, stride_c2, KW: tl.constexpr):
        """Next tail of channels `ch` where `live` [D]: taps 1..KW-2 of the old one, then this token in the cache
        dtype. [D, KP] fp32; the caller stores it after a barrier."""
        c_dt: tl.constexpr = tail_row.dtype.element_ty
        new = round_to(tl.load(mixed_row + ch, mask=live, other=0.0).to(tl.float32), c_dt)
        tail = tail_row + ch.to(tl.int64)[:, None] * stride_c1
        shifted = tl.load(tail + (taps[None, :] + 1) * stride_c2,
                          mask=live[:, None] & (taps[None, :] + 1 < KW - 1), other=0.0).to(tl.float32)
        return tl.where(taps[None, :] == KW - 2, new[:, None], shifted)

    @triton.jit
    def _store_tail(tail_row, ch, taps, live, shifted, stride_c1, stride_c2, KW: tl.constexpr):
        tail = tail_row + ch.to(tl.int64)[:, None] * stride_c1
        tl.store(tail + taps[None, :] * stride_c2, shifted.to(tail_row.dtype.element_ty),
                 mask=live[:, None] & (taps[None, :] < KW - 1))

    @triton.jit
    def _gdn_recurrence_kernel(mixed_ptr, b_ptr, a_ptr, convw_ptr, alog_ptr, dtb_ptr, conv_ptr, rec_ptr, slots_ptr,
                               o_ptr, stride_m, stride_b, stride_a, stride_w0, stride_w1,
                               stride_c0, stride_c1, stride_c2, stride_r0, stride_r1, stride_r2, stride_ob,
                               scale,
                               NK: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               BV: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr, ROUND_PROD: tl.constexpr,
                               L2EPS: tl.constexpr, PDL: tl.constexpr = False):
        pdl_wait(PDL)                 # first: the slots, the projection output and the states all wait
        seq = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        col = tl.program_id(2) * BV + tl.arange(0, BV)                  # this program's value columns
        hk = h // REP
        x_dt: tl.constexpr = o_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        mixed_row = mixed_ptr + seq * stride_m
        tail_row = conv_ptr + slot * stride_c0
        taps = tl.arange(0, KP)
        rk = tl.arange(0, DK)

        q = _conv_channels(mixed_row, tail_row, convw_ptr, hk * DK + rk, taps, stride_c1, stride_c2,
                           stride_w0, stride_w1, KW, ROUND_PROD)
        k = _conv_channels(mixed_row, tail_row, convw_ptr, NK * DK + hk * DK + rk, taps, stride_c1, stride_c2,
                           stride_w0, stride_w1, KW, ROUND_PROD)
        v = _conv_channels(mixed_row, tail_row, convw_ptr, 2 * NK * DK + h * DV + col, taps, stride_c1, stride_c2,
                           stride_w0, stride_w1, KW, ROUND_PROD)
        q = (q * tl.math.rsqrt(tl.sum(q * q, axis=0) + L2EPS)) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + L2EPS)

        beta = round_to(1.0 / (1.0 + tl.exp(-tl.load(b_ptr + seq * stride_b + h).to(tl.float32))), x_dt)
        x = tl.load(a_ptr + seq * stride_a + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        # softplus (torch's threshold 20) with log1p(e) = log(u) * e / (u - 1), u = 1 + e: exact for tiny e.
        e = tl.exp(x)
        u = 1.0 + e
        softplus = tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus

        s_ptrs = rec_ptr + slot * stride_r0 + h * stride_r1 + rk[:, None] * stride_r2 + col[None, :]
        s = tl.load(s_ptrs) * tl.exp(g)                                   # [DK, BV] fp32
        predicted = tl.sum(s * k[:, None], axis=0)                         # S^T k, these columns
        delta = (v - predicted) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)                                 # S^T q
        tl.debug_barrier()   # every thread has read the old block before any thread overwrites it
        tl.store(s_ptrs, s)
        tl.store(o_ptr + seq * stride_ob + h * DV + col, round_to(o, x_dt).to(x_dt))

    @triton.jit
    def _gdn_norm_kernel(mixed_ptr, z_ptr, normw_ptr, conv_ptr, slots_ptr, o_ptr, out_ptr,
                         stride_m, stride_z, stride_c0, stride_c1, stride_c2, stride_ob, stride_o,
                         eps,
                         NK: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         KW: tl.constexpr, KP: tl.constexpr, SILU_GATE: tl.constexpr, ROUND_NORM: tl.constexpr,
                         PDL: tl.constexpr = False):
        pdl_wait(PDL)                 # first: the recurrence's scratch, the conv tails and z all wait
        seq = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        hk = h // REP
        x_dt: tl.constexpr = out_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        mixed_row = mixed_ptr + seq * stride_m
        tail_row = conv_ptr + slot * stride_c0
        taps = tl.arange(0, KP)
        rk = tl.arange(0, DK)
        rv = tl.arange(0, DV)

        # Conv tails: read the old ones (the recurrence kernel, which also read them, has finished) ...
        v_ch = 2 * NK * DK + h * DV + rv
        v_live = rv < DV
        qk_live = (rk < DK) & (h % REP == 0)             # the key head's q/k tails: its group's first program
        q_ch = hk * DK + rk
        k_ch = NK * DK + hk * DK + rk
        v_tail = _next_tail(mixed_row, tail_row, v_ch, taps, v_live, stride_c1, stride_c2, KW)
        q_tail = _next_tail(mixed_row, tail_row, q_ch, taps, qk_live, stride_c1, stride_c2, KW)
        k_tail = _next_tail(mixed_row, tail_row, k_ch, taps, qk_live, stride_c1, stride_c2, KW)

        # Gated RMSNorm over the head's dv outputs (already rounded to the activation dtype).
        o = tl.load(o_ptr + seq * stride_ob + h * DV + rv).to(tl.float32)
        normed = round_to(o * tl.math.rsqrt(tl.sum(o * o, axis=0) / DV + eps), x_dt)
        normed = tl.load(normw_ptr + rv).to(tl.float32) * normed
        if ROUND_NORM:
            normed = round_to(normed, x_dt)
        zz = tl.load(z_ptr + seq * stride_z + h * DV + rv).to(tl.float32)
        if SILU_GATE:
            gate = zz / (1.0 + tl.exp(-zz))
        else:
            gate = 1.0 / (1.0 + tl.exp(-zz))
        y = round_to(normed * gate, x_dt)
        tl.store(out_ptr + seq * stride_o + h * DV + rv, y.to(x_dt))

        # ... and write the new ones once every thread of this program has read the old ones.
        tl.debug_barrier()
        _store_tail(tail_row, v_ch, taps, v_live, v_tail, stride_c1, stride_c2, KW)
        _store_tail(tail_row, q_ch, taps, qk_live, q_tail, stride_c1, stride_c2, KW)
        _store_tail(tail_row, k_ch, taps, qk_live, k_tail, stride_c1, stride_c2, KW)


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
               gate_activation: str = "silu") -> torch.Tensor:
    """One decode token per row -> [B, nv*dv] in mixed.dtype, states updated in place at `slots`; =
    `gdn_decode_ref` (same arguments). mixed/z/b/a may be strided row views of one projection output."""
    B, conv_dim = mixed.shape
    nk, nv, dk, dv, rep = split_sizes(conv_dim, recurrent_state)
    width = conv_weight.shape[-1]
    if gate_activation not in ("silu", "sigmoid"):
        raise ValueError(f"gate_activation must be silu or sigmoid, not {gate_activation!r}")
    if conv_weight.shape != (conv_dim, width) or conv_state.shape[1:] != (conv_dim, width - 1) or width < 2:
        raise ValueError(f"conv weight {tuple(conv_weight.shape)} / state {tuple(conv_state.shape)} do not match "
                         f"conv_dim {conv_dim}")
    if z.shape != (B, nv * dv) or b.shape != (B, nv) or a.shape != (B, nv) or slots.shape != (B,):
        raise ValueError(f"shapes: mixed {tuple(mixed.shape)} z {tuple(z.shape)} b {tuple(b.shape)} "
                         f"a {tuple(a.shape)} slots {tuple(slots.shape)} for nv={nv}, dv={dv}")
    if recurrent_state.dtype != torch.float32 or recurrent_state.stride(-1) != 1:
        raise ValueError("the recurrent state must be fp32 with a contiguous last dimension (updated in place)")
    if BV < 1 or BV != _pow2(BV):
        raise ValueError(f"BV must be a power of two, not {BV}")
    if not triton_usable(mixed) or dk != _pow2(dk) or dv != _pow2(dv):
        return gdn_decode_ref(mixed, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, conv_state,
                              recurrent_state, slots, gate_activation)
    out = torch.empty(B, nv * dv, dtype=mixed.dtype, device=mixed.device)
    if B == 0:
        return out
    mixed, z, b, a = (t if t.stride(-1) == 1 else t.contiguous() for t in (mixed, z, b, a))
    A_log, dt_bias, norm_weight = A_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous()
    o = torch.empty(B, nv, dv, dtype=mixed.dtype, device=mixed.device)    # delta-rule output, as the model rounds it
    bv = min(BV, dv)                                                      # both powers of two: bv divides dv
    pdl = pdl_usable(mixed)
    _gdn_recurrence_kernel[(B, nv, dv // bv)](
        mixed, b, a, conv_weight, A_log, dt_bias, conv_state, recurrent_state, slots, o,
        mixed.stride(0), b.stride(0), a.stride(0), conv_weight.stride(0), conv_weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2), o.stride(0),
        dk ** -0.5,
        NK=nk, REP=rep, DK=dk, DV=dv, BV=bv, KW=width, KP=_pow2(width),
        ROUND_PROD=conv_weight.dtype == mixed.dtype, L2EPS=L2_EPS, num_warps=RECURRENCE_WARPS, PDL=pdl,
        launch_pdl=pdl)
    _gdn_norm_kernel[(B, nv)](
        mixed, z, norm_weight, conv_state, slots, o, out,
        mixed.stride(0), z.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        o.stride(0), out.stride(0), float(eps),
        NK=nk, REP=rep, DK=dk, DV=dv, KW=width, KP=_pow2(width), SILU_GATE=gate_activation == "silu",
        ROUND_NORM=norm_weight.dtype == mixed.dtype, num_warps=NORM_WARPS, PDL=pdl, launch_pdl=pdl)
    return out
