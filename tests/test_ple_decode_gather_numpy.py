"""A PLE stage's own decode rows through numpy alone (`DecodeRowGather`'s `_fast` path: `_windows`,
`ngram_hash.hash_windows_numpy` and the tables' `gather_into` writing straight into the mailbox's rows): the same
rows, ids and flag as the torch path (`ngram_rows_numpy_batch`, `index_select`, `copy_`), for a file-backed table and
a procedural one, several PLE layers, contexts holding EOS, and a mailbox of another dtype (which keeps the torch
path)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shared.ngram_hash import NgramHashSpec, hash_windows_numpy, ngram_rows_numpy_batch
from shared.ple_files import ProceduralTable, dummy_ple_table
from shared.ple_table import open_table
from stage_worker.ple_decode_rows import DecodeRowGather, PleMailbox

DIM, EOS, VOCAB = 8, 7, 500


def _spec(index: int) -> NgramHashSpec:
    return NgramHashSpec(vocab_size=VOCAB, ngram_size=3, heads_per_ngram=4, ngram_vocab_size_base=997,
                         make_divisible_by=128, seed=1234, eos_token_id=EOS, ple_layer_index=index)


def _gather(tables: dict, slots: int = 8, numpy: bool = True) -> DecodeRowGather:
    layers = {str(layer): SimpleNamespace(ple=SimpleNamespace(spec=_spec(i), table=t, heads=8, head_dim=DIM))
              for i, (layer, t) in enumerate(tables.items())}
    first = next(iter(tables))
    cache = SimpleNamespace(ple={first: SimpleNamespace(context=torch.full((slots, 2), EOS, dtype=torch.long))})
    return DecodeRowGather(SimpleNamespace(layers=layers), cache, list(tables), torch.device("cpu"), numpy=numpy)


def _steps(n: int = 40, batch: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ctx = rng.integers(0, VOCAB, size=(8, 2))
        ctx[rng.random(ctx.shape) < 0.2] = EOS             # EOS in the contexts: positions behind it read as EOS
        slots = rng.permutation(8)[:batch].tolist()
        yield ctx, slots, rng.integers(0, VOCAB, size=batch).tolist()


@pytest.fixture
def tables(tmp_path):
    rows = _spec(0).padded_rows
    flat = dummy_ple_table(rows, DIM, torch.bfloat16, 3, 2, tmp_path)          # a file, mapped
    proc = ProceduralTable(_spec(1).padded_rows, DIM, torch.bfloat16, 4)
    yield {2: flat, 5: proc}
    flat.close()


def test_hash_equals_ngram_rows_numpy_batch(tables):
    g = _gather(tables)
    assert g._fast
    for ctx, slots, toks in _steps():
        windows = g._windows(ctx, slots, toks)
        for b, (consts, _) in zip(g.branches.values(), g._consts):
            want, _ = ngram_rows_numpy_batch(b.spec, ctx[slots], np.asarray(toks))
            np.testing.assert_array_equal(hash_windows_numpy(windows, consts), want)


def test_gather_into_equals_gather(tables):
    rng = np.random.default_rng(1)
    for t in tables.values():
        rows = rng.integers(0, _spec(0).padded_rows, size=(5, 8))
        got = torch.from_numpy(t.gather_into(rows)).view(torch.bfloat16)
        assert torch.equal(got, t.gather(torch.from_numpy(rows)))
        out = np.zeros((5, 3, 8, DIM), dtype=np.uint16)
        t.gather_into(rows, out[:, 1])
        assert torch.equal(torch.from_numpy(out[:, 1].copy()).view(torch.bfloat16), got)
        assert not out[:, 0].any() and not out[:, 2].any()
    flat = tables[2]
    with pytest.raises(IndexError):                       # a row past the file is an error, not a clamp
        flat.gather_into(np.array([flat.rows]))


@pytest.mark.parametrize("box_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_ids", [False, True])
def test_publish_numpy_path_equals_torch_path(tables, box_dtype, with_ids):
    fast, slow = _gather(tables), _gather(tables, numpy=False)
    assert fast._fast and not slow._fast
    boxes = [PleMailbox.create(g, 8, box_dtype, torch.device("cpu"), with_ids=with_ids) for g in (fast, slow)]
    for seq, (ctx, slots, toks) in enumerate(_steps(), start=1):
        for g, box in zip((fast, slow), boxes):
            box.contexts.copy_(torch.from_numpy(ctx))
            g.publish(box, slots, toks, seq)
        a, b = boxes
        assert torch.equal(a.rows, b.rows) and int(a.flag[0]) == int(b.flag[0]) == seq
        if with_ids:
            assert torch.equal(a.ids, b.ids) and a.ids[: len(toks)].tolist() == toks
    assert (boxes[0].host[1] is not None) == (box_dtype == torch.bfloat16)   # another dtype: the torch path


def test_call_numpy_path_equals_torch_path(tables):
    fast, slow = _gather(tables), _gather(tables, numpy=False)
    assert fast._fast and not slow._fast
    for ctx, slots, toks in _steps(10):
        for g in (fast, slow):
            g.contexts.copy_(torch.from_numpy(ctx))
        a, b = fast(slots, toks), slow(slots, toks)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_flag_set_even_when_the_gather_fails(tables, tmp_path):
    g = _gather(tables)
    box = PleMailbox.create(g, 8, torch.bfloat16, torch.device("cpu"))
    small = open_table(tables[2].path)
    object.__setattr__(small, "array", small.array[:10])     # rows past 10 now out of range
    g._consts[0] = (g._consts[0][0], small)
    with pytest.raises(IndexError):
        g.publish(box, [0, 1], [100, 200], 9)
    assert int(box.flag[0]) == 9
    small.close()

