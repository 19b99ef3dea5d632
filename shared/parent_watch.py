"""Die with the launcher: a component started by `moepipe serve` gets SIGTERM when the launcher goes, however it
goes (SIGKILL, a crashed test run), so no stage, PLE service or gateway is left running on its own.

The launcher starts each child in a session of its own (so a terminal's Ctrl-C reaches only the launcher, which
stops them in order); without this, a launcher killed outright left its children behind, holding memory and
CPU (seen on the CI machine: a killed test run's cluster kept two cores busy). Linux only (prctl); elsewhere a no-op.
A component started alone (systemd, `--parent-pid` not given) is not affected.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGTERM when our parent exits; if it already has (we were re-parented), stop now."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return                                   # no prctl: behave as before rather than fail to start
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


RESTARTS_ENV = "MOEPIPE_RESTARTS"


def restart_count() -> int:
    """How often the launcher has restarted this component (it sets MOEPIPE_RESTARTS; heartbeats report it)."""
    try:
        return int(os.environ.get(RESTARTS_ENV, "0"))
    except ValueError:
        return 0
