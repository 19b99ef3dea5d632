"""W4/W6/W8-A16 GEMVs over dense Linear weights kept as compressed-tensors packs them (issue 17, item 2): decode reads
the int32 words and their scales and dequantizes in registers, so a step reads 4/16 (INT4), 6/16 (INT6) or 8/16
(INT8) of the bf16 bytes of attention's o_proj, DeltaNet's out_proj, the shared expert beside INT4 experts and
lm_head (`stage_worker/model/quant_linear.py` decides which modules).

One launch, grid (token groups, cdiv(N, BLOCK_N), splits): a program owns up to TOKENS_PER_PROGRAM tokens, BLOCK_N
output rows and one slice of the inputs, and walks it a tile of NPER periods at a time. A period is the smallest run
of whole words holding whole values (`period`): the INT6 dense stream repeats every 3 words (16 values), INT4 and
INT8 every word (8, 4), the older INT6 layout every word (5, top bits unused). Why this shape (the first kernel read
0.03-0.7 TB/s on the H200, bench/results/quant-decode-1, docs/performance.md "Packed dense layers"):
* whole words, never a load per value: a tile is WP loads of [NPER, BLOCK_N] words (the first kernel loaded, for
  INT6, each value's word and maybe the next: 8 bytes of gathers a 0.75-byte value), the next tile's issued before
  one is computed (PREFETCH);
* value j of a period comes from its word by constant shifts (`_value`: shift, one mask-and-or into the mantissa of
  1.0 = 1 + u / 2^bits, exact; no int-to-float conversion), 2 of INT6's 16 values also taking bits of the next
  word; x is taken at stride P to match (value j of every period of the tile);
* the offset 2^(bits-1) and the 2^bits factor are not applied per value: sum (u - o) x = 2^bits sum (f - 1.5) x,
  so the kernel sums f x and x and corrects once a row (per-channel scales) or once a period (group scales, the
  group a multiple of the period: one scale load a period); other groups (INT6 groups of 8 or 24, the older layout
  in groups) take a scale a value;
* nothing is reduced across threads inside the loop: the accumulator [NPER, BLOCK_N, T] keeps one fp32 cell a
  (period, row, token) and is summed over the periods once at the end; the tokens (up to TOKENS_PER_PROGRAM, more
  taking more programs over the same rows, adjacent in the grid so their words come from L2) are its small inner
  dimension, so one unpack serves all of them (the first kernel reduced each tile per token, and took tl.dot at 2-16
  tokens, 10-45x slower than its own one-token path);
* with the kernel flag `quant_gemv_fma` off, 2-16 tokens take one tl.dot a value position of the period ([BLOCK_N,
  NPER] weights by [NPER, 16] x) instead: the A/B for 8-16 tokens, where FMAs (16 a value) may bound the time.
* from WIDE_MIN_T (4) tokens the wide kernel (`_quant_gemm_kernel`, `quant_gemv(wide=)`, flag `quant_gemv_wide`)
  takes the call: the FMA kernel would decode every word in 2-4 programs (at 16 tokens 3-8x slower than cuBLAS bf16,
  h200-13), so one program holds all the tokens, decodes each tile once (the same periods and constant shifts, the
  scale applied with one FMA a value) into x's dtype, joins the value positions into input order and multiplies
  [BLOCK_N, K-tile] by [K-tile, 16 tokens] in one tl.dot (the tensor cores take the 16 multiply-adds a value).
  Past 16 tokens (up to WIDE_MAX_T: prefill of a few short prompts, decode batches over 16) it takes a program a
  group of 16 tokens, each decoding the words again (from L2: the groups of a row block are adjacent in the grid).
With the kernel flag `pdl` (`common.pdl_usable`) both kernels are launched as programmatic dependents: the first
tile's words load before `common.pdl_wait`, everything a previous kernel writes after it. With `l2_prefetch` too
(`common.l2_prefetch_usable`, the constexpr L2PF) each program first asks the L2 for its whole range of words (its
rows x its K slice) and group scales (`_l2_prefetch_slice`), so they stream in from HBM while the previous kernel
runs and the loop's loads after the wait hit the L2.
With several K slices (small N: few row blocks for the SMs) each slice writes fp32 partial sums and the last program
of an output tile (token group, row block) adds them in a fixed order (`split_reduce.py`: one launch, deterministic).
More tokens (DECODE_MAX_T, or WIDE_MAX_T with the wide kernel) and machines without Triton take `dequant_matmul`: a
block of rows dequantized at a time (never the whole weight in float) and one matmul a block; on CUDA the block is
dequantized by one Triton launch (`quant_dequant.py`, bit for bit the PyTorch `dequantize_packed` the CPU runs).

Reference: `quant_gemv_ref.quant_gemv_ref`; tests: tests/test_kernel_quant_gemv.py (CPU under TRITON_INTERPRET=1,
an sm_90 compile, the H200 at the full shape against cuBLAS); launch configs (CFG) are guesses until that test's
sweep or `bench/tune_kernels.py --only quant_gemv` has run on the H200.
"""

from __future__ import annotations

import math

import torch

