"""A QA pass over the command-line tools as a new user (from vLLM or llama.cpp) meets them on a CPU with tiny
checkpoints: each case here ended in a traceback, did hours of work before refusing, or misled; each is now one
line naming the problem (exit 2 for a usage error) or works as --help says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stage_worker import cli as sw_cli


def run(capsys, *argv) -> tuple[int, str, str]:
    code = sw_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, err: str, *words: str) -> None:
    """Exit 2, one stderr line holding `words`, no traceback."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err


@pytest.mark.parametrize("usage,words", [
    ({"usage": []}, ['"usage" must map each kind']),
    ({"usage": {}}, ["at least one kind"]),
    ({"usage": {"code": []}}, ["kind 'code' must map layer numbers"]),
    ({"usage": {"code": {"x": [1]}}}, ["layer 'x' is not a layer number"]),
    ({"usage": {"code": {"1": "abc"}}}, ["kind 'code', layer 1: expected a list of selection counts"]),
    ({"usage": {"code": {"1": [1, -2]}}}, ["non-negative integers"]),
    ([], ['no "usage" object']),
])
def test_cold_set_names_a_malformed_usage_file(tmp_path, capsys, tiny_checkpoint, usage, words):
    """`moepipe cold-set --usage F` with F JSON but not route_usage.json's shape: was an AttributeError or TypeError
    traceback (or, for no kinds at all, an empty cold set written as if chosen)."""
    f = tmp_path / "usage.json"
    f.write_text(json.dumps(usage))
    code, _, err = run(capsys, "cold-set", "--model", str(tiny_checkpoint), "--usage", str(f), "--gib-per-stage",
                       "1", "--out", str(tmp_path / "cold.json"))
    refused(code, err, f"{f}: not a route_usage.json", *words)
    assert not (tmp_path / "cold.json").exists()


def test_cold_set_takes_meta_of_another_shape(tmp_path, capsys, tiny_checkpoint):
    """A `meta` that is not an object (tokens per kind are only for the printed read rate): was a traceback."""
    f = tmp_path / "usage.json"
    f.write_text(json.dumps({"usage": {"code": {str(i): [1] * 16 for i in range(6)}}, "meta": []}))
    code, out, err = run(capsys, "cold-set", "--model", str(tiny_checkpoint), "--usage", str(f), "--gib-per-stage",
                         "0.001", "--out", str(tmp_path / "cold.json"))
    assert code == 0, err
    assert (tmp_path / "cold.json").is_file()


@pytest.mark.parametrize("command", ["route-stats", "cold-set"])
@pytest.mark.parametrize("where", ["missing/out.json", "a_directory"])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, monkeypatch, tiny_checkpoint,
                                                                       command, where):
    """route-stats traced all its text (hours on a real model) and only then failed to write --out in a directory
    that does not exist, or that is a directory, as a bare `[Errno 2] No such file or directory`."""
    import stage_worker.route_stats as rs

    def never(*a, **k):
        raise AssertionError("the work ran before --out was checked")

    monkeypatch.setattr(rs, "route_stats", never)
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "text.txt").write_text("some text " * 20)
    (tmp_path / "usage.json").write_text(json.dumps({"usage": {"code": {str(i): [1] * 16 for i in range(6)}}}))
    out = tmp_path / where
    args = ["--text", f"code={tmp_path / 'text.txt'}"] if command == "route-stats" else \
        ["--usage", str(tmp_path / "usage.json"), "--gib-per-stage", "1"]
    code, _, err = run(capsys, command, "--model", str(tiny_checkpoint), *args, "--out", str(out))
    refused(code, err, f"--out {out}:")


@pytest.mark.parametrize("module,argv", [("gateway.cli", ["serve", "MODEL"]),
                                         ("stage_worker.cli", ["generate", "--prompt", "hi"]),
                                         ("stage_worker.cli", ["make-model", "--out", "x"])])
def test_verbose_is_taken_after_the_subcommand(module, argv):
    """`moepipe serve MODEL -v` (serve's --help: "use -v for INFO logs"): was `unrecognized arguments: -v`, -v being
    only the top-level flag (`moepipe -v serve`)."""
    import importlib

    parser = importlib.import_module(module).build_parser()
    assert parser.parse_args([*argv, "-v"]).verbose is True
    assert parser.parse_args(["-v", *argv]).verbose is True
    assert parser.parse_args(argv).verbose is False


