"""Replay routing traces against expert-residency policies: what share of expert selections a VRAM set of C
experts per layer would serve, and how many experts each policy moves per token. Groundwork for expert offload
(DESIGN §4, §7: cold experts in host RAM, rows moved at run time from decayed use counts), on the demo model's traces.

    python bench/expert_cache_sim.py                                  # bench/traces/demo-model, C = 8, 16, 24
    python bench/expert_cache_sim.py --trace DIR --capacity 4,8 --out bench/results/expert_cache_sim.json

Model. Per MoE layer a resident set S of C experts. A selection is a hit when its expert is in S before the token;
a miss is served from host memory (a GPU kernel can read pinned host memory directly), so policies differ only in
how S moves:
* `static-all`: the C most used experts of the fit half of every kind, never moved;
* `static-kind`: the same from the fit half of the workload's own kind (an oracle for a known workload);
* `lru`: S is the C most recently selected experts (moves on every miss);
* `decay-H/N`: use counts decayed with a half-life of H tokens; every N tokens S becomes the C highest counts;
* `swap-N/H`: what the server does (`StageExperts.move_round`, 000 §4.3): S starts as static-all's set; every N
  tokens the counts (decayed to a half-life of H tokens) pick, per layer, the most used expert outside S and the
  least used inside it, and they trade places when the outside one leads by more than 2 (one move per layer at
  most).
Each kind's trace is split in halves: statistics come from the first, replay runs on the second. Workloads: each
kind alone; `switch`, the kinds' second halves alternating every 512-token window (a server moving between
conversations of different kinds); `interleave4`, the four kinds token by token (four concurrent streams).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str                     # "static", "recency" or "decay"
    half_life: float = 0.0        # tokens (decay)
    every: int = 1                # re-placement interval in tokens (recency: 1)
    margin: float = 2.0           # swap: the lead a move needs
    per_round: int = 1            # swap: moves a layer at most, each round


def top_c(scores: np.ndarray, c: int) -> np.ndarray:
    """[L, E] scores -> [L, E] bool, the c best per row (ties: lower expert id, as a stable sort gives)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :c]
    out = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(out, order, True, axis=-1)
    return out


