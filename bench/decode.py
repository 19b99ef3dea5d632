"""In-process decode benchmark against the memory-bandwidth roofline (DESIGN §6, 002 §3.0).

    python bench/decode.py --preset full-shape          # Qwen4-Exp at the reports' dimensions, dummy weights
    python bench/decode.py --preset qwen3-next-shape    # Qwen3-Next-80B-A3B's dimensions, also vs transformers
    python bench/decode.py --context 4096,65536,262144 --batch 1,4 --qsa-kv-offload --row-cache-mib 256
                                                        # long context (issue 18): K/V tier and row-cache hits

Dummy weights are generated on the GPU; the layer count is the largest that fits the card in bf16 (or --layers).
For each batch size it prints and writes as JSON: the bytes one decode step must read (dense weights, the union of
experts the batch selected, recurrent states, the K/V rows attention reads), HBM bandwidth measured in the same run,
the roofline tokens/s, the measured median step time and tokens/s, the percentage of the roofline, CUDA kernels per
step, and peak GPU memory against the weights' size. Contexts above 8192 tokens are filled with random rows instead of
a prefill (`--fill`, `LocalEngine.fill_context`): decode's cost does not depend on the values, and a 262k-token
prefill would take minutes; the QSA pooled keys are all drawn, so the selection ranks real scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_io import write_json, write_on_sigterm  # noqa: E402
from shared.cluster_config import env_overrides  # noqa: E402
from shared.model_config import HybridMoeConfig, Qwen4ExpConfig, config_from_dict  # noqa: E402
from shared.ple_files import ProceduralTable  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, build_empty  # noqa: E402
from stage_worker.checkpoint.make_model import QWEN3_NEXT_80B, preset_config  # noqa: E402
from stage_worker.checkpoint.packed_experts import dummy_groups  # noqa: E402
from stage_worker.checkpoint.random_init import fill_random  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402
from stage_worker.model.meta_build import on_meta  # noqa: E402
from stage_worker.model.quant_linear import dummy_specs  # noqa: E402
from stage_worker.model.moe import SparseMoE  # noqa: E402


def preset(name: str) -> dict:
    if name == "full-shape":
        raw = preset_config("full-shape")
        raw.update(eos_token_id=248046)
        return raw
    if name == "qwen3-next-shape":
        return dict(QWEN3_NEXT_80B)
    raise SystemExit(f"unknown preset {name!r}: full-shape or qwen3-next-shape")


def param_bytes(cfg: HybridMoeConfig, layers: int) -> tuple[int, int]:
    """(bytes of `layers` decoder layers, bytes outside the layers) in bf16, computed on the meta device."""
    with on_meta():
        from stage_worker.model.model import StageModel

        m = StageModel(dataclasses.replace(cfg, num_hidden_layers=1, layer_types=cfg.layer_types[:1]))
    per_type = {}
    for kind in ("linear_attention", cfg.attention_layer_type):
        c = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=[kind],
                                **({"ple_layer_ids": []} if isinstance(cfg, Qwen4ExpConfig) else {}))
        with on_meta():
            mm = StageModel(c)
        per_type[kind] = sum(p.numel() for n, p in mm.named_parameters() if n.startswith("layers.")) * 2
    outside = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("layers.")) * 2
    total = sum(per_type[cfg.layer_types[i]] for i in range(layers))
    return total, outside


PACKED = (".mlp.q13", ".mlp.s13", ".mlp.q2", ".mlp.s2")     # SparseMoE.use_packed's buffers
DENSE = (".weight_packed", ".weight_scale")                  # PackedLinear's (packed dense layers)
INT4_RATIO = (0.5 + 2 / 128) / 2      # an INT4 expert's bytes (words + bf16 scales per 128) over its bf16 bytes


def fit_layers(cfg: HybridMoeConfig, share: float, expert_ratio: float = 1.0) -> int:
    """The most layers (in whole [linear x3, attention] patterns) whose weights fit `share` of the free memory;
    routed experts at `expert_ratio` of their bf16 bytes."""
    free, _ = torch.cuda.mem_get_info()
    n = cfg.num_hidden_layers
    routed = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2 * cfg.num_experts
    while n > 4:
        layers, outside = param_bytes(cfg, n)
        moe = sum(1 for i in range(n) if cfg.is_sparse_moe(i))
        layers -= int(moe * routed * (1 - expert_ratio))
        if layers + outside < free * share:
            break
        n -= 4          # keep the [linear x3, attention] pattern whole
    return n


def hbm_bandwidth(gib: float = 4.0) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    n = int(gib * (1 << 30)) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / statistics.median(times[2:])


def step_bytes(model, cfg: HybridMoeConfig, batch: int, context: int) -> dict[str, int]:
    """Bytes one decode step must read from HBM, from the experts the last step actually selected."""
    dense = experts = 0
    expert_each = 0
    for name, p in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                     if n.endswith(PACKED + DENSE)]:
        nbytes = p.numel() * p.element_size()
        if name.endswith((".w13", ".w2") + PACKED):
            expert_each += nbytes // p.shape[0]
            continue
        if "embed_tokens" in name:
            nbytes = batch * p.shape[1] * p.element_size()      # only the batch's rows
        dense += nbytes
    union = 0
    for m in model.modules():
        if isinstance(m, SparseMoE) and m.last_expert_ids is not None:
            union += int(torch.unique(m.last_expert_ids).numel())
    n_mlps = sum(1 for m in model.modules() if isinstance(m, SparseMoE))
    experts = union * (expert_each // max(1, n_mlps))
    n_attn = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_attention(i))
    n_lin = cfg.num_hidden_layers - n_attn
    state = n_lin * batch * 2 * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    kv_tokens = context
    if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
        kv_tokens = min(context, cfg.indexer_budget + cfg.indexer_compress_ratio - 1)
    kv = n_attn * batch * kv_tokens * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    if isinstance(cfg, Qwen4ExpConfig) and cfg.has_qsa:
        kv += n_attn * batch * (context // cfg.indexer_compress_ratio) * cfg.indexer_head_dim * 2
    return {"dense": dense, "experts": experts, "experts_selected": union, "states": state, "kv": kv,
            "total": dense + experts + state + kv}


def split_configs(spec: str) -> list[str]:
    """--configs: "KERNELS:GRAPHS" entries, separated by ';' (or by ',' when every part has its ':'), so "all,-pdl:1"
    is one entry (h100-28 lost a call to it splitting on the comma) and a trailing ';' is nothing."""
    if ";" in spec:
        return [c for c in spec.split(";") if c.strip()]
    parts = spec.split(",")
    if all(":" in p for p in parts):
        return parts
    if spec.count(":") > 1:
        raise SystemExit(f"--configs {spec!r}: separate entries with ';' when a kernel list holds a comma "
                         f"(\"all,-pdl:1;all:1\")")
    return [spec]


def kernels_per_step(fn, top: int = 45) -> tuple[int, list[dict], float]:
    """CUDA kernels one step launches (graph replays included: CUPTI sees the nodes), the `top` kernels by GPU
    time, so the next fusion can be picked from measurement, and all kernels' GPU time summed (us)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    count = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        count += 1
        by_name.setdefault(e.name[:90], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                   else e.cuda_time_total)
    rows = sorted(({"name": k, "count": len(v), "total_us": sum(v)} for k, v in by_name.items()),
                  key=lambda r: -r["total_us"])
    return count, rows[:top] if top > 0 else rows, sum(r["total_us"] for r in rows)


