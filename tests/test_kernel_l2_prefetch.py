"""The kernel flag `l2_prefetch` (stage_worker/kernels/common.py `l2_prefetch_usable`, `l2_prefetch_rows`): with `pdl`,
each program of quant_gemv's two kernels and of the mix's down and up GEMVs asks the L2 for its whole weight range
before its wait. The switch (named only; nothing without `pdl`), that it reaches those launches (and never on the CPU
or under the interpreter), an offline sm_90 compile of each (cp.async.bulk.prefetch.L2 in the PTX with it, all
before griddepcontrol.wait and no store before the wait; none without it, the kernels as before), and on a GPU each
kernel inside a CUDA graph with PDL alone and PDL + l2_prefetch, bit for bit, with the replay times printed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stage_worker.kernels import common
from stage_worker.kernels.flags import NAMES, NOT_IN_ALL, KernelFlags

CUDA = torch.cuda.is_available()
triton = pytest.importorskip("triton")


# ---------------------------------------------------------------------------------------------------- the switch

def test_flag_parse(monkeypatch):
    assert "l2_prefetch" in NAMES
    assert not KernelFlags.parse("all").l2_prefetch and not KernelFlags.parse("all,pdl").l2_prefetch
    both = KernelFlags.parse("all,pdl,l2_prefetch")
    assert both.pdl and both.l2_prefetch and both == KernelFlags(**{n: n == "l2_prefetch" or n not in NOT_IN_ALL
                                                                    for n in NAMES})
    assert not KernelFlags.parse("all,pdl,l2_prefetch,-l2_prefetch").l2_prefetch
    assert KernelFlags.parse("l2_prefetch").describe() == "l2_prefetch"
    monkeypatch.setenv("MOEPIPE_KERNELS", "all")
    assert not KernelFlags.from_env().l2_prefetch
    monkeypatch.setenv("MOEPIPE_KERNELS", "all,pdl,l2_prefetch")
    got = KernelFlags.from_env()
    assert got.pdl and got.l2_prefetch


def test_set_kernels_sets_the_one_setting(monkeypatch):
    """StageModel.set_kernels hands the flag to kernels/common.py; l2_prefetch_usable is False on the CPU whatever
    it says, and without PDL on any device."""
    from stage_worker.model.model import StageModel

    monkeypatch.setattr(common, "_PDL", False)
    monkeypatch.setattr(common, "_L2PF", False)
    m = torch.nn.Linear(2, 2)
    StageModel.set_kernels(m, KernelFlags.parse("all,pdl,l2_prefetch"))
    assert common._L2PF and common._PDL
    assert not common.l2_prefetch_usable(torch.zeros(1))           # CPU (and the interpreter): never
    monkeypatch.setattr(common, "_pdl_device", lambda x: True)     # a Hopper stand-in
    assert common.l2_prefetch_usable(torch.zeros(1))
    StageModel.set_kernels(m, KernelFlags.parse("all,-pdl,l2_prefetch"))
    assert common._L2PF and not common.l2_prefetch_usable(torch.zeros(1))   # needs pdl
    StageModel.set_kernels(m, KernelFlags.parse("all,pdl"))
    assert not common._L2PF and not common.l2_prefetch_usable(torch.zeros(1))


class _Spy:
    """Stands in for a @triton.jit kernel: records each launch's (PDL, L2PF, launch_pdl)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((self.name, kw.get("PDL", False), kw.get("L2PF", False), kw.get("launch_pdl", False)))
        return launch


def _launches(monkeypatch, flags: str, fake_hopper: bool, module, names, call) -> list:
    from stage_worker.model.model import StageModel

    monkeypatch.setattr(common, "_PDL", False)
    monkeypatch.setattr(common, "_L2PF", False)
    monkeypatch.setattr(common, "_pdl_device", lambda x: fake_hopper)   # a CUDA device of compute capability 9
    StageModel.set_kernels(torch.nn.Linear(2, 2), KernelFlags.parse(flags))
    calls: list = []
    for n in names:
        monkeypatch.setattr(module, n, _Spy(n, calls))
    call()
    return calls


