"""Grouped MoE prefill kernels (stage_worker/kernels/moe_prefill.py) against the PyTorch reference.

Without CUDA they run under TRITON_INTERPRET=1 on small shapes (tl.dot needs 16 rows, so BLOCK_M is 16 there too).
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels import moe_prefill as P  # noqa: E402
from stage_worker.kernels.moe_ref import fused_moe_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    scores = torch.rand(t, e, generator=g)
    if skew:                                   # most pairs on a few experts: runs of several blocks, empty experts
        scores[:, :3] += 2.0
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return (x.to(DEV, dtype), ids.to(DEV), weights.to(DEV), w13.to(DEV, dtype), w2.to(DEV, dtype))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("t,e,k,h,i,dtype,skew", [
    (9, 8, 2, 32, 16, torch.float32, False),
    (40, 6, 3, 48, 24, torch.float32, True),      # H, I not multiples of the tiles; several blocks per expert
    (20, 16, 4, 32, 32, torch.bfloat16, False),
])
def test_grouped_kernels_match_the_reference(t, e, k, h, i, dtype, skew):
    x, ids, weights, w13, w2 = _case(t, e, k, h, i, dtype, seed=t + e, skew=skew)
    out = P.grouped_moe_triton(x, ids, weights, w13, w2)
    ref = fused_moe_ref(x, ids, weights, w13, w2)
    assert out.dtype == x.dtype and out.shape == ref.shape and torch.isfinite(out).all()
    assert _rel(out, ref) < (2e-3 if dtype == torch.float32 else 2e-2)


def test_align_puts_each_block_on_one_expert_and_every_pair_once():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, (50, 3), generator=g, dtype=torch.int32)
    ids[:, 0] = 2                                             # expert 2 needs several blocks; some get none
    bm = 16
    sorted_ids, block_expert = P.align(ids.to(DEV), 9, bm)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    tk = ids.numel()
    real = sorted_ids[sorted_ids < tk]
    assert sorted(real.tolist()) == list(range(tk))          # every pair exactly once
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < tk]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows.long()] == e).all())
    used = int((block_expert >= 0).sum())
    counts = torch.bincount(flat.long(), minlength=9)
    assert used == int(((counts + bm - 1) // bm).sum())


def test_fused_moe_takes_the_kernel_for_prefill_and_the_loop_without_it(monkeypatch):
    t, e, k = 80, 8, 4                                        # T*k > DECODE_MAX_TK: the prefill path
    x, ids, weights, w13, w2 = _case(t, e, k, 32, 16, torch.float32, seed=5)
    assert t * k > K.DECODE_MAX_TK
    calls = []
    real = P.grouped_moe_triton
    monkeypatch.setattr(P, "grouped_moe_triton", lambda *a: calls.append(1) or real(*a))
    with_kernel = K.fused_moe(x, ids, weights, w13, w2)
    assert calls == [1]
    without = K.fused_moe(x, ids, weights, w13, w2, prefill_kernel=False)
    assert calls == [1]
    assert _rel(with_kernel, without) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 512, 4096])
def test_real_shapes_on_gpu(t):
    """The full-shape MoE (H 2560, I 640, 512 experts, top-10) at prefill sizes: the kernels run without a host
    sync, agree with the per-expert loop they replace, and are timed beside it."""
    from conftest import cuda_us

    h, i, e, k = 2560, 640, 512, 10
    g = torch.Generator(device="cuda").manual_seed(t)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(t, k, device="cuda", generator=g), dim=-1).bfloat16()
    P.grouped_moe_triton(x, ids, weights, w13, w2)                 # compiled before the sync check
    torch.cuda.set_sync_debug_mode("error")                         # a host sync in the call raises
    try:
        out = P.grouped_moe_triton(x, ids, weights, w13, w2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loop = K.grouped_moe(x, ids, weights, w13, w2)
    assert _rel(out, loop) < 2e-2
    kernel_us = cuda_us(lambda: P.grouped_moe_triton(x, ids, weights, w13, w2))
    loop_us = cuda_us(lambda: K.grouped_moe(x, ids, weights, w13, w2), reps=5)
    print(f"T={t}: grouped kernels {kernel_us:.0f} us, per-expert loop {loop_us:.0f} us")
