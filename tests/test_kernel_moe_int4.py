"""The INT4 fused MoE decode kernels (stage_worker/kernels/moe_int4.py) against their dequantize-then-matmul
reference, and the reference's packing against compressed-tensors' own. Without CUDA the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py turns it on); with CUDA, also at the full shape."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from shared.quant_scheme import WeightQuant  # noqa: E402
from stage_worker.kernels import moe_int4 as K  # noqa: E402
from stage_worker.kernels.moe import SKIP  # noqa: E402
from stage_worker.kernels.moe_int4_ref import (PackedExperts, dequantize_int4, dequantize_packed,  # noqa: E402
                                               fused_moe_int4_ref, pack_fp4, pack_int4)
from stage_worker.kernels.moe_ref import route_ref  # noqa: E402
from stage_worker.model import quant_weight as qw  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _experts(E: int, H: int, I: int, group: int, seed: int, dtype=torch.float32, asym=False) -> PackedExperts:
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=DEV) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g, device=DEV) / I ** 0.5).to(dtype)
    if asym:                                         # skewed weights: zero points far from the middle
        w13, w2 = w13 + w13.abs().mean(), w2 - w2.abs().mean()
    q13, s13 = pack_int4(w13, group, asym)
    q2, s2 = pack_int4(w2, group, asym)
    return PackedExperts(q13, s13, q2, s2, group)


def _fp4_experts(E: int, H: int, I: int, group: int, seed: int, group2: int | None = None) -> PackedExperts:
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=DEV) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, device=DEV) / I ** 0.5
    return PackedExperts(*pack_fp4(w13, group), *pack_fp4(w2, group2 or group), group, group2, fp4=True)


def test_the_packing_is_compressed_tensors_own():
    """Words and scales from pack_int4 are what the library writes for INT4 symmetric groups: its decompressor and
    the loader's reader (quant_weight) give the same weight as dequantize_int4."""
    from compressed_tensors.compressors import PackedQuantizationCompressor as P
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    q, s = pack_int4(w, 16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16)
    parts = {"weight_packed": q, "weight_scale": s, "weight_shape": torch.tensor([24, 64])}
    lib = P.decompress(parts, QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    ours = dequantize_int4(q, s, 16)
    assert torch.equal(ours, lib)
    assert torch.equal(qw.dequantize(parts, WeightQuant(bits=4, kind="int", group_size=16), torch.float32), ours)
    assert (ours - w).abs().max() <= s.max() / 2 + 1e-6         # round to nearest


def test_asymmetric_packing_is_the_library_s_too():
    """Asymmetric groups: compressed-tensors' decompressor, given the scales and the zero points (packed along the
    rows, as the library stores them) of pack_int4's scale rows, gives dequantize_int4's weight."""
    from compressed_tensors.compressors import PackedQuantizationCompressor as P
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2)) + 0.7
    q, sz = pack_int4(w, 16, asym=True)
    s, z = sz[:, :4], sz[:, 4:]
    assert PackedExperts(q[None], sz[None], q[None, :64, :3], sz[None, :64, :2], 16, 16).asym
    assert int(z.min()) < -1                                     # skewed: zero points off the middle
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    zp = pack_to_int32(z.to(torch.int8), 4, packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    parts = {"weight_packed": q, "weight_scale": s, "weight_zero_point": zp, "weight_shape": torch.tensor([24, 64])}
    lib = P.decompress(parts, QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    ours = dequantize_int4(q, sz, 16)
    assert torch.equal(ours, lib)
    assert (ours - w).abs().max() <= s.max() / 2 + 1e-6


def test_fp4_words_are_the_library_s_bytes():
    """NVFP4 `weight_packed` bytes read as int32 words are the kernels' words: every code and sign, through
    dequantize_packed, gives compressed-tensors' decompressed weight bit for bit (its bf16(code * bf16(scale) /
    global)), with s = bf16(scale) / global in float32 in the scale rows."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (24, 32), dtype=torch.uint8, generator=g)
    packed[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) + torch.arange(8, dtype=torch.uint8)  # all codes
    scale = (torch.rand(24, 4, generator=g) * 4 + 0.01).to(torch.float8_e4m3fn)
    glob = torch.tensor([37.0])
    lib = (unpack_fp4_from_uint8(packed, 24, 64, dtype=torch.bfloat16).float() *
           (scale.to(torch.bfloat16) / glob).repeat_interleave(16, 1)).to(torch.bfloat16)
    s = scale.to(torch.bfloat16).float() / glob
    ours = dequantize_packed(packed.view(torch.int32), s, 16, True, torch.bfloat16)
    assert torch.equal(ours, lib)
    wq = WeightQuant(bits=4, kind="float", strategy="tensor_group", group_size=16, format="nvfp4-pack-quantized")
    parts = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": glob}
    assert torch.equal(qw.dequantize(parts, wq, torch.bfloat16), ours)
    assert torch.equal(dequantize_int4(packed.view(torch.int32), s, 16, True).to(torch.bfloat16), ours)


def test_the_fp4_decode_builds_every_code():
    """The kernels' table-free E2M1 decode (an fp16 built from the code's bits) gives all 16 codes' values: one
    expert whose rows each hold one code, scales 1, one-hot inputs."""
    H, I = 64, 16
    codes = torch.arange(16, dtype=torch.int32).repeat_interleave(2)[:, None]      # row r: code r // 2
    word = (codes << torch.arange(0, 32, 4, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    q13 = word[:, None].expand(2 * I, H // 8).contiguous()[None].to(DEV)
    s13 = torch.ones(1, 2 * I, H // 16, device=DEV)
    q2 = torch.full((1, H, I // 8), 0x22222222, dtype=torch.int32, device=DEV)     # all 1.0
    ex = PackedExperts(q13, s13, q2, torch.ones(1, H, I // 16, device=DEV), 16, fp4=True)
    w = dequantize_int4(ex.q13[0], ex.s13[0], 16, True)
    assert torch.equal(w[::2, 0], qw.E2M1_VALUES.to(DEV))
    x = torch.zeros(1, H, device=DEV)
    x[0, 5] = 1.0
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    out = K.fused_moe_int4(x, ids, torch.ones(1, 1, device=DEV), ex)
    torch.testing.assert_close(out, fused_moe_int4_ref(x, ids, torch.ones(1, 1, device=DEV), ex), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("t,group,group2,hot", [(1, 16, 16, None), (2, 16, 32, 5), (1, 32, 16, 12),
                                                 (5, 16, 16, 5)])   # the largest config bucket (16: any T > 4)
def test_fp4_kernel_matches_the_reference(t, group, group2, hot):
    """FP4 experts (E2M1 codes, float32 scales; NVFP4's group 16, MXFP4's 32) through the INT4 decode kernels:
    host slots from `hot` on, a skipped token, the widths' last groups partial (I 40 in groups of 16 or 32), at
    each launch-config bucket (`moe._bucket`: 1, up to 4, more; 5 tokens take the largest's configs as 17 would,
    with under a third of the programs: the grids are per token, nothing else depends on T)."""
    E, H, I, k = 16, 64, 40, 4
    ex = _fp4_experts(E, H, I, group, seed=t + group, group2=group2)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(t, H, generator=gen).to(DEV)
    logits = torch.randn(t, E, generator=gen)
    logits[:, E - 1] += 10
    w, ids = route_ref(logits.to(DEV), k, True)
    ref = fused_moe_int4_ref(x, ids, w, ex)
    parts = (ex.q13, ex.s13, ex.q2, ex.s2)
    if hot is None:
        out = K.fused_moe_int4(x, ids, w, ex)
    else:
        pin = (lambda a: a.cpu().pin_memory()) if CUDA else (lambda a: a.clone())
        dev = PackedExperts(*(a[:hot].contiguous() for a in parts), group, group2, fp4=True)
        host = PackedExperts(*(pin(a[hot:]) for a in parts), group, group2, fp4=True)
        out = K.fused_moe_int4(x, ids, w, dev, host=host, first_host=hot)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    skipped = ids.clone()
    skipped[-1, :] = SKIP
    out = K.fused_moe_int4(x, skipped, w, ex)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    if t > 1:
        torch.testing.assert_close(out[:-1], ref[:-1], rtol=1e-4, atol=1e-5)


def test_fp4_in_bf16_is_within_bf16_rounding_of_the_library_loop():
    """bf16 activations: the kernels (fp32 code * scale) and the CPU loop (the library's bf16 weights) agree
    within bf16 rounding."""
    E, H, I, k = 8, 64, 32, 3
    ex = _fp4_experts(E, H, I, 16, seed=11)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, H, generator=gen).to(DEV, torch.bfloat16)
    w, ids = route_ref(torch.randn(3, E, generator=gen).to(DEV), k, True)
    out = K.fused_moe_int4(x, ids, w, ex).float()
    loop = K.grouped_moe_int4(x, ids, w, ex).float()
    assert ((out - loop).norm() / loop.norm()).item() < 1e-2


@pytest.mark.parametrize("t,group,hot,asym", [(1, 8, None, False), (2, 16, 5, False), (1, 16, 12, False),
                                              (5, 16, 5, False),   # the largest config bucket (16: any T > 4)
                                              (2, 16, 5, True), (1, 32, None, True)])     # zero points
def test_kernel_matches_the_reference(t, group, hot, asym):
    """Decode shapes, with some slots in a second (host) table from `hot` on and a skipped slot (CUDA-graph
    padding). At 2 tokens the skipped last token is in the split launch itself (the first token still reads the
    host row every top-k holds), not in a second launch over one table that repeated the first token's work.
    Asymmetric experts (zero points in the scale rows) likewise."""
    E, H, I, k = 16, 64, 32, 4
    ex = _experts(E, H, I, group, seed=t + group, asym=asym)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, H, generator=g).to(DEV)
    logits = torch.randn(t, E, generator=g)
    logits[:, E - 1] += 10                                     # the last slot (a host row when split) in every top-k
    w, ids = route_ref(logits.to(DEV), k, True)
    ref = fused_moe_int4_ref(x, ids, w, ex)
    skipped = ids.clone()
    skipped[-1, :] = SKIP
    if hot is None:
        out = K.fused_moe_int4(x, ids, w, ex)
    else:
        dev = PackedExperts(ex.q13[:hot].contiguous(), ex.s13[:hot].contiguous(), ex.q2[:hot].contiguous(),
                            ex.s2[:hot].contiguous(), group)
        pin = (lambda a: a.cpu().pin_memory()) if CUDA else (lambda a: a.clone())
        host = PackedExperts(pin(ex.q13[hot:]), pin(ex.s13[hot:]), pin(ex.q2[hot:]), pin(ex.s2[hot:]), group)
        if t > 1:                                              # the skipped token in the same (split) launch
            out = K.fused_moe_int4(x, skipped, w, dev, host=host, first_host=hot)
            torch.testing.assert_close(out[:-1], ref[:-1], rtol=1e-4, atol=1e-5)
            assert torch.equal(out[-1], torch.zeros_like(out[-1]))
            return
        out = K.fused_moe_int4(x, ids, w, dev, host=host, first_host=hot)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out = K.fused_moe_int4(x, skipped, w, ex)                  # one token: every pair skipped
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("prefetch", [0, 1])    # the depths the launch configs use (2, swept only, on the GPU)
def test_blocks_span_experts_and_row_ends(monkeypatch, prefetch):
    """Launch configs smaller than the rows: several blocks a row with a partial last one (up: 12 words in blocks
    of 8, scale quads of 4 words at group 32), down blocks spanning two experts' rows (5 words each, group 16 with
    a partial last group), host rows, one skipped slot, and activations poisoned with NaN before the launch (the
    kernels must not read a skipped slot's, which the up phase never writes); at each prefetch depth in use."""
    E, H, I, k, hot = 12, 96, 40, 3, 8
    g = torch.Generator(device=DEV).manual_seed(5)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=DEV) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, device=DEV) / I ** 0.5
    ex = PackedExperts(*pack_int4(w13, 32), *pack_int4(w2, 16), 32, 16)
    assert K.quad_words(H // 8, 32) == 4
    gc = torch.Generator().manual_seed(9)
    x = torch.randn(2, H, generator=gc).to(DEV)
    logits = torch.randn(2, E, generator=gc)
    logits[:, E - 1] += 10
    w, ids = route_ref(logits.to(DEV), k, True)
    ids[0, 1] = SKIP
    ref = fused_moe_int4_ref(x, ids.clamp_min(0), torch.where(ids == SKIP, 0.0, w), ex)
    real = K.activations
    monkeypatch.setattr(K, "activations", lambda *a: real(*a).fill_(float("nan")))
    monkeypatch.setattr(K, "UP_CFG", {b: (16, 8, 1) for b in (1, 4, 16)})      # 40 rows: blocks of 16, 16, 8
    monkeypatch.setattr(K, "DOWN_CFG", {b: (32, 8, 1) for b in (1, 4, 16)})
    monkeypatch.setattr(K, "PREFETCH", {b: prefetch for b in (1, 4, 16)})
    dev = PackedExperts(*(a[:hot].contiguous() for a in (ex.q13, ex.s13, ex.q2, ex.s2)), 32, 16)
    pin = (lambda a: a.cpu().pin_memory()) if CUDA else (lambda a: a.clone())
    host = PackedExperts(*(pin(a[hot:]) for a in (ex.q13, ex.s13, ex.q2, ex.s2)), 32, 16)
    out = K.fused_moe_int4(x, ids, w, dev, host=host, first_host=hot)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_router_slots_are_read_in_place_and_the_shared_output_added():
    """ids and weights as the first k columns of the router's k + 1 slots (the shared expert's last: not
    copied, not read) and `add` (the shared expert's output) summed inside the down launch."""
    E, H, I, k = 8, 64, 32, 3
    ex = _experts(E, H, I, 16, seed=4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, H, generator=g).to(DEV)
    w, ids = route_ref(torch.randn(2, E, generator=g).to(DEV), k, True)
    wide_ids = torch.cat([ids, torch.full((2, 1), -1, dtype=ids.dtype, device=DEV)], 1).to(torch.int32)
    wide_w = torch.cat([w, torch.full((2, 1), 7.0, device=DEV)], 1)
    add = torch.randn(2, H, generator=g).to(DEV)
    out = K.fused_moe_int4(x, wide_ids[:, :k], wide_w[:, :k], ex, add=add)
    torch.testing.assert_close(out, fused_moe_int4_ref(x, ids, w, ex) + add, rtol=1e-4, atol=1e-5)


def test_a_layer_s_int4_decode_in_six_launches(tiny_checkpoint):
    """SparseMoE's INT4 decode with a bf16 shared expert (`_packed_decode`: the router and shared gate as one
    GEMV, the router's k + 1 slots read in place, the shared expert's output added in the INT4 down launch)
    gives the PyTorch path's output, on the CPU under the interpreter (float32)."""
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.kernels.flags import KernelFlags

    if CUDA:
        pytest.skip("the GPU test above covers the kernel path on CUDA")
    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32,
                                                    dummy_int4=dummy_groups(cfg)), cfg)
    model.set_kernels(KernelFlags.parse("all"))
    moe = next(m for m in model.moe_layers().values() if m.shared_expert is not None)
    assert moe._packed_router() is not None and moe._packed_shared() is not None
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast = moe._packed_decode(x, None)
        ids = moe.last_expert_ids.clone()
        ref = moe(x)                                    # CPU: the PyTorch path
    assert torch.equal(ids.long(), moe.last_expert_ids.long())
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", ["all", "all,fused_router"])
def test_a_layer_s_int4_decode_with_a_packed_shared_expert(tiny_checkpoint, kernels):
    """The same six launches with the shared expert kept packed (a reports-mixed checkpoint's INT6: gate and up
    one packed GEMV, the down GEMV computing the activation and the gate weight as it loads) give the PyTorch
    path's output (packed layers dequantized a block of rows at a time), on the CPU under the interpreter; with
    `fused_router` the router GEMV and top-k are one launch (`moe.router_route`)."""
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, build_empty
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.checkpoint.random_init import fill_random
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.quant_linear import PackedLinear, dummy_specs

    if CUDA:
        pytest.skip("the GPU tests cover the kernel path on CUDA")
    cfg = load_config(tiny_checkpoint)
    groups = dummy_groups(cfg)
    model = build_empty(cfg, LoadOptions(dtype=torch.float32),
                        {i: groups for i in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(i)},
                        lambda m: dummy_specs(m, torch.float32))
    fill_random(model, seed=1)
    model.set_kernels(KernelFlags.parse(kernels))
    moe = next(m for m in model.moe_layers().values() if m.shared_expert is not None)
    assert isinstance(moe.shared_expert.down_proj, PackedLinear) and moe._packed_shared() is None
    assert moe._packed_shared_int() is not None and moe._packed_router() is not None
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast = moe._packed_decode(x, None)
        ids = moe.last_expert_ids.clone()
        ref = moe(x)                                    # CPU: the PyTorch path
    assert torch.equal(ids.long(), moe.last_expert_ids.long())
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_shapes_the_kernel_cannot_take_are_refused():
    ex = _experts(4, 64, 32, 8, seed=0)
    with pytest.raises(ValueError, match="multiples of 8"):
        K.fused_moe_int4(torch.zeros(1, 60, device=DEV), torch.zeros(1, 2, dtype=torch.int32, device=DEV),
                         torch.ones(1, 2, device=DEV), ex)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("form", ["sym", "asym", "fp4"])
