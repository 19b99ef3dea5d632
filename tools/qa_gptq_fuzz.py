#!/usr/bin/env python3
"""QA fuzzer: random GPTQ / AutoRound / AutoAWQ checkpoints of the tiny reference families, loaded by moepipe and
compared with transformers on the dequantized weights (not collected by pytest).

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 tools/qa_gptq_fuzz.py --seed 3901 --cases 10

Each case draws a family (tests/hf_oracle.py, a random model seed), a format (GPTQ v1/v2, AutoRound's packings,
AutoAWQ GEMM), a base scheme (bits 2-8, group 16 / 32 / -1, sym, desc_act) and per-module overrides (GPTQModel's
`dynamic`, first matching pattern in order wins, `-:` skips; AutoRound's `extra_config`, 16 bits skips), and how the
files are laid out (one file or a sharded checkpoint cutting a module's parts apart, released
`model.language_model.` names, AutoGPTQ's quantize_config.json) and loaded (one stage or two). The files are written
by tests/test_gptq_checkpoint.py's independent writer (`write_gptq`, its `_quantize` given each module's own scheme
here), the expected scheme of every module is computed here from the libraries' documented semantics, and the
oracle is that test's `_check_against_reference` (prefill and greedy decode, log-probs within 1e-4).

One line a case (PASS / FAIL / REFUSED with the reason), then a summary; exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import test_gptq_checkpoint as tg  # noqa: E402
import hf_oracle  # noqa: E402
from hf_oracle import save_reference  # noqa: E402

FAMILIES = ("qwen3_next", "qwen4_exp", "qwen3_5_moe")

# GPTQModel `dynamic` patterns (written on the files' names: `model.` + optional `language_model.` + `layers...`)
DYN_POOL = [r".*down_proj$", r".*\.mlp\.experts\..*", r".*shared_expert\..*", r".*self_attn\..*",
            r".*linear_attn\..*", r".*gate.*", r".*\.1\..*", r".*up_proj", r".*experts\.[0-3]\..*",
            r"model\.(language_model\.)?layers\.0\..*", r".*\.mlp\..*", r".*o_proj"]


def _scheme_gptq(name: str, base: dict, dynamic: dict):
    """GPTQModel's dynamic_get: the first pattern (dict order) that re.match-es decides; `-:` skips."""
    for pattern, over in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return None
        elif re.match(pattern.removeprefix("+:"), name):
            return {**base, **over}
    return base


def _scheme_auto_round(name: str, plain: str, base: dict, extra: dict):
    """AutoRound's extra_config: a layer's own name (as the files name it) decides; 16 bits: float."""
    over = extra.get(name, extra.get(plain))
    if over is None:
        return base
    s = {**base, **over}
    return None if s["bits"] >= 16 else s


