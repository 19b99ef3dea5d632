"""ple_service.prefetch's pread and fadvise methods (`ple_prefetch_method`): coalesced page ranges read by a pool of
threads into the page cache (or advised with POSIX_FADV_WILLNEED), exactly the requested pages resident afterwards,
cancellation of the work in flight, the service on each, and the method's switches in the cluster config."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ple_service import page_cache, prefetch
from ple_service.prefetch import (
    Advisor, FadviseAdvisor, PreadReader, PromptPrefetcher, ReadPool, coalesce_ranges, page_ranges,
)
from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec, cluster_from_dict, env_overrides

PAGE = mmap.PAGESIZE


def _pages_of(ranges) -> set[int]:
    out = set()
    for start, length in ranges:
        out.update(range(start // PAGE, -(-(start + length) // PAGE)))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# coalescing


def test_coalesce_hand_made_edges():
    P = PAGE
    assert coalesce_ranges([], P, 100 * P) == []
    assert coalesce_ranges([(0, 0), (5 * P, 0)], P, 100 * P) == []                      # empty ranges go
    assert coalesce_ranges([(3 * P, P), (P, P)], P, 100 * P) == [(P, P), (3 * P, P)]    # sorted, gap kept
    assert coalesce_ranges([(P, P), (2 * P, P)], P, 100 * P) == [(P, 2 * P)]            # adjacent pages: one read
    assert coalesce_ranges([(P, 3 * P), (2 * P, P)], P, 100 * P) == [(P, 3 * P)]        # inside another
    assert coalesce_ranges([(P, 2 * P), (2 * P, 3 * P)], P, 100 * P) == [(P, 4 * P)]    # overlapping
    assert coalesce_ranges([(P + 10, 5)], P, 100 * P) == [(P, P)]                       # unaligned: its page
    assert coalesce_ranges([(P - 1, 2)], P, 100 * P) == [(0, 2 * P)]                    # straddles two pages
    assert coalesce_ranges([(P - 1, 1), (P, 1)], P, 100 * P) == [(0, 2 * P)]            # bytes on adjacent pages
    assert coalesce_ranges([(-P, 2 * P)], P, 100 * P) == [(0, P)]                       # clipped at 0
    assert coalesce_ranges([(99 * P, 5 * P)], P, 100 * P) == [(99 * P, P)]              # clipped at the end
    assert coalesce_ranges([(100 * P, P)], P, 100 * P) == []                            # wholly beyond it
    # a file whose size is not a page multiple: its last page is partial and still read as one page
    size = 10 * P + 100
    assert coalesce_ranges([(10 * P, 4 * P)], P, size) == [(10 * P, P)]
    assert coalesce_ranges([(9 * P, P), (10 * P + 50, 10)], P, size) == [(9 * P, 2 * P)]
    assert coalesce_ranges([(10 * P + 100, P)], P, size) == []                         # past the last byte
    # long runs split at max_bytes, so no read exceeds the scratch buffer and one run spreads over the pool
    assert coalesce_ranges([(0, 10 * P)], P, 100 * P, max_bytes=4 * P) == [(0, 4 * P), (4 * P, 4 * P), (8 * P, 2 * P)]
    assert coalesce_ranges([(0, 8 * P)], P, 100 * P, max_bytes=4 * P) == [(0, 4 * P), (4 * P, 4 * P)]


@pytest.mark.parametrize("seed", range(4))
def test_coalesce_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    limit = int(rng.integers(50, 400)) * PAGE + int(rng.integers(0, PAGE))
    ranges = [(int(s), int(n)) for s, n in zip(rng.integers(-2 * PAGE, limit + 2 * PAGE, 300),
                                               rng.integers(0, 6 * PAGE, 300))]
    out = coalesce_ranges(ranges, PAGE, limit, max_bytes=8 * PAGE)
    want = set()
    for s, n in ranges:
        s, e = max(s, 0), min(s + n, limit)
        if e > s:
            want.update(range(s // PAGE, -(-e // PAGE)))
    assert _pages_of(out) == want
    assert all(s % PAGE == 0 and 0 < n <= 8 * PAGE and n % PAGE == 0 for s, n in out)
    assert all(a[0] + a[1] <= b[0] for a, b in zip(out, out[1:]))            # sorted, disjoint
    # only the max_bytes split leaves two ranges touching
    assert all(a[0] + a[1] < b[0] or a[1] == 8 * PAGE for a, b in zip(out, out[1:]))


# ---------------------------------------------------------------------------------------------------------------------
# reads land in the page cache: exactly the requested pages


@pytest.fixture
def table_file(tmp_path) -> Path:
    """A file of 300 pages and 100 bytes (its last page partial), on disk and dropped from the page cache."""
    path = tmp_path / "table.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 300 * PAGE + 100, dtype=np.uint8).tobytes())
    page_cache.evict(path)
    try:
        still = int(page_cache.resident(path).sum())
    except OSError as exc:
        pytest.skip(str(exc))
    if still:
        pytest.skip(f"posix_fadvise(DONTNEED) left {still} pages of {path} resident: residency cannot be measured")
    return path


def test_pread_makes_exactly_the_requested_pages_resident(table_file):
    size = table_file.stat().st_size
    pool = ReadPool(depth=8, max_read=4 * PAGE, task_ranges=3)
    reader = PreadReader(table_file, size, pool)
    try:
        ranges = [(0, 1), (5 * PAGE + 7, 10), (6 * PAGE, PAGE), (7 * PAGE - 1, 2),           # pages 0, 5, 6, 7 (5-7 one run)
                  (20 * PAGE, 9 * PAGE),                                                     # 9 pages: reads of 4, 4, 1
                  (100 * PAGE, 2 * PAGE), (101 * PAGE, PAGE),                                # overlap
                  (299 * PAGE, 4 * PAGE),                                                    # the last two pages, the end
                  (-PAGE, PAGE // 2), (400 * PAGE, PAGE)]                                    # outside: nothing
        want = {0, 5, 6, 7, *range(20, 29), 100, 101, 299, 300}
        assert reader.advise(ranges) == len(want)
        res = page_cache.resident(table_file)
        assert set(np.flatnonzero(res).tolist()) == want       # read when advise returns, and nothing else
        st = reader.stats()
        # runs: [0], [5-7], [20-23], [24-27], [28], [100-101], [299-300]; the last read ends at the file's end
        assert st["pages"] == len(want) and st["ranges"] == 7 and st["calls"] == 7 and st["errors"] == 0
        assert st["fallback"] == 0 and st["cancelled_pages"] == 0 and st["seconds"] > 0 and st["io_seconds"] > 0
    finally:
        pool.close()
        reader.close()


def test_pread_through_the_prefetcher_reads_a_prompt_s_pages(table_file):
    """Rows of 320 bytes (a full-shape PLE row) straddle pages: every page any byte of a row lies on is read, in
    batches of the prompt's tokens, and no other page."""
    size = table_file.stat().st_size
    row_bytes = 320
    rng = np.random.default_rng(7)
    rows = rng.integers(0, size // row_bytes, (40, 4))                    # 40 tokens x 4 heads
    want = _pages_of(page_ranges(rows, row_bytes, PAGE))
    pool = ReadPool(depth=4)
    reader = PreadReader(table_file, size, pool, row_bytes=row_bytes)
    pf = PromptPrefetcher([reader], batch_tokens=16, threads=2)
    try:
        assert pf.submit("r", [rows]) == 3
        assert pf.wait_idle()
        assert set(np.flatnonzero(page_cache.resident(table_file)).tolist()) == want
        assert reader.stats()["pages"] == sum(len(_pages_of(page_ranges(rows[s:s + 16], row_bytes, PAGE)))
                                             for s in (0, 16, 32))
    finally:
        pf.stop()
        pool.close()
        reader.close()


def _wait_resident(path: Path, want: set[int], timeout: float = 5.0) -> set[int]:
    """The resident pages once every page of `want` is (advice returns before the reads land), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = set(np.flatnonzero(page_cache.resident(path)).tolist())
        if want <= got or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def test_fadvise_makes_exactly_the_requested_pages_resident(table_file):
    size = table_file.stat().st_size
    adv = FadviseAdvisor(table_file, size, row_bytes=320)
    try:
        ranges = [(0, 1), (5 * PAGE + 7, 10), (6 * PAGE, 2 * PAGE), (20 * PAGE, 9 * PAGE), (299 * PAGE, 4 * PAGE),
                  (-PAGE, PAGE // 2), (400 * PAGE, PAGE)]
        want = {0, 5, 6, 7, *range(20, 29), 299, 300}
        assert adv.advise(ranges) == len(want)
        assert _wait_resident(table_file, want) == want
        st = adv.stats()
        assert st["calls"] == 4 and st["ranges"] == 4 and st["pages"] == len(want) and st["errors"] == 0
        # through the prefetcher: a prompt's rows, and the cancel flag checked between calls
        rows = np.random.default_rng(3).integers(0, size // 320, (30, 4))
        pf = PromptPrefetcher([adv], batch_tokens=10, threads=2)
        try:
            assert pf.submit("r", [rows]) == 3 and pf.wait_idle()
        finally:
            pf.stop()
        rows_pages = _pages_of(page_ranges(rows, 320, PAGE))
        assert _wait_resident(table_file, want | rows_pages) == want | rows_pages
        flag = threading.Event()
        flag.set()
        prefetch._scope.cancel = flag
        try:
            assert adv.advise([(100 * PAGE, PAGE), (102 * PAGE, PAGE)]) == 0
        finally:
            prefetch._scope.cancel = None
        assert adv.stats()["cancelled_pages"] == 2
    finally:
        adv.close()


# ---------------------------------------------------------------------------------------------------------------------
# cancellation and never waiting


class _GatedPreadv:
    """os.preadv that records each read's offset and blocks the first `hold` reads until `gate` is set."""

    def __init__(self, hold: int = 1) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.offsets: list[int] = []
        self.hold = hold
        self._real = os.preadv
        self._lock = threading.Lock()

    def __call__(self, fd, buffers, offset):
        with self._lock:
            self.offsets.append(offset)
            held = len(self.offsets) <= self.hold
        if held:
            self.entered.set()
            assert self.gate.wait(10), "the test never opened the gate"
        return self._real(fd, buffers, offset)


def test_cancel_stops_a_batch_s_reads_in_flight(table_file, monkeypatch):
    """One pool thread held inside the first read of request a's first batch: cancel(a) drops a's queued batches and
    the rest of the batch in flight (its other reads never happen), and b, queued behind, is still read whole."""
    gated = _GatedPreadv()
    monkeypatch.setattr(prefetch.os, "preadv", gated)       # before the pool's threads bind it
    size = table_file.stat().st_size
    pool = ReadPool(depth=1, task_ranges=4)
    reader = PreadReader(table_file, size, pool, row_bytes=PAGE)       # one row = one page
    pf = PromptPrefetcher([reader], batch_tokens=50, threads=1)
    a = (np.arange(150) * 2)[:, None]                  # pages 0, 2, 4, ...: 150 separate reads in 3 batches of 50
    b = (np.arange(10) * 2 + 1)[:, None]               # 10 odd pages
    try:
        assert pf.submit("a", [a]) == 3
        assert pf.submit("b", [b]) == 1
        assert gated.entered.wait(5)
        assert pf.cancel("a") == 2 and pf.batches_interrupted == 1
        gated.gate.set()
        assert pf.wait_idle()
        st = reader.stats()
        assert st["pages"] == 1 + 10                     # a's first read, then b's ten
        assert st["cancelled_pages"] == 49               # the rest of a's batch in flight, never read
        assert gated.offsets[0] == 0 and sorted(gated.offsets[1:]) == [(2 * i + 1) * PAGE for i in range(10)]
        res = page_cache.resident(table_file)
        assert res[0] and not res[2:300:2].any() and res[1:21:2].all()
    finally:
        gated.gate.set()
        pf.stop()
        pool.close()
        reader.close()


def test_madvise_stops_between_calls_when_cancelled():
    """The madvise method checks the batch's flag between system calls (1,024 ranges a process_madvise call)."""
    buf = mmap.mmap(-1, 4000 * PAGE)
    adv = Advisor(np.frombuffer(buf, dtype=np.uint8).ctypes.data, 4000 * PAGE)
    flag = threading.Event()
    real = adv._syscall

    def spy(nr, *args):
        if nr == prefetch._SYS_PROCESS_MADVISE:
            flag.set()                                   # cancelled while the first call runs
        return real(nr, *args)

    adv._syscall = spy
    prefetch._scope.cancel = flag
    try:
        got = adv.advise([(2 * i * PAGE, PAGE) for i in range(1500)])
    finally:
        prefetch._scope.cancel = None
    if adv.fallback:
        pytest.skip(f"process_madvise refused on this machine: {adv.refusal}")
    assert got == prefetch.IOV_MAX and adv.stats()["cancelled_pages"] == 1500 - prefetch.IOV_MAX
    adv.close()


def test_urgent_reads_never_wait_and_go_first(table_file, monkeypatch):
    """`advise(..., wait=False)` (a sampled token's pages, on the service loop) returns at once even while the pool
    is busy, and its reads go before the queued prompt reads."""
    gated = _GatedPreadv()
    monkeypatch.setattr(prefetch.os, "preadv", gated)
    size = table_file.stat().st_size
    pool = ReadPool(depth=1, task_ranges=2)
    reader = PreadReader(table_file, size, pool)
    try:
        waiter = threading.Thread(target=reader.advise, args=([(i * 2 * PAGE, PAGE) for i in range(6)],))
        waiter.start()                                  # a prompt batch: 3 tasks, the first one held in its first read
        assert gated.entered.wait(5)
        t0 = time.perf_counter()
        assert reader.advise([(201 * PAGE, PAGE), (203 * PAGE, PAGE)], wait=False) == 2
        assert time.perf_counter() - t0 < 1.0 and waiter.is_alive()
        gated.gate.set()
        waiter.join(5)
        deadline = time.monotonic() + 5
        while reader.stats()["pages"] < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert reader.stats()["pages"] == 8
        # the held task's second read, then the urgent task, then the rest of the prompt batch
        assert gated.offsets == [p * PAGE for p in (0, 2, 201, 203, 4, 6, 8, 10)]
    finally:
        gated.gate.set()
        pool.close()
        reader.close()


def test_pool_close_ends_queued_jobs_as_cancelled(table_file, monkeypatch):
    gated = _GatedPreadv()
    monkeypatch.setattr(prefetch.os, "preadv", gated)
    pool = ReadPool(depth=1, task_ranges=1)
    reader = PreadReader(table_file, table_file.stat().st_size, pool)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(reader.advise([(i * 2 * PAGE, PAGE) for i in range(5)])))
    waiter.start()
    assert gated.entered.wait(5)
    closer = threading.Thread(target=pool.close)
    closer.start()
    deadline = time.monotonic() + 5
    while pool.pending() and time.monotonic() < deadline:     # close dropped the queued tasks (the thread is held)
        time.sleep(0.001)
    gated.gate.set()
    closer.join(5)
    waiter.join(5)
    assert not waiter.is_alive() and got == [1]          # the read in flight finished; the other four were dropped
    assert reader.stats()["cancelled_pages"] == 4
    assert reader.advise([(0, PAGE)]) == 0               # a closed pool reads nothing and does not hang
    reader.close()