# (flags, a Hopper stand-in, PDL wanted, L2PF wanted)
CASES = [("all,pdl,l2_prefetch", True, True, True), ("all,pdl", True, True, False),
         ("all,-pdl,l2_prefetch", True, False, False), ("all", True, True, False),
         ("all,pdl,l2_prefetch", False, False, False)]


@pytest.mark.parametrize("flags,hopper,pdl,l2pf", CASES)
def test_flag_reaches_quant_gemv_launches(monkeypatch, flags, hopper, pdl, l2pf):
    from stage_worker.kernels import quant_gemv as Q
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn

    pw = quantize_rtn(torch.randn(32, 64), 4, 32, dense=True, scale_dtype=torch.float32)
    x = torch.randn(4, 64)

    def call():
        Q.quant_gemv(x[:1], pw)
        Q.quant_gemv(x, pw, wide=True)
    calls = _launches(monkeypatch, flags, hopper, Q, ["_quant_gemv_kernel", "_quant_gemm_kernel"], call)
    assert calls == [("_quant_gemv_kernel", pdl, l2pf, pdl), ("_quant_gemm_kernel", pdl, l2pf, pdl)]


@pytest.mark.parametrize("flags,hopper,pdl,l2pf", CASES)
def test_flag_reaches_hyper_connection_launches(monkeypatch, flags, hopper, pdl, l2pf):
    """The mix's down and up GEMVs take L2PF; the norm (prep) and inject kernels never (no weight stream)."""
    from stage_worker.kernels import hyper_connection as HC

    hc, H, R = 4, 32, 8
    streams, out, w = torch.randn(1, hc * H), torch.randn(1, H), torch.rand(1, hc)
    args = (torch.randn(hc * H), torch.randn(R, hc * H), torch.randn(hc * H, R), torch.randn(hc, hc * H), hc, 1e-6)

    def call():
        HC.hc_inject_mix(streams, out, w, *args)
        HC.hc_inject(streams, out, w)
    names = ["_hc_prep_kernel", "_hc_down_kernel", "_hc_up_mix_kernel", "_hc_inject_kernel"]
    calls = _launches(monkeypatch, flags, hopper, HC, names, call)
    assert calls == [("_hc_prep_kernel", pdl, False, pdl), ("_hc_down_kernel", pdl, l2pf, pdl),
                     ("_hc_up_mix_kernel", pdl, l2pf, pdl), ("_hc_inject_kernel", pdl, False, pdl)]


def test_a_copied_weight_turns_the_prefetch_off_with_pdl(monkeypatch):
    """A weight the mix has to copy turns its PDL off (test_kernel_pdl), and the prefetch with it."""
    from stage_worker.kernels import hyper_connection as HC

    hc, H, R = 4, 32, 8
    streams = torch.randn(1, hc * H)
    args = (torch.randn(hc * H), torch.randn(hc * H, R).t(), torch.randn(hc * H, R), None, hc, 1e-6)
    calls = _launches(monkeypatch, "all,pdl,l2_prefetch", True, HC,
                      ["_hc_prep_kernel", "_hc_down_kernel", "_hc_up_mix_kernel"], lambda: HC.hc_mix(streams, *args))
    assert [c[1:] for c in calls] == [(False, False, False)] * 3


# ---------------------------------------------------------------------------------- offline sm_90 compiles

