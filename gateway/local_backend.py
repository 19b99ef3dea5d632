"""`Engine` in one process: a worker thread drives `LocalEngine` over a loaded model, one step at a time.

What the API tests run against (a single-process backend; `moepipe serve` always starts stage processes). Requests queue up to `max_waiting`, at most
`max_seqs` run at once; every step feeds each running request either its next prompt chunk or its last sampled token,
so requests are batched continuously (simply: no preemption, no token budget beyond `prefill_chunk` per prompt).
Each request has an asyncio queue; the thread hands events to it with `call_soon_threadsafe`.

Logprobs are `log_softmax` of the RAW logits, before penalties, temperature and top-k/top-p/min-p: the model's own
distribution, which is what vLLM returns by default (`logprobs_mode="raw_logprobs"`) and what stays comparable across
sampling settings. Sampling itself uses `stage_worker.sampler` exactly as `stage_worker.generate` does (a generator
per (seed, position), penalties over prompt + output), so a seeded request reproduces `moepipe generate`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gateway.engine import EngineFailed, EngineOverloaded, EngineUnavailable, GenerationRequest, TokenEvent
from gateway.metrics import Metrics
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine
from stage_worker.model.model import StageModel
from shared.token_mask import apply_mask
from stage_worker.sampler import (apply_logit_bias, apply_penalties, position_generator, random_seed, sample,
                                  token_logprobs)

__all__ = ["LocalBackend"]

log = logging.getLogger("moepipe.local_backend")

COMPONENT = "local_backend"


@dataclass
class _Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq_id: int
    seed: int
    max_new: int
    cancelled: bool = False
    admitted: bool = False
    fed: int = 0                            # prompt tokens already in the cache
    output: list[int] = field(default_factory=list)
    prompt_lps: list[float | None] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt_ids)

    def deliver(self, item: TokenEvent | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                # the consumer's loop is closed: nobody is listening any more
            self.cancelled = True


class LocalBackend:
    """Serves `GenerationRequest`s from one in-process model (all layers, embedding to head)."""

    def __init__(self, model: StageModel | list[StageModel], *, max_model_len: int | None = None, max_seqs: int = 4,
                 max_waiting: int = 64, block_size: int | None = None, prefill_chunk: int = 2048,
                 metrics: Metrics | None = None) -> None:
        stages = model if isinstance(model, list) else [model]
        limit = stages[0].cfg.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        self.max_seqs, self.max_waiting, self.prefill_chunk = max_seqs, max_waiting, prefill_chunk
        self.metrics = metrics
        self._engine = LocalEngine(stages, max_seqs=max_seqs, block_size=block_size, max_tokens=self.max_model_len)
        self._num_blocks = len(self._engine.free_blocks)
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._closed = False
        self._busy, self._window_start = 0.0, time.monotonic()
        self._thread = threading.Thread(target=self._run, name="moepipe-local-backend", daemon=True)
        self._thread.start()

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str = "cpu", **kwargs) -> LocalBackend:
        """Load a checkpoint directory (all layers) and serve it."""
        return cls(load_model(model_dir, LoadOptions(device=device)), **kwargs)

    # ---- Engine ----------------------------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self._closed or not self._thread.is_alive():
            raise EngineUnavailable(COMPONENT)
        if not request.prompt_ids or len(request.prompt_ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in {self.max_model_len}")
        job = _Job(request=request, loop=asyncio.get_running_loop(), queue=asyncio.Queue(), seq_id=next(self._ids),
                   seed=random_seed() if request.params.seed is None else request.params.seed,
                   max_new=min(request.params.max_tokens, self.max_model_len - len(request.prompt_ids)))
        with self._cond:
            if len(self._waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests waiting")
            self._waiting.append(job)
            self._cond.notify()
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            with self._cond:                 # closed early (client gone) or finished: free its slot and blocks now
                job.cancelled = True
                self._cond.notify()

    def health(self) -> list[str]:
        return [] if self._thread.is_alive() and not self._closed else [COMPONENT]

    # ---- introspection and shutdown -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---- worker thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        self._reap()
                        self._admit()
                        self._report()
                        if self._closed:
                            break
                        if not self._running:
                            self._cond.wait(timeout=1.0)
                            continue
                        batch = list(self._running)
                    self._step(batch)
        except Exception:                      # a bug, not a bad request: health() now names this component
            log.exception("local backend worker died")
        finally:
            with self._cond:
                self._closed = True
                for job in self._running:       # started requests fail; queued ones never reached the model
                    job.deliver(EngineFailed(f"{COMPONENT} stopped") if job.output else EngineUnavailable(COMPONENT))
                for job in self._waiting:
                    job.deliver(EngineUnavailable(COMPONENT))

    def _reap(self) -> None:
        """Drop cancelled jobs; release the cache of those that were running. Caller holds the lock."""
        for job in [j for j in self._running if j.cancelled]:
            self._running.remove(job)
            self._engine.release(job.seq_id)
        if any(j.cancelled for j in self._waiting):
            self._waiting = deque(j for j in self._waiting if not j.cancelled)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_seqs:
            job = self._waiting.popleft()
            self._engine.add(job.seq_id)
            job.admitted = True
            self._running.append(job)

    def _step(self, batch: list[_Job]) -> None:
        feeds = []
        for job in batch:
            if job.prefilling:
                tokens = job.request.prompt_ids[job.fed: job.fed + self.prefill_chunk]
            else:
                tokens = [job.output[-1]]
            feeds.append((job.seq_id, tokens))
        all_logits = any(j.prefilling and j.request.prompt_logprobs for j in batch)
        t0 = time.monotonic()
        try:
            logits = self._engine.step(feeds, all_logits=all_logits)
        except Exception as e:             # the step's sequences are in an unknown state: fail them, keep serving
            log.exception("step failed")
            with self._cond:
                for job in batch:
                    job.deliver(EngineFailed(f"{COMPONENT}: {e}"))
                    job.cancelled = True
                self._reap()
            return
        dt = time.monotonic() - t0
        self._busy += dt
        if self.metrics:
            self.metrics.observe_stage_step("0", dt)
        row = 0
        for job, (_, tokens) in zip(batch, feeds):
            n = len(tokens) if all_logits else 1
            rows = logits[row: row + n]
            row += n
            if job.cancelled:
                continue
            if job.prefilling and job.request.prompt_logprobs:
                self._record_prompt_logprobs(job, rows, len(tokens))
            if job.prefilling:
                job.fed += len(tokens)
                if job.prefilling:
                    continue                   # more prompt chunks to go before the first token
            self._sample(job, rows[-1])

    def _record_prompt_logprobs(self, job: _Job, rows: torch.Tensor, n: int) -> None:
        """Row i predicts prompt token fed+i+1; the first prompt token has no logprob (nothing precedes it)."""
        prompt = job.request.prompt_ids
        if job.fed == 0:
            job.prompt_lps.append(None)
        targets = prompt[job.fed + 1: job.fed + n + 1]
        if targets:
            lps = torch.log_softmax(rows[: len(targets)].float(), dim=-1)
            picked = lps.gather(1, torch.tensor(targets, dtype=torch.long, device=lps.device)[:, None])
            job.prompt_lps.extend(picked[:, 0].tolist())

    def _sample(self, job: _Job, logits: torch.Tensor) -> None:
        req, params = job.request, job.request.params
        generator = None if params.greedy else position_generator(job.seed, len(req.prompt_ids) + len(job.output))
        adjusted = apply_penalties(apply_logit_bias(logits, params.logit_bias), params, job.output, req.prompt_ids)
        if req.grammar is not None:
            adjusted = apply_mask(adjusted, req.grammar.mask_bytes())
        tid = sample(adjusted, params, generator)
        job.output.append(tid)
        if req.grammar is not None and not req.grammar.accept(tid):
            job.cancelled = True
            job.deliver(EngineFailed(f"{COMPONENT}: token {tid} was sampled outside the grammar"))
            return
        event = TokenEvent(token_id=tid)
        if params.logprobs is not None:
            event.logprob, ids, values = token_logprobs(logits, tid, params.logprobs)
            if params.logprobs > 0:
                event.top_logprobs = list(zip(ids, values))
        if len(job.output) == 1 and req.prompt_logprobs:
            event.prompt_logprobs = job.prompt_lps
        if tid in req.stop_token_ids or (req.grammar is not None and req.grammar.is_finished()):
            event.finish_reason = "stop"
        elif len(job.output) >= job.max_new:
            event.finish_reason = "length"
        if event.finish_reason is not None:
            job.cancelled = True               # done: the next _reap frees its cache
        job.deliver(event)

    def _report(self) -> None:
        if not self.metrics:
            return
        eng = self._engine
        self.metrics.set_scheduler_state(
            running=len(self._running), waiting=len(self._waiting),
            kv_blocks_used=self._num_blocks - len(eng.free_blocks), kv_blocks_total=self._num_blocks,
            state_slots_used=len(eng.seqs))
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self.metrics.set_stage_busy("0", self._busy / (now - self._window_start))
            self._busy, self._window_start = 0.0, now
