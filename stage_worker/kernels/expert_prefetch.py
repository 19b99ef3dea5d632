"""Layer-ahead expert prefetch (issue 16, `expert_prefetch`): the predict and copy launches; the redirect is in the
router kernel (`moe._route_row`'s PF). What and why: `expert_prefetch_ref.py` (the references and the state).

`predict` (one launch on the device's "predict" stream, beside layer L's router and experts): the next MoE layer's router GEMV on L's input
(`moe.router_logits`, programs of PREDICT_CFG rows), and the last program to finish (`split_reduce.last_of`) ranks
each token's best `Prefetch.top` (`moe._route_row`, through the next layer's slot map; a graph's padding rows select
nothing; `expert_prefetch_top`, by default the layer's top-k) and
writes the first P distinct host slots, rank-major, to the next layer's `Prefetch.slot`, clearing `ready`. With
`logits` given (the benchmark's routing replay) one program does only the second part.

`copy` (one launch on a second side stream, forked from the forward's stream after layer L's expert launches so
that it does not slow their own host reads, and joined at the end of the forward): program (p, j) copies its share of
every part of host slot `slot[p]`'s rows into prefetch slot `first + p`; the last of entry p's programs to finish sets
`ready[p]` with release semantics, which the router kernel reads with acquire. A copy that is not done when the
next layer routes is simply not used: that layer reads the host slot over PCIe as without the prefetch. So a wrong
guess costs PCIe bandwidth beside the step, never a wait.

Ordering, per step: the predict launch forks from the forward's stream and that stream joins it after layer L's
expert launches, so the next layer's router never sees a `ready` of an earlier step (and L's down launch waits for
nothing of the prefetch's); the copy stream forks after that join and is joined by the forward's stream at the end of the stage's
forward (`StageModel.forward`), so no copy of step t runs into step t + 1. Tests: tests/test_expert_prefetch.py (CPU
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from stage_worker.kernels.common import INTERPRET, cuda_index, fix_interpreter_loop_bounds
from stage_worker.kernels.common import pow2 as _pow2
from stage_worker.kernels.expert_prefetch_ref import Prefetch
from stage_worker.kernels.moe import triton

if INTERPRET:
    fix_interpreter_loop_bounds()      # the copy kernel's loop starts at a program id

if triton is not None:
    import triton.language as tl

    from stage_worker.kernels.moe import _route_row, router_logits
    from stage_worker.kernels.split_reduce import last_of

    @triton.jit
    def _predict_tail(logits_ptr, pw_ptr, pids_ptr, valid_ptr, map_ptr, slot_ptr, ready_ptr, issued_ptr, E,
                      FIRST_HOST, T: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, VALID: tl.constexpr, SLOT_MAP: tl.constexpr, P: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, KEY32: tl.constexpr):
        """Rank the T rows of logits [T, E] (top-k, slot map, padding rows: SKIP) into pids [T, k], then the first
        P distinct host slots among them, rank-major, into slot [P] (-1 after), ready [P] cleared, +their number to
        issued."""
        for t in tl.static_range(T):
            _route_row(t, logits_ptr, pw_ptr, pids_ptr, pw_ptr, issued_ptr, valid_ptr, map_ptr, E, E, FIRST_HOST,
                       TOP_K, 0, True, BLOCK_E, BLOCK_K, False, VALID, SLOT_MAP, None, None, False, None, 1, True,
                       KEY32)
        tl.debug_barrier()                       # the rows' ids, stored by other threads of this program
        n = tl.arange(0, BLOCK_N)
        rank = n // T
        tok = n % T
        inside = n < T * TOP_K
        ids = tl.load(pids_ptr + tok * TOP_K + rank, mask=inside, other=-1, cache_modifier=".cg")
        left = inside & (ids >= FIRST_HOST)
        pp = tl.arange(0, BLOCK_P)
        out = tl.full([BLOCK_P], -1, tl.int32)
        for p in tl.static_range(P):
            first = tl.min(tl.where(left, n, BLOCK_N), axis=0)
            s = tl.where(first < BLOCK_N, tl.sum(tl.where(n == first, ids, 0), axis=0), -1)
            out = tl.where(pp == p, s, out)
            left = left & (ids != s)
        tl.store(slot_ptr + pp, out, mask=pp < P)
        tl.store(ready_ptr + pp, tl.zeros([BLOCK_P], tl.int32), mask=pp < P)
        tl.atomic_add(issued_ptr, tl.sum(tl.where((pp < P) & (out >= 0), 1, 0), axis=0).to(tl.int64))

    @triton.jit
    def _predict_kernel(x_ptr, w_ptr, logits_ptr, lock_ptr, pw_ptr, pids_ptr, valid_ptr, map_ptr, slot_ptr,
                        ready_ptr, issued_ptr, E, stride_xt, stride_wr, FIRST_HOST, H: tl.constexpr,
                        T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, VALID: tl.constexpr,
                        SLOT_MAP: tl.constexpr, NPROG: tl.constexpr, GIVEN: tl.constexpr, P: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, KEY32: tl.constexpr):
        """Program p: the logits of router rows p*BLOCK_R .. +BLOCK_R for all T tokens; the last to finish ranks
        them (`_predict_tail`). GIVEN: the logits are given, one program ranks them."""
        if GIVEN:
            _predict_tail(logits_ptr, pw_ptr, pids_ptr, valid_ptr, map_ptr, slot_ptr, ready_ptr, issued_ptr, E,
                          FIRST_HOST, T, TOP_K, BLOCK_E, BLOCK_K, VALID, SLOT_MAP, P, BLOCK_P, BLOCK_N, KEY32)
        else:
            rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
            mask_r = rows < E
            offs_h = tl.arange(0, BLOCK_H)
            w_first = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wr + offs_h[None, :],
                              mask=mask_r[:, None] & (offs_h < H)[None, :], other=0.0)
            router_logits(x_ptr, w_ptr, logits_ptr, rows, mask_r, w_first, E, stride_xt, stride_wr, H, T, BLOCK_T,
                          BLOCK_R, BLOCK_H)
            if last_of(lock_ptr, NPROG):
                _predict_tail(logits_ptr, pw_ptr, pids_ptr, valid_ptr, map_ptr, slot_ptr, ready_ptr, issued_ptr, E,
                              FIRST_HOST, T, TOP_K, BLOCK_E, BLOCK_K, VALID, SLOT_MAP, P, BLOCK_P, BLOCK_N, KEY32)

    @triton.jit
    def _copy_part(d_ptr, h_ptr, src_row, dst_row, N, NPROG: tl.constexpr, BLOCK: tl.constexpr):
        """This program's share (every NPROG-th BLOCK, from program_id(1)) of row src_row of h into row dst_row of
        d, rows N elements long."""
        src = h_ptr + src_row.to(tl.int64) * N
        dst = d_ptr + dst_row.to(tl.int64) * N
        for start in range(tl.program_id(1) * BLOCK, N, NPROG * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < N
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    @triton.jit
    def _copy_kernel(slot_ptr, ready_ptr, done_ptr, d0, h0, d1, h1, d2, h2, d3, h3, N0, N1, N2, N3, FIRST_HOST,
                     PF_FIRST, NPARTS: tl.constexpr, NPROG: tl.constexpr, BLOCK: tl.constexpr):
        """Entry program_id(0) = p: host slot slot[p]'s rows of the NPARTS parts (device rows d*, host rows h*, N*
        elements a row) into device row PF_FIRST + p; the last of the entry's NPROG programs sets ready[p]."""
        p = tl.program_id(0)
        s = tl.load(slot_ptr + p)
        if s >= 0:
            src = s - FIRST_HOST
            dst = PF_FIRST + p
            _copy_part(d0, h0, src, dst, N0, NPROG, BLOCK)
            _copy_part(d1, h1, src, dst, N1, NPROG, BLOCK)
            if NPARTS > 2:
                _copy_part(d2, h2, src, dst, N2, NPROG, BLOCK)
                _copy_part(d3, h3, src, dst, N3, NPROG, BLOCK)
            if last_of(done_ptr + p, NPROG):
                tl.atomic_xchg(ready_ptr + p, 1, sem="release", scope="gpu")


