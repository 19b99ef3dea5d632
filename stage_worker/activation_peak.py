"""The activation part of the start-up memory plan's reserve, measured on the device (issue 16, item 1).

The plan used to estimate it (1 GiB plus 96 bytes per hidden unit and batched token); the reports' own predicted
peak was half of what their prefill really allocated, and an underestimate means a stage that passes the plan and
then runs out of memory in its first long prompt. So `memory_needs` builds one layer of each kind a GPU stage holds
(token mixer, MoE or dense MLP, PLE branch, and the embedding or the head where the stage has them) on the stage's
device with random weights, runs one prefill chunk of `max_num_batched_tokens` tokens through it with the stage's
kernels, and takes the largest rise of the allocator's peak over what was allocated before the forward. Layers run
one after another, so the chunk's peak is the largest single layer's plus the hidden states passed between them,
which the measurement includes (the layer's input and output are live during it).

Switch: `measure_reserve` (MOEPIPE_MEASURE_RESERVE=0 keeps the estimate).
"""

from __future__ import annotations

import torch

from shared.cluster_config import ClusterConfig
from shared.model_config import HybridMoeConfig
from stage_worker.checkpoint.loader import DTYPES, LoadOptions, load_model
from stage_worker.kernels.flags import KernelFlags
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec


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


@torch.inference_mode()
def prefill_peak(cluster: ClusterConfig, cfg: HybridMoeConfig, index: int, dtype: str) -> int:
    """Bytes one prefill chunk of `max_num_batched_tokens` tokens allocates on stage `index`'s device beyond its
    weights and caches (the largest over the stage's kinds of layer)."""
    spec = cluster.stages[index]
    device = torch.device(spec.device)
    tokens = cluster.max_num_batched_tokens
    block = cluster.block_size or 16
    blocks = -(-tokens // block)
    peak = 0
    for layer in layer_kinds(cfg, spec.start, spec.end):
        model = load_model(cluster.model, LoadOptions(start=layer, end=layer + 1, device=device,
                                                      load_format="dummy", dtype=DTYPES[dtype], seed=cluster.seed),
                           cfg)
        model.set_kernels(KernelFlags.parse(cluster.kernels))
        cache = model.new_cache(CacheSpec(num_blocks=blocks + 1, block_size=block, num_slots=2,
                                          dtype=DTYPES[dtype], device=device))
        ids = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
        batch = StepBatch.build([(ids, 0, 0, list(range(blocks)))], block, device)
        hidden = None if model.has_embedding else \
            torch.randn(tokens, model.stream_width, dtype=DTYPES[dtype], device=device) * 0.02
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = model(batch, cache, hidden)
        if model.has_head:
            model.logits(out, batch)
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        del model, cache, batch, hidden, out
        torch.cuda.empty_cache()
    return peak
