"""shared/protocol.py: tensor frames round-trip bit for bit, a dtype the wire does not carry is refused by name, and
the gateway, which handles no tensor message, starts without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.protocol import Activations, ProtocolError, decode, encode

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_activations_round_trip_bit_for_bit(dtype):
    hidden = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    msg = Activations(step=7, hidden=hidden, token_ids=torch.tensor([1, 2, 3]))
    back = decode([bytes(f) for f in encode(msg)])
    assert back.step == 7 and back.hidden.dtype == dtype and torch.equal(back.hidden, hidden)
    assert torch.equal(back.token_ids, msg.token_ids)
    empty = decode(encode(Activations(step=1, hidden=torch.empty(0, 5, dtype=dtype),
                                      token_ids=torch.empty(0, dtype=torch.int64))))
    assert empty.hidden.shape == (0, 5) and empty.hidden.dtype == dtype


def test_a_dtype_the_wire_does_not_carry_is_refused_by_name():
    with pytest.raises(ProtocolError, match="a float64 tensor cannot be sent"):
        encode(Activations(step=1, hidden=torch.zeros(2, dtype=torch.float64), token_ids=torch.zeros(2)))


def test_the_gateway_starts_without_torch():
    code = ("import sys; import gateway.main, gateway.engine, gateway.cluster_executor, gateway.api; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