# The prediction's GEMV: router rows a program, hidden columns a load (BLOCK_H shrinks with the tokens: the program
# holds a [rows, tokens, columns] fp32 product), warps. Few rows a program would take more SMs from the forward's
# kernels that run beside it; untuned.
PREDICT_CFG = (4, 1024, 4)
# Programs a copied slot gets and elements a program moves a load: PCIe reads are latency bound, so a few programs
# with 8 KB loads in flight each; few enough to leave the forward's kernels their SMs. Untuned.
COPY_PROGRAMS = 16
COPY_BLOCK = 2048


_pending: set[int] = set()       # devices whose prefetch stream has copies the forward's stream has not joined


def note_pending(device: torch.device) -> None:
    """A copy was queued on `device`'s prefetch stream (`join_prefetch` joins it)."""
    _pending.add(cuda_index(device))


def join_prefetch(device: torch.device) -> None:
    """End of a forward: the current stream waits for the prefetch copies queued since the last join (inside a
    CUDA-graph capture every forked stream must join before the capture ends; eagerly, no copy of this step may
    still run when the next step's prediction clears the flags)."""
    if not _pending or torch.device(device).type != "cuda":
        return
    from stage_worker.kernels.common import side_stream

    index = cuda_index(device)
    if index in _pending:
        _pending.discard(index)
        torch.cuda.current_stream(index).wait_stream(side_stream(index, "prefetch"))


