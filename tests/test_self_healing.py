"""Self-healing (issue 15) on a real `moepipe serve --stages 2` with the PLE service: a stage, then the PLE service
(restarted with stage 0, which maps its ring) are SIGKILLed in turn while three seeded requests stream. The
streams pause, then end with exactly the texts of an undisturbed run (the engine core recomputed the running
requests); the launcher
restarts what died, `/health` is 200 again within the bound, the restart is counted in /metrics, and a greedy
request gets exactly the tokens it got before any fault. Then the launcher is SIGKILLed and takes every child with
it. Also: a port already in use is refused at start with a message naming it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import AsyncOpenAI, free_port, stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from soak import alive, component_pids  # noqa: E402  (the launcher's children by name, as the chaos soak finds them)

# kill -> /health 200 again: issue 15 asks for 10 s; 4.1-5.5 s measured on an idle 2-core machine, but the PLE
# service (which brings stage 0 with it) took over 10 s beside the rest of the suite in CI: the bound leaves room
HEAL_BOUND_S = 20.0
GATEWAY_BOUND_S = 60.0     # the gateway's death restarts the whole cluster (every model load again)


def _greedy(url: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": "moepipe", "prompt": "The quick brown fox",
                                                             "max_tokens": 12, "temperature": 0}, verify=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def _stream(client: AsyncOpenAI, seed: int, kill: int | None = None, killed: list | None = None,
                  max_tokens: int = 40) -> str:
    """A seeded sampled completion, streamed; with `kill`, that pid is SIGKILLed after the third chunk (the time
    goes into `killed`)."""
    stream = await client.completions.create(model="moepipe", prompt=f"hello {seed}", max_tokens=max_tokens, stream=True,
                                             temperature=0.8, seed=seed, extra_body={"ignore_eos": True})
    text, n = [], 0
    async for chunk in stream:
        text.append(chunk.choices[0].text if chunk.choices else "")
        n += 1
        if n == 3 and kill is not None:
            os.kill(kill, signal.SIGKILL)
            killed.append(time.time())
    return "".join(text)


async def _healed(url: str, victim: str, killed: list) -> float:
    """Seconds from the kill until /health is 200 again with the restarted `victim` heartbeating (its restart
    count, which only the new process reports, has gone up), watched while the streams run."""
    series = f'moepipe_component_restarts{{component="{victim}"}}'
    before = _metric(url, series)
    async with httpx.AsyncClient(timeout=2, verify=False) as http:
        while True:
            if killed:
                try:
                    up = (await http.get(url + "/health")).status_code == 200
                except httpx.HTTPError:
                    up = False
                if up and _metric(url, series) > before:
                    return time.time() - killed[0]
                if time.time() - killed[0] > HEAL_BOUND_S:
                    return float("inf")
            await asyncio.sleep(0.1)


async def _load(url: str, kill: tuple[str, int] | None = None, max_tokens: int = 40) -> tuple[list[str], float | None]:
    """Three concurrent seeded streams; with `kill` (victim, its pid), the first stream kills the victim, and the
    seconds until it is healthy again come back too."""
    killed: list[float] = []
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0) as client:
        streams = [_stream(client, seed, kill[1] if kill and seed == 7 else None, killed, max_tokens)
                   for seed in (7, 8, 9)]
        if kill is None:
            return list(await asyncio.gather(*streams)), None
        *texts, healed = await asyncio.gather(*streams, _healed(url, kill[0], killed))
        return texts, healed


def _survivors(children: dict[str, int], wait_s: float = 15.0) -> list[str]:
    """The components of `children` still alive after up to `wait_s` seconds."""
    deadline = time.time() + wait_s
    while time.time() < deadline and [p for p in children.values() if alive(p)]:
        time.sleep(0.2)
    return [name for name, p in children.items() if alive(p)]


def _stop_all(launcher: subprocess.Popen, children: dict[str, int]) -> None:
    stop_server(launcher)
    for p in children.values():
        if alive(p):
            os.kill(p, signal.SIGKILL)


def _stream_lines(url: str, after: int, then, timeout: float) -> list[str]:
    """The SSE lines of a long streamed completion; `then()` runs once, when `after` lines have arrived."""
    lines: list[str] = []
    body = {"model": "moepipe", "prompt": "hello", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == after:
                then()
    return lines


def _metric(url: str, series: str) -> float:
    for line in httpx.get(url + "/metrics", verify=False).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_each_component_is_restarted_and_serving_resumes(tiny_checkpoint):
    children: dict[str, int] = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--model", str(tiny_checkpoint),
                                 "--stages", "2", "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, launcher)
        before = _greedy(url)
        undisturbed, _ = asyncio.run(_load(url))
        # The PLE stage gathers its own decode rows (ple_decode_in_stage: 2 micro-batches here, 2 + 1 streams), so a
        # dead PLE service stalls nothing until the launcher restarts it with stage 0 a second later: the streams
        # must outlast that to be recomputed (120 tokens did not always, on a loaded CI machine). 400 until 2026-12-07,
        # when its two runs took 31 s of the test's 62 on a 2-core CPU; at 200 the streams paused 5-7 tokens after
        # the kill, 185-240 of them still to come, idle and beside two CPU-bound processes
        long_tokens = 200
        undisturbed_long, _ = asyncio.run(_load(url, max_tokens=long_tokens))
        healed, requeued_before = {}, 0.0
        # every component in turn (the PLE service brings stage 0, its PLE stage, down and up with it)
        for victim in ("stage1", "stage0", "ple"):
            pids = component_pids(launcher.pid)
            assert victim in pids, pids
            # The streams pause while the launcher restarts what died, then go on where they were: the engine core
            # recomputes the running requests, and their seeded draws come out the same.
            n = long_tokens if victim == "ple" else 40
            texts, healed[victim] = asyncio.run(_load(url, kill=(victim, pids[victim]), max_tokens=n))
            assert texts == (undisturbed_long if victim == "ple" else undisturbed), victim
            assert healed[victim] <= HEAL_BOUND_S, f"{victim} did not come back within {HEAL_BOUND_S} s"
            assert _greedy(url) == before, victim
            assert _metric(url, f'moepipe_component_restarts{{component="{victim}"}}') >= 1
            requeued = _metric(url, "moepipe_requests_requeued")
            assert requeued > requeued_before, victim           # the stream was recomputed, not finished before
            requeued_before = requeued
        # The gateway holds the engine core and every connection: its streams end (the connection drops), and the
        # launcher restarts the whole cluster, which then serves the same tokens.
        pids = component_pids(launcher.pid)
        t0 = time.time()
        os.kill(pids["gateway"], signal.SIGKILL)
        time.sleep(1.0)
        while time.time() - t0 < GATEWAY_BOUND_S:
            try:
                if httpx.get(url + "/health", timeout=2, verify=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        healed["gateway"] = time.time() - t0
        assert healed["gateway"] < GATEWAY_BOUND_S, "the cluster did not come back after the gateway died"
        assert component_pids(launcher.pid)["gateway"] != pids["gateway"]
        assert _metric(url, 'moepipe_component_restarts{component="gateway"}') == 1
        assert _greedy(url) == before and asyncio.run(_load(url))[0] == undisturbed
        print("kill -> healthy:", {k: f"{v:.1f} s" for k, v in healed.items()})
        assert launcher.poll() is None
        # Last, the launcher killed outright (SIGKILL: no cleanup runs) takes every child with it, those it restarted
        # too (shared/parent_watch.py)
        children = component_pids(launcher.pid)
        assert set(children) == {"ple", "stage0", "stage1", "gateway"}, children
        launcher.kill()
        launcher.wait(timeout=10)
        assert not _survivors(children)
    finally:
        _stop_all(launcher, children)


def test_a_port_in_use_is_refused_by_name(tiny_checkpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "shared.cli", "serve", "--model", str(tiny_checkpoint),
                            "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr


def test_a_replaced_process_still_heartbeating_is_not_a_restart(tmp_path):
    """The launcher replaces stage 0 when the PLE service dies; the old process may heartbeat once more while it
    stops. That is not a third process: one restart is reported, the successor's pid stays, and its heartbeats
    after that are no restart either (each reported restart makes the engine core recompute every request)."""
    from gateway.cluster_executor import ClusterExecutor
    from shared.cluster_config import ClusterConfig, StageSpec
    from shared.protocol import Heartbeat

    cluster = ClusterConfig(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s0.sock")],
                            gateway_endpoint=f"ipc://{tmp_path}/gw.sock")
    ex = ClusterExecutor(cluster, expect_ple=False)
    for pid in (100, 100, 200, 100, 200, 100):
        ex._on_heartbeat(Heartbeat(component="stage0", pid=pid))
    assert ex.restarted() == ["stage0"] and ex.state["stage0"].pid == 200
    ex._on_heartbeat(Heartbeat(component="stage0", pid=300))          # a real restart after that still counts
    assert ex.restarted() == ["stage0"] and ex.state["stage0"].pid == 300


def test_a_step_error_from_a_process_not_yet_heard_from_is_its_restart(tmp_path):
    """A restarted component can fail a plan sent before it started (it lacks those requests' state) before its
    first heartbeat reaches the gateway: that error is the restart (the core recomputes the running requests), not
    a failure of the step's requests. Errors from the known process, or without a pid, still reach the core."""
    from gateway.cluster_executor import ClusterExecutor
    from shared.cluster_config import ClusterConfig, StageSpec
    from shared.protocol import Heartbeat, StageError

    cluster = ClusterConfig(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s0.sock")],
                            gateway_endpoint=f"ipc://{tmp_path}/gw.sock")
    ex = ClusterExecutor(cluster, expect_ple=False)
    ex._on_heartbeat(Heartbeat(component="stage0", pid=100))
    assert not ex._from_new_process(StageError(component="stage0", step=3, message="x", pid=100))
    assert not ex._from_new_process(StageError(component="stage0", step=3, message="x"))
    assert ex._from_new_process(StageError(component="stage0", step=4, message="stale", pid=200))
    assert ex.restarted() == ["stage0"] and ex.state["stage0"].pid == 200
    ex._on_heartbeat(Heartbeat(component="stage0", pid=200))           # its first heartbeat: no second restart
    assert ex.restarted() == [] and not ex._from_new_process(StageError(component="stage0", step=5, message="x",
                                                                         pid=200))


def test_a_step_error_in_the_batch_of_the_restart_is_the_restart(tmp_path):
    """The new process's first heartbeat and its error for a plan sent before it started can come in one batch:
    the heartbeat registers the pid first, and the error then looked like a real failure of the step's requests
    (QA saw 2 of 4 streams fail after a fast PLE restart). Until the core has taken the restart up, such errors
    are the restart's."""
    from gateway.cluster_executor import ClusterExecutor
    from shared.cluster_config import ClusterConfig, StageSpec
    from shared.protocol import Heartbeat, StageError

    cluster = ClusterConfig(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s0.sock")],
                            gateway_endpoint=f"ipc://{tmp_path}/gw.sock")
    ex = ClusterExecutor(cluster, expect_ple=False)
    assert not ex._keep(Heartbeat(component="stage0", pid=100))
    assert ex._keep(StageError(component="stage0", step=3, message="x", pid=100))
    assert not ex._keep(Heartbeat(component="stage0", pid=200))                  # the restart, not yet taken up
    assert not ex._keep(StageError(component="stage0", step=4, message="lost n-gram context", pid=200))
    assert ex.restarted() == ["stage0"]
    assert ex._keep(StageError(component="stage0", step=5, message="x", pid=200))  # after it: a real failure


def test_a_hung_component_is_killed_only_if_it_is_ours(tmp_path):
    """`lost` SIGKILLs a component silent for hang_timeout when its pid runs the component's module on this host
    (so the launcher restarts it); a pid running something else is left alone, and each pid is tried once. Until
    then it is late, not `down`: only a component whose process is not seen running refuses new requests."""
    from gateway.cluster_executor import ClusterExecutor, kill_hung
    from shared.cluster_config import ClusterConfig, StageSpec

    started = time.time()
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "stage_worker", "--stage", "0"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "something_else"])
    # another stage's process (a remote stage's pid can be a local process's: containers number pids from 1)
    stage1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "stage_worker", "--stage", "1"])
    try:
        assert not kill_hung("stage0", other.pid, 40.0) and other.poll() is None
        assert not kill_hung("stage0", stage1.pid, 40.0) and stage1.poll() is None
        # a pid heard from before the process now holding it started: a reused pid, left alone
        assert not kill_hung("stage0", ours.pid, 40.0, heard_at=time.time() - 3600) and ours.poll() is None
        cluster = ClusterConfig(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s0.sock")],
                                gateway_endpoint=f"ipc://{tmp_path}/gw.sock", heartbeat_timeout=0.2,
                                hang_timeout=1.0)
        ex = ClusterExecutor(cluster, expect_ple=False)
        ex.state["stage0"].pid, ex.state["stage0"].last_seen = ours.pid, time.time() - 0.5
        assert ex.lost() == ["stage0"] and ours.poll() is None       # lost, not yet hung
        assert ex.down() == []                    # late, its process runs: new requests queue behind it
        time.sleep(max(0.0, started + 1.5 - time.time()))
        ex.state["stage0"].last_seen = started + 0.2                  # heard from once it ran, then silent
        assert ex.lost() == ["stage0"]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert ex.state["stage0"].killed == {ours.pid}
        assert ex.down() == ["stage0"]            # gone: new requests get 503 until its restart heartbeats
        ex.state["stage0"].pid = other.pid        # a pid running something else is not the component
        assert ex.down() == ["stage0"]
        ex.state["stage0"].pid = stage1.pid       # nor is another stage's
        assert ex.down() == ["stage0"]
    finally:
        for p in (ours, other, stage1):
            if p.poll() is None:
                p.kill()


