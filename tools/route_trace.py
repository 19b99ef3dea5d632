"""Trace which experts a checkpoint routes each token to, per corpus kind, and summarise the skew (issue 6, item 3).

    python tools/route_trace.py --corpus .corpus --out runs/routes                      # built-in model, CPU
    python tools/route_trace.py --model shared/demo_model --device cuda --out runs/routes --tokens-per-kind 300000
    python tools/route_trace.py ... --predict                   # also the predictions one layer ahead (pred:{kind})
    python tools/route_trace.py --add-predictions bench/traces/demo-model --model DIR     # add them to a trace

Text of each corpus kind (documents joined by the EOS token, as tools/train_demo.py joins them) is cut into windows
of `--chunk` tokens; each window is PREFILLED as a fresh sequence (context 0), `--batch` windows per step. The
experts chosen at a position depend only on the tokens up to it, so prefill of a text selects what decode of the
same text would (tests/test_route_trace.py checks this against token-by-token decode). After each step every
`SparseMoE`'s `last_expert_ids` ([tokens, k], rows in the step's token order) is read, in layer order.

Output, in `--out DIR`:

* `route_trace.npz` (an .npz that `numpy.load` reads, its members LZMA-compressed: `save_npz`):
  - `ids:{kind}`: uint8 [tokens, moe_layers, k] (uint16 if num_experts > 256): the expert ids token t selected in
    the l-th MoE layer (layer indices in meta's `moe_layers`), in the router's order (highest probability first);
  - `tokens:{kind}`: int32 [tokens]: the token ids, in the same order; window w is rows [w * chunk, (w+1) * chunk);
  - `pred:{kind}` (with `--predict`, or added later by `--add-predictions`): the same dtype and shape as `ids:{kind}`,
    what a prediction one layer ahead names (`stage_worker/route_stats.py`): for the l-th MoE layer the top-k of its
    router applied to the (l-1)-th MoE layer's input, best first; for the first MoE layer its router on the hidden
    state entering its decoder layer, normed as its MoE input is (no previous layer to predict from);
  - `meta`: a JSON string: format, model path, config summary (layers, moe_layers, num_experts, top_k, dtype),
    kinds, tokens per kind, chunk, split, EOS id, corpus recipe sha256 (`raw_sha256` of corpus.json), command;
    with predictions also `predictions`: how they were made (model, dtype, command; `--add-predictions`: the share
    of rows whose recomputed ids equal the stored ones, per kind).

`--add-predictions TRACE --model DIR` re-prefills a trace's stored tokens in its windows (meta's `chunk`, `--batch`
windows a step) on DIR, prints how often the recomputed ids equal the stored ones (a different checkpoint, dtype or
machine routes differently: the predictions are then of a slightly different model), and writes the trace back
with `pred:` keys added; every other array is kept as it was.
* `route_usage.json`: `meta` (as above), `usage[kind][layer]` = selections per expert (list of num_experts ints,
  equal to the bincount of `ids:{kind}[:, l, :]`), and `summary`:
  - `layers[layer]`, over all kinds together: `least10_share` / `most10_share`, the share of all selections taken by
    the least / most used 10% of experts (a fractional expert counts pro rata, so 0 <= least10 <= 0.1 <= most10
    <= 1; uniform routing gives 0.1 and 0.1); `entropy_rel`, the usage entropy over log(num_experts) (1 = uniform,
    0 = one expert); `jsd_bits[kindA|kindB]`, the Jensen-Shannon divergence in bits (in [0, 1]) between the two
    kinds' per-expert usage distributions in that layer;
  - `mean`: the same numbers averaged over layers; `jsd_bits` per pair of kinds averaged over layers;
  - `per_kind[kind]`: least10 / most10 / entropy_rel of each kind alone, averaged over layers.
  Expert offload relies on `most10_share` well above 0.1 (a hot set worth keeping resident) with no collapse
  (`least10_share` not ~0, `entropy_rel` not tiny); `jsd_bits` says how much the hot set moves between kinds.

The summary is also printed as a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_worker.local_engine import LocalEngine  # noqa: E402
from stage_worker.route_stats import moe_layers, trace_windows, usage_counts, windows  # noqa: E402

FORMAT = "moepipe-route-trace/1"
TRACE_FILE = "route_trace.npz"
USAGE_FILE = "route_usage.json"


# ---- text -> token windows ----------------------------------------------------------------------------------

def kind_streams(corpus: str | Path, tok, eos: int, tokens_per_kind: int, split: str = "all") -> dict[str, np.ndarray]:
    """{kind: int32 token stream} of at most tokens_per_kind tokens, documents in corpus order joined by EOS.
    split: "all" documents, only "heldout" ones, or only "train" (not held out) ones."""
    from build_corpus import iter_documents   # tools/ is on sys.path

    if split not in ("all", "heldout", "train"):
        raise ValueError(f"split must be all, heldout or train, not {split!r}")
    streams: dict[str, list[int]] = {}
    for kind, _path, text, held in iter_documents(corpus):
        ids = streams.setdefault(kind, [])
        if len(ids) >= tokens_per_kind or (split == "heldout" and not held) or (split == "train" and held):
            continue
        ids.extend(tok.encode(text))
        ids.append(eos)
    return {k: np.asarray(v[:tokens_per_kind], dtype=np.int32) for k, v in streams.items() if v}


# ---- statistics ---------------------------------------------------------------------------------------------

def save_npz(path: str | Path, **arrays: np.ndarray) -> None:
    """`numpy.savez_compressed` with LZMA instead of deflate (`numpy.load` reads either: both are zip members
    holding .npy files): the bundled demo trace is 11.1 MB instead of 15.8, and the checked-in tree must travel to
    the GPU machines within 64 MiB (tests/test_tree_size.py)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_LZMA) as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)


