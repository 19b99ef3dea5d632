"""One flat, memory-mapped file per PLE n-gram table.

A Qwen4-Exp checkpoint stores each PLE table as `split_ngram_parts` row shards (`...ngram_embedding.shard_{k}.weight`,
concatenated along rows in shard-number order). Tables are far larger than RAM budgets allow, and the PLE service reads
only a few rows per token, so at first start each table is streamed shard by shard into one raw row-major file beside
the checkpoint; every later start just maps it. Page cache then holds whatever rows are hot, shared between processes.

Layout: `<name>` holds rows * dim elements of the stored dtype in native byte order, nothing else; `<name>.json` (the
sidecar) records rows, dim, dtype and format version and is written last, so a table without a matching sidecar is
an interrupted expansion and is rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "FlatTable",
    "ensure_table",
    "expand_table",
    "open_table",
    "shard_row_counts",
    "sidecar_path",
    "table_is_current",
    "uint_view",
]

FORMAT = "moepipe-ple-flat"
FORMAT_VERSION = 1

# numpy has no bfloat16, so the mapping is viewed as an unsigned int of the same width and reinterpreted by torch.
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# (torch's signed ints of each width: views any tensor allows; numpy then reinterprets them as its unsigned ones)
_TORCH_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def uint_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy's unsigned int of its element's width (numpy has no bfloat16), no copy: what
    the tables' `gather_into` reads and writes, so a decode step's gather runs in numpy alone."""
    size = t.element_size()
    return t.view(_TORCH_INT_OF_SIZE[size]).numpy().view(_UINT_OF_SIZE[size])


def sidecar_path(out_path: Path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".json")


