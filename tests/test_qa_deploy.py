"""The environments `moepipe serve` is started in: a small or full /dev/shm (Docker's 64 MiB), a server killed
outright, two servers on one host, a read-only model directory or MOEPIPE_HOME, an unusable TMPDIR or HOME, and the
deploy/ files. Each failure must be one line naming the problem and what to do: never a traceback, a SIGBUS or a
hang. Real processes; what this machine cannot simulate (no root, no mount namespaces) is skipped."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, free_port, stop_server, wait_healthy
from shared.ple_ring import GatherRing, RingError, remove_stale_rings, ring_bytes

RING = dict(slots=4, max_tokens=64, layers=1, heads=8, head_dim=8, dtype=torch.float32)   # 32 KiB + header


def _root() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the block (root only; skipped where mounting is refused)."""
    path.mkdir(parents=True, exist_ok=True)
    if not _root() or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _can_unshare() -> bool:
    return _root() and shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEPIPE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _serve(args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "shared.cli", "serve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _refusal(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The stderr of a serve that must refuse to start: it exits non-zero within `timeout` s, without a traceback."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"serve did not refuse within {timeout:.0f} s (a hang)")
    assert proc.returncode not in (0, None), err
    assert "Traceback" not in err and "Bus error" not in err, err
    return err


