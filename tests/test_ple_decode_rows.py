"""A PLE stage gathers its decode steps' rows itself (`ple_decode_in_stage`, stage_worker/ple_decode_rows.py): the
PleService still fills the ring for prefill chunks, and for decode steps the stage hashes and gathers in-process, so
no step waits for the service's round trip. Driven step by step on the CPU: a StageRunner over the tiny checkpoint
and a real PleService (socket-free) sharing a ring, with the messages handed over by hand."""

from __future__ import annotations

import pytest
import torch

from ple_service.service import PleService
from shared.cluster_config import ClusterConfig, StageSpec
from shared.model_config import load_config
from shared.protocol import Plan, PleReady, SamplingSpec, SeqEntry
from stage_worker.checkpoint.loader import load_model
from stage_worker import step_sampling
from stage_worker.ple_decode_rows import PleMailbox
from stage_worker.runner import StageRunner

PROMPTS = {"a": [5, 17, 300, 2, 2, 9, 1000], "b": [44, 45, 46, 47, 48, 1, 2, 3, 90]}
STEPS = 6


def _cluster(model, tmp, **kw) -> ClusterConfig:
    cfg = load_config(model)
    stages = [StageSpec(0, cfg.num_hidden_layers, f"ipc://{tmp}/s0.sock")]
    cluster = ClusterConfig(model=str(model), stages=stages, gateway_endpoint=f"ipc://{tmp}/gw.sock",
                            ple_endpoint=f"ipc://{tmp}/ple.sock", ple_ring=str(tmp / "ple.ring"),
                            max_num_batched_tokens=32, block_size=16, num_blocks=16, max_num_seqs=4, **kw)
    return cluster.for_model(cfg)


def _run(model_dir, tmp, own_rows: bool, max_seqs: int = 2):
    """Prefill both prompts, then decode STEPS tokens each; returns (tokens, logprobs, PleReady messages the stage
    was given, the runner's stats). With `own_rows` and steps of at most `max_seqs` sequences the service's
    PleReady of every decode step is withheld."""
    cluster = _cluster(model_dir, tmp, ple_decode_in_stage=own_rows, ple_decode_in_stage_max_seqs=max_seqs)
    withhold = own_rows and len(PROMPTS) <= max_seqs
    cfg = load_config(model_dir)
    svc = PleService(model_dir, cfg, cluster)
    runner = StageRunner(load_model(model_dir), cluster, 0, svc.ring)
    given: list[PleReady] = []
    tokens: dict[str, list[int]] = {r: [] for r in PROMPTS}
    logprobs: dict[str, list[float]] = {r: [] for r in PROMPTS}
    try:
        specs = [SamplingSpec(r, 0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, 1, prompt_ids=p) for r, p in PROMPTS.items()]
        entries = [SeqEntry(r, i, 0, len(p), [i], tokens=p, sample=True) for i, (r, p) in enumerate(PROMPTS.items())]
        plans = [Plan(step=0, microbatch=0, new_requests=specs, entries=entries)]
        for step in range(1, STEPS + 1):
            plans.append(Plan(step=step, microbatch=0,
                              entries=[SeqEntry(r, i, len(p) + step - 1, 1, [], sample=True)
                                       for i, (r, p) in enumerate(PROMPTS.items())]))
        for plan in plans:
            runner.on_message(plan)
            ready = svc.on_plan(plan)
            while True:
                for msg in ready:
                    if withhold and plan.step > 0:
                        continue          # the decode steps must run without the service's rows
                    given.append(msg)
                    runner.on_message(msg)
                if runner.ready() is not None:
                    break
                assert ready, f"step {plan.step} waits for rows nobody will send"
                ready = []
            for out in runner.run(runner.ready()):
                if out.to == "ple":
                    ready = svc.on_sampled(out.message)
                    for msg in ready:     # rows of the next step, if its plan came first (it has not here)
                        runner.on_message(msg)
                elif out.to == "gateway":
                    for t in out.message.tokens:
                        tokens[t.req_id].append(t.token)
                        logprobs[t.req_id].append(t.logprob)
        return tokens, logprobs, given, runner.stats()
    finally:
        svc.close()


