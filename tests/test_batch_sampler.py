"""The batched device sampler against the per-row reference: the same adjusted logits and filtered probabilities
for every parameter mix, greedy rows the same token, draws that depend only on (seed, position) and follow the
filtered distribution, and a defined token when a row has nothing left to sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.sampling import SamplingParams
from shared.token_mask import apply_mask
from stage_worker import batch_sampler as bs
from stage_worker import sampler

V = 64


def pack_mask(allowed: np.ndarray) -> bytes:
    """bool [vocab] -> the packed mask the gateway sends (shared/token_mask.py's wire form)."""
    return np.packbits(np.asarray(allowed, dtype=bool), bitorder="little").tobytes()


def filtered_probs(adjusted: torch.Tensor, rows: list[bs.Row]) -> torch.Tensor:
    """The batch's candidates' probabilities over the whole vocabulary [B, V] (zero elsewhere)."""
    return bs.candidates(adjusted, rows)


def _rows(n: int, seed: int = 0) -> list[bs.Row]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa: E731
        allowed = None
        if i % 4 == 3:
            keep = torch.rand(V, generator=g) < 0.3
            allowed = pack_mask(keep.numpy())
        params = SamplingParams(
            temperature=pick([0.0, 0.5, 0.7, 1.3]), top_k=pick([0, 1, 5, 20, V + 3]), top_p=pick([1.0, 0.8, 0.3]),
            min_p=pick([0.0, 0.05]), presence_penalty=pick([0.0, 0.5]), frequency_penalty=pick([0.0, 0.3]),
            repetition_penalty=pick([1.0, 1.2]), logit_bias=pick([None, {3: 5.0, 7: -100.0}, {V + 5: 1.0}]))
        history = torch.randint(V, (int(torch.randint(6, (1,), generator=g)),), generator=g).tolist()
        prompt = torch.randint(V, (4,), generator=g).tolist()
        rows.append(bs.Row(params, seed=1000 + i, position=10 + i, history=history, prompt_ids=prompt,
                           allowed=allowed))
    return rows


def _reference_adjusted(logits: torch.Tensor, r: bs.Row) -> torch.Tensor:
    biased = sampler.apply_logit_bias(logits, r.params.logit_bias)
    return apply_mask(sampler.apply_penalties(biased, r.params, r.history, r.prompt_ids), r.allowed)


def test_adjusted_logits_and_filtered_probabilities_match_the_per_row_sampler():
    rows = _rows(48)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(1)) * 3
    adjusted = bs.adjusted_logits(logits, rows)
    probs = filtered_probs(adjusted, rows)
    for b, r in enumerate(rows):
        ref = _reference_adjusted(logits[b], r)
        assert torch.allclose(adjusted[b], ref, atol=1e-5), b
        assert torch.allclose(probs[b], sampler.filtered_probs(ref, r.params), atol=1e-6), b


def test_greedy_rows_take_the_per_row_argmax_and_every_token_is_allowed():
    rows = _rows(48, seed=2)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(3))
    tokens = bs.sample_rows(logits, rows)
    for b, r in enumerate(rows):
        ref = _reference_adjusted(logits[b], r)
        if r.params.greedy:
            assert int(tokens[b]) == int(torch.argmax(ref))
        else:
            assert float(sampler.filtered_probs(ref, r.params)[tokens[b]]) > 0     # never a filtered-out token


def test_a_draw_depends_only_on_seed_and_position():
    rows = _rows(16, seed=4)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(5))
    whole = bs.sample_rows(logits, rows)
    order = list(reversed(range(len(rows))))
    shuffled = bs.sample_rows(logits[order], [rows[i] for i in order])
    assert whole.tolist() == shuffled.flip(0).tolist()
    for b in range(0, len(rows), 5):                  # alone in its batch
        assert int(bs.sample_rows(logits[b:b + 1], rows[b:b + 1])[0]) == int(whole[b])
    moved = [bs.Row(r.params, r.seed, r.position + 1, r.history, r.prompt_ids, r.allowed) for r in rows]
    assert bs.sample_rows(logits, moved).tolist() != whole.tolist()


def test_draws_follow_the_filtered_distribution():
    n = 20000
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    rows = [bs.Row(params, seed=7, position=p, history=[]) for p in range(n)]
    logits = torch.linspace(2.0, -2.0, 8).repeat(n, 1)
    tokens = bs.sample_rows(logits, rows)
    want = sampler.filtered_probs(logits[0], params)
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert float((freq - want).abs().max()) < 0.015
    assert bool((freq[want == 0] == 0).all())
    u = bs.uniforms(torch.tensor([bs.row_key(1, 2), bs.row_key(2, 1)]), torch.arange(50000).repeat(2, 1))
    assert bool(((u > 0) & (u < 1)).all()) and abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_a_row_with_nothing_left_gets_a_defined_token():
    params = SamplingParams(temperature=0.8)
    rows = [bs.Row(params, 1, 1, []), bs.Row(params, 1, 2, [])]
    logits = torch.full((2, V), float("-inf"))
    logits[1, 9] = 0.0
    assert bs.sample_rows(logits, rows).tolist() == [0, 9]


