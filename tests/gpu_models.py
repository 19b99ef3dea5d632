"""A model of a preset (or a raw config) with random weights generated on the GPU, for the GPU-only tests: the
same build the tiny-preset and small-preset tests of several files need (PLE tables procedural, so nothing is
written to disk)."""

from __future__ import annotations

import torch

from shared.model_config import config_from_dict
from shared.ple_files import ProceduralTable
from stage_worker.checkpoint.loader import LoadOptions, build_empty
from stage_worker.checkpoint.make_model import preset_config
from stage_worker.checkpoint.random_init import fill_random


def random_gpu_model(preset: str = "tiny", dtype: torch.dtype = torch.float32, raw: dict | None = None,
                     seed: int = 0):
    """(model on cuda with seeded random weights, its config); `raw` replaces the preset's config."""
    raw = dict(raw) if raw is not None else preset_config(preset)
    raw.update(eos_token_id=3, dtype=str(dtype).removeprefix("torch."))
    cfg = config_from_dict(raw)
    model = build_empty(cfg, LoadOptions(device="cuda", dtype=dtype))
    fill_random(model, seed=seed)
    for layer in model.layers.values():
        if getattr(layer, "ple", None) is not None:
            layer.ple.table = ProceduralTable(layer.ple.spec.padded_rows, cfg.ple_head_dim, dtype, seed)
    return model, cfg
