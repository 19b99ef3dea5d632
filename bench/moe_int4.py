"""INT4 fused MoE decode against the bf16 kernels at the reports' shape (issue 17): time per MoE call, bytes of the
selected experts read, and that as a share of the HBM bandwidth.

    python bench/moe_int4.py [--tokens 1,4,16] [--out bench/results/moe_int4.json]

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
from stage_worker.kernels.moe_int4_ref import PackedExperts, fused_moe_int4_ref, pack_int4  # noqa: E402
from stage_worker.kernels.moe_ref import route_ref  # noqa: E402
from tune_kernels import graph_time  # noqa: E402

HBM_TBPS = 4.8            # H200 datasheet; docs/performance.md's measured copy bandwidth is the tighter bar


def timed(fn, calls: int, runs: int) -> float:
    """Median seconds per call of fn(i), i cycling through range(calls), captured as one CUDA graph of `calls`
    calls (each with its own routing)."""
    i = itertools.count()
    return graph_time(lambda: fn(next(i) % calls), calls, runs)


def sweep(ex, H, E, k, tokens, gen, calls, runs) -> dict:
    """Per token bucket: the up phase's (BLOCK_I, BLOCK_W, warps) with the down phase fixed, then the down phase's;
    the winners go into M.UP_CFG / M.DOWN_CFG for the table."""
    out = {}
    for t in tokens:
        b = M._bucket(t)
        x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
        routes = [route_ref(torch.randn(t, E, generator=gen, device="cuda"), k, True) for _ in range(calls)]
        routes = [(w.to(torch.bfloat16), ids) for w, ids in routes]
        fn = lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex)      # noqa: E731
        for table in (M.UP_CFG, M.DOWN_CFG):
            best = None
            for rows in (4, 8, 16, 32):
                for words in (8, 16, 32):
                    for warps in (2, 4, 8):
                        table[b] = (rows, words, warps)
                        try:
                            s = timed(fn, calls, runs)
                        except Exception as exc:                  # a config the compiler refuses
                            print(f"  t={t} {(rows, words, warps)}: {type(exc).__name__}")
                            continue
                        if best is None or s < best[0]:
                            best = (s, (rows, words, warps))
            table[b] = best[1]
            print(f"  t={t} {'up' if table is M.UP_CFG else 'down'}: best {best[1]} {best[0] * 1e6:.1f} us/call")
        out[t] = {"up": M.UP_CFG[b], "down": M.DOWN_CFG[b]}
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_int4.py needs a CUDA device")
    E, H, I, k, g = args.experts, args.hidden, args.inter, args.top_k, args.group
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen, device="cuda") / I ** 0.5).to(torch.bfloat16)
    ex = PackedExperts(*pack_int4(w13, g), *pack_int4(w2, g), g)
    torch.cuda.empty_cache()
    bf16_expert = 3 * H * I * 2
    int4_expert = ex.nbytes_per_expert()
    rows = []
    swept = {}
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
        for name, fn, per in (("bf16", lambda i: K.fused_moe(x, routes[i][1], routes[i][0], w13, w2), bf16_expert),
                              ("int4", lambda i: fused_moe_int4(x, routes[i][1], routes[i][0], ex), int4_expert)):
            s = timed(fn, args.calls, args.runs)
            read = distinct * per
            outs[name] = s
            rows.append({"tokens": t, "kernel": name, "seconds_per_call": s, "bytes_read": read,
                         "tb_per_s": read / s / 1e12, "share_of_hbm": read / s / 1e12 / HBM_TBPS,
                         "distinct_experts": distinct, "rel_error_vs_ref": err if name == "int4" else None})
            print(f"{t:>6} {name:>6} {s * 1e6:>8.1f} {read / 1e6:>8.1f} {read / s / 1e12:>6.2f} "
                  f"{100 * read / s / 1e12 / HBM_TBPS:>5.1f}%")
        print(f"{'':>6} int4 / bf16 time: {outs['int4'] / outs['bf16']:.2f}; int4 vs reference: rel. error {err:.1e}")
    if args.out:
        meta = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "host": platform.node(),
                "shape": {"experts": E, "hidden": H, "inter": I, "top_k": k, "group": g}, "swept": swept,
                "up_cfg": M.UP_CFG, "down_cfg": M.DOWN_CFG}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
