"""`moepipe serve`: start the PLE service, the stage workers and the gateway on this machine, wait until /health
answers 200, print the URL, restart a stage or the PLE service that dies, forward Ctrl-C / SIGTERM and leave no
process behind.

Each process is the same program an operator runs alone from the cluster config (see deploy/), so the one-command
path and the systemd path cannot drift apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.cluster_config import (GPU_MAX_NUM_BATCHED_TOKENS, ClusterConfig, ClusterConfigError, StageSpec,
                                  child_environment, dump_toml, env_overrides, split_layers, unknown_keys)
from shared.cold_set import AUTO
from shared.quant_scheme import refusal as quant_refusal
from shared.memory_plan import (AUTO_OFFLOAD_LEN, GIB, DeviceMemory, MemoryPlan, MemoryPlanError, PlanLimits,
                                 StageNeeds, fit_max_model_len, host_bytes_to_fit, host_kv_room)
from shared.model_config import Qwen4ExpConfig, load_config
from shared.sampling import read_generation_config
from shared.parent_watch import RESTARTS_ENV

STABLE_SECONDS = 600.0      # a component up this long has its restart count reset
MAX_BACKOFF = 30.0
PLAN_SEND_TIMEOUT = 2.0     # gateway/cluster_executor.py: the engine core's send to a gone component gives up then


@dataclass
class ServeOptions:
    model: Path
    stages: int = 1
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: Path | None = None
    extra: dict | None = None            # any other ClusterConfig field
    startup_timeout: float | None = None  # None: the cluster's start_timeout (MOEPIPE_START_TIMEOUT, 300 s)
    verbose: bool = False


def build_cluster_config(opts: ServeOptions, run_dir: Path) -> ClusterConfig:
    cfg = load_config(opts.model)
    if (opts.extra or {}).get("load_format", "safetensors") != "dummy":
        why = quant_refusal(opts.model)
        if why:
            raise ValueError(why)
    ipc = lambda name: f"ipc://{run_dir / (name + '.sock')}"          # noqa: E731
    devices = [opts.device] * opts.stages
    if opts.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("--device cuda: no CUDA device is visible")
        # One GPU per stage when there are enough; otherwise stages share GPUs round-robin.
        devices = [f"cuda:{i % count}" for i in range(opts.stages)]
        if opts.stages > count:
            # Stages on one GPU add no memory and take turns on it: said once, since nobody would choose it knowingly
            print(f"moepipe: --stages {opts.stages} on {count} visible GPU(s): stages sharing a GPU take turns on it "
                  f"and hand activations between processes, so they serve fewer tokens a second than one stage "
                  f"there (H200, two stages of one GPU: 78% of one stage's tokens a second, docs/performance.md); "
                  f"use --stages {count} unless you are measuring the pipeline", file=sys.stderr)
    stages = [StageSpec(start=s, end=e, endpoint=ipc(f"stage{i}"), device=devices[i])
              for i, (s, e) in enumerate(split_layers(cfg.num_hidden_layers, opts.stages))]
    extra = {**env_overrides(), **(opts.extra or {})}        # command-line flags win over the environment
    if opts.device == "cuda":
        extra.setdefault("max_num_batched_tokens", GPU_MAX_NUM_BATCHED_TOKENS)
    has_ple = isinstance(cfg, Qwen4ExpConfig) and bool(cfg.ple_layer_ids)
    use_service = extra.pop("ple_service", True) and has_ple     # popped either way: a field set below
    unknown = unknown_keys(extra)
    if unknown:                                   # a benchmark's --set or a typo: name it, not a TypeError
        known = sorted(f.name for f in dataclasses.fields(ClusterConfig))
        raise ClusterConfigError(f"unknown cluster config key(s) {', '.join(map(repr, unknown))}; known: "
                                 f"{', '.join(known)}")
    cluster = ClusterConfig(model=str(Path(opts.model).resolve()), stages=stages,
                            gateway_endpoint=ipc("gateway"), host=opts.host, port=opts.port,
                            ple_endpoint=ipc("ple") if use_service else "",
                            ple_ring=str(_shm_dir() / f"moepipe-ple-{os.getpid()}-{opts.port}.ring")
                            if use_service else "",
                            ple_service=use_service, **extra)
    sized = cluster.for_model(cfg)         # cluster.toml carries the derived KV sizes: every process reads them
    if sized.max_model_len and not cluster.max_model_len:
        # an explicit --num-blocks shorter than the model's length shortens an unset max_model_len to what the pool
        # holds (ClusterConfig.for_model); said here, as the GPU plan says its fitted length: `--num-blocks 1` served
        # a 16-token context without a word, and every longer prompt got a 400
        full = cluster.model_len(cfg)
        print(f"moepipe: --num-blocks {sized.num_blocks} x block size {sized.block_size} holds {sized.max_model_len} "
              f"tokens, less than the model's {full}: "
              f"serving max_model_len {sized.max_model_len} (raise --num-blocks to "
              f"{-(-full // sized.block_size)} for the model's length, or set "
              f"--max-model-len)", file=sys.stderr)
    return sized


def plan_inputs(cluster: ClusterConfig, config_path: Path) -> tuple[list[StageNeeds], dict[str, DeviceMemory],
                                                                    PlanLimits]:
    """The GPU stages' needs and the devices' free memory, from a child process (`stage_worker.memory_needs`):
    asking CUDA creates a context this process would keep; and the limits the flags set."""
    r = subprocess.run([sys.executable, "-m", "stage_worker.memory_needs", "--config", str(config_path)],
                       capture_output=True, text=True, timeout=600, env=child_environment(dict(os.environ)))
    if r.returncode != 0:
        raise RuntimeError(f"memory plan: {r.stderr.strip() or 'stage_worker.memory_needs failed'}")
    data = json.loads(r.stdout)
    needs = [StageNeeds(**{**n, "layers": tuple(n["layers"])}) for n in data["stages"]]
    devices = {k: DeviceMemory(**v) for k, v in data["devices"].items()}
    limits = PlanLimits(block_size=cluster.block_size, max_model_len=cluster.model_len(load_config(cluster.model)),
                        max_num_seqs=cluster.max_num_seqs,
                        gpu_memory_utilization=cluster.gpu_memory_utilization,
                        vram_limit=int(cluster.vram_limit * GIB),
                        kv_cache_memory_bytes=cluster.kv_cache_memory_bytes or int(cluster.kv_cache_memory * GIB),
                        host_kv_bytes=host_kv_room(data.get("host_available", 0), needs),
                        max_num_batched_tokens=cluster.max_num_batched_tokens)
    return needs, devices, limits


def memory_plan(cluster: ClusterConfig, config_path: Path) -> MemoryPlan:
    """The GPU stages' memory plan (shared/memory_plan.py), printed; RuntimeError with its refusal. With
    --max-model-len unset and the model's length too long for the KV room, the plan at the longest length that
    fits (`fit_max_model_len`, each candidate's needs measured again from a config file of that length), its line
    printed: the caller writes `result.max_model_len` into the cluster config every process reads."""
    def at(length: int):
        trial = dataclasses.replace(cluster, max_model_len=length)
        config_path.write_text(dump_toml(trial))
        return plan_inputs(trial, config_path)

    original = config_path.read_text() if config_path.is_file() else None
    try:
        result = fit_max_model_len(*plan_inputs(cluster, config_path), at, user_set=bool(cluster.max_model_len))
    except MemoryPlanError as exc:
        raise RuntimeError(f"the model does not fit: {exc}") from None
    finally:
        if original is not None:
            config_path.write_text(original)        # the trial lengths' files: the caller writes the chosen one
    print(result.table(), file=sys.stderr)
    if result.fitted:
        print(result.fitted, file=sys.stderr)
    return result


def auto_cold_experts(cluster: ClusterConfig, config_path: Path, run_dir: Path) -> ClusterConfig:
    """`--cold-experts auto`: the least offload that lets the memory plan start (`host_bytes_to_fit`) at
    --max-model-len, or with it unset at AUTO_OFFLOAD_LEN tokens (then `memory_plan` fits the context), spread over
    each stage's MoE layers, the least used experts by the checkpoint's `route_usage.json` if it has one (written
    by `moepipe route-stats`), else the highest ids; the file goes to the run directory. Experts are counted at
    the size the stage holds them (`StageNeeds.expert_bytes`: INT4 experts kept packed at their packed size)."""
    from shared import cold_set

    cfg = load_config(cluster.model)
    if not any(s.device.startswith("cuda") for s in cluster.stages):
        # host RAM is all there is: nothing to move (said, as every other GPU-only flag on a CPU cluster is)
        print("moepipe: --cold-experts auto: the cluster runs on the CPU, where every expert is in host RAM "
              "already; none moved (add --device cuda)", file=sys.stderr)
        return dataclasses.replace(cluster, cold_experts="")
    probe = cluster
    if not cluster.max_model_len:
        # unset: experts out for AUTO_OFFLOAD_LEN tokens, and memory_plan then fits the context to what is left
        probe = dataclasses.replace(cluster, max_model_len=min(cfg.max_position_embeddings, AUTO_OFFLOAD_LEN))
        config_path.write_text(dump_toml(probe))         # the needs process reads the length from the file
    try:
        inputs = plan_inputs(probe, config_path)
        need = host_bytes_to_fit(*inputs)
    except MemoryPlanError as exc:
        raise RuntimeError(f"the model does not fit: {exc}") from None
    stages = [(s.start, s.end) for s in cluster.stages]
    usage_file = Path(cluster.model) / "route_usage.json"
    scores = None
    if usage_file.is_file():        # `moepipe route-stats` output beside the checkpoint: this model's, or named
        try:
            scores = cold_set.kind_normalised(json.loads(usage_file.read_text())["usage"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise cold_set.ColdSetError(f"{usage_file}: not a route_usage.json ({type(exc).__name__}: {exc}); "
                                        f"rerun `moepipe route-stats` or remove it") from None
        cold_set.check_scores(scores, cfg, f"{usage_file} (rerun `moepipe route-stats` or remove it)")
    # one expert as each stage holds it: an INT4 checkpoint's experts kept packed at their packed size (the needs
    # say), else the compute dtype's
    sizes = {n.stage: n.expert_bytes for n in inputs[0] if n.expert_bytes}
    per_expert = [sizes.get(i) or cold_set.expert_bytes(cfg, cluster.dtype or None) for i in range(len(stages))]
    cold = cold_set.spread(cfg, stages, [need.get(i, 0) for i in range(len(stages))], per_expert, scores)
    out = cold_set.write(run_dir / "cold_experts.json", cfg, cluster.model, cold, stages, per_expert,
                         max(need.values(), default=0), ["route_usage.json" if scores else "highest ids"])
    n = sum(len(ids) for ids in cold.values())
    host = sum(size * len(ids) for (s, e), size in zip(stages, per_expert) for layer, ids in cold.items()
               if s <= layer < e)
    how = f"the least used by {usage_file}" if scores else \
        "no route_usage.json beside the checkpoint: the highest ids, moves re-place them"
    print(f"moepipe: --cold-experts auto: {n} experts ({host / GIB:.2f} GiB) in host RAM ({how})"
          + ("" if cluster.max_model_len else f", enough for a {probe.max_model_len}-token context with --max-model-len"
             " unset (the context is fitted to the memory left; a longer --max-model-len moves more experts out)"),
          file=sys.stderr)
    return dataclasses.replace(cluster, cold_experts=str(out))


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


def ple_stage_indices(cluster: ClusterConfig) -> list[int]:
    """The stages holding a PLE layer (they map the PLE service's ring)."""
    layers = [i - 1 for i in getattr(load_config(cluster.model), "ple_layer_ids", None) or []]
    return [k for k, s in enumerate(cluster.stages) if any(s.start <= layer < s.end for layer in layers)]


def check_port_free(host: str, port: int) -> None:
    """Refuse to start on a port something already listens on (an orphaned server would answer our health probe
    and we would report serving while it does)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise RuntimeError(f"port {port} on {host} is already in use (another moepipe serve?); "
                                   f"stop it or pass --port") from None
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets (`http://[::1]:8000`), as a URL must write it."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


RUN_DIR_PREFIX = "moepipe-"
# the launcher tells the gateway that a dead component will not be restarted (gateway/main.py: EngineCore.give_up)
GIVEN_UP_SIGNAL = signal.SIGUSR1
LAUNCHER_PID = "launcher.pid"


def remove_stale_run_dirs() -> list[Path]:
    """Remove the run directories of launchers that died without cleaning up (SIGKILL, OOM: the children go with
    them, `shared/parent_watch.py`, but the directory stayed, its cluster.toml holding the API key): this user's
    `moepipe-*` directories whose `launcher.pid` names no live process. Returns what was removed."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.getuid() or not d.is_dir():
                continue
            pid = int((d / LAUNCHER_PID).read_text())
        except (OSError, ValueError):
            continue                  # not ours, or from before launcher.pid (left alone: no way to tell)
        try:
            os.kill(pid, 0)
            continue                  # its launcher runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue                  # a live process of another user has that pid
        left = _left_by(pid, d / "cluster.toml")
        for child in left:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        if left:
            print(f"moepipe: killed {len(left)} process(es) (pid {', '.join(map(str, left))}) that the dead launcher "
                  f"{pid} left running (stopped when it died?)", file=sys.stderr)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _left_by(launcher_pid: int, config: Path) -> list[int]:
    """This user's processes still running a component of a dead launcher's cluster: `--parent-pid` naming it and
    its run directory's config on their command line. The parent-death signal ends them (`shared/parent_watch.py`),
    except one that could not take it: stopped when the launcher died (SIGSTOP, a debugger), whose SIGTERM stays
    pending and whose watch thread is frozen with it, for ever."""
    found = []
    want = [b"--parent-pid", str(launcher_pid).encode()]
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return found                 # no /proc: nothing to find
    for e in entries:
        try:
            if e.stat().st_uid != os.getuid():
                continue
            args = (e / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in args and any(args[i:i + 2] == want for i in range(len(args) - 1)):
            found.append(int(e.name))
    return found


class Cluster:
    """The child processes of one `serve`; a context manager that always cleans up."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self._tmp = None
        if opts.run_dir is None:
            remove_stale_run_dirs()
            # (a file a stopping child removes meanwhile must not turn a clean stop into an OSError: exit 1)
            self._tmp = tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX, ignore_cleanup_errors=True)
            self.run_dir = Path(self._tmp.name)
            (self.run_dir / LAUNCHER_PID).write_text(str(os.getpid()))
        else:
            self.run_dir = Path(opts.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = build_cluster_config(opts, self.run_dir)
        # what the gateway reads at its start, checked before any stage spends minutes loading weights
        self.cluster.load_tokenizer()
        read_generation_config(self.cluster.model)
        self.config_path = self.run_dir / "cluster.toml"
        self.config_path.write_text(dump_toml(self.cluster))
        if self.cluster.cold_experts == AUTO:
            self.cluster = auto_cold_experts(self.cluster, self.config_path, self.run_dir)
            self.config_path.write_text(dump_toml(self.cluster))
        if any(s.device.startswith("cuda") for s in self.cluster.stages) and not (opts.extra or {}).get("num_blocks"):
            # a minute on a GPU's first start (the child compiles and runs a prefill chunk to measure its peak)
            print("moepipe: measuring the stages' memory needs for the memory plan", file=sys.stderr, flush=True)
            self.plan = memory_plan(self.cluster, self.config_path)
            # a fitted length (--max-model-len unset) reaches the gateway, engine core and stages as a set one would
            fitted = {"max_model_len": self.plan.max_model_len} if self.plan.fitted else {}
            self.cluster = dataclasses.replace(self.cluster, num_blocks=self.plan.num_blocks, **fitted)
            self.config_path.write_text(dump_toml(self.cluster))
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands = dict(commands(self.cluster, self.config_path, opts.verbose))
        self.started_at: dict[str, float] = {}
        self.restarts: dict[str, int] = {}

    @property
    def url(self) -> str:
        return http_url(self.cluster.host, self.cluster.port)

    def start(self) -> None:
        check_port_free(self.cluster.host, self.cluster.port)
        for name in self.commands:
            self._spawn(name)

    def _spawn(self, name: str) -> None:
        env = {**child_environment(dict(os.environ)), "PYTHONUNBUFFERED": "1",
               RESTARTS_ENV: str(self.restarts.get(name, 0))}
        # A new session per child: Ctrl-C in the terminal reaches only us, and we stop them in order.
        self.procs[name] = subprocess.Popen(self.commands[name], env=env, start_new_session=True)
        self.started_at[name] = time.time()

    def restart(self, name: str) -> list[str]:
        """Start `name` again; returns what else had to be restarted with it. A new PLE service writes a new ring,
        which the stages holding PLE layers map only at start: they are restarted too. A new gateway is a new
        engine core, whose plans the old stages' state would not match: everything is restarted with it."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        also = []
        if name == "gateway":
            also = [n for n in self.procs if n != "gateway"]
            self._terminate(also)
            if self.cluster.ple_ring:
                Path(self.cluster.ple_ring).unlink(missing_ok=True)
        elif name == "ple":
            Path(self.cluster.ple_ring).unlink(missing_ok=True)     # stages then wait for the new one
            also = [f"stage{i}" for i in ple_stage_indices(self.cluster)]
            self._terminate(also)
        self._spawn(name)
        for other in also:
            self._spawn(other)
        return also

    def down_components(self) -> list[str] | None:
        """What the gateway's `/health` names as missing its heartbeat deadline: [] when it answers 200, None when
        it does not answer (not up yet, or gone). `/health` needs no key and no Host check (gateway/access.py)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return [] if r.status == 200 else None
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                return None
            try:
                down = json.loads(exc.read())["down"]       # gateway/api.py's /health: the components it misses
            except (ValueError, KeyError, TypeError, OSError):
                return None
            return [str(n) for n in down] if isinstance(down, list) else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_healthy(self, should_stop=lambda: False) -> None:
        timeout = self.opts.startup_timeout if self.opts.startup_timeout is not None else self.cluster.start_timeout
        deadline = time.time() + timeout if timeout else float("inf")
        while time.time() < deadline:
            if should_stop():
                raise RuntimeError("stopped during start-up")
            # Health first: once every component has heartbeated the cluster is up, and a process that dies from
            # then on is the supervisor's (a client can be served, and kill a stage, before this loop looks again).
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"{', '.join(f'{n} exited with {c}' for n, c in dead.items())} during start-up")
            time.sleep(0.2)
        down = self.down_components()
        missing = (f"{', '.join(down)} sent no heartbeat" if down else
                   "the gateway does not answer /health" if down is None else "")
        raise RuntimeError(f"cluster not healthy after {timeout:g} s (start_timeout, MOEPIPE_START_TIMEOUT)"
                           + (f": {missing}" if missing else ""))

    def _terminate(self, names: list[str], timeout: float = 10.0) -> None:
        """SIGTERM to each of `names` (in that order, without pausing), then up to `timeout` s in all for them to
        end; whatever is left is SIGKILLed."""
        procs = [self.procs[n] for n in names if n in self.procs]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                # then SIGCONT, as systemd does: a stopped child (kill -STOP, a debugger) keeps SIGTERM pending and
                # was only SIGKILLed after the whole `timeout`; resumed, it ends cleanly at once
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
        deadline = time.time() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop(self, timeout: float = 10.0) -> None:
        self._terminate(["gateway"] + [n for n in self.procs if n.startswith("stage")] + ["ple"], timeout)
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
    # the terminal or ssh session that ran us closed: stop as on SIGTERM. Its default killed us without cleanup (the
    # children went with us, but the run directory stayed, its cluster.toml holding the API key). Left ignored under
    # nohup, which asks for just that.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_signal)
    try:
        cluster = Cluster(opts)          # the memory plan's refusal is a RuntimeError with the numbers
    except RuntimeError as exc:
        print(f"moepipe serve: {exc}", file=sys.stderr)
        return 1
    gateway_watch = None
    try:
        cluster.start()
        print(f"moepipe: starting {cluster.cluster.num_stages} stage(s)"
              f"{' + PLE service' if cluster.cluster.ple_service else ''} for {opts.model}", file=sys.stderr)
        cluster.wait_healthy(lambda: stop["flag"])
        print(f"moepipe: serving {cluster.cluster.served_model_name} at {cluster.url}/v1  (Ctrl-C stops)",
              flush=True)
        watch = Supervisor(cluster)
        gateway_watch = GatewayWatch(cluster)        # (a hung gateway: the Supervisor sees only deaths)
        while not stop["flag"]:
            time.sleep(0.2)
            gateway_watch.check()
            watch.check()
            if watch.given_up:
                return watch.exit_given_up(lambda: stop["flag"])
        return 0
    except RuntimeError as exc:
        print(f"moepipe serve: {exc}", file=sys.stderr)
        # a stop asked for during start-up (SIGTERM, Ctrl-C) is a clean stop, not a failure: the launcher can
        # still be in its own /health wait when clients already see 200
        return 0 if stop["flag"] else 1
    finally:
        if gateway_watch is not None:
            gateway_watch.stop()
        cluster.stop()


class Supervisor:
    """Restarts a stage, the PLE service or the gateway that died, `restart_limit` times in a row with exponential
    backoff (1, 2, 4 ... 30 s); a component that stayed up STABLE_SECONDS starts its count again. The engine core
    recomputes the requests that were running on a dead stage or PLE service (their streams pause); `/health` is
    503 naming it until it heartbeats again. A dead gateway takes the engine core and every connection with it: the
    whole cluster is restarted (`Cluster.restart`).

    A restarted process must be heard from within `start_timeout` (the gateway's `/health` stops naming it), else it
    is killed, which counts as a failed restart: one hung while loading was never killed before, since the gateway's
    hang check needs a heartbeat from the process (its pid) first. Once a component's restarts are used up, `serve`
    exits with status 1 (`exit_given_up`), as vLLM's server exits when its engine dies: a service manager (systemd,
    Docker, Kubernetes) can then restart the whole server, where before it kept answering `/health` 503 forever."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.limit = cluster.cluster.restart_limit
        self.due: dict[str, float] = {}            # component -> when to restart it
        self.given_up: dict[str, str] = {}         # component -> why (the exit line names it)
        self.starting: dict[str, object] = {}      # restarted components not yet heard from -> their process
        self.start_killed: set = set()              # ... and those of them killed for it (once each)
        self.probe = cluster.down_components       # /health's missing components

    def check(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        c = self.cluster
        self._check_starting(now)
        for name, p in list(c.procs.items()):
            if p.poll() is None or name in self.given_up or c.procs.get(name) is not p:
                continue               # (or a restart earlier in this pass replaced it: the PLE service's stages)
            if name != "gateway" and name not in self.due and c.procs["gateway"].poll() is not None:
                continue               # the gateway's restart brings everything back
            if name not in self.due:
                # never heard from, it was not up: its count goes on (a restart hung past STABLE_SECONDS included)
                came_up = self.starting.pop(name, None) is not p
                if came_up and now - c.started_at.get(name, now) >= STABLE_SECONDS:
                    c.restarts[name] = 0
                tries = c.restarts.get(name, 0)
                if tries >= self.limit:
                    print(f"moepipe: {name} exited with {p.returncode}; not restarting it ({tries} "
                          f"restart{'' if tries == 1 else 's'}, restart_limit {self.limit}); stopping", file=sys.stderr)
                    self.given_up[name] = (f"{name} exited with {p.returncode} and its restarts are used up "
                                           f"({tries} restart{'' if tries == 1 else 's'} in a row, restart_limit "
                                           f"{self.limit}{': restarts off' if not self.limit else ''})")
                    gateway = c.procs.get("gateway")
                    if name != "gateway" and gateway is not None and gateway.poll() is None:
                        gateway.send_signal(GIVEN_UP_SIGNAL)     # its requests fail now, not after recovery_timeout
                    continue
                delay = min(MAX_BACKOFF, 2.0 ** tries)
                print(f"moepipe: {name} exited with {p.returncode}; restarting it in {delay:.0f} s", file=sys.stderr)
                self.due[name] = now + delay
            elif now >= self.due[name]:
                del self.due[name]
                also = c.restart(name)
                for other in also:
                    self.due.pop(other, None)
                for started in (name, *also):
                    self.starting[started] = c.procs[started]
                print(f"moepipe: restarted {name}{' with ' + ', '.join(also) if also else ''}", file=sys.stderr)

    def _check_starting(self, now: float) -> None:
        """Restarted components heard from (the gateway's `/health` does not name them, asked once their
        predecessor's last heartbeats are past `heartbeat_timeout`, so only the new process can account for it)
        are up; one not heard from within `start_timeout` of its start is SIGKILLed (the death is then handled as
        any: restarted with backoff, or given up, its restart counted)."""
        c = self.cluster
        timeout, fresh = c.cluster.start_timeout, c.cluster.heartbeat_timeout
        waiting = {n: p for n, p in self.starting.items() if c.procs.get(n) is p and p.poll() is None
                   and p not in self.start_killed}
        if not waiting:
            return
        down = None
        if any(now - c.started_at.get(n, now) > fresh for n in waiting):
            down = self.probe()
        for name, p in waiting.items():
            age = now - c.started_at.get(name, now)
            if down is not None and name not in down and age > fresh:
                del self.starting[name]          # heard from: up (a later hang is the gateway's hang_timeout)
            elif timeout and age > timeout:
                if name != "gateway" and "gateway" in waiting:
                    continue                     # heard through the gateway: its restart brings them all back
                print(f"moepipe: {name} (pid {p.pid}) sent no heartbeat within {timeout:g} s of its restart "
                      f"(start_timeout, MOEPIPE_START_TIMEOUT): killing it, a failed restart", file=sys.stderr)
                self.start_killed.add(p)
                p.kill()

    def exit_given_up(self, should_stop=lambda: False) -> int:
        """`serve`'s end once a component's restarts are used up: the gateway was told (GIVEN_UP_SIGNAL) and ends
        the running streams with an error event naming the component once it misses its heartbeat deadline
        (`/health` names it) and its watchdog has passed twice (the first pass may requeue the running requests
        and send the dead component a plan, which waits PLAN_SEND_TIMEOUT; the next fails them); that long is
        waited for, so the streams end with that error and not the shutdown's. Then one line names the component
        and its restarts, and the caller stops the cluster and exits 1."""
        c = self.cluster
        if "gateway" not in self.given_up:
            beat = c.cluster.heartbeat_interval
            after_named = 2 * beat + PLAN_SEND_TIMEOUT + 0.5
            deadline = time.time() + c.cluster.heartbeat_timeout + beat + after_named
            named = False
            gateway = c.procs.get("gateway")
            while time.time() < deadline and not should_stop() and gateway is not None and gateway.poll() is None:
                if not named and set(self.probe() or ()) & set(self.given_up):
                    named = True
                    deadline = min(deadline, time.time() + after_named)
                time.sleep(0.1)
        print(f"moepipe serve: exiting with status 1: {'; '.join(self.given_up.values())}. The server no longer "
              f"serves; a service manager (systemd Restart=on-failure, Docker, Kubernetes) may start it again",
              file=sys.stderr, flush=True)
        return 1


class GatewayWatch:
    """Kills a gateway that stopped answering: the gateway kills a stage or the PLE service that stops heartbeating
    (`hang_timeout`), but nothing watched the gateway itself, so a stopped or deadlocked gateway left every stream
    hanging on an open connection and `/health` unanswered for ever. A thread asks its `/health` every
    PROBE_INTERVAL s (any HTTP answer, 200 or 503, is one); a gateway that answered once and then nothing for
    `hang_timeout` s is SIGKILLed, and the `Supervisor` handles that death as any gateway death (the cluster
    restarted, or given up). A gateway not yet heard from is the `Supervisor`'s start deadline's. A gap in the
    thread's own turns (the launcher frozen with the rest: SIGSTOP of every process, a suspended VM) restarts the
    count, as the engine core's heartbeat deadlines do."""

    PROBE_INTERVAL = 1.0

    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.timeout = cluster.cluster.hang_timeout
        # the gateway process the time below is of: the one that has just answered the launcher's start-up wait
        self.proc = cluster.procs.get("gateway")
        self.answered: float | None = time.monotonic()     # its last answer (None: a restart not yet heard from)
        self.lock = threading.Lock()
        self.done = threading.Event()
        if self.timeout:
            threading.Thread(target=self._probe, name="gateway-watch", daemon=True).start()

    def stop(self) -> None:
        self.done.set()

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.cluster.url + "/health", timeout=max(1.0, self.timeout / 2)):
                return True
        except urllib.error.HTTPError:
            return True                  # 503: it answers (a component down is the Supervisor's)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _probe(self) -> None:
        last_turn = time.monotonic()
        while not self.done.wait(self.PROBE_INTERVAL):
            proc = self.cluster.procs.get("gateway")
            answered = proc is not None and proc.poll() is None and self._answers()
            now = time.monotonic()
            with self.lock:
                if now - last_turn > self.PROBE_INTERVAL + max(1.0, self.timeout / 2) + 2.0:
                    if self.answered is not None:
                        self.answered = now      # we were frozen too: the silence is not the gateway's alone
                if proc is not self.proc:
                    self.proc, self.answered = proc, None
                if answered:
                    self.answered = now
            last_turn = now

    def check(self) -> bool:
        """Kill the gateway if it answered once and then not for `hang_timeout` s; True if it was killed."""
        with self.lock:
            proc, answered = self.proc, self.answered
            if (not self.timeout or proc is None or answered is None or proc is not self.cluster.procs.get("gateway")
                    or proc.poll() is not None or time.monotonic() - answered <= self.timeout):
                return False
            self.answered = None
        print(f"moepipe: gateway (pid {proc.pid}) has not answered /health for {self.timeout:g} s (hang_timeout, "
              f"MOEPIPE_HANG_TIMEOUT): killing it; the cluster restarts", file=sys.stderr, flush=True)
        proc.kill()
        return True
