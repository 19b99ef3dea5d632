"""QSA prefill over K/V in host RAM with the loops swapped (001 §5.3): the context is staged section by section,
every query of the chunk attends to the section at once, and one running (max, norm, acc) per query head is merged
across sections.

Why: with `qsa_kv_offload` the K/V rows live in host RAM. Gathering each query's selected rows (`GatedAttention.
_attend_selected`) moves queries x selected rows over PCIe (a 512-token chunk at the full shape: 512 x 2,051 rows
of 1 KiB each for K and again for V, per layer); staging the context once per chunk moves context-length rows,
whatever the chunk size. The first version in the reports kept every section's partial softmax and grew with the
context until the card ran out (001 §5.3); here only one (max, norm, acc) set is held, so peak memory depends on the
chunk and the section size, never on the context length.

Masks: a query reads exactly its `QSAIndexer.selected_positions` (chosen blocks plus the tail), as the gather path
does; within a section that is a [queries, section] mask scattered from those lists. Softmax in fp32 (exp, log2
free: a plain running max), products against V in fp32, one rounding to the activations' dtype at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stage_worker.model.cache import read_rows

# Elements of one section's scores ([queries, heads, section] fp32): 2^25 is 128 MB, 4,096 context rows for a
# 512-token chunk of 16 heads. Larger sections mean fewer launches per chunk; the peak is a few times this (scores,
# probabilities) plus the staged rows (4 MB at the full shape).
SECTION_SCORES = 1 << 25
MIN_SECTION = 256


def section_rows(queries: int, heads: int) -> int:
    """Context rows staged per section for a chunk of `queries` tokens over `heads` query heads."""
    return max(MIN_SECTION, SECTION_SCORES // max(queries * heads, 1))


def attend_sections(q: torch.Tensor, key_pos: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                    section: int | None = None, union_ratio: int = 0) -> torch.Tensor:
    """q [Q, H, d]; key_pos/valid [Q, K] (each query's keys, `QSAIndexer.selected_positions`); rows [ctx] the
    sequence's flat cache rows; caches [R, kv_heads, d] in either tier. Returns [Q, H, d] in q's dtype: attention
    of each query over exactly its listed keys. `section` overrides `section_rows` (tests). `union_ratio` (the
    compression ratio): stage only the union of the chunk's listed blocks, compacted, the key lists remapped to it
    (`union_plan`; the reference of the fused kernel's `union`)."""
    if union_ratio:
        plan = union_plan(block_bits(key_pos, valid, union_ratio, -(-rows.shape[0] // union_ratio)),
                          union_ratio, rows.shape[0])
        rows = compact_rows(rows, plan, union_ratio)
        key_pos = compact_positions(torch.where(valid, key_pos, 0), plan, union_ratio)    # unlisted: masked below
    Q, H, d = q.shape
    kvh = k_cache.shape[1]
    rep = H // kvh
    ctx = rows.shape[0]
    section = section or section_rows(Q, H)
    qg = q.view(Q, kvh, rep, d)
    kp = torch.where(valid, key_pos, -1)
    m = torch.full((Q, kvh, rep), float("-inf"), dtype=torch.float32, device=q.device)
    norm = torch.zeros((Q, kvh, rep), dtype=torch.float32, device=q.device)
    acc = torch.zeros((Q, kvh, rep, d), dtype=torch.float32, device=q.device)
    for a in range(0, ctx, section):
        b = min(a + section, ctx)
        k = read_rows(k_cache, rows[a:b]).to(q.dtype)                       # the section, staged once
        v = read_rows(v_cache, rows[a:b]).float()
        local = torch.where((kp >= a) & (kp < b), kp - a, b - a)            # out of section -> spare column
        mask = torch.zeros((Q, b - a + 1), dtype=torch.bool, device=q.device).scatter_(1, local, True)[:, : b - a]
        scores = torch.einsum("lgrd,kgd->lgrk", qg, k).float()              # in place from here: one fp32 copy
        scores.mul_(scale).masked_fill_(~mask[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_use = torch.where(m_new == float("-inf"), 0.0, m_new)             # no visible key yet: nothing to scale
        alpha = torch.exp(m - m_use)
        p = scores.sub_(m_use[..., None]).exp_()
        norm = norm * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("lgrk,kgd->lgrd", p, v)
        m = m_new
    return (acc / norm[..., None]).reshape(Q, H, d).to(q.dtype)


def block_bits(key_pos: torch.Tensor, valid: torch.Tensor, ratio: int, n_blocks: int) -> torch.Tensor:
    """[Q, ceil(n_blocks / 32)] int32: bit b % 32 of word b // 32 is set iff one of the query's listed keys lies in
    compression block b. The selection in the form the fused kernel reads (`kernels/section_attention.py`).

    Why a bit per block and not the key lists: `QSAIndexer.selected_positions` lists whole complete blocks (all
    before the query) plus the query's own incomplete block up to the query, so "block bit set and key <= query"
    names exactly the listed keys, and a tile of keys tests it with one word per query (the lists would need a
    search per key). Q/8 bytes per compression block: 4 MiB for a 512-token chunk at 262k tokens, less than the
    lists themselves (8 MiB). The caller passes query slices, so the [Q, blocks] scratch stays small."""
    q = key_pos.shape[0]
    words = (n_blocks + 31) // 32
    blocks = torch.where(valid, key_pos // ratio, words * 32)               # unlisted -> the spare column
    hit = torch.zeros((q, words * 32 + 1), dtype=torch.bool, device=key_pos.device)
    hit = hit.scatter_(1, blocks, True)[:, : words * 32].reshape(q, words, 4, 8)
    shifts = torch.arange(8, device=key_pos.device, dtype=torch.uint8)
    packed = (hit.view(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)   # [Q, words, 4] bytes, low byte first
    return packed.view(torch.int32).reshape(q, words)                      # (little-endian, as every GPU host)


class UnionPlan(NamedTuple):
    """The union of a chunk's selected compression blocks, compacted: `blocks` [U] int32 the original block ids
    ascending (compacted block i holds context positions blocks[i] * ratio + 0..ratio-1 at arena rows i * ratio +
    0..ratio-1); `prefix` [n_blocks] int32 the inclusive count of union blocks up to each original block (so block
    b, if in the union, is compacted block prefix[b] - 1); `keys` = U * ratio, the rows staged."""
    blocks: torch.Tensor
    prefix: torch.Tensor
    keys: int


def union_bits(bits: torch.Tensor) -> torch.Tensor:
    """[Q, words] int32 -> [words]: the OR over the queries, in log2(Q) halving steps on the device (PyTorch has no
    bitwise-or reduction)."""
    x = bits
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = torch.cat([x[:h] | x[h: 2 * h], x[2 * h:]])
    return x[0] if x.shape[0] else torch.zeros(bits.shape[1], dtype=bits.dtype, device=bits.device)


def union_plan(bits: torch.Tensor, ratio: int, ctx: int) -> UnionPlan:
    """The union of the queries' selected blocks (`block_bits` rows) over a `ctx`-token context as a `UnionPlan`.

    What the union holds: every block some query lists, which is each query's `block_topk` chosen complete blocks
    and its own incomplete block (the tail `selected_positions` always adds, up to the query; a chunk's tails are
    its own ~Q / ratio blocks). All on the device (an OR, an unpack, a prefix sum, a scatter) but one host read:
    the union's size, which sizes the arena and the number of section launches. Prefill is eager, so the read
    only waits for the selection already queued (a few us of launch slack, tests/test_kernel_section_attention.py
    measures the plan on the CPU); a captured variant would launch ctx / section sections that read the size from
    the device and exit early instead."""
    n_blocks = -(-ctx // ratio)
    dev = bits.device
    words = union_bits(bits.to(torch.int32))
    b = torch.arange(n_blocks, device=dev)
    used = ((words[b >> 5] >> (b & 31)) & 1).bool()
    prefix = used.cumsum(0, dtype=torch.int32)
    u = int(prefix[-1]) if n_blocks else 0                                   # the one host read
    slot = torch.where(used, prefix.long() - 1, u)                          # not in the union -> the spare slot
    blocks = torch.zeros(u + 1, dtype=torch.int32, device=dev).scatter_(0, slot, b.int())[:u]
    return UnionPlan(blocks, prefix, u * ratio)


def compact_rows(rows: torch.Tensor, plan: UnionPlan, ratio: int) -> torch.Tensor:
    """[plan.keys] the flat cache rows of the compacted arena, in order. The last block of a context that is not a
    multiple of the ratio runs past the context: those arena rows repeat the last row, and no query sees them (their
    original positions are >= ctx > every query's position)."""
    ctx = rows.shape[0]
    pos = (plan.blocks.long()[:, None] * ratio + torch.arange(ratio, device=rows.device)).flatten()
    return rows[pos.clamp_(max=ctx - 1)]


def compact_positions(key_pos: torch.Tensor, plan: UnionPlan, ratio: int) -> torch.Tensor:
    """Context positions (in union blocks) -> their arena rows: (prefix[block] - 1) * ratio + position % ratio."""
    return (plan.prefix[key_pos // ratio].long() - 1) * ratio + key_pos % ratio
