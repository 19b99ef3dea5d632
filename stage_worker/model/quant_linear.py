"""Dense Linear layers kept in a checkpoint's packed INT4/6/8 form (issue 17, item 2): `PackedLinear` holds the
compressed-tensors words and scales (`weight_packed` int32 [N, W], `weight_scale` [N, G], as on disk) and runs
`kernels/quant_gemv.py` for decode (dequantized in registers), or dequantizes a block of rows at a time and
multiplies (prefill, the CPU).

Which modules: those the model calls as a plain linear (`x -> module(x)`) everywhere (`plain_linear_sites`):
attention's o_proj, Gated DeltaNet's out_proj and its four in-projections (decode reads them as one packed weight,
`fuse_packed`, when they share a scheme), the hyper-connection mix's down and up weights (the mix kernels read INT8
per-channel bytes in place; another scheme takes the PyTorch path), a dense layer's MLP, the MTP head's fc, lm_head
(unless tied to the embedding), and the shared expert of a layer whose INT4 routed experts stay packed (then it
runs beside the INT4 kernels, never as the bf16 MoE kernel's extra slot), and attention's q/k/v (decode reads them as
one packed weight when they share a scheme, the QSA indexer's bf16 rows beside them: `Attention.prepare_kernels`).
Weights a fused kernel reads as bf16 stay dequantized at load: the QSA indexer's projection, the shared expert beside
bf16 experts (the MoE kernel's last slot), the block-inject weight, the PLE projections, the router and the
embedding (a gather, not a Linear).

A module is kept packed when its scheme is compressed-tensors INT 4, 6 or 8, symmetric, per channel (or per
tensor, held as per channel), or per group of a multiple of 8 inputs (a last partial group allowed), its words on
disk are in either packing, and its on-disk weight maps onto it one to one. Switch: cluster key `packed_dense`
(MOEPIPE_PACKED_DENSE=0 dequantizes at load, as before).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shared.quant_scheme import QuantPlan, WeightQuant
from stage_worker.kernels.flags import NONE, KernelFlags
from stage_worker.kernels.quant_gemv_ref import PackedWeight

BITS = (4, 6, 8)
# module names (as StageModel names them) whose only use is a plain linear call
_PLAIN = re.compile(r"(^|\.)(self_attn\.o_proj|linear_attn\.(out_proj|in_proj_(qkv|z|b|a))|mlp\.(gate|up|down)_proj"
                    r"|input_mix_weight_(down|up)|fc|lm_head)$")
_SHARED = re.compile(r"(^|\.)mlp\.shared_expert\.(gate|up|down)_proj$")
_QKV = re.compile(r"(^|\.)self_attn\.(q|k|v)_proj$")


@dataclass(frozen=True)
class PackedSpec:
    """How one module is kept: its scheme's bits and group (inputs per scale column; K for one a row) and the
    shapes and dtypes of its words and scales as the checkpoint stores them."""

    bits: int
    group: int
    words: int
    groups: int
    scale_dtype: torch.dtype


class PackedLinear(nn.Module):
    """y = x W^T with W in packed words and scales (no bias: modules with one stay dequantized)."""

    # The kernel also runs on CPU tensors under TRITON_INTERPRET=1 where a test opts in; otherwise the CPU path
    # dequantizes a block of rows at a time.
    interpret_on_cpu: bool = False
    kernels: KernelFlags = NONE       # set by StageModel.set_kernels (quant_gemv_fma, quant_gemv_wide)

    def __init__(self, in_features: int, out_features: int, spec: PackedSpec, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group = spec.bits, spec.group
        self.register_buffer("weight_packed", torch.empty(out_features, spec.words, dtype=torch.int32,
                                                          device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, spec.groups, dtype=spec.scale_dtype,
                                                         device=device))
        self.bias = None

    def packed(self) -> PackedWeight:
        return PackedWeight(self.weight_packed, self.weight_scale, self.bits, self.in_features, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed(), self.kernels.quant_gemv_fma, self.kernels.quant_gemv_wide)

    def prepare_kernels(self) -> None:
        """Called by `StageModel.set_kernels`: the GEMV's split counters exist before any CUDA graph is captured."""
        if self.weight_packed.is_cuda:
            from stage_worker.kernels.split_reduce import split_locks

            split_locks(self.weight_packed.device)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} "
                f"{'channel' if self.group >= self.in_features else f'group {self.group}'}")


