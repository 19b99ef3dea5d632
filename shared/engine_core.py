"""The engine core: the one scheduler, block manager and finish rule, driving an executor from its own thread.

Every way of running the model goes through here: `moepipe serve` (the ZeroMQ cluster executor,
`gateway/cluster_executor.py`), tests, `moepipe generate` and benchmarks (the in-process executor,
`stage_worker/inprocess_executor.py`, which runs the same `StageRunner`s in one process). The two differ only in
how a plan reaches the stages and how a step's result comes back.

The core runs on its own thread, as vLLM v1's EngineCore runs in its own process: the HTTP event loop only hands
requests in (`add`, `cancel`, both thread-safe and short) and receives token events through each request's sink,
so tokenizing, detokenizing and JSON never delay a step, and a step's planning (grammar masks included) never
delays an HTTP response.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from shared.protocol import Message, Plan, PromptLogprobs, StageError, StepResult
from shared.sampling import SamplingParams, random_seed
from shared.scheduler import Request, Scheduler

log = logging.getLogger("moepipe.engine")


class EngineUnavailable(RuntimeError):
    """A component is down: new requests fail fast with 503 naming it."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: 429."""


class EngineFailed(RuntimeError):
    """A request in flight could not finish (a stage died or errored): the stream ends with an error."""


