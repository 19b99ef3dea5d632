"""Store on claim (issue 16): the fused decode kernels, bf16 (`moe.fused_moe`), float8 (`moe.fused_moe_fp8`: bytes and
block scales) and INT4 (`moe_int4.fused_moe_int4`), also store the rows they read of a claimed slot into a free
device slot, so a host expert moves with no copy of its own. Checked: the output keeps its bits; the spare slot ends
up an exact copy of every part of the claimed host slot when a token selects it and keeps its bytes when none does,
there is no claim (-1, also the shared expert's id) or no spare (-1); nothing else changes (the device tables sit
between guard rows), at row ends that are not multiples of the blocks too (float8: scales gathered a weight and one
a row, ROW_SCALE); the PyTorch paths copy the same. Without CUDA under TRITON_INTERPRET=1 (tests/conftest.py turns
it on): tiny shapes, few cases."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels import moe_int4 as K4  # noqa: E402
from stage_worker.kernels.moe_int4_ref import PackedExperts, pack_fp4, pack_int4  # noqa: E402
from stage_worker.kernels.moe_ref import Fp8Experts, HostRows  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
E, HOT, SPARE = 8, 4, 2          # slots [0, HOT) on the device (SPARE free: no token selects it), the rest host rows
IDS = {1: [[6, 0, 5]], 3: [[6, 0, 5], [3, 6, 1], [5, 1, 6]]}    # host slot 6 selected; 4 and 7 never
CLAIMS = {"selected": 6, "unselected": 7, "none": -1, "no spare": 6}
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes as integers: garbage rows hold NaN patterns, which torch.equal on floats calls unequal."""
    return t.view(INTS[t.element_size()])


def _garbage(t: torch.Tensor, seed: int) -> None:
    """Random bits (NaN and infinity patterns included), so a copy of anything else shows."""
    b = _bits(t)
    top = 1 << (8 * t.element_size() - 1)
    b.copy_(torch.randint(-top, top, b.shape, generator=torch.Generator().manual_seed(seed)).to(b.dtype))


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().pin_memory() if CUDA else t.clone()


