"""What a host thread may do while a `host_wait` kernel spins on the device (`ple_launch_ahead`), measured on a GPU.

Why (h100-32 call 5): a one-stage server's four streams stopped at tokens 253-255 of 256 for 113 s with nothing
logged, right where the batch shrank from 4 rows to 1 for the first time in the process. On that path `launch(t)`
replays graph t, whose first kernel spins until the host publishes rows that only `finish(t-1)` can publish, and
then queues the eager device sampler (and copies, events, pinned buffers) behind it. Any CUDA call there that waits
for the device to go idle (CUDA's lazy module loading of a kernel used for the first time, a Triton compile's module
load, an allocation that synchronizes) waits for the spinning kernel, which waits for the host: a deadlock broken
then only by `host_wait.MAX_SPINS` polls, whose length in seconds was never measured (h100-33 measured it with this
script: 204 s; the kernel now also gives up after `host_wait.WAIT_TIMEOUT_S` on the GPU clock, which A's calls set
out of reach so that they time polls alone, and `ple_sample_after_rows` keeps the sampler from being queued behind
a spinning graph). This script measures both:

  A. the time a poll takes and so how long `MAX_SPINS` polls last (the backstop behind the timeout);
  B. for each kind of CUDA call, whether it returns at once while a wait kernel spins, or only once the flag is
     written (by a child process after `--release` seconds: a thread of this process may need the GIL the blocked
     call holds). A call that takes ~`--release` s deadlocks behind a waiting graph.

    python tools/host_wait_probe.py                 # A and B, ~1-2 minutes
    python tools/host_wait_probe.py --full          # A also runs MAX_SPINS polls once (may take minutes)

Read the B tables: `blocked` marks a call that waited for the device. The probes run in one process, in order; the
sampler's are the server's (`batch_sampler.sample_rows`, temperature 0.7, the full shape's 248,320-token vocabulary)
at 4 rows first (as the start-up warm-up does, nothing waiting), then at 1, 2 and 3 rows behind a spinning kernel (a
batch that shrinks at the end of requests). A second round (new sizes and ops) puts the same calls behind a stream
wait (`stream_wait.py`, `cuStreamWaitValue64`: stage 0 of several with `ple_launch_ahead_across_stages`, where a
blocked call waits for `PUBLISH_DEADLINE_S`; h200-27's step 256 failed after 60 s at the end of 4 x 256-token
requests).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stage_worker.kernels.host_wait import MAX_SPINS, wait_and_copy  # noqa: E402

VOCAB = 248320


@triton.jit
def _fresh(x, SALT: tl.constexpr):
    """A kernel the probe compiles with a new constant each run: a compile and a module load at its launch."""
    tl.store(x, tl.load(x) + SALT)


class Flag:
    """An int64 in a /dev/shm file, registered as pinned memory: the device polls it, a child process writes it."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="host-wait-probe-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                         else None)
        os.ftruncate(fd, mmap.PAGESIZE)
        self.map = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.int64, count=1)
        self.tensor = torch.from_numpy(self.array)
        err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), mmap.PAGESIZE, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {err}")

    def set(self, value: int) -> None:
        self.array[0] = value

    def release_later(self, seconds: float, value: int) -> subprocess.Popen:
        code = (f"import mmap,os,time,numpy as np\ntime.sleep({seconds})\nfd=os.open({self.path!r},os.O_RDWR)\n"
                f"m=mmap.mmap(fd,{mmap.PAGESIZE})\nnp.frombuffer(m,dtype=np.int64,count=1)[0]={value}\nm.flush()")
        return subprocess.Popen([sys.executable, "-c", code])

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        os.unlink(self.path)


