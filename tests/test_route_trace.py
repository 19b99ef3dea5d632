"""tools/route_trace.py on the tiny preset (random weights, 16 experts, top-4) and a tiny real corpus: the CLI
end to end, prefill routing equal to token-by-token decode routing, usage counts equal to the trace's bincounts, and
the summary's numbers in range and consistent."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import route_trace as rt  # noqa: E402
from conftest import small_corpus  # noqa: E402
from stage_worker.route_stats import read_ids  # noqa: E402

CHUNK = 160          # > the tiny model's QSA budget (64 tokens), so decode reads a sparse selection of blocks
TOKENS = 400         # per kind: windows of 160, 160 and a partial 80
BATCH = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny real corpus: conftest.small_corpus (0.2 MB a kind), the one test_train_demo.py trains on."""
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def traced(corpus, tmp_path_factory, tiny_checkpoint):
    """The CLI end to end on the tiny preset (float32: prefill and decode routing compare exactly): its main, in
    this process (a subprocess paid a fresh torch import)."""
    out = tmp_path_factory.mktemp("routes")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert rt.main(["--corpus", str(corpus), "--model", str(tiny_checkpoint), "--out", str(out),
                        "--tokens-per-kind", str(TOKENS), "--chunk", str(CHUNK), "--batch", str(BATCH),
                        "--threads", "1"]) == 0
    return out, printed.getvalue()


def test_cli_writes_trace_and_usage(traced, corpus):
    out, stdout = traced
    assert "least10%" in stdout and "JSD (bits)" in stdout
    meta, ids, toks = rt.load_trace(out)
    assert meta["format"] == rt.FORMAT
    assert meta["kinds"] == ["code", "prose", "docs", "german"]
    cfg = meta["config"]
    assert (cfg["num_experts"], cfg["top_k"], cfg["moe_layers"]) == (16, 4, list(range(6)))
    assert meta["corpus_raw_sha256"] == json.loads((corpus / "corpus.json").read_text())["raw_sha256"]
    assert meta["chunk"] == CHUNK and meta["ids_dtype"] == "uint8"
    for kind in meta["kinds"]:
        assert meta["tokens_per_kind"][kind] == TOKENS
        assert ids[kind].dtype == np.uint8 and ids[kind].shape == (TOKENS, 6, 4)
        assert toks[kind].dtype == np.int32 and toks[kind].shape == (TOKENS,)
        assert ids[kind].max() < 16
        # top-k: k distinct experts per token and layer
        assert (np.diff(np.sort(ids[kind], axis=-1), axis=-1) > 0).all()
    # tokens are the kind's documents in corpus order, joined by EOS
    from build_corpus import iter_documents
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(meta["model"])
    first = next(text for kind, _, text, _ in iter_documents(corpus) if kind == "prose")
    expect = (tok.encode(first) + [meta["eos_token_id"]])[:TOKENS]
    assert toks["prose"][:len(expect)].tolist() == expect
    with np.load(out / rt.TRACE_FILE) as data:
        assert sorted(data.files) == sorted(["meta"] + [f"{p}:{k}" for k in meta["kinds"] for p in ("ids", "tokens")])


