"""QA of the launcher's lifecycle: a hung gateway. The gateway kills a stage or the PLE service that stops
heartbeating (hang_timeout), but nobody watched the gateway itself: SIGSTOPped (or deadlocked) it left every stream
hanging with its connection open, `/health` unanswered and the launcher waiting for ever (seen: a stream still
open 70 s after the gateway stopped, nothing logged). The launcher now asks the gateway's `/health` and kills one
that has not answered for `hang_timeout`; its death restarts the cluster as any gateway death does."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from conftest import stop_server, wait_healthy
from test_self_healing import _greedy, _serve_restarting_once, _stop_all, _survivors, alive, component_pids

HANG_S = 4.0


def _stream_until_cut(url: str, after: int, then, out: list) -> None:
    """A long streamed completion's SSE lines into `out`, `then()` once `after` have come; a connection cut ends
    it with ("cut", error)."""
    body = {"model": "moepipe", "prompt": "hello", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    if len(out) == after:
                        then()
    except httpx.HTTPError as exc:
        out.append(("cut", repr(exc)))


def test_a_stopped_gateway_is_killed_after_hang_timeout_and_the_cluster_restarted(tiny_checkpoint, tmp_path):
    launcher, url, log = _serve_restarting_once(tiny_checkpoint, tmp_path, MOEPIPE_HANG_TIMEOUT=str(HANG_S))
    children: dict[str, int] = {}
    hung = None
    try:
        wait_healthy(url, launcher)
        before = _greedy(url)
        children = component_pids(launcher.pid)
        hung = children["gateway"]
        stopped: list[float] = []
        lines: list = []
        t = threading.Thread(target=_stream_until_cut, args=(url, 3, lambda: (os.kill(hung, signal.SIGSTOP),
                                                                                stopped.append(time.time())), lines))
        t.start()
        t.join(HANG_S + 30)
        assert not t.is_alive(), "the stream still hangs on the stopped gateway"
        ended = time.time() - stopped[0]
        assert isinstance(lines[-1], tuple) and lines[-1][0] == "cut", lines[-2:]    # as for a gateway's death
        # its last answer was up to a probe interval (1 s) and a probe before the stop; then a probe's timeout
        assert HANG_S - 2 < ended < HANG_S + 10, ended
        assert not _survivors({"gateway": hung}, wait_s=5)   # (its connection closes before its exit ends)
        wait_healthy(url, launcher, timeout=60)
        assert component_pids(launcher.pid)["gateway"] != hung
        assert _greedy(url) == before
        text = log.read_text()
        assert f"gateway (pid {hung}) has not answered /health for {HANG_S:g} s" in text, text[-3000:]
        children = component_pids(launcher.pid)
        stop_server(launcher)
        assert launcher.returncode == 0, log.read_text()[-3000:]
        assert not _survivors(children)
    finally:
        if hung is not None and alive(hung):
            os.kill(hung, signal.SIGKILL)
        _stop_all(launcher, children)