def test_full_shape_on_the_gpu(form):
    """The reports' shape (H 2560, I 640, 512 experts, top-10, group 128) in bf16, symmetric, with zero points, and
    FP4 in NVFP4's groups of 16: agreement with the reference, CUDA-graph replays bit for bit; bench/moe_int4.py
    times it against the bf16 kernels (`--asym`, `--fp4`)."""
    E, H, I, k = 512, 2560, 640, 10
    ex = _fp4_experts(E, H, I, 16, seed=3) if form == "fp4" else \
        _experts(E, H, I, 128, seed=3, dtype=torch.bfloat16, asym=form == "asym")
    for t in (1, 4, 16, 100):          # the three launch-config buckets, and a short prompt (DECODE_MAX_TK)
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, H, generator=g).to(DEV, torch.bfloat16)
        w, ids = route_ref(torch.randn(t, E, generator=g).to(DEV), k, True)
        out = K.fused_moe_int4(x, ids, w.to(torch.bfloat16), ex)
        ref = fused_moe_int4_ref(x, ids, w.to(torch.bfloat16), ex)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        # fixed-order sums (no atomics): CUDA-graph replays give the eager result bit for bit
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = K.fused_moe_int4(x, ids, w.to(torch.bfloat16), ex)
        for _ in range(3):
            replayed.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, out), t


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("shared", ["bf16", "int6"])
def test_a_packed_layer_s_shared_expert_runs_the_bf16_fused_kernel(tiny_checkpoint, shared):
    """Beside INT4 experts, a bf16 shared expert decodes as the one slot of a bf16 fused-MoE launch pair
    (`SparseMoE._packed_shared`), a packed one (int6, as a reports-mixed checkpoint has it) as two W6A16 GEMVs:
    the layer's output in six launches (`_packed_decode`) and in twelve (moe_int4_fused off)
    stays within bf16 rounding of the PyTorch path, at 1 and 4 tokens."""
    from stage_worker.checkpoint.loader import LoadOptions, build_empty, load_model
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.checkpoint.random_init import fill_random
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.quant_linear import dummy_specs
    from shared.model_config import load_config

    cfg = load_config(tiny_checkpoint)
    opts = LoadOptions(device="cuda", load_format="dummy", dtype=torch.bfloat16, dummy_int4=dummy_groups(cfg))
    if shared == "bf16":
        model = load_model(tiny_checkpoint, opts, cfg)
    else:
        model = build_empty(cfg, opts, {i: dummy_groups(cfg) for i in range(cfg.num_hidden_layers)
                                        if cfg.is_sparse_moe(i)}, lambda m: dummy_specs(m, torch.bfloat16))
        fill_random(model, seed=0)
    model.set_kernels(KernelFlags.parse("all"))
    moe = next(m for m in model.moe_layers().values() if m.shared_expert is not None)
    assert moe.packed_group and moe._packed_router() is not None
    assert (moe._packed_shared() if shared == "bf16" else moe._packed_shared_int()) is not None
    for t in (1, 4):
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            fast = moe(x)
            moe.kernels = KernelFlags.parse("-moe_int4_fused")
            twelve = moe(x)
            moe.kernels = KernelFlags.parse("none")
            ref = moe(x)
            moe.kernels = KernelFlags.parse("all")
        for got in (fast, twelve):
            err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
            assert err < 2e-2, (t, float(err))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_shared_expert_on_the_side_stream_gives_the_same_bits(tiny_checkpoint):
    """Kernel flag `side_stream`: a packed (INT6) shared expert's two GEMVs on a second stream beside the router
    and the INT4 up launch (`SparseMoE._packed_decode`) give the one-stream result bit for bit, eagerly and
    replayed from a CUDA graph captured with the fork and join (a parallel branch), at 1 and 4 tokens."""
    from stage_worker.checkpoint.loader import LoadOptions, build_empty
    from stage_worker.checkpoint.packed_experts import dummy_groups
    from stage_worker.checkpoint.random_init import fill_random
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.model.quant_linear import dummy_specs
    from shared.model_config import load_config

    cfg = load_config(tiny_checkpoint)
    opts = LoadOptions(device="cuda", load_format="dummy", dtype=torch.bfloat16, dummy_int4=dummy_groups(cfg))
    model = build_empty(cfg, opts, {i: dummy_groups(cfg) for i in range(cfg.num_hidden_layers)
                                    if cfg.is_sparse_moe(i)}, lambda m: dummy_specs(m, torch.bfloat16))
    fill_random(model, seed=0)
    moe = next(m for m in model.moe_layers().values() if m.shared_expert is not None)
    for t in (1, 4):
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            model.set_kernels(KernelFlags.parse("all"))
            one = moe(x)
            model.set_kernels(KernelFlags.parse("all,side_stream"))
            side = moe(x)
            assert torch.equal(side, one), t
            moe(x)                                    # warm-up on this stream before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = moe(x)
            for _ in range(3):
                replayed.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(replayed, one), t
