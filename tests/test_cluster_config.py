"""The cluster config file: round trip, validation messages, environment switches."""

from __future__ import annotations

import pytest

from gateway.launcher import ServeOptions, build_cluster_config
from shared.cluster_config import (ClusterConfigError, cluster_from_dict, dump_toml, load_cluster_config,
                                   split_layers)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint              # read only: the session's tiny preset (seed 0)


def test_layers_split_contiguously_with_the_remainder_first():
    assert split_layers(6, 2) == [(0, 3), (3, 6)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ClusterConfigError, match="--stages 9"):
        split_layers(6, 9)


def test_toml_round_trip_and_validation(tiny, tmp_path):
    cfg = build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)
    path = tmp_path / "cluster.toml"
    path.write_text(dump_toml(cfg))
    assert load_cluster_config(path) == cfg
    raw = {"model": "m", "gateway_endpoint": "ipc://g", "stages": [{"start": 0, "end": 3, "endpoint": "ipc://a"},
                                                                   {"start": 4, "end": 6, "endpoint": "ipc://b"}]}
    with pytest.raises(ClusterConfigError, match=r"stages\[1\] covers layers \[4, 6\)"):
        cluster_from_dict(raw)
    with pytest.raises(ClusterConfigError, match="unknown keys"):
        cluster_from_dict({**raw, "stages": raw["stages"][:1], "max_num_seq": 3})
    with pytest.raises(ClusterConfigError, match="not valid TOML"):
        bad = tmp_path / "bad.toml"
        bad.write_text("model = [")
        load_cluster_config(bad)


def test_environment_switches_reach_the_launcher_and_the_processes(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPIPE_PLE_SERVICE", "0")
    monkeypatch.setenv("MOEPIPE_MICROBATCHES", "1")
    monkeypatch.setenv("MOEPIPE_BATCHED_PREFILL", "0")
    cfg = build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)
    assert not cfg.ple_service and not cfg.ple_endpoint and cfg.num_microbatches == 1
    assert not cfg.batched_prefill
    monkeypatch.setenv("MOEPIPE_PLE_SERVICE", "1")
    cfg = build_cluster_config(ServeOptions(model=tiny, stages=2, extra={"ple_service": False}), tmp_path)
    assert not cfg.ple_service                       # the command-line flag wins over the environment
    with pytest.raises(ClusterConfigError, match="unknown cluster config key.*'num_blockz'.*known: .*num_blocks"):
        build_cluster_config(ServeOptions(model=tiny, stages=2, extra={"num_blockz": 64}), tmp_path)


