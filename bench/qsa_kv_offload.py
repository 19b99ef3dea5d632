"""QSA K/V in host RAM (issue 18): what one full-shape QSA layer's decode attention and prefill chunk cost with the
K/V bodies in pinned host memory (`qsa_kv_offload`) against VRAM, by context length and batch.

    python bench/qsa_kv_offload.py --contexts 4096,65536,262144 --batch 1,4 --out bench/results/x.json

Decode: the attention work of one decode step of one layer after the projections: the pool update (reads the
newest block's raw indexer keys), QSA selection over the pooled keys (VRAM either way) and split-K attention over
the selected rows, captured in a CUDA graph and timed with CUDA events around replays (DESIGN §6). With host K/V
the attention reads `budget + ratio - 1` rows of K and of V a sequence over PCIe (4.2 MB at the full shape), which
cannot overlap the indexer that chooses them (002 §3.1): the table prints that transfer's time at the measured
host-read bandwidth beside the step. "select us": the QSA selection alone (scores and top-k, in a CUDA graph) with
the block table padded to 262,144 tokens as under the decode graphs, and in parentheses the first version's (one
select program a sequence). Prefill: one 512-token chunk at the end of the context through
`GatedAttention` (in VRAM: gathering each query's rows; host: the context staged in sections, by the fused kernel
`section_attention` unless `--kernels all,-section_attention`), time and the peak memory it adds. Caches are
random (a selection over random scores: no row locality, the worst case for a row cache). Tier "rows"
(`--row-cache-mib`, `bench/row_cache_steps.py`): host K/V with the VRAM row cache over steps that advance (the
context grows, the indexer's query drifts, the real indexer selects): decode us with the cache, in parentheses the
same steps without it, the hit rate and the overlap of consecutive selections.
Without CUDA it runs eagerly on the CPU under Triton's interpreter (a smoke test; use tiny --contexts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")       # before anything imports triton

from shared.kv_layout import GIB, block_bytes  # noqa: E402
from shared.model_config import Qwen4ExpConfig  # noqa: E402
from stage_worker.kernels.flags import KernelFlags  # noqa: E402
from stage_worker.model.attention import GatedAttention  # noqa: E402
from stage_worker.model.batch import StepBatch  # noqa: E402
from stage_worker.model.cache import CacheSpec, ModelCache  # noqa: E402
from stage_worker.model.rope import Rotary  # noqa: E402
from bench.row_cache_steps import graphed, row_cache_tier  # noqa: E402

BLOCK = 16
HOST_READ_GBS = 50.0      # a GPU kernel reading pinned host memory on the H200 (DESIGN §6)


def full_layer_config() -> Qwen4ExpConfig:
    """One QSA layer at the reports' attention shape: 16 heads of 256, 2 K/V heads, indexer 32 x 128, budget 2048."""
    cfg = Qwen4ExpConfig(
        vocab_size=64, hidden_size=2048, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, partial_rotary_factor=0.25, layer_types=["indexed_attention"], eos_token_id=[0],
        indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
        indexer_compress_ratio=4, dtype="bfloat16")
    cfg.validate()
    return cfg


