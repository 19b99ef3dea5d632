"""A step's rows sampled together on the logits' device (issue 14): logit bias, penalties, grammar masks,
temperature, top-k, top-p and min-p as whole-batch tensor operations, and seeded draws without a host generator.

`stage_worker/sampler.py` does the same one row at a time, with a CPU `torch.Generator` per token; this module keeps
its order (bias on the raw logits, penalties, the grammar mask, then temperature and filtering) and its filters'
definitions, so the two agree on every probability (`tests/test_batch_sampler.py`). The draw differs: an exponential
race, token = argmax(p / E) with E = -log(U) ~ Exp(1), which samples exactly from p, and U comes from an integer
hash of (request seed, position, token id) computed on the device. The token therefore still depends only on
(seed, position), whatever else is in the batch and on whichever device or process runs it; preemption and
recompute reproduce it. Switch: cluster key `device_sampling` (`MOEPIPE_DEVICE_SAMPLING`); off, the per-row sampler.
The hash, race, argmax and validity check are `kernels/sample_race_ref.py`; with kernel flag `sample_race` on CUDA
they are one Triton launch (`kernels/sample_race.py`), and plain temperature rows skip the softmax (Gumbel-max).

Penalties read per-slot token counts kept on the device (`TokenCounts`): set once from the prompt and any earlier
output when a request first samples in its slot, then advanced by each step's sampled tokens on the device, so a
step never turns a request's history (a 30k-token agent prompt, for the repetition penalty) into a tensor again.
Logprobs of all rows come out of one `log_softmax` (`row_logprobs`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from shared.sampling import SAMPLING_EPS, SamplingParams
from shared.token_mask import unpack_mask
from stage_worker.host_copy import to_device
from stage_worker.kernels import sample_race_ref

# The draw's hash lives with the race's reference (`kernels/sample_race_ref.py`); the names stay here for callers.
_M32, _mix32, uniforms = sample_race_ref.M32, sample_race_ref.mix32, sample_race_ref.uniforms

# Tests: run the `sample_race` kernel on CPU tensors under TRITON_INTERPRET=1 (on the CPU the reference runs).
INTERPRET_ON_CPU = False


@dataclass
class Row:
    """What one sampled row needs besides its logits."""
    params: SamplingParams
    seed: int
    position: int
    history: list[int]                    # tokens generated so far (presence / frequency / repetition)
    prompt_ids: list[int] | None = None   # repetition penalty also counts the prompt (HF semantics)
    allowed: bytes | None = None          # packed grammar mask (shared/token_mask.py)
    slot: int | None = None               # the request's row in `TokenCounts` (None: count from `history`)
    banned: list[int] | None = None       # ids not sampled at this position (min_tokens: the stop ids)


def uses_penalties(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or (p.repetition_penalty and p.repetition_penalty != 1.0))


class TokenCounts:
    """Per-slot counts of generated tokens and a per-slot 'seen in prompt or output' mask, on the device."""

    def __init__(self, num_slots: int, vocab: int, device) -> None:
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)

    def reset(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A request starts sampling in `slot` (first time, or again after a preemption)."""
        V = self.counts.shape[1]
        dev = self.counts.device
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        out = torch.tensor([t for t in output_ids if 0 <= t < V], dtype=torch.long, device=dev)
        self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        prompt = torch.tensor([t for t in prompt_ids if 0 <= t < V], dtype=torch.long, device=dev)
        self.seen[slot, prompt] = True
        self.seen[slot, out] = True

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each row's sampled token, counted in its slot (device tensors: no host round trip)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.seen[slots, tokens] = True


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of a row's draw: a function of (seed, position) only."""
    h = _mix32(seed & _M32)
    h = _mix32(h ^ ((seed >> 32) & _M32))
    return _mix32(h ^ (position & _M32))


