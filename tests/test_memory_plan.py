"""The start-up memory plan (issue 16, shared/memory_plan.py) and the needs it is made from
(stage_worker/memory_needs.py): KV blocks from what the devices leave, refusals that name the numbers and the flag
that makes the model fit."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import torch

from shared.cluster_config import GPU_MAX_NUM_BATCHED_TOKENS, ClusterConfig, StageSpec, dump_toml
from shared.memory_plan import GIB, DeviceMemory, MemoryPlanError, PlanLimits, StageNeeds, plan
from shared.model_config import load_config
from stage_worker.memory_needs import _tensor_bytes, stage_needs
from stage_worker.model.cache import CacheSpec
from stage_worker.model.model import StageModel


def _stage(i: int, device: str, weights_gib: float, block: int = 1 << 20) -> StageNeeds:
    return StageNeeds(stage=i, layers=(8 * i, 8 * i + 8), device=device, weights=int(weights_gib * GIB),
                      state=GIB // 2, block=block, reserve=GIB)


LIMITS = PlanLimits(block_size=16, max_model_len=32768, max_num_seqs=8)
H200 = DeviceMemory(total=141 * GIB, free=140 * GIB)


def test_kv_blocks_come_from_what_the_devices_leave():
    stages = [_stage(0, "cuda:0", 60), _stage(1, "cuda:1", 70)]
    p = plan(stages, {"cuda:0": H200, "cuda:1": H200}, LIMITS)
    budget = int(141 * GIB * 0.9)
    tightest = (budget - int(71.5 * GIB)) // (1 << 20) - 1      # cuda:1: 70 GiB weights + state + reserve
    want = 32768 // 16 * 8
    assert p.num_blocks == min(want, tightest)
    assert "cuda:1" in p.table() and f"{p.num_blocks} KV blocks" in p.table()
    roomy = plan([_stage(0, "cuda:0", 10, block=1 << 10)], {"cuda:0": H200}, LIMITS)
    assert roomy.num_blocks == want                              # never more than max_num_seqs x max_model_len


def test_stages_on_one_device_share_its_budget():
    alone = plan([_stage(0, "cuda:0", 30)], {"cuda:0": H200}, LIMITS)
    shared = plan([_stage(0, "cuda:0", 30), _stage(1, "cuda:0", 30)],
                  {"cuda:0": H200}, dataclasses.replace(LIMITS, max_num_seqs=64))
    assert shared.num_blocks < alone.num_blocks or alone.num_blocks == 32768 // 16 * 8
    fixed = 2 * int(31.5 * GIB)
    assert shared.num_blocks == (int(141 * GIB * 0.9) - fixed) // (2 << 20) - 1


def test_weights_that_do_not_fit_are_refused_with_the_numbers_and_the_flag():
    limits = dataclasses.replace(LIMITS, vram_limit=24 * GIB)
    with pytest.raises(MemoryPlanError) as err:
        plan([_stage(0, "cuda:0", 60)], {"cuda:0": H200}, limits)
    msg = str(err.value)
    assert "24.00 GiB" in msg and "--vram-limit 24" in msg and "61.50 GiB" in msg and "--stages" in msg
    assert "--max-num-batched-tokens" not in msg
    assert "39.5 GiB more of experts per stage" in msg
    # moves on read (the default) give every table that gets cold experts two spare device slots: the advice
    # counts them, so following it is enough
    spared = dataclasses.replace(_stage(0, "cuda:0", 60), spare_bytes=GIB // 2)
    with pytest.raises(MemoryPlanError, match="40.0 GiB more of experts per stage"):
        plan([spared], {"cuda:0": H200}, limits)
    # a GPU serve's 2048-token prefill chunk: the refusals also name the smaller chunk's smaller reserve
    for stage, gpu in ((_stage(0, "cuda:0", 60), limits),
                       (_stage(0, "cuda:0", 60, block=1 << 22), dataclasses.replace(LIMITS, vram_limit=64 * GIB,
                                                                                    max_model_len=262144))):
        with pytest.raises(MemoryPlanError, match="--max-num-batched-tokens 512"):
            plan([stage], {"cuda:0": H200}, dataclasses.replace(gpu, max_num_batched_tokens=2048))


def test_no_room_for_one_sequence_names_the_max_model_len_that_fits():
    limits = dataclasses.replace(LIMITS, vram_limit=64 * GIB, max_model_len=262144)
    stages = [_stage(0, "cuda:0", 60, block=1 << 22)]
    with pytest.raises(MemoryPlanError, match="--max-model-len") as err:
        plan(stages, {"cuda:0": H200}, limits)
    longest = int(str(err.value).split("Use --max-model-len ")[1].split()[0])
    assert 0 < longest < 262144
    fits = plan(stages, {"cuda:0": H200}, dataclasses.replace(limits, max_model_len=longest, max_num_seqs=1))
    assert fits.num_blocks * 16 >= longest
    with pytest.raises(MemoryPlanError):
        plan(stages, {"cuda:0": H200}, dataclasses.replace(limits, max_model_len=longest + 16 * 2, max_num_seqs=1))


def test_a_budget_beyond_free_memory_is_refused():
    busy = DeviceMemory(total=141 * GIB, free=40 * GIB)
    with pytest.raises(MemoryPlanError, match="only 40.00 of 141.00 GiB are free.*--gpu-memory-utilization to 0.27"):
        plan([_stage(0, "cuda:0", 10)], {"cuda:0": busy}, LIMITS)
    assert plan([_stage(0, "cuda:0", 10)], {"cuda:0": busy},
                dataclasses.replace(LIMITS, vram_limit=40 * GIB)).num_blocks > 0


def test_kv_cache_memory_bytes_caps_the_pool():
    limits = dataclasses.replace(LIMITS, kv_cache_memory_bytes=GIB, max_model_len=8192)
    assert plan([_stage(0, "cuda:0", 10)], {"cuda:0": H200}, limits).num_blocks == 1024 - 1


def test_needs_built_on_the_meta_device_equal_a_real_stage(tiny_checkpoint):
    """Weights and state of each stage as `memory_needs` counts them on the meta device, against the same stage
    built for real (float32 here: the CPU's compute dtype; a CUDA stage of this checkpoint would count float32 too,
    its dtype)."""
    cfg = load_config(tiny_checkpoint)
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=5, block_size=16,
                            stages=[StageSpec(0, 2, "", "cuda:0"), StageSpec(2, n, "", "cuda:1")])
    needs = stage_needs(cfg, cluster)
    assert [x.layers for x in needs] == [(0, 2), (2, n)]
    for x in needs:
        real = StageModel(cfg, *x.layers).to(torch.float32 if cfg.dtype == "float32" else torch.bfloat16)
        weights = sum(p.numel() * p.element_size() for name, p in real.named_parameters()
                      if "ngram_embedding" not in name and ".ple.ple_embedding" not in name)
        assert x.weights == weights
        dtype = next(real.parameters()).dtype
        cache = real.new_cache(CacheSpec(num_blocks=0, block_size=16, num_slots=6, dtype=dtype))
        assert x.state == _tensor_bytes(cache) > 0
        assert x.reserve >= GIB
    assert sum(x.block for x in needs) > 0            # (a stage without attention layers holds no KV)


def test_the_launcher_plans_gpu_stages_from_the_needs_process(tiny_checkpoint, tmp_path, monkeypatch):
    """`moepipe serve --device cuda` asks `stage_worker.memory_needs` (a child process) for the needs and the free
    memory, plans, and refuses to start with the plan's message when the model does not fit. The child's reply is
    stood in for here (no CUDA device on this machine)."""
    import json
    import subprocess

    from gateway import launcher

    cfg = load_config(tiny_checkpoint)
    cluster = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=4, block_size=16,
                            max_model_len=256, stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")])
    needs = [vars(n) for n in stage_needs(cfg, cluster)]
    seen = []

    def reply(free_gib: float):
        def run(cmd, **kw):
            seen.append(cmd)
            out = {"stages": needs, "devices": {"cuda:0": {"total": 24 * GIB, "free": int(free_gib * GIB)}}}
            return subprocess.CompletedProcess(cmd, 0, json.dumps(out), "")
        return run

    monkeypatch.setattr(launcher.subprocess, "run", reply(23.5))
    p = launcher.memory_plan(cluster, tmp_path / "cluster.toml")
    assert p.num_blocks == 256 // 16 * 4                          # everything fits: max_num_seqs x max_model_len
    assert seen[-1][1:4] == ["-m", "stage_worker.memory_needs", "--config"]
    monkeypatch.setattr(launcher.subprocess, "run", reply(1.0))
    with pytest.raises(RuntimeError, match="the model does not fit: cuda:0: .*only 1.00 of 24.00 GiB are free"):
        launcher.memory_plan(cluster, tmp_path / "cluster.toml")


def test_auto_cold_experts_moves_out_the_least_that_lets_the_plan_start(tiny_checkpoint, tmp_path, monkeypatch):
    """`--cold-experts auto` on a model that does not fit its device: the launcher asks for the needs, writes a
    cold set of at least the missing bytes spread over the stage's MoE layers, and the plan made with it starts
    (the needs process stood in for, as above, subtracting the file's experts as the real one does)."""
    import json
    import subprocess

    from gateway import launcher
    from shared import cold_set
    from shared.memory_plan import host_bytes_to_fit

    # the pure part: shared by the stages of one device, capped at their routed experts, what one cannot take
    # going to the other (an even split capped at b's 2 GiB moved only half of the rest: a model that fits refused)
    a = dataclasses.replace(_stage(0, "cuda:0", 20), routed_experts=18 * GIB)
    b = dataclasses.replace(_stage(1, "cuda:0", 20), routed_experts=2 * GIB)
    limits = dataclasses.replace(LIMITS, vram_limit=36 * GIB, max_model_len=1024)
    need = host_bytes_to_fit([a, b], {"cuda:0": H200}, limits)
    over = 2 * (21.5 * GIB) + (1024 // 16 + 1) * 2 * (1 << 20) - 36 * GIB
    assert need[1] == 2 * GIB and need[0] == int(over) - 2 * GIB and need[0] > -(-int(over) // 2)
    c = dataclasses.replace(_stage(1, "cuda:0", 20), routed_experts=18 * GIB)    # room in both: even shares
    assert host_bytes_to_fit([a, c], {"cuda:0": H200}, limits) == {0: -(-int(over) // 2), 1: int(over) // 2}
    assert host_bytes_to_fit([_stage(0, "cuda:0", 10)], {"cuda:0": H200}, LIMITS) == {0: 0}

    model = tiny_checkpoint              # read only: the session's tiny preset (seed 0)
    cfg = load_config(model)
    cluster = ClusterConfig(model=str(model), gateway_endpoint="", max_num_seqs=4, block_size=16, max_model_len=256,
                            stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")], cold_experts="auto",
                            gpu_memory_utilization=1.0)
    base = vars(stage_needs(cfg, dataclasses.replace(cluster, cold_experts=""))[0])
    per_expert = cold_set.expert_bytes(cfg, "float32")
    all_in = base["weights"] + base["state"] + base["reserve"] + (256 // 16 + 1) * base["block"]
    size = all_in - 10 * per_expert                  # ten experts too many for the device
    device = {"total": size, "free": size}

    def run(cmd, **kw):
        moved = 0
        if cluster_now[0].cold_experts not in ("", "auto"):
            moved = sum(len(v) for v in cold_set.load(cluster_now[0].cold_experts, cfg).values()) * per_expert
        n = {**base, "weights": base["weights"] - moved, "host_experts": moved,
             "routed_experts": base["routed_experts"] - moved}
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"stages": [n], "devices": {"cuda:0": device}}), "")

    cluster_now = [cluster]
    monkeypatch.setattr(launcher.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="does not fit"):
        launcher.memory_plan(dataclasses.replace(cluster, cold_experts=""), tmp_path / "c.toml")
    resolved = launcher.auto_cold_experts(cluster, tmp_path / "c.toml", tmp_path)
    cold = cold_set.load(resolved.cold_experts, cfg)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(i)]
    assert sorted(cold) == moe_layers and {len(v) for v in cold.values()} == {-(-10 // len(moe_layers))}
    assert all(v == list(range(cfg.num_experts - len(v), cfg.num_experts)) for v in cold.values())   # highest ids
    cluster_now[0] = resolved
    p = launcher.memory_plan(resolved, tmp_path / "c.toml")
    assert p.num_blocks >= 256 // 16
    cpu = dataclasses.replace(cluster, stages=[StageSpec(0, cfg.num_hidden_layers, "", "cpu")])
    assert launcher.auto_cold_experts(cpu, tmp_path / "c.toml", tmp_path).cold_experts == ""


def test_auto_cold_experts_with_no_max_model_len_offloads_for_the_auto_length(tiny_checkpoint, tmp_path, monkeypatch):
    """--max-model-len unset: `--cold-experts auto` sizes the offload for AUTO_OFFLOAD_LEN tokens (or the model's
    own length, if shorter), not the model's whole context, and leaves the length unset for memory_plan to fit; set,
    it sizes the offload for that length."""
    from gateway import launcher
    from shared.memory_plan import AUTO_OFFLOAD_LEN

    cfg = load_config(tiny_checkpoint)
    seen = []

    def inputs(cluster, path):
        seen.append((cluster.max_model_len, tomllib.loads(Path(path).read_text())["max_model_len"]))
        raise MemoryPlanError("stop here")           # the offload's size is not what this test is about

    monkeypatch.setattr(launcher, "plan_inputs", inputs)
    base = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", cold_experts="auto",
                         stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")])
    want = min(cfg.max_position_embeddings, AUTO_OFFLOAD_LEN)
    for set_len, probe in ((0, want), (200, 200)):
        cluster = dataclasses.replace(base, max_model_len=set_len)
        (tmp_path / "c.toml").write_text(dump_toml(cluster))       # as the launcher writes it before the call
        with pytest.raises(RuntimeError, match="stop here"):
            launcher.auto_cold_experts(cluster, tmp_path / "c.toml", tmp_path)
        assert seen.pop() == (probe, probe)          # the needs process reads the same length from the file


def test_the_reserve_is_the_measured_prefill_plus_logits_and_workspace(tiny_checkpoint):
    """With `measure_reserve` (the default) a GPU stage's reserve is one measured prefill chunk per layer kind
    (`activation_peak.prefill_peak`, stood in for here) plus the step's logits and the workspace; off, the former
    estimate. One layer of each kind is measured: the first and last layers on their own (embedding, head)."""
    from stage_worker.activation_peak import layer_kinds
    from stage_worker.memory_needs import WORKSPACE

    cfg = load_config(tiny_checkpoint)
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=4, block_size=16,
                            max_num_batched_tokens=64, stages=[StageSpec(0, 2, "", "cuda:0"),
                                                               StageSpec(2, n, "", "cuda:0")])
    asked = []

    def measure(cl, c, stage, dtype):
        asked.append(stage)
        return (stage + 1) * 1000 if stage == 0 else (2000, 700)      # (peak, its long-context part) or a peak

    needs = stage_needs(cfg, cluster, measure)
    logits = 64 * cfg.vocab_size * 4
    assert asked == [0, 1]
    assert [x.reserve for x in needs] == [1000 + WORKSPACE, 2000 + logits + WORKSPACE]
    assert [x.reserve_context for x in needs] == [0, 700]
    off = stage_needs(cfg, dataclasses.replace(cluster, measure_reserve=False))
    assert off[0].reserve == GIB + 64 * cfg.hidden_size * cfg.hc_count * 96
    kinds = layer_kinds(cfg, 0, n)
    assert kinds[0] == 0 and kinds[-1] == n - 1 and len(set(kinds)) == len(kinds)
    described = {(cfg.layer_types[i], cfg.ple_index(i) is not None) for i in range(1, n - 1)}
    assert len(kinds) - 2 <= len(described) <= len(kinds)


@pytest.mark.gpu
def test_the_measured_reserve_covers_a_whole_stage_s_prefill(tiny_checkpoint):
    """On a GPU: the whole stage's prefill of a `max_num_batched_tokens` chunk allocates no more beyond its weights
    and caches than the measured reserve's activation part (the plan's promise)."""
    from stage_worker.activation_peak import prefill_peak
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.batch import StepBatch

    cfg = load_config(tiny_checkpoint)
    tokens = 512
    cluster = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=4, block_size=16,
                            max_num_batched_tokens=tokens,
                            stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")])
    measured, _ = prefill_peak(cluster, cfg, 0, "bfloat16")      # (peak, its long-context part)
    model = load_model(tiny_checkpoint, LoadOptions(device="cuda:0", load_format="dummy", dtype=torch.bfloat16), cfg)
    model.set_kernels(KernelFlags.parse("all"))
    blocks = tokens // 16
    cache = model.new_cache(CacheSpec(num_blocks=blocks + 1, block_size=16, num_slots=2, dtype=torch.bfloat16,
                                      device="cuda:0"))
    batch = StepBatch.build([(list(range(5, 5 + tokens)), 0, 0, list(range(blocks)))], 16, "cuda:0")
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model.logits(model(batch, cache), batch)
        torch.cuda.synchronize()
    whole = torch.cuda.max_memory_allocated() - base
    print(f"measured reserve (activations) {measured / 2**20:.1f} MiB, whole stage's prefill {whole / 2**20:.1f} MiB")
    assert 0 < whole <= measured * 1.05 + (1 << 20)


def test_dummy_int4_experts_are_loaded_and_planned_packed(tiny_checkpoint):
    """`dummy_quant = "int4-experts"` (benchmarks of a quantized model without its files): the stage's routed
    experts are random INT4 words kept packed, and the plan counts them at their packed size."""
    from shared.cold_set import packed_expert_bytes
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.stage_loader import load_stage

    cfg = load_config(tiny_checkpoint)
    stages = [StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")]
    base = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", stages=stages, load_format="dummy",
                         measure_reserve=False)
    plain = stage_needs(cfg, base)[0]
    packed = stage_needs(cfg, dataclasses.replace(base, dummy_quant="int4-experts"))[0]
    dtype = "float32" if cfg.dtype == "float32" else "bfloat16"
    assert packed.expert_bytes == packed_expert_bytes(cfg, *dummy_groups(cfg), dtype=dtype) < plain.expert_bytes
    assert plain.weights - packed.weights == packed.routed_experts // packed.expert_bytes * (
        plain.expert_bytes - packed.expert_bytes)
    cpu = dataclasses.replace(base, dummy_quant="int4-experts", stages=[StageSpec(0, cfg.num_hidden_layers, "", "cpu")])
    model = load_stage(cpu, 0, cfg)
    assert all(m.packed_group for m in model.moe_layers().values())
    with pytest.raises(Exception, match="dummy_quant"):
        dataclasses.replace(base, dummy_quant="int3").validate()


# ---- --max-model-len unset: the longest length that fits (fit_max_model_len) -----------------------------------------

FULL = 262144
KV_BLOCK = 1 << 18                      # one 16-token block on the device (the H200 report's 262144 bytes)


def _needs_fn(budget_gib: float, context_per_token: int = 96 << 10, offset: int = 0, square: float = 0.0):
    """A stage of 100 GiB of weights whose prefill reserve grows with max_model_len (`reserve_context`: `offset` +
    `context_per_token` a token + `square` x tokens^2), as the needs process measures it at each length; and the
    lengths it was asked at."""
    asked = []
    device = {"cuda:0": DeviceMemory(total=int(budget_gib / 0.9 * GIB) + GIB, free=140 * GIB)}
    limits = PlanLimits(block_size=16, max_model_len=FULL, max_num_seqs=8,
                        vram_limit=int(budget_gib * GIB))

    def needs(length: int, record: bool = True):
        if record:
            asked.append(length)
        ctx = offset + context_per_token * length + int(square * length * length)
        stage = StageNeeds(stage=0, layers=(0, 32), device="cuda:0", weights=100 * GIB, state=GIB, block=KV_BLOCK,
                           reserve=GIB + ctx, reserve_context=ctx)
        return [stage], device, dataclasses.replace(limits, max_model_len=length)

    return needs, asked


def _fits(needs, length: int) -> bool:
    try:
        plan(*needs(length, record=False))
    except MemoryPlanError:
        return False
    return True


def _longest(needs, step: int = 1024, lowest: int = 4096) -> int:
    """The brute-force answer: the longest multiple of `step` from `lowest` up that fits for real."""
    fitting = [k for k in range(lowest, FULL, step) if _fits(needs, k)]
    return max(fitting) if fitting else 0


def test_an_unset_max_model_len_is_fitted_to_the_longest_length_that_fits():
    from shared.memory_plan import fit_max_model_len

    needs, asked = _needs_fn(127)                # 1 GiB left for KV at the model's length: 4096 of 16384 blocks
    with pytest.raises(MemoryPlanError, match="one sequence of --max-model-len 262144 needs 16384"):
        plan(*needs(FULL, record=False))
    p = fit_max_model_len(*needs(FULL, record=False), needs, user_set=False)
    best = _longest(needs)
    assert 4096 < best < FULL and p.max_model_len == best and p.max_model_len % 1024 == 0
    assert not _fits(needs, best + 1024)
    assert asked[-1] == best or best in asked                    # the answer's needs were measured at its length
    assert len(asked) <= 3
    assert p.num_blocks >= p.per_seq == best // 16 and p.full_sequences >= 1
    assert f"--max-model-len not set: one sequence of the model's {FULL} tokens" in p.fitted
    assert f"serving with --max-model-len {best}" in p.fitted and "cuda:0" in p.fitted
    assert "pass --max-model-len to choose" in p.fitted and "--vram-limit" in p.fitted and "\n" not in p.fitted
    roomy, _ = _needs_fn(130, context_per_token=0)
    assert fit_max_model_len(*roomy(FULL, record=False), roomy, user_set=False).fitted == ""   # the model's fits


def test_the_prefill_reserve_is_measured_again_at_the_chosen_length():
    """The context part of the reserve has an offset (a proportional extrapolation from the model's length
    under-counts it at shorter ones): the first prediction does not fit for real, and the answer is one measured
    to fit; a reserve growing faster than the context (interpolation over-counts) still ends at a length that fits."""
    from shared.memory_plan import fit_max_model_len

    needs, asked = _needs_fn(127, offset=6 * GIB, context_per_token=64 << 10)
    p = fit_max_model_len(*needs(FULL, record=False), needs, user_set=False)
    assert len(asked) >= 2 and not _fits(needs, asked[0])       # the extrapolation alone would not have started
    assert p.max_model_len in asked and _fits(needs, p.max_model_len)
    assert p.max_model_len == _longest(needs)
    assert p.stages[0].reserve == needs(p.max_model_len, record=False)[0][0].reserve   # the measured needs planned

    convex, asked = _needs_fn(127, context_per_token=16 << 10, square=0.4)
    assert not _fits(convex, FULL)
    p = fit_max_model_len(*convex(FULL, record=False), convex, user_set=False)
    assert len(asked) <= 3 and p.max_model_len in asked and _fits(convex, p.max_model_len)
    assert p.max_model_len >= _longest(convex) - 2 * 1024


def test_an_explicit_max_model_len_is_honoured_or_refused():
    from shared.memory_plan import fit_max_model_len

    needs, asked = _needs_fn(127)
    with pytest.raises(MemoryPlanError, match="one sequence of --max-model-len 262144 needs 16384") as err:
        fit_max_model_len(*needs(FULL, record=False), needs, user_set=True)
    assert "Use --max-model-len" in str(err.value) and asked == []


def test_the_fitted_length_respects_the_minimum_and_nothing_shorter_is_served():
    from shared.memory_plan import fit_max_model_len

    # room for 4096 tokens and not 5120: 4096 is served
    fixed = 100 * GIB + GIB + GIB + (96 << 10) * 4096
    exact = (fixed + (4096 // 16 + 1) * KV_BLOCK) / GIB
    needs, _ = _needs_fn(exact)
    assert _fits(needs, 4096) and not _fits(needs, 5120)
    assert fit_max_model_len(*needs(FULL, record=False), needs, user_set=False).max_model_len == 4096
    # room for 3072: below the minimum, refused with the model length's numbers
    needs, _ = _needs_fn(exact - 0.05)
    assert _fits(needs, 3072) and not _fits(needs, 4096)
    with pytest.raises(MemoryPlanError, match="prefill chunk at --max-model-len 262144"):
        fit_max_model_len(*needs(FULL, record=False), needs, user_set=False)
    # a lower minimum of the caller's serves it
    assert fit_max_model_len(*needs(FULL, record=False), needs, user_set=False, minimum=2048).max_model_len == 3072


def test_nothing_fits_when_the_weights_alone_are_too_big_or_the_device_is_busy():
    from shared.memory_plan import fit_max_model_len

    needs, asked = _needs_fn(100)
    with pytest.raises(MemoryPlanError, match="before any KV cache"):
        fit_max_model_len(*needs(FULL, record=False), needs, user_set=False)
    assert asked == []                                 # no length would help: none is measured
    needs, asked = _needs_fn(125)
    stages, _, limits = needs(FULL, record=False)
    busy = {"cuda:0": DeviceMemory(total=141 * GIB, free=40 * GIB)}
    with pytest.raises(MemoryPlanError, match="only 40.00 of 141.00 GiB are free"):
        fit_max_model_len(stages, busy, limits, needs, user_set=False)
    assert asked == []


def test_a_prefill_reserve_larger_than_the_device_is_fitted_too():
    """At the model's length the prefill chunk's scratch alone leaves no room for the weights (the plan's first
    refusal, not the KV's): a shorter length fits, and the line names the device."""
    from shared.memory_plan import fit_max_model_len

    needs, _ = _needs_fn(127, context_per_token=128 << 10)
    with pytest.raises(MemoryPlanError, match="before any KV cache"):
        plan(*needs(FULL, record=False))
    p = fit_max_model_len(*needs(FULL, record=False), needs, user_set=False)
    assert p.max_model_len == _longest(needs) > 4096 and "in what cuda:0 leaves" in p.fitted


def test_the_fitted_length_is_whole_blocks_of_a_block_size_that_does_not_divide_1024():
    from shared.memory_plan import fit_max_model_len, fit_step

    assert fit_step(16) == 1024 and fit_step(48) == 1008 and fit_step(2048) == 2048
    needs, _ = _needs_fn(127)

    def by48(length: int, record: bool = True):
        stages, devices, limits = needs(length, record)
        return stages, devices, dataclasses.replace(limits, block_size=48)

    p = fit_max_model_len(*by48(FULL, record=False), by48, user_set=False)
    assert p.max_model_len % 1008 == 0 and p.max_model_len % 48 == 0
    assert not _fits(by48, p.max_model_len + 1008)


def test_serve_writes_the_fitted_length_where_every_process_reads_it(tiny_checkpoint, tmp_path, monkeypatch):
    """`moepipe serve --device cuda` without --max-model-len on a device whose KV room is too small for the
    model's 8192 tokens: the plan is made again at the chosen length (the needs process reads it from the config
    file it is given), the line is printed, and cluster.toml, which the gateway, its engine core and the stages
    read, carries the chosen length as a --max-model-len flag would. With --max-model-len 8192 the same device
    refuses. The needs process and the GPU count are stood in for."""
    import json
    import subprocess

    import torch

    from gateway import launcher
    from shared.cluster_config import load_cluster_config

    cfg = load_config(tiny_checkpoint)
    assert cfg.max_position_embeddings == 8192
    ctx = lambda length: 2000 * length                                              # noqa: E731
    sizes = {}
    real_run = subprocess.run

    def measure(cluster, c, stage, dtype):
        length = cluster.max_model_len or c.max_position_embeddings
        return (1 << 20) + ctx(length), ctx(length)

    def run(cmd, **kw):
        if cmd[1:3] != ["-m", "stage_worker.memory_needs"]:
            return real_run(cmd, **kw)
        cluster = load_cluster_config(cmd[-1])
        needs = [vars(n) for n in stage_needs(cfg, cluster, measure)]
        sizes.setdefault("asked", []).append(cluster.max_model_len)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"stages": needs, "devices": sizes["devices"]}), "")

    monkeypatch.setattr(launcher.subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    probe = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", gpu_memory_utilization=1.0,
                          stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")],
                          max_num_batched_tokens=GPU_MAX_NUM_BATCHED_TOKENS).for_model(cfg)   # serve's, on a GPU
    (need,) = stage_needs(cfg, dataclasses.replace(probe, max_model_len=6144), measure)
    size = need.fixed + (6144 // probe.block_size + 1) * need.block             # room for 6144 tokens, not 7168
    sizes["devices"] = {"cuda:0": {"total": size, "free": size}}

    opts = launcher.ServeOptions(model=tiny_checkpoint, device="cuda", run_dir=tmp_path / "run",
                                 extra={"gpu_memory_utilization": 1.0, "load_format": "dummy"})
    cluster = launcher.Cluster(opts)
    assert sizes["asked"][0] == 0 and 6144 in sizes["asked"]                  # measured again at the chosen length
    assert cluster.cluster.max_model_len == 6144 and cluster.plan.max_model_len == 6144
    written = load_cluster_config(cluster.config_path).for_model(cfg)
    assert written.max_model_len == 6144 and written.num_blocks == cluster.plan.num_blocks
    assert all(cmd[cmd.index("--config") + 1] == str(cluster.config_path) for cmd in cluster.commands.values())
    cluster.stop()

    sizes["asked"] = []
    opts = dataclasses.replace(opts, run_dir=tmp_path / "explicit",
                               extra={**opts.extra, "max_model_len": 8192})
    with pytest.raises(RuntimeError, match="the model does not fit: cuda:0: .*--max-model-len 8192 needs 512"):
        launcher.Cluster(opts)
    assert sizes["asked"] == [8192]


def test_the_cpu_path_plans_nothing_and_keeps_the_model_length(tiny_checkpoint, tmp_path, monkeypatch):
    from gateway import launcher

    def run(cmd, **kw):
        raise AssertionError(f"no needs process for CPU stages: {cmd}")

    monkeypatch.setattr(launcher.subprocess, "run", run)
    cluster = launcher.Cluster(launcher.ServeOptions(model=tiny_checkpoint, run_dir=tmp_path))
    assert cluster.cluster.max_model_len == 0 and not hasattr(cluster, "plan")
    assert "max_model_len = 0" in cluster.config_path.read_text()
    cluster.stop()
