"""Routed experts kept in a checkpoint's INT4 form (issue 17): which layers qualify, and placing their on-disk
words and scales into the layers' buffers (`SparseMoE.use_packed`) as the loader streams the files, or, for a layer
with cold experts (issue 16), into each expert's slot of its table (device rows or pinned host rows).

A layer's experts stay packed when the checkpoint's scheme for them is compressed-tensors INT4 by groups that are
multiples of 8 (whole int32 words per group; gate and up alike, down may differ), symmetric (the reports' release)
or asymmetric in all three (AutoAWQ, GPTQ `sym: false`, W4A16_ASYM: the zero points go into the scale rows after the
scales, `kernels/moe_int4_ref.py`), and the hidden and expert widths are multiples of 8. Anything else is
dequantized at load (`quant_weight`).
FP4 experts (compressed-tensors NVFP4A16 / MXFP4A16: `nvfp4-pack-quantized` groups of 16 over a global scale,
`mxfp4-pack-quantized` groups of 32 of E8M0 exponents, the same format in all three projections) stay packed too, in
the same words (the `weight_packed` bytes read as int32) with float32 scale rows s = bf16(scale) / global
(`quant_weight.fp4_group_scales`), and run in the INT4 kernels with their FP4 switch (`kernels/moe_int4_ref.py`);
NVFP4's global scale may come before or after a module's scales: whichever comes first is held until both are in.
The MTP head's experts are always dequantized. Switch: cluster key `packed_experts` (MOEPIPE_PACKED_EXPERTS=0).

The third form: a block-FP8 checkpoint's (transformers' `fp8`) routed experts kept as their float8 bytes (uint8
storage) and float32 block scales (`SparseMoE.use_fp8`), half the bf16 bytes; the placer copies each expert's
`weight` and `weight_scale_inv` into its rows, or into its slot of the layer's expert table with cold experts (the
float8 bytes and scales themselves, never a bf16 copy). Switch: cluster key `packed_fp8_experts`
(MOEPIPE_PACKED_FP8_EXPERTS=0 turns it off; on by default since the H200 ran the FP8 kernel, h200-14).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from shared.model_config import HybridMoeConfig
from shared.quant_scheme import QuantPlan, QuantSchemeError
from stage_worker.kernels.moe_int4_ref import scale_columns
from stage_worker.model.quant_weight import fp4_group_scales, unpack_rows

log = logging.getLogger(__name__)

NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight_packed|weight_scale|"
                  r"weight_zero_point|weight_shape|weight_global_scale)$")
FP8_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")
FP8_PARTS = ("weight", "weight_scale_inv")


def _expert_schemes(plan: QuantPlan, cfg: HybridMoeConfig, start: int, end: int):
    """(layer, [scheme of gate, up, down] of its experts) for this stage's MoE layers: what decides whether a layer's
    experts can stay in their checkpoint's form. A part whose experts do not all share one scheme is None (one
    buffer a layer holds one form: GPTQModel's `dynamic` regexes such as `.*\\.1\\..*` reach `experts.1.` of every
    layer, AutoRound's `extra_config` names single experts; QA 2026-12-07): those layers are dequantized at load."""
    for layer in range(start, end):
        if cfg.is_sparse_moe(layer):
            schemes = []
            for part in ("gate", "up", "down"):
                each = {plan.for_module(f"model.layers.{layer}.mlp.experts.{e}.{part}_proj")
                        for e in range(cfg.num_experts)}
                schemes.append(each.pop() if len(each) == 1 else None)
            yield layer, schemes


_EXPERT_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.(\w+)$")


def expert_tensors(headers: dict[str, tuple[tuple, str]]) -> Iterator[tuple[int, str, str]]:
    """(decoder layer, part: `weight`, `weight_packed`, `weight_scale`, ..., safetensors dtype) of every routed
    expert tensor in `headers` (`shared.checkpoint_files.tensor_headers`; the MTP layer's left out)."""
    for name, (_, dtype) in headers.items():
        m = None if name.startswith("mtp.") else _EXPERT_TENSOR.search(name)
        if m is not None:
            yield int(m.group(1)), m.group(2), dtype


