"""GPTQ checkpoints (GPTQModel, AutoGPTQ, AutoRound's GPTQ packings) read as compressed-tensors `pack-quantized` ones;
AutoAWQ's GEMM layout too.

Both formats store a module's b-bit values as a little-endian bit stream in int32 words (value i at bit i*b, a value
crossing into the next word where 32 is no multiple of b), unsigned with a zero point, one scale per group of inputs:

| GPTQ (per module)                            | compressed-tensors                                                 |
|----------------------------------------------|--------------------------------------------------------------------|
| `qweight` int32 [in*b/32, out]: along inputs | `weight_packed` int32 [out, in*b/32]: the same stream, transposed  |
| `scales` [groups, out]                       | `weight_scale` [out, groups]                                       |
| `qzeros` int32 [groups, out*b/32]            | `weight_zero_point` int32 [out*b/32, groups] (asymmetric only)     |
| `g_idx` int32 [in]: each input's group       | `weight_g_idx` (activation order only; else the groups are runs)   |
| (the shape)                                  | `weight_shape` [out, in]                                           |

compressed-tensors stores a symmetric value v as v + 2^(b-1) and reads zero points the same way, so GPTQ's unsigned
q and z are the very bits it expects: w = s * (q - z) either way. A symmetric GPTQ module's zero points are all
2^(b-1) and are not shown (checked when its weight is read). GPTQ's v1 files (what GPTQModel and AutoGPTQ save and
publish, AutoRound's auto_round:auto_gptq) store z - 1. GPTQModel (`quant_method: gptq`, 2, 4 or 8 bits) saves them
as its v2 words minus 0x11111111 (4 bits; 0x55555555, 0x01010101), whole words whose borrows cross fields, and reads
them back adding the same to whole words: shown here so (a v1 zero of 0 borrows from its neighbour, which reads one
too low field by field; QA 2026-12-07). Other v1 files (3, 5-7 bits, AutoRound's packing) are read each field + 1
on its own (a stored -1 read back as 0, what the quantizer computed).

AutoAWQ (`quant_method: awq`, version gemm; AutoRound's auto_round:auto_awq) packs 4-bit values along the outputs
instead, `qweight` [in, out/8] and `qzeros` [groups, out/8], each word's 8 columns in the order AWQ_ORDER, zero points
stored as they are (always asymmetric): its words are unpacked and packed again along the inputs (a pass over the
module at load, not a transpose), its zero points along the outputs as compressed-tensors wants them.

`open_safetensors` (shared/checkpoint_files.py) hands every reader of a GPTQ checkpoint this view, so the loader,
the metadata check, the packed-expert scan and the memory plan all see one layout. The view costs transposes at
load; nothing is dequantized that compressed-tensors' form would keep packed.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.bit_fields import pack_fields, unpack_fields
from shared.checkpoint_files import CheckpointError, normalise
from shared.quant_scheme import QuantPlan, QuantSchemeError, WeightQuant, cached_plan

# GPTQ part -> the compressed-tensors part it is shown as
PARTS = {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_zero_point", "g_idx": "weight_g_idx"}


def plan_for(model_dir: Path) -> QuantPlan | None:
    """The GPTQ / AWQ plan of the checkpoint in `model_dir` (the one `plan_of` gives), None for any other checkpoint,
    no readable config, or a refused one (the config loader and the quantization check say why)."""
    try:
        plan = cached_plan(model_dir)
    except ValueError:
        return None
    return plan if plan is not None and plan.layout in ("gptq", "awq") else None


@dataclass(frozen=True)
class _Slice:
    """What readers ask of a shown tensor's slice without reading it: its shape and safetensors dtype."""
    shape: tuple[int, ...]
    dtype: str

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype


