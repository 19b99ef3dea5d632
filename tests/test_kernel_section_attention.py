"""The fused section kernel (`kernels/section_attention.py`) against the PyTorch section loop it replaces
(`model/section_attention.attend_sections`): the selection's bits name exactly the listed keys, and the kernel gives
the loop's output over paged caches, several ragged sections, GQA groups of 2 and 3, queries that see nothing in most
sections, fp32 and fp16. Without CUDA the kernel runs in Triton's interpreter. GPU (`-m gpu`): the full shape
(24 query / 2 K/V heads of 256, budget 2048, host K/V) at 16k, 131k and 262k tokens: agreement, time, peak memory.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shared.model_config import Qwen4ExpConfig  # noqa: E402
from stage_worker.kernels.section_attention import attend_sections_fused  # noqa: E402
from stage_worker.model.attention import QSAIndexer  # noqa: E402
from stage_worker.model.section_attention import attend_sections, block_bits  # noqa: E402

if not torch.cuda.is_available():
    import stage_worker.kernels.section_attention as _kernels

    assert _kernels._INTERPRET, "the kernels were imported before TRITON_INTERPRET=1 was set: they cannot run here"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = 4


def _indexer(budget: int) -> QSAIndexer:
    cfg = Qwen4ExpConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.5, layer_types=["indexed_attention"], eos_token_id=[0],
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=budget,
        indexer_compress_ratio=RATIO, dtype="float32")
    return QSAIndexer(cfg)


def _case(first: int, queries: int, heads: int, kv_heads: int, d: int, budget: int, seed: int):
    """A chunk of `queries` tokens from position `first`, its QSA selection (the real rule, random scores) and
    a paged cache whose rows are in shuffled blocks of 8: (q, key_pos, valid, pos, rows, k, v)."""
    g = torch.Generator().manual_seed(seed)
    ctx = first + queries
    idx = _indexer(budget)
    pos = torch.arange(first, ctx)
    key_pos, valid = idx.selected_positions(torch.randn(queries, 2, 16, generator=g),
                                            torch.randn(ctx // RATIO, 16, generator=g), pos)
    n_blocks = -(-ctx // 8) + 3
    rows = (torch.randperm(n_blocks, generator=g)[:, None] * 8 + torch.arange(8)).flatten()[:ctx]
    k = torch.randn(n_blocks * 8, kv_heads, d, generator=g)
    v = torch.randn(n_blocks * 8, kv_heads, d, generator=g)
    q = torch.randn(queries, heads, d, generator=g)
    return q, key_pos, valid, pos, rows, k, v


def test_block_bits_name_exactly_the_listed_keys():
    """Bit (j // ratio) and j <= the query's position, over every key j, is the key list's mask: the lists hold
    whole complete blocks and the query's own block up to it. Blocks past bit 31 land in later words."""
    q, key_pos, valid, pos, *_ = _case(first=260, queries=40, heads=4, kv_heads=2, d=16, budget=16, seed=0)
    ctx = 300
    n_blocks = -(-ctx // RATIO)
    bits = block_bits(key_pos, valid, RATIO, n_blocks)
    assert bits.dtype == torch.int32 and bits.shape == (40, 3)
    j = torch.arange(ctx)
    b = j // RATIO
    got = ((bits[:, b // 32] >> (b % 32)) & 1).bool() & (j[None, :] <= pos[:, None])
    want = torch.zeros(40, ctx + 1, dtype=torch.bool).scatter_(1, torch.where(valid, key_pos, ctx), True)[:, :ctx]
    assert torch.equal(got, want)
    assert bool((bits < 0).any())                 # bit 31 set somewhere: the sign bit is a block like the others


@pytest.mark.parametrize("dtype,heads,kv_heads,d,first,section", [
    (torch.float32, 4, 2, 16, 160, 64), (torch.float16, 6, 2, 32, 160, 64), (torch.float32, 6, 2, 32, 0, 48),
    (torch.float16, 4, 2, 16, 90, 1000)])
def test_kernel_equals_the_section_loop(dtype, heads, kv_heads, d, first, section):
    """A 40-token chunk at the end of a 200-token context (or at its start: early queries see no key of later
    sections, and the chunk's own rows are the whole context; or in a 130-token one with one section), budget 8
    (each query reads 2 blocks and its tail, so most sections hold none of its keys), GQA groups of 2 and 3,
    sections of 64, 48 or all rows (ragged last sections), 16 x 16 tiles (several query and key tiles, a last query
    tile part empty)."""
    q, key_pos, valid, pos, rows, k, v = _case(first, 40, heads, kv_heads, d, budget=8, seed=first + d)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = d ** -0.5
    want = attend_sections(q.float(), key_pos, valid, rows, k.float(), v.float(), scale, section)
    bits = block_bits(key_pos, valid, RATIO, -(-(first + 40) // RATIO))
    dev = torch.device(DEVICE)
    got = attend_sections_fused(q.to(dev), bits.to(dev), pos.to(dev), rows.to(dev), k, v, scale, RATIO,
                                section=section, tiles=(16, 16, 4))
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.float().cpu() - want).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:                                         # the loop in fp16 against fp32 sets the scale of the rounding
        loop = attend_sections(q, key_pos, valid, rows, k, v, scale, section).float()
        assert err <= 2 * (loop - want).abs().max().item() + 1e-3, err


# ---- GPU: the full shape over host K/V -------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_full_shape_agreement_time_and_flat_memory():
    """A 512-token chunk at the end of 16k, 131k and 262k-token contexts over pinned host K/V (24 query / 2 K/V
    heads of 256, bf16), each query 512 random complete blocks and its tail: the kernel equals the PyTorch loop
    within bf16 rounding; printed: both times, the kernel without the side stream's overlap, and the peak memory
    the call adds, which may grow only by the bits (Q/8 bytes a compression block)."""
    from conftest import cuda_us

    Q, H, KVH, D, bs = 512, 24, 2, 256, 16
    longest = 262144
    g = torch.Generator(device="cuda").manual_seed(0)
    k_host = torch.randn(longest, KVH, D, dtype=torch.bfloat16).pin_memory()
    v_host = torch.randn(longest, KVH, D, dtype=torch.bfloat16).pin_memory()
    table = torch.randperm(longest // bs, device="cuda")
    peaks = {}
    for ctx in (16384, 131072, longest):
        rows = (table[: ctx // bs, None] * bs + torch.arange(bs, device="cuda")).flatten()
        pos = torch.arange(ctx - Q, ctx, device="cuda")
        complete = (pos + 1) // RATIO
        nb = ctx // RATIO
        score = torch.rand(Q, nb, device="cuda", generator=g)
        score = score.masked_fill(torch.arange(nb, device="cuda")[None, :] >= complete[:, None], -1.0)
        blocks = score.topk(512, dim=-1).indices.sort(-1).values              # distinct, all complete
        offs = torch.arange(RATIO, device="cuda")
        tail = complete[:, None] * RATIO + offs[: RATIO - 1]
        key_pos = torch.cat([(blocks[..., None] * RATIO + offs).flatten(1), tail], 1)
        valid = torch.cat([torch.ones(Q, 512 * RATIO, dtype=torch.bool, device="cuda"), tail <= pos[:, None]], 1)
        del score
        q = torch.randn(Q, H, D, device="cuda", generator=g).to(torch.bfloat16)
        scale = D ** -0.5
        bits = block_bits(key_pos, valid, RATIO, -(-ctx // RATIO))
        want = attend_sections(q, key_pos, valid, rows, k_host, v_host, scale)
        got = attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 0.02 * want.float().abs().max().item(), err
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO)
        torch.cuda.synchronize()
        peaks[ctx] = torch.cuda.max_memory_allocated() - base
        fused = cuda_us(lambda: attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO), 1, 3)
        serial = cuda_us(lambda: attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO,
                                                       overlap=False), 1, 3)
        loop = cuda_us(lambda: attend_sections(q, key_pos, valid, rows, k_host, v_host, scale), 1, 3)
        pcie = ctx * KVH * D * 2 * 2 / 50e9 * 1e6
        print(f"ctx {ctx}: fused {fused / 1e3:.1f} ms (no overlap {serial / 1e3:.1f}), loop {loop / 1e3:.1f} ms, "
              f"K/V over PCIe at 50 GB/s {pcie / 1e3:.1f} ms; max |diff| {err:.2e}; peak +{peaks[ctx] / 2**20:.0f} MiB")
    assert peaks[longest] - peaks[16384] <= (longest - 16384) // RATIO * Q // 8 + (1 << 20), peaks
