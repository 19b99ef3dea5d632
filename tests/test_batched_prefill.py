"""A prefill step's sequences go through each layer as one batch padded to the longest (`StepBatch.ragged`,
`stage_worker/model/ragged.py`), whatever their lengths and contexts: the result must be what the per-sequence loop
gives (`batched_prefill` off), outputs and every cache/state the next step reads. Also the training-only dense MoE
path against the sparse loop, values and gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.model.attention import GatedAttention
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec
from stage_worker.model.moe import SparseMoE
from stage_worker.model.ragged import Ragged, ragged_causal_conv

BS = 8


def _run(model, steps: list[list[tuple[list[int], int]]], batched: bool, num_slots: int, device: str = "cpu"):
    """Run `steps`, each a list of (tokens, slot) fed together (slot s owns blocks 8s..8s+7; a slot's context is what
    earlier steps fed it), with the batched path on, or with it off (the per-sequence loop). Returns every step's
    hidden rows, the cache and the indexer's distillation terms."""
    cache = model.new_cache(CacheSpec(num_blocks=8 * num_slots, block_size=BS, num_slots=num_slots,
                                      dtype=torch.float32, device=device))
    fed = [0] * num_slots
    hidden = []
    aux: list = []
    for m in model.modules():
        if isinstance(m, GatedAttention) and m.indexer is not None:
            m.aux = aux
    for step in steps:
        entries = [(tokens, fed[slot], slot, list(range(8 * slot, 8 * slot + 8))) for tokens, slot in step]
        batch = StepBatch.build(entries, BS, torch.device(device), all_logits=True)
        batch.batched_prefill = batched
        hidden.append(model.final_hidden(model(batch, cache)))
        for tokens, slot in step:
            fed[slot] += len(tokens)
    for m in model.modules():
        if isinstance(m, GatedAttention):
            m.aux = None
    return torch.cat(hidden), cache, aux


def _state_tensors(cache) -> dict[str, torch.Tensor]:
    out = {}
    for name, obj in vars(cache).items():
        items = obj.items() if isinstance(obj, dict) else [("", obj)]
        for key, sub in items:
            for field, t in vars(sub).items() if hasattr(sub, "__dict__") else []:
                if isinstance(t, torch.Tensor):
                    out[f"{name}.{key}.{field}"] = t
    return out


def _model(tiny_checkpoint, device: str):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = load_model(tiny_checkpoint, LoadOptions(dtype=torch.float32, with_mtp=True, device=device)).eval()
    if device == "cuda":                      # the GPU prefill path: flash-linear-attention's varlen delta rule
        from stage_worker.kernels.flags import KernelFlags

        model.set_kernels(KernelFlags.parse("all"))
    tol = dict(rtol=1e-4, atol=1e-4) if device == "cpu" else dict(rtol=2e-3, atol=2e-3)   # TF32 in fla's kernels
    return model, tol


def _assert_same(model, steps, num_slots, device, tol):
    with torch.no_grad():
        h_loop, cache_loop, aux_loop = _run(model, steps, False, num_slots, device)
        h_batch, cache_batch, aux_batch = _run(model, steps, True, num_slots, device)
    torch.testing.assert_close(h_batch, h_loop, **tol)
    loop_states, batch_states = _state_tensors(cache_loop), _state_tensors(cache_batch)
    assert len(loop_states) >= 6 and loop_states.keys() == batch_states.keys()
    for name, t in loop_states.items():
        torch.testing.assert_close(batch_states[name], t, **tol, msg=lambda m: f"{name}: {m}")
    return aux_loop, aux_batch


