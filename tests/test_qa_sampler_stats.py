"""What tools/qa_sampler_stats.py found (the sampler against vLLM's documented semantics), kept as cheap
deterministic cases: each failed before its fix."""

from __future__ import annotations

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


def _draws(logits: torch.Tensor, rows: list[bs.Row], n: int) -> list[int]:
    """The first row's tokens at positions 0..n-1, with the other rows beside it in every batch."""
    out = []
    for pos in range(n):
        batch = [bs.Row(rows[0].params, rows[0].seed, pos, [])] + rows[1:]
        out.append(int(bs.sample_rows(logits.expand(len(batch), -1), batch)[0]))
    return out


def test_top_k_keeps_every_tie_of_the_kth_value_whatever_the_batch():
    """top_k=2 over three tied best logits (bf16 logits tie often) keeps all three, as vLLM does. The top-k path (every
    row of the batch has a top-k) kept its K columns only, the unsorted path (a row without one beside it) all
    three: the same (seed, position) drew another token depending on the batch."""
    params = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.tensor([[3.0, 3.0, 3.0, 0.0, -1.0]])
    want = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0, 0.0])
    row = bs.Row(params, seed=5, position=0, history=[])
    beside = bs.Row(SamplingParams(temperature=1.0), seed=6, position=0, history=[])
    for rows in ([row], [row, beside]):
        assert torch.allclose(bs.candidates(logits.expand(len(rows), -1), rows)[0], want)
    assert torch.allclose(sampler.filtered_probs(logits[0], params), want)
    alone = _draws(logits, [row], 300)
    assert alone == _draws(logits, [row, beside], 300)
    assert set(alone) == {0, 1, 2}


def test_top_p_keeps_the_whole_tie_that_crosses_it():
    """Probabilities 0.45, then three tied at 0.16, then 0.06; top_p 0.6 is crossed inside the tie: all three stay
    (the mass above each is 0.45 < 0.6). The stable sort kept the lower ids of the tie, `topk` whichever it listed
    first, so the candidates hung on the order of ties (and on the batch's path)."""
    params = SamplingParams(temperature=1.0, top_p=0.6, top_k=4)
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    want = torch.softmax(torch.tensor([2.0, 1.0, 1.0, 1.0, float("-inf")]), dim=0)
    beside = bs.Row(SamplingParams(temperature=1.0, top_p=0.9), seed=6, position=0, history=[])
    for p in (params, SamplingParams(temperature=1.0, top_p=0.6)):
        row = bs.Row(p, seed=5, position=0, history=[])
        for rows in ([row], [row, beside]):        # the top-k's columns, the sorted vocabulary
            assert torch.allclose(bs.candidates(logits.expand(len(rows), -1), rows)[0], want), (p, len(rows))
        assert torch.allclose(sampler.filtered_probs(logits[0], p), want)
    row = bs.Row(params, seed=5, position=0, history=[])
    assert _draws(logits, [row], 200) == _draws(logits, [row, beside], 200)


def test_min_p_filters_before_top_p():
    """vLLM's order: min-p, then top-p over what it left. Probabilities 0.5 / 0.3 / 0.2, min_p 0.5 drops 0.2 (below
    0.25), leaving 0.625 / 0.375, and top_p 0.6 then keeps the first token alone; min-p last kept two."""
    params = SamplingParams(temperature=1.0, top_p=0.6, min_p=0.5)
    logits = torch.tensor([0.5, 0.3, 0.2]).log()[None]
    want = torch.tensor([1.0, 0.0, 0.0])
    for p in (params, SamplingParams(temperature=1.0, top_p=0.6, min_p=0.5, top_k=3)):
        rows = [bs.Row(p, seed=1, position=1, history=[])]
        assert torch.allclose(bs.candidates(logits, rows)[0], want), p
        assert torch.allclose(sampler.filtered_probs(logits[0], p), want), p


def test_a_temperature_below_1e_5_is_greedy():
    """vLLM's rule (its _SAMPLING_EPS): temperature 1e-6 over two tied best logits takes the first, every time, on both
    paths. It sampled at 1e-5 instead: half the draws took the other tied token."""
    params = SamplingParams(temperature=1e-6)
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy
    assert set(_draws(logits, [bs.Row(params, seed=3, position=0, history=[])], 100)) == {1}
    assert {sampler.sample(logits[0], params, sampler.position_generator(3, pos)) for pos in range(100)} == {1}
