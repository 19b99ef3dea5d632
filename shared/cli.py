"""The `moepipe` command. Each subcommand imports its implementation lazily, so `--help` stays fast."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


BUNDLED_MODEL = Path(__file__).resolve().parent / "demo_model"    # the trained demo checkpoint (issue 6)


def builtin_model_dir() -> Path:
    """Where the built-in model is served from: a copy of the bundled demo checkpoint under MOEPIPE_HOME, named
    by the hash of every bundled file (a changed config or tokenizer, not only new weights, must not reuse an old
    copy). A copy because loading writes the expanded PLE table beside the checkpoint, and the installed package
    may be read-only (or a git checkout that should stay clean)."""
    base = Path(os.environ.get("MOEPIPE_HOME", Path.home() / ".cache" / "moepipe"))
    if not (BUNDLED_MODEL / "model.safetensors").is_file():
        return base / "models" / "tiny"
    import hashlib

    digest = hashlib.sha256()
    for f in sorted(p for p in BUNDLED_MODEL.iterdir() if p.is_file()):
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode() + f.read_bytes())
    return base / "models" / f"demo-{digest.hexdigest()[:12]}"


def ensure_builtin_model() -> Path:
    path = builtin_model_dir()
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if (BUNDLED_MODEL / "model.safetensors").is_file():
        import shutil
        import tempfile

        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".copy-"))
        for f in BUNDLED_MODEL.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        try:
            tmp.rename(path)              # atomic: a concurrent first start sees a whole checkpoint or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / "model.safetensors").is_file():
                raise
        return path
    from stage_worker.checkpoint.make_model import make_model

    print(f"moepipe: no bundled demo model ({BUNDLED_MODEL}); writing the random-weight tiny model to {path} (once)",
          file=sys.stderr)
    make_model("tiny", path, seed=0)
    return path


def _make_model(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.make_model import make_model

    out = make_model(args.preset, Path(args.out), seed=args.seed, layers=args.layers)
    print(out)
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.quantize import QuantizeError, quantize_checkpoint

    src = Path(args.input)
    if not (src / "config.json").is_file():
        print(f"moepipe quantize: {src} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    try:
        summary = quantize_checkpoint(src, Path(args.output), args.scheme)
    except QuantizeError as exc:
        print(f"moepipe quantize: {exc}", file=sys.stderr)
        return 2
    for name, w in summary["groups"].items():
        how = f"group {w['group_size']}" if w.get("group_size") else w.get("block_structure") or w["strategy"]
        print(f"  {name}: {w['type']}{w['num_bits']} {how}")
    print(f"{args.output}: {summary['modules']} modules quantized ({args.scheme}), "
          f"{summary['bytes_in'] / 2**20:.1f} MiB -> {summary['bytes_out'] / 2**20:.1f} MiB")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from stage_worker.generate import run_cli

    if args.model is None:
        args.model = str(ensure_builtin_model())
    return run_cli(args)


def _keys(args: argparse.Namespace) -> int:
    from shared.links import write_keys

    try:
        secret = write_keys(args.out)
    except FileExistsError as exc:
        print(f"moepipe keys: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {secret} (keep it private: whoever has it can join the cluster)")
    print(f"copy {Path(args.out)} to every host of the cluster and set in cluster.toml:")
    print(f'link_keys = "{secret.resolve()}"')
    return 0


def _route_stats(args: argparse.Namespace) -> int:
    from stage_worker.route_stats import read_texts, route_stats

    model = Path(args.model) if args.model else ensure_builtin_model()
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

    model = Path(args.model) if args.model else ensure_builtin_model()
    cfg = load_config(model)
    try:
        data = json.loads(Path(args.usage).read_text())
        usage = data["usage"]
        tokens = data.get("meta", {}).get("tokens_per_kind", {})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"moepipe cold-set: {args.usage}: not a route_usage.json from tools/route_trace.py ({exc})",
              file=sys.stderr)
        return 2
    if args.gib_per_stage <= 0:
        print("moepipe cold-set: --gib-per-stage must be > 0", file=sys.stderr)
        return 2
    from shared.quant_scheme import plan_of
    from stage_worker.checkpoint.packed_experts import fp8_layers, packed_layers

    stages = split_layers(cfg.num_hidden_layers, args.stages)
    # INT4 experts stay packed (issue 17) and block-FP8 experts float8 where the server keeps them so with cold
    # experts (`ClusterConfig.keeps_fp8_experts`: the defaults and MOEPIPE_* switches): a stage holds them, and a
    # host read moves them, at that size
    plan = plan_of(model)
    packed = packed_layers(plan, cfg, 0, cfg.num_hidden_layers)
    try:
        switches = {f.name: f.default for f in dataclasses.fields(ClusterConfig)
                    if f.name in ("packed_fp8_experts", "fp8_expert_tables")} | env_overrides()
    except ClusterConfigError as exc:
        print(f"moepipe cold-set: {exc}", file=sys.stderr)
        return 2
    keep_fp8 = switches["packed_fp8_experts"] and switches["fp8_expert_tables"]
    fp8 = fp8_layers(plan, cfg, 0, cfg.num_hidden_layers) if keep_fp8 else {}

    def stage_expert_bytes(s: int, e: int) -> int:
        layer = next((x for x in range(s, e) if x in packed), None)
        if layer is not None:
            return cold_set.packed_expert_bytes(cfg, *packed[layer], args.dtype)
        layer = next((x for x in range(s, e) if x in fp8), None)
        if layer is not None:
            return cold_set.fp8_expert_bytes(cfg, fp8[layer])
        return cold_set.expert_bytes(cfg, args.dtype)

    per_expert = [stage_expert_bytes(s, e) for s, e in stages]
    budget = int(args.gib_per_stage * (1 << 30))
    try:
        scores = cold_set.kind_normalised(usage)
        bad = [layer for layer in scores if not (0 <= layer < cfg.num_hidden_layers)
               or len(scores[layer]) != cfg.num_experts]
        if bad:
            raise cold_set.ColdSetError(f"the counts of layers {bad} do not match this model "
                                        f"({cfg.num_hidden_layers} layers, {cfg.num_experts} experts)")
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


def serve_options(args: argparse.Namespace):
    """`moepipe serve` flags as the launcher's ServeOptions (flags left unset keep the config defaults)."""
    from gateway.launcher import ServeOptions

    model = Path(args.model) if args.model else ensure_builtin_model()
    extra = {}
    if args.no_ple_service:
        extra["ple_service"] = False
    if args.no_access_log:
        extra["access_log"] = False
    if args.cold_experts is not None:
        extra["cold_experts"] = args.cold_experts if args.cold_experts == "auto" else \
            str(Path(args.cold_experts).resolve())
    if args.no_expert_moves:
        extra["expert_moves"] = False
    if args.qsa_kv_offload:
        extra["qsa_kv_offload"] = True
    if args.kv_row_cache_mib is not None:
        extra["kv_row_cache"] = args.kv_row_cache_mib > 0
        extra["kv_row_cache_mib"] = args.kv_row_cache_mib
    for key in ("allowed_hosts", "allowed_origins"):
        if getattr(args, key) is not None:
            extra[key] = [h.strip() for h in getattr(args, key).split(",") if h.strip()]
    for key in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "max_model_len",
                "load_format", "kv_cache_memory", "api_key", "restart_limit", "gpu_memory_utilization",
                "vram_limit", "kv_cache_memory_bytes"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    return ServeOptions(model=model, stages=args.stages, device=args.device, host=args.host, port=args.port,
                        extra=extra, verbose=args.verbose)


