"""Multi-token-prediction head in vLLM's Qwen3-Next MTP layout (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`).

It predicts token t+2 from the main model's final hidden state at t and the embedding of token t+1. Its block is one
plain pre-norm full-attention + MoE layer for every family (`transformers` ignores `mtp.*`, so vLLM's layout is the
reference); it caches K/V under layer index `num_hidden_layers`.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridMoeConfig
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import ModelCache
from stage_worker.model.decoder import DecoderLayer
from stage_worker.model.norms import ZeroCentredRMSNorm
from stage_worker.model.rope import Rotary


class MTPHead(nn.Module):
    def __init__(self, cfg: HybridMoeConfig, rotary: Rotary) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)    # the last stage's own copy of the embedding
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleDict({"0": DecoderLayer(cfg, cfg.num_hidden_layers, rotary,
                                                       force_full_attention=True)})
        self.norm = ZeroCentredRMSNorm(H, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: StepBatch, cache: ModelCache) -> torch.Tensor:
        """hidden: the main model's final hidden states of batch's positions; batch.token_ids: the next tokens."""
        e = self.pre_fc_norm_embedding(self.embed_tokens(batch.token_ids))
        h = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = self.rotary.cos_sin(batch.positions, h.dtype)
        return self.norm(self.layers["0"](h, batch, cache, rope))
