"""Float8 experts (issue 17, `packed_fp8_experts`): the bf16 fused MoE decode kernels in FP8 mode (float8_e4m3fn
bytes and 128x128-style block scales read and applied in registers) against their reference (dequantize, then
matmul: `moe_ref.fused_moe_fp8_ref`), and the per-expert CPU/prefill loop `grouped_moe_fp8`.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py) at tiny shapes with small blocks whose
edges cut (I and H not multiples of the block, gate's and up's blocks apart). The `gpu` test takes Qwen3-Next-80B's
expert shape (H 2048, I 512, 512 experts, top 10, 128 x 128 blocks) at 1/4/16 tokens and prints the time against
the bf16 kernels over the same experts dequantized.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels.moe_ref import Fp8Experts, fused_moe_fp8_ref, fused_moe_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, cols] -> (float8_e4m3fn bytes as uint8, float32 scales per block), amax / 448 per block."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    p = torch.nn.functional.pad(w.float(), (0, nc * bc - cols, 0, nr * br - rows))
    scale = (p.view(nr, br, nc, bc).abs().amax((1, 3)) / 448.0).clamp_min(1e-12)
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn).view(torch.uint8), scale


def make_experts(E: int, h: int, i: int, block: tuple[int, int], seed: int) -> Fp8Experts:
    g = torch.Generator(device=DEV).manual_seed(seed)     # made on the device: the GPU test's 512 in seconds
    nr, nc = -(-i // block[0]), -(-h // block[1])
    q13 = torch.empty(E, 2 * i, h, dtype=torch.uint8, device=DEV)
    s13 = torch.empty(E, 2, nr, nc, device=DEV)
    q2 = torch.empty(E, h, i, dtype=torch.uint8, device=DEV)
    s2 = torch.empty(E, -(-h // block[0]), -(-i // block[1]), device=DEV)
    for e in range(E):                            # one expert at a time: the GPU test's 512 stay a few GB
        w13 = torch.randn(2 * i, h, generator=g, device=DEV) / h ** 0.5
        w2 = torch.randn(h, i, generator=g, device=DEV) / i ** 0.5
        q13[e, :i], s13[e, 0] = quantize_block(w13[:i], block)
        q13[e, i:], s13[e, 1] = quantize_block(w13[i:], block)
        q2[e], s2[e] = quantize_block(w2, block)
    return Fp8Experts(q13, s13, q2, s2, block)


def _route(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return ids.to(DEV), w.to(DEV)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def test_dequantize_matches_the_loaders_dequantization():
    from shared.quant_scheme import WeightQuant
    from stage_worker.model.quant_weight import dequantize_float

    ex = make_experts(2, 40, 24, (16, 16), 0)
    wq = WeightQuant(bits=8, kind="float", strategy="block", block=(16, 16), format="float-quantized")
    gate = dequantize_float(ex.q13[1, :24].view(torch.float8_e4m3fn), ex.s13[1, 0], wq, torch.float32)
    up = dequantize_float(ex.q13[1, 24:].view(torch.float8_e4m3fn), ex.s13[1, 1], wq, torch.float32)
    assert torch.equal(ex.w13(1), torch.cat([gate, up]))
    assert torch.equal(ex.w2(1), dequantize_float(ex.q2[1].view(torch.float8_e4m3fn), ex.s2[1], wq, torch.float32))


@pytest.mark.parametrize("T,block", [(1, (16, 16)), (3, (16, 16)), (2, (16, 64))])
def test_fp8_decode_kernel_matches_the_reference_and_is_deterministic(T, block):
    """Blocks (16, 16): edge blocks cut in both dimensions, I not a multiple of 16, a gathered scale per weight
    (the tiles span column blocks); (16, 64): one column block a tile, one scale a row (ROW_SCALE)."""
    E, k, h, i = 6, 2, 40, 24
    ex = make_experts(E, h, i, block, 1)
    ids, w = _route(T, E, k, 2 + T)
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(3)).to(DEV)
    out = K.fused_moe_fp8(x, ids, w, ex)
    ref = fused_moe_fp8_ref(x, ids, w, ex)
    assert _rel(out, ref) < 1e-5
    assert torch.equal(out, K.fused_moe_fp8(x, ids, w, ex))            # same bits again
    add = torch.randn(T, h, generator=torch.Generator().manual_seed(4)).to(DEV)
    assert torch.equal(K.fused_moe_fp8(x, ids, w, ex, add=add), out + add)


def test_fp8_decode_kernel_skips_padding_slots_and_the_loop_agrees():
    E, k, h, i = 5, 2, 32, 16
    ex = make_experts(E, h, i, (16, 16), 5)
    ids, w = _route(2, E, k, 6)
    ids[1] = K.SKIP                               # a CUDA graph's padding row: no expert read, zeros out
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(7)).to(DEV)
    out = K.fused_moe_fp8(x, ids, w, ex)
    assert torch.count_nonzero(out[1]) == 0
    ref = fused_moe_fp8_ref(x, ids, w, ex)
    assert _rel(out, ref) < 1e-5
    loop = K.grouped_moe_fp8(x, ids, w, ex)
    assert _rel(loop, ref) < 1e-5


def split_slots(ex: Fp8Experts, first: int) -> tuple[Fp8Experts, Fp8Experts]:
    """An expert table's two tiers of `ex`: slots [0, first) as the device table, [first, E) as the host table
    (their own contiguous tensors; pinned host memory when CUDA is there, as `expert_offload` allocates it)."""
    def host(t: torch.Tensor) -> torch.Tensor:
        t = t[first:].contiguous()
        return t.cpu().pin_memory() if CUDA else t

    parts = (ex.q13, ex.s13, ex.q2, ex.s2)
    return (Fp8Experts(*(t[:first].contiguous() for t in parts), ex.block),
            Fp8Experts(*(host(t) for t in parts), ex.block))


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("block", [(16, 16), (16, 64)])
def test_fp8_kernel_with_host_slots_gives_the_all_device_bits(T, block):
    """Slots from `first_host` on read from a second table (bytes and block scales alike): the same kernel math,
    so the same bits as every slot on the device, for every split including none (E) and all (0) in host memory;
    the per-expert loop with host slots likewise equals its all-device self."""
    E, k, h, i = 6, 2, 40, 24
    ex = make_experts(E, h, i, block, 11)
    ids, w = _route(T, E, k, 12 + T)
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(13)).to(DEV)
    want = K.fused_moe_fp8(x, ids, w, ex)
    loop = K.grouped_moe_fp8(x, ids, w, ex)
    for first in (0, 2, 5, E):
        dev, host = split_slots(ex, first)
        assert torch.equal(K.fused_moe_fp8(x, ids, w, dev, host=host, first_host=first), want), first
        assert torch.equal(K.grouped_moe_fp8(x, ids, w, dev, host, first), loop), first


def test_the_fp8_loop_takes_a_table_s_slots_in_expert_order():
    """With an expert table's slot map the loop sums the experts in id order (as the model without a table does):
    slots permuted, the same bits as the experts in their own order."""
    E, k, h, i = 6, 2, 32, 16
    ex = make_experts(E, h, i, (16, 16), 14)
    ids, w = _route(4, E, k, 15)
    x = torch.randn(4, h, generator=torch.Generator().manual_seed(16)).to(DEV)
    expert_of_slot = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    slot_of = torch.argsort(expert_of_slot)
    perm = Fp8Experts(*(t[expert_of_slot.long().to(DEV)] for t in (ex.q13, ex.s13, ex.q2, ex.s2)), ex.block)
    dev, host = split_slots(perm, 4)
    slots = slot_of.to(DEV)[ids.long()].to(torch.int32)
    got = K.grouped_moe_fp8(x, slots, w, dev, host, 4, expert_of_slot.to(DEV))
    assert torch.equal(got, K.grouped_moe_fp8(x, ids, w, ex))


def test_fp8_host_slots_that_do_not_continue_the_device_table_are_refused():
    ex = make_experts(4, 32, 16, (16, 16), 17)
    dev, host = split_slots(ex, 2)
    ids, w = _route(1, 4, 2, 18)
    x = torch.randn(1, 32).to(DEV)
    with pytest.raises(ValueError, match="do not continue"):
        K.fused_moe_fp8(x, ids, w, dev, host=host, first_host=3)
    bad = Fp8Experts(host.q13, host.s13[..., :1].contiguous(), host.q2, host.s2, host.block)
    with pytest.raises(ValueError, match="do not continue"):
        K.fused_moe_fp8(x, ids, w, dev, host=bad, first_host=2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fp8_kernel_with_host_slots_in_a_cuda_graph_gives_the_all_device_bits():
    """Qwen3-Next-80B's expert shape (H 2048, I 512, 512 experts, top 10, 128 x 128 blocks), a quarter and a half of
    the slots in pinned host memory read over UVA, 1/4/16 tokens, captured in a CUDA graph and replayed: the same
    bits as the all-device call, with host slots selected in every step."""
    E, k, h, i = 512, 10, 2048, 512
    ex = make_experts(E, h, i, (128, 128), 1)
    for first in (384, 256):
        dev, host = split_slots(ex, first)
        for T in (1, 4, 16):
            ids, w = _route(T, E, k, 20 + T)
            ids[:, 0] = first + torch.arange(T, device=DEV) % (E - first)      # a host slot in every token
            x = torch.randn(T, h, generator=torch.Generator().manual_seed(T)).to(DEV, torch.bfloat16)
            want = K.fused_moe_fp8(x, ids, w, ex)
            K.fused_moe_fp8(x, ids, w, dev, host=host, first_host=first)      # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = K.fused_moe_fp8(x, ids, w, dev, host=host, first_host=first)
            for _ in range(3):
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, want), (first, T)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fp8_kernel_at_qwen3_next_80b_shape_against_the_reference_and_the_bf16_kernel():
    """Qwen3-Next-80B-A3B's experts (H 2048, I 512, 512 experts, top 10, 128 x 128 blocks), 1/4/16 tokens: the FP8
    kernel against the reference, bit-stable over repeats, and its time against the bf16 kernels on the same
    experts dequantized (prints us and the bytes' TB/s)."""
    E, k, h, i = 512, 10, 2048, 512
    ex = make_experts(E, h, i, (128, 128), 0)
    w13 = torch.stack([ex.w13(e) for e in range(E)]).to(torch.bfloat16)
    w2 = torch.stack([ex.w2(e) for e in range(E)]).to(torch.bfloat16)
    for T in (1, 4, 16):
        ids, w = _route(T, E, k, T)
        x = torch.randn(T, h, generator=torch.Generator().manual_seed(T)).to(DEV, torch.bfloat16)
        out = K.fused_moe_fp8(x, ids, w, ex)
        ref = fused_moe_fp8_ref(x, ids, w, ex)
        assert _rel(out, ref) < 1e-2, T                  # bf16 output rounding
        assert torch.equal(out, K.fused_moe_fp8(x, ids, w, ex))
        bf = K.fused_moe(x, ids, w.to(torch.bfloat16), w13, w2)
        assert _rel(bf, fused_moe_ref(x, ids, w, w13, w2)) < 1e-2
        times = {}
        for name, fn in (("fp8", lambda: K.fused_moe_fp8(x, ids, w, ex)),
                         ("bf16", lambda: K.fused_moe(x, ids, w.to(torch.bfloat16), w13, w2))):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name] = start.elapsed_time(end) / 50 * 1e3
        sel = len(torch.unique(ids))
        fp8_bytes = sel * 3 * h * i
        print(f"T={T:2d} experts={sel:3d} fp8 {times['fp8']:.1f} us ({fp8_bytes / times['fp8'] / 1e6:.2f} TB/s) "
              f"bf16 {times['bf16']:.1f} us ({2 * fp8_bytes / times['bf16'] / 1e6:.2f} TB/s)")


