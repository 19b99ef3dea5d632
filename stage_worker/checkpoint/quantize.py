"""`moepipe quantize --scheme S IN OUT`: a quantized checkpoint from a float one (issue 17), the files people
download, written with compressed-tensors' own quantizer and compressor (not bytes packed here) so that anyone can
make what the tests load.

Schemes (each role: a set of module-name patterns and one weight scheme; what no role names stays as it was):
* `reports-mixed`, the reports' release (001 §2-4): routed experts INT4 group 128; attention, Gated DeltaNet, the
  shared expert, dense MLPs and the PLE projections INT6 group 128; hyper-connection down/up INT8 per channel
  (its up projection has 320 inputs, 2.5 groups of 128); embedding and lm_head INT8 per channel; the router,
  gates, norms, the hyper-connections' block inject and the PLE table as they were.
* `int4-experts`: only the routed experts, INT4 group 128.
* `int4-experts-asym`: the same with a zero point per group (llm-compressor's W4A16_ASYM on the experts; AutoAWQ
  and GPTQ `sym: false` releases are of this kind): what the asymmetric INT4 expert kernels run.
* `nvfp4`, `mxfp4`: llm-compressor's NVFP4A16 and MXFP4A16 over the experts and the dense projections (FP4 E2M1
  values in groups of 16 with float8 scales under a global scale per module, or groups of 32 with power-of-two
  scales); a pattern whose modules' inputs the group does not divide stays as it was (FP4 has one group size).
  The routed experts are what the INT4 expert kernels run with their FP4 switch (where all three projections are
  FP4); the dense projections are dequantized at load.
* `fp8-block`: transformers' block-FP8 form (`quant_method: fp8`, 128 x 128 scales, `weight_scale_inv`) over the
  experts and the dense projections, as the model makers publish it; the rest is listed in
  `modules_to_not_convert`.
A group size that does not divide a module's inputs (the library needs whole groups) becomes the largest power of
two that does, down to 8, else per channel. Experts stored fused (3-D) are written per expert, the layout vLLM and
the loader read. Streams one tensor at a time; the output has one file per input file.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.checkpoint_files import CheckpointError, checkpoint_files, readable_as_umask_allows, tensor_headers

EXPERTS = (r"mlp\.experts\.\d+\.(gate|up)_proj", r"mlp\.experts\.\d+\.down_proj")
DENSE = (r"self_attn\.(q|k|v|o)_proj", r"self_attn\.indexer\.index_qk_proj", r"linear_attn\.in_proj_\w+",
         r"linear_attn\.out_proj", r"shared_expert\.(gate|up)_proj", r"shared_expert\.down_proj",
         r"mlp\.(gate|up)_proj", r"mlp\.down_proj", r"ple\.(key|value)_proj")
HYPER = (r"input_mix_weight_down", r"input_mix_weight_up")
EMBED = (r"embed_tokens", r"lm_head")


@dataclass(frozen=True)
class Role:
    name: str
    patterns: tuple[str, ...]
    bits: int
    kind: str = "int"
    strategy: str = "group"
    group_size: int | None = 128
    block: tuple[int, int] | None = None
    symmetric: bool = True


SCHEMES: dict[str, tuple[Role, ...]] = {
    "reports-mixed": (Role("experts_int4", EXPERTS, 4), Role("dense_int6", DENSE, 6),
                      Role("hyper_connection_int8", HYPER, 8, strategy="channel", group_size=None),
                      Role("embeddings_int8", EMBED, 8, strategy="channel", group_size=None)),
    "int4-experts": (Role("experts_int4", EXPERTS, 4),),
    "int4-experts-asym": (Role("experts_int4_asym", EXPERTS, 4, symmetric=False),),
    "nvfp4": (Role("nvfp4", EXPERTS + DENSE, 4, kind="float", strategy="tensor_group", group_size=16),),
    "mxfp4": (Role("mxfp4", EXPERTS + DENSE, 4, kind="float", strategy="group", group_size=32),),
    "fp8-block": (Role("fp8", EXPERTS + DENSE, 8, kind="float", strategy="block", group_size=None,
                       block=(128, 128)),),
}
# an FP4 role's strategy -> its compressed-tensors format and the dtype its group scales are stored in
FP4 = {"tensor_group": ("nvfp4-pack-quantized", "torch.float8_e4m3fn"),
       "group": ("mxfp4-pack-quantized", "torch.uint8")}


class QuantizeError(ValueError):
    """A scheme or checkpoint `moepipe quantize` cannot write; the message names it."""


def _library():
    try:
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils.helpers import calculate_qparams
    except ImportError as exc:
        raise QuantizeError("moepipe quantize writes with the compressed-tensors library: pip install "
                            "'moepipe[quantize]' (or compressed-tensors)") from exc
    return PackedQuantizationCompressor, QuantizationArgs, QuantizationConfig, QuantizationScheme, quantize, \
        calculate_qparams


def _pattern_of(module: str, roles: tuple[Role, ...]) -> tuple[Role, str] | None:
    for role in roles:
        for pat in role.patterns:
            if re.search(rf"(^|\.){pat}$", module):
                return role, pat
    return None


def _fp4(role: Role) -> bool:
    return role.kind == "float" and role.bits == 4


def _group_for(role: Role, inputs: set[int]) -> tuple[str, int | None] | None:
    """(strategy, group size) for one pattern's modules: the role's group if it divides every module's inputs,
    else the largest power of two (>= 8) that does, else per channel; FP4: its group or None (left as it was)."""
    if _fp4(role):
        return (role.strategy, role.group_size) if all(n % role.group_size == 0 for n in inputs) else None
    if role.strategy != "group":
        return role.strategy, None
    g = role.group_size
    while g >= 8:
        if all(n % g == 0 for n in inputs):
            return "group", g
        g //= 2
    return "channel", None


def _modules(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every 2-D `.weight` tensor's module -> shape, fused 3-D experts as their per-expert modules."""
    try:
        headers = tensor_headers(model_dir)
    except CheckpointError as exc:      # a truncated or foreign file, a broken index: named
        raise QuantizeError(f"cannot read the checkpoint: {exc}") from None
    out: dict[str, tuple[int, ...]] = {}
    for name, (shape, _) in headers.items():
        if name.endswith(".weight") and len(shape) == 2:
            out[name[: -len(".weight")]] = shape
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(shape) == 3:
            base, kind = name.rsplit(".", 1)
            for e in range(shape[0]):
                if kind == "gate_up_proj":
                    for p in ("gate_proj", "up_proj"):
                        out[f"{base}.{e}.{p}"] = (shape[1] // 2, shape[2])
                else:
                    out[f"{base}.{e}.down_proj"] = shape[1:]
    return out


def plan(model_dir: Path, scheme: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """(module -> weight args, config_groups) for `scheme` over the checkpoint's modules."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    roles = SCHEMES[scheme]
    modules = _modules(model_dir)
    by_pattern: dict[tuple[str, str], list[str]] = {}
    for module in modules:
        hit = _pattern_of(module, roles)
        if hit:
            by_pattern.setdefault((hit[0].name, hit[1]), []).append(module)
    role_of = {r.name: r for r in roles}
    chosen: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    for (rname, pat), names in by_pattern.items():
        role = role_of[rname]
        chosen_group = _group_for(role, {modules[m][1] for m in names})
        if chosen_group is None:
            continue
        strategy, gs = chosen_group
        args = {"num_bits": role.bits, "type": role.kind, "symmetric": role.symmetric, "strategy": strategy}
        if gs:
            args["group_size"] = gs
        if _fp4(role):
            args["scale_dtype"] = FP4[strategy][1]
        if role.block:
            args["block_structure"] = list(role.block)
        gname = rname if (strategy, gs) == (role.strategy, role.group_size) else \
            f"{rname}_{'g' + str(gs) if gs else strategy}"
        group = groups.setdefault(gname, {"targets": [], "weights": args, "input_activations": None,
                                          "output_activations": None})
        group["targets"].append(f"re:.*{pat}$")
        for m in names:
            chosen[m] = args
    return chosen, groups


def _int_weight(weight: torch.Tensor, args: dict, lib) -> dict[str, torch.Tensor]:
    P, QuantizationArgs, _, QuantizationScheme, _, calculate_qparams = lib
    qa = QuantizationArgs(**args)
    rows, n = weight.shape
    w = weight.float()
    if qa.strategy == "group":
        v = w.view(rows, n // qa.group_size, qa.group_size)
        lo, hi = v.amin(-1), v.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, qa)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype)}
    if not qa.symmetric:
        state["weight_zero_point"] = zp
    return P.compress(state, QuantizationScheme(targets=["Linear"], weights=qa))


def _fp4_weight(weight: torch.Tensor, args: dict, lib) -> dict[str, torch.Tensor]:
    """`weight_packed`, `weight_scale` (and NVFP4's `weight_global_scale`) from the library's FP4 compressor, with
    the scales its observers would give a weight: a global scale over the whole module, then per group."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    _, QuantizationArgs, _, QuantizationScheme, _, calculate_qparams = lib
    qa = QuantizationArgs(**args)
    rows, n = weight.shape
    w = weight.float()
    v = w.view(rows, n // qa.group_size, qa.group_size)
    state = {"weight": weight}
    if qa.strategy == "tensor_group":
        state["weight_global_scale"] = generate_gparam(w.amin(), w.amax())
    state["weight_scale"], _ = calculate_qparams(v.amin(-1), v.amax(-1), qa,
                                                 global_scale=state.get("weight_global_scale"))
    compressor = NVFP4PackedCompressor if qa.strategy == "tensor_group" else MXFP4PackedCompressor
    return compressor.compress(state, QuantizationScheme(targets=["Linear"], weights=qa))


def _fp8_weight(weight: torch.Tensor, block: tuple[int, int], lib) -> dict[str, torch.Tensor]:
    _, QuantizationArgs, _, _, quantize, calculate_qparams = lib
    qa = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=list(block))
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    w = torch.nn.functional.pad(weight.float(), (0, nc * bc - cols, 0, nr * br - rows))
    amax = w.view(nr, br, nc, bc).abs().amax((1, 3))
    scale, _ = calculate_qparams(-amax, amax, qa)
    q = quantize(weight.float(), scale, None, qa, dtype=torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale.float()}


def quantize_checkpoint(src: Path, dst: Path, scheme: str) -> dict:
    """Write `src` quantized with `scheme` to `dst`; returns a summary (modules per group, bytes in and out)."""
    lib = _library()
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise QuantizeError(f"{dst} exists and is not empty")
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QuantizeError(f"cannot read {src / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise QuantizeError(f"{src / 'config.json'} is not a JSON object")
    if config.get("quantization_config"):
        raise QuantizeError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    chosen, groups = plan(src, scheme)
    if not chosen:
        raise QuantizeError(f"scheme {scheme!r} names no module of {src}")
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        return _write(src, dst, scheme, config, chosen, groups, lib)
    except BaseException:
        # Ctrl-C, a full disk, an unreadable shard: no half-written output left that the next run refuses as "not
        # empty" (or that loads with files missing); a directory that was there stays, emptied
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        else:
            for f in dst.iterdir():
                if f.is_file():
                    f.unlink(missing_ok=True)
        raise


def _write(src: Path, dst: Path, scheme: str, config: dict, chosen: dict[str, dict], groups: dict[str, dict],
           lib) -> dict:
    role = SCHEMES[scheme][0]
    fp8, fp4 = role.kind == "float" and role.bits == 8, _fp4(role)
    bytes_in = bytes_out = 0
    weight_map: dict[str, str] = {}
    untouched: set[str] = set()
    for path in checkpoint_files(src):
        out: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                bytes_in += t.numel() * t.element_size()
                for module, weight in _split_fused(name, t):
                    args = chosen.get(module)
                    if args is None:
                        out[f"{module}.weight" if module != name else name] = weight.contiguous()
                        if name.endswith(".weight") and weight.dim() == 2:
                            untouched.add(module)
                        continue
                    parts = _fp8_weight(weight, tuple(args["block_structure"]), lib) if fp8 else \
                        _fp4_weight(weight, args, lib) if fp4 else _int_weight(weight, args, lib)
                    for part, v in parts.items():
                        out[f"{module}.{part}"] = v.contiguous()
        save_file(out, dst / path.name, metadata={"format": "pt"})
        readable_as_umask_allows(dst / path.name)
        for k, v in out.items():
            bytes_out += v.numel() * v.element_size()
            weight_map[k] = path.name
        del out
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for extra in src.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name not in (
                "config.json", "model.safetensors.index.json") and not extra.name.startswith("ple_table."):
            # (ple_table.*: the loader's expansion of the PLE shards, made again beside the output)
            shutil.copy(extra, dst / extra.name)
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": list(SCHEMES[scheme][0].block),
                                         "modules_to_not_convert": sorted(untouched)}
    else:
        import compressed_tensors

        fmt = FP4[role.strategy][0] if fp4 else "pack-quantized"
        qc = lib[2].model_validate({"config_groups": groups, "format": fmt, "quantization_status": "compressed"})
        config["quantization_config"] = {**qc.model_dump(mode="json"), "quant_method": "compressed-tensors",
                                         "version": compressed_tensors.__version__}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return {"scheme": scheme, "modules": len(chosen), "groups": {g: v["weights"] for g, v in groups.items()},
            "bytes_in": bytes_in, "bytes_out": bytes_out}


def _split_fused(name: str, t: torch.Tensor):
    """(module, 2-D weight) pairs of one tensor: fused 3-D experts per expert, anything else as itself."""
    if t.dim() == 3 and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        base, kind = name.rsplit(".", 1)
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                yield f"{base}.{e}.gate_proj", gate
                yield f"{base}.{e}.up_proj", up
            else:
                yield f"{base}.{e}.down_proj", t[e]
        return
    yield (name[: -len(".weight")] if name.endswith(".weight") else name), t
