"""A component whose launcher is gone ends even when its SIGTERM path cannot (shared/parent_watch.py).

h100-34: a GPU stage with the parent-death signal was still running 70 s after its launcher died, holding 63 GiB.
The child here ignores SIGTERM, standing in for a main thread that never gets back to its handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import signal, sys, time
from shared import parent_watch
parent_watch.ORPHAN_GRACE_S = 1.0
signal.signal(signal.SIGTERM, signal.SIG_IGN)
parent_watch.die_with_parent(int(sys.argv[1]))
print("ready", flush=True)
while True:
    time.sleep(0.2)
"""

MIDDLE = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=subprocess.PIPE,
                         stderr=open(sys.argv[2], "w"), text=True, start_new_session=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and getppid re-parenting are Linux's")
def test_an_orphan_that_ignores_sigterm_still_exits_with_its_stacks(tmp_path):
    log = tmp_path / "child.err"
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, CHILD, str(log)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        child = int(middle.stdout.readline())
        time.sleep(1.5)                       # alive while its parent is: the watcher only polls
        assert _alive(child)
        middle.kill()                         # the launcher killed outright
        middle.wait(timeout=10)
        t0 = time.monotonic()
        while _alive(child) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        gone_after = time.monotonic() - t0
        assert not _alive(child), "the orphan was still running 15 s after its launcher died"
        assert 0.9 < gone_after < 6, gone_after    # the grace (1 s) and a poll, not at once: SIGTERM had its chance
        err = log.read_text()
        assert f"launcher {middle.pid} is gone" in err
        assert "most recent call first" in err     # faulthandler's stacks: what held the process
    finally:
        middle.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def _alive(pid: int) -> bool:
    """A zombie is gone for this purpose (its reaper, init, may not have run yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
