"""What every kernel module shares: whether Triton can run a tensor here, the device's SM count for grid sizes, and
the interpreter fix the CPU tests need. One place, so each kernel file holds only its kernels and their launchers.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
except ImportError:   # CPU-only installs off Linux: every caller takes its PyTorch path
    triton = None

# Decided once, at import, as the kernels are defined: TRITON_INTERPRET=1 (the CPU tests) runs them on CPU tensors.
INTERPRET = bool(triton is not None and triton.knobs.runtime.interpret)


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs CUDA tensors, or CPU tensors when the interpreter was on at import time (tests)."""
    return triton is not None and (x.is_cuda or (INTERPRET and x.device.type == "cpu"))


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors to fill on a CUDA device (a cached host-side query, no sync); `cpu` under the
    interpreter, each caller's choice (what its CPU tests need to reach the split paths they check)."""
    if device.type != "cuda":
        return cpu
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


# The kernel flag `pdl` (KernelFlags.pdl) as the decode kernels read it: set by StageModel.set_kernels (`set_pdl`),
# one setting for the process (every stage of a process takes the same flags), read through `pdl_usable`. The one
# place: each PDL-taking wrapper asks `pdl_usable(x)` and hands the answer to its kernels as the constexpr PDL and
# the launch option launch_pdl.
_PDL = False


