"""The fused Gated DeltaNet decode kernels: kernels = reference (fp32 and bf16, both gate activations, shuffled slots,
strided projection rows, state split into column blocks of BV < dv, nv/nk = 1, 2 and 4), reference = the model's
PyTorch decode path over several steps, and GatedDeltaNet with the kernel flag on = flag off, with
`fuse_projections` sharing storage and leaving the state_dict alone.

Without CUDA the kernel runs on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported): tiny shapes.
With CUDA the same tests run natively and the `gpu` tests add the real shapes, a no-host-sync check and a graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from shared.model_config import Qwen3NextConfig  # noqa: E402
from stage_worker.kernels import deltanet_decode as K  # noqa: E402
from stage_worker.kernels.deltanet_decode_ref import gdn_decode_ref  # noqa: E402
from stage_worker.kernels.flags import KernelFlags  # noqa: E402
from stage_worker.model.batch import StepBatch  # noqa: E402
from stage_worker.model.cache import CacheSpec, DeltaNetState  # noqa: E402
from stage_worker.model.deltanet import GatedDeltaNet  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
NK, NV, DK, DV, WIDTH, HIDDEN = 2, 4, 16, 16, 4, 32
EPS = 1e-6
ON = KernelFlags(deltanet=True)


def tiny_config(nk: int = NK, nv: int = NV, dk: int = DK, dv: int = DV, hidden: int = HIDDEN) -> Qwen3NextConfig:
    return Qwen3NextConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=1, linear_num_key_heads=nk,
                           linear_num_value_heads=nv, linear_key_head_dim=dk, linear_value_head_dim=dv,
                           linear_conv_kernel_dim=WIDTH, layer_types=["linear_attention"], dtype="float32")


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.02) -> None:
    """Within bf16 tolerance and bit-equal almost everywhere: a rounding point that moved shifts a third or more of
    the elements by one ulp, which a tolerance alone would let through."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    frac = (got != want).float().mean().item()
    assert frac <= max_mismatch, f"{frac:.1%} of elements differ from the reference: a rounding point moved?"


def random_inputs(B: int, dtype: torch.dtype, seed: int, nk: int = NK, nv: int = NV, dk: int = DK, dv: int = DV,
                  num_slots: int = 7, conv_dtype: torch.dtype | None = None) -> dict:
    """Projection rows as strided views of one [B, conv_dim + value_dim + 2*nv] output (as the fused GEMV gives),
    states with non-trivial contents, the conv weight as the [C, width] view of a Conv1d weight."""
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * nk * dk + nv * dv
    proj = torch.randn(B, conv_dim + nv * dv + 2 * nv, generator=g).to(DEV, dtype)
    mixed, z, b, a = proj.split([conv_dim, nv * dv, nv, nv], dim=-1)
    conv_weight = (torch.randn(conv_dim, 1, WIDTH, generator=g) * 0.5).to(DEV, dtype)[:, 0]
    conv_state = torch.randn(num_slots, conv_dim, WIDTH - 1, generator=g).to(DEV, conv_dtype or dtype)
    recurrent = (torch.randn(num_slots, nv, dk, dv, generator=g) * 0.3).to(DEV)
    return dict(mixed=mixed, z=z, b=b, a=a, conv_weight=conv_weight,
                A_log=(torch.rand(nv, generator=g) * 2 - 1).to(DEV, dtype),
                dt_bias=torch.randn(nv, generator=g).to(DEV, dtype),
                norm_weight=(1 + 0.2 * torch.randn(dv, generator=g)).to(DEV, dtype), eps=EPS,
                conv_state=conv_state, recurrent_state=recurrent)


def check_against_reference(inp: dict, act: str, nv: int = NV, dv: int = DV) -> None:
    """Kernels = reference on 3 sequences at slots [5, 0, 3] of 7: output, both states, other slots untouched."""
    dtype = inp["mixed"].dtype
    slots = torch.tensor([5, 0, 3], device=DEV)                     # not contiguous, not sorted
    ref_conv, ref_rec = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    before_conv, before_rec = ref_conv.clone(), ref_rec.clone()
    want = gdn_decode_ref(**{**inp, "conv_state": ref_conv, "recurrent_state": ref_rec}, slots=slots,
                          gate_activation=act)
    got = K.gdn_decode(**inp, slots=slots, gate_activation=act)
    assert got.dtype == dtype and got.shape == (3, nv * dv)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_close(got, want)
    assert torch.equal(inp["conv_state"], ref_conv)                 # a shift and one cast: exact
    tol = 1e-5 if dtype == torch.float32 else 1e-2                  # bf16: a v one ulp off moves S by ~1e-3
    torch.testing.assert_close(inp["recurrent_state"], ref_rec, rtol=tol, atol=tol)
    others = torch.tensor([i for i in range(7) if i not in (5, 0, 3)], device=DEV)
    assert torch.equal(inp["conv_state"][others], before_conv[others])
    assert torch.equal(inp["recurrent_state"][others], before_rec[others])
    assert not torch.equal(inp["recurrent_state"][slots], before_rec[slots])


