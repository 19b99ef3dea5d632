"""Device counters read back to the host without waiting on the device (for heartbeats and /metrics).

Why: a stage's counters (the K/V row cache's hits and lookups, issue 18) are bumped by kernels inside the decode
graph; reading them with `.tolist()` would wait for every queued step. `snapshot()`, called from the runner's thread
between steps, queues a copy into pinned memory behind an event and keeps the previous copy's values once it has
landed, as `ExpertOffload.snapshot` does for the expert counters.
"""

from __future__ import annotations

import torch


class CounterReadback:
    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts
        self.last: list[int] | None = None       # the values as last read back
        self._copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def snapshot(self) -> None:
        if self.counts.device.type != "cuda":
            self.last = self.counts.tolist()
            return
        if self._copy is None:
            self._copy = (torch.empty(self.counts.shape, dtype=self.counts.dtype, pin_memory=True), None)
        buf, event = self._copy
        if event is not None:
            if not event.query():
                return                               # the previous copy is still on its way
            self.last = buf.tolist()
        buf.copy_(self.counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copy = (buf, event)
