from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the kernel tests run Triton's interpreter, which must be on before anything imports triton:
# triton.language's own helpers (tl.zeros, ...) are compiled or interpreted as the package is first imported, and
# libraries the tests use (compressed-tensors) import it early. Model code takes Triton only for CUDA tensors.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        __import__("interpreter_speedup").install()


# The slowest units of work on the 2-core CI machine (a file, or a SHARED_GROUPS group listed by one of its files),
# longest first as of a full run at 242c609 (seconds of --durations=0 summed by file: 155 for test_expert_moves_async,
# then 129, 114, 96, 79, 63, 62, 62, 60, 55, ... the "api" group 53, "corpus" 24). With --dist loadfile a unit runs
# whole on one worker; handing the longest out first keeps the two workers' ends close. xdist's own order (by number
# of tests; `--no-loadscope-reorder` in pyproject.toml turns it off) handed the then 190-s training file out late,
# when the other worker had run out of work. Not refreshed after the interpreter speed-up (tests/interpreter_speedup.py)
# halved the kernel files: the list re-sorted by the new durations (server files first) ran 723 s against this one's
# 682 s back to back (2026-12-07): with both workers starting on server tests, their processes contend for the two
# cores; this order mixes kernel files (in-process) with server files.
SLOWEST_FILES = ["test_expert_moves_async.py", "test_kernel_moe_int4.py", "test_self_healing.py",
                 "test_kernel_hyper_connection.py", "test_kernel_moe_claim.py", "test_kernel_qsa.py",
                 "test_qa_cancel_storm.py", "test_prefix_cache.py", "test_kernel_moe_int4_prefill.py",
                 "test_schemathesis.py", "test_quantized_checkpoint.py", "test_demo_model.py", "test_agents.py",
                 "test_qa_deploy.py", "test_gptq_checkpoint.py", "test_qa_api_oracle.py", "test_expert_table.py",
                 "test_kernel_quant_gemv.py", "test_cluster.py", "test_kernel_deltanet_decode.py",
                 "test_cli_migration.py", "test_kernel_section_attention.py", "test_unseen_checkpoints_2.py",
                 "test_qa_prefix_oracle.py", "test_any_checkpoint.py", "test_train_demo.py", "test_engine_core.py",
                 "test_grammar_xml_tool_calls.py", "test_kernel_moe_fp8.py", "test_qa_end_of_stream_stall.py"]


# Test files that share session resources (`shared`): each group runs on one xdist worker, its files one after the
# other (`pytest_xdist_make_scheduler`), and what they share is stopped when the group's last test has run. "api": the
# tiny checkpoint's 2-stage cluster (small_cluster_options) and its thinking-template 1-stage cluster, ~8 and ~5 s
# of CPU to start (without a PLE service process); "corpus": the small training corpus (tools/build_corpus.py, ~8 s).
SHARED_GROUPS = {"test_agents.py": "api", "test_responses_api.py": "api", "test_device_sampling_cluster.py": "api",
                 "test_agent_clients.py": "api", "test_prompt_logprobs.py": "api", "test_train_demo.py": "corpus",
                 "test_route_trace.py": "corpus"}


def pytest_xdist_auto_num_workers(config) -> int | None:
    """`-n auto` on a machine without a GPU: one worker more than its cores. Much of a server test is waiting (a hang
    or start timeout run out, a restart, a stream paused while a component comes back), and the extra worker's
    tests use the cores meanwhile. On the 2-core CI-sized VM (2026-12-07, four full runs in a row; its speed drifts):
    3 workers 607 s (18m33 of user CPU), 2 workers 753 s (21m00), 4 workers 741 s (22m51), 3 again 685 s (21m10):
    wall / CPU 0.54-0.55 with 3 or 4 against 0.60 with 2, and a fourth worker's contention costs more CPU than it
    hides. With a GPU, xdist's own count."""
    import torch

    if torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


def _group(path) -> str:
    name = Path(str(path)).name
    return SHARED_GROUPS.get(name, name)