def test_more_stages_than_gpus_share_them_round_robin_and_say_so(tiny, tmp_path, monkeypatch, capsys):
    """--device cuda with more stages than visible GPUs: the stages take the GPUs in turn, and the launcher says
    that stages sharing a GPU serve less than one stage would (one line; none when every stage has its own)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = build_cluster_config(ServeOptions(model=tiny, stages=2, device="cuda"), tmp_path)
    assert [s.device for s in cfg.stages] == ["cuda:0", "cuda:0"]
    err = capsys.readouterr().err
    assert "--stages 2 on 1 visible GPU(s)" in err and "use --stages 1" in err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = build_cluster_config(ServeOptions(model=tiny, stages=2, device="cuda"), tmp_path)
    assert [s.device for s in cfg.stages] == ["cuda:0", "cuda:1"]
    assert "visible GPU" not in capsys.readouterr().err


def test_dtype_default_switch_and_validation(tiny, tmp_path, monkeypatch):
    import torch

    from shared.model_config import config_from_dict
    from stage_worker.checkpoint.loader import default_dtype

    half = config_from_dict({**__import__("json").loads((tiny / "config.json").read_text()), "dtype": "bfloat16"})
    assert default_dtype(half, "cpu") == torch.float32              # no bf16 matrix units on most CPUs
    assert default_dtype(half, "cuda:1") == torch.bfloat16          # a GPU keeps the checkpoint's dtype
    monkeypatch.setenv("MOEPIPE_DTYPE", "bfloat16")
    assert build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path).dtype == "bfloat16"
    monkeypatch.setenv("MOEPIPE_DTYPE", "bf16")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_DTYPE='bf16': expected float32, bfloat16, float16"):
        build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)


def test_serve_load_format_reaches_the_cluster_config(tiny, tmp_path):
    from gateway.cli import build_parser, serve_options

    opts = serve_options(build_parser().parse_args(["serve", "--model", str(tiny), "--stages", "2",
                                                    "--load-format", "dummy"]))
    assert build_cluster_config(opts, tmp_path).load_format == "dummy"
    opts = serve_options(build_parser().parse_args(["serve", "--model", str(tiny)]))
    assert build_cluster_config(opts, tmp_path).load_format == "safetensors"


# ---- KV sizes derived from the model (issue 13) ---------------------------------------------------------------------

def _ratio3_model(tiny, tmp_path):
    """A config-only copy of the tiny model with QSA compression ratio 3 (valid in transformers)."""
    import json

    raw = json.loads((tiny / "config.json").read_text())
    raw.update(indexer_compress_ratio=3, indexer_budget=12)
    out = tmp_path / "ratio3"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_block_size_is_derived_and_a_bad_explicit_one_is_named(tiny, tmp_path):
    model = _ratio3_model(tiny, tmp_path)
    assert build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path).block_size == 16      # ratio 4
    cfg = build_cluster_config(ServeOptions(model=model, stages=2), tmp_path)
    assert cfg.block_size == 48
    assert build_cluster_config(ServeOptions(model=model, extra={"block_size": 18}), tmp_path).block_size == 18
    with pytest.raises(ClusterConfigError, match=r"block_size 16 must be a multiple of indexer_compress_ratio 3.*"
                                                 r"use 48, 96, 192 or any multiple of 3"):
        build_cluster_config(ServeOptions(model=model, extra={"block_size": 16}), tmp_path)
    with pytest.raises(ClusterConfigError, match="block_size must be >= 1, or 0"):
        cluster_from_dict({"model": "m", "gateway_endpoint": "ipc://g", "block_size": -16,
                           "stages": [{"start": 0, "end": 6, "endpoint": "ipc://a"}]})


def test_the_cli_names_a_bad_block_size_and_too_many_stages(tiny, tmp_path, capsys):
    import signal

    from gateway.cli import main

    model = _ratio3_model(tiny, tmp_path)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve", "--model", str(model), "--block-size", "16"]) == 2
        assert "--block-size 16 must be a multiple of indexer_compress_ratio 3" in capsys.readouterr().err
        assert main(["serve", "--model", str(tiny), "--stages", "7"]) == 2
        assert "--stages 7: must be between 1 and the model's 6 layers" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


def test_block_bytes_is_what_a_stage_allocates_per_block(tiny):
    from shared.kv_layout import block_bytes
    from shared.model_config import load_config
    from stage_worker.model.cache import CacheSpec, ModelCache

    cfg = load_config(tiny)
    for start, end in split_layers(cfg.num_hidden_layers, 3):
        sizes = [ModelCache(cfg, CacheSpec(num_blocks=n, block_size=16, num_slots=2), start, end).bytes()
                 for n in (5, 12)]
        assert (sizes[1] - sizes[0]) / 7 == block_bytes(cfg, start, end, 16, "float32")
    assert block_bytes(cfg, 0, cfg.num_hidden_layers, 16, "float32") > 0


def test_an_explicit_num_blocks_beyond_the_host_s_ram_is_named(tiny, tmp_path, monkeypatch):
    """`--num-blocks 100000000` on a CPU: the stage process asked for 409 GB and died with an allocation traceback
    ("stage0 exited with 1 during start-up"); now the config names --num-blocks and the RAM it would need. A
    stage on another host is not checked against this one's RAM."""
    import dataclasses
    import os

    real = os.sysconf

    def small_host(name):
        return 1 << 20 if name == "SC_PHYS_PAGES" else real(name)      # pages: 4 GiB with 4 KiB pages

    monkeypatch.setattr(os, "sysconf", small_host)
    ok = build_cluster_config(ServeOptions(model=tiny, extra={"num_blocks": 64}), tmp_path)
    with pytest.raises(ClusterConfigError, match=r"num_blocks \(--num-blocks\) 100000000 needs [\d.]+ GiB of KV "
                                                 r"blocks on this host's CPU stages .* more than its [\d.]+ GiB of RAM"):
        build_cluster_config(ServeOptions(model=tiny, extra={"num_blocks": 100_000_000}), tmp_path)
    from shared.model_config import load_config

    far = dataclasses.replace(ok, num_blocks=100_000_000, stages=[
        dataclasses.replace(st, endpoint="tcp://10.0.0.9:5555") for st in ok.stages], insecure_links=True)
    assert far.for_model(load_config(tiny)).num_blocks == 100_000_000


