"""tools/train_demo.py on the CPU at toy size: it trains (losses fall), a rerun with the same seed logs the same
losses, a run stopped and resumed from its checkpoint continues exactly, and the export is a checkpoint that the
loader and `generate` take, with bits-per-byte evaluation against a unigram baseline."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import moepipe, small_corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """tools/build_corpus.py at 0.2 MB a kind (conftest.small_corpus, shared with test_route_trace.py)."""
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def _train(corpus: Path, out: Path, *extra: str, batch: int = 2, lr: float = 3e-3, total: int = 12) -> list[dict]:
    """One `tools/train_demo.py` run, in this process: a subprocess a run cost ~7 s of start-up (torch, and the
    torch._dynamo import that AdamW.step makes) against ~1 s of training; the CLI itself is run as a subprocess by
    test_prepare_writes_only_what_a_gpu_machine_needs."""
    argv = ["--corpus", str(corpus), "--out", str(out), "--preset", "tiny", "--device", "cpu", "--batch", str(batch),
            "--seq", "32", "--distill-steps", "3", "--warmup", "2", "--lr", str(lr), "--total-steps", str(total),
            *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        assert _tool().main(argv) == 0
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@functools.cache
def _tool():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools/train_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rerun_resume_and_snapshot_reproduce_the_losses(corpus, tmp_path):
    """A rerun with the same seed logs the same losses (CPU: bit-identical), a run resumed from its checkpoint
    continues exactly, and --snapshot (bf16 weights and the step at each save) lets --init-from start a new output
    directory there (what survives losing a lent machine): its first loss is the uninterrupted run's, within bf16
    rounding."""
    full = _train(corpus, tmp_path / "a", "--max-steps", "6")
    first = _train(corpus, tmp_path / "c", "--max-steps", "4", "--save-every", "4", "--snapshot",
                   str(tmp_path / "snap"))
    assert [r["loss"] for r in first] == [r["loss"] for r in full][:4]    # the last of them sparse
    assert json.loads((tmp_path / "snap/train_state.json").read_text()) == {"step": 4}
    resumed = _train(corpus, tmp_path / "c", "--max-steps", "6")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["dense"] for r in full][:4] == [True, True, True, False]     # indexer warm-up, then sparse
    assert all(r["indexer_kl"] >= 0 and r["moe_balance"] >= 0.99 for r in full)
    moved = _train(corpus, tmp_path / "m", "--max-steps", "6", "--init-from", str(tmp_path / "snap"))
    assert [r["step"] for r in moved] == [5, 6]
    assert abs(moved[0]["ce"] - full[4]["ce"]) < 0.01 * full[4]["ce"]


def test_training_lowers_the_loss_and_exports_a_servable_checkpoint(corpus, tmp_path):
    log = _train(corpus, tmp_path / "run", "--max-steps", "24", batch=4, lr=1e-2, total=24)
    first, last = log[0]["ce"], sum(r["ce"] for r in log[-4:]) / 4
    assert last < first - 0.5, (first, last)                                # 7.62 (uniform) to ~6.8 here
    out = tmp_path / "model"
    _train(corpus, tmp_path / "run", "--eval", "--eval-tokens", "256", "--export", str(out))   # one run, both
    res = json.loads((tmp_path / "run/eval.json").read_text())
    assert set(res) == {"code", "prose", "docs", "german"}
    assert all(r["model_bpb"] > 0 and r["unigram_bpb"] > 0 for r in res.values())
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine

    model = load_model(out, LoadOptions(with_mtp=True))
    engine = LocalEngine([model])
    engine.add(0)
    logits = engine.step([(0, [5, 6, 7])])
    assert logits.shape[-1] == model.cfg.vocab_size and bool(logits.isfinite().all())
    gen = moepipe("generate", "--model", str(out), "--prompt", "def", "--max-tokens", "4", "--seed", "1")
    assert gen.returncode == 0, gen.stderr


def test_prepare_writes_only_what_a_gpu_machine_needs(corpus, tmp_path):
    out = tmp_path / "prep"
    _train_cmd = [sys.executable, str(ROOT / "tools/train_demo.py"), "--corpus", str(corpus), "--out", str(out),
                  "--preset", "tiny", "--device", "cpu", "--prepare"]
    subprocess.run(_train_cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    assert {p.name for p in out.iterdir()} == {"tokenizer", "tokens.npz", "tokens.json"}
    counts = json.loads((out / "tokens.json").read_text())
    assert set(counts) == {"code", "prose", "docs", "german"} and all(c["train_tokens"] > 0 for c in counts.values())
    # a run from the prepared directory needs no corpus at all
    _train(tmp_path / "no-corpus", out, "--max-steps", "2")
    assert (out / "checkpoint.pt").exists()


def test_chat_data_from_the_corpus_renders_answers_and_parseable_tool_calls(corpus):
    sys.path.insert(0, str(ROOT / "tools"))
    import chat_data
    from build_corpus import iter_documents
    from gateway.output_parser import OutputParser
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ROOT / "shared" / "demo_model")
    convs = list(chat_data.conversations(iter_documents(corpus)))
    assert any(held for held, _, _ in convs) and any(not held for held, _, _ in convs)
    man = [m for _, m, tools in convs if not tools and m[0]["content"].startswith("What does the `")]
    assert man and all(m[1]["content"].startswith("`") and ": " in m[1]["content"] for m in man)
    assert any(m[0]["content"].startswith("What is the Python module `") for _, m, _ in convs)
    code = [m for _, m, _ in convs if m[0]["content"].startswith("Write a Python function `")]
    assert all(m[1]["content"].startswith("```python\ndef ") for m in code)     # few in this small corpus
    calls = [(m, tools) for _, m, tools in convs if tools]
    assert calls
    for messages, _ in calls:
        text = chat_data.render(tok, messages, True)
        assert '"name": "run_shell"' in text and text.count("<|im_start|>") == 3     # system (tools), user, assistant
        # what the model learns to write after "<|im_start|>assistant\n" is what the gateway parses as a call
        reply = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("\n").removesuffix("<|im_end|>")
        parsed = OutputParser.parse_complete(reply, tool_names=["run_shell"])
        want = messages[1]["tool_calls"][0]["function"]
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(want["name"], want["arguments"])]


def test_chat_share_mixes_chat_windows_into_training(corpus, tmp_path):
    log = _train(corpus, tmp_path / "chat", "--chat-share", "0.5", "--max-steps", "2")
    assert len(log) == 2
    counts = json.loads((tmp_path / "chat/tokens.json").read_text())
    assert counts["chat"]["train_tokens"] > 1000
    sys.path.insert(0, str(ROOT / "tools"))
    import numpy as np
    import train_demo

    data = np.load(tmp_path / "chat/tokens.npz")
    streams = {k.split(":", 1)[1]: data[k].astype(np.int32) for k in data.files if k.startswith("train:")}
    with_chat = train_demo.batch_for_step(streams, 0, 0, 64, 32, chat_share=0.5)
    without = train_demo.batch_for_step({k: v for k, v in streams.items() if k != "chat"}, 0, 0, 64, 32)
    assert torch_equal(without, train_demo.batch_for_step(streams, 0, 0, 64, 32, chat_share=0.0))  # off = as before
    assert not torch_equal(with_chat, without)


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_python_and_man_page_conversations_from_known_text():
    sys.path.insert(0, str(ROOT / "tools"))
    import chat_data

    add = 'def add(a, b=1):\n    """Add two numbers."""\n    return a + b'
    src = '"""Small helpers.\n\nMore text."""\n\n\n' + add + '\n\n\n' \
          'def _private():\n    """Skipped."""\n'
    convs = list(chat_data.python_module("stdlib/tools/helpers.py", src))
    assert convs == [
        [{"role": "user", "content": "What is the Python module `tools.helpers` for?"},
         {"role": "assistant", "content": "Small helpers."}],
        [{"role": "user", "content": "Write a Python function `add(a, b=1)`: Add two numbers."},
         {"role": "assistant", "content": f"```python\n{add}\n```"}]]
    page = "LS(1)    User Commands    LS(1)\n\nNAME\n       ls - list directory contents\n\nDESCRIPTION\n" \
           "       List  information about the FILEs.\n\n       Second paragraph.\n"
    conv = chat_data.man_page("usr/share/man/man8/ls.8.gz", page, german=False)       # section 8: never a tool call
    assert conv[1]["content"] == "`ls`: list directory contents.\n\nList information about the FILEs."
    assert "ls" in conv[0]["content"]


def test_the_mtp_head_trains_the_embedding_the_export_keeps(tmp_path):
    """transformers' layout stores one embedding; the MTP head must train with it, or its export is a stranger's."""
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import train_demo
    from shared.model_config import config_from_dict
    from stage_worker.checkpoint.make_model import preset_config

    raw = preset_config("tiny")
    raw.update(eos_token_id=1, pad_token_id=0, bos_token_id=None, dtype="float32")
    model = train_demo.build_model(config_from_dict(raw), 0, "cpu")
    assert model.mtp.embed_tokens.weight is model.embed_tokens.weight
    with torch.no_grad():
        model.embed_tokens.weight.mul_(3.0)              # as if trained: not the loader's random init
    tok_dir = tmp_path / "tok"
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(tok_dir, vocab_size=raw["vocab_size"], model_max_length=512,
                          texts=["hello world " * 50])
    train_demo.export(model, dict(raw, dtype="float32"), tok_dir, tmp_path / "exp")
    (tmp_path / "exp" / "train_state.json").write_text('{"step": 7}')
    again = train_demo.build_model(config_from_dict(raw), 1, "cpu")
    assert train_demo.init_from_snapshot(again, tmp_path / "exp") == 7
    tokens = torch.randint(0, raw["vocab_size"], (2, 34), generator=torch.Generator().manual_seed(0))
    model.eval(), again.eval()
    with torch.no_grad():
        a, b = train_demo.forward_losses(model, tokens), train_demo.forward_losses(again, tokens)
    assert abs(a["mtp"].item() - b["mtp"].item()) < 1e-3 and abs(a["ce"].item() - b["ce"].item()) < 1e-3


def test_train_only_moves_only_the_named_parameters(corpus, tmp_path):
    import torch

    log = _train(corpus, tmp_path / "only", "--train-only", "mtp.", "--max-steps", "3")
    assert len(log) == 3
    sys.path.insert(0, str(ROOT / "tools"))
    import train_demo
    from shared.model_config import config_from_dict
    from stage_worker.checkpoint.make_model import preset_config

    trained = torch.load(tmp_path / "only/checkpoint.pt", weights_only=False)["model"]
    raw = preset_config("tiny")
    tok_cfg = json.loads((tmp_path / "only/tokenizer/tokenizer_config.json").read_text())
    ids = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    raw.update(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None, dtype="float32")
    start = train_demo.build_model(config_from_dict(raw), 0, "cpu").state_dict()
    moved = {k for k in start if not torch.equal(start[k], trained[k])}
    assert moved and all(k.startswith("mtp.") for k in moved), sorted(moved)[:5]


MAN_LS = """NAME
       ls - list directory contents