def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    for name, group in SHARED_GROUPS.items():        # a group's files side by side, at its best-ranked file's place
        rank[group] = min(rank.get(group, len(SLOWEST_FILES)), rank.get(name, len(SLOWEST_FILES)))
    items.sort(key=lambda item: rank.get(_group(item.fspath), len(rank)))   # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)        # `pytest -p no:xdist` has no such hook
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the files of a SHARED_GROUPS group as one unit of work (one worker runs them all)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_GROUPS.get(Path(scope).name, scope)

    return GroupedFiles(config, log)


class _Shared:
    """Resources the files of one SHARED_GROUPS group share: made by the first test that asks, stopped after the
    group's last test (or when a test of another group or file follows: without xdist the groups still run whole,
    in pytest_collection_modifyitems' order)."""

    def __init__(self) -> None:
        import contextlib

        self.values: dict[str, object] = {}
        self.stack = contextlib.ExitStack()

    def get(self, key: str, make):
        if key not in self.values:
            self.values[key] = self.stack.enter_context(make())
        return self.values[key]

    def close(self) -> None:
        self.values.clear()
        self.stack.close()


_SHARED = _Shared()


def shared(key: str, make):
    """The group's resource `key`, `make()` (a context manager) entered by the first caller."""
    return _SHARED.get(key, make)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _SHARED.values and (nextitem is None or _group(nextitem.fspath) != _group(item.fspath)):
        _SHARED.close()


def pytest_sessionfinish(session, exitstatus):
    """An interrupted or stopped run (-x, Ctrl-C) never reaches its group's last test: stop what it shared."""
    _SHARED.close()


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Test tensors are tiny: one intra-op thread is faster, and far faster on a shared, busy 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def reference_checkpoints(tmp_path_factory):
    """family -> (directory written by transformers.save_pretrained, the in-memory transformers model)."""
    from hf_oracle import FAMILIES, save_reference

    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"ref_{family}")
        out[family] = (path, save_reference(family, path))
    return out


@pytest.fixture(scope="session")
def fp8_dirs(tmp_path_factory) -> dict[str, Path]:
    """Block-FP8 checkpoints (`moepipe quantize --scheme fp8-block`) of transformers' tiny Qwen4-Exp and Qwen3-Next,
    made once for the FP8 expert and dense tests."""
    pytest.importorskip("compressed_tensors")
    from hf_oracle import save_reference
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    out = {}
    for i, family in enumerate(("qwen4_exp", "qwen3_next")):
        src = tmp_path_factory.mktemp(family)
        save_reference(family, src, seed=i)
        out[family] = tmp_path_factory.mktemp(family + "_fp8") / "q"
        quantize_checkpoint(src, out[family], "fp8-block")
    return out


def moepipe(*args: str, env: dict[str, str] | None = None):
    """`moepipe <subcommand> ...` run in this process by the command module that `moepipe` itself runs for that
    subcommand (shared.cli.COMMANDS: stage_worker.cli or gateway.cli), with `env` set while it runs: a
    subprocess.CompletedProcess with its exit code and what it printed. A subprocess would pay a fresh Python and
    torch import (seconds) a call; the dispatcher's own process boundary is tested end to end by
    tests/test_cli_layering.py and the tests that start `python -m shared.cli serve|generate`."""
    import contextlib
    import importlib
    import io
    import signal
    import subprocess
    from unittest import mock

    from shared.cli import COMMANDS

    command = next(a for a in args if not a.startswith("-"))
    main = importlib.import_module(COMMANDS[command][0]).main
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    # `serve` here is for its refusals: one that gets as far as starting a child would serve in this process until
    # killed (a flag a test expects refused that has become accepted hung a worker for 14 minutes). Spawning fails
    # instead (run_serve prints it and returns 1), and the handlers run_serve installs leave with the call.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    no_children = mock.patch("gateway.launcher.Cluster._spawn", side_effect=RuntimeError(
        "tests' moepipe() helper: serve got as far as starting a server (expected a refusal)")) \
        if command == "serve" else contextlib.nullcontext()
    try:
        with no_children, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:            # argparse: a bad flag or value (2), --help (0)
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(["moepipe", *args], code, out.getvalue(), err.getvalue())


