"""GPTQ checkpoints (GPTQModel / AutoGPTQ `quant_method: gptq`, AutoRound's GPTQ packings `quant_method: auto-round`)
load as the files say (shared/gptq_files.py shows their tensors under compressed-tensors' names).

The files here are written by this test's own GPTQ writer, as those libraries lay them out: per module `qweight`
int32 [in*b/32, out] (each column's values a little-endian bit stream along the inputs), `qzeros` int32
[groups, out*b/32] (the same along the outputs; v1 files store z - 1, GPTQModel's by whole words with borrows), `scales` float16 [groups, out], `g_idx`
int32 [in], routed experts as per-expert modules (as every published GPTQ release of this family has them). The
writer builds each column's bit stream as one Python integer, independently of the loader's vectorised reader; the
reader's packing agrees bit for bit with AutoRound's own `pack_bitstream` for 2-8 bits (checked once by hand,
docs/model.md). The oracle is transformers on the float weights the GPTQ libraries compute, s * (q - z) in the
scale's dtype: prefill and greedy decode, float32 on the CPU, within 1e-4.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import OpenAI, free_port
from hf_oracle import reference_logits, save_reference
from shared.checkpoint_files import CheckpointError, tensor_headers
from shared.gptq_files import pack_fields, unpack_fields
from shared.quant_scheme import QuantSchemeError, parse, refusal
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.checkpoint.quantize import _split_fused
from stage_worker.local_engine import LocalEngine
from stage_worker.model.quant_linear import PackedLinear

PROMPT = [40, 7, 200, 13, 5, 99, 101, 250, 3, 17, 88, 61, 120, 300]
STEPS = 8
TOL = 1e-4
# what the published releases quantize: routed experts always; attention, DeltaNet and the shared expert in some
QUANTIZED = re.compile(r"\.(mlp\.experts\.\d+\.(gate|up|down)_proj|self_attn\.[qkvo]_proj|"
                       r"linear_attn\.(in_proj_\w+|out_proj)|mlp\.shared_expert\.(gate|up|down)_proj)$")


def _stream_words(values: list[int], bits: int) -> list[int]:
    """Unsigned values as one little-endian bit stream (value i at bit i*bits), cut into int32 words."""
    n = 0
    for i, v in enumerate(values):
        n |= int(v) << (i * bits)
    words = len(values) * bits // 32
    out = [(n >> (32 * w)) & 0xFFFFFFFF for w in range(words)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in out]


def _pack_columns(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, cols] unsigned -> int32 [n*bits/32, cols], each column its own stream (GPTQ's qweight; qzeros with
    the roles of rows and columns swapped)."""
    cols = [_stream_words(q[:, c].tolist(), bits) for c in range(q.shape[1])]
    return torch.tensor(cols, dtype=torch.int32).t().contiguous()


