"""One request's sampling parameters cannot fail another's (issue 15): poisoned requests, with values the API
refuses but a stage may still be handed (hand-written plans, another client of the protocol), share steps with
healthy ones on the real engine core and last-stage runner. The healthy ones get exactly their solo tokens; a
poisoned one either gets tokens or fails alone with a clean error; the step never fails. Both sampling paths."""

from __future__ import annotations

import random

import pytest

from conftest import collect_events

from shared.engine_core import EngineFailed, GenerationRequest
from shared.sampling import SamplingParams
from stage_worker.inprocess_executor import local_engine_core

POISON = [dict(top_p=1e-46), dict(repetition_penalty=1e-300), dict(temperature=float("inf")),
          dict(temperature=1e-45), dict(presence_penalty=float("nan")), dict(min_p=1.0, top_k=1),
          dict(frequency_penalty=1e30), dict(logit_bias={5: float("inf")})]


@pytest.mark.parametrize("device_sampling", [True, False])
def test_poisoned_requests_fail_alone(tiny_checkpoint, device_sampling):
    rng = random.Random(3 + device_sampling)
    healthy = [GenerationRequest(f"h{i}", [5 + i, 9, 11 + i], SamplingParams(max_tokens=6, temperature=0.8,
                                                                             top_p=0.9, seed=40 + i))
               for i in range(5)]
    core = local_engine_core(tiny_checkpoint, max_model_len=64, max_num_seqs=12, device_sampling=device_sampling)
    try:
        solo = [collect_events(core, [r])[0] for r in healthy]
        poisoned = [GenerationRequest(f"p{i}", [7, 8 + i], SamplingParams(max_tokens=6, seed=i, **p))
                    for i, p in enumerate(POISON)]
        mixed = healthy + poisoned
        rng.shuffle(mixed)
        for r in healthy:
            r.request_id += "-again"
        out = dict(zip([r.request_id for r in mixed], collect_events(core, mixed)))
        for r, ref in zip(healthy, solo):
            assert [e.token_id for e in out[r.request_id]] == [e.token_id for e in ref], r.request_id
        for r in poisoned:
            events = out[r.request_id]
            last = events[-1]
            assert isinstance(last, EngineFailed) or last.finish_reason == "length", (r.params, events)
        assert core.health() == [] and core.num_running == 0
        assert core.scheduler.blocks.used_blocks == 0 and core.scheduler.blocks.used_slots == 0
    finally:
        core.stop()
