"""Programmatic dependent launch (kernel flag `pdl`, stage_worker/kernels/common.py `pdl_usable`): the switch, that it
reaches the kernels' launches (and never on the CPU or under the interpreter), an offline sm_90 compile of each
kernel that takes it (griddepcontrol.wait / launch_dependents in the PTX with PDL, neither without; only weight
loads before the wait, no store), and on a GPU each kernel inside a CUDA graph with PDL on and off, bit for bit,
with the graph replay times printed (on against off)."""

from __future__ import annotations

import pytest
import torch

from stage_worker.kernels import common
from stage_worker.kernels.flags import NAMES, NOT_IN_ALL, KernelFlags

CUDA = torch.cuda.is_available()
triton = pytest.importorskip("triton")


# ---------------------------------------------------------------------------------------------------- the switch

def test_flag_parse_all_and_off(monkeypatch):
    assert "pdl" in NAMES
    assert KernelFlags.parse("all").pdl and KernelFlags.parse("pdl").pdl             # in "all" since h200-19
    # every item but the named-only ones (flags.NOT_IN_ALL: l2_prefetch)
    assert "pdl" not in NOT_IN_ALL and "l2_prefetch" in NOT_IN_ALL
    assert KernelFlags.parse("all,pdl") == KernelFlags(**{n: n not in NOT_IN_ALL for n in NAMES})
    assert not KernelFlags.parse("-pdl").pdl
    assert KernelFlags.parse("-pdl") == KernelFlags(**{n: n != "pdl" and n not in NOT_IN_ALL for n in NAMES})
    assert not KernelFlags.parse("none").pdl and KernelFlags.parse("pdl").describe() == "pdl"
    monkeypatch.setenv("MOEPIPE_KERNELS", "-pdl")
    assert not KernelFlags.from_env().pdl
    monkeypatch.setenv("MOEPIPE_KERNELS", "all")
    assert KernelFlags.from_env().pdl
    monkeypatch.setenv("MOEPIPE_KERNELS", "all,-pdl")
    assert not KernelFlags.from_env().pdl
    monkeypatch.setenv("MOEPIPE_KERNELS", "all,pdl")
    assert KernelFlags.from_env().pdl


def test_set_kernels_sets_the_one_setting(monkeypatch):
    """StageModel.set_kernels hands the flag to kernels/common.py; pdl_usable is False on the CPU whatever it says."""
    from stage_worker.model.model import StageModel

    monkeypatch.setattr(common, "_PDL", False)
    m = torch.nn.Linear(2, 2)
    StageModel.set_kernels(m, KernelFlags.parse("all,pdl"))
    assert common._PDL
    assert not common.pdl_usable(torch.zeros(1))                 # CPU (and the interpreter): never
    StageModel.set_kernels(m, KernelFlags.parse("-pdl"))
    assert not common._PDL


class _Spy:
    """Stands in for a @triton.jit kernel: records each launch's PDL constexpr and launch_pdl option."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((kw.get("PDL", False), kw.get("launch_pdl", False)))
        return launch


def _spy(monkeypatch, module, names) -> list:
    calls: list = []
    for n in names:
        monkeypatch.setattr(module, n, _Spy(calls))
    return calls


def _launches(monkeypatch, flags: str, fake_hopper: bool, module, names, call) -> list:
    from stage_worker.model.model import StageModel

    monkeypatch.setattr(common, "_PDL", False)
    monkeypatch.setattr(common, "_pdl_device", lambda x: fake_hopper)   # a CUDA device of compute capability 9
    StageModel.set_kernels(torch.nn.Linear(2, 2), KernelFlags.parse(flags))
    calls = _spy(monkeypatch, module, names)
    call()
    return calls


@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_quant_gemv_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import quant_gemv as Q
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn

    pw = quantize_rtn(torch.randn(32, 64), 4, 32, dense=True, scale_dtype=torch.float32)
    x = torch.randn(4, 64)

    def call():
        Q.quant_gemv(x[:1], pw)
        Q.quant_gemv(x, pw, wide=True)
    calls = _launches(monkeypatch, flags, hopper, Q, ["_quant_gemv_kernel", "_quant_gemm_kernel"], call)
    assert calls == [(want, want)] * 2


# ---------------------------------------------------------------------------------- offline sm_90 compiles

# Prepended to each family's script (run in a clean interpreter by sm90_compile.run_compile_script): compile a
# kernel for sm_90 and read its PTX: the griddepcontrol instructions, and the global loads and stores (and
# atomics) before the first wait.
PTX_PROBE = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def ptx_of(fn, sig, const, num_warps=4, num_stages=1):
    sig = dict(sig)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    return k.asm["ptx"]

def gdc(name, fn, sig, const, **kw):
    out = {}
    for pdl in (False, True):
        ptx = ptx_of(fn, sig, dict(const, PDL=pdl), **kw)
        body = ptx.split(".entry", 1)[1]
        head = body.split("griddepcontrol.wait", 1)[0] if "griddepcontrol.wait" in body else ""
        out[pdl] = dict(wait=body.count("griddepcontrol.wait"), launch=body.count("griddepcontrol.launch_dependents"),
                        loads_before=head.count("ld.global"),
                        stores_before=head.count("st.global") + head.count("atom.") + head.count("red."))
    return dict(name=name, off=out[False], on=out[True])
"""


def _compile(script: str) -> list[dict]:
    from sm90_compile import run_compile_script

    got = run_compile_script(PTX_PROBE + script, timeout=300)
    print("\n" + "\n".join(map(str, got)))
    return got


def _check(got: list[dict], prologue: set[str] = frozenset()) -> None:
    """PDL off: no griddepcontrol at all (the kernel as before). On: a wait and a launch_dependents, no store
    before the wait; the kernels named in `prologue` load weights before it."""
    for g in got:
        assert g["off"]["wait"] == 0 and g["off"]["launch"] == 0, g
        assert g["on"]["wait"] >= 1 and g["on"]["launch"] >= 1, g
        assert g["on"]["stores_before"] == 0, g
        if g["name"] in prologue:
            assert g["on"]["loads_before"] > 0, g


