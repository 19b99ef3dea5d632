"""The serve command's install has no Triton (it is a GPU-side dependency that torch's CUDA builds bring along):
nothing on the CPU path may import it. CI's fresh-environment smoke step proves it for the whole cluster; this test
catches it in the suite, in a child interpreter where `import triton` fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys
sys.modules["triton"] = None                       # any `import triton` now raises ImportError
from stage_worker.cli import main
from stage_worker.checkpoint.make_model import make_model
from stage_worker.checkpoint.loader import load_model
from stage_worker.kernels.flags import KernelFlags

path = make_model("tiny", sys.argv[1], seed=0)
load_model(path).set_kernels(KernelFlags.parse("all"))   # what a stage does at start (the CPU keeps PyTorch)
code = main(["generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "4", "--temperature", "0"])
assert code == 0, code
assert not any(m.split(".")[0] == "triton" and sys.modules[m] is not None for m in sys.modules)
"""


def test_model_runs_on_cpu_without_triton(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "tiny")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "generate printed nothing"
