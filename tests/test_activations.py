"""Every `hidden_act` moepipe accepts computes what transformers' ACT2FN computes for that name, to the bit on the
same input (the model's logits then match the reference whatever the activation)."""

from __future__ import annotations

import pytest
import torch

from shared.model_config import ACTIVATIONS
from stage_worker.model.activations import activation


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_matches_transformers(name):
    act2fn = pytest.importorskip("transformers.activations").ACT2FN
    x = torch.linspace(-12, 12, 4001, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(activation(name)(x.to(dtype)), act2fn[name](x.to(dtype))), (name, dtype)


def test_the_list_is_transformers_parameter_free_names():
    """ACTIVATIONS is every ACT2FN name but those with weights of their own (no checkpoint carries them for
    hidden_act): a transformers release that adds one shows up here."""
    act2fn = pytest.importorskip("transformers.activations").ACT2FN
    with_weights = {name for name in act2fn if any(True for _ in act2fn[name].parameters())}
    assert ACTIVATIONS == set(act2fn) - with_weights
