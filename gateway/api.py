"""The OpenAI-compatible HTTP API over any `Engine`: /v1/chat/completions, /v1/responses, /v1/completions,
/v1/models, /health, /metrics. A Responses request is translated into a chat request (gateway/responses.py) and
served by the chat path.

Each request is parsed by hand (size limit, strict UTF-8, JSON, then pydantic) so every client mistake becomes an
OpenAI-shaped 4xx naming the field. Every choice (`n`, and each prompt of a completions prompt list) is its own
engine request, a `_Generation`; choice index = prompt_i * n + j, as vLLM numbers them. The engine's first token of
every choice is awaited before a response starts, so back-pressure and outages still answer 429/503 instead of a
broken stream. Whatever way a request ends (finished, stop string, client gone, error), every choice's engine
iterator is closed in a `finally`, which cancels it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from gateway import access_log, errors, responses
from gateway.engine import Engine
from gateway.errors import APIError, invalid_request
from gateway.metrics import Metrics, RequestTimer
from gateway.openapi_doc import install_openapi
from gateway.chat_plan import ChatPlan, completion_grammar, plan_chat, template_messages
from gateway.output_parser import Delta
from gateway.schemas import (ChatChoice, ChatChunkChoice, ChatMessage, ChatCompletionChunk, ChatCompletionRequest,
                             ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob,
                             CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
                             CompletionResponse, DeltaFunction, DeltaMessage, DeltaToolCall, FunctionCall,
                             DetokenizeRequest, DetokenizeResponse, InputTokensResponse, MAX_CHOICES, ModelCard,
                             ModelList, PromptLogprob, PromptLogprobsList, PromptTokensDetails, ResponsesRequest,
                             SEED_MAX, TokenizeRequest, TokenizeResponse,
                             ToolCall, TopLogprob, Usage, VersionResponse)
from gateway.stop import StopMatcher
from shared.engine_core import (EngineFailed, EngineInterrupted, EngineOverloaded, EngineUnavailable, GenerationRequest,
                                TokenEvent)
from shared.protocol import PromptLogprobs
from shared.sampling import SamplingParams
from shared.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["create_app", "DEFAULT_MAX_BODY_BYTES"]

log = logging.getLogger("moepipe.gateway")

DEFAULT_MAX_BODY_BYTES = 16 << 20
NORMALIZE_SLACK = 4          # NFC can shrink text up to 3x (decomposed Hangul); bytes/token bound gets this margin
MIN_LOGPROB = -9999.0        # vLLM's stand-in for -inf, which JSON cannot carry
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
MAX_LOGIT_BIAS = 100.0
# The fill-in-the-middle tokens of the Qwen coder models' tokenizers (Qwen2.5-Coder onward; the Qwen3 vocabulary
# keeps them): a completion with a `suffix` is prefix + suffix + middle in them, as llama.cpp's /infill builds it.
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class _Token:
    """One generated token, for logprobs: its id, logprob, alternatives and character offset in the output."""
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int


@dataclass
class _Piece:
    text: str
    tokens: list[_Token] = field(default_factory=list)
    finish_reason: str | None = None
    # every id this piece generated (vLLM's `return_token_ids`): a stop token's and those of a stop string too
    ids: list[int] = field(default_factory=list)


class _Generation:
    """One engine request turned into text pieces: detokenized, stop-string checked, timed.

    Stop token ids (EOS unless ignore_eos) end generation with "stop"; their text is never emitted and they get no
    logprobs entry, but they count as completion tokens (the engine computed them; vLLM counts them too). With echo
    they keep their logprobs entry (at the end of the text), as vLLM's: the logprobs then cover the prompt and every
    generated token, which lm-eval's loglikelihood parser counts on (it drops the last entry as the generated one).
    """

    def __init__(self, engine: Engine, request: GenerationRequest, tokenizer: Tokenizer, stops: list[str],
                 timer: RequestTimer, *, want_logprobs: bool, index: int = 0, echo: str | None = None,
                 first_of_prompt: bool = True, echo_only: bool = False,
                 shares: _Generation | None = None, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.request, self.timer, self.want_logprobs = request, timer, want_logprobs
        self.index, self.echo = index, echo              # choice index; completions echo text (offsets start after)
        # completions' max_tokens 0 with echo: the engine samples one token (prompt logprobs come with the first),
        # which is not returned, counted or timed as output; finish "length"
        self.echo_only = echo_only
        self.first_of_prompt = first_of_prompt           # counts the prompt's tokens (once per prompt, as usage)
        # the prompt's first choice, which computes the prompt logprobs every choice of the prompt shows (n > 1)
        self.shares = shares
        offset = len(echo or "")
        self._events = engine.generate(request)
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = StopMatcher(stops, include=include_stop)
        self._min_tokens = request.params.min_tokens     # no stop string is matched in the first min_tokens tokens
        self._chars = offset
        self._first: TokenEvent | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None   # from the engine, when this choice asked for them
        self.cached_tokens = 0                           # prompt tokens the prefix cache served (usage)

    async def start(self) -> None:
        """Wait for the first token: engine errors that precede generation (429, 503) surface here."""
        self._first = await self._next()
        self.prompt_logprobs = self._first.prompt_logprobs
        self.cached_tokens = self._first.cached_tokens or 0
        self.timer.started(len(self.request.prompt_ids) if self.first_of_prompt else 0)

    def usage_so_far(self) -> Usage:
        """vLLM's continuous usage stats: this choice's prompt and the tokens it generated so far."""
        prompt = len(self.request.prompt_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                     total_tokens=prompt + self.completion_tokens)

    @property
    def prompt_lps(self) -> PromptLogprobs | None:
        """The prompt's logprobs (the same for every choice of a prompt: its first choice alone computes them)."""
        return (self.shares or self).prompt_logprobs

    async def pieces(self) -> AsyncIterator[_Piece]:
        """One piece per token event; the last one carries finish_reason (and any text held back until then)."""
        event = self._first
        assert event is not None, "start() first"
        while True:
            piece = self._consume(event)
            yield piece
            if piece.finish_reason is not None:
                await self.aclose()           # a stop string ends the request early: cancel it in the engine now
                return
            event = await self._next()

    async def aclose(self) -> None:
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()

    async def _next(self) -> TokenEvent:
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            raise EngineFailed("the engine ended the request without a finish reason") from None

    def _consume(self, event: TokenEvent) -> _Piece:
        if self.echo_only:
            self.finish_reason = "length"
            return _Piece("", finish_reason="length")
        self.completion_tokens += 1
        self.timer.token(event=event)
        piece = _Piece("", ids=[event.token_id])
        is_stop_token = event.finish_reason == "stop" and event.token_id in self.request.stop_token_ids
        if not is_stop_token:
            if self.want_logprobs:
                piece.tokens.append(_Token(event.token_id, event.logprob, event.top_logprobs, self._chars))
            delta = self._detok.push(event.token_id)
            self._chars += len(delta)
            if self.completion_tokens <= self._min_tokens:
                self._stop.observe(delta)            # (a stop string may start here and end after min_tokens)
                piece.text = delta
            else:
                piece.text = self._stop.feed(delta)
        if self._stop.stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            tail = self._detok.flush()
            self._chars += len(tail)
            piece.text += self._stop.feed(tail)
            piece.text += self._stop.flush()
            self.finish_reason = "stop" if self._stop.stopped else event.finish_reason
        if is_stop_token and self.want_logprobs and self.echo is not None:
            piece.tokens.append(_Token(event.token_id, event.logprob, event.top_logprobs, self._chars))
        piece.finish_reason = self.finish_reason
        return piece


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its body and every generation, whichever way the stream ends (even
    if the body never started: closing an unstarted async generator would not run its `finally`)."""

    def __init__(self, body: AsyncIterator[str], gens: list[_Generation]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gens = gens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _finish_timers(self._gens)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            await _close_all(self._gens)


def _finish_timers(gens: list[_Generation], reason: str | None = None) -> None:
    for gen in gens:
        gen.timer.finish(reason or gen.finish_reason or "abort")


async def _close_all(gens: list[_Generation]) -> None:
    for gen in gens:
        await gen.aclose()


async def _all(works: list[Awaitable[T]]) -> list[T]:
    """Await every choice's work together; if one fails (or this is cancelled), cancel and await the others before
    raising, so no engine iterator is still running when the caller closes them."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """Chunks of several choices' streams in the order they are produced (each chunk carries its choice index);
    the first failure ends the merge and cancels the others.

    One chunk per event-loop turn (the `sleep(0)` after each): a backlog (the first choices' tokens, queued while a
    later choice waited for a slot) never empties the queues and a send that does not block never yields, so the
    whole backlog went out in one turn: a client gone meanwhile was not seen (the transport's connection-lost
    callback waits for the loop) and asyncio logged every write into the dead socket
    (tests/test_qa_soak_disconnect_burst.py). Yielding here, inside the merge, lets the disconnect cancel the stream
    where its cleanup (the pump tasks first, then the engine iterators) already runs."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
            await asyncio.sleep(0)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
            queue.put_nowait(done)
        except Exception as exc:        # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
                await asyncio.sleep(0)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (the body has been read, so receive() only ever
    reports the disconnect)."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone()


