"""Record what a served model answers greedily to fixed prompts, and compare two such records.

    python tools/greedy_transcript.py record --model DIR --stages 2 --device cuda --out one_gpu.json
    CUDA_VISIBLE_DEVICES=0,1 python tools/greedy_transcript.py record ... --out two_gpus.json
    python tools/greedy_transcript.py compare one_gpu.json two_gpus.json [--logprob-tol 0.05]

Why: the two-GPU run (issue 7) must give the same greedy tokens and logprobs as the one-GPU two-stage run, within
bf16 tolerance. `record` starts `moepipe serve` itself (real processes), sends the prompts through the official
client at temperature 0 with logprobs, and writes tokens, their logprobs and the serving layout. `compare` reports
the first diverging token of each prompt and the largest logprob difference before it, and exits 1 if a prompt
diverges or a logprob differs by more than `--logprob-tol` (greedy ties can flip between devices whose reductions
round differently, which is why the tolerance is on logprobs and the report names the step).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "def fibonacci(n):",
    "The pipeline splits the model's layers",
    "import json\nimport sys\n\n",
    "Mixture-of-experts layers route each token to",
    "# TODO: handle the empty case\n",
    "Die Einstellungen werden gespeichert, wenn",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(model: Path | None, stages: int, device: str, max_tokens: int, out: Path) -> dict:
    from openai import OpenAI

    from gateway.launcher import Cluster, ServeOptions
    from shared.cli import ensure_builtin_model

    model = model or ensure_builtin_model()
    with Cluster(ServeOptions(model=model, stages=stages, device=device, port=_port())) as cluster:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=600)
        rows = []
        for prompt in PROMPTS:
            r = client.completions.create(model="moepipe", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True})
            lp = r.choices[0].logprobs
            rows.append({"prompt": prompt, "tokens": lp.tokens, "logprobs": lp.token_logprobs})
        layout = [{"start": s.start, "end": s.end, "device": s.device} for s in cluster.cluster.stages]
    data = {"model": str(model), "stages": stages, "device": device, "layout": layout, "max_tokens": max_tokens,
            "results": rows}
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def compare(a: dict, b: dict, tol: float) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for ra, rb in zip(a["results"], b["results"]):
        n = min(len(ra["tokens"]), len(rb["tokens"]))
        first = next((i for i in range(n) if ra["tokens"][i] != rb["tokens"][i]), None)
        upto = n if first is None else first
        worst = max((abs(x - y) for x, y in zip(ra["logprobs"][:upto], rb["logprobs"][:upto])), default=0.0)
        same = first is None and len(ra["tokens"]) == len(rb["tokens"])
        ok = ok and same and worst <= tol
        where = "all tokens equal" if same else f"first difference at token {first}"
        lines.append(f"{ra['prompt'][:40]!r}: {where}; max |logprob diff| {worst:.4f}")
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", type=Path, default=None)
    rec.add_argument("--stages", type=int, default=2)
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--max-tokens", type=int, default=32)
    rec.add_argument("--out", type=Path, required=True)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    cmp_.add_argument("--logprob-tol", type=float, default=0.05)
    args = ap.parse_args()
    if args.cmd == "record":
        data = record(args.model, args.stages, args.device, args.max_tokens, args.out)
        print(f"recorded {len(data['results'])} prompts; layout {data['layout']}; wrote {args.out}")
        return 0
    a, b = json.loads(args.a.read_text()), json.loads(args.b.read_text())
    ok, lines = compare(a, b, args.logprob_tol)
    print(f"A: {a['layout']}\nB: {b['layout']}")
    print("\n".join(lines))
    print("same greedy tokens, logprobs within tolerance" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
