"""Every checkpoint transformers loads is served (issue 13): transformers-written checkpoints whose dimensions match
no preset (QSA compression ratio 3, PLE layers that land on different stages, head and expert counts that are not
powers of two), compared with transformers in-process and served by real `moepipe serve` clusters of 1, 2 and 3
stages (processes, sockets on 127.0.0.1, the `openai` client), with no KV size given by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import free_port
from gateway.launcher import Cluster, ServeOptions
from hf_oracle import ROPE, build_from_config, reference_logits
from shared.cluster_config import split_layers
from shared.kv_layout import derived_block_size
from shared.model_config import load_config
from shared.tokenizer import Tokenizer
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine

VOCAB = 330                      # the smallest byte-level tokenizer (256 bytes + Qwen's added tokens) plus a few
ODD = dict(vocab_size=VOCAB, hidden_size=24, num_attention_heads=6, num_key_value_heads=3, head_dim=12,
           linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=3, linear_num_value_heads=6,
           moe_intermediate_size=10, shared_expert_intermediate_size=14, num_experts=6, num_experts_per_tok=3,
           rope_parameters=ROPE, eos_token_id=5, rms_norm_eps=1e-6, max_position_embeddings=256)
LIN, IDX, FULL = "linear_attention", "indexed_attention", "full_attention"
PROMPT = [40, 7, 200, 13, 5, 99, 101, 250, 3, 17, 88, 61, 120, 300, 45, 46, 47, 9, 310, 2, 77, 150]   # EOS inside
NEW = 6
TOL = 1e-4


def qwen4_exp_ratio3():
    """Ratio 3 (block size 48 derived), PLE on 0-based layers 1 and 4: stages 0 and 1 of 2, stages 0 and 2 of 3."""
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        **ODD, num_hidden_layers=6, layer_types=[LIN, LIN, IDX, LIN, LIN, IDX],
        hc_count=3, hc_lowrank=6, ple_layer_ids=[2, 5], ple_embed_dim=12, ngram_size=3, heads_per_ngram=3,
        ngram_vocab_size_base=37, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3,
        indexer_n_heads=3, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=9, indexer_compress_ratio=3,
        output_gate_type="sigmoid")


def qwen3_next_odd():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**{**ODD, "num_experts": 12}, num_hidden_layers=3, intermediate_size=20,
                           mlp_only_layers=[2], layer_types=[LIN, FULL, LIN])


def qwen3_5_moe_odd():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**ODD, num_hidden_layers=3, layer_types=[LIN, LIN, FULL])


CONFIGS = {"qwen4_exp_ratio3": qwen4_exp_ratio3, "qwen3_next_odd": qwen3_next_odd, "qwen3_5_moe_odd": qwen3_5_moe_odd}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (directory written by save_pretrained plus a tokenizer, the transformers model)."""
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files

    tok = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(tok, vocab_size=VOCAB, model_max_length=256)
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        path = tmp_path_factory.mktemp(name)
        model = build_from_config(make(), seed=i)
        model.save_pretrained(path)
        for f in tok.iterdir():
            shutil.copy(f, path / f.name)
        out[name] = (path, model)
    return out


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its log-probabilities at every position of prompt + continuation."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):], torch.log_softmax(reference_logits(model, ids), dim=-1)


@pytest.fixture(scope="module")
def oracles(checkpoints):
    """name -> `_greedy(transformers model, PROMPT, NEW)`, computed once for the module (the in-process and the
    served tests of a checkpoint compare with the same continuation)."""
    made: dict[str, tuple[list[int], torch.Tensor]] = {}

    def get(name: str) -> tuple[list[int], torch.Tensor]:
        if name not in made:
            made[name] = _greedy(checkpoints[name][1], PROMPT, NEW)
        return made[name]
    return get


def test_block_size_is_derived_from_the_qsa_ratio(checkpoints):
    cfg = load_config(checkpoints["qwen4_exp_ratio3"][0])
    assert cfg.indexer_compress_ratio == 3 and derived_block_size(cfg) == 48
    assert derived_block_size(load_config(checkpoints["qwen3_next_odd"][0])) == 16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_in_process_whole_and_split_match_transformers(name, checkpoints, oracles):
    """Prefill logits and greedy decode equal transformers', with the whole model and with it split into three
    slices (the stages of `moepipe serve --stages 3`, each PLE slice gathering its own rows)."""
    path = checkpoints[name][0]
    cfg = load_config(path)
    want_ids, want_lp = oracles(name)
    whole = [load_model(path, LoadOptions(dtype=torch.float32))]
    split = [load_model(path, LoadOptions(start=s, end=e, dtype=torch.float32))
             for s, e in split_layers(cfg.num_hidden_layers, 3)]
    for stages in (whole, split):
        engine = LocalEngine(stages, max_seqs=1, max_tokens=64)
        assert engine.block_size == derived_block_size(cfg)
        engine.add(0)
        logits = engine.step([(0, PROMPT)], all_logits=True)
        assert (torch.log_softmax(logits, -1) - want_lp[: len(PROMPT)]).abs().max() < TOL
        got = []
        for _ in range(NEW):
            got.append(int(logits[-1].argmax()))
            logits = engine.step([(0, [got[-1]])])
        assert got == want_ids


