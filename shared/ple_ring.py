"""The PLE gather ring: a shared-memory file the PLE service writes gathered rows into and the PLE stage reads.

Gathering a step's rows from a 95 GiB memory-mapped table can fault on cold pages; doing it in the service process
keeps that off the GPU forward. Slot `step % slots` holds step `step`'s rows as [max_tokens, ple_layers, heads,
head_dim] (the first `PleReady.num_tokens` rows are valid, in StepBatch token order). On a GPU the stage registers the
mapping as pinned memory, so the host-to-device copy of a slot is a plain DMA.

File layout: a 4096-byte header (magic, then a JSON description), then the slots back to back. The service writes the
file under a temporary name and renames it into place, so a reader never sees a half-written header.

Every page is allocated when the ring is made (`posix_fallocate`): a sparse file on a full tmpfs (Docker's 64 MiB
/dev/shm) maps fine and raises SIGBUS at the first write of a page past the free space, killing the service mid-request,
where now it refuses to start with the sizes and what to do. The service holds an exclusive `flock` on the ring for
its life: a ring nobody holds is stale (its service died). A new service reuses a stale ring of the same shape at its
path in place (a stage still mapping it then reads the new service's rows, whatever order systemd restarts them in),
refuses a ring another live service holds (two clusters given one `ple_ring`), and removes the rings `moepipe serve`
launchers killed outright left in the directory (`moepipe-ple-<pid>-<port>.ring`). A stage (`open`) waits for a ring
that a live service holds.

It lives in `shared` because the file's layout is the contract between two services: the PLE service creates the
ring (`create`), a PLE stage maps it (`open`, `pin`), and neither service imports the other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import struct
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from shared.ple_table import unmap

__all__ = ["GatherRing", "RingError", "HEADER_BYTES", "ring_bytes", "remove_stale_rings"]

MAGIC = b"MOEPIPE-PLE-RING"
VERSION = 1
HEADER_BYTES = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UINT_OF_SIZE = {2: np.uint16, 4: np.uint32}
_CUDA_HOST_REGISTER_READ_ONLY = 8         # cudaHostRegisterReadOnly
# the names `moepipe serve` gives its rings (gateway/launcher.py: its pid and port), and their temporary files
_LAUNCHER_RING = re.compile(r"^moepipe-ple-\d+-\d+\.ring(\.tmp\d+)?$")
_TMP_AGE = 60.0           # a temporary ring file younger than this may be one a service is making: left alone
LIVE_WAIT = 120.0         # how long `open` waits for a live service's ring (the stage's wait for the file)


class RingError(ValueError):
    """A ring file that is missing, truncated or not a moepipe PLE ring; the message names the path."""


class GatherRing:
    """A mapped ring file; `slot(i)` is a zero-copy [max_tokens, layers, heads, head_dim] tensor view."""

    def __init__(self, path: Path, mm: mmap.mmap, meta: dict, writable: bool, lock_fd: int | None = None) -> None:
        self.path, self.writable = Path(path), writable
        self._lock_fd = lock_fd            # the service's: an exclusive flock on the ring while it lives
        self.slots, self.max_tokens = int(meta["slots"]), int(meta["max_tokens"])
        self.layers, self.heads, self.head_dim = int(meta["layers"]), int(meta["heads"]), int(meta["head_dim"])
        self.dtype = _DTYPES[meta["dtype"]]
        self.nbytes = len(mm)
        self._mm: mmap.mmap | None = mm
        self._pinned = False
        shape = (self.slots, self.max_tokens, self.layers, self.heads, self.head_dim)
        count = int(np.prod(shape))
        arr = np.frombuffer(mm, dtype=_UINT_OF_SIZE[self.dtype.itemsize], count=count, offset=HEADER_BYTES)
        self._base = np.frombuffer(mm, dtype=np.uint8, count=1)      # only for the mapping's address
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")   # read-only on the stage side
            self.tensor = torch.from_numpy(arr).view(self.dtype).view(shape)

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, *, slots: int, max_tokens: int, layers: int, heads: int, head_dim: int,
               dtype: torch.dtype) -> GatherRing:
        """Service side: create the ring file, every page allocated, and map it read-write, holding its lock.
        A stale ring of the same shape at `path` is reused in place; one a live service holds is refused; either
        failure, and too little room for the ring, is a RingError naming the path, the sizes and what to do."""
        path = Path(path)
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise RingError(f"{path}: ring dtype must be one of {sorted(_DTYPES)}, got {name}")
        for key, v in (("slots", slots), ("max_tokens", max_tokens), ("layers", layers), ("heads", heads),
                       ("head_dim", head_dim)):
            if v < 1:
                raise RingError(f"{path}: {key} must be >= 1, got {v}")
        meta = {"version": VERSION, "slots": slots, "max_tokens": max_tokens, "layers": layers, "heads": heads,
                "head_dim": head_dim, "dtype": name, "byteorder": sys.byteorder}
        size = ring_bytes(slots, max_tokens, layers, heads, head_dim, dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RingError(f"{path.parent}: cannot create the PLE ring's directory ({exc.strerror or exc}); point "
                            f"ple_ring at a writable directory, ideally a tmpfs such as /dev/shm") from None
        remove_stale_rings(path.parent)
        reused = _reuse(path, meta, size)
        if reused is not None:
            return reused
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise RingError(f"{path}: cannot create the PLE ring ({exc.strerror or exc}); point ple_ring at a "
                            f"writable directory, ideally a tmpfs such as /dev/shm") from None
        try:
            _lock(fd)
            _allocate(fd, path, size)
            os.pwrite(fd, _header(meta), 0)
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            if _held_by_live_service(path):
                mm.close()
                raise _held_elsewhere(path)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                mm.close()
                raise RingError(f"{path}: cannot replace the ring there ({exc.strerror or exc}; another user's?): "
                                f"point ple_ring at a file of this user's") from None
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(path, mm, meta, writable=True, lock_fd=fd)

    @classmethod
    def open(cls, path: str | Path, writable: bool = False, wait: float = LIVE_WAIT) -> GatherRing:
        """Stage side: map an existing ring (read-only by default; read-write if it is to be pinned on a GPU
        without cudaHostRegisterReadOnly support). A ring no live service holds (left by one that died) is waited
        for up to `wait` s, until a service holds it (reused in place) or replaces it, so a stage started before its
        restarted service never maps a ring nobody writes; then a RingError says so."""
        path = Path(path)
        deadline, first = time.monotonic() + wait, True
        while True:
            try:
                fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            except FileNotFoundError:
                if time.monotonic() < deadline and not first:
                    time.sleep(0.05)          # a stale ring removed while we waited: its replacement comes
                    continue
                raise RingError(f"{path}: no PLE ring (is the PLE service running?)") from None
            except OSError as exc:
                raise RingError(f"{path}: cannot open the PLE ring ({exc.strerror or exc}); the stage must run as "
                                f"the PLE service's user") from None
            try:
                size = os.fstat(fd).st_size
                meta = _parse_header(path, os.pread(fd, HEADER_BYTES, 0))
                want = ring_bytes(meta["slots"], meta["max_tokens"], meta["layers"], meta["heads"], meta["head_dim"],
                                  _DTYPES[meta["dtype"]])
                if size != want:
                    raise RingError(f"{path}: {size} bytes, the header describes {want}")
                live = _is_locked(fd) is not False
                if live or time.monotonic() >= deadline:
                    if not live:
                        raise RingError(f"{path}: no live PLE service holds this ring (left by one that stopped); "
                                        f"start the PLE service (it reuses or replaces the ring)")
                    mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
                    return cls(path, mm, meta, writable)
            finally:
                os.close(fd)
            first = False
            time.sleep(0.05)

    # -- use -------------------------------------------------------------------------------------------------------
    def slot(self, i: int) -> torch.Tensor:
        """Slot `i` as [max_tokens, layers, heads, head_dim]; a view of the shared memory (no copy)."""
        if not 0 <= i < self.slots:
            raise IndexError(f"ring slot {i} out of range [0, {self.slots})")
        return self.tensor[i]

    def slot_for_step(self, step: int) -> int:
        return step % self.slots

    @property
    def address(self) -> int:
        return int(self._base.ctypes.data)

    def pin(self) -> bool:
        """Register the whole mapping as page-locked CUDA host memory; False (and nothing done) without CUDA."""
        if self._pinned or not torch.cuda.is_available():
            return self._pinned
        flags = 0 if self.writable else _CUDA_HOST_REGISTER_READ_ONLY
        err = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, flags)
        if int(err) != 0:
            raise RuntimeError(f"{self.path}: cudaHostRegister of the PLE ring ({self.nbytes / 2**20:.1f} MiB) "
                               f"failed with CUDA error {int(err)} (a memlock limit? `ulimit -l unlimited`, "
                               f"LimitMEMLOCK=infinity, docker run --ulimit memlock=-1)"
                               + ("" if self.writable else "; open the ring writable=True on GPUs without "
                                  "read-only host registration"))
        self._pinned = True
        return True

    def close(self) -> None:
        """Unpin and unmap. Views of slots still referenced elsewhere keep the mapping alive until collected."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._pinned = False
        self.tensor = torch.empty(0, dtype=self.dtype)
        self._base = np.empty(0, dtype=np.uint8)
        mm, self._mm = self._mm, None
        unmap(mm)
        if self._lock_fd is not None:          # the ring is stale from here: a new service may reuse it
            os.close(self._lock_fd)
            self._lock_fd = None

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> GatherRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ring_bytes(slots: int, max_tokens: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The ring file's size: the header and `slots` x [max_tokens, layers, heads, head_dim] of `dtype`."""
    return HEADER_BYTES + slots * max_tokens * layers * heads * head_dim * dtype.itemsize


def _room_hint(path: Path, size: int) -> str:
    try:
        st = os.statvfs(path.parent)
        free, total = st.f_bavail * st.f_frsize / 2**20, st.f_blocks * st.f_frsize / 2**20
        room = f"{path.parent} has {free:.1f} MiB free of {total:.1f} MiB"
    except OSError:
        room = f"{path.parent} has less free"
    return (f"the PLE gather ring needs {size / 2**20:.1f} MiB of shared memory and {room}: give it more "
            f"(docker run --shm-size=1g or --ipc=host; a larger tmpfs for ple_ring), lower --max-num-batched-tokens "
            f"(max_num_batched_tokens), or run without the PLE service (--no-ple-service)")


def _allocate(fd: int, path: Path, size: int) -> None:
    """Give the file `size` bytes of real pages (tmpfs, disk), or a RingError naming the room there: a sparse ring
    would SIGBUS the writer at the first page past a full tmpfs."""
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
            raise RingError(f"{path}: {_room_hint(path, size)}") from None
        raise RingError(f"{path}: cannot allocate the PLE gather ring ({size} bytes: "
                        f"{exc.strerror or exc})") from None


def _is_locked(fd: int) -> bool | None:
    """Whether another open file holds an exclusive flock on this file (a live service's ring); None where the
    filesystem has no flock (no way to tell)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _lock(fd: int, wait: float = 0.0) -> bool:
    """Take the service's exclusive flock on the ring, trying for `wait` s; False if another holds it. True on a
    filesystem without flock (the ring then works, unguarded)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        except OSError:
            return True


def _held_elsewhere(path: Path) -> RingError:
    return RingError(f"{path}: another live PLE service holds this ring (two clusters given one ple_ring?): give "
                     f"each cluster its own ple_ring, or stop the other one")


def _held_by_live_service(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return bool(_is_locked(fd))
    finally:
        os.close(fd)


def _reuse(path: Path, meta: dict, size: int) -> GatherRing | None:
    """The stale ring at `path`, of this very shape, locked and mapped for a new service: a stage of the cluster
    may still map it (systemd restarts the PLE service alone, or the stage first). None where there is no such
    ring: none there, another shape (then replaced), or not ours to write."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            old = _parse_header(path, os.pread(fd, HEADER_BYTES, 0))
        except RingError:
            old = None
        if old != meta or os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        if not _lock(fd, wait=1.0):          # (a stage's check of the lock holds it shared for a moment)
            raise _held_elsewhere(path)
        _allocate(fd, path, size)              # a ring made before rings were allocated up front
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return GatherRing(path, mm, meta, writable=True, lock_fd=fd)


def remove_stale_rings(directory: str | Path) -> list[Path]:
    """Remove the rings (and temporary ring files) that `moepipe serve` launchers killed outright (SIGKILL, the
    OOM killer) left in `directory`: this user's `moepipe-ple-<pid>-<port>.ring*` files no live service holds.
    Each held up to 40 MiB of /dev/shm (the full shape at 2048 tokens) until the next reboot. Returns them."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for f in entries:
        m = _LAUNCHER_RING.match(f.name)
        if not m:
            continue
        try:
            st = f.stat()
            if st.st_uid != os.getuid() or (m.group(1) and time.time() - st.st_mtime < _TMP_AGE):
                continue
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _is_locked(fd) is not False:
                continue
        finally:
            os.close(fd)
        try:
            f.unlink()
            removed.append(f)
        except OSError:
            pass
    return removed


def _header(meta: dict) -> bytes:
    body = json.dumps(meta, sort_keys=True).encode()
    raw = MAGIC + struct.pack("<I", len(body)) + body
    if len(raw) > HEADER_BYTES:
        raise RingError("ring header too long")
    return raw.ljust(HEADER_BYTES, b"\0")


def _parse_header(path: Path, raw: bytes) -> dict:
    if len(raw) < len(MAGIC) + 4 or not raw.startswith(MAGIC):
        raise RingError(f"{path}: not a moepipe PLE ring (bad magic)")
    (n,) = struct.unpack_from("<I", raw, len(MAGIC))
    try:
        meta = json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    except ValueError as exc:
        raise RingError(f"{path}: unreadable ring header ({exc})") from exc
    if meta.get("version") != VERSION:
        raise RingError(f"{path}: ring version {meta.get('version')} != {VERSION}")
    if meta.get("byteorder") != sys.byteorder:
        raise RingError(f"{path}: written {meta.get('byteorder')}-endian, this machine is {sys.byteorder}")
    if meta.get("dtype") not in _DTYPES:
        raise RingError(f"{path}: unknown ring dtype {meta.get('dtype')!r}")
    return meta
