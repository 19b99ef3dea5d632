"""The PLE service process: one inbox (Plan, Sampled, Shutdown in), PleReady out to every stage holding a PLE
layer, heartbeats and errors out to the gateway.

The loop never dies on one bad message (logged and skipped) and never blocks forever on a peer that is gone, so a
SIGTERM/SIGINT always ends it promptly, with the shared-memory ring unlinked.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time

import zmq

from shared.cluster_config import ClusterConfig, ClusterConfigError, load_cluster_config
from shared.links import bind_inbox, cluster_keys, connect_outbox, stop_authentication
from shared.model_config import load_config
from shared.parent_watch import die_with_parent, restart_count
from shared.protocol import Heartbeat, Message, Plan, ProtocolError, Sampled, Shutdown, decode, encode

log = logging.getLogger("ple_service")

_POLL_MS = 50
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def ple_stages(cluster: ClusterConfig, cfg) -> list[int]:
    """Indices of the stages holding PLE layers: each gets every step's PleReady and copies its own layers' rows."""
    layers = sorted(i - 1 for i in set(getattr(cfg, "ple_layer_ids", None) or []))
    if not layers:
        raise ClusterConfigError(f"{cluster.model}: the model has no PLE layers; set ple_service = false")
    owners = set()
    for layer in layers:
        owner = next((k for k, s in enumerate(cluster.stages) if s.start <= layer < s.end), None)
        if owner is None:
            raise ClusterConfigError(f"cluster config: no stage holds PLE layer {layer} (0-based)")
        owners.add(owner)
    return sorted(owners)


def _send(sock: zmq.Socket, msg: Message, stop: threading.Event, wait: bool = True) -> bool:
    """Send without ever blocking past a stop request; `wait=False` drops the message if the peer's queue is full."""
    frames = encode(msg)
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            if not wait or stop.is_set():
                return False
            time.sleep(0.001)


def serve(cluster: ClusterConfig, stop: threading.Event, serving: threading.Event | None = None) -> int:
    """Load the table, then answer plans until `stop`; `serving` is set once loading is over (a stop before then
    exits at once: see `main`)."""
    import torch

    from ple_service.service import PleService     # heavy imports (torch) after argument errors are out of the way

    if not cluster.ple_endpoint:
        raise ClusterConfigError("cluster config: ple_endpoint is empty, the PLE service has no inbox to bind")
    if cluster.ple_threads > 0:
        # A decode step gathers a few thousand rows: a pool of threads woken per op costs more than it saves
        torch.set_num_threads(cluster.ple_threads)
    cfg = load_config(cluster.model)
    cluster = cluster.for_model(cfg)
    consumers = ple_stages(cluster, cfg)
    service = PleService(cluster.model, cfg, cluster)
    if serving is not None:
        serving.set()                    # from here a stop goes through the loop and `finally` (the ring unlinked)
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        keys = cluster_keys(cluster.link_keys)
        inbox = bind_inbox(ctx, cluster.ple_endpoint, keys)
        socks.append(inbox)
        gateway = connect_outbox(ctx, cluster.gateway_endpoint, keys)
        stages = [connect_outbox(ctx, cluster.stages[k].endpoint, keys) for k in consumers]
        socks += [gateway, *stages]
        log.info("PLE service: layers %s, ring %s (%d slots x %d tokens), PleReady -> stages %s, prefetch %s",
                 service.layers, service.ring.path, service.ring.slots, service.ring.max_tokens, consumers,
                 "on" if service.prefetcher else "off")
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        next_beat = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                _send(gateway, Heartbeat(component="ple", pid=os.getpid(),
                                         stats={**service.stats(), "restarts": restart_count()}), stop, wait=False)
                next_beat = now + cluster.heartbeat_interval
            if not poller.poll(min(_POLL_MS, max(1, int((next_beat - now) * 1000)))):
                continue
            frames = inbox.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("skipping malformed message: %s", exc)
                continue
            except Exception as exc:          # a decoder bug or garbage frames must not end the service
                log.warning("skipping undecodable message: %r", exc)
                continue
            try:
                if isinstance(msg, Plan):
                    out = service.on_plan(msg)
                elif isinstance(msg, Sampled):
                    out = service.on_sampled(msg)
                elif isinstance(msg, Shutdown):
                    log.info("PLE service: shutdown requested")
                    break
                else:
                    log.warning("skipping %s message: not meant for the PLE service", msg.TYPE)
                    continue
            except Exception:
                log.exception("PLE service: handling %s failed; message skipped", msg.TYPE)
                continue
            for ready in out:
                for stage in stages:
                    _send(stage, ready, stop)
            for err in service.take_errors():
                _send(gateway, err, stop)
    finally:
        for s in socks:
            s.close(linger=0)
        stop_authentication(ctx)
        ctx.term()
        service.close(unlink=True)
    log.info("PLE service: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ple_service", description="moepipe PLE gather service",
                                     allow_abbrev=False)
    parser.add_argument("--config", required=True, help="cluster config (TOML)")
    parser.add_argument("--log-level", default=None, metavar="LEVEL",
                        help=f"{', '.join(LOG_LEVELS)} (default: MOEPIPE_LOG_LEVEL, else INFO)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the launcher) exits")
    args = parser.parse_args(argv)
    level, source = (args.log_level, "--log-level") if args.log_level is not None else \
        (os.environ.get("MOEPIPE_LOG_LEVEL") or "INFO", "MOEPIPE_LOG_LEVEL")
    if level.strip().upper() not in LOG_LEVELS:
        print(f"python -m ple_service: {source} {level!r}: expected one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level.strip().upper(), format="%(asctime)s ple %(levelname)s %(name)s: %(message)s")
    stop, serving = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame) -> None:
        if not serving.is_set():
            # still loading (a large table is written or read for minutes): nothing to stop cleanly yet, and the
            # loop that reads `stop` has not started, so the launcher's stop waited its whole grace for a SIGKILL.
            # The table is written to a temporary file renamed once complete (an interrupted write removes it: the
            # next start writes it again); the ring file is removed as construction fails.
            log.info("PLE service: %s received while loading, exiting", signal.Signals(signum).name)
            raise SystemExit(0)
        log.info("PLE service: %s received, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # `kill -USR2 <pid>` (the engine core's stall report sends it) prints every thread's stack to stderr
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    die_with_parent(args.parent_pid)           # after the handlers: the launcher's death stops us cleanly
    try:
        cluster = load_cluster_config(args.config)
        if not cluster.ple_service:
            log.info("ple_service = false: stages gather PLE rows in-process; nothing to serve")
            return 0
        return serve(cluster, stop, serving)
    except (ClusterConfigError, ValueError) as exc:
        log.error("%s", exc)
        return 2
