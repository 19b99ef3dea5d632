"""Prometheus metrics of the gateway, in a registry of their own (so a test process can build several apps).

Request-level series are updated by the API layer through `RequestTimer`, which also turns the engine core's
timestamps on the token events (shared/engine_core.py `TokenEvent.*_ts`) into the request phases vLLM reports
(queue, prefill, decode, inference, time per output token) and the gateway's own share of the TTFT; scheduler,
stage and PLE series are pushed by whatever engine runs the model (`set_scheduler_state`, `observe_stage_step`,
`set_stage_busy`, `set_ple_totals`).

The `moepipe_ple_*_total` series are COUNTERS whose values are set from the cumulative totals the PLE service
and the stages report (each reporter keeps its own running sum; the exposed value is the sum over reporters). A
custom collector exposes them, because prometheus_client's Counter can only be incremented. A reporter that restarts
from zero looks like an ordinary counter reset to Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gateway import access_log

__all__ = ["Metrics", "RequestTimer", "CONTENT_TYPE_LATEST"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# request phases: a 3.6-ms decode step to a minute of queue or prefill; decode and inference go on to long requests
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
LONG_PHASE_BUCKETS = PHASE_BUCKETS + (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)

PLE_SERIES = {
    "prefetch_pages": ("moepipe_ple_prefetch_pages", "PLE table pages prefetched (cumulative, as reported)"),
    "prefetch_seconds": ("moepipe_ple_prefetch_seconds",
                         "Seconds the PLE service's prefetch threads spent advising pages, summed over threads "
                         "(cumulative, as reported)"),
    "gather_seconds": ("moepipe_ple_gather_seconds", "Seconds spent gathering PLE rows (cumulative, as reported)"),
    "stage_wait_seconds": ("moepipe_ple_stage_wait_seconds",
                           "Seconds stages waited for PLE rows (cumulative, as reported)"),
    "stage_decode_wait_seconds": ("moepipe_ple_stage_decode_wait_seconds",
                                  "Seconds stages waited for the PLE service's rows of decode-only steps (the round "
                                  "trip after each sampled token; part of stage_wait_seconds; cumulative)"),
    "stage_gathers": ("moepipe_ple_stage_gathers",
                      "Decode steps whose PLE rows a stage gathered itself (ple_decode_in_stage; cumulative)"),
    "rows_after_launch": ("moepipe_ple_rows_after_launch",
                          "Decode steps queued before their PLE rows existed, their graph waiting on the device for "
                          "the rows the host then published (ple_launch_ahead; cumulative)"),
    "wait_timeouts": ("moepipe_ple_wait_timeouts",
                      "Decode steps whose graph gave up waiting on the device for their PLE rows (ple_launch_ahead); "
                      "each failed its requests with an error (cumulative)"),
    "stage_gather_seconds": ("moepipe_ple_stage_gather_seconds",
                             "Seconds stages spent gathering their own decode steps' PLE rows (ple_decode_in_stage; "
                             "cumulative)"),
}


class _PleCollector(Collector):
    """Exposes reported cumulative PLE totals as counters (sum over reporters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[str, dict[str, float]] = {}

    def set(self, source: str, values: dict[str, float]) -> None:
        with self._lock:
            self._by_source.setdefault(source, {}).update(values)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:
            sources = [dict(v) for v in self._by_source.values()]
        for key, (name, doc) in PLE_SERIES.items():
            family = CounterMetricFamily(name, doc)
            family.add_metric([], sum(s.get(key, 0.0) for s in sources))
            yield family


class _StageStatsCollector(Collector):
    """Per stage, the cumulative counters its heartbeats report (experts and memory tiers, issue 16; K/V rows;
    CUDA IPC hand-offs; skipped steps): set, not incremented, as the PLE totals are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_stage: dict[str, dict[str, float]] = {}

    def set(self, stage: str, stats: dict[str, float]) -> None:
        keep = {k: v for k, v in stats.items() if k.startswith(("expert_", "kv_", "ipc_")) or k == "skipped_steps"}
        with self._lock:
            self._by_stage[stage] = keep

    def collect(self) -> Iterator:
        with self._lock:
            stages = {k: dict(v) for k, v in self._by_stage.items()}
        reads = CounterMetricFamily("moepipe_expert_host_reads", "Routed-expert selections served from host RAM "
                                    "(over PCIe), per stage and MoE layer", labels=["stage", "layer"])
        moves = CounterMetricFamily("moepipe_expert_moves", "Run-time swaps of a host expert with a device "
                                    "expert, per stage and MoE layer", labels=["stage", "layer"])
        prefetches = CounterMetricFamily("moepipe_expert_prefetches", "Host experts named for a layer-ahead copy into "
                                         "VRAM (expert_prefetch), per stage and MoE layer", labels=["stage", "layer"])
        prefetch_hits = CounterMetricFamily("moepipe_expert_prefetch_hits", "Routed-expert selections read from a "
                                            "prefetch slot instead of host RAM (expert_prefetch), per stage and MoE "
                                            "layer", labels=["stage", "layer"])
        tiers = GaugeMetricFamily("moepipe_expert_bytes", "Routed-expert weight bytes by tier (vram, host) of the "
                                  "layers that keep experts in host RAM", labels=["stage", "tier"])
        kv = GaugeMetricFamily("moepipe_kv_cache_bytes", "Bytes of a stage's paged KV pool", labels=["stage"])
        kv_tiers = GaugeMetricFamily("moepipe_kv_cache_tier_bytes", "Bytes of a stage's paged KV pool by tier: host "
                                     "(QSA K/V in pinned host RAM, qsa_kv_offload) and vram (the stage's device)",
                                     labels=["stage", "tier"])
        rc_hits = CounterMetricFamily("moepipe_kv_row_cache_hits", "Selected QSA K/V rows a decode step read from "
                                      "the VRAM row cache instead of host RAM (kv_row_cache), per stage",
                                      labels=["stage"])
        rc_lookups = CounterMetricFamily("moepipe_kv_row_cache_lookups", "Selected QSA K/V rows decode steps looked "
                                         "up in the VRAM row cache (hits / lookups = hit rate), per stage",
                                         labels=["stage"])
        rc_bytes = GaugeMetricFamily("moepipe_kv_row_cache_bytes", "VRAM of a stage's K/V row cache",
                                     labels=["stage"])
        ipc = CounterMetricFamily("moepipe_ipc_activation_steps", "Steps whose activations a stage handed to the "
                                  "next by CUDA IPC (handoff), sent the host way because they were larger than a "
                                  "slot (too_large) or the ring was full (ring_full), and received from the ring "
                                  "(taken), per stage (cuda_ipc_activations)", labels=["stage", "outcome"])
        # (the stage step histogram counts computed steps only: without this a skip could not be told from a lost step)
        skipped = CounterMetricFamily("moepipe_stage_skipped_steps", "Steps a stage skipped instead of computing "
                                      "them: every request in them had ended (cancelled, or finished by a token) "
                                      "while they were in flight (Plan.cancelled), per stage", labels=["stage"])
        for stage, st in sorted(stages.items()):
            for key, value in st.items():
                name, _, layer = key.partition(":")
                if name == "skipped_steps":
                    skipped.add_metric([stage], value)
                    continue
                if name.startswith("ipc_"):
                    ipc.add_metric([stage, name.removeprefix("ipc_").removesuffix("s")], value)
                    continue
                if name == "expert_host_reads":
                    reads.add_metric([stage, layer], value)
                elif name == "expert_moves":
                    moves.add_metric([stage, layer], value)
                elif name == "expert_prefetches":
                    prefetches.add_metric([stage, layer], value)
                elif name == "expert_prefetch_hits":
                    prefetch_hits.add_metric([stage, layer], value)
                elif name in ("expert_bytes_vram", "expert_bytes_host"):
                    tiers.add_metric([stage, name.rsplit("_", 1)[1]], value)
                elif name == "kv_pool_bytes":
                    kv.add_metric([stage], value)
                elif name in ("kv_bytes_vram", "kv_bytes_host"):
                    kv_tiers.add_metric([stage, name.rsplit("_", 1)[1]], value)
                elif name in ("kv_row_cache_hits", "kv_row_cache_lookups", "kv_row_cache_bytes"):
                    {"hits": rc_hits, "lookups": rc_lookups, "bytes": rc_bytes}[name.rsplit("_", 1)[1]].add_metric(
                        [stage], value)
        yield from (reads, moves, prefetches, prefetch_hits, tiers, kv, kv_tiers, rc_hits, rc_lookups, rc_bytes, ipc, skipped)


# moepipe series that vLLM exposes under its own name (vLLM v1's `vllm:*` families, with a `model_name` label):
# Grafana dashboards and autoscalers written for vLLM read them unchanged. (moepipe name, vLLM name, label renames)
VLLM_NAMES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("moepipe_time_to_first_token_seconds", "vllm:time_to_first_token_seconds", {}),
    ("moepipe_inter_token_latency_seconds", "vllm:inter_token_latency_seconds", {}),
    ("moepipe_inter_token_latency_seconds", "vllm:time_per_output_token_seconds", {}),   # its older name
    ("moepipe_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", {}),
    ("moepipe_request_queue_time_seconds", "vllm:request_queue_time_seconds", {}),
    ("moepipe_request_prefill_time_seconds", "vllm:request_prefill_time_seconds", {}),
    ("moepipe_request_decode_time_seconds", "vllm:request_decode_time_seconds", {}),
    ("moepipe_request_inference_time_seconds", "vllm:request_inference_time_seconds", {}),
    ("moepipe_request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds", {}),
    ("moepipe_prompt_tokens", "vllm:prompt_tokens", {}),
    ("moepipe_generation_tokens", "vllm:generation_tokens", {}),
    ("moepipe_requests", "vllm:request_success", {"finish_reason": "finished_reason"}),
    ("moepipe_requests_running", "vllm:num_requests_running", {}),
    ("moepipe_requests_waiting", "vllm:num_requests_waiting", {}),
)


class _VllmCollector(Collector):
    """The `VLLM_NAMES` families of `source`, renamed, plus `vllm:kv_cache_usage_perc` (blocks used / total, 0-1),
    read from the moepipe series at scrape time: one set of numbers, two names."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source, self.model_name = source, model_name
        self.by_name: dict[str, list[tuple[str, dict[str, str]]]] = {}
        for ours, theirs, labels in VLLM_NAMES:
            self.by_name.setdefault(ours, []).append((theirs, labels))

    def collect(self) -> Iterator[Metric]:
        kv: dict[str, float] = {}
        for family in self.source.collect():
            if family.name in ("moepipe_kv_blocks_used", "moepipe_kv_blocks_total"):
                kv[family.name] = sum(s.value for s in family.samples)
            for theirs, labels in self.by_name.get(family.name, ()):
                out = Metric(theirs, family.documentation, family.type, family.unit)
                for s in family.samples:
                    named = {labels.get(k, k): v for k, v in s.labels.items()}
                    out.add_sample(theirs + s.name[len(family.name):], {"model_name": self.model_name, **named},
                                   s.value, s.timestamp, s.exemplar)
                yield out
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage: 1 means 100 percent (blocks used / "
                                  "blocks in the pool)", labels=["model_name"])
        total = kv.get("moepipe_kv_blocks_total", 0.0)
        usage.add_metric([self.model_name], kv.get("moepipe_kv_blocks_used", 0.0) / total if total else 0.0)
        yield usage


class Metrics:
    """All gateway series, registered in `self.registry`; `render` adds their vLLM names (`VLLM_NAMES`)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "moepipe") -> None:
        r = self.registry = registry or CollectorRegistry()
        self.vllm_registry = CollectorRegistry()
        self.vllm_registry.register(_VllmCollector(r, model_name))
        self.ttft = Histogram("moepipe_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("moepipe_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("moepipe_e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        # The request phases (vLLM's vllm:request_*_time_seconds), from the engine core's time.monotonic() stamps.
        # Queue, prefill and gateway are observed with the TTFT (every request that got a token), decode, inference
        # and time per output token with the e2e latency (at its end, whatever the finish reason).
        self.queue_time = Histogram(
            "moepipe_request_queue_time_seconds", "Time a request waited in the engine core's queue: from its "
            "arrival at the core to its FIRST scheduling (a preempted or requeued request's later waits are not "
            "counted here but in prefill or decode time)", buckets=PHASE_BUCKETS, registry=r)
        self.prefill_time = Histogram(
            "moepipe_request_prefill_time_seconds", "From a request's first scheduling to the step result carrying "
            "its first token reaching the engine core (prefill chunks, the first sample, and any preemption "
            "meanwhile)", buckets=PHASE_BUCKETS, registry=r)
        self.decode_time = Histogram(
            "moepipe_request_decode_time_seconds", "From the step result carrying a request's first token to the "
            "one carrying its last reaching the engine core (the last: the one the client got, for requests the "
            "gateway ended: stop string, client gone)", buckets=LONG_PHASE_BUCKETS, registry=r)
        self.inference_time = Histogram(
            "moepipe_request_inference_time_seconds", "From a request's first scheduling to its last token "
            "reaching the engine core (prefill + decode)", buckets=LONG_PHASE_BUCKETS, registry=r)
        self.request_tpot = Histogram(
            "moepipe_request_time_per_output_token_seconds", "A request's mean time per output token after the "
            "first: decode time / (tokens - 1), one observation per request of two or more tokens (the per-token "
            "series is moepipe_inter_token_latency_seconds)", buckets=TPOT_BUCKETS, registry=r)
        self.gateway_time = Histogram(
            "moepipe_request_gateway_time_seconds", "The gateway's share of the time to first token: TTFT - (queue + "
            "prefill), i.e. HTTP receipt to the engine core's queue (body parsing, chat template, tokenizing, "
            "hand-off) plus the first token's way from the core to the API layer taking it up (thread hop, event "
            "loop, response start); its detokenizing and sending are not in the TTFT", buckets=PHASE_BUCKETS,
            registry=r)
        self.prompt_tokens = Counter("moepipe_prompt_tokens", "Prompt tokens of requests that started generating",
                                     registry=r)
        self.generation_tokens = Counter("moepipe_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("moepipe_requests", "Finished requests by finish reason (stop, length, abort, error)",
                                ["finish_reason"], registry=r)
        self.running = Gauge("moepipe_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("moepipe_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_used = Gauge("moepipe_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("moepipe_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.slots_used = Gauge("moepipe_state_slots_used", "Recurrent-state slots in use", registry=r)
        self.stage_step = Histogram("moepipe_stage_step_seconds", "Compute time of one step on a stage", ["stage"],
                                    buckets=STEP_BUCKETS, registry=r)
        self.stage_busy = Gauge("moepipe_stage_busy_fraction", "Fraction of recent wall time a stage computed",
                                ["stage"], registry=r)
        self.restarts = Gauge("moepipe_component_restarts", "Times the launcher restarted a component after it died",
                              ["component"], registry=r)
        self.stage_transfer = Histogram(
            "moepipe_stage_transfer_seconds", "A step's activations between stages: from the end of the sender's "
            "compute to their arrival at the receiver (device-to-host copy, serialisation, ZeroMQ); link 'K->core': "
            "the last stage's step result until the engine core took it up",
            ["link", "step_kind"], buckets=TRANSFER_BUCKETS, registry=r)
        self._ple = _PleCollector()
        r.register(self._ple)
        self._stage_stats = _StageStatsCollector()
        r.register(self._stage_stats)
        for reason in ("stop", "length"):
            self.requests.labels(finish_reason=reason)      # expose zeros before the first request

    # ---- request level (API layer) -----------------------------------------------------------------------------

    def request_started(self, arrival: float | None = None, request_id: str | None = None) -> RequestTimer:
        """A timer for one request; `arrival` is a time.monotonic() value (default: now); `request_id` (the
        response's id) goes to the access log line."""
        return RequestTimer(self, time.monotonic() if arrival is None else arrival, request_id)

    # ---- engine level --------------------------------------------------------------------------------------------

    def set_scheduler_state(self, *, running: int | None = None, waiting: int | None = None,
                            kv_blocks_used: int | None = None, kv_blocks_total: int | None = None,
                            state_slots_used: int | None = None) -> None:
        """Set whichever scheduler gauges are given."""
        for gauge, value in ((self.running, running), (self.waiting, waiting), (self.kv_used, kv_blocks_used),
                             (self.kv_total, kv_blocks_total), (self.slots_used, state_slots_used)):
            if value is not None:
                gauge.set(value)

    def observe_stage_step(self, stage: str | int, seconds: float) -> None:
        self.stage_step.labels(stage=str(stage)).observe(seconds)

    def observe_transfer(self, link: str, step_kind: str, seconds: float) -> None:
        self.stage_transfer.labels(link=link, step_kind=step_kind).observe(max(seconds, 0.0))

    def set_stage_busy(self, stage: str | int, fraction: float) -> None:
        self.stage_busy.labels(stage=str(stage)).set(min(max(fraction, 0.0), 1.0))

    def set_restarts(self, component: str, count: float) -> None:
        self.restarts.labels(component=component).set(count)

    def set_ple_totals(self, source: str = "ple", *, prefetch_pages: float | None = None,
                       prefetch_seconds: float | None = None, gather_seconds: float | None = None,
                       stage_wait_seconds: float | None = None, stage_decode_wait_seconds: float | None = None,
                       stage_gathers: float | None = None, stage_gather_seconds: float | None = None,
                       rows_after_launch: float | None = None, wait_timeouts: float | None = None) -> None:
        """Record one reporter's cumulative PLE totals (not increments); the series expose the sum over reporters."""
        given = {"prefetch_pages": prefetch_pages, "prefetch_seconds": prefetch_seconds,
                 "gather_seconds": gather_seconds, "stage_wait_seconds": stage_wait_seconds,
                 "stage_decode_wait_seconds": stage_decode_wait_seconds,
                 "stage_gathers": stage_gathers, "stage_gather_seconds": stage_gather_seconds,
                 "rows_after_launch": rows_after_launch, "wait_timeouts": wait_timeouts}
        self._ple.set(source, {k: float(v) for k, v in given.items() if v is not None})

    def set_stage_stats(self, stage: str | int, stats: dict[str, float]) -> None:
        """A stage's heartbeat totals: expert host reads and moves per layer, expert bytes by tier, KV pool bytes,
        the K/V row cache's hits, lookups and bytes."""
        self._stage_stats.set(str(stage), stats)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series, for GET /metrics."""
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)

    content_type = CONTENT_TYPE_LATEST


class RequestTimer:
    """Times one request: TTFT from arrival to the first token event, ITL between events, e2e at the finish; and,
    from the engine core's stamps on the events, the phases: queue, prefill and the gateway's share (TTFT - queue -
    prefill) with the first token, decode, inference and time per output token at the finish. Engines that stamp
    nothing (test stubs) get the gateway's series only.

    It also fills the HTTP request's access-log record (gateway/access_log.py), when the log is on: the timer is
    the one place that sees every token and the finish of every generation."""

    def __init__(self, metrics: Metrics, arrival: float, request_id: str | None = None) -> None:
        self._m = metrics
        self.arrival = arrival
        self._last: float | None = None
        self._done = False
        # the engine core's stamps (time.monotonic(), the same clock: the core is a thread of this process)
        self._scheduled_ts: float | None = None
        self._first_ts: float | None = None
        self._last_ts: float | None = None
        self._timed_tokens = 0
        self._access = access_log.current()
        if self._access is not None:
            self._access.generation_created(request_id)

    def started(self, prompt_tokens: int) -> None:
        """The first token arrived: the prompt has been computed."""
        self._m.prompt_tokens.inc(prompt_tokens)
        if self._access is not None:
            self._access.generation_started(prompt_tokens)

    def token(self, count: int = 1, event=None) -> None:
        """`count` tokens taken up by the API layer; `event` (shared/engine_core.TokenEvent) carries the engine
        core's timestamps, for the phase histograms."""
        now = time.monotonic()
        if self._access is not None:
            self._access.tokens(count)
        if self._last is None:
            ttft = now - self.arrival
            self._m.ttft.observe(ttft)
            if event is not None and None not in (event.token_ts, event.queued_ts, event.scheduled_ts):
                self._first_ts, self._scheduled_ts = event.token_ts, event.scheduled_ts
                queue, prefill = event.scheduled_ts - event.queued_ts, event.token_ts - event.scheduled_ts
                self._m.queue_time.observe(queue)
                self._m.prefill_time.observe(prefill)
                self._m.gateway_time.observe(ttft - queue - prefill)
        else:
            self._m.itl.observe(now - self._last)
        if self._first_ts is not None and event is not None and event.token_ts is not None:
            self._last_ts = event.token_ts
            self._timed_tokens += count
        self._last = now
        self._m.generation_tokens.inc(count)

    def finish(self, reason: str) -> None:
        """Count the request under `reason` (stop, length, abort, error); only the first call counts."""
        if self._done:
            return
        self._done = True
        self._m.requests.labels(finish_reason=reason).inc()
        if self._access is not None:
            self._access.finished(reason)
        if self._last is not None:
            self._m.e2e.observe(time.monotonic() - self.arrival)
        if self._first_ts is not None and self._last_ts is not None:
            decode = self._last_ts - self._first_ts
            self._m.decode_time.observe(decode)
            self._m.inference_time.observe(self._last_ts - self._scheduled_ts)
            if self._timed_tokens > 1:
                self._m.request_tpot.observe(decode / (self._timed_tokens - 1))
