"""The cluster config file (TOML): one file describes every process, so each can also run alone as a systemd unit.

Every speed-relevant feature has a switch here (and an environment override read in this module only), so it can
be measured against its absence.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from shared.kv_layout import (GIB, KvLayoutError, auto_num_blocks, compute_dtype, default_kv_budget,
                              resolve_block_size, stage_block_cost)
from shared.model_config import HybridMoeConfig


# the least non-zero stall_timeout (see the field): a healthy stage can go this long without a layer finishing
MIN_STALL_TIMEOUT = 30.0


class ClusterConfigError(ValueError):
    """A cluster config the processes cannot run with; the message names the key."""


# `dummy_quant` values: "" (the compute dtype), routed experts as random INT4 words, and those plus the reports'
# release for the plain-linear layers (INT6 groups of 128, lm_head and the mix INT8: quant_linear.dummy_specs).
DUMMY_QUANTS = ("", "int4-experts", "reports-mixed")
PLE_PREFETCH_METHODS = ("madvise", "fadvise", "pread")   # ple_prefetch_method (ple_service/prefetch.py make_advisors)
EXPERT_MOVE_HALF_LIFE_UNITS = ("steps", "tokens")        # expert_move_half_life_unit
MAX_EXPERT_MOVE_CLAIMS = 16        # claims a layer a step (expert_move_claims): 2C spare slots a table
MAX_EXPERT_PREFETCH = 16           # prefetch slots a table (expert_prefetch)
# `chat_template_content_format` (vLLM's --chat-template-content-format): how a message's content reaches the chat
# template. "auto": as the template reads it (shared/tokenizer.py detects a loop over content); "string": text parts
# joined by newlines, null as ""; "openai": a list of parts (a string one text part, null none)
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")

# The prefill chunk `moepipe serve --device cuda` takes when --max-num-batched-tokens is not given (the CPU keeps
# the field's 512). A GPU chunk of 512 tokens is launch- and weight-read-bound: every chunk reads nearly all of a
# layer's experts (512 tokens x top-10 of 512) and launches ~3,700 kernels, so 2048 prefills 2.7-3.3x faster
# (h200-25: 16,384 tokens of the full shape's 20 layers in 1.22 s against 3.26-4.10 s) at about the same time a
# chunk (152 against 102-128 ms: what a decode stream waits while a prompt is prefilled beside it). The dense
# attention path takes the chunk's queries 512 at a time (model/attention.py DENSE_PREFILL_QUERIES), so the plan's
# reserve grows by the other layers' activations only. vLLM's own default on large GPUs is 2048-8192.
GPU_MAX_NUM_BATCHED_TOKENS = 2048
# Sequences at once, at most: each is a state slot in every stage and a block-table row in the engine core
# (vLLM's defaults are 256-1024).
MAX_NUM_SEQS = 16384
# Tokens in one step, at most (`max_num_batched_tokens`): the PLE ring, the activation reserve and the step's
# buffers are sized by it at start-up, so 10^11 was an ENOMEM inside the PLE service. vLLM's large-GPU defaults are
# 2048-16384; for_model also refuses more than max_num_seqs x max_model_len (a step can never hold more).
MAX_NUM_BATCHED_TOKENS = 1 << 20
# The compute dtypes (`dtype`) and the names `moepipe serve --dtype` and MOEPIPE_DTYPE also take for them, as
# vLLM's --dtype ("auto" and "": the checkpoint's).
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"auto": "", "": "", "half": "float16", "float": "float32", **{d: d for d in DTYPES}}
# The kernel families `kernels` / MOEPIPE_KERNELS may name, one `stage_worker.kernels.flags.KernelFlags` field each
# (flags.py takes the list from here, as `NAMES`): the launcher and every component refuse a misspelt one at load,
# naming the key, before a stage starts.
KERNEL_NAMES = ("moe", "moe_prefill", "moe_int4_prefill", "hyper_connection", "rmsnorm", "attention", "deltanet",
                "moe_int4_fused", "quant_gemv_fma", "qsa_tiles", "section_attention", "quant_gemv_wide",
                "section_union", "sample_race", "pdl", "l2_prefetch", "quant_dequant", "sdpa_prefill", "side_stream",
                "fused_router", "route_key32", "staged_inputs")


def host_ram() -> int | None:
    """This host's physical RAM in bytes (None off POSIX): the bound an explicit size on its CPU stages is checked
    against."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def kernels_error(spec: str) -> str | None:
    """Why a `kernels` value is not one KernelFlags.parse takes ("all", "none", or a comma list of names, each
    optionally prefixed with '-'), or None."""
    if not isinstance(spec, str):
        return f"expected a string, got {spec!r}"
    spec = spec.strip()
    if spec in ("", "none", "0", "off"):
        return None
    for part in spec.split(","):
        part = part.strip()
        name = part[1:] if part.startswith("-") else part
        if part not in ("", "all") and name not in KERNEL_NAMES:
            return f"unknown kernel {name!r}: choose from {', '.join(KERNEL_NAMES)}, all, none"
    return None


def parse_names(value: str, what: str) -> list[str]:
    """A list of names as a flag or variable gives it: comma-separated (`a,b`) or, as vLLM takes it, a JSON list
    (`["*"]`); ClusterConfigError naming `what` for a JSON value that is not a list of strings."""
    text = value.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError as exc:
            raise ClusterConfigError(f"{what} {value!r}: not a JSON list ({exc}); give names separated by commas "
                                     f"or a JSON list such as '[\"*\"]'") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ClusterConfigError(f"{what} {value!r}: a JSON list must hold strings")
        return [n.strip() for n in names if n.strip()]
    return [n.strip() for n in text.split(",") if n.strip()]


@dataclass
class StageSpec:
    start: int                    # first decoder layer (inclusive)
    end: int                      # last decoder layer (exclusive)
    endpoint: str                 # the stage's inbox, a ZeroMQ endpoint it binds
    device: str = "cpu"


