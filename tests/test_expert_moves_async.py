"""Asynchronous expert moves (`expert_moves_async`, `StageExperts.start_async`): each layer's move round runs in its
quiet window (between its MoE in one step and its router in the next) on a side stream, and must be the in-stream
`move_round`'s, bit for bit: the same decisions, rows, router rows, counts and slot map at every layer's forward.

On the CPU the side stream is deferred work applied at the join; a layer that runs while its round is in flight
raises. The Triton launches (`decide_layer`, one-layer `SwapPlan`s) run under TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import time

import pytest

import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.expert_offload import gates  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import settle_ref  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402
from expert_tables import fingerprints_hold, random_cold  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def demo():
    from shared.cli import ensure_builtin_model

    d = ensure_builtin_model()
    return d, load_config(d)


# ---- the one-layer decision kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("armed", [1, 0])
def test_decide_layer_kernel_is_decide_and_settle_of_one_layer(armed):
    """Decay, least used device slot, most used host slot (ties: lowest), the margin, then the counts, slot map and
    move counter swapped: as `decide` + `settle_ref`; not armed: nothing changes and go is 0."""
    g = torch.Generator().manual_seed(2)
    E = 24
    cases = [torch.rand(E, generator=g) * 8, torch.zeros(E), torch.full((E,), 3.0),
             torch.randint(0, 4, (E,), generator=g).float()]       # ties everywhere
    cases[0][20] = 40.0                                                # a clear winner among host slots
    for counts in cases:
        for hot, margin in ((18, 0.5), (5, 0.0), (23, 2.0)):
            want_c, want_m = counts.clone()[None].to(DEV), torch.randperm(E, generator=g).int()[None].to(DEV)
            got_c, got_m = want_c[0].clone(), want_m[0].clone()
            want_mv, got_mv = torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int64,
                                                                                         device=DEV)
            if armed:
                dec = M.decide(want_c, torch.tensor([hot], device=DEV), 0.75, margin)
                settle_ref(want_c, want_m, want_mv, dec)
            out = torch.full((3,), 7, dtype=torch.int64, device=DEV)
            M.decide_layer(got_c, got_m, got_mv, out, torch.tensor([armed], dtype=torch.int32, device=DEV), hot,
                           0.75, margin)
            if armed:
                assert out.tolist() == dec[0].tolist()
            else:
                assert out[2].item() == 0
            assert torch.equal(got_c, want_c[0]) and torch.equal(got_m, want_m[0]) and torch.equal(got_mv, want_mv)


# ---- the schedule against the in-stream round, layer by layer --------------------------------------------------

def _simulate(model, x, rounds: int, seed: int, interval: int, asynchronous: bool, kernels: bool = False,
              check=None):
    """Drive the table layers' hooks as forwards would (pre-hook, the router's counting, forward hook, in order),
    `rounds` steps, a round every `interval` launches as the runner runs it; at each layer's "forward" call
    `check(step, position)`. The counting: random adds to the layer's counts, as its router kernel's."""
    moes = model.moe_layers()
    layers = list(x.tables)
    g = torch.Generator().manual_seed(seed)
    decay = 0.5 ** (interval / 16)
    if asynchronous:
        assert x.start_async(model, gates(model), decay, 0.5, kernels=kernels)
    try:
        for n in range(1, rounds + 1):
            if asynchronous:
                x.arm(tail=(n + 1) % interval == 0, head=n % interval == 0)
            elif n % interval == 0:
                x.move_round(gates(model), decay, 0.5)
            for p, layer in enumerate(layers):
                m = moes[layer]
                for hook in m._forward_pre_hooks.values():
                    hook(m, ())
                if check is not None:
                    check(n, p)
                x.counts[p].add_((torch.rand(x.counts.shape[1], generator=g) * 3).floor().to(x.counts.device))
                for hook in m._forward_hooks.values():
                    hook(m, (), None)
    finally:
        if asynchronous:
            x.stop_async()


def _layer_state(model, x, p: int) -> list[torch.Tensor]:
    layer = list(x.tables)[p]
    t = x.tables[layer]
    return [x.counts[p].clone(), x.expert_of_slot[p].clone(), x.moves[p].clone(),
            model.moe_layers()[layer].gate.weight.detach().clone()] + \
        [r.clone() for r in (*t.dev.values(), *t.host.values())]


@pytest.mark.parametrize("interval,kernels", [(1, False), (3, False), (1, True)])
def test_every_layer_sees_the_in_stream_round_s_state_at_its_forward(demo, interval, kernels):
    """At every layer's forward of every step, its counts, slot map, move counter, router rows and table rows are
    exactly what the in-stream `move_round` between steps leaves (a late join would show the previous state; a
    read while in flight raises); afterwards every slot still holds its own expert."""
    d, cfg = demo
    plain = load_model(d, LoadOptions(), cfg)
    cold = random_cold(cfg, 0.25, seed=4)
    steps = 40 if not kernels else 8
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}
    ref = load_model(d, LoadOptions(cold_experts=cold), cfg)
    _simulate(ref, ref.experts, steps, 1, interval, False,
              check=lambda n, p: seen.__setitem__((n, p), _layer_state(ref, ref.experts, p)))
    model = load_model(d, LoadOptions(cold_experts=cold), cfg)
    compared = []

    def check(n, p):
        got = _layer_state(model, model.experts, p)
        assert all(torch.equal(a, b) for a, b in zip(got, seen[(n, p)])), (n, p)
        compared.append((n, p))

    _simulate(model, model.experts, steps, 1, interval, True, kernels=kernels, check=check)
    assert len(compared) == steps * len(model.experts.tables)
    # after the last step: the tail layers have run the round before the next step already, the head layers not
    x, r = model.experts, ref.experts
    before = [_layer_state(ref, r, p) for p in range(len(r.tables))]
    if (steps + 1) % interval == 0:
        r.move_round(gates(ref), 0.5 ** (interval / 16), 0.5)
    for p in range(len(x.tables)):
        want = _layer_state(ref, r, p) if p in range(len(x.tables) // 2) else before[p]
        assert all(torch.equal(a, b) for a, b in zip(_layer_state(model, x, p), want)), p
    assert x.moves.sum().item() > 0
    fingerprints_hold(model, plain)


def test_thousands_of_async_rounds_keep_every_row_its_own_expert(demo):
    d, cfg = demo
    plain = load_model(d, LoadOptions(), cfg)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=5)), cfg)
    x = model.experts
    _simulate(model, x, 1500, 7, 1, True)
    assert x.moves.sum().item() >= 1000
    fingerprints_hold(model, plain)


def test_a_layer_run_while_its_round_is_in_flight_raises(demo):
    """The CPU model of the side stream: a tail layer's round is in flight from its forward hook to the last table
    layer's; running it again before then (a forward that skipped the join) is refused."""
    d, cfg = demo
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=5)), cfg)
    x = model.experts
    assert x.start_async(model, gates(model), 0.9, 0.5)
    x.arm(tail=True, head=True)
    assert x._async.tail[:2] == [0, 1]
    ms = [model.moe_layers()[layer] for layer in list(x.tables)[:2]]
    for m in ms:                             # positions 0 and 1 are tail layers: their rounds are now in flight
        for hook in m._forward_pre_hooks.values():
            hook(m, ())
        for hook in m._forward_hooks.values():
            hook(m, (), None)
    assert {0, 1} <= set(x._async.inflight)          # (and the head layers, forked before position 0)
    with pytest.raises(RuntimeError, match="in flight"):
        for hook in ms[1]._forward_pre_hooks.values():
            hook(ms[1], ())
    x.stop_async()
    assert not x.async_moves


