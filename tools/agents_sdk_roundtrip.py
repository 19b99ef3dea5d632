"""One tool-call round trip of the openai-agents SDK against a running moepipe server: the agent offers a
`run_shell` tool (the demo model's fine-tune knows it), the model calls it, the SDK runs it in a scratch directory
and sends the output back, the model answers. Exits 0 only if all four happened. The SDK is in the test extra
(`tests/test_demo_model.py` runs this script), or put it in a venv of its own (`pip install openai-agents`):

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused \\
        python tools/agents_sdk_roundtrip.py [--stream] [--seed 4] [--chat-completions]

The SDK keeps its defaults apart from the base URL, the key and the model name: it talks to the Responses API
(`POST /v1/responses`, its default in 0.24); `--chat-completions` switches it with
`set_default_openai_api("chat_completions")`. Tracing is off: its default exporter sends every run to api.openai.com.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

PROMPT = "Run the command for this: list directory contents."      # the shape of the fine-tune's tool prompts


async def run(args: argparse.Namespace) -> int:
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
                        set_tracing_disabled)

    if args.chat_completions:
        set_default_openai_api("chat_completions")
    set_tracing_disabled(True)               # traces go to api.openai.com by default: unreachable here
    workdir = tempfile.mkdtemp(prefix="agents-sdk-")
    open(os.path.join(workdir, "notes.txt"), "w").write("hello\n")
    ran: list[str] = []

    @function_tool
    def run_shell(command: str) -> str:
        """Run a shell command and return its output."""
        ran.append(command)
        r = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=10, cwd=workdir)
        return (r.stdout + r.stderr)[:2000] or f"(exit {r.returncode}, no output)"

    settings = ModelSettings(extra_body={"seed": args.seed}) if args.seed is not None else ModelSettings()
    agent = Agent(name="shell", instructions="You are a helpful assistant.", tools=[run_shell],
                  model=args.model, model_settings=settings)
    if args.stream:
        result = Runner.run_streamed(agent, PROMPT, max_turns=4)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, PROMPT, max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    print(f"items: {kinds}")
    print(f"tool ran: {ran}")
    print(f"final: {str(result.final_output)[:300]!r}")
    ok = kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem" and ran
    print("round trip complete" if ok else "round trip NOT complete")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "moepipe"))
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--stream", action="store_true", help="Runner.run_streamed instead of Runner.run")
    ap.add_argument("--chat-completions", action="store_true",
                    help="chat completions instead of the SDK's default Responses API")
    return asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
