"""A `gateway.launcher.Cluster` whose processes write their stderr (every log line) to a file the tests read
(tests/test_qa_cancel_storm.py, tests/test_qa_soak_disconnect_burst.py)."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.launcher import Cluster, ServeOptions


class LoggedCluster(Cluster):
    def __init__(self, opts: ServeOptions, log: Path) -> None:
        super().__init__(opts)
        self.log = log
        self._log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _spawn(self, name: str) -> None:
        saved = os.dup(2)
        try:
            os.dup2(self._log_fd, 2)          # the child inherits it
            super()._spawn(name)
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        os.close(self._log_fd)
