"""QA exploration: does a served cluster stay up and answer exactly when a process is stopped for a while or the CPU
is starved? Not collected by pytest (tests/test_qa_stalls.py keeps the cheap cases).

For each layout (checkpoint, stages, PLE service) the same workload runs once on the idle cluster (the reference),
then again while one process is SIGSTOPped for 1, 3 and 6 s (a stage, the PLE service, the gateway), and while
busy-loop processes starve the CPU. Every answer must equal the reference: texts, token logprobs, finish reasons,
usage; a stream's chunks must add up to its text and its logprob count to completion_tokens. Afterwards /health is
200, no KV block, slot or request is held, and no process died.

    python tools/qa_stalls.py [--model tiny|demo|PATH] [--stages 1 2] [--ple] [--stops 1 3 6] [--victims ...]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import free_port
from logged_cluster import LoggedCluster
from test_qa_stalls import check, metrics, run_workload, settle, workload

from gateway.launcher import ServeOptions


def health_within(url: str, seconds: float) -> float | None:
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


def _spin(stop_at: float, cpus) -> None:
    os.setsid()             # a scheduler autogroup of its own, as each cluster process has: else all loops share one
    if cpus:
        os.sched_setaffinity(0, cpus)
    while time.time() < stop_at:
        pass


def starve(n: int, seconds: float, cpus=None) -> list[multiprocessing.Process]:
    procs = [multiprocessing.Process(target=_spin, args=(time.time() + seconds, cpus), daemon=True)
             for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ple", action="store_true", help="with the PLE service")
    ap.add_argument("--stops", type=float, nargs="+", default=[1, 3, 6])
    ap.add_argument("--victims", nargs="+", default=["stage0", "stage1", "ple", "gateway"])
    ap.add_argument("--starve", type=int, nargs="*", default=[6])
    ap.add_argument("--pin", action="store_true", help="also pin the cluster to one core while starving")
    ap.add_argument("--nice", type=int, default=0, help="renice every thread of the cluster while starving")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    if args.model == "tiny":
        from stage_worker.checkpoint.make_model import make_model

        model = make_model("tiny", Path(tempfile.mkdtemp(prefix="qa-stalls-")), seed=0)
    elif args.model == "demo":
        model = ROOT / "shared" / "demo_model"
    else:
        model = Path(args.model)
    work = workload(args.tokens, (0.0, 0.0, 0.0, 1.5, 2.5, 4.0))
    failures = 0
    for stages in args.stages:
        log = Path(args.log or tempfile.mkdtemp(prefix="qa-stalls-log-")) / f"cluster-{stages}.log"
        opts = ServeOptions(model=model, stages=stages, port=free_port(),
                            extra={"max_num_batched_tokens": 64, "block_size": 16, "num_blocks": 256,
                                   "ple_service": args.ple})
        with LoggedCluster(opts, log) as c:
            name = f"{args.model} stages={stages} ple={c.cluster.ple_service}"
            t0 = time.time()
            ref = asyncio.run(run_workload(c.url, work))
            print(f"{name}: reference in {time.time() - t0:.1f} s", flush=True)
            for r in ref:
                assert r["status"] == 200 and not r.get("errors"), r
            cases = []
            for victim in args.victims:
                if victim not in c.procs:
                    continue
                for s in args.stops:
                    cases.append((f"SIGSTOP {victim} {s:g} s", victim, s, 0))
            for n in args.starve:
                cases.append((f"{n} busy loops", None, 8.0, n))
            for label, victim, seconds, busy in cases:
                before = metrics(c.url)
                since = log.stat().st_size

                async def disturb(victim=victim, seconds=seconds, busy=busy):
                    if victim is not None:
                        p = c.procs[victim]
                        p.send_signal(signal.SIGSTOP)
                        try:
                            await asyncio.sleep(seconds)
                        finally:
                            p.send_signal(signal.SIGCONT)
                    else:
                        tids = [int(t) for p in c.procs.values() for t in os.listdir(f"/proc/{p.pid}/task")]
                        for tid in tids:
                            if args.pin:
                                os.sched_setaffinity(tid, {0})
                            if args.nice:
                                os.setpriority(os.PRIO_PROCESS, tid, args.nice)
                        if args.nice:
                            for p in c.procs.values():      # each child is a session: nice its autogroup too
                                Path(f"/proc/{p.pid}/autogroup").write_text(str(args.nice))
                        spin = starve(busy, seconds, {0} if args.pin else None)
                        await asyncio.sleep(seconds)
                        for p in spin:
                            p.join()
                        for p in c.procs.values():
                            if args.nice:
                                Path(f"/proc/{p.pid}/autogroup").write_text("0")
                        for tid in tids:
                            try:
                                os.sched_setaffinity(tid, {0, 1})
                                os.setpriority(os.PRIO_PROCESS, tid, 0)
                            except OSError:
                                pass

                t0 = time.time()
                got = asyncio.run(run_workload(c.url, work, disturb))
                took = time.time() - t0
                healthy = health_within(c.url, 20)
                held = settle(c.url)
                after = metrics(c.url)
                dead = {n: p.returncode for n, p in c.procs.items() if p.poll() is not None}
                problems = []
                for k, (r, g) in enumerate(zip(ref, got)):
                    problems += [f"request {k} ({work[k][1]} stream={work[k][2]['stream']}): {b}"
                                 for b in check(r, g, args.tokens)]
                if healthy is None:
                    problems.append("/health not 200 within 20 s")
                if any(held.values()):
                    problems.append(f"resources still held: {held}")
                if dead:
                    problems.append(f"processes died: {dead}")
                lines = log.read_bytes()[since:].decode(errors="replace").splitlines()
                errs = [ln for ln in lines if "moepipe.access" not in ln and any(
                    w in ln for w in (" ERROR ", "Traceback", "failed step", " CRITICAL "))]
                requeued = after.get("moepipe_requests_requeued", 0) - before.get("moepipe_requests_requeued", 0)
                warns = [ln for ln in lines if "WARNING" in ln]
                done = " ".join(f"{g['done_s']:.1f}" for g in got)
                print(f"  {label}: {'OK' if not problems else 'FAIL'} in {took:.1f} s; requeued {requeued:.0f}, "
                      f"{len(warns)} warnings, {len(errs)} errors; answers done at "
                      f"{done} s (idle {max(r['done_s'] for r in ref):.1f})",
                      flush=True)
                for p in problems[:12]:
                    print("     ", p)
                for e in errs[:6]:
                    print("      log:", e[:300])
                failures += bool(problems)
                if dead:
                    break
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
