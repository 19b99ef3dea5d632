"""The two GatedResidual decode kernels of the field report (002 §3.3), and the stream update after a block.

Why: a GatedResidual is six small kernels in PyTorch (~32 µs each on a 3090, two per layer), and its down/up
weights, 2 x [320, 10240], are ~23% of the bytes a decode step reads (001 §2). Two kernels read each weight once:

A `_hc_down_inject_kernel`, one program per (r-tile, row block): the grouped RMSNorm statistics, then the normed
  streams on the fly while streaming over hc*H, dotted with a tile of `down` rows (the last tiles: `block_inject`
  rows); SiLU (or 2*sigmoid) applied on store. It also saves each row's per-stream 1/rms for kernel B.
B `_hc_up_mix_kernel`, one program per (H-tile, row block): the `up` GEMV for each stream's H-tile, sigmoid, and the
  mean over streams of gate * normed, in registers (normed recomputed from the streams and the saved 1/rms).
Each weight tile is loaded once per row block and used for all its rows (up to 16).

Both round to the input dtype wherever `GatedResidual.mix` does (normed, each Linear output, /hc, silu, sigmoid,
gate * normed, the mean), so they agree with the PyTorch path to within bf16 noise. Sized for decode (T <= 16): each
row block re-reads the weights, so prefill-size batches belong on a tl.dot GEMM (002 §3.3: different tiles again).
H, r and hc are compile-time constants (fixed per checkpoint): the loop over streams unrolls, loop bounds are known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from stage_worker.kernels import hyper_connection_ref
from stage_worker.kernels.rmsnorm import round_to

if TYPE_CHECKING:   # the model will import this module behind its kernel flag: no import cycle at run time
    from stage_worker.model.hyper_connection import GatedResidual

# Above this many rows `hc_mix_module` takes the PyTorch path: these kernels re-normalise each row block per
# program. Measured on the H200 (docs/performance.md, full-shape decode with graphs): the kernels win at batch 1
# (21.9% vs 17.7% of the roofline) and 4 (28.1% vs 26.0%) and lose at 16 (31.2% vs 42.9%); 8 is unmeasured.
DECODE_ROWS = 4


@triton.jit
def _hc_down_inject_kernel(x_ptr, nw_ptr, down_ptr, inj_ptr, a_ptr, g_ptr, rstd_ptr, T, stride_x, eps,
                           H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr):
    pid_r = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_T
    ts = tl.arange(0, BLOCK_T)
    mt = row0 + ts < T
    x_rows = x_ptr + (row0 + ts).to(tl.int64)[:, None] * stride_x
    n_down: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    is_down = pid_r < n_down
    if is_down:
        w_ptr = down_ptr
        outs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < R
    else:
        w_ptr = inj_ptr
        outs = (pid_r - n_down) * BLOCK_R + tl.arange(0, BLOCK_R)
        mo = outs < HC
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * (HC * H)
    dt: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for s in tl.static_range(HC):
        sq = tl.zeros([BLOCK_T, BLOCK_KS], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_KS):
            ks = k0 + tl.arange(0, BLOCK_KS)
            x = tl.load(x_rows + (s * H + ks)[None, :], mask=mt[:, None] & (ks < H)[None, :], other=0.0)
            sq += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sq, axis=1) / H + eps)
        if pid_r == 0:
            tl.store(rstd_ptr + (row0 + ts) * HC + s, rstd, mask=mt)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mk = ks < H
            # One weight tile for every row of the block: the weights are the bytes that count (001 §2).
            w = tl.load(w_rows + (s * H + ks)[None, :], mask=mo[:, None] & mk[None, :], other=0.0).to(tl.float32)
            scale = 1.0 + tl.load(nw_ptr + s * H + ks, mask=mk, other=0.0).to(tl.float32)
            for t in range(BLOCK_T):
                x = tl.load(x_ptr + (row0 + t).to(tl.int64) * stride_x + s * H + ks, mask=mk & (row0 + t < T),
                            other=0.0).to(tl.float32)
                normed = round_to((x * tl.sum(tl.where(ts == t, rstd, 0.0), axis=0)) * scale, dt)
                part = tl.sum(w * normed[None, :], axis=1)
                acc += tl.where((ts == t)[:, None], part[None, :], 0.0)
    v = round_to(round_to(acc, dt) / HC, dt)
    mask = mt[:, None] & mo[None, :]
    if is_down:
        silu = round_to(v / (1.0 + tl.exp(-v)), dt)
        tl.store(a_ptr + (row0 + ts)[:, None] * R + outs[None, :], silu.to(dt), mask=mask)
    else:
        gate = round_to(1.0 / (1.0 + tl.exp(-v)), dt)
        tl.store(g_ptr + (row0 + ts)[:, None] * HC + outs[None, :], (2.0 * gate).to(dt), mask=mask)


@triton.jit
def _hc_up_mix_kernel(x_ptr, nw_ptr, rstd_ptr, a_ptr, up_ptr, y_ptr, T, stride_x, stride_y,
                      H: tl.constexpr, R: tl.constexpr, HC: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
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
        for j0 in range(0, R, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            mj = js < R
            w = tl.load(up_ptr + (s * H + hs).to(tl.int64)[:, None] * R + js[None, :],
                        mask=mh[:, None] & mj[None, :], other=0.0).to(tl.float32)
            for t in range(BLOCK_T):
                a = tl.load(a_ptr + (row0 + t) * R + js, mask=mj & (row0 + t < T), other=0.0).to(tl.float32)
                part = tl.sum(w * a[None, :], axis=1)
                u += tl.where((ts == t)[:, None], part[None, :], 0.0)
        gate = round_to(1.0 / (1.0 + tl.exp(-round_to(u, dt))), dt)
        rstd = tl.load(rstd_ptr + (row0 + ts) * HC + s, mask=mt, other=0.0)
        x = tl.load(x_ptr + (row0 + ts).to(tl.int64)[:, None] * stride_x + (s * H + hs)[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        scale = 1.0 + tl.load(nw_ptr + s * H + hs, mask=mh, other=0.0).to(tl.float32)
        mix += round_to(gate * round_to((x * rstd[:, None]) * scale[None, :], dt), dt)
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
           inject_w: torch.Tensor | None, hc: int, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc], or None for the final mixer);
    `hyper_connection_ref.hc_mix` in two kernels. Weights in the streams' dtype."""
    t, width = streams.shape
    hidden, rank = width // hc, down_w.shape[0]
    if hidden * hc != width or tuple(down_w.shape) != (rank, width) or tuple(up_w.shape) != (width, rank):
        raise ValueError(f"streams {tuple(streams.shape)}, down {tuple(down_w.shape)}, up {tuple(up_w.shape)} "
                         f"and hc {hc} do not fit together")
    if inject_w is not None and tuple(inject_w.shape) != (hc, width):
        raise ValueError(f"block_inject weight {tuple(inject_w.shape)} is not {(hc, width)}")
    x = _rows_contiguous(streams)
    dev, dt = x.device, x.dtype
    hc_norm_w, down_w, up_w = hc_norm_w.contiguous(), down_w.contiguous(), up_w.contiguous()
    a = torch.empty((t, rank), dtype=dt, device=dev)
    rstd = torch.empty((t, hc), dtype=torch.float32, device=dev)
    mixed = torch.empty((t, hidden), dtype=dt, device=dev)
    inject = torch.empty((t, hc), dtype=dt, device=dev) if inject_w is not None else None
    if t == 0:
        return mixed, inject
    bt = min(triton.next_power_of_2(t), 16)
    # Untuned starting points for the GPU run. ~160 programs of 2 `down` rows at T=1 spread the 6.5 MB over the
    # SMs; more rows per program as T grows, since each program normalises its whole row block again.
    br = 2 if t == 1 else 4 if t <= 4 else 8
    n_tiles = triton.cdiv(rank, br) + (triton.cdiv(hc, br) if inject_w is not None else 0)
    _hc_down_inject_kernel[(n_tiles, triton.cdiv(t, bt))](
        x, hc_norm_w, down_w, inject_w.contiguous() if inject_w is not None else down_w, a,
        inject if inject is not None else a, rstd, t, x.stride(0), eps, H=hidden, R=rank, HC=hc, BLOCK_T=bt,
        BLOCK_R=br, BLOCK_K=min(triton.next_power_of_2(hidden), 4096 // br),
        BLOCK_KS=min(triton.next_power_of_2(hidden), max(16, 4096 // bt)))
    bh = min(triton.next_power_of_2(hidden), 16)
    _hc_up_mix_kernel[(triton.cdiv(hidden, bh), triton.cdiv(t, bt))](
        x, hc_norm_w, rstd, a, up_w, mixed, t, x.stride(0), mixed.stride(0), H=hidden, R=rank, HC=hc,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_J=min(triton.next_power_of_2(rank), 256))
    return mixed, inject


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
    above `DECODE_ROWS` rows (not `module.mix`, which calls this function when its kernel flag is on)."""
    inject = module.block_inject_weight
    weights = (module.hc_norm.weight, module.input_mix_weight_down.weight, module.input_mix_weight_up.weight,
               None if inject is None else inject.weight)
    mix = hc_mix if streams.shape[0] <= DECODE_ROWS else hyper_connection_ref.hc_mix
    return mix(streams, *weights, module.hc, module.hc_norm.eps)
