"""One stage's step logic: collect a step's inputs (plan, activations, sampled tokens, PLE rows), run the slice,
and say what goes where. No sockets here: `stage_worker.main` moves the messages.

Plans arrive by broadcast before the activations, so a stage builds its step metadata while the previous stage is
still computing (002 §3.2 measured that stall at 3 ms a step when preparation waited for the activations).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shared.cluster_config import ClusterConfig
from shared.protocol import (PLANS_IN_FLIGHT, Activations, IpcActivations, Message, Plan, PleReady, Sampled,
                             StepResult, TokenOut)
from stage_worker.model.batch import BlockTable, StepBatch
from stage_worker.model.cache import CacheSpec
from stage_worker.model.model import StageModel
from stage_worker.expert_offload import gates, round_decay
from stage_worker.model.expert_table import counted_tokens
from stage_worker.readback import CounterReadback
from stage_worker.host_copy import to_device, to_host
from stage_worker.ple_decode_rows import DecodeRowGather, PleMailbox
from stage_worker.profiling import phase
from stage_worker.stream_wait import StreamWait
from stage_worker.step_sampling import HostCopy, ReqState, StepSampler

log = logging.getLogger("moepipe.stage")


class StaleState(RuntimeError):
    """A plan refers to per-request state this process never held: it was restarted since the plan was made. Expected
    for the few plans sent in the moment before the engine core sees the new process (it then recomputes every
    running request and ignores what those plans return), so the worker logs one line for it, not a traceback."""


@dataclass
class Outgoing:
    to: str                      # "next", "first", "gateway", "ple"
    message: Message


@dataclass
class _Prepared:
    plan: Plan
    batch: StepBatch | None = None
    complete: bool = False            # token ids known
    host_ids: list[int] | None = None  # the token ids on the host, once known there (a PLE stage's own gather)
    # ... else (launch-ahead) per entry its token on the host, or the (request, position) of one still on the device
    entry_tokens: list | None = None
    # stage 0: the sampled tokens this step took, (request, position) -> ("host", id) or ("device", (tokens, row)),
    # given back if the step is dropped (the scheduler plans its rolled-back requests again from those tokens)
    taken: dict = field(default_factory=dict)


@dataclass
class _Launched:
    """A step whose work is queued on the device; `StageRunner.finish` waits for it and says what goes where."""
    plan: Plan
    batch: StepBatch
    timing: list
    t0: float
    start: float
    arrived: float | None = None            # when the activations arrived (other stages' transfer metric)
    outs: list[TokenOut] | None = None      # last stage: the step's tokens, complete once `copy` is on the host
    copy: HostCopy | None = None
    hidden: torch.Tensor | None = None      # other stages: the activations for the next one
    sent: object | None = None              # ... handed over at launch by CUDA IPC: the event after the slot's write
    copied: object | None = None            # ... else, across stages: the event after their copies to the host
    ple_wait: tuple[int, torch.Tensor] | None = None   # `ple_launch_ahead`: (its number in the mailbox, a host copy
    #                                         of the mailbox's `timed_out` queued behind its graph)
    taken: dict = field(default_factory=dict)          # stage 0: `_Prepared.taken`
    skipped: bool = False                   # every entry's request was cancelled: nothing computed (`_skip`)
    rows_seq: int | None = None             # `ple_launch_ahead`: the mailbox number of the rows its graph waits for
    tail: Callable[[], None] | None = None  # last stage: its sampler, queued once those rows are out (`queue_samplers`)
    tail_error: Exception | None = None     # ... which raised: `finish` fails the step with it
    dropped: bool = False                   # the engine core dropped it (`Plan.dropped`) before its finish


@dataclass
class _PendingRows:
    """A launched step whose graph waits for its PLE rows (`ple_launch_ahead`): its number in the mailbox, its
    sequences' slots, each entry's token (an int, or the (request, position) whose sampled token it is), and the
    event after the contexts' copy its rows are hashed against (the step before it)."""
    seq: int
    slots: list[int]
    tokens: list
    contexts: object | None
    since: float = field(default_factory=time.perf_counter)
    taken: dict = field(default_factory=dict)   # its step's `_Prepared.taken`: a token it consumes is noted there
    dropped: bool = False                       # its step was dropped: its rows still go out, its tokens stay


# Across stages a launched step's tokens come once the steps before it have run on every stage (seconds at most: a
# long prefill chunk); one whose tokens have not come after this long (a lost message) is published with 0 in their
# place and its step fails, so no stream waits forever (`stream_wait.py` has no timeout on the device). Not for one
# stage: its tokens come from its own steps, and its polling kernel times out on its own.
PUBLISH_DEADLINE_S = 60.0


def across_stages(cluster: ClusterConfig, ple_layers: list[int]) -> bool:
    """Whether `ple_launch_ahead_across_stages` can take effect: stage 0 of several holds a PLE layer, gathers its
    own decode rows from the service's ring, and every switch its waiting graphs need is on. Only then may a step
    of another stage wait on the device for stage 0's graph: elsewhere (no PLE layer on stage 0, `ple_service` off,
    the CPU test clusters) the last stage keeps its launch depth and the host path its plain finish."""
    c, first = cluster, cluster.stages[0]
    return (c.ple_launch_ahead_across_stages and c.num_stages > 1 and c.ple_service and bool(c.ple_endpoint)
            and c.ple_decode_in_stage and c.ple_launch_ahead and c.launch_ahead and c.ple_graph and c.cuda_graphs
            and c.stage_spin_wait and c.device_sampling and any(first.start <= i < first.end for i in ple_layers))