# Each cluster costs ~3 s of CPU per process just importing torch: one per layout that matters. Qwen4-Exp: PLE on
# stages 0 and 2 of 3 through the service (stage 1 holds none), on both of 2 stages through the in-process fallback.
SERVED = [("qwen4_exp_ratio3", 3, True), ("qwen4_exp_ratio3", 2, False), ("qwen3_next_odd", 2, True),
          ("qwen3_5_moe_odd", 1, True)]


@pytest.mark.parametrize("name,stages,ple_service", SERVED)
def test_served_cluster_matches_transformers(name, stages, ple_service, checkpoints, oracles):
    """`moepipe serve --stages N` with no KV size given: greedy tokens, their logprobs and top-3, and the echoed
    prompt's logprobs equal transformers'."""
    from conftest import OpenAI         # openai imported here, not at the top: the GPU image has no openai client

    path = checkpoints[name][0]
    want_ids, want_lp = oracles(name)
    extra = {"max_num_batched_tokens": 32} if ple_service else {"max_num_batched_tokens": 32, "ple_service": False}
    with Cluster(ServeOptions(model=path, stages=stages, port=free_port(), extra=extra)) as c:
        assert c.cluster.block_size == derived_block_size(load_config(path))
        assert c.cluster.ple_service == (ple_service and name.startswith("qwen4"))
        client = OpenAI(base_url=c.url + "/v1", api_key="x")
        res = client.completions.create(model="moepipe", prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True,
                                        logprobs=3, extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    tok = Tokenizer.from_dir(path)
    text = [tok.token_bytes(i, skip_special_tokens=False).decode("utf-8", "backslashreplace") for i in want_ids]
    assert lp.tokens[len(PROMPT):] == text                              # the greedy tokens, id for id
    full = PROMPT + want_ids
    want = [float(want_lp[i - 1, full[i]]) for i in range(1, len(full))]
    assert lp.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < TOL
    for i, top in enumerate(lp.top_logprobs[len(PROMPT):]):
        ref_top = want_lp[len(PROMPT) + i - 1].topk(3).values.tolist()
        assert max(abs(a - b) for a, b in zip(sorted(top.values(), reverse=True), ref_top)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_kernels_and_graphs_on_a_gpu_match_transformers(name, checkpoints):
    """On CUDA every fused kernel (QSA ratio 3 over 48-token pages, GQA group 2, 6 or 12 experts top-3) and the
    decode graphs give transformers' greedy tokens and log-probabilities."""
    from stage_worker.kernels.flags import KernelFlags

    path, ref = checkpoints[name]
    want_ids, want_lp = _greedy(ref, PROMPT, NEW)
    model = load_model(path, LoadOptions(device="cuda", dtype=torch.float32))
    model.set_kernels(KernelFlags.parse("all"))
    engine = LocalEngine([model], max_seqs=2, max_tokens=64, cuda_graphs=True)
    engine.add(0)
    logits = engine.step([(0, PROMPT)])
    got = []
    for i in range(NEW):
        row = torch.log_softmax(logits[-1].cpu(), -1)
        assert (row - want_lp[len(PROMPT) + i - 1]).abs().max() < 1e-3, f"decode step {i}"
        got.append(int(row.argmax()))
        logits = engine.step([(0, [got[-1]])])
    assert got == want_ids


@pytest.mark.gpu
def test_served_on_cuda_with_ple_on_two_stages(checkpoints):
    """`moepipe serve --stages 3 --device cuda`: stages 0 and 2 hold PLE layers and both map (and pin) the one ring
    the PLE service writes; greedy tokens equal transformers' and their logprobs agree."""
    import httpx

    path, ref = checkpoints["qwen4_exp_ratio3"]
    want_ids, want_lp = _greedy(ref, PROMPT, NEW)
    opts = ServeOptions(model=path, stages=3, device="cuda", port=free_port(),
                        extra={"max_num_batched_tokens": 32, "dtype": "float32"})
    with Cluster(opts) as c:
        assert c.cluster.ple_service
        body = httpx.post(c.url + "/v1/completions", timeout=120, json={
            "model": "moepipe", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}, verify=False).json()
    lp = body["choices"][0]["logprobs"]
    tok = Tokenizer.from_dir(path)
    assert lp["tokens"] == [tok.token_bytes(i, skip_special_tokens=False).decode("utf-8", "backslashreplace")
                            for i in want_ids]
    full = PROMPT + want_ids
    want = [float(want_lp[i - 1, full[i]]) for i in range(len(PROMPT), len(full))]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"], want)) < 1e-3
