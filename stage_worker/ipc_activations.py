"""Same-host CUDA IPC handoff of a stage's activations to the next stage (`cuda_ipc_activations`, issue 14).

Without it a non-last stage sends `Activations` from `finish`: after its step has run on the GPU, the hidden state is
copied to the host, framed through ZeroMQ, and the next stage copies it back to its device before it can even
launch (~1.48 ms a step between two stage processes of one H200, docs/performance.md). With it, when both stages are
CUDA stages of one host, the sender owns a small ring of device slots that the receiver maps by CUDA IPC, and a
step that fits a slot is handed over at LAUNCH time:

    sender's stream:    [forward] -> wait consumed[s] -> copy hidden + ids into slot s -> record ready[s]
    sender's host:      ... and at once IpcActivations(step, slot s, use u, shapes) over the existing link
    receiver's stream:  wait ready[s] -> copy slot s out -> record consumed[s] -> [forward]
    receiver's host:    released[s] = u (a shared host array: slot s's consumed record for use u is issued)

Messages (shared/protocol.py): at start the sender sends `IpcOffer` (the ring's memory handle, one interprocess
"ready" event per slot, its host and GPU), and the receiver sends `IpcRequest` (offer me your slots: a restarted
receiver holds nothing of the old session). The receiver answers an offer with `IpcAccept`: one interprocess
"consumed" event per slot and the path of a small shared file (`released`, one int64 per slot) it writes after each
copy out; or `ok=False` and why. Until an accept arrives, and for every step that does not fit a slot (prefill chunks
longer than `max_num_seqs` tokens) or finds every slot still held, the activations take the host path unchanged.

Why a shared array beside the consumed events: a stream's wait on an event waits for the event's LAST RECORD AT THE
TIME OF THE WAIT CALL. The sender may want slot s again before the receiver's host even got to its copy (and its
record) of the slot's previous use; its wait would then pass on an older record and the write would overwrite data
not yet read. So the sender reuses a slot only once `released[s]` says the receiver has issued the record (host
order), and its stream still waits on consumed[s] (device order: the copy out is done). Symmetrically the receiver
waits on ready[s] only after the header arrived, which the sender sends after recording it, and the sender records
ready[s] again only after the slot's release. A slot the receiver drops (a failed step) is released without a copy.
A slot never released (a receiver that died) costs only that slot; a new receiver process asks for a new session.
A stream waiting on an event of a peer that died with the record queued would wait forever while the heartbeats
still flow: `Watchdog` exits the stage then (restarted like any dead stage).

Fallbacks (one log line each, naming why): the switch off, a CPU stage, stages on different hosts (from the
endpoints, then the host name and boot id in the offer), a peer GPU without P2P access, anything the driver or
torch refuses while sharing or opening a handle. The stage worker (`main.py`) holds one `Handoff` per process: its
`sender` to the next stage, its `receiver` from the previous one. Slot memory and events stay mapped on both sides
for the process lifetime.
"""

from __future__ import annotations

import atexit
import logging
import math
import mmap
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.cluster_config import LOOPBACK_HOSTS, ClusterConfig, endpoint_host, stage_name
from shared.protocol import IpcAccept, IpcActivations, IpcOffer, IpcRequest, Message
from stage_worker.runner import Outgoing

log = logging.getLogger("moepipe.stage")

SETUP_MESSAGES = (IpcOffer, IpcRequest, IpcAccept)
_ALIGN = 512                       # slot and region alignment (bytes): every dtype's view of a slot is aligned


# ---- whether to try at all (config) ----------------------------------------------------------------------------
def same_host(a: str, b: str) -> bool:
    """Whether two stages whose inboxes are `a` and `b` run on one host. The receiver's inbox is connected to by the
    sender and (for the setup) the sender's by the receiver, so an `ipc://` or loopback inbox on either side means
    one host; two tcp endpoints count as one host only under the same name (the offer's host id checks it again)."""
    ha, hb = endpoint_host(a), endpoint_host(b)
    if ha is None or hb is None or ha in LOOPBACK_HOSTS or hb in LOOPBACK_HOSTS:
        return True
    return ha == hb