from stage_worker.kernels.common import l2_prefetch_usable, pdl_usable, sm_count, triton_usable
from stage_worker.kernels.quant_gemv_ref import CHUNK, PackedWeight, dequantize_packed, swiglu_input
from stage_worker.kernels.split_reduce import LOCKS, split_locks

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux: the PyTorch path
    triton = None

DECODE_MAX_T = 16
# With the wide kernel (flag `quant_gemv_wide`) T up to this takes it, past DECODE_MAX_T a program a group of 16 tokens
# (its grid's first dimension). The trade-off: the wide kernel decodes each weight tile once per 16 tokens (the words
# from L2 after the first group, the decode's ALU work again), while `dequant_matmul` writes the weight once in x's
# dtype and cuBLAS reads it back, a cost that barely grows with T. The H200 (h200-20,
# tests/test_kernel_quant_gemv.py::test_prefill_dequant_on_the_gpu, eager ms a call, bench/results/h200-20/call8/):
# wide against dequantize + cuBLAS at 17 / 46 / 128 tokens 0.097 / 0.107 / 0.105 against 0.149 / 0.113 / 0.123 ms
# on o_proj INT6, 0.66 / 0.89 / 1.98 against 2.93 / 3.04 / 2.97 ms on a 248k x 2560 INT8 lm_head (the ratio rising
# with T: 0.23 at 17, 0.67 at 128). So up to 128 tokens.
WIDE_MAX_T = 128
# The kernel flag `quant_dequant` (KernelFlags.quant_dequant) as `dequant_matmul` reads it: set by
# StageModel.set_kernels (`set_dequant_kernel`), process-wide like `pdl`; on until a model says otherwise.
_DEQUANT_KERNEL = True


def set_dequant_kernel(on: bool) -> None:
    """`dequant_matmul` on CUDA: blocks dequantized by the Triton kernel (on) or PyTorch's ops (off)."""
    global _DEQUANT_KERNEL
    _DEQUANT_KERNEL = bool(on)

# Weight elements `dequant_matmul` dequantizes a block on CUDA (the Triton kernel; CPU: quant_gemv_ref.CHUNK, 4M).
# 64M = 128 MiB of bf16 in one reused buffer (never the whole 1.3 GB lm_head in bf16): one block for o_proj (15.7M),
# out_proj, the DeltaNet in-projections and the fused q/k/v, 10 for a 248k x 2560 lm_head. Each block costs ~0.15 ms
# whatever its size in eager prefill (the launches from the host), so fewer is faster: the H200 (h200-20, the same
# test) at 46 tokens on that lm_head 11.7 / 5.35 / 2.67 / 1.46 ms with 8M / 16M / 32M / 64M blocks, at 512 tokens
# 9.45 / 9.53 / 8.71 / 4.18; o_proj 0.23 / 0.12 / 0.11 / 0.12 ms (one block from 16M on).
GPU_CHUNK = 1 << 26
# (BLOCK_N rows, BLOCK_K inputs, warps[, pipeline stages]) by token count: a call takes the entry of the smallest key
# >= T. BLOCK_K is rounded down to a power-of-two number of periods (16 inputs for the INT6 stream, 8 for INT4, 4
# for INT8, 5 for the older INT6 layout). Guesses sized so a thread keeps ~8 (row, period) cells, 24-48 words in
# flight with the prefetch, until the H200 sweep (tests/test_kernel_quant_gemv.py::test_sweep_launch_configs_on_the_gpu,
# bench/tune_kernels.py --only quant_gemv) has run.
CFG = {1: (32, 512, 4), 4: (32, 256, 4), 16: (16, 256, 4)}
# ... and where one shape's winner beats that entry on both cards: (N, K, bits) -> {token count: config}, the same
# smallest-key-above rule, falling back to CFG past the largest key. DeltaNet's out_proj INT6 (2,560 x 4,096, split
# over K) at one token, (64, 512, 8) against (32, 512, 4): 1,359 against 1,155 GB/s on the H200 (h200-30), 1,354
# against 1,104 on the H100 (h100-29; `bench/tune_kernels.py --only quant_gemv --rows 1 --shapes "out_proj int6"`).
# o_proj (2,560 x 6,144) keeps CFG: 1,731 against 1,720 on the H200, 1,558 against 1,645 on the H100 at that config.
CFG_SHAPE: dict[tuple[int, int, int], dict[int, tuple[int, ...]]] = {(2560, 4096, 6): {1: (64, 512, 8)}}
# Words of the next tile loading while one is computed. The INT4 MoE kernel gained 24% at one token from the same
# (bench/results/moe-int4-4).
PREFETCH = True
# Tokens a program's FMA tiles hold; more tokens take more programs over the same rows, side by side in the grid's
# fastest dimension so the repeated words come from L2. At 16 a program the sm_90 compile put the accumulator in
# another layout than the words (18 shared-memory conversions a tile); at 4, none.
TOKENS_PER_PROGRAM = 4
# (row, period) cells a thread holds a tile at most (BLOCK_K is cut to fit): at 32 (INT8 with 512 inputs a tile) the
# sm_90 compile used 253 registers a thread, at 8 128 (INT6).
MAX_CELLS_PER_THREAD = 8
# The wide kernel (`_quant_gemm_kernel`) from this many tokens: at 1 token the FMA kernel beat cuBLAS bf16 (h200-13);
# at 4 the wide kernel beat it at every measured site (h200-16: lm_head INT8 240 against 508 us, out_proj INT4 9.6
# against 19.3; bench/results/h200-16/call4/qg.log), and from 5 the FMA kernel takes 2-4 programs over the same
# words, each decoding them again. 2-3 tokens are unmeasured and stay with the FMA kernel.
WIDE_MIN_T = 4
# (BLOCK_N rows, BLOCK_K inputs, warps[, stages]) of the wide kernel: a guess until the H200 sweep (64 x 128: 64
# values a thread decoded a tile at 4 warps, the [64, 16] tl.dot one tensor-core tile a warp).
CFG_WIDE = (64, 128, 4)
PROGRAMS_PER_SM = 4          # K is split until about this many programs per SM run (small N, e.g. o_proj's 2560)
MIN_SPLIT_K = 512            # ... but no slice shorter than this many inputs
ONE = 0x3F800000             # the bits of 1.0f, a kernel argument so the mask-and-or is one LOP3 (moe_int4._nibble)