def _tmp_path(path: Path) -> Path:
    # Appended rather than `with_suffix`, so two tables differing only in suffix never share a temporary file.
    return path.with_name(path.name + ".tmp")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def shard_row_counts(rows: int, num_shards: int) -> list[int]:
    """Rows of each checkpoint shard: `torch.chunk` sizes, i.e. the split `transformers` writes (equal shards of
    rows / num_shards when that divides, else ceil-sized shards with a shorter last one)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    size = -(-rows // num_shards)
    counts = [max(0, min(size, rows - k * size)) for k in range(num_shards)]
    if rows and counts[-1] == 0:
        raise ValueError(f"{rows} rows cannot be chunked into {num_shards} non-empty shards")
    return counts


def _sidecar(rows: int, dim: int, dtype: torch.dtype) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "rows": int(rows),
        "dim": int(dim),
        "dtype": _dtype_name(dtype),
        "byteorder": sys.byteorder,
        "nbytes": int(rows) * int(dim) * dtype.itemsize,
    }


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unmap(mm: mmap.mmap | None) -> None:
    """Close a mapping unless views of it are still referenced (BufferError): then it stays until they are
    collected, since unmapping under them would crash."""
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        pass


def expand_table(
    read_shard: Callable[[int], torch.Tensor],
    num_shards: int,
    out_path: Path,
    *,
    rows: int,
    dim: int,
    dtype: torch.dtype,
    desc: str = "",
) -> Path:
    """Stream shards 0..num_shards-1 (as returned by `read_shard(k)`) into the flat file `out_path`.

    Only one shard is in memory at a time. Data goes to a temporary file that is renamed over `out_path` once
    complete; the sidecar is written after that, so a crash at any point leaves no table that `table_is_current`
    accepts. Raises ValueError naming the shard whose shape or dtype is wrong, OSError if the disk is too small.
    """
    out_path = Path(out_path)
    counts = shard_row_counts(rows, num_shards)
    nbytes = rows * dim * dtype.itemsize
    tmp, meta = _tmp_path(out_path), sidecar_path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    # An existing sidecar would vouch for a file we are about to replace; the stale data file only takes disk space
    # (a process that still maps it keeps its inode alive).
    meta.unlink(missing_ok=True)
    out_path.unlink(missing_ok=True)
    reusable = tmp.stat().st_size if tmp.exists() else 0
    free = shutil.disk_usage(out_path.parent).free
    if free + reusable < nbytes:
        raise OSError(f"{out_path.parent}: {nbytes} bytes needed for {out_path.name}, only {free + reusable} free")

    try:
        with open(tmp, "wb") as f, tqdm(
            total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc or out_path.name, disable=None
        ) as bar:
            for k in range(num_shards):
                shard = read_shard(k)
                if not isinstance(shard, torch.Tensor):
                    raise ValueError(f"shard {k}: expected a torch.Tensor, got {type(shard).__name__}")
                if tuple(shard.shape) != (counts[k], dim):
                    raise ValueError(
                        f"shard {k}: shape {tuple(shard.shape)}, expected {(counts[k], dim)} "
                        f"({rows} rows over {num_shards} shards)"
                    )
                if shard.dtype != dtype:
                    raise ValueError(f"shard {k}: dtype {_dtype_name(shard.dtype)}, expected {_dtype_name(dtype)}")
                data = shard.detach().to("cpu").contiguous()
                del shard
                if data.numel():
                    f.write(data.view(torch.uint8).numpy().data)  # raw bytes, no copy
                bar.update(data.numel() * data.element_size())
                del data
            f.flush()
            os.fsync(f.fileno())
        written = tmp.stat().st_size
        if written != nbytes:
            raise OSError(f"{tmp}: wrote {written} bytes, expected {nbytes}")
        os.replace(tmp, out_path)
        _fsync_dir(out_path.parent)

        meta_tmp = _tmp_path(meta)
        meta_tmp.write_text(json.dumps(_sidecar(rows, dim, dtype), indent=1) + "\n")
        with open(meta_tmp, "rb+") as mf:
            os.fsync(mf.fileno())
        os.replace(meta_tmp, meta)
        _fsync_dir(out_path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        _tmp_path(meta).unlink(missing_ok=True)
        raise
    return out_path


def _read_sidecar(out_path: Path) -> dict:
    meta = json.loads(sidecar_path(out_path).read_text())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{sidecar_path(out_path)}: not a {FORMAT} v{FORMAT_VERSION} sidecar")
    return meta


def table_is_current(out_path: Path, rows: int, dim: int, dtype: torch.dtype) -> bool:
    """True when `out_path` is a complete expansion with exactly this shape and dtype (so no rebuild is needed)."""
    out_path = Path(out_path)
    try:
        meta = _read_sidecar(out_path)
        size = out_path.stat().st_size
    except (OSError, ValueError):
        return False
    expected = _sidecar(rows, dim, dtype)
    keys = ("rows", "dim", "dtype", "byteorder", "nbytes")
    return all(meta.get(k) == expected[k] for k in keys) and size == expected["nbytes"]


@dataclass(eq=False)
class FlatTable:
    """A read-only, zero-copy [rows, dim] view of an expanded table; owns the mapping that backs `tensor`.

    The mapping is PROT_READ: writing into `tensor` faults. Keep this object (not just `tensor`) alive while rows are
    read, or use it as a context manager.
    """

    path: Path
    rows: int
    dim: int
    dtype: torch.dtype
    tensor: torch.Tensor
    _mmap: mmap.mmap | None = field(default=None, repr=False)
    # the same rows as numpy's unsigned int of the dtype's width (numpy has no bfloat16): `gather_into`'s source
    array: np.ndarray | None = field(default=None, repr=False)

    def gather_into(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `rows` (an int64 array, any shape) -> (*rows.shape, dim) as the unsigned int of the dtype's width,
        written into `out` when given (any strides: a slice of a pinned mailbox). One numpy call, no torch: a decode
        step's gather on a stage's critical path (`stage_worker/ple_decode_rows.py`), where each torch op's dispatch
        cost ~10x its warm time once the step's other work had left the CPU caches cold
        (bench/ple_decode_gather.py --thrash-mib)."""
        if self.array is None:
            self.array = uint_view(self.tensor)
        return np.take(self.array, rows, axis=0, out=out)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` (any shape, any device) of the table -> CPU tensor of shape (*rows.shape, dim).

        `out`, when given (e.g. a pinned staging buffer), must be (rows.numel(), dim) or (*rows.shape, dim)."""
        index = rows.reshape(-1).to(device="cpu", dtype=torch.long)
        if out is None:
            return torch.index_select(self.tensor, 0, index).view(*rows.shape, self.dim)
        torch.index_select(self.tensor, 0, index, out=out.view(-1, self.dim))
        return out.view(*rows.shape, self.dim)

    def close(self) -> None:
        """Drop the tensor and unmap. If views of the tensor are still referenced elsewhere the mapping stays until
        they are garbage collected (unmapping under them would crash)."""
        self.tensor = torch.empty(0, self.dim, dtype=self.dtype)
        self.array = None
        mm, self._mmap = self._mmap, None
        unmap(mm)

    def __enter__(self) -> FlatTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_table(out_path: Path) -> FlatTable:
    """Map an expanded table read-only and advise the kernel that access is random (no readahead: each token reads
    a handful of scattered rows, and readahead would evict hot pages for nothing)."""
    out_path = Path(out_path)
    meta = _read_sidecar(out_path)
    if meta.get("byteorder") != sys.byteorder:
        raise ValueError(f"{out_path}: written {meta.get('byteorder')}-endian, this machine is {sys.byteorder}")
    rows, dim, dtype = int(meta["rows"]), int(meta["dim"]), _dtype_from_name(meta["dtype"])
    nbytes = rows * dim * dtype.itemsize
    size = out_path.stat().st_size
    if size != nbytes:
        raise ValueError(f"{out_path}: {size} bytes on disk, sidecar says {rows}x{dim} {meta['dtype']} = {nbytes}")
    if nbytes == 0:
        return FlatTable(out_path, rows, dim, dtype, torch.empty(rows, dim, dtype=dtype))

    with open(out_path, "rb") as f:
        mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    flat = np.frombuffer(mm, dtype=_UINT_OF_SIZE[dtype.itemsize])
    with warnings.catch_warnings():
        # torch warns that the array is not writable; that is the point of a read-only mapping.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        tensor = torch.from_numpy(flat).view(dtype).view(rows, dim)
    return FlatTable(out_path, rows, dim, dtype, tensor, mm, flat.reshape(rows, dim))


def ensure_table(
    read_shard: Callable[[int], torch.Tensor],
    num_shards: int,
    out_path: Path,
    *,
    rows: int,
    dim: int,
    dtype: torch.dtype,
    desc: str = "",
) -> FlatTable:
    """Open `out_path`, expanding it from the checkpoint shards first unless a current expansion is already there.

    An exclusive lock beside the table serialises processes that start together (the PLE stage and the PLE
    service both open the table at start-up): one expands, the other waits and then only reopens. A current table
    is opened without the lock: a read-only directory's (a volume, another user's model) has no room for one."""
    out_path = Path(out_path)
    if table_is_current(out_path, rows, dim, dtype):
        return open_table(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_path.with_name(out_path.name + ".lock")
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not table_is_current(out_path, rows, dim, dtype):
                expand_table(read_shard, num_shards, out_path, rows=rows, dim=dim, dtype=dtype, desc=desc)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return open_table(out_path)
