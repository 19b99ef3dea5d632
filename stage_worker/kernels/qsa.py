"""QSA block selection for decode on the GPU: a score kernel, radix-select passes and an emit kernel, each a grid
over the whole device and bounded by the context.

Why: the selection decides which `budget + ratio - 1` K/V rows a decode step reads, a bounded number whatever the
context length (001 §1); it has to run on the device, batched, with no host sync, so that the attention launch can
follow it directly (and be captured in a CUDA graph). Under CUDA graphs the block tables are padded to the maximum
model length (262144 tokens / ratio 4 = 65,536 compression blocks), so work sized by the table width (a grid over
every block, then `torch.topk` over the width) costs ~85 us per layer even at a 256-token context. Here every program
first loads its sequence's `context_len // ratio` (the complete blocks) and returns at once past them; the table width
only sizes the grids and the scratch. And the work is spread over the SMs: with the first version (16 score
programs and ONE select program per sequence) one layer's decode step on the H200 grew from 26 us at 4k to 316 us at
262k (bench/results/h200-12), for 16 MB of pooled keys (4 us of HBM time): almost every SM idle, ~160 histogram
iterations in series.

Keys: the score's float bits as int32 (the score is >= +0, so integer order == float order; -0.0 is written as +0.0).
The choice: the k = budget // ratio largest keys, equal keys to the lower block (as `stable_topk_mask`); all
`complete` blocks if complete <= k. Launches (shapes from tensor sizes only; `qsa_select`):
0. a memset of the radix histograms [B, passes + 1, 2^bits] (they are summed with atomics; the last row holds the
   last pass's ticket, so the memset zeroes it too). The model's decode step has no such launch: it passes
   `qsa_select(hist=)` histograms that the pooled-key update kernel before it zeroed (`qsa_pool_update(zero=)`).
1. `_score_kernel`, persistent grid (B, S), S from the SM count and the batch (`score_programs`): program `p` walks
   the tiles `p, p + S, ...` of SCORE_BLOCK complete blocks: pooled keys gathered through the block table, one `tl.dot`
   (fp32 accumulation) against the indexer heads (heads padded to 16), `sum_h relu(.) / sqrt(d)`; it writes one key per
   complete block, and adds the histogram of its keys' top radix digit into the sequence's pass-0 histogram (the
   first radix pass, fused: it saves a launch and a read of the keys). At 262k a program walks ~2.6 tiles, each a
   gather of two dependent round trips (block table, then 64 key rows of 256 bytes).
2. `_radix_pass_kernel` for passes 1..3 (8-bit digits), grid (B, tiles of SELECT_TILE keys), one tile a program
   (rows of at most SHORT_BLOCKS complete blocks: the hybrid below):
   each program recomputes from the histograms of the earlier passes (256 ints each, L2) the digits of the k-th
   largest key found so far, and adds the histogram of the next digit among its keys that share them. The last pass
   also stores, per tile and per value d of the last digit, how many of its keys are >= the prefix with digit d
   (`ge`), then takes a ticket (an acq_rel atomic on the row's counter); the program that draws the row's last
   ticket (one per tile inside the context: programs past it take none) sees every tile's histogram and `ge` and
   ranks the row once (`_rank_tiles`): the k-th largest key T, how many keys equal to it to take, and for every
   tile the keys equal to T and the blocks chosen in the tiles before it.
3. `_emit_kernel`, grid (B, tiles): a program loads those 4 ints, then a `tl.cumsum` over its tile gives each chosen
   block its slot, in ascending block order (no sort): key > T, or key == T among the first `take_eq` by block
   index. Tile 0 writes -1 over the unused block slots and the tail positions (the layout of `qsa_ref`).
   Why the ticket: every emit program used to recompute T from the four histograms (four serial 256-bin scans) and
   sum the counts of all earlier tiles (2 x 128 loads at 262k): the emit grew from 4 to 38 us over 5 layers from 4k
   to 262k on the H200. The last pass's programs already hold the first three digits; one of them adds the last
   scan and one prefix sum over the tiles.
Each launch reads the keys (L2-resident, 4 bytes a block) at most once; a grid-wide barrier inside one persistent
kernel would save the launches but can deadlock when not every program is resident, so the passes are launches.

Short rows (device-side hybrid): a launch costs ~2-4 us in a CUDA graph whatever it does, and at 4k context the six
launches took 22.3 us on the H200 against 14.3 us for the first version's two (bench/results/h200-13). A row with at
most SHORT_BLOCKS complete blocks (2048: 8k tokens) is selected whole by program 0 of its row in the FIRST pass
launch (`_select_row`: the remaining radix passes over all its keys in steps of SHORT_TILE, pass 0's histogram read
from the score kernel, then the emit with a running count, -1 padding and tail); the later pass launches and the
emit return at once for it (they read the context length: one captured graph serves every mix of short and long
rows, no host branch). Long rows take the tiled passes as above. Why this and not fewer launches for everyone:
the launch count is fixed by the long rows (a pass needs the previous pass's histogram over every tile, and the
emit needs the final one: each is a grid-wide dependency); 11-bit digits would drop one pass launch but make the
fused pass-0 histogram 2048 bins wide inside the score kernel, the one that decides 262k (128 registers a thread
against 91 at 8 bits, sm_90); the hybrid leaves the long path untouched and only turns the short rows' later
launches into early returns (and is sweepable: SHORT_BLOCKS = 0 is the plain tiled path,
`qsa_select(short_blocks=0)`). What it cannot save: the memset and the launches after the first pass launch still
run for a short row (an early return costs about a launch's latency), so it should land between the first version
and the tiled path at 4k, not at 14 us (GPU-unverified: `test_262k_context_on_gpu` prints the three).
`one_program=True` keeps the first version (16 score programs, `_select_kernel`: `_select_row` for every row, one
program per sequence): the `-qsa_tiles` path and the baseline the GPU test times against.
Launch parameters (SCORE_BLOCK, SCORE_PROGRAMS_PER_SM, SELECT_TILE, RADIX_BITS, SHORT_BLOCKS,
SHORT_TILE) are module globals (`bench/tune_kernels.py --only qsa` sweeps the first four).
With the kernel flag `pdl` (`common.pdl_usable`) the four kernels launch as programmatic dependents and each waits
(`common.pdl_wait`) first thing, before its context length, every program (those that return at once included):
each reads the previous launch's keys / histograms / counts, so the launch chain keeps its order (a kernel's wait
returns once the kernel before it has finished, which had itself waited for the one before). The histograms'
memset before the score kernel, where `qsa_select` makes them itself, is a plain launch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from stage_worker.kernels.common import INTERPRET as _INTERPRET
from stage_worker.kernels.common import fix_interpreter_loop_bounds, pdl_usable, pdl_wait, sm_count
from stage_worker.kernels.decode_attention import _dot

if _INTERPRET:
    fix_interpreter_loop_bounds()      # the loops below are bounded by loaded context lengths

SCORE_BLOCK = 64            # pooled keys per tile of the score kernel
SCORE_PROGRAMS_PER_SM = 3   # score programs per SM, shared by the batch (sm_90, as the JIT specializes it: 91
                            # registers a thread and 24 KB of shared memory, so up to 5 of 4 warps are resident)
SELECT_TILE = 512           # keys per program of the radix passes and the emit (65,536 blocks: 128 programs)
RADIX_BITS = 8              # bits resolved per radix pass: 4 passes cover a 32-bit key
SHORT_BLOCKS = 2048         # rows of at most this many complete blocks (8k tokens at ratio 4) are selected whole by
                            # one program of the first pass launch; 0: every row takes the tiled passes
SHORT_TILE = 1024           # keys a step of that program's loops: 96 registers a thread in the pass launch that
                            # holds it (sm_90; 2048: 147, and fewer of the long rows' pass programs resident)
ONE_PROGRAM_SCORE_PROGRAMS = 16     # the first version's score grid per sequence (`one_program=True`)


@triton.jit
def _score_kernel(q_ptr, pooled_ptr, tables_ptr, ctx_ptr, key_ptr, hist_ptr, sqrt_d,
                  s_qb, s_qh, s_pr, s_tb, s_kb, s_hb,
                  N_IDX: tl.constexpr, D_IDX: tl.constexpr, PAGE: tl.constexpr, RATIO: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PROGRAMS: tl.constexpr,
                  DOT_F32: tl.constexpr, HIST: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr = False):
    """Module doc, step 1. The loop is left to Triton's pipelining: a version pipelined by hand (the next tile's
    gather issued before this one is scored) measured the same on the H200 (h200-26: 23.75 against 23.79 us for
    the whole 262k selection) and was deleted."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_C
    complete = tl.load(ctx_ptr + b) // RATIO
    if first < complete:
        offs_c = tl.arange(0, BLOCK_C)
        offs_d = tl.arange(0, BLOCK_D)
        q = _indexer_heads(q_ptr + b.to(tl.int64) * s_qb, s_qh, offs_d, N_IDX, D_IDX, BLOCK_H)
        table = tables_ptr + b.to(tl.int64) * s_tb
        keys_out = key_ptr + b.to(tl.int64) * s_kb
        hist = tl.zeros([1 << BITS], tl.int32)
        for c0 in range(first, complete, PROGRAMS * BLOCK_C):
            page = _table_entries(table, c0 + offs_c, complete, PAGE, RATIO)
            keys = _pooled_rows(pooled_ptr, page, c0 + offs_c, complete, s_pr, offs_d, D_IDX, PAGE, RATIO)
            hist = _score_tile(keys, q, c0 + offs_c, complete, keys_out, hist, sqrt_d, DOT_F32, HIST, BITS)
        if HIST:
            tl.atomic_add(hist_ptr + b.to(tl.int64) * s_hb + tl.arange(0, 1 << BITS), hist, mask=hist > 0,
                          sem="relaxed")


