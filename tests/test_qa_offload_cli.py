"""QA of the expert-offload and memory command lines on the CPU: `moepipe route-stats`, `moepipe cold-set` and the
memory / offload flags of `moepipe serve`, driven with the inputs a vLLM or llama.cpp user types. Each test guards
one fix (its docstring says what was wrong). The wider exploration (served tokens with cold experts, QSA K/V offload
and the row cache on and off, 1 and 2 stages) is tools/qa_offload_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT, free_port, moepipe, stop_server
from shared import cold_set
from shared.model_config import load_config


def serve_refused(model, *argv: str) -> subprocess.CompletedProcess:
    """`python -m shared.cli serve MODEL ARGV` expected to stop at start: its exit code and stderr. One that starts
    instead (the bug back) is stopped after 60 s and fails the test, not left serving (an in-process serve would
    block the test run)."""
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", str(model), "--port", str(free_port()),
                             "--no-ple-service", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop_server(proc)
        pytest.fail(f"serve {' '.join(argv)} started instead of refusing")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def dense_config(tmp_path_factory):
    """A Qwen3-Next config written by transformers with no routed experts (num_experts 0: every MLP dense), and
    nothing else: no weights, no tokenizer."""
    from hf_oracle import COMMON
    from transformers import Qwen3NextConfig

    d = tmp_path_factory.mktemp("dense")
    Qwen3NextConfig(**{**COMMON, "num_experts": 0}, num_hidden_layers=2, intermediate_size=40,
                    layer_types=["linear_attention", "full_attention"]).save_pretrained(d)
    return d


def test_route_stats_refuses_binary_text_and_skips_a_directory_s_binaries(tmp_path, tiny_checkpoint):
    """A binary file (an archive, a directory's .git objects) was read as text with replacement characters and
    its noise counted as the kind's routing, exit 0 and not a word said. Now a binary file named alone is refused
    in one line (exit 2), a directory's binaries are skipped with a line saying how many, and a directory of only
    binaries is refused."""
    blob = bytes(range(256)) * 8                         # NUL bytes: git's test of a binary file
    (tmp_path / "blob.bin").write_bytes(blob)
    r = moepipe("route-stats", "--model", str(tiny_checkpoint), "--text", f"code={tmp_path / 'blob.bin'}",
                "--out", str(tmp_path / "u.json"))
    assert r.returncode == 2 and "blob.bin is a binary file" in r.stderr and "Traceback" not in r.stderr
    only = tmp_path / "only"
    only.mkdir()
    (only / "a.gz").write_bytes(blob)
    r = moepipe("route-stats", "--model", str(tiny_checkpoint), "--text", f"code={only}", "--out",
                str(tmp_path / "u.json"))
    assert r.returncode == 2 and "holds only binary files (1)" in r.stderr
    mixed = tmp_path / "mixed"
    (mixed / ".git").mkdir(parents=True)
    (mixed / ".git" / "obj").write_bytes(blob)
    (mixed / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    r = moepipe("route-stats", "--model", str(tiny_checkpoint), "--text", f"code={mixed}", "--tokens-per-kind",
                "64", "--chunk", "32", "--out", str(tmp_path / "u.json"))
    assert r.returncode == 0, r.stderr
    assert "skipped 1 binary file(s)" in r.stderr
    data = json.loads((tmp_path / "u.json").read_text())
    assert data["meta"]["tokens_per_kind"] == {"code": 64}


def test_a_model_without_moe_layers_is_named_by_route_stats_and_cold_set(tmp_path, dense_config):
    """A Qwen3-Next checkpoint with num_experts 0: route-stats loaded the whole model before it said "no SparseMoE
    layers to trace" (here, with no weights, it failed on the missing tokenizer instead), and cold-set listed every
    counted layer as not matching ("MoE layers []"). Both now say the model has no MoE layers, route-stats before
    reading anything but config.json."""
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    r = moepipe("route-stats", "--model", str(dense_config), "--text", f"prose={text}", "--out",
                str(tmp_path / "u.json"))
    assert r.returncode == 2 and "has no MoE layers" in r.stderr, r.stderr
    cfg = load_config(dense_config)
    usage = tmp_path / "u.json"
    usage.write_text(json.dumps({"usage": {"prose": {"0": [1, 2, 3], "1": [3, 2, 1]}}}))
    r = moepipe("cold-set", "--model", str(dense_config), "--usage", str(usage), "--gib-per-stage", "1", "--out",
                str(tmp_path / "cold.json"))
    assert r.returncode == 2 and "has no MoE layers" in r.stderr and cfg.num_experts == 0, r.stderr
    assert not (tmp_path / "cold.json").exists()


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.update(layers={"3": [1], "03": [2]}), "layer 3 is listed twice"),
    (lambda d: d.update(num_experts="16"), "model of '16' experts"),
], ids=["layer_twice", "experts_as_text"])
def test_serve_refuses_a_hand_edited_cold_set_naming_the_problem(tmp_path, tiny_checkpoint, edit, words):
    """Hand-edited cold-set files: layer "3" and "03" both listed kept the second list without a word (the first
    layer's experts silently back in VRAM); a num_experts of "16" was refused as "written for a model of 16 experts
    ...; this one has 16". Both are refused at start (exit 2, before any process) naming the file and the
    problem."""
    cfg = load_config(tiny_checkpoint)
    path = cold_set.write(tmp_path / "cold.json", cfg, str(tiny_checkpoint), {1: [0]}, [(0, cfg.num_hidden_layers)],
                          cold_set.expert_bytes(cfg), 1 << 30, ["qa"])
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    r = serve_refused(tiny_checkpoint, "--cold-experts", str(path))
    assert r.returncode == 2 and str(path) in r.stderr and words in r.stderr, r.stderr


@pytest.mark.parametrize("argv,words,wrong", [
    (["--cold-experts", ""], "--cold-experts: an empty path", "Is a directory"),
    (["--kv-cache-memory-bytes", "-5"], "--kv-cache-memory-bytes -5: must be", "vram_limit"),
    (["--vram-limit", "nan"], "--vram-limit nan: must be", "kv_cache_memory_bytes"),
], ids=["empty_cold_experts", "negative_kv_bytes", "nan_vram_limit"])
def test_serve_names_the_one_bad_memory_flag(tiny_checkpoint, argv, words, wrong):
    """`--cold-experts "$UNSET"` resolved to the working directory and was refused as "not a readable cold-set
    file (Is a directory: <cwd>)"; `--kv-cache-memory-bytes -5` was refused as "vram_limit and
    --kv-cache-memory-bytes must be ..., got 0.0 and -5", naming a key nobody set. Each now names its flag alone."""
    r = serve_refused(tiny_checkpoint, *argv)
    assert r.returncode == 2 and words in r.stderr and wrong not in r.stderr, r.stderr


def test_served_with_vllm_s_offload_defaults_says_what_each_flag_did(tiny_checkpoint):
    """`moepipe serve` as a vLLM command line spells it out on a CPU machine: `--cpu-offload-gb 0` (vLLM's default,
    no offload) was refused as if it asked for offload; `--num-blocks 4` cut the context to 64 tokens without a word
    (every longer prompt then got a 400 the user could not explain); `--cold-experts auto` and `--kv-row-cache-mib`
    without `--qsa-kv-offload` did nothing, silently. Now the server starts, says each, and serves the length it
    printed: a prompt past it gets a 400 naming both numbers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", str(tiny_checkpoint), "--port", str(port),
                             "--no-ple-service", "--cpu-offload-gb", "0", "--num-blocks", "4", "--cold-experts",
                             "auto", "--kv-row-cache-mib", "16", "--no-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert models[0]["max_model_len"] == 64
        ok = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "moepipe", "prompt": [5, 17, 101], "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        long = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "moepipe", "prompt": [7] * 80, "max_tokens": 1})
        assert long.status_code == 400 and "64" in long.text and "80" in long.text
    finally:
        stop_server(proc)
    err = proc.stderr.read()
    assert "--num-blocks 4 x block size 16 holds 64 tokens" in err and "serving max_model_len 64" in err
    assert "--cold-experts auto: the cluster runs on the CPU" in err
    assert "--kv-row-cache-mib 16 applies only with --qsa-kv-offload" in err
    assert "--cpu-offload-gb" not in err and "Traceback" not in err
