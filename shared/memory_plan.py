"""The start-up memory plan (issue 16, first part): what each GPU stage needs, what its device may give, and the KV
pool from what is left; or a refusal that prints the numbers and the flag that would make the model fit.

Why at start-up and in one place: a server that fits its weights but not its KV pool, its CUDA-graph pools or its
largest prefill fails minutes later, at the first long request (the reports' predicted peak was half the real one,
001 §5.4; 002 §2). Every stage must hold the same number of KV blocks (the gateway places them), so the plan is made
once, for all stages together, and written into the cluster config every process reads.

Inputs are plain numbers (`StageNeeds`, measured by `stage_worker.memory_needs` on the meta device, and each
device's total and free bytes), so the plan is a pure function with unit tests. A device's budget is the smaller of
`gpu_memory_utilization` x total and `vram_limit` (a large card made to behave as a small one); it must not exceed
what is free now. Stages sharing a device share its budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

GIB = 1 << 30
# The shortest max_model_len the plan fits an unset --max-model-len down to (`fit_max_model_len`): llama.cpp's
# `--fit` floor (`--fit-ctx`, 4096) and its default context; below it a chat with a system prompt and a tool list
# no longer fits, so a server that short is refused instead of started.
MIN_FITTED_LEN = 4096
# `--cold-experts auto` with --max-model-len unset moves experts out for a context this long (or the model's own, if
# shorter), then the plan fits the context to what is left: not expert bytes moved to host RAM, and paid for with
# every token's host reads, for a 262,144-token context nobody asked for. 32k holds a coding agent's first request
# (system prompt, tool list, files: ~25k tokens); --max-model-len asks for more, with more experts in host RAM.
AUTO_OFFLOAD_LEN = 32768


class MemoryPlanError(ValueError):
    """The model does not fit as configured; the message has the numbers and what to change. `where`: the device
    (or "host RAM") that refused, where the plan knows it."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int


@dataclass(frozen=True)
class StageNeeds:
    stage: int
    layers: tuple[int, int]
    device: str
    weights: int             # parameters in VRAM (the PLE table stays on the host)
    state: int               # per-slot recurrent / conv / PLE state for max_num_seqs + 1 slots
    block: int               # one KV block
    reserve: int             # activations of the largest step, CUDA-graph pools, kernel workspace
    host_experts: int = 0    # cold experts' bytes in pinned host RAM (not part of `weights`)
    routed_experts: int = 0  # routed experts' bytes still in `weights` (what `--cold-experts auto` may move out)
    expert_bytes: int = 0    # one routed expert as the stage holds it (INT4 kept packed: its packed size; layers
    #                          that differ: the smallest, so `auto` moves out at least what it must); 0: unknown
    host_block: int = 0      # one KV block's bytes in pinned host RAM (QSA K/V with qsa_kv_offload; not in `block`)
    host_state: int = 0      # the prefix cache's saved states in pinned host RAM (prefix_cache_states; not in `state`)
    row_cache: int = 0       # VRAM of the K/V row cache over host K/V (kv_row_cache; not in `state`)
    reserve_context: int = 0  # of `reserve`: what the worst prefill chunk up to max_model_len adds over a short one
    offload_helps: bool = False  # QSA layers with K/V in VRAM: --qsa-kv-offload would make that part flat
    spare_bytes: int = 0     # VRAM moves on read's spare slots would add once experts of the MoE layers that have
    #                          none in host RAM yet go there (expert_move_async; not in `weights` until then)

    @property
    def fixed(self) -> int:
        return self.weights + self.state + self.reserve + self.row_cache


@dataclass
class PlanLimits:
    block_size: int
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float = 0.9
    vram_limit: int = 0                 # bytes per device; 0 = none
    kv_cache_memory_bytes: int = 0      # KV bytes per stage; 0 = whatever is left
    host_kv_bytes: int = 0              # host RAM the stages' host K/V may take together (qsa_kv_offload); 0 = none
    max_num_batched_tokens: int = 0     # the prefill chunk the reserve was measured at (0: not said)


