"""One virtual address range whose first rows are VRAM and whose remaining rows are pinned host RAM (issue 16, 000 §4.2).

Why: an expert table keeps its hot experts in VRAM and its cold ones in host RAM. Today the kernels take two base
pointers and branch per slot (`kernels.moe_ref.HostRows`); the reports' design maps both tiers behind one range with
the CUDA virtual memory API, so a kernel computes every slot's address the same way and the host rows are read over
PCIe only when selected. This module builds such a range with the driver API through ctypes (libcuda, no extra
package): `cuMemAddressReserve` one range, `cuMemCreate` one device allocation and one host-NUMA allocation
(CU_MEM_LOCATION_TYPE_HOST_NUMA, CUDA 12.2+ drivers), `cuMemMap` both back to back, `cuMemSetAccess` for the device.
The device part ends on the allocation granularity (2 MiB on current GPUs), so up to one granule of the first host
rows sits in VRAM; `TieredRange.device_rows` says how many rows do.

Where the driver refuses (no CUDA, an old driver, a host-NUMA allocation not supported), `tiered_rows` raises
`VmmUnavailable` with the driver's reason and the caller keeps the two-table layout. GPU-verified by
tests/test_vmm_range.py on a device (bench/results/vmm-1/next.txt); the expert tables use it with `expert_vmm_table`
(`stage_worker/expert_offload.py`, tests/test_expert_vmm_table.py).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

# driver enums (cuda.h)
_PINNED = 1                       # CU_MEM_ALLOCATION_TYPE_PINNED
_LOC_DEVICE = 1                   # CU_MEM_LOCATION_TYPE_DEVICE
_LOC_HOST_NUMA = 3                # CU_MEM_LOCATION_TYPE_HOST_NUMA
_GRANULARITY_MINIMUM = 0          # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_ACCESS_READWRITE = 3             # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_ATTR_HOST_NUMA_ID = 134          # CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID


class VmmUnavailable(RuntimeError):
    """The driver cannot build a VRAM + host range here; the message says why (the two-table layout still works)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib: ctypes.CDLL | None = None


_SYMBOLS = ("cuGetErrorName", "cuDeviceGetAttribute", "cuMemGetAllocationGranularity", "cuMemAddressReserve",
            "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree")


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise VmmUnavailable(f"no CUDA driver library: {exc}") from None
        missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
        if missing:
            raise VmmUnavailable(f"the CUDA driver has no {', '.join(missing)} (virtual memory management needs "
                                 f"CUDA 10.2+, host-NUMA allocations 12.2+)")
        _lib = lib
    return _lib


def _check(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(res, ctypes.byref(name))
        raise VmmUnavailable(f"{what} failed: {name.value.decode() if name.value else res}")


def _prop(loc_type: int, loc_id: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _PINNED
    prop.location.type = loc_type
    prop.location.id = loc_id
    return prop


def _granularity(prop: _AllocationProp) -> int:
    g = ctypes.c_size_t()
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), _GRANULARITY_MINIMUM),
           "cuMemGetAllocationGranularity")
    return g.value


@dataclass
class TieredRange:
    """The reserved range and its two physical allocations; `release` unmaps and frees them (also at garbage
    collection of the last tensor viewing the range, through `_Holder`)."""
    base: int
    size: int
    device_bytes: int
    host_bytes: int
    device_rows: int              # rows wholly or partly in VRAM (the hot rows plus what shares their last granule)
    handles: tuple[int, ...]
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        lib = _driver()
        lib.cuMemUnmap(ctypes.c_uint64(self.base), ctypes.c_size_t(self.size))
        for h in self.handles:
            lib.cuMemRelease(ctypes.c_uint64(h))
        lib.cuMemAddressFree(ctypes.c_uint64(self.base), ctypes.c_size_t(self.size))


class _Holder:
    """Exposes the range as a CUDA array to `torch.as_tensor` and frees it when the tensor (which keeps this object
    alive) is collected."""

    def __init__(self, rng: TieredRange, nbytes: int) -> None:
        self.range = rng
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (rng.base, False),
                                         "version": 3, "strides": None}

    def __del__(self) -> None:
        self.range.release()


def tiered_rows(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, hot: int,
                device: torch.device | str) -> tuple[torch.Tensor, TieredRange]:
    """A [rows, *row_shape] `dtype` tensor on `device` whose rows [0, hot) are VRAM and the rest pinned host RAM of
    the GPU's NUMA node, one address range. Raises VmmUnavailable where the driver cannot."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise VmmUnavailable("one VRAM + host range needs a CUDA device")
    if not 0 <= hot <= rows:
        raise ValueError(f"hot rows {hot} outside [0, {rows}]")
    if rows == 0 or math.prod(row_shape) == 0:
        raise ValueError(f"an empty table ({rows} rows of {tuple(row_shape)}) needs no range")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()                                        # the driver and the primary context, as torch uses them
    lib = _driver()
    numa = ctypes.c_int(-1)
    _check(lib.cuDeviceGetAttribute(ctypes.byref(numa), _ATTR_HOST_NUMA_ID, index), "cuDeviceGetAttribute(HOST_NUMA_ID)")
    # -1: the system has no NUMA (a VM, one socket): its one node, 0, holds every page
    numa_node = max(numa.value, 0)
    dev_prop, host_prop = _prop(_LOC_DEVICE, index), _prop(_LOC_HOST_NUMA, numa_node)
    gran = max(_granularity(dev_prop), _granularity(host_prop))
    row_bytes = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
    total = rows * row_bytes
    dev_bytes = min(-(-hot * row_bytes // gran) * gran, -(-total // gran) * gran)
    host_bytes = -(-max(0, total - dev_bytes) // gran) * gran
    size = dev_bytes + host_bytes
    base = ctypes.c_uint64()
    _check(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(size), ctypes.c_size_t(gran),
                                   ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    handles: list[int] = []
    mapped = 0
    try:
        for nbytes, prop in ((dev_bytes, dev_prop), (host_bytes, host_prop)):
            if nbytes == 0:
                continue
            h = ctypes.c_uint64()
            _check(lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(nbytes), ctypes.byref(prop), ctypes.c_uint64(0)),
                   "cuMemCreate (device)" if prop is dev_prop else "cuMemCreate (host NUMA)")
            handles.append(h.value)
            _check(lib.cuMemMap(ctypes.c_uint64(base.value + mapped), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                                h, ctypes.c_uint64(0)), "cuMemMap")
            mapped += nbytes
        access = _AccessDesc()
        access.location.type = _LOC_DEVICE
        access.location.id = index
        access.flags = _ACCESS_READWRITE
        _check(lib.cuMemSetAccess(ctypes.c_uint64(base.value), ctypes.c_size_t(size), ctypes.byref(access),
                                  ctypes.c_size_t(1)), "cuMemSetAccess")
    except VmmUnavailable:
        if mapped:
            lib.cuMemUnmap(ctypes.c_uint64(base.value), ctypes.c_size_t(mapped))
        for h in handles:
            lib.cuMemRelease(ctypes.c_uint64(h))
        lib.cuMemAddressFree(ctypes.c_uint64(base.value), ctypes.c_size_t(size))
        raise
    rng = TieredRange(base.value, size, dev_bytes, host_bytes, min(rows, -(-dev_bytes // row_bytes)), tuple(handles))
    flat = torch.as_tensor(_Holder(rng, total), device=device)
    return flat[:total].view(dtype).view(rows, *row_shape), rng