def test_quant_gemv_compiles_with_pdl_for_the_h200():
    """Both quant_gemv kernels (FMA at 1 token, the wide one at 16, K slices so the split counters are in): with
    PDL the first tile's words load before the wait."""
    got = _compile(r"""
from stage_worker.kernels import quant_gemv as Q

def build(T, wide, N=256, K=1024, bits=4, group=128):
    c = Q.launch_config(T, N, K, group, torch.device("cpu"), bits=bits, dense=True, wide=wide)
    sig = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
               w_ptr="*bf16", N="i32", T="i32", stride_xt="i32", stride_qn="i32", stride_sn="i32", stride_ot="i32",
               stride_wt="i32", one="i32")
    const = dict(K=K, W=K * bits // 32, BITS=bits, P=c["P"], WP=c["WP"], GROUP=group, SCALE=c["SCALE"],
                 K_SLICE=K // 2, SPLITS=2, BLOCK_N=c["BLOCK_N"], NPER=c["NPER"], TP=c["TP"], PRECISION="tf32",
                 SWIGLU=False, PREFETCH=True)
    const.update(dict(PP=c["PP"]) if wide else dict(DOT=c["DOT"]))
    fn = Q._quant_gemm_kernel if wide else Q._quant_gemv_kernel
    return gdc("quant_gemm" if wide else "quant_gemv", fn, sig, const, num_warps=c["warps"])

print(json.dumps([build(1, False), build(16, True)]))
""")
    _check(got, prologue={"quant_gemv", "quant_gemm"})


# ------------------------------------------------------------------------------------------------------ the GPU

def _graph_pair(fn, reps: int = 20):
    """fn() captured `reps` times into one CUDA graph with PDL off, then on (common._PDL; the device takes it):
    (outputs off, outputs on, us a call off, us a call on), the outputs of the graph's last call."""
    from conftest import graph_ab

    before = common._PDL
    try:
        (off, on), (us_off, us_on) = graph_ab(fn, [lambda: common.set_pdl(False), lambda: common.set_pdl(True)], reps)
    finally:
        common.set_pdl(before)
    return off, on, us_off, us_on


def _same(a, b):
    from conftest import assert_same_tensors

    assert_same_tensors(a, b)


needs_hopper = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] >= 9),
                                  reason="PDL needs a CUDA device of compute capability >= 9")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T,wide", [(1, False), (4, True), (16, True), (2, False)])
def test_quant_gemv_pdl_in_a_graph_bit_for_bit(T, wide):
    """A chain of quant_gemvs (out_proj INT4 4096 -> 2560 then o_proj-like INT6 2560 -> 6144 -> 2560, each reading
    the previous one's output, K slices so the split counters are shared) in one graph with PDL off and on."""
    from stage_worker.kernels import quant_gemv as Q
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn
    from stage_worker.kernels.split_reduce import split_locks

    torch.manual_seed(0)
    dev = "cuda"
    split_locks(dev)
    a = quantize_rtn(torch.randn(2560, 4096, device=dev) / 64, 4, 128, dense=True, scale_dtype=torch.bfloat16)
    b = quantize_rtn(torch.randn(6144, 2560, device=dev) / 50, 6, 128, dense=True, scale_dtype=torch.bfloat16)
    c = quantize_rtn(torch.randn(2560, 6144, device=dev) / 78, 8, 6144, dense=True, scale_dtype=torch.bfloat16)
    x = torch.randn(T, 4096, device=dev, dtype=torch.bfloat16)

    def fn():
        return Q.quant_gemv(Q.quant_gemv(Q.quant_gemv(x, a, wide=wide), b, wide=wide), c, wide=wide)

    off, on, us_off, us_on = _graph_pair(fn)
    print(f"\nquant_gemv chain T={T} wide={wide}: {us_off:.1f} us off, {us_on:.1f} us on (3 launches)")
    _same(off, on)


# ----------------------------------------------------------------------------------------- hyper_connection

HC_NAMES = ["_hc_prep_kernel", "_hc_down_kernel", "_hc_up_mix_kernel", "_hc_inject_kernel"]


@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_hyper_connection_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import hyper_connection as HC

    hc, H, R = 4, 32, 8
    streams, out, w = torch.randn(1, hc * H), torch.randn(1, H), torch.rand(1, hc)
    args = (torch.randn(hc * H), torch.randn(R, hc * H), torch.randn(hc * H, R), torch.randn(hc, hc * H), hc, 1e-6)

    def call():
        HC.hc_inject_mix(streams, out, w, *args)
        HC.hc_inject(streams, out, w)
    calls = _launches(monkeypatch, flags, hopper, HC, HC_NAMES, call)
    assert calls == [(want, want)] * 4


def test_a_weight_copied_for_the_mix_turns_pdl_off_for_its_kernels(monkeypatch):
    """The mix kernels load weights before their wait: a weight that needs `.contiguous()` is a copy kernel's output
    still being written, so that mix launches plainly; the inject kernel (it waits first thing) keeps PDL."""
    from stage_worker.kernels import hyper_connection as HC

    hc, H, R = 4, 32, 8
    streams, out, w = torch.randn(1, hc * H), torch.randn(1, H), torch.rand(1, hc)
    down_t = torch.randn(hc * H, R).t()                      # [R, hc*H], not contiguous
    args = (torch.randn(hc * H), down_t, torch.randn(hc * H, R), torch.randn(hc, hc * H), hc, 1e-6)

    def call():
        HC.hc_inject_mix(streams, out, w, *args)
        HC.hc_inject(streams, out, w)
    calls = _launches(monkeypatch, "all,pdl", True, HC, HC_NAMES, call)
    assert calls == [(False, False)] * 3 + [(True, True)]


