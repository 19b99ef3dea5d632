"""Fuzz quantized checkpoints against transformers on the weights compressed-tensors decompresses.

Each case draws a random valid config of one family (tools/qa_checkpoint_fuzz.py's generator, then widths that
stress the packers: hidden and expert sizes that are not multiples of 8, 32 or 128, experts of 1-5 rows), writes it
with transformers, and quantizes it one of the ways users get such files:

- `moepipe quantize --scheme reports-mixed|int4-experts|fp8-block` (the CLI in a subprocess for some cases, else
  `quantize_checkpoint`, the same code);
- the compressed-tensors library itself, as llm-compressor saves a model: `apply_quantization_config` over
  transformers' modules with random groups (INT2-8, symmetric or not, per tensor / channel / group of 8-128 inputs,
  a per-layer override group, the embedding by class), min-max scales, `ModelCompressor` compress and save; and,
  since transformers holds routed experts as one 3-D module the library never quantizes, per-expert tensors
  compressed by the library's own compressor with a scheme of their own (asymmetric groups included), the layout
  vLLM and llm-compressor's MoE recipes write.

The oracle: every quantized module decompressed by compressed-tensors, with the scheme the library resolves from
the config (its own `match_targets`), written back as float and loaded by transformers (float32, eager). Where
transformers can load the quantized directory itself (library-written, experts float) its logits are checked
against that oracle too. moepipe must load the directory (packed kernels on, and off, and on two stages) and give
the oracle's prompt log-probabilities and greedy decode within 1e-4, or refuse at load with one CheckpointError /
QuantSchemeError naming the scheme. With --serve N, N cases also run through a real 2-stage cluster: the same
greedy text and log-probabilities as in-process. --refusals checks that schemes moepipe does not run are refused
naming the tensor and the scheme, never a traceback.

    python3 tools/qa_quant_fuzz.py --seed 1 --cases 20 [--way cli|library] [--serve 2] [--refusals] [--keep DIR]

Not collected by pytest: tests/test_qa_quant_fuzz.py keeps the cases that found bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

import torch  # noqa: E402

from qa_checkpoint_fuzz import (FAMILIES, NEW, TIE_GAP, Case, check_served, hf_config,  # noqa: E402
                                is_tie, random_case, reference, write_checkpoint)

TOL = 1e-4                    # the quantized tests' tolerance (tests/test_quantized_checkpoint.py)
SCHEMES = ("reports-mixed", "int4-experts", "fp8-block", "int4-experts-asym")
# widths off the packers' multiples (8, 32, 128) beside a few on them
HIDDEN = (20, 36, 44, 60, 72, 100, 136, 200, 24, 32, 64, 128)
EXPERT = (1, 2, 3, 5, 12, 20, 40, 72, 136, 8, 16, 64, 128)
QUANT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_scale_inv", "weight",
               "weight_g_idx")


# ---- configs ---------------------------------------------------------------------------------------------------------

def stress_case(rng: random.Random, family: str, servable: bool) -> Case:
    """A qa_checkpoint_fuzz case (at most 4 layers, heads of 2-20) with packer-stressing widths, no MTP head, SiLU
    mostly."""
    case = random_case(rng, family, servable=servable)
    while case.kw["num_hidden_layers"] > 4 or case.kw["head_dim"] == 256:       # small and quick
        case = random_case(rng, family, servable=servable)
    kw = case.kw
    kw["hidden_size"] = rng.choice(HIDDEN)
    kw["moe_intermediate_size"] = rng.choice(EXPERT)
    if kw.get("shared_expert_intermediate_size") or family == "qwen4_exp":
        kw["shared_expert_intermediate_size"] = rng.choice(EXPERT)
    if family == "qwen3_next":
        kw["intermediate_size"] = rng.choice(EXPERT)
    if kw.get("hidden_act") and rng.random() < 0.7:
        del kw["hidden_act"]
    case.mtp_layers = 0
    case.dtype = rng.choice(["float32", "float32", "bfloat16"])
    return case


# ---- the oracle: compressed-tensors decompresses -------------------------------------------------------------------

def _library_scheme(q: dict, module: str):
    """The scheme compressed-tensors gives `module` for config `q` (its own target matching), or None."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match, match_targets

    qc = QuantizationConfig.model_validate({k: v for k, v in q.items() if k not in ("quant_method", "version")})
    t2s = OrderedDict()
    for scheme in qc.config_groups.values():
        for t in scheme.targets:
            t2s[t] = scheme
    dummy = torch.nn.Embedding(1, 1) if module.endswith("embed_tokens") else torch.nn.Linear(1, 1)
    if not is_match(module, dummy, list(t2s), qc.ignore or []):
        return None
    from compressed_tensors.quantization.lifecycle.apply import _scheme_from_targets

    return _scheme_from_targets(t2s, match_targets(module, dummy, t2s), module)


