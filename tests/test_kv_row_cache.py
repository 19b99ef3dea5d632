"""The VRAM row cache of QSA K/V in host RAM (`kernels/kv_row_cache.py`, issue 18 deliverable 3).

The kernels against the protocol's sequential reference (`kv_row_cache_ref.py`): the state a step leaves (tags,
hitmarks, claims, epoch, counters, and every tagged slot holding its row's host bytes), and attention through the
cache equal to the uncached kernel bit for bit. The randomised acceptance test (a small region with many collisions,
host rows rewritten between steps, the region overwritten and cleared, consecutive selections that mostly repeat)
runs a dozen steps on the CPU (Triton's interpreter runs programs one after another, so only the GPU form, 1,000
steps, can show a race).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from stage_worker.kernels import kv_row_cache as rc  # noqa: E402
from stage_worker.kernels.decode_attention import paged_decode_attention  # noqa: E402
from stage_worker.kernels.decode_attention_ref import paged_decode_attention_ref  # noqa: E402
from stage_worker.kernels.kv_row_cache_ref import invalidate_ref, plan_ref, selected_rows, step_ref  # noqa: E402

if not torch.cuda.is_available():
    import stage_worker.kernels.decode_attention as _kernels

    assert _kernels._INTERPRET, "the kernels were imported before TRITON_INTERPRET=1 was set: they cannot run here"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _clone(c: rc.RowCache, device: str = "cpu") -> rc.RowCache:
    return rc.RowCache(**{name: getattr(c, name).to(device, copy=True) for name in
                          ("k", "v", "tag", "hitmark", "claim", "epoch", "counts")})


def _state_mismatches(got: rc.RowCache, want: rc.RowCache, host_k: torch.Tensor, host_v: torch.Tensor) -> list[str]:
    """What differs between the kernels' state and the reference's; every tagged slot must hold its row's bytes."""
    bad = [n for n in ("tag", "hitmark", "claim", "epoch", "counts") if not torch.equal(getattr(got, n).cpu(),
                                                                                       getattr(want, n))]
    tag = got.tag.cpu()
    held = tag >= 0
    if not torch.equal(got.k.cpu()[held], host_k[tag[held]]) or not torch.equal(got.v.cpu()[held],
                                                                                  host_v[tag[held]]):
        bad.append("region rows")
    return bad


