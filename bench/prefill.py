"""In-process prefill of one long prompt, as a server chunks it: time to the first token without HTTP, sockets or
scheduling, and the A/B of the QSA sparse prefill (`qsa_sparse_prefill`). Fixed prompt and seed, one warm-up, then
`--runs` measured runs; the median is reported, with each run's last chunk (the one at the longest context).

    python bench/prefill.py                                        # the built-in demo model on the CPU
    python bench/prefill.py --model /tmp/fs --load-format dummy --device cuda --tokens 8192,32768 --chunk 2048
    python bench/prefill.py --model /tmp/fs48 --load-format dummy --device cuda --tokens 11 --seqs 4 \
        --set dummy_quant=reports-mixed --profile /tmp/prof     # a burst of four short chats: TTFT's prefill step
    python bench/prefill.py --model /tmp/fs48 --load-format dummy --device cuda --tokens 46,512 \
        --set dummy_quant=reports-mixed --profile /tmp/prefill_prof     # a quantized model's prefill, its kernels

The model is loaded as a served stage loads it (`gateway.launcher.build_cluster_config` from the options and
`--set` keys, then `stage_worker.stage_loader.load_stage`: one stage over all the layers), so any cluster key takes
effect, e.g. `dummy_quant=reports-mixed` (packed INT4/6/8 dense layers and experts on a GPU), `kernels=-moe_prefill`,
`packed_dense=false`. `--profile DIR`: after the measured runs, one more run of each row under torch.profiler
(`bench/decode.py`'s `kernels_per_step`): the kernel count, and the kernels by GPU time written to
DIR/prefill_<tokens>_<sparse|dense>.txt, the top 25 printed (CUDA only).

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
sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench/decode.py's profiler helper


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model, device: str, tokens: int, chunk: int, runs: int, sparse: bool, profile: str = "",
            seqs: int = 1, batched: bool = True) -> dict:
    """Median seconds to prefill `tokens` tokens in `chunk`-token steps (and the last chunk's seconds); with
    `profile` (a directory) one more run's kernels (`profile_run`). `seqs` > 1: that many prompts side by side in
    the same steps, of tokens, tokens - 1, ... tokens (distinct lengths, as a burst of chats arrives; padded to one
    batch by `StepBatch.ragged`), each step `chunk` tokens of every unfinished prompt."""
    import torch

    from stage_worker.local_engine import LocalEngine

    g = torch.Generator().manual_seed(0)
    lengths = [max(1, tokens - i) for i in range(seqs)]
    prompts = [torch.randint(10, model.cfg.vocab_size - 10, (n,), generator=g).tolist() for n in lengths]
    engine = LocalEngine([model], max_seqs=seqs, max_tokens=tokens + 1, sparse_prefill=sparse,
                         batched_prefill=batched)

    def one_run() -> float:
        """The run's seconds; returns the last step's."""
        for i in range(seqs):
            engine.add(i)
        last = 0.0
        for s in range(0, tokens, chunk):
            t = time.perf_counter()
            engine.step([(i, p[s:s + chunk]) for i, p in enumerate(prompts) if s < len(p)])
            _sync(device)
            last = time.perf_counter() - t
        for i in range(seqs):
            engine.release(i)
        return last

    totals, lasts = [], []
    for run in range(runs + 1):                                   # run 0 is the warm-up
        start = time.perf_counter()
        last = one_run()
        total = time.perf_counter() - start
        if run:
            totals.append(total)
            lasts.append(last)
    out = {"tokens": tokens, "seqs": seqs, "lengths": lengths, "chunk": chunk, "sparse_prefill": sparse,
           "batched_prefill": batched,
           "seconds": statistics.median(totals), "last_chunk_seconds": statistics.median(lasts), "runs": totals,
           "tokens_per_second": sum(lengths) / statistics.median(totals)}
    if profile:
        name = f"prefill_{tokens}{f'x{seqs}' if seqs > 1 else ''}_{'sparse' if sparse else 'dense'}.txt"
        out["profile"] = profile_run(one_run, Path(profile) / name)
        out["host_profile"] = host_profile(one_run, Path(profile) / f"host_{name}")
    engine = None                                     # (the closure's cell too) before the cache is emptied
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def profile_run(fn, path: Path, top: int = 25) -> dict:
    """One run of `fn` under torch.profiler (`decode.kernels_per_step`, CUDA kernels only): the kernels by GPU time
    written to `path` as a table, the first `top` printed; returns the kernel count, their GPU time and the top."""
    from decode import kernels_per_step

    count, rows, busy_us = kernels_per_step(fn, top=10 ** 6)
    lines = [f"{count} kernels, {busy_us / 1e3:.2f} ms of GPU time; by GPU time:",
             f"{'total us':>11} {'%':>6} {'count':>7}  name"]
    lines += [f"{r['total_us']:>11.1f} {100 * r['total_us'] / max(busy_us, 1e-9):>6.1f} {r['count']:>7}  {r['name']}"
              for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: top + 2]) + f"\n(all {len(rows)} kernel names in {path})", flush=True)
    return {"kernels": count, "kernel_seconds": busy_us / 1e6, "top": rows[:top], "table": str(path)}


def host_profile(fn, path: Path, top: int = 15) -> dict:
    """One run of `fn` under cProfile: the Python functions by own time and by cumulative time written to `path`,
    the first `top` by own time printed. Why: a short prompt's prefill is host-bound (h200-22 call 2: the 48-layer
    reports-mixed four-prompt step 0.32 s against 39 ms of GPU time), and the kernel table cannot say where the
    host's time goes; time inside `item` / `tolist` / `cpu` / `synchronize` is the host waiting for the GPU."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    seconds = time.perf_counter() - t0
    text = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(60)
        text[key] = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"one run under cProfile: {seconds:.3f} s\n\n== by own time\n{text['tottime']}\n"
                    f"== by cumulative time\n{text['cumulative']}")
    lines = [ln for ln in text["tottime"].splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    print(f"host: one run under cProfile {seconds:.3f} s; by own time:\n" + "\n".join(lines[start:start + top + 1])
          + f"\n(more in {path})", flush=True)
    return {"seconds": seconds, "table": str(path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the built-in demo model)")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="4096,16384", help="comma list of prompt lengths")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per step (a server's max_num_batched_tokens)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=1,
                    help="prompts side by side in the same steps (lengths tokens, tokens - 1, ...: a burst of chats)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a cluster config key for the stage (repeatable), e.g. --set dummy_quant=reports-mixed")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="one more run per row under torch.profiler (kernels by GPU time) and one under cProfile "
                         "(Python functions by host time) to DIR, the tops printed")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.profile and not args.device.startswith("cuda"):
        ap.error("--profile lists CUDA kernels: it needs --device cuda")
    from cluster_sets import parse_sets

    extra: dict = {"load_format": args.load_format, "ple_service": False,     # the PLE tables in-process
                   **parse_sets(args.set, ap.error)}

    import tempfile

    import torch

    from gateway.launcher import ServeOptions, build_cluster_config
    from shared.cli import ensure_builtin_model
    from shared.model_config import load_config
    from stage_worker.stage_loader import load_stage

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else ensure_builtin_model()
    with tempfile.TemporaryDirectory() as run_dir:            # the endpoints' names only: nothing is served
        try:
            cluster = build_cluster_config(ServeOptions(model=path, device=args.device, extra=extra), Path(run_dir))
        except (TypeError, ValueError) as exc:                # an unknown key, a value the config refuses
            ap.error(f"--set: {exc}")
    model = load_stage(cluster, 0, load_config(path))
    print(f"{'tokens':>8} {'seqs':>5} {'chunk':>6} {'sparse':>6} {'seconds':>9} {'tok/s':>9} {'last chunk s':>13}",
          flush=True)
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        for sparse in (True, False):
            r = measure(model, args.device, n, args.chunk, args.runs, sparse, args.profile, args.seqs,
                        cluster.batched_prefill)
            rows.append(r)
            print(f"{r['tokens']:>8} {r['seqs']:>5} {r['chunk']:>6} {str(r['sparse_prefill']):>6} {r['seconds']:>9.2f} "
                  f"{r['tokens_per_second']:>9.0f} {r['last_chunk_seconds']:>13.3f}", flush=True)
    if args.out:
        meta = {"model": str(path), "device": args.device, "load_format": args.load_format, "set": args.set,
                "kernels": cluster.kernels, "host": platform.node(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
