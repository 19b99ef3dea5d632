"""Gated full attention over paged K/V, with the QSA indexer of Qwen4-Exp choosing which K/V rows each query reads.

QSA: the indexer scores blocks of `compress_ratio` keys (the block's raw keys averaged, normalised, rotated at the
block's first position) by sum over heads of ReLU(q.k)/sqrt(d); each query reads the top `budget/ratio` complete blocks
plus the incomplete tail. A decode step therefore reads a bounded number of K/V rows whatever the context length
(001 §1), which is what later lets K/V live in host RAM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import HybridMoeConfig, Qwen4ExpConfig
from stage_worker.host_copy import to_device
from stage_worker.kernels.flags import NONE, KernelFlags
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import AttentionCache, read_rows, write_rows
from stage_worker.kernels.quant_gemv_ref import PackedWeight
from stage_worker.model.fused_rows import fuse_rows, still_fused
from stage_worker.model.norms import ZeroCentredRMSNorm
from stage_worker.model.quant_linear import PackedLinear, fuse_packed, packed_matmul, still_fused_packed
from stage_worker.model.rope import Rotary, apply_rotary


def stable_topk_mask(scores: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the k best valid entries per row; equal scores go to the lower index (documented tie rule).

    No sort: the k-th best value is a threshold, everything above it is in, and of the entries equal to it the
    lowest-indexed ones fill the remaining places (a prefix count). A stable sort per query was a sixth of a
    25k-token prompt's CPU prefill (docs/performance.md)."""
    n = scores.shape[-1]
    if k <= 0 or n == 0:
        return torch.zeros_like(valid)
    if k >= n:
        return valid.clone()
    masked = scores.masked_fill(~valid, float("-inf"))
    kth = masked.topk(k, dim=-1).values[..., -1:]
    above = masked > kth
    tied = (masked == kth) & valid
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


