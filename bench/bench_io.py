"""What a benchmark's JSON says about the machine it ran on, and writing that JSON (each bench prints a table and
writes JSON; these two pieces were repeated per script)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """The host, kernel, architecture, Python and CPU count: what makes two runs' numbers comparable or not."""
    return {"host": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count()}


def write_json(out: Path, result: dict[str, Any]) -> None:
    """`result` to `out` (its directory made), and a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
