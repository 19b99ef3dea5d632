"""Client-side serving benchmark: time to first token, inter-token latency (median, p90) and tokens/s at 1 and 4
concurrent streams, measured as the field reports do (002 §3.0): fixed prompts and seed, one warm-up run, three
measured runs, median ITL and mean tokens/s, TTFT from the client; "decode tok/s" is streams / median TPOT, what
decoding alone sustains (the mean tokens/s also pays every request's TTFT). ITL is between text-bearing chunks (what a
client sees, as vLLM's benchmark reports it); TPOT is a request's time per output token after its first chunk,
from the usage count, and `tokens_per_chunk` says how far the two differ (1.0 for a real model's text). When a chunk
carries several tokens (dummy weights: ~7), the client's TPOT runs low by about (tokens per chunk - 1) / tokens,
since the first chunk's extra tokens fall outside its span; "server TPOT" (the gateway's mean time between
consecutive tokens of a request, moepipe_inter_token_latency_seconds, over the measured runs) is exact. "TTFT
split" divides the server's mean TTFT of the measured requests (from HTTP receipt) into the engine core's queue
and prefill (moepipe_request_queue_time_seconds, _prefill_time_seconds) and the gateway's share (tokenizing,
hand-off, the first token's way back: moepipe_request_gateway_time_seconds).

    python bench/serve.py                      # starts `moepipe serve --stages 2` on the built-in demo model
    python bench/serve.py --url http://127.0.0.1:8000 --model-name moepipe
    python bench/serve.py --stages 2 --no-ple-service          # A/B: the in-process PLE fallback
    python bench/serve.py --model M --cold --prompt-chars 90000 --text-seed 1   # cold PLE time to first token
    python bench/serve.py --model M --cold --prompt-chars 90000 --cold-text code  # ... on real code, not random words
Prints a table and writes JSON (--out).

`--cold` (issue 18) measures time to first token on text the server has never seen with the PLE table's pages
dropped from the page cache before each request, then the same prompt again (its rows now resident): cold against
warm, per run, with the table's resident share before the cold request and the stages' wait for PLE rows. TTFT
there is a one-token completion's latency (prefill and one sampled token), since dummy weights' tokens often carry
no text. Eviction pages out the server processes' mappings of the table first (`process_madvise(MADV_PAGEOUT)`, root
or CAP_SYS_NICE: a process that read rows of a freshly written table maps whole large folios, the whole table after
a few thousand tokens), and each run still sends new random words (`--text-seed` gives each side of an A/B its own),
so nothing of the prompt can be cached anywhere. The table is the checkpoint's expanded PLE file;
for dummy weights serve with `--set dummy_ple_file=true` so there is one (`bench/results/` notes the sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Explain what a mixture-of-experts layer does, in two sentences.",
    "List three uses of a hash map in a compiler.",
    "def quicksort(xs):",
]


def long_prompt(chars: int, i: int) -> str:
    """A long fixed prompt, as coding agents send (system prompt, tools, files): this file's own source, repeated,
    from a per-stream offset."""
    text = Path(__file__).read_text()
    text = text * (chars // len(text) + 2)
    return text[i * 101: i * 101 + chars]


async def one_stream(client, model: str, prompt: str, max_tokens: int, seed: int) -> dict:
    """One streamed request. Times are per text-bearing chunk, as clients see them (vLLM's benchmark does the
    same); the token count comes from the usage chunk, because a chunk can carry several tokens (text held back
    until it is valid UTF-8, or ids a stand-in tokenizer has no text for: dummy full-shape weights)."""
    t0 = time.perf_counter()
    stamps = []
    tokens = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.7,
                                             seed=seed, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if not stamps:
        return {"ttft": float("nan"), "itl": [], "tpot": float("nan"), "tokens": tokens, "chunks": 0,
                "seconds": time.perf_counter() - t0}
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tpot": tpot,
            "tokens": tokens, "chunks": len(stamps), "seconds": stamps[-1] - t0}


def scrape(url: str) -> dict[tuple, float]:
    """The gateway's /metrics as {(sample name, sorted labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def pipeline_stats(before: dict, after: dict, wall: float) -> dict:
    """Per stage: busy fraction (compute seconds / wall time of the measured runs); per link and step kind: mean
    time activations spent between stages (moepipe_stage_transfer_seconds)."""
    def delta(name: str, labels: tuple) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    busy = {dict(lab)["stage"]: delta(name, lab) / wall
            for name, lab in after if name == "moepipe_stage_step_seconds_sum"}
    step_ms = {dict(lab)["stage"]: 1e3 * delta(name, lab) / n for name, lab in after
               if name == "moepipe_stage_step_seconds_sum"
               for n in [delta("moepipe_stage_step_seconds_count", lab)] if n > 0}
    transfer = {}
    for name, lab in after:
        if name == "moepipe_stage_transfer_seconds_sum":
            n = delta("moepipe_stage_transfer_seconds_count", lab)
            if n > 0:
                d = dict(lab)
                transfer[f"{d['link']} {d['step_kind']}"] = {"mean_ms": 1e3 * delta(name, lab) / n, "count": n}
    # the stages' time waiting for the PLE service's rows, over the wall time (heartbeat totals: ~1 s granular)
    ple_wait = delta("moepipe_ple_stage_wait_seconds_total", ()) / wall
    # of which decode-only steps (the stage -> service -> stage round trip after each sampled token, paid by decode
    # steps of more than ple_decode_in_stage_max_seqs sequences); the rest is prefill chunks' rows
    ple_decode_wait = delta("moepipe_ple_stage_decode_wait_seconds_total", ()) / wall
    # the gateway's mean time between consecutive tokens of a request: TPOT token by token, however the text is
    # chunked (dummy weights' tokens often have no text of their own, so a client chunk carries several)
    n_itl = delta("moepipe_inter_token_latency_seconds_count", ())
    server_tpot = 1e3 * delta("moepipe_inter_token_latency_seconds_sum", ()) / n_itl if n_itl else float("nan")
    # rows a PLE stage gathered itself for decode steps (ple_decode_in_stage): host time a step on the stage's
    # critical path (its own series: h200-15 divided the PLE service's prefill gathers by these steps, 20-71 ms)
    n_gathers = delta("moepipe_ple_stage_gathers_total", ())
    gather_ms = 1e3 * delta("moepipe_ple_stage_gather_seconds_total", ()) / n_gathers if n_gathers else float("nan")

    def mean(histogram: str) -> float:
        """Mean of one histogram's observations in the measured runs (NaN: none, or a server without it)."""
        n = delta(histogram + "_count", ())
        return delta(histogram + "_sum", ()) / n if n else float("nan")

    # the server's TTFT (from HTTP receipt) split: the engine core's queue (arrival at the core to first scheduling)
    # and prefill (to the first token's result at the core), and the gateway's share (the rest: tokenizing,
    # hand-off, the first token's way back to the API layer)
    phases = {"server_ttft_s": mean("moepipe_time_to_first_token_seconds"),
              "server_queue_s": mean("moepipe_request_queue_time_seconds"),
              "server_prefill_s": mean("moepipe_request_prefill_time_seconds"),
              "server_gateway_s": mean("moepipe_request_gateway_time_seconds"),
              "server_decode_s": mean("moepipe_request_decode_time_seconds"),
              "server_request_tpot_ms": 1e3 * mean("moepipe_request_time_per_output_token_seconds")}
    return {**phases, "server_tpot_ms": server_tpot, "stage_busy_fraction": busy, "stage_step_ms": step_ms,
            "ple_wait_fraction": ple_wait, "ple_decode_wait_fraction": ple_decode_wait,
            "ple_stage_gather_ms": gather_ms,
            "transfer": transfer,
            "preemptions": delta("moepipe_preemptions", ())}