def _quantize(w: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool, g: torch.Generator):
    """RTN quantization of a float weight [out, in] as GPTQ stores it: (q [in, out] unsigned, z [groups, out],
    s float16 [groups, out], g_idx [in], the float weight the libraries compute from them)."""
    out_f, in_f = w.shape
    size = in_f if group == -1 else group
    order = torch.randperm(in_f, generator=g) if act_order else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_f) // size).to(torch.int32)
    groups = in_f // size
    maxq = (1 << bits) - 1
    q = torch.empty(in_f, out_f, dtype=torch.int64)
    z = torch.empty(groups, out_f, dtype=torch.int64)
    s = torch.empty(groups, out_f, dtype=torch.float16)
    for gi in range(groups):
        cols = (g_idx == gi).nonzero().flatten()
        blk = w[:, cols].double()                                   # [out, size]
        if gi == 0 and not sym:
            blk[0] = blk[0].abs()       # a row of non-negative weights: zero point 0 (a v1 file stores it as -1)
        lo, hi = blk.min(1).values.clamp(max=0), blk.max(1).values.clamp(min=0)
        if sym:
            scale = torch.maximum(lo.abs(), hi) * 2 / maxq
            zero = torch.full_like(scale, (maxq + 1) // 2)
        else:
            scale = (hi - lo) / maxq
            zero = torch.round(-lo / scale.clamp(min=1e-12)).clamp(0, maxq)
        scale = scale.clamp(min=1e-6).half()
        s[gi], z[gi] = scale, zero.long()
        q[cols] = torch.clamp(torch.round(blk / scale.double()[:, None]) + zero[:, None], 0, maxq).long().t()
    w_hat = (s[g_idx.long()] * (q - z[g_idx.long()]).half()).t().float()       # in the scale's dtype, as they do
    return q, z, s, g_idx, w_hat


def _per_module(tensors: dict[str, torch.Tensor]):
    """(module, 2-D weight) pairs, transformers' fused 3-D experts as per-expert modules (`moepipe quantize`'s
    split)."""
    for name, t in tensors.items():
        if (name.endswith(".weight") and t.dim() == 2) or \
                (t.dim() == 3 and name.endswith((".experts.gate_up_proj", ".experts.down_proj"))):
            yield from _split_fused(name, t)


def _pack_awq_rows(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM layout: each row's 4-bit values, every 8 columns stored in the order 0 2 4 6 1 3 5 7, as one
    bit stream: [rows, cols] -> int32 [rows, cols/8]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    rows = []
    for row in q.tolist():
        stored = [row[b + order[p]] for b in range(0, len(row), 8) for p in range(8)]
        rows.append(_stream_words(stored, 4))
    return torch.tensor(rows, dtype=torch.int32)


def write_gptq(src: Path, dst: Path, qconfig: dict, bits_of, sym: bool, act_order: bool, group: int,
               v1: bool = True, seed: int = 0, awq: bool = False) -> Path:
    """A GPTQ checkpoint of the transformers checkpoint `src` in `dst`, and its float reference (the dequantized
    weights in transformers' own layout) in `dst`.ref: the modules QUANTIZED selects whose `bits_of(module)` is
    not None, at that width."""
    g = torch.Generator().manual_seed(seed)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    ref = dict(tensors)
    out = {k: v for k, v in tensors.items()                  # norms, A_log, conv, PLE tables: as they are
           if not ((k.endswith(".weight") and v.dim() == 2) or v.dim() == 3 and ".experts." in k)}
    hat: dict[str, torch.Tensor] = {}
    for module, w in _per_module(tensors):
        bits = bits_of(module) if QUANTIZED.search(module) else None
        out_f, in_f = w.shape
        if bits is None or in_f % (in_f if group == -1 else group) or (in_f * bits) % 32 or (out_f * bits) % 32:
            out[f"{module}.weight"] = w.contiguous()     # float (also what the quantizers skip: no whole words)
            continue
        q, z, s, g_idx, w_hat = _quantize(w, bits, group, sym, act_order, g)
        hat[module] = w_hat
        out[f"{module}.scales"] = s
        if awq:                              # AutoAWQ: along the outputs, interleaved; zero points as they are
            out[f"{module}.qweight"], out[f"{module}.qzeros"] = _pack_awq_rows(q), _pack_awq_rows(z)
            continue
        out[f"{module}.qweight"] = _pack_columns(q, bits)
        if v1 and qconfig.get("quant_method") == "gptq" and 32 % bits == 0:
            # GPTQModel saves v1 as its v2 words minus 0x11111111 (4 bits), whole words: a zero of 0 borrows
            const = sum(1 << (i * bits) for i in range(32 // bits))
            words = [[((w & 0xFFFFFFFF) - const) & 0xFFFFFFFF for w in row]
                     for row in _pack_columns(z.t(), bits).t().tolist()]
            out[f"{module}.qzeros"] = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row]
                                                    for row in words], dtype=torch.int32)
        else:                           # v1 field by field (AutoRound's packing, 3 and 5-7 bits), or v2
            stored_z = (z - 1) & ((1 << bits) - 1) if v1 else z
            out[f"{module}.qzeros"] = _pack_columns(stored_z.t(), bits).t().contiguous()
        out[f"{module}.g_idx"] = g_idx
    for name in list(ref):
        base = name.rsplit(".", 1)[0]
        if name.endswith(".experts.gate_up_proj"):
            E = ref[name].shape[0]
            rows = [torch.cat([hat.get(f"{base}.{e}.gate_proj", ref[name][e].chunk(2)[0]),
                               hat.get(f"{base}.{e}.up_proj", ref[name][e].chunk(2)[1])]) for e in range(E)]
            ref[name] = torch.stack(rows)
        elif name.endswith(".experts.down_proj"):
            ref[name] = torch.stack([hat.get(f"{base}.{e}.down_proj", ref[name][e]) for e in range(ref[name].shape[0])])
        elif name.endswith(".weight") and base in hat:
            ref[name] = hat[base]
    config = json.loads((src / "config.json").read_text())
    for where, tensors_, cfg in ((dst, out, {**config, "quantization_config": qconfig}), (Path(f"{dst}.ref"), ref,
                                                                                         config)):
        where.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors_.items()}, where / "model.safetensors",
                  metadata={"format": "pt"})
        (where / "config.json").write_text(json.dumps(cfg))
        for extra in src.iterdir():                      # the tokenizer and generation config, if any
            if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
                shutil.copy(extra, where / extra.name)
    return dst


