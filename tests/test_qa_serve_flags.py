"""`moepipe serve` with the flags a vLLM user types (a QA pass with tools/qa_serve_flags.py, which drives every case
through the real CLI). Each test is a bug found that way and fails without its fix: refusals are checked without
starting anything (in-process, or one quick subprocess where the bug was a hang); one real server, started through
the CLI, checks that the flags accepted now take effect."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import ROOT, OpenAI, free_port, moepipe, stop_server, wait_healthy


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_an_empty_host_is_refused_at_once_not_after_the_start_timeout(tiny_checkpoint):
    """`--host "$HOST"` with HOST unset: the gateway bound every interface while the launcher polled
    http://:PORT/health, which never answers, so serve hung start_timeout (300 s) and then failed. Now one line
    naming --host, before anything starts."""
    cmd = [sys.executable, "-m", "shared.cli", "serve", str(tiny_checkpoint), "--host", "", "--port",
           str(free_port()), "--no-ple-service"]
    t = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        stop_server(proc)
        pytest.fail("serve --host '' did not exit: it waits for a /health at http://:PORT")
    assert proc.returncode == 2 and time.time() - t < 30 and "serving" not in out, (proc.returncode, out, err)
    assert err.strip().splitlines()[-1].startswith("moepipe serve: --host: an empty address") and \
        "Traceback" not in err, err


def test_an_empty_chat_template_is_refused_not_replaced_by_the_checkpoint_s(tiny_checkpoint):
    """`--chat-template "$TEMPLATE"` with TEMPLATE unset served the checkpoint's own template without a word (an
    empty --api-key, --served-model-name or --cold-experts is refused the same way)."""
    # (--port 0 is refused after the template is checked: without the check this fails at once instead of serving)
    r = moepipe("serve", str(tiny_checkpoint), "--chat-template", "", "--port", "0")
    assert r.returncode == 2 and last_line(r).startswith("moepipe serve: --chat-template: an empty value"), r.stderr


@pytest.mark.parametrize("argv,words", [
    (["--max-model-length", "4096"], "--max-model-length (did you mean --max-model-len?)"),
    (["--served-model", "x"], "--served-model (did you mean --served-model-name?)"),
    (["--gpu-memory-utilisation=0.9"], "--gpu-memory-utilisation=0.9 (did you mean --gpu-memory-utilization?)"),
    (["--enable-prefix-cache"], "--enable-prefix-cache (did you mean --enable-prefix-caching?)"),
])
def test_an_unknown_flag_names_the_close_one(argv, words):
    """Options are never abbreviated, so a near miss of a vLLM flag was only "unrecognized arguments" after 60
    lines of usage; the close flag is now named."""
    r = moepipe("serve", *argv)
    assert r.returncode == 2 and last_line(r) == f"moepipe serve: error: unrecognized arguments: {words}", r.stderr
    r = moepipe("serve", "--enable-eplb")        # nothing close: only the flag
    assert last_line(r) == "moepipe serve: error: unrecognized arguments: --enable-eplb", r.stderr


@pytest.mark.parametrize("argv,words", [
    (["--max_model_len", "100k"], "--max-model-len 100000 is longer than this model serves"),
    (["--tensor_parallel_size=2"], "--tensor-parallel-size 2: moepipe splits a model"),
    (["--kv_cache_dtype", "fp8"], "--kv-cache-dtype fp8:"),
])
def test_flags_written_with_underscores_are_vllm_s_flags(tiny_checkpoint, argv, words):
    """vLLM's FlexibleArgumentParser takes `--max_model_len` as `--max-model-len`; such a command line was refused
    as unrecognized arguments. Values keep their underscores (`--api-key=a_b`)."""
    from shared.cli import vllm_spelling

    r = moepipe("serve", str(tiny_checkpoint), *argv)
    assert r.returncode == 2 and words in last_line(r) and "unrecognized" not in r.stderr, r.stderr
    assert vllm_spelling(["--api_key=a_b", "--served_model_name", "my_model", "--", "--x_y"]) == \
        ["--api-key=a_b", "--served-model-name", "my_model", "--", "--x_y"]


def test_response_role_other_than_assistant_is_refused_by_name(tiny_checkpoint):
    """`--response-role` was an unrecognized argument; vLLM's default (assistant) is what moepipe answers with,
    another role is refused naming the flag."""
    r = moepipe("serve", str(tiny_checkpoint), "--response-role", "bot")
    assert r.returncode == 2 and last_line(r).startswith("moepipe serve: --response-role bot: "), r.stderr


def test_vllm_defaults_written_out_serve_through_the_cli(tiny_checkpoint):
    """`--load-format auto` (vLLM's default) was an invalid choice and `--response-role assistant` an unrecognized
    argument; a command line with underscores was refused. Served through the real CLI: the flags take effect."""
    port = free_port()
    cmd = [sys.executable, "-m", "shared.cli", "serve", str(tiny_checkpoint), f"--port={port}", "--no-ple-service",
           "--load-format", "auto", "--response-role", "assistant", "--max_model_len=1K",
           "--served_model_name", "alpha", "beta", "--api_key", "k_1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = OpenAI(base_url=url + "/v1", api_key="k_1", max_retries=0, timeout=60)
        cards = client.models.list().data
        assert [(m.id, m.max_model_len) for m in cards] == [("alpha", 1024), ("beta", 1024)], cards
        reply = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    finally:
        stop_server(proc)
    assert proc.returncode == 0


@pytest.mark.parametrize("key", ["ключ7", "s3cr3t ", "s3\tcr3t"])
def test_a_key_no_client_can_send_is_refused_at_start(tiny_checkpoint, monkeypatch, key):
    """`--api-key ключ` (or a key with a trailing space) served a cluster that answered every /v1 request 401: the
    openai client cannot put it in a header, curl's UTF-8 bytes arrive as other characters, and the gateway strips
    the token. Refused before anything starts, given as the flag or as VLLM_API_KEY, without echoing the key."""
    monkeypatch.delenv("MOEPIPE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    # (--max-model-len 100k is refused after the keys are checked: without the check this fails at once, unserved)
    r = moepipe("serve", str(tiny_checkpoint), "--max-model-len", "100k", "--api-key", "fine", key)
    assert r.returncode == 2 and last_line(r).startswith("moepipe serve: --api-key: a key with non-ASCII"), r.stderr
    r = moepipe("serve", str(tiny_checkpoint), "--max-model-len", "100k", env={"VLLM_API_KEY": key})
    assert r.returncode == 2 and "api_key (--api-key): a key with non-ASCII" in last_line(r), r.stderr
    assert key.strip() not in r.stderr and "cr3t" not in r.stderr


def test_a_chat_template_file_that_is_not_utf8_is_named(tiny_checkpoint, tmp_path):
    """A template file in another encoding was refused as "'utf-8' codec can't decode byte 0xff in position 0",
    naming neither the flag nor the file."""
    path = tmp_path / "latin1.jinja"
    path.write_bytes("{{ 'é' }}".encode("latin-1"))
    r = moepipe("serve", str(tiny_checkpoint), "--chat-template", str(path))
    assert r.returncode == 2 and last_line(r).startswith(f"moepipe serve: --chat-template {path}: not UTF-8"), \
        r.stderr


def test_prefix_cache_states_beyond_the_host_s_ram_are_refused_at_start(tiny_checkpoint):
    """`--prefix-cache-states 100000` on the demo model had the CPU stage allocate and fill ~25 GB (its RSS grew
    past 17 GB in 85 s on a 24 GB machine) while the launcher waited for its first heartbeat. States whose fp32
    recurrent part alone is more than the host's RAM are refused naming the flag, before anything starts."""
    # (--max-model-len 100k is refused after the states are checked: without the check this fails at once)
    r = moepipe("serve", str(tiny_checkpoint), "--prefix-cache-states", "1000000000", "--max-model-len", "100k")
    assert r.returncode == 2 and last_line(r).startswith("moepipe serve: --prefix-cache-states 1000000000 and "), \
        r.stderr
    assert "more than its" in last_line(r) and "GiB of RAM" in last_line(r)
    r = moepipe("serve", str(tiny_checkpoint), "--prefix-cache-states", "1000000000", "--no-enable-prefix-caching",
                "--max-model-len", "100k")       # off: no saved states, nothing to refuse
    assert r.returncode == 2 and "--max-model-len 100000" in last_line(r), r.stderr


def test_a_cpu_stage_checks_free_ram_before_its_prefix_cache_states(tiny_checkpoint, monkeypatch):
    """The start-up check above is a lower bound against the host's total RAM (every process must reach the same
    result from the config); a CPU stage's own allocation of the saved states (`cache._snapshot_store`) also
    checks MemAvailable first, as the GPU's pinned buffer does (`host_memory.allocate`), so states that fit the
    total but not what is free are refused naming the flag instead of filling the RAM."""
    from pathlib import Path

    from shared.model_config import load_config
    from stage_worker import host_memory
    from stage_worker.model.cache import CacheSpec, ModelCache

    if not Path("/proc/meminfo").exists():
        pytest.skip("MemAvailable is read from /proc/meminfo (Linux)")
    cfg = load_config(tiny_checkpoint)
    spec = CacheSpec(num_blocks=4, block_size=16, num_slots=2, snapshot_slots=3)
    one = ModelCache(cfg, spec)
    need = sum(host.numel() * host.element_size() for _, host in one.snapshots if host is not None)
    assert need > 0 and all(host.shape[0] == 3 for _, host in one.snapshots if host is not None)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need - 1)
    with pytest.raises(host_memory.HostMemoryError, match=r"3 prefix-cache states \(--prefix-cache-states\)"):
        ModelCache(cfg, spec)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need)
    ModelCache(cfg, spec)                    # exactly enough: no headroom is asked of a CPU stage


def test_the_in_process_helper_fails_a_serve_that_would_start_instead_of_hanging(tiny_checkpoint):
    # the guard that keeps a refusal test from serving forever in its worker when the flag it names became accepted
    r = moepipe("serve", str(tiny_checkpoint), "--port", str(free_port()), "--stages", "1")
    assert r.returncode == 1, r
    assert "got as far as starting a server" in r.stderr, r.stderr
