"""How fast each way of prefetching PLE table pages makes a cold prompt's pages resident (issue 18).

A file the size of a PLE table is written (or an existing one given with --file), dropped from the page cache
(`posix_fadvise(DONTNEED)`, checked with mincore), and for every method the page set of one unseen prompt is read
ahead exactly as the PLE service does it: a `PromptPrefetcher` in batches of 1,024 tokens, each token 16 random rows
of 320 bytes (the full shape's heads and row size). Each method gets its own random rows, on a freshly evicted file.

Per method: the pages it advised or read, the time until every batch's system calls returned (`calls_s`) and until
mincore saw every requested page resident (`resident_s`, pages/s from it), pages resident that were not asked for,
and from the block device's counters (/sys/dev/block/M:m/stat) the reads it issued, their mean size and the mean
queue depth over the run (time_in_queue / wall time): whether the method keeps the drive's queue deep. Then the same
pages again, now resident (`hot_s`): the cost of the calls alone, the ceiling when the drive is not the limit. A
probe on the main thread (a fixed 2,000-iteration Python loop every millisecond, as the service loop's own work)
shows what the method's threads cost the GIL: its median and p99 time during the run against idle.

Methods (name:N):
  madvise:N          one madvise(MADV_WILLNEED) per range (the fallback), N prefetch threads
  process_madvise:N  process_madvise, up to 1,024 ranges a call (today's default), N prefetch threads
  pread:D            ple_prefetch_method = "pread": a ReadPool of D threads, os.preadv into scratch buffers
                     (--workers prefetch threads feed it, as ple_prefetch_threads)
  fadvise:N          ple_prefetch_method = "fadvise": one posix_fadvise(POSIX_FADV_WILLNEED) per coalesced range on
                     the file's own descriptor (FadviseAdvisor), N prefetch threads
  readahead:N        one readahead(2) per range (through ctypes), N prefetch threads

MADV_WILLNEED on a file mapping, fadvise(WILLNEED) and readahead(2) all end in the kernel's
force_page_cache_readahead: they differ in how many system calls carry the ranges, not in how the reads are issued.

  python bench/ple_prefetch_io.py --size-gib 12 --out bench/results/ple-prefetch-io-1/cpu-vm.json
  python bench/ple_prefetch_io.py --file /tmp/fscold/ple_table...bin --out $OUT/ple_prefetch_io.json   # a table
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ple_service import page_cache  # noqa: E402
from ple_service.prefetch import (  # noqa: E402
    Advisor, FadviseAdvisor, PreadReader, PromptPrefetcher, ReadPool, page_ranges,
)
from bench_io import machine, write_json  # noqa: E402  (bench/, this script's directory)

PAGE = mmap.PAGESIZE
DEFAULT_METHODS = ("madvise:1 madvise:4 process_madvise:1 process_madvise:4 pread:1 pread:8 pread:32 pread:64 "
                   "fadvise:1 fadvise:4 readahead:1")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.readahead.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_size_t]
_libc.readahead.restype = ctypes.c_ssize_t


class _Readahead:
    """readahead(2) per range: the Advisor interface the prefetcher calls."""

    def __init__(self, path: Path, row_bytes: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.row_bytes = row_bytes
        self.lock = threading.Lock()
        self.calls = self.pages = 0
        self.seconds = 0.0

    def advise_rows(self, rows, *, wait: bool = True) -> int:
        t0 = time.perf_counter()
        ranges = page_ranges(rows, self.row_bytes, PAGE)
        ra = _libc.readahead
        for start, length in ranges:
            ra(self.fd, start, length)
        pages = sum(n for _, n in ranges) // PAGE
        with self.lock:
            self.calls += len(ranges)
            self.pages += pages
            self.seconds += time.perf_counter() - t0
        return pages

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {"calls": float(self.calls), "pages": float(self.pages), "seconds": self.seconds,
                    "io_seconds": self.seconds}

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------------------------------------------------------------
# the block device under the file


def _mount_of(path: Path) -> tuple[str, str, str] | None:
    """(mount point, filesystem type, super options) of the mount holding `path`, from /proc/self/mountinfo."""
    best = None
    target = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        point = left.split()[4]
        fields = right.split()
        if len(fields) >= 3 and (target == point or target.startswith(point.rstrip("/") + "/")):
            if best is None or len(point) > len(best[0]):
                best = (point, fields[0], fields[2])
    return best


def block_device(path: Path) -> dict:
    """The block device holding `path`: its sysfs directory, model and queue settings (what is readable). Through
    an overlay, the device of its upper directory; where none is found, every whole disk's counters together."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sysdir = Path(f"/sys/dev/block/{major}:{minor}")
    out: dict = {"dev": f"{major}:{minor}"}
    if not (sysdir / "stat").exists():
        mount = _mount_of(path)
        upper = next((o.split("=", 1)[1] for o in (mount[2].split(",") if mount else []) if o.startswith("upperdir=")),
                     None)
        if mount and mount[1] == "overlay" and upper and Path(upper).exists():
            inner = block_device(Path(upper))
            inner["via"] = f"overlay upperdir {upper}"
            return inner
        disks = [d for d in Path("/sys/block").iterdir()
                 if (d / "device").exists() and not d.name.startswith(("loop", "ram", "zram", "dm-", "md"))]
        out["note"] = (f"no block device for {path} (filesystem {mount[1] if mount else '?'}): the counters are "
                       f"every disk's together ({', '.join(d.name for d in disks) or 'none'})")
        out["stats"] = [str(d / "stat") for d in disks]
        return out
    real = sysdir.resolve()
    out["name"] = real.name
    out["stat"] = str(sysdir / "stat")
    queue = real / "queue" if (real / "queue").exists() else real.parent / "queue"      # a partition: its disk's
    for key in ("nr_requests", "read_ahead_kb", "max_sectors_kb", "rotational", "scheduler", "nr_hw_queues"):
        f = queue / key
        if f.exists():
            out[key] = f.read_text().strip()
    mq = (real if (real / "mq").exists() else real.parent) / "mq"
    if mq.exists():
        out["hw_queues"] = len(list(mq.iterdir()))
    for f in (real / "device" / "model", real.parent / "device" / "model"):
        if f.exists():
            out["model"] = f.read_text().strip()
            break
    return out


