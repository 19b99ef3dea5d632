"""Kernel time as a decode step pays it: calls captured into one CUDA graph and replayed (no Python launch cost).
The one timer of the benchmarks (`tune_kernels.graph_time`, `moe_int4.py`) and the GPU tests (`conftest.graph_us`)."""

from __future__ import annotations

import statistics

import torch


def graph_us(fn, calls: int = 20, runs: int = 5, warmup: int = 1) -> float:
    """Microseconds per call of `fn(i)`, i = 0..calls-1, captured into one CUDA graph and replayed `runs` times
    (median). `fn(0..warmup-1)` run eagerly first (compiles, allocator warm-up outside the capture)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
