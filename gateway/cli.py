"""The gateway side of the `moepipe` command: serve (the launcher) and keys. `moepipe <subcommand>` (shared/cli.py)
runs `python -m gateway.cli <subcommand> ...`; each subcommand imports its implementation lazily, so `--help` stays
fast."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from shared.cli import command_parser, model_arg, run_command


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


def _keys_dir(value: str) -> str:
    """keys --out: a directory path (an empty one wrote the secret into the working directory, unasked)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("empty path; give the directory to write the keys into")
    if Path(value).exists() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value}: exists and is not a directory")
    return value


def human_int(value: str) -> int:
    """An argparse type for counts as vLLM's flags take them (`shared.cluster_config.parse_human_int`)."""
    from shared.cluster_config import parse_human_int
    try:
        return parse_human_int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def max_model_len_arg(value: str) -> int | None:
    """--max-model-len as vLLM takes it: a human_int, or auto / -1 = None (the flag left out: the model's own
    length, fitted to the memory on a GPU, as vLLM's auto fits it)."""
    if value.strip() == "-1" or value.strip().lower() == "auto":
        return None
    n = human_int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of tokens (32768, 32k, 32K), 0 or auto/-1 for the "
                                         f"model's own length")
    return n


JINJA_CHARS = "{}\n"      # vLLM's test for a --chat-template that is the template, not a path


def chat_template_file(value: str) -> Path:
    """--chat-template as vLLM takes it: a file, or the template itself when no such file opens and the value holds
    `{`, `}` or a line break (without them it is a path, and a missing one is an error, not a one-line template).
    Inline text is kept in a file named by its hash under MOEPIPE_HOME, since every process (a restarted gateway too)
    reads the cluster config's chat_template as a file. Either is checked to compile here, named."""
    import hashlib
    import os

    from shared.cli import moepipe_home
    from shared.tokenizer import check_chat_template, read_chat_template

    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):         # a template longer than a path may be, or with a NUL
        is_file = False
    if is_file or not any(c in value for c in JINJA_CHARS):
        if not is_file:
            raise ValueError(f"--chat-template {value} is not a file (nor an inline template, which holds '{{', "
                             f"'}}' or a line break)")
        try:
            read_chat_template(value)              # one that does not compile stops here, named
        except UnicodeDecodeError as exc:          # it named neither the flag nor the file
            raise ValueError(f"--chat-template {value}: not UTF-8 text ({exc.reason} at byte {exc.start}); a "
                             f"chat template is a Jinja text file") from None
        return Path(value).resolve()
    check_chat_template(value, "--chat-template (inline)")
    path = moepipe_home() / "chat_templates" / f"{hashlib.sha256(value.encode()).hexdigest()[:16]}.jinja"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(value, encoding="utf-8")
        tmp.replace(path)                          # whole or absent: a concurrent start reads either
    return path


