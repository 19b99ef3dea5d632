"""Quantized dense layers filled straight from the checkpoint files: each on-disk part of a module kept quantized
(compressed-tensors words and scales into a `PackedLinear`; a block-FP8 weight's bytes and scales into an
`Fp8Linear`) is copied into its module's buffers as the loader streams the files, never through a float weight.
`finish` names any part that never came. The loader asks `takes(name)` of each placer before anything else."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stage_worker.model.fp8_linear import Fp8Linear
from stage_worker.model.quant_linear import PackedLinear, disk_module


class _Placer:
    """The module bookkeeping both kinds share: which modules of `kind` the model holds, by their on-disk name,
    which of their PARTS have been placed, and the error for the missing ones."""

    PARTS: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, kind: type[nn.Module], error: type[Exception]) -> None:
        self.modules = {disk_module(n): m for n, m in model.named_modules() if isinstance(m, kind)}
        self.error = error
        self.seen: set[tuple[str, str]] = set()

    def takes(self, name: str) -> bool:
        module, _, part = name.rpartition(".")
        return part in self.PARTS and module in self.modules

    def _copy(self, target: torch.Tensor, tensor: torch.Tensor, raw_name: str, path: Path, what: str) -> None:
        if tuple(tensor.shape) != tuple(target.shape):
            raise self.error(f"tensor {raw_name!r} in {path} has shape {list(tensor.shape)}, expected "
                             f"{list(target.shape)} ({what})")
        target.copy_(tensor.to(target.dtype))

    def finish(self, model_dir: Path) -> None:
        missing = [f"{module}.{part}" for module in self.modules for part in self.PARTS
                   if (module, part) not in self.seen]
        if missing:
            raise self.error(f"missing tensor(s) in {model_dir}: {', '.join(missing[:3])}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))


class PackedDensePlacer(_Placer):
    """compressed-tensors `weight_packed` and `weight_scale` (a per-tensor scale repeated per row) into each
    PackedLinear, `weight_shape` checked against the module."""

    PARTS = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, model: nn.Module, error: type[Exception]) -> None:
        super().__init__(model, PackedLinear, error)

    @torch.no_grad()
    def place(self, name: str, tensor: torch.Tensor, raw_name: str, path: Path) -> None:
        module, _, part = name.rpartition(".")
        m = self.modules[module]
        if part == "weight_shape":
            if [int(v) for v in tensor.tolist()] != [m.out_features, m.in_features]:
                raise self.error(f"tensor {raw_name!r} in {path} says {tensor.tolist()}, expected "
                                 f"{[m.out_features, m.in_features]}")
        else:
            target = getattr(m, part)
            if part == "weight_scale" and tensor.numel() in (1, target.shape[0]) and target.shape[1] == 1:
                tensor = tensor.reshape(-1, 1).expand(target.shape)
            self._copy(target, tensor, raw_name, path, f"int{m.bits}, group {m.group}")
        self.seen.add((module, part))


class Fp8DensePlacer(_Placer):
    """A block-FP8 `weight` (its float8 bytes) and `weight_scale_inv` into each Fp8Linear."""

    PARTS = ("weight", "weight_scale_inv")

    def __init__(self, model: nn.Module, error: type[Exception]) -> None:
        super().__init__(model, Fp8Linear, error)

    @torch.no_grad()
    def place(self, name: str, tensor: torch.Tensor, raw_name: str, path: Path) -> None:
        module, _, part = name.rpartition(".")
        m = self.modules[module]
        if part == "weight":
            if tensor.dtype != torch.float8_e4m3fn:
                raise self.error(f"tensor {raw_name!r} in {path} is {tensor.dtype}; dense layers kept in float8 "
                                 f"(packed_fp8_dense) take float8_e4m3fn")
            self._copy(m.weight_fp8, tensor.view(torch.uint8), raw_name, path, f"float8, blocks {m.block}")
        else:
            self._copy(m.weight_scale_inv, tensor, raw_name, path, f"float8, blocks {m.block}")
        self.seen.add((module, part))
