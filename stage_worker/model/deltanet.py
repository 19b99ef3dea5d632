"""Gated DeltaNet token mixer (linear attention with a fixed-size state per sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import HybridMoeConfig
from stage_worker.host_copy import to_device
from stage_worker.kernels.flags import NONE, KernelFlags
from stage_worker.model.activations import activation
from stage_worker.model.batch import StepBatch
from stage_worker.model.ragged import fresh_masked, ragged_causal_conv
from stage_worker.model.cache import DeltaNetState
from stage_worker.model.delta_rule import chunked_delta_rule, l2_normalize, recurrent_delta_rule
from stage_worker.kernels.quant_gemv_ref import PackedWeight
from stage_worker.model.fused_rows import fuse_rows, still_fused
from stage_worker.model.quant_linear import PackedLinear, fuse_packed, packed_matmul, still_fused_packed
from stage_worker.model.norms import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    """Qwen3.5 projection layout (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).

    Qwen3-Next stores grouped in_proj_qkvz / in_proj_ba instead; the checkpoint loader permutes those rows into this
    layout once at load time, so one forward serves both families.
    """

    kernels: KernelFlags = NONE
    # The fused decode kernel also runs on CPU tensors under TRITON_INTERPRET=1, but only where a test opts in: on
    # the CPU every layer otherwise keeps its PyTorch path whatever the flags (stage_worker/kernels/flags.py).
    interpret_on_cpu: bool = False

    def __init__(self, cfg: HybridMoeConfig, gate_activation: str = "silu") -> None:
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.nv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, gate_activation)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.gate_activation = gate_activation
        self.conv_act = activation(cfg.hidden_act)      # the short conv's, as transformers' `config.hidden_act`
        self._fused_in_proj: torch.Tensor | PackedWeight | None = None   # a plain attribute: state_dict unchanged

    def forward(self, x: torch.Tensor, batch: StepBatch, state: DeltaNetState) -> torch.Tensor:
        if self.kernels.deltanet and batch.num_seqs and batch.is_decode and self._decode_kernel_usable(x):
            return self._fused_decode(x, batch, state)
        T = x.shape[0]
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(T, self.nv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if batch.batched_prefill and not batch.is_decode:    # (a decode step keeps the graph-safe path below)
            out = self._prefill_batched(x, mixed, g, beta, batch, state)
            return self.out_proj(self.norm(out, z).reshape(T, -1))
        out = torch.empty(T, self.nv, self.dv, dtype=x.dtype, device=x.device)
        cu = batch.cu_seqlens
        decode = [i for i in range(batch.num_seqs) if batch.seq_lens[i] == 1 and batch.context_lens[i] > 0]
        if decode:
            # One token each: batch the recurrence over sequences.
            if len(decode) == batch.num_seqs:      # a pure decode step: no index tensors built here
                tok, slots = slice(None), batch.device_slots()
            else:
                tok = to_device([cu[i] for i in decode], torch.long, x.device)    # queued: no wait for the GPU
                slots = to_device([batch.slots[i] for i in decode], torch.long, x.device)
            mixed_t = self._conv_step(mixed[tok], state, slots)
            rule = self._fla_rule("recurrent") if (self.kernels.deltanet and x.is_cuda) else None
            if rule is not None:
                q, k, v = self._split_raw(mixed_t[:, None])
                o, s = rule(q, k, v, g=g[tok][:, None], beta=beta[tok][:, None], scale=self.dk ** -0.5,
                            initial_state=state.recurrent[slots], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            else:
                q, k, v = self._split(mixed_t[:, None])
                o, s = recurrent_delta_rule(q, k, v, g[tok][:, None], beta[tok][:, None], state.recurrent[slots])
            state.recurrent[slots] = s
            out[tok] = o[:, 0].to(x.dtype)
        for i in range(batch.num_seqs):
            if i in decode:
                continue
            s_, e_ = cu[i], cu[i + 1]
            slot = batch.slots[i]
            fresh = batch.context_lens[i] == 0
            conv_tail = torch.zeros_like(state.conv[slot]) if fresh else state.conv[slot]
            seq = torch.cat([conv_tail, mixed[s_:e_].T.to(conv_tail.dtype)], dim=-1)     # [C, k-1+n]
            state.conv[slot] = seq[:, -(self.kernel - 1):]
            conv = self.conv_act(F.conv1d(seq[None].to(x.dtype), self.conv1d.weight, groups=self.conv_dim))[0].T
            # A copy, not a view: the state is overwritten below, and training (tools/train_demo.py's agent
            # examples continue a cached prefix) needs the value it read for the backward pass.
            init = torch.zeros_like(state.recurrent[slot]) if fresh else state.recurrent[slot].clone()
            o, s = self._delta_rule(conv[None], g[None, s_:e_], beta[None, s_:e_], init[None])
            state.recurrent[slot] = s[0]
            out[s_:e_] = o[0].to(x.dtype)
        out = self.norm(out, z).reshape(T, -1)
        return self.out_proj(out)

    def _prefill_batched(self, x: torch.Tensor, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         batch: StepBatch, state: DeltaNetState) -> torch.Tensor:
        """Every sequence of a step that is not a pure decode, whatever their lengths and contexts, in one call each
        for the short conv (`ragged.ragged_causal_conv`) and the delta rule:
        sequences of one length (one prompt, training windows) as a [B, L] batch; different lengths on a GPU through
        flash-linear-attention's varlen kernel (`cu_seqlens`, a state per sequence), on the CPU padded (g and beta
        zero past a sequence's end leave its state exactly as it was) or, when padding would more than double the
        work, per sequence. Returns [T, nv, dv] in x's dtype."""
        rg = batch.ragged()
        slots = batch.device_slots()
        tails = fresh_masked(state.conv[slots], rg).transpose(1, 2)          # [B, k-1, C]
        conv, new_tails = ragged_causal_conv(mixed, tails, self.conv1d.weight, 1, rg)
        state.conv[slots] = new_tails.transpose(1, 2)
        conv = self.conv_act(conv)
        # A copy (advanced indexing), not a view: the state is overwritten below, and training (tools/train_demo.py's
        # agent examples continue a cached prefix) needs the value it read for the backward pass.
        init = fresh_masked(state.recurrent[slots], rg)
        fla = self._fla_rule("chunk") if (self.kernels.deltanet and conv.is_cuda) else None
        if rg.uniform or (fla is None and rg.num_seqs * rg.max_len <= 2 * x.shape[0]):
            o, s = self._delta_rule(rg.pad(conv), rg.pad(g), rg.pad(beta), init)
            o = rg.unpad(o)
        elif fla is not None:
            q, k, v = self._split_raw(conv[None])
            o, s = fla(q, k, v, g=g[None], beta=beta[None], scale=self.dk ** -0.5, initial_state=init,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=rg.cu_seqlens,
                       cu_seqlens_cpu=rg.host_cu)
            o = o[0]
        else:
            cu = batch.cu_seqlens
            parts = [self._delta_rule(conv[None, cu[i]:cu[i + 1]], g[None, cu[i]:cu[i + 1]],
                                      beta[None, cu[i]:cu[i + 1]], init[i:i + 1]) for i in range(batch.num_seqs)]
            o, s = torch.cat([p[0][0] for p in parts]), torch.cat([p[1] for p in parts])
        state.recurrent[slots] = s.to(state.recurrent.dtype)
        return o.to(x.dtype)

    def _delta_rule(self, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """conv [B, T, conv_dim] (after the short conv), g/beta [B, T, nv], init [B, nv, dk, dv] -> (out, state):
        flash-linear-attention's chunked kernel on a GPU when enabled, else the model's own rule."""
        fla = self._fla_rule("chunk") if (self.kernels.deltanet and conv.is_cuda) else None
        if fla is not None:
            q, k, v = self._split_raw(conv)
            return fla(q, k, v, g=g, beta=beta, scale=self.dk ** -0.5, initial_state=init, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
        q, k, v = self._split(conv)
        rule = recurrent_delta_rule if conv.shape[1] == 1 else chunked_delta_rule
        return rule(q, k, v, g, beta, init)

    def _decode_kernel_usable(self, x: torch.Tensor) -> bool:
        from stage_worker.kernels.common import triton_usable

        return triton_usable(x) and (x.is_cuda or self.interpret_on_cpu)

    def _fused_decode(self, x: torch.Tensor, batch: StepBatch, state: DeltaNetState) -> torch.Tensor:
        """A pure decode step (every sequence one token, each with a state): one projection GEMV, `gdn_decode`
        (conv step, gates, delta rule and gated norm in two launches, states updated in place), out_proj."""
        from stage_worker.kernels.deltanet_decode import gdn_decode

        mixed, z, b, a = self._decode_projections(x)
        out = gdn_decode(mixed, z, b, a, self.conv1d.weight[:, 0], self.A_log, self.dt_bias, self.norm.weight,
                         self.norm.eps, state.conv, state.recurrent, batch.device_slots(), self.gate_activation)
        return self.out_proj(out)

    def _decode_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed, z, b, a): column slices of one GEMV once the weights are fused (a bf16 weight, or packed words
        and scales read by the W4/6/8A16 GEMV when the four stay packed: `quant_linear.fuse_packed`). The first
        call fuses them; a call inside a CUDA-graph capture never does (the copy would be captured), it runs the
        four GEMVs instead, as do packed projections of different schemes."""
        linears = self._in_projs()
        if not self._is_fused():
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.fuse_projections()
            if not self._is_fused():
                return tuple(m(x) for m in linears)
        fused = self._fused_in_proj
        if isinstance(fused, PackedWeight):
            flags = self.in_proj_qkv.kernels
            y = packed_matmul(x, fused, flags.quant_gemv_fma, flags.quant_gemv_wide)
        else:
            y = F.linear(x, fused)
        return y.split([m.out_features for m in linears], dim=-1)

    def _in_projs(self) -> tuple[nn.Module, ...]:
        return (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def _is_fused(self) -> bool:
        """The four weights are still views of `_fused_in_proj` (not replaced by .to(), a loader, or a user)."""
        fused, linears = self._fused_in_proj, self._in_projs()
        if isinstance(fused, PackedWeight):
            return still_fused_packed(fused, linears)
        return all(type(m) is nn.Linear for m in linears) and still_fused(fused, linears)

    def prepare_kernels(self) -> None:
        """Called by `StageModel.set_kernels`: fuse the projections up front, before any CUDA-graph capture."""
        self.fuse_projections()

    def fuse_projections(self) -> torch.Tensor | PackedWeight | None:
        """Store in_proj_qkv, in_proj_z, in_proj_b and in_proj_a in one [conv_dim + value_dim + 2*nv, hidden]
        weight and rebind each as a Parameter viewing its rows, so decode reads the four in one GEMV.

        No extra memory once the old weights are released; state_dict names and values are unchanged (the fused
        tensor is a plain attribute, not a parameter or buffer); idempotent. Returns the fused weight. Projections
        kept packed (PackedLinear, issue 17) are fused the same way, into one PackedWeight over their words and
        scales, when all four share a scheme (a reports-mixed checkpoint's INT6 group 128); else None.
        """
        if not self._is_fused():
            linears = self._in_projs()
            if all(isinstance(m, PackedLinear) for m in linears):
                self._fused_in_proj = fuse_packed(linears)
            elif all(type(m) is nn.Linear for m in linears):
                self._fused_in_proj = fuse_rows(linears)
        return self._fused_in_proj

    def _conv_step(self, mixed: torch.Tensor, state: DeltaNetState, slots: torch.Tensor) -> torch.Tensor:
        seq = torch.cat([state.conv[slots], mixed[:, :, None].to(state.conv.dtype)], dim=-1)   # [B, C, k]
        state.conv[slots] = seq[:, :, 1:]
        w = self.conv1d.weight[:, 0, :]
        return self.conv_act((seq.to(mixed.dtype) * w[None]).sum(-1))

    @staticmethod
    def _fla_rule(kind: str):
        """flash-linear-attention's kernels, the field's standard for Gated DeltaNet on GPUs (None if absent)."""
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError:
            return None
        return fused_recurrent_gated_delta_rule if kind == "recurrent" else chunk_gated_delta_rule

    def _split_raw(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, conv_dim] -> q, k [B, T, nk, dk] and v [B, T, nv, dv], contiguous, not normalised (the kernel
        L2-normalises and maps value heads onto key heads itself)."""
        B, T, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.nk, self.dk).contiguous(), k.reshape(B, T, self.nk, self.dk).contiguous(),
                v.reshape(B, T, self.nv, self.dv).contiguous())

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, conv_dim] -> q, k (L2-normalised, heads repeated to value heads) and v."""
        B, T, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.float().view(B, T, self.nk, self.dk))
        k = l2_normalize(k.float().view(B, T, self.nk, self.dk))
        rep = self.nv // self.nk
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return q, k, v.view(B, T, self.nv, self.dv)
