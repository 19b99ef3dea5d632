"""`ple_launch_ahead` (GPU only): a one-stage server whose stage holds the PLE layer queues each decode step before
the token it needs reaches the host, its graph waiting on the device (`stage_worker/kernels/host_wait.py`) for the
rows the host publishes into the mailbox once the token is in. Served greedily it must give the tokens and logprobs
of the same server without it; with `ple_launch_ahead_across_stages` the same for stage 0 of two, whose graph
also waits for its input ids. The CPU side (the rows the mailbox gets) is in tests/test_ple_decode_rows.py, the
kernel's in tests/test_kernel_host_wait.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_ipc_activations import _greedy, _tool


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset,stages,key,line", [
    ("tiny", 1, "ple_launch_ahead", "(ple_launch_ahead)"),
    # two stage processes on the GPU, the PLE layer on stage 0, which queues each decode step before the last
    # stage's Sampled brings its token, its graph waiting on the device for the ids and rows
    ("small", 2, "ple_launch_ahead_across_stages", "input ids (across stages) (ple_launch_ahead)")])
def test_a_ple_stage_launched_ahead_serves_the_same_greedy_tokens(preset, stages, key, line, tmp_path, capfd):
    from stage_worker.checkpoint.make_model import make_model

    if stages > 1 and torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one GPU (the stages share it)")
    model = make_model(preset, tmp_path / preset, seed=0)
    off, _ = _greedy(model, stages, {key: False}, capfd)
    on, log = _greedy(model, stages, {key: True}, capfd)
    assert line in log, log[-3000:]
    ok, lines = _tool().compare(off, on, 1e-4)
    assert ok, "\n".join(lines)
    assert np.isfinite([x for r in on["results"] for x in r["logprobs"] if x is not None]).all()