async def watch_pools(url: str, seen: dict, stop: asyncio.Event, every: float = 1.0) -> None:
    """Poll /metrics while runs go: the most requests running at once and KV blocks in use, the pool's size and
    its bytes by tier (long-context residency: were all streams resident at once, or preempted)."""
    while not stop.is_set():
        try:
            m = await asyncio.to_thread(scrape, url)
        except Exception:                                   # a slow scrape must not end the benchmark
            m = {}
        for key, name in (("max_running", "moepipe_requests_running"), ("max_kv_blocks_used", "moepipe_kv_blocks_used")):
            seen[key] = max(seen.get(key, 0), m.get((name, ()), 0))
        seen["kv_blocks_total"] = m.get(("moepipe_kv_blocks_total", ()), seen.get("kv_blocks_total", 0))
        tiers = {f"stage {dict(lab)['stage']} {dict(lab)['tier']}": v for (n, lab), v in m.items()
                 if n == "moepipe_kv_cache_tier_bytes"}
        seen["kv_tier_bytes"] = tiers or seen.get("kv_tier_bytes", {})
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def run_level(url: str, model: str, streams: int, max_tokens: int, runs: int, prompt_chars: int = 0,
                    warmup_chars: int = -1) -> dict:
    from openai import AsyncOpenAI

    results = []
    before, t_start = None, 0.0
    prompts = [long_prompt(prompt_chars, i) if prompt_chars else PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    # --warmup-chars: a shorter warm-up (kernels compile per chunk shape, not per context), so that a long-context
    # level does not pay its whole prefill twice
    warm = prompts if warmup_chars < 0 else [long_prompt(warmup_chars, i) if warmup_chars else
                                             PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    pools: dict = {}
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600) as client:   # closed inside this loop
        for run in range(runs + 1):                    # run 0 is the warm-up
            if run == 1:
                before, t_start = scrape(url), time.perf_counter()
                stop = asyncio.Event()
                watcher = asyncio.create_task(watch_pools(url, pools, stop))
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[one_stream(client, model, (prompts if run else warm)[i], max_tokens,
                                                     1000 + i) for i in range(streams)])
            wall = time.perf_counter() - t0
            if run:
                results.append((outs, wall))
        if runs:
            stop.set()
            await watcher
    stats = pipeline_stats(before, scrape(url), time.perf_counter() - t_start) if before is not None else {}
    stats["pools"] = pools
    itl = [x for outs, _ in results for o in outs for x in o["itl"]]
    ttft = [o["ttft"] for outs, _ in results for o in outs]
    per_run_tps = [sum(o["tokens"] for o in outs) / wall for outs, wall in results]
    tpot = [o["tpot"] for outs, _ in results for o in outs if not math.isnan(o["tpot"])]
    tokens = sum(o["tokens"] for outs, _ in results for o in outs)
    chunks = sum(o["chunks"] for outs, _ in results for o in outs)
    return {"streams": streams, "runs": runs, "max_tokens": max_tokens, "prompt_chars": prompt_chars,
            "ttft_median_s": statistics.median(ttft), "ttft_mean_s": statistics.fmean(ttft),
            "itl_median_ms": 1e3 * statistics.median(itl) if itl else float("nan"),
            "itl_p90_ms": 1e3 * _p90(itl) if itl else float("nan"),
            "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
            "tpot_p90_ms": 1e3 * _p90(tpot) if tpot else float("nan"),
            "tokens_per_chunk": tokens / chunks if chunks else float("nan"),
            "tokens_per_s_mean": statistics.fmean(per_run_tps),
            # streams / TPOT: what decoding alone sustains (tokens/s above also pays every request's TTFT)
            "decode_tokens_per_s": streams / statistics.median(tpot) if tpot else float("nan"),
            **stats}