def period(bits: int, dense: bool) -> tuple[int, int]:
    """(values, words) of the smallest run of whole words holding whole values: the dense stream repeats every
    lcm(bits, 32) bits (INT6: 16 values in 3 words); 4 and 8 bits, and the older layout (32 // bits values a word,
    the top bits unused: INT6 5 a word), every word."""
    if not dense or 32 % bits == 0:
        return 32 // bits, 1
    g = math.gcd(bits, 32)
    return 32 // g, bits // g


if triton is not None:
    from stage_worker.kernels.common import l2_prefetch_rows, pdl_wait
    from stage_worker.kernels.split_reduce import store_tile

    @triton.jit
    def _words(q_ptr, rows, mask_n, p0, stride_qn, W: tl.constexpr, WP: tl.constexpr, NPER: tl.constexpr):
        """The words of periods p0 .. p0 + NPER of `rows` ([1, BLOCK_N, 1]), one [NPER, BLOCK_N, 1] tensor per word
        of a period (WP of them; the unused ones repeat the first), 0 past the row's W words. Three-dimensional
        from the load on, so the values meet the [NPER, BLOCK_N, T] accumulator in their own layout (a 2-D tile
        broadcast into it cost a shared-memory layout conversion per value: the sm_90 compile showed 16 a tile),
        the periods first: where no dimension is contiguous (INT6's stride of 3 words) Triton spreads a warp's
        threads along the first, and along the periods a warp's loads cover 384 contiguous bytes of a row (along
        the rows, 32 separate sectors). Loads only: `_value` decodes them, so the next tile's loads are issued
        before a tile is computed."""
        return _period_words(q_ptr + rows * stride_qn, mask_n, (p0 + tl.arange(0, NPER))[:, None, None], W, WP)

    @triton.jit
    def _period_words(row_ptr, mask, periods, W: tl.constexpr, WP: tl.constexpr):
        """The WP words of each period of `periods` from the rows at `row_ptr` (any broadcastable shapes; the
        unused words repeat the first), 0 past a row's W words."""
        word = periods * WP
        at = row_ptr + word
        w0 = tl.load(at, mask=mask & (word < W), other=0)
        w1 = w0
        w2 = w0
        if WP > 1:
            w1 = tl.load(at + 1, mask=mask & (word + 1 < W), other=0)
        if WP > 2:
            w2 = tl.load(at + 2, mask=mask & (word + 2 < W), other=0)
        return w0, w1, w2

    @triton.jit
    def _value(w0, w1, w2, one, J: tl.constexpr, BITS: tl.constexpr):
        """Value J of each period as the float 1 + u / 2^BITS, exactly: its bits (at J * BITS of the period) moved
        by a constant shift to the top of the mantissa and given the exponent of 1.0 by one mask-and-or; no
        int-to-float conversion (a quarter-rate instruction). A value that crosses into the next word (INT6: 2 of
        16) takes its high bits from there."""
        MP: tl.constexpr = 23 - BITS
        MASK: tl.constexpr = ((1 << BITS) - 1) << MP
        C: tl.constexpr = J * BITS // 32
        OFF: tl.constexpr = J * BITS % 32
        if C == 0:
            w = w0
            nxt = w1
        elif C == 1:
            w = w1
            nxt = w2
        else:
            w = w2
            nxt = w2
        if OFF + BITS <= 32:
            # arithmetic shifts are fine: the sign fill lands above bit 22, which MASK drops
            if OFF <= MP:
                v = w << (MP - OFF)
            else:
                v = w >> (OFF - MP)
        else:
            L: tl.constexpr = 32 - OFF                       # bits in this word; the rest start the next one
            v = ((w >> (OFF - MP)) & (((1 << L) - 1) << MP)) | (nxt << (MP + L))
        return ((v & MASK) | one).to(tl.float32, bitcast=True)

    @triton.jit
    def _x(x_ptr, w_ptr, t, k, mask, stride_xt, stride_wt, K: tl.constexpr, SWIGLU: tl.constexpr):
        """x[t, k] in fp32 (0 where masked); with SWIGLU, x is [T, 2K] gate then up, and the input is
        silu(gate) * up * w[t], each product rounded to x's dtype as `quant_gemv_ref.swiglu_input` does."""
        offs = t * stride_xt + k
        if SWIGLU:
            dt: tl.constexpr = x_ptr.dtype.element_ty
            g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + t * stride_wt + 0 * k, mask=mask, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            return ((a * u).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _l2_prefetch_slice(q_ptr, s_ptr, N, k_begin, stride_qn, stride_sn, K: tl.constexpr, W: tl.constexpr,
                           P: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr, SCALE: tl.constexpr,
                           K_SLICE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Kernel flag `l2_prefetch` (constexpr L2PF, before `pdl_wait`): the L2 prefetch of everything a program
        of either kernel streams: its rows' words of its K slice (words k_begin / P * WP on, at most the row's W:
        the rows one contiguous range when there is one K slice and the rows are packed, `common.l2_prefetch_rows`)
        and, with group scales (SCALE 1, 2), their scales of the slice (the row scales of SCALE 0 are a few bytes a
        row: not worth an instruction). Rows stop at N and columns at the row's end: nothing past the tensors.
        Only the first token group's program asks (the FMA kernel's other groups read the same words)."""
        row0 = tl.program_id(1) * BLOCK_N
        n_rows = tl.where(tl.program_id(0) == 0, tl.minimum(N - row0, BLOCK_N), 0)
        w_lo = k_begin // P * WP
        l2_prefetch_rows(q_ptr, row0, n_rows, stride_qn, w_lo, tl.minimum(W - w_lo, K_SLICE // P * WP), BLOCK_N)
        if SCALE != 0:
            G: tl.constexpr = (K + GROUP - 1) // GROUP
            g_lo = k_begin // GROUP
            g_hi = tl.minimum((k_begin + K_SLICE + GROUP - 1) // GROUP, G)
            l2_prefetch_rows(s_ptr, row0, n_rows, stride_sn, g_lo, g_hi - g_lo, BLOCK_N)

    @triton.jit
    def _quant_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, w_ptr, N, T, stride_xt, stride_qn,
                           stride_sn, stride_ot, stride_wt, one, K: tl.constexpr, W: tl.constexpr,
                           BITS: tl.constexpr, P: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr,
                           SCALE: tl.constexpr, K_SLICE: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_N: tl.constexpr, NPER: tl.constexpr, TP: tl.constexpr, DOT: tl.constexpr,
                           PRECISION: tl.constexpr, SWIGLU: tl.constexpr, PREFETCH: tl.constexpr,
                           PDL: tl.constexpr = False, L2PF: tl.constexpr = False):
        """out[t, rows] = sum_k W[rows, k] x[t, k] over tiles of NPER periods (P values in WP words each) of
        BLOCK_N rows: see the module docstring. SCALE 0: one scale a row, at the end; 1: one a period (the group
        a multiple of P); 2: one a value. FMA path: acc [TP, BLOCK_N, NPER] (TP tokens, the next power of two
        >= T, the small inner dimension), reduced over the periods once at the end. DOT: acc [BLOCK_N, 16], one
        tl.dot a value position j of the period (K order within a tile does not matter to a sum, so x is taken at
        stride P to match). With SPLITS K slices each program stores fp32 partials and the last of a row block
        adds them in order (`split_reduce.last_of`). PDL: the first tile's words (PREFETCH) load before
        `common.pdl_wait`, everything else after it; L2PF (with PDL) first the program's whole words and group
        scales into L2 (`_l2_prefetch_slice`)."""
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        rows64 = rows.to(tl.int64)
        r3 = rows64[None, :, None]
        m3 = mask_n[None, :, None]
        OFFSET: tl.constexpr = 1 << (BITS - 1)
        BLOCK_K: tl.constexpr = NPER * P
        ITERS: tl.constexpr = K_SLICE // BLOCK_K
        DT: tl.constexpr = x_ptr.dtype.element_ty
        k_begin = tl.program_id(2) * K_SLICE
        offs_t = tl.program_id(0) * TP + tl.arange(0, TP)
        offs_p = tl.arange(0, NPER)
        if DOT:
            acc = tl.zeros([BLOCK_N, TP], tl.float32)
            xs = tl.zeros([TP], tl.float32)
        else:
            acc = tl.zeros([NPER, BLOCK_N, TP], tl.float32)
            xs = tl.zeros([NPER, 1, TP], tl.float32)
        if L2PF:
            _l2_prefetch_slice(q_ptr, s_ptr, N, k_begin, stride_qn, stride_sn, K, W, P, WP, GROUP, SCALE, K_SLICE,
                               BLOCK_N)
        if PREFETCH:
            w0, w1, w2 = _words(q_ptr, r3, m3, k_begin // P, stride_qn, W, WP, NPER)
        pdl_wait(PDL)
        for i in range(ITERS):
            k0 = k_begin + i * BLOCK_K
            if PREFETCH:
                n0, n1, n2 = _words(q_ptr, r3, m3 & (i + 1 < ITERS), (k0 + BLOCK_K) // P, stride_qn, W, WP, NPER)
            else:
                w0, w1, w2 = _words(q_ptr, r3, m3, k0 // P, stride_qn, W, WP, NPER)
            kp = k0 + offs_p * P                                              # each period's first input
            if DOT:
                if SCALE == 1:
                    s = tl.load(s_ptr + rows64[:, None] * stride_sn + (kp // GROUP)[None, :],
                                mask=mask_n[:, None] & (kp < K)[None, :], other=0.0).to(tl.float32)
                for j in tl.static_range(P):
                    k = kp + j
                    xj = _x(x_ptr, w_ptr, offs_t[None, :], k[:, None], (k < K)[:, None] & (offs_t < T)[None, :],
                            stride_xt, stride_wt, K, SWIGLU)                  # [NPER, TP]
                    f = tl.trans(tl.reshape(_value(w0, w1, w2, one, j, BITS), [NPER, BLOCK_N]))
                    u = f * (1 << BITS) - (1 << BITS)                         # exact: 0 .. 2^BITS - 1
                    if SCALE == 0:
                        xs += tl.sum(xj, axis=0)
                        wj = u
                    else:
                        if SCALE == 2:
                            s = tl.load(s_ptr + rows64[:, None] * stride_sn + (k // GROUP)[None, :],
                                        mask=mask_n[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
                        wj = (u - OFFSET) * s
                    acc += tl.dot(wj.to(DT), xj.to(DT), input_precision=PRECISION)
            else:
                kp3 = kp[:, None, None]
                if SCALE == 1:
                    s = tl.load(s_ptr + r3 * stride_sn + kp3 // GROUP, mask=m3 & (kp3 < K), other=0.0)
                    s = s.to(tl.float32)
                    d = tl.zeros([NPER, BLOCK_N, TP], tl.float32)
                    xt = tl.zeros([NPER, 1, TP], tl.float32)
                for j in tl.static_range(P):
                    k = kp3 + j
                    xj = _x(x_ptr, w_ptr, offs_t[None, None, :], k, (offs_t < T)[None, None, :] & (k < K),
                            stride_xt, stride_wt, K, SWIGLU)                  # [NPER, 1, TP]
                    f = _value(w0, w1, w2, one, j, BITS)                      # 1 + u / 2^BITS, [NPER, BLOCK_N, 1]
                    if SCALE == 0:
                        acc += f * xj
                        xs += xj
                    elif SCALE == 1:
                        d += f * xj
                        xt += xj
                    else:
                        sv = tl.load(s_ptr + r3 * stride_sn + k // GROUP, mask=m3 & (k < K), other=0.0)
                        acc += (f - 1.5) * sv.to(tl.float32) * xj
                if SCALE == 1:
                    # sum (u - 2^(B-1)) x = 2^B sum (f - 1.5) x: the offset once a period, the 2^B at the end
                    acc += s * (d - 1.5 * xt)
            if PREFETCH:
                w0 = n0
                w1 = n1
                w2 = n2
        if DOT:
            res = acc
            if SCALE == 0:
                res = res - OFFSET * xs[None, :]
        else:
            res = tl.sum(acc, axis=0)                                         # [BLOCK_N, TP]
            if SCALE == 0:
                res = res - 1.5 * tl.sum(xs, axis=0)
            res = res * (1 << BITS)
        if SCALE == 0:
            res = res * tl.load(s_ptr + rows64 * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        store_tile(res, out_ptr, part_ptr, lock_ptr, rows64, mask_n, offs_t, N, T, stride_ot, SPLITS)

    @triton.jit
    def _wide_values(w0, w1, w2, one, s1, s2, sv_ptr, kp, mask_s, J: tl.constexpr, STEP: tl.constexpr,
                     PP: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     SCALE: tl.constexpr, K: tl.constexpr):
        """The dequantized weights (u - 2^(BITS-1)) * s of values J, J + STEP, ... of each period ([BLOCK_N, NPER]
        words), joined so that the tile reads [BLOCK_N, NPER, PP // STEP] in input order: each join adds a last
        dimension for the lowest bit left of j, so the whole tree, flattened, is value j of period p at p * PP + j.
        Positions j >= P (the older INT6 layout's period of 5, padded to 8) are 0. The scale is one FMA on the
        decoded float f = 1 + u / 2^BITS: f * 2^B s - (2^B + 2^(B-1)) s, exact before the one rounding (s with
        <= 22 significant bits), as the reference's q * s; a scale a value (SCALE 2) is loaded for its input."""
        if STEP == PP:
            if J < P:
                f = _value(w0, w1, w2, one, J, BITS)
                if SCALE == 2:
                    # masked per value: the last period's values past K would read the scale column after the
                    # row's last (past the tensor's end on the last row: h200-14's illegal address)
                    sj = tl.load(sv_ptr + (kp + J) // GROUP, mask=mask_s & (kp + J < K), other=0.0).to(tl.float32)
                    v = (f * (1 << BITS) - ((1 << BITS) + (1 << (BITS - 1)))) * sj
                else:
                    v = tl.fma(f, s1, -s2)
            else:
                v = tl.zeros(w0.shape, tl.float32)
        else:
            v = tl.join(_wide_values(w0, w1, w2, one, s1, s2, sv_ptr, kp, mask_s, J, 2 * STEP, PP, P, BITS, GROUP,
                                     SCALE, K),
                        _wide_values(w0, w1, w2, one, s1, s2, sv_ptr, kp, mask_s, J + STEP, 2 * STEP, PP, P, BITS,
                                     GROUP, SCALE, K))
        return v

    @triton.jit
    def _quant_gemm_kernel(x_ptr, q_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, w_ptr, N, T, stride_xt, stride_qn,
                           stride_sn, stride_ot, stride_wt, one, K: tl.constexpr, W: tl.constexpr,
                           BITS: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, WP: tl.constexpr,
                           GROUP: tl.constexpr, SCALE: tl.constexpr, K_SLICE: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_N: tl.constexpr, NPER: tl.constexpr, TP: tl.constexpr, PRECISION: tl.constexpr,
                           SWIGLU: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
                           L2PF: tl.constexpr = False):
        """The wide path (WIDE_MIN_T to WIDE_MAX_T tokens): out[t, rows] for one group of TP = 16 tokens (group g =
        program_id(0): tokens 16 g .. 16 g + 15, those past T masked to 0) in one program a (token group, row block, K
        slice). Each tile of NPER periods of BLOCK_N rows is decoded once, in registers, to x's dtype with its scales
        applied ([BLOCK_N, NPER * PP], `_wide_values`), and multiplied by the [NPER * PP, TP] inputs in one tl.dot, fp32
        accumulate: the decode is paid once for 16 tokens, the 16 multiply-adds a value go to the tensor cores. Input
        position p * PP + j of a tile is input k0 + p * P + j (natural order where P is a power of two; the older INT6
        layout's 3 padding positions a period take x = 0). Words load [BLOCK_N, NPER] (rows first: the tile's own
        shape), the next tile's issued before one is decoded (PREFETCH); split K as the FMA kernel
        (`split_reduce.store_tile`). PDL: the row scales (SCALE 0) and the first tile's words load before
        `common.pdl_wait`, everything else after it; L2PF (with PDL) first the program's whole words and group scales
        into L2 (`_l2_prefetch_slice`)."""
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        rows64 = rows.to(tl.int64)
        r2 = rows64[None, :]
        m2 = mask_n[None, :]
        OFFSET: tl.constexpr = 1 << (BITS - 1)
        BLOCK_K: tl.constexpr = NPER * P
        ITERS: tl.constexpr = K_SLICE // BLOCK_K
        DT: tl.constexpr = x_ptr.dtype.element_ty
        k_begin = tl.program_id(2) * K_SLICE
        offs_t = tl.program_id(0) * TP + tl.arange(0, TP)                    # this program's token group
        offs_p = tl.arange(0, NPER)
        kk = tl.arange(0, NPER * PP)
        k_in = (kk // PP) * P + kk % PP                                       # a tile position's input, from k0
        pad = kk % PP < P
        base = q_ptr + r2 * stride_qn
        acc = tl.zeros([BLOCK_N, TP], tl.float32)
        if L2PF:
            _l2_prefetch_slice(q_ptr, s_ptr, N, k_begin, stride_qn, stride_sn, K, W, P, WP, GROUP, SCALE, K_SLICE,
                               BLOCK_N)
        if SCALE == 0:
            s = tl.load(s_ptr + r2 * stride_sn, mask=m2, other=0.0).to(tl.float32)          # [1, BLOCK_N]
            s1 = s * (1 << BITS)
            s2 = s * ((1 << BITS) + OFFSET)
        if PREFETCH:
            w0, w1, w2 = _period_words(base, m2, k_begin // P + offs_p[:, None], W, WP)
        pdl_wait(PDL)
        for i in range(ITERS):
            k0 = k_begin + i * BLOCK_K
            if PREFETCH:
                nxt = (k0 + BLOCK_K) // P + offs_p[:, None]
                n0, n1, n2 = _period_words(base, m2 & (i + 1 < ITERS), nxt, W, WP)
            else:
                w0, w1, w2 = _period_words(base, m2, k0 // P + offs_p[:, None], W, WP)
            kp = (k0 + offs_p * P)[:, None]                                  # each period's first input
            mask_s = m2 & (kp < K)
            if SCALE == 1:
                s = tl.load(s_ptr + r2 * stride_sn + kp // GROUP, mask=mask_s, other=0.0).to(tl.float32)
                s1 = s * (1 << BITS)
                s2 = s * ((1 << BITS) + OFFSET)
            elif SCALE == 2:
                s1 = 0.0
                s2 = 0.0
            v = _wide_values(w0, w1, w2, one, s1, s2, s_ptr + r2 * stride_sn, kp, mask_s, 0, 1, PP, P, BITS, GROUP,
                             SCALE, K)                                          # [NPER, BLOCK_N, 2, ..., 2]
            v = tl.permute(tl.reshape(v, [NPER, BLOCK_N, PP]), (1, 0, 2))
            wt = tl.reshape(v, [BLOCK_N, NPER * PP])
            k = k0 + k_in
            xk = _x(x_ptr, w_ptr, offs_t[None, :], k[:, None], (pad & (k < K))[:, None] & (offs_t < T)[None, :],
                    stride_xt, stride_wt, K, SWIGLU)                          # [NPER * PP, TP]
            acc = tl.dot(wt.to(DT), xk.to(DT), acc, input_precision=PRECISION)
            if PREFETCH:
                w0 = n0
                w1 = n1
                w2 = n2
        store_tile(acc, out_ptr, part_ptr, lock_ptr, rows64, mask_n, offs_t, N, T, stride_ot, SPLITS)


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _token_entry(table: dict[int, tuple[int, ...]] | None, T: int) -> tuple[int, ...] | None:
    """The entry of the smallest key >= T; CFG (the last resort) its largest key's past them, a shape's table none."""
    if not table:
        return None
    key = min((k for k in table if k >= T), default=None)
    if key is None:
        return table[max(table)] if table is CFG else None
    return table[key]


def launch_config(T: int, N: int, K: int, group: int, device: torch.device, cfg: tuple[int, ...] | None = None,
                  fma: bool = True, bits: int = 6, dense: bool = True, wide: bool = False) -> dict:
    """Tile sizes, scale mode and K slices for a call (`cfg` overrides the CFG entry; `fma` False: 2-16 tokens take
    the tl.dot variant, with at least 16 rows and 16 periods a tile; `wide`: the wide kernel (`CFG_WIDE`), all the
    tokens in one program (TP 16), at least 16 rows and 16 tile positions (NPER * PP, PP the period padded to a
    power of two))."""
    dot = T > 1 and not fma and not wide
    bn, bk, warps, *rest = cfg or (CFG_WIDE if wide else _token_entry(CFG_SHAPE.get((N, K, bits)), T)
                                   or _token_entry(CFG, T))
    p, wp = period(bits, dense)
    pp = triton.next_power_of_2(p)
    if wide:
        nper = max(min(_floor_pow2(bk // p), triton.next_power_of_2(-(-K // p))), 16 // pp)
        bn = max(bn, 16)
    else:
        nper = min(_floor_pow2(bk // p), triton.next_power_of_2(-(-K // p)),   # tiny test widths: one tile
                   _floor_pow2(MAX_CELLS_PER_THREAD * 32 * warps // bn))
    if dot:
        bn, nper = max(bn, 16), max(nper, 16)
    scale = 0 if group >= K else 1 if group % p == 0 else 2
    tp = 16 if dot or wide else min(triton.next_power_of_2(T), TOKENS_PER_PROGRAM)
    tiles = triton.cdiv(N, bn) * triton.cdiv(T, tp)
    sms = sm_count(device, cpu=4)
    bk = nper * p
    splits = max(1, min(PROGRAMS_PER_SM * sms // tiles, K // MIN_SPLIT_K))
    k_slice = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    return dict(BLOCK_N=bn, NPER=nper, BLOCK_K=bk, P=p, PP=pp, WP=wp, warps=warps, stages=rest[0] if rest else 1,
                SCALE=scale, K_SLICE=k_slice, splits=triton.cdiv(K, k_slice), DOT=dot, TP=tp, WIDE=wide)


def quant_gemv(x: torch.Tensor, pw: PackedWeight, cfg: tuple[int, ...] | None = None,
               swiglu: torch.Tensor | None = None, fma: bool = True, wide: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T [T, N] in x.dtype, W the packed weight; = quant_gemv_ref. On a device Triton runs
    (CUDA, or the interpreter on CPU tensors) T <= DECODE_MAX_T takes a GEMV kernel, and with `wide` so does T up to
    WIDE_MAX_T (the wide kernel, a program a group of 16 tokens); anything else `dequant_matmul`. `swiglu` [T]
    (any stride): x is [T, 2K] (gate, up) and the input is `quant_gemv_ref.swiglu_input(x, swiglu)`, computed as
    the kernel loads it (a shared expert's down projection with its activation and gate: no launch for them; past
    the kernels' token counts `swiglu_input`, then `dequant_matmul`). `fma` (kernel flag `quant_gemv_fma`): 2-16
    tokens as the small inner dimension of the FMA tiles; off, one tl.dot per value position of a period (the A/B
    until the H200 says which wins at 8-16 tokens). `wide` (kernel flag `quant_gemv_wide`): WIDE_MIN_T to
    WIDE_MAX_T tokens take the wide kernel (each tile decoded once for up to 16 tokens, one tl.dot a tile) whatever
    `fma` says; off, the above. `out` ([T, N] in x.dtype, rows contiguous, any row stride: e.g. columns of a wider
    tensor): written and returned (the kernels store into it directly; the other paths copy)."""
    limit = WIDE_MAX_T if wide else DECODE_MAX_T
    T, N = x.shape[0], pw.out_features
    if out is not None and (out.shape != (T, N) or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} (stride {out.stride()}): [{T}, {N}] {x.dtype} "
                         f"with contiguous rows")
    placed = (lambda y: y) if out is None else out.copy_
    if swiglu is not None:
        if x.shape[1] != 2 * pw.in_features or swiglu.shape != (x.shape[0],):
            raise ValueError(f"swiglu: x {tuple(x.shape)} must be [T, 2 x {pw.in_features}], weights [T]")
        if x.shape[0] > limit or not triton_usable(x) or pw.bits > 8:
            return placed(dequant_matmul(swiglu_input(x, swiglu), pw))
    K = x.shape[1] // (2 if swiglu is not None else 1)
    if K != pw.in_features:
        raise ValueError(f"x has {K} inputs, the packed weight {pw.in_features}")
    if T > limit or not triton_usable(x) or pw.bits > 8:
        return placed(dequant_matmul(x, pw))
    out = torch.empty(T, N, dtype=x.dtype, device=x.device) if out is None else out
    if T == 0 or N == 0:
        return out
    x = x.contiguous()
    pdl = pdl_usable(x)
    l2pf = pdl and l2_prefetch_usable(x)
    wide = wide and T >= WIDE_MIN_T
    c = launch_config(T, N, K, pw.group, x.device, cfg, fma, pw.bits, pw.dense, wide)
    blocks, splits, tp = triton.cdiv(N, c["BLOCK_N"]), c["splits"], c["TP"]
    groups = triton.cdiv(T, tp)
    if groups * blocks > LOCKS and splits > 1:
        raise ValueError(f"{groups * blocks} output tiles: more than the split counters ({LOCKS})")
    part = torch.empty(splits, T, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if wide:
        _quant_gemm_kernel[(groups, blocks, splits)](
            x, pw.words, pw.scales, out, part, split_locks(x.device) if splits > 1 else pw.words,
            x if swiglu is None else swiglu, N, T, x.stride(0), pw.words.stride(0), pw.scales.stride(0),
            out.stride(0), 0 if swiglu is None else swiglu.stride(0), ONE, K=K, W=pw.words.shape[1], BITS=pw.bits,
            P=c["P"], PP=c["PP"], WP=c["WP"], GROUP=pw.group, SCALE=c["SCALE"], K_SLICE=c["K_SLICE"], SPLITS=splits,
            BLOCK_N=c["BLOCK_N"], NPER=c["NPER"], TP=tp, PRECISION=precision, SWIGLU=swiglu is not None,
            PREFETCH=PREFETCH, PDL=pdl, L2PF=l2pf, num_warps=c["warps"], num_stages=c["stages"], launch_pdl=pdl)
        return out
    _quant_gemv_kernel[(groups, blocks, splits)](
        x, pw.words, pw.scales, out, part, split_locks(x.device) if splits > 1 else pw.words,
        x if swiglu is None else swiglu, N, T, x.stride(0), pw.words.stride(0), pw.scales.stride(0), out.stride(0),
        0 if swiglu is None else swiglu.stride(0), ONE, K=K, W=pw.words.shape[1], BITS=pw.bits, P=c["P"],
        WP=c["WP"], GROUP=pw.group, SCALE=c["SCALE"], K_SLICE=c["K_SLICE"], SPLITS=splits, BLOCK_N=c["BLOCK_N"],
        NPER=c["NPER"], TP=tp, DOT=c["DOT"],
        PRECISION=precision, SWIGLU=swiglu is not None, PREFETCH=PREFETCH, PDL=pdl, L2PF=l2pf,
        num_warps=c["warps"], num_stages=c["stages"], launch_pdl=pdl)
    return out


def dequant_matmul(x: torch.Tensor, pw: PackedWeight, kernel: bool | None = None) -> torch.Tensor:
    """Prefill, large batches and the CPU: the weight dequantized to x.dtype a block of rows at a time (never the
    whole weight in float), each block one matmul, the weights exactly the dequantize-at-load path's. `kernel`: the
    block dequantized by one Triton launch (`quant_dequant.dequantize_into`, into one buffer reused by every block)
    instead of PyTorch's chain of whole-tensor ops; default on CUDA with the kernel flag `quant_dequant` (blocks of
    GPU_CHUNK elements), tests turn it on under the interpreter (blocks of CHUNK, as the CPU's)."""
    from stage_worker.kernels import quant_dequant

    K, N = x.shape[1], pw.out_features
    kernel = (x.is_cuda and _DEQUANT_KERNEL if kernel is None else kernel) and triton_usable(x) and \
        quant_dequant.usable(pw)
    step = max(1, (GPU_CHUNK if x.is_cuda and kernel else CHUNK) // max(K, 1))
    return quant_dequant.blockwise_linear(
        x, N, step, lambda r0, r1, buf: quant_dequant.dequantize_into(pw, buf, r0) if kernel
        else dequantize_packed(pw, x.dtype, r0, r1), reuse=kernel)