@pytest.mark.parametrize("argv,words", [(["--api-key", ""], "--api-key: an empty key"),
                                        (["--api-key", "k1", " "], "--api-key: an empty key"),
                                        (["--served-model-name", ""], "--served-model-name: an empty name")])
def test_serve_refuses_empty_keys_and_names(tiny_checkpoint, argv, words):
    """`moepipe serve MODEL --api-key "$KEY"` with KEY unset served with no authentication at all, silently (empty
    keys are dropped); `--served-model-name ""` served under the name ""."""
    from gateway.cli import build_parser, serve_options

    with pytest.raises(ValueError, match=words):
        serve_options(build_parser().parse_args(["serve", str(tiny_checkpoint), *argv]))
    assert serve_options(build_parser().parse_args(["serve", str(tiny_checkpoint), "--api-key", "k1"])
                         ).extra["api_key"] == ["k1"]


def test_make_model_does_not_overwrite_a_quantized_or_the_built_in_checkpoint(tmp_path, capsys, monkeypatch,
                                                                              tiny_checkpoint):
    """make-model rewrote any directory holding only its file names: a `moepipe quantize` output (the same names),
    the built-in demo model's copy or a plain `save_pretrained` checkpoint became random weights, silently. Its own
    earlier output (its weight files' metadata say make-model wrote them) is still replaced, said on stderr."""
    import shutil

    quantized = tmp_path / "q"
    shutil.copytree(tiny_checkpoint, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    monkeypatch.setenv("MOEPIPE_HOME", str(tmp_path / "home"))
    demo = tmp_path / "home" / "models" / "demo-0123456789ab"
    shutil.copytree(tiny_checkpoint, demo)
    for out, words in ((quantized, "holds a quantized checkpoint (fp8)"), (demo, "is the built-in demo model")):
        before = (out / "model.safetensors").read_bytes()
        code, _, err = run(capsys, "make-model", "--out", str(out))
        refused(code, err, f"--out {out}: {words}")
        assert (out / "model.safetensors").read_bytes() == before
    plain = tmp_path / "plain"              # a save_pretrained folder: make-model's file names, not its output
    shutil.copytree(tiny_checkpoint, plain)
    from safetensors.torch import load_file, save_file

    save_file(load_file(plain / "model.safetensors"), plain / "model.safetensors", metadata={"format": "pt"})
    before = (plain / "model.safetensors").read_bytes()
    code, _, err = run(capsys, "make-model", "--out", str(plain))
    refused(code, err, f"--out {plain}: holds a checkpoint make-model did not write (model.safetensors)")
    assert (plain / "model.safetensors").read_bytes() == before
    own = tmp_path / "own"
    shutil.copytree(tiny_checkpoint, own)
    code, out, err = run(capsys, "make-model", "--out", str(own), "--layers", "3")
    assert code == 0 and f"replacing the make-model checkpoint in {own}" in err
    assert json.loads((own / "config.json").read_text())["num_hidden_layers"] == 3


@pytest.mark.parametrize("existed", [False, True])
def test_an_interrupted_quantize_leaves_no_half_written_output(tmp_path, capsys, monkeypatch, tiny_checkpoint,
                                                               existed):
    """Ctrl-C (or a full disk) after a shard was written left it in OUT, and the next `moepipe quantize` refused OUT
    as not empty; an OUT that existed (empty) before stays, emptied."""
    pytest.importorskip("compressed_tensors")
    from stage_worker.checkpoint import quantize

    real = quantize.save_file

    def interrupted(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        raise KeyboardInterrupt

    out = tmp_path / "q"
    if existed:
        out.mkdir()
    monkeypatch.setattr(quantize, "save_file", interrupted)
    code, _, _ = run(capsys, "quantize", "--scheme", "int4-experts", str(tiny_checkpoint), str(out))
    assert code == 130
    assert (list(out.iterdir()) == []) if existed else not out.exists()
    monkeypatch.setattr(quantize, "save_file", real)
    code, _, err = run(capsys, "quantize", "--scheme", "int4-experts", str(tiny_checkpoint), str(out))
    assert code == 0, err
    assert (out / "config.json").is_file()


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch, tiny_checkpoint):
    """Ctrl-C mid-run exited 130 silently, the streamed text cut off with no line end or word of why."""
    import stage_worker.generate as gen

    def interrupted(args):
        print("partial text", end="")
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "run_cli", interrupted)
    code, out, err = run(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt", "hi")
    assert code == 130 and out == "partial text"
    assert [line for line in err.splitlines() if line.strip()] == ["moepipe generate: interrupted"]


@pytest.mark.parametrize("argv,words", [
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "moepipe generate: --max-tokens 0: must be at least 1"),
    (["quantize", "--scheme", "fp8-block", "Qwen/Qwen3-Next-80B-A3B-Instruct", "OUT"],
     "moepipe quantize: Qwen/Qwen3-Next-80B-A3B-Instruct: no such directory; moepipe serves local checkpoint "
     "directories only (it does not download models)"),
    (["quantize", "--scheme", "fp8-block", "", "OUT"], "moepipe quantize: input: empty path"),
])
def test_usage_errors_name_the_command_and_what_to_do(tmp_path, capsys, monkeypatch, argv, words):
    """`--max-tokens 0` was `moepipe: ...` (no command named, as every other refusal names it); a Hub id given to
    quantize was `... is not a checkpoint directory (no config.json)`, not that moepipe does not download."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    refused(code, err, words)
    assert not (tmp_path / "OUT").exists()


def test_route_stats_sizes_its_engine_by_the_windows_it_has(tmp_path, capsys, monkeypatch, tiny_checkpoint):
    """`moepipe route-stats --batch 100000` on the tiny model sized the engine for 100,000 sequences: 13 GB asked
    for before the first step (a traceback, or a host swapping), for text of one window."""
    import stage_worker.route_stats as rs

    real, seen = rs.LocalEngine, []

    def engine(models, max_seqs, max_tokens):
        seen.append(max_seqs)
        assert max_seqs <= 4, max_seqs
        return real(models, max_seqs=max_seqs, max_tokens=max_tokens)

    monkeypatch.setattr(rs, "LocalEngine", engine)
    (tmp_path / "text.txt").write_text("def f(x):\n    return x * 2\n" * 40)
    code, out, err = run(capsys, "route-stats", "--model", str(tiny_checkpoint), "--text",
                         f"code={tmp_path / 'text.txt'}", "--tokens-per-kind", "300", "--chunk", "128", "--batch",
                         "100000", "--out", str(tmp_path / "usage.json"))
    assert code == 0, err
    assert seen == [3]
    usage = json.loads((tmp_path / "usage.json").read_text())
    assert usage["meta"]["tokens_per_kind"] == {"code": 300}


def test_keys_refuses_an_empty_or_file_out(tmp_path, monkeypatch):
    """`moepipe keys --out ""` wrote the cluster secret into the working directory; a file as --out: a traceback
    or a half-written pair. Both are a usage error naming --out, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for out, words in (("", "empty path"), (str(a_file), "exists and is not a directory")):
        r = subprocess.run([sys.executable, "-m", "shared.cli", "keys", "--out", out], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "argument --out" in r.stderr and words in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_clamp_max_tokens_flag_and_environment(tiny_checkpoint, monkeypatch):
    """--clamp-max-tokens and MOEPIPE_CLAMP_MAX_TOKENS reach the cluster key the gateway reads; off by default."""
    from gateway.cli import build_parser, serve_options
    from shared.cluster_config import env_overrides

    opts = serve_options(build_parser().parse_args(["serve", str(tiny_checkpoint), "--clamp-max-tokens"]))
    assert opts.extra["clamp_max_tokens"] is True
    assert "clamp_max_tokens" not in serve_options(build_parser().parse_args(["serve", str(tiny_checkpoint)])).extra
    monkeypatch.setenv("MOEPIPE_CLAMP_MAX_TOKENS", "1")
    assert env_overrides()["clamp_max_tokens"] is True
