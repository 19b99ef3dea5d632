"""Open the PLE tables of every PLE layer exactly as a stage's loader does, without loading any weights.

The loader decides where a table's expansion lives (a file beside the checkpoint whose name fingerprints its source
shards) and expands it on first use. The service must map that very file: a second expansion would cost another
95 GiB of disk and split the page cache between two copies. So the shard scan here feeds the loader's own
`_open_ple_table`; normally the PLE stage has already expanded the table and this only maps it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from shared.model_config import Qwen4ExpConfig
from shared.ngram_hash import NgramHashSpec, ple_layer_indices
from stage_worker.checkpoint import loader
from stage_worker.checkpoint.names import PLE_SHARD, normalise
from stage_worker.checkpoint.random_init import dummy_ple_table


def ple_specs(cfg: Qwen4ExpConfig) -> dict[int, NgramHashSpec]:
    """0-based decoder layer -> its hash spec, in PLE-index order (the ring's layer order)."""
    return {layer: NgramHashSpec.from_model_config(cfg, idx)
            for layer, idx in sorted(ple_layer_indices(cfg.ple_layer_ids).items(), key=lambda kv: kv[1])}


def open_tables(model_dir: str | Path, cfg: Qwen4ExpConfig, *, ple_dir: Path | None = None,
                load_format: str = "safetensors", dtype: torch.dtype | None = None, seed: int = 0,
                dummy_file: bool = False) -> dict:
    """0-based layer -> table: a `FlatTable`, or for the `dummy` format a `ProceduralTable` seeded as the loader
    seeds it, so the service and the in-process fallback gather the same values (with `dummy_file`, the same rows
    from the same file as the loader's `dummy_ple_file`). Raises the loader's
    CheckpointError (a ValueError naming the tensor and file) for missing or misshapen shards."""
    model_dir = Path(model_dir)
    specs = ple_specs(cfg)
    if load_format == "dummy":
        dt = dtype or loader.DTYPES[cfg.dtype]
        where = (ple_dir or model_dir) if dummy_file else None
        return {layer: dummy_ple_table(spec.padded_rows, cfg.ple_head_dim, dt, seed + layer, layer, where)
                for layer, spec in specs.items()}
    shards = _find_shards(model_dir, set(specs))
    opts = loader.LoadOptions(ple_dir=ple_dir)
    return {layer: loader._open_ple_table(cfg, layer, spec, shards.get(layer, {}), model_dir, opts)
            for layer, spec in specs.items()}


def _find_shards(model_dir: Path, layers: set[int]) -> dict[int, dict[int, tuple[Path, str, tuple]]]:
    """layer -> shard number (-1: unsharded) -> (file, tensor name, shape), in the loader's format, from the
    safetensors headers only (no tensor data is read)."""
    found: dict[int, dict[int, tuple[Path, str, tuple]]] = {}
    for path in loader.checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for raw in f.keys():
                m = PLE_SHARD.match(normalise(raw))
                if m and int(m.group(1)) in layers:
                    shape = tuple(f.get_slice(raw).get_shape())
                    found.setdefault(int(m.group(1)), {})[int(m.group(2) or -1)] = (path, raw, shape)
    return found
