"""Read PLE table pages ahead of the gather, so cold page-cache misses do not stall the forward.

Field reports measured a 100 s time-to-first-token when a long prompt's PLE rows were faulted in one by one from a
cold page cache. As soon as a prompt arrives its rows are known (same n-gram hash), so their pages are read ahead,
long before prefill reaches them. Three methods (cluster key `ple_prefetch_method`):

- `madvise` (`Advisor`): the pages are handed to the kernel with `MADV_WILLNEED`. `process_madvise` takes up to
  IOV_MAX ranges per system call; where it is refused (EPERM in containers, ENOSYS/EINVAL on old kernels) one
  `madvise` per range does the same work with more calls, and the log says so once. The kernel submits the reads
  and returns; the pages land later.
- `fadvise` (`FadviseAdvisor`): the same advice, `posix_fadvise(POSIX_FADV_WILLNEED)` per coalesced range on the
  table file's own descriptor. MADV_WILLNEED on a file mapping ends in the same kernel readahead, but each range
  first finds its VMA and drops and retakes the process's mmap lock: on pages already resident, where only the
  calls cost, process_madvise took 3.4-7 us a range on the 2-core development VM against 0.5-1.0 us for
  posix_fadvise from Python (bench/ple_prefetch_io.py). h200-15's one thread spent 4.9 s in process_madvise for
  ~530k cold pages (~9 us a range) and four threads 4.2 s each: if the calls rather than the drive set that pace,
  this method is the cure.
- `pread` (`PreadReader` over a `ReadPool`): the same page ranges, coalesced, are read with `os.preadv` from the
  table file into per-thread scratch buffers by `ple_prefetch_depth` threads, so that many reads are in flight
  whatever the kernel's readahead path does with a list of small ranges. Buffered, not O_DIRECT: the pages land
  in the page cache that the table's mapping then hits. The file descriptor is the pool's own and carries
  POSIX_FADV_RANDOM, so a read brings in exactly its pages and no readahead window. Costs the GIL a round trip
  per read: on 2 cores a 64-thread pool delayed the main thread's work by up to ~4 ms (p99).

Whichever the method, the prompt prefetcher's workers hash a prompt's batches and wait for each batch's advice
or reads; `cancel` drops a request's queued batches and stops the calls or reads of its batches in flight.
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

from shared.cluster_config import PLE_PREFETCH_METHODS
from shared.ngram_hash import NgramHashSpec, ngram_rows_numpy

log = logging.getLogger(__name__)

__all__ = ["Advisor", "FadviseAdvisor", "PreadReader", "ReadPool", "PromptPrefetcher", "page_ranges", "coalesce_ranges", "IOV_MAX",
           "MADV_WILLNEED", "STATS", "make_advisors"]

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


# The cancellation flag of the batch the calling thread is advising (PromptPrefetcher sets it around each batch): an
# advisor stops between system calls once it is set. Thread-local so `advise(ranges)` keeps its signature.
_scope = threading.local()


def _current_cancel() -> threading.Event | None:
    return getattr(_scope, "cancel", None)


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


def coalesce_ranges(ranges: Sequence[tuple[int, int]], page_size: int, limit: int,
                    max_bytes: int = 0) -> list[tuple[int, int]]:
    """Byte ranges (start, length) -> sorted, page-aligned ranges with overlapping and adjacent ones merged, clipped to
    [0, limit) (the last page of a file whose size is not a page multiple ends at `limit` rounded up to a page), and
    split so none exceeds `max_bytes` (a page multiple; 0: no split). Empty ranges, and ranges wholly outside, go."""
    if not len(ranges):
        return []
    a = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    start = np.maximum(a[:, 0], 0)
    end = np.minimum(a[:, 0] + a[:, 1], limit)
    keep = end > start
    if not keep.any():
        return []
    top = -(-limit // page_size) * page_size
    start = start[keep] // page_size * page_size
    end = np.minimum(-(-end[keep] // page_size) * page_size, top)
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)              # furthest end of any range so far
    new = np.ones(start.shape[0], dtype=bool)
    new[1:] = start[1:] > reach[:-1]                 # a gap before this range: it starts a new run
    first = np.flatnonzero(new)
    starts = start[first]
    ends = reach[np.append(first[1:] - 1, start.shape[0] - 1)]
    out = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        if max_bytes > 0:
            while e - s > max_bytes:
                out.append((s, max_bytes))
                s += max_bytes
        out.append((s, e - s))
    return out


STATS = ("calls", "pages", "ranges", "seconds", "io_seconds", "errors", "fallback", "cancelled_pages")


class _Counters:
    """The counters every prefetch method keeps for the PLE service's heartbeat, and `stats`, their snapshot (keys
    `STATS`). `fallback`: madvise in use where process_madvise was meant (`Advisor`'s; never for the others)."""

    fallback = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0              # system calls made (process_madvise, madvise, fadvise; pread: reads)
        self.pages = 0              # pages advised or read
        self.ranges = 0             # ranges advised
        self.seconds = 0.0          # time the callers spent inside advise()
        self.io_seconds = 0.0       # of it, inside the system calls (pread: summed over the pool's threads)
        self.errors = 0             # ranges the kernel failed on (other than a refusal)
        self.cancelled_pages = 0    # pages left unadvised because their request finished meanwhile

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"calls": float(self.calls), "pages": float(self.pages), "ranges": float(self.ranges),
                    "seconds": self.seconds, "io_seconds": self.io_seconds, "errors": float(self.errors),
                    "fallback": float(self.fallback), "cancelled_pages": float(self.cancelled_pages)}


