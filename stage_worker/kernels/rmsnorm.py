"""Zero-centred, optionally grouped RMSNorm in one Triton kernel (reference: `rmsnorm_ref.py`).

The model's norm is four or five small PyTorch kernels (cast, square-mean, rsqrt-scale, weight, cast back) at every
call site; at decode they are launch-bound, not byte-bound (docs/performance.md: ~300 kernels per layer per step).
One program per row; groups (one per hyper-connection stream, `hc_norm` and PLE's norms) are a loop inside it.
Widths are compile-time constants: a checkpoint has a handful of them, so few compiles and known loop bounds (and
Triton 3.6's interpreter cannot take a run-time loop bound under numpy 2.4).
With the kernel flag `pdl` (`common.pdl_usable`) both kernels launch as programmatic dependents: `rmsnorm` waits
(`common.pdl_wait`) first thing (its weight loads sit in the groups' loop, between loads of x), `add_rmsnorm` loads
the norm weight before the wait and x, the residual and every store after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stage_worker.kernels.common import pdl_usable, pdl_wait


@triton.jit
def round_to(x, dt: tl.constexpr):
    """fp32 `x` rounded to `dt`'s precision (to nearest even), kept in fp32: where the PyTorch path stores a bf16
    tensor. Integer ops rather than a cast because Triton 3.6's interpreter truncates fp32 -> bf16, which would hide
    a misplaced rounding point from the CPU tests; on the GPU it costs a few ALU ops in byte-bound kernels."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, eps, D: tl.constexpr, G: tl.constexpr,
                    ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                 # first: x is an earlier kernel's output (PDL: launched as a dependent)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    for g0 in range(0, D, G):
        # Pass 1: the group's mean square in fp32; pass 2 re-reads the row (L1/L2-resident) to scale and store.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, G, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + g0 + offs, mask=offs < G, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / G + eps)
        for k0 in range(0, G, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            mask = offs < G
            x = tl.load(x_row + g0 + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + g0 + offs, mask=mask, other=0.0).to(tl.float32)
            scale = 1.0 + w if ZERO_CENTRED else w
            y = round_to((x * rstd) * scale, y_ptr.dtype.element_ty)
            tl.store(y_row + g0 + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None,
            zero_centred: bool = True) -> torch.Tensor:
    """x [..., D] -> [..., D], as `rmsnorm_ref.rmsnorm`: fp32 inside, x's dtype out."""
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if d % g:
        raise ValueError(f"width {d} is not a multiple of group_size {g}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(triton.next_power_of_2(g), 1024)
        pdl = pdl_usable(x2)
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, x2.stride(0), y.stride(0), eps, D=d, G=g,
                                        ZERO_CENTRED=zero_centred, BLOCK=block, PDL=pdl, launch_pdl=pdl)
    return y.reshape(x.shape)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, stride_x, stride_r, stride_s, stride_y, eps,
                        D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    dt: tl.constexpr = y_ptr.dtype.element_ty
    if PDL:                       # the norm weight (nothing writes it during decode) before the wait, the rest after
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=m, other=0.0).to(tl.float32)
    s = round_to(x + r, dt)
    tl.store(s_ptr + row * stride_s + offs, s.to(dt), mask=m)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / D + eps)
    if not PDL:
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, round_to((s * rstd) * (1.0 + w), dt).to(dt), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, zero-centred RMSNorm of that sum) in one launch, as `rmsnorm_ref.add_rmsnorm`: the residual add
    that ends a block and the norm that starts the next are two launches each per layer otherwise (Qwen3-Next,
    Qwen3.5). One program per row; rows up to 16K features (decode-sized widths)."""
    d = x.shape[-1]
    x2, r2 = x.reshape(-1, d), residual.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    s = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    y = torch.empty_like(s)
    if x2.shape[0]:
        pdl = pdl_usable(x2) and weight.is_contiguous()     # a copied weight is an earlier kernel's output
        _add_rmsnorm_kernel[(x2.shape[0],)](x2, r2, s, weight.contiguous(), y, x2.stride(0), r2.stride(0),
                                            s.stride(0), y.stride(0), eps, D=d, BLOCK=triton.next_power_of_2(d),
                                            num_warps=8 if d >= 2048 else 4, PDL=pdl, launch_pdl=pdl)
    return s.reshape(x.shape), y.reshape(x.shape)
