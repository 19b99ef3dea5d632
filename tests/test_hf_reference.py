"""bench/hf_reference.py rebuilds transformers' Qwen3-Next from moepipe's weights: same logits, shared experts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_transformers_on_our_weights_gives_our_logits(reference_checkpoints):
    from hf_reference import hf_model_from_ours, time_decode

    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine

    path, _ = reference_checkpoints["qwen3_next"]
    model = load_model(path, LoadOptions(dtype=torch.float32))
    hf = hf_model_from_ours(model)
    ids = list(range(7, 40))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    engine = LocalEngine([model])
    engine.add(0)
    got = engine.step([(0, ids)], all_logits=True)
    assert (got - want).abs().max().item() < 1e-4
    layer = model.layers["0"]
    assert hf.model.layers[0].mlp.experts.gate_up_proj.data_ptr() == layer.mlp.w13.data_ptr()   # shared, not copied
    assert time_decode(hf, [ids, ids[::-1]], steps=2, warmup=1) > 0
