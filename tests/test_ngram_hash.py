"""shared.ngram_hash against the reference `Qwen4ExpTextNGramEmbedding` of transformers, bit for bit.

The reference module is run with its embedding swapped for a module that records the row ids it is asked for, so we
compare ids, not embeddings.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shared.ngram_hash import (
    NgramHashSpec,
    initial_context,
    ngram_rows_numpy,
    ngram_rows_numpy_batch,
    ngram_rows_torch,
    ngram_rows_torch_flat,
    ple_layer_indices,
)

transformers = pytest.importorskip("transformers")
ref = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

EOS = 7
VOCAB = 1000

# (ngram_size, heads_per_ngram, ngram_vocab_size_base, ple_layer_index)
CASES = [
    (3, 2, 5000, 0),
    (3, 3, 5000, 1),
    (4, 2, 5000, 1),
    (4, 3, 5000, 0),
    (2, 2, 5000, 1),
    (3, 3, 20_000_000, 1),
]


class _RecordIds(torch.nn.Module):
    """Stands in for the reference's nn.Embedding: remembers the ids, returns zeros of width 1."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the reference reads .weight.device
        self.seen: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.clone())
        return torch.zeros(*ids.shape, 1)


def _config(ngram_size: int, heads: int, base: int, eos=EOS):
    num_heads = (ngram_size - 1) * heads
    return transformers.Qwen4ExpTextConfig(
        vocab_size=VOCAB,
        hidden_size=4 * num_heads,
        ple_embed_dim=num_heads,
        num_hidden_layers=4,  # layers 1-3 are linear attention
        ple_layer_ids=[1, 2],
        ngram_size=ngram_size,
        heads_per_ngram=heads,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        eos_token_id=eos,
    )


def _reference(cfg, ple_layer_index: int):
    """The reference module (embedding replaced by _RecordIds). Big tables are built on the meta device and their
    index buffers recomputed the way the reference's own `_init_weights` does."""
    num_heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    layer_idx = cfg.ple_layer_ids[ple_layer_index] - 1
    if cfg.ngram_vocab_size_base > 100_000:
        with torch.device("meta"):
            mod = ref.Qwen4ExpTextNGramEmbedding(cfg, num_heads, layer_idx, ple_layer_index)
        mod.layer_multipliers = ref._build_layer_multipliers(
            mod.unigram_vocab_size, mod.ngram_size, mod.ple_layer_index, mod.seed
        )
        mod.ngram_heads_vocab_sizes = torch.tensor(mod.head_vocab_sizes, dtype=torch.long)
        mod.ngram_heads_offsets = torch.tensor(mod.head_offsets, dtype=torch.long)
        padded = mod.ngram_embedding.num_embeddings
    else:
        mod = ref.Qwen4ExpTextNGramEmbedding(cfg, num_heads, layer_idx, ple_layer_index)
        padded = mod.ngram_embedding.num_embeddings
    mod.ngram_embedding = _RecordIds()
    mod.padded_rows = padded
    return mod


def _ref_rows(mod, tokens: torch.Tensor, cache=None) -> torch.Tensor:
    mod.ngram_embedding.seen.clear()
    mod(tokens, cache)
    (ids,) = mod.ngram_embedding.seen
    return ids


def _stream(rng: np.random.Generator, length: int, eos: int = EOS, overflow: bool = False) -> np.ndarray:
    """Random ids with EOS at position 0, a run of consecutive EOS, scattered EOS and ids at the vocab edge."""
    x = rng.integers(0, VOCAB, size=length, dtype=np.int64)
    x[rng.random(length) < 0.15] = eos
    x[rng.random(length) < 0.1] = VOCAB - 1
    x[0] = eos
    x[5:8] = eos
    x[9] = VOCAB - 1
    x[10] = VOCAB - 2
    if overflow:
        # Out-of-vocabulary ids whose products with the multipliers overflow int64 and must wrap identically.
        big = np.array([2**63 - 1, 2**62 + 12345, -(2**63), -1, 2**40 + 3], dtype=np.int64)
        x[rng.choice(np.arange(12, length), size=big.size, replace=False)] = big
    return x


