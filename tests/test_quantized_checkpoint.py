"""Quantized checkpoints (issue 17): `moepipe quantize` writes them with compressed-tensors' own quantizer and
compressor, moepipe loads them (stage_worker/model/quant_weight.py reads the packed tensors without the library),
and the logits equal transformers' on the weights the library itself decompresses: prefill and greedy decode, in
float32 on the CPU, for the Qwen4-Exp and Qwen3-Next layouts (Qwen3-Next's grouped in-projections are dequantized
before their rows are regrouped).

transformers 5.24 cannot load these files itself when the routed experts are quantized (it holds experts as one
3-D module, which the per-expert `weight_packed` tensors do not map onto), so its side of the comparison is the
checkpoint the library's decompressor writes back to float.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytest.importorskip("compressed_tensors")

from conftest import moepipe  # noqa: E402
from hf_oracle import reference_logits, save_reference  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from shared.quant_scheme import WeightQuant, parse  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.checkpoint.quantize import QuantizeError, quantize_checkpoint  # noqa: E402
from stage_worker.kernels.quant_gemv_ref import dequantize_packed  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402
from stage_worker.model import quant_weight as qw  # noqa: E402

PROMPT = [40, 7, 200, 13, 5, 99, 101, 250, 3, 17, 88, 61, 120, 300]
NEW = 16
TOL = 1e-4
CASES = [("qwen4_exp", "reports-mixed"), ("qwen3_next", "reports-mixed"), ("qwen4_exp", "fp8-block"),
         ("qwen3_next", "int4-experts"), ("qwen3_next", "int4-experts-asym")]


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, family in enumerate(("qwen4_exp", "qwen3_next")):
        path = tmp_path_factory.mktemp(family)
        save_reference(family, path, seed=i)
        out[family] = path
    return out


@pytest.fixture(scope="module")
def quantized(originals, tmp_path_factory):
    """(family, scheme) -> (directory, summary): `quantize_checkpoint(originals[family], directory, scheme)`, written
    once for the module (several tests read the same checkpoint; none writes into it)."""
    made: dict[tuple[str, str], tuple[Path, dict]] = {}

    def get(family: str, scheme: str) -> tuple[Path, dict]:
        if (family, scheme) not in made:
            qdir = tmp_path_factory.mktemp(f"{family}_{scheme}") / "q"
            made[family, scheme] = qdir, quantize_checkpoint(originals[family], qdir, scheme)
        return made[family, scheme]
    return get


@pytest.fixture(scope="module")
def original_logits(originals):
    """family -> transformers' logits of PROMPT on the float original (the "quantization is real" checks), computed
    once for the module."""
    made: dict[str, torch.Tensor] = {}

    def get(family: str) -> torch.Tensor:
        if family not in made:
            made[family] = reference_logits(_reference(originals[family]), PROMPT)
        return made[family]
    return get


def _decompress_with_the_library(qdir: Path, out: Path) -> None:
    """The oracle's weights: every quantized module as the compressed-tensors library decompresses it."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    config = json.loads((qdir / "config.json").read_text())
    q = config.pop("quantization_config")
    plan = parse({"quantization_config": q})
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(qdir / "model.safetensors", "pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale_inv",
                                                                     ".weight_scale"))}
    plain = {}
    for k, v in tensors.items():
        module, part = k.rsplit(".", 1)
        if module not in modules or part not in qw.QUANT_PARTS:      # a quantized module's bias stays as it is
            plain[k] = v
    for module in modules:
        parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
        wq = plan.for_module(module)
        if q["quant_method"] == "fp8":
            args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(wq.block))
            w = dequantize(parts["weight"], parts["weight_scale_inv"], None, args, dtype=torch.float32)
        elif wq.fp4:                                 # NVFP4 / MXFP4: the format's own compressor
            from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
            from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

            compressor = NVFP4PackedCompressor if wq.strategy == "tensor_group" else MXFP4PackedCompressor
            weights = next(g["weights"] for g in q["config_groups"].values() if _reached(module, g))
            scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
            w = compressor.decompress({k: v for k, v in parts.items() if k != "bias"}, scheme)["weight"]
        elif wq.format != "pack-quantized":          # one value an element: the format's own compressor
            from compressed_tensors.compressors import FloatQuantizationCompressor, IntQuantizationCompressor

            compressor = FloatQuantizationCompressor if wq.kind == "float" else IntQuantizationCompressor
            weights = next(g["weights"] for g in q["config_groups"].values())
            scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
            w = compressor.decompress({k: v for k, v in parts.items() if k != "bias"}, scheme)["weight"]
        else:
            group = next(g for g in q["config_groups"].values() if g["weights"]["num_bits"] == wq.bits and
                         g["weights"].get("group_size") == wq.group_size and
                         g["weights"]["strategy"] == wq.strategy)
            scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]))
            w = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        plain[f"{module}.weight"] = w.float().contiguous()
    out.mkdir()
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", experts_implementation="eager",
                                                dtype=torch.float32).eval()


