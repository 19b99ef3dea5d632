"""Which pages of a file the page cache holds, and dropping them: what a cold start of the PLE table means.

`bench/serve.py --cold` evicts the table before each request on unseen text and reports how much was still
resident; the prefetch tests check that advised pages became resident. Eviction (`posix_fadvise(DONTNEED)` after
the file's dirty pages are on disk) drops only pages no process has mapped in: a running server keeps the rows it
already read, which is why a cold measurement uses text the server has never seen.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def evict(path: str | Path) -> None:
    """Write the file's dirty pages back, then ask the kernel to drop its cached pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


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
