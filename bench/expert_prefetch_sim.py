"""Would prefetching host experts one layer ahead take host reads off the decode step's critical path? A CPU study
on a trained checkpoint (default: the built-in demo model) for issue 16.

    python bench/expert_prefetch_sim.py                       # demo model, this repository's docs and shared/*.py
    python bench/expert_prefetch_sim.py --model DIR --text 'corpus/*.txt' --tokens 32768 --shares 0.1,0.5

Why: with moves on read a step still reads ~1.6 host experts a token at 10% of expert bytes in host RAM (h200-25),
each ~50 us of PCIe on the critical path, because a layer's experts are known only after its own router. A layer's
router applied to the PREVIOUS MoE layer's input (the residual stream changes little from one layer to the next)
names most of them a layer early, when a copy engine could fetch them beside the step. This measures how often.

What it does: prefills windows of held-out text (text the demo model never trained on) once, recording what each
MoE layer selected and its prediction one layer ahead (`stage_worker/route_stats.py`, as `tools/route_trace.py
--predict` records it): per token and MoE layer l, l's router on layer l-1's input, its top-k and top-2k (the first
MoE layer: its router on the normed hidden state entering its decoder layer; until 2026-12-07 it had no prediction),
and, as a predictor that costs no GEMV, the experts layer l chose for the previous token. Then per share of experts in host RAM (cold set: the least used experts of
the first half of the text, replay on the second half) the server's moves on read (`expert_cache_sim._replay_claim`,
the default policy: a round every token, half-life 128, margin 0.5, two spares) with each predictor's experts
prefetched: host reads left on the critical path a token, prefetches a token (PCIe beside the step) and how many
of them were used. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from expert_cache_sim import Policy, _replay_claim, top_c, usage  # noqa: E402

DEFAULT_TEXT = ("docs/*.md", "shared/*.py")        # held-out text: the demo model trained on its own corpus


def predictions(model, windows: list[list[int]], batch: int = 4) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Prefill `windows` as fresh sequences once (`route_stats.trace_windows` with its predictions one layer ahead,
    2k wide): (the selected expert ids [tokens, layers, k] that the layers reported, {"top-1" .. "top-(k-1)",
    "top-k", "top-2k", "previous token"}: [tokens, layers, m] expert ids, -1: no prediction). top-r is the first r
    of top-2k (the router's order, best first)."""
    from stage_worker.route_stats import moe_layers, trace_windows

    k = moe_layers(model)[0][1].top_k
    actual, wide = trace_windows(model, windows, batch, predict=2 * k)
    prev = np.full_like(actual, -1)
    prev[1:] = actual[:-1]
    # each token's best r < k only (`expert_prefetch_top`): fewer copies, of the likelier experts
    fewer = {f"top-{r}": wide[..., :r] for r in range(1, k)}
    return actual, {**fewer, "top-k": wide[..., :k], "top-2k": wide, "previous token": prev}


def recall(actual: np.ndarray, pred: np.ndarray) -> list[float]:
    """Per layer: the share of actual selections that the prediction named."""
    hit = (actual[:, :, :, None] == pred[:, :, None, :]).any(-1)
    return [float(hit[:, l].mean()) for l in range(actual.shape[1])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--text", default=",".join(DEFAULT_TEXT), help="comma list of globs, relative to the repo root")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512, help="tokens a prefilled sequence")
    ap.add_argument("--shares", default="0.1,0.25,0.5", help="shares of each layer's experts in host RAM")
    ap.add_argument("--warmup", type=int, default=1024, help="replayed tokens that only warm the counts up")
    ap.add_argument("--out", default=str(ROOT / "bench/results/expert_prefetch_sim.json"))
    args = ap.parse_args(argv)
    from shared.cli import ensure_builtin_model
    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    model_dir = Path(args.model) if args.model else Path(ensure_builtin_model())
    files = sorted({f for g in args.text.split(",") for f in glob.glob(str(ROOT / g))})
    if not files:
        ap.error(f"--text {args.text!r}: no files")
    shares = [float(s) for s in args.shares.split(",")]
    t0 = time.time()
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("\n".join(Path(f).read_text(errors="replace") for f in files))[: args.tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
    model = load_model(model_dir, LoadOptions(device="cpu"))
    actual, preds = predictions(model, windows)
    T, L, k = actual.shape
    E = int(model.cfg.num_experts)
    half = T // 2
    if args.warmup >= T - half:
        ap.error(f"--warmup {args.warmup}: the replay has only {T - half} tokens (half of the {T} read: --tokens "
                 f"{args.tokens}), so every result would be 0; use a warm-up below that, or more --tokens")
    fit, run = actual[:half], actual[half:]
    policy = Policy("onread-1:128:0.5", "swap", half_life=128, every=1, margin=0.5)
    recalls = {name: recall(run, p[half:]) for name, p in preds.items()}
    rows = []
    for share in shares:
        resident = top_c(usage(fit, E), max(0, E - round(share * E)))
        for name, p in [("none", None), *preds.items()]:
            r = _replay_claim(run, E, resident, policy, skip=args.warmup, predicted=None if p is None else p[half:])
            rows.append({"host_share": share, "prefetch": name, **r})
    print(f"{model_dir}: {T} tokens ({len(files)} files), {L} MoE layers, top-{k} of {E}; replay {T - half} tokens "
          f"after {args.warmup} warm-up")
    print("recall of the actual selections, per MoE layer: " + "; ".join(
        f"{n} " + " ".join(f"{x:.2f}" for x in v) for n, v in recalls.items()))
    print(f"{'host share':>10} {'prefetch':>15} {'critical reads/tok':>19} {'prefetches/tok':>15} {'used':>6} "
          f"{'moves/tok':>10}")
    for r in rows:
        print(f"{r['host_share']:>10.2f} {r['prefetch']:>15} {r['critical_reads_per_token']:>19.2f} "
              f"{r['prefetches_per_token']:>15.2f} {r['prefetches_used_per_token']:>6.2f} "
              f"{r['moves_per_token'] * L:>10.2f}")
    out = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                    "model": str(model_dir), "files": len(files), "tokens": T, "moe_layers": L, "num_experts": E,
                    "top_k": k, "policy": policy.name, "machine": platform.node(),
                    "seconds": round(time.time() - t0, 1)}, "recall": recalls, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
