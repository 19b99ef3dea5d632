"""The row cache tier of `bench/qsa_kv_offload.py`: one full-shape QSA layer's decode steps over host K/V with and
without the VRAM row cache (`kv_row_cache`, `stage_worker/kernels/kv_row_cache.py`), on selections that move as a
model's do.

Why not the other tiers' repeated step: replaying one step selects the same rows every time (a 100% hit rate after
the first). Here every replay is the next step: the context grows by one token (its row invalidated, its compression
block pooled once complete, so new blocks become candidates) and the indexer's query drifts (an AR(1) walk,
q <- rho q + sqrt(1 - rho^2) noise), and the real indexer (`qsa_select`) picks the rows from the pooled keys. The
reports measured 0.72 overlap with the previous step on real text (002 §5); the tier prints the overlap these steps
give beside the hit rate, so a figure can be read against theirs (`--query-drift` sets rho).
"""

from __future__ import annotations

import torch

from stage_worker.kernels import kv_row_cache as rc


def graphed(step, device: str):
    """The step captured in a CUDA graph (its replay), or itself on the CPU."""
    if device != "cuda":
        return step
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def row_cache_tier(cfg, attn, cache, tables: list[list[int]], block: int, device: str, reps: int, mib: int,
                   timed, rho: float = 0.99) -> dict | None:
    """Seconds per drifting decode step over host K/V without and with a `mib`-MiB region (one layer's), the hit
    rate of the timed steps and the mean overlap of consecutive selections; None when the context is too short."""
    from stage_worker.kernels.attention_prep import qsa_pool_update
    from stage_worker.kernels.decode_attention import paged_decode_attention
    from stage_worker.kernels.qsa import qsa_select

    B, idx = len(tables), attn.indexer
    ctx = min(len(t) for t in tables) * block
    steps = 3 * reps + 24                                   # overlap pass, capture warm-up, timed() replays
    if ctx - steps < 2 * cfg.indexer_budget:
        return None
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    q = torch.randn(B, cfg.num_attention_heads, cfg.head_dim, device=device).to(torch.bfloat16)
    region = rc.RowCache.new(rc.slots_for(mib << 20, 1, cfg.num_key_value_heads, cfg.head_dim, 2),
                             cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, device)
    out: dict = dict(row_cache_mib=mib, slots=region.n_slots, query_drift=rho)
    for name, rows_cache in (("host_drift_s", None), ("row_cache_s", region)):
        torch.manual_seed(1)
        lens = torch.full((B,), ctx - steps, dtype=torch.int32, device=device)
        q_state = torch.randn(B, cfg.indexer_n_heads, cfg.indexer_head_dim, device=device)
        sel_out = torch.empty(B, idx.block_topk * idx.ratio + idx.ratio - 1, dtype=torch.int32, device=device)

        def step():
            lens.add_(1)
            q_state.mul_(rho).add_(torch.randn_like(q_state), alpha=(1 - rho * rho) ** 0.5)
            pos = (lens - 1).long()
            new_rows = table.gather(1, (pos // block)[:, None])[:, 0].long() * block + pos % block
            qsa_pool_update(cache.index_keys, cache.pooled_keys, table, lens, idx.k_layernorm.weight,
                            attn.rotary.inv_freq, idx.k_layernorm.eps, block, idx.ratio, attn.rotary.rotary_dim)
            sel = qsa_select(q_state.to(torch.bfloat16), cache.pooled_keys, table, lens, block, idx.ratio,
                             idx.block_topk * idx.ratio)
            if rows_cache is not None:
                rc.invalidate(rows_cache, new_rows)
                rc.plan(rows_cache, sel, table, lens, block)
            sel_out.copy_(sel)
            return paged_decode_attention(q, cache.k, cache.v, table, lens, attn.scale, block, sel,
                                          row_cache=rows_cache)

        overlaps, prev = [], None
        for _ in range(16):                                 # eager: the selections' overlap, and the region warms
            step()
            cur = [set(r[r >= 0].tolist()) for r in sel_out.cpu()]
            if prev is not None:
                overlaps.append(sum(len(a & b) / max(len(a), 1) for a, b in zip(cur, prev)) / B)
            prev = cur
        replay = graphed(step, device)
        before = region.counts.tolist()
        out[name] = timed(replay, reps, device)
        if rows_cache is not None:
            hits, lookups = (a - b for a, b in zip(region.counts.tolist(), before))
            out["hit_rate"] = hits / max(lookups, 1)
        out["overlap"] = sum(overlaps) / len(overlaps)
    return out