DESCRIPTION
       List  information  about  the FILEs (the current directory by default).  Sort entries alphabetically if
       none of -cftuvSUX nor --sort is specified.
"""
MODULE = '''def clamp(x, lo, hi):
    """Return x limited to [lo, hi]."""
    return max(lo, min(x, hi))


def twice(f, x):
    """Apply f two times."""
    return f(f(x))


def _private(x):
    """Not offered."""
    return x
'''


def test_agent_examples_render_as_the_gateway_does_and_train_only_the_reply():
    """qwen-code and aider examples: the prompt is the gateway's rendering of the agent's request, the reply parses
    back (a qwen-code call as the call, an aider edit as a file listing), and a group shares a block-aligned
    prefix."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tools"))
    import agent_data
    from gateway.output_parser import OutputParser
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ROOT / "shared" / "demo_model")
    src = agent_data.sources([("docs", "usr/share/man/man1/ls.1.gz", MAN_LS, False),
                              ("code", "stdlib/mathtools.py", MODULE, False)])["train"]
    assert src["commands"] == [["ls", "list directory contents"]]
    assert [f[:2] for f in src["functions"]] == [["mathtools", "clamp"], ["mathtools", "twice"]]
    assert src["texts"][0].startswith("List information about the FILEs")
    prompts, render = agent_data.load_prompts(), agent_data.Renderer(tok)
    rng = np.random.default_rng(0)
    calls = answers = 0
    for _ in range(3):
        group = agent_data.qwen_code_group(rng, src, prompts, render, 6, 16)
        assert len(group.prefix) % 16 == 0 and len(group.prefix) > 15000        # system prompt + tools + env turn
        for e in group.examples:
            assert e.ids[:len(group.prefix)] == group.prefix and len(group.prefix) < e.reply_start < len(e.ids)
            prompt = tok.decode(e.ids[:e.reply_start], False)
            assert prompt.startswith("<|im_start|>system\nYou are Qwen Code") and prompt.endswith(
                "<|im_start|>assistant\n")
            reply = tok.decode(e.ids[e.reply_start:], False)
            assert reply.endswith("<|im_end|>\n")
            names = [t["function"]["name"] for t in prompts["qwen_code"]["tools_yolo"]]
            parsed = OutputParser.parse_complete(reply.removesuffix("<|im_end|>\n"), tool_names=names)
            if "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[1]:
                answers += 1
                assert not parsed.tool_calls and parsed.content
            else:
                calls += 1
                (call,) = parsed.tool_calls
                args = json.loads(call.arguments)
                assert call.name in ("list_directory", "read_file", "run_shell_command")
                assert call.name == "run_shell_command" or list(args.values())[0].startswith("/")  # absolute
    assert calls and answers
    for _ in range(12):              # any client's tools: the call names an offered tool, with its parameter
        e = agent_data.tool_example(rng, src, render)
        prompt, reply = tok.decode(e.ids[:e.reply_start], False), tok.decode(e.ids[e.reply_start:], False)
        offered = re.findall(r'"function", "function": \{"name": "(\w+)"', prompt)
        assert offered
        parsed = OutputParser.parse_complete(reply.removesuffix("<|im_end|>\n"), tool_names=offered)
        if "<tool_response>" not in prompt:
            (call,) = parsed.tool_calls
            assert call.name in offered and len(offered) <= 3
            assert f'"properties": {{"{next(iter(json.loads(call.arguments)))}"' in prompt
    e = agent_data.aider_example(rng, src, prompts, render)
    reply = tok.decode(e.ids[e.reply_start:], False)
    assert reply.startswith("Ok, I will:") and "\n```\n" in reply and reply.endswith("```<|im_end|>\n")
    fname = reply.split("\n\n")[2].split("\n")[0]
    assert fname.endswith(".py") and f"{fname}\n```\n" in tok.decode(e.ids[:e.reply_start], False)