def test_num_blocks_auto_fits_the_budget_and_an_explicit_one_is_honoured(tiny, tmp_path, monkeypatch):
    import dataclasses

    from shared.kv_layout import GIB, block_bytes
    from shared.model_config import load_config

    cfg = load_config(tiny)
    per_seq = -(-cfg.max_position_embeddings // 16)
    auto = build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)
    assert auto.num_blocks == auto.max_num_seqs * per_seq                  # 16 full-length sequences fit in 4 GiB
    worst = max(block_bytes(cfg, s.start, s.end, 16, "float32") for s in auto.stages)
    monkeypatch.setenv("MOEPIPE_KV_CACHE_MEMORY", str(2.5 * per_seq * worst / GIB))
    capped = build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)
    assert per_seq <= capped.num_blocks < 3 * per_seq and (capped.num_blocks + 1) * worst <= 2.5 * per_seq * worst
    unresolved = dataclasses.replace(capped, num_blocks=0, block_size=0)           # as an operator may write it
    assert load_cluster_config(_written(unresolved, tmp_path)).for_model(cfg) == capped     # every process agrees
    monkeypatch.setenv("MOEPIPE_KV_CACHE_MEMORY", str(0.5 * per_seq * worst / GIB))
    with pytest.raises(ClusterConfigError, match=rf"kv_cache_memory .* GiB holds \d+ KV blocks of 16 tokens on stage "
                                                 rf"\d .*max_model_len {cfg.max_position_embeddings} needs {per_seq}"):
        build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)
    assert build_cluster_config(ServeOptions(model=tiny, extra={"num_blocks": 7}), tmp_path).num_blocks == 7
    monkeypatch.setenv("MOEPIPE_KV_CACHE_MEMORY", "lots")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_KV_CACHE_MEMORY='lots': expected a number"):
        build_cluster_config(ServeOptions(model=tiny), tmp_path)


def test_default_kv_budget_fits_one_full_sequence_on_a_gpu(tiny, tmp_path):
    """With no kv_cache_memory set, GPU stages get at least one max_model_len sequence (a 262k-token checkpoint is
    not refused by default); CPU stages keep the 4 GiB cap; an explicit budget is a cap on both."""
    import dataclasses

    from shared.kv_layout import GIB, block_bytes
    from shared.model_config import load_config

    cfg = load_config(tiny)
    cpu = build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)
    worst = max(block_bytes(cfg, s.start, s.end, 16, "float32") for s in cpu.stages)
    long_len = int(5 * GIB / worst) * 16                                # one sequence: ~5 GiB, over the 4 GiB default
    cfg = dataclasses.replace(cfg, max_position_embeddings=long_len)     # a model that serves that length
    base = dataclasses.replace(cpu, num_blocks=0, block_size=0, max_model_len=long_len, max_num_seqs=4,
                               dtype="float32")
    with pytest.raises(ClusterConfigError, match=f"max_model_len {long_len} needs"):
        base.for_model(cfg)
    gpu = dataclasses.replace(base, stages=[dataclasses.replace(s, device=f"cuda:{i}")
                                            for i, s in enumerate(base.stages)])
    per_seq = long_len // 16
    assert gpu.for_model(cfg).num_blocks == per_seq                     # exactly one full-length sequence
    with pytest.raises(ClusterConfigError, match="kv_cache_memory 4 GiB holds"):
        dataclasses.replace(gpu, kv_cache_memory=4.0).for_model(cfg)


