"""Compile a Triton kernel for the H200 (sm_90) without a GPU and read what ptxas says of it: the kernel tests'
offline check for register spills. One place for the probe both kernel files used to carry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Prepended to a test's script (run in a clean interpreter, TRITON_INTERPRET unset): `ptxas_info(ptx)`.
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


def run_compile_script(script: str, timeout: int):
    """Run PTXAS_PROBE + `script` in a subprocess; the JSON of its last stdout line. Skips where this Triton has no
    bundled ptxas."""
    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", PTXAS_PROBE + script], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if r.returncode and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this Triton has no bundled ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
