"""`ple_launch_ahead_across_stages` when the engine core drops steps (`Scheduler.drop_from`), on the CPU: stage 0 of
two as in tests/test_ple_launch_ahead_orderings.py (a real StageRunner, the mailbox with ids, graphs faked; a faked
device runs a launched step only once the mailbox's flag reaches its number), the engine's real Scheduler with
plan-ahead, and a faked last stage.

The suspicion checked: stage 0 launches a decode step's graph before its input ids exist, and the graph waits on
the device (a stream wait, no timeout there) until the host publishes them (`_publish_rows`) from the last stage's
`Sampled`. If the core drops steps after a failure, a dropped graph might wait for a token of a dropped step the
last stage never ran (no `Sampled` ever comes) while the request is still alive (replanned): the host would publish
zeros only after PUBLISH_DEADLINE_S (60 s), and every step queued behind the graph on the device (the replan's
first) would wait too, a 60 s stall after any failed step.

Here PUBLISH_DEADLINE_S is made infinite, so a wait the deadline would end shows as a hang; and after every message
and turn of stage 0 each waiting graph's missing tokens are checked: a token whose request stage 0 still holds must
have a step before the graph's that draws it and can still deliver it (not dropped as far as stage 0 knows, and
not already run by the last stage with its Sampled gone by; or a Sampled for it on its way).

What was found: it does not happen. Plan-ahead is one step deep (PLANS_IN_FLIGHT), so a dropped graph that waits for
a token of a dropped step waits for the failed step's own draw, whose requests the core fails with it
(`drop_from`: none older is in flight, so none is left draining) and names in the drop plan's `finished`; stage 0
then holds no table for them and `_publish_rows` writes 0 for their rows at its next turn. A request replanned alive
was only in the later dropped step, and its token there came from a step that was kept.
"""

from __future__ import annotations

import random

import pytest

import stage_worker.runner as runner_mod
from shared.protocol import Plan, Sampled, StepResult, TokenOut
from shared.scheduler import Scheduler
from tests.test_ple_launch_ahead_orderings import _Pipeline, _stage0
from tests.test_qa_dropped_step_two_stages import _AnyToken


