"""INT4 fused MoE decode against the bf16 kernels at the reports' shape (issue 17): time per MoE call, bytes of the
selected experts read, and that as a share of the HBM bandwidth.

    python bench/moe_int4.py [--tokens 1,4,16] [--sweep [--jobs 14]] [--claims] [--out bench/results/moe_int4.json]

Each measurement is a CUDA graph of `--calls` calls, each with its own routing (top-k of random logits, so
consecutive calls pick other experts and the L2 cannot serve them), replayed `--runs` times after a warm-up
(`tune_kernels.graph_time`); the time per call is the median replay over the calls in it. Bytes: the distinct experts a call selects times the bytes
of one expert (bf16: 3 x H x I x 2; INT4: the words and the group scales). Routed experts only (no shared slot, so
both kernels do the same work). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels import moe_int4 as M  # noqa: E402
from stage_worker.kernels.moe_int4 import fused_moe_int4  # noqa: E402
from stage_worker.kernels.moe_int4_ref import PackedExperts, fused_moe_int4_ref, pack_fp4, pack_int4  # noqa: E402
from stage_worker.kernels.moe_ref import route_ref  # noqa: E402
from tune_kernels import graph_time  # noqa: E402

HBM_TBPS = 4.8            # H200 datasheet; docs/performance.md's measured copy bandwidth is the tighter bar


def timed(fn, calls: int, runs: int) -> float:
    """Median seconds per call of fn(i), i cycling through range(calls), captured as one CUDA graph of `calls`
    calls (each with its own routing)."""
    i = itertools.count()
    return graph_time(lambda: fn(next(i) % calls), calls, runs)


UP_CANDIDATES = [(bi, bw, w) for w in (1, 2, 4, 8) for bi in (4, 8, 16, 32) for bw in (32, 64, 128)
                 if 8 <= 2 * bi * bw // (32 * w) <= 32]      # 8..32 words a thread over the gate and up tiles
DOWN_CANDIDATES = [(bh, bw, w) for w in (1, 2, 4, 8) for bh in (4, 8, 16, 32, 64) for bw in (32, 64, 128, 256)
                   if 8 <= bh * bw // (32 * w) <= 32]


PREFETCH_DEPTHS = (0, 1, 2)


def _compile_worker(args) -> int:
    """Compile (into Triton's on-disk cache) the kernels of each (up, down, prefetch) config on a small table with the
    full shape's strides, so the sweep's launches find them compiled."""
    cfgs, H, I, k, g = args
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import torch as t
    from stage_worker.kernels import moe_int4 as m
    from stage_worker.kernels.moe_int4_ref import PackedExperts as P

    E = 16
    dev = "cuda" if t.cuda.is_available() else "cpu"          # cpu: a dry run under TRITON_INTERPRET=1
    ex = P(t.randint(-2 ** 31, 2 ** 31 - 1, (E, 2 * I, H // 8), dtype=t.int32, device=dev),
           t.rand(E, 2 * I, -(-H // g), device=dev).to(t.bfloat16),
           t.randint(-2 ** 31, 2 ** 31 - 1, (E, H, I // 8), dtype=t.int32, device=dev),
           t.rand(E, H, -(-I // g), device=dev).to(t.bfloat16), g)
    x = t.randn(1, H, device=dev).to(t.bfloat16)
    ids = t.arange(k, dtype=t.int32, device=dev)[None]
    w = t.full((1, k), 0.1, device=dev).to(t.bfloat16)
    for up, down, pf in cfgs:
        m.UP_CFG[1], m.DOWN_CFG[1], m.PREFETCH[1] = up, down, pf
        m.fused_moe_int4(x, ids, w, ex)
    if dev == "cuda":
        t.cuda.synchronize()
    return len(cfgs)


def precompile(H, I, k, g, jobs: int) -> None:
    """Every candidate config at each prefetch depth, compiled by `jobs` processes at once (Triton compiles one kernel
    at a time per process; the sweep would otherwise spend minutes compiling)."""
    import multiprocessing as mp

    pairs = itertools.zip_longest(UP_CANDIDATES, DOWN_CANDIDATES, fillvalue=None)
    cfgs = [(u or M.UP_CFG[1], d or M.DOWN_CFG[1], pf) for u, d in pairs for pf in PREFETCH_DEPTHS]
    with mp.get_context("spawn").Pool(jobs) as pool:
        done = sum(pool.map(_compile_worker, [(cfgs[i::jobs], H, I, k, g) for i in range(jobs)]))
    print(f"  precompiled {done} config pairs in {jobs} processes")


def sweep(ex, H, E, k, tokens, gen, calls, runs) -> dict:
    """Per token bucket: the up phase's (BLOCK_I, BLOCK_W, warps) with the down phase fixed, then the down phase's;
    the winners go into M.UP_CFG / M.DOWN_CFG for the table. Then the prefetch depths 0, 1, 2 with them."""
    out = {}
    for t in tokens:
        b = M._bucket(t)
        x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
        routes = [route_ref(torch.randn(t, E, generator=gen, device="cuda"), k, True) for _ in range(calls)]
        routes = [(w.to(torch.bfloat16), ids) for w, ids in routes]
        fn = lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex)      # noqa: E731
        res = {"up": {}, "down": {}}
        for table, cands, name in ((M.UP_CFG, UP_CANDIDATES, "up"), (M.DOWN_CFG, DOWN_CANDIDATES, "down")):
            best = None
            for cfg in cands:
                table[b] = cfg
                try:
                    s = timed(fn, calls, runs)
                except Exception as exc:                  # a config the compiler refuses
                    print(f"  t={t} {cfg}: {type(exc).__name__}")
                    continue
                res[name][str(cfg)] = s
                if best is None or s < best[0]:
                    best = (s, cfg)
            table[b] = best[1]
            top = sorted(res[name].items(), key=lambda kv: kv[1])[:4]
            print(f"  t={t} {name}: best {best[1]} {best[0] * 1e6:.1f} us/call; next "
                  + ", ".join(f"{c} {v * 1e6:.1f}" for c, v in top[1:]))
        res["prefetch"] = {}
        for depth in PREFETCH_DEPTHS:
            M.PREFETCH[b] = depth
            res["prefetch"][depth] = timed(fn, calls, runs)
        M.PREFETCH[b] = min(res["prefetch"], key=res["prefetch"].get)
        print(f"  t={t} prefetch depth: " + ", ".join(f"{d}: {s * 1e6:.1f} us" for d, s in res["prefetch"].items())
              + f" -> {M.PREFETCH[b]}")
        out[t] = {"up": M.UP_CFG[b], "down": M.DOWN_CFG[b], "prefetch": M.PREFETCH[b], "times": res}
    print(f"UP_CFG = {M.UP_CFG}\nDOWN_CFG = {M.DOWN_CFG}\nPREFETCH = {M.PREFETCH}")
    return out


class _Skip:
    """Stands in for a kernel so that only the other phase runs (phase timing)."""

    def __getitem__(self, grid):
        return lambda *a, **kw: None


def phase_times(fn, calls, runs) -> dict:
    """Time with only the up launch and with only the down launch (the other replaced by nothing; the down phase
    then reads stale activations, which does not change its work)."""
    out = {}
    for name, attr in (("up_only", "_int4_down_kernel"), ("down_only", "_int4_up_kernel")):
        real = getattr(M, attr)
        setattr(M, attr, _Skip())
        try:
            out[name] = timed(fn, calls, runs)
        finally:
            setattr(M, attr, real)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--inter", type=int, default=640)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="first try launch configs of the INT4 kernels per token bucket (up, then down) and use the "
                         "fastest (printed: the values for moe_int4.UP_CFG / DOWN_CFG)")
    ap.add_argument("--profile-only", action="store_true",
                    help="only run the INT4 call a few times at the first --tokens count, no graphs (for ncu)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="with --sweep: compile the candidate configs in this many processes first")
    ap.add_argument("--claims", action="store_true",
                    help="also time the INT4 kernels' claim variant (moves on read) claiming nothing, and claiming "
                         "a selected slot (its rows stored into a spare as they are read)")
    ap.add_argument("--asym", action="store_true",
                    help="also time asymmetric experts (zero points in the scale rows: AutoAWQ, GPTQ sym false)")
    ap.add_argument("--fp4", action="store_true",
                    help="also time FP4 experts (E2M1 codes, float32 scales in NVFP4's groups of 16: NVFP4A16)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_int4.py needs a CUDA device")
    E, H, I, k, g = args.experts, args.hidden, args.inter, args.top_k, args.group
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen, device="cuda") / I ** 0.5).to(torch.bfloat16)
    ex = PackedExperts(*pack_int4(w13, g), *pack_int4(w2, g), g)
    ex_claim = PackedExperts(*pack_int4(w13, g), *pack_int4(w2, g), g) if args.claims else None  # spares written
    ex_asym = PackedExperts(*pack_int4(w13, g, True), *pack_int4(w2, g, True), g) if args.asym else None
    ex_fp4 = PackedExperts(*pack_fp4(w13, 16), *pack_fp4(w2, 16), 16, fp4=True) if args.fp4 else None
    torch.cuda.empty_cache()
    if args.profile_only:
        t = int(args.tokens.split(",")[0])
        x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(6):
            w, ids = route_ref(torch.randn(t, E, generator=gen, device="cuda"), k, True)
            fused_moe_int4(x, ids, w.to(torch.bfloat16), ex)
        torch.cuda.synchronize()
        return 0
    bf16_expert = 3 * H * I * 2
    int4_expert = ex.nbytes_per_expert()
    rows = []
    swept = {}
    if args.sweep and args.jobs:
        precompile(H, I, k, g, args.jobs)
    if args.sweep:
        swept = sweep(ex, H, E, k, [int(v) for v in args.tokens.split(",")], gen, args.calls, args.runs)
    print(f"{'tokens':>6} {'kernel':>6} {'us/call':>8} {'MB read':>8} {'TB/s':>6} {'% HBM':>6}  (E {E}, H {H}, I {I}, "
          f"top-{k}, group {g}; expert {bf16_expert / 1e6:.2f} MB bf16, {int4_expert / 1e6:.2f} MB int4)")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
        routes = [route_ref(torch.randn(t, E, generator=gen, device="cuda"), k, True) for _ in range(args.calls)]
        routes = [(w.to(torch.bfloat16), ids) for w, ids in routes]
        distinct = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
        ref = fused_moe_int4_ref(x, routes[0][1], routes[0][0], ex)
        got = fused_moe_int4(x, routes[0][1], routes[0][0], ex)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        outs = {}
        # The claim variant (issue 16, moves on read): compiled in whenever experts can move, so every layer pays
        # for it, the layers that read no host row too (h200-25: every layer's INT4 GEMVs grew with moves on).
        # "claim-" claims no slot (-1: the variant's cost alone); "claim+" claims a slot each call selects, whose
        # words the kernels also store into a spare slot (the stores' cost).
        none = (torch.full((1,), -1, dtype=torch.int32, device="cuda"),
                torch.full((1,), -1, dtype=torch.int64, device="cuda"))
        hits = [(routes[i][1][0, :1].to(torch.int32).contiguous(),
                 torch.full((1,), (int(routes[i][1][0, 0]) + E // 2) % E, dtype=torch.int64, device="cuda"))
                for i in range(args.calls)]
        kernels = [("bf16", lambda i: K.fused_moe(x, routes[i][1], routes[i][0], w13, w2), bf16_expert),
                   ("int4", lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex), int4_expert)]
        if args.claims:
            kernels += [("claim-", lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex, claim=none),
                         int4_expert),
                        ("claim+", lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex_claim, claim=hits[i]),
                         int4_expert)]
        if args.asym:
            kernels += [("asym", lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex_asym),
                         ex_asym.nbytes_per_expert())]
        if args.fp4:
            kernels += [("fp4", lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex_fp4),
                         ex_fp4.nbytes_per_expert())]
        for name, fn, per in kernels:
            s = timed(fn, args.calls, args.runs)
            read = distinct * per
            outs[name] = s
            phases = phase_times(fn, args.calls, args.runs) if name != "bf16" else {}
            rows.append({"tokens": t, "kernel": name, "seconds_per_call": s, "bytes_read": read,
                         "tb_per_s": read / s / 1e12, "share_of_hbm": read / s / 1e12 / HBM_TBPS,
                         "distinct_experts": distinct, "rel_error_vs_ref": err if name != "bf16" else None,
                         **{f"seconds_{p}": v for p, v in phases.items()}})
            print(f"{t:>6} {name:>6} {s * 1e6:>8.1f} {read / 1e6:>8.1f} {read / s / 1e12:>6.2f} "
                  f"{100 * read / s / 1e12 / HBM_TBPS:>5.1f}%"
                  + "".join(f"  {p} {v * 1e6:.1f} us" for p, v in phases.items()))
        print(f"{'':>6} int4 / bf16 time: {outs['int4'] / outs['bf16']:.2f}; int4 vs reference: rel. error {err:.1e}")
    if args.out:
        meta = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "host": platform.node(),
                "shape": {"experts": E, "hidden": H, "inter": I, "top_k": k, "group": g}, "swept": swept,
                "up_cfg": M.UP_CFG, "down_cfg": M.DOWN_CFG, "prefetch": M.PREFETCH}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
