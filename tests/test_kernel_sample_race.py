"""The sampling race kernel against its PyTorch reference: the same token for every row, or none where the row has
nothing to sample (the caller's greedy token stays).

Without CUDA the kernel runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py turns it on before triton
is imported): small vocabularies. There numpy's float32 log may differ from torch's by an ulp, so a token could
differ where two scores agree to rounding; none of these inputs has such a tie. With CUDA the same tests run
natively and the `gpu` test times the kernel against the reference at real vocabulary sizes.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import sample_race as K  # noqa: E402
from stage_worker.kernels import sample_race_ref as R  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
NONE = -1
# Rows with NaN / inf make numpy (the interpreter) warn where the GPU computes quietly.
pytestmark = [pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]                            # what `out` holds before the race: a row not ok keeps it


def _keys(b: int, g: torch.Generator) -> torch.Tensor:
    keys = torch.randint(0, 2 ** 32, (b,), generator=g, dtype=torch.int64)
    keys[0] = 2 ** 32 - 1                                  # the top bit set: unsigned arithmetic
    return keys.to(DEV)


def _probs(b: int, k: int, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(b, k, generator=g) * 3
    logits[:, ::5] = float("-inf")                         # filtered out: probability 0
    return torch.softmax(logits, dim=-1).to(DEV)


def _both(vals, keys, ids=None, **kw) -> tuple[list[int], list[int]]:
    n = (kw["rows"].max().item() + 1) if kw.get("rows") is not None else vals.shape[0]
    splits = kw.pop("splits", None)
    want = R.sample_race(torch.full((n,), NONE, device=DEV), vals, keys, ids, **kw)
    got = K.sample_race(torch.full((n,), NONE, device=DEV), vals, keys, ids, splits=splits, **kw)
    return got.tolist(), want.tolist()


@pytest.mark.parametrize("b,k,splits", [(1, 1, None), (3, 7, None), (5, 64, None), (2, 1000, None), (2, 1000, 3),
                                        (4, 3000, 7)])
@pytest.mark.parametrize("with_ids", [False, True])
def test_probabilities_draw_the_reference_token(b, k, splits, with_ids):
    g = torch.Generator().manual_seed(b * 1000 + k)
    probs, keys = _probs(b, k, g), _keys(b, g)
    ids = None
    if with_ids:                                           # distinct ids up to a 248k vocabulary, any order
        ids = torch.randperm(248320, generator=g)[: b * k].view(b, k).to(DEV)
        ids[0, -1] = 248319
    got, want = _both(probs, keys, ids, splits=splits)
    assert got == want
    assert (NONE in got) == (k == 1)                       # one column, filtered out: nothing to sample


def test_uniform_rows_pick_the_largest_hash():
    """Equal probabilities: the winner is the candidate with the largest U, so any hash bit differing shows."""
    g = torch.Generator().manual_seed(3)
    b, k = 16, 512
    probs = torch.full((b, k), 1.0 / k, device=DEV)
    keys = _keys(b, g)
    ids = torch.randint(0, 2 ** 20, (b, k), generator=g).to(DEV)
    got, want = _both(probs, keys, ids)
    assert got == want
    u = R.uniforms(keys, ids)
    assert want == ids.gather(1, u.argmax(dim=-1, keepdim=True))[:, 0].tolist()


def test_the_largest_hash_value_is_below_one_and_wins_in_both():
    """Key 1 and token 5949405 give the largest hash value. With 24 bits it became U = 1.0, E = -0.0 in PyTorch and
    +0.0 in the kernel: that candidate scored -inf in one and +inf in the other (the H200 run of
    test_timing_against_the_reference drew different tokens). U now stays below one, E above zero, and it wins."""
    keys = torch.tensor([1, 1], device=DEV)
    ids = torch.tensor([[3, 5949405, 17, 1000], [5949405, 8, 9, 10]], device=DEV)
    u = R.uniforms(keys, ids)
    assert float(u.max()) == 1.0 - 2.0 ** -24 and bool((-torch.log(u) > 0).all())
    for logits in (False, True):
        vals = torch.zeros(2, 4, device=DEV) if logits else torch.full((2, 4), 0.25, device=DEV)
        kw = dict(temperature=torch.ones(2, device=DEV)) if logits else {}
        got, want = _both(vals, keys, ids, **kw)
        assert got == want == [5949405, 5949405]


@pytest.mark.parametrize("splits", [None, 2])
def test_rows_with_nothing_to_sample_keep_the_caller_s_token(splits):
    g = torch.Generator().manual_seed(4)
    k = 600
    probs = _probs(6, k, g)
    probs[1] = 0.0                                         # all zero: sums to nothing
    probs[2, 17] = float("nan")                            # NaN: not finite
    probs[3, 599] = float("inf")
    probs[4, 3] = float("-inf")                            # -inf: not finite either
    probs[5, :-1] = 0.0                                    # one candidate left: drawn
    probs[5, -1] = 1.0
    keys = _keys(6, g)
    got, want = _both(probs, keys, splits=splits)
    assert got == want
    assert got[1:5] == [NONE] * 4 and got[5] == k - 1 and got[0] != NONE


@pytest.mark.parametrize("splits", [None, 3])
def test_ties_go_to_the_first_column(splits):
    """Two columns with the same token id and probability score the same: the first wins (torch.argmax)."""
    k = 900
    probs = torch.zeros(2, k, device=DEV)
    ids = torch.arange(k, device=DEV).repeat(2, 1)
    probs[:, 100] = probs[:, 800] = 0.5
    ids[:, 800] = 100
    keys = torch.tensor([5, 6], device=DEV)
    got, want = _both(probs, keys, ids, splits=splits)
    assert got == want == [100, 100]
    probs[:, 100] = 0.0                                    # the later column alone: its token
    ids[:, 800] = 101
    assert _both(probs, keys, ids, splits=splits)[0] == [101, 101]


@pytest.mark.parametrize("b,k,splits", [(1, 50, None), (4, 64, None), (3, 2000, None), (3, 2000, 4)])
def test_logits_draw_the_reference_token(b, k, splits):
    """Plain temperature sampling: Gumbel-max over logit / temperature equals softmax, normalise and race."""
    g = torch.Generator().manual_seed(k + b)
    logits = (torch.randn(b, k, generator=g) * 4).to(DEV)
    logits[:, 1::7] = float("-inf")                        # masked
    if b > 2:
        logits[2] += 5000.0                                # large logits: scores relative to the row's max
    temperature = torch.tensor([0.3, 1.0, 0.7, 1.7][:b], device=DEV)[:, None]
    keys = _keys(b, g)
    got, want = _both(logits, keys, temperature=temperature, splits=splits)
    assert got == want and NONE not in got


@pytest.mark.parametrize("splits", [None, 2])
def test_logit_rows_with_nothing_to_sample(splits):
    g = torch.Generator().manual_seed(6)
    k = 300
    logits = (torch.randn(5, k, generator=g) * 2).to(DEV)
    logits[1] = float("-inf")                              # everything masked
    logits[2, 7] = float("nan")
    logits[3, 250] = float("inf")                          # the reference's softmax: NaN
    logits[4] = float("-inf")                              # one token left
    logits[4, 123] = -3.0
    temperature = torch.full((5, 1), 0.8, device=DEV)
    got, want = _both(logits, _keys(5, g), temperature=temperature, splits=splits)
    assert got == want
    assert got[1:4] == [NONE] * 3 and got[4] == 123 and got[0] != NONE


def test_rows_write_into_the_batch_and_gather_reads_it():
    """`rows`: raced row r writes out[rows[r]]; with `gather` it also reads the whole batch's row rows[r] (logits,
    float64 table columns as `batch_sampler._Params.table` holds them)."""
    g = torch.Generator().manual_seed(7)
    B, k = 6, 80
    logits = (torch.randn(B, k, generator=g) * 2).to(DEV)
    table = torch.zeros(B, 8, dtype=torch.float64, device=DEV)
    table[:, 0] = torch.tensor([0.5, 0.9, 1.3, 0.7, 1.0, 2.0], dtype=torch.float64)
    table[:, 7] = _keys(B, g).to(torch.float64)
    rows = torch.tensor([4, 1, 3], device=DEV)
    got, want = _both(logits, table[:, 7], temperature=table[:, 0], rows=rows, gather=True)
    assert got == want
    assert got[0] == got[2] == NONE and NONE not in (got[1], got[3], got[4])

    probs = _probs(3, k, g)
    ids = torch.randint(0, 10 ** 5, (3, k), generator=g).to(DEV)
    keys = _keys(3, g)
    got, want = _both(probs, keys, ids, rows=rows)
    assert got == want
    out = torch.full((5,), NONE, device=DEV)
    K.sample_race(out, probs, keys, ids)                   # no rows: row r writes out[r]
    assert out[:3].tolist() == R.race(probs, keys, ids)[0].tolist() and out[3:].tolist() == [NONE, NONE]


def test_the_kernels_compile_for_the_h200():
    """Triton compiles both kernels for sm_90 without a GPU (a subprocess: the interpreter is off there), in every
    mode the sampler launches: probabilities with candidate ids (top-k rows, one launch), logits with a temperature
    read through `rows` from the whole batch (plain temperature rows, split), probabilities without ids split, keys
    as float64 (the parameter table's column); no register spills. h200-15's first GPU run failed to compile on
    what the interpreter accepts (a global integer used inside the kernel)."""
    from sm90_compile import run_compile_script

    script = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stage_worker.kernels import sample_race as S

def race(ids, rows, gather, logits, split, keys="*i64", block=1024):
    sig = dict(vals_ptr="*fp32", ids_ptr="*i64", keys_ptr=keys, temp_ptr="*fp32", rows_ptr="*i64", out_ptr="*i64",
               part_ptr="*fp32" if split else "*i64", K="i32", chunk="i32", s_v="i32", s_i="i32", s_k="i32",
               s_t="i32")
    const = dict(HAS_IDS=ids, HAS_ROWS=rows, GATHER=gather, LOGITS=logits, SPLIT=split, BLOCK=block)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(S._race_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8 if block > 512 else 4))
    return dict(kernel="race", ids=ids, rows=rows, logits=logits, split=split, keys=keys,
                **ptxas_info(k.asm["ptx"]))

def reduce(ids, rows, gather, logits):
    sig = dict(part_ptr="*fp32", ids_ptr="*i64", rows_ptr="*i64", out_ptr="*i64", S="i32", K="i32", s_i="i32")
    const = dict(HAS_IDS=ids, HAS_ROWS=rows, GATHER=gather, LOGITS=logits, BLOCK_S=64)
    sig.update(dict.fromkeys(const, "constexpr"))
    k = triton.compile(ASTSource(S._reduce_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=1))
    return dict(kernel="reduce", ids=ids, rows=rows, logits=logits, **ptxas_info(k.asm["ptx"]))

out = [race(True, False, False, False, False, block=64), race(False, True, True, True, True),
       race(False, True, False, False, True), race(True, True, False, False, False, keys="*fp64", block=64),
       reduce(False, True, True, True), reduce(False, True, False, False), reduce(True, False, False, False)]
print(json.dumps(out))
"""
    got = run_compile_script(script, timeout=300)
    print("\n" + "\n".join(map(str, got)))
    assert len(got) == 7 and all(c["spill"] == 0 for c in got), got


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 248320])
def test_timing_against_the_reference(vocab):
    """Kernel vs PyTorch race at B = 1, 4, 16 over the whole vocabulary: eager us a call (what the host-bound step
    pays: launches included) and graph-replayed us (GPU time), both modes, and the tokens equal."""
    from conftest import cuda_us, graph_us

    g = torch.Generator().manual_seed(vocab)
    print()
    for b in (1, 4, 16):
        logits = (torch.randn(b, vocab, generator=g) * 4).to(DEV)
        temperature = torch.rand(b, 1, generator=g).to(DEV) + 0.5
        probs = torch.softmax(logits / temperature, dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        keys = _keys(b, g)
        out = torch.zeros(b, dtype=torch.int64, device=DEV)
        runs = {
            "probs": (lambda: R.sample_race(out, probs, keys), lambda s=None: K.sample_race(out, probs, keys,
                                                                                           splits=s)),
            "logits": (lambda: R.sample_race(out, logits, keys, temperature=temperature),
                       lambda s=None: K.sample_race(out, logits, keys, temperature=temperature, splits=s)),
        }
        for mode, (ref, kern) in runs.items():
            want = ref().clone()
            for s in (None, 1):
                assert torch.equal(kern(s), want), (mode, b, s)
            ref_eager, ref_graph = cuda_us(ref), graph_us(lambda i: ref())
            k_eager, k_graph = cuda_us(kern), graph_us(lambda i: kern())
            one_eager, one_graph = cuda_us(lambda: kern(1)), graph_us(lambda i: kern(1))
            print(f"sample_race V={vocab} B={b:2d} {mode:6s}: kernel {k_eager:7.1f} us eager {k_graph:7.1f} us GPU "
                  f"(splits {K.choose_splits(b, vocab, logits.device)}; one program a row {one_eager:7.1f} / "
                  f"{one_graph:7.1f}) | reference {ref_eager:7.1f} us eager {ref_graph:7.1f} us GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 248320])
def test_sample_rows_timing_with_and_without_the_kernel(vocab):
    """The whole device sampler (`batch_sampler.sample_rows`, eager us a call) with the `sample_race` flag off and on:
    plain temperature rows (the logit mode), and top-k / top-p rows (candidates, then the probability mode)."""
    from conftest import cuda_us

    from shared.sampling import SamplingParams
    from stage_worker import batch_sampler as bs

    g = torch.Generator().manual_seed(vocab + 1)
    print()
    for b in (1, 4, 16):
        logits = (torch.randn(b, vocab, generator=g) * 4).to(DEV, torch.bfloat16)
        for name, params in (("plain", SamplingParams(temperature=0.8)),
                             ("top-k/p", SamplingParams(temperature=0.8, top_k=40, top_p=0.95))):
            rows = [bs.Row(params, seed=11 + i, position=100, history=[]) for i in range(b)]
            off = bs.sample_rows(logits, rows)
            assert torch.equal(bs.sample_rows(logits, rows, race_kernel=True), off), (name, b)
            us_off = cuda_us(lambda: bs.sample_rows(logits, rows))
            us_on = cuda_us(lambda: bs.sample_rows(logits, rows, race_kernel=True))
            print(f"sample_rows V={vocab} B={b:2d} {name:7s}: sample_race on {us_on:7.1f} us, off {us_off:7.1f} us")