def _library_greedy(qdir: Path, dense: Path) -> tuple[list[int], torch.Tensor]:
    """transformers on `qdir` decompressed by the library: PROMPT and NEW greedy tokens, and the log-probabilities
    after each of them (the oracle of the end-to-end tests)."""
    _decompress_with_the_library(qdir, dense)
    ref = _reference(dense)
    ids = list(PROMPT)
    for _ in range(NEW):
        ids.append(int(reference_logits(ref, ids)[-1].argmax()))
    return ids, torch.log_softmax(reference_logits(ref, ids), -1)


@pytest.mark.parametrize("family,scheme", CASES)
def test_quantized_checkpoint_matches_transformers_on_the_librarys_decompression(family, scheme, quantized,
                                                                                  original_logits, tmp_path):
    qdir, summary = quantized(family, scheme)
    assert summary["bytes_out"] < summary["bytes_in"]
    config = json.loads((qdir / "config.json").read_text())
    with safe_open(qdir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        if scheme == "fp8-block":
            assert f.get_slice("model.layers.0.mlp.experts.0.gate_proj.weight").get_dtype() == "F8_E4M3"
    assert "model.layers.0.mlp.experts.0.down_proj.weight_scale" in names or scheme == "fp8-block"
    if scheme == "reports-mixed":
        bits = {g: v["weights"]["num_bits"] for g, v in config["quantization_config"]["config_groups"].items()}
        assert {4, 6, 8} <= set(bits.values()), bits
        assert "model.layers.0.mlp.gate.weight" in names                       # the router stays float
    ids, want_lp = _library_greedy(qdir, tmp_path / "dense")

    model = load_model(qdir, LoadOptions(dtype=torch.float32))
    engine = LocalEngine([model], max_seqs=1, max_tokens=64)
    engine.add(0)
    logits = engine.step([(0, PROMPT)], all_logits=True)
    assert (torch.log_softmax(logits, -1) - want_lp[: len(PROMPT)]).abs().max() < TOL
    got = []
    for i in range(NEW):
        got.append(int(logits[-1].argmax()))
        logits = engine.step([(0, [got[-1]])])
        if i < NEW - 1:
            assert (torch.log_softmax(logits[-1], -1) - want_lp[len(PROMPT) + i]).abs().max() < TOL
    assert got == ids[len(PROMPT):]
    # and the quantization is real: the original float model's logits are elsewhere
    orig = original_logits(family)
    assert (torch.log_softmax(orig, -1) - want_lp[: len(PROMPT)]).abs().max() > 1e-3


@pytest.mark.parametrize("bits", range(2, 9))
def test_unpack_reads_the_librarys_dense_packing_and_the_older_layout(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(bits)
    for n in (1, 5, 31, 32, 33, 130):
        q = torch.randint(-(1 << bits - 1), 1 << bits - 1, (7, n), generator=g, dtype=torch.int8)
        assert torch.equal(qw.unpack(pack_to_int32(q, bits), bits, n), q), n
        # the older layout: 32 // bits values per word, low bits first, stored with the same offset
        per = 32 // bits
        if qw.legacy_words(n, bits) == qw.dense_words(n, bits):
            continue
        u = torch.nn.functional.pad((q.to(torch.int64) + (1 << bits - 1)), (0, -n % per)).view(7, -1, per)
        words = (u << (torch.arange(per) * bits)).sum(-1)
        legacy = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        assert torch.equal(qw.unpack(legacy, bits, n), q), n


def test_asymmetric_groups_and_partial_groups_dequantize_as_the_library_would():
    """Asymmetric zero points (packed along their rows) match the library bit for bit; a last group shorter than
    the group size (which the library's quantizer refuses but other writers make) takes its scale's column."""
    from compressed_tensors.compressors import PackedQuantizationCompressor as P
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    g = torch.Generator().manual_seed(0)
    for bits in (4, 6, 8):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=16)
        w = torch.randn(40, 96, generator=g, dtype=torch.bfloat16)
        v = w.float().view(40, -1, 16)
        scale, zp = calculate_qparams(v.amin(-1), v.amax(-1), args)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        c = P.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zp}, scheme)
        want = P.decompress(c, scheme)["weight"]
        wq = WeightQuant(bits=bits, kind="int", symmetric=False, strategy="group", group_size=16)
        assert torch.equal(qw.dequantize(c, wq, want.dtype), want)
    # 40 inputs in groups of 16: 16 + 16 + 8
    q = torch.randint(-8, 8, (3, 40), generator=g, dtype=torch.int8)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    scale = torch.rand(3, 3, generator=g) + 0.5
    parts = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([3, 40])}
    got = qw.dequantize(parts, WeightQuant(bits=4, kind="int", group_size=16), torch.float32)
    assert torch.equal(got, q.float() * scale.repeat_interleave(16, 1)[:, :40])