def test_a_stalled_step_loop_silences_the_heartbeats(tmp_path):
    """The stage's heartbeat thread vouched for a process whose step loop was stuck (QA froze the main thread for
    40 s: /health stayed 200, requests hung). Past stall_timeout it sends none, so the gateway sees the stage lost;
    once the loop turns again they resume."""
    from shared.protocol import Heartbeat, decode

    turned = [time.monotonic() - 5.0]
    with _heartbeat_thread(tmp_path, turned, stall_timeout=1.0) as inbox:
        def beats(seconds: float) -> int:
            n, deadline = 0, time.monotonic() + seconds
            while time.monotonic() < deadline:
                if inbox.poll(50):
                    n += isinstance(decode(inbox.recv_multipart()), Heartbeat)
            return n

        assert beats(0.5) == 0
        turned[0] = time.monotonic()
        assert beats(0.5) >= 3


@contextlib.contextmanager
def _heartbeat_thread(tmp_path, turned: list[float], stall_timeout: float):
    """A stage's heartbeat thread (`stage_worker.main._heartbeats`) with `turned` as its progress clock, sending to
    a gateway inbox this yields; stopped and closed on exit."""
    import threading

    import zmq

    from shared.cluster_config import ClusterConfig, StageSpec
    from shared.links import bind_inbox, cluster_keys
    from stage_worker.main import _heartbeats

    class Runner:
        launched: list = []

        def stats(self):
            return {}

    endpoint = f"ipc://{tmp_path}/gw.sock"
    cluster = ClusterConfig(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s0.sock")],
                            gateway_endpoint=endpoint, heartbeat_interval=0.05, stall_timeout=stall_timeout)
    ctx = zmq.Context()
    inbox = bind_inbox(ctx, endpoint, cluster_keys(""))
    stop = threading.Event()
    t = threading.Thread(target=_heartbeats, args=(ctx, cluster, cluster_keys(""), "stage0", Runner(), stop, turned))
    t.start()
    try:
        yield inbox
    finally:
        stop.set()
        t.join()
        inbox.close(linger=0)
        ctx.term()


