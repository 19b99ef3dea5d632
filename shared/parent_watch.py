"""Die with the launcher: a component started by `moepipe serve` gets SIGTERM when the launcher goes, however it
goes (SIGKILL, a crashed test run), so no stage, PLE service or gateway is left running on its own.

The launcher starts each child in a session of its own (so a terminal's Ctrl-C reaches only the launcher, which
stops them in order); without this, a launcher killed outright left its children behind, holding memory and
CPU (seen on the CI machine: a killed test run's cluster kept two cores busy). Linux only (prctl); elsewhere a no-op.
A component started alone (systemd, `--parent-pid` not given) is not affected.

SIGTERM alone was not enough: on the H100 (h100-34) a GPU stage whose launcher had gone was still running 70 s
later, holding 63 GiB of device memory, though it had the parent-death signal. So a watcher thread also sees the
launcher go and arms faulthandler's exit timer: ORPHAN_GRACE_S later the process prints every thread's stack (what
held it, into the stage's log) and ends with os._exit whatever its main thread is doing (the timer is a C thread
that needs no GIL and no signal handler to run). The grace matches the launcher's own SIGTERM-then-SIGKILL wait.
faulthandler has one such timer a process: a component must not use `dump_traceback_later` itself (nothing does).
A component stopped (SIGSTOP) when its launcher dies cannot run this thread either; the next `moepipe serve` kills
it (`gateway/launcher.py`, `_left_by`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 10.0        # a clean stop takes well under this; the launcher's own stop waits as long
_POLL_S = 0.5


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGTERM when our parent exits; if it already has (we were re-parented), stop now."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return                                   # no prctl: behave as before rather than fail to start
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid, ORPHAN_GRACE_S), name="parent-watch",
                     daemon=True).start()


def _exit_when_orphaned(parent_pid: int, grace_s: float) -> None:
    """Once the parent is gone, give the SIGTERM path `grace_s` to end the process, then dump stacks and exit."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    print(f"{os.path.basename(sys.argv[0]) or 'moepipe'} (pid {os.getpid()}): launcher {parent_pid} is gone; "
          f"exiting within {grace_s:.0f} s", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(grace_s, exit=True)


RESTARTS_ENV = "MOEPIPE_RESTARTS"


def restart_count() -> int:
    """How often the launcher has restarted this component (it sets MOEPIPE_RESTARTS; heartbeats report it)."""
    try:
        return int(os.environ.get(RESTARTS_ENV, "0"))
    except ValueError:
        return 0
