"""The last stage's sampling of a step's logits: one token per sampling entry (batched on the device, or row by row
on the host), the logprobs asked for, and prompt logprobs (echo). Apart from `StageRunner` because it needs only the
step's plan, its logits and its requests' sampling state, not how the step was launched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from shared.cluster_config import ClusterConfig
from shared.protocol import Plan, PromptLogprobs, SamplingSpec, TokenOut
from shared.sampling import SamplingParams
from shared.token_mask import apply_mask
from stage_worker.batch_sampler import Row, TokenCounts, row_logprobs, sample_rows, uses_penalties
from stage_worker.host_copy import to_device, to_host
from stage_worker.model.batch import StepBatch
from stage_worker.profiling import phase
from stage_worker.sampler import (apply_ban, apply_logit_bias, apply_penalties, position_generator, sample,
                                  token_logprobs)


log = logging.getLogger("moepipe.stage")

# Prompt logprobs (echo) take the log-softmax of this many rows at a time (`StepSampler.sample`).
ECHO_ROWS = 256


@dataclass
class ReqState:
    """A request's sampling state on the last stage, from its admission (`Plan.new_requests`) to its end."""
    spec: SamplingSpec
    params: SamplingParams
    history: list[int] = field(default_factory=list)
    counted_slot: int | None = None     # the TokenCounts row holding this request's counts, once set up

    @classmethod
    def of(cls, spec: SamplingSpec) -> ReqState:
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                min_p=spec.min_p, presence_penalty=spec.presence_penalty,
                                frequency_penalty=spec.frequency_penalty,
                                repetition_penalty=spec.repetition_penalty, seed=spec.seed,
                                logprobs=spec.logprobs, logit_bias=spec.logit_bias,
                                min_tokens=spec.min_tokens)
        return cls(spec, params, list(spec.output_ids))


@dataclass
class HostCopy:
    """A step's sampled tokens (and asked-for logprobs) on their way to the host: queued copies into pinned memory,
    done when `event` is. `device` keeps the tokens on the device, where the next step of a single-stage pipeline
    reads its input ids (launch-ahead)."""
    device: torch.Tensor                    # [R] int64, one row per sampled entry
    tokens: torch.Tensor                    # host [R]
    rows: list[tuple[int, ReqState]]        # (index in the step's TokenOuts, request) of each row
    logprobs: tuple | None = None           # host (picked [W], values [W, top], ids [W, top]) of the `want` rows
    want: list[int] = field(default_factory=list)
    event: object | None = None             # torch.cuda.Event on a GPU; None on the CPU (already there)

    def settle(self, outs: list[TokenOut]) -> None:
        """Wait for the copies, then fill the step's TokenOuts and the requests' histories (call once)."""
        if self.event is not None:
            self.event.synchronize()
        for (i, state), token in zip(self.rows, self.tokens.tolist()):
            state.history.append(token)
            outs[i].token = token
        if self.logprobs is not None:
            lp, vals, ids = (t.tolist() for t in self.logprobs)
            for j, b in enumerate(self.want):
                i, state = self.rows[b]
                k = state.params.logprobs
                outs[i].logprob, outs[i].top_ids, outs[i].top_logprobs = lp[j], ids[j][:k], vals[j][:k]


