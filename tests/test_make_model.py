"""`moepipe make-model` writes checkpoints that transformers reads as the same model, and `generate` runs on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import moepipe
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    res = moepipe("make-model", "--preset", "tiny", "--out", str(out), "--seed", "3")
    assert res.returncode == 0, res.stderr
    return out


def test_tiny_checkpoint_is_complete(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen4_exp_text" and cfg["ple_layer_ids"] and cfg["indexer_budget"]
    assert cfg["mtp_num_hidden_layers"] == 1
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == cfg["eos_token_id"]
    assert sum(p.stat().st_size for p in tiny.iterdir()) < 20 << 20       # "a few MB"
    from safetensors import safe_open

    with safe_open(tiny / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in keys
    assert "mtp.fc.weight" in keys and "mtp.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight" in keys
    # every file as the umask allows (safetensors writes 600: a checkpoint made by root could not be served by
    # another user, and the loader said "No such file or directory")
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tiny.iterdir()}
    assert modes == {name: 0o666 & ~mask for name in modes}


def test_transformers_reads_our_checkpoint_as_the_same_model(tiny):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(3, 2000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    model = load_model(tiny, LoadOptions(dtype=torch.float32))
    engine = LocalEngine([model])
    engine.add(0)
    got = engine.step([(0, ids)], all_logits=True)
    assert (got - expected).abs().max().item() < 1e-4


def test_seed_changes_weights_and_same_seed_repeats(tmp_path):
    from stage_worker.checkpoint.random_init import random_param

    a = random_param("layers.0.mlp.w13", (4, 8, 8), seed=1)
    assert torch.equal(a, random_param("layers.0.mlp.w13", (4, 8, 8), seed=1))
    assert not torch.equal(a, random_param("layers.0.mlp.w13", (4, 8, 8), seed=2))


def test_generate_end_to_end_in_a_subprocess(tiny):
    """The `moepipe` command as a user runs it (the dispatcher execs the service's command module); the other
    command tests run that module in-process."""
    res = subprocess.run([sys.executable, "-m", "shared.cli", "generate", "--model", str(tiny), "--prompt",
                          "def add(a, b):", "--max-tokens", "12", "--temperature", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "12 tokens, finish_reason=length" in res.stderr or "finish_reason=stop" in res.stderr
    chat = moepipe("generate", "--model", str(tiny), "--chat", "--prompt", "Hi", "--max-tokens", "8", "--seed", "5")
    assert chat.returncode == 0, chat.stderr


def test_generate_names_the_problem_on_bad_input(tiny, tmp_path):
    res = moepipe("generate", "--model", str(tmp_path), "--prompt", "x")
    assert res.returncode == 2 and "tokenizer.json" in res.stderr or "config.json" in res.stderr
    res = moepipe("generate", "--model", str(tiny), "--prompt", "x", "--max-tokens", "0")
    assert res.returncode == 2 and "--max-tokens" in res.stderr
    res = moepipe("make-model", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "huge" in res.stderr


def test_full_shape_writes_config_and_tokenizer_only(tmp_path):
    from stage_worker.checkpoint.make_model import make_model     # in process: the CLI is run by the tests above

    make_model("full-shape", tmp_path / "full")
    names = {p.name for p in (tmp_path / "full").iterdir()}
    assert "config.json" in names and "tokenizer.json" in names and not any(n.endswith(".safetensors") for n in names)
    from shared.model_config import load_config

    cfg = load_config(tmp_path / "full")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (48, 2560, 512, 10)
    assert (cfg.indexer_budget, cfg.indexer_compress_ratio, cfg.indexer_head_dim) == (2048, 4, 128)
    assert cfg.ple_layer_ids == [2] and cfg.vocab_size == 248320 and cfg.split_ngram_parts == 128
    from shared.ngram_hash import NgramHashSpec

    rows = NgramHashSpec.from_model_config(cfg, 0).padded_rows
    assert rows == 128 * 2_500_012 and cfg.ple_head_dim == 160     # 001 §1: 128 shards of [2500012, 160]


def test_dummy_load_format_runs_without_weight_files(tiny, tmp_path):
    for name in ("config.json",):
        (tmp_path / name).write_text((tiny / name).read_text())
    model = load_model(tmp_path, LoadOptions(load_format="dummy", seed=1))
    engine = LocalEngine([model])
    engine.add(0)
    logits = engine.step([(0, [5, 6, 7, 8])])
    assert torch.isfinite(logits).all()


def test_layers_cuts_a_preset_and_refuses_what_it_cannot_cut(tmp_path):
    from stage_worker.checkpoint.make_model import make_model

    out = make_model("full-shape", tmp_path / "fs", layers=6)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 6 and len(cfg["layer_types"]) == 6
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["indexed_attention"] + ["linear_attention"] * 2
    assert not list(out.glob("*.safetensors"))                          # full-shape stays config-only
    r = moepipe("make-model", "--preset", "tiny", "--layers", "99", "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and "--layers 99: the tiny preset has 1..6 layers" in r.stderr
    assert not (tmp_path / "bad").exists()
    r = moepipe("make-model", "--preset", "tiny", "--layers", "1", "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and "PLE layer ids" in r.stderr


def test_qwen3_next_shape_is_a_config_only_qwen3_next_checkpoint(tmp_path):
    from shared.model_config import load_config
    from stage_worker.checkpoint.make_model import QWEN3_NEXT_80B, make_model

    out = make_model("qwen3-next-shape", tmp_path / "q3n", layers=6)
    cfg = load_config(out)
    assert type(cfg).__name__ == "Qwen3NextConfig" and cfg.num_hidden_layers == 6
    assert cfg.num_experts == QWEN3_NEXT_80B["num_experts"] and cfg.hidden_size == QWEN3_NEXT_80B["hidden_size"]
    assert cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").exists()
