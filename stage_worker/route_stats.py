"""Which experts a checkpoint routes each token to, counted per layer over sample text of several kinds (issue 16,
item 2): `moepipe route-stats`, whose counts `moepipe cold-set` turns into the experts kept in host RAM.

Each kind's text is cut into windows of `chunk` tokens and each window is PREFILLED as a fresh sequence: the experts
chosen at a position depend only on the tokens up to it, so prefill selects what decode of the same text would
(tests/test_route_trace.py checks it against token-by-token decode), at prefill's speed. After each step every
`SparseMoE`'s `last_expert_ids` is read, in layer order. `tools/route_trace.py` builds the demo model's traces on
the same functions.

Predictions one layer ahead (`trace_windows(..., predict=m)`, `Predictions`; issue 16's layer-ahead prefetch): in
the same prefill pass, for MoE layer l the top-m of layer l's router applied to MoE layer l-1's INPUT (the residual
stream changes little from one layer to the next, so it names most of layer l's experts while layer l-1 runs), in
the router's order (best first, ties to the lower id: `route_ref`). The FIRST MoE layer has no previous MoE layer:
its prediction is its own router on the hidden state ENTERING its decoder layer (before the token mixer), normed as
the MoE input is normed (the layer's `post_attention_layernorm`; with hyper-connections its MLP hyper-connection's
`mix`): the best a prediction can do without a previous layer (what a prefetch launched as the layer starts could
know).

Output (`route_usage.json`): `meta` (model, config summary, kinds, tokens per kind, chunk, command) and
`usage[kind][layer]`, selections per expert.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from stage_worker.local_engine import LocalEngine
from stage_worker.model.moe import SparseMoE

FORMAT = "moepipe-route-usage/1"


def windows(stream: np.ndarray, chunk: int) -> list[list[int]]:
    return [stream[i:i + chunk].tolist() for i in range(0, len(stream), chunk)]


def moe_layers(model) -> list[tuple[int, SparseMoE]]:
    """(global layer index, SparseMoE) of every MoE layer of the model, in layer order."""
    out = sorted(model.moe_layers().items())
    if not out:
        raise ValueError("the model has no SparseMoE layers to trace")
    return out


def read_ids(moes: list[tuple[int, SparseMoE]], n_tokens: int) -> torch.Tensor:
    """[n_tokens, layers, k] of what each MoE layer selected in the last step."""
    rows = []
    for i, m in moes:
        ids = m.last_expert_ids
        if ids is None or ids.shape[0] != n_tokens:
            raise RuntimeError(f"layer {i}: last_expert_ids has {None if ids is None else tuple(ids.shape)} rows, "
                               f"the step fed {n_tokens} tokens")
        rows.append(m.expert_ids(ids).reshape(n_tokens, -1))    # slots -> experts when a table is set
    return torch.stack(rows, dim=1)


def router_top(moe: SparseMoE, x: torch.Tensor, m: int) -> torch.Tensor:
    """Expert ids [T, m] that `moe`'s router picks for inputs x [..., H], best first (ties to the lower id, as the
    route kernel and `route_ref` order them); router indices are mapped to expert ids when a table is set."""
    from stage_worker.kernels.moe_ref import route_ref

    _, ids = route_ref(moe.gate(x.reshape(-1, x.shape[-1])), m, False)
    t = moe.table
    return ids.long() if t is None else t.experts_of(t.slots_of(ids)).long()


class Predictions:
    """Records, while installed (`with Predictions(model, m) as p:`), each MoE layer's prediction one layer ahead
    (the module docstring): a forward pre-hook on MoE layer l-1 applies layer l's router to its input, and the first
    MoE layer's decoder layer has its `forward_deferred` wrapped (an instance attribute, removed on exit) to apply
    its router to its normed input. `read(n_tokens)` after a step: int64 [n_tokens, layers, m], rows in the step's
    token order (as `read_ids`)."""

    def __init__(self, model, m: int | None = None) -> None:
        self.moes = moe_layers(model)
        self.m = m or self.moes[0][1].top_k
        first = self.moes[0][0]
        self.layer = model.layers[str(first)]       # the first MoE layer's decoder layer
        self.rows: list[list[torch.Tensor]] = [[] for _ in self.moes]
        self.hooks: list = []

    def _first(self, h: torch.Tensor, pending, *args, **kwargs):
        layer = self.layer
        streams = h if pending is None else layer.finish(h, pending)     # the hidden state entering the layer
        x = layer.mlp_hyper_connection.mix(streams)[0] if layer.hyper else layer.post_attention_layernorm(streams)
        self.rows[0].append(router_top(self.moes[0][1], x, self.m))
        return type(layer).forward_deferred(layer, h, pending, *args, **kwargs)

    def __enter__(self) -> "Predictions":
        for l in range(1, len(self.moes)):
            nxt = self.moes[l][1]
            self.hooks.append(self.moes[l - 1][1].register_forward_pre_hook(
                lambda mod, args, l=l, nxt=nxt: self.rows[l].append(router_top(nxt, args[0], self.m))))
        self.layer.forward_deferred = self._first
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        del self.layer.forward_deferred

    def read(self, n_tokens: int) -> torch.Tensor:
        out = []
        for (i, _), rows in zip(self.moes, self.rows):
            got = torch.cat(rows) if rows else None
            if got is None or got.shape[0] != n_tokens:
                raise RuntimeError(f"layer {i}: predictions for {None if got is None else got.shape[0]} rows, the "
                                   f"step fed {n_tokens} tokens")
            out.append(got)
            rows.clear()
        return torch.stack(out, dim=1)


def trace_windows(model, wins: list[list[int]], batch: int = 8, engine: LocalEngine | None = None,
                  predict: int = 0) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Prefill every window as a fresh sequence, `batch` windows per step; returns int64 [sum(len), layers, k] in
    window order. `predict` m > 0: also the predictions one layer ahead (the module docstring), int64
    [sum(len), layers, m]: returns (ids, predictions)."""
    moes = moe_layers(model)
    k = moes[0][1].top_k
    chunk = max((len(w) for w in wins), default=1)
    out, pred = [], []
    with torch.inference_mode(), (Predictions(model, predict) if predict else contextlib.nullcontext()) as p:
        engine = engine or LocalEngine([model], max_seqs=batch, max_tokens=chunk)
        for s in range(0, len(wins), batch):
            group = wins[s:s + batch]
            for i in range(len(group)):
                engine.add(i)
            try:
                engine.step([(i, w) for i, w in enumerate(group)])
            finally:
                for i in range(len(group)):
                    engine.release(i)
            n = sum(len(w) for w in group)
            out.append(read_ids(moes, n).cpu())
            if p is not None:
                pred.append(p.read(n).cpu())
    ids = torch.cat(out).numpy().astype(np.int64) if out else np.zeros((0, len(moes), k), np.int64)
    if not predict:
        return ids
    return ids, (torch.cat(pred).numpy() if pred else np.zeros((0, len(moes), predict), np.int64))


