"""A dropped step's sampled tokens must not feed the step that replans its requests (one stage, first and last, on
the CPU: the GPU path faked as tests/test_qa_end_of_stream_stall.py does, with the real `EngineCore`).

When a stage fails step s, the engine core drops s and every later plan of its micro-batch (`drop_from`): the
requests of s fail, those only in later plans are rolled back and planned again from where they were, so their
replan samples the same (request, position) again. Stage 0 keys the next step's input ids by (request, position)
(`next_tokens` on the host, `device_next` on the device). A later dropped step that had already been launched (its
inputs did not depend on s: a new admission's prefill, say) still sampled its token, and its `finish` put it in
`next_tokens`; the replanned decode step launched ahead behind the replanned prefill then found that key on the host
and was fed the dropped draw, while the client got the replan's draw. With an unseeded request (or any draw that
differs between the two computations) the model then continued from a token the client never saw.

What is checked: every token the gateway sends a request is the token the model is fed at that position, by the
steps whose results the core kept.
"""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine_core import GenerationRequest
from shared.protocol import StepResult
from shared.sampling import SamplingParams
from tests.test_qa_end_of_stream_stall import _Model, _Run, _stage


class _PeakedDraws:
    """A faked forward's head peaked on a new token at every call (it needs `vocab` and `calls`), and the ids each
    step is fed recorded in `fed`, by step and (request, position)."""

    def _note_fed(self, plan, batch) -> None:
        ids = batch.token_ids.tolist()
        fed, i = self.fed.setdefault(plan.step, {}), 0
        for e in plan.entries:
            for k in range(e.num_tokens):
                fed[(e.req_id, e.context_len + k)] = ids[i]
                i += 1

    def logits(self, hidden, batch):
        n = batch.logits_indices.numel()
        out = torch.full((n, self.vocab), -30.0)
        for row in range(n):
            self.calls += 1
            out[row, 10 + (self.calls * 7) % (self.vocab - 10)] = 30.0
        return out


class _DrawModel(_PeakedDraws, _Model):
    """Logits peaked on a new token at every call: two computations of one position draw different tokens (an
    unseeded draw, or a non-deterministic forward), and each row's token is known; it also records the ids each
    step is fed, by (request, position)."""

    def __init__(self, real, rng) -> None:
        super().__init__(real, rng)
        self.calls = 0
        self.plan = None                                  # the step being launched (set by the run)
        self.fed: dict[int, dict[tuple[str, int], int]] = {}   # step -> (request, position) -> id fed

    def __call__(self, batch, cache, hidden):
        self._note_fed(self.plan, batch)
        return super().__call__(batch, cache, hidden)


class _DropRun(_Run):
    """The harness's run with unseeded requests added by hand, the model's fed ids recorded, the steps whose results
    the core kept noted, and a step failure injected where the test says."""

    def __init__(self, runner, rng, fail_launch=(), fail_sample=(), route_first=False) -> None:
        super().__init__(runner, rng, [], [], [], 0.0)
        self.route_first = route_first          # `finish`'s Sampled for stage 0 back to it, as InProcessExecutor
        self.model = runner.model = _DrawModel(runner.model.real, rng)
        self.kept: set[int] = set()
        real_launch, real_sample = runner.launch, runner.sampler.sample

        def launch(plan):
            if plan.step in fail_launch:
                raise RuntimeError(f"step {plan.step}: injected launch failure")
            self.model.plan = plan
            real_launch(plan)
        runner.launch = launch

        def sample(plan, batch, logits, requests):
            if plan.step in fail_sample:
                raise RuntimeError(f"step {plan.step}: injected sampler failure")
            return real_sample(plan, batch, logits, requests)
        runner.sampler.sample = sample

        real_on_result = self.core._on_result

        def on_result(msg: StepResult):
            oldest = self.core.scheduler.oldest_in_flight(msg.microbatch)
            if oldest is not None and oldest.step == msg.step:
                self.kept.add(msg.step)
            real_on_result(msg)
        self.core._on_result = on_result

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.events[rid] = []
        req = GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.7),
                                ignore_eos=True)
        self.prompts = getattr(self, "prompts", {})
        self.prompts[rid] = len(prompt)
        self.core.add(req, self._sink(rid))
        self.log.append(f"client sends {rid}")

    def route(self, o) -> None:
        if self.route_first and o.to == "first":    # stage_worker/inprocess_executor.py routes it to stage 0
            self.runner.on_message(o.message)
        else:
            super().route(o)

    def launch(self) -> None:
        self.runner.launch_ready(self._failed)
        self.device()

    def core_all(self) -> None:
        while self.ex.results:
            self.core_turn()
        self._plans()

    def to_the_end(self, turns: int = 40) -> None:
        """Finish what the device has done, the core's turns, the stage's inbox and launches, until nothing moves."""
        runner = self.runner
        for _ in range(turns):
            if runner.launched and runner.launched[0].plan.step in self.device_done:
                self.finish()
            self.core_all()
            self.read_inbox()
            self.launch()
            if not (runner.launched or self.ex.inbox or self.ex.results or self.stuck()):
                break

    def mismatches(self) -> list[str]:
        return mismatches(self.kept, self.model.fed, self.events, self.prompts)