def refusal(cluster: ClusterConfig, sender: int) -> str | None:
    """Why stage `sender`'s activations to stage `sender + 1` keep the host path, judged from the config alone;
    None: try CUDA IPC (the handshake may still refuse)."""
    if not cluster.cuda_ipc_activations:
        return "cuda_ipc_activations is off"
    if not 0 <= sender < cluster.num_stages - 1:
        return f"{stage_name(sender)} has no next stage"
    a, b = cluster.stages[sender], cluster.stages[sender + 1]
    cpu = [stage_name(i) for i, s in ((sender, a), (sender + 1, b)) if not s.device.startswith("cuda")]
    if cpu:
        return f"{' and '.join(cpu)} {'is a CPU stage' if len(cpu) == 1 else 'are CPU stages'}"
    if not same_host(a.endpoint, b.endpoint):
        return f"different hosts ({a.endpoint} and {b.endpoint})"
    return None


def host_id() -> str:
    """This host's name and boot id: IPC handles from a process with another id mean nothing here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# ---- the release array and the slot bookkeeping (no CUDA) ------------------------------------------------------
def release_array(path: str | Path, slots: int, create: bool) -> np.ndarray:
    """`slots` int64 in a small shared file: the receiver's note of each slot's last consumed use (-1: none).
    The receiver creates it (read-write), the sender maps it read-only and unlinks the name."""
    size = 8 * slots
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # its pages allocated now: a sparse file on a full /dev/shm would SIGBUS at the first write; this way a
            # full one is an OSError here, and the handoff keeps the host path (`Receiver.on_offer`)
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.int64)
        arr[:] = -1
        return arr
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.int64)


class SlotRing:
    """The sender's side of slot reuse: which slot the next handoff takes. A slot is free when it was never used
    or the receiver noted (`released`) that it has queued the copy out of its last use and recorded the slot's
    consumed event after it; the sender's stream still waits on that event before writing. No slot free: None (the
    step takes the host path; the sender never blocks on the receiver)."""

    def __init__(self, slots: int, released: np.ndarray) -> None:
        self.last = [-1] * slots           # the use last written into each slot
        self.released = released
        self.next = 0
        self.uses = 0

    def free(self, slot: int) -> bool:
        use = self.last[slot]
        return use < 0 or int(self.released[slot]) >= use

    def acquire(self) -> tuple[int, int] | None:
        n = len(self.last)
        for k in range(n):
            slot = (self.next + k) % n
            if self.free(slot):
                use, self.uses = self.uses, self.uses + 1
                self.last[slot], self.next = use, (slot + 1) % n
                return slot, use
        return None


class Watchdog:
    """A stream waiting on a peer's event never goes on if the peer died with that event's record queued but not
    run (its GPU work is torn down with it). The heartbeats would still flow, so the gateway would never see the
    stage as lost. So each end watches the event after its latest wait on a peer's event: still not done `grace`
    seconds later, with the peer process gone, the stage exits, and the launcher (or systemd) restarts it as it
    does any dead stage."""

    def __init__(self, name: str, grace: float = 3.0, interval: float = 0.5) -> None:
        self.name, self.grace, self.interval = name, grace, interval
        self.latest: tuple | None = None       # (event after the wait, the peer's pid, since)
        self.thread: threading.Thread | None = None

    def watch(self, event, pid: int) -> None:
        self.latest = (event, pid, time.monotonic())
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="ipc-watchdog", daemon=True)
            self.thread.start()

    def stuck(self) -> bool:
        if self.latest is None:
            return False
        event, pid, since = self.latest
        return time.monotonic() - since > self.grace and not event.query() and not _alive(pid)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                stuck = self.stuck()
            except Exception:                 # noqa: BLE001 (a query that fails: nothing to judge by)
                continue
            if stuck:
                log.error("%s: the GPU waits for an event of process %d, which died; exiting so that this stage is "
                          "restarted", self.name, self.latest[1])
                os._exit(70)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the CUDA primitives (tests swap in a fake) ----------------------------------------------------------------
class CudaOps:
    """torch's own CUDA IPC primitives: `UntypedStorage._share_cuda_` / `_new_shared_cuda` (what
    torch.multiprocessing's `reduce_tensor` / `rebuild_cuda_tensor` send and call) for the ring, and interprocess
    `torch.cuda.Event`s."""

    @staticmethod
    def stream(device: torch.device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def device_uuid(device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    @staticmethod
    def share(ring: torch.Tensor) -> dict:
        (_, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = ring.untyped_storage()._share_cuda_()
        return {"handle": handle, "size": size, "offset": offset, "ref_handle": ref_handle, "ref_offset": ref_offset,
                "event_handle": event_handle, "event_sync": event_sync, "storage_offset": ring.storage_offset()}

    @staticmethod
    def open(desc: dict, device: torch.device, nbytes: int) -> torch.Tensor:
        """The sender's ring as a uint8 tensor of this process, on `device` (this stage's own GPU: for a ring on
        another GPU the driver maps it as peer memory, so no context is made on that GPU)."""
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(), desc["handle"], desc["size"],
            desc["offset"], desc["ref_handle"], desc["ref_offset"], desc["event_handle"], desc["event_sync"])
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, desc["storage_offset"], (nbytes,), (1,))

    @staticmethod
    def new_event(device: torch.device):
        """An interprocess event on `device` and its handle."""
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            return event, bytes(event.ipc_handle())

    @staticmethod
    def open_event(handle: bytes, device: torch.device):
        return torch.cuda.Event.from_ipc_handle(device, handle)

    @staticmethod
    def done_event(device: torch.device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @staticmethod
    def peer_refusal(device: torch.device, uuid: str) -> str | None:
        """Why this stage's GPU cannot read memory of the GPU `uuid`; None where it can, or where that GPU is not
        visible here (then the driver decides when the handle is opened)."""
        if device.type != "cuda":
            return f"this stage runs on {device}"
        here = device.index if device.index is not None else torch.cuda.current_device()
        for j in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(j).uuid) == uuid:
                if j != here and not torch.cuda.can_device_access_peer(here, j):
                    return f"cuda:{here} has no P2P access to cuda:{j}"
                return None
        return None


# ---- the two ends ------------------------------------------------------------------------------------------------
@dataclass
class _OutSession:
    id: int
    pid: int = 0                     # the receiver's, once it accepted
    active: bool = False
    consumed: list | None = None
    ring: SlotRing | None = None


class Sender:
    """Stage k's end: the ring (slots x [hidden | ids]) and its ready events, made once for the process; a session
    per accepted offer (consumed events, release array)."""

    def __init__(self, device: torch.device, slots: int, slot_tokens: int, width: int, dtype: torch.dtype,
                 name: str = "stage", ops=CudaOps) -> None:
        self.device, self.slots, self.slot_tokens, self.ops, self.name = device, slots, slot_tokens, ops, name
        elem = torch.empty(0, dtype=dtype).element_size()
        self.ids_offset = _round(slot_tokens * width * elem)
        self.slot_bytes = _round(self.ids_offset + 8 * slot_tokens)
        self.ring = torch.zeros(slots * self.slot_bytes, dtype=torch.uint8, device=device)
        events = [ops.new_event(device) for _ in range(slots)]
        self.ready = [e for e, _ in events]
        self.ready_handles = [h for _, h in events]
        self.memory = ops.share(self.ring)
        self.uuid = ops.device_uuid(device)
        self.session: _OutSession | None = None
        self.watchdog = Watchdog(name)
        self.handoffs = 0            # steps handed over through a slot
        self.too_large = 0           # ... and steps that did not fit a slot, or found none free (host path)
        self.ring_full = 0

    def offer(self) -> IpcOffer:
        self.session = _OutSession(id=int.from_bytes(os.urandom(8), "little") >> 1)
        return IpcOffer(session=self.session.id, pid=os.getpid(), host=host_id(), device_uuid=self.uuid,
                        memory=self.memory, ready_events=self.ready_handles, slot_bytes=self.slot_bytes,
                        ids_offset=self.ids_offset, slot_tokens=self.slot_tokens)

    def on_request(self, msg: IpcRequest) -> list[IpcOffer]:
        """A receiver process asks for slots: a new session, unless this very process holds the current one (its
        request crossed our first offer), whose slots may still hold steps it has not read."""
        s = self.session
        if s is not None and s.active and s.pid == msg.pid:
            return []
        return [self.offer()]

    def on_accept(self, msg: IpcAccept) -> None:
        s = self.session
        try:
            if s is None or msg.session != s.id:
                return                   # the answer to an offer made before the current one
            if not msg.ok:
                log.warning("%s: activations to the next stage keep the host path: it refused CUDA IPC (%s)",
                            self.name, msg.reason)
                return
            try:
                consumed = [self.ops.open_event(h, self.device) for h in msg.consumed_events]
                released = release_array(msg.release_file, self.slots, create=False)
            except Exception as exc:      # noqa: BLE001 (whatever the driver or the file system says)
                log.warning("%s: activations to the next stage keep the host path: its consumed events or release "
                            "file cannot be opened here (%s: %s)", self.name, type(exc).__name__, exc)
                return
            if len(consumed) != self.slots:
                log.warning("%s: activations to the next stage keep the host path: %d consumed events for %d slots",
                            self.name, len(consumed), self.slots)
                return
            s.pid, s.consumed, s.ring, s.active = msg.pid, consumed, SlotRing(self.slots, released), True
            log.info("%s: activations to the next stage over CUDA IPC (%d slots of %d tokens, session %x)",
                     self.name, self.slots, self.slot_tokens, s.id)
        finally:
            if msg.release_file:
                Path(msg.release_file).unlink(missing_ok=True)    # mapped (or not wanted): the name can go

    @property
    def active(self) -> bool:
        return self.session is not None and self.session.active

    def put(self, hidden: torch.Tensor, token_ids: torch.Tensor, host_ids: list[int] | None, step: int,
            timing: list) -> tuple[IpcActivations, object] | None:
        """Queue the step's hidden state and token ids into a free slot behind the step's work, and return the
        header to send now and an event marking the slot's write; None: the host path (no session, too large, no
        free slot)."""
        s = self.session
        if s is None or not s.active:
            return None
        nbytes = hidden.numel() * hidden.element_size()
        if not 0 < hidden.shape[0] <= self.slot_tokens or nbytes > self.ids_offset \
                or token_ids.numel() > self.slot_tokens:
            self.too_large += 1
            return None
        got = s.ring.acquire()
        if got is None:
            self.ring_full += 1
            return None
        slot, use = got
        stream = self.ops.stream(self.device)
        s.consumed[slot].wait(stream)                 # the receiver's copy of the slot's last use is done
        base = slot * self.slot_bytes
        self.ring[base: base + nbytes].view(hidden.dtype).view(hidden.shape).copy_(hidden, non_blocking=True)
        k = token_ids.numel()
        ids = base + self.ids_offset
        self.ring[ids: ids + 8 * k].view(torch.int64).copy_(token_ids.reshape(-1), non_blocking=True)
        self.ready[slot].record(stream)
        self.handoffs += 1
        header = IpcActivations(step=step, session=s.id, slot=slot, use=use, shape=list(hidden.shape),
                                dtype=str(hidden.dtype).removeprefix("torch."), num_ids=k,
                                token_ids=list(host_ids) if host_ids is not None else None, timing=timing)
        done = self.ops.done_event(self.device)
        self.watchdog.watch(done, s.pid)
        return header, done


@dataclass
class _InSession:
    id: int
    ring: torch.Tensor
    ready: list
    consumed: list
    released: np.ndarray
    slot_bytes: int
    ids_offset: int
    pid: int                         # the sender's


class Receiver:
    """Stage k+1's end: one session per accepted offer (the sender's ring and ready events mapped here, consumed
    events and the release array made here), all kept for the process lifetime."""

    def __init__(self, device: torch.device, name: str = "stage", ops=CudaOps, shm_dir: Path | None = None) -> None:
        self.device, self.name, self.ops = device, name, ops
        self.shm_dir = shm_dir or _shm_dir()
        self.sessions: dict[int, _InSession] = {}
        self.files: list[Path] = []
        # What this process has mapped, by handle: a sender offers the same ring and events in each session (two at
        # start, when its first offer crosses our request), and a memory handle is opened once per process.
        self.opened: dict[bytes, object] = {}
        self.watchdog = Watchdog(name)
        self.taken = 0
        atexit.register(self.remove_files)

    def request(self) -> IpcRequest:
        return IpcRequest(pid=os.getpid())

    def on_offer(self, msg: IpcOffer) -> IpcAccept:
        reason = None
        if msg.host != host_id():
            reason = f"different hosts ({msg.host}, here {host_id()})"
        if reason is None:
            reason = self.ops.peer_refusal(self.device, msg.device_uuid)
        if reason is None:
            try:
                return self._accept(msg)
            except Exception as exc:      # noqa: BLE001 (IPC refused by the driver, no shared memory, ...)
                reason = f"{type(exc).__name__}: {exc}"
        log.warning("%s: activations from the previous stage keep the host path: %s", self.name, reason)
        return IpcAccept(session=msg.session, pid=os.getpid(), ok=False, reason=reason)

    def _accept(self, msg: IpcOffer) -> IpcAccept:
        slots = len(msg.ready_events)
        key = repr(sorted(msg.memory.items())).encode()
        if key not in self.opened:
            self.opened[key] = self.ops.open(msg.memory, self.device, slots * msg.slot_bytes)
        ring = self.opened[key]
        for h in msg.ready_events:
            if h not in self.opened:
                self.opened[h] = self.ops.open_event(h, self.device)
        ready = [self.opened[h] for h in msg.ready_events]
        events = [self.ops.new_event(self.device) for _ in range(slots)]
        path = self.shm_dir / f"moepipe-ipc-{os.getpid()}-{msg.session:x}"
        released = release_array(path, slots, create=True)
        self.files.append(path)
        self.sessions[msg.session] = _InSession(msg.session, ring, ready, [e for e, _ in events], released,
                                                msg.slot_bytes, msg.ids_offset, msg.pid)
        log.info("%s: activations from the previous stage over CUDA IPC (%d slots, session %x)", self.name, slots,
                 msg.session)
        return IpcAccept(session=msg.session, pid=os.getpid(), ok=True, consumed_events=[h for _, h in events],
                         release_file=str(path))

    def take(self, header: IpcActivations) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's hidden state and token ids, copied out of the slot on this stage's stream after the slot's
        ready event; then the consumed event is recorded and the slot released."""
        s = self.sessions.get(header.session)
        if s is None:
            raise RuntimeError(f"step {header.step}'s activations are in CUDA IPC session {header.session:x}, which "
                               f"this stage never accepted")
        stream = self.ops.stream(self.device)
        s.ready[header.slot].wait(stream)
        dtype = getattr(torch, header.dtype)
        nbytes = math.prod(header.shape) * torch.empty(0, dtype=dtype).element_size()
        base = header.slot * s.slot_bytes
        hidden = s.ring[base: base + nbytes].view(dtype).view(header.shape).clone()
        ids = base + s.ids_offset
        token_ids = s.ring[ids: ids + 8 * header.num_ids].view(torch.int64).clone()
        s.consumed[header.slot].record(stream)
        s.released[header.slot] = max(header.use, int(s.released[header.slot]))
        self.watchdog.watch(s.consumed[header.slot], s.pid)
        self.taken += 1
        return hidden, token_ids

    def drop(self, header: IpcActivations) -> None:
        """A step this stage will not run: its slot is free again (nothing reads it)."""
        s = self.sessions.get(header.session)
        if s is not None:
            s.released[header.slot] = max(header.use, int(s.released[header.slot]))

    def remove_files(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)