def _written(cfg, tmp_path):
    path = tmp_path / "written.toml"
    path.write_text(dump_toml(cfg))
    return path


def test_the_built_in_model_serves_a_32k_context_by_default(tmp_path):
    from shared.cli import BUNDLED_MODEL
    from shared.model_config import load_config

    limit = load_config(BUNDLED_MODEL).max_position_embeddings
    assert limit >= 32768
    for stages in (1, 2):
        cfg = build_cluster_config(ServeOptions(model=BUNDLED_MODEL, stages=stages), tmp_path)
        assert cfg.num_blocks * cfg.block_size >= cfg.max_num_seqs * limit     # every slot can hold a full context


def test_default_micro_batches_count_each_gpu_once():
    """Stages sharing one GPU take turns on it, so they get one micro-batch between them; CPU stages, GPUs of
    another host (tcp endpoints) and other GPUs each count; an explicit `microbatches` wins."""
    from shared.cluster_config import ClusterConfig, StageSpec

    def count(devices, endpoints=None, **kw):
        endpoints = endpoints or [f"ipc:///tmp/s{i}" for i in range(len(devices))]
        stages = [StageSpec(i, i + 1, e, d) for i, (d, e) in enumerate(zip(devices, endpoints))]
        return ClusterConfig(model="m", stages=stages, gateway_endpoint="ipc:///tmp/g", **kw).num_microbatches

    assert count(["cpu", "cpu", "cpu"]) == 3
    assert count(["cuda:0", "cuda:0"]) == 1 and count(["cuda", "cuda:0"]) == 1
    assert count(["cuda:0", "cuda:1", "cuda:0"]) == 2
    assert count(["cuda:0", "cuda:0"], ["tcp://10.0.0.1:5560", "tcp://10.0.0.2:5560"]) == 2
    assert count(["cuda:0", "cuda:0"], microbatches=2) == 2


def test_the_supervisor_restarts_the_ple_service_s_stages_once():
    """A dead PLE service is restarted with the stages holding PLE layers (they map its ring at start). The stage
    process that restart replaced must not then look dead itself in the same pass of `Supervisor.check`: that
    restarted stage 0 a second time two seconds later, killing the fresh one."""
    from types import SimpleNamespace

    from gateway.launcher import Supervisor

    class Proc:
        def __init__(self, code=None):
            self.code = code

        def poll(self):
            return self.code

        @property
        def returncode(self):
            return self.code

    restarted = []

    def restart(name):
        restarted.append(name)
        old = cluster.procs["stage0"]
        old.code = 0                                  # terminated by the restart (SIGTERM, exit 0)
        cluster.procs["ple"], cluster.procs["stage0"] = Proc(), Proc()
        return ["stage0"]

    cluster = SimpleNamespace(procs={"gateway": Proc(), "ple": Proc(-9), "stage0": Proc(), "stage1": Proc()},
                              started_at={}, restarts={}, restart=restart, down_components=lambda: None,
                              cluster=SimpleNamespace(restart_limit=5, start_timeout=300.0, heartbeat_timeout=2.5))
    sup = Supervisor(cluster)
    sup.check(now=100.0)                              # the PLE service is due in 1 s
    sup.check(now=102.0)                              # restarted, with stage 0
    sup.check(now=110.0)
    assert restarted == ["ple"] and sup.due == {}


