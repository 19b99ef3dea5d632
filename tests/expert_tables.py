"""Helpers of the expert-table tests (tests/test_expert_table.py, tests/test_packed_cold_experts.py): a random cold
set, greedy decoding with run-time moves, and the fingerprint check that every slot still holds its own expert."""

from __future__ import annotations

import random

import torch

from stage_worker.expert_offload import gates
from stage_worker.local_engine import LocalEngine


def random_cold(cfg, share: float, seed: int = 0) -> dict[int, list[int]]:
    """`share` of every MoE layer's experts, chosen at random, for host RAM."""
    rng = random.Random(seed)
    n = max(1, round(cfg.num_experts * share))
    return {layer: sorted(rng.sample(range(cfg.num_experts), n)) for layer in range(cfg.num_hidden_layers)
            if cfg.is_sparse_moe(layer)}


def greedy(model, prompt: list[int], steps: int, move_every: int = 0):
    """Greedy tokens and every step's log-probabilities; a move round every `move_every` tokens (0: none)."""
    eng = LocalEngine([model], max_seqs=2)
    eng.add(0)
    logits = [eng.step([(0, prompt)])[-1]]
    tokens = []
    for i in range(steps):
        tokens.append(int(logits[-1].argmax()))
        if move_every and model.experts is not None and i % move_every == 0:
            model.experts.move_round(gates(model), decay=0.9, margin=0.0)
        logits.append(eng.step([(0, [tokens[-1]])])[-1])
    return tokens, torch.log_softmax(torch.stack(logits), -1)


def random_move_rounds(model, rounds: int, seed: int = 9) -> int:
    """`rounds` move rounds over random selection counts (the reference swap a CPU cluster runs); returns the swaps
    done, for tests that then check every slot still holds its own expert."""
    x = model.experts
    g = torch.Generator().manual_seed(seed)
    router = gates(model)
    for _ in range(rounds):
        x.counts.add_(torch.rand(x.counts.shape, generator=g) * 4)
        if x.claim is not None:          # moves on read: claim as the router would, store as the kernels would
            for t in x.tables.values():
                host = [s for s in range(t.hot, t.num_slots) if int(t.expert_of_slot[s]) >= 0]
                if t.claim is not None and t.claim.numel() > 1:     # C claims a step: distinct, where a spare is
                    t.claim.fill_(-1)
                    if float(t.threshold) < float("inf"):
                        picks = torch.randperm(len(host), generator=g).tolist()
                        for j in range(min(t.claim.numel(), len(picks))):
                            if int(t.spare[j]) >= 0 and torch.rand((), generator=g) < 0.5:
                                t.claim[j] = host[picks[j]]
                        t.copy_claimed(t.claim.view(1, -1))
                elif t.claim is not None and float(t.threshold) < float("inf") and \
                        torch.rand((), generator=g) < 0.5:
                    t.claim.fill_(host[int(torch.randint(len(host), (), generator=g))])
                    t.copy_claimed(t.claim.view(1, 1))          # as a step that selected it
        x.move_round(router, decay=0.8, margin=0.5)
    return int(x.moves.sum().item())


def permute_slots(model, seed: int) -> int:
    """Every table's rows moved to other slots (across the device / host split too) and a slot map that routes
    each router index to its expert's new slot; gate rows untouched. Returns the tables changed."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    for moe in model.moe_layers().values():
        t = moe.table
        if t is None:
            continue
        perm = torch.randperm(t.num_experts, generator=g)
        # host rows may be pinned CPU tensors (the two-table layout) beside device rows: gathered on the CPU
        rows = {k: torch.stack([t.slot_part(s, k).cpu() for s in range(t.num_experts)]) for k in t.parts}
        for i in range(t.num_experts):
            for k in t.parts:
                t.slot_part(int(perm[i]), k).copy_(rows[k][i])
        t.expert_of_slot[perm.to(t.device)] = t.expert_of_slot.clone()
        t.slot_map = perm.to(t.device, torch.int32)
        n += 1
    return n


def fingerprints_hold(model, plain) -> int:
    """Every slot holds its expert's rows of every part (packed words and scales, or w13/w2), and the router row
    that leads to the slot (router index == slot, or through the table's slot map) is its expert's, wherever the
    moves took it; returns the number of tables checked."""
    want = plain.moe_layers()
    n = 0
    for layer, moe in model.moe_layers().items():
        t = moe.table
        if t is None:
            continue
        n += 1
        experts = t.expert_of_slot.tolist()
        assert sorted(e for e in experts if e >= 0) == list(range(t.num_experts))      # -1: a spare slot
        assert experts.count(-1) == t.num_slots - t.num_experts
        router = range(t.num_experts) if t.slot_map is None else t.slot_map.tolist()   # router index -> slot
        row_of = {slot: i for i, slot in enumerate(router)}
        for slot, e in enumerate(experts):
            if e < 0:
                assert slot not in row_of                   # no router row leads to a spare
                continue
            for kind in t.parts:
                assert torch.equal(t.slot_part(slot, kind).cpu(), getattr(want[layer], kind)[e].cpu()), \
                    (layer, slot, e, kind)
            assert torch.equal(moe.gate.weight[row_of[slot]].cpu(), want[layer].gate.weight[e].cpu())
    return n


def graphed_greedy(model, prompt: list[int], steps: int, moves: bool,
                   move_graph: bool = False) -> tuple[list[int], list[float]]:
    """On a GPU: greedy tokens and their log-probabilities through CUDA-graph replays, with a move round (decay 0.5,
    margin 0) between replays when `moves` (replayed from its own graphs with `move_graph`)."""
    eng = LocalEngine([model], max_seqs=2, cuda_graphs=True)
    eng.add(0)
    logits = eng.step([(0, prompt)])[-1]
    tokens, lps = [], []
    for _ in range(steps):
        lp = torch.log_softmax(logits.float(), -1)
        tokens.append(int(lp.argmax()))
        lps.append(float(lp.max()))
        if moves:
            model.experts.move_round(gates(model), 0.5, 0.0, graph=move_graph)
        logits = eng.step([(0, [tokens[-1]])])[-1]
    return tokens, lps
