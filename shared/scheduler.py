"""Continuous batching over pipeline micro-batches: admission, chunked prefill, KV blocks and state slots,
preemption by recompute, cancellation.

With N stages there are N micro-batches; each request belongs to one and decodes every N steps, so while stage 1
works on micro-batch 0, stage 0 already runs micro-batch 1 (001 §5.5). A micro-batch gets its next plan when its
previous step's result is back. Pure logic: no sockets, no asyncio, so every policy is unit-testable.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shared.block_manager import BlockManager
from shared.protocol import Plan, SamplingSpec, SeqEntry, TokenOut
from shared.sampling import SamplingParams


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: set[int]
    max_tokens: int
    want_prompt_logprobs: bool = False
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0                  # tokens whose K/V and state are in the caches
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    microbatch: int | None = None
    finished: str | None = None        # finish reason once done
    cancelled: bool = False
    spec_sent: bool = False
    fresh_sample: bool = False         # the newest output was sampled by the stages since the last admission
    preemptions: int = 0
    events: list[TokenOut] = field(default_factory=list)   # results not yet consumed by the API layer
    prompt_logprobs: list[float] = field(default_factory=list)
    grammar: Any = None                # structured output: a gateway.grammar.GrammarState (mask, accept, finished)
    grammar_error: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_done(self) -> bool:
        # Once every known token but the newest sampled one is computed, the request decodes.
        return self.computed >= len(self.all_ids) - (1 if self.output_ids else 0)


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 num_microbatches: int, max_model_len: int, max_queue: int = 256) -> None:
        self.blocks = BlockManager(num_blocks, max_num_seqs)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_microbatches = num_microbatches
        self.max_model_len = max_model_len
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.in_flight: dict[int, Plan] = {}                # microbatch -> plan being computed
        # Requests whose per-request state stages must drop. Flushed into the next plan of any micro-batch, so a
        # preempted request's "finished" always reaches the stages before its re-admission's sampling spec.
        self.pending_finished: list[str] = []
        self.num_preemptions = 0
        self._step = itertools.count()
        self._arrivals = itertools.count()

    # ---- admission and cancellation ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise OverflowError("waiting queue is full")
        req.arrival = next(self._arrivals)
        self.waiting.append(req)

    def cancel(self, req_id: str) -> None:
        """Drop a request; its blocks and slot return now unless its micro-batch is computing (then on the result)."""
        for req in list(self.waiting):
            if req.req_id == req_id:
                self.waiting.remove(req)
                req.cancelled = True
                return
        req = self.running.get(req_id)
        if req is None:
            return
        req.cancelled = True
        if req.microbatch not in self.in_flight:
            self.release(req, "cancelled")

    # ---- planning ----------------------------------------------------------------------------------------------
    def idle_microbatches(self) -> list[int]:
        return [m for m in range(self.num_microbatches) if m not in self.in_flight]

    def schedule(self, mb: int) -> Plan | None:
        """The next step of micro-batch `mb`, or None when it has nothing to run."""
        assert mb not in self.in_flight
        budget = self.max_num_batched_tokens
        self._planned: set[str] = set()          # requests already in this plan: never preemption victims
        entries: list[SeqEntry] = []
        new_specs: list[SamplingSpec] = []
        members = sorted((r for r in self.running.values() if r.microbatch == mb), key=lambda r: r.arrival)
        # Decodes first (one token each, latency-critical), then prefill chunks, then admissions.
        for req in [r for r in members if r.prefill_done] + [r for r in members if not r.prefill_done]:
            if budget <= 0:
                break
            if req.req_id not in self.running:
                continue                        # preempted by an earlier entry of this same plan
            entry = self._entry(req, budget, mb)
            if entry is None:
                continue
            entries.append(entry)
            budget -= entry.num_tokens
            if not req.spec_sent:
                new_specs.append(self._spec(req))
        while self.waiting and budget > 0 and self.blocks.free_slots and self._admit_here(mb):
            req = self.waiting[0]
            need = self._blocks_needed(req, min(budget, len(req.all_ids)))
            if not self.blocks.can_allocate(need):
                break
            self.waiting.popleft()
            req.slot = self.blocks.allocate_slot()
            req.microbatch = mb
            self.running[req.req_id] = req
            entry = self._entry(req, budget, mb)
            if entry is None:
                break
            entries.append(entry)
            budget -= entry.num_tokens
            new_specs.append(self._spec(req))
        finished = self.pending_finished
        if not entries and not finished:
            return None
        self.pending_finished = []
        plan = Plan(step=next(self._step), microbatch=mb, entries=entries, new_requests=new_specs, finished=finished)
        if entries:
            self.in_flight[mb] = plan
        return plan

    def _admit_here(self, mb: int) -> bool:
        """Spread requests over micro-batches: admit into `mb` only if it is among the least loaded."""
        loads = [0] * self.num_microbatches
        for r in self.running.values():
            loads[r.microbatch] += 1
        return loads[mb] <= min(loads)

    def _blocks_needed(self, req: Request, tokens: int) -> int:
        total = req.computed + tokens
        return max(0, -(-total // self.block_size) - len(req.blocks))

    def _entry(self, req: Request, budget: int, mb: int) -> SeqEntry | None:
        ids = req.all_ids
        if req.prefill_done:
            # Stage 0 got the newest sampled token straight from the last stage, unless it predates a preemption.
            n, tokens = 1, (None if req.fresh_sample else [ids[-1]])
        else:
            remaining = len(ids) - req.computed - (1 if req.output_ids else 0)
            # After a preemption the newest sampled token is part of what must be recomputed.
            if req.output_ids and req.computed + remaining == len(ids) - 1:
                remaining += 1
            n = min(budget, remaining)
            tokens = ids[req.computed: req.computed + n]
        if not self._reserve(req, n, mb):
            return None
        self._planned.add(req.req_id)
        done_prefill = req.computed + n >= len(ids)
        entry = SeqEntry(req_id=req.req_id, slot=req.slot, context_len=req.computed, num_tokens=n,
                         block_table=list(req.blocks), tokens=tokens, sample=done_prefill or tokens is None,
                         prompt_logprobs=req.want_prompt_logprobs and tokens is not None and not req.output_ids)
        if entry.prompt_logprobs and req.computed + n < len(req.prompt_ids):
            entry.next_token = req.prompt_ids[req.computed + n]
        if entry.sample and req.grammar is not None:
            # No plan-ahead: the request's previous token has been accepted by the grammar before this plan, so
            # the mask matches the state the sampled token will be checked against (002 §8's pitfall).
            entry.allowed = req.grammar.mask_bytes()
        return entry

    def _reserve(self, req: Request, n: int, mb: int) -> bool:
        need = self._blocks_needed(req, n)
        while not self.blocks.can_allocate(need):
            victim = self._victim(mb, exclude=req)
            if victim is None:
                return False
            self._preempt(victim)
        req.blocks.extend(self.blocks.allocate(need))
        return True

    def _victim(self, mb: int, exclude: Request) -> Request | None:
        """The most recently admitted request not in a computing micro-batch (it loses the least work)."""
        cands = [r for r in self.running.values()
                 if r is not exclude and r.microbatch not in self.in_flight and r.blocks
                 and r.req_id not in self._planned]
        return max(cands, key=lambda r: r.arrival) if cands else None

    def _preempt(self, req: Request) -> None:
        """Recompute later: free its blocks and slot, put it first in the queue; outputs so far are kept."""
        self._free(req)
        self.pending_finished.append(req.req_id)
        req.computed, req.microbatch, req.spec_sent, req.fresh_sample = 0, None, False, False
        if not req.output_ids:
            req.prompt_logprobs.clear()          # a prefill cut short is recomputed, prompt logprobs included
        req.preemptions += 1
        self.num_preemptions += 1
        del self.running[req.req_id]
        self.waiting.appendleft(req)

    def _spec(self, req: Request) -> SamplingSpec:
        req.spec_sent = True
        p = req.params
        return SamplingSpec(req_id=req.req_id, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                            min_p=p.min_p, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                            seed=p.seed, logprobs=p.logprobs, prompt_ids=list(req.prompt_ids),
                            output_ids=list(req.output_ids), logit_bias=p.logit_bias)

    # ---- results -----------------------------------------------------------------------------------------------
    def on_result(self, mb: int, tokens: list[TokenOut]) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that got a token (or finished)."""
        plan = self.in_flight.pop(mb)
        by_id = {t.req_id: t for t in tokens}
        touched = []
        for entry in plan.entries:
            req = self.running.get(entry.req_id)
            if req is None:
                continue
            req.computed = entry.context_len + entry.num_tokens
            if req.cancelled:
                self.release(req, "cancelled")
                continue
            out = by_id.get(entry.req_id)
            if out is None:
                continue
            if out.prompt_logprobs:
                req.prompt_logprobs.extend(out.prompt_logprobs)
            if out.token < 0:
                continue
            req.output_ids.append(out.token)
            req.fresh_sample = True
            req.events.append(out)
            touched.append(req)
            if req.grammar is not None and not req.grammar.accept(out.token):
                req.grammar_error = f"token {out.token} was sampled outside the grammar"
                self.release(req, "error")
                continue
            reason = self._finish_reason(req)
            if reason:
                self.release(req, reason)
        return touched

    def _finish_reason(self, req: Request) -> str | None:
        if req.output_ids[-1] in req.stop_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.is_finished():
            return "stop"
        if len(req.output_ids) >= req.max_tokens or len(req.all_ids) >= self.max_model_len:
            return "length"
        return None

    def fail_all(self, reason: str) -> list[Request]:
        failed = list(self.running.values()) + list(self.waiting)
        for req in failed:
            req.finished = reason
            self._free(req)
        self.running.clear()
        self.waiting.clear()
        self.in_flight.clear()
        return failed

    def release(self, req: Request, reason: str) -> None:
        """Finish a request now: its blocks and slot are free, the stages drop its state with the next plan."""
        req.finished = reason
        self._free(req)
        self.running.pop(req.req_id, None)
        self.pending_finished.append(req.req_id)

    def take_finished(self) -> list[str]:
        """The requests whose state the stages must drop, for a plan that carries no entries (a dropped step)."""
        out, self.pending_finished = self.pending_finished, []
        return out

    def _free(self, req: Request) -> None:
        self.blocks.release(req.blocks)
        req.blocks = []
        if req.slot is not None:
            self.blocks.release_slot(req.slot)
            req.slot = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