def _serve(args: argparse.Namespace) -> int:
    from gateway.launcher import run_serve

    return run_serve(serve_options(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moepipe", description="Serve huge hybrid MoE models on small GPUs.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a random-weight Qwen4-Exp checkpoint")
    mk.add_argument("--preset", choices=["tiny", "small", "demo", "full-shape", "qwen3-next-shape"], default="tiny")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--layers", type=int, default=None, help="keep the preset's first N decoder layers")
    mk.set_defaults(func=_make_model)

    q = sub.add_parser("quantize", help="write a quantized copy of a checkpoint (compressed-tensors INT4/6/8 or "
                                        "block FP8), with the compressed-tensors library")
    q.add_argument("--scheme", required=True, choices=["reports-mixed", "int4-experts", "fp8-block"],
                   help="reports-mixed: experts INT4 g128, attention/DeltaNet/shared expert INT6 g128, "
                        "hyper-connections and embeddings INT8 per channel; int4-experts: only the routed experts; "
                        "fp8-block: float8 with 128x128 block scales (quant_method fp8)")
    q.add_argument("input", help="checkpoint directory (float weights)")
    q.add_argument("output", help="directory to write (must not exist or be empty)")
    q.set_defaults(func=_quantize)

    g = sub.add_parser("generate", help="generate from a prompt in this process")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cpu")
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="start the whole cluster and serve the OpenAI API")
    s.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    s.add_argument("--stages", type=int, default=1, help="pipeline stages, one process each")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per stage (default: max-num-seqs sequences of max-model-len within "
                        "--kv-cache-memory)")
    s.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: derived from the model, a multiple of its QSA ratio)")
    s.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB of KV blocks per stage when --num-blocks is not given (default 4; on a GPU at "
                        "least one --max-model-len sequence)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="GPU stages: the share of each device's memory the server may use (default 0.9)")
    s.add_argument("--vram-limit", type=float, default=None, metavar="GIB",
                   help="GPU stages: use at most this many GiB of each device, as a smaller card would have")
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                   help="GPU stages: KV bytes per stage (default: what the memory plan leaves)")
    s.add_argument("--cold-experts", default=None, metavar="FILE",
                   help="keep these routed experts in host RAM (a file from `moepipe cold-set`, or 'auto': as "
                        "few as the memory plan needs, the least used by the checkpoint's route_usage.json if it "
                        "has one): a model larger than the GPUs runs, reading the selected host experts over PCIe")
    s.add_argument("--no-expert-moves", action="store_true",
                   help="with --cold-experts: never swap host and device experts at run time (also "
                        "MOEPIPE_EXPERT_MOVES=0)")
    s.add_argument("--qsa-kv-offload", action="store_true",
                   help="keep the QSA layers' K/V in pinned host RAM (only pooled keys in VRAM: far more tokens of "
                        "context per GiB; decode reads the selected rows over PCIe; also MOEPIPE_QSA_KV_OFFLOAD=1)")
    s.add_argument("--kv-row-cache-mib", type=int, default=None, metavar="MIB",
                   help="with --qsa-kv-offload: cache the K/V rows decode reads from host RAM in MIB of VRAM per "
                        "stage (default 256; 0: off; also MOEPIPE_KV_ROW_CACHE=0/1, MOEPIPE_KV_ROW_CACHE_MIB)")
    s.add_argument("--restart-limit", type=int, default=None, metavar="N",
                   help="restart a dead stage or PLE service up to N times in a row (default 5; 0: never)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (also MOEPIPE_API_KEY)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed to call the API (CORS; default none; also "
                        "MOEPIPE_ALLOWED_ORIGINS)")
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated Host names to answer, '*' for any (default: loopback names when bound to "
                        "a loopback address, else any; also MOEPIPE_ALLOWED_HOSTS)")
    s.add_argument("--load-format", choices=["safetensors", "dummy"], default=None,
                   help="dummy: seeded random weights, no file reads (a config-only checkpoint such as full-shape)")
    s.add_argument("--no-ple-service", action="store_true",
                   help="gather PLE rows inside the stage instead of the PLE service (A/B fallback)")
    s.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="no_access_log", action="store_true",
                   help="no access log line per HTTP request (vLLM's name is the alias)")
    s.set_defaults(func=_serve)

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
    r.add_argument("--out", required=True, help="route_usage.json to write")
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
    c.add_argument("--out", required=True, help="the cold-set file to write (JSON)")
    c.set_defaults(func=_cold_set)

    k = sub.add_parser("keys", help="write the CurveZMQ certificate that authenticates and encrypts the cluster's "
                                    "links between hosts (cluster config: link_keys)")
    k.add_argument("--out", required=True, help="directory for cluster.key and cluster.key_secret")
    k.set_defaults(func=_keys)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if getattr(args, "max_tokens", 1) is not None and getattr(args, "max_tokens", 1) < 1:
        print("moepipe: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"moepipe {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