def _serve_restarting_once(checkpoint, tmp_path, **env: str) -> tuple[subprocess.Popen, str, Path]:
    """`moepipe serve` of two stages, one restart allowed (--restart-limit 1), `env` set, stderr to a log file:
    (launcher, URL, log)."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--model", str(checkpoint),
                                     "--stages", "2", "--port", str(port), "--no-ple-service", "--restart-limit",
                                     "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, **env})
    return launcher, f"http://127.0.0.1:{port}", log


def test_a_stopped_stage_is_killed_and_restarted_then_given_up(tiny_checkpoint, tmp_path):
    """A hung stage (SIGSTOP: no heartbeats, no exit) was never restarted: /health stayed 503 until someone sent
    SIGCONT. The gateway now kills it after hang_timeout (4 s here) and the launcher restarts it: serving resumes
    with the same tokens, a request sent while it was stopped answered too. That was its one restart (--restart-limit 1): its successor killed while a stream runs
    is given up. The stream waited recovery_timeout (60 s) for it (QA); the gateway is told (SIGUSR1) and the
    stream ends within seconds with an error event naming the stage (not the shutdown's), then `serve` exits 1
    naming it, where it used to stay up answering /health 503 forever."""
    launcher, url, log = _serve_restarting_once(tiny_checkpoint, tmp_path, MOEPIPE_HANG_TIMEOUT="4")
    victim = None
    children: dict[str, int] = {}
    try:
        wait_healthy(url, launcher)
        before = _greedy(url)
        victim = component_pids(launcher.pid)["stage1"]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.time()
        while httpx.get(url + "/health", timeout=2).status_code == 200:
            assert time.time() - t0 < 10, "/health stayed 200 for a stopped stage"
            time.sleep(0.1)
        # late, not gone (its process is there): a request sent now waits for it, as running ones do, and its
        # restart answers it (CI under load once starved a healthy stage past the deadline: three requests 503)
        queued = concurrent.futures.ThreadPoolExecutor(1).submit(_greedy, url)
        while time.time() - t0 < HEAL_BOUND_S + 10:
            pid = component_pids(launcher.pid).get("stage1")
            try:
                if pid not in (None, victim) and httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("the stopped stage was not replaced")
        assert not alive(victim)
        assert queued.result(timeout=60) == before
        assert _greedy(url) == before
        children = component_pids(launcher.pid)
        killed: list[float] = []
        lines = _stream_lines(url, 3, lambda: (os.kill(children["stage1"], signal.SIGKILL), killed.append(time.time())),
                              timeout=90)
        assert time.time() - killed[0] < 20, "the stream waited for a stage that will not come back"
        assert lines[-1] == "data: [DONE]" and "stage1 stopped responding" in lines[-2], lines[-3:]
        assert launcher.wait(timeout=30) == 1
        assert ("exiting with status 1: stage1 exited with -9 and its restarts are used up (1 restart in a row, "
                "restart_limit 1)") in log.read_text()
        assert not _survivors(children)
    finally:
        if victim is not None and alive(victim):
            os.kill(victim, signal.SIGKILL)
        _stop_all(launcher, children)


def test_sigterm_ends_streams_with_an_error_event(tiny_checkpoint):
    """SIGTERM to `moepipe serve` while a stream runs: the stream ends with an error event naming the shutdown and
    its [DONE], not a connection cut mid-chunk (QA: "incomplete chunked read" and a gateway traceback); every
    process exits."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--model", str(tiny_checkpoint),
                                 "--port", str(port), "--no-ple-service"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    children: dict[str, int] = {}
    try:
        wait_healthy(url, launcher)
        children = component_pids(launcher.pid)
        lines = _stream_lines(url, 5, lambda: launcher.send_signal(signal.SIGTERM), timeout=60)
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in lines[-2] and '"error"' in lines[-2], lines[-3:]
        code = launcher.wait(timeout=30)
        assert code == 0, launcher.stderr.read()[-3000:]       # (once 1 under a loaded CI: its reason shows)
        assert not _survivors(children)
    finally:
        _stop_all(launcher, children)


def test_run_dirs_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    """A launcher killed outright left /tmp/moepipe-* behind, its cluster.toml holding the API key (QA counted 86):
    the next launcher removes those whose launcher.pid names no live process, and nothing else."""
    import tempfile

    from gateway.launcher import LAUNCHER_PID, remove_stale_run_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dirs = {name: tmp_path / f"moepipe-{name}" for name in ("dead", "alive", "old", "bad")}
    for d in dirs.values():
        d.mkdir()
        (d / "cluster.toml").write_text('api_key = "k"')
    (dirs["dead"] / LAUNCHER_PID).write_text(str(dead.pid))
    (dirs["alive"] / LAUNCHER_PID).write_text(str(os.getpid()))
    (dirs["bad"] / LAUNCHER_PID).write_text("x")
    (tmp_path / "elsewhere").mkdir()
    assert remove_stale_run_dirs() == [dirs["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "moepipe-alive", "moepipe-bad", "moepipe-old"]


def test_a_hung_restart_is_killed_and_serve_exits_once_restarts_are_used_up(tiny_checkpoint, tmp_path):
    """--restart-limit 1, a stage killed while a stream runs, and its restart hung before its first heartbeat
    (SIGSTOP while it loads). Before: nothing killed the hung restart (the gateway's hang check needs a heartbeat
    from the new pid), so the stream waited recovery_timeout (60 s) and `serve` answered /health 503 forever. Now
    the launcher kills it after start_timeout (12 s here, 15 s until 2026-12-06: the first start, ~5 s on an idle
    2-core machine, must fit it too) as a failed restart; the restarts are used up, so the gateway is told
    (SIGUSR1), the stream ends at once with an error event naming the stage, and `serve` exits 1 with a line naming
    the stage and its restarts, leaving no process."""
    import threading

    launcher, url, log = _serve_restarting_once(tiny_checkpoint, tmp_path, MOEPIPE_START_TIMEOUT="12")
    children: dict[str, int] = {}
    hung: list[int] = []
    try:
        wait_healthy(url, launcher)
        children = component_pids(launcher.pid)
        first = children["stage1"]

        def hang_the_restart() -> None:
            deadline = time.time() + 30
            while time.time() < deadline:
                pid = component_pids(launcher.pid).get("stage1")
                if pid not in (None, first):
                    os.kill(pid, signal.SIGSTOP)      # torch is still importing: no heartbeat yet
                    hung.append(pid)
                    return
                time.sleep(0.02)

        watcher = threading.Thread(target=hang_the_restart)
        killed: list[float] = []

        def kill_stage1() -> None:
            os.kill(first, signal.SIGKILL)
            killed.append(time.time())
            watcher.start()

        lines = _stream_lines(url, 3, kill_stage1, timeout=90)
        ended = time.time() - killed[0]
        watcher.join()
        assert hung, "stage1 was not restarted"
        assert lines[-1] == "data: [DONE]" and "stage1 stopped responding" in lines[-2], lines[-3:]
        # 1 s backoff + 12 s start_timeout, then a watchdog pass (not recovery_timeout's 60 s)
        assert 12 < ended < 25, ended
        assert launcher.wait(timeout=30) == 1
        text = log.read_text()
        assert f"stage1 (pid {hung[0]}) sent no heartbeat within 12 s of its restart" in text, text[-3000:]
        assert ("exiting with status 1: stage1 exited with -9 and its restarts are used up (1 restart in a row, "
                "restart_limit 1)") in text, text[-3000:]
        assert not _survivors({**children, "stage1": hung[0]})
    finally:
        for pid in hung:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        _stop_all(launcher, children)


class _FakeProc:
    """What the Supervisor reads of a Popen."""

    def __init__(self, pid):
        self.pid, self.code, self.signals = pid, None, []

    def poll(self):
        return self.code

    @property
    def returncode(self):
        return self.code

    def kill(self):
        self.code = -9

    def send_signal(self, sig):
        self.signals.append(sig)


def _fake_supervisor():
    """A Supervisor over a fake cluster (gateway, stage0, stage1; restart_limit 2, start_timeout 10 s) and
    `at(t, down)`: one supervision pass at time t with /health naming `down` (None: the gateway does not answer).
    A gateway restart brings the stages back with it, as `Cluster.restart` does."""
    from types import SimpleNamespace

    from gateway.launcher import Supervisor

    clock = {"now": 0.0}
    pids = iter(range(200, 300))

    def restart(name):
        also = ["stage0", "stage1"] if name == "gateway" else []
        for n in (name, *also):
            cluster.procs[n], cluster.started_at[n] = _FakeProc(next(pids)), clock["now"]
        cluster.restarts[name] = cluster.restarts.get(name, 0) + 1
        return also

    down: dict = {"names": None}
    cluster = SimpleNamespace(procs={"gateway": _FakeProc(1), "stage0": _FakeProc(2), "stage1": _FakeProc(3)},
                              started_at={}, restarts={}, restart=restart, down_components=lambda: down["names"],
                              cluster=SimpleNamespace(restart_limit=2, start_timeout=10.0, heartbeat_timeout=2.5,
                                                      heartbeat_interval=0.5))
    sup = Supervisor(cluster)

    def at(t, names=None):
        clock["now"], down["names"] = t, names
        sup.check(now=t)

    return sup, cluster, at


def test_the_supervisor_kills_a_restart_it_does_not_hear_from_within_start_timeout(capsys):
    """The launcher's side of the start deadline, on a fake cluster: a restarted stage /health still names after
    start_timeout is SIGKILLed, and that counts as a failed restart (the next waits longer, and is the last). /health
    not naming it is believed only once the dead predecessor's heartbeats are stale (heartbeat_timeout), so a
    restart is not taken as up on its predecessor's last heartbeats. A restart heard from is left alone however
    long it runs; when the restarts are used up, the exit line names the component and its restarts."""
    sup, cluster, at = _fake_supervisor()

    cluster.procs["stage1"].code = -9
    at(100.0)                                         # dead: due in 1 s
    at(101.5)
    hung = cluster.procs["stage1"]
    assert hung.pid == 200 and cluster.restarts["stage1"] == 1
    at(103.0, [])                                     # its predecessor's heartbeats may still count: not yet up
    at(108.0, ["stage1"])
    assert hung.poll() is None
    at(112.0, ["stage1"])                             # 10.5 s without a heartbeat: killed, a failed restart
    assert hung.poll() == -9 and sup.due == {"stage1": 114.0}      # 2nd restart in a row: 2 s backoff
    at(114.5)
    up = cluster.procs["stage1"]
    assert up.pid == 201 and cluster.restarts["stage1"] == 2
    at(117.5, ["ple"])                                # heard from (another component is down): up
    at(200.0, ["stage1"])                             # a later silence is the gateway's hang_timeout, not ours
    assert up.poll() is None and "stage1" not in sup.starting
    up.code = 1
    at(300.0)                                         # restarts used up
    assert "stage1" in sup.given_up and cluster.procs["gateway"].signals    # the gateway was told
    assert sup.exit_given_up(should_stop=lambda: True) == 1
    err = capsys.readouterr().err
    assert "stage1 (pid 200) sent no heartbeat within 10 s of its restart" in err
    assert "exiting with status 1: stage1 exited with 1 and its restarts are used up (2 restarts in a row, " \
           "restart_limit 2)" in err


def test_a_hung_gateway_restart_is_killed_alone(capsys):
    """The stages restarted with a gateway are heard from through it: when the gateway's restart hangs (no /health
    at all), only it is killed at start_timeout; the log named every component as silent, and killed them all."""
    sup, cluster, at = _fake_supervisor()
    cluster.procs["gateway"].code = -9
    at(100.0)
    at(101.5)
    procs = dict(cluster.procs)
    assert sorted(sup.starting) == ["gateway", "stage0", "stage1"]
    at(112.0, None)                                   # 10.5 s, the gateway does not answer
    assert procs["gateway"].poll() == -9
    assert procs["stage0"].poll() is None and procs["stage1"].poll() is None
    err = capsys.readouterr().err
    assert "gateway (pid" in err and "stage0 (pid" not in err and "stage1 (pid" not in err


def test_a_long_step_whose_layers_finish_is_not_a_stall(tmp_path):
    """stall_timeout measured the step loop's turns, so a step longer than it (a large prefill chunk on a CPU)
    silenced the heartbeats although the stage was computing: the stage was killed, and its restart killed again
    on the same recomputed request until the restarts ran out. Each layer now marks progress (`mark_progress`):
    a 1.2 s step of 0.2 s layers keeps heartbeating under a 0.6 s stall_timeout; a layer stuck past it still
    silences them. (The real floor is MIN_STALL_TIMEOUT; the clock's rule is the same.)"""
    import threading

    from shared.protocol import Heartbeat, decode
    from stage_worker.main import mark_progress

    class Layer:
        def __init__(self, seconds):
            self.seconds = seconds

        def forward_deferred(self, h, pending, *rest):
            time.sleep(self.seconds)
            return h + 1, pending

    class Model:
        layers = {str(i): Layer(0.2) for i in range(6)}

    model = Model()
    turned = [time.monotonic()]
    mark_progress(model, turned)

    def step() -> None:                               # the model's forward: its layers, one after the other
        h, pending = 0, None
        for layer in model.layers.values():
            h, pending = layer.forward_deferred(h, pending, None, None, None)
        assert h == len(model.layers)

    with _heartbeat_thread(tmp_path, turned, stall_timeout=0.6) as inbox:
        def beats_during(work) -> list[float]:
            """When heartbeats arrived while `work` ran (seconds from its start)."""
            runner = threading.Thread(target=work)
            t0 = time.monotonic()
            runner.start()
            out = []
            while runner.is_alive():
                if inbox.poll(20):
                    if isinstance(decode(inbox.recv_multipart()), Heartbeat):
                        out.append(time.monotonic() - t0)
            runner.join()
            return out

        seen = beats_during(step)
        assert seen and seen[-1] > 1.0, seen                  # still heartbeating at the end of the 1.2 s step
        assert max(b - a for a, b in zip([0.0] + seen, seen)) < 0.5, seen
        model.layers["3"].seconds = 1.5                       # one layer stuck past stall_timeout: silence
        seen = beats_during(step)
        assert any(b - a > 0.7 for a, b in zip(seen, seen[1:])), seen


def test_a_stall_timeout_below_the_floor_is_refused_by_name(tiny_checkpoint):
    """A stall_timeout shorter than a healthy stretch of a step kill-looped the stage; one below MIN_STALL_TIMEOUT
    (30 s) is refused at start, naming the key, the variable and the floor."""
    r = subprocess.run([sys.executable, "-m", "shared.cli", "serve", "--model", str(tiny_checkpoint), "--port",
                        str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MOEPIPE_STALL_TIMEOUT": "5"})
    assert r.returncode == 2, r.stderr
    assert "stall_timeout (MOEPIPE_STALL_TIMEOUT) 5 s is below the minimum of 30 s" in r.stderr, r.stderr


def test_a_step_that_does_not_come_back_is_reported_with_every_stack(tiny_checkpoint, tmp_path):
    """A pipeline that stops without an error (h100-32: a one-stage server's four streams stopped at token 253-255
    of 256 for 113 s and nothing was logged) now says where it waits: a step in flight for stall_report_timeout
    while every component still heartbeats is logged once with its plan, then the gateway's threads' stacks and,
    by SIGUSR2, each stage's. Here stage 1 is stopped for less than the heartbeat deadline: the report comes (the
    stopped stage prints its stacks when it resumes), and the stream ends with all its tokens: nothing failed."""
    launcher, url, log = _serve_restarting_once(tiny_checkpoint, tmp_path, MOEPIPE_STALL_REPORT_TIMEOUT="0.3")
    children: dict[str, int] = {}
    try:
        wait_healthy(url, launcher)
        children = component_pids(launcher.pid)
        victim = children["stage1"]

        def pause() -> None:
            os.kill(victim, signal.SIGSTOP)
            time.sleep(1.5)                   # under heartbeat_timeout (2.5 s): not lost, only slow
            os.kill(victim, signal.SIGCONT)

        body = {"model": "moepipe", "prompt": "hello", "max_tokens": 60, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        chunks, usage, finish = 0, None, None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    finish = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), finish)
                    chunks += 1
                    if chunks == 10:
                        pause()
        assert usage["completion_tokens"] == 60 and finish == "length", (usage, finish)
        deadline = time.time() + 10
        while time.time() < deadline and log.read_text().count("Thread 0x") < 3:
            time.sleep(0.2)
        text = log.read_text()
        assert "has not come back after" in text and "stall_report_timeout" in text, text[-3000:]
        assert "asked stage0, stage1 for their stacks" in text, text[-3000:]
        # faulthandler's dumps: the gateway's own, stage 0's at once, stage 1's when it resumed
        assert text.count("Thread 0x") >= 3 and "stage_worker/main.py" in text, text[-3000:]
        # once per step, not every watchdog turn (another step may be reported too: a first prefill, or any step
        # of a loaded CI machine that took longer than the 0.3 s here)
        reported = re.findall(r"engine core: step (\d+) \(micro-batch .* has not come back after", text)
        assert reported and len(reported) == len(set(reported)), reported
    finally:
        _stop_all(launcher, children)
