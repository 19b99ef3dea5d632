"""One decoder layer: token mixer (Gated DeltaNet or gated attention) then MoE, with either a plain pre-norm
residual (Qwen3-Next, Qwen3.5-MoE) or hyper-connection streams (Qwen4-Exp, where PLE may come first)."""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridMoeConfig, Qwen4ExpConfig
from stage_worker.model.attention import GatedAttention
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import ModelCache
from stage_worker.model.deltanet import GatedDeltaNet
from stage_worker.model.hyper_connection import GatedResidual
from stage_worker.model.moe import SparseMoE, SwiGLU
from stage_worker.model.norms import ZeroCentredRMSNorm
from stage_worker.model.ple import PLEBranch
from stage_worker.model.rope import Rotary


def build_mlp(cfg: HybridMoeConfig, layer: int) -> nn.Module:
    if cfg.is_sparse_moe(layer):
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.shared_expert_intermediate_size, cfg.norm_topk_prob, act=cfg.hidden_act)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridMoeConfig, layer: int, rotary: Rotary, force_full_attention: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.is_attention = force_full_attention or cfg.is_attention(layer)
        self.hyper = cfg.uses_hyper_connections and not force_full_attention
        gate_act = cfg.gate_activation if isinstance(cfg, Qwen4ExpConfig) else "silu"     # Qwen3-Next/3.5: fixed
        if self.is_attention:
            use_qsa = isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa and not force_full_attention
            self.self_attn = GatedAttention(cfg, use_qsa, rotary)
        else:
            self.linear_attn = GatedDeltaNet(cfg, gate_act)
        self.mlp = build_mlp(cfg, layer)
        self.ple = None
        if self.hyper:
            ple_index = cfg.ple_index(layer)
            self.ple = PLEBranch(cfg, ple_index) if ple_index is not None else None
            args = (cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps)
            self.attn_hyper_connection = GatedResidual(*args)
            self.mlp_hyper_connection = GatedResidual(*args)
        else:
            self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mixer(self, x: torch.Tensor, batch: StepBatch, cache: ModelCache, rope) -> torch.Tensor:
        if self.is_attention:
            return self.self_attn(x, batch, cache.attention[self.layer], rope)
        return self.linear_attn(x, batch, cache.deltanet[self.layer])

    def forward(self, h: torch.Tensor, batch: StepBatch, cache: ModelCache, rope) -> torch.Tensor:
        h, pending = self.forward_deferred(h, None, batch, cache, rope)
        return self.finish(h, pending)

    def forward_deferred(self, h: torch.Tensor, pending, batch: StepBatch, cache: ModelCache, rope):
        """`forward`, with the layer's last residual update left to the next layer: `pending` is the previous
        layer's MLP output not yet added to `h` (with hyper-connections: (output, injection weights)); this layer
        returns its own the same way, and `finish` applies it. The update then happens inside the next layer's
        first kernel (the hyper-connection mix, or the fused add + RMSNorm): one launch fewer per block with the
        kernels on. Same math as `forward`."""
        if not self.hyper:
            if pending is None:
                x = self.input_layernorm(h)
            else:
                h, x = self.input_layernorm.add_forward(h, pending)
            h, x = self.post_attention_layernorm.add_forward(h, self.mixer(x, batch, cache, rope))
            return h, self.mlp(x)
        if self.ple is not None:
            if pending is not None:
                h, pending = self.attn_hyper_connection.inject_fast(h, *pending), None
            h = self.ple(h, batch, cache.ple[self.layer], self.layer)
        if pending is None:
            x, w = self.attn_hyper_connection.mix(h)
        else:
            h, x, w = self.attn_hyper_connection.inject_mix(h, *pending)
        out = self.mixer(x, batch, cache, rope)
        h, x, w = self.mlp_hyper_connection.inject_mix(h, out, w)
        return h, (self.mlp(x), w)

    def finish(self, h: torch.Tensor, pending) -> torch.Tensor:
        """Apply the residual update `forward_deferred` left pending."""
        if not self.hyper:
            return h + pending
        return self.mlp_hyper_connection.inject_fast(h, *pending)
