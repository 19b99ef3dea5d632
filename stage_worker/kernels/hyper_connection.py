"""The GatedResidual decode kernels of the field report (002 §3.3), with the stream update after a block fused in.

Why: a GatedResidual is six small kernels in PyTorch (~32 µs each on a 3090, two per layer), and its down/up
weights, 2 x [320, 10240], are ~23% of the bytes a decode step reads (001 §2). Three kernels per mix:

P `_hc_prep_kernel`, grid (T, hc): optionally first the previous block's injection (streams + out * g, the
  `GatedResidual.inject` that would otherwise be its own launches), then the stream's RMSNorm, stored in bf16 as
  the PyTorch path stores it. One stream per program: the statistics are per stream, so no program waits on another.
A `_hc_down_kernel`, grid (down/inject row tiles, row blocks): the `down` GEMV (and the `block_inject` rows) over the
  normed streams, SiLU (or 2*sigmoid) on store. Each weight tile is loaded once per row block and used for all rows.
B `_hc_up_mix_kernel`, grid (H tiles, row blocks): the `up` GEMV for each stream's H tile, sigmoid, and the mean
  over streams of gate * normed, in registers.

An earlier version fused the norm into A (two kernels instead of three): each of its ~160 programs then
re-normalised the whole row before its first weight load, a chain of dependent loads that ran A at 12.9 µs for
6.6 MB on the H200 (about 0.5 TB/s). With the norm in P the GEMVs are plain weight streams.

All three round to the input dtype wherever `GatedResidual.mix` / `inject` do (the injection, normed, each Linear
output, /hc, silu, sigmoid, gate * normed, the mean), so they agree with the PyTorch path to within bf16 noise.
Sized for decode (T <= DECODE_ROWS): each row block re-reads the weights, so prefill-size batches take PyTorch.
H, r and hc are compile-time constants (fixed per checkpoint): the loop over streams unrolls, loop bounds are known.

Folded norm, two launches (`FOLD_NORM`, off by default until timed on the H200; env MOEPIPE_HC_FOLD_NORM=1 turns it
on at import, `hc_mix(fold_norm=)` per call; not a `flags.NAMES` item, since "all", the default, turns every item on).
At batch 1 the three launches are latency-bound, not byte-bound (h200-17: 2.5 + 4.3 + 5.3 us a mix for 2 x 3.3 MB of
INT8, ~1.6 us each at HBM speed), so one launch fewer is the prize:
F `_hc_fold_down_kernel` replaces P and A. The RMSNorm is linear in x once its factor r_s = rsqrt(mean(x_s^2) + eps)
  is known, and r_s is one scalar a stream: a down row's dot is sum_s r_s * p_s with p_s = sum_h W[row, s, h] *
  (1 + w_norm[s, h]) * x_s[h]. Each program already streams every value of x for its dot, so in the same loop it
  accumulates p_s and q_s = sum_h x_s[h]^2 (and does the injection, x = streams + out * g, as it loads); r_s is
  applied once at the end. No load depends on a reduction, unlike the earlier two-kernel version above: the loop is
  A's, a weight tile [rows, hc, H tile] with x, out and w_norm read from L2 beside it. The price: each program also
  reads w_norm (20 KB at the full shape, once for all its rows) and reduces q_s beside p_s each tile; programs of 2
  rows halve the first. Programs (0, row block) store the new streams (injection) and r_s [T, hc] in fp32.
B `_hc_up_mix_kernel(FOLD=True)` forms normed_s[h] = bf16((x_s[h] * r_s) * (1 + w_norm)) itself from the streams
  and r_s instead of reading a stored normed buffer (the value P stores: same ops, same order).
The one rounding point that moves: the PyTorch path rounds normed to bf16 before the down / block_inject GEMVs, F
dots the unrounded fp32 product. Rounding there needs r_s before the dot, i.e. a sum-of-squares pass over x ahead of
the first weight load in every program: the dependent chain above (or every weight tile held in registers while it
runs, which Triton's per-tile loop cannot express at 10240 values a row). So F's down / inject outputs differ from
the reference's by the bf16 noise of the normed values (~1e-3 relative, closer to an fp32 norm, not further; one bf16
ulp in ~5-15% of the mixed values under the interpreter, within the file's bf16 tolerance) and everything after them
rounds where the PyTorch path does: bit-equal to the reference with that one point moved (`_folded_oracle` in
tests/test_kernel_hyper_connection.py). Float and INT8 weights, block_inject rows, T <= DECODE_ROWS as above.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from stage_worker.kernels import hyper_connection_ref
from stage_worker.kernels.quant_gemv_ref import PackedWeight
from stage_worker.kernels.rmsnorm import round_to

if TYPE_CHECKING:   # the model will import this module behind its kernel flag: no import cycle at run time
    from stage_worker.model.hyper_connection import GatedResidual

# Above this many rows `hc_mix_module` takes the PyTorch path. `bench/tune_kernels.py` on the H200 (2026-11-29,
# full-shape GatedResidual, whole mix inside a CUDA graph): kernels 9.7 / 17.6 / >= 87 us at 1 / 4 / 16 rows, the
# PyTorch path 43.4 / 51.4 us at 1 / 4 rows; each row costs A and B a reduction per weight tile.
DECODE_ROWS = 4

# Launch tunables per row-count bucket (1, <=4, <=16): rows per program / K chunk / warps for A, H tile / R chunk /
# warps for B. Winners of `bench/tune_kernels.py` (same run) for 1 and 4 rows.
DOWN_CFG = {1: (1, 4096, 8), 4: (1, 4096, 8), 16: (2, 4096, 4)}
UP_CFG = {1: (4, 512, 8), 4: (8, 512, 4), 16: (16, 256, 4)}


# The two-launch mix (F then B with FOLD; module docstring): off by default until the GPU test
# `test_folded_norm_timing` has timed it against the three launches at the full shape. Read once, at import.
FOLD_NORM = os.environ.get("MOEPIPE_HC_FOLD_NORM", "0").strip().lower() in ("1", "true", "on", "yes")

# F's tunables per row-count bucket: rows per program / H tile (a chunk is hc x H tile values: 4 x 1024 = A's 4096
# at the full shape) / warps. Untuned (A's winners carried over); `test_folded_norm_timing` prints a few variants.
FOLD_DOWN_CFG = {1: (1, 1024, 8), 4: (1, 1024, 8), 16: (2, 1024, 4)}


def _bucket(t: int) -> int:
    return 1 if t == 1 else 4 if t <= 4 else 16


@triton.jit
def _hc_prep_kernel(x_ptr, o_ptr, g_ptr, y_ptr, nw_ptr, n_ptr, stride_x, stride_o, stride_y, eps,
                    H: tl.constexpr, HC: tl.constexpr, INJECT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    dt: tl.constexpr = n_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_x + s * H + offs, mask=m, other=0.0).to(tl.float32)
    if INJECT:
        o = tl.load(o_ptr + t * stride_o + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * HC + s).to(tl.float32)
        x = round_to(x + round_to(o * g, dt), dt)
        tl.store(y_ptr + t * stride_y + s * H + offs, x.to(dt), mask=m)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    scale = 1.0 + tl.load(nw_ptr + s * H + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(n_ptr + t * (HC * H) + s * H + offs, round_to((x * rstd) * scale, dt).to(dt), mask=m)


@triton.jit
def _rows_dot(n_ptr, w_ptr, outs, mo, row0, T, K: tl.constexpr, OFFSET: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_T, BLOCK_R]: the normed rows times weight rows `outs` (stored values less OFFSET: 128 for INT8
    bytes, whose per-row scale the caller applies; 0 for float weights)."""
    ts = tl.arange(0, BLOCK_T)
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mk = ks < K
        # One weight tile for every row of the block: the weights are the bytes that count (001 §2).
        w = tl.load(w_rows + ks[None, :], mask=mo[:, None] & mk[None, :], other=OFFSET).to(tl.float32) - OFFSET
        for t in tl.static_range(BLOCK_T):
            x = tl.load(n_ptr + (row0 + t).to(tl.int64) * K + ks, mask=mk & (row0 + t < T), other=0.0)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            acc += tl.where((ts == t)[:, None], part[None, :], 0.0)
    return acc


