"""Block-FP8 checkpoints with `packed_fp8_experts` on (issue 17): the routed experts stay float8 (uint8 bytes and
float32 block scales, half the bf16 bytes) and the model's logits equal those of the same checkpoint dequantized
at load (the key off) within float32 rounding, a prompt and 8 greedy decode steps, for the Qwen3-Next and Qwen4-Exp
layouts, in one stage and split into two. On the CPU the experts run the per-expert loop (`grouped_moe_fp8`); the
decode kernel's own tests are tests/test_kernel_moe_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")

from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402

PROMPT = [40, 7, 200, 13, 5, 99, 101, 250, 3, 17, 88, 61, 120, 300]
STEPS = 8


def _logits(stages) -> torch.Tensor:
    engine = LocalEngine(stages, max_seqs=1, max_tokens=64)
    engine.add(0)
    logits = [engine.step([(0, PROMPT)], all_logits=True)]
    for _ in range(STEPS):
        logits.append(engine.step([(0, [int(logits[-1][-1].argmax())])]))
    return torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in logits])


@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp"])
def test_fp8_experts_stay_float8_and_give_the_dequantized_models_logits(family, fp8_dirs):
    qdir = fp8_dirs[family]
    on = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_experts=True))
    moes = on.moe_layers()
    assert moes and all(m.fp8_block == (128, 128) for m in moes.values())
    assert all(not hasattr(m, "w13") and m.q13.dtype == torch.uint8 and m.s13.dtype == torch.float32
               for m in moes.values())
    held = sum(t.numel() * t.element_size() for m in moes.values() for t in (m.q13, m.q2, m.s13, m.s2))
    bf16 = sum((m.q13.numel() + m.q2.numel()) * 2 for m in moes.values())
    assert held < 0.55 * bf16                    # float8 bytes plus one float32 per 128 x 128 block
    off = load_model(qdir, LoadOptions(dtype=torch.float32))
    assert not any(m.fp8_block for m in off.moe_layers().values())
    n = on.cfg.num_hidden_layers
    halves = [load_model(qdir, LoadOptions(dtype=torch.float32, start=s, end=e, packed_fp8_experts=True))
              for s, e in ((0, n // 2), (n // 2, n))]
    ref = _logits([off])
    assert (_logits([on]) - ref).abs().max() < 1e-5
    assert (_logits(halves) - ref).abs().max() < 1e-5


def test_fp8_experts_with_cold_experts_load_into_float8_tables(fp8_dirs):
    """The pair once refused: now each listed layer's expert table holds float8 slots (the full tests are
    tests/test_fp8_cold_experts.py); a layer not listed keeps its float8 buffers."""
    qdir = fp8_dirs["qwen3_next"]
    model = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_experts=True, cold_experts={0: [0, 5]}))
    moes = model.moe_layers()
    t = moes[0].table
    assert t is not None and t.fp8 and t.hot == moes[0].num_experts - 2 and t.host["q13"].dtype == torch.uint8
    assert all(m.table is None and m.q13.dtype == torch.uint8 for layer, m in moes.items() if layer != 0)


def test_the_switch_is_on_by_default_set_from_the_environment_and_reaches_a_stage(fp8_dirs, monkeypatch):
    import dataclasses

    from shared.cluster_config import ClusterConfig, StageSpec, env_overrides
    from shared.model_config import load_config
    from stage_worker.stage_loader import load_stage

    assert ClusterConfig.__dataclass_fields__["packed_fp8_experts"].default is True
    monkeypatch.setenv("MOEPIPE_PACKED_FP8_EXPERTS", "0")
    assert env_overrides()["packed_fp8_experts"] is False
    qdir = fp8_dirs["qwen4_exp"]
    cfg = load_config(qdir)
    n = cfg.num_hidden_layers
    for on in (False, True):
        cluster = ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=1, dtype="float32",
                                stages=[StageSpec(0, n, "", "cpu")], packed_fp8_experts=on)
        moes = load_stage(cluster, 0, cfg).moe_layers()
        assert moes and all(bool(m.fp8_block) == on for m in moes.values())
        # cold experts' expert tables hold float8 slots: the switch alone decides
        assert cluster.keeps_fp8_experts() == on
        # with cold experts while the float8 tables are on (the default since h200-16)
        assert dataclasses.replace(cluster, cold_experts="auto").keeps_fp8_experts() == on
        assert not dataclasses.replace(cluster, cold_experts="auto", fp8_expert_tables=False).keeps_fp8_experts()


def test_the_memory_plan_counts_fp8_experts_at_their_size(fp8_dirs):
    """A GPU stage of a block-FP8 checkpoint with the key on is planned at what the loader keeps: the experts'
    float8 bytes and scales, the rest in the compute dtype."""
    import dataclasses

    from shared.cluster_config import ClusterConfig, StageSpec
    from shared.model_config import load_config
    from stage_worker.memory_needs import stage_needs

    qdir = fp8_dirs["qwen3_next"]
    cfg = load_config(qdir)
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=2, block_size=16, dtype="float32",
                            stages=[StageSpec(0, n, "", "cuda:0")], packed_fp8_experts=True, measure_reserve=False)
    planned = stage_needs(cfg, cluster)[0]
    model = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_experts=True))
    held = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "ngram_embedding" not in name
               and ".ple.ple_embedding" not in name)
    held += sum(b.numel() * b.element_size() for name, b in model.named_buffers() if ".mlp.q" in name or
                ".mlp.s" in name)
    assert planned.weights == held
    moe = next(iter(model.moe_layers().values()))
    assert planned.expert_bytes == sum(t[0].numel() * t.element_size() for t in (moe.q13, moe.s13, moe.q2, moe.s2))
    off = stage_needs(cfg, dataclasses.replace(cluster, packed_fp8_experts=False))[0]
    assert planned.weights < off.weights


def test_a_layer_s_fp8_decode_launches_give_the_cpu_path(fp8_dirs):
    """The layer's decode launches with float8 experts (router + shared gate GEMV, the router kernel, the shared
    expert's bf16 pair, the FP8 pair adding it) give the PyTorch path's output (each present expert dequantized
    once), on the CPU under the interpreter; same bits when run again."""
    from stage_worker.kernels.flags import KernelFlags

    if torch.cuda.is_available():
        pytest.skip("the GPU tests cover the kernel path on CUDA")
    pytest.importorskip("triton")
    model = load_model(fp8_dirs["qwen3_next"], LoadOptions(dtype=torch.float32, packed_fp8_experts=True))
    model.set_kernels(KernelFlags.parse("all"))
    moe = next(m for m in model.moe_layers().values() if m.shared_expert is not None)
    assert moe.fp8_block and moe._packed_router() is not None and moe._packed_shared() is not None
    x = torch.randn(3, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast = moe._packed_decode(x, None)
        again = moe._packed_decode(x, None)
        ref = moe(x)                                    # CPU: the PyTorch path
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(fast, again)
