"""Cold sets (issue 16, item 2): which routed experts of each stage stay in host RAM, chosen from routing counts.

The reports' lesson (000 §3): a cold set chosen from one kind of text slows every other kind (chosen from code
only, English decode fell from 95 to 57-61 tok/s), so the counts of several kinds are each normalised to a sum of
one and added, and experts are taken from the lowest sum up until each stage's budget is full (each GPU's budget
separately). The counts come from `tools/route_trace.py` (`route_usage.json`: `usage[kind][layer]`, selections per
expert; prefill of a text selects what its decode would). The file written here is what the server will take as
`--cold-experts FILE` (the expert tables of `stage_worker/expert_offload.py` read it).

File format (JSON): {"format": FORMAT, "model": ..., "expert_bytes": ..., "stages": [{"layers": [start, end],
"budget_bytes": ..., "cold_bytes": ...}], "layers": {"<layer>": [expert ids]}, "kinds": [...]}; a stage row also has
"expert_bytes" when the stages hold experts of different sizes (`--cold-experts auto`: INT4 experts at their packed
size, `packed_expert_bytes`; float8 experts at theirs, `fp8_expert_bytes`).
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.model_config import HybridMoeConfig

FORMAT = "moepipe-cold-experts/1"
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class ColdSetError(ValueError):
    """Routing counts or a cold-set file that do not match the model."""


def expert_bytes(cfg: HybridMoeConfig, dtype: str | None = None) -> int:
    """One routed expert's gate, up and down projections."""
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * _ITEMSIZE[dtype or cfg.dtype]


