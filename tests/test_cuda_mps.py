"""`cuda_mps` (gateway/cuda_mps.py): stage processes sharing a GPU get a control daemon private to the run, its
pipe directory in their environment, and the daemon is told to quit at the end; without the binary, or with
nothing shared, the stages run as before. The daemon is a stand-in script here (no GPU on the CPU runners)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gateway.cuda_mps import MpsDaemon, shared_gpus, start_mps
from shared.cluster_config import ClusterConfig, StageSpec


def _cluster(tmp: Path, devices: list[str], on: bool = True) -> ClusterConfig:
    return ClusterConfig(model="unused", gateway_endpoint=f"ipc://{tmp}/g.sock", cuda_mps=on,
                         stages=[StageSpec(i, i + 1, f"ipc://{tmp}/s{i}.sock", d) for i, d in enumerate(devices)])


def _fake_control(tmp: Path, monkeypatch, rc: int = 0) -> Path:
    """An `nvidia-cuda-mps-control` that logs its arguments, its stdin and its pipe directory."""
    bin_dir, log = tmp / "bin", tmp / "mps.log"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(f"#!{sys.executable}\nimport os, sys\nargs = ' '.join(sys.argv[1:])\n"
                      f"stdin = '' if args else sys.stdin.read().strip()\n"
                      f"open({str(log)!r}, 'a').write(f\"{{args}}|{{stdin}}|{{os.environ['CUDA_MPS_PIPE_DIRECTORY']}}\\n\")\n"
                      f"sys.exit({rc})\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_shared_gpus():
    assert shared_gpus(_cluster(Path("/x"), ["cuda:0", "cuda"])) == ["cuda:0"]
    assert shared_gpus(_cluster(Path("/x"), ["cuda:0", "cuda:1", "cpu", "cpu"])) == []


def test_a_private_daemon_starts_and_quits(tmp_path, monkeypatch, capsys):
    log = _fake_control(tmp_path, monkeypatch)
    daemon = start_mps(_cluster(tmp_path, ["cuda:0", "cuda:0"]), tmp_path)
    assert daemon is not None and daemon.pipe_dir == tmp_path / "mps-pipe" and daemon.pipe_dir.is_dir()
    assert "private MPS daemon" in capsys.readouterr().err
    daemon.stop()
    assert log.read_text().splitlines() == [f"-d||{daemon.pipe_dir}", f"|quit|{daemon.pipe_dir}"]


def test_no_daemon_when_off_unshared_missing_or_failing(tmp_path, monkeypatch, capsys):
    assert start_mps(_cluster(tmp_path, ["cuda:0", "cuda:0"], on=False), tmp_path) is None
    assert start_mps(_cluster(tmp_path, ["cuda:0", "cuda:1"]), tmp_path) is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert start_mps(_cluster(tmp_path, ["cuda:0", "cuda:0"]), tmp_path) is None
    assert "cannot start nvidia-cuda-mps-control" in capsys.readouterr().err
    _fake_control(tmp_path, monkeypatch, rc=1)
    assert start_mps(_cluster(tmp_path, ["cuda:0", "cuda:0"]), tmp_path) is None
    err = capsys.readouterr().err
    assert "exited with 1" in err and "time-sliced" in err


def test_the_launcher_hands_its_children_the_pipe_directory(tmp_path):
    """`Cluster._spawn` (every start and restart) adds the daemon's environment to a child's."""
    from gateway.launcher import Cluster

    out = tmp_path / "env.txt"
    c = Cluster.__new__(Cluster)
    c.commands = {"stage0": [sys.executable, "-c",
                             f"import os; open({str(out)!r}, 'w').write(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"]}
    c.procs, c.started_at, c.restarts = {}, {}, {}
    c.mps = MpsDaemon(tmp_path / "pipe", tmp_path / "log")
    c._spawn("stage0")
    assert c.procs["stage0"].wait(timeout=30) == 0
    assert out.read_text() == str(tmp_path / "pipe")


def test_a_dead_launcher_s_daemon_is_told_to_quit(tmp_path, monkeypatch):
    """A launcher killed outright leaves its self-daemonising MPS control behind: the next launcher, removing the
    stale run directory, tells it to quit first."""
    import tempfile

    from gateway.launcher import LAUNCHER_PID, remove_stale_run_dirs

    log = _fake_control(tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = runs / "moepipe-x"
    (stale / "mps-pipe").mkdir(parents=True)
    (stale / LAUNCHER_PID).write_text(str(dead.pid))
    assert remove_stale_run_dirs() == [stale]
    assert log.read_text().splitlines() == [f"|quit|{stale / 'mps-pipe'}"]
