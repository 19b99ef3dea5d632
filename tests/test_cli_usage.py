"""A bad flag is named with the usage of the subcommand it was given to (its own flags), not the top-level usage of
the service module that runs it (which lists only that module's subcommands)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module,command,args,flag", [("gateway.cli", "serve", [], "--stagez"),
                                                      ("stage_worker.cli", "make-model", ["--out", "/nonexistent"],
                                                       "--presett")])
def test_an_unknown_flag_gets_the_subcommand_s_usage(module, command, args, flag, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main([command, *args, f"{flag}=x"])       # (`serve` takes a positional MODEL, as vLLM's does)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"usage: moepipe {command} " in err and f"unrecognized arguments: {flag}=x" in err
    assert "{" not in err.splitlines()[0]          # no "{serve,keys}" subcommand list


def test_a_vllm_command_line_serves_as_it_would_there(tmp_path, capsys):
    """`vllm serve MODEL --served-model-name ... -pp 2 --dtype half --enforce-eager --enable-auto-tool-choice
    --tool-call-parser hermes --reasoning-parser qwen3 --trust-remote-code`: the same settings here, the parsers
    said to be unneeded; contradictions, tensor parallelism and a chat template that does not compile are refused
    naming the flags or file."""
    from gateway.cli import build_parser, serve_options

    def options(*argv):
        return serve_options(build_parser().parse_args(["serve", *argv]))

    opts = options(str(tmp_path), "--served-model-name", "qwen", "alias", "-pp", "2", "--dtype", "half",
                   "--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--reasoning-parser", "qwen3", "--trust-remote-code", "--disable-log-requests", "-tp", "1")
    assert opts.model == tmp_path and opts.stages == 2
    assert opts.extra == {"served_model_name": "qwen", "served_model_aliases": ["alias"], "dtype": "float16",
                          "cuda_graphs": False}
    err = capsys.readouterr().err
    assert "--tool-call-parser hermes is not needed" in err and "--reasoning-parser qwen3 is not needed" in err
    assert options("--model", str(tmp_path), "--stages", "3").stages == 3
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert options(str(tmp_path), "--chat-template", str(template)).extra == {"chat_template": str(template)}
    template.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template .*t.jinja: "):
        options(str(tmp_path), "--chat-template", str(template))
    with pytest.raises(ValueError, match="is not a file"):
        options(str(tmp_path), "--chat-template", str(tmp_path / "missing.jinja"))
    assert options(str(tmp_path), "--dtype", "auto").extra == {"dtype": ""}     # the checkpoint's, over MOEPIPE_DTYPE
    for argv, words in ((["--stages", "2", "-pp", "3"], "--stages 2 and --pipeline-parallel-size 3 differ"),
                        (["-tp", "2"], "--tensor-parallel-size 2"),
                        (["--model", "/elsewhere"], "two models given")):
        with pytest.raises(ValueError, match=words):
            options(str(tmp_path), *argv)


def test_a_served_chat_renders_with_the_chat_template_given(tiny_checkpoint, tmp_path):
    """`--chat-template FILE` (cluster key chat_template) reaches the gateway: the prompt is that template's."""
    import httpx

    from conftest import free_port
    from gateway.launcher import Cluster, ServeOptions
    from shared.tokenizer import Tokenizer

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    text = "user: hello there\nassistant:"
    want = len(Tokenizer.from_dir(tiny_checkpoint, template).encode(text))
    assert want != len(Tokenizer.from_dir(tiny_checkpoint).encode(
        Tokenizer.from_dir(tiny_checkpoint).apply_chat_template([{"role": "user", "content": "hello there"}])))
    opts = ServeOptions(model=tiny_checkpoint, stages=1, port=free_port(),
                        extra={"chat_template": str(template), "ple_service": False})
    with Cluster(opts) as c:
        r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
            "model": "moepipe", "max_tokens": 1, "messages": [{"role": "user", "content": "hello there"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == want


def test_an_inline_chat_template_is_taken_as_vllm_takes_it(tiny_checkpoint, tmp_path, monkeypatch):
    """`vllm serve --chat-template '{% for m in messages %}...'` (the template itself, not a file) was refused as 'is
    not a file'. As vLLM: a value that is no file and holds '{', '}' or a line break is the template (kept in a file
    every process reads); one without them is a path, and a missing one is named."""
    from pathlib import Path

    from gateway.cli import build_parser, serve_options
    from shared.tokenizer import Tokenizer

    def options(*argv):
        return serve_options(build_parser().parse_args(["serve", str(tiny_checkpoint), *argv]))

    home = tmp_path / "home"
    monkeypatch.setenv("MOEPIPE_HOME", str(home))
    text = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    path = Path(options("--chat-template", text).extra["chat_template"])
    assert path.read_text() == text and path.is_relative_to(home)
    assert Path(options("--chat-template", text).extra["chat_template"]) == path       # the same file again
    tok = Tokenizer.from_dir(tiny_checkpoint, path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    with pytest.raises(ValueError, match=r"--chat-template \(inline\): "):
        options("--chat-template", "{% for m in messages %}")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]                 # nothing half-made left
    with pytest.raises(ValueError, match="--chat-template templates/none.jinja is not a file"):
        options("--chat-template", "templates/none.jinja")