def test_hyper_connection_compiles_with_pdl_for_the_h200():
    """The mix's three kernels (INT8 down and up, the injection on) and the inject kernel: P, A and B load weights
    before the wait."""
    got = _compile(r"""
from stage_worker.kernels import hyper_connection as K

H, HC, R = 512, 4, 64
out = [gdc("hc_prep", K._hc_prep_kernel,
           dict(x_ptr="*bf16", o_ptr="*bf16", g_ptr="*bf16", y_ptr="*bf16", nw_ptr="*bf16", n_ptr="*bf16",
                stride_x="i32", stride_o="i32", stride_y="i32", eps="fp32"),
           dict(H=H, HC=HC, INJECT=True, BLOCK=H)),
       gdc("hc_down", K._hc_down_kernel,
           dict(n_ptr="*bf16", down_ptr="*u8", ds_ptr="*bf16", inj_ptr="*bf16", a_ptr="*bf16", g_ptr="*bf16",
                part_ptr="*fp32", lock_ptr="*i32", T="i32"),
           dict(H=H, R=R, HC=HC, BLOCK_T=1, BLOCK_R=1, BLOCK_K=1024, SPLITS=1, SPAN=H * HC, Q8=True), num_warps=8),
       gdc("hc_up_mix", K._hc_up_mix_kernel,
           dict(n_ptr="*bf16", a_ptr="*bf16", up_ptr="*u8", us_ptr="*bf16", y_ptr="*bf16", T="i32", stride_y="i32"),
           dict(H=H, R=R, HC=HC, BLOCK_T=1, BLOCK_H=4, BLOCK_J=64, Q8=True), num_warps=8),
       gdc("hc_inject", K._hc_inject_kernel,
           dict(x_ptr="*bf16", o_ptr="*bf16", g_ptr="*bf16", y_ptr="*bf16", stride_x="i32", stride_o="i32",
                stride_y="i32"),
           dict(H=H, HC=HC, BLOCK=1024)),]
print(json.dumps(out))
""")
    _check(got, prologue={"hc_prep", "hc_down", "hc_up_mix"})


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T", [1, 4])
def test_hyper_connection_pdl_in_a_graph_bit_for_bit(T):
    """Two mixes in a row at the full shape (hc 4, H 2560, rank 320; bf16 weights), the second injecting a block
    output into the first one's streams, and an inject: PDL off and on in one graph each."""
    from stage_worker.kernels import hyper_connection as HC

    torch.manual_seed(0)
    hc, H, R, dt = 4, 2560, 320, torch.bfloat16
    dev = "cuda"
    w = dict(hc_norm_w=torch.randn(hc * H, device=dev, dtype=dt) * 0.1,
             down_w=torch.randn(R, hc * H, device=dev, dtype=dt) / 100,
             up_w=torch.randn(hc * H, R, device=dev, dtype=dt) / 18,
             inject_w=torch.randn(hc, hc * H, device=dev, dtype=dt) / 100)
    streams = torch.randn(T, hc * H, device=dev, dtype=dt)

    def fn():
        mixed, inj = HC.hc_mix(streams, **w, hc=hc, eps=1e-6)
        s2, mixed2, inj2 = HC.hc_inject_mix(streams, mixed, inj, **w, hc=hc, eps=1e-6)
        return mixed, inj, s2, mixed2, inj2, HC.hc_inject(s2, mixed2, inj2)

    off, on, us_off, us_on = _graph_pair(fn)
    print(f"\nhyper_connection mix + inject-mix + inject T={T}: {us_off:.1f} us off, {us_on:.1f} us on (7 launches)")
    _same(off, on)


# -------------------------------------------------------------------------------- INT4 experts and the router

def _int4_experts(E: int, H: int, I: int, group: int, dev: str, seed: int = 0):
    from stage_worker.kernels.moe_int4_ref import PackedExperts, pack_int4

    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=dev) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, device=dev) / I ** 0.5
    return PackedExperts(*pack_int4(w13.to(torch.bfloat16), group), *pack_int4(w2.to(torch.bfloat16), group), group)


@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_moe_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import moe as M
    from stage_worker.kernels import moe_int4 as M4

    ex = _int4_experts(4, 64, 32, 32, "cpu")
    x, ids, w = torch.randn(1, 64), torch.tensor([[0, 2]], dtype=torch.int32), torch.rand(1, 2)
    calls = _launches(monkeypatch, flags, hopper, M4, ["_int4_up_kernel", "_int4_down_kernel"],
                      lambda: M4.fused_moe_int4(x, ids, w, ex))
    calls += _launches(monkeypatch, flags, hopper, M, ["_route_kernel"], lambda: M.route(torch.randn(1, 8), 2, True))
    assert calls == [(want, want)] * 3


