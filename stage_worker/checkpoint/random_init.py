"""Seeded random weights, by parameter name: for `make-model` checkpoints and the `dummy` load format (whose PLE
tables, which the PLE service makes too, are `shared/ple_files.py`'s).

Values follow the families' own initialisation (zero-centred norms at 0, gated norms at 1, decay rates spread over
[1, 16]) with std 0.02 matrices, so a random model's activations stay finite through 48 layers.
"""

from __future__ import annotations

import hashlib

import torch


def _generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def random_param(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Each tensor depends only on (seed, name, device): any subset can be generated alone, in any order.

    On a GPU the values come from the GPU's generator (a 100 GB dummy model fills in seconds there); they differ
    from the CPU's, which only matters for comparing dummy models across devices."""
    gen = _generator(seed, name, device)
    leaf = name.rsplit(".", 2)
    kw = dict(device=device, dtype=torch.float32 if torch.device(device).type == "cpu" else dtype)
    if name.endswith("A_log"):
        t = torch.empty(shape, **kw).uniform_(1.0, 16.0, generator=gen).log_()
    elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        t = torch.ones(shape, **kw)
    elif name.endswith("norm.weight") or "layernorm" in name or name.endswith("hc_norm.weight") or \
            leaf[-2].startswith("norm_"):
        t = torch.randn(shape, generator=gen, **kw) * 0.02      # zero-centred norms: small perturbation of 1 + w
    elif name.endswith("conv1d.weight"):
        t = torch.randn(shape, generator=gen, **kw) * 0.2
    else:
        t = torch.randn(shape, generator=gen, **kw) * 0.02
    return t.to(dtype)


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int) -> None:
    from stage_worker.model.quant_linear import PackedLinear

    for name, p in model.named_parameters():
        p.copy_(random_param(name, tuple(p.shape), seed, p.dtype, p.device))
    for name, b in model.named_buffers():
        if name.endswith((".mlp.q13", ".mlp.q2", ".mlp.s13", ".mlp.s2")):     # INT4 experts kept packed
            b.copy_(random_packed_part(name, tuple(b.shape), seed, b.dtype, b.device))
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):        # dense layers kept packed (benchmarks: bench/decode.py --quant)
            words = m.weight_packed
            words.copy_(torch.randint(-(1 << 31), (1 << 31) - 1, tuple(words.shape), dtype=torch.int64,
                                      device=words.device,
                                      generator=_generator(seed, f"{name}.weight_packed", words.device)))
            m.weight_scale.fill_(0.02 * 12 ** 0.5 / (1 << m.bits))   # uniform values over 2^bits levels: std 0.02


def random_packed_part(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype,
                       device: torch.device | str) -> torch.Tensor:
    """A packed INT4 expert part (`SparseMoE.use_packed`; an expert table's slots get the same): words (`q13`,
    `q2`) are random, any word a valid value; scales (`s13`, `s2`) give std-0.02 weights over the 16 levels."""
    if name.endswith(("q13", "q2")):
        return torch.randint(-(1 << 31), (1 << 31) - 1, shape, generator=_generator(seed, name, device),
                             device=device, dtype=torch.int64).to(torch.int32)
    return torch.full(shape, 0.02 * 2 / 7.5, dtype=dtype, device=device)
