"""Which quantization each on-disk weight of a quantized checkpoint carries, and whether the files agree (issue 17,
item 1: the part of loading that reads metadata; stage_worker/model/quant_weight.py reads the tensors).

The formats people publish for this model family:
* compressed-tensors (`quantization_config.quant_method == "compressed-tensors"`): `config_groups`, each a scheme
  (weights: num_bits, type int/float, symmetric, strategy tensor/channel/group/block, group_size / block_structure)
  and its `targets` (a module name, `re:` + a regex on the name, or a class name such as `Linear`), plus `ignore`.
  The scheme of a module is resolved as compressed-tensors' `apply_quantization_config` does: every group's targets
  go into one target -> scheme map in group order (a target named by two groups keeps the LAST group's scheme), and
  a module takes the scheme of its most specific matching target (exact name, then regex, then class).
* block FP8 (`quant_method == "fp8"` with `weight_block_size`, transformers' fine-grained FP8): every Linear weight
  outside `modules_to_not_convert` is float8 with a `weight_scale_inv` per block.
* GPTQ (`quant_method == "gptq"`: GPTQModel, AutoGPTQ), AutoAWQ's GEMM layout (`quant_method == "awq"`) and
  AutoRound's packings of either (`quant_method == "auto-round"`, `packing_format` auto_round:auto_gptq /
  auto_round / auto_round:gptqmodel / auto_round:auto_awq): one int scheme
  (`bits`, `group_size`, `sym`, `desc_act`) with per-module overrides (GPTQModel's `dynamic` regexes, `-:` to skip;
  AutoRound's `extra_config`, 16 bits to skip). Their tensors (`qweight`, `scales`, `qzeros`, `g_idx`) are the
  same bit streams as compressed-tensors' `pack-quantized` parts, transposed (AWQ's repacked);
  `shared/gptq_files.py` shows the
  files under those names, so everything after this plan reads one layout (`QuantPlan.layout`).
* compressed-tensors FP4 (llm-compressor's NVFP4A16 and MXFP4A16): float 4-bit weights in format
  `nvfp4-pack-quantized` (strategy tensor_group: FP8 group scales over a per-module global scale) or
  `mxfp4-pack-quantized` (strategy group: power-of-two E8M0 group scales); dequantized at load.

The metadata is checked against the tensors actually on disk (`check`): the reports met a release whose groups all
targeted `Linear`, so all but the last group reached nothing, and a loader that trusted the config would have read
INT6 planes as INT4. Each finding names the tensors it hits. Anything else stops with the scheme's name.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
# FP4 formats -> the group strategy each stores (NVFP4's group scales sit over a global scale: `tensor_group`)
FP4_FORMATS = {"nvfp4-pack-quantized": "tensor_group", "mxfp4-pack-quantized": "group"}


class QuantSchemeError(ValueError):
    """A quantization config moepipe cannot load; the message names the scheme (and the tensor, when one)."""


class RefusedGroup(QuantSchemeError):
    """A config group whose scheme moepipe cannot run, with what it targets and the config's ignore list, so that
    `plan_of` (which has the files; a config alone has not) can name a tensor it reaches."""

    def __init__(self, message: str, targets: list[str], ignore: list[str]) -> None:
        super().__init__(message)
        self.targets, self.ignore = targets, ignore


@dataclass(frozen=True)
class WeightQuant:
    bits: int
    kind: str                           # "int" or "float"
    symmetric: bool = True
    strategy: str = "group"             # "tensor", "channel", "group", "tensor_group" (NVFP4) or "block"
    group_size: int | None = None       # strategies "group" and "tensor_group"
    block: tuple[int, int] | None = None  # strategy "block": (rows, columns) per scale
    format: str = "pack-quantized"

    def describe(self) -> str:
        how = {"group": f"group {self.group_size}", "tensor_group": f"tensor_group {self.group_size}",
               "block": f"block {self.block}"}.get(self.strategy, self.strategy)
        return f"{self.kind}{self.bits} {'sym' if self.symmetric else 'asym'} {how} ({self.format})"

    @property
    def fp4(self) -> bool:
        """FP4 E2M1 values two a byte (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`)."""
        return self.format in FP4_FORMATS


@dataclass
class QuantPlan:
    method: str                                      # "compressed-tensors" or "fp8"
    targets: dict[str, tuple[str, WeightQuant]]      # target -> (group name, scheme), in the library's order
    ignore: list[str] = field(default_factory=list)
    shadowed: dict[str, list[str]] = field(default_factory=dict)   # target -> groups whose scheme it lost
    kv_cache: dict | None = None        # compressed-tensors' kv_cache_scheme (the loader skips its k/v scales)
    # "gptq" / "awq": the files hold GPTQ's or AutoAWQ's tensors (qweight, scales, qzeros, g_idx), shown under
    # compressed-tensors' names by shared/gptq_files.py; "" for the formats that need no translation
    layout: str = ""
    zero_offset: int = 0                # GPTQ's v1 checkpoints store each zero point minus one
    # GPTQModel's v1 files (quant_method gptq): 2-, 4- and 8-bit zero points saved as v2 words minus 0x11111111 (4
    # bits), whole words with borrows, and read back by adding it to whole words (shared/gptq_files.py)
    zero_words: bool = False
    act_order: dict[str, bool] = field(default_factory=dict)   # target -> desc_act (GPTQ: g_idx is meaningful)
    # GPTQModel's `dynamic`: its regex targets in the config's order, each with whether it skips (`-:`): the first
    # that matches a module decides it, as GPTQModel's dynamic_get (and vLLM) read them, not the most specific one
    ordered: list[tuple[str, bool]] = field(default_factory=list)
    # module -> its deciding target, as looked up: a GPTQ release has ~74k expert modules, each looked up by every
    # pass over the files (~47 us a lookup with a few regex targets)
    _decided: dict[tuple[str, str | None], str | None] = field(default_factory=dict, repr=False, compare=False)

    def for_module(self, name: str, cls: str | None = None) -> WeightQuant | None:
        """The scheme of module `name` (class `cls`, default `module_class(name)`), or None (ignored or no target
        matches)."""
        group = self.group_of(name, cls)
        return None if group is None else self.targets[group][1]

    def group_of(self, name: str, cls: str | None = None) -> str | None:
        """The target that decides module `name`'s scheme (`deciding_target`), or None."""
        key = (name, cls)
        if key not in self._decided:
            self._decided[key] = self._first_rule(name, cls) if self.ordered else \
                deciding_target(name, self.targets, self.ignore, cls)
        return self._decided[key]

    def _first_rule(self, name: str, cls: str | None) -> str | None:
        """GPTQModel's `dynamic`: modules_to_not_convert, then the first pattern (in the config's order) matching the
        name (a `-:` one: None), then the default."""
        names = _released_names(name)
        if any(_match_name(n, t) for t in self.ignore for n in names):
            return None
        for target, skip in self.ordered:
            if any(_match_name(n, target) for n in names):
                return None if skip else target
        rest = {t: v for t, v in self.targets.items() if t not in dict(self.ordered)}
        return deciding_target(name, rest, self.ignore, cls)

    @property
    def packs_ints(self) -> bool:
        """The files may hold int weights as compressed-tensors' packed parts (or GPTQ's, shown as them); which
        modules do is each module's scheme (an NVFP4 / MXFP4 module's `weight_packed` is FP4: only routed experts
        keep it packed, `checkpoint/packed_experts.py`)."""
        return self.method in ("compressed-tensors", "gptq")

    def acts_in_order(self, name: str) -> bool:
        """GPTQ's desc_act for module `name`: its `g_idx` orders the groups (else the groups are runs of inputs)."""
        group = self.group_of(name)
        return group is not None and self.act_order.get(group, False)


def deciding_target(name: str, targets, ignore: list[str], cls: str | None = None) -> str | None:
    """Of `targets`, the one that decides module `name`'s scheme (exact name, then regex, then class), or None
    (ignored, or no target matches). A name in the plain causal-LM layout (`model.layers...`, as the loader
    normalises) also matches targets written for a released multimodal checkpoint's names
    (`model.language_model.layers...`, `language_model.layers...`)."""
    cls = cls or module_class(name)
    names = _released_names(name)
    if any(_match_name(n, t) or t == cls for t in ignore for n in names):
        return None
    for t in sorted(targets, key=lambda t: (t.startswith("re:"), t)):
        if any(_match_name(n, t) for n in names):
            return t
    return cls if cls in targets else None


def module_class(name: str) -> str:
    """The class transformers' model holds module `name` as, for class targets: the token embedding is an
    `Embedding` (a recipe may give it a group of its own, `targets: [Embedding]`), every other quantizable weight a
    `Linear`."""
    return "Embedding" if name.rsplit(".", 1)[-1] == "embed_tokens" else "Linear"


def _released_names(name: str) -> list[str]:
    """`name` and its other spellings: a plain causal-LM name's released ones, a released name's plain one and the
    other released one (the metadata check reads on-disk names, the loader normalised ones: both decide alike)."""
    for prefix in ("model.language_model.", "language_model."):
        if name.startswith(prefix):
            name = "model." + name[len(prefix):]
            break
    if name.startswith("model."):
        rest = name[len("model."):]
        return [name, "model.language_model." + rest, "language_model." + rest]
    return [name]


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _weight_quant(group: str, scheme: dict, fmt: str) -> WeightQuant:
    w = scheme.get("weights")
    if not isinstance(w, dict):
        raise QuantSchemeError(f"quantization_config.config_groups.{group}: no `weights` scheme (activation-only "
                               f"quantization is not supported)")
    kind, bits = w.get("type", "int"), w.get("num_bits", 0)
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise QuantSchemeError(f"quantization_config.config_groups.{group}.weights.num_bits: expected an integer, got "
                               f"{bits!r}")
    strategy = w.get("strategy") or "tensor"
    if scheme.get("input_activations") not in (None, {}):
        raise QuantSchemeError(f"quantization_config.config_groups.{group}: activation quantization "
                               f"({scheme['input_activations']}) is not supported; moepipe runs weight-only schemes")
    ok = (kind == "int" and 2 <= bits <= 8 and strategy in ("channel", "group", "tensor") and fmt in FORMATS) or \
        (kind == "float" and bits == 8 and strategy in ("block", "channel", "tensor") and fmt in FORMATS) or \
        (kind == "float" and bits == 4 and FP4_FORMATS.get(fmt) == strategy and w.get("symmetric", True))
    if not ok:
        raise QuantSchemeError(f"quantization_config.config_groups.{group}: {kind}{bits} "
                               f"{'sym' if w.get('symmetric', True) else 'asym'} strategy {strategy!r} in format "
                               f"{fmt!r} is not supported (int 2-8 bit tensor/channel/group in {', '.join(FORMATS)}, "
                               f"float8 block/channel/tensor, or symmetric float4: tensor_group in "
                               f"nvfp4-pack-quantized, group in mxfp4-pack-quantized)")
    group_size = w.get("group_size")
    if strategy in ("group", "tensor_group") and not (isinstance(group_size, int) and group_size > 0):
        raise QuantSchemeError(f"quantization_config.config_groups.{group}: strategy {strategy} needs a "
                               f"group_size > 0, got {group_size!r}")
    block = tuple(w["block_structure"]) if strategy == "block" and w.get("block_structure") else None
    if strategy == "block" and (block is None or len(block) != 2):
        raise QuantSchemeError(f"quantization_config.config_groups.{group}: strategy block needs "
                               f"block_structure [rows, columns], got {w.get('block_structure')!r}")
    return WeightQuant(bits=bits, kind=kind, symmetric=bool(w.get("symmetric", True)), strategy=strategy,
                       group_size=group_size if strategy in ("group", "tensor_group") else None, block=block,
                       format=fmt)


def parse(config: dict) -> QuantPlan | None:
    """The plan of a config.json dict (its `quantization_config`), None for an unquantized checkpoint."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise QuantSchemeError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and
                all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantSchemeError(f"quantization_config: fp8 needs weight_block_size [rows, columns] of positive "
                                   f"integers (per-tensor fp8 is not supported): {q}")
        wq = WeightQuant(bits=8, kind="float", strategy="block", block=tuple(block), format="float-quantized")
        return QuantPlan("fp8", {"Linear": ("fp8", wq)}, list(q.get("modules_to_not_convert") or []))
    if method in ("gptq", "awq", "auto-round", "auto_round", "intel/auto-round"):   # the last: AutoRound < 0.4
        return _gptq_plan(q, method)
    if method != "compressed-tensors":
        raise QuantSchemeError(f"quantization_config.quant_method {method!r} is not supported (compressed-tensors, "
                               f"fp8 with weight_block_size, gptq, awq (gemm), or auto-round in a GPTQ or AWQ "
                               f"packing)")
    _refuse_sparsity_and_online_transforms(q)
    groups = q.get("config_groups") or {}
    if not groups:
        raise QuantSchemeError("quantization_config (compressed-tensors) has no config_groups")
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise QuantSchemeError("quantization_config.config_groups must map group names to schemes (objects), got "
                               f"{type(groups).__name__}")
    default_fmt = q.get("format") or "pack-quantized"
    targets: dict[str, tuple[str, WeightQuant]] = {}
    shadowed: dict[str, list[str]] = {}
    for name, scheme in groups.items():
        try:
            wq = _weight_quant(name, scheme, scheme.get("format") or default_fmt)
        except QuantSchemeError as exc:
            reach = scheme.get("targets")
            raise RefusedGroup(str(exc), list(reach) if isinstance(reach, list) else [],
                               list(q.get("ignore") or [])) from None
        for t in scheme.get("targets") or []:
            if t in targets and targets[t][1] != wq:
                shadowed.setdefault(t, []).append(targets[t][0])
            targets[t] = (name, wq)                       # the library keeps the last group's scheme
    kv = q.get("kv_cache_scheme")
    if kv is not None and not isinstance(kv, dict):
        raise QuantSchemeError(f"quantization_config.kv_cache_scheme must be an object, got {kv!r}")
    return QuantPlan("compressed-tensors", targets, list(q.get("ignore") or []), shadowed, kv or None)


# GPTQ's checkpoint formats -> the zero-point offset of their files: v1 ("gptq", what GPTQModel and AutoGPTQ save
# and publish) stores z - 1, v2 z itself. AutoRound names its packings; "auto_round:auto_gptq" is v1.
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
_AUTO_ROUND_PACKINGS = {"auto_round:auto_gptq": 1, "auto_round:gptq": 1, "auto": 1, "auto_round": 0,
                        "auto_round:gptqmodel": 0, "auto_round:auto_awq": "awq", "auto_round:awq": "awq"}


def _gptq_plan(q: dict, method: str) -> QuantPlan:
    """GPTQ's, AutoAWQ's and AutoRound's configs: one scheme for every quantized Linear, overrides by module."""
    where = f"quantization_config ({method})"
    layout = "gptq"
    if method == "awq":               # AutoAWQ's GEMM layout: 4-bit, a zero point a group, interleaved columns
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantSchemeError(f"{where}: version {q.get('version')!r} is not supported (gemm)")
        if not q.get("zero_point", True):
            raise QuantSchemeError(f"{where}: zero_point false is not supported (AutoAWQ's GEMM layout with zero "
                                   f"points)")
        q = {**q, "bits": q.get("bits", q.get("w_bit")), "group_size": q.get("group_size", q.get("q_group_size")),
             "sym": False}
        layout, offset = "awq", 0
    elif method == "gptq":
        fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
        if fmt not in _GPTQ_FORMATS:
            raise QuantSchemeError(f"{where}: checkpoint_format {fmt!r} is not supported ({', '.join(_GPTQ_FORMATS)})")
        offset = _GPTQ_FORMATS[fmt]
    else:
        fmt = q.get("packing_format") or "auto_round:auto_gptq"      # as AutoRound reads a config without it
        if fmt not in _AUTO_ROUND_PACKINGS:
            raise QuantSchemeError(f"{where}: packing_format {fmt!r} is not supported "
                                   f"({', '.join(_AUTO_ROUND_PACKINGS)}; auto_round:llm_compressor checkpoints say "
                                   f"compressed-tensors and load as such)")
        offset = _AUTO_ROUND_PACKINGS[fmt]
        if offset == "awq":
            q, layout, offset = {**q, "sym": False}, "awq", 0
    if layout == "awq" and q.get("bits") != 4:
        raise QuantSchemeError(f"{where}: bits {q.get('bits')!r} in AWQ's layout is not supported (4)")
    if q.get("is_marlin_format"):
        raise QuantSchemeError(f"{where}: is_marlin_format (AutoGPTQ's Marlin repacking) is not supported (gptq, "
                               f"gptq_v2 files)")
    if q.get("pack_dtype", "int32") != "int32":
        raise QuantSchemeError(f"{where}: pack_dtype {q.get('pack_dtype')!r} is not supported (int32)")
    base = _gptq_scheme(q, where, {})
    targets = {"Linear": ("default", base[0])}
    act_order = {"Linear": base[1]}
    ignore: list[str] = list(q.get("modules_to_not_convert") or [])
    overrides = q.get("dynamic") if method == "gptq" else q.get("extra_config")
    if overrides is not None and not isinstance(overrides, dict):
        raise QuantSchemeError(f"{where}: {'dynamic' if method == 'gptq' else 'extra_config'} must be an object, "
                               f"got {type(overrides).__name__}")
    ordered: list[tuple[str, bool]] = []
    for key, over in (overrides or {}).items():
        if not isinstance(over, dict):
            raise QuantSchemeError(f"{where}: the override for {key!r} must be an object, got {over!r}")
        if method == "gptq":          # GPTQModel: a regex matched from the name's start; "-:" skips the module;
            skip, pattern = key.startswith("-:"), key[2:] if key[:2] in ("-:", "+:") else key
            target = "re:" + pattern
            if target in dict(ordered):   # the first pattern in order decides (a later spelling: never reached)
                continue
            ordered.append((target, skip))
        else:                         # AutoRound: a module name (or a regex); 16 bits or a float type: not quantized
            target = key if re.fullmatch(r"[\w.]+", key) else "re:" + key
            skip = int(over.get("bits", base[0].bits) or 16) >= 16 or \
                str(over.get("data_type", "int")).lower() not in ("int", "int_sym", "int_asym")
            if skip:
                ignore.append(target)
        if skip:
            continue
        targets[target] = (key, (scheme := _gptq_scheme({**q, **over}, f"{where} override {key!r}", over))[0])
        act_order[target] = scheme[1]
    return QuantPlan("gptq", targets, ignore, layout=layout, zero_offset=offset, act_order=act_order,
                     ordered=ordered, zero_words=method == "gptq" and offset == 1)


def _gptq_scheme(q: dict, where: str, over: dict) -> tuple[WeightQuant, bool]:
    """(scheme, desc_act) of a GPTQ / AutoRound config (merged with an override)."""
    bits, group = q.get("bits"), q.get("group_size", q.get("groupsize", 128))     # AutoGPTQ wrote groupsize
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise QuantSchemeError(f"{where}: bits {bits!r} is not supported (integers 2-8)")
    if isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1:
        raise QuantSchemeError(f"{where}: group_size {group!r} is not supported (a positive size, or -1 for one "
                               f"scale a row)")
    data_type = str(q.get("data_type", "int")).lower()
    if data_type not in ("int", "int_sym", "int_asym"):
        raise QuantSchemeError(f"{where}: data_type {data_type!r} is not supported (int)")
    act_bits = q.get("act_bits", 16)
    if isinstance(act_bits, int) and act_bits < 16:
        raise QuantSchemeError(f"{where}: act_bits {act_bits} (activation quantization) is not supported; moepipe "
                               f"runs weight-only schemes")
    wq = WeightQuant(bits=bits, kind="int", symmetric=bool(q.get("sym", True)),
                     strategy="group" if group > 0 else "channel", group_size=group if group > 0 else None)
    return wq, bool(q.get("desc_act", False))


_OFFLINE = ("weight_input", "weight_output")      # transforms fused into the stored weights


def _refuse_sparsity_and_online_transforms(q: dict) -> None:
    """compressed-tensors sections beside `config_groups` that change what the tensors mean or what a forward must
    compute: a `sparsity_config` in a compressed format (2:4 bitmask, marlin-24: the values are not in
    `weight_packed` / `weight` alone) and a `transform_config` applied online (a Hadamard rotation of activations,
    K or Q at run time, which moepipe does not compute; rotations fused into the weights, `weight_input` /
    `weight_output`, need nothing)."""
    sparsity = q.get("sparsity_config") or {}
    if not isinstance(sparsity, dict):
        raise QuantSchemeError(f"quantization_config.sparsity_config must be an object, got {sparsity!r}")
    if sparsity.get("format") not in (None, "dense"):
        raise QuantSchemeError(f"quantization_config.sparsity_config: format {sparsity.get('format')!r} "
                               f"({sparsity.get('sparsity_structure', '?')} sparsity) is not supported; moepipe "
                               f"reads dense weights (sparsity format 'dense')")
    transforms = q.get("transform_config") or {}
    groups = transforms.get("config_groups") if isinstance(transforms, dict) else None
    for name, t in (groups if isinstance(groups, dict) else {}).items():
        applies = t.get("apply") if isinstance(t, dict) else None
        for apply in applies if isinstance(applies, list) else []:
            where = apply.get("location") if isinstance(apply, dict) else None
            if where not in _OFFLINE:
                raise QuantSchemeError(f"quantization_config.transform_config.config_groups.{name}: a "
                                       f"{t.get('type', '?')} transform at location {where!r} (targets "
                                       f"{apply.get('targets') if isinstance(apply, dict) else '?'}) is applied at "
                                       f"run time, which moepipe does not compute (only transforms fused into the "
                                       f"weights, {' / '.join(_OFFLINE)}, load)")


def check(plan: QuantPlan, tensors: dict[str, tuple[int, ...]]) -> list[str]:
    """Findings where the config and the files disagree (empty: they agree). `tensors`: on-disk name -> shape."""
    found: list[str] = []
    for t, lost in plan.shadowed.items():
        found.append(f"config_groups {', '.join(lost)} and {plan.targets[t][0]} all target {t!r}: only "
                     f"{plan.targets[t][0]}'s scheme ({plan.targets[t][1].describe()}) takes effect for it, the "
                     f"others' never does (compressed-tensors keeps the last group per target)")
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in tensors.items():
        for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_scale_inv",
                       "weight_global_scale", "weight"):
            if name.endswith("." + suffix):
                modules.setdefault(name[: -len(suffix) - 1], {})[suffix] = tuple(shape)
                break
    bad: dict[str, list[str]] = {}
    # targets that reach a module the files hold quantized (see below: routed experts left in float beside them)
    reaching = {plan.group_of(m) for m, parts in modules.items()
                if {"weight_packed", "weight_scale", "weight_scale_inv"} & set(parts)}
    for module, parts in sorted(modules.items()):
        wq = plan.for_module(module)
        quantized = bool({"weight_packed", "weight_scale", "weight_scale_inv"} & set(parts))
        if wq is None:
            if quantized:
                bad.setdefault("quantized on disk, but no config group applies (ignored or unmatched)", []).append(
                    module)
            continue
        if not quantized:
            # Only a target naming the module (exact or regex) promises it is quantized: a class target reaches
            # what the writer's model held as that class (transformers keeps experts in a 3-D module, not Linear,
            # so a `Linear` target leaves them in bf16 where vLLM-layout writers quantize them), and an
            # embedding is no Linear at all. The loader goes by what is on disk.
            # A regex that also reaches modules quantized on disk (`re:.*mlp.*proj$` for the dense MLP and the
            # shared expert) may reach the per-expert names of transformers' 3-D experts too, which the library's
            # writer never quantizes (not Linear): float experts there are what it wrote, not a disagreement.
            target = plan.group_of(module)
            named = target is not None and (target.startswith("re:") or target == module)
            if named and target.startswith("re:") and target in reaching and _ROUTED_EXPERT.search(module):
                named = False
            # GPTQ's and AWQ's overrides (`dynamic` regexes, `extra_config` names) only set how a module the library
            # quantizes is quantized: it quantizes the modules its model definition lists, and leaves in float those
            # whose shape fills no whole words or groups, whatever the overrides reach (`.*gate.*` reaches the
            # router and shared_expert_gate too); a float weight there is what it wrote.
            if plan.layout:
                named = False
            if "weight" in parts and len(parts["weight"]) == 2 and named:
                bad.setdefault(f"plain weight on disk, but the config says {wq.describe()}", []).append(module)
            continue
        problem = _shape_problem(wq, parts, plan.method)
        if problem:
            bad.setdefault(problem, []).append(module)
    for problem, names in bad.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        found.append(f"{problem}: {shown}")
    return found


_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")


def _shape_problem(wq: WeightQuant, parts: dict[str, tuple[int, ...]], method: str) -> str | None:
    if method == "fp8":
        w, s = parts.get("weight"), parts.get("weight_scale_inv")
        if w is None or s is None or len(w) != 2:
            return "fp8: weight or weight_scale_inv missing"
        want = (-(-w[0] // wq.block[0]), -(-w[1] // wq.block[1]))
        if tuple(s) != want:
            return f"fp8 block {wq.block}: weight_scale_inv is {list(s)}, expected {list(want)}"
        return None
    if wq.fp4:
        return _fp4_problem(wq, parts)
    if wq.kind == "float" or wq.format != "pack-quantized":
        return _unpacked_problem(wq, parts)
    packed, scale = parts.get("weight_packed"), parts.get("weight_scale")
    if packed is None or scale is None:
        return f"{wq.describe()}: weight_packed or weight_scale missing"
    rows, cols = packed[0], packed[-1]
    if wq.strategy == "group":
        groups = scale[-1]
        lo, hi = (groups - 1) * wq.group_size + 1, groups * wq.group_size    # inputs the scale columns allow
        if not any(max(lo, a + 1) <= min(hi, b) for a, b in _packed_inputs(cols, wq.bits)):
            return (f"{wq.describe()}: {groups} scale columns mean {lo}-{hi} inputs, but {cols} packed int32 "
                    f"columns hold {' or '.join(f'{a + 1}-{b}' for a, b in _packed_inputs(cols, wq.bits))} "
                    f"(another bit width or group size?)")
    elif wq.strategy == "channel" and scale[0] != rows:
        return f"{wq.describe()}: weight_scale has {scale[0]} rows, the weight {rows}"
    if not wq.symmetric and "weight_zero_point" not in parts:
        return f"{wq.describe()}: asymmetric, but no weight_zero_point"
    return None


def _unpacked_problem(wq: WeightQuant, parts: dict[str, tuple[int, ...]]) -> str | None:
    """The compressed-tensors formats that store one value an element (`float-quantized`: float8; `int-quantized`,
    `naive-quantized`: int8): `weight` [rows, in] and `weight_scale` by the strategy."""
    w, scale = parts.get("weight"), parts.get("weight_scale")
    if w is None or scale is None or len(w) != 2:
        return f"{wq.describe()}: weight or weight_scale missing"
    rows, cols = w
    if wq.strategy == "channel" and scale[0] != rows:
        return f"{wq.describe()}: weight_scale has {scale[0]} rows, the weight {rows}"
    if wq.strategy == "group" and scale[-1] != -(-cols // wq.group_size):
        return f"{wq.describe()}: {scale[-1]} scale columns for {cols} inputs"
    if wq.strategy == "block" and tuple(scale) != (-(-rows // wq.block[0]), -(-cols // wq.block[1])):
        return f"{wq.describe()}: weight_scale is {list(scale)} for a {rows} x {cols} weight"
    if not wq.symmetric and "weight_zero_point" not in parts:
        return f"{wq.describe()}: asymmetric, but no weight_zero_point"
    return None


def _fp4_problem(wq: WeightQuant, parts: dict[str, tuple[int, ...]]) -> str | None:
    """FP4 (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`): `weight_packed` [rows, in / 2] (two values a byte),
    `weight_scale` [rows, in / group], and for NVFP4 a one-element `weight_global_scale`."""
    packed, scale = parts.get("weight_packed"), parts.get("weight_scale")
    if packed is None or scale is None or len(packed) != 2:
        return f"{wq.describe()}: weight_packed or weight_scale missing"
    rows, inputs = packed[0], 2 * packed[1]
    if tuple(scale) != (rows, -(-inputs // wq.group_size)):
        return (f"{wq.describe()}: weight_scale is {list(scale)}, expected {[rows, -(-inputs // wq.group_size)]} "
                f"for weight_packed {list(packed)} ({inputs} inputs)")
    if wq.strategy == "tensor_group":
        glob = parts.get("weight_global_scale")
        if glob is None:
            return f"{wq.describe()}: no weight_global_scale"
        if math.prod(glob) != 1:
            return f"{wq.describe()}: weight_global_scale is {list(glob)}, expected one value"
    return None


def _packed_inputs(cols: int, bits: int) -> list[tuple[int, int]]:
    """The input counts (a, b] that `cols` int32 columns of `bits`-bit values can hold: compressed-tensors 0.20
    packs densely (32 values in `bits` words), older versions packed 32 // bits values to a word (the same for 2,
    4 and 8 bits; an INT6 or INT3 release made with an older version has the sparse layout)."""
    dense = ((cols - 1) * 32 // bits, cols * 32 // bits)
    per = 32 // bits
    sparse = ((cols - 1) * per, cols * per)
    return [dense] if dense == sparse else [dense, sparse]


def _config_texts(model_dir) -> tuple[str | None, str | None]:
    """The texts of a checkpoint directory's config.json and AutoGPTQ's quantize_config.json (None: unreadable)."""
    from pathlib import Path

    def text(name: str) -> str | None:
        try:
            return (Path(model_dir) / name).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    return text("config.json"), text("quantize_config.json")


def _merged(config_text: str | None, side_text: str | None) -> dict | None:
    """config.json, with quantize_config.json as its quantization_config when it has none (see
    `config_with_quantization`)."""
    import json

    try:
        config = json.loads(config_text) if config_text is not None else None
    except ValueError:
        return None                            # the config loader reports that
    if not isinstance(config, dict) or config.get("quantization_config") or \
            (config.get("text_config") or {}).get("quantization_config") or side_text is None:
        return config
    try:
        side = json.loads(side_text)
    except ValueError:
        return config
    if isinstance(side, dict) and "bits" in side:
        config = {**config, "quantization_config": {"quant_method": "gptq", **side}}
    return config


def config_with_quantization(model_dir) -> dict | None:
    """A checkpoint directory's config.json, with AutoGPTQ's `quantize_config.json` as its quantization_config when
    config.json has none (the older GPTQ releases keep it there, as vLLM reads it); None: no readable config."""
    return _merged(*_config_texts(model_dir))


def cached_plan(model_dir) -> QuantPlan | None:
    """The plan of a checkpoint directory's configs, one instance per config text (its memo of module lookups then
    serves every pass of a load: the check, the packed-expert scan, the loader, the GPTQ view). Raises the parser's
    QuantSchemeError as it is (`plan_of` names the tensors a refused group reaches)."""
    return _plan_of_texts(*_config_texts(model_dir))


@functools.lru_cache(maxsize=16)
def _plan_of_texts(config_text: str | None, side_text: str | None) -> QuantPlan | None:
    config = _merged(config_text, side_text)
    return None if config is None else parse(config)


def plan_of(model_dir) -> QuantPlan | None:
    """The plan of a checkpoint directory's config.json (None: not quantized, or no readable config)."""
    from pathlib import Path

    try:
        return cached_plan(model_dir)
    except RefusedGroup as exc:
        raise QuantSchemeError(f"{exc}; {_reached_tensors(Path(model_dir), exc.targets, exc.ignore)}") from None