@pytest.mark.parametrize("dtype,conv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_kernel_matches_reference(dtype, conv_dtype, act):
    check_against_reference(random_inputs(3, dtype, seed=1 + (dtype == torch.bfloat16), conv_dtype=conv_dtype), act)


# nv/nk = 1, 4, 2 in fp32; bf16 (its rounding: test_kernel_matches_reference's cases) at one of them, the
# interpreter's bf16 being 2-3x its fp32 time
@pytest.mark.parametrize("dtype,nk,nv,bv", [(torch.float32, 2, 2, 8), (torch.float32, 1, 4, 16),
                                            (torch.float32, 2, 4, 8), (torch.bfloat16, 1, 4, 16)])
def test_kernel_column_blocks_and_head_groups(nk, nv, bv, dtype, monkeypatch):
    """dv = 32 split into column blocks of BV = 8 or 16 (each block of S updated by its own program), and key
    heads read by 1, 2 or 4 value heads (the q/k conv tails written once per key head, by the group's first)."""
    dv = 32
    monkeypatch.setattr(K, "BV", bv)
    inp = random_inputs(3, dtype, seed=20 + nv + bv, nk=nk, nv=nv, dv=dv)
    check_against_reference(inp, "silu", nv=nv, dv=dv)


def test_kernel_takes_int32_slots_and_an_empty_batch():
    inp = random_inputs(2, torch.float32, seed=3)
    ref_conv, ref_rec = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    slots = torch.tensor([6, 2], device=DEV)
    want = gdn_decode_ref(**{**inp, "conv_state": ref_conv, "recurrent_state": ref_rec}, slots=slots)
    torch.testing.assert_close(K.gdn_decode(**inp, slots=slots.int()), want, rtol=1e-5, atol=1e-5)
    empty = random_inputs(0, torch.float32, seed=4)
    assert K.gdn_decode(**empty, slots=torch.zeros(0, dtype=torch.long, device=DEV)).shape == (0, NV * DV)


# ---- the reference against the model --------------------------------------------------------------------------

def tiny_layer(dtype: torch.dtype, act: str = "silu", seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(tiny_config(), act)
    with torch.no_grad():   # gates and norm weight away from their identity-ish initial values
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.normal_()
        layer.norm.weight.normal_(1, 0.2)
    return layer.to(DEV, dtype).eval()


def prefilled(layer: GatedDeltaNet, dtype: torch.dtype, lens: list[int], slots: list[int]) -> DeltaNetState:
    """States after one prefill step of the given prompt lengths (prefill never takes the decode kernel)."""
    state = DeltaNetState(tiny_config(), CacheSpec(num_blocks=1, block_size=64, num_slots=6, dtype=dtype, device=DEV))
    batch = StepBatch.build([([1] * n, 0, s, [0]) for n, s in zip(lens, slots)], 64, DEV)
    x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(9)).to(DEV, dtype)
    with torch.no_grad():
        layer(x, batch, state)
    return state


def decode_batch(ctx: list[int], slots: list[int]) -> StepBatch:
    return StepBatch.build([([1], c, s, [0]) for c, s in zip(ctx, slots)], 64, DEV)


def clone_state(state: DeltaNetState) -> DeltaNetState:
    out = object.__new__(DeltaNetState)
    out.conv, out.recurrent = state.conv.clone(), state.recurrent.clone()
    return out


@pytest.mark.parametrize("dtype,act", [(torch.float32, "silu"), (torch.float32, "sigmoid"), (torch.bfloat16, "silu")])
def test_reference_is_the_model_decode_path(dtype, act):
    layer = tiny_layer(dtype, act)
    lens, slots = [5, 2, 3], [4, 1, 2]
    model_state = prefilled(layer, dtype, lens, slots)
    ref_state = clone_state(model_state)
    g = torch.Generator().manual_seed(11)
    for step in range(4):
        x = torch.randn(3, HIDDEN, generator=g).to(DEV, dtype)
        batch = decode_batch([n + step for n in lens], slots)
        with torch.no_grad():
            want = layer(x, batch, model_state)
            got = layer.out_proj(gdn_decode_ref(
                layer.in_proj_qkv(x), layer.in_proj_z(x), layer.in_proj_b(x), layer.in_proj_a(x),
                layer.conv1d.weight[:, 0], layer.A_log, layer.dt_bias, layer.norm.weight, layer.norm.eps,
                ref_state.conv, ref_state.recurrent, batch.device_slots(), act))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
            torch.testing.assert_close(ref_state.recurrent, model_state.recurrent, rtol=1e-5, atol=1e-5)
        else:
            assert_bf16_close(got, want)
            torch.testing.assert_close(ref_state.recurrent, model_state.recurrent, rtol=1e-2, atol=1e-2)
        assert torch.equal(ref_state.conv, model_state.conv)


# ---- the integrated layer -------------------------------------------------------------------------------------

@pytest.fixture
def fast_path_calls(monkeypatch) -> list[int]:
    """Let a flag-on layer take the kernel on CPU tensors (interpreter), keep flash-linear-attention out of the
    other steps (so flag on and off share them bit for bit on CUDA too), and count the fused decode steps."""
    monkeypatch.setattr(GatedDeltaNet, "interpret_on_cpu", True)
    monkeypatch.setattr(GatedDeltaNet, "_fla_rule", staticmethod(lambda kind: None))
    calls: list[int] = []
    fast = GatedDeltaNet._fused_decode

    def counted(self, *args):
        calls.append(1)
        return fast(self, *args)

    monkeypatch.setattr(GatedDeltaNet, "_fused_decode", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_with_flag_on_equals_flag_off(dtype, fast_path_calls):
    off = tiny_layer(dtype, "sigmoid")
    on = tiny_layer(dtype, "sigmoid")
    on.kernels = ON
    lens, slots = [5, 2, 3], [4, 1, 2]
    s_off = prefilled(off, dtype, lens, slots)
    s_on = prefilled(on, dtype, lens, slots)
    assert not fast_path_calls                                      # prefill keeps its own path
    g = torch.Generator().manual_seed(12)
    for step in range(2):             # states carried from step to step: the second reads what the first wrote
        x = torch.randn(3, HIDDEN, generator=g).to(DEV, dtype)
        batch = decode_batch([n + step for n in lens], slots)
        with torch.no_grad():
            want, got = off(x, batch, s_off), on(x, batch, s_on)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
            torch.testing.assert_close(s_on.recurrent, s_off.recurrent, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(s_on.conv, s_off.conv, rtol=1e-5, atol=1e-5)   # the GEMV's rounding
        else:   # bit-equal on the CPU; cuBLAS may pick another GEMV algorithm for the fused weight
            mismatch = 1.0 if CUDA else 0.02
            assert_bf16_close(got, want, mismatch)
            torch.testing.assert_close(s_on.recurrent, s_off.recurrent, rtol=2e-2, atol=2e-2)
            assert_bf16_close(s_on.conv, s_off.conv, mismatch)
    assert len(fast_path_calls) == 2 and on._is_fused()

    # A fresh one-token prompt (no state yet) and a mixed batch keep the PyTorch path, bit for bit.
    for batch in (StepBatch.build([([1], 0, 0, [0]), ([1], 9, 4, [0])], 64, DEV),
                  StepBatch.build([([1, 2, 3], 9, 4, [0]), ([1], 9, 1, [0])], 64, DEV)):
        x = torch.randn(len(batch.token_ids), HIDDEN, generator=g).to(DEV, dtype)
        s_on.recurrent.copy_(s_off.recurrent)
        s_on.conv.copy_(s_off.conv)
        with torch.no_grad():
            assert torch.equal(on(x, batch, s_on), off(x, batch, s_off))
    assert len(fast_path_calls) == 2


def test_fuse_projections_shares_storage_and_keeps_the_state_dict():
    layer = tiny_layer(torch.float32)
    layer.in_proj_b.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    n_params = sum(p.numel() for p in layer.parameters())
    fused = layer.fuse_projections()
    rows = 2 * NK * DK + NV * DV + NV * DV + 2 * NV
    assert fused.shape == (rows, HIDDEN)
    after = layer.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    linears = (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a)
    assert all(m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for m in linears)
    assert torch.equal(torch.cat([m.weight for m in linears]), fused)
    assert sum(p.numel() for p in layer.parameters()) == n_params      # views, not extra parameters
    assert [m.weight.requires_grad for m in linears] == [True, True, False, True]
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in linears)

    assert layer.fuse_projections() is fused                           # idempotent
    layer.load_state_dict({k: v * 2 for k, v in before.items()})      # copies into the views: still fused
    assert layer._is_fused()
    assert torch.equal(fused, torch.cat([before[f"{m}.weight"] for m in
                                         ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]) * 2)
    layer.to(torch.float64)                                            # new storages: no longer fused
    assert not layer._is_fused()
    assert layer.fuse_projections().dtype == torch.float64 and layer._is_fused()


def _packed(m: torch.nn.Linear, bits: int, group: int):
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn
    from stage_worker.model.quant_linear import PackedLinear, PackedSpec

    pw = quantize_rtn(m.weight.detach().float().cpu(), bits, group)
    out = PackedLinear(m.in_features, m.out_features, PackedSpec(bits, group, pw.words.shape[1], pw.groups,
                                                                 pw.scales.dtype))
    out.weight_packed.copy_(pw.words)
    out.weight_scale.copy_(pw.scales)
    return out.to(DEV)


@pytest.mark.parametrize("kernel", [False, True])
def test_packed_in_projections_are_read_as_one_packed_weight(kernel, monkeypatch):
    """In-projections kept packed (a reports-mixed checkpoint's INT6 group 128, issue 17) are fused into one
    PackedWeight over their words and scales (views: no copy, state_dict unchanged) and decode reads them in one
    GEMV: the four modules' own outputs, on the CPU path and through the GEMV kernel (under the interpreter
    without CUDA); projections of different schemes stay four calls."""
    from stage_worker.kernels.quant_gemv_ref import PackedWeight
    from stage_worker.model.quant_linear import PackedLinear

    monkeypatch.setattr(PackedLinear, "interpret_on_cpu", kernel)
    layer = tiny_layer(torch.float32)
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    for n in names:
        setattr(layer, n, _packed(getattr(layer, n), 6, 16))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = [getattr(layer, n)(x) for n in names]
    fused = layer.fuse_projections()
    assert isinstance(fused, PackedWeight) and layer._is_fused() and layer.fuse_projections() is fused
    assert fused.words.shape[0] == sum(m.out_features for m in layer._in_projs())
    assert all(m.weight_packed.untyped_storage().data_ptr() == fused.words.untyped_storage().data_ptr()
               for m in layer._in_projs())
    after = layer.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    for got, ref in zip(layer._decode_projections(x), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    mixed = tiny_layer(torch.float32)
    for n, bits in zip(names, (6, 6, 8, 6)):
        setattr(mixed, n, _packed(getattr(mixed, n), bits, 16))
    assert mixed.fuse_projections() is None and not mixed._is_fused()
    for got, n in zip(mixed._decode_projections(x), names):
        torch.testing.assert_close(got, getattr(mixed, n)(x))


# ---- real shapes on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,bv", [(1, 32), (4, 32), (16, 32), (1, 16), (4, 64), (4, 128)])
def test_real_shapes_bf16(B, bv, monkeypatch):
    """nk=16, nv=32, dk=dv=128 after a hidden-2560 GEMV: kernels against reference, in bf16, at the default BV
    and at others a sweep may pick."""
    monkeypatch.setattr(K, "BV", bv)
    nk, nv, dk, dv, hidden = 16, 32, 128, 128, 2560
    g = torch.Generator(device="cuda").manual_seed(B)
    rows = 2 * nk * dk + 2 * nv * dv + 2 * nv
    x = torch.randn(B, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(rows, hidden, device="cuda", generator=g) / hidden ** 0.5).bfloat16()
    inp = random_inputs(B, torch.bfloat16, seed=B, nk=nk, nv=nv, dk=dk, dv=dv, num_slots=2 * B + 1)
    conv_dim = 2 * nk * dk + nv * dv
    inp["mixed"], inp["z"], inp["b"], inp["a"] = F.linear(x, w).split([conv_dim, nv * dv, nv, nv], dim=-1)
    slots = torch.randperm(2 * B + 1, device="cuda", generator=g)[:B]
    ref_conv, ref_rec = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    want = gdn_decode_ref(**{**inp, "conv_state": ref_conv, "recurrent_state": ref_rec}, slots=slots)
    got = K.gdn_decode(**inp, slots=slots)
    assert_bf16_close(got, want)
    assert torch.equal(inp["conv_state"], ref_conv)
    torch.testing.assert_close(inp["recurrent_state"], ref_rec, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_no_host_sync_and_graph_capture():
    inp = random_inputs(4, torch.bfloat16, seed=5, nk=16, nv=32, dk=128, dv=128, num_slots=9)
    slots = torch.tensor([7, 2, 0, 5], device="cuda")
    K.gdn_decode(**inp, slots=slots)                                   # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")                            # any host sync raises
    try:
        K.gdn_decode(**inp, slots=slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.gdn_decode(**inp, slots=slots)
    conv, rec = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    want = gdn_decode_ref(**{**inp, "conv_state": conv, "recurrent_state": rec}, slots=slots)
    graph.replay()                                                     # both launches, from the same old state
    assert_bf16_close(out, want)
    assert torch.equal(inp["conv_state"], conv)
    torch.testing.assert_close(inp["recurrent_state"], rec, rtol=1e-2, atol=1e-2)