def plain_linear_sites(model: nn.Module, qkv: bool = False) -> list[str]:
    """Names of the model's Linear modules (bias-free) that are only ever called as a plain linear, so a
    PackedLinear can stand in for them: see the module docstring. Call after `SparseMoE.use_packed`. `qkv`: also
    attention's q/k/v projections, which its decode kernels read as one packed weight beside the indexer's bf16
    rows (`Attention.prepare_kernels`); block-FP8 dense layers (fp8_linear) leave them out."""
    from stage_worker.model.moe import SparseMoE

    packed_moe = {name for name, m in model.named_modules() if isinstance(m, SparseMoE) and m.packed_group}
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or m.bias is not None:
            continue
        if (_PLAIN.search(name) or (qkv and _QKV.search(name))) and ".shared_expert." not in name and \
                ".indexer." not in name:
            out.append(name)
        elif _SHARED.search(name) and name.rsplit(".shared_expert.", 1)[0] in packed_moe:
            out.append(name)
    return out


def keeps_packed(wq: WeightQuant | None) -> bool:
    """A scheme PackedLinear takes (see the module docstring)."""
    return (wq is not None and wq.kind == "int" and wq.bits in BITS and wq.symmetric and wq.format ==
            "pack-quantized" and (wq.strategy in ("channel", "tensor") or
                                  (wq.strategy == "group" and wq.group_size % 8 == 0)))


