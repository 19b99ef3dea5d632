"""ple_service: the socket-free PleService (plans, sampled tokens, ring contents, request state) and the process
end to end over ZeroMQ."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from ple_service.main import ple_stages
from ple_service.prefetch import Advisor, page_ranges
from ple_service.service import PleService
from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec, dump_toml
from shared.model_config import load_config
from shared.ngram_hash import NgramHashSpec, initial_context, ngram_rows_numpy
from shared.ple_ring import GatherRing, RingError
from shared.protocol import (
    Heartbeat, Plan, PleReady, Sampled, SamplingSpec, SeqEntry, StageError, TokenOut, decode, encode,
)
from stage_worker.checkpoint.loader import load_model
from stage_worker.checkpoint.make_model import make_model
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec, PLEState

ROOT = Path(__file__).resolve().parents[1]
PAGE = mmap.PAGESIZE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, config, the loaded whole model): loading expands the PLE table the service then maps."""
    path = tmp_path_factory.mktemp("tiny_ple_service")
    make_model("tiny", path)
    return path, load_config(path), load_model(path)


def _cluster(model: Path, tmp: Path, **kw) -> ClusterConfig:
    stages = [StageSpec(0, 3, f"ipc://{tmp}/s0.sock"), StageSpec(3, 6, f"ipc://{tmp}/s1.sock")]
    base = dict(model=str(model), stages=stages,
                gateway_endpoint=f"ipc://{tmp}/gw.sock", ple_endpoint=f"ipc://{tmp}/ple.sock",
                ple_ring=str(tmp / "ple.ring"), ple_ring_slots=6, max_num_batched_tokens=32)
    base.update(kw)
    return ClusterConfig(**base)


def _spec(req_id: str, prompt: list[int]) -> SamplingSpec:
    return SamplingSpec(req_id, 1.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, None, prompt_ids=list(prompt))


def _prompts(cfg) -> tuple[list[int], list[int]]:
    eos = cfg.primary_eos
    return [5, 17, 300, 2, 2, 9, 1000], [eos, 44, 45, eos, 46, 47, 48, 1, 2, 3]