def library_dense(qdir: Path, out: Path) -> int:
    """`qdir` with every quantized module as compressed-tensors decompresses it, in float32, into `out` (config
    without quantization_config); returns how many modules were quantized."""
    from compressed_tensors.compressors import (FloatQuantizationCompressor, IntQuantizationCompressor,
                                                PackedQuantizationCompressor)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((qdir / "config.json").read_text())
    q = config.pop("quantization_config")
    out.mkdir(parents=True)
    n = 0
    files = sorted(qdir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k)
                where[k] = f.name
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale",
                                                                     ".weight_scale_inv"))}
    result: dict[str, dict[str, torch.Tensor]] = {f.name: {} for f in files}
    for k, v in tensors.items():
        module, part = k.rsplit(".", 1)
        if module not in modules or part not in QUANT_PARTS:
            result[where[k]][k] = v.float() if v.is_floating_point() else v
    for module in sorted(modules):
        parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module and
                 k.rsplit(".", 1)[1] in QUANT_PARTS}
        home = where.get(f"{module}.weight", where.get(f"{module}.weight_packed", where.get(f"{module}.weight_scale")))
        if q["quant_method"] == "fp8":
            args = QuantizationArgs(num_bits=8, type="float", strategy="block",
                                    block_structure=list(q["weight_block_size"]))
            w = dequantize(parts["weight"], parts["weight_scale_inv"], None, args, dtype=torch.float32)
        else:
            scheme = _library_scheme(q, module)
            assert scheme is not None, f"no group of the library reaches {module}"
            fmt = scheme.format or q.get("format")
            comp = {"pack-quantized": PackedQuantizationCompressor, "int-quantized": IntQuantizationCompressor,
                    "naive-quantized": IntQuantizationCompressor,
                    "float-quantized": FloatQuantizationCompressor}[fmt]
            w = comp.decompress(parts, scheme)["weight"]
        result[home][f"{module}.weight"] = w.float().contiguous()
        n += 1
    for name, t in result.items():
        save_file(t, out / name, metadata={"format": "pt"})
    for extra in qdir.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name != "config.json" and \
                not extra.name.startswith("ple_table."):
            shutil.copy(extra, out / extra.name)
    if (out / "model.safetensors.index.json").exists():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: f for f, t in result.items() for k in t}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return n


def hf_load(path: Path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", experts_implementation="eager",
                                                dtype=torch.float32, **kw).float().eval()


# ---- way (a): moepipe quantize ---------------------------------------------------------------------------------------

