"""The activation a config's `hidden_act` names (MLPs, experts, the DeltaNet short conv; Qwen4-Exp's gated norm when
`output_gate_type` is unset), computed as transformers' `ACT2FN` computes it: the same formula, so logits match the
reference (tests/test_activations.py compares every name). The names are `shared.model_config.ACTIVATIONS`; the
fused kernels compute SiLU only, so `StageModel.set_kernels` keeps another activation on these PyTorch paths."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shared.model_config import ACTIVATIONS

Activation = Callable[[torch.Tensor], torch.Tensor]
_C = math.sqrt(2.0 / math.pi)


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


_TABLE: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10),
    "gelu_new": _gelu_tanh_formula,
    "gelu_accurate": _gelu_tanh_formula,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_python_tanh": _gelu_tanh_formula,
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0)))),
    "hardswish": F.hardswish,
    "leaky_relu": F.leaky_relu,
    "linear": lambda x: x,
    "mish": F.mish,
    "relu": F.relu,
    "relu2": _relu2,
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "tanh": torch.tanh,
}
assert set(_TABLE) == set(ACTIVATIONS), "stage_worker.model.activations and shared.model_config.ACTIVATIONS differ"


def activation(name: str) -> Activation:
    """The function `name` (a validated config's `hidden_act` or gate activation) stands for."""
    return _TABLE[name]


def is_silu(name: str) -> bool:
    """What the fused kernels compute (`swish` is transformers' alias of it)."""
    return name in ("silu", "swish")
