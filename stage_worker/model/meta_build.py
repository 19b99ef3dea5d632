"""Build modules on the meta device without running their initialisers.

The loader, the memory estimate and the checkpoint writer build models on `meta` for their shapes only. Left alone,
`nn.Linear` and `nn.Embedding` initialise their meta weights, which goes through torch's Python reference
decompositions and imports torch._dynamo: about 4 s of every stage process's start-up, for values nobody reads.
Here the `torch.nn.init` functions are no-ops while the block runs (as transformers' `no_init_weights` does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "zeros_", "ones_", "constant_", "orthogonal_")


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextmanager
def on_meta() -> Iterator[None]:
    """`with torch.device("meta")`, minus the initialisers."""
    saved = {name: getattr(nn.init, name) for name in _INITS if hasattr(nn.init, name)}
    for name in saved:
        setattr(nn.init, name, _keep)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
