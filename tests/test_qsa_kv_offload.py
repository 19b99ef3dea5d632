"""QSA K/V in host RAM (`qsa_kv_offload`, issue 18): where the rows live, what a block costs per tier, and that the
model computes exactly what it computes with every row in the device's memory.

CPU: the host pool is a CPU tensor (one exact-size allocation, `stage_worker.host_memory`), so the switch must not
change a single logit: chunked prefill, the sparse prefill path (context > 16 x the keys a query reads), a QSA
budget that binds, decode. The row kernels (`kernels/kv_rows.py`) run in Triton's interpreter against plain
indexing. GPU (`-m gpu`): the decode kernels read host rows through their UVA addresses and must give the in-VRAM
kernels' output bit for bit, eagerly and replayed from CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_oracle import save_reference
from shared.cluster_config import ClusterConfig, StageSpec, env_overrides
from shared.kv_layout import block_bytes, host_block_bytes, host_row_bytes, stage_block_cost
from shared.memory_plan import GIB, DeviceMemory, MemoryPlanError, PlanLimits, StageNeeds, plan
from shared.model_config import load_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine
from stage_worker.model.attention import SPARSE_PREFILL_FACTOR
from stage_worker.model.cache import CacheSpec, ModelCache

BLOCK = 8


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref_qwen4_offload")
    save_reference("qwen4_exp", path)
    return path, load_config(path)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 320, (n,), generator=g).tolist()
    ids[40] = 5                                            # an EOS inside (PLE hash reset)
    return ids


def _greedy(engine: LocalEngine, prompts: list[list[int]], chunk: int, steps: int):
    """Chunked prefill of every prompt (one step per chunk, all prompts in it), then greedy decode of all together:
    the logits of every fed position and decode step, and the tokens chosen."""
    for i in range(len(prompts)):
        engine.add(i)
    logits, last = [], {}
    for a in range(0, max(len(p) for p in prompts), chunk):
        feeds = [(i, p[a:a + chunk]) for i, p in enumerate(prompts) if p[a:a + chunk]]
        out = engine.step(feeds, all_logits=True)
        logits.append(out)
        end = 0
        for i, toks in feeds:
            end += len(toks)
            last[i] = out[end - 1]
    tokens = [[] for _ in prompts]
    out = torch.stack([last[i] for i in range(len(prompts))])
    for _ in range(steps):
        nxt = out.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            tokens[i].append(t)
        out = engine.step([(i, [t]) for i, t in enumerate(nxt)])
        logits.append(out)
    return torch.cat(logits), tokens


@pytest.mark.parametrize("chunk", [7, 64])
def test_offload_gives_the_same_logits_and_tokens(qwen4, chunk):
    """Two prompts (230 and 100 tokens) prefilled together in chunks, then 12 greedy decode steps: with the QSA K/V
    in the host pool (prefill reading it section by section) every logit is the in-memory run's within 1e-5 and
    the greedy tokens are the same (the budget of 8 keys binds from position 12 on; without the switch the long
    prompt's late chunks take the gather path, with it every chunk the section loop)."""
    path, cfg = qwen4
    model = load_model(path, LoadOptions(dtype=torch.float32))
    assert 230 > SPARSE_PREFILL_FACTOR * (cfg.indexer_budget + cfg.indexer_compress_ratio - 1)
    prompts = [_prompt(230, 1), _prompt(100, 2)]
    runs = {}
    for offload in (False, True):
        engine = LocalEngine([model], block_size=BLOCK, max_seqs=3, max_tokens=256, kv_offload=offload)
        runs[offload] = _greedy(engine, prompts, chunk, 12)
        cache = engine.caches[0]
        if offload:
            # every QSA layer's K, V and raw indexer keys are views of the one host allocation; pooled keys are not
            lo = cache.host.tensor.data_ptr()
            hi = lo + cache.host.nbytes
            for layer in cache.attention.values():
                for t in (layer.k, layer.v, layer.index_keys):
                    assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
                assert not lo <= layer.pooled_keys.data_ptr() < hi
        else:
            assert cache.host is None
    (want, want_tokens), (got, got_tokens) = runs[False], runs[True]
    assert got_tokens == want_tokens
    # prefill over host K/V merges context sections (section_attention.py): the same keys, summed in another order
    assert (got - want).abs().max().item() < 1e-5


def test_offload_with_the_fused_section_kernel(qwen4, monkeypatch):
    """Kernel `section_attention` on (`kernels/section_attention.py`, run by Triton's interpreter on the CPU): the
    same two prompts in 64-token chunks and 12 greedy steps give the in-memory run's tokens and logits within 1e-5,
    and every prefill chunk over host K/V went through the kernel."""
    pytest.importorskip("triton")
    import stage_worker.kernels.section_attention as fused
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.attention import GatedAttention

    if not fused._INTERPRET:
        pytest.skip("the kernel runs on CPU tensors only under TRITON_INTERPRET=1 (set where there is no GPU)")
    path, _ = qwen4
    model = load_model(path, LoadOptions(dtype=torch.float32))
    prompts = [_prompt(230, 1), _prompt(100, 2)]
    want, want_tokens = _greedy(LocalEngine([model], block_size=BLOCK, max_seqs=3, max_tokens=256), prompts, 64, 12)
    calls = []
    real = fused.attend_sections_fused
    monkeypatch.setattr(fused, "attend_sections_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(GatedAttention, "interpret_on_cpu", True)
    model.set_kernels(KernelFlags.parse("section_attention"))
    engine = LocalEngine([model], block_size=BLOCK, max_seqs=3, max_tokens=256, kv_offload=True)
    got, got_tokens = _greedy(engine, prompts, 64, 12)
    assert calls and got_tokens == want_tokens
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("section", [5, 16, 1000])
def test_section_loop_equals_gathering_the_selected_rows(qwen4, section):
    """The loop swap on its own: a 300-token context in a paged cache, a 40-token chunk at its end (and one at its
    start, whose early queries see no key in most sections), attention merged over sections of 5, 16 or all rows
    equals attention over each query's gathered keys (`_attend_selected`) within float32 rounding."""
    from stage_worker.model.attention import GatedAttention
    from stage_worker.model.cache import AttentionCache
    from stage_worker.model.rope import Rotary
    from stage_worker.model.section_attention import attend_sections

    _, cfg = qwen4
    torch.manual_seed(0)
    attn = GatedAttention(cfg, True, Rotary(cfg.rotary_dim, cfg.rope_theta)).eval()
    idx = attn.indexer
    cache = AttentionCache(cfg, CacheSpec(num_blocks=40, block_size=BLOCK, num_slots=1))
    g = torch.Generator().manual_seed(section)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    rows = torch.randperm(40, generator=g)[:38].repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(38)
    ctx = 300
    rows = rows[:ctx]
    pooled = torch.randn(ctx // idx.ratio, idx.head_dim, generator=g)
    for first in (ctx - 40, 0):
        pos = torch.arange(first, first + 40)
        q = torch.randn(40, attn.n_heads, attn.head_dim, generator=g)
        iq = torch.randn(40, idx.n_heads, idx.head_dim, generator=g)
        key_pos, valid = idx.selected_positions(iq, pooled[: (first + 40) // idx.ratio], pos)
        n = first + 40
        got = attend_sections(q, key_pos, valid, rows[:n], cache.k, cache.v, attn.scale, section)
        want = attn._attend_selected(q, iq, pooled[: n // idx.ratio], pos, rows[:n], cache)
        assert (got - want).abs().max().item() < 1e-5


def test_block_cost_by_tier(qwen4):
    """With the switch a QSA layer's block costs only its pooled keys on the device and its K/V rows and raw
    indexer keys on the host; the bytes a ModelCache allocates are those (to the host pool's alignment)."""
    _, cfg = qwen4
    n_attn = sum(cfg.is_attention(i) for i in range(cfg.num_hidden_layers))
    pooled = BLOCK // cfg.indexer_compress_ratio * cfg.indexer_head_dim * 4
    row = (2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim) * 4
    assert host_row_bytes(cfg, "float32") == row
    end = cfg.num_hidden_layers
    assert block_bytes(cfg, 0, end, BLOCK, "float32", kv_offload=True) == n_attn * pooled
    assert block_bytes(cfg, 0, end, BLOCK, "float32") == n_attn * (pooled + BLOCK * row)
    assert host_block_bytes(cfg, 0, end, BLOCK, "float32", True) == n_attn * BLOCK * row
    assert host_block_bytes(cfg, 0, end, BLOCK, "float32", False) == 0
    # a GPU stage's budget counts the device tier; a CPU stage's both (the same RAM)
    assert stage_block_cost(cfg, 0, end, BLOCK, "float32", "cuda:0", True) == n_attn * pooled
    assert stage_block_cost(cfg, 0, end, BLOCK, "float32", "cpu", True) == block_bytes(cfg, 0, end, BLOCK, "float32")
    blocks = 9
    on = ModelCache(cfg, CacheSpec(num_blocks=blocks, block_size=BLOCK, num_slots=2, kv_offload=True))
    off = ModelCache(cfg, CacheSpec(num_blocks=blocks, block_size=BLOCK, num_slots=2))
    assert on.kv_bytes() == off.kv_bytes() == blocks * block_bytes(cfg, 0, end, BLOCK, "float32")
    assert on.kv_host_bytes() == blocks * host_block_bytes(cfg, 0, end, BLOCK, "float32", True)
    assert on.host.nbytes >= on.kv_host_bytes() and off.kv_host_bytes() == 0
    # the full shape: 2 KiB of K/V and 256 B of raw indexer key a token and layer move out, 64 B of pooled key stay
    full = dataclasses.replace(cfg, num_key_value_heads=2, head_dim=256, indexer_head_dim=128)
    assert block_bytes(full, 0, end, 16, "bfloat16", True) * 37 == block_bytes(full, 0, end, 16, "bfloat16")


def test_layers_without_an_indexer_keep_their_kv(qwen4):
    """The switch moves only QSA layers' K/V: a model without indexers (as Qwen3-Next, Qwen3.5-MoE, the MTP block)
    allocates nothing on the host and costs what it cost."""
    from stage_worker.model.cache import _without_qsa

    _, cfg = qwen4
    plain = _without_qsa(cfg)
    cache = ModelCache(plain, CacheSpec(num_blocks=4, block_size=BLOCK, num_slots=2, kv_offload=True))
    assert cache.host is None and cache.kv_host_bytes() == 0
    assert not any(a.host_kv for a in cache.attention.values())
    end = cfg.num_hidden_layers
    assert block_bytes(plain, 0, end, BLOCK, "float32", True) == block_bytes(plain, 0, end, BLOCK, "float32") > 0
    assert host_block_bytes(plain, 0, end, BLOCK, "float32", True) == 0
    for device in ("cpu", "cuda:0"):                     # the KV sizes resolve as without the switch
        c = ClusterConfig(model="m", stages=[StageSpec(0, end, "ipc:///tmp/s0", device)], gateway_endpoint="g",
                          max_model_len=256, qsa_kv_offload=True)
        assert c.for_model(plain).num_blocks == dataclasses.replace(c, qsa_kv_offload=False).for_model(
            plain).num_blocks > 0


def test_meta_cache_allocates_nothing(qwen4):
    """The memory plan builds caches on the meta device: with the switch nothing is allocated on the host."""
    _, cfg = qwen4
    cache = ModelCache(cfg, CacheSpec(num_blocks=0, block_size=BLOCK, num_slots=2, device="meta", kv_offload=True))
    assert cache.host is None and all(a.k.device.type == "meta" for a in cache.attention.values())


def test_switch_in_config_env_and_cli(qwen4, monkeypatch):
    """`qsa_kv_offload`: off by default, MOEPIPE_QSA_KV_OFFLOAD and --qsa-kv-offload turn it on; with it a GPU
    cluster fits more blocks in the same KV budget (the device tier's cost), a CPU one the same."""
    from gateway.cli import build_parser, serve_options

    path, cfg = qwen4
    monkeypatch.delenv("MOEPIPE_QSA_KV_OFFLOAD", raising=False)
    assert env_overrides().get("qsa_kv_offload") is None
    monkeypatch.setenv("MOEPIPE_QSA_KV_OFFLOAD", "1")
    assert env_overrides()["qsa_kv_offload"] is True
    monkeypatch.setenv("MOEPIPE_QSA_KV_OFFLOAD", "off")
    assert env_overrides()["qsa_kv_offload"] is False
    monkeypatch.delenv("MOEPIPE_QSA_KV_OFFLOAD")
    args = build_parser().parse_args(["serve", "--model", str(path), "--qsa-kv-offload"])
    assert serve_options(args).extra["qsa_kv_offload"] is True
    args = build_parser().parse_args(["serve", "--model", str(path)])
    assert "qsa_kv_offload" not in serve_options(args).extra

    def blocks(device: str, offload: bool) -> int:
        c = ClusterConfig(model=str(path), stages=[StageSpec(0, cfg.num_hidden_layers, "ipc:///tmp/s0", device)],
                          gateway_endpoint="ipc:///tmp/g", kv_cache_memory=0.01, max_num_seqs=64,
                          max_model_len=1024, qsa_kv_offload=offload)
        return c.for_model(cfg).num_blocks

    assert blocks("cuda:0", True) > 4 * blocks("cuda:0", False)
    assert blocks("cpu", True) == blocks("cpu", False)


def test_memory_plan_counts_host_kv():
    """The plan gives the KV pool what the device tier leaves (blocks of pooled keys only) and caps it by the host
    RAM the host tier may take; a host that cannot hold one max_model_len sequence is refused with the numbers."""
    need = StageNeeds(stage=0, layers=(0, 4), device="cuda:0", weights=10 * GIB, state=GIB, block=4096,
                      reserve=GIB, host_block=1 << 20)
    devices = {"cuda:0": DeviceMemory(total=40 * GIB, free=40 * GIB)}
    limits = PlanLimits(block_size=16, max_model_len=16 * 1024, max_num_seqs=128, host_kv_bytes=100 * GIB)
    p = plan([need], devices, limits)
    assert p.num_blocks == 100 * 1024 - 1                       # the host bound: 100 GiB of 1 MiB blocks, + scratch
    assert "host" in p.table() and f"{(p.num_blocks + 1) / 1024:.2f}" in p.table()
    roomy = dataclasses.replace(limits, host_kv_bytes=10_000 * GIB)
    assert plan([need], devices, roomy).num_blocks == 128 * 1024           # the request bound
    tight = dataclasses.replace(limits, host_kv_bytes=GIB // 2)
    with pytest.raises(MemoryPlanError, match="host RAM"):
        plan([need], devices, tight)


# ---- the row kernels (interpreter on the CPU) ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16), (16,), (3, 7)])
def test_row_kernels_match_indexing(dtype, shape):
    pytest.importorskip("triton")
    from stage_worker.kernels.kv_rows import gather_rows, scatter_rows
    from stage_worker.kernels.kv_rows_ref import gather_rows_ref, scatter_rows_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(len(shape))
    cache = torch.randn(50, *shape, generator=g).to(dtype)
    rows = torch.randint(0, 50, (23,), generator=g)                     # repeats allowed in a gather
    host = cache.pin_memory() if dev == "cuda" else cache.clone()       # the GPU reads it over PCIe
    got = gather_rows(host, rows.to(dev))
    assert got.device.type == dev and torch.equal(got.cpu(), gather_rows_ref(cache, rows))
    new_rows = torch.randperm(50, generator=g)[:11]
    values = torch.randn(11, *shape, generator=g).to(dtype)
    want = cache.clone()
    scatter_rows_ref(want, new_rows, values)
    scatter_rows(host, new_rows.to(dev), values.to(dev))
    if dev == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host, want)
    with pytest.raises(ValueError, match="do not match"):
        scatter_rows(host, new_rows.to(dev), values[:, :1].to(dev).contiguous())


def test_needs_and_launcher_plan_count_host_kv(qwen4, tmp_path, monkeypatch):
    """`memory_needs` counts a QSA stage's block at its device tier and the host tier apart; the launcher's plan
    bounds the pool by the host RAM the needs process reports (less cold experts and headroom), and refuses when
    that cannot hold one sequence. The needs process's reply is stood in for (no CUDA device here)."""
    import json
    import subprocess

    from gateway import launcher
    from stage_worker.memory_needs import stage_needs

    path, cfg = qwen4
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(path), gateway_endpoint="", max_num_seqs=4, block_size=16, max_model_len=256,
                            stages=[StageSpec(0, n, "", "cuda:0")], measure_reserve=False, qsa_kv_offload=True)
    (need,) = stage_needs(cfg, cluster)
    assert need.block == block_bytes(cfg, 0, n, 16, "float32", True) > 0
    assert need.host_block == host_block_bytes(cfg, 0, n, 16, "float32", True) > need.block
    (plain,) = stage_needs(cfg, dataclasses.replace(cluster, qsa_kv_offload=False))
    assert plain.host_block == 0 and plain.block == need.block + need.host_block

    def reply(host_available: int):
        def run(cmd, **kw):
            out = {"stages": [vars(need)], "devices": {"cuda:0": {"total": 24 * GIB, "free": 23 * GIB}},
                   "host_available": host_available}
            return subprocess.CompletedProcess(cmd, 0, json.dumps(out), "")
        return run

    monkeypatch.setattr(launcher.subprocess, "run", reply(64 * GIB))
    assert launcher.memory_plan(cluster, tmp_path / "cluster.toml").num_blocks == 256 // 16 * 4
    # 40 blocks past the headroom and the prefix cache's saved states in host RAM: 39 and the scratch
    assert need.host_state == need.state // 5 * 16 > 0
    room = 2 * GIB + need.host_state + 40 * need.host_block
    monkeypatch.setattr(launcher.subprocess, "run", reply(room))
    assert launcher.memory_plan(cluster, tmp_path / "cluster.toml").num_blocks == 39
    monkeypatch.setattr(launcher.subprocess, "run", reply(2 * GIB + need.host_state + 10 * need.host_block))
    with pytest.raises(RuntimeError, match="host RAM: .* one sequence of --max-model-len 256 needs 16"):
        launcher.memory_plan(cluster, tmp_path / "cluster.toml")


# ---- GPU: the kernels over host rows (UVA) equal the kernels over device rows, bit for bit -------------------------

def _full_head_cfg(budget: int = 2048):
    """One QSA layer at the full shape's attention dimensions (16 query heads of 256, 2 K/V heads, indexer 32 x 128,
    ratio 4), bf16."""
    from shared.model_config import Qwen4ExpConfig

    cfg = Qwen4ExpConfig(
        vocab_size=64, hidden_size=1024, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, partial_rotary_factor=0.25, layer_types=["indexed_attention"], eos_token_id=[0],
        indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=budget,
        indexer_compress_ratio=4, dtype="bfloat16")
    cfg.validate()
    return cfg


@pytest.mark.gpu
def test_gpu_decode_attention_over_host_kv_is_bit_identical():
    """Fresh random caches (70k, 5k and 300 tokens, shuffled paged tables), far-away blocks planted so the indexer
    must pick them: selection, the pool update reading raw keys from host RAM, and split-K attention reading the
    selected K/V rows from host RAM give exactly the in-VRAM results, with one split and with several. (The
    prologue's writes over PCIe: `test_gpu_layer_over_host_kv_equals_in_vram`.)"""
    from stage_worker.kernels.attention_prep import qsa_pool_update
    from stage_worker.kernels.decode_attention import paged_decode_attention
    from stage_worker.kernels.qsa import qsa_select

    cfg = _full_head_cfg()
    bs, r, budget = 16, 4, 2048
    ctxs = [70_000, 5_000, 300]
    g = torch.Generator().manual_seed(7)
    blocks = sum(-(-c // bs) for c in ctxs) + 2
    pool = torch.randperm(blocks, generator=g).tolist()
    tables, start = [], 0
    for c in ctxs:
        n = -(-c // bs)
        tables.append(pool[start:start + n])
        start += n
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    spec = CacheSpec(num_blocks=blocks, block_size=bs, num_slots=4, dtype=torch.bfloat16, device="cuda")
    dev = ModelCache(cfg, spec).attention[0]
    host_cache = ModelCache(cfg, dataclasses.replace(spec, kv_offload=True))
    host = host_cache.attention[0]
    assert host.k.device.type == "cpu" and host_cache.host.pinned and host.pooled_keys.is_cuda
    for name in ("k", "v", "index_keys"):
        vals = torch.randn(getattr(dev, name).shape, generator=g).to(torch.bfloat16)
        getattr(dev, name).copy_(vals)
        getattr(host, name).copy_(vals)
    pooled = torch.randn(dev.pooled_keys.shape, generator=g).to(torch.bfloat16)
    q_idx = torch.randn(len(ctxs), 32, 128, generator=g).to(torch.bfloat16)
    far = {0: [3, 17, 2_000], 1: [1, 40]}                            # compression blocks far from the end
    for b, ids in far.items():
        for c in ids:
            row = tables[b][c * r // bs] * (bs // r) + (c * r % bs) // r
            pooled[row] = q_idx[b].float().mean(0).sign().to(torch.bfloat16) * 8      # every head scores it high
    dev.pooled_keys.copy_(pooled)
    host.pooled_keys.copy_(pooled)
    q_idx = q_idx.cuda()
    w = torch.randn(128, generator=g).to(torch.bfloat16).cuda() * 0.1
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).cuda()
    for c in (dev, host):
        qsa_pool_update(c.index_keys, c.pooled_keys, table, lens, w, inv_freq, 1e-6, bs, r, 64)
    torch.cuda.synchronize()
    assert torch.equal(dev.pooled_keys, host.pooled_keys)
    sel = {id(c): qsa_select(q_idx, c.pooled_keys, table, lens, bs, r, budget) for c in (dev, host)}
    selected = sel[id(dev)]
    assert torch.equal(selected, sel[id(host)])
    for b, ids in far.items():
        chosen = set(selected[b][selected[b] >= 0].tolist())
        assert all(c * r in chosen for c in ids), (b, ids)
    q = torch.randn(len(ctxs), 16, 256, generator=g).to(torch.bfloat16).cuda()
    want = paged_decode_attention(q, dev.k, dev.v, table, lens, 256 ** -0.5, bs, selected)
    got = paged_decode_attention(q, host.k, host.v, table, lens, 256 ** -0.5, bs, selected)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    for splits in (1, 7):
        assert torch.equal(paged_decode_attention(q, host.k, host.v, table, lens, 256 ** -0.5, bs, selected,
                                                  num_splits=splits),
                           paged_decode_attention(q, dev.k, dev.v, table, lens, 256 ** -0.5, bs, selected,
                                                  num_splits=splits))


@pytest.mark.gpu
def test_gpu_layer_over_host_kv_equals_in_vram():
    """One full-head QSA layer (budget 64) on the GPU with the attention kernels: a 3,000-token prompt in chunks of
    512 (in VRAM its late chunks gather each query's rows; over host K/V every chunk stages the context section by
    section), then 16 decode steps through the fused prologue (rows written over PCIe) and split-K attention. The
    caches (written by the row kernels and the prologue) and the decode outputs equal the in-VRAM layer's bit for
    bit; prefill outputs agree within bf16 rounding (the section merge sums in another order)."""
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.attention import GatedAttention
    from stage_worker.model.batch import StepBatch
    from stage_worker.model.rope import Rotary

    cfg = _full_head_cfg(budget=64)
    torch.manual_seed(0)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).cuda()
    attn = GatedAttention(cfg, True, rotary).cuda().to(torch.bfloat16).eval()
    attn.kernels = KernelFlags.parse("all")
    attn.prepare_kernels()
    n, bs = 3000, 16
    table = torch.randperm(n // bs + 4).tolist()
    x = torch.randn(n + 16, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    spec = CacheSpec(num_blocks=n // bs + 4, block_size=bs, num_slots=2, dtype=torch.bfloat16, device="cuda")
    outs, caches = {}, {}
    for offload in (False, True):
        cache = ModelCache(cfg, dataclasses.replace(spec, kv_offload=offload)).attention[0]
        assert (cache.k.device.type == "cpu") == offload
        got = []
        with torch.inference_mode():
            feeds = [(list(range(a, min(a + 512, n))), a) for a in range(0, n, 512)] + \
                [([n + i], n + i) for i in range(16)]
            for tokens, start in feeds:
                batch = StepBatch.build([(tokens, start, 0, table)], bs, "cuda")
                got.append(attn(x[start:start + len(tokens)], batch, cache,
                                rotary.cos_sin(batch.positions, x.dtype)))
        torch.cuda.synchronize()
        outs[offload], caches[offload] = torch.cat(got), cache
    assert n > SPARSE_PREFILL_FACTOR * attn.indexer.keys
    assert torch.equal(outs[True][n:], outs[False][n:])                     # decode
    prefill_err = (outs[True][:n].float() - outs[False][:n].float()).abs().max().item()
    print(f"prefill over host K/V vs in VRAM: max |diff| {prefill_err:.2e} (outputs' std "
          f"{outs[False][:n].float().std().item():.2e})")
    assert prefill_err <= 0.02 * outs[False][:n].float().abs().max().item()
    for name in ("k", "v", "index_keys", "pooled_keys"):
        assert torch.equal(getattr(caches[True], name).cpu(), getattr(caches[False], name).cpu()), name


@pytest.mark.gpu
def test_gpu_stage_with_offload_replays_graphs():
    """The tiny preset (float32, random weights, every kernel on) through LocalEngine with CUDA graphs: three
    prompts (1,500, 300 and 9 tokens in 512-token chunks: the budget of 64 binds, prefill reads host rows section by
    section), then 32 teacher-forced decode steps replayed from the batch-4 graph: every logit is the in-VRAM run's
    within float32 rounding, and the decode kernels alone (the second half of the test: both runs prefilled in
    VRAM order) give the same logits bit for bit."""
    from gpu_models import random_gpu_model
    from stage_worker.kernels.flags import KernelFlags

    model, cfg = random_gpu_model("tiny", torch.float32)
    model.set_kernels(KernelFlags.parse("all"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, cfg.vocab_size, (n,), generator=g).tolist() for n in (1500, 300, 9)]
    forced = [torch.randint(10, cfg.vocab_size, (32,), generator=g).tolist() for _ in prompts]
    def cache_tensors(engine) -> dict[tuple, torch.Tensor]:
        out = {}
        for i, c in enumerate(engine.caches):
            for group in ("attention", "deltanet", "ple"):
                for layer, obj in getattr(c, group).items():
                    for name, t in vars(obj).items():
                        if isinstance(t, torch.Tensor):
                            out[(i, group, layer, name)] = t
        return out

    def run(offload: bool, restore: dict | None = None):
        """Logits of the prefill chunks and the decode steps, and the caches as prefill left them; `restore`: decode
        from those caches instead (the other run's), so that only the decode kernels are compared."""
        engine = LocalEngine([model], max_seqs=4, max_tokens=2048, cuda_graphs=True, kv_offload=offload)
        for i in range(len(prompts)):
            engine.add(i)
        out = []
        with torch.inference_mode():
            for a in range(0, 1500, 512):
                feeds = [(i, p[a:a + 512]) for i, p in enumerate(prompts) if p[a:a + 512]]
                out.append(engine.step(feeds, all_logits=True))
            mine = cache_tensors(engine)
            saved = {key: t.clone() for key, t in mine.items()}
            if restore is not None:
                for key, t in mine.items():
                    t.copy_(restore[key])
            for t in range(32):
                out.append(engine.step([(i, [f[t]]) for i, f in enumerate(forced)]))
        assert engine.graphs is not None and 4 in engine.graphs.graphs        # decode replayed the graph
        assert (engine.caches[0].host is not None) == offload
        return torch.cat(out), saved

    want, vram_caches = run(False)
    got, _ = run(True)
    spread = want.float().std().item()
    err = (got - want).abs().max().item()
    print(f"tiny preset, host K/V vs VRAM: max |diff| {err:.2e} of a logit spread {spread:.2e}")
    assert err < 1e-3 * spread          # (a near-tie of QSA blocks may flip on a 1e-7 difference: not bit-exact)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.99
    # The same caches on both sides before decoding: the graphs over host rows give the in-VRAM logits exactly.
    got, _ = run(True, restore=vram_caches)
    assert torch.equal(got[-32 * 3:], want[-32 * 3:])


@pytest.mark.gpu
def test_gpu_prefill_over_host_kv_peak_memory_stays_near_flat():
    """A 512-token chunk of one full-shape QSA layer (budget 2048) over host K/V at contexts of 16k and 128k tokens
    (caches filled with random rows): the device memory the chunk's forward adds grows by less than 256 bytes per
    context token (the selection reads the context's pooled keys: 64 B a token, and their fp32 copy; the staged
    K/V sections and the one (max, norm, acc) set do not grow: staging the whole context would add 2 KiB a token),
    printed with the time per chunk."""
    import time

    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.attention import GatedAttention
    from stage_worker.model.batch import StepBatch
    from stage_worker.model.rope import Rotary

    cfg = _full_head_cfg(budget=2048)
    torch.manual_seed(0)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).cuda()
    attn = GatedAttention(cfg, True, rotary).cuda().to(torch.bfloat16).eval()
    attn.kernels = KernelFlags.parse("all")
    bs, longest = 16, 128 * 1024
    spec = CacheSpec(num_blocks=longest // bs + 1, block_size=bs, num_slots=2, dtype=torch.bfloat16, device="cuda",
                     kv_offload=True)
    cache = ModelCache(cfg, spec).attention[0]
    g = torch.Generator().manual_seed(1)
    for name in ("k", "v", "index_keys"):
        t = getattr(cache, name)
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    cache.pooled_keys.copy_(torch.randn(cache.pooled_keys.shape, generator=g).to(torch.bfloat16).cuda())
    table = list(range(longest // bs))
    x = torch.randn(512, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for ctx in (16 * 1024, longest):
        batch = StepBatch.build([(list(range(512)), ctx - 512, 0, table[: ctx // bs])], bs, "cuda")
        with torch.inference_mode():
            attn(x, batch, cache, rotary.cos_sin(batch.positions, x.dtype))          # warm-up
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            attn(x, batch, cache, rotary.cos_sin(batch.positions, x.dtype))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        peaks[ctx] = torch.cuda.max_memory_allocated() - base
        print(f"host K/V prefill, 512-token chunk at context {ctx}: +{peaks[ctx] / 2**20:.0f} MiB peak, "
              f"{seconds * 1e3:.1f} ms")
    assert peaks[longest] - peaks[16 * 1024] <= (longest - 16 * 1024) * 256, peaks


def test_served_stages_with_offload_give_the_same_tokens(tiny_checkpoint):
    """The engine core over two in-process stage runners (the server's path) with `qsa_kv_offload`: two 150-token
    prompts prefilled in 32-token chunks (the tiny preset reads 64 + 3 keys a query: the budget binds) decode the
    same greedy tokens as without; each runner reports its K/V bytes by tier, and /metrics shows them."""
    from gateway.metrics import _StageStatsCollector
    from shared.engine_core import GenerationRequest
    from shared.sampling import SamplingParams
    from stage_worker.inprocess_executor import local_engine_core

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 2000, (150,), generator=g).tolist() for _ in range(2)]
    tokens, stats = {}, {}
    for offload in (False, True):
        core = local_engine_core(tiny_checkpoint, stages=2, max_model_len=256, max_num_seqs=4,
                                 max_num_batched_tokens=32, qsa_kv_offload=offload)
        try:
            got = []
            for i, ids in enumerate(prompts):
                params = SamplingParams(max_tokens=12, temperature=0.0)
                got.append([e.token_id for e in core.stream(GenerationRequest(f"r{i}", ids, params,
                                                                              ignore_eos=True))])
            tokens[offload] = got
            stats[offload] = [r.stats() for r in core.executor.runners]
        finally:
            core.stop()
    assert tokens[True] == tokens[False] and all(len(t) == 12 for t in tokens[True])
    for on, off in zip(stats[True], stats[False]):
        assert on["kv_pool_bytes"] == off["kv_pool_bytes"] == off["kv_bytes_vram"] and off["kv_bytes_host"] == 0
        assert on["kv_bytes_host"] > 0 and on["kv_bytes_vram"] + on["kv_bytes_host"] == on["kv_pool_bytes"]
    collector = _StageStatsCollector()
    collector.set("0", stats[True][0])
    samples = {(s.name, s.labels.get("tier")): s.value for fam in collector.collect() for s in fam.samples}
    assert samples[("moepipe_kv_cache_tier_bytes", "host")] == stats[True][0]["kv_bytes_host"]
    assert samples[("moepipe_kv_cache_tier_bytes", "vram")] == stats[True][0]["kv_bytes_vram"]


@pytest.mark.parametrize("offload", [False, True], ids=["vram", "host"])
def test_fill_context_gives_a_sequence_a_decodable_long_context(qwen4, offload):
    """`LocalEngine.fill_context` (bench/decode.py --fill random): a sequence gets its blocks and random rows on
    either tier without a prefill, decodes from there, and touches no other sequence's blocks; both tiers hold the
    same values, so they decode the same logits (to 1e-5: the CPU's host-K/V path sums in another order)."""
    path, cfg = qwen4
    model = load_model(path, LoadOptions(dtype=torch.float32))
    logits = {}
    for tier in (False, offload):
        engine = LocalEngine([model], max_seqs=2, block_size=BLOCK, max_tokens=256, kv_offload=tier)
        engine.add(0)
        engine.add(1)
        engine.fill_context(1, 150, torch.Generator().manual_seed(3))
        cache = engine.caches[0]
        att = cache.attention[min(cache.attention)]
        assert engine.seqs[1].length == 150 and len(engine.seqs[1].blocks) == -(-150 // BLOCK)
        mine = torch.tensor(engine.seqs[1].blocks)
        paged_k = att.k.view(-1, BLOCK, *att.k.shape[1:])
        assert bool((paged_k[mine] != 0).any(dim=(1, 2, 3)).all())          # every block of it was written
        others = torch.ones(paged_k.shape[0], dtype=torch.bool)
        others[mine] = False
        assert not paged_k[others].any()                                    # nothing else was
        with pytest.raises(ValueError, match="already has"):
            engine.fill_context(1, 10, torch.Generator())
        out = engine.step([(1, [7])])
        assert torch.isfinite(out).all() and engine.seqs[1].length == 151
        logits[tier] = out
    torch.testing.assert_close(logits[offload], logits[False], rtol=0, atol=1e-5)