def unseen_text(chars: int, seed: int, kind: str = "words") -> str:
    """`chars` characters no other seed sends. `words`: seeded random lowercase words, whose token n-grams (so PLE
    rows) almost never repeat, the worst case for a cold table. `code`: real source text, the Python standard
    library's own modules (on every machine that runs this), a block of whole files per seed, blocks disjoint:
    real n-gram repetition, as an agent's prompt has it."""
    if kind == "code":
        return _stdlib_block(chars, seed)
    rng = random.Random(seed)
    words, n = [], 0
    while n < chars:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(word)
        n += len(word) + 1
    return " ".join(words)[:chars]


def _stdlib_block(chars: int, seed: int) -> str:
    """The standard library's .py files in a fixed shuffled order, cut into consecutive blocks of at least `chars`
    characters; block `seed` mod the number of blocks."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    random.Random(0).shuffle(files)
    blocks, cur, n = [], [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        cur.append(f"# {path.relative_to(root)}\n{text}")
        n += len(cur[-1])
        if n >= chars:
            blocks.append("\n".join(cur)[:chars])
            cur, n = [], 0
    if not blocks:
        raise SystemExit(f"the standard library has fewer than {chars} characters of source for one block")
    return blocks[seed % len(blocks)]


async def one_token(client, model: str, prompt: str) -> tuple[float, int]:
    """Seconds to a one-token completion of `prompt` (prefill + one sampled token) and its prompt tokens."""
    t0 = time.perf_counter()
    out = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    return time.perf_counter() - t0, out.usage.prompt_tokens


def _process_name(pid: int) -> str:
    """A process's command line, shortened, for the cold report's list of who holds the table mapped."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        return " ".join(args[:4])[:100]
    except OSError:
        return "?"


