"""The PLE branch of Qwen4-Exp: hashed n-gram rows projected to a value and one key per residual stream, gated
against each normalised stream, then a dilated depthwise conv (kernel `ple_conv_kernel_size`, dilation `ngram_size`)
adds local context. Applied to the streams before the layer's token mixer.

The table itself is not a parameter: it is a flat file (95 GiB at full size) that the PLE service gathers from, or
that this module gathers from itself behind the in-process fallback.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import Qwen4ExpConfig
from shared.ngram_hash import NgramHashSpec, ngram_rows_torch, ngram_rows_torch_flat
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import PLEState
from stage_worker.model.norms import ZeroCentredRMSNorm
from stage_worker.model.ragged import fresh_masked, ragged_causal_conv


class PLEBranch(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig, ple_index: int) -> None:
        super().__init__()
        self.hidden, self.hc = cfg.hidden_size, cfg.hc_count
        self.spec = NgramHashSpec.from_model_config(cfg, ple_index)
        self.heads, self.head_dim = cfg.ple_heads, cfg.ple_head_dim
        width = self.hidden * self.hc
        dim = cfg.ple_embed_dim
        self.key_proj = nn.Linear(dim, width, bias=False)
        self.value_proj = nn.Linear(dim, self.hidden, bias=False)
        self.norm_key = ZeroCentredRMSNorm(width, cfg.rms_norm_eps, group_size=self.hidden)
        self.norm_query = ZeroCentredRMSNorm(width, cfg.rms_norm_eps, group_size=self.hidden)
        self.norm_conv = ZeroCentredRMSNorm(width, cfg.rms_norm_eps, group_size=self.hidden)
        self.kernel, self.dilation = cfg.ple_conv_kernel_size, cfg.ngram_size
        self.conv1d = nn.Conv1d(width, width, self.kernel, groups=width, dilation=self.dilation, bias=False)
        self.table = None   # set by the loader: an object with .gather(rows) -> [N, head_dim]

    def rows(self, batch: StepBatch, state: PLEState) -> torch.Tensor:
        """Table rows [T, heads] for this step's tokens; advances the per-slot n-gram context."""
        if batch.is_decode:
            slots = batch.device_slots()
            r, new_ctx = ngram_rows_torch(self.spec, state.context[slots], batch.token_ids[:, None])
            state.context[slots] = new_ctx
            return r[:, 0]
        if batch.batched_prefill:
            slots, rg = batch.device_slots(), batch.ragged()
            ctx = fresh_masked(state.context[slots], rg, self.spec.eos_token_id)
            if rg.uniform:                     # one length: the [B, L] form, fewer launches than the flat one
                rows, new_ctx = ngram_rows_torch(self.spec, ctx, rg.pad(batch.token_ids))
                rows = rg.unpad(rows)
            else:
                rows, new_ctx = ngram_rows_torch_flat(self.spec, ctx, batch.token_ids, rg.cu_seqlens)
            state.context[slots] = new_ctx
            return rows
        out = []
        cu = batch.cu_seqlens
        for i in range(batch.num_seqs):
            slot = batch.slots[i]
            ctx = state.context[slot:slot + 1]
            if batch.context_lens[i] == 0:
                ctx = torch.full_like(ctx, self.spec.eos_token_id)
            r, new_ctx = ngram_rows_torch(self.spec, ctx, batch.token_ids[None, cu[i]:cu[i + 1]])
            state.context[slot] = new_ctx[0]
            out.append(r[0])
        return torch.cat(out)

    def decode_embeddings(self, batch: StepBatch, state: PLEState) -> torch.Tensor:
        """The table rows a decode step will read, [B, heads, head_dim] on the step's device, WITHOUT advancing the
        n-gram context: gathered before a CUDA-graph replay into the buffer the graph reads (a host table needs
        the row ids on the host, a synchronisation a captured step cannot contain), as the PLE service's rows are."""
        r, _ = ngram_rows_torch(self.spec, state.context[batch.device_slots()], batch.token_ids[:, None])
        rows = r[:, 0]
        return self.table.gather(rows.flatten()).view(*rows.shape, -1).to(batch.token_ids.device, non_blocking=True)

    def forward(self, streams: torch.Tensor, batch: StepBatch, state: PLEState, layer: int) -> torch.Tensor:
        rows = self.rows(batch, state)
        emb = batch.ple_rows.get(layer)
        if emb is None:
            emb = self.table.gather(rows.flatten()).view(*rows.shape, -1).to(streams.device, non_blocking=True)
        emb = emb.flatten(-2).to(streams.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(streams).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value[:, None, :]).flatten(-2)
        return streams + gated + self._conv(self.norm_conv(gated), batch, state)

    def _conv(self, x: torch.Tensor, batch: StepBatch, state: PLEState) -> torch.Tensor:
        tail_len = state.conv.shape[1]
        if batch.is_decode:
            slots = batch.device_slots()
            seq = torch.cat([state.conv[slots], x[:, None, :].to(state.conv.dtype)], dim=1)   # [B, tail + 1, W]
            state.conv[slots] = seq[:, 1:]
            taps = seq[:, :: self.dilation].to(x.dtype)                                       # [B, kernel, W]
            return F.silu((taps * self.conv1d.weight[:, 0, :].T[None]).sum(1))
        if batch.batched_prefill:
            slots, rg = batch.device_slots(), batch.ragged()
            tails = fresh_masked(state.conv[slots], rg)                              # [B, tail, W]
            y, new_tails = ragged_causal_conv(x, tails, self.conv1d.weight, self.dilation, rg)
            state.conv[slots] = new_tails
            return F.silu(y)
        out = torch.empty_like(x)
        cu = batch.cu_seqlens
        for i in range(batch.num_seqs):
            s, e = cu[i], cu[i + 1]
            slot = batch.slots[i]
            tail = torch.zeros_like(state.conv[slot]) if batch.context_lens[i] == 0 else state.conv[slot]
            seq = torch.cat([tail, x[s:e].to(tail.dtype)], dim=0)          # [tail + n, width]
            state.conv[slot] = seq[-tail_len:]
            y = F.conv1d(seq.T[None].to(x.dtype), self.conv1d.weight, groups=seq.shape[1], dilation=self.dilation)
            out[s:e] = F.silu(y[0].T)
        return out
