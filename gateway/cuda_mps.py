"""CUDA MPS for stage processes that share a GPU (cluster key `cuda_mps`, issue 14).

Two stage processes on one GPU time-slice it: each CUDA context runs alone for its slice, so a pipeline of two
stages cannot overlap one stage's kernels with the other's, and the switches cost (H200, h200-24: two stages 607.7
tok/s against one stage's 786.5 at 4 streams). The Multi-Process Service runs the kernels of every client process
in one hardware context, concurrently. Its control daemon is a user process: the launcher starts one private to
this `serve` (its pipe and log directories in the run directory, so it neither needs nor touches a system-wide
daemon or the GPU's compute mode), hands the children its pipe directory, and tells it to quit at the end. Where
the daemon cannot start (no `nvidia-cuda-mps-control`, a container without the device nodes it needs) the stages
run time-sliced as before and the launcher says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from shared.cluster_config import ClusterConfig

MPS_CONTROL = "nvidia-cuda-mps-control"


def shared_gpus(cluster: ClusterConfig) -> list[str]:
    """The CUDA devices that two or more stages run on (`cuda` counted as `cuda:0`)."""
    devices = Counter(s.device if ":" in s.device else s.device + ":0"
                      for s in cluster.stages if s.device.startswith("cuda"))
    return sorted(d for d, n in devices.items() if n > 1)


@dataclass
class MpsDaemon:
    """A running control daemon; `env` is what its client processes need."""

    pipe_dir: Path
    log_dir: Path

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def stop(self) -> None:
        try:
            subprocess.run([MPS_CONTROL], input="quit\n", text=True, env={**os.environ, **self.env},
                           capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            pass


def start_mps(cluster: ClusterConfig, run_dir: Path) -> MpsDaemon | None:
    """With `cuda_mps` on and a GPU shared by stages: a control daemon private to this run, or None (off, nothing
    shared, or it could not start: a one-line note says why)."""
    shared = shared_gpus(cluster)
    if not cluster.cuda_mps or not shared:
        return None
    daemon = MpsDaemon(run_dir / "mps-pipe", run_dir / "mps-log")
    daemon.pipe_dir.mkdir(exist_ok=True)
    daemon.log_dir.mkdir(exist_ok=True)
    try:
        r = subprocess.run([MPS_CONTROL, "-d"], env={**os.environ, **daemon.env}, capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"moepipe: cuda_mps: cannot start {MPS_CONTROL} ({exc}); stages sharing {', '.join(shared)} run "
              f"time-sliced", file=sys.stderr)
        return None
    if r.returncode != 0:
        print(f"moepipe: cuda_mps: {MPS_CONTROL} -d exited with {r.returncode} ({(r.stderr or r.stdout).strip()}); "
              f"stages sharing {', '.join(shared)} run time-sliced", file=sys.stderr)
        return None
    print(f"moepipe: cuda_mps: stages sharing {', '.join(shared)} run under a private MPS daemon", file=sys.stderr)
    return daemon