class _Workload:
    """Sequences over a shared paged pool, each decode step's selection mostly the previous one's (the reports: 0.72
    overlap), new tokens written, other rows rewritten; the pool is host memory (pinned on a GPU)."""

    def __init__(self, seed: int, *, seqs: int, kv: int, d: int, heads: int, block: int, blocks: int, select: int,
                 dtype: torch.dtype) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.block, self.select, self.heads, self.dtype = block, select, heads, dtype
        rows = blocks * block
        self.host_k = torch.randn(rows, kv, d, generator=self.g).to(dtype)
        self.host_v = torch.randn(rows, kv, d, generator=self.g).to(dtype)
        if DEVICE == "cuda":
            self.host_k, self.host_v = self.host_k.pin_memory(), self.host_v.pin_memory()
        per = blocks // seqs
        pool = torch.randperm(blocks, generator=self.g)
        self.tables = torch.stack([pool[i * per:(i + 1) * per] for i in range(seqs)]).to(torch.int32)
        self.lens = torch.randint(select // 2, per * block // 2, (seqs,), generator=self.g).to(torch.int32)
        self.sel = [self._fresh(i) for i in range(seqs)]

    def _fresh(self, i: int) -> torch.Tensor:
        n = int(self.lens[i])
        return torch.randperm(n, generator=self.g)[: self.select]

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance one token per sequence (its row written), rewrite a few other rows; returns (written rows,
        selected [B, S] int32 with -1 padding)."""
        cap = self.tables.shape[1] * self.block
        written = []
        for i in range(len(self.sel)):
            if int(self.lens[i]) < cap:
                self.lens[i] += 1
            pos = int(self.lens[i]) - 1
            written.append(int(self.tables[i, pos // self.block]) * self.block + pos % self.block)
        written += torch.randint(0, self.host_k.shape[0], (3,), generator=self.g).tolist()
        written = torch.tensor(sorted(set(written)))
        self.host_k[written] = torch.randn(len(written), *self.host_k.shape[1:], generator=self.g).to(self.dtype)
        self.host_v[written] = torch.randn(len(written), *self.host_v.shape[1:], generator=self.g).to(self.dtype)
        out = torch.full((len(self.sel), self.select + 1), -1, dtype=torch.int32)
        for i, prev in enumerate(self.sel):
            n = int(self.lens[i])
            keep = prev[torch.rand(len(prev), generator=self.g) < 0.75]
            new = torch.randperm(n, generator=self.g)[: self.select - len(keep)]
            sel = torch.unique(torch.cat([keep, new, torch.tensor([n - 1])]))[: self.select]
            self.sel[i] = sel
            out[i, : len(sel)] = sel.to(torch.int32)
        return written, out


def run_random(steps: int, seed: int, *, n_slots: int, seqs: int = 3, kv: int = 2, d: int = 16, heads: int = 4,
               block: int = 8, blocks: int = 48, select: int = 40, dtype=torch.bfloat16) -> tuple[int, float]:
    """(steps whose output or state differ, hit rate) over `steps` random decode steps."""
    w = _Workload(seed, seqs=seqs, kv=kv, d=d, heads=heads, block=block, blocks=blocks, select=select, dtype=dtype)
    cache = rc.RowCache.new(n_slots, kv, d, dtype, DEVICE)
    ref = _clone(cache)
    tables, scale = w.tables.to(DEVICE), d ** -0.5
    bad = 0
    for t in range(steps):
        written, sel = w.step()
        if t % 17 == 5:                     # something else overwrote the region: its tags are dropped
            cache.k.normal_(), cache.v.normal_()
            cache.clear(), ref.clear()
        lens, sel_d = w.lens.to(DEVICE), sel.to(DEVICE)
        q = torch.randn(seqs, heads, d, generator=w.g).to(dtype).to(DEVICE)
        splits = (1, 2, 3, None)[t % 4]
        plain = paged_decode_attention(q, w.host_k, w.host_v, tables, lens, scale, block, sel_d, num_splits=splits)
        rc.invalidate(cache, written.to(DEVICE))
        rc.plan(cache, sel_d, tables, lens, block)
        cached = paged_decode_attention(q, w.host_k, w.host_v, tables, lens, scale, block, sel_d,
                                        num_splits=splits, row_cache=cache)
        step_ref(ref, written, sel, w.tables, w.lens, block, w.host_k, w.host_v)
        if not torch.equal(cached, plain) or _state_mismatches(cache, ref, w.host_k, w.host_v):
            bad += 1
    counts = cache.counts.cpu()
    return bad, int(counts[0]) / max(int(counts[1]), 1)


def test_invalidate_and_plan_match_the_reference():
    """One step by hand: a tagged row is hit and marked, a rewritten row loses its tag, two misses into one slot
    claim it and the larger (epoch, row) wins, a miss into a slot another column hit claims but will not write."""
    cache = rc.RowCache.new(8, 1, 4, torch.float32, DEVICE)
    cache.tag.copy_(torch.tensor([0, 9, -1, 3, 12, -1, -1, -1]))
    cache.epoch.fill_(4)
    ref = _clone(cache)
    written = torch.tensor([3, 100])                 # row 3 was rewritten; 100's slot holds another row
    rc.invalidate(cache, written.to(DEVICE))
    invalidate_ref(ref, written)
    assert cache.tag.cpu()[3] == -1 and int(cache.epoch) == 5
    # one sequence, page size 1, identity table: positions are rows. 9 hits slot 1; 17 misses into it; 11 and 19
    # miss into slot 3; 12 hits slot 4; 4 (slot 4) misses; position 40 is past the context (not a column).
    sel = torch.tensor([[9, 17, 11, 19, 12, 4, 40, -1]], dtype=torch.int32)
    tables = torch.arange(64, dtype=torch.int32)[None]
    lens = torch.tensor([30], dtype=torch.int32)
    rc.plan(cache, sel.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE), 1)
    hit = plan_ref(ref, selected_rows(sel, tables, lens, 1))
    assert hit.tolist() == [True, False, False, False, True, False]
    for name in ("tag", "hitmark", "claim", "epoch", "counts"):
        assert torch.equal(getattr(cache, name).cpu(), getattr(ref, name)), name
    assert int(cache.claim[3]) == 5 << 32 | 19 and int(cache.hitmark[1]) == 5 and cache.counts.tolist() == [2, 6]


def test_cached_attention_equals_uncached_and_fills_the_region():
    """Attention through the cache equals the uncached kernel and the PyTorch reference over host rows; the misses
    that won their claims fill the region (the next identical step hits every such row)."""
    torch.manual_seed(0)
    B, H, KV, D, BS = 2, 4, 2, 16, 4
    rows = 64
    host_k, host_v = torch.randn(rows, KV, D), torch.randn(rows, KV, D)
    if DEVICE == "cuda":                                                  # host rows the GPU reads over PCIe
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    tables = torch.randperm(rows // BS).to(torch.int32).view(2, -1)
    lens = torch.tensor([30, 21], dtype=torch.int32)
    sel = torch.tensor([[0, 3, 7, 8, 20, 29, -1], [1, 2, 5, 13, 17, 18, 20]], dtype=torch.int32)
    q = torch.randn(B, H, D)
    cache = rc.RowCache.new(1024, KV, D, torch.float32, DEVICE)          # no collisions
    ref = _clone(cache)
    dev = [t.to(DEVICE) for t in (tables, lens, sel, q)]
    want = paged_decode_attention_ref(q, host_k, host_v, tables, lens, D ** -0.5, BS, sel)
    plain = paged_decode_attention(dev[3], host_k, host_v, dev[0], dev[1], D ** -0.5, BS, dev[2], num_splits=2)
    for step in range(2):
        rc.invalidate(cache, torch.tensor([], dtype=torch.int64, device=DEVICE))
        rc.plan(cache, dev[2], dev[0], dev[1], BS)
        got = paged_decode_attention(dev[3], host_k, host_v, dev[0], dev[1], D ** -0.5, BS, dev[2], num_splits=2,
                                     row_cache=cache)
        hit = step_ref(ref, torch.tensor([], dtype=torch.int64), sel, tables, lens, BS, host_k, host_v)
        assert torch.equal(got, plain) and torch.allclose(got.cpu(), want, atol=1e-5)
        assert not _state_mismatches(cache, ref, host_k, host_v)
        assert bool(hit.all()) == (step == 1)
    assert cache.counts.tolist() == [13, 26]


def test_random_steps_with_collisions_rewrites_and_overwrites():
    """The acceptance test in small form: 12 steps, 13 slots for 2 x 40 selected rows (many collisions)."""
    bad, rate = run_random(12, seed=1, n_slots=13, seqs=2)
    assert bad == 0
    assert 0.0 < rate < 1.0


def test_region_size_from_the_budget():
    # full shape: 2 kv heads x 256 x bf16 = 2 KiB of K and V a row, 24 B of state; 12 layers share 256 MiB
    assert rc.slots_for(256 << 20, 12, 2, 256, 2) == (256 << 20) // (12 * (2048 + 24))
    assert rc.slots_for(0, 12, 2, 256, 2) == 0


@pytest.mark.gpu
def test_gpu_random_steps_zero_mismatches():
    """The acceptance test (issue 18): 1,000 random steps on the GPU, the host rows pinned and read over PCIe, small
    regions (many collisions), host rows rewritten between steps, the region overwritten: zero mismatches against
    the uncached kernel (and the reference's state). Bigger shapes than the CPU form: 8 sequences, 256 rows each."""
    bad, rate = run_random(1000, seed=2, n_slots=509, seqs=8, kv=2, d=128, heads=16, block=16, blocks=512,
                           select=256)
    print(f"1,000 steps: {bad} mismatches, hit rate {rate:.3f}")
    assert bad == 0 and rate > 0.1


def test_layer_decode_through_the_cache_with_rows_rewritten():
    """`GatedAttention`'s own wiring on the CPU (interpreter): prefill and decode write rows through `forward`, which
    invalidates them; `_decode_kernels` plans and reads through the cache. Two caches fed identically, one with a
    23-slot region: every decode output is equal bit for bit, also after sequence 0's blocks are prefilled again
    with other tokens (a new request reusing them: rows the region held, rewritten)."""
    from stage_worker.model.attention import GatedAttention
    from stage_worker.model.batch import StepBatch
    from stage_worker.model.cache import AttentionCache, CacheSpec
    from stage_worker.model.rope import Rotary

    cfg = _qsa_cfg()
    torch.manual_seed(0)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    attn = GatedAttention(cfg, True, rotary).eval().to(DEVICE)
    bs, ctxs = 8, [29, 41]
    tables = [[5, 0, 7, 2, 9], [1, 8, 3, 6, 4, 10]]
    spec = CacheSpec(num_blocks=11, block_size=bs, num_slots=2, device=DEVICE)
    caches = [AttentionCache(cfg, spec), AttentionCache(cfg, spec)]
    caches[0].row_cache = rc.RowCache.new(23, cfg.num_key_value_heads, cfg.head_dim, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(1)

    def feed(seqs):
        batch = StepBatch.build(seqs, bs, DEVICE)
        x = torch.randn(sum(len(t) for t, *_ in seqs), cfg.hidden_size, generator=g).to(DEVICE)
        for c in caches:
            attn(x, batch, c, rotary.cos_sin(batch.positions, x.dtype))
        return batch

    with torch.no_grad():
        feed([(list(range(c)), 0, i, tables[i]) for i, c in enumerate(ctxs)])
        lens = list(ctxs)
        for step in range(4):
            if step == 2:                                   # sequence 0's blocks reused by another prompt
                feed([(list(range(lens[0] - 1)), 0, 0, tables[0])])
                lens[0] -= 1
            batch = feed([([5], n, i, tables[i]) for i, n in enumerate(lens)])
            q = torch.randn(2, cfg.num_attention_heads, cfg.head_dim, generator=g).to(DEVICE)
            iq = torch.randn(2, cfg.indexer_n_heads, cfg.indexer_head_dim, generator=g).to(DEVICE)
            outs = [attn._decode_kernels(q, iq, batch, c) for c in caches]
            assert torch.equal(outs[0], outs[1]), step
            lens = [n + 1 for n in lens]
    hits, lookups = caches[0].row_cache.counts.tolist()
    assert 0 < hits < lookups


# ---- the switch, the memory plan, the stage's counters -------------------------------------------------------------

def _qsa_cfg():
    from test_kernel_decode_attention import tiny_config

    return tiny_config()


def test_switch_in_config_env_and_cli(monkeypatch, tmp_path):
    """`kv_row_cache` on by default; MOEPIPE_KV_ROW_CACHE / _MIB and --kv-row-cache-mib set it; it takes VRAM only
    over host K/V."""
    from gateway.cli import build_parser, serve_options
    from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec, env_overrides

    for name in ("MOEPIPE_KV_ROW_CACHE", "MOEPIPE_KV_ROW_CACHE_MIB"):
        monkeypatch.delenv(name, raising=False)
    assert "kv_row_cache" not in env_overrides()
    monkeypatch.setenv("MOEPIPE_KV_ROW_CACHE", "1")
    monkeypatch.setenv("MOEPIPE_KV_ROW_CACHE_MIB", "64")
    assert env_overrides()["kv_row_cache"] is True and env_overrides()["kv_row_cache_mib"] == 64
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--kv-row-cache-mib", "32"])
    assert serve_options(args).extra["kv_row_cache"] is True and serve_options(args).extra["kv_row_cache_mib"] == 32
    assert ClusterConfig(model="m", gateway_endpoint="", stages=[StageSpec(0, 1, "", "cpu")]).kv_row_cache
    monkeypatch.setenv("MOEPIPE_KV_ROW_CACHE", "0")
    assert env_overrides()["kv_row_cache"] is False                 # the off switch
    c = ClusterConfig(model="m", gateway_endpoint="", stages=[StageSpec(0, 1, "", "cpu")], kv_row_cache=True,
                      kv_row_cache_mib=8)
    assert c.row_cache_bytes == 0                                   # no host K/V: nothing to cache
    c.qsa_kv_offload = True
    assert c.row_cache_bytes == 8 << 20
    c.kv_row_cache_mib = -1
    with pytest.raises(ClusterConfigError, match="kv_row_cache_mib"):
        c.validate()


def test_model_cache_gives_each_qsa_layer_a_region():
    """On a GPU (here: the meta device, as the memory plan builds it) each host-K/V layer gets its share of the
    budget and the stage one pair of counters; on the CPU (whose decode reads RAM anyway) or without host K/V,
    none."""
    from stage_worker.model.cache import CacheSpec, ModelCache

    cfg = _qsa_cfg()
    spec = CacheSpec(num_blocks=0, block_size=8, num_slots=2, device="meta", kv_offload=True, row_cache_bytes=1 << 20)
    cache = ModelCache(cfg, spec)
    (layer,) = cache.attention.values()
    n = rc.slots_for(1 << 20, 1, cfg.num_key_value_heads, cfg.head_dim, 4)
    assert layer.row_cache.n_slots == n and layer.row_cache.k.shape == (n, cfg.num_key_value_heads, cfg.head_dim)
    assert layer.row_cache.counts is cache.row_cache_counts
    assert n * (2 * cfg.num_key_value_heads * cfg.head_dim * 4 + 24) + 8 == cache.row_cache_bytes() <= 1 << 20
    assert cache.kv_bytes() == ModelCache(cfg, CacheSpec(0, 8, 2, device="meta", kv_offload=True)).kv_bytes()
    for other in (CacheSpec(0, 8, 2, device="cpu", kv_offload=True, row_cache_bytes=1 << 20),
                  CacheSpec(0, 8, 2, device="meta", kv_offload=False, row_cache_bytes=1 << 20)):
        none = ModelCache(cfg, other)
        assert none.row_cache_counts is None and all(a.row_cache is None for a in none.attention.values())


def test_memory_plan_counts_the_region(tmp_path):
    """`memory_needs` counts the region of a GPU stage apart from its state, and the plan's fixed bytes include it."""
    import dataclasses

    from hf_oracle import save_reference
    from shared.cluster_config import ClusterConfig, StageSpec
    from shared.memory_plan import GIB, DeviceMemory, PlanLimits, plan
    from shared.model_config import load_config
    from stage_worker.memory_needs import stage_needs

    save_reference("qwen4_exp", tmp_path)
    cfg = load_config(tmp_path)
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(tmp_path), gateway_endpoint="", max_num_seqs=4, block_size=16,
                            max_model_len=256, stages=[StageSpec(0, n, "", "cuda:0")], measure_reserve=False,
                            qsa_kv_offload=True, kv_row_cache=True, kv_row_cache_mib=2)
    (need,) = stage_needs(cfg, cluster)
    (plain,) = stage_needs(cfg, dataclasses.replace(cluster, kv_row_cache=False))
    assert plain.row_cache == 0 and 0.9 * (2 << 20) < need.row_cache <= 2 << 20
    assert need.state == plain.state + 16 and need.fixed == plain.fixed + need.row_cache + 16   # + the counters
    p = plan([need], {"cuda:0": DeviceMemory(24 * GIB, 24 * GIB)},
             PlanLimits(block_size=16, max_model_len=256, max_num_seqs=4, host_kv_bytes=GIB))
    assert "rows" in p.table()


def test_counters_reach_metrics():
    """The stage's (hits, lookups), read back without waiting, become /metrics counters per stage."""
    from gateway.metrics import Metrics
    from stage_worker.readback import CounterReadback

    counts = torch.tensor([7, 10])
    reads = CounterReadback(counts)
    reads.snapshot()
    assert reads.last == [7, 10]
    m = Metrics()
    m.set_stage_stats(1, {"kv_row_cache_hits": 7.0, "kv_row_cache_lookups": 10.0, "kv_row_cache_bytes": 64.0})
    text = m.render().decode()
    assert 'moepipe_kv_row_cache_hits_total{stage="1"} 7.0' in text
    assert 'moepipe_kv_row_cache_lookups_total{stage="1"} 10.0' in text
    assert 'moepipe_kv_row_cache_bytes{stage="1"} 64.0' in text


# ---- GPU: the model with the cache on and off ----------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_tiny_model_same_logits_with_the_row_cache():
    """The tiny preset (float32, random weights, every kernel on, CUDA graphs) with `qsa_kv_offload`: three prompts
    (1,500, 300, 9 tokens; the budget of 64 binds) prefilled, then 64 greedy decode steps replayed from the batch-4
    graph. With a 1 MiB row cache (collisions) every logit and token equals the run without it, bit for bit, and
    the cache hit."""
    from gpu_models import random_gpu_model
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.local_engine import LocalEngine

    model, cfg = random_gpu_model("tiny", torch.float32)
    model.set_kernels(KernelFlags.parse("all"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, cfg.vocab_size, (n,), generator=g).tolist() for n in (1500, 300, 9)]

    def run(mib: int):
        engine = LocalEngine([model], max_seqs=4, max_tokens=2048, cuda_graphs=True, kv_offload=True,
                             row_cache_mib=mib)
        for i in range(len(prompts)):
            engine.add(i)
        out, tokens = [], []
        with torch.inference_mode():
            for a in range(0, 1500, 512):
                feeds = [(i, p[a:a + 512]) for i, p in enumerate(prompts) if p[a:a + 512]]
                last = engine.step(feeds)
            out.append(last)
            for _ in range(64):
                nxt = last.argmax(-1).tolist()
                tokens.append(nxt)
                last = engine.step([(i, [t]) for i, t in enumerate(nxt)])
                out.append(last)
        assert engine.graphs is not None and 4 in engine.graphs.graphs
        counts = engine.caches[0].row_cache_counts
        return torch.cat(out), tokens, counts.tolist() if counts is not None else None

    want, want_tokens, none = run(0)
    got, tokens, (hits, lookups) = run(1)
    print(f"tiny preset with a 1 MiB row cache: hit rate {hits / max(lookups, 1):.3f} of {lookups} lookups")
    assert none is None and tokens == want_tokens and torch.equal(got, want)
    assert lookups > 0 and hits > 0