class _TimedReplay:
    """A captured graph whose `replay` (cudaGraphLaunch) records its host time: how much of a synced step's host
    share is the launch of the ~1,000-node graph itself rather than the step's Python (StepBatch, input copies)."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.times = graph, []

    def replay(self) -> None:
        t0 = time.perf_counter()
        self.graph.replay()
        self.times.append(time.perf_counter() - t0)

    def __getattr__(self, name: str):
        return getattr(self.graph, name)


def run_batch(model, cfg, batch: int, context: int, steps: int, warmup: int, graphs: bool,
              max_model_len: int = 0, fill: str = "prefill", kv_offload: bool = False, row_cache_mib: int = 0,
              profile_top: int = 45) -> dict:
    # max_model_len sizes the block tables (and the graphs' static ones) as a server sized for that length does
    engine = LocalEngine([model], max_seqs=batch,
                         max_tokens=max(max_model_len, context + warmup + 2 * steps + 8), cuda_graphs=graphs,
                         kv_offload=kv_offload, row_cache_mib=row_cache_mib)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add(i)
    if fill == "random":          # long contexts: rows filled, no prefill run (LocalEngine.fill_context)
        for i in range(batch):
            engine.fill_context(i, context, g)
        toks = [[int(t)] for t in torch.randint(10, cfg.vocab_size - 10, (batch,), generator=g)]
    else:
        prompts = [torch.randint(10, cfg.vocab_size - 10, (context,), generator=g).tolist() for _ in range(batch)]
        for i, p in enumerate(prompts):
            engine.step([(i, p)])
        toks = [[p[-1]] for p in prompts]

    def step():
        return engine.step([(i, toks[i]) for i in range(batch)])

    for _ in range(warmup):
        step()
    timed = [g for g in (engine.graphs.graphs.values() if engine.graphs is not None else ())]
    for g in timed:
        g.graph = _TimedReplay(g.graph)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, host = [], []
    replays = engine.replays
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)       # the host's share: the GPU waits for it where it is longer
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    graphed = engine.replays - replays
    launches = [t for g in timed for t in g.graph.times]
    for g in timed:
        g.graph = g.graph.graph
    # The same steps back to back, one sync at the end: each step's host work overlaps the previous step's kernels
    # as in an engine that launches ahead (the served stage's `launch_ahead`); the synced step above adds the host
    # time to the kernels' (the GPU waits for it). Both are reported; the served comparison uses the synced one.
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        step()
    e.record()
    torch.cuda.synchronize()
    pipelined = s.elapsed_time(e) / 1e3 / steps
    counts = engine.caches[0].row_cache_counts
    hits = counts.tolist() if counts is not None else None
    kernels, top, busy_us = kernels_per_step(step, profile_top)
    by = step_bytes(model, cfg, batch, context + warmup + steps)
    med = statistics.median(times)
    return {"batch": batch, "context": context, "fill": fill, "median_step_s": med, "tokens_per_s": batch / med,
            "bytes": by, "kernels_per_step": kernels, "top_kernels": top, "kernel_busy_s": busy_us / 1e6,
            "host_step_s": statistics.median(host), "replay_host_s": statistics.median(launches) if launches else None,
            "pipelined_step_s": pipelined, "graphed_steps": graphed,
            "timed_steps": steps,
            "kv_tier": "host" if engine.caches[0].kv_host_bytes() else "vram",
            "row_cache_hit_rate": hits[0] / hits[1] if hits and hits[1] else None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full-shape")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: as many as fit)")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--context", default="256", help="comma list of context lengths, e.g. 4096,65536,262144")
    ap.add_argument("--fill", choices=["prefill", "random"], default=None,
                    help="how sequences get their context: a real prefill, or rows filled with random values "
                         "(LocalEngine.fill_context; default: random above 8192 tokens)")
    ap.add_argument("--qsa-kv-offload", action="store_true", help="QSA K/V in pinned host RAM (qsa_kv_offload)")
    ap.add_argument("--row-cache-mib", type=int, default=0,
                    help="with --qsa-kv-offload: the VRAM row cache, MiB per stage (kv_row_cache_mib)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="size block tables for this many tokens, as the server does (default: just the context)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--configs", default="none:0,all:0,all:1",
                    help="kernel set:cuda graphs pairs to measure, e.g. 'none:0,all:1,-moe:1' (A/B in one run); "
                         "separated by ';' when a kernel set lists several names (--configs='all:1;-moe_int4_fused,"
                         "-rmsnorm:1'; with '=' when the value starts with '-')")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--profile", action="store_true", help="print the kernels taking the most GPU time per step")
    ap.add_argument("--profile-top", type=int, default=45,
                    help="how many kernels --profile prints (and the JSON keeps), by GPU time; 0: all")
    ap.add_argument("--quant", default="", choices=["", "int4-experts", "int4-experts-asym", "reports-mixed"],
                    help="int4-experts: the routed experts packed in INT4 (group 128, or the largest power of two "
                         "dividing the widths), as an INT4 checkpoint loads with packed_experts on; reports-mixed: "
                         "also the plain-linear dense layers packed as the reports' release has them (INT6 group "
                         "128, lm_head INT8 per channel; quant_linear.dummy_specs), as packed_dense keeps them; "
                         "int4-experts-asym: int4-experts with zero points (AutoAWQ, GPTQ sym false)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode.py needs a CUDA device")
    raw = preset(args.preset)
    full = config_from_dict(raw)
    n = args.layers or fit_layers(full, 0.8, INT4_RATIO if args.quant else 1.0)
    raw = dict(raw, num_hidden_layers=n, layer_types=full.layer_types[:n],
               max_position_embeddings=full.max_position_embeddings)
    if isinstance(full, Qwen4ExpConfig):
        raw["ple_layer_ids"] = [i for i in full.ple_layer_ids if i <= n]
    cfg = config_from_dict(raw)
    bandwidth = hbm_bandwidth()
    t0 = time.time()
    packed = {}
    if args.quant:
        g13, g2 = dummy_groups(cfg)
        packed = {layer: (g13, g2, args.quant.endswith("-asym")) for layer in range(n) if cfg.is_sparse_moe(layer)}
    # MOEPIPE_PACKED_QKV=0: q/k/v dequantized (bf16), as the cluster key packed_qkv off loads them
    qkv = env_overrides().get("packed_qkv", True)
    dense = (lambda m: dummy_specs(m, torch.bfloat16, qkv)) if args.quant == "reports-mixed" else None   # noqa: E731
    model = build_empty(cfg, LoadOptions(device="cuda", dtype=torch.bfloat16), packed, dense)
    fill_random(model, seed=0)
    for layer in model.layers.values():
        if getattr(layer, "ple", None) is not None:
            layer.ple.table = ProceduralTable(layer.ple.spec.padded_rows, cfg.ple_head_dim, torch.bfloat16, 0)
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith(PACKED + DENSE))
    print(f"{args.preset}{' ' + args.quant if args.quant else ''}: {n} layers, {weights / 1e9:.1f} GB of weights, "
          f"built in {time.time() - t0:.0f} s; "
          f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows, hf_rows = [], []
    path = Path(args.out or f"bench/results/decode_{args.preset}.json")

    def save() -> None:
        write_json(path, {"meta": {"command": " ".join(sys.argv), "preset": args.preset, "quant": args.quant,
                                   "layers": n, "weights_bytes": weights,
                                   "hbm_copy_bandwidth_bytes_per_s": bandwidth, "gpu": torch.cuda.get_device_name(),
                                   "torch": torch.__version__, "python": platform.python_version(),
                                   "note": "roofline = batch * bandwidth / bytes per step; bandwidth counts read + "
                                           "write of a copy",
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                          "results": rows, "transformers": hf_rows})

    write_on_sigterm(save)        # a run cut by the device call's `timeout` keeps the rows it finished
    from stage_worker.kernels.flags import KernelFlags

    with torch.inference_mode():
        for conf in split_configs(args.configs):
            kernels, graphs = conf.rsplit(":", 1)
            model.set_kernels(KernelFlags.parse(kernels))
            for context, b in ((int(c), int(x)) for c in args.context.split(",") for x in args.batch.split(",")):
                fill = args.fill or ("random" if context > 8192 else "prefill")
                t_run = time.perf_counter()
                try:
                    r = run_batch(model, cfg, b, context, args.steps, args.warmup, graphs == "1",
                                  args.max_model_len, fill, args.qsa_kv_offload, args.row_cache_mib,
                                  args.profile_top)
                except Exception as exc:  # report a failing configuration and go on with the others
                    print(f"kernels={kernels} graphs={graphs} context={context} batch={b}: FAILED "
                          f"{type(exc).__name__}: {exc}")
                    continue
                r["kernels"], r["cuda_graphs"] = KernelFlags.parse(kernels).describe(), graphs == "1"
                r["roofline_tokens_per_s"] = b * bandwidth / r["bytes"]["total"]
                r["percent_of_roofline"] = 100 * r["tokens_per_s"] / r["roofline_tokens_per_s"]
                rows.append(r)
                # one line as each run ends (the table comes after all of them): a run cut off by a timeout still
                # leaves the earlier ones (h200-13 F: 4k and 262k at batch 1 and 4 printed nothing in 120 s)
                print(f"done: context {context} batch {b}: {1e3 * r['median_step_s']:.2f} ms a step, "
                      f"{r['tokens_per_s']:.1f} tok/s ({time.perf_counter() - t_run:.0f} s with its set-up and "
                      f"{fill} fill); kernels {1e3 * r['kernel_busy_s']:.2f} ms, host {1e3 * r['host_step_s']:.2f} "
                      f"ms a step ({1e3 * (r['replay_host_s'] or 0):.2f} of it the graph's launch), {r['graphed_steps']} of {r['timed_steps']} steps replayed a graph; back to back "
                      f"{1e3 * r['pipelined_step_s']:.2f} ms a step", flush=True)
                torch.cuda.empty_cache()
    print(f"{'kernels':>28} {'graphs':>6} {'context':>7} {'K/V':>4} {'hits':>5} {'batch':>5} {'GB/step':>8} "
          f"{'experts':>8} {'step ms':>8} {'tok/s':>8} {'roofline':>9} {'%':>6} {'kernels':>8} {'peak GB':>8}")
    for r in rows:
        hit = f"{r['row_cache_hit_rate']:.2f}" if r["row_cache_hit_rate"] is not None else "-"
        print(f"{r['kernels']:>28} {str(r['cuda_graphs']):>6} {r['context']:>7} {r['kv_tier']:>4} {hit:>5} "
              f"{r['batch']:>5} {r['bytes']['total'] / 1e9:>8.2f} {r['bytes']['experts_selected']:>8} "
              f"{1e3 * r['median_step_s']:>8.1f} {r['tokens_per_s']:>8.1f} {r['roofline_tokens_per_s']:>9.1f} "
              f"{r['percent_of_roofline']:>6.1f} {r['kernels_per_step']:>8} {r['peak_memory_bytes'] / 1e9:>8.1f}")
    if args.profile:
        for r in rows:
            busy = 1e6 * r["kernel_busy_s"]
            print(f"\n{r['kernels']} graphs={r['cuda_graphs']} batch {r['batch']}: top kernels by GPU time "
                  f"({busy / 1e3:.2f} ms of {1e3 * r['median_step_s']:.2f} ms step)")
            for k in r["top_kernels"]:
                print(f"  {k['total_us']:>9.1f} us {k['count']:>5}x  {k['name']}")
    if args.preset == "qwen3-next-shape" and not args.no_transformers:
        # transformers' own Qwen3-Next on the same weights (experts shared, not copied), same prompts and batches.
        from hf_reference import hf_model_from_ours, time_decode

        hf = hf_model_from_ours(model)
        g = torch.Generator().manual_seed(0)
        for b in (int(x) for x in args.batch.split(",")):
            first = int(args.context.split(",")[0])
            prompts = [torch.randint(10, cfg.vocab_size - 10, (first,), generator=g).tolist() for _ in range(b)]
            try:
                step = time_decode(hf, prompts, steps=min(args.steps, 8), warmup=2)
            except Exception as exc:
                print(f"transformers batch={b}: FAILED {type(exc).__name__}: {exc}")
                continue
            best = max((r["tokens_per_s"] for r in rows if r["batch"] == b), default=float("nan"))
            hf_rows.append({"batch": b, "median_step_s": step, "tokens_per_s": b / step,
                            "moepipe_best_tokens_per_s": best, "ratio": best / (b / step)})
            print(f"transformers Qwen3NextForCausalLM batch {b}: {1e3 * step:.1f} ms/step, {b / step:.1f} tok/s; "
                  f"moepipe's best {best:.1f} tok/s = {best / (b / step):.1f}x")
        del hf
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