def _spec(cfg, ple_layer_index: int) -> NgramHashSpec:
    return NgramHashSpec.from_model_config(cfg, ple_layer_index)


@pytest.mark.parametrize("ngram_size,heads,base,ple_index", CASES)
def test_constants_match_reference(ngram_size, heads, base, ple_index):
    cfg = _config(ngram_size, heads, base)
    mod = _reference(cfg, ple_index)
    spec = _spec(cfg, ple_index)
    assert spec.num_heads == mod.ngram_heads
    assert list(spec.primes) == mod.ngram_heads_vocab_sizes.tolist() == mod.head_vocab_sizes
    assert list(spec.offsets) == mod.ngram_heads_offsets.tolist()
    assert list(spec.multipliers) == mod.layer_multipliers.tolist()
    assert spec.total_rows == mod.total_vocab_size
    assert spec.padded_rows == mod.padded_rows
    assert spec.padded_rows % 128 == 0


@pytest.mark.parametrize("ngram_size,heads,base,ple_index", CASES)
@pytest.mark.parametrize("overflow", [False, True])
def test_rows_match_reference(ngram_size, heads, base, ple_index, overflow):
    cfg = _config(ngram_size, heads, base)
    mod = _reference(cfg, ple_index)
    spec = _spec(cfg, ple_index)
    rng = np.random.default_rng(ngram_size * 100 + heads * 10 + ple_index + overflow)
    batch = np.stack([_stream(rng, 64, overflow=overflow) for _ in range(3)])
    batch[2, :] = np.roll(batch[2, :], 1)  # one row that does not start with EOS
    expected = _ref_rows(mod, torch.from_numpy(batch))

    for b in range(batch.shape[0]):
        rows_np, ctx_np = ngram_rows_numpy(spec, initial_context(spec), batch[b])
        assert rows_np.dtype == np.int64
        np.testing.assert_array_equal(rows_np, expected[b].numpy())
        np.testing.assert_array_equal(ctx_np, batch[b, -(ngram_size - 1) :])

    ctx0 = torch.from_numpy(np.stack([initial_context(spec)] * batch.shape[0]))
    rows_t, ctx_t = ngram_rows_torch(spec, ctx0, torch.from_numpy(batch))
    assert rows_t.dtype == torch.long and rows_t.shape == expected.shape
    assert torch.equal(rows_t, expected)
    assert torch.equal(ctx_t, torch.from_numpy(batch[:, -(ngram_size - 1) :]))

    if not overflow:
        assert int(expected.min()) >= 0 and int(expected.max()) < spec.total_rows


@pytest.mark.parametrize("ngram_size,heads,base,ple_index", [(3, 2, 5000, 0), (4, 3, 5000, 1)])
def test_arbitrary_context_equals_prefixed_reference(ngram_size, heads, base, ple_index):
    """A non-EOS context acts exactly as if those ids had been fed earlier in the same call."""
    cfg = _config(ngram_size, heads, base)
    mod = _reference(cfg, ple_index)
    spec = _spec(cfg, ple_index)
    rng = np.random.default_rng(5)
    for trial in range(20):
        ctx = rng.integers(0, VOCAB, size=ngram_size - 1, dtype=np.int64)
        if trial % 3 == 1:
            ctx[rng.integers(0, ngram_size - 1)] = EOS
        toks = rng.integers(0, VOCAB, size=int(rng.integers(1, 6)), dtype=np.int64)
        if trial % 4 == 2:
            toks[0] = EOS
        full = torch.from_numpy(np.concatenate([ctx, toks]))[None]
        expected = _ref_rows(mod, full)[0, -toks.size :]
        rows, _ = ngram_rows_numpy(spec, ctx, toks)
        np.testing.assert_array_equal(rows, expected.numpy())
        rows_t, _ = ngram_rows_torch(spec, torch.from_numpy(ctx)[None], torch.from_numpy(toks)[None])
        assert torch.equal(rows_t[0], expected)