def _expected(table, spec, seqs) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Rows straight from the hash: seqs = (context, tokens) each -> (gathered [T, heads, dim], new contexts)."""
    rows, ctxs = [], []
    for ctx, toks in seqs:
        r, c = ngram_rows_numpy(spec, ctx, np.asarray(toks))
        rows.append(r)
        ctxs.append(c)
    return table.tensor[torch.from_numpy(np.concatenate(rows))], ctxs


def test_prefill_then_decode_rows_match_hash_and_stage(tiny, tmp_path, monkeypatch):
    path, cfg, model = tiny
    layer = cfg.ple_layer_ids[0] - 1
    ple = model.layers[str(layer)].ple
    table, spec = ple.table, NgramHashSpec.from_model_config(cfg, 0)
    a, b = _prompts(cfg)
    svc = PleService(path, cfg, _cluster(path, tmp_path))
    advised: list[list[tuple[int, int]]] = []
    real = svc.advisors[0].advise
    monkeypatch.setattr(svc.advisors[0], "advise", lambda ranges: advised.append(list(ranges)) or real(ranges))
    state = PLEState(cfg, CacheSpec(num_blocks=8, block_size=16, num_slots=2))     # the stage's own PLE state
    assert svc.tables[layer].path == table.path                   # the stage's expansion, mapped, not copied
    assert len(list(path.glob(f"ple_table.layer{layer}*.bin"))) == 1
    try:
        plan0 = Plan(step=0, microbatch=0, new_requests=[_spec("a", a), _spec("b", b)],
                     entries=[SeqEntry("a", 0, 0, len(a), [0], tokens=a), SeqEntry("b", 1, 0, len(b), [1], tokens=b)])
        [ready] = svc.on_plan(plan0)
        assert ready == PleReady(step=0, ring_slot=0, num_tokens=len(a) + len(b))
        got = svc.ring.slot(0)[:ready.num_tokens, 0]
        want, (ca, cb) = _expected(table, spec, [(initial_context(spec), a), (initial_context(spec), b)])
        assert torch.equal(got, want)
        stage_rows = ple.rows(StepBatch.build([(a, 0, 0, [0]), (b, 0, 1, [1])], 16), state)
        assert torch.equal(got, table.gather(stage_rows))

        # the prompts' pages were advised, and nothing else
        assert svc.prefetcher.wait_idle()
        rb = table.dim * table.tensor.element_size()
        prompt_rows = np.concatenate([ngram_rows_numpy(spec, initial_context(spec), np.array(p))[0] for p in (a, b)])
        pages = {s for r in advised for s in r}
        assert pages == set(page_ranges(prompt_rows[:len(a)], rb, PAGE) + page_ranges(prompt_rows[len(a):], rb, PAGE))

        # decode: the plan waits for both sampled tokens
        plan1 = Plan(step=1, microbatch=0, entries=[SeqEntry("a", 0, len(a), 1, [0]), SeqEntry("b", 1, len(b), 1, [1])])
        assert svc.on_plan(plan1) == [] and svc.waiting_steps() == [1]
        advised.clear()
        assert svc.on_sampled(Sampled(0, 0, [TokenOut("a", len(a), 77)])) == []
        tok_rows, _ = ngram_rows_numpy(spec, ca, np.array([77]))
        assert advised == [page_ranges(tok_rows, rb, PAGE)]          # one call, at once, for the fresh token
        out = svc.on_sampled(Sampled(0, 0, [TokenOut("b", len(b), 88)]))
        assert out == [PleReady(step=1, ring_slot=1, num_tokens=2)] and svc.waiting_steps() == []
        got = svc.ring.slot(1)[:2, 0]
        want, (ca, cb) = _expected(table, spec, [(ca, [77]), (cb, [88])])
        assert torch.equal(got, want)
        stage_rows = ple.rows(StepBatch.build([([77], len(a), 0, [0]), ([88], len(b), 1, [1])], 16), state)
        assert torch.equal(got, table.gather(stage_rows))

        # a token that arrives before its plan; "a" finishes in the same plan
        assert svc.on_sampled(Sampled(1, 0, [TokenOut("b", len(b) + 1, 99)])) == []
        plan2 = Plan(step=2, microbatch=0, entries=[SeqEntry("b", 1, len(b) + 1, 1, [1])], finished=["a"])
        assert svc.on_plan(plan2) == [PleReady(step=2, ring_slot=2, num_tokens=1)]
        want, _ = _expected(table, spec, [(cb, [99])])
        assert torch.equal(svc.ring.slot(2)[:1, 0], want)
        assert svc.tracked_requests() == {"b"}
        assert svc.on_sampled(Sampled(2, 0, [TokenOut("a", len(a) + 1, 5)])) == []   # late token of a dead request
        assert svc.tracked_requests() == {"b"}

        assert svc.on_plan(Plan(step=3, microbatch=0, entries=[], finished=["b"])) == \
            [PleReady(step=3, ring_slot=3, num_tokens=0)]
        assert svc.tracked_requests() == set()
        st = svc.stats()
        assert st["gathers"] == 4 and st["gather_tokens"] == len(a) + len(b) + 3
        assert st["prefetch_pages"] > 0 and st["prefetch_calls"] >= 3 and st["prefetch_fallback"] in (0.0, 1.0)
        assert svc.take_errors() == []
    finally:
        svc.close()
    assert not (tmp_path / "ple.ring").exists()


def test_service_expands_a_table_no_stage_has_expanded(tiny, tmp_path):
    path, cfg, model = tiny
    fresh = tmp_path / "model"
    fresh.mkdir()
    for f in path.iterdir():
        if not f.name.startswith("ple_table."):
            shutil.copy(f, fresh / f.name)
    svc = PleService(fresh, cfg, _cluster(fresh, tmp_path))
    try:
        layer = cfg.ple_layer_ids[0] - 1
        assert svc.tables[layer].path.parent == fresh
        assert torch.equal(svc.tables[layer].tensor, model.layers[str(layer)].ple.table.tensor)
    finally:
        svc.close()


def test_finished_request_cancels_prompt_prefetch(tiny, tmp_path, monkeypatch):
    path, cfg, _ = tiny
    svc = PleService(path, cfg, _cluster(path, tmp_path))
    cancelled: list[str] = []
    real = svc.prefetcher.cancel
    monkeypatch.setattr(svc.prefetcher, "cancel", lambda rid: cancelled.append(rid) or real(rid))
    try:
        a, _ = _prompts(cfg)
        svc.on_plan(Plan(step=0, microbatch=0, new_requests=[_spec("a", a)],
                         entries=[SeqEntry("a", 0, 0, 3, [0], tokens=a[:3])]))
        assert svc.tracked_requests() == {"a"}
        svc.on_plan(Plan(step=1, microbatch=0, entries=[], finished=["a"]))
        assert "a" in cancelled and svc.tracked_requests() == set()
    finally:
        svc.close()


def test_prefetch_off_never_advises(tiny, tmp_path, monkeypatch):
    path, cfg, _ = tiny

    def boom(self, ranges):
        raise AssertionError("madvise with ple_prefetch off")

    monkeypatch.setattr(Advisor, "advise", boom)
    svc = PleService(path, cfg, _cluster(path, tmp_path, ple_prefetch=False))
    try:
        a, _ = _prompts(cfg)
        assert svc.prefetcher is None and svc.advisors == []
        svc.on_plan(Plan(step=0, microbatch=0, new_requests=[_spec("a", a)],
                         entries=[SeqEntry("a", 0, 0, len(a), [0], tokens=a)]))
        svc.on_plan(Plan(step=1, microbatch=0, entries=[SeqEntry("a", 0, len(a), 1, [0])]))
        assert len(svc.on_sampled(Sampled(0, 0, [TokenOut("a", len(a), 3)]))) == 1
        st = svc.stats()
        assert st["prefetch_enabled"] == 0 and st["prefetch_calls"] == 0 and st["gathers"] == 2
    finally:
        svc.close()


def test_request_preempted_and_readmitted_in_one_plan_starts_over(tiny, tmp_path):
    """`finished` applies before a plan's entries: the scheduler can preempt a request while planning a step and
    re-admit it in that same step, from position 0 (tests/test_scheduler.py makes that plan)."""
    path, cfg, model = tiny
    table = model.layers[str(cfg.ple_layer_ids[0] - 1)].ple.table
    spec = NgramHashSpec.from_model_config(cfg, 0)
    a, _ = _prompts(cfg)
    svc = PleService(path, cfg, _cluster(path, tmp_path))
    try:
        assert svc.on_plan(Plan(step=0, microbatch=0, new_requests=[_spec("a", a)],
                                entries=[SeqEntry("a", 0, 0, 5, [0], tokens=a[:5])]))[0].num_tokens == 5
        again = Plan(step=1, microbatch=0, new_requests=[_spec("a", a)], finished=["a"],
                     entries=[SeqEntry("a", 0, 0, 3, [0], tokens=a[:3])])
        assert svc.on_plan(again) == [PleReady(step=1, ring_slot=1, num_tokens=3)]
        rest = Plan(step=2, microbatch=0, entries=[SeqEntry("a", 0, 3, len(a) - 3, [0], tokens=a[3:])])
        assert svc.on_plan(rest) == [PleReady(step=2, ring_slot=2, num_tokens=len(a) - 3)]
        assert svc.take_errors() == []
        want, _ = _expected(table, spec, [(initial_context(spec), a)])
        got = torch.cat([svc.ring.slot(1)[:3, 0], svc.ring.slot(2)[:len(a) - 3, 0]])
        assert torch.equal(got, want)
    finally:
        svc.close()


def test_lost_context_and_oversized_step_become_stage_errors(tiny, tmp_path):
    path, cfg, _ = tiny
    svc = PleService(path, cfg, _cluster(path, tmp_path))
    try:
        assert svc.on_plan(Plan(step=0, microbatch=0, entries=[SeqEntry("x", 0, 5, 2, [0], tokens=[1, 2])])) == []
        assert svc.on_plan(Plan(step=1, microbatch=0, entries=[SeqEntry("y", 0, 0, 40, [0], tokens=[1] * 40)])) == []
        errs = svc.take_errors()
        assert [e.step for e in errs] == [0, 1] and all(isinstance(e, StageError) and e.component == "ple"
                                                        for e in errs)
        assert "x" in errs[0].message and "32" in errs[1].message
        assert svc.waiting_steps() == [] and svc.tracked_requests() == set()
    finally:
        svc.close()


def test_a_restarted_service_fails_stale_decode_plans_and_serves_the_recomputed_requests(tiny, tmp_path, caplog):
    """A new PLE service receives the plans queued for it while it was down. Stages that gather their own decode
    rows decoded on meanwhile, so those plans decode requests it has never seen, whose tokens went to the dead
    process: they fail at once as lost contexts (the engine core ignores the errors of steps it has forgotten),
    instead of waiting for tokens forever in front of the same requests' recomputation. Expected after a restart,
    so logged as warnings, not errors."""
    import logging

    path, cfg, _ = tiny
    svc = PleService(path, cfg, _cluster(path, tmp_path))
    try:
        stale = [Plan(step=s, microbatch=0, entries=[SeqEntry("a", 0, 7 + s, 1, []), SeqEntry("b", 1, 5 + s, 1, [])])
                 for s in (40, 41)]
        with caplog.at_level(logging.WARNING):
            for plan in stale:
                assert svc.on_plan(plan) == []
        assert [e.step for e in svc.take_errors()] == [40, 41] and svc.waiting_steps() == []
        assert [r.levelname for r in caplog.records if "PLE step" in r.getMessage()] == ["WARNING", "WARNING"]
        recompute = Plan(step=43, microbatch=0, finished=["a", "b"],
                         entries=[SeqEntry("a", 0, 0, 9, [0], tokens=list(range(3, 12))),
                                  SeqEntry("b", 1, 0, 7, [1], tokens=list(range(20, 27)))])
        assert svc.on_plan(Plan(step=42, microbatch=0, entries=[], finished=["a", "b"], dropped=[39])) == \
            [PleReady(step=42, ring_slot=svc.ring.slot_for_step(42), num_tokens=0)]
        assert svc.on_plan(recompute) == [PleReady(step=43, ring_slot=svc.ring.slot_for_step(43), num_tokens=16)]
        assert svc.take_errors() == [] and svc.tracked_requests() == {"a", "b"}
    finally:
        svc.close()


def test_ring_roundtrip_and_errors(tmp_path):
    ring = GatherRing.create(tmp_path / "r", slots=3, max_tokens=4, layers=2, heads=3, head_dim=5,
                             dtype=torch.bfloat16)
    ring.slot(2)[1, 1] = torch.arange(15, dtype=torch.bfloat16).view(3, 5)
    reader = GatherRing.open(tmp_path / "r")
    assert (reader.slots, reader.max_tokens, reader.layers, reader.heads, reader.head_dim) == (3, 4, 2, 3, 5)
    assert reader.slot(2).dtype == torch.bfloat16 and torch.equal(reader.slot(2), ring.slot(2))
    assert reader.pin() is torch.cuda.is_available()
    reader.close()
    ring.close()
    ring.unlink()
    with pytest.raises(RingError, match="no PLE ring"):
        GatherRing.open(tmp_path / "r")
    (tmp_path / "bad").write_bytes(b"x" * 5000)
    with pytest.raises(RingError, match="magic"):
        GatherRing.open(tmp_path / "bad")


def test_a_ring_slot_is_rewritten_only_after_the_last_stage_ran_its_step(tiny, tmp_path):
    """Two slots, steps 0 and 2 share slot 0: step 2 waits (its rows unwritten, step 0's intact) until the last
    stage's Sampled for step 0 proves every PLE stage copied them; a dropped step frees its slot the same way."""
    path, cfg, _ = tiny
    a, b = _prompts(cfg)
    svc = PleService(path, cfg, _cluster(path, tmp_path, ple_ring_slots=2))
    try:
        [r0] = svc.on_plan(Plan(step=0, microbatch=0, new_requests=[_spec("a", a)],
                                entries=[SeqEntry("a", 0, 0, len(a), [0], tokens=a)]))
        [r1] = svc.on_plan(Plan(step=1, microbatch=1, new_requests=[_spec("b", b)],
                                entries=[SeqEntry("b", 1, 0, len(b), [1], tokens=b)]))
        assert (r0.ring_slot, r1.ring_slot) == (0, 1) and svc.busy_slots() == {0: 0, 1: 1}
        rows0 = svc.ring.slot(0)[:len(a)].clone()
        step2 = Plan(step=2, microbatch=0, new_requests=[_spec("c", [7, 8, 9])],
                     entries=[SeqEntry("c", 2, 0, 3, [2], tokens=[7, 8, 9])])
        assert svc.on_plan(step2) == [] and svc.waiting_steps() == [2]
        assert torch.equal(svc.ring.slot(0)[:len(a)], rows0)               # a later stage may still copy these
        assert svc.on_sampled(Sampled(0, 0, [TokenOut("a", len(a), 11)])) == [PleReady(2, 0, 3)]
        assert svc.busy_slots() == {0: 2, 1: 1}
        step3 = Plan(step=3, microbatch=1, entries=[SeqEntry("b", 1, len(b), 1, [1], tokens=[5])])
        assert svc.on_plan(step3) == []                                    # slot 1: step 1 not run to the end
        out = svc.on_plan(Plan(step=-1, microbatch=0, entries=[], dropped=[1]))
        assert out[0] == PleReady(3, 1, 1) and [(r.step, r.num_tokens) for r in out[1:]] == [(-1, 0)]
        assert svc.take_errors() == []
    finally:
        svc.close()


def test_ple_stages_lookup(tiny, tmp_path):
    path, cfg, _ = tiny
    assert ple_stages(_cluster(path, tmp_path), cfg) == [0]                  # layer 1 of [0, 3)
    two = _cluster(path, tmp_path, stages=[StageSpec(0, 1, "ipc://a"), StageSpec(1, 6, "ipc://b")])
    assert ple_stages(two, cfg) == [1]
    import dataclasses
    spread = dataclasses.replace(cfg, ple_layer_ids=[2, 4])                  # 0-based 1 and 3: both stages
    assert ple_stages(_cluster(path, tmp_path), spread) == [0, 1]
    with pytest.raises(ClusterConfigError, match="no PLE layers"):
        ple_stages(_cluster(path, tmp_path), dataclasses.replace(cfg, ple_layer_ids=[]))


# ---------------------------------------------------------------------------------------------------------------------
# the process


def _recv(sock: zmq.Socket, timeout_s: float, want: type, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode(sock.recv_multipart())
            if isinstance(msg, want):
                return msg
    pytest.fail(f"no {want.__name__} within {timeout_s} s; service log:\n{log.read_text()}")


def test_process_end_to_end(tiny, tmp_path):
    path, cfg, model = tiny
    table = model.layers[str(cfg.ple_layer_ids[0] - 1)].ple.table
    spec = NgramHashSpec.from_model_config(cfg, 0)
    ring_path = Path(f"/dev/shm/moepipe-test-{uuid.uuid4().hex[:12]}.ring")
    cluster = _cluster(path, tmp_path, ple_ring=str(ring_path), heartbeat_interval=0.1)
    toml = tmp_path / "cluster.toml"
    toml.write_text(dump_toml(cluster))
    log = tmp_path / "ple.log"
    ctx = zmq.Context()
    gw, stage = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    gw.bind(cluster.gateway_endpoint)
    stage.bind(cluster.stages[0].endpoint)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(cluster.ple_endpoint)          # queues until the service binds
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MOEPIPE_PLE_PREFETCH", None)
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "ple_service", "--config", str(toml)], cwd=ROOT, env=env,
                                stdout=logf, stderr=subprocess.STDOUT)
    try:
        a, b = _prompts(cfg)
        push.send_multipart([b"\x93garbage"])                      # malformed: logged and skipped
        push.send_multipart(encode(Heartbeat(component="x", pid=1)))   # not for the PLE service: skipped
        push.send_multipart(encode(Plan(step=5, microbatch=0, new_requests=[_spec("a", a), _spec("b", b)],
                                        entries=[SeqEntry("a", 0, 0, len(a), [0], tokens=a),
                                                 SeqEntry("b", 1, 0, len(b), [1], tokens=b)])))
        ready = _recv(stage, 30, PleReady, log)
        assert ready == PleReady(step=5, ring_slot=5 % cluster.ple_ring_slots, num_tokens=len(a) + len(b))
        hb = _recv(gw, 5, Heartbeat, log)
        assert hb.component == "ple" and hb.pid == proc.pid and "gather_seconds" in hb.stats
        ring = GatherRing.open(ring_path)
        want, _ = _expected(table, spec, [(initial_context(spec), a), (initial_context(spec), b)])
        assert torch.equal(ring.slot(ready.ring_slot)[:ready.num_tokens, 0], want)
        ring.close()
        assert proc.poll() is None, "the service died on a malformed message"

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 5
        assert not ring_path.exists()
        text = log.read_text()
        assert "malformed" in text and "not meant for the PLE service" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ring_path.unlink(missing_ok=True)
        for s in (gw, stage, push):
            s.close(linger=0)
        ctx.term()


