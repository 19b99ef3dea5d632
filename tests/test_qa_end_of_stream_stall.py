"""The one-stage GPU decode path at the end of requests, on the CPU, over random orderings (h100-32 call 5: a
one-stage server's four streams, one started a step after the other three, stopped at tokens 255, 255, 255 and 253
of 256 for 113 s with nothing logged).

What that server ran: one stage, first and last, with `launch_ahead` (two steps queued), `feed_from_device` (a
decode step's input ids read on the device from the step before's sampled tokens), `ple_launch_ahead` (a decode
step's graph waits on the device, `host_wait`, for the PLE rows the host publishes once the step before's tokens
are on the host: `_expect_rows`, `_rows_from`, `_publish_rows`), device sampling, plan-ahead in the engine core and
the cancellation skip path. Here: the real `EngineCore` (its planning and result handling, `_plans` and
`_on_result`, driven by hand instead of by its thread), a real `StageRunner` over the tiny checkpoint with what only
a CUDA stage has faked as tests/test_ple_launch_ahead_orderings.py does (the mailbox, decode steps that replay a
graph, the launch depth and the device feed a CUDA stage gets; the forward returns random logits), and a fake device
that runs the launched steps in launch order, a graph only once the mailbox's flag has reached its number. The
stage worker's loop (`stage_worker/main.py`: read the inbox, launch what is ready, finish the oldest step once the
device is done with it, send its result, ask `ready`), the engine core's turns, late requests and (optionally)
clients that leave interleave at random. A state where requests are still running but neither the stage nor the
core can move (no message on its way, no launched step the device can complete) is the hang; a launched graph
waiting for a token the host will never publish is one too (on the GPU it would time out and fail its requests).

Found: with one micro-batch (the h100-32 server) no ordering stalls here, with or without clients leaving, so the
host-side bookkeeping alone did not stop that server (the device side: tools/host_wait_probe.py). With `microbatches`
2 on the one stage it did, the first seed: `test_a_step_prepared_with_the_launch_depth_full_gets_its_rows`.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from shared.cluster_config import ClusterConfig
from shared.engine_core import EngineCore, GenerationRequest, SchedulerLimits
from shared.protocol import Plan, PleReady, StepResult
from shared.sampling import SamplingParams
from stage_worker.ple_decode_rows import PleMailbox
from stage_worker.runner import StageRunner
from tests.test_ple_decode_rows import _cluster


class _Ring:
    """The PLE service's ring, for prefill chunks: rows of zeros (the forward is faked)."""

    def slot(self, i: int) -> torch.Tensor:
        return torch.zeros(64, 1)


class _Model:
    """The stage's forward and head, faked: random logits for the rows the head reads."""

    def __init__(self, real, rng: random.Random) -> None:
        self.real, self.rng = real, rng
        self.vocab = real.cfg.vocab_size

    def __call__(self, batch, cache, hidden):
        return torch.zeros(batch.token_ids.numel(), 4)

    def logits(self, hidden, batch):
        g = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
        return torch.randn(batch.logits_indices.numel(), self.vocab, generator=g)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _stage(model_dir, tmp, rng: random.Random, microbatches: int = 0, after_rows: bool = True) -> StageRunner:
    from stage_worker.checkpoint.loader import load_model

    cluster = ClusterConfig(**{**_cluster(model_dir, tmp).__dict__, "max_num_batched_tokens": 64, "num_blocks": 64,
                               "microbatches": microbatches, "ple_sample_after_rows": after_rows})
    runner = StageRunner(load_model(model_dir), cluster, 0, _Ring())
    assert runner.is_first and runner.is_last and runner.own_decode_rows is not None
    # what a CUDA stage with graphs, launch_ahead, ple_launch_ahead and device sampling has
    runner.ple_mailbox = PleMailbox.create(runner.own_decode_rows, cluster.max_num_seqs, torch.float32,
                                           torch.device("cpu"))
    runner._rows_in_graph = lambda prepared: prepared.batch.is_decode
    runner._copy_contexts = lambda: None              # (a CUDA event behind the launched step)
    runner.launch_depth = 2
    runner.feed_from_device = True
    runner.model = _Model(runner.model, rng)
    return runner