def packed_specs(plan: QuantPlan | None, sites: dict[str, tuple[int, int]], disk: dict[str, tuple[tuple, str]],
                 dtypes: dict[str, torch.dtype]) -> dict[str, PackedSpec]:
    """Site (local module name) -> PackedSpec, for the sites whose on-disk module is kept packed.

    `sites`: local module -> (out, in) features, only modules whose `.weight` one on-disk tensor fills whole (the
    loader checks); `disk`: on-disk tensor name -> (shape, safetensors dtype), read from the files' headers (the
    word count says which packing, the scale's dtype is kept)."""
    from stage_worker.model.quant_weight import dense_words, legacy_words

    if plan is None or not plan.packs_ints:
        return {}
    out = {}
    for local, (N, K) in sites.items():
        module = disk_module(local)
        wq = plan.for_module(module)
        if not keeps_packed(wq):
            continue
        packed, scale = disk.get(f"{module}.weight_packed"), disk.get(f"{module}.weight_scale")
        if packed is None or scale is None or f"{module}.weight_zero_point" in disk or \
                f"{module}.weight_g_idx" in disk:      # activation-ordered groups: dequantized at load
            continue
        (rows, words), sshape = packed[0], scale[0]
        if rows != N or words not in (dense_words(K, wq.bits), legacy_words(K, wq.bits)):
            continue                          # the loader's dequantize path names the mismatch
        group = wq.group_size if wq.strategy == "group" else K
        groups = -(-K // group)
        if tuple(sshape) not in ((N, groups),) + (((N,), (1,), ()) if groups == 1 else ()):
            continue
        out[local] = PackedSpec(wq.bits, group, words, groups, dtypes.get(scale[1], torch.float32))
    return out


def disk_module(local: str) -> str:
    """The on-disk module name of local module `local` (`lm_head` and `mtp.*` keep theirs, the rest gain `model.`)."""
    from stage_worker.checkpoint.names import hf_name

    return hf_name(f"{local}.weight")[: -len(".weight")]


def fuse_packed(mods: Sequence[PackedLinear]) -> PackedWeight | None:
    """One PackedWeight over the modules' rows, in order (their words and scales concatenated once, each module's
    buffers rebound as views of them: no extra memory once the old ones are freed, state_dict unchanged), so one
    GEMV reads them all; None when they differ in bits, group, packing or scale dtype (then each runs alone)."""
    first = mods[0]
    same = all((m.bits, m.group, m.in_features, m.weight_packed.shape[1], m.weight_scale.shape[1],
                m.weight_scale.dtype, m.weight_packed.device) ==
               (first.bits, first.group, first.in_features, first.weight_packed.shape[1],
                first.weight_scale.shape[1], first.weight_scale.dtype, first.weight_packed.device) for m in mods)
    if not same:
        return None
    with torch.inference_mode(False), torch.no_grad():    # normal tensors even when called under inference mode
        words = torch.cat([m.weight_packed for m in mods])
        scales = torch.cat([m.weight_scale for m in mods])
        row = 0
        for m in mods:
            n = m.out_features
            m.weight_packed, m.weight_scale = words[row:row + n], scales[row:row + n]
            row += n
    return PackedWeight(words, scales, first.bits, first.in_features, first.group)


def still_fused_packed(fused: PackedWeight | None, mods: Sequence[nn.Module]) -> bool:
    """Every module is a PackedLinear whose words and scales are still the views `fuse_packed` made."""
    if fused is None:
        return False
    row = 0
    for m in mods:
        if not isinstance(m, PackedLinear) or m.weight_packed.data_ptr() != fused.words[row:].data_ptr() or \
                m.weight_scale.data_ptr() != fused.scales[row:].data_ptr():
            return False
        row += m.out_features
    return row == fused.out_features


def packed_matmul(x: torch.Tensor, pw: PackedWeight, fma: bool = True, wide: bool = False,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for a packed weight, as PackedLinear.forward runs it (the GEMV kernel on a GPU or under the
    interpreter where tests opt in, else a block of rows dequantized at a time; `fma`, `wide`, `out` (x 2-D):
    quant_gemv's)."""
    from stage_worker.kernels.quant_gemv import dequant_matmul, quant_gemv

    x2 = x.reshape(-1, pw.in_features)
    if x.is_cuda or PackedLinear.interpret_on_cpu:
        y = quant_gemv(x2, pw, fma=fma, wide=wide, out=out)
    else:
        y = dequant_matmul(x2, pw) if out is None else out.copy_(dequant_matmul(x2, pw))
    return y.view(*x.shape[:-1], pw.out_features)


def dummy_specs(model: nn.Module, dtype: torch.dtype, qkv: bool = True) -> dict[str, PackedSpec]:
    """The reports' release for the `plain_linear_sites` of a model without files (benchmarks): lm_head and the
    hyper-connection mix weights INT8 per channel, the rest INT6 in groups of 128 inputs (or the largest power of
    two >= 8 dividing them, else per channel, as `moepipe quantize` chooses), the dense bit stream, scales in
    `dtype`."""
    from stage_worker.model.quant_weight import dense_words

    out = {}
    for name in plain_linear_sites(model, qkv=qkv):
        K = model.get_submodule(name).in_features
        if name.endswith(("lm_head", "_down", "_up")):
            bits, group = 8, K
        else:
            bits, group = 6, next((g for g in (128, 64, 32, 16, 8) if K % g == 0), K)
        out[name] = PackedSpec(bits, group, dense_words(K, bits), -(-K // group), dtype)
    return out


def use_packed_dense(model: nn.Module, specs: dict[str, PackedSpec]) -> None:
    """Replace each named Linear with a PackedLinear of its spec (on the model's device, meta while building)."""
    for name, spec in specs.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, PackedLinear(old.in_features, old.out_features, spec, device=old.weight.device))