class _Params:
    """Each row's sampling parameters on the device, from one queued copy of one host table (`table` [B, 8] float64:
    a tensor per parameter built from a list made the host wait for the GPU each time). The [B, 1] float32 columns
    and the keys ([B] int64) are converted on first use: plain temperature sampling with the `sample_race` kernel
    reads the table itself and converts nothing."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table          # temperature, top_k, top_p, min_p, frequency, presence, repetition, key

    @classmethod
    def of(cls, rows: list[Row], vocab: int, device) -> "_Params":
        table = [[max(p.temperature or 0.0, SAMPLING_EPS), _top_k(p, vocab), p.top_p if p.top_p is not None else 1.0,
                  p.min_p or 0.0, p.frequency_penalty or 0.0, p.presence_penalty or 0.0, p.repetition_penalty or 1.0,
                  float(row_key(r.seed, r.position))] for r in rows for p in (r.params,)]
        return cls(to_device(table, torch.float64, device))       # float64 holds every 32-bit key exactly

    @functools.cached_property
    def _cols(self) -> torch.Tensor:
        return self.table[:, :7].float()

    temperature = property(lambda self: self._cols[:, 0:1])
    top_k = property(lambda self: self._cols[:, 1:2])
    top_p = property(lambda self: self._cols[:, 2:3])
    min_p = property(lambda self: self._cols[:, 3:4])
    frequency = property(lambda self: self._cols[:, 4:5])
    presence = property(lambda self: self._cols[:, 5:6])
    repetition = property(lambda self: self._cols[:, 6:7])

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        return self.table[:, 7].to(torch.int64)

    def select(self, idx: torch.Tensor) -> "_Params":
        return _Params(self.table[idx])


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if p.top_k and 0 < p.top_k < vocab else vocab


def _pairs(rows: list[Row], picked: list[int], tokens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors of every token `tokens(row)` lists, for the `picked` rows."""
    b_idx = [b for b in picked for _ in tokens(rows[b])]
    t_idx = [t for b in picked for t in tokens(rows[b])]
    return to_device(b_idx, torch.long, device), to_device(t_idx, torch.long, device)


def adjusted_logits(logits: torch.Tensor, rows: list[Row], counts: TokenCounts | None = None,
                    params: _Params | None = None) -> torch.Tensor:
    """[B, V] float32 logits after bias, penalties and masks (the per-row path's `apply_logit_bias`,
    `apply_penalties`, `apply_mask`, batched). With `counts`, penalty rows read their slot's counts instead of their
    `history`. Never writes `logits` (the caller's raw logits give the logprobs)."""
    B, V = logits.shape
    dev = logits.device
    out = logits.float()
    bias = [(b, int(i), float(x)) for b, r in enumerate(rows) for i, x in (r.params.logit_bias or {}).items()
            if 0 <= int(i) < V]
    if bias:
        b_idx, t_idx, vals = zip(*bias)
        out = out.index_put((to_device(b_idx, torch.long, dev), to_device(t_idx, torch.long, dev)),
                            to_device(vals, torch.float32, dev), accumulate=True)
    on_device = counts is not None and all(r.slot is not None for r in rows) and counts.counts.shape[1] == V
    if on_device and any(uses_penalties(r.params) for r in rows):
        params = params or _Params.of(rows, V, dev)
        slots = to_device([r.slot for r in rows], torch.long, dev)
        # Rows without a penalty get neutral weights below, whatever their slot holds. Repetition first (vLLM's order,
        # `sampler.apply_penalties`).
        if any(r.params.repetition_penalty and r.params.repetition_penalty != 1.0 for r in rows):
            rp = params.repetition
            out = torch.where(counts.seen[slots], torch.where(out > 0, out / rp, out * rp), out)
        if any(r.params.presence_penalty or r.params.frequency_penalty for r in rows):
            c = counts.counts[slots].float()
            out = out - params.frequency * c - params.presence * (c > 0)
    else:
        out = _penalties_from_history(out, rows)
    ban = [(b, int(t)) for b, r in enumerate(rows) for t in (r.banned or ()) if 0 <= int(t) < V]
    if ban:
        b_idx, t_idx = zip(*ban)
        out = out.index_put((to_device(b_idx, torch.long, dev), to_device(t_idx, torch.long, dev)),
                            torch.tensor(float("-inf"), device=dev))
    masked = [b for b, r in enumerate(rows) if r.allowed is not None]
    if masked:
        allowed = np.ones((B, V), dtype=bool)
        for b in masked:
            row = unpack_mask(rows[b].allowed, V)
            if row.any():                 # a mask that allows nothing is ignored, as on the per-row path
                allowed[b] = row
        out = out.masked_fill(~to_device(torch.from_numpy(allowed), torch.bool, dev), float("-inf"))
    return out


