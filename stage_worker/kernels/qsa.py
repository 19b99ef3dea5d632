"""QSA block selection for decode on the GPU: a score kernel and a select kernel, both bounded by the context.

Why: the selection decides which `budget + ratio - 1` K/V rows a decode step reads, a bounded number whatever the
context length (001 §1); it has to run on the device, batched, with no host sync, so that the attention launch can
follow it directly (and be captured in a CUDA graph). Under CUDA graphs the block tables are padded to the maximum
model length (262144 tokens / ratio 4 = 65,536 compression blocks), so work sized by the table width (a grid over
every block, then `torch.topk` over the width) costs ~85 us per layer even at a 256-token context. Here every loop
is bounded by `context_len // ratio` (the complete blocks), loaded on the device; the table width only sizes the
scratch buffer.

Structure (two launches, shapes from tensor sizes only):
1. `_score_kernel`, persistent grid (B, S) with S = min(MAX_SCORE_PROGRAMS, cdiv(table blocks, BLOCK_C)): program
   `p` walks the tiles `c0 = p * BLOCK_C, (p + S) * BLOCK_C, ...` below the sequence's complete blocks, so programs
   past the context return at once. Per tile: BLOCK_C pooled keys gathered through the block table, scored against
   all indexer heads with one fp32 `tl.dot` (heads padded to 16), `sum_h relu(.) / sqrt(d)`. It writes one int32 key
   per complete block: the score's float bits (the score is >= +0, so integer order == float order; -0.0 is written
   as +0.0). Entries past the complete blocks are never written nor read.
2. `_select_kernel`, grid (B,): the top k = budget // ratio keys among the `complete` ones, expanded to positions.
   If complete <= k every complete block is chosen (no ranking). Otherwise a radix select finds the k-th largest key
   T in four passes over the keys (8 bits each, top down, `tl.histogram` of the digit among the keys that match the
   bits fixed so far; it stops early once a whole bucket is taken). A last pass emits, in ascending block order, the
   blocks with key > T and, of those with key == T, the lowest-indexed ones still needed: ties go to the lower block
   index, as `stable_topk_mask`. Each chosen block's slot is a running prefix count (`tl.cumsum`), so no sort is
   needed. It then writes -1 over the unused block slots and the tail positions (same layout as `qsa_ref`).

Cost: the score kernel reads the complete blocks' pooled keys once, spread over B * S programs; the select kernel
reads B * complete int32 keys (L2-resident) up to five times, in one program per sequence.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from stage_worker.kernels.decode_attention import _INTERPRET, _dot, _fix_interpreter_loop_bounds

if _INTERPRET:
    _fix_interpreter_loop_bounds()      # the loops below are bounded by loaded context lengths

MAX_SCORE_PROGRAMS = 16     # score programs per sequence (persistent grid): enough to spread a long context over SMs
SELECT_BLOCK = 2048         # keys per tile of the select kernel
RADIX_BITS = 8              # bits resolved per radix-select pass: 4 passes cover a 32-bit key


@triton.jit
def _score_kernel(q_ptr, pooled_ptr, tables_ptr, ctx_ptr, key_ptr, sqrt_d,
                  s_qb, s_qh, s_pr, s_tb, s_kb,
                  N_IDX: tl.constexpr, D_IDX: tl.constexpr, PAGE: tl.constexpr, RATIO: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PROGRAMS: tl.constexpr,
                  DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_C
    complete = tl.load(ctx_ptr + b) // RATIO
    if first < complete:                                                        # else: past the context, no work
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D_IDX
        q = tl.load(q_ptr + b.to(tl.int64) * s_qb + offs_h[:, None] * s_qh + offs_d[None, :],
                    mask=(offs_h[:, None] < N_IDX) & d_ok[None, :], other=0.0)
        table = tables_ptr + b.to(tl.int64) * s_tb
        keys_out = key_ptr + b.to(tl.int64) * s_kb
        for c0 in range(first, complete, PROGRAMS * BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            ok = c < complete
            start = tl.where(ok, c * RATIO, 0)
            page = tl.load(table + start // PAGE, mask=ok, other=0)
            row = page.to(tl.int64) * (PAGE // RATIO) + (start % PAGE) // RATIO
            keys = tl.load(pooled_ptr + row[:, None] * s_pr + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                           other=0.0)
            # bf16 operands on the tensor cores with fp32 accumulation: exact products, fp32 sums (an fp32 "ieee"
            # dot of these tiles ran ~36 us per layer on the H200: FMA emulation and register spills).
            s = _dot(keys, tl.trans(q), DOT_F32)                                 # [BLOCK_C, BLOCK_H]; pad heads: 0
            score = tl.sum(tl.maximum(s, 0.0), axis=1) / sqrt_d
            score = tl.where(score == 0.0, 0.0, score)                          # -0.0 ties +0.0, as in the sort
            tl.store(keys_out + c, score.to(tl.int32, bitcast=True), mask=ok)   # >= 0: int order == float order


@triton.jit
def _select_kernel(key_ptr, ctx_ptr, out_ptr, s_kb, s_ob,
                   K: tl.constexpr, BUDGET: tl.constexpr, RATIO: tl.constexpr, RATIO_P: tl.constexpr,
                   BLOCK: tl.constexpr, BITS: tl.constexpr):
    b = tl.program_id(0)
    ctx = tl.load(ctx_ptr + b)
    complete = ctx // RATIO
    keys_in = key_ptr + b.to(tl.int64) * s_kb
    out = out_ptr + b.to(tl.int64) * s_ob
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)

    # Radix select of the K-th largest key. Invariant: `need` of the keys whose high bits equal `prefix` are still
    # to take. Selection rule at the end: key > thr, or key == thr among the first `take_eq` such keys (by block).
    done = complete <= K                                                        # fast path: take every block
    prefix = tl.zeros((), tl.int32)
    need = tl.full((), K, tl.int32)
    thr = tl.full((), -1, tl.int32)
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    for p in tl.static_range(NPASS):
        shift = BITS * (NPASS - 1 - p)                                          # top digit first (bit 31 is 0)
        bound = tl.where(done, 0, complete)                                     # no pass once the rank is known
        hist = tl.zeros([NB], tl.int32)
        for c0 in range(0, bound, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < bound
            key = tl.load(keys_in + c, mask=ok, other=0)
            if p > 0:
                ok = ok & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
            hist += tl.histogram((key >> shift) & (NB - 1), NB, mask=ok)
        at_least = tl.cumsum(hist, axis=0, reverse=True)                        # keys with digit >= bin
        digit = tl.max(tl.where(at_least >= need, bins, -1), axis=0)            # bucket holding the K-th largest
        above = tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        in_bucket = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
        new_prefix = prefix | (digit << shift)
        new_need = need - above
        whole = new_need == in_bucket                                           # the whole bucket is taken
        thr = tl.where(done, thr, tl.where(whole, new_prefix - 1, thr))          # then: every key >= its lower edge
        prefix = tl.where(done, prefix, new_prefix)
        need = tl.where(done, need, new_need)
        done = done | whole
    take_eq = tl.where(done, 0, need)
    thr = tl.where(done, thr, prefix)                                           # not done: prefix is the K-th key

    # Emit the chosen blocks in ascending order; a block's slot is the number chosen before it.
    t = tl.arange(0, RATIO_P)
    n_sel = tl.zeros((), tl.int32)
    n_eq = tl.zeros((), tl.int32)
    for c0 in range(0, complete, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < complete
        key = tl.load(keys_in + c, mask=ok, other=-1)                           # -1 is never chosen (thr >= -1)
        eq = ok & (key == thr)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = ok & ((key > thr) | (eq & (eq_rank < take_eq)))
        slot = n_sel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out + slot[:, None] * RATIO + t[None, :], (c[:, None] * RATIO + t[None, :]).to(tl.int32),
                 mask=(sel & (slot < K))[:, None] & (t[None, :] < RATIO))              # never past the row
        n_sel += tl.sum(sel.to(tl.int32), axis=0)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)

    # -1 over the unused block slots, then the tail (incomplete block) positions.
    for j0 in range(n_sel * RATIO, BUDGET, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(out + j, tl.full([BLOCK], -1, tl.int32), mask=j < BUDGET)
    tail = complete * RATIO + t
    tl.store(out + BUDGET + t, tl.where(tail < ctx, tail, -1).to(tl.int32), mask=t < RATIO - 1)


def score_programs(n_blocks: int, block_c: int) -> int:
    """Programs per sequence of the score kernel: no more than there are tiles in the table, at most
    MAX_SCORE_PROGRAMS (a host-side shape computation: the context is only known on the device)."""
    return max(1, min(MAX_SCORE_PROGRAMS, triton.cdiv(n_blocks, block_c)))


def qsa_scores_keys(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, ratio: int,
                    block_c: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, max_blocks * block_size // ratio] int32 ranking keys (float bits of the score, see the module docstring);
    only the first `context_len // ratio` entries of a row are written (`out`, if given, shows which: tests)."""
    B, n_idx, d_idx = q_idx.shape
    assert q_idx.stride(-1) == 1 and pooled.stride(-1) == 1 and pooled.shape[1] == d_idx
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and block_size % ratio == 0
    n_blocks = block_tables.shape[1] * block_size // ratio
    keys = torch.empty((B, n_blocks), dtype=torch.int32, device=q_idx.device) if out is None else out
    assert keys.shape == (B, n_blocks) and keys.dtype == torch.int32 and keys.stride(-1) == 1
    block_c = block_c or 64
    programs = score_programs(n_blocks, block_c)
    _score_kernel[(B, programs)](
        q_idx, pooled, block_tables, context_lens, keys, math.sqrt(d_idx),
        q_idx.stride(0), q_idx.stride(1), pooled.stride(0), block_tables.stride(0), keys.stride(0),
        N_IDX=n_idx, D_IDX=d_idx, PAGE=block_size, RATIO=ratio,
        BLOCK_H=max(16, triton.next_power_of_2(n_idx)), BLOCK_D=max(16, triton.next_power_of_2(d_idx)),
        BLOCK_C=block_c, PROGRAMS=programs, DOT_F32=_INTERPRET or q_idx.dtype == torch.float32
        or pooled.dtype == torch.float32 or q_idx.dtype != pooled.dtype, num_warps=4)
    return keys