# The servers under test speak plain HTTP on 127.0.0.1, so the tests' clients are built without TLS verification
# (`verify=False` on httpx calls, and the two factories below for the official openai client): a verifying httpx
# client loads the CA bundle into an SSL context as it is built, ~55-70 ms of CPU on the CI machine, and httpx.get /
# httpx.post build a client per call, every openai client one of its own. A suite run built ~590 of them (~35 s of
# CPU, polling loops the most) for TLS that http:// never uses.
def OpenAI(**kw):
    """`openai.OpenAI(**kw)`, its httpx client (openai's default one) built without an SSL context."""
    import openai

    return openai.OpenAI(http_client=openai.DefaultHttpxClient(verify=False), **kw)


def AsyncOpenAI(**kw):
    """`openai.AsyncOpenAI(**kw)`, its httpx client (openai's default one) built without an SSL context."""
    import openai

    return openai.AsyncOpenAI(http_client=openai.DefaultAsyncHttpxClient(verify=False), **kw)


def free_port() -> int:
    """A TCP port nothing listens on now (servers under test bind it a moment later), chosen below the kernel's
    ephemeral range: a port the kernel hands out for `bind(0)` is one it also gives outgoing connections, and the
    cluster's own components connect to each other while the slower ones start (a test's PLE service found its
    port taken by such a connection: test_links, 2026-12-05)."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()                       # its own state: tests seed the module's
    for _ in range(200):
        port = pick.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc=None, timeout: float = 120) -> None:
    """Poll `url`/health until it answers 200; fail the test on timeout or if `proc` (the launcher) exits first."""
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1, verify=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read()[-2000:] if proc.stderr else ""
            pytest.fail(f"the server exited with {proc.returncode}: {err}")
        time.sleep(0.2)
    pytest.fail(f"{url} did not become healthy in {timeout:.0f} s")


def stop_server(proc) -> None:
    """Stop a `moepipe serve` started by a test the way a user does (Ctrl-C), killing it if it hangs."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metric(url: str, name: str) -> float:
    """The value of the unlabelled series `name` on the server's /metrics (an AssertionError if it has none)."""
    import httpx

    for line in httpx.get(url + "/metrics", verify=False).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def all_metrics(url: str, timeout: float = 60) -> dict[str, float]:
    """Every sample of the server's /metrics by its name with its labels (`name{label="x"}`)."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=timeout, verify=False).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# The gauges of what a request holds: all 0 once every request has ended and released its resources
HELD = ("moepipe_kv_blocks_used", "moepipe_state_slots_used", "moepipe_requests_running", "moepipe_requests_waiting")


def settle_held(url: str, seconds: float) -> dict[str, float]:
    """The HELD gauges once they are all 0 (or after `seconds`, as they are then)."""
    import time

    deadline = time.time() + seconds
    while True:
        m = all_metrics(url)
        if not any(m[k] for k in HELD) or time.time() > deadline:
            return {k: m[k] for k in HELD}
        time.sleep(0.05)


def small_cluster_options(model: Path):
    """The 2-stage cluster the API test modules share on the tiny checkpoint: small steps and a fixed KV pool, so
    every test's prompt fits and prefill chunks are exercised. No PLE service process (the stages gather their PLE
    rows): each process is a torch import (~4 s of CPU), and the service has its own tests (test_cluster's
    `cluster`, test_self_healing, test_ple_decode_wait, test_any_checkpoint's served clusters)."""
    from gateway.launcher import ServeOptions

    return ServeOptions(model=model, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 64, "block_size": 16, "num_blocks": 512,
                               "ple_service": False})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny preset written once for the session (seed 0): the server tests share it read-mostly."""
    from stage_worker.checkpoint.make_model import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


def small_cluster(tiny_checkpoint: Path):
    """The group's running small_cluster_options cluster on the tiny checkpoint (`shared`, group "api")."""
    from gateway.launcher import Cluster

    return shared("small_cluster", lambda: Cluster(small_cluster_options(tiny_checkpoint)))


