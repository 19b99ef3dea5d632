"""A streaming client that goes away while the gateway is writing a backlog of chunks (found by tools/qa_soak.py).

A stream answers only once every choice has its first token (`api._serve`), so with n > the free state slots the
first choices generate (here all of their tokens: one slot, n=2) before the last one is admitted, and the stream then starts with
that whole backlog. The body wrote it in one event-loop turn: the engine iterator's and `_merged`'s queues were
never empty, and a send that does not block never yields, so the loop never ran the transport's connection-lost
callback. A client that read the first chunk and closed (an agent cancelling) left the gateway writing hundreds of
chunks into a dead socket, asyncio logging `socket.send() raised exception.` for each one after the fifth: 372
WARNING lines for one n=3 request of 300 tokens on the demo model (1,040 in a minute of the soak's disconnect mix),
and no other request was served while it lasted. Now the body yields to the loop after every chunk, so the lost
connection is seen after the first failed write and the stream is cancelled there. (That cancellation then lands
between two chunks, while `_merged`'s pump tasks still drive the later choices' engine iterators: the stream closes
its chunk iterator, which stops them, before it closes the iterators, or aclose() raised "asynchronous generator is
already running" and the gateway logged an unhandled error: the second assertion.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conftest import free_port, metric
from gateway.launcher import ServeOptions
from logged_cluster import LoggedCluster


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("burst") / "cluster.log"
    opts = ServeOptions(model=tiny_checkpoint, stages=1, port=free_port(),
                        extra={"max_num_seqs": 1, "max_model_len": 1024, "ple_service": False})
    with LoggedCluster(opts, log) as c:
        yield c


def _warnings(log: Path) -> int:
    return log.read_text(errors="replace").count("socket.send() raised exception")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_client_gone_during_a_backlog_burst_is_seen_at_once(server, route):
    body = {"model": "moepipe", "max_tokens": 300, "n": 2, "stream": True, "ignore_eos": True, "temperature": 1.0,
            "seed": 5}
    body.update({"prompt": "hello there"} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hello there"}]})
    before, log_size = _warnings(server.log), server.log.stat().st_size
    with httpx.Client(base_url=server.url, timeout=120, verify=False) as c:
        with c.stream("POST", route, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break                    # one chunk read, then the connection is closed under the backlog
    deadline = time.time() + 30
    while metric(server.url, "moepipe_requests_running") != 0 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)                          # (the access line and any warning are written after the stream ends)
    assert _warnings(server.log) - before <= 2, server.log.read_text()[-3000:]
    with open(server.log, errors="replace") as f:
        f.seek(log_size)
        written = f.read()
    assert "Traceback" not in written and " ERROR " not in written, written[-3000:]
    assert metric(server.url, "moepipe_kv_blocks_used") == 0
    assert metric(server.url, "moepipe_state_slots_used") == 0


class _Choice:
    """A choice's `_Generation` as the stream uses it: pieces from an engine iterator that never ends here."""

    def __init__(self, index: int) -> None:
        self.index, self.echo, self.want_logprobs, self.finish_reason = index, None, False, None
        self.timer = SimpleNamespace(finish=lambda reason: None)
        self.closed = False

        async def events():
            while True:
                await asyncio.sleep(0.001)
                yield SimpleNamespace(text="x", tokens=[], ids=[7], finish_reason=None)

        self._events = events()

    async def pieces(self):
        async for piece in self._events:
            yield piece

    async def aclose(self) -> None:
        await self._events.aclose()         # raises if a pump task is still inside it
        self.closed = True


def test_a_stream_closed_at_a_chunk_stops_its_pumps_before_closing_the_engine_iterators():
    """The client's disconnect may cancel the response in its `send` (the socket full: a client gone under a
    backlog), outside the body: the body is then closed at the yield of a chunk, with an n>1 merge's pump tasks
    still inside the engine iterators. Closing those raised 'aclose(): asynchronous generator is already running'
    (asyncio logs it as an unhandled error when it finalises the body)."""
    from gateway import api

    async def run() -> list[_Choice]:
        choices = [_Choice(0), _Choice(1)]
        req = SimpleNamespace(include_usage=False, continuous_usage=False, prompt_logprobs=None,
                              return_token_ids=False, return_tokens_as_token_ids=False)
        body = api._completion_stream(SimpleNamespace(model_name="m"), req, choices, "cmpl-1")
        assert (await body.__anext__()).startswith("data: ")
        await asyncio.sleep(0.01)            # the pumps run on meanwhile
        await body.aclose()
        return choices

    assert all(c.closed for c in asyncio.run(run()))
