"""Authenticated, encrypted links (issue 15, shared/links.py): `moepipe keys`, tcp endpoints refused without keys,
and a real two-stage cluster over tcp on 127.0.0.1 with CurveZMQ that serves the greedy tokens of the ipc cluster
and ignores what a sender without the cluster's certificate pushes into a stage."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import zmq

from conftest import free_port, moepipe, wait_healthy
from gateway.launcher import ServeOptions, build_cluster_config, commands
from shared.cluster_config import ClusterConfigError, cluster_from_dict, dump_toml, load_cluster_config
from shared.protocol import Shutdown, encode
from shared.sampling import SamplingParams
from stage_worker.generate import generate

ROOT = Path(__file__).resolve().parents[1]


def _keys(out: Path) -> subprocess.CompletedProcess:
    return moepipe("keys", "--out", str(out))


def test_keys_are_written_private_and_never_replaced(tmp_path):
    r = _keys(tmp_path / "k")
    assert r.returncode == 0, r.stderr
    secret = tmp_path / "k" / "cluster.key_secret"
    assert f'link_keys = "{secret}"' in r.stdout
    assert secret.stat().st_mode & 0o077 == 0
    before = secret.read_bytes()
    again = _keys(tmp_path / "k")
    assert again.returncode == 1 and "exists" in again.stderr and secret.read_bytes() == before


def test_tcp_endpoints_need_keys_unless_insecure_links(tmp_path):
    raw = {"model": "/m", "gateway_endpoint": "tcp://10.0.0.1:5550",
           "stages": [{"start": 0, "end": 2, "endpoint": "tcp://10.0.0.2:5560"}]}
    with pytest.raises(ClusterConfigError, match=r"tcp endpoints .*moepipe keys"):
        cluster_from_dict(dict(raw))
    assert cluster_from_dict({**raw, "insecure_links": True}).insecure_links
    assert _keys(tmp_path / "k").returncode == 0
    with pytest.raises(ClusterConfigError, match="only a public key"):
        cluster_from_dict({**raw, "link_keys": str(tmp_path / "k" / "cluster.key")})
    with pytest.raises(ClusterConfigError, match="cannot read"):
        cluster_from_dict({**raw, "link_keys": str(tmp_path / "nothing")})
    assert cluster_from_dict({**raw, "link_keys": str(tmp_path / "k" / "cluster.key_secret")}).link_keys
    with pytest.raises(ClusterConfigError, match="tcp endpoints"):        # the shipped example, minus its keys
        text = (ROOT / "deploy" / "two-host.toml").read_text()
        (tmp_path / "two.toml").write_text("\n".join(x for x in text.splitlines() if not x.startswith("link_keys")))
        load_cluster_config(tmp_path / "two.toml")


PROMPTS = ("The quick brown fox", "def add(a, b):")


def _greedy(url: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": "moepipe", "prompt": prompt,
                                                                 "max_tokens": 10, "temperature": 0}, verify=False)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_two_stages_over_tcp_with_curve_keys_serve_the_in_process_tokens(tiny_checkpoint, tmp_path):
    """The cluster over TCP with CURVE keys serves the greedy tokens of in-process generation (which the IPC cluster
    serves: tests/test_cluster.py), and drops what senders without the cluster's certificate send."""
    in_process = [generate(tiny_checkpoint, p, SamplingParams(max_tokens=10, temperature=0.0)).text for p in PROMPTS]
    assert _keys(tmp_path / "keys").returncode == 0
    run = tmp_path / "run"
    run.mkdir()
    base = build_cluster_config(ServeOptions(model=tiny_checkpoint, stages=2, port=free_port()), run)
    tcp = lambda: f"tcp://127.0.0.1:{free_port()}"       # noqa: E731
    cluster = replace(base, gateway_endpoint=tcp(), ple_endpoint=tcp(),
                      stages=[replace(s, endpoint=tcp()) for s in base.stages],
                      link_keys=str(tmp_path / "keys" / "cluster.key_secret"))
    path = run / "cluster.toml"
    path.write_text(dump_toml(cluster))
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _, cmd in commands(load_cluster_config(path), path, verbose=False)]
    url = f"http://127.0.0.1:{cluster.port}"
    try:
        wait_healthy(url)
        assert _greedy(url) == in_process
        # Senders without the cluster's certificate: no keys at all, and another cluster's keys. Neither gets a
        # message into stage 1 (a Shutdown would stop it).
        assert _keys(tmp_path / "other").returncode == 0
        ctx = zmq.Context()
        plain = ctx.socket(zmq.PUSH)
        plain.connect(cluster.stages[1].endpoint)
        other = ctx.socket(zmq.PUSH)
        pub, sec = zmq.auth.load_certificate(tmp_path / "other" / "cluster.key_secret")
        other.curve_publickey, other.curve_secretkey = pub, sec
        other.curve_serverkey = zmq.auth.load_certificate(tmp_path / "keys" / "cluster.key")[0]
        other.connect(cluster.stages[1].endpoint)
        for s in (plain, other):
            try:
                s.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.Again:            # no connection was ever completed: nothing to send on
                pass
        time.sleep(1.5)
        for s in (plain, other):
            s.close(linger=0)
        ctx.term()
        assert all(p.poll() is None for p in procs)
        assert _greedy(url) == in_process
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in procs:
            if p.returncode not in (0, -signal.SIGTERM):
                print(p.stderr.read()[-2000:])
    assert os.path.exists(path)