def test_decode_rows_gathered_in_the_stage_equal_the_service_s(tiny_checkpoint, tmp_path):
    for name in ("own", "svc"):
        (tmp_path / name).mkdir()
    own = _run(tiny_checkpoint, tmp_path / "own", own_rows=True)
    svc = _run(tiny_checkpoint, tmp_path / "svc", own_rows=False)
    assert own[0] == svc[0] and all(len(t) == STEPS + 1 for t in own[0].values())
    for r in PROMPTS:
        assert own[1][r] == pytest.approx(svc[1][r], abs=1e-5)
    assert [m.step for m in own[2]] == [0]                      # only the prefill's rows came from the service
    assert [m.step for m in svc[2]] == list(range(STEPS + 1))
    assert own[3]["ple_stage_gathers"] == STEPS and "ple_stage_gathers" not in svc[3]
    assert own[3]["ple_wait_seconds"] >= 0.0


def test_larger_decode_steps_take_the_service_s_rows(tiny_checkpoint, tmp_path):
    """`ple_decode_in_stage_max_seqs`: a decode step of more sequences waits for the service's rows (measured faster
    there at 4 and 16 streams, docs/performance.md call 11); same tokens."""
    for name in ("small", "svc"):
        (tmp_path / name).mkdir()
    capped = _run(tiny_checkpoint, tmp_path / "small", own_rows=True, max_seqs=1)
    svc = _run(tiny_checkpoint, tmp_path / "svc", own_rows=False)
    assert capped[0] == svc[0]
    assert [m.step for m in capped[2]] == list(range(STEPS + 1))     # every step's rows came from the service
    assert capped[3]["ple_stage_gathers"] == 0


def _prefill(runner: StageRunner, svc: PleService) -> list:
    """Step 0: both prompts prefilled, the service's rows handed over; returns the step's outgoing messages."""
    specs = [SamplingSpec(r, 0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, 1, prompt_ids=p) for r, p in PROMPTS.items()]
    entries = [SeqEntry(r, i, 0, len(p), [i], tokens=p, sample=True) for i, (r, p) in enumerate(PROMPTS.items())]
    plan = Plan(step=0, microbatch=0, new_requests=specs, entries=entries)
    runner.on_message(plan)
    for msg in svc.on_plan(plan):
        runner.on_message(msg)
    return runner.run(runner.ready())


def test_rows_published_for_a_waiting_graph_equal_the_stage_s_own(tiny_checkpoint, tmp_path):
    """`ple_launch_ahead` (GPU only: a graph waits on the device for them) hashes against the copy of the contexts
    the step before left and writes the rows into the mailbox, then the flag: after a prefill, the same rows as
    the stage's own gather (which reads the live contexts), for any tokens."""
    cluster = _cluster(tiny_checkpoint, tmp_path)
    cfg = load_config(tiny_checkpoint)
    svc = PleService(tiny_checkpoint, cfg, cluster)
    try:
        runner = StageRunner(load_model(tiny_checkpoint), cluster, 0, svc.ring)
        _prefill(runner, svc)
        gather = runner.own_decode_rows
        box = PleMailbox.create(gather, cluster.max_num_seqs, torch.float32, torch.device("cpu"))
        for seq, (slots, toks) in enumerate((([0, 1], [7, 300]), ([1], [2]), ([1, 0], [9, 9])), start=1):
            want = gather(slots, toks)
            gather.publish(box, slots, toks, seq)
            assert int(box.flag[0]) == seq
            for li, layer in enumerate(gather.branches):
                assert torch.equal(box.rows[: len(slots), li], want[layer].float())
    finally:
        svc.close()


