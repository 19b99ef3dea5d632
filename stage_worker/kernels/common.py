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