def _gptq_config(bits=4, group=16, sym=True, desc_act=False, **extra) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq", **extra}


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", experts_implementation="eager",
                                                dtype=torch.float32).eval()


def _oracle(qdir: Path) -> tuple[list[int], torch.Tensor]:
    """transformers on `qdir`.ref: PROMPT and STEPS greedy tokens, and the log-probabilities after each."""
    ref = _reference(Path(f"{qdir}.ref"))
    ids = list(PROMPT)
    for _ in range(STEPS):
        ids.append(int(reference_logits(ref, ids)[-1].argmax()))
    return ids, torch.log_softmax(reference_logits(ref, ids), -1)


def _check_against_reference(qdir: Path, stages_of, oracle: tuple[list[int], torch.Tensor] | None = None) -> list:
    """moepipe's log-probabilities of PROMPT and STEPS greedy tokens against transformers on `qdir`.ref (`oracle`:
    `_oracle(qdir)` already computed, for a second layout of the same files)."""
    ids, want = oracle or _oracle(qdir)
    stages = stages_of(qdir)
    engine = LocalEngine(stages, max_seqs=1, max_tokens=64)
    engine.add(0)
    logits = engine.step([(0, PROMPT)], all_logits=True)
    assert (torch.log_softmax(logits, -1) - want[: len(PROMPT)]).abs().max() < TOL
    got = []
    for i in range(STEPS):
        got.append(int(logits[-1].argmax()))
        logits = engine.step([(0, [got[-1]])])
        if i < STEPS - 1:
            assert (torch.log_softmax(logits[-1], -1) - want[len(PROMPT) + i]).abs().max() < TOL, i
    assert got == ids[len(PROMPT):]
    return stages


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, family in enumerate(("qwen3_next", "qwen4_exp", "qwen3_5_moe")):
        path = tmp_path_factory.mktemp(family)
        save_reference(family, path, seed=10 + i)
        out[family] = path
    return out


@pytest.mark.parametrize("bits", range(2, 9))
def test_the_reader_unpacks_the_writers_bit_streams(bits):
    g = torch.Generator().manual_seed(bits)
    v = torch.randint(0, 1 << bits, (64, 5), generator=g)
    words = _pack_columns(v, bits)                                # along the rows, as qweight
    assert torch.equal(unpack_fields(words.t().contiguous(), bits).t(), v)
    assert torch.equal(pack_fields(v.t(), bits), words.t())