class Advisor(_Counters):
    """`MADV_WILLNEED` for ranges of one memory mapping (an expanded PLE table), with counters for heartbeats.

    `address`/`length` describe the mapping (address page aligned); ranges passed to `advise` are byte offsets into
    it and are clipped to it. Thread-safe: the prompt prefetcher and the sampled-token path share one Advisor.
    """

    method = "madvise"

    def __init__(self, address: int, length: int, *, row_bytes: int = 0, page_size: int = mmap.PAGESIZE,
                 force_fallback: bool = False) -> None:
        if address % page_size:
            raise ValueError(f"mapping address {address:#x} is not page aligned ({page_size})")
        super().__init__()                       # its lock also guards the log-once flag
        self.address, self.length, self.row_bytes, self.page_size = address, length, row_bytes, page_size
        self.force_fallback = force_fallback
        self._pidfd: int | None = None
        self._pid = -1
        self._refused: str | None = "forced by the caller" if force_fallback else None
        self._logged = False
        self._fd_lock = threading.Lock()         # the pidfd (opened lazily, closed on refusal)

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

    def advise_rows(self, rows: np.ndarray, *, wait: bool = True) -> int:
        """Advise every page of `rows` (table row ids, any shape); returns pages advised. `wait` is for the pread
        method's sake: advice never waits for the reads."""
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
        io = 0.0
        cancel = _current_cancel()
        total = sum(-(-length // self.page_size) for _, length in clipped)
        for batch in self._batches(clipped):
            if cancel is not None and cancel.is_set():      # the request finished: the rest is not needed
                break
            done = False
            t1 = time.perf_counter()
            if self._refused is None:
                ok, n = self._process_madvise_batch(batch)
                calls += n
                done = ok
            if not done:
                c, e = self._madvise_batch(batch)
                calls, errors = calls + c, errors + e
            io += time.perf_counter() - t1
            pages += sum(-(-length // self.page_size) for _, length in batch)
        with self._lock:
            self.calls += calls
            self.pages += pages
            self.ranges += len(clipped)
            self.errors += errors
            self.io_seconds += io
            self.cancelled_pages += total - pages
            self.seconds += time.perf_counter() - t0
        return pages

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


class _FileMethod(_Counters):
    """What the file-descriptor prefetch methods share (`FadviseAdvisor`, `PreadReader`): the table file opened on
    its own descriptor, `advise_rows`, `close`."""

    refusal = None

    def __init__(self, path: str | os.PathLike, length: int, *, row_bytes: int, page_size: int,
                 random_access: bool = False) -> None:
        self.path, self.row_bytes, self.page_size = str(path), row_bytes, page_size
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.file_size = os.fstat(self.fd).st_size
            self.length = min(length, self.file_size)
            if random_access and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            os.close(self.fd)
            raise
        super().__init__()

    def advise_rows(self, rows: np.ndarray, *, wait: bool = True) -> int:
        """Every page of `rows` (table row ids, any shape); returns the pages (queued, with wait=False)."""
        return self.advise(page_ranges(rows, self.row_bytes, self.page_size), wait=wait)

    def advise(self, ranges: Sequence[tuple[int, int]], *, wait: bool = True) -> int:
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class FadviseAdvisor(_FileMethod):
    """The `fadvise` prefetch method for one table file: `posix_fadvise(POSIX_FADV_WILLNEED)` per coalesced page
    range on the file's own descriptor, from the calling thread (the kernel submits the reads and returns, as for
    MADV_WILLNEED, without the mapping's VMA walk and mmap lock). The interface of `Advisor`."""

    method = "fadvise"

    def __init__(self, path: str | os.PathLike, length: int, *, row_bytes: int = 0,
                 page_size: int = mmap.PAGESIZE) -> None:
        super().__init__(path, length, row_bytes=row_bytes, page_size=page_size)

    @classmethod
    def for_table(cls, table) -> FadviseAdvisor:
        t = table.tensor
        return cls(table.path, t.numel() * t.element_size(), row_bytes=table.dim * t.element_size())

    def advise(self, ranges: Sequence[tuple[int, int]], *, wait: bool = True) -> int:
        """Advise these byte ranges; returns pages advised. Never waits for the reads."""
        t0 = time.perf_counter()
        merged = coalesce_ranges(ranges, self.page_size, self.length)
        cancel = _current_cancel()
        fadvise, willneed, fd, page = os.posix_fadvise, os.POSIX_FADV_WILLNEED, self.fd, self.page_size
        calls = pages = errors = skipped = 0
        t1 = time.perf_counter()
        for k, (start, length) in enumerate(merged):
            if cancel is not None and cancel.is_set():
                skipped = sum(-(-n // page) for _, n in merged[k:])
                break
            try:
                fadvise(fd, start, length, willneed)
            except OSError:
                errors += 1
            calls += 1
            pages += -(-length // page)
        t2 = time.perf_counter()
        with self._lock:
            self.calls += calls
            self.pages += pages
            self.ranges += len(merged)
            self.errors += errors
            self.cancelled_pages += skipped
            self.io_seconds += t2 - t1
            self.seconds += t2 - t0
        return pages



class _Job:
    """One `PreadReader.advise` call's reads: split into tasks for the pool, done when every task is."""

    __slots__ = ("reader", "cancel", "tasks_left", "pages", "cancelled_pages", "lock", "done")

    def __init__(self, reader: PreadReader, cancel: threading.Event | None, tasks: int) -> None:
        self.reader, self.cancel, self.tasks_left = reader, cancel, tasks
        self.pages = self.cancelled_pages = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        if tasks == 0:
            self.done.set()

    def task_done(self, pages: int, cancelled_pages: int) -> None:
        with self.lock:
            self.pages += pages
            self.cancelled_pages += cancelled_pages
            self.tasks_left -= 1
            last = self.tasks_left == 0
        if last:
            self.done.set()


class ReadPool:
    """`depth` threads that read byte ranges of files with `os.preadv` into a scratch buffer each: up to `depth`
    reads in flight at once, the queue depth the drive sees (os.preadv releases the GIL while it waits).

    Work comes in tasks of at most `task_ranges` ranges (one queue operation per task, not per read), taken in
    order; a sampled token's few pages (`urgent`) go to the front. Shared by every table's `PreadReader`.
    """

    def __init__(self, depth: int = 32, *, max_read: int = 256 << 10, task_ranges: int = 16) -> None:
        if depth < 1:
            raise ValueError(f"pread prefetch depth must be >= 1, got {depth}")
        if max_read < mmap.PAGESIZE or max_read % mmap.PAGESIZE:
            raise ValueError(f"max_read ({max_read}) must be a positive multiple of the page size")
        self.depth, self.max_read, self.task_ranges = depth, max_read, max(1, task_ranges)
        self._tasks: deque[tuple[_Job, int, list[tuple[int, int]]]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._run, name=f"ple-pread-{i}", daemon=True) for i in range(depth)]
        for t in self._threads:
            t.start()

    def submit(self, reader: PreadReader, ranges: list[tuple[int, int]], cancel: threading.Event | None,
               urgent: bool = False) -> _Job:
        """Queue the reads of `ranges` (coalesced, each at most max_read bytes) of `reader`'s file."""
        chunks = [ranges[i:i + self.task_ranges] for i in range(0, len(ranges), self.task_ranges)]
        job = _Job(reader, cancel, len(chunks))
        if not chunks:
            return job
        with self._cv:
            if self._stop:
                job.tasks_left = 0
                job.done.set()
                return job
            if urgent:
                self._tasks.extendleft((job, reader.fd, c) for c in reversed(chunks))
            else:
                self._tasks.extend((job, reader.fd, c) for c in chunks)
            self._cv.notify(min(len(chunks), self.depth))
        return job

    def pending(self) -> int:
        with self._cv:
            return len(self._tasks)

    def close(self) -> None:
        """Stop the threads; queued tasks are dropped (their jobs end as cancelled), tasks in flight finish."""
        with self._cv:
            self._stop = True
            dropped, self._tasks = self._tasks, deque()
            self._cv.notify_all()
        for job, _, ranges in dropped:
            skipped = sum(-(-n // job.reader.page_size) for _, n in ranges)
            job.reader._account(0, 0, 0, 0.0, skipped)
            job.task_done(0, skipped)
        for t in self._threads:
            t.join(timeout=5.0)

    def _run(self) -> None:
        scratch = memoryview(bytearray(self.max_read))
        views: dict[int, list[memoryview]] = {}          # one iovec list per read length: no slicing per read
        preadv, clock = os.preadv, time.perf_counter
        while True:
            with self._cv:
                while not self._tasks and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job, fd, ranges = self._tasks.popleft()
            page, eof = job.reader.page_size, job.reader.file_size
            cancel = job.cancel
            calls = pages = errors = 0
            skipped = 0
            t0 = clock()
            for k, (start, length) in enumerate(ranges):
                if cancel is not None and cancel.is_set():
                    skipped = sum(-(-n // page) for _, n in ranges[k:])
                    break
                iov = views.get(length)
                if iov is None:
                    iov = views[length] = [scratch[:length]]
                try:
                    got = preadv(fd, iov, start)
                    calls += 1
                    while 0 < got < length and start + got < eof:    # short, not at the file's end: go on
                        more = preadv(fd, [scratch[:length - got]], start + got)
                        calls += 1
                        got = got + more if more > 0 else length
                except OSError:
                    errors += 1
                    continue
                pages += -(-length // page)
            job.reader._account(calls, pages, errors, clock() - t0, skipped)
            job.task_done(pages, skipped)


class PreadReader(_FileMethod):
    """The `pread` prefetch method for one table file: the same interface as `Advisor` (advise, advise_rows, stats,
    close), but the pages are read by a `ReadPool` into the page cache, and `advise` waits for them (unless
    `wait=False`: a sampled token's pages, read without holding up the service loop).

    Ranges are byte offsets into the table, which starts at offset 0 of its file; they are coalesced (adjacent and
    overlapping pages merged into one read) and clipped to the table. The file is opened on its own, with
    POSIX_FADV_RANDOM: a read of a few pages brings in just those pages, with no readahead window around them.
    """

    method = "pread"

    def __init__(self, path: str | os.PathLike, length: int, pool: ReadPool, *, row_bytes: int = 0,
                 page_size: int = mmap.PAGESIZE) -> None:
        super().__init__(path, length, row_bytes=row_bytes, page_size=page_size, random_access=True)
        self.pool = pool

    @classmethod
    def for_table(cls, table, pool: ReadPool) -> PreadReader:
        """A reader of a `shared.ple_table.FlatTable`'s file (the table starts at offset 0)."""
        t = table.tensor
        return cls(table.path, t.numel() * t.element_size(), pool, row_bytes=table.dim * t.element_size())

    def advise(self, ranges: Sequence[tuple[int, int]], *, wait: bool = True) -> int:
        """Read these byte ranges into the page cache. Waits for the reads unless `wait` is False; returns the pages
        read (or queued). Stops early, between reads, when the calling batch is cancelled."""
        t0 = time.perf_counter()
        merged = coalesce_ranges(ranges, self.page_size, self.length, self.pool.max_read)
        with self._lock:
            self.ranges += len(merged)
        job = self.pool.submit(self, merged, _current_cancel(), urgent=not wait)
        if not wait:
            return sum(-(-n // self.page_size) for _, n in merged)
        job.done.wait()
        with self._lock:
            self.seconds += time.perf_counter() - t0
        return job.pages

    def _account(self, calls: int, pages: int, errors: int, seconds: float, cancelled_pages: int = 0) -> None:
        with self._lock:
            self.calls += calls
            self.pages += pages
            self.errors += errors
            self.io_seconds += seconds
            self.cancelled_pages += cancelled_pages



def make_advisors(tables: Sequence, method: str = "madvise", *, depth: int = 32) -> tuple[list, ReadPool | None]:
    """One advisor per `FlatTable` for prefetch method `method` (`ple_prefetch_method`), and the read pool the pread readers
    share (None for the others; the caller closes it after the readers)."""
    if method == "madvise":
        return [Advisor.for_table(t) for t in tables], None
    if method == "fadvise":
        return [FadviseAdvisor.for_table(t) for t in tables], None
    if method == "pread":
        pool = ReadPool(depth)
        try:
            return [PreadReader.for_table(t, pool) for t in tables], pool
        except OSError:
            pool.close()
            raise
    raise ValueError(f"PLE prefetch method {method!r}: expected one of {', '.join(PLE_PREFETCH_METHODS)}")


class PromptPrefetcher:
    """Background threads that advise each new prompt's PLE pages, `batch_tokens` tokens per batch.

    Batching bounds how long `cancel` takes to bite (a finished or dropped request leaves at most the batches in
    flight) and keeps each request's early tokens (the ones prefill needs first) at the front of the queue.
    `threads` workers take batches in queue order: a 32k-token prompt is ~500k random 4 KiB pages, and one thread
    submitting their reads one range at a time kept a cold prefill waiting 1.9 s for rows on the H200 (h200-14; the
    drive's queue stays shallow while one CPU walks the ranges). Cluster key `ple_prefetch_threads`. With the pread
    method each worker waits for its batch's reads, which the readers' pool spreads over its own threads.

    `cancel(req_id)` drops the request's queued batches and flags its batches in flight: an advisor checks the flag
    (set for the calling thread, `_scope`) between system calls, the read pool between reads.
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
        self._running: dict[int, tuple[str, threading.Event]] = {}    # worker ident -> its batch's request, flag
        self._stop = False
        self.batches_interrupted = 0    # batches in flight when their request was cancelled
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

    def submit_prompt(self, req_id: str, prompt: np.ndarray, specs: Sequence[NgramHashSpec], start: int = 0) -> int:
        """Queue a prompt by its token ids, from `start` on; specs[i] hashes advisors[i]'s table. Each batch is
        hashed on the prefetch thread (a 100k-token prompt takes ~80 ms to hash, which the service loop should not
        spend): the hash of a batch needs only the ngram_size - 1 raw ids before it, so batches are independent."""
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
            for s in range(start, prompt.size, self.batch_tokens):
                before = prompt[max(0, s - k):s]
                context = np.concatenate([np.full(k - before.size, specs[0].eos_token_id, dtype=np.int64), before])
                chunk = prompt[s:s + self.batch_tokens]
                self._queue.append((req_id, lambda c=context, t=chunk: [ngram_rows_numpy(sp, c, t)[0]
                                                                        for sp in specs]))
                n += 1
            self._cv.notify_all()
        return n

    def cancel(self, req_id: str) -> int:
        """Drop the request's batches that have not started, and stop the reads of those in flight; returns how many
        were dropped (not counting those in flight)."""
        with self._cv:
            keep = deque(job for job in self._queue if job[0] != req_id)
            dropped = len(self._queue) - len(keep)
            self._queue = keep
            for rid, flag in self._running.values():
                if rid == req_id and not flag.is_set():
                    flag.set()
                    self.batches_interrupted += 1
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
            self._queue.clear()
            for _, flag in self._running.values():         # batches in flight end at their next system call
                flag.set()
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
                flag = threading.Event()
                self._running[threading.get_ident()] = (req_id, flag)
            _scope.cancel = flag
            try:
                if callable(rows):
                    rows = rows()
                for advisor, r in zip(self.advisors, rows):
                    if flag.is_set():
                        break
                    advisor.advise_rows(r)
            except Exception:                   # never let one bad batch end prefetching for everyone
                log.exception("PLE prefetch of request %s failed", req_id)
            finally:
                _scope.cancel = None
                with self._cv:
                    self._running.pop(threading.get_ident(), None)
                    self._busy -= 1
                    self._cv.notify_all()