def test_agent_loss_with_a_shared_prefix_equals_the_loss_of_whole_sequences():
    """The prefix run once and its states copied to every example's slot give the loss that feeding each whole
    sequence gives (the K/V blocks shared through the block tables, the recurrent and PLE states copied)."""
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import train_demo
    from agent_data import Example, Group, shared_prefix
    from shared.model_config import config_from_dict
    from stage_worker.checkpoint.make_model import preset_config

    raw = preset_config("tiny")
    raw.update(eos_token_id=1, pad_token_id=0, bos_token_id=None, dtype="float32")
    model = train_demo.build_model(config_from_dict(raw), 0, "cpu").eval()
    g = torch.Generator().manual_seed(0)
    head = torch.randint(2, raw["vocab_size"], (70,), generator=g).tolist()
    examples = [Example(head + torch.randint(2, raw["vocab_size"], (n,), generator=g).tolist(), 70 + r)
                for n, r in ((9, 3), (30, 1), (17, 10))]
    group = Group(shared_prefix([e.ids for e in examples], 16), examples)
    assert len(group.prefix) == 64
    aider = [Example(torch.randint(2, raw["vocab_size"], (40,), generator=g).tolist(), 25)]
    with torch.no_grad():
        shared = train_demo.agent_losses(model, group, [aider])
        whole = train_demo.agent_losses(model, None, [examples, aider])
        alone = train_demo.agent_losses(model, None, [examples])
    assert abs(shared["agent_ce"].item() - whole["agent_ce"].item()) < 1e-4
    assert abs(shared["agent_ce"].item() - alone["agent_ce"].item()) > 1e-3      # the aider example counts
    shared = train_demo.agent_losses(model.train(), group, [aider])
    shared["agent_ce"].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(t).all() for t in grads)