def test_a_step_whose_graph_gave_up_on_its_rows_fails_its_requests():
    """`ple_launch_ahead`: the mailbox's `timed_out` (read back with the step's tokens) names the step whose graph
    gave up waiting; that step's requests fail with an error instead of continuing on wrong rows, and the count
    goes to the stats. A copy naming an earlier step leaves this one alone."""
    from types import SimpleNamespace

    from shared.protocol import TokenOut

    def launched(seq: int, seen: int):
        outs = [TokenOut("a", 9, 11), TokenOut("b", 12, 13)]
        return SimpleNamespace(plan=SimpleNamespace(step=40 + seq), outs=outs,
                               ple_wait=(seq, torch.tensor([seen], dtype=torch.int64)))

    runner = SimpleNamespace(index=0, ple_wait_timeouts=0)
    fine = launched(5, 4)                            # step 4 timed out earlier: step 5's own copy says 4
    StageRunner._fail_if_rows_missed(runner, fine)
    assert [o.token for o in fine.outs] == [11, 13] and runner.ple_wait_timeouts == 0
    missed = launched(6, 6)
    StageRunner._fail_if_rows_missed(runner, missed)
    assert [o.token for o in missed.outs] == [-1, -1] and all("in time" in o.error for o in missed.outs)
    assert runner.ple_wait_timeouts == 1


def test_a_first_stage_that_does_not_sample_publishes_ids_and_rows_once_sampled_arrives(tiny_checkpoint, tmp_path):
    """`ple_launch_ahead_across_stages` (the graph's side is GPU only): stage 0 of two takes a decode plan before
    the last stage's Sampled brought its tokens (the step is launched, its graph waiting on the device), and once
    Sampled arrives writes the ids (padding rows 0) and the rows the stage's own gather gives for those tokens,
    then the flag. A request finished meanwhile, whose token never comes, does not hold the step up."""
    from shared.protocol import Sampled, TokenOut

    runner, svc = _first_of_two(tiny_checkpoint, tmp_path)
    try:
        assert not runner.is_last and runner.own_decode_rows is not None
        # what a CUDA stage has: the mailbox with ids, and decode steps that replay a graph
        gather = runner.own_decode_rows
        runner.ple_mailbox = PleMailbox.create(gather, runner.cluster.max_num_seqs, torch.float32,
                                               torch.device("cpu"), with_ids=True)
        runner._rows_in_graph = lambda prepared: prepared.batch.is_decode
        box = runner.ple_mailbox

        def decode(step: int, reqs: list[str]) -> tuple[Plan, int]:
            plan = Plan(step=step, microbatch=0, entries=[SeqEntry(r, i, len(PROMPTS[r]) + step - 1, 1, [])
                                                          for i, r in enumerate(PROMPTS) if r in reqs])
            runner.on_message(plan)
            assert runner.ready() is plan                 # launched before its tokens exist
            prepared = runner.plans.pop(step)
            assert prepared.host_ids is None
            seq = runner._expect_rows(plan, prepared)
            assert int(box.flag[0]) < seq                 # the graph would wait
            return plan, seq

        plan, seq = decode(1, ["a", "b"])
        toks = {"a": 300, "b": 7}
        want = gather([0, 1], [toks["a"], toks["b"]])
        runner.on_message(Sampled(step=0, microbatch=0,
                                  tokens=[TokenOut(r, len(PROMPTS[r]), t) for r, t in toks.items()]))
        assert int(box.flag[0]) == seq
        assert box.ids.tolist() == [300, 7, 0, 0]
        for li, layer in enumerate(gather.branches):
            assert torch.equal(box.rows[:2, li], want[layer].float())
        assert not runner.next_tokens                    # the mailbox took them

        _, seq = decode(2, ["a", "b"])
        runner.on_message(Plan(step=3, microbatch=0, entries=[], finished=["b"]))   # b ends; no token comes
        runner.on_message(Sampled(step=1, microbatch=0, tokens=[TokenOut("a", len(PROMPTS["a"]) + 1, 42)]))
        assert int(box.flag[0]) == seq and box.ids.tolist() == [42, 0, 0, 0]
    finally:
        svc.close()


