"""Decode with routed experts in host RAM (issue 16): the cost of one host read, and tok/s with 0/10/25/50% of the
expert bytes in pinned host memory, run-time moves on and off, at the full shape on one GPU.

    python bench/expert_offload.py --layers 16 --shares 0,0.1,0.25,0.5 --batch 1,4 --out bench/results/x.json
    python bench/expert_offload.py --quant int4-experts --shares 0,0.1,0.25 --policies 1:128:0.5 --out ...
    python bench/expert_offload.py --simulate --shares 0,0.1 --policies 1:128:0.5,16:1024:2 --warmup 2048   # no GPU
    python bench/expert_offload.py ... --freeze-moves     # moves in the warm-up only: the reads' cost alone
    python bench/expert_offload.py --quant int4-experts --shares 0,0.1 --move-modes onread --prefetch 4,0 \
        --pred-mapping member            # the layer-ahead prefetch (expert_prefetch) against none, one process

`--prefetch P[:R],...`: each moving row also with `expert_prefetch` P slots a table (R: `expert_prefetch_top`); the
prediction's GEMV runs as served, then the replay ranks the trace's layer-ahead predictions (`pred:` keys, mapped
by `--pred-mapping`) instead of its logits (`Replay.predict`).

`--quant int4-experts`: the routed experts as an INT4 checkpoint's are kept (issue 17: words and group-128 scales,
dummy values as the loader's dummy format makes them), the tables hold them at their packed size (2.53 MB an
expert at the full shape against 9.83 in bf16), decode runs `moe_int4.fused_moe_int4` reading host slots, and a
host read moves the packed bytes; shares are of the packed expert bytes.

Routing. Random weights route near-uniformly with no memory from token to token, which is not what a trained
model does, so the router's choice is replaced by a replay of `bench/traces/demo-model` (the trained demo model's
top-4 of 32 experts over code, prose, docs and German). It maps onto 512 experts and top-10 as follows: full-shape
layer L reads demo layers a = L mod 8 and b = (L + 1) mod 8; slot j of token t takes demo token t + j // 4 and its
selection s = j mod 4; expert = 16 * ids[t + j // 4, a, s] + ids[t + j // 4, b, s] mod 16 (a collision within a
token's ten moves to the next free id). So the skew and the temporal locality are the demo model's (least-used
10% of its experts take 6.8% of selections, 000's trained model ~1.7%): a hard case for a cold set. The router's
GEMV still runs (its cost is paid); the replay rewrites its logits so that the real route kernel picks the trace's
experts and maps, counts and claims them as served (`Replay`); the all-in-VRAM baseline runs the same.

Moves run as the server runs them (`StageExperts.move_round`, one policy per `--policies` entry; `expert_move_fused`
and `expert_move_graph` from the environment), and a step's time includes the round before it. Two times a row:
the median synced step (the host's launches, the round's too, on the GPU's critical path) and the same number of
steps back to back with one sync at the end ("b2b"), as a server that launches ahead runs them. Each configuration
is a fresh model (dummy weights generated on the GPU; the cold rows copied to pinned host memory once). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import preset  # noqa: E402
from shared.cold_set import expert_bytes, packed_expert_bytes  # noqa: E402
from shared.model_config import config_from_dict  # noqa: E402
from shared.cluster_config import ClusterConfig, env_overrides  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.checkpoint.packed_experts import dummy_groups  # noqa: E402
from stage_worker.expert_offload import gates, round_decay  # noqa: E402
from stage_worker.kernels import expert_prefetch as PF  # noqa: E402
from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels.flags import KernelFlags  # noqa: E402
from stage_worker.kernels.moe_ref import HostRows  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402

TRACE = ROOT / "bench" / "traces" / "demo-model" / "route_trace.npz"


def full_shape_map(demo: np.ndarray, layers: int, num_experts: int, top_k: int, tokens: int) -> np.ndarray:
    """Demo-model expert ids [>= tokens + 3, demo layers, demo k] (selections or predictions) -> full-shape ids
    [tokens, layers, top_k] int64, by the mapping in the module docstring (collisions too)."""
    demo = demo.astype(np.int64)
    n_demo, k_demo = demo.shape[1], demo.shape[2]
    sub = num_experts // 32
    ids = np.empty((tokens, layers, top_k), dtype=np.int64)
    for L in range(layers):
        a, b = L % n_demo, (L + 1) % n_demo
        for j in range(top_k):
            src = np.arange(tokens) + j // k_demo
            s = j % k_demo
            ids[:, L, j] = sub * demo[src, a, s] + demo[src, b, s] % sub
        srt = np.sort(ids[:, L], axis=-1)
        for t in np.nonzero((srt[:, 1:] == srt[:, :-1]).any(-1))[0]:   # a collision moves to the next free id
            row = ids[t, L]
            seen = set()
            for j in range(top_k):
                while row[j] in seen:
                    row[j] = (row[j] + 1) % num_experts
                seen.add(int(row[j]))
    return ids


def member_predictions(demo_ids: np.ndarray, demo_pred: np.ndarray, ids: np.ndarray, pred: np.ndarray,
                       num_experts: int) -> np.ndarray:
    """`--pred-mapping member`: full-shape slot j names its selected expert (ids) when each of the two demo
    selections it is built from is among its demo layer's predicted experts at that token (any rank), else the
    rank mapping's guess (pred). Why: the rank mapping counts a prediction only when both demo layers name the
    same experts at the same rank (recall 0.27 a slot against the demo layers' 0.71 each, 2026-12-07), far below
    what a layer-ahead router recalls on a trained model (0.49-0.80 on the demo model, docs/performance.md); with
    membership a slot's recall is the product of its two layers' (~0.5)."""
    tokens, layers, top_k = ids.shape
    n_demo, k_demo = demo_ids.shape[1], demo_ids.shape[2]
    out = pred.copy()
    for L in range(layers):
        a, b = L % n_demo, (L + 1) % n_demo
        for j in range(top_k):
            src = np.arange(tokens) + j // k_demo
            s = j % k_demo
            hit = ((demo_pred[src, a] == demo_ids[src, a, s][:, None]).any(-1) &
                   (demo_pred[src, b] == demo_ids[src, b, s][:, None]).any(-1))
            out[:, L, j] = np.where(hit, ids[:, L, j], pred[:, L, j])
    return out


def full_shape_trace(layers: int, num_experts: int, top_k: int, tokens: int, start: int = 0,
                     predictions: bool = False, path: Path = TRACE, mapping: str = "rank"):
    """{kind: [tokens, layers, top_k] int64 expert ids} by the mapping in the module docstring, from demo token
    `start` on. `predictions`: ({kind: ids}, {kind: predictions}), the trace's `pred:` keys (what a prediction one
    layer ahead names, `tools/route_trace.py`) through the same mapping: full-shape slot j's prediction is built
    from the two demo layers' rank-(j mod 4) predictions as its selection is from their selections (`mapping`
    "rank"; "member": `member_predictions`)."""
    z = np.load(path)
    ids, pred = {}, {}
    for key in z.files:
        if not key.startswith("ids:"):
            continue
        kind = key[4:]
        ids[kind] = full_shape_map(z[key][start: start + tokens + 3], layers, num_experts, top_k, tokens)
        if predictions:
            if f"pred:{kind}" not in z.files:
                raise SystemExit(f"{path}: no pred:{kind} (add them: tools/route_trace.py --add-predictions)")
            demo_pred = z[f"pred:{kind}"][start: start + tokens + 3].astype(np.int64)
            if len(demo_pred) < tokens + 3:
                raise SystemExit(f"{path}: pred:{kind} holds {len(z[f'pred:{kind}'])} tokens, {start + tokens + 3} "
                                 "wanted (fewer steps, or tools/route_trace.py --add-predictions for every token)")
            pred[kind] = full_shape_map(demo_pred, layers, num_experts, top_k, tokens)
            if mapping == "member":
                pred[kind] = member_predictions(z[key][start: start + tokens + 3].astype(np.int64), demo_pred,
                                                ids[kind], pred[kind], num_experts)
            elif mapping != "rank":
                raise SystemExit(f"prediction mapping {mapping!r}: rank or member")
    return (ids, pred) if predictions else ids


class Replay:
    """Makes the router choose the trace's experts inside `moe.route`; installed by monkeypatching. The real route
    kernel then maps, counts and claims exactly as served: the replay only writes the router's logits (the trace's
    k experts at k, k-1, ..., 1, every other column far below; the shared expert's logit kept). Until 2026-12-05
    the replay overwrote the kernel's ids and counted (and claimed, moves on read) with ~20 PyTorch ops a layer
    inside the graph, which the served path does not run: h200-24's on-read row paid ~0.5 ms a step for them."""

    def __init__(self, model, batch: int, top_k: int) -> None:
        self.moes = list(model.moe_layers().values())
        self.layer = 0
        self.batch = batch
        self.decode_calls = 0                     # calls with at most `batch` rows: decode (eager or captured)
        dev = next(model.parameters()).device
        self.buf = torch.zeros(len(self.moes), 16, top_k, dtype=torch.int64, device=dev)   # expert ids
        self.pred = torch.zeros_like(self.buf)   # the layer-ahead prediction of each layer's ids (`predict`)
        # ... as forced logits, made by `stage_pred` before each step (not inside the graph: the served prediction
        # is one launch, the replay's is the GEMV it pays for and the ranking)
        self.pred_logits = torch.full((len(self.moes), 16, model.cfg.num_experts), -1e4, dtype=torch.bfloat16,
                                      device=dev)
        self.rank = torch.arange(top_k, 0, -1, dtype=torch.float32, device=dev).expand(16, top_k).contiguous()
        self.real_route = K.route
        self.real_predict = PF.predict
        self.predict_calls = 0

    def route(self, logits, top_k, renormalise, shared=False, counts=None, valid=None, slot_map=None):
        T = logits.shape[0]
        if T > self.buf.shape[1]:                 # prefill: the router's own choice, not counted
            return self.real_route(logits, top_k, renormalise, shared=shared, valid=valid, slot_map=slot_map)
        index = self.layer % len(self.moes)     # layers call the router in order, once a forward
        self.layer += 1
        self.decode_calls += T <= self.batch
        t = self.moes[index].table
        experts = self.buf[index, :T]
        if t is not None and slot_map is None:    # moves in place: router row == slot, and experts move
            E = logits.shape[1] - int(shared)
            held = t.expert_of_slot.long()        # slot -> expert (-1: a spare) => expert -> its slot now
            slot_of = torch.zeros(E + 1, dtype=torch.int64, device=held.device).scatter_(
                0, torch.where(held >= 0, held, E), torch.arange(held.numel(), device=held.device))[:E]
            experts = slot_of[experts]
        # (with a slot map the router rows stay in expert order: the column is the expert)
        forced = torch.full_like(logits, -1e4)
        if shared:
            forced[:, -1] = logits[:, -1]
        forced.scatter_(1, experts, self.rank[:T].to(logits.dtype))
        return self.real_route(forced, top_k, renormalise, shared=shared, counts=counts, valid=valid,
                               slot_map=slot_map)

    def stage_pred(self) -> None:
        """`pred` (just written) as the forced logits `predict` ranks: the trace's experts at k, k-1, ..., 1."""
        self.pred_logits.fill_(-1e4)
        self.pred_logits.scatter_(2, self.pred, self.rank.to(self.pred_logits.dtype).expand(
            self.pred.shape[0], -1, -1))

    def predict(self, x, gate, top_k, pf, first_host, slot_map=None, valid=None, logits=None):
        """`expert_prefetch`'s prediction (called by layer L for layer L + 1, before L routes): the GEMV still runs
        (its bytes are paid, as the router's are), then the trace's prediction for the next layer (its router on
        this layer's input, mapped as the ids are: `full_shape_trace`) is ranked from forced logits (router column
        = expert: prefetch runs with a slot map)."""
        T = x.shape[0]
        nxt = (self.layer + 1) % len(self.moes)
        self.predict_calls += 1
        F.linear(x, gate)
        return self.real_predict(x, gate, top_k, pf, first_host, slot_map=slot_map, valid=valid,
                                 logits=self.pred_logits[nxt, :T])


