"""A dropped step's sampled tokens across two stages (stage 0 first, stage 1 last), on the CPU: two real StageRunners
over the tiny checkpoint split in two (no PLE service: stage 0 reads its input ids from the last stage's `Sampled`),
their forwards faked (stage 1's logits peaked on a new token at every call, so two computations of one position draw
different tokens), and the real `EngineCore` driven by hand; every message is handed over by hand, in the orders
the tests choose (stage 1's `Sampled` to stage 0 travels on its own socket, so it may reach stage 0 after the core's
plans that dropped its step and replanned its requests).

What is checked: every token the gateway sends a request at position p is the token stage 0 fed the model at p
(by a step whose result the core kept), and the run ends.
"""

from __future__ import annotations

from collections import deque

import torch

from shared.engine_core import EngineCore, GenerationRequest, SchedulerLimits
from shared.model_config import load_config
from shared.protocol import Plan, StageError, StepResult
from shared.sampling import SamplingParams
from stage_worker.runner import StageRunner
from tests.test_qa_end_of_stream_stall import _Executor as _OneStageExecutor
from tests.test_qa_end_of_stream_stall import _client_sink
from tests.test_qa_stale_token_after_drop import _PeakedDraws, mismatches


class _Forward(_PeakedDraws):
    """A stage's forward faked (zeros for the activations); the last stage's head peaked on a new token at every
    call. Stage 0's records the ids it is fed, by step and (request, position)."""

    def __init__(self, real, plan_of) -> None:
        self.real, self.plan_of = real, plan_of
        self.vocab = real.cfg.vocab_size
        self.calls = 0
        self.fed: dict[int, dict[tuple[str, int], int]] = {}

    def __call__(self, batch, cache, hidden):
        self._note_fed(self.plan_of(), batch)
        return torch.zeros(batch.token_ids.numel(), 4)

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Executor(_OneStageExecutor):
    """The core's executor for two stages: each plan to both stages (no PLE service), results back in order."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[deque] = [deque(), deque()]   # core -> each stage

    def send(self, plan: Plan) -> None:
        for q in self.plans:
            q.append(plan)


class _AnyToken:
    """A grammar that accepts every token: the request is never planned ahead (`Scheduler._can_run_ahead`), so it
    can decode in the step after a failed one without being in the failed one (it is then replanned, alive)."""

    def mask_bytes(self):
        return None

    def accept(self, token: int) -> bool:
        return True

    def is_finished(self) -> bool:
        return False


class _Two:
    def __init__(self, model_dir, tmp, fail_sample1=()) -> None:
        from stage_worker.stage_loader import load_stage
        from tests.test_ple_decode_rows import _two_stages

        cluster = _two_stages(model_dir, tmp, ple_service=False, max_num_batched_tokens=64, num_blocks=64,
                              microbatches=1)
        cfg = load_config(model_dir)
        self.stages = [StageRunner(load_stage(cluster, i, cfg), cluster, i, None) for i in (0, 1)]
        assert self.stages[0].is_first and not self.stages[0].is_last and self.stages[1].is_last
        self.current: list[Plan | None] = [None, None]
        self.fwd = []
        for i, r in enumerate(self.stages):
            fwd = _Forward(r.model, lambda i=i: self.current[i])
            self.fwd.append(fwd)
            r.model = fwd
            real_launch = r.launch

            def launch(plan, i=i, real_launch=real_launch):
                self.current[i] = plan
                real_launch(plan)
                self.log.append(f"stage {i} launches {plan.step}")
            r.launch = launch
        real_sample = self.stages[1].sampler.sample

        def sample(plan, batch, logits, requests):
            if plan.step in fail_sample1:
                raise RuntimeError(f"step {plan.step}: injected sampler failure")
            return real_sample(plan, batch, logits, requests)
        self.stages[1].sampler.sample = sample
        self.ex = _Executor()
        self.core = EngineCore(self.ex, SchedulerLimits.from_cluster(cluster, 4096))
        self.acts: deque = deque()          # stage 0 -> stage 1
        self.sampled: deque = deque()       # stage 1 -> stage 0
        self.events: dict[str, list[int]] = {}
        self.prompts: dict[str, int] = {}
        self.done: dict[str, str] = {}
        self.kept: set[int] = set()
        self.failed: list[tuple[int, int]] = []
        self.log: list[str] = []

    # ---- the core ----------------------------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_tokens: int, grammar=None, plan: bool = True) -> None:
        self.events[rid] = []
        self.prompts[rid] = len(prompt)
        self.core.add(GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.7),
                                        ignore_eos=True, grammar=grammar), _client_sink(self, rid))
        if plan:
            self.plans()

    def plans(self) -> None:
        for plan in self.core._plans():
            entries = [(e.req_id, e.context_len, e.num_tokens) for e in plan.entries]
            self.log.append(f"core plans {plan.step}: {entries}")
            self.core._send(plan)

    def core_turn(self) -> None:
        msg = self.ex.results.popleft()
        with self.core._lock:
            if isinstance(msg, StepResult):
                oldest = self.core.scheduler.oldest_in_flight(msg.microbatch)
                if oldest is not None and oldest.step == msg.step:
                    self.kept.add(msg.step)
                self.log.append(f"core gets result {msg.step}")
                self.core._on_result(msg)
            else:
                self.log.append(f"core gets error {msg.step}")
                for p in self.core._on_stage_error(msg):
                    self.log.append(f"core drops {p.dropped}")
                    self.core._send(p)
        self.plans()

    def core_all(self) -> None:
        while self.ex.results:
            self.core_turn()

    # ---- the stages --------------------------------------------------------------------------------------------
    def _failed(self, i: int):
        def failed(step, exc):
            self.log.append(f"stage {i} fails {step}: {exc!r}")
            self.failed.append((i, step))
            self.ex.results.append(StageError(component=f"stage{i}", step=step, message=repr(exc)))
        return failed

    def plans_to(self, i: int) -> None:
        while self.ex.plans[i]:
            self.stages[i].on_message(self.ex.plans[i].popleft())

    def acts_to_1(self) -> None:
        while self.acts:
            self.stages[1].on_message(self.acts.popleft())

    def sampled_to_0(self, n: int | None = None) -> None:
        while self.sampled and (n is None or n > 0):
            msg = self.sampled.popleft()
            self.log.append(f"stage 0 gets Sampled {msg.step}")
            self.stages[0].on_message(msg)
            n = None if n is None else n - 1

    def launch(self, i: int) -> None:
        self.stages[i].launch_ready(self._failed(i))

    def finish(self, i: int) -> None:
        r = self.stages[i]
        while r.launched:
            step = r.launched[0].plan.step
            try:
                outgoing = r.finish()
            except Exception as exc:
                self._failed(i)(step, exc)
                continue
            self.log.append(f"stage {i} finishes {step}")
            for o in outgoing:
                if o.to == "next":
                    self.acts.append(o.message)
                elif o.to == "first":
                    self.sampled.append(o.message)
                elif o.to == "gateway":
                    self.ex.results.append(o.message)
            r.queue_samplers()

    def stage(self, i: int) -> None:
        """One worker-loop turn of stage i: its inbox, launch what is ready, finish it."""
        self.plans_to(i)
        if i == 0:
            self.sampled_to_0()
        else:
            self.acts_to_1()
        self.launch(i)
        self.finish(i)

    def to_the_end(self, turns: int = 200) -> None:
        for _ in range(turns):
            before = len(self.log)
            self.stage(0)
            self.stage(1)
            self.core_all()
            if len(self.log) == before:
                return

    def running(self) -> bool:
        s = self.core.scheduler
        return bool(s.running or s.draining or s.waiting)

    def mismatches(self) -> list[str]:
        return mismatches(self.kept, self.fwd[0].fed, self.events, self.prompts)     # (stage 0's feed)

    def explain(self) -> str:
        return "\n".join(self.log[-60:])


def _steps_0_to_3(run: _Two) -> None:
    """a (6 tokens, 3 to generate): its prompt (step 0), its first decode planned ahead (1), its last (2); b (11
    tokens) admitted in step 3 (its prompt alone, which needs nothing from step 2). Stage 0 has finished steps 2
    and 3; stage 1 has both plans and both activations."""
    run.add("a", [3 + j for j in range(6)], 3)
    run.stage(0)                                       # step 0
    run.stage(1)                                       # step 0: Sampled (a, 6) on its way to stage 0
    run.stage(0)                                       # step 1
    run.stage(1)                                       # step 1
    run.core_turn()                                    # step 0's result: step 2 (a's last token)
    run.add("b", [20 + j for j in range(11)], 3)
    run.core_turn()                                    # step 1's result: step 3 (b's prompt)
    run.stage(0)                                       # steps 2 and 3
    assert run.core.scheduler.in_flight_steps() == [2, 3], run.explain()


def test_a_late_sampled_of_a_dropped_step_does_not_feed_the_replan(tiny_checkpoint, tmp_path):
    """Stage 1 fails step 2 (its sampler raised) and runs step 3 (b's prompt, sampling (b, 11)) before the drop
    reaches it: that Sampled is on its way to stage 0. The core fails a, drops step 3 and plans b again: its prompt
    (step 4) and, ahead of that result, its first decode (step 5), which reads (b, 11). Stage 0 launches step 4;
    then step 3's Sampled comes (its own socket), and stage 0 kept its token under (b, 11): step 5 was fed the
    dropped draw, while the client got step 4's (stage 1's Sampled of step 4 came after step 5 had taken the key)."""
    run = _Two(tiny_checkpoint, tmp_path, fail_sample1={2})
    _steps_0_to_3(run)
    run.plans_to(1)
    run.acts_to_1()
    run.launch(1)                                      # steps 2 and 3 on stage 1
    run.finish(1)                                      # step 2 fails; step 3's Sampled held back (its socket)
    assert (1, 2) in run.failed
    late = [m for m in run.sampled if m.step == 3]
    assert late, run.explain()
    run.sampled = deque(m for m in run.sampled if m.step != 3)
    run.sampled_to_0()
    run.core_all()                                     # a fails; steps 2, 3 dropped; b planned again: 4, 5
    run.plans_to(0)
    run.launch(0)                                      # step 4 (b's prompt again)
    run.finish(0)
    run.sampled.extend(late)                           # now step 3's Sampled reaches stage 0
    run.to_the_end()
    assert run.done.get("a", "").startswith("error") and run.done.get("b") == "length", \
        f"{run.done}\n{run.explain()}"
    assert len(run.events["b"]) == 3 and 3 not in run.kept
    assert not run.mismatches(), "\n".join(run.mismatches()) + "\n" + run.explain()
    assert not run.running()
    assert not run.stages[0].next_tokens, run.stages[0].next_tokens


def test_a_dropped_step_s_sampled_before_the_drop_does_not_feed_the_replan(tiny_checkpoint, tmp_path):
    """As above, with step 3's Sampled reaching stage 0 before the core's drop does: the replan's prefill (step 4)
    draws (b, 11) again, and its launch forgets the dropped draw (`_forget_redrawn`)."""
    run = _Two(tiny_checkpoint, tmp_path, fail_sample1={2})
    _steps_0_to_3(run)
    run.stage(1)                                       # step 2 fails, step 3 runs
    run.sampled_to_0()                                 # step 3's Sampled first
    run.core_all()
    run.to_the_end()
    assert run.done.get("a", "").startswith("error") and run.done.get("b") == "length", \
        f"{run.done}\n{run.explain()}"
    assert not run.mismatches(), "\n".join(run.mismatches()) + "\n" + run.explain()
    assert not run.running()


def test_a_token_a_finished_dropped_step_took_is_there_for_the_replan(tiny_checkpoint, tmp_path):
    """c has a grammar, so it is never planned ahead. Step 0: the prompts of a (2 tokens to generate) and c; step 1,
    planned ahead: a's last token (a is then at max_tokens, so not in step 2); step 2, planned on step 0's result: c
    alone, decoding (c, 8), which step 0 (kept) sampled. Stage 0 runs steps 1 and 2 (step 2 takes (c, 8) off
    `next_tokens`) and has finished both when stage 1 fails step 1: the core fails a, drops step 2 and plans c again
    from (c, 8) (step 3). The drop found step 2 neither prepared nor launched on stage 0, so nothing gave (c, 8) back:
    step 3 was never ready, and c waited for good."""
    run = _Two(tiny_checkpoint, tmp_path, fail_sample1={1})
    run.add("a", [3 + j for j in range(6)], 2, plan=False)
    run.add("c", [40 + j for j in range(8)], 3, grammar=_AnyToken())
    assert run.core.scheduler.in_flight_steps() == [0, 1], run.explain()
    run.stage(0)                                       # step 0
    run.stage(1)                                       # step 0: Sampled (a, 6), (c, 8)
    run.stage(0)                                       # step 1 (a's last token)
    run.core_turn()                                    # step 0's result: step 2 (c alone)
    assert run.core.scheduler.in_flight_steps() == [1, 2], run.explain()
    run.stage(0)                                       # step 2, finished: its activations are on their way
    assert not run.stages[0].launched and not run.stages[0].plans
    run.stage(1)                                       # step 1 fails (step 2 runs too: its Sampled is dropped)
    assert (1, 1) in run.failed
    run.to_the_end()
    assert run.done.get("a", "").startswith("error") and run.done.get("c") == "length", \
        f"{run.done}\n{run.explain()}"
    assert len(run.events["c"]) == 3
    assert not run.mismatches(), "\n".join(run.mismatches()) + "\n" + run.explain()
    assert not run.running()
