"""What one decode launch costs on this GPU as a function of the bytes it reads: the floor a chain of small kernels
pays, with and without programmatic dependent launch (PDL). Issue 17's yardstick.

    python3 bench/launch_floor.py [--sizes-mb 0,0.25,0.5,1,2,4,8,16,32] [--chain 64] [--out bench/results/launch_floor.json]

Why: the reports-mixed 48-layer step at batch 1 is ~980 launches reading 5.42 GB (5.6 MB a launch on average) in
~5.1 ms back to back, 21% of the HBM roofline, while the bf16 path (2.2x the bytes, as many launches) reaches 45%.
Whether fusing launches (fewer, bigger) or making each kernel read faster is the way to the 45% bar depends on
two numbers this measures: the time of a launch that reads nothing in a graphed chain (the floor), and how fast a
launch of S bytes runs (t(S) ~ floor + S / bandwidth).

Each row: a CUDA graph of `--chain` launches of one probe kernel, each reading its own S bytes (a pool of buffers
larger than the L2 is walked, so every launch reads HBM) and writing one word a program that the next launch reads
after its wait, as the model's decode kernels do: with PDL the first tile of its bytes is loaded before
`griddepcontrol.wait` (a weight nothing earlier writes), the rest after. Programs: `--programs-per-sm` per SM, a
grid-stride loop of 16 KB tiles. Reported: microseconds a launch (median of `--runs` replays), the GB/s that makes,
and a least-squares fit of floor + S / bandwidth over the sizes >= 1 MB. The probe kernel lives here, not in
stage_worker/kernels/: it computes nothing the model uses (an XOR of the words, so the loads cannot be dropped;
tests/test_launch_floor.py checks it under the interpreter).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stage_worker.kernels.common import INTERPRET, fix_interpreter_loop_bounds, pdl_wait, sm_count  # noqa: E402

if INTERPRET:
    fix_interpreter_loop_bounds()      # the probe's loop starts at its program id

TILE = 4096                       # int32 words a program loads a step (16 KB)


@triton.jit
def _probe_kernel(w_ptr, prev_ptr, out_ptr, n_words, PROGRAMS: tl.constexpr, TILE: tl.constexpr,
                  PDL: tl.constexpr):
    """out[p] = prev[p] ^ (XOR of the words program p reads: tiles p, p + PROGRAMS, ... of w)."""
    p = tl.program_id(0)
    offs = p * TILE + tl.arange(0, TILE)
    acc = tl.load(w_ptr + offs, mask=offs < n_words, other=0)          # the first tile: before the wait
    pdl_wait(PDL)
    for start in range((p + PROGRAMS) * TILE, n_words, PROGRAMS * TILE):
        offs = start + tl.arange(0, TILE)
        acc ^= tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    x = tl.reduce(acc, 0, _xor)
    tl.store(out_ptr + p, tl.load(prev_ptr + p) ^ x)


@triton.jit
def _xor(a, b):
    return a ^ b


def probe(w: torch.Tensor, prev: torch.Tensor, out: torch.Tensor, programs: int, pdl: bool = False) -> None:
    """One launch over the int32 words of w (`_probe_kernel`); prev and out: int32 [programs]."""
    _probe_kernel[(programs,)](w, prev, out, w.numel(), PROGRAMS=programs, TILE=TILE, PDL=pdl, launch_pdl=pdl,
                               num_warps=4)


def probe_ref(w: torch.Tensor, prev: torch.Tensor, programs: int) -> torch.Tensor:
    """What `probe` writes: per program the XOR of its tiles' words (tiles p, p + programs, ...), XOR prev."""
    import numpy as np

    words = np.pad(w.cpu().numpy(), (0, (-w.numel()) % (programs * TILE))).reshape(-1, programs, TILE)
    acc = np.bitwise_xor.reduce(words.transpose(1, 0, 2).reshape(programs, -1), axis=1)
    return prev ^ torch.from_numpy(acc.astype(np.int32)).to(prev.device)