@pytest.mark.parametrize("ngram_size,heads,base,ple_index", [(3, 3, 5000, 1), (4, 2, 5000, 0), (2, 2, 5000, 1)])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_equals_one_shot(ngram_size, heads, base, ple_index, chunk):
    cfg = _config(ngram_size, heads, base)
    mod = _reference(cfg, ple_index)
    spec = _spec(cfg, ple_index)
    rng = np.random.default_rng(chunk)
    batch = np.stack([_stream(rng, 40, overflow=True) for _ in range(2)])
    one_shot = _ref_rows(mod, torch.from_numpy(batch))

    # The reference's own streaming path (cache carries the last ngram_size - 1 ids) agrees with its one-shot path.
    cache = transformers.DynamicCache(config=cfg)
    ref_chunks = [_ref_rows(mod, torch.from_numpy(batch[:, i : i + chunk]), cache) for i in range(0, 40, chunk)]
    assert torch.equal(torch.cat(ref_chunks, dim=1), one_shot)

    for b in range(batch.shape[0]):
        ctx, parts = initial_context(spec), []
        for i in range(0, 40, chunk):
            rows, ctx = ngram_rows_numpy(spec, ctx, batch[b, i : i + chunk])
            parts.append(rows)
        np.testing.assert_array_equal(np.concatenate(parts), one_shot[b].numpy())

    ctx_t = torch.from_numpy(np.stack([initial_context(spec)] * 2))
    parts_t = []
    for i in range(0, 40, chunk):
        rows_t, ctx_t = ngram_rows_torch(spec, ctx_t, torch.from_numpy(batch[:, i : i + chunk]))
        parts_t.append(rows_t)
    assert torch.equal(torch.cat(parts_t, dim=1), one_shot)
    # An empty chunk changes nothing.
    rows_e, ctx_e = ngram_rows_torch(spec, ctx_t, torch.zeros(2, 0, dtype=torch.long))
    assert rows_e.shape == (2, 0, spec.num_heads) and torch.equal(ctx_e, ctx_t)
    rows_en, ctx_en = ngram_rows_numpy(spec, ctx_t[0].numpy(), np.zeros(0, dtype=np.int64))
    assert rows_en.shape == (0, spec.num_heads)
    np.testing.assert_array_equal(ctx_en, ctx_t[0].numpy())


