"""`ple_launch_ahead_across_stages` on the CPU, over random message orderings: stage 0 of two (a real StageRunner
over the tiny checkpoint, with what a CUDA stage has faked as in tests/test_ple_decode_rows.py: the mailbox with
ids, decode steps that replay a graph), the engine's real Scheduler with plan-ahead and one micro-batch, and a fake
last stage that runs each step once stage 0's graph for it has its ids and rows, then sends Sampled to stage 0 and
the result to the engine. Plans, Sampled messages and stage 0's turns (`ready`, `launch_ready`, `finish`)
interleave at random, requests start late and end at max_tokens (the h200-27 shape: prompts 11, 11, 6 and 18, the
last started a few steps later), and the last stage may fail a step (the engine drops it and the steps behind it).
A launched step whose graph would wait for a token that never comes is a hang: on the GPU it failed after
PUBLISH_DEADLINE_S (bench/results/h200-27/callA/serve_fs_2stages_pla2.log)."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from shared.model_config import load_config
from shared.protocol import Plan, PleReady, Sampled, StepResult, TokenOut
from shared.sampling import SamplingParams
from shared.scheduler import Request, Scheduler
from stage_worker.ple_decode_rows import PleMailbox
from stage_worker.runner import StageRunner
from tests.test_ple_decode_rows import _two_stages


class _Ring:
    """The PLE service's ring, for prefill chunks: rows of zeros (the forward is faked)."""

    def slot(self, i: int) -> torch.Tensor:
        return torch.zeros(64, 1)


def _stage0(model, tmp) -> StageRunner:
    from stage_worker.stage_loader import load_stage

    cluster = _two_stages(model, tmp, ple_launch_ahead_across_stages=True, max_num_batched_tokens=32)
    runner = StageRunner(load_stage(cluster, 0, load_config(model)), cluster, 0, _Ring())
    assert runner.own_decode_rows is not None and not runner.is_last
    runner.ple_mailbox = PleMailbox.create(runner.own_decode_rows, cluster.max_num_seqs, torch.float32,
                                           torch.device("cpu"), with_ids=True)
    runner._rows_in_graph = lambda prepared: prepared.batch.is_decode
    runner._copy_contexts = lambda: None              # (a CUDA event)
    runner.model = lambda batch, cache, hidden: torch.zeros(batch.token_ids.numel(), 4)
    return runner


