"""Cache rows between host RAM and the GPU by row index, in one launch each way, with no host synchronisation.

Why: with `qsa_kv_offload` (issue 18) a QSA layer's K/V rows and raw indexer keys live in pinned host memory that
the GPU addresses directly (UVA, as the MoE kernels read host experts: issue 16). Prefill writes its chunk's new rows
there and reads the rows its queries attend to; PyTorch cannot index a CPU tensor with CUDA indices (it would sync
and copy through the host). These kernels load and store through the host rows' device addresses instead, so a
gather copies exactly the selected rows' bytes over PCIe into a device tensor (bit-identical to indexing an in-VRAM
cache) and a scatter writes only the new rows.

Layout: a cache tensor is [R, ...] contiguous, seen as [R, W] elements; grid (cdiv(N, BLOCK_R),), each program moves
BLOCK_R rows of W elements in BLOCK_W-wide tiles. Reference: `kv_rows_ref.py`; tests: tests/test_qsa_kv_offload.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 4            # rows a program moves (a K/V row of the full shape is 1 KiB: 4 rows, one 4-KiB program)


@triton.jit
def _rows_kernel(src, dst, rows, n, W: tl.constexpr, GATHER: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = i < n
    r = tl.load(rows + i, mask=ok, other=0).to(tl.int64)
    i = i.to(tl.int64)
    for w0 in tl.static_range(0, W, BLOCK_W):
        c = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (c < W)[None, :]
        if GATHER:                              # dst[i] = src[rows[i]]
            tl.store(dst + i[:, None] * W + c[None, :], tl.load(src + r[:, None] * W + c[None, :], mask=m), mask=m)
        else:                                   # dst[rows[i]] = src[i]
            tl.store(dst + r[:, None] * W + c[None, :], tl.load(src + i[:, None] * W + c[None, :], mask=m), mask=m)


def _check(cache: torch.Tensor, rows: torch.Tensor, other: torch.Tensor) -> int:
    if not cache.is_contiguous() or not other.is_contiguous():
        raise ValueError("cache rows need contiguous tensors")
    if rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
        raise ValueError(f"rows must be a 1-D int32/int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    if cache.dtype != other.dtype or cache.shape[1:] != other.shape[1:] or other.shape[0] != rows.shape[0]:
        raise ValueError(f"rows {tuple(other.shape)} {other.dtype} do not match the cache's {tuple(cache.shape)} "
                         f"{cache.dtype} for {rows.shape[0]} row indices")
    return cache[0].numel() if cache.shape[0] else 0


def _launch(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, width: int, gather: bool) -> None:
    n = rows.shape[0]
    if n == 0 or width == 0:
        return
    block_w = min(triton.next_power_of_2(width), 1024)
    _rows_kernel[(triton.cdiv(n, BLOCK_R),)](src, dst, rows, n, W=width, GATHER=gather, BLOCK_R=BLOCK_R,
                                             BLOCK_W=block_w, num_warps=4)


def gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """src [R, ...] (host rows the GPU can address, or device rows), rows [N] on the GPU -> [N, ...] on rows'
    device: `src[rows]`, copied bit for bit. Equals `kv_rows_ref.gather_rows_ref`. `out`: a contiguous [N, ...]
    buffer to fill instead (prefill's reused section buffers, `kernels/section_attention.py`)."""
    if out is None:
        out = torch.empty((rows.shape[0], *src.shape[1:]), dtype=src.dtype, device=rows.device)
    _launch(src, out, rows, _check(src, rows, out), True)
    return out


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """dst[rows] = values (same dtype and row shape); dst may be host rows the GPU can address. Rows must be
    distinct (a row written twice keeps either value). Equals `kv_rows_ref.scatter_rows_ref`."""
    _launch(values.contiguous(), dst, rows, _check(dst, rows, values.contiguous()), False)