def _two_stages(model, tmp, **kw) -> ClusterConfig:
    """`_cluster` split in two stages: the PLE layer on stage 0."""
    stages = [StageSpec(0, 2, f"ipc://{tmp}/s0.sock"),
              StageSpec(2, load_config(model).num_hidden_layers, f"ipc://{tmp}/s1.sock")]
    return ClusterConfig(**{**_cluster(model, tmp).__dict__, "stages": stages, **kw})


def _first_of_two(model, tmp, **kw) -> tuple[StageRunner, PleService]:
    """Stage 0 of `_two_stages` with its PLE service, both prompts prefilled. The caller closes the service."""
    from stage_worker.stage_loader import load_stage

    cluster = _two_stages(model, tmp, **kw)
    svc = PleService(model, load_config(model), cluster)
    runner = StageRunner(load_stage(cluster, 0, load_config(model)), cluster, 0, svc.ring)
    _prefill(runner, svc)
    return runner, svc


def _across(tiny_checkpoint, tmp_path):
    """Stage 0 of two over the tiny checkpoint, prefilled, with what a CUDA stage across stages has: the mailbox with
    ids, and decode steps that replay a graph. Returns (runner, service)."""
    runner, svc = _first_of_two(tiny_checkpoint, tmp_path, ple_launch_ahead_across_stages=True)
    cluster = runner.cluster
    runner.ple_mailbox = PleMailbox.create(runner.own_decode_rows, cluster.max_num_seqs, torch.float32,
                                           torch.device("cpu"), with_ids=True)
    runner._rows_in_graph = lambda prepared: prepared.batch.is_decode
    return runner, svc


def _decode_plan(step: int) -> Plan:
    return Plan(step=step, microbatch=0, entries=[SeqEntry(r, i, len(PROMPTS[r]) + step - 1, 1, [])
                                                  for i, r in enumerate(PROMPTS)])


def test_a_token_that_comes_between_ready_and_launch_is_published(tiny_checkpoint, tmp_path):
    """`ple_launch_ahead_across_stages`: `ready` takes a step before its tokens came (the worker loop asks it with
    the launch depth full), then Sampled brings them, then the step is launched: its rows and ids are published at
    once (the tokens were left in `next_tokens`, which the mailbox must take, not wait PUBLISH_DEADLINE_S for)."""
    from shared.protocol import Sampled, TokenOut

    runner, svc = _across(tiny_checkpoint, tmp_path)
    try:
        plan = _decode_plan(1)
        runner.on_message(plan)
        assert runner.ready() is plan
        runner.on_message(Sampled(step=0, microbatch=0,
                                  tokens=[TokenOut(r, len(PROMPTS[r]), t) for r, t in (("a", 300), ("b", 7))]))
        seq = runner._expect_rows(plan, runner.plans.pop(1))
        box = runner.ple_mailbox
        assert int(box.flag[0]) == seq and box.ids.tolist() == [300, 7, 0, 0]
        assert not runner._pending_rows and not runner.next_tokens
    finally:
        svc.close()


@pytest.mark.parametrize("across", [True, False])
def test_tokens_that_never_come_are_published_as_0_past_the_deadline_across_stages_only(tiny_checkpoint, tmp_path,
                                                                                        monkeypatch, across):
    """Across stages the stream waits with no device timeout: a step whose tokens have not come by
    PUBLISH_DEADLINE_S is published with 0 (the stream goes on) and marked to fail. One stage (no ids in the
    mailbox) never: its tokens come from its own steps, however long those take, and its kernel times out alone."""
    import stage_worker.runner as runner_module

    runner, svc = _across(tiny_checkpoint, tmp_path)
    try:
        if not across:
            runner.ple_mailbox.ids = None
        plan = _decode_plan(1)
        runner.on_message(plan)
        prepared = runner.plans.pop(1)
        prepared.entry_tokens = [(r, len(PROMPTS[r])) for r in PROMPTS]     # what `ready` leaves without tokens
        seq = runner._expect_rows(plan, prepared)
        monkeypatch.setattr(runner_module, "PUBLISH_DEADLINE_S", 0.0)
        runner._publish_rows()
        box = runner.ple_mailbox
        if across:
            assert int(box.flag[0]) == seq and box.ids.tolist() == [0, 0, 0, 0] and seq in runner._forced_rows
        else:
            assert int(box.flag[0]) < seq and runner._pending_rows and not runner._forced_rows
    finally:
        svc.close()


