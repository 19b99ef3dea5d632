"""The gateway process: `python -m gateway --config cluster.toml`. Serves the OpenAI API on uvicorn; the engine
core, on its own thread, drives the stage workers through the ZeroMQ cluster executor."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

import uvicorn

from gateway.access import AccessControl, default_allowed_hosts
from gateway.access_log import AccessLogMiddleware, configure_logger
from gateway.cluster_executor import ClusterExecutor
from gateway.engine import AsyncEngine
from gateway.metrics import Metrics
from shared.cluster_config import ClusterConfigError, load_cluster_config
from shared.engine_core import EngineCore, SchedulerLimits
from shared.model_config import Qwen4ExpConfig, load_config
from shared.parent_watch import die_with_parent, restart_count
from shared.sampling import read_generation_config

log = logging.getLogger("moepipe.gateway")


def apply_switch_interval(ms: float) -> None:
    """The core's thread and the HTTP event loop share the GIL: a stage result waits for the loop to yield it, at
    most one switch interval (Python's default 5 ms is about a whole decode step). 0 keeps Python's default."""
    if ms > 0:
        sys.setswitchinterval(ms / 1e3)


CORE_WATCH_S = 1.0          # how often the gateway checks that its engine core's thread still runs


async def serve(config_path: str) -> int:
    from gateway.api import create_app

    cluster = load_cluster_config(config_path)
    cfg = load_config(cluster.model)
    cluster = cluster.for_model(cfg)
    max_len = cluster.model_len(cfg)
    expect_ple = bool(cluster.ple_service and cluster.ple_endpoint and isinstance(cfg, Qwen4ExpConfig)
                      and cfg.ple_layer_ids)
    core = EngineCore(ClusterExecutor(cluster, expect_ple=expect_ple), SchedulerLimits.from_cluster(cluster, max_len))
    metrics = Metrics(model_name=cluster.served_model_name)
    metrics.set_restarts("gateway", restart_count())      # the launcher restarted the whole cluster this often
    core.attach_metrics(metrics)
    tokenizer = cluster.load_tokenizer()
    app = create_app(AsyncEngine(core), tokenizer, model_name=cluster.served_model_name,
                     aliases=cluster.served_model_aliases, vocab_size=cfg.vocab_size,
                     generation_config=read_generation_config(cluster.model), metrics=metrics,
                     root=str(cluster.model), clamp_max_tokens=cluster.clamp_max_tokens)
    app = AccessControl(app, api_key=cluster.api_key,
                        allowed_hosts=cluster.allowed_hosts or default_allowed_hosts(cluster.host))
    if cluster.allowed_origins:  # CORS only when asked; outside the key check, which preflights do not carry
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=cluster.allowed_origins, allow_methods=["GET", "POST", "OPTIONS"],
                             allow_headers=["authorization", "content-type"])
    if cluster.access_log:      # ours replaces uvicorn's: it also has the request id, tokens, TTFT, finish reason
        app = AccessLogMiddleware(app, configure_logger(True))
    apply_switch_interval(cluster.gil_switch_interval_ms)
    core.start()
    server = uvicorn.Server(uvicorn.Config(app, host=cluster.host, port=cluster.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=2))
    loop = asyncio.get_running_loop()

    def stop() -> None:
        # streams in flight end with an error event and their [DONE] before uvicorn closes the connections
        # (timeout_graceful_shutdown), not with a connection cut mid-chunk
        ended = core.close_requests("the server is shutting down")
        if ended:
            log.warning("gateway: stopping; %d request(s) in flight ended with an error", ended)
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGUSR1, core.give_up)     # the launcher's GIVEN_UP_SIGNAL
    watcher = asyncio.create_task(watch_core(core, stop, lambda: server.should_exit))
    try:
        await server.serve()
    finally:
        watcher.cancel()
        died = core.dead                  # (read before stop: a stopped core is not dead)
        core.stop()
    return 1 if died else 0


async def watch_core(core, stop: Callable[[], None], stopping: Callable[[], bool],
                     interval: float = CORE_WATCH_S) -> bool:
    """A core thread stopped by a bug leaves nothing to serve requests while the process, alive, would answer 503
    for ever: stop the server instead (serve then exits 1, and the launcher restarts the cluster). True if so."""
    while not stopping():
        await asyncio.sleep(interval)
        if core.dead:
            log.error("gateway: the engine core stopped (its traceback is above); exiting so the launcher restarts "
                      "the server")
            stop()
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway", description="run the OpenAI-compatible gateway")
    ap.add_argument("--config", required=True, help="cluster config file (TOML)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the launcher) exits")
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(serve(args.config))
    except ClusterConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
