"""tools/train_demo.py on the CPU at toy size: it trains (losses fall), a rerun with the same seed logs the same
losses, a run stopped and resumed from its checkpoint continues exactly, and the export is a checkpoint that the
loader and `generate` take, with bits-per-byte evaluation against a unigram baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(ROOT / "tools/build_corpus.py"), "--out", str(out),
                    "--max-mb-per-kind", "0.2", "--held-out-every", "5"], check=True, capture_output=True)
    return out


def _train(corpus: Path, out: Path, *extra: str, batch: int = 2, lr: float = 3e-3, total: int = 12) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "tools/train_demo.py"), "--corpus", str(corpus), "--out", str(out),
           "--preset", "tiny", "--device", "cpu", "--batch", str(batch), "--seq", "32", "--distill-steps", "3",
           "--warmup", "2", "--lr", str(lr), "--total-steps", str(total), *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_rerun_and_resume_reproduce_the_losses(corpus, tmp_path):
    full = _train(corpus, tmp_path / "a", "--max-steps", "8")
    again = _train(corpus, tmp_path / "b", "--max-steps", "8")
    assert [r["loss"] for r in full] == [r["loss"] for r in again]          # CPU: bit-identical
    _train(corpus, tmp_path / "c", "--max-steps", "5")
    resumed = _train(corpus, tmp_path / "c", "--max-steps", "8")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["dense"] for r in full][:4] == [True, True, True, False]     # indexer warm-up, then sparse
    assert all(r["indexer_kl"] >= 0 and r["moe_balance"] >= 0.99 for r in full)


def test_training_lowers_the_loss_and_exports_a_servable_checkpoint(corpus, tmp_path):
    log = _train(corpus, tmp_path / "run", "--max-steps", "24", batch=4, lr=1e-2, total=24)
    first, last = log[0]["ce"], sum(r["ce"] for r in log[-4:]) / 4
    assert last < first - 0.5, (first, last)                                # 7.62 (uniform) to ~6.8 here
    _train(corpus, tmp_path / "run", "--eval", "--eval-tokens", "256")
    res = json.loads((tmp_path / "run/eval.json").read_text())
    assert set(res) == {"code", "prose", "docs", "german"}
    assert all(r["model_bpb"] > 0 and r["unigram_bpb"] > 0 for r in res.values())
    out = tmp_path / "model"
    _train(corpus, tmp_path / "run", "--export", str(out))
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine

    model = load_model(out, LoadOptions(with_mtp=True))
    engine = LocalEngine([model])
    engine.add(0)
    logits = engine.step([(0, [5, 6, 7])])
    assert logits.shape[-1] == model.cfg.vocab_size and bool(logits.isfinite().all())
    gen = subprocess.run([sys.executable, "-m", "shared.cli", "generate", "--model", str(out), "--prompt", "def",
                          "--max-tokens", "4", "--seed", "1"], capture_output=True, text=True, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr


def test_snapshot_lets_training_continue_elsewhere(corpus, tmp_path):
    """--snapshot exports bf16 weights and the step at each save; --init-from starts a new output directory there
    (what survives losing a lent machine): its first step's loss is the uninterrupted run's, within bf16 rounding."""
    kw = dict(batch=4, lr=1e-2, total=24)
    full = _train(corpus, tmp_path / "a", "--max-steps", "10", **kw)
    _train(corpus, tmp_path / "b", "--max-steps", "8", "--save-every", "8", "--snapshot", str(tmp_path / "snap"), **kw)
    assert json.loads((tmp_path / "snap/train_state.json").read_text()) == {"step": 8}
    moved = _train(corpus, tmp_path / "c", "--max-steps", "10", "--init-from", str(tmp_path / "snap"), **kw)
    assert [r["step"] for r in moved] == [9, 10]
    assert abs(moved[0]["ce"] - full[8]["ce"]) < 0.01 * full[8]["ce"]


def test_prepare_writes_only_what_a_gpu_machine_needs(corpus, tmp_path):
    out = tmp_path / "prep"
    _train_cmd = [sys.executable, str(ROOT / "tools/train_demo.py"), "--corpus", str(corpus), "--out", str(out),
                  "--preset", "tiny", "--device", "cpu", "--prepare"]
    subprocess.run(_train_cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    assert {p.name for p in out.iterdir()} == {"tokenizer", "tokens.npz", "tokens.json"}
    counts = json.loads((out / "tokens.json").read_text())
    assert set(counts) == {"code", "prose", "docs", "german"} and all(c["train_tokens"] > 0 for c in counts.values())
    # a run from the prepared directory needs no corpus at all
    _train(tmp_path / "no-corpus", out, "--max-steps", "2")
    assert (out / "checkpoint.pt").exists()
