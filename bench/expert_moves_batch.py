"""Moves on read at batch > 1, a CPU study (issue 16): host reads and moves a token when a step of B tokens may claim
C host experts a layer (today 1) with S spare device slots a layer (today 2), replayed by
`expert_cache_sim._replay_claims` on the routing `bench/expert_offload.py` drives the full shape with (the demo traces
mapped onto 512 experts x top-10, its docstring), its cold sets (the least used experts on other text) and its batch
(stream i: kind i mod 4 from row s + 997 * (i // 4): `expert_cache_sim.batch_steps`).

    python bench/expert_moves_batch.py                                  # the table: B 1,4,8 x C 1,2,4 x S 2,4,8
    python bench/expert_moves_batch.py --streams 4 --claims 2 --spares 4 --shares 0.1 --warmup 2048 --steps 4096

Host reads are counted as the server counts them (`host_reads`: once per selection, so a host expert that two tokens
of a step select is two reads, as the fused decode kernels read it: a program per (token, slot)); moves are claims
committed. PCIe a token: reads x the expert's bytes host -> device plus moves x the same device -> host (the victims'
write-backs, on a side stream). The estimate of back-to-back step time (B 1 and 4 only) is the H100's all-in-VRAM
step plus reads a step x the cost of a read at that batch and share measured there with moves off
(bench/results/h100-28/call9/shares.log), a move costing nothing on the forward's stream: rough (it puts the measured
moves-on rows within 3 points). Prints a table and writes JSON into --out-dir.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from expert_cache_sim import Policy, _replay_claims, batch_steps  # noqa: E402

EXPERT_MB = 2.53          # one INT4 expert of the full shape (packed words and scales)

# H100, bench/results/h100-28/call9 (INT4 experts, 16 layers, 1,024 + 256 steps, back to back): the all-in-VRAM step
# (ms) per batch, and (step, host reads a token) with moves off per (batch, share): a read's cost at that point
BASE_B2B_MS = {1: 2.825, 4: 4.061}
OFF_B2B = {(1, 0.1): (3.515, 5.9375), (4, 0.1): (5.978, 6.6953), (1, 0.25): (4.444, 18.0156),
           (4, 0.25): (10.707, 21.4258), (1, 0.5): (6.759, 48.1953), (4, 0.5): (21.054, 52.7031)}
# the same call's moves-on rows (1:128:0.5, C 1, S 2): b2b ms, reads and moves a token, to check the replay against
MEASURED = {(1, 0.1): (3.022, 1.6055, 1.4336), (4, 0.1): (5.443, 5.6396, 1.7676),
            (1, 0.25): (3.667, 8.3359, 5.0273), (4, 0.25): (9.314, 18.4658, 3.0654),
            (1, 0.5): (5.605, 31.7031, 9.75), (4, 0.5): (19.067, 47.6563, 3.6670)}


def read_ms(batch: int, share: float) -> float | None:
    """ms a host read adds to a back-to-back step at this batch and share (H100, moves off), None if unmeasured."""
    off = OFF_B2B.get((batch, share))
    if off is None:
        return None
    return (off[0] - BASE_B2B_MS[batch]) / (off[1] * batch)


def setup(layers: int, tokens: int):
    """(cfg, trace, fit): the full shape cut to `layers`, the mapped trace of `tokens` rows a kind, the cold sets'
    text, as `bench/expert_offload.py --simulate` builds them."""
    from decode import preset
    from expert_offload import full_shape_trace
    from shared.model_config import config_from_dict

    raw = preset("full-shape")
    raw.update(num_hidden_layers=layers, layer_types=raw["layer_types"][:layers])
    raw["ple_layer_ids"] = [i for i in raw.get("ple_layer_ids", []) if i <= layers]
    cfg = config_from_dict(raw)
    trace = full_shape_trace(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, tokens)
    fit = full_shape_trace(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, 20000, start=100000)
    return cfg, trace, fit


def resident_mask(cfg, share: float, fit) -> np.ndarray:
    from expert_offload import cold_sets

    resident = np.ones((cfg.num_hidden_layers, cfg.num_experts), dtype=bool)
    for layer, ids in cold_sets(cfg, share, fit).items():
        resident[layer, ids] = False
    return resident


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def oracle_reads(ids: np.ndarray, num_experts: int, capacity: np.ndarray) -> float:
    """Host reads a step of a clairvoyant placement (Belady with bypass): per layer, after each step VRAM holds the
    capacity[l] experts among those it held and those the step selected whose next selection comes soonest, starting
    from the best set; moves free and unlimited. Reads counted per selection, as `_replay_claims` counts them. A
    floor for any policy with that much VRAM (exactly so when no expert is selected twice in a step)."""
    T, L, _ = ids.shape
    reads = 0
    for layer in range(L):
        cap = int(capacity[layer])
        later = np.full(num_experts, T + 1)
        next_use = np.empty((T, num_experts), dtype=np.int64)
        for t in range(T - 1, -1, -1):
            next_use[t] = later                       # the next step after t that selects each expert
            later[ids[t, layer]] = t
        held = np.zeros(num_experts, dtype=bool)
        held[np.argsort(later, kind="stable")[:cap]] = True
        for t in range(T):
            sel = ids[t, layer]
            reads += int((~held[sel]).sum())
            held[sel] = True
            keep = np.argsort(np.where(held, next_use[t], T + 2), kind="stable")[:cap]
            held[:] = False
            held[keep] = True
    return reads / T


def fmt_row(row: dict) -> str:
    c = "off" if row["claims"] is None else row["claims"]
    s = "-" if row["spares"] is None else row["spares"]
    vs = f"{row['pcie_mb_vs_c1s2']:+.1f}" if row.get("pcie_mb_vs_c1s2") is not None else "-"
    est = f"{100 * row['est_b2b_vs_all_in_vram']:.1f}" if row["est_b2b_vs_all_in_vram"] else "-"
    meas = row.get("measured_h100_call9")
    extra = (f"   measured {meas['reads_per_token']:.2f} / {meas['moves_per_token']:.2f}, "
             f"{100 * meas['b2b_vs_all_in_vram']:.1f}%") if meas else ""
    return (f"{row['share']:>5g} {row['streams']:>2} {row['policy'] or '-':>10} {c:>3} {s:>2} "
            f"{row['reads_per_token']:>9.2f} {row['moves_per_token_all_layers']:>9.2f} "
            f"{row['distinct_reads_per_token']:>8.2f} {row['unclaimed_per_step']:>9.2f} "
            f"{row['pcie_mb_per_token']:>11.1f} {vs:>8} {est:>9}" + extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shares", default="0.1,0.25,0.5", help="share of each layer's experts in host RAM")
    ap.add_argument("--streams", default="1,4,8", help="B: tokens a step, each its own stream (comma list)")
    ap.add_argument("--claims", default="1,2,4", help="C: host experts a layer may claim a step (today 1)")
    ap.add_argument("--spares", default="2,4,8", help="S: spare device slots a layer (today 2)")
    ap.add_argument("--policies", default="1:128:0.5",
                    help="interval:half-life:margin, comma list (1:128:0.5 is the server's default)")
    ap.add_argument("--warmup", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--oracle", action="store_true",
                    help="also the clairvoyant placement's reads (`oracle_reads`, VRAM = the hot experts + "
                         "--oracle-spares), a floor for any policy with that much VRAM")
    ap.add_argument("--oracle-spares", type=int, default=2, help="--oracle: device slots beyond the hot experts")
    ap.add_argument("--out-dir", default=str(ROOT / "bench/results/expert-moves-batch-1"))
    ap.add_argument("--name", default="", help="JSON file name (default: w<warmup>_s<steps>.json)")
    args = ap.parse_args(argv)
    t0 = time.time()
    policies = [p for p in args.policies.split(",") if p]
    total = args.warmup + args.steps
    cfg, trace, fit = setup(args.layers, total + 1000)          # the benchmark's trace length (its `tokens`)
    rows, floors = [], []
    print(f"{args.layers} layers, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, {args.warmup} warm-up + "
          f"{args.steps} measured steps; reads and moves a token (all layers), PCIe MB a token both ways")
    print(f"{'host':>5} {'B':>2} {'policy':>10} {'C':>3} {'S':>2} {'reads/tok':>9} {'moves/tok':>9} "
          f"{'distinct':>8} {'unclaimed':>9} {'PCIe MB/tok':>11} {'vs C1S2':>8} {'est b2b %':>9}")
    for share in (float(s) for s in args.shares.split(",")):
        resident = resident_mask(cfg, share, fit)
        for B in ints(args.streams):
            ids = batch_steps(trace, B, total)
            if args.oracle:
                cap = resident.sum(1) + args.oracle_spares
                floor = oracle_reads(ids[args.warmup:], cfg.num_experts, cap) / B
                floors.append({"share": share, "streams": B, "vram_experts_per_layer": int(cap.max()),
                               "oracle_reads_per_token": floor})
                print(f"{share:>5g} {B:>2} {'oracle':>10}   -  - {floor:>9.2f}", flush=True)
            configs = [(None, None, None)] + [(p, c, s) for p in policies
                                              for c, s in itertools.product(ints(args.claims), ints(args.spares))]
            block = []
            for pol, C, S in configs:
                if pol is None:
                    every, half_life, margin = 1, 128.0, np.inf            # no claim ever passes: moves off
                else:
                    every, half_life, margin = (f(v) for f, v in zip((int, float, float), pol.split(":")))
                policy = Policy(pol or "off", "swap", half_life=half_life, every=every, margin=margin)
                r = _replay_claims(ids, cfg.num_experts, resident, policy, args.warmup, spares=S or 2,
                                   claims=C or 1, streams=B)
                cost = read_ms(B, share)
                row = {"share": share, "streams": B, "policy": pol, "claims": C, "spares": S,
                       **{k: v for k, v in r.items() if k != "moves_per_token"},
                       "moves_per_step_per_layer": r["moves_per_token"],
                       "pcie_mb_per_token": (r["reads_per_token"] + r["moves_per_token_all_layers"]) * EXPERT_MB,
                       "h2d_mb_per_token": r["reads_per_token"] * EXPERT_MB,
                       "d2h_mb_per_token": r["moves_per_token_all_layers"] * EXPERT_MB,
                       "est_b2b_vs_all_in_vram": (BASE_B2B_MS[B] / (BASE_B2B_MS[B] + r["reads_per_step"] * cost)
                                                  if cost is not None else None)}
                meas = MEASURED.get((B, share))
                if meas and (pol, C, S) == ("1:128:0.5", 1, 2) and (args.warmup, args.steps) == (1024, 256):
                    row["measured_h100_call9"] = {"b2b_vs_all_in_vram": BASE_B2B_MS[B] / meas[0],
                                                  "reads_per_token": meas[1], "moves_per_token": meas[2]}
                block.append(row)
            for row in block:        # PCIe against today's C 1, S 2 under the same policy (moves off: the first)
                ref = next((x for x in block if x["policy"] == (row["policy"] or policies[0])
                            and (x["claims"], x["spares"]) == (1, 2)), None)
                row["pcie_mb_vs_c1s2"] = row["pcie_mb_per_token"] - ref["pcie_mb_per_token"] if ref else None
                print(fmt_row(row), flush=True)
            rows += block
    out = Path(args.out_dir) / (args.name or f"w{args.warmup}_s{args.steps}.json")
    meta = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "machine": platform.node(), "seconds": round(time.time() - t0, 1), "expert_mb": EXPERT_MB,
            "trace": "bench/traces/demo-model (full-shape mapping, bench/expert_offload.py)",
            "layers": args.layers, "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "policies": policies, "warmup": args.warmup, "steps": args.steps,
            "est_basis": "H100 bench/results/h100-28/call9 back-to-back steps (BASE_B2B_MS, OFF_B2B)"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "oracle": floors, "results": rows}, indent=1) + "\n")
    print(f"wrote {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