@dataclass
class ClusterConfig:
    model: str
    stages: list[StageSpec]
    gateway_endpoint: str                       # the gateway's inbox (results, heartbeats)
    ple_endpoint: str = ""                      # the PLE service's inbox ("" = no PLE service process)
    ple_ring: str = ""                          # shared-memory file of the PLE gather ring
    ple_ring_slots: int = 0                     # 0 = the steps in flight + 2 (resolved by for_model)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "moepipe"
    served_model_aliases: list[str] = field(default_factory=list)   # more names the API answers to and lists
    #                                           (vLLM's --served-model-name after the first); responses carry the first
    chat_template: str = ""                     # a Jinja file instead of the checkpoint's templates ("" = theirs)
    chat_template_content_format: str = "auto"  # CHAT_TEMPLATE_CONTENT_FORMATS: "auto" = read off the template
    dtype: str = ""                             # "" = the checkpoint's (float32 for bf16/fp16 on a CPU)
    load_format: str = "safetensors"
    dummy_quant: str = ""                       # "dummy" format: "int4-experts" = routed experts packed INT4;
                                                # "reports-mixed" = those and, with packed_dense on a GPU, the
                                                # plain-linear layers packed as the reports' release (benchmarks)
    dummy_ple_file: bool = False                # "dummy" format: PLE tables written to files beside the model and mapped,
                                                # so gathers read disk and page cache (cold-start benchmarks)
    block_size: int = 0                         # 0 = derived from the model (shared/kv_layout.py)
    num_blocks: int = 0                         # 0 = auto: max_num_seqs x max_model_len within kv_cache_memory
    kv_cache_memory: float = 0.0                # GiB of KV blocks per stage when num_blocks is auto; 0 = 4 GiB,
                                                # on a GPU at least one max_model_len sequence (default_kv_budget)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512           # `moepipe serve --device cuda`: GPU_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 0                      # 0 = the model's max_position_embeddings
    max_queue: int = 256                        # waiting requests beyond this get 429
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.5             # /health turns 503 within 3 s of a component's death
    # Feature switches (A/B): the PLE service gathers rows (off = stage gathers in-process, the fallback);
    # prompt prefetch with process_madvise; micro-batches across stages.
    ple_service: bool = True
    ple_prefetch: bool = True
    # threads advising a prompt's table pages (ple_service/prefetch.py): one walked a 32k-token prompt's ~500k
    # random pages too slowly for a cold prefill (H200 h200-14: 1.9 s of row waits, cold TTFT 1.8x warm)
    ple_prefetch_threads: int = 4
    # how the prefetch reads those pages (ple_service/prefetch.py): "madvise" (MADV_WILLNEED, process_madvise),
    # "fadvise" (POSIX_FADV_WILLNEED per range on the file: no VMA walk, no mmap lock) or "pread"
    # (ple_prefetch_depth threads read the pages into the page cache, that many reads in flight). h200-15: 4 threads
    # in process_madvise advised no faster than 1 (~110-125k pages/s); madvise until the H200 measures the others
    ple_prefetch_method: str = "madvise"
    ple_prefetch_depth: int = 32
    microbatches: int = 0                       # 0 = one per stage
    kernels: str = "all"                        # fast CUDA kernels: all, none, or a list (kernels/flags.py)
    cuda_graphs: bool = True                    # replay decode steps from CUDA graphs (GPU stages only)
    ple_graph: bool = True                      # stages holding PLE layers replay graphs too (rows in static buffers)
    ple_decode_in_stage: bool = True            # with the service: a PLE stage gathers its decode steps' rows itself
    ple_decode_in_stage_max_seqs: int = 0       # ... for steps of at most this many sequences (larger: the service's;
                                                # 0 = every decode step)
    ple_gather_numpy: bool = True               # ... hashed and gathered in numpy (ple_decode_rows.py), not torch ops
    graph_skip_padding: bool = True             # a graph's padding rows route to no expert (read no expert rows)
    async_scheduling: bool = True               # plan-ahead: a micro-batch's next plan before its step's result
    skip_cancelled_steps: bool = True           # a request that ends while plans in flight hold it is sent to the
                                                # stages at once (`Plan.cancelled`) and they skip its steps; CPU
                                                # stages compute one step at a time, reading the inbox between
    launch_ahead: bool = True                   # one stage: a decode step is queued on the GPU before the previous
                                                # step's tokens reach the host (its ids read on the device)
    ple_launch_ahead: bool = True               # ... on a stage holding PLE layers too: its graph waits on the device
                                                # for the rows the host gathers once the token is in (host_wait.py)
    ple_launch_ahead_across_stages: bool = True   # ... also when stage 0 is not the last stage: the graph also waits
                                                # for the ids the last stage's Sampled brings (h100-32, two stages
                                                # on one H100: 980.4 against 854.0 tok/s without it)
    ple_sample_after_rows: bool = True          # ... a launched-ahead step's sampler is queued only once its graph
                                                # has its rows: a CUDA call that waits for the device (a kernel's
                                                # first load) made while the graph spins waited out host_wait's
                                                # timeout (h100-33: 3.3 s of 3.3 behind a spinning kernel)
    stage_spin_wait: bool = True                # a GPU stage with a step in flight polls without blocking, so the
                                                # step's end is seen at once (off: 1 ms polls, ~0.5 ms a step late)
    startup_warmup: bool = True                 # a GPU stage runs its prefill path and the sampler once before its
                                                # first heartbeat (stage_worker/warmup.py): the first request does
                                                # not pay their compiles (h200-16: TTFT 11-16 s, then 0.07 s)
    # Same-host GPU stages hand a decode step's activations to the next stage through a ring of device slots
    # shared by CUDA IPC, at launch, instead of device -> host -> ZeroMQ -> host -> device after the step
    # (stage_worker/ipc_activations.py; issue 14: ~1.48 ms a step between two stages of one H200). On since its GPU
    # tests passed on the H200 (h200-17/18); two stages on one GPU, 4 streams: 583.8 against 476.6 tok/s (h200-17).
    cuda_ipc_activations: bool = True
    batched_prefill: bool = True                # a prefill step's sequences run as one padded batch (StepBatch.ragged)
    # Prefix caching (shared/prefix_cache.py): a prompt that starts with an earlier prompt's tokens restores the
    # state saved there and computes only the rest (vLLM's --enable-prefix-caching). Each saved state is one
    # sequence's recurrent state on every stage, kept in host RAM (prefix_cache_states of them, numbered after the
    # running requests' slots and the scratch slot), and holds its KV blocks until evicted, least recently used
    # first, before any running request is preempted for blocks.
    enable_prefix_caching: bool = True
    prefix_cache_states: int = 16
    # A prompt's prefill is cut into one more chunk at a snapshot target only if that saves this many tokens over
    # saving the chunk start before it (a block boundary); -1 = auto: 0 when every stage is a CPU (a step costs its
    # tokens only), 1024 otherwise (a GPU prefill step's launches cost 0.1-0.2 s at 48 layers whatever its tokens)
    prefix_cache_split_tokens: int = -1
    # The gateway's interpreter switch interval (sys.setswitchinterval), in ms: the engine core's thread waits for
    # the GIL after each stage result while the HTTP event loop streams tokens, up to Python's default 5 ms a wait.
    # 0.5 since the H200 timed it (h200-20, full shape 20 layers, one stage): 4 streams 607.8 -> 653.5 tok/s,
    # 16 streams 1,139.7 -> 1,184.4, one stream within noise (3.88 / 3.99 ms TPOT). 0 keeps Python's default.
    gil_switch_interval_ms: float = 0.5
    qsa_sparse_prefill: bool = True             # long-context QSA prefill gathers only the selected keys
    device_sampling: bool = True                # a step's rows sampled together on the device (batch_sampler.py)
    threads_per_stage: int = 1                  # torch intra-op threads of each stage worker (CPU stages)
    ple_threads: int = 1                        # torch intra-op threads of the PLE service's gathers (0 = torch's)
    # The start-up memory plan of GPU stages (shared/memory_plan.py): each device's budget is the smaller of
    # gpu_memory_utilization x its memory and vram_limit GiB; the KV pool takes what weights, state and reserve leave
    # (capped at kv_cache_memory_bytes per stage when set), unless num_blocks is given.
    gpu_memory_utilization: float = 0.9
    vram_limit: float = 0.0                     # GiB per device; 0 = the device's own size
    kv_cache_memory_bytes: int = 0
    measure_reserve: bool = True                # the plan's reserve from one measured prefill chunk per layer kind
    # Routed experts in host RAM (issue 16): a `moepipe cold-set` file ("" = every expert in VRAM); run-time moves
    # swap each layer's most used host expert with its least used device expert every expert_move_interval steps
    # (decode selections, decayed by half every expert_move_half_life steps; a move needs a lead of
    # expert_move_margin). Defaults measured on the H200 (bench/results/expert-offload-3: 10% of expert bytes in
    # host RAM, full shape: 92.7% of all-in-VRAM at batch 1 against 78.9% with the reports' 8 / 512 / 2).
    cold_experts: str = ""
    expert_moves: bool = True
    expert_move_interval: int = 1
    expert_move_half_life: float = 128.0
    expert_move_margin: float = 0.5
    # ... the half-life counted in "steps" (a round's decay 0.5 ** (interval / half_life)) or in "tokens" (0.5 **
    # (decode tokens counted since the last round / half_life): a step of B tokens adds B selections a layer, so at
    # batch 4 a half-life in steps keeps every count ~4x larger and a host expert rarely passes the threshold;
    # docs/performance.md "Moves at batch 4, a CPU study"). "steps" until a GPU measures "tokens".
    expert_move_half_life_unit: str = "steps"
    # ... with moves on read, C host slots a layer may claim a step, 2C spare device slots a table (the kernels and the
    # round take C: `expert_moves.claim_round`); 1 = the default layout, 1 to MAX_EXPERT_MOVE_CLAIMS served (the
    # loader and the memory plan carry it). h100-29: 4 with half-life in tokens and margin 0 is the batch-4 setting.
    expert_move_claims: int = 1
    # ... layer-ahead prefetch (issue 16): this many more device slots a table; at decode each MoE layer's router
    # input also goes through the NEXT layer's router (on a side stream), and the host experts it names, up to this
    # many, are copied into those slots beside the step, so the next layer reads them from VRAM when the guess was
    # right and in time (stage_worker/kernels/expert_prefetch.py). 0 = off. GPU stages, experts of any form; with
    # moves on read or no moves (moves in place would swap experts into the empty prefetch slots).
    expert_prefetch: int = 0
    # ... candidates: each token's best this many predicted experts (0: the layer's top-k); fewer waste less PCIe on
    # wrong guesses (h100-39: with the top 10, 80% of the copies went unused and the prefetch cost more than it saved)
    expert_prefetch_top: int = 0
    # ... only decode steps of at least this many tokens predict and copy (a graph of a smaller batch has none of
    # the prefetch's launches). h100-40 (H100, 16 layers INT4, 10% in host RAM, moves on read, 1 slot): batch 1
    # 92.4% of all in VRAM against 94.2% without the prefetch, batch 4 75.6% against 73.0%: at one token the
    # prediction's and copy's launches cost more than the ~0.5 host reads a token they save.
    expert_prefetch_min_batch: int = 2
    # ... a move round's decision and its counts / slot-map / move-counter bookkeeping in one Triton launch
    # (stage_worker/kernels/expert_moves.py `decide_settle`) instead of ~25 eager ops; the same results bit for
    # bit. On since h200-18 (full shape, INT4 experts, 10% in host RAM, a round every step): a round's GPU span 0.28
    # against 0.87 ms and its host launch 0.30 against 0.89 ms; the step after it 3.22 against 3.34 ms at batch 1.
    expert_move_fused: bool = True
    # ... and replayed from a CUDA graph (one launch a round instead of ~6 Triton launches, 0.41 ms of host time at
    # h200-22 with the GPU idle between them; StageExperts._capture)
    expert_move_graph: bool = True
    # ... or on read: two spare device slots a table, the router through a slot map; the router claims a host slot
    # past the layer's threshold, the decode kernels store its rows into a spare as they read them, and the round
    # commits it and writes the evicted row back on a side stream (StageExperts._claim_round; the fused switch does
    # not apply). On since h200-25: faster than moves in place at 10% of the experts in host RAM (90.4% against
    # 86.3% of all in VRAM, same call) and at 79% served (+14% at one stream, h200-24); off: moves in place.
    expert_move_async: bool = True
    # ... each layer's expert table part as one CUDA-VMM address range, VRAM rows then host-NUMA rows
    # (stage_worker/vmm_range.py, 000 §4.2), instead of device rows plus a slice of one pinned host allocation; the
    # kernels and moves take the same tensors (two views of the range). Where the driver refuses, one warning and the
    # two tables. Off until the H200 runs tests/test_expert_vmm_table.py -m gpu (a first run passed: the tiny model,
    # not yet timed against the two tables).
    expert_vmm_table: bool = False
    # INT4 and NVFP4 / MXFP4 checkpoints (issue 17): routed experts stay in their packed words + scales and run the
    # INT4 kernels (stage_worker/checkpoint/packed_experts.py); off: dequantized to the compute dtype at load.
    packed_experts: bool = True
    # ... and dense Linear weights in INT4/6/8 called as a plain linear (o_proj, out_proj, lm_head, the shared expert
    # beside packed experts) stay packed and run the W4/W6/W8A16 GEMVs (stage_worker/model/quant_linear.py); off:
    # dequantized to the compute dtype at load. On since h200-18: the 48-layer full shape in the reports' precision
    # steps in 6.62 against 7.51 ms at batch 1 (kernels 5.24 against 6.03) and 11.20 against 11.08 at batch 4 (kernels
    # 8.68 against 9.29; back to back 9.14 against 9.77), and holds 3.7 GB less (docs/performance.md).
    packed_dense: bool = True
    # with packed_dense: attention's q/k/v stay packed too (decode: one packed GEMV + the QSA indexer's bf16 rows,
    # Attention.prepare_kernels); off, they are dequantized to bf16 at load (one bf16 GEMV with the indexer's rows,
    # as before). Full shape, INT6: 43 MB a layer less (516 MB for 12 attention layers). On since it was built
    # (2026-12-03), before an H200 A/B of the decode step: AB key noqkv.
    packed_qkv: bool = True
    # Block-FP8 checkpoints (transformers' `fp8`, issue 17): routed experts stay float8 with their 128x128 block
    # scales (half the bf16 bytes) and run the FP8 decode kernel (stage_worker/kernels/moe.py, FP8 mode); off:
    # dequantized to the compute dtype at load. H200 (h200-14, tests/test_kernel_moe_fp8.py): same outputs as the
    # reference, 96 against 150 us for the bf16 kernel at 1 token, 117 against 171 at 4, 190 against 222 at 16.
    packed_fp8_experts: bool = True
    # With cold_experts too: expert tables of float8 slots (bytes and block scales, in VRAM and host RAM alike).
    # On since h200-16 ran the graphed stage with float8 host slots and moves; off: cold experts of a block-FP8
    # checkpoint are dequantized at load into compute-dtype tables (twice the host RAM).
    fp8_expert_tables: bool = True
    # ... and their dense Linear weights called as a plain linear (o_proj, out_proj, the DeltaNet in-projections, a
    # dense MLP, the MTP fc, lm_head when quantized) stay float8 with their block scales and run the FP8 GEMV
    # (stage_worker/model/fp8_linear.py, kernels/fp8_gemv.py): half the bytes a decode step reads for them; off:
    # dequantized to the compute dtype at load. GPU stages only (a CPU stage dequantizes at load). Off by default
    # until the H200 has run the GEMV's GPU tests (bench/results/fp8-dense-1/next.txt).
    packed_fp8_dense: bool = False
    # Long context (issue 18): QSA layers keep their K/V rows and raw indexer keys in one exact-size pinned host
    # allocation per stage, read over PCIe by the decode kernels; only the pooled keys stay in VRAM, so a KV block
    # costs 1/37 of the VRAM at the full shape (stage_worker/model/cache.py, shared/kv_layout.py).
    qsa_kv_offload: bool = False
    # ... and a region of VRAM caching the K/V rows decode steps read from there, keyed by physical row: hits read
    # VRAM, misses host memory in the same kernel, same output bits (stage_worker/kernels/kv_row_cache.py, 002 §5).
    # `kv_row_cache_mib` is the region of one stage, shared by its QSA layers; counted by the memory plan. On by
    # default (it only acts with qsa_kv_offload on a GPU): on the H200 it took one full-shape layer's decode at 262k
    # from 148 to 94 us (batch 1, hits 0.88) with output bits unchanged (bench/results/h200-13).
    kv_row_cache: bool = True
    kv_row_cache_mib: int = 256
    access_log: bool = True                     # the gateway writes one line per HTTP request (gateway/access_log.py)
    # A max_tokens asked for past what the context leaves after the prompt: a 400 naming it (false, vLLM's and
    # OpenAI's answer) or cut to fit (true, llama.cpp's): agents that send a fixed cap (Zed 65,535, qwen-code 8,000)
    # against a small context, which the memory plan may choose on a small GPU, fail every request otherwise.
    clamp_max_tokens: bool = False
    restart_limit: int = 5                      # launcher: restarts of a dead stage / PLE service in a row (0 = none)
    recovery_timeout: float = 60.0              # s running requests wait (recomputed) for a dead component; 0 = fail
    # A stuck component (gateway/cluster_executor.py): a stage that made no progress for `stall_timeout` s stops
    # heartbeating (its heartbeat thread would otherwise report a wedged process alive), and the gateway kills a
    # local component that sent no heartbeat for `hang_timeout` s, so the launcher restarts it (vLLM's
    # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS is 300). 0 = off. Progress, not step length: a step launched or finished,
    # none launched, or a layer of a step starting or ending resets the stall clock (stage_worker/main.py);
    # below MIN_STALL_TIMEOUT it is refused: a step longer than the timeout killed the restarted stage again on the
    # same recomputed request, restart after restart.
    stall_timeout: float = 300.0
    hang_timeout: float = 30.0
    # A step in flight this long (s) is reported once by the engine core: its plan, then every thread's stack of
    # the gateway and (SIGUSR2) of each component on this host, in the serve log: where a pipeline that stopped
    # without an error waits (h100-32: a one-stage server's four streams stopped at token 253-255 of 256 for
    # 113 s, nothing logged; not reproduced). A prefill chunk gets 5x as long (engine_core.PREFILL_STALL_FACTOR).
    # Reports only. 0 = off.
    stall_report_timeout: float = 60.0
    # launcher: seconds a start may take until its first heartbeat. The first start: until /health is 200 (else
    # `serve` fails naming what is missing); a restarted component: until the gateway hears from it, else it is
    # killed and that counts as a failed restart (a restart hung while loading was never killed: the hang check
    # above needs a heartbeat from the process first). 0 = wait forever.
    start_timeout: float = 300.0
    # "" = none; else /v1 routes need "Authorization: Bearer <key>"; a list: any of its keys (vLLM's --api-key A B)
    api_key: str | list[str] = ""
    allowed_hosts: list[str] = field(default_factory=list)   # Host names answered; [] = loopback names when bound to
                                                # loopback, any otherwise (gateway/access.py); ["*"] = any
    allowed_origins: list[str] = field(default_factory=list)  # CORS: browser origins allowed to call; [] = none
    # CurveZMQ on every link (shared/links.py): the secret certificate `moepipe keys` wrote, read by every process.
    # tcp endpoints are refused without it unless insecure_links (a network where anyone may drive the stages).
    link_keys: str = ""
    insecure_links: bool = False
    seed: int = 0

    def endpoints(self) -> list[str]:
        return [e for e in [self.gateway_endpoint, self.ple_endpoint, *(s.endpoint for s in self.stages)] if e]

    def _validate_links(self) -> None:
        tcp = [e for e in self.endpoints() if e.startswith("tcp://")]
        if self.link_keys:
            from shared.links import LinkKeyError, LinkKeys

            try:
                LinkKeys.load(self.link_keys)
            except LinkKeyError as exc:
                raise ClusterConfigError(f"cluster config: {exc}") from None
        elif tcp and not self.insecure_links:
            raise ClusterConfigError(
                f"cluster config: tcp endpoints ({', '.join(tcp)}) would carry plans, activations and tokens "
                f"unauthenticated and unencrypted: anyone who reaches them can drive the stages. Write a cluster "
                f"certificate with `moepipe keys --out DIR`, copy DIR to every host and set link_keys = "
                f"\"DIR/cluster.key_secret\"; or set insecure_links = true on a network you trust")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_microbatches(self) -> int:
        """`microbatches`, or by default one per stage that can run alongside the others: stages sharing one GPU
        count once. Their kernels take turns on that GPU, so a second micro-batch only reads every dense weight a
        second time (H200, full shape cut to 20 layers on two stage processes of one GPU, 4 streams: 487 decode
        tok/s with one micro-batch against 349 with two, bench/results/served-speed-10). CPU stages run on cores
        of their own and each counts; so does a GPU of another host (a tcp endpoint's host)."""
        if self.microbatches:
            return self.microbatches
        gpus = set()
        for i, s in enumerate(self.stages):
            host = s.endpoint.split("://", 1)[-1].rsplit(":", 1)[0] if s.endpoint.startswith("tcp://") else ""
            gpus.add((host, "cuda:0" if s.device == "cuda" else s.device) if s.device.startswith("cuda") else i)
        return len(gpus)

    def validate(self, num_layers: int | None = None) -> None:
        if not self.stages:
            raise ClusterConfigError("cluster config: [[stages]] must list at least one stage")
        expect = 0
        for i, s in enumerate(self.stages):
            if s.start != expect or s.end <= s.start:
                raise ClusterConfigError(f"cluster config: stages[{i}] covers layers [{s.start}, {s.end}); stages "
                                         f"must cover contiguous, non-empty layer ranges starting at {expect}")
            expect = s.end
        if num_layers is not None and expect != num_layers:
            raise ClusterConfigError(f"cluster config: stages end at layer {expect}, the model has {num_layers}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ClusterConfigError(f"cluster config: {name} must be >= 1")
        if self.max_num_batched_tokens > MAX_NUM_BATCHED_TOKENS:
            raise ClusterConfigError(f"cluster config: max_num_batched_tokens (--max-num-batched-tokens) "
                                     f"{self.max_num_batched_tokens} is more than {MAX_NUM_BATCHED_TOKENS} tokens "
                                     f"a step (the start-up buffers are sized by it)")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 1 <= self.port <= 65535:
            raise ClusterConfigError(f"cluster config: port (--port) must be between 1 and 65535, got {self.port!r}")
        if self.microbatches < 0:
            raise ClusterConfigError(f"cluster config: microbatches (MOEPIPE_MICROBATCHES) must be >= 1, or 0 (one "
                                     f"per stage), got {self.microbatches}")
        err = kernels_error(self.kernels)
        if err:
            raise ClusterConfigError(f"cluster config: kernels (MOEPIPE_KERNELS) {self.kernels!r}: {err}")
        if self.max_num_seqs > MAX_NUM_SEQS:    # per-slot state in every process: 10^9 was an OOM kill at start-up
            raise ClusterConfigError(f"cluster config: max_num_seqs {self.max_num_seqs} is more than "
                                     f"{MAX_NUM_SEQS} sequences at once")
        if self.prefix_cache_states < 0:
            raise ClusterConfigError(f"cluster config: prefix_cache_states must be >= 0 (0 = no prefix cache), got "
                                     f"{self.prefix_cache_states}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ClusterConfigError(f"cluster config: gpu_memory_utilization must be in (0, 1], got "
                                     f"{self.gpu_memory_utilization}")
        if not (0 <= self.vram_limit < math.inf and 0 <= self.kv_cache_memory_bytes < math.inf):
            raise ClusterConfigError("cluster config: vram_limit and kv_cache_memory_bytes must be finite and >= 0 "
                                     f"(0 = none), got {self.vram_limit} and {self.kv_cache_memory_bytes}")
        if self.expert_move_interval < 1 or not self.expert_move_half_life > 0 or not self.expert_move_margin >= 0:
            raise ClusterConfigError("cluster config: expert_move_interval must be >= 1 step, expert_move_half_life "
                                     "> 0 steps and expert_move_margin >= 0")
        if not 1 <= self.expert_move_claims <= MAX_EXPERT_MOVE_CLAIMS:
            raise ClusterConfigError(f"cluster config: expert_move_claims (MOEPIPE_EXPERT_MOVE_CLAIMS) "
                                     f"{self.expert_move_claims} must be 1 to {MAX_EXPERT_MOVE_CLAIMS} (claims a layer "
                                     f"a step; each takes two spare expert slots a layer in VRAM)")
        if not 0 <= self.expert_prefetch <= MAX_EXPERT_PREFETCH:
            raise ClusterConfigError(f"cluster config: expert_prefetch (MOEPIPE_EXPERT_PREFETCH) "
                                     f"{self.expert_prefetch} must be 0 (off) to {MAX_EXPERT_PREFETCH} prefetch "
                                     "slots a layer")
        if self.expert_prefetch_top < 0:
            raise ClusterConfigError(f"cluster config: expert_prefetch_top (MOEPIPE_EXPERT_PREFETCH_TOP) must be >= 0 "
                                     f"(0: each token's top-k), got {self.expert_prefetch_top}")
        if self.expert_prefetch_min_batch < 1:
            raise ClusterConfigError(f"cluster config: expert_prefetch_min_batch (MOEPIPE_EXPERT_PREFETCH_MIN_BATCH) "
                                     f"must be >= 1 (1: every decode step), got {self.expert_prefetch_min_batch}")
        if self.expert_prefetch and self.expert_moves and not self.expert_move_async:
            raise ClusterConfigError("cluster config: expert_prefetch needs moves on read (expert_move_async) or no "
                                     "moves (expert_moves off): moves in place would swap experts into the empty "
                                     "prefetch slots")
        if self.expert_move_half_life_unit not in EXPERT_MOVE_HALF_LIFE_UNITS:
            raise ClusterConfigError(f"cluster config: expert_move_half_life_unit (MOEPIPE_EXPERT_MOVE_HALF_LIFE_UNIT) "
                                     f"{self.expert_move_half_life_unit!r} must be one of "
                                     f"{', '.join(EXPERT_MOVE_HALF_LIFE_UNITS)}")
        if not 0 <= self.gil_switch_interval_ms <= 1000:
            raise ClusterConfigError(f"cluster config: gil_switch_interval_ms must be in [0, 1000] ms (0 = Python's "
                                     f"default 5 ms), got {self.gil_switch_interval_ms}")
        if self.kv_row_cache_mib < 0:
            raise ClusterConfigError("cluster config: kv_row_cache_mib must be >= 0 (0 = no row cache)")
        if self.ple_prefetch_threads < 1:
            raise ClusterConfigError("cluster config: ple_prefetch_threads must be >= 1 (turn prefetch off with "
                                     "ple_prefetch = false)")
        if self.ple_prefetch_method not in PLE_PREFETCH_METHODS:
            raise ClusterConfigError(f"cluster config: ple_prefetch_method (MOEPIPE_PLE_PREFETCH_METHOD) "
                                     f"{self.ple_prefetch_method!r} must be one of {', '.join(PLE_PREFETCH_METHODS)} "
                                     "(turn prefetch off with ple_prefetch = false)")
        if self.ple_prefetch_depth < 1:
            raise ClusterConfigError("cluster config: ple_prefetch_depth must be >= 1 (the pread prefetch's reads in "
                                     "flight)")
        if self.ple_threads < 0:
            raise ClusterConfigError("cluster config: ple_threads must be >= 1, or 0 (torch's default)")
        if self.ple_decode_in_stage_max_seqs < 0:
            raise ClusterConfigError("cluster config: ple_decode_in_stage_max_seqs must be >= 1, or 0 for every decode "
                                     "step (a PLE stage gathers its own rows for decode steps of up to this many "
                                     "sequences; to never, set ple_decode_in_stage = false)")
        for name in ("block_size", "num_blocks", "max_model_len"):
            if getattr(self, name) < 0:
                raise ClusterConfigError(f"cluster config: {name} must be >= 1, or 0 (derived from the model), got "
                                         f"{getattr(self, name)}")
        if self.ple_ring_slots < 0:
            raise ClusterConfigError(f"cluster config: ple_ring_slots must be >= 1, or 0 (the steps in flight + 2), "
                                     f"got {self.ple_ring_slots}")
        if self.restart_limit < 0:
            raise ClusterConfigError(f"cluster config: restart_limit (--restart-limit) must be >= 0 restarts in a "
                                     f"row (0: never restart a dead component), got {self.restart_limit}")
        if not 0 <= self.kv_cache_memory < math.inf:
            raise ClusterConfigError(f"cluster config: kv_cache_memory must be > 0 GiB (or 0 for the default), "
                                     f"got {self.kv_cache_memory}")
        if not (isinstance(self.recovery_timeout, (int, float)) and 0 <= self.recovery_timeout < float("inf")):
            raise ClusterConfigError(f"cluster config: recovery_timeout must be a number of seconds >= 0 (0 = fail "
                                     f"a dead component's requests at once), got {self.recovery_timeout!r}")
        for name in ("stall_timeout", "hang_timeout", "start_timeout", "stall_report_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")):
                raise ClusterConfigError(f"cluster config: {name} must be a number of seconds >= 0 (0 = off), "
                                         f"got {value!r}")
        if 0 < self.stall_timeout < MIN_STALL_TIMEOUT:
            raise ClusterConfigError(
                f"cluster config: stall_timeout (MOEPIPE_STALL_TIMEOUT) {self.stall_timeout:g} s is below the "
                f"minimum of {MIN_STALL_TIMEOUT:g} s: a stage whose step makes no progress (no layer finishing) for "
                f"that long is killed and restarted, and a healthy stretch that long (a large layer on a CPU, a "
                f"Triton compile for a new shape) would kill the restarted stage again on the same request, restart "
                f"after restart; use {MIN_STALL_TIMEOUT:g} or more, or 0 (off)")
        if 0 < self.hang_timeout <= self.heartbeat_timeout:
            raise ClusterConfigError(f"cluster config: hang_timeout ({self.hang_timeout} s) must exceed "
                                     f"heartbeat_timeout ({self.heartbeat_timeout} s), or be 0 (off)")
        self._validate_links()
        if not isinstance(self.api_key, str) and not (isinstance(self.api_key, list) and
                                                      all(isinstance(k, str) for k in self.api_key)):
            raise ClusterConfigError("cluster config: api_key must be a string or a list of strings (any of the "
                                     "keys authenticates)")
        for key in ("allowed_hosts", "allowed_origins"):
            names = getattr(self, key)
            if not isinstance(names, list) or not all(isinstance(h, str) and h for h in names):
                raise ClusterConfigError(f"cluster config: {key} must be a list of names (or [\"*\"])")
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ClusterConfigError(f"cluster config: chat_template_content_format "
                                     f"(MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT) {self.chat_template_content_format!r} "
                                     f"must be one of {', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}")
        if self.dummy_quant not in DUMMY_QUANTS:
            raise ClusterConfigError(f"cluster config: dummy_quant {self.dummy_quant!r} must be one of "
                                     f"{', '.join(q for q in DUMMY_QUANTS if q)} or empty")
        if self.dtype not in ("", *DTYPES):
            raise ClusterConfigError(f"cluster config: dtype {self.dtype!r} must be float32, bfloat16, float16 or "
                                     f"empty (the checkpoint's)")
        in_flight = self.steps_in_flight
        if self.ple_service and 0 < self.ple_ring_slots <= in_flight:
            # Ring slot step % slots is rewritten only after the last stage ran its step: with no more slots than
            # steps in flight the service would wait on the pipeline instead of gathering ahead.
            raise ClusterConfigError(f"cluster config: ple_ring_slots ({self.ple_ring_slots}) must exceed the "
                                     f"steps in flight ({in_flight}: {self.num_microbatches} micro-batches"
                                     f"{', two plans each with async_scheduling' if self.async_scheduling else ''})")

    def model_len(self, cfg: HybridMoeConfig) -> int:
        """The longest sequence served: `max_model_len`, or when 0 the model's max_position_embeddings (a RoPE
        scaling's longer `longest_context` only when asked for with --max-model-len). The one rule every component
        sizes by (the gateway's limit, KV blocks, graphs, the activation peak)."""
        return self.max_model_len or cfg.max_position_embeddings

    def for_model(self, cfg: HybridMoeConfig) -> ClusterConfig:
        """Validated against the model, with the KV sizes derived from it filled in. Every process calls this on
        the same file, and the result depends only on the file (and environment), so the gateway that places
        blocks and every stage that allocates them agree."""
        self.validate(cfg.num_hidden_layers)
        self._check_api_keys()
        self._check_host_states(cfg)
        if self.cold_experts and self.cold_experts != "auto":
            from shared.cold_set import ColdSetError, load

            try:
                load(self.cold_experts, cfg)
            except ColdSetError as exc:
                raise ClusterConfigError(f"cluster config: cold_experts: {exc}") from None
        if self.max_model_len > cfg.longest_context:
            raise ClusterConfigError(
                f"max_model_len {self.max_model_len} is longer than this model serves: {cfg.longest_context} "
                f"(max_position_embeddings {cfg.max_position_embeddings}"
                f"{', ' + cfg.rope_scaling['rope_type'] + ' RoPE scaling' if cfg.rope_scaling else ''}); lower "
                f"--max-model-len")
        try:
            block_size = resolve_block_size(cfg, self.block_size)
            costs = [stage_block_cost(cfg, s.start, s.end, block_size, compute_dtype(cfg, s.device, self.dtype),
                                      s.device, self.qsa_kv_offload) for s in self.stages]
            max_len = self.model_len(cfg)
            most = max(GPU_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs * max_len)
            if self.max_num_batched_tokens > most:
                raise ClusterConfigError(
                    f"cluster config: max_num_batched_tokens (--max-num-batched-tokens) "
                    f"{self.max_num_batched_tokens} is more than one step can hold: max_num_seqs {self.max_num_seqs} "
                    f"x max_model_len {max_len} = {self.max_num_seqs * max_len} tokens")
            budget = self.kv_cache_memory or default_kv_budget(
                costs, block_size, max_len, any(s.device.startswith("cuda") for s in self.stages))
            num_blocks = self.num_blocks or auto_num_blocks(costs, block_size, max_len, self.max_num_seqs, budget)
            fitted = {}
            if self.num_blocks and self.num_blocks * block_size < max_len:
                # a request the pool can never hold would wait at the head of the queue forever (and every request
                # behind it): a set max_model_len is refused, as vLLM refuses a KV cache shorter than it; an unset
                # one becomes what the pool holds (as the GPU memory plan fits it)
                if self.max_model_len:
                    raise KvLayoutError(
                        f"num_blocks {self.num_blocks} x block_size {block_size} = {self.num_blocks * block_size} "
                        f"KV tokens cannot hold one sequence of max_model_len {max_len}: raise --num-blocks to at "
                        f"least {-(-max_len // block_size)} or lower --max-model-len")
                fitted = {"max_model_len": self.num_blocks * block_size}
            if self.num_blocks:         # auto is sized within kv_cache_memory
                self._check_host_blocks(costs)
        except KvLayoutError as exc:
            raise ClusterConfigError(f"cluster config: {exc}") from None
        return dataclasses.replace(self, block_size=block_size, num_blocks=num_blocks,
                                   ple_ring_slots=self.ple_ring_slots or self.steps_in_flight + 2, **fitted)

    def _check_api_keys(self) -> None:
        """Keys a client can send (checked when serving, not when a config with any string is read or written).
        A key no client can send as written served a cluster that answered every /v1 request 401: HTTP headers
        carry Latin-1 (httpx, the openai client, refuse anything but ASCII; curl's UTF-8 bytes arrive as other
        characters), and the gateway strips the token it is sent. The key itself is not echoed."""
        if any(k and not (k.isascii() and k.isprintable() and k == k.strip())
               for k in ([self.api_key] if isinstance(self.api_key, str) else self.api_key)):
            raise ClusterConfigError("cluster config: api_key (--api-key): a key with non-ASCII or control "
                                     "characters or leading or trailing spaces cannot be sent in an "
                                     "'Authorization: Bearer' header as it is (every request would be refused "
                                     "401); use printable ASCII (whether given as a flag, MOEPIPE_API_KEY or "
                                     "VLLM_API_KEY)")

    def _check_host_states(self, cfg: HybridMoeConfig) -> None:
        """Recurrent states (max_num_seqs + 1 running slots and prefix_cache_states saved ones) whose fp32 DeltaNet
        state alone is more than this host's RAM on its CPU stages: a line naming the flags now. `--prefix-cache-states
        100000` on the demo model had a CPU stage allocate and fill ~25 GB, growing until the machine ran out of
        memory, with the launcher still waiting for its first heartbeat. (A lower bound: conv and PLE tails are
        not counted.)"""
        heads, k, v = (getattr(cfg, n, 0) or 0 for n in ("linear_num_value_heads", "linear_key_head_dim",
                                                           "linear_value_head_dim"))
        per_layer = heads * k * v * 4
        local = self._here_on_cpu([sum(per_layer for layer in range(s.start, s.end) if not cfg.is_attention(layer))
                                   for s in self.stages])
        slots = self.max_num_seqs + 1 + self.prefix_states
        need = sum(local) * slots
        ram = host_ram()
        if ram is not None and need > ram:
            raise ClusterConfigError(
                f"cluster config: prefix_cache_states (--prefix-cache-states) {self.prefix_states} and max_num_seqs "
                f"(--max-num-seqs) {self.max_num_seqs}: {slots} recurrent states of at least {sum(local)} bytes "
                f"each on this host's CPU stages need {need / GIB:.1f} GiB, more than its {ram / GIB:.1f} GiB of "
                f"RAM: lower them")

    def _check_host_blocks(self, costs: list[int]) -> None:
        """An explicit num_blocks whose KV blocks on this host's CPU stages need more than its RAM: a line naming
        --num-blocks now, not an allocation traceback from a stage process (409 GB asked for by a typo)."""
        num_blocks = self.num_blocks
        local = self._here_on_cpu(costs)
        need = sum(local) * (num_blocks + 1)
        ram = host_ram()
        if local and ram is not None and need > ram:
            raise KvLayoutError(
                f"num_blocks (--num-blocks) {num_blocks} needs {need / GIB:.1f} GiB of KV blocks on this host's CPU "
                f"stages ({sum(local)} bytes a block), more than its {ram / GIB:.1f} GiB of RAM: lower --num-blocks, "
                f"or leave it out (the pool is then sized within --kv-cache-memory)")

    def _here_on_cpu(self, per_stage: list[int]) -> list[int]:
        """The entries of `per_stage` (one a stage) of the CPU stages on this host: what its RAM must hold."""
        return [c for s, c in zip(self.stages, per_stage) if s.device == "cpu" and on_this_host(s.endpoint)]

    def load_tokenizer(self):
        """The tokenizer the gateway renders chats with: the model's, with `chat_template` instead of its templates
        when set and message content passed as `chat_template_content_format` says (a ValueError naming what is
        wrong). The gateway and the launcher's check before any stage starts both load it here."""
        from shared.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.model, self.chat_template or None,
                                  content_format=self.chat_template_content_format)

    def keeps_fp8_experts(self) -> bool:
        """Whether a block-FP8 checkpoint's experts stay float8: the switch, and with cold experts also
        `fp8_expert_tables` (the expert tables' float8 slots); the stage loader, the memory plan and `moepipe
        cold-set` all ask here."""
        return self.packed_fp8_experts and (self.fp8_expert_tables or not self.cold_experts)

    @property
    def row_cache_bytes(self) -> int:
        """VRAM a stage gives its K/V row cache (`CacheSpec.row_cache_bytes`): only over host K/V."""
        return self.kv_row_cache_mib << 20 if self.kv_row_cache and self.qsa_kv_offload else 0

    @property
    def prefix_states(self) -> int:
        return self.prefix_cache_states if self.enable_prefix_caching else 0

    @property
    def prefix_split_tokens(self) -> int:
        if self.prefix_cache_split_tokens >= 0:
            return self.prefix_cache_split_tokens
        return 0 if all(s.device.split(":")[0] == "cpu" for s in self.stages) else 1024

    @property
    def steps_in_flight(self) -> int:
        """At most this many steps are planned and not yet finished: plans per micro-batch x micro-batches."""
        return self.num_microbatches * (2 if self.async_scheduling else 1)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges, the remainder spread over the first stages."""
    if not 1 <= num_stages <= num_layers:
        raise ClusterConfigError(f"--stages {num_stages}: must be between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


_ENV = {"MOEPIPE_PLE_SERVICE": "ple_service", "MOEPIPE_PLE_PREFETCH": "ple_prefetch",
        "MOEPIPE_PLE_PREFETCH_THREADS": "ple_prefetch_threads",
        "MOEPIPE_PLE_PREFETCH_METHOD": "ple_prefetch_method", "MOEPIPE_PLE_PREFETCH_DEPTH": "ple_prefetch_depth",
        "MOEPIPE_MICROBATCHES": "microbatches", "MOEPIPE_KERNELS": "kernels", "MOEPIPE_CUDA_GRAPHS": "cuda_graphs",
        "MOEPIPE_PLE_GRAPH": "ple_graph", "MOEPIPE_PLE_DECODE_IN_STAGE": "ple_decode_in_stage",
        "MOEPIPE_PLE_DECODE_IN_STAGE_MAX_SEQS": "ple_decode_in_stage_max_seqs",
        "MOEPIPE_PLE_GATHER_NUMPY": "ple_gather_numpy",
        "MOEPIPE_GRAPH_SKIP_PADDING": "graph_skip_padding",
        "MOEPIPE_ASYNC_SCHEDULING": "async_scheduling",
        "MOEPIPE_SKIP_CANCELLED_STEPS": "skip_cancelled_steps",
        "MOEPIPE_LAUNCH_AHEAD": "launch_ahead", "MOEPIPE_PLE_LAUNCH_AHEAD": "ple_launch_ahead",
        "MOEPIPE_PLE_LAUNCH_AHEAD_ACROSS_STAGES": "ple_launch_ahead_across_stages",
        "MOEPIPE_PLE_SAMPLE_AFTER_ROWS": "ple_sample_after_rows",
        "MOEPIPE_STAGE_SPIN_WAIT": "stage_spin_wait",
        "MOEPIPE_STARTUP_WARMUP": "startup_warmup",
        "MOEPIPE_CUDA_IPC_ACTIVATIONS": "cuda_ipc_activations",
        "MOEPIPE_BATCHED_PREFILL": "batched_prefill", "MOEPIPE_PREFIX_CACHING": "enable_prefix_caching",
        "MOEPIPE_PREFIX_CACHE_STATES": "prefix_cache_states",
        "MOEPIPE_PREFIX_CACHE_SPLIT_TOKENS": "prefix_cache_split_tokens", "MOEPIPE_GIL_SWITCH_INTERVAL_MS": "gil_switch_interval_ms",
        "MOEPIPE_QSA_SPARSE_PREFILL": "qsa_sparse_prefill", "MOEPIPE_ACCESS_LOG": "access_log",
        "MOEPIPE_CLAMP_MAX_TOKENS": "clamp_max_tokens",
        "MOEPIPE_DEVICE_SAMPLING": "device_sampling",
        "MOEPIPE_THREADS": "threads_per_stage", "MOEPIPE_DTYPE": "dtype",
        "MOEPIPE_KV_CACHE_MEMORY": "kv_cache_memory", "MOEPIPE_API_KEY": "api_key",
        "MOEPIPE_ALLOWED_HOSTS": "allowed_hosts", "MOEPIPE_RESTART_LIMIT": "restart_limit",
        "MOEPIPE_ALLOWED_ORIGINS": "allowed_origins", "MOEPIPE_RECOVERY_TIMEOUT": "recovery_timeout",
        "MOEPIPE_STALL_TIMEOUT": "stall_timeout", "MOEPIPE_HANG_TIMEOUT": "hang_timeout",
        "MOEPIPE_STALL_REPORT_TIMEOUT": "stall_report_timeout",
        "MOEPIPE_START_TIMEOUT": "start_timeout",
        "MOEPIPE_LINK_KEYS": "link_keys", "MOEPIPE_PLE_THREADS": "ple_threads",
        "MOEPIPE_GPU_MEMORY_UTILIZATION": "gpu_memory_utilization", "MOEPIPE_VRAM_LIMIT": "vram_limit",
        "MOEPIPE_KV_CACHE_MEMORY_BYTES": "kv_cache_memory_bytes", "MOEPIPE_MEASURE_RESERVE": "measure_reserve",
        "MOEPIPE_COLD_EXPERTS": "cold_experts",
        "MOEPIPE_EXPERT_MOVES": "expert_moves", "MOEPIPE_EXPERT_MOVE_INTERVAL": "expert_move_interval",
        "MOEPIPE_EXPERT_MOVE_HALF_LIFE": "expert_move_half_life",
        "MOEPIPE_EXPERT_MOVE_HALF_LIFE_UNIT": "expert_move_half_life_unit",
        "MOEPIPE_EXPERT_MOVE_CLAIMS": "expert_move_claims", "MOEPIPE_EXPERT_MOVE_MARGIN": "expert_move_margin",
        "MOEPIPE_EXPERT_MOVE_FUSED": "expert_move_fused", "MOEPIPE_EXPERT_MOVE_GRAPH": "expert_move_graph",
        "MOEPIPE_EXPERT_MOVE_ASYNC": "expert_move_async", "MOEPIPE_EXPERT_PREFETCH": "expert_prefetch",
        "MOEPIPE_EXPERT_PREFETCH_TOP": "expert_prefetch_top",
        "MOEPIPE_EXPERT_PREFETCH_MIN_BATCH": "expert_prefetch_min_batch",
        "MOEPIPE_EXPERT_VMM_TABLE": "expert_vmm_table",
        "MOEPIPE_PACKED_EXPERTS": "packed_experts", "MOEPIPE_PACKED_DENSE": "packed_dense",
        "MOEPIPE_PACKED_QKV": "packed_qkv",
        "MOEPIPE_PACKED_FP8_EXPERTS": "packed_fp8_experts", "MOEPIPE_FP8_EXPERT_TABLES": "fp8_expert_tables", "MOEPIPE_PACKED_FP8_DENSE": "packed_fp8_dense",
        "MOEPIPE_QSA_KV_OFFLOAD": "qsa_kv_offload", "MOEPIPE_KV_ROW_CACHE": "kv_row_cache",
        "MOEPIPE_KV_ROW_CACHE_MIB": "kv_row_cache_mib", "MOEPIPE_MAX_NUM_BATCHED_TOKENS": "max_num_batched_tokens",
        "MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT": "chat_template_content_format"}


_INT_KEYS = ("microbatches", "threads_per_stage", "restart_limit", "ple_threads", "kv_cache_memory_bytes",
             "expert_move_interval", "ple_decode_in_stage_max_seqs", "kv_row_cache_mib", "ple_prefetch_threads",
             "ple_prefetch_depth", "prefix_cache_states", "prefix_cache_split_tokens", "max_num_batched_tokens",
             "expert_move_claims", "expert_prefetch", "expert_prefetch_top", "expert_prefetch_min_batch")
# counts whose flags take vLLM's suffixes (--max-num-batched-tokens 8k): their variables take them too
_HUMAN_INT_KEYS = ("max_num_batched_tokens", "kv_cache_memory_bytes")
_FLOAT_KEYS = ("kv_cache_memory", "recovery_timeout", "stall_timeout", "hang_timeout", "start_timeout",
               "stall_report_timeout", "gpu_memory_utilization", "vram_limit", "expert_move_half_life",
               "expert_move_margin", "gil_switch_interval_ms")
_STRING_KEYS = ("kernels", "dtype", "api_key", "link_keys", "cold_experts")
# a word (stripped, lower case; VAR= is not set), checked by validate
_CHOICE_KEYS = ("ple_prefetch_method", "chat_template_content_format", "expert_move_half_life_unit")
_LIST_KEYS = ("allowed_hosts", "allowed_origins")


def env_overrides() -> dict[str, Any]:
    """Feature switches set in the environment (A/B without editing the config file). A value that is not of the
    key's type is a ClusterConfigError naming the variable; an empty number or switch (VAR=) counts as not set."""
    out: dict[str, Any] = {}
    for env, key in _ENV.items():
        val = os.environ.get(env)
        if val is None or (not val.strip() and key not in _STRING_KEYS + _LIST_KEYS):
            continue
        if key in _INT_KEYS:
            out[key] = _int_env(env, val)
        elif key in _FLOAT_KEYS:
            out[key] = _float_env(env, val)
        elif key == "dtype":
            low = val.strip().lower()
            if not low:
                continue                # VAR= is not set, as for the other keys
            if low not in DTYPE_ALIASES:
                raise ClusterConfigError(f"{env}={val!r}: expected {', '.join(DTYPES)}, or as --dtype takes them "
                                         f"auto (the checkpoint's), half, float")
            out[key] = DTYPE_ALIASES[low]
        elif key in _STRING_KEYS:
            out[key] = val
        elif key in _CHOICE_KEYS:
            out[key] = val.strip().lower()
        elif key in _LIST_KEYS:
            out[key] = parse_names(val, env)
        else:
            out[key] = _bool_env(env, val)
    if "api_key" not in out and os.environ.get(VLLM_API_KEY):
        out["api_key"] = os.environ[VLLM_API_KEY]     # as `vllm serve` reads it; MOEPIPE_API_KEY and --api-key win
    return out


