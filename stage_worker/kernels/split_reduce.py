"""Split-K in one launch: the programs that share an output tile each store an fp32 partial sum, and the last of
them to finish adds the partials in a fixed order and writes the tile (`store_tile`; deterministic: the order never
depends on which program finished last). Used by the packed and float8 dense GEMVs (`quant_gemv.py`,
`fp8_gemv.py`), where a separate reduction launch (and a cast) cost more than the sum itself at decode sizes. (Splitting the INT4 MoE kernels' rows this way was
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

    @triton.jit
    def store_tile(res, out_ptr, part_ptr, lock_ptr, rows64, mask_n, offs_t, N, T, stride_ot, SPLITS: tl.constexpr):
        """res [BLOCK_N, TP] fp32 to out (x.dtype); with SPLITS K slices, each program's partial sums to part and
        the last program of the output tile (token group, row block) adds them in a fixed order
        (`split_reduce.last_of`: one launch, deterministic)."""
        at = offs_t[None, :] * stride_ot + rows64[:, None]
        mask = mask_n[:, None] & (offs_t < T)[None, :]
        if SPLITS > 1:
            pt = offs_t[None, :] * N + rows64[:, None]
            tl.store(part_ptr + tl.program_id(2) * T * N + pt, res, mask=mask)
            if last_of(lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLITS):
                res = tl.load(part_ptr + pt, mask=mask, other=0.0, cache_modifier=".cg")
                for p in tl.static_range(1, SPLITS):
                    res += tl.load(part_ptr + p * T * N + pt, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + at, res.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + at, res.to(out_ptr.dtype.element_ty), mask=mask)