def _packed_kernels_match_their_reference(moe) -> None:
    """The INT4 decode kernels (the interpreter on the CPU) and the grouped prefill kernels on a loaded layer's
    experts, against the dequantize-then-matmul reference."""
    from stage_worker.kernels.moe_int4 import fused_moe_int4
    from stage_worker.kernels.moe_int4_prefill import grouped_moe_int4_triton
    from stage_worker.kernels.moe_int4_ref import fused_moe_int4_ref

    ex = moe.packed()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, ex.shape[1], generator=g)
    ids, w = torch.tensor([[0, 3, 5], [1, 2, 7]], dtype=torch.int32), torch.rand(2, 3, generator=g)
    ref = fused_moe_int4_ref(x, ids, w, ex)
    assert torch.allclose(fused_moe_int4(x, ids, w, ex), ref, atol=1e-4)
    assert torch.allclose(grouped_moe_int4_triton(x, ids, w, ex), ref, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp"])
def test_a_symmetric_int4_release_loads_with_its_experts_packed(family, originals, tmp_path):
    """The published shape (GPTQModel v1 files, INT4 symmetric, groups of 16 here, desc_act off): the routed
    experts stay in their words and scales for the INT4 kernels, dense modules as the config groups allow, and
    the logits are transformers' on the dequantized weights; on two stages too."""
    qdir = write_gptq(originals[family], tmp_path / "q", _gptq_config(), lambda m: 4, sym=True, act_order=False,
                      group=16)
    assert refusal(qdir) is None
    headers = tensor_headers(qdir)
    name = "model.layers.0.mlp.experts.0.down_proj"
    assert headers[f"{name}.weight_packed"][0] == (32, 2) and f"{name}.weight_zero_point" not in headers
    assert f"{name}.qweight" not in headers and f"{name}.weight_g_idx" not in headers
    n = json.loads((qdir / "config.json").read_text())["num_hidden_layers"]
    oracle = _oracle(qdir)                      # one transformers run for the whole model and the two stages
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))], oracle)
    moes = stages[0].moe_layers()
    assert moes and all(m.packed_group == 16 and m.q13.dtype == torch.int32 for m in moes.values())
    kept = [n for n, m in stages[0].named_modules() if isinstance(m, PackedLinear)]
    assert any(n.endswith("o_proj") for n in kept) and any("shared_expert" in n for n in kept), kept
    if family == "qwen4_exp":      # the INT4 kernels (interpreter on the CPU) read the float16 scales
        assert next(iter(moes.values())).packed().s13.dtype == torch.float16
        _packed_kernels_match_their_reference(next(iter(moes.values())))
    _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32, start=s, end=e))
                                              for s, e in ((0, n // 2), (n // 2, n))], oracle)


def test_asymmetric_activation_ordered_and_overridden_modules_load(originals, tmp_path):
    """sym off, desc_act on (g_idx a permutation's groups), GPTQModel `dynamic` overrides: down projections at
    8 bits, the shared expert skipped (float on disk); v1 zero points, some of them 0 (stored as -1), saved as
    GPTQModel saves them, whole words minus 0x11111111: the neighbour of a zero of 0 borrows, and is read back with
    the carry (field by field it read one too low: tools/qa_gptq_fuzz.py's oracle missed it, the writer packed
    field by field; found reading GPTQModel's convert_gptq_v2_to_v1_format_module)."""
    dynamic = {r"+:.*down_proj$": {"bits": 8}, r"-:.*shared_expert\..*": {}}
    cfg = _gptq_config(sym=False, desc_act=True, dynamic=dynamic)
    bits_of = lambda m: None if "shared_expert." in m else 8 if m.endswith("down_proj") else 4  # noqa: E731
    qdir = write_gptq(originals["qwen4_exp"], tmp_path / "q", cfg, bits_of, sym=False, act_order=True, group=16)
    with safe_open(qdir / "model.safetensors", "pt") as f:
        zeros = f.get_tensor("model.layers.0.mlp.experts.1.up_proj.qzeros")
    assert bool((unpack_fields(zeros, 4) == 15).any())              # a zero point of 0, stored as -1
    headers = tensor_headers(qdir)
    assert "model.layers.0.mlp.experts.1.up_proj.weight_g_idx" in headers
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in headers
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
    assert not any(m.packed_group for m in stages[0].moe_layers().values())     # activation order: dequantized


def test_asymmetric_int4_experts_stay_packed_with_their_zero_points(originals, tmp_path):
    """sym off, desc_act off (GPTQModel v1 files, zero points of 0 among them, stored as -1): the routed experts stay
    in their words, with the zero points beside the scales (a quarter of the bytes dequantizing at load took), and
    the logits are transformers' on the dequantized weights; on two stages too; the kernels read the zero points."""
    qdir = write_gptq(originals["qwen4_exp"], tmp_path / "q", _gptq_config(sym=False), lambda m: 4, sym=False,
                      act_order=False, group=16)
    n = json.loads((qdir / "config.json").read_text())["num_hidden_layers"]
    oracle = _oracle(qdir)                      # one transformers run for the whole model and the two stages
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))], oracle)
    moes = stages[0].moe_layers()
    assert moes and all(m.packed_group == 16 and m.packed().asym for m in moes.values())
    ex = next(iter(moes.values())).packed()
    zeros = torch.cat([ex.s13[..., ex.s13.shape[-1] // 2:].flatten(), ex.s2[..., ex.s2.shape[-1] // 2:].flatten()])
    assert zeros.min() >= -8 and zeros.max() <= 7 and len(zeros.unique()) > 4 and torch.equal(zeros, zeros.round())
    _packed_kernels_match_their_reference(next(iter(moes.values())))
    _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32, start=s, end=e))
                                              for s, e in ((0, n // 2), (n // 2, n))], oracle)


def _shard(qdir: Path, second: set[str]) -> None:
    """Rewrite `qdir` as two files with an index, the tensors in `second` in the second one."""
    from safetensors.torch import load_file

    tensors = load_file(qdir / "model.safetensors")
    (qdir / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in second},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k in second}}
    for name, part in files.items():
        save_file(part, qdir / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, part in files.items() for k in part}}
    (qdir / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_module_split_across_two_files_of_a_sharded_checkpoint_loads(originals, tmp_path):
    """A sharded checkpoint may cut between one module's tensors (qweight in one file, qzeros, scales and g_idx in
    the next): the module is read whole, and its hidden zero points are checked from the other file."""
    from safetensors.torch import load_file

    one = "model.layers.0.mlp.experts.2.up_proj"
    qdir = write_gptq(originals["qwen3_next"], tmp_path / "q", _gptq_config(), lambda m: 4, sym=True,
                      act_order=False, group=16)
    _shard(qdir, {f"{one}.qzeros", f"{one}.scales", f"{one}.g_idx", "model.norm.weight"})
    _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
    second = qdir / "model-00002-of-00002.safetensors"
    tensors = load_file(second)
    tensors[f"{one}.qzeros"] = torch.full_like(tensors[f"{one}.qzeros"], 0x55555555)     # zero points 6, not 8
    save_file(tensors, second, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{one}.qzeros: the config says sym")):
        load_model(qdir, LoadOptions(dtype=torch.float32))


def test_an_autogptq_quantize_config_json_is_read(originals, tmp_path):
    """Older GPTQ releases keep their scheme in quantize_config.json (no quant_method; `groupsize`), not in
    config.json: read as vLLM reads it, and `--quantization gptq` is then the checkpoint's own scheme."""
    from gateway.cli import _quant_method

    qdir = write_gptq(originals["qwen3_next"], tmp_path / "q", _gptq_config(), lambda m: 4, sym=True,
                      act_order=False, group=16)
    cfg = json.loads((qdir / "config.json").read_text())
    q = cfg.pop("quantization_config")
    (qdir / "config.json").write_text(json.dumps(cfg))
    (qdir / "quantize_config.json").write_text(json.dumps({"bits": 4, "groupsize": 16, "sym": True,
                                                           "desc_act": False}))
    assert q["quant_method"] == _quant_method(qdir) == "gptq"
    _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])