class Case:
    def __init__(self, rng: random.Random, idx: int) -> None:
        self.idx = idx
        self.family = rng.choice(FAMILIES)
        self.model_seed = rng.randrange(1 << 16)
        self.kind = rng.choices(["gptq", "auto-round", "awq"], weights=[5, 3, 2])[0]
        self.released = rng.random() < 0.3
        self.shard = rng.random() < 0.35
        self.stages = rng.choice([1, 1, 2])
        self.quantize_config_json = False
        self.write_seed = rng.randrange(1 << 16)
        self.tied = rng.random() < 0.15
        # the dense MLP (Qwen3-Next's mlp_only_layers) is quantized as the libraries do; lm_head with GPTQModel's
        # `lm_head: true` (not with tied embeddings)
        self.lm_head = False
        group = rng.choice([16, 16, 32, -1])
        if self.kind == "awq":
            self.base = dict(bits=4, group_size=rng.choice([16, 32]), sym=False, desc_act=False)
        else:
            self.base = dict(bits=rng.randint(2, 8), group_size=group, sym=rng.random() < 0.5,
                             desc_act=self.kind == "gptq" and rng.random() < 0.4)
        self.overrides: dict[str, dict] = {}
        if self.kind == "gptq":
            self.v1 = rng.random() < 0.6
            fmt_key = rng.choice(["checkpoint_format", "format"])
            self.qconfig = {"quant_method": "gptq", "bits": self.base["bits"], "group_size": self.base["group_size"],
                            "sym": self.base["sym"], "desc_act": self.base["desc_act"],
                            fmt_key: "gptq" if self.v1 else "gptq_v2"}
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                pat = rng.choice(DYN_POOL)
                if rng.random() < 0.3:
                    self.overrides["-:" + pat] = {}
                else:
                    over = {"bits": rng.randint(2, 8)}
                    if rng.random() < 0.3:
                        over["group_size"] = rng.choice([16, 32, -1])
                    if rng.random() < 0.3:
                        over["sym"] = not self.base["sym"]
                    if rng.random() < 0.2:
                        over["desc_act"] = not self.base["desc_act"]
                    self.overrides[rng.choice(["+:", ""]) + pat] = over
            if self.overrides:
                self.qconfig["dynamic"] = self.overrides
            self.lm_head = not self.tied and rng.random() < 0.3
            if self.lm_head:
                self.qconfig["lm_head"] = True
            self.quantize_config_json = not self.overrides and self.v1 and rng.random() < 0.2
        elif self.kind == "auto-round":
            packing = rng.choice(["auto_round:auto_gptq", "auto_round", "auto_round:gptqmodel", "auto_round:auto_awq"])
            if packing == "auto_round:auto_awq":
                self.base.update(bits=4, sym=False, group_size=rng.choice([16, 32]))
            self.v1 = packing == "auto_round:auto_gptq"
            self.awq = packing == "auto_round:auto_awq"
            self.qconfig = {"quant_method": "auto-round", "bits": self.base["bits"],
                            "group_size": self.base["group_size"], "sym": self.base["sym"], "data_type": "int",
                            "packing_format": packing}
            self.extra_pick = [(rng.random(), rng.randint(2, 8), rng.choice([16, 32, -1]), rng.random() < 0.5,
                                rng.random()) for _ in range(rng.choice([0, 1, 2, 3]))]
        else:
            self.v1, self.awq = False, True
            self.qconfig = {"quant_method": "awq", "bits": 4, "group_size": self.base["group_size"],
                            "zero_point": True, "version": "gemm"}
            if rng.random() < 0.5:
                self.qconfig["modules_to_not_convert"] = ["mlp.gate"]
        if self.kind == "gptq":
            self.awq = False
        self.rng = random.Random(rng.randrange(1 << 30))

    def describe(self) -> str:
        b = self.base
        bits = f"b{b['bits']} g{b['group_size']} {'sym' if b['sym'] else 'asym'}{' act' if b['desc_act'] else ''}"
        fmt = self.qconfig.get("packing_format") or ("v1" if self.v1 else "v2") if self.kind != "awq" else "gemm"
        extras = []
        if self.overrides:
            extras.append(f"{'dynamic' if self.kind == 'gptq' else 'extra'}={json.dumps(self.overrides)}")
        for flag, word in ((self.released, "released"), (self.shard, "sharded"), (self.tied, "tied"),
                           (self.lm_head, "lm_head"),
                           (self.quantize_config_json, "quantize_config.json")):
            if flag:
                extras.append(word)
        extras.append(f"stages={self.stages}")
        return f"{self.family}/{self.model_seed} {self.kind} {fmt} {bits} " + " ".join(extras)


def _files_name(module: str, released: bool) -> str:
    return module.replace("model.", "model.language_model.", 1) if released and module.startswith("model.") \
        else module


