"""How far a quantized checkpoint's predictions are from its float original (issue 17), measured as the reports do:
mean KL divergence of the quantized model's next-token distribution from the original's over held-out text (the
reports: 0.0149 nats for their mixed INT4 release), and the greedy agreement rate (top-1 equal).

    python bench/quant_quality.py [--model DIR] [--scheme reports-mixed] [--text KIND=PATH ...] [--out FILE]

Default model: the built-in demo model; default text: this repository's own documentation and Python sources (the
demo model never trained on them). The checkpoint is quantized with `moepipe quantize` into a temporary directory;
both models run teacher-forced on the CPU in float32, in windows of `--window` tokens (each a fresh sequence), at
most `--tokens` tokens a kind. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.cli import ensure_builtin_model  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.checkpoint.quantize import quantize_checkpoint  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402
from stage_worker.route_stats import read_texts  # noqa: E402


def windows(tok: Tokenizer, files: list[Path], window: int, limit: int) -> list[list[int]]:
    ids: list[int] = []
    for f in files:
        ids += tok.encode(f.read_text(errors="replace"))
        if len(ids) >= limit:
            break
    ids = ids[:limit]
    return [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]


def logprobs(model, seq: list[int]) -> torch.Tensor:
    engine = LocalEngine([model], max_seqs=1, max_tokens=len(seq) + 8)
    engine.add(0)
    return torch.log_softmax(engine.step([(0, seq)], all_logits=True).float(), -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model, as "
                                                   "`moepipe serve` copies it under MOEPIPE_HOME)")
    ap.add_argument("--scheme", default="reports-mixed")
    ap.add_argument("--text", action="append", default=None, help="KIND=PATH (a file or a directory), repeatable")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per kind")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.model = args.model or str(ensure_builtin_model())     # loading writes the PLE expansion beside it
    texts = read_texts(args.text or [f"docs={ROOT / 'docs'}", f"code={ROOT / 'stage_worker'}"])
    texts = {k: [f for f in v if f.suffix in (".md", ".py", ".txt", "")] or v for k, v in texts.items()}
    tok = Tokenizer.from_dir(args.model)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        qdir = Path(tmp) / "q"
        summary = quantize_checkpoint(Path(args.model), qdir, args.scheme)
        orig = load_model(args.model, LoadOptions(dtype=torch.float32))
        quant = load_model(qdir, LoadOptions(dtype=torch.float32))
        rows = []
        print(f"{args.model} vs {args.scheme} ({summary['bytes_in'] / 2**20:.1f} -> {summary['bytes_out'] / 2**20:.1f} "
              f"MiB of tensors; groups {', '.join(summary['groups'])})")
        print(f"{'kind':>8} {'tokens':>7} {'mean KL nats':>13} {'p99 KL':>8} {'top-1 agree':>12} {'CE orig':>8} "
              f"{'CE quant':>9}")
        with torch.inference_mode():
            for kind, files in texts.items():
                kls, agree, ce_o, ce_q, n = [], 0, 0.0, 0.0, 0
                for seq in windows(tok, files, args.window, args.tokens):
                    p, q = logprobs(orig, seq)[:-1], logprobs(quant, seq)[:-1]
                    target = torch.tensor(seq[1:])
                    kls.append((p.exp() * (p - q)).sum(-1))
                    agree += int((p.argmax(-1) == q.argmax(-1)).sum())
                    ce_o -= float(p.gather(1, target[:, None]).sum())
                    ce_q -= float(q.gather(1, target[:, None]).sum())
                    n += len(seq) - 1
                kl = torch.cat(kls)
                row = {"kind": kind, "tokens": n, "mean_kl_nats": float(kl.mean()),
                       "p99_kl_nats": float(kl.quantile(0.99)), "top1_agreement": agree / n,
                       "ce_original": ce_o / n, "ce_quantized": ce_q / n}
                rows.append(row)
                print(f"{kind:>8} {n:>7} {row['mean_kl_nats']:>13.4f} {row['p99_kl_nats']:>8.3f} "
                      f"{100 * row['top1_agreement']:>11.1f}% {row['ce_original']:>8.3f} {row['ce_quantized']:>9.3f}")
    meta = {"command": " ".join(sys.argv), "model": args.model, "scheme": args.scheme, "groups": summary["groups"],
            "host": platform.node(), "seconds": time.time() - t0, "window": args.window}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