class _Pipeline:
    """Everything around stage 0, driven one random move at a time."""

    def __init__(self, runner: StageRunner, rng: random.Random, prompts: list[int], max_tokens: list[int],
                 late: list[int], fail_rate: float) -> None:
        self.runner, self.rng, self.fail_rate = runner, rng, fail_rate
        c = runner.cluster
        self.sched = Scheduler(num_blocks=c.num_blocks, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                               max_num_batched_tokens=c.max_num_batched_tokens, num_microbatches=1,
                               max_model_len=4096, plan_ahead=True)
        self.to_add = sorted(((late[i], Request(f"r{i}", [3 + (7 * i + j) % 90 for j in range(n)],
                                                SamplingParams(max_tokens=max_tokens[i]), set(), max_tokens[i]))
                              for i, n in enumerate(prompts)), key=lambda x: x[0])
        self.turns = 0
        self.plans0: deque = deque()      # engine -> stage 0
        self.sampled0: deque = deque()    # last stage -> stage 0
        self.plans1: deque = deque()      # engine -> last stage
        self.results: deque = deque()     # last stage -> engine (StepResult, or ("error", step))
        self.dropped1: set[int] = set()
        self.waits: dict[int, int | None] = {}    # stage 0's launched steps: the mailbox number its graph waits for
        self.done0: set[int] = set()              # ... whose graph has run (its ids and rows were published)
        self.finished: dict[str, str] = {}
        self.failed_steps: list[int] = []
        self.log: list[str] = []
        real_launch = runner.launch

        def launch(plan):
            real_launch(plan)
            launched = runner.launched[-1]
            # (`rows_seq`: the CPU path never sets `ple_wait`, which a graph's launch does, so keyed on it the fake
            # device held no step back; helper-114)
            self.waits[plan.step] = launched.rows_seq
        runner.launch = launch

    # ---- the engine core -------------------------------------------------------------------------------------
    def _send(self, plan: Plan) -> None:
        entries = [(e.req_id, e.context_len, e.tokens is None) for e in plan.entries]
        self.log.append(f"plan {plan.step} entries={entries} finished={plan.finished} dropped={plan.dropped}")
        self.plans0.append(plan)
        self.plans1.append(plan)

    def _schedule(self) -> None:
        while True:
            new = [p for mb in self.sched.idle_microbatches() if (p := self.sched.schedule(mb))]
            for p in new:
                self._send(p)
            if not any(p.entries for p in new):
                return

    def engine(self) -> bool:
        self.turns += 1
        while self.to_add and self.to_add[0][0] <= self.turns:
            self.sched.add(self.to_add.pop(0)[1])
        if self.results:
            msg = self.results.popleft()
            if isinstance(msg, tuple):                      # a stage failed a step
                steps, failed = self.sched.drop_from(msg[1])
                for r in failed:
                    self.finished[r.req_id] = "error"
                if steps:
                    self._send(Plan(step=-1, microbatch=0, entries=[], dropped=steps,
                                    finished=self.sched.take_finished()))
            else:
                oldest = self.sched.oldest_in_flight(msg.microbatch)
                if oldest is not None and oldest.step == msg.step:
                    for req in self.sched.on_result(msg.microbatch, msg.tokens):
                        if req.finished is not None:
                            self.finished.setdefault(req.req_id, req.finished)
        self._schedule()
        return True

    # ---- the last stage --------------------------------------------------------------------------------------
    def stage1_can(self) -> bool:
        for plan in self.plans1:            # (the stage reads its inbox while it waits for a step's activations)
            self.dropped1.update(plan.dropped)
        while self.plans1 and (not self.plans1[0].entries or self.plans1[0].step in self.dropped1):
            self.plans1.popleft()
        return bool(self.plans1) and self.plans1[0].step in self.done0

    def stage1(self) -> None:
        plan = self.plans1.popleft()
        if self.rng.random() < self.fail_rate:
            self.log.append(f"stage 1 fails step {plan.step}")
            self.results.append(("error", plan.step))
            return
        outs = [TokenOut(e.req_id, e.context_len + e.num_tokens, self.rng.randrange(1, 500))
                for e in plan.entries if e.sample]
        self.log.append(f"stage 1 ran step {plan.step}: {[(t.req_id, t.position) for t in outs]}")
        self.sampled0.append(Sampled(step=plan.step, microbatch=0, tokens=outs))
        self.results.append(StepResult(step=plan.step, microbatch=0, tokens=outs, timing=[]))

    # ---- stage 0 ---------------------------------------------------------------------------------------------
    def _failed(self, step: int, exc: Exception) -> None:
        self.log.append(f"stage 0 failed step {step}: {exc}")
        self.failed_steps.append(step)
        self.results.append(("error", step))

    def deliver(self, queue: deque) -> None:
        msg = queue.popleft()
        self.log.append(f"stage 0 gets {type(msg).__name__} {msg.step}")
        self.runner.on_message(msg)
        if isinstance(msg, Plan) and msg.entries and any(e.tokens is not None for e in msg.entries):
            n = sum(e.num_tokens for e in msg.entries)
            if not all(e.num_tokens == 1 for e in msg.entries):
                self.runner.on_message(PleReady(step=msg.step, ring_slot=0, num_tokens=n))

    def graphs_run(self) -> None:
        """Stage 0's graphs whose mailbox number the host has written run (in order, as one stream)."""
        flag = int(self.runner.ple_mailbox.flag[0])
        for step, seq in sorted(self.waits.items()):
            if step in self.done0:
                continue
            if seq is not None and flag < seq:
                break
            self.done0.add(step)

    def finish0(self) -> bool:
        r = self.runner
        if not r.launched or r.launched[0].plan.step not in self.done0:
            return False
        step = r.launched[0].plan.step
        try:
            r.finish()
        except Exception as exc:
            self._failed(step, exc)
            return True
        self._finished0(step)
        return True

    def _finished0(self, step: int) -> None:
        """After stage 0's `finish` of `step` returned (a hook: nothing here)."""

    # ---- the run ---------------------------------------------------------------------------------------------
    def moves(self) -> list:
        m = []
        if self.plans0:
            m.append(lambda: self.deliver(self.plans0))
        if self.sampled0:
            m.append(lambda: self.deliver(self.sampled0))
        if self.stage1_can():
            m.append(self.stage1)
        if self.results or self.to_add:
            m.append(self.engine)
        r = self.runner
        if r.launched and r.launched[0].plan.step in self.done0:
            m.append(self.finish0)
        return m

    def run(self, limit: int = 20000) -> None:
        r = self.runner
        for _ in range(limit):
            self.graphs_run()
            moves = self.moves()
            # stage 0's own turns: always possible; they only count as progress if they launch or publish
            turn = self.rng.random()
            if turn < 0.3 or not moves:
                before = (len(r.launched), int(r.ple_mailbox.flag[0]))
                if turn < 0.1:
                    r.ready()             # the worker loop asks it after `finish` (it may take the step's tokens)
                r.launch_ready(self._failed)
                self.graphs_run()
                if (len(r.launched), int(r.ple_mailbox.flag[0])) != before:
                    continue
                moves = self.moves()
                if not moves:
                    return
                continue
            self.rng.choice(moves)()
        raise AssertionError("the run did not end")


def _scenario(seed: int, fail_rate: float):
    rng = random.Random(seed)
    prompts = [11, 11, 6, 18]
    max_tokens = [rng.randint(2, 10) for _ in prompts]
    if rng.random() < 0.5:
        max_tokens[:3] = [max_tokens[0]] * 3          # three end together, as in the h200-27 run
    late = [0, 0, 0, rng.randint(0, 8)]
    return rng, prompts, max_tokens, late, fail_rate


@pytest.mark.parametrize("fail_rate", [0.0, 0.08])
def test_no_launched_step_waits_for_a_token_that_never_comes(tiny_checkpoint, tmp_path, fail_rate):
    for seed in range(60):
        runner = _stage0(tiny_checkpoint, tmp_path)     # a fresh stage per run
        rng, prompts, max_tokens, late, rate = _scenario(seed, fail_rate)
        pipe = _Pipeline(runner, rng, prompts, max_tokens, late, rate)
        pipe.run()
        stuck = [p for p in runner._pending_rows]
        where = "\n".join(pipe.log[-40:])
        assert not stuck, (f"seed {seed}: launched steps wait for tokens that never come: "
                           f"{[(p.seq, p.tokens) for p in stuck]}\n{where}")
        assert not runner._forced_rows, f"seed {seed}\n{where}"
        if not fail_rate:
            assert not pipe.failed_steps, f"seed {seed}\n{where}"
            assert pipe.finished == {f"r{i}": "length" for i in range(4)}, f"seed {seed}: {pipe.finished}\n{where}"
        assert not runner.launched and not pipe.sched.running and not pipe.sched.waiting, f"seed {seed}\n{where}"
