"""The PLE service's logic, free of sockets so it can be tested step by step.

Per step it hashes the fed tokens of every sequence (the same n-gram hash as `stage_worker.model.ple`), gathers their
rows from every PLE table into ring slot `step % slots` and answers with `PleReady` (sent to every stage holding a PLE
layer); the stages then never touch the memory-mapped tables inside their forward. A slot is written again only once
every stage has copied its rows out: the last stage's `Sampled` for that step (or a later one) proves it, because
every stage runs its steps in plan order and the last stage runs a step after all the others; a plan whose slot is
still held waits, as does one whose decode tokens have not arrived. Decode entries carry no token: the token sampled
at position `entry.context_len` arrives separately (`Sampled`, from the last stage), so such a plan waits for it.
Prompts, and sampled tokens whose plan has not arrived yet, have their table pages read ahead (`prefetch.py`, by
`MADV_WILLNEED`, `POSIX_FADV_WILLNEED` or a pool of `pread` threads: `ple_prefetch_method`) unless the `ple_prefetch`
switch is off; the service loop never waits for those reads. A decode step's tokens are hashed in one vectorised call per table: per-sequence
calls and read-ahead of rows gathered the next moment made the stages wait for rows 40% of the time at 16 streams
on the H200 (bench/results/served-speed-4).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.cluster_config import ClusterConfig
from shared.model_config import Qwen4ExpConfig
from shared.ngram_hash import context_after, initial_context, ngram_rows_numpy, ngram_rows_numpy_batch
from shared.ple_ring import GatherRing
from shared.ple_table import FlatTable
from shared.protocol import Plan, PleReady, Sampled, SamplingSpec, StageError
from ple_service.prefetch import (STATS, Advisor, FadviseAdvisor, PreadReader, PromptPrefetcher, ReadPool,
                                  make_advisors)
from ple_service.tables import open_tables, ple_specs

log = logging.getLogger(__name__)

__all__ = ["PleService", "PleServiceError"]


class PleServiceError(ValueError):
    """A configuration the PLE service cannot run with (no PLE layers, mixed table dtypes...)."""


class _PlanError(ValueError):
    """A plan the service cannot serve (lost context, oversized step); reported to the gateway as a StageError.
    `stale`: it names a request this process never saw, i.e. it was made before this service (re)started (the
    engine core recomputes the running requests on seeing the new process and ignores the step): logged as a
    warning, not an error."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


@dataclass
class _Request:
    context: np.ndarray           # the last ngram_size - 1 raw token ids fed (the hash's only state)
    length: int                   # tokens fed so far: the context_len the next entry must start at