def test_moe_compiles_with_pdl_for_the_h200():
    """The INT4 up and down kernels (with zero points too, and FP4 codes) and the router: each waits first thing (no
    load before the wait)."""
    got = _compile(r"""
from stage_worker.kernels import moe as M
from stage_worker.kernels import moe_int4 as K

H, I, G, TOPK = 512, 128, 32, 8
up = gdc("int4_up", K._int4_up_kernel,
         dict(x_ptr="*bf16", ids_ptr="*i32", wts_ptr="*fp32", q_ptr="*i32", s_ptr="*bf16", hq_ptr="*i32",
              hs_ptr="*bf16", act_ptr="*fp32", stride_it="i32", stride_wt="i32", stride_qe="i64", stride_qr="i32",
              stride_se="i64", stride_sr="i32", FIRST_HOST="i32", ONE="i32"),
         dict(H=H, I=I, TOP_K=TOPK, GROUP=G, QW=K.quad_words(H // 8, G), BLOCK_I=8, BLOCK_W=32, PREFETCH=1),
         num_warps=1)
down = gdc("int4_down", K._int4_down_kernel,
           dict(act_ptr="*fp32", ids_ptr="*i32", q_ptr="*i32", s_ptr="*bf16", hq_ptr="*i32", hs_ptr="*bf16",
                out_ptr="*bf16", add_ptr="*bf16", stride_it="i32", stride_qe="i64", stride_qh="i32",
                stride_se="i64", stride_sh="i32", stride_ot="i32", stride_at="i32", FIRST_HOST="i32", ONE="i32"),
           dict(H=H, I=I, TOP_K=TOPK, GROUP=G, QW=K.quad_words(I // 8, G), BLOCK_H=4, BLOCK_W=128, PREFETCH=1,
                ADD=True), num_warps=2)
up_z = gdc("int4_up_zero_points", K._int4_up_kernel,
           dict(x_ptr="*bf16", ids_ptr="*i32", wts_ptr="*fp32", q_ptr="*i32", s_ptr="*bf16", hq_ptr="*i32",
                hs_ptr="*bf16", act_ptr="*fp32", stride_it="i32", stride_wt="i32", stride_qe="i64",
                stride_qr="i32", stride_se="i64", stride_sr="i32", FIRST_HOST="i32", ONE="i32"),
           dict(H=H, I=I, TOP_K=TOPK, GROUP=G, QW=K.quad_words(H // 8, G), BLOCK_I=8, BLOCK_W=32, PREFETCH=1,
                ZCOL=H // G), num_warps=1)
down_z = gdc("int4_down_zero_points", K._int4_down_kernel,
             dict(act_ptr="*fp32", ids_ptr="*i32", q_ptr="*i32", s_ptr="*bf16", hq_ptr="*i32", hs_ptr="*bf16",
                  out_ptr="*bf16", add_ptr="*bf16", stride_it="i32", stride_qe="i64", stride_qh="i32",
                  stride_se="i64", stride_sh="i32", stride_ot="i32", stride_at="i32", FIRST_HOST="i32", ONE="i32"),
             dict(H=H, I=I, TOP_K=TOPK, GROUP=G, QW=K.quad_words(I // 8, G), BLOCK_H=4, BLOCK_W=128, PREFETCH=1,
                  ADD=True, ZCOL=I // G), num_warps=2)
up_fp4 = gdc("int4_up_fp4", K._int4_up_kernel,
             dict(x_ptr="*bf16", ids_ptr="*i32", wts_ptr="*fp32", q_ptr="*i32", s_ptr="*fp32", hq_ptr="*i32",
                  hs_ptr="*fp32", act_ptr="*fp32", stride_it="i32", stride_wt="i32", stride_qe="i64",
                  stride_qr="i32", stride_se="i64", stride_sr="i32", FIRST_HOST="i32", ONE="i32"),
             dict(H=H, I=I, TOP_K=TOPK, GROUP=16, QW=K.quad_words(H // 8, 16), BLOCK_I=8, BLOCK_W=32, PREFETCH=1,
                  FP4=True), num_warps=1)
down_fp4 = gdc("int4_down_fp4", K._int4_down_kernel,
               dict(act_ptr="*fp32", ids_ptr="*i32", q_ptr="*i32", s_ptr="*fp32", hq_ptr="*i32", hs_ptr="*fp32",
                    out_ptr="*bf16", add_ptr="*bf16", stride_it="i32", stride_qe="i64", stride_qh="i32",
                    stride_se="i64", stride_sh="i32", stride_ot="i32", stride_at="i32", FIRST_HOST="i32",
                    ONE="i32"),
               dict(H=H, I=I, TOP_K=TOPK, GROUP=16, QW=K.quad_words(I // 8, 16), BLOCK_H=4, BLOCK_W=128,
                    PREFETCH=1, ADD=True, FP4=True), num_warps=2)
route = gdc("route", M._route_kernel,
            dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i32", counts_ptr="*fp32", reads_ptr="*i64",
                 valid_ptr="*i32", E="i32", stride_t="i32", FIRST_HOST="i32"),
            dict(TOP_K=TOPK, SHARED=1, RENORM=True, BLOCK_E=256, BLOCK_K=8, COUNT=True, VALID=True),
            num_warps=M.NUM_WARPS)
print(json.dumps([up, down, up_z, down_z, up_fp4, down_fp4, route]))
""")
    _check(got)
    assert all(g["on"]["loads_before"] == 0 for g in got), got


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T", [1, 4])
def test_moe_pdl_in_a_graph_bit_for_bit(T):
    """Route (shared slot, counts, valid rows) then the INT4 experts (the shared expert's output added) at the full
    shape's expert sizes (H 2560, I 1024 is a stand-in; 64 experts, top 8), twice in a row, PDL off and on."""
    from stage_worker.kernels import moe as M
    from stage_worker.kernels import moe_int4 as M4
    from stage_worker.kernels.moe_ref import RouteCounts

    torch.manual_seed(0)
    dev, H, I, E, k = "cuda", 2560, 1024, 64, 8
    ex = _int4_experts(E, H, I, 128, dev)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(T, E + 1, device=dev, dtype=torch.bfloat16)
    add = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    valid = torch.tensor([T], dtype=torch.int32, device=dev)

    def fn():
        counts = RouteCounts(torch.zeros(E, device=dev), torch.zeros(1, dtype=torch.int64, device=dev), E)
        w, ids = M.route(logits, k, True, shared=True, counts=counts, valid=valid)
        y = M4.fused_moe_int4(x, ids[:, :k], w[:, :k], ex, add=add)
        y2 = M4.fused_moe_int4(y, ids[:, :k], w[:, :k], ex, add=add)
        return w, ids, y, y2, counts.counts, counts.host_reads

    off, on, us_off, us_on = _graph_pair(fn)
    print(f"\nroute + 2 x INT4 experts T={T}: {us_off:.1f} us off, {us_on:.1f} us on (5 launches + 2 zero fills)")
    _same(off, on)


# ------------------------------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_rmsnorm_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import rmsnorm as K

    x, w = torch.randn(2, 32), torch.randn(32)

    def call():
        K.rmsnorm(x, w, 1e-6, group_size=16)
        K.add_rmsnorm(x, x, w, 1e-6)
    calls = _launches(monkeypatch, flags, hopper, K, ["_rmsnorm_kernel", "_add_rmsnorm_kernel"], call)
    assert calls == [(want, want)] * 2


