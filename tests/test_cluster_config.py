"""The cluster config file: round trip, validation messages, environment switches."""

from __future__ import annotations

import pytest

from gateway.launcher import ServeOptions, build_cluster_config
from shared.cluster_config import (ClusterConfigError, cluster_from_dict, dump_toml, load_cluster_config,
                                   split_layers)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stage_worker.checkpoint.make_model import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny"))


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
    with pytest.raises(ClusterConfigError, match="dtype 'bf16' must be float32, bfloat16, float16"):
        build_cluster_config(ServeOptions(model=tiny, stages=2), tmp_path)


def test_serve_load_format_reaches_the_cluster_config(tiny, tmp_path):
    from shared.cli import build_parser, serve_options

    opts = serve_options(build_parser().parse_args(["serve", "--model", str(tiny), "--stages", "2",
                                                    "--load-format", "dummy"]))
    assert build_cluster_config(opts, tmp_path).load_format == "dummy"
    opts = serve_options(build_parser().parse_args(["serve", "--model", str(tiny)]))
    assert build_cluster_config(opts, tmp_path).load_format == "safetensors"
