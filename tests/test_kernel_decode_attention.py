"""Paged decode attention: the PyTorch reference equals `GatedAttention` on the same cache contents (dense and with
QSA), the Triton kernel equals the reference (fp32 and bf16, one or several splits, shuffled block tables), and
`selected` listing every position equals dense attention. Without CUDA the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import cuda_us  # noqa: E402
from shared.model_config import Qwen4ExpConfig  # noqa: E402
from stage_worker.kernels.decode_attention import paged_decode_attention  # noqa: E402
from stage_worker.kernels.decode_attention_ref import paged_decode_attention_ref  # noqa: E402
from stage_worker.kernels.qsa import qsa_select  # noqa: E402
from stage_worker.kernels.qsa_ref import qsa_select_ref  # noqa: E402
from stage_worker.model.attention import GatedAttention, QSAIndexer  # noqa: E402
from stage_worker.model.batch import StepBatch  # noqa: E402
from stage_worker.model.cache import AttentionCache, CacheSpec  # noqa: E402
from stage_worker.model.rope import Rotary  # noqa: E402

if not torch.cuda.is_available():
    import stage_worker.kernels.decode_attention as _kernels

    assert _kernels._INTERPRET, "the kernels were imported before TRITON_INTERPRET=1 was set: they cannot run here"

H, KV, D = 4, 2, 16
N_IDX, D_IDX, RATIO, BUDGET = 2, 16, 4, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"



def tiny_config() -> Qwen4ExpConfig:
    cfg = Qwen4ExpConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=KV,
        head_dim=D, partial_rotary_factor=0.5, layer_types=["indexed_attention"], eos_token_id=[0],
        indexer_n_heads=N_IDX, indexer_kv_heads=1, indexer_head_dim=D_IDX, indexer_budget=BUDGET,
        indexer_compress_ratio=RATIO, dtype="float32")
    cfg.validate()
    return cfg


def paged_tables(ctxs: list[int], block_size: int, num_blocks: int, g: torch.Generator) -> list[list[int]]:
    """Each sequence gets its pages from one shuffled pool, so neighbouring positions live in far-apart blocks."""
    pool = torch.randperm(num_blocks, generator=g).tolist()
    out = []
    for c in ctxs:
        n = -(-c // block_size)
        out.append(pool[:n])
        pool = pool[n:]
    return out


def table_tensor(tables: list[list[int]], width: int) -> torch.Tensor:
    """[B, width] int32, padded with -1: a kernel that reads a padding entry would gather a wrong row."""
    out = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def random_cache(ctxs: list[int], block_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in ctxs) + 3
    tables = table_tensor(paged_tables(ctxs, block_size, num_blocks, g), -(-max(ctxs) // block_size) + 1)
    k = torch.randn(num_blocks * block_size, KV, D, generator=g).to(dtype)
    v = torch.randn(num_blocks * block_size, KV, D, generator=g).to(dtype)
    q = torch.randn(len(ctxs), H, D, generator=g).to(dtype)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    return q, k, v, tables, ctx, g


def random_selection(ctxs: list[int], width: int, g: torch.Generator) -> torch.Tensor:
    """Distinct positions before each context end, in random order, with (at least two) -1 scattered among them."""
    out = torch.full((len(ctxs), width), -1, dtype=torch.int32)
    for i, c in enumerate(ctxs):
        n = min(c, width - 2)
        pos = torch.randperm(c, generator=g)[:n].to(torch.int32)
        out[i, torch.randperm(width, generator=g)[:n]] = pos
    return out


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        assert (got - want).abs().max().item() < 1e-5
    else:
        err = (got - want).norm() / want.norm().clamp_min(1e-6)
        assert err.item() < 2e-2, err.item()


def to_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


# ---- the reference is GatedAttention's math on the same cache ---------------------------------------------------

@pytest.mark.parametrize("block_size,ctxs", [(8, [1, 19, 40]), (16, [4, 16, 37])])
@pytest.mark.parametrize("use_qsa", [False, True])
def test_reference_and_kernel_match_gated_attention(monkeypatch, block_size, ctxs, use_qsa):
    """Prefill then one decode step through `GatedAttention` (its per-sequence Python loop); the decode query's
    `_attend` output must equal the reference and the kernel fed from the same cache, with QSA through both
    selection paths (whose positions must equal `QSAIndexer.select`'s mask)."""
    torch.manual_seed(block_size)
    cfg = tiny_config()
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    attn = GatedAttention(cfg, use_qsa, rotary).eval()
    g = torch.Generator().manual_seed(7)
    num_blocks = sum(-(-c // block_size) for c in ctxs) + 2
    tables = paged_tables(ctxs, block_size, num_blocks, g)
    cache = AttentionCache(cfg, CacheSpec(num_blocks=num_blocks, block_size=block_size, num_slots=len(ctxs)))
    x = torch.randn(sum(ctxs), cfg.hidden_size, generator=g)

    seen: dict[str, list] = {"attend": [], "select": []}
    attend, select = GatedAttention._attend_heads, QSAIndexer.select

    def spy_attend(self, q, k, v, visible, *args, **kw):  # (the prefill's batched path asks for probabilities too)
        out = attend(self, q, k, v, visible, *args, **kw)
        seen["attend"].append((q, out))
        return out

    def spy_select(self, q, pooled, positions, ctx):
        mask = select(self, q, pooled, positions, ctx)
        seen["select"].append((q, mask))
        return mask

    monkeypatch.setattr(GatedAttention, "_attend_heads", spy_attend)
    monkeypatch.setattr(QSAIndexer, "select", spy_select)
    starts = [sum(ctxs[:i]) for i in range(len(ctxs))]
    with torch.no_grad():
        prefill = [(list(range(c - 1)), 0, i, tables[i]) for i, c in enumerate(ctxs) if c > 1]
        rows = torch.cat([x[starts[i]: starts[i] + c - 1] for i, c in enumerate(ctxs) if c > 1])
        batch = StepBatch.build(prefill, block_size)
        attn(rows, batch, cache, rotary.cos_sin(batch.positions, x.dtype))
        seen["attend"].clear()
        seen["select"].clear()
        batch = StepBatch.build([([5], c - 1, i, tables[i]) for i, c in enumerate(ctxs)], block_size)
        batch.sparse_prefill = False            # the dense masked `_attend` is what the spies compare against
        last = torch.stack([x[starts[i] + c - 1] for i, c in enumerate(ctxs)])
        attn(last, batch, cache, rotary.cos_sin(batch.positions, x.dtype))

    q = torch.cat([s[0] for s in seen["attend"]])                      # [B, H, D]
    want = torch.cat([s[1] for s in seen["attend"]])
    table = table_tensor(tables, max(len(t) for t in tables) + 1)
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    selected = None
    if use_qsa:
        q_idx = torch.cat([s[0] for s in seen["select"]])             # [B, n_idx, d_idx]
        masks = [s[1][0] for s in seen["select"]]                     # the decode query's visibility, [ctx]
        selected = qsa_select_ref(q_idx, cache.pooled_keys, table, ctx, block_size, RATIO, BUDGET)
        fast = qsa_select(*to_device(q_idx, cache.pooled_keys, table, ctx), block_size, RATIO, BUDGET).cpu()
        for i, c in enumerate(ctxs):
            for sel in (selected, fast):
                got = torch.zeros(c, dtype=torch.bool)
                got[sel[i][sel[i] >= 0].long()] = True
                assert torch.equal(got, masks[i]), (i, sel[i].tolist())
    ref = paged_decode_attention_ref(q, cache.k, cache.v, table, ctx, attn.scale, block_size, selected)
    assert (ref - want).abs().max().item() < 1e-5
    dev = to_device(q, cache.k, cache.v, table, ctx)
    out = paged_decode_attention(*dev, attn.scale, block_size, None if selected is None else selected.to(DEVICE),
                                 block_n=16)
    assert (out.cpu() - want).abs().max().item() < 1e-5


# ---- the kernel equals the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,block_size,splits", [("dense", 8, None), ("dense", 16, 3), ("selected", 8, 2),
                                                    ("selected", 16, None)])
def test_kernel_matches_reference(dtype, mode, block_size, splits):
    ctxs = [7, 40, 1]
    q, k, v, tables, ctx, g = random_cache(ctxs, block_size, dtype, seed=block_size + (splits or 0))
    selected = random_selection(ctxs, 19, g) if mode == "selected" else None
    scale = D ** -0.5
    want = paged_decode_attention_ref(q, k, v, tables, ctx, scale, block_size, selected)
    dev = to_device(q, k, v, tables, ctx)
    got = paged_decode_attention(*dev, scale, block_size, None if selected is None else selected.to(DEVICE),
                                 num_splits=splits, block_n=16)
    assert got.dtype == dtype and got.shape == q.shape
    close(got.cpu(), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_gate_product_in_the_store_is_the_product_after_it(dtype, splits):
    """`gate=` (gated attention's output gate, fused into the attention store so the step has no product launch):
    the same bits as the kernel's output times the gate afterwards, with one split (the split kernel stores) and
    several (the reduce kernel stores)."""
    ctxs = [7, 40, 1]
    q, k, v, tables, ctx, g = random_cache(ctxs, 8, dtype, seed=5 + splits)
    gate = torch.sigmoid(torch.randn(len(ctxs), H * D, generator=g)).to(DEVICE, dtype)
    dev = to_device(q, k, v, tables, ctx)
    plain = paged_decode_attention(*dev, D ** -0.5, 8, num_splits=splits, block_n=16)
    gated = paged_decode_attention(*dev, D ** -0.5, 8, num_splits=splits, block_n=16, gate=gate)
    assert torch.equal(gated, (plain.reshape(len(ctxs), -1) * gate).view_as(plain))


@pytest.mark.parametrize("splits", [1, 4])
def test_selecting_every_position_is_dense(splits):
    ctxs = [33, 2, 17]
    q, k, v, tables, ctx, g = random_cache(ctxs, 8, torch.float32, seed=3)
    selected = torch.empty(len(ctxs), 40, dtype=torch.int32)
    for i, c in enumerate(ctxs):                                      # every position, shuffled, -1 in between
        slots = torch.randperm(40, generator=g)[:c]
        selected[i] = -1
        selected[i, slots] = torch.randperm(c, generator=g).to(torch.int32)
    scale = D ** -0.5
    dense = paged_decode_attention_ref(q, k, v, tables, ctx, scale, 8)
    assert (paged_decode_attention_ref(q, k, v, tables, ctx, scale, 8, selected) - dense).abs().max() < 1e-5
    dev = to_device(q, k, v, tables, ctx)
    for sel in (None, selected.to(DEVICE)):
        got = paged_decode_attention(*dev, scale, 8, sel, num_splits=splits, block_n=16).cpu()
        assert (got - dense).abs().max().item() < 1e-5


def test_a_query_that_sees_no_key_reads_zeros():
    q, k, v, tables, ctx, g = random_cache([5, 9], 8, torch.float32, seed=11)
    selected = torch.tensor([[-1, -1, -1], [0, -1, 8]], dtype=torch.int32)
    want = paged_decode_attention_ref(q, k, v, tables, ctx, 0.25, 8, selected)
    assert torch.equal(want[0], torch.zeros_like(want[0]))
    for splits in (1, 2):
        got = paged_decode_attention(*to_device(q, k, v, tables, ctx), 0.25, 8, selected.to(DEVICE),
                                     num_splits=splits, block_n=16).cpu()
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert (got - want).abs().max().item() < 1e-5


# ---- real shapes, on a GPU only --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_real_shapes_on_gpu(batch):
    """Qwen4-Exp full shape: 24 query / 2 K/V heads of 256, context up to 8192, QSA budget 2048 (001 §1)."""
    torch.manual_seed(batch)
    hq, kv, d, bs, ctx_max = 24, 2, 256, 16, 8192
    n_idx, d_idx, ratio, budget = 32, 128, 4, 2048
    dev, dt = "cuda", torch.bfloat16
    pages = ctx_max // bs
    num_blocks = batch * pages + 7
    tables = torch.stack([torch.randperm(num_blocks, device=dev)[:pages] for _ in range(batch)]).to(torch.int32)
    ctx = torch.randint(1, ctx_max + 1, (batch,), device=dev, dtype=torch.int32)
    ctx[0] = ctx_max
    k = torch.randn(num_blocks * bs, kv, d, device=dev, dtype=dt)
    v = torch.randn(num_blocks * bs, kv, d, device=dev, dtype=dt)
    q = torch.randn(batch, hq, d, device=dev, dtype=dt)
    pooled = torch.randn(num_blocks * bs // ratio, d_idx, device=dev, dtype=dt)
    q_idx = torch.randn(batch, n_idx, d_idx, device=dev, dtype=dt)
    scale = d ** -0.5

    selected = qsa_select(q_idx, pooled, tables, ctx, bs, ratio, budget)
    assert selected.shape == (batch, budget + ratio - 1)
    for sel in (None, selected):
        want = paged_decode_attention_ref(q, k, v, tables, ctx, scale, bs, sel)
        got = paged_decode_attention(q, k, v, tables, ctx, scale, bs, sel)
        close(got, want, dt)

    dense_us = cuda_us(lambda: paged_decode_attention(q, k, v, tables, ctx, scale, bs))
    sel_us = cuda_us(lambda: paged_decode_attention(q, k, v, tables, ctx, scale, bs, selected))
    qsa_us = cuda_us(lambda: qsa_select(q_idx, pooled, tables, ctx, bs, ratio, budget))
    print(f"\nB={batch}: dense {dense_us:.1f} us, selected {sel_us:.1f} us, qsa_select {qsa_us:.1f} us")