class _Drops(_Pipeline):
    """`_Pipeline` with: several micro-batches, grammar requests, a last stage that reads its inbox one message at
    a time (it may run a step before it reads the plan that dropped it), stage 0 failing steps itself (at launch,
    or at finish after its graph handed the activations on), chosen failures of the last stage, and the waiting
    graphs checked after every move (`check_waits`)."""

    def __init__(self, runner, rng, prompts, max_tokens, late, fail_rate, *, microbatches=1, grammar=(),
                 fail_if=None, fail0_rate=0.0, launch_fail_rate=0.0) -> None:
        super().__init__(runner, rng, prompts, max_tokens, late, fail_rate)
        c = runner.cluster
        self.sched = Scheduler(num_blocks=c.num_blocks, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                               max_num_batched_tokens=c.max_num_batched_tokens, num_microbatches=microbatches,
                               max_model_len=4096, plan_ahead=True)
        for _, req in self.to_add:
            if int(req.req_id[1:]) in grammar:
                req.grammar = _AnyToken()
        self.fail_if, self.fail0_rate, self.launch_fail_rate = fail_if, fail0_rate, launch_fail_rate
        self.drawers: dict[tuple[str, int], set[int]] = {}    # (request, position) -> the steps that sample it
        self.dropped0: set[int] = set()                       # drops stage 0 has read
        self.ran1: set[int] = set()                           # steps the last stage ran (not failed)
        self.known1: list[Plan] = []                          # plans the last stage has read, not yet run
        self.seq_step: dict[int, int] = {}                    # mailbox number -> stage 0's step
        self.dropped_waits = 0     # drops that reached a graph waiting for a token of a step dropped with it
        real_launch = runner.launch        # (the base class's wrapper, which notes `waits`)

        def launch(plan):
            if self.rng.random() < self.launch_fail_rate:
                raise RuntimeError(f"stage 0 fails step {plan.step} at launch (injected)")
            real_launch(plan)
            # The mailbox number its graph waits for is `rows_seq`. `ple_wait` (that number and the readback of the
            # mailbox's `timed_out`) is set only where a captured graph replays, on a GPU: here the forward is eager,
            # so it is set as a GPU launch would, or `_on_plan` never marks a dropped step's waiting rows dropped,
            # `finish` never checks forced rows, and `_Pipeline`'s fake device never holds a step back.
            launched = runner.launched[-1]
            seq = launched.rows_seq
            if seq is not None and launched.ple_wait is None:
                launched.ple_wait = (seq, runner.ple_mailbox.timed_out.clone())
            self.waits[plan.step] = seq
            if seq is not None:
                self.seq_step[seq] = plan.step
        runner.launch = launch

    # ---- the engine core -------------------------------------------------------------------------------------
    def _send(self, plan: Plan) -> None:
        for e in plan.entries:
            if e.sample:
                self.drawers.setdefault((e.req_id, e.context_len + e.num_tokens), set()).add(plan.step)
        super()._send(plan)

    # ---- the last stage: its inbox read one message at a time ------------------------------------------------
    def stage1_read(self) -> None:
        plan = self.plans1.popleft()
        self.dropped1.update(plan.dropped)
        self.known1 = [p for p in self.known1 if p.step not in self.dropped1]
        if plan.entries and plan.step not in self.dropped1:
            self.known1.append(plan)

    def stage1_can(self) -> bool:
        return bool(self.known1) and self.known1[0].step in self.done0

    def stage1(self) -> None:
        plan = self.known1.pop(0)
        if (self.fail_if is not None and self.fail_if(plan)) or self.rng.random() < self.fail_rate:
            self.log.append(f"stage 1 fails step {plan.step}")
            self.results.append(("error", plan.step))     # (its drop is on its way: `check_waits` lets it be)
            return
        self.ran1.add(plan.step)
        outs = [TokenOut(e.req_id, e.context_len + e.num_tokens, self.rng.randrange(1, 500))
                for e in plan.entries if e.sample]
        self.log.append(f"stage 1 ran step {plan.step}: {[(t.req_id, t.position) for t in outs]}")
        self.sampled0.append(Sampled(step=plan.step, microbatch=plan.microbatch, tokens=outs))
        self.results.append(StepResult(step=plan.step, microbatch=plan.microbatch, tokens=outs, timing=[]))

    # ---- stage 0 ---------------------------------------------------------------------------------------------
    def deliver(self, queue) -> None:
        msg = queue[0]
        if isinstance(msg, Plan) and msg.dropped:
            self._note_dropped_waits(set(msg.dropped))
            self.dropped0.update(msg.dropped)
        super().deliver(queue)
        self.check_waits()

    def _note_dropped_waits(self, dropped: set[int]) -> None:
        """Count the drops that reach a graph waiting for a token only a step dropped with it draws (the shape the
        suspicion is about), so the test shows it was met."""
        r = self.runner
        for p in r._pending_rows:
            step = self.seq_step.get(p.seq)
            if step is None or step not in dropped:
                continue
            for k in p.tokens:
                if isinstance(k, tuple) and k not in r._host_tokens:
                    before = {s for s in self.drawers.get(k, ()) if s < step}
                    if before and before <= dropped:
                        self.dropped_waits += 1
                        return

    def check_waits(self) -> None:
        r = self.runner
        queued = {(t.req_id, t.position) for s in self.sampled0 for t in s.tokens}
        for p in r._pending_rows:
            step = self.seq_step.get(p.seq)
            assert step is not None, f"mailbox number {p.seq} waits, but no launched step was given it"  # (harness)
            for k in p.tokens:
                if not isinstance(k, tuple) or k in r._host_tokens or k[0] not in r.tables:
                    continue          # (a request stage 0 no longer holds is published as 0)
                if k in queued:
                    continue
                live = [s for s in self.drawers.get(k, ()) if s < step and s not in self.dropped0
                        and s not in self.ran1]
                assert live, (f"stage 0's step {step} (dropped: {p.dropped}) waits on the device for {k}, which "
                              f"no step before it can still deliver (drawn by {sorted(self.drawers.get(k, ()))}, "
                              f"dropped as stage 0 knows: {sorted(self.dropped0)}, run by the last stage: "
                              f"{sorted(self.ran1)}): its graph and every step behind it would wait "
                              f"PUBLISH_DEADLINE_S\n" + "\n".join(self.log[-40:]))

    def _finished0(self, step: int) -> None:
        if self.rng.random() < self.fail0_rate:       # a failure after the activations went on (CUDA IPC)
            self._failed(step, RuntimeError("injected"))
        self.check_waits()

    def moves(self) -> list:
        m = super().moves()
        if self.plans1:
            m.append(self.stage1_read)
        return m

    def run(self, limit: int = 20000) -> None:
        real = self.runner.launch_ready

        def launch_ready(failed, limit=None):
            n = real(failed, limit)
            self.check_waits()
            return n
        self.runner.launch_ready = launch_ready
        super().run(limit)