class StepSampler:
    """The last stage's sampler: a step's TokenOuts from its logits rows, and (device sampling) the penalties' token
    counts per slot, kept across steps."""

    def __init__(self, cluster: ClusterConfig, index: int, race_kernel: Callable[[], bool],
                 settle_launched: Callable[[], None]) -> None:
        self.cluster, self.index = cluster, index
        # read at each step: the stage's model (its kernel flags) may be switched after the runner is built
        self.race_kernel = race_kernel
        # completes every launched step's tokens: paths that read the requests' histories need them all
        self.settle_launched = settle_launched
        self.counts: TokenCounts | None = None    # penalties' token counts per slot (device sampling), on first use

    def sample(self, plan: Plan, batch: StepBatch, logits: torch.Tensor,
               requests: dict[str, ReqState | None]) -> tuple[list[TokenOut], HostCopy | None]:
        """The step's TokenOuts, and the copy that completes them (None: complete already). `requests`: the
        sampling state of the step's requests as its launch saw it (`StageRunner._states`)."""
        with phase("stage.sample"):
            logits = logits.float()
            outs: list[TokenOut] = []
            drawn = []                      # (index in outs, entry, request state, raw logits row) of sampled rows
            row = 0
            echo = any(e.prompt_logprobs for e in plan.entries)     # only then are the fed ids needed on the host
            fed = _split(batch.token_ids.tolist(), [x.num_tokens for x in plan.entries]) if echo \
                else [None] * len(plan.entries)
            for e, toks in zip(plan.entries, fed):
                n_rows = e.num_tokens if e.prompt_logprobs else (1 if e.sample else 0)
                rows = logits[row: row + n_rows]
                row += n_rows
                prompt_lps = None
                if e.prompt_logprobs:
                    targets = toks[1:] + ([e.next_token] if e.next_token is not None else [])
                    st = requests.get(e.req_id)
                    prompt_lps = prompt_logprobs(rows, targets, st.spec.prompt_logprobs if st is not None else 0)
                if not e.sample:
                    outs.append(TokenOut(req_id=e.req_id, position=-1, token=-1, prompt_logprobs=prompt_lps))
                    continue
                state = requests.get(e.req_id)
                if state is None:
                    raise RuntimeError(f"no sampling parameters for request {e.req_id}")
                drawn.append((len(outs), e, state, rows[-1]))
                outs.append(TokenOut(req_id=e.req_id, position=e.context_len + e.num_tokens, token=-1,
                                     prompt_logprobs=prompt_lps))
            if not drawn:
                return outs, None
            if self.cluster.device_sampling:
                try:
                    return outs, self._sample_batched(drawn, outs, None if echo else logits)
                except Exception as exc:   # sample row by row instead: a failure then fails its own request only
                    log.warning("stage %d: batched sampling failed (%s: %s); sampling this step row by row",
                                self.index, type(exc).__name__, exc)
                    for _, _, state, _ in drawn:
                        state.counted_slot = None  # its device counts may have taken the abandoned draw: rebuild
            self.settle_launched()             # the per-row path reads the histories: complete them first
            for i, e, state, raw in drawn:
                try:
                    token = sample_row(raw, state, e.allowed, outs[i].position, _banned(state.spec, outs[i].position))
                    if state.params.logprobs is not None:
                        outs[i].logprob, outs[i].top_ids, outs[i].top_logprobs = token_logprobs(
                            raw, token, state.params.logprobs)
                except Exception as exc:   # one request's parameters must not fail the step's other requests
                    log.warning("stage %d: request %s failed sampling: %s: %s", self.index, e.req_id,
                                type(exc).__name__, exc)
                    outs[i].error = "sampling failed for this request's parameters"   # (the detail: logged above)
                    continue
                state.history.append(token)
                outs[i].token = token
            return outs, None

    def _sample_batched(self, drawn: list, outs: list[TokenOut], logits: torch.Tensor | None) -> HostCopy:
        """All of a step's rows on the device: penalties from per-slot token counts; the tokens (and the logprobs,
        when asked) leave for the host by queued copies, which `StageRunner.finish` waits for."""
        # `logits` (no entry echoes its prompt): one row per sampling entry, in order, so no stack to copy them.
        raw = logits if logits is not None else torch.stack([r for *_, r in drawn])
        if self.counts is None and any(uses_penalties(st.params) for _, _, st, _ in drawn):
            self.counts = TokenCounts(self.cluster.max_num_seqs + 1, raw.shape[-1], raw.device)
        specs = []
        for i, e, st, _ in drawn:
            if self.counts is not None and uses_penalties(st.params) and st.counted_slot != e.slot:
                self.settle_launched()              # the counts start from the whole history: complete it first
                self.counts.reset(e.slot, st.spec.prompt_ids, st.history)   # first sample here, or after preemption
                st.counted_slot = e.slot
            specs.append(Row(st.params, st.params.seed or 0, outs[i].position, st.history, st.spec.prompt_ids,
                             e.allowed, slot=e.slot if self.counts is not None else None,
                             banned=_banned(st.spec, outs[i].position)))
        sampled = sample_rows(raw, specs, self.counts, race_kernel=self.race_kernel())
        copy = HostCopy(device=sampled, tokens=to_host(sampled), rows=[(i, st) for i, _, st, _ in drawn])
        want = [b for b, (_, _, st, _) in enumerate(drawn) if st.params.logprobs is not None]
        if want:
            top = max(drawn[b][2].params.logprobs for b in want)
            idx = to_device(want, torch.long, raw.device)
            copy.logprobs = tuple(to_host(t) for t in row_logprobs(raw[idx], sampled[idx], top))
            copy.want = want
        if raw.is_cuda:
            copy.event = torch.cuda.Event()
            copy.event.record()
        return copy