@pytest.mark.parametrize("ngram_size,heads,base,ple_index", [(3, 3, 5000, 1), (4, 2, 5000, 0)])
def test_flat_varlen_matches_per_sequence(ngram_size, heads, base, ple_index):
    cfg = _config(ngram_size, heads, base)
    spec = _spec(cfg, ple_index)
    rng = np.random.default_rng(11)
    lengths = [5, 0, 1, 2, 17, 3]  # includes an empty sequence and ones shorter than the context
    seqs = [_stream(rng, 20, overflow=True)[:n] for n in lengths]
    contexts = np.stack([rng.integers(0, VOCAB, size=ngram_size - 1, dtype=np.int64) for _ in lengths])
    contexts[1, 0] = EOS
    contexts[3] = EOS
    cu = np.concatenate([[0], np.cumsum(lengths)])
    rows, new_ctx = ngram_rows_torch_flat(
        spec, torch.from_numpy(contexts), torch.from_numpy(np.concatenate(seqs)), torch.from_numpy(cu)
    )
    assert rows.shape == (sum(lengths), spec.num_heads)
    for b, seq in enumerate(seqs):
        exp_rows, exp_ctx = ngram_rows_numpy(spec, contexts[b], seq)
        np.testing.assert_array_equal(rows[cu[b] : cu[b + 1]].numpy(), exp_rows)
        np.testing.assert_array_equal(new_ctx[b].numpy(), exp_ctx)

    # All sequences empty.
    rows0, ctx0 = ngram_rows_torch_flat(
        spec, torch.from_numpy(contexts[:2]), torch.zeros(0, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    )
    assert rows0.shape == (0, spec.num_heads) and torch.equal(ctx0, torch.from_numpy(contexts[:2]))


def test_eos_list_uses_first_and_config_shapes():
    cfg = _config(3, 2, 5000, eos=[11, 7])
    mod = _reference(cfg, 0)
    spec = NgramHashSpec.from_model_config(cfg, 0)
    assert spec.eos_token_id == mod.eos_token_id == 11
    x = _stream(np.random.default_rng(3), 50, eos=11)
    rows, _ = ngram_rows_numpy(spec, initial_context(spec), x)
    np.testing.assert_array_equal(rows, _ref_rows(mod, torch.from_numpy(x)[None])[0].numpy())

    # A config.json-style dict, possibly nested under text_config, with defaulted fields omitted.
    raw = {"vocab_size": VOCAB, "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 5000,
           "eos_token_id": [11, 7]}
    assert NgramHashSpec.from_model_config(raw, 0) == spec
    assert NgramHashSpec.from_model_config({"text_config": raw, "eos_token_id": 99}, 0) == spec
    assert ple_layer_indices([3, 1, 3]) == {0: 0, 2: 1}


def test_primes_fast_for_large_base():
    t0 = time.perf_counter()
    spec = NgramHashSpec(248320, 3, 16, 20_000_000, 128, 1234, 248044, 40)
    primes = spec.primes
    assert time.perf_counter() - t0 < 1.0
    assert len(primes) == 32 and all(p >= 20_000_000 for p in primes)
    assert list(primes) == sorted(set(primes))
    # Spot-check against the reference's trial division.
    assert primes[0] == ref._find_nth_prime_after(20_000_000 - 1, 40 * 32 + 1)
    assert primes[-1] == ref._find_nth_prime_after(20_000_000 - 1, 41 * 32)
    # Tiny bases: 0, 1 and 2 behave as the reference's scan does.
    for base in (0, 1, 2, 3):
        small = NgramHashSpec(10, 2, 3, base, 1, 0, 0, 1)
        assert list(small.primes) == [ref._find_nth_prime_after(base - 1, 3 + h + 1) for h in range(3)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    spec = _spec(_config(4, 3, 5000), 1)
    rng = np.random.default_rng(0)
    batch = torch.from_numpy(np.stack([_stream(rng, 64, overflow=True) for _ in range(2)]))
    ctx = torch.from_numpy(np.stack([initial_context(spec)] * 2))
    rows_cpu, _ = ngram_rows_torch(spec, ctx, batch)
    rows_gpu, ctx_gpu = ngram_rows_torch(spec, ctx.cuda(), batch.cuda())
    assert rows_gpu.is_cuda and ctx_gpu.is_cuda
    assert torch.equal(rows_gpu.cpu(), rows_cpu)
    cu = torch.tensor([0, 64, 128])
    flat_gpu, fctx_gpu = ngram_rows_torch_flat(spec, ctx.cuda(), batch.reshape(-1).cuda(), cu.cuda())
    assert torch.equal(flat_gpu.cpu(), rows_cpu.reshape(128, -1))
    assert torch.equal(fctx_gpu, ctx_gpu)


@pytest.mark.parametrize("ngram_size,heads,base,ple_index", [(3, 3, 5000, 1), (4, 2, 5000, 0)])
def test_one_token_per_sequence_batch_matches_per_sequence(ngram_size, heads, base, ple_index):
    """The PLE service hashes a decode step's tokens in one call (`ngram_rows_numpy_batch`)."""
    spec = _spec(_config(ngram_size, heads, base), ple_index)
    rng = np.random.default_rng(12)
    contexts = rng.integers(0, VOCAB, size=(9, ngram_size - 1), dtype=np.int64)
    contexts[2] = EOS
    contexts[3, -1] = EOS
    tokens = _stream(rng, 20, overflow=True)[:9]
    rows, new_ctx = ngram_rows_numpy_batch(spec, contexts, tokens)
    for b in range(9):
        exp_rows, exp_ctx = ngram_rows_numpy(spec, contexts[b], tokens[b:b + 1])
        np.testing.assert_array_equal(rows[b:b + 1], exp_rows)
        np.testing.assert_array_equal(new_ctx[b], exp_ctx)