class _Executor:
    """The cluster executor's side the core sees: plans go to the stage's inbox, results come back in order."""

    def __init__(self) -> None:
        self.inbox: deque = deque()        # core -> stage (plans), and the PLE service's PleReady for prefills
        self.results: deque = deque()      # stage -> core

    def start(self) -> None:
        pass

    def send(self, plan: Plan) -> None:
        self.inbox.append(plan)
        n = sum(e.num_tokens for e in plan.entries)
        if plan.entries and not all(e.num_tokens == 1 and e.context_len > 0 for e in plan.entries):
            self.inbox.append(PleReady(step=plan.step, ring_slot=0, num_tokens=n))   # the service's rows

    def health(self) -> list[str]:
        return []

    def down(self) -> list[str]:
        return []

    def lost(self) -> list[str]:
        return []

    def restarted(self) -> list[str]:
        return []

    def dump_stacks(self) -> list[str]:
        return []

    def stop(self) -> None:
        pass


def _client_sink(run, rid: str):
    """A client's sink for request `rid`: its tokens to `run.events[rid]`, its finish reason (or error) to
    `run.done[rid]`."""
    def sink(ev):
        if isinstance(ev, Exception):
            run.done[rid] = f"error: {ev}"
            return
        run.events[rid].append(ev.token_id)
        if ev.finish_reason is not None:
            run.done[rid] = ev.finish_reason
    return sink