def _complete(port: int, prompt: str = "Hello", max_tokens: int = 4) -> str:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, verify=False,
                   json={"model": "moepipe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ---- the ring on a small tmpfs -----------------------------------------------------------------------------------
def test_a_ring_larger_than_the_free_shared_memory_is_refused_at_creation_naming_the_room(tmp_path):
    """A sparse ring on a 1 MiB tmpfs mapped fine and SIGBUSed the PLE service at its first long prompt (-7, five
    restarts, serve gone after a minute): now creating it fails, naming the sizes and Docker's --shm-size."""
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        with pytest.raises(RingError, match=r"needs 2\.0 MiB of shared memory and .* has 1\.0 MiB free .*--shm-size"
                                             r".*--max-num-batched-tokens.*--no-ple-service"):
            GatherRing.create(shm / "r.ring", **{**RING, "max_tokens": 2048})
        assert list(shm.iterdir()) == []               # no temporary file left taking the room
        assert ring_bytes(**{**RING, "max_tokens": 2048}) == 4096 + 4 * 2048 * 8 * 8 * 4


def test_a_ring_on_a_tmpfs_filled_after_it_was_made_is_written_whole_without_sigbus(tmp_path):
    """Every page of the ring is allocated at creation: a tmpfs filled up afterwards (another server, a leak) cannot
    SIGBUS the service when it first writes a slot's later pages. In a child process: a SIGBUS there fails the test,
    not the run."""
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        code = f"""
import torch
from shared.ple_ring import GatherRing
ring = GatherRing.create({str(shm / 'r.ring')!r}, slots=4, max_tokens=256, layers=1, heads=8, head_dim=8,
                         dtype=torch.float32)
with open({str(shm / 'filler')!r}, 'wb', buffering=0) as f:
    try:
        while True:
            f.write(b'x' * 65536)
    except OSError:
        pass
for i in range(ring.slots):
    ring.slot(i).fill_(float(i + 1))
assert float(ring.slot(3).sum()) == 4 * 256 * 64
print('ok')
"""
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


# ---- stale rings, reuse, two services on one path ---------------------------------------------------------------
def test_rings_left_by_killed_launchers_are_removed_and_live_ones_kept(tmp_path):
    live = GatherRing.create(tmp_path / "moepipe-ple-1-8000.ring", **RING)     # its service lives: kept
    dead = GatherRing.create(tmp_path / "moepipe-ple-2-8001.ring", **RING)
    dead.close()                                                               # its service died: stale
    old_tmp = tmp_path / "moepipe-ple-3-8002.ring.tmp77"
    old_tmp.write_bytes(b"x")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    young_tmp = tmp_path / "moepipe-ple-4-8003.ring.tmp78"                    # a service making it now
    young_tmp.write_bytes(b"x")
    other = tmp_path / "moepipe-ple.ring"                                       # a config's own name: not ours
    other.write_bytes(b"x")
    try:
        assert sorted(p.name for p in remove_stale_rings(tmp_path)) == [dead.path.name, old_tmp.name]
        assert live.path.exists() and young_tmp.exists() and other.exists()
        # and a new service removes them itself before it takes its room
        dead2 = GatherRing.create(tmp_path / "moepipe-ple-5-8004.ring", **RING)
        dead2.close()
        fresh = GatherRing.create(tmp_path / "moepipe-ple-6-8005.ring", **RING)
        assert not dead2.path.exists() and live.path.exists()
        fresh.close()
    finally:
        live.close()


def test_a_restarted_service_reuses_its_stale_ring_so_a_stage_still_mapping_it_reads_the_new_rows(tmp_path):
    """systemd restarts the PLE service alone (or a stage first): the stage's mapping of the old ring must see what
    the new service writes. Another shape replaces the file; a ring a live service holds is refused."""
    path = tmp_path / "moepipe-ple.ring"
    first = GatherRing.create(path, **RING)
    stage = GatherRing.open(path)
    first.close()                                          # the service died; the stage keeps its mapping
    second = GatherRing.create(path, **RING)
    try:
        second.slot(1).fill_(7.0)
        assert torch.all(stage.slot(1) == 7.0)             # same inode: the stage reads the new service's rows
        with pytest.raises(RingError, match="another live PLE service holds this ring"):
            GatherRing.create(path, **RING)
        with pytest.raises(RingError, match="another live PLE service holds this ring"):
            GatherRing.create(path, **{**RING, "slots": 6})
    finally:
        second.close()
        stage.close()
    other = GatherRing.create(path, **{**RING, "slots": 6})
    assert other.slots == 6 and GatherRing.open(path).slots == 6
    other.close()


def test_a_stage_waits_for_a_live_service_instead_of_mapping_a_stale_ring(tmp_path):
    path = tmp_path / "r.ring"
    GatherRing.create(path, **RING).close()                 # stale: its service is gone
    t0 = time.monotonic()
    with pytest.raises(RingError, match="no live PLE service holds this ring"):
        GatherRing.open(path, wait=0.3)
    assert time.monotonic() - t0 < 5
    made = []
    timer = threading.Timer(0.3, lambda: made.append(GatherRing.create(path, **{**RING, "slots": 5})))
    timer.start()
    try:
        ring = GatherRing.open(path, wait=10)
        assert ring.slots == 5                               # the live service's ring, not the stale one
        ring.close()
    finally:
        timer.join()
        for r in made:
            r.close()


def _in_small_shm(size: str) -> list[str]:
    """A command prefix running the rest in a private mount namespace whose /dev/shm is a tmpfs of `size`."""
    if not _can_unshare():
        pytest.skip("needs root and mount namespaces (unshare -m) to give the server a small /dev/shm")
    return ["unshare", "-m", "sh", "-c",
            f'mount --make-rprivate / && mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh"]


def test_serve_with_a_docker_sized_dev_shm_too_small_for_the_ring_refuses_in_one_line(tiny_checkpoint):
    """As vLLM tells Docker users to pass --shm-size: the ring (2 MiB here: 4 slots x 2048 tokens of the tiny
    model's PLE rows) does not fit a 1 MiB /dev/shm, and serve says so at start instead of serving until the first
    long prompt SIGBUSes the PLE service."""
    proc = _serve([str(tiny_checkpoint), "--port", str(free_port()), "--max-num-batched-tokens", "2048"], _env(),
                  prefix=_in_small_shm("1m"))
    err = _refusal(proc)
    assert re.search(r"the PLE gather ring needs \d+\.\d MiB of shared memory and /dev/shm has 1\.0 MiB free.*"
                     r"--shm-size", err), err


# ---- a read-only model directory, MOEPIPE_HOME -------------------------------------------------------------------
@contextlib.contextmanager
def read_only(path: Path):
    """`path` read-only for this user's processes: mode 555 as a user, a read-only bind mount as root (skipped where
    mounting is refused)."""
    if not _root():
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(mode)
        return
    for cmd in (["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,bind,ro", str(path)]):
        r = subprocess.run(cmd, capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", str(path)], capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ple_table.*"))
    return dst


def test_a_read_only_model_directory_serves_with_its_ple_table_expanded_under_moepipe_home(tiny_checkpoint,
                                                                                               tmp_path):
    """A model on a read-only volume (or another user's): the PLE service's lock file beside the table was a
    PermissionError traceback in the service and the stage. Now the expansion goes under MOEPIPE_HOME."""
    model, home = _copy(tiny_checkpoint, tmp_path / "model"), tmp_path / "home"
    port = free_port()
    with read_only(model):
        proc = _serve([str(model), "--port", str(port)], _env(MOEPIPE_HOME=str(home)))
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=90)
            assert _complete(port)
        finally:
            stop_server(proc)
        assert not list(model.glob("ple_table.*"))
    [table] = (home / "ple_tables").glob("model-*/ple_table.layer*.bin")
    assert (table.parent / (table.name + ".json")).is_file()