def set_pdl(on: bool) -> None:
    """Turn programmatic dependent launch on or off for the kernels that take it (StageModel.set_kernels)."""
    global _PDL
    _PDL = bool(on)


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _pdl_device(x: torch.Tensor) -> bool:
    """Whether a launch on x's device can be a programmatic dependent one: a CUDA tensor of compute capability >= 9
    (Hopper on), compiled (never under the interpreter)."""
    if triton is None or INTERPRET or not x.is_cuda:
        return False
    return _cuda_major(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 9


def pdl_usable(x: torch.Tensor) -> bool:
    """Launch the kernels over x with PDL (their constexpr PDL and `launch_pdl=`): the flag is on and the device
    takes it. False on the CPU, under the interpreter and before sm_90: there the kernels compile as without it."""
    return _PDL and _pdl_device(x)


# The kernel flag `l2_prefetch` (KernelFlags.l2_prefetch), set by StageModel.set_kernels (`set_l2_prefetch`) and read
# the same way (`l2_prefetch_usable`): only with PDL, whose prologue before the wait is where the prefetch goes.
_L2PF = False


def set_l2_prefetch(on: bool) -> None:
    """Turn the L2 prefetch of a PDL kernel's whole weight range on or off (StageModel.set_kernels)."""
    global _L2PF
    _L2PF = bool(on)


def l2_prefetch_usable(x: torch.Tensor) -> bool:
    """Compile the PDL kernels over x with the constexpr L2PF (`l2_prefetch_rows` before their `pdl_wait`): the flag
    is on and PDL is usable (`pdl_usable`; sm_90's cp.async.bulk.prefetch). False wherever PDL is: the kernels then
    compile as without it."""
    return _L2PF and pdl_usable(x)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """With PDL (the kernel launched as a programmatic dependent, `launch_pdl=True`): wait until the previous
        kernel of the stream has finished and its writes are visible, then let the next kernel launch. Every
        program of a PDL kernel calls it exactly once, before its first store and its first load of anything an
        earlier kernel may write (activations, routing, caches, counters, an output's previous contents); before it
        only weights nothing writes during decode. The next kernel launches once every program of this one has
        passed its wait (so the previous kernel is done): its programs start while this one streams its weights,
        issue their own weight loads and wait in turn (a chain: each kernel's wait implies all earlier kernels are
        done). Launching dependents right after the wait, not after the main loop, is a choice made without a
        measurement: it gives the next kernel the most time to start. Without PDL nothing: the kernel compiles as
        before."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def l2_prefetch_bytes(lo, hi):
        """Elementwise: ask the L2 to fetch global memory [lo, hi) (int64 addresses) from HBM, one
        `cp.async.bulk.prefetch.L2.global` an element (sm_90, PTX ISA 8.0: a 16-byte-aligned address, a size a
        multiple of 16). Only the 16-byte-aligned inside of the range, [lo rounded up, hi rounded down), so nothing
        outside [lo, hi) is touched however the tensor is aligned (at most 15 bytes an end left to the ordinary
        loads); nothing where that is empty. A hint: it writes nothing, returns nothing and is never waited on,
        so it is legal before `pdl_wait`, and the L2 being the device's point of coherence, whatever it brings in
        is never stale."""
        a = (lo + 15) & -16
        size = tl.maximum((hi & -16) - a, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [a, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def l2_prefetch_rows(ptr, row0, n_rows, row_stride, col0, n_cols, ROWS: tl.constexpr):
        """L2 prefetch (`l2_prefetch_bytes`) of rows row0 .. row0 + n_rows (n_rows <= ROWS, the caller's bound on
        the tensor: nothing past it) times elements col0 .. col0 + n_cols of the row-major tensor at `ptr` (its
        element size from ptr's type, row_stride elements a row). Rows that are whole and adjacent (col0 0, n_cols
        row_stride) are one contiguous range: one instruction, the first thread's; otherwise one a row, each from
        its own thread (a tensor of one element a thread, num_warps * 32, so no thread repeats another's)."""
        NT: tl.constexpr = tl.extra.cuda.num_threads()
        EB: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
        base = ptr.to(tl.int64)
        for r in tl.static_range(0, ROWS, NT):
            lane = r + tl.arange(0, NT)
            zero = tl.zeros([NT], tl.int64)                  # the scalars as int64 tensors, whatever their types
            row = zero + row0 + lane
            stride = zero + row_stride
            cols = zero + n_cols
            lo = base + (row * stride + col0) * EB
            hi = lo + cols * EB
            whole = ((zero + col0) == 0) & (cols == stride)
            hi = tl.where(whole, base + (zero + row0 + n_rows) * stride * EB, hi)
            take = (lane < n_rows) & ((lane == 0) | (whole == 0))
            l2_prefetch_bytes(lo, tl.where(take, hi, lo))

    @triton.jit
    def e2m1_scaled(q, N: tl.constexpr):
        """The E2M1 value of code N of the words q (FP4 experts; N 0 for codes already on their own), times 2^-14,
        in fp32, exactly and with no table: the magnitude index's three bits become an fp16's two low exponent bits
        and top mantissa bit (exponent 0 is subnormal, so index 0 and 1 give 0 and 0.5 * 2^-14) and the code's sign
        bit the fp16's; the caller applies the 2^14 (the decode kernels once, after the sums)."""
        if N < 3:
            mag = q << (9 - 4 * N)
        else:
            mag = q >> (4 * N - 9)
        if N < 4:
            sgn = q << (12 - 4 * N)
        else:
            sgn = q >> (4 * N - 12)
        bits = (mag & 0x0E00) | (sgn & 0x8000)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


def cuda_index(device: torch.device | str | int) -> int:
    """The CUDA device number of `device` (`cuda` alone: the current device)."""
    index = torch.device(device).index if not isinstance(device, int) else device
    return torch.cuda.current_device() if index is None else index


def side_stream(device: torch.device | int, name: str = "side") -> torch.cuda.Stream:
    """A second stream per CUDA device (and `name`), for decode launches that can run beside the main chain (kernel
    flag `side_stream`): a small launch that cannot fill the GPU alone runs while another does. Every use forks from
    the current stream first (`side.wait_stream(main)`) and the main stream joins it before reading its output;
    inside a CUDA-graph capture that makes a parallel branch of the graph. `name` "predict": the layer-ahead
    prediction (`expert_prefetch`), joined after the layer's expert launches; "prefetch": its expert copies, joined
    only at the end of a forward, so no other join waits for them."""
    index = cuda_index(device)
    if (index, name) not in _side_streams:
        _side_streams[index, name] = torch.cuda.Stream(device=index)
    return _side_streams[index, name]


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def fix_interpreter_loop_bounds() -> None:
    """Under TRITON_INTERPRET=1, triton 3.6 turns a tensor loop bound into an int with `int(array of shape (1,))`,
    which numpy >= 2.4 refuses, so `range(start, end)` over loaded values fails (triton-lang/triton#9171). Apply the
    upstream one-line fix, so the interpreter runs the same `for` loop the GPU compiles (and pipelines)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fix", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patched._scalar_index_fix = True
    interpreter._patch_lang_tensor = patched
