"""A step whose `launch` raises, and the sampled tokens its preparation took (one stage, first and last, on the CPU:
the GPU path faked as tests/test_qa_end_of_stream_stall.py does, with the real `EngineCore`).

Stage 0 takes a decode step's input token out of `next_tokens` / `device_next` when it prepares the step (`ready`:
`_take_host`, `_input_ids`) or when it expects the step's PLE rows (`_expect_rows`, `_rows_from`), noting it in the
step's `_Prepared.taken`, so that a dropped step gives it back for the step that replans its requests. A step whose
launch raises is reported (`failed(step, exc)`) and the core drops it and every later plan of its micro-batch
(`drop_from`), failing the failed step's requests and planning the others again. Its taken tokens then belong to
requests that end, unless that step is itself a *later* step of an earlier failure's drop: a second step failing in
the same `launch_ready` (the loop goes on to the next ready step before the core's drop comes), whose StageError the
core ignores (the step is dropped already), while its requests are rolled back and replanned alive. A grammar
request (never planned ahead) whose decode is in that second step needs the token it took: kept nowhere, its replan
was never ready and the request waited for good.

Across stages (stage 0 of two, `ple_launch_ahead_across_stages`) a launch that raises after `_expect_rows` leaves
rows pending with no graph waiting for them: they still go out in mailbox order (their tokens come with the last
stage's `Sampled`, or as 0 once the failed requests are `finished`), so `ready`'s guard and the mailbox's numbers
hold nothing up; but without being marked dropped they took a token that came after the failure (`_rows_from`)
from a request replanned alive, whose replan then waited PUBLISH_DEADLINE_S and failed.

A step that raises in `finish` is not affected: `finish` notes its taken tokens in `_finished_taken` before anything
in it can raise, and the drop that names the step gives them back.

What is checked: every request ends (a finish reason or an error), nothing is left launched or waiting, and the
tokens the clients got are the ones the model was fed.
"""

from __future__ import annotations

import random

import pytest

from shared.engine_core import GenerationRequest
from shared.sampling import SamplingParams
from tests.test_ple_launch_ahead_orderings import _stage0
from tests.test_qa_dropped_across_stages import no_deadline  # noqa: F401 (a fixture)
from tests.test_qa_dropped_across_stages import _Drops, _end_checks, _random_drops
from tests.test_qa_dropped_step_two_stages import _AnyToken
from tests.test_qa_end_of_stream_stall import _stage
from tests.test_qa_stale_token_after_drop import _DropRun, _explain


class _LaunchFailRun(_DropRun):
    """`_DropRun` with grammar requests, and a launch that raises at a chosen point: `before` (the wrapper, before
    the runner's `launch`: the prepared step is still in `plans`), `rows` (inside `launch`, right after the real
    `_expect_rows` numbered the step in the mailbox and noted its pending rows; prefill steps raise in the
    forward) or `forward` (inside `launch`, in the model's forward)."""

    def __init__(self, runner, rng, fail: set[int], where: str) -> None:
        super().__init__(runner, rng, fail_launch=fail if where == "before" else ())
        self.fail, self.where = fail, where
        real_expect, model = runner._expect_rows, self.model

        def expect_rows(plan, prepared):
            seq = real_expect(plan, prepared)
            if where == "rows" and plan.step in fail:
                raise RuntimeError(f"step {plan.step}: injected failure after _expect_rows")
            return seq
        runner._expect_rows = expect_rows
        real_call = type(model).__call__

        def call(batch, cache, hidden):
            if where in ("rows", "forward") and model.plan.step in fail:
                raise RuntimeError(f"step {model.plan.step}: injected forward failure")
            return real_call(model, batch, cache, hidden)
        runner.model = _Callable(model, call)

    def add_request(self, rid: str, prompt: list[int], max_tokens: int, grammar=None) -> None:
        self.events[rid] = []
        self.prompts = getattr(self, "prompts", {})
        self.prompts[rid] = len(prompt)
        self.core.add(GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.7),
                                        ignore_eos=True, grammar=grammar), self._sink(rid))
        self.log.append(f"client sends {rid}")


