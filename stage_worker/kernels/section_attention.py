"""QSA prefill over staged K/V sections in one Triton launch a section: the loops swapped (001 §5.3), fused.

Why: `model/section_attention.attend_sections` (the PyTorch loop, this kernel's reference) is ~15 launches a section
and materialises the section's fp32 scores; the H200 measured one full-shape QSA layer's 512-token chunk at 123 ms
at 262k tokens over host K/V against 29 ms in VRAM (docs/performance.md, issue 18). Here each section is one launch
that reads the chunk's queries, the section's staged K/V rows and the selection bits, and updates one running
(max, norm, acc) per query head in place, flash-attention style; the scores never leave registers.

Layout: grid (cdiv(Q * rep, BLOCK_M), kv_heads). A program's rows are (query, head) pairs of one GQA group, query
major, so a tile holds the `rep` heads of ~BLOCK_M / rep neighbouring queries: they share the K/V tile, and few
queries a tile means their selections rarely cover a tile of keys, which is then skipped before K/V are loaded.
Visibility of key j for a query at position p: bit (j // ratio) of the query's `block_bits` and j <= p (the bits'
docstring says why that is exactly the listed keys). The running max is kept in log2 units (exp2); the state is
kernel-private: the caller only divides acc by norm at the end.

Staging: the context's rows are gathered into reused device buffers of `SECTION_ROWS` rows (`kv_rows.gather_rows`
over UVA for host rows); on a GPU the next section's gather runs on a side stream, double-buffered, while this
section's launch runs. Memory: two buffers of K and V (32 MiB at the full shape) and the state (12 MiB for 512
queries x 24 heads of 256): nothing grows with the context but the bits (Q/8 bytes a compression block).
Union staging (`union`, kernel flag `section_union`): only the union of the queries' selected blocks is staged,
compacted (`model/section_attention.union_plan`); the kernel reads arena row c as context position
blocks[c // RATIO] * RATIO + c % RATIO, so the bits stay as they are and PCIe bytes scale with the union.
Tests: tests/test_kernel_section_attention.py (CPU under TRITON_INTERPRET=1 against the loop; GPU at full shape).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from stage_worker.kernels.common import INTERPRET as _INTERPRET
from stage_worker.kernels.decode_attention import _dot

# Rows staged per section: 8 MiB of K and of V at the full shape (2 KV heads of 256, bf16), so 32 launches at 262k
# tokens; the PyTorch loop sized sections by its score tensor instead (2,730 rows for 512 queries x 24 heads).
SECTION_ROWS = 8192


def _tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for head dim d: the fp32 accumulator is BLOCK_M x d registers, so the key tile
    narrows as d grows. Not tuned on a GPU yet."""
    if d <= 64:
        return 64, 64, 4
    if d <= 128:
        return 64, 64, 8
    return 64, 32, 8