@pytest.mark.parametrize("L", [29, 3])      # 29: not a multiple of the block size or the QSA ratio; 3: under the ratio
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_equal_new_sequences_batched_match_the_per_sequence_loop(tiny_checkpoint, device, L):
    model, tol = _model(tiny_checkpoint, device)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.cfg.vocab_size, (L,), generator=g).tolist() for _ in range(3)]
    aux_loop, aux_batch = _assert_same(model, [[(s, i) for i, s in enumerate(seqs)]], 3, device, tol)
    # the indexer's distillation loss: one batched term is the mean of the per-sequence terms
    n_idx = sum(1 for m in model.modules() if isinstance(m, GatedAttention) and m.indexer is not None)
    assert len(aux_loop) == 3 * n_idx and len(aux_batch) == n_idx and n_idx > 0
    per_layer = torch.stack([v for _, v in aux_loop]).view(n_idx, 3).mean(1)      # layer by layer, sequences inside
    torch.testing.assert_close(torch.stack([v for _, v in aux_batch]), per_layer, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ragged_steps_batched_match_the_per_sequence_loop(tiny_checkpoint, device):
    """A burst of new prompts of different lengths (some under the QSA ratio, one a block-size multiple), then a
    step mixing a continued chunk, single decode tokens and a new prompt, then a pure decode step."""
    model, tol = _model(tiny_checkpoint, device)
    g = torch.Generator().manual_seed(4)

    def toks(n: int) -> list[int]:
        return torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()

    steps = [[(toks(29), 0), (toks(3), 1), (toks(16), 2), (toks(11), 3)],
             [(toks(1), 0), (toks(13), 1), (toks(1), 2), (toks(21), 4), (toks(1), 3)],
             [(toks(1), s) for s in range(5)]]
    _assert_same(model, steps, 5, device, tol)


def test_ragged_conv_equals_each_sequence_alone():
    """The conv of a step against a conv over each sequence's own tail + tokens; tails from random state; lengths
    that differ (gathered windows, a sequence of one token among them) and one length (the plain conv); with
    dilation (PLE's) and without (DeltaNet's)."""
    g = torch.Generator().manual_seed(0)
    for lens, (kernel, dilation) in itertools.product(([5, 1, 12, 3], [7, 7], [9]), ((4, 1), (3, 2))):
        tail = dilation * (kernel - 1)
        x = torch.randn(sum(lens), 6, generator=g)
        tails = torch.randn(len(lens), tail, 6, generator=g)
        w = torch.randn(6, 1, kernel, generator=g)
        rg = Ragged(lens, torch.device("cpu"))
        y, new = ragged_causal_conv(x, tails, w, dilation, rg)
        start = 0
        for b, n in enumerate(lens):
            seq = torch.cat([tails[b], x[start:start + n]])
            want = torch.nn.functional.conv1d(seq.T[None], w, groups=6, dilation=dilation)[0].T
            torch.testing.assert_close(y[start:start + n], want)
            torch.testing.assert_close(new[b], seq[-tail:])
            start += n
        torch.testing.assert_close(rg.unpad(rg.pad(x)), x)


def test_dense_experts_equal_the_sparse_loop_with_gradients():
    torch.manual_seed(0)
    moe = SparseMoE(24, 12, 8, 3, shared_intermediate=16, renormalise=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(37, 24)
    results = []
    for dense in (False, True):
        moe.zero_grad()
        moe.dense_experts = dense
        out = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in moe.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_large_batched_attention_falls_back_to_the_loop(tiny_checkpoint, monkeypatch):
    """Above BATCHED_SCORES_LIMIT the attention loops over sequences (peak memory of one sequence's scores), with the
    same result; DeltaNet and PLE stay batched."""
    import stage_worker.model.attention as attention

    model = load_model(tiny_checkpoint, LoadOptions(dtype=torch.float32)).eval()
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.cfg.vocab_size, (21,), generator=g).tolist() for _ in range(2)]
    with torch.no_grad():
        step = [[(s, i) for i, s in enumerate(seqs)]]
        want, _, aux_batched = _run(model, step, True, num_slots=2)
        monkeypatch.setattr(attention, "BATCHED_SCORES_LIMIT", 0)
        got, _, aux_looped = _run(model, step, True, num_slots=2)
    n_idx = sum(1 for m in model.modules() if isinstance(m, GatedAttention) and m.indexer is not None)
    assert len(aux_batched) == n_idx and len(aux_looped) == 2 * n_idx          # one term per sequence: the loop ran
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
