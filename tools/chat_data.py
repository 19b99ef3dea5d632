"""Chat-formatted training text made from the corpus itself, so the demo model learns the shape of a conversation
(an answer after a question, a tool call when tools are offered) and not only to continue documents.

    python tools/chat_data.py --corpus .corpus --model shared/demo_model --show 5      # print a few

Every conversation is derived from one corpus document, deterministically (choices hash the path):
* a man page (`docs`): "What does the `ls` command do?" -> the NAME line and the first DESCRIPTION paragraph; or
  (a third of section-1 pages), with a `run_shell` tool offered, "Run the command for this: <NAME description>." ->
  a `run_shell` call with the command;
* a German man page: the same question in German -> NAME and the first BESCHREIBUNG paragraph;
* a stdlib module (`code`): "What is the Python module `json.decoder` for?" -> the module docstring's first
  paragraph; a short documented function -> "Write a Python function `name(args)`: <docstring summary>" -> its
  source in a fenced block.
Held-out documents give held-out conversations, as `tools/train_demo.py` splits the rest of the corpus. The text
is rendered with the model's own chat template (`Tokenizer.apply_chat_template`), thinking off.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

RUN_SHELL = {"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}
EN_QUESTIONS = ["What does the `{cmd}` command do?", "What is {cmd}?", "Explain the {cmd} command briefly."]
DE_QUESTIONS = ["Was macht der Befehl `{cmd}`?", "Wozu dient {cmd}?"]
MAX_ANSWER_CHARS = 700
MAX_FUNCTION_LINES = 25


def _pick(path: str, salt: str, n: int) -> int:
    return int(hashlib.sha1(f"{salt}:{path}".encode()).hexdigest(), 16) % n


def _section(text: str, names: tuple[str, ...]) -> str | None:
    """The body of the first man-page section whose heading is one of `names` (headings are unindented lines)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() in names and not line.startswith(" "):
            body = []
            for nxt in lines[i + 1:]:
                if nxt and not nxt.startswith(" "):
                    break
                body.append(nxt)
            return textwrap.dedent("\n".join(body)).strip()
    return None


def _first_paragraph(text: str | None) -> str:
    if not text:
        return ""
    para = re.split(r"\n\s*\n", text.strip(), maxsplit=1)[0]
    return " ".join(para.split())[:MAX_ANSWER_CHARS]


def man_name(text: str, german: bool) -> tuple[str, str, str] | None:
    """(command, NAME description, first DESCRIPTION paragraph) of a rendered man page."""
    name = _first_paragraph(_section(text, ("BEZEICHNUNG", "NAME") if german else ("NAME",)))
    m = re.match(r"([\w.+-]+)(?:,\s*[\w.+-]+)*\s+(?:-|\\-|–)\s+(.+)", name)
    if not m:
        return None
    detail = _first_paragraph(_section(text, ("BESCHREIBUNG",) if german else ("DESCRIPTION",)))
    return m.group(1), m.group(2).rstrip("."), detail


def man_page(path: str, text: str, german: bool) -> list[dict] | None:
    found = man_name(text, german)
    if not found:
        return None
    cmd, desc, detail = found
    if not german and _pick(path, "tool", 3) == 0 and "/man1/" in path:
        return [{"role": "user", "content": f"Run the command for this: {desc}."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "run_shell", "arguments": {"command": cmd}}}]}]
    questions = DE_QUESTIONS if german else EN_QUESTIONS
    q = questions[_pick(path, "q", len(questions))].format(cmd=cmd)
    answer = f"`{cmd}`: {desc}." + (f"\n\n{detail}" if detail else "")
    return [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]


def python_module(path: str, text: str) -> Iterator[list[dict]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    module = path.removeprefix("stdlib/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    doc = _first_paragraph(ast.get_docstring(tree))
    if doc:
        yield [{"role": "user", "content": f"What is the Python module `{module}` for?"},
               {"role": "assistant", "content": doc}]
    lines = text.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        summary = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
        n = node.end_lineno - node.lineno + 1
        if not summary or n > MAX_FUNCTION_LINES or node.decorator_list:
            continue
        source = "\n".join(lines[node.lineno - 1: node.end_lineno])
        yield [{"role": "user", "content": f"Write a Python function `{node.name}({ast.unparse(node.args)})`: "
                                           f"{summary}"},
               {"role": "assistant", "content": f"```python\n{source}\n```"}]


def conversations(documents: Iterable[tuple[str, str, str, bool]]) -> Iterator[tuple[bool, list[dict], bool]]:
    """(held_out, messages, offers_tools) for every conversation the corpus gives."""
    for kind, path, text, held in documents:
        if "/man/" in path and kind in ("docs", "german"):
            conv = man_page(path, text, german=kind == "german")
            if conv:
                yield held, conv, "tool_calls" in conv[-1]
        elif kind == "code" and path.startswith("stdlib/") and path.endswith(".py"):
            for conv in python_module(path, text):
                yield held, conv, False


def render(tok, messages: list[dict], tools: bool) -> str:
    return tok.apply_chat_template(messages, tools=[RUN_SHELL] if tools else None, add_generation_prompt=False,
                                   enable_thinking=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=".corpus")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "shared" / "demo_model"),
                    help="checkpoint or tokenizer directory whose chat template renders the text")
    ap.add_argument("--show", type=int, default=3, help="print this many rendered conversations")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from build_corpus import iter_documents
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.model)
    counts = {"train": 0, "heldout": 0, "tool_calls": 0}
    for held, messages, tools in conversations(iter_documents(Path(args.corpus))):
        counts["heldout" if held else "train"] += 1
        counts["tool_calls"] += tools
        if args.show > 0:
            print(render(tok, messages, tools) + "\n" + "-" * 60)
            args.show -= 1
    print(counts)
    return 0


def chat_stream(documents: Iterable[tuple[str, str, str, bool]], tok, separator: int) -> dict[str, list[int]]:
    """{"train": ids, "heldout": ids}: every rendered conversation, tokenized, each followed by `separator`."""
    out: dict[str, list[int]] = {"train": [], "heldout": []}
    for held, messages, tools in conversations(documents):
        ids = out["heldout" if held else "train"]
        ids.extend(tok.encode(render(tok, messages, tools)))
        ids.append(separator)
    return out


if __name__ == "__main__":
    sys.exit(main())
