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


# ---- predictions one layer ahead (stage_worker/route_stats.py, --predict, --add-predictions) -------------------

def _direct_predictions(model, wins: list[list[int]], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, predictions) computed directly from inputs captured by hooks of this test's own: every SparseMoE's
    input, and the hidden state entering the first MoE layer's decoder layer (the input of its first norm: the
    attention hyper-connection's or the input layernorm, no pending update before layer 0)."""
    moes = rt.moe_layers(model)
    first = model.layers[str(moes[0][0])]
    assert moes[0][0] == 0 and getattr(first, "ple", None) is None      # the hidden state is the norm's input
    seen: dict[int, list[torch.Tensor]] = {i: [] for i, _ in moes}
    entering: list[torch.Tensor] = []
    norm = first.attn_hyper_connection.hc_norm if first.hyper else first.input_layernorm
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].detach().clone()))
             for i, m in moes]
    hooks.append(norm.register_forward_pre_hook(lambda mod, args: entering.append(args[0].detach().clone())))
    try:
        ids = rt.trace_windows(model, wins, batch)
    finally:
        for h in hooks:
            h.remove()
    k = moes[0][1].top_k

    def top(moe, x):
        return torch.sort(moe.gate(x).float(), dim=-1, descending=True, stable=True).indices[:, :k].numpy()

    with torch.inference_mode():
        h = torch.cat(entering)
        x0 = first.mlp_hyper_connection.mix(h)[0] if first.hyper else first.post_attention_layernorm(h)
        pred = [top(moes[0][1], x0)] + [top(moes[l][1], torch.cat(seen[moes[l - 1][0]])) for l in range(1, len(moes))]
        actual = np.stack([top(m, torch.cat(seen[i])) for i, m in moes], axis=1)
    assert (actual == ids).all()              # the captured inputs are the ones the layers routed
    return ids, np.stack(pred, axis=1)


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    """A plain pre-norm residual MoE (no hyper-connections): transformers' tiny Qwen3-Next, random weights."""
    pytest.importorskip("transformers")
    from hf_oracle import save_reference

    out = tmp_path_factory.mktemp("q3n")
    save_reference("qwen3_next", out, seed=0)
    return out


@pytest.mark.parametrize("which", ["tiny", "qwen3_next"])
def test_predictions_are_the_next_routers_top_k_on_the_previous_input(which, traced, tiny_checkpoint, request):
    """`trace_windows(predict=k)`: layer l's prediction is layer l's router on MoE layer l-1's input (captured
    independently), the first layer's its router on the normed hidden state entering its decoder layer, top-k best
    first; the selected ids are those of a trace without predictions. Hyper-connection streams (the tiny preset) and
    a plain residual (Qwen3-Next), several windows a step."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    path = tiny_checkpoint if which == "tiny" else request.getfixturevalue("qwen3_next_dir")
    model = load_model(path, LoadOptions(device="cpu", dtype=torch.float32))
    _, _, toks = rt.load_trace(traced[0])
    vocab = model.cfg.vocab_size
    wins = [[t % vocab for t in toks[kind][:n].tolist()] for kind, n in (("code", 50), ("prose", 37), ("docs", 50))]
    k = rt.moe_layers(model)[0][1].top_k
    ids, pred = rt.trace_windows(model, wins, 2, predict=k)
    want_ids, want_pred = _direct_predictions(model, wins, 2)
    assert pred.shape == ids.shape == (137, len(rt.moe_layers(model)), k)
    assert (ids == want_ids).all()
    assert (pred == want_pred).all()
    wide = rt.trace_windows(model, wins, 2, predict=2 * k)[1]
    assert (wide[..., :k] == pred).all()                # router order: top-k is top-2k's first k
    # a real predictor, not a copy: later layers' predictions differ from their selections somewhere
    assert (pred != ids).any()


def test_add_predictions_round_trips(traced, corpus, tiny_checkpoint, tmp_path):
    """--add-predictions on a trace made without them: every stored array kept byte for byte, the recomputed ids
    equal the stored ones (same model and dtype: 100%), and the predictions equal a --predict trace's."""
    out, _ = traced
    trace = tmp_path / rt.TRACE_FILE
    trace.write_bytes((out / rt.TRACE_FILE).read_bytes())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert rt.main(["--add-predictions", str(tmp_path), "--model", str(tiny_checkpoint), "--batch", "3",
                        "--threads", "1"]) == 0
    assert "100.00% of rows" in printed.getvalue()
    meta0, ids0, toks0 = rt.load_trace(out)
    assert rt.load_trace(out, predictions=True)[3] == {}
    meta, ids, toks, pred = rt.load_trace(trace, predictions=True)
    note = meta.pop("predictions")
    assert meta == meta0
    assert note["ids_agreement"]["code"]["rows"] == 1.0 and note["made_with_ids"] is False
    with np.load(out / rt.TRACE_FILE) as a, np.load(trace) as b:
        assert sorted(b.files) == sorted(a.files + [f"pred:{k}" for k in meta["kinds"]])
        for key in a.files:
            if key != "meta":
                assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key
    with contextlib.redirect_stdout(io.StringIO()):
        assert rt.main(["--corpus", str(corpus), "--model", str(tiny_checkpoint), "--out", str(tmp_path / "p"),
                        "--tokens-per-kind", str(TOKENS), "--chunk", str(CHUNK), "--batch", str(BATCH),
                        "--threads", "1", "--predict"]) == 0
    _, ids2, _, pred2 = rt.load_trace(tmp_path / "p", predictions=True)
    for kind in meta["kinds"]:
        assert pred[kind].dtype == ids[kind].dtype and pred[kind].shape == ids[kind].shape
        assert (ids2[kind] == ids[kind]).all() and (pred2[kind] == pred[kind]).all()
