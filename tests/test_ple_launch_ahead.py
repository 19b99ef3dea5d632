"""`ple_launch_ahead` (GPU only): a one-stage server whose stage holds the PLE layer queues each decode step before
the token it needs reaches the host, its graph waiting on the device (`stage_worker/kernels/host_wait.py`) for the
rows the host publishes into the mailbox once the token is in. Served greedily it must give the tokens and logprobs
of the same server without it. The CPU side (the rows the mailbox gets) is in tests/test_ple_decode_rows.py, the
kernel's in tests/test_kernel_host_wait.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_ipc_activations import _greedy, _tool


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_ple_stage_launched_ahead_serves_the_same_greedy_tokens(tmp_path, capfd):
    from stage_worker.checkpoint.make_model import make_model

    model = make_model("tiny", tmp_path / "tiny", seed=0)
    off, _ = _greedy(model, 1, {"ple_launch_ahead": False}, capfd)
    on, log = _greedy(model, 1, {"ple_launch_ahead": True}, capfd)
    assert "(ple_launch_ahead)" in log, log[-3000:]
    ok, lines = _tool().compare(off, on, 1e-4)
    assert ok, "\n".join(lines)
    assert np.isfinite([x for r in on["results"] for x in r["logprobs"] if x is not None]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_a_first_stage_launched_ahead_across_stages_serves_the_same_greedy_tokens(tmp_path, capfd):
    """`ple_launch_ahead_across_stages`: two stage processes on the GPU, the PLE layer on stage 0, which queues each
    decode step before the last stage's Sampled brings its token, its graph waiting on the device for the ids and
    rows. Same tokens and logprobs as without it."""
    from stage_worker.checkpoint.make_model import make_model

    model = make_model("small", tmp_path / "small", seed=0)
    off, _ = _greedy(model, 2, {"ple_launch_ahead_across_stages": False}, capfd)
    on, log = _greedy(model, 2, {"ple_launch_ahead_across_stages": True}, capfd)
    assert "input ids (across stages) (ple_launch_ahead)" in log, log[-3000:]
    ok, lines = _tool().compare(off, on, 1e-4)
    assert ok, "\n".join(lines)
