"""Load a checkpoint directory into one stage's `StageModel`, streaming tensor by tensor.

The model is first built on the `meta` device and then given real, uninitialised storage on its final device;
each on-disk tensor is read once and copied into place, so the weights never exist twice in memory (a report's
start-up took 27 minutes until a closure stopped holding a second copy).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.model_config import HybridMoeConfig, Qwen4ExpConfig, load_config
from shared.ngram_hash import NgramHashSpec
from shared.ple_table import ensure_table
from stage_worker.checkpoint.names import PLE_BUFFER, PLE_SHARD, Piece, normalise, pieces_for
from stage_worker.checkpoint.random_init import ProceduralTable, fill_random
from stage_worker.model.model import StageModel
from stage_worker.model.rope import Rotary

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor and its file."""


@dataclass
class LoadOptions:
    start: int = 0
    end: int | None = None
    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None          # default: the config's dtype
    load_format: str = "safetensors"          # or "dummy": seeded random weights, no file reads
    with_mtp: bool = False
    ple_dir: Path | None = None               # where expanded PLE tables live; default beside the checkpoint
    seed: int = 0


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {missing[0].name}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def build_empty(cfg: HybridMoeConfig, opts: LoadOptions) -> StageModel:
    dtype = opts.dtype or DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = StageModel(cfg, opts.start, opts.end, with_mtp=opts.with_mtp)
    model = model.to(dtype).to_empty(device=opts.device)
    for m in model.modules():      # non-persistent buffers come back uninitialised from to_empty
        if isinstance(m, Rotary):
            m.inv_freq.copy_(Rotary(m.rotary_dim, cfg.rope_theta).inv_freq)
    return model.eval().requires_grad_(False)


def load_model(model_dir: str | Path, opts: LoadOptions | None = None,
               cfg: HybridMoeConfig | None = None) -> StageModel:
    opts = opts or LoadOptions()
    model_dir = Path(model_dir)
    cfg = cfg or load_config(model_dir)
    model = build_empty(cfg, opts)
    if opts.load_format == "dummy":
        fill_random(model, opts.seed)
        for layer, ple in _ple_modules(model):
            spec: NgramHashSpec = ple.spec
            ple.table = ProceduralTable(spec.padded_rows, cfg.ple_head_dim, next(model.parameters()).dtype, opts.seed + layer)
        return model
    if opts.load_format != "safetensors":
        raise ValueError(f"load format {opts.load_format!r}: expected 'safetensors' or 'dummy'")
    _load_tensors(model, cfg, model_dir, opts)
    return model


def _ple_modules(model: StageModel):
    for idx, layer in model.layers.items():
        if getattr(layer, "ple", None) is not None:
            yield int(idx), layer.ple


def _load_tensors(model: StageModel, cfg: HybridMoeConfig, model_dir: Path, opts: LoadOptions) -> None:
    params = dict(model.named_parameters())
    pieces = pieces_for(cfg, {n: p.shape for n, p in params.items()})
    with torch.device("meta"):
        full = StageModel(cfg, with_mtp=True)
    known = set(pieces_for(cfg, {n: p.shape for n, p in full.named_parameters()}))
    del full
    filled: dict[str, int] = defaultdict(int)
    ple_shards: dict[int, dict[int, tuple[Path, str]]] = defaultdict(dict)
    ple_layers = {layer: ple for layer, ple in _ple_modules(model)}
    skipped_extra: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for raw_name in f.keys():
                name = normalise(raw_name)
                if name in pieces:
                    tensor = f.get_tensor(raw_name)
                    for piece in pieces[name]:
                        _place(params[piece.local], piece, tensor, raw_name, path)
                        filled[piece.local] += _numel(piece)
                    del tensor
                    continue
                m = PLE_SHARD.match(name)
                if m:
                    layer = int(m.group(1))
                    if layer in ple_layers:
                        ple_shards[layer][int(m.group(2) or -1)] = (path, raw_name)
                    continue
                m = PLE_BUFFER.match(name)
                if m:
                    if int(m.group(1)) in ple_layers:
                        _check_hash_buffer(ple_layers[int(m.group(1))].spec, m.group(2), f.get_tensor(raw_name),
                                           raw_name, path)
                    continue
                if name in known:
                    continue                       # another stage's tensor
                if name.startswith(("model.visual.", "visual.")) or (name.startswith("mtp.") and model.mtp is None):
                    skipped_extra.add(name.split(".")[0] + "." + name.split(".")[1])
                    continue
                raise CheckpointError(f"unexpected tensor {raw_name!r} in {path}: no part of a "
                                      f"{cfg.family} model with this config.json takes it")
    if skipped_extra:
        log.info("checkpoint: skipped tensors under %s (not served by this stage)", ", ".join(sorted(skipped_extra)))
    _check_complete(params, pieces, filled, model_dir)
    for layer, ple in ple_layers.items():
        ple.table = _open_ple_table(cfg, layer, ple.spec, ple_shards.get(layer, {}), model_dir, opts)


