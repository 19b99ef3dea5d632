"""The fused section kernel (`kernels/section_attention.py`) against the PyTorch section loop it replaces
(`model/section_attention.attend_sections`): the selection's bits name exactly the listed keys, and the kernel gives
the loop's output over paged caches, several ragged sections, GQA groups of 2 and 3, queries that see nothing in most
sections, fp32 and fp16. Without CUDA the kernel runs in Triton's interpreter. GPU (`-m gpu`): the full shape
(24 query / 2 K/V heads of 256, budget 2048, host K/V) at 16k, 131k and 262k tokens: agreement, time, peak memory.

Union staging (kernel flag `section_union`: only the union of the chunk's selected blocks is staged, compacted):
the plan names exactly the listed blocks, and the kernel and the loop over the union equal the whole-context paths
for planted far-away blocks, chunks at the start of the context, contexts not a multiple of the compression ratio,
and a batch of prompts of different lengths through the model; GPU: union against whole staging at full shape.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shared.model_config import Qwen4ExpConfig  # noqa: E402
from stage_worker.kernels.section_attention import attend_sections_fused  # noqa: E402
from stage_worker.model.attention import QSAIndexer  # noqa: E402
from stage_worker.model.section_attention import (  # noqa: E402
    attend_sections, block_bits, compact_positions, compact_rows, union_plan)

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


# ---- union staging (`section_union`) ---------------------------------------------------------------------------------

def _planted(first: int, queries: int, far: list[int], seed: int, extra: int = 1):
    """A chunk of `queries` tokens from position `first` whose selection has the form `selected_positions` gives
    (chosen complete blocks ascending, padded with the spare block, then the tail up to the query): every query
    picks the planted `far` blocks it can see plus `extra` random blocks among the last 8 complete ones. Returns
    (key_pos, valid, pos, the union's block ids)."""
    g = torch.Generator().manual_seed(seed)
    ctx = first + queries
    nb = -(-ctx // RATIO)
    width = len(far) + extra
    pos = torch.arange(first, ctx)
    key_pos, valid, union = [], [], set()
    offs = torch.arange(RATIO)
    for p in pos.tolist():
        complete = (p + 1) // RATIO
        near = torch.randperm(min(8, complete), generator=g)[:extra] + max(0, complete - 8)
        chosen = sorted({b for b in far if b < complete} | set(near.tolist()))
        blocks = torch.tensor(chosen + [nb] * (width - len(chosen)), dtype=torch.long)
        tail = complete * RATIO + offs[: RATIO - 1]
        key_pos.append(torch.cat([(blocks[:, None] * RATIO + offs).flatten(), tail]))
        valid.append(torch.cat([(blocks < nb).repeat_interleave(RATIO), tail <= p]))
        union |= set(chosen) | ({complete} if complete * RATIO <= p else set())
    return torch.stack(key_pos), torch.stack(valid), pos, sorted(union)


def test_union_plan_names_exactly_the_listed_blocks():
    """Far-away planted blocks (0, 3, 40 in a 1,030-token context: not a multiple of the ratio) and each query's
    recent block and tail: the plan's blocks are the union, ascending; the prefix counts them; the compacted rows
    are the blocks' cache rows (the last block's rows past the context repeat the last row) and every listed key
    maps to the arena row holding its cache row."""
    first, queries = 990, 40
    key_pos, valid, pos, union = _planted(first, queries, far=[0, 3, 40], seed=1)
    ctx = first + queries
    rows = torch.randperm(ctx + 50)[:ctx]
    bits = block_bits(key_pos, valid, RATIO, -(-ctx // RATIO))
    plan = union_plan(bits, RATIO, ctx)
    assert plan.blocks.tolist() == union and plan.keys == len(union) * RATIO < ctx // 8
    assert plan.prefix.dtype == torch.int32 and plan.prefix[-1].item() == len(union)
    assert plan.prefix[torch.tensor(union)].tolist() == list(range(1, len(union) + 1))
    arena = compact_rows(rows, plan, RATIO)
    want = (torch.tensor(union)[:, None] * RATIO + torch.arange(RATIO)).flatten().clamp(max=ctx - 1)
    assert torch.equal(arena, rows[want])
    kp = key_pos[valid]
    assert torch.equal(arena[compact_positions(kp, plan, RATIO)], rows[kp])


def test_union_plan_cost_on_cpu():
    """The plan's cost at the full shape's sizes (512 queries, 262k tokens at ratio 4: 2,048 words of bits a
    query, a union of ~10k blocks) on this CPU, the host read of its size included; printed."""
    import time

    g = torch.Generator().manual_seed(0)
    ctx, q = 262144, 512
    pool = torch.randperm(ctx // RATIO, generator=g)[:10240]               # the chunk's queries share 10k blocks
    blocks = pool[torch.rand(q, pool.shape[0], generator=g).topk(512, dim=1).indices]
    bits = block_bits(blocks * RATIO, torch.ones_like(blocks, dtype=torch.bool), RATIO, ctx // RATIO)
    union_plan(bits, RATIO, ctx)
    t = time.perf_counter()
    plan = union_plan(bits, RATIO, ctx)
    ms = (time.perf_counter() - t) * 1e3
    print(f"union_plan at 262k tokens, 512 queries: {ms:.2f} ms on the CPU, union {plan.keys} of {ctx} rows")
    assert plan.keys == 10240 * RATIO
    assert ms < 200


@pytest.mark.parametrize("dtype,first,queries,far,section", [
    (torch.float32, 1000, 40, [0, 1, 70, 200], 64),     # far blocks; context 1,040
    (torch.float32, 1001, 37, [2, 5, 99], 96),          # context 1,038: not a multiple of the ratio
    (torch.float16, 0, 40, [], 16),                      # the chunk at the start: its own rows are the context
    (torch.float32, 3, 30, [0], 1000),                   # near the start, 33 tokens, one section
    (torch.float16, 600, 50, [1, 140], 32)])
def test_union_staging_equals_whole_staging_and_the_loop(dtype, first, queries, far, section):
    """Planted far-away blocks: the kernel with `union` stages only the union's rows (counted at the gather) and
    equals the kernel over the whole context and the loop (whole and union) within rounding. The whole-context
    run, the reference here, takes 64 x 64 tiles (16 x 16 over a 1,000-token context: ~75% of the test's time
    in the interpreter; small tiles over the whole context are test_kernel_equals_the_section_loop's)."""
    import stage_worker.kernels.section_attention as fused

    key_pos, valid, pos, union = _planted(first, queries, far, seed=first + queries)
    ctx = first + queries
    heads, kv_heads, d = 6, 2, 16
    g = torch.Generator().manual_seed(ctx)
    n_blocks = -(-ctx // 8) + 3
    rows = (torch.randperm(n_blocks, generator=g)[:, None] * 8 + torch.arange(8)).flatten()[:ctx]
    k = torch.randn(n_blocks * 8, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(n_blocks * 8, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(queries, heads, d, generator=g).to(dtype)
    scale = d ** -0.5
    want = attend_sections(q.float(), key_pos, valid, rows, k.float(), v.float(), scale, section)
    loop_union = attend_sections(q.float(), key_pos, valid, rows, k.float(), v.float(), scale, section, RATIO)
    assert (loop_union - want).abs().max().item() < 1e-5
    bits = block_bits(key_pos, valid, RATIO, -(-ctx // RATIO))
    dev = torch.device(DEVICE)
    staged = []
    real = fused._gather
    fused._gather = lambda src, r, out: staged.append(r.shape[0]) or real(src, r, out)
    try:
        run = [attend_sections_fused(q.to(dev), bits.to(dev), pos.to(dev), rows.to(dev), k, v, scale, RATIO,
                                     section=section, tiles=(16, 16, 4) if u else (64, 64, 4), union=u).float().cpu()
               for u in (False, True)]
    finally:
        fused._gather = real
    assert sum(staged) == 2 * (ctx + len(union) * RATIO)                  # K and V: the whole context, the union
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (run[1] - run[0]).abs().max().item() < tol
    assert (run[1] - want).abs().max().item() < tol


def test_batch_of_prompts_through_the_model_with_union_staging(tmp_path):
    """Three prompts of different lengths (230, 157 and 45 tokens: not multiples of the ratio or the block) in
    64-token chunks over host K/V with `section_attention` and `section_union` (the kernel in the interpreter):
    the tokens and logits of the in-memory run within 1e-5, and every host-section chunk staged only its union."""
    import stage_worker.kernels.section_attention as fused
    from hf_oracle import save_reference
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.local_engine import LocalEngine
    from stage_worker.model.attention import GatedAttention
    from test_qsa_kv_offload import BLOCK, _greedy, _prompt

    if not torch.cuda.is_available() and not fused._INTERPRET:
        pytest.skip("the kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    save_reference("qwen4_exp", tmp_path)
    model = load_model(tmp_path, LoadOptions(dtype=torch.float32))
    prompts = [_prompt(230, 1), _prompt(157, 2), _prompt(45, 3)]
    want, want_tokens = _greedy(LocalEngine([model], block_size=BLOCK, max_seqs=4, max_tokens=512), prompts, 64, 6)
    unions = []
    real = fused.attend_sections_fused
    fused.attend_sections_fused = lambda *a, **k: unions.append(k.get("union")) or real(*a, **k)
    try:
        GatedAttention.interpret_on_cpu = True
        model.set_kernels(KernelFlags.parse("section_attention,section_union"))
        engine = LocalEngine([model], block_size=BLOCK, max_seqs=4, max_tokens=512, kv_offload=True)
        got, got_tokens = _greedy(engine, prompts, 64, 6)
    finally:
        fused.attend_sections_fused = real
        GatedAttention.interpret_on_cpu = False
    assert unions and all(unions) and got_tokens == want_tokens
    assert (got - want).abs().max().item() < 1e-5


# ---- GPU: the full shape over host K/V -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("pool", [0, 2048])
def test_gpu_full_shape_agreement_time_and_flat_memory(pool):
    """A 512-token chunk at the end of 16k, 131k and 262k-token contexts over pinned host K/V (24 query / 2 K/V
    heads of 256, bf16), each query 512 complete blocks and its tail: random over the context (`pool` 0: the
    worst case for union staging, whose union is most of the context at 262k) or drawn from 2,048 blocks the
    chunk's queries share (`pool` 2048: neighbouring queries select overlapping blocks). The kernel equals the
    PyTorch loop within bf16 rounding, staging the whole context and staging the union (`section_union`); printed:
    the times (whole, whole without the side stream's overlap, union, loop), the union's rows and the K/V bytes
    each stages, and the peak memory the call adds, which may grow only by the bits (Q/8 bytes a compression
    block) staging the whole context, and by the union's indices and the plan's scratch (32 bytes a context row at
    most) staging the union."""
    from conftest import cuda_us

    Q, H, KVH, D, bs = 512, 24, 2, 256, 16
    longest = 262144
    g = torch.Generator(device="cuda").manual_seed(0)
    k_host = torch.randn(longest, KVH, D, dtype=torch.bfloat16).pin_memory()
    v_host = torch.randn(longest, KVH, D, dtype=torch.bfloat16).pin_memory()
    table = torch.randperm(longest // bs, device="cuda")
    peaks, union_peaks = {}, {}
    row_bytes = KVH * D * 2 * 2                                               # K and V, bf16
    for ctx in (16384, 131072, longest):
        rows = (table[: ctx // bs, None] * bs + torch.arange(bs, device="cuda")).flatten()
        pos = torch.arange(ctx - Q, ctx, device="cuda")
        complete = (pos + 1) // RATIO
        nb = ctx // RATIO
        score = torch.rand(Q, nb, device="cuda", generator=g)
        if pool:                                  # only the shared pool's blocks can win (all complete)
            shared = torch.randperm(int(complete[0]), device="cuda", generator=g)[:pool]
            keep = torch.zeros(nb, dtype=torch.bool, device="cuda").index_fill_(0, shared, True)
            score = score.masked_fill(~keep[None, :], -0.5)
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
        got_u = attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO, union=True)
        err = (got.float() - want.float()).abs().max().item()
        err_u = (got_u.float() - want.float()).abs().max().item()
        assert max(err, err_u) <= 0.02 * want.float().abs().max().item(), (err, err_u)
        plan = union_plan(bits, RATIO, ctx)
        for union, out in ((False, peaks), (True, union_peaks)):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO, union=union)
            torch.cuda.synchronize()
            out[ctx] = torch.cuda.max_memory_allocated() - base
        fused = cuda_us(lambda: attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO), 1, 3)
        serial = cuda_us(lambda: attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO,
                                                       overlap=False), 1, 3)
        union = cuda_us(lambda: attend_sections_fused(q, bits, pos, rows, k_host, v_host, scale, RATIO,
                                                      union=True), 1, 3)
        plan_us = cuda_us(lambda: union_plan(bits, RATIO, ctx), 1, 3)
        loop = cuda_us(lambda: attend_sections(q, key_pos, valid, rows, k_host, v_host, scale), 1, 3)
        pcie = ctx * row_bytes / 50e9 * 1e6
        print(f"pool {pool or 'none'} ctx {ctx}: whole {fused / 1e3:.1f} ms (no overlap {serial / 1e3:.1f}), "
              f"union {union / 1e3:.1f} ms (plan {plan_us / 1e3:.2f}), loop {loop / 1e3:.1f} ms; union "
              f"{plan.keys} of {ctx} rows ({plan.keys / ctx:.1%}): staged {plan.keys * row_bytes / 2**20:.0f} of "
              f"{ctx * row_bytes / 2**20:.0f} MiB, K/V of the whole context over PCIe at 50 GB/s {pcie / 1e3:.1f} ms"
              f"; max |diff| {err:.2e} / union {err_u:.2e}; peak +{peaks[ctx] / 2**20:.0f} MiB / union "
              f"+{union_peaks[ctx] / 2**20:.0f} MiB")
    assert peaks[longest] - peaks[16384] <= (longest - 16384) // RATIO * Q // 8 + (1 << 20), peaks
    assert union_peaks[longest] - union_peaks[16384] <= (longest - 16384) * (Q // 8 // RATIO + 32) + (1 << 20), \
        union_peaks
