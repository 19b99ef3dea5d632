#!/usr/bin/env bash
# CI, step 1: the README's serve command on a fresh environment. A new virtual environment gets exactly the serve
# command's install (no test extra), starts the real cluster (gateway, two stages, PLE service) and answers a chat;
# a runtime dependency missing from pyproject.toml's main list makes this fail before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
pip install -qq torch==2.13.0 -e .
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is not None)" \
    || echo "smoke: note: triton is present in the serve environment"
port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
MOEPIPE_HOME="$work/home" moepipe serve --stages 2 --port "$port" >"$work/serve.log" 2>&1 &
server=$!
status=0
python .ci/smoke_chat.py "http://127.0.0.1:$port/v1" 300 "$server" || status=$?
kill -INT "$server" 2>/dev/null || true
wait "$server" || true
if [ "$status" -ne 0 ]; then
    echo "smoke: FAILED; the server's log:" >&2
    tail -n 60 "$work/serve.log" >&2
    exit "$status"
fi
left=$(pgrep -f "$work/venv" || true)
if [ -n "$left" ]; then
    echo "smoke: processes left after Ctrl-C: $left" >&2
    exit 1
fi
deactivate
echo "smoke: the README serve command works in a fresh environment"
