"""Cache storage a stage holds for its layers: paged K/V, per-slot recurrent states, QSA pooled keys.

Allocation policy (which blocks and slots a request owns) belongs to the scheduler; this module only owns tensors.

With `CacheSpec.kv_offload` (cluster key `qsa_kv_offload`, issue 18) the QSA layers' K/V rows and raw indexer keys
live in one exact-size host allocation per stage (`stage_worker.host_memory`: pinned and registered when the stage
is on a GPU, whose kernels then read and write those rows over PCIe through their UVA addresses); only the pooled
keys stay on the device. QSA reads at most `indexer_budget + ratio - 1` rows a step whatever the context, so the
bodies do not need VRAM (001 §5.1). Layers without an indexer keep their K/V on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.kv_layout import check_block_size
from shared.model_config import HybridMoeConfig, Qwen4ExpConfig
from stage_worker.kernels.kv_rows_ref import gather_rows_ref, scatter_rows_ref

HOST_ALIGN = 256        # bytes: each host tensor starts on this boundary of the stage's allocation (kernel loads)


@dataclass
class CacheSpec:
    num_blocks: int
    block_size: int
    num_slots: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    kv_offload: bool = False        # QSA layers' K/V rows and raw indexer keys in host RAM (see the module doc)
    row_cache_bytes: int = 0        # with kv_offload on a GPU: VRAM caching the rows decode reads, shared by the
    #                                 stage's QSA layers (`kernels/kv_row_cache.py`; cluster key kv_row_cache_mib)
    snapshot_slots: int = 0         # the prefix cache's saved states, numbered after `num_slots`, in host RAM
    #                                 (pinned on a GPU: copied over PCIe; shared/prefix_cache.py)


class AttentionCache:
    """Paged K/V rows [num_blocks * block_size, kv_heads, head_dim]; with QSA also the indexer's raw token keys and
    the pooled key of every complete compression block (one row per `compress_ratio` K/V rows). `host`, when
    given, holds `k`, `v` and `index_keys` (views of the stage's host allocation, `host_shapes`)."""

    row_cache = None        # kv_row_cache.RowCache: the VRAM row cache over the host rows (ModelCache sets it)

    def __init__(self, cfg: HybridMoeConfig, spec: CacheSpec, host: dict[str, torch.Tensor] | None = None) -> None:
        shapes = self.host_shapes(cfg, spec)
        if host is not None and {n: tuple(t.shape) for n, t in host.items()} != shapes:
            raise ValueError(f"host K/V tensors {({n: tuple(t.shape) for n, t in host.items()})} are not the "
                             f"layer's {shapes}")
        for name, shape in shapes.items():
            t = host[name] if host is not None else torch.zeros(shape, dtype=spec.dtype, device=spec.device)
            setattr(self, name, t)
        self.index_keys: torch.Tensor | None = getattr(self, "index_keys", None)
        self.host_kv = host is not None         # prefill reads these rows section by section (section_attention.py)
        self.pooled_keys: torch.Tensor | None = None
        if "index_keys" in shapes:
            rows = spec.num_blocks * spec.block_size
            self.pooled_keys = torch.zeros((rows // cfg.indexer_compress_ratio, cfg.indexer_head_dim),
                                           dtype=spec.dtype, device=spec.device)

    @staticmethod
    def host_shapes(cfg: HybridMoeConfig, spec: CacheSpec) -> dict[str, tuple[int, ...]]:
        """The per-token tensors (what `kv_offload` moves to host RAM): k, v and, with QSA, index_keys."""
        rows = spec.num_blocks * spec.block_size
        shapes = {"k": (rows, cfg.num_key_value_heads, cfg.head_dim), "v": (rows, cfg.num_key_value_heads,
                                                                            cfg.head_dim)}
        if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
            check_block_size(cfg, spec.block_size)
            shapes["index_keys"] = (rows, cfg.indexer_head_dim)
        return shapes


class DeltaNetState:
    """Per-slot causal-conv tail (pre-activation q/k/v features) and fp32 recurrent state."""

    def __init__(self, cfg: HybridMoeConfig, spec: CacheSpec) -> None:
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.conv = torch.zeros((spec.num_slots, conv_dim, cfg.linear_conv_kernel_dim - 1), dtype=spec.dtype,
                                device=spec.device)
        self.recurrent = torch.zeros((spec.num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim), dtype=torch.float32, device=spec.device)


class PLEState:
    """Per-slot dilated-conv tail of the PLE branch and the last ngram_size-1 token ids (the hash context)."""

    def __init__(self, cfg: Qwen4ExpConfig, spec: CacheSpec) -> None:
        tail = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
        self.conv = torch.zeros((spec.num_slots, tail, cfg.hc_count * cfg.hidden_size), dtype=spec.dtype,
                                device=spec.device)
        self.context = torch.full((spec.num_slots, cfg.ngram_size - 1), cfg.primary_eos, dtype=torch.long,
                                  device=spec.device)


class ModelCache:
    """Every cache tensor of layers [start, end) of one stage, keyed by global layer index."""

    def __init__(self, cfg: HybridMoeConfig, spec: CacheSpec, start: int = 0, end: int | None = None,
                 with_mtp: bool = False) -> None:
        self.spec = spec
        end = cfg.num_hidden_layers if end is None else end
        self.attention: dict[int, AttentionCache] = {}
        self.deltanet: dict[int, DeltaNetState] = {}
        self.ple: dict[int, PLEState] = {}
        qsa = [layer for layer in range(start, end) if cfg.is_attention(layer)] \
            if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa and spec.kv_offload else []
        self.host, host_views = _host_pool(cfg, spec, qsa)
        for layer in range(start, end):
            if cfg.is_attention(layer):
                self.attention[layer] = AttentionCache(cfg, spec, host_views.get(layer))
            else:
                self.deltanet[layer] = DeltaNetState(cfg, spec)
            if isinstance(cfg, Qwen4ExpConfig) and cfg.ple_index(layer) is not None:
                self.ple[layer] = PLEState(cfg, spec)
        self.row_cache_counts = _add_row_caches(cfg, spec, [self.attention[layer] for layer in qsa])
        self.snapshots = _snapshot_store(spec, [t for group in (self.deltanet, self.ple) for state in group.values()
                                               for t in vars(state).values() if isinstance(t, torch.Tensor)])
        if with_mtp:
            # The MTP block is one plain full-attention layer; it caches under index num_hidden_layers.
            self.attention[cfg.num_hidden_layers] = AttentionCache(_without_qsa(cfg), spec)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy slot `src`'s per-sequence state (DeltaNet conv tail and recurrent state, PLE conv tail and n-gram
        context) into slot `dst`: the prefix cache's snapshots and restores (shared/prefix_cache.py). Slots from
        `spec.num_slots` on are the snapshots in host RAM. Queued on the current stream like the steps around it
        (from and to pinned memory: asynchronous, in stream order)."""
        n = self.spec.num_slots
        for t, host in self.snapshots:
            into = t[dst] if dst < n else host[dst - n]
            into.copy_(t[src] if src < n else host[src - n], non_blocking=True)

    def bytes(self, groups: tuple[str, ...] = ("attention", "deltanet", "ple")) -> int:
        total = 0
        for group in groups:
            for obj in getattr(self, group).values():
                for t in vars(obj).values():
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total

    def kv_bytes(self) -> int:
        """The paged KV pool (attention layers' blocks, QSA keys included), both tiers."""
        return self.bytes(("attention",))

    def row_cache_bytes(self) -> int:
        """VRAM of the K/V row caches (regions and their tags); not part of `kv_bytes`."""
        return sum(t.numel() * t.element_size() for c in self.attention.values() if c.row_cache is not None
                   for t in vars(c.row_cache).values() if t is not self.row_cache_counts)

    def kv_host_bytes(self) -> int:
        """Of `kv_bytes`, what lives in the host allocation (`kv_offload`; the allocation itself adds a little
        alignment)."""
        return sum(t.numel() * t.element_size() for c in self.attention.values() if c.host_kv
                   for t in (c.k, c.v, c.index_keys) if t is not None)


def _host_pool(cfg: HybridMoeConfig, spec: CacheSpec, layers: list[int]):
    """(HostBuffer or None, layer -> its host tensors): one exact-size allocation for every offloaded layer, pinned
    when the stage computes on a GPU. On the meta device (the memory plan's count) or with no rows: meta/empty
    tensors, nothing allocated."""
    if not layers:
        return None, {}
    shapes = AttentionCache.host_shapes(cfg, spec)
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    device = torch.device(spec.device)
    if device.type == "meta" or spec.num_blocks * spec.block_size == 0:
        return None, {layer: {n: torch.zeros(s, dtype=spec.dtype, device=device) for n, s in shapes.items()}
                      for layer in layers}
    layout, offset = [], 0
    for layer in layers:
        for name, shape in shapes.items():
            offset = -(-offset // HOST_ALIGN) * HOST_ALIGN
            layout.append((layer, name, offset, shape))
            offset += math.prod(shape) * itemsize
    from stage_worker.host_memory import allocate       # numpy, mmap: only where a pool is made

    buf = allocate(offset, what=f"QSA K/V of layers {layers[0]}-{layers[-1]}", pin=device.type == "cuda")
    views: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in layers}
    for layer, name, off, shape in layout:
        views[layer][name] = buf.tensor[off:off + math.prod(shape) * itemsize].view(spec.dtype).view(shape)
    return buf, views


def _snapshot_store(spec: CacheSpec, tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(per-slot state tensor, its `spec.snapshot_slots` rows in host RAM) for each tensor: on a GPU one exact-size
    pinned allocation for all of them (`stage_worker.host_memory`: a 48-layer Qwen4-Exp's state is ~75 MB a
    sequence, VRAM the experts and KV need more). None without snapshots or on the meta device."""
    device = torch.device(spec.device)
    if spec.snapshot_slots <= 0 or device.type == "meta" or not tensors:
        return [(t, None) for t in tensors]
    shapes = [(spec.snapshot_slots, *t.shape[1:]) for t in tensors]
    sizes = [math.prod(shape) * t.element_size() for shape, t in zip(shapes, tensors)]
    what = f"{spec.snapshot_slots} prefix-cache states (--prefix-cache-states)"
    from stage_worker.host_memory import allocate, check_free   # numpy, mmap: only where snapshots are kept

    if device.type != "cuda":
        # A CPU stage: its own memory is host RAM. Checked first, as the GPU's pinned buffer is: torch.zeros writes
        # every page, and an oversized --prefix-cache-states had the stage fill the host's RAM (~25 GB) while the
        # launcher waited for it. No headroom asked: only states that cannot fit at all are refused.
        if Path("/proc/meminfo").exists():             # Linux (MemAvailable); elsewhere as before
            check_free(sum(sizes), what, headroom=0)
        return [(t, torch.zeros(shape, dtype=t.dtype)) for t, shape in zip(tensors, shapes)]
    offsets = [0]
    for size in sizes:
        offsets.append(-(-(offsets[-1] + size) // HOST_ALIGN) * HOST_ALIGN)
    buf = allocate(offsets[-1], what=what, pin=True)
    out = []
    for t, shape, off, size in zip(tensors, shapes, offsets, sizes):
        out.append((t, buf.tensor[off:off + size].view(t.dtype).view(shape)))
    return out


def _add_row_caches(cfg: HybridMoeConfig, spec: CacheSpec, caches: list[AttentionCache]) -> torch.Tensor | None:
    """Give each host-K/V layer its share of `spec.row_cache_bytes` as a VRAM row cache; returns the (hits,
    lookups) counters they share, or None. Only where the decode kernels run (a GPU; the meta device for the memory
    plan's count): the CPU's PyTorch path reads its rows from RAM anyway."""
    device = torch.device(spec.device)
    if not caches or spec.row_cache_bytes <= 0 or device.type == "cpu":
        return None
    from stage_worker.kernels.kv_row_cache import RowCache, slots_for

    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    n = slots_for(spec.row_cache_bytes, len(caches), cfg.num_key_value_heads, cfg.head_dim, itemsize)
    if n == 0:
        return None
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for c in caches:
        c.row_cache = RowCache.new(n, cfg.num_key_value_heads, cfg.head_dim, spec.dtype, device, counts)
    return counts


def _without_qsa(cfg: HybridMoeConfig) -> HybridMoeConfig:
    import dataclasses

    if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
        return dataclasses.replace(cfg, indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None,
                                   indexer_budget=None, indexer_compress_ratio=None)
    return cfg


def read_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`src[rows]` on rows' device, whichever tier `src` lives in: host K/V rows are copied by a gather kernel that
    reads them over PCIe (`kernels/kv_rows.py`), bit for bit; anything else is plain indexing (the CPU path)."""
    if src.device == rows.device or rows.device.type != "cuda":
        return gather_rows_ref(src, rows).to(rows.device)
    from stage_worker.kernels.kv_rows import gather_rows    # Triton: only where a GPU reads host rows

    return gather_rows(src, rows)


def write_rows(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """`dst[rows] = values` (rounded to dst's dtype), whichever tier `dst` lives in (see `read_rows`)."""
    values = values.to(dst.dtype)
    if dst.device == values.device or values.device.type != "cuda":
        scatter_rows_ref(dst, rows, values)
        return
    from stage_worker.kernels.kv_rows import scatter_rows

    scatter_rows(dst, rows, values)
