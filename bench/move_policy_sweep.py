"""Run-time move policies for experts in host RAM, replayed on the CPU against the routing `bench/expert_offload.py`
drives the full shape with (the demo traces mapped onto 512 experts and top-10, its docstring): host reads and moves
a token for each (interval, half-life, margin, moves a round) at a host share, the cold set chosen as
`bench/expert_offload.py` chooses it (the least used experts on other text of the same kinds). The H200 measured
the default 1:128:0.5 at 2.36 reads and 2.15 moves a token (16 layers, 10%; bench/results/h200-13/D); this replay
gives 2.26 / 2.09 for it, so policies can be compared here before a device call.

    python bench/move_policy_sweep.py --layers 16 --share 0.1 --out bench/results/move_policy_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from expert_cache_sim import Policy, replay  # noqa: E402
from expert_offload import full_shape_trace  # noqa: E402


def fit_counts(layers: int, experts: int, top_k: int) -> np.ndarray:
    """[L, E] kind-normalised selection counts on demo tokens 100k on (what expert_offload's cold sets use)."""
    score = np.zeros((layers, experts))
    for ids in full_shape_trace(layers, experts, top_k, 20000, start=100000).values():
        for layer in range(layers):
            c = np.bincount(ids[:, layer].ravel(), minlength=experts)
            score[layer] += c / c.sum()
    return score


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--share", type=float, default=0.1, help="share of each layer's experts in host RAM")
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=128)
    ap.add_argument("--steps", type=int, default=384)
    ap.add_argument("--half-lives", default="32,128,512")
    ap.add_argument("--margins", default="0.25,0.5,1")
    ap.add_argument("--per-round", default="1,2")
    ap.add_argument("--intervals", default="1,4")
    ap.add_argument("--out", default=str(ROOT / "bench/results/move_policy_sweep.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    trace = full_shape_trace(args.layers, args.experts, args.top_k, args.warmup + args.steps)
    kind = sorted(trace)[0]                 # batch 1 in bench/expert_offload.py decodes the first kind
    ids = trace[kind]
    capacity = args.experts - int(round(args.experts * args.share))
    counts = fit_counts(args.layers, args.experts, args.top_k)
    per_tok = args.layers * args.top_k
    rows = [{"policy": "static", **replay(ids[args.warmup:], args.experts, capacity, Policy("static", "static"),
                                          counts)}]
    for every, hl, margin, pr in itertools.product(
            [int(x) for x in args.intervals.split(",")], [float(x) for x in args.half_lives.split(",")],
            [float(x) for x in args.margins.split(",")], [int(x) for x in args.per_round.split(",")]):
        p = Policy(f"{every}:{hl:g}:{margin:g}x{pr}", "swap", hl, every, margin, pr)
        rows.append({"policy": p.name, **replay(ids, args.experts, capacity, p, counts, skip=args.warmup)})
    print(f"{args.layers} layers, {args.experts} experts, top-{args.top_k}, {args.share:.0%} in host RAM, "
          f"trace kind {kind}; policy interval:half-life:margin x moves a round")
    print(f"{'policy':>16} {'reads/token':>12} {'moves/token':>12}")
    for r in rows:
        r["reads_per_token"] = (1 - r["hit_rate"]) * per_tok
        r["moves_per_token_all_layers"] = r["moves_per_token"] * args.layers
        print(f"{r['policy']:>16} {r['reads_per_token']:>12.2f} {r['moves_per_token_all_layers']:>12.2f}")
    out = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                    "machine": platform.node(), "seconds": round(time.time() - t0, 1), **vars(args)},
           "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
