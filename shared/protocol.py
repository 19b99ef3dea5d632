"""Every message that crosses a process boundary, and the only code that knows their bytes.

A message is one ZeroMQ multipart message: frame 0 is a msgpack header `{"t": type, "v": version, ...fields}`; each
tensor field is replaced in the header by a descriptor (dtype, shape, frame number) and its raw bytes travel as a
following frame, sent without copying. Nothing else in moepipe pickles or hand-rolls bytes.

Every process has one inbox (a PULL socket it binds); senders connect PUSH sockets to it. Types, by receiver:
  stage k     Plan (from the gateway, broadcast to all stages), Activations or IpcActivations (from stage k-1),
              Sampled (stage 0, from the last stage), PleReady (the PLE stage, from the PLE service), Shutdown;
              with `cuda_ipc_activations`: IpcOffer (from stage k-1), IpcRequest and IpcAccept (from stage k+1)
  gateway     StepResult (from the last stage), Heartbeat (from every component), StageError
  PLE service Plan, Sampled, Shutdown
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

VERSION = 3          # 3: TokenOut.prompt_logprobs is a PromptLogprobs (ranks, alternatives)
_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool")


@cache
def _torch_dtypes() -> dict:
    """Tensor dtype names <-> torch dtypes. torch is imported only where a tensor crosses: the gateway handles no
    tensor message and never imports it (~2.5 s and ~300 MB off its start)."""
    import torch

    return {name: getattr(torch, name) for name in _DTYPES}


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")           # no torch imported: no tensor to send
    return torch is not None and isinstance(value, torch.Tensor)


HISTORY = 32        # tokens a restoring entry carries from before its position (`SeqEntry.history`)
PLANS_IN_FLIGHT = 2  # plans of one micro-batch the core sends before the oldest's result (plan-ahead); stage 0
#                      relies on it to know which finished steps a later drop can still name


class ProtocolError(ValueError):
    """A message that cannot be decoded: wrong version, unknown type, malformed frames."""


@dataclass
class SeqEntry:
    """One sequence's share of a step."""

    req_id: str
    slot: int                        # Gated DeltaNet / PLE state slot
    context_len: int                 # tokens already in the caches
    num_tokens: int                  # tokens fed this step (prefill chunk length, or 1 for decode)
    new_blocks: list[int]            # KV blocks added to the request's table since its previous entry (its whole
                                     # table when context_len is 0): a plan never resends what stages hold
    tokens: list[int] | None = None  # prefill tokens; None for decode: the token comes from the last stage
    sample: bool = True              # last chunk of a prefill or a decode: the last stage samples a token
    prompt_logprobs: bool = False    # return the fed tokens' prompt logprobs (`PromptLogprobs`; echo, prompt_logprobs)
    next_token: int | None = None    # with prompt_logprobs: the prompt token after this chunk
    allowed: bytes | None = None     # structured output: packed mask of the ids the sampled token may take
                                     # (shared/token_mask.py), from the gateway's grammar state after the last token
    restore: int | None = None       # prefix cache (shared/prefix_cache.py): the request's first entry, at
                                     # context_len > 0: copy snapshot slot `restore` into `slot` before the step;
                                     # `new_blocks` is then the whole table (the prefix's shared blocks first)
    history: list[int] | None = None  # with restore: the (up to HISTORY) tokens before context_len, whose n-gram
                                     # context the PLE service rebuilds


@dataclass
class SamplingSpec:
    """Per-request sampling state the last stage needs; sent once, with the request's first plan entry."""

    req_id: str
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    logprobs: int | None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)     # tokens generated before a preemption (penalties)
    logit_bias: dict[int, float] | None = None               # token id -> added to the raw logit, before penalties
    min_tokens: int = 0                                      # min_tokens: `min_tokens_ban` is not sampled until
    min_tokens_ban: list[int] = field(default_factory=list)  # this many tokens (the stop ids: EOS, stop_token_ids)
    prompt_logprobs: int = 0         # entries with `prompt_logprobs`: alternatives (top-k) per prompt position


@dataclass
class Message:
    TYPE: ClassVar[str] = ""


@dataclass
class Plan(Message):
    """What every stage runs at `step`; stages prepare metadata from it before activations arrive."""

    TYPE: ClassVar[str] = "plan"
    step: int
    microbatch: int
    entries: list[SeqEntry]
    new_requests: list[SamplingSpec] = field(default_factory=list)
    # Drop per-request state (sampler, pending tokens, n-gram context) BEFORE running the entries: a request the
    # scheduler preempted while planning this step can be re-admitted in it, from position 0.
    finished: list[str] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)       # steps a stage failed: forget their pending inputs
    # prefix cache: (slot, snapshot slot) pairs; before running the entries (after any restore) each stage copies
    # its per-sequence state (DeltaNet, PLE) of `slot` into the snapshot slot: the state the entry starts from
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended (cancelled, or finished by a token) while plans in flight still hold them: a stage skips a
    # step all of whose entries are theirs instead of computing it (nobody reads its output), and remembers them
    # until they come in `finished`. Sent at once, on a plan with no entries (step -1) if no step is planned.
    cancelled: list[str] = field(default_factory=list)


