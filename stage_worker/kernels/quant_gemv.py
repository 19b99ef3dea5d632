"""W4/W6/W8-A16 GEMVs over dense Linear weights kept as compressed-tensors packs them (issue 17, item 2): decode reads
the int32 words and their scales and dequantizes in registers, so a step reads 6/16 (INT6) or 8/16 (INT8) of the
bf16 bytes of attention's o_proj, DeltaNet's out_proj, the shared expert beside INT4 experts and lm_head
(`stage_worker/model/quant_linear.py` decides which modules).

One launch, grid (cdiv(N, BLOCK_N), splits): a program owns BLOCK_N output rows and one slice of the inputs, and
walks it BLOCK_K columns at a time:
* the words of the tile: where values never cross a word (4 and 8 bits; also the older layout's words at those
  widths, which place bits identically) one [BLOCK_N, BLOCK_K / (32 / bits)] load and a broadcast shift
  (value j of a word at bit j * bits), reshaped to input order; otherwise (6 bits, dense or the older 5 a word) a
  gather per value of its word (and, for the dense stream's values that straddle two words, the next word, loaded
  only where needed), shifted and masked as unsigned;
* the offset 2^(bits-1) is not subtracted per value: sum_k (u_k - o) x_k = sum_k u_k x_k - o sum_k x_k, the second
  term once a tile;
* scales: one a row (per channel) applied to the accumulator at the end; one a tile (the group a multiple of
  BLOCK_K, as group 128 with BLOCK_K <= 128) applied to the tile's partial sum; otherwise (small or odd groups) one
  gathered per value;
* FMAs in fp32 and a reduction per tile and token (2-16 tokens share the tile's unpack); with the kernel flag
  `quant_gemv_fma` off, 2-16 tokens take `tl.dot` of the tile (the unsigned values are exact in bf16 / fp16) with
  x^T [BLOCK_K, 16] on the tensor cores instead: 10-45x slower on the H200 (bench/results/quant-decode-1).
With several K slices (small N: few row blocks for the SMs) each slice writes fp32 partial sums and the last
program of a row block adds them in a fixed order (`split_reduce.py`: one launch, deterministic; a separate sum
and cast were two more launches a call). Prefill (more than DECODE_MAX_T tokens) and machines without Triton take
`dequant_matmul`: BLOCK of rows dequantized at a time (never the whole weight in float) and a matmul.

Reference: `quant_gemv_ref.quant_gemv_ref`; tests: tests/test_kernel_quant_gemv.py (CPU under TRITON_INTERPRET=1,
the H200 at the full shape, with timings); launch configs are guesses until that test's sweep has run on the H200.
"""

from __future__ import annotations

import functools

import torch

from stage_worker.kernels.quant_gemv_ref import CHUNK, PackedWeight, dequantize_packed, swiglu_input
from stage_worker.kernels.split_reduce import LOCKS, split_locks

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux: the PyTorch path
    triton = None

DECODE_MAX_T = 16
# (BLOCK_N, BLOCK_K, warps[, pipeline stages]) for one token (FMA path) and for 2-16 tokens (tl.dot path). Guesses
# until the H200 sweep of tests/test_kernel_quant_gemv.py::test_sweep_launch_configs_on_the_gpu (offline sm_90
# compiles: the 6-bit dot path holds 76 KB of shared memory with Triton's 3 stages).
CFG = {1: (16, 128, 4), 16: (32, 128, 4)}
# Words of the next tile loading while one is computed (FMA paths). The one-token path read 0.2 TB/s (INT6) on the
# H200 with one tile in flight a program (bench/results/quant-decode-1); the INT4 MoE kernel gained 24% from the same
# at one token (bench/results/moe-int4-4). Not yet timed here.
PREFETCH = True
PROGRAMS_PER_SM = 4          # K is split until about this many programs per SM run (small N, e.g. o_proj's 2560)
MIN_SPLIT_K = 512            # ... but no slice shorter than this many inputs