def poll_time(flag: Flag, n: int) -> float:
    """Seconds a wait kernel takes to give up after `n` polls (the flag never reaches the step)."""
    dev = torch.device("cuda")
    src = torch.zeros(2560, dtype=torch.bfloat16).pin_memory()     # one full-shape decode row: 16 heads x 160
    dst = torch.empty(2560, dtype=torch.bfloat16, device=dev)
    expected = torch.ones(1, dtype=torch.int64, device=dev)
    timed_out = torch.zeros(1, dtype=torch.int64, device=dev)
    flag.set(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    wait_and_copy(flag.tensor, expected, src, dst, timed_out, max_spins=n, timeout_s=1e4)   # (polls only)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def behind_a_spin(flag: Flag, what: str, fn, release: float, seq: list[int], waiter=None) -> tuple[str, float,
                                                                                                  float, bool]:
    """Launch a wait kernel that spins until the flag reaches the next number (a child process writes it after
    `release` s), or with `waiter` (a `StreamWait`) a stream wait for it, then time `fn()` on this thread; returns
    (what, seconds fn took, seconds until the device was done, whether fn waited for the release)."""
    dev = torch.device("cuda")
    src = torch.zeros(2560, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty(2560, dtype=torch.bfloat16, device=dev)
    timed_out = torch.zeros(1, dtype=torch.int64, device=dev)
    seq[0] += 1
    expected = torch.full((1,), seq[0], dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    child = flag.release_later(release, seq[0])
    t0 = time.perf_counter()
    if waiter is None:
        wait_and_copy(flag.tensor, expected, src, dst, timed_out)
    else:
        waiter.wait(seq[0])
    t1 = time.perf_counter()
    try:
        fn()
        err = ""
    except Exception as exc:              # a probe that fails says so and the others still run
        err = f" (raised {type(exc).__name__}: {exc})"
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    child.wait()
    gave_up = int(timed_out[0]) == seq[0]
    took = t2 - t1
    return what + err + (" (the wait kernel gave up)" if gave_up else ""), took, t3 - t0, took > 0.5 * release


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", type=float, default=3.0, help="seconds before the child process writes the flag")
    ap.add_argument("--full", action="store_true", help="also time MAX_SPINS polls once")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA_MODULE_LOADING="
          f"{os.environ.get('CUDA_MODULE_LOADING', '(unset: LAZY)')}")
    flag = Flag()
    try:
        poll_time(flag, 1 << 10)                                      # compile
        print("\nA. the wait kernel giving up (host_wait.MAX_SPINS = 2^24 polls)")
        per = []
        for k in (16, 18, 20):
            s = poll_time(flag, 1 << k)
            per.append(s / (1 << k))
            print(f"  2^{k} polls: {s:.3f} s ({s / (1 << k) * 1e6:.2f} us a poll)")
        print(f"  MAX_SPINS polls would take ~{MAX_SPINS * per[-1]:.0f} s")
        if args.full:
            print(f"  MAX_SPINS polls took {poll_time(flag, MAX_SPINS):.1f} s")

        from shared.sampling import SamplingParams
        from stage_worker.batch_sampler import Row, sample_rows
        from stage_worker.host_copy import to_device, to_host

        dev = torch.device("cuda")
        race = True

        def sampler(rows: int):
            logits = torch.randn(rows, VOCAB, device=dev)

            def run():
                specs = [Row(SamplingParams(temperature=0.7, seed=i), i, 100 + i, []) for i in range(rows)]
                to_host(sample_rows(logits, specs, race_kernel=race))
            return run

        def gather(rows: int):
            tokens = torch.arange(max(rows, 8), device=dev)

            def run():
                out = to_device([0] * rows, torch.long, dev)
                out[to_device(list(range(rows)), torch.long, dev)] = tokens[to_device(list(range(rows)), torch.long,
                                                                                     dev)]
            return run

        fresh = torch.zeros(1, dtype=torch.int64, device=dev)
        warm = torch.ones(8, device=dev)
        sampler(4)()                      # as the start-up warm-up: 4 rows, nothing spinning
        gather(4)()
        warm.add_(1)                      # (h100-33's first run had not: its "used before" row was a first use)
        torch.cuda.synchronize()
        seq = [0]

        def probes(rows: list[int], new_op, pinned: int):
            salt = random.randrange(1, 1 << 30)   # a constexpr never compiled before: a compile and a module load
            return [
                ("an op used before (add)", lambda: warm.add_(1)),
                ("event create + record", lambda: torch.cuda.Event().record()),
                ("batch sampler at 4 rows (warmed)", sampler(4)),
                *[(f"batch sampler at {n} row(s) (first time)", sampler(n)) for n in rows],
                (f"batch sampler at {rows[0]} row(s) (again)", sampler(rows[0])),
                (f"input-id gather at {rows[0]} row(s) (first time)", gather(rows[0])),
                ("pinned buffer of a new size", lambda: torch.empty(pinned, dtype=torch.uint8, pin_memory=True)),
                ("device buffer of a new size (caching allocator may cudaMalloc)",
                 lambda: torch.empty(2**30 + pinned, dtype=torch.uint8, device=dev)),
                (f"an op never used before ({new_op.__name__}, float64)",
                 lambda: new_op(torch.ones(8, dtype=torch.float64, device=dev))),
                ("a new stream", lambda: torch.cuda.Stream()),
                ("a Triton kernel compiled and loaded now", lambda: _fresh[(1,)](fresh, SALT=salt)),
            ]

        from stage_worker.stream_wait import StreamWait

        waiter = StreamWait.open(flag.tensor, dev)
        rounds = [("a wait kernel spins (one stage's host_wait)", None, probes([1, 2, 3], torch.special.i1e,
                                                                                3 * 2**20 + 123))]
        if waiter is not None:                # new sizes and ops: what round one loaded is loaded
            rounds.append(("a stream waits (across stages' cuStreamWaitValue64)", waiter,
                           probes([5, 6, 7], torch.special.i0e, 5 * 2**20 + 321)))
        else:
            print("\n(no stream waits on this driver: the second round is skipped)")
        for title, how, calls in rounds:
            print(f"\nB. calls made while {title}; the flag is written after {args.release:.1f} s")
            print(f"  {'call':<64} {'call s':>8} {'device s':>9}  blocked")
            for what, fn in calls:
                name, took, done, blocked = behind_a_spin(flag, what, fn, args.release, seq, how)
                print(f"  {name:<64} {took:8.3f} {done:9.3f}  {'BLOCKED' if blocked else '-'}")
    finally:
        flag.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
