"""`moepipe generate`: in-process generation, streaming text to the terminal.

Uses the same model, sampler and tokenizer code as the server, in one process with `LocalEngine`. Sampling parameters
not given on the command line come from the checkpoint's generation_config.json.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.sampling import SamplingParams, read_generation_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine
from stage_worker.sampler import apply_logit_bias, apply_penalties, position_generator, random_seed, sample


@dataclass
class GenerateResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    seconds: float


def generate(model_dir: Path, prompt: str, params: SamplingParams, *, chat: bool = False,
             on_text: Callable[[str], None] | None = None, device: str = "cpu") -> GenerateResult:
    t0 = time.time()
    tok = Tokenizer.from_dir(model_dir)
    gen_cfg = read_generation_config(model_dir)
    params = params.with_defaults(gen_cfg)
    model = load_model(model_dir, LoadOptions(device=device))
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    prompt_ids = tok.encode(text)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    limit = model.cfg.max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {limit}")
    max_new = min(params.max_tokens, limit - len(prompt_ids))
    engine = LocalEngine([model], max_seqs=1, max_tokens=len(prompt_ids) + max_new)
    engine.add(0)
    stops = set(params.stop_token_ids) | set(gen_cfg.get("eos_token_id") or tok.eos_token_ids)
    detok = IncrementalDetokenizer(tok)
    out: list[int] = []
    pieces: list[str] = []
    finish = "length"
    for tid in _tokens(engine, prompt_ids, params, max_new):
        if tid in stops:
            finish = "stop"
            break
        out.append(tid)
        piece = detok.push(tid)
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)
    tail = detok.flush()
    if tail:
        pieces.append(tail)
        if on_text:
            on_text(tail)
    return GenerateResult(out, "".join(pieces), finish, len(prompt_ids), time.time() - t0)


def _tokens(engine: LocalEngine, prompt_ids: list[int], params: SamplingParams, max_new: int) -> Iterator[int]:
    seed = params.seed if params.seed is not None else random_seed()
    logits = engine.step([(0, prompt_ids)])[0]
    history: list[int] = []
    for i in range(max_new):
        gen = position_generator(seed, len(prompt_ids) + i)
        tid = sample(apply_penalties(apply_logit_bias(logits, params.logit_bias), params, history, prompt_ids), params,
                     gen)
        history.append(tid)
        yield tid
        logits = engine.step([(0, [tid])])[0]


def run_cli(args) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed)

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with torch.inference_mode():
        res = generate(Path(args.model), args.prompt, params, chat=args.chat, on_text=emit, device=args.device)
    sys.stdout.write("\n")
    n = len(res.token_ids)
    print(f"[{n} tokens, finish_reason={res.finish_reason}, prompt {res.prompt_tokens} tokens, "
          f"{res.seconds:.2f} s]", file=sys.stderr)
    return 0
