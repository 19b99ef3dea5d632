"""The last stage's sampling step, per-row (`stage_worker/sampler.py`) against batched (`batch_sampler.py`,
`device_sampling`), on whatever device is given: milliseconds per step for B rows of a V-token vocabulary with the
default sampling settings of the Qwen checkpoints (temperature 0.7, top-p 0.8, top-k 20) and a repetition penalty
over a 256-token history. Warm-up, then the median of --runs timed steps; prints a table and writes JSON.

    python bench/sampler.py [--device cuda] [--vocab 151936] [--batches 1,4,16] [--out bench/results/sampler.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.sampling import SamplingParams  # noqa: E402
from stage_worker import batch_sampler, sampler  # noqa: E402


def _time(fn, device: str, runs: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="print the batched step's top operators (torch.profiler)")
    args = ap.parse_args()
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"device {args.device}, vocab {args.vocab}; ms per sampling step (median of {args.runs})", flush=True)
    print(f"{'batch':>6} {'per-row':>10} {'batched':>10} {'speed-up':>9}", flush=True)
    for b in [int(x) for x in args.batches.split(",")]:
        logits = torch.randn(b, args.vocab, generator=g).to(args.device)
        history = torch.randint(args.vocab, (256,), generator=g).tolist()
        rows = [batch_sampler.Row(params, seed=i, position=300, history=history) for i in range(b)]

        def per_row():
            out = []
            for i in range(b):
                adjusted = sampler.apply_penalties(logits[i], params, history)
                out.append(sampler.sample(adjusted, params, sampler.position_generator(i, 300)))
            return out

        def batched():
            return batch_sampler.sample_rows(logits, rows).tolist()

        a, c = _time(per_row, args.device, args.runs), _time(batched, args.device, args.runs)
        results.append({"batch": b, "per_row_ms": a, "batched_ms": c})
        print(f"{b:>6} {a:>10.2f} {c:>10.2f} {a / c:>8.1f}x", flush=True)
        if args.profile:
            with torch.profiler.profile() as prof:
                for _ in range(5):
                    batched()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "vocab": args.vocab, "params": vars(params),
                                              "results": results}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
