"""moepipe's model against transformers' reference implementation, on checkpoints transformers itself wrote."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import FAMILIES, reference_logits
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine

TOL = 1e-4


def _prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (n,), generator=g).tolist()
    ids[n // 3] = 5          # an EOS inside the prompt exercises the PLE hash reset
    return ids


def _load(path, **kw):
    return load_model(path, LoadOptions(dtype=torch.float32, **kw))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_match_transformers(family, reference_checkpoints):
    path, ref = reference_checkpoints[family]
    model = _load(path)
    prompt = _prompt(29, seed=1)
    cont = _prompt(16, seed=2)
    full = prompt + cont
    expected = reference_logits(ref, full)

    engine = LocalEngine([model], block_size=8)
    engine.add(0)
    got = engine.step([(0, prompt)], all_logits=True)
    assert (got - expected[: len(prompt)]).abs().max().item() < TOL
    for i, tok in enumerate(cont):
        step = engine.step([(0, [tok])])
        assert (step[0] - expected[len(prompt) + i]).abs().max().item() < TOL, f"decode step {i}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_of_three_gives_solo_logits(family, reference_checkpoints):
    path, _ = reference_checkpoints[family]
    model = _load(path)
    prompts = [_prompt(n, seed=10 + n) for n in (5, 23, 12)]
    solo = []
    for p in prompts:
        e = LocalEngine([model], block_size=8)
        e.add(0)
        solo.append([e.step([(0, p)])[0]] + [e.step([(0, [t])])[0] for t in (7, 8, 9)])
    e = LocalEngine([model], block_size=8)
    for i in range(3):
        e.add(i)
    together = [e.step([(i, p) for i, p in enumerate(prompts)])]
    for t in (7, 8, 9):
        together.append(e.step([(i, [t]) for i in range(3)]))
    for step, rows in enumerate(together):
        for i in range(3):
            assert (rows[i] - solo[i][step]).abs().max().item() < 1e-5, (step, i)
