"""Read PLE table pages ahead of the gather, so cold page-cache misses do not stall the forward.

Field reports measured a 100 s time-to-first-token when a long prompt's PLE rows were faulted in one by one from a
cold page cache. As soon as a prompt arrives its rows are known (same n-gram hash), so their pages are handed to the
kernel with `MADV_WILLNEED` and read in parallel, long before prefill reaches them. `process_madvise` takes up to
IOV_MAX ranges per system call; where it is refused (EPERM in containers, ENOSYS/EINVAL on old kernels) one `madvise`
per range does the same work with more calls, and the log says so once.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from shared.ngram_hash import NgramHashSpec, ngram_rows_numpy

log = logging.getLogger(__name__)

__all__ = ["Advisor", "PromptPrefetcher", "page_ranges", "IOV_MAX", "MADV_WILLNEED"]

MADV_WILLNEED = 3
IOV_MAX = 1024                      # the kernel's UIO_MAXIOV: most iovecs one process_madvise call accepts
_MAX_CALL_BYTES = 1 << 30           # the kernel caps one call's total length near 2 GiB (MAX_RW_COUNT); stay below
# Generic syscall numbers, the same on x86_64 and aarch64.
_SYS_PIDFD_OPEN = 434
_SYS_PROCESS_MADVISE = 440
# errnos that mean "this kernel/container will not do process_madvise": switch to madvise for good.
_REFUSED = {errno.EPERM, errno.ENOSYS, errno.EINVAL, errno.EBADF, errno.EACCES, errno.ESRCH}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def page_ranges(rows: np.ndarray, row_bytes: int, page_size: int, base_offset: int = 0) -> list[tuple[int, int]]:
    """Byte ranges (start, length), page aligned and sorted, covering every page any of `rows` touches.

    A row may straddle a page boundary (or span several pages); duplicate rows and pages collapse, and adjacent or
    overlapping pages merge into one range. `base_offset` is the table's byte offset inside the mapping.
    """
    if row_bytes <= 0 or page_size <= 0:
        raise ValueError(f"row_bytes ({row_bytes}) and page_size ({page_size}) must be positive")
    r = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1))
    if r.size == 0:
        return []
    start = base_offset + r * row_bytes
    first = start // page_size
    last = (start + row_bytes - 1) // page_size
    # rows are sorted, so first and last pages are non-decreasing: a new range starts where a row's first page is
    # beyond the previous row's last page + 1.
    new = np.ones(first.shape[0], dtype=bool)
    new[1:] = first[1:] > last[:-1] + 1
    starts = first[new]
    ends = np.maximum.reduceat(last, np.flatnonzero(new))
    return [(int(s) * page_size, (int(e) - int(s) + 1) * page_size) for s, e in zip(starts, ends)]


class Advisor:
    """`MADV_WILLNEED` for ranges of one memory mapping (an expanded PLE table), with counters for heartbeats.

    `address`/`length` describe the mapping (address page aligned); ranges passed to `advise` are byte offsets into
    it and are clipped to it. Thread-safe: the prompt prefetcher and the sampled-token path share one Advisor.
    """

    def __init__(self, address: int, length: int, *, row_bytes: int = 0, page_size: int = mmap.PAGESIZE,
                 force_fallback: bool = False) -> None:
        if address % page_size:
            raise ValueError(f"mapping address {address:#x} is not page aligned ({page_size})")
        self.address, self.length, self.row_bytes, self.page_size = address, length, row_bytes, page_size
        self.force_fallback = force_fallback
        self._pidfd: int | None = None
        self._pid = -1
        self._refused: str | None = "forced by the caller" if force_fallback else None
        self._logged = False
        self._lock = threading.Lock()            # counters and the log-once flag
        self._fd_lock = threading.Lock()         # the pidfd (opened lazily, closed on refusal)
        self.calls = 0          # system calls made (process_madvise or madvise)
        self.pages = 0          # pages advised
        self.ranges = 0         # ranges advised
        self.seconds = 0.0      # time spent inside advise()
        self.errors = 0         # ranges the kernel failed on (other than a refusal)

    @classmethod
    def for_table(cls, table, *, force_fallback: bool = False) -> Advisor:
        """An Advisor over a `shared.ple_table.FlatTable`'s mapping (the tensor starts at the mapping's start)."""
        t = table.tensor
        return cls(t.data_ptr(), t.numel() * t.element_size(), row_bytes=table.dim * t.element_size(),
                   force_fallback=force_fallback)

    @property
    def fallback(self) -> bool:
        """True once process_madvise is off (refused by the kernel, or forced): madvise per range is in use."""
        return self._refused is not None

    @property
    def refusal(self) -> str | None:
        """Why process_madvise is not used (with the errno), or None while it is."""
        return self._refused

    def advise_rows(self, rows: np.ndarray) -> int:
        """Advise every page of `rows` (table row ids, any shape); returns pages advised."""
        return self.advise(page_ranges(rows, self.row_bytes, self.page_size))

    def advise(self, ranges: Sequence[tuple[int, int]]) -> int:
        """Ask the kernel to read these byte ranges ahead; returns the number of pages advised."""
        t0 = time.perf_counter()
        clipped = []
        for start, length in ranges:
            end = min(start + length, self.length)
            start = max(start, 0)
            if end > start:
                clipped.append((start, end - start))
        calls = pages = errors = 0
        for batch in self._batches(clipped):
            done = False
            if self._refused is None:
                ok, n = self._process_madvise_batch(batch)
                calls += n
                done = ok
            if not done:
                c, e = self._madvise_batch(batch)
                calls, errors = calls + c, errors + e
            pages += sum(-(-length // self.page_size) for _, length in batch)
        with self._lock:
            self.calls += calls
            self.pages += pages
            self.ranges += len(clipped)
            self.errors += errors
            self.seconds += time.perf_counter() - t0
        return pages

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"calls": float(self.calls), "pages": float(self.pages), "ranges": float(self.ranges),
                    "seconds": self.seconds, "errors": float(self.errors), "fallback": float(self.fallback)}

    def close(self) -> None:
        with self._fd_lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None

    # -- internals -----------------------------------------------------------------------------------------------------
    @staticmethod
    def _batches(ranges: list[tuple[int, int]]):
        batch: list[tuple[int, int]] = []
        total = 0
        for start, length in ranges:
            while length > 0:        # a single huge range is split so no call exceeds the kernel's byte cap
                take = min(length, _MAX_CALL_BYTES)
                if batch and (len(batch) == IOV_MAX or total + take > _MAX_CALL_BYTES):
                    yield batch
                    batch, total = [], 0
                batch.append((start, take))
                total += take
                start, length = start + take, length - take
        if batch:
            yield batch

    def _syscall(self, nr: int, *args) -> tuple[int, int]:
        """One raw system call -> (result, errno); a seam for tests that simulate a refusing kernel."""
        ctypes.set_errno(0)
        res = _libc.syscall(ctypes.c_long(nr), *args)
        return int(res), ctypes.get_errno()

    def _get_pidfd(self) -> int:
        pid = os.getpid()
        with self._fd_lock:
            if self._pidfd is None or self._pid != pid:      # a forked child must not advise its parent
                res, err = self._syscall(_SYS_PIDFD_OPEN, ctypes.c_long(pid), ctypes.c_long(0))
                if res < 0:
                    raise OSError(err, f"pidfd_open: {os.strerror(err)}")
                self._pidfd, self._pid = res, pid
            return self._pidfd

    def _process_madvise_batch(self, batch: list[tuple[int, int]]) -> tuple[bool, int]:
        """(whole batch advised?, calls made). Switches to the fallback for good when the kernel refuses."""
        try:
            pidfd = self._get_pidfd()
        except OSError as exc:
            self._refuse(f"pidfd_open failed: {exc.strerror} (errno {errno.errorcode.get(exc.errno, exc.errno)})")
            return False, 1
        iov = (_IoVec * len(batch))(*[_IoVec(self.address + s, n) for s, n in batch])
        want = sum(n for _, n in batch)
        # Every argument as a full register width: syscall(2) reads its variadic arguments as longs.
        res, err = self._syscall(_SYS_PROCESS_MADVISE, ctypes.c_long(pidfd), iov, ctypes.c_long(len(batch)),
                                 ctypes.c_long(MADV_WILLNEED), ctypes.c_long(0))
        if res == want:
            return True, 1
        if res < 0 and err in _REFUSED:
            self._refuse(f"process_madvise refused: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})")
        elif res < 0:
            log.debug("process_madvise failed (%s); retrying this batch with madvise", os.strerror(err))
        return False, 1       # a short or failed call: the batch is redone range by range

    def _madvise_batch(self, batch: list[tuple[int, int]]) -> tuple[int, int]:
        if self._refused is not None:
            self._log_fallback()
        errors = 0
        for start, length in batch:
            if _libc.madvise(ctypes.c_void_p(self.address + start), ctypes.c_size_t(length), MADV_WILLNEED) != 0:
                errors += 1
        return len(batch), errors

    def _refuse(self, why: str) -> None:
        self._refused = why
        self.close()

    def _log_fallback(self) -> None:
        if self._logged:
            return
        with self._lock:
            if self._logged:
                return
            self._logged = True
        level = logging.INFO if self.force_fallback else logging.WARNING
        log.log(level, "PLE prefetch: process_madvise not used (%s); falling back to one madvise(MADV_WILLNEED) "
                "per page range", self._refused)


class PromptPrefetcher:
    """Background threads that advise each new prompt's PLE pages, `batch_tokens` tokens per batch.

    Batching bounds how long `cancel` takes to bite (a finished or dropped request leaves at most the batches in
    flight) and keeps each request's early tokens (the ones prefill needs first) at the front of the queue.
    `threads` workers take batches in queue order: a 32k-token prompt is ~500k random 4 KiB pages, and one thread
    submitting their reads one range at a time kept a cold prefill waiting 1.9 s for rows on the H200 (h200-14; the
    drive's queue stays shallow while one CPU walks the ranges). Cluster key `ple_prefetch_threads`.
    """

    def __init__(self, advisors: Sequence[Advisor], batch_tokens: int = 1024, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"prefetch threads must be >= 1, got {threads}")
        self.advisors = list(advisors)
        self.batch_tokens = batch_tokens
        # (req_id, rows per advisor, or a callable computing them on the worker)
        self._queue: deque[tuple[str, list[np.ndarray] | Callable[[], list[np.ndarray]]]] = deque()
        self._cv = threading.Condition()
        self._busy = 0                  # batches being advised right now
        self._stop = False
        self.batches_done = 0
        self.batches_cancelled = 0
        self._threads = [threading.Thread(target=self._run, name=f"ple-prefetch-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, req_id: str, rows: Sequence[np.ndarray]) -> int:
        """Queue one prompt: rows[i] is [T, heads] row ids in advisors[i]'s table. Returns batches queued."""
        if len(rows) != len(self.advisors):
            raise ValueError(f"{len(rows)} row arrays for {len(self.advisors)} tables")
        n = rows[0].shape[0] if rows else 0
        with self._cv:
            if self._stop:
                return 0
            k = 0
            for s in range(0, n, self.batch_tokens):
                self._queue.append((req_id, [r[s:s + self.batch_tokens] for r in rows]))
                k += 1
            self._cv.notify_all()
        return k

    def submit_prompt(self, req_id: str, prompt: np.ndarray, specs: Sequence[NgramHashSpec]) -> int:
        """Queue a prompt by its token ids; specs[i] hashes advisors[i]'s table. Each batch is hashed on the
        prefetch thread (a 100k-token prompt takes ~80 ms to hash, which the service loop should not spend): the
        hash of a batch needs only the ngram_size - 1 raw ids before it, so batches are independent."""
        if len(specs) != len(self.advisors):
            raise ValueError(f"{len(specs)} hash specs for {len(self.advisors)} tables")
        prompt = np.array(prompt, dtype=np.int64).reshape(-1)
        if not specs or prompt.size == 0:
            return 0
        k = specs[0].context_len
        with self._cv:
            if self._stop:
                return 0
            n = 0
            for s in range(0, prompt.size, self.batch_tokens):
                before = prompt[max(0, s - k):s]
                context = np.concatenate([np.full(k - before.size, specs[0].eos_token_id, dtype=np.int64), before])
                chunk = prompt[s:s + self.batch_tokens]
                self._queue.append((req_id, lambda c=context, t=chunk: [ngram_rows_numpy(sp, c, t)[0]
                                                                        for sp in specs]))
                n += 1
            self._cv.notify_all()
        return n

    def cancel(self, req_id: str) -> int:
        """Drop the request's batches that have not started; returns how many were dropped."""
        with self._cv:
            keep = deque(job for job in self._queue if job[0] != req_id)
            dropped = len(self._queue) - len(keep)
            self._queue = keep
            self.batches_cancelled += dropped
            self._cv.notify_all()
        return dropped

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the queue is empty and no batch is in flight (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self.batches_cancelled += len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                req_id, rows = self._queue.popleft()
                self._busy += 1
            try:
                if callable(rows):
                    rows = rows()
                for advisor, r in zip(self.advisors, rows):
                    advisor.advise_rows(r)
            except Exception:                   # never let one bad batch end prefetching for everyone
                log.exception("PLE prefetch of request %s failed", req_id)
            finally:
                with self._cv:
                    self._busy -= 1
                    self.batches_done += 1
                    self._cv.notify_all()
