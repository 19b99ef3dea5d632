"""The executor that runs every stage in this process: the same `StageRunner`s the stage worker processes run, with
the messages between them handed over as objects instead of ZeroMQ frames.

Tests, `moepipe generate` and the benchmarks use it, so they run the real engine core (scheduler, block manager,
finish rule) and the real last-stage sampler. Without a PLE service every stage holding a PLE layer gathers its
rows itself (the fallback path). Steps run on the engine core's thread: `send` queues the ready ones on a GPU
stage (`StageRunner.launch`); `poll` launches a CPU stage's (which compute inside their launch), completes them
(`finish`) and whatever their results unblock.
"""

from __future__ import annotations

import faulthandler
import logging
import select
import time
from pathlib import Path

from shared.cluster_config import ClusterConfig, StageSpec, env_overrides, split_layers, stage_name
from shared.engine_core import EngineCore, SchedulerLimits, wait_readable
from shared.model_config import HybridMoeConfig, load_config
from shared.protocol import Message, Plan, StageError
from stage_worker.model.model import StageModel
from stage_worker.runner import StageRunner
from stage_worker.stage_loader import load_stage

log = logging.getLogger("moepipe.inprocess")


class InProcessExecutor:
    def __init__(self, runners: list[StageRunner]) -> None:
        self.runners = runners
        self._results: list[Message] = []
        self.metrics = None
        self._busy_mark = (time.monotonic(), [0.0] * len(runners))

    @classmethod
    def load(cls, cluster: ClusterConfig, cfg: HybridMoeConfig | None = None,
             models: list[StageModel] | None = None) -> InProcessExecutor:
        """Load (or take) every stage's slice and build its runner; `cluster` must be `for_model`-resolved."""
        cfg = cfg or load_config(cluster.model)
        models = models or [load_stage(cluster, i, cfg) for i in range(cluster.num_stages)]
        return cls([StageRunner(m, cluster, i) for i, m in enumerate(models)])

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def send(self, plan: Plan) -> None:
        """Hand the plan to every stage and queue what is ready on a GPU stage; `poll` completes it. So with
        plan-ahead a second plan is queued behind the first before its tokens reach the host, as in a stage worker
        process. A CPU stage computes a step inside its launch, so it launches in `poll` only, where the core's new
        work is looked for between steps: launched here, a plan-ahead prefill chunk was computed as soon as it was
        planned, and one stage never skipped a chunk of a cancelled prompt (a short request waited 1.1-1.4 s after
        a cancelled 8000-token prompt, of 2.1 s left; 0.55 s now)."""
        for runner in self.runners:
            runner.on_message(plan)
        self._launch_ready(queue_only=True)

    def _launch_ready(self, queue_only: bool = False) -> bool:
        """Launch what is ready: every step on a GPU stage (queued), one on a CPU stage (computed now), none there
        if `queue_only`. Whether anything was launched."""
        # as a stage worker does: a failed step is reported, not fatal
        return sum(runner.launch_ready(lambda step, exc, i=i: self._failed(i, step, exc),
                                       limit=(0 if queue_only else 1) if runner.computes_in_launch else None)
                   for i, runner in enumerate(self.runners)) > 0

    def _drain(self, wake_fd: int | None = None) -> None:
        """Launch and complete every ready step and whatever its results unblock, in pipeline order, until none is
        left; or, once something was computed, until `wake_fd` is readable: the core has new work (a cancellation,
        whose steps not yet run are then skipped: `Plan.cancelled`), and the next `poll` goes on from here. Every
        ready step is launched before the oldest is completed (launch-ahead: a one-stage decode step reads the
        previous step's tokens on the device), one CPU step at a time with the look in between."""
        worked = False
        while True:
            while True:
                if worked and wake_fd is not None and _readable(wake_fd):
                    return
                if not self._launch_ready():
                    break
                worked = True
            progressed = False
            for i, runner in enumerate(self.runners):
                if not runner.launched:
                    continue
                step = runner.launched[0].plan.step
                try:
                    outgoing = runner.finish()
                except Exception as exc:
                    self._failed(i, step, exc)
                    continue
                progressed = worked = True
                for o in outgoing:
                    if o.to == "next":
                        self.runners[i + 1].on_message(o.message)
                    elif o.to == "first":
                        self.runners[0].on_message(o.message)
                    elif o.to == "gateway":
                        self._results.append(o.message)
            if not progressed:
                return

    def _failed(self, i: int, step: int, exc: Exception) -> None:
        log.exception("%s: step %d failed", stage_name(i), step, exc_info=exc)
        self._results.append(StageError(component=stage_name(i), step=step, message=f"{type(exc).__name__}: {exc}"))

    def poll(self, timeout: float, wake_fd: int) -> list[Message]:
        self._report_busy()
        self._drain(wake_fd)
        if not self._results:
            wait_readable(wake_fd, timeout)
        out, self._results = self._results, []
        return out

    def health(self) -> list[str]:
        return []

    def down(self) -> list[str]:
        return []

    def lost(self) -> list[str]:
        return []

    def restarted(self) -> list[str]:
        return []

    def dump_stacks(self) -> list[str]:
        faulthandler.dump_traceback(all_threads=True)     # the stages are threads of this process
        return []

    def attach_metrics(self, metrics) -> None:
        self.metrics = metrics

    def _report_busy(self) -> None:
        now = time.monotonic()
        then, busy = self._busy_mark
        if self.metrics is None or now - then < 1.0:
            return
        current = [r.busy_seconds for r in self.runners]
        for i, (b0, b1) in enumerate(zip(busy, current)):
            self.metrics.set_stage_busy(i, (b1 - b0) / (now - then))
        for i, runner in enumerate(self.runners):
            self.metrics.set_stage_stats(i, runner.stats())
        self._busy_mark = (now, current)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def inprocess_cluster(model_dir: str | Path, cfg: HybridMoeConfig | None = None, *, stages: int = 1,
                      device: str = "cpu", ranges: list[tuple[int, int]] | None = None, **keys) -> ClusterConfig:
    """A cluster config for running `stages` stages (or the layer `ranges` given) in this process: no endpoints,
    no PLE service; `keys` are cluster keys (`max_model_len`, `max_num_seqs`, `device_sampling`, ...) over the
    environment's switches."""
    cfg = cfg or load_config(model_dir)
    specs = [StageSpec(start=s, end=e, endpoint="", device=device)
             for s, e in ranges or split_layers(cfg.num_hidden_layers, stages)]
    cluster = ClusterConfig(model=str(model_dir), stages=specs, gateway_endpoint="",
                            **{**env_overrides(), **keys, "ple_service": False})
    return cluster.for_model(cfg)


def local_engine_core(model_dir: str | Path, *, stages: int = 1, device: str = "cpu",
                      models: list[StageModel] | None = None, start: bool = True, **keys) -> EngineCore:
    """The engine core over an in-process executor: what `moepipe serve` runs, in one process."""
    cfg = models[0].cfg if models else load_config(model_dir)
    if models:
        keys["ranges"] = [(m.start, m.end) for m in models]
        device = str(next(models[0].parameters()).device)
    cluster = inprocess_cluster(model_dir, cfg, stages=stages, device=device, **keys)
    core = EngineCore(InProcessExecutor.load(cluster, cfg, models),
                      SchedulerLimits.from_cluster(cluster, cluster.model_len(cfg)))
    if start:
        core.start()
    return core