@triton.jit
def _store_down(acc, is_down, a_ptr, g_ptr, row0, ts, outs, mt, mo, R: tl.constexpr, HC: tl.constexpr):
    """The down kernels' epilogue, rounded where `GatedResidual.mix` rounds: a down row's sum / hc through SiLU into
    a [T, R], or an injection row's through 2 * sigmoid into g [T, HC]."""
    dt: tl.constexpr = a_ptr.dtype.element_ty
    v = round_to(round_to(acc, dt) / HC, dt)
    mask = mt[:, None] & mo[None, :]
    if is_down:
        silu = round_to(v / (1.0 + tl.exp(-v)), dt)
        tl.store(a_ptr + (row0 + ts)[:, None] * R + outs[None, :], silu.to(dt), mask=mask)
    else:
        gate = round_to(1.0 / (1.0 + tl.exp(-v)), dt)
        tl.store(g_ptr + (row0 + ts)[:, None] * HC + outs[None, :], (2.0 * gate).to(dt), mask=mask)


@triton.jit
def _hc_down_kernel(n_ptr, down_ptr, ds_ptr, inj_ptr, a_ptr, g_ptr, T,
                    H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, Q8: tl.constexpr):
    """`down` (and `block_inject`) rows over the normed streams; with Q8 the down weight is INT8 bytes (stored
    value + 128) with one scale a row (ds), applied to the row's sum."""
    K: tl.constexpr = HC * H
    pid_r = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_T
    ts = tl.arange(0, BLOCK_T)
    mt = row0 + ts < T
    n_down: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    is_down = pid_r < n_down
    if is_down:
        outs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < R
        if Q8:
            acc = _rows_dot(n_ptr, down_ptr, outs, mo, row0, T, K, 128.0, BLOCK_T, BLOCK_R, BLOCK_K)
            acc = acc * tl.load(ds_ptr + outs, mask=mo, other=0.0).to(tl.float32)[None, :]
        else:
            acc = _rows_dot(n_ptr, down_ptr, outs, mo, row0, T, K, 0.0, BLOCK_T, BLOCK_R, BLOCK_K)
    else:
        outs = (pid_r - n_down) * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < HC
        acc = _rows_dot(n_ptr, inj_ptr, outs, mo, row0, T, K, 0.0, BLOCK_T, BLOCK_R, BLOCK_K)
    _store_down(acc, is_down, a_ptr, g_ptr, row0, ts, outs, mt, mo, R, HC)


