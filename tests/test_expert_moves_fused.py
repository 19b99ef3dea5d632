"""The fused move round (`expert_move_fused`): `expert_moves.decide_settle` (decision and bookkeeping in one launch)
and the swap kernel reading its layers' decisions through an index give bit for bit what `decide` + `swap_rows`
(with `index_select`) + `settle_ref` give: counts, slot map, move counters, decisions and every kind of row, over
several rounds in a row, with ties among device and among host slots, a layer with no device slot, one with no host
slot, and a host slot that leads by exactly the margin (no move).

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py), rows a few elements each.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from stage_worker.expert_offload import StageExperts  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import settle_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DECAY = 0.5 ** (1 / 128)         # the server's default policy: not a power of two, so the fp32 multiply is tested


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Float tensors as their bit patterns (torch.equal would take -0.0 for 0.0)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.element_size() == 2 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a).cpu(), _bits(b).cpu())


def _planted_counts(E: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [6, E] and hot [6]: small integers (ties everywhere) and planted rows."""
    counts = torch.randint(0, 4, (6, E), generator=g).float()
    hot = torch.tensor([0, E, E // 2, E - 3, 3, E // 3])
    counts[2] = 2.0                                   # all tied: device and host ties, nothing leads
    counts[3, : E - 3] = 1.0                          # ... every device slot 1.0, the host slots 2.0: after a decay of
    counts[3, E - 3:] = 2.0                           # 0.5, 1.0 > 0.5 + 0.5 is false (a lead of exactly the margin)
    counts[4, :3] = torch.tensor([5.0, 0.0, 0.0])     # two device slots tie for the least used
    counts[4, 3:] = 0.0
    counts[4, [E - 1, 4]] = 9.0                       # two host slots tie for the most used: the lower (4) moves
    return counts.to(DEV), hot.to(DEV)


@pytest.mark.parametrize("E", [12, 512])
def test_decide_settle_equals_decide_then_settle(E):
    g = torch.Generator().manual_seed(E)
    counts, hot = _planted_counts(E, g)
    slot_map = torch.stack([torch.randperm(E, generator=g) for _ in range(6)]).to(DEV, torch.int32)
    moves = torch.randint(0, 5, (6,), generator=g).to(DEV)
    want = [counts.clone(), slot_map.clone(), moves.clone()]
    rounds = [(0.5, 0.5)] + [(DECAY, 0.5), (0.8, 0.0), (DECAY, 2.0)] * (2 if E < 64 else 1)
    for r, (decay, margin) in enumerate(rounds):
        dec_ref = M.decide(want[0], hot, decay, margin)
        settle_ref(*want, dec_ref)
        dec = M.decide_settle(counts, hot, slot_map, moves, decay, margin)
        assert _same(dec, dec_ref), (r, dec.tolist(), dec_ref.tolist())
        for got, ref in zip((counts, slot_map, moves), want):
            assert _same(got, ref), r
        if r == 0:
            assert dec[:, 2].tolist() == [0, 0, 0, 0, 1, dec_ref[5, 2].item()]   # the planted layers
            assert dec[4, :2].tolist() == [1, 4] and dec[2, :2].tolist() == [0, E // 2]
            assert dec[0, 0].item() == 0 and dec[1, 1].item() == 0              # no device / no host slot
        # new selections: integers (more ties) or fractions, on a few slots
        add = torch.randint(0, 3, (6, E), generator=g).float() if r % 2 else torch.rand(6, E, generator=g) * 3
        add[torch.rand(6, E, generator=g) < 0.5] = 0
        counts.add_(add.to(DEV))
        want[0].add_(add.to(DEV))
    assert moves.sum().item() > 0


def _stage(g: torch.Generator, E: int = 12) -> tuple[StageExperts, list[torch.Tensor]]:
    """A stage of five layers (hot 0, E, 5, 9, 3) whose tables hold two sets of parts: layers 0, 2, 4 a float32
    `w13` row, layers 1, 3 int32 `q13` and float16 `s13` rows (kinds that cover only some layers: the indexed
    path), every layer's router rows; tiny rows. Tables are stand-ins with what `row_sets` reads."""
    hots = [0, E, 5, 9, 3]
    shapes = {"w13": ((2, 3), torch.float32), "q13": ((5,), torch.int32), "s13": ((2,), torch.float16)}
    tables = {}
    for layer, hot in enumerate(hots):
        parts = ["w13"] if layer % 2 == 0 else ["q13", "s13"]

        def rows(n, part):
            shape, dt = shapes[part]
            if dt == torch.int32:
                return torch.randint(-2 ** 31, 2 ** 31 - 1, (n, *shape), generator=g, dtype=torch.int32).to(DEV)
            return torch.randn(n, *shape, generator=g).to(DEV, dt)

        tables[10 + layer] = SimpleNamespace(parts=parts, hot=hot, num_experts=E,
                                             dev={p: rows(hot, p) for p in parts},
                                             host={p: rows(E - hot, p) for p in parts})
    L = len(hots)
    counts = torch.randint(0, 4, (L, E), generator=g).float()
    counts[3, :9], counts[3, 9:] = 1.0, 2.0           # a lead of exactly the margin after the first decay: no move
    x = StageExperts(tables=tables, counts=counts.to(DEV),
                     expert_of_slot=torch.stack([torch.randperm(E, generator=g) for _ in hots]).to(DEV, torch.int32),
                     hot=torch.tensor(hots, device=DEV), host_reads=torch.zeros(L, dtype=torch.int64, device=DEV),
                     moves=torch.zeros(L, dtype=torch.int64, device=DEV), host=None)
    gates = [torch.randn(E, 4, generator=g).to(DEV) for _ in hots]
    return x, gates


def _state(x: StageExperts, gates: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [x.counts, x.expert_of_slot, x.moves, *gates]
    for t in x.tables.values():
        for p in t.parts:
            out += [t.dev[p], t.host[p]]
    return [a.clone() for a in out]


def test_fused_move_round_equals_the_round(monkeypatch):
    """`StageExperts.move_round(fused=True)` against the round as it was, on two copies of one stage (the swap kernel
    on both: `swap_usable` forced on for CPU tensors), eight rounds."""
    monkeypatch.setattr(M, "swap_usable", lambda t: True)
    runs = {}
    for fused in (False, True):
        g = torch.Generator().manual_seed(5)
        x, gates = _stage(g)
        kinds = {idx is None for _, idx in x.row_sets(gates)}
        assert kinds == {True, False}                  # some kinds cover only some layers
        decs, states = [], []
        for r in range(8):
            decay, margin = (0.5, 0.5) if r == 0 else (DECAY, 0.5) if r % 2 else (0.8, 0.0)
            decs.append(x.move_round(gates, decay, margin, fused=fused))
            states.append(_state(x, gates))
            x.counts.add_((torch.rand(x.counts.shape, generator=g) * 3).to(DEV))
        runs[fused] = (torch.stack(decs), states, x)
    (dec0, states0, x0), (dec1, states1, x1) = runs[False], runs[True]
    assert _same(dec1, dec0)
    assert dec0[0, 3, 2].item() == 0 and dec0[:, 0, 2].sum().item() == 0 and dec0[:, 1, 2].sum().item() == 0
    assert x0.moves.sum().item() >= 8
    for r, (a, b) in enumerate(zip(states0, states1)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert _same(v, u), (r, i)
    # the plans (and their layer indices) are built once, on the first round
    assert x1._plans is not None and all(idx is None or idx.dtype == torch.int64 for _, idx in x1._plans[1])


@pytest.mark.parametrize("key,default", [("expert_move_fused", True), ("expert_move_graph", True),
                                         ("expert_move_async", True)])
def test_the_move_switches_are_cluster_keys(monkeypatch, key, default):
    """Each way of running a move round has its off switch: a cluster key with its default, and MOEPIPE_<KEY>."""
    from shared import cluster_config as cc

    assert cc.ClusterConfig.__dataclass_fields__[key].default is default
    monkeypatch.setenv(f"MOEPIPE_{key.upper()}", "0" if default else "1")
    assert cc.env_overrides()[key] is (not default)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_graphed_move_round_equals_the_fused_round():
    """`move_round(fused=True, graph=True)` (`expert_move_graph`): the first round with given arguments runs eagerly
    and captures, later ones replay; against the eager fused round on a copy of the stage, twelve rounds, the
    policy changed once in the middle (a new capture). Decisions, counts, slot map, move counters and every row
    equal bit for bit."""
    policy = [(DECAY, 0.5)] * 6 + [(0.8, 0.0)] * 6
    runs = {}
    for graph in (False, True):
        g = torch.Generator().manual_seed(7)
        x, gates = _stage(g)
        decs, states = [], []
        for decay, margin in policy:
            decs.append(x.move_round(gates, decay, margin, fused=True, graph=graph).clone())
            states.append(_state(x, gates))
            x.counts.add_((torch.rand(x.counts.shape, generator=g) * 3).to(DEV))
        runs[graph] = (torch.stack(decs), states, x)
    (dec0, states0, _), (dec1, states1, x1) = runs[False], runs[True]
    assert _same(dec1, dec0) and dec0[:, :, 2].sum().item() >= 6
    for r, (a, b) in enumerate(zip(states0, states1)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert _same(v, u), (r, i)
    assert x1._graph is not None and x1._graph[0][1:] == (0.8, 0.0)
