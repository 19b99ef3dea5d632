"""Row ids of the hashed n-gram ("PLE") embedding table of Qwen4-Exp.

Each PLE layer owns one big table. A token's embedding there is the concatenation of `num_heads` rows, one per
(n-gram order, head) pair: for orders 2..ngram_size the previous tokens of the n-gram are multiplied by per-position
odd multipliers, XOR-ed together, reduced modulo a per-head prime and shifted by that head's offset in the table.
History never reaches across an EOS token: positions before the latest EOS read as EOS.

The ids must match `transformers`' `Qwen4ExpTextNGramEmbedding` bit for bit, or every PLE layer reads garbage rows;
`tests/test_ngram_hash.py` checks that against the reference. Everything here is pure integer arithmetic in int64
with two's-complement wrap-around, which numpy and torch both give us for arrays.

Streaming: the only state carried between calls is the last `ngram_size - 1` raw token ids of a sequence (its
"context"); a fresh sequence starts from an all-EOS context (`initial_context`). Feeding a stream in chunks with the
returned context gives exactly the ids of feeding it at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

__all__ = [
    "NgramHashSpec",
    "initial_context",
    "context_after",
    "hash_windows_numpy",
    "hide_behind_eos",
    "ngram_rows_numpy",
    "ngram_rows_torch",
    "ngram_rows_torch_flat",
    "numpy_constants",
    "ple_layer_indices",
]

_U64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
# splitmix64 (Steele, Lea & Flood 2014): the golden-ratio increment and the two finaliser multipliers.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_A = 0xBF58476D1CE4E5B9
_MIX_B = 0x94D049BB133111EB
# Each PLE layer perturbs the seed by this prime times its PLE index, so that layers hash differently.
_LAYER_SEED_STRIDE = 10007

# Defaults of `Qwen4ExpTextConfig`: `save_pretrained` drops fields equal to their default, so config.json may omit them.
_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
}


def _splitmix64(x: int) -> int:
    """One splitmix64 step on an unsigned 64-bit python int (increment, then the mixing finaliser)."""
    z = (x + _GOLDEN_GAMMA) & _U64
    z = ((z ^ (z >> 30)) * _MIX_A) & _U64
    z = ((z ^ (z >> 27)) * _MIX_B) & _U64
    return z ^ (z >> 31)


def _small_primes(limit: int) -> np.ndarray:
    """All primes <= limit (sieve of Eratosthenes), as int64."""
    if limit < 2:
        return np.zeros(0, dtype=np.int64)
    is_p = np.ones(limit + 1, dtype=bool)
    is_p[:2] = False
    for p in range(2, math.isqrt(limit) + 1):
        if is_p[p]:
            is_p[p * p :: p] = False
    return np.flatnonzero(is_p).astype(np.int64)


def _primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start, ascending.

    A segmented sieve over [start, start + span): every composite there has a prime factor <= sqrt(end), so this is
    trial division by those small primes done for a whole window at once. Milliseconds for start = 2e7 and hundreds
    of primes, where per-candidate trial division in Python would take seconds for deep PLE layers.
    """
    found: list[int] = []
    lo = max(start, 0)
    # Prime gaps average ln(n); ask for twice the expected span so one window usually suffices.
    span = max(1024, int(2 * count * max(math.log(max(lo, 3)), 1.0)) + 64)
    while len(found) < count:
        hi = lo + span
        window = np.ones(span, dtype=bool)
        if lo < 2:
            window[: 2 - lo] = False
        for p in _small_primes(math.isqrt(hi - 1)).tolist():
            first = max(p * p, -(-lo // p) * p)
            if first < hi:
                window[first - lo :: p] = False
        found.extend((np.flatnonzero(window) + lo).tolist())
        lo = hi
        span *= 2
    return [int(p) for p in found[:count]]


@dataclass(frozen=True)
class NgramHashSpec:
    """Everything that determines the n-gram row ids of one PLE layer; hashable, so usable as a cache key.

    `ple_layer_index` is the position of the layer among the PLE layers (0 for the first PLE layer), not the decoder
    layer index: it selects the layer's multipliers and which primes its heads get.
    """

    vocab_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_divisible_by: int
    seed: int
    eos_token_id: int
    ple_layer_index: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # accept numpy / torch integer scalars, store plain ints (stable hashing)
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{f.name} must be an integer, got {v!r}")
            object.__setattr__(self, f.name, int(v))
        if self.ngram_size < 2:
            raise ValueError(f"ngram_size must be >= 2, got {self.ngram_size}")
        if self.heads_per_ngram < 1:
            raise ValueError(f"heads_per_ngram must be >= 1, got {self.heads_per_ngram}")
        if self.make_divisible_by < 1:
            raise ValueError(f"make_divisible_by must be >= 1, got {self.make_divisible_by}")
        if self.ple_layer_index < 0:
            raise ValueError(f"ple_layer_index must be >= 0, got {self.ple_layer_index}")

    @classmethod
    def from_model_config(cls, cfg: Any, ple_layer_index: int) -> NgramHashSpec:
        """Build from a model config: a mapping (config.json) or an object with the `transformers` attribute names.

        A multimodal config's `text_config` is used when the top level has no n-gram fields. Missing fields take the
        `Qwen4ExpTextConfig` defaults; `eos_token_id` is required, and a list means its first entry (as the reference).
        """
        get = _config_getter(cfg)
        if get("ngram_size") is None:
            text = get("text_config")
            if text is None and hasattr(cfg, "get_text_config"):
                text = cfg.get_text_config()
            if text is not None and text is not cfg:
                get = _config_getter(text, fallback=get)

        def value(name: str, *aliases: str) -> Any:
            for key in (name, *aliases):
                v = get(key)
                if v is not None:
                    return v
            if name in _CONFIG_DEFAULTS:
                return _CONFIG_DEFAULTS[name]
            raise ValueError(f"model config has no {name!r}")

        eos = value("eos_token_id")
        if isinstance(eos, (list, tuple)):
            if not eos:
                raise ValueError("model config has an empty eos_token_id list; PLE needs an EOS id")
            eos = eos[0]
        return cls(
            vocab_size=int(value("vocab_size")),
            ngram_size=int(value("ngram_size")),
            heads_per_ngram=int(value("heads_per_ngram")),
            ngram_vocab_size_base=int(value("ngram_vocab_size_base")),
            make_divisible_by=int(value("make_ngram_vocab_size_divisible_by", "make_divisible_by")),
            seed=int(value("seed")),
            eos_token_id=int(eos),
            ple_layer_index=int(ple_layer_index),
        )

    @property
    def context_len(self) -> int:
        """Raw token ids carried between calls: the n-gram's history length."""
        return self.ngram_size - 1

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @cached_property
    def primes(self) -> tuple[int, ...]:
        """Per-head moduli: the primes >= base numbered `ple_layer_index * num_heads + head` (0-based), so that
        all heads of all PLE layers get distinct table sizes."""
        first = self.ple_layer_index * self.num_heads
        return tuple(_primes_from(self.ngram_vocab_size_base, first + self.num_heads)[first:])

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start row of each head's slice of the table (heads are laid out back to back, order 2 first)."""
        starts, acc = [], 0
        for p in self.primes:
            starts.append(acc)
            acc += p
        return tuple(starts)

    @cached_property
    def multipliers(self) -> tuple[int, ...]:
        """One odd multiplier per n-gram position (0 = current token), each < (2**63 - 1) // vocab_size so that an
        in-vocabulary id times its multiplier never overflows int64 (out-of-vocabulary ids simply wrap)."""
        bound = _I64_MAX // max(self.vocab_size, 1)
        half = max(1, bound // 2)
        layer_seed = self.seed + _LAYER_SEED_STRIDE * self.ple_layer_index
        return tuple(
            2 * (_splitmix64((layer_seed + _GOLDEN_GAMMA * (pos + 1)) & _U64) % half) + 1
            for pos in range(self.ngram_size)
        )

    @property
    def total_rows(self) -> int:
        """Rows actually addressable by the hash (sum of the head primes)."""
        return self.offsets[-1] + self.primes[-1]

    @property
    def padded_rows(self) -> int:
        """Rows of the stored table: total_rows rounded up to a multiple of make_divisible_by."""
        d = self.make_divisible_by
        return -(-self.total_rows // d) * d


def _config_getter(cfg: Any, fallback: Any = None):
    def get(name: str) -> Any:
        if isinstance(cfg, Mapping):
            v = cfg.get(name)
        else:
            v = getattr(cfg, name, None)
        if v is None and fallback is not None:
            v = fallback(name)
        return v

    return get


def ple_layer_indices(ple_layer_ids: list[int]) -> dict[int, int]:
    """Map 0-based decoder layer -> PLE layer index, from the config's 1-based `ple_layer_ids` (sorted, deduplicated
    as `Qwen4ExpTextConfig` does)."""
    return {layer_id - 1: i for i, layer_id in enumerate(sorted(set(ple_layer_ids)))}


def initial_context(spec: NgramHashSpec) -> np.ndarray:
    """The context of a sequence that has seen no token yet: all EOS, so the first token's n-grams are EOS-padded."""
    return np.full(spec.context_len, spec.eos_token_id, dtype=np.int64)


def context_after(spec: NgramHashSpec, history: list[int], position: int) -> np.ndarray:
    """The context after the first `position` ids of a stream, from its last ids `history` (the prefix cache's
    restoring entries carry them: `SeqEntry.history`): what feeding the stream from `initial_context` leaves."""
    if len(history) < min(position, spec.context_len):
        raise ValueError(f"{len(history)} ids of history cannot give the n-gram context after {position} ids "
                         f"({spec.context_len} needed)")
    return np.concatenate([initial_context(spec), np.asarray(history, dtype=np.int64)])[-spec.context_len:]


# ---------------------------------------------------------------------------------------------------------------------
# numpy


def ngram_rows_numpy(spec: NgramHashSpec, context: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row ids of one sequence's `tokens`, given the `ngram_size - 1` raw ids that preceded them.

    Returns `(rows, new_context)`: rows is int64 of shape (T, num_heads); new_context is the context for the next
    call (the last ngram_size - 1 ids of context + tokens).
    """
    n = spec.ngram_size
    context = np.asarray(context, dtype=np.int64).reshape(-1)
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if context.shape[0] != n - 1:
        raise ValueError(f"context must hold ngram_size - 1 = {n - 1} ids, got {context.shape[0]}")
    history = np.concatenate([context, tokens])
    new_context = history[history.shape[0] - (n - 1) :].copy()
    if tokens.shape[0] == 0:
        return np.zeros((0, spec.num_heads), dtype=np.int64), new_context
    # windows[t, s] = id s positions before token t (s = 0 is the token itself).
    windows = np.lib.stride_tricks.sliding_window_view(history, n)[:, ::-1]
    return _hash_windows_numpy(spec, windows), new_context


def ngram_rows_numpy_batch(spec: NgramHashSpec, contexts: np.ndarray,
                           tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ngram_rows_numpy` for B sequences feeding one token each (a decode step), in one pass:
    contexts [B, ngram_size - 1], tokens [B] -> (rows [B, num_heads], new contexts [B, ngram_size - 1])."""
    n = spec.ngram_size
    contexts = np.asarray(contexts, dtype=np.int64).reshape(-1, n - 1)
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
    history = np.concatenate([contexts, tokens], axis=1)          # oldest first
    return _hash_windows_numpy(spec, history[:, ::-1]), history[:, 1:].copy()


@functools.lru_cache(maxsize=64)
def numpy_constants(spec: NgramHashSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(multipliers (n,), primes (n-1, H), offsets (n-1, H)) as read-only int64 arrays, built once per spec: a
    decode step's hash on the host (a PLE stage's own rows, on its critical path) took 13.5 us with them built
    every call, 11.8 us without (full shape, 4 sequences, the development VM). A caller that hashes every step
    keeps them (`hash_windows_numpy`), which also spares the cache's lookup."""
    shape = (spec.ngram_size - 1, spec.heads_per_ngram)
    out = (np.array(spec.multipliers, dtype=np.int64), np.array(spec.primes, dtype=np.int64).reshape(shape),
           np.array(spec.offsets, dtype=np.int64).reshape(shape))
    for a in out:
        a.flags.writeable = False
    return out


def hide_behind_eos(windows: np.ndarray, eos: int) -> np.ndarray:
    """`windows` (B, n), windows[:, s] = id s positions back, in place: a position is hidden (reads as EOS) if any of
    positions 1..s back is an EOS, so no n-gram spans the end of a sequence. Returns `windows`."""
    hit = windows[:, 1:] == eos
    if hit.any():                              # (rare in a decode step: a context that holds an EOS)
        windows[:, 1:][np.logical_or.accumulate(hit, axis=1)] = eos
    return windows


def hash_windows_numpy(windows: np.ndarray, constants: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Row ids (B, num_heads) of windows (B, n) already passed through `hide_behind_eos`, with one spec's
    `numpy_constants`. The int64 products wrap, as numpy's array arithmetic does without a warning. One spec's
    windows serve every PLE layer of equal `ngram_size` and EOS (their specs differ in the constants alone), so a
    decode step builds them once for all its layers (`stage_worker/ple_decode_rows.py`)."""
    mult, primes, offsets = constants
    # mixed[:, k-1] is the XOR over positions 0..k of an order-(k+1) n-gram.
    mixed = np.bitwise_xor.accumulate(windows * mult, axis=1)[:, 1:]
    rows = mixed[:, :, None] % primes
    rows += offsets
    return rows.reshape(windows.shape[0], primes.size)


def _hash_windows_numpy(spec: NgramHashSpec, windows: np.ndarray) -> np.ndarray:
    return hash_windows_numpy(hide_behind_eos(windows.copy(), spec.eos_token_id), numpy_constants(spec))


# ---------------------------------------------------------------------------------------------------------------------
# torch


@functools.lru_cache(maxsize=64)
def _constants(spec: NgramHashSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(multipliers (n,), primes (n-1, H), offsets (n-1, H)) on `device`, built once per device."""
    shape = (spec.ngram_size - 1, spec.heads_per_ngram)
    mult = torch.tensor(spec.multipliers, dtype=torch.long, device=device)
    primes = torch.tensor(spec.primes, dtype=torch.long, device=device).view(shape)
    offsets = torch.tensor(spec.offsets, dtype=torch.long, device=device).view(shape)
    return mult, primes, offsets


def _hash_windows_torch(spec: NgramHashSpec, windows: torch.Tensor) -> torch.Tensor:
    """windows (..., n) with windows[..., s] = id s positions back -> rows (..., num_heads)."""
    eos = spec.eos_token_id
    mult, primes, offsets = _constants(spec, windows.device)
    hidden = (windows[..., 1:] == eos).cumsum(dim=-1) > 0
    shifted = torch.cat([windows[..., :1], windows[..., 1:].masked_fill(hidden, eos)], dim=-1)
    terms = shifted * mult
    acc = terms[..., 0]
    mixed = []
    for k in range(1, spec.ngram_size):  # loop over n-gram positions (2-4 of them), not tokens
        acc = torch.bitwise_xor(acc, terms[..., k])
        mixed.append(acc)
    mixed_t = torch.stack(mixed, dim=-1)  # (..., n-1)
    rows = torch.remainder(mixed_t.unsqueeze(-1), primes) + offsets  # (..., n-1, H)
    return rows.flatten(-2)


def ngram_rows_torch(
    spec: NgramHashSpec, context: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched `ngram_rows_numpy` for equal-length sequences, on the device of `tokens`.

    context: (B, ngram_size - 1) raw ids preceding each row of tokens; tokens: (B, T).
    Returns rows (B, T, num_heads) int64 and new_context (B, ngram_size - 1).
    """
    n = spec.ngram_size
    tokens = tokens.long()
    context = context.to(device=tokens.device, dtype=torch.long)
    if tokens.dim() != 2 or context.dim() != 2 or context.shape != (tokens.shape[0], n - 1):
        raise ValueError(
            f"expected context (B, {n - 1}) and tokens (B, T); got {tuple(context.shape)} and {tuple(tokens.shape)}"
        )
    history = torch.cat([context, tokens], dim=1)
    new_context = history[:, history.shape[1] - (n - 1) :].clone()
    if tokens.shape[1] == 0:
        return tokens.new_zeros(tokens.shape[0], 0, spec.num_heads), new_context
    # unfold gives history[t : t + n] for token t; flip so that index s means "s positions back".
    windows = history.unfold(1, n, 1).flip(-1)
    return _hash_windows_torch(spec, windows), new_context


def ngram_rows_torch_flat(
    spec: NgramHashSpec, contexts: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen batch: sequence b owns tokens[cu_seqlens[b]:cu_seqlens[b+1]] and starts from contexts[b].

    Returns rows (total, num_heads) and new contexts (B, ngram_size - 1). Sequences may be empty (context kept).
    No host synchronisation beyond what the inputs imply: the total length is tokens.numel().
    """
    n = spec.ngram_size
    device = tokens.device
    tokens = tokens.long().reshape(-1)
    contexts = contexts.to(device=device, dtype=torch.long)
    cu = cu_seqlens.to(device=device, dtype=torch.long).reshape(-1)
    num_seqs = cu.shape[0] - 1
    if contexts.shape != (num_seqs, n - 1):
        raise ValueError(f"contexts must be ({num_seqs}, {n - 1}) to match cu_seqlens, got {tuple(contexts.shape)}")
    total = tokens.shape[0]
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths, output_size=total)
    pos = torch.arange(total, device=device) - cu[:-1][seq]  # position of each token within its sequence

    def lookup(seq_idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Id at position p (>= -(n-1); negative = inside the context) of sequence seq_idx."""
        in_ctx = p < 0
        from_tokens = tokens[(cu[:-1][seq_idx] + p).clamp(0, max(total - 1, 0))] if total else p
        from_ctx = contexts[seq_idx, (p + (n - 1)).clamp(0, n - 2)]
        return torch.where(in_ctx, from_ctx, from_tokens)

    back = torch.arange(n, device=device)
    windows = lookup(seq.unsqueeze(1).expand(-1, n), pos.unsqueeze(1) - back)  # (total, n)
    rows = _hash_windows_torch(spec, windows)

    tail = torch.arange(n - 1, device=device) - (n - 1)  # -(n-1) .. -1 relative to each sequence's end
    all_seqs = torch.arange(num_seqs, device=device)
    new_contexts = lookup(all_seqs.unsqueeze(1).expand(-1, n - 1), lengths.unsqueeze(1) + tail)
    return rows, new_contexts