def serve_options(args: argparse.Namespace):
    """`moepipe serve` flags as the launcher's ServeOptions (flags left unset keep the config defaults)."""
    from gateway.launcher import ServeOptions
    from shared.cluster_config import DTYPE_ALIASES, parse_names

    names = args.served_model_name or []
    _model_taken_by(args, names, "--served-model-name", "name", lambda v: "/" in v or _exists(v))
    keys = args.api_key or []
    # a key may hold '/' (base64): only a Hub id's shape or a path's counts as a model
    _model_taken_by(args, keys, "--api-key", "key", lambda v: bool(_HUB_ID.fullmatch(v) or _PATH.fullmatch(v)) or
                    _exists(v))
    # an empty value (`--api-key "$KEY"` with KEY unset) served with no key at all, or under the name ""
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key: an empty key (an unset variable?); the server would require no key: give the "
                         "key, or leave --api-key out to serve without one")
    if any(not n.strip() for n in names):
        raise ValueError("--served-model-name: an empty name; give the name(s) the API answers to, or leave the "
                         "flag out (moepipe)")
    if not args.host.strip():
        # `--host "$HOST"` with HOST unset: the gateway bound every interface while the launcher polled
        # http://:PORT/health, which never answers, and hung start_timeout (300 s) before failing
        raise ValueError("--host: an empty address (an unset variable?); give the address to listen on (0.0.0.0 "
                         "for every interface), or leave --host out (127.0.0.1)")
    if args.chat_template is not None and not args.chat_template.strip():
        # `--chat-template "$TEMPLATE"` with TEMPLATE unset served the checkpoint's template without a word
        raise ValueError("--chat-template: an empty value (an unset variable?); give a template file or the "
                         "template itself, or leave the flag out (the checkpoint's template)")
    if not 1 <= args.port <= 65535:       # 0 would bind a random port the launcher cannot find
        raise ValueError(f"--port {args.port}: must be between 1 and 65535")
    if args.model_tag and args.model and Path(args.model_tag) != Path(args.model):
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    if args.stages is not None and args.pipeline_parallel_size is not None and \
            args.stages != args.pipeline_parallel_size:
        raise ValueError(f"--stages {args.stages} and --pipeline-parallel-size {args.pipeline_parallel_size} differ "
                         f"(they are one setting: the pipeline's stage processes)")
    if args.tensor_parallel_size not in (None, 1):
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: moepipe splits a model into pipeline "
                         f"stages, one GPU each; use --pipeline-parallel-size (--stages) {args.tensor_parallel_size}")
    if args.tool_call_parser and args.tool_call_parser not in JSON_TOOL_PARSERS + XML_TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {args.tool_call_parser}: moepipe parses tool calls in the hermes JSON "
                         f"form (<tool_call>{{\"name\": ..., \"arguments\": ...}}</tool_call>) and in "
                         f"qwen3_coder's <function=...> XML form only; a model that writes another form would have "
                         f"its calls returned as text. Leave the flag out: the chat template's form is parsed")
    for flag, value in (("--tool-call-parser", args.tool_call_parser), ("--reasoning-parser", args.reasoning_parser)):
        if value:       # vLLM needs them; here the chat template's format decides (docs/agents.md)
            print(f"moepipe: {flag} {value} is not needed: tool calls and reasoning are parsed in the format of "
                  f"the model's chat template (docs/agents.md)", file=sys.stderr)
    if args.device is None:
        args.device = "cpu"
        if _has_nvidia_gpu():
            print("moepipe: serving on the CPU (--device cpu, the default); add --device cuda to serve on the "
                  "GPU(s)", file=sys.stderr)
    # Each memory flag named alone: the config's joint check named both keys, the one not given too
    # (`--kv-cache-memory-bytes -5` read "vram_limit and --kv-cache-memory-bytes must be ..., got 0.0 and -5").
    for flag, value in (("--vram-limit", args.vram_limit), ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes)):
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"{flag} {value}: must be a finite number >= 0 (0 = no limit)")
    if args.cold_experts is not None and not args.cold_experts.strip():
        # an unset variable (`--cold-experts "$COLD"`) resolved to the working directory, refused as "not a
        # readable cold-set file (Is a directory)"
        raise ValueError("--cold-experts: an empty path (an unset variable?); give a file from `moepipe cold-set`, "
                         "'auto', or leave the flag out (every expert in VRAM)")
    if args.kv_row_cache_mib is not None and args.kv_row_cache_mib > 0 and not args.qsa_kv_offload:
        print(f"moepipe: --kv-row-cache-mib {args.kv_row_cache_mib} applies only with --qsa-kv-offload (it caches "
              f"the host K/V rows decode reads)", file=sys.stderr)
    if args.device == "cpu":
        gpu_only = [f for f, v in (("--gpu-memory-utilization", args.gpu_memory_utilization),
                                   ("--vram-limit", args.vram_limit),
                                   ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes),
                                   ("--kv-row-cache-mib", args.kv_row_cache_mib if args.qsa_kv_offload and
                                    args.kv_row_cache_mib else None),
                                   ("--enforce-eager", args.enforce_eager or None)) if v is not None]
        if gpu_only:
            print(f"moepipe: {', '.join(gpu_only)} {'applies' if len(gpu_only) == 1 else 'apply'} only on a GPU; "
                  f"the cluster runs on the CPU (add --device cuda)", file=sys.stderr)
    model_dir = args.model_tag if args.model_tag is not None else args.model
    model = model_arg(model_dir, "--model" if args.model_tag is None else "MODEL")
    _vllm_only_flags(args, model)
    extra = {}
    if names:
        extra["served_model_name"] = names[0]
        if len(names) > 1:                 # vLLM answers to every name given
            extra["served_model_aliases"] = list(dict.fromkeys(names[1:]))
    if args.dtype:          # "auto" too: the checkpoint's, over MOEPIPE_DTYPE (flags win over the environment)
        extra["dtype"] = DTYPE_ALIASES[args.dtype]
    if args.enforce_eager:
        extra["cuda_graphs"] = False
    if args.chat_template:
        extra["chat_template"] = str(chat_template_file(args.chat_template))
    if args.chat_template_content_format:
        extra["chat_template_content_format"] = args.chat_template_content_format
    if args.no_ple_service:
        extra["ple_service"] = False
    if args.no_access_log:
        extra["access_log"] = False
    if args.clamp_max_tokens:
        extra["clamp_max_tokens"] = True
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
            extra[key] = parse_names(getattr(args, key), "--" + key.replace("_", "-"))
    if args.load_format == "auto":         # vLLM's default: a checkpoint's safetensors (moepipe's only format)
        args.load_format = None
    for key in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "max_model_len",
                "load_format", "kv_cache_memory", "api_key", "restart_limit", "gpu_memory_utilization",
                "vram_limit", "kv_cache_memory_bytes", "enable_prefix_caching", "prefix_cache_states"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    stages = next((n for n in (args.stages, args.pipeline_parallel_size) if n is not None), 1)
    return ServeOptions(model=model, stages=stages, device=args.device, host=args.host, port=args.port,
                        extra=extra, verbose=args.verbose)