FP4_SCHEMES = {"nvfp4": ("tensor_group", 16, "F8_E4M3"), "mxfp4": ("group", 32, "U8")}


def _wide_experts(tmp_path: Path) -> Path:
    """Qwen3-Next with experts 32 wide, so MXFP4's groups of 32 reach their down projections too (the tiny
    families' 16 leave them in float, and such a layer is dequantized at load)."""
    from hf_oracle import build_from_config, qwen3_next_config

    cfg = qwen3_next_config()
    cfg.moe_intermediate_size = 32
    out = tmp_path / "wide"
    build_from_config(cfg, seed=3).save_pretrained(out)
    return out


@pytest.mark.parametrize("family,scheme", [("qwen4_exp", "nvfp4"), ("qwen3_next", "nvfp4"), ("qwen3_next", "mxfp4"),
                                           ("wide", "mxfp4")])
def test_fp4_checkpoint_matches_transformers_on_the_librarys_decompression(family, scheme, quantized,
                                                                          original_logits, tmp_path):
    """NVFP4A16 / MXFP4A16 (llm-compressor's releases of this family: experts, attention, DeltaNet and shared-expert
    projections in FP4, the router and norms in float), written by the library's own FP4 compressor: moepipe keeps
    the routed experts packed (E2M1 words, float32 scales: the INT4 expert kernels' FP4 form) and dequantizes the
    rest at load, and its prefill log-probs and greedy decode equal transformers' on the library's decompression, on
    one stage and on two; and equal (1e-5) those of the same checkpoint with every module dequantized at load
    (packed_experts off)."""
    from stage_worker.model.quant_linear import PackedLinear

    if family == "wide":
        qdir, original = tmp_path / "q", _wide_experts(tmp_path)
        quantize_checkpoint(original, qdir, scheme)
    else:
        qdir = quantized(family, scheme)[0]
    q = json.loads((qdir / "config.json").read_text())["quantization_config"]
    strategy, group, scale_dtype = FP4_SCHEMES[scheme]
    assert q["format"] == f"{scheme}-pack-quantized"
    assert [(g["weights"]["strategy"], g["weights"]["group_size"]) for g in q["config_groups"].values()] == \
        [(strategy, group)]
    with safe_open(qdir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        expert = "model.layers.0.mlp.experts.0.gate_proj"
        assert f.get_slice(f"{expert}.weight_packed").get_dtype() == "U8"
        assert f.get_slice(f"{expert}.weight_scale").get_dtype() == scale_dtype
    assert (f"{expert}.weight_global_scale" in names) == (scheme == "nvfp4")
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight_packed" in names
    assert any(".self_attn.q_proj.weight_packed" in n for n in names)
    assert any(".linear_attn.out_proj.weight_packed" in n for n in names)
    assert {"model.layers.0.mlp.gate.weight", "lm_head.weight", "model.layers.0.linear_attn.norm.weight"} <= names
    ids, want = _library_greedy(qdir, tmp_path / "dense")

    whole = load_model(qdir, LoadOptions(dtype=torch.float32))
    moes = whole.moe_layers().values()
    if f"{expert[:-len('gate_proj')]}down_proj.weight_packed" in names:      # all three projections FP4: packed
        assert moes and all(m.packed_group == m.packed_group2 == group and m.packed().fp4 for m in moes)
        assert all(not hasattr(m, "w13") and m.q13.dtype == torch.int32 and m.s13.dtype == torch.float32
                   for m in moes)
    else:                                        # MXFP4 left the 16-wide down projections float: dequantized
        assert (family, scheme) == ("qwen3_next", "mxfp4") and not any(m.packed_group for m in moes)
    assert not any(isinstance(m, PackedLinear) for m in whole.modules())
    plain = load_model(qdir, LoadOptions(dtype=torch.float32, packed_experts=False))
    assert not any(m.packed_group or m.fp8_block for m in plain.moe_layers().values())
    n = whole.cfg.num_hidden_layers
    halves = [load_model(qdir, LoadOptions(dtype=torch.float32, start=s, end=e)) for s, e in ((0, n // 2), (n // 2, n))]
    outs = []
    for stages in ([whole], halves, [plain]):
        got, tokens = _logits_of(stages, NEW)
        assert tokens == ids[len(PROMPT):]
        assert (torch.log_softmax(got, -1) - want).abs().max() < TOL
        outs.append(got)
    assert (outs[0] - outs[2]).abs().max() < 1e-5 and (outs[1] - outs[2]).abs().max() < 1e-5
    orig = reference_logits(_reference(original), PROMPT) if family == "wide" else original_logits(family)
    assert (torch.log_softmax(orig, -1) - want[: len(PROMPT)]).abs().max() > 1e-3      # the quantization is real


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_fp4_dequantization_equals_the_librarys_bit_for_bit(scheme):
    """Every byte (so every code in both nibbles, negative zero among them), odd row counts and every scale the
    format stores (all 256 float8 bit patterns, NaN and subnormals included; all 256 E8M0 exponents, 255 read as
    inf): moepipe's FP4 dequantization gives the library decompressor's bfloat16 bits, and float32 is those
    values."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy, group, _ = FP4_SCHEMES[scheme]
    compressor = NVFP4PackedCompressor if scheme == "nvfp4" else MXFP4PackedCompressor
    args = QuantizationArgs(num_bits=4, type="float", strategy=strategy, group_size=group, symmetric=True)
    wq = WeightQuant(bits=4, kind="float", strategy=strategy, group_size=group, format=f"{scheme}-pack-quantized")
    g = torch.Generator().manual_seed(0)
    every = torch.arange(256, dtype=torch.uint8)
    for rows, n in ((1, group), (7, 3 * group), (33, 4 * group)):
        packed = every[torch.randint(0, 256, (rows, n // 2), generator=g)]
        packed.view(-1)[:256] = every[: packed.numel()] if packed.numel() < 256 else every
        codes = every[torch.randint(0, 256, (rows, n // group), generator=g)]
        codes.view(-1)[: min(256, codes.numel())] = every[: min(256, codes.numel())]
        parts = {"weight_packed": packed}
        if scheme == "nvfp4":
            parts |= {"weight_scale": codes.view(torch.float8_e4m3fn),
                      "weight_global_scale": torch.rand(1, generator=g) * 1000 + 1}
        else:
            parts["weight_scale"] = codes
        want = compressor.decompress(dict(parts), QuantizationScheme(targets=["Linear"], weights=args))["weight"]
        got = qw.dequantize(parts, wq, torch.bfloat16)
        assert want.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16)), (rows, n)
        assert torch.equal(qw.dequantize(parts, wq, torch.float32).view(torch.int32), want.float().view(torch.int32))
    assert torch.equal(qw.unpack_fp4(torch.tensor([[0x80, 0x7F]], dtype=torch.uint8)).view(torch.int32),
                       torch.tensor([[0.0, -0.0, -6.0, 6.0]]).view(torch.int32))   # low nibble first, -0 kept


def test_quantize_command_writes_and_names_what_it_cannot_do(originals, tmp_path):
    def run(*args):
        return moepipe("quantize", *args)

    done = tmp_path / "done"
    r = run("--scheme", "int4-experts", str(originals["qwen3_next"]), str(done))
    assert r.returncode == 0, r.stderr
    assert "experts_int4_g16: int4 group 16" in r.stdout and "modules quantized (int4-experts)" in r.stdout
    r = run("--scheme", "nvfp4", str(originals["qwen3_next"]), str(tmp_path / "fp4"))
    assert r.returncode == 0 and "nvfp4: float4 tensor_group 16" in r.stdout, r.stderr
    r = run("--scheme", "reports-mixed", str(tmp_path / "nowhere"), str(tmp_path / "o"))
    assert r.returncode == 2 and "nowhere: no such directory" in r.stderr and "download" not in r.stderr
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(done, tmp_path / "again", "int4-experts")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_checkpoint(originals["qwen3_next"], done, "int4-experts")
    with pytest.raises(QuantizeError, match="unknown scheme 'int3'"):
        quantize_checkpoint(originals["qwen3_next"], tmp_path / "x", "int3")
    broken = tmp_path / "broken"                  # a truncated weights file and a config that is not JSON: named
    broken.mkdir()
    (broken / "config.json").write_bytes((originals["qwen3_next"] / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes((originals["qwen3_next"] / "model.safetensors").read_bytes()[:100])
    with pytest.raises(QuantizeError, match="cannot read .*model.safetensors"):
        quantize_checkpoint(broken, tmp_path / "y", "int4-experts")
    (broken / "config.json").write_text("{")
    r = run("--scheme", "int4-experts", str(broken), str(tmp_path / "z"))
    assert r.returncode == 2 and "config.json" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("family,scheme", [("qwen4_exp", "reports-mixed"), ("qwen3_next", "int4-experts"),
                                           ("qwen3_next", "int4-experts-asym")])
def test_int4_experts_stay_packed_and_give_the_dequantized_models_logits(family, scheme, quantized):
    """The routed experts of an INT4 checkpoint stay in their words and scales (a quarter of the bf16 bytes; with
    zero points, W4A16_ASYM, beside the scales) and the model's logits equal those of the same checkpoint
    dequantized at load (packed_experts off); split into two stages too (each stage skips the other's packed
    tensors)."""
    qdir = quantized(family, scheme)[0]
    packed = load_model(qdir, LoadOptions(dtype=torch.float32))
    moes = packed.moe_layers()
    assert moes and all(m.packed_group and m.packed().asym == scheme.endswith("asym") for m in moes.values())
    assert all(not hasattr(m, "w13") and m.q13.dtype == torch.int32 for m in moes.values())
    plain = load_model(qdir, LoadOptions(dtype=torch.float32, packed_experts=False))
    assert not any(m.packed_group for m in plain.moe_layers().values())
    n = packed.cfg.num_hidden_layers
    halves = [load_model(qdir, LoadOptions(dtype=torch.float32, start=s, end=e)) for s, e in ((0, n // 2),
                                                                                            (n // 2, n))]
    outs = []
    for stages in ([packed], [plain], halves):
        engine = LocalEngine(stages, max_seqs=1, max_tokens=64)
        engine.add(0)
        logits = [engine.step([(0, PROMPT)], all_logits=True)]
        for _ in range(4):
            logits.append(engine.step([(0, [int(logits[-1][-1].argmax())])]))
        outs.append(torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in logits]))
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    assert (outs[2] - outs[1]).abs().max() < 1e-5


@pytest.mark.parametrize("scheme", ["reports-mixed", "int4-experts-asym"])
def test_the_memory_plan_counts_packed_weights_at_their_size(quantized, scheme):
    """A GPU stage of a reports-mixed checkpoint is planned at what the loader keeps: its packed INT4 experts' and
    packed dense layers' words and scales (a model that fits only quantized must not be refused for its bf16
    size), the rest in the compute dtype; asymmetric INT4 experts with their zero points."""
    from shared.cluster_config import ClusterConfig, StageSpec
    from stage_worker.memory_needs import stage_needs

    qdir = quantized("qwen4_exp", scheme)[0]
    cfg = load_config(qdir)
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=2, block_size=16, dtype="float32",
                            stages=[StageSpec(0, n, "", "cuda:0")], packed_dense=True)
    planned = stage_needs(cfg, cluster)[0].weights
    model = load_model(qdir, LoadOptions(dtype=torch.float32))
    assert any(name.endswith(".weight_packed") for name, _ in model.named_buffers()) == (scheme == "reports-mixed")
    assert all(m.packed().asym == (scheme != "reports-mixed") for m in model.moe_layers().values())
    held = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "ngram_embedding" not in name
               and ".ple.ple_embedding" not in name)
    held += sum(b.numel() * b.element_size() for name, b in model.named_buffers() if ".mlp.q" in name or
                ".mlp.s" in name or name.endswith((".weight_packed", ".weight_scale")))
    assert planned == held
    dense_only = stage_needs(cfg, dataclasses.replace(cluster, packed_dense=False))[0].weights
    unpacked = stage_needs(cfg, dataclasses.replace(cluster, packed_experts=False, packed_dense=False))[0].weights
    assert planned <= dense_only < unpacked * (0.7 if scheme == "reports-mixed" else 0.8)
    assert (planned < dense_only) == (scheme == "reports-mixed")


def test_the_memory_plan_counts_fp4_weights_as_loaded(quantized):
    """An NVFP4 checkpoint's routed experts stay packed (E2M1 words and float32 scales) and its other modules are
    dequantized at load (no dense FP4 kernel), so a GPU stage is planned at what the loader holds: the experts at
    their packed size, the rest in the compute dtype whatever the dense switches say (planning those at their packed
    size would start a stage that runs out of memory while loading); with packed_experts off, all dequantized."""
    from shared.cluster_config import ClusterConfig, StageSpec
    from stage_worker.memory_needs import stage_needs

    qdir = quantized("qwen4_exp", "nvfp4")[0]
    cfg = load_config(qdir)
    cluster = ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=2, block_size=16, dtype="float32",
                            stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")], packed_dense=True,
                            packed_fp8_dense=True)
    planned = stage_needs(cfg, cluster)[0].weights
    model = load_model(qdir, LoadOptions(dtype=torch.float32))
    held = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "ngram_embedding" not in name
               and ".ple.ple_embedding" not in name)
    assert not any(name.endswith(".weight_packed") for name, _ in model.named_buffers())
    experts = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if ".mlp.q" in name or
                  ".mlp.s" in name)
    assert experts > 0 and all(m.packed().fp4 for m in model.moe_layers().values())
    assert planned == held + experts
    off = stage_needs(cfg, dataclasses.replace(cluster, packed_experts=False, packed_dense=False,
                                               packed_fp8_dense=False))[0].weights
    plain = load_model(qdir, LoadOptions(dtype=torch.float32, packed_experts=False))
    assert off == sum(p.numel() * p.element_size() for name, p in plain.named_parameters()
                      if "ngram_embedding" not in name and ".ple.ple_embedding" not in name)
    assert planned < off


def test_moepipe_serve_runs_a_quantized_checkpoint_on_two_stages(tiny_checkpoint, tmp_path):
    """The real cluster (two stage processes, the PLE service, the gateway) serves a reports-mixed checkpoint,
    INT4 experts packed in both stages, with the greedy tokens of in-process generation from the same
    files."""

    from conftest import OpenAI, free_port
    from gateway.launcher import Cluster, ServeOptions
    from shared.sampling import SamplingParams
    from stage_worker.generate import generate

    qdir = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoint, qdir, "reports-mixed")
    prompt = "def fibonacci(n):"
    solo = generate(qdir, prompt, SamplingParams(max_tokens=10, temperature=0.0))
    with Cluster(ServeOptions(model=qdir, stages=2, port=free_port())) as c:
        client = OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        res = client.completions.create(model="moepipe", prompt=prompt, max_tokens=10, temperature=0.0)
    assert res.choices[0].text == solo.text and res.usage.completion_tokens == 10


def test_a_released_multimodal_layout_with_exact_name_targets_loads(quantized, tmp_path):
    """Released Qwen3.5 checkpoints name their tensors `model.language_model.layers...`, and a quantizer that
    targets modules by exact name writes those names into the config; the loader (which maps the prefix away)
    still finds each module's scheme, packed INT4 experts included."""
    from safetensors.torch import load_file

    qdir, moved = quantized("qwen3_next", "int4-experts")[0], tmp_path / "moved"
    moved.mkdir()
    tensors = load_file(qdir / "model.safetensors")
    save_file({k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}, moved / "model.safetensors")
    config = json.loads((qdir / "config.json").read_text())
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")})
    groups = config["quantization_config"]["config_groups"]
    for g in groups.values():          # each group's regexes -> the exact released names they reach
        g["targets"] = [m.replace("model.", "model.language_model.", 1) for m in modules if _reached(m, g)]
    assert sum(len(g["targets"]) for g in groups.values()) == len(modules)
    (moved / "config.json").write_text(json.dumps(config))
    want = load_model(qdir, LoadOptions(dtype=torch.float32))
    got = load_model(moved, LoadOptions(dtype=torch.float32))
    assert all(m.packed_group for m in got.moe_layers().values())
    outs = []
    for model in (want, got):
        engine = LocalEngine([model], max_seqs=1, max_tokens=64)
        engine.add(0)
        outs.append(engine.step([(0, PROMPT)], all_logits=True))
    assert torch.equal(outs[0], outs[1])


def _reached(module: str, group: dict) -> bool:
    """Does `group` (regex targets, as moepipe quantize writes them) reach `module`?"""
    import re

    return any(re.match(t[3:], module) for t in group["targets"] if t.startswith("re:"))


def _logits_of(stages, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill PROMPT, then `steps` greedy decode steps: every step's logits and the greedy tokens."""
    engine = LocalEngine(stages, max_seqs=1, max_tokens=64)
    engine.add(0)
    logits = [engine.step([(0, PROMPT)], all_logits=True)]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(engine.step([(0, [tokens[-1]])]))
    return torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in logits]), tokens


@pytest.mark.parametrize("family", ["qwen4_exp", "qwen3_next"])
def test_dense_layers_stay_packed_and_give_the_dequantized_models_logits(family, quantized, monkeypatch):
    """A reports-mixed checkpoint keeps its plain-linear INT6/INT8 layers packed (q/k/v, o_proj, out_proj, the
    shared expert beside INT4 experts, a dense MLP, lm_head, and Qwen4-Exp's DeltaNet in-projections, which decode
    reads as one packed weight, and its INT8 hyper-connection down / up; Qwen3-Next's grouped in-projections
    dequantized) and gives the logits and greedy
    tokens of the same checkpoint with packed_dense off: prefill + 16 decode steps on the CPU path (a block of rows
    dequantized a call), the first steps also through the GEMV kernel under the interpreter, and on two stages."""
    from stage_worker.kernels import quant_gemv
    from stage_worker.kernels.quant_gemv_ref import PackedWeight
    from stage_worker.model.quant_linear import PackedLinear

    qdir = quantized(family, "reports-mixed")[0]
    packed = load_model(qdir, LoadOptions(dtype=torch.float32))
    kept = {n: m for n, m in packed.named_modules() if isinstance(m, PackedLinear)}
    cfg = packed.cfg
    want = {"lm_head"} | {f"layers.{i}.{'self_attn.o_proj' if cfg.is_attention(i) else 'linear_attn.out_proj'}"
                          for i in range(cfg.num_hidden_layers)}
    want |= {f"layers.{i}.self_attn.{p}_proj" for i in range(cfg.num_hidden_layers) if cfg.is_attention(i)
             for p in "qkv"}                                   # decode: one packed GEMV + the indexer's bf16 rows
    want |= {f"layers.{i}.mlp.{p}" for i in range(cfg.num_hidden_layers)
             for p in (("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
                       if cfg.is_sparse_moe(i) else ("gate_proj", "up_proj", "down_proj"))}
    if family == "qwen4_exp":        # one on-disk module each (Qwen3-Next's grouped qkvz / ba are regrouped)
        want |= {f"layers.{i}.linear_attn.in_proj_{p}" for i in range(cfg.num_hidden_layers)
                 if not cfg.is_attention(i) for p in ("qkv", "z", "b", "a")}
        hc = {f"layers.{i}.{m}_hyper_connection.input_mix_weight_{p}" for i in range(cfg.num_hidden_layers)
              for m in ("attn", "mlp") for p in ("down", "up")}
        want |= hc | {f"hyper_connection_mixer.input_mix_weight_{p}" for p in ("down", "up")}
    assert set(kept) == want
    eight = {n for n in kept if n == "lm_head" or n.endswith(("_down", "_up"))}
    assert {kept[n].bits for n in eight} == {8} and {m.bits for n, m in kept.items() if n not in eight} == {6}
    assert all(not hasattr(m, "weight") and m.weight_packed.dtype == torch.int32 for m in kept.values())
    layer0 = packed.layers["0"]
    if family == "qwen4_exp":
        assert isinstance(layer0.linear_attn.fuse_projections(), PackedWeight)    # decode: one packed GEMV
    else:
        assert isinstance(layer0.linear_attn.in_proj_qkv, torch.nn.Linear)      # regrouped: dequantized
    plain = load_model(qdir, LoadOptions(dtype=torch.float32, packed_dense=False))
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())

    def held(model):
        return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))

    assert held(packed) < held(plain)
    want_logits, want_tokens = _logits_of([plain], NEW)
    got, tokens = _logits_of([packed], NEW)
    assert tokens == want_tokens
    assert (got - want_logits).abs().max() < TOL
    if family == "qwen4_exp":
        n = cfg.num_hidden_layers
        halves = [load_model(qdir, LoadOptions(dtype=torch.float32, start=s, end=e)) for s, e in ((0, n // 2),
                                                                                                (n // 2, n))]
        got, tokens = _logits_of(halves, NEW)
        assert tokens == want_tokens and (got - want_logits).abs().max() < TOL
    # the kernel itself (Triton's interpreter: ~0.1 s a launch, so the prompt (14 tokens: the tl.dot path) and one
    # one-token step), with one row block a call
    monkeypatch.setattr(PackedLinear, "interpret_on_cpu", True)
    monkeypatch.setattr(quant_gemv, "CFG", {1: (512, 64, 4), 16: (512, 64, 4)})
    got, tokens = _logits_of([packed], 1)
    assert tokens == want_tokens[:1]
    assert (got - want_logits[: got.shape[0]]).abs().max() < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["nvfp4", "int4-experts-asym"])
def test_gpu_kernels_serve_fp4_and_asymmetric_experts_as_the_cpu_path(tiny_checkpoint, tmp_path, scheme):
    """On a GPU: the tiny model quantized by `moepipe quantize --scheme nvfp4` (FP4 experts kept packed, the dense
    FP4 modules dequantized at load) or `int4-experts-asym` through every fast kernel and the decode graphs stays
    as close to the float32 CPU path on the same files as the bf16 PyTorch path does (`gpu_paths`)."""
    from gpu_paths import assert_gpu_kernels_track_the_cpu

    qdir = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoint, qdir, scheme)

    def packed(gpu) -> None:
        moes = gpu.moe_layers().values()
        assert moes and all(m.packed_group and m.packed_fp4 == (scheme == "nvfp4") for m in moes)

    assert_gpu_kernels_track_the_cpu(qdir, packed)


def test_a_dummy_reports_mixed_model_packs_the_plain_linear_sites(tiny_checkpoint):
    """`bench/decode.py --quant reports-mixed` without files: `quant_linear.dummy_specs` keeps every plain-linear
    site packed as the reports' release has it (lm_head and the hyper-connection mix weights INT8 per channel, the
    rest INT6 in groups), fill_random
    gives them std-0.02 weights as it gives float ones, and the DeltaNet in-projections fuse into one packed
    weight."""
    from stage_worker.checkpoint.loader import build_empty
    from shared.ple_files import ProceduralTable
    from stage_worker.checkpoint.random_init import fill_random
    from stage_worker.kernels.quant_gemv_ref import PackedWeight
    from stage_worker.model.quant_linear import PackedLinear, dummy_specs, plain_linear_sites

    cfg = load_config(tiny_checkpoint)
    opts = LoadOptions(dtype=torch.float32)
    sites = set(plain_linear_sites(build_empty(cfg, opts), qkv=True))
    model = build_empty(cfg, opts, dense=lambda m: dummy_specs(m, torch.float32))
    fill_random(model, seed=0)
    kept = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert set(kept) == sites and any(".in_proj_qkv" in n for n in kept)
    eight = {n for n in kept if n == "lm_head" or n.endswith(("input_mix_weight_down", "input_mix_weight_up"))}
    assert "lm_head" in eight and len(eight) > 1
    assert {kept[n].bits for n in eight} == {8} and {m.bits for n, m in kept.items() if n not in eight} == {6}
    for m in kept.values():
        assert 0.015 < float(dequantize_packed(m.packed(), torch.float32).std()) < 0.025
    la = next(m for m in model.modules() if hasattr(m, "fuse_projections"))
    assert isinstance(la.fuse_projections(), PackedWeight)
    # attention: q/k/v one packed weight, the QSA indexer's bf16 rows a second GEMV, columns in the prep's order
    att = next(m for m in model.modules() if hasattr(m, "_project"))
    assert all(isinstance(m, PackedLinear) for m in (att.q_proj, att.k_proj, att.v_proj))
    assert not isinstance(att.indexer.index_qk_proj, PackedLinear)
    att.prepare_kernels()
    weight, layout = att._fused_proj()
    assert isinstance(weight, PackedWeight) and weight.out_features == sum(
        m.out_features for m in (att.q_proj, att.k_proj, att.v_proj))
    x = torch.randn(3, cfg.hidden_size)
    parts = torch.cat([m(x) for m in att._projections()], dim=-1)
    assert torch.allclose(att._project(x, weight), parts, atol=1e-5, rtol=0)
    assert layout.k_off == att.q_proj.out_features and layout.iq_off == weight.out_features
    # packed_qkv off (MOEPIPE_PACKED_QKV=0): q/k/v dequantized at load, one bf16 GEMV with the indexer's rows
    plain_qkv = build_empty(cfg, opts, dense=lambda m: dummy_specs(m, torch.float32, qkv=False))
    att = next(m for m in plain_qkv.modules() if hasattr(m, "_project"))
    assert not any(isinstance(m, PackedLinear) for m in (att.q_proj, att.k_proj, att.v_proj))
    assert any(isinstance(m, PackedLinear) for m in plain_qkv.modules())          # the rest stays packed
    fill_random(plain_qkv, seed=0)
    att.prepare_kernels()
    assert isinstance(att._fused_proj()[0], torch.Tensor)
    for layer in model.layers.values():
        if getattr(layer, "ple", None) is not None:          # as bench/decode.py does
            layer.ple.table = ProceduralTable(layer.ple.spec.padded_rows, cfg.ple_head_dim, torch.float32, 0)
    engine = LocalEngine([model], max_seqs=1, max_tokens=64)
    engine.add(0)
    assert torch.isfinite(engine.step([(0, PROMPT)])).all()


@pytest.mark.parametrize("fmt,kind", [("float-quantized", "float"), ("int-quantized", "int")])
def test_one_value_an_element_formats_load_as_the_library_decompresses(fmt, kind, originals, original_logits,
                                                                       tmp_path):
    """compressed-tensors' unpacked formats, written by the library's own compressors: FP8 weight-only per channel
    (`float-quantized`: `weight` float8 + `weight_scale`) and INT8 per channel (`int-quantized`: `weight` int8 +
    `weight_scale`). Both were refused as "weight_packed or weight_scale missing" (QA, 2026-12-05); the logits now
    equal transformers' on the library's decompression."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file

    src, qdir = originals["qwen3_next"], tmp_path / "q"
    args = QuantizationArgs(num_bits=8, type=kind, strategy="channel", symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = FloatQuantizationCompressor if kind == "float" else IntQuantizationCompressor
    out, n = {}, 0
    for k, v in load_file(src / "model.safetensors").items():
        if k.endswith("_proj.weight") and v.dim() == 2:
            scale, _ = calculate_qparams(v.amin(1, keepdim=True), v.amax(1, keepdim=True), args)
            for part, t in compressor.compress({"weight": v, "weight_scale": scale}, scheme).items():
                out[k[: -len("weight")] + part] = t.contiguous()
            n += 1
        else:
            out[k] = v
    assert n > 10
    qdir.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer"):
            (qdir / f.name).write_bytes(f.read_bytes())
    save_file(out, qdir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt,
                                  "quantization_status": "compressed", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["re:.*_proj$"],
                                                                "weights": args.model_dump(mode="json")}}}
    (qdir / "config.json").write_text(json.dumps(cfg))
    with safe_open(qdir / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.0.down_proj.weight").get_dtype() == \
            ("F8_E4M3" if kind == "float" else "I8")
    _decompress_with_the_library(qdir, tmp_path / "dense")
    want = torch.log_softmax(reference_logits(_reference(tmp_path / "dense"), PROMPT), -1)
    model = load_model(qdir, LoadOptions(dtype=torch.float32))
    engine = LocalEngine([model], max_seqs=1, max_tokens=64)
    engine.add(0)
    got = torch.log_softmax(engine.step([(0, PROMPT)], all_logits=True), -1)
    assert (got - want).abs().max() < TOL
    orig = original_logits("qwen3_next")
    assert (torch.log_softmax(orig, -1) - want).abs().max() > 1e-4         # the quantization is real
