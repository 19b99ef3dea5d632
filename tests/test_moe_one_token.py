"""The CPU MoE's one-token path (a decode step of one sequence) against the general per-expert loop it shortcuts:
the same sums in the same order, so the same bits, with and without renormalisation, in float32 and bfloat16. (With
the experts in a two-tier table the same path reads each slot's rows: tests/test_expert_table.py's greedy runs.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stage_worker.model.moe import SparseMoE, route


def loop_reference(m: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The general path: each selected expert over the tokens that chose it, index_add into the output."""
    w, ids = route(m.gate(x), m.top_k, m.renormalise)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        g, u = F.linear(x[tok], m.w13[e]).chunk(2, -1)
        out.index_add_(0, tok, (F.linear(m.act(g) * u, m.w2[e]) * w[tok, slot, None]).to(out.dtype))
    return m._add_shared(x, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalise", [False, True])
def test_one_token_equals_the_per_expert_loop_bit_for_bit(dtype, renormalise):
    torch.manual_seed(3)
    for _ in range(8):
        m = SparseMoE(48, 20, 12, 5, 16, renormalise).to(dtype)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(1, 48, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(m(x), loop_reference(m, x))
            assert m.last_expert_ids.shape == (1, 5)
