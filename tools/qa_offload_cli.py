"""QA exploration of the memory-plan, expert-offload and long-context command lines on the CPU (not collected by
pytest; the cheap cases that guard fixes are in tests/test_qa_offload_cli.py).

It drives the real commands as a user does: `python -m shared.cli route-stats | cold-set | serve ...` with odd
inputs, and for every server that starts it asks the same greedy completions (tokens and logprobs) as a plain
server of the same layout. What it checks, per case: a clear one-line refusal with exit 2, or a server whose
answers equal the baseline's (1e-4 on logprobs).

    python tools/qa_offload_cli.py [--only cold|memory|qsa|cli] [--keep DIR]

Takes a few minutes on 2 CPU cores (each served case is a cluster start, ~10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = [[5, 17, 101, 250, 9, 33], [40, 41, 42, 7]]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


class Served:
    """`moepipe serve MODEL ARGS` started and waited for: healthy (url set) or exited (rc set)."""

    def __init__(self, model: Path, *args: str, timeout: float = 120) -> None:
        from conftest import free_port

        self.port = free_port()
        self.url = None
        self.rc = None
        self.err_path = Path(tempfile.mkstemp(prefix="qa-serve-", suffix=".err")[1])
        self.proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", str(model), "--port",
                                      str(self.port), *args], stdout=subprocess.DEVNULL,
                                     stderr=self.err_path.open("w"), cwd=ROOT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.rc = self.proc.returncode
                return
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    self.url = f"http://127.0.0.1:{self.port}"
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.rc = "timeout"

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err_path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def greedy(url: str, prompts=PROMPTS, max_tokens: int = 12) -> list[tuple[list[str], list[float]]]:
    out = []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "moepipe", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append((lp["tokens"], lp["token_logprobs"]))
    return out


def same(a, b, tol: float = 1e-4) -> bool:
    return all(ta == tb and all(abs(x - y) <= tol for x, y in zip(la, lb)) for (ta, la), (tb, lb) in zip(a, b))


def report(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""


def refused(name: str, s: Served, *words: str) -> bool:
    err = s.err
    ok = s.rc == 2 and "Traceback" not in err and all(w in err for w in words)
    return report(name, ok, f"rc={s.rc} {last_line(err)}")


# ---- route-stats and cold-set --------------------------------------------------------------------------------------

def cli_cases(model: Path, tmp: Path) -> int:
    fails = 0
    (tmp / "empty.txt").write_text("")
    (tmp / "bin.dat").write_bytes(os.urandom(4000))
    (tmp / "dir").mkdir(exist_ok=True)
    (tmp / "prose.txt").write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 200))
    usage = tmp / "usage.json"
    r = cli("route-stats", "--model", str(model), "--text", f"prose={tmp / 'prose.txt'}", "--tokens-per-kind",
            "600", "--chunk", "128", "--out", str(usage))
    fails += not report("route-stats on text", r.returncode == 0, last_line(r.stderr or r.stdout))
    for name, args in [("empty text", ["--text", f"p={tmp / 'empty.txt'}"]),
                       ("empty directory", ["--text", f"p={tmp / 'dir'}"]),
                       ("missing text", ["--text", f"p={tmp / 'nope.txt'}"]),
                       ("binary text", ["--text", f"p={tmp / 'bin.dat'}"]),
                       ("tokens 0", ["--text", f"p={tmp / 'prose.txt'}", "--tokens-per-kind", "0"])]:
        r = cli("route-stats", "--model", str(model), *args, "--out", str(tmp / "u2.json"))
        fails += not report(f"route-stats {name}", r.returncode in (0, 2) and "Traceback" not in r.stderr,
                            f"rc={r.returncode} {last_line(r.stderr)}")
    for name, gib, stages in [("0", "0", "1"), ("negative", "-1", "1"), ("nan", "nan", "1"), ("tiny", "1e-9", "1"),
                              ("all", "100", "1"), ("two stages", "0.0001", "2"), ("stages 0", "1", "0"),
                              ("text", "abc", "1")]:
        r = cli("cold-set", "--model", str(model), "--usage", str(usage), "--gib-per-stage", gib, "--stages", stages,
                "--out", str(tmp / f"cold-{name}.json"))
        fails += not report(f"cold-set budget {name}", r.returncode in (0, 2) and "Traceback" not in r.stderr,
                            f"rc={r.returncode} {last_line(r.stderr or r.stdout)}")
    return fails


# ---- serve --cold-experts ------------------------------------------------------------------------------------------

def cold_cases(model: Path, tmp: Path) -> int:
    from shared import cold_set
    from shared.model_config import load_config

    cfg = load_config(model)
    fails = 0
    files = {}

    def write(name: str, cold: dict, stages=((0, cfg.num_hidden_layers),), **over) -> Path:
        path = tmp / f"cold-{name}.json"
        cold_set.write(path, cfg, str(model), cold, list(stages), cold_set.expert_bytes(cfg), 1 << 30, ["qa"])
        if over:
            data = json.loads(path.read_text())
            data.update(over)
            path.write_text(json.dumps(data))
        files[name] = path
        return path

    half = {layer: list(range(0, cfg.num_experts, 2)) for layer in range(cfg.num_hidden_layers)}
    most = {layer: list(range(1, cfg.num_experts)) for layer in range(cfg.num_hidden_layers)}
    write("half", half)
    write("most", most)
    write("none", {})
    bad = {"out of range": write("range", {}, layers={"1": [0, cfg.num_experts]}),
           "duplicated": write("dup", {}, layers={"1": [3, 3]}),
           "all experts": write("all", {}, layers={"1": list(range(cfg.num_experts))}),
           "another model": write("other", {}, num_experts=cfg.num_experts * 2),
           "not json": tmp / "bin.dat"}
    (tmp / "bin.dat").write_bytes(os.urandom(100))
    for name, path in bad.items():
        with Served(model, "--cold-experts", str(path), "--no-ple-service") as s:
            fails += not refused(f"serve --cold-experts {name}", s, str(path))
    for stages in (1, 2):
        with Served(model, "--stages", str(stages), "--no-ple-service", "--num-blocks", "64") as s:
            if s.url is None:
                fails += not report(f"baseline {stages} stages", False, f"rc={s.rc} {last_line(s.err)}")
                continue
            want = greedy(s.url)
        for name in ("half", "most", "none"):
            for moves in ([], ["--no-expert-moves"]):
                with Served(model, "--stages", str(stages), "--no-ple-service", "--num-blocks", "64",
                            "--cold-experts", str(files[name]), *moves) as s:
                    label = f"serve {stages} stage(s) --cold-experts {name} {' '.join(moves)}"
                    if s.url is None:
                        fails += not report(label, False, f"rc={s.rc} {last_line(s.err)}")
                        continue
                    got = greedy(s.url)
                    fails += not report(label, same(got, want), "" if same(got, want) else f"{got} != {want}")
    return fails


# ---- memory flags --------------------------------------------------------------------------------------------------

MEMORY_REFUSED = [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--kv-cache-memory-bytes", "-5"], "--kv-cache-memory-bytes"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory"),
    (["--kv-cache-memory", "0.00001"], "--kv-cache-memory"),
    (["--num-blocks", "-1"], "--num-blocks"),
    (["--max-model-len", "100000"], "--max-model-len"),
    (["--max-model-len", "4096", "--num-blocks", "8"], "--num-blocks"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--vram-limit", "-1"], "--vram-limit"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb"),
    (["--kv-row-cache-mib", "-1"], "--kv-row-cache-mib"),
]
MEMORY_SERVED = [["--gpu-memory-utilization", "0.5"], ["--vram-limit", "4"], ["--kv-cache-memory-bytes", "1G"],
                 ["--kv-cache-memory", "0.5"], ["--num-blocks", "1"], ["--max-model-len", "auto"],
                 ["--swap-space", "4"], ["--cold-experts", "auto"], ["--max-num-seqs", "1"]]


def memory_cases(model: Path, tmp: Path) -> int:
    fails = 0
    for args, flag in MEMORY_REFUSED:
        with Served(model, "--no-ple-service", *args) as s:
            fails += not refused(f"serve {' '.join(args)}", s, flag)
    want = None
    for args in MEMORY_SERVED:
        with Served(model, "--no-ple-service", *args) as s:
            if s.url is None:
                fails += not report(f"serve {' '.join(args)}", False, f"rc={s.rc} {last_line(s.err)}")
                continue
            limit = httpx.get(s.url + "/v1/models").json()["data"][0].get("max_model_len")
            got = greedy(s.url, max_tokens=4)
            want = want or got
            fails += not report(f"serve {' '.join(args)}", same(got, want),
                                f"max_model_len {limit}; notes: {' | '.join(s.err.strip().splitlines()[:-1])[:300]}")
    return fails


# ---- long context --------------------------------------------------------------------------------------------------

def qsa_cases(model: Path, tmp: Path) -> int:
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in (150, 300)]
    # two more sharing a 230-token prefix (past the tiny model's QSA budget of 64): prefix-cache hits over host K/V
    prefix = [rng.randrange(10, 2000) for _ in range(230)]
    prompts += [prefix + [rng.randrange(10, 2000) for _ in range(n)] for n in (5, 37)]
    fails = 0
    common = ["--no-ple-service", "--max-model-len", "512", "--max-num-batched-tokens", "64"]
    want = None
    for stages in ("1", "2"):
        for extra in ([], ["--qsa-kv-offload"], ["--qsa-kv-offload", "--kv-row-cache-mib", "0"],
                      ["--qsa-kv-offload", "--kv-row-cache-mib", "16", "--enable-prefix-caching"],
                      ["--qsa-kv-offload", "--no-enable-prefix-caching"]):
            label = f"serve --stages {stages} {' '.join(extra)}"
            with Served(model, "--stages", stages, *common, *extra) as s:
                if s.url is None:
                    fails += not report(label, False, f"rc={s.rc} {last_line(s.err)}")
                    continue
                got = greedy(s.url, prompts, max_tokens=8) + greedy(s.url, prompts, max_tokens=8)  # twice: cache
                want = want or got
                r = httpx.post(s.url + "/v1/completions", timeout=60, json={
                    "model": "moepipe", "prompt": [7] * 600, "max_tokens": 4})
                limit_ok = r.status_code == 400 and "512" in r.text and "600" in r.text
                fails += not report(label, same(got, want) and limit_ok,
                                    f"same={same(got, want)} long prompt: {r.status_code} {r.text[:200]}")
    return fails


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["cli", "cold", "memory", "qsa"], action="append")
    p.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one)")
    args = p.parse_args()
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="qa-offload-"))
    tmp.mkdir(parents=True, exist_ok=True)
    model = tmp / "tiny"
    if not (model / "config.json").is_file():
        from stage_worker.checkpoint.make_model import make_model
        make_model("tiny", model, seed=0)
    fails = 0
    for name, fn in (("cli", cli_cases), ("cold", cold_cases), ("memory", memory_cases), ("qsa", qsa_cases)):
        if not args.only or name in args.only:
            fails += fn(model, tmp)
    print(f"{fails} failure(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
