"""Chunked prefill: feeding a prompt in chunks of 1, 7 or 64 tokens gives the one-shot prefill's logits for every
position, routes every token to the same experts and (Qwen4-Exp) lets every query read the same QSA blocks.

The oracle config has indexer_budget 8 and compress ratio 4 (two blocks per query), so with a 70-token prompt the
indexer really chooses: most queries see far more complete blocks than it may keep.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import FAMILIES
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine
from stage_worker.model.attention import QSAIndexer
from stage_worker.model.moe import SparseMoE



TOL = 1e-5
PROMPT_LEN = 70
BLOCK_SIZE = 8


def _prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (n,), generator=g).tolist()
    # EOS (5) inside the prompt resets the PLE n-gram hash; put some on chunk edges of 7 and 64.
    for p in (13, 14, 40, 63, 64):
        ids[p] = 5
    return ids


@pytest.fixture(scope="module")
def models(reference_checkpoints):
    return {fam: load_model(path, LoadOptions(dtype=torch.float32))
            for fam, (path, _) in reference_checkpoints.items()}


class _Recorder:
    """Per layer: expert ids of every fed token (in feed order); per QSA layer: mask row of every query position."""

    def __init__(self, model, monkeypatch) -> None:
        self.experts: dict[int, list[torch.Tensor]] = {}
        self.qsa: dict[int, dict[int, torch.Tensor]] = {}
        self.handles = []
        indexer_layer = {}
        for idx, layer in model.layers.items():
            if isinstance(layer.mlp, SparseMoE):
                self.handles.append(layer.mlp.register_forward_hook(self._moe_hook(int(idx))))
            attn = getattr(layer, "self_attn", None)
            if attn is not None and attn.indexer is not None:
                indexer_layer[id(attn.indexer)] = int(idx)
        original = QSAIndexer.selected_positions
        rec = self

        def selected_positions(indexer, q, pooled, positions):
            key_pos, valid = original(indexer, q, pooled, positions)
            per_pos = rec.qsa.setdefault(indexer_layer[id(indexer)], {})
            for keys, ok, p in zip(key_pos, valid, positions.tolist()):
                row = torch.zeros(p + 1, dtype=torch.bool)
                assert int(keys[ok].max()) <= p, f"QSA keys of position {p} reach past it"
                row[keys[ok]] = True
                per_pos[p] = row
            return key_pos, valid

        monkeypatch.setattr(QSAIndexer, "selected_positions", selected_positions)

    def _moe_hook(self, layer: int):
        def hook(module, args, output):
            self.experts.setdefault(layer, []).append(module.last_expert_ids.clone())
        return hook

    def expert_sets(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(chunks).sort(dim=-1).values for layer, chunks in self.experts.items()}


def _run(model, prompt: list[int], chunk: int, monkeypatch):
    """Logits of every prompt position, fed `chunk` tokens per engine step, and what the model selected."""
    with monkeypatch.context() as mp:
        rec = _Recorder(model, mp)
        engine = LocalEngine([model], block_size=BLOCK_SIZE)
        engine.add(0)
        out = []
        try:
            for i in range(0, len(prompt), chunk):
                out.append(engine.step([(0, prompt[i:i + chunk])], all_logits=True))
        finally:
            for h in rec.handles:
                h.remove()
    return torch.cat(out), rec


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_matches_one_shot(family, models, monkeypatch):
    model = models[family]
    prompt = _prompt(PROMPT_LEN, seed=3)
    want, want_rec = _run(model, prompt, PROMPT_LEN, monkeypatch)
    assert want.shape[0] == PROMPT_LEN
    want_experts = want_rec.expert_sets()
    assert want_experts, "no sparse-MoE layer was recorded"
    if family == "qwen4_exp":
        assert want_rec.qsa and all(len(v) == PROMPT_LEN for v in want_rec.qsa.values())
        # The budget really binds: late queries see 17 complete blocks and keep 2 of them.
        last = next(iter(want_rec.qsa.values()))[PROMPT_LEN - 1]
        assert last.sum().item() == 8 + (PROMPT_LEN % 4)

    for chunk in (1, 7, 64):
        got, rec = _run(model, prompt, chunk, monkeypatch)
        assert got.shape == want.shape
        err = (got - want).abs().max(dim=-1).values
        assert err.max().item() < TOL, f"chunk {chunk}: positions {torch.nonzero(err >= TOL).flatten().tolist()} " \
                                       f"differ by up to {err.max().item():.2e}"
        experts = rec.expert_sets()
        assert experts.keys() == want_experts.keys()
        for layer, ids in experts.items():
            bad = torch.nonzero((ids != want_experts[layer]).any(-1)).flatten().tolist()
            assert not bad, f"chunk {chunk}, layer {layer}: other experts at positions {bad}"
        if family == "qwen4_exp":
            assert rec.qsa.keys() == want_rec.qsa.keys()
            for layer, rows in rec.qsa.items():
                assert sorted(rows) == list(range(PROMPT_LEN))
                bad = [p for p in range(PROMPT_LEN) if not torch.equal(rows[p], want_rec.qsa[layer][p])]
                assert not bad, f"chunk {chunk}, layer {layer}: other QSA blocks at positions {bad}"
