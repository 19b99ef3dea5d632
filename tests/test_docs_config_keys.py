"""docs/architecture.md against the code, for the drift that comes back most often: a cluster key, environment
variable, flag, module, message or route added, renamed or removed in the code but not in the document (or the
other way round). Text only, no server: well under a second."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shared.cluster_config import _ENV, ClusterConfig
from shared.protocol import MESSAGES

ROOT = Path(__file__).resolve().parents[1]
DOC_PATH = ROOT / "docs" / "architecture.md"
DOC = DOC_PATH.read_text()
TICKED = re.findall(r"`([^`\n]+)`", DOC.replace("```", ""))
PACKAGES = ("shared", "gateway", "stage_worker", "ple_service")
# the files a name in the document may come from: the packages, the benchmarks and tools, the tests
SOURCES = {p: p.read_text(errors="ignore") for d in (*PACKAGES, "bench", "tools", "tests", "deploy")
           for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".toml", ".service") and p.is_file()}
ALL_SOURCE = "\n".join(SOURCES.values())
# flags of other programs the document compares with (llama.cpp's)
FOREIGN_FLAGS = {"--fit", "--fit-ctx"}


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end >= 0 else len(DOC)]


def test_every_cluster_key_is_documented():
    missing = [f.name for f in dataclasses.fields(ClusterConfig) if f"`{f.name}`" not in DOC]
    assert not missing, f"ClusterConfig fields not named in {DOC_PATH.name} (add a row to a key table): {missing}"


def test_every_environment_variable_is_documented():
    missing = [env for env in _ENV if env not in DOC]
    assert not missing, f"_ENV variables not named in {DOC_PATH.name}: {missing}"


def test_every_documented_variable_exists():
    """A MOEPIPE_* variable the document names is in `_ENV` or read somewhere (MOEPIPE_HOME, MOEPIPE_PROFILE, ...)."""
    named = set(re.findall(r"\bMOEPIPE_[A-Z0-9_]*[A-Z0-9]\b", DOC))
    gone = sorted(v for v in named if v not in _ENV and not re.search(rf"\b{v}\b", ALL_SOURCE))
    assert not gone, f"{DOC_PATH.name} names variables nothing reads: {gone}"


def test_documented_variables_map_to_their_keys():
    """In the key tables, a row's variables belong to that row's keys (`MOEPIPE_X` of key `x` in `_ENV`)."""
    keys = {f.name for f in dataclasses.fields(ClusterConfig)}
    wrong = []
    for line in DOC.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.replace("\\|", "/").strip("|").split("|")[0]
        row_keys = {k for k in re.findall(r"`(\w+)`", first) if k in keys}
        if not row_keys or "item" in first:
            continue
        for env in re.findall(r"\bMOEPIPE_[A-Z0-9_]*[A-Z0-9]\b", line):
            key = _ENV.get(env)
            if key is not None and key not in row_keys and f"`{key}`" not in line:
                wrong.append(f"{env} (key {key}) in the row of {sorted(row_keys)}")
    assert not wrong, wrong


def _word(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_stated_defaults_match():
    """A key-table row's default cell (`true, 16, -1 (auto)`: one value a key, in the row's key order) holds each
    number or switch key's dataclass default; rows whose cell does not split into one value a key are skipped."""
    defaults = {f.name: f.default for f in dataclasses.fields(ClusterConfig)
                if isinstance(f.default, (bool, int, float)) and f.default is not dataclasses.MISSING}
    wrong, checked = [], 0
    for line in DOC.splitlines():
        if not line.startswith("| `") or " item " in line.split("|")[1]:
            continue
        cells = [c.strip() for c in line.replace("\\|", "/").strip().strip("|").split("|")]
        keys = [k for k in re.findall(r"`(\w+)`", cells[0]) if k in {f.name for f in dataclasses.fields(ClusterConfig)}]
        if not keys or len(cells) not in (3, 5):
            continue
        cell = cells[1] if len(cells) == 3 else cells[3]
        while re.search(r"\([^()]*\)", cell):
            cell = re.sub(r"\([^()]*\)", "", cell)
        values = [v.strip().strip("`").split(" ")[0].rstrip(":;") for v in cell.split(",")]
        if len(values) != len(keys):
            continue
        for key, value in zip(keys, values):
            if key in defaults and re.fullmatch(r"true|false|-?[\d.,]+s?", value):     # not "model's" (0: derived)
                checked += 1
                if value.removesuffix("s") != _word(defaults[key]) and value != _word(defaults[key]):
                    wrong.append(f"{key}: {value!r} in the document, {defaults[key]!r} in ClusterConfig")
    assert checked > 40, f"only {checked} defaults found in the key tables: has their layout changed?"
    assert not wrong, wrong


