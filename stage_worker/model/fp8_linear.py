"""Dense Linear layers kept in a block-FP8 checkpoint's form (issue 17): `Fp8Linear` holds transformers' `fp8`
tensors as they are on disk (`weight` float8_e4m3fn [N, K], as uint8 bytes; `weight_scale_inv` float32 per block of
rows x columns) and runs `kernels/fp8_gemv.py` for decode (converted and scaled in registers: one byte a weight read
instead of bf16's two), or dequantizes a block of rows at a time and multiplies (prefill, the CPU).

Which modules: the plain-linear sites of `quant_linear.plain_linear_sites` (attention's o_proj, Gated DeltaNet's
out_proj and its four in-projections, a dense layer's MLP, the MTP head's fc, lm_head), less the hyper-connection mix
weights (the mix kernels read their float weight), whose checkpoint scheme is float8 in blocks (not in
`modules_to_not_convert`), their on-disk `weight` float8_e4m3fn and their `weight_scale_inv` of the block's shape,
one on-disk module filling each whole. Weights a fused bf16 kernel reads stay dequantized at load, as for
`packed_dense`: q/k/v and the QSA indexer (one GEMV over row views), the shared expert (the MoE kernels' extra slot
or the FP8 experts' bf16 pair), the router. The DeltaNet in-projections run as four GEMVs (not fused) when float8.
Switch: cluster key `packed_fp8_dense` (MOEPIPE_PACKED_FP8_DENSE), GPU stages only.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shared.quant_scheme import QuantPlan
from stage_worker.kernels.fp8_gemv_ref import Fp8Weight

_MIX = re.compile(r"(^|\.)input_mix_weight_(down|up)$")       # read as float weights by the mix kernels


class Fp8Linear(nn.Module):
    """y = x W^T with W in float8 bytes and block scales (no bias: modules with one stay dequantized)."""

    # The kernel also runs on CPU tensors under TRITON_INTERPRET=1 where a test opts in; otherwise the CPU path
    # dequantizes a block of rows at a time.
    interpret_on_cpu: bool = False

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], device=None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        br, bc = self.block
        self.register_buffer("weight_fp8", torch.empty(out_features, in_features, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale_inv", torch.empty(-(-out_features // br), -(-in_features // bc),
                                                             dtype=torch.float32, device=device))
        self.bias = None

    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight_fp8, self.weight_scale_inv, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from stage_worker.kernels.fp8_gemv import dequant_matmul, fp8_gemv

        x2 = x.reshape(-1, self.in_features)
        y = fp8_gemv(x2, self.fp8()) if x.is_cuda or self.interpret_on_cpu else dequant_matmul(x2, self.fp8())
        return y.view(*x.shape[:-1], self.out_features)

    def prepare_kernels(self) -> None:
        """Called by `StageModel.set_kernels`: the GEMV's split counters exist before any CUDA graph is captured."""
        if self.weight_fp8.is_cuda:
            from stage_worker.kernels.split_reduce import split_locks

            split_locks(self.weight_fp8.device)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 blocks {self.block}"


def fp8_sites(model: nn.Module) -> list[str]:
    """The Linear modules an Fp8Linear may stand in for: see the module docstring."""
    from stage_worker.model.quant_linear import plain_linear_sites

    return [name for name in plain_linear_sites(model) if not _MIX.search(name)]


def fp8_specs(plan: QuantPlan | None, sites: dict[str, tuple[int, int]],
              disk: dict[str, tuple[tuple, str]]) -> dict[str, tuple[int, int]]:
    """Site (local module name) -> its scale block, for the sites kept float8. `sites`: local module -> (out, in)
    features, only modules one on-disk tensor fills whole; `disk`: on-disk tensor name -> (shape, safetensors
    dtype) from the files' headers. Anything else (another float8 format, shapes that do not fit) is left to the
    dequantize-at-load path, which names the mismatch."""
    from stage_worker.model.quant_linear import disk_module

    if plan is None or plan.method != "fp8":
        return {}
    out = {}
    for local, (N, K) in sites.items():
        module = disk_module(local)
        wq = plan.for_module(module)
        if wq is None or (wq.kind, wq.bits, wq.strategy) != ("float", 8, "block") or wq.block is None:
            continue
        br, bc = wq.block
        w, s = disk.get(f"{module}.weight"), disk.get(f"{module}.weight_scale_inv")
        if w != ((N, K), "F8_E4M3") or s is None or tuple(s[0]) != (-(-N // br), -(-K // bc)):
            continue
        out[local] = (br, bc)
    return out


def use_fp8_dense(model: nn.Module, specs: dict[str, tuple[int, int]]) -> None:
    """Replace each named Linear with an Fp8Linear of its block (on the model's device, meta while building)."""
    for name, block in specs.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, Fp8Linear(old.in_features, old.out_features, block, device=old.weight.device))
