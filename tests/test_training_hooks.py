"""Training hooks of the model modules (used by tools/train_demo.py): the MoE load-balancing loss and the QSA
indexer's distillation toward dense attention, on the CPU."""

from __future__ import annotations

import dataclasses

import torch

from stage_worker.model.attention import GatedAttention
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import AttentionCache, CacheSpec
from stage_worker.model.moe import SparseMoE, balance_loss
from stage_worker.model.rope import Rotary
from test_kernel_decode_attention import tiny_config


def test_balance_loss_is_one_when_uniform_and_e_when_collapsed():
    e, t = 8, 64
    uniform_logits = torch.zeros(t, e)
    ids = torch.arange(t * 2).remainder(e).view(t, 2)          # every expert chosen equally often
    assert abs(balance_loss(uniform_logits, ids, e).item() - 1.0) < 1e-6
    collapsed = torch.full((t, e), -30.0)
    collapsed[:, 0] = 30.0
    assert abs(balance_loss(collapsed, torch.zeros(t, 1, dtype=torch.long), e).item() - e) < 1e-3


def test_moe_hook_appends_a_loss_with_router_gradient():
    torch.manual_seed(0)
    m = SparseMoE(16, 8, 8, 2, shared_intermediate=0, renormalise=True)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    m.aux = []
    m(torch.randn(10, 16))
    (kind, loss), = m.aux
    assert kind == "moe_balance" and loss.item() >= 1.0 - 1e-5   # E * sum f P >= 1 only at the uniform optimum
    loss.backward()
    assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0


def _prefill(attn: GatedAttention, cfg, x: torch.Tensor, rotary: Rotary):
    n = x.shape[0]
    batch = StepBatch.build([(list(range(n)), 0, 0, list(range(-(-n // 8))))], 8)
    cache = AttentionCache(cfg, CacheSpec(num_blocks=-(-n // 8), block_size=8, num_slots=1))
    return attn(x, batch, cache, rotary.cos_sin(batch.positions, x.dtype))


def test_dense_mode_equals_a_budget_that_covers_the_context():
    torch.manual_seed(1)
    cfg = tiny_config()
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    x = torch.randn(40, cfg.hidden_size)
    sparse = GatedAttention(cfg, True, rotary).eval()
    wide = GatedAttention(dataclasses.replace(cfg, indexer_budget=64), True, rotary).eval()
    wide.load_state_dict(sparse.state_dict())
    with torch.no_grad():
        selected = _prefill(sparse, cfg, x, rotary)
        want = _prefill(wide, cfg, x, rotary)
        sparse.qsa_dense = True
        dense = _prefill(sparse, cfg, x, rotary)
    torch.testing.assert_close(dense, want)
    assert (selected - want).abs().max() > 1e-4          # the budget (8 tokens) really cut something off


def test_indexer_distillation_learns_the_attention_blocks():
    """Training only the indexer on the KL loss moves its block distribution toward dense attention's."""
    torch.manual_seed(2)
    cfg = tiny_config()
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    attn = GatedAttention(cfg, True, rotary)
    attn.qsa_dense = True
    for p in attn.parameters():
        p.requires_grad_(False)
    params = list(attn.indexer.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-2)
    x = torch.randn(48, cfg.hidden_size)
    losses = []
    for _ in range(40):
        attn.aux = []
        _prefill(attn, cfg, x, rotary)
        (kind, loss), = attn.aux
        assert kind == "indexer_kl"
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]
