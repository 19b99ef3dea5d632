"""Long context in the start-up memory plan (issue 18 acceptance, the memory plan of issue 16):

- the reserve covers the worst prefill chunk up to `max_model_len`, not only a short one: the formula of an
  attention chunk's scratch (`activation_peak.attention_chunk_bytes`) against peaks measured on the CPU
  (torch.profiler's allocation events) at two contexts, for QSA with K/V in VRAM (dense and sparse paths), QSA over
  host K/V and attention without an indexer; the measured reserve grows with `max_model_len` and covers a whole
  stage's last chunk at it; a refusal caused by it names `--qsa-kv-offload` and a `--max-model-len` that helps;
- "four 250k-token requests resident at once, no preemption": the plan sizes the pools for `max_num_seqs` full
  sequences (host K/V in RAM checked against what is available, and said when it limits them), and the real engine
  core, its pools sized by the plan exactly for four sequences, admits four requests of a few thousand tokens with
  zero preemptions, all four resident at once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shared.cluster_config import ClusterConfig, StageSpec
from shared.memory_plan import GIB, DeviceMemory, MemoryPlanError, PlanLimits, StageNeeds, plan
from shared.model_config import load_config
from stage_worker.activation_peak import (attention_chunk_bytes, chunk_shapes, context_growth, peak_bytes,
                                          prefill_peak)
from stage_worker.memory_needs import stage_needs
from stage_worker.model.attention import GatedAttention
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec, ModelCache
from stage_worker.model.rope import Rotary

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint):
    return load_config(tiny_checkpoint)


def _attention_peak(cfg, layer: int, qsa: bool, offload: bool, q: int, ctx: int, sparse: bool = True) -> int:
    torch.manual_seed(0)
    rot = Rotary(cfg.rotary_dim, cfg.rope_theta)
    att = GatedAttention(cfg, qsa, rot)
    bs = 16
    nb = -(-ctx // bs)
    cache = ModelCache(cfg, CacheSpec(num_blocks=nb + 1, block_size=bs, num_slots=2, kv_offload=offload),
                       layer, layer + 1)
    batch = StepBatch.build([(list(range(q)), ctx - q, 0, list(range(nb)))], bs)
    batch.sparse_prefill = sparse
    x = torch.randn(q, cfg.hidden_size)
    rope = rot.cos_sin(batch.positions, x.dtype)
    attn_cache = cache.attention[layer]
    if not qsa:
        attn_cache.index_keys = attn_cache.pooled_keys = None
    with torch.inference_mode():
        return peak_bytes(lambda: att(x, batch, attn_cache, rope), CPU)


@pytest.mark.parametrize("qsa, offload, contexts", [
    (True, False, (2048, 16384)),      # K/V in VRAM: the sparse gather path (past 16 x the keys a query reads)
    (True, True, (2048, 16384)),       # host K/V: sections of the whole context (16k rows at 4 heads)
    (False, False, (1024, 4096)),      # attention without an indexer: dense scores over the context
])
def test_the_predicted_attention_scratch_matches_measured_peaks_at_two_contexts(cfg, qsa, offload, contexts):
    """The plan's formula against the real allocation peak of `GatedAttention.forward` (CPU, float32, a 512-token
    chunk ending at each context): never below the measurement (the reports' predicted peak was half the real one)
    and at most 2x it, and its growth from one context to the other at least the measured growth."""
    layer = cfg.layer_types.index("indexed_attention")
    if not qsa:
        cfg = dataclasses.replace(cfg, layer_types=["full_attention" if t == "indexed_attention" else t
                                                    for t in cfg.layer_types])
    got = []
    for ctx in contexts:
        measured = _attention_peak(cfg, layer, qsa, offload, 512, ctx)
        predicted = attention_chunk_bytes(cfg, layer, 512, ctx, 4, offload)
        print(f"qsa {qsa} host K/V {offload} context {ctx}: measured {measured / 2**20:.1f} MiB, predicted "
              f"{predicted / 2**20:.1f} MiB")
        assert measured <= predicted <= 2 * measured
        got.append((measured, predicted))
    (m0, p0), (m1, p1) = got
    assert m1 > m0 and p1 - p0 >= 0.9 * (m1 - m0)


@pytest.mark.parametrize("qsa", [True, False])
def test_a_large_chunk_attends_in_query_slices_with_one_slice_s_scratch(cfg, qsa, monkeypatch):
    """The dense path takes a chunk's queries `DENSE_PREFILL_QUERIES` at a time (a GPU's default chunk is 2048
    tokens): the same output as one slice, a 2048-token chunk's scratch far under four times a 512-token one's (the
    scores are a slice's), and the plan's formula still above the measurement and at most 2x it."""
    from stage_worker.model import attention

    layer = cfg.layer_types.index("indexed_attention")
    if not qsa:
        cfg = dataclasses.replace(cfg, layer_types=["full_attention" if t == "indexed_attention" else t
                                                    for t in cfg.layer_types])
    ctx = 3072
    small = _attention_peak(cfg, layer, qsa, False, 512, ctx, sparse=False)
    large = _attention_peak(cfg, layer, qsa, False, 2048, ctx, sparse=False)
    predicted = attention_chunk_bytes(cfg, layer, 2048, ctx, 4, False, sparse_prefill=False)
    print(f"qsa {qsa}: 512-token chunk {small / 2**20:.1f} MiB, 2048 {large / 2**20:.1f} MiB, predicted "
          f"{predicted / 2**20:.1f} MiB")
    assert large < 2 * small
    assert large <= predicted <= 2 * large
    sliced = _attention_out(cfg, layer, qsa, 700, ctx)
    monkeypatch.setattr(attention, "DENSE_PREFILL_QUERIES", 1 << 20)
    whole = _attention_out(cfg, layer, qsa, 700, ctx)
    assert torch.allclose(sliced, whole, rtol=0, atol=1e-6), (sliced - whole).abs().max()


def _attention_out(cfg, layer: int, qsa: bool, q: int, ctx: int) -> torch.Tensor:
    """`GatedAttention.forward`'s output for a q-token chunk ending at ctx over a seeded random cache."""
    torch.manual_seed(0)
    rot = Rotary(cfg.rotary_dim, cfg.rope_theta)
    att = GatedAttention(cfg, qsa, rot)
    bs = 16
    nb = -(-ctx // bs)
    cache = ModelCache(cfg, CacheSpec(num_blocks=nb + 1, block_size=bs, num_slots=2), layer, layer + 1)
    ac = cache.attention[layer]
    for t in (ac.k, ac.v) + ((ac.index_keys,) if qsa else ()):
        t.copy_(torch.randn_like(t.float()).to(t.dtype))
    if not qsa:
        ac.index_keys = ac.pooled_keys = None
    batch = StepBatch.build([(list(range(q)), ctx - q, 0, list(range(nb)))], bs)
    batch.sparse_prefill = False
    x = torch.randn(q, cfg.hidden_size)
    with torch.inference_mode():
        return att(x, batch, ac, rot.cos_sin(batch.positions, x.dtype))


def test_chunk_shapes_cover_the_dense_switch_the_longest_context_and_the_host_gather(cfg):
    qsa = cfg.layer_types.index("indexed_attention")
    linear = cfg.layer_types.index("linear_attention")
    keys = cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    assert chunk_shapes(cfg, linear, 512, 8192, False) == [(512, 512)]
    assert chunk_shapes(cfg, qsa, 512, 8192, False) == [(512, 512), (512, 8192), (512, 16 * keys)]
    assert chunk_shapes(cfg, qsa, 512, 8192, False, sparse_prefill=False) == [(512, 512), (512, 8192)]
    assert chunk_shapes(cfg, qsa, 512, 8192, True) == [(512, 512), (512, 8192), (8191 // keys, 8192)]


def _cpu_cluster(model: Path, cfg, length: int, offload: bool) -> ClusterConfig:
    return ClusterConfig(model=str(model), gateway_endpoint="", max_num_seqs=4, block_size=16,
                         max_num_batched_tokens=512, max_model_len=length, qsa_kv_offload=offload, kernels="none",
                         stages=[StageSpec(0, cfg.num_hidden_layers, "", "cpu")])


def test_the_measured_reserve_grows_with_max_model_len_and_covers_a_whole_stage_s_last_chunk(tiny_checkpoint, cfg):
    """`prefill_peak` (what `memory_needs` runs on each GPU stage's device; here on the CPU, measured by the
    profiler) at two `max_model_len`: its long-context part grows with the length, the formula's growth is within
    2x of it, and the whole stage's last 512-token chunk at the longer length allocates no more than it and the step's
    logits (the reserve's other activation term)."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    parts = {}
    for length in (2048, 8192):
        cluster = _cpu_cluster(tiny_checkpoint, cfg, length, False)
        peak, context = prefill_peak(cluster, cfg, 0, "float32")
        predicted = context_growth(cfg, 0, cfg.num_hidden_layers, 512, length, 4, False)
        print(f"max_model_len {length}: measured peak {peak / 2**20:.1f} MiB, of it long context "
              f"{context / 2**20:.1f}; the formula's growth {predicted / 2**20:.1f} MiB")
        assert 0 < context <= peak and context <= predicted <= 2 * context
        parts[length] = peak, context
    assert parts[8192][1] > parts[2048][1]
    model = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32), cfg)
    length = 8192
    cache = model.new_cache(CacheSpec(num_blocks=length // 16 + 1, block_size=16, num_slots=2))
    batch = StepBatch.build([(list(range(5, 517)), length - 512, 0, list(range(length // 16)))], 16)
    with torch.inference_mode():
        whole = peak_bytes(lambda: model.logits(model(batch, cache), batch), CPU)
    logits = 512 * cfg.vocab_size * 4           # the reserve's other activation term (memory_needs)
    print(f"whole stage, last chunk at {length}: {whole / 2**20:.1f} MiB against {parts[length][0] / 2**20:.1f} "
          f"+ logits {logits / 2**20:.1f}")
    assert whole <= parts[length][0] + logits


def test_the_estimate_adds_the_context_term_and_a_refusal_names_the_flags(tiny_checkpoint, cfg):
    """Without a measurement (`measure_reserve` off) the reserve grows by the formula's term; a refusal caused by
    it says how much of the reserve that is and names --qsa-kv-offload and a shorter --max-model-len."""
    n = cfg.num_hidden_layers
    base = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=4, block_size=16,
                         max_num_batched_tokens=512, measure_reserve=False, stages=[StageSpec(0, n, "", "cuda:0")])
    short = stage_needs(cfg, dataclasses.replace(base, max_model_len=512))[0]
    long = stage_needs(cfg, dataclasses.replace(base, max_model_len=8192))[0]
    host = stage_needs(cfg, dataclasses.replace(base, max_model_len=8192, qsa_kv_offload=True))[0]
    assert short.reserve_context == 0 and long.reserve_context > 0
    assert long.reserve == short.reserve + long.reserve_context and long.offload_helps and not host.offload_helps

    stage = StageNeeds(stage=0, layers=(0, 48), device="cuda:0", weights=60 * GIB, state=GIB, block=1 << 20,
                       reserve=14 * GIB, reserve_context=12 * GIB, offload_helps=True)
    limits = PlanLimits(block_size=16, max_model_len=262144, max_num_seqs=4)
    small = {"cuda:0": DeviceMemory(total=80 * GIB, free=80 * GIB)}
    with pytest.raises(MemoryPlanError) as err:
        plan([stage], small, limits)
    msg = str(err.value)
    print(msg)
    assert "12.00 GiB is the prefill chunk at --max-model-len 262144" in msg and "--qsa-kv-offload" in msg
    assert "--max-model-len" in msg.split("--qsa-kv-offload")[1]


def test_the_plan_holds_four_full_contexts_with_host_kv_and_says_what_limits_them(tiny_checkpoint, cfg):
    """`--max-num-seqs 4 --max-model-len 262144 --qsa-kv-offload` on the full shape (needs counted on the meta
    device): the KV pool is four full sequences, the host K/V for them fits the RAM given, and with less RAM the
    plan says host RAM limits the pool (more at once would be preempted)."""
    from stage_worker.checkpoint.make_model import make_model

    model = make_model("full-shape", tiny_checkpoint.parent / "fs-plan", layers=8, seed=0)
    fcfg = load_config(model)
    cluster = ClusterConfig(model=str(model), gateway_endpoint="", max_num_seqs=4, max_model_len=262144,
                            block_size=0, qsa_kv_offload=True, load_format="dummy", measure_reserve=False,
                            stages=[StageSpec(0, 8, "", "cuda:0")]).for_model(fcfg)
    needs = stage_needs(fcfg, cluster)
    limits = PlanLimits(block_size=cluster.block_size, max_model_len=262144, max_num_seqs=4, host_kv_bytes=100 * GIB)
    h200 = {"cuda:0": DeviceMemory(total=140 * GIB, free=139 * GIB)}
    result = plan(needs, h200, limits)
    per_seq = 262144 // cluster.block_size
    print(result.table())
    assert result.num_blocks == 4 * per_seq and result.full_sequences == 4 and not result.limited_by
    host = (result.num_blocks + 1) * needs[0].host_block
    assert 4 * 262144 * 2 * 2304 <= host <= limits.host_kv_bytes       # two QSA layers, 2,304 bytes a token each
    tight = plan(needs, h200, dataclasses.replace(limits, host_kv_bytes=3 * per_seq * needs[0].host_block))
    assert tight.full_sequences == 2 and "host RAM" in tight.limited_by and "preempted" in tight.table()


def test_four_long_requests_are_resident_at_once_without_preemption(tiny_checkpoint, cfg):
    """The real engine core (in-process executor, tiny preset, host K/V): pools sized by the plan for exactly
    four sequences of `max_model_len`; four requests filling them are all running at once and none is preempted."""
    from conftest import collect_events
    from shared.sampling import SamplingParams
    from shared.engine_core import GenerationRequest
    from stage_worker.inprocess_executor import local_engine_core

    length, block = 1536, 16
    gpu = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=4, max_model_len=length,
                        block_size=block, qsa_kv_offload=True, measure_reserve=False,
                        stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")])
    needs = stage_needs(cfg, gpu)
    per_seq = length // block
    exact = (4 * per_seq + 1) * needs[0].host_block                    # host RAM for four sequences, no more
    limits = PlanLimits(block_size=block, max_model_len=length, max_num_seqs=4, host_kv_bytes=exact)
    result = plan(needs, {"cuda:0": DeviceMemory(total=80 * GIB, free=80 * GIB)}, limits)
    assert result.num_blocks == 4 * per_seq and result.full_sequences == 4
    core = local_engine_core(tiny_checkpoint, max_model_len=length, max_num_seqs=4, num_blocks=result.num_blocks,
                             block_size=block, qsa_kv_offload=True, max_num_batched_tokens=512)
    sched = core.scheduler
    most, schedule = [0], sched.schedule

    def watch(mb):
        out = schedule(mb)
        most[0] = max(most[0], len(sched.running))
        return out
    sched.schedule = watch
    prompt, out = length - 64, 64                           # each request ends exactly at max_model_len
    try:
        reqs = [GenerationRequest(f"r{i}", [5 + (i * 7 + j) % 1000 for j in range(prompt)],
                                  SamplingParams(max_tokens=out, temperature=0.0), ignore_eos=True)
                for i in range(4)]
        results = collect_events(core, reqs, timeout=120)
    finally:
        core.stop()
    assert all(sum(1 for e in evs if getattr(e, "token_id", None) is not None) == out for evs in results)
    assert sched.num_preemptions == 0 and most[0] == 4
    assert sched.blocks.num_blocks == 4 * per_seq