@pytest.fixture
def no_deadline(monkeypatch):
    """No PUBLISH_DEADLINE_S: a graph left waiting for a token that never comes hangs the run instead of being
    published with zeros after 60 s (which would hide the stall)."""
    monkeypatch.setattr(runner_mod, "PUBLISH_DEADLINE_S", float("inf"))


def _random_drops(tiny_checkpoint, tmp_path, seed: int, fail_rate: float, **kw):
    """Stage 0 and a `_Drops` of four requests (prompts 11, 11, 6 and 18 tokens) drawn from `seed`: random lengths,
    the last two arriving late, about a third of them grammar requests; `kw` goes to `_Drops`."""
    runner = _stage0(tiny_checkpoint, tmp_path)
    rng = random.Random(seed)
    prompts = [11, 11, 6, 18]
    max_tokens = [rng.randint(2, 10) for _ in prompts]
    late = [0, 0, rng.randint(0, 6), rng.randint(0, 8)]
    grammar = {i for i in range(4) if rng.random() < 0.35}
    return runner, _Drops(runner, rng, prompts, max_tokens, late, fail_rate, grammar=grammar, **kw)


def _end_checks(runner, pipe, seed) -> None:
    where = "\n".join(pipe.log[-40:])
    assert not runner._pending_rows, (f"seed {seed}: launched steps wait for tokens that never come: "
                                      f"{[(p.seq, p.tokens, p.dropped) for p in runner._pending_rows]}\n{where}")
    assert not runner._forced_rows, f"seed {seed}\n{where}"
    assert not runner.launched and not pipe.sched.running and not pipe.sched.waiting, f"seed {seed}\n{where}"


def test_a_dropped_graph_waiting_for_the_failed_steps_token_does_not_wait(tiny_checkpoint, tmp_path, no_deadline):
    """The suspicion's shape, directed: r0 (planned ahead) and r1 (a grammar request, never planned ahead) decode;
    the last stage fails a step of r0's, so the core drops it and the step after it, which stage 0 has launched and
    whose graph waits for r0's token from the failed step (never run by the last stage: no Sampled comes). r1 was
    only in the dropped later step: it is replanned, alive, and its replan is queued behind that graph. The drop
    must let the graph go at once (r0 failed with the step, so its row is published as 0), the replan must run, and
    r1 must end as asked, with no second failure for the dropped step."""
    hits = 0
    for seed in range(40):
        runner = _stage0(tiny_checkpoint, tmp_path)
        rng = random.Random(seed)
        nth, alone = rng.randint(1, 3), []

        def fail_if(plan):          # the nth step of r0 alone (the step after it, planned ahead, has r1 too)
            if [e.req_id for e in plan.entries] == ["r0"]:
                alone.append(plan.step)
            return len(alone) == nth and alone[-1] == plan.step
        pipe = _Drops(runner, rng, [11, 9], [8, 8], [0, 0], 0.0, grammar=(1,), fail_if=fail_if)
        pipe.run()
        _end_checks(runner, pipe, seed)
        where = "\n".join(pipe.log[-60:])
        hits += pipe.dropped_waits
        assert len(alone) >= nth, f"seed {seed}: no step of r0 alone failed\n{where}"
        assert not pipe.failed_steps, f"seed {seed}: stage 0 reported {pipe.failed_steps} as failed\n{where}"
        assert pipe.finished == {"r0": "error", "r1": "length"}, f"seed {seed}: {pipe.finished}\n{where}"
    assert hits, "no run dropped a graph waiting for the failed step's token: the test did not meet its shape"


@pytest.mark.parametrize("microbatches", [1, 2])
def test_no_graph_waits_for_a_dropped_steps_token_under_random_failures(tiny_checkpoint, tmp_path, no_deadline,
                                                                          microbatches):
    """Random orderings with failures on either stage (the last stage's chosen at random; stage 0's at launch or
    after its graph ran, as a CUDA IPC hand-off lets the last stage run a step stage 0 then fails), the last stage
    reading its drops late, grammar requests among plain ones, one or two micro-batches."""
    hits = 0
    for seed in range(50):
        runner, pipe = _random_drops(tiny_checkpoint, tmp_path, 1000 + seed, 0.1, microbatches=microbatches,
                                     fail0_rate=0.05, launch_fail_rate=0.03)
        pipe.run()
        _end_checks(runner, pipe, seed)
        hits += pipe.dropped_waits
        assert set(pipe.finished) == {f"r{i}" for i in range(4)}, f"seed {seed}: {pipe.finished}"
    assert hits, "no run dropped a graph waiting for a dropped step's token: the test did not meet its shape"
