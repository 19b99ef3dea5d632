"""Cold sets (issue 16, item 2; shared/cold_set.py, `moepipe cold-set`): kind-normalised counts, per-stage budgets,
the file and its checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import moepipe
from shared import cold_set
from shared.model_config import load_config

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "bench" / "traces" / "demo-model" / "route_usage.json"


def _usage(layers: int, experts: int, hot: range, tokens: int) -> dict[str, list[int]]:
    """Counts where the `hot` experts take every selection."""
    return {str(layer): [tokens if e in hot else 0 for e in range(experts)] for layer in range(layers)}


def test_each_kind_weighs_the_same_whatever_its_token_count():
    usage = {"code": _usage(2, 8, range(0, 4), 1000), "prose": _usage(2, 8, range(4, 8), 10)}
    scores = cold_set.kind_normalised(usage)
    assert scores[0][0] == pytest.approx(scores[0][4])            # one kind's hot expert = the other's
    assert sum(sum(row) for row in scores.values()) == pytest.approx(2.0)


def test_experts_are_taken_from_the_lowest_sum_within_each_stage_budget():
    scores = {0: [0.5, 0.1, 0.2, 0.9], 1: [0.05, 0.3, 0.8, 0.7], 2: [0.4, 0.01, 0.6, 0.2], 3: [0.3, 0.3, 0.1, 0.9]}
    cold = cold_set.choose(scores, [(0, 2), (2, 4)], per_expert=100, budget_bytes=250)
    assert cold == {0: [1], 1: [0], 2: [1], 3: [2]}                # two per stage: 250 bytes hold two experts
    assert cold_set.choose(scores, [(0, 4)], per_expert=100, budget_bytes=99) == {}


def test_a_mixed_cold_set_reads_less_on_the_kind_a_single_kind_set_ignores():
    """000 §3: chosen from one kind only, the cold set holds what the other kind uses."""
    usage = {"code": _usage(4, 16, range(0, 6), 500), "prose": _usage(4, 16, range(6, 12), 500)}
    tokens = {"code": 100, "prose": 100}
    stages, per, budget = [(0, 4)], 10, 10 * 16          # 4 experts per layer on average
    mixed = cold_set.choose(cold_set.kind_normalised(usage), stages, per, budget)
    code_only = cold_set.choose(cold_set.kind_normalised({"code": usage["code"]}), stages, per, budget)
    assert cold_set.host_reads(mixed, usage, tokens)["prose"] < cold_set.host_reads(code_only, usage, tokens)["prose"]


def test_moepipe_cold_set_writes_a_file_the_checks_accept(tmp_path):
    out = tmp_path / "cold.json"
    r = moepipe("cold-set", "--usage", str(TRACE), "--stages", "2", "--gib-per-stage", "0.002", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "host expert reads per token" in r.stdout
    data = json.loads(out.read_text())
    from shared.cli import ensure_builtin_model

    cfg = load_config(ensure_builtin_model())
    cold = cold_set.load(out, cfg)
    for stage in data["stages"]:
        s, e = stage["layers"]
        n = sum(len(ids) for layer, ids in cold.items() if s <= layer < e)
        assert 0 < n * data["expert_bytes"] == stage["cold_bytes"] <= stage["budget_bytes"]
    bad = tmp_path / "bad.json"
    for layers, match in [({"99": [1]}, "not a MoE layer"), ({"0": [1, 1]}, "distinct"),
                          ({"0": list(range(cfg.num_experts))}, "all"), ([[0, 1]], "must map layer numbers"),
                          ({"\u00b2": [1]}, "not a MoE layer")]:          # "²".isdigit(), but not a number
        bad.write_text(json.dumps({**data, "layers": layers}))
        with pytest.raises(cold_set.ColdSetError, match=match):
            cold_set.load(bad, cfg)
    bad.write_text(json.dumps({**data, "num_experts": cfg.num_experts + 1}))       # another checkpoint's file
    with pytest.raises(cold_set.ColdSetError, match=f"written for a model of {cfg.num_experts + 1} experts"):
        cold_set.load(bad, cfg)
    assert data["shape"] == cold_set.shape(cfg)          # the same expert count, another model: named too
    bad.write_text(json.dumps({**data, "shape": {**data["shape"], "hidden_size": cfg.hidden_size * 2}}))
    with pytest.raises(cold_set.ColdSetError, match="written for another model .its hidden_size"):
        cold_set.load(bad, cfg)
    bad.write_text(json.dumps({**data, "layers": {"0": [True]}}))                   # JSON true is not expert 1
    with pytest.raises(cold_set.ColdSetError, match="distinct integers"):
        cold_set.load(bad, cfg)
    no_shape = dict(data)
    del no_shape["shape"]
    bad.write_text(json.dumps(no_shape))                 # an older file: still taken
    assert cold_set.load(bad, cfg) == cold
    bad.write_text("{}")
    with pytest.raises(cold_set.ColdSetError, match="format"):
        cold_set.load(bad, cfg)
    r = moepipe("cold-set", "--usage", str(bad), "--gib-per-stage", "1", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "route_usage.json" in r.stderr


def test_route_stats_counts_every_token_of_every_kind_and_feeds_cold_set(tmp_path):
    """`moepipe route-stats` on two kinds of text: every MoE layer counts top_k selections per token, and its file
    is what `moepipe cold-set` takes."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.py").write_text("def f(x):\n    return [i * i for i in range(x)]\n" * 20)
    (tmp_path / "prose.txt").write_text("The river ran quietly past the old mill, and nobody saw the boat. " * 20)
    usage = tmp_path / "usage.json"
    r = moepipe("route-stats", "--text", f"code={tmp_path / 'code'}", "--text", f"prose={tmp_path / 'prose.txt'}",
                "--tokens-per-kind", "300", "--chunk", "128", "--out", str(usage))
    assert r.returncode == 0, r.stderr
    data = json.loads(usage.read_text())
    top_k = data["meta"]["config"]["top_k"]
    for kind in ("code", "prose"):
        tokens = data["meta"]["tokens_per_kind"][kind]
        assert 0 < tokens <= 300
        assert all(sum(row) == tokens * top_k for row in data["usage"][kind].values())
    out = tmp_path / "cold.json"
    r = moepipe("cold-set", "--usage", str(usage), "--gib-per-stage", "0.002", "--out", str(out))
    assert r.returncode == 0, r.stderr
    from shared.cli import ensure_builtin_model

    assert cold_set.load(out, load_config(ensure_builtin_model()))
    r = moepipe("route-stats", "--text", "nokind", "--out", str(usage))
    assert r.returncode == 2 and "KIND=PATH" in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")                         # counted as one end-of-sequence token before (QA, 2026-12-05)
    r = moepipe("route-stats", "--text", f"code={empty}", "--out", str(usage))
    assert r.returncode == 2 and "hold no text" in r.stderr, r.stderr
    r = moepipe("cold-set", "--usage", str(TRACE), "--gib-per-stage", "inf", "--out", str(tmp_path / "c.json"))
    assert r.returncode == 2 and "--gib-per-stage must be a positive number" in r.stderr, r.stderr