def _greedy(model, prompt, steps, mode: str, graphs: bool = False):
    """Greedy tokens and logprobs with a round before every step: `mode` "swap" (in-stream `move_round`) or
    "async" (the hooks, armed as the runner arms them)."""
    x = model.experts
    if mode == "async":
        assert x.start_async(model, gates(model), 0.5, 0.0)
    eng = LocalEngine([model], max_seqs=2, cuda_graphs=graphs)
    eng.add(0)
    if mode == "async":
        x.arm(tail=True, head=True)
    elif mode == "swap":
        x.move_round(gates(model), 0.5, 0.0)
    logits = eng.step([(0, prompt)])[-1]
    tokens, lps = [], []
    for _ in range(steps):
        lp = torch.log_softmax(logits.float(), -1)
        tokens.append(int(lp.argmax()))
        lps.append(lp[tokens[-1]].item())
        if mode == "async":
            x.arm(tail=True, head=True)
        elif mode == "swap":
            x.move_round(gates(model), 0.5, 0.0)
        logits = eng.step([(0, [tokens[-1]])])[-1]
    if mode == "async":
        x.stop_async()
    return tokens, lps


def test_cpu_model_serves_the_swap_path_s_greedy_tokens(demo):
    d, cfg = demo
    plain = load_model(d, LoadOptions(), cfg)
    cold = random_cold(cfg, 0.5, seed=2)
    prompt = [1, 5, 9, 33, 70, 100, 7, 400]
    runs = {}
    for mode in ("swap", "async"):
        model = load_model(d, LoadOptions(cold_experts=cold), cfg)
        runs[mode] = (*_greedy(model, prompt, 16, mode), model.experts.moves.sum().item())
        fingerprints_hold(model, plain)
    assert runs["async"][0] == runs["swap"][0]
    assert runs["async"][1] == runs["swap"][1]                    # logprobs bit for bit
    # the tail layers have run the round after the last step too (the in-stream path runs it before the next)
    assert runs["async"][2] >= runs["swap"][2] > 0


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_graphs_with_async_moves_equal_the_in_stream_swap_bit_for_bit(tiny_checkpoint):
    """CUDA graphs, half the experts in registered host memory, a round before every step (margin 0, so rows
    move often): the async path's tokens and logprobs equal the in-stream swap's exactly over many steps, the
    same moves were made, and every row still holds its expert."""
    from stage_worker.kernels.flags import KernelFlags

    cfg = load_config(tiny_checkpoint)
    plain = load_model(tiny_checkpoint, LoadOptions(device="cuda"), cfg)
    cold = random_cold(cfg, 0.5, seed=3)
    runs = {}
    for mode in ("swap", "async"):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", cold_experts=cold), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        runs[mode] = (*_greedy(model, [1, 5, 9, 33, 70, 100], 96, mode, graphs=True),
                      model.experts.moves.sum().item())
        fingerprints_hold(model, plain)
    assert runs["async"][0] == runs["swap"][0]
    assert runs["async"][1] == runs["swap"][1]
    # the tail layers have run the round after the last step too (the in-stream path runs it before the next)
    assert runs["async"][2] >= runs["swap"][2] > 0


