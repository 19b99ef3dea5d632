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
