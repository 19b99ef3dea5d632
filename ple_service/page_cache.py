"""Which pages of a file the page cache holds, and dropping them: what a cold start of the PLE table means.

`bench/serve.py --cold` evicts the table before each request on unseen text and reports how much was still
resident; the prefetch tests check that advised pages became resident. `posix_fadvise(DONTNEED)` (after the file's
dirty pages are on disk) drops only pages no process has mapped in, and a process that reads rows of a file the page
cache holds in large folios (a table just written sequentially) maps whole folios at a fault: on the H200's kernel
6.18 the PLE service had all 11.9 GiB of a fresh table mapped after ~5k tokens of warm-up. So `evict(pids=...)`
first asks the kernel to page out those processes' mappings of the file (`process_madvise(MADV_PAGEOUT)`, which
needs CAP_SYS_NICE over the target: root on the device), then drops the cache.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

from ple_service.prefetch import _SYS_PIDFD_OPEN, _SYS_PROCESS_MADVISE, _IoVec

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.syscall.restype = ctypes.c_long

MADV_PAGEOUT = 21


def mapped_ranges(path: str | Path, pid: int) -> list[tuple[int, int]]:
    """(address, length) of each of process `pid`'s mappings of `path`, from /proc/PID/maps ([] if unreadable)."""
    target = os.path.realpath(path)
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) == 6 and head[5].strip() == target:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    out.append((lo, hi - lo))
    except OSError:
        pass
    return out


def page_out(path: str | Path, pid: int) -> str | None:
    """Ask the kernel to reclaim process `pid`'s mapped pages of `path` (MADV_PAGEOUT); None when done, else why
    not (the errno's text: EPERM without CAP_SYS_NICE over `pid`, EINVAL on kernels before 5.10)."""
    ranges = mapped_ranges(path, pid)
    if not ranges:
        return None
    pidfd = _libc.syscall(ctypes.c_long(_SYS_PIDFD_OPEN), ctypes.c_long(pid), ctypes.c_long(0))
    if pidfd < 0:
        return f"pidfd_open({pid}): {os.strerror(ctypes.get_errno())}"
    try:
        for lo, n in ranges:
            done = 0
            while done < n:                      # one call moves at most ~2 GiB (MAX_RW_COUNT)
                step = min(n - done, 1 << 30)
                iov = (_IoVec * 1)(_IoVec(lo + done, step))
                res = _libc.syscall(ctypes.c_long(_SYS_PROCESS_MADVISE), ctypes.c_long(pidfd), iov, ctypes.c_long(1),
                                    ctypes.c_long(MADV_PAGEOUT), ctypes.c_long(0))
                if res < 0:
                    return f"process_madvise(MADV_PAGEOUT) on pid {pid}: {os.strerror(ctypes.get_errno())}"
                done += step
    finally:
        os.close(pidfd)
    return None


def evict(path: str | Path, pids: list[int] | tuple[int, ...] = ()) -> list[str]:
    """Page out `pids`' mappings of the file (see the module docstring), write its dirty pages back, then ask the
    kernel to drop its cached pages. Returns why a process's pages could not be paged out ([] when all were)."""
    problems = [why for why in (page_out(path, pid) for pid in pids) if why]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return problems


def resident(path: str | Path) -> np.ndarray:
    """Per page of the file: is it in the page cache (mincore on a fresh mapping that never touches the data).
    Raises OSError where mincore is refused."""
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, dtype=bool)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        arr = np.frombuffer(mm, dtype=np.uint8)
        vec = (ctypes.c_ubyte * (-(-size // PAGE)))()
        if _libc.mincore(arr.ctypes.data, size, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore on {path}: {os.strerror(err)}")
        out = (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
        del arr
        return out
    finally:
        mm.close()


def resident_fraction(paths: list[Path]) -> float:
    """Share of the files' pages in the page cache (0 for no pages)."""
    pages = [resident(p) for p in paths]
    total = sum(p.size for p in pages)
    return float(sum(int(p.sum()) for p in pages)) / total if total else 0.0


def mapped_rss(path: str | Path) -> dict[int, int]:
    """Bytes of `path` each process has faulted into its page tables (`Rss` of its mappings in /proc/PID/smaps):
    the pages `evict` cannot drop. Processes whose smaps can't be read are left out."""
    target = os.path.realpath(path)
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/smaps") as f:
                inside, total = False, 0
                for line in f:
                    head = line.split(maxsplit=6)
                    if head and "-" in head[0] and len(head) >= 5:      # a mapping's header line
                        inside = len(head) >= 6 and head[5].strip() == target
                    elif inside and head[0] == "Rss:":
                        total += int(head[1]) * 1024
        except OSError:
            continue
        if total:
            out[int(entry.name)] = total
    return out