def test_rmsnorm_compiles_with_pdl_for_the_h200():
    """The (grouped) RMSNorm waits first thing; the fused add + RMSNorm loads the norm weight before its wait."""
    got = _compile(r"""
from stage_worker.kernels import rmsnorm as K

norm = gdc("rmsnorm", K._rmsnorm_kernel,
           dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", stride_x="i32", stride_y="i32", eps="fp32"),
           dict(D=2048, G=512, ZERO_CENTRED=True, BLOCK=512))
add = gdc("add_rmsnorm", K._add_rmsnorm_kernel,
          dict(x_ptr="*bf16", r_ptr="*bf16", s_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", stride_x="i32",
               stride_r="i32", stride_s="i32", stride_y="i32", eps="fp32"),
          dict(D=2048, BLOCK=2048), num_warps=8)
print(json.dumps([norm, add]))
""")
    _check(got, prologue={"add_rmsnorm"})
    assert got[0]["on"]["loads_before"] == 0, got


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T", [1, 4])
def test_rmsnorm_pdl_in_a_graph_bit_for_bit(T):
    """RMSNorm, the fused add + RMSNorm over its output and a grouped RMSNorm (4 streams of 2560) in a row."""
    from stage_worker.kernels import rmsnorm as K

    torch.manual_seed(0)
    dev, H, dt = "cuda", 2560, torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=dt)
    w = torch.randn(H, device=dev, dtype=dt) * 0.1
    wg = torch.randn(4 * H, device=dev, dtype=dt) * 0.1
    streams = torch.randn(T, 4 * H, device=dev, dtype=dt)

    def fn():
        y = K.rmsnorm(x, w, 1e-6)
        s, y2 = K.add_rmsnorm(y, x, w, 1e-6)
        return y, s, y2, K.rmsnorm(streams, wg, 1e-6, group_size=H)

    off, on, us_off, us_on = _graph_pair(fn)
    print(f"\nrmsnorm + add_rmsnorm + grouped rmsnorm T={T}: {us_off:.1f} us off, {us_on:.1f} us on (3 launches)")
    _same(off, on)


# ----------------------------------------------------------------------------------------- deltanet_decode

def _gdn_inputs(B: int, nk: int, nv: int, dk: int, dv: int, width: int, dev: str, dt=torch.bfloat16, seed: int = 0):
    """gdn_decode's keyword arguments for B sequences at slots [0, 2, 4, ...] of 2B + 1, the states as given."""
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * nk * dk + nv * dv
    r = lambda *s: torch.randn(*s, generator=g)                  # noqa: E731
    return dict(mixed=r(B, conv_dim).to(dev, dt), z=r(B, nv * dv).to(dev, dt), b=r(B, nv).to(dev, dt),
                a=r(B, nv).to(dev, dt), conv_weight=(r(conv_dim, width) * 0.3).to(dev, dt),
                A_log=r(nv).to(dev, torch.float32), dt_bias=r(nv).to(dev, dt),
                norm_weight=(1 + 0.2 * r(dv)).to(dev, dt), eps=1e-6,
                conv_state=r(2 * B + 1, conv_dim, width - 1).to(dev, dt),
                recurrent_state=(r(2 * B + 1, nv, dk, dv) * 0.1).to(dev),
                slots=torch.arange(0, 2 * B, 2, device=dev))


@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_deltanet_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import deltanet_decode as K

    inp = _gdn_inputs(1, 1, 2, 8, 8, 4, "cpu", torch.float32)
    calls = _launches(monkeypatch, flags, hopper, K, ["_gdn_recurrence_kernel", "_gdn_norm_kernel"],
                      lambda: K.gdn_decode(**inp))
    assert calls == [(want, want)] * 2


def test_deltanet_compiles_with_pdl_for_the_h200():
    """The recurrence and the gated norm (real head sizes): each waits first thing."""
    got = _compile(r"""
from stage_worker.kernels import deltanet_decode as K
from stage_worker.kernels.deltanet_decode_ref import L2_EPS

NK, NV, DK, DV, KW = 16, 32, 128, 128, 4
rec = gdc("gdn_recurrence", K._gdn_recurrence_kernel,
          dict(mixed_ptr="*bf16", b_ptr="*bf16", a_ptr="*bf16", convw_ptr="*bf16", alog_ptr="*fp32", dtb_ptr="*bf16",
               conv_ptr="*bf16", rec_ptr="*fp32", slots_ptr="*i64", o_ptr="*bf16", stride_m="i32", stride_b="i32",
               stride_a="i32", stride_w0="i32", stride_w1="i32", stride_c0="i32", stride_c1="i32", stride_c2="i32",
               stride_r0="i32", stride_r1="i32", stride_r2="i32", stride_ob="i32", scale="fp32"),
          dict(NK=NK, REP=NV // NK, DK=DK, DV=DV, BV=32, KW=KW, KP=4, ROUND_PROD=True, L2EPS=L2_EPS),
          num_warps=K.RECURRENCE_WARPS)
norm = gdc("gdn_norm", K._gdn_norm_kernel,
           dict(mixed_ptr="*bf16", z_ptr="*bf16", normw_ptr="*bf16", conv_ptr="*bf16", slots_ptr="*i64",
                o_ptr="*bf16", out_ptr="*bf16", stride_m="i32", stride_z="i32", stride_c0="i32", stride_c1="i32",
                stride_c2="i32", stride_ob="i32", stride_o="i32", eps="fp32"),
           dict(NK=NK, REP=NV // NK, DK=DK, DV=DV, KW=KW, KP=4, SILU_GATE=True, ROUND_NORM=True),
           num_warps=K.NORM_WARPS)
print(json.dumps([rec, norm]))
""")
    _check(got)
    assert all(g["on"]["loads_before"] == 0 for g in got), got


def _gdn_fn(inp: dict):
    """Two DeltaNet decode steps from the same saved states (reset by copies first, so every call computes the
    same): the outputs and the states after them."""
    from stage_worker.kernels import deltanet_decode as K

    conv0, rec0 = inp["conv_state"].clone(), inp["recurrent_state"].clone()

    def fn():
        inp["conv_state"].copy_(conv0)
        inp["recurrent_state"].copy_(rec0)
        y = K.gdn_decode(**inp)
        y2 = K.gdn_decode(**dict(inp, mixed=inp["mixed"] * 0.5))
        return y, y2, inp["conv_state"], inp["recurrent_state"]
    return fn


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("B", [1, 4])
def test_deltanet_pdl_in_a_graph_bit_for_bit(B):
    """Two decode steps of a Gated DeltaNet layer at the real head sizes (16 key heads, 32 value heads, 128 x 128
    states, conv width 4), each step's recurrence and gated norm reading the state the previous one wrote."""
    inp = _gdn_inputs(B, 16, 32, 128, 128, 4, "cuda")
    off, on, us_off, us_on = _graph_pair(_gdn_fn(inp))
    print(f"\ndeltanet 2 steps B={B}: {us_off:.1f} us off, {us_on:.1f} us on (4 launches + 3 plain)")
    _same(off, on)