def test_a_read_only_model_directory_and_moepipe_home_refuse_in_one_line(tiny_checkpoint, tmp_path):
    model = _copy(tiny_checkpoint, tmp_path / "model")
    with read_only(model):
        proc = _serve([str(model), "--port", str(free_port())], _env(MOEPIPE_HOME=str(model / "home")))
        err = _refusal(proc)
    assert re.search(r"cannot write the expanded PLE table of layer \d+ \(\d+\.\d MiB\) to .*set MOEPIPE_HOME to a "
                     r"writable directory", err), err


def test_a_read_only_model_directory_with_its_table_expanded_maps_it_in_place(tiny_checkpoint, tmp_path):
    """An image that ships the model with its expanded table on a read-only layer: opened where it is, without
    the lock file (that cannot be created there) and without a second copy under MOEPIPE_HOME."""
    from ple_service.tables import open_tables
    from shared.model_config import load_config

    model, home = _copy(tiny_checkpoint, tmp_path / "model"), tmp_path / "home"
    cfg = load_config(model)
    first = open_tables(model, cfg)
    rows = {layer: t.gather(torch.arange(5)) for layer, t in first.items()}
    for t in first.values():
        t.close()
    for lock in model.glob("ple_table.*.lock"):
        lock.unlink()
    with read_only(model):
        os.environ["MOEPIPE_HOME"], saved = str(home), os.environ.get("MOEPIPE_HOME")
        try:
            again = open_tables(model, cfg)
        finally:
            if saved is None:
                del os.environ["MOEPIPE_HOME"]
            else:
                os.environ["MOEPIPE_HOME"] = saved
        try:
            assert all(t.path.parent == model and torch.equal(t.gather(torch.arange(5)), rows[layer])
                       for layer, t in again.items())
        finally:
            for t in again.values():
                t.close()
    assert not home.exists()


def test_an_unreadable_weight_file_is_named_with_the_fix_not_called_missing(tiny_checkpoint, tmp_path):
    """safetensors writes its files mode 600 and words EACCES "No such file or directory": a model made by root and
    served by a service user read as missing. (As root: checked in a forked child that drops to nobody.)"""
    from shared.checkpoint_files import CheckpointError, open_safetensors

    model = _copy(tiny_checkpoint, tmp_path / "model")
    (model / "model.safetensors").chmod(0o600)
    if not _root():
        (model / "model.safetensors").chmod(0)
        with pytest.raises(CheckpointError, match=r"cannot read it \(Permission denied\); make the checkpoint "
                                                  r"readable"):
            open_safetensors(model / "model.safetensors")
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the child: never back into pytest
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                open_safetensors(model / "model.safetensors")
                msg = "opened"
            except CheckpointError as exc:
                msg = str(exc)
            os.write(write, msg.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    assert re.search(r"cannot read it \(Permission denied\); make the checkpoint readable", msg), msg


# ---- two servers on one host; one killed outright ---------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid, *(int(p) for p in out)]


def _gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for p in pids:
            try:
                os.kill(p, 0)
                status = Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]
                if status != "Z":
                    alive.append(p)
            except (ProcessLookupError, OSError):
                pass
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"processes {alive} outlived their killed launcher")


