"""A gateway whose engine core's thread died on a bug answered 503 for ever while its process stayed up, so the
launcher (which restarts processes that exit) never restarted it. `gateway.main.watch_core` stops the server then
(serve exits 1): a real EngineCore whose executor raises inside the core's loop."""

from __future__ import annotations

import asyncio
import time

from gateway.main import watch_core
from shared.engine_core import EngineCore, SchedulerLimits


class BrokenExecutor:
    """Starts fine; its first poll raises, as a bug in the core's loop would."""

    def start(self) -> None: ...
    def send(self, plan) -> None: ...
    def poll(self, timeout: float, wake_fd: int) -> list:
        raise RuntimeError("a bug in the core's loop")
    def health(self) -> list[str]:
        return []
    def down(self) -> list[str]:
        return []
    def lost(self) -> list[str]:
        return []
    def restarted(self) -> list[str]:
        return []
    def stop(self) -> None: ...


def _limits() -> SchedulerLimits:
    return SchedulerLimits(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                           num_microbatches=1, max_model_len=128)


def test_a_dead_core_stops_the_server():
    core = EngineCore(BrokenExecutor(), _limits())
    core.start()
    stopped = []
    try:
        died = asyncio.run(asyncio.wait_for(watch_core(core, lambda: stopped.append(1), lambda: bool(stopped),
                                                       interval=0.05), timeout=10))
        assert died and stopped == [1] and core.dead and EngineCore.COMPONENT in core.health()
    finally:
        core.stop()


def test_a_live_core_is_left_alone_until_the_server_stops():
    class IdleExecutor(BrokenExecutor):
        def poll(self, timeout: float, wake_fd: int) -> list:
            time.sleep(min(timeout, 0.05))
            return []

    core = EngineCore(IdleExecutor(), _limits())
    core.start()
    calls, until = [], time.monotonic() + 0.5
    try:
        died = asyncio.run(asyncio.wait_for(watch_core(core, lambda: calls.append(1),
                                                       lambda: time.monotonic() > until, interval=0.05), timeout=10))
        assert died is False and calls == [] and not core.dead
    finally:
        core.stop()
