"""Grouped MoE prefill over INT4 experts on the tensor cores: the (token, slot) pairs of a chunk sorted by expert on
the device, the words and group scales dequantized in registers and fed to `tl.dot`, no host sync.

The path it replaces (`ExpertTable.moe_int4`, `moe_int4.grouped_moe_int4`) loops over the present experts in Python,
dequantizing each to the compute dtype and running two GEMMs: ~15 launches an expert, ~300 experts a layer in a
4-stream prefill at the full shape (TTFT 3.98 s at --vram-limit 24, bench/results/offload-int4-vram24-1). Here, as in
`moe_prefill.py` for bf16 tables: pairs sorted by expert and padded to BLOCK_M (`align_range`), one launch computes
act = silu(x Wg^T) * (x Wu^T) for every block, one the down projection, each program reading only its block's
expert; the combine is a fixed-order batched matmul (deterministic, no atomics). Dropped pairs (negative ids: no
expert) are in no block and add nothing.

Host slots (cold experts in pinned host RAM, issue 16) are read by the kernel over PCIe directly (UVA), not staged:
a program reads a [BLOCK_N rows x all inputs] slice of its expert, so one block reads the expert once, whatever the
N tiles. Device and host slots run as separate launches so that the host launch can take a BLOCK_M large enough for
a whole expert's pairs (`host_block_m`: the chunk's token count rounded up to a power of two, up to 128; a token
picks an expert at most once): each host expert crosses PCIe once per chunk, unless more than 128 of the chunk's
tokens picked it (then once per 128 of them). The padding this costs is tensor-core work on rows that are masked
out of every load, cheap beside the PCIe read it saves. Staging the chunk's host experts into a device buffer first
would read the same bytes over the same link (a gather of scattered host rows, so a kernel or per-expert copies),
write and re-read them in HBM, and need a buffer as large as the chunk's present host experts (at the full shape
with 78% of experts cold, up to ~400 x 2.53 MB = 1 GB a layer of the VRAM the offload frees), or rounds with host
syncs; the direct read also overlaps PCIe with other programs' math. `bench/moe_int4_prefill.py` prints the host
launch's PCIe bandwidth beside the H200's 55 GB/s copy-engine figure.

Scales: when BLOCK_K divides the group, a step's inputs share one scale a row, applied to the dot's result in fp32
(mode 0); when the group divides BLOCK_K, the step's scales are loaded as a [groups, BLOCK_N] tile and broadcast
(mode 1); otherwise (groups of 24, 40, ...) each element's scale is gathered (mode 2). A last group shorter than the
group size has its own scale column, as the checkpoints store it. Asymmetric experts (ZCOL > 0: zero points after
the scales in the scale rows, `moe_int4_ref`) subtract each row's zero point with the 8: in the tile (modes 1 and 2,
and mode 0 without MAGIC), or, mode 0 with MAGIC, in the row-sum term taken off the dot (now per output column).
FP4 experts (FP4: E2M1 codes in the words, float32 scales, `moe_int4_ref`) build each code's value in the tile
(`common.e2m1_scaled`) and take no MAGIC path and no offset.

Reference: `moe_int4_ref.fused_moe_int4_ref` (dequantize, then `fused_moe_ref`); the path it replaces:
`ExpertTable.moe_int4`. Tests: tests/test_kernel_moe_int4_prefill.py. Switch: kernel flag `moe_int4_prefill`.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from stage_worker.kernels.common import e2m1_scaled
from stage_worker.kernels.moe_int4_ref import PackedExperts, zcol
from stage_worker.kernels.moe_prefill import block_m

# (BLOCK_N, BLOCK_K, warps, stages) per launch kind and phase: not timed yet (bench/moe_int4_prefill.py --sweep on
# the H200), chosen by compiling for sm_90 without a GPU and reading ptxas's registers: the device launch (BLOCK_M
# 16-64, HBM- and ALU-bound) at 8 warps and BLOCK_K 64 spills nothing (104-202 registers; 4 warps or BLOCK_K 128
# spill from BLOCK_M 64 on); the host launch (BLOCK_M up to 128, PCIe-bound, so some spilling costs little) reads
# 64 contiguous bytes of a row a step (BLOCK_K 128) with BLOCK_N 32 (BLOCK_K 256 spills 2-3 KB at BLOCK_M 128).
# tests/test_kernel_moe_int4_prefill.py compiles both for sm_90 on the CPU.
CFG = {("dev", "up"): (64, 64, 8, 3), ("dev", "down"): (64, 64, 8, 3),
       ("host", "up"): (32, 128, 8, 3), ("host", "down"): (32, 128, 8, 3)}
HOST_MAX_BLOCK_M = 128


@triton.jit
def _tile(q_base, s_base, rows, rmask, k0, stride_qr, stride_sr, K: tl.constexpr, GROUP: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr, DT: tl.constexpr,
          MAGIC: tl.constexpr, ZCOL: tl.constexpr, FP4: tl.constexpr = False):
    """W^T for `rows` and inputs k0..k0+BLOCK_K as a [BLOCK_K, BLOCK_N] tile in DT, the [BLOCK_N] scales the
    dot's result takes (mode 0; ones otherwise, the scales being in the tile) and the [BLOCK_N] zero points the
    caller still has to take off (mode 0 with MAGIC and ZCOL; zeros otherwise). Words are loaded once, [BLOCK_K / 8,
    BLOCK_N], and split into their 8 nibbles in registers (input 8w + n is nibble n of word w, stored as q + 8).

    Mode 0 with MAGIC (bf16 / fp16 activations): the tile holds MAGIC's value + nibble, built by OR-ing the nibble
    into the mantissa of 128.0 (bf16) or 1024.0 (fp16), exactly, with no int-to-float conversion (a quarter-rate
    instruction); the caller subtracts (that value + 8 + the row's zero point) x the row sums of x from the dot.
    FP4: the nibbles are E2M1 codes (`common.e2m1_scaled`); never MAGIC or ZCOL."""
    WK: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP        # groups a step (mode 1)
    kw = k0 // 8 + tl.arange(0, WK)
    m = (kw < K // 8)[:, None] & rmask[None, :]
    q = tl.load(q_base + rows[None, :] * stride_qr + kw[:, None], mask=m, other=0)          # [WK, BLOCK_N]
    v = (q[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF                      # [WK, 8, BLOCK_N]
    v = tl.reshape(v, [BLOCK_K, BLOCK_N])
    z = tl.zeros([BLOCK_N], tl.float32)
    if MODE == 0:
        s = tl.load(s_base + rows * stride_sr + k0 // GROUP, mask=rmask, other=0.0).to(tl.float32)
        if ZCOL:
            z = tl.load(s_base + rows * stride_sr + ZCOL + k0 // GROUP, mask=rmask, other=0.0).to(tl.float32)
        if FP4:
            w = (e2m1_scaled(v, 0) * 16384.0).to(DT)
        elif MAGIC:
            w = (v | MAGIC).to(tl.int16).to(DT, bitcast=True)
        else:
            w = ((v - 8).to(tl.float32) - z[None, :]).to(DT)
            z = tl.zeros([BLOCK_N], tl.float32)
    else:
        if MODE == 1:
            gi = k0 // GROUP + tl.arange(0, NG)
            sm = (gi < (K + GROUP - 1) // GROUP)[:, None] & rmask[None, :]
            st = tl.load(s_base + rows[None, :] * stride_sr + gi[:, None], mask=sm, other=0.0).to(tl.float32)
            sc = tl.reshape(tl.broadcast_to(st[:, None, :], [NG, GROUP, BLOCK_N]), [BLOCK_K, BLOCK_N])
            if ZCOL:
                zt = tl.load(s_base + rows[None, :] * stride_sr + ZCOL + gi[:, None], mask=sm,
                             other=0.0).to(tl.float32)
                zc = tl.reshape(tl.broadcast_to(zt[:, None, :], [NG, GROUP, BLOCK_N]), [BLOCK_K, BLOCK_N])
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            sm = (ks < K)[:, None] & rmask[None, :]
            sc = tl.load(s_base + rows[None, :] * stride_sr + (ks // GROUP)[:, None], mask=sm,
                         other=0.0).to(tl.float32)
            if ZCOL:
                zc = tl.load(s_base + rows[None, :] * stride_sr + ZCOL + (ks // GROUP)[:, None], mask=sm,
                             other=0.0).to(tl.float32)
        if FP4:
            w = (e2m1_scaled(v, 0) * 16384.0 * sc).to(DT)
        elif ZCOL:
            w = (((v - 8).to(tl.float32) - zc) * sc).to(DT)
        else:
            w = ((v - 8).to(tl.float32) * sc).to(DT)
        s = tl.full([BLOCK_N], 1.0, tl.float32)
    return w, s, z


@triton.jit
def _dot(a, w, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    if INTERPRET:                     # the interpreter's bf16 tl.dot is wrong (triton 3.6): upcast there
        d = tl.dot(a.to(tl.float32), w.to(tl.float32))
    elif IEEE:                        # float32 models: no TF32 rounding
        d = tl.dot(a, w, input_precision="ieee")
    else:
        d = tl.dot(a, w)
    return d


@triton.jit
def _step(d, off, xsum, s, z, MAGIC: tl.constexpr, ZCOL: tl.constexpr):
    """A step's dot d with the tile's offsets taken off (MAGIC + 8 times the row sums; with MAGIC and zero points,
    the zero point times them too), times the scales."""
    if MAGIC:
        d = d - off
        if ZCOL:
            d = d - xsum * z[None, :]
    return d * s[None, :]


@triton.jit
def _int4_gemm_kernel(a_ptr, sorted_ptr, block_expert_ptr, q_ptr, s_ptr, out_ptr, stride_a, stride_qe, stride_qr,
                      stride_se, stride_sr, TK, K: tl.constexpr, N: tl.constexpr, ROW_DIV: tl.constexpr,
                      GATED: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                      INTERPRET: tl.constexpr, IEEE: tl.constexpr, ZCOL: tl.constexpr = 0,
                      FP4: tl.constexpr = False):
    """One BLOCK_M block of pairs (one expert) x BLOCK_N output columns: out[pair, n] = sum_k a[pair // ROW_DIV, k]
    W_e[n, k], W in INT4 words and group scales. GATED (the up phase): W's rows n are the gate rows and n + N the
    up rows, and out = silu(gate) * up. Rows of the block past its expert's pairs are masked in every load and
    store. block_expert < 0: a block past the used length, which exits at once. ZCOL > 0: asymmetric, FP4: E2M1
    codes (`_tile`)."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < TK
    arow = (pair // ROW_DIV).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    q_base = q_ptr + e * stride_qe
    s_base = s_ptr + e * stride_se
    DT: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + arow[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks < K)[None, :],
                    other=0.0)
        if MAGIC:
            xsum = tl.sum(a.to(tl.float32), axis=1)[:, None]
            off = OFFSET * xsum                                            # the tile's MAGIC + 8, times x
        else:
            xsum = 0.0
            off = 0.0
        w, s, z = _tile(q_base, s_base, rows, rmask, k0, stride_qr, stride_sr, K, GROUP, BLOCK_N, BLOCK_K, MODE,
                        DT, MAGIC, ZCOL, FP4)
        acc += _step(_dot(a, w, INTERPRET, IEEE), off, xsum, s, z, MAGIC, ZCOL)
        if GATED:
            w, s, z = _tile(q_base, s_base, rows + N, rmask, k0, stride_qr, stride_sr, K, GROUP, BLOCK_N, BLOCK_K,
                            MODE, DT, MAGIC, ZCOL, FP4)
            acc_u += _step(_dot(a, w, INTERPRET, IEEE), off, xsum, s, z, MAGIC, ZCOL)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_u
    dst = out_ptr + pair[:, None].to(tl.int64) * N + rows[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & rmask[None, :])


def align_range(ids: torch.Tensor, lo: int, hi: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs whose slot is in [lo, hi), sorted by slot, each slot's run padded to a multiple of `bm`:
    (sorted pair ids [L] int32, padded with T*k; slot - lo of each bm block [L / bm] int32, -1 past the end).

    Pair p = t * k + j is token t's j-th routed slot; pairs outside the range (the other table's, negative ids) are
    in no block. L = T*k + min(n, T*k) * (bm - 1), rounded up to bm: the most any routing can need (at most one
    partial block a present slot), so nothing here waits for the device."""
    flat = ids.reshape(-1).long()
    tk, n, dev = flat.numel(), hi - lo, ids.device
    key = torch.where((flat >= lo) & (flat < hi), flat - lo, n)            # n: pairs this launch does not take
    order = torch.argsort(key, stable=True)
    # not torch.bincount: on CUDA it reads the largest id back to size its output (a host sync)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:n]
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    slot = key[order]
    taken = slot < n
    s = slot.clamp_max(n - 1)
    length = -(-(tk + min(n, tk) * (bm - 1)) // bm) * bm
    pos = torch.where(taken, (padded_end - padded)[s] + torch.arange(tk, device=dev) - start[s], length)
    sorted_ids = torch.full((length + 1,), tk, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)                                # untaken pairs land on the spare row
    first_row = torch.arange(0, length, bm, device=dev)
    block_slot = torch.searchsorted(padded_end, first_row, right=True)
    block_slot = torch.where(first_row < padded_end[-1], block_slot, -1).to(torch.int32)
    return sorted_ids[:length], block_slot


def host_block_m(tokens: int) -> int:
    """The host launch's rows a block: every pair of one expert in one block (so it is read once) up to 128."""
    return min(HOST_MAX_BLOCK_M, max(16, triton.next_power_of_2(tokens)))


# int16 bits OR-ed with a nibble to give (value + nibble) exactly, and value + 8 (mode 0's dequantization)
MAGIC = {torch.bfloat16: (0x4300, 136.0), torch.float16: (0x6400, 1032.0)}


def scale_mode(group: int, block_k: int) -> int:
    """0: BLOCK_K divides the group (one scale a row a step, after the dot); 1: the group divides BLOCK_K (a
    [groups, BLOCK_N] scale tile); 2: neither (a scale gathered per element)."""
    return 0 if group % block_k == 0 else 1 if block_k % group == 0 else 2


def _gemm(a: torch.Tensor, sorted_ids: torch.Tensor, block_slot: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
          out: torch.Tensor, tk: int, K: int, N: int, row_div: int, gated: bool, group: int, bm: int,
          cfg: tuple[int, int, int, int], zcol: int = 0, fp4: bool = False) -> None:
    """One launch over one table: out[pair] = (a[pair // row_div] W_e^T) for the blocks of `block_slot`."""
    bn, bk, warps, stages = cfg
    bn = min(bn, max(16, triton.next_power_of_2(N)))
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    interpret = bool(triton.knobs.runtime.interpret)
    mode = scale_mode(group, bk)
    magic, offset = MAGIC.get(a.dtype, (0, 0.0)) if mode == 0 and not fp4 else (0, 0.0)
    _int4_gemm_kernel[(block_slot.numel(), triton.cdiv(N, bn))](
        a, sorted_ids, block_slot, q, s, out, a.stride(0), q.stride(0), q.stride(1), s.stride(0), s.stride(1), tk,
        K=K, N=N, ROW_DIV=row_div, GATED=gated, GROUP=group, MODE=mode, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        MAGIC=magic, OFFSET=offset, INTERPRET=interpret, IEEE=a.dtype == torch.float32, ZCOL=zcol, num_warps=warps,
        num_stages=stages, FP4=fp4)


def grouped_moe_int4_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: PackedExperts,
                            host: PackedExperts | None = None, first_host: int | None = None) -> torch.Tensor:
    """x [T, H], routed slots ids [T, k] (negative: no expert) and weights [T, k] -> [T, H] in x.dtype; =
    fused_moe_int4_ref with the unrouted pairs' weights 0. `host`: slots from `first_host` on (= the device table's
    length), packed the same way in pinned host memory that the GPU reads over PCIe. The activation between the two
    GEMMs and each pair's down output are kept in x.dtype, as the per-expert loop keeps them."""
    T, H = x.shape
    k = ids.shape[1]
    E, H_, I = experts.shape
    g, g2 = experts.group, experts.down_group
    if H_ != H or H % 8 or I % 8 or g % 8 or g2 % 8 or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)} ids {tuple(ids.shape)} experts (E, H, I) {(E, H_, I)} "
                         f"groups {g}/{g2} (H, I and the groups must be multiples of 8)")
    if host is not None and (first_host != E or host.shape[1:] != experts.shape[1:] or
                             (host.group, host.down_group, host.fp4) != (g, g2, experts.fp4)):
        raise ValueError(f"host slots {host.shape} from {first_host} do not continue the device table {experts.shape}")
    if any(t.stride(-1) != 1 for p in (experts, host) if p is not None for t in (p.q13, p.s13, p.q2, p.s2)):
        raise ValueError("the packed parts need a contiguous last dimension")   # never copy the expert tables
    tk = T * k
    out = torch.zeros(tk, H, dtype=x.dtype, device=x.device)       # pairs of no expert stay 0 in the combine
    if T == 0:
        return out.view(0, H)
    x = x.contiguous()
    act = torch.empty(tk, I, dtype=x.dtype, device=x.device)
    total = E + (0 if host is None else host.q13.shape[0])
    launches = [(experts, 0, E, block_m(tk * E // max(total, 1), E), "dev")]    # the device slots' share of pairs
    if total > E:
        launches.append((host, E, total, host_block_m(T), "host"))
    for table, lo, hi, bm, kind in launches:
        if hi == lo:
            continue
        sorted_ids, block_slot = align_range(ids, lo, hi, bm)
        _gemm(x, sorted_ids, block_slot, table.q13, table.s13, act, tk, H, I, k, True, g, bm, CFG[kind, "up"],
              zcol(H, g, experts), experts.fp4)
        _gemm(act, sorted_ids, block_slot, table.q2, table.s2, out, tk, I, H, 1, False, g2, bm, CFG[kind, "down"],
              zcol(I, g2, experts), experts.fp4)
    return torch.bmm(weights.to(x.dtype).unsqueeze(1), out.view(T, k, H)).squeeze(1)
