"""A stream waits for a word the host writes without occupying the GPU (`cuStreamWaitValue64`).

Why: `kernels/host_wait.py` waits inside a kernel that polls the word, which is fine when the work that ends the wait
runs in another process's CPU (one stage, the rows of the PLE table). With `ple_launch_ahead_across_stages` the
wait ends when the LAST stage's step has run, and two stage processes on one GPU are two CUDA contexts, which the GPU
time-slices (no MPS): stage 0's polling kernel would hold the GPU for whole time slices while stage 1 computes the
very step whose token ends the poll. A stream memory operation waits in the GPU's front end instead (no SM, the
channel yields while it waits), so stage 0 queues it before the graph and the graph's polling kernel then finds the
word already set.

Driver API by ctypes (libcuda, no extra package); the V2 stream memory operations are on by default since CUDA 11.7.
Where the driver refuses (no CUDA, a refused probe), `StreamWait.open` returns None with the reason logged, and the
kernel polls as before. No timeout on the device: the runner publishes every waiting step's word within
`PUBLISH_DEADLINE_S` (60 s, `StageRunner._publish_rows`), failing the step whose tokens never came.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_WAIT_GEQ = 0                     # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0


class StreamWait:
    """`wait(value)`: the current stream of `flag`'s device waits until the pinned int64 `flag[0]` >= value."""

    def __init__(self, lib: ctypes.CDLL, address: int, device: torch.device) -> None:
        self._fn = lib.cuStreamWaitValue64_v2
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        self._address = address
        self.device = device

    @classmethod
    def open(cls, flag: torch.Tensor, device: torch.device) -> "StreamWait | None":
        """A waiter on `flag` (pinned host int64 [1]), or None where the driver cannot (the reason logged)."""
        if device.type != "cuda" or not flag.is_pinned() or flag.dtype != torch.int64:
            return None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            get_ptr = lib.cuMemHostGetDevicePointer_v2
            if not hasattr(lib, "cuStreamWaitValue64_v2"):
                raise OSError("the driver has no cuStreamWaitValue64_v2 (CUDA 11.7+)")
            dptr = ctypes.c_uint64()
            res = get_ptr(ctypes.byref(dptr), ctypes.c_void_p(flag.data_ptr()), ctypes.c_uint(0))
            if res != 0:
                raise OSError(f"cuMemHostGetDevicePointer returned {res}")
            waiter = cls(lib, dptr.value, device)
            with torch.cuda.device(device):
                waiter.wait(int(flag[0]))               # a probe the word already satisfies
                torch.cuda.current_stream(device).synchronize()
            return waiter
        except (OSError, AttributeError, RuntimeError) as exc:
            log.warning("stream waits unavailable (%s): a launched-ahead graph polls its mailbox in a kernel", exc)
            return None

    def wait(self, value: int) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        res = self._fn(ctypes.c_void_p(stream), ctypes.c_uint64(self._address), ctypes.c_uint64(value),
                       ctypes.c_uint(_WAIT_GEQ))
        if res != 0:
            raise RuntimeError(f"cuStreamWaitValue64 returned CUresult {res}")