def usage_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[layers, num_experts] selections per expert from ids [tokens, layers, k]."""
    return np.stack([np.bincount(ids[:, l, :].reshape(-1).astype(np.int64), minlength=num_experts)
                     for l in range(ids.shape[1])])


def is_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB (git's test): an image, an archive, a git object; not text of any encoding
    but UTF-16/32, which the tokenizer would read as noise too."""
    with path.open("rb") as f:
        return b"\0" in f.read(8192)


def read_texts(specs: list[str]) -> dict[str, list[Path]]:
    """`KIND=PATH` items (a file, or a directory whose files are read in name order) -> {kind: files}. Binary files
    are no sample text: decoded with replacement characters they counted the routing of noise as a kind's, and
    silently (a code directory's .git objects, a gzipped corpus). A directory's are skipped, said on stderr; a
    binary file named alone is refused."""
    out: dict[str, list[Path]] = {}
    for spec in specs:
        kind, sep, path = spec.partition("=")
        if not sep or not kind or not path:
            raise ValueError(f"--text {spec!r}: expected KIND=PATH (a file or a directory of files)")
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"--text {spec!r}: {path} is not a file or a directory with files")
        binary = [f for f in files if is_binary(f)]
        if binary and not p.is_dir():
            raise ValueError(f"--text {spec!r}: {path} is a binary file (a NUL byte in its first 8 KiB), not text")
        if binary:
            files = [f for f in files if f not in binary]
            if not files:
                raise ValueError(f"--text {spec!r}: {path} holds only binary files ({len(binary)}), no text")
            print(f"route-stats: {kind}: skipped {len(binary)} binary file(s) of {path} (e.g. {binary[0]})",
                  file=sys.stderr)
        out.setdefault(kind, []).extend(files)
    return out