def select_from_keys(keys: torch.Tensor, context_lens: torch.Tensor, ratio: int, budget: int) -> torch.Tensor:
    """keys [B, >= max complete] int32, >= 0 (only the first `context_len // ratio` of a row are read) -> selected
    [B, budget + ratio - 1] int32: the blocks of the budget // ratio largest keys (equal keys: lower block first),
    in ascending order, expanded to positions, then the tail. Separate from the scores so tests can plant keys."""
    assert keys.dtype == torch.int32 and keys.stride(-1) == 1 and budget % ratio == 0
    B = keys.shape[0]
    out = torch.empty((B, budget + ratio - 1), dtype=torch.int32, device=keys.device)
    _select_kernel[(B,)](
        keys, context_lens, out, keys.stride(0), out.stride(0),
        K=budget // ratio, BUDGET=budget, RATIO=ratio, RATIO_P=triton.next_power_of_2(ratio),
        BLOCK=SELECT_BLOCK, BITS=RADIX_BITS, num_warps=8)
    return out


def qsa_select(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               block_size: int, ratio: int, budget: int, *, block_c: int | None = None) -> torch.Tensor:
    """q_idx [B, n_idx, d_idx] of each sequence's new token; pooled [rows // ratio, d_idx] (already holding the block
    the new token completed); block_tables [B, max_blocks] int32; context_lens [B] int32 with the new token.
    Returns selected [B, budget + ratio - 1] int32: chosen blocks' tokens (ascending block order), then the tail;
    -1 pad. Equals `qsa_select_ref`."""
    assert budget % ratio == 0
    keys = qsa_scores_keys(q_idx, pooled, block_tables, context_lens, block_size, ratio, block_c)
    return select_from_keys(keys, context_lens, ratio, budget)
