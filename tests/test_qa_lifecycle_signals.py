"""QA of the launcher's lifecycle: the signals a terminal or a service manager sends `moepipe serve`.

SIGHUP (the terminal or the ssh session that ran `moepipe serve` closed): the launcher handled only SIGINT and
SIGTERM, so SIGHUP killed it outright (exit -1, no cleanup). Its children went with it (the parent-death signal),
but its run directory stayed behind, `cluster.toml` and the API key in it, until the next start. It is now a stop
like SIGTERM's: streams end with an error event, every process exits, the run directory is removed, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import free_port, wait_healthy
from test_self_healing import ROOT, _stop_all, _stream_lines, _survivors, component_pids


def _serve(checkpoint, tmp_path, *args: str) -> tuple[subprocess.Popen, str, object]:
    """`moepipe serve` of two stages with a TMPDIR of its own (its run directory is the one there), stderr to a
    log file: (launcher, URL, TMPDIR)."""
    port = free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    with open(tmp_path / "serve.log", "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--model", str(checkpoint),
                                     "--stages", "2", "--port", str(port), "--no-ple-service", *args], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, "TMPDIR": str(tmp)})
    return launcher, f"http://127.0.0.1:{port}", tmp


def test_sighup_stops_the_server_cleanly(tiny_checkpoint, tmp_path):
    launcher, url, tmp = _serve(tiny_checkpoint, tmp_path)
    children: dict[str, int] = {}
    try:
        wait_healthy(url, launcher)
        children = component_pids(launcher.pid)
        assert len(list(tmp.glob("moepipe-*"))) == 1
        lines = _stream_lines(url, 5, lambda: launcher.send_signal(signal.SIGHUP), timeout=60)
        assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2], lines[-3:]
        assert launcher.wait(timeout=30) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert not _survivors(children)
        assert not list(tmp.glob("moepipe-*")), "the run directory was left behind"
    finally:
        _stop_all(launcher, children)


def test_a_stopped_stage_does_not_hold_up_the_stop(tiny_checkpoint, tmp_path):
    """A stage SIGSTOPped (a debugger, `kill -STOP`, a job-control stop) when the server is stopped: SIGTERM stays
    pending on a stopped process, so the launcher waited its whole 10 s and SIGKILLed it. It now sends SIGCONT after
    SIGTERM, as systemd does: the stage ends cleanly at once and `serve` exits 0 within a few seconds."""
    launcher, url, tmp = _serve(tiny_checkpoint, tmp_path)
    children: dict[str, int] = {}
    try:
        wait_healthy(url, launcher)
        children = component_pids(launcher.pid)
        os.kill(children["stage1"], signal.SIGSTOP)
        t0 = time.time()
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        took = time.time() - t0
        assert took < 5, f"the stop took {took:.1f} s"
        assert not _survivors(children)
        assert not list(tmp.glob("moepipe-*"))
    finally:
        _stop_all(launcher, children)