@triton.jit
def _indexer_heads(q_row, s_qh, offs_d, N_IDX: tl.constexpr, D_IDX: tl.constexpr, BLOCK_H: tl.constexpr):
    """A sequence's indexer query [BLOCK_H, BLOCK_D], zero past N_IDX heads and D_IDX dims."""
    offs_h = tl.arange(0, BLOCK_H)
    return tl.load(q_row + offs_h[:, None] * s_qh + offs_d[None, :],
                   mask=(offs_h[:, None] < N_IDX) & (offs_d[None, :] < D_IDX), other=0.0)


@triton.jit
def _table_entries(table, c, complete, PAGE: tl.constexpr, RATIO: tl.constexpr):
    """The KV page of each compression block c (0 past the context: no load). c is >= 0: unsigned, the division
    and the remainder below are a shift and a mask (signed, ~14 instructions a row in the gather's address)."""
    BPP: tl.constexpr = PAGE // RATIO                                           # compression blocks a page
    return tl.load(table + c.to(tl.uint32) // BPP, mask=c < complete, other=0)


@triton.jit
def _pooled_rows(pooled_ptr, page, c, complete, s_pr, offs_d, D_IDX: tl.constexpr, PAGE: tl.constexpr,
                 RATIO: tl.constexpr):
    """The pooled key rows [BLOCK_C, BLOCK_D] of blocks c, in the pages the block table gave (zeros past the
    context: no load). Block c is token c * RATIO: row page * (PAGE // RATIO) + c % (PAGE // RATIO)."""
    BPP: tl.constexpr = PAGE // RATIO
    ok = c < complete
    row = page.to(tl.int64) * BPP + (c.to(tl.uint32) % BPP).to(tl.int64)
    return tl.load(pooled_ptr + row[:, None] * s_pr + offs_d[None, :], mask=ok[:, None] & (offs_d < D_IDX)[None, :],
                   other=0.0)


@triton.jit
def _score_tile(keys, q, c, complete, keys_out, hist, sqrt_d, DOT_F32: tl.constexpr, HIST: tl.constexpr,
                BITS: tl.constexpr):
    """Score one tile's pooled keys against the indexer heads, store their keys, add their top digits to hist."""
    NB: tl.constexpr = 1 << BITS
    TOP: tl.constexpr = BITS * ((32 + BITS - 1) // BITS - 1)                    # shift of the first radix digit
    ok = c < complete
    # bf16 operands on the tensor cores with fp32 accumulation: exact products, fp32 sums (an fp32 "ieee" dot of
    # these tiles ran ~36 us per layer on the H200: FMA emulation and register spills).
    s = _dot(keys, tl.trans(q), DOT_F32)                                        # [BLOCK_C, BLOCK_H]; pad heads: 0
    score = tl.sum(tl.maximum(s, 0.0), axis=1) / sqrt_d
    score = tl.where(score == 0.0, 0.0, score)                                  # -0.0 ties +0.0, as in the sort
    key = score.to(tl.int32, bitcast=True)                                      # >= 0: int order == float order
    tl.store(keys_out + c, key, mask=ok)
    if HIST:
        hist += tl.histogram(key >> TOP, NB, mask=ok)
    return hist


@triton.jit
def _radix_prefix(hist_ptr, K, PASSES: tl.constexpr, BITS: tl.constexpr):
    """(prefix, need) after `PASSES` radix passes: the top PASSES digits of the K-th largest key (lower digits 0),
    and how many of the keys that share them are still to take (the rest of the K are above the prefix). Every
    program recomputes it from the histograms (identical integers everywhere): no launch just to publish it."""
    NB: tl.constexpr = 1 << BITS
    NPASS: tl.constexpr = (32 + BITS - 1) // BITS
    bins = tl.arange(0, NB)
    prefix = tl.zeros((), tl.int32)
    need = tl.zeros((), tl.int32) + K
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + p * NB + bins)
        at_least = tl.cumsum(h, axis=0, reverse=True)                           # keys with digit >= bin
        digit = tl.max(tl.where(at_least >= need, bins, -1), axis=0)            # bucket holding the K-th largest
        need -= tl.sum(tl.where(bins > digit, h, 0), axis=0)
        prefix |= digit << (BITS * (NPASS - 1 - p))
    return prefix, need


@triton.jit
def _radix_pass_kernel(key_ptr, ctx_ptr, hist_ptr, ge_ptr, out_ptr, s_kb, s_hb, s_gb, s_ob,
                       K: tl.constexpr, BUDGET: tl.constexpr, RATIO: tl.constexpr, RATIO_P: tl.constexpr,
                       PASS: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr, SHORT: tl.constexpr,
                       SHORT_TILE: tl.constexpr, SELECT_SHORT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                 # first: the keys and the earlier passes' histograms
    b = tl.program_id(0)
    tile = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    complete = ctx // RATIO
    if SELECT_SHORT:                   # the first pass launched: program 0 of a short row selects the whole row
        if (complete <= SHORT) & (tile == 0):
            _select_row(key_ptr + b.to(tl.int64) * s_kb, out_ptr + b.to(tl.int64) * s_ob, ctx,
                        hist_ptr + b.to(tl.int64) * s_hb, K, BUDGET, RATIO, RATIO_P, SHORT_TILE, BITS, PASS > 0)
    if (complete > K) & (complete > SHORT) & (tile * TILE < complete):         # else nothing to rank here
        NB: tl.constexpr = 1 << BITS
        NPASS: tl.constexpr = (32 + BITS - 1) // BITS
        SHIFT: tl.constexpr = BITS * (NPASS - 1 - PASS)
        GE_W: tl.constexpr = NB + 3                                             # a tile's ge counts, then 2 ranks
        hist = hist_ptr + b.to(tl.int64) * s_hb
        bins = tl.arange(0, NB)
        c = tile * TILE + tl.arange(0, TILE)
        inside = c < complete
        key = tl.load(key_ptr + b.to(tl.int64) * s_kb + c, mask=inside, other=0)
        ok = inside
        prefix = tl.zeros((), tl.int32)
        need = tl.zeros((), tl.int32) + K
        if PASS > 0:
            prefix, need = _radix_prefix(hist, K, PASS, BITS)
            ok = ok & ((key >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
        h = tl.histogram((key >> SHIFT) & (NB - 1), NB, mask=ok)
        # relaxed: read by the next launch, or by the last pass's ranking program after the ticket's release
        tl.atomic_add(hist + PASS * NB + bins, h, mask=h > 0, sem="relaxed")
        if PASS == NPASS - 1:
            # ge[d] = keys of this tile >= prefix | d, ge[NB] = keys above every such value: with the last digit d
            # of the K-th key, ge[d + 1] are the tile's keys above it and ge[d] - ge[d + 1] those equal to it.
            above = tl.sum((inside & ((key >> BITS) > (prefix >> BITS))).to(tl.int32), axis=0)
            ge_row = ge_ptr + b.to(tl.int64) * s_gb
            tl.store(ge_row + tile * GE_W + bins, above + tl.cumsum(h, axis=0, reverse=True))
            tl.store(ge_row + tile * GE_W + NB, above)
            # The row's last tile program to count itself in (the barrier orders every thread's stores and
            # histogram atomics before the one thread's acq_rel ticket) ranks the K-th key for the emit.
            tl.debug_barrier()
            ticket = tl.atomic_add(hist + NPASS * NB, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.cdiv(complete, TILE) - 1:
                _rank_tiles(hist, ge_row, prefix, need, tl.cdiv(complete, TILE), PASS, BITS, TILE)


@triton.jit
def _rank_tiles(hist, ge_row, prefix, need, tiles, PASS: tl.constexpr, BITS: tl.constexpr, CHUNK: tl.constexpr):
    """Once every tile of the row has counted its last pass (histogram and `ge`, read past the L1: other programs
    wrote them): the K-th largest key `thr` and how many keys equal to it to take, after the ticket in the
    histograms' last row, and for each tile the keys equal to `thr` and the blocks chosen in the tiles before it,
    after the tile's `ge` counts. The emit loads these 4 ints instead of recomputing them in every program."""
    NB: tl.constexpr = 1 << BITS
    GE_W: tl.constexpr = NB + 3
    bins = tl.arange(0, NB)
    h = tl.load(hist + PASS * NB + bins, cache_modifier=".cg")
    at_least = tl.cumsum(h, axis=0, reverse=True)                               # keys with digit >= bin
    digit = tl.max(tl.where(at_least >= need, bins, -1), axis=0)                # last digit of the K-th key
    take_eq = need - tl.sum(tl.where(bins > digit, h, 0), axis=0)
    thr = prefix | digit
    tl.store(hist + (PASS + 1) * NB + 1, thr)
    tl.store(hist + (PASS + 1) * NB + 2, take_eq)
    n_ge = tl.zeros((), tl.int32)
    n_gt = tl.zeros((), tl.int32)
    for t0 in range(0, tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        ge = ge_row + t * GE_W + digit
        g_ge = tl.load(ge, mask=t < tiles, other=0, cache_modifier=".cg")       # keys >= thr in tile t
        g_gt = tl.load(ge + 1, mask=t < tiles, other=0, cache_modifier=".cg")   # keys > thr in tile t
        ge_before = n_ge + tl.cumsum(g_ge, axis=0) - g_ge
        gt_before = n_gt + tl.cumsum(g_gt, axis=0) - g_gt
        eq_before = ge_before - gt_before
        rank = ge_row + t * GE_W + NB + 1
        tl.store(rank, eq_before, mask=t < tiles)
        tl.store(rank + 1, gt_before + tl.minimum(eq_before, take_eq), mask=t < tiles)     # the tile's first slot
        n_ge += tl.sum(g_ge, axis=0)
        n_gt += tl.sum(g_gt, axis=0)


@triton.jit
def _emit_kernel(key_ptr, ctx_ptr, hist_ptr, ge_ptr, out_ptr, s_kb, s_hb, s_gb, s_ob,
                 K: tl.constexpr, BUDGET: tl.constexpr, RATIO: tl.constexpr, RATIO_P: tl.constexpr,
                 BITS: tl.constexpr, TILE: tl.constexpr, SHORT: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_wait(PDL)                 # first: the last pass's histograms and counts
    b = tl.program_id(0)
    tile = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    complete = ctx // RATIO
    if complete > SHORT:                                                        # else the pass launch wrote it
        _emit_tile(key_ptr, hist_ptr, ge_ptr, out_ptr, s_kb, s_hb, s_gb, s_ob, b, tile, ctx, complete,
                   K, BUDGET, RATIO, RATIO_P, BITS, TILE)


@triton.jit
def _emit_tile(key_ptr, hist_ptr, ge_ptr, out_ptr, s_kb, s_hb, s_gb, s_ob, b, tile, ctx, complete,
               K: tl.constexpr, BUDGET: tl.constexpr, RATIO: tl.constexpr, RATIO_P: tl.constexpr,
               BITS: tl.constexpr, TILE: tl.constexpr):
    out = out_ptr + b.to(tl.int64) * s_ob
    t = tl.arange(0, RATIO_P)
    if tile == 0:                      # -1 over the unused block slots, then the tail (incomplete block) positions
        for j0 in range(tl.minimum(complete, K) * RATIO, BUDGET, TILE):
            j = j0 + tl.arange(0, TILE)
            tl.store(out + j, tl.full([TILE], -1, tl.int32), mask=j < BUDGET)
        tail = complete * RATIO + t
        tl.store(out + BUDGET + t, tl.where(tail < ctx, tail, -1).to(tl.int32), mask=t < RATIO - 1)
    if tile * TILE < complete:
        c = tile * TILE + tl.arange(0, TILE)
        ok = c < complete
        if complete <= K:                                                       # every complete block, in order
            sel = ok
            slot = c
        else:
            NB: tl.constexpr = 1 << BITS
            NPASS: tl.constexpr = (32 + BITS - 1) // BITS
            GE_W: tl.constexpr = NB + 3
            ranked = hist_ptr + b.to(tl.int64) * s_hb + NPASS * NB                  # from `_rank_tiles`
            thr = tl.load(ranked + 1)
            take_eq = tl.load(ranked + 2)
            rank = ge_ptr + b.to(tl.int64) * s_gb + tile * GE_W + NB + 1
            key = tl.load(key_ptr + b.to(tl.int64) * s_kb + c, mask=ok, other=-1)
            eq = ok & (key == thr)
            eq_rank = tl.load(rank) + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            sel = ok & ((key > thr) | (eq & (eq_rank < take_eq)))
            slot = tl.load(rank + 1) + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out + slot[:, None] * RATIO + t[None, :], (c[:, None] * RATIO + t[None, :]).to(tl.int32),
                 mask=(sel & (slot < K))[:, None] & (t[None, :] < RATIO))      # never past the row


# One program selects a whole row: radix passes over all of its keys in tiles of BLOCK, stopping early once a whole
# bucket is taken, then the emit. The first version's select (`one_program=True`, `_select_kernel`) and the short
# rows of the tiled path (`_radix_pass_kernel` with SELECT_SHORT; HIST0: pass 0's histogram is read from `hist0`,
# where the score kernel added it, instead of counted again).
@triton.jit
def _select_kernel(key_ptr, ctx_ptr, out_ptr, s_kb, s_ob,
                   K: tl.constexpr, BUDGET: tl.constexpr, RATIO: tl.constexpr, RATIO_P: tl.constexpr,
                   BLOCK: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)                 # first: the score kernel's keys
    b = tl.program_id(0)
    _select_row(key_ptr + b.to(tl.int64) * s_kb, out_ptr + b.to(tl.int64) * s_ob, tl.load(ctx_ptr + b), key_ptr,
                K, BUDGET, RATIO, RATIO_P, BLOCK, BITS, False)


@triton.jit
def _select_row(keys_in, out, ctx, hist0, K: tl.constexpr, BUDGET: tl.constexpr, RATIO: tl.constexpr,
                RATIO_P: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, HIST0: tl.constexpr):
    complete = ctx // RATIO
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
        if HIST0 and p == 0:
            hist = tl.load(hist0 + bins)
        else:
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


def radix_passes(bits: int) -> int:
    """Radix passes over a 32-bit key, `bits` a pass (the top digit may be narrower)."""
    return -(-32 // bits)


def score_programs(n_blocks: int, block_c: int, batch: int, device: torch.device) -> int:
    """Score programs per sequence: SCORE_PROGRAMS_PER_SM per SM shared by the batch, no more than the table has
    tiles (a host-side shape: the context is only known on the device, programs past it return at once)."""
    return max(1, min(triton.cdiv(n_blocks, block_c), triton.cdiv(SCORE_PROGRAMS_PER_SM * sm_count(device, cpu=1), batch)))


def qsa_scores_keys(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, ratio: int, block_c: int | None = None,
                    out: torch.Tensor | None = None, hist: torch.Tensor | None = None,
                    programs: int | None = None) -> torch.Tensor:
    """[B, max_blocks * block_size // ratio] int32 ranking keys (float bits of the score, see the module docstring);
    only the first `context_len // ratio` entries of a row are written (`out`, if given, shows which: tests). With
    `hist` ([B, >= 1, 2^RADIX_BITS] int32, zeroed) the histogram of the keys' top radix digit is added to hist[:, 0]."""
    B, n_idx, d_idx = q_idx.shape
    assert q_idx.stride(-1) == 1 and pooled.stride(-1) == 1 and pooled.shape[1] == d_idx
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and block_size % ratio == 0
    n_blocks = block_tables.shape[1] * block_size // ratio
    keys = torch.empty((B, n_blocks), dtype=torch.int32, device=q_idx.device) if out is None else out
    assert keys.shape == (B, n_blocks) and keys.dtype == torch.int32 and keys.stride(-1) == 1
    if hist is not None:
        assert hist.dtype == torch.int32 and hist.shape[0] == B and hist.shape[-1] == 1 << RADIX_BITS
    block_c = block_c or SCORE_BLOCK
    programs = programs or score_programs(n_blocks, block_c, B, q_idx.device)
    pdl = pdl_usable(q_idx)
    _score_kernel[(B, programs)](
        q_idx, pooled, block_tables, context_lens, keys, keys if hist is None else hist, math.sqrt(d_idx),
        q_idx.stride(0), q_idx.stride(1), pooled.stride(0), block_tables.stride(0), keys.stride(0),
        0 if hist is None else hist.stride(0),
        N_IDX=n_idx, D_IDX=d_idx, PAGE=block_size, RATIO=ratio,
        BLOCK_H=max(16, triton.next_power_of_2(n_idx)), BLOCK_D=max(16, triton.next_power_of_2(d_idx)),
        BLOCK_C=block_c, PROGRAMS=programs, DOT_F32=_INTERPRET or q_idx.dtype == torch.float32
        or pooled.dtype == torch.float32 or q_idx.dtype != pooled.dtype, HIST=hist is not None, BITS=RADIX_BITS,
        num_warps=4, PDL=pdl, launch_pdl=pdl)
    return keys


def new_histograms(batch: int, device: torch.device) -> torch.Tensor:
    """Zeroed radix histograms [B, passes + 1, 2^RADIX_BITS] int32 for `qsa_scores_keys` and `select_from_keys`:
    a row's last-pass ticket and the K-th key's rank (`_rank_tiles`) follow its histograms, so the one memset zeroes
    the ticket as well, each call and each graph replay."""
    return empty_histograms(batch, device).zero_()


def empty_histograms(batch: int, device: torch.device) -> torch.Tensor:
    """`new_histograms` not yet zeroed: for a kernel earlier in the step to zero (`qsa_pool_update(zero=)`)."""
    return torch.empty((batch, radix_passes(RADIX_BITS) + 1, 1 << RADIX_BITS), dtype=torch.int32, device=device)


def select_from_keys(keys: torch.Tensor, context_lens: torch.Tensor, ratio: int, budget: int,
                     hist: torch.Tensor | None = None, one_program: bool = False,
                     short_blocks: int | None = None) -> torch.Tensor:
    """keys [B, >= max complete] int32, >= 0 (only the first `context_len // ratio` of a row are read) -> selected
    [B, budget + ratio - 1] int32: the blocks of the budget // ratio largest keys (equal keys: lower block first),
    in ascending order, expanded to positions, then the tail. `hist`: from `new_histograms`, pass 0 already added
    (by the score kernel); None runs pass 0 here. `short_blocks` (default SHORT_BLOCKS; 0: off): rows with at most
    that many complete blocks are selected whole by one program of the first pass launch. Separate from the scores
    so tests can plant keys."""
    assert keys.dtype == torch.int32 and keys.stride(-1) == 1 and budget % ratio == 0
    B, n_blocks = keys.shape
    k = budget // ratio
    out = torch.empty((B, budget + ratio - 1), dtype=torch.int32, device=keys.device)
    ratio_p = triton.next_power_of_2(ratio)
    pdl = pdl_usable(keys)
    if one_program:
        _select_kernel[(B,)](
            keys, context_lens, out, keys.stride(0), out.stride(0),
            K=k, BUDGET=budget, RATIO=ratio, RATIO_P=ratio_p, BLOCK=2048, BITS=8, num_warps=8, PDL=pdl,
            launch_pdl=pdl)
        return out
    bits, tile = RADIX_BITS, SELECT_TILE
    short = SHORT_BLOCKS if short_blocks is None else short_blocks
    short = min(short, n_blocks) if short > 0 else -1           # -1: no row is short (every complete count >= 0)
    short_tile = min(SHORT_TILE, triton.next_power_of_2(max(short, 1)))
    tiles = triton.cdiv(n_blocks, tile)
    first = 0 if hist is None else 1
    hist = new_histograms(B, keys.device) if hist is None else hist
    assert hist.shape == (B, radix_passes(bits) + 1, 1 << bits) and hist.dtype == torch.int32
    ge = torch.empty((B, tiles, (1 << bits) + 3), dtype=torch.int32, device=keys.device)     # counts, 2 ranks
    for p in range(first, radix_passes(bits)):
        _radix_pass_kernel[(B, tiles)](
            keys, context_lens, hist, ge, out, keys.stride(0), hist.stride(0), ge.stride(0), out.stride(0),
            K=k, BUDGET=budget, RATIO=ratio, RATIO_P=ratio_p, PASS=p, BITS=bits, TILE=tile, SHORT=short,
            SHORT_TILE=short_tile, SELECT_SHORT=p == first and short >= 0, num_warps=4, PDL=pdl, launch_pdl=pdl)
    _emit_kernel[(B, tiles)](
        keys, context_lens, hist, ge, out, keys.stride(0), hist.stride(0), ge.stride(0), out.stride(0),
        K=k, BUDGET=budget, RATIO=ratio, RATIO_P=ratio_p, BITS=bits, TILE=tile,
        SHORT=short, num_warps=4, PDL=pdl, launch_pdl=pdl)
    return out


def qsa_select(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               block_size: int, ratio: int, budget: int, *, block_c: int | None = None,
               one_program: bool = False, short_blocks: int | None = None,
               hist: torch.Tensor | None = None) -> torch.Tensor:
    """q_idx [B, n_idx, d_idx] of each sequence's new token; pooled [rows // ratio, d_idx] (already holding the block
    the new token completed); block_tables [B, max_blocks] int32; context_lens [B] int32 with the new token.
    Returns selected [B, budget + ratio - 1] int32: chosen blocks' tokens (ascending block order), then the tail;
    -1 pad. Equals `qsa_select_ref`. `one_program`: the first version, for timing (module docstring);
    `short_blocks`: see `select_from_keys` (0: the tiled passes for every row, for timing); `hist`: zeroed
    histograms (`new_histograms`, or `empty_histograms` an earlier kernel of the step zeroed), else made here."""
    assert budget % ratio == 0
    if one_program:
        n_blocks = block_tables.shape[1] * block_size // ratio
        programs = min(ONE_PROGRAM_SCORE_PROGRAMS, triton.cdiv(n_blocks, block_c or SCORE_BLOCK))
        keys = qsa_scores_keys(q_idx, pooled, block_tables, context_lens, block_size, ratio, block_c,
                               programs=programs)
        return select_from_keys(keys, context_lens, ratio, budget, one_program=True)
    hist = new_histograms(q_idx.shape[0], q_idx.device) if hist is None else hist
    keys = qsa_scores_keys(q_idx, pooled, block_tables, context_lens, block_size, ratio, block_c, hist=hist)
    return select_from_keys(keys, context_lens, ratio, budget, hist=hist, short_blocks=short_blocks)
