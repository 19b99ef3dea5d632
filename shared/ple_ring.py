"""The PLE gather ring: a shared-memory file the PLE service writes gathered rows into and the PLE stage reads.

Gathering a step's rows from a 95 GiB memory-mapped table can fault on cold pages; doing it in the service process
keeps that off the GPU forward. Slot `step % slots` holds step `step`'s rows as [max_tokens, ple_layers, heads,
head_dim] (the first `PleReady.num_tokens` rows are valid, in StepBatch token order). On a GPU the stage registers the
mapping as pinned memory, so the host-to-device copy of a slot is a plain DMA.

File layout: a 4096-byte header (magic, then a JSON description), then the slots back to back. The service writes the
file under a temporary name and renames it into place, so a reader never sees a half-written header.

It lives in `shared` because the file's layout is the contract between two services: the PLE service creates the
ring (`create`), a PLE stage maps it (`open`, `pin`), and neither service imports the other.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from shared.ple_table import unmap

__all__ = ["GatherRing", "RingError", "HEADER_BYTES"]

MAGIC = b"MOEPIPE-PLE-RING"
VERSION = 1
HEADER_BYTES = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UINT_OF_SIZE = {2: np.uint16, 4: np.uint32}
_CUDA_HOST_REGISTER_READ_ONLY = 8         # cudaHostRegisterReadOnly


class RingError(ValueError):
    """A ring file that is missing, truncated or not a moepipe PLE ring; the message names the path."""


class GatherRing:
    """A mapped ring file; `slot(i)` is a zero-copy [max_tokens, layers, heads, head_dim] tensor view."""

    def __init__(self, path: Path, mm: mmap.mmap, meta: dict, writable: bool) -> None:
        self.path, self.writable = Path(path), writable
        self.slots, self.max_tokens = int(meta["slots"]), int(meta["max_tokens"])
        self.layers, self.heads, self.head_dim = int(meta["layers"]), int(meta["heads"]), int(meta["head_dim"])
        self.dtype = _DTYPES[meta["dtype"]]
        self.nbytes = len(mm)
        self._mm: mmap.mmap | None = mm
        self._pinned = False
        shape = (self.slots, self.max_tokens, self.layers, self.heads, self.head_dim)
        count = int(np.prod(shape))
        arr = np.frombuffer(mm, dtype=_UINT_OF_SIZE[self.dtype.itemsize], count=count, offset=HEADER_BYTES)
        self._base = np.frombuffer(mm, dtype=np.uint8, count=1)      # only for the mapping's address
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")   # read-only on the stage side
            self.tensor = torch.from_numpy(arr).view(self.dtype).view(shape)

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, *, slots: int, max_tokens: int, layers: int, heads: int, head_dim: int,
               dtype: torch.dtype) -> GatherRing:
        """Service side: create (or replace) the ring file, zero-filled, and map it read-write."""
        path = Path(path)
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise RingError(f"{path}: ring dtype must be one of {sorted(_DTYPES)}, got {name}")
        for key, v in (("slots", slots), ("max_tokens", max_tokens), ("layers", layers), ("heads", heads),
                       ("head_dim", head_dim)):
            if v < 1:
                raise RingError(f"{path}: {key} must be >= 1, got {v}")
        meta = {"version": VERSION, "slots": slots, "max_tokens": max_tokens, "layers": layers, "heads": heads,
                "head_dim": head_dim, "dtype": name, "byteorder": sys.byteorder}
        size = HEADER_BYTES + slots * max_tokens * layers * heads * head_dim * dtype.itemsize
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, _header(meta), 0)
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(path, mm, meta, writable=True)

    @classmethod
    def open(cls, path: str | Path, writable: bool = False) -> GatherRing:
        """Stage side: map an existing ring (read-only by default; read-write if it is to be pinned on a GPU
        without cudaHostRegisterReadOnly support)."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise RingError(f"{path}: no PLE ring (is the PLE service running?)") from None
        try:
            size = os.fstat(fd).st_size
            meta = _parse_header(path, os.pread(fd, HEADER_BYTES, 0))
            want = HEADER_BYTES + meta["slots"] * meta["max_tokens"] * meta["layers"] * meta["heads"] * \
                meta["head_dim"] * _DTYPES[meta["dtype"]].itemsize
            if size != want:
                raise RingError(f"{path}: {size} bytes, the header describes {want}")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return cls(path, mm, meta, writable)

    # -- use -------------------------------------------------------------------------------------------------------
    def slot(self, i: int) -> torch.Tensor:
        """Slot `i` as [max_tokens, layers, heads, head_dim]; a view of the shared memory (no copy)."""
        if not 0 <= i < self.slots:
            raise IndexError(f"ring slot {i} out of range [0, {self.slots})")
        return self.tensor[i]

    def slot_for_step(self, step: int) -> int:
        return step % self.slots

    @property
    def address(self) -> int:
        return int(self._base.ctypes.data)

    def pin(self) -> bool:
        """Register the whole mapping as page-locked CUDA host memory; False (and nothing done) without CUDA."""
        if self._pinned or not torch.cuda.is_available():
            return self._pinned
        flags = 0 if self.writable else _CUDA_HOST_REGISTER_READ_ONLY
        err = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, flags)
        if int(err) != 0:
            raise RuntimeError(f"{self.path}: cudaHostRegister failed with CUDA error {int(err)}"
                               + ("" if self.writable else "; open the ring writable=True on GPUs without "
                                  "read-only host registration"))
        self._pinned = True
        return True

    def close(self) -> None:
        """Unpin and unmap. Views of slots still referenced elsewhere keep the mapping alive until collected."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._pinned = False
        self.tensor = torch.empty(0, dtype=self.dtype)
        self._base = np.empty(0, dtype=np.uint8)
        mm, self._mm = self._mm, None
        unmap(mm)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> GatherRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _header(meta: dict) -> bytes:
    body = json.dumps(meta, sort_keys=True).encode()
    raw = MAGIC + struct.pack("<I", len(body)) + body
    if len(raw) > HEADER_BYTES:
        raise RingError("ring header too long")
    return raw.ljust(HEADER_BYTES, b"\0")


def _parse_header(path: Path, raw: bytes) -> dict:
    if len(raw) < len(MAGIC) + 4 or not raw.startswith(MAGIC):
        raise RingError(f"{path}: not a moepipe PLE ring (bad magic)")
    (n,) = struct.unpack_from("<I", raw, len(MAGIC))
    try:
        meta = json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    except ValueError as exc:
        raise RingError(f"{path}: unreadable ring header ({exc})") from exc
    if meta.get("version") != VERSION:
        raise RingError(f"{path}: ring version {meta.get('version')} != {VERSION}")
    if meta.get("byteorder") != sys.byteorder:
        raise RingError(f"{path}: written {meta.get('byteorder')}-endian, this machine is {sys.byteorder}")
    if meta.get("dtype") not in _DTYPES:
        raise RingError(f"{path}: unknown ring dtype {meta.get('dtype')!r}")
    return meta
