"""QA probe: `moepipe serve` with the flags a vLLM user types, on the CPU with the built-in demo model.

Every case drives the real CLI (`python -m shared.cli serve ...`) in a subprocess:
- refusals: the command must exit != 0 before anything starts, with one `moepipe serve: ...` line (or argparse's
  `error:` line) naming the flag, no traceback, and no process left behind;
- accepted flags: two real servers (2 stages, then 1) started with many flags at once, their effects checked end to
  end with the `openai` client and httpx (names, 404s, keys, lengths, concurrency, prefix caching, chat templates,
  notes printed for ignored flags), then stopped with Ctrl-C and checked to leave no process behind.

    python tools/qa_serve_flags.py [--only refusals|servers]

Prints a table of pass/fail (exit 1 if any case failed). Takes ~2 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail if not ok else ''}", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", "serve", *args]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "MOEPIPE_API_KEY")}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (walking /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(p)
    return left


def model_dir() -> str:
    from shared.cli import ensure_builtin_model

    return str(ensure_builtin_model())


# ---- refusals: exit != 0 before anything starts, one line naming the flag -------------------------------------

def refusal_cases(model: str, tmp: Path) -> list[tuple[list[str], str]]:
    """(serve arguments, a word the error must hold)"""
    bad_template = tmp / "bad.jinja"
    bad_template.write_text("{% for m in messages %}{{ m.content }")
    latin1 = tmp / "latin1.jinja"
    latin1.write_bytes("{{ 'é' }}".encode("latin-1"))
    return [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
        (["-tp", "4"], "--tensor-parallel-size 4"),
        (["--tensor-parallel-size=2"], "--tensor-parallel-size 2"),
        (["--stages", "1", "--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
        (["-pp", "0"], "--stages 0"),
        (["--pipeline-parallel-size", "99"], "layers"),
        (["--max-model-len", "100k"], "--max-model-len 100000"),
        (["--max-model-len", "64K"], "--max-model-len 65536"),
        (["--max-model-len", "1.5K"], "upper-case"),
        (["--max-model-len", "32q"], "--max-model-len"),
        (["--max-model-len", "-5"], "--max-model-len"),
        (["--max-model-len", "100", "--max-num-batched-tokens", "8k"], "--max-num-batched-tokens 8000"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--prefix-cache-states", "1000000"], "GiB of RAM"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--max-num-batched-tokens", "2G"], "--max-num-batched-tokens"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--dtype", "bf16"], "--dtype"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
        (["--quantization", "awq"], "--quantization awq"),
        (["--cpu-offload-gb", "8"], "--cpu-offload-gb 8"),
        (["--download-dir", "/tmp"], "--download-dir"),
        (["--revision", "main"], "--revision"),
        (["--tokenizer", "/tmp"], "--tokenizer"),
        (["--generation-config", "vllm"], "--generation-config vllm"),
        (["--response-role", "bot"], "--response-role bot"),
        (["--tool-call-parser", "mistral"], "--tool-call-parser mistral"),
        (["--load-format", "pt"], "--load-format"),
        (["--chat-template", str(tmp / "missing.jinja")], "--chat-template"),
        (["--chat-template", str(bad_template)], "bad.jinja"),
        (["--chat-template", "{% if %}"], "--chat-template (inline)"),
        (["--chat-template", ""], "--chat-template"),
        (["--chat-template", str(latin1)], "not UTF-8"),
        (["--api-key", "ключ"], "--api-key: a key with non-ASCII"),
        (["--api-key", "key "], "--api-key: a key with non-ASCII"),
        (["--host", ""], "--host"),
        (["--port", "0"], "--port 0"),
        (["--port", "70000"], "--port 70000"),
        (["--api-key", ""], "--api-key"),
        (["--served-model-name", ""], "--served-model-name"),
        (["--served-model-name", "Qwen/Qwen3-8B"], "Qwen/Qwen3-8B"),
        (["Qwen/Qwen3-Next-80B-A3B-Instruct"], "huggingface-cli download"),
        ([model, "--model", "/tmp"], "two models"),
        (["--max-model-length", "4096"], "did you mean --max-model-len"),
        (["--served-model", "x"], "did you mean --served-model-name"),
        (["--gpu-memory-utilisation", "0.9"], "did you mean --gpu-memory-utilization"),
        (["--enable-eplb"], "--enable-eplb"),
        (["--max_model_len", "100k"], "--max-model-len 100000"),
        (["--tensor_parallel_size=2"], "--tensor-parallel-size 2"),
    ]


def run_refusals(model: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        for args, words in refusal_cases(model, Path(d)):
            port = free_port()
            cmd = serve_cmd(*args, "--port", str(port)) if not any(a.startswith("--port") for a in args) \
                else serve_cmd(*args)
            name = "refuse: serve " + " ".join(a if a else "''" for a in args)
            t = time.time()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env=env(), start_new_session=True)
            kids: set[int] = set()
            try:
                while proc.poll() is None and time.time() - t < 30:
                    kids |= descendants(proc.pid)
                    time.sleep(0.05)
                out, err = proc.communicate(timeout=1)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)
                out, err = proc.communicate(timeout=30)
            took = time.time() - t
            last = err.strip().splitlines()[-1] if err.strip() else ""
            problems = []
            if proc.returncode in (0, None):
                problems.append(f"exit {proc.returncode}")
            if "Traceback" in err:
                problems.append("traceback")
            if not last.startswith("moepipe serve:"):
                problems.append(f"last line {last!r}")
            if words not in last:
                problems.append(f"{words!r} not in {last!r}")
            if took > 20:
                problems.append(f"took {took:.0f} s")
            if "serving" in out:
                problems.append("a server started")
            if alive(kids):
                problems.append(f"left processes {sorted(alive(kids))}")
            record(name, not problems, "; ".join(problems))


# ---- accepted flags: real servers, effects checked end to end -------------------------------------------------

class Server:
    def __init__(self, args: list[str], port: int, environ: dict[str, str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.err_path = tempfile.NamedTemporaryFile(prefix="qa_serve_", suffix=".err", delete=False).name
        self.err_file = open(self.err_path, "w")
        self.proc = subprocess.Popen(serve_cmd(*args), stdout=subprocess.PIPE, stderr=self.err_file, text=True,
                                     cwd=ROOT, env=environ)
        self.kids: set[int] = set()

    def wait_healthy(self, timeout: float = 180) -> bool:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            self.kids |= descendants(self.proc.pid)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.kids |= descendants(self.proc.pid)
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        return False

    def stderr(self) -> str:
        self.err_file.flush()
        return Path(self.err_path).read_text()

    def stop(self) -> tuple[int | None, set[int]]:
        self.kids |= descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None, alive(self.kids)
        time.sleep(0.5)
        self.err_file.close()
        Path(self.err_path).unlink(missing_ok=True)
        return self.proc.returncode, alive(self.kids)


def check(name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:        # a failed case: its message in the table
        record(name, False, f"{type(exc).__name__}: {exc}"[:300])
    else:
        record(name, True)


def server_one(model: str) -> None:
    """2 stages, many vLLM flags at once (written as vLLM users write them: --flag=value, underscores)."""
    import httpx
    import openai

    port = free_port()
    template = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    args = [model, "--stages", "2", "--host=127.0.0.1", f"--port={port}", "--served-model-name", "alpha", "beta",
            "--api-key", "k1", "k2", "--max-model-len=1K", "--max_num_seqs", "2", "--max-num-batched-tokens", "64",
            "--no-enable-prefix-caching", "--chat-template", template, "--dtype", "float32", "--seed", "3",
            "--uvicorn-log-level", "info", "--disable-log-requests", "--enable-log-requests",
            "--generation-config", "auto", "--kv-cache-dtype", "auto", "--trust-remote-code",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "-tp", "1",
            "--gpu-memory-utilization", "0.8", "--cpu-offload-gb", "0", "--tokenizer", model,
            "--load-format", "auto", "--response-role", "assistant", "--no-ple-service"]
    srv = Server(args, port, env())
    up = srv.wait_healthy()
    record("server 1 (2 stages, 30 vLLM flags) starts", up, srv.stderr()[-1500:])
    if not up:
        srv.stop()
        return
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k2", max_retries=0, timeout=120)
    hdr = {"Authorization": "Bearer k1"}

    def names():
        models = client.models.list().data
        assert [m.id for m in models] == ["alpha", "beta"], models
        assert all(m.max_model_len == 1024 for m in models), models     # --max-model-len=1K = 1024
        assert client.models.retrieve("beta").id == "beta"

    def not_found():
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
            r = httpx.post(srv.url + path, json={"model": "gamma", "max_tokens": 2, **body}, headers=hdr, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 404 and err["code"] == "model_not_found" and "gamma" in err["message"], r.text
        with_beta = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
        assert with_beta.choices[0].message.role == "assistant"

    def keys():
        for key in ("bad", None):
            h = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(srv.url + "/v1/models", headers=h, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(srv.url + "/v1/models", headers=hdr, timeout=30).status_code == 200
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200       # outside /v1, as vLLM

    def max_model_len():
        try:
            client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1100)
        except openai.BadRequestError as e:
            assert "1024" in str(e.body), e.body
        else:
            raise AssertionError("max_tokens past --max-model-len was served")

    def max_num_seqs():
        def go():
            httpx.post(srv.url + "/v1/completions", headers=hdr, timeout=120,
                       json={"model": "alpha", "prompt": "hello", "max_tokens": 40, "ignore_eos": True})
        threads = [threading.Thread(target=go) for _ in range(4)]
        for t in threads:
            t.start()
        most = 0.0
        while any(t.is_alive() for t in threads):
            for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
                if line.startswith("moepipe_requests_running "):
                    most = max(most, float(line.split()[1]))
            time.sleep(0.05)
        assert most == 2, f"at most {most} running with --max_num_seqs 2"

    def no_prefix_caching():
        long = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20}]
        cached = [client.chat.completions.create(model="alpha", messages=long, max_tokens=1)
                  .usage.prompt_tokens_details.cached_tokens for _ in range(2)]
        assert cached == [0, 0], cached

    def inline_template():
        ids = httpx.post(srv.url + "/tokenize", timeout=30,
                         json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        text = httpx.post(srv.url + "/detokenize", json={"model": "alpha", "tokens": ids}, timeout=30).json()
        assert text["prompt"] == "<<user>>hi<<assistant>>", text

    def notes():
        err = srv.stderr()
        for words in ("--seed 3 ignored", "--uvicorn-log-level info ignored", "--tool-call-parser hermes is not needed",
                      "--gpu-memory-utilization applies only on a GPU"):
            assert words in err, (words, err[-2000:])
        assert "Traceback" not in err

    for name, fn in (("served names listed, --max-model-len=1K in the cards", names),
                     ("another model: 404 model_not_found (chat, completions, responses)", not_found),
                     ("--api-key k1 k2: both keys work, others 401; /health open", keys),
                     ("max_tokens past --max-model-len: 400", max_model_len),
                     ("--max_num_seqs 2 (underscores): 2 running at most", max_num_seqs),
                     ("--no-enable-prefix-caching: no cached tokens", no_prefix_caching),
                     ("--chat-template inline: the prompt is that template's", inline_template),
                     ("ignored flags are noted, no traceback", notes)):
        check(name, fn)
    code, left = srv.stop()
    record("server 1 stops on Ctrl-C (exit 0), no process left", code == 0 and not left,
           f"exit {code}, left {sorted(left)}")


def server_two(model: str) -> None:
    """1 stage, --model, VLLM_API_KEY, --enable-prefix-caching, a chat template file."""
    import httpx
    import openai

    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="qa_serve_"))
    (tmp / "t.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    args = ["--model", model, "-pp", "1", "--port", str(port), "--enable-prefix-caching",
            f"--chat-template={tmp / 't.jinja'}", "--enable-chunked-prefill", "--disable-log-stats"]
    srv = Server(args, port, env(VLLM_API_KEY="from-env"))
    up = srv.wait_healthy()
    record("server 2 (1 stage, VLLM_API_KEY) starts", up, srv.stderr()[-1500:])
    if not up:
        srv.stop()
        return
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="from-env", max_retries=0, timeout=120)

    def env_key():
        assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 401
        assert [m.id for m in client.models.list().data] == ["moepipe"]

    def prefix_caching():
        long = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20}]
        cached = [client.chat.completions.create(model="moepipe", messages=long, max_tokens=1)
                  .usage.prompt_tokens_details.cached_tokens for _ in range(2)]
        assert cached[0] == 0 and cached[1] > 100, cached

    def file_template():
        ids = httpx.post(srv.url + "/tokenize", timeout=30,
                         json={"model": "moepipe", "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        text = httpx.post(srv.url + "/detokenize", json={"model": "moepipe", "tokens": ids}, timeout=30).json()
        assert text["prompt"] == "[user]hi[assistant]", text

    for name, fn in (("VLLM_API_KEY: required, and the default name moepipe", env_key),
                     ("--enable-prefix-caching: a repeated prompt is cached", prefix_caching),
                     ("--chat-template=FILE: the prompt is that template's", file_template)):
        check(name, fn)
    code, left = srv.stop()
    record("server 2 stops on Ctrl-C (exit 0), no process left", code == 0 and not left,
           f"exit {code}, left {sorted(left)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["refusals", "servers"], default=None)
    args = p.parse_args()
    model = model_dir()
    if args.only in (None, "refusals"):
        run_refusals(model)
    if args.only in (None, "servers"):
        server_one(model)
        server_two(model)
    width = max(len(n) for n, _, _ in RESULTS)
    print(f"\n{'case'.ljust(width)}  result")
    for name, ok, detail in RESULTS:
        print(f"{name.ljust(width)}  {'pass' if ok else 'FAIL  ' + detail}")
    failed = sum(not ok for _, ok, _ in RESULTS)
    print(f"\n{len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
