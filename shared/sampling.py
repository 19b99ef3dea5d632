"""Sampling parameters of one request, and how omitted ones are filled from generation_config.json.

A field left as None means "not given by the request"; `with_defaults` fills it from the checkpoint's
generation_config.json, then from the fixed fallbacks below (a report lost a day to dropped defaults).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLING_EPS = 1e-5      # vLLM's: a temperature below it is greedy (sampling there only picks among tied logits)
FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None            # None: no logprobs; k >= 0: the sampled token's plus top-k
    logit_bias: dict[int, float] | None = None   # token id -> value added to its raw logit (OpenAI logit_bias)
    min_tokens: int = 0                    # vLLM's: stop tokens are not sampled, stop strings not matched, before

    def with_defaults(self, generation_config: dict[str, Any]) -> "SamplingParams":
        values = {}
        greedy = generation_config.get("do_sample") is False
        for name, fallback in FALLBACK.items():
            given = getattr(self, name)
            if given is not None:
                values[name] = given
            elif name == "temperature" and greedy:
                values[name] = 0.0
            else:
                values[name] = generation_config.get(name, fallback)
        return dataclasses.replace(self, **values)

    @property
    def greedy(self) -> bool:
        return (self.temperature or 0.0) < SAMPLING_EPS or self.top_k == 1


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    eos = cfg.get("eos_token_id")
    if isinstance(eos, int):
        cfg["eos_token_id"] = [eos]
    return cfg


def random_seed() -> int:
    """A request's seed when it gives none: drawn once, so its draws still depend only on (seed, position)."""
    return secrets.randbits(62)