# ---------------------------------------------------------------------------------------------------------------------
# the service on the pread method, and the switches


def _cluster(model: Path, tmp: Path, **kw) -> ClusterConfig:
    stages = [StageSpec(0, 3, f"ipc://{tmp}/s0.sock"), StageSpec(3, 6, f"ipc://{tmp}/s1.sock")]
    base = dict(model=str(model), stages=stages, gateway_endpoint=f"ipc://{tmp}/gw.sock",
                ple_endpoint=f"ipc://{tmp}/ple.sock", ple_ring=str(tmp / "ple.ring"), ple_ring_slots=6,
                max_num_batched_tokens=32)
    base.update(kw)
    return ClusterConfig(**base)


@pytest.mark.parametrize("method", ["pread", "fadvise"])
def test_service_prefetches_with_pread_or_fadvise(tiny_checkpoint, tmp_path, method):
    from ple_service.service import PleService
    from shared.model_config import load_config
    from shared.ngram_hash import initial_context, ngram_rows_numpy
    from shared.protocol import Plan, Sampled, SamplingSpec, SeqEntry, TokenOut

    cfg = load_config(tiny_checkpoint)
    svc = PleService(tiny_checkpoint, cfg, _cluster(tiny_checkpoint, tmp_path, ple_prefetch_method=method,
                                                    ple_prefetch_depth=4))
    try:
        if method == "pread":
            assert svc.read_pool is not None and svc.read_pool.depth == 4
        else:
            assert svc.read_pool is None
        assert all(isinstance(a, PreadReader if method == "pread" else FadviseAdvisor) for a in svc.advisors)
        reader = svc.advisors[0]
        table = svc.tables[svc.layers[0]]
        page_cache.evict(table.path)           # where another process holds pages mapped some stay: no matter
        prompt = [5, 17, 300, 2, 2, 9, 1000]
        spec = SamplingSpec("a", 1.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, None, prompt_ids=prompt)
        svc.on_plan(Plan(step=0, microbatch=0, new_requests=[spec],
                         entries=[SeqEntry("a", 0, 0, len(prompt), [0], tokens=prompt)]))
        assert svc.prefetcher.wait_idle()
        rows, ctx = ngram_rows_numpy(svc.specs[0][1], initial_context(svc.specs[0][1]), np.array(prompt))
        want = _pages_of(page_ranges(rows, reader.row_bytes, PAGE))
        assert reader.stats()["pages"] == len(want)
        # a sampled token's pages are queued for the pool; the service loop does not wait for them
        svc.on_sampled(Sampled(0, 0, [TokenOut("a", len(prompt), 77)]))
        tok_rows, _ = ngram_rows_numpy(svc.specs[0][1], ctx, np.array([77]))
        tok_pages = _pages_of(page_ranges(tok_rows, reader.row_bytes, PAGE))
        deadline = time.monotonic() + 5
        while reader.stats()["pages"] < len(want) + len(tok_pages) and time.monotonic() < deadline:
            time.sleep(0.005)
        st = svc.stats()
        assert st["prefetch_pread"] == (method == "pread") and st["prefetch_fadvise"] == (method == "fadvise")
        assert st["prefetch_pages"] == len(want) + len(tok_pages)
        assert st["prefetch_calls"] > 0 and st["prefetch_errors"] == 0 and st["prefetch_io_seconds"] > 0
        assert want | tok_pages <= _wait_resident(table.path, want | tok_pages)
    finally:
        svc.close()
    assert reader.fd == -1
    assert svc.read_pool is None or not any(t.is_alive() for t in svc.read_pool._threads)