def lorenz_share(counts: np.ndarray, frac: float) -> float:
    """Share of all selections taken by the least-used `frac` of experts (the Lorenz curve at frac, linear between
    experts: a fractional expert counts pro rata)."""
    c = np.sort(np.asarray(counts, dtype=np.float64))
    total = c.sum()
    if total <= 0:
        return float(frac)
    cum = np.concatenate([[0.0], np.cumsum(c) / total])
    x = frac * len(c)
    j = min(int(math.floor(x)), len(c) - 1)
    return float(cum[j] + (x - j) * (cum[j + 1] - cum[j]))


def entropy_rel(counts: np.ndarray) -> float:
    p = np.asarray(counts, dtype=np.float64)
    if p.sum() <= 0 or len(p) < 2:
        return 1.0
    p = p / p.sum()
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum() / math.log(len(p)))


def jsd_bits(a: np.ndarray, b: np.ndarray) -> float:
    """Jensen-Shannon divergence (base 2, in [0, 1]) between two count vectors as distributions."""
    p = np.asarray(a, dtype=np.float64)
    q = np.asarray(b, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return 0.0
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(x):
        nz = x > 0
        return float((x[nz] * np.log2(x[nz] / m[nz])).sum())

    return min(1.0, max(0.0, 0.5 * kl(p) + 0.5 * kl(q)))


def _shares(counts: np.ndarray) -> dict[str, float]:
    return {"least10_share": lorenz_share(counts, 0.1), "most10_share": 1.0 - lorenz_share(counts, 0.9),
            "entropy_rel": entropy_rel(counts)}


def summarise(usage: dict[str, np.ndarray], layer_ids: list[int]) -> dict:
    """usage: {kind: [layers, num_experts] counts} -> the summary stored in route_usage.json (see the docstring)."""
    kinds = sorted(usage)
    pairs = [f"{a}|{b}" for a, b in itertools.combinations(kinds, 2)]
    total = sum(usage[k] for k in kinds)
    layers = {}
    for l, idx in enumerate(layer_ids):
        row = _shares(total[l])
        row["jsd_bits"] = {f"{a}|{b}": jsd_bits(usage[a][l], usage[b][l]) for a, b in itertools.combinations(kinds, 2)}
        layers[str(idx)] = row
    rows = list(layers.values())
    mean = {key: float(np.mean([r[key] for r in rows])) for key in ("least10_share", "most10_share", "entropy_rel")}
    mean["jsd_bits"] = {p: float(np.mean([r["jsd_bits"][p] for r in rows])) for p in pairs}
    mean["jsd_bits_all_pairs"] = float(np.mean(list(mean["jsd_bits"].values()))) if pairs else 0.0
    per_kind = {}
    for k in kinds:
        s = [_shares(usage[k][l]) for l in range(len(layer_ids))]
        per_kind[k] = {key: float(np.mean([r[key] for r in s])) for key in ("least10_share", "most10_share",
                                                                               "entropy_rel")}
    return {"definition": "least10/most10: share of selections taken by the least/most used 10% of experts (a "
                          "fractional expert pro rata; uniform = 0.1); entropy_rel: usage entropy / log(E); "
                          "jsd_bits: Jensen-Shannon divergence (bits) between two kinds' usage distributions",
            "layers": layers, "mean": mean, "per_kind": per_kind}


def format_summary(summary: dict) -> str:
    lines = []
    pairs = list(summary["mean"]["jsd_bits"])
    lines.append(f"{'layer':>5}  {'least10%':>8}  {'most10%':>8}  {'H/Hmax':>7}  {'JSD mean':>8}")
    for idx, r in summary["layers"].items():
        j = np.mean(list(r["jsd_bits"].values())) if r["jsd_bits"] else 0.0
        lines.append(f"{idx:>5}  {r['least10_share']:8.4f}  {r['most10_share']:8.4f}  {r['entropy_rel']:7.4f}  "
                     f"{j:8.4f}")
    m = summary["mean"]
    lines.append(f"{'mean':>5}  {m['least10_share']:8.4f}  {m['most10_share']:8.4f}  {m['entropy_rel']:7.4f}  "
                 f"{m['jsd_bits_all_pairs']:8.4f}")
    lines.append("")
    lines.append(f"{'kind':>8}  {'least10%':>8}  {'most10%':>8}  {'H/Hmax':>7}   (each kind alone, mean over layers)")
    for k, r in summary["per_kind"].items():
        lines.append(f"{k:>8}  {r['least10_share']:8.4f}  {r['most10_share']:8.4f}  {r['entropy_rel']:7.4f}")
    if pairs:
        lines.append("")
        lines.append("JSD (bits) between kinds' expert usage, mean over layers:")
        w = max(len(p) for p in pairs)
        for p in pairs:
            per_layer = " ".join(f"{summary['layers'][i]['jsd_bits'][p]:.4f}" for i in summary["layers"])
            lines.append(f"  {p:<{w}}  {m['jsd_bits'][p]:.4f}   per layer: {per_layer}")
    return "\n".join(lines)


# ---- the run ------------------------------------------------------------------------------------------------

def _recipe_sha(corpus: Path) -> str | None:
    try:
        return json.loads((corpus / "corpus.json").read_text(encoding="utf-8")).get("raw_sha256")
    except (OSError, ValueError):
        return None


PREDICTION = ("layer l's router on MoE layer l-1's input, top-k, best first; the first MoE layer: its router on the "
              "hidden state entering its decoder layer, normed as its MoE input (stage_worker/route_stats.py)")


def run(model_dir: str | Path, corpus: str | Path, out: str | Path, *, tokens_per_kind: int = 300_000,
        chunk: int = 512, batch: int = 8, device: str = "cpu", split: str = "all", kernels: str | None = None,
        command: list[str] | None = None, log=print, predict: bool = False) -> dict:
    """Trace every kind, write DIR/route_trace.npz and DIR/route_usage.json; returns the route_usage.json dict.
    `predict`: also the predictions one layer ahead (`pred:{kind}`)."""
    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.kernels.flags import KernelFlags

    model_dir, corpus, out = Path(model_dir), Path(corpus), Path(out)
    if chunk < 1 or batch < 1 or tokens_per_kind < 1:
        raise ValueError("--chunk, --batch and --tokens-per-kind must be positive")
    tok = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, LoadOptions(device=device))
    if torch.device(device).type == "cuda":
        model.set_kernels(KernelFlags.from_env("all") if kernels is None else KernelFlags.parse(kernels))
    cfg = model.cfg
    chunk = min(chunk, cfg.max_position_embeddings)
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
    if eos is None:
        eos = tok.eos_token_ids[0]
    moes = moe_layers(model)
    layer_ids = [i for i, _ in moes]
    num_experts, top_k = moes[0][1].num_experts, moes[0][1].top_k
    id_dtype = np.uint8 if num_experts <= 256 else np.uint16

    t0 = time.time()
    streams = kind_streams(corpus, tok, int(eos), tokens_per_kind, split)
    if not streams:
        raise ValueError(f"{corpus}: no documents for split {split!r}")
    log(f"route_trace: tokenised {', '.join(f'{k} {len(v)}' for k, v in streams.items())} tokens "
        f"in {time.time() - t0:.1f}s")

    arrays: dict[str, np.ndarray] = {}
    usage: dict[str, np.ndarray] = {}
    with torch.inference_mode():
        engine = LocalEngine([model], max_seqs=batch, max_tokens=chunk)
        for kind, stream in streams.items():
            t1 = time.time()
            ids = trace_windows(model, windows(stream, chunk), batch, engine, predict=top_k if predict else 0)
            if predict:
                ids, pred = ids
                arrays[f"pred:{kind}"] = pred.astype(id_dtype)
            assert ids.shape == (len(stream), len(layer_ids), top_k), ids.shape
            arrays[f"ids:{kind}"] = ids.astype(id_dtype)
            arrays[f"tokens:{kind}"] = stream
            usage[kind] = usage_counts(ids, num_experts)
            dt = time.time() - t1
            log(f"route_trace: {kind}: {len(stream)} tokens in {dt:.1f}s ({len(stream) / max(dt, 1e-9):.0f} tok/s)")

    meta = {
        "format": FORMAT,
        "model": str(model_dir.resolve()),
        "config": {"model_type": type(cfg).__name__, "num_hidden_layers": cfg.num_hidden_layers,
                   "moe_layers": layer_ids, "num_experts": num_experts, "top_k": top_k, "dtype": cfg.dtype,
                   "vocab_size": cfg.vocab_size},
        "kinds": list(streams),
        "tokens_per_kind": {k: int(len(v)) for k, v in streams.items()},
        "chunk": chunk, "batch": batch, "split": split, "eos_token_id": int(eos),
        "device": device, "kernels": getattr(getattr(model, "kernel_flags", None), "describe", lambda: "none")(),
        "ids_dtype": np.dtype(id_dtype).name,
        "corpus": str(corpus.resolve()), "corpus_raw_sha256": _recipe_sha(corpus),
        "command": command if command is not None else sys.argv,
    }
    if predict:
        meta["predictions"] = {"definition": PREDICTION, "model": meta["model"],
                               "dtype": str(next(model.parameters()).dtype), "made_with_ids": True}
    out.mkdir(parents=True, exist_ok=True)
    save_npz(out / TRACE_FILE, meta=np.array(json.dumps(meta)), **arrays)
    summary = summarise(usage, layer_ids)
    result = {"meta": meta,
              "usage": {k: {str(i): [int(c) for c in u[l]] for l, i in enumerate(layer_ids)} for k, u in usage.items()},
              "summary": summary}
    (out / USAGE_FILE).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(format_summary(summary))
    size = (out / TRACE_FILE).stat().st_size
    log(f"route_trace: wrote {out / TRACE_FILE} ({size / 1e6:.2f} MB, "
        f"{size / max(1, sum(len(v) for v in streams.values())):.2f} B/token) and {out / USAGE_FILE}")
    return result