# Prepended to the script (run in a clean interpreter by sm90_compile.run_compile_script): compile a kernel for
# sm_90 with PDL and L2PF off / on and read its PTX: the bulk prefetches, where they are against the first
# griddepcontrol.wait, and the global loads and stores (and atomics) before the wait. Triton's compile runs ptxas,
# so a kernel that compiles is one the assembler took.
PTX_PROBE = r"""
import json, re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PF = "cp.async.bulk.prefetch.L2.global"

def ptx_of(fn, sig, const, num_warps=4, num_stages=1):
    sig = dict(sig)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    return k.asm["ptx"]

def waited(body):
    # prefetches whose next wait-or-store in the text is a wait (a kernel with two branches, each with its wait,
    # has its second branch's prefetch after the first branch's wait: it counts if its own wait comes first)
    n, pending = 0, 0
    for m in re.finditer(r"cp\.async\.bulk\.prefetch\.L2\.global|griddepcontrol\.wait|st\.global|atom\.|red\.", body):
        if m.group().startswith("cp."):
            pending += 1
        elif m.group().startswith("griddepcontrol"):
            n, pending = n + pending, 0
        else:
            pending = 0
    return n

def probe(name, fn, sig, const, **kw):
    out = {}
    for key, pdl, l2 in (("off", False, False), ("pdl", True, False), ("both", True, True)):
        body = ptx_of(fn, sig, dict(const, PDL=pdl, L2PF=l2), **kw).split(".entry", 1)[1]
        head = body.split("griddepcontrol.wait", 1)[0] if "griddepcontrol.wait" in body else ""
        out[key] = dict(wait=body.count("griddepcontrol.wait"), prefetch=body.count(PF), prefetch_waited=waited(body),
                        prefetch_before=head.count(PF), loads_before=head.count("ld.global"),
                        stores_before=head.count("st.global") + head.count("atom.") + head.count("red."))
    return dict(name=name, **out)
"""


def _compile(script: str) -> list[dict]:
    from sm90_compile import run_compile_script

    got = run_compile_script(PTX_PROBE + script, timeout=300)
    print("\n" + "\n".join(map(str, got)))
    return got


def _check(got: list[dict]) -> None:
    """Without L2PF (PDL off or on) no prefetch at all; with it, `prefetches` of them (one a l2_prefetch_rows
    call: one element a thread, so no repeats), every one followed by a wait before any store (the first at least
    before the first wait), and still no store before the first wait."""
    for g in got:
        assert g["off"]["prefetch"] == 0 and g["off"]["wait"] == 0, g
        assert g["pdl"]["prefetch"] == 0 and g["pdl"]["wait"] >= 1, g
        b = g["both"]
        assert b["wait"] >= 1 and b["prefetch"] == g["prefetches"] and b["prefetch_waited"] == b["prefetch"], g
        assert b["prefetch_before"] >= 1, g
        assert b["stores_before"] == 0 and g["pdl"]["stores_before"] == 0, g
        assert b["loads_before"] == g["pdl"]["loads_before"], g          # the same weight loads, no new ones


def test_quant_gemv_compiles_with_l2_prefetch_for_the_h200():
    """Both quant_gemv kernels (FMA at 1 token, the wide one at 16), one K slice and two, group scales (a words and
    a scales prefetch) and per-row scales (the words only)."""
    got = _compile(r"""
from stage_worker.kernels import quant_gemv as Q

def build(T, wide, splits, group, N=256, K=1024, bits=4):
    c = Q.launch_config(T, N, K, group, torch.device("cpu"), bits=bits, dense=True, wide=wide)
    sig = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
               w_ptr="*bf16", N="i32", T="i32", stride_xt="i32", stride_qn="i32", stride_sn="i32", stride_ot="i32",
               stride_wt="i32", one="i32")
    const = dict(K=K, W=K * bits // 32, BITS=bits, P=c["P"], WP=c["WP"], GROUP=group, SCALE=c["SCALE"],
                 K_SLICE=K // splits, SPLITS=splits, BLOCK_N=c["BLOCK_N"], NPER=c["NPER"], TP=c["TP"],
                 PRECISION="tf32", SWIGLU=False, PREFETCH=True)
    const.update(dict(PP=c["PP"]) if wide else dict(DOT=c["DOT"]))
    fn = Q._quant_gemm_kernel if wide else Q._quant_gemv_kernel
    name = f"{'quant_gemm' if wide else 'quant_gemv'} splits={splits} group={group}"
    return dict(probe(name, fn, sig, const, num_warps=c["warps"]), prefetches=2 if group < K else 1)

print(json.dumps([build(1, False, 2, 128), build(1, False, 1, 1024), build(16, True, 1, 128),
                  build(16, True, 2, 1024)]))
""")
    _check(got)


