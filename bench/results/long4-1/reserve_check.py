"""Device check of the memory plan's long-context reserve (issue 18): one full-shape QSA layer's prefill chunk at the
shapes `activation_peak.chunk_shapes` measures up to --max-model-len, with K/V in VRAM and in host RAM, measured by
the CUDA allocator (what `memory_needs` does at start-up) beside the formula the plan falls back to
(`attention_chunk_bytes`, checked on the CPU by tests/test_long_context_plan.py). The layer is the model's first QSA
layer alone (no embedding, no head), with the build's kernels.

    moepipe make-model --preset full-shape --layers 8 --out /tmp/fslong
    python3 bench/results/long4-1/reserve_check.py --model /tmp/fslong --max-model-len 262144
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from shared.model_config import load_config  # noqa: E402
from stage_worker.activation_peak import attention_chunk_bytes, chunk_shapes, chunk_peak  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.kernels.flags import KernelFlags  # noqa: E402
from stage_worker.model.cache import CacheSpec  # noqa: E402


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=262144)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--kernels", default="all")
    ap.add_argument("--out", default="reserve_check.json")
    args = ap.parse_args()
    cfg = load_config(args.model)
    layer = cfg.layer_types.index("indexed_attention")
    dev = torch.device("cuda:0")
    flags = KernelFlags.parse(args.kernels)
    model = load_model(args.model, LoadOptions(start=layer, end=layer + 1, device=dev, load_format="dummy",
                                               dtype=torch.bfloat16), cfg)
    model.set_kernels(flags)
    rows = []
    for offload in (False, True):
        shapes = chunk_shapes(cfg, layer, args.tokens, args.max_model_len, offload)
        blocks = -(-max(c for _, c in shapes) // 16)
        cache = model.new_cache(CacheSpec(num_blocks=blocks + 1, block_size=16, num_slots=2, dtype=torch.bfloat16,
                                          device=dev, kv_offload=offload))
        for q, ctx in shapes:
            chunk_peak(model, cfg, cache, (q, ctx), 16, dev, torch.bfloat16)          # compile, warm
            t0 = time.perf_counter()
            try:
                peak = chunk_peak(model, cfg, cache, (q, ctx), 16, dev, torch.bfloat16)
            except torch.OutOfMemoryError:
                peak = -1
            ms = 1e3 * (time.perf_counter() - t0)
            pred = attention_chunk_bytes(cfg, layer, q, ctx, 2, offload, True, flags.section_attention)
            row = {"kv": "host" if offload else "vram", "queries": q, "context": ctx, "measured_mib": peak / 2**20,
                   "predicted_mib": pred / 2**20, "ms": ms}
            rows.append(row)
            print(f"{row['kv']:>4} chunk {q:>4} at {ctx:>7}: measured {peak / 2**20:8.1f} MiB (whole layer), "
                  f"attention formula {pred / 2**20:8.1f} MiB, {ms:.1f} ms")
        del cache
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "layer": layer, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
