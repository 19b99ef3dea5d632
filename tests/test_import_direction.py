"""Imports run one way: each service (gateway, stage_worker, ple_service) imports only `shared` and its own package,
and `shared` imports no service. Services run as separate processes on separate hosts; an import across them would
drag one service's dependencies (and start-up cost) into another, and hide a contract that belongs in `shared`.

Every import counts, at any nesting level (inside functions, `try`, `if`): a lazy import crosses the boundary as
surely as a top-level one, only later."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "stage_worker", "ple_service")
PACKAGES = SERVICES + ("shared",)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in `path`; relative imports stay inside the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _crossings() -> dict[str, list[str]]:
    """package -> "file:line module" for each import of another of `PACKAGES` that the package may not import."""
    bad: dict[str, list[str]] = {}
    for package in PACKAGES:
        allowed = {package} if package == "shared" else {package, "shared"}
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in _imports(path):
                top = module.split(".")[0]
                if top in PACKAGES and top not in allowed:
                    bad.setdefault(package, []).append(f"{path.relative_to(ROOT)}:{line} {module}")
    return bad


def test_every_package_is_walked():
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), package
        assert any(_imports(p) for p in (ROOT / package).rglob("*.py")), package


def test_shared_imports_no_service():
    assert not _crossings().get("shared"), _crossings().get("shared")


def test_no_service_imports_another():
    bad = {p: hits for p, hits in _crossings().items() if p != "shared"}
    assert not bad, bad


def test_lazy_and_nested_imports_are_seen(tmp_path):
    """The walk sees imports inside functions and `try` blocks, and skips relative ones."""
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom . import sibling\n\ndef g():\n    try:\n        from ple_service.ring import X\n"
                 "    except ImportError:\n        import gateway.api as api\n")
    assert sorted(m for _, m in _imports(f)) == ["gateway.api", "os", "ple_service.ring"]
