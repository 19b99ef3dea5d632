"""Training conversations in the shape coding agents send them, so the demo model completes their round trips
(issue 13): qwen-code's 25,000-token prompt with its own tools, and aider's whole-file edit format.

    python tools/agent_data.py --corpus .corpus --show 3        # print a few rendered examples

The requests are the recorded ones (`tools/data/agent_prompts.json.gz`: qwen-code 0.15.10's system prompt and both
of its tool sets, headless and `--yolo`; aider 0.86.2's whole-format messages), with the parts that vary in the
field varied here: the working directory (it also appears in qwen-code's memory paths), the date, the files, the
task. Each prompt is rendered by the gateway's own path (`ChatCompletionRequest` -> `template_messages` -> the
chat template with the request's tools), so training sees the tokens serving will; the reply is what the template
renders for the assistant turn, and only the reply is trained on.

* qwen-code: "List the files in this directory." -> `list_directory` with the absolute path; "Show me the
  contents of notes.txt." -> `read_file` with the absolute path; with `--yolo`'s tools also "Run the command for
  this: <a man page's NAME line>." -> `run_shell_command`. Half of the examples go on to the tool's result (in
  qwen-code's formats: "Listed 2 item(s) in ...", the file's text, "Command: ... Exit Code: ...") and a short
  answer that quotes it, so the model stops instead of calling again.
* aider (whole format): a small Python file of corpus functions added to the chat, and a mechanical request
  (rename a function, remove one, add a comment line) -> "Ok, I will:" then the file name and the whole new file.

Examples of one qwen-code group share a directory, so they share the first ~24,500 tokens (system prompt, tools,
environment turn): `tools/train_demo.py` runs that prefix once per step without gradients and trains the
examples' tails on it. Sources come from the corpus (`sources()`), held-out documents give held-out sources; a
GPU machine gets them as a small JSON file instead of the corpus.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import re
import sys
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = Path(__file__).resolve().parent / "data" / "agent_prompts.json.gz"
LIST_TASKS = ["List the files in this directory.", "What files are in this directory?", "List the files in {cwd}.",
              "Show me the files here.", "List the directory contents."]
READ_TASKS = ["Show me the contents of {name}.", "Read {name}.", "What is in {name}?", "Print {name}.",
              "Show me {name}."]
RUN_TASKS = ["Run the command for this: {desc}.", "Run `{cmd}`.", "Run {cmd} here."]
DIR_WORDS = ["project", "work", "src", "app", "demo", "code", "repo", "tmp", "sandbox", "tool", "site", "lib", "notes"]
MAX_FUNCTION_LINES = 16
TEXT_NAMES = ["notes.txt", "README.md", "TODO", "todo.txt", "CHANGES", "log.txt", "hello.txt", "ideas.md"]


@dataclass
class Example:
    """One training sequence: the prompt's tokens then the reply's; only the reply (`ids[reply_start:]`) is a target."""
    ids: list[int]
    reply_start: int


@dataclass
class Group:
    """Examples that start with the same `prefix` tokens (a multiple of the block size)."""
    prefix: list[int]
    examples: list[Example]


# ---- sources from the corpus --------------------------------------------------------------------------------

def sources(documents) -> dict[str, dict[str, list]]:
    """{"train"|"heldout": {"commands": [[cmd, desc]], "functions": [[module, name, source]], "texts": [text]}}:
    section-1 man pages' NAME lines, short documented stdlib functions, and man pages' first description paragraphs
    (the contents of text files)."""
    from chat_data import man_name

    out = {s: {"commands": [], "functions": [], "texts": []} for s in ("train", "heldout")}
    for kind, path, text, held in documents:
        dest = out["heldout" if held else "train"]
        if kind == "docs" and "/man1/" in path:
            found = man_name(text, german=False)
            if found:
                cmd, desc, detail = found
                dest["commands"].append([cmd, desc])
                if 40 <= len(detail) <= 400:
                    dest["texts"].append(detail)
        elif kind == "code" and path.startswith("stdlib/") and path.endswith(".py"):
            module = path.removeprefix("stdlib/").removesuffix(".py").split("/")[-1]
            if module == "__init__":
                continue
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            lines = text.splitlines()
            for node in tree.body:
                if (isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and not node.decorator_list
                        and node.end_lineno - node.lineno < MAX_FUNCTION_LINES
                        and ast.get_docstring(node)):
                    dest["functions"].append([module, node.name,
                                              "\n".join(lines[node.lineno - 1: node.end_lineno])])
    return out


# ---- rendering through the gateway ----------------------------------------------------------------------------

class Renderer:
    """Prompt text exactly as the gateway renders a chat request, and the template's text for the reply."""

    def __init__(self, tok) -> None:
        sys.path.insert(0, str(ROOT))
        from gateway.chat_plan import plan_chat, template_messages
        from gateway.schemas import ChatCompletionRequest

        self.tok = tok
        self._plan, self._messages, self._request = plan_chat, template_messages, ChatCompletionRequest

    def prompt_and_reply(self, body: dict, reply: dict) -> tuple[str, str]:
        req = self._request(**body)
        plan = self._plan(req, lambda: None)
        messages = self._messages(req.messages)
        kwargs = dict(plan.template_kwargs)
        prompt = self.tok.apply_chat_template(messages, tools=plan.tools, add_generation_prompt=True, **kwargs)
        full = self.tok.apply_chat_template(messages + [reply], tools=plan.tools, add_generation_prompt=False,
                                            **kwargs)
        if not full.startswith(prompt):
            raise ValueError("the chat template's reply does not extend its generation prompt")
        return prompt, full[len(prompt):]

    def example(self, body: dict, reply: dict) -> Example:
        prompt, text = self.prompt_and_reply(body, reply)
        ids = self.tok.encode(prompt)
        return Example(ids + self.tok.encode(text), len(ids))