def quantize_cli(src: Path, qdir: Path, scheme: str, cli: bool) -> str:
    if cli:
        proc = subprocess.run([sys.executable, "-m", "shared.cli", "quantize", "--scheme", scheme, str(src),
                               str(qdir)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"moepipe quantize rc {proc.returncode}: {proc.stderr.strip()[-400:]}")
        return f"cli {scheme}"
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    quantize_checkpoint(src, qdir, scheme)
    return f"quantize_checkpoint {scheme}"


# ---- way (b): compressed-tensors over a transformers model, experts per expert -------------------------------------

def _weights(rng: random.Random, fmt: str, allow_tensor: bool = True) -> dict:
    if fmt == "int-quantized":
        bits = 8
    else:
        bits = rng.choice([2, 3, 4, 4, 5, 6, 8])
    strategy = rng.choice(["group", "group", "channel"] + (["tensor"] if allow_tensor else []))
    w = {"num_bits": bits, "type": "int", "symmetric": rng.random() < 0.6, "strategy": strategy}
    if strategy == "group":
        w["group_size"] = rng.choice([8, 16, 32, 64, 128])
    return w


def _fit_group(w: dict, inputs: list[int]) -> None:
    """The largest group size up to the drawn one that divides every input count, else per channel."""
    g = w["group_size"]
    while g >= 8 and not all(n % g == 0 for n in inputs):
        g //= 2
    if g >= 8:
        w["group_size"] = g
    else:
        w["strategy"] = "channel"
        del w["group_size"]


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group / channel / tensor min and max of a weight, a last partial group included."""
    if args.strategy == "group":
        parts = w.split(args.group_size, dim=1)
        return torch.stack([p.amin(-1) for p in parts], -1), torch.stack([p.amax(-1) for p in parts], -1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.amin().reshape(1), w.amax().reshape(1)


def library_written(rng: random.Random, model, qdir: Path, family: str) -> str:
    """`model` quantized and saved by compressed-tensors with random groups; the routed experts, when drawn,
    compressed per expert by the library's compressor. Returns a description."""
    from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                  apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from compressed_tensors.utils.match import match_named_modules
    from safetensors.torch import load_file, save_file

    fmt = rng.choice(["pack-quantized"] * 4 + ["int-quantized"])
    groups: dict[str, dict] = {}
    pats = {"attn": ["re:.*self_attn\\.(q|k|v|o)_proj$"], "deltanet": ["re:.*linear_attn\\.(in_proj_\\w+|out_proj)$"],
            "mlp": ["re:.*mlp\\.shared_expert\\.(gate|up|down)_proj$", "re:.*mlp\\.(gate|up|down)_proj$"]}
    for g, targets in pats.items():
        if rng.random() < 0.8:
            groups[g] = {"targets": targets, "weights": _weights(rng, fmt)}
    if rng.random() < 0.3:
        groups["all_linear"] = {"targets": ["Linear"], "weights": _weights(rng, fmt)}
    if not groups:
        groups["all_linear"] = {"targets": ["Linear"], "weights": _weights(rng, fmt)}
    # a per-layer override: one module by exact name, later in the order (the library keeps the last group)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and
             re.search(r"(o_proj|out_proj|down_proj)$", n) and ".experts." not in n]
    if names and rng.random() < 0.5:
        groups["override"] = {"targets": [rng.choice(names)], "weights": _weights(rng, fmt)}
    if rng.random() < 0.25 and fmt == "pack-quantized":
        groups["embedding"] = {"targets": ["Embedding"], "weights": _weights(rng, fmt, allow_tensor=False)}
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*indexer.*"] + \
        (["re:.*hyper_connection.*", "re:.*ple.*"] if family == "qwen4_exp" else [])
    ignore += [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
               and m.weight.numel() == 0]
    if not any(any(True for _ in match_named_modules(model, g["targets"], ignore)) for g in groups.values()):
        # groups of modules the model lacks (attention of an all-DeltaNet model, a zero-width shared expert): the
        # library would write no quantization_config at all and the case would test nothing
        groups["all_linear"] = {"targets": ["Linear"], "weights": _weights(rng, fmt)}
    for g in groups.values():           # the library's compressor needs whole groups: a size dividing every input
        reached = [m.weight.shape[1] for _, m in match_named_modules(model, g["targets"], ignore)]
        if g["weights"]["strategy"] == "group":
            _fit_group(g["weights"], reached)
    qconfig = {"config_groups": groups, "ignore": ignore, "format": fmt}
    apply_quantization_config(model, QuantizationConfig.model_validate(qconfig), show_progress=False)
    for _, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None or s.weights is None:
            continue
        lo, hi = _minmax(m.weight.data.float(), s.weights)
        scale, zp = calculate_qparams(lo, hi, s.weights)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
        if getattr(m, "weight_zero_point", None) is not None:
            m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    comp.compress_model(model)
    model.save_pretrained(qdir)
    comp.update_config(qdir)
    desc = {g: v["weights"] for g, v in groups.items()} | {"format": fmt}
    if rng.random() < 0.6 and fmt == "pack-quantized":
        ew = _weights(rng, fmt)
        if ew["strategy"] == "group":
            c = model.config
            _fit_group(ew, [c.hidden_size, c.moe_intermediate_size])
        desc["experts"] = ew
        args = QuantizationArgs(**ew)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        f = qdir / "model.safetensors"
        tensors = load_file(f)
        out = {}
        for name, t in tensors.items():
            # save_pretrained writes the experts fused (3-D) or per expert, as the family's released files are
            per_expert = re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", name)
            if per_expert or (t.dim() == 3 and name.endswith((".experts.gate_up_proj", ".experts.down_proj"))):
                if per_expert:
                    todo = [(name[: -len(".weight")], t)]
                else:
                    base, kind = name.rsplit(".", 1)
                    todo = [(f"{base}.{e}.{p}", w) for e in range(t.shape[0]) for p, w in (
                        zip(("gate_proj", "up_proj"), t[e].chunk(2, 0)) if kind == "gate_up_proj" else
                        [("down_proj", t[e])])]
                for module, w in todo:
                    lo, hi = _minmax(w.float(), args)
                    s, zp = calculate_qparams(lo, hi, args)
                    state = {"weight": w, "weight_scale": s.to(w.dtype)}
                    if not args.symmetric:
                        state["weight_zero_point"] = zp
                    for part, v in PackedQuantizationCompressor.compress(state, scheme).items():
                        out[f"{module}.{part}"] = v.contiguous()
            else:
                out[name] = t
        save_file(out, f, metadata={"format": "pt"})
        config = json.loads((qdir / "config.json").read_text())
        config["quantization_config"]["config_groups"]["routed_experts"] = {
            "targets": ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"], "weights": args.model_dump(mode="json"),
            "input_activations": None, "output_activations": None, "format": fmt}
        (qdir / "config.json").write_text(json.dumps(config))
    return "library " + json.dumps(desc, sort_keys=True)


