"""The executor of `moepipe serve`: plans go over ZeroMQ to every stage worker process (and the PLE service), step
results and stage errors come back on the gateway's inbox, and heartbeats say who is alive.

Data flow: activations pass stage to stage; the last stage sends sampled ids straight to stage 0 and the PLE
service, and the same ids with logprobs here. Used only from the engine core's thread (ZeroMQ sockets are not
thread-safe), except `health`, which only reads the heartbeat times.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from shared.cluster_config import ClusterConfig, stage_name
from shared.links import bind_inbox, cluster_keys, connect_outbox, stop_authentication
from shared.protocol import Heartbeat, Message, Plan, ProtocolError, StageError, StepResult, decode, encode

log = logging.getLogger("moepipe.gateway")

# moepipe_stage_busy_fraction covers the last this many seconds of heartbeats: one heartbeat interval (0.5 s) was
# mostly noise for a Prometheus scrape every 15 s, and read 0 right after a burst of work had ended
BUSY_WINDOW_S = 10.0


@dataclass
class ComponentState:
    last_seen: float = 0.0
    pid: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)   # pids it had before: a stopping one may still heartbeat
    killed: set[int] = field(default_factory=set)    # pids killed as hung (once each)
    watched_from: float = 0.0     # its silence counts from here at the earliest (a gap in the gateway's looking)


# the module each component runs as (`python -m ...`): a pid is only killed if it is one of ours on this host
_MODULES = {"ple": "ple_service"}


def _start_time(pid: int) -> float | None:
    """When process `pid` started (time.time() scale), from /proc; None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def ours(component: str, pid: int, heard_at: float | None = None) -> bool:
    """Whether `pid` is `component`'s process on this host: its command line runs the component's module (a stage
    on another host is left alone) and, given `heard_at` (its last heartbeat), it started before then (a pid the
    system has since given to a new process, say the component's restarted successor, is left alone)."""
    module = _MODULES.get(component, "stage_worker")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False                  # gone already, or not on this host
    if module.encode() not in argv:
        return False
    if component.startswith("stage"):
        # its own stage index too: a remote stage's pid can be a local process's (containers number pids from 1),
        # and that local process may be another stage; it is not this component, to call late or to kill
        index = component[len("stage"):].encode()
        if not any(a == b"--stage" and b == index for a, b in zip(argv, argv[1:])):
            return False
    started = _start_time(pid)
    return heard_at is None or (started is not None and started <= heard_at + 1.0)


def kill_hung(component: str, pid: int, silent_s: float, heard_at: float | None = None) -> bool:
    """SIGKILL `pid` if it is `component`'s process on this host (`ours`). True if killed."""
    if not ours(component, pid, heard_at):
        return False
    log.error("gateway: %s (pid %d) sent no heartbeat for %.0f s (hang_timeout): killing it so the launcher "
              "restarts it", component, pid, silent_s)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


