"""The activation part of the start-up memory plan's reserve, measured on the device (issue 16, item 1), and what
long context adds to it (issue 18).

The plan used to estimate it (1 GiB plus 96 bytes per hidden unit and batched token); the reports' own predicted
peak was half of what their prefill really allocated, and an underestimate means a stage that passes the plan and
then runs out of memory in its first long prompt. So `memory_needs` builds one layer of each kind a GPU stage holds
(token mixer, MoE or dense MLP, PLE branch, and the embedding or the head where the stage has them) on the stage's
device with random weights, runs one prefill chunk of `max_num_batched_tokens` tokens through it with the stage's
kernels, and takes the largest rise of the allocator's peak over what was allocated before the forward. Layers run
one after another, so the chunk's peak is the largest single layer's plus the hidden states passed between them,
which the measurement includes (the layer's input and output are live during it).

**Long context.** An attention layer's prefill chunk allocates scratch that grows with the context it attends to
(docs/performance.md, issue 18: one full-shape QSA layer's 512-token chunk adds 412 MiB at 4k tokens, 2,140 at 64k
and 5,273 at 262k with K/V in VRAM): the QSA selection's block scores, `[queries, context / ratio, indexer heads]`
fp32 twice over for each slice of 256 queries, and below `SPARSE_PREFILL_FACTOR` x the keys a query reads, the dense
path's `[heads, queries, context]` scores (so the worst VRAM chunk is at the dense/sparse switch or at
`max_model_len`, whichever is larger; a layer without an indexer always takes the dense path). With host K/V
(`qsa_kv_offload`) the context is staged in fixed sections and the selection in slices of at most
`HOST_SELECT_SCORES` scores: flat in the context (~300-420 MiB at the full shape) but for the per-query lists. A
chunk measured at a short context sees none of it, so attention layers are measured again at the contexts where
their chunk may peak (`chunk_shapes`: the full chunk at `max_model_len`, at the dense/sparse switch, and with host
K/V the longest chunk that still gathers each query's rows), over a cache of `max_model_len` tokens whose contents
do not matter (the scratch depends on shapes only). Measured, not computed, where a device is there: one layer's
cache at 262,144 tokens is ~0.6 GiB and a chunk 30-120 ms on the H200, and the formula (`attention_chunk_bytes`)
is a model of PyTorch's temporaries that the CPU test checks against measured peaks but cannot promise for every
kernel and allocator. A chunk that runs out of memory while measured counts as the device's whole free memory, so
the plan refuses and says which flag helps. Where nothing is measured (`measure_reserve` off, no CUDA) the estimate
gets the formula's growth from the short chunk to the worst one.

Switch: `measure_reserve` (MOEPIPE_MEASURE_RESERVE=0 keeps the estimate).
"""

from __future__ import annotations

from typing import Callable

import torch

from shared.cluster_config import ClusterConfig
from shared.model_config import HybridMoeConfig
from stage_worker.checkpoint.loader import DTYPES, LoadOptions, load_model
from stage_worker.kernels.flags import KernelFlags
from stage_worker.model.attention import (DENSE_PREFILL_QUERIES, HOST_SELECT_SCORES, SPARSE_PREFILL_FACTOR,
                                          SPARSE_PREFILL_QUERIES)
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec
from stage_worker.model.section_attention import section_rows

STAGED_ROWS = 8192       # kernels/section_attention.py SECTION_ROWS: context rows a fused launch stages (2 buffers)


def layer_kinds(cfg: HybridMoeConfig, start: int, end: int) -> list[int]:
    """One layer index per kind in [start, end): token mixer, MoE or not, PLE or not, and the first and last layer
    of the model on their own (they carry the embedding and the head)."""
    seen, out = set(), []
    for layer in range(start, end):
        ple = getattr(cfg, "ple_index", lambda _: None)(layer) is not None
        kind = (cfg.layer_types[layer], cfg.is_sparse_moe(layer), ple, layer == 0,
                layer == cfg.num_hidden_layers - 1)
        if kind not in seen:
            seen.add(kind)
            out.append(layer)
    return out


def has_indexer(cfg: HybridMoeConfig, layer: int) -> bool:
    return cfg.layer_types[layer] == "indexed_attention" and bool(getattr(cfg, "indexer_budget", 0))


def query_keys(cfg: HybridMoeConfig) -> int:
    """The most keys one QSA query reads (`QSAIndexer.keys`)."""
    r = cfg.indexer_compress_ratio
    return cfg.indexer_budget // r * r + r - 1


