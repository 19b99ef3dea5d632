"""The block-FP8 GEMV (issue 17): y [T, N] = x [T, K] @ dequant(W)^T for a dense Linear weight kept as a block-FP8
checkpoint stores it (float8_e4m3fn bytes and a float32 scale per 128 x 128 block, `fp8_gemv_ref.Fp8Weight`), so
decode reads one byte a weight instead of bf16's two (`stage_worker/model/fp8_linear.py` decides which modules).

One launch, grid (token groups, cdiv(N, BLOCK_N), K slices). A program owns BLOCK_N output rows, up to TP tokens
and one slice of the inputs, and walks it BLOCK_K inputs at a time: the tile's bytes are loaded as uint8 and
converted in registers (bitcast to float8e4nv, then float32: the FP8 experts' approach, `moe._moe_up_kernel`),
times the scale of their block. BLOCK_K divides the block's columns where it can (ROW_SCALE: one scale a row a tile,
a [BLOCK_N] load; else one gathered a weight), so the scale costs one multiply a weight and no extra bytes to speak
of (one float32 per 16,384 weights). Then, by token count:
* DOT (every token count from DOT_MIN_T, 1 since h200-16): the scaled tile rounded to x's dtype (the weight the
  dequantize-at-load path holds) and one tl.dot with the [BLOCK_K, 16] inputs (tokens past T masked to 0), fp32
  accumulate;
* FMA (`dot=False`, the A/B): fp32 products into an accumulator [TP, BLOCK_N, BLOCK_K], reduced once at the end
  (nothing reduced across threads inside the loop, as `quant_gemv`'s FMA path); slower than DOT at 1 and 4 tokens
  on the H200.
Small N (o_proj, out_proj: few row blocks for the SMs) splits K into slices; each writes fp32 partial sums and the
last program of an output tile adds them in a fixed order (`split_reduce.store_tile`: one
launch, deterministic). More than DECODE_MAX_T tokens (prefill) and machines without Triton take `dequant_matmul`
(on CUDA each block dequantized by one Triton launch, `quant_dequant.dequantize_fp8_into`):
a block of rows dequantized at a time (never the whole weight in float) and a matmul.

Reference: `fp8_gemv_ref.fp8_gemv_ref`; tests: tests/test_kernel_fp8_gemv.py (CPU under TRITON_INTERPRET=1; on a GPU
graph replays bit for bit and the full shapes timed against cuBLAS on the bf16 weight). CFG is a guess until that
test has run on the H200 (bench/results/fp8-dense-1/next.txt).
With the kernel flag `pdl` (`common.pdl_usable`) the kernel launches as a programmatic dependent and waits
(`common.pdl_wait`) before its first load (no weight prologue yet: the loop loads a tile's bytes, its scale and the
inputs together; PDL saves the launch and ramp-up), the split counters and partials after it.
"""

from __future__ import annotations

import torch

from stage_worker.kernels.fp8_gemv_ref import CHUNK, Fp8Weight, dequantize_rows
from stage_worker.kernels.common import pdl_usable, sm_count, triton_usable
from stage_worker.kernels.quant_gemv import MIN_SPLIT_K, PROGRAMS_PER_SM
from stage_worker.kernels.split_reduce import LOCKS, split_locks

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux: the PyTorch path
    triton = None

DECODE_MAX_T = 16
# One tl.dot a tile from this many tokens: h200-16 timed it against the FMA path and bf16 cuBLAS at 1 and 4 tokens
# (bench/results/h200-16/call2/fp8.log): at 1 it beat both at every shape (80B lm_head 114.5 against 178.5 / 150.4
# us), at 4 it beat the FMA path (216.7 against 287.0) but not bf16. The FMA path stays for `dot=False` (tests).
DOT_MIN_T = 1
TOKENS_PER_PROGRAM = 4        # the FMA path's tokens a program (its accumulator's first dimension)
# (BLOCK_N rows, BLOCK_K inputs, warps) by token count: a call takes the entry of the smallest key >= T. BLOCK_K is
# cut to a power of two dividing the block's columns (128). Guesses sized so a thread keeps 32-64 fp32 cells of the
# FMA accumulator, until the H200 has run tests/test_kernel_fp8_gemv.py's sweep.
CFG = {1: (32, 128, 4), 4: (16, 128, 4), 16: (64, 128, 4)}


