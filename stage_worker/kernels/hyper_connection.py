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

Folding P into A was tried twice and is gone: each of A's ~160 programs then normalises the whole row itself. First
before its first weight load (a chain of dependent loads: A at 12.9 µs for 6.6 MB on the H200, about 0.5 TB/s);
then on the way, the GEMV being linear (rstd applied per stream to the sums, B norming its tiles from the streams
and the stored rstd: kernel flag `hc_fused_norm`, two launches, no normed copy), which h100-38 timed at 5.58 / 5.61
ms a 44-layer reports-mixed step back to back at batch 1 against 4.39-4.51 with P, and 13.2 against 7.4 ms at batch 4
(bench/results/h100-38). With the norm in P the GEMVs are plain weight streams.

All three round to the input dtype wherever `GatedResidual.mix` / `inject` do (the injection, normed, each Linear
output, /hc, silu, sigmoid, gate * normed, the mean), so they agree with the PyTorch path to within bf16 noise.
Sized for decode (T <= DECODE_ROWS; EAGER_ROWS outside graph capture): each row block re-reads the weights, so
prefill-size batches take PyTorch.
H, r and hc are compile-time constants (fixed per checkpoint): the loop over streams unrolls, loop bounds are known.
With the kernel flag `pdl` (`common.pdl_usable`) the four kernels are launched as programmatic dependents: P loads
its norm weight before `common.pdl_wait`, A and B their first weight tile (B: the first stream's), the inject
kernel nothing; everything the previous kernel writes (streams, normed rows, a, the block output) after it. With
`l2_prefetch` too (`common.l2_prefetch_usable`, the constexpr L2PF) A and B first ask the L2 for all the weight rows
the program streams (`common.l2_prefetch_rows`: A its down or inject rows, B its H tile of each stream's up rows), so
they come from HBM while the previous kernel runs; the norm weight (P) is too small to matter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from stage_worker.kernels import hyper_connection_ref
from stage_worker.kernels.common import l2_prefetch_rows, l2_prefetch_usable, pdl_usable, pdl_wait
from stage_worker.kernels.quant_gemv_ref import PackedWeight
from stage_worker.kernels.rmsnorm import round_to
from stage_worker.kernels.split_reduce import LOCKS, last_of, split_locks

if TYPE_CHECKING:   # the model will import this module behind its kernel flag: no import cycle at run time
    from stage_worker.model.hyper_connection import GatedResidual

# Above this many rows `hc_mix_module` takes the PyTorch path. `bench/tune_kernels.py` on the H200 (2026-11-29,
# full-shape GatedResidual, whole mix inside a CUDA graph): kernels 9.7 / 17.6 / >= 87 us at 1 / 4 / 16 rows, the
# PyTorch path 43.4 / 51.4 us at 1 / 4 rows; each row costs A and B a reduction per weight tile.
DECODE_ROWS = 4
# ... except outside a CUDA-graph capture (prefill chunks, steps that do not fit a graph): there each of the
# PyTorch path's ~15 launches a mix costs host time that the kernels' weight re-reads do not (h200-22 call 5,
# full shape 20 layers, four prompts of 11 tokens in one ragged step: 0.093 s with 4, 0.088 with 16, 0.078 with 64).
EAGER_ROWS = 64

# Launch tunables per row-count bucket (1, <=4, <=16): rows per program / K chunk / warps[ / K slices] for A, H
# tile / R chunk / warps for B. K slices (default 1): A's inputs cut over that many programs a tile, their partial
# sums added by the last (`split_reduce.last_of`; deterministic, not bit-equal to one slice). Winners of `bench/tune_kernels.py` (same run) for 1 and 4 rows.
DOWN_CFG = {1: (1, 4096, 8), 4: (1, 4096, 8), 16: (2, 4096, 4)}
UP_CFG = {1: (4, 512, 8), 4: (8, 512, 4), 16: (16, 256, 4)}
# The same for INT8 per-channel down / up weights read in place (reports-mixed): `bench/tune_kernels.py --only hc_q8
# --rows 1,4` on the H200 (h200-20, the whole mix in a CUDA graph with PDL, each call on the next of 16 weight sets
# so the bytes come from HBM as in the model): at 1 row 9.19 us against 9.99 with the bf16 tables' entries, at 4
# rows 16.41 against 17.36 (bench/results/h200-20/call5/). 16 rows: unswept, the bf16 entry.
DOWN_CFG_Q8 = {1: (2, 4096, 4), 4: (2, 8192, 8), 16: (2, 4096, 4)}
UP_CFG_Q8 = {1: (8, 512, 4), 4: (8, 512, 4), 16: (16, 256, 4)}


def _bucket(t: int) -> int:
    return 1 if t == 1 else 4 if t <= 4 else 16


@triton.jit
def _hc_prep_kernel(x_ptr, o_ptr, g_ptr, y_ptr, nw_ptr, n_ptr, stride_x, stride_o, stride_y, eps,
                    H: tl.constexpr, HC: tl.constexpr, INJECT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    dt: tl.constexpr = n_ptr.dtype.element_ty
    if PDL:
        scale = 1.0 + tl.load(nw_ptr + s * H + offs, mask=m, other=0.0).to(tl.float32)
        pdl_wait(PDL)
    x = tl.load(x_ptr + t * stride_x + s * H + offs, mask=m, other=0.0).to(tl.float32)
    if INJECT:
        o = tl.load(o_ptr + t * stride_o + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * HC + s).to(tl.float32)
        x = round_to(x + round_to(o * g, dt), dt)
        tl.store(y_ptr + t * stride_y + s * H + offs, x.to(dt), mask=m)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    if not PDL:
        scale = 1.0 + tl.load(nw_ptr + s * H + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(n_ptr + t * (HC * H) + s * H + offs, round_to((x * rstd) * scale, dt).to(dt), mask=m)


@triton.jit
def _rows_dot(n_ptr, w_ptr, outs, mo, row0, T, k_lo, K: tl.constexpr, SPAN: tl.constexpr, OFFSET: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """[BLOCK_T, BLOCK_R]: the normed rows times weight rows `outs` over inputs k_lo .. k_lo + SPAN (stored values
    less OFFSET: 128 for INT8 bytes, whose per-row scale the caller applies; 0 for float weights). PDL: the wait
    after the first weight tile's load, before the first normed row's."""
    ts = tl.arange(0, BLOCK_T)
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in tl.static_range(0, SPAN, BLOCK_K):
        ks = k_lo + k0 + tl.arange(0, BLOCK_K)
        mk = ks < K
        # One weight tile for every row of the block: the weights are the bytes that count (001 §2).
        w = tl.load(w_rows + ks[None, :], mask=mo[:, None] & mk[None, :], other=OFFSET).to(tl.float32) - OFFSET
        if PDL:
            if k0 == 0:
                pdl_wait(PDL)
        for t in tl.static_range(BLOCK_T):
            x = tl.load(n_ptr + (row0 + t).to(tl.int64) * K + ks, mask=mk & (row0 + t < T), other=0.0)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            acc += tl.where((ts == t)[:, None], part[None, :], 0.0)
    return acc


@triton.jit
def _hc_down_kernel(n_ptr, down_ptr, ds_ptr, inj_ptr, a_ptr, g_ptr, part_ptr, lock_ptr, T,
                    H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, SPAN: tl.constexpr,
                    Q8: tl.constexpr, PDL: tl.constexpr = False, L2PF: tl.constexpr = False):
    """`down` (and `block_inject`) rows over the normed streams; with Q8 the down weight is INT8 bytes (stored
    value + 128) with one scale a row (ds), applied to the row's sum. With SPLITS > 1 the inputs are cut into
    SPLITS slices (grid axis 2), each program stores its fp32 partial sums (part [SPLITS, T, R + HC]) and the last
    of a tile's programs adds them in a fixed order and finishes the tile (`split_reduce.last_of`): at one token
    the 160 whole-row programs keep too few bytes in flight for the HBM. SPAN: the inputs a slice covers (K with
    one slice; else a multiple of BLOCK_K). L2PF (with PDL): the program's weight rows (its slice of each) into L2
    before anything else."""
    K: tl.constexpr = HC * H
    pid_r = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_T
    k_lo = tl.program_id(2) * SPAN
    ts = tl.arange(0, BLOCK_T)
    mt = row0 + ts < T
    n_down: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    is_down = pid_r < n_down
    if L2PF:
        if is_down:
            l2_prefetch_rows(down_ptr, pid_r * BLOCK_R, tl.minimum(R - pid_r * BLOCK_R, BLOCK_R), K, k_lo,
                             tl.minimum(K - k_lo, SPAN), BLOCK_R)
        else:
            r0 = (pid_r - n_down) * BLOCK_R
            l2_prefetch_rows(inj_ptr, r0, tl.minimum(HC - r0, BLOCK_R), K, k_lo, tl.minimum(K - k_lo, SPAN), BLOCK_R)
    if is_down:
        outs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < R
        if Q8:
            acc = _rows_dot(n_ptr, down_ptr, outs, mo, row0, T, k_lo, K, SPAN, 128.0, BLOCK_T, BLOCK_R, BLOCK_K, PDL)
        else:
            acc = _rows_dot(n_ptr, down_ptr, outs, mo, row0, T, k_lo, K, SPAN, 0.0, BLOCK_T, BLOCK_R, BLOCK_K, PDL)
        col = outs
    else:
        outs = (pid_r - n_down) * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < HC
        acc = _rows_dot(n_ptr, inj_ptr, outs, mo, row0, T, k_lo, K, SPAN, 0.0, BLOCK_T, BLOCK_R, BLOCK_K, PDL)
        col = R + outs
    mask = mt[:, None] & mo[None, :]
    if SPLITS > 1:
        at = (row0 + ts).to(tl.int64)[:, None] * (R + HC) + col[None, :]
        tl.store(part_ptr + tl.program_id(2) * T * (R + HC) + at, acc, mask=mask)
        if last_of(lock_ptr + pid_r * tl.num_programs(1) + tl.program_id(1), SPLITS):
            acc = tl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
            for p in tl.static_range(1, SPLITS):
                acc += tl.load(part_ptr + p * T * (R + HC) + at, mask=mask, other=0.0, cache_modifier=".cg")
            _down_finish(acc, ds_ptr, a_ptr, g_ptr, outs, mo, row0, ts, mask, is_down, R, HC, Q8)
    else:
        _down_finish(acc, ds_ptr, a_ptr, g_ptr, outs, mo, row0, ts, mask, is_down, R, HC, Q8)


@triton.jit
def _down_finish(acc, ds_ptr, a_ptr, g_ptr, outs, mo, row0, ts, mask, is_down, R: tl.constexpr, HC: tl.constexpr,
                 Q8: tl.constexpr):
    """A tile's whole sums -> `a` (row-scaled with Q8, /hc, SiLU) or the injection weights (2 * sigmoid), rounded
    as `GatedResidual.mix` rounds them."""
    dt: tl.constexpr = a_ptr.dtype.element_ty
    if is_down:
        if Q8:
            acc = acc * tl.load(ds_ptr + outs, mask=mo, other=0.0).to(tl.float32)[None, :]
        v = round_to(round_to(acc, dt) / HC, dt)
        silu = round_to(v / (1.0 + tl.exp(-v)), dt)
        tl.store(a_ptr + (row0 + ts)[:, None] * R + outs[None, :], silu.to(dt), mask=mask)
    else:
        v = round_to(round_to(acc, dt) / HC, dt)
        gate = round_to(1.0 / (1.0 + tl.exp(-v)), dt)
        tl.store(g_ptr + (row0 + ts)[:, None] * HC + outs[None, :], (2.0 * gate).to(dt), mask=mask)


@triton.jit
def _up_gate(up_ptr, us_ptr, a_ptr, s: tl.constexpr, hs, mh, row0, ts, T, H: tl.constexpr, R: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, OFFSET: tl.constexpr,
             Q8: tl.constexpr, PDL: tl.constexpr, dt: tl.constexpr):
    """[BLOCK_T, BLOCK_H]: stream s's `up` GEMV over `a` for the H tile hs, row-scaled with Q8, then the sigmoid
    gate, rounded as `GatedResidual.mix` rounds it. PDL: the wait after the first weight tile of stream 0, before
    the first `a`."""
    u = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j0 in tl.static_range(0, R, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        mj = js < R
        w = tl.load(up_ptr + (s * H + hs).to(tl.int64)[:, None] * R + js[None, :],
                    mask=mh[:, None] & mj[None, :], other=OFFSET).to(tl.float32) - OFFSET
        if PDL:
            if s == 0 and j0 == 0:
                pdl_wait(PDL)                             # after the first weight tile, before the first `a`
        for t in tl.static_range(BLOCK_T):
            a = tl.load(a_ptr + (row0 + t) * R + js, mask=mj & (row0 + t < T), other=0.0).to(tl.float32)
            part = tl.sum(w * a[None, :], axis=1)
            u += tl.where((ts == t)[:, None], part[None, :], 0.0)
    if Q8:
        u = u * tl.load(us_ptr + s * H + hs, mask=mh, other=0.0).to(tl.float32)[None, :]
    return round_to(1.0 / (1.0 + tl.exp(-round_to(u, dt))), dt)


@triton.jit
def _hc_up_mix_kernel(n_ptr, a_ptr, up_ptr, us_ptr, y_ptr, T, stride_y,
                      H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, Q8: tl.constexpr,
                      PDL: tl.constexpr = False, L2PF: tl.constexpr = False):
    """The `up` GEMV per stream, sigmoid, and the mean of gate * normed; with Q8 the up weight is INT8 bytes
    (stored value + 128) with one scale a row (us), applied to each row's sum. L2PF (with PDL): first the program's
    weight rows into L2, each stream's H tile (whole rows, contiguous) one prefetch."""
    OFFSET: tl.constexpr = 128.0 if Q8 else 0.0
    hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = hs < H
    row0 = tl.program_id(1) * BLOCK_T
    ts = tl.arange(0, BLOCK_T)
    mt = row0 + ts < T
    mask = mt[:, None] & mh[None, :]
    dt: tl.constexpr = y_ptr.dtype.element_ty
    if L2PF:
        h0 = tl.program_id(0) * BLOCK_H
        for s in tl.static_range(HC):
            l2_prefetch_rows(up_ptr, s * H + h0, tl.minimum(H - h0, BLOCK_H), R, 0, R, BLOCK_H)
    mix = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(HC):
        gate = _up_gate(up_ptr, us_ptr, a_ptr, s, hs, mh, row0, ts, T, H, R, BLOCK_T, BLOCK_H, BLOCK_J, OFFSET, Q8,
                        PDL, dt)
        nx = tl.load(n_ptr + (row0 + ts).to(tl.int64)[:, None] * (HC * H) + (s * H + hs)[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        mix += round_to(gate * nx, dt)
    y = round_to(mix / HC, dt).to(dt)
    tl.store(y_ptr + (row0 + ts).to(tl.int64)[:, None] * stride_y + hs[None, :], y, mask=mask)


@triton.jit
def _hc_inject_kernel(x_ptr, o_ptr, g_ptr, y_ptr, stride_x, stride_o, stride_y,
                      H: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                                          # no weights: everything it reads an earlier kernel wrote
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
           inject_w: torch.Tensor | None, hc: int, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc], or None for the final mixer);
    `hyper_connection_ref.hc_mix` in three kernels. Weights in the streams' dtype."""
    _, mixed, inject = _mix(streams, None, None, hc_norm_w, down_w, up_w, inject_w, hc, eps)
    return mixed, inject


def hc_inject_mix(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, hc_norm_w: torch.Tensor,
                  down_w: torch.Tensor, up_w: torch.Tensor, inject_w: torch.Tensor | None, hc: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`hc_inject` of the previous block's output, then `hc_mix` of the result, with the injection inside the mix's
    first kernel: -> (new streams, block input, injection weights)."""
    return _mix(streams, out, weights, hc_norm_w, down_w, up_w, inject_w, hc, eps)


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


def _in_place(w) -> bool:
    """The weight reaches the kernels without a copy: with PDL the mix kernels load weights before their wait, and a
    copy made here would be an earlier kernel's output still being written."""
    if w is None:
        return True
    if isinstance(w, PackedWeight):
        return w.words.is_contiguous() and w.scales[:, 0].is_contiguous()
    return w.is_contiguous()


def _mix(streams, out, weights, hc_norm_w, down_w, up_w, inject_w, hc: int, eps: float):
    in_place = all(_in_place(w) for w in (hc_norm_w, down_w, up_w, inject_w))
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
    pdl = pdl_usable(x) and in_place
    l2pf = pdl and l2_prefetch_usable(x)
    br, bk, warps, *rest = (DOWN_CFG_Q8 if down_s is not None else DOWN_CFG)[_bucket(t)]
    normed = torch.empty((t, width), dtype=dt, device=dev)
    _hc_prep_kernel[(t, hc)](
        x, o if out is not None else x, g if out is not None else x, new_streams, hc_norm_w, normed,
        x.stride(0), o.stride(0) if out is not None else 0, new_streams.stride(0), eps,
        H=hidden, HC=hc, INJECT=out is not None, BLOCK=triton.next_power_of_2(hidden),
        num_warps=8 if hidden >= 2048 else 4, PDL=pdl, launch_pdl=pdl)
    bt = min(triton.next_power_of_2(t), 16)
    splits = rest[0] if rest else 1
    bk = min(triton.next_power_of_2(triton.cdiv(width, splits)), bk)
    span = width if splits == 1 else triton.cdiv(triton.cdiv(width, splits), bk) * bk
    n_tiles = triton.cdiv(rank, br) + (triton.cdiv(hc, br) if inject_w is not None else 0)
    n_rows = triton.cdiv(t, bt)
    if splits > 1 and n_tiles * n_rows > LOCKS:
        raise ValueError(f"{n_tiles * n_rows} output tiles: more than the split counters ({LOCKS})")
    part = torch.empty((splits, t, rank + hc), dtype=torch.float32, device=dev) if splits > 1 else a
    _hc_down_kernel[(n_tiles, n_rows, splits)](
        normed, down_w, down_s if down_s is not None else a, inject_w.contiguous() if inject_w is not None else a,
        a, inject if inject is not None else a, part, split_locks(dev) if splits > 1 else a, t, H=hidden, R=rank,
        HC=hc, BLOCK_T=bt, BLOCK_R=br, BLOCK_K=bk, SPLITS=splits, SPAN=span, Q8=down_s is not None,
        num_warps=warps, PDL=pdl, L2PF=l2pf, launch_pdl=pdl)
    bh, bj, warps = (UP_CFG_Q8 if up_s is not None else UP_CFG)[_bucket(t)]
    bh = min(triton.next_power_of_2(hidden), bh)
    _hc_up_mix_kernel[(triton.cdiv(hidden, bh), triton.cdiv(t, bt))](
        normed, a, up_w, up_s if up_s is not None else a, mixed, t, mixed.stride(0), H=hidden, R=rank, HC=hc,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_J=min(triton.next_power_of_2(rank), bj), Q8=up_s is not None,
        num_warps=warps, PDL=pdl, L2PF=l2pf, launch_pdl=pdl)
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
        pdl = pdl_usable(x)
        _hc_inject_kernel[(triton.cdiv(width, block), t)](x, o, g, y, x.stride(0), o.stride(0), y.stride(0),
                                                          H=width // hc, HC=hc, BLOCK=block, PDL=pdl, launch_pdl=pdl)
    return y


def _kernel_rows(streams: torch.Tensor) -> bool:
    """Whether a mix of these rows takes the kernels: up to `DECODE_ROWS`, or `EAGER_ROWS` when no graph is being
    captured (a captured PyTorch path costs no launches)."""
    t = streams.shape[0]
    if t <= DECODE_ROWS:
        return True
    return t <= EAGER_ROWS and not (streams.is_cuda and torch.cuda.is_current_stream_capturing())


def hc_mix_module(module: GatedResidual, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module.mix(streams)` of a `GatedResidual` through the kernels at decode sizes (`_kernel_rows`), through the
    PyTorch reference above them or for packed weights the kernels do not read (not `module.mix`, which calls this
    function when its kernel flag is on)."""
    w = _module_weights(module)
    if _kernel_rows(streams) and kernel_form(w[1]) and kernel_form(w[2]):
        return hc_mix(streams, *w, module.hc, module.hc_norm.eps)
    return hyper_connection_ref.hc_mix(streams, *w, module.hc, module.hc_norm.eps)


def _module_weights(module: GatedResidual) -> tuple:
    """(norm weight, down, up, inject): down and up a PackedWeight where the module keeps them packed."""
    inject = module.block_inject_weight
    down, up = module.input_mix_weight_down, module.input_mix_weight_up
    return (module.hc_norm.weight, down.packed() if hasattr(down, "packed") else down.weight,
            up.packed() if hasattr(up, "packed") else up.weight, None if inject is None else inject.weight)


def hc_inject_mix_module(module: GatedResidual, streams: torch.Tensor, out: torch.Tensor,
                         weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`GatedResidual.inject` then `module.mix`, fused at decode sizes (`_kernel_rows`; the reference above, or for
    packed weights the kernels do not read)."""
    w = _module_weights(module)
    if _kernel_rows(streams) and kernel_form(w[1]) and kernel_form(w[2]):
        return hc_inject_mix(streams, out, weights, *w, module.hc, module.hc_norm.eps)
    streams = hyper_connection_ref.hc_inject(streams, out, weights)
    return (streams, *hyper_connection_ref.hc_mix(streams, *w, module.hc, module.hc_norm.eps))