@triton.jit
def _fold_rows_dot(x_ptr, o_ptr, g_ptr, y_ptr, r_ptr, nw_ptr, w_ptr, outs, mo, first, row0, T, stride_x, stride_o,
                   stride_y, eps, H: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, INJECT: tl.constexpr,
                   OFFSET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """[BLOCK_T, BLOCK_R]: weight rows `outs` (stored values less OFFSET) times the RMS-normed streams, the norm
    folded in: per stream the dot with (1 + w_norm) * x and the sum of squares of x in one loop, rsqrt applied to
    each stream's partial dot at the end. With INJECT, x = streams + out * g as it loads. `first`: this program
    stores the new streams (INJECT) and the per-stream rsqrt factors [T, HC] fp32."""
    K: tl.constexpr = HC * H
    dt: tl.constexpr = x_ptr.dtype.element_ty
    ts = tl.arange(0, BLOCK_T)
    ss = tl.arange(0, HC_P)
    ms = ss < HC
    w_rows = w_ptr + outs.to(tl.int64)[:, None, None] * K
    acc = tl.zeros([BLOCK_T, BLOCK_R, HC_P], dtype=tl.float32)      # per stream: sum W * (1 + w_norm) * x
    sq = tl.zeros([BLOCK_T, HC_P], dtype=tl.float32)                # per stream: sum x^2
    for h0 in tl.static_range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        mh = hs < H
        ks = ss[:, None] * H + hs[None, :]                           # [HC_P, BLOCK_H]
        mk = ms[:, None] & mh[None, :]
        w = tl.load(w_rows + ks[None, :, :], mask=mo[:, None, None] & mk[None, :, :],
                    other=OFFSET).to(tl.float32) - OFFSET
        scale = 1.0 + tl.load(nw_ptr + ks, mask=mk, other=0.0).to(tl.float32)
        for t in tl.static_range(BLOCK_T):
            row = (row0 + t).to(tl.int64)
            mkt = mk & (row0 + t < T)
            x = tl.load(x_ptr + row * stride_x + ks, mask=mkt, other=0.0).to(tl.float32)
            if INJECT:
                o = tl.load(o_ptr + row * stride_o + hs, mask=mh & (row0 + t < T), other=0.0).to(tl.float32)
                g = tl.load(g_ptr + row * HC + ss, mask=ms & (row0 + t < T), other=0.0).to(tl.float32)
                x = round_to(x + round_to(o[None, :] * g[:, None], dt), dt)
                tl.store(y_ptr + row * stride_y + ks, x.to(dt), mask=mkt & first)
            sq += tl.where((ts == t)[:, None], tl.sum(x * x, axis=1)[None, :], 0.0)
            part = tl.sum(w * (x * scale)[None, :, :], axis=2)       # [BLOCK_R, HC_P]
            acc += tl.where((ts == t)[:, None, None], part[None, :, :], 0.0)
    rstd = tl.math.rsqrt(sq / H + eps)                               # [BLOCK_T, HC_P]; padded streams: 0 * rsqrt(eps)
    tl.store(r_ptr + (row0 + ts)[:, None] * HC + ss[None, :], rstd, mask=(row0 + ts < T)[:, None] & ms[None, :] & first)
    return tl.sum(acc * rstd[:, None, :], axis=2)


@triton.jit
def _hc_fold_down_kernel(x_ptr, o_ptr, g_ptr, y_ptr, r_ptr, nw_ptr, down_ptr, ds_ptr, inj_ptr, a_ptr, gi_ptr, T,
                         stride_x, stride_o, stride_y, eps, H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr,
                         HC_P: tl.constexpr, INJECT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_H: tl.constexpr, Q8: tl.constexpr):
    """P and A in one launch (module docstring, F): `down` (and `block_inject`) rows over the streams with the norm
    folded into the dot and the injection done as x loads; SiLU (or 2*sigmoid) on store as A. Program (0, row
    block) also stores the block's new streams and rsqrt factors for B."""
    pid_r = tl.program_id(0)
    first = pid_r == 0
    row0 = tl.program_id(1) * BLOCK_T
    ts = tl.arange(0, BLOCK_T)
    mt = row0 + ts < T
    n_down: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    is_down = pid_r < n_down
    if is_down:
        outs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < R
        if Q8:
            acc = _fold_rows_dot(x_ptr, o_ptr, g_ptr, y_ptr, r_ptr, nw_ptr, down_ptr, outs, mo, first, row0, T,
                                 stride_x, stride_o, stride_y, eps, H, HC, HC_P, INJECT, 128.0, BLOCK_T, BLOCK_R,
                                 BLOCK_H)
            acc = acc * tl.load(ds_ptr + outs, mask=mo, other=0.0).to(tl.float32)[None, :]
        else:
            acc = _fold_rows_dot(x_ptr, o_ptr, g_ptr, y_ptr, r_ptr, nw_ptr, down_ptr, outs, mo, first, row0, T,
                                 stride_x, stride_o, stride_y, eps, H, HC, HC_P, INJECT, 0.0, BLOCK_T, BLOCK_R,
                                 BLOCK_H)
    else:
        outs = (pid_r - n_down) * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < HC
        acc = _fold_rows_dot(x_ptr, o_ptr, g_ptr, y_ptr, r_ptr, nw_ptr, inj_ptr, outs, mo, first, row0, T,
                             stride_x, stride_o, stride_y, eps, H, HC, HC_P, INJECT, 0.0, BLOCK_T, BLOCK_R, BLOCK_H)
    _store_down(acc, is_down, a_ptr, gi_ptr, row0, ts, outs, mt, mo, R, HC)


@triton.jit
def _hc_up_mix_kernel(n_ptr, a_ptr, up_ptr, us_ptr, y_ptr, r_ptr, nw_ptr, T, stride_n, stride_y,
                      H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, Q8: tl.constexpr,
                      FOLD: tl.constexpr):
    """The `up` GEMV per stream, sigmoid, and the mean of gate * normed; with Q8 the up weight is INT8 bytes
    (stored value + 128) with one scale a row (us), applied to each row's sum. n_ptr: the normed streams, or with
    FOLD the (new) streams themselves (rows stride_n apart), normed here from F's rsqrt factors (r_ptr [T, HC] fp32)
    and w_norm; without FOLD the kernel compiles as before (r_ptr, nw_ptr, stride_n unused)."""
    OFFSET: tl.constexpr = 128.0 if Q8 else 0.0
    hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = hs < H
    row0 = tl.program_id(1) * BLOCK_T
    ts = tl.arange(0, BLOCK_T)
    mt = row0 + ts < T
    mask = mt[:, None] & mh[None, :]
    dt: tl.constexpr = y_ptr.dtype.element_ty
    mix = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(HC):
        u = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j0 in tl.static_range(0, R, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            mj = js < R
            w = tl.load(up_ptr + (s * H + hs).to(tl.int64)[:, None] * R + js[None, :],
                        mask=mh[:, None] & mj[None, :], other=OFFSET).to(tl.float32) - OFFSET
            for t in tl.static_range(BLOCK_T):
                a = tl.load(a_ptr + (row0 + t) * R + js, mask=mj & (row0 + t < T), other=0.0).to(tl.float32)
                part = tl.sum(w * a[None, :], axis=1)
                u += tl.where((ts == t)[:, None], part[None, :], 0.0)
        if Q8:
            u = u * tl.load(us_ptr + s * H + hs, mask=mh, other=0.0).to(tl.float32)[None, :]
        gate = round_to(1.0 / (1.0 + tl.exp(-round_to(u, dt))), dt)
        if FOLD:    # the norm's value, as P stores it: (x * rstd) * (1 + w), rounded
            nx = tl.load(n_ptr + (row0 + ts).to(tl.int64)[:, None] * stride_n + (s * H + hs)[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            rstd = tl.load(r_ptr + (row0 + ts) * HC + s, mask=mt, other=0.0)
            scale = 1.0 + tl.load(nw_ptr + s * H + hs, mask=mh, other=0.0).to(tl.float32)
            nx = round_to((nx * rstd[:, None]) * scale[None, :], dt)
        else:
            nx = tl.load(n_ptr + (row0 + ts).to(tl.int64)[:, None] * (HC * H) + (s * H + hs)[None, :], mask=mask,
                         other=0.0).to(tl.float32)
        mix += round_to(gate * nx, dt)
    y = round_to(mix / HC, dt).to(dt)
    tl.store(y_ptr + (row0 + ts).to(tl.int64)[:, None] * stride_y + hs[None, :], y, mask=mask)


@triton.jit
def _hc_inject_kernel(x_ptr, o_ptr, g_ptr, y_ptr, stride_x, stride_o, stride_y,
                      H: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HC * H
    dt: tl.constexpr = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + row * stride_o + offs % H, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * HC + offs // H, mask=mask, other=0.0).to(tl.float32)
    y = round_to(x + round_to(o * g, dt), dt)
    tl.store(y_ptr + row * stride_y + offs, y.to(dt), mask=mask)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def hc_mix(streams: torch.Tensor, hc_norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
           inject_w: torch.Tensor | None, hc: int, eps: float,
           fold_norm: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc], or None for the final mixer);
    `hyper_connection_ref.hc_mix` in three kernels (two with `fold_norm`; None: `FOLD_NORM`). Weights in the
    streams' dtype."""
    _, mixed, inject = _mix(streams, None, None, hc_norm_w, down_w, up_w, inject_w, hc, eps, fold_norm)
    return mixed, inject


def hc_inject_mix(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, hc_norm_w: torch.Tensor,
                  down_w: torch.Tensor, up_w: torch.Tensor, inject_w: torch.Tensor | None, hc: int,
                  eps: float, fold_norm: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`hc_inject` of the previous block's output, then `hc_mix` of the result, with the injection inside the mix's
    first kernel: -> (new streams, block input, injection weights). `fold_norm`: as `hc_mix`."""
    return _mix(streams, out, weights, hc_norm_w, down_w, up_w, inject_w, hc, eps, fold_norm)


def int8_rows(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, row scales) as the mix kernels take them: a float weight as it is (no scales); a packed INT8
    per-channel weight (a reports-mixed checkpoint's down / up, `PackedLinear`) as its words viewed as bytes
    [N, K] uint8 (value k of a row is byte k, stored + 128) and its scales [N]."""
    if not isinstance(w, PackedWeight):
        return w.contiguous(), None
    if not kernel_form(w):
        raise ValueError(f"the mix kernels take INT8 per-channel weights, not {w.bits} bits in groups of {w.group}")
    return w.words.contiguous().view(torch.uint8), w.scales[:, 0].contiguous()


def kernel_form(w) -> bool:
    """A weight the mix kernels read: float, or packed INT8 with one scale a row in whole words."""
    return not isinstance(w, PackedWeight) or (w.bits == 8 and w.groups == 1 and w.words.shape[1] * 4 ==
                                               w.in_features)


def _mix(streams, out, weights, hc_norm_w, down_w, up_w, inject_w, hc: int, eps: float, fold: bool | None = None):
    (down_w, down_s), (up_w, up_s) = int8_rows(down_w), int8_rows(up_w)
    t, width = streams.shape
    hidden, rank = width // hc, down_w.shape[0]
    if hidden * hc != width or tuple(down_w.shape) != (rank, width) or tuple(up_w.shape) != (width, rank):
        raise ValueError(f"streams {tuple(streams.shape)}, down {tuple(down_w.shape)}, up {tuple(up_w.shape)} "
                         f"and hc {hc} do not fit together")
    if inject_w is not None and tuple(inject_w.shape) != (hc, width):
        raise ValueError(f"block_inject weight {tuple(inject_w.shape)} is not {(hc, width)}")
    x = _rows_contiguous(streams)
    dev, dt = x.device, x.dtype
    hc_norm_w = hc_norm_w.contiguous()
    new_streams = x
    a = torch.empty((t, rank), dtype=dt, device=dev)
    mixed = torch.empty((t, hidden), dtype=dt, device=dev)
    inject = torch.empty((t, hc), dtype=dt, device=dev) if inject_w is not None else None
    if out is not None:
        new_streams = torch.empty_like(x)
        o, g = _rows_contiguous(out), weights.contiguous()
    if t == 0:
        return new_streams, mixed, inject
    bt = min(triton.next_power_of_2(t), 16)
    if FOLD_NORM if fold is None else fold:
        return _mix_folded(x, o if out is not None else None, g if out is not None else None, new_streams, a,
                           mixed, inject, hc_norm_w, down_w, down_s, up_w, up_s, inject_w, hc, eps, bt)
    normed = torch.empty((t, width), dtype=dt, device=dev)
    _hc_prep_kernel[(t, hc)](
        x, o if out is not None else x, g if out is not None else x, new_streams, hc_norm_w, normed,
        x.stride(0), o.stride(0) if out is not None else 0, new_streams.stride(0), eps,
        H=hidden, HC=hc, INJECT=out is not None, BLOCK=triton.next_power_of_2(hidden),
        num_warps=8 if hidden >= 2048 else 4)
    br, bk, warps = DOWN_CFG[_bucket(t)]
    n_tiles = triton.cdiv(rank, br) + (triton.cdiv(hc, br) if inject_w is not None else 0)
    _hc_down_kernel[(n_tiles, triton.cdiv(t, bt))](
        normed, down_w, down_s if down_s is not None else a, inject_w.contiguous() if inject_w is not None else a,
        a, inject if inject is not None else a, t, H=hidden, R=rank, HC=hc, BLOCK_T=bt,
        BLOCK_R=br, BLOCK_K=min(triton.next_power_of_2(width), bk), Q8=down_s is not None, num_warps=warps)
    _up_mix(normed, width, a, up_w, up_s, mixed, None, None, hc, bt, fold=False)
    return new_streams, mixed, inject


def _up_mix(n, stride_n, a, up_w, up_s, mixed, rstd, hc_norm_w, hc: int, bt: int, fold: bool) -> None:
    """B over the normed streams `n`, or with `fold` over the streams normed in place from `rstd` and hc_norm_w."""
    t, hidden, rank = mixed.shape[0], mixed.shape[1], a.shape[1]
    bh, bj, warps = UP_CFG[_bucket(t)]
    bh = min(triton.next_power_of_2(hidden), bh)
    _hc_up_mix_kernel[(triton.cdiv(hidden, bh), triton.cdiv(t, bt))](
        n, a, up_w, up_s if up_s is not None else a, mixed, rstd if fold else a, hc_norm_w if fold else a, t,
        stride_n, mixed.stride(0), H=hidden, R=rank, HC=hc, BLOCK_T=bt, BLOCK_H=bh,
        BLOCK_J=min(triton.next_power_of_2(rank), bj), Q8=up_s is not None, FOLD=fold, num_warps=warps)


def _mix_folded(x, o, g, new_streams, a, mixed, inject, hc_norm_w, down_w, down_s, up_w, up_s, inject_w, hc: int,
                eps: float, bt: int):
    """F then B(FOLD): the mix in two launches (module docstring). o, g: the injection, or None."""
    t, width = x.shape
    hidden, rank = width // hc, down_w.shape[0]
    rstd = torch.empty((t, hc), dtype=torch.float32, device=x.device)
    br, bh, warps = FOLD_DOWN_CFG[_bucket(t)]
    n_tiles = triton.cdiv(rank, br) + (triton.cdiv(hc, br) if inject_w is not None else 0)
    _hc_fold_down_kernel[(n_tiles, triton.cdiv(t, bt))](
        x, o if o is not None else x, g if g is not None else x, new_streams, rstd, hc_norm_w, down_w,
        down_s if down_s is not None else a, inject_w.contiguous() if inject_w is not None else a, a,
        inject if inject is not None else a, t, x.stride(0), o.stride(0) if o is not None else 0,
        new_streams.stride(0), eps, H=hidden, R=rank, HC=hc, HC_P=triton.next_power_of_2(hc), INJECT=o is not None,
        BLOCK_T=bt, BLOCK_R=br, BLOCK_H=min(triton.next_power_of_2(hidden), bh), Q8=down_s is not None,
        num_warps=warps)
    _up_mix(new_streams, new_streams.stride(0), a, up_w, up_s, mixed, rstd, hc_norm_w, hc, bt, fold=True)
    return new_streams, mixed, inject


def hc_inject(streams: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams [T, hc*H] + out [T, H] scaled per stream by inject [T, hc] -> new streams
    (`hyper_connection_ref.hc_inject`)."""
    t, width = streams.shape
    hc = inject.shape[1]
    x, o, g = _rows_contiguous(streams), _rows_contiguous(out), inject.contiguous()
    y = torch.empty((t, width), dtype=streams.dtype, device=streams.device)
    if t:
        block = min(triton.next_power_of_2(width), 1024)
        _hc_inject_kernel[(triton.cdiv(width, block), t)](x, o, g, y, x.stride(0), o.stride(0), y.stride(0),
                                                          H=width // hc, HC=hc, BLOCK=block)
    return y


def hc_mix_module(module: GatedResidual, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module.mix(streams)` of a `GatedResidual` through the kernels at decode sizes, through the PyTorch reference
    above `DECODE_ROWS` rows or for packed weights the kernels do not read (not `module.mix`, which calls this
    function when its kernel flag is on)."""
    w = _module_weights(module)
    mix = hc_mix if streams.shape[0] <= DECODE_ROWS and kernel_form(w[1]) and kernel_form(w[2]) else \
        hyper_connection_ref.hc_mix
    return mix(streams, *w, module.hc, module.hc_norm.eps)


def _module_weights(module: GatedResidual) -> tuple:
    """(norm weight, down, up, inject): down and up a PackedWeight where the module keeps them packed."""
    inject = module.block_inject_weight
    down, up = module.input_mix_weight_down, module.input_mix_weight_up
    return (module.hc_norm.weight, down.packed() if hasattr(down, "packed") else down.weight,
            up.packed() if hasattr(up, "packed") else up.weight, None if inject is None else inject.weight)


def hc_inject_mix_module(module: GatedResidual, streams: torch.Tensor, out: torch.Tensor,
                         weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`GatedResidual.inject` then `module.mix`, fused at decode sizes (reference above `DECODE_ROWS` rows, or for
    packed weights the kernels do not read)."""
    w = _module_weights(module)
    if streams.shape[0] <= DECODE_ROWS and kernel_form(w[1]) and kernel_form(w[2]):
        return hc_inject_mix(streams, out, weights, *w, module.hc, module.hc_norm.eps)
    streams = hyper_connection_ref.hc_inject(streams, out, weights)
    return (streams, *hyper_connection_ref.hc_mix(streams, *w, module.hc, module.hc_norm.eps))
