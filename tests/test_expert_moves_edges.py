"""Run-time expert moves where a layer has no device slot (every expert of it in host RAM: a `moepipe cold-set`
file or budget can choose that) or no host slot: such a layer never moves, and the swap kernel's plan builds
around its empty device part. Before, `decide` could pick "device slot 0" of an all-cold layer (a host row) and
`SwapPlan.build` took layer 0's device part, empty there, as its anchor (IndexError on the GPU path)."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import RowSet, swap_rows_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
E, ROW = 4, (3, 8)


def test_layers_without_device_or_host_slots_never_move():
    counts = torch.tensor([[0.0, 9.0, 1.0, 9.0],       # hot 0: would pick slots 0 and 1 (both host rows)
                           [0.0, 0.0, 9.0, 0.0],       # hot 2: slot 2 (host) beats slot 0 (device)
                           [9.0, 0.0, 0.0, 0.0]], device=DEV)   # hot 4: no host slot
    dec = M.decide(counts, torch.tensor([0, 2, 4], device=DEV), decay=1.0, margin=0.5)
    assert dec[:, 2].tolist() == [0, 1, 0]
    assert dec[1, :2].tolist() == [0, 2]


def test_swap_plan_builds_around_an_empty_device_part():
    g = torch.Generator().manual_seed(0)
    hots = [0, 2]
    dev = [torch.randn(h, *ROW, generator=g).to(DEV) for h in hots]
    host = [torch.randn(E - h, *ROW, generator=g).to(DEV) for h in hots]
    rows = RowSet(dev, host, hots)
    dec = M.decide(torch.tensor([[0.0, 9.0, 1.0, 9.0], [0.0, 0.0, 9.0, 0.0]], device=DEV),
                   torch.tensor(hots, device=DEV), decay=1.0, margin=0.5)
    want = RowSet([t.clone() for t in dev], [t.clone() for t in host], hots)
    swap_rows_ref(want, dec)
    M.swap_rows(M.SwapPlan.build(rows, torch.device(DEV)), dec, block=16)
    for a, b in zip(rows.dev + rows.host, want.dev + want.host):
        assert torch.equal(a.cpu(), b.cpu())
