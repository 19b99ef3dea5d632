"""`ple_sample_after_rows` on the CPU (the one-stage GPU path faked as tests/test_qa_end_of_stream_stall.py does):
a launched-ahead decode step's sampler (its "tail") is queued only once its PLE rows are published, which can be
after messages that came since its launch. Before the switch the sampler ran inside `launch`, with the requests'
sampling state as the launch saw it; a later plan may end or replace that state before the tail runs."""

from __future__ import annotations

import random

import pytest

from shared.protocol import Plan, PleReady, SamplingSpec, SeqEntry
from tests.test_qa_end_of_stream_stall import _stage

PROMPT = [5, 17, 30, 2, 2, 9, 100]


def _spec(rid: str, output_ids: list[int] | None = None) -> SamplingSpec:
    # a presence penalty: the batched sampler keeps per-slot token counts (`TokenCounts`) for it
    return SamplingSpec(rid, 0.7, 1.0, 0, 0.0, 0.5, 0.0, 1.0, 3, None, prompt_ids=list(PROMPT),
                        output_ids=list(output_ids or []))


def _fail(step, exc):
    pytest.fail(f"step {step}: {exc!r}")


def _two_launched(tiny_checkpoint, tmp_path):
    """Step 0 (a's prompt) launched and sampled; step 1 (a's first decode, its input read on the device from step
    0's token) launched behind it, its graph waiting for rows that need step 0's token on the host: its sampler
    waits (`tail`)."""
    runner = _stage(tiny_checkpoint, tmp_path, random.Random(0))
    n = len(PROMPT)
    runner.on_message(Plan(step=0, microbatch=0, new_requests=[_spec("a")],
                           entries=[SeqEntry("a", 0, 0, n, [0], tokens=list(PROMPT), sample=True)]))
    runner.on_message(PleReady(step=0, ring_slot=0, num_tokens=n))
    assert runner.launch_ready(_fail) == 1
    runner.on_message(Plan(step=1, microbatch=0, entries=[SeqEntry("a", 0, n, 1, [])]))
    assert runner.launch_ready(_fail) == 1
    assert [x.plan.step for x in runner.launched] == [0, 1]
    assert runner.launched[0].tail is None and runner.launched[1].tail is not None
    return runner


def test_a_dropped_step_whose_requests_ended_before_its_sampler_ran_does_not_fail(tiny_checkpoint, tmp_path):
    """The engine core drops every step in flight and ends their requests (`_fail_all`, or `drop_from` after a
    failed step: `Plan.dropped` with `finished`) while step 1's sampler waits for its rows. Its rows still go out
    once step 0's token is in, and its tail then ran with `requests` already without "a": "no sampling parameters",
    a second failed step (traceback, `StageError`) for a step the core had already forgotten."""
    runner = _two_launched(tiny_checkpoint, tmp_path)
    runner.on_message(Plan(step=-1, microbatch=0, entries=[], dropped=[0, 1], finished=["a"]))
    runner.finish()                                   # step 0: its token publishes step 1's rows
    runner.queue_samplers()                           # (the worker loop, once step 0's messages are out)
    runner.finish()                                   # step 1: its result is ignored by the core, but no failure
    assert not runner.launched and not runner._pending_rows


def test_a_dropped_step_sampled_after_its_request_was_replanned_leaves_the_new_state_alone(tiny_checkpoint,
                                                                                          tmp_path):
    """The core requeues its running requests (`requeue_running`: a component was lost and came back): steps 0 and
    1 dropped, "a" ended on the stages and planned again from its prompt and outputs (`new_requests`: a fresh
    `ReqState`). If that replan arrives while step 1's sampler waits for its rows, the tail sampled with the new
    state: the dropped step's token went into the replanned request's history and its penalty counts."""
    runner = _two_launched(tiny_checkpoint, tmp_path)
    n = len(PROMPT)
    runner.on_message(Plan(step=-1, microbatch=0, entries=[], dropped=[0, 1], finished=["a"]))
    outputs = [41]                                    # what the core kept of "a" (step 0's token, say)
    runner.on_message(Plan(step=2, microbatch=0, new_requests=[_spec("a", outputs)],
                           entries=[SeqEntry("a", 0, 0, n + 1, [1], tokens=PROMPT + outputs, sample=True)]))
    state = runner.requests["a"]
    assert state.history == outputs
    runner.finish()
    runner.queue_samplers()
    runner.finish()                                   # step 1, dropped
    assert runner.requests["a"] is state
    assert state.history == outputs, f"a dropped step's token reached the replanned request: {state.history}"
    assert state.counted_slot is None                 # its counts are rebuilt from its history at its first sample