@dataclass
class Activations(Message):
    TYPE: ClassVar[str] = "act"
    step: int
    hidden: torch.Tensor
    token_ids: torch.Tensor                                   # stages with PLE layers need the ids
    timing: list[list[float]] = field(default_factory=list)   # [stage, start, end, arrival], each stage so far
    # the sender skipped the step (every entry's request was `cancelled`): `hidden` is empty, and the receiver skips
    # it too, whether or not the cancellation has reached it yet
    skipped: bool = False


@dataclass
class PromptLogprobs:
    """Prompt logprobs of consecutive prompt positions (one entry's, or a whole prompt's joined): row i scores the
    prompt token that follows the i-th position given everything before it, from the raw logits' fp32 log_softmax.
    Raw little-endian arrays, not msgpack lists: a 2048-token chunk with 20 alternatives is ~350 KB."""

    top: int = 0                     # alternatives per row
    logprobs: bytes = b""            # float32 [rows]: the next prompt token's logprob
    ranks: bytes = b""               # int32 [rows]: its rank (1 + how many tokens are at least as likely, as vLLM)
    top_ids: bytes = b""             # int32 [rows, top]: the most likely tokens, best first
    top_logprobs: bytes = b""        # float32 [rows, top]

    @classmethod
    def build(cls, logprobs, ranks, top_ids, top_logprobs) -> PromptLogprobs:
        """From arrays (numpy, or anything numpy takes): [rows], [rows], [rows, top], [rows, top]."""
        ids = np.asarray(top_ids, dtype="<i4")
        return cls(top=int(ids.shape[1]) if ids.ndim == 2 else 0,
                   logprobs=np.asarray(logprobs, dtype="<f4").tobytes(), ranks=np.asarray(ranks, dtype="<i4").tobytes(),
                   top_ids=ids.tobytes(), top_logprobs=np.asarray(top_logprobs, dtype="<f4").tobytes())

    @classmethod
    def join(cls, parts: list[PromptLogprobs], top: int = 0) -> PromptLogprobs:
        """Consecutive parts as one (an empty list: no rows, `top` alternatives)."""
        if len(parts) == 1:
            return parts[0]
        return cls(top=parts[0].top if parts else top, logprobs=b"".join(p.logprobs for p in parts),
                   ranks=b"".join(p.ranks for p in parts), top_ids=b"".join(p.top_ids for p in parts),
                   top_logprobs=b"".join(p.top_logprobs for p in parts))

    def __len__(self) -> int:
        return len(self.logprobs) // 4

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(logprobs [rows], ranks [rows], top ids [rows, top], top logprobs [rows, top]), read-only views."""
        n = len(self)
        return (np.frombuffer(self.logprobs, dtype="<f4"), np.frombuffer(self.ranks, dtype="<i4"),
                np.frombuffer(self.top_ids, dtype="<i4").reshape(n, self.top),
                np.frombuffer(self.top_logprobs, dtype="<f4").reshape(n, self.top))


@dataclass
class TokenOut:
    req_id: str
    position: int                    # position the sampled token will occupy
    token: int                       # -1: nothing sampled (a middle prefill chunk that only returns prompt logprobs)
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # an entry with `prompt_logprobs`: one row per fed token whose next prompt token is known (all of a middle chunk;
    # the last chunk's last token is followed by the sampled one, which `logprob` scores)
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None         # this request failed inside the step (token -1): the others of the step go on

    def __post_init__(self) -> None:
        if isinstance(self.prompt_logprobs, dict):          # decoded from a message header
            self.prompt_logprobs = PromptLogprobs(**self.prompt_logprobs)


@dataclass
class Sampled(Message):
    """Sampled tokens, straight from the last stage to stage 0 (next decode input) and the PLE service."""

    TYPE: ClassVar[str] = "sampled"
    step: int
    microbatch: int
    tokens: list[TokenOut]


@dataclass
class StepResult(Message):
    """The same tokens, with logprobs and timings, for the gateway to stream."""

    TYPE: ClassVar[str] = "result"
    step: int
    microbatch: int
    tokens: list[TokenOut]
    timing: list[list[float]] = field(default_factory=list)   # [stage, start, end, arrival] wall clock, every stage


@dataclass
class PleReady(Message):
    """Rows for `step` sit in ring slot `ring_slot`: [tokens, ple_layers, heads, head_dim]."""

    TYPE: ClassVar[str] = "ple_ready"
    step: int
    ring_slot: int
    num_tokens: int


@dataclass
class IpcOffer(Message):
    """Stage k -> k+1 (`cuda_ipc_activations`, stage_worker/ipc_activations.py): stage k's ring of device slots for
    its activations, as CUDA IPC handles: one memory handle for the whole ring and one interprocess "ready" event
    per slot. Sent at start and again for every IpcRequest from a new process; answered by IpcAccept."""

    TYPE: ClassVar[str] = "ipc_offer"
    session: int                     # random per offer: IpcAccept and every IpcActivations name it
    pid: int
    host: str                        # host name and boot id: IPC handles mean nothing on another host
    device_uuid: str                 # the sender's GPU (the receiver maps it to its own device numbering)
    memory: dict                     # the ring's storage as `UntypedStorage._share_cuda_` describes it
    ready_events: list[bytes]        # per slot: an interprocess event the sender records once the slot is written
    slot_bytes: int                  # the ring is slots x slot_bytes; a slot holds the hidden state at offset 0
    ids_offset: int                  # ... and the step's token ids (int64) from this offset
    slot_tokens: int                 # tokens a slot holds (steps with more go the host way, as Activations)


@dataclass
class IpcRequest(Message):
    """Stage k+1 -> k at start: offer your slots (again): a restarted receiver holds none of the old session."""

    TYPE: ClassVar[str] = "ipc_request"
    pid: int


@dataclass
class IpcAccept(Message):
    """Stage k+1 -> k: the answer to an IpcOffer. `ok`: the receiver mapped the ring and created one interprocess
    "consumed" event per slot, and the file where it notes each slot's last consumed use; else `reason` says why
    not, and the activations keep going as Activations."""

    TYPE: ClassVar[str] = "ipc_accept"
    session: int
    pid: int
    ok: bool
    reason: str = ""
    consumed_events: list[bytes] = field(default_factory=list)
    release_file: str = ""


@dataclass
class IpcActivations(Message):
    """In place of Activations when the step's hidden state is in ring slot `slot` of stage k's session `session`
    (written, and the slot's ready event recorded, before this was sent): the receiver's stream waits for the
    event, copies the slot out and records the slot's consumed event."""

    TYPE: ClassVar[str] = "ipc_act"
    step: int
    session: int
    slot: int
    use: int                                                  # the session's handoff number (slot reuse order)
    shape: list[int]                                          # of the hidden state
    dtype: str
    num_ids: int                                              # token ids in the slot
    token_ids: list[int] | None = None                        # the same ids as a list, when the sender had them
    timing: list[list[float]] = field(default_factory=list)   # as Activations' (the sender's end: its launch)


@dataclass
class Heartbeat(Message):
    TYPE: ClassVar[str] = "hb"
    component: str                                            # "stage0", "stage1", ..., "ple"
    pid: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class StageError(Message):
    """A stage failed a step; the gateway fails the step's requests instead of waiting forever."""

    TYPE: ClassVar[str] = "error"
    component: str
    step: int
    message: str
    pid: int = 0                     # the sending process (0: in-process): an error from a process the gateway has
    #                                  not heard from yet is that component's restart (its plans predate it)


@dataclass
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"


MESSAGES: dict[str, type[Message]] = {c.TYPE: c for c in (Plan, Activations, Sampled, StepResult, PleReady,
                                                           Heartbeat, StageError, Shutdown, IpcOffer, IpcRequest,
                                                           IpcAccept, IpcActivations)}
_NESTED = {"entries": SeqEntry, "new_requests": SamplingSpec, "tokens": TokenOut}


def encode(msg: Message) -> list[Any]:
    """Message -> frames: msgpack header, then one raw frame per tensor (zero-copy memoryviews)."""
    frames: list[Any] = [b""]
    header: dict[str, Any] = {"t": msg.TYPE, "v": VERSION}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if _is_tensor(value):
            import torch

            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 or t.numel() == 0 else t
            name = str(t.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise ProtocolError(f"{msg.TYPE}.{f.name}: a {name} tensor cannot be sent ({', '.join(_DTYPES)})")
            header[f.name] = {"__tensor__": len(frames), "dtype": name, "shape": list(t.shape)}
            frames.append(memoryview(raw.numpy()).cast("B") if raw.numel() else b"")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            header[f.name] = [dataclasses.asdict(v) for v in value]
        else:
            header[f.name] = value
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def decode(frames: list[Any]) -> Message:
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message header: {exc}") from exc
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v') if isinstance(header, dict) else '?'} "
                            f"!= {VERSION}")
    cls = MESSAGES.get(header.pop("t", None))
    if cls is None:
        raise ProtocolError("unknown message type")
    header.pop("v")
    kwargs: dict[str, Any] = {}
    try:
        for f in dataclasses.fields(cls):
            if f.name not in header:
                continue
            value = header[f.name]
            if isinstance(value, dict) and "__tensor__" in value:
                value = _tensor(frames, value)
            elif f.name in _NESTED and isinstance(value, list):
                value = [_NESTED[f.name](**v) for v in value]
            kwargs[f.name] = value
        return cls(**kwargs)
    except Exception as exc:  # any malformed field (bad nested entry, dtype, frame index) is a protocol error
        raise ProtocolError(f"{cls.TYPE}: {type(exc).__name__}: {exc}") from exc


def _tensor(frames: list[Any], desc: dict) -> torch.Tensor:
    import torch

    idx, dtype, shape = desc["__tensor__"], _torch_dtypes()[desc["dtype"]], desc["shape"]
    buf = frames[idx]
    buf = buf.buffer if hasattr(buf, "buffer") else buf       # zmq.Frame
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    storage = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=torch.uint8)
    return storage.view(dtype).view(shape)
