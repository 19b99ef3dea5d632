"""Pipeline split: two stages loaded as layer slices [0, k) and [k, n) give the single-stage model's logits for every
split point, and each slice holds only its own parameters."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import FAMILIES
from shared.model_config import load_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine



TOL = 1e-6
DECODE = [7, 5, 9, 300]          # 5 is EOS: the PLE hash resets on every stage that holds a PLE layer


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 320, (n,), generator=g).tolist()
    ids[n // 2] = 5
    return ids


def _run(stages, prompt: list[int]) -> torch.Tensor:
    engine = LocalEngine(stages, block_size=8)
    engine.add(0)
    out = [engine.step([(0, prompt)], all_logits=True)]
    out += [engine.step([(0, [t])]) for t in DECODE]
    return torch.cat(out)


def _layer_ids(model) -> set[int]:
    return {int(name.split(".")[1]) for name, _ in model.named_parameters() if name.startswith("layers.")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_split_point_gives_the_single_stage_logits(family, reference_checkpoints):
    path, _ = reference_checkpoints[family]
    n = load_config(path).num_hidden_layers
    prompt = _prompt(19, seed=7)
    want = _run([load_model(path, LoadOptions(dtype=torch.float32))], prompt)
    assert want.shape[0] == len(prompt) + len(DECODE)
    for k in range(1, n):
        a = load_model(path, LoadOptions(dtype=torch.float32, start=0, end=k))
        b = load_model(path, LoadOptions(dtype=torch.float32, start=k))
        got = _run([a, b], prompt)
        assert (got - want).abs().max().item() < TOL, f"split at layer {k}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_slices_hold_only_their_parameters(family, reference_checkpoints):
    path, _ = reference_checkpoints[family]
    n = load_config(path).num_hidden_layers
    whole = dict(load_model(path, LoadOptions(dtype=torch.float32)).named_parameters())
    for k in range(1, n):
        a = load_model(path, LoadOptions(dtype=torch.float32, start=0, end=k))
        b = load_model(path, LoadOptions(dtype=torch.float32, start=k))
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert _layer_ids(a) == set(range(k)) and _layer_ids(b) == set(range(k, n)), k
        assert "embed_tokens.weight" in pa and "lm_head.weight" not in pa
        assert "embed_tokens.weight" not in pb and "lm_head.weight" in pb
        assert a.has_embedding and not a.has_head and b.has_head and not b.has_embedding
        # Final mixer / norm only on the last slice.
        assert not any(name.startswith(("norm.", "hyper_connection_mixer.")) for name in pa)
        assert any(name.startswith(("norm.", "hyper_connection_mixer.")) for name in pb)
        # Together the slices are exactly the whole model, with the same values.
        assert not pa.keys() & pb.keys()
        assert pa.keys() | pb.keys() == whole.keys()
        for name, p in {**pa, **pb}.items():
            assert torch.equal(p, whole[name]), name
        # Caches too: each stage allocates state only for its own layers.
        for stage in (a, b):
            engine = LocalEngine([a, b], block_size=8)
            cache = engine.caches[[a, b].index(stage)]
            held = set(cache.attention) | set(cache.deltanet)
            assert held == set(range(stage.start, stage.end)), (k, stage.start)
