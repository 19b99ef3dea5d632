"""`moepipe generate`: in-process generation, streaming text to the terminal.

The server's own path in one process: the engine core (scheduler, finish rule) over the in-process executor (the
stage runners and their sampler), with the gateway's tokenizer. Sampling parameters not given on the command line
come from the checkpoint's generation_config.json.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shared.engine_core import GenerationRequest
from shared.model_config import load_config
from shared.sampling import SamplingParams, read_generation_config
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from stage_worker.inprocess_executor import local_engine_core


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
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    prompt_ids = tok.encode(text)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    limit = load_config(model_dir).max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {limit}")
    stops = set(params.stop_token_ids) | set(gen_cfg.get("eos_token_id") or tok.eos_token_ids)
    core = local_engine_core(model_dir, device=device, max_num_seqs=1,
                             max_model_len=min(limit, len(prompt_ids) + params.max_tokens))
    detok = IncrementalDetokenizer(tok)
    out: list[int] = []
    pieces: list[str] = []
    finish = "length"
    try:
        for event in core.stream(GenerationRequest("generate", prompt_ids, params, stop_token_ids=stops)):
            finish = event.finish_reason or finish
            if event.finish_reason == "stop" and event.token_id in stops:
                break
            out.append(event.token_id)
            piece = detok.push(event.token_id)
            if piece:
                pieces.append(piece)
                if on_text:
                    on_text(piece)
    finally:
        core.stop()
    tail = detok.flush()
    if tail:
        pieces.append(tail)
        if on_text:
            on_text(tail)
    return GenerateResult(out, "".join(pieces), finish, len(prompt_ids), time.time() - t0)


def run_cli(args) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed)

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    res = generate(Path(args.model), args.prompt, params, chat=args.chat, on_text=emit, device=args.device)
    sys.stdout.write("\n")
    n = len(res.token_ids)
    print(f"[{n} tokens, finish_reason={res.finish_reason}, prompt {res.prompt_tokens} tokens, "
          f"{res.seconds:.2f} s]", file=sys.stderr)
    return 0
