"""The stage-worker side of the `moepipe` command: make-model, quantize, generate, route-stats and cold-set, whose
work is in stage_worker. `moepipe <subcommand>` (shared/cli.py) runs `python -m stage_worker.cli <subcommand> ...`;
each subcommand imports its implementation lazily, so `--help` stays fast."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from shared.cli import command_parser, model_arg, run_command

# What make-model writes (and loading derives beside it: ple_table.*): a directory holding nothing else is an
# earlier make-model checkpoint, rewritten whole; any other non-empty --out is refused, as quantize refuses one
MAKE_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors", "model.safetensors.index.json")
MAKE_MODEL_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")       # over 2 GiB (make_model.SHARD_BYTES)
DERIVED_PREFIX = "ple_table."

# `moepipe generate`'s sampling flags take what the API takes (gateway/schemas.py: MAX_TEMPERATURE, MIN_TOP_P and
# the Field bounds; the service packages import only shared, so the numbers are repeated; tests/test_cli_migration.py
# checks the API refuses the same values)
SAMPLING_RANGES = {"temperature": (0.0, 100.0), "top_p": (1e-6, 1.0), "min_p": (0.0, 1.0)}


def _make_model_out(value: str) -> Path:
    """--out as make-model may write it: not empty, not a file, and either absent, empty or an earlier make-model
    checkpoint (whose files are removed first, so none of the old one's is left beside the new one)."""
    if not value.strip():
        raise ValueError("--out: empty path")
    out = Path(value)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {value}: exists and is not a directory")
    if out.is_dir():
        entries = sorted(out.iterdir())
        others = [e.name for e in entries if not e.is_file() or not (
            e.name in MAKE_MODEL_FILES or MAKE_MODEL_SHARD.fullmatch(e.name) or e.name.startswith(DERIVED_PREFIX))]
        if others:
            raise ValueError(f"--out {value}: not empty ({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}"
                             f" is not what make-model writes); give a new or empty directory")
        _not_another_checkpoint(out, value)
        if entries:
            print(f"moepipe make-model: replacing the make-model checkpoint in {value}", file=sys.stderr)
        for e in entries:
            e.unlink()
    return out


def _not_another_checkpoint(out: Path, value: str) -> None:
    """A directory of make-model's file names that is not make-model's output: the built-in model (the bundled
    trained demo checkpoint, or its copy under MOEPIPE_HOME) or a quantized checkpoint (`moepipe quantize` writes
    the same names). Rewriting it with random weights lost it, silently."""
    from shared.cli import BUNDLED_MODEL, moepipe_home

    where = out.resolve()
    if where == BUNDLED_MODEL.resolve() or (where.parent == (moepipe_home() / "models").resolve()
                                            and where.name.startswith("demo-")):     # (not "tiny": make-model's)
        raise ValueError(f"--out {value}: is the built-in demo model; give a new or empty directory")
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        config = None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant:
        how = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(f"--out {value}: holds a quantized checkpoint ({how}), not make-model's output; give a new "
                         f"or empty directory")
    from shared.checkpoint_files import CheckpointError, open_safetensors
    from stage_worker.checkpoint.make_model import WRITTEN_BY

    for f in sorted(out.glob("*.safetensors")):
        try:
            with open_safetensors(f) as opened:
                meta = opened.metadata() or {}
        except CheckpointError:         # not a readable safetensors file (an interrupted write): nobody's weights
            continue
        if any(meta.get(k) != v for k, v in WRITTEN_BY.items()):
            raise ValueError(f"--out {value}: holds a checkpoint make-model did not write ({f.name}); give a new or "
                             f"empty directory")


def out_file(value: str, flag: str = "--out") -> Path:
    """An output file checked before the work that fills it (route-stats may run for hours): not empty, not a
    directory, in a directory that exists; a ValueError naming it. An existing file is replaced (--help says so)."""
    if not value.strip():
        raise ValueError(f"{flag}: empty path")
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{flag} {value}: is a directory; give the file to write")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {value}: {parent} is not an existing directory")
    return path