class _Run:
    def __init__(self, runner: StageRunner, rng: random.Random, prompts: list[int], max_tokens: list[int],
                 late: list[int], cancel_rate: float) -> None:
        self.runner, self.rng, self.cancel_rate = runner, rng, cancel_rate
        c = runner.cluster
        self.ex = _Executor()
        self.core = EngineCore(self.ex, SchedulerLimits.from_cluster(c, 4096))
        self.to_add = sorted(((late[i], GenerationRequest(f"r{i}", [3 + (7 * i + j) % 90 for j in range(n)],
                                                          SamplingParams(max_tokens=max_tokens[i], temperature=0.7,
                                                                         seed=i), ignore_eos=True))
                              for i, n in enumerate(prompts)), key=lambda x: x[0])
        self.events: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
        self.done: dict[str, str] = {}
        self.turns = 0
        self.waits: dict[int, int | None] = {}    # launched step -> the mailbox number its graph waits for
        self.device_done: set[int] = set()        # launched steps the device has completed
        self.failed: list[int] = []
        self.log: list[str] = []
        self.sampled_early: list[tuple[int, int, int]] = []   # (step, rows it waits for, flag) sampled before them
        real_launch, real_expect, real_sample = runner.launch, runner._expect_rows, runner.sampler.sample

        def sample(plan, batch, logits, requests):      # on the GPU: a sampler queued behind a graph still spinning
            seq, flag = self.waits.get(plan.step), int(runner.ple_mailbox.flag[0])
            if seq is not None and flag < seq:
                self.sampled_early.append((plan.step, seq, flag))
            return real_sample(plan, batch, logits, requests)
        runner.sampler.sample = sample

        def expect_rows(plan, prepared):      # (the CPU path computes in `launch`: no `ple_wait` is noted there)
            self.waits[plan.step] = seq = real_expect(plan, prepared)
            return seq

        def launch(plan):
            real_launch(plan)
            launched = runner.launched[-1]
            self.log.append(f"stage launches {plan.step}{' (skipped)' if launched.skipped else ''} "
                            f"waiting for {self.waits.get(plan.step)} (flag {int(runner.ple_mailbox.flag[0])})")
        runner.launch, runner._expect_rows = launch, expect_rows

    def _sink(self, rid: str):
        return _client_sink(self, rid)

    # ---- the engine core ---------------------------------------------------------------------------------------
    def _plans(self) -> None:
        for plan in self.core._plans():
            self.log.append(f"core plans {plan.step}: {[(e.req_id, e.context_len, e.num_tokens) for e in plan.entries]}"
                            f" finished={plan.finished} cancelled={plan.cancelled}")
            self.core._send(plan)

    def core_turn(self) -> None:
        self.turns += 1
        while self.to_add and self.to_add[0][0] <= self.turns:
            req = self.to_add.pop(0)[1]
            self.core.add(req, self._sink(req.request_id))
            self.log.append(f"client sends {req.request_id}")
        if self.ex.results:
            msg = self.ex.results.popleft()
            with self.core._lock:
                if isinstance(msg, StepResult):
                    self.log.append(f"core gets result {msg.step}: {[(t.req_id, t.position) for t in msg.tokens]}")
                    self.core._on_result(msg)
                else:
                    self.log.append(f"core gets error {msg}")
                    for p in self.core._on_stage_error(msg):
                        self.core._send(p)
        self._plans()

    def client_leaves(self) -> None:
        live = [r for r in self.events if r not in self.done and self.events[r]]
        if live:
            rid = self.rng.choice(live)
            self.log.append(f"client of {rid} leaves")
            self.done[rid] = "cancelled"
            self.core.cancel(rid)
            self._plans()

    # ---- the stage worker --------------------------------------------------------------------------------------
    def _failed(self, step: int, exc: Exception) -> None:
        from shared.protocol import StageError

        self.log.append(f"stage fails step {step}: {exc!r}")
        self.failed.append(step)
        self.ex.results.append(StageError(component="stage0", step=step, message=repr(exc)))

    def read_inbox(self) -> None:
        while self.ex.inbox:
            msg = self.ex.inbox.popleft()
            self.runner.on_message(msg)

    def read_one(self) -> None:
        self.runner.on_message(self.ex.inbox.popleft())

    def device(self) -> None:
        """The GPU: launched steps run in launch order; a graph waiting for its rows runs once the flag reaches them."""
        flag = int(self.runner.ple_mailbox.flag[0])
        for launched in self.runner.launched:
            step = launched.plan.step
            if step in self.device_done:
                continue
            seq = self.waits.get(step)
            if seq is not None and flag < seq:
                return
            self.device_done.add(step)

    def finish(self) -> None:
        r = self.runner
        step = r.launched[0].plan.step
        try:
            outgoing = r.finish()
        except Exception as exc:
            self._failed(step, exc)
            return
        for o in outgoing:
            self.route(o)
        r.queue_samplers()                    # as the worker loop, once the messages are out
        self.log.append(f"stage finishes {step}")

    def route(self, o) -> None:
        """One of a `finish`'s messages: the gateway's result to the core (one stage has no one else to tell)."""
        if o.to == "gateway":
            self.ex.results.append(o.message)

    # ---- the run -----------------------------------------------------------------------------------------------
    def moves(self) -> list:
        r = self.runner
        m = []
        if self.ex.inbox:
            m += [self.read_inbox, self.read_one]
        if r.launched and r.launched[0].plan.step in self.device_done:
            m.append(self.finish)
        if self.ex.results or self.to_add:
            m.append(self.core_turn)
        return m

    def stuck(self) -> bool:
        return bool(self.core.scheduler.running or self.core.scheduler.draining or self.core.scheduler.waiting)

    def run(self, limit: int = 30000) -> None:
        r = self.runner
        for _ in range(limit):
            self.device()
            if self.cancel_rate and self.rng.random() < self.cancel_rate:
                self.client_leaves()
            moves = self.moves()
            turn = self.rng.random()
            if turn < 0.3 or not moves:
                before = (len(r.launched), int(r.ple_mailbox.flag[0]), len(self.device_done))
                if turn < 0.1:
                    r.ready()            # the worker loop asks it after `finish`
                r.launch_ready(self._failed)
                self.device()
                if (len(r.launched), int(r.ple_mailbox.flag[0]), len(self.device_done)) != before:
                    continue
                moves = self.moves()
                if not moves:
                    return
                continue
            self.rng.choice(moves)()
        raise AssertionError("the run did not end")


def _scenario(seed: int):
    rng = random.Random(seed)
    prompts = [11, 18, 11, 6]
    n = rng.randint(2, 12)
    max_tokens = [n, n, n, rng.choice([n, rng.randint(2, 12)])]
    late = [0, 0, 0, rng.randint(0, 6)]                # the h100-32 shape: the fourth starts a few turns later
    return rng, prompts, max_tokens, late


@pytest.mark.parametrize("microbatches,cancel_rate,after_rows", [(0, 0.0, True), (0, 0.01, True), (2, 0.0, True),
                                                                   (2, 0.01, True), (0, 0.0, False)])