def mismatches(kept: set[int], fed_by_step: dict[int, dict[tuple[str, int], int]], events: dict[str, list[int]],
               prompts: dict[str, int]) -> list[str]:
    """Tokens a client got (`events`, from position `prompts[rid]` on) that the model was not fed at their position
    by a step whose result the core kept (`fed_by_step`: step -> (request, position) -> id fed)."""
    fed: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for step in sorted(kept):
        for key, token in fed_by_step.get(step, {}).items():
            fed.setdefault(key, []).append((step, token))
    bad = []
    for rid, tokens in events.items():
        for i, token in enumerate(tokens):
            pos = prompts[rid] + i
            for step, was in fed.get((rid, pos), []):
                if was != token:
                    bad.append(f"{rid} position {pos}: the client got {token}, step {step} was fed {was}")
    return bad


def _explain(run: _DropRun) -> str:
    return "\n".join(run.log[-40:])


@pytest.mark.parametrize("route_first", [False, True])
@pytest.mark.parametrize("finish_before_drop", [True, False])
def test_a_replanned_prefill_feeds_its_own_draw_not_the_dropped_one(tiny_checkpoint, tmp_path, finish_before_drop,
                                                                    route_first):
    """Request a (its last token in step 2) and b, admitted in step 3 (its prefill alone, which needs nothing from
    step 2). Both plans reach the stage before either is launched (the core planned step 3 from step 1's result);
    step 2's launch fails and step 3 is launched right behind it, sampling b's first token. The core fails a, drops
    step 3 and plans b again: a prefill sampling the same position (step 4) and, ahead of its result, b's first
    decode (step 5). Step 3's finish came before the drop reached the stage (`finish_before_drop`) or after it, with
    step 4 launched meanwhile; either way its token was left under (b, 11) on the host, and step 5 read it there.
    `route_first`: the stage's messages for stage 0 go back to it, as `InProcessExecutor` routes them (a dropped
    step's finish sent its Sampled there, and `on_message` kept its draw)."""
    rng = random.Random(0)
    runner = _stage(tiny_checkpoint, tmp_path, rng)
    run = _DropRun(runner, rng, fail_launch={2}, route_first=route_first)
    run.add("a", [3 + j for j in range(6)], 3)
    run._plans()                                           # steps 0 (a's prompt) and 1 (its first decode)
    run.read_inbox()
    run.launch()
    assert [x.plan.step for x in runner.launched] == [0, 1]
    run.finish()                                           # step 0
    run.launch()
    run.finish()                                           # step 1
    run.core_turn()                                        # step 0's result: step 2 (a's last token)
    run.add("b", [20 + j for j in range(11)], 3)
    run.core_turn()                                        # step 1's result: step 3 (b's prompt)
    run.read_inbox()
    assert sorted(runner.plans) == [2, 3]
    run.launch()                                           # step 2 fails; step 3 launched behind it
    assert run.failed == [2] and [x.plan.step for x in runner.launched] == [3]
    if finish_before_drop:
        run.finish()                                       # step 3's token (b, 11) to the host
    run.core_all()                                         # a fails, step 3 dropped, b planned again: 4 and 5
    run.read_inbox()
    run.launch()                                           # step 4 (b's prompt again)
    if not finish_before_drop:
        run.finish()                                       # step 3, dropped
        run.launch()
    run.to_the_end()
    assert run.done.get("a", "").startswith("error") and run.done.get("b") == "length", f"{run.done}\n{_explain(run)}"
    assert len(run.events["b"]) == 3
    assert 3 not in run.kept
    assert not run.mismatches(), "\n".join(run.mismatches()) + "\n" + _explain(run)
    assert not runner.launched and not runner.next_tokens and not runner.device_next


def test_a_replanned_prefill_after_a_sampler_failure_feeds_its_own_draw(tiny_checkpoint, tmp_path):
    """As above, with step 2 launched and failing in its `finish` (its sampler raised), step 3 launched behind it."""
    rng = random.Random(1)
    runner = _stage(tiny_checkpoint, tmp_path, rng)
    run = _DropRun(runner, rng, fail_sample={2})
    run.add("a", [3 + j for j in range(6)], 3)
    run._plans()
    run.read_inbox()
    run.launch()
    run.finish()                                           # step 0
    run.launch()
    run.finish()                                           # step 1
    run.core_turn()
    run.add("b", [20 + j for j in range(11)], 3)
    run.core_turn()
    run.read_inbox()
    run.launch()                                           # steps 2 and 3
    assert [x.plan.step for x in runner.launched] == [2, 3]
    run.finish()                                           # step 2 fails
    assert run.failed == [2]
    run.finish()                                           # step 3: b's token to the host
    run.to_the_end()
    assert run.done.get("a", "").startswith("error") and run.done.get("b") == "length", f"{run.done}\n{_explain(run)}"
    assert not run.mismatches(), "\n".join(run.mismatches()) + "\n" + _explain(run)
