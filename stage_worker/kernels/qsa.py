"""QSA block selection for decode on the GPU: score kernel, `torch.topk` on order-preserving keys, expand kernel.

Why: the selection decides which `budget + ratio - 1` K/V rows a decode step reads, a bounded number whatever the
context length (001 §1); it has to run on the device, batched, with no host sync, so that the attention launch can
follow it directly.

Structure (three launches, shapes from tensor sizes only):
1. `_score_kernel`, grid (B, cdiv(max_blocks_c, BLOCK_C)): a tile of BLOCK_C compression blocks of one sequence,
   their pooled keys gathered through the block table, scored against all indexer heads with one fp32 `tl.dot`
   (heads padded to 16), `sum_h relu(.) / sqrt(d)`. It writes an int64 key per block, `(order-preserving bits of
   the score) << 32 | (n - 1 - block)`: larger key = higher score, then lower block index. Blocks that are not
   complete get the key of -inf.
2. `torch.topk` over those keys. The keys are distinct, so the result does not depend on how topk orders equal
   values (it does not specify that): ties go to the lower block index, as `stable_topk_mask` does.
3. `_expand_kernel`, grid (B,): chosen blocks -> token positions, plus the tail (same layout as `qsa_ref`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _score_kernel(q_ptr, pooled_ptr, tables_ptr, ctx_ptr, key_ptr, n_blocks, sqrt_d,
                  s_qb, s_qh, s_pr, s_tb, s_kb,
                  N_IDX: tl.constexpr, D_IDX: tl.constexpr, PAGE: tl.constexpr, RATIO: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    complete = tl.load(ctx_ptr + b) // RATIO
    ok = c < complete
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D_IDX
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + offs_h[:, None] * s_qh + offs_d[None, :],
                mask=(offs_h[:, None] < N_IDX) & d_ok[None, :], other=0.0).to(tl.float32)
    start = tl.where(ok, c * RATIO, 0)
    page = tl.load(tables_ptr + b.to(tl.int64) * s_tb + start // PAGE, mask=ok, other=0)
    row = page.to(tl.int64) * (PAGE // RATIO) + (start % PAGE) // RATIO
    keys = tl.load(pooled_ptr + row[:, None] * s_pr + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                   other=0.0).to(tl.float32)
    s = tl.dot(keys, tl.trans(q), input_precision="ieee")                       # [BLOCK_C, BLOCK_H]; pad heads: 0
    score = tl.sum(tl.maximum(s, 0.0), axis=1) / sqrt_d
    score = tl.where(score == 0.0, 0.0, score)                                  # -0.0 ties +0.0, as in the sort
    score = tl.where(ok, score, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                         # int order == float order
    key = (bits.to(tl.int64) << 32) + (n_blocks - 1 - c).to(tl.int64)
    tl.store(key_ptr + b.to(tl.int64) * s_kb + c, key, mask=c < n_blocks)


@triton.jit
def _expand_kernel(idx_ptr, ctx_ptr, out_ptr, k_sel, s_ib, s_ob,
                   BUDGET: tl.constexpr, RATIO: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    ctx = tl.load(ctx_ptr + b)
    complete = ctx // RATIO
    slot = j // RATIO
    in_blocks = j < BUDGET
    blk = tl.load(idx_ptr + b.to(tl.int64) * s_ib + slot, mask=in_blocks & (slot < k_sel), other=-1)
    from_block = tl.where((blk >= 0) & (blk < complete), blk * RATIO + j % RATIO, -1)
    tail = complete * RATIO + (j - BUDGET)
    from_tail = tl.where(tail < ctx, tail, -1)
    pos = tl.where(in_blocks, from_block, from_tail)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + j, pos.to(tl.int32), mask=j < BUDGET + RATIO - 1)


def qsa_scores_keys(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, block_size: int, ratio: int,
                    block_c: int | None = None) -> torch.Tensor:
    """[B, max_blocks * block_size // ratio] int64 ranking keys (see the module docstring)."""
    B, n_idx, d_idx = q_idx.shape
    assert q_idx.stride(-1) == 1 and pooled.stride(-1) == 1 and pooled.shape[1] == d_idx
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and block_size % ratio == 0
    n_blocks = block_tables.shape[1] * block_size // ratio
    keys = torch.empty((B, n_blocks), dtype=torch.int64, device=q_idx.device)
    block_c = block_c or 64
    _score_kernel[(B, triton.cdiv(n_blocks, block_c))](
        q_idx, pooled, block_tables, context_lens, keys, n_blocks, math.sqrt(d_idx),
        q_idx.stride(0), q_idx.stride(1), pooled.stride(0), block_tables.stride(0), keys.stride(0),
        N_IDX=n_idx, D_IDX=d_idx, PAGE=block_size, RATIO=ratio,
        BLOCK_H=max(16, triton.next_power_of_2(n_idx)), BLOCK_D=max(16, triton.next_power_of_2(d_idx)),
        BLOCK_C=block_c, num_warps=4)
    return keys


def qsa_select(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               block_size: int, ratio: int, budget: int, *, block_c: int | None = None) -> torch.Tensor:
    """q_idx [B, n_idx, d_idx] of each sequence's new token; pooled [rows // ratio, d_idx] (already holding the block
    the new token completed); block_tables [B, max_blocks] int32; context_lens [B] int32 with the new token.
    Returns selected [B, budget + ratio - 1] int32: chosen blocks' tokens (best block first), then the tail; -1 pad."""
    assert budget % ratio == 0
    keys = qsa_scores_keys(q_idx, pooled, block_tables, context_lens, block_size, ratio, block_c)
    k = min(budget // ratio, keys.shape[1])
    chosen = torch.topk(keys, k, dim=1, sorted=True).indices                   # distinct keys: deterministic
    width = budget + ratio - 1
    out = torch.empty((q_idx.shape[0], width), dtype=torch.int32, device=q_idx.device)
    _expand_kernel[(q_idx.shape[0],)](
        chosen, context_lens, out, k, chosen.stride(0), out.stride(0),
        BUDGET=budget, RATIO=ratio, BLOCK=triton.next_power_of_2(width), num_warps=4)
    return out
