"""Review of session 33's changes (late components, the PLE service's stop while loading, route_key32, model_len):
the problems found, each as a test that failed before its fix. CPU only, the engine core over a stub executor."""

from __future__ import annotations

from shared.engine_core import EngineCore, GenerationRequest, SchedulerLimits
from shared.sampling import SamplingParams


class _Executor:
    """What the engine core's watchdog and stall report ask of an executor: `late` components are past their
    heartbeat deadline with their process running, `gone` ones without."""

    def __init__(self) -> None:
        self.late: list[str] = []
        self.gone: list[str] = []
        self.back: list[str] = []
        self.asked = 0
        self.sent: list = []

    def health(self) -> list[str]:
        return self.late + self.gone

    def lost(self) -> list[str]:
        return self.late + self.gone

    def down(self) -> list[str]:
        return list(self.gone)

    def restarted(self) -> list[str]:
        out, self.back = self.back, []
        return out

    def send(self, plan) -> None:
        self.sent.append(plan)

    def dump_stacks(self) -> list[str]:
        self.asked += 1
        return []

    def stop(self) -> None: ...


def _core(ex: _Executor, **limits) -> EngineCore:
    return EngineCore(ex, SchedulerLimits(**{"num_blocks": 8, "block_size": 16, "max_num_seqs": 2,
                                             "max_num_batched_tokens": 64, "num_microbatches": 1,
                                             "max_model_len": 128, **limits}))


def _running(core: EngineCore, rid: str = "r", events: list | None = None):
    """A request admitted and its first step sent (as the core's loop would)."""
    core.add(GenerationRequest(rid, [3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0)),
             (events if events is not None else []).append)
    plans = core._plans()
    for plan in plans:
        core._send(plan)
    return plans


def test_a_late_component_back_is_no_stall_report_of_the_steps_that_waited_for_it():
    """A step in flight while a component is late waits for it (no recompute since this session): the stall report
    (a step in flight `stall_report_timeout` "though every component heartbeats", then SIGUSR2 to every component
    for its stacks) counted the late period, so the pass after the component heartbeated again reported the step
    that had only waited for it, and asked everyone for their stacks. Before, the step was requeued (its clock gone).
    Its clock now restarts when the component is back."""
    ex = _Executor()
    limit = 0.2
    core = _core(ex, stall_report=limit)
    steps = {p.step for p in _running(core)}
    ex.late = ["stage1"]
    assert core._watchdog() == []               # late: the step waits, nothing requeued
    core._report_stall()                        # (nothing while a component is lost: the watchdog's)
    for s in steps:                             # the stop lasted longer than the report's limit (a prefill's too)
        core._sent_at[s] -= limit * 10
    ex.late = []                                # heartbeats again: its step comes back soon
    assert core._watchdog() == []
    core._report_stall()
    assert ex.asked == 0 and not core._reported, "a step that waited for a late component was reported as stalled"
    # the report still comes once the step is in flight that long with every component heartbeating
    for s in steps:
        core._sent_at[s] -= limit * 10
    core._report_stall()
    assert ex.asked == 1 and core._reported == steps
    core.stop()