def random_caches(cfg, ctxs: list[int], device: str, offload: bool, seed: int):
    """A one-layer cache holding `ctxs` tokens per sequence (random rows, pages shuffled), its block tables and
    lengths on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = sum(-(-c // BLOCK) for c in ctxs) + 1
    spec = CacheSpec(num_blocks=blocks, block_size=BLOCK, num_slots=len(ctxs) + 1, dtype=torch.bfloat16,
                     device=device, kv_offload=offload)
    cache = ModelCache(cfg, spec).attention[0]
    for t in (cache.k, cache.v, cache.index_keys, cache.pooled_keys):
        for a in range(0, t.shape[0], 1 << 16):                  # a slice at a time: no full-size fp32 copy
            n = min(1 << 16, t.shape[0] - a)
            t[a:a + n].copy_(torch.randn((n, *t.shape[1:]), generator=g, device=device).to(torch.bfloat16))
    pool = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for c in ctxs:
        n = -(-c // BLOCK)
        tables.append(pool[start:start + n])
        start += n
    return cache, tables


def timed(fn, reps: int, device: str) -> float:
    """Median seconds per call over three runs of `reps` calls (CUDA events on a GPU)."""
    fn()
    out = []
    for _ in range(3):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def decode_step(cfg, attn: GatedAttention, cache, tables: list[list[int]], device: str, reps: int) -> float:
    """Seconds per decode attention step of the batch (pool update, selection, split-K attention)."""
    from stage_worker.kernels.attention_prep import qsa_pool_update
    from stage_worker.kernels.decode_attention import paged_decode_attention
    from stage_worker.kernels.qsa import qsa_select

    B = len(tables)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    lens = torch.tensor([len(t) * BLOCK for t in tables], dtype=torch.int32, device=device)
    q = torch.randn(B, cfg.num_attention_heads, cfg.head_dim, device=device).to(torch.bfloat16)
    q_idx = torch.randn(B, cfg.indexer_n_heads, cfg.indexer_head_dim, device=device).to(torch.bfloat16)
    idx = attn.indexer

    def step():
        qsa_pool_update(cache.index_keys, cache.pooled_keys, table, lens, idx.k_layernorm.weight,
                        attn.rotary.inv_freq, idx.k_layernorm.eps, BLOCK, idx.ratio, attn.rotary.rotary_dim)
        sel = qsa_select(q_idx, cache.pooled_keys, table, lens, BLOCK, idx.ratio, idx.block_topk * idx.ratio)
        return paged_decode_attention(q, cache.k, cache.v, table, lens, attn.scale, BLOCK, sel)

    return timed(graphed(step, device), reps, device)


def selection(cfg, attn: GatedAttention, cache, tables: list[list[int]], device: str, reps: int,
              one_program: bool) -> float:
    """Seconds per `qsa_select` of the batch alone (in a CUDA graph on a GPU), the block table padded to 262,144
    tokens as the decode graphs pad it; `one_program`: the first version (one select program a sequence)."""
    from stage_worker.kernels.qsa import qsa_select

    width = 262144 // BLOCK
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    lens = torch.tensor([len(t) * BLOCK for t in tables], dtype=torch.int32, device=device)
    q_idx = torch.randn(len(tables), cfg.indexer_n_heads, cfg.indexer_head_dim, device=device).to(torch.bfloat16)
    idx = attn.indexer

    def run():
        qsa_select(q_idx, cache.pooled_keys, table, lens, BLOCK, idx.ratio, idx.block_topk * idx.ratio,
                   one_program=one_program)

    return timed(graphed(run, device), reps, device)


def prefill_chunk(cfg, attn: GatedAttention, cache, table: list[int], ctx: int, device: str) -> tuple[float, int]:
    """Seconds and added peak bytes of one 512-token chunk ending at `ctx` (the cache already holds the rows)."""
    chunk = min(512, ctx)
    x = torch.randn(chunk, cfg.hidden_size, device=device).to(torch.bfloat16)
    batch = StepBatch.build([(list(range(chunk)), ctx - chunk, 0, table)], BLOCK, device)

    def run():
        attn(x, batch, cache, attn.rotary.cos_sin(batch.positions, x.dtype))

    run()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(run, 1, device)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    return seconds, peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,65536,262144")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--row-cache-mib", type=int, default=32,
                    help="the row cache tier's region (one layer's; 0: no tier)")
    ap.add_argument("--query-drift", type=float, default=0.99, help="the row cache tier's query walk (rho)")
    ap.add_argument("--tiers", default="vram,host,rows", help="which of the tiers vram, host, rows to run")
    ap.add_argument("--kernels", default="all",
                    help="kernel flags; 'all,-section_attention': host prefill by the PyTorch section loop")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = full_layer_config()
    torch.manual_seed(0)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    attn = GatedAttention(cfg, True, rotary).to(device=device, dtype=torch.bfloat16).eval()
    attn.rotary.inv_freq = attn.rotary.inv_freq.float()
    attn.kernels = KernelFlags.parse(args.kernels)
    keys = cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    row = cfg.num_key_value_heads * cfg.head_dim * 2                    # bytes of one token's K (or V) row, bf16
    rows = []
    dev_on = block_bytes(cfg, 0, 1, BLOCK, "bfloat16", True) // BLOCK
    dev_off = block_bytes(cfg, 0, 1, BLOCK, "bfloat16") // BLOCK
    print(f"VRAM per token and QSA layer: {dev_off} B in VRAM, {dev_on} B with host K/V ({dev_off / dev_on:.0f}x the "
          f"tokens per GiB: {GIB // dev_off:,} against {GIB // dev_on:,} token-layers)")
    print(f"{'context':>8} {'batch':>5} {'tier':>5} {'decode us':>10} {'PCIe us':>8} {'prefill ms':>10} "
          f"{'+peak MiB':>9} {'select us (v1)':>15}")
    with torch.inference_mode():
        for ctx in [int(c) for c in args.contexts.split(",")]:
            for B in [int(b) for b in args.batch.split(",")]:
                for offload in [o for o in (False, True) if ("host" if o else "vram") in args.tiers.split(",")]:
                    cache, tables = random_caches(cfg, [ctx] * B, device, offload, seed=ctx + B)
                    dec = decode_step(cfg, attn, cache, tables, device, args.reps)
                    sel, sel_v1 = (selection(cfg, attn, cache, tables, device, args.reps, one) for one in (False, True))
                    pcie = B * keys * 2 * row / (HOST_READ_GBS * 1e9) if offload else 0.0
                    pre, peak = (0.0, 0) if args.no_prefill or B > 1 else \
                        prefill_chunk(cfg, attn, cache, tables[0], ctx, device)
                    rows.append(dict(context=ctx, batch=B, tier="host" if offload else "vram", decode_s=dec,
                                     pcie_s=pcie, prefill_chunk_s=pre, prefill_peak_bytes=peak, select_s=sel,
                                     select_v1_s=sel_v1))
                    print(f"{ctx:>8} {B:>5} {rows[-1]['tier']:>5} {dec * 1e6:>10.1f} {pcie * 1e6:>8.1f} "
                          f"{pre * 1e3:>10.1f} {peak / 2**20:>9.0f} {sel * 1e6:>7.1f} ({sel_v1 * 1e6:.1f})")
                    del cache
                    if device == "cuda":
                        torch.cuda.empty_cache()
                if args.row_cache_mib and "rows" in args.tiers.split(","):   # steps that advance, over host K/V
                    cache, tables = random_caches(cfg, [ctx] * B, device, True, seed=ctx + B)
                    r = row_cache_tier(cfg, attn, cache, tables, BLOCK, device, args.reps, args.row_cache_mib, timed,
                                       args.query_drift)
                    if r is not None:
                        rows.append(dict(context=ctx, batch=B, tier="rows", **r))
                        print(f"{ctx:>8} {B:>5} {'rows':>5} {r['row_cache_s'] * 1e6:>10.1f} "
                              f"({r['host_drift_s'] * 1e6:.1f} uncached)  hit rate {r['hit_rate']:.3f}, overlap "
                              f"{r['overlap']:.2f}, {r['slots']} slots")
                    del cache
    if args.out:
        meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                    kernels=attn.kernels.describe(),
                    torch=torch.__version__, config=dataclasses.asdict(cfg), host_read_gbs=HOST_READ_GBS,
                    vram_bytes_per_token_layer={"vram": dev_off, "host_kv": dev_on})
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
