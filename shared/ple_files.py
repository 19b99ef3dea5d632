"""A model's PLE tables, opened the same way by a PLE stage's loader and by the PLE service.

Both must map the very same file: the service gathers rows for the stage, and the stage gathers them itself when the
service is off. A second expansion would cost another 95 GiB of disk and split the page cache between two copies, so
finding a table's shards, checking them, naming the expansion and the `dummy` format's tables are written once, here;
`ensure_table`'s lock lets whichever process comes first expand the file while the other waits and maps it.

The expansion goes beside the checkpoint, unless that directory is not writable (a read-only volume, a model
directory of another user) and holds no current expansion: then under `MOEPIPE_HOME/ple_tables/` (`table_dir`),
which both processes derive alike from the model's path. A table that cannot be written anywhere is a
CheckpointError naming the directory, the size and what to do, not a PermissionError traceback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shared.checkpoint_files import CheckpointError, checkpoint_files, normalise, open_safetensors
from shared.model_config import Qwen4ExpConfig
from shared.ngram_hash import NgramHashSpec
from shared.ple_table import FlatTable, ensure_table, shard_row_counts, table_is_current, uint_view

__all__ = ["ProceduralTable", "Shards", "dummy_layer_table", "dummy_ple_table", "find_ple_shards", "open_ple_table",
           "ple_shard", "table_dir"]

log = logging.getLogger(__name__)

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
    rows, dim = spec.padded_rows, cfg.ple_head_dim
    name = _expansion_name(layer, order)
    out_dir = table_dir(model_dir, name, lambda p: table_is_current(p, rows, dim, dtype), layer)
    out = _expansion_path(out_dir, layer, name)
    try:
        return ensure_table(read, len(order), out, rows=rows, dim=dim, dtype=dtype,
                            desc=f"expanding PLE table of layer {layer}")
    except ValueError as exc:
        raise CheckpointError(f"PLE table of layer {layer} in {model_dir}: {exc}") from exc
    except OSError as exc:
        raise _unwritable(exc, layer, rows * dim * dtype.itemsize, out_dir, Path(model_dir)) from None


def table_dir(model_dir: str | Path, name: str, is_current: Callable[[Path], bool], layer: int) -> Path:
    """The directory of the table file `name`: the checkpoint's if a current copy is there or it is writable, else
    `MOEPIPE_HOME/ple_tables/<checkpoint dir name>-<hash of its path>` (the stage and the PLE service choose alike)."""
    model_dir = Path(model_dir)
    if is_current(model_dir / name) or os.access(model_dir, os.W_OK):
        return model_dir
    from shared.cli import moepipe_home

    key = hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=6).hexdigest()
    fallback = moepipe_home() / "ple_tables" / f"{model_dir.name}-{key}"
    if not is_current(fallback / name):
        log.warning("%s is not writable: the PLE table of layer %d is expanded under %s instead", model_dir, layer,
                    fallback)
    return fallback


def _unwritable(exc: OSError, layer: int, nbytes: int, out_dir: Path, model_dir: Path) -> CheckpointError:
    """A table that could not be written (no permission, a read-only or full filesystem): one line with the way out."""
    what = f"cannot write the expanded PLE table of layer {layer} ({nbytes / 2**20:.1f} MiB) to {out_dir}"
    detail = f"{exc.strerror} ({exc.filename})" if exc.strerror else str(exc)
    if out_dir == model_dir:
        return CheckpointError(f"{what}: {detail}; free that much room there")
    from shared.cli import moepipe_home_in_words

    home = moepipe_home_in_words()
    return CheckpointError(f"{what}: {detail}; the checkpoint directory {model_dir} is not writable, so the table "
                           f"goes under {home}: set MOEPIPE_HOME to a writable directory with that much room, or make "
                           f"{model_dir} writable")


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


def _expansion_name(layer: int, order: list[tuple[Path, str, tuple]]) -> str:
    """The expansion's file name, with a fingerprint of its source shards, so a checkpoint rewritten in place is
    expanded again rather than served from a stale table."""
    return f"ple_table.layer{layer}.{_fingerprint(order)}.bin"


def _expansion_path(out_dir: Path, layer: int, name: str) -> Path:
    """`out_dir / name`; older expansions of the layer there are deleted (where the directory lets us)."""
    out = out_dir / name
    for stale in out_dir.glob(f"ple_table.layer{layer}.*.bin*"):
        if not stale.name.startswith(out.name):
            try:
                stale.unlink(missing_ok=True)
            except OSError:
                pass
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
        self._host: np.ndarray | None = None        # the CPU block as numpy's uint of its width (`gather_into`)

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

    def gather_into(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`FlatTable.gather_into`'s form: rows (int64 array) -> (*rows.shape, dim) as the unsigned int of the
        dtype's width, from the CPU block, into `out` when given. The block is built on the first call (1.3 s on the
        2-core VM: call it once before serving, as `DecodeRowGather` does)."""
        if self._host is None:
            self._host = uint_view(self._block(torch.device("cpu")))
        return np.take(self._host, rows % self.period, axis=0, out=out)

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
    name = f"ple_table.layer{layer}.dummy-seed{seed}-{rows}x{dim}.{str(dtype).removeprefix('torch.')}.bin"
    out_dir = table_dir(file_dir, name, lambda p: table_is_current(p, rows, dim, dtype), layer)
    path = out_dir / name
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

    try:
        return ensure_table(read, shards, path, rows=rows, dim=dim, dtype=dtype,
                            desc=f"writing the dummy PLE table of layer {layer}")
    except OSError as exc:
        raise _unwritable(exc, layer, rows * dim * dtype.itemsize, out_dir, Path(file_dir)) from None
