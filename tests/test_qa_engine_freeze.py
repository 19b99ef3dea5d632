"""A `moepipe serve --stages 2` cluster frozen as a whole (`docker pause`, a suspended VM or laptop, SIGSTOP of its
processes) for longer than `hang_timeout`, then resumed: nothing is killed, and it serves the same tokens."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from conftest import free_port
from gateway.launcher import Cluster, ServeOptions


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    opts = ServeOptions(model=tiny_checkpoint, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 64, "block_size": 16, "num_blocks": 64,
                               "ple_service": False, "hang_timeout": 4.0})
    with Cluster(opts) as c:
        yield c


def _complete(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "moepipe", "prompt": "def add(a, b):", "max_tokens": 12,
                                                  "temperature": 0}, timeout=60, verify=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_cluster_frozen_longer_than_hang_timeout_is_not_killed_when_it_resumes(cluster):
    """The gateway measured a component's silence from its last heartbeat, including the time the gateway itself
    was frozen: on resuming it found every component silent past hang_timeout and SIGKILLed them all before their
    next heartbeats arrived (under `moepipe serve` all restarted, models loaded again, every running request
    recomputed). Silence now counts only while the gateway reads its inbox."""
    url = cluster.url
    before = _complete(url)
    procs = dict(cluster.procs)
    stages = [p for name, p in procs.items() if name.startswith("stage")]
    for p in procs.values():
        p.send_signal(signal.SIGSTOP)
    try:
        time.sleep(6.0)                              # past hang_timeout (4 s)
    finally:
        procs["gateway"].send_signal(signal.SIGCONT)     # the gateway looks first, the stages' heartbeats follow
        time.sleep(0.3)
        for p in stages:
            p.send_signal(signal.SIGCONT)
    time.sleep(1.5)                                  # the gateway's watchdog has passed (every 0.5 s) since then
    dead = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
    assert not dead, f"killed after the freeze: {dead}"
    assert httpx.get(url + "/health", timeout=5, verify=False).status_code == 200
    assert _complete(url) == before


def test_a_component_lost_before_the_gap_stays_lost(tmp_path):
    """The gap's grace is for components that were heartbeating when the gateway stopped looking: one already past
    its deadline then stays lost (else its requests were requeued again once the grace ran out)."""
    from gateway.cluster_executor import ClusterExecutor
    from shared.cluster_config import ClusterConfig, StageSpec

    cluster = ClusterConfig(model="unused", stages=[StageSpec(0, 1, f"ipc://{tmp_path}/s0.sock"),
                                                    StageSpec(1, 2, f"ipc://{tmp_path}/s1.sock")],
                            gateway_endpoint=f"ipc://{tmp_path}/gw.sock", heartbeat_timeout=2.5, hang_timeout=0)
    ex = ClusterExecutor(cluster, expect_ple=False)
    now = time.time()
    ex._last_look = now - 10.0                        # the gateway was frozen for 10 s
    ex.state["stage0"].last_seen = now - 30.0         # silent 20 s when it stopped looking: lost already
    ex.state["stage1"].last_seen = now - 10.5         # heard from 0.5 s before the freeze
    assert ex.health() == ["stage0", "stage1"]
    ex._looked()
    assert ex.health() == ["stage0"] and ex.lost() == ["stage0"]
