"""The dense attention prefill through torch's scaled_dot_product_attention (kernel flag `sdpa_prefill`, named
only): the same attention as the eager scores and fp32 softmax of `GatedAttention._attend`, for full attention and
for QSA's selection masks, with grouped K/V heads and a batch of padded sequences. On the CPU `_attend_sdpa` is
called directly (the whole QSA prefill with the flag: tests/test_qsa.py); on a GPU (`-m gpu`) the whole prefill with
the flag on against off, and a long dense chunk timed both ways."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from shared.model_config import load_config
from stage_worker.kernels.flags import KernelFlags
from stage_worker.model.attention import GatedAttention
from stage_worker.model.rope import Rotary


def _layer(cfg, qsa: bool) -> GatedAttention:
    torch.manual_seed(0)
    return GatedAttention(cfg, qsa, Rotary(cfg.rotary_dim, cfg.rope_theta))


@pytest.mark.parametrize("lead", [(), (3,)])
def test_sdpa_attends_as_the_eager_scores_under_any_mask(tiny_checkpoint, lead):
    cfg = load_config(tiny_checkpoint)
    att = _layer(cfg, True)
    H, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    assert H > kvh                                   # grouped heads: each K/V head serves several query heads
    g = torch.Generator().manual_seed(1)
    q_len, ctx = 37, 150
    q = torch.randn(*lead, q_len, H, d, generator=g)
    k = torch.randn(*lead, ctx, kvh, d, generator=g)
    v = torch.randn(*lead, ctx, kvh, d, generator=g)
    pos = torch.arange(ctx - q_len, ctx)
    causal = torch.arange(ctx)[None, :] <= pos[:, None]
    # a QSA-like selection: random blocks of the past, always the query itself
    chosen = torch.rand(*lead, q_len, ctx, generator=g) < 0.3
    selected = causal & (chosen | (torch.arange(ctx)[None, :] == pos[:, None]))
    for visible in (causal.expand(*lead, q_len, ctx), selected):
        want = att._attend(q, k, v, visible)
        got = att._attend_sdpa(q, *att._per_head(k, v, q.dtype), visible)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_flag_is_in_all_and_can_be_turned_off():
    assert KernelFlags.parse("all").sdpa_prefill and not KernelFlags.parse("all,-sdpa_prefill").sdpa_prefill


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_prefill_with_sdpa_matches_the_eager_path_and_is_timed(tiny_checkpoint):
    """One QSA layer's dense prefill chunk at a long context on the GPU, bf16: the flag on against off (outputs
    within bf16 rounding of the probabilities), both timed (printed)."""
    from stage_worker.model.batch import StepBatch
    from stage_worker.model.cache import CacheSpec, ModelCache

    cfg = load_config(tiny_checkpoint)
    for qsa in (True, False):
        c = cfg if qsa else dataclasses.replace(cfg, layer_types=["full_attention" if t == "indexed_attention" else t
                                                                  for t in cfg.layer_types])
        layer = cfg.layer_types.index("indexed_attention")
        att = _layer(c, qsa).to("cuda", torch.bfloat16)
        q_len, ctx, bs = 2048, 16384, 16
        nb = ctx // bs
        cache = ModelCache(c, CacheSpec(num_blocks=nb + 1, block_size=bs, num_slots=2, device="cuda",
                                        dtype=torch.bfloat16), layer, layer + 1)
        ac = cache.attention[layer]
        for t in (ac.k, ac.v) + ((ac.index_keys,) if qsa else ()):
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
        if not qsa:
            ac.index_keys = ac.pooled_keys = None
        batch = StepBatch.build([(list(range(q_len)), ctx - q_len, 0, list(range(nb)))], bs, "cuda")
        batch.sparse_prefill = False
        x = torch.randn(q_len, c.hidden_size, device="cuda", dtype=torch.bfloat16)
        rope = att.rotary.cos_sin(batch.positions, x.dtype)
        outs, times = [], []
        for flags in ("all,-sdpa_prefill", "all"):
            att.kernels = KernelFlags.parse(flags)
            with torch.inference_mode():
                att(x, batch, ac, rope)                         # warm-up
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(3):
                    out = att(x, batch, ac, rope)
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / 3)
            outs.append(out.float())
        print(f"qsa {qsa}: a {q_len}-token chunk at context {ctx}: eager {times[0] * 1e3:.2f} ms, sdpa "
              f"{times[1] * 1e3:.2f} ms")
        torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)
