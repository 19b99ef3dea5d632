"""Sweep the launch tunables of the byte-bound decode kernels at real shapes, on the GPU.

    python bench/tune_kernels.py                         # MoE up/down and hyper-connection down/up, T = 1, 4, 16
    python bench/tune_kernels.py --only moe_up --rows 1
    python bench/tune_kernels.py --only qsa --rows 1,4        # QSA decode selection at 262k and 4k, batch 1 and 4
    python bench/tune_kernels.py --only quant_gemv            # packed dense GEMVs (INT4/6/8) at the full shape
    python bench/tune_kernels.py --only hc_q8 --rows 1,4      # the mix with INT8 down / up (reports-mixed), HBM-cold
    python bench/tune_kernels.py --only route --rows 1,4      # the router kernel's warps a program, int64/int32 keys
    python bench/tune_kernels.py --only fused_router --rows 1,4 [--route-key32]  # router GEMV + top-k in one launch
    python bench/tune_kernels.py --only quant_dequant --reps 5  # prefill's dequantize of packed dense weights

Each configuration is timed inside a CUDA graph of `--reps` back-to-back calls (decode replays graphs, so launch
cost from Python is not what matters), median of 5 replays. It prints, per kernel and row count, every
configuration's microseconds (PDL on unless `--no-pdl`, as the model launches them on Hopper) and effective bandwidth (weight bytes the call must read / time), the best one, the
PyTorch path of the same computation, and a cuBLAS GEMV over the same number of bytes as a yardstick; JSON goes to
`--out`. The winners are copied by hand into the tunables at the top of `stage_worker/kernels/moe.py` and
`stage_worker/kernels/hyper_connection.py`, `stage_worker/kernels/qsa.py`, `stage_worker/kernels/quant_gemv.py`
(CFG, by token count) (docs/performance.md records the run).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_io import write_json, write_on_sigterm  # noqa: E402
from graph_timing import graph_us  # noqa: E402
from stage_worker.kernels import hyper_connection as HC  # noqa: E402
from stage_worker.kernels import hyper_connection_ref as HC_REF  # noqa: E402
from stage_worker.kernels import moe as MOE  # noqa: E402


def graph_time(fn, reps: int, runs: int = 5) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph of `reps` calls (median of `runs` replays)."""
    return graph_us(lambda i: fn(), reps, runs) / 1e6


def cublas_yardstick(nbytes: int, h: int, t: int, reps: int) -> float:
    """cuBLAS bf16 GEMV [t, h] x [n, h]^T reading `nbytes` of weights."""
    n = max(1, nbytes // (2 * h))
    w = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    return graph_time(lambda: F.linear(x, w), reps)


def sweep(name: str, configs, setter, run, nbytes: int, rows: int, reps: int, results: list, ref=None,
          ref_name: str = "PyTorch path") -> None:
    best = None
    for cfg in configs:
        setter(cfg)
        try:
            s = graph_time(run, reps)
        except Exception as exc:   # a configuration the compiler rejects (registers, shared memory): skip it
            print(f"  {name} T={rows} {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
            continue
        results.append({"kernel": name, "rows": rows, "config": list(cfg), "us": s * 1e6, "gbps": nbytes / s / 1e9})
        print(f"  {name:10s} T={rows:<3d} {str(cfg):24s} {s * 1e6:8.2f} us {nbytes / s / 1e9:8.0f} GB/s", flush=True)
        if best is None or s < best[1]:
            best = (cfg, s)
    line = f"BEST {name} T={rows}: {best[0]} {best[1] * 1e6:.2f} us {nbytes / best[1] / 1e9:.0f} GB/s"
    if ref is not None:
        r = graph_time(ref, reps)
        line += f"; {ref_name} {r * 1e6:.2f} us"
        results.append({"kernel": name + "_pytorch", "rows": rows, "us": r * 1e6})
    y = cublas_yardstick(nbytes, 2560, rows, reps)
    line += f"; cuBLAS GEMV of the same bytes {y * 1e6:.2f} us ({nbytes / y / 1e9:.0f} GB/s)"
    print(line, flush=True)
    results.append({"kernel": name, "rows": rows, "best": list(best[0]), "best_us": best[1] * 1e6,
                    "cublas_us": y * 1e6})


def moe_case(t: int, h: int = 2560, i: int = 640, e: int = 512, k: int = 10):
    g = torch.Generator(device="cuda").manual_seed(t)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g)
    shared = MOE.SharedExpert(torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g),
                              torch.randn(h, i, device="cuda", dtype=torch.bfloat16, generator=g))
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)]).int()
    ids = torch.cat([ids, torch.full((t, 1), -1, dtype=torch.int32, device="cuda")], dim=1)
    w = torch.rand(t, k + 1, device="cuda", generator=g).bfloat16()
    distinct = len(set(ids[:, :k].flatten().tolist())) + 1
    return x, ids, w, w13, w2, shared, distinct