def thinking_cluster(tiny_checkpoint: Path, tmp: Path):
    """The group's 1-stage cluster on a copy of the tiny checkpoint with a Qwen3-2507-style thinking template (the
    generation prompt opens the think block, so the reply starts inside it; random weights never close it):
    `shared`, group "api"; `tmp` holds the copy."""
    def make():
        import json
        import shutil

        from gateway.launcher import Cluster, ServeOptions
        from stage_worker.checkpoint.tokenizer_files import CHAT_TEMPLATE

        d = tmp / "tiny"
        shutil.copytree(tiny_checkpoint, d)
        opening = "{%- if enable_thinking is defined and enable_thinking is false -%}"
        assert opening in CHAT_TEMPLATE
        template = CHAT_TEMPLATE.replace(opening, "{%- if enable_thinking is not defined or enable_thinking -%}"
                                         "{{- '<think>\\n' -}}{%- endif -%}" + opening)
        (d / "chat_template.jinja").write_text(template)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        return Cluster(ServeOptions(model=d, stages=1, port=free_port(), extra={"ple_service": False}))

    return shared("thinking_cluster", make)


def small_corpus(tmp: Path) -> Path:
    """The group's tools/build_corpus.py corpus, 0.2 MB a kind, every 5th document held out (`shared`, group
    "corpus"), written under `tmp`."""
    import contextlib
    import subprocess

    @contextlib.contextmanager
    def make():
        out = tmp / "corpus"
        subprocess.run([sys.executable, str(ROOT / "tools/build_corpus.py"), "--out", str(out),
                        "--max-mb-per-kind", "0.2", "--held-out-every", "5"], check=True, capture_output=True)
        yield out

    return shared("small_corpus", make)


def cuda_us(fn, warmup: int = 3, reps: int = 20) -> float:
    """Microseconds per call of `fn` on the current CUDA stream (events around `reps` calls after a warm-up):
    the GPU tests print kernel timings with it."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def graph_us(fn, calls: int = 20, runs: int = 5, warmup: int = 1) -> float:
    """Microseconds per call of `fn(i)` replayed from one CUDA graph: `bench/graph_timing.graph_us`, the benchmarks'
    timer, so the GPU tests' tables and the benchmarks' agree."""
    sys.path.insert(0, str(ROOT / "bench"))
    from graph_timing import graph_us as timed

    return timed(fn, calls, runs, warmup)


def graph_ab(fn, settings, reps: int = 20):
    """fn() captured `reps` times into one CUDA graph under each of `settings` (callables that set a process-wide
    switch; the caller restores it): ([outputs of the graph's last call, per setting], [us a call, per setting]).
    Each setting runs fn once eagerly and once on a side stream (compiles, allocator warm-up) before its capture."""
    import torch

    outs, times = [], []
    for setting in settings:
        setting()
        fn()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                out = fn()
        g.replay()
        torch.cuda.synchronize()
        outs.append([o.clone() for o in (out if isinstance(out, (tuple, list)) else (out,)) if o is not None])
        times.append(graph_us(lambda i: fn(), calls=reps, runs=5, warmup=2))
    return outs, times


def assert_same_tensors(a, b) -> None:
    """Two lists of tensors equal element for element, bit for bit."""
    import torch

    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def collect_events(core, requests, timeout: float = 120) -> list[list]:
    """Hand every request to an engine core at once (so they share steps) and return each one's events (token
    events, then a finish reason or an exception)."""
    import threading

    results: list[list] = [[] for _ in requests]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            results[i].append(ev)
            if isinstance(ev, Exception) or ev.finish_reason is not None:
                done.release()
        return sink

    for i, r in enumerate(requests):
        core.add(r, sink_for(i))
    for _ in requests:
        assert done.acquire(timeout=timeout), "a request never ended"
    return results


class InProcessServer:
    """Real uvicorn on a free 127.0.0.1 port over an app: `with InProcessServer(app, core) as url` (stops the core)."""

    def __init__(self, app, core=None) -> None:
        import socket
        import threading

        import uvicorn

        self.core = core
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        import time

        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.core is not None:
            self.core.stop()