class PleService:
    """Owns the PLE tables and the gather ring; turns Plans (+ Sampled tokens) into filled ring slots."""

    def __init__(self, model_dir: str | Path, cfg: Qwen4ExpConfig, cluster: ClusterConfig) -> None:
        if not getattr(cfg, "ple_layer_ids", None):
            raise PleServiceError(f"{model_dir}: the model has no PLE layers; run without a PLE service "
                                  "(ple_service = false)")
        self.cfg, self.cluster = cfg, cluster
        self.specs = list(ple_specs(cfg).items())                 # [(0-based layer, spec)] in ring layer order
        self.layers = [layer for layer, _ in self.specs]
        self.tables = open_tables(model_dir, cfg, load_format=cluster.load_format, seed=cluster.seed,
                                  dtype=getattr(torch, cluster.dtype) if cluster.dtype else None,
                                  dummy_file=cluster.dummy_ple_file)
        for layer in self.layers:
            # one row each now, not in the first prompt's time to first token: a dummy table builds its rows on the
            # first gather (h200-21: ~0.4 s of a first request's 1.06 s), a mapped one reads one page
            self.tables[layer].gather(torch.zeros(1, dtype=torch.long))
        dtypes = {self.tables[layer].dtype for layer in self.layers}
        if len(dtypes) != 1:
            raise PleServiceError(f"PLE tables of layers {self.layers} have different dtypes "
                                  f"{sorted(map(str, dtypes))}")
        if not cluster.ple_ring:
            raise PleServiceError("cluster config: ple_ring must name the shared-memory file of the gather ring "
                                  "(e.g. /dev/shm/moepipe-ple.ring)")
        self.ring = GatherRing.create(cluster.ple_ring, slots=cluster.ple_ring_slots,
                                      max_tokens=cluster.max_num_batched_tokens, layers=len(self.layers),
                                      heads=cfg.ple_heads, head_dim=cfg.ple_head_dim, dtype=dtypes.pop())
        try:     # the ring is a file in shared memory: an error (or a stop while loading) must not leave it
            self.advisors: list[Advisor | FadviseAdvisor | PreadReader] = []
            self.read_pool: ReadPool | None = None          # the pread method's reading threads
            self.prefetcher: PromptPrefetcher | None = None
            if cluster.ple_prefetch:
                flat = [self.tables[layer] for layer in self.layers]
                if all(isinstance(t, FlatTable) and t.tensor.numel() for t in flat):   # procedural tables: nothing to read
                    self.advisors, self.read_pool = make_advisors(
                        flat, cluster.ple_prefetch_method, depth=cluster.ple_prefetch_depth)
                    self.prefetcher = PromptPrefetcher(self.advisors, threads=cluster.ple_prefetch_threads)
        except BaseException:
            self.ring.close()
            self.ring.unlink()
            raise
        self._requests: dict[str, _Request] = {}
        self._sampled: dict[str, dict[int, int]] = {}            # req_id -> position -> sampled token
        self._waiting: deque[Plan] = deque()
        self._slot_owner: dict[int, int] = {}      # ring slot -> the step whose rows some stage may still copy
        self._errors: list[StageError] = []
        self.gathers = 0
        self.gather_tokens = 0
        self.gather_seconds = 0.0

    # -- messages --------------------------------------------------------------------------------------------------
    def on_plan(self, plan: Plan) -> list[PleReady]:
        """Start prefetches, then fill the ring slots of the plans that can run now: this one, unless it waits for
        sampled tokens or its slot (or failed: see `take_errors`), and any its `dropped` steps unblocked."""
        if self.prefetcher is not None:
            # At once: no reason to keep reading a dead prompt. Before the new requests, because a request the
            # scheduler preempted and re-admitted in this same plan is in both.
            for req_id in plan.finished:
                self.prefetcher.cancel(req_id)
        restored = {e.req_id: e.context_len for e in plan.entries if e.restore is not None}
        for spec in plan.new_requests:
            self._start_prefetch(spec, restored.get(spec.req_id, 0))
        if plan.dropped:                  # failed steps: no stage will copy their rows, nor wait for them
            dropped = set(plan.dropped)
            self._release(lambda step: step in dropped)
            self._waiting = deque(p for p in self._waiting if p.step not in dropped)
        self._waiting.append(plan)
        return self._drain()

    def on_sampled(self, msg: Sampled) -> list[PleReady]:
        """Record sampled tokens, read their rows' pages ahead, and run every plan they unblock (in order)."""
        fresh: list[tuple[str, int]] = []
        for t in msg.tokens:
            state = self._requests.get(t.req_id)
            if state is None:            # a finished (or unknown) request: nothing will ever read this token
                log.debug("sampled token for unknown request %s ignored", t.req_id)
                continue
            self._sampled.setdefault(t.req_id, {})[int(t.position)] = int(t.token)
            if state.length == t.position:
                fresh.append((t.req_id, int(t.position)))
        # The last stage ran msg.step, so every stage has run (and copied the rows of) every step up to it.
        self._release(lambda step: step <= msg.step)
        ready = self._drain()
        # Read ahead the rows of tokens no plan has consumed yet. With plan-ahead the plan that feeds a token is
        # usually here already and was just served: its rows are read now, and advice would only cost syscalls.
        later = [(self._requests[r], self._sampled[r][p]) for r, p in fresh
                 if r in self._requests and p in self._sampled.get(r, {})]
        if later and self.advisors:
            contexts = np.stack([state.context for state, _ in later])
            tokens = np.array([tok for _, tok in later], dtype=np.int64)
            for (_, spec), advisor in zip(self.specs, self.advisors):       # queued, never waited for
                advisor.advise_rows(ngram_rows_numpy_batch(spec, contexts, tokens)[0].reshape(-1), wait=False)
        return ready

    def take_errors(self) -> list[StageError]:
        """Plans that failed since the last call, as StageErrors for the gateway (so it fails them, not waits)."""
        out, self._errors = self._errors, []
        return out

    # -- state -----------------------------------------------------------------------------------------------------
    def tracked_requests(self) -> set[str]:
        return set(self._requests) | set(self._sampled)

    def waiting_steps(self) -> list[int]:
        return [p.step for p in self._waiting]

    def stats(self) -> dict[str, float]:
        """Numbers for the heartbeat: gather work, prefetch work, and whether madvise is the fallback in use."""
        out = {"gathers": float(self.gathers), "gather_tokens": float(self.gather_tokens),
               "gather_seconds": self.gather_seconds, "waiting_plans": float(len(self._waiting)),
               "requests": float(len(self._requests)), "prefetch_enabled": float(self.prefetcher is not None)}
        totals = dict.fromkeys(STATS, 0.0)
        for a in self.advisors:
            for k, v in a.stats().items():
                totals[k] = max(totals[k], v) if k == "fallback" else totals[k] + v
        out.update({f"prefetch_{k}": v for k, v in totals.items()})
        out["prefetch_queue"] = float(self.prefetcher.pending()) if self.prefetcher else 0.0
        out["prefetch_pread"] = float(self.read_pool is not None)     # 1: ple_prefetch_method = "pread"
        out["prefetch_fadvise"] = float(any(isinstance(a, FadviseAdvisor) for a in self.advisors))
        out["prefetch_read_queue"] = float(self.read_pool.pending()) if self.read_pool else 0.0
        return out

    def close(self, unlink: bool = True) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()
        if self.read_pool is not None:      # before the readers close their files under the pool's threads
            self.read_pool.close()
        for a in self.advisors:
            a.close()
        self.ring.close()
        if unlink:
            self.ring.unlink()
        for t in self.tables.values():
            if hasattr(t, "close"):
                t.close()

    # -- internals -------------------------------------------------------------------------------------------------
    def _start_prefetch(self, spec: SamplingSpec, start: int = 0) -> None:
        """Prefetch the rows of the prompt's tokens from `start` on (a request restored from the prefix cache
        computes nothing before its entry's position)."""
        if self.prefetcher is None or len(spec.prompt_ids) <= start:
            return
        self.prefetcher.submit_prompt(spec.req_id, np.asarray(spec.prompt_ids, dtype=np.int64),
                                      [s for _, s in self.specs], start)

    def _ready_to_run(self, plan: Plan) -> bool:
        """Its slot is free and every decode token is here, or a decode entry's request is one this service holds
        no context for: no token will make that plan servable, so it runs now and fails as a lost context. (A
        restarted service receives the plans queued for it while it was down; stages that gather their own decode
        rows went on decoding meanwhile, and those plans' tokens went to the dead process. Waiting for them would
        block every later plan of the same requests, their recomputation included.)"""
        if plan.entries and self.ring.slot_for_step(plan.step) in self._slot_owner:
            return False                  # its slot still holds rows a stage has not copied
        return all(e.tokens is not None or e.context_len in self._sampled.get(e.req_id, {})
                   or (e.context_len > 0 and e.req_id not in self._requests) for e in plan.entries)

    def _release(self, done) -> None:
        """Free the ring slots of the steps `done(step)` says no stage will read again."""
        for slot in [s for s, step in self._slot_owner.items() if done(step)]:
            del self._slot_owner[slot]

    def busy_slots(self) -> dict[int, int]:
        """Ring slot -> step, for the slots that stages may still be copying from."""
        return dict(self._slot_owner)

    def _drain(self) -> list[PleReady]:
        """Run waiting plans that have their tokens, in arrival order; a plan touching a request of an earlier,
        still-waiting plan waits too (its n-gram context depends on that plan)."""
        done: list[PleReady] = []
        blocked: set[str] = set()
        still: deque[Plan] = deque()
        for plan in self._waiting:
            ids = {e.req_id for e in plan.entries} | set(plan.finished)
            if ids & blocked or not self._ready_to_run(plan):
                blocked |= ids
                still.append(plan)
                continue
            try:
                done.append(self._run(plan))
            except _PlanError as exc:
                (log.warning if exc.stale else log.error)("PLE step %d failed: %s", plan.step, exc)
                self._errors.append(StageError(component="ple", step=plan.step, message=str(exc), pid=os.getpid()))
                for req_id in {e.req_id for e in plan.entries} | set(plan.finished):
                    self._drop(req_id)
        self._waiting = still
        return done

    def _run(self, plan: Plan) -> PleReady:
        total = sum(e.num_tokens for e in plan.entries)
        if total > self.ring.max_tokens:
            raise _PlanError(f"step {plan.step} feeds {total} tokens, the PLE ring holds {self.ring.max_tokens} "
                             "(max_num_batched_tokens)")
        # A plan's `finished` applies before its entries (as on the stages): a request preempted and re-admitted
        # in the same plan starts again from position 0 here.
        for req_id in plan.finished:
            self._forget(req_id)          # its prefetch was cancelled when the plan arrived (on_plan)
        per_entry: list[list[np.ndarray]] = [[] for _ in plan.entries]     # [entry][table] rows
        updates: dict[str, _Request] = {}
        one = []                       # (entry index, context, token) of entries feeding one token: hashed together
        for j, e in enumerate(plan.entries):     # hash everything first: a bad entry leaves no half-updated state
            if e.tokens is None:
                token = self._sampled.get(e.req_id, {}).get(e.context_len)
                if token is None:
                    raise _PlanError(f"request {e.req_id}: step {plan.step} decodes at position {e.context_len}, "
                                     f"and the PLE service has neither its token nor its context (lost n-gram "
                                     f"context)", stale=e.req_id not in self._requests and e.req_id not in updates)
                tokens = np.array([token], dtype=np.int64)
            else:
                tokens = np.asarray(e.tokens, dtype=np.int64)
            if tokens.shape[0] != e.num_tokens:
                raise _PlanError(f"request {e.req_id}: entry says {e.num_tokens} tokens, carries {tokens.shape[0]}")
            state = updates.get(e.req_id) or self._requests.get(e.req_id)
            if e.context_len == 0:
                context = initial_context(self.specs[0][1])
            elif e.restore is not None:          # prefix cache: the request starts after a cached prefix
                try:
                    context = context_after(self.specs[0][1], e.history or [], e.context_len)
                except ValueError as exc:
                    raise _PlanError(f"request {e.req_id}: {exc}") from None
            elif state is not None and state.length == e.context_len:
                context = state.context
            else:
                have = "no tokens" if state is None else f"{state.length} tokens"
                raise _PlanError(f"request {e.req_id}: step {plan.step} feeds from position {e.context_len}, the PLE "
                                 f"service has {have} of it (lost n-gram context)", stale=state is None)
            if e.num_tokens == 1:
                one.append((j, context, tokens[0]))
                continue
            new_context = context
            for _, spec in self.specs:
                r, new_context = ngram_rows_numpy(spec, context, tokens)
                per_entry[j].append(r)
            updates[e.req_id] = _Request(new_context, e.context_len + e.num_tokens)
        if one:                        # a decode step: one vectorised hash per table instead of one per sequence
            contexts = np.stack([c for _, c, _ in one])
            tokens = np.array([t for _, _, t in one], dtype=np.int64)
            for _, spec in self.specs:
                r, new_contexts = ngram_rows_numpy_batch(spec, contexts, tokens)
                for k, (j, _, _) in enumerate(one):
                    per_entry[j].append(r[k:k + 1])
            for k, (j, _, _) in enumerate(one):
                e = plan.entries[j]
                updates[e.req_id] = _Request(new_contexts[k], e.context_len + 1)
        rows = [[per_entry[j][i] for j in range(len(plan.entries))] for i in range(len(self.specs))]

        t0 = time.perf_counter()
        slot_index = self.ring.slot_for_step(plan.step)
        if total:
            self._slot_owner[slot_index] = plan.step
            slot = self.ring.slot(slot_index)
            for i, layer in enumerate(self.layers):
                index = torch.from_numpy(np.concatenate(rows[i]))          # [T, heads], StepBatch token order
                dest = slot[:total, i]
                if dest.is_contiguous():
                    self.tables[layer].gather(index, out=dest)
                else:
                    dest.copy_(self.tables[layer].gather(index))
        self.gather_seconds += time.perf_counter() - t0
        self.gathers += 1
        self.gather_tokens += total

        self._requests.update(updates)
        for e in plan.entries:
            if e.tokens is None:
                pending = self._sampled.get(e.req_id, {})
                for pos in [p for p in pending if p <= e.context_len]:
                    del pending[pos]
                if not pending:
                    self._sampled.pop(e.req_id, None)
        return PleReady(step=plan.step, ring_slot=slot_index, num_tokens=total)

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._sampled.pop(req_id, None)

    def _drop(self, req_id: str) -> None:
        self._forget(req_id)
        if self.prefetcher is not None:
            self.prefetcher.cancel(req_id)