class Handoff:
    """One stage process's IPC links: `sender` to the next stage, `receiver` from the previous one (either None)."""

    def __init__(self, sender: Sender | None, receiver: Receiver | None) -> None:
        self.sender, self.receiver = sender, receiver

    def start(self) -> list[Outgoing]:
        out = []
        if self.sender is not None:
            out.append(Outgoing("next", self.sender.offer()))
        if self.receiver is not None:
            out.append(Outgoing("prev", self.receiver.request()))
        return out

    def on_setup(self, msg: Message) -> list[Outgoing]:
        if isinstance(msg, IpcOffer) and self.receiver is not None:
            return [Outgoing("prev", self.receiver.on_offer(msg))]
        if isinstance(msg, IpcRequest) and self.sender is not None:
            return [Outgoing("next", o) for o in self.sender.on_request(msg)]
        if isinstance(msg, IpcAccept) and self.sender is not None:
            self.sender.on_accept(msg)
        return []

    def put(self, *args, **kwargs):
        return self.sender.put(*args, **kwargs) if self.sender is not None else None

    def take(self, header: IpcActivations) -> tuple[torch.Tensor, torch.Tensor]:
        if self.receiver is None:
            raise RuntimeError(f"step {header.step}'s activations came by CUDA IPC, which this stage does not take")
        return self.receiver.take(header)

    def drop(self, header: IpcActivations) -> None:
        if self.receiver is not None:
            self.receiver.drop(header)

    def stats(self) -> dict[str, float]:
        out = {}
        if self.sender is not None:
            out.update(ipc_handoffs=float(self.sender.handoffs), ipc_too_large=float(self.sender.too_large),
                       ipc_ring_full=float(self.sender.ring_full))
        if self.receiver is not None:
            out["ipc_taken"] = float(self.receiver.taken)
        return out