def test_prefetch_method_and_depth_switches(monkeypatch, tmp_path):
    raw = dict(model="m", stages=[dict(start=0, end=2, endpoint="ipc:///tmp/s0")], gateway_endpoint="ipc:///tmp/gw")
    monkeypatch.delenv("MOEPIPE_PLE_PREFETCH_METHOD", raising=False)
    monkeypatch.delenv("MOEPIPE_PLE_PREFETCH_DEPTH", raising=False)
    cfg = cluster_from_dict(raw)
    assert cfg.ple_prefetch_method == "madvise" and cfg.ple_prefetch_depth == 32          # defaults
    cfg = cluster_from_dict({**raw, "ple_prefetch_method": "pread", "ple_prefetch_depth": 8})
    assert (cfg.ple_prefetch_method, cfg.ple_prefetch_depth) == ("pread", 8)
    assert cluster_from_dict({**raw, "ple_prefetch_method": "fadvise"}).ple_prefetch_method == "fadvise"
    monkeypatch.setenv("MOEPIPE_PLE_PREFETCH_METHOD", " PRead ")
    monkeypatch.setenv("MOEPIPE_PLE_PREFETCH_DEPTH", "32")
    assert env_overrides()["ple_prefetch_method"] == "pread"
    cfg = cluster_from_dict(raw)                                          # the environment over the file
    assert (cfg.ple_prefetch_method, cfg.ple_prefetch_depth) == ("pread", 32)
    monkeypatch.setenv("MOEPIPE_PLE_PREFETCH_METHOD", "")                 # VAR= means not set
    assert "ple_prefetch_method" not in env_overrides()
    monkeypatch.setenv("MOEPIPE_PLE_PREFETCH_METHOD", "io_uring")
    with pytest.raises(ClusterConfigError, match=r"ple_prefetch_method \(MOEPIPE_PLE_PREFETCH_METHOD\) 'io_uring' "
                                                 r"must be one of madvise, fadvise, pread"):
        cluster_from_dict(raw)
    monkeypatch.delenv("MOEPIPE_PLE_PREFETCH_METHOD")
    with pytest.raises(ClusterConfigError, match="ple_prefetch_method .*'fast' must be one of madvise, fadvise, pread"):
        cluster_from_dict({**raw, "ple_prefetch_method": "fast"})
    monkeypatch.setenv("MOEPIPE_PLE_PREFETCH_DEPTH", "deep")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_PLE_PREFETCH_DEPTH='deep': expected a whole number"):
        cluster_from_dict(raw)
    monkeypatch.setenv("MOEPIPE_PLE_PREFETCH_DEPTH", "0")
    with pytest.raises(ClusterConfigError, match="ple_prefetch_depth must be >= 1"):
        cluster_from_dict(raw)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ReadPool(depth=0)
    with pytest.raises(ValueError, match="expected one of madvise, fadvise, pread"):
        prefetch.make_advisors([], "mmap")