# ---- moepipe ---------------------------------------------------------------------------------------------------------

def check_moepipe(qdir: Path, prompt: list[int], want_ids: list[int], want: torch.Tensor, layers: int,
                  **opts) -> tuple[float, str]:
    """Teacher-forced prefill + decode log-probability error against `want`; a message if a greedy token differs
    off a near-tie."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine

    split = opts.pop("split", False)
    ranges = [(0, layers // 2), (layers // 2, layers)] if split and layers > 1 else [(0, layers)]
    parts = [load_model(qdir, LoadOptions(start=s, end=e, dtype=torch.float32, **opts)) for s, e in ranges]
    engine = LocalEngine(parts, max_seqs=1, max_tokens=64)
    engine.add(0)
    got = [engine.step([(0, prompt)], all_logits=True)]
    for tok in want_ids[:-1]:
        got.append(engine.step([(0, [tok])], all_logits=True))
    got = torch.cat(got)
    err = (torch.log_softmax(got, -1) - torch.log_softmax(want[:-1], -1)).abs().max().item()
    for pos, tok in enumerate(want_ids):
        row = len(prompt) - 1 + pos
        if int(got[row].argmax()) != tok and not is_tie(want[row]):
            return err, f"greedy token {pos} differs: {int(got[row].argmax())} != {tok}"
    return err, ""


def load_refusal(qdir: Path, **opts) -> str | None:
    """None when moepipe loads the directory (with LoadOptions `opts`); the message of its refusal
    (CheckpointError / QuantSchemeError / ConfigError), else raises."""
    from shared.checkpoint_files import CheckpointError
    from shared.model_config import ConfigError
    from shared.quant_scheme import QuantSchemeError
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    try:
        load_model(qdir, LoadOptions(dtype=torch.float32, **opts))
    except (CheckpointError, QuantSchemeError, ConfigError) as exc:
        return str(exc)
    return None


def _has_experts(model) -> bool:
    """The transformers model has routed experts (Qwen3-Next draws none with num_experts 0, mlp_only_layers every
    layer or decoder_sparse_step past the layers): `--scheme int4-experts` has something to quantize."""
    return any(".mlp.experts" in name for name, _ in model.named_parameters())


def run_case(case: Case, way: str, rng: random.Random, work: Path, serve: bool) -> tuple[str, str, float]:
    """(status, detail, worst error): ok, refused, skipped (transformers / the library cannot make it), tie,
    mismatch, crash."""
    for d in ("src", "q", "dense"):
        shutil.rmtree(work / d, ignore_errors=True)
    src, qdir, dense = work / "src", work / "q", work / "dense"
    try:
        model = write_checkpoint(case, src)
    except Exception as exc:  # noqa: BLE001 - transformers cannot build it
        return "skipped", f"transformers: {type(exc).__name__}: {exc}"[:300], 0.0
    try:
        if way == "cli":
            how = quantize_cli(src, qdir, rng.choice(SCHEMES), cli=rng.random() < 0.25)
        else:
            if case.dtype != "float32":
                model = model.float()
            how = library_written(rng, model, qdir, case.family)
    except Exception as exc:  # noqa: BLE001
        detail = "".join(traceback.format_exception_only(exc)).strip()[-500:]
        if way == "cli" and "names no module" in detail and not _has_experts(model):
            return "refused", "quantize: " + detail, 0.0      # int4-experts of a model with no routed experts
        # the library refusing its own input (a group size against a width) is not moepipe's to serve
        return ("crash" if way == "cli" else "skipped"), "quantize: " + detail, 0.0
    case.notes.append(how)
    try:
        n = library_dense(qdir, dense)
        ref = hf_load(dense)
    except Exception as exc:  # noqa: BLE001
        return "skipped", "oracle: " + "".join(traceback.format_exception_only(exc)).strip()[-400:], 0.0
    case.notes.append(f"{n} modules quantized")
    limit = ref.config.max_position_embeddings
    prompt = [rng.randrange(ref.config.vocab_size) for _ in range(rng.randint(1, max(1, min(30, limit - 1))))]
    case.notes.append(f"prompt={prompt}")
    new = min(NEW, max(1, limit - len(prompt)))
    try:
        want_ids, want, gap = reference(ref, prompt, new)
    except Exception as exc:  # noqa: BLE001
        return "skipped", f"transformers forward: {type(exc).__name__}: {exc}"[:300], 0.0
    tie = "tie" if gap < TIE_GAP else "mismatch"
    if way == "library" and "experts" not in how:
        # transformers reads the library's directory itself (experts float): its decompression is the oracle's
        try:
            from transformers.utils.quantization_config import CompressedTensorsConfig

            direct = hf_load(qdir, quantization_config=CompressedTensorsConfig(run_compressed=False))
            from hf_oracle import reference_logits

            d = (reference_logits(direct, prompt) - want[: len(prompt)]).abs().max().item()
            case.notes.append(f"transformers direct vs oracle {d:.1e}")
        except Exception as exc:  # noqa: BLE001
            case.notes.append(f"transformers cannot load it directly: {type(exc).__name__}: {str(exc)[:120]}")
    # packed on: LoadOptions keeps float8 experts and dense layers float8 only when asked (a served stage keeps the
    # experts so by default, cluster key packed_fp8_experts); off: everything dequantized at load
    on = {"packed_fp8_experts": True, "packed_fp8_dense": True}
    try:
        why = load_refusal(qdir, **on)
        if why is not None:
            return "refused", why[:500], 0.0
        worst = 0.0
        layers = ref.config.num_hidden_layers
        for opts in (on, {"packed_experts": False, "packed_dense": False, "packed_fp8_experts": False},
                     {"split": True, **on}):
            err, msg = check_moepipe(qdir, prompt, want_ids, want, layers, **opts)
            worst = max(worst, err)
            if msg or err > TOL:
                return tie, f"{opts}: " + (msg or f"log-prob error {err:.3g}") + f" [gap {gap:.2g}]", worst
        if serve:
            msg = check_served(qdir, ref, prompt, 2 if layers > 1 else 1, [(0, layers)], limit)
            if msg:
                return tie, "served: " + msg, worst
        return "ok", "", worst
    except Exception as exc:  # noqa: BLE001
        return "crash", "".join(traceback.format_exception_only(exc)).strip()[-600:] + "\n" + \
            "".join(traceback.format_tb(exc.__traceback__)[-3:]), 0.0


# ---- refusals --------------------------------------------------------------------------------------------------------

UNSUPPORTED = {
    "w4a8 (activations quantized)": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                 "strategy": "group", "group_size": 16},
                                     "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                           "strategy": "token", "dynamic": True}},
    "nvfp4a4 (activations quantized)": {
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16},
        "input_activations": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                              "group_size": 16, "dynamic": "local"}, "format": "nvfp4-pack-quantized"},
    "int4 block": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "block",
                               "block_structure": [8, 8]}},
    "float8 group": {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                 "group_size": 16}, "format": "float-quantized"},
    "marlin-24": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                              "group_size": 16}, "format": "marlin-24"},
}


def check_refusals(work: Path) -> list[str]:
    """Each UNSUPPORTED scheme over a moepipe-quantized checkpoint's experts: load_model and `moepipe serve`'s
    check (`quant_scheme.refusal`) stop with one message naming the scheme and a tensor, no traceback."""
    from hf_oracle import save_reference
    from shared.quant_scheme import refusal
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    src, base = work / "rsrc", work / "rbase"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    save_reference("qwen3_5_moe", src, seed=0)
    quantize_checkpoint(src, base, "int4-experts")
    problems = []
    for label, scheme in UNSUPPORTED.items():
        d = work / "refuse"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        config = json.loads((d / "config.json").read_text())
        group = next(iter(config["quantization_config"]["config_groups"].values()))
        group.update({k: v for k, v in scheme.items() if k != "format"})
        if "format" in scheme:
            config["quantization_config"]["format"] = scheme["format"]
        (d / "config.json").write_text(json.dumps(config))
        try:
            why = load_refusal(d)
        except Exception as exc:  # noqa: BLE001
            why = f"TRACEBACK {type(exc).__name__}: {exc}"
        served = refusal(d)              # what `moepipe serve` checks before it starts a stage
        if why and not why.startswith("TRACEBACK") and (served is None or why not in served):
            why = f"serve's check differs: {served}"
        tensor = re.search(r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+", why or "")
        print(f"  {label}: {why}")
        if why is None or why.startswith("TRACEBACK") or not tensor:
            problems.append(f"{label}: {why}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=10)
    ap.add_argument("--family", choices=FAMILIES, action="append")
    ap.add_argument("--way", choices=("cli", "library"), action="append")
    ap.add_argument("--serve", type=int, default=0, help="serve this many ok cases through a 2-stage cluster")
    ap.add_argument("--refusals", action="store_true")
    ap.add_argument("--keep", type=Path)
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case's config and notes")
    args = ap.parse_args(argv)
    sys.modules.setdefault("fla", None)
    torch.set_num_threads(2)
    try:
        from loguru import logger

        logger.disable("compressed_tensors")          # a warning per module on int-quantized
    except ImportError:
        pass
    work = Path(tempfile.mkdtemp(prefix="qa-quant-fuzz-"))
    failures = 0
    try:
        if args.refusals:
            problems = check_refusals(work)
            print("refusals:", "ok" if not problems else problems)
            failures += len(problems)
        rng = random.Random(args.seed)
        families, ways = args.family or list(FAMILIES), args.way or ["cli", "library"]
        counts: dict[str, int] = {}
        served = 0
        for i in range(args.cases):
            family, way = families[i % len(families)], ways[(i // len(families)) % len(ways)]
            want_serve = served < args.serve
            for _ in range(50):
                case = stress_case(rng, family, want_serve)
                try:
                    hf_config(case)
                    break
                except Exception:  # noqa: BLE001
                    continue
            t0 = time.monotonic()
            status, detail, err = run_case(case, way, rng, work, want_serve)
            served += want_serve and status == "ok"
            counts[status] = counts.get(status, 0) + 1
            print(f"[{i}] {family} {way} {status} err={err:.1e} {time.monotonic() - t0:.1f}s"
                  + (" served" if want_serve and status == "ok" else ""), flush=True)
            if status != "ok" or args.verbose:
                print("   ", case.describe())
                print("   ", detail.replace("\n", "\n    "))
            if status in ("mismatch", "crash"):
                failures += 1
                if args.keep:
                    dest = args.keep / f"case{args.seed}-{i}"
                    shutil.rmtree(dest, ignore_errors=True)
                    shutil.copytree(work, dest, ignore=shutil.ignore_patterns("refuse*", "rsrc", "rbase"))
                    (dest / "case.json").write_text(case.describe())
        print("summary:", json.dumps(counts, sort_keys=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