def slots_for(cluster: ClusterConfig, launch_depth: int) -> int:
    """Slots in a ring: every step that can be handed over and not yet read (steps in flight; launch depth x
    micro-batches) and one more, so a full pipeline never finds them all held."""
    return max(cluster.steps_in_flight, launch_depth * cluster.num_microbatches) + 1


def no_peer_access(cluster: ClusterConfig, sender: int) -> str | None:
    """Why a link between two different GPUs of this host keeps the host path: a ring on another GPU is mapped as
    peer memory, which needs peer access between the two (consumer cards without NVLink often lack it); None when
    the two stages share a GPU or have peer access."""
    a, b = (cluster.stages[i].device for i in (sender, sender + 1))
    if a == b or not torch.cuda.is_available():
        return None
    da, db = torch.device(a), torch.device(b)
    if da.index is None or db.index is None or da.index == db.index:
        return None
    if da.index >= torch.cuda.device_count() or db.index >= torch.cuda.device_count():
        return None                       # the stage's own device check says what is wrong
    if torch.cuda.can_device_access_peer(da.index, db.index) and torch.cuda.can_device_access_peer(db.index, da.index):
        return None
    return f"no peer access between {a} and {b}"


def _level(why: str) -> int:
    """A CPU stage's refusal is expected (info); any other means a same-host GPU link runs slower than it could."""
    return logging.INFO if why.endswith(("is a CPU stage", "are CPU stages")) else logging.WARNING


