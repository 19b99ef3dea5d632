"""tools/greedy_transcript.py: the check issue 7 needs (one-GPU vs two-GPU two-stage runs) exercised on the CPU,
where a one-stage and a two-stage cluster must give the same greedy tokens and logprobs; and a planted change is
reported as a difference. The two-stage `record` and both `compare`s go through the CLI (a subprocess: the tool end
to end); the one-stage `record` calls the tool's `record` in this process meanwhile, so the two cluster starts overlap
and one fresh interpreter (openai, gateway imports: seconds of CPU) is saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = str(ROOT / "tools/greedy_transcript.py")
sys.path.insert(0, str(ROOT / "tools"))

import greedy_transcript  # noqa: E402


def test_one_and_two_stage_runs_agree_and_a_change_is_caught(tiny_checkpoint, tmp_path):
    two = subprocess.Popen([sys.executable, TOOL, "record", "--model", str(tiny_checkpoint), "--stages", "2",
                            "--max-tokens", "12", "--out", str(tmp_path / "s2.json")], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        greedy_transcript.record(tiny_checkpoint, 1, "cpu", 12, tmp_path / "s1.json")
    finally:
        out, _ = two.communicate(timeout=600)
    assert two.returncode == 0, out
    assert "recorded 6 prompts" in out
    same = subprocess.run([sys.executable, TOOL, "compare", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"),
                           "--logprob-tol", "1e-4"], cwd=ROOT, capture_output=True, text=True)
    assert same.returncode == 0, same.stdout
    assert json.loads((tmp_path / "s1.json").read_text())["layout"] == [{"start": 0, "end": 6, "device": "cpu"}]
    data = json.loads((tmp_path / "s2.json").read_text())
    assert [(s["start"], s["end"]) for s in data["layout"]] == [(0, 3), (3, 6)]
    data["results"][2]["tokens"][5] = "<planted>"
    (tmp_path / "changed.json").write_text(json.dumps(data))
    diff = subprocess.run([sys.executable, TOOL, "compare", str(tmp_path / "s1.json"), str(tmp_path / "changed.json")],
                          cwd=ROOT, capture_output=True, text=True)
    assert diff.returncode == 1 and "first difference at token 5" in diff.stdout