VLLM_API_KEY = "VLLM_API_KEY"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool_env(name: str, val: str) -> bool:
    """A switch is on or off; a typo (MOEPIPE_CUDA_GRAPHS=ture) is an error, not silently "on"."""
    low = val.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ClusterConfigError(f"{name}={val!r}: expected one of 1/true/yes/on or 0/false/no/off")


_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def parse_human_int(value: str) -> int:
    """A count as vLLM's flags take it, so a pasted `--max-model-len 32k` works: 32k = 32,000 and 1.5m = 1,500,000
    (lower case: powers of 1000, fractions allowed), 32K = 32,768 (upper case: powers of 1024, whole numbers only);
    plain numbers as int() reads them. ValueError with a message naming the rule otherwise."""
    text = value.strip()
    m = _SUFFIXED.fullmatch(text)
    if m:
        number, suffix = m.groups()
        power = "kmgt".index(suffix.lower()) + 1
        if suffix.islower():
            return int(Decimal(number) * 1000 ** power)     # exact: float made 4.35k 4,349
        if "." not in number:
            return int(number) * 1024 ** power
        raise ValueError(f"{value!r}: upper-case {suffix} is 1024^{power}, whole numbers only (lower case "
                         f"{number}{suffix.lower()} is 1000^{power})")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{value!r}: expected a whole number, optionally with k/m/g/t (powers of 1000) or K/M/G/T "
                         f"(powers of 1024), e.g. 32k or 32K") from None


