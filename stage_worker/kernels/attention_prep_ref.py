"""PyTorch reference of `attention_prep.py`: the decode prologue exactly as `GatedAttention.forward` computes it
(norms, RoPE, cache writes, sigmoid of the gate), from the one projection row per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.kernels.rmsnorm_ref import rmsnorm
from stage_worker.model.rope import apply_rotary


@dataclass(frozen=True)
class PrepLayout:
    """Shapes and the column offsets of each part inside a projection row."""

    n_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    q_off: int               # q head h at q_off + h * 2 * head_dim, its gate head right after it
    k_off: int
    v_off: int
    idx_heads: int = 0       # 0: no QSA indexer
    idx_dim: int = 0
    iq_off: int = 0
    ik_off: int = 0


def attention_decode_prep_ref(proj: torch.Tensor, layout: PrepLayout, cos: torch.Tensor, sin: torch.Tensor,
                              slot_mapping: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                              idx_q_norm_w: torch.Tensor | None = None, index_keys: torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    L = layout
    T = proj.shape[0]
    nq, nkv = L.n_heads * L.head_dim, L.kv_heads * L.head_dim
    q, gate = proj[:, L.q_off:L.q_off + 2 * nq].view(T, L.n_heads, 2 * L.head_dim).chunk(2, dim=-1)
    q = apply_rotary(rmsnorm(q, q_norm_w, eps), cos, sin)
    k = proj[:, L.k_off:L.k_off + nkv].view(T, L.kv_heads, L.head_dim)
    k = apply_rotary(rmsnorm(k, k_norm_w, eps), cos, sin)
    v = proj[:, L.v_off:L.v_off + nkv].view(T, L.kv_heads, L.head_dim)
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)
    iq = None
    if L.idx_heads:
        iq = proj[:, L.iq_off:L.iq_off + L.idx_heads * L.idx_dim].view(T, L.idx_heads, L.idx_dim)
        iq = apply_rotary(rmsnorm(iq, idx_q_norm_w, eps), cos, sin)
        index_keys[slot_mapping] = proj[:, L.ik_off:L.ik_off + L.idx_dim].to(index_keys.dtype)
    return q.contiguous(), torch.sigmoid(gate.reshape(T, -1)), iq


def qsa_pool_update_ref(index_keys: torch.Tensor, pooled_keys: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, k_norm_w: torch.Tensor, inv_freq: torch.Tensor, eps: float,
                        block_size: int, ratio: int, rotary_dim: int) -> None:
    """`GatedAttention._decode_kernels`' re-pooling of the block holding each newest token, in PyTorch ops:
    mean of the block's raw index keys (fp32, rounded), zero-centred RMSNorm, RoPE at the block's first position."""
    first = (lens.long() - 1) // ratio * ratio                                     # [B]
    pos = first[:, None] + torch.arange(ratio, device=lens.device)[None, :]         # [B, r]
    blk = torch.gather(tables.long(), 1, (pos // block_size).clamp_max(tables.shape[1] - 1))
    rows = blk * block_size + pos % block_size
    dtype = pooled_keys.dtype
    pooled = index_keys[rows].float().mean(dim=1).to(index_keys.dtype)
    freqs = first.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    normed = rmsnorm(pooled, k_norm_w, eps)
    pooled_keys[rows[:, 0] // ratio] = apply_rotary(normed[:, None, :], cos, sin)[:, 0].to(dtype)
