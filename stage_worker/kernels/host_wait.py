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
scalar the runner sets before each replay), or `max_spins` polls have passed (a host that never answers must not
hang the device: the rows are then whatever `src` holds, and the runner reports the step failed), then copies its
block of `src` (pinned host, read over UVA) to `dst` (device). Reference: `host_wait_ref.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024             # elements a program copies (a full-shape step's rows: 16 heads x 160 x batch)
MAX_SPINS = 1 << 24      # ~1 us a poll over PCIe: some seconds before a step gives up on the host


@triton.jit
def _wait_copy_kernel(flag, expected, src, dst, timed_out, n, max_spins, BLOCK: tl.constexpr):
    want = tl.load(expected)
    seen = tl.load(flag, volatile=True)
    spins = 0
    while (seen < want) & (spins < max_spins):
        seen = tl.load(flag, volatile=True)
        spins += 1
    if seen < want:
        tl.store(timed_out, want)          # the step that gave up: the host fails that step's requests
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m, volatile=True), mask=m)


def wait_and_copy(flag: torch.Tensor, expected: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  timed_out: torch.Tensor, max_spins: int = MAX_SPINS) -> None:
    """flag [1] int64 (pinned host), expected [1] int64 and timed_out [1] int64 (device), src and dst of one dtype
    and element count (src pinned host, dst device; both contiguous). One launch, no host synchronisation. A wait
    that gives up (the flag still short of `expected` after `max_spins` polls) writes `expected` into `timed_out`
    and copies anyway: `timed_out` holds the number of the last step that did."""
    if src.dtype != dst.dtype or src.numel() != dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} must be "
                         "contiguous, of one dtype and size")
    if flag.dtype != torch.int64 or expected.dtype != torch.int64 or timed_out.dtype != torch.int64:
        raise ValueError("flag, expected and timed_out are int64")
    n = dst.numel()
    _wait_copy_kernel[(max(1, triton.cdiv(n, BLOCK)),)](flag, expected, src, dst, timed_out, n, max_spins,
                                                         BLOCK=BLOCK, num_warps=4)
