"""Pinned host memory at its exact size, allocated under a host-wide lock (issue 16, memory plan).

Cold experts (and later QSA K/V) live in host RAM that the GPU reads over PCIe, so it must be page-locked. PyTorch's
pinned allocator rounds a request up to a power of two (002 §2: a 33 GiB request holds 64 GiB), which on a 128 GiB
machine decides whether the model runs at all. So a large buffer here is an anonymous mapping of exactly the bytes
asked (rounded up to a page), registered with `cudaHostRegister` when a GPU is present.

Several stage processes on one host start together: each must see what the others took. The check of
`MemAvailable` and the allocation happen under one exclusive `flock` on a file every process on the host opens, and
the pages are faulted in before the lock is released, so the next process's check already sees them gone. A
request that leaves less than `headroom` free is refused with the numbers, not left to the OOM killer.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("moepipe.stage")

GIB = 1 << 30
DEFAULT_LOCK = Path("/dev/shm/moepipe-host-memory.lock") if Path("/dev/shm").is_dir() else \
    Path("/tmp/moepipe-host-memory.lock")


class HostMemoryError(RuntimeError):
    """Host RAM that cannot be had: too little available, or the host lock held too long by another process."""


def available_bytes() -> int:
    """The kernel's estimate of memory available without swapping (`MemAvailable` in /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise HostMemoryError("/proc/meminfo has no MemAvailable line")


@dataclass
class HostBuffer:
    """`nbytes` of host memory as a uint8 tensor; `pinned` when registered with CUDA.

    The registration ends with the mapping: at close(), or when the last view of the memory dies. A mapping unmapped
    while still registered would make the next `cudaHostRegister` at the same address fail (error 712)."""
    tensor: torch.Tensor
    nbytes: int
    mapped: int                               # bytes mapped: nbytes rounded up to a page
    pinned: bool = False
    _release: weakref.finalize | None = field(default=None, repr=False)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if n > self.nbytes:
            raise ValueError(f"a {tuple(shape)} {dtype} view needs {n} bytes, the buffer has {self.nbytes}")
        return self.tensor[:n].view(dtype).view(shape)

    def close(self) -> None:
        """Unregister now; the pages go when the last view does (a view still alive keeps them mapped)."""
        if self._release is not None:
            self._release()
            self._release = None
        self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _unregister(ptr: int, pinned: bool) -> None:
    """Runs once, before the mapping is unmapped (the finalizer fires as the numpy array over it dies)."""
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _open_lock(path: Path) -> int:
    """The lock file's descriptor (`flock` needs no write access): an existing file is opened read-only, so another
    user's lock serves too (created mode 644 by a root server, it refused every other user: PermissionError); a new
    one is made readable by all. Where the shared file cannot be had at all (a read-only /dev/shm, a directory this
    user may not write), one per-user lock instead, with a warning: this user's processes still take turns."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            break
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue                          # another process made it meanwhile: open that one
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            break
        try:
            os.fchmod(fd, 0o644)              # whatever the umask: every user opens it read-only
        except OSError:
            pass
        return fd
    own = Path(tempfile.gettempdir()) / f"moepipe-host-memory-{os.getuid()}.lock"
    log.warning("host-memory lock %s cannot be opened or created by this user; using %s (processes of other users "
                "allocate pinned memory without waiting for this one's)", path, own)
    return os.open(own, os.O_RDONLY | os.O_CREAT, 0o600)


class host_lock:
    """An exclusive `flock` on `path` shared by every process of the host; HostMemoryError after `timeout` s."""

    def __init__(self, path: str | Path = DEFAULT_LOCK, timeout: float = 600.0) -> None:
        self.path, self.timeout = Path(path), timeout
        self._fd: int | None = None

    def __enter__(self) -> "host_lock":
        self._fd = _open_lock(self.path)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    self._fd = None
                    raise HostMemoryError(f"waited {self.timeout:.0f} s for the host-memory lock {self.path} (another "
                                          f"process is allocating; remove the file if no moepipe process runs)") \
                        from None
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def check_free(nbytes: int, what: str = "host buffer", headroom: int = 2 * GIB) -> None:
    """HostMemoryError unless `nbytes` more of host RAM leave `headroom` bytes of MemAvailable. Call it under
    `host_lock` and take the memory (faulted in) before the lock is released, so the next process sees it gone:
    `allocate` does, and so do the expert tables' VRAM + host ranges (`expert_offload`, `expert_vmm_table`)."""
    avail = available_bytes()
    if nbytes + headroom > avail:
        raise HostMemoryError(
            f"{what}: {nbytes / GIB:.2f} GiB of host RAM asked, {avail / GIB:.2f} GiB available (MemAvailable, "
            f"after the other processes of this host) and {headroom / GIB:.2f} GiB must stay free: keep less in "
            f"host RAM (a smaller cold set, --gib-per-stage), or free memory on this host")


def allocate(nbytes: int, *, what: str = "host buffer", headroom: int = 2 * GIB, pin: bool = True,
             lock_path: str | Path = DEFAULT_LOCK, lock_timeout: float = 600.0) -> HostBuffer:
    """`nbytes` of zeroed host memory, mapped at its exact size (to a page), faulted in and (with `pin` and a GPU)
    page-locked, all under the host lock after checking that `headroom` bytes stay available."""
    if nbytes <= 0:
        raise ValueError(f"{what}: nbytes must be > 0, got {nbytes}")
    page = mmap.PAGESIZE
    size = -(-nbytes // page) * page
    with host_lock(lock_path, lock_timeout):
        check_free(size, what, headroom)
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        raw = np.frombuffer(m, dtype=np.uint8)
        raw[::page] = 0                       # fault every page in now (MAP_POPULATE does where it exists)
        tensor = torch.from_numpy(raw)[:nbytes]          # every view holds `raw`, and `raw` holds the mapping
        pinned = False
        if pin and torch.cuda.is_available():
            err = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 0))
            if err != 0:
                hint = ("the range is registered already: an earlier buffer here was unmapped without "
                        "cudaHostUnregister" if err == 712 else
                        "memlock limit? `ulimit -l unlimited` or LimitMEMLOCK=infinity")
                raise HostMemoryError(f"{what}: cudaHostRegister of {size / GIB:.2f} GiB failed with CUDA error "
                                      f"{err} ({hint})")
            pinned = True
        release = weakref.finalize(raw, _unregister, tensor.data_ptr(), pinned)
        del m, raw
    return HostBuffer(tensor=tensor, nbytes=nbytes, mapped=size, pinned=pinned, _release=release)
