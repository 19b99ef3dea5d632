"""A quantized checkpoint on a GPU against the float32 CPU path on the same files: the check the GPU tests of each
quantized format share (tests/test_gptq_checkpoint.py, tests/test_quantized_checkpoint.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine


def assert_gpu_kernels_track_the_cpu(qdir: Path, check: Callable[[torch.nn.Module], None] | None = None) -> None:
    """`qdir` through every fast kernel (a 600-token prompt: past the decode kernels' size, so the experts' grouped
    prefill) and the decode graphs, teacher-forced over 32 steps, stays as close to the float32 CPU path as the bf16
    PyTorch path does, and its greedy choices agree with the CPU's at 90% of the steps or more. `check` sees the GPU
    model once loaded (what stays packed)."""
    from stage_worker.kernels.flags import NONE, KernelFlags

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 300, (600,), generator=g).tolist()
    forced = torch.randint(10, 300, (32,), generator=g).tolist()

    def run(model, graphs: bool) -> torch.Tensor:
        engine = LocalEngine([model], max_seqs=1, max_tokens=1024, cuda_graphs=graphs)
        engine.add(0)
        out = [engine.step([(0, prompt)])[-1:]]
        out += [engine.step([(0, [t])]) for t in forced]
        return torch.cat([o.reshape(-1, o.shape[-1]).float().cpu() for o in out])

    with torch.inference_mode():
        truth = run(load_model(qdir, LoadOptions(dtype=torch.float32)), False)
        gpu = load_model(qdir, LoadOptions(device="cuda", dtype=torch.bfloat16))
        if check is not None:
            check(gpu)
        gpu.set_kernels(NONE)
        plain = run(gpu, False)
        gpu.set_kernels(KernelFlags.parse("all"))
        fast = run(gpu, True)
    spread = truth.std()
    plain_err, fast_err = ((x - truth).abs().mean() / spread for x in (plain, fast))
    agree = (fast.argmax(-1) == truth.argmax(-1)).float().mean()
    assert fast_err <= 1.25 * plain_err + 0.005 and agree >= 0.9, (float(fast_err), float(plain_err), float(agree))
