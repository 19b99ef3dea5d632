"""tools/build_corpus.py: a small real build (tiny caps, 64 KiB pieces) read back, rebuilt byte for byte, damaged; and
the fallback roff converter on a hand-written man page."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("build_corpus", ROOT / "tools" / "build_corpus.py")
bc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("build_corpus", bc)
_spec.loader.exec_module(bc)

PIECE = 64 * 1024
CAP_MB = 0.15
EVERY = 2       # tiny corpus: hold out half, so every kind surely has held-out documents


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    recipe = bc.build_corpus(out, {k: CAP_MB for k in bc.KINDS}, piece_bytes=PIECE, held_out_every=EVERY)
    return out, recipe


def test_pieces_respect_the_limit_and_match_the_recipe(built):
    out, recipe = built
    pieces = sorted(out.glob(bc.PIECE_PREFIX + "*"))
    assert [p.name for p in pieces] == [p["name"] for p in recipe["pieces"]]
    assert len(pieces) >= 2, "the test's caps should force several 64 KiB pieces"
    assert all(p.stat().st_size <= PIECE for p in pieces)
    assert all(p.stat().st_size == PIECE for p in pieces[:-1])
    assert sum(p.stat().st_size for p in pieces) == recipe["compressed_bytes"]
    assert recipe["container"]["piece_limit_bytes"] == PIECE
    for kind in bc.KINDS:
        k = recipe["kinds"][kind]
        assert 0 < k["bytes"] <= k["cap_bytes"] == round(CAP_MB * bc.MB)
        assert k["bytes"] == sum(s["bytes"] for s in k["sources"])


def test_reader_returns_every_kind_with_held_out_documents(built):
    out, recipe = built
    docs = list(bc.iter_documents(out))
    assert len(docs) == recipe["documents"]
    assert [d[0] for d in docs] == sorted((d[0] for d in docs), key=bc.KINDS.index)   # kinds in order
    for kind in bc.KINDS:
        mine = [d for d in docs if d[0] == kind]
        r = recipe["kinds"][kind]
        assert len(mine) == r["documents"] > 0
        assert [d[1] for d in mine] == sorted(d[1] for d in mine)
        assert all(d[2].strip() and d[2].endswith("\n") and "\x1e" not in d[2] for d in mine)
        assert sum(len(d[2].encode()) for d in mine) == r["bytes"]
        held = [d for d in mine if d[3]]
        assert held and len(held) < len(mine)
        assert len(held) == r["held_out_documents"]
        assert sum(len(d[2].encode()) for d in held) == r["held_out_bytes"]
        assert all(d[3] == bc.is_held_out(d[1], EVERY) for d in mine)
    # each kind draws from all its sources (code mixes Python and C headers)
    code_paths = [d[1] for d in docs if d[0] == "code"]
    assert any(p.endswith(".py") for p in code_paths) and any(p.endswith(".h") for p in code_paths)
    assert any("/man/de/" in d[1] for d in docs if d[0] == "german")


def test_rebuild_is_byte_identical_and_cli_prints_table(built, tmp_path, capsys):
    out, recipe = built
    again = tmp_path / "again"
    assert bc.main(["--out", str(again), "--max-mb-per-kind", str(CAP_MB), "--piece-mib", str(PIECE / 2**20),
                    "--held-out-every", str(EVERY)]) == 0
    printed = capsys.readouterr().out
    for kind in bc.KINDS:
        assert kind in printed
    assert "held-out MB" in printed
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_truncated_or_corrupt_piece_is_named(built, tmp_path):
    out, recipe = built
    name = recipe["pieces"][1]["name"]

    d = _copy(out, tmp_path / "missing")
    (d / name).unlink()
    with pytest.raises(bc.CorpusError, match=rf"{name}.*missing"):
        next(bc.iter_documents(d))

    d = _copy(out, tmp_path / "truncated")
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(bc.CorpusError, match=rf"{name}.*(corrupt|truncated)"):
        next(bc.iter_documents(d))

    d = _copy(out, tmp_path / "flipped")
    data = bytearray((d / name).read_bytes())
    data[100] ^= 0xFF
    (d / name).write_bytes(bytes(data))
    with pytest.raises(bc.CorpusError, match=rf"{name}.*sha256"):
        next(bc.iter_documents(d))

    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(bc.CorpusError, match="recipe is missing"):
        next(bc.iter_documents(d))


MAN_SNIPPET = r""".\" Comment line that must vanish
'\" another comment
.TH FROB 1 "2024-01-01" "frob 1.0" "User Commands"
.SH NAME
frob \- frobnicate the bits
.SH SYNOPSIS
.B frob
[\fB\-v\fR] [\fIFILE\fP]...
.SH DESCRIPTION
.B frob
reads
.I FILE
and prints \(lqfrobbed\(rq bits. \" trailing comment
.SS "Exit status"
.TP
.BR \-v ", " \-\-verbose
Be \fBvery\fP verbose\(em really.
.de XX
garbage inside a macro definition
..
.if n .ds Q "quoted
.PP
See also
.BR bar (1),
.IR baz (5)
and \*(lqthe \f(CWmanual\fP\*(rq.
.nf
  keep   this
spacing
.fi
\&.dotfile, \e backslash, \s-1small\s0, \[u00E4] and \N'65'.
"""

MAN_TEXT = """FROB(1)

NAME
frob - frobnicate the bits

SYNOPSIS
frob [-v] [FILE]...

DESCRIPTION
frob reads FILE and prints “frobbed” bits.

Exit status

-v, --verbose
Be very verbose— really.

See also bar(1), baz(5) and “the manual”.
  keep   this
spacing
.dotfile, \\ backslash, small, ä and A.
"""


def test_roff_converter_on_a_hand_written_page():
    assert bc.roff_to_text(MAN_SNIPPET) == MAN_TEXT


def test_roff_inline_escapes():
    assert bc.roff_inline(r"\fB\-\-all\fR") == "--all"
    assert bc.roff_inline(r"\f[B]x\f[]y\fPz") == "xyz"
    assert bc.roff_inline(r"a\(emb\[en]c\(aqd\(cq") == "a\u2014b\u2013c'd\u2019"
    assert bc.roff_inline(r"x\h'2n'y\s+2z\s0\&.") == "xyz."
    assert bc.roff_inline(r"text \" a comment") == "text "


@pytest.mark.skipif(bc.groff_version() is None, reason="groff is not installed")
def test_groff_converter_keeps_the_words():
    text = bc.groff_to_text(MAN_SNIPPET)
    assert text is not None
    for word in ("NAME", "frobnicate the bits", "“frobbed”", "--verbose", "keep   this", ".dotfile", "ä"):
        assert word in text, word
    assert "garbage" not in text and "Comment line" not in text


def test_parse_caps():
    assert bc.parse_caps(None) == bc.DEFAULT_CAPS_MB
    assert bc.parse_caps(["2"]) == {k: 2.0 for k in bc.KINDS}
    assert bc.parse_caps(["3", "code=1,docs=0.5"]) == {"code": 1.0, "prose": 3.0, "docs": 0.5, "german": 3.0}
    with pytest.raises(ValueError, match="unknown kind"):
        bc.parse_caps(["poetry=1"])
