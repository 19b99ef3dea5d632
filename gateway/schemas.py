"""Request and response bodies of the OpenAI-compatible endpoints (pydantic v2).

Requests ignore unknown fields (clients send many we do not use). The agent-facing fields (tools, tool_choice,
parallel_tool_calls, response_format, chat_template_kwargs, the legacy functions / function_call) are validated here
for shape only and checked in depth by `gateway.chat_plan`, which answers 400 naming the field for anything it cannot
honour. `logit_bias` is checked against the vocabulary by the API layer (it needs the tokenizer).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "ChatMessage", "StreamOptions", "Usage",
    "TopLogprob", "ChatTokenLogprob", "ChatLogprobs", "CompletionLogprobs", "PromptLogprob", "PromptLogprobsList",
    "ChatResponseMessage", "ChatChoice", "FunctionCall", "ToolCall", "DeltaFunction", "DeltaToolCall",
    "ChatCompletionResponse", "DeltaMessage", "ChatChunkChoice",
    "ChatCompletionChunk", "CompletionChoice", "CompletionResponse", "CompletionChunk", "ModelCard", "ModelList",
    "ModelPermission", "ResponsesRequest", "InputTokensResponse",
]

# OpenAI takes 4 stop strings, vLLM any number; code-evaluation harnesses send 8 or more (HumanEval's), so a vLLM
# user's request must pass: 64, with every string's matcher built per request (gateway/stop.py) kept bounded
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 16384        # a stop string's matcher is built per request on the event loop (gateway/stop.py)
MAX_TOP_LOGPROBS = 20
MAX_N = 16                  # choices per prompt; each is its own engine request
MAX_CHOICES = 64            # prompts x n in one completions request
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1     # what torch.Generator.manual_seed accepts
MAX_TEMPERATURE = 100.0     # above ~10 every distribution is flat anyway; keeps logits / T finite
MIN_TOP_P = 1e-6            # smaller values keep only the most likely token, as this does
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class _Request(BaseModel):
    # NaN and +-Infinity are refused in every number field (JSON has neither, but Python's json module reads them).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries the usage so far (its choice's completion tokens)
    continuous_usage_stats: bool | None = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None          # {"type": "refusal", "refusal": ...}: assistant history only


class HistoryFunction(BaseModel):
    """A call in the history: a name, and arguments as the JSON text OpenAI sends (or an object, as some do)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class HistoryToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: HistoryFunction


