"""A graph's first kernel waits on the device for a word the host writes, then copies rows the host wrote before it.

Why: a stage holding a PLE layer needs each decode step's table rows, and those depend on the token the previous
step sampled, which the host must see first (the table is on the host, hashed and gathered there). Launched only
once the rows were ready, every step paid the host's whole turn-around with the GPU idle: the token's copy, the
hash and gather, the inputs' copies, the graph launch (H200, full shape, one stream: 3.53 ms served against a 2.71 ms
step back to back, h200-21). With `ple_launch_ahead` the step's graph is launched before the token reaches the
host; its first kernel spins on a pinned host word (volatile loads over UVA) until the host has written the rows
into pinned memory and bumped the word to the step's number, then copies the rows into the graph's static buffer.
The GPU then waits only for the hash and gather.

`wait_and_copy(flag, expected, src, dst)`: every program polls `flag[0]` until it is >= `expected[0]` (a device
scalar the runner sets before each replay), or `timeout_s` seconds have passed on the GPU's global timer (a host
that never answers must not hang the device: the rows are then whatever `src` holds, and the runner reports the
step failed), then copies its block of `src` (pinned host, read over UVA) to `dst` (device). Under
TRITON_INTERPRET=1, which has no timer, `max_spins` polls bound it instead. Reference: `host_wait_ref.py`.

The bound was `MAX_SPINS` polls alone until h100-33 measured a poll: 12.1 us on an H100, so 2^24 polls were 204 s
of a stopped server whenever the host could not answer (tools/host_wait_probe.py). The host answers within
milliseconds of the step before (its tokens' copy, a hash and a gather) unless it is itself blocked behind the
spinning kernel, which `StageRunner.queue_samplers` (`ple_sample_after_rows`) keeps from happening;
`WAIT_TIMEOUT_S` only bounds what is left.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from stage_worker.kernels.common import INTERPRET

BLOCK = 1024             # elements a program copies (a full-shape step's rows: 16 heads x 160 x batch)
MAX_SPINS = 1 << 24      # the interpreter's bound (no timer there); on a GPU also a backstop (204 s on an H100)
WAIT_TIMEOUT_S = 10.0    # seconds a graph waits for the host before its step fails


@triton.jit
def _wait_copy_kernel(flag, expected, src, dst, timed_out, n, max_spins, max_ns, BLOCK: tl.constexpr,
                      TIMER: tl.constexpr):
    want = tl.load(expected)
    seen = tl.load(flag, volatile=True)
    spins = 0
    if TIMER:
        start = globaltimer()
        waited = start - start
        while (seen < want) & (spins < max_spins) & (waited < max_ns):
            seen = tl.load(flag, volatile=True)
            spins += 1
            waited = globaltimer() - start
    else:
        while (seen < want) & (spins < max_spins):
            seen = tl.load(flag, volatile=True)
            spins += 1
    if seen < want:
        tl.store(timed_out, want)          # the step that gave up: the host fails that step's requests
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m, volatile=True), mask=m)


def wait_and_copy(flag: torch.Tensor, expected: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  timed_out: torch.Tensor, max_spins: int = MAX_SPINS, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """flag [1] int64 (pinned host), expected [1] int64 and timed_out [1] int64 (device), src and dst of one dtype
    and element count (src pinned host, dst device; both contiguous). One launch, no host synchronisation. A wait
    that gives up (the flag still short of `expected` after `timeout_s`, or `max_spins` polls) writes `expected`
    into `timed_out` and copies anyway: `timed_out` holds the number of the last step that did."""
    if src.dtype != dst.dtype or src.numel() != dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} must be "
                         "contiguous, of one dtype and size")
    if flag.dtype != torch.int64 or expected.dtype != torch.int64 or timed_out.dtype != torch.int64:
        raise ValueError("flag, expected and timed_out are int64")
    n = dst.numel()
    _wait_copy_kernel[(max(1, triton.cdiv(n, BLOCK)),)](flag, expected, src, dst, timed_out, n, max_spins,
                                                         int(timeout_s * 1e9), BLOCK=BLOCK, num_warps=4,
                                                         TIMER=not INTERPRET)
