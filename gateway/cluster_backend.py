"""The `Engine` backed by stage worker processes: runs the scheduler, broadcasts plans over ZeroMQ, turns step
results into token events, and watches heartbeats.

Data flow: plans go to every stage (and the PLE service); activations flow stage to stage; the last stage sends
sampled ids straight to stage 0 and the PLE service, and the same ids with logprobs here for streaming.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from gateway.engine import EngineFailed, EngineOverloaded, EngineUnavailable, GenerationRequest, TokenEvent
from gateway.scheduler import Request, Scheduler
from shared.cluster_config import ClusterConfig, stage_name
from shared.protocol import Heartbeat, Plan, ProtocolError, StageError, StepResult, decode, encode

log = logging.getLogger("moepipe.gateway")


@dataclass
class ComponentState:
    last_seen: float = 0.0
    pid: int = 0
    stats: dict[str, float] = field(default_factory=dict)


class ClusterBackend:
    def __init__(self, cluster: ClusterConfig, max_model_len: int, *, expect_ple: bool) -> None:
        self.cluster = cluster
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(num_blocks=cluster.num_blocks, block_size=cluster.block_size,
                                   max_num_seqs=cluster.max_num_seqs,
                                   max_num_batched_tokens=cluster.max_num_batched_tokens,
                                   num_microbatches=cluster.num_microbatches, max_model_len=max_model_len,
                                   max_queue=cluster.max_queue)
        self.components = [stage_name(i) for i in range(cluster.num_stages)] + (["ple"] if expect_ple else [])
        self.state = {c: ComponentState() for c in self.components}
        self.queues: dict[str, asyncio.Queue] = {}
        self.failed_components: set[str] = set()
        self.stage_overlap_seconds = 0.0
        self._recent: deque[tuple[int, int, float, float]] = deque(maxlen=64)   # (step, stage, start, end)
        self.metrics = None
        self._busy_marks: dict[str, tuple[float, float]] = {}
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.inbox = self._ctx.socket(zmq.PULL)
        self.inbox.bind(self.cluster.gateway_endpoint)
        self.outs = []
        targets = [s.endpoint for s in self.cluster.stages]
        if "ple" in self.components:
            targets.append(self.cluster.ple_endpoint)
        for ep in targets:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.outs.append(s)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watchdog())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self.outs:
            s.close()
        self.inbox.close(linger=0)
        self._ctx.term()

    # ---- Engine ------------------------------------------------------------------------------------------------
    def health(self) -> list[str]:
        now = time.time()
        return [c for c in self.components if now - self.state[c].last_seen > self.cluster.heartbeat_timeout]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        missing = self.health()
        if missing:
            raise EngineUnavailable(f"not serving: no heartbeat from {', '.join(missing)}")
        rid = request.request_id or uuid.uuid4().hex
        req = Request(req_id=rid, prompt_ids=list(request.prompt_ids), params=request.params,
                      stop_token_ids=set(request.stop_token_ids),     # the API already left EOS out for ignore_eos
                      max_tokens=request.params.max_tokens, want_prompt_logprobs=request.prompt_logprobs,
                      grammar=request.grammar)
        if req.params.seed is None:
            from stage_worker.sampler import random_seed

            req.params.seed = random_seed()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            self.scheduler.add(req)
        except OverflowError:
            raise EngineOverloaded(f"{self.scheduler.num_waiting} requests are waiting; try again later") from None
        self.queues[rid] = queue
        await self._kick()
        first = True
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                event: TokenEvent = item
                if first and request.prompt_logprobs:
                    event.prompt_logprobs = [None] + list(req.prompt_logprobs)
                first = False
                yield event
                if event.finish_reason:
                    return
        finally:
            self.queues.pop(rid, None)
            if req.finished is None:
                self.scheduler.cancel(rid)
                if self.metrics is not None:
                    self._push_gauges()
                await self._kick()

    # ---- scheduling --------------------------------------------------------------------------------------------
    async def _kick(self) -> None:
        for mb in self.scheduler.idle_microbatches():
            plan = self.scheduler.schedule(mb)
            if plan is not None:
                await self._broadcast(plan)

    async def _broadcast(self, plan: Plan) -> None:
        frames = encode(plan)
        for s in self.outs:
            await s.send_multipart(frames)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.inbox.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("gateway: dropped a malformed message: %s", exc)
                continue
            try:
                if isinstance(msg, Heartbeat):
                    self._on_heartbeat(msg)
                elif isinstance(msg, StepResult):
                    self._on_result(msg)
                    await self._kick()
                elif isinstance(msg, StageError):
                    await self._on_stage_error(msg)
            except Exception:  # the receive loop must survive anything a message can cause
                log.exception("gateway: failed to handle %s", type(msg).__name__)

    def _on_result(self, msg: StepResult) -> None:
        self._account_timing(msg)
        touched = self.scheduler.on_result(msg.microbatch, msg.tokens)
        for req in touched:
            q = self.queues.get(req.req_id)
            events, req.events = req.events, []
            if q is None:
                continue
            for i, out in enumerate(events):
                last = i == len(events) - 1
                if last and req.finished == "error":
                    q.put_nowait(EngineFailed(req.grammar_error or "generation failed"))
                    break
                top = list(zip(out.top_ids, out.top_logprobs)) if out.top_ids else ([] if out.logprob is not None
                                                                                   else None)
                q.put_nowait(TokenEvent(token_id=out.token, logprob=out.logprob, top_logprobs=top,
                                        finish_reason=req.finished if last else None))

    async def _on_stage_error(self, msg: StageError) -> None:
        log.error("gateway: %s failed step %d: %s", msg.component, msg.step, msg.message)
        for mb, plan in list(self.scheduler.in_flight.items()):
            if plan.step != msg.step:
                continue
            del self.scheduler.in_flight[mb]
            for e in plan.entries:
                req = self.scheduler.running.get(e.req_id)
                if req is not None:
                    self.scheduler._release(req, "error")
                    q = self.queues.get(e.req_id)
                    if q is not None:
                        q.put_nowait(EngineFailed(f"{msg.component} failed: {msg.message}"))
            drop = Plan(step=-1, microbatch=mb, entries=[], dropped=[msg.step],
                        finished=self.scheduler.pending_finished)
            self.scheduler.pending_finished = []
            await self._broadcast(drop)
        await self._kick()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.cluster.heartbeat_interval)
            missing = [c for c in self.health() if self.state[c].last_seen > 0]
            if missing and (self.scheduler.num_running or self.scheduler.num_waiting):
                err = EngineFailed(f"{', '.join(missing)} stopped responding")
                steps = [p.step for p in self.scheduler.in_flight.values()]
                failed = self.scheduler.fail_all("error")
                for req in failed:
                    q = self.queues.get(req.req_id)
                    if q is not None:
                        q.put_nowait(err)
                # Survivors forget the lost steps and requests, so a restarted component finds a clean pipeline.
                await self._broadcast(Plan(step=-1, microbatch=0, entries=[], dropped=steps,
                                           finished=[r.req_id for r in failed]))

    # ---- statistics --------------------------------------------------------------------------------------------
    def _account_timing(self, msg: StepResult) -> None:
        timing = [(t[0], t[1], t[2]) for t in msg.timing]
        for stage, start, end in timing:
            for step, other_stage, s2, e2 in self._recent:
                if other_stage != stage and step != msg.step:
                    self.stage_overlap_seconds += max(0.0, min(end, e2) - max(start, s2))
        for stage, start, end in timing:
            self._recent.append((msg.step, int(stage), start, end))
        if self.metrics is not None:
            for stage, start, end in timing:
                self.metrics.observe_stage_step(int(stage), end - start)
            plan = self.scheduler.in_flight.get(msg.microbatch)
            kind = "decode" if plan is not None and all(e.tokens is None for e in plan.entries) else "prefill"
            for sender, receiver in zip(msg.timing, msg.timing[1:]):
                if len(receiver) > 3:          # [stage, start, end, arrival]
                    self.metrics.observe_transfer(f"{int(sender[0])}->{int(receiver[0])}", kind,
                                                  receiver[3] - sender[2])
            self._push_gauges()

    def attach_metrics(self, metrics) -> None:
        from prometheus_client import Gauge

        self.metrics = metrics
        self._overlap = Gauge("moepipe_stage_overlap_seconds", "Wall time two or more stages computed at once "
                              "(different micro-batches): > 0 shows the pipeline overlapping", registry=metrics.registry)
        self._overlap.set_function(lambda: self.stage_overlap_seconds)
        preempt = Gauge("moepipe_preemptions", "Requests preempted (recomputed later) because KV blocks ran out",
                        registry=metrics.registry)
        preempt.set_function(lambda: self.scheduler.num_preemptions)
        self._push_gauges()

    def _push_gauges(self) -> None:
        pool = self.scheduler.pool
        self.metrics.set_scheduler_state(running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
                                         kv_blocks_used=pool.used_blocks, kv_blocks_total=pool.num_blocks,
                                         state_slots_used=pool.used_slots)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        st = self.state.setdefault(msg.component, ComponentState())
        now = time.time()
        st.last_seen, st.pid, st.stats = now, msg.pid, msg.stats
        if self.metrics is None:
            return
        if msg.component.startswith("stage"):
            busy = msg.stats.get("busy_seconds", 0.0)
            prev = self._busy_marks.get(msg.component)
            if prev is not None and now > prev[0]:
                self.metrics.set_stage_busy(int(msg.component[5:]), (busy - prev[1]) / (now - prev[0]))
            self._busy_marks[msg.component] = (now, busy)
            if "ple_wait_seconds" in msg.stats:
                self.metrics.set_ple_totals(msg.component, stage_wait_seconds=msg.stats["ple_wait_seconds"])
        elif msg.component == "ple":
            self.metrics.set_ple_totals("ple", prefetch_pages=msg.stats.get("prefetch_pages"),
                                        gather_seconds=msg.stats.get("gather_seconds"))
        self._push_gauges()

    def stats(self) -> dict[str, float]:
        pool = self.scheduler.pool
        return {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "kv_blocks_used": pool.used_blocks, "kv_blocks_total": pool.num_blocks,
                "slots_used": pool.used_slots, "stage_overlap_seconds": self.stage_overlap_seconds}