if triton is not None:
    from stage_worker.kernels.common import pdl_wait
    from stage_worker.kernels.split_reduce import store_tile

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, N, T, stride_xt, stride_qn, stride_sn,
                         stride_ot, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, K_SLICE: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TP: tl.constexpr,
                         DOT: tl.constexpr, ROW_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                         PDL: tl.constexpr = False):
        """out[t, rows] = sum_k (q[rows, k] s[rows // BR, k // BC]) x[t, k]: see the module docstring. ROW_SCALE:
        BLOCK_K divides BC, so a tile's inputs lie in one column block (one scale a row). A tile past K (the last
        slice's padding) loads nothing, its scale included (a scale past the row's last column would be the next
        row's, or past the tensor's end). PDL: waits first thing (`common.pdl_wait`)."""
        pdl_wait(PDL)                 # first: x, and the split counters / partials, wait (and so the weights)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        rows64 = rows.to(tl.int64)
        offs_t = tl.program_id(0) * TP + tl.arange(0, TP)
        mask_t = offs_t < T
        k_begin = tl.program_id(2) * K_SLICE
        ITERS: tl.constexpr = K_SLICE // BLOCK_K
        DT: tl.constexpr = x_ptr.dtype.element_ty
        w_rows = q_ptr + rows64[:, None] * stride_qn
        s_rows = s_ptr + (rows64 // BR) * stride_sn
        if DOT:
            acc = tl.zeros([BLOCK_N, TP], tl.float32)
        else:
            acc = tl.zeros([TP, BLOCK_N, BLOCK_K], tl.float32)
        for i in range(ITERS):
            k0 = k_begin + i * BLOCK_K
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < K
            m = mask_n[:, None] & mask_k[None, :]
            w = tl.load(w_rows + k[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if ROW_SCALE:
                s = tl.load(s_rows + k0 // BC, mask=mask_n & (k0 < K), other=0.0)[:, None]
            else:
                s = tl.load(s_rows[:, None] + (k // BC)[None, :], mask=m, other=0.0)
            w = w * s
            if DOT:
                xk = tl.load(x_ptr + offs_t[None, :] * stride_xt + k[:, None],
                             mask=mask_k[:, None] & mask_t[None, :], other=0.0)               # [BLOCK_K, TP]
                acc = tl.dot(w.to(DT), xk.to(DT), acc, input_precision=PRECISION)
            else:
                xk = tl.load(x_ptr + offs_t[:, None, None] * stride_xt + k[None, None, :],
                             mask=mask_t[:, None, None] & mask_k[None, None, :], other=0.0)   # [TP, 1, BLOCK_K]
                acc += w[None, :, :] * xk.to(tl.float32)
        if DOT:
            res = acc
        else:
            res = tl.trans(tl.sum(acc, axis=2))                                              # [BLOCK_N, TP]
        store_tile(res, out_ptr, part_ptr, lock_ptr, rows64, mask_n, offs_t, N, T, stride_ot, SPLITS)


def _pow2_factor(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


def launch_config(T: int, N: int, K: int, block: tuple[int, int], device: torch.device,
                  cfg: tuple[int, ...] | None = None, dot: bool | None = None) -> dict:
    """Tile sizes, scale mode and K slices for a call (`cfg` overrides the CFG entry; `dot` forces the tl.dot or
    the FMA path, default from DOT_MIN_T tokens)."""
    dot = T >= DOT_MIN_T if dot is None else dot
    bn, bk, warps = cfg or CFG[min(k for k in CFG if k >= T)]
    lo = 16 if dot else 1                                 # tl.dot's smallest dimension
    bk = max(min(bk, triton.next_power_of_2(K)), lo)      # tiny test widths: one tile
    f = _pow2_factor(block[1])
    if f >= lo:
        bk = min(bk, f)
    if dot:
        bn = max(bn, 16)
    tp = 16 if dot else min(triton.next_power_of_2(T), TOKENS_PER_PROGRAM)
    tiles = triton.cdiv(N, bn) * triton.cdiv(T, tp)
    sms = sm_count(device, cpu=4)
    splits = max(1, min(PROGRAMS_PER_SM * sms // tiles, K // MIN_SPLIT_K))
    k_slice = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    return dict(BLOCK_N=bn, BLOCK_K=bk, warps=warps, TP=tp, DOT=dot, ROW_SCALE=block[1] % bk == 0,
                K_SLICE=k_slice, splits=triton.cdiv(K, k_slice))


def fp8_gemv(x: torch.Tensor, fw: Fp8Weight, cfg: tuple[int, ...] | None = None,
             dot: bool | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T [T, N] in x.dtype, W the block-FP8 weight; = fp8_gemv_ref (within the tl.dot path's
    rounding of the scaled weight to x.dtype). T <= DECODE_MAX_T on a device Triton runs (CUDA, or the interpreter
    on CPU tensors) takes the kernel, no host sync (CUDA-graph safe once `split_locks` exists); anything else
    `dequant_matmul`."""
    T, K = x.shape
    N = fw.out_features
    if K != fw.in_features:
        raise ValueError(f"x has {K} inputs, the fp8 weight {fw.in_features}")
    if T > DECODE_MAX_T or not triton_usable(x):
        return dequant_matmul(x, fw)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    x = x.contiguous()
    q, s = fw.q, fw.scale
    if q.dtype != torch.uint8 or q.stride(1) != 1 or s.dtype != torch.float32 or s.stride(1) != 1:
        raise ValueError(f"fp8 weight: q {q.dtype} strides {q.stride()}, scale {s.dtype} strides {s.stride()}: "
                         f"uint8 and float32 with contiguous rows")
    c = launch_config(T, N, K, fw.block, x.device, cfg, dot)
    blocks, splits, tp = triton.cdiv(N, c["BLOCK_N"]), c["splits"], c["TP"]
    groups = triton.cdiv(T, tp)
    if groups * blocks > LOCKS and splits > 1:
        raise ValueError(f"{groups * blocks} output tiles: more than the split counters ({LOCKS})")
    part = torch.empty(splits, T, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    pdl = pdl_usable(x)
    _fp8_gemv_kernel[(groups, blocks, splits)](
        x, q, s, out, part, split_locks(x.device) if splits > 1 else q, N, T, x.stride(0), q.stride(0), s.stride(0),
        out.stride(0), K=K, BR=fw.block[0], BC=fw.block[1], K_SLICE=c["K_SLICE"], SPLITS=splits,
        BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], TP=tp, DOT=c["DOT"], ROW_SCALE=c["ROW_SCALE"],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c["warps"], PDL=pdl, launch_pdl=pdl)
    return out


def dequant_matmul(x: torch.Tensor, fw: Fp8Weight, kernel: bool | None = None) -> torch.Tensor:
    """Prefill and the CPU: the weight dequantized to x.dtype a block of rows at a time (whole scale blocks; never
    the whole weight in float), each block one matmul: the weights exactly those the dequantize-at-load path holds.
    `kernel`: each block dequantized by one Triton launch (`quant_dequant.dequantize_fp8_into`, into one reused
    buffer, blocks of quant_gemv.GPU_CHUNK elements) instead of PyTorch's float32 ops (blocks of CHUNK); default on
    CUDA with the kernel flag `quant_dequant`, tests turn it on under the interpreter."""
    from stage_worker.kernels import quant_dequant, quant_gemv

    K, N = x.shape[1], fw.out_features
    br = fw.block[0]
    if kernel is None:
        kernel = x.is_cuda and quant_gemv._DEQUANT_KERNEL
    kernel = kernel and triton_usable(x)
    elements = quant_gemv.GPU_CHUNK if kernel and x.is_cuda else CHUNK
    step = max(1, elements // max(K, 1) // br) * br
    return quant_dequant.blockwise_linear(
        x, N, step, lambda r0, r1, buf: quant_dequant.dequantize_fp8_into(fw, buf, r0) if kernel
        else dequantize_rows(fw, x.dtype, r0, r1), reuse=kernel)
