"""Give a stage's MoE layers expert tables with their cold experts in host RAM (issue 16): one exact-size pinned
allocation for all of the stage's host rows, device tables for the rest, counters for moves and /metrics.

Called by the loader on the meta-device model, before anything is allocated on the device: the routed experts'
[E, ...] parameters are replaced by tables (`SparseMoE.use_table`), so neither the device nor the host ever holds
an expert twice (the reports' first offload loaded everything, then copied the cold rows out: 000 §5).

With `expert_vmm_table` (`attach_tables(..., vmm=True)`, 000 §4.2) each layer's part is instead one CUDA-VMM range
(`vmm_range.tiered_rows`): VRAM rows then host-NUMA rows at one address range, the table's device and host tensors
two views of it, so the kernels, loaders and moves take the same tensors as before. The device part ends on the
driver's granularity (2 MiB), so a few host slots may sit in VRAM. Where the driver refuses, one warning and the
two-table layout above for the whole stage.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch

from stage_worker.host_memory import HostBuffer, allocate, check_free, host_lock
from stage_worker.vmm_range import TieredRange, VmmUnavailable, tiered_rows
from stage_worker.kernels.expert_moves_ref import RowSet, settle_ref, swap_rows_ref
from stage_worker.kernels.expert_prefetch_ref import PREFETCH_MAX_T, Prefetch
from stage_worker.model.expert_table import FP8_PARTS, PACKED_PARTS, PARTS, ExpertRows, ExpertTable

log = logging.getLogger(__name__)


def uncounted(model) -> contextlib.AbstractContextManager:
    """`StageExperts.uncounted` of the model's expert tables (warm-up steps: a graph capture's, the start-up's);
    nothing to do for a model without them."""
    experts = getattr(model, "experts", None)
    return contextlib.nullcontext() if experts is None else experts.uncounted()


@dataclass
class StageExperts:
    """The stage's tables by layer, and the state every table holds a view of: one tensor each for all layers, so
    a move round is a few launches and /metrics one read-back."""
    tables: dict[int, ExpertTable]
    counts: torch.Tensor          # fp32 [L, E] selections per slot, decayed each move round
    expert_of_slot: torch.Tensor  # int32 [L, E]
    hot: torch.Tensor             # int64 [L] device slots per layer
    host_reads: torch.Tensor      # int64 [L]
    moves: torch.Tensor           # int64 [L]
    host: HostBuffer | None       # the pinned allocation of the host rows (None with VMM ranges)
    # with `expert_vmm_table`: every layer's part as one VRAM + host range ([E, ...] tensor, its range), the
    # tables' dev/host tensors views of it; held here so the ranges live as long as the stage's experts
    ranges: list[tuple[torch.Tensor, TieredRange]] = field(default_factory=list)
    # with `expert_move_async` (moves on read): each layer has S = E + SPARES slots, the spares among its `hot` device
    # slots; the router reaches its E live slots through `slot_map` (`expert_moves.claim_round`)
    slot_map: torch.Tensor | None = None        # int32 [L, E] router index -> slot (the tables' `slot_map` views)
    # int64 [L, 4C] (free slots [2C], victims [C], their host slots [C]; C = 1: spare, reserve, victim, its host
    # slot), -1: none
    state: torch.Tensor | None = None
    claim: torch.Tensor | None = None           # int32 [L, C] ([L] at C = 1) the host slots a step claimed, -1 none
    threshold: torch.Tensor | None = None       # fp32 [L] the count a host slot must pass to be claimed
    _done: object | None = None    # the event after the last round's write-backs (CUDA)
    _side: object | None = None    # the side stream the write-backs run on (CUDA)
    _plans: tuple | None = None   # (router data_ptrs, [(SwapPlan, layer indices)]) of the last move round
    _graph: tuple | None = None   # (key, CUDAGraph, its decisions tensor) of the captured round (`expert_move_graph`)
    # every captured round by key (the decay is baked into a graph: a half-life in tokens gives a decay per batch
    # size), at most GRAPH_CACHE of them, the oldest dropped first
    _graph_cache: dict = field(default_factory=dict)
    # with `expert_prefetch`: int64 [L] host slots named for a layer-ahead copy and selections read from a
    # prefetch slot, per layer (the tables' `Prefetch.issued` / `.hits` views; 0 where a layer has none)
    prefetch_issued: torch.Tensor | None = None
    prefetch_hits: torch.Tensor | None = None
    _copy: tuple | None = None    # (pinned [4, L] host tensor, event) of the counters' last read-back
    _last: tuple[list[int], ...] | None = None   # host reads, moves, prefetches, their hits per layer, last read back

    @property
    def layers(self) -> list[int]:
        return list(self.tables)

    def host_bytes(self) -> int:
        """Routed-expert bytes in host RAM (packed experts at their packed size; VMM ranges: their host parts)."""
        if self.ranges:
            return sum(rng.host_bytes for _, rng in self.ranges)
        return sum(t.host_bytes() for t in self.tables.values())

    def device_bytes(self) -> int:
        """Routed-expert bytes in the device slots of the layers with tables (VMM ranges: their device parts, up to
        the granularity, so also the host slots that share the last granule)."""
        if self.ranges:
            return sum(rng.device_bytes for _, rng in self.ranges)
        return sum(t.device_bytes() for t in self.tables.values())

    def _counters(self) -> list[torch.Tensor]:
        out = [self.host_reads, self.moves]
        if self.prefetch_issued is not None:
            out += [self.prefetch_issued, self.prefetch_hits]
        return out

    @contextlib.contextmanager
    def uncounted(self):
        """Steps run inside (a graph capture's warm-up runs, the start-up warm-up: scratch rows, no request's) leave
        the host-read, move and prefetch counters as they were, so /metrics counts requests' traffic only. Found by
        h100-42: a one-token stage with `expert_prefetch_min_batch` 2 reported 28 prefetches, all from the warm-up
        of its batch-2 graph."""
        saved = [c.clone() for c in self._counters()]
        try:
            yield
        finally:
            for c, s in zip(self._counters(), saved):
                c.copy_(s)

    def snapshot(self) -> None:
        """Queue a copy of the host-read, move and prefetch counters to the host, and keep the previous copy's
        values once it has landed; called from the runner's thread between steps (nothing waits, nothing runs
        during a capture)."""
        counters = self._counters()
        if self.counts.device.type != "cuda":
            self._last = tuple(c.tolist() for c in counters)
            return
        if self._copy is None:
            self._copy = (torch.empty(len(counters), len(self.tables), dtype=torch.int64, pin_memory=True), None)
        buf, event = self._copy
        if event is not None:
            if not event.query():
                return                                   # the previous copy is still on its way
            self._last = tuple(row.tolist() for row in buf)
        for row, c in zip(buf, counters):
            row.copy_(c, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copy = (buf, event)

    def stats(self) -> dict[str, float]:
        """For the heartbeat (/metrics): bytes by tier, and per layer the host reads and moves last read back."""
        out = {"expert_bytes_vram": float(self.device_bytes()), "expert_bytes_host": float(self.host_bytes())}
        if self._last is not None:
            names = ("expert_host_reads", "expert_moves", "expert_prefetches", "expert_prefetch_hits")
            for name, values in zip(names, self._last):
                for layer, v in zip(self.tables, values):
                    out[f"{name}:{layer}"] = float(v)
        return out

    def row_sets(self, gates: list[torch.Tensor], with_gates: bool = True) -> list[tuple[RowSet, list[int] | None]]:
        """What a move swaps, one RowSet per kind of row (a part with one row shape and dtype: w13, w2, or INT4
        words and scales of each, or float8 bytes and block scales of each; then, `with_gates`, the router rows),
        each with the indices of the layers it covers (None: all, in `tables` order) so a stage whose layers hold
        different parts still swaps each in one launch."""
        ts = list(self.tables.values())
        kinds: dict[tuple, list[int]] = {}
        for i, t in enumerate(ts):
            for part in t.parts:
                d = t.dev[part]
                kinds.setdefault((part, tuple(d.shape[1:]), d.dtype), []).append(i)
        out = []
        for (part, _, _), idx in kinds.items():
            out.append((RowSet([ts[i].dev[part] for i in idx], [ts[i].host[part] for i in idx],
                               [ts[i].hot for i in idx]), None if len(idx) == len(ts) else idx))
        if with_gates:
            out.append((RowSet(gates, gates, [t.num_experts for t in ts]), None))
        return out

    @torch.no_grad()
    def move_round(self, gates: list[torch.Tensor], decay: float, margin: float, fused: bool = False,
                   graph: bool = False) -> torch.Tensor:
        """Decay the counts and swap, per layer, the most used host slot with the least used device slot if it
        beats it by `margin` (rows, router rows, counts, slot map); `gates` are the layers' router weights [E, H]
        (slot order). Queued on the current stream; nothing waits. Returns the decisions [L, 3]. `fused`
        (`expert_move_fused`, where the swap kernel runs): the decision and the counts / slot-map / move-counter
        bookkeeping in one launch (`decide_settle`; the swap kernels read only the decisions and the rows, so the
        bookkeeping may come first), then one swap launch per kind of row; the same results bit for bit. `graph`
        (`expert_move_graph`, with `fused`): those launches replayed from a CUDA graph, captured after the first
        eager round with these arguments (the returned decisions are then the graph's tensor, rewritten by the
        next round)."""
        from stage_worker.kernels.expert_moves import decide, swap_rows, swap_usable   # Triton: lazily

        if self.state is not None:
            return self._claim_round(gates, decay, margin, graph)
        if fused and swap_usable(self.counts):
            if not graph:
                return self._fused_round(gates, decay, margin)
            key = (tuple(g.data_ptr() for g in gates), float(decay), float(margin))
            if self._cached_graph(key):
                self._graph[1].replay()
                return self._graph[2]
            dec = self._fused_round(gates, decay, margin)     # compiles the kernels and builds the plans
            self._capture(key, gates, decay, margin)          # records the launches; runs nothing
            return dec
        dec = decide(self.counts, self.hot, decay, margin)
        if swap_usable(self.counts):
            for plan, idx in self._swap_plans(gates):
                swap_rows(plan, dec if idx is None else dec.index_select(0, idx))
        else:
            for r, idx in self.row_sets(gates):
                swap_rows_ref(r, dec if idx is None else dec[idx])
        settle_ref(self.counts, self.expert_of_slot, self.moves, dec)
        return dec

    def _claim_round(self, gates: list[torch.Tensor], decay: float, margin: float,
                     graph: bool = False) -> torch.Tensor:
        """`expert_move_async` (moves on read): commit what the steps since the last round claimed (their decode
        kernels stored the claimed host rows into the spares as they read them), make last round's written-back
        victims' slots the spares, set the next claims' thresholds (`claim_round`, one launch; the forward's stream
        first waits for last round's write-backs, the host does not), then write this round's victims back into
        the host slots their claimed experts left, on a side stream so the steps run meanwhile. A CPU cluster
        runs the references at once. With `graph` both parts replay CUDA graphs captured after the first eager
        round with these arguments. Returns `state` [L, 4C] (free slots, victims, their host slots; C = 1: spare,
        reserve, victim, its host slot). Gate rows
        never move."""
        from stage_worker.kernels.expert_moves import swap_usable
        from stage_worker.kernels.expert_moves_ref import claim_round_ref, write_back_ref

        args = (self.counts, self.expert_of_slot, self.slot_map, self.hot, self.moves, self.state, self.claim,
                self.threshold, decay, margin)
        if not swap_usable(self.counts):
            claim_round_ref(*args)
            for rows, idx in self.row_sets(gates, with_gates=False):
                write_back_ref(rows, self.state if idx is None else self.state[idx])
            return self.state
        from stage_worker.kernels.expert_moves import claim_round

        if self._side is None:
            self._side = torch.cuda.Stream(self.counts.device)
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        key = ("claims", tuple(g.data_ptr() for g in gates), float(decay), float(margin))
        captured = graph and self._cached_graph(key)
        if captured:
            self._graph[1].replay()
        else:
            claim_round(*args)
        decided = torch.cuda.Event()
        decided.record()
        with torch.cuda.stream(self._side):
            self._side.wait_event(decided)
            if captured:
                self._graph[2].replay()
            else:
                self._write_backs(gates)
            self._done = torch.cuda.Event()
            self._done.record(self._side)
        if graph and not captured:     # record both parts; capture runs nothing
            main, side = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(main, capture_error_mode="thread_local"):
                claim_round(*args)
            with torch.cuda.graph(side, capture_error_mode="thread_local"):
                self._write_backs(gates)
            self._keep_graph((key, main, side))
        return self.state

    def _cached_graph(self, key: tuple) -> bool:
        """Whether a round with `key` was captured; if so it is `_graph` now."""
        if self._graph is not None and self._graph[0] == key:
            return True
        hit = self._graph_cache.get(key)
        if hit is not None:
            self._graph = hit
        return hit is not None

    def _keep_graph(self, entry: tuple) -> None:
        self._graph = entry
        self._graph_cache[entry[0]] = entry
        while len(self._graph_cache) > GRAPH_CACHE:
            self._graph_cache.pop(next(iter(self._graph_cache)))

    def _write_backs(self, gates: list[torch.Tensor]) -> None:
        """The round's side-stream part: `write_back` of the pending victims for every kind of row (the router
        rows stay), over SwapPlans built once."""
        from stage_worker.kernels.expert_moves import SwapPlan, write_back

        if self._plans is None or self._plans[0] != "write_back":
            dev = self.counts.device
            self._plans = ("write_back", [(SwapPlan.build(r, dev),
                                           idx if idx is None else torch.tensor(idx, device=dev))
                                          for r, idx in self.row_sets(gates, with_gates=False)])
        for plan, idx in self._plans[1]:
            write_back(plan, self.state, layers=idx)

    def _fused_round(self, gates: list[torch.Tensor], decay: float, margin: float) -> torch.Tensor:
        """`move_round`'s fused launches: `decide_settle`, then one swap launch per kind of row."""
        from stage_worker.kernels.expert_moves import decide_settle, swap_rows

        dec = decide_settle(self.counts, self.hot, self.expert_of_slot, self.moves, decay, margin)
        for plan, idx in self._swap_plans(gates):
            swap_rows(plan, dec, layers=idx)
        return dec

    def _capture(self, key: tuple, gates: list[torch.Tensor], decay: float, margin: float) -> None:
        """Record the fused round into a CUDA graph. Why: its six or so Triton launches took 0.41 ms of host time a
        round with the GPU idle between them (h200-22 call 3: a round's GPU span 0.42 ms at batch 1, its kernels
        ~0.1 ms), and the server runs a round after every step. Thread-local capture: the stage's other threads
        (the PLE row publisher) keep using CUDA meanwhile."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            dec = self._fused_round(gates, decay, margin)
        self._keep_graph((key, g, dec))

    def _swap_plans(self, gates: list[torch.Tensor]) -> list:
        """[(SwapPlan, layer indices tensor or None)] of `row_sets`, built once (rows never move in memory)."""
        from stage_worker.kernels.expert_moves import SwapPlan

        ptrs = tuple(g.data_ptr() for g in gates)
        if self._plans is None or self._plans[0] != ptrs:
            dev = self.counts.device
            self._plans = (ptrs, [(SwapPlan.build(r, dev), idx if idx is None else torch.tensor(idx, device=dev))
                                  for r, idx in self.row_sets(gates)])
        return self._plans[1]


def round_decay(unit: str, half_life: float, interval: int, tokens: int) -> float:
    """A move round's decay of the selection counts: 0.5 ** (interval / half_life) with `expert_move_half_life_unit`
    "steps", 0.5 ** (tokens / half_life) with "tokens" (the decode tokens counted since the last round,
    `expert_table.counted_tokens`: at batch B a round every step decays by 0.5 ** (B / half_life), so a count
    means the same number of tokens at every batch size)."""
    if unit == "tokens":
        return 0.5 ** (tokens / half_life)
    if unit != "steps":
        raise ValueError(f"half-life unit {unit!r}: steps or tokens")
    return 0.5 ** (interval / half_life)


# Spare device slots a table gets with `expert_move_async`: the claim state's spare and reserve (`claim_round`), so
# two by layout. With one, a layer that moved could not claim again until its victim's write-back was committed a
# round later (simulated on the benchmark's trace: 2.12 host reads a token at batch 1 against 1.74 with two; more,
# with one claim a step, changed nothing).
SPARES = 2
# Captured rounds kept (`StageExperts._graph_cache`): one per decay and margin, so a half-life counted in tokens keeps
# one per batch size seen (a round every step) instead of capturing again whenever the batch size changes.
GRAPH_CACHE = 64
HOST_ALIGN = 256      # bytes: each part of each layer starts on this boundary of the host allocation (kernel loads)
# The CUDA VMM allocation granularity of current GPUs (H100/H200: 2 MiB; `vmm_range` asks the driver): a range's
# device part is the hot rows' bytes rounded up to it, its host part the rest's. Used for the estimates made before
# the driver is asked: the free-RAM check and the memory plan (`vmm_round_up`).
VMM_GRANULE = 2 << 20


def _parts(moe) -> dict[str, torch.Tensor]:
    """The [E, ...] tensors a layer's table replaces (meta tensors at build time): w13/w2, the packed words and
    scales of INT4 experts (`SparseMoE.use_packed`), or the float8 bytes (uint8) and float32 block scales of FP8
    experts (`SparseMoE.use_fp8`)."""
    names = PACKED_PARTS if moe.packed_group else FP8_PARTS if moe.fp8_block else PARTS
    return {name: getattr(moe, name) for name in names}


def vmm_round_up(model, cold: dict[int, list[int]] | None, granule: int = VMM_GRANULE, spare: int = 0) -> int:
    """VRAM the VMM ranges of `expert_vmm_table` take beyond the hot rows' bytes, for the memory plan (which counts
    the hot rows as weights): per layer with cold experts and part, its hot rows' bytes rounded up to the
    granularity (less than a granule each). `cold` None (`--cold-experts auto`, not chosen yet): a granule for every
    MoE layer's every part, the worst case. `spare` (SPARES with `expert_move_async`): the device spare rows count with
    the hot rows. `model` may be on the meta device."""
    out = 0
    for layer, moe in model.moe_layers().items():
        if cold is None:
            out += granule * len(_parts(moe))
            continue
        if not cold.get(layer):
            continue
        hot = moe.num_experts - len(cold[layer]) + spare
        for t in _parts(moe).values():
            nbytes = hot * math.prod(t.shape[1:]) * t.element_size()
            out += -(-nbytes // granule) * granule - nbytes
    return out


def _tiered_parts(mine: dict[int, list[int]], layers, E: int, device: torch.device, what: str,
                  spare: int = 0) -> list[tuple[int, str, torch.Tensor, TieredRange]] | None:
    """Every layer's part as one VRAM + host range, under the host lock after checking MemAvailable for their host
    parts (the cold rows' bytes plus a granule each, an upper bound; a host-NUMA allocation is pinned, so taken
    before the lock is released); None, after one warning, where the driver refuses (the caller builds two tables).
    `spare` (0, or 2C: SPARES at one claim a step): spare slots at the end of the device tier."""
    S = E + spare
    specs = [(layer, name, tuple(t.shape[1:]), t.dtype, E - len(ids) + spare)
             for layer, ids in mine.items() for name, t in _parts(layers[layer]).items()]
    host_need = sum((S - hot) * math.prod(shape) * torch.empty((), dtype=dt).element_size() + VMM_GRANULE
                    for _, _, shape, dt, hot in specs)
    built: list[tuple[int, str, torch.Tensor, TieredRange]] = []
    try:
        with host_lock():
            check_free(host_need, what=what)
            for layer, name, shape, dt, hot in specs:
                rows, rng = tiered_rows(S, shape, dt, hot, device)
                built.append((layer, name, rows, rng))
    except VmmUnavailable as exc:
        built.clear()                 # the ranges built so far are freed with their last tensor
        log.warning("expert tables: one VRAM+host range refused (%s): two tables instead", exc)
        return None
    return built


def prefetch_slots(model, slots: int, device: torch.device | str) -> int:
    """The prefetch slots every table of the stage gets (`expert_prefetch`): `slots` on a CUDA stage (its decode
    paths predict and copy: `SparseMoE._prefetch_next`), 0 on the CPU. Every table the same number (the stage-wide
    counts and slot maps have one width); the stage's first MoE layer's go unused (nothing before it predicts it)."""
    return slots if slots > 0 and torch.device(device).type == "cuda" else 0


def attach_tables(model, cold: dict[int, list[int]], device: torch.device | str,
                  vmm: bool = False, spares: bool = False, claims: int = 1,
                  prefetch: int = 0, prefetch_top: int = 0, prefetch_min_batch: int = 1) -> StageExperts | None:
    """Tables for this stage's layers that have cold experts; None when none of them has. Each layer's table holds
    the parts its experts have at build time (compute dtype, INT4 words and scales, or float8 bytes and block
    scales), at their own dtypes and sizes. `vmm` (`expert_vmm_table`): each part one VRAM + host range
    (`vmm_range.tiered_rows`), the table's device and host rows views of it; where the driver refuses, the two
    tables. `spares` (`expert_move_async`): 2C more slots (SPARES at C = 1) at the end of the device tier, the
    router reaching the live slots through a slot map (`StageExperts.slot_map`), and the claim state of moves on
    read. `claims` (C, `expert_move_claims`): claims a layer a step with moves on read, 2C spares a table (C being
    written back, C receiving), state [L, 4C], claim [L, C] ([L] at C = 1). `prefetch` (P, `expert_prefetch`): P
    more device slots at the end of every table's device tier on a GPU (`prefetch_slots`), its `Prefetch` state, and
    the layer before each such table set to predict and copy for it (`SparseMoE.set_prefetch_next`), from each
    token's best `prefetch_top` predicted experts (`expert_prefetch_top`; 0: the layer's top-k), at decode steps of
    at least `prefetch_min_batch` tokens (`expert_prefetch_min_batch`)."""
    layers = model.moe_layers()
    mine = {layer: ids for layer, ids in sorted(cold.items()) if layer in layers and ids}
    if not mine:
        return None
    device = torch.device(device)
    E = next(iter(layers.values())).num_experts
    C = int(claims)
    if C < 1:
        raise ValueError(f"claims a layer a step must be >= 1, not {C}")
    P = prefetch_slots(model, prefetch, device)
    spare = SPARES * C if spares else 0
    S = E + spare + P
    what = f"cold experts of layers {min(mine)}-{max(mine)}"
    dev_parts: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in mine}
    host_parts: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in mine}
    tiered = _tiered_parts(mine, layers, E, device, what, spare + P) if vmm else None
    host = None
    if tiered is not None:
        for layer, name, rows, _ in tiered:
            hot = E - len(mine[layer]) + spare + P
            dev_parts[layer][name], host_parts[layer][name] = rows[:hot], rows[hot:]
    else:
        # the host layout first: one exact-size allocation for every layer's cold rows of every part
        layout: list[tuple[int, str, int, tuple[int, ...], torch.dtype]] = []     # (layer, part, offset, shape, dtype)
        offset = 0
        for layer, ids in mine.items():
            for name, t in _parts(layers[layer]).items():
                offset = -(-offset // HOST_ALIGN) * HOST_ALIGN
                shape = (len(ids), *t.shape[1:])
                layout.append((layer, name, offset, shape, t.dtype))
                offset += math.prod(shape) * t.element_size()
        host = allocate(offset, what=what, pin=device.type == "cuda")
        for layer, name, off, shape, dt in layout:
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            host_parts[layer][name] = host.tensor[off:off + n].view(dt).view(shape)
        for layer, ids in mine.items():
            dev_parts[layer] = {name: torch.empty(E - len(ids) + spare + P, *t.shape[1:], dtype=t.dtype,
                                                  device=device)
                                for name, t in _parts(layers[layer]).items()}
    n = len(mine)
    counts = torch.zeros(n, S, dtype=torch.float32, device=device)
    reads = torch.zeros(n, dtype=torch.int64, device=device)
    moves = torch.zeros(n, dtype=torch.int64, device=device)
    # slot -> expert at load: the hot experts, then the cold ones, each ascending (with spares and prefetch slots:
    # -1 after the hot, spares first)
    orders = [tuple([e for e in range(E) if e not in set(ids)] + [-1] * (spare + P) + sorted(ids))
              for ids in mine.values()]
    expert_of_slot = torch.tensor(orders, dtype=torch.int32, device=device)
    slot_map = state = claim = threshold = None
    if spares or P:
        # router index (== expert id: the router rows stay in expert order) -> slot
        slot_map = torch.tensor([sorted(range(S), key=lambda s: (o[s] < 0, o[s]))[:E] for o in orders],
                                dtype=torch.int32, device=device)
    if spares:
        # (spare, reserve, victim, its host slot): the two slots after the live device ones
        state = torch.tensor([[E - len(ids) + s for s in range(spare)] + [-1] * (2 * C) for ids in mine.values()],
                             dtype=torch.int64, device=device)
        claim = torch.full((n,) if C == 1 else (n, C), -1, dtype=torch.int32, device=device)
        threshold = torch.full((n,), float("inf"), dtype=torch.float32, device=device)   # the first round sets it
    pf_issued = pf_hits = None
    if P:
        pf_issued = torch.zeros(n, dtype=torch.int64, device=device)
        pf_hits = torch.zeros(n, dtype=torch.int64, device=device)
    tables: dict[int, ExpertTable] = {}
    for i, (layer, ids) in enumerate(mine.items()):
        moe = layers[layer]
        pf = None
        if P:
            pf = Prefetch.allocate(P, E - len(ids) + spare, E, moe.top_k, PREFETCH_MAX_T, moe.gate.weight.dtype,
                                   device, issued=pf_issued[i:i + 1], hits=pf_hits[i:i + 1], top=prefetch_top,
                                   min_tokens=prefetch_min_batch)
        table = ExpertTable(
            dev=dev_parts[layer], host=host_parts[layer],
            expert_of_slot=expert_of_slot[i], counts=counts[i], host_reads=reads[i:i + 1], moves=moves[i:i + 1],
            initial=orders[i], groups=(moe.packed_group, moe.packed_group2) if moe.packed_group else None,
            fp4=moe.packed_fp4, fp8_block=moe.fp8_block, slot_map=None if slot_map is None else slot_map[i],
            claim=None if claim is None else claim[i:i + 1] if C == 1 else claim[i],
            threshold=None if threshold is None else threshold[i:i + 1],
            spare=None if state is None else state[i, :C], prefetch=pf)
        moe.use_table(table)
        tables[layer] = table
    hot = torch.tensor([E - len(ids) + spare + P for ids in mine.values()], dtype=torch.int64, device=device)
    if P:
        # each MoE layer predicts and copies for the next one of the stage that has a table (`_prefetch_next`)
        order = sorted(layers)
        for a, b in zip(order, order[1:]):
            layers[a].set_prefetch_next(layers[b] if b in tables else None)
    return StageExperts(tables=tables, counts=counts, expert_of_slot=expert_of_slot, hot=hot, host_reads=reads,
                        moves=moves, host=host, ranges=[(rows, rng) for _, _, rows, rng in tiered or ()],
                        slot_map=slot_map, state=state, claim=claim, threshold=threshold,
                        prefetch_issued=pf_issued, prefetch_hits=pf_hits)


def gates(model) -> list[torch.Tensor]:
    """The router weights of the layers with tables, in `StageExperts.tables` order."""
    layers = model.moe_layers()
    return [layers[layer].gate.weight for layer in model.experts.tables]


def loader_targets(model) -> dict[str, ExpertRows]:
    """`layers.N.mlp.w13` / `.w2` -> the table standing in for that parameter, for layers that have one (INT4
    and float8 tables are filled by `checkpoint.packed_experts.PackedPlacer`, which writes each expert's part into its
    slot)."""
    out = {}
    for layer, moe in model.moe_layers().items():
        if moe.table is not None and moe.table.parts == PARTS:
            out[f"layers.{layer}.mlp.w13"] = ExpertRows(moe.table, "w13")
            out[f"layers.{layer}.mlp.w2"] = ExpertRows(moe.table, "w2")
    return out


@torch.no_grad()
def fill_random_tables(model, seed: int) -> None:
    """The `dummy` load format for tables: each part's whole [E, ...] tensor made as `random_init.fill_random`
    makes the parameter or buffer it replaces (same name, seed and device), then scattered into the slots, so a
    table holds the all-in-VRAM model's rows."""
    from stage_worker.checkpoint.random_init import random_packed_part, random_param

    for layer, moe in model.moe_layers().items():
        t = moe.table
        if t is None:
            continue
        for kind in t.parts:
            name, shape, dt = f"layers.{layer}.mlp.{kind}", t.full_shape(kind), t.dev[kind].dtype
            full = random_param(name, shape, seed, dt, t.device) if kind in PARTS else \
                random_packed_part(name, shape, seed, dt, t.device)
            ExpertRows(t, kind).copy_(full)
            del full


@torch.no_grad()
def order_gates(model) -> None:
    """After loading: every table's router rows into slot order (the fused router, once built, is a view of them
    too, so this runs before `prepare_kernels`)."""
    for moe in model.moe_layers().values():
        if moe.table is not None:
            moe.table.order_gate(moe.gate.weight)