_INTERPRET = bool(triton is not None and triton.knobs.runtime.interpret)


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs CUDA tensors, or CPU tensors when the interpreter was on at import time (tests)."""
    return triton is not None and (x.is_cuda or (_INTERPRET and x.device.type == "cpu"))


if triton is not None:
    from stage_worker.kernels.split_reduce import last_of

    @triton.jit
    def _tile_words(q_ptr, rows, mask_n, k0, stride_qn, W: tl.constexpr, BITS: tl.constexpr,
                    DENSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The words input columns k0 .. k0 + BLOCK_K of `rows` are in, loaded (`_tile_unpack` makes the values,
        so a tile's loads can be issued before the previous tile is computed): for 4 and 8 bits the [BLOCK_N,
        BLOCK_K / (32 / bits)] words (twice: there is no second word); otherwise each value's word and, in the
        dense stream, the next word where the value spills into it (0 elsewhere). Past the row's words: 0."""
        PER: tl.constexpr = 32 // BITS
        base = q_ptr + rows[:, None] * stride_qn
        if 32 % BITS == 0:                      # whole values a word (4, 8 bits): one load
            WB: tl.constexpr = BLOCK_K // PER
            offs_w = k0 // PER + tl.arange(0, WB)
            q = tl.load(base + offs_w[None, :], mask=mask_n[:, None] & (offs_w < W)[None, :], other=0)
            return q, q
        else:
            word, off = _value_bits(k0, BITS, DENSE, BLOCK_K)
            lo = tl.load(base + word[None, :], mask=mask_n[:, None] & (word < W)[None, :], other=0)
            if DENSE:
                spill = (off + BITS > 32) & (word + 1 < W)
                hi = tl.load(base + (word + 1)[None, :], mask=mask_n[:, None] & spill[None, :], other=0)
            else:
                hi = lo
            return lo, hi

    @triton.jit
    def _value_bits(k0, BITS: tl.constexpr, DENSE: tl.constexpr, BLOCK_K: tl.constexpr):
        """(word, bit offset) of input columns k0 .. k0 + BLOCK_K (values that may not fill a word: 6 bits)."""
        k = k0 + tl.arange(0, BLOCK_K)
        if DENSE:                               # bit stream: value k at bit k * BITS, maybe across two words
            bit = k * BITS
            return bit // 32, bit % 32
        else:                                   # older layout: 32 // BITS values a word, the top bits unused
            PER: tl.constexpr = 32 // BITS
            return k // PER, (k % PER) * BITS

    @triton.jit
    def _tile_unpack(lo, hi, k0, BITS: tl.constexpr, DENSE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """The stored (unsigned) values u [BLOCK_N, BLOCK_K] int32 from `_tile_words`' words."""
        MASK: tl.constexpr = (1 << BITS) - 1
        PER: tl.constexpr = 32 // BITS
        if 32 % BITS == 0:                      # a broadcast shift
            shifts = tl.arange(0, PER) * BITS
            u = tl.reshape((lo[:, :, None] >> shifts[None, None, :]) & MASK, [BLOCK_N, BLOCK_K])
        else:
            word, off = _value_bits(k0, BITS, DENSE, BLOCK_K)
            u = lo.to(tl.uint32, bitcast=True) >> off[None, :]
            if DENSE:
                # (32 - off) & 31: no shift by 32 where off is 0 (hi is 0 wherever nothing spills)
                u = u | (hi.to(tl.uint32, bitcast=True) << ((32 - off) & 31)[None, :])
            u = (u & MASK).to(tl.int32, bitcast=True)
        return u

    @triton.jit
    def _x_tile(x_ptr, w_ptr, offs, mask, stride_wt, t, K: tl.constexpr, SWIGLU: tl.constexpr):
        """x at `offs` (t * stride_xt + k); with SWIGLU, x is [T, 2K] gate then up, and the input is
        silu(gate) * up * w[t], each product rounded to x's dtype as `quant_gemv_ref.swiglu_input` does."""
        if SWIGLU:
            dt: tl.constexpr = x_ptr.dtype.element_ty
            g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + t * stride_wt + 0 * offs, mask=mask, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            return ((a * u).to(dt).to(tl.float32) * w).to(dt)
        return tl.load(x_ptr + offs, mask=mask, other=0.0)

    @triton.jit
    def _quant_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, w_ptr, N, T, stride_xt, stride_qn,
                           stride_sn, stride_ot, stride_wt, K: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr,
                           DENSE: tl.constexpr, GROUP: tl.constexpr, SCALE: tl.constexpr, K_SLICE: tl.constexpr,
                           SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TP: tl.constexpr,
                           DOT: tl.constexpr, PRECISION: tl.constexpr, SWIGLU: tl.constexpr,
                           PREFETCH: tl.constexpr):
        """out[t, rows] = sum_k W[rows, k] x[t, k] (SCALE 0: one scale a row, 1: one a tile, 2: one gathered per
        value; see the module docstring). 2-16 tokens: FMAs per token over each unpacked tile (TP the next power
        of two, tokens past T masked), or with DOT tl.dot over a tile of TP = 16 (T a run-time value). With SPLITS K slices a program sums its slice into
        part[slice, t, rows] (fp32) and the last of a row block's programs adds the slices in order and writes out
        (`split_reduce.last_of`): one launch, deterministic. With PREFETCH the next tile's words are loading while
        one is computed."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rows < N
        rows64 = rows.to(tl.int64)
        OFFSET: tl.constexpr = 1 << (BITS - 1)
        k_begin = tl.program_id(1) * K_SLICE
        offs_t = tl.arange(0, TP)
        mask_t = offs_t < T
        if DOT or TP > 1:
            acc = tl.zeros([BLOCK_N, TP], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
        ITERS: tl.constexpr = K_SLICE // BLOCK_K
        if PREFETCH:
            lo, hi = _tile_words(q_ptr, rows64, mask_n, k_begin, stride_qn, W, BITS, DENSE, BLOCK_N, BLOCK_K)
        for i in range(ITERS):
            k0 = k_begin + i * BLOCK_K
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            if PREFETCH:
                lo_n, hi_n = _tile_words(q_ptr, rows64, mask_n & (i + 1 < ITERS), k0 + BLOCK_K, stride_qn, W, BITS,
                                         DENSE, BLOCK_N, BLOCK_K)
                u = _tile_unpack(lo, hi, k0, BITS, DENSE, BLOCK_N, BLOCK_K)
                lo = lo_n
                hi = hi_n
            else:
                lo, hi = _tile_words(q_ptr, rows64, mask_n, k0, stride_qn, W, BITS, DENSE, BLOCK_N, BLOCK_K)
                u = _tile_unpack(lo, hi, k0, BITS, DENSE, BLOCK_N, BLOCK_K)
            if SCALE == 1:
                s = tl.load(s_ptr + rows64 * stride_sn + k0 // GROUP, mask=mask_n, other=0.0).to(tl.float32)
            if SCALE == 2:
                s = tl.load(s_ptr + rows64[:, None] * stride_sn + (offs_k // GROUP)[None, :],
                            mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            if DOT:
                xt = _x_tile(x_ptr, w_ptr, offs_t[None, :] * stride_xt + offs_k[:, None],
                             mask_k[:, None] & mask_t[None, :], stride_wt, offs_t[None, :], K, SWIGLU)  # [BLOCK_K, TP]
                if SCALE == 2:
                    w = ((u - OFFSET).to(tl.float32) * s).to(xt.dtype)
                    acc += tl.dot(w, xt, input_precision=PRECISION)
                else:
                    # (through fp32: exact, and the interpreter's int -> bf16 cast is wrong)
                    part = tl.dot(u.to(tl.float32).to(xt.dtype), xt, input_precision=PRECISION)
                    part -= OFFSET * tl.sum(xt.to(tl.float32), axis=0)[None, :]
                    if SCALE == 1:
                        part = part * s[:, None]
                    acc += part
            elif TP > 1:
                # FMAs for each of 2-16 tokens over one unpacked tile (kernel flag quant_gemv_fma): the unpack,
                # the costly part, is shared; tl.dot's staging at these shapes cost 10x (H200,
                # bench/results/quant-decode-1)
                if SCALE == 2:
                    wf = (u - OFFSET).to(tl.float32) * s
                else:
                    wf = u.to(tl.float32)
                for tt in tl.static_range(TP):
                    xk = _x_tile(x_ptr, w_ptr, tt * stride_xt + offs_k, mask_k & (tt < T), stride_wt, tt, K,
                                 SWIGLU).to(tl.float32)
                    part = tl.sum(wf * xk[None, :], axis=1)
                    if SCALE != 2:
                        part -= OFFSET * tl.sum(xk, axis=0)
                    if SCALE == 1:
                        part = part * s
                    acc += tl.where((offs_t == tt)[None, :], part[:, None], 0.0)
            else:
                xk = _x_tile(x_ptr, w_ptr, offs_k, mask_k, stride_wt, 0, K, SWIGLU).to(tl.float32)
                if SCALE == 2:
                    acc += tl.sum((u - OFFSET).to(tl.float32) * s * xk[None, :], axis=1)
                else:
                    part = tl.sum(u.to(tl.float32) * xk[None, :], axis=1) - OFFSET * tl.sum(xk, axis=0)
                    if SCALE == 1:
                        part = part * s
                    acc += part
        if SCALE == 0:
            s = tl.load(s_ptr + rows64 * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
            if DOT or TP > 1:
                acc = acc * s[:, None]
            else:
                acc = acc * s
        if DOT or TP > 1:
            at = offs_t[None, :] * stride_ot + rows64[:, None]
            mask = mask_n[:, None] & mask_t[None, :]
            pt = offs_t[None, :] * N + rows64[:, None]
        else:
            at = rows64
            mask = mask_n
            pt = rows64
        if SPLITS > 1:
            tl.store(part_ptr + tl.program_id(1) * T * N + pt, acc, mask=mask)
            if last_of(lock_ptr + tl.program_id(0), SPLITS):
                acc = tl.load(part_ptr + pt, mask=mask, other=0.0, cache_modifier=".cg")
                for p in tl.static_range(1, SPLITS):
                    acc += tl.load(part_ptr + p * T * N + pt, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2_divisor(n: int) -> int:
    return n & -n


def launch_config(T: int, N: int, K: int, group: int, device: torch.device,
                  cfg: tuple[int, ...] | None = None, fma: bool = True) -> dict:
    """The kernel's tile sizes, scale mode and K slices for a call (`cfg` overrides CFG's entry; `fma`: 2-16
    tokens take the FMA path, with one token's tiles, else tl.dot's)."""
    dot = T > 1 and not fma
    bn, bk, warps, *rest = cfg or CFG[16 if dot else 1]
    if dot:
        bn = max(bn, 16)                                      # tl.dot's smallest M
    bk = min(bk, max(16, 1 << (K - 1).bit_length()))          # tiny test widths
    if group >= K:
        scale = 0
    elif group % bk == 0:
        scale = 1
    elif _pow2_divisor(group) >= 32:                          # e.g. group 96: tiles of 32 still hold one scale
        bk, scale = _pow2_divisor(group), 1
    else:
        scale = 2
    blocks = triton.cdiv(N, bn)
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    splits = max(1, min(PROGRAMS_PER_SM * sms // blocks, K // MIN_SPLIT_K))
    k_slice = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    return dict(BLOCK_N=bn, BLOCK_K=bk, warps=warps, stages=rest[0] if rest else 3, SCALE=scale, K_SLICE=k_slice,
                splits=triton.cdiv(K, k_slice))


def quant_gemv(x: torch.Tensor, pw: PackedWeight, cfg: tuple[int, ...] | None = None,
               swiglu: torch.Tensor | None = None, fma: bool = True) -> torch.Tensor:
    """x [T, K] -> x @ W^T [T, N] in x.dtype, W the packed weight; = quant_gemv_ref. T <= DECODE_MAX_T on a
    device Triton runs (CUDA, or the interpreter on CPU tensors) takes the kernel, anything else
    `dequant_matmul`. `swiglu` [T] (any stride): x is [T, 2K] (gate, up) and the input is
    `quant_gemv_ref.swiglu_input(x, swiglu)`, computed as the kernel loads it (a shared expert's down projection
    with its activation and gate: no launch for them). `fma` (kernel flag `quant_gemv_fma`): 2-16 tokens run FMAs
    per token over each unpacked tile; off, `tl.dot` (10-45x slower on the H200 at 4-16 tokens,
    bench/results/quant-decode-1)."""
    if swiglu is not None:
        if x.shape[1] != 2 * pw.in_features or swiglu.shape != (x.shape[0],):
            raise ValueError(f"swiglu: x {tuple(x.shape)} must be [T, 2 x {pw.in_features}], weights [T]")
        if x.shape[0] > DECODE_MAX_T or not triton_usable(x) or pw.bits > 8:
            return dequant_matmul(swiglu_input(x, swiglu), pw)
    T, K = x.shape[0], x.shape[1] // (2 if swiglu is not None else 1)
    N = pw.out_features
    if K != pw.in_features:
        raise ValueError(f"x has {K} inputs, the packed weight {pw.in_features}")
    if T > DECODE_MAX_T or not triton_usable(x) or pw.bits > 8:
        return dequant_matmul(x, pw)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    x = x.contiguous()
    c = launch_config(T, N, K, pw.group, x.device, cfg, fma)
    dot = T > 1 and not fma
    blocks, splits = triton.cdiv(N, c["BLOCK_N"]), c["splits"]
    if blocks > LOCKS:
        raise ValueError(f"{blocks} row blocks: more than the split counters ({LOCKS})")    # splits are 1 there
    part = torch.empty(splits, T, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    _quant_gemv_kernel[(blocks, splits)](
        x, pw.words, pw.scales, out, part, split_locks(x.device) if splits > 1 else pw.words,
        x if swiglu is None else swiglu, N, T, x.stride(0), pw.words.stride(0), pw.scales.stride(0), out.stride(0),
        0 if swiglu is None else swiglu.stride(0), K=K, W=pw.words.shape[1], BITS=pw.bits, DENSE=pw.dense,
        GROUP=pw.group, SCALE=c["SCALE"], K_SLICE=c["K_SLICE"], SPLITS=splits, BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"], TP=16 if dot else triton.next_power_of_2(T), DOT=dot, PREFETCH=PREFETCH and not dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SWIGLU=swiglu is not None, num_warps=c["warps"], num_stages=c["stages"])
    return out


def dequant_matmul(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """Prefill and the CPU: the weight dequantized to x.dtype a block of rows at a time (at most CHUNK elements,
    never the whole weight in float), each block one matmul, the weights exactly the dequantize-at-load path's."""
    T, K = x.shape
    N = pw.out_features
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    step = max(1, CHUNK // max(K, 1))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        out[:, r0:r1] = torch.nn.functional.linear(x, dequantize_packed(pw, x.dtype, r0, r1))
    return out
