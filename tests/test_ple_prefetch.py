"""ple_service.prefetch: page ranges of table rows, MADV_WILLNEED through process_madvise or the madvise fallback,
and the prompt prefetcher's batching and cancellation."""

from __future__ import annotations

import errno
import logging
import mmap
import threading
import time

import numpy as np
import pytest

from ple_service import page_cache, prefetch
from ple_service.prefetch import IOV_MAX, Advisor, PromptPrefetcher, page_ranges
from shared.model_config import load_config
from shared.ngram_hash import NgramHashSpec, initial_context, ngram_rows_numpy
from shared.ple_table import open_table
from stage_worker.checkpoint.loader import load_model
from stage_worker.checkpoint.make_model import make_model

PAGE = mmap.PAGESIZE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model, loaded once so its PLE table is expanded beside the checkpoint."""
    path = tmp_path_factory.mktemp("tiny_prefetch")
    make_model("tiny", path)
    model = load_model(path)
    cfg = load_config(path)
    table = model.layers[str(cfg.ple_layer_ids[0] - 1)].ple.table      # wherever the loader put the expansion
    return table.path, NgramHashSpec.from_model_config(cfg, 0)


def _pages(rows: np.ndarray, row_bytes: int, page: int = PAGE, base: int = 0) -> set[int]:
    """Brute force: every page any byte of any row lies on."""
    out = set()
    for r in np.asarray(rows).reshape(-1).tolist():
        start = base + r * row_bytes
        out.update(range(start // page, (start + row_bytes - 1) // page + 1))
    return out


def _range_pages(ranges, page: int = PAGE) -> set[int]:
    out = set()
    for start, length in ranges:
        assert start % page == 0 and length % page == 0 and length > 0
        out.update(range(start // page, (start + length) // page))
    return out


def _prompt(spec: NgramHashSpec, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, spec.vocab_size, n)
    toks[n // 2] = spec.eos_token_id               # the hash resets at EOS: exercise it
    return toks


# ---------------------------------------------------------------------------------------------------------------------
# page_ranges


def test_page_ranges_hand_made():
    p, rb = 4096, 100
    assert page_ranges(np.array([], dtype=np.int64), rb, p) == []
    assert page_ranges(np.array([0]), rb, p) == [(0, 4096)]
    assert page_ranges(np.array([40]), rb, p) == [(0, 8192)]              # bytes 4000..4099 straddle pages 0 and 1
    assert page_ranges(np.array([0, 0, 0, 1]), rb, p) == [(0, 4096)]      # duplicates and same-page rows collapse
    assert page_ranges(np.array([41, 0]), rb, p) == [(0, 8192)]           # pages 0 and 1: adjacent, merged
    assert page_ranges(np.array([0, 82]), rb, p) == [(0, 4096), (8192, 4096)]   # page 1 untouched: two ranges
    assert page_ranges(np.array([[82, 0], [40, 200]]), rb, p) == [(0, 3 * 4096), (16384, 4096)]  # any shape
    assert page_ranges(np.array([0]), rb, p, base_offset=4000) == [(0, 8192)]   # the table starts mid-page
    assert page_ranges(np.array([1]), 10_000, p) == [(8192, 3 * 4096)]   # a row wider than a page: all its pages
    with pytest.raises(ValueError):
        page_ranges(np.array([0]), 0, p)


@pytest.mark.parametrize("row_bytes", [32, 100, 320, 4096, 5000])
def test_page_ranges_match_brute_force(row_bytes):
    rng = np.random.default_rng(row_bytes)
    rows = rng.integers(0, 5000, size=(300, 8))
    ranges = page_ranges(rows, row_bytes, PAGE, base_offset=64)
    assert _range_pages(ranges) == _pages(rows, row_bytes, base=64)
    ends = [s + n for s, n in ranges]
    assert all(ends[i] < ranges[i + 1][0] for i in range(len(ranges) - 1))   # sorted, disjoint, never adjacent


# ---------------------------------------------------------------------------------------------------------------------
# what gets advised


class _Recording(Advisor):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[list[tuple[int, int]]] = []

    def advise(self, ranges):
        self.seen.append(list(ranges))
        return super().advise(ranges)


def test_prompt_prefetch_advises_exactly_the_hashed_rows_pages(tiny):
    path, spec = tiny
    table = open_table(path)
    row_bytes = table.dim * table.tensor.element_size()
    rec = _Recording.for_table(table)
    prompt = _prompt(spec, 10)
    rows, _ = ngram_rows_numpy(spec, initial_context(spec), prompt)
    pf = PromptPrefetcher([rec], batch_tokens=4)
    try:
        assert pf.submit("r1", [rows]) == 3                      # 10 tokens in batches of 4
        assert pf.wait_idle()
    finally:
        pf.stop()
    assert len(rec.seen) == 3
    assert set().union(*(_range_pages(r) for r in rec.seen)) == _pages(rows, row_bytes)
    for k, ranges in enumerate(rec.seen):                        # each batch: its own tokens' pages, nothing else
        assert _range_pages(ranges) == _pages(rows[4 * k:4 * k + 4], row_bytes)
    assert rec.stats()["pages"] == sum(len(_range_pages(r)) for r in rec.seen)

    # by token ids: each batch hashed on the prefetch thread from the raw ids before it gives the same ranges
    by_ids = _Recording.for_table(table)
    pf = PromptPrefetcher([by_ids], batch_tokens=4)
    try:
        assert pf.submit_prompt("r1", prompt, [spec]) == 3
        assert pf.wait_idle()
    finally:
        pf.stop()
    assert by_ids.seen == rec.seen

    # from a position on (a request restored from the prefix cache): only the later tokens' pages
    later = _Recording.for_table(table)
    pf = PromptPrefetcher([later], batch_tokens=4)
    try:
        assert pf.submit_prompt("r1", prompt, [spec], start=6) == 1
        assert pf.wait_idle()
    finally:
        pf.stop()
    assert set().union(*(_range_pages(r) for r in later.seen)) == _pages(rows[6:], row_bytes)
    table.close()


def test_advise_batches_to_iov_max_and_clips():
    buf = mmap.mmap(-1, 3000 * PAGE)
    addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    adv = Advisor(addr, 3000 * PAGE)
    calls: list[int] = []
    real = adv._syscall

    def spy(nr, *args):
        if nr == prefetch._SYS_PROCESS_MADVISE:
            calls.append(args[2].value)
        return real(nr, *args)

    adv._syscall = spy
    ranges = [(2 * i * PAGE, PAGE) for i in range(1500)] + [(3000 * PAGE - PAGE, 10 * PAGE)]   # last one clipped
    assert adv.advise(ranges) == 1501
    if adv.fallback:
        pytest.skip(f"process_madvise refused on this machine: {adv.refusal}")
    assert calls == [IOV_MAX, 1501 - IOV_MAX]
    adv.close()


def test_cancel_drops_pending_batches(tiny):
    path, spec = tiny
    table = open_table(path)
    gate = threading.Event()
    seen: list[int] = []

    class Slow(Advisor):
        def advise_rows(self, rows):
            gate.wait(5)
            seen.append(int(rows.shape[0]))
            return 0

    rows, _ = ngram_rows_numpy(spec, initial_context(spec), _prompt(spec, 50))
    pf = PromptPrefetcher([Slow.for_table(table)], batch_tokens=5)
    try:
        assert pf.submit("a", [rows]) == 10
        assert pf.submit("b", [rows[:7]]) == 2
        deadline = time.monotonic() + 5
        while pf.pending() == 12 and time.monotonic() < deadline:   # the worker has taken a's first batch
            time.sleep(0.001)
        assert pf.cancel("a") == 9
        gate.set()
        assert pf.wait_idle()
    finally:
        pf.stop()
    assert seen == [5, 5, 2]                 # a's batch in flight, then b's two; a's other nine never ran
    table.close()


def test_several_threads_advise_every_batch_at_once_and_cancel_still_bites(tiny):
    """`threads` workers (cluster key ple_prefetch_threads): batches are taken in queue order and advised
    concurrently (three held inside advise at once), every page of the prompt is advised exactly once, and a
    cancel drops what no worker has taken yet."""
    path, spec = tiny
    table = open_table(path)
    row_bytes = table.dim * table.tensor.element_size()
    gate = threading.Event()
    lock = threading.Lock()
    inside, most, seen = [0], [0], []

    class Gated(_Recording):
        def advise(self, ranges):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            gate.wait(5)
            try:
                return super().advise(ranges)
            finally:
                with lock:
                    inside[0] -= 1

    rec = Gated.for_table(table)
    rows, _ = ngram_rows_numpy(spec, initial_context(spec), _prompt(spec, 40))
    pf = PromptPrefetcher([rec], batch_tokens=4, threads=3)
    try:
        assert pf.submit("a", [rows]) == 10
        assert pf.submit("b", [rows[:8]]) == 2
        deadline = time.monotonic() + 5
        while inside[0] < 3 and time.monotonic() < deadline:      # three of a's batches in flight at once
            time.sleep(0.001)
        assert inside[0] == 3 and pf.pending() == 9
        assert pf.cancel("a") == 7
        gate.set()
        assert pf.wait_idle()
        seen = [_range_pages(r) for r in rec.seen]
    finally:
        gate.set()
        pf.stop()
    assert most[0] == 3 and len(seen) == 5                        # a's three in flight, then b's two
    assert set().union(*seen) == _pages(rows[:12], row_bytes) | _pages(rows[:8], row_bytes)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        PromptPrefetcher([rec], threads=0)
    table.close()


# ---------------------------------------------------------------------------------------------------------------------
# the pages really become resident


def _resident(path) -> np.ndarray:
    try:
        return page_cache.resident(path)
    except OSError as exc:
        pytest.skip(str(exc))


def _wait_resident(path, pages: set[int], timeout: float = 5.0) -> set[int]:
    """Pages of `pages` still not resident after waiting for the (asynchronous) readahead to land."""
    deadline = time.monotonic() + timeout
    while True:
        res = _resident(path)
        missing = {p for p in pages if not res[p]}
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.01)


@pytest.mark.parametrize("force_fallback", [False, True], ids=["process_madvise", "madvise_fallback"])
def test_prefetch_makes_prompt_pages_resident(tiny, force_fallback):
    path, spec = tiny
    table = open_table(path)
    try:
        page_cache.evict(path)
        still = int(_resident(path).sum())
        if still:
            pytest.skip(f"posix_fadvise(DONTNEED) left {still} pages of {path} resident: this filesystem does not "
                        "evict on request, so residency cannot be measured")
        prompt = _prompt(spec, 6, seed=3)
        rows, _ = ngram_rows_numpy(spec, initial_context(spec), prompt)
        want = _pages(rows, table.dim * table.tensor.element_size())
        adv = Advisor.for_table(table, force_fallback=force_fallback)
        pf = PromptPrefetcher([adv])
        try:
            pf.submit("r", [rows])
            assert pf.wait_idle()
        finally:
            pf.stop()
        if not force_fallback and adv.fallback:
            pytest.skip(f"process_madvise refused on this machine: {adv.refusal}")
        assert adv.fallback == force_fallback
        missing = _wait_resident(path, want)
        assert not missing, f"{len(missing)} of {len(want)} advised pages never became resident"
        res = _resident(path)
        assert res.sum() < res.size, "the whole table became resident: the advice was not what made pages resident"
        st = adv.stats()
        assert st["pages"] == len(want) and st["errors"] == 0
        if force_fallback:
            assert st["calls"] == st["ranges"]          # one madvise per range
        else:
            assert st["calls"] == 1                     # all ranges in one process_madvise call
        adv.close()
    finally:
        table.close()


# ---------------------------------------------------------------------------------------------------------------------
# the fallback


def _buffer(pages: int = 8) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(-1, pages * PAGE)
    return buf, np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_forced_fallback_logs_once(caplog):
    buf, addr = _buffer()
    adv = Advisor(addr, 8 * PAGE, force_fallback=True)
    with caplog.at_level(logging.INFO, logger="ple_service.prefetch"):
        assert adv.advise([(0, PAGE), (2 * PAGE, 2 * PAGE)]) == 3
        assert adv.advise([(4 * PAGE, PAGE)]) == 1
    msgs = [r for r in caplog.records if "madvise" in r.getMessage()]
    assert len(msgs) == 1 and "forced" in msgs[0].getMessage()
    assert adv.stats()["calls"] == 3 and adv.fallback


def test_refused_process_madvise_falls_back_and_logs_once(caplog):
    buf, addr = _buffer()
    adv = Advisor(addr, 8 * PAGE)
    real = adv._syscall
    made: list[int] = []

    def refuse(nr, *args):
        made.append(nr)
        if nr == prefetch._SYS_PROCESS_MADVISE:
            return -1, errno.EPERM
        return real(nr, *args)

    adv._syscall = refuse
    with caplog.at_level(logging.INFO, logger="ple_service.prefetch"):
        assert adv.advise([(0, PAGE), (2 * PAGE, PAGE)]) == 2       # still advised, by madvise
        assert adv.advise([(4 * PAGE, PAGE)]) == 1
    assert adv.fallback and "EPERM" in adv.refusal
    assert made.count(prefetch._SYS_PROCESS_MADVISE) == 1          # refused once, never retried
    msgs = [r for r in caplog.records if "madvise" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].levelno == logging.WARNING and "EPERM" in msgs[0].getMessage()


def test_evict_pages_out_another_process_s_mapping(tmp_path):
    """A process holding the file mapped keeps the pages it touched past posix_fadvise; `evict(pids=...)` pages its
    mapping out first (what `bench/serve.py --cold` does to the PLE service), and `mapped_rss` sees both states."""
    import subprocess
    import sys

    path = tmp_path / "table.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 22, dtype=np.uint8).tobytes())
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
        "_ = bytes(m[: 1 << 21]); print('mapped', flush=True); sys.stdin.read()"), str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"mapped"
        held = page_cache.mapped_rss(path)
        assert set(held) == {child.pid} and held[child.pid] >= 1 << 21
        assert page_cache.evict(path) == []
        if _resident(path).sum() == 0:
            pytest.skip("the kernel dropped mapped pages on posix_fadvise: nothing to page out here")
        problems = page_cache.evict(path, pids=[child.pid])
        if problems:
            pytest.skip(f"MADV_PAGEOUT refused here: {problems}")
        assert _resident(path).sum() == 0 and page_cache.mapped_rss(path) == {}
    finally:
        child.kill()
        child.wait()