def _numel(piece: Piece) -> int:
    n = 1
    for d in piece.shape:
        n *= d
    if piece.transform is not None:
        return -1                                   # counted by the caller through the local slice instead
    return n


@torch.no_grad()
def _place(param: torch.Tensor, piece: Piece, tensor: torch.Tensor, name: str, path: Path) -> None:
    if tuple(tensor.shape) != piece.shape:
        raise CheckpointError(f"tensor {name!r} in {path} has shape {list(tensor.shape)}, "
                              f"expected {list(piece.shape)}")
    if piece.transform is not None:
        tensor = piece.transform(tensor)
    target = param[piece.index] if piece.index else param
    target.copy_(tensor.to(param.dtype))


def _check_complete(params: dict[str, torch.Tensor], pieces: dict[str, list[Piece]], filled: dict[str, int],
                    model_dir: Path) -> None:
    # Transformed pieces (Qwen3-Next grouped projections) fill their whole local tensor.
    covered = {local: (n < 0 or n >= params[local].numel()) for local, n in filled.items()}
    missing_locals = [n for n in params if not covered.get(n)]
    if not missing_locals:
        return
    names = sorted(hf for hf, ps in pieces.items() if any(p.local in missing_locals for p in ps)
                   and not hf.endswith(("experts.gate_up_proj", "experts.down_proj")))
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise CheckpointError(f"missing tensor(s) in {model_dir}: {shown}")


def _check_hash_buffer(spec: NgramHashSpec, kind: str, tensor: torch.Tensor, name: str, path: Path) -> None:
    expected = {"layer_multipliers": spec.multipliers, "ngram_heads_vocab_sizes": spec.primes,
                "ngram_heads_offsets": spec.offsets}[kind]
    if [int(x) for x in tensor.tolist()] != [int(x) for x in expected]:
        raise CheckpointError(f"tensor {name!r} in {path} disagrees with the n-gram hash derived from config.json "
                              f"(seed, vocab_size, ngram_vocab_size_base): {tensor.tolist()} != {list(expected)}")


def _open_ple_table(cfg: Qwen4ExpConfig, layer: int, spec: NgramHashSpec, shards: dict[int, tuple[Path, str]],
                    model_dir: Path, opts: LoadOptions):
    prefix = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding"
    if not shards:
        raise CheckpointError(f"missing tensor(s) in {model_dir}: {prefix}.shard_0.weight "
                              f"... (the PLE table of layer {layer})")
    if -1 in shards:
        order = [shards[-1]]
    else:
        order = [shards.get(k) for k in range(cfg.split_ngram_parts)]
        if None in order:
            k = order.index(None)
            raise CheckpointError(f"missing tensor {prefix}.shard_{k}.weight in {model_dir} "
                                  f"(split_ngram_parts={cfg.split_ngram_parts})")
        extra = sorted(k for k in shards if k >= cfg.split_ngram_parts)
        if extra:
            raise CheckpointError(f"unexpected tensor {prefix}.shard_{extra[0]}.weight in {shards[extra[0]][0]}: "
                                  f"config.json says split_ngram_parts={cfg.split_ngram_parts}")

    def read(k: int) -> torch.Tensor:
        path, name = order[k]
        with safe_open(path, framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    first = read(0)
    dtype = first.dtype
    del first
    out_dir = Path(opts.ple_dir) if opts.ple_dir else model_dir
    out = out_dir / f"ple_table.layer{layer}.bin"
    try:
        return ensure_table(read, len(order), out, rows=spec.padded_rows, dim=cfg.ple_head_dim, dtype=dtype,
                            desc=f"expanding PLE table of layer {layer}")
    except ValueError as exc:
        raise CheckpointError(f"PLE table of layer {layer} in {model_dir}: {exc}") from exc
