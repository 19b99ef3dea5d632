"""QSA decode selection: the PyTorch reference and the Triton path choose exactly the keys `QSAIndexer.select` makes
visible to the last query, on the same paged cache (shuffled block tables), ties included (lower block wins), and
agree with each other in layout (chosen blocks in ascending order, then the tail), also when the block table is far
wider than the context (as under CUDA graphs) and when more blocks are complete than the budget holds (the radix
select), with short rows selected whole by one program (`SHORT_BLOCKS`) and long rows by the tiled passes, in one
batch and when the same buffers see other context lengths (as CUDA graph replays). Without CUDA the kernels run in
Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import stage_worker.kernels.qsa as qsa_kernels  # noqa: E402
from conftest import cuda_us  # noqa: E402
from stage_worker.kernels.qsa import qsa_scores_keys, qsa_select, select_from_keys  # noqa: E402
from stage_worker.kernels.qsa_ref import expand_selection, qsa_scores_ref, qsa_select_ref  # noqa: E402
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
    assert torch.equal(ref, fast)                     # same layout, same (ascending) order


def test_layout_blocks_then_tail():
    ctxs = [2, 4, 23]                                  # no complete block; one and no tail; five and a tail of 3
    q_idx, cache, tables, table, ctx = paged_pooled(ctxs, 8, torch.float32, seed=2)
    for sel in both(q_idx, cache.pooled_keys, table, ctx, 8, 8):
        assert sel[0].tolist() == [-1] * 8 + [0, 1, -1]
        assert sel[1].tolist() == [0, 1, 2, 3] + [-1] * 4 + [-1, -1, -1]
        blocks = sel[2, :8].view(2, RATIO)
        assert torch.equal(blocks - blocks[:, :1], torch.arange(RATIO).expand(2, RATIO))
        assert (blocks[:, 0] % RATIO == 0).all() and (blocks < 20).all()
        assert blocks[0, 0] < blocks[1, 0]                           # ascending block order
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


def small_int_inputs(q_idx: torch.Tensor, cache: AttentionCache, seed: int) -> torch.Tensor:
    """Replace the pooled keys and queries by values in {-1, 0, 1}: every score is exact in any summation order, and
    there are few distinct scores, so the K-th largest almost always sits in a group of equal scores."""
    g = torch.Generator().manual_seed(seed)
    cache.pooled_keys = torch.randint(-1, 2, cache.pooled_keys.shape, generator=g).float()
    return torch.randint(-1, 2, q_idx.shape, generator=g).float()


@pytest.mark.parametrize("budget,programs", [(8, 2), (64, None)])
def test_table_much_wider_than_the_context(budget, programs, monkeypatch):
    """64 table pages (128 compression blocks) for contexts of 1..70 tokens, as under CUDA graphs where the tables are
    padded to the model length: the same selection as the reference, which scores the whole width. Two score
    programs per sequence make each walk several tiles (block_c 4), every row through the tiled passes; budget 64
    takes every complete block, each row selected whole by one program (all are short)."""
    ctxs = [5, 70, 33, 8, 64, 17, 1]
    if programs is not None:                                             # the interpreter counts one SM
        monkeypatch.setattr(qsa_kernels, "SCORE_PROGRAMS_PER_SM", programs * len(ctxs))
        monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", 0)
    bs = 8
    q_idx, cache, tables, _, ctx = paged_pooled(ctxs, bs, torch.float32, seed=21 + budget)
    table = table_tensor(tables, 64)
    want = select_masks(indexer(budget), q_idx, cache, tables, ctxs, bs)
    ref, fast = both(q_idx, cache.pooled_keys, table, ctx, bs, budget, block_c=4 if programs else None)
    for sel in (ref, fast):
        for i, (got, w) in enumerate(zip(as_masks(sel, ctxs), want)):
            assert torch.equal(got, w), (i, sel[i].tolist())
    assert torch.equal(ref, fast)
    # every complete block got its score (the key is the score's float bits), whichever program owns its tile, and
    # nothing past the complete blocks was written
    scores = qsa_scores_ref(q_idx, cache.pooled_keys, table, ctx, bs, RATIO)
    keys = torch.full(scores.shape, -7, dtype=torch.int32, device=DEVICE)
    qsa_scores_keys(*[t.to(DEVICE) for t in (q_idx, cache.pooled_keys, table, ctx)], bs, RATIO,
                    block_c=4 if programs else None, out=keys)
    keys = keys.cpu()
    for i, c in enumerate(ctxs):
        torch.testing.assert_close(keys[i, : c // RATIO].view(torch.float32), scores[i, : c // RATIO])
        assert (keys[i, c // RATIO:] == -7).all()


def test_more_complete_blocks_than_the_budget_with_ties(monkeypatch):
    """budget 64 (k = 16) with 30, 24 and 17 complete blocks: the radix select runs, on scores with many exact ties
    (inputs in {-1, 0, 1}) plus planted duplicate pooled rows; equal scores go to the lower block, as
    `stable_topk_mask`. Sequence 3 has every score 0 (the first 16 blocks win) and sequence 4 exactly k blocks.
    One batch of short and long rows: up to 22 complete blocks (17, 22, 16) one program selects whole, in steps of 8
    keys, 30 and 24 take the tiled passes."""
    ctxs = [122, 97, 70, 90, 64]
    monkeypatch.setattr(qsa_kernels, "SCORE_PROGRAMS_PER_SM", 3 * len(ctxs))     # 3 a sequence (one SM here)
    monkeypatch.setattr(qsa_kernels, "SELECT_TILE", 8)                           # 2-4 select tiles a sequence
    monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", 22)
    monkeypatch.setattr(qsa_kernels, "SHORT_TILE", 8)
    bs, budget = 8, 64
    q_idx, cache, tables, _, ctx = paged_pooled(ctxs, bs, torch.float32, seed=31)
    q_idx = small_int_inputs(q_idx, cache, seed=31)
    for dup, src in ((20, 2), (27, 2), (9, 4), (13, 4), (29, 11)):      # sequence 0: more planted exact ties
        cache.pooled_keys[block_row(tables[0], dup, bs)] = cache.pooled_keys[block_row(tables[0], src, bs)]
    q_idx[3] = 1.0                                                       # sequence 3: every score 0
    for c in range(90 // RATIO):
        cache.pooled_keys[block_row(tables[3], c, bs)] = -1.0
    want = select_masks(indexer(budget), q_idx, cache, tables, ctxs, bs)
    ref, fast = both(q_idx, cache.pooled_keys, table_tensor(tables, 40), ctx, bs, budget, block_c=4)
    for sel in (ref, fast):
        for i, (got, w) in enumerate(zip(as_masks(sel, ctxs), want)):
            assert torch.equal(got, w), (i, sel[i].tolist())
        assert ((sel[:, :budget] >= 0).sum(1) == budget).all()          # k blocks chosen in every sequence
        assert sel[3, :budget].tolist() == list(range(budget))           # all tied: blocks 0..15, ascending
    assert torch.equal(ref, fast)


def keys_oracle(keys: torch.Tensor, ctx: torch.Tensor, ratio: int, budget: int) -> torch.Tensor:
    """`select_from_keys` in PyTorch: stable descending sort of each row's complete keys, the first k, ascending."""
    n = keys.shape[1]
    valid = torch.arange(n)[None, :] < ctx.long()[:, None] // ratio
    order = torch.sort(keys.long().masked_fill(~valid, -1), dim=1, descending=True, stable=True).indices
    return expand_selection(order[:, : min(budget // ratio, n)].sort(dim=1).values, ctx, ratio, budget)


def planted_keys(kind: str, completes: list[int], n: int, k: int, seed: int = 7) -> torch.Tensor:
    """int32 keys [len(completes), n] shaped to reach one branch of the radix select; entries past each row's
    complete blocks hold the largest key (they must never be read)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(completes)
    if kind == "full_range":
        keys = torch.randint(0, 2**31 - 1, (rows, n), generator=g)
    elif kind == "shared_high_bits":                                     # equal but for the low byte: every pass
        keys = 0x3F8ABC00 + torch.randint(0, 256, (rows, n), generator=g)
    elif kind == "few_values":                                           # heavy ties
        keys = torch.randint(0, 3, (rows, n), generator=g) * 1000
    elif kind == "whole_bucket":                                         # exactly k keys with top byte 100
        keys = torch.randint(0, 50 << 24, (rows, n), generator=g)
        for i, c in enumerate(completes):
            top = torch.randperm(max(c, 1), generator=g)[:k]
            keys[i, top] = (100 << 24) + torch.randint(0, 1 << 24, (len(top),), generator=g)
    elif kind == "tie_across_tiles":            # the k-th key in a tie group over tiles 0 and 1 of 512, larger after
        keys = torch.randint(0, 3, (rows, n), generator=g)
        for i, c in enumerate(completes):
            if c > 1000:
                keys[i, :c] = 1
                keys[i, 505:525] = 5                                     # 7 in the first tile, 5 more taken
                keys[i, 600:604] = 9
    else:                                                                # the float bits of real scores
        keys = torch.rand(rows, n, generator=g).abs().view(torch.int32).long()
    for i, c in enumerate(completes):
        keys[i, c:] = 2**31 - 1
    return keys.to(torch.int32)


@pytest.mark.parametrize("kind,short", [(kind, 0) for kind in ("full_range", "shared_high_bits", "few_values",
                                                                 "tie_across_tiles", "whole_bucket", "float_bits")]
                         + [(kind, 511) for kind in ("shared_high_bits", "few_values", "whole_bucket")])
def test_radix_select_on_planted_keys(kind, short, monkeypatch):
    """The select alone (radix passes and emit, SELECT_TILE 512) on int32 keys shaped to reach each branch: keys
    over the whole range, keys equal but for the low byte (all four passes), heavy ties, the K-th key in a tie group
    that spans two tiles (the emit's count of earlier tiles' equal keys), a first-pass bucket holding exactly k keys,
    and the float bits of real scores. Rows have none, fewer than k, exactly k, k + 1, and up to three tiles of
    complete blocks. short 511 (every pass, ties, a whole bucket): rows of up to 511 blocks are selected whole by
    one program (steps of 128 keys), the longer ones (513, 1100) by the tiled passes, in the same call (pass 0 runs
    in the first pass launch there, as the short program counts its own)."""
    monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", short)
    monkeypatch.setattr(qsa_kernels, "SHORT_TILE", 128)
    budget, n = 64, 1152                                                 # k = 16
    completes = [0, 5, 16, 17, 300, 511, 513, 1100]
    keys = planted_keys(kind, completes, n, budget // RATIO)
    ctx = torch.tensor([c * RATIO + i % RATIO for i, c in enumerate(completes)], dtype=torch.int32)
    want = keys_oracle(keys, ctx, RATIO, budget)
    got = select_from_keys(keys.to(DEVICE), ctx.to(DEVICE), RATIO, budget).cpu()
    assert torch.equal(got, want), [i for i in range(len(completes)) if not torch.equal(got[i], want[i])]


@pytest.mark.parametrize("bits,kind", [(8, "few_values"), (11, "shared_high_bits"), (8, "one_program"),
                                       (8, "hybrid")])
def test_select_over_many_small_tiles(bits, kind, monkeypatch):
    """Tiles of 8 keys, so a short row spans many programs of the radix passes and of the emit: a batch of mixed
    lengths (contexts of 0-3 tokens, complete < k, == k, k + 1, 4 and 7 tiles), ties everywhere (few_values: the
    k-th key's tie group crosses several tile boundaries, and earlier tiles' equal keys fill the take), 8- and 11-bit
    digits (4 and 3 passes); `one_program` the first version's single-program select on the same rows; `hybrid`:
    rows of up to 29 blocks (29: the threshold itself) selected whole by one program in steps of 8 keys, the row of
    53 by the tiled passes."""
    monkeypatch.setattr(qsa_kernels, "SELECT_TILE", 8)
    monkeypatch.setattr(qsa_kernels, "RADIX_BITS", bits)
    monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", 29 if kind == "hybrid" else 0)
    monkeypatch.setattr(qsa_kernels, "SHORT_TILE", 8)
    budget, n = 16, 60                                                   # k = 4
    completes = [0, 0, 0, 0, 3, 4, 5, 29, 53]
    keys = planted_keys("few_values" if kind in ("one_program", "hybrid") else kind, completes, n, budget // RATIO,
                        seed=bits)
    keys[8, :53] = 1000                                                  # the k-th key's ties in tiles 0, 1, 3, 5:
    keys[8, [6, 7, 9, 30, 45]] = 2000                                    # the first three taken, after one larger
    keys[8, 50] = 3000
    ctx = torch.tensor([0, 1, 2, 3] + [c * RATIO + i % RATIO for i, c in enumerate(completes[4:])], dtype=torch.int32)
    want = keys_oracle(keys, ctx, RATIO, budget)
    got = select_from_keys(keys.to(DEVICE), ctx.to(DEVICE), RATIO, budget, one_program=kind == "one_program").cpu()
    assert torch.equal(got, want), [i for i in range(len(completes)) if not torch.equal(got[i], want[i])]
    assert got[8, :budget:RATIO].tolist() == [6 * RATIO, 7 * RATIO, 9 * RATIO, 50 * RATIO]
    assert got[:4, :budget].eq(-1).all() and got[3, budget:].tolist() == [0, 1, 2]


@pytest.mark.parametrize("short", [0, 17], ids=["tiled", "hybrid"])
def test_score_kernel_adds_the_first_radix_pass(short, monkeypatch):
    """The score kernel's fused pass 0: with three score programs per sequence (each walking several tiles of 4
    blocks) and
    select tiles of 16, hist[:, 0] is the histogram of the top byte of each row's complete keys, the other passes
    untouched; and `qsa_select` (pass 0 from the score kernel) equals the select with pass 0 run on the keys.
    hybrid: the rows of 17, 0 and 10 blocks are selected whole by one program (pass 0 read from the score kernel's
    histogram, or counted when `select_from_keys` runs pass 0), the row of 30 by the tiled passes."""
    ctxs = [70, 3, 41, 122]
    monkeypatch.setattr(qsa_kernels, "SCORE_PROGRAMS_PER_SM", 3 * len(ctxs))
    monkeypatch.setattr(qsa_kernels, "SELECT_TILE", 16)
    monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", short)
    monkeypatch.setattr(qsa_kernels, "SHORT_TILE", 8)
    q_idx, cache, tables, table, ctx = paged_pooled(ctxs, 8, torch.float32, seed=3)
    dev = [t.to(DEVICE) for t in (q_idx, cache.pooled_keys, table, ctx)]
    hist = qsa_kernels.new_histograms(len(ctxs), DEVICE)
    keys = qsa_scores_keys(*dev, 8, RATIO, block_c=4, hist=hist).cpu()
    hist = hist.cpu()
    for i, c in enumerate(ctxs):
        want = torch.bincount((keys[i, : c // RATIO] >> 24).long(), minlength=256).to(torch.int32)
        assert torch.equal(hist[i, 0], want), i
    assert (hist[:, 1:] == 0).all()
    scores = qsa_scores_ref(q_idx, cache.pooled_keys, table, ctx, 8, RATIO)
    for i, c in enumerate(ctxs):                                         # every tile scored, whichever program
        torch.testing.assert_close(keys[i, : c // RATIO].view(torch.float32), scores[i, : c // RATIO])
    ref = qsa_select_ref(q_idx, cache.pooled_keys, table, ctx, 8, RATIO, 16)
    assert torch.equal(qsa_select(*dev, 8, RATIO, 16, block_c=4).cpu(), ref)
    assert torch.equal(select_from_keys(keys.to(DEVICE), dev[3], RATIO, 16).cpu(), ref)
    assert torch.equal(qsa_select(*dev, 8, RATIO, 16, block_c=4, one_program=True).cpu(), ref)


class ReplayedBuffers:
    """Stands in for `torch` inside qsa.py as a CUDA graph's private pool does on replay: the tensors the first call
    allocates (histograms, keys, `ge`, the output) are handed out again, in the same order, to every later call,
    holding what the last call left there; `zeros` zeroes again (the memset node). The first call's `empty` tensors
    start as garbage, so an entry no launch writes shows."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.next = None                                                 # None: recording the first call

    def __getattr__(self, name):
        return getattr(torch, name)

    def _buffer(self, make, zero: bool) -> torch.Tensor:
        if self.next is None:
            self.buffers.append(make())
            return self.buffers[-1]
        t = self.buffers[self.next]
        self.next += 1
        return t.zero_() if zero else t

    def empty(self, *args, **kw) -> torch.Tensor:
        return self._buffer(lambda: torch.empty(*args, **kw).fill_(0x5A5A5A5A), zero=False)

    def zeros(self, *args, **kw) -> torch.Tensor:
        return self._buffer(lambda: torch.zeros(*args, **kw), zero=True)

    def replay(self) -> None:
        self.next = 0


def test_replays_with_other_context_lengths(monkeypatch):
    """Graph-like reuse: one `qsa_select` on the same tensors and scratch, the context lengths rewritten in place
    between calls, each row switching between short (selected whole by one program, up to 12 blocks) and long (the
    tiled passes) and back, small-integer inputs (exact ties at the k-th key): every call equals the reference for
    its lengths, whatever the last call left in the output, the keys past the context and the `ge` counts."""
    monkeypatch.setattr(qsa_kernels, "SCORE_PROGRAMS_PER_SM", 2 * 3)
    monkeypatch.setattr(qsa_kernels, "SELECT_TILE", 8)
    monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", 12)
    monkeypatch.setattr(qsa_kernels, "SHORT_TILE", 8)
    replayed = ReplayedBuffers()
    monkeypatch.setattr(qsa_kernels, "torch", replayed)
    bs, budget = 8, 16                                                   # k = 4
    q_idx, cache, tables, _, ctx = paged_pooled([120, 96, 64], bs, torch.float32, seed=41)
    q_idx = small_int_inputs(q_idx, cache, seed=41)
    table = table_tensor(tables, 16)
    dev = [t.to(DEVICE) for t in (q_idx, cache.pooled_keys, table)]
    ctx_dev = ctx.to(DEVICE)
    out = None
    for lens in ([120, 96, 64], [48, 3, 53], [5, 96, 0], [53, 49, 48], [120, 17, 64]):   # 48: 12 blocks, 53: 13
        ctx_dev.copy_(torch.tensor(lens, dtype=torch.int32))
        got = qsa_select(*dev, ctx_dev, bs, RATIO, budget, block_c=4)
        assert out is None or got.data_ptr() == out.data_ptr()           # the same output tensor every call
        out = got
        replayed.replay()
        want = qsa_select_ref(q_idx, cache.pooled_keys, table, torch.tensor(lens, dtype=torch.int32), bs, RATIO,
                              budget)
        assert torch.equal(got.cpu(), want), lens


@pytest.mark.parametrize("short", [0, 12], ids=["tiled", "hybrid"])
def test_last_pass_ranks_each_long_row_once(short, monkeypatch):
    """The last radix pass's ticket: the last of a long row's tile programs to count itself in ranks the K-th key
    once for the emit (`_rank_tiles`). Tiles of 8 keys, k = 6, the K-th key in a tie group spread over every tile
    of the row (1000 everywhere, a few larger keys in some tiles), rows that end mid-tile and on a tile edge, beside
    short rows (hybrid: up to 12 blocks, one program), rows of <= k blocks, and an empty one, in one batch; the same
    histogram, ticket and `ge` buffers (as a CUDA graph's pool: the memset zeroes the histograms and tickets, the
    rest keeps what the last call left) through calls with other context lengths, each row switching between
    long, short and empty. Every call equals the oracle, each long row's ticket counts exactly its tiles (the
    programs past its context take none) and holds the K-th key and how many keys equal to it are taken."""
    monkeypatch.setattr(qsa_kernels, "SELECT_TILE", 8)
    monkeypatch.setattr(qsa_kernels, "SHORT_BLOCKS", short)
    monkeypatch.setattr(qsa_kernels, "SHORT_TILE", 8)
    replayed = ReplayedBuffers()
    monkeypatch.setattr(qsa_kernels, "torch", replayed)
    budget, n, k = 24, 100, 6
    g = torch.Generator().manual_seed(11)
    keys = torch.full((5, n), 1000, dtype=torch.int32)
    keys[0, [3, 40, 77, 98]] = 2000                     # 4 above: 2 of the ties taken (blocks 0 and 1: tile 0)
    keys[1, [12, 13]] = 3000
    keys[2] = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32) * 1000     # 2000s, then 1000s
    keys[3, 90:] = 5000                                 # the larger keys in the last tiles
    keys[4, ::9] = 1001
    npass = qsa_kernels.radix_passes(8)
    for completes in ([100, 13, 6, 96, 0], [5, 100, 97, 0, 64], [96, 0, 12, 100, 16], [100, 99, 98, 97, 96]):
        ctx = torch.tensor([c * RATIO + i % RATIO for i, c in enumerate(completes)], dtype=torch.int32)
        hist = qsa_kernels.new_histograms(len(completes), DEVICE)          # pass 0, as the score kernel adds it
        for i, c in enumerate(completes):
            hist[i, 0] = torch.bincount((keys[i, :c] >> 24).long(), minlength=256).to(torch.int32)
        got = select_from_keys(keys.to(DEVICE), ctx.to(DEVICE), RATIO, budget, hist=hist).cpu()
        replayed.replay()
        assert torch.equal(got, keys_oracle(keys, ctx, RATIO, budget)), completes
        for i, c in enumerate(completes):
            ranked = hist[i, npass].tolist()[:3]
            if c <= max(k, short):
                assert ranked == [0, 0, 0], (completes, i)
                continue
            order = torch.sort(keys[i, :c], descending=True, stable=True).values
            thr = int(order[k - 1])
            assert ranked == [-(-c // 8), thr, int((order[:k] == thr).sum())], (completes, i)


def test_kernels_compile_for_sm90():
    """The interpreter runs none of the GPU compiler: compile the score (hand-pipelined and plain, with the fused
    histogram), radix pass (the first one launched with the short rows' one-program select, HIST0 for pass 1 and
    not for pass 0; the last one with the ranking) and emit kernels for sm_90 at the full shape (8- and 11-bit
    digits), specialized as the JIT specializes a real launch (16-aligned pointers, strides divisible by 16; without
    it the score kernel's gather compiles to 2-byte loads at 140 registers), so a compile error shows before a
    device call. None of the 8-bit ones may spill (11 bits, a sweep candidate, spills in the short select); the
    pass launch with the short select (steps of SHORT_TILE keys) at <= 128
    registers a thread keeps 4+ of its programs resident per SM for the long rows' tiles (B = 4 at 262k: 512
    programs), and SCORE_PROGRAMS_PER_SM score programs must fit an SM's 64K registers."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import qsa as Q

def build(fn, sig, const, warps=4):
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if (t.startswith("*") or t == "i32") and n != "s_ob"}          # the output row (budget + 3) is odd
    sig = dict(sig, **dict.fromkeys(const, "constexpr"))
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))

info = {}
for bits, tile in ((8, 512), (11, 1024)):
    for score in (Q._score_kernel,):
        k = build(score, dict(q_ptr="*bf16", pooled_ptr="*bf16", tables_ptr="*i32", ctx_ptr="*i32", key_ptr="*i32",
                  hist_ptr="*i32", sqrt_d="fp32", s_qb="i32", s_qh="i32", s_pr="i32", s_tb="i32", s_kb="i32",
                  s_hb="i32"),
                  dict(N_IDX=32, D_IDX=128, PAGE=16, RATIO=4, BLOCK_H=32, BLOCK_D=128, BLOCK_C=64, PROGRAMS=396,
                       DOT_F32=False, HIST=True, BITS=bits))
        info[f"{score.__name__}/{bits}"] = ptxas_info(k.asm["ptx"])
    ptrs = dict(key_ptr="*i32", ctx_ptr="*i32", hist_ptr="*i32", ge_ptr="*i32", out_ptr="*i32")
    strides = dict(s_kb="i32", s_hb="i32", s_gb="i32", s_ob="i32")
    for p in range(Q.radix_passes(bits)):
        for select_short in ((True, False) if p < 2 else (False,)):
            k = build(Q._radix_pass_kernel, dict(ptrs, **strides),
                      dict(K=512, BUDGET=2048, RATIO=4, RATIO_P=4, PASS=p, BITS=bits, TILE=tile, SHORT=2048,
                           SHORT_TILE=Q.SHORT_TILE, SELECT_SHORT=select_short))
            info[f"pass{p}{'+short' if select_short else ''}/{bits}"] = ptxas_info(k.asm["ptx"])
    k = build(Q._emit_kernel, dict(ptrs, **strides),
              dict(K=512, BUDGET=2048, RATIO=4, RATIO_P=4, BITS=bits, TILE=tile, SHORT=2048))
    info[f"emit/{bits}"] = ptxas_info(k.asm["ptx"])
build(Q._select_kernel, dict(key_ptr="*i32", ctx_ptr="*i32", out_ptr="*i32", s_kb="i32", s_ob="i32"),
      dict(K=512, BUDGET=2048, RATIO=4, RATIO_P=4, BLOCK=2048, BITS=8), warps=8)
print(json.dumps(info))
"""
    info = run_compile_script(script, timeout=300)
    print(info)
    assert all(i["spill"] == 0 for name, i in info.items() if name.endswith("/8")), info     # 11 bits: sweep only
    assert info["pass1+short/8"]["regs"] <= 128, info
    assert info["_score_kernel/8"]["regs"] * 128 * qsa_kernels.SCORE_PROGRAMS_PER_SM <= 65536, info


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


def wide_gpu_case(ctxs: list[int], inputs: str, dtype: torch.dtype, seed: int):
    """Real shapes (001 §1): 32 indexer heads of 128, block size 16, tables 16384 pages wide (262144 tokens = 65,536
    compression blocks, as CUDA graphs pad them) holding each sequence's pages, shuffled, then -1."""
    bs, n_idx, d_idx, width = 16, 32, 128, 16384
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    pages = [-(-c // bs) for c in ctxs]
    num_blocks = sum(pages) + 5
    pool = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32)
    tables = torch.full((len(ctxs), width), -1, dtype=torch.int32, device=dev)
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = pool[start: start + n]
        start += n
    shape_p, shape_q = (num_blocks * bs // RATIO, d_idx), (len(ctxs), n_idx, d_idx)
    if inputs == "small_ints":                  # exact scores in any summation order, many exact ties
        pooled = torch.randint(-1, 2, shape_p, device=dev, generator=g).to(dtype)
        q_idx = torch.randint(-1, 2, shape_q, device=dev, generator=g).to(dtype)
    else:
        pooled = torch.randn(shape_p, device=dev, generator=g).to(dtype)
        q_idx = torch.randn(shape_q, device=dev, generator=g).to(dtype)
    return q_idx, pooled, tables, torch.tensor(ctxs, dtype=torch.int32, device=dev)


@pytest.mark.gpu
@pytest.mark.parametrize("inputs", ["small_ints", "randn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wide_table_real_shapes_on_gpu(inputs, dtype):
    """Ratio 4, budget 2048 (k = 512), B = 4: contexts 300 and 301 (75 complete blocks <= k: every block, no ranking)
    and 20000 / 20003 (5000 > k: the radix select), in a table 16384 pages wide. Identical output to the reference
    (with random inputs that assumes no two scores within rounding of each other straddle the k-th; small integers
    make it exact). Prints the time of `qsa_select`, which should follow the context, not the table width. A mixed
    batch for the hybrid (300 / 301: short rows, one program each; 20000 / 20003: the tiled passes), also all tiled."""
    budget = 2048
    q_idx, pooled, tables, ctx = wide_gpu_case([300, 20000, 20003, 301], inputs, dtype, seed=1)
    ref = qsa_select_ref(q_idx, pooled, tables, ctx, 16, RATIO, budget)
    fast = qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget)
    assert fast.shape == (4, budget + RATIO - 1) and fast.dtype == torch.int32
    assert torch.equal(ref, fast)
    assert torch.equal(ref, qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget, short_blocks=0))
    assert ((fast[:, :budget] >= 0).sum(1).tolist() == [300 // 4 * 4, budget, budget, 301 // 4 * 4])

    short = ctx.clone().fill_(256)
    print(f"\nqsa_select, table 16384 pages: contexts {ctx.tolist()}: "
          f"{cuda_us(lambda: qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget)):.1f} us; "
          f"contexts 256: {cuda_us(lambda: qsa_select(q_idx, pooled, tables, short, 16, RATIO, budget)):.1f} us")


@pytest.mark.gpu
def test_cuda_graph_replay_follows_the_context_lengths():
    """Captured once, replayed with other context lengths written into the same device tensor: the kernels read the
    lengths on the device, so every replay equals the reference for the new lengths, each row switching between the
    hybrid's short path (<= 2048 complete blocks: 8192 tokens is the threshold itself) and the tiled passes."""
    budget = 2048
    q_idx, pooled, tables, ctx = wide_gpu_case([20003, 8191, 5000, 256], "randn", torch.bfloat16, seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                        # compile and warm up outside the capture
        qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget)
    for lens in ([20000, 300, 5000, 4], [1, 8191, 2052, 256], [8196, 8192, 5000, 256], [8192, 4, 1, 255],
                 [256, 256, 256, 256], [20003, 8191, 5000, 256]):                         # within each table
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, qsa_select_ref(q_idx, pooled, tables, ctx, 16, RATIO, budget)), lens


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of `reps` calls (median of 5 replays): decode replays
    graphs, so the Python launch cost of a path of several kernels is not what a step pays."""
    from conftest import graph_us as timed

    return timed(lambda i: fn(), reps, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_262k_context_on_gpu(batch):
    """Issue 18: contexts of 262,144 tokens (65,536 compression blocks, the whole table 16384 pages wide), budget 2048
    (k = 512), small-integer inputs (exact scores, heavy ties at the k-th key) and randn bf16: the multi-program
    select equals the reference and the first version (one select program a sequence) bit for bit, and so do the
    tiled path and the hybrid at 8192 (short: 2048 blocks, the threshold) and 8196 tokens (long). Prints, by
    context in the same wide table (its width is fixed under CUDA graphs, so short contexts must stay cheap), the
    time in a CUDA graph of: the first version, the tiled path (`short_blocks=0`), the hybrid (the default:
    SHORT_BLOCKS), and every row forced short (`short_blocks` = the table: where the one-program select stops
    paying, i.e. where SHORT_BLOCKS belongs)."""
    budget = 2048
    ctxs = [262144, 262143, 262142, 262141][:batch]
    for inputs, dtype in (("small_ints", torch.float32), ("randn", torch.bfloat16)):
        q_idx, pooled, tables, ctx = wide_gpu_case(ctxs, inputs, dtype, seed=batch)
        ref = qsa_select_ref(q_idx, pooled, tables, ctx, 16, RATIO, budget)
        new = qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget)
        old = qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget, one_program=True)
        assert torch.equal(new, old), inputs                             # same keys: exactly the same choice
        assert torch.equal(ref, new), inputs
        assert ((new[:, :budget] >= 0).sum(1) == budget).all()
        for c in (8192, 8196):
            ctx.fill_(c)
            ref = qsa_select_ref(q_idx, pooled, tables, ctx, 16, RATIO, budget)
            for short in (None, 0, 65536):
                got = qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget, short_blocks=short)
                assert torch.equal(ref, got), (inputs, c, short)
        ctx.fill_(ctxs[0])
    n_blocks = tables.shape[1] * 16 // RATIO
    variants = dict(one_program=dict(one_program=True), tiled=dict(short_blocks=0), hybrid={},
                    all_short=dict(short_blocks=n_blocks))
    line = []
    for c in (1024, 4096, 8192, 8196, 16384, 65536, 262144):
        ctx.fill_(c)
        us = [graph_us(lambda: qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget, **kw))
              for kw in variants.values()]
        line.append(f"{c}: " + " / ".join(f"{u:.1f}" for u in us))
    roofline = batch * 262144 // RATIO * pooled.shape[1] * pooled.element_size() / 4.24e12 * 1e6
    print(f"\nqsa_select B={batch}, table 16384 pages, us {' / '.join(variants)} (SHORT_BLOCKS "
          f"{qsa_kernels.SHORT_BLOCKS}), by context: {'; '.join(line)} (262k pooled keys at 4.24 TB/s: "
          f"{roofline:.1f} us)")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_score_variants_at_262k_on_gpu(batch, monkeypatch):
    """Issue 18's score kernel at 262k (65,536 blocks a row, randn bf16) writes the same keys and pass-0 histograms
    bit for bit at 3 and 5 programs per SM; prints the
    score launch alone and the whole selection in a CUDA graph, and the selection at 4k for the gap issue 18 is
    about (262k within 5% of 4k is the goal for the decode step)."""
    budget = 2048
    q_idx, pooled, tables, ctx = wide_gpu_case([262144 - i for i in range(batch)], "randn", torch.bfloat16, seed=7)
    want = None
    line = []
    for per_sm in (3, 5):
        monkeypatch.setattr(qsa_kernels, "SCORE_PROGRAMS_PER_SM", per_sm)
        hist = qsa_kernels.new_histograms(batch, "cuda")
        keys = qsa_scores_keys(q_idx, pooled, tables, ctx, 16, RATIO, hist=hist)
        # a key per complete block (the slots past a row's context are never written), and a copy of the
        # histograms: the timing below adds into `hist` again (h200-26 compared against those sums and
        # against the unwritten slots, and failed on both)
        keys = [keys[b, : int(ctx[b]) // RATIO].clone() for b in range(batch)]
        if want is None:
            want = keys, hist.clone()
        assert all(torch.equal(k, w) for k, w in zip(keys, want[0])), ("keys", per_sm)
        assert torch.equal(hist, want[1]), ("histograms", per_sm)
        score = graph_us(lambda: qsa_scores_keys(q_idx, pooled, tables, ctx, 16, RATIO, hist=hist))
        select = graph_us(lambda: qsa_select(q_idx, pooled, tables, ctx, 16, RATIO, budget))
        short = ctx.clone().fill_(4096)
        at_4k = graph_us(lambda: qsa_select(q_idx, pooled, tables, short, 16, RATIO, budget))
        line.append(f"{per_sm}/SM: score {score:.1f}, select {select:.1f}, 4k {at_4k:.1f}")
    print(f"\nqsa B={batch} at 262k, us: " + "; ".join(line))
