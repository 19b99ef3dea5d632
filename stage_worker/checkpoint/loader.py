"""Load a checkpoint directory into one stage's `StageModel`, streaming tensor by tensor.

The model is first built on the `meta` device and then given real, uninitialised storage on its final device;
each on-disk tensor is read once and copied into place, so the weights never exist twice in memory (a report's
start-up took 27 minutes until a closure stopped holding a second copy).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.checkpoint_files import CheckpointError, checkpoint_files, normalise, open_safetensors, tensor_headers
from shared.kv_layout import compute_dtype
from shared.model_config import HybridMoeConfig, load_config
from shared.ngram_hash import NgramHashSpec
from shared.ple_files import Shards, dummy_layer_table, open_ple_table, ple_shard
from shared.quant_scheme import QuantPlan, QuantSchemeError, plan_of
from shared.quant_scheme import refusal as quant_refusal
from stage_worker.checkpoint.names import PLE_BUFFER, Piece, hf_name, pieces_for
from stage_worker.checkpoint.packed_experts import PackedPlacer, expert_tensors, fp8_layers, packed_layers
from stage_worker.checkpoint.random_init import fill_random
from stage_worker.expert_offload import attach_tables, fill_random_tables, loader_targets, order_gates
from stage_worker.checkpoint.dense_placers import Fp8DensePlacer, PackedDensePlacer
from stage_worker.model.fp8_linear import fp8_sites, fp8_specs, use_fp8_dense
from stage_worker.model.meta_build import on_meta
from stage_worker.model.model import StageModel
from stage_worker.model.quant_linear import (PackedSpec, dummy_specs, packed_specs, plain_linear_sites,
                                              use_packed_dense)
from stage_worker.model.quant_weight import QUANT_PARTS, dequantize, needed
from stage_worker.model.rope import Rotary

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadOptions:
    start: int = 0
    end: int | None = None
    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None          # default: `default_dtype` (the config's; float32 for half on a CPU)
    load_format: str = "safetensors"          # or "dummy": seeded random weights, no file reads
    with_mtp: bool = False
    seed: int = 0
    cold_experts: dict[int, list[int]] | None = None   # MoE layer -> experts kept in host RAM (issue 16)
    expert_vmm_table: bool = False            # ... each table part one VRAM + host range (expert_offload.py)
    expert_move_async: bool = False           # ... a spare slot per tier and a slot map: moves off the forward
    expert_move_claims: int = 1               # ... C claims a layer a step: 2C spare slots (expert_move_claims)
    expert_prefetch: int = 0                  # ... P prefetch slots a table, a layer ahead (expert_prefetch)
    expert_prefetch_top: int = 0              # ... from each token's best this many predictions (0: top-k)
    expert_prefetch_min_batch: int = 1        # ... at decode steps of at least this many tokens
    packed_experts: bool = True               # INT4 / FP4 checkpoints' routed experts stay packed (packed_experts.py)
    packed_dense: bool = True                 # INT4/6/8 plain-linear weights stay packed (model/quant_linear.py)
    packed_qkv: bool = True                   # ... attention's q/k/v among them (else dequantized at load)
    packed_fp8_experts: bool = False          # block-FP8 checkpoints' routed experts stay float8 (packed_experts.py)
    packed_fp8_dense: bool = False            # ... and their plain-linear dense weights (model/fp8_linear.py)
    dummy_int4: tuple[int, int] | None = None  # "dummy" format: routed experts as INT4 kept packed, these groups
    #                                            (gate/up, down), random words as fill_random makes them (benchmarks)
    dummy_dense: bool = False                 # "dummy" format: plain-linear layers packed as the reports' release
    #                                            (quant_linear.dummy_specs), random words (benchmarks)
    dummy_ple_file: bool = False              # "dummy" format: PLE tables written to files beside the model, mapped


# RoPE tables some exporters wrote as tensors (older transformers saved `rotary_emb.inv_freq` buffers): computed from
# the config here, and ignored by transformers and vLLM alike, so not an unexpected tensor
_ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def default_dtype(cfg: HybridMoeConfig, device: str | torch.device) -> torch.dtype:
    """The checkpoint's dtype, except that a CPU computes half-precision checkpoints in float32 (the rule lives in
    `shared.kv_layout.compute_dtype`: the KV budget is sized in it). `dtype` in the cluster config (MOEPIPE_DTYPE)
    overrides it."""
    return DTYPES[compute_dtype(cfg, torch.device(device).type)]


def build_empty(cfg: HybridMoeConfig, opts: LoadOptions,
                packed: dict[int, tuple] | None = None, dense=None,
                fp8: dict[int, tuple[int, int]] | None = None, fp8_dense=None,
                scale_dtypes: dict[int, torch.dtype] | None = None) -> StageModel:
    """The stage's model with uninitialised storage; `packed`: MoE layer -> `SparseMoE.use_packed`'s groups (and
    asym, fp4) of experts kept packed (`scale_dtypes`: layer -> the checkpoint's dtype of their scales, default the
    compute dtype);
    `dense(model)`: the Linear modules kept packed (PackedLinear) -> their PackedSpec; `fp8`: MoE layer -> scale
    block of experts kept float8; `fp8_dense(model)`: the Linear modules kept float8 (Fp8Linear) -> their block."""
    dtype = opts.dtype or default_dtype(cfg, opts.device)
    with on_meta():
        model = StageModel(cfg, opts.start, opts.end, with_mtp=opts.with_mtp)
    model = model.to(dtype)
    for layer, moe in model.moe_layers().items():
        if layer in (packed or {}):
            moe.use_packed(*packed[layer], scale_dtype=(scale_dtypes or {}).get(layer))
        elif layer in (fp8 or {}):
            moe.use_fp8(fp8[layer])
    if dense is not None:
        use_packed_dense(model, dense(model))    # words and scales, allocated with everything else below
    if fp8_dense is not None:
        use_fp8_dense(model, fp8_dense(model))   # float8 bytes and block scales, likewise
    # cold experts: tables in host RAM and hot rows on the device, allocated at their sizes before anything else
    # (INT4 experts kept packed: their words and scales, at the packed size; float8 experts: bytes and block scales)
    model.experts = attach_tables(model, opts.cold_experts, opts.device, vmm=opts.expert_vmm_table,
                                  spares=opts.expert_move_async, claims=opts.expert_move_claims,
                                  prefetch=opts.expert_prefetch, prefetch_top=opts.expert_prefetch_top,
                                  prefetch_min_batch=opts.expert_prefetch_min_batch) \
        if opts.cold_experts else None
    model = _to_empty(model, opts.device)
    for m in model.modules():      # non-persistent buffers come back uninitialised from to_empty
        if isinstance(m, Rotary):
            m.inv_freq.copy_(m.compute_inv_freq())
    return model.eval().requires_grad_(False)


def _to_empty(model: StageModel, device: str | torch.device) -> StageModel:
    """`Module.to_empty(device=...)` without `torch.empty_like`: on a meta tensor that runs torch's Python reference,
    whose first call imports sympy (~0.6 s of CPU in every stage process's start-up). A contiguous tensor gets the
    same storage from `torch.empty`; any other keeps `empty_like`'s layout rules."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    return model._apply(empty)


def load_model(model_dir: str | Path, opts: LoadOptions | None = None,
               cfg: HybridMoeConfig | None = None) -> StageModel:
    opts = opts or LoadOptions()
    model_dir = Path(model_dir)
    cfg = cfg or load_config(model_dir)
    packed = {}
    end = cfg.num_hidden_layers if opts.end is None else opts.end
    # every tensor's shape and dtype, read once for the checks before the tensors stream (the quantization check,
    # the packed and float8 layer specs, a tied lm_head)
    headers = tensor_headers(model_dir) if opts.load_format == "safetensors" else {}
    if opts.load_format == "safetensors" and opts.packed_experts:
        packed = packed_layers(plan_of(model_dir), cfg, opts.start, end, model_dir)
    elif opts.load_format == "dummy" and opts.dummy_int4:
        packed = {layer: tuple(opts.dummy_int4) for layer in range(opts.start, end) if cfg.is_sparse_moe(layer)}
    fp8 = {}
    if opts.load_format == "safetensors" and opts.packed_fp8_experts:
        fp8 = fp8_layers(plan_of(model_dir), cfg, opts.start, end, model_dir)
    dense = None
    if opts.load_format == "safetensors" and opts.packed_dense:
        dense = lambda m: packed_dense_specs(m, cfg, model_dir, opts.packed_qkv, headers)      # noqa: E731
    elif opts.load_format == "dummy" and opts.dummy_dense:
        dense = lambda m: dummy_specs(m, opts.dtype or default_dtype(cfg, opts.device), opts.packed_qkv)  # noqa: E731
    fp8_dense = None
    if opts.load_format == "safetensors" and opts.packed_fp8_dense:
        fp8_dense = lambda m: fp8_dense_specs(m, cfg, model_dir, headers)      # noqa: E731
    model = build_empty(cfg, opts, packed, dense, fp8, fp8_dense, _expert_scale_dtypes(headers, packed))
    if opts.load_format == "dummy":
        fill_random(model, opts.seed)
        fill_random_tables(model, opts.seed)      # the tables get what the parameters or buffers would have
        for layer, ple in _ple_modules(model):
            # with `dummy_ple_file` the rows go to a file beside the model, else procedural
            ple.table = dummy_layer_table(cfg, layer, ple.spec, opts.dtype, opts.seed,
                                          Path(model_dir) if opts.dummy_ple_file else None)
    elif opts.load_format == "safetensors":
        _load_tensors(model, cfg, model_dir, headers)
    else:
        raise ValueError(f"load format {opts.load_format!r}: expected 'safetensors' or 'dummy'")
    order_gates(model)
    return model


def _ple_modules(model: StageModel):
    for idx, layer in model.layers.items():
        if getattr(layer, "ple", None) is not None:
            yield int(idx), layer.ple


def _load_tensors(model: StageModel, cfg: HybridMoeConfig, model_dir: Path,
                  headers: dict[str, tuple[tuple, str]]) -> None:
    why = quant_refusal(model_dir, headers)
    if why:
        raise CheckpointError(why)
    params = dict(model.named_parameters()) | loader_targets(model)
    pieces = pieces_for(cfg, {n: p.shape for n, p in params.items()})
    with on_meta():
        full = StageModel(cfg, with_mtp=True)
    known = set(pieces_for(cfg, {n: p.shape for n, p in full.named_parameters()}))
    del full
    if cfg.tie_word_embeddings:
        _untie_lm_head(pieces, known, headers)
    seen: dict[str, Path] = {}
    ple_shards: dict[int, Shards] = defaultdict(dict)
    ple_layers = {layer: ple for layer, ple in _ple_modules(model)}
    skipped_extra: set[str] = set()
    kv_scales = 0
    quant = _Dequantizer(plan_of(model_dir), pieces, {normalise(n)[: -len(".weight_g_idx")] for n in headers
                                                      if n.endswith(".weight_g_idx")})
    placer = PackedPlacer({layer: moe for layer, moe in model.moe_layers().items()
                           if moe.packed_group or moe.fp8_block},
                          CheckpointError)
    dense = PackedDensePlacer(model, CheckpointError)
    fp8_dense = Fp8DensePlacer(model, CheckpointError)
    for path in checkpoint_files(model_dir):
        with open_safetensors(path) as f:
            for raw_name in f.keys():
                name = normalise(raw_name)
                if placer.takes(name):
                    placer.place(name, f.get_tensor(raw_name), raw_name, path)
                    continue
                if dense.takes(name):
                    dense.place(name, f.get_tensor(raw_name), raw_name, path)
                    continue
                if fp8_dense.takes(name):
                    fp8_dense.place(name, f.get_tensor(raw_name), raw_name, path)
                    continue
                if quant.takes(name, f, raw_name):
                    done = quant.add(name, f.get_tensor(raw_name), raw_name, path)
                    if done is None:
                        continue
                    name, tensor = done              # a module's parts all read: its float weight
                    raw_name = f"{name} (dequantized)"
                elif name in pieces:
                    tensor = f.get_tensor(raw_name)
                else:
                    tensor = None
                if tensor is not None:
                    if name in seen:
                        raise CheckpointError(f"tensor {raw_name!r} appears twice: in {seen[name]} and {path}")
                    seen[name] = path
                    for piece in pieces[name]:
                        _place(params[piece.local], piece, tensor, raw_name, path)
                    del tensor
                    continue
                shard = ple_shard(name)
                if shard:
                    if shard[0] in ple_layers:
                        ple_shards[shard[0]][shard[1]] = (path, raw_name, tuple(f.get_slice(raw_name).get_shape()))
                    continue
                m = PLE_BUFFER.match(name)
                if m:
                    if int(m.group(1)) in ple_layers:
                        _check_hash_buffer(ple_layers[int(m.group(1))].spec, m.group(2), f.get_tensor(raw_name),
                                           raw_name, path)
                    continue
                if name in known or _quant_part_of(name, known):
                    continue                       # another stage's tensor
                if cfg.shared_expert_intermediate_size == 0 and _NO_SHARED_EXPERT.match(name):
                    continue                       # transformers' zero-width shared expert (and its gate): adds 0
                if quant.plan is not None and quant.plan.kv_cache and _KV_SCALE.search(name):
                    kv_scales += 1                 # kv_cache_scheme's scales: the KV cache stays in the compute dtype
                    continue
                if name.endswith(_ROTARY_BUFFERS):
                    continue                       # an old exporter's RoPE tables: recomputed, as transformers does
                if name.startswith(("model.visual.", "visual.")) or (name.startswith("mtp.") and model.mtp is None):
                    skipped_extra.add(name.split(".")[0] + "." + name.split(".")[1])
                    continue
                raise CheckpointError(f"unexpected tensor {raw_name!r} in {path}: no part of a "
                                      f"{cfg.family} model with this config.json takes it")
    if kv_scales:
        kv = quant.plan.kv_cache
        log.warning("checkpoint: kv_cache_scheme (%s%s %s) ignored: the KV cache stays in the compute dtype and the "
                    "%d k/v scales in the files are unused, as vLLM's --kv-cache-dtype auto does",
                    kv.get("type", "int"), kv.get("num_bits", "?"), kv.get("strategy") or "tensor", kv_scales)
    if skipped_extra:
        log.info("checkpoint: skipped tensors under %s (not served by this stage)", ", ".join(sorted(skipped_extra)))
    quant.finish(model_dir)
    placer.finish(model_dir)
    dense.finish(model_dir)
    fp8_dense.finish(model_dir)
    _check_complete(params, pieces, set(seen), model_dir)
    for layer, ple in ple_layers.items():
        ple.table = open_ple_table(cfg, layer, ple.spec, ple_shards.get(layer, {}), model_dir)


def _untie_lm_head(pieces: dict[str, list[Piece]], known: set[str], headers: dict[str, tuple[tuple, str]]) -> None:
    """tie_word_embeddings with an `lm_head` weight in the files (exporters that write both, an untied fine-tune
    whose config kept the flag): transformers loads that tensor into lm_head (with other values than the embedding
    it does not tie them, with a warning), so lm_head takes it instead of `model.embed_tokens.weight`; with no
    embedding in the files, the tie fills the embedding from it too. A quantized embedding is in the files as its
    parts (`weight_packed`, `weight_scale`, ...: llm-compressor's Embedding target beside a float lm_head), not
    `.weight`. `headers`: the files' `tensor_headers`."""
    on_disk = {normalise(n) for n in headers}
    if not any(n.startswith("lm_head.") for n in on_disk):
        return
    known.add("lm_head.weight")
    embed = pieces.pop("model.embed_tokens.weight", [])
    has_embed = any((_quant_part(n) or ("",))[0] == "model.embed_tokens" for n in on_disk)
    mine = [p for p in embed if p.local == "lm_head.weight" or not has_embed]
    if mine:
        pieces["lm_head.weight"] = mine
    if len(mine) < len(embed):
        pieces["model.embed_tokens.weight"] = [p for p in embed if p not in mine]


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
def _expert_scale_dtypes(headers: dict, packed: dict[int, tuple[int, int]]) -> dict[int, torch.dtype]:
    """Packed MoE layer -> the dtype of its experts' scales in the files (the first found; a float dtype)."""
    out: dict[int, torch.dtype] = {}
    for layer, part, dtype in expert_tensors(headers):
        if part == "weight_scale" and layer in packed and dtype in _SAFETENSORS_DTYPES:
            out.setdefault(layer, _SAFETENSORS_DTYPES[dtype])
    return out
# compressed-tensors' kv_cache_scheme (llm-compressor's FP8 KV cache recipes): each attention layer's static K and V
# scales. vLLM reads them only for an FP8 KV cache (--kv-cache-dtype fp8, which moepipe refuses); with auto it keeps
# the cache in the model's dtype and leaves them unused, and so does moepipe (a warning says so).
_KV_SCALE = re.compile(r"\.self_attn\.(k|v)_scale$")
# With shared_expert_intermediate_size 0 transformers still builds (and save_pretrained writes) a shared expert of
# zero width, [0, H] / [H, 0] weights, and its [1, H] gate: the gated output is sigmoid(g) * 0. Ours has none.
_NO_SHARED_EXPERT = re.compile(r"^(model\.|mtp\.)(.*\.)?layers\.\d+\.mlp\.shared_expert(_gate)?\.")


def packed_dense_specs(model: StageModel, cfg: HybridMoeConfig, model_dir: Path, qkv: bool = True,
                       headers: dict[str, tuple[tuple, str]] | None = None) -> dict[str, PackedSpec]:
    """The plain-linear modules of `model` (built on meta, after `SparseMoE.use_packed`) that the checkpoint stores
    packed in a scheme PackedLinear runs, each filled by exactly one on-disk module (not a tied lm_head, not a
    regrouped projection), from the files' headers (`headers`: their `tensor_headers`, if read already).
    `use_packed_dense(model, packed_dense_specs(...))` on a meta model gives what a stage holds (the memory plan can
    count its `weight_packed` / `weight_scale` buffers)."""
    sites = _whole_sites(model, cfg, plain_linear_sites(model, qkv=qkv))
    plan = plan_of(model_dir)
    if not sites or plan is None:
        return {}
    disk = _disk_headers(model_dir, headers, (".weight_packed", ".weight_scale", ".weight_zero_point",
                                              ".weight_g_idx"))
    return packed_specs(plan, sites, disk, _SAFETENSORS_DTYPES)


def fp8_dense_specs(model: StageModel, cfg: HybridMoeConfig, model_dir: Path,
                    headers: dict[str, tuple[tuple, str]] | None = None) -> dict[str, tuple[int, int]]:
    """The plain-linear modules of `model` (built on meta) that a block-FP8 checkpoint stores as float8 with a
    `weight_scale_inv` (not in `modules_to_not_convert`), each filled by one on-disk module, -> their scale block,
    from the files' headers (`fp8_linear.fp8_specs`; `headers` as `packed_dense_specs` takes them).
    `use_fp8_dense(model, fp8_dense_specs(...))` on a meta model gives what a stage holds with `packed_fp8_dense`
    on (the memory plan counts its buffers)."""
    sites = _whole_sites(model, cfg, fp8_sites(model))
    plan = plan_of(model_dir)
    if not sites or plan is None or plan.method != "fp8":
        return {}
    return fp8_specs(plan, sites, _disk_headers(model_dir, headers, (".weight", ".weight_scale_inv")))


def _whole_sites(model: StageModel, cfg: HybridMoeConfig, names: list[str]) -> dict[str, tuple[int, int]]:
    """Of the named Linear modules, those whose `.weight` exactly one on-disk tensor fills (not a tied lm_head,
    not a regrouped projection) -> (out, in) features."""
    sites = {}
    for name in names:
        m = model.get_submodule(name)
        local = f"{name}.weight"
        if pieces_for(cfg, {local: m.weight.shape}).get(hf_name(local)) == [Piece(local, tuple(m.weight.shape))]:
            sites[name] = (m.out_features, m.in_features)
    return sites


def _disk_headers(model_dir: Path, headers: dict[str, tuple[tuple, str]] | None,
                  suffixes: tuple[str, ...]) -> dict[str, tuple[tuple, str]]:
    """Normalised on-disk name -> (shape, safetensors dtype) of the tensors ending in `suffixes`, from `headers`
    (the files' `tensor_headers`; read now when None)."""
    if headers is None:
        headers = tensor_headers(model_dir)
    return {normalise(raw): h for raw, h in headers.items() if raw.endswith(suffixes)}


class _Dequantizer:
    """Collects each quantized module's on-disk parts (`weight_packed`, `weight_scale`, ...; for float8 the weight
    and its scale) and hands back its float weight once all have been read, so a module is dequantized while its
    parts are in memory and never the whole model at once (issue 17; the weights are held in the compute dtype
    until the quantized kernels take the packed form)."""

    def __init__(self, plan: QuantPlan | None, pieces: dict, g_idx: set[str] = frozenset()) -> None:
        self.plan, self.pieces = plan, pieces
        self.g_idx = g_idx             # modules whose files hold a `weight_g_idx` (activation-ordered groups)
        self.parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)

    def takes(self, name: str, f, raw_name: str) -> bool:
        """Is `name` part of a quantized module that this stage loads?"""
        if self.plan is None:
            return False
        split = _quant_part(name)
        if split is None or f"{split[0]}.weight" not in self.pieces:
            return False
        if split[1] == "weight":         # a plain weight, unless float8 or int8 values (then a scale follows)
            return f.get_slice(raw_name).get_dtype() in ("F8_E4M3", "F8_E5M2", "I8")
        return True

    def add(self, name: str, tensor: torch.Tensor, raw_name: str, path: Path):
        module, part = _quant_part(name)
        wq = self.plan.for_module(module)
        if wq is None:
            raise CheckpointError(f"tensor {raw_name!r} in {path} is quantized, but no quantization_config group "
                                  f"applies to {module} (ignored or unmatched)")
        have = self.parts[module]
        have[part] = tensor
        if not needed(wq, self.plan.method, module in self.g_idx) <= set(have):
            return None
        del self.parts[module]
        try:     # computed in the scale's dtype, as the library does; float32 holds it exactly, `_place` casts
            weight = dequantize(have, wq, torch.float32)
        except QuantSchemeError as exc:
            raise CheckpointError(f"{module} in {path}: {exc}") from exc
        return f"{module}.weight", weight

    def finish(self, model_dir: Path) -> None:
        if self.parts:
            module, have = next(iter(self.parts.items()))
            raise CheckpointError(f"{model_dir}: quantized module {module} has only {sorted(have)} "
                                  f"(and {len(self.parts) - 1} more modules are incomplete)")