def sample_row(raw: torch.Tensor, state: ReqState, allowed: bytes | None, position: int,
               banned: list[int] | None = None) -> int:
    """The per-row path (`device_sampling` off): bias, penalties, min_tokens' ban, mask, then a CPU generator's
    draw."""
    biased = apply_logit_bias(raw, state.params.logit_bias)     # the grammar mask still wins over a bias
    penalised = apply_ban(apply_penalties(biased, state.params, state.history, state.spec.prompt_ids), banned)
    adjusted = apply_mask(penalised, allowed)
    return sample(adjusted, state.params, position_generator(state.params.seed or 0, position))


def _banned(spec: SamplingSpec, position: int) -> list[int] | None:
    """The ids the token at `position` may not be: min_tokens' stop ids while fewer than min_tokens are generated
    (the prompt is positions 0 .. len - 1; a preempted request keeps its positions)."""
    if spec.min_tokens and position - len(spec.prompt_ids) < spec.min_tokens:
        return spec.min_tokens_ban
    return None


def prompt_logprobs(rows: torch.Tensor, targets: list[int], top: int) -> PromptLogprobs:
    """Row i of `rows` (raw logits, one per fed token) scores `targets[i]`, the prompt token after it: its logprob
    and rank under the fp32 log_softmax, and the `top` most likely tokens (rows past the targets are not read)."""
    n = len(targets)
    k = min(max(top, 0), rows.shape[-1])
    if n == 0:
        return PromptLogprobs(top=k)
    idx = torch.tensor(targets, dtype=torch.long, device=rows.device)[:, None]
    picked, ranks, vals, ids = [], [], [], []
    # a slice of rows at a time: the log-softmax of a whole 2048-token chunk would be another [tokens, vocab] fp32
    # tensor beside the logits (1.2 GB at the full shape), which the plan's reserve does not hold; rows are
    # independent, so the values are the same
    for a in range(0, n, ECHO_ROWS):
        b = min(n, a + ECHO_ROWS)
        lp = torch.log_softmax(rows[a:b].float(), dim=-1)
        p = lp.gather(1, idx[a:b])
        picked.append(p[:, 0])
        ranks.append((lp >= p).sum(dim=-1, dtype=torch.int32))   # vLLM's rank: ties count against the token
        if k:
            v, i = torch.topk(lp, k, dim=-1)
            vals.append(v)
            ids.append(i.to(torch.int32))
    out = [torch.cat(picked), torch.cat(ranks)]
    if k:
        out += [torch.cat(vals), torch.cat(ids)]
    host = [t.cpu().numpy() for t in out]          # one read-back of each, not one a token
    if not k:
        host += [np.zeros((n, 0)), np.zeros((n, 0))]
    return PromptLogprobs.build(host[0], host[1], host[3], host[2])


def _split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(ids[start:start + n])
        start += n
    return out
