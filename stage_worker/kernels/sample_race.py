"""The sampling race of `batch_sampler._draw` in one Triton launch (two for long rows); reference: `sample_race_ref.py`.

Why: the PyTorch race is ~45 elementwise launches a step (the 32-bit hash of `uniforms` alone is ~25: every and,
xor, shift and multiply a kernel over [B, V]), then log, divide, argmax, the validity check and the write-back.
At one stream the served step is host-bound and these launches sit between two decode steps
(bench/results/h200-15/call6/profile_fs).

A program takes one row's run of candidates in blocks: for candidate j (token id ids[r, j], or j) it hashes
(key_r, token id) to U exactly as `uniforms` does (uint32 arithmetic: the reference's int64 products masked to 32
bits are the same residues), scores it and keeps the first maximal score and its column (torch.argmax's rule).
- probability mode: score = p / -log(U), the reference's float32 ops; ok = every p finite and their sum > 0.
  Measured on the H200 over all 2**24 values of U: tl.log equals torch.log bit for bit; `div_rn` equalled torch's
  division in all but 1 of 16.7M quotients, plain `/` (approximate on NVIDIA) differed in 4.8M.
- logit mode (`temperature`): plain temperature sampling without the softmax. x = logit / temperature (IEEE), then
  Gumbel-max: argmax(x - log(-log U)) = argmax(softmax(x) / E); the scores are taken relative to the run's largest
  x, so the log term keeps its precision whatever the logits' magnitude. The token equals the reference's (softmax,
  normalise, race) but where two scores agree to float rounding. ok = no NaN, no +inf and some x > -inf (what
  makes the reference's softmax finite).
A row not ok writes nothing: `out` (the caller's greedy argmax) keeps its token.

Long rows (a whole vocabulary, 152k-248k tokens, with few rows) are cut into splits so more than B SMs work: each
split writes (best score, its column, its sum or largest x, a bad flag) and `_reduce_kernel` picks the winner
(earlier split on a tie). One split, the kernel writes the token itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stage_worker.kernels.common import INTERPRET as _INTERPRET
from stage_worker.kernels.common import fix_interpreter_loop_bounds, sm_count

if _INTERPRET:
    fix_interpreter_loop_bounds()     # the split loop's bounds are run-time values

_NO_INDEX = tl.constexpr(2 ** 31 - 1)   # a column past any row: the "not here" of the first-max search


@triton.jit
def _mix32(x):
    """`sample_race_ref.mix32` on uint32 (products wrap mod 2**32: the reference's masked int64 products)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, tok):
    """`sample_race_ref.uniforms` of uint32 `key` (a scalar) and uint32 token ids."""
    h = _mix32(key ^ (tok * 0x9E3779B1))
    h = _mix32(h ^ (key >> 7))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _race_kernel(vals_ptr, ids_ptr, keys_ptr, temp_ptr, rows_ptr, out_ptr, part_ptr, K, chunk,
                 s_v, s_i, s_k, s_t, HAS_IDS: tl.constexpr, HAS_ROWS: tl.constexpr, GATHER: tl.constexpr,
                 LOGITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    else:
        row = r
    if GATHER:
        src = row
    else:
        src = r
    key = tl.load(keys_ptr + src * s_k).to(tl.int64).to(tl.uint32)   # int64, or float64 holding it
    start = split * chunk
    end = tl.minimum(start + chunk, K)
    v_row = vals_ptr + src * s_v
    i_row = ids_ptr + src * s_i
    lanes = tl.arange(0, BLOCK)

    bad = tl.zeros([BLOCK], tl.int32)
    if LOGITS:
        t = tl.load(temp_ptr + src * s_t).to(tl.float32)
        hi = tl.full([BLOCK], float("-inf"), tl.float32)
        for k0 in range(start, end, BLOCK):          # pass 1: the run's largest x (and NaN / +inf)
            offs = k0 + lanes
            x = tl.math.div_rn(tl.load(v_row + offs, mask=offs < end, other=float("-inf")).to(tl.float32), t)
            bad = tl.maximum(bad, ((x != x) | (x == float("inf"))).to(tl.int32))
            hi = tl.maximum(hi, x)
        aux = tl.max(hi, axis=0)
        shift = tl.where(aux > float("-inf"), aux, 0.0)   # an all -inf run: no -inf - -inf
    else:
        tot = tl.zeros([BLOCK], tl.float32)

    best = tl.full([], float("-inf"), tl.float32)
    best_j = tl.full([], 0, tl.int32)
    for k0 in range(start, end, BLOCK):
        offs = k0 + lanes
        m = offs < end
        if HAS_IDS:
            tok = tl.load(i_row + offs, mask=m, other=0).to(tl.uint32)
        else:
            tok = offs.to(tl.uint32)
        e = -tl.log(_uniform(key, tok))
        if LOGITS:
            x = tl.math.div_rn(tl.load(v_row + offs, mask=m, other=float("-inf")).to(tl.float32), t)
            s = tl.where(x == float("-inf"), float("-inf"), (x - shift) - tl.log(e))
        else:
            p = tl.load(v_row + offs, mask=m, other=0.0).to(tl.float32)
            bad = tl.maximum(bad, ((p != p) | (tl.abs(p) == float("inf"))).to(tl.int32))
            tot += p
            s = tl.math.div_rn(p, e)
        s = tl.where(m, s, float("-inf"))
        top = tl.max(s, axis=0)
        j = tl.min(tl.where(s == top, offs, _NO_INDEX), axis=0)
        take = top > best                            # strict: an earlier block keeps a tie
        best_j = tl.where(take, j, best_j)
        best = tl.where(take, top, best)
    if not LOGITS:
        aux = tl.sum(tot, axis=0)
    any_bad = tl.max(bad, axis=0)

    if SPLIT:
        p_row = part_ptr + (r * tl.num_programs(1) + split) * 4
        tl.store(p_row, best)
        tl.store(p_row + 1, best_j.to(tl.float32))        # < 2**24: exact
        tl.store(p_row + 2, aux)
        tl.store(p_row + 3, any_bad.to(tl.float32))
    else:
        if LOGITS:
            ok = (any_bad == 0) & (aux > float("-inf"))
        else:
            ok = (any_bad == 0) & (aux > 0.0)
        best_j = tl.minimum(tl.maximum(best_j, 0), K - 1)
        if HAS_IDS:
            tok = tl.load(i_row + best_j, mask=ok, other=0).to(tl.int64)
        else:
            tok = best_j.to(tl.int64)
        tl.store(out_ptr + row, tok, mask=ok)


@triton.jit
def _reduce_kernel(part_ptr, ids_ptr, rows_ptr, out_ptr, S, K, s_i, HAS_IDS: tl.constexpr,
                   HAS_ROWS: tl.constexpr, GATHER: tl.constexpr, LOGITS: tl.constexpr, BLOCK_S: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    else:
        row = r
    if GATHER:
        src = row
    else:
        src = r
    offs = tl.arange(0, BLOCK_S)
    m = offs < S
    p_row = part_ptr + (r * S + offs) * 4
    best = tl.load(p_row, mask=m, other=float("-inf"))
    col = tl.load(p_row + 1, mask=m, other=0.0).to(tl.int32)
    any_bad = tl.max(tl.load(p_row + 3, mask=m, other=0.0), axis=0)
    if LOGITS:
        hi = tl.load(p_row + 2, mask=m, other=float("-inf"))
        top_x = tl.max(hi, axis=0)
        ok = (any_bad == 0.0) & (top_x > float("-inf"))
        shift = tl.where(top_x > float("-inf"), top_x, 0.0)
        best = tl.where(best == float("-inf"), float("-inf"), best + (hi - shift))   # relative to the row's max
    else:
        total = tl.sum(tl.load(p_row + 2, mask=m, other=0.0), axis=0)
        ok = (any_bad == 0.0) & (total > 0.0)
    top = tl.max(best, axis=0)
    j = tl.min(tl.where(m & (best == top), col, _NO_INDEX), axis=0)
    j = tl.minimum(tl.maximum(j, 0), K - 1)
    if HAS_IDS:
        tok = tl.load(ids_ptr + src * s_i + j, mask=ok, other=0).to(tl.int64)
    else:
        tok = j.to(tl.int64)
    tl.store(out_ptr + row, tok, mask=ok)


MIN_SPLIT = 4096     # candidates a split takes at least: shorter rows (top-k candidates) are one launch


def choose_splits(rows: int, k: int, device: torch.device) -> int:
    """About two programs per SM, no split under MIN_SPLIT candidates."""
    return max(1, min(triton.cdiv(2 * sm_count(device, cpu=1), max(rows, 1)), triton.cdiv(k, MIN_SPLIT), 256))


def sample_race(out: torch.Tensor, vals: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None, *,
                temperature: torch.Tensor | None = None, rows: torch.Tensor | None = None, gather: bool = False,
                splits: int | None = None, block: int | None = None) -> torch.Tensor:
    """`sample_race_ref.sample_race` in one or two launches: each raced row writes its token into `out` [B] int64
    where it is ok. vals [R, K] (or [B, K] with `gather`): probabilities, or adjusted logits with `temperature`
    (float32 or float64, [R] / [R, 1] or whole-batch with `gather`, any row stride); keys [R] int64 or float64 (row
    keys < 2**32, any stride); ids [R, K] or None; rows [R] int64 or None. `splits` / `block` override the
    heuristics (tests, timing)."""
    if ids is not None and gather:
        raise ValueError("gather reads whole-batch rows: no ids")
    if out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError("out: a contiguous int64 tensor")
    R = rows.numel() if rows is not None else vals.shape[0]
    K = vals.shape[-1]
    if R == 0 or K == 0:
        return out
    if vals.stride(-1) != 1:
        vals = vals.contiguous()
    if ids is not None and ids.stride(-1) != 1:
        ids = ids.contiguous()
    if rows is not None:
        rows = rows.contiguous()
    if block is None:
        block = min(1024, triton.next_power_of_2(K))
    S = splits or choose_splits(R, K, vals.device)
    chunk = triton.cdiv(triton.cdiv(K, S), block) * block
    S = triton.cdiv(K, chunk)                              # no empty split
    part = torch.empty(R, S, 4, dtype=torch.float32, device=vals.device) if S > 1 else out
    flags = dict(HAS_IDS=ids is not None, HAS_ROWS=rows is not None, GATHER=gather and rows is not None,
                 LOGITS=temperature is not None)
    dummy = out
    _race_kernel[(R, S)](vals, ids if ids is not None else dummy, keys,
                         temperature if temperature is not None else vals, rows if rows is not None else dummy,
                         out, part, K, chunk, vals.stride(0), ids.stride(0) if ids is not None else 0,
                         keys.stride(0), temperature.stride(0) if temperature is not None else 0,
                         SPLIT=S > 1, BLOCK=block, num_warps=4 if block <= 512 else 8, **flags)
    if S > 1:
        _reduce_kernel[(R,)](part, ids if ids is not None else dummy, rows if rows is not None else dummy,
                             out, S, K, ids.stride(0) if ids is not None else 0,
                             BLOCK_S=triton.next_power_of_2(S), num_warps=1, **flags)
    return out
