"""The QSA indexer of Qwen4-Exp: block selection against a brute-force reference (ties included), a planted far-away
block that must be found through the paged cache path, and QSA with a budget covering the context == dense attention.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shared.model_config import load_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine
from stage_worker.model.attention import SPARSE_PREFILL_FACTOR, GatedAttention, QSAIndexer, stable_topk_mask
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import AttentionCache, CacheSpec
from stage_worker.model.rope import Rotary, apply_rotary



@pytest.fixture(scope="module")
def qwen4_cfg(reference_checkpoints):
    return load_config(reference_checkpoints["qwen4_exp"][0])


def _indexer(cfg, budget: int) -> QSAIndexer:
    return QSAIndexer(dataclasses.replace(cfg, indexer_budget=budget))


def reference_select(q: torch.Tensor, pooled: torch.Tensor, positions: list[int], ctx: int, ratio: int,
                     topk: int) -> torch.Tensor:
    """Per query p: the `topk` best complete blocks before it by (score desc, block index asc), plus the tail."""
    d = q.shape[-1]
    mask = torch.zeros(len(positions), ctx, dtype=torch.bool)
    qd, kd = q.double(), pooled.double()
    for i, p in enumerate(positions):
        complete = (p + 1) // ratio
        scores = [sum(max(0.0, float(qd[i, h] @ kd[b])) for h in range(q.shape[1])) / math.sqrt(d)
                  for b in range(complete)]
        for b in sorted(range(complete), key=lambda b: (-scores[b], b))[:topk]:
            mask[i, b * ratio:(b + 1) * ratio] = True
        mask[i, complete * ratio:p + 1] = True
    return mask


def _check(indexer: QSAIndexer, q, pooled, positions: list[int], ctx: int) -> None:
    got = indexer.select(q, pooled, torch.tensor(positions), ctx)
    want = reference_select(q, pooled, positions, ctx, indexer.ratio, indexer.block_topk)
    assert got.shape == want.shape
    bad = [positions[i] for i in range(len(positions)) if not torch.equal(got[i], want[i])]
    assert not bad, f"query positions {bad} select other keys than the reference"


# ---- (a) select() against the brute-force reference -----------------------------------------------------------------

@pytest.mark.parametrize("budget", [4, 8, 12, 64])
@pytest.mark.parametrize("where", ["prefill", "chunk", "decode"])
def test_select_matches_brute_force(qwen4_cfg, budget, where):
    idx = _indexer(qwen4_cfg, budget)
    H, d, r = idx.n_heads, idx.head_dim, idx.ratio
    g = torch.Generator().manual_seed(budget * 7 + len(where))
    ctx = 61
    positions = {"prefill": list(range(ctx)), "chunk": list(range(37, ctx)), "decode": [ctx - 1]}[where]
    q = torch.randn(len(positions), H, d, generator=g)
    pooled = torch.randn(ctx // r, d, generator=g)
    _check(idx, q, pooled, positions, ctx)


def test_select_exact_ties_go_to_the_lower_block(qwen4_cfg):
    idx = _indexer(qwen4_cfg, 8)                          # two blocks per query
    H, d, r = idx.n_heads, idx.head_dim, idx.ratio
    ctx = 48
    g = torch.Generator().manual_seed(5)
    # Small integers: every dot product and sum is exact in float32, so equal rows give bit-equal scores.
    q = torch.randint(-1, 2, (ctx, H, d), generator=g).float()
    pooled = torch.randint(-1, 2, (ctx // r, d), generator=g).float()
    pooled[7] = pooled[3]
    pooled[9] = pooled[3]
    pooled[10] = pooled[2]
    _check(idx, q, pooled, list(range(ctx)), ctx)

    # All blocks equal: every query keeps the first two complete blocks.
    same = pooled[:1].expand(ctx // r, d).contiguous()
    q_pos = torch.ones(ctx, H, d)
    got = idx.select(q_pos, same, torch.arange(ctx), ctx)
    for p in range(2 * r, ctx):
        complete = (p + 1) // r
        want = torch.zeros(ctx, dtype=torch.bool)
        want[: 2 * r] = True
        want[complete * r: p + 1] = True
        assert torch.equal(got[p], want), p

    # A three-way tie at the top for two places: blocks 3 and 7 win over 9.
    q1 = torch.zeros(1, H, d)
    q1[0, :, 0] = 1.0
    pk = torch.zeros(ctx // r, d)
    pk[:, 0] = -1.0
    pk[[3, 7, 9], 0] = 2.0
    got = idx.select(q1, pk, torch.tensor([ctx - 1]), ctx)[0]
    chosen = sorted({int(i) // r for i in torch.nonzero(got).flatten() if int(i) < (ctx // r) * r})
    assert chosen == [3, 7]

    # Every score zero (ReLU of negatives): the lowest-indexed blocks are kept.
    got = idx.select(q1, -pk.abs() - 1, torch.tensor([ctx - 1]), ctx)[0]
    chosen = sorted({int(i) // r for i in torch.nonzero(got).flatten() if int(i) < (ctx // r) * r})
    assert chosen == [0, 1]


def test_stable_topk_mask_tie_rule():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    valid = torch.tensor([[True, True, True, True, True, True]])
    assert stable_topk_mask(scores, 2, valid).tolist() == [[False, True, True, False, False, False]]
    valid[0, 2] = False
    assert stable_topk_mask(scores, 2, valid).tolist() == [[False, True, False, False, True, False]]
    # k beyond the valid entries: only valid ones are kept.
    valid = torch.tensor([[True, False, False, False, False, True]])
    assert stable_topk_mask(scores, 4, valid).tolist() == [[True, False, False, False, False, True]]


# ---- (b) a planted far-away block through the paged cache --------------------------------------------------------

def _positions_mask(key_pos: torch.Tensor, valid: torch.Tensor, ctx: int) -> torch.Tensor:
    """`selected_positions`' lists as a [q, ctx] visibility mask (what `select` returns)."""
    mask = torch.zeros(key_pos.shape[0], ctx, dtype=torch.bool)
    for i in range(key_pos.shape[0]):
        mask[i, key_pos[i][valid[i]]] = True
    return mask


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse_prefill", "dense_prefill"])
def test_planted_far_block_is_selected(qwen4_cfg, monkeypatch, sparse):
    """200 tokens, budget 8 / ratio 4. The indexer query of every token is a fixed un-rotated direction; only block 1
    (tokens 4..7) has a pooled key strongly along it, blocks 40..44 weakly. The last query must read block 1 (and the
    strongest near block), and the attention output must be attention over exactly those rows plus the tail, both
    when prefill gathers the selected keys and when it masks dense scores."""
    cfg = qwen4_cfg
    torch.manual_seed(0)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    attn = GatedAttention(cfg, True, rotary).eval()
    idx = attn.indexer
    H, d, r = idx.n_heads, idx.head_dim, idx.ratio
    D = cfg.hidden_size
    assert cfg.rotary_dim < d, "the planted direction must be one RoPE leaves alone"
    n = 200
    # Hidden features: 0 = constant 1, 1 = "planted" signal, 2..17 = noise feeding the other key dims.
    x = torch.zeros(n + 1, D)
    x[:, 0] = 1.0
    x[:, 1] = -1.0
    x[4:8, 1] = 1.0                                   # block 1: strong, clean
    g = torch.Generator().manual_seed(1)
    x[:, 2:2 + d - 1] = torch.randn(n + 1, d - 1, generator=g) * 0.05
    for b, s in zip(range(40, 45), (0.2, 0.3, 0.5, 0.4, 0.1)):
        # Weak: the same noisy key on each token, of fixed norm, so the normalised signal is ~s (0.5 wins here).
        u = torch.randn(d - 1, generator=g)
        x[b * r:(b + 1) * r, 1] = s
        x[b * r:(b + 1) * r, 2:2 + d - 1] = u / u.norm() * math.sqrt(d - 1)
    with torch.no_grad():
        w = torch.zeros_like(idx.index_qk_proj.weight)   # [(H + 1) * d, D]
        for h in range(H):
            w[h * d + d - 1, 0] = 1.0                    # q_h = e_{d-1} (after the norm: 4 * e_{d-1})
        k0 = H * d
        w[k0 + d - 1, 1] = 1.0                           # raw key's last dim = the planted signal
        for j in range(d - 1):
            w[k0 + j, 2 + j] = 1.0
        idx.index_qk_proj.weight.copy_(w)

    bs = 16
    spec = CacheSpec(num_blocks=20, block_size=bs, num_slots=1)
    cache = AttentionCache(cfg, spec)
    table = list(range(19, 19 - 13, -1))                 # paged, in reverse order
    captured = {}
    original, original_positions = QSAIndexer.select, QSAIndexer.selected_positions

    def select(self, q, pooled, positions, ctx):
        mask = original(self, q, pooled, positions, ctx)
        captured["mask"], captured["positions"] = mask, positions
        return mask

    def selected_positions(self, q, pooled, positions):
        key_pos, valid = original_positions(self, q, pooled, positions)
        captured["mask"] = _positions_mask(key_pos, valid, int(positions.max()) + 1)
        captured["positions"] = positions
        return key_pos, valid

    monkeypatch.setattr(QSAIndexer, "select", select)
    monkeypatch.setattr(QSAIndexer, "selected_positions", selected_positions)
    with torch.no_grad():
        for tokens, start in ((list(range(n)), 0), ([7], n)):      # prefill 200, then decode position 200
            batch = StepBatch.build([(tokens, start, 0, table)], bs)
            batch.sparse_prefill = sparse
            out = attn(x[start:start + len(tokens)], batch, cache, rotary.cos_sin(batch.positions, x.dtype))

    mask = captured["mask"][-1]
    assert captured["positions"].tolist() == [n]
    complete = (n + 1) // r
    blocks = sorted({int(i) // r for i in torch.nonzero(mask[: complete * r]).flatten()})
    assert blocks == [1, 42], blocks
    expected = torch.zeros(n + 1, dtype=torch.bool)
    expected[4:8] = True
    expected[42 * r:43 * r] = True
    expected[complete * r:] = True
    assert torch.equal(mask, expected)

    # The attention output reads exactly those K/V rows.
    with torch.no_grad():
        xl = x[n:n + 1]
        cos, sin = rotary.cos_sin(torch.tensor([n]), x.dtype)
        q, gate = attn.q_proj(xl).view(1, attn.n_heads, 2 * attn.head_dim).chunk(2, dim=-1)
        q = apply_rotary(attn.q_norm(q), cos, sin)
        rows = batch.context_rows(0, n + 1)
        k, v = cache.k[rows][expected], cache.v[rows][expected]
        rep = attn.n_heads // attn.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * attn.scale, dim=-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(1, -1) * torch.sigmoid(gate.reshape(1, -1))
        want = attn.o_proj(o)
    assert (out - want).abs().max().item() < 1e-5


# ---- (b2) sparse prefill: the selected keys as lists, and attention over them ------------------------------------

@pytest.mark.parametrize("ties", [False, True])
def test_selected_positions_are_the_select_mask(qwen4_cfg, ties):
    """`selected_positions` lists exactly the keys `select` marks, ascending, for queries of a chunk and a decode,
    with ties (integer-valued scores) broken to the lower block as the rule says."""
    idx = _indexer(qwen4_cfg, 12)
    g = torch.Generator().manual_seed(3)
    ctx, r = 97, idx.ratio
    q = torch.randn(ctx, idx.n_heads, idx.head_dim, generator=g)
    pooled = torch.randn(ctx // r, idx.head_dim, generator=g)
    if ties:
        q, pooled = q.sign(), pooled.sign()
    positions = torch.arange(ctx)
    key_pos, valid = idx.selected_positions(q, pooled, positions)
    assert key_pos.shape[1] == idx.keys
    for row, ok in zip(key_pos, valid):
        kept = row[ok]
        assert bool((kept[1:] > kept[:-1]).all())
    assert torch.equal(_positions_mask(key_pos, valid, ctx), idx.select(q, pooled, positions, ctx))


def test_stable_topk_mask_matches_a_stable_sort():
    """The sort-free top-k equals ranking by (score desc, index asc) on random rows full of ties."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (64, 40), generator=g).float()
    valid = torch.rand(64, 40, generator=g) < 0.8
    for k in (1, 3, 7, 39, 40, 50):
        order = torch.sort(scores.masked_fill(~valid, float("-inf")), dim=-1, descending=True, stable=True).indices
        want = torch.zeros_like(valid).scatter_(-1, order[:, :k], True) & valid
        assert torch.equal(stable_topk_mask(scores, k, valid), want), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sparse_prefill_equals_dense_masked_prefill(qwen4_cfg, device):
    """A 300-token prompt in chunks of 64 over a paged cache, budget 8: gathering each query's selected keys gives
    the dense masked path's output (float32) and leaves the same caches."""
    cfg = qwen4_cfg
    torch.manual_seed(0)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    cfg8 = dataclasses.replace(cfg, indexer_budget=8)
    attn = GatedAttention(cfg8, True, rotary).eval().to(device)
    x = torch.randn(300, cfg.hidden_size).to(device)
    table = list(range(24, 4, -1))
    outs, caches = {}, {}
    for sparse in (True, False):
        cache = AttentionCache(cfg8, CacheSpec(num_blocks=25, block_size=16, num_slots=1, device=device))
        chunks = []
        with torch.no_grad():
            for start in range(0, 300, 64):
                tokens = list(range(start, min(start + 64, 300)))
                batch = StepBatch.build([(tokens, start, 0, table)], 16, device)
                batch.sparse_prefill = sparse
                chunks.append(attn(x[start:start + len(tokens)], batch, cache,
                                   rotary.cos_sin(batch.positions, x.dtype)))
        outs[sparse], caches[sparse] = torch.cat(chunks), cache
    assert 300 > SPARSE_PREFILL_FACTOR * attn.indexer.keys            # the late chunks do take the sparse path
    assert (outs[True] - outs[False]).abs().max().item() < (1e-5 if device == "cpu" else 1e-4)
    assert torch.equal(caches[True].pooled_keys, caches[False].pooled_keys)


def test_sdpa_prefill_on_the_cpu_attends_as_the_eager_paths(qwen4_cfg, monkeypatch):
    """Kernel flag `sdpa_prefill` on the CPU: both QSA prefill paths (the dense masked scores and each query's
    gathered keys) go through F.scaled_dot_product_attention and give the eager paths' output within float32
    rounding (a 300-token prompt in chunks of 64, budget 8, so the late chunks gather)."""
    import torch.nn.functional as F

    from stage_worker.kernels.flags import KernelFlags

    cfg8 = dataclasses.replace(qwen4_cfg, indexer_budget=8)
    torch.manual_seed(0)
    rotary = Rotary(cfg8.rotary_dim, cfg8.rope_theta)
    attn = GatedAttention(cfg8, True, rotary).eval()
    x = torch.randn(300, cfg8.hidden_size)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))

    def prefill(flags: str, sparse: bool) -> torch.Tensor:
        attn.kernels = KernelFlags.parse(flags)
        cache = AttentionCache(cfg8, CacheSpec(num_blocks=25, block_size=16, num_slots=1, device="cpu"))
        chunks = []
        with torch.no_grad():
            for start in range(0, 300, 64):
                tokens = list(range(start, min(start + 64, 300)))
                batch = StepBatch.build([(tokens, start, 0, list(range(24, 4, -1)))], 16, "cpu")
                batch.sparse_prefill = sparse
                chunks.append(attn(x[start:start + len(tokens)], batch, cache,
                                   rotary.cos_sin(batch.positions, x.dtype)))
        return torch.cat(chunks)

    want = prefill("none", False)
    assert not calls
    for sparse in (False, True):
        got = prefill("sdpa_prefill", sparse)
        assert calls, "the SDPA path was not taken"
        calls.clear()
        assert (got - want).abs().max().item() < 1e-5, sparse
    assert 300 > SPARSE_PREFILL_FACTOR * attn.indexer.keys            # the late chunks do take the gathered path


# ---- (c) a budget covering the context is dense attention -------------------------------------------------------

def _logits(model, prompt, decode):
    engine = LocalEngine([model], block_size=8)
    engine.add(0)
    out = [engine.step([(0, prompt)], all_logits=True)]
    out += [engine.step([(0, [t])]) for t in decode]
    return torch.cat(out)


@pytest.mark.parametrize("budget", [40, 64])
def test_budget_covering_context_is_dense(reference_checkpoints, qwen4_cfg, budget):
    path, _ = reference_checkpoints["qwen4_exp"]
    cfg = dataclasses.replace(qwen4_cfg, indexer_budget=budget)
    qsa = load_model(path, LoadOptions(dtype=torch.float32), cfg=cfg)
    dense = load_model(path, LoadOptions(dtype=torch.float32), cfg=cfg)   # same weights; indexers removed below
    removed = 0
    for layer in dense.layers.values():
        if getattr(layer, "self_attn", None) is not None and layer.self_attn.indexer is not None:
            layer.self_attn.indexer = None
            removed += 1
    assert removed == 2
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(6, 320, (37,), generator=g).tolist()
    decode = [11, 12, 13]                                # context ends at 40 tokens <= budget
    got, want = _logits(qsa, prompt, decode), _logits(dense, prompt, decode)
    assert (got - want).abs().max().item() < 1e-5

    # ...and the comparison can fail: with the oracle's budget of 8 the same prompt reads fewer rows.
    small = load_model(path, LoadOptions(dtype=torch.float32), cfg=qwen4_cfg)
    assert (_logits(small, prompt, decode) - want).abs().max().item() > 1e-3
