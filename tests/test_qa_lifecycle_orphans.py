"""QA of the launcher's lifecycle: a child that cannot take its parent-death signal. A stage stopped (SIGSTOP, a
debugger) when its launcher is SIGKILLed keeps the kernel's SIGTERM pending and its parent-watch thread frozen, so
it stayed, stopped and holding its memory, for ever: the next `moepipe serve` removed the dead launcher's run
directory (`remove_stale_run_dirs`) but left its process. The next start now also kills what that launcher left
running (its `--parent-pid` and the run directory's config on the command line)."""

from __future__ import annotations

import os
import signal
import time

from conftest import wait_healthy
from test_qa_lifecycle_signals import _serve
from test_self_healing import _stop_all, _survivors, alive, component_pids


def test_a_stopped_orphan_is_killed_by_the_next_start(tiny_checkpoint, tmp_path):
    launcher, url, tmp = _serve(tiny_checkpoint, tmp_path)
    children: dict[str, int] = {}
    late = None
    try:
        wait_healthy(url, launcher)
        children = component_pids(launcher.pid)
        run_dir, = tmp.glob("moepipe-*")
        stopped = children["stage1"]
        os.kill(stopped, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        others = {n: p for n, p in children.items() if p != stopped}
        assert not _survivors(others)              # the parent-death signal takes the others
        time.sleep(1.0)
        assert alive(stopped)                      # the stopped one cannot take it
        late, url2, _ = _serve(tiny_checkpoint, tmp_path)
        wait_healthy(url2, late)
        assert not _survivors({"stage1": stopped}, wait_s=5), "the stopped orphan outlived the next start"
        assert not run_dir.exists()
        assert f"killed 1 process(es) (pid {stopped}) that the dead launcher {launcher.pid} left running" in \
            (tmp_path / "serve.log").read_text()
    finally:
        if alive(children.get("stage1", 0) or 0):
            os.kill(children["stage1"], signal.SIGKILL)
        _stop_all(launcher, children)
        if late is not None:
            _stop_all(late, {})
