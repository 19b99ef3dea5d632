"""Imports run one way: gateway -> shared and stage_worker -> shared. Nothing in shared/ imports a service, not even
lazily inside a function; the `moepipe` command (shared/cli.py) reaches the services' subcommands by running their
command modules as processes."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"gateway", "stage_worker", "ple_service"}


def _service_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):       # every nesting level: functions, try, if
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in SERVICES]
    return found


def test_shared_imports_no_service():
    files = sorted((ROOT / "shared").rglob("*.py"))
    assert any(f.name == "cli.py" for f in files)
    bad = [hit for f in files for hit in _service_imports(f)]
    assert not bad, bad


def test_help_lists_every_subcommand_fast():
    from shared.cli import COMMANDS

    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "shared.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    took = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    for name in ["make-model", "quantize", "generate", "serve", "route-stats", "cold-set", "keys"]:
        assert name in COMMANDS
        assert f"    {name}" in r.stdout, r.stdout                 # listed with its help line
    assert took < 5, f"moepipe --help took {took:.1f} s"


def test_an_unknown_subcommand_is_named():
    r = subprocess.run([sys.executable, "-m", "shared.cli", "nosuch"], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2
    assert "invalid choice: 'nosuch'" in r.stderr, r.stderr


def test_a_subcommand_help_is_the_services():
    r = subprocess.run([sys.executable, "-m", "shared.cli", "keys", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage: moepipe keys" in r.stdout and "--out" in r.stdout


def test_in_process_main_returns_the_child_exit_code(tmp_path, capfd):
    from shared.cli import main

    assert main(["keys", "--out", str(tmp_path / "k")]) == 0
    assert (tmp_path / "k" / "cluster.key_secret").is_file()
    assert main(["keys", "--out", str(tmp_path / "k")]) == 1               # exists: the service's own exit code
    assert "moepipe keys:" in capfd.readouterr().err


def test_the_table_matches_the_command_modules():
    """Each subcommand of the dispatcher's static table is defined by the module it names, with the same help line."""
    import argparse
    import importlib

    from shared.cli import COMMANDS

    defined = {}
    for module in sorted({m for m, _ in COMMANDS.values()}):
        parser = importlib.import_module(module).build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        defined |= {c.dest: (module, c.help) for c in sub._choices_actions}
    assert defined == COMMANDS
