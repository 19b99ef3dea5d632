"""A vLLM or llama.cpp user's command line and environment, as a QA pass pasted them: each was served wrong,
hung, or ended in a traceback. Each now works as there or is one line naming the flag or variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import moepipe as moepipe_here
from gateway.cli import build_parser, serve_options
from shared.cluster_config import (ClusterConfig, ClusterConfigError, StageSpec, env_overrides, load_cluster_config,
                                   parse_names)

ROOT = Path(__file__).resolve().parents[1]


def options(*argv):
    return serve_options(build_parser().parse_args(["serve", *argv]))


def moepipe(*argv, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line(r: subprocess.CompletedProcess, *words: str) -> None:
    """A refusal: non-zero exit, one stderr line holding `words`, no traceback."""
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr


def test_the_model_after_served_model_name_is_the_model(tiny_checkpoint):
    """`vllm serve --served-model-name qwen /path`: nargs="+" took the path as a second name and the demo model was
    served under both."""
    opts = options("--served-model-name", "qwen", str(tiny_checkpoint))
    assert opts.model == tiny_checkpoint and opts.extra["served_model_name"] == "qwen"
    assert "served_model_aliases" not in opts.extra
    with pytest.raises(ValueError, match="put the model first"):
        options("--served-model-name", str(tiny_checkpoint))


def test_names_take_a_json_list_as_vllm_does(monkeypatch, tiny_checkpoint):
    assert parse_names('["*"]', "--allowed-origins") == ["*"] and parse_names("a, b,", "x") == ["a", "b"]
    with pytest.raises(ClusterConfigError, match="--allowed-origins"):
        parse_names('["a", 3]', "--allowed-origins")
    assert options(str(tiny_checkpoint), "--allowed-origins", '["*"]').extra["allowed_origins"] == ["*"]
    monkeypatch.setenv("MOEPIPE_ALLOWED_ORIGINS", '["http://a.example", "http://b.example"]')
    assert env_overrides()["allowed_origins"] == ["http://a.example", "http://b.example"]


@pytest.mark.parametrize("argv", [["-t", "8"], ["-p", "2"], ["--max-model", "100"], ["--served", "x"]])
def test_options_are_not_abbreviated(argv, capsys):
    """llama-server's `-t 8` became -tp 8, `-p 2` -pp 2; `--max-model 100` was --max-model-len."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "-1", "70000"])
def test_a_port_outside_1_to_65535_is_refused(port, tiny_checkpoint):
    """--port 0 hung for 5 minutes (uvicorn bound a random port the launcher never found); -1, 70000 tracebacks."""
    with pytest.raises(ValueError, match="--port"):
        options(str(tiny_checkpoint), "--port", port)


def test_bad_keys_are_refused_when_the_config_loads(tmp_path, monkeypatch):
    """A negative micro-batch count served a cluster that never answered; an unknown kernel failed inside a stage
    with a traceback; a huge max_num_batched_tokens failed in the PLE service (ENOMEM); restart_limit -1 said
    "0 (derived from the model)"."""
    base = dict(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s.sock")],
                gateway_endpoint=f"ipc://{tmp_path}/g.sock")
    for key, value, words in (("microbatches", -1, "microbatches"), ("kernels", "nonsense", "MOEPIPE_KERNELS"),
                              ("max_num_batched_tokens", 99999999999, "--max-num-batched-tokens"),
                              ("restart_limit", -1, "never restart"), ("port", 0, "--port")):
        with pytest.raises(ClusterConfigError, match=words):
            ClusterConfig(**base, **{key: value}).validate()
    ClusterConfig(**base, kernels="all,-pdl,sdpa_prefill").validate()