class EngineInterrupted(EngineFailed):
    """A request with tokens ended by the server stopping or a component lost, not by the request itself: a stream
    that sent them ends with an error (500, as any EngineFailed), but a non-streamed request, whose client has seen
    nothing, is answered as one refused (503 + Retry-After): sent again it succeeds."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams                 # defaults applied; params.max_tokens is the generation budget
    stop_token_ids: set[int] = field(default_factory=set)
    # the prompt's logprobs (completions' echo, vLLM's prompt_logprobs): None (or False) for none, k >= 0 for every
    # prompt token's logprob and rank given its prefix plus the k most likely tokens there (True: k = 0). Such a
    # request computes its whole prompt: the prefix cache does not serve it.
    prompt_logprobs: int | bool | None = None
    ignore_eos: bool = False
    grammar: Any = None                    # structured output: gateway.grammar.GrammarState, advanced per token


@dataclass
class TokenEvent:
    """One sampled token. The `*_ts` fields are the engine core's `time.monotonic()` stamps, the request phases of
    /metrics (`RequestTimer` in gateway/metrics.py observes them; None from engines that keep no times)."""
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None       # (token id, logprob), best first
    finish_reason: str | None = None       # "stop" (EOS / stop token) or "length" on the last event
    # only on the first event, when asked: rows for prompt positions 1 .. len - 1 (the first token has none)
    prompt_logprobs: PromptLogprobs | None = None
    token_ts: float | None = None          # the step result carrying this token reached the core (the last: finished)
    queued_ts: float | None = None         # first event only: the request entered the core's waiting queue
    scheduled_ts: float | None = None      # first event only: its first plan; preemptions and requeues keep it
    cached_tokens: int | None = None       # first event only: prompt tokens served from the prefix cache


@dataclass
class _Phases:
    """A request's core timestamps until its first token: then they ride on that token's event."""
    queued: float
    scheduled: float | None = None


Sink = Callable[["TokenEvent | Exception"], None]   # called on the core's thread: must not block


class Executor(Protocol):
    """Moves plans to the stages and their results back."""

    def start(self) -> None: ...

    def send(self, plan: Plan) -> None:
        """Hand a plan to every stage (and the PLE service). May run the step before returning (in-process)."""

    def poll(self, timeout: float, wake_fd: int) -> list[Message]:
        """Step results and stage errors that arrived; waits up to `timeout` s for the first, or until `wake_fd`
        is readable (the core has new work)."""

    def health(self) -> list[str]:
        """Components past their heartbeat deadline (empty: healthy)."""

    def down(self) -> list[str]:
        """Of those, the ones not seen running: new requests are refused (503) while one is. One that is only slow
        (its process runs: a starved CPU, a stopped process) makes new requests queue instead, as running ones wait."""

    def lost(self) -> list[str]:
        """Components that were up and stopped answering: the requests in flight cannot finish."""

    def restarted(self) -> list[str]:
        """Components that came back as a new process since the last call (state lost, serving again)."""

    def dump_stacks(self) -> list[str]:
        """Every thread's stack of every component of this host into the logs (a step stalls); returns the
        components asked."""

    def stop(self) -> None: ...


@dataclass
class SchedulerLimits:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_microbatches: int
    max_model_len: int
    max_queue: int = 256
    watchdog_interval: float = 0.5         # how often lost components are looked for
    plan_ahead: bool = True                # a micro-batch's next plan goes out before its step's result is back
    skip_cancelled: bool = True            # requests that end under plans in flight go out as `Plan.cancelled`
    stall_report: float = 0.0              # a step in flight this long (s) is reported with every stack (0: never)
    recovery_timeout: float = 60.0         # running requests wait this long for a dead component to come back
    late_timeout: float = 60.0             # ... and for a late one (its process runs) to heartbeat again
    prefix_cache_states: int = 0           # snapshot slots of the prefix cache (0: off; shared/prefix_cache.py)
    prefix_split_tokens: int = 0           # ... tokens a snapshot must save to cut a prefill chunk for it

    @classmethod
    def from_cluster(cls, cluster, max_model_len: int) -> SchedulerLimits:
        return cls(num_blocks=cluster.num_blocks, block_size=cluster.block_size, max_num_seqs=cluster.max_num_seqs,
                   max_num_batched_tokens=cluster.max_num_batched_tokens,
                   num_microbatches=cluster.num_microbatches, max_model_len=max_model_len,
                   max_queue=cluster.max_queue, watchdog_interval=cluster.heartbeat_interval,
                   plan_ahead=cluster.async_scheduling, skip_cancelled=cluster.skip_cancelled_steps,
                   stall_report=cluster.stall_report_timeout,
                   prefix_cache_states=cluster.prefix_states,
                   prefix_split_tokens=cluster.prefix_split_tokens,
                   # nothing comes back without the launcher's restarts: then a dead component fails its requests
                   recovery_timeout=cluster.recovery_timeout if cluster.restart_limit > 0 else 0.0,
                   # a late one comes back by itself, restarts or not (else, with --restart-limit 0, a stage
                   # starved or stopped past heartbeat_timeout failed every running and queued request)
                   late_timeout=cluster.recovery_timeout)


class EngineCore:
    COMPONENT = "engine_core"

    def __init__(self, executor: Executor, limits: SchedulerLimits) -> None:
        self.executor, self.limits = executor, limits
        self.max_model_len = limits.max_model_len
        self.scheduler = Scheduler(num_blocks=limits.num_blocks, block_size=limits.block_size,
                                   max_num_seqs=limits.max_num_seqs,
                                   max_num_batched_tokens=limits.max_num_batched_tokens,
                                   num_microbatches=limits.num_microbatches, max_model_len=limits.max_model_len,
                                   max_queue=limits.max_queue, plan_ahead=limits.plan_ahead,
                                   skip_cancelled=limits.skip_cancelled,
                                   prefix_cache_states=limits.prefix_cache_states,
                                   prefix_split_tokens=limits.prefix_split_tokens)
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._phases: dict[str, _Phases] = {}   # requests without a token yet: when queued, first scheduled
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moepipe-engine-core", daemon=True)
        self.metrics = None
        self.stage_overlap_seconds = 0.0
        self._recent: list[tuple[int, int, float, float]] = []     # (step, stage, start, end), the last 64
        self._started = False
        self._lost_since: float | None = None    # a component stopped sending heartbeats: scheduling waits
        self._recovered_for: set[str] = set()    # lost components found gone (their requests requeued) meanwhile
        self._closing: str | None = None         # why new requests are refused (`close_requests`)
        self._given_up = False                   # the launcher will not restart a lost component (`give_up`)
        self._sent_at: dict[int, float] = {}     # step -> when its plan went out (the stall report)
        self._reported: set[int] = set()         # steps reported as stalled (once each)

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.executor.start()
        self._started = True
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake()
        if self._started:
            self._thread.join(timeout)
        self.executor.stop()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- the requests' side (any thread) ----------------------------------------------------------------------
    def add(self, request: GenerationRequest, sink: Sink) -> str:
        """Queue a request; its token events (then a finish reason, or an exception) go to `sink`."""
        if self._closing is not None:
            raise EngineUnavailable(self._closing)
        missing = self.executor.down() + ([self.COMPONENT] if self.dead else [])
        if missing:
            raise EngineUnavailable(f"not serving: no heartbeat from {', '.join(missing)}")
        if not request.prompt_ids:
            raise ValueError("the prompt has no tokens")
        if len(request.prompt_ids) > self.max_model_len:
            # Past the context the KV pool (sized for max_model_len) may never hold it: it waited at the head of
            # the queue for blocks forever, and every request behind it too. (The API refuses it before.)
            raise ValueError(f"the prompt has {len(request.prompt_ids)} tokens; the context is {self.max_model_len}")
        rid = request.request_id or uuid.uuid4().hex
        params = request.params
        if params.seed is None:     # drawn here, once: a preempted request recomputes with the same draws
            params.seed = random_seed()
        top = prompt_top(request.prompt_logprobs)
        req = Request(req_id=rid, prompt_ids=list(request.prompt_ids), params=params,
                      stop_token_ids=set(request.stop_token_ids),     # the API already left EOS out for ignore_eos
                      max_tokens=params.max_tokens, want_prompt_logprobs=top is not None, prompt_top=top or 0,
                      grammar=request.grammar)
        with self._lock:
            # (one that ended still has steps in flight until they come back: the stages skip those by its id)
            if rid in self._sinks or rid in self.scheduler.draining:
                raise ValueError(f"request id {rid} is already running")
            try:
                self.scheduler.add(req)
            except OverflowError:
                raise EngineOverloaded(f"{self.scheduler.num_waiting} requests are waiting; try again later") \
                    from None
            self._sinks[rid] = sink
            self._phases[rid] = _Phases(time.monotonic())
        self._wake()
        return rid

    def stream(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """`add` for a synchronous caller (`moepipe generate`, benchmarks): the events as an iterator; leaving it
        early cancels the request."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add(request, events.put)
        done = False
        try:
            while True:
                item = events.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:
                self.cancel(rid)

    def close_requests(self, message: str) -> int:
        """The server is stopping: refuse new requests (503 `message`) and end every running and waiting one with
        an error carrying `message` (a stream's last event, before the connection closes), instead of cutting
        their connections mid-stream. Returns how many were ended."""
        self._closing = message
        with self._lock:
            failed = self.scheduler.fail_all("abort")
            # one without a token yet is answered 503 (+ Retry-After), not a 500
            self._fail(failed, lambda req: EngineInterrupted(message) if req.output_ids else EngineUnavailable(message))
            self._push_gauges()
        self._wake()
        return len(failed)

    def _fail(self, reqs: list[Request], error: Exception | Callable[[Request], Exception]) -> None:
        """Drop each of `reqs` and hand its sink `error` (or `error(req)`) as the request's end."""
        for req in reqs:
            sink = self._drop(req.req_id)
            if sink is not None:
                sink(error if isinstance(error, Exception) else error(req))

    def give_up(self) -> None:
        """The launcher will not restart a dead component (its restarts are used up): the requests waiting for it
        fail at the next watchdog pass instead of after `recovery_timeout`. Any thread (a signal handler)."""
        self._given_up = True
        self._wake()

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone, stop string): its blocks and slot return as soon as no step uses them."""
        with self._lock:
            if self._drop(request_id) is None:
                return
            self.scheduler.cancel(request_id)
            self._push_gauges()
        self._wake()

    def health(self) -> list[str]:
        down = list(self.executor.health())
        if self.dead:
            down.append(self.COMPONENT)
        return down

    @property
    def dead(self) -> bool:
        """The core's thread stopped on a bug (not by `stop`): nothing will run again in this process."""
        return self._started and not self._thread.is_alive() and not self._stopping

    @property
    def closing(self) -> str | None:
        """Why new requests are refused once the server is stopping (`close_requests`), else None."""
        return self._closing

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the core's thread -------------------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):      # the pipe is full (a wake-up is pending anyway) or closed
            pass

    def _run(self) -> None:
        next_watch = time.monotonic() + self.limits.watchdog_interval
        try:
            while not self._stopping:
                if self._lost_since is None:     # nothing goes to a pipeline with a component missing
                    for plan in self._plans():
                        self._send(plan)
                timeout = max(0.0, next_watch - time.monotonic())
                messages = self.executor.poll(timeout, self._wake_r)
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
                drops = []
                with self._lock:
                    for msg in messages:
                        try:
                            if isinstance(msg, StepResult):
                                self._on_result(msg)
                            elif isinstance(msg, StageError):
                                drops.extend(self._on_stage_error(msg))
                        except Exception:   # one message must not stop the core
                            log.exception("engine core: failed to handle %s", type(msg).__name__)
                    back = self.executor.restarted()
                    if back:
                        drops.extend(self._recover(back))
                    if time.monotonic() >= next_watch:
                        next_watch = time.monotonic() + self.limits.watchdog_interval
                        drops.extend(self._watchdog())
                        self._report_stall()
                for plan in drops:
                    self._send(plan)
        except Exception:                   # a bug, not a bad request: health() now names the core
            log.exception("engine core stopped")
            with self._lock:
                self._fail(self.scheduler.fail_all("error"), EngineFailed("the engine core stopped"))

    def _send(self, plan: Plan) -> None:
        """Hand a plan to the executor. One that cannot go out (a value the protocol cannot encode: the fuzzer found
        a top_k of 10^30 that once stopped the core) fails the requests of its step, as a stage's failure would,
        and the core goes on; a plan that only drops steps failing to go out is a bug (the loop's handler)."""
        if plan.step >= 0 and self.limits.stall_report > 0:
            self._sent_at[plan.step] = time.monotonic()
        try:
            self.executor.send(plan)
        except Exception as exc:
            if plan.step < 0:
                raise
            with self._lock:
                drops = self._on_stage_error(StageError(component=self.COMPONENT, step=plan.step,
                                                        message=f"could not send the step's plan: {exc!r}"))
            for p in drops:
                self.executor.send(p)

    def _plans(self) -> list[Plan]:
        """Every plan that can go out now (with plan-ahead, a micro-batch may take two in one call)."""
        plans: list[Plan] = []
        with self._lock:
            while True:
                new = [p for mb in self.scheduler.idle_microbatches() if (p := self.scheduler.schedule(mb))]
                plans += new
                for p in new:           # a request's sampling spec goes out with its (re-)admission's plan
                    for spec in p.new_requests:
                        ph = self._phases.get(spec.req_id)
                        if ph is not None and ph.scheduled is None:   # the first only: preemptions keep it
                            ph.scheduled = time.monotonic()
                if not any(p.entries for p in new):
                    break
            cancelled = self.scheduler.take_cancelled()
            if cancelled:
                # At once, on the first plan going out or on one of its own: a stage that has not started a step of
                # these requests alone skips it, so a cancelled prefill's chunks in flight do not hold the pipeline.
                if plans:
                    plans[0].cancelled.extend(cancelled)
                else:
                    plans.append(Plan(step=-1, microbatch=0, entries=[], cancelled=cancelled))
            if plans and self.metrics is not None:
                self._push_gauges()
        return plans

    def _on_result(self, msg: StepResult) -> None:
        oldest = self.scheduler.oldest_in_flight(msg.microbatch)
        if oldest is None or oldest.step != msg.step:
            # A step forgotten when a component died: its plan reached a stage before the failure was seen. Or
            # the server stopping (`close_requests` dropped the steps in flight): expected then, not worth a warning
            (log.debug if self._closing else log.warning)(
                "engine core: ignored the result of step %d (no longer in flight)", msg.step)
            return
        now = time.monotonic()
        self._account_timing(msg)
        for req in self.scheduler.on_result(msg.microbatch, msg.tokens):
            events, req.events = req.events, []
            sink = self._sinks.get(req.req_id)
            if sink is None:
                continue
            for i, out in enumerate(events):
                last = i == len(events) - 1
                if last and req.finished == "error":
                    sink(EngineFailed(req.error or "generation failed"))
                    break
                top = list(zip(out.top_ids, out.top_logprobs)) if out.top_ids else ([] if out.logprob is not None
                                                                                   else None)
                event = TokenEvent(token_id=out.token, logprob=out.logprob, top_logprobs=top,
                                   finish_reason=req.finished if last else None, token_ts=now)
                if len(req.output_ids) - len(events) + i == 0:      # the request's first token
                    if req.want_prompt_logprobs:
                        event.prompt_logprobs = PromptLogprobs.join(req.prompt_logprobs, req.prompt_top)
                    event.cached_tokens = req.cached_tokens
                    ph = self._phases.pop(req.req_id, None)
                    if ph is not None:
                        event.queued_ts, event.scheduled_ts = ph.queued, ph.scheduled
                sink(event)
            if req.finished is not None:
                self._drop(req.req_id)

    def _on_stage_error(self, msg: StageError) -> list[Plan]:
        """Fail the step's requests; every stage forgets the step's inputs and the requests' state."""
        log.error("engine core: %s failed step %d: %s", msg.component, msg.step, msg.message)
        steps, failed = self.scheduler.drop_from(msg.step)
        if not steps:
            return []
        if failed:      # the client sees which component failed; the log has what happened, and for which requests
            log.error("engine core: step %d failed requests %s", msg.step, ", ".join(r.req_id for r in failed))
        self._fail(failed, EngineFailed(f"{msg.component} failed a step of this request"))
        return [Plan(step=-1, microbatch=0, entries=[], dropped=steps, finished=self.scheduler.take_finished())]

    def _watchdog(self) -> list[Plan]:
        """A component without heartbeats: its requests wait for it, then every request fails. One whose process is
        gone is waited for up to `recovery_timeout` (the launcher restarts it, and they are recomputed; 0: they fail
        at once), one that is only late up to `late_timeout` (it runs again, or `hang_timeout` kills it: gone)."""
        lost = self.executor.lost()
        now = time.monotonic()
        if not lost:
            if self._lost_since is not None:
                # The steps still in flight waited for a late component (they are no longer requeued): their stall
                # clocks start again now, or the first pass found them "in flight though every component
                # heartbeats" for the whole stop and asked every component for its stacks
                self._sent_at = dict.fromkeys(self._sent_at, now)
            self._lost_since = None
            self._recovered_for.clear()
            return []
        if self._lost_since is None:
            self._lost_since = now
            log.warning("engine core: no heartbeat from %s; scheduling waits for it", ", ".join(lost))
        # Only a component whose process is gone has lost the steps in flight and the requests' state. One that
        # is only late (its process runs: a starved CPU, a stopped process) still holds them, and its steps come
        # back when it runs again: its requests just wait. Requeued at once, they recomputed their whole prompt and
        # output (QA: SIGSTOP of a stage for 3 s added 2.4 s of recompute on the demo model; a loaded 2-core machine
        # requeued every running request again at each late heartbeat). A late one killed at `hang_timeout` is gone
        # from the next pass on, and its restart recomputes (`restarted`). With restarts off (recovery_timeout 0) a
        # late one failed every request at once; now only a gone one does.
        gone = [c for c in self.executor.down() if c in lost]
        fresh = [c for c in gone if c not in self._recovered_for]
        if fresh and self.limits.recovery_timeout > 0:
            self._recovered_for.update(fresh)
            return self._recover(fresh)
        limit = self.limits.recovery_timeout if gone else self.limits.late_timeout
        if now - self._lost_since < limit and not self._given_up:
            return []
        return self._fail_all(lost)

    def _report_stall(self) -> None:
        """A step in flight for `stall_report` s while its components heartbeat (a lost one is the watchdog's):
        its plan is logged once, then every stack of this host's components (`Executor.dump_stacks`). Nothing is
        failed: a stage stuck for `stall_timeout` stops heartbeating and is restarted; this only says where the
        pipeline waits (h100-32: four streams stopped at token 253-255 of 256 for 113 s with nothing logged)."""
        limit = self.limits.stall_report
        if limit <= 0:
            return
        plans = {p.step: p for queue in self.scheduler.in_flight.values() for p in queue}
        for step in [s for s in self._sent_at if s not in plans]:
            del self._sent_at[step]
        self._reported &= plans.keys()
        now = time.monotonic()
        stalled = sorted(s for s, t in self._sent_at.items()
                         if now - t > _stall_limit(plans[s], limit) and s not in self._reported)
        if not stalled or self._lost_since is not None:
            return
        self._reported.update(stalled)
        p = plans[stalled[0]]
        log.error("engine core: step %d (micro-batch %d: %d entries, requests %s; %d step(s) in flight) has not come "
                  "back after %.1f s though every component heartbeats (stall_report_timeout, "
                  "MOEPIPE_STALL_REPORT_TIMEOUT). Every thread's stack follows: this process's, then those of the "
                  "components asked", p.step, p.microbatch, len(p.entries),
                  ", ".join(sorted({e.req_id for e in p.entries})) or "none", len(plans), now - self._sent_at[p.step])
        try:
            asked = self.executor.dump_stacks()
        except Exception:       # a report only: a stderr without a file descriptor must not stop the core
            log.exception("engine core: could not dump the stacks")
            return
        log.error("engine core: asked %s for their stacks (SIGUSR2; in their logs)",
                  ", ".join(asked) or "no process (the stages are threads of this one)")

    def _recover(self, components: list[str]) -> list[Plan]:
        """Components died or came back empty: whatever was in flight is lost, and so are the running requests'
        caches. They are recomputed (`Scheduler.requeue_running`), so their streams pause instead of failing."""
        if self.limits.recovery_timeout <= 0:
            return self._fail_all(components, keep_waiting=True)
        steps, moved = self.scheduler.requeue_running()
        if moved:
            log.warning("engine core: %s lost the state of %d running request(s): recomputing them",
                        ", ".join(components), len(moved))
        return [Plan(step=-1, microbatch=0, entries=[], dropped=steps, finished=self.scheduler.take_finished())]

    def _fail_all(self, components: list[str], keep_waiting: bool = False) -> list[Plan]:
        """Fail the running requests (and, unless `keep_waiting`, the queued ones): the components are gone. Steps
        in flight are dropped even when no request is left to fail: finished requests still held by them (draining)
        would otherwise keep their micro-batch busy for good, its plans never coming back."""
        steps = self.scheduler.in_flight_steps()
        if not (self.scheduler.num_running or (self.scheduler.num_waiting and not keep_waiting) or steps):
            self.scheduler.forget_cached_states()   # nothing to fail, but a component back empty lost its snapshots
            return []
        message = f"{', '.join(components)} stopped responding"
        drained = list(self.scheduler.draining)
        failed = self.scheduler.fail_all("error", keep_waiting=keep_waiting)
        # as when the server stops: one without a token yet is answered 503 (+ Retry-After), not a 500
        self._fail(failed, lambda req: EngineInterrupted(message) if req.output_ids else EngineUnavailable(message))
        # Survivors forget the lost steps and requests (the draining ones too: their state would stay on the
        # stages), so a restarted component finds a clean pipeline.
        return [Plan(step=-1, microbatch=0, entries=[], dropped=steps,
                     finished=[r.req_id for r in failed] + drained)]

    def _drop(self, rid: str) -> Sink | None:
        """Forget a request that ended (its sink, and its phase stamps if it had no token yet); returns its sink."""
        self._phases.pop(rid, None)
        return self._sinks.pop(rid, None)

    # ---- metrics -----------------------------------------------------------------------------------------------
    def attach_metrics(self, metrics) -> None:
        """Scheduler gauges, stage step times, activation transfer times and stage overlap (gateway/metrics.py)."""
        from prometheus_client import Gauge

        self.metrics = metrics
        overlap = Gauge("moepipe_stage_overlap_seconds", "Wall time two or more stages computed at once "
                        "(different micro-batches): > 0 shows the pipeline overlapping", registry=metrics.registry)
        overlap.set_function(lambda: self.stage_overlap_seconds)
        preempt = Gauge("moepipe_preemptions", "Requests preempted (recomputed later) because KV blocks ran out",
                        registry=metrics.registry)
        preempt.set_function(lambda: self.scheduler.num_preemptions)
        requeued = Gauge("moepipe_requests_requeued", "Running requests recomputed because a component died or "
                         "restarted under them (their streams paused instead of failing)", registry=metrics.registry)
        requeued.set_function(lambda: self.scheduler.num_requeued)
        prefix = self.scheduler.prefix
        if prefix is not None:
            metrics.registry.register(_PrefixCacheCollector(prefix))
            # Blocks only the prefix cache holds are as good as free (vLLM counts its cached blocks so too). Counted
            # when scraped, not on every step's push (they take a walk over the cached blocks); the pushed value
            # is then not reported.
            blocks = self.scheduler.blocks
            metrics.kv_used.set_function(lambda: blocks.used_blocks - prefix.idle_blocks)
        attach = getattr(self.executor, "attach_metrics", None)
        if attach is not None:
            attach(metrics)
        self._push_gauges()

    def _push_gauges(self) -> None:
        if self.metrics is None:
            return
        b = self.scheduler.blocks
        self.metrics.set_scheduler_state(running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
                                         kv_blocks_used=b.used_blocks, kv_blocks_total=b.num_blocks,
                                         state_slots_used=b.used_slots)

    def _account_timing(self, msg: StepResult) -> None:
        timing = [(int(t[0]), t[1], t[2]) for t in msg.timing]
        for stage, start, end in timing:
            for step, other_stage, s2, e2 in self._recent:
                if other_stage != stage and step != msg.step:
                    self.stage_overlap_seconds += max(0.0, min(end, e2) - max(start, s2))
        self._recent = (self._recent + [(msg.step, stage, start, end) for stage, start, end in timing])[-64:]
        if self.metrics is None:
            return
        for stage, start, end in timing:
            self.metrics.observe_stage_step(stage, end - start)
        plan = self.scheduler.oldest_in_flight(msg.microbatch)
        kind = "decode" if plan is not None and all(e.tokens is None for e in plan.entries) else "prefill"
        for sender, receiver in zip(msg.timing, msg.timing[1:]):
            if len(receiver) > 3:          # [stage, start, end, arrival]
                self.metrics.observe_transfer(f"{int(sender[0])}->{int(receiver[0])}", kind,
                                              receiver[3] - sender[2])
        if timing:      # the last stage's end of compute to here: the socket, and any wait for this thread's turn
            self.metrics.observe_transfer(f"{timing[-1][0]}->core", kind, time.time() - timing[-1][2])
        self._push_gauges()


