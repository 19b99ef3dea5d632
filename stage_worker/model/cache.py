"""Cache storage a stage holds for its layers: paged K/V, per-slot recurrent states, QSA pooled keys.

Allocation policy (which blocks and slots a request owns) belongs to the scheduler; this module only owns tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kv_layout import check_block_size
from shared.model_config import HybridMoeConfig, Qwen4ExpConfig


@dataclass
class CacheSpec:
    num_blocks: int
    block_size: int
    num_slots: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"


class AttentionCache:
    """Paged K/V rows [num_blocks * block_size, kv_heads, head_dim]; with QSA also the indexer's raw token keys and
    the pooled key of every complete compression block (one row per `compress_ratio` K/V rows)."""

    def __init__(self, cfg: HybridMoeConfig, spec: CacheSpec) -> None:
        rows = spec.num_blocks * spec.block_size
        shape = (rows, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.index_keys: torch.Tensor | None = None
        self.pooled_keys: torch.Tensor | None = None
        if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
            r = cfg.indexer_compress_ratio
            check_block_size(cfg, spec.block_size)
            self.index_keys = torch.zeros((rows, cfg.indexer_head_dim), dtype=spec.dtype, device=spec.device)
            self.pooled_keys = torch.zeros((rows // r, cfg.indexer_head_dim), dtype=spec.dtype, device=spec.device)


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
        for layer in range(start, end):
            if cfg.is_attention(layer):
                self.attention[layer] = AttentionCache(cfg, spec)
            else:
                self.deltanet[layer] = DeltaNetState(cfg, spec)
            if isinstance(cfg, Qwen4ExpConfig) and cfg.ple_index(layer) is not None:
                self.ple[layer] = PLEState(cfg, spec)
        if with_mtp:
            # The MTP block is one plain full-attention layer; it caches under index num_hidden_layers.
            self.attention[cfg.num_hidden_layers] = AttentionCache(_without_qsa(cfg), spec)

    def bytes(self, groups: tuple[str, ...] = ("attention", "deltanet", "ple")) -> int:
        total = 0
        for group in groups:
            for obj in getattr(self, group).values():
                for t in vars(obj).values():
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total

    def kv_bytes(self) -> int:
        """The paged KV pool (attention layers' blocks, QSA keys included)."""
        return self.bytes(("attention",))


def _without_qsa(cfg: HybridMoeConfig) -> HybridMoeConfig:
    import dataclasses

    if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
        return dataclasses.replace(cfg, indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None,
                                   indexer_budget=None, indexer_compress_ratio=None)
    return cfg