def chunk_shapes(cfg: HybridMoeConfig, layer: int, tokens: int, max_model_len: int, kv_offload: bool,
                 sparse_prefill: bool = True) -> list[tuple[int, int]]:
    """(chunk tokens, context after the chunk) at which layer `layer`'s prefill chunk may peak: the short chunk
    for every layer; for an attention layer also the full chunk at `max_model_len`, with K/V in VRAM the last
    context that still takes the dense masked path (`SPARSE_PREFILL_FACTOR` x the keys a query reads), and with host
    K/V the longest chunk that gathers each query's rows instead of staging sections (queries x keys < context)."""
    tokens = min(tokens, max_model_len)
    out = [(tokens, tokens)]
    if not cfg.is_attention(layer):
        return out
    if max_model_len > tokens:
        out.append((tokens, max_model_len))
    if has_indexer(cfg, layer):
        keys = query_keys(cfg)
        if kv_offload:
            q = (max_model_len - 1) // keys
            if q >= 1 and (q, max_model_len) not in out and q < tokens:
                out.append((q, max_model_len))
        elif sparse_prefill and tokens < SPARSE_PREFILL_FACTOR * keys < max_model_len:
            out.append((tokens, SPARSE_PREFILL_FACTOR * keys))
    return out


def attention_chunk_bytes(cfg: HybridMoeConfig, layer: int, q: int, ctx: int, itemsize: int, kv_offload: bool,
                          sparse_prefill: bool = True, fused_sections: bool = False) -> int:
    """Predicted scratch of one attention layer's prefill chunk of `q` queries ending at context `ctx`
    (`GatedAttention.forward`'s prefill paths; activations of `itemsize` bytes): the terms that grow with the
    context, and the chunk's own score buffers. A model of PyTorch's temporaries, checked against measured peaks on
    the CPU (tests/test_long_context_plan.py); the plan measures where it can (module docstring)."""
    H, kvh, d, it = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, itemsize
    up = 4 if it < 4 else 0                     # .float() of a half-precision tensor is a copy
    rows = 32 * ctx                             # context_rows' int64 temporaries
    qd = min(q, DENSE_PREFILL_QUERIES)          # the dense path's query slice (`GatedAttention.forward`)
    own = 2 * q * H * d * it                    # the whole chunk's output and its gated copy, beside the slices
    if not has_indexer(cfg, layer):
        return rows + own + 2 * qd * ctx + _dense(H, kvh, d, qd, ctx, it, up)   # the causal mask and its negation
    ni, di, r = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    keys = query_keys(cfg)
    nb = ctx // r
    pooled = nb * (di * it + 8)                 # the sequence's pooled keys, copied, and their rows

    def select(s: int) -> int:                  # block scores, ReLU, the head sum; top-k masks; the lists
        return s * nb * max(8 * ni + 4, 32) + nb * di * up + s * keys * 17

    if kv_offload:
        if q * keys < ctx:                      # each query's rows gathered (`_attend_selected`)
            return rows + pooled + _gather(H, kvh, d, q, keys, it, up, select)
        n = max(1, min(SPARSE_PREFILL_QUERIES, HOST_SELECT_SCORES // max(nb * ni, 1)))
        lists = 2 * q * keys * 9                # every query's key list, and its concatenation
        if fused_sections:                      # a bit per block and query, two staged sections of K and V
            return rows + pooled + lists + select(n) + 2 * q * (nb // 32 + 1) * 4 + 4 * STAGED_ROWS * kvh * d * it
        sec = min(section_rows(q, H), ctx)
        return (rows + pooled + lists + select(n) + q * H * sec * (it + up) + q * keys * 40
                + sec * kvh * d * (it + 4))
    if sparse_prefill and ctx > SPARSE_PREFILL_FACTOR * keys:
        return rows + pooled + _gather(H, kvh, d, q, keys, it, up, select)
    return rows + own + pooled + 3 * qd * ctx + select(qd) + _dense(H, kvh, d, qd, ctx, it, up)


def _dense(H: int, kvh: int, d: int, q: int, ctx: int, it: int, up: int) -> int:
    """`GatedAttention._attend` over the whole context: K and V read and repeated per head, the scores in the
    activations' dtype, their fp32 copy and the fp32 softmax, the masks."""
    return 2 * ctx * (kvh + H) * d * it + H * q * ctx * (it + 4 + up) + 3 * q * ctx


def _gather(H: int, kvh: int, d: int, q: int, keys: int, it: int, up: int, select: Callable[[int], int]) -> int:
    """`GatedAttention._attend_selected`: per slice of 256 queries the selection, then each query's rows."""
    s = min(q, SPARSE_PREFILL_QUERIES)
    return select(s) + 3 * s * keys * kvh * d * it + s * H * keys * (it + 4 + up) + s * keys * 33


def context_growth(cfg: HybridMoeConfig, start: int, end: int, tokens: int, max_model_len: int, itemsize: int,
                   kv_offload: bool, sparse_prefill: bool = True, fused_sections: bool = False) -> int:
    """What the worst attention chunk of layers [start, end) adds over the short chunk, by the formula (the
    estimate's context term when nothing is measured)."""
    worst = 0
    for layer in layer_kinds(cfg, start, end):
        shapes = chunk_shapes(cfg, layer, tokens, max_model_len, kv_offload, sparse_prefill)
        if len(shapes) == 1:
            continue
        args = (itemsize, kv_offload, sparse_prefill, fused_sections)
        short = attention_chunk_bytes(cfg, layer, *shapes[0], *args)
        worst = max([worst] + [attention_chunk_bytes(cfg, layer, q, c, *args) - short for q, c in shapes[1:]])
    return worst


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The largest rise of allocated memory on `device` while `fn` runs: the CUDA allocator's peak, or on the CPU
    the allocation events torch.profiler records (in order; their running sum's maximum)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    now = peak = 0
    for _, size in sorted(sizes):
        now += size
        peak = max(peak, now)
    return peak


def chunk_peak(model, cfg: HybridMoeConfig, cache, shape: tuple[int, int], block: int, device: torch.device,
               dtype: torch.dtype, sparse_prefill: bool = True, seed: int = 0) -> int:
    """Bytes one prefill chunk of `shape` = (tokens, context after it) allocates through `model` (a one-layer
    StageModel) over `cache`, whose blocks 0.. hold the context (its contents do not matter: shapes decide)."""
    q, ctx = shape
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (q,), generator=gen).tolist()
    batch = StepBatch.build([(ids, ctx - q, 0, list(range(-(-ctx // block))))], block, device)
    batch.sparse_prefill = sparse_prefill
    hidden = None if model.has_embedding else \
        torch.randn(q, model.stream_width, dtype=dtype, generator=gen).to(device) * 0.02

    def run():
        out = model(batch, cache, hidden)
        if model.has_head:
            model.logits(out, batch)
    return peak_bytes(run, device)


@torch.inference_mode()
def prefill_peak(cluster: ClusterConfig, cfg: HybridMoeConfig, index: int, dtype: str) -> tuple[int, int]:
    """(bytes the worst prefill chunk allocates on stage `index`'s device beyond its weights and caches, the part
    of it that long context adds): the largest over the stage's kinds of layer and, for attention layers, over
    `chunk_shapes` up to the cluster's `max_model_len`, else the model's."""
    spec = cluster.stages[index]
    device = torch.device(spec.device)
    tokens = cluster.max_num_batched_tokens
    length = cluster.model_len(cfg)
    block = cluster.block_size or 16
    offload = cluster.qsa_kv_offload
    short_peak = long_peak = 0
    for layer in layer_kinds(cfg, spec.start, spec.end):
        model = load_model(cluster.model, LoadOptions(start=layer, end=layer + 1, device=device,
                                                      load_format="dummy", dtype=DTYPES[dtype], seed=cluster.seed),
                           cfg)
        model.set_kernels(KernelFlags.parse(cluster.kernels))
        shapes = chunk_shapes(cfg, layer, tokens, length, offload, cluster.qsa_sparse_prefill)
        blocks = -(-max(c for _, c in shapes) // block)
        cache = model.new_cache(CacheSpec(num_blocks=blocks + 1, block_size=block, num_slots=2,
                                          dtype=DTYPES[dtype], device=device, kv_offload=offload))
        for i, shape in enumerate(shapes):
            try:
                peak = chunk_peak(model, cfg, cache, shape, block, device, DTYPES[dtype],
                                  cluster.qsa_sparse_prefill, cluster.seed)
            except torch.OutOfMemoryError:
                if i == 0:
                    raise
                # it did not fit on a device holding nothing else: it cannot fit beside the stage
                torch.cuda.empty_cache()
                peak = torch.cuda.mem_get_info(device)[1]          # the device's total: the plan refuses
            if i == 0:
                short_peak = max(short_peak, peak)
            else:
                long_peak = max(long_peak, peak)
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return max(short_peak, long_peak), max(long_peak - short_peak, 0)