def test_token_counts_on_the_device_give_the_history_s_penalties_step_after_step():
    """Penalties read from per-slot counts (set from the prompt and earlier output once, then advanced by each
    sampled token on the device) equal penalties rebuilt from the token lists at every step."""
    rows = _rows(24, seed=7)
    counts = bs.TokenCounts(num_slots=30, vocab=V, device="cpu")
    slotted = []
    for b, r in enumerate(rows):
        slot = 29 - b
        counts.reset(slot, r.prompt_ids, r.history)
        slotted.append(bs.Row(r.params, r.seed, r.position, list(r.history), r.prompt_ids, r.allowed, slot=slot))
    g = torch.Generator().manual_seed(8)
    for step in range(6):
        logits = torch.randn(len(rows), V, generator=g) * 2
        ref = bs.adjusted_logits(logits, rows)
        assert torch.allclose(bs.adjusted_logits(logits, slotted, counts), ref, atol=1e-5), step
        tokens = bs.sample_rows(logits, slotted, counts)
        assert torch.equal(tokens, bs.sample_rows(logits, rows)), step
        for r, s, t in zip(rows, slotted, tokens.tolist()):
            r.history.append(t)
            s.history.append(t)
            r.position += 1
            s.position += 1


def test_batched_logprobs_equal_the_per_row_ones():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(9)) * 3
    tokens = torch.tensor([0, 5, 63, 7, 7])
    lp, vals, ids = bs.row_logprobs(logits, tokens, 3)
    for b in range(5):
        ref_lp, ref_ids, ref_vals = sampler.token_logprobs(logits[b], int(tokens[b]), 3)
        assert abs(float(lp[b]) - ref_lp) < 1e-6
        assert ids[b].tolist() == ref_ids and torch.allclose(vals[b], torch.tensor(ref_vals), atol=1e-6)
    lp0, vals0, ids0 = bs.row_logprobs(logits, tokens, 0)
    assert vals0.shape == (5, 0) and ids0.shape == (5, 0) and torch.allclose(lp0, lp)