def test_hyper_connection_compiles_with_l2_prefetch_for_the_h200():
    """The mix's down GEMV (INT8 and bf16; one prefetch for the down rows, one for the inject rows, one taken a
    program) and up GEMV (one a stream); the prep and inject kernels take no L2PF."""
    got = _compile(r"""
from stage_worker.kernels import hyper_connection as K

H, HC, R = 512, 4, 64
down = dict(n_ptr="*bf16", down_ptr="*u8", ds_ptr="*bf16", inj_ptr="*bf16", a_ptr="*bf16", g_ptr="*bf16",
            part_ptr="*fp32", lock_ptr="*i32", T="i32")
up = dict(n_ptr="*bf16", a_ptr="*bf16", up_ptr="*u8", us_ptr="*bf16", y_ptr="*bf16", T="i32", stride_y="i32")
out = []
for q8 in (True, False):
    ty = "*u8" if q8 else "*bf16"
    out += [dict(probe(f"hc_down q8={q8}", K._hc_down_kernel, dict(down, down_ptr=ty),
                       dict(H=H, R=R, HC=HC, BLOCK_T=1, BLOCK_R=1, BLOCK_K=1024, SPLITS=1, SPAN=H * HC, Q8=q8),
                       num_warps=8), prefetches=2),
            dict(probe(f"hc_up_mix q8={q8}", K._hc_up_mix_kernel, dict(up, up_ptr=ty),
                       dict(H=H, R=R, HC=HC, BLOCK_T=4, BLOCK_H=8, BLOCK_J=64, Q8=q8), num_warps=4),
                 prefetches=HC)]
print(json.dumps(out))
""")
    _check(got)


# ------------------------------------------------------------------------------------------------------ the GPU

def _graph_pair(fn, reps: int = 20):
    """fn() captured `reps` times into one CUDA graph with PDL alone, then PDL + l2_prefetch (common._PDL, _L2PF;
    the device takes them): (outputs pdl, outputs both, us a call pdl, us a call both), the graph's last call's."""
    from conftest import graph_ab

    before = common._PDL, common._L2PF

    def with_l2(on: bool):
        return lambda: (common.set_pdl(True), common.set_l2_prefetch(on))

    try:
        (pdl, both), (us_pdl, us_both) = graph_ab(fn, [with_l2(False), with_l2(True)], reps)
    finally:
        common.set_pdl(before[0])
        common.set_l2_prefetch(before[1])
    return pdl, both, us_pdl, us_both


def _same(a, b):
    from conftest import assert_same_tensors

    assert_same_tensors(a, b)


needs_hopper = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] >= 9),
                                  reason="PDL and cp.async.bulk.prefetch need a CUDA device of compute capability >= 9")


def _row_padded(pw, pad: int):
    """The same weight with its words in a wider buffer (stride_qn = W + pad): the per-row prefetch path."""
    buf = torch.zeros(pw.words.shape[0], pw.words.shape[1] + pad, dtype=pw.words.dtype, device=pw.words.device)
    buf[:, :pw.words.shape[1]] = pw.words
    return dataclasses.replace(pw, words=buf[:, :pw.words.shape[1]])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T,wide", [(1, False), (2, False), (4, True), (16, True)])