def _int_env(name: str, val: str) -> int:
    """A whole number; the keys that take vLLM's suffixed counts on the command line take them here too."""
    if _ENV.get(name) in _HUMAN_INT_KEYS:
        try:
            return parse_human_int(val)
        except ValueError as e:
            raise ClusterConfigError(f"{name}={e}") from None      # parse_human_int's message names the rule
    try:
        return int(val)
    except ValueError:
        raise ClusterConfigError(f"{name}={val!r}: expected a whole number") from None


def _float_env(name: str, val: str) -> float:
    try:
        return float(val)
    except ValueError:
        raise ClusterConfigError(f"{name}={val!r}: expected a number") from None


def _apply_env(raw: dict[str, Any]) -> None:
    raw.update(env_overrides())


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment for a process the launcher starts on a cluster file it wrote: without the MOEPIPE_*
    switches, whose values the file already carries as the launcher resolved them (its flags over the
    environment). Else the child's `load_cluster_config` would apply them again over the file, and a flag given
    beside its variable (`--max-num-batched-tokens 2048` with MOEPIPE_MAX_NUM_BATCHED_TOKENS=512) would be the
    launcher's value and not the processes'. A component started alone on a file still takes them.

    Also: where HOME cannot hold Triton's kernel cache (`~/.triton`: `docker run --user N` with HOME=/, a read-only
    home) and neither TRITON_CACHE_DIR nor TRITON_HOME is set, the cache goes to MOEPIPE_HOME/triton or a directory
    of this user's under the temporary directory: a GPU stage's first kernel compile raised PermissionError there
    and the stage died."""
    env = {k: v for k, v in environ.items() if k not in _ENV and k != VLLM_API_KEY}
    if "TRITON_CACHE_DIR" not in env and "TRITON_HOME" not in env:
        cache = triton_cache_fallback(env.get("HOME") or os.path.expanduser("~"), env)
        if cache is not None:
            env["TRITON_CACHE_DIR"] = cache
    return env


def triton_cache_fallback(home: str, environ: dict[str, str] | None = None) -> str | None:
    """None when `home`/.triton is (or can be made) writable; else a private directory for Triton's cache (it
    loads compiled kernels from there, so not on a noexec filesystem): `MOEPIPE_HOME/triton` where MOEPIPE_HOME is
    set, else `<tmp>/moepipe-triton-<uid>` if this user owns it with mode 700 (kept across starts), else a new one.
    A shared name is never taken on trust: another user's files there would be kernels this process loads."""
    import tempfile

    first = next(d for d in (Path(home) / ".triton" / "cache", Path(home) / ".triton", Path(home), Path("/"))
                 if d.exists())          # the directory Triton writes, or the one it would make it in
    if os.access(first, os.W_OK):
        return None

    def usable(d: Path) -> bool:
        try:
            return not os.statvfs(d).f_flag & getattr(os, "ST_NOEXEC", 0)
        except OSError:
            return False

    moepipe_home = (environ or {}).get("MOEPIPE_HOME")
    if moepipe_home:
        cache = Path(moepipe_home) / "triton"
        try:
            cache.mkdir(parents=True, exist_ok=True)
            if os.access(cache, os.W_OK) and usable(cache):
                return str(cache)
        except OSError:
            pass
    try:
        base = Path(tempfile.gettempdir())
        if not usable(base):
            return None
        mine = base / f"moepipe-triton-{os.getuid()}"
        try:
            mine.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = mine.lstat()
        if mine.is_dir() and not mine.is_symlink() and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return str(mine)
        return tempfile.mkdtemp(prefix="moepipe-triton-")
    except OSError:
        return None               # no temporary directory either: the launcher says so itself