def _make_model(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.make_model import make_model

    out = make_model(args.preset, _make_model_out(args.out), seed=args.seed, layers=args.layers)
    print(out)
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.quantize import QuantizeError, quantize_checkpoint

    if not args.input.strip():
        raise ValueError("input: empty path; give the checkpoint directory to quantize")
    src = model_arg(args.input, "input")       # a Hub id: moepipe does not download, it says so
    if not (src / "config.json").is_file():
        print(f"moepipe quantize: {src} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    try:
        summary = quantize_checkpoint(src, Path(args.output), args.scheme)
    except QuantizeError as exc:
        print(f"moepipe quantize: {exc}", file=sys.stderr)
        return 2
    for name, w in summary["groups"].items():
        how = f"{w['strategy']} {w['group_size']}" if w.get("group_size") else w.get("block_structure") or w["strategy"]
        print(f"  {name}: {w['type']}{w['num_bits']} {how}")
    print(f"{args.output}: {summary['modules']} modules quantized ({args.scheme}), "
          f"{summary['bytes_in'] / 2**20:.1f} MiB -> {summary['bytes_out'] / 2**20:.1f} MiB")
    return 0


def _check_device(value: str) -> None:
    """--device as a stage takes it: cpu, cuda or cuda:N of a visible GPU; else a ValueError naming it."""
    kind, _, index = value.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"--device {value}: expected cpu, cuda or cuda:N")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {value}: no CUDA device is visible")
        if index and int(index) >= count:
            raise ValueError(f"--device {value}: only {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags within the API's bounds (gateway/schemas.py), each refused naming its flag."""
    for key, (lo, hi) in SAMPLING_RANGES.items():
        value = getattr(args, key)
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise ValueError(f"--{key.replace('_', '-')} {value}: must be between {lo:g} and {hi:g}")
    if args.top_k is not None and args.top_k < -1:
        raise ValueError(f"--top-k {args.top_k}: must be >= 1, or 0 / -1 (off)")


def _generate(args: argparse.Namespace) -> int:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be at least 1")
    _check_sampling(args)
    args.model = str(model_arg(args.model))
    _check_device(args.device)
    from stage_worker.generate import run_cli

    return run_cli(args)


def _route_stats(args: argparse.Namespace) -> int:
    from stage_worker.route_stats import read_texts, route_stats

    model = model_arg(args.model)
    out_file(args.out)
    _check_device(args.device)
    texts = read_texts(args.text)
    route_stats(model, texts, args.out, tokens_per_kind=args.tokens_per_kind, chunk=args.chunk, batch=args.batch,
                device=args.device)
    return 0


def _cold_set(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from shared import cold_set
    from shared.cluster_config import ClusterConfig, ClusterConfigError, env_overrides, split_layers
    from shared.model_config import load_config

    model = model_arg(args.model)
    out_file(args.out)
    cfg = load_config(model)
    try:
        data = json.loads(Path(args.usage).read_text())
        if not isinstance(data, dict) or "usage" not in data:
            raise ValueError("no \"usage\" object")
        usage = data["usage"]
        cold_set.check_usage(usage)
    except (OSError, ValueError) as exc:
        print(f"moepipe cold-set: {args.usage}: not a route_usage.json from `moepipe route-stats` or "
              f"tools/route_trace.py ({exc})", file=sys.stderr)
        return 2
    meta = data.get("meta")
    tokens = meta.get("tokens_per_kind") if isinstance(meta, dict) else None
    if not isinstance(tokens, dict) or not all(isinstance(n, (int, float)) for n in tokens.values()):
        tokens = {}
    if not 0 < args.gib_per_stage < float("inf"):          # NaN too
        print(f"moepipe cold-set: --gib-per-stage must be a positive number, got {args.gib_per_stage}",
              file=sys.stderr)
        return 2
    from shared.quant_scheme import plan_of
    from stage_worker.checkpoint.packed_experts import fp8_layers, packed_layers

    stages = split_layers(cfg.num_hidden_layers, args.stages)
    # INT4 / FP4 experts stay packed (issue 17) and block-FP8 experts float8 where the server keeps them so with cold
    # experts (`ClusterConfig.keeps_fp8_experts`: the defaults and MOEPIPE_* switches): a stage holds them, and a
    # host read moves them, at that size
    plan = plan_of(model)
    try:
        switches = {f.name: f.default for f in dataclasses.fields(ClusterConfig)
                    if f.name in ("packed_experts", "packed_fp8_experts", "fp8_expert_tables")} | env_overrides()
    except ClusterConfigError as exc:
        print(f"moepipe cold-set: {exc}", file=sys.stderr)
        return 2
    # MOEPIPE_PACKED_EXPERTS=0: the stages dequantize INT4 / FP4 experts at load, so they are sized as such
    packed = packed_layers(plan, cfg, 0, cfg.num_hidden_layers, model) if switches["packed_experts"] else {}
    keep_fp8 = switches["packed_fp8_experts"] and switches["fp8_expert_tables"]
    fp8 = fp8_layers(plan, cfg, 0, cfg.num_hidden_layers, model) if keep_fp8 else {}

    def stage_expert_bytes(s: int, e: int) -> int:
        layer = next((x for x in range(s, e) if x in packed), None)
        if layer is not None:
            return cold_set.packed_expert_bytes(cfg, *packed[layer], dtype=args.dtype)
        layer = next((x for x in range(s, e) if x in fp8), None)
        if layer is not None:
            return cold_set.fp8_expert_bytes(cfg, fp8[layer])
        return cold_set.expert_bytes(cfg, args.dtype)

    per_expert = [stage_expert_bytes(s, e) for s, e in stages]
    budget = int(args.gib_per_stage * (1 << 30))
    try:
        scores = cold_set.kind_normalised(usage)
        cold_set.check_scores(scores, cfg, str(args.usage))
        cold = cold_set.choose(scores, stages, per_expert, budget)
    except cold_set.ColdSetError as exc:
        print(f"moepipe cold-set: {exc}", file=sys.stderr)
        return 2
    out = cold_set.write(args.out, cfg, str(model), cold, stages, per_expert, budget, sorted(usage))
    for s, e in stages:
        n = sum(len(ids) for layer, ids in cold.items() if s <= layer < e)
        size = per_expert[stages.index((s, e))]
        print(f"stage layers {s}-{e}: {n} experts ({n * size / (1 << 20):.1f} MiB) in host RAM")
    reads = cold_set.host_reads(cold, usage, tokens)
    print("host expert reads per token on the traced text (before run-time moves): "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(reads.items())))
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p, sub = command_parser()

    mk = sub.add_parser("make-model", help="write a random-weight Qwen4-Exp checkpoint")
    mk.add_argument("--preset", choices=["tiny", "small", "demo", "full-shape", "qwen3-next-shape"], default="tiny")
    mk.add_argument("--out", required=True, help="output directory: new, empty, or an earlier make-model "
                                                 "checkpoint (replaced)")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--layers", type=int, default=None, help="keep the preset's first N decoder layers")
    mk.set_defaults(func=_make_model)

    q = sub.add_parser("quantize", help="write a quantized copy of a checkpoint (compressed-tensors INT4/6/8, "
                                        "NVFP4/MXFP4 or block FP8), with the compressed-tensors library")
    q.add_argument("--scheme", required=True,
                   choices=["reports-mixed", "int4-experts", "int4-experts-asym", "nvfp4", "mxfp4", "fp8-block"],
                   help="reports-mixed: experts INT4 g128, attention/DeltaNet/shared expert INT6 g128, "
                        "hyper-connections and embeddings INT8 per channel; int4-experts: only the routed experts; "
                        "int4-experts-asym: the same with zero points (W4A16_ASYM); "
                        "nvfp4 / mxfp4: experts and dense projections FP4 (NVFP4A16 / MXFP4A16: experts kept packed, the "
                        "rest dequantized at load); "
                        "fp8-block: float8 with 128x128 block scales (quant_method fp8)")
    q.add_argument("input", help="checkpoint directory (float weights)")
    q.add_argument("output", help="directory to write (must not exist or be empty)")
    q.set_defaults(func=_quantize)

    g = sub.add_parser("generate", help="generate from a prompt in this process")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None, help="[0, 100] (0: greedy)")
    g.add_argument("--top-p", type=float, default=None, help="[1e-6, 1]")
    g.add_argument("--top-k", type=int, default=None, help="-1 or 0 (off), or >= 1")
    g.add_argument("--min-p", type=float, default=None, help="[0, 1]")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.set_defaults(func=_generate)

    r = sub.add_parser("route-stats", help="count each MoE layer's expert selections over sample text of several "
                                           "kinds (the input of cold-set)")
    r.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    r.add_argument("--text", action="append", required=True, metavar="KIND=PATH",
                   help="sample text of one kind: a file, or a directory of files (repeat for each kind: code, "
                        "prose, another language...)")
    r.add_argument("--tokens-per-kind", type=int, default=200_000)
    r.add_argument("--chunk", type=int, default=512, help="tokens per prefilled window")
    r.add_argument("--batch", type=int, default=8, help="windows per step")
    r.add_argument("--device", default="cpu")
    r.add_argument("--out", required=True, help="route_usage.json to write (an existing file is replaced)")
    r.set_defaults(func=_route_stats)

    c = sub.add_parser("cold-set", help="choose the experts each stage keeps in host RAM from routing counts "
                                        "(tools/route_trace.py's route_usage.json)")
    c.add_argument("--usage", required=True, help="route_usage.json (`moepipe route-stats` or tools/route_trace.py): "
                                                "per kind, per layer, selections per expert")
    c.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    c.add_argument("--stages", type=int, default=1, help="pipeline stages the budget applies to, one each")
    c.add_argument("--gib-per-stage", type=float, required=True, help="host RAM for experts per stage, GiB")
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the experts' dtype in memory (default: the checkpoint's)")
    c.add_argument("--out", required=True, help="the cold-set file to write (JSON; an existing file is replaced)")
    c.set_defaults(func=_cold_set)

    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
