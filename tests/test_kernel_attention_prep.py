"""Attention decode prologue (norms, partial RoPE, cache writes, indexer query, gate sigmoid in one launch) against
its PyTorch reference on random inputs, and `GatedAttention`'s fused decode path against its own PyTorch path after
a prefill. Without CUDA the kernels run in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import pytest
import torch

pytest.importorskip("triton")

from stage_worker.kernels.attention_prep import PrepLayout, attention_decode_prep  # noqa: E402
from stage_worker.kernels.attention_prep_ref import attention_decode_prep_ref  # noqa: E402
from stage_worker.model.attention import GatedAttention  # noqa: E402
from stage_worker.model.batch import StepBatch  # noqa: E402
from stage_worker.model.cache import AttentionCache, CacheSpec  # noqa: E402
from stage_worker.model.rope import Rotary  # noqa: E402
from test_kernel_decode_attention import DEVICE, paged_tables, tiny_config  # noqa: E402


def _layout(nh, kvh, hd, rd, ni, di) -> PrepLayout:
    k_off = 2 * nh * hd
    v_off = k_off + kvh * hd
    iq_off = v_off + kvh * hd
    return PrepLayout(nh, kvh, hd, rd, 0, k_off, v_off, ni, di, iq_off if ni else 0, iq_off + ni * di if ni else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 2, 16, 8, 2, 16), (3, 1, 24, 12, 0, 0), (2, 2, 32, 16, 3, 16),
                                   pytest.param((24, 2, 256, 64, 32, 128), marks=pytest.mark.gpu)])
def test_prep_kernel_matches_reference(dtype, shape):
    nh, kvh, hd, rd, ni, di = shape
    L = _layout(*shape)
    g = torch.Generator().manual_seed(sum(shape))
    T, rows = 3, 40
    width = L.iq_off + ni * di + di if ni else L.v_off + kvh * hd
    proj = (torch.randn(T, width, generator=g) * 3).to(DEVICE, dtype)
    freqs = torch.rand(T, rd // 2, generator=g) * 50
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    slots = torch.randperm(rows, generator=g)[:T].to(DEVICE)
    w = [(torch.randn(n, generator=g) * 0.2).to(DEVICE, dtype) for n in (hd, hd, max(di, 1))]
    caches = [torch.randn(rows, kvh, hd, generator=g).to(DEVICE, dtype) for _ in range(2)]
    ik = torch.randn(rows, max(di, 1), generator=g).to(DEVICE, dtype)
    ref_caches, ref_ik = [c.clone() for c in caches], ik.clone()
    got = attention_decode_prep(proj, L, cos, sin, slots, w[0], w[1], *caches, 1e-6,
                                w[2] if ni else None, ik if ni else None)
    want = attention_decode_prep_ref(proj, L, cos, sin, slots, w[0], w[1], *ref_caches, 1e-6,
                                     w[2] if ni else None, ref_ik if ni else None)
    exact = dtype == torch.bfloat16      # every rounding point is reproduced: bf16 results are bit-equal
    for a, b in [(got[0], want[0]), (got[1], want[1]), (caches[0], ref_caches[0]), (caches[1], ref_caches[1]),
                 (ik, ref_ik)] + ([(got[2], want[2])] if ni else []):
        assert a.shape == b.shape
        if exact:
            # bf16: a one-ulp flip is possible where fp32 rsqrt/exp implementations differ; allow a few
            mism = (a.float() != b.float()).float().mean().item()
            assert mism < 0.01, mism
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[2] is None if not ni else got[2].shape == (T, ni, di)


def _copy_of(cache: AttentionCache, cfg, spec: CacheSpec) -> AttentionCache:
    """A second cache holding the same rows, for a second decode step from identical state."""
    twin = AttentionCache(cfg, spec)
    for name in ("k", "v", "index_keys", "pooled_keys"):
        if getattr(cache, name) is not None:
            getattr(twin, name).copy_(getattr(cache, name))
    return twin


ODD = dict(num_attention_heads=6, num_key_value_heads=2, indexer_n_heads=3, indexer_compress_ratio=3,
           indexer_budget=9)      # GQA group 3, ratio 3: nothing a power of two


@pytest.mark.parametrize("use_qsa,odd,bs", [(False, False, 8), (True, False, 8), (True, True, 48), (True, True, 18)],
                         ids=["dense", "qsa", "ratio3_page48", "ratio3_page18"])
def test_fused_decode_path_matches_pytorch_path(use_qsa, odd, bs, monkeypatch):
    """Prefill three sequences through the PyTorch path, then one decode step twice from identical caches: the
    fused path (one GEMV over views of the same weights, the prologue kernel, QSA and paged attention kernels)
    equals the PyTorch path, and both leave the same K/V rows behind; also with a QSA ratio of 3 and pages of 48
    (the size derived for it) and 18 tokens, which no kernel may assume to be powers of two."""
    torch.manual_seed(3)
    cfg = dataclasses.replace(tiny_config(), **(ODD if odd else {}))
    cfg.validate()
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    attn = GatedAttention(cfg, use_qsa, rotary).eval().to(DEVICE)
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    attn.prepare_kernels()
    assert all(torch.equal(before[k], v) for k, v in attn.state_dict().items())
    assert attn._fused_proj() is not None
    ctxs = [9, 21, 34] if bs == 8 else [9, 50, 101]       # past a page boundary, more blocks than the budget
    g = torch.Generator().manual_seed(5)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 2
    tables = paged_tables(ctxs, bs, num_blocks, g)
    spec = CacheSpec(num_blocks=num_blocks, block_size=bs, num_slots=3, device=DEVICE)
    cache = AttentionCache(cfg, spec)
    with torch.no_grad():
        pre = [(list(range(c - 1)), 0, i, tables[i]) for i, c in enumerate(ctxs)]
        batch = StepBatch.build(pre, bs, device=DEVICE)
        x = torch.randn(batch.token_ids.shape[0], cfg.hidden_size, generator=g).to(DEVICE)
        attn(x, batch, cache, rotary.cos_sin(batch.positions, x.dtype))
        dec = StepBatch.build([([7], c - 1, i, tables[i]) for i, c in enumerate(ctxs)], bs, device=DEVICE)
        xd = torch.randn(3, cfg.hidden_size, generator=g).to(DEVICE)
        rope = rotary.cos_sin(dec.positions, x.dtype)
        twin, twin2 = _copy_of(cache, cfg, spec), _copy_of(cache, cfg, spec)
        want = attn(xd, dec, cache, rope)                    # kernel flags off: the PyTorch path
        got = attn._decode_fused(xd, dec, twin, rope)
        attn.kernels = dataclasses.replace(attn.kernels, qsa_tiles=True)   # tiled selection, histograms zeroed
        # by the pool kernel: handed garbage, so a pool kernel that stopped zeroing them fails here
        from stage_worker.kernels import qsa
        monkeypatch.setattr(qsa, "empty_histograms", lambda b, d: torch.full(
            (b, qsa.radix_passes(qsa.RADIX_BITS) + 1, 1 << qsa.RADIX_BITS), 7, dtype=torch.int32, device=d))
        tiled = attn._decode_fused(xd, dec, twin2, rope)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tiled, want, rtol=1e-4, atol=1e-4)
    for name in ("k", "v", "index_keys"):
        if getattr(cache, name) is not None:
            torch.testing.assert_close(getattr(twin, name), getattr(cache, name), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_update_kernel_matches_reference(dtype):
    from stage_worker.kernels.attention_prep import qsa_pool_update
    from stage_worker.kernels.attention_prep_ref import qsa_pool_update_ref

    g = torch.Generator().manual_seed(9)
    bs, ratio, d, rd = 8, 4, 16, 8
    tables = torch.stack([torch.randperm(12, generator=g)[:5] for _ in range(3)]).int().to(DEVICE)
    lens = torch.tensor([5, 16, 37], dtype=torch.int32, device=DEVICE)       # partial, complete, far block
    index_keys = torch.randn(12 * bs, d, generator=g).to(DEVICE, dtype)
    w = (torch.randn(d, generator=g) * 0.3).to(DEVICE, dtype)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rd, 2).float() / rd))
    got = torch.zeros(12 * bs // ratio, d, dtype=dtype, device=DEVICE)
    want = got.clone()
    hist = torch.full((3, 5, 256), 7, dtype=torch.int32, device=DEVICE)    # zero= : the selection's histograms
    qsa_pool_update(index_keys, got, tables, lens, w, inv_freq.to(DEVICE), 1e-6, bs, ratio, rd, zero=hist)
    qsa_pool_update_ref(index_keys, want, tables, lens, w, inv_freq.to(DEVICE), 1e-6, bs, ratio, rd)
    assert (hist == 0).all()
    assert (got != 0).any(dim=1).sum().item() == 3            # one pooled row per sequence, nothing else
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