class _Callable:
    """The faked model with its forward replaced (a call goes through the type)."""

    def __init__(self, model, call) -> None:
        self._model, self._call = model, call

    def __call__(self, batch, cache, hidden):
        return self._call(batch, cache, hidden)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _run(tiny_checkpoint, tmp_path, fail: set[int], where: str, grammar: bool = True) -> _LaunchFailRun:
    run = _abg(tiny_checkpoint, tmp_path, _LaunchFailRun, fail, where, grammar=grammar)
    run.to_the_end(turns=200)
    return run


def _abg(tiny_checkpoint, tmp_path, cls, *args, grammar: bool = True):
    """A `cls` run (`cls(runner, rng, *args)`) of one stage with requests a, g (a grammar request unless not
    `grammar`) and b added, and the core's first plans sent."""
    rng = random.Random(0)
    run = cls(_stage(tiny_checkpoint, tmp_path, rng), rng, *args)
    run.add_request("a", [3 + j for j in range(6)], 4)
    run.add_request("g", [30 + j for j in range(5)], 4, grammar=_AnyToken() if grammar else None)
    run.add_request("b", [50 + j for j in range(7)], 4)
    run._plans()                                  # step 0 (the three prompts), step 1 (a and b planned ahead)
    return run


def _to_step_two(run) -> None:
    """Steps 0 and 1 launched, step 0 finished, step 2 (a, g, b) planned and launched."""
    run.read_inbox()
    run.launch()
    run.finish()                                  # step 0
    run.core_turn()                               # step 2 (a, g, b)
    run.read_inbox()
    run.launch()


def _check(run: _LaunchFailRun) -> None:
    r = run.runner
    assert set(run.done) == {"a", "g", "b"}, f"not ended: {sorted(set(run.events) - set(run.done))}\n{_explain(run)}"
    assert not run.stuck(), _explain(run)
    assert not r.launched and not r.plans, _explain(run)
    assert not run.mismatches(), "\n".join(run.mismatches()) + "\n" + _explain(run)


@pytest.mark.parametrize("where", ["before", "rows", "forward"])
@pytest.mark.parametrize("first", range(0, 8))
def test_two_launch_failures_in_a_row_end_every_request(tiny_checkpoint, tmp_path, first, where):
    """Steps `first` and `first + 1` raise in `launch`; every request still ends."""
    run = _run(tiny_checkpoint, tmp_path, {first, first + 1}, where)
    _check(run)


@pytest.mark.parametrize("where", ["before", "rows", "forward"])
@pytest.mark.parametrize("first", range(0, 8))
def test_one_launch_failure_ends_every_request(tiny_checkpoint, tmp_path, first, where):
    """Only step `first` raises in `launch`: its taken tokens belong to its own requests, which the core fails, so
    nothing waits for them; the rows it expected still go out (in mailbox order), so later graphs run."""
    run = _run(tiny_checkpoint, tmp_path, {first}, where)
    _check(run)



@pytest.mark.parametrize("where", ["before", "rows", "forward"])
def test_a_failed_later_step_gives_back_its_tokens(tiny_checkpoint, tmp_path, where):
    """Step 3 ([a, b], planned ahead) and step 4 ([g], the grammar request's decode of step 2's draw, which needs
    nothing from step 3) are both prepared when the stage launches: step 3 raises, the loop goes on to step 4
    (ready), which takes g's token and raises too. The core drops 3 and 4 on step 3's error, fails a and b and plans
    g again from the same token; step 4's error names a step it dropped already, so nothing more happens. The replan
    needs the token step 4 took: without it back it was never ready and g waited for good."""
    run = _abg(tiny_checkpoint, tmp_path, _LaunchFailRun, {3, 4}, where)
    runner = run.runner
    _to_step_two(run)
    assert [x.plan.step for x in runner.launched] == [1, 2]
    run.finish()                                  # step 1
    run.core_turn()                               # step 3 (a and b planned ahead)
    run.read_inbox()                              # prepared; the stage has not launched it yet
    run.device()
    run.finish()                                  # step 2: g's token (g, 6) to the host
    run.core_turn()                               # step 4 (g)
    run.read_inbox()
    assert sorted(runner.plans) == [3, 4]
    run.launch()                                  # both raise
    assert run.failed == [3, 4], _explain(run)
    run.to_the_end(turns=200)
    assert run.done.get("a", "").startswith("error") and run.done.get("b", "").startswith("error"), run.done
    assert run.done.get("g") == "length", f"{run.done}\n{_explain(run)}"
    _check(run)