@pytest.mark.gpu
def test_gpu_async_moves_leave_the_step_s_critical_path():
    """A stage of 8 layers of 64 experts of 2048 x 1024 (bf16 rows of 8 MB, ~160 us over PCIe each way) with a
    forced move in every layer every step: the in-stream swap adds the moves' transfers to the step; the async
    path hides them behind the other layers (its step at most 60% of the swap path's extra time over no moves)."""
    from stage_worker.kernels.flags import KernelFlags
    from shared.model_config import config_from_dict
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from decode import preset

    raw = preset("full-shape")
    raw.update(num_hidden_layers=8, layer_types=raw["layer_types"][:8], num_experts=64)
    raw["ple_layer_ids"] = [i for i in raw.get("ple_layer_ids", []) if i <= 8]
    cfg = config_from_dict(raw)
    cold = {L: list(range(56, 64)) for L in range(8) if cfg.is_sparse_moe(L)}
    times = {}
    for mode in ("off", "swap", "async"):
        model = load_model("", LoadOptions(device="cuda", dtype=torch.bfloat16, load_format="dummy",
                                           cold_experts=cold), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        x = model.experts
        if mode == "async":
            x.start_async(model, gates(model), 1.0, -1.0)        # margin < 0: every layer moves every round
        eng = LocalEngine([model], max_seqs=1, max_tokens=256, cuda_graphs=True)
        eng.add(0)
        eng.step([(0, [11] * 8)])
        samples = []
        for s in range(80):
            torch.cuda.synchronize()
            t0 = time.perf_counter()              # wall time of the whole step, moves included: events around the
            if mode == "async":                   # step alone left the in-stream swap's work (queued before them)
                x.arm(tail=True, head=True)       # out, and counted the host's launch gaps instead (h200-14 A:
            elif mode == "swap":                  # "swap" 1.5 ms under "off" 4.9 ms)
                x.move_round(gates(model), 1.0, -1.0)
            eng.step([(0, [100])])
            torch.cuda.synchronize()
            if s >= 16:
                samples.append((time.perf_counter() - t0) * 1e3)
        if mode == "async":
            x.stop_async()
        if mode != "off":
            assert x.moves.sum().item() > 0
        times[mode] = sorted(samples)[len(samples) // 2]
        del eng, model, x
        torch.cuda.empty_cache()
    print("median step ms", times)
    assert times["async"] - times["off"] <= 0.6 * (times["swap"] - times["off"]) + 0.02


def test_graph_warm_ups_hold_the_rounds(demo):
    """`hold_moves` (DecodeGraphs.capture): no round runs inside, the flags come back after, and the one-off first
    round is not used up."""
    d, cfg = demo
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=5)), cfg)
    x = model.experts
    assert x.start_async(model, gates(model), 0.9, 0.5)
    x._set_flags((True, True))
    with x.hold_moves():
        assert x._async.armed.tolist() == [0, 0]
    assert x._async.armed.tolist() == [1, 1] and not x._async.started
    x.stop_async()