def predict(x: torch.Tensor, gate: torch.Tensor, top_k: int, pf: Prefetch, first_host: int,
            slot_map: torch.Tensor | None = None, valid: torch.Tensor | None = None,
            logits: torch.Tensor | None = None) -> None:
    """x [T, H] (this layer's MoE input), gate [E, H] (the next layer's router rows, expert order with its slot
    map, else slot order) -> the next layer's `pf.slot` / `pf.ready` (`expert_prefetch_ref.predict_ref`). `valid`
    int32 [1]: a graph's real rows. `logits` [T, E] given: no GEMV (the benchmark's replay). One launch, on the
    current stream."""
    T, H = x.shape
    E = gate.shape[0]
    if not 0 < T <= pf.max_tokens or pf.logits.shape[1] != E or not 0 < top_k <= pf.ids.shape[1]:
        raise ValueError(f"prefetch of {T} tokens, {E} experts, top-{top_k}: the state holds "
                         f"{tuple(pf.logits.shape)} logits and top-{pf.ids.shape[1]}")
    given = logits is not None
    if given and (logits.shape != (T, E) or logits.stride() != (E, 1)):
        raise ValueError(f"given logits {tuple(logits.shape)} for {T} tokens and {E} experts (contiguous)")
    br, bh, warps = PREDICT_CFG
    bt = _pow2(T)
    bh = min(_pow2(H), max(128, bh * 4 // max(bt, 4)))
    nprog = 1 if given else -(-E // br)
    P = pf.slots
    _predict_kernel[(nprog,)](
        x, gate, logits if given else pf.logits, pf.lock, pf.weights, pf.ids, pf.ids if valid is None else valid,
        pf.ids if slot_map is None else slot_map, pf.slot, pf.ready, pf.issued, E, x.stride(0), gate.stride(0),
        first_host, H=H, T=T, BLOCK_T=bt, BLOCK_R=br, BLOCK_H=bh, TOP_K=top_k, BLOCK_E=_pow2(E),
        BLOCK_K=_pow2(top_k), VALID=valid is not None, SLOT_MAP=slot_map is not None, NPROG=nprog, GIVEN=given,
        P=P, BLOCK_P=_pow2(P), BLOCK_N=_pow2(T * top_k), KEY32=False, num_warps=warps)


def copy(pf: Prefetch, dev: list[torch.Tensor], host: list[torch.Tensor], first_host: int) -> None:
    """The rows of the host slots `pf.slot` names into the prefetch slots (`expert_prefetch_ref.copy_ref`): dev /
    host the table's parts in one order (2: w13, w2; 4: INT4 or float8 words and scales), contiguous. One launch
    on the current stream."""
    n = len(dev)
    if n not in (2, 4) or len(host) != n:
        raise ValueError(f"a table has 2 or 4 parts, not {n} / {len(host)}")
    for d, h in zip(dev, host):
        if not (d.is_contiguous() and h.is_contiguous()) or d.shape[1:] != h.shape[1:] or d.dtype != h.dtype:
            raise ValueError("prefetch copies contiguous parts of one row shape and dtype")
    rows = [int(d[0].numel()) if d.shape[0] else int(h[0].numel()) for d, h in zip(dev, host)]
    parts = [t for pair in zip(dev, host) for t in pair]
    if n == 2:
        parts += parts
        rows += rows
    block = min(COPY_BLOCK, _pow2(max(rows)))
    _copy_kernel[(pf.slots, COPY_PROGRAMS)](pf.slot, pf.ready, pf.done, *parts, *rows, first_host, pf.first,
                                           NPARTS=n, NPROG=COPY_PROGRAMS, BLOCK=block)