# ------------------------------------------------- attention: prep, QSA pool update and selection, decode attention

ATTN_PREP_NAMES = ["_attn_prep_kernel", "_pool_kernel"]
QSA_NAMES = ["_score_kernel", "_radix_pass_kernel", "_emit_kernel", "_select_kernel"]
DECODE_ATTN_NAMES = ["_split_kernel", "_reduce_kernel"]


def _attention_inputs(B: int, ctxs: list[int], nh: int, kvh: int, hd: int, rd: int, ni: int, di: int, page: int,
                      dev: str, dt=torch.bfloat16, seed: int = 0) -> dict:
    """One decode token for each of B sequences (context lengths `ctxs`, the token included) over a shuffled paged
    cache: the projection rows, cos/sin, the new tokens' slots, norm weights, the K/V / index-key / pooled caches."""
    from stage_worker.kernels.attention_prep_ref import PrepLayout

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)                  # noqa: E731
    pages = max(-(-c // page) for c in ctxs)
    n_pages = B * pages + 1
    tables = torch.randperm(n_pages, generator=g)[:B * pages].view(B, pages).int()
    lens = torch.tensor(ctxs, dtype=torch.int32)
    pos = lens.long() - 1
    slots = tables[torch.arange(B), pos // page].long() * page + pos % page
    k_off = 2 * nh * hd
    v_off = k_off + kvh * hd
    iq_off = v_off + kvh * hd
    layout = PrepLayout(nh, kvh, hd, rd, 0, k_off, v_off, ni, di, iq_off, iq_off + ni * di)
    rows = n_pages * page
    to = lambda t, d=dt: t.to(dev, d)                            # noqa: E731
    return dict(layout=layout, proj=to(r(B, iq_off + ni * di + di)), cos=to(torch.cos(r(B, rd))),
                sin=to(torch.sin(r(B, rd))), slots=to(slots, torch.int64), q_norm_w=to(r(hd) * 0.1),
                k_norm_w=to(r(hd) * 0.1), idx_q_norm_w=to(r(di) * 0.1), idx_k_norm_w=to(r(di) * 0.1),
                k_cache=to(r(rows, kvh, hd)), v_cache=to(r(rows, kvh, hd)), index_keys=to(r(rows, di)),
                pooled=to(r(rows // 4, di)), inv_freq=to(1.0 / (1e4 ** (torch.arange(0, rd, 2).float() / rd)),
                                                         torch.float32),
                tables=to(tables, torch.int32), lens=to(lens, torch.int32), page=page, hd=hd)


def _attention_fn(a: dict, budget: int, splits: int | None = None):
    """A gated-attention decode step's kernels in order: prep (norms, RoPE, the cache writes), the pooled-key update,
    QSA selection (score, radix passes, emit), the decode attention over the selection, and a dense one (split-K
    and its reduce). Every write is the same each call (the caches get the same rows)."""
    from stage_worker.kernels import attention_prep as P
    from stage_worker.kernels import decode_attention as D
    from stage_worker.kernels import qsa as Q

    def fn():
        q, gate, iq = P.attention_decode_prep(a["proj"], a["layout"], a["cos"], a["sin"], a["slots"], a["q_norm_w"],
                                              a["k_norm_w"], a["k_cache"], a["v_cache"], 1e-6, a["idx_q_norm_w"],
                                              a["index_keys"])
        P.qsa_pool_update(a["index_keys"], a["pooled"], a["tables"], a["lens"], a["idx_k_norm_w"], a["inv_freq"],
                          1e-6, a["page"], 4, a["layout"].rotary_dim)
        sel = Q.qsa_select(iq, a["pooled"], a["tables"], a["lens"], a["page"], 4, budget)
        o = D.paged_decode_attention(q, a["k_cache"], a["v_cache"], a["tables"], a["lens"], a["hd"] ** -0.5,
                                     a["page"], sel, num_splits=splits)
        o2 = D.paged_decode_attention(q, a["k_cache"], a["v_cache"], a["tables"], a["lens"], a["hd"] ** -0.5,
                                      a["page"], num_splits=splits)
        return q, gate, iq, sel, o, o2, a["k_cache"], a["pooled"]
    return fn


@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_attention_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import attention_prep as P
    from stage_worker.kernels import decode_attention as D
    from stage_worker.kernels import qsa as Q

    a = _attention_inputs(1, [40], 2, 1, 16, 8, 2, 16, 8, "cpu", torch.float32)
    rest: list = []                                  # every kernel of the step spied: none runs
    for module, names in ((Q, QSA_NAMES), (D, DECODE_ATTN_NAMES)):
        for n in names:
            monkeypatch.setattr(module, n, _Spy(rest))
    calls = _launches(monkeypatch, flags, hopper, P, ATTN_PREP_NAMES, _attention_fn(a, 16, splits=2))
    Q.select_from_keys(torch.zeros(1, 8, dtype=torch.int32), a["lens"], 4, 16, one_program=True)
    # prep + pool; score + 3 radix passes + emit, 2 x (split + reduce), the one-program select
    assert calls == [(want, want)] * 2 and rest == [(want, want)] * (5 + 4 + 1)


def test_attention_compiles_with_pdl_for_the_h200():
    """attention prep and the pooled-key update, the QSA score / radix pass / emit / one-program select, and the
    split-K decode attention (selection and the row cache's fill on) with its reduce: each waits first thing."""
    got = _compile(r"""
from stage_worker.kernels import attention_prep as P
from stage_worker.kernels import decode_attention as D
from stage_worker.kernels import qsa as Q

out = [gdc("attn_prep", P._attn_prep_kernel,
           dict(p_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", slot_ptr="*i64", qn_ptr="*bf16", kn_ptr="*bf16",
                iqn_ptr="*bf16", q_out="*bf16", g_out="*bf16", k_cache="*bf16", v_cache="*bf16", iq_out="*bf16",
                ik_cache="*bf16", stride_p="i32", stride_c="i32", eps="fp32"),
           dict(NH=16, KVH=2, HD=256, RD=64, NI=32, DI=128, Q_OFF=0, K_OFF=8192, V_OFF=8704, IQ_OFF=9216,
                IK_OFF=13312, BLOCK=256), num_warps=2),
       gdc("qsa_pool", P._pool_kernel,
           dict(ik_ptr="*bf16", pooled_ptr="*bf16", tables_ptr="*i32", lens_ptr="*i32", w_ptr="*bf16",
                inv_freq_ptr="*fp32", eps="fp32", s_tb="i32", n_table="i32", zero_ptr="*i32"),
           dict(D=128, RATIO=4, PAGE=16, RD=64, BLOCK_R=4, BLOCK=128, ZERO_N=1280, ZERO_BLOCK=2048), num_warps=2),
       gdc("qsa_score", Q._score_kernel,
           dict(q_ptr="*bf16", pooled_ptr="*bf16", tables_ptr="*i32", ctx_ptr="*i32", key_ptr="*i32",
                hist_ptr="*i32", sqrt_d="fp32", s_qb="i32", s_qh="i32", s_pr="i32", s_tb="i32", s_kb="i32",
                s_hb="i32"),
           dict(N_IDX=32, D_IDX=128, PAGE=16, RATIO=4, BLOCK_H=32, BLOCK_D=128, BLOCK_C=64, PROGRAMS=396,
                DOT_F32=False, HIST=True, BITS=8))]
ptrs = dict(key_ptr="*i32", ctx_ptr="*i32", hist_ptr="*i32", ge_ptr="*i32", out_ptr="*i32", s_kb="i32", s_hb="i32",
            s_gb="i32", s_ob="i32")
out += [gdc("qsa_pass", Q._radix_pass_kernel, ptrs,
            dict(K=512, BUDGET=2048, RATIO=4, RATIO_P=4, PASS=1, BITS=8, TILE=512, SHORT=2048,
                 SHORT_TILE=Q.SHORT_TILE, SELECT_SHORT=True)),
        gdc("qsa_emit", Q._emit_kernel, ptrs,
            dict(K=512, BUDGET=2048, RATIO=4, RATIO_P=4, BITS=8, TILE=512, SHORT=2048)),
        gdc("qsa_select", Q._select_kernel,
            dict(key_ptr="*i32", ctx_ptr="*i32", out_ptr="*i32", s_kb="i32", s_ob="i32"),
            dict(K=512, BUDGET=2048, RATIO=4, RATIO_P=4, BLOCK=2048, BITS=8), num_warps=8)]
sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", tables_ptr="*i32", ctx_ptr="*i32", sel_ptr="*i32",
           part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", rk_ptr="*bf16", rv_ptr="*bf16", tag_ptr="*i64",
           hitmark_ptr="*i64", claim_ptr="*i64", epoch_ptr="*i64", n_slots="i32", scale_log2="fp32", n_sel="i32")
sig.update(dict.fromkeys("s_qb s_qh s_kr s_kh s_vr s_vh s_tb s_sb s_pb s_ph s_ps s_lb s_lh s_ob s_oh s_rr s_rh".split(),
                         "i32"))
out += [gdc("decode_attn_split", D._split_kernel, sig,
            dict(GROUP=8, HEAD_DIM=256, PAGE=16, NUM_SPLITS=4, BLOCK_G=16, BLOCK_D=256, BLOCK_N=32, HAS_SEL=True,
                 DIRECT=False, DOT_F32=False, CACHED=True)),
        gdc("decode_attn_reduce", D._reduce_kernel,
            dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", s_pb="i32", s_ph="i32", s_ps="i32", s_lb="i32",
                 s_lh="i32", s_ob="i32", s_oh="i32"),
            dict(HEAD_DIM=256, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=256))]
print(json.dumps(out))
""")
    _check(got)
    assert all(g["on"]["loads_before"] == 0 for g in got), got


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("B", [1, 4])
def test_attention_pdl_in_a_graph_bit_for_bit(B):
    """A full-shape gated-attention layer's decode kernels (16 q heads, 2 KV heads of 256, partial RoPE 64, a QSA
    indexer of 32 x 128, budget 2048), one sequence short (selected whole in the first pass launch) and the others
    past SHORT_BLOCKS (the tiled passes): prep, pool update, selection, the selected and a dense split-K attention."""
    ctxs = [3000, 20000, 40000, 65536][:B]
    a = _attention_inputs(B, ctxs, 16, 2, 256, 64, 32, 128, 16, "cuda")
    off, on, us_off, us_on = _graph_pair(_attention_fn(a, 2048))
    print(f"\nattention prep + pool + QSA select + 2 decode attentions B={B}: {us_off:.1f} us off, "
          f"{us_on:.1f} us on")
    _same(off, on)


# ------------------------------------------------------------------------------------------------ fp8_gemv

def _fp8_weight(N: int, K: int, dev: str, seed: int = 0):
    from stage_worker.kernels.fp8_gemv_ref import Fp8Weight
    from test_kernel_moe_fp8 import quantize_block

    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5
    return Fp8Weight(*quantize_block(w.to(dev), (128, 128)), (128, 128))


@pytest.mark.parametrize("flags,hopper,want", [("all,pdl", True, True), ("all", True, True), ("-pdl", True, False), ("all,pdl", False, False)])
def test_flag_reaches_fp8_gemv_launches(monkeypatch, flags, hopper, want):
    from stage_worker.kernels import fp8_gemv as F

    fw, x = _fp8_weight(32, 256, "cpu"), torch.randn(4, 256)

    def call():
        F.fp8_gemv(x[:1], fw)
        F.fp8_gemv(x, fw, dot=False)
    calls = _launches(monkeypatch, flags, hopper, F, ["_fp8_gemv_kernel"], call)
    assert calls == [(want, want)] * 2


def test_fp8_gemv_compiles_with_pdl_for_the_h200():
    """The block-FP8 GEMV (tl.dot at 1 token, FMA at 4; K slices so the split counters are in): waits first."""
    got = _compile(r"""
from stage_worker.kernels import fp8_gemv as F

def build(T, dot, N=256, K=2048):
    c = F.launch_config(T, N, K, (128, 128), torch.device("cpu"), dot=dot)
    sig = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
               N="i32", T="i32", stride_xt="i32", stride_qn="i32", stride_sn="i32", stride_ot="i32")
    const = dict(K=K, BR=128, BC=128, K_SLICE=K // 2, SPLITS=2, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                 TP=c["TP"], DOT=c["DOT"], ROW_SCALE=c["ROW_SCALE"], PRECISION="tf32")
    return gdc(f"fp8_gemv_{'dot' if dot else 'fma'}", F._fp8_gemv_kernel, sig, const, num_warps=c["warps"])

print(json.dumps([build(1, True), build(4, False)]))
""")
    _check(got)
    assert all(g["on"]["loads_before"] == 0 for g in got), got


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T", [1, 4, 16])
def test_fp8_gemv_pdl_in_a_graph_bit_for_bit(T):
    """A chain of block-FP8 GEMVs (4096 -> 2560 -> 6144 -> 2560, each reading the previous one's output; small N
    takes K slices, so the split counters are shared) in one graph with PDL off and on."""
    from stage_worker.kernels import fp8_gemv as F
    from stage_worker.kernels.split_reduce import split_locks

    torch.manual_seed(0)
    dev = "cuda"
    split_locks(dev)
    a, b, c = _fp8_weight(2560, 4096, dev, 1), _fp8_weight(6144, 2560, dev, 2), _fp8_weight(2560, 6144, dev, 3)
    x = torch.randn(T, 4096, device=dev, dtype=torch.bfloat16)

    def fn():
        return F.fp8_gemv(F.fp8_gemv(F.fp8_gemv(x, a), b), c)

    off, on, us_off, us_on = _graph_pair(fn)
    print(f"\nfp8_gemv chain T={T}: {us_off:.1f} us off, {us_on:.1f} us on (3 launches)")
    _same(off, on)


# ------------------------------------------------------------------------------------------------ kv_row_cache

def _row_cache_inputs(dev: str, B: int = 2, S: int = 300, slots: int = 64, seed: int = 0):
    """A small region, B sequences' selections over a 4-block paged table, the step's written rows."""
    from stage_worker.kernels import kv_row_cache as RC

    g = torch.Generator().manual_seed(seed)
    page, blocks = 16, 40
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in range(B)]).int().to(dev)
    lens = torch.full((B,), 8 * page, dtype=torch.int32, device=dev)
    sel = torch.randint(-1, 8 * page, (B, S), generator=g).int().to(dev)
    written = torch.randint(0, blocks * page, (B,), generator=g).to(dev)
    template = RC.RowCache.new(slots, 1, 8, torch.bfloat16, dev)
    template.tag.copy_(torch.randint(-1, blocks * page, (slots,), generator=g).to(dev))
    return RC, template, sel, tables, lens, written, page


@pytest.mark.parametrize("flags,hopper,want", [("all", True, True), ("-pdl", True, False), ("all", False, False)])
def test_flag_reaches_kv_row_cache_launches(monkeypatch, flags, hopper, want):
    """The row cache's invalidate and plan (the decode chain of a QSA layer over host K/V) launch as programmatic
    dependents with the flag: a plain launch in the chain kept the next kernel from launching early."""
    from stage_worker.kernels import kv_row_cache as RC

    _, c, sel, tables, lens, written, page = _row_cache_inputs("cpu")
    calls = _launches(monkeypatch, flags, hopper, RC, ["_invalidate_kernel", "_plan_kernel"],
                      lambda: (RC.invalidate(c, written), RC.plan(c, sel, tables, lens, page)))
    assert calls == [(want, want)] * 2


def test_kv_row_cache_compiles_with_pdl_for_the_h200():
    """invalidate and plan wait first thing (everything they read an earlier kernel wrote)."""
    got = _compile(r"""
from stage_worker.kernels import kv_row_cache as RC

out = [gdc("rc_invalidate", RC._invalidate_kernel,
           dict(rows_ptr="*i64", n="i32", tag_ptr="*i64", epoch_ptr="*i64", n_slots="i32"), dict(BLOCK=128)),
       gdc("rc_plan", RC._plan_kernel,
           dict(sel_ptr="*i32", tables_ptr="*i32", ctx_ptr="*i32", tag_ptr="*i64", hitmark_ptr="*i64",
                claim_ptr="*i64", epoch_ptr="*i64", counts_ptr="*i64", n_sel="i32", n_slots="i32", s_sb="i32",
                s_tb="i32"), dict(PAGE=16, BLOCK=128))]
print(json.dumps(out))
""")
    _check(got)
    assert all(g["on"]["loads_before"] == 0 for g in got), got


@pytest.mark.gpu
@needs_hopper
def test_kv_row_cache_pdl_in_a_graph_bit_for_bit():
    """invalidate then plan on a copy of one region state, captured with PDL off and on: the same tags, hitmarks,
    claims, epoch and counters."""
    RC, template, sel, tables, lens, written, page = _row_cache_inputs("cuda")

    def fn():
        c = RC.RowCache(**{n: getattr(template, n).clone() for n in
                           ("k", "v", "tag", "hitmark", "claim", "epoch", "counts")})
        RC.invalidate(c, written)
        RC.plan(c, sel, tables, lens, page)
        return c.tag, c.hitmark, c.claim, c.epoch, c.counts
    off, on, us_off, us_on = _graph_pair(fn)
    print(f"\nrow cache invalidate + plan: {us_off:.1f} us off, {us_on:.1f} us on")
    _same(off, on)
