"""One address range of VRAM rows then host rows (`stage_worker/vmm_range.py`, issue 16's VMM table): refused
clearly where it cannot be built; on a GPU, rows on both sides of the boundary read and write like any tensor's,
inside CUDA graphs too, only the device part takes VRAM, and the range is freed with its last tensor."""

from __future__ import annotations

import gc

import pytest
import torch

from stage_worker.vmm_range import VmmUnavailable, tiered_rows

CUDA = torch.cuda.is_available()


def test_refused_without_a_gpu_and_for_bad_shapes():
    if not CUDA:
        with pytest.raises(VmmUnavailable, match="needs a CUDA device"):
            tiered_rows(8, (4,), torch.float32, 4, "cpu")
    dev = "cuda" if CUDA else "cpu"
    with pytest.raises((ValueError, VmmUnavailable)):
        tiered_rows(8, (4,), torch.float32, 9, dev)
    if CUDA:
        with pytest.raises(ValueError, match="hot rows 9 outside"):
            tiered_rows(8, (4,), torch.float32, 9, dev)
        with pytest.raises(ValueError, match="empty table"):
            tiered_rows(0, (4,), torch.float32, 0, dev)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("hot", [0, 5, 64])
def test_rows_on_both_tiers_read_and_write_as_one_tensor(hot):
    """64 rows of 1 MiB (bf16 [512, 1024], an expert-sized row), `hot` of them in VRAM: what is written reads back
    bit for bit, a matmul over every row equals the same over a plain device copy, eagerly and from a CUDA graph,
    and the device part is all the VRAM it takes (host rows cost none)."""
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    try:
        rows, rng = tiered_rows(64, (512, 1024), torch.bfloat16, hot, "cuda")
    except VmmUnavailable as exc:
        pytest.skip(f"the driver refused: {exc}")
    free1 = torch.cuda.mem_get_info()[0]
    print(f"\nhot {hot}: device part {rng.device_bytes / 2**20:.0f} MiB ({rng.device_rows} rows), host part "
          f"{rng.host_bytes / 2**20:.0f} MiB, VRAM taken {(free0 - free1) / 2**20:.0f} MiB")
    assert rows.shape == (64, 512, 1024) and rows.is_cuda and rng.device_rows >= hot
    assert free0 - free1 <= rng.device_bytes + (4 << 20)
    src = torch.randn(64, 512, 1024, device="cuda").to(torch.bfloat16)
    rows.copy_(src)
    assert torch.equal(rows, src)
    x = torch.randn(4, 1024, device="cuda").to(torch.bfloat16)
    want = torch.einsum("th,eih->tei", x, src)
    assert torch.equal(torch.einsum("th,eih->tei", x, rows), want)
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.einsum("th,eih->tei", x, rows))
    rows[hot:].mul_(2)                   # the graph reads the rows as they are at replay
    graph.replay()
    torch.cuda.synchronize()
    src[hot:].mul_(2)
    assert torch.equal(out, torch.einsum("th,eih->tei", x, src))
    # The release returns the range's device part: measured around it alone, with the test's other tensors gone
    # and the caching allocator emptied first (h200-15: measured against `free1`, the allocator's cached blocks of
    # `src` and the einsums, 458 MiB, failed the all-host case).
    del out, graph, src, want, x
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.mem_get_info()[0]
    del rows
    gc.collect()
    torch.cuda.synchronize()
    assert rng.released and torch.cuda.mem_get_info()[0] >= before + rng.device_bytes - (4 << 20)