class ChatMessage(BaseModel):
    """One message. The history fields the templates read are checked here, so a malformed one is a 400 naming it
    (`messages[3].tool_calls[0].function.name`) instead of a template error; other extra fields pass through."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    function_call: HistoryFunction | None = None       # legacy (pre-tools) assistant call

    def template_extras(self) -> dict[str, Any]:
        """The history fields given, as the template reads them (plain dicts), then any other extra field."""
        out = {k: v for k, v in (self.model_extra or {}).items()}
        for key in ("tool_call_id", "reasoning_content", "refusal"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.function_call is not None:
            out["function_call"] = self.function_call.model_dump()
        return out


class _Sampling(_Request):
    """Fields shared by both endpoints. None means "not given": generation_config.json fills it. Every field
    accepts an explicit null (many clients send null for "unset")."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # vLLM's structured-output extras (sent through extra_body): one of them, or `structured_outputs` (its newer
    # object: json / regex / choice / grammar / json_object); gateway/chat_plan.guided_format reads them.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Bounds (docs/agents.md, "Sampling parameters"): finite; top_p and repetition_penalty no smaller than what
    # float32 sampling still tells from 0 (1e-30 would underflow to a division by zero on the device).
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, ge=MIN_TOP_P, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)          # -1 and 0 both mean "off" (vLLM uses -1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None                 # vLLM extension: extra ids that end generation
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    logit_bias: dict[str, Any] | None = None                # token id (string) -> [-100, 100]; checked by the API
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0)     # vLLM extension: no stop token / string before this many

    # OpenAI's and vLLM's rule on the chat and completions routes (the Responses API has other stream options,
    # which the openai-agents SDK sends without streaming)
    stream_options_need_stream: ClassVar[bool] = True

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and cls.stream_options_need_stream and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        if sum(len(s) for s in items if isinstance(s, str)) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters together")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `stream_options.continuous_usage_stats` (with include_usage): usage on every chunk."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class _VllmOutput(BaseModel):
    """vLLM's extras of the chat and completions routes (sent through extra_body) beside the sampling ones."""

    # the matched stop string stays at the end of the text (it is still where the text ends)
    include_stop_str_in_output: bool | None = False
    # false: special tokens the model writes (other than the stop tokens) are part of the text
    skip_special_tokens: bool | None = True
    # keep only the prompt's last k tokens (-1: the context length); the API layer cuts the tokenized prompt
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's that change what is generated and that moepipe cannot do: refused when set (`vllm_unsupported`), never
    # silently ignored
    use_beam_search: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's token-id extras (what RL trainers send: verl, SkyRL, agent-lightning). With logprobs, every token string
    # in them is "token_id:{id}" (a token that is no whole UTF-8 text is still known exactly); the choices carry the
    # generated ids (`token_ids`) and the prompt's (`prompt_token_ids`). Absent or false: the bodies are unchanged.
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, v: int | None) -> int | None:
        if v == 0:          # vLLM's rule too: 0 would leave no prompt (a 400 naming the prompt, not this field)
            raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for the context length")
        return v

    def vllm_unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first vLLM extra given that cannot be honoured; None if there is none."""
        if self.use_beam_search:
            return "use_beam_search", "Beam search is not supported; sample n choices instead."
        if self.bad_words:
            return "bad_words", "bad_words is not supported; use logit_bias to ban single tokens."
        if self.allowed_token_ids:
            return "allowed_token_ids", ("allowed_token_ids is not supported; use guided_choice / guided_regex or "
                                         "logit_bias to constrain the tokens.")
        return None


def check_prompt_logprobs(v: int | None) -> int | None:
    """vLLM's `prompt_logprobs`: null (none), or k >= 0 (each prompt token's logprob and rank, plus the k most likely
    tokens at its position), at most MAX_TOP_LOGPROBS as top_logprobs / logprobs are. vLLM's -1 (the whole
    vocabulary) is refused by name."""
    if v is None:
        return v
    if v == -1:
        raise ValueError(f"-1 (the whole vocabulary at every prompt position) is not supported; ask for at most "
                         f"{MAX_TOP_LOGPROBS} alternatives")
    if v < 0:
        raise ValueError("must be >= 0 (or null)")
    if v > MAX_TOP_LOGPROBS:
        raise ValueError(f"must be <= {MAX_TOP_LOGPROBS}")
    return v


class _PromptLogprobs(BaseModel):
    """The vLLM extra both the chat and the completions route take (sent through extra_body)."""

    prompt_logprobs: StrictInt | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, v: int | None) -> int | None:
        return check_prompt_logprobs(v)


class ChatCompletionRequest(_Sampling, _PromptLogprobs, _VllmOutput):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat extras: render without the assistant header, or continue the final (assistant) message where its
    # text ends (a prefilled reply); echo: a reply to a final assistant message starts with that message's text
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None                     # "none" switches thinking off (gateway.chat_plan)
    functions: list[dict[str, Any]] | None = None           # legacy: mapped to tools by gateway.chat_plan
    function_call: str | dict[str, Any] | None = None       # legacy: mapped to tool_choice
    # OpenAI's output modalities: the models served write text, so audio output is refused, not silently dropped
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @property
    def budget(self) -> int | None:
        """max_completion_tokens supersedes the deprecated max_tokens (vLLM's rule)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def budget_param(self) -> str:
        """The field `budget` came from, as errors name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def explicit_budget(self) -> int | None:
        """The length the client asked for (None: not asked, the rest of the context)."""
        return self.budget

    @property
    def top_k_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None for no logprobs, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(param, message) of the first field we cannot honour; None if the request is servable (the agent fields
        are checked by gateway.chat_plan)."""
        if self.top_logprobs and not self.logprobs:        # 0 asks for nothing (vLLM lets it pass)
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        other = [m for m in self.modalities or [] if m != "text"]
        if other:
            return "modalities", f"This model writes text only: modalities may hold \"text\", not {other[0]!r}."
        if self.audio is not None:
            return "audio", "This model writes text only: audio output is not available."
        return self.vllm_unsupported()


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False    # vLLM's: as on /v1/chat/completions (the prompt ends in the final message)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class InputTokensResponse(BaseModel):
    """OpenAI's `POST /v1/responses/input_tokens`: the tokens the request's input would take as a prompt."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class CompletionRequest(_Sampling, _PromptLogprobs, _VllmOutput):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]    # a boolean is not a token id
    # The legacy endpoint's default (OpenAI's and vLLM's): a completion request that names no length gets 16
    # tokens, not the rest of the context (an explicit null still means "to the end of the context").
    # 0 only with echo (vLLM's, what lm-eval's loglikelihood requests send): the prompt and its logprobs, nothing
    # generated
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    # Fill-in-the-middle (editor autocompletion sends the text after the cursor here): the prompt becomes the
    # tokenizer's FIM form, `FIM_TOKENS`; a model without those tokens refuses it rather than ignore it.
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)      # only = n (or 1) is servable: every choice is returned
    response_format: dict[str, Any] | None = None        # as on the chat route (vLLM takes it here too)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)) and len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request")
        return v

    @property
    def budget(self) -> int | None:
        return self.max_tokens

    budget_param: ClassVar[str] = "max_tokens"

    @property
    def explicit_budget(self) -> int | None:
        """The length the client asked for: the legacy default of 16, not sent, is no request (it is cut to what
        the context leaves rather than refused), nor is an explicit null (the rest of the context)."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else None

    @property
    def top_k_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Every prompt, as text or token ids (a single prompt is a list of one)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


class ResponsesRequest(_Sampling, _VllmOutput):
    """`POST /v1/responses` (the OpenAI Responses API). Shapes only: `gateway.responses` checks the items, tools,
    tool_choice and text.format in depth and turns the request into a ChatCompletionRequest. The sampling extras
    of the chat route (top_k, min_p, seed, stop, logit_bias, ...) and vLLM's output extras (include_stop_str_in_output,
    skip_special_tokens, truncate_prompt_tokens; beam search, bad_words and allowed_token_ids refused by name) are
    taken as they are there; `max_tokens` and
    `n` are chat fields with no meaning here and are refused by `gateway.responses` when given."""

    stream_options_need_stream: ClassVar[bool] = False

    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    # Fields that need state or features we do not have: refused by gateway.responses when set.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    moderation: dict[str, Any] | None = None


# ---- responses -------------------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0          # prompt tokens restored from the prefix cache instead of computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(BaseModel):
    """One token at one prompt position in vLLM's `prompt_logprobs` (keyed by its id, as a string)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` answer: null for the first prompt token, then per position the prompt token itself and
# the k most likely tokens there
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


def _omit_none(v: Any) -> bool:
    return v is None


def _omit_empty(v: Any) -> bool:
    return not v


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """`tool_calls` and `function_call` are left out of the JSON when absent, as OpenAI does (clients test
    `if (msg.tool_calls)`; an empty list is truthy in JavaScript)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_omit_empty)
    function_call: FunctionCall | None = Field(default=None, exclude_if=_omit_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's `return_token_ids`: every generated id (a stop token and the tokens of a stop string included)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=_omit_none)   # when asked (vLLM's)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)   # vLLM's `return_token_ids`


class DeltaFunction(BaseModel):
    name: str | None = Field(default=None, exclude_if=_omit_none)
    arguments: str = ""


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first carries id, type and name; later ones argument text only."""

    index: int
    id: str | None = Field(default=None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_omit_none)
    function: DeltaFunction


class DeltaMessage(BaseModel):
    """A streamed delta: fields not carried by this chunk are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_omit_none)
    function_call: DeltaFunction | None = Field(default=None, exclude_if=_omit_none)    # legacy requests


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)    # the ids of this chunk's tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=_omit_none)   # on the first chunk
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)   # on each choice's first chunk


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # when asked (vLLM's); streamed, on the choice's first chunk
    prompt_logprobs: PromptLogprobsList | None = Field(default=None, exclude_if=_omit_none)
    # vLLM's `return_token_ids`: the prompt's ids (streamed: on the choice's first chunk) and the generated ones
    # (streamed: those of each chunk)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelPermission(BaseModel):
    """vLLM's (the early OpenAI API's) permission entry on a model card; clients that read `permission[0]` find it."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """A model as vLLM's /v1/models lists it: `root` the model served (vLLM: its path), `parent` null (no LoRA
    adapters here), `max_model_len` the context length."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moepipe"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