def _penalties_from_history(out: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Penalties from each row's token lists (rows without a `TokenCounts` slot)."""
    B, V = out.shape
    dev = out.device
    counted = [b for b, r in enumerate(rows) if (r.params.presence_penalty or r.params.frequency_penalty) and r.history]
    repeated = [b for b, r in enumerate(rows) if r.params.repetition_penalty and r.params.repetition_penalty != 1.0
                and (r.history or r.prompt_ids)]
    if not counted and not repeated:
        return out
    params = _Params.of(rows, V, dev)
    if repeated:
        seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        seen[_pairs(rows, repeated, lambda r: r.history + list(r.prompt_ids or []), dev)] = True
        rp = params.repetition
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if counted:
        counts = torch.zeros(B, V, device=dev)
        where = _pairs(rows, counted, lambda r: r.history, dev)
        counts.index_put_(where, torch.ones(len(where[0]), device=dev), accumulate=True)
        out = out - params.frequency * counts - params.presence * (counts > 0)
    return out


def candidates(adjusted: torch.Tensor, rows: list[Row], params: _Params | None = None) -> torch.Tensor:
    """[B, V] probabilities after temperature, min-p, top-k and top-p, as `sampler.filtered_probs` defines them: the
    scaled logits below each row's `_floor` dropped, the rest renormalised."""
    params = params or _Params.of(rows, adjusted.shape[1], adjusted.device)
    scaled = adjusted / params.temperature
    return torch.softmax(scaled.masked_fill(scaled < _floor(scaled, rows, params), float("-inf")), dim=-1)


def _floor(scaled: torch.Tensor, rows: list[Row], params: _Params) -> torch.Tensor:
    """[B, 1]: each row's lowest kept scaled logit after min-p, top-k, then top-p over what those left (vLLM's order:
    min-p first changes top-p's mass; it ran last, so top_p 0.6 over 0.5/0.3/0.2 with min_p 0.5 kept two tokens
    where vLLM keeps one). Every filter keeps a token with all tokens tied with it (top-k:
    everything at least the k-th value, vLLM's rule; top-p: a token whose strictly more likely tokens hold less than
    top_p, so the token crossing top_p stays and so does its whole tie), which makes each a bound on the value: a row's
    candidates never depend on the order a sort or `topk` leaves ties in, so not on the rest of the batch. (The
    candidates were K columns of the batch's top-k, dropping a row's ties with its k-th value past them, and top-p cut
    inside a tie by sort order: with bf16 logits a row drew other tokens beside a row without a top-k.)
    Only top-p needs the distribution in order: the top-k's columns when every row has one (a tie of the k-th value
    past them belongs to a group that starts inside them), else the sorted vocabulary."""
    B, V = scaled.shape
    ninf = float("-inf")
    floor = scaled.new_full((B, 1), ninf)
    if any(r.params.min_p for r in rows):   # p < min_p x max p: below max + log(min_p) (log 0: -inf, no bound)
        floor = scaled.amax(dim=-1, keepdim=True) + params.min_p.log()
    cut = [k for k in (_top_k(r.params, V) for r in rows) if k < V]
    best = None
    if cut:                           # rows without a top-k: their 'k-th' value is -inf
        best = torch.topk(scaled, max(cut), dim=-1).values
        kth = best.gather(1, params.top_k.long().clamp_max(max(cut)) - 1)
        floor = torch.maximum(floor, kth.masked_fill(params.top_k >= V, ninf))
    if any(r.params.top_p is not None and r.params.top_p < 1.0 for r in rows):
        vals = best if len(cut) == B else torch.sort(scaled, dim=-1, descending=True).values
        top = scaled.amax(dim=-1, keepdim=True)
        mass = torch.exp(scaled - top).masked_fill(scaled < floor, 0.0).sum(dim=-1, keepdim=True)
        probs = torch.exp(vals - top).masked_fill(vals < floor, 0.0) / mass
        above = probs.cumsum(dim=-1) - probs
        cols = torch.arange(vals.shape[1], device=vals.device).expand_as(vals)
        first = torch.cat([torch.ones_like(vals[:, :1], dtype=torch.bool), vals[:, 1:] != vals[:, :-1]], dim=1)
        group = torch.where(first, cols, 0).cummax(dim=-1).values      # each column's tie group's first column
        keep = above.gather(1, group) < params.top_p
        lowest = torch.where(keep, vals, float("inf")).amin(dim=-1, keepdim=True)
        floor = torch.maximum(floor, lowest.masked_fill(params.top_p >= 1.0, ninf))
    return floor


def sample_rows(logits: torch.Tensor, rows: list[Row], counts: TokenCounts | None = None, *,
                race_kernel: bool = False) -> torch.Tensor:
    """One token per row, [B] int64 on the logits' device: greedy rows take the first maximal adjusted logit, the
    others race exponentials over their filtered probabilities. With `counts`, the sampled tokens are counted in
    the rows' slots before returning. `race_kernel` (kernel flag `sample_race`): the race in one Triton launch on
    CUDA (two for whole-vocabulary rows; `kernels/sample_race.py`), the same tokens (plain temperature rows: but
    where two scores agree to float rounding). Queues device work only: nothing here waits for the GPU."""
    tokens = _draw(logits, rows, counts, race_kernel)
    if counts is not None:
        pen = [b for b, r in enumerate(rows) if r.slot is not None and uses_penalties(r.params)]
        if pen:
            idx = to_device(pen, torch.long, logits.device)
            slots = to_device([rows[b].slot for b in pen], torch.long, logits.device)
            counts.record(slots, tokens[idx].clamp(0, counts.counts.shape[1] - 1))
    return tokens


def row_logprobs(raw: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Logprob of each row's token and its `top` best, under the raw distribution (as `sampler.token_logprobs`),
    for all rows at once: ([B], [B, top] values, [B, top] ids), on the device."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    picked = lp.gather(1, tokens[:, None].long())[:, 0]
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    else:
        vals, ids = lp[:, :0], torch.zeros(lp.shape[0], 0, dtype=torch.long, device=lp.device)
    return picked, vals, ids


def _plain(p: SamplingParams, vocab: int) -> bool:
    """Plain temperature sampling (the OpenAI default): no top-k, top-p or min-p, so the candidates are the whole
    vocabulary at softmax(logits / temperature)."""
    return _top_k(p, vocab) == vocab and not (p.top_p is not None and p.top_p < 1.0) and not p.min_p


def _race_impl(x: torch.Tensor, race_kernel: bool):
    """The `sample_race` kernel on CUDA tensors when the flag is on (on CPU tensors too under the interpreter where
    a test sets INTERPRET_ON_CPU), else the PyTorch reference. Imported here: the CPU path never imports Triton."""
    if race_kernel and (x.is_cuda or (INTERPRET_ON_CPU and x.device.type == "cpu")):
        from stage_worker.kernels.sample_race import sample_race
        return sample_race
    return sample_race_ref.sample_race


def _draw(logits: torch.Tensor, rows: list[Row], counts: TokenCounts | None,
          race_kernel: bool = False) -> torch.Tensor:
    B, V = logits.shape
    sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
    params = _Params.of(rows, V, logits.device) if sampled or any(uses_penalties(r.params) for r in rows) else None
    adjusted = adjusted_logits(logits, rows, counts, params)
    tokens = adjusted.argmax(dim=-1)
    if not sampled:
        return tokens
    race = _race_impl(logits, race_kernel)
    idx = to_device(sampled, torch.long, logits.device) if len(sampled) < B else None
    sub = [rows[b] for b in sampled] if idx is not None else rows
    # The race writes each sampled row's token over its greedy one, unless the row has nothing to sample (all -inf
    # after masks): then the argmax stands.
    if all(_plain(r.params, V) for r in sub):
        # The whole batch's adjusted logits and table columns (key, temperature), read at the sampled rows: no
        # per-row copies, and with the kernel no softmax (Gumbel-max).
        return race(tokens, adjusted, params.table[:, 7], temperature=params.table[:, 0], rows=idx, gather=True)
    if idx is not None:
        params, adjusted = params.select(idx), adjusted[idx]
    if adjusted.device.type == "cpu" and all(_top_k(r.params, V) < V for r in sub):
        probs, ids = _compact_candidates(adjusted, sub, params)
        return race(tokens, probs, params.keys, ids, rows=idx)
    return race(tokens, candidates(adjusted, sub, params), params.keys, rows=idx)


def _compact_candidates(adjusted: torch.Tensor, rows: list[Row], params: _Params) -> tuple[torch.Tensor, torch.Tensor]:
    """`candidates` as ([B, W] probabilities, [B, W] token ids) over each row's best W logits, W the most candidates
    a row keeps (its top-k and the k-th value's ties): the race then hashes W tokens a row instead of the whole
    vocabulary (the tokens and their probabilities are the same, so is the draw: its uniforms are keyed by token id).
    Reading W back is a sync, free on the CPU only; on a GPU the whole-vocabulary race stays (nothing waits there).
    (CPU, 152k vocabulary, Qwen's defaults: the whole-vocabulary race took 0.7 -> 4.7 ms at one row.)"""
    scaled = adjusted / params.temperature
    floor = _floor(scaled, rows, params)
    width = max(1, int(((scaled >= floor) & (scaled > float("-inf"))).sum(dim=-1).max()))   # masked tokens: none
    vals, ids = torch.topk(scaled, width, dim=-1)
    return torch.softmax(vals.masked_fill(vals < floor, float("-inf")), dim=-1), ids