def packed_expert_bytes(cfg: HybridMoeConfig, group: int, group2: int, asym: bool = False, fp4: bool = False, *,
                        dtype: str | None = None) -> int:
    """One routed expert kept in INT4 words and group scales (issue 17, `SparseMoE.use_packed`): int32 words of 8
    inputs for gate/up [2I, H/8] and down [H, I/8], scales in the compute dtype [2I, ceil(H/group)] and
    [H, ceil(I/group2)] (`asym`: as many zero points again; `fp4`: E2M1 codes in the same words, float32 scales).
    What an expert table holds per slot and a host read moves (about a quarter of bf16; FP4's groups of 16 in
    float32: about 0.38 of it)."""
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    words = 4 * (2 * inter * (H // 8) + H * (inter // 8))
    scales = 2 * inter * -(-H // group) + H * -(-inter // group2)
    return words + (4 if fp4 else _ITEMSIZE[dtype or cfg.dtype]) * scales * (2 if asym else 1)


def fp8_expert_bytes(cfg: HybridMoeConfig, block: tuple[int, int]) -> int:
    """One routed expert kept float8 (a block-FP8 checkpoint, `SparseMoE.use_fp8`): a byte per weight of gate/up
    [2I, H] and down [H, I], and a float32 scale per block of each projection (gate's and up's blocked apart). What
    an expert table's float8 slot holds and a host read moves (about half of bf16); the compute dtype does not
    matter."""
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    br, bc = block
    scales = 2 * -(-inter // br) * -(-H // bc) + -(-H // br) * -(-inter // bc)
    return 3 * inter * H + 4 * scales


def check_usage(usage: object) -> None:
    """`usage` as route_usage.json holds it: {kind: {layer number: [selections per expert]}}, at least one kind,
    counts non-negative integers; else a ColdSetError naming what is wrong (not a traceback from the arithmetic)."""
    if not isinstance(usage, dict) or not usage:
        raise ColdSetError("\"usage\" must map each kind of text to its per-layer counts "
                           "({kind: {layer: [selections per expert]}}), with at least one kind")
    for kind, layers in usage.items():
        if not isinstance(layers, dict) or not layers:
            raise ColdSetError(f"usage of kind {kind!r} must map layer numbers to counts per expert")
        for layer, row in layers.items():
            if not (isinstance(layer, str) and layer.isascii() and layer.isdigit()):
                raise ColdSetError(f"usage of kind {kind!r}: layer {layer!r} is not a layer number")
            if not (isinstance(row, list) and row and all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in row)):
                raise ColdSetError(f"usage of kind {kind!r}, layer {layer}: expected a list of selection counts "
                                   f"(non-negative integers) per expert")


def kind_normalised(usage: dict[str, dict[str, list[int]]]) -> dict[int, list[float]]:
    """Per MoE layer, per expert: the sum over kinds of each kind's selections divided by all of that kind's
    selections (in every layer), so every kind weighs the same however many tokens it was traced with."""
    check_usage(usage)
    scores: dict[int, list[float]] = {}
    for kind, layers in usage.items():
        total = sum(sum(row) for row in layers.values())
        if total <= 0:
            raise ColdSetError(f"routing counts of kind {kind!r} are empty")
        for layer, row in layers.items():
            acc = scores.setdefault(int(layer), [0.0] * len(row))
            if len(acc) != len(row):
                raise ColdSetError(f"layer {layer}: kinds count different numbers of experts")
            for e, n in enumerate(row):
                acc[e] += n / total
    return scores


def check_scores(scores: dict[int, list[float]], cfg: HybridMoeConfig, source: str) -> None:
    """Routing counts from `source` must be of this model: every counted layer one of its MoE layers, with its
    number of experts (counts of another checkpoint would place experts on a dense layer, or index past a row)."""
    if not cfg.has_sparse_moe:
        # (every counted layer listed as not matching, "MoE layers []", left the user to work out why)
        raise ColdSetError(f"{source}: this model has no MoE layers (routed experts): there are no experts to keep "
                           f"in host RAM")
    bad = [layer for layer in sorted(scores) if not (0 <= layer < cfg.num_hidden_layers and cfg.is_sparse_moe(layer))
           or len(scores[layer]) != cfg.num_experts]
    if bad:
        raise ColdSetError(f"{source}: the counts of layers {bad} do not match this model ({cfg.num_hidden_layers} "
                           f"layers, {cfg.num_experts} experts, MoE layers "
                           f"{[x for x in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(x)]})")


def choose(scores: dict[int, list[float]], stages: list[tuple[int, int]], per_expert: int | list[int],
           budget_bytes: int) -> dict[int, list[int]]:
    """Per stage (layer range), the least used experts of its layers, lowest score first (ties: lower layer, lower
    id), as many as fit in `budget_bytes` but never every expert of a layer (one stays in VRAM, as the server
    requires); layer -> sorted expert ids. `per_expert`: one expert's bytes as the stages hold it (a list: per
    stage, e.g. INT4 experts at their packed size)."""
    cold: dict[int, list[int]] = {}
    sizes = per_expert if isinstance(per_expert, list) else [per_expert] * len(stages)
    for (start, end), size in zip(stages, sizes):
        fit = budget_bytes // size if size > 0 else 0
        ranked = sorted((score, layer, e) for layer in range(start, end) if layer in scores
                        for e, score in enumerate(scores[layer]))
        for _, layer, e in ranked:
            if fit <= 0:
                break
            ids = cold.setdefault(layer, [])
            if len(ids) < len(scores[layer]) - 1:
                ids.append(e)
                fit -= 1
    return {layer: sorted(ids) for layer, ids in sorted(cold.items()) if ids}


def spread(cfg: HybridMoeConfig, stages: list[tuple[int, int]], host_bytes: list[int], per_expert: int | list[int],
           scores: dict[int, list[float]] | None = None) -> dict[int, list[int]]:
    """`--cold-experts auto`: per stage, at least `host_bytes` of experts spread evenly over its MoE layers; with
    routing `scores` the least used of each layer, else the highest ids (run-time moves re-place them by use).
    `per_expert`: one expert's bytes as the stages hold it (a list: per stage, e.g. INT4 experts at their packed
    size)."""
    sizes = per_expert if isinstance(per_expert, list) else [per_expert] * len(stages)
    cold: dict[int, list[int]] = {}
    for (start, end), nbytes, size in zip(stages, host_bytes, sizes):
        layers = [layer for layer in range(start, end) if cfg.is_sparse_moe(layer)]
        if nbytes <= 0 or not layers:
            continue
        n = min(-(-nbytes // (size * len(layers))), cfg.num_experts - 1)
        for layer in layers:
            if scores is not None and layer in scores:
                order = sorted(range(cfg.num_experts), key=lambda e: (scores[layer][e], e))
            else:
                order = list(range(cfg.num_experts - 1, -1, -1))
            cold[layer] = sorted(order[:n])
    return cold


def host_reads(cold: dict[int, list[int]], usage: dict[str, dict[str, list[int]]],
               tokens: dict[str, int]) -> dict[str, float]:
    """Per kind: traced selections that would read a host expert, per token."""
    out = {}
    for kind, layers in usage.items():
        hits = sum(layers[str(layer)][e] for layer, ids in cold.items() if str(layer) in layers for e in ids)
        out[kind] = hits / max(tokens.get(kind, 0), 1)
    return out


def write(path: str | Path, cfg: HybridMoeConfig, model: str, cold: dict[int, list[int]],
          stages: list[tuple[int, int]], per_expert: int | list[int], budget_bytes: int, kinds: list[str]) -> Path:
    """`per_expert` a list: each stage's expert size (also written in its row; the top-level `expert_bytes` is
    then the first stage's)."""
    path = Path(path)
    sizes = per_expert if isinstance(per_expert, list) else [per_expert] * len(stages)
    rows = [{"layers": [s, e], "budget_bytes": budget_bytes,
             "cold_bytes": size * sum(len(ids) for layer, ids in cold.items() if s <= layer < e)}
            | ({"expert_bytes": size} if isinstance(per_expert, list) else {})
            for (s, e), size in zip(stages, sizes)]
    path.write_text(json.dumps({"format": FORMAT, "model": model, "num_experts": cfg.num_experts,
                                "shape": shape(cfg),
                                "expert_bytes": sizes[0] if sizes else per_expert, "stages": rows, "kinds": kinds,
                                "layers": {str(k): v for k, v in cold.items()}}, indent=1) + "\n")
    return path


AUTO = "auto"     # `--cold-experts auto`: the launcher writes a file from the memory plan (gateway/launcher.py)


def shape(cfg: HybridMoeConfig) -> dict:
    """What a cold-set file was chosen for, beyond the expert count: another checkpoint's file is refused."""
    return {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "moe_layers": [x for x in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(x)]}


def load(path: str | Path, cfg: HybridMoeConfig) -> dict[int, list[int]]:
    """A cold-set file, checked against the model: layer -> expert ids; ColdSetError naming what is wrong."""
    if str(path) == AUTO:
        raise ColdSetError("cold_experts = \"auto\" is resolved by `moepipe serve` from the memory plan (it writes "
                           "a file and points the cluster config at it); a stage started alone needs the file")
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ColdSetError(f"{path}: not a readable cold-set file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ColdSetError(f"{path}: format is not {FORMAT!r} (write one with `moepipe cold-set`)")
    if data.get("num_experts", cfg.num_experts) != cfg.num_experts:
        # !r: a hand-edited "16" read "written for a model of 16 experts ...; this one has 16"
        raise ColdSetError(f"{path}: written for a model of {data['num_experts']!r} experts a layer (its model: "
                           f"{data.get('model')}); this one has {cfg.num_experts}")
    mine = shape(cfg)
    theirs = data.get("shape")                  # files written before 2026-12-05 carry none
    if isinstance(theirs, dict) and any(theirs.get(k, v) != v for k, v in mine.items()):
        diff = next(k for k, v in mine.items() if theirs.get(k, v) != v)
        raise ColdSetError(f"{path}: written for another model (its {diff} {theirs[diff]}, this one's "
                           f"{mine[diff]}; its model: {data.get('model')}): write one for this checkpoint with "
                           f"`moepipe cold-set`")
    layers = data.get("layers") or {}
    if not isinstance(layers, dict):
        raise ColdSetError(f"{path}: \"layers\" must map layer numbers to expert ids")
    out: dict[int, list[int]] = {}
    for layer, ids in layers.items():
        layer = str(layer)
        if not (layer.isascii() and layer.isdigit() and int(layer) < cfg.num_hidden_layers
                and cfg.is_sparse_moe(int(layer))):
            raise ColdSetError(f"{path}: layer {layer} is not a MoE layer of this model "
                               f"({cfg.num_hidden_layers} layers)")
        if not (isinstance(ids, list) and all(isinstance(e, int) and not isinstance(e, bool)
                                              and 0 <= e < cfg.num_experts for e in ids)
                and len(set(ids)) == len(ids)):
            raise ColdSetError(f"{path}: layer {layer}: expert ids must be distinct integers in "
                               f"[0, {cfg.num_experts})")
        if len(ids) >= cfg.num_experts:
            raise ColdSetError(f"{path}: layer {layer} puts all {cfg.num_experts} experts in host RAM")
        if int(layer) in out:           # "3" and "03": the second list replaced the first without a word
            raise ColdSetError(f"{path}: layer {int(layer)} is listed twice")
        out[int(layer)] = sorted(ids)
    return out