def _disk_stat(dev: dict) -> list[int] | None:
    files = [dev["stat"]] if "stat" in dev else dev.get("stats", [])
    if not files:
        return None
    rows = [[int(x) for x in Path(f).read_text().split()[:11]] for f in files]
    return [sum(col) for col in zip(*rows)]


def _disk_delta(a: list[int] | None, b: list[int] | None, wall: float) -> dict:
    if a is None or b is None:
        return {}
    d = [y - x for x, y in zip(a, b)]
    reads, sectors, read_ms, queue_ms = d[0], d[2], d[3], d[10]
    return {"disk_reads": reads, "disk_read_kib": round(sectors * 512 / max(reads, 1) / 1024, 2),
            "disk_read_ms_mean": round(read_ms / max(reads, 1), 4),
            "queue_depth_mean": round(queue_ms / max(wall * 1000, 1e-9), 2),
            "disk_reads_per_s": round(reads / max(wall, 1e-9))}


# ---------------------------------------------------------------------------------------------------------------------
# one method


def _probe_once() -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(2000):
        s += i
    return time.perf_counter() - t0


def _idle_probe(n: int = 300) -> list[float]:
    out = []
    for _ in range(n):
        out.append(_probe_once())
        time.sleep(0.001)
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e6, q)) if xs else 0.0


