"""PyTorch reference of the fused Gated DeltaNet decode kernel in `deltanet_decode.py`.

Written from tensors rather than from a `GatedDeltaNet`, so kernel and reference take the same arguments. The ops,
and therefore the points where a bf16 activation rounds, are those of the model's decode step: the causal-conv step
(`GatedDeltaNet._conv_step`), the gates, `l2_normalize` + `recurrent_delta_rule` for one token, and `GatedRMSNorm`.
It is also graph-capturable (gathers and scatters by a device slots tensor, no host sync), so `gdn_decode` can fall
back to it anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6     # l2_normalize's epsilon for q and k (not the norm's rms_norm_eps)


def split_sizes(conv_dim: int, recurrent_state: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(nk, nv, dk, dv, rep) from the tensor shapes: the conv channels are q (nk*dk), k (nk*dk), v (nv*dv)."""
    _, nv, dk, dv = recurrent_state.shape
    key_dim = (conv_dim - nv * dv) // 2
    nk = key_dim // dk
    if nk <= 0 or 2 * nk * dk + nv * dv != conv_dim or nv % nk:
        raise ValueError(f"conv_dim {conv_dim} is not 2*nk*{dk} + {nv}*{dv} with nk dividing {nv}")
    return nk, nv, dk, dv, nv // nk


def gdn_decode_ref(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                   conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                   eps: float, conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                   gate_activation: str = "silu") -> torch.Tensor:
    """One decode token per row: mixed [B, conv_dim], z [B, nv*dv], b/a [B, nv] (the projection outputs),
    conv_weight [conv_dim, width]; updates conv_state [S, conv_dim, width-1] and recurrent_state [S, nv, dk, dv]
    (fp32) in place at `slots` [B] and returns the gated-normed output [B, nv*dv] in mixed.dtype."""
    B, conv_dim = mixed.shape
    nk, nv, dk, dv, rep = split_sizes(conv_dim, recurrent_state)
    dtype = mixed.dtype
    slots = slots.long()

    # Causal conv over [stored tail, this token]: the window lives in the cache dtype, products in the activation's.
    window = torch.cat([conv_state[slots], mixed.to(conv_state.dtype).unsqueeze(-1)], dim=-1)     # [B, C, width]
    conv_state[slots] = window[..., 1:]
    feat = F.silu((window.to(dtype) * conv_weight).sum(-1))                                       # [B, C]

    q, k, v = feat.split([nk * dk, nk * dk, nv * dv], dim=-1)

    def unit_heads(t: torch.Tensor) -> torch.Tensor:       # [B, nk*dk] -> L2-normalised [B, nv, dk] in fp32
        t = t.float().reshape(B, nk, dk)
        t = t * torch.rsqrt((t * t).sum(-1, keepdim=True) + L2_EPS)
        return t.repeat_interleave(rep, dim=1)             # value head h reads key head h // rep

    q = unit_heads(q) * dk ** -0.5
    k = unit_heads(k)
    v = v.float().reshape(B, nv, dv)
    beta = torch.sigmoid(b).float()                                                  # rounded to dtype first
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())                # [B, nv] fp32

    # Delta rule, one token: decay, read the prediction S^T k, write beta * error along k, read S^T q.
    s = recurrent_state[slots] * g.exp()[..., None, None]                            # [B, nv, dk, dv]
    predicted = (s * k[..., None]).sum(-2)
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    recurrent_state[slots] = s
    o = (s * q[..., None]).sum(-2).to(dtype)                                          # [B, nv, dv]

    # Gated RMSNorm per head: fp32 statistics, rounded to dtype before the weight, act(gate) in fp32.
    h = o.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    h = norm_weight * h
    gate = z.float().reshape(B, nv, dv)
    if gate_activation == "silu":
        gate = F.silu(gate)
    elif gate_activation == "sigmoid":
        gate = torch.sigmoid(gate)
    else:
        raise ValueError(f"gate_activation must be silu or sigmoid, not {gate_activation!r}")
    return (h * gate).to(dtype).reshape(B, nv * dv)