def _ple_delta(before: dict, after: dict, series: str = "stage_wait_seconds") -> float:
    """How much one `moepipe_ple_<series>_total` counter grew between two scrapes."""
    name = (f"moepipe_ple_{series}_total", ())
    return after.get(name, 0.0) - before.get(name, 0.0)


async def run_cold(url: str, model: str, chars: int, runs: int, text_seed: int, tables: list[Path],
                   text: str = "words") -> dict:
    """Cold and warm TTFT on unseen text, `runs` times (see the module docstring)."""
    from openai import AsyncOpenAI

    from ple_service.page_cache import evict, mapped_rss, resident_fraction

    if not tables:
        raise SystemExit("--cold: the model directory has no expanded PLE table (ple_table.layer*.bin); for dummy "
                         "weights add --set dummy_ple_file=true")
    settle = 1.5         # the stages' PLE totals reach /metrics with their ~1 s heartbeat
    runs_out = []
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=1800) as client:
        await one_token(client, model, PROMPTS[0])                               # kernels
        # prefill kernels (chunks of one shape; attention compiles once whatever the context): a shorter text
        await one_token(client, model, unseen_text(min(chars, 8000), 1_000_003 * text_seed + 999_999))   # words
        for run in range(runs):
            prompt = unseen_text(chars, 1_000_003 * text_seed + run if text == "words" else
                                 1 + text_seed * runs + run, text)
            refused = []
            for path in tables:                 # the server's mappings paged out too (ple_service/page_cache.py)
                refused += evict(path, pids=list(mapped_rss(path)))
            share = resident_fraction(tables)
            mapped: dict[int, int] = {}         # pages a process still holds mapped: what eviction could not drop
            for path in tables:
                for pid, rss in mapped_rss(path).items():
                    mapped[pid] = mapped.get(pid, 0) + rss
            mapped = {f"{pid} {_process_name(pid)}": rss for pid, rss in mapped.items()}
            m0 = scrape(url)
            cold, tokens = await one_token(client, model, prompt)
            await asyncio.sleep(settle)
            m1 = scrape(url)
            warm, _ = await one_token(client, model, prompt)
            await asyncio.sleep(settle)
            m2 = scrape(url)
            runs_out.append({"prompt_tokens": tokens, "cold_s": cold, "warm_s": warm, "resident_before": share,
                             "mapped_before_bytes": mapped, "page_out_refused": refused,
                             "cold_ple_wait_s": _ple_delta(m0, m1), "warm_ple_wait_s": _ple_delta(m1, m2),
                             # the prefetch threads' work for the cold request: pages advised and the seconds
                             # spent advising them (summed over threads; ple_prefetch_threads)
                             "cold_prefetch_pages": _ple_delta(m0, m1, "prefetch_pages"),
                             "cold_prefetch_s": _ple_delta(m0, m1, "prefetch_seconds")})
    cold = statistics.median(r["cold_s"] for r in runs_out)
    warm = statistics.median(r["warm_s"] for r in runs_out)
    return {"prompt_chars": chars, "runs": runs, "text_seed": text_seed, "text": text, "cold_ttft_median_s": cold,
            "warm_ttft_median_s": warm, "cold_over_warm": cold / warm,
            "table_gib": sum(p.stat().st_size for p in tables) / 2**30, "per_run": runs_out}