def _call(name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                 "function": {"name": name, "arguments": args}}]}


def _called(rng: np.random.Generator, name: str, args: dict, result) -> list[dict]:
    """The call and its result as the agent sends them back: the call with content null, compact arguments and
    the id we gave it, then the tool turn (`result`: a string or content parts)."""
    call_id = "call_" + "".join(f"{int(b):02x}" for b in rng.integers(0, 256, 12))
    return [{"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":"))}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def _parts(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


# ---- qwen-code ----------------------------------------------------------------------------------------------

def _date_text(rng: np.random.Generator) -> str:
    d = date(2025, 1, 1) + timedelta(days=int(rng.integers(0, 3 * 365)))
    return f"{d:%A}, {d:%B} {d.day}, {d.year}"


def _directory(rng: np.random.Generator, src: dict) -> tuple[str, dict[str, str]]:
    depth = int(rng.integers(1, 4))
    words = [DIR_WORDS[int(i)] for i in rng.integers(0, len(DIR_WORDS), depth)]
    cwd = "/" + "/".join([["home/user", "tmp", "srv", "root", "work"][int(rng.integers(5))]] + words)
    files: dict[str, str] = {}
    for _ in range(int(rng.integers(1, 5))):
        if rng.random() < 0.5 and src["functions"]:
            module, _, source = src["functions"][int(rng.integers(len(src["functions"])))]
            files[f"{module}.py"] = source + "\n"
        else:
            text = src["texts"][int(rng.integers(len(src["texts"])))]
            files[TEXT_NAMES[int(rng.integers(len(TEXT_NAMES)))]] = text + "\n"
    return cwd, dict(sorted(files.items()))


def _env_text(template: str, cwd: str, files: dict[str, str], when: str) -> str:
    names = list(files)
    tree = [f"{'└' if i == len(names) - 1 else '├'}───{n}" for i, n in enumerate(names)]
    text = re.sub(r"Today's date is [^(]+\(", f"Today's date is {when} (", template)
    text = text.replace("/tmp/agents/sandbox", cwd)
    head = text[: text.index(f"{cwd}/\n") + len(cwd) + 2]
    return head + "\n".join(tree)


def _shell_result(rng: np.random.Generator, cmd: str) -> tuple[str, str, int]:
    """qwen-code's run_shell_command result for `cmd` (made up: found or not), its output and exit code."""
    if rng.random() < 0.5:
        out, code = f"bash: line 1: {cmd}: command not found", 127
    else:
        out, code = f"{cmd}: usage: {cmd} [OPTION]... [FILE]...", int(rng.choice([0, 1, 2]))
    text = "\n".join([f"Command: {cmd}", "Directory: (root)", f"Output: {out}", "Error: (none)",
                      f"Exit Code: {code}", "Signal: (none)", f"Process Group PGID: {int(rng.integers(1000, 99999))}"])
    return text, out, code


def qwen_code_group(rng: np.random.Generator, src: dict, prompts: dict, render: Renderer, n: int,
                    block_size: int) -> Group:
    """`n` qwen-code examples in one made-up directory (one tool set), sharing their prompt's long prefix."""
    q = prompts["qwen_code"]
    yolo = rng.random() < 0.5
    cwd, files = _directory(rng, src)
    system = q["system"].replace("-tmp-agents-sandbox", cwd.replace("/", "-"))
    head = [{"role": "system", "content": system},
            {"role": "user", "content": _parts(_env_text(q["env"], cwd, files, _date_text(rng)))},
            {"role": "assistant", "content": q["ack"]}]
    base = {"model": "moepipe", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": q["max_tokens"], "tools": q["tools_yolo"] if yolo else q["tools"]}
    examples = []
    for _ in range(n):
        kind = int(rng.integers(3 if yolo else 2))
        if kind == 0:
            task = LIST_TASKS[int(rng.integers(len(LIST_TASKS)))].format(cwd=cwd)
            name, args = "list_directory", {"path": cwd}
            result = f"Listed {len(files)} item(s) in {cwd}:\n---\n" + "\n".join(files)
            count = "is 1 file" if len(files) == 1 else f"are {len(files)} files"
            answer = f"There {count} in `{cwd}`:\n\n" + "\n".join(f"- {f}" for f in files)
        elif kind == 1:
            fname = list(files)[int(rng.integers(len(files)))]
            task = READ_TASKS[int(rng.integers(len(READ_TASKS)))].format(name=fname)
            name, args = "read_file", {"file_path": f"{cwd}/{fname}"}
            result = files[fname]
            answer = f"`{fname}` contains:\n\n```\n{files[fname].rstrip()}\n```"
        else:
            cmd, desc = src["commands"][int(rng.integers(len(src["commands"])))]
            task = RUN_TASKS[int(rng.integers(len(RUN_TASKS)))].format(cmd=cmd, desc=desc)
            name, args = "run_shell_command", {"command": cmd}
            result, out, code = _shell_result(rng, cmd)
            answer = f"`{cmd}` exited with code {code}:\n\n```\n{out}\n```"
        messages = head + [{"role": "user", "content": _parts(task)}]
        if rng.random() < 0.5:
            examples.append(render.example(dict(base, messages=messages), _call(name, args)))
        else:
            messages = messages + _called(rng, name, args, _parts(result))
            examples.append(render.example(dict(base, messages=messages), {"role": "assistant", "content": answer}))
    return Group(shared_prefix([e.ids for e in examples], block_size), examples)


def shared_prefix(seqs: list[list[int]], block_size: int) -> list[int]:
    """The longest common token prefix of `seqs`, cut to whole blocks and short of every sequence's end."""
    first = seqs[0]
    n = min(len(s) for s in seqs) - 1
    for s in seqs[1:]:
        m = 0
        while m < n and s[m] == first[m]:
            m += 1
        n = m
    return first[: n - n % block_size]


# ---- any client's tools (the openai-agents SDK's shape): short prompts, varied tool names -----------------------

SHELL_TOOLS = [("run_shell", "Run a shell command and return its output."), ("run_shell_command", "Executes a shell "
               "command."), ("shell", "Run a command in a shell."), ("bash", "Run a bash command and return what it "
               "prints."), ("execute_command", "Execute a command on the system.")]
LIST_TOOLS = [("list_directory", "path", "List the entries of a directory."), ("list_files", "path", "List files."),
              ("ls", "directory", "List a directory's contents.")]
READ_TOOLS = [("read_file", "file_path", "Read a text file."), ("read", "path", "Return the contents of a file."),
              ("cat_file", "filename", "Print a file.")]
OTHER_TOOLS = [("get_weather", "city", "Current weather for a city."), ("search_web", "query", "Search the web."),
               ("send_email", "to", "Send an email."), ("add_numbers", "a", "Add two numbers.")]
SYSTEMS = ["You are a helpful assistant.", "You are a coding assistant. Use the tools when they help.",
           "Answer the user's request.", None]


def _tool(name: str, param: str, description: str, pydantic: bool) -> dict:
    """A function tool; `pydantic`: shaped as the openai-agents SDK sends one (schema titles, among them
    "<name>_args", which the model must not take for the name; strict, closed)."""
    if pydantic:
        params = {"properties": {param: {"title": param.replace("_", " ").title(), "type": "string"}},
                  "required": [param], "title": f"{name}_args", "type": "object", "additionalProperties": False}
        return {"type": "function", "function": {"name": name, "description": description, "parameters": params,
                                                 "strict": True}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {param: {"type": "string", "description": f"the {param}"}},
        "required": [param]}}}


def tool_example(rng: np.random.Generator, src: dict, render: Renderer) -> Example:
    """A short request offering one to three tools (names drawn from a pool, so the model copies the offered name
    instead of remembering one) and the call to the one that fits; half go on to its result and an answer."""
    kind = int(rng.integers(3))
    if kind == 0:
        name, description = SHELL_TOOLS[int(rng.integers(len(SHELL_TOOLS)))]
        param = "command"
        cmd, desc = src["commands"][int(rng.integers(len(src["commands"])))]
        task, value = RUN_TASKS[int(rng.integers(len(RUN_TASKS)))].format(cmd=cmd, desc=desc), cmd
        result = f"sh: 1: {cmd}: not found" if rng.random() < 0.5 else f"{cmd}: missing operand"
        answer = f"`{cmd}` printed:\n\n```\n{result}\n```"
    elif kind == 1:
        name, param, description = LIST_TOOLS[int(rng.integers(len(LIST_TOOLS)))]
        cwd, files = _directory(rng, src)
        here = [t for t in LIST_TASKS if "{cwd}" not in t]
        task, value = (f"List the files in {cwd}.", cwd) if rng.random() < 0.5 else \
            (here[int(rng.integers(len(here)))], ".")
        result = "\n".join(files)
        answer = f"The directory has {len(files)} entries:\n\n" + "\n".join(f"- {f}" for f in files)
    else:
        name, param, description = READ_TOOLS[int(rng.integers(len(READ_TOOLS)))]
        cwd, files = _directory(rng, src)
        fname = list(files)[int(rng.integers(len(files)))]
        # An absolute path, as in qwen-code's tool (same name, same parameter): one rule for both shapes.
        task = READ_TASKS[int(rng.integers(len(READ_TASKS)))].format(name=f"{cwd}/{fname}")
        value = f"{cwd}/{fname}"
        result = files[fname]
        answer = f"`{fname}` contains:\n\n```\n{result.rstrip()}\n```"
    pydantic = bool(rng.random() < 0.5)
    tools = [_tool(name, param, description, pydantic)]
    for i in rng.permutation(len(OTHER_TOOLS))[: int(rng.integers(0, 3))]:
        tools.append(_tool(*OTHER_TOOLS[int(i)], pydantic))
    tools = [tools[int(i)] for i in rng.permutation(len(tools))]
    system = SYSTEMS[int(rng.integers(len(SYSTEMS)))]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task}]
    body = {"model": "moepipe", "tools": tools}
    args = {param: value}
    if rng.random() < 0.5:
        return render.example(dict(body, messages=messages), _call(name, args))
    messages = messages + _called(rng, name, args, result)
    return render.example(dict(body, messages=messages), {"role": "assistant", "content": answer})