class StageRunner:
    def __init__(self, model: StageModel, cluster: ClusterConfig, index: int, ring=None) -> None:
        self.model, self.cluster, self.index = model, cluster, index
        self.is_first, self.is_last = index == 0, index == cluster.num_stages - 1
        p = next(model.parameters())
        self.device = p.device
        # One slot and one block beyond what the gateway hands out: scratch for CUDA-graph padding entries; then
        # the prefix cache's snapshot slots (in host RAM).
        spec = CacheSpec(num_blocks=cluster.num_blocks + 1, block_size=cluster.block_size,
                         num_slots=cluster.max_num_seqs + 1, snapshot_slots=cluster.prefix_states,
                         dtype=p.dtype, device=p.device,
                         kv_offload=cluster.qsa_kv_offload, row_cache_bytes=cluster.row_cache_bytes)
        self.cache = model.new_cache(spec)
        # Prefix cache: snapshot slots this process has saved into. A restore from any other slot names a snapshot
        # this stage never took (it was restarted since): refused, never computed from an empty state.
        self.saved_states: set[int] = set()
        self.plans: dict[int, _Prepared] = {}
        self.acts: dict[int, Activations] = {}
        self._dropped_steps: set[int] = set()   # dropped before their activations came (one entry a failure)
        # Stage 0: the sampled tokens each finished step took, while the core may still drop it (`_on_plan`), and
        # per micro-batch its latest steps not dropped (the core's plans in flight are among the last
        # PLANS_IN_FLIGHT of them)
        self._finished_taken: dict[int, dict] = {}
        self._live_steps: dict[int, list[int]] = {}
        # stage 0 of several: (request, position) -> the step launched last to draw it, until its Sampled comes
        self._drawn_by: dict[tuple[str, int], int] = {}
        self.arrived: dict[int, float] = {}      # wall clock each step's activations arrived (transfer metric)
        self.ple: dict[int, PleReady] = {}
        self.next_tokens: dict[tuple[str, int], int] = {}
        self.requests: dict[str, ReqState] = {}
        # Requests that ended while plans in flight held them (`Plan.cancelled`), until they come in `finished`: a
        # step of theirs alone is skipped, not computed (a cancelled 21k-token prompt's chunks in flight held the
        # pipeline 6.6 s after its client left).
        self.cancelled: set[str] = set()
        self.skipped_steps = 0
        self.tables: dict[str, BlockTable] = {}   # each request's KV block table, grown by its entries' new_blocks
        # the last stage's sampler of a step's logits (step_sampling.py); it holds the penalties' token counts
        self.sampler = StepSampler(cluster, index, self._race_kernel, self._settle_launched) if self.is_last else None
        self.launched: list[_Launched] = []       # steps queued on the device, oldest first
        # `cuda_ipc_activations` (stage_worker/ipc_activations.py): the stage worker sets both; `send_now` sends an
        # Outgoing at once, from `launch`.
        self.handoff = None
        self.send_now = None
        cfg = model.cfg
        self.all_ple_layers = [i - 1 for i in getattr(cfg, "ple_layer_ids", [])]
        self.my_ple_layers = [layer for layer in self.all_ple_layers if model.start <= layer < model.end]
        self.ring = ring if self.my_ple_layers else None
        # Decode rows gathered here rather than by the service (ple_decode_rows.py: the service's round trip was
        # the one-stream gap); prefill chunks still come from the service's ring.
        self.own_decode_rows = DecodeRowGather(model, self.cache, self.my_ple_layers, p.device,
                                               numpy=cluster.ple_gather_numpy) \
            if self.ring is not None and cluster.ple_decode_in_stage else None
        self._max_launched_step = -1
        self.device_next: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}   # (request, position) -> token
        self.device_fed: set[tuple[str, int]] = set()      # of those, the ones a launched step already read
        self._last_end = 0.0
        self.ids_from_device = 0                  # input ids read from a launched step's tokens (launch-ahead)
        self.busy_seconds = 0.0
        self.steps = 0
        self.last_step_seconds = 0.0
        self.ple_wait_seconds = 0.0
        self.ple_decode_wait_seconds = 0.0        # of which decode-only steps (the round trip after each token)
        self._ple_wait_start: dict[int, float] = {}
        # Run-time expert moves (issue 16): every expert_move_interval launched steps, one swap per layer at most.
        self.experts = model.experts
        counts = self.cache.row_cache_counts
        self.row_cache_reads = CounterReadback(counts) if counts is not None else None   # (hits, lookups)
        self.expert_moves = model.experts is not None and cluster.expert_moves
        self._move_gates = gates(model) if self.expert_moves else []
        self._move_decay = 0.5 ** (cluster.expert_move_interval / cluster.expert_move_half_life)
        # `expert_move_half_life_unit` "tokens": the round decays by the decode tokens counted since the last one
        # (`move_decay`); "steps": by the interval (`_move_decay`)
        self._move_tokens = 0
        self._move_top_k = next(iter(model.moe_layers().values())).top_k if self.expert_moves else 0
        self.launches = 0
        self.graphs = None
        kernels = getattr(model, "kernel_flags", None)
        # Capture needs a step with no host synchronisation: the MoE and attention kernels must be on.
        graphed = cluster.cuda_graphs and p.device.type == "cuda" and kernels is not None and kernels.attention \
            and kernels.moe
        # `ple_launch_ahead`: one stage holding PLE layers that gathers its decode rows itself queues a decode step
        # before the token it needs reaches the host; the graph waits on the device for the rows
        # (`stage_worker/kernels/host_wait.py`, `PleMailbox`), which `_publish_rows` writes once the token is in.
        # `ple_launch_ahead_across_stages`: the same on a first stage that does not sample, whose graphs then also
        # wait for their input ids (the last stage's Sampled brings the tokens to this host; the core's plan-ahead
        # brings the plan before them). It needs the spin wait: a stage blocked in `finish` on a graph that waits
        # for a message would never read that message. And device sampling: the last stage's per-row sampler waits
        # on the host for the step's logits, in the launch of a step whose activations wait (CUDA IPC) for this
        # graph, before the `finish` of the step before sends the Sampled this graph waits for.
        self.ple_mailbox: PleMailbox | None = None
        waits_across = across_stages(cluster, self.all_ple_layers)     # stage 0's graphs may wait across stages
        across = not self.is_last and waits_across
        if cluster.ple_launch_ahead and graphed and self.own_decode_rows is not None and self.is_first and \
                (self.is_last and cluster.device_sampling or across) and cluster.launch_ahead and cluster.ple_graph:
            self.ple_mailbox = PleMailbox.create(self.own_decode_rows, cluster.max_num_seqs, p.dtype, p.device,
                                                 with_ids=not self.is_last)
            log.info("stage %d: decode steps launched ahead, their graphs waiting on the device for the PLE rows%s "
                     "(ple_launch_ahead)", index, "" if self.is_last else " and input ids (across stages)")
        # across stages the wait ends only after the last stage's step: a stream wait, not a polling kernel that
        # would hold a GPU time-sliced with that stage's process (stream_wait.py)
        self._stream_wait = StreamWait.open(self.ple_mailbox.flag, p.device) \
            if self.ple_mailbox is not None and not self.is_last else None
        self._forced_rows: set[int] = set()     # mailbox steps published past PUBLISH_DEADLINE_S (they fail)
        # ... and behind a step of any stage but the last, a step may wait on the device for stage 0's such graph
        # (through the CUDA IPC hand-off's events): a step handed on by the host path is finished on its own event
        self._host_path_events = not self.is_last and waits_across
        self.ple_rows_after_launch = 0          # mailbox steps whose graph was queued before their rows existed
        self.ple_wait_timeouts = 0              # ... and whose graph gave up waiting (their requests failed)
        self._pending_rows: list[_PendingRows] = []             # launched steps whose rows are not yet written
        self._host_tokens: dict[tuple[str, int], int] = {}      # (request, position) -> sampled token, for those
        self._contexts_copied: torch.cuda.Event | None = None   # the contexts' copy behind the last launched step
        # Launch-ahead: two steps queued at once; with one stage (first and last) and device sampling, a decode
        # step's input ids are read from the previous step's sampled tokens on the device, so it is queued before
        # that step's tokens reach the host and the GPU never waits for the host's bookkeeping between steps.
        # Not on a stage whose PLE rows come from the service (unless the mailbox above takes them): they need the
        # token on the host first, so the next step cannot be queued early, and waiting for the launched step by
        # polling only delayed the token (full shape on the H200: 517 vs 598 tok/s at 4 streams,
        # bench/results/served-speed-9). Off: each step is completed before the next is queued.
        ahead = cluster.launch_ahead and (self.ring is None or self.ple_mailbox is not None)
        # Across stages, the last stage's step t+1 waits on the device (CUDA IPC) for stage 0's graph, which waits
        # for the Sampled of step t that only this stage's `finish(t)` sends: launched before that finish, any host
        # wait for the device in its launch (a kernel's first load, an allocator sync) waits on that cycle until
        # PUBLISH_DEADLINE_S (h200-27: a 4-stream run's step 256 failed after 60 s). Its GPU work cannot start
        # before that Sampled anyway, so the last stage finishes each step before launching the next: no cycle, and
        # the Sampled goes out without waiting behind a launch.
        if self.is_last and not self.is_first and waits_across:
            ahead = False
        self.launch_depth = 2 if ahead else 1
        self.feed_from_device = self.is_first and self.is_last and ahead and cluster.device_sampling
        if graphed:
            from stage_worker.cuda_graphs import DecodeGraphs, graph_sizes

            max_len = cluster.model_len(model.cfg)
            self.graphs = DecodeGraphs(model, self.cache, max_blocks_per_seq=-(-max_len // cluster.block_size),
                                       scratch_slot=cluster.max_num_seqs, scratch_block=cluster.num_blocks,
                                       sizes=graph_sizes(cluster.max_num_seqs),
                                       ple_graph=cluster.ple_graph, skip_padding=cluster.graph_skip_padding,
                                       mailbox=self.ple_mailbox)

    # ---- inputs ------------------------------------------------------------------------------------------------

    def move_decay(self) -> float:
        """The move round's decay: 0.5 ** (interval / half-life) with `expert_move_half_life_unit` "steps", else 0.5
        ** (decode tokens the router counted since the last round / half-life), those tokens then restarting."""
        c = self.cluster
        if c.expert_move_half_life_unit != "tokens":
            return self._move_decay
        tokens, self._move_tokens = self._move_tokens, 0
        return round_decay(c.expert_move_half_life_unit, c.expert_move_half_life, c.expert_move_interval, tokens)

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, Plan):
            self._on_plan(msg)
        elif isinstance(msg, (Activations, IpcActivations)):
            if msg.step in self._dropped_steps:    # handed on before the drop reached this stage: never runs here
                self._dropped_steps.discard(msg.step)
                if isinstance(msg, IpcActivations) and self.handoff is not None:
                    self.handoff.drop(msg)         # its ring slot is free again (held for good otherwise)
                return
            self.acts[msg.step] = msg
            self.arrived[msg.step] = time.time()
        elif isinstance(msg, Sampled):
            # A step the core dropped, which the last stage ran before the drop reached it, draws positions the
            # replan draws again. Its Sampled travels on its own socket and may come after the replan's step that
            # draws them was launched here (`_forget_redrawn` then had nothing to forget): kept, the replan's next
            # step was fed that draw while the client got the replan's (tests/test_qa_dropped_step_two_stages.py).
            # A token is taken only from the step launched last to draw its (request, position); a stale one goes
            # to dropped graphs still waiting for their rows alone (their output is thrown away, but they must not
            # wait for tokens that never come).
            fresh, stale = [], []
            for t in msg.tokens:
                key = (t.req_id, t.position)
                if self._drawn_by.get(key, msg.step) > msg.step:
                    stale.append(t)
                    continue
                self._drawn_by.pop(key, None)
                fresh.append(t)
                if t.token >= 0 and t.req_id in self.tables:    # (a request finished meanwhile needs none: a
                    self.next_tokens[key] = t.token             # failed step's later one, say)
            self._rows_from(fresh)             # a launched graph may wait for some of these (across stages)
            if stale:
                self._rows_from(stale, dropped_only=True)
        elif isinstance(msg, PleReady) and msg.num_tokens > 0:
            if msg.step in self.plans or msg.step > self._max_launched_step:
                self.ple[msg.step] = msg       # else: a step that ran on rows this stage gathered itself

    def _on_plan(self, plan: Plan) -> None:
        for launched in self.launched:
            if launched.plan.step in plan.dropped:
                launched.dropped = True         # its draws feed nothing (`finish`, `_sample_launched`)
                self._give_back(launched.taken)
                for pending in self._pending_rows:      # its graph still waits: rows yes, tokens for the replan
                    if pending.seq == launched.rows_seq:
                        pending.dropped = True
        if self.is_first:
            # A dropped step that finished before its drop came keeps the tokens it took from an earlier step's
            # draw, which the replan of a request only in the dropped steps reads again (a grammar request, never
            # planned ahead, decoding a kept step's token in the step after the failed one): without them back
            # its replan was never ready and the request waited for good (tests/test_qa_dropped_step_two_stages.py).
            for step in plan.dropped:
                self._give_back(self._finished_taken.pop(step, {}))
            for steps in self._live_steps.values():
                steps[:] = [x for x in steps if x not in plan.dropped]
            if plan.entries:
                steps = self._live_steps.setdefault(plan.microbatch, [])
                steps.append(plan.step)
                del steps[:-PLANS_IN_FLIGHT]    # (the core's plans in flight: older ones cannot be dropped now)
                live = {x for steps in self._live_steps.values() for x in steps}
                for step in [x for x in self._finished_taken if x not in live]:
                    del self._finished_taken[step]
        for step in plan.dropped:
            if not self.is_first and step not in self.acts and step > self._max_launched_step:
                self._dropped_steps.add(step)    # its activations may still be on their way
            dropped = self.plans.pop(step, None)
            if dropped is not None:
                self._give_back(dropped.taken)
            act = self.acts.pop(step, None)
            if isinstance(act, IpcActivations) and self.handoff is not None:
                self.handoff.drop(act)               # its ring slot is free again
            self.arrived.pop(step, None)
            self.ple.pop(step, None)
        self.cancelled.update(plan.cancelled)      # (before `finished`: a plan may carry an id in both)
        for rid in plan.finished:
            self.cancelled.discard(rid)            # no plan of it is left on any stage
            self.requests.pop(rid, None)
            self.tables.pop(rid, None)
            for key in [k for k in self.next_tokens if k[0] == rid]:
                del self.next_tokens[key]
            for key in [k for k in self.device_next if k[0] == rid]:
                del self.device_next[key]
            for key in [k for k in self._drawn_by if k[0] == rid]:
                del self._drawn_by[key]
        if self.is_last:
            for spec in plan.new_requests:
                self.requests[spec.req_id] = ReqState.of(spec)
        if plan.entries:
            # Everything but the ids of decode tokens is known now: positions, KV rows, slots, logits rows. The ids
            # (from the previous stage's activations, or on stage 0 the last stage's Sampled) are filled in later.
            prepared = _Prepared(plan)
            prepared.batch = self._build_batch(plan, [e.tokens if e.tokens is not None else [0] * e.num_tokens
                                                      for e in plan.entries])
            prepared.complete = all(e.tokens is not None for e in plan.entries)
            self.plans[plan.step] = prepared

    def _build_batch(self, plan: Plan, tokens: list[list[int]]) -> StepBatch:
        seqs = [(toks, e.context_len, e.slot, self._table(e)) for e, toks in zip(plan.entries, tokens)]
        batch = StepBatch.build(seqs, self.cluster.block_size, self.device)
        batch.batched_prefill = self.cluster.batched_prefill
        batch.sparse_prefill = self.cluster.qsa_sparse_prefill
        if self.is_last:
            idx, start = [], 0
            for e in plan.entries:
                if e.prompt_logprobs:
                    idx.extend(range(start, start + e.num_tokens))
                elif e.sample:
                    idx.append(start + e.num_tokens - 1)
                start += e.num_tokens
            batch.select_logits(idx)
        return batch

    def _table(self, e) -> BlockTable:
        """The entry's whole block table: what earlier entries sent, plus its new blocks (plans arrive in order)."""
        if e.context_len == 0 or e.restore is not None:
            self.tables[e.req_id] = BlockTable(e.new_blocks)
        elif e.req_id in self.tables:
            self.tables[e.req_id].extend(e.new_blocks)
        else:
            raise StaleState(f"request {e.req_id} continues at {e.context_len} but this stage has no block table "
                             f"for it (was the stage restarted?)")
        return self.tables[e.req_id]

    # ---- readiness ---------------------------------------------------------------------------------------------
    def ready(self) -> Plan | None:
        """The oldest prepared step whose inputs are all here (steps run in plan order)."""
        if not self.plans:
            return None
        if self._pending_rows and self.ple_mailbox.ids is not None:
            # Across stages a launched graph waits on the device for ids only this thread publishes: nothing is
            # launched behind it until then, since a launch may wait for the device on the host (an eager step's
            # host reads, as float8 experts' prefill; the first expert-move round's capture), which would never
            # return. (One micro-batch loses nothing: plan t+2 goes out once step t's result is in, after the
            # Sampled that published step t+1.)
            return None
        step = min(self.plans)
        prepared = self.plans[step]
        if not self.is_first and step not in self.acts:
            return None
        if self._skips(prepared.plan):
            return prepared.plan                # needs neither its tokens nor its PLE rows: `launch` skips it
        if not prepared.complete:
            if self.is_first:
                keys = [(e.req_id, e.context_len) for e in prepared.plan.entries if e.tokens is None]
                if any(k not in self.next_tokens and k not in self.device_next for k in keys):
                    if not self._ids_in_mailbox(prepared):
                        return None
                    prepared.entry_tokens = [e.tokens[-1] if e.tokens is not None else
                                             self._take_host((e.req_id, e.context_len), prepared.taken)
                                             for e in prepared.plan.entries]
                else:
                    prepared.batch.token_ids, prepared.host_ids, prepared.entry_tokens = \
                        self._input_ids(prepared.plan, prepared.taken)
            elif isinstance(self.acts[step], IpcActivations):
                prepared.host_ids = self.acts[step].token_ids     # the device ids come out of the slot at launch
            else:
                host = self.acts[step].token_ids
                prepared.batch.token_ids = host.to(self.device)
                prepared.host_ids = host.tolist()
            prepared.complete = True
        if self.ring is not None and step not in self.ple and not self._gathers_own_rows(prepared) \
                and not self._rows_in_graph(prepared):
            # Everything else is here: from now on the stage is waiting for the PLE service.
            self._ple_wait_start.setdefault(step, time.perf_counter())
            return None
        return prepared.plan

    def _rows_in_graph(self, prepared: _Prepared) -> bool:
        """`ple_launch_ahead`: a decode step that replays a graph; its rows reach the graph through the mailbox."""
        if self.ple_mailbox is None or not prepared.batch.is_decode:
            return False
        if not self.graphs.graphs:
            self.graphs.capture()             # (a stage worker captures at start; here for one driven by hand)
        return self.graphs.fits(prepared.batch)

    def _ids_in_mailbox(self, prepared: _Prepared) -> bool:
        """`ple_launch_ahead_across_stages`: a decode step of a first stage that does not sample may be launched
        before its tokens arrive (its graph copies them from the mailbox with its rows)."""
        return self.ple_mailbox is not None and self.ple_mailbox.ids is not None and self._rows_in_graph(prepared)

    def _gathers_own_rows(self, prepared: _Prepared) -> bool:
        """A decode step on a PLE stage whose token ids the host has: it gathers its rows itself
        (`stage_worker/ple_decode_rows.py`), unless `ple_decode_in_stage_max_seqs` caps the sequences (larger steps
        then wait for the service's rows: a round trip after every sampled token)."""
        cap = self.cluster.ple_decode_in_stage_max_seqs          # 0: every decode step
        # (with the mailbox, an eager step's gather would read the contexts behind a waiting graph: the service's)
        return (self.own_decode_rows is not None and self.ple_mailbox is None and prepared.host_ids is not None
                and prepared.batch.is_decode and (cap == 0 or len(prepared.host_ids) <= cap))

    def _take_host(self, key: tuple[str, int], taken: dict):
        """The sampled token for `key` out of `next_tokens` (noted in `taken`), or the key if it has not come."""
        if key not in self.next_tokens:
            return key
        token = self.next_tokens.pop(key)
        taken[key] = ("host", token)
        return token

    def _give_back(self, taken: dict) -> None:
        """A dropped step's sampled tokens back where it took them from, for the step that replans its requests
        (without them that step waited forever for tokens already consumed; a finished request's are removed with
        it, as `_on_plan` handles `finished` after `dropped`)."""
        for key, (where, value) in taken.items():
            if where == "host":
                self.next_tokens[key] = value
            else:
                self.device_next[key] = value
                self.device_fed.discard(key)
        taken.clear()

    def _input_ids(self, plan: Plan, taken: dict) -> tuple[torch.Tensor, list[int] | None, list]:
        """Stage 0's input ids: prompt tokens and sampled tokens the host has, and (launch-ahead) sampled tokens
        still on the device, gathered there from the step that sampled them. Also the ids as a host list, unless
        some are only on the device, and each entry's last token: on the host, or the (request, position) key of
        one on the device. The sampled tokens taken go into `taken`."""
        ids: list[int] = []
        last: list = []
        from_device: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for e in plan.entries:
            if e.tokens is not None:
                ids.extend(e.tokens)
                last.append(e.tokens[-1] if e.tokens else 0)
                continue
            key = (e.req_id, e.context_len)
            if key in self.next_tokens:
                ids.append(self._take_host(key, taken))
                last.append(ids[-1])
                continue
            last.append(key)
            tokens, row = self.device_next.pop(key)
            taken[key] = ("device", (tokens, row))
            self.device_fed.add(key)
            self.ids_from_device += 1
            _, dst, src = from_device.setdefault(id(tokens), (tokens, [], []))
            dst.append(len(ids))
            src.append(row)
            ids.append(0)
        out = to_device(ids, torch.long, self.device)
        for tokens, dst, src in from_device.values():
            out[to_device(dst, torch.long, self.device)] = tokens[to_device(src, torch.long, self.device)]
        return out, (None if from_device else ids), last

    def _skips(self, plan: Plan) -> bool:
        """Whether the step computes nothing anyone reads: every entry's request was cancelled, or the previous
        stage skipped it (so there are no activations to run, whether or not the cancellation has come here)."""
        act = self.acts.get(plan.step)
        if isinstance(act, Activations) and act.skipped:
            return True
        return bool(plan.entries) and all(e.req_id in self.cancelled for e in plan.entries)

    def _skip(self, plan: Plan, prepared: _Prepared) -> None:
        """Queue a skipped step: its inputs are let go (an IPC slot freed, PLE rows no longer waited for) and
        `finish` sends what the next components wait for, without computing it."""
        act = self.acts.pop(plan.step, None)
        if isinstance(act, IpcActivations) and self.handoff is not None:
            self.handoff.drop(act)             # its ring slot is free again
        arrived = self.arrived.pop(plan.step, None)
        self.ple.pop(plan.step, None)
        self._ple_wait_start.pop(plan.step, None)
        self._max_launched_step = max(self._max_launched_step, plan.step)   # its rows, if they come, are dropped
        self.skipped_steps += 1
        self.launched.append(_Launched(plan, prepared.batch, list(act.timing) if act is not None else [], time.time(),
                                       time.perf_counter(), arrived, skipped=True))

    def _finish_skipped(self, launched: _Launched) -> list[Outgoing]:
        """A skipped step's messages: empty activations marked skipped to the next stage; on the last stage token 0
        for each sampling entry to stage 0 and the PLE service (a step planned ahead of it waits for that token, as
        for a failed row) and a result without tokens or timing to the gateway (their requests ended: it drops
        them; the stage step and transfer metrics count computed steps only)."""
        plan = launched.plan
        if not self.is_last:
            return [Outgoing("next", Activations(step=plan.step, hidden=torch.empty(0),
                                                 token_ids=torch.empty(0, dtype=torch.long), timing=launched.timing,
                                                 skipped=True))]
        tokens = [TokenOut(e.req_id, e.context_len + e.num_tokens, 0) for e in plan.entries if e.sample]
        self._rows_from(tokens, dropped_only=launched.dropped)
        out: list[Outgoing] = []
        if self.is_first and not launched.dropped:      # (dropped: see `finish`)
            for t in tokens:
                key = (t.req_id, t.position)
                self.device_next.pop(key, None)
                self.device_fed.discard(key)
                if t.req_id in self.requests:
                    self.next_tokens[key] = t.token
        elif not self.is_first:                         # (stage 0 itself: see `finish`)
            out.append(Outgoing("first", Sampled(step=plan.step, microbatch=plan.microbatch, tokens=tokens)))
        out.append(Outgoing("ple", Sampled(step=plan.step, microbatch=plan.microbatch, tokens=tokens)))
        out.append(Outgoing("gateway", StepResult(step=plan.step, microbatch=plan.microbatch, tokens=[])))
        return out

    # ---- the step ----------------------------------------------------------------------------------------------
    def can_launch(self) -> bool:
        """Below the launch depth, and no launched step's sampler still waiting for its rows (`queue_samplers`): a
        step queued before it would run ahead of it on the stream (a replay of the same graph rewrites the logits
        it reads)."""
        return len(self.launched) < self.launch_depth and not self.sampler_waits()

    def sampler_waits(self) -> bool:
        """A launched step's sampler is not queued yet: it waits for the step's PLE rows (`queue_samplers`)."""
        return any(x.tail is not None for x in self.launched)

    @property
    def computes_in_launch(self) -> bool:
        """A CPU stage's step is computed inside `launch`: launching the next one at once gains nothing, and would
        compute it before the inbox is read again (a cancellation that came meanwhile, the next stage's wait).
        With `skip_cancelled_steps` off, a CPU stage launches up to the launch depth as a GPU stage does."""
        return self.device.type != "cuda" and self.cluster.skip_cancelled_steps

    def launch_ready(self, failed, limit: int | None = None) -> int:
        """Launch every step whose inputs are here, oldest first, up to the launch depth (and `limit`); returns how
        many were launched. A step that raises is dropped and handed to `failed(step, exc)` (the caller reports
        it): the worker keeps serving."""
        if self._pending_rows:                # whatever became publishable since (a contexts copy that completed)
            waiting = self._pending_rows[0].seq
            try:
                self._publish_rows()
            except Exception as exc:          # the step whose rows failed: its requests fail, the worker goes on
                failed(next((x.plan.step for x in self.launched
                             if x.rows_seq == waiting), -1), exc)
        self.queue_samplers()
        launched = 0
        while self.can_launch() and (limit is None or launched < limit):
            plan = None
            try:
                plan = self.ready()
                if plan is None:
                    break
                self.launch(plan)
                launched += 1
            except Exception as exc:
                step = plan.step if plan is not None else min(self.plans, default=-1)
                dropped = self.plans.pop(step, None)
                if dropped is not None:       # (`ready` or a caller's wrapper raised before `launch` took it)
                    self._abandon(dropped)
                failed(step, exc)
        return launched

    def oldest_done(self) -> bool:
        """The oldest launched step's results are on the host (`finish` will not wait). On the CPU always."""
        if self.launched and self.launched[0].tail is not None:
            return False                      # its sampler waits for its rows (`launch_ready` publishes them)
        if self.launched and self.launched[0].sent is not None:
            return self.launched[0].sent.query()
        if self.launched and self.launched[0].copied is not None:
            return self.launched[0].copied.query()
        copy = self.launched[0].copy if self.launched else None
        return copy is None or copy.event is None or copy.event.query()

    def run(self, plan: Plan) -> list[Outgoing]:
        """Launch `plan` and wait for it (callers that do not overlap steps)."""
        self.launch(plan)
        return self.finish()

    @torch.inference_mode()
    def launch(self, plan: Plan) -> None:
        """Queue the step's work on the device (inputs, forward or graph replay, sampling, copies of the results to
        the host); `finish` completes it. Nothing here waits for the GPU, except the per-row sampler and echo."""
        prepared = self.plans.pop(plan.step)
        try:
            self._launch(plan, prepared)
        except BaseException:
            self._abandon(prepared)
            raise

    def _abandon(self, prepared: _Prepared) -> None:
        """A step whose launch raised (`launch_ready` reports it): the sampled tokens its preparation took go back,
        and rows it expected still go out (in mailbox order: later steps' graphs wait for higher numbers) without
        taking any more. The core fails the step's own requests, but the step may also be a later step of an
        earlier failure's drop (a second step failing in the same `launch_ready`, before that drop comes: its own
        StageError is then ignored), whose requests are planned again alive from the tokens it took: kept nowhere,
        that replan was never ready and the request waited for good (tests/test_qa_launch_failures.py). For a step
        the core fails they sit in `next_tokens` / `device_next` until its `finished` removes them."""
        for pending in self._pending_rows:
            if pending.taken is prepared.taken:
                pending.dropped = True        # (`_rows_from` takes no token for it: as for a dropped step's graph)
        self._give_back(prepared.taken)

    def _launch(self, plan: Plan, prepared: _Prepared) -> None:
        if self.is_first:
            self._forget_redrawn(plan)
        if self._skips(plan):
            self._skip(plan, prepared)
            return
        batch = prepared.batch
        for e in plan.entries:
            if e.restore is not None and e.restore not in self.saved_states:
                raise StaleState(f"request {e.req_id} restores prefix-cache state {e.restore}, which this stage "
                                 f"never saved (was the stage restarted?)")
        for e in plan.entries:
            if e.restore is not None:         # prefix cache: the request starts from a saved state
                self.cache.copy_state(e.restore, e.slot)
        for slot, snapshot in plan.snapshots:  # ... and saves the state its entry starts from
            self.cache.copy_state(slot, snapshot)
            self.saved_states.add(snapshot)
        act = self.acts.pop(plan.step, None)
        arrived = self.arrived.pop(plan.step, None)
        with phase("stage.inputs"):
            if isinstance(act, IpcActivations):
                hidden, batch.token_ids = self.handoff.take(act)
            else:
                hidden = act.hidden.to(self.device) if act is not None else None
            timing = list(act.timing) if act is not None else []
            wait_seq = None
            in_graph = self.ring is not None and self._rows_in_graph(prepared)
            if in_graph or (self.ring is not None and self._gathers_own_rows(prepared)):
                self.ple.pop(plan.step, None)  # the service's rows for this step, if they came first: not needed
                if in_graph:
                    wait_seq = self._expect_rows(plan, prepared)
                else:
                    batch.ple_rows.update(self.own_decode_rows(batch.slots, prepared.host_ids))
            elif self.ring is not None:
                ready = self.ple.pop(plan.step)
                now = time.perf_counter()
                waited = now - self._ple_wait_start.pop(plan.step, now)
                self.ple_wait_seconds += waited
                if batch.is_decode:
                    self.ple_decode_wait_seconds += waited
                # Copy out of the ring at once: this stage's own layers only. The service rewrites the slot once the
                # last stage has run this step (its Sampled), which in-order stages reach only after this copy.
                # (A queued copy: the ring is page-locked, and the slot is rewritten only after this step's Sampled.)
                rows = self.ring.slot(ready.ring_slot)[: ready.num_tokens].to(self.device, copy=True,
                                                                               non_blocking=True)
                for li, layer in enumerate(self.all_ple_layers):
                    if layer in self.my_ple_layers:
                        batch.ple_rows[layer] = rows[:, li]
        self._max_launched_step = max(self._max_launched_step, plan.step)
        self.launches += 1
        if self.expert_moves:
            self._move_tokens += counted_tokens(batch.token_ids.shape[0], self._move_top_k)
        if self.expert_moves and self.launches % self.cluster.expert_move_interval == 0:
            with phase("stage.expert_moves"):
                self.experts.move_round(self._move_gates, self.move_decay(), self.cluster.expert_move_margin,
                                        fused=self.cluster.expert_move_fused,
                                        graph=self.cluster.expert_move_graph and self.graphs is not None)
        if self.experts is not None and self.launches % 16 == 0:
            self.experts.snapshot()           # counters for /metrics, read back without waiting
        if self.row_cache_reads is not None and self.launches % 16 == 0:
            self.row_cache_reads.snapshot()
        launched = _Launched(plan, batch, timing, time.time(), time.perf_counter(), arrived, taken=prepared.taken,
                             rows_seq=wait_seq)
        graphed = self.graphs is not None and self._graph_ready(batch)
        if graphed:
            with phase("stage.graph_replay"):
                if wait_seq is not None and self._stream_wait is not None:
                    self._stream_wait.wait(wait_seq)
                result = self.graphs.run(batch, hidden, wait_seq)
            if wait_seq is not None:          # read back with the step's tokens (their event comes later)
                launched.ple_wait = (wait_seq, to_host(self.ple_mailbox.timed_out))
            self._copy_contexts()
            if self.is_last:                  # (the graph's output buffer: no replay comes before the tail runs)
                launched.tail = functools.partial(self._sample_launched, launched, result, self._states(plan))
            else:
                launched.hidden = result.clone()      # the graph's output buffer: the next replay overwrites it
        else:
            with phase("stage.forward"):
                hidden = self.model(batch, self.cache, hidden)
                self._copy_contexts()
                logits = self.model.logits(hidden, batch) if self.is_last else None
            if self.is_last:
                launched.tail = functools.partial(self._sample_launched, launched, logits, self._states(plan))
            else:
                launched.hidden = hidden
        self._publish_rows()
        if self.handoff is not None and not self.is_last:
            self._hand_off(launched, prepared.host_ids)
        if self._host_path_events and launched.sent is None:
            self._copy_out(launched)
        self.launched.append(launched)
        self.queue_samplers()

    def _forget_redrawn(self, plan: Plan) -> None:
        """Stage 0, launching `plan`: the tokens it will draw are not known to anyone yet, so a token already held
        for one of those (request, position) keys was drawn by a step the engine core dropped since (`drop_from`
        replans the requests of the later dropped steps from before them, so the same positions are drawn again;
        `requeue_running` as well). Such a step finished before its drop reached this stage, or its sampler ran
        before it, or a dropped step that read it gave it back (`_give_back`). Forgotten here: the step after this
        one, launched before this one's finish, would read the old token on the host first (`_input_ids`), feeding
        the model a token the client never got (unseeded draws differ). No step reads these keys before this one is
        launched: steps are prepared in plan order."""
        for e in plan.entries:
            if e.sample:
                key = (e.req_id, e.context_len + e.num_tokens)
                self.next_tokens.pop(key, None)
                self.device_next.pop(key, None)
                self.device_fed.discard(key)
                if not self.is_last:
                    self._drawn_by[key] = plan.step     # an earlier step's Sampled for it is stale (`on_message`)

    def _states(self, plan: Plan) -> dict[str, ReqState | None]:
        """The sampling state of each of the step's requests as its launch sees it, for its tail. The tail may run
        after later messages (`ple_sample_after_rows`): a plan that drops the step and ends its requests
        (`finished`: the tail failed "no sampling parameters", a second StageError for a step the core had already
        forgotten), or that plans them again (`new_requests` after `requeue_running`: the dropped step's token went
        into the fresh state's history and penalty counts). Sampled with these, as when the sampler ran in `launch`."""
        return {e.req_id: self.requests.get(e.req_id) for e in plan.entries}

    def _sample_launched(self, launched: _Launched, logits: torch.Tensor,
                         states: dict[str, ReqState | None]) -> None:
        """The last stage's tail of a launched step: its sampler queued behind the forward, and (one stage) its tokens
        noted as the next step's device feed. `states`: its requests' sampling state at its launch (`_states`)."""
        launched.outs, launched.copy = self.sampler.sample(launched.plan, launched.batch, logits, states)
        if self.feed_from_device and launched.copy is not None and not launched.dropped:
            for row, (i, _) in enumerate(launched.copy.rows):
                out = launched.outs[i]
                self.device_next[(out.req_id, out.position)] = (launched.copy.device, row)

    def _rows_out(self, launched: _Launched) -> bool:
        """Whether the rows the step's graph waits for are published (or it waits for none), or its graph has given
        up on them: past `host_wait.WAIT_TIMEOUT_S` nothing spins behind its sampler any more (or only until the
        kernel's own bound), and without it a step whose rows never come (a lost token) was never finished: the
        loop spun on `oldest_done` until the stall check restarted the stage, where the timeout is meant to fail
        that step's requests alone (`_fail_if_rows_missed`)."""
        if launched.rows_seq is None:
            return True
        pending = next((p for p in self._pending_rows if p.seq == launched.rows_seq), None)
        if pending is None:
            return True
        from stage_worker.kernels.host_wait import WAIT_TIMEOUT_S

        # (`since` is when the rows were expected, before the graph was queued; the kernel's clock starts once it
        # runs, after the step before: a second's margin covers that step)
        return time.perf_counter() - pending.since > WAIT_TIMEOUT_S + 1.0

    @torch.inference_mode()   # (called by the worker loop and `launch_ready`, outside it: a tail sampled there
    #                           updated the penalties' counts, inference tensors made in a launch, in place, which
    #                           raised, and every deferred step fell back to the row-by-row sampler)
    def queue_samplers(self) -> None:
        """Queue the samplers of launched steps, oldest first, each once its graph has its PLE rows
        (`ple_sample_after_rows`). Why wait: while a graph spins in `host_wait` for rows only this thread publishes,
        a CUDA call that waits for the device (the first load of a kernel's module: a sampler path, a batch size or
        a logprobs request met for the first time) waits for the spinning kernel, which waits for the host, until
        its timeout fails the step (h100-33, tools/host_wait_probe.py: a never-used op, a new stream and a Triton
        kernel's load each blocked for the whole spin; h100-32: four streams stopped for 113 s at a batch's first
        shrink to one row). The device loses nothing: the graph's own work follows the rows, and the sampler is
        queued while it runs. The worker loop calls this once a `finish` has sent its messages (that finish's tokens
        published the rows), so the tokens do not wait for the sampler's queueing (h100-33 call 5 ran it inside
        `finish`: 1.8 ms from a step's end to the engine core against 0.7). A tail that raises fails its step in
        `finish`."""
        after_rows = self.cluster.ple_sample_after_rows
        for launched in self.launched:
            if launched.tail is None:
                continue
            if after_rows and not self._rows_out(launched):
                return                        # later tails wait too: tokens are sampled in step order
            tail, launched.tail = launched.tail, None
            try:
                tail()
            except Exception as exc:          # (raised here from another step's finish: its own finish fails it)
                launched.tail_error = exc

    # ---- PLE rows for a launched-ahead graph (`ple_launch_ahead`) ----------------------------------------------
    def _expect_rows(self, plan: Plan, prepared: _Prepared) -> int:
        """Number this step in the mailbox and note what its rows need: each entry's token (known now, or the
        sampled token a launched step will bring) and the contexts as the step before leaves them."""
        box = self.ple_mailbox
        box.seq += 1
        # a decode step: one token an entry
        if prepared.host_ids is not None:
            tokens = list(prepared.host_ids)
        elif prepared.entry_tokens is not None:
            # (across stages: a token whose Sampled came after `ready` took the step is in `next_tokens`, where
            # `on_message` left it, the step not yet waiting: taken here, or the step would wait out
            # PUBLISH_DEADLINE_S and fail)
            tokens = [self._take_host(t, prepared.taken) if isinstance(t, tuple) else t
                      for t in prepared.entry_tokens]
        else:                                  # every token came with the plan
            tokens = [e.tokens[-1] for e in plan.entries]
        self._pending_rows.append(_PendingRows(box.seq, list(prepared.batch.slots), tokens, self._contexts_copied,
                                               taken=prepared.taken))
        self._publish_rows()                  # known already (the step before is done): the graph need not wait
        if self._pending_rows and self._pending_rows[-1].seq == box.seq:
            self.ple_rows_after_launch += 1
        return box.seq

    def _copy_contexts(self) -> None:
        """Behind every launched step of a mailbox stage: the n-gram contexts it leaves, into pinned memory, for
        the next step's hash (the live ones sit behind graphs that may be waiting for exactly those rows)."""
        if self.ple_mailbox is None:
            return
        self.ple_mailbox.contexts.copy_(self.own_decode_rows.contexts, non_blocking=True)
        self._contexts_copied = torch.cuda.Event()
        self._contexts_copied.record()

    def _rows_from(self, tokens: list[TokenOut], dropped_only: bool = False) -> None:
        """Sampled tokens on the host (this stage's own, or the last stage's `Sampled`): those a launched step
        waits for go to `_host_tokens` (out of `next_tokens`: that step took them; a failed row as 0, so a step
        behind it is not held up), then every step whose rows are now known is published. `dropped_only`: the
        tokens of a dropped step, for dropped steps' graphs alone (`on_message`)."""
        if not self._pending_rows:
            return
        needed = {k: p for p in self._pending_rows if p.dropped or not dropped_only
                  for k in p.tokens if isinstance(k, tuple)}
        for t in tokens:
            key = (t.req_id, t.position)
            if key in needed:
                self._host_tokens[key] = max(t.token, 0)
                if not needed[key].dropped:
                    self.next_tokens.pop(key, None)
                    # noted as taken by that step: dropped, it gives the token back for the step replanning it
                    needed[key].taken[key] = ("host", self._host_tokens[key])
        self._publish_rows()

    def _publish_rows(self) -> None:
        """Write the rows of every waiting step, oldest first, whose tokens are on the host and whose contexts'
        copy is done (each one's copy sits behind the step before, which its own rows do not wait for)."""
        alive = self.requests if self.is_last else self.tables    # (only the last stage keeps `requests`)
        while self._pending_rows:
            pending = self._pending_rows[0]
            late = self.ple_mailbox.ids is not None and time.perf_counter() - pending.since > PUBLISH_DEADLINE_S
            tokens = []
            for t in pending.tokens:
                if isinstance(t, tuple):
                    t = self._host_tokens.get(t, 0 if t[0] not in alive else None)  # finished: any row
                    if t is None:
                        if not late:
                            return
                        t = 0
                        self._forced_rows.add(pending.seq)
                tokens.append(t)
            if pending.contexts is not None and not pending.contexts.query():
                return
            self._pending_rows.pop(0)
            for t in pending.tokens:
                if isinstance(t, tuple):
                    self._host_tokens.pop(t, None)
            try:
                with phase("ple.publish"):
                    self.own_decode_rows.publish(self.ple_mailbox, pending.slots, tokens, pending.seq)
            except Exception:
                if not self.is_last:          # (raised from `on_message`, which only logs it: `finish` fails it)
                    self._forced_rows.add(pending.seq)
                raise

    def _fail_if_rows_missed(self, launched: _Launched) -> None:
        """A step whose graph gave up waiting for its PLE rows ran on whatever the mailbox held: its tokens are
        wrong, so each of its requests fails with an error instead (the others go on; the host is expected to
        publish the later steps' rows as usual)."""
        seq, timed_out = launched.ple_wait
        if int(timed_out[0]) != seq:
            return
        from stage_worker.kernels.host_wait import WAIT_TIMEOUT_S

        self.ple_wait_timeouts += 1
        log.error("stage %d: step %d's decode graph gave up waiting for its PLE rows after %.0f s "
                  "(ple_launch_ahead): its %d requests fail (%d such steps so far; MOEPIPE_PLE_LAUNCH_AHEAD=0 turns "
                  "the launch-ahead off)", self.index, launched.plan.step, WAIT_TIMEOUT_S, len(launched.outs),
                  self.ple_wait_timeouts)
        for out in launched.outs:
            out.token = -1
            out.error = "the server did not prepare this step's inputs in time; retry the request"

    def _hand_off(self, launched: _Launched, host_ids: list[int] | None) -> None:
        """`cuda_ipc_activations`: the activations into a ring slot the next stage maps, queued behind the step, and
        their header sent now; `finish` then sends nothing. A step that does not fit keeps the host path. The
        timing entry ends at this launch (the GPU time shows in the next stage's interval)."""
        timing = launched.timing + [[self.index, launched.t0, time.time(),
                                     launched.arrived if launched.arrived is not None else launched.t0]]
        got = self.handoff.put(launched.hidden, launched.batch.token_ids, host_ids, launched.plan.step, timing)
        if got is not None:
            header, launched.sent = got
            launched.hidden = None
            self.send_now(Outgoing("next", header))

    def _copy_out(self, launched: _Launched) -> None:
        """`ple_launch_ahead_across_stages`, a step handed on by the host path (no CUDA IPC, or a prefill chunk too
        large for a slot): its activations and ids into pinned memory now, and the event after them. A later step
        queued behind it may wait on the device for stage 0's host (its graph waits for ids it publishes once the
        last stage's Sampled is in, which needs this step's activations), so `finish` waits for this event alone:
        a device synchronisation, or the `.cpu()` of encoding the message, would wait for that step too."""
        launched.hidden = to_host(launched.hidden)
        launched.batch.token_ids = to_host(launched.batch.token_ids)
        if self.device.type == "cuda":
            launched.copied = torch.cuda.Event()
            launched.copied.record()

    @torch.inference_mode()
    def finish(self) -> list[Outgoing]:
        """Wait for the oldest launched step; its tokens to the gateway (and to stage 0 and the PLE service), or its
        activations to the next stage."""
        if self.launched[0].tail is not None:
            self._rows_for_oldest()
        launched = self.launched.pop(0)
        if self.is_first and launched.taken and not launched.dropped:
            self._finished_taken[launched.plan.step] = launched.taken    # (its drop may still come: `_on_plan`)
        if launched.skipped:
            return self._finish_skipped(launched)
        if launched.tail is not None or launched.tail_error is not None:
            raise launched.tail_error or RuntimeError(
                f"step {launched.plan.step}'s PLE rows were never published, so it was never sampled")
        plan, batch = launched.plan, launched.batch
        with phase("stage.sync"):
            if launched.copy is not None:
                self._settle(launched)
            elif launched.sent is not None:
                launched.sent.synchronize()
            elif launched.copied is not None:
                launched.copied.synchronize()
            elif self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        # busy: from the later of this step's launch and the previous step's end (launched steps overlap)
        self.last_step_seconds = end - max(launched.start, self._last_end)
        self._last_end = end
        self.busy_seconds += self.last_step_seconds
        self.steps += 1
        # [stage, compute start, compute end, activations' arrival] (arrival = start on the first stage)
        timing = launched.timing + [[self.index, launched.t0, time.time(),
                                     launched.arrived if launched.arrived is not None else launched.t0]]
        if not self.is_last:
            if launched.ple_wait is not None and (int(launched.ple_wait[1][0]) == launched.ple_wait[0]
                                                  or launched.ple_wait[0] in self._forced_rows):
                self._forced_rows.discard(launched.ple_wait[0])
                raise RuntimeError(f"step {plan.step}'s decode graph did not get its input ids and PLE rows in time "
                                   "(ple_launch_ahead_across_stages; MOEPIPE_PLE_LAUNCH_AHEAD_ACROSS_STAGES=0 turns "
                                   "it off)")
            if launched.sent is not None:
                return []                       # its header went at launch (`_hand_off`)
            return [Outgoing("next", Activations(step=plan.step, hidden=launched.hidden, token_ids=batch.token_ids,
                                                 timing=timing))]
        tokens = launched.outs
        if launched.ple_wait is not None:
            self._fail_if_rows_missed(launched)
        out: list[Outgoing] = []
        # A row that failed (its request ends) goes out as token 0: a step planned ahead feeds that token, and stage
        # 0 and the PLE service would wait for it forever (the step's output for the ended request is dropped).
        # Stage 0 and the PLE service read the tokens only: prompt logprobs go to the gateway alone.
        sampled = Sampled(step=plan.step, microbatch=plan.microbatch,
                          tokens=[(t if t.prompt_logprobs is None else dataclasses.replace(t, prompt_logprobs=None))
                                  if t.token >= 0 else TokenOut(t.req_id, t.position, 0) for t in tokens
                                  if t.token >= 0 or t.error])
        self._rows_from(tokens, dropped_only=launched.dropped)   # (dropped: its graphs' rows alone)
        # A dropped step's draws feed nothing: the core plans its surviving requests again from before it, and that
        # replan draws the same (request, position) anew. Left in `next_tokens` (or popping `device_next`, which
        # may hold the replan's draw by now) the replan's next step was fed this step's token while the client got
        # the replan's (`_forget_redrawn` clears what this step published before the drop came;
        # tests/test_qa_stale_token_after_drop.py).
        if self.is_first and not launched.dropped:
            for t in sampled.tokens:
                key = (t.req_id, t.position)
                self.device_next.pop(key, None)
                fed = key in self.device_fed     # a step already took it on the device
                self.device_fed.discard(key)
                # ... but one only prepared (the worker loop asks `ready()` with the launch depth full: two
                # micro-batches on one stage) still needs it on the host for its mailbox rows, which `_rows_from`
                # gives launched steps only: left here, `_expect_rows` takes it (else its graph waited for good)
                if t.req_id in self.requests and (not fed or self._prepared_took(key)):   # (a request finished
                    self.next_tokens[key] = t.token                                       # meanwhile needs none)
        elif not self.is_first:
            # (not to stage 0 itself, dropped: `InProcessExecutor` hands "first" to stage 0's `on_message`, which
            # kept the dropped draw for the replan's next step; test_qa_stale_token_after_drop.py, route_first)
            out.append(Outgoing("first", sampled))
        out.append(Outgoing("ple", sampled))
        out.append(Outgoing("gateway", StepResult(step=plan.step, microbatch=plan.microbatch, tokens=tokens,
                                                  timing=timing)))
        return out

    def _rows_for_oldest(self) -> None:
        """`finish` of a step whose sampler waits for its rows: those rows out first. Its tokens are on the host (the
        step before is finished), so only the contexts' copy behind that step can hold them: waited for here."""
        for pending in self._pending_rows:
            if pending.contexts is not None:
                pending.contexts.synchronize()
            if pending.seq == self.launched[0].rows_seq:
                break
        self._publish_rows()
        self.queue_samplers()

    def _prepared_took(self, key: tuple[str, int]) -> bool:
        """A mailbox stage's step prepared by `ready()` but not launched took this sampled token off the device."""
        return self.ple_mailbox is not None and any(key in p.taken for p in self.plans.values())

    def _settle(self, launched: _Launched) -> None:
        """The step's tokens are on the host: fill its TokenOuts and the requests' histories (once)."""
        copy, launched.copy = launched.copy, None
        copy.settle(launched.outs)

    def _race_kernel(self) -> bool:
        """Kernel flag `sample_race` of the stage's model, for the device sampler's draw."""
        return getattr(getattr(self.model, "kernel_flags", None), "sample_race", False)

    def _settle_launched(self) -> None:
        """Wait for every launched step's tokens (a path about to read the requests' histories needs them all)."""
        for earlier in self.launched:
            if earlier.copy is not None:
                self._settle(earlier)

    def _graph_ready(self, batch: StepBatch) -> bool:
        """Capture lazily (weights and caches exist by the first decode step), then replay what fits."""
        if not batch.is_decode:
            return False
        if not self.graphs.graphs:
            self.graphs.capture()
        return self.graphs.fits(batch)

    def stats(self) -> dict[str, float]:
        out = {"busy_seconds": self.busy_seconds, "steps": float(self.steps),
               "skipped_steps": float(self.skipped_steps),
               "ids_from_device": float(self.ids_from_device),
               "last_step_seconds": self.last_step_seconds, "ple_wait_seconds": self.ple_wait_seconds,
               "ple_decode_wait_seconds": self.ple_decode_wait_seconds,
               "kv_pool_bytes": float(self.cache.kv_bytes()), "kv_bytes_host": float(self.cache.kv_host_bytes()),
               "kv_bytes_vram": float(self.cache.kv_bytes() - self.cache.kv_host_bytes())}
        if self.own_decode_rows is not None:
            out["ple_stage_gathers"] = float(self.own_decode_rows.steps)
            out["ple_stage_gather_seconds"] = self.own_decode_rows.seconds
        if self.ple_mailbox is not None:
            out["ple_rows_after_launch"] = float(self.ple_rows_after_launch)
            out["ple_wait_timeouts"] = float(self.ple_wait_timeouts)
        if self.experts is not None:
            out.update(self.experts.stats())
        if self.handoff is not None:
            out.update(self.handoff.stats())
        if self.row_cache_reads is not None:
            out["kv_row_cache_bytes"] = float(self.cache.row_cache_bytes())
            if self.row_cache_reads.last is not None:
                out["kv_row_cache_hits"], out["kv_row_cache_lookups"] = map(float, self.row_cache_reads.last)
        return out