def test_vllm_api_key_is_honoured(monkeypatch):
    """VLLM_API_KEY left the server open: it is the key when neither MOEPIPE_API_KEY nor --api-key is given."""
    monkeypatch.delenv("MOEPIPE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert env_overrides()["api_key"] == "secret"
    monkeypatch.setenv("MOEPIPE_API_KEY", "ours")
    assert env_overrides()["api_key"] == "ours"


def test_dtype_flag_wins_and_the_variable_takes_the_flag_s_names(monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("MOEPIPE_DTYPE", "half")
    assert env_overrides()["dtype"] == "float16"
    assert options(str(tiny_checkpoint), "--dtype", "auto").extra["dtype"] == ""      # the checkpoint's, not half
    monkeypatch.setenv("MOEPIPE_DTYPE", "fp64")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_DTYPE"):
        env_overrides()


def test_models_that_are_not_local_directories(tmp_path):
    """An empty path served the demo model; a Hugging Face id said "no config.json in the model directory"."""
    with pytest.raises(ValueError, match="empty model path"):
        options("--model", "")
    with pytest.raises(ValueError, match="does not download"):
        options("Qwen/Qwen3-Next-80B-A3B-Instruct")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        options(str(tmp_path / "f"))


def test_a_cluster_config_that_is_a_directory(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot read"):
        load_cluster_config(tmp_path)


def test_ipv6_urls_are_bracketed():
    from gateway.launcher import http_url

    assert http_url("::1", 8000) == "http://[::1]:8000" and http_url("127.0.0.1", 80) == "http://127.0.0.1:80"


def test_outputs_that_cannot_be_written_are_one_line(tmp_path):
    """make-model / keys into a file or under one: FileExistsError, NotADirectoryError tracebacks. Run in this
    process by the subcommand's own command module (conftest's `moepipe`: its error handling, not a fresh Python
    and torch import a call); a traceback there is an exception out of its `main`, which fails the test."""
    f = tmp_path / "file"
    f.write_text("x")
    one_line(moepipe_here("keys", "--out", str(f / "sub")), str(f))
    one_line(moepipe_here("make-model", "--preset", "tiny", "--out", str(f)), "not a directory")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    one_line(moepipe_here("make-model", "--preset", "tiny", "--out", str(other)), "not empty", "notes.txt")
    one_line(moepipe_here("make-model", "--preset", "tiny", "--out", ""), "empty")


def test_make_model_rewrites_its_own_checkpoint_whole(tmp_path):
    """Over an earlier make-model checkpoint nothing of the old one is left (its PLE table loaded a stale shape).
    (make-model in this process, by its command module: conftest's `moepipe`.)"""
    out = tmp_path / "m"
    assert moepipe_here("make-model", "--preset", "tiny", "--out", str(out)).returncode == 0
    (out / "ple_table.layer3.bin").write_bytes(b"stale")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")     # a sharded (> 2 GiB) earlier output
    r = moepipe_here("make-model", "--preset", "tiny", "--out", str(out), "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert not (out / "ple_table.layer3.bin").exists() and json.loads((out / "config.json").read_text())
    assert not (out / "model-00001-of-00002.safetensors").exists()


def test_generate_refuses_what_the_api_refuses(tmp_path):
    """Values the API answers 400 to ran (several silently greedy); --device tpu and a missing CUDA were
    tracebacks; an unwritable MOEPIPE_HOME too."""
    for flag, value in (("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "2"), ("--min-p", "5"),
                        ("--top-k", "-5")):
        one_line(moepipe("generate", "--prompt", "hi", flag, value), flag)
    one_line(moepipe("generate", "--prompt", "hi", "--device", "tpu"), "--device tpu")
    home = tmp_path / "home"
    home.write_text("a file")
    one_line(moepipe("generate", "--prompt", "hi", env={"MOEPIPE_HOME": str(home)}), "MOEPIPE_HOME")


def test_the_ple_service_names_a_bad_log_level(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ple_service", "--config", str(tmp_path / "c.toml"), "--log-level",
                        "bogus"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    one_line(r, "--log-level", "bogus")


def test_vllm_only_flags_are_accepted_noted_or_refused_by_name(tiny_checkpoint, capsys):
    """A pasted Qwen3-Next / Qwen3.5 `vllm serve` line (QA, helper-77): flags with nothing to set here were a bare
    'unrecognized arguments'. Each is now accepted, accepted with a note naming it, or refused with what to do."""
    model = str(tiny_checkpoint)
    for argv in (["--enable-chunked-prefill"], ["--kv-cache-dtype", "auto"], ["--generation-config", "auto"],
                 ["--max-log-len", "100"], ["--enable-log-requests"], ["--tokenizer", model],
                 ["--async-scheduling"], ["--max-seq-len-to-capture", "8192"], ["--max-logprobs", "20"],
                 ["--enable-request-id-headers"], ["--disable-fastapi-docs"],
                 ["--distributed-executor-backend", "mp"]):
        capsys.readouterr()
        options(model, *argv)
        assert capsys.readouterr().err == "", argv
    for argv in (["--speculative-config", '{"method":"qwen3_next_mtp","num_speculative_tokens":2}'],
                 ["--seed", "0"], ["--swap-space", "4"], ["--no-enable-chunked-prefill"],
                 ["--enable-expert-parallel"], ["--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}'],
                 ["--max-logprobs", "50"], ["--distributed-executor-backend", "ray"]):
        capsys.readouterr()
        options(model, *argv)
        err = capsys.readouterr().err
        assert f"moepipe: {argv[0]}" in err and "ignored:" in err, err
    for argv, word in ((["--kv-cache-dtype", "fp8"], "compute dtype"), (["--quantization", "fp8"], "moepipe quantize"),
                       (["--cpu-offload-gb", "8"], "--cold-experts"), (["--download-dir", "/x"], "does not download"),
                       (["--tokenizer", "/elsewhere"], "tokenizer"), (["--generation-config", "vllm"], "generation"),
                       (["--no-async-scheduling"], "MOEPIPE_ASYNC_SCHEDULING=0"),
                       (["--return-tokens-as-token-ids"], "each request"), (["--hf-overrides", "{}"], "config.json")):
        with pytest.raises(ValueError, match=word) as err:
            options(model, *argv)
        assert argv[0] in str(err.value)


def test_a_quantization_flag_matching_the_checkpoint_is_accepted(tmp_path, tiny_checkpoint):
    import shutil

    quant = tmp_path / "q"
    shutil.copytree(tiny_checkpoint, quant)
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quant / "config.json").write_text(json.dumps(cfg))
    options(str(quant), "--quantization", "compressed-tensors")
    with pytest.raises(ValueError, match="--quantization fp8"):
        options(str(quant), "--quantization", "fp8")
    # what vLLM users pass for GPTQ and AutoRound checkpoints: its kernel names and AutoRound's `inc`
    for method, flags in (("gptq", ("gptq", "gptq_marlin", "moe_wna16")), ("auto-round", ("inc", "gptq_marlin"))):
        cfg["quantization_config"] = {"quant_method": method}
        (quant / "config.json").write_text(json.dumps(cfg))
        for flag in flags:
            options(str(quant), "--quantization", flag)
        with pytest.raises(ValueError, match="--quantization fp8"):
            options(str(quant), "--quantization", "fp8")
    # a multimodal wrapper's config keeps it in text_config
    cfg = {"model_type": "wrapper", "text_config": {**cfg, "quantization_config": cfg.pop("quantization_config")}}
    assert _quant_method_of(cfg, tmp_path) == "auto-round"


def _quant_method_of(cfg: dict, tmp_path) -> str | None:
    from gateway.cli import _quant_method

    d = tmp_path / "wrapped"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return _quant_method(d)


def test_tool_parsers_for_other_call_forms_are_refused(tiny_checkpoint):
    """The hermes JSON and qwen3_coder XML parsers are accepted (the chat template's form is parsed); a parser of a
    form moepipe does not read is refused, since its calls would come back as text."""
    for name in ("hermes", "qwen3_coder", "qwen3_xml"):
        options(str(tiny_checkpoint), "--tool-call-parser", name)
    with pytest.raises(ValueError, match="mistral.*hermes JSON.*XML"):
        options(str(tiny_checkpoint), "--tool-call-parser", "mistral")


def test_a_hub_id_after_served_model_name_is_not_served_as_the_demo_model():
    """`--served-model-name qwen Qwen/Qwen3-Next-80B-A3B-Instruct` with no model served the demo model under both."""
    with pytest.raises(ValueError, match="does not download"):
        options("--served-model-name", "qwen", "Qwen/Qwen3-Next-80B-A3B-Instruct")


def test_gpu_only_flags_on_the_cpu_are_named(tiny_checkpoint, capsys):
    opts = options(str(tiny_checkpoint), "--gpu-memory-utilization", "0.8", "--enforce-eager")
    assert opts.device == "cpu"
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization, --enforce-eager apply only on a GPU" in err


def test_counts_take_vllm_s_human_readable_forms_and_auto(tiny_checkpoint, capsys):
    """`--max-model-len 32k` / `auto` / `-1` from a vLLM command line were 'invalid int value'. As vLLM: k m g t are
    powers of 1000 (fractions allowed), K M G T powers of 1024 (whole numbers); auto and -1 are the model's own
    length (the flag left out); --max-num-batched-tokens and --kv-cache-memory-bytes take the suffixes too."""
    model = str(tiny_checkpoint)
    for value, want in (("32k", 32000), ("32K", 32768), ("1m", 1_000_000), ("1M", 1 << 20), ("25.6k", 25600),
                        ("4.35k", 4350), ("4096", 4096), (" 2K ", 2048)):
        assert options(model, "--max-model-len", value).extra["max_model_len"] == want, value
    for value in ("auto", "AUTO", "-1"):
        assert "max_model_len" not in options(model, "--max-model-len", value).extra, value
    opts = options(model, "--max-num-batched-tokens", "8k", "--kv-cache-memory-bytes", "2G")
    assert opts.extra["max_num_batched_tokens"] == 8000 and opts.extra["kv_cache_memory_bytes"] == 2 << 30
    for value, words in (("1.5K", "whole numbers only"), ("-2", "auto/-1"), ("32kb", "32k or 32K"), ("x", "32K")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-model-len", value])
        err = capsys.readouterr().err
        assert "argument --max-model-len" in err and words in err, err


def test_config_errors_name_the_flag_given(tiny_checkpoint, monkeypatch, capsys):
    """`--gpu-memory-utilization 1.5` was refused as 'cluster config: gpu_memory_utilization must be in (0, 1]': a
    key the user never typed. A value from a flag is named by its flag (read off the parser); one from a variable
    keeps its key."""
    import signal

    from gateway.cli import main

    monkeypatch.setattr(signal, "signal", lambda *a: None)       # run_serve's handlers: not in the test process
    model = str(tiny_checkpoint)
    for argv, words in ((["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
                        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
                        (["--restart-limit", "-1"], "--restart-limit must be >= 0"),
                        (["--max-num-batched-tokens", "2m"], "--max-num-batched-tokens 2000000 is more than"),
                        (["--max-model-len", "10m"], "--max-model-len 10000000 is longer than this model serves")):
        capsys.readouterr()
        assert main(["serve", model, *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"moepipe serve: {words}"), err
        assert "cluster config" not in err and argv[0][2:].replace("-", "_") not in err, err
    monkeypatch.setenv("MOEPIPE_GPU_MEMORY_UTILIZATION", "1.5")
    assert main(["serve", model]) == 2
    assert "cluster config: gpu_memory_utilization must be" in capsys.readouterr().err


def test_a_model_after_api_key_is_not_a_key_in_either_order(tmp_path, tiny_checkpoint, monkeypatch):
    """`--api-key` takes several keys (vLLM's nargs="+"), so `moepipe serve --api-key sk-1 Qwen/Qwen3-Next-...` took
    the Hub id as a second key: the demo model was served and the Hub id was a bearer token. With no model given
    otherwise, the last key is treated as the --served-model-name rescue treats the last name: a checkpoint is the
    model, a Hub id or a path that is none here is refused as a model would be (before the keys took nargs, it was
    the model: "no such directory ... download"). vLLM's own order, the model first, is unchanged, and a key holding
    '/' (base64) is a key."""
    monkeypatch.setattr("shared.cli.ensure_builtin_model", lambda: Path("/demo-model"))
    hub = "Qwen/Qwen3-Next-80B-A3B-Instruct"
    with pytest.raises(ValueError, match=r"--api-key took Qwen/Qwen3-Next-80B-A3B-Instruct as a key.*does not "
                                         r"download"):
        options("--api-key", "sk-1", hub)
    with pytest.raises(ValueError, match="no model was given.*no such directory"):
        options("--api-key", "sk-1", str(tmp_path / "not-downloaded-yet"))
    with pytest.raises(ValueError, match="--api-key took ./models/later as a key"):
        options("--api-key", "sk-1", "./models/later")
    with pytest.raises(ValueError, match="does not download"):          # a single "key" that is a Hub id: no key left
        options("--api-key", hub)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        options("--api-key", "sk-1", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="does not download"):          # the model first: as before
        options(hub, "--api-key", "sk-1")
    opts = options("--api-key", "sk-1", "sk-2", str(tiny_checkpoint))    # a checkpoint after the keys is the model
    assert opts.model == tiny_checkpoint and opts.extra["api_key"] == ["sk-1", "sk-2"]
    opts = options(str(tiny_checkpoint), "--api-key", "sk-1", "Qwen/not-a-model")   # the model given: keys are keys
    assert opts.model == tiny_checkpoint and opts.extra["api_key"] == ["sk-1", "Qwen/not-a-model"]
    opts = options("--model", str(tiny_checkpoint), "--api-key", hub)
    assert opts.model == tiny_checkpoint and opts.extra["api_key"] == [hub]
    b64 = "q3+/Zk9e/Pw0sT1xM2Jd8A=="                                   # base64 keys hold '/': still keys
    opts = options("--api-key", "sk-1", b64)
    assert opts.model == Path("/demo-model") and opts.extra["api_key"] == ["sk-1", b64]
    long_key = "k" * 5000                                               # longer than a path may be: a key, no OSError
    assert options("--api-key", long_key).extra["api_key"] == [long_key]
    assert options("--served-model-name", long_key).extra["served_model_name"] == long_key

