"""Give a stage's MoE layers expert tables with their cold experts in host RAM (issue 16): one exact-size pinned
allocation for all of the stage's host rows, device tables for the rest, counters for moves and /metrics.

Called by the loader on the meta-device model, before anything is allocated on the device: the routed experts'
[E, ...] parameters are replaced by tables (`SparseMoE.use_table`), so neither the device nor the host ever holds
an expert twice (the reports' first offload loaded everything, then copied the cold rows out: 000 §5).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from stage_worker.host_memory import HostBuffer, allocate
from stage_worker.kernels.expert_moves_ref import RowSet, settle_ref, swap_rows_ref
from stage_worker.model.expert_table import FP8_PARTS, PACKED_PARTS, PARTS, ExpertRows, ExpertTable


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
    host: HostBuffer | None
    _plans: tuple | None = None   # (router data_ptrs, [(SwapPlan, layer indices)]) of the last move round
    _copy: tuple | None = None    # (pinned [2, L] host tensor, event) of the counters' last read-back
    _last: tuple[list[int], list[int]] | None = None   # host reads and moves per layer, as last read back
    _async: "_Async | None" = None   # asynchronous moves, when started (`start_async`)

    @property
    def layers(self) -> list[int]:
        return list(self.tables)

    def host_bytes(self) -> int:
        """Routed-expert bytes in host RAM (packed experts at their packed size)."""
        return sum(t.host_bytes() for t in self.tables.values())

    def device_bytes(self) -> int:
        """Routed-expert bytes in the device slots of the layers with tables."""
        return sum(t.device_bytes() for t in self.tables.values())

    def snapshot(self) -> None:
        """Queue a copy of the host-read and move counters to the host, and keep the previous copy's values once it
        has landed; called from the runner's thread between steps (nothing waits, nothing runs during a capture)."""
        if self.counts.device.type != "cuda":
            self._last = (self.host_reads.tolist(), self.moves.tolist())
            return
        if self._copy is None:
            self._copy = (torch.empty(2, len(self.tables), dtype=torch.int64, pin_memory=True), None)
        buf, event = self._copy
        if event is not None:
            if not event.query():
                return                                   # the previous copy is still on its way
            self._last = (buf[0].tolist(), buf[1].tolist())
        buf[0].copy_(self.host_reads, non_blocking=True)
        buf[1].copy_(self.moves, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copy = (buf, event)

    def stats(self) -> dict[str, float]:
        """For the heartbeat (/metrics): bytes by tier, and per layer the host reads and moves last read back."""
        out = {"expert_bytes_vram": float(self.device_bytes()), "expert_bytes_host": float(self.host_bytes())}
        if self._last is not None:
            for layer, reads, moves in zip(self.tables, *self._last):
                out[f"expert_host_reads:{layer}"] = float(reads)
                out[f"expert_moves:{layer}"] = float(moves)
        return out

    def row_sets(self, gates: list[torch.Tensor]) -> list[tuple[RowSet, list[int] | None]]:
        """What a move swaps, one RowSet per kind of row (a part with one row shape and dtype: w13, w2, or INT4
        words and scales of each, or float8 bytes and block scales of each; then the router rows), each with the indices of the layers it covers (None:
        all, in `tables` order) so a stage whose layers hold different parts still swaps each in one launch."""
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
        out.append((RowSet(gates, gates, [t.num_experts for t in ts]), None))
        return out

    @torch.no_grad()
    def move_round(self, gates: list[torch.Tensor], decay: float, margin: float) -> torch.Tensor:
        """Decay the counts and swap, per layer, the most used host slot with the least used device slot if it
        beats it by `margin` (rows, router rows, counts, slot map); `gates` are the layers' router weights [E, H]
        (slot order). Queued on the current stream; nothing waits. Returns the decisions [L, 3]. The in-stream
        path (`expert_moves_async` off); `start_async` runs the same round one layer at a time off the critical
        path."""
        from stage_worker.kernels.expert_moves import decide, swap_rows, swap_usable   # Triton: lazily

        dec = decide(self.counts, self.hot, decay, margin)
        if swap_usable(self.counts):
            for plan, idx in self._swap_plans(gates):
                swap_rows(plan, dec if idx is None else dec.index_select(0, idx))
        else:
            for r, idx in self.row_sets(gates):
                swap_rows_ref(r, dec if idx is None else dec[idx])
        settle_ref(self.counts, self.expert_of_slot, self.moves, dec)
        return dec

    def _swap_plans(self, gates: list[torch.Tensor]) -> list:
        """[(SwapPlan, layer indices tensor or None)] of `row_sets`, built once (rows never move in memory)."""
        from stage_worker.kernels.expert_moves import SwapPlan

        ptrs = tuple(g.data_ptr() for g in gates)
        if self._plans is None or self._plans[0] != ptrs:
            dev = self.counts.device
            self._plans = (ptrs, [(SwapPlan.build(r, dev), idx if idx is None else torch.tensor(idx, device=dev))
                                  for r, idx in self.row_sets(gates)])
        return self._plans[1]

    # -- asynchronous moves (`expert_moves_async`) -------------------------------------------------------------
    #
    # The same round as `move_round`, one layer at a time, in that layer's quiet window: after its MoE ran in one
    # step and before its router runs in the next, nothing reads its rows, router rows, counts or slot map (only
    # its own router kernel writes its counts), so its move can run on a side stream while other layers compute.
    # Position p of L tables (forward order) takes the longer of two windows, both inside one forward (so a CUDA
    # graph holds each fork and its join): "tail" (p < (L-1)/2): forked after its own MoE, joined after the last
    # table layer's MoE, overlapping layers p+1..L-1; "head": forked before the first table layer's router of the
    # next step, joined before its own router, overlapping layers 0..p-1. Forks and joins are forward hooks on the
    # layers' SparseMoE modules. Each layer's round sees exactly the counts `move_round` between the two steps
    # would see (nothing else writes them in the window), so decisions, rows and tokens are the in-stream path's,
    # bit for bit. Whether a step has a round sits on the device (`armed`: tail, head), so graphs replay it;
    # `arm` sets it before each launch. On the CPU the side stream is modelled as deferred work: a layer's round
    # runs at its join, and a layer whose round is in flight must not run (it raises).

    def start_async(self, model, gates: list[torch.Tensor], decay: float, margin: float,
                    kernels: bool | None = None) -> bool:
        """Hook the asynchronous moves onto the model's table layers; False (nothing hooked) where the kernels
        cannot run on these tables (a CUDA stage without Triton: use `move_round`). `kernels`: the Triton launches
        (default: on CUDA tables; tests run them on the CPU under the interpreter), else the PyTorch reference."""
        from stage_worker.kernels.expert_moves import swap_usable

        cuda = self.counts.device.type == "cuda"
        if cuda and not swap_usable(self.counts):
            return False
        kernels = cuda if kernels is None else kernels
        self.stop_async()
        layers = model.moe_layers()
        n = len(self.tables)
        dev = self.counts.device
        a = _Async(gates=list(gates), decay=decay, margin=margin,
                   armed=torch.zeros(2, dtype=torch.int32, device=dev),
                   dec=torch.zeros(n, 3, dtype=torch.int64, device=dev),
                   tail=[p for p in range(n) if n - 1 - p > p], hot=[t.hot for t in self.tables.values()],
                   kernels=kernels)
        if cuda:
            a.side = torch.cuda.Stream(dev)
            a.done = [torch.cuda.Event() for _ in range(n)]
        if kernels:
            a.plans = [[(plan.layer(k), k) for plan, idx in self._swap_plans(gates)
                        for k in ([p] if idx is None else [i for i, q in enumerate(idx.tolist()) if q == p])]
                       for p in range(n)]
        for p, layer in enumerate(self.tables):
            a.handles.append(layers[layer].register_forward_pre_hook(lambda m, args, p=p: self._before(p)))
            a.handles.append(layers[layer].register_forward_hook(lambda m, args, out, p=p: self._after(p)))
        self._async = a
        return True

    def stop_async(self) -> None:
        """Remove the hooks (after joining anything in flight); `move_round` works again."""
        a = self._async
        if a is None:
            return
        for p in list(a.inflight):
            self._join(p)
        for h in a.handles:
            h.remove()
        self._async = None

    @property
    def async_moves(self) -> bool:
        return self._async is not None

    def set_policy(self, decay: float, margin: float) -> None:
        """Change the asynchronous round's decay and margin (taken when a layer's round is launched: CUDA graphs
        captured before keep the old values)."""
        self._async.decay, self._async.margin = decay, margin

    @torch.no_grad()
    def arm(self, tail: bool, head: bool) -> None:
        """Before each launch: whether the rounds of this step run (tail layers: the round after this step;
        head layers: the round before it; with interval K and launch n, tail = (n + 1) % K == 0, head =
        n % K == 0). Writes the device flags only when they change. The first call with `head` also runs the
        tail layers' round before this step, in-stream (their round before the first step, which no earlier step
        forked), so the sequence of rounds is `move_round`'s."""
        a = self._async
        self._set_flags((bool(tail), bool(head)))
        if not a.started:
            a.started = True
            if head:
                for p in a.tail:
                    self._round(p, 1)

    def _set_flags(self, want: tuple[bool, bool]) -> None:
        a = self._async
        if a.flags != want:
            for k, v in enumerate(want):
                if a.flags is None or a.flags[k] != v:
                    a.armed[k].fill_(int(v))
            a.flags = want

    @contextmanager
    def hold_moves(self):
        """No rounds while inside (a CUDA graph's warm-up runs and capture: warm-ups would otherwise run rounds the
        in-stream path never runs); the flags are restored after. A no-op without asynchronous moves."""
        a = self._async
        if a is None or a.flags is None or a.flags == (False, False):
            yield
            return
        saved = a.flags
        self._set_flags((False, False))
        try:
            yield
        finally:
            self._set_flags(saved)

    def _round(self, p: int, flag: int) -> None:
        """Layer position p's round, on the current stream, if armed[flag] (tail: 0, head: 1)."""
        a = self._async
        armed = a.armed[flag:flag + 1]
        if a.kernels:
            from stage_worker.kernels.expert_moves import decide_layer, swap_rows

            decide_layer(self.counts[p], self.expert_of_slot[p], self.moves[p:p + 1], a.dec[p], armed, a.hot[p],
                         a.decay, a.margin)
            for plan, _ in a.plans[p]:
                swap_rows(plan, a.dec[p:p + 1])
            return
        from stage_worker.kernels.expert_moves import decide

        if not int(armed[0]):
            return
        dec = decide(self.counts[p:p + 1], self.hot[p:p + 1], a.decay, a.margin)
        a.dec[p:p + 1].copy_(dec)
        for r, idx in self.row_sets(a.gates):
            if idx is None or p in idx:
                k = p if idx is None else idx.index(p)
                swap_rows_ref(RowSet([r.dev[k]], [r.host[k]], [r.split[k]]), dec)
        settle_ref(self.counts[p:p + 1], self.expert_of_slot[p:p + 1], self.moves[p:p + 1], dec)

    def _fork(self, p: int) -> None:
        a = self._async
        flag = 0 if p in a.tail else 1
        if a.side is None:
            a.inflight[p] = flag                    # the CPU's side stream: deferred to the join
            return
        main = torch.cuda.current_stream(self.counts.device)
        a.side.wait_stream(main)
        with torch.cuda.stream(a.side):
            self._round(p, flag)
        a.done[p].record(a.side)
        a.inflight[p] = flag

    def _join(self, p: int) -> None:
        a = self._async
        flag = a.inflight.pop(p)
        if a.side is None:
            self._round(p, flag)
        else:
            torch.cuda.current_stream(self.counts.device).wait_event(a.done[p])

    def _before(self, p: int) -> None:
        """Pre-forward hook of table position p: at the first, join anything left over (a forward that stopped
        early) and fork the head layers' rounds; join p's own round if it is a head layer."""
        a = self._async
        if p == 0:
            for q in list(a.inflight):
                self._join(q)
            for q in range(len(a.hot)):
                if q not in a.tail:
                    self._fork(q)
        if p in a.inflight and p not in a.tail:
            self._join(p)
        if p in a.inflight:
            raise RuntimeError(f"expert moves: table layer {p} runs while its move is in flight")

    def _after(self, p: int) -> None:
        """Forward hook of table position p: fork its round if it is a tail layer; after the last, join them."""
        a = self._async
        if p in a.tail:
            self._fork(p)
        if p == len(a.hot) - 1:
            for q in a.tail:
                if q in a.inflight:
                    self._join(q)


@dataclass
class _Async:
    """State of the asynchronous moves (`StageExperts.start_async`)."""
    gates: list
    decay: float
    margin: float
    armed: torch.Tensor                 # int32 [2] on the device: this step's (tail, head) rounds run
    dec: torch.Tensor                   # int64 [L, 3]: each layer's last decision
    tail: list[int]                     # table positions with the tail window
    hot: list[int]                      # device slots per position
    kernels: bool = True                # Triton launches (else the PyTorch reference, which reads `armed` back)
    side: torch.cuda.Stream | None = None
    done: list | None = None            # an event per position: its round's work on the side stream
    plans: list | None = None           # per position: [(its one-layer SwapPlan, its index)] per kind of row
    inflight: dict = field(default_factory=dict)   # position -> flag of its forked, not yet joined round
    handles: list = field(default_factory=list)
    flags: tuple | None = None
    started: bool = False


HOST_ALIGN = 256      # bytes: each part of each layer starts on this boundary of the host allocation (kernel loads)


def _parts(moe) -> dict[str, torch.Tensor]:
    """The [E, ...] tensors a layer's table replaces (meta tensors at build time): w13/w2, the packed words and
    scales of INT4 experts (`SparseMoE.use_packed`), or the float8 bytes (uint8) and float32 block scales of FP8
    experts (`SparseMoE.use_fp8`)."""
    names = PACKED_PARTS if moe.packed_group else FP8_PARTS if moe.fp8_block else PARTS
    return {name: getattr(moe, name) for name in names}


def attach_tables(model, cold: dict[int, list[int]], device: torch.device | str) -> StageExperts | None:
    """Tables for this stage's layers that have cold experts; None when none of them has. Each layer's table holds
    the parts its experts have at build time (compute dtype, INT4 words and scales, or float8 bytes and block
    scales), at their own dtypes and sizes."""
    layers = model.moe_layers()
    mine = {layer: ids for layer, ids in sorted(cold.items()) if layer in layers and ids}
    if not mine:
        return None
    device = torch.device(device)
    E = next(iter(layers.values())).num_experts
    # the host layout first: one exact-size allocation for every layer's cold rows of every part
    layout: list[tuple[int, str, int, tuple[int, ...], torch.dtype]] = []     # (layer, part, offset, shape, dtype)
    offset = 0
    for layer, ids in mine.items():
        for name, t in _parts(layers[layer]).items():
            offset = -(-offset // HOST_ALIGN) * HOST_ALIGN
            shape = (len(ids), *t.shape[1:])
            layout.append((layer, name, offset, shape, t.dtype))
            offset += math.prod(shape) * t.element_size()
    host = allocate(offset, what=f"cold experts of layers {min(mine)}-{max(mine)}", pin=device.type == "cuda")
    host_parts: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in mine}
    for layer, name, off, shape, dt in layout:
        n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        host_parts[layer][name] = host.tensor[off:off + n].view(dt).view(shape)
    n = len(mine)
    counts = torch.zeros(n, E, dtype=torch.float32, device=device)
    reads = torch.zeros(n, dtype=torch.int64, device=device)
    moves = torch.zeros(n, dtype=torch.int64, device=device)
    orders = [tuple([e for e in range(E) if e not in set(ids)] + sorted(ids)) for ids in mine.values()]
    expert_of_slot = torch.tensor(orders, dtype=torch.int32, device=device)
    tables: dict[int, ExpertTable] = {}
    for i, (layer, ids) in enumerate(mine.items()):
        moe = layers[layer]
        hot = E - len(ids)
        dev = {name: torch.empty(hot, *t.shape[1:], dtype=t.dtype, device=device)
               for name, t in _parts(moe).items()}
        table = ExpertTable(
            dev=dev, host=host_parts[layer],
            expert_of_slot=expert_of_slot[i], counts=counts[i], host_reads=reads[i:i + 1], moves=moves[i:i + 1],
            initial=orders[i], groups=(moe.packed_group, moe.packed_group2) if moe.packed_group else None,
            fp8_block=moe.fp8_block)
        moe.use_table(table)
        tables[layer] = table
    hot = torch.tensor([E - len(ids) for ids in mine.values()], dtype=torch.int64, device=device)
    return StageExperts(tables=tables, counts=counts, expert_of_slot=expert_of_slot, hot=hot, host_reads=reads,
                        moves=moves, host=host)


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
