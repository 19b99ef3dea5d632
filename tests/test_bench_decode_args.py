"""bench/decode.py's --configs: a kernel list with commas is one entry unless ';' separates entries (h100-28 lost a
device call to "all,-pdl:1" split on its comma)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_configs_split_on_semicolons_and_keep_kernel_lists_whole():
    from decode import split_configs

    assert split_configs("none:0,all:0,all:1") == ["none:0", "all:0", "all:1"]       # the default's form
    assert split_configs("all,-pdl:1") == ["all,-pdl:1"]
    assert split_configs("all,-pdl:1;all:1") == ["all,-pdl:1", "all:1"]
    assert split_configs("all,-pdl:1;") == ["all,-pdl:1"]
    with pytest.raises(SystemExit, match="separate entries with ';'"):
        split_configs("all,-pdl:1,all:1")               # two entries, one holding a comma: ambiguous
