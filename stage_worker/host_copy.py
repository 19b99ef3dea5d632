"""Host values to device tensors without stalling the host on the GPU.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, and that copy waits until every kernel
already queued on the stream has run. A step builds a dozen such small tensors (positions, KV rows, block tables,
sampling parameters); each one made the host wait for the GPU, so the next launches could not be queued behind
the running graph and the GPU idled while Python caught up (the gap between the served TPOT and the in-process
step, issue 14). Through pinned memory the copy is queued like a kernel and the host goes on. PyTorch's caching
host allocator keeps a pinned buffer alive until the copy that reads it has run. The other direction (`to_host`)
queues the copy into pinned memory too; the caller waits for an event before reading it.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, a nested list or a CPU tensor) as a `dtype` tensor on `device`; to a GPU, a queued copy."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A queued copy of `t` into pinned host memory (the tensor itself on the CPU): valid once the stream has run
    past it (record an event after this and wait for that)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