def test_env_overrides_parse_each_key_by_its_type_and_name_bad_values(monkeypatch):
    """Every MOEPIPE_* switch is parsed as its config field's type; a typo is an error naming the variable (before,
    MOEPIPE_CUDA_GRAPHS=ture silently meant "on" and MOEPIPE_MICROBATCHES=two raised a bare ValueError)."""
    import typing

    from shared import cluster_config as cc

    hints = typing.get_type_hints(cc.ClusterConfig)
    samples = {int: ("3", 3, "two"), float: ("0.5", 0.5, "half"), bool: ("off", False, "ture"), str: ("x", "x", None)}
    for env, key in cc._ENV.items():
        monkeypatch.delenv(env, raising=False)
    for env, key in cc._ENV.items():
        kind = hints[key]
        if key == "api_key":
            kind = str          # str | list[str]: a variable holds one key (as VLLM_API_KEY), --api-key several
        if typing.get_origin(kind) is list:
            monkeypatch.setenv(env, " a , b,")
            assert cc.env_overrides()[key] == ["a", "b"], env
        else:
            good, parsed, bad = ("half", "float16", "x") if key == "dtype" else samples[kind]   # vLLM's names too
            monkeypatch.setenv(env, good)
            got = cc.env_overrides()[key]
            assert got == parsed and type(got) is kind, (env, got)
            if bad is not None:
                monkeypatch.setenv(env, bad)
                with pytest.raises(ClusterConfigError, match=f"{env}='{bad}': expected"):
                    cc.env_overrides()
                monkeypatch.setenv(env, "")          # VAR= means not set, not "on" and not an error
                assert key not in cc.env_overrides()
        monkeypatch.delenv(env)
    monkeypatch.setenv("MOEPIPE_CUDA_GRAPHS", " YES ")
    assert cc.env_overrides() == {"cuda_graphs": True}


def test_count_variables_take_the_suffixes_their_flags_take(monkeypatch):
    """--max-num-batched-tokens 8k worked and MOEPIPE_MAX_NUM_BATCHED_TOKENS=8k was "expected a whole number": the
    two count variables whose flags take vLLM's suffixes take them too; the other counts stay plain numbers."""
    from shared import cluster_config as cc

    for env in cc._ENV:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("MOEPIPE_MAX_NUM_BATCHED_TOKENS", "8k")
    monkeypatch.setenv("MOEPIPE_KV_CACHE_MEMORY_BYTES", "2G")
    assert cc.env_overrides() == {"max_num_batched_tokens": 8000, "kv_cache_memory_bytes": 2 << 30}
    monkeypatch.setenv("MOEPIPE_KV_CACHE_MEMORY_BYTES", "1.5G")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_KV_CACHE_MEMORY_BYTES='1.5G': upper-case G is 1024\\^3, whole numbers only"):
        cc.env_overrides()
    monkeypatch.delenv("MOEPIPE_KV_CACHE_MEMORY_BYTES")
    monkeypatch.delenv("MOEPIPE_MAX_NUM_BATCHED_TOKENS")
    monkeypatch.setenv("MOEPIPE_MICROBATCHES", "2k")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_MICROBATCHES='2k': expected a whole number$"):
        cc.env_overrides()


def test_gil_switch_interval_is_validated_and_applied(monkeypatch):
    """gil_switch_interval_ms (MOEPIPE_GIL_SWITCH_INTERVAL_MS): a bad value is named; the gateway sets the
    interpreter's switch interval from it, and 0 leaves Python's default alone."""
    import sys

    from gateway.main import apply_switch_interval

    raw = {"model": "m", "gateway_endpoint": "ipc://g", "stages": [{"start": 0, "end": 3, "endpoint": "ipc://a"}]}
    assert cluster_from_dict(raw).gil_switch_interval_ms == 0.5
    with pytest.raises(ClusterConfigError, match="gil_switch_interval_ms must be in"):
        cluster_from_dict({**raw, "gil_switch_interval_ms": -1.0}).validate()
    before = sys.getswitchinterval()
    try:
        apply_switch_interval(0.25)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        apply_switch_interval(0)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:
        sys.setswitchinterval(before)