def test_a_deferred_sampler_keeps_the_batched_path(tiny_checkpoint, tmp_path, caplog):
    """The worker loop queues a deferred tail from `queue_samplers` after `finish` (and `launch_ready` at its
    start), outside the `torch.inference_mode()` that `launch` and `finish` run in. The penalties' `TokenCounts`,
    made inside a launch, are inference tensors: their in-place update there raised, so every deferred step of a
    request with penalties fell back to the row-by-row sampler (host waits for the device, a warning a step)."""
    runner = _two_launched(tiny_checkpoint, tmp_path)
    assert runner.sampler.counts is not None          # step 0's sampler, in its launch, made them
    runner.finish()
    with caplog.at_level("WARNING", logger="moepipe.stage"):
        runner.queue_samplers()                       # as stage_worker/main.py, outside inference mode
    assert not [r for r in caplog.records if "batched sampling failed" in r.getMessage()], caplog.text
    assert runner.requests["a"].counted_slot == 0     # (the fallback forgets it: counts rebuilt every step)
    runner.finish()


def test_a_step_whose_rows_never_come_still_fails_after_the_wait_timeout(tiny_checkpoint, tmp_path):
    """`host_wait` gives up after `WAIT_TIMEOUT_S` so that a host that never publishes a step's rows (a token lost
    by some bug: h100-32's stall, the two micro-batch one of test_qa_end_of_stream_stall.py) costs that step's
    requests, not the server. With the sampler waiting for the rows, such a step was never sampled: `oldest_done`
    stayed False and the worker loop spun on it until the stall check restarted the stage. Past the timeout the
    graph has given up, so nothing spins behind the sampler: it is queued, and `finish` fails the step's requests
    from the mailbox's `timed_out` (`_fail_if_rows_missed`), as before the switch."""
    import torch

    from shared.protocol import StepResult
    from stage_worker.kernels.host_wait import WAIT_TIMEOUT_S

    runner = _two_launched(tiny_checkpoint, tmp_path)
    real_rows_from = runner._rows_from
    runner._rows_from = lambda tokens, **_: None          # step 0's token never reaches step 1's rows (a lost token)
    runner.finish()
    runner._rows_from = real_rows_from
    runner.launch_ready(_fail)
    step1 = runner.launched[0]
    assert step1.tail is not None and not runner.oldest_done()
    pending = runner._pending_rows[0]
    assert pending.seq == step1.rows_seq
    pending.since -= WAIT_TIMEOUT_S + 2               # the graph gave up: its copy of `timed_out` names it
    step1.ple_wait = (pending.seq, torch.tensor([pending.seq], dtype=torch.int64))
    runner.launch_ready(_fail)
    assert step1.tail is None and runner.oldest_done()
    result = next(o.message for o in runner.finish() if o.to == "gateway")
    assert isinstance(result, StepResult)
    assert [t.token for t in result.tokens] == [-1] and "in time" in result.tokens[0].error


def test_a_dropped_step_s_token_does_not_feed_the_replanned_request(tiny_checkpoint, tmp_path):
    """As above (`requeue_running`: steps 0 and 1 dropped, "a" planned again from its prompt and outputs while step
    1's sampler waits), then the replan runs: step 2 recomputes "a" and draws position n + 1 again, the position the
    dropped step 1 drew, and step 3 decodes that token, launched behind step 2 before its finish. Step 1's finish
    had left its own draw under ("a", n + 1) on the host, where step 3 read it first: the model was fed a token the
    client never got (the replan's draw differs unless seeded). tests/test_qa_stale_token_after_drop.py has the
    same through the engine core's `drop_from`."""
    runner = _two_launched(tiny_checkpoint, tmp_path)
    n = len(PROMPT)
    fed = {}
    model_call = type(runner.model).__call__

    def record(model, batch, cache, hidden):
        fed[len(fed)] = batch.token_ids.tolist()
        return model_call(model, batch, cache, hidden)
    type(runner.model).__call__ = record
    try:
        runner.on_message(Plan(step=-1, microbatch=0, entries=[], dropped=[0, 1], finished=["a"]))
        outputs = [41]
        runner.on_message(Plan(step=2, microbatch=0, new_requests=[_spec("a", outputs)],
                               entries=[SeqEntry("a", 0, 0, n + 1, [1], tokens=PROMPT + outputs, sample=True)]))
        runner.on_message(PleReady(step=2, ring_slot=0, num_tokens=n + 1))
        runner.finish()                               # step 0 (dropped): its token publishes step 1's rows
        runner.queue_samplers()
        assert runner.launch_ready(_fail) == 1        # step 2 (the replan) behind step 1
        runner.finish()                               # step 1, dropped: it drew ("a", n + 1) too
        runner.on_message(Plan(step=3, microbatch=0, entries=[SeqEntry("a", 0, n + 1, 1, [])]))
        assert runner.launch_ready(_fail) == 1        # step 3, its input read before step 2's finish
        assert [x.plan.step for x in runner.launched] == [2, 3]
        step2 = next(o.message for o in runner.finish() if o.to == "gateway")
        runner.queue_samplers()
        runner.finish()
    finally:
        type(runner.model).__call__ = model_call
    (drawn,) = [t.token for t in step2.tokens if t.position == n + 1]
    assert fed[len(fed) - 1] == [drawn], f"step 3 was fed {fed[len(fed) - 1]}, the client got {drawn}"
    assert ("a", n + 1) not in runner.next_tokens and ("a", n + 1) not in runner.device_next   # (taken by step 3)