class _Server:
    """The state behind the routes: engine, tokenizer, defaults."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str, generation_config: dict[str, Any],
                 metrics: Metrics, max_body_bytes: int, vocab_size: int | None = None,
                 aliases: tuple[str, ...] = (), clamp_max_tokens: bool = False) -> None:
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.clamp_max_tokens = clamp_max_tokens
        self.model_names = tuple(dict.fromkeys((model_name, *aliases)))   # what `model` may say; the first answers
        self.model_vocab = vocab_size          # the embedding's rows (None: trust the tokenizer's ids)
        self.version = _package_version()
        self.gen_cfg, self.metrics, self.max_body_bytes = dict(generation_config), metrics, max_body_bytes
        self.created = int(time.time())
        configured = generation_config.get("eos_token_id") or []
        configured = [configured] if isinstance(configured, int) else list(configured)
        self.eos_ids = set(tokenizer.eos_token_ids) | {int(i) for i in configured}
        # Longest byte string one token decodes to: bounds the tokens a text needs from below, without encoding it.
        sizes = (len(tokenizer.token_bytes(i, skip_special_tokens=False)) for i in range(tokenizer.vocab_size))
        self.max_token_bytes = max(max(sizes, default=1), 1)
        self._token_text: dict[int, tuple[str, list[int]]] = {}

    # ---- parsing and prompt preparation ------------------------------------------------------------------------

    async def parse(self, request: Request, model: type[T]) -> T:
        errors.require_json(request)
        raw = await errors.read_body(request, self.max_body_bytes)
        req = errors.validate(model, errors.parse_json_body(raw))
        if req.model is not None and req.model not in self.model_names:
            raise errors.model_not_found(req.model)
        return req

    async def encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        """Tokenize, refusing text that cannot fit the context before spending time on it."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise invalid_request(f"The {param} contain invalid Unicode (lone surrogates).", param=param) from None
        limit = self.engine.max_model_len
        if size > NORMALIZE_SLACK * self.max_token_bytes * limit:
            raise errors.context_length_exceeded(limit, None, param)
        return await run_in_threadpool(self.tok.encode, text, add_special_tokens)

    def fim_ids(self) -> tuple[int, int, int]:
        """The ids of `FIM_TOKENS` (prefix, suffix, middle), or a 400 naming what the tokenizer lacks."""
        ids = [self.tok.token_to_id(t) for t in FIM_TOKENS]
        if any(i is None for i in ids):
            raise invalid_request("suffix (fill-in-the-middle) needs a tokenizer with the tokens "
                                  f"{', '.join(FIM_TOKENS)}; this model's has "
                                  f"{'none of them' if all(i is None for i in ids) else 'only some'}.",
                                  param="suffix")
        return ids[0], ids[1], ids[2]

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tok.vocab_size
        bad = next((i for i in ids if i < 0 or i >= vocab), None)
        if bad is not None:
            raise invalid_request(f"Token id {bad} is out of vocabulary (0..{vocab - 1}).", param=param)

    @staticmethod
    def check_min_tokens(req: ChatCompletionRequest | CompletionRequest, room: int | None = None) -> None:
        """vLLM's rule: min_tokens may not exceed max_tokens, the requested one or (`room`) what the context leaves
        after the prompt."""
        if req.min_tokens and req.budget is not None and req.min_tokens > req.budget:
            raise invalid_request(f"min_tokens ({req.min_tokens}) must be <= {req.budget_param} ({req.budget}).",
                                  param="min_tokens")
        if req.min_tokens and room is not None and req.min_tokens > room:
            raise invalid_request(f"min_tokens ({req.min_tokens}) is more than the {room} tokens the context leaves "
                                  f"after the prompt.", param="min_tokens")

    def truncate(self, ids: list[int], keep: int | None, output: int | None = None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens; -1 keeps what the context leaves after
        `output` (the max_tokens asked for; at least one token). A `keep` past that room is a 400, as there."""
        if keep is None:
            return ids
        limit = self.engine.max_model_len
        room = limit - (output or 0)
        if keep > room:
            after = f" less {output} for the output" if output else ""
            raise invalid_request(f"truncate_prompt_tokens ({keep}) is more than the context length ({limit}){after}.",
                                  param="truncate_prompt_tokens")
        if keep == -1:
            keep = limit - max(output or 0, 1)
            if keep < 1:            # max_tokens takes the whole context: refused naming it (budget)
                return ids
        return ids[len(ids) - keep:] if len(ids) > keep else ids

    def budget(self, prompt_len: int, requested: int | None, param: str, cap_param: str | None = None) -> int:
        """Tokens to generate. `requested`: the length to generate, `cap_param` the field it came from when the
        client asked for it: more than the context leaves after the prompt is then a 400 naming both numbers
        (vLLM's and OpenAI's answer; docs/agents.md), or cut to fit with `clamp_max_tokens` (llama.cpp's); a
        default length (completions' 16) is cut to what fits. None: the rest of the context (or generation_config's
        max_new_tokens)."""
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise invalid_request(f"The {param} must contain at least one token.", param=param)
        if prompt_len + 1 > limit:
            raise errors.context_length_exceeded(limit, prompt_len, param)
        room = limit - prompt_len
        default = self.gen_cfg.get("max_new_tokens")
        if requested is None:
            return min(room, default) if isinstance(default, int) and default > 0 else room
        if requested > room and cap_param is not None and not self.clamp_max_tokens:
            raise errors.output_exceeds_context(cap_param, requested, prompt_len, limit, param)
        return min(requested, room)

    def logit_bias(self, raw: dict[str, Any] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias checked: keys are token ids (as strings) in the vocabulary, values in [-100, 100]."""
        if not raw:
            return None
        vocab, out = self.tok.vocab_size, {}
        for key, value in raw.items():
            try:
                tid = int(key)
            except ValueError:
                raise invalid_request(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
            if not 0 <= tid < vocab:
                raise invalid_request(f"logit_bias token id {tid} is out of vocabulary (0..{vocab - 1}).",
                                      param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_LOGIT_BIAS <= value \
                    <= MAX_LOGIT_BIAS:
                raise invalid_request(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}.",
                                      param="logit_bias")
            out[tid] = float(value)
        return out

    def generation_request(self, req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
                           max_tokens: int, request_id: str, *, choice: int = 0, prompt_logprobs: int | None = None,
                           logit_bias: dict[int, float] | None = None) -> GenerationRequest:
        """Choice j of a seeded request samples with seed + j (vLLM's rule): choice 0 is the n=1 answer, the others
        are reproducible and differ from it; each prompt of a list starts again at j = 0. `prompt_logprobs`: None, or
        the alternatives a prompt position reports (the prompt's logprobs are asked of its first choice only)."""
        params = SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            # -1 and a k of at least the vocabulary filter nothing: both are 0, "off" (a k past any int64 would
            # not even travel in a plan)
            top_k=0 if req.top_k is not None and (req.top_k == -1 or req.top_k >= self.tok.vocab_size) else req.top_k,
            min_p=req.min_p, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            seed=None if req.seed is None else _choice_seed(req.seed, choice),
            stop_token_ids=list(req.stop_token_ids or []), logprobs=req.top_k_logprobs, logit_bias=logit_bias,
            min_tokens=req.min_tokens or 0,       # at most max_tokens and the context's room (check_min_tokens)
        ).with_defaults(self.gen_cfg)
        stop_ids = set(params.stop_token_ids) | (set() if req.ignore_eos else self.eos_ids)
        if self.model_vocab is not None and prompt_ids and max(prompt_ids) >= self.model_vocab:
            # a tokenizer larger than the checkpoint's embedding: refused here, not in a step it would fail for all
            raise invalid_request(f"Token id {max(prompt_ids)} is out of the model's vocabulary (its embedding has "
                                  f"{self.model_vocab} rows; the tokenizer {self.tok.vocab_size}).")
        return GenerationRequest(request_id=request_id, prompt_ids=prompt_ids, params=params, stop_token_ids=stop_ids,
                                 prompt_logprobs=prompt_logprobs, ignore_eos=bool(req.ignore_eos))

    def render_chat(self, req: ChatCompletionRequest, plan: ChatPlan, add_generation_prompt: bool = True,
                    continue_final: bool = False) -> str:
        """The prompt text of a chat; `continue_final` (vLLM's continue_final_message): cut where the final
        message's text ends, so the reply continues it (transformers' rule, as vLLM applies it)."""
        kwargs = dict(plan.template_kwargs)
        reserved = [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]
        if reserved:
            raise invalid_request(f"chat_template_kwargs may not set {reserved[0]!r}.", param="chat_template_kwargs")
        messages = template_messages(req.messages)
        try:
            text = self.tok.apply_chat_template(messages, tools=plan.tools,
                                                add_generation_prompt=add_generation_prompt and not continue_final,
                                                **kwargs)
        except ValueError as e:
            raise invalid_request(str(e), param="messages") from None
        except RecursionError:          # tools or extra fields nested hundreds deep: converting them recursed too far
            raise invalid_request("The messages, tools or chat_template_kwargs are nested too deeply to render.") \
                from None
        return _continued(text, req.messages[-1]) if continue_final else text

    @cached_property
    def grammar_compiler(self):
        """llguidance over this tokenizer, built on first use (None if the package is missing)."""
        try:
            from gateway.grammar import GrammarCompiler
        except ImportError:
            return None
        return GrammarCompiler.for_tokenizer(self.tok, eos_ids=sorted(self.eos_ids), vocab_size=self.tok.vocab_size)

    # ---- logprobs formatting -------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token as logprobs show it: its bytes as text (incomplete UTF-8 as \\x escapes), and the bytes."""
        cached = self._token_text.get(token_id)
        if cached is None:
            raw = self.tok.token_bytes(token_id, skip_special_tokens=False)
            cached = self._token_text[token_id] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return cached

    def logprob_token(self, token_id: int, as_id: bool) -> str:
        """A token's name in logprobs: its text, or with vLLM's `return_tokens_as_token_ids` "token_id:{id}"."""
        return f"token_id:{int(token_id)}" if as_id else self.token_text(token_id)[0]

    def chat_logprobs(self, tokens: list[_Token], as_ids: bool = False) -> ChatLogprobs:
        """`as_ids` (vLLM's `return_tokens_as_token_ids`): every `token` is "token_id:{id}"; the sampled token's
        `bytes` stay its own bytes, an alternative's are those of its "token_id:{id}" string (vLLM's choice)."""
        content = []
        for t in tokens:
            text, raw = self.token_text(t.token_id)
            top = []
            for i, lp in t.top or []:
                name = self.logprob_token(i, as_ids)
                top.append(TopLogprob(token=name, logprob=_lp(lp),
                                      bytes=list(name.encode()) if as_ids else self.token_text(i)[1]))
            content.append(ChatTokenLogprob(token=self.logprob_token(t.token_id, as_ids), logprob=_lp(t.logprob),
                                            bytes=raw, top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion_logprobs(self, tokens: list[_Token], as_ids: bool = False) -> CompletionLogprobs:
        """`as_ids`: tokens and the top_logprobs keys are "token_id:{id}"; `text_offset` stays the offset in the
        text (vLLM's counts the "token_id:{id}" strings' lengths, which point nowhere in it)."""
        out = CompletionLogprobs()
        for t in tokens:
            text = self.logprob_token(t.token_id, as_ids)
            top = {self.logprob_token(i, as_ids): _lp(lp) for i, lp in (t.top or [])}
            top.setdefault(text, _lp(t.logprob))        # OpenAI: the sampled token is always among them
            out.tokens.append(text)
            out.token_logprobs.append(_lp(t.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(t.offset)
        return out

    def echo_logprobs(self, prompt_ids: list[int], lps: PromptLogprobs | None, top: int,
                      as_ids: bool = False) -> CompletionLogprobs:
        """Echoed prompt tokens as OpenAI's legacy completions gave them: the first token's logprob and
        top_logprobs null; every later one's logprob given its prefix, and its `top` most likely tokens there plus
        itself (as for generated tokens)."""
        out = CompletionLogprobs()
        detok, offset = IncrementalDetokenizer(self.tok, skip_special_tokens=False), 0
        rows = _rows(lps, len(prompt_ids))
        for pos, tid in enumerate(prompt_ids):
            text = self.logprob_token(tid, as_ids)
            out.tokens.append(text)
            row = rows[pos]
            if row is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                lp, _, ids, vals = row
                alternatives = {self.logprob_token(i, as_ids): _lp(v) for i, v in zip(ids[:top], vals[:top])}
                alternatives.setdefault(text, _lp(lp))
                out.token_logprobs.append(_lp(lp))
                out.top_logprobs.append(alternatives)
            out.text_offset.append(offset)
            offset += len(detok.push(tid))
        return out

    def vllm_prompt_logprobs(self, prompt_ids: list[int], lps: PromptLogprobs | None,
                             top: int) -> PromptLogprobsList:
        """vLLM's `prompt_logprobs`: None for the first token, then per position {token id: logprob, rank,
        decoded_token} of the prompt token and the `top` most likely tokens (ranks 1..top), the prompt token first
        (an alternative that is the prompt token keeps its place in the ranking, as vLLM's dict does)."""
        out: PromptLogprobsList = []
        for pos, (tid, row) in enumerate(zip(prompt_ids, _rows(lps, len(prompt_ids)))):
            if row is None:
                out.append(None)
                continue
            lp, rank, ids, vals = row
            entry = {str(tid): PromptLogprob(logprob=_lp(lp), rank=int(rank), decoded_token=self.token_text(tid)[0])}
            for r, (i, v) in enumerate(zip(ids[:top], vals[:top]), start=1):
                entry[str(i)] = PromptLogprob(logprob=_lp(v), rank=r, decoded_token=self.token_text(int(i))[0])
            out.append(entry)
        return out


def _message_text(message: ChatMessage) -> str:
    """A message's text: its content string, or its text parts joined by newlines (vLLM's reading)."""
    content = message.content
    if isinstance(content, list):
        return "\n".join(p.text for p in content if p.type == "text" and p.text is not None)
    return content or ""


def _continued(prompt: str, final: ChatMessage) -> str:
    """`prompt` cut right after the final message's text (transformers' continue_final_message: the template may
    strip the text's surrounding whitespace; a leading one is never kept)."""
    content = final.content
    if isinstance(content, list):
        texts = [p.text for p in content if p.type == "text" and p.text is not None]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise invalid_request("continue_final_message needs a final message with text to continue.",
                              param="continue_final_message")
    at = prompt.rfind(content.strip())
    if at == -1:
        raise invalid_request("continue_final_message: the chat template does not render the final message's text "
                              "as it is, so there is no place to continue it.", param="continue_final_message")
    kept = content.lstrip()
    # transformers compares the untrimmed text: with leading whitespace the test fails and the trailing one is cut too
    return prompt[:at + (len(kept) if prompt[at:at + len(kept)] == content else len(content.strip()))]


def _rows(lps: PromptLogprobs | None, n: int) -> list[tuple[float, int, list[int], list[float]] | None]:
    """Per prompt position: (logprob, rank, top ids, top logprobs) given the tokens before it; None for the first
    (and for every position if the engine sent none)."""
    if lps is None or len(lps) != n - 1:
        return [None] * n
    lp, ranks, ids, vals = lps.arrays()
    return [None] + list(zip(lp.tolist(), ranks.tolist(), ids.tolist(), vals.tolist()))


def _lp(value: float | None) -> float:
    return MIN_LOGPROB if value is None or value != value else max(float(value), MIN_LOGPROB)


def _choice_seed(seed: int, choice: int) -> int:
    s = seed + choice
    return s - (1 << 64) if s > SEED_MAX else s        # wrap into what torch.Generator.manual_seed takes


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moepipe")
    except PackageNotFoundError:        # run from a source tree that was never installed
        return "unknown"


def _output_options(req: ChatCompletionRequest | CompletionRequest) -> dict[str, bool]:
    """vLLM's output extras as `_Generation` takes them, on every route."""
    return {"include_stop": bool(req.include_stop_str_in_output),
            "skip_special_tokens": req.skip_special_tokens is not False}


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"No response with id {response_id!r}: responses are not stored on this server (store is "
                    "accepted but nothing is kept).", param="response_id", code="not_found")


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _engine_id(rid: str, index: int, total: int) -> str:
    """The engine request id of one choice: the response id itself when there is one choice."""
    return rid if total == 1 else f"{rid}-{index}"


def _usage(gens: list[_Generation]) -> Usage:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice (vLLM's sums)."""
    prompt = sum(len(g.request.prompt_ids) for g in gens if g.first_of_prompt)
    completion = sum(g.completion_tokens for g in gens)
    cached = sum(g.cached_tokens for g in gens if g.first_of_prompt)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def create_app(engine: Engine, tokenizer: Tokenizer, *, model_name: str, generation_config: dict, metrics: Metrics,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, vocab_size: int | None = None,
               aliases: list[str] | tuple[str, ...] = (), root: str | None = None,
               clamp_max_tokens: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name` (and `aliases`, which requests may name too and
    /v1/models lists; responses carry `model_name`); omitted sampling fields take generation_config's values.
    `vocab_size`: the model's embedding rows, when the tokenizer may know more ids than it. `root`: what
    /v1/models calls the model served (vLLM: its path; default `model_name`). `clamp_max_tokens`: a max_tokens
    past the context is cut to fit instead of a 400 (the cluster key of that name)."""
    app = FastAPI(title="moepipe", docs_url=None, redoc_url=None)
    errors.install_error_handlers(app)
    srv = _Server(engine, tokenizer, model_name, generation_config, metrics, max_body_bytes, vocab_size,
                  tuple(aliases), clamp_max_tokens)
    app.state.server = srv

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=srv.created, root=root or model_name, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return ModelList(data=[card(n) for n in srv.model_names]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        if name not in srv.model_names:
            raise errors.model_not_found(name)
        return card(name).model_dump()

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(request: Request) -> dict:
        """OpenAI's input token count: the prompt the request would be served with (rendered and tokenized as
        /v1/responses renders it, tools and instructions included), counted; nothing is generated."""
        req = await srv.parse(request, ResponsesRequest)
        chat_req = responses.to_chat_request(req)
        with responses.renamed_params():
            plan = await run_in_threadpool(plan_chat, chat_req, lambda: srv.grammar_compiler)
            text = await run_in_threadpool(srv.render_chat, chat_req, plan)
            ids = srv.truncate(await srv.encode(text, "input"), chat_req.truncate_prompt_tokens,
                               chat_req.explicit_budget)
        return InputTokensResponse(input_tokens=len(ids)).model_dump()

    @app.post("/v1/responses/compact")
    async def compact_response() -> dict:
        raise errors.APIError(404, "Compaction (POST /v1/responses/compact) is not available on this server: it "
                              "keeps no responses and has no compaction model. Send the conversation in input as "
                              "it is, or shorten it on the client.", code="not_found")

    @app.get("/v1/responses/{response_id}", operation_id="retrieve_response")
    @app.delete("/v1/responses/{response_id}", operation_id="delete_response")
    async def stored_response(response_id: str) -> dict:
        """OpenAI's retrieve / delete of a stored response: nothing is stored here, so every id is unknown."""
        raise _not_stored(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        """OpenAI's cancel of a background response: background responses are refused, so no id is known."""
        raise _not_stored(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str) -> dict:
        raise _not_stored(response_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.closing is not None:    # requests get 503 now: a load balancer must stop sending them here
            err = APIError(503, f"Unavailable: {engine.closing}.", type="service_unavailable_error", param=None,
                           code="shutting_down", retry_after=errors.RETRY_UNAVAILABLE_S)
            return JSONResponse(err.body(), status_code=503, headers={"Retry-After": str(err.retry_after)})
        down = engine.health()
        if down:
            err = APIError(503, f"Unhealthy: {', '.join(down)} missed the heartbeat deadline.",
                           type="service_unavailable_error", param=None, code="unhealthy",
                           retry_after=errors.RETRY_UNAVAILABLE_S)
            # `down` beside the error: the launcher reads which components to watch from it, not from the prose
            return JSONResponse({**err.body(), "down": list(down)}, status_code=503,
                                headers={"Retry-After": str(err.retry_after)})
        return JSONResponse({"status": "ok"})

    @app.get("/ping", operation_id="ping_get")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> JSONResponse:
        """vLLM's liveness probe for SageMaker (GET and POST): /health's answer."""
        return await health()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version() -> dict:
        return {"version": srv.version}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        """vLLM's: the ids of a prompt, or of chat messages as the chat route renders them (tools and template
        kwargs included), with the context limit."""
        req = await srv.parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise invalid_request("Give either prompt or messages.", param="prompt")
        if req.messages is not None:
            continue_final = req.continue_final_message
            if continue_final and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
                raise invalid_request("Cannot set both continue_final_message and add_generation_prompt to true.",
                                      param="continue_final_message")
            chat = errors.validate(ChatCompletionRequest, {
                "messages": [m.model_dump(exclude_none=True) for m in req.messages], "tools": req.tools,
                "chat_template_kwargs": req.chat_template_kwargs})
            plan = await run_in_threadpool(plan_chat, chat, lambda: srv.grammar_compiler)
            # (continue_final_message was ignored: the ids ended with a closed turn and a generation prompt, not
            # the chat route's prompt, so /v1/completions on them answered something else)
            text = await run_in_threadpool(srv.render_chat, chat, plan, req.add_generation_prompt, continue_final)
            ids = await srv.encode(text, "messages")
        else:
            ids = await srv.encode(req.prompt, "prompt", req.add_special_tokens)
        strs = await run_in_threadpool(srv.tok.token_strings, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await srv.parse(request, DetokenizeRequest)
        srv.check_ids(req.tokens, "tokens")
        return {"prompt": await run_in_threadpool(srv.tok.decode, req.tokens, False)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await srv.parse(request, ChatCompletionRequest)
        rid = _new_id("chatcmpl")
        plan, gens = await _start_chat(srv, req, arrival, rid, "messages")
        return await _serve(request, gens, bool(req.stream), lambda: _chat_stream(srv, req, gens, rid, plan),
                            lambda: _chat_full(srv, req, gens, rid, plan))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """The Responses API, served by the chat path: the request becomes a chat request (gateway/responses.py),
        the reply's parsed pieces become output items and stream events."""
        arrival = time.monotonic()
        req = await srv.parse(request, ResponsesRequest)
        chat_req = responses.to_chat_request(req)
        rid = responses.new_id("resp")
        with responses.renamed_params():
            plan, gens = await _start_chat(srv, chat_req, arrival, rid, "input")
        gen = gens[0]
        builder = responses.ResponseBuilder(rid, srv.model_name, req, gen.request.params)
        return await _serve(request, gens, bool(req.stream),
                            lambda: _stream_body(gens, responses.stream(gen, builder, plan),
                                                 error_event=builder.failed_event, done=None),
                            lambda: responses.collect(gen, builder, plan))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await srv.parse(request, CompletionRequest)
        prompts, n = req.prompts(), req.num_choices
        unsupported = req.vllm_unsupported()
        if unsupported:
            raise invalid_request(unsupported[1], param=unsupported[0])
        if len(prompts) * n > MAX_CHOICES:
            raise invalid_request(f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices.", param="n")
        if req.best_of is not None and req.best_of > n:
            raise invalid_request(f"best_of={req.best_of} > n={n} is not supported: moepipe returns every choice it "
                                  "generates (ask for n choices instead).", param="best_of")
        if req.suffix and req.echo:
            raise invalid_request("echo with suffix is not supported: the model's prompt is the fill-in-the-middle "
                                  "form (prefix, suffix, middle tokens), so neither the prompt text nor its "
                                  "logprobs would describe what was echoed.", param="echo")
        fim = srv.fim_ids() if req.suffix else None
        grammar, compiler = await run_in_threadpool(completion_grammar, req, lambda: srv.grammar_compiler)
        suffix_ids = await srv.encode(req.suffix, "suffix") if req.suffix else []
        bias = srv.logit_bias(req.logit_bias)
        rid, want = _new_id("cmpl"), req.logprobs is not None
        # The prompt's logprobs, when echo + logprobs or prompt_logprobs ask for them: alternatives for both uses
        asks = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        prompt_top = max(asks) if asks else None
        gens = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt_ids, prompt_text = await srv.encode(prompt, "prompt"), prompt
            else:
                srv.check_ids(prompt, "prompt")
                prompt_ids, prompt_text = list(prompt), None
            if req.truncate_prompt_tokens is not None:
                kept = srv.truncate(prompt_ids, req.truncate_prompt_tokens, req.explicit_budget)
                if len(kept) < len(prompt_ids):
                    prompt_ids, prompt_text = kept, None      # an echo shows what the model was given
            if req.echo and prompt_text is None:
                prompt_text = await run_in_threadpool(tokenizer.decode, prompt_ids, False)
            if fim is not None:         # prefix-suffix-middle, as the Qwen coder models were trained
                prompt_ids = [fim[0], *prompt_ids, fim[1], *suffix_ids, fim[2]]
            echo_only = req.max_tokens == 0
            if echo_only and not req.echo:
                raise invalid_request("max_tokens 0 asks for no output: it is only valid with echo (the prompt and "
                                      "its logprobs).", param="max_tokens")
            max_tokens = srv.budget(len(prompt_ids), 1 if echo_only else req.budget, "prompt",
                                    None if echo_only or req.explicit_budget is None else req.budget_param)
            srv.check_min_tokens(req, engine.max_model_len - len(prompt_ids))
            first = len(gens)
            for j in range(n):
                index = i * n + j
                gen_req = srv.generation_request(req, prompt_ids, max_tokens, _engine_id(rid, index, len(prompts) * n),
                                                 choice=j, prompt_logprobs=prompt_top if j == 0 else None,
                                                 logit_bias=bias)
                if grammar is not None:
                    gen_req.grammar = compiler.new_matcher(grammar)
                gens.append(_Generation(engine, gen_req, tokenizer, req.stop_strings,
                                        metrics.request_started(arrival, rid), want_logprobs=want, index=index,
                                        echo=prompt_text if req.echo else None, first_of_prompt=j == 0,
                                        echo_only=echo_only, shares=gens[first] if j else None,
                                        **_output_options(req)))
        return await _serve(request, gens, bool(req.stream), lambda: _completion_stream(srv, req, gens, rid),
                            lambda: _completion_full(srv, req, gens, rid))

    install_openapi(app, {"/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
                          "/v1/completions": (CompletionRequest, CompletionResponse),
                          "/v1/responses": (ResponsesRequest, None),
                          "/v1/responses/input_tokens": (ResponsesRequest, InputTokensResponse),
                          "/tokenize": (TokenizeRequest, TokenizeResponse),
                          "/detokenize": (DetokenizeRequest, DetokenizeResponse)},
                    {"/v1/models": ModelList, "/v1/models/{name}": ModelCard, "/version": VersionResponse})
    return app


async def _start_chat(srv: _Server, req: ChatCompletionRequest, arrival: float, rid: str,
                      prompt_param: str) -> tuple[ChatPlan, list[_Generation]]:
    """Plan, render and tokenize a chat request and create one engine request per choice: the one request path of
    /v1/chat/completions and /v1/responses (`prompt_param` names the prompt field in errors)."""
    unsupported = req.unsupported_field()
    if unsupported:
        raise invalid_request(unsupported[1], param=unsupported[0])
    continue_final = bool(req.continue_final_message)
    if continue_final and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise invalid_request("Cannot set both continue_final_message and add_generation_prompt to true.",
                              param="continue_final_message")
    plan = await run_in_threadpool(plan_chat, req, lambda: srv.grammar_compiler)
    text = await run_in_threadpool(srv.render_chat, req, plan, req.add_generation_prompt is not False, continue_final)
    if plan.reasoning == "auto" and text.rstrip(" \n").endswith("<think>"):
        plan.reasoning = "inside"          # the template opened the think block: the reply starts inside it
    plan.call_form = srv.tok.tool_call_form     # hermes JSON or Qwen3-Coder XML calls, as the template writes them
    prompt_ids = srv.truncate(await srv.encode(text, prompt_param), req.truncate_prompt_tokens, req.explicit_budget)
    max_tokens = srv.budget(len(prompt_ids), req.budget, prompt_param, req.budget_param)
    srv.check_min_tokens(req, srv.engine.max_model_len - len(prompt_ids))
    bias = srv.logit_bias(req.logit_bias)
    n = req.num_choices
    gens = []
    for j in range(n):
        gen_req = srv.generation_request(req, prompt_ids, max_tokens, _engine_id(rid, j, n), choice=j,
                                         logit_bias=bias, prompt_logprobs=req.prompt_logprobs if j == 0 else None)
        if plan.grammar is not None:
            gen_req.grammar = plan.compiler.new_matcher(plan.grammar)
        gens.append(_Generation(srv.engine, gen_req, srv.tok, req.stop_strings,
                                srv.metrics.request_started(arrival, rid), want_logprobs=bool(req.logprobs), index=j,
                                first_of_prompt=j == 0, shares=gens[0] if j else None, **_output_options(req)))
    return plan, gens


async def _serve(request: Request, gens: list[_Generation], stream: bool,
                 make_stream: Callable[[], AsyncIterator[str]], make_full: Callable[[], Awaitable[dict]]) -> Response:
    """Start every choice (so 429/503 can still be answered), then stream or collect; always close the engine side."""
    handed_over = False
    try:
        await _until_disconnected(request, _all([g.start() for g in gens]))
        if stream:
            handed_over = True                # from here _SSEResponse owns closing
            return _SSEResponse(make_stream(), gens)
        try:
            return JSONResponse(await _until_disconnected(request, make_full()))
        except EngineInterrupted as exc:      # nothing was sent: to this client a refusal, worth sending again
            _finish_timers(gens, "error")
            raise EngineUnavailable(str(exc)) from exc
    except _ClientGone:
        return Response(status_code=499)      # nobody is listening; the status only shows in access logs
    except (EngineOverloaded, EngineUnavailable):
        _finish_timers(gens, "rejected")
        raise
    except Exception:
        _finish_timers(gens, "error")
        raise
    finally:
        if not handed_over:
            _finish_timers(gens)
            await _close_all(gens)


def _called_finish(plan: ChatPlan, finish: str) -> str:
    """The finish reason of a reply that called tools: the engine ends it with "stop", the client sees
    "tool_calls" ("function_call" for a legacy request), and the access log is told. Not for a reply cut inside a
    call's arguments (a stop string, max_tokens): its finish reason stays the cut's, since "tool_calls" promises
    arguments that parse."""
    if finish != "stop":
        return finish
    access_log.note_tool_calls()
    return "function_call" if plan.legacy else "tool_calls"


def _parses(plan: ChatPlan) -> bool:
    return plan.reasoning != "off" or plan.tool_names is not None


async def _collect(gen: _Generation) -> tuple[str, list[_Token], list[int]]:
    """The choice's text, its logprobs tokens and every id it generated."""
    texts, tokens, ids = [gen.echo or ""], [], []
    async for piece in gen.pieces():
        texts.append(piece.text)
        tokens.extend(piece.tokens)
        ids.extend(piece.ids)
    return "".join(texts), tokens, ids


def _vllm_prompt_logprobs(srv: _Server, req: ChatCompletionRequest | CompletionRequest,
                          gen: _Generation) -> PromptLogprobsList | None:
    """The `prompt_logprobs` field of `gen`'s answer: None unless the request asked for it."""
    if req.prompt_logprobs is None:
        return None
    return srv.vllm_prompt_logprobs(gen.request.prompt_ids, gen.prompt_lps, req.prompt_logprobs)


async def _chat_full(srv: _Server, req: ChatCompletionRequest, gens: list[_Generation], rid: str,
                     plan: ChatPlan) -> dict:
    echo = _chat_echo(req)

    async def one(gen: _Generation) -> ChatChoice:
        text, tokens, ids = await _collect(gen)
        finish = gen.finish_reason
        message = ChatResponseMessage(content=text)
        if _parses(plan):
            parsed = plan.parse_complete(text)
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in parsed.tool_calls]
            message = ChatResponseMessage(content=parsed.content or (None if calls else ""),
                                          reasoning_content=parsed.reasoning_content)
            if plan.legacy and calls:           # a legacy request gets its (one) call as function_call
                message.function_call = calls[0].function
            else:
                message.tool_calls = calls or None
            if calls and not parsed.cut_call:
                finish = _called_finish(plan, finish)
        if echo:
            message.content = echo + (message.content or "")
        return ChatChoice(index=gen.index, message=message, finish_reason=finish,
                          logprobs=srv.chat_logprobs(tokens, _as_ids(req)) if gen.want_logprobs else None,
                          token_ids=ids if req.return_token_ids else None)

    choices = await _all([one(g) for g in gens])
    return ChatCompletionResponse(id=rid, created=int(time.time()), model=srv.model_name, choices=choices,
                                  usage=_usage(gens), prompt_logprobs=_vllm_prompt_logprobs(srv, req, gens[0]),
                                  prompt_token_ids=_prompt_ids(req, gens[0])).model_dump()


async def _completion_full(srv: _Server, req: CompletionRequest, gens: list[_Generation], rid: str) -> dict:
    async def one(gen: _Generation) -> CompletionChoice:
        text, tokens, ids = await _collect(gen)
        logprobs = None
        if gen.want_logprobs:
            logprobs = srv.completion_logprobs(tokens, _as_ids(req))
            if gen.echo is not None:
                logprobs = _join(_echo_logprobs(srv, req, gen), logprobs)
        return CompletionChoice(index=gen.index, text=text, logprobs=logprobs, finish_reason=gen.finish_reason,
                                prompt_logprobs=_vllm_prompt_logprobs(srv, req, gen),
                                prompt_token_ids=_prompt_ids(req, gen),
                                token_ids=ids if req.return_token_ids else None)

    choices = await _all([one(g) for g in gens])
    return CompletionResponse(id=rid, created=int(time.time()), model=srv.model_name, choices=choices,
                              usage=_usage(gens)).model_dump()


def _echo_logprobs(srv: _Server, req: CompletionRequest, gen: _Generation) -> CompletionLogprobs:
    return srv.echo_logprobs(gen.request.prompt_ids, gen.prompt_lps, req.logprobs or 0, _as_ids(req))


def _as_ids(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """vLLM's `return_tokens_as_token_ids`: logprobs name tokens "token_id:{id}"."""
    return bool(req.return_tokens_as_token_ids)


def _prompt_ids(req: ChatCompletionRequest | CompletionRequest, gen: _Generation) -> list[int] | None:
    """vLLM's `prompt_token_ids` (with `return_token_ids`): the ids the model was given (after truncation, in the
    fill-in-the-middle form for a completion with a suffix); None (left out) otherwise."""
    return list(gen.request.prompt_ids) if req.return_token_ids else None


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


async def _stream_body(gens: list[_Generation], chunks: AsyncIterator[str],
                       error_event: Callable[[APIError], str] | None = None,
                       done: str | None = "data: [DONE]\n\n") -> AsyncIterator[str]:
    """SSE framing shared by the endpoints: an error becomes an error event (the chat shape unless `error_event`
    says otherwise); ends with `done` ([DONE] for chat and completions, nothing for responses); always closes."""
    reason = None
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        reason = "error"
        if isinstance(exc, EngineFailed):
            err = errors.engine_error(exc)
        else:
            log.exception("stream %s failed", gens[0].request.request_id)
            err = errors.internal_error()
        yield error_event(err) if error_event is not None else _sse(json.dumps(err.body()))
    finally:
        _finish_timers(gens, reason)             # before any await: a cancelled task may not get past one
        # The chunks first: closed at a yield (the cancellation of a client gone landed in the response's `send`,
        # which waits when the socket is full), `_merged`'s pump tasks still drove the engine iterators, whose
        # aclose() then raised "asynchronous generator is already running".
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
        await _close_all(gens)
    if done is not None:
        yield done


def _delta_message(d: Delta, legacy: bool) -> DeltaMessage:
    """A parser delta as an OpenAI delta; a legacy request streams its call as function_call (its parser keeps
    one call: `ChatPlan.max_calls`)."""
    if d.reasoning is not None:
        return DeltaMessage(reasoning_content=d.reasoning)
    if d.content is not None:
        return DeltaMessage(content=d.content)
    if legacy:
        return DeltaMessage(function_call=DeltaFunction(name=d.name, arguments=d.arguments))
    return DeltaMessage(tool_calls=[DeltaToolCall(index=d.tool_index, id=d.tool_id,
                                                  type="function" if d.tool_id else None,
                                                  function=DeltaFunction(name=d.name, arguments=d.arguments))])


def _chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: a reply to a final assistant message (a prefill) starts with that message's text."""
    last = req.messages[-1]
    return _message_text(last) if req.echo and last.role == "assistant" else ""


def _chat_stream(srv: _Server, req: ChatCompletionRequest, gens: list[_Generation], rid: str,
                 plan: ChatPlan) -> AsyncIterator[str]:
    created = int(time.time())
    exclude = None if req.include_usage else {"usage"}
    echo = _chat_echo(req)

    async def one(gen: _Generation) -> AsyncIterator[str]:
        # vLLM's return_token_ids: each chunk of the reply carries the ids generated since the previous one (ids
        # whose text is held back, by a stop string or the output parser, ride with the next chunk: the chunks are
        # the ones sent without the flag; the finish chunk carries what is left)
        pending: list[int] = []

        def chunk(delta: DeltaMessage, tokens: list[_Token] | None = None, finish: str | None = None,
                  prompt_lps: PromptLogprobsList | None = None, reply: bool = True,
                  prompt_ids: list[int] | None = None) -> str:
            logprobs = srv.chat_logprobs(tokens, _as_ids(req)) if gen.want_logprobs and tokens is not None else None
            ids = None
            if req.return_token_ids and reply:
                ids = list(pending)
                pending.clear()
            c = ChatCompletionChunk(id=rid, created=created, model=srv.model_name,
                                    choices=[ChatChunkChoice(index=gen.index, delta=delta, logprobs=logprobs,
                                                             finish_reason=finish, token_ids=ids)],
                                    prompt_logprobs=prompt_lps, prompt_token_ids=prompt_ids,
                                    usage=gen.usage_so_far() if req.continuous_usage else None)
            return _sse(c.model_dump_json(exclude=exclude))

        parser = plan.output_parser() if _parses(plan) else None
        # A reply that may be tool calls alone has content null (`_chat_full`), so its stream says nothing of
        # content until there is some: a first chunk with content "" made a client's folded message "" where the
        # non-streamed one is null. If it ends with neither text nor a call, its finish chunk says "".
        calls_possible = parser is not None and plan.tool_names is not None
        # the prompt's logprobs (vLLM's prompt_logprobs) ride on the first choice's first chunk
        # (and vLLM's prompt_token_ids on every choice's first chunk, as vLLM sends them)
        yield chunk(DeltaMessage(role="assistant", content=None if calls_possible else ""),
                    prompt_lps=_vllm_prompt_logprobs(srv, req, gen) if gen is gens[0] else None, reply=False,
                    prompt_ids=_prompt_ids(req, gen))
        if echo:
            yield chunk(DeltaMessage(content=echo), reply=False)
        called, said = False, bool(echo)        # said: some chunk carried content
        sent_logprobs = False
        async for text, tokens, ids, finish in _coalesce(gen):
            if req.return_token_ids:
                pending.extend(ids)
            if parser is None:
                if text or tokens:
                    yield chunk(DeltaMessage(content=text), tokens)
                    sent_logprobs = True
            else:
                deltas = parser.feed(text) + (parser.finish() if finish is not None else [])
                called = called or any(d.tool_index is not None for d in deltas)
                said = said or any(d.content is not None for d in deltas)
                messages = [_delta_message(d, plan.legacy) for d in deltas]
                for i, m in enumerate(messages):            # logprobs ride on the piece's first chunk
                    yield chunk(m, tokens if i == 0 else None)
                    sent_logprobs = sent_logprobs or (i == 0 and bool(tokens))
                if not messages and tokens and gen.want_logprobs:
                    yield chunk(DeltaMessage(), tokens)     # (no content "": the reply may be calls alone)
                    sent_logprobs = True
            if finish is not None:
                last = DeltaMessage(content="" if calls_possible and not said and not called else None)
                called = called and not parser.cut_call
                # a choice whose every token was a stop token still says it has logprobs (none), as `_chat_full`
                yield chunk(last, [] if gen.want_logprobs and not sent_logprobs else None,
                            _called_finish(plan, finish) if called else finish)

    async def chunks() -> AsyncIterator[str]:
        async with contextlib.aclosing(_merged([one(g) for g in gens])) as merged:    # (see `_stream_body`)
            async for c in merged:
                yield c
        if req.include_usage:
            yield _sse(ChatCompletionChunk(id=rid, created=created, model=srv.model_name, choices=[],
                                           usage=_usage(gens)).model_dump_json())

    return _stream_body(gens, chunks())


def _completion_stream(srv: _Server, req: CompletionRequest, gens: list[_Generation],
                       rid: str) -> AsyncIterator[str]:
    created = int(time.time())
    exclude = None if req.include_usage else {"usage"}

    async def one(gen: _Generation) -> AsyncIterator[str]:
        # vLLM's return_token_ids: the prompt's ids on the choice's first chunk, and on each chunk the ids generated
        # since the previous one (held-back text's ids ride with the chunk that shows it, the rest with the finish)
        pending: list[int] = []
        first = True

        def chunk(text: str, logprobs: CompletionLogprobs | None = None, finish: str | None = None,
                  prompt_lps: PromptLogprobsList | None = None) -> str:
            nonlocal first
            ids = prompt_ids = None
            if req.return_token_ids:
                ids, prompt_ids = list(pending), _prompt_ids(req, gen) if first else None
                pending.clear()
            first = False
            c = CompletionChunk(id=rid, created=created, model=srv.model_name,
                                choices=[CompletionChoice(index=gen.index, text=text, logprobs=logprobs,
                                                          finish_reason=finish, prompt_logprobs=prompt_lps,
                                                          prompt_token_ids=prompt_ids, token_ids=ids)],
                                usage=gen.usage_so_far() if req.continuous_usage else None)
            return _sse(c.model_dump_json(exclude=exclude))

        prompt_lps = _vllm_prompt_logprobs(srv, req, gen)
        if gen.echo is not None:
            yield chunk(gen.echo, _echo_logprobs(srv, req, gen) if gen.want_logprobs else None, prompt_lps=prompt_lps)
        elif prompt_lps is not None:
            yield chunk("", prompt_lps=prompt_lps)
        sent_logprobs = gen.echo is not None
        async for text, tokens, ids, finish in _coalesce(gen):
            if req.return_token_ids:
                pending.extend(ids)
            if text or tokens:
                yield chunk(text, srv.completion_logprobs(tokens, _as_ids(req)) if gen.want_logprobs else None)
                sent_logprobs = True
            if finish is not None:
                # a choice whose every token was a stop token still says it has logprobs (none), as the full body
                yield chunk("", CompletionLogprobs() if gen.want_logprobs and not sent_logprobs else None, finish)

    async def chunks() -> AsyncIterator[str]:
        async with contextlib.aclosing(_merged([one(g) for g in gens])) as merged:    # (see `_stream_body`)
            async for c in merged:
                yield c
        if req.include_usage:
            yield _sse(CompletionChunk(id=rid, created=created, model=srv.model_name, choices=[],
                                       usage=_usage(gens)).model_dump_json())

    return _stream_body(gens, chunks())


async def _coalesce(gen: _Generation) -> AsyncIterator[tuple[str, list[_Token], list[int], str | None]]:
    """Pieces grouped so each chunk carries text: tokens whose text is still held back ride with the next text
    (their logprobs entries, and their ids)."""
    pending: list[_Token] = []
    ids: list[int] = []
    async for piece in gen.pieces():
        pending.extend(piece.tokens)
        ids.extend(piece.ids)
        if piece.text or piece.finish_reason is not None:
            yield piece.text, pending, ids, piece.finish_reason
            pending, ids = [], []