def test_a_gpu_serve_prefills_in_larger_chunks_unless_told(tiny, tmp_path, monkeypatch):
    """`--device cuda` without --max-num-batched-tokens takes GPU_MAX_NUM_BATCHED_TOKENS (a 512-token GPU chunk is
    launch- and weight-read-bound); the CPU keeps 512; the flag and MOEPIPE_MAX_NUM_BATCHED_TOKENS still decide."""
    import torch

    from shared.cluster_config import GPU_MAX_NUM_BATCHED_TOKENS

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert GPU_MAX_NUM_BATCHED_TOKENS > 512
    gpu = build_cluster_config(ServeOptions(model=tiny, device="cuda"), tmp_path)
    assert gpu.max_num_batched_tokens == GPU_MAX_NUM_BATCHED_TOKENS
    assert build_cluster_config(ServeOptions(model=tiny), tmp_path).max_num_batched_tokens == 512
    told = ServeOptions(model=tiny, device="cuda", extra={"max_num_batched_tokens": 256})
    assert build_cluster_config(told, tmp_path).max_num_batched_tokens == 256
    monkeypatch.setenv("MOEPIPE_MAX_NUM_BATCHED_TOKENS", "1024")
    assert build_cluster_config(ServeOptions(model=tiny, device="cuda"), tmp_path).max_num_batched_tokens == 1024


def test_the_processes_take_the_launcher_s_values_not_the_environment_again(tiny, tmp_path, monkeypatch):
    """A flag given beside its variable: the launcher resolves the flag, writes the file, and starts its children
    without the MOEPIPE_* switches (`child_environment`), so they read the file's value rather than applying the
    variable over it again; other variables pass through."""
    from shared.cluster_config import child_environment

    monkeypatch.setenv("MOEPIPE_MAX_NUM_BATCHED_TOKENS", "512")
    monkeypatch.setenv("MOEPIPE_PROFILE", "/tmp/p")              # not a config switch: the children still see it
    cfg = build_cluster_config(ServeOptions(model=tiny, extra={"max_num_batched_tokens": 2048}), tmp_path)
    assert cfg.max_num_batched_tokens == 2048
    path = tmp_path / "cluster.toml"
    path.write_text(dump_toml(cfg))
    assert load_cluster_config(path).max_num_batched_tokens == 512         # what a child with the variable read
    child = child_environment(dict(__import__("os").environ))
    assert "MOEPIPE_MAX_NUM_BATCHED_TOKENS" not in child and child["MOEPIPE_PROFILE"] == "/tmp/p"
    monkeypatch.delenv("MOEPIPE_MAX_NUM_BATCHED_TOKENS")
    assert load_cluster_config(path).max_num_batched_tokens == 2048        # ... and what the launcher's child reads


def test_a_kv_pool_or_a_length_the_model_cannot_serve_is_refused_at_start(tiny, tmp_path):
    """An explicit --num-blocks smaller than one max_model_len sequence (a request that cannot fit waited at the head
    of the queue forever, and every request behind it, /health still 200): refused with a set --max-model-len (as
    vLLM does), an unset one fitted to the pool; a --max-model-len past what the model serves is refused; linear and
    YaRN scaling extend that limit by their factor, dynamic NTK does not."""
    import dataclasses

    from shared.model_config import load_config

    cfg = load_config(tiny)
    limit = cfg.max_position_embeddings
    with pytest.raises(ClusterConfigError, match=r"num_blocks 1 x block_size 16 = 16 KV tokens cannot hold one "
                                                 r"sequence of max_model_len 64: raise --num-blocks to at least 4"):
        build_cluster_config(ServeOptions(model=tiny, extra={"num_blocks": 1, "block_size": 16,
                                                             "max_model_len": 64}), tmp_path)
    fitted = build_cluster_config(ServeOptions(model=tiny, extra={"num_blocks": 2, "block_size": 16}), tmp_path)
    assert (fitted.num_blocks, fitted.max_model_len) == (2, 32)        # unset: what the pool holds
    assert load_cluster_config(_written(fitted, tmp_path)).for_model(cfg) == fitted
    with pytest.raises(ClusterConfigError, match=f"max_model_len {limit + 1} is longer than this model serves: "
                                                 f"{limit}"):
        build_cluster_config(ServeOptions(model=tiny, extra={"max_model_len": limit + 1}), tmp_path)
    for kind, factor, serves in (("linear", 2.0, 2 * limit), ("dynamic", 2.0, limit),
                                 ("yarn", 4.0, 4 * limit)):
        scaled = dataclasses.replace(cfg, rope_scaling={"rope_type": kind, "factor": factor,
                                                        "original_max_position_embeddings": limit})
        assert scaled.longest_context == serves, kind