def test_two_servers_on_one_host_and_one_killed_outright_leave_the_other_serving_and_the_next_start_clean(
        tiny_checkpoint, tmp_path):
    """Two `moepipe serve` at once (one checkpoint, one MOEPIPE_HOME): own rings, run directories and sockets, a
    shared expanded table. One SIGKILLed with its children leaves its ring in /dev/shm and its run directory; the
    next start removes both and the other server serves throughout."""
    if shutil.which("pgrep") is None:
        pytest.skip("needs pgrep")
    (tmp_path / "tmp").mkdir()             # run directories of their own: no other test's server removes them
    env = _env(MOEPIPE_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"))
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    procs = [_serve([str(tiny_checkpoint), "--port", str(p)], env) for p in ports]
    late = None
    try:
        for proc, port in zip(procs, ports):
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=90)
        rings = [Path(f"/dev/shm/moepipe-ple-{proc.pid}-{port}.ring") for proc, port in zip(procs, ports)]
        if not all(r.exists() for r in rings):
            pytest.skip("the rings are not in /dev/shm here")
        runs = [d for d in (tmp_path / "tmp").glob("moepipe-*") if (d / "launcher.pid").is_file()
                and (d / "launcher.pid").read_text() == str(procs[0].pid)]
        assert len(runs) == 1
        assert [_complete(p) for p in ports]

        killed = _tree(procs[0].pid)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        procs[0].wait()
        _gone(killed)
        # nothing cleaned up: SIGKILL (the ring is in the host's /dev/shm: another server starting now may remove it)
        assert runs[0].exists()

        late = _serve([str(tiny_checkpoint), "--port", str(ports[0])], env)
        wait_healthy(f"http://127.0.0.1:{ports[0]}", late, timeout=90)
        assert not rings[0].exists() and not runs[0].exists()
        assert rings[1].exists()                               # the live one's ring is kept
        assert _complete(ports[1]) and _complete(ports[0])
    finally:
        for proc in (*procs, late):
            if proc is not None and proc.poll() is None:
                stop_server(proc)


# ---- TMPDIR, HOME ------------------------------------------------------------------------------------------------
def test_no_writable_temporary_directory_is_refused_naming_tmpdir():
    """`docker run --read-only` without a tmpfs: tempfile's bare "No usable temporary directory" now says to set
    TMPDIR."""
    model = ROOT / "shared" / "demo_model"
    if not _can_unshare():
        pytest.skip("needs root and mount namespaces (unshare -m) to make every temporary directory read-only")
    if not (model / "model.safetensors").is_file():
        pytest.skip("no bundled demo model")
    # each temporary directory bound onto itself read-only (not an empty tmpfs over it: a checkout under /tmp, as
    # CI's clean clone is, must stay importable)
    prefix = ["unshare", "-m", "sh", "-c", "mount --make-rprivate / && for d in /tmp /var/tmp; do mount --bind $d $d "
              '&& mount -o remount,bind,ro $d; done && cd /tmp && exec "$@"', "sh"]
    err = _refusal(_serve([str(model), "--port", str(free_port())], _env(TMPDIR="/proc"), prefix=prefix))
    assert "No usable temporary directory" in err and "set TMPDIR to a writable directory" in err, err


def test_a_home_without_room_for_triton_s_cache_gets_a_private_one(tmp_path):
    """A GPU stage's first kernel compile writes ~/.triton/cache: with HOME=/ (docker run --user N) or a read-only
    home Triton raised PermissionError and the stage died. The launcher's children get TRITON_CACHE_DIR then, a
    directory only this user can write; a writable home, or TRITON_CACHE_DIR/TRITON_HOME set, are left alone."""
    from shared.cluster_config import child_environment

    home = tmp_path / "home"
    home.mkdir()
    assert "TRITON_CACHE_DIR" not in child_environment({"HOME": str(home)})
    with read_only(home):
        cache = child_environment({"HOME": str(home)})["TRITON_CACHE_DIR"]
        st = os.stat(cache)
        assert st.st_uid == os.getuid() and not st.st_mode & 0o077 and os.access(cache, os.W_OK)
        assert child_environment({"HOME": str(home), "TRITON_CACHE_DIR": "/x"})["TRITON_CACHE_DIR"] == "/x"
        assert "TRITON_CACHE_DIR" not in child_environment({"HOME": str(home), "TRITON_HOME": "/y"})
        assert child_environment({"HOME": str(home), "MOEPIPE_HOME": str(tmp_path / "mh")})["TRITON_CACHE_DIR"] \
            == str(tmp_path / "mh" / "triton")
    (home / ".triton" / "cache").mkdir(parents=True)            # an earlier run's cache this user cannot write
    with read_only(home / ".triton" / "cache"):
        assert "TRITON_CACHE_DIR" in child_environment({"HOME": str(home)})


# ---- deploy/ -----------------------------------------------------------------------------------------------------
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))