def run_case(case: Case, work: Path) -> tuple[str, str]:
    src = work / "src"
    if case.tied:
        cfg = hf_oracle.FAMILIES[case.family]()
        cfg.tie_word_embeddings = True
        hf_oracle.build_from_config(cfg, case.model_seed).save_pretrained(src)
    else:
        save_reference(case.family, src, seed=case.model_seed)
    from safetensors import safe_open

    with safe_open(src / "model.safetensors", "pt") as f:
        shapes = {m: tuple(w.shape) for m, w in tg._per_module({k: f.get_tensor(k) for k in f.keys()})}
    if case.kind == "auto-round" and case.extra_pick:        # overrides on modules that exist
        names = sorted(m for m in shapes if tg.QUANTIZED.search(m) or re.search(r"mlp\.(gate|up|down)_proj$", m))
        for pick, bits, group, sym, skip in case.extra_pick:
            m = names[int(pick * len(names))]
            if m in case.overrides or _files_name(m, True) in case.overrides:
                continue                       # one key a module (two spellings of it would contradict)
            key = _files_name(m, case.released) if case.rng.random() < 0.5 else m
            if skip < 0.3:
                case.overrides[key] = {"bits": 16}
            elif case.awq:
                case.overrides[key] = {"bits": 4, "group_size": case.rng.choice([16, 32])}
            else:
                case.overrides[key] = {"bits": bits, "group_size": group, "sym": sym}
        case.qconfig["extra_config"] = case.overrides

    schemes: dict[str, dict] = {}

    def scheme_of(module: str):
        name = _files_name(module, case.released)
        if case.kind == "gptq":
            s = _scheme_gptq(name, case.base, case.overrides)
        elif case.kind == "auto-round":
            s = _scheme_auto_round(name, module, case.base, case.overrides)
        else:
            s = case.base
        if s is None:
            return None
        out_f, in_f = shapes[module]
        size = in_f if s["group_size"] == -1 else s["group_size"]
        if in_f % size:                 # what the writer (and the quantizers) leave in float
            return None
        return s

    current: dict = {}

    def bits_of(module: str):
        s = scheme_of(module)
        if s is not None:
            schemes[module] = s
        current["s"] = s
        return None if s is None else s["bits"]

    real_quantize = tg._quantize

    def quantize(w, bits, group, sym, act_order, g):
        s = current["s"]
        return real_quantize(w, s["bits"], s["group_size"], s["sym"], s["desc_act"], g)

    tg._quantize = quantize
    real_quantized = tg.QUANTIZED
    tg.QUANTIZED = re.compile(f"(?:{real_quantized.pattern})" + r"|\.mlp\.(gate|up|down)_proj$" +
                              (r"|^lm_head$" if case.lm_head else ""))
    try:
        qdir = tg.write_gptq(src, work / "q", case.qconfig, bits_of, sym=case.base["sym"], act_order=False, group=-1,
                             v1=case.v1, seed=case.write_seed, awq=case.awq)
    finally:
        tg._quantize, tg.QUANTIZED = real_quantize, real_quantized
    quantized = [m for m, s in schemes.items()
                 if (shapes[m][1] * s["bits"]) % 32 == 0 and (shapes[m][0] * s["bits"]) % 32 == 0]
    note = f"{len(quantized)} quantized modules"
    if case.quantize_config_json:
        cfg = json.loads((qdir / "config.json").read_text())
        q = cfg.pop("quantization_config")
        q.pop("quant_method")
        (qdir / "config.json").write_text(json.dumps(cfg))
        (qdir / "quantize_config.json").write_text(json.dumps(q))
    if case.released:
        from safetensors.torch import load_file, save_file

        tensors = load_file(qdir / "model.safetensors")
        save_file({_files_name(k, True): v for k, v in tensors.items()}, qdir / "model.safetensors",
                  metadata={"format": "pt"})
    if case.shard:
        from safetensors import safe_open

        with safe_open(qdir / "model.safetensors", "pt") as f:
            keys = list(f.keys())
        parts = [k for k in keys if k.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx")]
        second = set()
        for k in case.rng.sample(parts, min(len(parts), 6)):
            second.add(k)
        second |= {k for k in keys if case.rng.random() < 0.2}
        tg._shard(qdir, second)
        note += f", {len(second)} tensors in the 2nd file"
    from shared.quant_scheme import refusal
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    why = refusal(qdir)
    if why is not None:
        return "REFUSED", why
    n = json.loads((qdir / "config.json").read_text())["num_hidden_layers"]
    if case.stages == 1:
        def stages_of(d):
            return [load_model(d, LoadOptions(dtype=torch.float32))]
    else:
        cut = case.rng.randint(1, n - 1)
        note += f", split at {cut}"

        def stages_of(d):
            return [load_model(d, LoadOptions(dtype=torch.float32, start=0, end=cut)),
                    load_model(d, LoadOptions(dtype=torch.float32, start=cut, end=n))]
    tg._check_against_reference(qdir, stages_of)
    return "PASS", note


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=3901)
    ap.add_argument("--cases", type=int, default=10)
    ap.add_argument("--only", type=int, default=None, help="run only case number N of the seed")
    ap.add_argument("--keep", action="store_true", help="keep each case's files (printed)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    for i in range(args.cases):
        case = Case(rng, i)
        if args.only is not None and i != args.only:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"qa_gptq_{args.seed}_{i}_"))
        t0 = time.time()
        try:
            status, note = run_case(case, work)
        except AssertionError as exc:
            status, note = "FAIL", f"mismatch: {exc!r}"[:300]
        except Exception as exc:                 # a refusal at load, or a crash
            status = "REFUSED" if type(exc).__name__ in ("CheckpointError", "QuantSchemeError") else "FAIL"
            note = f"{type(exc).__name__}: {exc}"[:600]
            if status == "FAIL":
                note += " | " + traceback.format_exc().strip().splitlines()[-3][:200]
        counts[status] = counts.get(status, 0) + 1
        print(f"[{args.seed}:{i}] {status} {case.describe()} ({time.time() - t0:.0f}s) {note}", flush=True)
        if args.keep:
            print(f"    files: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"seed {args.seed}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    return 1 if counts.get("FAIL") or counts.get("REFUSED") else 0


if __name__ == "__main__":
    sys.exit(main())
