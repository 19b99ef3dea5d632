"""What a PLE stage's own decode-row gather costs on the host, per step, by table kind and page state.

`stage_worker/ple_decode_rows.py` `DecodeRowGather.publish` (the `ple_launch_ahead` path a served one-stage GPU run
takes) hashes a decode step's tokens against the n-gram contexts and gathers the rows into the mailbox's rows
(pinned with `--device cuda`): in numpy alone where the table has `gather_into` (`_windows`,
`ngram_hash.hash_windows_numpy`, `gather_into` straight into the mailbox), else, or with `--path torch`, through
torch (`ngram_rows_numpy_batch`, `branch.table.gather`, a copy into the mailbox). This times that real method step
by step, with the hash and the gather timed by thin wrappers around them, so each step splits into hash / gather /
the rest (the copy and Python). `--call` times `DecodeRowGather.__call__` instead (the path without
launch-ahead: the contexts read back, a `to_device` per layer).

Tables (`--states`):
  procedural  the `dummy` load format's `ProceduralTable` (what `bench/serve.py --load-format dummy` serves unless
              `--set dummy_ple_file=true`: the full-shape table is 95 GiB, no file at all)
  cold        a flat file mapped as a checkpoint's expanded table, evicted from the page cache first
              (`ple_service/page_cache.evict`): every row a major fault, a read from the disk
  fresh       the same file in the page cache but mapped anew (never touched by this process): minor faults
  touched     the same rows again through the same mapping: no faults

The file is `--table-gib` of rows (default 4: the full shape's 95 GiB fits neither this VM's RAM nor the GPU
machine's disk) written once by `shared/ple_files.dummy_ple_table` under `--dir`; the hash spec's
`ngram_vocab_size_base` is scaled so its row ids span exactly that file (the same hash work, the same scattered
rows, one page each). Random token ids and contexts, seeded; the same sequence of steps for every state of a batch.

  python bench/ple_decode_gather.py --out bench/results/ple-decode-gather-1/cpu-vm.json
  python bench/ple_decode_gather.py --device cuda --dir /tmp/pdg --out $OUT/ple_decode_gather.json   # the GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stage_worker.ple_decode_rows as pdr  # noqa: E402
from ple_service import page_cache  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from shared.ngram_hash import NgramHashSpec  # noqa: E402
from shared.ple_files import dummy_ple_table  # noqa: E402
from shared.ple_table import open_table  # noqa: E402
from stage_worker.ple_decode_rows import DecodeRowGather, PleMailbox  # noqa: E402
from bench_io import machine, write_json  # noqa: E402  (bench/, this script's directory)

STATES = ("procedural", "cold", "fresh", "touched")


class _Timed:
    """Adds the seconds of each call of `fn` to `acc[key]`."""

    def __init__(self, fn, acc: dict, key: str) -> None:
        self.fn, self.acc, self.key = fn, acc, key

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.acc[self.key] += time.perf_counter() - t0


class _TimedTable:
    """The table with its gathers timed (`gather`: the torch path; `gather_into`: the numpy one)."""

    def __init__(self, table, acc: dict) -> None:
        self.table, self.dtype, self.gather = table, table.dtype, _Timed(table.gather, acc, "gather")
        if hasattr(table, "gather_into"):
            self.gather_into = _Timed(table.gather_into, acc, "gather")


def _steps(spec: NgramHashSpec, batch: int, steps: int, seed: int) -> list[tuple[np.ndarray, list[int]]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, spec.vocab_size, size=(batch, spec.ngram_size - 1), dtype=np.int64),
             rng.integers(0, spec.vocab_size, size=batch).tolist()) for _ in range(steps)]


def _warm_file(path: Path) -> float:
    """Read the whole file once (into the page cache); seconds."""
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def _run(gather: DecodeRowGather, box: PleMailbox | None, acc: dict, seq: list, device: torch.device,
         call: bool, thrash: np.ndarray | None = None) -> dict:
    """Time every step of `seq` through the real method; per-step arrays (us)."""
    batch = seq[0][0].shape[0]
    slots = list(range(batch))
    ctx = gather.contexts
    total, hash_, gat, gc_in = [], [], [], []
    gc_time = [0.0, 0.0]                  # (start of the running collection, seconds of collections so far)

    def on_gc(phase, info):
        if phase == "start":
            gc_time[0] = time.perf_counter()
        else:
            gc_time[1] += time.perf_counter() - gc_time[0]

    gc.callbacks.append(on_gc)
    try:
        for i, (contexts, tokens) in enumerate(seq):
            if call:
                ctx[:batch].copy_(torch.from_numpy(contexts))
            else:
                box.contexts[:batch].copy_(torch.from_numpy(contexts))
            if thrash is not None:            # what a served step does between two gathers to the caches
                thrash.sum()
                thrash[::512] += 1.0
            acc["hash"] = acc["gather"] = 0.0
            g0 = gc_time[1]
            t0 = time.perf_counter()
            if call:
                gather(slots, tokens)
            else:
                gather.publish(box, slots, tokens, i + 1)
            t1 = time.perf_counter()
            if device.type == "cuda" and call:
                torch.cuda.synchronize()      # (outside the timing: the queued copies of __call__)
            total.append(t1 - t0)
            hash_.append(acc["hash"])
            gat.append(acc["gather"])
            gc_in.append(gc_time[1] - g0)
    finally:
        gc.callbacks.remove(on_gc)
    us = {k: np.asarray(v) * 1e6 for k, v in (("total", total), ("hash", hash_), ("gather", gat), ("gc", gc_in))}
    us["rest"] = us["total"] - us["hash"] - us["gather"]
    return us


def _summary(us: dict) -> dict:
    out = {}
    for k, v in us.items():
        out[k] = {"median_us": float(np.median(v)), "p90_us": float(np.percentile(v, 90)),
                  "p99_us": float(np.percentile(v, 99)), "mean_us": float(v.mean()), "max_us": float(v.max())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/fs2"), help="model directory (config.json)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ple-decode-gather"), help="where the table file goes")
    ap.add_argument("--table-gib", type=float, default=4.0, help="size of the file-backed table")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--states", default=",".join(STATES))
    ap.add_argument("--device", default="cpu", help="cuda: the mailbox's rows pinned, as on a GPU stage")
    ap.add_argument("--call", action="store_true", help="time __call__ (no launch-ahead) instead of publish")
    ap.add_argument("--thrash-mib", type=int, default=0,
                    help="stream over this many MiB between steps (outside the timing): the CPU caches as a served "
                         "stage leaves them between two gathers (64: L1/L2 and most of a share of L3 gone)")
    ap.add_argument("--path", choices=("fast", "torch"), default="fast",
                    help="torch: DecodeRowGather's torch path (index_select, copy_) even where a table has the numpy "
                         "one (`gather_into`): the before of an A/B in one checkout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    states = [s for s in args.states.split(",") if s]
    for s in states:
        if s not in STATES:
            ap.error(f"--states: unknown {s!r} (choose from {', '.join(STATES)})")
    batches = [int(b) for b in args.batches.split(",")]

    cfg = load_config(args.model)
    layer = cfg.ple_layer_ids[0]
    spec = NgramHashSpec.from_model_config(cfg, 0)
    dtype = getattr(torch, cfg.dtype)
    dim = cfg.ple_head_dim
    # a spec whose row ids span the file: ngram_vocab_size_base scaled down (primes near it, one per head)
    file_rows_target = int(args.table_gib * 2**30) // (dim * dtype.itemsize)
    small = dataclasses.replace(spec, ngram_vocab_size_base=max(1024, file_rows_target // spec.num_heads - 4096))
    flat = None
    if set(states) - {"procedural"}:
        t0 = time.perf_counter()
        flat = dummy_ple_table(small.padded_rows, dim, dtype, 0 + layer, layer, args.dir)
        path = flat.path
        flat.close()
        print(f"table file {path}: {small.padded_rows} rows x {dim} {cfg.dtype}, "
              f"{small.padded_rows * dim * dtype.itemsize / 2**30:.2f} GiB ({time.perf_counter() - t0:.1f} s to "
              f"write or find)", flush=True)

    thrash = np.ones((args.thrash_mib << 20) // 8) if args.thrash_mib else None
    acc = {"hash": 0.0, "gather": 0.0}
    pdr.ngram_rows_numpy_batch = _Timed(pdr.ngram_rows_numpy_batch, acc, "hash")      # (the torch path's hash)
    pdr.hash_windows_numpy = _Timed(pdr.hash_windows_numpy, acc, "hash")              # (the numpy path's)
    rows_out, results = [], []
    max_b = max(batches)
    for batch in batches:
        seq_full = _steps(spec, batch, args.steps, args.seed + batch)
        seq_small = _steps(small, batch, args.steps, args.seed + batch)
        table = None
        for state in states:
            note = ""
            if state == "procedural":
                table, branch_spec, seq = dummy_ple_table(spec.padded_rows, dim, dtype, layer, layer), spec, seq_full
            else:
                branch_spec, seq = small, seq_small
                if state == "cold":
                    if table is not None and hasattr(table, "close"):
                        table.close()
                    gc.collect()
                    page_cache.evict(path)
                    note = f"resident before {page_cache.resident_fraction([path]):.3f}"
                    table = open_table(path)
                elif state == "fresh":
                    if table is not None and hasattr(table, "close"):
                        table.close()
                    gc.collect()
                    note = f"warmed in {_warm_file(path):.1f} s"
                    table = open_table(path)
                elif state == "touched":
                    if table is None or not hasattr(table, "close"):
                        ap.error("--states: touched follows fresh or cold")
            branch = SimpleNamespace(spec=branch_spec, table=_TimedTable(table, acc), heads=spec.num_heads,
                                     head_dim=dim)
            model = SimpleNamespace(layers={str(layer): SimpleNamespace(ple=branch)})
            cache = SimpleNamespace(ple={layer: SimpleNamespace(
                context=torch.zeros(max_b, spec.ngram_size - 1, dtype=torch.long, device=device))})
            gather = DecodeRowGather(model, cache, [layer], device, numpy=args.path == "fast")
            if gather._fast:                        # the numpy path's hash: the windows and each layer's rows
                gather._windows = _Timed(gather._windows, acc, "hash")
            box = None if args.call else PleMailbox.create(gather, max_b, dtype, device)
            # first calls (lru caches, first allocations) off the record, on rows of another seed
            for contexts, tokens in _steps(branch_spec, batch, 3, args.seed + 7777):
                if args.call:
                    gather(list(range(batch)), tokens)
                else:
                    gather.publish(box, list(range(batch)), tokens, 0)
            us = _run(gather, box, acc, seq, device, args.call, thrash)
            s = _summary(us)
            results.append({"batch": batch, "state": state, "steps": len(seq), "note": note, **s})
            rows_out.append((batch, state, s, note))
            print(f"  B={batch:2d} {state:10s} total med {s['total']['median_us']:7.1f} p90 "
                  f"{s['total']['p90_us']:7.1f} mean {s['total']['mean_us']:7.1f} us  {note}", flush=True)
        if table is not None and hasattr(table, "close"):
            table.close()

    print()
    print(f"{'B':>3} {'state':10s} {'total med':>9} {'p90':>7} {'mean':>7} {'max':>8} {'hash med':>8} "
          f"{'gather med':>10} {'p90':>7} {'rest med':>8} {'gc mean':>7}   (us a step, "
          f"{'__call__' if args.call else 'publish'}, {args.path} path, {device.type}, thrash {args.thrash_mib} MiB)")
    for batch, state, s, _ in rows_out:
        print(f"{batch:3d} {state:10s} {s['total']['median_us']:9.1f} {s['total']['p90_us']:7.1f} "
              f"{s['total']['mean_us']:7.1f} {s['total']['max_us']:8.1f} {s['hash']['median_us']:8.1f} "
              f"{s['gather']['median_us']:10.1f} {s['gather']['p90_us']:7.1f} {s['rest']['median_us']:8.1f} "
              f"{s['gc']['mean_us']:7.2f}")
    if args.out:
        result = {**machine(), "torch": torch.__version__,
                  "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                  "device": device.type, "method": "__call__" if args.call else "publish", "path": args.path,
                  "table_gib": args.table_gib, "steps": args.steps, "thrash_mib": args.thrash_mib, "results": results}
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