# ---- aider --------------------------------------------------------------------------------------------------

def _repo_map(fname: str, source: str) -> str:
    heads = [line for line in source.splitlines() if line.startswith(("def ", "class "))]
    return f"{fname}:\n" + "".join(f"│{h}\n⋮\n" for h in heads)


def aider_example(rng: np.random.Generator, src: dict, prompts: dict, render: Renderer) -> Example:
    """aider's whole-format request for a file of one or two corpus functions, and the whole edited file."""
    fns = [src["functions"][int(i)] for i in rng.integers(0, len(src["functions"]), int(rng.integers(1, 3)))]
    module = fns[0][0]
    fname = f"{module}.py"
    source = "\n\n\n".join(f[2] for f in fns) + "\n"
    fn = fns[int(rng.integers(len(fns)))][1]
    kind = int(rng.integers(3 if len(fns) > 1 and fns[0][1] != fns[1][1] else 2))
    if kind == 0:
        new = ["new_", "get_", "do_", "my_"][int(rng.integers(4))] + fn
        request = f"Rename the function `{fn}` to `{new}` in {fname}."
        edited = re.sub(rf"\b{re.escape(fn)}\b", new, source)
        plan = f"Rename `{fn}` to `{new}`."
    elif kind == 1:
        line = src["texts"][int(rng.integers(len(src["texts"])))].split(". ")[0][:80].rstrip(". ")
        request = f"Add a comment at the top of {fname} saying: {line}"
        edited = f"# {line}\n{source}"
        plan = "Add the comment at the top of the file."
    else:
        keep = [f for f in fns if f[1] != fn]
        request = f"Remove the function `{fn}` from {fname}."
        edited = "\n\n\n".join(f[2] for f in keep) + "\n"
        plan = f"Remove `{fn}`."
    messages = json.loads(json.dumps(prompts["aider_whole"]["messages"]))
    # The recorded request's tail: repo map (user, assistant ack), the added file (user, assistant ack), the
    # request with the format reminder (user).
    messages[-5]["content"] = re.sub(r"\n\ncalc\.py:\n.*", lambda _: "\n\n" + _repo_map(fname, source),
                                     messages[-5]["content"], flags=re.S)
    messages[-3]["content"] = re.sub(r"calc\.py\n```\n.*?```", lambda _: f"{fname}\n```\n{source}```",
                                     messages[-3]["content"], flags=re.S)
    reminder = messages[-1]["content"].split("\n", 1)[1]
    messages[-1]["content"] = request + "\n" + reminder
    body = dict(prompts["aider_whole"], messages=messages)
    reply = {"role": "assistant", "content": f"Ok, I will:\n\n1. {plan}\n\n{fname}\n```\n{edited}```"}
    return render.example(body, reply)


def load_prompts() -> dict:
    return json.loads(gzip.decompress(PROMPTS.read_bytes()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=".corpus")
    ap.add_argument("--model", default=str(ROOT / "shared" / "demo_model"))
    ap.add_argument("--show", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from build_corpus import iter_documents
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.model)
    src = sources(iter_documents(Path(args.corpus)))
    print({s: {k: len(v) for k, v in d.items()} for s, d in src.items()})
    render, prompts = Renderer(tok), load_prompts()
    rng = np.random.default_rng(args.seed)
    group = qwen_code_group(rng, src["train"], prompts, render, args.show, 16)
    print(f"qwen-code group: prefix {len(group.prefix)} tokens")
    for e in group.examples:
        print(f"--- {len(e.ids)} tokens; tail:\n{tok.decode(e.ids[len(group.prefix):], False)}")
    for _ in range(args.show):
        e = aider_example(rng, src["train"], prompts, render)
        print(f"--- aider, {len(e.ids)} tokens; reply:\n{tok.decode(e.ids[e.reply_start:], False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