# vLLM's hermes-style parsers: the JSON form moepipe's output parser reads (gateway/output_parser.py)
JSON_TOOL_PARSERS = ("hermes", "qwen", "qwen25", "qwen3", "json")
# vLLM's parsers of the Qwen3-Coder / Qwen3.5 XML form (<function=NAME><parameter=KEY>...), parsed too; which form a
# reply is read in follows the chat template (Tokenizer.tool_call_form), not the flag
XML_TOOL_PARSERS = ("qwen3_coder", "qwen3_xml")

# vLLM flags with nothing to set here: (flag, takes a value, what happens: "ok" accepted silently, "note" accepted
# with the message, "refuse" a one-line error with the message; a value listed after "|" is accepted silently)
VLLM_ONLY_FLAGS = (
    ("--enable-chunked-prefill", False, "ok", "prefill is always chunked (--max-num-batched-tokens)"),
    ("--no-enable-chunked-prefill", False, "note", "prefill is always chunked here (--max-num-batched-tokens sets "
                                                   "the chunk)"),
    ("--enable-log-requests", False, "ok", "moepipe never logs prompts"),
    ("--max-log-len", True, "ok", "moepipe never logs prompts"),
    ("--language-model-only", False, "ok", "moepipe serves text only"),
    ("--limit-mm-per-prompt", True, "note", "moepipe serves text only (image and audio parts are refused)"),
    ("--speculative-config", True, "note", "no speculative decoding (MTP drafts) yet: tokens are the same, one a "
                                           "step"),
    ("--seed", True, "note", "sampling seeds are per request (the `seed` field; a request without one draws its "
                             "own)"),
    ("--swap-space", True, "note", "preempted requests are recomputed, not swapped"),
    ("--uvicorn-log-level", True, "note", "use -v for INFO logs and --no-access-log for fewer lines"),
    ("--kv-cache-dtype", True, "refuse|auto", "the KV cache is kept in the compute dtype (--dtype); fp8 KV is not "
                                              "supported"),
    ("--quantization", True, "refuse", "a quantized checkpoint's scheme is read from its config.json; to quantize "
                                       "a bf16 one: moepipe quantize --scheme fp8-block|int4-experts|reports-mixed "
                                       "IN OUT"),
    ("--response-role", True, "refuse|assistant", "a reply's message role is always assistant (vLLM's default)"),
    ("--generation-config", True, "refuse|auto", "sampling defaults come from the checkpoint's "
                                                 "generation_config.json (vLLM's auto)"),
    ("--cpu-offload-gb", True, "refuse", "weights beyond the GPU go to host RAM as cold experts: --cold-experts "
                                         "auto with --vram-limit GIB or --gpu-memory-utilization"),
    ("--download-dir", True, "refuse", "moepipe does not download: huggingface-cli download ID --local-dir DIR, "
                                       "then moepipe serve DIR"),
    ("--revision", True, "refuse", "moepipe does not download: huggingface-cli download ID --revision REV "
                                   "--local-dir DIR, then moepipe serve DIR"),
    ("--tokenizer", True, "refuse", "the tokenizer is the checkpoint's own (tokenizer.json in the model "
                                    "directory)"),
    # more of what Qwen3-Next / Qwen3.5 `vllm serve` lines carry (2026-12-07)
    ("--async-scheduling", False, "ok", "plan-ahead scheduling is on by default (MOEPIPE_ASYNC_SCHEDULING=0 turns it "
                                        "off)"),
    ("--no-async-scheduling", False, "refuse", "plan-ahead scheduling is turned off by MOEPIPE_ASYNC_SCHEDULING=0 "
                                               "(the cluster key async_scheduling)"),
    ("--enable-expert-parallel", False, "note", "a pipeline stage keeps its layers' experts on its own GPU; experts "
                                                "beyond its memory go to host RAM (--cold-experts auto)"),
    ("--compilation-config", True, "note", "decode replays CUDA graphs moepipe captures itself (--enforce-eager "
                                           "turns them off); nothing goes through torch.compile"),
    ("--max-seq-len-to-capture", True, "ok", "decode graphs serve every context length"),
    ("--max-logprobs", True, "note|20", "logprobs and top_logprobs go up to 20, the OpenAI API's limit"),
    ("--enable-request-id-headers", False, "ok", "every reply carries X-Request-Id (the client's, or one made)"),
    ("--disable-fastapi-docs", False, "ok", "moepipe serves no /docs or /redoc pages (/openapi.json stays)"),
    ("--distributed-executor-backend", True, "note|mp", "stages are processes linked over ZeroMQ (--stages)"),
    ("--return-tokens-as-token-ids", False, "refuse", "set return_tokens_as_token_ids in each request (the "
                                                      "server-wide default is not supported)"),
    ("--hf-overrides", True, "refuse", "the model's settings are its config.json: edit a copy of the checkpoint's "
                                       "config.json instead"),
)