def test_one_stage_end_of_stream_never_stalls(tiny_checkpoint, tmp_path, microbatches, cancel_rate, after_rows):
    """The default (one micro-batch) and `microbatches` 2 on the one stage, where the core keeps up to four plans in
    flight against the stage's launch depth of two, so the worker loop's `ready()` prepares a step it cannot launch
    yet (the deterministic case below). With `ple_sample_after_rows` no step's sampler is queued while its graph
    still waits for its rows (h100-33: a kernel's first load there waits for the spinning graph); without it, the
    launch queues it at once (some seeds show it), and nothing else changes."""
    early = []
    for seed in range(40):
        rng, prompts, max_tokens, late = _scenario(seed)
        runner = _stage(tiny_checkpoint, tmp_path, rng, microbatches, after_rows)
        run = _Run(runner, rng, prompts, max_tokens, late, cancel_rate)
        run.run()
        early += run.sampled_early
        if after_rows:
            assert not run.sampled_early, f"seed {seed}: sampled before their rows were out: {run.sampled_early}"
        where = "\n".join(run.log[-50:])
        pending = [(p.seq, p.tokens) for p in runner._pending_rows]
        assert not pending, f"seed {seed}: launched graphs wait for tokens nobody publishes: {pending}\n{where}"
        assert not run.stuck(), (f"seed {seed}: stalled with requests running {list(run.core.scheduler.running)}, "
                                 f"draining {list(run.core.scheduler.draining)}, launched "
                                 f"{[x.plan.step for x in runner.launched]}, plans {sorted(runner.plans)}\n{where}")
        assert not run.failed, f"seed {seed}: failed steps {run.failed}\n{where}"
        for i in range(4):
            rid = f"r{i}"
            if run.done.get(rid) == "cancelled":
                continue
            assert run.done.get(rid) == "length" and len(run.events[rid]) == max_tokens[i], \
                f"seed {seed}: {rid} {run.done.get(rid)} after {len(run.events[rid])} tokens\n{where}"
        assert not runner.launched
    assert after_rows or early, "no step was ever sampled before its rows: the orderings never queue it early"


def test_a_step_prepared_with_the_launch_depth_full_gets_its_rows(tiny_checkpoint, tmp_path):
    """The worker loop asks `ready()` after each `finish` whatever the launch depth (stage_worker/main.py), and
    `ready()` takes a decode step's tokens off the device feed (`device_fed`). With two micro-batches on one stage
    the step asked about may decode tokens of the launched step that finishes next: `finish` then saw them as taken
    by a launched step and kept no host copy, while `_rows_from` hands tokens only to launched steps, so once that
    step was launched its graph waited for rows nobody would publish (on the GPU until host_wait gave up, then
    its requests failed, and every graph queued behind it waited as long)."""
    from shared.protocol import SamplingSpec, SeqEntry

    runner = _stage(tiny_checkpoint, tmp_path, random.Random(0))
    box = runner.ple_mailbox
    prompts = {"a": [5, 17, 30, 2, 2, 9, 100], "b": [44, 45, 46, 47, 48, 1, 2, 3, 90]}
    for step, (rid, ids) in enumerate(prompts.items()):     # a in micro-batch 0, b in micro-batch 1
        spec = SamplingSpec(rid, 0.7, 1.0, 0, 0.0, 0.0, 0.0, 1.0, step, None, prompt_ids=ids)
        runner.on_message(Plan(step=step, microbatch=step, new_requests=[spec],
                               entries=[SeqEntry(rid, step, 0, len(ids), [step], tokens=ids, sample=True)]))
        runner.on_message(PleReady(step=step, ring_slot=0, num_tokens=len(ids)))
        assert runner.launch_ready(lambda s, exc: pytest.fail(f"step {s}: {exc!r}")) == 1
    assert not runner.can_launch()                      # steps 0 and 1 launched: the depth is full
    a = len(prompts["a"])
    plan = Plan(step=2, microbatch=0, entries=[SeqEntry("a", 0, a, 1, [])])    # a's token from step 0
    runner.on_message(plan)
    assert runner.ready() is plan                       # the worker loop's question, answered from the device feed
    assert ("a", a) in runner.device_fed
    runner.finish()                                     # step 0: the token a's step 2 decodes reaches the host
    assert runner.launch_ready(lambda s, exc: pytest.fail(f"step {s}: {exc!r}")) == 1
    assert runner.launched[-1].plan.step == 2
    seq = box.seq                                       # step 2's number in the mailbox
    assert not runner._pending_rows and int(box.flag[0]) == seq, \
        f"step 2's graph waits for {[(p.seq, p.tokens) for p in runner._pending_rows]} (flag {int(box.flag[0])})"
    assert ("a", a) not in runner.next_tokens           # taken by the step it was for