def test_auto_round_packings_load(originals, tmp_path):
    """AutoRound's config: `packing_format` auto_round (zero points as they are: v2), `extra_config` leaving a
    module in float (16 bits); Qwen3.5-MoE."""
    extra = {"model.layers.0.linear_attn.out_proj": {"bits": 16}}
    cfg = {"quant_method": "auto-round", "bits": 4, "group_size": 16, "sym": True, "data_type": "int",
           "packing_format": "auto_round", "extra_config": extra}
    bits_of = lambda m: None if m.endswith("layers.0.linear_attn.out_proj") else 4    # noqa: E731
    qdir = write_gptq(originals["qwen3_5_moe"], tmp_path / "q", cfg, bits_of, sym=True, act_order=False, group=16,
                      v1=False)
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
    assert all(m.packed_group == 16 for m in stages[0].moe_layers().values())


def test_released_multimodal_names_and_their_overrides_load(originals, tmp_path):
    """Released Qwen3.5 checkpoints name their tensors `model.language_model.layers...`, and AutoRound's
    `extra_config` / GPTQModel's `dynamic` name modules so: an override written with the released name (8 bits for
    one module) takes effect for the files' plain and released names alike, with transformers' logits."""
    from safetensors.torch import load_file

    one = "model.layers.0.linear_attn.out_proj"
    released = one.replace("model.", "model.language_model.", 1)
    bits_of = lambda m: 8 if m.endswith(one) else 4          # noqa: E731
    for i, (how, extra) in enumerate((("extra_config", {released: {"bits": 8}}),
                                      ("dynamic", {"+:" + re.escape(released): {"bits": 8}}))):
        cfg = {**_gptq_config(), how: extra}
        if how == "extra_config":
            cfg.update(quant_method="auto-round", packing_format="auto_round:auto_gptq")
        qdir = write_gptq(originals["qwen3_5_moe"], tmp_path / f"q{i}", cfg, bits_of, sym=True, act_order=False,
                          group=16)
        moved = tmp_path / f"moved{i}"
        moved.mkdir()
        tensors = load_file(qdir / "model.safetensors")
        assert tensors[f"{one}.qweight"].shape[0] == 8              # 32 inputs at 8 bits: 8 words (4 at 4 bits)
        save_file({k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                   for k, v in tensors.items()}, moved / "model.safetensors")
        shutil.copy(qdir / "config.json", moved / "config.json")
        assert refusal(moved) is None
        stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
        outs = []
        for model in (stages[0], load_model(moved, LoadOptions(dtype=torch.float32))):
            engine = LocalEngine([model], max_seqs=1, max_tokens=64)
            engine.add(0)
            outs.append(engine.step([(0, PROMPT)], all_logits=True))
        assert torch.equal(outs[0], outs[1])