def _vllm_only_flags(args: argparse.Namespace, model) -> None:
    """Each vLLM-only flag given: accepted, accepted with a note, or refused naming it and what to do instead."""
    for flag, _, rule, why in VLLM_ONLY_FLAGS:
        value = getattr(args, "vllm_" + flag[2:].replace("-", "_"), None)
        if value is None or value is False:
            continue
        kind, _, fine = rule.partition("|")
        if flag == "--quantization" and value in _VLLM_METHODS.get(_quant_method(model), ()):
            continue                              # what the checkpoint holds: vLLM's redundant hint
        if flag == "--tokenizer" and Path(value).resolve() == Path(model).resolve():
            continue                              # the model directory again
        if flag == "--cpu-offload-gb" and _is_zero(value):
            continue                              # vLLM's default, no offload: nothing asked that moepipe lacks
        shown = flag if value is True else f"{flag} {value}"
        if kind == "ok" or (fine and value in fine.split(",")):
            continue
        if kind == "refuse":
            raise ValueError(f"{shown}: {why}")
        print(f"moepipe: {shown} ignored: {why}", file=sys.stderr)


# A checkpoint's quant_method -> the --quantization values vLLM takes for it (its kernel choices included), each of
# which only repeats what config.json says: GPTQ's and AWQ's Marlin / BitBLAS / MoE kernels, AutoRound's `inc` (its
# name in vLLM since 2025) and the kernels its GPTQ and AWQ packings run on.
_GPTQ_KERNELS = ("gptq", "gptq_marlin", "gptq_bitblas", "moe_wna16")
_VLLM_METHODS = {
    "compressed-tensors": ("compressed-tensors",),
    "fp8": ("fp8",),
    "gptq": _GPTQ_KERNELS,
    "awq": ("awq", "awq_marlin", "moe_wna16"),
    "auto-round": ("auto-round", "auto_round", "inc", "awq", "awq_marlin") + _GPTQ_KERNELS,
    "auto_round": ("auto-round", "auto_round", "inc", "awq", "awq_marlin") + _GPTQ_KERNELS,
    "intel/auto-round": ("auto-round", "auto_round", "inc", "intel/auto-round") + _GPTQ_KERNELS,
}