def test_each_candidate_path_gives_the_per_row_distribution_and_the_same_draws():
    """Only top-p needs a sorted distribution: batches where every row has a top-k (topk), where no row has a top-p
    (the unsorted vocabulary, top-k rows cut at their k-th value) and where one row forces the sort must all give
    the per-row probabilities, and a row draws the same token whichever path its batch takes."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(12, V, generator=g) * 2
    plain = [SamplingParams(temperature=t, top_k=k, min_p=m) for t, k, m in
             [(0.7, 0, 0.0), (1.1, 5, 0.0), (0.5, 0, 0.05), (0.9, 20, 0.05), (1.0, 0, 0.0), (0.6, 3, 0.0)]]
    topk = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
            [(0.7, 4, 0.9), (1.1, 9, 1.0), (0.8, 20, 0.5), (1.2, 2, 1.0), (0.9, 30, 0.7), (0.6, 6, 1.0)]]
    for params in (plain, topk, plain + [SamplingParams(temperature=0.8, top_p=0.6)]):
        rows = [bs.Row(p, seed=50 + i, position=7, history=[]) for i, p in enumerate(params)]
        x = logits[: len(rows)]
        probs = filtered_probs(bs.adjusted_logits(x, rows), rows)
        for b, r in enumerate(rows):
            assert torch.allclose(probs[b], sampler.filtered_probs(x[b], r.params), atol=1e-6), (b, r.params)
        together = bs.sample_rows(x, rows).tolist()
        alone = [int(bs.sample_rows(x[b:b + 1], rows[b:b + 1])[0]) for b in range(len(rows))]
        assert together == alone
    sorted_batch = [bs.Row(p, seed=50 + i, position=7, history=[]) for i, p in enumerate(plain)]
    sorted_batch.append(bs.Row(SamplingParams(temperature=0.8, top_p=0.6), seed=1, position=7, history=[]))
    unsorted = bs.sample_rows(logits[: len(plain)], sorted_batch[: len(plain)]).tolist()
    assert bs.sample_rows(logits[: len(sorted_batch)], sorted_batch).tolist()[: len(plain)] == unsorted


def test_the_cpu_races_only_the_kept_columns_and_draws_what_the_whole_vocabulary_race_draws(monkeypatch):
    """On the CPU every row with a top-k races its best W columns (W: the most candidates a row keeps, ties of the
    k-th value included) with their token ids: the same tokens as racing each row's whole filtered vocabulary, over
    bf16-rounded logits full of ties, with top-p and min-p on top and a row whose logits are all masked."""
    from stage_worker.kernels import sample_race_ref

    widths = []
    compact = bs._compact_candidates
    monkeypatch.setattr(bs, "_compact_candidates", lambda *a: widths.append(compact(*a)[1].shape[1]) or compact(*a))
    g = torch.Generator().manual_seed(21)
    vocab = 600
    for trial in range(40):
        n = 1 + trial % 7
        params = [SamplingParams(temperature=0.4 + 0.3 * (i % 4), top_k=[2, 3, 20, 50][(trial + i) % 4],
                                 top_p=[1.0, 0.8, 0.3][i % 3], min_p=[0.0, 0.1][(trial + i) % 2]) for i in range(n)]
        rows = [bs.Row(p, seed=trial * 10 + i, position=trial, history=[]) for i, p in enumerate(params)]
        logits = (torch.randn(n, vocab, generator=g) * 2).to(torch.bfloat16).float()   # many ties
        logits[:, :40] = logits[:, :1]                                                 # a tie at the top
        if trial % 5 == 0:
            logits[n - 1] = float("-inf")                                              # nothing left: argmax
        got = bs.sample_rows(logits, rows)
        adjusted = bs.adjusted_logits(logits, rows)
        whole = sample_race_ref.sample_race(adjusted.argmax(dim=-1), bs.candidates(adjusted, rows),
                                            bs._Params.of(rows, vocab, "cpu").keys)
        assert torch.equal(got, whole), (trial, params)
    assert len(widths) == 40 and min(widths) >= 1 and max(widths) < vocab, widths


def test_the_race_kernel_draws_the_same_tokens(monkeypatch):
    """Kernel flag `sample_race` on (the Triton kernel, here on CPU tensors under the interpreter) or off: the same
    tokens over mixed rows (greedy, temperature, top-k, top-p, min-p, penalties, bias, masks), over plain temperature
    rows (the kernel's logit mode) with and without greedy rows among them, and with per-slot counts."""
    pytest.importorskip("triton")
    from stage_worker.kernels import sample_race

    calls = []
    kernel = sample_race.sample_race
    monkeypatch.setattr(sample_race, "sample_race", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    monkeypatch.setattr(bs, "INTERPRET_ON_CPU", True)
    g = torch.Generator().manual_seed(13)
    mixed = _rows(32, seed=12)
    plain = [bs.Row(SamplingParams(temperature=t), seed=300 + i, position=5 + i, history=[])
             for i, t in enumerate([0.3, 0.7, 1.0, 1.4, 0.9, 0.6])]
    greedy = [bs.Row(SamplingParams(temperature=0.0), seed=1, position=1, history=[])]
    for rows in (mixed, plain, plain[:3] + greedy + plain[3:], greedy + plain[:1]):
        logits = torch.randn(len(rows), V, generator=g) * 3
        logits[len(rows) // 2, :-1] = float("-inf")       # one token left
        if rows is plain:
            logits[1] = float("-inf")                      # nothing left: the argmax (0) stands
        n = len(calls)
        got = bs.sample_rows(logits, rows, race_kernel=True)
        assert torch.equal(got, bs.sample_rows(logits, rows)), [r.params for r in rows]
        assert len(calls) == n + 1 and ("temperature" in calls[-1]) == (rows is not mixed)
        if rows is plain:
            assert int(got[1]) == 0
    slotted = [bs.Row(r.params, r.seed, r.position, list(r.history), r.prompt_ids, r.allowed, slot=b)
               for b, r in enumerate(mixed)]
    counts = {on: bs.TokenCounts(num_slots=len(mixed), vocab=V, device="cpu") for on in (False, True)}
    for c in counts.values():
        for b, r in enumerate(mixed):
            c.reset(b, r.prompt_ids, r.history)
    for step in range(3):
        logits = torch.randn(len(mixed), V, generator=g) * 2
        on = bs.sample_rows(logits, slotted, counts[True], race_kernel=True)
        assert torch.equal(on, bs.sample_rows(logits, slotted, counts[False])), step
        assert torch.equal(counts[True].counts, counts[False].counts)
        for r in slotted:
            r.position += 1


def test_banned_ids_are_never_sampled_on_either_path():
    """min_tokens' ban (Row.banned, sampler.apply_ban): the best ids of every row are banned, greedy and sampled
    rows take something else, on the batched and the per-row path alike."""
    from shared.sampling import SamplingParams
    from stage_worker.batch_sampler import Row, sample_rows
    from stage_worker.sampler import apply_ban, position_generator, sample

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[:, 7] = logits[:, 9] = 30.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7,
              top_k=5), SamplingParams(temperature=1.0, top_p=0.5)]
    rows = [Row(p, 11, 20, [], banned=[7, 9]) for p in params]
    for _ in range(20):
        assert not set(sample_rows(logits, rows).tolist()) & {7, 9}
    for p in params:
        assert sample(apply_ban(logits[0], [7, 9]), p, position_generator(11, 20)) not in (7, 9)
    assert set(sample_rows(logits, [Row(params[0], 11, 20, [])]).tolist()) <= {7, 9}    # not banned: taken
