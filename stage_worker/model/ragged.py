"""A step's sequences of different lengths in batched calls: the causal short convolutions with a per-sequence tail
state that DeltaNet and PLE run (no padding across lengths), and a padded [B, Lmax] view for what needs one
(attention over new prompts, the CPU delta rule).

Why: a prefill step of several prompts looped over its sequences in each layer, ~15 kernel launches a sequence a
DeltaNet layer. Prefill of short prompts is launch-bound on the host (h200-21: four prompts of 8-11 tokens, 20
layers, 5,418 kernels and 24 ms of GPU time in a 0.17 s step; one prompt 2,413 kernels, 0.08 s), so a burst of
chats paid for its sequence count in time to first token. The index tensors are built on the host once per step
(`StepBatch.ragged`), each only if a layer uses it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from stage_worker.host_copy import to_device


class Ragged:
    """A step's sequence lengths, and the index tensors between the flat [T, ...] layout and the padded
    [B, Lmax, ...] one, each built on the device only when a layer first asks for it (a one-length step needs
    none: padding is a reshape)."""

    def __init__(self, seq_lens: list[int], device: torch.device, context_lens: list[int] | None = None) -> None:
        """`context_lens` (default: every sequence continues) says which sequences start from a fresh state."""
        self.device = device
        self.host_lens = np.asarray(seq_lens, dtype=np.int64)                   # [B] tokens each sequence feeds
        self.host_cu = torch.from_numpy(np.concatenate([[0], np.cumsum(self.host_lens)]))   # [B + 1], on the host
        self.num_seqs = len(self.host_lens)
        self.max_len = int(self.host_lens.max()) if self.num_seqs else 0
        self.uniform = self.num_seqs * self.max_len == int(self.host_cu[-1])    # padding is a reshape
        fresh = [c == 0 for c in context_lens] if context_lens is not None else [False] * self.num_seqs
        self.all_new = bool(fresh) and all(fresh)
        # [B] bool on the device: the sequences with context (their state is read); None when all have or none has
        self.continues = None if all(fresh) or not any(fresh) else \
            to_device([not f for f in fresh], torch.bool, device)
        self._windows: dict = {}

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[B + 1] int64 on the device (flash-linear-attention's varlen argument; `host_cu` its `cu_seqlens_cpu`)."""
        return to_device(self.host_cu, torch.long, self.device)

    @functools.cached_property
    def pad_index(self) -> torch.Tensor:
        """[B, Lmax] int64: flat token row, or T (a zero row appended) past a sequence's end."""
        cu, lens = self.host_cu.numpy(), self.host_lens
        j = np.arange(self.max_len, dtype=np.int64)[None, :]
        return to_device(torch.from_numpy(np.where(j < lens[:, None], cu[:-1, None] + j, cu[-1])), torch.long,
                         self.device)

    @functools.cached_property
    def unpad_index(self) -> torch.Tensor:
        """[T] int64: b * Lmax + j of each flat token."""
        rows = [b * self.max_len + np.arange(n, dtype=np.int64) for b, n in enumerate(self.host_lens)]
        return to_device(torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)),
                         torch.long, self.device)

    def pad(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[T, ...] -> [B, Lmax, ...], `fill` past each sequence's end."""
        if self.uniform:
            return x.view(self.num_seqs, self.max_len, *x.shape[1:])
        extra = x.new_full((1, *x.shape[1:]), fill)
        return torch.cat([x, extra])[self.pad_index]

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[B, Lmax, ...] -> [T, ...]."""
        if self.uniform:
            return y.reshape(-1, *y.shape[2:])
        return y.flatten(0, 1)[self.unpad_index]

    def windows(self, tail: int, kernel: int, dilation: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of `cat([tails.flatten(0, 1), x])` (B * tail rows of tails, then the T tokens): for each token its
        conv window's `kernel` taps [T, kernel], and each sequence's next tail [B, tail], where sequence b's
        extended sequence is its tail then its tokens. Built once per (tail, kernel, dilation) a step."""
        key = (tail, kernel, dilation)
        cached = self._windows.get(key)
        if cached is None:
            lens, B, cu = self.host_lens, self.num_seqs, self.host_cu.numpy()
            seq = np.repeat(np.arange(B), lens)
            local = np.arange(int(cu[-1])) - cu[seq]

            def rows(b: np.ndarray, q: np.ndarray) -> np.ndarray:   # extended position q of sequence b -> src row
                return np.where(q < tail, b * tail + q, B * tail + cu[b] + q - tail)

            taps = rows(seq[:, None], local[:, None] + np.arange(kernel)[None, :] * dilation)
            tails = rows(np.arange(B)[:, None], lens[:, None] + np.arange(tail)[None, :])
            dev = self.device
            cached = self._windows[key] = (to_device(torch.from_numpy(taps.astype(np.int64)), torch.long, dev),
                                           to_device(torch.from_numpy(tails.astype(np.int64)), torch.long, dev))
        return cached


def ragged_causal_conv(x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor, dilation: int,
                       ragged: Ragged) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d of each sequence's tokens after its tail (the tokens before, zeros for a new one).

    x [T, C] flat tokens; tails [B, tail, C] with tail = dilation * (kernel - 1), in the state's dtype; weight
    [C, 1, kernel]. Returns (y [T, C] in x's dtype, before any activation; new tails [B, tail, C]). Sequences of
    different lengths: each token's window is gathered from its own sequence's tail and tokens (no padding, T x
    kernel rows whatever the lengths)."""
    B, tail, C = tails.shape
    if ragged.uniform:       # one length (one prompt's chunk): the plain conv over [B, C, tail + L], 1/kernel the bytes
        seq = torch.cat([tails, ragged.pad(x).to(tails.dtype)], dim=1)
        y = F.conv1d(seq.transpose(1, 2).to(x.dtype), weight, groups=C, dilation=dilation)
        return ragged.unpad(y.transpose(1, 2)), seq[:, seq.shape[1] - tail:]
    taps, new_tails = ragged.windows(tail, weight.shape[-1], dilation)
    src = torch.cat([tails.reshape(B * tail, C), x.to(tails.dtype)])
    y = (src[taps].to(x.dtype) * weight[:, 0, :].T[None]).sum(1)
    return y, src[new_tails].view(B, tail, C)


def fresh_masked(state_rows: torch.Tensor, ragged: Ragged, fill: float = 0) -> torch.Tensor:
    """`state_rows` [B, ...] with the rows of new sequences (no context) set to `fill` (their initial state):
    their slots may hold a finished request's values (or NaN garbage, which a multiply by zero would keep)."""
    if ragged.all_new:
        return torch.full_like(state_rows, fill)
    if ragged.continues is None:
        return state_rows
    keep = ragged.continues.view(-1, *([1] * (state_rows.dim() - 1)))
    return torch.where(keep, state_rows, torch.full_like(state_rows, fill))
