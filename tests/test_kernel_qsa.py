"""QSA decode selection: the PyTorch reference and the Triton path choose exactly the keys `QSAIndexer.select` makes
visible to the last query, on the same paged cache (shuffled block tables), ties included (lower block wins), and
agree with each other in layout. Without CUDA the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined: they run on the CPU

pytest.importorskip("triton")

from stage_worker.kernels.qsa import qsa_select  # noqa: E402
from stage_worker.kernels.qsa_ref import qsa_select_ref  # noqa: E402
from stage_worker.model.attention import QSAIndexer  # noqa: E402
from stage_worker.model.cache import AttentionCache, CacheSpec  # noqa: E402
from test_kernel_decode_attention import (DEVICE, D_IDX, N_IDX, RATIO, paged_tables, table_tensor,  # noqa: E402
                                          tiny_config)



def indexer(budget: int) -> QSAIndexer:
    import dataclasses

    return QSAIndexer(dataclasses.replace(tiny_config(), indexer_budget=budget))


def select_masks(idx: QSAIndexer, q_idx: torch.Tensor, cache: AttentionCache, tables: list[list[int]],
                 ctxs: list[int], block_size: int) -> list[torch.Tensor]:
    """`QSAIndexer.select` for each sequence's last query, fed the pooled keys the way `GatedAttention` gathers
    them (`_update_pooled`: the pooled row of block c is the K/V row of token c * ratio, divided by ratio)."""
    out = []
    for i, c in enumerate(ctxs):
        pos = torch.arange(c)
        table = torch.tensor(tables[i])
        rows = table[pos // block_size] * block_size + pos % block_size
        pooled = cache.pooled_keys[rows[::RATIO][: c // RATIO] // RATIO]
        out.append(idx.select(q_idx[i: i + 1], pooled, torch.tensor([c - 1]), c)[0])
    return out


def block_row(table: list[int], c: int, block_size: int) -> int:
    """Row of `pooled_keys` holding compression block c of a sequence with this block table."""
    p = c * RATIO
    return table[p // block_size] * (block_size // RATIO) + (p % block_size) // RATIO


def as_masks(selected: torch.Tensor, ctxs: list[int]) -> list[torch.Tensor]:
    out = []
    for i, c in enumerate(ctxs):
        row = selected[i]
        m = torch.zeros(c, dtype=torch.bool)
        m[row[row >= 0].long()] = True
        assert int((row >= 0).sum()) == int(m.sum()), "a position is listed twice"
        out.append(m)
    return out


def paged_pooled(ctxs: list[int], block_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in ctxs) + 2
    tables = paged_tables(ctxs, block_size, num_blocks, g)
    cache = AttentionCache(tiny_config(), CacheSpec(num_blocks=num_blocks, block_size=block_size, num_slots=1))
    cache.pooled_keys.copy_(torch.randn(cache.pooled_keys.shape, generator=g))
    cache.pooled_keys = cache.pooled_keys.to(dtype)
    q_idx = torch.randn(len(ctxs), N_IDX, D_IDX, generator=g).to(dtype)
    return q_idx, cache, tables, table_tensor(tables, max(len(t) for t in tables) + 1), \
        torch.tensor(ctxs, dtype=torch.int32)


def both(q_idx, pooled, table, ctx, block_size, budget, block_c=None) -> tuple[torch.Tensor, torch.Tensor]:
    ref = qsa_select_ref(q_idx, pooled, table, ctx, block_size, RATIO, budget)
    dev = [t.to(DEVICE) for t in (q_idx, pooled, table, ctx)]
    return ref, qsa_select(*dev, block_size, RATIO, budget, block_c=block_c).cpu()


@pytest.mark.parametrize("block_size,ctxs", [(8, [40, 1, 23, 4]), (16, [3, 37, 16])])
@pytest.mark.parametrize("budget,block_c", [(8, 4), (8, None), (64, None)])
def test_selection_equals_indexer_select(block_size, ctxs, budget, block_c):
    """budget 8: two of up to ten complete blocks; 64: every block; block_c 4 spreads a sequence over tiles."""
    q_idx, cache, tables, table, ctx = paged_pooled(ctxs, block_size, torch.float32, seed=block_size + budget)
    want = select_masks(indexer(budget), q_idx, cache, tables, ctxs, block_size)
    ref, fast = both(q_idx, cache.pooled_keys, table, ctx, block_size, budget, block_c)
    for sel in (ref, fast):
        assert sel.shape == (len(ctxs), budget + RATIO - 1) and sel.dtype == torch.int32
        for i, (got, w) in enumerate(zip(as_masks(sel, ctxs), want)):
            assert torch.equal(got, w), (i, sel[i].tolist())
    assert torch.equal(ref, fast)                     # same layout, same best-first order


def test_layout_blocks_then_tail():
    ctxs = [2, 4, 23]                                  # no complete block; one and no tail; five and a tail of 3
    q_idx, cache, tables, table, ctx = paged_pooled(ctxs, 8, torch.float32, seed=2)
    for sel in both(q_idx, cache.pooled_keys, table, ctx, 8, 8):
        assert sel[0].tolist() == [-1] * 8 + [0, 1, -1]
        assert sel[1].tolist() == [0, 1, 2, 3] + [-1] * 4 + [-1, -1, -1]
        blocks = sel[2, :8].view(2, RATIO)
        assert torch.equal(blocks - blocks[:, :1], torch.arange(RATIO).expand(2, RATIO))
        assert (blocks[:, 0] % RATIO == 0).all() and (blocks < 20).all()
        assert sel[2, 8:].tolist() == [20, 21, 22]


def test_ties_go_to_the_lower_block():
    """Small integers make every score exact, so equal pooled rows give bit-equal scores; all-zero scores (every
    head's ReLU clips) must keep the first blocks."""
    ctxs = [40, 33, 29]
    bs = 8
    q_idx, cache, tables, table, ctx = paged_pooled(ctxs, bs, torch.float32, seed=5)
    g = torch.Generator().manual_seed(5)
    cache.pooled_keys = torch.randint(-1, 2, cache.pooled_keys.shape, generator=g).float()
    q_idx = torch.randint(-1, 2, q_idx.shape, generator=g).float()
    for dup, src in ((7, 3), (9, 3), (5, 2)):                        # sequence 0: planted exact ties
        cache.pooled_keys[block_row(tables[0], dup, bs)] = cache.pooled_keys[block_row(tables[0], src, bs)]
    q_idx[1] = 1.0                                                   # sequence 1: every score 0
    for c in range(33 // RATIO):
        cache.pooled_keys[block_row(tables[1], c, bs)] = -1.0
    want = select_masks(indexer(8), q_idx, cache, tables, ctxs, bs)
    ref, fast = both(q_idx, cache.pooled_keys, table, ctx, bs, 8, block_c=4)
    for sel in (ref, fast):
        assert all(torch.equal(a, b) for a, b in zip(as_masks(sel, ctxs), want))
        assert sorted(sel[1, :8].tolist()) == list(range(8))        # blocks 0 and 1
    assert torch.equal(ref, fast)


def test_bf16_inputs():
    ctxs = [40, 21, 9]
    q_idx, cache, tables, table, ctx = paged_pooled(ctxs, 8, torch.bfloat16, seed=9)
    want = select_masks(indexer(8), q_idx, cache, tables, ctxs, 8)
    ref, fast = both(q_idx, cache.pooled_keys, table, ctx, 8, 8)
    for sel in (ref, fast):
        assert all(torch.equal(a, b) for a, b in zip(as_masks(sel, ctxs), want))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_real_shapes_on_gpu(batch):
    """32 indexer heads of 128, budget 2048 / ratio 4, context up to 8192 (001 §1): same selection as the reference
    (as sets: equal scores computed in another order could differ in the last bit, which never happened here)."""
    torch.manual_seed(batch)
    bs, ctx_max, n_idx, d_idx, budget = 16, 8192, 32, 128, 2048
    pages = ctx_max // bs
    num_blocks = batch * pages + 5
    dev = "cuda"
    tables = torch.stack([torch.randperm(num_blocks, device=dev)[:pages] for _ in range(batch)]).to(torch.int32)
    ctx = torch.randint(1, ctx_max + 1, (batch,), device=dev, dtype=torch.int32)
    ctx[0] = ctx_max
    for dt in (torch.float32, torch.bfloat16):
        pooled = torch.randn(num_blocks * bs // RATIO, d_idx, device=dev).to(dt)
        q_idx = torch.randn(batch, n_idx, d_idx, device=dev).to(dt)
        ref = qsa_select_ref(q_idx, pooled, tables, ctx, bs, RATIO, budget)
        fast = qsa_select(q_idx, pooled, tables, ctx, bs, RATIO, budget)
        assert fast.shape == (batch, budget + RATIO - 1)
        assert torch.equal(ref.sort(dim=1).values, fast.sort(dim=1).values)
