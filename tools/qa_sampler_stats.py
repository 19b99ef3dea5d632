"""Statistical QA of the sampler: does each row draw from the distribution OpenAI / vLLM semantics define?

Random batches (vocabularies of 5..300; normal, peaked, flat, tied (bf16-rounded) and partly -inf logits; random
parameter mixes with edge values: temperature 1e-6..100, top_p 1e-6..1, top_k 1 / -1 / past the vocabulary, min_p up
to 1, penalties over prompt and output histories, logit_bias of +-100, grammar masks, min_tokens bans; greedy and
sampled rows of different parameters in one batch, with and without per-slot `TokenCounts`) go through the engine's
entry point `batch_sampler.sample_rows`, N draws per sub-case (seed and position varied). `reference` computes each
sub-case's exact target distribution in float64 (vLLM's order, docs/architecture.md "Sampling semantics"):

    logit_bias on the raw logits; repetition penalty (prompt + output: positive / rp, others x rp), then frequency and
    presence (output counts); min_tokens' ban and the grammar mask (-inf); greedy (temperature < 1e-5 or top_k 1):
    the first maximal logit; else logits / temperature, min_p (p < min_p x max p dropped), top_k (everything at least
    the k-th largest value: ties kept), top_p (a token stays when the mass of the tokens strictly more likely than it
    is below top_p: the token crossing top_p stays, and so does every token tied with it).

Checks, per sub-case: `batch_sampler.candidates` equals the reference within 1e-5; no draw of a zero-probability
token; a greedy row always draws the reference's token (the first maximal adjusted logit: ties go to the lower id); a
chi-square test of the draws' counts (bins expecting fewer than 5 pooled) at a Bonferroni-corrected level (family-wise
false-alarm rate `--alpha`, default 1e-3, over every test the run can make; the seeds are fixed, so a run is
reproducible); the total-variation distance is reported. Per batch: the same (seed, position) draws the same token
alone, in reverse order and beside rows that push the batch onto another candidate path (no top-k with a top-p: the
sorted vocabulary; plain temperature), from histories instead of per-slot counts; `row_logprobs` equals float64
log_softmax of the raw logits (moepipe's documented logprobs, vLLM's default `raw_logprobs`); a row left with nothing
to sample (the grammar's tokens all banned) gets one defined token and the batch goes on. Every 10 batches: draws at
seeds s and s + 1 (a request's n choices) and at positions p and p + 1 are independent (chi-square of their 8 x 8
table). `--rowwise` also draws a sub-case a batch through the per-row sampler (`device_sampling` off), `--kernel` the
batches through the `sample_race` Triton kernel (interpreted on the CPU: slow), `--big` sub-cases over a
151,936-token vocabulary (large token ids in the hash; about a minute each).

Sub-cases whose outcome hangs on float rounding (a top_p / min_p boundary within 1e-5, two distinct logits within a
relative 1e-6) are drawn again, not tested: float32 may legitimately decide them either way.

    PYTHONPATH=. python tools/qa_sampler_stats.py [--batches 60] [--draws 4000] [--seed 0] [--alpha 1e-3] [--rowwise]
        [--big 2] [--kernel]

Not collected by pytest: tests/test_qa_sampler_stats.py keeps what it found as regression tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
KERNEL = "--kernel" in sys.argv
if KERNEL:                                 # before triton is imported: the kernel on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.stats import chi2  # noqa: E402

from shared.sampling import SamplingParams  # noqa: E402
from shared.token_mask import apply_mask  # noqa: E402
from stage_worker import batch_sampler as bs  # noqa: E402
from stage_worker import sampler  # noqa: E402

EPS_T = 1e-5              # vLLM's _SAMPLING_EPS: a temperature below it is greedy
FRAGILE_MASS = 1e-5       # a top_p / min_p decision this close to its threshold is float32's call
FRAGILE_GAP = 1e-6        # two distinct logits this close (relative) may tie or swap in float32


# ---- the reference -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Target:
    probs: torch.Tensor | None     # float64 [V]; None: nothing can be sampled (every logit -inf after bias and masks)
    greedy: bool
    fragile: bool


def pack(allowed: np.ndarray) -> bytes:
    return np.packbits(allowed.astype(bool), bitorder="little").tobytes()


def adjusted(logits: torch.Tensor, p: SamplingParams, history: list[int], prompt: list[int],
             allowed: np.ndarray | None, banned: list[int]) -> torch.Tensor:
    """float64 logits after bias, penalties (repetition, then frequency and presence), ban and mask."""
    V = logits.numel()
    x = logits.double().clone()
    for i, b in (p.logit_bias or {}).items():
        if 0 <= i < V:
            x[i] += b
    rp = p.repetition_penalty or 1.0
    if rp != 1.0:
        for t in set(history) | set(prompt):
            x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=V).double() if history \
        else torch.zeros(V, dtype=torch.float64)
    x = x - (p.frequency_penalty or 0.0) * counts - (p.presence_penalty or 0.0) * (counts > 0).double()
    for t in banned:
        x[t] = -math.inf
    if allowed is not None and allowed.any():
        x[~torch.from_numpy(allowed)] = -math.inf
    return x


def _close_values(x: torch.Tensor) -> bool:
    """Two distinct finite values within a relative FRAGILE_GAP."""
    v = torch.unique(x[torch.isfinite(x)])
    if v.numel() < 2:
        return False
    gaps = v[1:] - v[:-1]
    return bool((gaps <= FRAGILE_GAP * torch.maximum(v[1:].abs(), v[:-1].abs()).clamp_min(1.0)).any())


def reference(logits: torch.Tensor, p: SamplingParams, history: list[int], prompt: list[int],
              allowed: np.ndarray | None, banned: list[int]) -> Target:
    x = adjusted(logits, p, history, prompt, allowed, banned)
    V = x.numel()
    fragile = _close_values(x)
    if not torch.isfinite(x).any():
        return Target(None, True, fragile)
    if (p.temperature or 0.0) < EPS_T or p.top_k == 1:
        probs = torch.zeros(V, dtype=torch.float64)
        probs[int(torch.argmax(x))] = 1.0           # torch.argmax: the first maximum
        return Target(probs, True, fragile)
    s = x / p.temperature
    fragile |= _close_values(s)
    keep = torch.isfinite(s)
    if p.min_p:
        q = torch.softmax(s, 0)
        bound = p.min_p * q.max()
        keep &= q >= bound
        fragile |= bool(((q - bound).abs() <= FRAGILE_MASS * q.max()).any())
    if p.top_k and 0 < p.top_k < V:
        finite = torch.sort(s[keep], descending=True).values
        if finite.numel() >= p.top_k:
            keep &= s >= finite[p.top_k - 1]
    if p.top_p is not None and p.top_p < 1.0:
        q = torch.softmax(s.masked_fill(~keep, -math.inf), 0)
        values, which = torch.unique(s, return_inverse=True)           # ascending distinct values
        mass = torch.zeros_like(values).index_add_(0, which, q)
        above = (mass.flip(0).cumsum(0).flip(0) - mass)[which]          # the mass strictly more likely than each token
        keep &= above < p.top_p
        fragile |= bool(((above - p.top_p).abs()[q > 0] <= FRAGILE_MASS).any())
    probs = torch.softmax(s.masked_fill(~keep, -math.inf), 0)
    return Target(probs, False, fragile)


# ---- random cases --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sub:
    """One parameter mix over one row of logits, drawn `n` times in its batch."""
    logits: torch.Tensor
    params: SamplingParams
    history: list[int]
    prompt: list[int]
    allowed: np.ndarray | None
    banned: list[int]
    target: Target
    seed: int
    slot: int = 0


def random_logits(rng: random.Random, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    kind = rng.choice(["normal", "normal", "peaked", "flat", "ties", "levels", "ninf", "big"])
    x = torch.randn(V, generator=g) * rng.choice([0.1, 1.0, 3.0, 8.0])
    if kind == "peaked":
        x[rng.randrange(V)] += rng.choice([8.0, 15.0, 40.0])
    elif kind == "flat":
        x = torch.full((V,), rng.choice([0.0, 2.5, -7.0]))
    elif kind == "ties":          # a grid of 0.25: ties among the best tokens
        x = (x * 4).round() / 4
    elif kind == "levels":        # a few values only: ties everywhere, at every threshold
        x = torch.tensor([rng.choice([0.0, 0.5, 1.0, 2.0, -1.0]) for _ in range(V)])
    elif kind == "ninf":
        x[torch.rand(V, generator=g) < rng.choice([0.3, 0.9])] = -math.inf
        x[rng.randrange(V)] = 1.0
    elif kind == "big":
        x = x * 4 + 30.0
    if kind != "flat":
        x = x.bfloat16().float()              # the model's logits: bf16 values, so ties are common
    return x


def random_params(rng: random.Random, V: int) -> SamplingParams:
    pick = rng.choice
    bias = None
    if rng.random() < 0.3:
        bias = {rng.randrange(V): pick([100.0, -100.0, 5.0, -5.0, 0.5]) for _ in range(rng.randint(1, 4))}
    return SamplingParams(
        temperature=pick([0.0, 1e-6, 1e-5, 0.01, 0.3, 0.7, 1.0, 1.0, 1.5, 5.0, 100.0]),
        top_k=pick([None, 0, -1, 1, 2, 5, 20, max(V - 1, 1), V, V + 7]),
        top_p=pick([None, 1.0, 1.0, 0.95, 0.8, 0.5, 0.1, 1e-6]),
        min_p=pick([None, 0.0, 0.0, 0.05, 0.2, 0.5, 0.9, 0.999, 1.0]),
        presence_penalty=pick([0.0, 0.0, 0.5, -0.5, 2.0]), frequency_penalty=pick([0.0, 0.0, 0.3, -1.0, 2.0]),
        repetition_penalty=pick([1.0, 1.0, 1.2, 0.8, 2.0, 0.01, 100.0]), logit_bias=bias,
    ).with_defaults({})


def random_sub(rng: random.Random, V: int, degenerate: bool = False) -> Sub:
    while True:
        logits = random_logits(rng, V)
        params = random_params(rng, V)
        history = [rng.randrange(V) for _ in range(rng.choice([0, 0, 3, 12]))]
        prompt = [rng.randrange(V) for _ in range(rng.choice([0, 4, 30]))]
        allowed = None
        banned: list[int] = []
        if rng.random() < 0.2:
            allowed = np.array([rng.random() < rng.choice([0.0, 0.1, 0.5]) for _ in range(V)])
        if rng.random() < 0.2:
            banned = rng.sample(range(V), rng.randint(1, max(1, V // 4)))
        if degenerate:            # everything masked: the grammar allows a set min_tokens bans
            allowed = np.zeros(V, dtype=bool)
            allowed[: max(1, V // 5)] = True
            banned = list(range(max(1, V // 5)))
        target = reference(logits, params, history, prompt, allowed, banned)
        if not target.fragile:
            return Sub(logits, params, history, prompt, allowed, banned, target, seed=rng.getrandbits(64) - 2 ** 63)


def rows_of(sub: Sub, n: int, counted: bool) -> list[bs.Row]:
    """n draws of `sub`: seeds and positions both vary (seed + i // 1000, position i % 1000 + 7)."""
    return [bs.Row(sub.params, seed=sub.seed + i // 1000, position=i % 1000 + 7, history=list(sub.history),
                   prompt_ids=list(sub.prompt), allowed=pack(sub.allowed) if sub.allowed is not None else None,
                   slot=sub.slot if counted else None, banned=list(sub.banned) or None) for i in range(n)]


# ---- statistics ----------------------------------------------------------------------------------------------------

def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(p-value, degrees of freedom, total variation) of `counts` against `probs`; bins expecting < 5 pooled."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = counts.double()
    e_bins = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o_bins = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    if float(e_bins[-1]) < 5:       # fold a too-small pooled bin into the smallest big one
        j = int(torch.argmin(e_bins[:-1])) if e_bins.numel() > 1 else 0
        e_bins[j] += e_bins[-1]
        o_bins[j] += o_bins[-1]
        e_bins, o_bins = e_bins[:-1], o_bins[:-1]
    df = int(e_bins.numel()) - 1
    tv = 0.5 * float((obs / n - probs).abs().sum())
    if df < 1:
        return 1.0, 0, tv
    stat = float(((o_bins - e_bins) ** 2 / e_bins).sum())
    return float(chi2.sf(stat, df)), df, tv


@dataclasses.dataclass
class Report:
    failures: list[str] = dataclasses.field(default_factory=list)
    tests: int = 0
    draws: int = 0
    worst_p: float = 1.0
    worst_tv: float = 0.0
    greedy: int = 0
    degenerate: int = 0
    invariance: int = 0
    independence: int = 0
    prob_checks: int = 0

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        print("FAIL", msg, flush=True)


def describe(sub: Sub) -> str:
    p = sub.params
    return (f"V={sub.logits.numel()} T={p.temperature} top_k={p.top_k} top_p={p.top_p} min_p={p.min_p} "
            f"pres={p.presence_penalty} freq={p.frequency_penalty} rep={p.repetition_penalty} bias={p.logit_bias} "
            f"hist={len(sub.history)} prompt={len(sub.prompt)} mask={sub.allowed is not None} ban={len(sub.banned)}")


def check_draws(report: Report, where: str, sub: Sub, tokens: torch.Tensor, level: float) -> None:
    V = sub.logits.numel()
    t = sub.target
    if bool(((tokens < 0) | (tokens >= V)).any()):
        report.fail(f"{where}: token out of range {tokens.unique().tolist()[:5]}: {describe(sub)}")
        return
    if t.probs is None:
        report.degenerate += 1
        if tokens.unique().numel() != 1:
            report.fail(f"{where}: a row with nothing to sample drew varying tokens: {describe(sub)}")
        return
    counts = torch.bincount(tokens, minlength=V)
    zero = (t.probs == 0) & (counts > 0)
    if bool(zero.any()):
        ids = zero.nonzero()[:, 0].tolist()
        report.fail(f"{where}: drew zero-probability tokens {ids[:8]} ({int(counts[zero].sum())} of "
                    f"{tokens.numel()} draws): {describe(sub)}")
    if t.greedy:
        report.greedy += 1
        return
    report.tests += 1
    report.draws += tokens.numel()
    pval, df, tv = chi_square(counts, t.probs)
    report.worst_p = min(report.worst_p, pval)
    report.worst_tv = max(report.worst_tv, tv)
    if pval < level:
        top = torch.argsort(t.probs, descending=True)[:6].tolist()
        report.fail(f"{where}: chi-square p={pval:.2e} (df {df}) tv={tv:.4f}: {describe(sub)}; "
                    f"want {[round(float(t.probs[i]), 4) for i in top]} got "
                    f"{[round(float(counts[i]) / tokens.numel(), 4) for i in top]} (ids {top})")


def check_probs(report: Report, subs: list[Sub], logits: torch.Tensor, rows: list[bs.Row],
                owner: torch.Tensor) -> None:
    """`batch_sampler.candidates` of each sub-case's first row, all in one batch, against the reference (1e-5)."""
    first = [int((owner == s).nonzero()[0]) for s in range(len(subs))]
    batch = [dataclasses.replace(rows[i], history=list(rows[i].history), slot=None) for i in first]
    probs = bs.candidates(bs.adjusted_logits(logits[first], batch), batch)
    for sub, got in zip(subs, probs):
        t = sub.target
        if t.probs is not None and not t.greedy:
            report.prob_checks += 1
            err = float((got.double() - t.probs).abs().max())
            if not err < 1e-5:
                report.fail(f"candidates: probabilities off the reference by {err:.2e}: {describe(sub)}")


def check_invariance(report: Report, logits: torch.Tensor, rows: list[bs.Row], whole: torch.Tensor,
                     rng: random.Random) -> None:
    """The same (seed, position) draws the same token alone, reversed, beside path-switching rows and from
    histories instead of per-slot counts."""
    pick = rng.sample(range(len(rows)), min(40, len(rows)))
    free = SamplingParams(temperature=0.9, top_p=0.7).with_defaults({})          # no top-k, a top-p: the sort
    V = logits.shape[1]
    extra_rows = [bs.Row(free, 5, 5, []), bs.Row(SamplingParams(temperature=1.0).with_defaults({}), 6, 6, [])]
    sub_rows = [dataclasses.replace(rows[i], history=list(rows[i].history), slot=None) for i in pick]
    want = whole[pick]
    variants = {
        "alone": [int(bs.sample_rows(logits[i:i + 1], sub_rows[j:j + 1])[0]) for j, i in enumerate(pick[:10])],
        "reversed": bs.sample_rows(logits[pick[::-1]], sub_rows[::-1]).flip(0).tolist(),
        "beside sort": bs.sample_rows(torch.cat([logits[pick], torch.randn(2, V)]), sub_rows + extra_rows)
        .tolist()[: len(pick)],
    }
    for name, got in variants.items():
        report.invariance += 1
        ref = want.tolist()[: len(got)]
        if got != ref:
            bad = [j for j, (a, b) in enumerate(zip(got, ref)) if a != b]
            r = sub_rows[bad[0]]
            report.fail(f"invariance ({name}): {len(bad)} of {len(got)} rows drew another token, e.g. "
                        f"{got[bad[0]]} vs {ref[bad[0]]} for T={r.params.temperature} top_k={r.params.top_k} "
                        f"top_p={r.params.top_p} min_p={r.params.min_p} V={V}")


def check_logprobs(report: Report, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    idx = torch.arange(0, logits.shape[0], max(1, logits.shape[0] // 64))
    raw, tok = logits[idx], tokens[idx]
    top = min(5, raw.shape[1])
    lp, vals, ids = bs.row_logprobs(raw, tok, top)
    ref = torch.log_softmax(raw.double(), dim=-1)
    want = ref.gather(1, tok[:, None])[:, 0]
    ok = torch.isclose(lp.double(), want, atol=1e-4, rtol=0) | (torch.isinf(want) & (lp.double() == want))
    ref_top = torch.topk(ref, top, dim=-1).values
    ok_top = torch.isclose(vals.double(), ref_top, atol=1e-4, rtol=0) | (vals.double() == ref_top)
    ok_ids = torch.isclose(ref.gather(1, ids), vals.double(), atol=1e-4, rtol=0) | (ref.gather(1, ids) == vals.double())
    if not (bool(ok.all()) and bool(ok_top.all()) and bool(ok_ids.all())):
        report.fail(f"logprobs: not log_softmax of the raw logits (max err {float((lp.double() - want).abs().max())})")


def check_independence(report: Report, rng: random.Random, n: int, level: float) -> None:
    """Draws at adjacent seeds (n choices of one request: seed + j) and at adjacent positions of one seed are
    independent: chi-square of the 8 x 8 table of non-overlapping pairs, on the plain (logit) and the filtered
    (probability) race."""
    from scipy.stats import chi2_contingency
    V = 8
    logits = (torch.randn(V, generator=torch.Generator().manual_seed(rng.getrandbits(31))) * 0.5)[None]
    seed = rng.getrandbits(64) - 2 ** 63
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=7, top_p=0.99)):
        params = params.with_defaults({})
        for name, rows in (("seed, seed + 1", [bs.Row(params, seed + i, 11, []) for i in range(2 * n)]),
                           ("position, position + 1", [bs.Row(params, seed, i, []) for i in range(2 * n)])):
            tokens = bs.sample_rows(logits.expand(len(rows), V), rows).view(n, 2)
            table = torch.zeros(V, V, dtype=torch.long)
            table.index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(n, dtype=torch.long), accumulate=True)
            table = table[table.sum(1) > 0][:, table.sum(0) > 0]
            pval = float(chi2_contingency(table.numpy())[1])
            report.independence += 1
            report.worst_p = min(report.worst_p, pval)
            if pval < level:
                report.fail(f"independence ({name}, top_k={params.top_k}): p={pval:.2e}")


def check_big_vocab(report: Report, rng: random.Random, n: int, level: float, vocab: int = 151936) -> None:
    """A real vocabulary's width: the hash of large token ids, and the filters over 152k columns (draws in chunks)."""
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    logits = (torch.randn(vocab, generator=g) * rng.choice([1.0, 3.0])).bfloat16().float()
    if rng.random() < 0.5:               # a few live ids spread over the range, the top ids among them
        live = torch.cat([torch.randint(vocab, (30,), generator=g), torch.tensor([vocab - 1, vocab - 2])])
        logits = torch.full((vocab,), -math.inf).index_copy(0, live, logits[live])
    while True:
        params = dataclasses.replace(random_params(rng, 50), logit_bias={vocab - 1: 3.0})
        if params.temperature >= EPS_T and params.top_k != 1:
            break
    target = reference(logits, params, [], [], None, [])
    if target.fragile:
        return
    sub = Sub(logits, params, [], [], None, [], target, seed=rng.getrandbits(64) - 2 ** 63)
    n = min(n, 2000)                     # [n, 152k] float temporaries: about a minute a sub-case on 2 cores
    rows = rows_of(sub, n, False)
    tokens = torch.cat([bs.sample_rows(logits.expand(len(part), vocab), part)
                        for part in (rows[i:i + 250] for i in range(0, n, 250))])
    check_draws(report, "big vocabulary", sub, tokens, level)


def run_batch(report: Report, rng: random.Random, n: int, level: float, rowwise: bool) -> None:
    V = rng.choice([5, 6, 9, 17, 40, 64, 128, 300, rng.randint(5, 300)])
    subs = [random_sub(rng, V) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.15:
        subs.append(random_sub(rng, V, degenerate=True))
    counted = rng.random() < 0.5
    for s, sub in enumerate(subs):
        sub.slot = s
    rows, logits, owner = [], [], []
    for s, sub in enumerate(subs):
        rows += rows_of(sub, n, counted)
        logits.append(sub.logits.expand(n, V))
        owner += [s] * n
    order = list(range(len(rows)))
    rng.shuffle(order)
    rows = [rows[i] for i in order]
    owner_t = torch.tensor(owner)[order]
    logits_t = torch.cat(logits)[order].contiguous()
    counts = None
    if counted:
        counts = bs.TokenCounts(len(subs), V, "cpu")
        for sub in subs:
            counts.reset(sub.slot, sub.prompt, sub.history)
    try:
        tokens = bs.sample_rows(logits_t, rows, counts, race_kernel=KERNEL)
    except Exception as exc:     # noqa: BLE001 - a batch must never fail as a whole
        report.fail(f"sample_rows raised {type(exc).__name__}: {exc}: {[describe(s) for s in subs]}")
        return
    for s, sub in enumerate(subs):
        check_draws(report, "batched" + (" counted" if counted else ""), sub, tokens[owner_t == s], level)
    check_probs(report, subs, logits_t, rows, owner_t)
    check_invariance(report, logits_t, rows, tokens, rng)
    check_logprobs(report, logits_t, tokens)
    if rowwise:
        sub = subs[0]
        m = min(n, 2000)
        drawn = []
        for r in rows_of(sub, m, False)[:m]:
            x = sampler.apply_logit_bias(sub.logits, sub.params.logit_bias)
            x = apply_mask(sampler.apply_ban(sampler.apply_penalties(x, sub.params, r.history, r.prompt_ids),
                                             r.banned), r.allowed)
            try:
                drawn.append(sampler.sample(x, sub.params, sampler.position_generator(r.seed, r.position)))
            except Exception as exc:  # noqa: BLE001 - the runner turns this into the request's error
                if sub.target.probs is not None:
                    report.fail(f"per-row sampler raised {type(exc).__name__}: {exc}: {describe(sub)}")
                return
        check_draws(report, "per-row", sub, torch.tensor(drawn), level)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--draws", type=int, default=4000, help="draws per sub-case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=1e-3, help="family-wise false-alarm rate")
    ap.add_argument("--rowwise", action="store_true", help="also draw sub-cases through the per-row sampler")
    ap.add_argument("--big", type=int, default=2, help="sub-cases over a 151,936-token vocabulary")
    ap.add_argument("--kernel", action="store_true", help="the batches' draws through the `sample_race` Triton kernel "
                    "(interpreted on the CPU: slow, use few batches and draws)")
    args = ap.parse_args()
    bs.INTERPRET_ON_CPU = args.kernel
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    # Bonferroni over an upper bound of the tests this run can make (5 sub-cases a batch, + per-row, the big
    # vocabulary's, 4 independence tables every 10 batches).
    level = args.alpha / (args.batches * (6 if args.rowwise else 5) + args.big + 4 * (args.batches // 10 + 1))
    report = Report()
    start = time.time()
    for b in range(args.batches):
        run_batch(report, rng, args.draws, level, args.rowwise)
        if b % 10 == 0:
            check_independence(report, rng, args.draws, level)
        if (b + 1) % 10 == 0:
            print(f"{b + 1} batches, {report.tests} chi-square tests, {len(report.failures)} failures, "
                  f"{time.time() - start:.0f} s", flush=True)
    for _ in range(args.big):
        check_big_vocab(report, rng, args.draws, level)
    print(f"\n{report.tests} chi-square tests over {report.draws} draws (level {level:.1e} each, family {args.alpha}); "
          f"worst p {report.worst_p:.2e}, worst TV {report.worst_tv:.4f}; {report.greedy} greedy and "
          f"{report.degenerate} nothing-to-sample sub-cases; {report.invariance} invariance checks; "
          f"{report.independence} independence tables; {report.prob_checks} probability vectors checked to 1e-5; "
          f"{len(report.failures)} failures")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