@dataclass
class MemoryPlan:
    num_blocks: int
    budgets: dict[str, int]
    stages: list[StageNeeds]
    per_seq: int = 0            # blocks one max_model_len sequence takes
    max_num_seqs: int = 0
    limited_by: str = ""        # what keeps the pool below max_num_seqs full sequences, and the flag that helps
    max_model_len: int = 0      # the length the plan is for
    fitted: str = ""            # `fit_max_model_len` chose max_model_len (--max-model-len unset): the line saying so

    @property
    def full_sequences(self) -> int:
        """Sequences of max_model_len the pool holds at once, without preemption."""
        return self.num_blocks // self.per_seq if self.per_seq else 0

    def table(self) -> str:
        """One line per stage: what its device budget holds."""
        lines = [f"{'stage':>5} {'layers':>9} {'device':>8} {'weights':>8} {'state':>7} {'reserve':>8} "
                 f"{'KV':>8} {'budget':>8} {'host':>8} {'host KV':>8} {'rows':>6}  (GiB; {self.num_blocks} KV blocks "
                 f"per stage; host: cold experts in pinned RAM; host KV: QSA K/V in pinned RAM; rows: VRAM row cache "
                 f"of host K/V)"]
        for s in self.stages:
            lines.append(f"{s.stage:>5} {f'{s.layers[0]}-{s.layers[1]}':>9} {s.device:>8} {s.weights / GIB:>8.2f} "
                         f"{s.state / GIB:>7.2f} {s.reserve / GIB:>8.2f} {(self.num_blocks + 1) * s.block / GIB:>8.2f}"
                         f" {self.budgets[s.device] / GIB:>8.2f} {s.host_experts / GIB:>8.2f}"
                         f" {(self.num_blocks + 1) * s.host_block / GIB:>8.2f} {s.row_cache / GIB:>6.2f}")
            if s.reserve_context:
                lines.append(f"      (reserve: {s.reserve_context / GIB:.2f} GiB of it is the prefill chunk at the "
                             f"longest context)")
        if self.per_seq:
            lines.append(f"the KV pool holds {self.full_sequences} sequences of max_model_len at once "
                         f"(--max-num-seqs {self.max_num_seqs})"
                         + (f"; fewer because {self.limited_by}: more at once are preempted" if self.limited_by
                            else ""))
        return "\n".join(lines)


def device_budget(name: str, mem: DeviceMemory, limits: PlanLimits) -> int:
    budget = int(mem.total * limits.gpu_memory_utilization)
    if limits.vram_limit:
        budget = min(budget, limits.vram_limit)
    if budget > mem.free:
        raise MemoryPlanError(
            f"{name}: the plan may use {budget / GIB:.2f} GiB ({_budget_rule(limits)}), but only "
            f"{mem.free / GIB:.2f} of {mem.total / GIB:.2f} GiB are free (another process holds the rest): lower "
            f"--gpu-memory-utilization to {max(mem.free / mem.total - 0.01, 0):.2f} or set --vram-limit "
            f"{mem.free / GIB:.0f}, or free the device", name)
    return budget


def _budget_flag(limits: PlanLimits) -> str:
    """The flag that bounds the budget: --vram-limit when it is set (it is then below the utilization's share)."""
    return "--vram-limit" if limits.vram_limit else "--gpu-memory-utilization"


def _budget_rule(limits: PlanLimits) -> str:
    rule = f"--gpu-memory-utilization {limits.gpu_memory_utilization:g}"
    return rule + (f", --vram-limit {limits.vram_limit / GIB:g}" if limits.vram_limit else "")


