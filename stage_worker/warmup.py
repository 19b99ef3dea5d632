"""A GPU stage's prefill path and sampler, run once at start before its first heartbeat (`startup_warmup`).

Why: /health turned 200 once the decode graphs were captured, but the first request still paid for compiling the
prefill path's Triton kernels (and the autotuning of the library kernels it calls) and the device sampler's: its
time to first token was 11-16 s on the H200 against 0.07 s for the next one (h200-16 call 1, the access log's
first request of each served run). Here one prefill of a scratch sequence runs eagerly through this stage's layers
(and, on the last stage, the logits and the sampler's plain-temperature, top-k/top-p, penalty and greedy paths), on
the scratch slot and KV block that CUDA-graph padding already uses, so no request's state is touched. Two lengths:
Triton specialises integer arguments on divisibility by 16, so a multiple of 16 and a length that is not compile
different kernels. Then, with `batched_prefill`, two prompts in one step at different lengths and at one length:
the ragged path's own kernels (flash-linear-attention's varlen chunk kernels, the gathered conv windows), which a
first burst of concurrent prompts otherwise compiles while its requests wait (h200-22 call 1: 37.5 s time to
first token for the first four-prompt burst of a fresh machine, 0.15 s after). Both prompts of such a step share
the scratch slot and block: their state and K/V writes collide there, which no request reads.
"""

from __future__ import annotations

import time

import torch

from shared.sampling import SamplingParams
from stage_worker.batch_sampler import Row, TokenCounts, sample_rows
from stage_worker.expert_offload import uncounted
from stage_worker.host_copy import to_host
from stage_worker.model.batch import StepBatch


@torch.inference_mode()
def warm_up(model, cache, *, block_size: int, scratch_slot: int, scratch_block: int, race_kernel: bool,
            batched_prefill: bool = True, decode_rows: tuple[int, ...] = (1, 4)) -> float:
    """Run the prefill path (and on a stage with the head, the sampler at each of `decode_rows` rows) once per
    warm-up length on the scratch slot and block, then (`batched_prefill`) two-prompt steps; returns the seconds it
    took. Every length fits the one scratch block."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ple = {int(i): layer.ple for i, layer in model.layers.items() if getattr(layer, "ple", None) is not None}
    lengths = sorted({block_size, max(1, block_size - 3)})
    steps = [[n] for n in lengths]
    if batched_prefill:
        steps += [[lengths[-1], max(1, block_size - 5)], [lengths[0], lengths[0]]]
    with uncounted(model):                  # scratch steps: no request's host reads or prefetches in /metrics
        for lens in steps:
            n = sum(lens)
            seqs = [(list(range(10, 10 + k)), 0, scratch_slot, [scratch_block]) for k in lens]
            batch = StepBatch.build(seqs, block_size, dev)
            batch.batched_prefill = batched_prefill
            batch.ple_rows = {i: torch.zeros(n, p.heads, p.head_dim, dtype=dtype, device=dev) for i, p in ple.items()}
            hidden = None
            if not model.has_embedding:
                hidden = torch.zeros(n, model.stream_width, dtype=dtype, device=dev)
            out = model(batch, cache, hidden)
            if model.has_head and len(lens) == 1:
                logits = model.logits(out, batch).float()
                for rows in decode_rows:
                    _warm_sampler(logits, scratch_slot, race_kernel, rows)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _warm_sampler(logits: torch.Tensor, slot: int, race_kernel: bool, n: int) -> None:
    """The batched sampler's paths a first request may take, at `n` rows: plain temperature (the race), top-k /
    top-p (the candidates and the probability race), penalties from device counts, greedy; mixed, then each alone,
    and the tokens' queued copy to the host. Run at every decode graph's batch size: a decode step launched ahead
    behind a graph that waits for the host (`ple_launch_ahead`) must not meet a first call there (a Triton kernel
    specialised for one row, a new pinned block) that waits for the device: the host and the graph then wait on
    each other until the graph gives up (h100-32 call 5: a one-stage server's streams stopped for 113 s when its
    last request decoded alone, the first step of one row; h200-27 showed the same shape; the cause is unconfirmed,
    this removes the first calls either way)."""
    mixed = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1),
             SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1, seed=1),
             SamplingParams(temperature=0.0)]
    row = logits[-1:].expand(n, -1).contiguous()
    counts = TokenCounts(slot + 1, logits.shape[-1], logits.device)
    for params in [[mixed[i % len(mixed)] for i in range(n)]] + [[p] * n for p in mixed]:
        rows = [Row(p, 1, 0, [], [], slot=slot) for p in params]
        to_host(sample_rows(row, rows, counts, race_kernel=race_kernel))