def test_the_systemd_units_run_components_with_flags_they_accept(capsys):
    """Every ExecStart is `python -m <component> ...` with flags that component's parser lists."""
    import importlib

    assert len(UNITS) == 3
    for unit in UNITS:
        [line] = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
        argv = line.removeprefix("ExecStart=").split()
        assert argv[1] == "-m", line
        main = importlib.import_module(f"{argv[2]}.main").main
        with pytest.raises(SystemExit):
            main(["--help"])
        usage = capsys.readouterr().out
        flags = [a for a in argv[3:] if a.startswith("--")]
        assert flags and all(re.search(rf"(?<![\w-]){re.escape(f)}\b", usage) for f in flags), (unit.name, flags)
        assert "--config /etc/moepipe/cluster.toml" in line


def test_the_systemd_units_pass_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` on the units, the venv's python replaced by this one: nothing but the two keys
    systemd < 254 does not know (their comment says it ignores them)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    for unit in UNITS:
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/moepipe/.venv/bin/python", sys.executable))
    for unit in UNITS:
        r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.name)], capture_output=True, text=True,
                           timeout=60)
        noise = [x for x in (r.stdout + r.stderr).splitlines()
                 if x.strip() and not re.search(r"Unknown key '(RestartSteps|RestartMaxDelaySec)'", x)]
        if any("Failed to" in x and ("bus" in x.lower() or "manager" in x.lower()) for x in noise):
            pytest.skip(f"systemd-analyze cannot run here: {noise[0]}")
        assert not noise, (unit.name, noise)


def test_the_two_host_example_uses_only_known_cluster_keys():
    import tomllib

    from shared.cluster_config import StageSpec, unknown_keys

    raw = tomllib.loads((ROOT / "deploy" / "two-host.toml").read_text())
    stages = raw.pop("stages")
    assert unknown_keys(raw) == []
    fields = {f.name for f in __import__("dataclasses").fields(StageSpec)}
    assert all(set(s) <= fields for s in stages)


# ---- the systemd way: components started alone, the PLE service restarted alone --------------------------------
def test_a_ple_service_restarted_alone_keeps_its_stage_reading_the_right_rows(tiny_checkpoint, tmp_path):
    """deploy/systemd: each component is a unit reading one cluster.toml with a fixed ple_ring, and
    Restart=on-failure restarts a crashed PLE service alone. The new service wrote a new ring file while the stage
    kept mapping the old one, nobody's any more: prompts after the restart were computed from stale PLE rows
    (different greedy text, silently). Now it reuses the ring in place: the texts are in-process generation's."""
    from dataclasses import replace

    from gateway.launcher import ServeOptions, build_cluster_config
    from shared.cluster_config import dump_toml
    from shared.sampling import SamplingParams
    from stage_worker.generate import generate

    prompts = ["def add(a, b):", "Once upon a time", "The capital of"]
    port = free_port()
    cluster = replace(build_cluster_config(ServeOptions(model=tiny_checkpoint, stages=1, port=port), tmp_path),
                      ple_ring=str(tmp_path / "moepipe-ple.ring"))
    config = tmp_path / "cluster.toml"
    config.write_text(dump_toml(cluster))
    env = _env()

    def start(*module: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", *module, "--config", str(config)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    procs = {"ple": start("ple_service"), "stage": start("stage_worker", "--stage", "0"), "gateway": start("gateway")}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", procs["gateway"], timeout=90)
        assert _complete(port, prompts[0], 10)
        procs["ple"].kill()
        procs["ple"].wait()
        procs["ple"] = start("ple_service")
        deadline = time.time() + 60
        while time.time() < deadline and not ple_holds(cluster.ple_ring):
            assert procs["ple"].poll() is None, procs["ple"].stderr.read()[-2000:]
            time.sleep(0.1)
        time.sleep(3)              # past heartbeat_timeout: the engine core has seen the new service
        wait_healthy(f"http://127.0.0.1:{port}", procs["gateway"], timeout=60)
        served = [_complete(port, p, 10) for p in prompts[1:]]
        assert procs["stage"].poll() is None                       # the stage outlived the service
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert served == [generate(tiny_checkpoint, p, SamplingParams(max_tokens=10, temperature=0.0)).text
                      for p in prompts[1:]]


def ple_holds(path: str) -> bool:
    """Whether a live PLE service holds the ring at `path` (its flock)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