def plan(stages: list[StageNeeds], devices: dict[str, DeviceMemory], limits: PlanLimits) -> MemoryPlan:
    """The number of KV blocks every stage holds (one more each: the CUDA-graph scratch block), at most what
    `max_num_seqs` sequences of `max_model_len` can use; MemoryPlanError when even the weights, or one sequence of
    `max_model_len`, do not fit."""
    per_seq = -(-limits.max_model_len // limits.block_size)
    want = per_seq * limits.max_num_seqs
    budgets = {name: device_budget(name, devices[name], limits) for name in sorted({s.device for s in stages})}
    fit, limited_by = want, ""
    for name, budget in budgets.items():
        mine = [s for s in stages if s.device == name]
        fixed = sum(s.fixed for s in mine)
        if fixed > budget:
            raise MemoryPlanError(_too_big(mine, name, budget, fixed, limits), name)
        per_block = sum(s.block for s in mine)
        if per_block == 0:
            continue
        blocks = (budget - fixed) // per_block - 1
        if limits.kv_cache_memory_bytes:
            blocks = min(blocks, min(limits.kv_cache_memory_bytes // s.block for s in mine if s.block) - 1)
        if blocks < per_seq:
            raise MemoryPlanError(_no_room_for_kv(mine, name, budget, fixed, per_block, per_seq, limits), name)
        if blocks < fit:
            fit, limited_by = blocks, (f"{name}'s budget ({_budget_rule(limits)}"
                                       + (", --kv-cache-memory-bytes" if limits.kv_cache_memory_bytes else "") + ")"
                                       + ("; --qsa-kv-offload keeps QSA K/V in host RAM" if any(
                                           s.offload_helps for s in mine) else ""))
    host_block = sum(s.host_block for s in stages)
    if host_block:
        # Host K/V of every stage comes out of one host's RAM (`moepipe serve` runs the stages on one machine).
        blocks = limits.host_kv_bytes // host_block - 1
        if blocks < per_seq:
            raise MemoryPlanError(
                f"host RAM: {limits.host_kv_bytes / GIB:.2f} GiB may hold QSA K/V (what is available after cold "
                f"experts and headroom), {max(blocks, 0)} blocks of {limits.block_size} tokens at {host_block} bytes "
                f"each for all stages; one sequence of --max-model-len {limits.max_model_len} needs {per_seq}. Use "
                f"--max-model-len {max(blocks, 0) * limits.block_size} or less, keep fewer experts in host RAM, "
                f"or run without --qsa-kv-offload", "host RAM")
        if blocks < fit:
            fit, limited_by = blocks, (f"host RAM for QSA K/V ({limits.host_kv_bytes / GIB:.2f} GiB available after "
                                       f"cold experts and headroom; {per_seq * host_block / GIB:.2f} GiB a sequence)")
    return MemoryPlan(num_blocks=fit, budgets=budgets, stages=stages, per_seq=per_seq,
                      max_num_seqs=limits.max_num_seqs, limited_by=limited_by, max_model_len=limits.max_model_len)


PlanInputs = tuple[list[StageNeeds], dict[str, DeviceMemory], PlanLimits]


def fit_step(block_size: int) -> int:
    """A fitted max_model_len is a multiple of this: 1024 where the block size divides it, else the multiple of the
    block size nearest below 1024 (whole blocks either way)."""
    return 1024 if 1024 % block_size == 0 else block_size * max(1024 // block_size, 1)


def fit_max_model_len(stages: list[StageNeeds], devices: dict[str, DeviceMemory], limits: PlanLimits,
                      needs_at: Callable[[int], PlanInputs], user_set: bool, minimum: int = MIN_FITTED_LEN,
                      tries: int = 3) -> MemoryPlan:
    """The plan at `limits.max_model_len`; when that is refused and the user did not set --max-model-len (it is
    the model's own length), the plan at the longest shorter length that fits instead, its `fitted` line saying so
    (llama.cpp's `--fit`, vLLM's `--max-model-len auto`): a multiple of `fit_step`, at least `minimum`.

    What a length needs is measured again for each candidate (`needs_at(length)`: the plan's inputs at that length,
    from the needs process; the prefill chunk's reserve grows with the context, `StageNeeds.reserve_context`), at
    most `tries` times: a candidate is the longest length the lengths measured so far predict to fit (their
    reserves interpolated, below the shortest scaled with its context part), the last try `minimum` while none has
    fit; the answer is the longest that fit for real. Refused with the first refusal when the user set the length
    or when nothing from `minimum` up fits (weights alone too big, a device already busy: no length helps)."""
    try:
        return plan(stages, devices, limits)
    except MemoryPlanError as exc:
        if user_set:
            raise
        refusal = exc
    full, step = limits.max_model_len, fit_step(limits.block_size)
    lowest = -(-minimum // step) * step
    measured = {full: stages}
    best, failed = None, full
    for n in range(tries):
        cand = _predicted_fit(measured, devices, limits, lowest, failed, step)
        if best is None and n == tries - 1 and lowest < failed and cand is not None:
            cand = lowest                   # no prediction has held: does the shortest allowed fit?
        if cand is None or (best is not None and cand <= best.max_model_len):
            break
        got, devices, limits = needs_at(cand)
        limits = dataclasses.replace(limits, max_model_len=cand)
        measured[cand] = got
        try:
            best = plan(got, devices, limits)
        except MemoryPlanError:
            failed = cand
        if best is not None and failed - best.max_model_len <= step:
            break
    if best is None:
        raise refusal
    offload = any(s.offload_helps for s in best.stages)
    where = refusal.where or "the devices"
    best.fitted = (f"moepipe: --max-model-len not set: one sequence of the model's {full} tokens (its KV and the "
                   f"prefill chunk's scratch at that context) does not fit in what {where} leaves after "
                   f"{'cold experts' if where == 'host RAM' else 'the weights'}; serving with --max-model-len {best.max_model_len}, the longest found "
                   f"to fit (pass --max-model-len to choose; more GPUs with --stages, a higher "
                   f"{_budget_flag(limits)}" + (" or --qsa-kv-offload" if offload else "") + " give more)")
    return best


def _predicted_fit(measured: dict[int, list[StageNeeds]], devices: dict[str, DeviceMemory], limits: PlanLimits,
                   lowest: int, below: int, step: int) -> int | None:
    """The longest multiple of `step` from `lowest` up and under `below` that the plan accepts with the needs
    `_needs_between` predicts; None when not even `lowest` is predicted to fit."""
    def fits(k: int) -> bool:
        length = k * step
        try:
            plan(_needs_between(measured, length), devices, dataclasses.replace(limits, max_model_len=length))
        except MemoryPlanError:
            return False
        return True

    lo, hi = lowest // step, (below - 1) // step
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _needs_between(measured: dict[int, list[StageNeeds]], length: int) -> list[StageNeeds]:
    """Each stage's needs at `length` from those measured at other lengths: the reserve (and its context part)
    interpolated between the nearest measured lengths around it, rounded up; below the shortest, on the line
    through the two shortest, or with one, its context part scaled with the length (the chunk's attention scratch
    is about proportional to the context); above the longest, the longest's. Nothing else depends on the length."""
    points = sorted(measured)
    under = [p for p in points if p <= length]
    over = [p for p in points if p >= length]
    if not over:
        return measured[under[-1]]
    if not under:
        top = over[0]
        if len(over) == 1:
            out = []
            for s in measured[top]:
                ctx = -(-s.reserve_context * length // top)
                out.append(dataclasses.replace(s, reserve=s.reserve - s.reserve_context + ctx, reserve_context=ctx))
            return out
        lo, hi = top, over[1]           # a line through the two shortest (a refused prediction corrects the next)
        out = []
        for a, b in zip(measured[lo], measured[hi], strict=True):
            def back(x: int, y: int) -> int:
                return max(x - max(y - x, 0) * (lo - length) // (hi - lo), 0)
            out.append(dataclasses.replace(a, reserve=back(a.reserve, b.reserve),
                                           reserve_context=back(a.reserve_context, b.reserve_context)))
        return out
    lo, hi = under[-1], over[0]
    if lo == hi:
        return measured[lo]
    out = []
    for a, b in zip(measured[lo], measured[hi], strict=True):
        def between(x: int, y: int) -> int:
            return x + -(-(y - x) * (length - lo) // (hi - lo))
        out.append(dataclasses.replace(b, reserve=between(a.reserve, b.reserve),
                                       reserve_context=between(a.reserve_context, b.reserve_context)))
    return out


def host_kv_room(available: int, stages: list[StageNeeds], headroom: int = 2 * GIB) -> int:
    """Host RAM the QSA K/V of `qsa_kv_offload` may take (`PlanLimits.host_kv_bytes`): what the host has available,
    less the cold experts and saved prefix states the stages will pin and the headroom a pinned allocation must leave
    (`stage_worker.host_memory.allocate`). Pinned pages are never evicted, so what host K/V takes is also gone from
    the PLE table's page cache (002 §1: 47.5 GiB of host K/V left 2.5 GiB of a 95 GiB table cached)."""
    return max(available - sum(s.host_experts + s.host_state for s in stages) - headroom, 0)


def host_bytes_to_fit(stages: list[StageNeeds], devices: dict[str, DeviceMemory],
                      limits: PlanLimits) -> dict[int, int]:
    """`--cold-experts auto`: per stage, the routed-expert bytes to keep in host RAM so that every device holds its
    stages' weights, state and reserve and one `max_model_len` sequence of KV (the least offload that starts; the
    KV pool then takes whatever is left). Shared evenly by the stages of a device, each at most its routed experts;
    what a stage cannot take goes to the others (QA: an even split capped at a small stage's experts moved 5.56 of
    the 7.13 GiB over, and the plan then refused a model that fits). The plan refuses what still does not fit."""
    per_seq = -(-limits.max_model_len // limits.block_size) + 1
    out = {s.stage: 0 for s in stages}
    for name in sorted({s.device for s in stages}):
        mine = sorted((s for s in stages if s.device == name), key=lambda s: (s.routed_experts, s.stage))
        budget = device_budget(name, devices[name], limits)
        over = sum(s.fixed for s in mine) + per_seq * sum(s.block for s in mine) - budget
        for i, s in enumerate(mine):           # the smallest first: each takes an even share of what is left
            if over <= 0:
                break
            take = min(-(-over // (len(mine) - i)), s.routed_experts)
            out[s.stage] = take
            over -= take
    return out


def _too_big(mine: list[StageNeeds], name: str, budget: int, fixed: int, limits: PlanLimits) -> str:
    parts = ", ".join(f"stage {s.stage} (layers {s.layers[0]}-{s.layers[1]}): weights {s.weights / GIB:.2f} + "
                      f"state {s.state / GIB:.2f} + reserve {s.reserve / GIB:.2f}"
                      + (f" + K/V row cache {s.row_cache / GIB:.2f}" if s.row_cache else "") for s in mine)
    weights = sum(s.weights for s in mine)
    per_device = max(budget - sum(s.state + s.reserve for s in mine), 1)
    need = -(-weights // per_device)
    per_seq = -(-limits.max_model_len // limits.block_size) + 1
    over = fixed + per_seq * sum(s.block for s in mine) - budget
    return (f"{name} holds {budget / GIB:.2f} GiB ({_budget_rule(limits)}); its stages need {fixed / GIB:.2f} GiB "
            f"before any KV cache ({parts}). " + _context_hint(mine, max(fixed - budget, 0), limits)
            + f"Spread the layers over more GPUs (--stages, one GPU each: about "
            f"{need} devices of this size for these layers), raise {_budget_flag(limits)}, "
            + _chunk_hint(limits) + f"or keep at least "
            f"{(over / len(mine) + max(s.spare_bytes for s in mine)) / GIB:.1f} GiB more of experts per stage in "
            f"host RAM (--cold-experts FILE, written "
            f"by `moepipe cold-set --gib-per-stage N`)")


def _chunk_hint(limits: PlanLimits) -> str:
    """A GPU serve prefills in 2048-token chunks by default (cluster_config.GPU_MAX_NUM_BATCHED_TOKENS): a smaller
    chunk shrinks the reserve's activations, at the cost of slower prefill."""
    if limits.max_num_batched_tokens <= 512:
        return ""
    return (f"use --max-num-batched-tokens 512 (a smaller prefill chunk than {limits.max_num_batched_tokens}: a "
            "smaller reserve, slower prompts), ")


def _context_hint(mine: list[StageNeeds], short: int, limits: PlanLimits) -> str:
    """When the reserve's long-context part matters: how much it is and the flags that shrink it (host K/V makes
    the QSA prefill peak flat; a shorter --max-model-len shrinks the scores, about in proportion). `short`: the
    bytes the device lacks."""
    grow = sum(s.reserve_context for s in mine)
    if grow < GIB // 4:
        return ""
    fixes = ["--qsa-kv-offload (QSA K/V in host RAM: the prefill peak stays flat)"] if any(
        s.offload_helps for s in mine) else []
    if short < grow:
        shorter = max(int(limits.max_model_len * (grow - short) / grow) // 1024 * 1024, 1024)
        fixes.append(f"--max-model-len {shorter} or less (about: the term grows with the context)")
    else:
        fixes.append("a smaller --max-model-len")
    return (f"Of the reserve, {grow / GIB:.2f} GiB is the prefill chunk at --max-model-len {limits.max_model_len} "
            f"(its attention scratch grows with the context): use {' or '.join(fixes)}. Otherwise: ")


def _no_room_for_kv(mine: list[StageNeeds], name: str, budget: int, fixed: int, per_block: int, per_seq: int,
                    limits: PlanLimits) -> str:
    left = budget - fixed
    if limits.kv_cache_memory_bytes:
        cap = min(limits.kv_cache_memory_bytes // s.block for s in mine if s.block) - 1
        room = max(cap, 0)
    else:
        room = max(left // per_block - 1, 0)
    longest = room * limits.block_size
    need = (per_seq + 1) * per_block - max(left, 0)
    return (f"{name}: after weights, state and reserve ({fixed / GIB:.2f} GiB) {max(left, 0) / GIB:.2f} GiB are "
            f"left for KV, {room} blocks of {limits.block_size} tokens ({per_block} bytes each on this device); one "
            f"sequence of --max-model-len {limits.max_model_len} needs {per_seq}. "
            + _context_hint(mine, need, limits)
            + f"Use --max-model-len "
            f"{longest} or less, raise --gpu-memory-utilization / --vram-limit"
            + (" / --kv-cache-memory-bytes" if limits.kv_cache_memory_bytes else "")
            + ", " + _chunk_hint(limits) + "or spread the layers over more GPUs (--stages)")
