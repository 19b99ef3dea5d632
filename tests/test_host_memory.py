"""Pinned host memory at its exact size under the host-wide lock (stage_worker/host_memory.py, issue 16)."""

from __future__ import annotations

import mmap
import threading
import time

import pytest
import torch

from stage_worker import host_memory as hm


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_buffer_is_mapped_at_its_exact_size_and_faulted_in(tmp_path):
    n = 3 * (1 << 20) + 5                                    # a power-of-two allocator would hold 4 MiB
    before = _rss()
    big = 256 << 20
    held = hm.allocate(big, lock_path=tmp_path / "lock", headroom=0, pin=False)
    try:
        # the pages are in RAM once allocate returns (this process's resident set: MemAvailable moves with
        # whatever the other test workers do meanwhile), so the next process's check sees them gone
        assert _rss() - before >= big
    finally:
        held.close()
    buf = hm.allocate(n, lock_path=tmp_path / "lock", headroom=0, pin=False)
    try:
        assert buf.nbytes == n and buf.tensor.numel() == n
        assert buf.mapped == -(-n // mmap.PAGESIZE) * mmap.PAGESIZE < 4 << 20
        assert int(buf.tensor.sum()) == 0
        view = buf.view(torch.float32, (1000, 3))
        view.fill_(1.5)
        assert float(buf.view(torch.float32, (3000,)).sum()) == 4500.0
        with pytest.raises(ValueError, match="needs"):
            buf.view(torch.float32, (n,))
    finally:
        buf.close()


def test_more_than_is_available_is_refused_with_the_numbers(tmp_path):
    avail = hm.available_bytes()
    with pytest.raises(hm.HostMemoryError, match=r"GiB of host RAM asked, .* GiB available .* must stay free"):
        hm.allocate(avail + (1 << 30), what="cold experts of stage 0", lock_path=tmp_path / "lock", pin=False)
    with pytest.raises(hm.HostMemoryError, match="cold experts of stage 0"):
        hm.allocate(1 << 20, what="cold experts of stage 0", headroom=avail + (1 << 30), lock_path=tmp_path / "lock",
                    pin=False)
    with pytest.raises(ValueError):
        hm.allocate(0, lock_path=tmp_path / "lock")


def test_the_host_lock_serialises_allocations(tmp_path):
    """While someone holds the lock (another stage process; here another open of the file, which flock treats the
    same), an allocation waits, and gives up with a clear error after its timeout; once free, it allocates."""
    lock = tmp_path / "lock"
    release, holding = threading.Event(), threading.Event()

    def hold():
        with hm.host_lock(lock):
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        t0 = time.monotonic()
        with pytest.raises(hm.HostMemoryError, match="waited 1 s for the host-memory lock"):
            hm.allocate(1 << 20, lock_path=lock, lock_timeout=1.0, headroom=0, pin=False)
        assert time.monotonic() - t0 >= 1.0
    finally:
        release.set()
        holder.join()
    buf = hm.allocate(1 << 20, lock_path=lock, lock_timeout=10, headroom=0, pin=False)
    assert buf.nbytes == 1 << 20
    buf.close()


def test_the_registration_ends_when_the_last_view_dies(tmp_path, monkeypatch):
    """A buffer nobody closed (a model dropped, the next one loaded) unregisters before its pages are unmapped, or
    the next cudaHostRegister at the same address fails with CUDA error 712; close() ends it at once."""
    import gc

    calls: list[int] = []
    monkeypatch.setattr(hm, "_unregister", lambda ptr, pinned: calls.append(ptr))
    big = 64 << 20
    buf = hm.allocate(big, lock_path=tmp_path / "lock", headroom=0, pin=False)
    ptr = buf.tensor.data_ptr()
    view = buf.view(torch.float32, (16,))
    view.fill_(2.0)
    del buf
    gc.collect()
    assert calls == [] and float(view.sum()) == 32.0                # a view alive: still registered and mapped
    alive = _rss()
    del view
    gc.collect()
    assert calls == [ptr] and alive - _rss() >= big * 0.9           # unregistered, then unmapped
    again = hm.allocate(1 << 20, lock_path=tmp_path / "lock", headroom=0, pin=False)
    second = again.tensor.data_ptr()
    again.close()
    assert calls == [ptr, second]
    again.close()                                                  # once only
    assert calls == [ptr, second]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_buffers_dropped_and_made_again_register_each_time(tmp_path):
    """What bench/expert_offload.py does between models: the mapping a dropped buffer leaves is often where the
    next one lands, and its registration must be gone by then (CUDA error 712 otherwise)."""
    import gc

    for _ in range(4):
        buf = hm.allocate(256 << 20, lock_path=tmp_path / "lock", headroom=0)
        assert buf.pinned
        dev = torch.ones(1 << 20, device="cuda")
        buf.view(torch.float32, (1 << 20,)).copy_(dev, non_blocking=True)      # a DMA from the device: pinned
        torch.cuda.synchronize()
        assert float(buf.view(torch.float32, (1 << 20,)).sum()) == float(1 << 20)
        del buf, dev
        gc.collect()


def test_the_host_lock_serves_other_users_and_falls_back_where_it_cannot_be_had(tmp_path, monkeypatch, caplog):
    """The shared lock file is made readable by every user whatever the umask and opened read-only (flock needs no
    write access): a root server's file created 644 refused every other user with a PermissionError. Where the file
    cannot be opened or made at all (a read-only /dev/shm, a directory this user may not write), a per-user lock
    with a warning instead of a traceback."""
    import errno
    import logging
    import os

    from stage_worker import host_memory

    shared = tmp_path / "shared.lock"
    old = os.umask(0o077)
    try:
        with host_memory.host_lock(shared, 1):
            pass
    finally:
        os.umask(old)
    assert shared.stat().st_mode & 0o777 == 0o644
    shared.chmod(0o444)                                  # another user's file: readable, not writable
    with host_memory.host_lock(shared, 1):
        pass

    real_open = os.open

    def refusing(path, flags, *mode):
        if str(path) == str(shared):
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    monkeypatch.setattr(host_memory.os, "open", refusing)
    monkeypatch.setattr(host_memory.tempfile, "gettempdir", lambda: str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="moepipe.stage"), host_memory.host_lock(shared, 1):
        assert (tmp_path / f"moepipe-host-memory-{os.getuid()}.lock").exists()
    assert "cannot be opened or created" in caplog.text
