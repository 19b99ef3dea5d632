"""transformers' Qwen3NextForCausalLM on moepipe's weights, for `bench/decode.py`'s comparison.

The expert tensors are shared, not copied (transformers keeps experts fused as [E, 2I, H] and [E, H, I], as we do),
so both models fit the card together; the grouped `in_proj_qkvz` / `in_proj_ba` are rebuilt from our split layout
(the inverse of the loader's permutation), which costs a few hundred MB at full size.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from shared.model_config import Qwen3NextConfig
from stage_worker.model.model import StageModel


def hf_config(cfg: Qwen3NextConfig):
    from transformers import Qwen3NextConfig as HFConfig

    d = cfg.to_dict()
    for key in ("model_type", "architectures", "dtype", "mtp_num_hidden_layers"):
        d.pop(key, None)
    return HFConfig(**d)


def _grouped(cfg: Qwen3NextConfig, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Our in_proj_qkv / z / b / a -> transformers' grouped in_proj_qkvz and in_proj_ba."""
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    H = cfg.hidden_size
    la = layer.linear_attn
    q, k, v = la.in_proj_qkv.weight.split([nk * dk, nk * dk, nk * r * dv])
    z = la.in_proj_z.weight
    qkvz = torch.cat([q.view(nk, dk, H), k.view(nk, dk, H), v.view(nk, r * dv, H), z.view(nk, r * dv, H)], dim=1)
    ba = torch.cat([la.in_proj_b.weight.view(nk, r, H), la.in_proj_a.weight.view(nk, r, H)], dim=1)
    return qkvz.reshape(-1, H), ba.reshape(-1, H)


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    owner._parameters[name.rsplit(".", 1)[-1]] = nn.Parameter(tensor, requires_grad=False)


def hf_model_from_ours(model: StageModel):
    """A transformers Qwen3NextForCausalLM computing with `model`'s weights (whole model: embedding to head)."""
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    cfg = model.cfg
    if not isinstance(cfg, Qwen3NextConfig) or not (model.has_embedding and model.has_head):
        raise ValueError("the transformers reference needs a whole Qwen3-Next model")
    hc = hf_config(cfg)
    hc._attn_implementation = "sdpa"
    device = next(model.parameters()).device
    with torch.device("meta"):
        hf = Qwen3NextForCausalLM(hc)
    ours = dict(model.named_parameters())
    for name, _ in list(hf.named_parameters()):
        local = name[len("model."):] if name.startswith("model.") else name
        if local.endswith("mlp.experts.gate_up_proj"):
            tensor = ours[local.replace("experts.gate_up_proj", "w13")]
        elif local.endswith("mlp.experts.down_proj"):
            tensor = ours[local.replace("experts.down_proj", "w2")]
        elif ".linear_attn.in_proj_qkvz" in local or ".linear_attn.in_proj_ba" in local:
            layer = model.layers[local.split(".")[1]]
            qkvz, ba = _grouped(cfg, layer)
            tensor = qkvz if "qkvz" in local else ba
        else:
            tensor = ours[local]
        _assign(hf, name, tensor)
    with torch.device(device):
        hf.model.rotary_emb = Qwen3NextRotaryEmbedding(config=hc)
    for name, buf in list(hf.named_buffers()):        # any other buffer left on meta is rebuilt on the device
        if buf.is_meta:
            raise RuntimeError(f"transformers buffer {name} was not materialised")
    return hf.eval()


@torch.inference_mode()
def time_decode(hf, prompts: list[list[int]], steps: int, warmup: int) -> float:
    """Median seconds of one batched decode step through transformers' own cache."""
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    out = hf(input_ids=ids, use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf(input_ids=tok, cache=cache, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
    times.sort()
    return times[len(times) // 2]