def test_a_stop_while_loading_exits_at_once(tiny, tmp_path):
    """SIGTERM while the service loads its table (minutes for a large one written or read): its loop, the only
    reader of the stop flag, had not started, so it ignored the signal and the launcher's stop waited its whole
    grace for a SIGKILL. Now it exits 0 at once and leaves no ring file behind."""
    path, _, _ = tiny
    ring_path = Path(f"/dev/shm/moepipe-test-{uuid.uuid4().hex[:12]}.ring")
    toml = tmp_path / "cluster.toml"
    toml.write_text(dump_toml(_cluster(path, tmp_path, ple_ring=str(ring_path))))
    log = tmp_path / "ple.log"
    # the table load made slow: the ring is created, then the advisors take "minutes" (the real load's stand-in)
    code = ("import sys, time\nimport ple_service.service as s\n"
            "s.make_advisors = lambda *a, **k: (print('loading', flush=True), time.sleep(120))\n"
            "from ple_service.main import main\nsys.exit(main(['--config', sys.argv[1]]))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MOEPIPE_PLE_PREFETCH="1", MOEPIPE_PLE_PREFETCH_METHOD="madvise")
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-c", code, str(toml)], cwd=ROOT, env=env, stdout=logf,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "loading" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert ring_path.exists()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, log.read_text()[-3000:]
        assert time.monotonic() - t0 < 3
        assert not ring_path.exists()
        assert "SIGTERM received while loading, exiting" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ring_path.unlink(missing_ok=True)