def load_trace(path: str | Path, predictions: bool = False):
    """(meta, {kind: ids}, {kind: tokens}) from a route_trace.npz (or its directory); with `predictions`,
    (meta, ids, tokens, {kind: pred}), the last empty when the trace has no `pred:` keys."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACE_FILE
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        ids = {k: data[f"ids:{k}"] for k in meta["kinds"]}
        toks = {k: data[f"tokens:{k}"] for k in meta["kinds"]}
        pred = {k: data[f"pred:{k}"] for k in meta["kinds"] if f"pred:{k}" in data.files}
    return (meta, ids, toks, pred) if predictions else (meta, ids, toks)


def add_predictions(trace: str | Path, model_dir: str | Path, *, batch: int = 8, device: str = "cpu",
                    dtype: str | None = None, command: list[str] | None = None, log=print) -> dict:
    """Re-prefill a trace's stored tokens in its windows on `model_dir`, check the recomputed ids against the stored
    ones and write the trace back with `pred:{kind}` added (other arrays unchanged). Returns the agreement per kind:
    `rows`, the share of (token, layer) rows equal in order; `sets`, equal as sets; `tokens`, of tokens equal in
    every layer."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    path = Path(trace)
    if path.is_dir():
        path = path / TRACE_FILE
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    meta = json.loads(str(arrays.pop("meta")))
    model = load_model(model_dir, LoadOptions(device=device, dtype=getattr(torch, dtype) if dtype else None))
    moes = moe_layers(model)
    cfg = meta["config"]
    have = ([i for i, _ in moes], moes[0][1].num_experts, moes[0][1].top_k)
    if have != (cfg["moe_layers"], cfg["num_experts"], cfg["top_k"]):
        raise ValueError(f"{model_dir}: MoE layers / experts / top-k {have} are not the trace's "
                         f"{(cfg['moe_layers'], cfg['num_experts'], cfg['top_k'])}")
    chunk, k = meta["chunk"], cfg["top_k"]
    agreement = {}
    with torch.inference_mode():
        engine = LocalEngine([model], max_seqs=batch, max_tokens=chunk)
        for kind in meta["kinds"]:
            t1 = time.time()
            stored = arrays[f"ids:{kind}"]
            ids, pred = trace_windows(model, windows(arrays[f"tokens:{kind}"], chunk), batch, engine, predict=k)
            if ids.shape != stored.shape:
                raise RuntimeError(f"{kind}: recomputed ids {ids.shape}, stored {stored.shape}")
            same = ids == stored
            agreement[kind] = {"rows": float(same.all(-1).mean()), "tokens": float(same.all((-1, -2)).mean()),
                               "sets": float((np.sort(ids, -1) == np.sort(stored, -1)).all(-1).mean()),
                               "rows_per_layer": [round(float(x), 4) for x in same.all(-1).mean(0)]}
            arrays[f"pred:{kind}"] = pred.astype(stored.dtype)
            dt = time.time() - t1
            a = agreement[kind]
            log(f"route_trace: {kind}: {len(stored)} tokens in {dt:.1f}s; recomputed ids equal the stored ones in "
                f"{100 * a['rows']:.2f}% of rows (as sets {100 * a['sets']:.2f}%; per layer "
                f"{' '.join(f'{100 * x:.1f}' for x in a['rows_per_layer'])}%)")
    meta["predictions"] = {"definition": PREDICTION, "model": str(Path(model_dir).resolve()),
                           "dtype": str(next(model.parameters()).dtype), "device": device, "batch": batch,
                           "made_with_ids": False, "ids_agreement": agreement,
                           "command": command if command is not None else sys.argv}
    save_npz(path, meta=np.array(json.dumps(meta)), **arrays)
    log(f"route_trace: wrote {path} ({path.stat().st_size / 1e6:.2f} MB) with pred: keys for "
        f"{', '.join(meta['kinds'])}")
    return agreement


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--corpus", default=".corpus", help="corpus directory from tools/build_corpus.py")
    ap.add_argument("--out", default=None, help="output directory (required unless --add-predictions)")
    ap.add_argument("--predict", action="store_true",
                    help="also record the predictions one layer ahead (pred:{kind})")
    ap.add_argument("--add-predictions", default=None, metavar="TRACE",
                    help="add pred:{kind} to an existing route_trace.npz (or its directory) from its stored tokens, "
                         "prefilled on --model; prints how often the recomputed ids equal the stored ones")
    ap.add_argument("--dtype", default=None,
                    help="--add-predictions: compute dtype (e.g. bfloat16; default the loader's)")
    ap.add_argument("--tokens-per-kind", type=int, default=300_000)
    ap.add_argument("--chunk", type=int, default=512, help="prefill window: each a fresh sequence (default 512)")
    ap.add_argument("--batch", type=int, default=8, help="windows per prefill step (default 8)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--split", choices=("all", "heldout", "train"), default="all",
                    help="which documents: all (default), only held-out ones, or only training ones")
    ap.add_argument("--kernels", default=None, help="CUDA kernel flags (default: MOEPIPE_KERNELS or all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; 1 is far faster for a tiny model on a busy machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from shared.cli import ensure_builtin_model

        args.model = str(ensure_builtin_model())
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    if args.add_predictions:
        add_predictions(args.add_predictions, args.model, batch=args.batch, device=args.device, dtype=args.dtype,
                        command=command)
        return 0
    if not args.out:
        ap.error("--out is required (unless --add-predictions)")
    run(args.model, args.corpus, args.out, tokens_per_kind=args.tokens_per_kind, chunk=args.chunk,
        batch=args.batch, device=args.device, split=args.split, kernels=args.kernels, command=command,
        predict=args.predict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
