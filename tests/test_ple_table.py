"""shared.ple_table: shard expansion into one flat file, staleness check, read-only mmap."""

from __future__ import annotations

import json

import pytest
import torch

from shared.ple_table import (
    FlatTable,
    ensure_table,
    expand_table,
    open_table,
    shard_row_counts,
    sidecar_path,
    table_is_current,
)

ROWS, DIM, SHARDS = 64, 6, 4


def _shards(dtype: torch.dtype, rows: int = ROWS, shards: int = SHARDS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(rows, DIM, generator=g).to(dtype)
    return list(torch.chunk(full, shards, dim=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expand_open_roundtrip(tmp_path, dtype):
    shards = _shards(dtype)
    calls: list[int] = []

    def read_shard(k: int) -> torch.Tensor:
        calls.append(k)
        return shards[k]

    out = tmp_path / "ple_0.bin"
    assert not table_is_current(out, ROWS, DIM, dtype)
    assert expand_table(read_shard, SHARDS, out, rows=ROWS, dim=DIM, dtype=dtype, desc="test") == out
    assert calls == list(range(SHARDS))
    assert out.stat().st_size == ROWS * DIM * dtype.itemsize
    assert not (tmp_path / "ple_0.bin.tmp").exists()
    meta = json.loads(sidecar_path(out).read_text())
    assert (meta["rows"], meta["dim"], meta["dtype"]) == (ROWS, DIM, str(dtype).removeprefix("torch."))
    assert "version" in meta

    assert table_is_current(out, ROWS, DIM, dtype)
    assert not table_is_current(out, ROWS + 1, DIM, dtype)
    assert not table_is_current(out, ROWS, DIM + 1, dtype)
    assert not table_is_current(out, ROWS, DIM, torch.float16 if dtype == torch.bfloat16 else torch.float64)

    with open_table(out) as table:
        assert isinstance(table, FlatTable)
        assert (table.rows, table.dim, table.dtype) == (ROWS, DIM, dtype)
        assert table.tensor.shape == (ROWS, DIM) and table.tensor.dtype == dtype
        assert torch.equal(table.tensor, torch.cat(shards))
        idx = torch.tensor([[0, 63, 17], [16, 15, 0]])
        got = table.gather(idx)
        assert got.shape == (2, 3, DIM)
        assert torch.equal(got, torch.cat(shards)[idx])
        out_buf = torch.empty(6, DIM, dtype=dtype)
        assert torch.equal(table.gather(idx, out=out_buf), got)
        assert table.tensor.untyped_storage().data_ptr() == table.tensor.data_ptr()  # a view, not a copy
    assert table.tensor.numel() == 0  # closed


def test_sidecar_missing_or_mismatched(tmp_path):
    dtype = torch.bfloat16
    shards = _shards(dtype)
    out = tmp_path / "t.bin"
    expand_table(shards.__getitem__, SHARDS, out, rows=ROWS, dim=DIM, dtype=dtype)
    side = sidecar_path(out)
    good = side.read_text()

    side.unlink()
    assert not table_is_current(out, ROWS, DIM, dtype)
    with pytest.raises(FileNotFoundError):
        open_table(out)

    meta = json.loads(good)
    meta["rows"] = ROWS * 2
    side.write_text(json.dumps(meta))
    assert not table_is_current(out, ROWS, DIM, dtype)
    assert not table_is_current(out, ROWS * 2, DIM, dtype)  # sidecar agrees, file size does not
    with pytest.raises(ValueError):
        open_table(out)

    meta = json.loads(good)
    meta["version"] = 999
    side.write_text(json.dumps(meta))
    assert not table_is_current(out, ROWS, DIM, dtype)

    side.write_text("{not json")
    assert not table_is_current(out, ROWS, DIM, dtype)

    side.write_text(good)
    assert table_is_current(out, ROWS, DIM, dtype)
    with open(out, "ab") as f:  # truncated/extended data file
        f.write(b"\0")
    assert not table_is_current(out, ROWS, DIM, dtype)


def test_wrong_shard_names_it_and_leaves_nothing(tmp_path):
    dtype = torch.float32
    shards = _shards(dtype)
    out = tmp_path / "bad.bin"

    bad_shape = list(shards)
    bad_shape[2] = bad_shape[2][:-1]
    with pytest.raises(ValueError, match=r"shard 2"):
        expand_table(bad_shape.__getitem__, SHARDS, out, rows=ROWS, dim=DIM, dtype=dtype)
    assert not out.exists() and not sidecar_path(out).exists()
    assert not (tmp_path / "bad.bin.tmp").exists()
    assert not table_is_current(out, ROWS, DIM, dtype)

    bad_dtype = list(shards)
    bad_dtype[3] = bad_dtype[3].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"shard 3"):
        expand_table(bad_dtype.__getitem__, SHARDS, out, rows=ROWS, dim=DIM, dtype=dtype)

    bad_dim = list(shards)
    bad_dim[1] = torch.zeros(ROWS // SHARDS, DIM + 1)
    with pytest.raises(ValueError, match=r"shard 1"):
        expand_table(bad_dim.__getitem__, SHARDS, out, rows=ROWS, dim=DIM, dtype=dtype)


def test_reexpansion_replaces_and_ensure_reuses(tmp_path):
    out = tmp_path / "e.bin"
    first = _shards(torch.float32)
    reads: list[int] = []

    def reader(shards):
        def read(k: int) -> torch.Tensor:
            reads.append(k)
            return shards[k]

        return read

    t = ensure_table(reader(first), SHARDS, out, rows=ROWS, dim=DIM, dtype=torch.float32)
    assert torch.equal(t.tensor, torch.cat(first))
    t.close()
    assert reads == list(range(SHARDS))

    reads.clear()
    t = ensure_table(reader(first), SHARDS, out, rows=ROWS, dim=DIM, dtype=torch.float32)
    assert reads == []  # current: just reopened
    t.close()

    second = [s + 1 for s in first]
    expand_table(reader(second), SHARDS, out, rows=ROWS, dim=DIM, dtype=torch.float32)
    with open_table(out) as t:
        assert torch.equal(t.tensor, torch.cat(second))


def test_uneven_shards_follow_torch_chunk(tmp_path):
    rows = 10
    assert shard_row_counts(rows, 4) == [s.shape[0] for s in torch.chunk(torch.zeros(rows), 4)] == [3, 3, 3, 1]
    assert shard_row_counts(64, 4) == [16] * 4
    shards = _shards(torch.bfloat16, rows=rows, shards=4)
    out = tmp_path / "u.bin"
    expand_table(shards.__getitem__, 4, out, rows=rows, dim=DIM, dtype=torch.bfloat16)
    with open_table(out) as t:
        assert torch.equal(t.tensor, torch.cat(shards))


def test_dummy_ple_file_holds_the_procedural_rows(tiny_checkpoint, tmp_path):
    """`dummy_ple_file`: the dummy format's PLE table written to a file (written once, shared by the stage's loader
    and the PLE service) holds exactly the procedural rows, so both forms serve the same tokens; the service's
    copy is a mapped file its prefetcher can advise."""
    import shutil

    from ple_service.tables import open_tables
    from shared.model_config import load_config
    from shared.ple_files import ProceduralTable
    from shared.ple_table import FlatTable
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint, model_dir)
    cfg = load_config(model_dir)
    procedural = load_model(model_dir, LoadOptions(load_format="dummy", seed=5), cfg)
    from_file = load_model(model_dir, LoadOptions(load_format="dummy", seed=5, dummy_ple_file=True), cfg)
    key = next(k for k, m in procedural.layers.items() if getattr(m, "ple", None) is not None)
    proc, flat = procedural.layers[key].ple.table, from_file.layers[key].ple.table
    assert isinstance(proc, ProceduralTable) and isinstance(flat, FlatTable)
    files = sorted(model_dir.glob("ple_table.layer*.dummy-*.bin"))
    assert [f.name for f in files] == [flat.path.name]
    rows = torch.randint(0, proc.rows, (7, 5))
    assert torch.equal(proc.gather(rows), flat.gather(rows))
    assert torch.equal(proc.gather(torch.tensor([proc.rows - 1])), flat.gather(torch.tensor([proc.rows - 1])))

    written = files[0].stat().st_mtime_ns
    service = open_tables(model_dir, cfg, load_format="dummy", seed=5, dummy_file=True)
    table = service[int(key)]
    assert isinstance(table, FlatTable) and table.path == flat.path
    assert files[0].stat().st_mtime_ns == written          # opened, not written again
    assert torch.equal(table.gather(rows), proc.gather(rows))


def test_dummy_ple_file_past_the_procedural_period(tmp_path, monkeypatch):
    """Rows past the procedural block's period (where the file is written as copies of the block) and a table
    written in several shards hold the procedural values too."""
    from shared import ple_files
    from shared.ple_files import ProceduralTable, dummy_ple_table

    rows = ProceduralTable.PERIOD * 2 + 77
    monkeypatch.setattr(ple_files, "_FILE_SHARD_BYTES", 100_000)   # several shards, edges inside a period
    flat = dummy_ple_table(rows, 3, torch.float32, 2, 0, tmp_path)
    every = torch.arange(rows)
    assert torch.equal(flat.gather(every), ProceduralTable(rows, 3, torch.float32, 2).gather(every))
    flat.close()
