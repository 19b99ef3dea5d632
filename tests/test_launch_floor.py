"""bench/launch_floor.py's probe kernel (issue 17's launch yardstick) under the interpreter: it must read every word
it is timed for, each program its own tiles, and chain through the word the previous launch wrote."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import launch_floor as lf  # noqa: E402


@pytest.mark.parametrize("words,programs", [(0, 3), (100, 4), (lf.TILE * 5 + 17, 2), (lf.TILE * 7, 7)])
def test_probe_reads_every_word_of_its_tiles(words, programs):
    g = torch.Generator().manual_seed(words + programs)
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, generator=g)
    prev = torch.randint(-2 ** 31, 2 ** 31 - 1, (programs,), dtype=torch.int32, generator=g)
    out = torch.zeros(programs, dtype=torch.int32)
    lf.probe(w, prev, out, programs)
    assert torch.equal(out, lf.probe_ref(w, prev, programs))
    if words:                                   # one flipped bit anywhere changes exactly its program's word
        i = words - 1
        w2 = w.clone()
        w2[i] ^= 1
        out2 = torch.zeros_like(out)
        lf.probe(w2, prev, out2, programs)
        owner = (i // lf.TILE) % programs
        assert (out2 != out).nonzero().flatten().tolist() == [owner]


def test_the_fit_recovers_floor_and_bandwidth():
    rows = [{"bytes": b, "t": 2.0 + b / 3e9 * 1e6} for b in (2 ** 20, 2 ** 22, 2 ** 24, 2 ** 25)]
    floor, bw = lf.fit(rows + [{"bytes": 0, "t": 99.0}], "t")
    assert floor == pytest.approx(2.0) and bw == pytest.approx(3.0, rel=1e-6)