class _PrefixCacheCollector:
    """The prefix cache's counters for /metrics, named as vLLM's (prefix_cache_queries / _hits count tokens)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.cache
        yield CounterMetricFamily("moepipe_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=c.queries)
        yield CounterMetricFamily("moepipe_prefix_cache_hits", "Of those, tokens restored from it instead of "
                                  "computed", value=c.hits)
        yield GaugeMetricFamily("moepipe_prefix_cache_entries", "Saved prefix states (of prefix_cache_states)",
                                value=len(c.entries))
        yield GaugeMetricFamily("moepipe_prefix_cache_blocks", "KV blocks the prefix cache holds; those no "
                                "running request shares are not counted in moepipe_kv_blocks_used (evicted before any "
                                "request is preempted)", value=c.cached_blocks)


def prompt_top(value: int | bool | None) -> int | None:
    """`GenerationRequest.prompt_logprobs` as alternatives per prompt position: None for no prompt logprobs."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if value < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {value}")
    return int(value)


def wait_readable(fd: int, timeout: float) -> None:
    """Block until `fd` is readable or `timeout` s pass (executors with nothing of their own to wait on)."""
    select.select([fd], [], [], timeout)


PREFILL_STALL_FACTOR = 5    # a prefill chunk may take this many times `stall_report_timeout` before it is reported


def _stall_limit(plan: Plan, limit: float) -> float:
    """How long `plan` may be in flight before the stall report: a decode step takes milliseconds on a GPU and well
    under a second on a CPU, so `limit` (60 s) means a stall; a prefill chunk of thousands of tokens can take
    longer than that on a CPU (a large model's chunk) without anything being wrong. Reports only."""
    return limit * PREFILL_STALL_FACTOR if any(e.num_tokens > 1 for e in plan.entries) else limit