@functools.lru_cache(maxsize=8)
def _quantized_expert_layers(model_dir: str) -> tuple[frozenset[int], frozenset[int]]:
    """(layers whose experts are INT4-packed on disk: `weight_packed`, and no `weight_g_idx`; layers whose expert
    weights are float8 on disk), from the safetensors headers. The quantization config alone does not say: a
    compressed-tensors group targeting `Linear` (what the library writes for a transformers model) leaves 3-D expert
    modules in bf16, and a transformers fp8 config may not list experts it left unconverted."""
    from shared.checkpoint_files import tensor_headers

    packed, fp8, g_idx, plain = set(), set(), set(), set()
    for layer, part, dtype in expert_tensors(tensor_headers(Path(model_dir))):
        if part == "weight_packed":
            packed.add(layer)
        elif part == "weight_g_idx":            # activation-ordered groups (GPTQ actorder): dequantized at load
            g_idx.add(layer)
        elif part == "weight" and dtype.startswith("F8"):
            fp8.add(layer)
        elif part == "weight":                  # an expert the quantizer left in float beside packed ones
            plain.add(layer)
    return frozenset(packed - g_idx - plain), frozenset(fp8 - plain)


def packed_layers(plan: QuantPlan | None, cfg: HybridMoeConfig, start: int, end: int,
                  model_dir: Path | str | None = None) -> dict[int, tuple[int, int, bool, bool]]:
    """Decoder layer -> (group of gate/up, group of down, asymmetric, FP4), for this stage's MoE layers whose
    experts stay packed (`SparseMoE.use_packed`'s arguments): the plan says INT4 groups, symmetric in all three
    projections or asymmetric in all three, or one FP4 format in all three, and (given `model_dir`) the files hold
    them packed."""
    if plan is None or not plan.packs_ints or not _silu_experts(cfg):
        return {}
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if H % 8 or inter % 8:
        return {}
    out = {}
    for layer, schemes in _expert_schemes(plan, cfg, start, end):
        if any(w is None for w in schemes) or schemes[0] != schemes[1]:
            continue
        if all((w.kind, w.bits, w.strategy, w.format, w.symmetric) ==
               ("int", 4, "group", "pack-quantized", schemes[0].symmetric) and w.group_size % 8 == 0
               for w in schemes):
            out[layer] = (schemes[0].group_size, schemes[2].group_size, not schemes[0].symmetric, False)
        elif all(w.fp4 and w.format == schemes[0].format and w.group_size % 8 == 0 for w in schemes):
            out[layer] = (schemes[0].group_size, schemes[2].group_size, False, True)
    if model_dir is not None and out:
        on_disk = _quantized_expert_layers(str(model_dir))[0]
        out = {layer: groups for layer, groups in out.items() if layer in on_disk}
    return out


def fp8_layers(plan: QuantPlan | None, cfg: HybridMoeConfig, start: int, end: int,
               model_dir: Path | str | None = None) -> dict[int, tuple[int, int]]:
    """Decoder layer -> (rows, columns) of a scale block, for this stage's MoE layers whose experts stay float8
    (`packed_fp8_experts`): a transformers `fp8` checkpoint whose gate, up and down of the experts are all
    quantized (none in `modules_to_not_convert`) and (given `model_dir`) float8 in the files."""
    if plan is None or plan.method != "fp8" or not _silu_experts(cfg):
        return {}
    out = {}
    for layer, schemes in _expert_schemes(plan, cfg, start, end):
        if all(w is not None and (w.kind, w.bits, w.strategy) == ("float", 8, "block") and w.block == schemes[0].block
               for w in schemes):
            out[layer] = tuple(schemes[0].block)
    if model_dir is not None and out:
        on_disk = _quantized_expert_layers(str(model_dir))[1]
        out = {layer: block for layer, block in out.items() if layer in on_disk}
    return out


def _silu_experts(cfg: HybridMoeConfig) -> bool:
    """The packed expert kernels compute SiLU: a model with another `hidden_act` has its quantized experts
    dequantized at load instead (as `packed_experts` / `packed_fp8_experts` off would), which any activation runs."""
    from stage_worker.model.activations import is_silu

    if is_silu(cfg.hidden_act):
        return True
    log.info("checkpoint: hidden_act %r: quantized routed experts are dequantized at load (the packed expert "
             "kernels compute SiLU)", cfg.hidden_act)
    return False


def dummy_groups(cfg: HybridMoeConfig) -> tuple[int, int]:
    """The INT4 groups of gate/up and down that `moepipe quantize --scheme int4-experts` gives a model of these
    widths (128, or the largest power of two >= 8 dividing the inputs): what the `dummy` format's packed experts use
    (cluster key `dummy_quant`, benchmarks)."""
    def group(width: int) -> int:
        g = 128
        while g > 8 and width % g:
            g //= 2
        return g

    return group(cfg.hidden_size), group(cfg.moe_intermediate_size)