def test_quant_gemv_l2_prefetch_in_a_graph_bit_for_bit(T, wide):
    """A chain of quant_gemvs (INT4 groups 4096 -> 2560 with K slices, INT6 groups 2560 -> 6136 with rows not a
    multiple of the block and its words in padded rows, INT8 per-row 6136 -> 2560) in one graph with PDL alone and
    with the prefetch, bit for bit; and the padded weight's output that of the same weight packed."""
    from stage_worker.kernels import quant_gemv as Q
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn
    from stage_worker.kernels.split_reduce import split_locks

    torch.manual_seed(0)
    dev = "cuda"
    split_locks(dev)
    a = quantize_rtn(torch.randn(2560, 4096, device=dev) / 64, 4, 128, dense=True, scale_dtype=torch.bfloat16)
    packed = quantize_rtn(torch.randn(6136, 2560, device=dev) / 50, 6, 128, dense=True, scale_dtype=torch.bfloat16)
    b = _row_padded(packed, 4)
    c = quantize_rtn(torch.randn(2560, 6136, device=dev) / 78, 8, 6136, dense=True, scale_dtype=torch.bfloat16)
    x = torch.randn(T, 4096, device=dev, dtype=torch.bfloat16)

    def fn():
        return Q.quant_gemv(Q.quant_gemv(Q.quant_gemv(x, a, wide=wide), b, wide=wide), c, wide=wide)

    pdl, both, us_pdl, us_both = _graph_pair(fn)
    print(f"\nquant_gemv chain T={T} wide={wide}: {us_pdl:.1f} us pdl, {us_both:.1f} us pdl+l2_prefetch (3 launches)")
    _same(pdl, both)
    before = common._PDL, common._L2PF
    common.set_pdl(True)
    common.set_l2_prefetch(True)
    try:
        y = torch.randn(T, 2560, device=dev, dtype=torch.bfloat16)
        assert torch.equal(Q.quant_gemv(y, b, wide=wide), Q.quant_gemv(y, packed, wide=wide))
    finally:
        common.set_pdl(before[0])
        common.set_l2_prefetch(before[1])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("T,q8", [(1, False), (4, False), (1, True)])
def test_hyper_connection_l2_prefetch_in_a_graph_bit_for_bit(T, q8):
    """Two mixes in a row at the full shape (hc 4, H 2560, rank 320; bf16 or INT8 down / up), the second injecting
    a block output into the first one's streams, and an inject: PDL alone and with the prefetch, one graph each."""
    from stage_worker.kernels import hyper_connection as HC
    from stage_worker.kernels.quant_gemv_ref import quantize_rtn

    torch.manual_seed(0)
    hc, H, R, dt = 4, 2560, 320, torch.bfloat16
    dev = "cuda"
    down = torch.randn(R, hc * H, device=dev) / 100
    up = torch.randn(hc * H, R, device=dev) / 18
    if q8:
        down = quantize_rtn(down, 8, hc * H, dense=True, scale_dtype=dt)
        up = quantize_rtn(up, 8, R, dense=True, scale_dtype=dt)
    else:
        down, up = down.to(dt), up.to(dt)
    w = dict(hc_norm_w=torch.randn(hc * H, device=dev, dtype=dt) * 0.1, down_w=down, up_w=up,
             inject_w=torch.randn(hc, hc * H, device=dev, dtype=dt) / 100)
    streams = torch.randn(T, hc * H, device=dev, dtype=dt)

    def fn():
        mixed, inj = HC.hc_mix(streams, **w, hc=hc, eps=1e-6)
        s2, mixed2, inj2 = HC.hc_inject_mix(streams, mixed, inj, **w, hc=hc, eps=1e-6)
        return mixed, inj, s2, mixed2, inj2, HC.hc_inject(s2, mixed2, inj2)

    pdl, both, us_pdl, us_both = _graph_pair(fn)
    print(f"\nhyper_connection mix + inject-mix + inject T={T} q8={q8}: {us_pdl:.1f} us pdl, {us_both:.1f} us "
          f"pdl+l2_prefetch (7 launches)")
    _same(pdl, both)