def tune_qsa(batches: list[int], reps: int, results: list) -> None:
    """`qsa_select` at the full indexer shape (32 heads of 128, budget 2048, ratio 4) in a table padded to 262,144
    tokens: (SCORE_BLOCK, SCORE_PROGRAMS_PER_SM, SELECT_TILE, RADIX_BITS) at contexts 262,144 and
    4,096, in two groups (the score kernel's knobs at the default select, the select's at the default score: they
    act on different launches, and the whole product took minutes of compiles). Bytes: the pooled keys the scores
    read."""
    from stage_worker.kernels import qsa as QSA
    from stage_worker.kernels.qsa_ref import qsa_select_ref

    bs, width, budget = 16, 16384, 2048
    default = (QSA.SCORE_BLOCK, QSA.SCORE_PROGRAMS_PER_SM, QSA.SELECT_TILE, QSA.RADIX_BITS)
    score = itertools.product((64, 128), (2, 3, 4, 5), default[2:3], default[3:])
    select = itertools.product(default[0:1], default[1:2], (256, 512, 1024, 2048), (8, 11))
    cfgs = list(dict.fromkeys([*score, *select]))
    for b in batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        tables = torch.stack([torch.randperm(b * width, device="cuda", generator=g)[:width] for _ in range(b)])
        tables = tables.to(torch.int32)
        pooled = torch.randn(b * width * bs // 4, 128, device="cuda", generator=g).bfloat16()
        q_idx = torch.randn(b, 32, 128, device="cuda", generator=g).bfloat16()
        for ctx_len in (262144, 4096):
            ctx = torch.full((b,), ctx_len, dtype=torch.int32, device="cuda")
            want = qsa_select_ref(q_idx, pooled, tables, ctx, bs, 4, budget)

            def set_cfg(cfg):
                QSA.SCORE_BLOCK, QSA.SCORE_PROGRAMS_PER_SM, QSA.SELECT_TILE, QSA.RADIX_BITS = cfg
                try:
                    same = torch.equal(QSA.qsa_select(q_idx, pooled, tables, ctx, bs, 4, budget), want)
                except Exception:          # the sweep reports it when it times this configuration
                    return
                if not same:
                    print(f"  MISMATCH against qsa_select_ref: {cfg}", flush=True)

            sweep(f"qsa@{ctx_len // 1024}k", cfgs, set_cfg,
                  lambda: QSA.qsa_select(q_idx, pooled, tables, ctx, bs, 4, budget),
                  b * ctx_len // 4 * 128 * 2, b, reps, results,
                  ref=lambda: QSA.qsa_select(q_idx, pooled, tables, ctx, bs, 4, budget, one_program=True),
                  ref_name="first version (one select program)")
            QSA.SCORE_BLOCK, QSA.SCORE_PROGRAMS_PER_SM, QSA.SELECT_TILE, QSA.RADIX_BITS = default


def tune_quant_gemv(rows: list[int], reps: int, results: list, shapes_filter: list[str] | None = None) -> None:
    """`quant_gemv` (FMA path) over (BLOCK_N, BLOCK_K inputs, warps) at the full shape's kept-packed sizes: o_proj
    INT6 group 128, the shared expert's gate+up INT6, out_proj INT4 group 128, lm_head INT8 per channel. Each call
    cycles through copies of the weight that together exceed L2, so the bytes come from HBM; the winners go to
    `quant_gemv.CFG[T]`."""
    from stage_worker.kernels import quant_gemv as Q
    from stage_worker.kernels.quant_gemv_ref import PackedWeight, quantize_rtn

    shapes = [("o_proj int6", 2560, 6144, 6, 128), ("shared gate+up int6", 1280, 2560, 6, 128),
              ("out_proj int4", 2560, 4096, 4, 128), ("lm_head int8", 248320, 2560, 8, None),
              # the fused in-projections reports-mixed keeps packed: DeltaNet's q/k/v/z/b/a (the step's largest
              # GEMVs: 33 of 44 layers) and attention's q/k/v
              ("deltanet in_proj int6", 12352, 2560, 6, 128), ("out_proj int6", 2560, 4096, 6, 128),
              ("attention qkv int6", 13312, 2560, 6, 128)]
    for name, n, k, bits, group in shapes:
        if shapes_filter and not any(f in name for f in shapes_filter):
            continue
        pw = quantize_rtn(torch.randn(n, k, device="cuda") / k ** 0.5, bits, group, scale_dtype=torch.bfloat16)
        copies = [pw] + [PackedWeight(pw.words.clone(), pw.scales.clone(), bits, k, pw.group)
                         for _ in range(max(0, min(15, (256 << 20) // pw.nbytes() - 1)))]
        for t in rows:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            state = {}

            def run():
                for p in copies:
                    Q.quant_gemv(x, p, cfg=state["cfg"])

            cfgs = list(itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8)))
            sweep(f"qgemv {name}", cfgs, lambda c: state.__setitem__("cfg", c), run,
                  pw.nbytes() * len(copies), t, reps, results)
        del copies, pw
        torch.cuda.empty_cache()


def tune_quant_dequant(reps: int, results: list) -> None:
    """`quant_dequant.dequantize_into` (prefill's dequantize before cuBLAS, kernels item `quant_dequant`) over
    (BLOCK_N rows, BLOCK_K inputs, warps) at the full shape's kept-packed sizes: o_proj INT6 group 128, out_proj
    INT4 group 128, a GPU_CHUNK block of the INT8 lm_head. Each call dequantizes the next of several weight copies
    that together exceed L2; bytes are the packed words and scales read plus the bf16 written. Every config is
    checked bit for bit against the shipped one first. The winner goes to `quant_dequant.CFG` (h200-20: the
    shipped (32, 256, 4) ran at ~0.55 TB/s)."""
    from stage_worker.kernels import quant_dequant as D
    from stage_worker.kernels import quant_gemv as Q
    from stage_worker.kernels.quant_gemv_ref import PackedWeight, quantize_rtn

    shapes = [("o_proj int6", 2560, 6144, 6, 128), ("out_proj int4", 2560, 4096, 4, 128),
              ("lm_head block int8", Q.GPU_CHUNK // 2560, 2560, 8, None)]
    for name, n, k, bits, group in shapes:
        pw = quantize_rtn(torch.randn(n, k, device="cuda") / k ** 0.5, bits, group, scale_dtype=torch.bfloat16)
        copies = [pw] + [PackedWeight(pw.words.clone(), pw.scales.clone(), bits, k, pw.group)
                         for _ in range(max(0, min(7, (256 << 20) // (pw.nbytes() + n * k * 2) - 1)))]
        out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        want = D.dequantize_into(pw, torch.empty_like(out)).clone()
        state = {"cfg": None, "i": 0}

        def set_cfg(cfg, pw=pw, want=want, out=out):
            state["cfg"] = cfg
            try:
                same = torch.equal(D.dequantize_into(pw, out, cfg=cfg), want)
            except Exception:          # the sweep reports it when it times this configuration
                return
            if not same:
                print(f"  MISMATCH against the shipped config: {cfg}", flush=True)

        def run(copies=copies, out=out):
            D.dequantize_into(copies[state["i"] % len(copies)], out, cfg=state["cfg"])
            state["i"] += 1

        cfgs = list(itertools.product((16, 32, 64, 128), (128, 256, 512, 1024), (4, 8)))
        sweep(f"dequant {name}", cfgs, set_cfg, run, pw.nbytes() + n * k * 2, 1, reps, results)


def tune_route(rows: list[int], reps: int, results: list, copies: int = 48) -> None:
    """The router kernel (`moe.route`: softmax statistics and top-10 of 512 by ten block-wide max reductions, the
    shared expert's gate in slot 10) over its warps a program (`moe.NUM_WARPS`) and its keys (kernel flag
    `route_key32`: int32 instead of int64), as the INT4 decode runs it: each captured call on the next of `copies`
    logit rows (a layer each). Bytes: the logits read and the slots written. A reduction over fewer warps needs no
    shared-memory round trip (one warp: shuffles only). Every config is checked bit for bit against the shipped one
    (int64 keys) first."""
    from stage_worker.kernels import moe as M

    shipped, shipped_key32 = M.NUM_WARPS, M.route_key32_enabled()
    M.set_route_key32(False)
    for t in rows:
        g = torch.Generator(device="cuda").manual_seed(300 + t)
        logits = [torch.randn(t, 513, device="cuda", generator=g).bfloat16() for _ in range(copies)]
        want = [M.route(lg, 10, True, shared=True) for lg in logits[:2]]
        turn = {"i": 0, "bad": False}

        def set_cfg(cfg):
            M.NUM_WARPS = cfg[0]
            M.set_route_key32(bool(cfg[1]))
            turn["bad"] = False
            for lg, (w, i) in zip(logits, want):
                got = M.route(lg, 10, True, shared=True)
                if not (torch.equal(got[0], w) and torch.equal(got[1], i)):
                    turn["bad"] = True

        def run():
            if turn["bad"]:             # not timed, never BEST: `sweep` prints it as failed
                raise ValueError(f"MISMATCH against {shipped} warps")
            M.route(logits[turn["i"] % copies], 10, True, shared=True)
            turn["i"] += 1

        sweep("route (warps, key32)", [(w, k) for k in (0, 1) for w in (1, 2, 4, 8)], set_cfg, run,
              t * (513 * 2 + 11 * 8), t, reps, results)
        M.NUM_WARPS = shipped
    M.set_route_key32(shipped_key32)


def tune_fused_router(rows: list[int], reps: int, results: list, copies: int = 48) -> None:
    """The fused router launch (`moe.router_route(fused=True)`, kernel flag `fused_router`: the router GEMV of 512
    experts + the shared gate over 2560 columns and the top-10 in one launch) over FUSED_ROUTER_CFG (router rows a
    program, columns a load, warps), each captured call on the next of `copies` router weights (126 MB: from HBM as
    in the model); the two launches it replaces (cuBLAS GEMV + router kernel) as the yardstick. h100-29: the then
    shipped (4, 512, 4) was even with them at batch 1 and 0.27 ms a step slower at 4 (48 layers); h100-33's sweep (up
    to 1024 columns a load) put (1, 1024, 4) in: 7.36 against 8.08 us at one token, 17.12 against 14.42 at four."""
    from stage_worker.kernels import moe as M

    shipped = M.FUSED_ROUTER_CFG
    g = torch.Generator(device="cuda").manual_seed(400)
    routers = [torch.randn(513, 2560, device="cuda", generator=g).bfloat16() / 50 for _ in range(copies)]
    for t in rows:
        x = torch.randn(t, 2560, device="cuda", generator=g).bfloat16()
        turn = {"i": 0}

        def run(fused=True):
            M.router_route(x, routers[turn["i"] % copies], 10, True, shared=True, fused=fused)
            turn["i"] += 1

        cfgs = list(itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048, 4096), (1, 2, 4, 8)))
        sweep("fused_router", cfgs, lambda c: setattr(M, "FUSED_ROUTER_CFG", c), run, 513 * 2560 * 2, t, reps,
              results, ref=lambda: run(False), ref_name="cuBLAS GEMV + router kernel")
        M.FUSED_ROUTER_CFG = shipped


def tune_hc_q8(rows: list[int], reps: int, results: list, copies: int = 16) -> None:
    """The hyper-connection mix (`hc_mix`, three kernels) as a reports-mixed checkpoint runs it: down and up INT8 per
    channel (PackedWeight, read in place), PDL as `--no-pdl` says, and each captured call on the next of
    `copies` weight sets (16 x 6.6 MB > the 50 MB L2), so the bytes come from HBM as in the model, where 97 mixes'
    weights never fit the L2 (the hc_down / hc_up sweeps above reuse one bf16 weight: L2-hot). Sweeps DOWN_CFG_Q8 with
    UP_CFG_Q8 as it is, then UP_CFG_Q8 with the best DOWN_CFG_Q8; the winners go to hyper_connection.DOWN_CFG_Q8 / UP_CFG_Q8."""
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn

    hidden, hc, rank = 2560, 4, 320
    width = hc * hidden
    for t in rows:
        g = torch.Generator(device="cuda").manual_seed(200 + t)
        streams = torch.randn(t, width, device="cuda", dtype=torch.bfloat16, generator=g)
        norm_w = torch.randn(width, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        inj = torch.randn(hc, width, device="cuda", dtype=torch.bfloat16, generator=g) * 0.01
        sets = []
        for c in range(copies):
            down = quantize_rtn(torch.randn(rank, width, device="cuda", generator=g) * 0.01, 8, None,
                                scale_dtype=torch.bfloat16)
            up = quantize_rtn(torch.randn(width, rank, device="cuda", generator=g) * 0.05, 8, None,
                              scale_dtype=torch.bfloat16)
            sets.append((down, up))
        nbytes = sum(w.words.numel() * 4 + w.scales.numel() * 2 for w in sets[0]) + inj.numel() * 2
        turn = {"i": 0}

        def run():
            down, up = sets[turn["i"] % copies]
            turn["i"] += 1                      # each captured call reads the next weight set
            return HC.hc_mix(streams, norm_w, down, up, inj, hc, 1e-6)

        bucket = HC._bucket(t)
        # (rows a program, K chunk, warps, K slices): whole rows (1 slice) as shipped, or the inputs cut over 2-8
        # programs a tile (`_hc_down_kernel` SPLITS) so a token's 3.3 MB have more programs in flight
        cfgs = [(r, bk, w, sp) for sp in (1, 2, 4, 5, 8) for r in (1, 2, 4) for w in (4, 8)
                for bk in ((2048, 4096) if sp == 1 else (1024, 2048))]
        sweep("hc_q8(A)", cfgs, lambda c: HC.DOWN_CFG_Q8.__setitem__(bucket, c), run, nbytes, t, reps, results)
        HC.DOWN_CFG_Q8[bucket] = tuple(min((r for r in results if r.get("kernel") == "hc_q8(A)" and r["rows"] == t
                                         and "config" in r), key=lambda r: r["us"])["config"])
        cfgs = list(itertools.product((4, 8, 16, 32, 64), (128, 256, 512), (4, 8)))
        sweep("hc_q8(B)", cfgs, lambda c: HC.UP_CFG_Q8.__setitem__(bucket, c), run, nbytes, t, reps, results)
        print(f"hc_q8 T={t}: DOWN_CFG_Q8 {HC.DOWN_CFG_Q8[bucket]} (the sweep's best), UP_CFG_Q8 best above", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="moe_up,moe_down,hc_down,hc_up")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="quant_gemv: only the shapes whose names hold one of these "
                    "comma-separated words (e.g. 'in_proj,qkv')")
    ap.add_argument("--out", default="bench/results/tune_kernels.json")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the kernels without programmatic dependent launch (on by default, as the model "
                         "runs them on Hopper: kernels item `pdl`)")
    ap.add_argument("--route-key32", action="store_true",
                    help="the router's top-k with int32 keys (kernels item `route_key32`) in the sweeps other than "
                         "`route`, which times both")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/tune_kernels.py needs a CUDA device")
    from stage_worker.kernels import common
    from stage_worker.kernels.moe import set_route_key32

    common.set_pdl(not args.no_pdl)
    set_route_key32(args.route_key32)
    only = set(args.only.split(","))
    results: list[dict] = []
    t0 = time.time()

    def save() -> None:
        write_json(Path(args.out), {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
                                    "results": results})

    write_on_sigterm(save)
    if "qsa" in only:
        tune_qsa([int(r) for r in args.rows.split(",")], args.reps, results)
    if "quant_gemv" in only:
        tune_quant_gemv([int(r) for r in args.rows.split(",")], args.reps, results,
                        [f for f in args.shapes.split(",") if f] if args.shapes else None)
    if "hc_q8" in only:
        tune_hc_q8([int(r) for r in args.rows.split(",")], args.reps, results)
    if "route" in only:
        tune_route([int(r) for r in args.rows.split(",")], args.reps, results)
    if "fused_router" in only:
        tune_fused_router([int(r) for r in args.rows.split(",")], args.reps, results)
    if "quant_dequant" in only:
        tune_quant_dequant(args.reps, results)
    for t in (int(r) for r in args.rows.split(",")) if only - {"qsa", "quant_gemv", "hc_q8", "quant_dequant", "route", "fused_router"} else ():
        x, ids, w, w13, w2, shared, distinct = moe_case(t)
        i, h = w2.shape[2], w2.shape[1]
        if "moe_up" in only:
            act = torch.empty(t, ids.shape[1], i, dtype=torch.float32, device="cuda")
            state = {}

            def set_up(cfg):
                state["cfg"] = cfg

            def run_up():
                bi, bh, warps = state["cfg"]
                MOE._moe_up_kernel[(t * ids.shape[1], -(-i // bi))](
                    x, ids, w13, shared.w13, w13, act, x.stride(0), w13.stride(0), w13.stride(1), w13.shape[0],
                    H=h, I=i, TOP_K=ids.shape[1], BLOCK_I=bi, BLOCK_H=bh, num_warps=warps)

            cfgs = list(itertools.product((8, 16, 32), (128, 256, 512, 1024), (4, 8)))
            sweep("moe_up", cfgs, set_up, run_up, distinct * 2 * i * h * 2, t, args.reps, results)
        if "moe_down" in only:
            act = torch.randn(t, ids.shape[1], i, dtype=torch.float32, device="cuda")
            out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
            state = {}

            def set_down(cfg):
                state["cfg"] = cfg

            def run_down():
                bh, bi, warps = state["cfg"]
                MOE._moe_down_kernel[(t, -(-h // bh))](
                    act, ids, w, w2, shared.w2, w2, out, w2.stride(0), w2.stride(1), out.stride(0), w2.shape[0],
                    H=h, I=i, TOP_K=ids.shape[1], BLOCK_H=bh, BLOCK_I=bi, num_warps=warps)

            cfgs = list(itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8)))
            sweep("moe_down", cfgs, set_down, run_down, distinct * i * h * 2, t, args.reps, results)
        del w13, w2
        torch.cuda.empty_cache()
        hidden, hc, rank = 2560, 4, 320
        g = torch.Generator(device="cuda").manual_seed(100 + t)
        streams = torch.randn(t, hc * hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        norm_w = torch.randn(hc * hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        down = torch.randn(rank, hc * hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.01
        up = torch.randn(hc * hidden, rank, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        inj = torch.randn(hc, hc * hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.01
        bucket = HC._bucket(t)
        ref = (lambda: HC_REF.hc_mix(streams, norm_w, down, up, inj, hc, 1e-6))
        if "hc_down" in only:
            keep = HC.DOWN_CFG[bucket]
            cfgs = list(itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (4, 8)))
            sweep("hc_mix(A)", cfgs, lambda c: HC.DOWN_CFG.__setitem__(bucket, c),
                  lambda: HC.hc_mix(streams, norm_w, down, up, inj, hc, 1e-6),
                  (rank + hc) * hc * hidden * 2 + hc * hidden * rank * 2, t, args.reps, results, ref)
            HC.DOWN_CFG[bucket] = min((r for r in results if r.get("kernel") == "hc_mix(A)" and r["rows"] == t
                                       and "config" in r), key=lambda r: r["us"], default={"config": keep})["config"]
            HC.DOWN_CFG[bucket] = tuple(HC.DOWN_CFG[bucket])
        if "hc_up" in only:
            cfgs = list(itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8)))
            sweep("hc_mix(B)", cfgs, lambda c: HC.UP_CFG.__setitem__(bucket, c),
                  lambda: HC.hc_mix(streams, norm_w, down, up, inj, hc, 1e-6),
                  (rank + hc) * hc * hidden * 2 + hc * hidden * rank * 2, t, args.reps, results, ref)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