def test_nothing_is_launched_behind_a_step_that_waits_for_its_ids(tiny_checkpoint, tmp_path):
    """`ple_launch_ahead_across_stages`: while a launched graph waits for ids this stage's host has yet to publish,
    no later step is ready (its launch may wait for the device on the host: that wait would never end); once the
    Sampled that publishes them is in, it is."""
    from shared.protocol import Sampled, TokenOut

    runner, svc = _across(tiny_checkpoint, tmp_path)
    try:
        first = _decode_plan(1)
        runner.on_message(first)
        assert runner.ready() is first
        runner._expect_rows(first, runner.plans.pop(1))
        runner.on_message(_decode_plan(2))
        assert runner._pending_rows and runner.ready() is None
        runner.on_message(Sampled(step=0, microbatch=0,
                                  tokens=[TokenOut(r, len(PROMPTS[r]), 5) for r in PROMPTS]))
        assert not runner._pending_rows and runner.ready() is not None
    finally:
        svc.close()


def test_a_row_that_failed_sampling_reaches_stage_0_and_the_service_as_token_0(tiny_checkpoint, tmp_path,
                                                                                 monkeypatch):
    """A request whose row failed inside a step ends, but a step planned ahead already feeds its token: the Sampled
    for stage 0 and the PLE service carries that row as token 0 (without it both waited for it forever, and across
    stages the waiting step failed after PUBLISH_DEADLINE_S with every request in it); the gateway still sees the
    error."""
    cluster = _cluster(tiny_checkpoint, tmp_path, device_sampling=False)
    svc = PleService(tiny_checkpoint, load_config(tiny_checkpoint), cluster)
    real = step_sampling.sample_row

    def sample_row(raw, state, allowed, position, banned=None):
        if state.spec.req_id == "b":
            raise ValueError("bad parameters")
        return real(raw, state, allowed, position, banned)

    monkeypatch.setattr(step_sampling, "sample_row", sample_row)
    try:
        runner = StageRunner(load_model(tiny_checkpoint), cluster, 0, svc.ring)
        out = {o.to: o.message for o in _prefill(runner, svc)}
        result = {t.req_id: t for t in out["gateway"].tokens}
        assert result["b"].token == -1 and result["b"].error and result["a"].token >= 0
        sampled = {t.req_id: t.token for t in out["ple"].tokens}
        assert sampled == {"a": result["a"].token, "b": 0}
        assert runner.next_tokens[("b", len(PROMPTS["b"]))] == 0     # the step planned ahead is ready
    finally:
        svc.close()


def test_a_step_on_the_host_path_is_finished_on_its_own_event(tiny_checkpoint, tmp_path):
    """`ple_launch_ahead_across_stages`, a step handed on by the host path (no CUDA IPC, or a prefill chunk too large
    for a slot): its activations are copied to the host at launch and `finish` waits for the event after that copy
    alone. (On a GPU a device synchronisation, or encoding from the device, would also wait for the graph queued
    behind it, which waits for a message only this thread reads: the worker hung on every prompt.)"""
    from shared.protocol import Activations

    class Event:
        def __init__(self) -> None:
            self.done, self.waited = False, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.waited = True

    runner, svc = _across(tiny_checkpoint, tmp_path)
    try:
        plan = Plan(step=1, microbatch=0, new_requests=[SamplingSpec("c", 0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, 1,
                                                                     prompt_ids=[3, 4, 5])],
                    entries=[SeqEntry("c", 2, 0, 3, [2], tokens=[3, 4, 5], sample=True)])
        runner.on_message(plan)
        for msg in svc.on_plan(plan):
            runner.on_message(msg)
        runner._copy_contexts = lambda: None              # (a CUDA event)
        copied = []
        runner._copy_out = lambda launched: copied.append(launched)
        runner.launch(runner.ready())
        launched = runner.launched[0]
        assert copied == [launched]
        launched.copied = event = Event()                 # what a CUDA stage records after the copies
        assert not runner.oldest_done()
        event.done = True
        assert runner.oldest_done()
        (out,) = runner.finish()
        assert event.waited and isinstance(out.message, Activations) and out.message.token_ids.tolist() == [3, 4, 5]
    finally:
        svc.close()



