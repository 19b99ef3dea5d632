"""Where each on-disk tensor of a Hugging Face checkpoint goes in a `StageModel`.

The map is derived from the model itself (its parameter names and shapes), so the loader, the random-checkpoint
writer and the missing-tensor check can never disagree. On-disk names are `transformers`' (`model.layers.N....`;
released multimodal checkpoints add `model.language_model.`): experts per expert (`mlp.experts.E.gate_proj.weight`),
Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba`. Mapping those prefixes away (`normalise`,
`shared/checkpoint_files.py`) and the PLE table's `split_ngram_parts` shards (`shared/ple_files.py`) live in `shared`,
because the PLE service reads them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from shared.model_config import HybridMoeConfig, Qwen3NextConfig

Transform = Callable[[torch.Tensor], torch.Tensor]

PLE_BUFFER = re.compile(r"^model\.layers\.(\d+)\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|"
                        r"ngram_heads_offsets)$")
EXPERT = re.compile(r"^(.*\.mlp)\.(w13|w2)$")


@dataclass(frozen=True)
class Piece:
    """Part of local parameter `local` that one on-disk tensor fills."""

    local: str
    shape: tuple[int, ...]                    # shape of the on-disk tensor
    index: tuple = ()                          # where in the local parameter it lands
    transform: Transform | None = None         # on-disk tensor -> the values at `index`


def hf_name(local: str) -> str:
    if local.startswith(("lm_head.", "mtp.")):
        return local
    return "model." + local


def pieces_for(cfg: HybridMoeConfig, params: dict[str, torch.Size | tuple]) -> dict[str, list[Piece]]:
    """On-disk name -> the pieces it fills, for every local parameter in `params` (name -> shape)."""
    out: dict[str, list[Piece]] = {}

    def add(name: str, piece: Piece) -> None:
        out.setdefault(name, []).append(piece)

    for local, shape in params.items():
        shape = tuple(shape)
        if local == "mtp.embed_tokens.weight":
            add("model.embed_tokens.weight", Piece(local, shape))      # the MTP head's copy of the embedding
            continue
        if local == "lm_head.weight" and cfg.tie_word_embeddings:
            add("model.embed_tokens.weight", Piece(local, shape))
            continue
        m = EXPERT.match(local)
        if m:
            prefix, kind = m.groups()
            E = shape[0]
            for e in range(E):
                base = f"{hf_name(prefix)}.experts.{e}"
                if kind == "w13":
                    inter = shape[1] // 2
                    add(f"{base}.gate_proj.weight", Piece(local, (inter, shape[2]), (e, slice(0, inter))))
                    add(f"{base}.up_proj.weight", Piece(local, (inter, shape[2]), (e, slice(inter, 2 * inter))))
                else:
                    add(f"{base}.down_proj.weight", Piece(local, shape[1:], (e,)))
            # Some exports keep experts fused, as transformers holds them in memory.
            fused = "gate_up_proj" if kind == "w13" else "down_proj"
            add(f"{hf_name(prefix)}.experts.{fused}", Piece(local, shape))
            continue
        if isinstance(cfg, Qwen3NextConfig) and ".linear_attn.in_proj_" in local:
            _add_grouped(cfg, local, add)
            continue
        add(hf_name(local), Piece(local, shape))
    return out


def _add_grouped(cfg: Qwen3NextConfig, local: str, add) -> None:
    """Qwen3-Next stores, per key head g: [q_g, k_g, v_g (r heads), z_g (r heads)] and [b_g (r), a_g (r)].

    Permuting those rows into [q; k; v], [z], [b], [a] changes no dot product, so one forward serves both layouts.
    """
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    H = cfg.hidden_size
    base = hf_name(local.rsplit(".in_proj_", 1)[0])
    part = local.rsplit(".in_proj_", 1)[1].split(".")[0]
    if part in ("qkv", "z"):
        src = f"{base}.in_proj_qkvz.weight"
        src_shape = (nk * (2 * dk + 2 * r * dv), H)

        def take(w: torch.Tensor, part: str = part) -> torch.Tensor:
            q, k, v, z = w.view(nk, 2 * dk + 2 * r * dv, H).split([dk, dk, r * dv, r * dv], dim=1)
            if part == "z":
                return z.reshape(-1, H)
            return torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
    else:
        src = f"{base}.in_proj_ba.weight"
        src_shape = (nk * 2 * r, H)

        def take(w: torch.Tensor, part: str = part) -> torch.Tensor:
            b, a = w.view(nk, 2 * r, H).split([r, r], dim=1)
            return (b if part == "b" else a).reshape(-1, H)
    add(src, Piece(local, src_shape, (), take))