class QSAIndexer(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig) -> None:
        super().__init__()
        self.n_heads = cfg.indexer_n_heads
        self.head_dim = cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.block_topk = cfg.indexer_budget // cfg.indexer_compress_ratio
        self.keys = self.block_topk * self.ratio + self.ratio - 1      # the most keys one query reads
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = self.index_qk_proj(x)
        q, raw_k = qk.split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        q = apply_rotary(self.q_layernorm(q.view(-1, self.n_heads, self.head_dim)), cos, sin)
        return q, raw_k

    def pool(self, raw_keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """raw_keys: [blocks, ratio, d] -> normalised, rotated pooled keys [blocks, d] (cos/sin at block starts)."""
        pooled = raw_keys.float().mean(dim=1).to(raw_keys.dtype)
        return apply_rotary(self.k_layernorm(pooled)[:, None, :], cos, sin)[:, 0]

    def block_scores(self, q: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """[..., q_len, blocks] fp32: sum over indexer heads of ReLU(q . pooled key) / sqrt(d) (leading dims: a
        batch of sequences)."""
        scores = torch.einsum("...qhd,...bd->...qbh", q.float(), pooled.float())
        return torch.relu(scores).sum(-1) / math.sqrt(self.head_dim)

    def distill_loss(self, q: torch.Tensor, pooled: torch.Tensor, positions: torch.Tensor,
                     attn_probs: torch.Tensor) -> torch.Tensor:
        """KL(dense attention's mass per complete block || softmax of the indexer's block scores), averaged over
        queries that see at least two complete blocks (sparse-attention models train their indexer this way before
        it selects). attn_probs [..., heads, q_len, ctx] is detached: the indexer learns from attention, not vice
        versa. Leading dims are a batch of sequences that share `positions`."""
        r = self.ratio
        nb = pooled.shape[-2]
        complete = (positions + 1) // r
        mass = attn_probs.detach().float().mean(-3)[..., : nb * r].unflatten(-1, (nb, r)).sum(-1)   # [..., q, nb]
        valid = torch.arange(nb, device=q.device)[None, :] < complete[:, None]
        rows = complete >= 2
        if not bool(rows.any()):
            return q.new_zeros((), dtype=torch.float32)
        mass = mass.masked_fill(~valid, 0.0)[..., rows, :]
        target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-9)
        scores = self.block_scores(q[..., rows, :, :], pooled)
        logp = torch.log_softmax(scores.masked_fill(~valid[rows], float("-inf")), -1)
        kl = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-12)) - logp), 0.0)
        return kl.sum(-1).mean()

    def select(self, q: torch.Tensor, pooled: torch.Tensor, positions: torch.Tensor, ctx: int) -> torch.Tensor:
        """Visibility mask [..., q_len, ctx]: selected complete blocks plus the tail, causal (leading dims: a batch
        of sequences sharing `positions`). The mask form of `selected_positions`, for the dense paths."""
        key_pos, valid = self.selected_positions(q, pooled, positions)
        mask = torch.zeros(*key_pos.shape[:-1], ctx + 1, dtype=torch.bool, device=q.device)
        return mask.scatter_(-1, torch.where(valid, key_pos, ctx), True)[..., :ctx]

    def selected_positions(self, q: torch.Tensor, pooled: torch.Tensor,
                           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The one selection rule: (key positions [..., q_len, K], valid [..., q_len, K]) per query, with
        K = `keys` = block_topk * ratio + ratio - 1: the tokens of the best `block_topk` complete blocks before the
        query (ties: the lower block), ascending, then the incomplete tail up to the query. Leading dims: a batch
        of sequences sharing `positions`. Prefill reads ~K keys per query this way instead of the whole context."""
        r, k = self.ratio, self.block_topk
        scores = self.block_scores(q, pooled)                                # [..., q, blocks]
        complete = (positions + 1) // r                                      # complete blocks visible per query
        nb = pooled.shape[-2]
        block_ids = torch.arange(nb, device=q.device)
        chosen = stable_topk_mask(scores, k, (block_ids[None, :] < complete[:, None]).expand_as(scores))
        # Compact the chosen block ids to the front of each row, ascending: a prefix count is each one's slot, and
        # the unchosen all land in the spare column k, which is dropped.
        slot = torch.where(chosen, chosen.long().cumsum(-1) - 1, k)
        blocks = torch.full((*scores.shape[:-1], k + 1), nb, dtype=torch.long, device=q.device)
        blocks = blocks.scatter_(-1, slot, block_ids.expand_as(slot))[..., :k]
        offs = torch.arange(r, device=q.device)
        in_blocks = (blocks[..., None] * r + offs).flatten(-2)                # [..., q, k * r]
        in_valid = (blocks < nb).repeat_interleave(r, dim=-1)
        tail = ((complete * r)[:, None] + offs[: r - 1]).expand(*blocks.shape[:-1], r - 1)
        tail_valid = tail <= positions[:, None]
        return torch.cat([in_blocks, tail], -1), torch.cat([in_valid, tail_valid], -1)


# The batched path of same-length new sequences holds every sequence's [heads, L, L] scores at once; above this many
# elements (256 MB in float32) it loops over sequences instead, so a large batched prefill cannot multiply peak memory.
BATCHED_SCORES_LIMIT = 1 << 26
# QSA prefill gathers each query's selected keys once the context is this many times the keys a query may read.
# Gathering costs far more per key than a dense score (demo model, one CPU thread, 512-token chunks: the gather
# path is slower at a 1k context and twice as fast at 12k; docs/performance.md), so below that the dense masked
# scores win. Queries go through in slices of SPARSE_PREFILL_QUERIES so the gathered K/V stay bounded (full shape:
# 256 x 2051 x 2 x 256 bf16 = 0.5 GB each).
SPARSE_PREFILL_FACTOR = 16
SPARSE_PREFILL_QUERIES = 256
# Prefill over host K/V (`_attend_host_sections`) selects in query slices of at most this many block scores.
HOST_SELECT_SCORES = 1 << 25
# The dense masked path attends in query slices of at most this many: its [heads, queries, context] scores then
# stay those of a 512-token chunk however large the chunk (a GPU's default chunk is 2048 tokens, shared/cluster_config
# GPU_MAX_NUM_BATCHED_TOKENS: unsliced its scratch at the full shape's dense/sparse switch would be ~19 GiB, sliced
# ~5.6 as at 512), while the chunk's other layers still see every token at once (what the larger chunk is for).
DENSE_PREFILL_QUERIES = 512


def _invalidate_written(cache: AttentionCache, batch: StepBatch) -> None:
    """The step's K/V rows were just written to host memory: drop their copies from the VRAM row cache (if any),
    which also starts the cache's next epoch (`kernels/kv_row_cache.py`)."""
    if cache.row_cache is not None:
        from stage_worker.kernels.kv_row_cache import invalidate

        invalidate(cache.row_cache, batch.slot_mapping)


class GatedAttention(nn.Module):
    """Attention whose q_proj also produces a per-feature output gate; q/k are RMS-normalised per head."""

    kernels: KernelFlags = NONE
    # Training (tools/train_demo.py): `aux` collects ("indexer_kl", loss) per sequence when set to a list;
    # `qsa_dense` attends to every causal position (the indexer's warm-up phase) instead of the QSA selection.
    aux: list | None = None
    qsa_dense: bool = False
    # Tests: run the fused section kernel (`kernels.section_attention`) on CPU tensors under TRITON_INTERPRET=1.
    interpret_on_cpu: bool = False

    def __init__(self, cfg: HybridMoeConfig, use_qsa: bool, rotary: Rotary) -> None:
        super().__init__()
        self.rotary = rotary
        self.n_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.indexer = QSAIndexer(cfg) if use_qsa else None
        self.scale = self.head_dim ** -0.5

    def prepare_kernels(self) -> None:
        """Lay q/k/v (and the indexer's) projection weights out as row views of one tensor, without copying twice:
        one GEMV per decode step instead of three or four. q/k/v kept packed (PackedLinear, issue 17: a reports-mixed
        checkpoint's INT6) are fused the same way into one PackedWeight when they share a scheme, and the indexer's
        bf16 rows (never packed) are a second GEMV whose columns follow theirs. State-dict names and values do not
        change."""
        parts = self._projections()
        if any(m.bias is not None for m in parts) or self._fused_proj() is not None:
            return
        qkv, rest = parts[:3], parts[3:]
        if all(type(m) is nn.Linear for m in parts):
            fused = fuse_rows(parts)
        elif all(isinstance(m, PackedLinear) for m in qkv) and all(type(m) is nn.Linear for m in rest):
            fused = fuse_packed(qkv)
            if fused is None:                   # q/k/v in different schemes: each runs alone, unfused decode
                return
        else:
            return
        offs = [0]
        for m in parts:
            offs.append(offs[-1] + m.out_features)
        from stage_worker.kernels.attention_prep_ref import PrepLayout   # no Triton on the CPU path

        idx = self.indexer
        layout = PrepLayout(self.n_heads, self.kv_heads, self.head_dim, self.rotary.rotary_dim, offs[0], offs[1],
                            offs[2], idx.n_heads if idx else 0, idx.head_dim if idx else 0,
                            offs[3] if idx else 0, offs[3] + idx.n_heads * idx.head_dim if idx else 0)
        self._fused = (fused, layout)

    def _projections(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj] + ([self.indexer.index_qk_proj] if self.indexer else [])

    def _fused_proj(self):
        """(weight [N, hidden] or q/k/v's PackedWeight, PrepLayout) if `prepare_kernels` fused the projections and
        nothing rebound them."""
        fused = getattr(self, "_fused", None)
        if fused is not None:
            parts = self._projections()
            if isinstance(fused[0], PackedWeight):
                ok = still_fused_packed(fused[0], parts[:3]) and all(type(m) is nn.Linear for m in parts[3:])
            else:
                ok = all(type(m) is nn.Linear for m in parts) and still_fused(fused[0], parts)
            if not ok:
                self._fused = fused = None
        return fused

    def _project(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
        """[T, N] of all the fused projections, in `_projections` order (the PrepLayout's columns)."""
        if not isinstance(weight, PackedWeight):
            return F.linear(x, weight)
        flags = self.q_proj.kernels
        if self.indexer is None:
            return packed_matmul(x, weight, flags.quant_gemv_fma, flags.quant_gemv_wide)
        # the packed q/k/v and the indexer's bf16 projection write their columns of one tensor (no cat launch)
        idx_w = self.indexer.index_qk_proj.weight
        y = torch.empty(x.shape[0], weight.out_features + idx_w.shape[0], dtype=x.dtype, device=x.device)
        packed_matmul(x, weight, flags.quant_gemv_fma, flags.quant_gemv_wide, out=y[:, :weight.out_features])
        torch.mm(x, idx_w.t(), out=y[:, weight.out_features:])
        return y

    def forward(self, x: torch.Tensor, batch: StepBatch, cache: AttentionCache,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = rope
        if self.kernels.attention and x.is_cuda and batch.is_decode and self._fused_proj() is not None:
            return self._decode_fused(x, batch, cache, rope)
        q, gate = self.q_proj(x).view(T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(T, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(T, self.kv_heads, self.head_dim)
        write_rows(cache.k, batch.slot_mapping, k)
        write_rows(cache.v, batch.slot_mapping, v)
        _invalidate_written(cache, batch)
        iq = None
        if self.indexer is not None:
            iq, raw_k = self.indexer.project(x, cos, sin)
            write_rows(cache.index_keys, batch.slot_mapping, raw_k)

        if self.kernels.attention and x.is_cuda and batch.is_decode:
            out = self._decode_kernels(q, iq, batch, cache)
            out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
            return self.o_proj(out)
        if self._batched_fresh(batch):
            out = self._prefill_fresh(q, k, v, iq, raw_k if self.indexer is not None else None, batch, cache)
            out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
            return self.o_proj(out)
        out = torch.empty_like(q)
        cu = batch.cu_seqlens
        for i in range(batch.num_seqs):
            s, e = cu[i], cu[i + 1]
            ctx = batch.context_lens[i] + batch.seq_lens[i]
            rows = batch.context_rows(i, ctx)
            pos = batch.positions[s:e]
            pooled = None
            if self.indexer is not None:
                pooled = self._update_pooled(cache, rows, batch.context_lens[i], ctx, x.device, x.dtype)
                if cache.host_kv and not self.qsa_dense and self.aux is None:
                    # host rows: move the fewer of queries x keys (gather each query's) and the context (sections)
                    attend = self._attend_selected if (e - s) * self.indexer.keys < ctx else self._attend_host_sections
                    out[s:e] = attend(q[s:e], iq[s:e], pooled, pos, rows, cache)
                    continue
                if (not self.qsa_dense and self.aux is None and batch.sparse_prefill
                        and ctx > SPARSE_PREFILL_FACTOR * self.indexer.keys):
                    out[s:e] = self._attend_selected(q[s:e], iq[s:e], pooled, pos, rows, cache)
                    continue
            keys, values = self._per_head(read_rows(cache.k, rows), read_rows(cache.v, rows), q.dtype)
            if self.aux is not None and pooled is not None:      # training: the whole chunk's probabilities
                visible = self._visible(iq[s:e], pooled, pos, ctx)
                o, probs = self._attend_heads(q[s:e], keys, values, visible, with_probs=True)
                self.aux.append(("indexer_kl", self.indexer.distill_loss(iq[s:e], pooled, pos, probs)))
                out[s:e] = o
                continue
            for a in range(s, e, DENSE_PREFILL_QUERIES):         # each query's row alone: slices change nothing
                b = min(a + DENSE_PREFILL_QUERIES, e)
                visible = self._visible(None if iq is None else iq[a:b], pooled, batch.positions[a:b], ctx)
                out[a:b] = self._attend_heads(q[a:b], keys, values, visible)
        out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)

    def _visible(self, iq: torch.Tensor | None, pooled: torch.Tensor | None, pos: torch.Tensor,
                 ctx: int) -> torch.Tensor:
        """[queries, ctx] which context rows the queries at `pos` attend to: the causal mask, and with QSA the
        indexer's selection."""
        visible = torch.arange(ctx, device=pos.device)[None, :] <= pos[:, None]
        if pooled is not None and not self.qsa_dense:
            visible = visible & self.indexer.select(iq, pooled, pos, ctx)
        return visible

    def _batched_fresh(self, batch: StepBatch) -> bool:
        """Several new sequences (no context; any lengths) in one padded batch (`_prefill_fresh`), while their scores
        (B x heads x Lmax^2) stay within BATCHED_SCORES_LIMIT; training's distillation loss only at equal lengths
        (its mean would count padded queries)."""
        if not (batch.batched_prefill and batch.num_seqs > 1 and all(c == 0 for c in batch.context_lens)):
            return False
        L = max(batch.seq_lens)
        if self.aux is not None and any(n != L for n in batch.seq_lens):
            return False
        return batch.num_seqs * L * L * self.n_heads <= BATCHED_SCORES_LIMIT

    def _prefill_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor | None,
                       raw_k: torch.Tensor | None, batch: StepBatch, cache: AttentionCache) -> torch.Tensor:
        """Every sequence sees exactly its own new tokens, so the loop over sequences becomes a batch dimension,
        padded to the longest (`ragged.py`; same masks, same rounding through the cache dtypes as the per-sequence
        path). Padded keys need no mask: they sit after every real query of their sequence, and a QSA block holding
        any is incomplete for those queries, so never selected."""
        rg = batch.ragged()
        B, L = rg.num_seqs, rg.max_len
        dev = q.device
        q = rg.pad(q)
        k = rg.pad(k.to(cache.k.dtype))
        v = rg.pad(v.to(cache.v.dtype))
        pos = torch.arange(L, device=dev)
        visible = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        pooled = None
        if self.indexer is not None:
            r = self.indexer.ratio
            nb = L // r
            # (explicit last dimension: prompts shorter than the ratio have no complete block, nb = 0)
            raw = rg.pad(raw_k.to(cache.index_keys.dtype))[:, : nb * r].reshape(B * nb, r, raw_k.shape[-1])
            cos, sin = self.rotary.cos_sin(torch.arange(nb, device=dev) * r, q.dtype)
            pooled = self.indexer.pool(raw, cos.repeat(B, 1), sin.repeat(B, 1)).to(cache.pooled_keys.dtype)
            # each sequence's complete blocks go to the cache; a longer one's extra blocks hold padding
            own = [(i, n // r) for i, n in enumerate(batch.seq_lens) if n >= r]
            if own:
                rows = torch.cat([batch.context_rows(i, m * r)[::r] // r for i, m in own])
                picks = to_device(torch.cat([torch.arange(m) + i * nb for i, m in own]), torch.long, dev)
                cache.pooled_keys[rows] = pooled[picks]
            pooled = pooled.view(B, nb, pooled.shape[-1])
            if not self.qsa_dense:
                visible = visible & self.indexer.select(rg.pad(iq), pooled, pos, L)
        if self.aux is not None and pooled is not None:
            out, probs = self._attend(q, k, v, visible, with_probs=True)
            self.aux.append(("indexer_kl", self.indexer.distill_loss(rg.pad(iq), pooled, pos, probs)))
        else:
            out = self._attend(q, k, v, visible)
        return rg.unpad(out)

    def _update_pooled(self, cache: AttentionCache, rows: torch.Tensor, old_ctx: int, ctx: int,
                       device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Pool the compression blocks this step completed; return every complete block's pooled key."""
        r = self.indexer.ratio
        first, last = old_ctx // r, ctx // r
        pooled_rows = rows[::r][: last] // r
        if last > first:
            raw = read_rows(cache.index_keys, rows[first * r: last * r]).view(last - first, r, -1)
            starts = torch.arange(first, last, device=device) * r
            cos, sin = self.rotary.cos_sin(starts, dtype)
            cache.pooled_keys[pooled_rows[first:last]] = self.indexer.pool(raw, cos, sin).to(cache.pooled_keys.dtype)
        return cache.pooled_keys[pooled_rows]

    def _decode_fused(self, x: torch.Tensor, batch: StepBatch, cache: AttentionCache,
                      rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Decode with the kernels: one projection GEMV, one prologue launch (norms, RoPE, cache writes, gate),
        QSA selection, paged attention (the gate product in its store) and o_proj."""
        from stage_worker.kernels.attention_prep import attention_decode_prep

        weight, layout = self._fused_proj()
        cos, sin = rope
        idx = self.indexer
        q, gate, iq = attention_decode_prep(
            self._project(x, weight), layout, cos, sin, batch.slot_mapping, self.q_norm.weight, self.k_norm.weight,
            cache.k, cache.v, self.q_norm.eps, idx.q_layernorm.weight if idx else None,
            cache.index_keys if idx else None)
        _invalidate_written(cache, batch)
        out = self._decode_kernels(q, iq, batch, cache, gate=gate)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _pool_norm_weight(self) -> torch.Tensor:
        """The indexer key norm's weight as the pooling kernel (`kernels.attention_prep.qsa_pool_update`) takes it.

        With YaRN, transformers (and `QSAIndexer.pool`) rotate pooled keys by cos and sin times the attention factor
        c; the kernel rotates by `inv_freq` alone. Rotating a pair of features both scaled by c gives c times the
        rotation, so c goes into the norm's (1 + w) over the rotated features instead (float32; a few elementwise
        ops a step, graph-safe, YaRN models only). c does not cancel in the block scores: with partial RoPE the
        unrotated features keep their scale."""
        w = self.indexer.k_layernorm.weight
        c = self.rotary.attention_scaling
        if c == 1.0:
            return w
        rd = min(self.rotary.rotary_dim, w.shape[0])
        return torch.cat([(1.0 + w[:rd].float()) * c - 1.0, w[rd:].float()])

    def _decode_kernels(self, q: torch.Tensor, iq: torch.Tensor | None, batch: StepBatch, cache: AttentionCache,
                        gate: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence, no host synchronisation: paged split-K attention over the selected rows; times
        `gate` (the output gate, already through its sigmoid) in the attention kernel's store."""
        from stage_worker.kernels.decode_attention import paged_decode_attention

        tables, lens = batch.device_tables()
        bs = batch.block_size
        selected = None
        if self.indexer is not None:
            from stage_worker.kernels.attention_prep import qsa_pool_update
            from stage_worker.kernels.qsa import empty_histograms, qsa_select

            r = self.indexer.ratio
            # the tiled selection's histograms, zeroed by the pool kernel (no memset launch in the step)
            hist = empty_histograms(lens.shape[0], q.device) if self.kernels.qsa_tiles else None
            # Re-pool the compression block holding the new token. Until the block is complete the value is unused
            # (selection reads complete blocks only); once complete it is exact. Writing every step avoids a sync.
            qsa_pool_update(cache.index_keys, cache.pooled_keys, tables, lens, self._pool_norm_weight(),
                            self.rotary.inv_freq, self.indexer.k_layernorm.eps, bs, r, self.rotary.rotary_dim,
                            zero=hist)
            selected = qsa_select(iq, cache.pooled_keys, tables, lens, bs, r, self.indexer.block_topk * r,
                                  one_program=not self.kernels.qsa_tiles, hist=hist)
            if cache.row_cache is not None:
                from stage_worker.kernels.kv_row_cache import plan

                plan(cache.row_cache, selected, tables, lens, bs)
        return paged_decode_attention(q, cache.k, cache.v, tables, lens, self.scale, bs, selected,
                                      row_cache=cache.row_cache if selected is not None else None, gate=gate)

    def _attend_host_sections(self, q: torch.Tensor, iq: torch.Tensor, pooled: torch.Tensor, pos: torch.Tensor,
                              rows: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """QSA prefill over host K/V (`qsa_kv_offload`) when the chunk's queries would gather more rows than the
        context holds: the context staged section by section, every query of the chunk attending to each section
        (`section_attention.py`, 001 §5.3), so the rows cross PCIe once per chunk instead of once per query that
        selected them. The selection is made in query slices; the keys each query reads are the same."""
        from stage_worker.model.section_attention import attend_sections

        # the block scores of a query slice are [slice, blocks, indexer heads] fp32: slices shrink as the context
        # grows, so that too stays within a bound (2 GB for 256 queries at 262k tokens of the full shape otherwise)
        n = max(1, min(SPARSE_PREFILL_QUERIES, HOST_SELECT_SCORES // max(pooled.shape[0] * self.indexer.n_heads, 1)))
        if self.kernels.section_attention and (q.is_cuda or self.interpret_on_cpu):
            # the fused kernel (one launch a section) reads the selection as a bit per compression block
            from stage_worker.kernels.section_attention import attend_sections_fused
            from stage_worker.model.section_attention import block_bits

            r, ctx = self.indexer.ratio, rows.shape[0]
            bits = torch.cat([block_bits(*self.indexer.selected_positions(iq[a:a + n], pooled, pos[a:a + n]), r,
                                         -(-ctx // r)) for a in range(0, q.shape[0], n)])
            # `section_union`: stage only the union of the chunk's selected blocks, not the whole context
            return attend_sections_fused(q, bits, pos, rows, cache.k, cache.v, self.scale, r,
                                         union=self.kernels.section_union)
        sel = [self.indexer.selected_positions(iq[a:a + n], pooled, pos[a:a + n]) for a in range(0, q.shape[0], n)]
        key_pos, valid = torch.cat([k for k, _ in sel]), torch.cat([v for _, v in sel])
        return attend_sections(q, key_pos, valid, rows, cache.k, cache.v, self.scale)

    def _attend_selected(self, q: torch.Tensor, iq: torch.Tensor, pooled: torch.Tensor, pos: torch.Tensor,
                         rows: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """QSA prefill over only the selected keys: each query gathers its <= `indexer.keys` K/V rows and attends
        over those, where the dense path scores the whole context and masks. The same keys in the same order and
        the same dtypes and rounding points, so it agrees with the masked dense path to float rounding; a
        25k-token prompt's QSA layers no longer cost the square of the context (docs/performance.md).
        With the kernel flag `sdpa_prefill` on the CPU each query's gathered keys go through
        `F.scaled_dot_product_attention` instead (a batch of queries, one query row per K/V head's group of query
        heads): 2.3x faster than the two einsums and the softmax on one thread, and the probabilities are not
        rounded before the value sum (as `_attend_sdpa`). GPUs keep the einsums (untimed there)."""
        out = torch.empty_like(q)
        rep = self.n_heads // self.kv_heads
        sdpa = self.kernels.sdpa_prefill and not q.is_cuda
        for a in range(0, q.shape[0], SPARSE_PREFILL_QUERIES):
            b = min(a + SPARSE_PREFILL_QUERIES, q.shape[0])
            key_pos, valid = self.indexer.selected_positions(iq[a:b], pooled, pos[a:b])
            src = rows[key_pos.clamp(max=rows.shape[0] - 1)]                   # [q, K] cache rows
            k = read_rows(cache.k, src.flatten()).view(*src.shape, *cache.k.shape[1:]).to(q.dtype)  # [q, K, kv, d]
            v = read_rows(cache.v, src.flatten()).view(*src.shape, *cache.v.shape[1:]).to(q.dtype)
            qg = q[a:b].view(b - a, self.kv_heads, rep, self.head_dim)     # head h reads kv head h // rep
            if sdpa:                      # [q, kv, rep, d] against [q, kv, K, d]: each query its own batch entry
                o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                                   attn_mask=valid[:, None, None, :], scale=self.scale)
                out[a:b] = o.reshape(b - a, self.n_heads, self.head_dim)
                continue
            scores = torch.einsum("lgrd,lkgd->lgrk", qg, k) * self.scale
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[a:b] = torch.einsum("lgrk,lkgd->lgrd", probs, v).reshape(b - a, self.n_heads, self.head_dim)
        return out

    def _per_head(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [..., ctx, kv_heads, d] -> [..., H, ctx, d] in `dtype`, each K/V head repeated for its query heads
        (once a chunk: the dense path's query slices share them)."""
        rep = self.n_heads // self.kv_heads
        return (k.repeat_interleave(rep, dim=-2).transpose(-3, -2).to(dtype),
                v.repeat_interleave(rep, dim=-2).transpose(-3, -2).to(dtype))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                with_probs: bool = False):
        """q [..., q_len, H, d], k/v [..., ctx, kv_heads, d], visible [..., q_len, ctx] -> [..., q_len, H, d] (and
        the probabilities [..., H, q_len, ctx]); leading dims: a batch of sequences."""
        return self._attend_heads(q, *self._per_head(k, v, q.dtype), visible, with_probs)

    def _attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      with_probs: bool = False):
        """`_attend` over K/V already per head (`_per_head`). With the kernel flag `sdpa_prefill` (and no
        probabilities wanted): `_attend_sdpa`, on the CPU in every layer, on a GPU in layers without QSA. A QSA
        layer's dense prefill on a GPU (a selection mask, not a causal one) keeps the eager path: SDPA was slower
        there on the H200 (h200-26: a 2048-query chunk at 16k, 6.43 against 5.21 ms; a full-attention layer's 1.78
        against 2.86). On one CPU thread SDPA's fused kernel takes a 512-query chunk of the demo model's QSA layer
        (4 heads of 48) under a selection mask in 10.9 ms against 32.4 at a 1k context, 18.6 against 44.6 at 2k."""
        if not with_probs and self.kernels.sdpa_prefill and (self.indexer is None or not q.is_cuda):
            return self._attend_sdpa(q, k, v, visible)
        scores = torch.matmul(q.transpose(-3, -2), k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~visible.unsqueeze(-3), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v).transpose(-3, -2)
        return (out, probs) if with_probs else out

    def _attend_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`_attend_heads` through `F.scaled_dot_product_attention` with `visible` as its boolean mask (True:
        attend; every query sees at least itself). Inputs are made 4-D ([batch, H, len, d]): PyTorch's fused
        kernels (memory-efficient, flash, cuDNN) take only 4-D tensors and a 3-D call falls back to the math kernel,
        which builds the scores (in fp32) after all. The softmax stays inside the kernel in fp32 and the
        probabilities are not rounded to the activations' dtype before the value sum, so the output differs from
        the eager path's by that rounding only."""
        q = q.transpose(-3, -2)
        mask = visible.unsqueeze(-3)
        flat = q.dim() == 3
        if flat:                                 # one sequence: a batch of one
            q, k, v, mask = q[None], k[None], v[None], mask[None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return (out[0] if flat else out).transpose(-3, -2)
