"""Compile a Triton kernel for the H200 (sm_90) without a GPU and read what ptxas says of it: the kernel tests'
offline check for register spills. One place for the probe the kernel files share, and for the process that runs
their compile scripts (Triton's interpreter, which the tests' own process runs, must be off there)."""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading

import pytest

# Prepended to a test's script (run in an interpreter with TRITON_INTERPRET unset): `ptxas_info(ptx)`.
PTXAS_PROBE = r"""
import os, subprocess, tempfile, triton

def ptxas_info(ptx):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                              text=True).stderr
    return dict(spill=int(info.split(" bytes spill stores")[0].rsplit(" ", 1)[-1]),
                regs=int(info.split(" registers")[0].rsplit(" ", 1)[-1]))
"""

# The compiling process: it runs each script it is sent (a JSON line on stdin) in a fresh namespace as `__main__`,
# and answers with one line after MARK: the script's stdout and, if it raised, the traceback.
MARK = "@@sm90-compile@@ "
SERVER = r"""
import contextlib, io, json, sys, traceback
for line in sys.stdin:
    out, err = io.StringIO(), ""
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(json.loads(line), "<compile script>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        err = "" if exc.code in (0, None) else traceback.format_exc()
    except BaseException:
        err = traceback.format_exc()
    sys.__stdout__.write(MARK + json.dumps({"stdout": out.getvalue(), "error": err}) + "\n")
    sys.__stdout__.flush()
"""


class _Compiler:
    """One compiling process per test process, started at the first script: each script used to get a process of
    its own, which paid torch's and Triton's imports again (~3 s of CPU, a dozen compile tests). Scripts only
    compile and read what they compiled (they set no module state), so they share it; it ends when its stdin
    closes (this process's end) or when a script outlives its timeout."""

    def __init__(self) -> None:
        from conftest import ROOT

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen([sys.executable, "-c", f"MARK = {MARK!r}\n" + SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(json.loads(line[len(MARK):]))
        self.answers.put(None)                  # the process ended

    def run(self, script: str, timeout: float) -> dict | None:
        self.proc.stdin.write(json.dumps(script) + "\n")
        self.proc.stdin.flush()
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise subprocess.TimeoutExpired("sm90 compile script", timeout) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_compiler: _Compiler | None = None


def _stop() -> None:
    if _compiler is not None:
        _compiler.close()


atexit.register(_stop)


def run_compile_script(script: str, timeout: int):
    """Run PTXAS_PROBE + `script` in the compiling process (TRITON_INTERPRET unset); the JSON of the last line it
    printed. Skips where this Triton has no bundled ptxas."""
    global _compiler

    if _compiler is None or _compiler.proc.poll() is not None:
        _compiler = _Compiler()
    answer = _compiler.run(PTXAS_PROBE + script, timeout)
    assert answer is not None, f"the compiling process exited with {_compiler.proc.wait()}"
    err = answer["error"]
    if err and "ptxas" in err and "No such file" in err:
        pytest.skip("this Triton has no bundled ptxas")
    assert not err, err[-3000:]
    return json.loads(answer["stdout"].strip().splitlines()[-1])
