"""In-process prefill of one long prompt, as a server chunks it: time to the first token without HTTP, sockets or
scheduling, and the A/B of the QSA sparse prefill (`qsa_sparse_prefill`). Fixed prompt and seed, one warm-up, then
`--runs` measured runs; the median is reported, with each run's last chunk (the one at the longest context).

    python bench/prefill.py                                        # the built-in demo model on the CPU
    python bench/prefill.py --model /tmp/fs --load-format dummy --device cuda --tokens 8192,32768 --chunk 2048

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model, device: str, tokens: int, chunk: int, runs: int, sparse: bool) -> dict:
    """Median seconds to prefill `tokens` tokens in `chunk`-token steps (and the last chunk's seconds)."""
    import torch

    from stage_worker.local_engine import LocalEngine

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, model.cfg.vocab_size - 10, (tokens,), generator=g).tolist()
    engine = LocalEngine([model], max_seqs=1, max_tokens=tokens + 1, sparse_prefill=sparse)
    totals, lasts = [], []
    for run in range(runs + 1):                                   # run 0 is the warm-up
        engine.add(0)
        start = time.perf_counter()
        for s in range(0, tokens, chunk):
            t = time.perf_counter()
            engine.step([(0, prompt[s:s + chunk])])
            _sync(device)
            last = time.perf_counter() - t
        total = time.perf_counter() - start
        engine.release(0)
        if run:
            totals.append(total)
            lasts.append(last)
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"tokens": tokens, "chunk": chunk, "sparse_prefill": sparse, "seconds": statistics.median(totals),
            "last_chunk_seconds": statistics.median(lasts), "runs": totals,
            "tokens_per_second": tokens / statistics.median(totals)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the built-in demo model)")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="4096,16384", help="comma list of prompt lengths")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per step (a server's max_num_batched_tokens)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import torch

    from shared.cli import ensure_builtin_model
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.kernels.flags import KernelFlags

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else ensure_builtin_model()
    model = load_model(path, LoadOptions(device=args.device, load_format=args.load_format))
    model.set_kernels(KernelFlags.from_env())
    print(f"{'tokens':>8} {'chunk':>6} {'sparse':>6} {'seconds':>9} {'tok/s':>9} {'last chunk s':>13}", flush=True)
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        for sparse in (True, False):
            r = measure(model, args.device, n, args.chunk, args.runs, sparse)
            rows.append(r)
            print(f"{r['tokens']:>8} {r['chunk']:>6} {str(r['sparse_prefill']):>6} {r['seconds']:>9.2f} "
                  f"{r['tokens_per_second']:>9.0f} {r['last_chunk_seconds']:>13.3f}", flush=True)
    if args.out:
        meta = {"model": str(path), "device": args.device, "load_format": args.load_format,
                "host": platform.node(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