class _FinishFailRun(_LaunchFailRun):
    """A step of `fail_finish` raises inside `finish`, after its tokens are on the host (from `_rows_from`, before
    they are published to `next_tokens`, the PLE rows or the core); steps of `fail` raise in `launch` (`where`)."""

    def __init__(self, runner, rng, fail_finish: set[int], fail: set[int] = frozenset(), where: str = "before"):
        super().__init__(runner, rng, set(fail), where)
        self.finishing = None
        real_rows_from = runner._rows_from

        def rows_from(tokens, dropped_only=False):
            if self.finishing in fail_finish:
                raise RuntimeError(f"step {self.finishing}: injected finish failure")
            real_rows_from(tokens, dropped_only)
        runner._rows_from = rows_from

    def finish(self) -> None:
        self.finishing = self.runner.launched[0].plan.step
        try:
            super().finish()
        finally:
            self.finishing = None


@pytest.mark.parametrize("then_launch", [False, True])
@pytest.mark.parametrize("first", range(0, 8))
def test_a_finish_failure_ends_every_request(tiny_checkpoint, tmp_path, first, then_launch):
    """Step `first` raises in `finish` (and, `then_launch`, step `first + 1` in `launch`). What the failed finish
    took is kept in `_finished_taken` (noted at the top of `finish`, before anything can raise) and given back when
    the drop names it; the launched step behind it is dropped (`_on_plan` gives back its tokens, its rows go out
    once the failed requests' `finished` makes their missing tokens 0)."""
    run = _abg(tiny_checkpoint, tmp_path, _FinishFailRun, {first}, {first + 1} if then_launch else set())
    run.to_the_end(turns=200)
    _check(run)


def test_a_finish_failure_then_a_launch_failure_gives_back_the_later_steps_tokens(tiny_checkpoint, tmp_path):
    """Step 3 ([a, b]) launched, step 4 ([g], needing nothing from step 3) prepared behind it: step 3's finish raises
    and the loop's next `launch_ready` launches step 4, which raises too, before the core's drop of 3 and 4 comes.
    g is planned again from the token step 4 took (as `test_a_failed_later_step_gives_back_its_tokens`)."""
    run = _abg(tiny_checkpoint, tmp_path, _FinishFailRun, {3}, {4})
    runner = run.runner
    _to_step_two(run)
    run.finish()                                  # step 1
    run.core_turn()                               # step 3 (a and b)
    run.read_inbox()
    run.launch()                                  # step 3 (its inputs from step 2, on the device)
    assert [x.plan.step for x in runner.launched] == [2, 3], _explain(run)
    run.device()
    run.finish()                                  # step 2: g's token (g, 6) to the host
    run.core_turn()                               # step 4 (g)
    run.read_inbox()
    assert sorted(runner.plans) == [4]
    run.device()
    run.finish()                                  # step 3 raises
    run.launch()                                  # step 4 raises
    assert run.failed == [3, 4], _explain(run)
    run.to_the_end(turns=200)
    assert run.done.get("g") == "length", f"{run.done}\n{_explain(run)}"
    _check(run)


# ---- stage 0 of two, `ple_launch_ahead_across_stages` (tests/test_qa_dropped_across_stages.py's harness) ----------


def _raise_after_expect_rows(runner, pipe, when) -> list[int]:
    """Stage 0's launch raises right after the real `_expect_rows` numbered a step in the mailbox and queued its
    pending rows, where `when(plan, seq)` says; returns the list of the steps it raised for (filled as it runs)."""
    raised: list[int] = []
    real_expect = runner._expect_rows

    def expect_rows(plan, prepared):
        seq = real_expect(plan, prepared)
        if when(plan, seq):
            pipe.seq_step[seq] = plan.step        # (the harness maps every pending number to its step)
            raised.append(plan.step)
            raise RuntimeError(f"stage 0 fails step {plan.step} after _expect_rows (injected)")
        return seq
    runner._expect_rows = expect_rows
    return raised