def run_method(spec: str, path: Path, size: int, rows: np.ndarray, args, dev: dict) -> dict:
    name, _, n = spec.partition(":")
    n = int(n or 1)
    want = np.zeros(-(-size // PAGE), dtype=bool)
    for start, length in page_ranges(rows, args.row_bytes, PAGE):
        want[start // PAGE:(start + length) // PAGE] = True
    wanted = int(want.sum())

    page_cache.evict(path)
    before = int(page_cache.resident(path).sum())

    mm = pool = None
    if name in ("madvise", "process_madvise"):
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        mm.madvise(mmap.MADV_RANDOM)                    # as shared.ple_table.open_table maps a table
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        adv = Advisor(addr, size, row_bytes=args.row_bytes, force_fallback=name == "madvise")
        workers = n
    elif name == "pread":
        pool = ReadPool(n)
        adv = PreadReader(path, size, pool, row_bytes=args.row_bytes)
        workers = args.workers
    elif name == "fadvise":
        adv = FadviseAdvisor(path, size, row_bytes=args.row_bytes)
        workers = n
    elif name == "readahead":
        adv = _Readahead(path, args.row_bytes)
        workers = n
    else:
        raise SystemExit(f"unknown method {spec!r}")

    pf = PromptPrefetcher([adv], batch_tokens=args.batch_tokens, threads=workers)
    probes: list[float] = []
    try:
        d0 = _disk_stat(dev)
        t0 = time.perf_counter()
        pf.submit("cold", [rows])
        while not pf.wait_idle(timeout=0.001):
            probes.append(_probe_once())
        t_calls = time.perf_counter() - t0
        res = page_cache.resident(path)
        deadline = time.perf_counter() + args.timeout
        while (want & ~res).any() and time.perf_counter() < deadline:
            probes.append(_probe_once())
            time.sleep(0.002)
            res = page_cache.resident(path)
        t_res = time.perf_counter() - t0
        d1 = _disk_stat(dev)
        missing = int((want & ~res).sum())
        extra = int((res & ~want).sum())
        st = adv.stats()

        # the same pages again, resident now: the calls' own cost
        h0 = time.perf_counter()
        pf.submit("hot", [rows])
        pf.wait_idle(timeout=args.timeout)
        hot = time.perf_counter() - h0
    finally:
        pf.stop()
        if pool is not None:
            pool.close()
        adv.close()
        if mm is not None:
            del addr
            mm.close()

    out = {"method": spec, "workers": workers, "pages": wanted, "resident_before": before,
           "calls": int(st["calls"]), "calls_s": round(t_calls, 3), "resident_s": round(t_res, 3),
           "pages_per_s": round(wanted / t_res) if not missing else None, "missing": missing, "extra_resident": extra,
           "advise_s_summed": round(st["seconds"], 3), "io_s_summed": round(st.get("io_seconds", 0.0), 3),
           "hot_s": round(hot, 3), "hot_pages_per_s": round(wanted / hot),
           "probe_us_p50": round(_pct(probes, 50), 1), "probe_us_p99": round(_pct(probes, 99), 1)}
    if name == "process_madvise" and getattr(adv, "fallback", False):
        out["note"] = f"process_madvise refused ({adv.refusal}): this ran madvise per range"
    out.update(_disk_delta(d0, d1, t_res))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the calls alone


def call_costs(path: Path, size: int, row_bytes: int, region: int = 1 << 30, tokens: int = 4096,
               reps: int = 3) -> dict[str, float]:
    """Microseconds a range for each primitive, one thread, on pages already resident (the first `region` bytes of
    the file read in first): what the calls cost when the drive is not the limit. Best of `reps`."""
    region = min(region, size) // PAGE * PAGE
    fd = os.open(path, os.O_RDONLY)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        buf = memoryview(bytearray(1 << 20))
        for off in range(0, region, 1 << 20):                   # read the region in
            os.preadv(fd, [buf[:min(1 << 20, region - off)]], off)
        mm.madvise(mmap.MADV_RANDOM)
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        rng = np.random.default_rng(1)
        best: dict[str, float] = {}
        for _ in range(reps):
            ranges = page_ranges(rng.integers(0, region // row_bytes - 1, (tokens, 16)), row_bytes, PAGE)
            n = len(ranges)
            times = {}
            adv = Advisor(addr, size)
            t = time.perf_counter()
            adv.advise(ranges)
            times["process_madvise" if not adv.fallback else "process_madvise (refused)"] = time.perf_counter() - t
            adv.close()
            adv = Advisor(addr, size, force_fallback=True)
            t = time.perf_counter()
            adv.advise(ranges)
            times["madvise"] = time.perf_counter() - t
            fadvise, will = os.posix_fadvise, os.POSIX_FADV_WILLNEED
            t = time.perf_counter()
            for start, length in ranges:
                fadvise(fd, start, length, will)
            times["fadvise"] = time.perf_counter() - t
            ra = _libc.readahead
            t = time.perf_counter()
            for start, length in ranges:
                ra(fd, start, length)
            times["readahead"] = time.perf_counter() - t
            preadv = os.preadv
            t = time.perf_counter()
            for start, length in ranges:
                preadv(fd, [buf[:length]], start)
            times["preadv"] = time.perf_counter() - t
            for k, v in times.items():
                best[k] = min(best.get(k, float("inf")), v / n * 1e6)
        del addr
        return {k: round(v, 2) for k, v in best.items()}
    finally:
        mm.close()
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------------


def write_file(path: Path, size: int) -> None:
    chunk = 64 << 20
    block = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(chunk, left)
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    print(f"wrote {size / 2**30:.1f} GiB to {path} in {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, help="an existing file (a PLE table) to read; kept as it is")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where to write the test file (without --file)")
    ap.add_argument("--size-gib", type=float, default=12.0, help="size of the written file (11.9 GiB: the H200's)")
    ap.add_argument("--keep", action="store_true", help="keep the written file (reused by a later run of the same size)")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt tokens (32k: ~530k pages of a 12 GiB table)")
    ap.add_argument("--heads", type=int, default=16, help="random rows a token (one per n-gram head)")
    ap.add_argument("--row-bytes", type=int, default=320, help="bytes a row (160 bf16: the full shape)")
    ap.add_argument("--batch-tokens", type=int, default=1024, help="tokens a prefetch batch (the service's 1,024)")
    ap.add_argument("--workers", type=int, default=4, help="prefetch threads feeding the pread pool "
                    "(ple_prefetch_threads)")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"space-separated (default: {DEFAULT_METHODS})")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each method (each on fresh rows)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for residency")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args(argv)

    written = None
    if args.file:
        path = args.file
    else:
        path = args.dir / "ple-prefetch-io.bin"
        want_size = int(args.size_gib * 2**30) // PAGE * PAGE
        if not path.exists() or path.stat().st_size != want_size:
            write_file(path, want_size)
        written = path
    size = path.stat().st_size
    dev = block_device(path)
    page_cache.evict(path)
    if page_cache.resident(path).sum():
        print(f"warning: {int(page_cache.resident(path).sum())} pages of {path} stay resident after "
              "posix_fadvise(DONTNEED) (mapped by a process?): those are not cold", flush=True)
    print(f"file {path}: {size / 2**30:.2f} GiB, {size // args.row_bytes:,} rows of {args.row_bytes} bytes; device "
          f"{json.dumps(dev)}", flush=True)
    print(f"prompt: {args.tokens:,} tokens x {args.heads} rows, batches of {args.batch_tokens}", flush=True)
    idle = _idle_probe()
    print(f"idle probe: p50 {_pct(idle, 50):.1f} us, p99 {_pct(idle, 99):.1f} us", flush=True)
    costs = call_costs(path, size, args.row_bytes)
    print("one thread, pages resident, us a range: " + ", ".join(f"{k} {v}" for k, v in costs.items()), flush=True)

    rng = np.random.default_rng(args.seed)
    runs = []
    hdr = (f"{'method':<18} {'pages':>8} {'calls':>8} {'calls s':>8} {'resident s':>10} {'pages/s':>9} "
           f"{'disk reads':>10} {'KiB':>5} {'qd':>6} {'hot pages/s':>11} {'probe p99 us':>12}")
    print(hdr, flush=True)
    try:
        for _ in range(args.repeat):
            for spec in args.methods.split():
                rows = rng.integers(0, size // args.row_bytes, (args.tokens, args.heads))
                r = run_method(spec, path, size, rows, args, dev)
                runs.append(r)
                pps = f"{r['pages_per_s']:,}" if r["pages_per_s"] else f"miss {r['missing']}"
                print(f"{r['method']:<18} {r['pages']:>8,} {r['calls']:>8,} {r['calls_s']:>8.2f} {r['resident_s']:>10.2f} "
                      f"{pps:>9} {r.get('disk_reads', 0):>10,} {r.get('disk_read_kib', 0):>5.1f} "
                      f"{r.get('queue_depth_mean', 0):>6.1f} {r['hot_pages_per_s']:>11,} {r['probe_us_p99']:>12.1f}"
                      + (f"  ({r['note']})" if "note" in r else ""), flush=True)
    finally:
        if written is not None and not args.keep:
            written.unlink(missing_ok=True)
    result = {**machine(), "file": str(path), "size_bytes": size,
              "device": dev, "tokens": args.tokens, "heads": args.heads, "row_bytes": args.row_bytes,
              "batch_tokens": args.batch_tokens, "workers": args.workers,
              "idle_probe_us_p50": round(_pct(idle, 50), 1), "idle_probe_us_p99": round(_pct(idle, 99), 1),
              "call_us_per_range_resident": costs, "runs": runs}
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