def _is_zero(value: str) -> bool:
    try:
        return float(value) == 0
    except ValueError:
        return False


def _quant_method(model) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (config.json, or its `text_config` in a multimodal
    wrapper's, or AutoGPTQ's quantize_config.json), if any."""
    from shared.quant_scheme import config_with_quantization

    try:
        cfg = config_with_quantization(model)
    except TypeError:
        return None
    for c in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        q = c.get("quantization_config") if isinstance(c, dict) else None
        if isinstance(q, dict):
            return q.get("quant_method")
    return None


def _has_nvidia_gpu() -> bool:
    """An NVIDIA driver's device node (no CUDA context, no torch import for a hint)."""
    return Path("/dev/nvidiactl").exists()


def _is_checkpoint(value: str) -> bool:
    try:
        return bool(value) and (Path(value) / "config.json").is_file()
    except OSError:             # a value longer than a path may be (a key): ENAMETOOLONG
        return False


def _exists(value: str) -> bool:
    try:
        return bool(value) and Path(value).exists()
    except OSError:
        return False


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")                       # Qwen/Qwen3-Next-80B-A3B-Instruct
_PATH = re.compile(r"(?:~|\.{1,2})?/[\w.-]+(?:/[\w.-]*)*")     # /models/qwen, ./qwen, ~/models/qwen


def _model_taken_by(args: argparse.Namespace, values: list[str], flag: str, what: str, looks_like_model) -> None:
    """vLLM's --served-model-name and --api-key take several values (nargs="+"), so argparse hands them the MODEL
    written after them (`vllm serve --api-key KEY Qwen/Qwen3-Next-80B-A3B-Instruct`), and with no model left the
    built-in demo model would be served, under the model's name or with it as a key. When no model was given
    otherwise, the last value, if a checkpoint directory, is the model (taken out of `values`); one that
    `looks_like_model` (a Hub id, a path) but is no checkpoint here is refused as a model would be (moepipe does
    not download). vLLM's own order, `vllm serve MODEL --api-key K1 K2`, never comes here."""
    if args.model_tag is not None or args.model is not None or not values:
        return
    last = values[-1]
    if _is_checkpoint(last):
        if len(values) == 1:
            raise ValueError(f"{flag} took {last} (a checkpoint directory) as the {what} and no model was given: put "
                             f"the model first (`moepipe serve {last} {flag} {what.upper()}`) or use --model")
        args.model_tag = values.pop()
    elif looks_like_model(last):
        # the demo model would be served under it or with it as a key; as the model it is no local checkpoint
        if _exists(last):
            why = "is not a checkpoint directory (config.json, *.safetensors, tokenizer.json)"
        elif _HUB_ID.fullmatch(last):
            why = (f"is no local directory (moepipe does not download: `huggingface-cli download {last} --local-dir "
                   f"DIR`)")
        else:
            why = "is no such directory (moepipe does not download)"
        raise ValueError(f"{flag} took {last} as a {what} and no model was given; a model is a local checkpoint "
                         f"directory and {last} {why}: `moepipe serve DIR {flag} {what.upper()}`")


def _serve(args: argparse.Namespace) -> int:
    from gateway.launcher import run_serve
    from shared.cluster_config import ClusterConfigError

    opts = serve_options(args)
    try:
        return run_serve(opts)
    except ClusterConfigError as exc:     # the cluster config names its keys; the user typed flags
        flags = {key: flag for key, flag in args.config_flags.items() if key in (opts.extra or {})}
        raise ValueError(name_flags(str(exc), flags)) from None


def name_flags(message: str, flags: dict[str, str]) -> str:
    """A cluster config error with each key a flag set named as that flag (`gpu_memory_utilization must be ...` ->
    `--gpu-memory-utilization must be ...`, once where it read `key (--flag)`), without its `cluster config:`
    prefix then: the user gave a flag, not a file. Keys set otherwise (a variable, a default) keep their names."""
    named = message
    for key, flag in flags.items():
        named = re.sub(rf"\b{re.escape(key)}\b(?: \({re.escape(flag)}\))?", flag, named)
    return named.removeprefix("cluster config: ") if named != message else message