def route_stats(model_dir: str | Path, texts: dict[str, list[Path]], out: str | Path, *, tokens_per_kind: int,
                chunk: int = 512, batch: int = 8, device: str = "cpu") -> dict:
    """Count each MoE layer's selections over every kind's text (files joined by EOS, at most `tokens_per_kind`
    tokens a kind); writes and returns route_usage.json."""
    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.kernels.flags import KernelFlags

    from shared.model_config import load_config

    model_dir = Path(model_dir)
    if chunk < 1 or batch < 1 or tokens_per_kind < 1:
        raise ValueError("--chunk, --batch and --tokens-per-kind must be positive")
    if not load_config(model_dir).has_sparse_moe:
        # said before the weights load (minutes for a large checkpoint), not after, from moe_layers
        raise ValueError(f"{model_dir}: the model has no MoE layers (routed experts) to count; --cold-experts does "
                         f"not apply to it")
    tok = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, LoadOptions(device=device))
    if torch.device(device).type == "cuda":
        model.set_kernels(KernelFlags.from_env("all"))
    cfg = model.cfg
    chunk = min(chunk, cfg.max_position_embeddings)
    # no more sequences than a kind has windows: the engine's buffers are sized by it (`--batch 100000` asked for
    # 13 GB on the tiny model before the first step)
    batch = min(batch, -(-tokens_per_kind // chunk))
    eos = tok.eos_token_ids[0]
    moes = moe_layers(model)
    num_experts = moes[0][1].num_experts
    usage, counted = {}, {}
    with torch.inference_mode():
        engine = LocalEngine([model], max_seqs=batch, max_tokens=chunk)
        for kind, files in texts.items():
            ids: list[int] = []
            for f in files:
                if len(ids) >= tokens_per_kind:
                    break
                ids.extend(tok.encode(f.read_text(encoding="utf-8", errors="replace")))
                ids.append(eos)
            if len(ids) <= len(files):          # end-of-sequence ids only: no counts to choose a cold set from
                raise ValueError(f"--text {kind}=...: {', '.join(map(str, files))} hold no text")
            stream = np.asarray(ids[:tokens_per_kind], dtype=np.int64)
            sel = trace_windows(model, windows(stream, chunk), batch, engine)
            usage[kind] = usage_counts(sel, num_experts)
            counted[kind] = int(len(stream))
            print(f"route-stats: {kind}: {len(stream)} tokens")
    layer_ids = [i for i, _ in moes]
    result = {"meta": {"format": FORMAT, "model": str(model_dir.resolve()),
                       "config": {"num_hidden_layers": cfg.num_hidden_layers, "moe_layers": layer_ids,
                                  "num_experts": num_experts, "top_k": moes[0][1].top_k},
                       "kinds": list(texts), "tokens_per_kind": counted, "chunk": chunk, "command": sys.argv},
              "usage": {k: {str(i): [int(c) for c in u[l]] for l, i in enumerate(layer_ids)}
                        for k, u in usage.items()}}
    Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"route-stats: wrote {out}")
    return result
