"""Continuous batching over pipeline micro-batches: admission, chunked prefill, KV blocks and state slots,
preemption by recompute, cancellation.

With N stages there are N micro-batches; each request belongs to one and decodes every N steps, so while stage 1
works on micro-batch 0, stage 0 already runs micro-batch 1 (001 §5.5).

Plan-ahead (`plan_ahead`, cluster key `async_scheduling`): a micro-batch gets its next plan while its previous one
is still computing, so no stage waits for a round trip to the engine core between two steps. A request whose
in-flight step samples a token decodes that token in the next plan without knowing it: stage 0 takes it from the
last stage's `Sampled`, as for any decode. Not planned ahead: requests with a grammar (the next mask depends on the
token), and requests whose in-flight tokens already reach `max_tokens` or `max_model_len`. A request that finishes
(stop token, cancellation, preemption) while a plan in flight still holds it keeps its blocks and slot until that
plan's result is back, and its id reaches the stages in `finished` only then; the extra token it computed is
dropped. Pure logic: no sockets, no asyncio, so every policy is unit-testable.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shared.block_manager import BlockManager
from shared.prefix_cache import CachedPrefix, PrefixCache, agreeing_blocks
from shared.protocol import HISTORY, PLANS_IN_FLIGHT, Plan, PromptLogprobs, SamplingSpec, SeqEntry, TokenOut
from shared.sampling import SamplingParams


# A waiting prompt sharing this many tokens or more with one in prefill waits for its state there (`_held`): less is
# not worth the wait (a prefill chunk computes a few hundred tokens in one step anyway).
SHARED_HOLD_TOKENS = 256


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: set[int]
    max_tokens: int
    want_prompt_logprobs: bool = False  # return the prompt's logprobs (never served from the prefix cache)
    prompt_top: int = 0                # ... with this many alternatives a position
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
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)   # per prefill chunk, in order
    grammar: Any = None                # structured output: a gateway.grammar.GrammarState (mask, accept, finished)
    error: str | None = None           # why the request failed (grammar violation, a stage's per-request error)
    ahead_fed: int = 0                 # tokens fed by plans in flight (computed once their results are back)
    ahead_samples: int = 0             # tokens plans in flight will sample
    inflight: int = 0                  # plans in flight that hold this request
    sent_blocks: int = 0               # blocks of `blocks` the stages already have (plans carry only new ones)
    restore: CachedPrefix | None = None    # prefix cache: admitted on this entry, its first step not yet back
    snapshots: list[int] = field(default_factory=list)   # prefix cache: positions whose state to save (targets)
    compared: set[str] = field(default_factory=set)      # waiting requests whose prompts this one's was compared to
    cached_tokens: int = 0             # prompt tokens the prefix cache spared (usage's cached_tokens)

    @property
    def num_ids(self) -> int:
        """Prompt and output tokens. Never built as one list: a 250k-token prompt's concatenation costs ~1 ms, and
        each step asked for it several times per request."""
        return len(self.prompt_ids) + len(self.output_ids)

    def ids(self, start: int, end: int) -> list[int]:
        """(prompt_ids + output_ids)[start:end], without concatenating the whole of both."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def next_pos(self) -> int:
        """Where the request's next entry starts: after everything computed and everything plans in flight feed."""
        return self.computed + self.ahead_fed

    @property
    def prefill_done(self) -> bool:
        # Once every known token but the newest sampled one is computed (or on its way), the request decodes.
        return self.ahead_samples > 0 or self.next_pos >= self.num_ids - (1 if self.output_ids else 0)


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 num_microbatches: int, max_model_len: int, max_queue: int = 256, plan_ahead: bool = False,
                 prefix_cache_states: int = 0, prefix_split_tokens: int = 0, skip_cancelled: bool = True) -> None:
        self.blocks = BlockManager(num_blocks, max_num_seqs)
        # Snapshot slots follow the running requests' slots and the stages' scratch slot (shared/prefix_cache.py).
        self.prefix = PrefixCache(self.blocks, block_size, list(range(max_num_seqs + 1,
                                                                      max_num_seqs + 1 + prefix_cache_states))) \
            if prefix_cache_states > 0 else None
        self._snapshots: dict[int, list[tuple[Request, int, int]]] = {}   # step -> (request, length, state)
        self._snapping: list[tuple[Request, int]] = []       # this plan's (request, position) to save
        # A snapshot target is worth an extra prefill step (a chunk cut there) only if it saves this many tokens
        # over the chunk start before it (a block boundary saved instead): 0 on CPU stages, where a step costs only
        # its tokens; ~1024 where a step has a fixed cost (a GPU's launches: 0.1-0.2 s a prefill step at 48 layers).
        self.prefix_split_tokens = prefix_split_tokens
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_microbatches = num_microbatches
        self.max_model_len = max_model_len
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.depth = PLANS_IN_FLIGHT if plan_ahead else 1    # plans in flight per micro-batch
        self.in_flight: dict[int, list[Plan]] = {m: [] for m in range(num_microbatches)}   # oldest first
        self.draining: dict[str, Request] = {}              # finished, but still held by a plan in flight
        # Requests whose per-request state stages must drop. Flushed into the next plan of any micro-batch, so a
        # preempted request's "finished" always reaches the stages before its re-admission's sampling spec.
        self.pending_finished: list[str] = []
        # Requests that ended while a plan in flight still holds them: the stages skip a step of theirs alone
        # instead of computing it (`Plan.cancelled`). Taken by the engine core (`take_cancelled`) and sent at once.
        self.pending_cancelled: list[str] = []
        self.skip_cancelled = skip_cancelled                 # off (`skip_cancelled_steps`): nothing goes there
        self.num_preemptions = 0
        self.num_requeued = 0                                 # running requests recomputed after a component died
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
        self.release(req, "cancelled")          # blocks and slot wait for any plan in flight that holds it

    # ---- planning ----------------------------------------------------------------------------------------------
    def idle_microbatches(self) -> list[int]:
        """Micro-batches that may take another plan now."""
        return [m for m in range(self.num_microbatches) if len(self.in_flight[m]) < self.depth]

    def in_flight_steps(self) -> list[int]:
        return [p.step for plans in self.in_flight.values() for p in plans]

    def oldest_in_flight(self, mb: int) -> Plan | None:
        return self.in_flight[mb][0] if self.in_flight[mb] else None

    def schedule(self, mb: int) -> Plan | None:
        """The next step of micro-batch `mb`, or None when it has nothing to run."""
        assert len(self.in_flight[mb]) < self.depth
        budget = self.max_num_batched_tokens
        self._planned: set[str] = set()          # requests already in this plan: never preemption victims
        self._snapping = []
        if self.prefix is not None and self.waiting and self._lookups:
            self._share_targets()
        entries: list[SeqEntry] = []
        new_specs: list[SamplingSpec] = []
        members = sorted((r for r in self.running.values() if r.microbatch == mb), key=lambda r: r.arrival)
        # Decodes first (one token each, latency-critical), then prefill chunks, then admissions.
        for req in [r for r in members if r.prefill_done] + [r for r in members if not r.prefill_done]:
            if budget <= 0:
                break
            if req.req_id not in self.running:
                continue                        # preempted by an earlier entry of this same plan
            entry = self._entry(req, budget)
            if entry is None:
                continue
            entries.append(entry)
            budget -= entry.num_tokens
            if not req.spec_sent:
                new_specs.append(self._spec(req))
        waiting = 0                                 # index of the next waiting request to look at
        while waiting < len(self.waiting) and budget > 0 and self.blocks.free_slots and self._admit_here(mb):
            req = self.waiting[waiting]
            if self._held(req):
                waiting += 1                        # its prefix is being computed and saved: restore it then
                continue
            if not self._take_prefix(req, budget):
                break
            need = self._blocks_needed(req, min(budget, req.num_ids - req.computed))
            while not self.blocks.can_allocate(need) and self.prefix is not None \
                    and self.prefix.evict_one(for_blocks=True):
                pass
            if not self.blocks.can_allocate(need):
                self._drop_prefix(req)
                break
            del self.waiting[waiting]
            if req.restore is not None:
                req.cached_tokens = max(req.cached_tokens, req.restore.length)
            req.slot = self.blocks.allocate_slot()
            req.microbatch = mb
            self.running[req.req_id] = req
            entry = self._entry(req, budget)
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
        self._take_snapshots(plan)
        if entries:
            self.in_flight[mb].append(plan)
            for e in entries:
                req = self.running[e.req_id]
                req.ahead_fed += e.num_tokens
                req.ahead_samples += 1 if e.sample else 0
                req.inflight += 1
        return plan

    # ---- prefix cache (shared/prefix_cache.py) ------------------------------------------------------------------
    def _take_prefix(self, req: Request, budget: int) -> bool:
        """Admit `req` on the longest cached prefix of its prompt (blocks shared, prefill from there) and choose
        where it saves its own state. False: it should wait for a plan with room for its first chunk (a restoring
        chunk carries two tokens or more). With a step budget of one token no prompt is looked up."""
        if self.prefix is None:
            return True
        if budget < 2 and self._lookups:
            return False
        hit = None if req.want_prompt_logprobs or not self._lookups else \
            self.prefix.match(req.prompt_ids, count=req.preemptions == 0)
        if hit is not None:
            self.blocks.share(hit.blocks)
            hit.users += 1
            req.blocks, req.computed, req.restore, req.sent_blocks = list(hit.blocks), hit.length, hit, 0
        req.snapshots = self.prefix.snapshot_positions(req.prompt_ids, req.computed)
        return True

    def _held(self, req: Request) -> bool:
        """Whether `req` waits for a running request that will save a state its prompt starts with (n > 1 choices,
        one prompt sent twice at once, one system prompt among parallel agents whose parting point is known):
        restoring that state once it is saved beats computing the same prefix side by side, in steps and in time
        (the two would share each step's token budget). Asked again every plan: a producer that is preempted,
        finishes or gives its snapshot up releases it."""
        if self.prefix is None or req.want_prompt_logprobs or not self._lookups:
            return False
        ids = req.prompt_ids
        pending = [(r, pos) for saves in self._snapshots.values() for r, pos, _ in saves] + self._snapping
        for other in self.running.values():
            pending.extend((other, pos) for pos in other.snapshots)
        return any(pos + 2 <= len(ids) and ids[pos - 1] == other.ids(pos - 1, pos)[0]
                   and other.ids(0, pos) == ids[:pos] for other, pos in pending if pos > 0)

    def _share_targets(self) -> None:
        """A running request in prefill whose prompt shares a long first part with a waiting one (one system
        prompt, another conversation) gets a snapshot target where the two part, while it has not passed it: the
        waiting one then waits for that state (`_held`). Each pair is compared once (a block's compare first)."""
        b = self.block_size
        for other in self.running.values():
            start, end = other.next_pos, len(other.prompt_ids)
            if start >= end - 2:
                continue
            for req in self.waiting:
                if req.req_id in other.compared or req.want_prompt_logprobs:
                    continue
                other.compared.add(req.req_id)
                ids = req.prompt_ids
                if other.prompt_ids[:b] != ids[:b]:
                    continue
                shared = agreeing_blocks(ids, other.prompt_ids, b)
                if shared >= max(start, SHARED_HOLD_TOKENS) and shared + 2 <= min(len(ids), end):
                    other.snapshots = sorted(set(other.snapshots) | {shared})

    def _drop_prefix(self, req: Request) -> None:
        """Undo `_take_prefix` for a request that stays in the queue: its lookup counts when it is admitted (each
        plan it waits through looked it up again)."""
        counted = req.preemptions == 0           # (`_take_prefix` counts a first admission only)
        if self.prefix is not None and not req.want_prompt_logprobs and self._lookups and counted:
            self.prefix.queries -= len(req.prompt_ids)
        if req.restore is not None:
            self.prefix.hits -= req.restore.length if counted else 0
            self.blocks.release(req.blocks)
            req.restore.users -= 1
            req.blocks, req.computed, req.restore = [], 0, None
        req.snapshots = []

    def _prefix_chunk(self, req: Request, pos: int, n: int, remaining: int, restoring: bool) -> tuple[int, bool]:
        """A prefill chunk's length with the prefix cache on, and whether to save the state at its start. Chunks
        other than the prefill's last end on block boundaries, so each chunk starts on one. A chunk that reaches the
        request's next snapshot target is cut there when that saves `prefix_split_tokens` or more over its own start
        (the next chunk starts at the target and saves it); else the state at its start is saved instead, if that
        is a block boundary past what was restored."""
        b = self.block_size
        if n < remaining and (pos + n) // b * b - pos >= (2 if restoring else 1):
            n = (pos + n) // b * b - pos
        targets = req.snapshots
        while targets and targets[0] < pos:
            targets.pop(0)                          # passed (a chunk that could not be cut there)
        if not targets or targets[0] >= pos + n:
            return n, False
        x = targets[0]
        if x - pos >= max(self.prefix_split_tokens, 2 if restoring else 1):
            return x - pos, False                   # cut: the next chunk starts at x and saves it
        while targets and targets[0] < pos + n:
            targets.pop(0)
        return n, pos % b == 0 and pos > 0 and not restoring

    def _take_snapshots(self, plan: Plan) -> None:
        """Snapshot slots for the plan's entries whose start is to be saved (none left: not saved); the stages
        copy the states before they run the entries."""
        for req, pos in self._snapping:
            state = self.prefix.reserve_state()
            if state is None:
                continue
            plan.snapshots.append((req.slot, state))
            self._snapshots.setdefault(plan.step, []).append((req, pos, state))
        self._snapping = []

    def _keep_snapshots(self, step: int, tokens: list[TokenOut]) -> None:
        """A step whose snapshots are done on every stage: into the cache (before its requests may be freed). Not
        those of a request that ended before the step came back: the stages may have skipped its steps since
        (`Plan.cancelled`), so the state copied may never have been computed."""
        failed = {t.req_id for t in tokens if t.error}
        for req, length, state in self._snapshots.pop(step, []):
            if req.req_id in failed or req.finished is not None:
                self.prefix.unreserve(state)
            else:
                self.prefix.add(req.ids(0, length), req.blocks[: length // self.block_size], state)

    def _forget_snapshots(self, steps: list[int]) -> None:
        for step in steps:
            for _, _, state in self._snapshots.pop(step, []):
                self.prefix.unreserve(state)

    def _admit_here(self, mb: int) -> bool:
        """Spread requests over micro-batches: admit into `mb` only if it is among the least loaded."""
        loads = [0] * self.num_microbatches
        for r in self.running.values():
            loads[r.microbatch] += 1
        return loads[mb] <= min(loads)

    def _blocks_needed(self, req: Request, tokens: int) -> int:
        total = req.next_pos + tokens
        return max(0, -(-total // self.block_size) - len(req.blocks))

    def _entry(self, req: Request, budget: int) -> SeqEntry | None:
        num_ids = req.num_ids
        pos = req.next_pos
        snap = False
        if req.ahead_samples:
            # Plan-ahead: decode the token a step in flight is sampling (stage 0 gets it from the last stage).
            if not self._can_run_ahead(req):
                return None
            n, tokens = 1, None
        elif req.prefill_done:
            # Stage 0 got the newest sampled token straight from the last stage, unless it predates a preemption.
            n, tokens = 1, (None if req.fresh_sample else req.ids(num_ids - 1, num_ids))
        else:
            remaining = num_ids - pos - (1 if req.output_ids else 0)
            # After a preemption the newest sampled token is part of what must be recomputed.
            if req.output_ids and pos + remaining == num_ids - 1:
                remaining += 1
            n = min(budget, remaining)
            restoring = req.restore is not None and pos == req.restore.length
            if restoring and n < 2:
                return None                         # a restoring step is never decode-shaped (see PrefixCache.match)
            if self.prefix is not None:
                n, snap = self._prefix_chunk(req, pos, n, remaining, restoring)
            tokens = req.ids(pos, pos + n)
        if not self._reserve(req, n):
            return None
        if snap:
            self._snapping.append((req, pos))
        self._planned.add(req.req_id)
        restores = req.restore is not None and pos == req.restore.length
        if pos == 0 or restores:
            # Stages start the block table afresh at such an entry, so it sends every block: a first entry
            # (admission, again after a preemption) and a restoring one planned again after `drop_from` rolled back
            # the plan that carried it (which had sent the blocks already).
            req.sent_blocks = 0
        done_prefill = pos + n >= num_ids
        entry = SeqEntry(req_id=req.req_id, slot=req.slot, context_len=pos, num_tokens=n,
                         new_blocks=req.blocks[req.sent_blocks:], tokens=tokens,
                         sample=done_prefill or tokens is None,
                         prompt_logprobs=req.want_prompt_logprobs and tokens is not None and not req.output_ids)
        if restores:
            entry.restore = req.restore.state
            entry.history = req.ids(max(0, pos - HISTORY), pos)
        req.sent_blocks = len(req.blocks)
        if entry.prompt_logprobs and pos + n < len(req.prompt_ids):
            entry.next_token = req.prompt_ids[pos + n]
        if entry.sample and req.grammar is not None:
            # No plan-ahead: the request's previous token has been accepted by the grammar before this plan, so
            # the mask matches the state the sampled token will be checked against (002 §8's pitfall).
            entry.allowed = req.grammar.mask_bytes()
        return entry

    def _can_run_ahead(self, req: Request) -> bool:
        """The next token of a request whose in-flight step is still sampling may be planned now: no grammar (its
        mask needs that token), and the tokens in flight do not already reach a length limit."""
        if req.grammar is not None or req.cancelled:
            return False
        produced = len(req.output_ids) + req.ahead_samples
        return produced < req.max_tokens and req.num_ids + req.ahead_samples < self.max_model_len

    def _reserve(self, req: Request, n: int) -> bool:
        need = self._blocks_needed(req, n)
        while not self.blocks.can_allocate(need):
            if self.prefix is not None and self.prefix.evict_one(for_blocks=True):
                continue                        # cached prefixes go before any running request
            victim = self._victim(exclude=req)
            if victim is None:
                return False
            self._preempt(victim)
        req.blocks.extend(self.blocks.allocate(need))
        return True

    def _victim(self, exclude: Request) -> Request | None:
        """The most recently admitted request not in a computing micro-batch (it loses the least work), and only
        one that arrived after `exclude`: a request never preempts an older one. It waits instead (its plans drain,
        and the older one takes its blocks). Two requests that the pool cannot hold together, each preempting the
        other whenever the other's micro-batch was not computing, threw each other's prefill away for minutes (two
        prompts of 160 tokens in 12 blocks: 80 s and 641 preemptions, against 1.3 s one after the other)."""
        cands = [r for r in self.running.values()
                 if r is not exclude and r.arrival > exclude.arrival and r.inflight == 0 and r.blocks
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
                            output_ids=list(req.output_ids), logit_bias=p.logit_bias, min_tokens=p.min_tokens,
                            min_tokens_ban=sorted(req.stop_token_ids) if p.min_tokens else [],
                            prompt_logprobs=req.prompt_top if req.want_prompt_logprobs else 0)

    # ---- results -----------------------------------------------------------------------------------------------
    def on_result(self, mb: int, tokens: list[TokenOut]) -> list[Request]:
        """Apply the oldest in-flight step of `mb` (stages run a micro-batch's steps in plan order); returns the
        requests that got a token (or finished)."""
        plan = self.in_flight[mb].pop(0)
        if plan.step in self._snapshots:
            self._keep_snapshots(plan.step, tokens)
        by_id = {t.req_id: t for t in tokens}
        touched = []
        for entry in plan.entries:
            req = self._landed(entry)
            if req is None:
                continue
            if req.finished is not None:
                if req.inflight == 0:          # the last plan that held it is back: free it now
                    self.release(req, req.finished)
                continue                       # a token sampled after the request ended: dropped
            out = by_id.get(entry.req_id)
            if out is None:
                continue
            if out.error:                      # this request alone failed inside the step (the stage logged why)
                req.error = out.error
                req.events.append(out)
                touched.append(req)
                self.release(req, "error")
                continue
            if out.prompt_logprobs:
                req.prompt_logprobs.append(out.prompt_logprobs)
            if out.token < 0:
                continue
            req.output_ids.append(out.token)
            req.fresh_sample = True
            req.events.append(out)
            touched.append(req)
            if req.grammar is not None and not req.grammar.accept(out.token):
                why = getattr(req.grammar, "error", None)       # the matcher's own reason (a parser limit, ...)
                req.error = f"token {out.token} was sampled outside the grammar" + (f": {why}" if why else "")
                self.release(req, "error")
                continue
            reason = self._finish_reason(req)
            if reason:
                self.release(req, reason)
        return touched

    def _landed(self, entry: SeqEntry) -> Request | None:
        """The request of a returned entry, with the entry's tokens moved from 'in flight' to 'computed'."""
        req = self.running.get(entry.req_id) or self.draining.get(entry.req_id)
        if req is None:
            return None
        req.computed = entry.context_len + entry.num_tokens
        if entry.restore is not None and req.restore is not None:
            req.restore.users -= 1             # restored on every stage: the entry may be evicted again
            req.restore = None
        req.ahead_fed -= entry.num_tokens
        req.ahead_samples -= 1 if entry.sample else 0
        req.inflight -= 1
        return req

    def drop_from(self, step: int) -> tuple[list[int], list[Request]]:
        """A stage failed `step`: forget it and every later plan of its micro-batch (a later plan may decode a
        token the failed step never sampled). Returns the dropped steps and the requests of the failed step, now
        finished with "error"; requests only in the later plans are rolled back and planned again."""
        mb = next((m for m, plans in self.in_flight.items() if any(p.step == step for p in plans)), None)
        if mb is None:
            return [], []
        plans = self.in_flight[mb]
        cut = next(i for i, p in enumerate(plans) if p.step == step)
        dropped, self.in_flight[mb] = plans[cut:], plans[:cut]
        if self.prefix is not None:
            self._forget_snapshots([p.step for p in dropped])
        failed: list[Request] = []
        # Prefix cache: entries the failed step restored from may be what failed it (a stage restarted since it
        # saved them refuses them): not restored again.
        suspect = [r.restore for e in dropped[0].entries if e.restore is not None
                   for r in [self.running.get(e.req_id) or self.draining.get(e.req_id)]
                   if r is not None and r.restore is not None]
        for plan in reversed(dropped):         # undo the newest first: next_pos walks back entry by entry
            for e in plan.entries:
                req = self.running.get(e.req_id) or self.draining.get(e.req_id)
                if req is None:
                    continue
                req.ahead_fed -= e.num_tokens
                req.ahead_samples -= 1 if e.sample else 0
                req.inflight -= 1
                if plan is dropped[0] and req not in failed:
                    failed.append(req)
        for req in failed:
            self.release(req, "error")
        for req in list(self.draining.values()):
            if req.inflight == 0:
                self.release(req, req.finished)
        for entry in suspect:
            self.prefix.discard(entry)
        return [p.step for p in dropped], failed

    def _finish_reason(self, req: Request) -> str | None:
        if req.output_ids[-1] in req.stop_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.is_finished():
            return "stop"
        if len(req.output_ids) >= req.max_tokens or req.num_ids >= self.max_model_len:
            return "length"
        return None

    def fail_all(self, reason: str, keep_waiting: bool = False) -> list[Request]:
        """End every running request (and, unless `keep_waiting`, every waiting one) with `reason`; frees all."""
        failed = list(self.running.values()) + ([] if keep_waiting else list(self.waiting))
        for req in failed:
            req.finished = reason
        for req in failed + list(self.draining.values()):
            self._free(req)
            req.inflight = req.ahead_fed = req.ahead_samples = 0
        self.running.clear()
        if not keep_waiting:
            self.waiting.clear()
        self.draining.clear()
        self.pending_cancelled = []
        self._reset_prefix_cache()
        self.in_flight = {m: [] for m in range(self.num_microbatches)}
        return failed

    def forget_cached_states(self) -> None:
        """A component died or came back empty while nothing ran: the prefix cache's snapshots are gone with it."""
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Every plan in flight is lost and a stage may hold empty caches: no snapshot can be trusted."""
        if self.prefix is not None:
            self._forget_snapshots(list(self._snapshots))
            self.prefix.clear()

    def requeue_running(self) -> tuple[list[int], list[Request]]:
        """A component died or came back empty: every plan in flight is lost, and every running request's caches
        with it. Each running request goes back to the head of the queue, in arrival order, to be recomputed from
        its prompt and the tokens it already has (as a preemption: the client's stream just pauses, and seeded
        draws repeat, since they depend only on seed and position); finished requests still held by a plan in
        flight are freed. Returns the forgotten steps and the requeued requests."""
        steps = self.in_flight_steps()
        self.in_flight = {m: [] for m in range(self.num_microbatches)}
        for req in list(self.draining.values()):
            req.inflight = req.ahead_fed = req.ahead_samples = 0
            self.release(req, req.finished)
        moved = sorted(self.running.values(), key=lambda r: r.arrival)
        for req in reversed(moved):
            req.inflight = req.ahead_fed = req.ahead_samples = 0
            self._preempt(req)
            self.num_preemptions -= 1              # not for want of blocks
        self.num_requeued += len(moved)
        self._reset_prefix_cache()
        return steps, moved

    def release(self, req: Request, reason: str) -> None:
        """Finish a request. Its blocks and slot are freed, and the stages told to drop its state with the next
        plan, once no plan in flight holds it; until then it waits in `draining`."""
        req.finished = req.finished or reason
        self.running.pop(req.req_id, None)
        if req.inflight > 0:
            if self.skip_cancelled and req.req_id not in self.draining:
                self.pending_cancelled.append(req.req_id)
            self.draining[req.req_id] = req
            return
        self.draining.pop(req.req_id, None)
        self._free(req)
        self.pending_finished.append(req.req_id)

    def take_finished(self) -> list[str]:
        """The requests whose state the stages must drop, for a plan that carries no entries (a dropped step)."""
        out, self.pending_finished = self.pending_finished, []
        return out

    def take_cancelled(self) -> list[str]:
        """Requests that ended while plans in flight hold them, not yet told to the stages (`Plan.cancelled`): their
        steps in flight compute nothing anyone reads, so a stage that has not started one skips it. Those already
        freed again (their last plan came back meanwhile) are left out: `finished` reaches the stages first."""
        out = [rid for rid in self.pending_cancelled if rid in self.draining]
        self.pending_cancelled = []
        return out

    def _free(self, req: Request) -> None:
        if req.restore is not None:
            req.restore.users -= 1
            req.restore = None
        req.snapshots = []
        self.blocks.release(req.blocks)
        req.blocks = []
        if req.slot is not None:
            self.blocks.release_slot(req.slot)
            req.slot = None

    @property
    def _lookups(self) -> bool:
        """Whether admissions look prompts up: a restoring chunk carries two tokens, so not with a step budget of
        one (that would never admit anything)."""
        return self.max_num_batched_tokens >= 2

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