class GptqView:
    """A safetensors file of a GPTQ checkpoint with its modules' parts under compressed-tensors' names (see the
    module docstring); every other tensor as it is. Opened by `open_safetensors`; a context manager as safe_open."""

    def __init__(self, f, plan: QuantPlan, path: Path) -> None:
        self.f, self.plan, self.path = f, plan, path
        raw = list(f.keys())
        self._raw = set(raw)
        self._names: dict[str, str | None] = {}     # shown name -> file name (None: made up, weight_shape)
        for name in raw:         # by suffix alone: a module's parts may sit in two files of a sharded checkpoint
            module, _, part = name.rpartition(".")
            if part not in PARTS:
                self._names[name] = name
                continue
            if part == "qzeros" and self._symmetric(module):
                continue                         # symmetric: the zeros are 2^(b-1), checked with the weight
            if part == "g_idx" and not self.plan.acts_in_order(normalise(module)):
                continue                         # runs of inputs: g_idx says nothing more (checked with the weight)
            self._names[f"{module}.{PARTS[part]}"] = name
            if part == "qweight":
                self._names[f"{module}.weight_shape"] = None

    def __enter__(self) -> "GptqView":
        self.f.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.f.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._names)

    def metadata(self):
        return self.f.metadata()

    def get_slice(self, name: str):
        raw = self._names[name]
        if raw == name:
            return self.f.get_slice(name)
        module, _, part = name.rpartition(".")
        if part == "weight_shape":
            return _Slice((2,), "I64")
        sl = self.f.get_slice(raw)
        shape = tuple(sl.get_shape())
        if self.plan.layout == "awq" and part == "weight_packed":       # repacked along the inputs
            bits = self._scheme(module).bits
            return _Slice((shape[1] * 32 // bits, shape[0] * bits // 32), sl.get_dtype())
        return _Slice(shape[::-1] if len(shape) == 2 else shape, sl.get_dtype())

    def get_tensor(self, name: str) -> torch.Tensor:
        raw = self._names[name]
        if raw == name:
            return self.f.get_tensor(name)
        module, _, part = name.rpartition(".")
        if part == "weight_shape":
            return torch.tensor(self._shape(module), dtype=torch.int64)
        t = self.f.get_tensor(raw)
        if part == "weight_packed":
            try:
                self._check_implied(module)
            except QuantSchemeError as exc:
                raise CheckpointError(f"{self.path}: {exc}") from None
            if self.plan.layout == "awq":           # [in, out/8] interleaved -> the stream along the inputs
                return pack_fields(awq_values(t).t(), self._scheme(module).bits)
            return t.t().contiguous()
        if part == "weight_scale":
            return t.t().contiguous()
        if part == "weight_zero_point":
            wq = self._scheme(module)
            if self.plan.layout == "awq":
                return pack_fields(awq_values(t), wq.bits).t().contiguous()
            if self.plan.zero_offset and self.plan.zero_words and 32 % wq.bits == 0:
                t = _add_per_word(t, wq.bits, self.plan.zero_offset)
            elif self.plan.zero_offset:
                t = _add_per_field(t, wq.bits, self.plan.zero_offset)
            return t.t().contiguous()
        return t                                           # weight_g_idx

    def _scheme(self, module: str) -> WeightQuant:
        """The module's scheme; a module no override or default reaches is read with the default's bits (the
        metadata check then names it as quantized on disk with no scheme)."""
        return self.plan.for_module(normalise(module)) or self.plan.targets["Linear"][1]

    def _symmetric(self, module: str) -> bool:
        return self._scheme(module).symmetric

    def _shape(self, module: str) -> list[int]:
        """[out, in] of a module: out from its scales, in from g_idx where stored, else the packed words."""
        wq = self._scheme(module)
        words, out = self.f.get_slice(f"{module}.qweight").get_shape()
        if self.plan.layout == "awq":                      # [in, out*b/32]
            return [out * 32 // wq.bits, words]
        g_idx = f"{module}.g_idx"
        if g_idx in self._raw:
            return [out, int(self.f.get_slice(g_idx).get_shape()[0])]
        return [out, words * 32 // wq.bits]

    def _part(self, name: str) -> torch.Tensor | None:
        """A file tensor of this module that the view hides, from this file or, where a sharded checkpoint's index
        puts it in another, from that one (None: in no file)."""
        if name in self._raw:
            return self.f.get_tensor(name)
        index = self.path.parent / "model.safetensors.index.json"
        try:
            other = json.loads(index.read_text())["weight_map"].get(name)
        except (OSError, ValueError, KeyError, AttributeError):
            return None
        if other is None:
            return None
        from safetensors import safe_open

        with safe_open(self.path.parent / other, framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def _check_implied(self, module: str) -> None:
        """What the view leaves out must say nothing: a symmetric module's zero points are 2^(b-1) and, without
        activation order, its g_idx makes runs of group_size inputs (a file that disagrees is refused by name)."""
        wq = self._scheme(module)
        if self._symmetric(module) and (words := self._part(f"{module}.qzeros")) is not None:
            want = _symmetric_words(wq.bits, self.plan.zero_offset, words.shape[-1])
            # one compare a module (a release has ~74k); the fields themselves only to name what differs
            z = None if torch.equal(words, want.expand_as(words)) else \
                (unpack_fields(words, wq.bits) + self.plan.zero_offset) & ((1 << wq.bits) - 1)
            if z is not None and bool((z != (1 << (wq.bits - 1))).any()):
                raise QuantSchemeError(f"{module}.qzeros: the config says sym (zero point {1 << (wq.bits - 1)}), "
                                       f"but the file holds others ({sorted(set(z.unique().tolist()))[:4]}); set "
                                       f"sym: false in quantization_config if the module is asymmetric")
        if not self.plan.acts_in_order(normalise(module)) and (g := self._part(f"{module}.g_idx")) is not None:
            g = g.to(torch.int64)
            size = wq.group_size or g.numel()
            if not torch.equal(g, torch.arange(g.numel()) // size):
                raise QuantSchemeError(f"{module}.g_idx orders its groups (activation order), but the config says "
                                       f"desc_act: false; set desc_act: true in quantization_config")


@functools.lru_cache(maxsize=64)
def _symmetric_words(bits: int, offset: int, words: int) -> torch.Tensor:
    """The int32 words a row of a symmetric module's zero points holds as stored (2^(b-1) - offset each field)."""
    n = -(-words * 32 // bits)
    n += -n % 32                                            # whole words of whole fields, then cut to `words`
    fields = torch.full((1, n), (1 << (bits - 1)) - offset, dtype=torch.int64)
    return pack_fields(fields, bits)[:, :words]


# AutoAWQ stores the 8 columns of a word in this order (value p of a word is column AWQ_ORDER[p] of its 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_values(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's 4-bit words [rows, cols/8] -> the unsigned values [rows, cols] in column order."""
    v = unpack_fields(words, 4)
    rows, cols = v.shape
    out = torch.empty_like(v)
    out.view(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)] = v.view(rows, cols // 8, 8)
    return out


def _add_per_word(words: torch.Tensor, bits: int, add: int) -> torch.Tensor:
    """int32 words + `add` in every `bits`-bit field, as one 32-bit addition a word (a field's carry goes into the
    next field): GPTQModel's v1 -> v2 conversion, the inverse of its v2 -> v1 save (whole words minus the same)."""
    const = sum(add << (i * bits) for i in range(32 // bits))
    w = (words.to(torch.int64) + const) & 0xFFFFFFFF
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def _add_per_field(words: torch.Tensor, bits: int, add: int) -> torch.Tensor:
    """Each `bits`-bit field of int32 words + `add`, wrapped within the field (see the module docstring)."""
    return pack_fields(unpack_fields(words, bits) + add, bits)