def test_tokenizer_and_generation_config_problems_stop_serve_before_any_stage_starts(tiny, tmp_path):
    """The gateway reads them at its start, after every stage has loaded its weights (minutes on a large model), and
    a problem there was a traceback: the launcher (`Cluster`, before it starts any process) names it instead."""
    import shutil

    from gateway.launcher import Cluster

    ck = tmp_path / "ck"
    shutil.copytree(tiny, ck)
    (ck / "generation_config.json").write_text("{bad")
    with pytest.raises(ValueError, match="cannot read .*generation_config.json"):
        Cluster(ServeOptions(model=ck, run_dir=tmp_path / "r1"))
    (ck / "generation_config.json").unlink()
    (ck / "tokenizer.json").write_text("garbage")
    with pytest.raises(ValueError, match="cannot load .*tokenizer.json"):
        Cluster(ServeOptions(model=ck, run_dir=tmp_path / "r2"))
    (ck / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        Cluster(ServeOptions(model=ck, run_dir=tmp_path / "r3"))


@pytest.mark.parametrize("extra,match", [({"max_model_len": -1}, "max_model_len must be >= 1, or 0"),
                                         ({"kv_cache_memory": float("inf")}, "kv_cache_memory must be"),
                                         ({"kv_cache_memory": float("nan")}, "kv_cache_memory must be"),
                                         ({"vram_limit": float("inf")}, "must be finite"),
                                         ({"max_num_seqs": 10 ** 9}, "more than 16384 sequences"),
                                         ({"expert_move_margin": float("nan")}, "expert_move_interval must be")])
def test_lengths_and_sizes_that_cannot_be_served_are_named(tiny, tmp_path, extra, match):
    """(QA, 2026-12-05) --max-model-len -1 started a server whose every request was a 400; --kv-cache-memory inf was
    an OverflowError traceback."""
    with pytest.raises(ClusterConfigError, match=match):
        build_cluster_config(ServeOptions(model=tiny, extra=extra), tmp_path)


def test_strings_round_trip_through_toml_whatever_characters_they_hold(tmp_path):
    """dump_toml wrote a string's control characters raw: `api_key = ["e\\nf"]` came back as a file tomllib refused
    ("Illegal character"). Every control character is escaped (DEL too), other characters are written as they are
    (json.dumps is no TOML writer: its \\ud83d\\ude00 surrogate pairs are refused, and with ensure_ascii=False
    DEL stays raw)."""
    import tomllib

    from shared.cluster_config import _toml_value

    odd = ["e\nf", "tab\there", 'a "quoted" word', "back\\slash", "C:\\new\\table", "ünïcødé 😀 \u2028 \u00a0",
           "\x00\x01\x1b\x1f\x7f\x80\x9f", "\r\n\b\f", "\\u0041 is not A", "'single'", "#not a comment", ""]
    for s in odd:
        text = f"v = {_toml_value(s)}\n"
        assert tomllib.loads(text) == {"v": s}, (s, text)
        assert "\n" not in text[:-1] and "\x7f" not in text, text
    raw = {"model": "m", "stages": [{"start": 0, "end": 1, "endpoint": "ipc://x"}], "gateway_endpoint": "ipc://g",
           "api_key": odd, "served_model_name": "na\tme\n", "served_model_aliases": odd[:3]}
    cfg = cluster_from_dict(raw)
    path = tmp_path / "cluster.toml"
    path.write_text(dump_toml(cfg), encoding="utf-8")
    assert load_cluster_config(path) == cfg
    with pytest.raises(ValueError, match="surrogate"):          # no UTF-8 file can hold one
        _toml_value("bad \udcff byte")