@pytest.mark.parametrize("microbatches", [1, 2])
def test_across_stages_a_launch_failing_after_its_rows_were_expected(tiny_checkpoint, tmp_path, no_deadline,
                                                                      microbatches):
    """Stage 0 of two with the mailbox's ids: a launch that raises right after `_expect_rows` numbered the step in
    the mailbox and queued its pending rows (no graph will wait for them). `ready` launches nothing while rows are
    pending, so those rows must still go out (their tokens come with the last stage's `Sampled`, or as 0 once the
    failed requests are `finished`) and the mailbox's numbers stay in order for the graphs behind; a token they
    wait for must not be taken from a request replanned alive (`_abandon` marks them dropped). PUBLISH_DEADLINE_S is
    infinite: a wait it would end hangs the run. Random orderings, failures on both stages, grammar requests."""
    raised = 0
    for seed in range(40):
        runner, pipe = _random_drops(tiny_checkpoint, tmp_path, 5000 + seed, 0.05, microbatches=microbatches,
                                     launch_fail_rate=0.02)
        steps = _raise_after_expect_rows(runner, pipe, lambda plan, seq, pipe=pipe: pipe.rng.random() < 0.08)
        pipe.run()
        raised += len(steps)
        _end_checks(runner, pipe, seed)
        assert set(pipe.finished) == {f"r{i}" for i in range(4)}, f"seed {seed}: {pipe.finished}"
        flag = int(runner.ple_mailbox.flag[0])
        assert flag == runner.ple_mailbox.seq, f"seed {seed}: mailbox flag {flag}, numbered {runner.ple_mailbox.seq}"
    assert raised, "no launch raised after _expect_rows"



def test_across_stages_a_failed_launch_of_a_later_dropped_step_takes_no_token(tiny_checkpoint, tmp_path,
                                                                              no_deadline):
    """The last stage fails a step; before the core's drop reaches stage 0, stage 0 launches a later step of that
    micro-batch, and the launch raises after `_expect_rows` queued rows that wait for the token of a request not in
    the failed step (a kept step's draw whose `Sampled` has not come): the core drops both steps and replans that
    request alive from that token. When the `Sampled` comes, the abandoned rows must not take it (`_rows_from` notes
    a token a waiting step consumes in its `taken`, which `_abandon` has already given back): `_abandon` marks them
    dropped, so the token stays in `next_tokens` for the replan."""
    hits = 0
    for seed in range(60):
        runner = _stage0(tiny_checkpoint, tmp_path)
        rng = random.Random(7000 + seed)
        prompts = [11, 9, 7, 13]
        max_tokens = [rng.randint(3, 10) for _ in prompts]
        pipe = _Drops(runner, rng, prompts, max_tokens, [0, 0, rng.randint(0, 4), rng.randint(0, 6)], 0.08,
                      grammar={i for i in range(4) if rng.random() < 0.5})
        sent: dict[int, object] = {}
        real_send = pipe._send

        def send(plan, real_send=real_send, sent=sent):
            sent[plan.step] = plan
            real_send(plan)
        pipe._send = send

        def waits_on_a_kept_token(plan, seq, pipe=pipe, runner=runner, sent=sent) -> bool:
            pending = runner._pending_rows[-1] if runner._pending_rows else None
            failed1 = [int(x.split()[-1]) for x in pipe.log if x.startswith("stage 1 fails step")]
            for f in failed1:
                bad = sent.get(f)
                if (bad is None or f in pipe.dropped0 or f >= plan.step or bad.microbatch != plan.microbatch
                        or pending is None or pending.seq != seq):
                    continue
                gone = {e.req_id for e in bad.entries}
                if any(isinstance(t, tuple) and t[0] not in gone for t in pending.tokens):
                    return True
            return False
        steps = _raise_after_expect_rows(runner, pipe, waits_on_a_kept_token)
        pipe.run()
        hits += len(steps)
        _end_checks(runner, pipe, seed)
        assert set(pipe.finished) == {f"r{i}" for i in range(4)}, f"seed {seed}: {pipe.finished}\n" + \
            "\n".join(pipe.log[-40:])
    assert hits, "no such launch failed: the test did not meet its shape"