def test_dynamic_overrides_decide_in_order_and_may_reach_float_modules(originals, tmp_path):
    """GPTQModel's `dynamic`: the first pattern in the config's order that matches a module decides it (its
    dynamic_get; a `-:` after a matching `+:` does not skip), and a regex such as `.*gate.*` reaches the router and
    shared_expert_gate, which GPTQModel leaves in float. `.*\\.1\\..*` reaches `experts.1.` of every layer, so a
    layer's experts hold two widths (dequantized at load). Found by tools/qa_gptq_fuzz.py (seeds 3901-3906): the
    plan put skips first and took regexes alphabetically, the metadata check refused the float router, and the
    packed-expert path read every expert with expert 0's scheme."""
    dynamic = {r"+:.*\.1\..*": {"bits": 8}, r"-:.*shared_expert\..*": {}, r".*gate.*": {"bits": 4}}

    def bits_of(m):
        if re.match(r".*\.1\..*", m):
            return 8
        return None if re.match(r".*shared_expert\..*", m) else 4

    qdir = write_gptq(originals["qwen4_exp"], tmp_path / "q", _gptq_config(dynamic=dynamic), bits_of, sym=True,
                      act_order=False, group=16)
    headers = tensor_headers(qdir)
    assert "model.layers.1.mlp.shared_expert.up_proj.weight_packed" in headers
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in headers and "model.layers.0.mlp.gate.weight" in headers
    assert refusal(qdir) is None
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
    assert not any(m.packed_group for m in stages[0].moe_layers().values())     # experts.1: 8 bits, the rest 4


