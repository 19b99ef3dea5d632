"""Gated delta rule in plain PyTorch: a chunked form for prefill and the token-by-token recurrence for decode.

State S [heads, d_k, d_v] evolves per token as S = exp(g) S + k (beta (v - S^T k))^T and the output is S^T q.
Both forms compute in float32 and take q/k already L2-normalised; q is scaled by d_k^-1/2 here.
These are the references the fast kernels of `stage_worker/kernels/` are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, T, H, dk]; v: [B, T, H, dv]; g, beta: [B, T, H]; state [B, H, dk, dv] -> (out [B, T, H, dv], state)."""
    q = q.float() * q.shape[-1] ** -0.5
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    s = state.float()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        predicted = (s * kt[..., None]).sum(-2)                     # S^T k: [B, H, dv]
        delta = (v[:, t] - predicted) * beta[:, t][..., None]
        s = s + kt[..., None] * delta[..., None, :]
        outs.append((s * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, dim=1), s


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `recurrent_delta_rule`, parallel inside chunks (WY form), sequential across chunks."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    q = q.float() * dk ** -0.5
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    # [B, H, n, C, d]
    q, k, v = (x.transpose(1, 2).reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(B, H, n, chunk) for x in (g, beta))
    cum = g.cumsum(-1)                                               # log decay from chunk start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # Solve (I + strictly_lower(diag(beta) K K^T * decay)) W = rhs for the WY representation.
    a = (kb @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk, device=q.device)
    system = eye + a
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                        # intra-chunk, causal incl. diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()
    s = state.float()
    out = torch.empty(B, H, n, chunk, dv, device=q.device)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = q_decayed[:, :, c] @ s + attn[:, :, c] @ v_new
        s = s * chunk_decay[:, :, c][..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    out = out.reshape(B, H, n * chunk, dv)[:, :, :T].transpose(1, 2)
    return out, s
