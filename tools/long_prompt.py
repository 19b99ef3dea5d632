"""Time to first token of one long system prompt against a running server, as a coding agent's first request is
(qwen-code's is about 25,000 tokens: system prompt, tool schemas, environment). The prompt is this repository's
docs, repeated, cut to about --tokens tokens of the served model's tokenizer.

    moepipe serve --stages 2 &
    python tools/long_prompt.py --url http://127.0.0.1:8000 --tokens 25000

Prints prompt tokens (from the usage chunk), TTFT, total time, finish reason and the answer's start.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHARS_PER_TOKEN = 2.48         # the demo tokenizer on these docs (measured: 75,000 chars -> 30,272 tokens)


def system_prompt(chars: int) -> str:
    """`chars` characters of the docs, whole files repeated: fixed text, so runs are comparable."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    return (text * (chars // len(text) + 1))[:chars]


def main(argv: list[str] | None = None) -> int:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model-name", default="moepipe")
    ap.add_argument("--tokens", type=int, default=25000, help="about this many prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    client = OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    messages = [{"role": "system", "content": system_prompt(int(args.tokens * CHARS_PER_TOKEN))},
                {"role": "user", "content": "List the files in /tmp."}]
    t0 = time.perf_counter()
    first, text, usage, finish = None, [], None, None
    for chunk in client.chat.completions.create(model=args.model_name, messages=messages, stream=True,
                                                max_tokens=args.max_tokens, seed=args.seed,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            if first is None:
                first = time.perf_counter()         # the role chunk: sent once the first token exists
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    print(f"prompt_tokens={usage.prompt_tokens if usage else '?'} ttft={first - t0:.2f}s total={total:.2f}s "
          f"completion_tokens={usage.completion_tokens if usage else '?'} finish_reason={finish}")
    print("answer:", "".join(text)[:200].replace("\n", "\\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
