"""Dequantize a block of rows of a packed dense weight (`quant_gemv_ref.PackedWeight`: INT4/6/8, the dense bit
stream or the older one-value-a-slot layout, a scale a row or a group) into a preallocated float tensor in ONE
launch, for `quant_gemv.dequant_matmul` (prefill, and decode batches past the GEMV kernels' token counts).

Why: the PyTorch dequantization (`quant_gemv_ref.dequantize_packed`) is a chain of whole-tensor ops a block of
rows: 7-8 for INT4 and INT8, 45 for the INT6 dense stream (its 16 values a period each a shift, a mask and for 2 of
them an or of the next word; counted with a dispatch-mode op counter on CPU), each a kernel launch on a GPU, with
CHUNK = 4M elements a block. A reports-mixed model's 46-token prefill step launched tens of thousands of them
(~1.3 s of a 1.6-2.4 s time to first token on the H200, against a 6.5 ms decode step).

How: grid (row blocks, K tiles), a program one tile of BLOCK_N rows x NPER periods, decoded with the GEMV kernels'
helpers (`quant_gemv._period_words`: the WP words of each period; `quant_gemv._wide_values`: value j of a period by
constant shifts, joined into input order), the scale applied, stored contiguously along the row. Bit for bit the
reference: the signed value q = u - 2^(bits-1) is exact in fp32 (the wide helper's FMA with the constants 2^bits
and 3 * 2^(bits-1): integers); q * s is one fp32 multiply, then rounded to the scales' dtype and to the output's.
With 16-bit scales the fp32 product is exact (q has at most 8 significant bits, s 8 or 11), so its one rounding is
the reference's product in that dtype; with fp32 scales the multiply is the reference's. bf16 rounding is done on
the bits (`_rounded`, to nearest even as the GPU's cast), because the Triton interpreter's casts to bf16 truncate
(Triton 3.6, even with fp_downcast_rounding="rtne").

Block FP8 (`fp8_gemv.dequant_matmul`, `dequantize_fp8_into`): float8_e4m3fn bytes times their float32 block scale,
one program a tile, then rounded to the output dtype: bit for bit `fp8_gemv_ref.dequantize_rows` (the bytes convert
to float32 exactly, one float32 multiply, one rounding). PyTorch's path was 5 ops a block with float32 temporaries
(~30 bytes an element against 3 here), 7 launches a block with the matmul and the copy.

Reference: `quant_gemv_ref.dequantize_packed` (`fp8_gemv_ref.dequantize_rows` for FP8); tests: tests/test_kernel_quant_gemv.py (CPU under
TRITON_INTERPRET=1, bit for bit; an sm_90 compile; the H200 at o_proj and lm_head size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stage_worker.kernels.fp8_gemv_ref import Fp8Weight
from stage_worker.kernels.quant_gemv_ref import PackedWeight

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux: dequant_matmul keeps the PyTorch path
    triton = None

# (BLOCK_N rows, BLOCK_K inputs, warps) a program: a guess until the H200 test
# (tests/test_kernel_quant_gemv.py::test_prefill_dequant_on_the_gpu) has timed it: 8192 values a program, 64 a
# thread at 4 warps (the wide GEMV kernel's tile), 256 inputs a row = 512 contiguous bytes of bf16 stored a row.
CFG = (32, 256, 4)
# (BLOCK_N rows, BLOCK_K inputs, warps) of the FP8 kernel: a guess (a byte a value, 32 KB of bytes a program).
FP8_CFG = (32, 256, 4)
BITS = (4, 6, 8)


def blockwise_linear(x: torch.Tensor, n: int, step: int,
                     block: Callable[[int, int, torch.Tensor | None], torch.Tensor], reuse: bool) -> torch.Tensor:
    """x [T, K] @ W^T for a weight W [n, K] made `step` rows at a time by `block(r0, r1, buf)` (the rows [r0, r1) in
    x's dtype; `buf` a view of one [step, K] buffer every block reuses when `reuse`, else None), one matmul a block:
    prefill's path for packed and block-FP8 weights (`quant_gemv.dequant_matmul`, `fp8_gemv.dequant_matmul`), never
    the whole weight in float. One block: the matmul's output as it is, no copy into a wider one."""
    T, K = x.shape
    buf = torch.empty(min(step, n), K, dtype=x.dtype, device=x.device) if reuse else None
    if n <= step:
        return torch.nn.functional.linear(x, block(0, n, buf))
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out[:, r0:r1] = torch.nn.functional.linear(x, block(r0, r1, None if buf is None else buf[: r1 - r0]))
    return out


def usable(pw: PackedWeight) -> bool:
    """The kernel takes this weight (Triton installed, int32 words of 4, 6 or 8 bits)."""
    return triton is not None and pw.bits in BITS and pw.words.dtype == torch.int32


def launch_config(rows: int, K: int, bits: int, dense: bool, group: int,
                  cfg: tuple[int, int, int] | None = None) -> dict:
    """Tile sizes and scale mode: NPER periods a tile (a power of two, at most BLOCK_K inputs' worth, at most what
    K needs), PP the period padded to a power of two (the older INT6 layout's 5 values: 8 positions, 3 unused);
    SCALE 0 one scale a row, 1 one a period (the group a multiple of the period), 2 one a value (other groups:
    INT6 stream groups of 24, the older layout in groups of 128), as the GEMV kernels."""
    from stage_worker.kernels.quant_gemv import _floor_pow2, period

    bn, bk, warps = cfg or CFG
    p, wp = period(bits, dense)
    nper = min(_floor_pow2(max(1, bk // p)), triton.next_power_of_2(-(-K // p)))
    return dict(BLOCK_N=bn, NPER=nper, P=p, PP=triton.next_power_of_2(p), WP=wp, warps=warps,
                SCALE=0 if group >= K else 1 if group % p == 0 else 2,
                grid=(triton.cdiv(rows, bn), triton.cdiv(-(-K // p), nper)))


if triton is not None:
    from stage_worker.kernels.quant_gemv import _period_words, _wide_values

    @triton.jit
    def _rounded(v, DT: tl.constexpr):
        """v (fp32) rounded to the nearest DT value, ties to even, held in fp32 (a later cast to DT, or to a wider
        type, is exact). bf16 on the bits (add 0x7FFF plus the lowest kept bit, drop the low 16; NaN kept), so the
        interpreter, whose casts to bf16 truncate, and the GPU agree with PyTorch."""
        if DT == tl.bfloat16:
            b = v.to(tl.int32, bitcast=True)
            r = ((b + (0x7FFF + ((b >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
            return tl.where(v == v, r, v)
        elif DT == tl.float16:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, out_ptr, rows, stride_qn, stride_sn, stride_on, one, K: tl.constexpr,
                        W: tl.constexpr, BITS: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, WP: tl.constexpr,
                        GROUP: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr, NPER: tl.constexpr):
        """out[r, k] = round_out(round_scale(q[r, k] * s[r, k // GROUP])) for the tile (program_id(0): BLOCK_N rows,
        program_id(1): NPER periods): see the module docstring."""
        r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = r < rows
        r64 = r.to(tl.int64)
        p0 = tl.program_id(1) * NPER
        w0, w1, w2 = _period_words(q_ptr + r64[None, :] * stride_qn, mask_n[None, :],
                                   p0 + tl.arange(0, NPER)[:, None], W, WP)             # [NPER, BLOCK_N]
        # f * 2^B - (2^B + 2^(B-1)) = u - 2^(B-1), the signed value (f = 1 + u / 2^B): integers, exact
        s1 = tl.full([1, 1], 1 << BITS, tl.float32)
        s2 = tl.full([1, 1], (1 << BITS) + (1 << (BITS - 1)), tl.float32)
        q = _wide_values(w0, w1, w2, one, s1, s2, s_ptr, 0, mask_n[None, :], 0, 1, PP, P, BITS, GROUP, 0, K)
        q = tl.reshape(q, [NPER, BLOCK_N, PP])                              # value j of period p of a row
        kp = (p0 + tl.arange(0, NPER)) * P                                  # each period's first input
        if SCALE == 0:
            s = tl.load(s_ptr + r64 * stride_sn, mask=mask_n, other=0.0)[None, :, None]
        elif SCALE == 1:                                                    # the group a multiple of the period
            s = tl.load(s_ptr + r64[None, :] * stride_sn + (kp // GROUP)[:, None],
                        mask=mask_n[None, :] & (kp < K)[:, None], other=0.0)[:, :, None]
        else:
            kv = kp[:, None, None] + tl.arange(0, PP)[None, None, :]
            s = tl.load(s_ptr + r64[None, :, None] * stride_sn + kv // GROUP,
                        mask=mask_n[None, :, None] & (kv < K) & (tl.arange(0, PP) < P)[None, None, :], other=0.0)
        OUT: tl.constexpr = out_ptr.dtype.element_ty
        v = _rounded(_rounded(q * s.to(tl.float32), s_ptr.dtype.element_ty), OUT)
        v = tl.reshape(tl.permute(v, (1, 0, 2)), [BLOCK_N, NPER * PP])     # input order along the row
        kk = tl.arange(0, NPER * PP)
        if PP == P:
            k = p0 * P + kk                                                  # contiguous: vector stores
            valid = k < K
        else:
            k = (p0 + kk // PP) * P + kk % PP
            valid = (kk % PP < P) & (k < K)
        tl.store(out_ptr + r64[:, None] * stride_on + k[None, :], v.to(OUT), mask=mask_n[:, None] & valid[None, :])


def dequantize_into(pw: PackedWeight, out: torch.Tensor, start: int = 0,
                    cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Rows [start, start + out.shape[0]) of pw's weight into out ([rows, K], its dtype, contiguous rows of any
    stride) in one launch; returns out, = `dequantize_packed(pw, out.dtype, start, start + rows)` bit for bit."""
    from stage_worker.kernels.quant_gemv import ONE

    rows, K = out.shape
    if K != pw.in_features or start < 0 or start + rows > pw.out_features or (K > 1 and out.stride(1) != 1):
        raise ValueError(f"dequantize_into: out {list(out.shape)} (strides {out.stride()}) from row {start} of a "
                         f"[{pw.out_features}, {pw.in_features}] weight")
    if not usable(pw):
        raise ValueError(f"dequantize_into: {pw.bits}-bit {pw.words.dtype} words")
    if rows == 0 or K == 0:
        return out
    c = launch_config(rows, K, pw.bits, pw.dense, pw.group, cfg)
    words, scales = pw.words[start:start + rows], pw.scales[start:start + rows]
    _dequant_kernel[c["grid"]](
        words, scales, out, rows, words.stride(0), scales.stride(0), out.stride(0), ONE, K=K, W=pw.words.shape[1],
        BITS=pw.bits, P=c["P"], PP=c["PP"], WP=c["WP"], GROUP=pw.group, SCALE=c["SCALE"], BLOCK_N=c["BLOCK_N"],
        NPER=c["NPER"], num_warps=c["warps"])
    return out


if triton is not None:
    @triton.jit
    def _fp8_dequant_kernel(q_ptr, s_ptr, out_ptr, rows, K, stride_qn, stride_sn, stride_on, BR: tl.constexpr,
                            BC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[r, k] = round_out(float(q[r, k]) * s[r // BR, k // BC]) for a BLOCK_N x BLOCK_K tile; `rows` counts
        from the block's first row, which starts a scale block (the caller's rows are a multiple of BR)."""
        r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        r64 = r.to(tl.int64)
        m = (r < rows)[:, None] & (k < K)[None, :]
        q = tl.load(q_ptr + r64[:, None] * stride_qn + k[None, :], mask=m, other=0)
        f = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = tl.load(s_ptr + (r64 // BR)[:, None] * stride_sn + (k // BC)[None, :], mask=m, other=0.0)
        OUT: tl.constexpr = out_ptr.dtype.element_ty
        tl.store(out_ptr + r64[:, None] * stride_on + k[None, :], _rounded(f * s, OUT).to(OUT), mask=m)


def dequantize_fp8_into(fw: Fp8Weight, out: torch.Tensor, start: int = 0,
                        cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Rows [start, start + out.shape[0]) of a block-FP8 weight into out ([rows, K], its dtype, contiguous rows) in
    one launch; returns out, = `fp8_gemv_ref.dequantize_rows(fw, out.dtype, start, start + rows)` bit for bit.
    `start` a multiple of the block's rows, as `dequantize_rows` asks."""
    rows, K = out.shape
    br, bc = fw.block
    if K != fw.in_features or start < 0 or start % br or start + rows > fw.out_features or \
            (K > 1 and out.stride(1) != 1):
        raise ValueError(f"dequantize_fp8_into: out {list(out.shape)} (strides {out.stride()}) from row {start} "
                         f"of a [{fw.out_features}, {fw.in_features}] weight in blocks {fw.block}")
    if triton is None:
        raise ValueError("dequantize_fp8_into: Triton is not installed")
    if rows == 0 or K == 0:
        return out
    bn, bk, warps = cfg or FP8_CFG
    q, scale = fw.q[start:start + rows], fw.scale[start // br:]
    _fp8_dequant_kernel[(triton.cdiv(rows, bn), triton.cdiv(K, bk))](
        q, scale, out, rows, K, q.stride(0), scale.stride(0), out.stride(0), BR=br, BC=bc, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps)
    return out
