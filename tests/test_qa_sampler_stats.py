"""What tools/qa_sampler_stats.py found (the sampler against vLLM's documented semantics), kept as cheap
deterministic cases: each failed before its fix."""

from __future__ import annotations

import pytest
import torch

from shared.sampling import SamplingParams
from stage_worker import batch_sampler as bs
from stage_worker import sampler


def test_repetition_penalty_applies_before_frequency_and_presence():
    """vLLM's order: repetition (divide a positive logit, multiply a negative one), then frequency and presence.
    Token 0 (logit 1.0, generated once): 1.0 / 1.5 - 2 - 0.5; the other order gave (1.0 - 2.5) x 1.5. Token 1 (only in
    the prompt): repetition alone."""
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0, presence_penalty=0.5, repetition_penalty=1.5)
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    want = torch.tensor([1.0 / 1.5 - 2.5, 3.0 / 1.5, -2.0, 0.5])
    row = bs.Row(params, seed=1, position=1, history=[0], prompt_ids=[1])
    assert torch.allclose(bs.adjusted_logits(logits, [row])[0], want)
    counts = bs.TokenCounts(num_slots=2, vocab=4, device="cpu")
    counts.reset(1, [1], [0])
    slotted = bs.Row(params, seed=1, position=1, history=[0], prompt_ids=[1], slot=1)
    assert torch.allclose(bs.adjusted_logits(logits, [slotted], counts)[0], want)
    assert torch.allclose(sampler.apply_penalties(logits[0], params, [0], [1]), want)
