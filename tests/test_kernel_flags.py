"""The kernel switches: parsing, and that the model obeys them (on the CPU every layer keeps its reference path)."""

from __future__ import annotations

import pytest
import torch

from stage_worker.kernels.flags import NAMES, NONE, NOT_IN_ALL, KernelFlags


def test_parse_all_none_lists_and_negations():
    """"all" is every kernel that has passed on the H200 (NOT_IN_ALL are named to be on); "-name" turns one off."""
    assert KernelFlags.parse("all") == KernelFlags(**{n: n not in NOT_IN_ALL for n in NAMES})
    assert KernelFlags.parse("all," + ",".join(NOT_IN_ALL)) == KernelFlags(**dict.fromkeys(NAMES, True))
    assert KernelFlags.parse("none") == NONE == KernelFlags.parse("")
    assert KernelFlags.parse("moe,rmsnorm").describe() == "moe,rmsnorm"
    off = KernelFlags.parse("-hyper_connection")
    assert not off.hyper_connection
    assert all(getattr(off, n) for n in NAMES if n != "hyper_connection" and n not in NOT_IN_ALL)
    with pytest.raises(ValueError, match="unknown kernel 'flash'"):
        KernelFlags.parse("flash")


def test_environment_default(monkeypatch):
    monkeypatch.setenv("MOEPIPE_KERNELS", "-moe")
    assert not KernelFlags.from_env().moe
    monkeypatch.delenv("MOEPIPE_KERNELS")
    assert KernelFlags.from_env() == KernelFlags.parse("all")


def test_set_kernels_reaches_every_layer_and_cpu_output_is_unchanged(reference_checkpoints, monkeypatch):
    """The Triton kernels run CUDA tensors only: on the CPU every flag but `sdpa_prefill` leaves the output bit for
    bit; `sdpa_prefill` is a CPU path too (the attention through PyTorch's fused kernel), within float32
    rounding of the eager scores."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine
    from stage_worker.model.moe import SparseMoE
    from stage_worker.model.norms import ZeroCentredRMSNorm

    path, _ = reference_checkpoints["qwen4_exp"]
    model = load_model(path, LoadOptions(dtype=torch.float32))

    def run():
        e = LocalEngine([model], cuda_graphs=True)     # graphs need CUDA: ignored here
        e.add(0)
        return torch.cat([e.step([(0, list(range(6, 40)))]), e.step([(0, [7])])])

    ref = run()
    model.set_kernels(KernelFlags.parse("all,-sdpa_prefill"))
    assert torch.equal(run(), ref)
    flags = KernelFlags.parse("all")
    model.set_kernels(flags)
    assert all(m.kernels == flags for m in model.modules() if isinstance(m, (SparseMoE, ZeroCentredRMSNorm)))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    with_sdpa = run()
    assert calls                                      # the prompt's attention did take the other path
    torch.testing.assert_close(with_sdpa, ref, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    from stage_worker.kernels import common, quant_gemv

    # the process-wide settings follow the model's flags: pdl and the packed weights' prefill dequantize
    model.set_kernels(KernelFlags.parse("all,-quant_dequant,-pdl"))
    assert not quant_gemv._DEQUANT_KERNEL and not common._PDL
    model.set_kernels(flags)
    assert quant_gemv._DEQUANT_KERNEL and common._PDL
