"""Turn last-position logits into tokens: logit bias, penalties, temperature, top-k, top-p, min-p, per-request
seeded draws. The order every sampling path uses: bias on the raw logits, then penalties, then the grammar mask
(so a bias never re-allows a token the grammar forbids), then temperature and filtering."""

from __future__ import annotations

from collections import Counter

import torch

from shared.sampling import SAMPLING_EPS, SamplingParams


def apply_ban(logits: torch.Tensor, ids: list[int] | None) -> torch.Tensor:
    """`ids` (min_tokens: the stop ids before that many tokens) cannot be sampled: -inf. Ids past the row are
    ignored."""
    ids = [int(i) for i in ids or () if 0 <= int(i) < logits.shape[-1]]
    if not ids:
        return logits
    logits = logits.clone()
    logits[torch.tensor(ids, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """OpenAI logit_bias: each value is added to its token's raw logit (-100 all but bans it, +100 all but forces
    it). Ids past this row (a narrower head) are ignored; the gateway has already refused ids outside the vocabulary."""
    if not bias:
        return logits
    pairs = [(int(i), float(v)) for i, v in bias.items() if 0 <= int(i) < logits.shape[-1]]
    if not pairs:
        return logits
    logits = logits.clone()
    ids, values = zip(*pairs)
    logits[torch.tensor(ids, dtype=torch.long, device=logits.device)] += torch.tensor(
        values, dtype=logits.dtype, device=logits.device)
    return logits


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                    prompt_ids: list[int] | None = None) -> torch.Tensor:
    """Repetition as in HF (prompt + output), then OpenAI's presence/frequency (over generated tokens): vLLM's order.
    The two do not commute (a logit 1.0 seen once, frequency 2, repetition 1.5: -1.33 this way, -1.5 the other)."""
    if params.repetition_penalty and params.repetition_penalty != 1.0:
        seen = set(output_ids) | set(prompt_ids or [])
        if seen:
            ids = torch.tensor(sorted(seen), dtype=torch.long, device=logits.device)
            vals = logits[ids]
            logits = logits.clone()
            logits[ids] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        counts = Counter(output_ids)
        if counts:
            ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
            freq = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
            logits = logits.clone()
            logits[ids] -= params.frequency_penalty * freq + params.presence_penalty
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p, each over what the previous left (vLLM's order), for
    one row of logits. A filter keeps every token tied with one it keeps: top-k everything at least the k-th value
    (vLLM's rule), top-p a token when the tokens strictly more likely than it hold less than top_p (the token crossing
    top_p stays, with its whole tie), so the candidates never depend on how a sort orders ties
    (`batch_sampler._floor`)."""
    logits = logits.float() / max(params.temperature, SAMPLING_EPS)
    if params.min_p and params.min_p > 0.0:     # p < min_p x max p, in logits (as the batched sampler computes it)
        bound = logits.max() + torch.tensor(params.min_p, dtype=torch.float32, device=logits.device).log()
        logits = logits.masked_fill(logits < bound, float("-inf"))
    if params.top_k and params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        vals, order = torch.sort(logits, descending=True)
        p = probs[order]
        above = p.cumsum(0) - p
        first = torch.cat([torch.ones_like(vals[:1], dtype=torch.bool), vals[1:] != vals[:-1]])
        group = torch.where(first, torch.arange(vals.numel(), device=vals.device), 0).cummax(0).values
        keep = above[group] < params.top_p
        probs = probs.masked_fill(logits < (vals[keep].min() if bool(keep.any()) else float("inf")), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits).item())       # first maximal index: ties go to the lower id
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def position_generator(seed: int, position: int) -> torch.Generator:
    """The draw for a token depends only on (request seed, position): a request preempted and recomputed, or run
    in another process, samples exactly the same tokens."""
    return torch.Generator().manual_seed((seed * 1_000_003 + position) & ((1 << 63) - 1))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[int], list[float]]:
    """Logprob of `token` and the `top` best, under the model's raw distribution (before temperature and
    filtering), as vLLM returns them by default."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.numel()))
        return float(lp[token]), ids.tolist(), vals.tolist()
    return float(lp[token]), [], []
