"""`moepipe serve`: start the PLE service, the stage workers and the gateway on this machine, wait until /health
answers 200, print the URL, forward Ctrl-C / SIGTERM and leave no process behind.

Each process is the same program an operator runs alone from the cluster config (see deploy/), so the one-command
path and the systemd path cannot drift apart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.cluster_config import ClusterConfig, StageSpec, dump_toml, env_overrides, split_layers
from shared.model_config import Qwen4ExpConfig, load_config


@dataclass
class ServeOptions:
    model: Path
    stages: int = 1
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: Path | None = None
    extra: dict | None = None            # any other ClusterConfig field
    startup_timeout: float = 300.0
    verbose: bool = False


def build_cluster_config(opts: ServeOptions, run_dir: Path) -> ClusterConfig:
    cfg = load_config(opts.model)
    ipc = lambda name: f"ipc://{run_dir / (name + '.sock')}"          # noqa: E731
    devices = [opts.device] * opts.stages
    if opts.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("--device cuda: no CUDA device is visible")
        # One GPU per stage when there are enough; otherwise stages share GPUs round-robin.
        devices = [f"cuda:{i % count}" for i in range(opts.stages)]
    stages = [StageSpec(start=s, end=e, endpoint=ipc(f"stage{i}"), device=devices[i])
              for i, (s, e) in enumerate(split_layers(cfg.num_hidden_layers, opts.stages))]
    extra = {**env_overrides(), **(opts.extra or {})}        # command-line flags win over the environment
    has_ple = isinstance(cfg, Qwen4ExpConfig) and bool(cfg.ple_layer_ids)
    use_service = extra.pop("ple_service", True) and has_ple     # popped either way: a field set below
    cluster = ClusterConfig(model=str(Path(opts.model).resolve()), stages=stages,
                            gateway_endpoint=ipc("gateway"), host=opts.host, port=opts.port,
                            ple_endpoint=ipc("ple") if use_service else "",
                            ple_ring=str(_shm_dir() / f"moepipe-ple-{os.getpid()}-{opts.port}.ring")
                            if use_service else "",
                            ple_service=use_service, **extra)
    return cluster.for_model(cfg)          # cluster.toml carries the derived KV sizes: every process reads them


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def commands(cluster: ClusterConfig, config_path: Path, verbose: bool) -> list[tuple[str, list[str]]]:
    py = sys.executable
    # Every child dies with us (shared/parent_watch.py), however we end.
    v = (["-v"] if verbose else []) + ["--parent-pid", str(os.getpid())]
    cmds = []
    if cluster.ple_service and cluster.ple_endpoint:
        cmds.append(("ple", [py, "-m", "ple_service", "--config", str(config_path),
                             "--log-level", "INFO" if verbose else "WARNING", "--parent-pid", str(os.getpid())]))
    for i in range(cluster.num_stages):
        cmds.append((f"stage{i}", [py, "-m", "stage_worker", "--config", str(config_path), "--stage", str(i), *v]))
    cmds.append(("gateway", [py, "-m", "gateway", "--config", str(config_path), *v]))
    return cmds


class Cluster:
    """The child processes of one `serve`; a context manager that always cleans up."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self._tmp = None
        if opts.run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="moepipe-")
            self.run_dir = Path(self._tmp.name)
        else:
            self.run_dir = Path(opts.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = build_cluster_config(opts, self.run_dir)
        self.config_path = self.run_dir / "cluster.toml"
        self.config_path.write_text(dump_toml(self.cluster))
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"http://{self.cluster.host}:{self.cluster.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name, cmd in commands(self.cluster, self.config_path, self.opts.verbose):
            # A new session per child: Ctrl-C in the terminal reaches only us, and we stop them in order.
            self.procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True)

    def wait_healthy(self, should_stop=lambda: False) -> None:
        deadline = time.time() + self.opts.startup_timeout
        while time.time() < deadline:
            if should_stop():
                raise RuntimeError("stopped during start-up")
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"{', '.join(f'{n} exited with {c}' for n, c in dead.items())} during start-up")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not healthy after {self.opts.startup_timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        order = ["gateway"] + [n for n in self.procs if n.startswith("stage")] + ["ple"]
        for name in order:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.cluster.ple_ring:
            Path(self.cluster.ple_ring).unlink(missing_ok=True)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "Cluster":
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_serve(opts: ServeOptions) -> int:
    stop = {"flag": False}

    def on_signal(*_):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Cluster(opts)
    try:
        cluster.start()
        print(f"moepipe: starting {cluster.cluster.num_stages} stage(s)"
              f"{' + PLE service' if cluster.cluster.ple_service else ''} for {opts.model}", file=sys.stderr)
        cluster.wait_healthy(lambda: stop["flag"])
        print(f"moepipe: serving {cluster.cluster.served_model_name} at {cluster.url}/v1  (Ctrl-C stops)",
              flush=True)
        reported: set[str] = set()
        while not stop["flag"]:
            time.sleep(0.2)
            if cluster.procs["gateway"].poll() is not None:
                print("moepipe: the gateway exited; stopping", file=sys.stderr)
                return 1
            for name, p in cluster.procs.items():
                if p.poll() is not None and name not in reported:
                    # Keep serving /health (503 naming it) so operators and clients see what failed.
                    print(f"moepipe: {name} exited with {p.returncode}; /health now reports it", file=sys.stderr)
                    reported.add(name)
        return 0
    except RuntimeError as exc:
        print(f"moepipe serve: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
