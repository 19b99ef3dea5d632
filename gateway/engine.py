"""The boundary between the HTTP layer and whatever runs the model.

The API layer turns an OpenAI request into a `GenerationRequest` (token ids, sampling parameters with
generation_config.json defaults already applied) and consumes `TokenEvent`s. The cluster backend (scheduler + stage
workers over ZeroMQ) implements `Engine`; so does the single-process backend used by `moepipe generate`-style tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from shared.sampling import SamplingParams


class EngineUnavailable(RuntimeError):
    """A component is down: new requests fail fast with 503 naming it."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: 429."""


class EngineFailed(RuntimeError):
    """A request in flight could not finish (a stage died or errored): the stream ends with an error."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams                 # defaults applied; params.max_tokens is the generation budget
    stop_token_ids: set[int] = field(default_factory=set)
    prompt_logprobs: bool = False          # echo: logprob of every prompt token given its prefix
    ignore_eos: bool = False
    grammar: Any = None                    # structured output: gateway.grammar.GrammarState, advanced per token


@dataclass
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None       # (token id, logprob), best first
    finish_reason: str | None = None       # "stop" (EOS / stop token) or "length" on the last event
    prompt_logprobs: list[float | None] | None = None         # only on the first event, when asked


class Engine(Protocol):
    max_model_len: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Tokens as they are sampled. Closing the iterator early (client gone) cancels the request and frees its
        blocks and slots at once. Raises EngineUnavailable / EngineOverloaded before the first token, EngineFailed
        after."""
        ...

    def health(self) -> list[str]:
        """Names of components that missed their heartbeat deadline (empty: healthy)."""
        ...
