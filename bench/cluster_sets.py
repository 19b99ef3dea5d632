"""`--set KEY=VALUE` of the benchmarks that build a cluster config (bench/serve.py, bench/prefill.py): one parser,
so both read values the same way (JSON where it parses: numbers, booleans, lists; else the plain string: a path, a
dtype or a `dummy_quant` name). Unknown keys are the launcher's to refuse (`build_cluster_config`)."""

from __future__ import annotations

import json
from collections.abc import Callable


def parse_sets(items: list[str], error: Callable[[str], None]) -> dict:
    """KEY=VALUE strings -> {key: value}; `error` (argparse's `ap.error`) gets a malformed item."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            error(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