class PackedPlacer:
    """Copies each `...experts.E.{gate,up,down}_proj.{weight_packed,weight_scale}` (and, asymmetric,
    `weight_zero_point`: into the scale rows after the scales) into its layer's buffers and checks `weight_shape`;
    FP4: the codes' bytes as words, and the effective scales once a module's scales and global scale are both in;
    `finish` names what never came."""

    def __init__(self, moes: dict, error: type[Exception]) -> None:
        self.moes, self.error = moes, error
        self.seen: set[tuple[int, int, str, str]] = set()
        self.fp4_held: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}   # scales or global, awaiting the other

    def takes(self, name: str) -> bool:
        m = NAME.match(name) or FP8_NAME.match(name)
        return m is not None and int(m.group(1)) in self.moes and \
            bool(self.moes[int(m.group(1))].fp8_block) == (m.re is FP8_NAME)

    @torch.no_grad()
    def place(self, name: str, tensor: torch.Tensor, raw_name: str, path: Path) -> None:
        if FP8_NAME.match(name):
            return self._place_fp8(name, tensor, raw_name, path)
        layer, e, proj, part = NAME.match(name).groups()
        layer, e = int(layer), int(e)
        moe = self.moes[layer]
        E, two_i, words = _shape(moe, "q13")
        inter, H = two_i // 2, words * 8
        if e >= E:
            raise self.error(f"tensor {raw_name!r} in {path}: expert {e}, but the layer has {E}")
        fp4_part = part == "weight_global_scale" or \
            part in ("weight_packed", "weight_scale") and tensor.dtype in (torch.uint8, torch.float8_e4m3fn)
        if part != "weight_shape" and fp4_part != moe.packed_fp4:
            raise self.error(f"tensor {raw_name!r} in {path} ({tensor.dtype}) does not fit the layer's experts, read "
                             f"as {'FP4' if moe.packed_fp4 else 'INT4'} (groups {moe.packed_group} / "
                             f"{moe.packed_group2})")
        want = (inter, H) if proj in ("gate", "up") else (H, inter)
        if fp4_part and part != "weight_packed":
            self._hold_fp4_scale(moe, (layer, e, proj), part, tensor, raw_name, path)
        elif part == "weight_shape":
            if tuple(int(v) for v in tensor.tolist()) != want:
                raise self.error(f"tensor {raw_name!r} in {path} says {tensor.tolist()}, expected {list(want)}")
        else:
            kind = ("q" if part == "weight_packed" else "s") + ("2" if proj == "down" else "13")
            target = _proj_rows(moe, kind, e, proj)       # straight into its slot when the layer has a table
            if moe.packed_fp4 and tensor.shape[-1] % 4 == 0:   # two E2M1 codes a byte, low nibble first: the
                tensor = tensor.contiguous().view(torch.int32)   # little-endian int32 words are the kernels'
            elif kind[0] == "s" and _asym(moe):           # scales, then zero points, in one row
                half = target.shape[1] // 2
                target = target[:, half:] if part == "weight_zero_point" else target[:, :half]
                if part == "weight_zero_point" and tensor.dtype == torch.int32:      # packed along the rows
                    tensor = unpack_rows(tensor, 4, target.shape[0])
            elif part == "weight_zero_point":
                raise self.error(f"tensor {raw_name!r} in {path}: a zero point, but the layer's experts were read as "
                                 f"symmetric (INT4, groups {moe.packed_group} / {moe.packed_group2})")
            if tuple(tensor.shape) != tuple(target.shape):
                raise self.error(f"tensor {raw_name!r} in {path} has shape {list(tensor.shape)}, expected "
                                 f"{list(target.shape)} ({'FP4' if moe.packed_fp4 else 'INT4'}, groups "
                                 f"{moe.packed_group} / {moe.packed_group2})")
            target.copy_(tensor.to(target.dtype))
        self.seen.add((layer, e, proj, part))

    def _place_fp8(self, name: str, tensor: torch.Tensor, raw_name: str, path: Path) -> None:
        """A float8 expert's weight (its bytes, into the uint8 rows) or its block scales (float32), in the layer's
        buffers or straight into the expert's slot of its table (cold experts)."""
        layer, e, proj, part = FP8_NAME.match(name).groups()
        layer, e = int(layer), int(e)
        moe = self.moes[layer]
        E, two_i, H = _shape(moe, "q13")
        inter = two_i // 2
        if e >= E:
            raise self.error(f"tensor {raw_name!r} in {path}: expert {e}, but the layer has {E}")
        if part == "weight":
            if tensor.dtype != torch.float8_e4m3fn:
                raise self.error(f"tensor {raw_name!r} in {path} is {tensor.dtype}; float8 experts kept in float8 "
                                 f"(packed_fp8_experts) take float8_e4m3fn")
            q13 = _expert_row(moe, "q13", e)
            target = q13[:inter] if proj == "gate" else q13[inter:] if proj == "up" else _expert_row(moe, "q2", e)
            tensor = tensor.view(torch.uint8)
        else:
            s13 = _expert_row(moe, "s13", e)
            target = s13[0] if proj == "gate" else s13[1] if proj == "up" else _expert_row(moe, "s2", e)
        if tuple(tensor.shape) != tuple(target.shape):
            raise self.error(f"tensor {raw_name!r} in {path} has shape {list(tensor.shape)}, expected "
                             f"{list(target.shape)} (float8 experts, blocks {moe.fp8_block})")
        target.copy_(tensor.to(target.dtype))
        self.seen.add((layer, e, proj, part))

    def _hold_fp4_scale(self, moe, key: tuple[int, int, str], part: str, tensor: torch.Tensor, raw_name: str,
                        path: Path) -> None:
        """An FP4 module's `weight_scale` or `weight_global_scale`: held until its scale rows can be written, s =
        bf16(scale) / global (NVFP4; MXFP4's exponents need no global), so a module is never in the rows half done."""
        held = self.fp4_held.setdefault(key, {})
        held[part] = tensor
        self.seen.add((*key, part))
        scale = held.get("weight_scale")
        if scale is None or scale.dtype != torch.uint8 and "weight_global_scale" not in held:
            return
        del self.fp4_held[key]
        try:
            s = fp4_group_scales(scale, held.get("weight_global_scale"))
        except QuantSchemeError as exc:
            raise self.error(f"tensor {raw_name!r} in {path}: {exc}") from None
        layer, e, proj = key
        target = _proj_rows(moe, "s2" if proj == "down" else "s13", e, proj)
        if tuple(s.shape) != tuple(target.shape):
            raise self.error(f"tensor {raw_name!r} in {path}: FP4 scales of shape {list(s.shape)}, expected "
                             f"{list(target.shape)} (groups {moe.packed_group} / {moe.packed_group2})")
        target.copy_(s)

    def finish(self, model_dir: Path) -> None:
        int4 = ("weight_packed", "weight_scale", "weight_shape")
        fp4 = ("weight_packed", "weight_scale")          # NVFP4's global: a scale still held names it below
        missing = [(layer, e, proj, part) for layer, moe in self.moes.items() for e in range(moe.num_experts)
                   for proj in ("gate", "up", "down")
                   for part in (FP8_PARTS if moe.fp8_block else fp4 if moe.packed_fp4 else
                                int4 + ("weight_zero_point",) if _asym(moe) else int4)
                   if (layer, e, proj, part) not in self.seen]
        missing += [(layer, e, proj, "weight_global_scale") for (layer, e, proj), held in self.fp4_held.items()
                    if "weight_scale" in held]
        if missing:
            shown = ", ".join(f"model.layers.{lay}.mlp.experts.{e}.{p}_proj.{part}" for lay, e, p, part in missing[:3])
            raise self.error(f"missing tensor(s) in {model_dir}: {shown}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))


def _proj_rows(moe, kind: str, e: int, proj: str) -> torch.Tensor:
    """Expert e's rows of projection `proj` in part `kind` (gate: the first I rows of q13/s13, up: the next I)."""
    row = _expert_row(moe, kind, e)
    inter = row.shape[0] // 2
    return row if proj == "down" else row[:inter] if proj == "gate" else row[inter:]


def _asym(moe) -> bool:
    """INT4 experts with zero points (`SparseMoE.use_packed(..., asym=True)`): scale rows twice the groups."""
    _, _, words = _shape(moe, "q13")
    return _shape(moe, "s13")[-1] == scale_columns(words * 8, moe.packed_group, asym=True)


def _shape(moe, kind: str) -> tuple[int, ...]:
    """[E, ...] of a packed part, held by the layer or by its expert table (cold experts, issue 16)."""
    return tuple(moe.table.full_shape(kind)) if moe.table is not None else tuple(getattr(moe, kind).shape)


def _expert_row(moe, kind: str, e: int) -> torch.Tensor:
    """Expert e's row of a packed part: in the layer's buffer, or in the slot its table gave it (device or pinned
    host rows), so a cold expert goes straight to host RAM and is never held twice."""
    return moe.table.loaded_row(kind, e) if moe.table is not None else getattr(moe, kind)[e]
