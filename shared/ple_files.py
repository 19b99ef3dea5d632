"""A model's PLE tables, opened the same way by a PLE stage's loader and by the PLE service.

Both must map the very same file: the service gathers rows for the stage, and the stage gathers them itself when the
service is off. A second expansion would cost another 95 GiB of disk and split the page cache between two copies, so
finding a table's shards, checking them, naming the expansion and the `dummy` format's tables are written once, here;
`ensure_table`'s lock lets whichever process comes first expand the file while the other waits and maps it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from shared.checkpoint_files import CheckpointError, checkpoint_files, normalise, open_safetensors
from shared.model_config import Qwen4ExpConfig
from shared.ngram_hash import NgramHashSpec
from shared.ple_table import FlatTable, ensure_table, shard_row_counts

__all__ = ["ProceduralTable", "Shards", "dummy_layer_table", "dummy_ple_table", "find_ple_shards", "open_ple_table",
           "ple_shard"]

PLE_SHARD = re.compile(r"^model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.(?:shard_(\d+)\.)?weight$")

# One table's shards: shard number (-1: an unsharded table) -> (file, on-disk tensor name, shape).
Shards = dict[int, tuple[Path, str, tuple]]


def ple_shard(name: str) -> tuple[int, int] | None:
    """(layer, shard number; -1 unsharded) when the normalised `name` is a PLE table's weight, else None."""
    m = PLE_SHARD.match(name)
    return (int(m.group(1)), int(m.group(2) or -1)) if m else None


def find_ple_shards(model_dir: Path, layers: set[int]) -> dict[int, Shards]:
    """layer -> its shards, from the safetensors headers only (no tensor data is read): the PLE service's way to the
    tables without loading a stage (the loader collects the same while it streams)."""
    found: dict[int, Shards] = {}
    for path in checkpoint_files(model_dir):
        with open_safetensors(path) as f:
            for raw in f.keys():
                shard = ple_shard(normalise(raw))
                if shard and shard[0] in layers:
                    found.setdefault(shard[0], {})[shard[1]] = (path, raw, tuple(f.get_slice(raw).get_shape()))
    return found


def open_ple_table(cfg: Qwen4ExpConfig, layer: int, spec: NgramHashSpec, shards: Shards, model_dir: Path) -> FlatTable:
    """Layer `layer`'s table, expanded on first use into a flat file beside the checkpoint and mapped. Raises
    CheckpointError naming the tensor and file for missing, surplus or misshapen shards."""
    order = _shard_order(cfg, layer, shards, model_dir)
    _check_shapes(cfg, spec, order)

    def read(k: int) -> torch.Tensor:
        path, name, _ = order[k]
        with open_safetensors(path) as f:
            return f.get_tensor(name)

    with open_safetensors(order[0][0]) as f:
        dtype = f.get_slice(order[0][1]).get_dtype()
    dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[dtype]
    out = _expansion_path(model_dir, layer, order)
    try:
        return ensure_table(read, len(order), out, rows=spec.padded_rows, dim=cfg.ple_head_dim, dtype=dtype,
                            desc=f"expanding PLE table of layer {layer}")
    except ValueError as exc:
        raise CheckpointError(f"PLE table of layer {layer} in {model_dir}: {exc}") from exc


def _shard_order(cfg: Qwen4ExpConfig, layer: int, shards: Shards, model_dir: Path) -> list[tuple[Path, str, tuple]]:
    """The shards in row order, every one of `split_ngram_parts` present and none more (or the one unsharded
    tensor): a missing shard would silently shift every later row."""
    prefix = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding"
    if not shards:
        raise CheckpointError(f"missing tensor(s) in {model_dir}: {prefix}.shard_0.weight "
                              f"... (the PLE table of layer {layer})")
    if -1 in shards:
        return [shards[-1]]
    order = [shards.get(k) for k in range(cfg.split_ngram_parts)]
    if None in order:
        k = order.index(None)
        raise CheckpointError(f"missing tensor {prefix}.shard_{k}.weight in {model_dir} "
                              f"(split_ngram_parts={cfg.split_ngram_parts})")
    extra = sorted(k for k in shards if k >= cfg.split_ngram_parts)
    if extra:
        raise CheckpointError(f"unexpected tensor {prefix}.shard_{extra[0]}.weight in {shards[extra[0]][0]}: "
                              f"config.json says split_ngram_parts={cfg.split_ngram_parts}")
    return order


def _check_shapes(cfg: Qwen4ExpConfig, spec: NgramHashSpec, order: list[tuple[Path, str, tuple]]) -> None:
    """Each shard has the rows `torch.chunk` gives it: checked from the headers, before 95 GiB are expanded."""
    expected_rows = shard_row_counts(spec.padded_rows, len(order))
    for k, (path, name, shape) in enumerate(order):
        want = (expected_rows[k], cfg.ple_head_dim)
        if shape != want:
            raise CheckpointError(f"tensor {name!r} in {path} has shape {list(shape)}, expected {list(want)}")


def _expansion_path(out_dir: Path, layer: int, order: list[tuple[Path, str, tuple]]) -> Path:
    """Where the expansion lives, named by a fingerprint of its source shards, so a checkpoint rewritten in place is
    expanded again rather than served from a stale table; older expansions of the layer are deleted."""
    out = out_dir / f"ple_table.layer{layer}.{_fingerprint(order)}.bin"
    for stale in out_dir.glob(f"ple_table.layer{layer}.*.bin*"):
        if not stale.name.startswith(out.name):
            stale.unlink(missing_ok=True)
    return out


def _fingerprint(order: list[tuple[Path, str, tuple]]) -> str:
    h = hashlib.blake2b(digest_size=6)
    for path, name, shape in order:
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{name}:{shape};".encode())
    return h.hexdigest()


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


def dummy_layer_table(cfg: Qwen4ExpConfig, layer: int, spec: NgramHashSpec, dtype: torch.dtype | None, seed: int,
                      file_dir: Path | None = None) -> ProceduralTable | FlatTable:
    """The `dummy` format's table of `layer`, in the config's storage dtype (unless `dtype`) and seeded `seed + layer`:
    the loader and the PLE service both call this, so they gather the same values whatever the compute dtype."""
    return dummy_ple_table(spec.padded_rows, cfg.ple_head_dim, dtype or getattr(torch, cfg.dtype), seed + layer,
                           layer, file_dir)


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