def _guarded(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of the device slots t between two garbage guard rows (a write to row -1 or HOT lands in them); the
    spare slot's rows garbage too."""
    buf = torch.empty(t.shape[0] + 2, *t.shape[1:], dtype=t.dtype, device=t.device)
    _garbage(buf, seed)
    buf[1:-1] = t
    _garbage(buf[1 + SPARE], seed + 1)
    return buf[1:-1]


def _claim(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([CLAIMS[kind]], dtype=torch.int32, device=DEV),
            torch.tensor([-1 if kind == "no spare" else SPARE], dtype=torch.int64, device=DEV))


def _check_tables(parts: dict, before: dict, slot: int, copied: bool) -> None:
    """parts: name -> (device table, host table) after the call; before: name -> the device table's buffer (guard
    rows included, `_guarded`) before it."""
    for name, (dev, host) in parts.items():
        base = dev._base
        want = host[slot - HOT] if copied else before[name][1 + SPARE]
        assert torch.equal(_bits(dev[SPARE]), _bits(want.to(dev.device))), name
        others = [r for r in range(base.shape[0]) if r != 1 + SPARE]
        assert torch.equal(_bits(base[others]), _bits(before[name][others])), name


def _bf16_case(t: int, dtype: torch.dtype, H: int, I: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(DEV, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(DEV, dtype)
    dev13, dev2 = _guarded(w13[:HOT], seed + 1), _guarded(w2[:HOT], seed + 3)
    host = HostRows(_host(w13[HOT:]), _host(w2[HOT:]), HOT)
    x = torch.randn(t, H, generator=g).to(DEV, dtype)
    ids = torch.tensor(IDS[t], dtype=torch.int32, device=DEV)
    w = torch.rand(t, ids.shape[1], generator=g).to(DEV, dtype)
    return x, ids, w, dev13, dev2, host


@pytest.mark.parametrize("t,kind,shared,small,dtype", [
    (1, "selected", False, False, torch.bfloat16),
    (3, "selected", True, False, torch.bfloat16),
    (3, "selected", False, True, torch.float16),     # several blocks a row, the last one partial
    (1, "none", True, False, torch.bfloat16),        # -1 is the shared expert's id: still no claim
    (3, "unselected", False, False, torch.float32),
    (1, "no spare", True, False, torch.bfloat16)])
def test_bf16_kernels_store_the_claimed_slot(monkeypatch, t, kind, shared, small, dtype):
    H, I = 40, 20                 # row ends masked in both launches (blocks of 64/16 columns and 8/16/32 rows)
    if small:
        monkeypatch.setattr(K, "UP_CFG", {b: (8, 16, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K, "DOWN_CFG", {b: (16, 8, 1) for b in (1, 4, 16)})
    x, ids, w, dev13, dev2, host = _bf16_case(t, dtype, H, I, seed=t + 10 * small)
    sh = None
    if shared:
        g = torch.Generator().manual_seed(3)
        sh = K.SharedExpert((torch.randn(2 * I, H, generator=g) / H ** 0.5).to(DEV, dtype),
                            (torch.randn(H, I, generator=g) / I ** 0.5).to(DEV, dtype))
        ids = torch.cat([ids, torch.full((t, 1), -1, dtype=ids.dtype, device=DEV)], 1)
        w = torch.cat([w, torch.full((t, 1), 0.5, dtype=dtype, device=DEV)], 1)
    before = {"w13": dev13._base.clone(), "w2": dev2._base.clone()}
    want = K.fused_moe(x, ids, w, dev13, dev2, sh, host=host)
    out = K.fused_moe(x, ids, w, dev13, dev2, sh, host=host, claim=_claim(kind))
    assert torch.equal(_bits(out), _bits(want))
    _check_tables({"w13": (dev13, host.w13), "w2": (dev2, host.w2)}, before, CLAIMS[kind], kind == "selected")


@pytest.mark.parametrize("kind", ["selected", "unselected", "no spare"])
def test_bf16_pytorch_path_copies_the_claimed_slot(monkeypatch, kind):
    """Past DECODE_MAX_TK (and without Triton) `grouped_moe` runs: the claim is copied there with torch ops."""
    monkeypatch.setattr(K, "DECODE_MAX_TK", 0)
    x, ids, w, dev13, dev2, host = _bf16_case(3, torch.bfloat16, 40, 20, seed=5)
    before = {"w13": dev13._base.clone(), "w2": dev2._base.clone()}
    want = K.fused_moe(x, ids, w, dev13, dev2, host=host, prefill_kernel=False)
    out = K.fused_moe(x, ids, w, dev13, dev2, host=host, prefill_kernel=False, claim=_claim(kind))
    assert torch.equal(_bits(out), _bits(want))
    _check_tables({"w13": (dev13, host.w13), "w2": (dev2, host.w2)}, before, CLAIMS[kind], kind == "selected")


def test_a_claim_on_one_byte_tables_is_refused_by_fused_moe():
    """`fused_moe` has no scales to store: float8 tables claim through `fused_moe_fp8` (below); refused, not
    ignored."""
    x = torch.randn(1, 32, device=DEV)
    ids = torch.tensor([[0]], dtype=torch.int32, device=DEV)
    w13, w2 = torch.zeros(2, 16, 32, dtype=torch.uint8, device=DEV), torch.zeros(2, 32, 8, dtype=torch.uint8,
                                                                                  device=DEV)
    with pytest.raises(ValueError, match="fused_moe_fp8"):
        K.fused_moe(x, ids, torch.ones(1, 1, device=DEV), w13, w2, claim=_claim("none"))


FP8_NAMES = ("q13", "s13", "q2", "s2")


def _fp8_case(t: int, block: tuple[int, int], seed: int, dtype: torch.dtype = torch.float32):
    """H 40, I 24: neither a multiple of the blocks (edge blocks cut, gate's and up's blocks apart). Float8 bytes of
    small normal values and positive scales (no NaN bytes: a NaN output would hide a changed bit less well)."""
    H, I = 40, 24
    br, bc = block
    g = torch.Generator().manual_seed(seed)
    q13 = (torch.randn(E, 2 * I, H, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    q2 = (torch.randn(E, H, I, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    s13 = torch.rand(E, 2, -(-I // br), -(-H // bc), generator=g) / H + 1e-3
    s2 = torch.rand(E, -(-H // br), -(-I // bc), generator=g) / I + 1e-3
    parts = [p.to(DEV) for p in (q13, s13, q2, s2)]
    dev = Fp8Experts(*(_guarded(p[:HOT], seed + 2 * i) for i, p in enumerate(parts)), block)
    host = Fp8Experts(*(_host(p[HOT:]) for p in parts), block)
    x = torch.randn(t, H, generator=g).to(DEV, dtype)
    ids = torch.tensor(IDS[t], dtype=torch.int32, device=DEV)
    w = torch.rand(t, ids.shape[1], generator=g).to(DEV)
    return x, ids, w, dev, host


def _claim_keeps_output_and_copies(moe, x, ids, w, dev, host, names, kind: str) -> None:
    """`moe` (`fused_moe_fp8` or `fused_moe_int4`, tables of parts `names`): the output with the claim equals it
    without, bit for bit; the tables as `_check_tables` wants them."""
    before = {n: getattr(dev, n)._base.clone() for n in names}
    want = moe(x, ids, w, dev, host=host, first_host=HOT)
    out = moe(x, ids, w, dev, host=host, first_host=HOT, claim=_claim(kind))
    assert torch.equal(_bits(out), _bits(want))
    _check_tables({n: (getattr(dev, n), getattr(host, n)) for n in names}, before, CLAIMS[kind],
                  kind == "selected")


@pytest.mark.parametrize("t,kind,block,small", [
    (1, "selected", (16, 16), False),    # a gathered scale per weight in both launches
    (3, "selected", (16, 64), False),    # ROW_SCALE in both (one column block a tile)
    (3, "selected", (16, 16), True),     # ROW_SCALE over several column blocks and steps, rows cut
    (1, "selected", (8, 24), True),      # up gathered with blocks across tiles, down ROW_SCALE with BC > BLOCK_I
    (1, "none", (16, 16), True),
    (3, "unselected", (16, 64), False),
    (1, "no spare", (16, 16), False)])
def test_fp8_kernels_store_the_claimed_slot_bytes_and_scales(monkeypatch, t, kind, block, small):
    if small:
        monkeypatch.setattr(K, "UP_CFG", {b: (8, 16, 1) for b in (1, 4, 16)})     # 24 rows: 3 blocks; 40: 16, 16, 8
        monkeypatch.setattr(K, "DOWN_CFG", {b: (16, 8, 1) for b in (1, 4, 16)})   # 40 rows: 16, 16, 8; 24: 3 x 8
    x, ids, w, dev, host = _fp8_case(t, block, seed=50 + t + 10 * small + block[1],
                                     dtype=torch.bfloat16 if t == 3 else torch.float32)
    _claim_keeps_output_and_copies(K.fused_moe_fp8, x, ids, w, dev, host, FP8_NAMES, kind)


@pytest.mark.parametrize("kind", ["selected", "unselected", "no spare"])
def test_fp8_pytorch_path_copies_the_claimed_slot(monkeypatch, kind):
    """Past DECODE_MAX_TK (and without Triton) `grouped_moe_fp8` runs: the claim is copied there with torch ops."""
    monkeypatch.setattr(K, "DECODE_MAX_TK", 0)
    x, ids, w, dev, host = _fp8_case(3, (16, 16), seed=60)
    _claim_keeps_output_and_copies(K.fused_moe_fp8, x, ids, w, dev, host, FP8_NAMES, kind)


def test_fp8_claims_the_kernels_could_not_store_in_place_are_refused():
    """The kernels store the scales into the float32 contiguous table they read; other scales (converted for the
    launch) would lose the store: refused, as is a claim off the table's device or of more than one slot."""
    x, ids, w, dev, host = _fp8_case(1, (16, 16), seed=70)
    bf = Fp8Experts(dev.q13, dev.s13.to(torch.bfloat16), dev.q2, dev.s2, dev.block)
    with pytest.raises(ValueError, match="in place"):
        K.fused_moe_fp8(x, ids, w, bf, claim=_claim("selected"))
    two = (torch.tensor([6, 6], dtype=torch.int32, device=DEV), _claim("selected")[1])
    with pytest.raises(ValueError, match="claim"):
        K.fused_moe_fp8(x, ids, w, dev, host=host, first_host=HOT, claim=two)


def _int4_case(t: int, scale_dtype: torch.dtype, seed: int, asym: bool = False, fp4: bool = False):
    """H 96 (12 words a row), I 40 (5 words: down blocks span experts), groups 32 / 16 (a partial last group);
    `asym`: zero points after the scales in the scale rows (the kernels store them with the scales); `fp4`: E2M1
    codes and float32 scales."""
    H, I = 96, 40
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(DEV, scale_dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(DEV, scale_dtype)
    if fp4:
        ex = PackedExperts(*pack_fp4(w13, 32), *pack_fp4(w2, 16), 32, 16, fp4=True)
    else:
        ex = PackedExperts(*pack_int4(w13, 32, asym), *pack_int4(w2, 16, asym), 32, 16)
    assert ex.asym == asym
    names = ("q13", "s13", "q2", "s2")
    dev = PackedExperts(*(_guarded(getattr(ex, n)[:HOT], seed + 2 * i) for i, n in enumerate(names)), 32, 16, fp4)
    host = PackedExperts(*(_host(getattr(ex, n)[HOT:]) for n in names), 32, 16, fp4)
    x = torch.randn(t, H, generator=g).to(DEV)
    ids = torch.tensor(IDS[t], dtype=torch.int32, device=DEV)
    w = torch.rand(t, ids.shape[1], generator=g).to(DEV)
    return x, ids, w, dev, host, names


@pytest.mark.parametrize("t,kind,small,prefetch,scale_dtype,asym", [
    (1, "selected", False, None, torch.float32, False),
    (3, "selected", True, 0, torch.bfloat16, False),  # several blocks a row, partial ends, each prefetch depth in use
    (3, "selected", True, 1, torch.float32, False),
    (3, "selected", True, 1, torch.bfloat16, True),   # zero points stored with the scales
    (1, "none", False, None, torch.bfloat16, False),
    (1, "unselected", True, 0, torch.float32, False),
    (1, "no spare", False, None, torch.float32, False)])
def test_int4_kernels_store_the_claimed_slot(monkeypatch, t, kind, small, prefetch, scale_dtype, asym):
    if small:
        monkeypatch.setattr(K4, "UP_CFG", {b: (32, 8, 1) for b in (1, 4, 16)})      # 40 rows: 32, 8; 12 words: 8, 4
        monkeypatch.setattr(K4, "DOWN_CFG", {b: (64, 8, 1) for b in (1, 4, 16)})    # 96 rows: 64, 32
        monkeypatch.setattr(K4, "PREFETCH", {b: prefetch for b in (1, 4, 16)})
    x, ids, w, dev, host, names = _int4_case(t, scale_dtype, seed=20 + t + 10 * small, asym=asym)
    _claim_keeps_output_and_copies(K4.fused_moe_int4, x, ids, w, dev, host, names, kind)


@pytest.mark.parametrize("t,kind,small", [(1, "selected", False), (3, "selected", True), (1, "unselected", True)])
def test_fp4_experts_claims_store_words_and_float32_scales(monkeypatch, t, kind, small):
    """FP4 experts through the same kernels: the claimed slot's words and float32 scale rows stored as read."""
    if small:
        monkeypatch.setattr(K4, "UP_CFG", {b: (32, 8, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K4, "DOWN_CFG", {b: (64, 8, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K4, "PREFETCH", {b: 1 for b in (1, 4, 16)})
    x, ids, w, dev, host, names = _int4_case(t, torch.float32, seed=60 + t, fp4=True)
    assert dev.s13.dtype == torch.float32
    _claim_keeps_output_and_copies(K4.fused_moe_int4, x, ids, w, dev, host, names, kind)


def test_int4_pytorch_path_copies_the_claim_then_refuses_host_rows(monkeypatch):
    """`grouped_moe_int4` takes no host rows (refused as before), but the claim is copied first; without host rows a
    claimed device slot is copied and the output keeps its bits."""
    monkeypatch.setattr(K4, "DECODE_MAX_TK", 0)
    x, ids, w, dev, host, names = _int4_case(3, torch.float32, seed=40)
    before = {n: getattr(dev, n)._base.clone() for n in names}
    with pytest.raises(ValueError, match="host rows"):
        K4.fused_moe_int4(x, ids, w, dev, host=host, first_host=HOT, claim=_claim("selected"))
    _check_tables({n: (getattr(dev, n), getattr(host, n)) for n in names}, before, 6, True)
    dev_ids = ids.clamp_max(HOT - 1)                 # device slots only: 3, 0 and 1 (not SPARE)
    want = K4.fused_moe_int4(x, dev_ids, w, dev)
    out = K4.fused_moe_int4(x, dev_ids, w, dev, claim=(torch.tensor([1], dtype=torch.int32, device=DEV),
                                                       torch.tensor([SPARE], device=DEV)))
    assert torch.equal(_bits(out), _bits(want))
    for n in names:
        assert torch.equal(_bits(getattr(dev, n)[SPARE]), _bits(getattr(dev, n)[1])), n


IDS_C = {1: [[6, 0, 5]], 3: [[6, 0, 5], [4, 6, 1], [5, 1, 7]]}     # host slots 4..7; device 2, 3 never selected


def _claims4() -> tuple[torch.Tensor, torch.Tensor]:
    """C = 4 claims (`expert_move_claims`): slot 5 into spare 2, slot 6 with no spare (-1: not stored), slot 7 into
    spare 3, entry 3 empty."""
    return (torch.tensor([5, 6, 7, -1], dtype=torch.int32, device=DEV),
            torch.tensor([2, -1, 3, 3], dtype=torch.int64, device=DEV))


def _check_four(parts: dict, before: dict, t: int) -> None:
    """Spare 2 holds host slot 5, spare 3 host slot 7 where a token selects it (else its old bytes); nothing else
    changed, the guard rows included."""
    for name, (dev, host) in parts.items():
        base = dev._base
        assert torch.equal(_bits(dev[2]), _bits(host[5 - HOT].to(dev.device))), name
        want3 = host[7 - HOT].to(dev.device) if t == 3 else before[name][1 + 3]
        assert torch.equal(_bits(dev[3]), _bits(want3)), name
        others = [r for r in range(base.shape[0]) if r not in (1 + 2, 1 + 3)]
        assert torch.equal(_bits(base[others]), _bits(before[name][others])), name


@pytest.mark.parametrize("t,small,pytorch", [(1, False, False), (3, False, False), (3, True, False),
                                             (3, False, True)])
def test_bf16_kernels_store_each_of_four_claims_into_its_spare(monkeypatch, t, small, pytorch):
    """C = 4: the decode kernels compare each selected slot with the four claims and store it into the matching
    entry's spare; the output keeps its bits; the PyTorch path copies the same."""
    if small:
        monkeypatch.setattr(K, "UP_CFG", {b: (8, 16, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K, "DOWN_CFG", {b: (16, 8, 1) for b in (1, 4, 16)})
    if pytorch:
        monkeypatch.setattr(K, "DECODE_MAX_TK", 0)
    x, _, w, dev13, dev2, host = _bf16_case(t, torch.bfloat16, 40, 20, seed=80 + t)
    ids = torch.tensor(IDS_C[t], dtype=torch.int32, device=DEV)
    before = {"w13": dev13._base.clone(), "w2": dev2._base.clone()}
    want = K.fused_moe(x, ids, w, dev13, dev2, host=host, prefill_kernel=False)
    out = K.fused_moe(x, ids, w, dev13, dev2, host=host, prefill_kernel=False, claim=_claims4())
    assert torch.equal(_bits(out), _bits(want))
    _check_four({"w13": (dev13, host.w13), "w2": (dev2, host.w2)}, before, t)


@pytest.mark.parametrize("t,small", [(1, False), (3, True)])
def test_fp8_and_int4_kernels_store_each_of_four_claims_into_its_spare(monkeypatch, t, small):
    """C = 4 with float8 experts (bytes and block scales) and INT4 experts (words and group scales; the down
    kernel's blocks span experts, each column stored into its own slot's spare; asymmetric at 3 tokens, the zero
    points stored with the scales; FP4 codes at 1)."""
    if small:
        monkeypatch.setattr(K, "UP_CFG", {b: (8, 16, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K, "DOWN_CFG", {b: (16, 8, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K4, "UP_CFG", {b: (32, 8, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K4, "DOWN_CFG", {b: (64, 8, 1) for b in (1, 4, 16)})
        monkeypatch.setattr(K4, "PREFETCH", {b: 1 for b in (1, 4, 16)})
    ids = torch.tensor(IDS_C[t], dtype=torch.int32, device=DEV)
    x, _, w, dev, host = _fp8_case(t, (16, 16), seed=90 + t)
    x4, _, w4, dev4, host4, names4 = _int4_case(t, torch.float32, seed=95 + t, asym=t == 3, fp4=t == 1)
    for moe, xx, ww, d, h, names in ((K.fused_moe_fp8, x, w, dev, host, FP8_NAMES),
                                     (K4.fused_moe_int4, x4, w4, dev4, host4, names4)):
        before = {n: getattr(d, n)._base.clone() for n in names}
        want = moe(xx, ids, ww, d, host=h, first_host=HOT)
        out = moe(xx, ids, ww, d, host=h, first_host=HOT, claim=_claims4())
        assert torch.equal(_bits(out), _bits(want))
        _check_four({n: (getattr(d, n), getattr(h, n)) for n in names}, before, t)