def chain_us(size: int, chain: int, programs: int, pdl: bool, runs: int, pool_bytes: int) -> float:
    """Microseconds a launch in a graphed chain of `chain` launches reading `size` bytes each from a pool of
    distinct buffers (at least `pool_bytes` in all, so the L2 holds none of them when read)."""
    from graph_timing import graph_us

    words = size // 4
    n_bufs = max(2, -(-pool_bytes // size)) if size else 2
    pool = torch.randint(-2 ** 31, 2 ** 31 - 1, (n_bufs, words), dtype=torch.int32, device="cuda")
    flip = [torch.zeros(programs, dtype=torch.int32, device="cuda") for _ in range(2)]

    def one(i: int) -> None:
        probe(pool[i % n_bufs], flip[i % 2], flip[(i + 1) % 2], programs, pdl)

    return graph_us(one, calls=chain, runs=runs, warmup=2)


def fit(rows: list[dict], key: str) -> tuple[float, float]:
    """Least squares t = floor + bytes / bw over rows >= 1 MB: (floor us, bw GB/s)."""
    pts = [(r["bytes"], r[key]) for r in rows if r["bytes"] >= 2 ** 20]
    if len(pts) < 2:
        return float("nan"), float("nan")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / max(sum((x - mx) ** 2 for x, _ in pts), 1e-30)
    return my - slope * mx, (1e-3 / slope) if slope > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="0,0.25,0.5,1,2,4,8,16,32")
    ap.add_argument("--chain", type=int, default=64, help="launches in one graph")
    ap.add_argument("--programs-per-sm", default="1,4", help="comma list")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--pool-mb", type=int, default=512, help="bytes the chain walks through (> the L2)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/launch_floor.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (tests/test_launch_floor.py checks the probe kernel on the CPU)")
    from stage_worker.kernels.common import _pdl_device

    sizes = [int(float(s) * 2 ** 20) for s in args.sizes_mb.split(",")]
    sms = sm_count(torch.device("cuda"), cpu=1)
    pdl_ok = _pdl_device(torch.empty(1, device="cuda"))
    rows = []
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, chain of {args.chain} launches a graph, PDL "
          f"{'available' if pdl_ok else 'not available'}")
    print(f"{'MB':>6} {'progs/SM':>8} {'plain us':>9} {'GB/s':>6} {'PDL us':>8} {'GB/s':>6}")
    for per_sm in (int(p) for p in args.programs_per_sm.split(",")):
        for size in sizes:
            r = {"bytes": size, "programs_per_sm": per_sm}
            for name, pdl in (("plain_us", False), ("pdl_us", True)):
                if pdl and not pdl_ok:
                    continue
                r[name] = chain_us(size, args.chain, per_sm * sms, pdl, args.runs, args.pool_mb * 2 ** 20)
            rows.append(r)
            gbs = {k: (size / (r[k] * 1e-6) / 1e9 if r.get(k) else 0.0) for k in ("plain_us", "pdl_us")}
            print(f"{size / 2 ** 20:>6.2f} {per_sm:>8} {r['plain_us']:>9.2f} {gbs['plain_us']:>6.0f} "
                  f"{r.get('pdl_us', float('nan')):>8.2f} {gbs['pdl_us']:>6.0f}", flush=True)
    fits = {}
    for per_sm in sorted({r["programs_per_sm"] for r in rows}):
        sel = [r for r in rows if r["programs_per_sm"] == per_sm]
        for key in ("plain_us", "pdl_us"):
            if all(key in r for r in sel):
                floor, bw = fit(sel, key)
                fits[f"{key}@{per_sm}"] = {"floor_us": floor, "bandwidth_gbps": bw}
                print(f"fit {key} at {per_sm} programs/SM: {floor:.2f} us + S / {bw:.0f} GB/s")
    out = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                    "device": torch.cuda.get_device_name(), "sms": sms, "chain": args.chain,
                    "machine": platform.node()}, "rows": rows, "fits": fits}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
