"""Per-stage step profiles from a running cluster: `MOEPIPE_PROFILE=DIR` in the environment of `moepipe serve`.

Why: a served stage can be far slower than the same layers in one process (bench/decode.py), and the difference
lies in what only the server does (inputs from sockets and the PLE ring, sampling, several processes on one GPU).
torch.profiler over a window of real served steps shows where each step's time goes, per stage, with no change to
the served tokens. Off unless the variable is set; `MOEPIPE_PROFILE_STEPS=SKIP:COUNT` picks the window (default
10:20: skip the first 10 steps, then profile 20).

Each stage writes `DIR/<stage name>.txt`: the ops by self CPU time and by device time, plus the named phases of
`StageRunner.run` (stage.inputs, stage.forward, stage.graph_replay, stage.sync, stage.sample).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.autograd import profiler as _autograd_profiler

log = logging.getLogger(__name__)
T = TypeVar("T")
_NO_PHASE = contextlib.nullcontext()


def phase(name: str):
    """A named range for the profile's tables (`record_function`) while a profiler runs, else nothing: an idle
    `record_function` still costs ~15 us to enter and leave (torch 2.13, the dev VM), and a served step passes
    five to nine of them on its critical path."""
    if _autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_PHASE


class StepProfiler:
    def __init__(self, out_dir: str | Path, name: str, device: torch.device, skip: int = 10, steps: int = 20) -> None:
        if skip < 0 or steps < 1:
            raise ValueError(f"MOEPIPE_PROFILE_STEPS: expected SKIP:COUNT with SKIP >= 0 and COUNT >= 1, got "
                             f"{skip}:{steps}")
        self.out = Path(out_dir) / f"{name}.txt"
        self.name, self.device = name, device
        self.skip, self.steps = skip, steps
        self.seen = 0
        self._prof = None

    @classmethod
    def from_env(cls, name: str, device: torch.device) -> "StepProfiler | None":
        out = os.environ.get("MOEPIPE_PROFILE", "")
        if not out:
            return None
        window = os.environ.get("MOEPIPE_PROFILE_STEPS", "10:20")
        try:
            skip, steps = (int(x) for x in window.split(":"))
        except ValueError:
            raise ValueError(f"MOEPIPE_PROFILE_STEPS={window!r}: expected SKIP:COUNT, e.g. 10:20") from None
        Path(out).mkdir(parents=True, exist_ok=True)
        return cls(out, name, device, skip, steps)

    @property
    def done(self) -> bool:
        return self.seen >= self.skip + self.steps

    def __call__(self, fn: Callable[..., T], *args) -> T:
        """Run one step, profiled when it falls inside the window."""
        if self.done:
            return fn(*args)
        if self.seen == self.skip:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts, record_shapes=False)
            self._prof.start()
        try:
            return fn(*args)
        finally:
            self.seen += 1
            if self.done and self._prof is not None:
                self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        avg = prof.key_averages()
        device_key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        text = [f"{self.name}: {self.steps} steps after the first {self.skip}\n",
                "== by self CPU time ==", avg.table(sort_by="self_cpu_time_total", row_limit=40), ""]
        if self.device.type == "cuda":
            text += ["== by self device time ==", avg.table(sort_by=device_key, row_limit=30), ""]
        self.out.write_text("\n".join(text))
        log.warning("%s: wrote a profile of %d steps to %s", self.name, self.steps, self.out)
