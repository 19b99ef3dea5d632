"""bench/bench_io.py: a benchmark cut by the device call's `timeout` (SIGTERM) still writes the rows it finished."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_sigterm_writes_the_rows_so_far_and_exits_124(tmp_path):
    out = tmp_path / "cut.json"
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(BENCH)!r})
        from bench_io import write_json, write_on_sigterm
        rows = []
        write_on_sigterm(lambda: write_json(Path({str(out)!r}), {{"results": rows}}))
        rows.append({{"batch": 1}})
        print("ready", flush=True)
        time.sleep(60)
        rows.append({{"batch": 4}})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.terminate()
        assert p.wait(timeout=30) == 124
    finally:
        p.kill()
    assert json.loads(out.read_text()) == {"results": [{"batch": 1}]}
