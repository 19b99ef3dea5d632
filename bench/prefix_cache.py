"""Prefix cache A/B on a coding agent's conversation: time to first token of every turn, with and without it.

An agent sends its whole conversation every turn: a long system prompt (tools, instructions, files), then each turn
the replies and tool results so far and one new message. Without the prefix cache every turn's prefill computes the
whole prompt again; with it (`enable_prefix_caching`, shared/prefix_cache.py) a turn restores the state saved after
the previous turn's prompt and computes only what is new. The benchmark starts the cluster once per side (the same
model, stages and seed; `--set` keys apply to both), plays the same conversation on each (the system prompt is a
block of the Python standard library's sources; each user message new text; each assistant message the model's own
greedy reply, as an agent sends it back), and reports per turn the prompt tokens, the tokens the server served from
the cache (usage.prompt_tokens_details.cached_tokens) and TTFT from the client (first streamed chunk).

    python bench/prefix_cache.py                                  # the built-in demo model, two CPU stages
    python bench/prefix_cache.py --model M --device cuda --stages 1 --system-chars 90000 --turns 8
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


def converse(url: str, model: str, system: str, turns: int, user_chars: int, max_tokens: int, seed: int) -> list:
    """Play the conversation; per turn (prompt tokens, cached tokens, TTFT s, reply)."""
    import openai

    from serve import unseen_text

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": unseen_text(user_chars, seed * 1000 + turn)})
        t0 = time.perf_counter()
        ttft, reply, usage = None, [], None
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                reply.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) or 0
        out.append({"turn": turn, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached, "ttft_s": ttft})
        messages.append({"role": "assistant", "content": "".join(reply)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--model-name", default="moepipe")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--system-chars", type=int, default=24000, help="characters of the system prompt")
    ap.add_argument("--user-chars", type=int, default=600, help="characters of each new user message")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a cluster config key for both sides (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix_cache.json"))
    args = ap.parse_args()

    from cluster_sets import parse_sets
    from gateway.launcher import Cluster, ServeOptions
    from serve import _stdlib_block
    from shared.cli import ensure_builtin_model

    model = Path(args.model) if args.model else ensure_builtin_model()
    system = "You are a coding agent. The project's sources follow.\n\n" + _stdlib_block(args.system_chars, args.seed)
    sides = {}
    for name, on in (("off", False), ("on", True)):
        extra = {**parse_sets(args.set, ap.error), "enable_prefix_caching": on}
        with Cluster(ServeOptions(model=model, stages=args.stages, device=args.device, port=args.port,
                                  extra=extra)) as cluster:
            converse(cluster.url, args.model_name, "warm-up", 1, 200, 4, seed=999)
            sides[name] = converse(cluster.url, args.model_name, system, args.turns, args.user_chars,
                                   args.max_tokens, args.seed)
        print(f"done: prefix cache {name}", flush=True)

    print(f"\n{'turn':>4} {'prompt tok':>10} {'cached':>8} {'TTFT off s':>11} {'TTFT on s':>10} {'speed-up':>8}")
    for off, on in zip(sides["off"], sides["on"]):
        print(f"{off['turn']:>4} {on['prompt_tokens']:>10} {on['cached_tokens']:>8} {off['ttft_s']:>11.3f} "
              f"{on['ttft_s']:>10.3f} {off['ttft_s'] / on['ttft_s']:>7.1f}x")
    later = [(off["ttft_s"], on["ttft_s"]) for off, on in zip(sides["off"][1:], sides["on"][1:])]
    summary = {"median_ttft_later_turns_off_s": statistics.median(a for a, _ in later) if later else None,
               "median_ttft_later_turns_on_s": statistics.median(b for _, b in later) if later else None}
    print(f"later turns, median TTFT: off {summary['median_ttft_later_turns_off_s']:.3f} s, "
          f"on {summary['median_ttft_later_turns_on_s']:.3f} s" if later else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "host": platform.node(),
                                    "cpu": platform.processor(), "turns": sides, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