def _read_setup(cfg, quant: str, hot: int):
    """(call(ids), bytes of one expert): the fused MoE at T=1 over a table whose slots from `hot` on are pinned
    host rows (bf16 or INT4); everything it holds goes when `call` does."""
    E, H, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w = torch.full((1, k), 1.0 / k, device="cuda", dtype=torch.bfloat16)
    if quant:
        from stage_worker.kernels.moe_int4 import fused_moe_int4
        from stage_worker.kernels.moe_int4_ref import PackedExperts

        g13, g2 = dummy_groups(cfg)

        def words(*shape):
            return torch.randint(-(1 << 31), (1 << 31) - 1, shape, device="cuda", dtype=torch.int64).to(torch.int32)

        def scales(*shape):
            return torch.full(shape, 0.005, device="cuda", dtype=torch.bfloat16)

        parts = [words(E, 2 * I, H // 8), scales(E, 2 * I, -(-H // g13)), words(E, H, I // 8),
                 scales(E, H, -(-I // g2))]
        dev = PackedExperts(*(p[:hot] for p in parts), g13, g2)
        host = PackedExperts(*(p[hot:].cpu().pin_memory() for p in parts), g13, g2)
        return (lambda ids: fused_moe_int4(x, ids, w, dev, host=host, first_host=hot)), \
            packed_expert_bytes(cfg, g13, g2, dtype="bfloat16")
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    rows = HostRows(w13[hot:].cpu().pin_memory(), w2[hot:].cpu().pin_memory(), hot)
    return (lambda ids: K.fused_moe(x, ids, w, w13[:hot], w2[:hot], host=rows)), expert_bytes(cfg, "bfloat16")


def host_read_cost(cfg, quant: str = "", reps: int = 50) -> dict:
    """Fused MoE at T=1, top-k: all selected rows in VRAM vs n of them in pinned host memory; the slope is the
    cost of one host read (one expert's w13 + w2 over PCIe, inside the kernel; INT4: its words and scales)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    hot = E // 2
    call, expert = _read_setup(cfg, quant, hot)
    rows = []
    for n in range(0, k + 1):
        # distinct experts each rep, so no read is served from L2: rotate through the table
        times = []
        for r in range(reps + 5):
            base_dev = (r * k) % (hot - k)
            base_host = hot + (r * k) % (E - hot - k)
            ids = torch.tensor([[base_host + j if j < n else base_dev + j for j in range(k)]], dtype=torch.int32,
                               device="cuda")
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            call(ids)
            e.record()
            torch.cuda.synchronize()
            if r >= 5:
                times.append(s.elapsed_time(e) * 1e3)
        rows.append({"host_rows": n, "median_us": statistics.median(times)})
    slope = np.polyfit([r["host_rows"] for r in rows], [r["median_us"] for r in rows], 1)[0]
    del call
    torch.cuda.empty_cache()
    return {"per_read_us": float(slope), "expert_bytes": expert, "gb_per_s": expert / (slope * 1e-6) / 1e9,
            "rows": rows}


def cold_sets(cfg, share: float, trace: dict[str, np.ndarray]) -> dict[int, list[int]]:
    """The least-used experts of each layer (kind-normalised counts, as `moepipe cold-set` chooses), `share` of
    each layer's experts."""
    E = cfg.num_experts
    n = int(round(E * share))
    if n == 0:
        return {}
    score = np.zeros((cfg.num_hidden_layers, E))
    for ids in trace.values():
        for L in range(cfg.num_hidden_layers):
            c = np.bincount(ids[:, L].ravel(), minlength=E)
            score[L] += c / c.sum()
    return {L: sorted(np.argsort(score[L], kind="stable")[:n].tolist()) for L in range(cfg.num_hidden_layers)
            if cfg.is_sparse_moe(L)}


def greedy_check(model, moves: bool, steps: int = 24) -> dict:
    """Greedy tokens from the real router (no replay) and their logprobs; with moves, a round after every token
    with no margin, so rows move while the check runs."""
    engine = LocalEngine([model], max_seqs=1, max_tokens=128, cuda_graphs=True)
    engine.add(0)
    logits = engine.step([(0, [11, 220, 4021, 318, 257, 1332])])[-1]
    tokens, logprobs = [], []
    for _ in range(steps):
        lp = torch.log_softmax(logits.float(), -1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(float(lp[t]))
        if moves and model.experts is not None:
            model.experts.move_round(gates(model), 0.5, 0.0, fused=_switch("expert_move_fused"),
                                     graph=_switch("expert_move_graph"))
        logits = engine.step([(0, [t])])[-1]
    out = {"tokens": tokens, "logprobs": logprobs}
    if model.experts is not None:
        out["moves"] = int(model.experts.moves.sum())
    del engine
    return out


def _switch(key: str) -> bool:
    """A server switch as the environment sets it for this run (MOEPIPE_...; else the config's default), so the
    benchmark's rounds are the server's: `expert_move_fused` (0: the eager round of ~32 launches),
    `expert_move_graph` (0: the fused round's launches one by one), `expert_move_async` (1: moves on read, unless
    --move-modes says; a round's columns then time only its forward-stream part, the one-launch round),
    `expert_vmm_table` (1: each table part one VRAM + host range)."""
    return bool(env_overrides().get(key, getattr(ClusterConfig, key)))


def _round_cols(r: dict) -> str:
    """A move round's median host launch time and GPU span (both inside the timed step), or '-' without moves."""
    if r["round_host_ms"] is None:
        return "-"
    return f"{r['round_host_ms']:.3f}/{r['round_gpu_ms']:.3f}"


def run(cfg, cold, trace, batches: list[int], steps: int, warmup: int,
        policy: tuple[int, float, float] | None, quant: str = "", profile: Path | None = None,
        freeze: bool = False, on_read: bool = False, half_life_unit: str = "steps", claims: int = 1,
        pred: dict[str, np.ndarray] | None = None, prefetch: int = 0, prefetch_top: int = 0,
        prefetch_min_batch: int = 1) -> list[dict]:
    """One model (fresh weights, this cold set), decode at each batch size in turn. `profile` (a path prefix): 16
    more steps a batch size under torch.profiler, their kernels by GPU time to `<prefix>_b<batch>.txt` (two runs of
    one configuration that differ in speed then show whether the MoE kernels, the host reads inside them, or the
    moves' launches took the difference). `on_read`: moves on read (`expert_move_async`) instead of in place.
    `half_life_unit` (`expert_move_half_life_unit`): the policy's half-life in steps or in tokens (a round's decay
    then 0.5 ** (interval * batch / half-life), `expert_offload.round_decay`). `claims` (`expert_move_claims`, with
    `on_read`): C claims a layer a step, 2C spares a table (`LoadOptions.expert_move_claims`). `prefetch` (P,
    `expert_prefetch`): P prefetch slots a table, each layer predicting the next one's host experts from `pred`
    (the trace's layer-ahead predictions, keyed and indexed as `trace`; `Replay.predict`) at batches of at least
    `prefetch_min_batch` (`expert_prefetch_min_batch`)."""
    t0 = time.time()
    # MOEPIPE_EXPERT_VMM_TABLE=1: each table part one VRAM + host range, as the server builds it with the switch on
    vmm = _switch("expert_vmm_table")
    fused, graphed = _switch("expert_move_fused"), _switch("expert_move_graph")
    spares = policy is not None and on_read
    model = load_model("", LoadOptions(device="cuda", dtype=torch.bfloat16, load_format="dummy",
                                       cold_experts=cold or None, dummy_int4=dummy_groups(cfg) if quant else None,
                                       expert_vmm_table=vmm, expert_move_async=spares,
                                       expert_move_claims=claims if spares else 1,
                                       expert_prefetch=prefetch, expert_prefetch_top=prefetch_top,
                                       expert_prefetch_min_batch=prefetch_min_batch), cfg)
    if quant:
        assert all(m.packed_group for m in model.moe_layers().values())
    # fused_router off: the replay forces the trace's experts through the router's logits (`Replay.route`), which the
    # fused router (GEMV and top-k in one launch, in `all` since h200-35) never materialises; h100-31 timed the two
    # routers even at one token, so the offload's cost is measured on the same step
    model.set_kernels(KernelFlags.parse("all,-fused_router"))
    load_s = time.time() - t0
    x = model.experts
    if prefetch and x is not None and x.prefetch_hits is None:
        raise SystemExit("expert_offload: --prefetch needs --quant int4-experts (the packed decode path predicts)")
    moves = policy is not None
    interval, half_life, margin = policy or (0, 0.0, 0.0)
    check = greedy_check(model, moves)
    per_expert = packed_expert_bytes(cfg, *dummy_groups(cfg), dtype="bfloat16") if quant else \
        expert_bytes(cfg, "bfloat16")
    total_experts = sum(m.num_experts for m in model.moe_layers().values()) * per_expert
    if x is not None:
        assert x.host_bytes() + x.device_bytes() >= len(x.tables) * cfg.num_experts * per_expert   # VMM: granules
    out = []
    kinds = sorted(trace)

    def row_of(src: dict[str, np.ndarray], s: int, i: int) -> np.ndarray:
        """Stream i's trace row at step s (streams of one kind 997 tokens apart)."""
        ids = src[kinds[i % len(kinds)]]
        return ids[(s + 997 * (i // len(kinds))) % len(ids)]

    def stage_rows(replay: Replay, s: int, batch: int) -> None:
        for i in range(batch):
            replay.buf[:, i].copy_(torch.from_numpy(row_of(trace, s, i)), non_blocking=True)
            if pred is not None:
                replay.pred[:, i].copy_(torch.from_numpy(row_of(pred, s, i)), non_blocking=True)
        if pred is not None:
            replay.stage_pred()

    pf0 = (0, 0)                              # prefetches issued and hit before the measured steps
    for batch in batches:
        replay = Replay(model, batch, cfg.num_experts_per_tok)
        decay = round_decay(half_life_unit, half_life, interval, interval * batch) if moves else 0.0
        K.route = replay.route
        PF.predict = replay.predict
        try:
            engine = LocalEngine([model], max_seqs=batch, max_tokens=warmup + 2 * steps + 80, cuda_graphs=True)
            for i in range(batch):
                engine.add(i)
                engine.step([(i, [11 + i] * 8)])
            reads0 = moves0 = 0
            times = []
            round_host: list[float] = []          # host seconds to launch a move round (inside the timed step)
            round_events: list[tuple] = []        # its GPU span (events around it), read after the run
            for s in range(warmup + steps):
                stage_rows(replay, s, batch)
                if s == warmup:
                    torch.cuda.synchronize()
                    if x is not None:
                        reads0, moves0 = int(x.host_reads.sum()), int(x.moves.sum())
                        if x.prefetch_hits is not None:
                            pf0 = (int(x.prefetch_issued.sum()), int(x.prefetch_hits.sum()))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                # The timed span holds the move round before the step (the server runs one between steps and pays
                # its GPU time and launch gaps). Until h200-22 it started after the round: a round whose GPU work
                # outlasted its launches then hid the step's own launch gap (batch 4 with moves measured faster than
                # without), and at batch 1 the round's 0.42 ms was not counted.
                start.record()
                if moves and x is not None and s % interval == interval - 1 and not (freeze and s >= warmup):
                    r0, r1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t_host = time.perf_counter()
                    r0.record()
                    x.move_round(gates(model), decay, margin, fused=fused, graph=graphed)
                    r1.record()
                    if s >= warmup:
                        round_host.append(time.perf_counter() - t_host)
                        round_events.append((r0, r1))
                engine.step([(i, [100 + i]) for i in range(batch)])
                end.record()
                torch.cuda.synchronize()
                if s >= warmup:
                    times.append(start.elapsed_time(end) / 1e3)
            reads = (int(x.host_reads.sum()) - reads0) if x is not None else 0
            moved = (int(x.moves.sum()) - moves0) if x is not None else 0
            issued, hits = (int(x.prefetch_issued.sum()) - pf0[0], int(x.prefetch_hits.sum()) - pf0[1]) \
                if x is not None and x.prefetch_hits is not None else (0, 0)
            # The same steps back to back, one sync at the end, as a server that launches ahead runs them: each
            # step's host work (the round's launches too) overlaps the previous step's kernels. The trace rows are
            # staged on the device first so that nothing in the loop waits for the host.
            b2b = range(warmup + steps, warmup + 2 * steps)
            staged = [torch.stack([torch.stack([torch.from_numpy(row_of(src, s, i)) for i in range(batch)], 1)
                                   for s in b2b]).to(replay.buf.device)          # [steps, layers, batch, top_k]
                      for src in ([trace] if pred is None else [trace, pred])]
            b0, b1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b0.record()
            for n, s in enumerate(b2b):
                replay.buf[:, :batch].copy_(staged[0][n])
                if pred is not None:
                    replay.pred[:, :batch].copy_(staged[1][n])
                    replay.stage_pred()
                if moves and x is not None and s % interval == interval - 1 and not freeze:
                    x.move_round(gates(model), decay, margin, fused=fused, graph=graphed)
                engine.step([(i, [100 + i]) for i in range(batch)])
            b1.record()
            torch.cuda.synchronize()
            back_to_back = b0.elapsed_time(b1) / 1e3 / steps
            if profile is not None:
                from prefill import profile_run

                def more(replay=replay, x=x, model=model, engine=engine) -> None:   # the replay, further along
                    for s in range(warmup + 2 * steps, warmup + 2 * steps + 16):
                        stage_rows(replay, s, batch)
                        if moves and x is not None and s % interval == interval - 1 and not freeze:
                            x.move_round(gates(model), decay, margin, fused=fused,
                                         graph=graphed)
                        engine.step([(i, [100 + i]) for i in range(batch)])

                profile_run(more, Path(f"{profile}_b{batch}.txt"), top=12)
        finally:
            K.route = replay.real_route
            PF.predict = replay.real_predict
        # The decode layers must have taken the replay's routing (called eagerly or captured into the graphs, so
        # at least once a layer): a model that reaches the router another way (h200-18 call 3: a module that had
        # imported `route` by name) decodes with the dummy router's near-uniform choices, and the rows mean nothing
        # (14.7 host reads a token with no moves against the replay's 5.6).
        if replay.decode_calls < len(replay.moes):
            raise SystemExit(f"expert_offload: the routing replay ran in {replay.decode_calls} decode calls for "
                             f"{len(replay.moes)} MoE layers: the model's decode does not route through "
                             "stage_worker.kernels.moe.route (K.route)")
        if prefetch and batch >= prefetch_min_batch and replay.predict_calls == 0:
            raise SystemExit("expert_offload: --prefetch: no layer predicted (the decode path never called "
                             "stage_worker.kernels.expert_prefetch.predict)")
        del engine
        med = statistics.median(times)
        round_gpu = [a.elapsed_time(b) / 1e3 for a, b in round_events]
        host = x.host_bytes() if x is not None else 0
        out.append({"batch": batch, "host_share": host / total_experts, "host_gib": host / (1 << 30),
                    "moves_on": moves, "policy": policy, "median_step_ms": med * 1e3, "tokens_per_s": batch / med,
                    "host_reads_per_token": reads / (steps * batch), "moves_per_token": moved / (steps * batch),
                    "back_to_back_step_ms": back_to_back * 1e3,
                    "load_s": load_s, "quant": quant, "greedy": check, "expert_move_fused": fused,
                    "expert_move_graph": graphed, "step_includes_round": True, "frozen_after_warmup": freeze,
                    "expert_move_async": spares, "half_life_unit": half_life_unit, "round_decay": decay,
                    "claims": claims if spares else None, "prefetch_slots": prefetch, "prefetch_top": prefetch_top,
                    "prefetch_min_batch": prefetch_min_batch,
                    "prefetches_per_token": issued / (steps * batch), "prefetch_hits_per_token": hits / (steps * batch),
                    "round_host_ms": statistics.median(round_host) * 1e3 if round_host else None,
                    "round_gpu_ms": statistics.median(round_gpu) * 1e3 if round_gpu else None})
    if x is not None and x.host is not None:
        x.host.close()                    # unregister now: the next model's table may map at the same address
    del model, x, replay
    gc.collect()
    torch.cuda.empty_cache()
    return out


def simulate(cfg, trace: dict[str, np.ndarray], fit: dict[str, np.ndarray], shares: list[float],
             batches: list[int], policies: list[tuple], steps: int, warmup: int, read_us: float, move_us: float,
             round_us: float, base_ms: dict[int, float], on_read: bool = False, claims: int = 1,
             half_life_unit: str = "steps", pred: dict[str, np.ndarray] | None = None,
             prefetch_slots: int = 0) -> list[dict]:
    """`--simulate`: no GPU. The same cold sets, trace rows and streams as `run`, replayed by
    `expert_cache_sim._replay_swap` (the server's swap policy; it reproduces the benchmark's reads and moves a token
    exactly), and a step's time estimated with the serial model that fits the measured rows (h200-22 call 6): the
    all-in-VRAM step plus each host read (read_us) plus each move (move_us: two PCIe copies of an expert) plus each
    round's fixed GPU time (round_us). `on_read` (`--async-moves`): the moves on read of `expert_move_async`
    (`expert_cache_sim._replay_claim`) instead of swaps; with `claims` C > 1 (`--claims`) `_replay_claims` with C
    claims and 2C spares a layer a step. `half_life_unit` "tokens": each policy's half-life counted in tokens (a
    step of B tokens: half-life / B steps).
    `prefetch_slots` P > 0 (`--prefetch-slots`, with `pred`, the trace's predictions one layer ahead through the same
    mapping, `full_shape_trace(predictions=True)`; moves off or on read with one claim): each row also replays the
    moves on read with the predicted host experts prefetched (`_replay_claim(predicted=, prefetch_slots=P)`), at
    most P a layer a step, in rank order (every token's rank-0 prediction of the step first, then rank 1, ...), only
    experts host-resident at the step counting. Adds `critical_reads_per_token` (host reads left on the critical
    path; `host_reads_per_token` is the same without prefetch), `prefetches_per_token` and
    `prefetches_used_per_token`, and `extra_ms_prefetch` / `est_prefetch`: the estimate with only the critical
    reads paid (the prefetches' copies assumed hidden beside the step)."""
    from expert_cache_sim import Policy, _replay_claim, _replay_claims, _replay_swap

    kinds = sorted(trace)
    out = []
    for share in shares:
        cold = cold_sets(cfg, share, fit)
        resident = np.ones((cfg.num_hidden_layers, cfg.num_experts), dtype=bool)
        for layer, ids in cold.items():
            resident[layer, ids] = False
        for batch in batches:
            rows = np.arange(warmup + steps)

            def streams(src: dict[str, np.ndarray]) -> np.ndarray:      # [steps, layers, batch, top_k]
                return np.stack([src[kinds[i % len(kinds)]][(rows + 997 * (i // len(kinds))) %
                                                            len(src[kinds[i % len(kinds)]])]
                                 for i in range(batch)], axis=2)

            ids = streams(trace).reshape(len(rows), cfg.num_hidden_layers, -1)    # [steps, layers, batch * top_k]
            # predictions rank-major (rank 0 of every token first): the order a capped prefetch takes them in
            ahead = streams(pred).transpose(0, 1, 3, 2).reshape(ids.shape) if prefetch_slots else None
            for policy in [None] + (policies if cold else []):
                every, half_life, margin = policy or (1, 1e30, 1e30)
                if policy and half_life_unit == "tokens":
                    half_life = half_life / batch
                pol = Policy("swap", "swap", half_life=half_life, every=every, margin=margin)
                if on_read and policy and claims > 1:
                    r = _replay_claims(ids, cfg.num_experts, resident, pol, warmup, spares=2 * claims,
                                       claims=claims, streams=batch)
                else:
                    replay = _replay_claim if on_read and policy else _replay_swap
                    r = replay(ids, cfg.num_experts, resident, pol, warmup)
                reads = (1 - r["hit_rate"]) * ids.shape[1] * ids.shape[2] / batch        # a token
                moves = r["moves_per_token"] * ids.shape[1]                                # a step
                extra_ms = (reads * batch * read_us + moves * move_us + (round_us / every if policy else 0)) / 1e3
                base = base_ms.get(batch)
                out.append({"share": share, "batch": batch, "policy": policy, "host_reads_per_token": reads,
                            "moves_per_step": moves, "extra_ms": extra_ms,
                            "est_vs_all_in_vram": base / (base + extra_ms) if base else None})
                if prefetch_slots:
                    if policy and not (on_read and claims == 1):
                        raise ValueError("prefetch replays moves on read with one claim (--async-moves, --claims 1)")
                    pf = _replay_claim(ids, cfg.num_experts, resident, pol, warmup, predicted=ahead,
                                       prefetch_slots=prefetch_slots)
                    critical = pf["critical_reads_per_token"] / batch
                    extra_pf = extra_ms - (reads - critical) * batch * read_us / 1e3
                    out[-1].update({"prefetch_slots": prefetch_slots, "critical_reads_per_token": critical,
                                    "prefetches_per_token": pf["prefetches_per_token"] / batch,
                                    "prefetches_used_per_token": pf["prefetches_used_per_token"] / batch,
                                    "extra_ms_prefetch": extra_pf,
                                    "est_prefetch": base / (base + extra_pf) if base else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="full-shape")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shares", default="0,0.1,0.25,0.5")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--steps", type=int, default=384, help="measured decode steps per configuration")
    ap.add_argument("--warmup", type=int, default=128, help="steps before measuring (moves settle here too)")
    ap.add_argument("--policies", default="8:512:2",
                    help="move policies to run, each interval:half-life:margin (steps, steps, count lead); the "
                         "server's default is 1:128:0.5")
    ap.add_argument("--quant", default="", choices=["", "int4-experts"],
                    help="int4-experts: the routed experts kept as INT4 words and scales (as an INT4 checkpoint "
                         "loads with packed_experts on), tables and host reads at the packed size")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="16 more steps of every row under torch.profiler: kernels by GPU time to DIR, top 12 printed")
    ap.add_argument("--freeze-moves", action="store_true",
                    help="moves only during the warm-up: the timed steps read the placement the moves reached, "
                         "with no rounds (what moves off the forward's stream could give at best)")
    ap.add_argument("--move-modes", default="", metavar="inplace,onread",
                    help="each policy's rows with moves in place and / or on read (expert_move_async), one process "
                         "(default: the server's switch, MOEPIPE_EXPERT_MOVE_ASYNC)")
    ap.add_argument("--half-life-unit", choices=("steps", "tokens"), default="steps",
                    help="the --policies half-lives in steps (default, today's server) or in tokens "
                         "(expert_move_half_life_unit: a round decays by 0.5 ** (interval * batch / half-life))")
    ap.add_argument("--claims", type=int, default=1,
                    help="moves on read: C host slots a layer may claim a step, 2C spares a table "
                         "(expert_move_claims; default 1, today's server)")
    ap.add_argument("--prefetch", default="0",
                    help="prefetch slots a table to run each moving row with, comma-separated (expert_prefetch; "
                         "0 = off, the server's default): each layer predicts the next one's host experts from the "
                         "trace's layer-ahead predictions (GPU: needs --quant int4-experts). --simulate: the "
                         "largest value, at most P predicted host experts a layer a step, rank 0 of every token "
                         "first (moves on read: with --policies add --async-moves)")
    ap.add_argument("--prefetch-min-batch", type=int, default=ClusterConfig.expert_prefetch_min_batch,
                    help="GPU rows: decode batches of fewer tokens do not predict or copy "
                         "(expert_prefetch_min_batch; default the server's)")
    ap.add_argument("--pred-mapping", choices=("rank", "member"), default="rank",
                    help="how the demo trace's predictions map onto the full shape: rank (slot j's guess from the "
                         "two demo layers' same-rank predictions: recall ~0.27, a floor) or member (a slot is "
                         "predicted when both its demo selections are among their layers' predictions: ~0.5, "
                         "near a trained router's 0.49-0.80; `member_predictions`)")
    ap.add_argument("--simulate", action="store_true",
                    help="no GPU: replay the policies on the trace and estimate each row from the costs below")
    ap.add_argument("--read-us", type=float, default=49.0, help="--simulate: one host read (h200-22 call 6)")
    ap.add_argument("--move-us", type=float, default=100.0, help="--simulate: one move's two PCIe copies")
    ap.add_argument("--round-us", type=float, default=100.0, help="--simulate: a round's fixed GPU time")
    ap.add_argument("--async-moves", action="store_true",
                    help="--simulate: moves on read (expert_move_async): claims replayed as the server makes "
                         "them, a move costs the step nothing (its write-back runs on a side stream), a round its "
                         "one launch (--round-us applies, set it to the round's time)")
    ap.add_argument("--base-ms", default="1:3.59,4:4.76",
                    help="--simulate: all-in-VRAM step ms per batch (batch:ms,...; h200-22 call 6)")
    args = ap.parse_args()
    args.prefetch_slots = max(int(p.split(":")[0]) for p in args.prefetch.split(","))
    if args.simulate:
        return _simulate_main(args)
    wanted = [m for m in args.move_modes.split(",") if m]
    if set(wanted) - {"inplace", "onread"}:
        raise SystemExit(f"--move-modes takes inplace and / or onread, not {args.move_modes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/expert_offload.py needs a CUDA device")
    raw = preset(args.preset)
    raw.update(num_hidden_layers=args.layers, layer_types=raw["layer_types"][: args.layers])
    raw["ple_layer_ids"] = [i for i in raw.get("ple_layer_ids", []) if i <= args.layers]
    cfg = config_from_dict(raw)
    tokens = args.warmup + args.steps + 1000
    trace, pred = full_shape_trace(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, tokens,
                                   predictions=True, mapping=args.pred_mapping)
    prefetches = [tuple(int(v) for v in (p + ":0").split(":")[:2]) for p in args.prefetch.split(",")]
    # the cold sets come from other text of the same kinds (demo tokens 100k on), as a server's would
    fit = full_shape_trace(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, 20000, start=100000)
    cost = host_read_cost(cfg, args.quant)
    print(f"one host read ({args.quant or 'bf16'} expert of {cost['expert_bytes'] / 1e6:.2f} MB over PCIe inside the "
          f"fused kernel): {cost['per_read_us']:.0f} us ({cost['gb_per_s']:.1f} GB/s)")
    results = []
    batches = [int(b) for b in args.batch.split(",")]
    policies = _policies(args.policies)
    # in place (False) and / or on read (True): both in one process share its all-in-VRAM rows and its GPU state
    modes = [m == "onread" for m in wanted] or [_switch("expert_move_async")]
    print(f"{'batch':>5} {'host %':>7} {'GiB':>6} {'moves':>9} {'step ms':>8} {'tok/s':>8} {'vs VRAM':>8} "
          f"{'reads/tok':>9} {'moves/tok':>9} {'round host/gpu ms':>17} {'b2b ms':>7} {'b2b %':>6} "
          f"{'pf/tok':>6} {'hits/tok':>8}")
    base: dict[int, float] = {}
    base_b2b: dict[int, float] = {}
    for row, share in enumerate(float(s) for s in args.shares.split(",")):
        cold = cold_sets(cfg, share, fit)
        for policy, on_read, pf in ([(None, False, (0, 0))] + [(p, m, f) for p in policies for m in modes
                                                                for f in prefetches] if cold else
                                    [(None, False, (0, 0))]):
            moves = policy is not None
            name = f"row{row}_share{share:g}_{'moves' + ':'.join(f'{v:g}' for v in policy) if moves else 'nomoves'}"
            name += ("_onread" if on_read else "") + (f"_prefetch{pf[0]}-{pf[1]}" if pf[0] else "")
            prof = Path(args.profile) / name.replace(":", "-") if args.profile else None
            for r in run(cfg, cold, trace, batches, args.steps, args.warmup, policy, args.quant, prof,
                         freeze=args.freeze_moves and moves, on_read=on_read,
                         half_life_unit=args.half_life_unit, claims=args.claims, pred=pred, prefetch=pf[0],
                         prefetch_top=pf[1], prefetch_min_batch=args.prefetch_min_batch):
                if not cold:
                    base[r["batch"]] = r["tokens_per_s"]
                    base_b2b[r["batch"]] = r["back_to_back_step_ms"]
                r["vs_all_in_vram"] = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else None
                r["back_to_back_vs_all_in_vram"] = (base_b2b[r["batch"]] / r["back_to_back_step_ms"]
                                                    if r["batch"] in base_b2b else None)
                results.append(r)
                pol = ":".join(f"{v:g}" for v in policy) + ("f" if r["frozen_after_warmup"] else "") + \
                    ("a" if r["expert_move_async"] else "") + (f"c{args.claims}" if r.get("claims") not in (None, 1)
                                                               else "") + \
                    ("t" if args.half_life_unit == "tokens" else "") + (f"p{pf[0]}" if pf[0] else "") + \
                    (f"r{pf[1]}" if pf[0] and pf[1] else "") \
                    if moves else "off"  # frozen/async/C/tokens/prefetch
                print(f"{r['batch']:>5} {100 * r['host_share']:>6.1f}% {r['host_gib']:>6.1f} {pol:>9} "
                      f"{r['median_step_ms']:>8.2f} {r['tokens_per_s']:>8.1f} "
                      f"{100 * (r['vs_all_in_vram'] or 0):>7.1f}% {r['host_reads_per_token']:>9.2f} "
                      f"{r['moves_per_token']:>9.3f} {_round_cols(r):>17} {r['back_to_back_step_ms']:>7.2f} "
                      f"{100 * (r['back_to_back_vs_all_in_vram'] or 0):>5.1f}% {r['prefetches_per_token']:>6.2f} "
                      f"{r['prefetch_hits_per_token']:>8.2f}", flush=True)
    ref = results[0]["greedy"]
    for r in results:
        g = r["greedy"]
        r["greedy_equal"] = g["tokens"] == ref["tokens"]
        # up to the first differing token (after it the contexts differ and so do the logprobs)
        same = next((i for i, (a, b) in enumerate(zip(g["tokens"], ref["tokens"])) if a != b), len(g["tokens"]))
        r["greedy_first_difference"] = None if r["greedy_equal"] else same
        r["greedy_max_logprob_diff"] = max((abs(a - b) for a, b in zip(g["logprobs"][:same + 1],
                                                                       ref["logprobs"][:same + 1])), default=0.0)
    def mode(r: dict) -> str:
        return ("on read" if r["expert_move_async"] else "on") if r["moves_on"] else "off"

    print("greedy tokens vs all in VRAM (real router, moves after every token when on): " + "; ".join(
        f"{100 * r['host_share']:.0f}% moves {mode(r)}: "
        f"{'same' if r['greedy_equal'] else 'first differs at token ' + str(r['greedy_first_difference'])} "
        f"(max |dlogprob| up to there {r['greedy_max_logprob_diff']:.2g}"
        f"{', ' + str(r['greedy'].get('moves')) + ' moves' if r['moves_on'] else ''})"
        for r in results if r["batch"] == batches[0]))
    meta = {"command": " ".join(sys.argv), "expert_vmm_table": _switch("expert_vmm_table"),
            "preset": args.preset, "layers": args.layers, "quant": args.quant,
            "device": torch.cuda.get_device_name(), "host": platform.node(), "trace": str(TRACE.relative_to(ROOT)),
            "steps": args.steps, "warmup": args.warmup, "policies": policies}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "host_read": cost, "results": results}, indent=1))
        print(f"wrote {args.out}")
    return 0



def _policies(text: str) -> list[tuple[int, float, float]]:
    return [tuple(float(v) if i else int(v) for i, v in enumerate(p.split(":"))) for p in text.split(",") if p]


def _simulate_main(args) -> int:
    """`--simulate`'s table (and JSON with --out)."""
    raw = preset(args.preset)
    raw.update(num_hidden_layers=args.layers, layer_types=raw["layer_types"][: args.layers])
    raw["ple_layer_ids"] = [i for i in raw.get("ple_layer_ids", []) if i <= args.layers]
    cfg = config_from_dict(raw)
    if args.prefetch_slots < 0 or (args.prefetch_slots and (args.claims != 1 or (args.policies and
                                                                              not args.async_moves))):
        raise SystemExit("--prefetch-slots P >= 0; a prefetch is replayed with moves on read and one claim: add "
                         "--async-moves (or --policies ''), --claims 1")
    trace = full_shape_trace(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok,
                             args.warmup + args.steps + 1000, predictions=args.prefetch_slots > 0,
                             mapping=args.pred_mapping)
    trace, pred = trace if args.prefetch_slots else (trace, None)
    fit = full_shape_trace(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, 20000, start=100000)
    base = {int(b): float(ms) for b, ms in (x.split(":") for x in args.base_ms.split(",") if x)}
    rows = simulate(cfg, trace, fit, [float(x) for x in args.shares.split(",")],
                    [int(b) for b in args.batch.split(",")], _policies(args.policies), args.steps, args.warmup,
                    args.read_us, 0.0 if args.async_moves else args.move_us, args.round_us, base, args.async_moves,
                    claims=args.claims, half_life_unit=args.half_life_unit, pred=pred,
                    prefetch_slots=args.prefetch_slots)
    print(f"simulated (read {args.read_us:g} us, move {0 if args.async_moves else args.move_us:g} us, round "
          f"{args.round_us:g} us{', moves off the forward' if args.async_moves else ''}; "
          f"{args.warmup} warm-up + {args.steps} steps)")
    pf = args.prefetch_slots > 0
    print(f"{'host %':>7} {'batch':>5} {'moves':>11} {'reads/tok':>9} {'moves/step':>10} {'extra ms':>8} {'est %':>6}"
          + (f" | prefetch <= {args.prefetch_slots} a layer a step: {'critical/tok':>12} {'pf/tok':>7} "
             f"{'used':>6} {'est %':>6}" if pf else ""))
    for r in rows:
        pol = ":".join(f"{v:g}" for v in r["policy"]) if r["policy"] else "off"
        est = f"{100 * r['est_vs_all_in_vram']:.1f}" if r["est_vs_all_in_vram"] else "-"
        line = (f"{100 * r['share']:>6.1f}% {r['batch']:>5} {pol:>11} {r['host_reads_per_token']:>9.2f} "
                f"{r['moves_per_step']:>10.3f} {r['extra_ms']:>8.3f} {est:>6}")
        if pf:
            est = f"{100 * r['est_prefetch']:.1f}" if r["est_prefetch"] else "-"
            line += (f" | {'':>29} {r['critical_reads_per_token']:>12.2f} {r['prefetches_per_token']:>7.2f} "
                     f"{r['prefetches_used_per_token']:>6.2f} {est:>6}")
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": {"command": " ".join(sys.argv), "simulated": True,
                                                       "async_moves": args.async_moves,
                                                       "prefetch_slots": args.prefetch_slots},
                                              "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
