"""Several new sequences of one length go through the layers as one [B, L] batch (`StepBatch.fresh_equal`): the
result must be what the per-sequence loop gives, outputs and every cache/state the next step reads. Also the
training-only dense MoE path against the sparse loop, values and gradients."""

from __future__ import annotations

import pytest
import torch

from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.model.attention import GatedAttention
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec
from stage_worker.model.moe import SparseMoE

BS = 8


def _run(model, seqs: list[list[int]], together: bool, num_slots: int, device: str = "cpu"):
    """Prefill `seqs` (sequence i in slot i, blocks 4i..4i+3) in one step, or one step per sequence."""
    cache = model.new_cache(CacheSpec(num_blocks=4 * num_slots, block_size=BS, num_slots=num_slots,
                                      dtype=torch.float32, device=device))
    entries = [(s, 0, i, list(range(4 * i, 4 * i + 4))) for i, s in enumerate(seqs)]
    groups = [entries] if together else [[e] for e in entries]
    hidden = []
    aux: list = []
    for m in model.modules():
        if isinstance(m, GatedAttention) and m.indexer is not None:
            m.aux = aux
    for group in groups:
        batch = StepBatch.build(group, BS, torch.device(device), all_logits=True)
        if together:
            assert batch.fresh_equal
        hidden.append(model.final_hidden(model(batch, cache)))
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


@pytest.mark.parametrize("L", [29, 3])      # 29: not a multiple of the block size or the QSA ratio; 3: under the ratio
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fresh_equal_batch_matches_the_per_sequence_loop(tiny_checkpoint, device, L):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = load_model(tiny_checkpoint, LoadOptions(dtype=torch.float32, with_mtp=True, device=device)).eval()
    if device == "cuda":                      # the GPU prefill path: flash-linear-attention's chunked delta rule
        from stage_worker.kernels.flags import KernelFlags

        model.set_kernels(KernelFlags.parse("all"))
    tol = dict(rtol=1e-4, atol=1e-4) if device == "cpu" else dict(rtol=2e-3, atol=2e-3)   # TF32 in fla's kernels
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.cfg.vocab_size, (L,), generator=g).tolist() for _ in range(3)]
    with torch.no_grad():
        h_loop, cache_loop, aux_loop = _run(model, seqs, together=False, num_slots=3, device=device)
        h_batch, cache_batch, aux_batch = _run(model, seqs, together=True, num_slots=3, device=device)
    torch.testing.assert_close(h_batch, h_loop, **tol)
    loop_states, batch_states = _state_tensors(cache_loop), _state_tensors(cache_batch)
    assert len(loop_states) >= 6 and loop_states.keys() == batch_states.keys()
    for name, t in loop_states.items():
        torch.testing.assert_close(batch_states[name], t, **tol, msg=lambda m: f"{name}: {m}")
    # the indexer's distillation loss: one batched term is the mean of the per-sequence terms
    n_idx = sum(1 for m in model.modules() if isinstance(m, GatedAttention) and m.indexer is not None)
    assert len(aux_loop) == 3 * n_idx and len(aux_batch) == n_idx and n_idx > 0
    per_layer = torch.stack([v for _, v in aux_loop]).view(3, n_idx).mean(0)
    torch.testing.assert_close(torch.stack([v for _, v in aux_batch]), per_layer, rtol=1e-3, atol=1e-4)


def test_fresh_equal_needs_new_sequences_of_one_length():
    def batch(entries):
        return StepBatch.build(entries, BS, torch.device("cpu"))

    assert batch([([1, 2, 3], 0, 0, [0]), ([4, 5, 6], 0, 1, [1])]).fresh_equal
    assert not batch([([1, 2, 3], 0, 0, [0]), ([4, 5], 0, 1, [1])]).fresh_equal          # lengths differ
    assert not batch([([1, 2, 3], 0, 0, [0])]).fresh_equal                               # one sequence
    assert not batch([([1, 2, 3], 3, 0, [0]), ([4, 5, 6], 0, 1, [1])]).fresh_equal      # one has context
    off = batch([([1, 2, 3], 0, 0, [0]), ([4, 5, 6], 0, 1, [1])])
    off.batched_prefill = False                                                          # the A/B switch
    assert not off.fresh_equal


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
        want, _, aux_batched = _run(model, seqs, together=True, num_slots=2)
        monkeypatch.setattr(attention, "BATCHED_SCORES_LIMIT", 0)
        got, _, aux_looped = _run(model, seqs, together=True, num_slots=2)
    n_idx = sum(1 for m in model.modules() if isinstance(m, GatedAttention) and m.indexer is not None)
    assert len(aux_batched) == n_idx and len(aux_looped) == 2 * n_idx          # one term per sequence: the loop ran
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