class ClusterExecutor:
    def __init__(self, cluster: ClusterConfig, *, expect_ple: bool) -> None:
        self.cluster = cluster
        self.components = [stage_name(i) for i in range(cluster.num_stages)] + (["ple"] if expect_ple else [])
        self.state = {c: ComponentState() for c in self.components}
        self.metrics = None
        self._busy_marks: dict[str, deque[tuple[float, float]]] = {}   # (time, busy seconds) per heartbeat
        self._restarted: set[str] = set()     # components heard from with a new pid: their steps in flight are lost
        self._unreachable: set[str] = set()   # components a plan could not reach: sends to them do not wait
        self._ctx: zmq.Context | None = None
        self._last_look = 0.0                 # when the engine core last read the inbox (time.time(), as last_seen)

    def start(self) -> None:
        self._ctx = zmq.Context()
        keys = cluster_keys(self.cluster.link_keys)
        self.inbox = bind_inbox(self._ctx, self.cluster.gateway_endpoint, keys)
        targets = [s.endpoint for s in self.cluster.stages]
        if "ple" in self.components:
            targets.append(self.cluster.ple_endpoint)
        # A peer that is gone must not hang the engine core: sends give up after 2 s. Nor may the plans sent while
        # it was gone reach its restarted successor (immediate: they die with the connection): hundreds of stale
        # steps, each failed and logged by it and by the engine core, in the second the launcher waits to restart it
        self.outs = [connect_outbox(self._ctx, ep, keys, sndtimeo=2000, immediate=True) for ep in targets]
        self._poller = zmq.Poller()
        self._poller.register(self.inbox, zmq.POLLIN)
        self._wake_fd: int | None = None

    def stop(self) -> None:
        if self._ctx is None:
            return
        for s in self.outs:
            s.close()
        self.inbox.close(linger=0)
        stop_authentication(self._ctx)
        self._ctx.term()
        self._ctx = None

    def send(self, plan: Plan) -> None:
        """To every component; one that a plan could not reach in 2 s is skipped at once until it heartbeats again,
        so a dead peer costs the core one wait, not one a plan (gone, its requests are recomputed once it is back;
        a peer only late is sent little meanwhile: scheduling waits while it is silent, far below the send queue)."""
        frames = encode(plan)
        for name, s in zip(self.components, self.outs):
            try:
                s.send_multipart(frames, flags=zmq.NOBLOCK if name in self._unreachable else 0)
            except zmq.Again:
                if name not in self._unreachable:
                    log.error("gateway: a plan could not be delivered to %s (is it running?); its plans are "
                              "dropped until it heartbeats again", name)
                    self._unreachable.add(name)

    def poll(self, timeout: float, wake_fd: int) -> list[Message]:
        if self._wake_fd != wake_fd:
            self._poller.register(wake_fd, zmq.POLLIN)
            self._wake_fd = wake_fd
        out: list[Message] = []
        ready = self._poller.poll(timeout * 1000)
        self._looked()
        if not ready:
            return out
        while True:
            try:
                frames = self.inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("gateway: dropped a malformed message: %s", exc)
                continue
            if self._keep(msg):
                out.append(msg)

    def _keep(self, msg: Message) -> bool:
        """Whether the engine core gets `msg` (heartbeats are taken here). A step error from a restarted process,
        before the core has taken up that restart (`restarted`), is the restart's: a plan made before the process
        started, which the core recomputes anyway (else the error, in the same batch as the new process's first
        heartbeat, failed the step's requests just before the restart would have recomputed them)."""
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
            return False
        if isinstance(msg, StageError) and (self._from_new_process(msg) or msg.component in self._restarted):
            return False
        return isinstance(msg, (StepResult, StageError))

    def _looked(self) -> None:
        """The engine core is reading the inbox now. If it had not for longer than `heartbeat_timeout` (this process
        was stopped or starved: the container paused, the host suspended, SIGSTOP, a clock step), nobody was
        listening for heartbeats meanwhile: every component's silence counts from now, not from its last heartbeat
        before the gap. Counted from the last heartbeat, a cluster frozen for longer than `hang_timeout` as a whole
        (`docker pause`, a suspended VM or laptop) had every healthy component SIGKILLed by this process the moment
        it resumed, before their next heartbeats could arrive (and restarted, their models loaded again, every
        running request recomputed); frozen for more than `heartbeat_timeout`, every running request was
        recomputed. A component that really died meanwhile is found `heartbeat_timeout` later; one already silent
        past its deadline before the gap stays lost."""
        now = time.time()
        if self._last_look and not 0 <= now - self._last_look <= self.cluster.heartbeat_timeout:
            log.warning("gateway: no heartbeat was read for %.1f s (this process was stopped or starved, or the clock "
                        "stepped): the components' heartbeat deadlines count from now", now - self._last_look)
            for c in self.components:
                if self._silent(c, self._last_look) <= self.cluster.heartbeat_timeout:
                    self.state[c].watched_from = now
        self._last_look = now

    def _silent(self, component: str, now: float) -> float:
        """How long `component` has been silent while this process was listening."""
        st = self.state[component]
        return now - max(st.last_seen, st.watched_from)

    def health(self) -> list[str]:
        now = time.time()
        return [c for c in self.components if self._silent(c, now) > self.cluster.heartbeat_timeout]

    def down(self) -> list[str]:
        """Components past their deadline whose process is not seen running on this host: exited (a zombie too),
        never heard from, or on another host. One whose process still runs is only late (CI under load once starved
        a healthy stage past the 2.5 s deadline and three requests got 503 at once): new requests queue behind it
        until it heartbeats again, or `hang_timeout` kills it and its restart serves them."""
        out = []
        for c in self.health():
            st = self.state[c]
            if not (st.pid and ours(c, st.pid, st.last_seen or None)):
                out.append(c)
        return out

    def lost(self) -> list[str]:
        """Components that heartbeated once and no longer do; those silent for `hang_timeout` are killed here (a
        SIGSTOPped process, a stage whose step loop is stuck: it stops heartbeating after `stall_timeout`) so the
        launcher's Supervisor restarts them, as it does a process that died."""
        out = [c for c in self.health() if self.state[c].last_seen > 0]
        if self.cluster.hang_timeout:
            now = time.time()
            for c in out:
                st = self.state[c]
                if self._silent(c, now) > self.cluster.hang_timeout and st.pid not in st.killed:
                    st.killed.add(st.pid)
                    kill_hung(c, st.pid, now - st.last_seen, st.last_seen)
        return out

    def dump_stacks(self) -> list[str]:
        """Every thread's Python stack into the logs: this process's here, and each component of this host asked
        with SIGUSR2 (their faulthandler writes to their stderr, the serve log). Returns the components asked."""
        faulthandler.dump_traceback(all_threads=True)
        asked = []
        for c in self.components:
            st = self.state[c]
            if st.pid and ours(c, st.pid, st.last_seen or None):
                try:
                    os.kill(st.pid, signal.SIGUSR2)
                    asked.append(c)
                except OSError:
                    pass
        return asked

    def restarted(self) -> list[str]:
        """Components heard from with a new pid since the last call: whatever they held died with the old one."""
        out, self._restarted = sorted(self._restarted), set()
        return out

    # ---- heartbeats and their metrics --------------------------------------------------------------------------
    def attach_metrics(self, metrics) -> None:
        self.metrics = metrics

    def _saw_pid(self, component: str, pid: int) -> bool:
        """`component` is process `pid`: a pid it had before is a replaced process still talking while it stops
        (False: ignore it); a new one is a restart, whose steps in flight the engine core recomputes."""
        st = self.state.setdefault(component, ComponentState())
        if pid in st.retired:
            return False
        if st.pid and pid != st.pid:
            log.warning("gateway: %s restarted (pid %d -> %d)", component, st.pid, pid)
            self._restarted.add(component)
            st.retired.add(st.pid)
            st.pid = pid
        return True

    def _from_new_process(self, msg: StageError) -> bool:
        """A step error from a process of a known component that the gateway has not heard from yet: the restarted
        component failing a plan sent before it started (it lacks those requests' state), which can arrive before
        its first heartbeat. Counted as the restart, not as a failure of the step's requests."""
        st = self.state.get(msg.component)
        if not msg.pid or st is None or not st.pid or msg.pid == st.pid:
            return False
        return self._saw_pid(msg.component, msg.pid)          # (False for a retired pid)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if not self._saw_pid(msg.component, msg.pid):
            return              # the process its successor replaced, heartbeating while it stops: not a restart
        st = self.state[msg.component]
        self._unreachable.discard(msg.component)   # it has bound its inbox: sends wait for the connection again
        now = time.time()
        st.last_seen, st.pid, st.stats = now, msg.pid, msg.stats
        if self.metrics is None:
            return
        if "restarts" in msg.stats:
            self.metrics.set_restarts(msg.component, msg.stats["restarts"])
        if msg.component.startswith("stage"):
            busy = msg.stats.get("busy_seconds", 0.0)
            marks = self._busy_marks.setdefault(msg.component, deque())
            if marks and busy < marks[-1][1]:
                marks.clear()                 # the stage restarted: its busy seconds count from zero again
            while len(marks) > 1 and marks[1][0] <= now - BUSY_WINDOW_S:
                marks.popleft()
            if marks and now > marks[0][0]:
                self.metrics.set_stage_busy(int(msg.component[5:]), (busy - marks[0][1]) / (now - marks[0][0]))
            marks.append((now, busy))
            if "ple_wait_seconds" in msg.stats:
                self.metrics.set_ple_totals(msg.component, stage_wait_seconds=msg.stats["ple_wait_seconds"],
                                            stage_decode_wait_seconds=msg.stats.get("ple_decode_wait_seconds"),
                                            stage_gather_seconds=msg.stats.get("ple_stage_gather_seconds"),
                                            stage_gathers=msg.stats.get("ple_stage_gathers"),
                                            rows_after_launch=msg.stats.get("ple_rows_after_launch"),
                                            wait_timeouts=msg.stats.get("ple_wait_timeouts"))
            self.metrics.set_stage_stats(int(msg.component[5:]), msg.stats)
        elif msg.component == "ple":
            self.metrics.set_ple_totals("ple", prefetch_pages=msg.stats.get("prefetch_pages"),
                                        prefetch_seconds=msg.stats.get("prefetch_seconds"),
                                        gather_seconds=msg.stats.get("gather_seconds"))
