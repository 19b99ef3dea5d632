"""A contiguous slice of the model: what one pipeline stage holds.

`StageModel(cfg, start, end)` owns layers [start, end); the first slice also owns the token embedding, the last the
final mixer/norm, lm_head and (optionally) the MTP head. Between stages the hidden state is `hc_count * hidden_size`
wide for Qwen4-Exp (all residual streams travel) and `hidden_size` otherwise.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shared.model_config import HybridMoeConfig
from stage_worker.kernels.common import set_l2_prefetch, set_pdl
from stage_worker.model.activations import is_silu
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec, ModelCache
from stage_worker.model.decoder import DecoderLayer
from stage_worker.model.hyper_connection import GatedResidual
from stage_worker.model.moe import SparseMoE
from stage_worker.model.mtp import MTPHead
from stage_worker.model.norms import ZeroCentredRMSNorm
from stage_worker.model.rope import Rotary

log = logging.getLogger("moepipe.model")


class StageModel(nn.Module):
    experts = None    # stage_worker.expert_offload.StageExperts when some routed experts live in host RAM

    def __init__(self, cfg: HybridMoeConfig, start: int = 0, end: int | None = None, *,
                 with_embedding: bool | None = None, with_head: bool | None = None, with_mtp: bool = False) -> None:
        super().__init__()
        end = cfg.num_hidden_layers if end is None else end
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {cfg.num_hidden_layers})")
        self.cfg, self.start, self.end = cfg, start, end
        self.has_embedding = start == 0 if with_embedding is None else with_embedding
        self.has_head = end == cfg.num_hidden_layers if with_head is None else with_head
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_dim)
        if self.has_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, self.rotary) for i in range(start, end)})
        if self.has_head:
            if cfg.uses_hyper_connections:
                self.hyper_connection_mixer = GatedResidual(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank,
                                                            cfg.rms_norm_eps, inject=False)
            else:
                self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg, self.rotary) if (with_mtp and self.has_head) else None

    def set_kernels(self, flags) -> None:
        """Switch fast kernels on or off for every layer (see stage_worker/kernels/flags.py)."""
        from stage_worker.kernels.flags import NONE
        from stage_worker.kernels.moe import set_route_key32
        from stage_worker.kernels.quant_gemv import set_dequant_kernel

        act = getattr(getattr(self, "cfg", None), "hidden_act", "silu")
        if not is_silu(act) and flags != NONE:
            log.warning("hidden_act %r: the fused kernels compute SiLU; this model runs its PyTorch path", act)
            flags = NONE
        self.kernel_flags = flags
        set_pdl(getattr(flags, "pdl", False))     # the decode kernels' launch mode: one setting, kernels/common.py
        set_l2_prefetch(getattr(flags, "l2_prefetch", False))     # their L2 prefetch before the wait (with pdl)
        set_dequant_kernel(getattr(flags, "quant_dequant", False))     # packed weights' prefill dequantize
        set_route_key32(getattr(flags, "route_key32", False))           # the router top-k's keys (kernels/moe.py)
        for m in self.modules():
            if hasattr(type(m), "kernels"):
                m.kernels = flags
            if hasattr(m, "prepare_kernels"):
                m.prepare_kernels()     # weight layouts the kernels want (views over the same storage, no copy)

    @property
    def stream_width(self) -> int:
        hc = self.cfg.hc_count if self.cfg.uses_hyper_connections else 1
        return hc * self.cfg.hidden_size

    def moe_layers(self) -> dict[int, SparseMoE]:
        """Decoder layer index -> its SparseMoE, in layer order, for the layers of this slice that have one."""
        return {int(i): layer.mlp for i, layer in self.layers.items() if isinstance(layer.mlp, SparseMoE)}

    def new_cache(self, spec: CacheSpec) -> ModelCache:
        return ModelCache(self.cfg, spec, self.start, self.end, with_mtp=self.mtp is not None)

    def forward(self, batch: StepBatch, cache: ModelCache, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this slice. `hidden` is the previous stage's output; the first slice embeds `batch.token_ids`."""
        if self.has_embedding:
            hidden = self.embed_tokens(batch.token_ids)
            if self.cfg.uses_hyper_connections:
                hidden = hidden.repeat(1, self.cfg.hc_count)
        if hidden is None:
            raise ValueError("a stage without the embedding needs the previous stage's hidden states")
        rope = self.rotary.cos_sin(batch.positions, hidden.dtype)
        pending = None
        for layer in self.layers.values():
            hidden, pending = layer.forward_deferred(hidden, pending, batch, cache, rope)
        hidden = layer.finish(hidden, pending)
        if self.experts is not None and self.experts.prefetch_hits is not None:
            from stage_worker.kernels.expert_prefetch import join_prefetch

            join_prefetch(hidden.device)      # the layer-ahead expert copies (`expert_prefetch`) end with the step
        return hidden

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Collapse the streams (or apply the final norm): the state lm_head and the MTP head read."""
        if self.cfg.uses_hyper_connections:
            return self.hyper_connection_mixer.mix(hidden)[0]
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        return self.lm_head(self.final_hidden(hidden[batch.logits_indices]))