@triton.jit
def _section_kernel(q_ptr, k_ptr, v_ptr, bits_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, blocks_ptr, prefix_ptr, n_rows,
                    n_keys, start, n_words, qk_scale, H: tl.constexpr, REP: tl.constexpr, KVH: tl.constexpr,
                    D: tl.constexpr, RATIO: tl.constexpr, UNION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    g = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < n_rows
    query = r // REP
    qh = (query * H + g * REP + r % REP).to(tl.int64)              # flat (query, head) of the [Q, H] state
    d = tl.arange(0, BLOCK_D)
    qd = row_ok[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + qh[:, None] * D + d[None, :], mask=qd, other=0.0)
    pos = tl.load(pos_ptr + query, mask=row_ok, other=-1)           # padding rows see nothing
    m_i = tl.load(m_ptr + qh, mask=row_ok, other=float("-inf"))
    l_i = tl.load(l_ptr + qh, mask=row_ok, other=0.0)
    acc = tl.load(acc_ptr + qh[:, None] * D + d[None, :], mask=qd, other=0.0)
    bits_row = bits_ptr + query.to(tl.int64) * n_words
    # keys after the tile's last query are invisible to all its rows: stop there (a chunk's own rows, early queries)
    last = tl.max(pos, 0)
    if UNION:       # arena rows: the union's blocks compacted; its rows through the last query's block are a prefix
        hi = tl.minimum(n_keys, tl.load(prefix_ptr + tl.maximum(last, 0) // RATIO) * RATIO - start)
        hi = tl.where(last < 0, 0, hi)
    else:
        hi = tl.minimum(n_keys, last - start + 1)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if UNION:   # arena row c holds position blocks[c // RATIO] * RATIO + c % RATIO of the context
            c = start + n
            blk = tl.load(blocks_ptr + c // RATIO, mask=n < n_keys, other=0)
            j = blk * RATIO + c % RATIO
        else:
            j = start + n                                           # context positions of the tile's keys
            blk = j // RATIO
        word = tl.load(bits_row[:, None] + (blk >> 5)[None, :], mask=row_ok[:, None] & (n < n_keys)[None, :],
                       other=0)
        vis = (((word >> (blk & 31)[None, :]) & 1) != 0) & (j[None, :] <= pos[:, None])
        if tl.sum(tl.sum(vis.to(tl.int32), 1), 0) > 0:             # else no row of the tile reads these keys
            kv = n.to(tl.int64)[:, None] * (KVH * D) + g * D + d[None, :]
            kvm = (n < n_keys)[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + kv, mask=kvm, other=0.0).to(q.dtype)
            s = tl.where(vis, _dot(q, tl.trans(k), F32) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)    # nothing visible yet: nothing to rescale
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv, mask=kvm, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, F32)
            m_i = m_new
    tl.store(m_ptr + qh, m_i, mask=row_ok)
    tl.store(l_ptr + qh, l_i, mask=row_ok)
    tl.store(acc_ptr + qh[:, None] * D + d[None, :], acc, mask=qd)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _gather(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """out = src[rows]: the row kernel on a GPU (host rows over UVA), plain indexing on the CPU (the interpreter)."""
    if out.is_cuda:
        from stage_worker.kernels.kv_rows import gather_rows

        gather_rows(src, rows, out)
    else:
        torch.index_select(src, 0, rows.to(src.device), out=out)


def staged_sections(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, section: int, device,
                    overlap: bool = True) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (first context position, K rows, V rows) per section of `rows`, each a view of a reused buffer on
    `device`. The caller must launch its work on the current stream before asking for the next section. With
    `overlap` on a GPU, two buffers alternate and section i + 1 is gathered on a side stream while the caller's
    launch for section i runs (events order the reuse); else one buffer, gathered in line."""
    ctx = rows.shape[0]
    starts = list(range(0, ctx, section))
    two = overlap and torch.device(device).type == "cuda" and len(starts) > 1
    bufs = [(torch.empty((section, *k_cache.shape[1:]), dtype=k_cache.dtype, device=device),
             torch.empty((section, *v_cache.shape[1:]), dtype=v_cache.dtype, device=device))
            for _ in range(2 if two else 1)]

    def fill(i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        a = starts[i]
        b = min(a + section, ctx)
        k, v = bufs[i % len(bufs)]
        _gather(k_cache, rows[a:b], k[: b - a])
        _gather(v_cache, rows[a:b], v[: b - a])
        return a, k[: b - a], v[: b - a]

    if not two:
        for i in range(len(starts)):
            yield fill(i)
        return
    main = torch.cuda.current_stream(device)
    index = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.setdefault(index, torch.cuda.Stream(device))
    ready = [torch.cuda.Event(), torch.cuda.Event()]
    free = [torch.cuda.Event(), torch.cuda.Event()]
    staged: list[tuple[int, torch.Tensor, torch.Tensor]] = [None, None]

    def issue(i: int) -> None:
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(free[i % 2])          # the launch that read this buffer two sections ago is done
            staged[i % 2] = fill(i)
            ready[i % 2].record(side)

    side.wait_stream(main)                            # the rows and the chunk's new K/V were written on `main`
    try:
        issue(0)
        for i in range(len(starts)):
            if i + 1 < len(starts):
                issue(i + 1)
            main.wait_event(ready[i % 2])
            yield staged[i % 2]
            free[i % 2].record(main)
    finally:
        main.wait_stream(side)                        # the buffers go back to `main`'s pool only after the gathers


def attend_sections_fused(q: torch.Tensor, bits: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, ratio: int,
                          section: int | None = None, overlap: bool = True,
                          tiles: tuple[int, int, int] | None = None, union: bool = False) -> torch.Tensor:
    """q [Q, H, d]; bits [Q, words] (`section_attention.block_bits` of each query's selection); pos [Q] the
    queries' positions; rows [ctx] the sequence's flat cache rows; caches [R, kv_heads, d] in either tier.
    Returns [Q, H, d] in q's dtype: `section_attention.attend_sections` of the same selection within rounding.
    `union` (kernel flag `section_union`): stage only the union of the queries' selected blocks, compacted
    (`section_attention.union_plan`: one host read of its size), not the whole context; the same keys, the same
    softmax. `section` overrides `SECTION_ROWS`, `tiles` `_tiles` (tests)."""
    Q, H, d = q.shape
    kvh = k_cache.shape[1]
    dev = q.device
    bits = bits.to(torch.int32).contiguous()
    blocks = prefix = bits                                          # unread unless `union`
    if union:
        from stage_worker.model.section_attention import compact_rows, union_plan

        plan = union_plan(bits, ratio, rows.shape[0])
        rows, blocks, prefix = compact_rows(rows, plan, ratio), plan.blocks, plan.prefix
    ctx = rows.shape[0]
    section = max(1, min(section or SECTION_ROWS, ctx))
    block_m, block_n, warps = tiles or _tiles(d)
    m = torch.full((Q, H), float("-inf"), dtype=torch.float32, device=dev)
    norm = torch.zeros((Q, H), dtype=torch.float32, device=dev)
    acc = torch.zeros((Q, H, d), dtype=torch.float32, device=dev)
    q = q.contiguous()
    pos = pos.to(device=dev, dtype=torch.int32).contiguous()
    n_rows = Q * (H // kvh)
    grid = (triton.cdiv(n_rows, block_m), kvh)
    for a, k, v in staged_sections(k_cache, v_cache, rows, section, dev, overlap):
        _section_kernel[grid](q, k, v, bits, pos, m, norm, acc, blocks, prefix, n_rows, k.shape[0], a,
                              bits.shape[1], scale * 1.4426950408889634, H=H, REP=H // kvh, KVH=kvh, D=d,
                              RATIO=ratio, UNION=union, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_D=max(16, triton.next_power_of_2(d)),
                              F32=q.dtype == torch.float32 or _INTERPRET, num_warps=warps)
    return (acc / norm[..., None]).to(q.dtype)