def _flags_by_dest(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> the long flag that sets it, read off the parser (no table to keep in step with it); a dest that is a
    cluster config key (`--max-model-len` -> max_model_len) names that key's flag."""
    return {a.dest: longs[0] for a in parser._actions if (longs := [o for o in a.option_strings if o[:2] == "--"])}


def build_parser() -> argparse.ArgumentParser:
    p, sub = command_parser()

    s = sub.add_parser("serve", help="start the whole cluster and serve the OpenAI API")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, as `vllm serve MODEL` takes it (or --model)")
    s.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    s.add_argument("--stages", type=int, default=None, help="pipeline stages, one process each (default 1)")
    s.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="N",
                   help="vLLM's name for --stages")
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="1",
                   help="accepted as 1 only: moepipe splits a model by layers (--pipeline-parallel-size)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) the API answers to and lists; responses carry the first "
                        "(default: moepipe)")
    s.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "half", "float32", "float"],
                   help="compute dtype (default: MOEPIPE_DTYPE, else the checkpoint's; auto = the checkpoint's, over "
                        "MOEPIPE_DTYPE; float32 on a CPU for bf16/fp16 checkpoints)")
    s.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template used instead of the checkpoint's: a file, or the template itself as "
                        "vLLM takes it (a value with '{', '}' or a line break that is no file)")
    # the choices are cluster_config.CHAT_TEMPLATE_CONTENT_FORMATS, written out so --help imports no config module
    s.add_argument("--chat-template-content-format", default=None, choices=("auto", "string", "openai"),
                   help="how message content reaches the chat template, as vLLM's: auto (default) = as the "
                        "template reads it (a loop over content: a list of parts; else a string), string = text "
                        "parts joined, openai = a list of parts (also MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="GPU stages: no CUDA graphs (also MOEPIPE_CUDA_GRAPHS=0)")
    s.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default cpu")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="1-65535 (default 8000)")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=human_int, default=None, metavar="N",
                   help="tokens per step (default 512, 2048 with --device cuda; at most 1,048,576; 8k, 8K as "
                        "--max-model-len; also MOEPIPE_MAX_NUM_BATCHED_TOKENS)")
    s.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per stage (default: max-num-seqs sequences of max-model-len within "
                        "--kv-cache-memory)")
    s.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: derived from the model, a multiple of its QSA ratio)")
    s.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB of KV blocks per stage when --num-blocks is not given (default 4; on a GPU at "
                        "least one --max-model-len sequence)")
    s.add_argument("--max-model-len", type=max_model_len_arg, default=None, metavar="N",
                   help="longest prompt + output in tokens: 32768, 32k (32,000), 32K (32,768); auto or -1: the "
                        "model's own (the default; on a GPU the longest that fits the memory)")
    s.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="GPU stages: the share of each device's memory the server may use (default 0.9)")
    s.add_argument("--vram-limit", type=float, default=None, metavar="GIB",
                   help="GPU stages: use at most this many GiB of each device, as a smaller card would have")
    s.add_argument("--kv-cache-memory-bytes", type=human_int, default=None, metavar="BYTES",
                   help="GPU stages: KV bytes per stage, 8G = 8 GiB (default: what the memory plan leaves)")
    s.add_argument("--cold-experts", default=None, metavar="FILE",
                   help="keep these routed experts in host RAM (a file from `moepipe cold-set`, or 'auto': as "
                        "few as the memory plan needs, the least used by the checkpoint's route_usage.json if it "
                        "has one): a model larger than the GPUs runs, reading the selected host experts over PCIe")
    s.add_argument("--no-expert-moves", action="store_true",
                   help="with --cold-experts: never swap host and device experts at run time (also "
                        "MOEPIPE_EXPERT_MOVES=0)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="restore the state saved after an earlier prompt's first tokens instead of computing them "
                        "again (on by default; also MOEPIPE_PREFIX_CACHING=0/1)")
    s.add_argument("--prefix-cache-states", type=int, default=None, metavar="N",
                   help="saved prefix states per stage, each one sequence's recurrent state in host RAM (default "
                        "16; also MOEPIPE_PREFIX_CACHE_STATES)")
    s.add_argument("--qsa-kv-offload", action="store_true",
                   help="keep the QSA layers' K/V in pinned host RAM (only pooled keys in VRAM: far more tokens of "
                        "context per GiB; decode reads the selected rows over PCIe; also MOEPIPE_QSA_KV_OFFLOAD=1)")
    s.add_argument("--kv-row-cache-mib", type=int, default=None, metavar="MIB",
                   help="with --qsa-kv-offload: cache the K/V rows decode reads from host RAM in MIB of VRAM per "
                        "stage (default 256; 0: off; also MOEPIPE_KV_ROW_CACHE=0/1, MOEPIPE_KV_ROW_CACHE_MIB)")
    s.add_argument("--restart-limit", type=int, default=None, metavar="N",
                   help="restart a dead stage or PLE service up to N times in a row (default 5; 0: never); once "
                        "a component's restarts are used up, serve exits with status 1")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes, any of the keys given as vLLM takes "
                        "several (also MOEPIPE_API_KEY, or as vLLM VLLM_API_KEY when neither is given: one key)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser origins allowed to call the API, comma-separated or a JSON list as vLLM takes "
                        "it ('[\"*\"]'; CORS; default none; also MOEPIPE_ALLOWED_ORIGINS)")
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="Host names to answer, comma-separated or a JSON list, '*' for any (default: loopback names "
                        "when bound to a loopback address, else any; also MOEPIPE_ALLOWED_HOSTS)")
    s.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default=None,
                   help="auto (vLLM's default) = safetensors, the checkpoint's weights; dummy: seeded random "
                        "weights, no file reads (a config-only checkpoint such as full-shape)")
    s.add_argument("--no-ple-service", action="store_true",
                   help="gather PLE rows inside the stage instead of the PLE service (A/B fallback)")
    s.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="no_access_log", action="store_true",
                   help="no access log line per HTTP request (vLLM's name is the alias)")
    s.add_argument("--clamp-max-tokens", action="store_true",
                   help="cut a max_tokens past what the context leaves after the prompt to fit (llama.cpp's rule) "
                        "instead of answering 400 as vLLM and OpenAI do: for agents that send a fixed cap larger "
                        "than the context (also MOEPIPE_CLAMP_MAX_TOKENS=1)")
    vllm = s.add_argument_group("accepted for vLLM command lines; nothing to set here")
    vllm.add_argument("--trust-remote-code", action="store_true", help="(the model code is moepipe's own)")
    vllm.add_argument("--enable-auto-tool-choice", action="store_true", help="(tool calls are always parsed)")
    vllm.add_argument("--tool-call-parser", default=None, metavar="NAME",
                      help="(the chat template's format is parsed)")
    vllm.add_argument("--reasoning-parser", default=None, metavar="NAME", help="(likewise <think> blocks)")
    vllm.add_argument("--disable-log-requests", "--disable-log-stats", action="store_true",
                      help="(moepipe never logs prompts or sampling parameters, which vLLM's --disable-log-requests "
                           "turns off, nor periodic stats (/metrics has them); the one access-log line per HTTP "
                           "request stays: --no-access-log turns it off)")
    for flag, takes_value, rule, why in VLLM_ONLY_FLAGS:
        dest = "vllm_" + flag[2:].replace("-", "_")
        kind, _, fine = rule.partition("|")
        what = {"refuse": "refused", "note": "ignored", "ok": "accepted"}[kind] + (f" unless {fine}" if fine else "")
        if takes_value:
            vllm.add_argument(flag, dest=dest, default=None, metavar="X", help=f"({what}: {why})")
        else:
            vllm.add_argument(flag, dest=dest, action="store_true", help=f"({what}: {why})")
    s.set_defaults(func=_serve, config_flags=_flags_by_dest(s))

    k = sub.add_parser("keys", help="write the CurveZMQ certificate that authenticates and encrypts the cluster's "
                                    "links between hosts (cluster config: link_keys)")
    k.add_argument("--out", required=True, type=_keys_dir, help="directory for cluster.key and cluster.key_secret")
    k.set_defaults(func=_keys)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
