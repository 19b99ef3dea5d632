"""QSA block selection for decode in plain PyTorch: the oracle the Triton path is tested against.

Turns the indexer query of each sequence's new token into the list of K/V positions it may read: the top
`budget / ratio` complete compression blocks (ties: lower block index, as `stable_topk_mask`) plus the incomplete
tail. That list has at most `budget + ratio - 1` entries whatever the context length, which is what bounds the K/V
rows a decode step reads (001 §1).

Layout of the result [B, budget + ratio - 1] int32: entry `j < budget` is token `j % ratio` of the (j // ratio)-th
chosen block in ascending block order (not best first: attention does not depend on the order of the rows it reads,
and ascending order lets the Triton path emit blocks with a prefix count instead of a sort), entry `budget + t` is tail
position `complete * ratio + t`; -1 where there is nothing (the block slots past the min(complete, budget / ratio)
chosen blocks, tail positions past the context).
"""

from __future__ import annotations

import math

import torch


def pooled_rows(block_tables: torch.Tensor, num_blocks: int, block_size: int, ratio: int) -> torch.Tensor:
    """[B, num_blocks] row of `pooled_keys` holding compression block c: (K/V row of token c * ratio) // ratio."""
    start = torch.arange(num_blocks, device=block_tables.device) * ratio
    page = block_tables.long()[:, start // block_size]
    return page * (block_size // ratio) + (start % block_size) // ratio


def qsa_scores_ref(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, block_size: int, ratio: int) -> torch.Tensor:
    """[B, max_blocks * block_size // ratio] fp32: sum_h relu(q_h . K_c) / sqrt(d) per complete block, else -inf."""
    nc = block_tables.shape[1] * block_size // ratio
    complete = context_lens.long()[:, None] // ratio
    valid = torch.arange(nc, device=q_idx.device)[None, :] < complete
    rows = torch.where(valid, pooled_rows(block_tables, nc, block_size, ratio), 0)
    keys = pooled[rows].float()                                              # [B, nc, d]
    scores = torch.relu(torch.einsum("bhd,bcd->bch", q_idx.float(), keys)).sum(-1) / math.sqrt(q_idx.shape[-1])
    return scores.masked_fill(~valid, float("-inf"))


def expand_selection(blocks: torch.Tensor, context_lens: torch.Tensor, ratio: int, budget: int) -> torch.Tensor:
    """Chosen block ids [B, k] (ascending; ids >= complete are padding, so they come last) -> positions
    [B, budget + ratio - 1]."""
    B, k = blocks.shape
    ctx = context_lens.long()[:, None]
    complete = ctx // ratio
    offs = torch.arange(ratio, device=blocks.device)
    ok = blocks.long() < complete
    block_pos = torch.where(ok[:, :, None], blocks.long()[:, :, None] * ratio + offs, -1).reshape(B, k * ratio)
    block_pos = torch.nn.functional.pad(block_pos, (0, budget - k * ratio), value=-1)
    tail = complete * ratio + offs[None, : ratio - 1]
    tail = torch.where(tail < ctx, tail, -1)
    return torch.cat([block_pos, tail], dim=1).to(torch.int32)


def qsa_select_ref(q_idx: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, block_size: int, ratio: int, budget: int) -> torch.Tensor:
    """q_idx [B, n_idx, d_idx] of each sequence's last token; pooled [rows // ratio, d_idx], already holding the block
    the new token completed; context_lens [B] with the new token. Returns selected [B, budget + ratio - 1] int32."""
    scores = qsa_scores_ref(q_idx, pooled, block_tables, context_lens, block_size, ratio)
    k = min(budget // ratio, scores.shape[1])
    # Valid scores are >= 0 > -inf, so the stable order puts every complete block first, ties by lower index.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    chosen = torch.sort(order, dim=1).values             # ascending block order (padding ids >= complete last)
    return expand_selection(chosen, context_lens, ratio, budget)