def test_prefill_routing_equals_decode_routing(traced):
    """The property the tool relies on: prefilling a window selects, at every position and layer, the experts that
    decoding the same tokens one at a time selects. The tiny model in float32 on the CPU gives identical ids (and
    order) everywhere, so the check is exact. Windows 1 and 2 were prefilled at batch positions 1 and 2 of their
    step (2 is the partial last window), so this also checks the rows of several sequences in one step."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine

    out, _ = traced
    meta, ids, toks = rt.load_trace(out)
    model = load_model(meta["model"], LoadOptions(device="cpu"))
    moes = rt.moe_layers(model)
    for kind, w in (("code", 0), ("german", 1), ("docs", 2)):
        window = toks[kind][w * CHUNK:(w + 1) * CHUNK].tolist()
        rows = []
        with torch.inference_mode():
            engine = LocalEngine([model], max_seqs=1, max_tokens=CHUNK)
            engine.add(0)
            for t in window:                      # a 1-token prompt, then one token per step
                engine.step([(0, [t])])
                rows.append(read_ids(moes, 1)[0].numpy())
        decoded = np.stack(rows)
        prefilled = ids[kind][w * CHUNK:w * CHUNK + len(window)].astype(np.int64)
        assert decoded.shape == prefilled.shape
        assert (decoded[:, 0] == prefilled[:, 0]).all(), f"{kind} window {w}: first layer differs"
        assert (decoded == prefilled).all(), \
            f"{kind} window {w}: {(decoded != prefilled).any(axis=(1, 2)).sum()} positions differ"


def test_usage_counts_are_bincounts_and_summary_is_consistent(traced):
    out, _ = traced
    meta, ids, _ = rt.load_trace(out)
    usage = json.loads((out / rt.USAGE_FILE).read_text())
    assert usage["meta"] == meta
    layers = [str(i) for i in meta["config"]["moe_layers"]]
    for kind in meta["kinds"]:
        assert list(usage["usage"][kind]) == layers
        for l, idx in enumerate(layers):
            expect = np.bincount(ids[kind][:, l, :].reshape(-1), minlength=16)
            assert usage["usage"][kind][idx] == expect.tolist()
            assert sum(usage["usage"][kind][idx]) == TOKENS * 4
    s = usage["summary"]
    pairs = {"code|docs", "code|german", "code|prose", "docs|german", "docs|prose", "german|prose"}
    for idx in layers:
        r = s["layers"][idx]
        assert 0.0 <= r["least10_share"] <= 0.1 <= r["most10_share"] <= 1.0
        assert 0.0 < r["entropy_rel"] <= 1.0
        assert set(r["jsd_bits"]) == pairs and all(0.0 <= v <= 1.0 for v in r["jsd_bits"].values())
        # recompute from the counts
        total = np.sum([usage["usage"][k][idx] for k in meta["kinds"]], axis=0)
        assert r["least10_share"] == pytest.approx(rt.lorenz_share(total, 0.1))
        assert r["most10_share"] == pytest.approx(1 - rt.lorenz_share(total, 0.9))
        assert r["jsd_bits"]["code|prose"] == pytest.approx(
            rt.jsd_bits(usage["usage"]["code"][idx], usage["usage"]["prose"][idx]))
    m = s["mean"]
    assert 0.0 <= m["least10_share"] <= 0.1 <= m["most10_share"] <= 1.0 and 0.0 < m["entropy_rel"] <= 1.0
    for p in pairs:
        assert m["jsd_bits"][p] == pytest.approx(np.mean([s["layers"][i]["jsd_bits"][p] for i in layers]))
    assert set(s["per_kind"]) == set(meta["kinds"])


def test_statistics_on_known_distributions():
    uniform = np.full(16, 5)
    assert rt.lorenz_share(uniform, 0.1) == pytest.approx(0.1)
    assert 1 - rt.lorenz_share(uniform, 0.9) == pytest.approx(0.1)
    assert rt.entropy_rel(uniform) == pytest.approx(1.0)
    one = np.zeros(16)
    one[3] = 7
    assert rt.lorenz_share(one, 0.1) == 0.0 and 1 - rt.lorenz_share(one, 0.9) == pytest.approx(1.0)
    assert rt.entropy_rel(one) == 0.0
    # 10 experts: the least-used 10% is exactly the least-used expert
    ten = np.arange(1, 11)
    assert rt.lorenz_share(ten, 0.1) == pytest.approx(1 / 55)
    assert 1 - rt.lorenz_share(ten, 0.9) == pytest.approx(10 / 55)
    a, b = np.array([1, 0, 0, 0]), np.array([0, 0, 2, 0])
    assert rt.jsd_bits(a, b) == pytest.approx(1.0)
    assert rt.jsd_bits(a, 3 * a) == pytest.approx(0.0)
    assert 0 < rt.jsd_bits(np.array([3, 1]), np.array([1, 3])) < 1
