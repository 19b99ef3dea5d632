"""Open the PLE tables of every PLE layer exactly as a stage's loader does, without loading any weights.

The service must map the very file the PLE stage maps (`shared/ple_files.py` says why), so both go through
`open_ple_table`, which decides where a table's expansion lives (a file beside the checkpoint whose name fingerprints
its source shards) and expands it on first use; normally the PLE stage has already expanded the table and this only
maps it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model_config import Qwen4ExpConfig
from shared.ngram_hash import NgramHashSpec, ple_layer_indices
from shared.ple_files import dummy_layer_table, find_ple_shards, open_ple_table


def ple_specs(cfg: Qwen4ExpConfig) -> dict[int, NgramHashSpec]:
    """0-based decoder layer -> its hash spec, in PLE-index order (the ring's layer order)."""
    return {layer: NgramHashSpec.from_model_config(cfg, idx)
            for layer, idx in sorted(ple_layer_indices(cfg.ple_layer_ids).items(), key=lambda kv: kv[1])}


def open_tables(model_dir: str | Path, cfg: Qwen4ExpConfig, *, load_format: str = "safetensors",
                dtype: torch.dtype | None = None, seed: int = 0, dummy_file: bool = False) -> dict:
    """0-based layer -> table: a `FlatTable`, or for the `dummy` format a `ProceduralTable` seeded as the loader
    seeds it, so the service and the in-process fallback gather the same values (with `dummy_file`, the same rows
    from the same file as the loader's `dummy_ple_file`). Raises the loader's CheckpointError (a ValueError naming
    the tensor and file, `shared/checkpoint_files.py`) for missing or misshapen shards."""
    model_dir = Path(model_dir)
    specs = ple_specs(cfg)
    if load_format == "dummy":
        where = model_dir if dummy_file else None
        return {layer: dummy_layer_table(cfg, layer, spec, dtype, seed, where) for layer, spec in specs.items()}
    shards = find_ple_shards(model_dir, set(specs))
    return {layer: open_ple_table(cfg, layer, spec, shards.get(layer, {}), model_dir)
            for layer, spec in specs.items()}
