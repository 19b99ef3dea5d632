"""Several Linear weights stored as row views of one tensor, so a decode step reads them with one GEMV.

The decode kernels want q/k/v (and the QSA indexer's projection), the four Gated DeltaNet in-projections, the router
with the shared expert's gate, and the shared expert's gate/up rows each as one matrix. Rebinding the modules'
weights as views of a concatenation keeps one copy in memory and leaves state-dict names and values alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def fuse_rows(linears: Sequence[nn.Module]) -> torch.Tensor:
    """Concatenate the weights' rows once and rebind each module's weight as a Parameter viewing its rows (no extra
    memory once the old tensors are freed). Returns the fused tensor."""
    with torch.inference_mode(False), torch.no_grad():     # normal tensors even when called under inference mode
        fused = torch.cat([m.weight for m in linears])
        row = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(fused[row:row + n], requires_grad=m.weight.requires_grad)
            row += n
    return fused


def still_fused(fused: torch.Tensor | None, linears: Sequence[nn.Module]) -> bool:
    """Every weight is still the view `fuse_rows` made: a loader, `.to()` or `.float()` that rebinds a weight makes
    the fused tensor stale, and callers fall back (or fuse again) instead of reading it."""
    if fused is None:
        return False
    row = 0
    for m in linears:
        w = m.weight
        if w.device != fused.device or w.dtype != fused.dtype or w.data_ptr() != fused[row:].data_ptr():
            return False
        row += w.shape[0]
    return row == fused.shape[0]
