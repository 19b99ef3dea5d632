"""bench/expert_moves_batch.py's clairvoyant floor (`oracle_reads`) on traces whose answers are known."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import expert_cache_sim as sim  # noqa: E402
import expert_moves_batch as emb  # noqa: E402


def test_the_oracle_reads_nothing_when_the_working_set_fits_and_everything_when_vram_holds_nothing():
    rng = np.random.default_rng(1)
    ids = np.stack([np.stack([rng.choice(6, 2, replace=False) for _ in range(2)]) for _ in range(100)])  # E 6, k 2
    assert emb.oracle_reads(ids, 16, np.array([6, 6])) == 0.0
    assert emb.oracle_reads(ids, 16, np.array([0, 0])) == 4.0


def test_the_oracle_on_a_cycle_one_larger_than_vram_and_under_the_servers_policy():
    """k = 1 over a cycle of 3 experts with room for 2: furthest-next-use keeps the first two and reads the third
    from host each time round (one selection in three; LRU would read all); and it is a floor for moves on read."""
    ids = np.array([[[t % 3]] for t in range(302)])
    assert round(emb.oracle_reads(ids, 4, np.array([2])) * 302) == 100
    L, E, k, T = 3, 16, 2, 400
    rng = np.random.default_rng(2)
    weights = rng.dirichlet(np.full(E, 0.3), size=L)
    ids = np.stack([np.stack([rng.choice(E, k, replace=False, p=weights[layer]) for layer in range(L)])
                    for _ in range(T)])
    resident = np.ones((L, E), dtype=bool)
    resident[:, :4] = False
    r = sim._replay_claims(ids, E, resident, sim.Policy("c", "swap", half_life=16.0, every=1, margin=0.5))
    assert emb.oracle_reads(ids, E, resident.sum(1) + 2) <= r["reads_per_step"]
