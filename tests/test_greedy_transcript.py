"""tools/greedy_transcript.py: the check issue 7 needs (one-GPU vs two-GPU two-stage runs) exercised on the CPU,
where a one-stage and a two-stage cluster must give the same greedy tokens and logprobs; and a planted change is
reported as a difference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = str(ROOT / "tools/greedy_transcript.py")


def test_one_and_two_stage_runs_agree_and_a_change_is_caught(tiny_checkpoint, tmp_path):
    for stages in (1, 2):
        subprocess.run([sys.executable, TOOL, "record", "--model", str(tiny_checkpoint), "--stages", str(stages),
                        "--max-tokens", "12", "--out", str(tmp_path / f"s{stages}.json")], check=True, cwd=ROOT,
                       capture_output=True)
    same = subprocess.run([sys.executable, TOOL, "compare", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"),
                           "--logprob-tol", "1e-4"], cwd=ROOT, capture_output=True, text=True)
    assert same.returncode == 0, same.stdout
    data = json.loads((tmp_path / "s2.json").read_text())
    assert [(s["start"], s["end"]) for s in data["layout"]] == [(0, 3), (3, 6)]
    data["results"][2]["tokens"][5] = "<planted>"
    (tmp_path / "changed.json").write_text(json.dumps(data))
    diff = subprocess.run([sys.executable, TOOL, "compare", str(tmp_path / "s1.json"), str(tmp_path / "changed.json")],
                          cwd=ROOT, capture_output=True, text=True)
    assert diff.returncode == 1 and "first difference at token 5" in diff.stdout