@pytest.mark.parametrize("across,service", [(True, True), (False, True), (True, False)])
def test_the_last_stage_finishes_each_step_before_launching_the_next_across_stages(tiny_checkpoint, tmp_path, across,
                                                                                   service):
    """`ple_launch_ahead_across_stages`: the last stage's step t+1 waits on the device for stage 0's graph, which
    waits for the Sampled that the last stage's `finish(t)` sends; launched before that finish, a host wait in its
    launch closed the cycle until PUBLISH_DEADLINE_S (h200-27). The last stage launches one step at a time then;
    without the flag it still queues two, and so it does where stage 0 cannot wait across stages (here no PLE
    service: stage 0 has no rows of its own, as with a model without PLE layers): the flag, on by default, took
    every multi-stage pipeline's last stage down to one step; nor does a stage before the last then copy its
    activations out on an event of its own."""
    from stage_worker.stage_loader import load_stage

    cluster = _two_stages(tiny_checkpoint, tmp_path, ple_launch_ahead_across_stages=across, launch_ahead=True,
                          ple_service=service)
    runner = StageRunner(load_stage(cluster, 1, load_config(tiny_checkpoint)), cluster, 1)
    assert runner.is_last and not runner.is_first
    assert runner.launch_depth == (1 if across and service else 2)
    first = StageRunner(load_stage(cluster, 0, load_config(tiny_checkpoint)), cluster, 0)
    assert first._host_path_events == (across and service)


@pytest.mark.parametrize("drop_first", [False, True])
def test_a_token_a_waiting_step_consumed_is_given_back_when_that_step_is_dropped(tiny_checkpoint, tmp_path,
                                                                                  drop_first):
    """`ple_launch_ahead_across_stages`: Sampled's tokens go to the waiting step's rows (out of `next_tokens`). If
    that step is dropped, the step that replans its requests needs the same tokens: they were lost (noted
    nowhere), so it would wait PUBLISH_DEADLINE_S and fail. Now the waiting step notes them as taken and the drop
    gives them back; dropped before they came, its rows are still published (its graph waits) and the tokens stay
    for the replan."""
    from types import SimpleNamespace

    from shared.protocol import Sampled, TokenOut

    runner, svc = _across(tiny_checkpoint, tmp_path)
    try:
        plan = _decode_plan(1)
        runner.on_message(plan)
        assert runner.ready() is plan
        prepared = runner.plans.pop(1)
        seq = runner._expect_rows(plan, prepared)
        runner.launched.append(SimpleNamespace(plan=plan, taken=prepared.taken, ple_wait=(seq, None), rows_seq=seq))
        keys = {r: (r, len(PROMPTS[r])) for r in PROMPTS}
        sampled = Sampled(step=0, microbatch=0, tokens=[TokenOut(r, keys[r][1], t) for r, t in (("a", 300), ("b", 7))])
        drop = Plan(step=3, microbatch=0, entries=[], dropped=[1])
        for msg in ([drop, sampled] if drop_first else [sampled, drop]):
            runner.on_message(msg)
        runner.launched.clear()
        assert int(runner.ple_mailbox.flag[0]) == seq                               # the waiting graph got its rows
        assert runner.next_tokens == {keys["a"]: 300, keys["b"]: 7}
        again = Plan(step=2, microbatch=0, entries=_decode_plan(1).entries)        # the step replanning them
        runner.on_message(again)
        assert runner.ready() is again and runner.plans[2].host_ids == [300, 7]
    finally:
        svc.close()