def test_cold_set_sizes_a_block_fp8_checkpoint_s_experts_as_the_server_keeps_them(fp8_dirs, tmp_path):
    """`moepipe cold-set` counts block-FP8 experts at the size a stage with cold experts holds them: dequantized to
    the compute dtype by default, float8 bytes and block scales with the float8 tables on (fp8_expert_tables)."""
    model = fp8_dirs["qwen3_next"]
    cfg = load_config(model)
    usage = tmp_path / "route_usage.json"
    counts = {layer: row for layer, row in _usage(cfg.num_hidden_layers, cfg.num_experts, range(2), 50).items()
              if cfg.is_sparse_moe(int(layer))}                  # route-stats counts the MoE layers only
    usage.write_text(json.dumps({"usage": {"code": counts}, "meta": {"tokens_per_kind": {"code": 50}}}))
    sizes = {}
    for tables in ("0", "1"):
        out = tmp_path / f"cold{tables}.json"
        r = moepipe("cold-set", "--model", str(model), "--usage", str(usage), "--gib-per-stage", "0.0001", "--out",
                    str(out), env={"MOEPIPE_FP8_EXPERT_TABLES": tables})
        assert r.returncode == 0, r.stderr
        sizes[tables] = json.loads(out.read_text())["expert_bytes"]
    assert sizes == {"0": cold_set.expert_bytes(cfg), "1": cold_set.fp8_expert_bytes(cfg, (128, 128))}
    assert sizes["1"] < sizes["0"]


def test_counts_of_another_model_are_refused_and_no_layer_goes_all_to_host(tmp_path):
    """(QA, 2026-12-05) A budget that holds every expert wrote a file the server then refused (`choose` did not keep
    one expert a layer in VRAM); counts of another checkpoint (a dense layer counted as MoE, another expert count)
    were accepted by cold-set, and beside a checkpoint `--cold-experts auto` indexed past them (IndexError)."""
    from shared.cli import ensure_builtin_model

    cfg = load_config(ensure_builtin_model())
    E, L = cfg.num_experts, cfg.num_hidden_layers
    scores = {layer: [1.0 / (e + 1) for e in range(E)] for layer in range(L)}
    cold = cold_set.choose(scores, [(0, L)], 1, budget_bytes=10 ** 9)        # room for every expert
    assert all(len(ids) == E - 1 for ids in cold.values()) and len(cold) == L
    assert cold_set.choose(scores, [(0, L)], 1, budget_bytes=L)   # a small budget: the least used first
    cold_set.check_scores(scores, cfg, "ok")
    with pytest.raises(cold_set.ColdSetError, match=r"x: the counts of layers \[0\]"):
        cold_set.check_scores({**scores, 0: [1.0] * (E + 1)}, cfg, "x")
    from shared.model_config import Qwen3NextConfig

    dense = Qwen3NextConfig(num_hidden_layers=L, num_experts=E, mlp_only_layers=[0],
                            layer_types=["linear_attention"] * (L - 1) + ["full_attention"])
    with pytest.raises(cold_set.ColdSetError, match=r"the counts of layers \[0\] do not match"):
        cold_set.check_scores(scores, dense, "y")
