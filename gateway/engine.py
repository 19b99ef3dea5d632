"""The boundary between the HTTP layer and the engine core.

The API layer turns an OpenAI request into a `GenerationRequest` (token ids, sampling parameters with
generation_config.json defaults already applied) and consumes `TokenEvent`s from `Engine.generate`. `AsyncEngine`
is the one implementation: it hands requests to the engine core's thread (`shared/engine_core.py`) and carries the
events back onto the event loop. Tests put stub engines behind the same protocol.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

from shared.engine_core import EngineCore, GenerationRequest, TokenEvent

__all__ = ["AsyncEngine", "Engine"]


class Engine(Protocol):
    max_model_len: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Tokens as they are sampled. Closing the iterator early (client gone) cancels the request and frees its
        blocks and slots at once. Raises EngineUnavailable / EngineOverloaded before the first token, EngineFailed
        after."""
        ...

    def health(self) -> list[str]:
        """Names of components that missed their heartbeat deadline (empty: healthy)."""
        ...

    @property
    def closing(self) -> str | None:
        """Why new requests are refused while the server stops (then /health is 503 too), else None."""
        ...


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.max_model_len = core.max_model_len

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item) -> None:                 # on the core's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:                # the loop is closed: nobody listens any more
                pass

        rid = self.core.add(request, sink)
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:
                self.core.cancel(rid)

    def health(self) -> list[str]:
        return self.core.health()

    @property
    def closing(self) -> str | None:
        return self.core.closing
