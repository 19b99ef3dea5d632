"""Seeded random weights, by parameter name: for `make-model` checkpoints and the `dummy` load format.

Values follow the families' own initialisation (zero-centred norms at 0, gated norms at 1, decay rates spread over
[1, 16]) with std 0.02 matrices, so a random model's activations stay finite through 48 layers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from shared.ple_table import FlatTable, ensure_table, shard_row_counts


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


class ProceduralTable:
    """A PLE table that computes its rows from their index: the `dummy` format's stand-in for a 95 GiB file.

    Row r holds the values of row r mod PERIOD, computed once per device (a few MB), and a gather is a real
    index_select from that block, on whichever device the row ids are. So the PLE service (host) and a stage's own
    fallback (GPU) read the same values, and a benchmark with dummy weights pays what a gather from a page-cached
    table costs; computing every gathered row's hash on the host cost the PLE service 2-5 ms a step at 16 streams
    of the full shape, four times the real gather, and made the served benchmark wait for rows."""

    PERIOD = 1 << 16

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, seed: int) -> None:
        self.rows, self.dim, self.dtype, self.seed = rows, dim, dtype, seed
        self.period = min(rows, self.PERIOD)
        self._blocks: dict[torch.device, torch.Tensor] = {}

    def _block(self, device: torch.device) -> torch.Tensor:
        block = self._blocks.get(device)
        if block is None:
            idx = torch.arange(self.period, device=device)[:, None] * self.dim \
                + torch.arange(self.dim, device=device)[None, :] + self.seed * 7919
            x = idx * -7046029254386353131          # 0x9E3779B97F4A7C15 as a signed int64: wrapping multiply
            x = x ^ (x >> 29)
            block = (((x & 0xFFFFFF).float() / float(1 << 24) - 0.5) * 0.04).to(self.dtype)
            self._blocks[device] = block
        return block

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # On the rows' device: no host round trip, so a decode step stays free of synchronisation.
        flat = rows.reshape(-1).long() % self.period
        block = self._block(rows.device)
        if out is not None:
            torch.index_select(block, 0, flat, out=out.view(-1, self.dim))
            return out.view(*rows.shape, self.dim)
        return block.index_select(0, flat).view(*rows.shape, self.dim)


# Rows per write when a procedural table is written out: ~256 MB of bf16 rows of 160 at a time.
_FILE_SHARD_BYTES = 256 << 20


def dummy_ple_table(rows: int, dim: int, dtype: torch.dtype, seed: int, layer: int,
                    file_dir: Path | None = None) -> ProceduralTable | FlatTable:
    """The `dummy` format's PLE table of one layer: procedural, or with `file_dir` (cluster key `dummy_ple_file`)
    the same rows written once to a flat file there and mapped as a checkpoint's expanded table is.

    Why a file: a procedural gather costs nothing, so a benchmark on it can't show what the PLE service exists for
    (issue 18): rows read from disk on a cold start, prefetch, page-cache behaviour. The file holds exactly the
    procedural values, so both forms serve the same tokens. The PLE service and the stage name the same file and
    `ensure_table`'s lock lets one of them write it."""
    table = ProceduralTable(rows, dim, dtype, seed)
    if file_dir is None:
        return table
    name = str(dtype).removeprefix("torch.")
    path = Path(file_dir) / f"ple_table.layer{layer}.dummy-seed{seed}-{rows}x{dim}.{name}.bin"
    shards = max(1, -(-rows * dim * dtype.itemsize // _FILE_SHARD_BYTES))
    starts = [0]
    for count in shard_row_counts(rows, shards):
        starts.append(starts[-1] + count)

    block = table._block(torch.device("cpu"))

    def read(k: int) -> torch.Tensor:      # rows repeat with the block's period: copies of it, not a gather
        parts, row = [], starts[k]
        while row < starts[k + 1]:
            first = row % table.period
            n = min(table.period - first, starts[k + 1] - row)
            parts.append(block[first:first + n])
            row += n
        return torch.cat(parts)

    return ensure_table(read, shards, path, rows=rows, dim=dim, dtype=dtype,
                        desc=f"writing the dummy PLE table of layer {layer}")