def usage(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] -> [L, E] selection counts."""
    T, L, k = ids.shape
    flat = ids.transpose(1, 0, 2).reshape(L, -1).astype(np.int64) + np.arange(L)[:, None] * num_experts
    return np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts).astype(np.float64)


def replay(ids: np.ndarray, num_experts: int, capacity: int, policy: Policy,
           static_counts: np.ndarray | None = None, skip: int = 0) -> dict:
    """Hit rate and expert moves per token of one policy over a [T, L, k] trace (swap: the first `skip` tokens
    only warm the counts up, as a benchmark's warm-up steps do)."""
    T, L, k = ids.shape
    rows = np.arange(L)[:, None]
    if policy.kind == "static":
        resident = top_c(static_counts, capacity)
        hits = resident[rows, ids].sum()                       # [T, L, k] gather, broadcast over tokens
        return {"hit_rate": float(hits / ids.size), "moves_per_token": 0.0}
    if policy.kind == "swap":
        return _replay_swap(ids, num_experts, top_c(static_counts, capacity), policy, skip)
    score = np.zeros((L, num_experts))
    resident = np.zeros((L, num_experts), dtype=bool)          # starts cold: the first tokens miss
    hits = moves = 0
    growth = 2.0 ** (1.0 / policy.half_life) if policy.kind == "decay" else 1.0
    weight = 1.0
    for t in range(T):
        sel = ids[t]
        hits += int(resident[rows, sel].sum())
        if policy.kind == "recency":
            score[rows, sel] = t + 1
        else:
            # decay all counts by 2^(-1/H) a token == grow the new increment instead; renormalise before overflow
            score[rows, sel] += weight
            weight *= growth
            if weight > 1e100:
                score /= weight
                weight = 1.0
        if (t + 1) % policy.every == 0:
            new = top_c(score, capacity) & (score > 0)         # never-selected experts are not loaded
            moves += int((new & ~resident).sum())
            resident = new
    return {"hit_rate": hits / ids.size, "moves_per_token": moves / T / L}


def _replay_swap(ids: np.ndarray, num_experts: int, resident: np.ndarray, policy: Policy, skip: int = 0) -> dict:
    T, L, k = ids.shape
    rows = np.arange(L)
    counts = np.zeros((L, num_experts))
    resident = resident.copy()
    hits = moves = 0
    decay = 0.5 ** (policy.every / policy.half_life)
    for t in range(T):
        sel = ids[t]
        if t >= skip:
            hits += int(resident[rows[:, None], sel].sum())
        np.add.at(counts, (np.repeat(rows, k), sel.ravel()), 1.0)
        if (t + 1) % policy.every == 0:
            counts *= decay
            for _ in range(policy.per_round):
                inside = np.where(resident, counts, np.inf).argmin(1)
                outside = np.where(resident, -np.inf, counts).argmax(1)
                go = counts[rows, outside] > counts[rows, inside] + policy.margin
                resident[rows[go], inside[go]] = False
                resident[rows[go], outside[go]] = True
                moves += int(go.sum()) if t >= skip else 0
    n = T - min(skip, T)
    return {"hit_rate": hits / max(1, n * L * k), "moves_per_token": moves / max(1, n) / L}


def _replay_claim(ids: np.ndarray, num_experts: int, resident: np.ndarray, policy: Policy, skip: int = 0,
                  spares: int = 2, predicted: np.ndarray | None = None, prefetch_slots: int | None = None) -> dict:
    """The server's moves on read (`expert_move_async`, `expert_moves.claim_round`, `spares` spare device slots a
    layer): a step claims, per layer with a free spare and a finite threshold, the first selected host expert whose
    count (after the step's adds) passes the threshold (it is read from host this step and stored as it is read);
    every `every` tokens the round makes last round's victim a host expert (its write-back done) and its slot a free
    spare, decays the counts, commits the claim (resident from then on), picks the least-used other resident expert
    as the next victim (ties: the lowest id), and sets the threshold (least resident count + margin while a spare
    is free, else none).
    `predicted` ([T, L, m] expert ids, -1: none): experts a prefetch would have copied from host RAM into VRAM before
    layer l of token t ran (a prediction made one layer ahead, `bench/expert_prefetch_sim.py`); a selected host
    expert that was predicted is then not read on the step's critical path. Adds `critical_reads_per_token` (host
    selections neither resident nor prefetched, all layers), `prefetches_per_token` (predicted experts that were not
    resident: PCIe copies beside the step) and `prefetches_used_per_token`; without it the first equals the misses.
    `prefetch_slots` P (with `predicted`; None: no cap): at most P prefetches a layer a step, the first P distinct
    predicted experts that are host-resident at the step, in `predicted`'s column order (steps of several tokens:
    give the columns rank-major, every token's best prediction first, as `bench/expert_offload.py` does). P 0 is no
    prefetch."""
    T, L, k = ids.shape
    rows = np.arange(L)
    counts = np.zeros((L, num_experts))
    critical = fetched = used = 0
    resident = resident.copy()
    free = np.full(L, spares)
    victim = np.full(L, -1)
    claim = np.full(L, -1)
    thr = np.full(L, np.inf)
    hits = moves = 0
    decay = 0.5 ** (policy.every / policy.half_life)
    for t in range(T):
        sel = ids[t]
        on = resident[rows[:, None], sel]
        covered = on
        if predicted is not None:
            ahead = np.zeros((L, num_experts + 1), dtype=bool)          # column num_experts catches the -1s
            if prefetch_slots is None:
                ahead[rows[:, None], predicted[t]] = True
            else:
                host = np.concatenate([~resident, np.zeros((L, 1), dtype=bool)], axis=1)   # -1: no prediction
                n = np.zeros(L, dtype=np.int64)
                for e in predicted[t].T:                              # column order: rank-major
                    ok = host[rows, e] & ~ahead[rows, e] & (n < prefetch_slots)
                    ahead[rows[ok], e[ok]] = True
                    n += ok
            ahead = ahead[:, :num_experts] & ~resident
            got_ahead = ahead[rows[:, None], sel]
            covered = on | got_ahead
            if t >= skip:
                fetched += int(ahead.sum())
                used += int(got_ahead.sum())
        if t >= skip:
            hits += int(on.sum())
            critical += int((~covered).sum())
        np.add.at(counts, (np.repeat(rows, sel.shape[1]), sel.ravel()), 1.0)
        over = ~on & (counts[rows[:, None], sel] > thr[:, None]) & (claim < 0)[:, None]
        first = over.argmax(1)
        got = over[rows, first]
        claim[got] = sel[rows[got], first[got]]
        if (t + 1) % policy.every == 0:
            fin = victim >= 0
            resident[rows[fin], victim[fin]] = False
            free += fin
            victim[:] = -1
            counts *= decay
            go = (claim >= 0) & (free > 0)
            resident[rows[go], claim[go]] = True
            moves += int(go.sum()) if t >= skip else 0
            others = np.where(resident, counts, np.inf)
            others[rows[go], claim[go]] = np.inf
            victim[go] = others[go].argmin(1)
            free -= go
            claim[:] = -1
            low = np.where(resident, counts, np.inf).min(1)
            thr = np.where((free > 0) & (resident.sum(1) > 0) & ~resident.all(1), low + policy.margin, np.inf)
    n = max(1, T - min(skip, T))
    return {"hit_rate": hits / (n * L * k), "moves_per_token": moves / n / L, "critical_reads_per_token": critical / n,
            "prefetches_per_token": fetched / n, "prefetches_used_per_token": used / n}


def batch_steps(trace: dict[str, np.ndarray], streams: int, steps: int) -> np.ndarray:
    """{kind: [N, L, k]} -> [steps, L, streams * k]: decode step s of `streams` concurrent sequences as
    `bench/expert_offload.py` builds its batch (`run`, `simulate`): stream i replays kind sorted(kinds)[i % kinds]
    from row s + 997 * (i // kinds) (mod the kind's length), and a step's selections are the streams' tokens one
    after the other, each token's best first (the router kernel's flat order, which the claim follows)."""
    kinds = sorted(trace)
    rows = np.arange(steps)
    return np.concatenate([trace[kinds[i % len(kinds)]][(rows + 997 * (i // len(kinds))) %
                                                        len(trace[kinds[i % len(kinds)]])]
                           for i in range(streams)], axis=2)


def _replay_claims(ids: np.ndarray, num_experts: int, resident: np.ndarray, policy: Policy, skip: int = 0,
                   spares: int = 2, claims: int = 1, streams: int = 1) -> dict:
    """`_replay_claim` (moves on read) generalised to `claims` claims a layer a step and `spares` spare device slots
    a layer, for steps of `streams` tokens (ids [T, L, streams * k], `batch_steps`); claims=1, spares=2, streams=1
    is `_replay_claim` exactly (tests/test_expert_cache_sim.py). What the server would do with C claims (not built;
    docs/performance.md, "Moves at batch 4, a CPU study"):
    * the router claims, per layer, up to min(C, free spares) - (claims already held) distinct selected host
      experts whose count after the step's adds passes the threshold, first come first (flat order);
    * every `every` steps the round frees every pending victim's slot (its write-back done), decays, commits every
      claim (one spare each: resident from then on, a move each), picks as many victims, the least-used other
      resident experts (ties: the lowest id; they stay resident until the next round, their rows going back to host
      RAM meanwhile), and sets the threshold (least resident count + margin while a spare is free).
    So C claims a step in steady state need S >= 2C spares (C being written back, C receiving).
    Host reads are counted as the router kernel's `host_reads` counts them (and the fused decode kernels read: a
    program per (token, slot)): once per selection, so a host expert that two tokens of a step select is two reads.
    Also returned: `distinct_reads_per_token` (distinct host experts a layer a step, summed; what a kernel that read
    each present expert once would move over PCIe), `unclaimed_per_step` (distinct host experts that passed the
    threshold but found no claim left, all layers: > 0 where C or the spares bind) and per-token / per-step reads
    and moves over all layers."""
    T, L, n = ids.shape
    if n % streams:
        raise ValueError(f"{n} selections a step is not a multiple of {streams} streams")
    if claims < 1 or spares < 1:
        raise ValueError("claims and spares must be >= 1")
    rows = np.arange(L)
    counts = np.zeros((L, num_experts))
    resident = resident.copy()
    free = np.full(L, spares)
    victims = np.full((L, max(spares, claims)), -1)
    held = np.full((L, claims), -1)                    # claimed experts, -1: none
    claimed = np.zeros((L, num_experts), dtype=bool)   # the same as a mask
    thr = np.full(L, np.inf)
    hits = moves = distinct = unclaimed = 0
    decay = 0.5 ** (policy.every / policy.half_life)
    for t in range(T):
        sel = ids[t]
        on = resident[rows[:, None], sel]
        if t >= skip:
            hits += int(on.sum())
            host = np.sort(np.where(on, -1, sel), axis=1)
            distinct += int(((host[:, 1:] != host[:, :-1]) & (host[:, 1:] >= 0)).sum() + (host[:, 0] >= 0).sum())
        np.add.at(counts, (np.repeat(rows, n), sel.ravel()), 1.0)
        over = ~on & (counts[rows[:, None], sel] > thr[:, None])
        cap = np.minimum(claims, free) - (held >= 0).sum(1)        # claims this layer may still make
        for _ in range(claims):
            over &= ~claimed[rows[:, None], sel]
            first = over.argmax(1)
            got = over[rows, first] & (cap > 0)
            if not got.any():
                break
            e = sel[rows[got], first[got]]
            held[rows[got], (held[got] >= 0).sum(1)] = e
            claimed[rows[got], e] = True
            cap -= got
        if t >= skip:
            left = np.sort(np.where(over & ~claimed[rows[:, None], sel], sel, -1), axis=1)
            unclaimed += int(((left[:, 1:] != left[:, :-1]) & (left[:, 1:] >= 0)).sum() + (left[:, 0] >= 0).sum())
        if (t + 1) % policy.every == 0:
            fin = victims >= 0
            r, c = np.nonzero(fin)
            resident[r, victims[r, c]] = False
            free += fin.sum(1)
            victims[:] = -1
            counts *= decay
            n_go = np.minimum((held >= 0).sum(1), free)             # held claims fit the free spares (cap above)
            go = (held >= 0) & (np.arange(claims)[None, :] < n_go[:, None])
            r, c = np.nonzero(go)
            resident[r, held[r, c]] = True
            moves += int(go.sum()) if t >= skip else 0
            if go.any():
                others = np.where(resident & ~claimed, counts, np.inf)
                order = np.argsort(others, axis=1, kind="stable")[:, :claims]    # ties: the lowest id
                pick = np.arange(claims)[None, :] < n_go[:, None]
                victims[:, :claims] = np.where(pick, order, -1)
            free -= n_go
            held[:] = -1
            claimed[:] = False
            low = np.where(resident, counts, np.inf).min(1)
            thr = np.where((free > 0) & (resident.sum(1) > 0) & ~resident.all(1), low + policy.margin, np.inf)
    m = max(1, T - min(skip, T))
    reads = m * L * n - hits
    return {"hit_rate": hits / (m * L * n), "moves_per_token": moves / m / L,
            "reads_per_token": reads / (m * streams), "moves_per_token_all_layers": moves / (m * streams),
            "reads_per_step": reads / m, "moves_per_step": moves / m,
            "distinct_reads_per_token": distinct / (m * streams), "unclaimed_per_step": unclaimed / m}


def workloads(ids: dict[str, np.ndarray], chunk: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(fit halves per kind, replay workloads)."""
    fit, test = {}, {}
    for kind, a in ids.items():
        half = (len(a) // 2 // chunk) * chunk
        fit[kind], test[kind] = a[:half], a[half:]
    loads = dict(test)
    kinds = sorted(test)
    n_win = min(len(test[k]) for k in kinds) // chunk
    loads["switch"] = np.concatenate([test[k][w * chunk:(w + 1) * chunk] for w in range(n_win) for k in kinds])
    n = min(len(test[k]) for k in kinds)
    interleaved = np.stack([test[k][:n] for k in kinds], axis=1)            # [n, kinds, L, k]
    loads["interleave4"] = interleaved.reshape(n * len(kinds), *interleaved.shape[2:])
    return fit, loads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "bench/traces/demo-model"), help="route_trace.npz or its directory")
    ap.add_argument("--capacity", default="8,16,24", help="resident experts per layer (comma list)")
    ap.add_argument("--tokens", type=int, default=50_000, help="replay at most this many tokens per workload")
    ap.add_argument("--out", default=str(ROOT / "bench/results/expert_cache_sim.json"))
    args = ap.parse_args(argv)
    import route_trace as rt

    meta, ids, _ = rt.load_trace(args.trace)
    E, chunk = meta["config"]["num_experts"], meta["chunk"]
    caps = [int(c) for c in args.capacity.split(",")]
    if not all(0 < c <= E for c in caps):
        ap.error(f"--capacity: each value must be in 1..{E} (the trace's experts per layer)")
    fit, loads = workloads(ids, chunk)
    fit_all = sum(usage(a, E) for a in fit.values())
    policies = [Policy("static-all", "static"), Policy("static-kind", "static"), Policy("lru", "recency"),
                Policy("decay-64/1", "decay", 64, 1), Policy("decay-512/16", "decay", 512, 16),
                Policy("decay-4096/128", "decay", 4096, 128), Policy("swap-8/512", "swap", 512, 8),
                Policy("swap-32/256", "swap", 256, 32)]
    rows = []
    t0 = time.time()
    for name, trace in loads.items():
        trace = trace[: args.tokens]
        for c in caps:
            for p in policies:
                if p.name == "static-kind" and name not in fit:
                    continue
                counts = fit_all if p.name == "static-all" or p.kind == "swap" else \
                    usage(fit[name], E) if p.kind == "static" else None
                r = replay(trace, E, c, p, counts)
                rows.append({"workload": name, "capacity": c, "policy": p.name, "tokens": len(trace), **r})
    header = " ".join(f"{p.name:>15}" for p in policies)
    print(f"{'workload':>12} {'C':>3} {header}   (hit rate; moves/token/layer)")
    for name in loads:
        for c in caps:
            cells = []
            for p in policies:
                r = next((x for x in rows if x["workload"] == name and x["capacity"] == c and x["policy"] == p.name),
                         None)
                cells.append("-" if r is None else f"{r['hit_rate']:.3f};{r['moves_per_token']:.2f}")
            print(f"{name:>12} {c:>3} " + " ".join(f"{x:>15}" for x in cells))
    out = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                    "trace": meta.get("model"), "num_experts": E, "top_k": meta["config"]["top_k"],
                    "moe_layers": len(meta["config"]["moe_layers"]), "machine": platform.node(),
                    "seconds": round(time.time() - t0, 1)}, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
