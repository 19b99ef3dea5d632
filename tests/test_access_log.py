"""The access log as an operator sees it: `moepipe serve` (real gateway and stage worker) writes one line per HTTP
request to its stderr, with the fields the client's response carries; `--no-access-log` silences it. One stage and
no PLE service process (`--no-ple-service`): the log is the gateway's, and each process is a torch import (the
2-stage cluster with its PLE service took ~9 s of the file's ~22 s to start)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import OpenAI, free_port, stop_server, wait_healthy
from gateway.cli import build_parser, serve_options
from shared.cluster_config import env_overrides

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"moepipe\.access (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) (?P<fields>.*)$")


def _start(model: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MOEPIPE_ACCESS_LOG"}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--model", str(model), "--port",
                                 str(port), *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return proc, f"http://127.0.0.1:{port}"




def _lines(log: Path) -> list[dict[str, str]]:
    out = []
    for text in log.read_text().splitlines():
        m = LINE.search(text)
        if m:
            fields = dict(kv.split("=", 1) for kv in m["fields"].split())
            out.append({"method": m["method"], "path": m["path"], "status": m["status"], **fields})
    return out


def _wait_line(log: Path, count: int, timeout: float = 15.0) -> list[dict[str, str]]:
    """The lines once there are `count` of them (a line is written when its response has ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        lines = _lines(log)
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    pytest.fail(f"expected {count} access log lines, got: {_lines(log)}")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("access") / "serve.err"
    proc, url = _start(tiny_checkpoint, log, "--stages", "1", "--no-ple-service")
    try:
        wait_healthy(url, proc, timeout=180)
        yield url, log
    finally:
        stop_server(proc)


def test_one_line_per_request_with_the_response_fields(server):
    url, log = server
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    before = len(_lines(log))
    for probe in ("/health", "/ping", "/metrics"):           # probes and scrapers: not logged
        assert httpx.get(url + probe, timeout=30).status_code == 200
    raw = client.chat.completions.with_raw_response.create(
        model="moepipe", messages=[{"role": "user", "content": "Name a prime number."}], max_tokens=6, temperature=0)
    res = raw.parse()
    assert raw.headers["x-request-id"] == res.id and res.id.startswith("chatcmpl-")
    line = _wait_line(log, before + 1)[-1]
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", "200")
    assert line["request_id"] == res.id
    assert int(line["prompt_tokens"]) == res.usage.prompt_tokens
    assert int(line["completion_tokens"]) == res.usage.completion_tokens == 6
    assert line["finish_reason"] == res.choices[0].finish_reason == "length"
    assert 0 < float(line["ttft"]) <= float(line["total"]) < 60
    assert line["client"].startswith("127.0.0.1:")
    assert len(_lines(log)) == before + 1                    # one line: the probes were not logged


def test_client_request_id_and_streams(server):
    url, log = server
    before = len(_lines(log))
    body = {"model": "moepipe", "prompt": "def add(a, b):", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": "agent-42"},
                      verify=False) as r:
        assert r.headers["x-request-id"] == "agent-42"
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]][-1]
    line = _wait_line(log, before + 1)[-1]
    assert (line["path"], line["status"], line["request_id"]) == ("/v1/completions", "200", "agent-42")
    assert line["finish_reason"] == finish and finish in ("stop", "length")
    assert 1 <= int(line["completion_tokens"]) <= 5


def test_tool_calls_finish_reason_is_the_clients(server):
    url, log = server
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    before = len(_lines(log))
    tool = {"type": "function", "function": {"name": "run_shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
    for stream in (False, True):
        res = client.chat.completions.create(
            model="moepipe", messages=[{"role": "user", "content": "List /tmp."}], tools=[tool], stream=stream,
            tool_choice={"type": "function", "function": {"name": "run_shell"}}, max_tokens=60, temperature=0)
        finish = res.choices[0].finish_reason if not stream else [c.choices[0].finish_reason for c in res
                                                                  if c.choices][-1]
        assert finish == "tool_calls"
    fn = {"type": "function", **tool["function"]}                          # the Responses API's flat tool
    for stream in (False, True):
        args = dict(model="moepipe", input="List /tmp.", tools=[fn], max_output_tokens=60, temperature=0,
                    tool_choice={"type": "function", "name": "run_shell"})
        if stream:
            with client.responses.stream(**args) as s:
                res = s.get_final_response()
        else:
            res = client.responses.create(**args)
        assert [item.type for item in res.output] == ["function_call"]
    lines = _wait_line(log, before + 4)[before:]
    assert [ln["finish_reason"] for ln in lines] == ["tool_calls"] * 4


def test_errors_get_a_line_with_their_status(server):
    url, log = server
    before = len(_lines(log))
    replies = [httpx.post(url + "/v1/chat/completions", content=b"{not json", verify=False),
               httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": [
                   {"role": "user", "content": "hi"}]}, verify=False),
               httpx.get(url + "/v1/nothing-here", verify=False)]
    assert [r.status_code for r in replies] == [400, 404, 404]
    lines = _wait_line(log, before + 3)[before:]
    assert [(ln["method"], ln["path"], ln["status"]) for ln in lines] == [
        ("POST", "/v1/chat/completions", "400"), ("POST", "/v1/chat/completions", "404"),
        ("GET", "/v1/nothing-here", "404")]
    assert all(ln["prompt_tokens"] == ln["ttft"] == ln["finish_reason"] == "-" for ln in lines)
    # an error has no response id: a generated one, in the header and the line, so a report can quote it
    ids = [r.headers["x-request-id"] for r in replies]
    assert all(i.startswith("req-") for i in ids) and len(set(ids)) == 3
    assert [ln["request_id"] for ln in lines] == ids


def test_client_gone_mid_stream_is_499_abort(server):
    url, log = server
    before = len(_lines(log))
    body = {"model": "moepipe", "prompt": "The quick brown fox", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, verify=False) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                break                                      # leave after the first token: the connection closes
    line = _wait_line(log, before + 1)[-1]
    assert (line["status"], line["finish_reason"]) == ("499", "abort")
    assert line["request_id"].startswith("cmpl-") and 1 <= int(line["completion_tokens"]) < 2000


def test_no_access_log_flag_silences_it(tiny_checkpoint, tmp_path):
    log = tmp_path / "serve.err"
    proc, url = _start(tiny_checkpoint, log, "--stages", "1", "--no-ple-service", "--no-access-log")
    try:
        wait_healthy(url, proc, timeout=180)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60, verify=False)
        assert r.status_code == 200 and "x-request-id" not in r.headers
        assert httpx.get(url + "/v1/nothing-here", verify=False).status_code == 404
        time.sleep(0.5)
    finally:
        stop_server(proc)
    assert "moepipe.access" not in log.read_text() and _lines(log) == []


def test_switch_names():
    """The vLLM-style alias and the environment variable set the same cluster key."""
    parser = build_parser()
    for flag in ("--no-access-log", "--disable-uvicorn-access-log"):
        args = parser.parse_args(["serve", "--model", str(ROOT), flag])
        assert args.no_access_log is True
    assert parser.parse_args(["serve"]).no_access_log is False
    os.environ["MOEPIPE_ACCESS_LOG"] = "off"
    try:
        assert env_overrides()["access_log"] is False
    finally:
        del os.environ["MOEPIPE_ACCESS_LOG"]
    assert "access_log" not in env_overrides()


def test_serve_options_carry_the_switch(tiny_checkpoint):
    args = build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), "--no-access-log"])
    assert serve_options(args).extra == {"access_log": False}