@torch.no_grad()
def _place(param: torch.Tensor, piece: Piece, tensor: torch.Tensor, name: str, path: Path) -> None:
    if tuple(tensor.shape) != piece.shape:
        raise CheckpointError(f"tensor {name!r} in {path} has shape {list(tensor.shape)}, "
                              f"expected {list(piece.shape)}")
    if piece.transform is not None:
        tensor = piece.transform(tensor)
    target = param[piece.index] if piece.index else param
    target.copy_(tensor.to(param.dtype))


def _quant_part(name: str) -> tuple[str, str] | None:
    """(module, part) when `name` is a quantized module's part (`weight_packed`, `weight_scale`, ...)."""
    module, _, part = name.rpartition(".")
    return (module, part) if part in QUANT_PARTS else None


def _quant_part_of(name: str, known: set[str]) -> bool:
    """`name` is a quantized part of a weight the model has."""
    split = _quant_part(name)
    return split is not None and f"{split[0]}.weight" in known


def _check_complete(params: dict[str, torch.Tensor], pieces: dict[str, list[Piece]], seen: set[str],
                    model_dir: Path) -> None:
    """Every parameter is covered by its fused on-disk tensor or by all of its per-piece tensors."""
    fused_alt = ("experts.gate_up_proj", "experts.down_proj")
    by_local: dict[str, list[str]] = defaultdict(list)
    for hf, ps in pieces.items():
        for p in ps:
            by_local[p.local].append(hf)
    missing: list[str] = []
    for local in params:
        names = by_local.get(local, [])
        if any(n in seen for n in names if n.endswith(fused_alt)):
            continue
        missing.extend(n for n in names if not n.endswith(fused_alt) and n not in seen)
    if missing:
        missing = sorted(set(missing), key=_natural)
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                                           else "")
        raise CheckpointError(f"missing tensor(s) in {model_dir}: {shown}")


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _check_hash_buffer(spec: NgramHashSpec, kind: str, tensor: torch.Tensor, name: str, path: Path) -> None:
    expected = {"layer_multipliers": spec.multipliers, "ngram_heads_vocab_sizes": spec.primes,
                "ngram_heads_offsets": spec.offsets}[kind]
    if [int(x) for x in tensor.tolist()] != [int(x) for x in expected]:
        raise CheckpointError(f"tensor {name!r} in {path} disagrees with the n-gram hash derived from config.json "
                              f"(seed, vocab_size, ngram_vocab_size_base): {tensor.tolist()} != {list(expected)}")