def test_released_files_with_overrides_written_on_plain_names_load(originals, tmp_path):
    """Files named `model.language_model.layers...` and AutoRound's `extra_config` keyed by the plain names (a module
    at 8 bits, one routed expert left in float beside its packed neighbours): the metadata check decides each
    module as the loader does, and the layer with the float expert is dequantized, not read as all packed. Found
    by tools/qa_gptq_fuzz.py (seeds 3902, 3905)."""
    from safetensors.torch import load_file

    one, expert = "model.layers.0.linear_attn.out_proj", "model.layers.2.mlp.experts.2.up_proj"
    cfg = {"quant_method": "auto-round", "bits": 4, "group_size": 16, "sym": True, "data_type": "int",
           "packing_format": "auto_round", "extra_config": {one: {"bits": 8}, expert: {"bits": 16}}}
    bits_of = lambda m: None if m == expert else 8 if m == one else 4        # noqa: E731
    qdir = write_gptq(originals["qwen3_5_moe"], tmp_path / "q", cfg, bits_of, sym=True, act_order=False, group=16,
                      v1=False)
    tensors = load_file(qdir / "model.safetensors")
    save_file({k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}, qdir / "model.safetensors", metadata={"format": "pt"})
    assert refusal(qdir) is None
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
    assert not stages[0].moe_layers()[2].packed_group and stages[0].moe_layers()[0].packed_group == 16


@pytest.mark.parametrize("how", ["awq", "auto-round"])
def test_autoawq_gemm_files_load(how, originals, tmp_path):
    """AutoAWQ's GEMM layout (`quant_method: awq`, or AutoRound's auto_round:auto_awq packing): 4-bit values along
    the outputs in its interleaved column order, zero points as stored, repacked at load."""
    cfg = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": ["mlp.gate"]} if how == "awq" else \
        {"quant_method": "auto-round", "bits": 4, "group_size": 16, "sym": False, "packing_format": "auto_round:auto_awq"}
    qdir = write_gptq(originals["qwen3_next"], tmp_path / "q", cfg, lambda m: 4, sym=False, act_order=False,
                      group=16, awq=True)
    headers = tensor_headers(qdir)
    name = "model.layers.0.mlp.experts.0.down_proj"
    assert headers[f"{name}.weight_packed"][0] == (32, 2) and headers[f"{name}.weight_zero_point"][0] == (4, 1)
    stages = _check_against_reference(qdir, lambda d: [load_model(d, LoadOptions(dtype=torch.float32))])
    assert all(m.packed_group == 16 and m.packed().asym for m in stages[0].moe_layers().values())   # kept packed


