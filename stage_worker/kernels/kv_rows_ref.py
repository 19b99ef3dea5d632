"""Cache rows gathered and scattered by row index in plain PyTorch: the CPU path and the oracle of `kv_rows.py`.

With `qsa_kv_offload` the QSA layers' K/V rows and raw indexer keys live in host RAM (issue 18), and prefill reads and
writes them by flat cache row; on the CPU that is ordinary indexing, the same as for an in-VRAM cache.
"""

from __future__ import annotations

import torch


def gather_rows_ref(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """src [R, ...], rows [N] int -> [N, ...] on src's device."""
    return src[rows.to(src.device)]


def scatter_rows_ref(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """dst[rows] = values, rounded to dst's dtype."""
    dst[rows.to(dst.device)] = values.to(dst.device, dst.dtype)
