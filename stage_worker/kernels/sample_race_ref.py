"""PyTorch reference of the sampling race in `sample_race.py`, and the path `batch_sampler` takes without it (the CPU,
or the `sample_race` kernel flag off).

A sampled row's token is argmax(p / E) over its candidates, E = -log(U) ~ Exp(1), with U a 32-bit integer hash of
(the row's key, the token id) (`uniforms`): an exact draw from p that depends only on the key, whatever else is in
the batch and on whichever device. A row whose probabilities are not all finite or sum to nothing (every candidate
masked) draws nothing: its entry of `out` (the greedy token) stays.

`sample_race` takes either probabilities (after top-k / top-p / min-p: `batch_sampler.candidates`) or, with
`temperature`, a row's adjusted logits for plain temperature sampling: probabilities softmax(logits / temperature),
normalised once more as `candidates` does, then the same race. The kernel's logit mode (Gumbel-max, no softmax)
equals this but for ties within float rounding.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit avalanche hash (two multiply-xorshift rounds). Works on Python ints and on int64 tensors alike:
    every multiplier is below 2**31, so no product leaves int64."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1) shaped as `token_ids` [B, K] (or [1, K], broadcast over the B keys): U = hash(key_b, token
    id), the same on every device and whichever candidates a row keeps. 23 hash bits: (k + 0.5) / 2**23 is exact in
    float32 up to 1 - 2**-24, so U is never 1.0 (24 bits rounded the top value to 1.0, E = -log(U) to -0.0 on one
    side and +0.0 on the other, and that candidate's score to -inf in PyTorch and +inf in the kernel)."""
    h = mix32(keys[:, None] ^ ((token_ids.to(torch.int64) * 0x9E3779B1) & M32))
    h = mix32(h ^ (keys[:, None] >> 7))
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def race(vals: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None,
         temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(drawn token [R] int64, ok [R] bool) of the rows of `vals` [R, K]: probabilities, or adjusted logits with
    `temperature` ([R] or [R, 1]). `ids` [R, K]: column j's token id (None: token j). The first maximal score wins
    (torch.argmax)."""
    if temperature is not None:
        probs = torch.softmax(vals / temperature.reshape(-1, 1), dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    else:
        probs = vals
    cols = ids if ids is not None else torch.arange(vals.shape[-1], device=vals.device)[None]
    best = (probs / -torch.log(uniforms(keys, cols))).argmax(dim=-1)
    drawn = best if ids is None else ids.gather(1, best[:, None])[:, 0]
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)   # all -inf after masks: the argmax stands
    return drawn, ok


def sample_race(out: torch.Tensor, vals: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None, *,
                temperature: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                gather: bool = False) -> torch.Tensor:
    """Race each row and write its token into `out` where the row is ok (elsewhere `out` keeps what it holds); returns
    `out`. `rows` [R]: the entry of `out` each raced row writes (None: row r writes out[r]); with `gather`, `vals`,
    `keys` and `temperature` are whole-batch tensors and row r reads their row rows[r] (no `ids` then). Keys may be
    float64 holding the integers (`batch_sampler._Params.table`), temperatures float64 (rounded to float32 first,
    as the table's float32 columns are)."""
    if gather and rows is not None:
        vals, keys = vals[rows], keys[rows]
        temperature = temperature[rows] if temperature is not None else None
    temperature = temperature.to(torch.float32) if temperature is not None else None
    drawn, ok = race(vals, keys.to(torch.int64), ids, temperature)
    if rows is None:
        return torch.where(ok, drawn, out, out=out)
    out[rows] = torch.where(ok, drawn, out[rows])
    return out