def _reached_tensors(model_dir, targets: list[str], ignore: list[str]) -> str:
    """Which on-disk tensors a refused group's targets reach, for its message: the user learns which weights the
    scheme they cannot run holds (a whole config group's refusal named no tensor, QA 2026-12-07)."""
    from shared.checkpoint_files import CheckpointError, tensor_headers

    try:
        names = sorted(tensor_headers(model_dir))
    except (CheckpointError, OSError, ValueError):
        return "its tensors could not be read"
    suffixes = ("weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
                "weight_g_idx", "weight_global_scale", "weight")
    hit = [name for name in names if name.rpartition(".")[2] in suffixes
           and deciding_target(name.rpartition(".")[0], targets, ignore) is not None]
    if not hit:
        return f"its targets {targets} reach no tensor on disk"
    more = f" and {len(hit) - 1} more" if len(hit) > 1 else ""
    return f"it holds tensor '{hit[0]}'{more}"


def refusal(model_dir, headers: dict[str, tuple[tuple[int, ...], str]] | None = None) -> str | None:
    """Why a quantized checkpoint directory cannot be served (None: it can, or it is not quantized): a scheme
    moepipe does not run, or metadata that disagrees with the files (each finding names the tensors it hits).
    The files are those the loader reads (`checkpoint_files`: the index's, not every *.safetensors beside them);
    `headers`: their `tensor_headers`, when the caller has read them already."""
    from pathlib import Path

    from shared.checkpoint_files import tensor_headers

    model_dir = Path(model_dir)
    try:
        plan = plan_of(model_dir)
    except QuantSchemeError as exc:
        return f"{model_dir}: {exc}"
    if plan is None:
        return None
    if headers is None:
        headers = tensor_headers(model_dir)     # an unreadable file: a CheckpointError naming it
    findings = check(plan, {name: shape for name, (shape, _) in headers.items()})
    if not findings:
        return None
    schemes = sorted({wq.describe() for _, wq in plan.targets.values()})
    return (f"{model_dir} is a {plan.method} checkpoint ({'; '.join(schemes)}) whose metadata disagrees with its "
            "files: " + " | ".join(findings) + " (fix quantization_config in config.json to say what the tensors "
            "hold)")
