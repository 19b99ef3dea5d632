"""The wait-then-copy kernel a PLE stage's decode graph starts with (`ple_launch_ahead`) against its reference: rows
copied exactly once the flag has reached the step's number, the timeout marked (and the copy still made) when it
never does. Without CUDA under TRITON_INTERPRET=1 (tests/conftest.py), where nothing else can write the flag
meanwhile; the GPU test writes it from the host while the kernel spins."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("triton")

from stage_worker.kernels import host_wait as K  # noqa: E402
from stage_worker.kernels.host_wait_ref import wait_and_copy_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if CUDA else t


@pytest.mark.parametrize("n", [1, 2560 * 3 + 7])       # one element; several programs with a ragged last block
def test_copies_once_the_flag_reaches_the_step(n):
    g = torch.Generator().manual_seed(n)
    src = _host(torch.randn(n, generator=g).bfloat16())
    flag = _host(torch.tensor([7], dtype=torch.int64))
    expected = torch.tensor([7], dtype=torch.int64, device=DEV)
    for fn in (K.wait_and_copy, wait_and_copy_ref):
        dst = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
        timed_out = torch.zeros(1, dtype=torch.int64, device=DEV)
        fn(flag, expected, src, dst, timed_out)
        assert torch.equal(dst.cpu(), src.cpu()) and int(timed_out) == 0


def test_a_flag_that_never_comes_times_out_and_still_copies():
    src = _host(torch.arange(300, dtype=torch.float32))
    flag = _host(torch.tensor([3], dtype=torch.int64))
    expected = torch.tensor([4], dtype=torch.int64, device=DEV)
    for fn, kw in ((K.wait_and_copy, {"max_spins": 50}), (wait_and_copy_ref, {})):
        dst = torch.zeros(300, device=DEV)
        timed_out = torch.zeros(1, dtype=torch.int64, device=DEV)
        fn(flag, expected, src, dst, timed_out, **kw)
        assert int(timed_out) == 4 and torch.equal(dst.cpu(), src.cpu())   # the step that gave up


def test_mismatched_buffers_are_refused():
    flag = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="one dtype and size"):
        K.wait_and_copy(flag, flag.clone(), torch.zeros(4), torch.zeros(5), torch.zeros(1, dtype=torch.int32))


def _replays_wait_for_the_host(dtype: torch.dtype, make, waiter=None) -> None:
    """A graph of `wait_and_copy`, replayed (after `waiter.wait`, if given) before the host has written: the rows
    the host writes 50 ms later (then the flag) are what lands, and the stream was not done before the flag moved."""
    n = 16 * 160 * 4
    src = torch.zeros(n, dtype=dtype).pin_memory()
    flag = torch.zeros(1, dtype=torch.int64).pin_memory()
    expected = torch.ones(1, dtype=torch.int64, device="cuda")
    dst = torch.zeros(n, dtype=dtype, device="cuda")
    timed_out = torch.zeros(1, dtype=torch.int64, device="cuda")
    K.wait_and_copy(flag.fill_(1), expected, src, dst, timed_out)       # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.wait_and_copy(flag, expected, src, dst, timed_out)
    if waiter is not None:
        waiter = waiter(flag)
        assert waiter is not None, "the driver refused stream waits (see the log)"
    for step in range(2, 5):
        expected.fill_(step)
        if waiter is not None:
            waiter.wait(step)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        want = make(n)

        def host() -> None:
            time.sleep(0.05)
            src.copy_(want)
            flag[0] = step

        writer = threading.Thread(target=host)
        writer.start()
        time.sleep(0.02)
        assert not done.query()                  # still waiting for the host
        writer.join()
        done.synchronize()
        assert torch.equal(dst.cpu(), want) and int(timed_out) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_kernel_waits_for_the_host_inside_a_graph():
    _replays_wait_for_the_host(torch.bfloat16, lambda n: torch.randn(n).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_wait_gives_up_after_its_timeout_on_the_gpu_clock():
    """On the GPU the wait ends after `timeout_s` of the global timer, not after a count of polls (12.1 us each on
    an H100, h100-33: the old bound of 2^24 polls alone was 204 s of a stopped server)."""
    src = torch.arange(300, dtype=torch.float32).pin_memory()
    flag = torch.tensor([3], dtype=torch.int64).pin_memory()
    expected = torch.tensor([4], dtype=torch.int64, device="cuda")
    dst = torch.zeros(300, device="cuda")
    timed_out = torch.zeros(1, dtype=torch.int64, device="cuda")
    # compile, nothing to wait for (the same max_spins: 2^40 is an int64 argument, 2^24 an int32 one, and Triton
    # compiles each kind apart, so the default here left the compile in the timed call)
    K.wait_and_copy(flag.fill_(4), expected, src, dst, timed_out, max_spins=1 << 40, timeout_s=0.3)
    torch.cuda.synchronize()
    flag.fill_(3)
    t0 = time.perf_counter()
    K.wait_and_copy(flag, expected, src, dst, timed_out, max_spins=1 << 40, timeout_s=0.3)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    assert int(timed_out) == 4 and torch.equal(dst.cpu(), src)
    assert 0.25 < took < 3.0, took


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_stream_wait_holds_the_graph_until_the_host_writes():
    """`stream_wait.StreamWait` (`ple_launch_ahead_across_stages`): the stream waits in the front end for the
    host's word, then the graph's polling kernel finds it set and copies what the host wrote before it (int64:
    the input ids travel this way too)."""
    from stage_worker.stream_wait import StreamWait

    _replays_wait_for_the_host(torch.int64, lambda n: torch.randint(0, 1 << 40, (n,), dtype=torch.int64),
                               waiter=lambda flag: StreamWait.open(flag, torch.device("cuda")))


def test_stream_waits_are_refused_off_the_gpu():
    """No CUDA stream for a CPU stage: the runner keeps the polling kernel's path (None, no exception)."""
    from stage_worker.stream_wait import StreamWait

    assert StreamWait.open(torch.zeros(1, dtype=torch.int64), torch.device("cpu")) is None