def _p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile (for two values, the larger)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--model", default=None, help="checkpoint to serve (default: the built-in demo model)")
    ap.add_argument("--model-name", default="moepipe")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--no-ple-service", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="the components log at INFO (load, warm-up, graph capture: where a slow start spends it)")
    ap.add_argument("--load-format", choices=["safetensors", "dummy"], default=None,
                    help="dummy: seeded random weights (config-only checkpoints: make-model --preset full-shape)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a cluster config key for the served cluster (repeatable), e.g. --set num_blocks=4096")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-chars", default="0",
                    help="comma list; 0 = the short fixed prompts, N = long prompts of N characters (about 3.5 per "
                         "token); every stream count is measured with each")
    ap.add_argument("--warmup-chars", type=int, default=-1,
                    help="the warm-up run's prompt length (default: the measured prompts; 0: the short prompts)")
    ap.add_argument("--cold", action="store_true",
                    help="cold PLE time to first token on unseen text of --prompt-chars characters (docstring)")
    ap.add_argument("--text-seed", type=int, default=0, help="--cold: which unseen text (one per side of an A/B)")
    ap.add_argument("--cold-text", default="words", choices=["words", "code"],
                    help="--cold: random words (n-grams that never repeat: the worst case) or real code (the Python "
                         "standard library's sources, a disjoint block per run and seed)")
    ap.add_argument("--out", default="bench/results/serve.json")
    args = ap.parse_args()
    # `timeout` (every device script wraps us in one) sends SIGTERM: leave through the `finally` below, which stops
    # the served cluster and waits for its processes, so the next server in the same call finds the GPU free (h100-31
    # call 2: one killed mid-run still held 65 GB when the next one planned its memory, and was refused)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.cold and int(args.prompt_chars.split(",")[0]) <= 0:
        ap.error("--cold needs --prompt-chars N (the unseen prompt's length in characters)")

    cluster = None
    url = args.url
    if url is None:
        from gateway.launcher import Cluster, ServeOptions
        from shared.cli import ensure_builtin_model

        model = Path(args.model) if args.model else ensure_builtin_model()
        # Without the prefix cache unless --set enable_prefix_caching=true: the warm-up and the measured runs send
        # the same prompts, whose prefill it would skip (bench/prefix_cache.py measures it).
        extra = {"enable_prefix_caching": False, **({"ple_service": False} if args.no_ple_service else {})}
        if args.load_format:
            extra["load_format"] = args.load_format
        from cluster_sets import parse_sets

        extra.update(parse_sets(args.set, ap.error))
        from shared.cluster_config import ClusterConfigError

        try:
            cluster = Cluster(ServeOptions(model=model, stages=args.stages, device=args.device, port=args.port,
                                           extra=extra, verbose=args.verbose)).__enter__()
        except ClusterConfigError as exc:             # an unknown --set key, a value the config refuses
            ap.error(f"--set: {exc}")
        url = cluster.url
    try:
        if args.cold:
            model_dir = Path(args.model) if args.model else None
            tables = sorted(model_dir.glob("ple_table.layer*.bin")) if model_dir else []
            cold = asyncio.run(run_cold(url, args.model_name, int(args.prompt_chars.split(",")[0]), args.runs,
                                        args.text_seed, tables, args.cold_text))
            rows = []
        else:
            rows = [asyncio.run(run_level(url, args.model_name, int(n), args.max_tokens, args.runs, int(chars),
                                          args.warmup_chars))
                    for chars in args.prompt_chars.split(",") for n in args.streams.split(",")]
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
    meta = {"command": " ".join(sys.argv), "machine": platform.node(), "python": platform.python_version(),
            "stages": args.stages, "device": args.device, "ple_service": not args.no_ple_service,
            "load_format": args.load_format or "safetensors", "set": args.set,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.cold:
        return _report_cold(cold, meta, Path(args.out))
    print(f"{'prompt':>6} {'streams':>7} {'TTFT med s':>10} {'ITL med ms':>10} {'ITL p90 ms':>10} "
          f"{'TPOT med ms':>11} {'tok/chunk':>9} {'tok/s':>8} {'decode tok/s':>12}")
    for r in rows:
        print(f"{r['prompt_chars'] or 'short':>6} {r['streams']:>7} {r['ttft_median_s']:>10.3f} "
              f"{r['itl_median_ms']:>10.1f} {r['itl_p90_ms']:>10.1f} {r['tpot_median_ms']:>11.1f} "
              f"{r['tokens_per_chunk']:>9.2f} {r['tokens_per_s_mean']:>8.1f} {r['decode_tokens_per_s']:>12.1f}")
    for r in rows:
        busy = ", ".join(f"stage {k} {v:.2f}" for k, v in sorted(r.get("stage_busy_fraction", {}).items()))
        moves = ", ".join(f"{k} {v['mean_ms']:.2f} ms" for k, v in sorted(r.get("transfer", {}).items()))
        steps = ", ".join(f"stage {k} {v:.2f} ms" for k, v in sorted(r.get("stage_step_ms", {}).items()))
        print(f"  {r['prompt_chars'] or 'short'} x {r['streams']}: server TPOT {r.get('server_tpot_ms', 0):.2f} ms "
              f"({r['streams'] / r.get('server_tpot_ms', float('nan')) * 1e3:.1f} tok/s); busy {busy or '-'}; "
              f"step {steps or '-'}; "
              f"waiting for PLE rows {r.get('ple_wait_fraction', 0):.3f} "
              f"(decode steps {r.get('ple_decode_wait_fraction', float('nan')):.3f}); "
              f"stage's own PLE gather {r.get('ple_stage_gather_ms', float('nan')):.3f} ms a step; "
              f"activations between stages: {moves or '-'}; preemptions {r.get('preemptions', 0):.0f}")
        if not math.isnan(r.get("server_queue_s", float("nan"))):
            print(f"    TTFT split: queue {r['server_queue_s']:.3f} s, prefill {r['server_prefill_s']:.3f} s, "
                  f"gateway {r['server_gateway_s']:.3f} s (server TTFT {r['server_ttft_s']:.3f} s)")
        p = r.get("pools", {})
        if p:
            # the stages report their device's pool as tier "vram" whatever the device: RAM on a CPU stage
            dev = "ram" if args.device == "cpu" else "vram"
            tiers = ", ".join(f"{k.replace('vram', dev)} {v / 2**30:.2f} GiB"
                              for k, v in sorted(p.get("kv_tier_bytes", {}).items()))
            print(f"    at once: {p.get('max_running', 0):.0f} requests running, {p.get('max_kv_blocks_used', 0):.0f} "
                  f"of {p.get('kv_blocks_total', 0):.0f} KV blocks used; KV pool {tiers or '-'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _report_cold(cold: dict, meta: dict, out: Path) -> int:
    print(f"PLE table {cold['table_gib']:.1f} GiB; prompt {cold['prompt_chars']} chars of {cold['text']}; "
          f"text seed {cold['text_seed']}")
    print(f"{'run':>3} {'tokens':>7} {'resident':>8} {'cold s':>8} {'warm s':>8} {'cold/warm':>9} "
          f"{'PLE wait cold s':>15} {'warm s':>7} {'prefetched pages':>16} {'advising s':>10}")
    for i, r in enumerate(cold["per_run"]):
        print(f"{i:>3} {r['prompt_tokens']:>7} {r['resident_before']:>8.3f} {r['cold_s']:>8.2f} {r['warm_s']:>8.2f} "
              f"{r['cold_s'] / r['warm_s']:>9.2f} {r['cold_ple_wait_s']:>15.2f} {r['warm_ple_wait_s']:>7.2f} "
              f"{r.get('cold_prefetch_pages', 0):>16.0f} {r.get('cold_prefetch_s', 0):>10.2f}")
        held = ", ".join(f"pid {pid} {b / 2**30:.2f} GiB" for pid, b in sorted(r.get("mapped_before_bytes", {}).items()))
        print(f"    still mapped in processes before the cold request: {held or 'none'}"
              + "".join(f"; {why}" for why in r.get("page_out_refused", [])))
    print(f"median: cold {cold['cold_ttft_median_s']:.2f} s, warm {cold['warm_ttft_median_s']:.2f} s, "
          f"cold/warm {cold['cold_over_warm']:.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "cold": cold}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
