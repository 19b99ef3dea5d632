"""Talk to a freshly started `moepipe serve` the way a user would, with nothing but the standard library (the
serve command's install has no test extra, so no httpx or openai here).

Waits for /health, then sends a plain chat, a structured-output chat (json_schema: the grammar engine is a runtime
dependency too) and a streamed completion, and checks each answer's shape. Exits non-zero naming what failed.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request


def _post(base: str, path: str, body: dict, timeout: float = 120) -> bytes:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        raise SystemExit(f"smoke: POST {path} answered {e.code}: {e.read().decode(errors='replace')[:600]}") from None


def wait_healthy(base: str, timeout: float, pid: int | None) -> None:
    """Poll /health; give up at once if the server process (`pid`) is gone."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pid is not None and not _alive(pid):
            raise SystemExit(f"smoke: the server (pid {pid}) exited before it became healthy")
        try:
            with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"smoke: {base} did not become healthy within {timeout:.0f} s")


def _alive(pid: int) -> bool:
    """Running, not exited (an exited child of the calling shell stays a zombie until it is waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def main() -> int:
    base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
    wait_healthy(base, float(sys.argv[2]) if len(sys.argv) > 2 else 300,
                 int(sys.argv[3]) if len(sys.argv) > 3 else None)

    chat = json.loads(_post(base, "/chat/completions", {
        "model": "moepipe", "messages": [{"role": "user", "content": "What does the ls command do?"}],
        "max_tokens": 24, "seed": 1}))
    text = chat["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip(), f"empty chat answer: {chat}"
    assert chat["usage"]["completion_tokens"] >= 1, chat
    print(f"smoke: chat answered ({chat['usage']['completion_tokens']} tokens): {text[:80]!r}")

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"], "additionalProperties": False}
    structured = json.loads(_post(base, "/chat/completions", {
        "model": "moepipe", "messages": [{"role": "user", "content": "Describe a file as JSON."}],
        "max_tokens": 64, "seed": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "file", "schema": schema}}}))
    choice = structured["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"name", "size"} and isinstance(value["size"], int), value
    print(f"smoke: structured output ({choice['finish_reason']}): {choice['message']['content'][:80]!r}")

    raw = _post(base, "/completions", {"model": "moepipe", "prompt": "def main(", "max_tokens": 8,
                                       "stream": True, "seed": 1}).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-400:]
    finish = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]]
    assert finish[-1] in ("stop", "length"), finish
    print(f"smoke: streamed completion, {len(events) - 1} chunks, finish {finish[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