def _resolve(path: str) -> bool:
    """A path as the document writes it: from the repository root, or inside a package (`kernels/common.py` of
    stage_worker, `model/batch.py`)."""
    return (ROOT / path).exists() or any((ROOT / pkg / path).exists() for pkg in PACKAGES) or \
        any((ROOT / pkg / sub / path).exists() for pkg in PACKAGES for sub in ("model", "kernels", "checkpoint"))


def test_every_named_module_exists():
    """Every backticked `path/to/module.py` (or `module.py` of a package), and every `path/module.function`."""
    paths = {t for t in TICKED if re.fullmatch(r"[\w.-][\w./-]*\.(py|sh)", t)}
    top = r"(?:" + "|".join(PACKAGES) + r"|bench|tools|tests|deploy|docs)/[\w./-]*"
    paths |= {t for t in TICKED if re.fullmatch(top, t) and not re.fullmatch(r"[\w/]+\.[a-z_]\w*", t.rstrip("/"))}
    missing = sorted(p for p in paths if not _resolve(p.rstrip("/")))
    assert not missing, f"{DOC_PATH.name} names files that do not exist: {missing}"
    gone = []
    for t in TICKED:
        m = re.fullmatch(r"((?:" + "|".join(PACKAGES) + r")/[\w/]+)\.([a-zA-Z_]\w*)", t)
        if m and m.group(2) not in ("py", "sh", "md", "toml", "json"):
            module = ROOT / (m.group(1) + ".py")
            if not module.is_file() or not re.search(rf"^(?:async )?(?:def|class) {m.group(2)}\b|^{m.group(2)}\s*=",
                                                     module.read_text(), re.M):
                gone.append(t)
    assert not gone, f"{DOC_PATH.name} names functions that do not exist: {gone}"


def test_every_named_flag_exists():
    """Every `--flag` the document names is a `moepipe` flag or one a benchmark, tool or component takes."""
    from gateway.cli import build_parser

    parser = build_parser()
    flags = set()
    for action in parser._actions:
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict):
                flags |= {o for a in action.choices[sub]._actions for o in a.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", DOC))
    gone = sorted(f for f in named - flags - FOREIGN_FLAGS if f'"{f}"' not in ALL_SOURCE and
                  f"'{f}'" not in ALL_SOURCE)
    assert not gone, f"{DOC_PATH.name} names flags nothing takes: {gone}"


def test_message_table_matches_the_protocol():
    table = _section("## 2. Messages")
    rows = set(re.findall(r"^\| `(\w+)`", table, re.M))
    messages = {cls.__name__ for cls in MESSAGES.values()}
    nested = {"SeqEntry", "SamplingSpec", "TokenOut"}
    assert messages - rows == set(), f"message types without a row in section 2: {messages - rows}"
    assert rows - messages - nested == set(), f"section 2 rows that are no message type: {rows - messages - nested}"


def test_routes_are_listed():
    """Every route gateway/api.py serves is in the route list of section 1 (a parameter written any way)."""
    api = (ROOT / "gateway" / "api.py").read_text()
    routes = re.findall(r'@app\.(?:get|post|put|delete|patch)\("([^"]+)"', api)
    assert routes, "no routes found in gateway/api.py"
    start = DOC.index("The gateway's routes (`gateway/api.py`)")
    listed = DOC[start:DOC.index("\n\n", start)]
    missing = []
    for route in routes:
        parts = [p for p in route.split("/") if p]
        pattern = "/" + "/".join(r"\{\w+\}" if p.startswith("{") else re.escape(p) for p in parts)
        tail = "/" + parts[-1] if not parts[-1].startswith("{") else None
        if not re.search(pattern + r"(?![\w/])", listed) and \
                not (tail and re.search(re.escape(tail) + r"(?![\w/])", listed)):
            missing.append(route)
    assert not missing, f"routes gateway/api.py serves that section 1 does not list: {missing}"


@pytest.mark.parametrize("name", ["ClusterExecutor", "InProcessExecutor", "StageRunner", "EngineCore", "Scheduler",
                                  "BlockManager", "AsyncEngine", "PleService", "Supervisor"])
def test_the_request_path_classes_exist(name):
    """The classes the request path of the document's opening runs through."""
    assert re.search(rf"^class {name}\b", ALL_SOURCE, re.M), f"{name} is named in {DOC_PATH.name} but not defined"
    assert f"`{name}`" in DOC or name in DOC