def test_the_fp8_kernels_compile_for_the_h200():
    """The FP8 mode of both decode kernels compiles for sm_90 without a GPU (a subprocess, the interpreter off) at
    Qwen3-Next-80B's expert shape and every token bucket's launch config: float8 conversions in the code, no
    register spills."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import moe as M

H, I, k, br, bc = 2048, 512, 10, 128, 128
out = []
for bucket in (1, 4, 16):
    for name in ("up", "down"):
        if name == "up":
            fn, (bi, bh, warps) = M._moe_up_kernel, M.UP_CFG[bucket]
            sig = dict(x_ptr="*bf16", ids_ptr="*i32", w13_ptr="*u8", sw13_ptr="*u8", hw13_ptr="*u8",
                       act_ptr="*fp32", stride_xt="i32", stride_we="i32", stride_wr="i32", FIRST_HOST="i32",
                       scale_ptr="*fp32", hscale_ptr="*fp32")
            const = dict(H=H, I=I, TOP_K=k, BLOCK_I=bi, BLOCK_H=bh, NB_R=I // br, NB_C=H // bc, BR=br, BC=bc,
                         FP8=True, ROW_SCALE=bc % bh == 0)
        else:
            fn, (bh, bi, warps) = M._moe_down_kernel, M.DOWN_CFG[bucket]
            sig = dict(act_ptr="*fp32", ids_ptr="*i32", wts_ptr="*bf16", w2_ptr="*u8", sw2_ptr="*u8",
                       hw2_ptr="*u8", out_ptr="*bf16", stride_we="i32", stride_wh="i32", stride_ot="i32",
                       FIRST_HOST="i32", scale_ptr="*fp32", hscale_ptr="*fp32")
            const = dict(H=H, I=I, TOP_K=k, BLOCK_H=bh, BLOCK_I=bi, NB_R=H // br, NB_C=I // bc, BR=br, BC=bc,
                         FP8=True, ROW_SCALE=bc % bi == 0)
        names = list(fn.arg_names)
        sig = {n: sig.get(n, "constexpr") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if sig[n][0] == "*" or n.startswith("stride")}
        c = triton.compile(ASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps))
        ptx = c.asm["ptx"]
        out.append(dict(name=name, bucket=bucket, row_scale=const["ROW_SCALE"], fp8_cvt="e4m3" in ptx,
                        **ptxas_info(ptx)))
print(json.dumps(out))
"""
    for r in run_compile_script(script, timeout=300):
        print(r)
        assert r["spill"] == 0 and r["fp8_cvt"], r


def test_bf16_activations_with_fp32_router_weights_and_the_shared_output_added():
    """As the layer calls it on a GPU: bf16 x, the router's fp32 weights (rounded to bf16 in the down launch, as the
    CPU path uses them) and the shared expert's bf16 output added before the one rounding."""
    E, k, h, i = 6, 3, 32, 16
    ex = make_experts(E, h, i, (16, 16), 8)
    ids, w = _route(2, E, k, 9)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, h, generator=g).to(DEV, torch.bfloat16)
    add = torch.randn(2, h, generator=g).to(DEV, torch.bfloat16)
    out = K.fused_moe_fp8(x, ids, w, ex, add=add)
    assert out.dtype == torch.bfloat16
    ref = fused_moe_fp8_ref(x.float(), ids, w.to(torch.bfloat16), ex) + add.float()
    assert _rel(out, ref) < 1e-2
    assert torch.equal(out, K.fused_moe_fp8(x, ids, w, ex, add=add))