@pytest.mark.parametrize("change,words", [
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"bits": 16}, "bits 16 is not supported"),
    ({"group_size": 0}, "group_size 0 is not supported"),
    ({"quant_method": "auto-round", "packing_format": "auto_round:mlx"}, "packing_format 'auto_round:mlx'"),
    ({"quant_method": "auto-round", "data_type": "mx_fp"}, "data_type 'mx_fp' is not supported"),
    ({"quant_method": "auto-round", "act_bits": 8}, "act_bits 8"),
    ({"pack_dtype": "int16"}, "pack_dtype 'int16' is not supported"),
    ({"is_marlin_format": True}, "is_marlin_format"),
    ({"quant_method": "awq", "version": "gemv"}, "version 'gemv' is not supported"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point false"),
    ({"quant_method": "awq", "bits": 8}, "bits 8 in AWQ's layout"),
    ({"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
])
def test_schemes_moepipe_cannot_run_are_refused_by_name(change, words):
    with pytest.raises(QuantSchemeError, match=re.escape(words)):
        parse({"quantization_config": {**_gptq_config(), **change}})


def test_the_libraries_config_spellings_parse():
    """What GPTQModel, AutoGPTQ and AutoRound releases write: `format` for checkpoint_format, v2 files, AutoRound
    before 0.4 (`intel/auto-round`, no packing_format: v1, as AutoRound reads it), channel-wise scales."""
    v2 = parse({"quantization_config": {**_gptq_config(), "checkpoint_format": None, "format": "gptq_v2"}})
    old = parse({"quantization_config": {"quant_method": "intel/auto-round", "bits": 4, "group_size": 128,
                                         "sym": True, "data_type": "int", "backend": "auto_round:gptq:exllamav2"}})
    row = parse({"quantization_config": _gptq_config(bits=8, group=-1)})
    assert (v2.zero_offset, old.zero_offset, v2.layout, old.layout) == (0, 1, "gptq", "gptq")
    assert row.for_module("model.layers.0.self_attn.o_proj").strategy == "channel"


def test_files_that_contradict_sym_or_desc_act_are_refused_naming_the_tensor(originals, tmp_path):
    """A config saying sym over asymmetric zero points (or desc_act off over activation-ordered groups) would
    load wrong weights silently: the load stops naming the tensor and the config key to fix."""
    for i, (sym, act_order, words) in enumerate(((False, False, "the config says sym"),
                                                  (True, True, "desc_act: false"))):
        qdir = write_gptq(originals["qwen3_next"], tmp_path / f"q{i}", _gptq_config(), lambda m: 4, sym=sym,
                          act_order=act_order, group=16)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: .*(qzeros|g_idx).*" + re.escape(words)):
            load_model(qdir, LoadOptions(dtype=torch.float32))


def test_moepipe_serve_answers_from_a_gptq_checkpoint(tiny_checkpoint, tmp_path):
    """The real cluster (launcher, gateway, two stage workers, the PLE service reading the same files) serves a
    GPTQ checkpoint of the tiny model with the greedy text of in-process generation from the same files."""
    from gateway.launcher import Cluster, ServeOptions
    from shared.sampling import SamplingParams
    from stage_worker.generate import generate

    qdir = write_gptq(tiny_checkpoint, tmp_path / "q", _gptq_config(), lambda m: 4, sym=True, act_order=False,
                      group=16)
    prompt = "def fibonacci(n):"
    solo = generate(qdir, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    with Cluster(ServeOptions(model=qdir, stages=2, port=free_port())) as c:
        client = OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        res = client.completions.create(model="moepipe", prompt=prompt, max_tokens=8, temperature=0.0)
    assert res.choices[0].text == solo.text and res.usage.completion_tokens == 8


@pytest.mark.gpu
@pytest.mark.parametrize("sym", [True, False])
def test_gpu_kernels_serve_a_gptq_checkpoint_as_the_cpu_path(tiny_checkpoint, tmp_path, sym):
    """On a GPU: an INT4 GPTQ checkpoint (float16 scales, groups of 32; symmetric, and asymmetric: zero points in
    the INT4 expert kernels) through every fast kernel (a 600-token prompt: the INT4 experts' grouped prefill
    kernel) and the decode graphs, teacher-forced over 32 steps, stays as close to the float32 CPU path on the same
    files as the bf16 PyTorch path does (the INT4 expert kernels and the packed dense GEMVs read GPTQ's scales)."""
    from gpu_paths import assert_gpu_kernels_track_the_cpu

    qdir = write_gptq(tiny_checkpoint, tmp_path / "q", _gptq_config(group=32, sym=sym), lambda m: 4, sym=sym,
                      act_order=False, group=32)

    def packed(gpu) -> None:
        assert all(m.packed_group == 32 and m.packed().asym != sym for m in gpu.moe_layers().values())

    assert_gpu_kernels_track_the_cpu(qdir, packed)