def setup(cluster: ClusterConfig, index: int, runner) -> Handoff | None:
    """The stage's links that may go over CUDA IPC (config), or None. Each link the config rules out while the
    switch is on gets one log line naming why (info for a CPU stage, which never has CUDA IPC: the switch is on by
    default; a warning otherwise); a ring the driver refuses to share likewise."""
    if not cluster.cuda_ipc_activations:
        return None
    name = stage_name(index)
    sender = receiver = None
    if index + 1 < cluster.num_stages:
        why = refusal(cluster, index) or no_peer_access(cluster, index)
        if why is None:
            try:
                dtype = next(runner.model.parameters()).dtype
                sender = Sender(runner.device, slots_for(cluster, runner.launch_depth), cluster.max_num_seqs,
                                runner.model.stream_width, dtype, name)
            except Exception as exc:      # noqa: BLE001 (no IPC on this platform or driver)
                why = f"the ring cannot be shared ({type(exc).__name__}: {exc})"
        if why is not None:
            log.log(_level(why), "%s: activations to %s keep the host path: %s", name, stage_name(index + 1), why)
    if index > 0:
        why = refusal(cluster, index - 1) or no_peer_access(cluster, index - 1)
        if why is None:
            receiver = Receiver(runner.device, name)
        else:
            log.log(_level(why), "%s: activations from %s keep the host path: %s", name, stage_name(index - 1), why)
    return Handoff(sender, receiver) if sender is not None or receiver is not None else None
