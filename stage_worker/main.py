"""A stage worker process: `python -m stage_worker --config cluster.toml --stage K`.

Binds its inbox, connects to the next stage (or, as the last stage, to stage 0, the PLE service and the gateway),
and runs steps as their inputs arrive. A step that fails is reported to the gateway and dropped; the process keeps
serving. SIGTERM ends it cleanly.
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
from pathlib import Path

import torch
import zmq

from shared.checkpoint_files import CheckpointError
from shared.cluster_config import ClusterConfig, ClusterConfigError, load_cluster_config, stage_name
from shared.cold_set import ColdSetError
from shared.links import bind_inbox, cluster_keys, connect_outbox, stop_authentication
from shared.model_config import ConfigError, load_config
from shared.quant_scheme import QuantSchemeError
from shared.parent_watch import die_with_parent, restart_count
from shared.ple_ring import RingError
from shared.protocol import Heartbeat, ProtocolError, Shutdown, StageError, decode, encode
from stage_worker import ipc_activations
from stage_worker.profiling import StepProfiler
from stage_worker.runner import StageRunner, StaleState
from stage_worker.stage_loader import load_stage
from stage_worker.warmup import warm_up

log = logging.getLogger("moepipe.stage")
# start-up steps of a GPU stage: shown at INFO whatever the level (`serve`)
startup_log = logging.getLogger("moepipe.startup")
startup_log.setLevel(logging.INFO)

# What loading a checkpoint refuses with a message naming the problem (config field, file, tensor, cold set, quant
# scheme): the worker prints that message as one line and exits 2. Anything else keeps its traceback.
LOAD_REFUSALS = (CheckpointError, ConfigError, ClusterConfigError, ColdSetError, QuantSchemeError)


RING_WAIT_S = 120.0    # how long a stage waits for the PLE service to create its ring


def _open_ring(cluster: ClusterConfig):
    from shared.ple_ring import GatherRing

    deadline = time.time() + RING_WAIT_S
    while not Path(cluster.ple_ring).exists():
        if time.time() > deadline:
            raise RuntimeError(f"PLE ring {cluster.ple_ring} did not appear within {RING_WAIT_S:.0f} s")
        time.sleep(0.05)
    ring = GatherRing.open(cluster.ple_ring)
    if torch.cuda.is_available():
        ring.pin()
    return ring


def mark_progress(model, turned: list[float]) -> None:
    """Each decoder layer of `model` sets `turned[0]` (time.monotonic) as it starts and ends, as the step loop does
    when it launches or finishes a step or has none launched: the stall clock then measures a stretch without
    progress, not a step's length. A step longer than `stall_timeout` (a large prefill chunk on a CPU) silenced the
    heartbeats although every layer was finishing, so the stage was killed, and its restart killed again on the
    same recomputed request until the restarts ran out. Now only a layer stuck for that long counts, or a launched
    step that never completes: a GPU stage's layers only launch, so its wait for the device is one stretch, as a
    hung kernel should be. Two clock reads a layer; decode graphs replay without them."""
    for layer in getattr(model, "layers", {}).values():
        inner = layer.forward_deferred

        def forward_deferred(*args, _inner=inner, **kwargs):
            turned[0] = time.monotonic()
            try:
                return _inner(*args, **kwargs)
            finally:
                turned[0] = time.monotonic()

        layer.forward_deferred = forward_deferred


def _heartbeats(ctx: zmq.Context, cluster: ClusterConfig, keys, name: str, runner: StageRunner,
                stop: threading.Event, turned: list[float]) -> None:
    """Every `heartbeat_interval`, while the stage makes progress: `turned[0]` is when the step loop last launched or
    finished a step or had none launched, or a layer last started or ended (time.monotonic; `mark_progress`). No
    progress for `stall_timeout` (a hung step, a deadlock) silences them, so the gateway sees this stage lost and,
    after `hang_timeout`, kills it for the launcher to restart; a thread of its own would otherwise vouch for a
    wedged process."""
    sock = connect_outbox(ctx, cluster.gateway_endpoint, keys, sndhwm=10)
    silent = False
    while not stop.is_set():
        stalled = time.monotonic() - turned[0]
        if cluster.stall_timeout and stalled > cluster.stall_timeout:
            if not silent:
                log.error("%s: no progress for %.0f s (no step launched or finished and no layer moved, with %d "
                          "step(s) launched; stall_timeout %g s): no more heartbeats, so the gateway restarts this "
                          "stage. If one layer of a step really takes this long here, raise MOEPIPE_STALL_TIMEOUT. "
                          "Where each thread is:", name, stalled, len(runner.launched), cluster.stall_timeout)
                try:
                    faulthandler.dump_traceback(all_threads=True)
                except (OSError, ValueError, RuntimeError):   # a stderr without a file: the silence matters more
                    log.warning("%s: could not print the threads' stacks", name)
            silent = True
            stop.wait(cluster.heartbeat_interval)
            continue
        silent = False
        try:
            stats = {**runner.stats(), "restarts": restart_count()}
            sock.send_multipart(encode(Heartbeat(component=name, pid=os.getpid(), stats=stats)),
                                flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        stop.wait(cluster.heartbeat_interval)
    sock.close()


def serve(cluster: ClusterConfig, index: int) -> int:
    spec = cluster.stages[index]
    name = stage_name(index)
    t0 = time.time()
    try:
        cfg = load_config(cluster.model)
        cluster = cluster.for_model(cfg)
        model = load_stage(cluster, index, cfg)
    except LOAD_REFUSALS as exc:      # a checkpoint moepipe refuses: one line naming the problem, not a traceback
        print(f"stage_worker: {name}: {exc}", file=sys.stderr)
        return 2
    ple_layers = [i - 1 for i in getattr(cfg, "ple_layer_ids", [])]
    has_ple = any(spec.start <= layer < spec.end for layer in ple_layers)
    try:
        ring = _open_ring(cluster) if (has_ple and cluster.ple_service and cluster.ple_endpoint) else None
    except (RingError, RuntimeError) as exc:
        # no live service holds the ring, it never appeared, or it cannot be page-locked (the memlock limit): one
        # line naming the ring and what to do, as for a checkpoint refused, not a traceback (helper-104's QA)
        print(f"stage_worker: {name}: {exc}", file=sys.stderr)
        return 2
    runner = StageRunner(model, cluster, index, ring)
    profiler = StepProfiler.from_env(name, runner.device)
    if profiler is not None:
        launch = runner.launch
        runner.launch = lambda p: profiler(launch, p)
    # A GPU stage's start takes minutes on a machine's first start (Triton compiling the kernels, flash-linear-
    # attention timing its autotuned configs): its steps are said at INFO whatever the log level, as vLLM does, so
    # a start that is working does not look hung (h100-30 took a slow two-stage start for one).
    progress = startup_log if runner.device.type == "cuda" else log
    progress.info("%s: layers [%d, %d) built on %s in %.1f s", name, spec.start, spec.end, runner.device,
                  time.time() - t0)
    if runner.graphs is not None:
        # Capture before the first heartbeat: /health turns 200 only once decode steps can replay, so the first
        # request does not pay for Triton compiles and capture.
        progress.info("%s: capturing decode graphs for batch sizes %s (compiling the decode kernels on a "
                      "machine's first start)", name, runner.graphs.sizes)
        t1 = time.time()
        runner.graphs.capture()
        progress.info("%s: captured decode graphs for batch sizes %s in %.1f s", name, runner.graphs.sizes,
                      time.time() - t1)
    if cluster.startup_warmup and runner.device.type == "cuda":
        # ... and the prefill path and the sampler compiled: the first request's TTFT is then a request's
        progress.info("%s: running the prefill path and the sampler once (compiling their kernels on a machine's "
                      "first start)", name)
        try:
            seconds = warm_up(model, runner.cache, block_size=cluster.block_size,
                              scratch_slot=cluster.max_num_seqs, scratch_block=cluster.num_blocks,
                              race_kernel=getattr(getattr(model, "kernel_flags", None), "sample_race", False),
                              batched_prefill=cluster.batched_prefill,
                              decode_rows=runner.graphs.sizes if runner.graphs is not None else (1, 4))
            if runner.own_decode_rows is not None:
                # the stage's own decode-row gather once (the scratch slot's context): h200-21 measured the first
                # request at 1.06 s against 0.08 s for the next, 0.44 s of it this gather's first call (a dummy
                # table building its rows, first calls of its CPU ops)
                runner.own_decode_rows([cluster.max_num_seqs], [0])
            progress.info("%s: ran the prefill path and the sampler once in %.1f s", name, seconds)
        except Exception:   # an optimisation: a stage that cannot warm up still serves (the first request compiles)
            log.warning("%s: the start-up warm-up failed; serving without it", name, exc_info=True)
    progress.info("%s: layers [%d, %d) ready in %.1f s%s", name, spec.start, spec.end, time.time() - t0,
                  " (PLE rows from the PLE service)" if ring is not None else "")

    ctx = zmq.Context()
    keys = cluster_keys(cluster.link_keys)
    inbox = bind_inbox(ctx, spec.endpoint, keys)
    peers: dict[str, zmq.Socket] = {}

    def connect(key: str, endpoint: str) -> None:
        peers[key] = connect_outbox(ctx, endpoint, keys)

    connect("gateway", cluster.gateway_endpoint)
    if not runner.is_last:
        connect("next", cluster.stages[index + 1].endpoint)
    else:
        if not runner.is_first:
            connect("first", cluster.stages[0].endpoint)
        if cluster.ple_endpoint and cluster.ple_service:
            connect("ple", cluster.ple_endpoint)
    # Activations by CUDA IPC (`cuda_ipc_activations`): the setup goes both ways, so a receiver links back too.
    handoff = ipc_activations.setup(cluster, index, runner)
    if handoff is not None:
        if handoff.receiver is not None:
            connect("prev", cluster.stages[index - 1].endpoint)
        runner.handoff = handoff
        runner.send_now = lambda o: peers[o.to].send_multipart(encode(o.message), copy=False)
        for o in handoff.start():
            peers[o.to].send_multipart(encode(o.message))

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    turned = [time.monotonic()]          # when the stage last made progress (the stall check; see the loop)
    mark_progress(model, turned)
    hb = threading.Thread(target=_heartbeats, args=(ctx, cluster, keys, name, runner, stop, turned), daemon=True)
    hb.start()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)

    def failed(step: int, exc: Exception) -> None:    # a bad step must not take the worker down
        if isinstance(exc, StaleState):
            log.warning("%s: step %d refused: %s", name, step, exc)
        else:
            log.error("%s: step %d failed", name, step, exc_info=exc)
        peers["gateway"].send_multipart(encode(StageError(component=name, step=step, pid=os.getpid(),
                                                          message=f"{type(exc).__name__}: {exc}")))

    # With a step in flight, look for messages without blocking long: the next plan (or its PLE rows) may arrive
    # while the GPU works, and is prepared (or launched behind it) before the step is completed.
    # `stage_spin_wait` (GPU stages): never block while the GPU works. A 1 ms poll saw a step's end up to 1 ms late
    # (~0.5 ms a step), so a stage that runs one step at a time (a PLE stage: the next step needs this one's token
    # on the host) blocked in `finish` instead, and the next plan, which had arrived meanwhile, was only decoded and
    # prepared after the step: host work between steps with the GPU idle (issue 14; h200-15, one stream: stage step
    # 4.08 ms, server TPOT 4.86, stage idle 24% of the time). Spinning, the plan is prepared while the step runs,
    # the step's end is seen within microseconds, and the next step is queued before this one's tokens are encoded
    # for the gateway. Costs one busy core per GPU stage.
    spin = cluster.stage_spin_wait and runner.device.type == "cuda"
    # A CPU stage computes a step inside `launch`: one step at a time, the inbox read between them, so a plan's
    # `cancelled` that came during a step is seen before the next one starts (and the next stage gets this step's
    # activations before the next is computed).
    one_at_a_time = runner.computes_in_launch

    def read_inbox() -> None:
        """Hand every message waiting in the inbox to the runner (a Shutdown stops the loop)."""
        while True:
            try:
                frames = inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("%s: dropped a malformed message: %s", name, exc)
                continue
            if isinstance(msg, Shutdown):
                stop.set()
                return
            try:
                if handoff is not None and isinstance(msg, ipc_activations.SETUP_MESSAGES):
                    for o in handoff.on_setup(msg):
                        peers[o.to].send_multipart(encode(o.message))
                else:
                    runner.on_message(msg)
            except StaleState as exc:      # a plan made before this process (re)started: expected, one line
                log.warning("%s: ignored a %s message: %s", name, type(msg).__name__, exc)
            except Exception:  # a message the runner cannot use must not take the worker down
                log.exception("%s: could not handle a %s message", name, type(msg).__name__)

    def send(outgoing: list) -> None:
        for o in outgoing:
            if o.to in peers:
                peers[o.to].send_multipart(encode(o.message), copy=False)

    while not stop.is_set():
        # Progress for the stall check: idle (nothing launched: waiting for work is no stall), a step launched or
        # finished, a layer moving. Not the loop turning: a spinning stage turns it every few microseconds while it
        # polls a step the GPU never completes, and refreshed here that hid a hung step from the stall check.
        if not runner.launched:
            turned[0] = time.monotonic()
        wait = 100 if not runner.launched else (0 if spin or runner.oldest_done() else 1)
        if not poller.poll(wait) and not runner.launched:
            continue
        read_inbox()
        # Queue every step that is ready (up to the launch depth), then complete the oldest: the GPU runs the
        # next step while this process sends the previous one's results.
        while True:
            if runner.launch_ready(failed, limit=1 if one_at_a_time else None):
                turned[0] = time.monotonic()
            if not runner.launched:
                break
            if (spin or runner.can_launch()) and not runner.oldest_done():
                break                 # the GPU is still on it: meanwhile, look for the next plan
            step = runner.launched[0].plan.step
            try:
                outgoing = runner.finish()
            except Exception as exc:
                failed(step, exc)
                continue
            finally:
                turned[0] = time.monotonic()
            # What other components wait for goes first (activations, tokens for stage 0 and the PLE service);
            # spinning, the next ready step is queued before the tokens are encoded for the gateway.
            later = [o for o in outgoing if o.to == "gateway"] if spin else []
            send([o for o in outgoing if not any(o is x for x in later)])
            if later and runner.sampler_waits():
                # A launched step's sampler waits for the rows this finish's tokens gave (`ple_sample_after_rows`):
                # its graph runs from now (~ms), so the gateway's tokens go first; the sampler is queued next and
                # the step after it launched at the loop's top (h100-33 call 5: queued before the messages, it held
                # the tokens back 1.1 ms a step)
                send(later)
                later = []
            runner.queue_samplers()
            if later:
                if runner.launch_ready(failed):
                    turned[0] = time.monotonic()
                send(later)
            if runner.ready() is None:
                break                 # look for new messages (the next plan, activations, PLE rows)
            if one_at_a_time:
                read_inbox()
                if stop.is_set():
                    break
    stop.set()
    hb.join(timeout=2)
    for s in peers.values():
        s.close()
    inbox.close(linger=0)
    stop_authentication(ctx)
    ctx.term()
    log.info("%s: stopped", name)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stage_worker", description="run one pipeline stage")
    ap.add_argument("--config", required=True, help="cluster config file (TOML)")
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the launcher) exits")
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    # `kill -USR2 <pid>` prints every thread's Python stack to the stage's stderr: where a stage that never reports
    # ready is stuck (a start that hangs on one GPU model and not on another), without py-spy on the machine
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cluster = load_cluster_config(args.config)
        if not 0 <= args.stage < cluster.num_stages:
            raise ClusterConfigError(f"--stage {args.stage}: the config has {cluster.num_stages} stages")
    except (ClusterConfigError, ValueError) as exc:
        print(f"stage_worker: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, cluster.threads_per_stage))
    return serve(cluster, args.stage)
