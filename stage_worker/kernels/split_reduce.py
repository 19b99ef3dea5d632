"""Split-K in one launch: the programs that share an output tile each store an fp32 partial sum, and the last of
them to finish adds the partials in a fixed order and writes the tile (deterministic: the order never depends on
which program finished last). Used by the packed dense GEMVs (`quant_gemv.py`), where a separate reduction launch
(and a cast) cost more than the sum itself at decode sizes. (Splitting the INT4 MoE kernels' rows this way was
tried and measured: no gain, bench/results/moe-int4-5.)

The counters live in one zeroed int32 buffer per device (`split_locks`); every launch leaves them at 0, so
launches in sequence on a stream and CUDA-graph replays share it (two streams must not run split launches at the
same time). Allocate it before capturing a graph (`PackedLinear.prepare_kernels`). The cross-program protocol only
shows its races on a GPU: tests/test_kernel_quant_gemv.py replays such launches from a graph and compares them bit
for bit with the eager result (passed on the H200, bench/results/quant-decode-1).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs off Linux
    triton = None

LOCKS = 1 << 15                # counters: one per output tile of a launch
_locks: dict[torch.device, torch.Tensor] = {}


def split_locks(device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 counters split launches count their programs in, one buffer per device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _locks:
        _locks[device] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _locks[device]


if triton is not None:

    @triton.jit
    def last_of(lock_ptr, SPLIT: tl.constexpr):
        """True in the last of a tile's SPLIT programs to finish; that one then reads the others' partial sums
        (stored before they counted themselves in: the barrier orders every thread's stores before the one
        thread's acq_rel atomic; read them with cache_modifier=".cg", past the SM's L1) and puts the counter
        back to 0 for the next launch."""
        tl.debug_barrier()
        n = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
        last = n == SPLIT - 1
        if last:
            tl.atomic_xchg(lock_ptr, 0, sem="relaxed", scope="gpu")
        return last
