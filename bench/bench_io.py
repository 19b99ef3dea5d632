"""What a benchmark's JSON says about the machine it ran on, and writing that JSON (each bench prints a table and
writes JSON; these two pieces were repeated per script)."""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
from pathlib import Path
from typing import Any, Callable


def machine() -> dict[str, Any]:
    """The host, kernel, architecture, Python and CPU count: what makes two runs' numbers comparable or not."""
    return {"host": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count()}


def write_json(out: Path, result: dict[str, Any]) -> None:
    """`result` to `out` (its directory made), and a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def write_on_sigterm(write: Callable[[], None]) -> None:
    """Run `write` (the JSON of the rows so far) if the process gets SIGTERM, then exit 124: a device call wraps each
    benchmark in `timeout`, and a sweep cut there lost every row it had timed (h200-35: `bench/tune_kernels.py`
    printed its tables but wrote no JSON)."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            write()
        finally:
            sys.exit(124)

    signal.signal(signal.SIGTERM, handler)