def load_cluster_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterConfigError(f"{path}: no such cluster config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterConfigError(f"{path}: not valid TOML ({exc})") from exc
    except UnicodeDecodeError:
        raise ClusterConfigError(f"{path}: not a cluster config file (not UTF-8 text)") from None
    except OSError as exc:          # a directory, no permission: one line, not a traceback
        raise ClusterConfigError(f"{path}: cannot read the cluster config file ({exc.strerror or exc})") from None
    return cluster_from_dict(raw, source=str(path))


def unknown_keys(raw: dict[str, Any]) -> list[str]:
    """The keys of `raw` that are no ClusterConfig field, sorted (a cluster.toml's, or the launcher's flags)."""
    return sorted(set(raw) - {f.name for f in dataclasses.fields(ClusterConfig)})


def cluster_from_dict(raw: dict[str, Any], source: str = "cluster config") -> ClusterConfig:
    raw = dict(raw)
    _apply_env(raw)
    unknown = unknown_keys(raw)
    if unknown:
        raise ClusterConfigError(f"{source}: unknown keys {unknown}")
    for key in ("model", "stages", "gateway_endpoint"):
        if key not in raw:
            raise ClusterConfigError(f"{source}: missing required key {key!r}")
    try:
        raw["stages"] = [StageSpec(**s) for s in raw["stages"]]
        cfg = ClusterConfig(**raw)
    except TypeError as exc:
        raise ClusterConfigError(f"{source}: {exc}") from exc
    cfg.validate()
    return cfg


def dump_toml(cfg: ClusterConfig) -> str:
    """A small TOML writer for this flat structure (tomllib only reads)."""
    lines = []
    for f in dataclasses.fields(cfg):
        if f.name == "stages":
            continue
        lines.append(f"{f.name} = {_toml_value(getattr(cfg, f.name))}")
    for s in cfg.stages:
        lines.append("")
        lines.append("[[stages]]")
        for f in dataclasses.fields(s):
            lines.append(f"{f.name} = {_toml_value(getattr(s, f.name))}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return _toml_string(v)
    raise TypeError(f"cannot write {v!r} as TOML")


# TOML basic strings: `"` and `\` escaped, and every control character (U+0000-U+001F and DEL; tab too, for a
# readable file), which TOML does not allow raw; other characters as they are (the file is UTF-8). Not json.dumps:
# its \ud83d\ude00 surrogate pairs are no TOML escape (tomllib refuses them), and with ensure_ascii=False it
# leaves DEL raw.
_TOML_ESCAPES = {**{c: f"\\u{c:04x}" for c in (*range(0x20), 0x7F)},
                 **{ord(c): e for c, e in (("\b", "\\b"), ("\t", "\\t"), ("\n", "\\n"), ("\f", "\\f"),
                                           ("\r", "\\r"), ('"', '\\"'), ("\\", "\\\\"))}}


def _toml_string(v: str) -> str:
    if any("\ud800" <= c <= "\udfff" for c in v):
        raise ClusterConfigError(f"cannot write {v!r} as TOML: it holds a lone surrogate (an undecodable byte), "
                                 f"which no UTF-8 file can hold")
    return '"' + v.translate(_TOML_ESCAPES) + '"'


def stage_name(index: int) -> str:
    return f"stage{index}"


LOOPBACK_HOSTS = frozenset(("127.0.0.1", "localhost", "::1", "[::1]"))


def endpoint_host(endpoint: str) -> str | None:
    """The host of a `tcp://host:port` endpoint; None for `ipc://` / `inproc://` (reachable only from its own
    host)."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rsplit(":", 1)[0]


def on_this_host(endpoint: str) -> bool:
    """Whether a stage listening on `endpoint` runs on the host that reads the config: an `ipc://` / `inproc://`
    inbox, or a loopback address (any 127.x)."""
    host = endpoint_host(endpoint)
    return host is None or host in LOOPBACK_HOSTS or host.startswith("127.")
