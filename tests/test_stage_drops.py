"""Steps the engine core drops (a stage failed a step before them: `Scheduler.drop_from`) leave nothing behind in
the stages: stage 0 gives back the sampled tokens a dropped step took, and a later stage frees the activations of a
dropped step that reach it after the drop. Driven by hand on the CPU over the tiny checkpoint split in two stages
(the helpers of tests/test_ple_decode_rows.py)."""

from __future__ import annotations

import pytest
import torch

from shared.model_config import load_config
from shared.protocol import Activations, Plan, Sampled, SeqEntry, TokenOut
from stage_worker.runner import StageRunner
from stage_worker.stage_loader import load_stage
from test_ple_decode_rows import PROMPTS, _decode_plan, _first_of_two, _two_stages


@pytest.mark.parametrize("launched", [False, True])
def test_a_dropped_step_gives_its_sampled_tokens_back(tiny_checkpoint, tmp_path, launched):
    """Stage 0 of two took the sampled tokens for a step (prepared by `ready`, launched or not), then the step was
    dropped (a later stage failed the step before it); the scheduler plans the rolled-back requests again at the
    same positions, and that plan finds the tokens (it waited forever for tokens the dropped step had consumed).
    A request finished by the same message takes its token with it."""
    runner, svc = _first_of_two(tiny_checkpoint, tmp_path)
    try:
        runner.launched.clear()
        runner.on_message(_decode_plan(1))
        runner.on_message(Sampled(step=0, microbatch=0,
                                  tokens=[TokenOut(r, len(p), 40 + i) for i, (r, p) in enumerate(PROMPTS.items())]))
        assert runner.ready() is not None and not runner.next_tokens      # step 1 took both tokens
        if launched:
            runner.launch(runner.ready())
        runner.on_message(Plan(step=-1, microbatch=0, entries=[], dropped=[1], finished=["b"]))
        assert runner.next_tokens == {("a", len(PROMPTS["a"])): 40}
        replan = Plan(step=2, microbatch=0, entries=[SeqEntry("a", 0, len(PROMPTS["a"]), 1, [])])
        runner.on_message(replan)
        assert runner.ready() is replan
        assert runner.plans[2].host_ids == [40]
    finally:
        svc.close()


def test_activations_of_a_step_dropped_before_they_came_are_not_kept(tiny_checkpoint, tmp_path):
    """Stage 1: the drop of step 3 comes before stage 0's activations for it (handed on at launch, before the
    failure): they are discarded (over CUDA IPC their ring slot would stay held for good), and the next step's
    are kept as usual."""
    cluster = _two_stages(tiny_checkpoint, tmp_path)
    runner = StageRunner(load_stage(cluster, 1, load_config(tiny_checkpoint)), cluster, 1, None)
    runner.on_message(Plan(step=-1, microbatch=0, entries=[], dropped=[3]))
    hidden = torch.zeros(2, runner.model.stream_width)
    for step in (3, 4):
        runner.on_message(Activations(step=step, hidden=hidden, token_ids=torch.zeros(2, dtype=torch.long),
                                      timing=[]))
    assert list(runner.acts) == [4] and not runner._dropped_steps


def test_a_plan_for_state_a_restarted_stage_never_held_is_refused_as_stale(tiny_checkpoint, tmp_path):
    """A plan made before this process started (a decode of a request it never saw, a restore from a snapshot it
    never took) raises `StaleState`, which the worker logs in one line: expected in the moment before the engine
    core sees the new process, and then ignored."""
    from stage_worker.runner import StaleState

    cluster = _two_stages(tiny_checkpoint, tmp_path)
    runner = StageRunner(load_stage(cluster, 1, load_config(tiny_checkpoint)), cluster, 1, None)
    with pytest.raises(StaleState, match="was the stage restarted"):
        runner.on_message(Plan(step=7, microbatch=0, entries=[SeqEntry("a", 0, 12, 1, [])]))
    assert not runner.plans


def test_tokens_for_a_request_that_already_finished_are_not_kept(tiny_checkpoint, tmp_path):
    """Stage 0 of two: a Sampled that arrives after its request was finished (a step dropped for a failure that
    the last stage ran anyway) leaves nothing in `next_tokens` (it would stay there for good: request ids do not
    come back)."""
    runner, svc = _first_of_two(tiny_checkpoint, tmp_path)
    try:
        runner.on_message(Plan(step=-1, microbatch=0, entries=[], dropped=[1], finished=["b"]))
        runner.on_message(Sampled(step=1, microbatch=0, tokens=[TokenOut(r, len(p), 9) for r, p in PROMPTS.items()]))
        # (what it leaves for "a", still running, is a dropped step's token: `_forget_redrawn` removes it when the
        # replanned step launches; tests/test_qa_stale_token_after_drop.py)
        assert [key for key in runner.next_tokens if key[0] == "b"] == []
        assert ("a", len(PROMPTS["a"])) in runner.next_tokens      # the Sampled was read, not ignored whole
    finally:
        svc.close()
