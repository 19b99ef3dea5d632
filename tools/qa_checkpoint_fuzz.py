"""Fuzz valid model configs and stage splits against transformers (the oracle).

Each case draws a random config of one family (Qwen3-Next, Qwen3.5-MoE text, Qwen4-Exp text) that transformers
accepts, builds that model at random weights, writes it with `save_pretrained` (bfloat16 files when the config says
so, `mtp.*` tensors added when it has MTP layers), and checks moepipe against it on the CPU in float32:

- the prompt's log-probabilities and teacher-forced greedy decode steps, with the layers cut into a random number of
  stages (1..num_layers) at random points (`LocalEngine`), within 1e-4 as the parity tests;
- a greedy completion of 8 tokens through the engine core and the in-process executor (`local_engine_core`), at
  another random split: the same tokens as transformers' greedy loop;
- with --serve N, the first N cases that can be served (vocab >= 330 for the byte-level tokenizer) also through a
  real 2-3 stage cluster (`gateway.launcher.Cluster`): the same text and log-probabilities as the in-process run.

A config transformers refuses is drawn again. moepipe refusing a config transformers accepts is a finding unless the
message names a field (`config field '...'`), which is then reported as a refusal. Near-ties (the reference's top
two logits within 1e-4) are not counted as mismatches.

    python3 tools/qa_checkpoint_fuzz.py --seed 1 --cases 40 [--family qwen3_next] [--serve 3] [--keep DIR]
    python3 tools/qa_checkpoint_fuzz.py --cli-stages     # `moepipe serve --stages` 0, -1, > layers

Not collected by pytest: tests/test_qa_checkpoint_fuzz.py keeps the cases it found bugs with.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch
from hf_oracle import build_from_config, reference_logits

LIN, FULL, IDX = "linear_attention", "full_attention", "indexed_attention"
FAMILIES = ("qwen3_next", "qwen3_5_moe", "qwen4_exp")
TOL = 1e-4
TIE = 1e-4
TIE_GAP = 1e-5             # a top-k cut this close (QSA block scores, router probabilities) is a tie
NEW = 8
SERVE_VOCAB = 330          # the smallest byte-level tokenizer write_tokenizer_files makes


@dataclass
class Case:
    family: str
    kw: dict                       # the transformers config's arguments
    dtype: str = "float32"         # the checkpoint files' dtype (and config.json's)
    mtp_layers: int = 0            # mtp.* tensors written into the file
    seed: int = 0
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return json.dumps({"family": self.family, "dtype": self.dtype, "mtp_layers": self.mtp_layers, **self.kw,
                           "notes": self.notes},
                          default=str, sort_keys=True)


# ---- the generator --------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rope(rng: random.Random, head_dim: int, family: str, max_pos: int) -> dict:
    factor = rng.choice([0.25, 0.5, 0.75, 1.0, 0.0, round(rng.uniform(0.05, 1.0), 3)])
    rope: dict = {"rope_type": "default", "rope_theta": rng.choice([100.0, 10000.0, 1e6, rng.uniform(50, 5e5)])}
    if rng.random() < 0.8:        # else the family's default: 0.25, Qwen4-Exp 1.0
        rope["partial_rotary_factor"] = factor
    if rng.random() < 0.15:
        del rope["rope_theta"]
    kind = rng.choice(["default"] * 4 + ["linear", "yarn", "llama3", "dynamic"])
    if kind == "linear":
        rope.update(rope_type="linear", factor=rng.choice([1.0, 2.0, 3.5]))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=rng.choice([2.0, 4.0, 8.0]))
        if rng.random() < 0.7:
            rope["original_max_position_embeddings"] = rng.choice([8, 16, max_pos])
        for key, vals in (("beta_fast", [16, 32]), ("beta_slow", [1, 2]), ("attention_factor", [1.2]),
                          ("truncate", [False])):
            if rng.random() < 0.3:
                rope[key] = rng.choice(vals)
        if rng.random() < 0.2:
            rope.update(mscale=1.0, mscale_all_dim=rng.choice([0.5, 1.0]))
    elif kind == "llama3":
        rope.update(rope_type="llama3", factor=rng.choice([2.0, 8.0]), low_freq_factor=1.0,
                    high_freq_factor=rng.choice([2.0, 4.0]), original_max_position_embeddings=rng.choice([8, 16]))
    elif kind == "dynamic":
        rope.update(rope_type="dynamic", factor=2.0)
    return rope


def rotary_dim(head_dim: int, rope: dict, family: str) -> int:
    """The features transformers rotates: int(head_dim * factor) rounded up to even (one frequency per pair, an odd
    last feature's included), as moepipe's config check counts them."""
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0 if family == "qwen4_exp" else 0.25))
    return dim + dim % 2


def _layer_types(kw: dict, attn: str) -> list[str]:
    """The layer types the config class derives from full_attention_interval when none are given."""
    return kw.get("layer_types") or [
        LIN if (i + 1) % kw["full_attention_interval"] else attn for i in range(kw["num_hidden_layers"])]


def random_case(rng: random.Random, family: str, *, servable: bool = False) -> Case:
    layers = rng.randint(1, 6)
    heads = rng.randint(1, 6)
    hidden = rng.choice([8, 12, 16, 20, 24, 30, 32, 40, rng.randint(3, 40)])
    head_dim = rng.choice([rng.randint(2, 20)] * 9 + [256])       # 256: the default, left out of config.json
    vocab = rng.randint(SERVE_VOCAB, 420) if servable else rng.choice([rng.randint(64, 420), 128, 256, 320])
    max_pos = rng.choice([rng.randint(12, 40), 64, 256, 4096])
    lin_k = rng.randint(1, 4)
    kw = dict(  # noqa: C408 (the transformers config's keyword arguments)
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=rng.choice(_divisors(heads)), head_dim=head_dim,
        linear_num_key_heads=lin_k, linear_num_value_heads=lin_k * rng.randint(1, 3),
        linear_key_head_dim=rng.randint(2, 12), linear_value_head_dim=rng.randint(2, 12),
        linear_conv_kernel_dim=rng.randint(1, 5),
        moe_intermediate_size=rng.randint(1, 20), shared_expert_intermediate_size=rng.choice([0, rng.randint(1, 24)]),
        rms_norm_eps=rng.choice([1e-6, 1e-5, 0.01]), tie_word_embeddings=rng.random() < 0.3,
        attention_bias=rng.random() < 0.3, max_position_embeddings=max_pos,
        eos_token_id=rng.choice([5, [5, 7], 2]),
        rope_parameters=_rope(rng, head_dim, family, max_pos),
    )
    if rng.random() < 0.15:
        kw["hidden_act"] = rng.choice(["gelu_pytorch_tanh", "relu2", "swish", "gelu"])
    experts = rng.randint(1, 10)
    kw.update(num_experts=experts, num_experts_per_tok=rng.randint(1, experts))
    if family != "qwen3_5_moe" and rng.random() < 0.5:
        kw["norm_topk_prob"] = rng.random() < 0.5
    attn = IDX if family == "qwen4_exp" else FULL
    if rng.random() < 0.3:
        kw["full_attention_interval"] = rng.randint(1, 4)      # layer_types derived by the config class
    else:
        kw["layer_types"] = [rng.choice([LIN, attn]) for _ in range(layers)]
    if attn in _layer_types(kw, attn) and rotary_dim(head_dim, kw["rope_parameters"], family) > head_dim:
        # an odd head_dim rotated whole (factor 1.0) rotates one feature more than the head has: transformers cannot
        # run the attention layers and moepipe refuses naming partial_rotary_factor; with linear layers alone it is
        # valid and kept (tests/test_qa_checkpoint_fuzz.py). Rotate head_dim - 1 features instead (even: YaRN too)
        kw["rope_parameters"]["partial_rotary_factor"] = (head_dim - 0.5) / head_dim
    if family == "qwen3_next":
        kw["intermediate_size"] = rng.randint(1, 40)
        if rng.random() < 0.15:
            kw["num_experts"] = 0
            kw.pop("num_experts_per_tok")
        if rng.random() < 0.4:
            kw["decoder_sparse_step"] = rng.randint(1, 3)
        if rng.random() < 0.4:
            kw["mlp_only_layers"] = sorted(rng.sample(range(layers), rng.randint(0, layers)))
    if family == "qwen4_exp":
        _qwen4(rng, kw)
    case = Case(family, kw, dtype=rng.choice(["float32", "float32", "bfloat16", "float16"]),
                mtp_layers=rng.choice([0, 0, 1, 2]), seed=rng.randint(0, 10**6))
    return case


def _qwen4(rng: random.Random, kw: dict) -> None:
    kw["shared_expert_intermediate_size"] = kw["shared_expert_intermediate_size"] or rng.randint(1, 24)
    kw.update(hc_count=rng.randint(2, 4), hc_lowrank=rng.randint(1, 8),
              output_gate_type=rng.choice(["sigmoid", "silu", None]))
    if rng.random() < 0.5:
        kw["seed"] = rng.randint(0, 5000)          # the n-gram hash's seed
    if kw.get("hidden_act", "silu") not in ("silu", "swish") and kw["output_gate_type"] is None:
        kw["output_gate_type"] = "sigmoid"        # transformers' config refuses another gate activation
    layer_types = _layer_types(kw, IDX)
    if IDX in layer_types:         # transformers' indexer fields default to None: it cannot build one without them
        ratio = rng.randint(1, 4)
        # the indexer's keys hold the rotated features: rounded up to even (head_dim 11 at 0.5 rotates 6, not 5)
        rot = rotary_dim(kw["head_dim"], kw["rope_parameters"], "qwen4_exp")
        # 8+ indexer heads of 4+ features: with fewer, blocks often all score exactly 0 (every head's ReLU), a tie
        # transformers' topk and moepipe's lower-index rule break differently (tests/test_unseen_checkpoints_2.py)
        kw.update(indexer_n_heads=rng.choice([8, 12]), indexer_kv_heads=1,
                  indexer_head_dim=max(rot + rng.randint(0, 3), 4), indexer_compress_ratio=ratio,
                  indexer_budget=ratio * rng.randint(1, 4))
    linear = [i + 1 for i, t in enumerate(layer_types) if t == LIN]
    if linear and rng.random() < 0.7:
        ngram = rng.randint(2, 4)
        per = rng.randint(1, 3)
        heads = (ngram - 1) * per
        kw.update(ple_layer_ids=sorted(rng.sample(linear, rng.randint(1, len(linear)))), ngram_size=ngram,
                  heads_per_ngram=per, ple_embed_dim=heads * rng.randint(1, 4),
                  ple_conv_kernel_size=rng.randint(1, 4), ngram_vocab_size_base=rng.randint(20, 80),
                  make_ngram_vocab_size_divisible_by=rng.choice([1, 8, 16]), split_ngram_parts=rng.randint(1, 4))


def hf_config(case: Case):
    """The transformers config, or raises what transformers raises for it."""
    from transformers import Qwen3NextConfig, Qwen4ExpTextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    cls = {"qwen3_next": Qwen3NextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig,
           "qwen4_exp": Qwen4ExpTextConfig}[case.family]
    kw = dict(case.kw)
    if case.mtp_layers:
        kw["mtp_num_hidden_layers"] = case.mtp_layers
    return cls(**kw)


# ---- writing the checkpoint ------------------------------------------------------------------------------------------

def write_checkpoint(case: Case, out: Path):
    """save_pretrained at random weights; returns the float32 transformers model of exactly the weights on disk."""
    cfg = hf_config(case)
    model = build_from_config(cfg, case.seed)
    if case.dtype != "float32":
        model = model.to(getattr(torch, case.dtype))
    model.config.dtype = case.dtype
    model.save_pretrained(out)
    if case.dtype != "float32":
        # read back: model.float() would keep buffers (RoPE inv_freq) rounded to the half dtype, which
        # from_pretrained recomputes in float32 (a 1e-4 log-prob difference of the oracle's own)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                     experts_implementation="eager").float().eval()
    written = json.loads((out / "config.json").read_text())
    assert written.get("dtype") == case.dtype, (written.get("dtype"), case.dtype)
    if case.mtp_layers:
        _add_mtp(out, model, case)
    return model


def _add_mtp(out: Path, model, case: Case) -> None:
    """An MTP head's tensors, as released checkpoints carry them (transformers never builds the head)."""
    from safetensors.torch import load_file, save_file

    f = out / "model.safetensors"
    tensors = load_file(f)
    dt = getattr(torch, case.dtype)
    h = model.config.hidden_size
    extra = {"mtp.fc.weight": torch.randn(h, 2 * h), "mtp.norm.weight": torch.ones(h),
             "mtp.pre_fc_norm_embedding.weight": torch.ones(h), "mtp.pre_fc_norm_hidden.weight": torch.ones(h)}
    for i in range(case.mtp_layers):
        extra[f"mtp.layers.{i}.input_layernorm.weight"] = torch.ones(h)
        extra[f"mtp.layers.{i}.self_attn.q_proj.weight"] = torch.randn(8, h)
        extra[f"mtp.layers.{i}.mlp.experts.0.up_proj.weight"] = torch.randn(4, h)
    tensors.update({k: v.to(dt) for k, v in extra.items()})
    save_file(tensors, f, metadata={"format": "pt"})


# ---- the checks ------------------------------------------------------------------------------------------------------

def random_ranges(rng: random.Random, layers: int) -> list[tuple[int, int]]:
    n = rng.randint(1, layers)
    cuts = sorted(rng.sample(range(1, layers), n - 1))
    bounds = [0, *cuts, layers]
    return list(itertools.pairwise(bounds))


def reference(model, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor, float]:
    """transformers' greedy continuation, its logits at every position of prompt + continuation, and the smallest
    gap at the cut of any top-k it took (QSA blocks, experts): near 0 the selection is a tie that transformers'
    torch.topk breaks as it likes and moepipe by the lower index (docs/model.md, sections 5 and 7)."""
    gaps = [float("inf")]
    topk, method = torch.topk, torch.Tensor.topk

    def recording(self, k, dim=-1, *args, **kw):
        out = topk(self, k, dim, *args, **kw)
        if self.shape[dim] > k > 0:
            ranked = self.sort(dim=dim, descending=True).values
            gaps.append(float((ranked.narrow(dim, k - 1, 1) - ranked.narrow(dim, k, 1)).abs().min()))
        return out

    torch.Tensor.topk = torch.topk = recording       # routers call the function, the QSA indexer the method
    try:
        ids = list(prompt)
        for _ in range(new):
            ids.append(int(reference_logits(model, ids)[-1].argmax()))
        return ids[len(prompt):], reference_logits(model, ids), min(gaps)
    finally:
        torch.topk, torch.Tensor.topk = topk, method


def _longest_context(hf) -> int:
    """What the served context length should be from transformers' view of the config (vLLM's rule)."""
    rope = hf.rope_parameters or {}
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return int(hf.max_position_embeddings * rope["factor"])
    if kind == "yarn":
        orig = rope.get("original_max_position_embeddings") or hf.max_position_embeddings
        return max(hf.max_position_embeddings, int(orig * rope["factor"]))
    return hf.max_position_embeddings


def is_tie(logits: torch.Tensor) -> bool:
    top = logits.topk(2).values
    return bool(top[0] - top[1] < TIE)


def check_split(path: Path, ranges, prompt: list[int], want_ids: list[int], want: torch.Tensor) -> tuple[float, str]:
    """Log-probability error of a LocalEngine over `ranges` against `want`; a message if the greedy tokens differ
    off a near-tie."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.local_engine import LocalEngine

    parts = [load_model(path, LoadOptions(start=s, end=e, dtype=torch.float32)) for s, e in ranges]
    engine = LocalEngine(parts, max_seqs=1, max_tokens=64)
    engine.add(0)
    got = [engine.step([(0, prompt)], all_logits=True)]
    for tok in want_ids[:-1]:
        got.append(engine.step([(0, [tok])], all_logits=True))
    got = torch.cat(got)
    want = want[:-1]
    err = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
    for pos, tok in enumerate(want_ids):
        row = len(prompt) - 1 + pos
        if int(got[row].argmax()) != tok and not is_tie(want[row]):
            return err, f"greedy token {pos} differs: {int(got[row].argmax())} != {tok}"
    return err, ""


def check_core(path: Path, ranges, prompt: list[int], want_ids: list[int], want: torch.Tensor, max_pos: int,
               chunk: int = 512) -> str:
    """A greedy request through the engine core and the in-process executor: transformers' tokens (up to a tie),
    as many as the context allows."""
    from conftest import collect_events

    from shared.engine_core import GenerationRequest
    from shared.sampling import SamplingParams
    from stage_worker.inprocess_executor import local_engine_core

    # max_model_len: the context transformers serves (a linear or YaRN factor over max_position_embeddings), not
    # the default (max_position_embeddings)
    core = local_engine_core(path, max_num_seqs=2, ranges=ranges, max_model_len=max_pos,
                             max_num_batched_tokens=chunk)
    try:
        req = GenerationRequest("r", list(prompt), SamplingParams(max_tokens=NEW, temperature=0.0), ignore_eos=True)
        events = collect_events(core, [req], timeout=120)[0]
    finally:
        core.stop()
    bad = [e for e in events if isinstance(e, Exception)]
    if bad:
        return f"engine core error: {bad[0]!r}"
    got = [e.token_id for e in events if e.token_id is not None]
    expect = min(NEW, max(max_pos, 0) - len(prompt))
    if len(got) != expect:
        return f"engine core gave {len(got)} tokens, expected {expect} (max_position_embeddings {max_pos})"
    for i, (a, b) in enumerate(zip(got, want_ids)):
        if a != b:
            if is_tie(want[len(prompt) - 1 + i]):
                return ""
            return f"engine core token {i} differs: {got} != {want_ids}"
    return ""


def check_served(path: Path, model, prompt: list[int], stages: int, ranges_ip, max_len: int) -> str:
    """A real `moepipe serve --stages N` answers a greedy completion with the in-process run's text and
    log-probabilities."""
    from conftest import OpenAI, collect_events, free_port

    from gateway.launcher import Cluster, ServeOptions
    from shared.engine_core import GenerationRequest
    from shared.sampling import SamplingParams
    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files
    from stage_worker.inprocess_executor import local_engine_core

    write_tokenizer_files(path, vocab_size=model.config.vocab_size, model_max_length=256)
    core = local_engine_core(path, max_num_seqs=2, ranges=ranges_ip, max_model_len=max_len)
    try:
        # as many tokens as the context leaves (the API refuses more, as vLLM does)
        budget = min(NEW, max_len - len(prompt))
        req = GenerationRequest("r", list(prompt), SamplingParams(max_tokens=budget, temperature=0.0, logprobs=0),
                                ignore_eos=True)
        events = collect_events(core, [req], timeout=120)[0]
    finally:
        core.stop()
    ids = [e.token_id for e in events if getattr(e, "token_id", None) is not None]
    lps = [e.logprob for e in events if getattr(e, "token_id", None) is not None]
    text = Tokenizer.from_dir(path).decode(ids)
    with Cluster(ServeOptions(model=path, stages=stages, port=free_port(),
                              extra={"max_num_batched_tokens": 32, "max_model_len": max_len})) as c:
        res = OpenAI(base_url=c.url + "/v1", api_key="x").completions.create(
            model="moepipe", prompt=prompt, max_tokens=len(ids), temperature=0, logprobs=0,
            extra_body={"ignore_eos": True})
    got = res.choices[0]
    if got.text != text:
        return f"served text {got.text!r} != in-process {text!r}"
    served = got.logprobs.token_logprobs
    if len(served) != len(lps) or max(abs(a - b) for a, b in zip(served, lps)) > TOL:
        return f"served logprobs {served} != in-process {lps}"
    return ""


@dataclass
class Result:
    case: Case
    status: str                  # ok, refused, transformers_refused, mismatch, crash
    detail: str = ""
    err: float = 0.0
    ranges: list = field(default_factory=list)
    seconds: float = 0.0


def _mismatch(gap: float) -> str:
    """A difference where transformers took a top-k at a tie is that tie's (status "tie"), else a finding."""
    return "tie" if gap < TIE_GAP else "mismatch"


def run_case(case: Case, rng: random.Random, work: Path, serve_stages: int = 0) -> Result:
    from shared.model_config import ConfigError, load_config

    t0 = time.monotonic()
    path = work / "ckpt"
    shutil.rmtree(path, ignore_errors=True)
    try:
        model = write_checkpoint(case, path)
    except Exception as exc:  # noqa: BLE001 - transformers itself refuses or cannot build it: not ours to serve
        return Result(case, "transformers_refused", f"{type(exc).__name__}: {exc}"[:300])
    layers = model.config.num_hidden_layers
    # the prompt fits the context moepipe serves (longest_context) as transformers reads config.json
    limit = _longest_context(model.config)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, max(1, min(40, limit - 1))))]
    if rng.random() < 0.5:
        prompt[rng.randrange(len(prompt))] = 5            # an EOS inside (PLE hash resets there)
    case.notes.append(f"prompt={prompt}")
    try:
        # dynamic NTK rescales every position once a sequence passes max_position_embeddings, which moepipe never
        # serves (longest_context): compare within it; other RoPE types agree past it (test_unseen_checkpoints_2)
        dynamic = (model.config.rope_parameters or {}).get("rope_type") == "dynamic"
        want_ids, want, gap = reference(model, prompt, min(NEW, limit - len(prompt)) if dynamic else NEW)
    except Exception as exc:  # noqa: BLE001 - transformers builds it but cannot run it
        return Result(case, "transformers_refused", "forward: " + f"{type(exc).__name__}: {exc}"[:300])
    try:
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            # a refusal naming the field, of a config transformers computes: worth a look (status "refused")
            status = "refused" if "config field '" in str(exc) else "crash"
            return Result(case, status, str(exc)[:300], seconds=time.monotonic() - t0)
        if cfg.longest_context != limit:
            return Result(case, "mismatch", f"longest_context {cfg.longest_context} != {limit}")
        worst, ranges_all = 0.0, []
        for _ in range(2):
            ranges = random_ranges(rng, layers)
            ranges_all.append(ranges)
            err, msg = check_split(path, ranges, prompt, want_ids, want)
            worst = max(worst, err)
            if msg or err > TOL:
                return Result(case, _mismatch(gap), (msg or f"log-prob error {err:.3g} at stages {ranges}") + f" [gap {gap:.2g}]", err,
                              ranges_all, time.monotonic() - t0)
        ranges = random_ranges(rng, layers)
        ranges_all.append(ranges)
        chunk = rng.choice([1, 3, 7, 16, 512])         # prefill chunks (max_num_batched_tokens)
        case.notes.append(f"core: stages {ranges}, chunk {chunk}")
        msg = check_core(path, ranges, prompt, want_ids, want, cfg.longest_context, chunk)
        if msg:
            return Result(case, _mismatch(gap), msg, worst, ranges_all, time.monotonic() - t0)
        if serve_stages:
            msg = check_served(path, model, prompt, min(serve_stages, layers), ranges, cfg.longest_context)
            if msg:
                return Result(case, _mismatch(gap), "served: " + msg, worst, ranges_all, time.monotonic() - t0)
        return Result(case, "ok", "", worst, ranges_all, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001
        return Result(case, "crash", "".join(traceback.format_exception_only(exc)).strip()[-600:] + "\n"
                      + "".join(traceback.format_tb(exc.__traceback__)[-3:]), ranges=[],
                      seconds=time.monotonic() - t0)


def cli_stage_counts(work: Path) -> list[str]:
    """`moepipe serve --stages N` for N that cannot work: exit status 2 and a one-line message naming --stages."""
    from stage_worker.checkpoint.make_model import make_model

    ckpt = make_model("tiny", work / "tiny", seed=0)
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    problems = []
    for flag, n in (("--stages", 0), ("--stages", -1), ("--stages", layers + 1), ("--pipeline-parallel-size", 0),
                    ("--pipeline-parallel-size", layers + 5)):
        proc = subprocess.run([sys.executable, "-m", "shared.cli", "serve", "--model", str(ckpt), f"{flag}={n}",
                               "--port", "18999"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        ok = proc.returncode == 2 and f"--stages {n}" in last and str(layers) in last
        print(f"  {flag} {n}: rc {proc.returncode}: {last}")
        if not ok:
            problems.append(f"{flag} {n}: rc {proc.returncode}: {last}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--family", choices=FAMILIES, action="append")
    ap.add_argument("--serve", type=int, default=0, help="serve this many cases by a real 2-3 stage cluster")
    ap.add_argument("--cli-stages", action="store_true", help="check the CLI's refusal of bad stage counts")
    ap.add_argument("--keep", type=Path, help="copy each failing case's checkpoint under this directory")
    args = ap.parse_args(argv)
    sys.modules.setdefault("fla", None)
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="qa-ckpt-fuzz-"))
    failures = 0
    try:
        if args.cli_stages:
            problems = cli_stage_counts(work)
            print("cli stages:", "ok" if not problems else problems)
            failures += len(problems)
        rng = random.Random(args.seed)
        families = args.family or list(FAMILIES)
        counts: dict[str, int] = {}
        served = 0
        for i in range(args.cases):
            family = families[i % len(families)]
            want_serve = served < args.serve
            for _ in range(50):        # draw until transformers accepts the config
                case = random_case(rng, family, servable=want_serve)
                try:
                    hf_config(case)
                    break
                except Exception:  # noqa: BLE001
                    counts["transformers_refused"] = counts.get("transformers_refused", 0) + 1
            stages = rng.randint(2, 3) if want_serve else 0
            res = run_case(case, rng, work, stages)
            served += bool(stages) and res.status == "ok"
            counts[res.status] = counts.get(res.status, 0) + 1
            tag = f"[{i}] {family} {res.status} err={res.err:.1e} {res.seconds:.1f}s splits={res.ranges}"
            if stages:
                tag += f" served@{stages}"
            print(tag, flush=True)
            if res.status not in ("ok",):
                print("   ", case.describe())
                print("   ", res.detail.replace("\n", "\n    "))
            if res.status in ("mismatch", "crash"):
                failures += 1
                if args.keep:
                    dest = args.keep / f"case{args.seed}-{i}"
                    shutil.rmtree(dest, ignore_errors=True)
                    shutil.copytree(work / "ckpt", dest)
                    (dest / "case.json").write_text(case.describe())
        print("summary:", json.dumps(counts, sort_keys=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
