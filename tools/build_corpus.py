"""Build the demo model's training corpus from text that ships with this machine's Debian and Python installation.

One command:  python tools/build_corpus.py [--out DIR] [--max-mb-per-kind MB | KIND=MB ...]   (default DIR: .corpus/,
git-ignored). The offline GPU machine receives DIR/corpus.json and DIR/corpus.xz.NNN and reads them with
`iter_documents(DIR)` (this module is stdlib-only, so it runs there as is).

Kinds, each built from a fixed list of sources (see SOURCES): `code` (Python stdlib source and C headers), `prose`
(license texts, Debian package READMEs/NEWS, changelogs), `docs` (English man pages rendered to plain text, Node.js
API docs, awscli reStructuredText), `german` (German man pages, German gettext catalogs, a few German text files).

Container (the raw stream, before compression): for every document a header line `\\x1e{kind}\\t{path}\\n`, then the
document's text (UTF-8, ends with "\\n", never contains \\x1e). Documents are ordered by kind (KINDS order), then by
path. The stream is compressed as one xz stream (lzma preset 9) and cut into pieces `corpus.xz.000`, `.001`, ... of
at most 16 MiB each. `corpus.json` is the recipe: sources, caps, counts, held-out rule, sha256 of the raw stream and
of every piece. No timestamps anywhere: the same machine rebuilds the same bytes.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

VERSION = "1"
KINDS = ("code", "prose", "docs", "german")
MB = 1_000_000
PIECE_BYTES = 16 * 1024 * 1024
HELD_OUT_EVERY = 50
RECIPE = "corpus.json"
PIECE_PREFIX = "corpus.xz."
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / ".corpus"
DEFAULT_CAPS_MB = {"code": 16.0, "prose": 8.0, "docs": 12.0, "german": 6.0}
MIN_DOC_BYTES = 64          # smaller texts (empty __init__.py, one-line READMEs) are skipped
MAX_MISFITS = 32            # a source stops after this many documents in a row that do not fit its remaining budget
SEP = "\x1e"


class CorpusError(Exception):
    """A corpus directory that cannot be read: missing recipe, missing or corrupt piece, bad stream."""


# ----------------------------------------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    name: str
    kind: str
    roots: tuple[tuple[str, str], ...]   # (directory, label prefix); a document's path is prefix + path under root
    include: tuple[str, ...]             # fnmatch globs on the path under the root ("*" also matches "/")
    loader: str                          # "text" (plain or .gz UTF-8), "man" (roff, plain or .gz), "mo" (gettext)
    share: float                         # share of the kind's cap; what a source leaves unused passes to the next
    exclude: tuple[str, ...] = ()        # fnmatch globs on the path under the root
    exclude_re: str = ""                 # regex searched in the file name (language-tagged files and the like)
    max_doc_bytes: int = 512 * 1024


def _stdlib() -> str:
    return sysconfig.get_paths()["stdlib"]


def _purelib() -> str:
    return sysconfig.get_paths()["purelib"]


_LANG_TAG = r"[._-](de|fr|es|it|ja|ko|ru|zh|zh_CN|zh_TW|pt|pt_BR|pl|nl|cs|sv|fi|hu|tr|uk|da|nb|ro|sk|sl|ca|el)([._-]|$)"


def default_sources() -> list[Source]:
    """The recipe. Order matters: within a kind, sources fill their budget in this order."""
    std, pure = _stdlib(), _purelib()
    return [
        # code: stdlib Python (no test suites, no site-packages) and C headers, half and half
        Source("stdlib-py", "code", ((std, "stdlib/"),), ("*.py",), "text", 0.5,
               exclude=("site-packages/*", "dist-packages/*", "*__pycache__*", "test/*", "*/test/*", "tests/*",
                        "*/tests/*", "*/idle_test/*", "_sysconfigdata_*"),
               max_doc_bytes=256 * 1024),
        Source("c-headers", "code", (("/usr/include", "usr/include/"),), ("*.h",), "text", 0.5,
               max_doc_bytes=256 * 1024),
        # prose: license texts, package READMEs / NEWS / notes, then changelogs
        Source("licenses", "prose", (("/usr/share/common-licenses", "usr/share/common-licenses/"),
                                     (os.path.join(std, "LICENSE.txt"), "stdlib/")),
               ("*",), "text", 0.1),
        Source("doc-notes", "prose", (("/usr/share/doc", "usr/share/doc/"),),
               ("*/README*", "*/NEWS*", "*/FAQ*", "*/TODO*", "*/THANKS*", "*/AUTHORS*", "*/BUGS*", "*/HISTORY*",
                "*/RELEASE*", "*/*.txt", "*/*.txt.gz", "*/*.md", "*/*.md.gz", "*/*.rst", "*/*.rst.gz"),
               "text", 0.6,
               exclude=("nodejs/*", "*/examples/*", "*/changelog*", "*/CHANGELOG*", "*/copyright", "*.html*",
                        "*/LICENSE*", "*/COPYING*"),
               exclude_re=_LANG_TAG),
        Source("changelogs", "prose", (("/usr/share/doc", "usr/share/doc/"),),
               ("*/changelog", "*/changelog.gz", "*/changelog.Debian.gz", "*/changelog.Debian.*.gz",
                "*/CHANGES", "*/CHANGES.gz", "*/CHANGES.txt", "*/CHANGES.txt.gz"),
               "text", 0.3, exclude=("nodejs/*",)),
        # docs: English man pages (gcloud's 16k generated pages kept to a small share), Node.js API docs, awscli rst
        Source("man-en", "docs", tuple((f"/usr/share/man/man{s}", f"usr/share/man/man{s}/") for s in "1578"),
               ("*",), "man", 0.65, exclude=("gcloud*",)),
        Source("man-gcloud", "docs", (("/usr/share/man/man1", "usr/share/man/man1/"),), ("gcloud*",), "man", 0.05),
        Source("nodejs-api", "docs", (("/usr/share/doc/nodejs/api", "usr/share/doc/nodejs/api/"),),
               ("*.md", "*.md.gz"), "text", 0.15),
        Source("awscli-rst", "docs", ((os.path.join(pure, "awscli"), "site-packages/awscli/"),), ("*.rst",),
               "text", 0.15),
        # german: German man pages, German gettext message catalogs (msgstr text), a few German text files
        Source("man-de", "german", (("/usr/share/man/de", "usr/share/man/de/"),), ("*",), "man", 0.45),
        Source("gettext-de", "german", (("/usr/share/locale/de/LC_MESSAGES", "usr/share/locale/de/LC_MESSAGES/"),),
               ("*.mo",), "mo", 0.5),
        Source("text-de", "german", (("/usr/share/vim/vim90/tutor", "usr/share/vim/vim90/tutor/"),
                                     ("/usr/share/gnupg", "usr/share/gnupg/"),
                                     ("/usr/lib/systemd/catalog", "usr/lib/systemd/catalog/")),
               ("tutor.de.utf-8", "help.de.txt", "*.de.catalog"), "text", 0.05),
    ]


def _match(source: Source, rel: str) -> bool:
    if not any(fnmatch.fnmatchcase(rel, g) for g in source.include):
        return False
    if any(fnmatch.fnmatchcase(rel, g) for g in source.exclude):
        return False
    if source.exclude_re and re.search(source.exclude_re, os.path.basename(rel)):
        return False
    return True


def list_candidates(source: Source) -> list[tuple[str, str]]:
    """(document path, file) for every regular file (not a symlink) a source matches, sorted by path. A root that is
    a file stands for itself (its path under the root is its name); directories whose every path is excluded
    (site-packages/, test/ ...) are not walked."""
    out = []
    for root, prefix in source.roots:
        if os.path.isfile(root) and not os.path.islink(root):
            found = [(os.path.dirname(root), [os.path.basename(root)])]
            top = os.path.dirname(root)
        elif os.path.isdir(root):
            top = root
            found = []
            for dirpath, dirnames, filenames in os.walk(root):
                reld = os.path.relpath(dirpath, root).replace(os.sep, "/")
                dirnames[:] = sorted(d for d in dirnames if not any(
                    fnmatch.fnmatchcase((d if reld == "." else f"{reld}/{d}") + "/", g) for g in source.exclude))
                found.append((dirpath, sorted(filenames)))
        else:
            continue
        for dirpath, names in found:
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, top).replace(os.sep, "/")
                label = prefix + rel
                if os.path.islink(full) or not os.path.isfile(full) or any(c in label for c in "\t\n\r" + SEP):
                    continue
                if _match(source, rel):
                    out.append((label, full))
    out.sort()
    return out


def selection_key(path: str) -> bytes:
    return hashlib.sha1(b"select:" + path.encode("utf-8")).digest()


def is_held_out(path: str, every: int = HELD_OUT_EVERY) -> bool:
    """The held-out rule: int(sha1(path as UTF-8).hexdigest(), 16) % every == 0 (same rule for every kind)."""
    return int(hashlib.sha1(path.encode("utf-8")).hexdigest(), 16) % every == 0


# ------------------------------------------------------------------------------------------------------------- text

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BLANKS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Newlines normalized, C0 controls except tab/newline dropped (so never \\x1e), trailing spaces stripped,
    runs of blank lines collapsed to one, no leading/trailing blank lines, ends with one newline ('' if empty)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _BLANKS.sub("\n\n", text).strip("\n")
    return text + "\n" if text.strip() else ""


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    return data


def load_text(path: str) -> str | None:
    """UTF-8 text of a plain or gzipped file; None for binary or undecodable files."""
    data = _read_bytes(path)
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_mo(path: str) -> str | None:
    """The translated strings (msgstr; plural forms one per line) of a gettext .mo catalog, in catalog order."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 28:
        return None
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if end is None:
        return None
    _, n, o_orig, o_trans = struct.unpack(end + "4I", data[4:20])
    charset = "utf-8"
    strings = []
    for i in range(n):
        olen, ooff = struct.unpack(end + "2I", data[o_orig + 8 * i: o_orig + 8 * i + 8])
        tlen, toff = struct.unpack(end + "2I", data[o_trans + 8 * i: o_trans + 8 * i + 8])
        msgid, msgstr = data[ooff:ooff + olen], data[toff:toff + tlen]
        if not msgid:   # the header entry: only its charset matters
            m = re.search(rb"charset=([A-Za-z0-9_.:-]+)", msgstr)
            if m:
                charset = m.group(1).decode("ascii")
            continue
        strings.append(msgstr)
    try:
        texts = [s.decode(charset) for s in strings]
    except (LookupError, UnicodeDecodeError):
        return None
    lines = [p for t in texts for p in t.split("\x00") if p.strip()]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------- roff

_GLYPHS = {
    "em": "\u2014", "en": "\u2013", "hy": "-", "mi": "-", "\\-": "-", "lq": "\u201c", "rq": "\u201d",
    "oq": "\u2018", "cq": "\u2019", "aq": "'", "dq": '"', "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae",
    "tm": "\u2122", "de": "\u00b0", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "ba": "|", "br": "|",
    "pl": "+", "eq": "=", "mu": "\u00d7", "di": "\u00f7", "+-": "\u00b1", ">=": "\u2265", "<=": "\u2264",
    "!=": "\u2260", "->": "\u2192", "<-": "\u2190", "<>": "\u2194", "ga": "`", "aa": "\u00b4", "ul": "_",
    "ru": "_", "bv": "|", "dg": "\u2020", "sc": "\u00a7", "ps": "\u00b6", "Fo": "\u00ab", "Fc": "\u00bb",
    "fo": "\u2039", "fc": "\u203a", "Eu": "\u20ac", "eu": "\u20ac", "ct": "\u00a2", "Po": "\u00a3",
    "lh": "\u261c", "rh": "\u261e", "at": "@", "sh": "#", "Do": "$", "ss": "\u00df", "ae": "\u00e6",
    "AE": "\u00c6", "o/": "\u00f8", "O/": "\u00d8", "12": "\u00bd", "14": "\u00bc", "34": "\u00be",
    ":a": "\u00e4", ":o": "\u00f6", ":u": "\u00fc", ":A": "\u00c4", ":O": "\u00d6", ":U": "\u00dc",
    "'e": "\u00e9", "`e": "\u00e8", "^e": "\u00ea", "'a": "\u00e1", "`a": "\u00e0", "^a": "\u00e2",
    ",c": "\u00e7", "~n": "\u00f1", "if": "\u221e", "*a": "\u03b1", "*b": "\u03b2", "*m": "\u03bc",
    "*p": "\u03c0", "*W": "\u03a9", "or": "|", "no": "\u00ac", "lB": "[", "rB": "]", "lC": "{", "rC": "}",
    "la": "\u27e8", "ra": "\u27e9", "OK": "\u2713", "sq": "\u25a1",
}
# predefined strings (\*x, \*(xx, \*[xx]) of man/mdoc and the pod2man preamble, as nroff renders them
_STRINGS = {"lq": "\u201c", "rq": "\u201d", "R": "\u00ae", "Tm": "\u2122", "aq": "'", "L\"": '"', "R\"": '"',
            "C`": '"', "C'": '"', "C+": "C++", "--": "-", "PI": "pi", "Aq": "'", "q": '"', "Lq": "\u201c",
            "Rq": "\u201d", "Ba": "|", "Le": "\u2264", "Ge": "\u2265", "Pi": "pi", "Ne": "\u2260"}
_SIMPLE_ESC = {"-": "-", "e": "\\", "E": "\\", "\\": "\\", "&": "", " ": " ", "~": " ", "0": " ", "|": "", "^": "",
               "%": "", ":": "", "/": "", ",": "", "'": "\u00b4", "`": "`", ".": ".", "t": "\t", "a": "",
               "d": "", "u": "", "r": "", "p": "", "z": "", "!": "", "{": "", "}": "", "c": ""}
_DELIMITED_ESC = set("hvwlLDoXAbBHRSZxNCTUOV?")


def _esc_name(s: str, i: int) -> tuple[str, int]:
    """Name after \\f, \\*, \\n ...: `(xx`, `[name]`, or one character; returns (name, next index)."""
    if i >= len(s):
        return "", i
    if s[i] == "(":
        return s[i + 1:i + 3], i + 3
    if s[i] == "[":
        j = s.find("]", i)
        return (s[i + 1:j], j + 1) if j >= 0 else (s[i + 1:], len(s))
    return s[i], i + 1


def _glyph(name: str) -> str:
    if name in _GLYPHS:
        return _GLYPHS[name]
    m = re.fullmatch(r"u([0-9A-Fa-f]{4,6})(?:_[0-9A-Fa-f_]+)?", name)
    if m:
        return chr(int(m.group(1), 16))
    return ""


def roff_inline(s: str) -> str:
    """Replace roff escapes in one line of text: fonts (\\fB \\fI \\fR \\fP \\f(xx \\f[x]) vanish, \\- is '-',
    \\(xx and \\[xx] are glyphs, \\*x strings, \\e a backslash, size/motion/register escapes vanish, \\" starts a
    comment."""
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= n:          # a trailing backslash joins lines: nothing to print
            break
        e = s[i + 1]
        i += 2
        if e in "\"#":          # comment to end of line
            break
        if e in "fF":
            _, i = _esc_name(s, i)
        elif e == "(":
            out.append(_glyph(s[i:i + 2]))
            i += 2
        elif e == "[":
            name, i = _esc_name(s, i - 1)
            out.append(_glyph(name))
        elif e == "*":
            name, i = _esc_name(s, i)
            out.append(_STRINGS.get(name, ""))
        elif e in "nmgkMY$":
            if e == "n" and i < n and s[i] in "+-":
                i += 1
            _, i = _esc_name(s, i)
        elif e == "s":          # \sN, \s+N, \s-N, \s(NN, \s[N], \s'N', \s10 .. \s39
            if i < n and s[i] in "+-":
                i += 1
            if i < n and s[i] in "([":
                _, i = _esc_name(s, i)
            elif i < n and s[i] == "'":
                j = s.find("'", i + 1)
                i = j + 1 if j >= 0 else n
            elif i < n and s[i].isdigit():
                i += 2 if s[i] in "123" and i + 1 < n and s[i + 1].isdigit() else 1
        elif e in _DELIMITED_ESC and i < n:
            d = s[i]
            j = s.find(d, i + 1)
            arg = s[i + 1:j] if j >= 0 else s[i + 1:]
            i = j + 1 if j >= 0 else n
            if e == "N" and arg.isdigit():
                out.append(chr(int(arg)))
            elif e == "C":
                out.append(_glyph(arg))
        elif e in _SIMPLE_ESC:
            out.append(_SIMPLE_ESC[e])
        else:
            out.append(e)
    return "".join(out)


def _split_args(rest: str) -> list[str]:
    """Macro arguments: blank-separated, double quotes group ("" inside quotes is a literal quote)."""
    args, i, n = [], 0, len(rest)
    while i < n:
        while i < n and rest[i] in " \t":
            i += 1
        if i >= n:
            break
        if rest.startswith('\\"', i):
            break
        if rest[i] == '"':
            i += 1
            buf = []
            while i < n:
                if rest[i] == '"':
                    if i + 1 < n and rest[i + 1] == '"':
                        buf.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                buf.append(rest[i])
                i += 1
            args.append("".join(buf))
        else:
            j = i
            while j < n and rest[j] not in " \t":
                j += 1
            args.append(rest[i:j])
            i = j
    return args


_FONT_MACROS = {"B", "I", "SM", "SB"}
_ALT_MACROS = {"BI", "BR", "IB", "IR", "RB", "RI"}
_PARA_MACROS = {"PP", "LP", "P", "sp", "Pp", "Lp", "HP", "ns", "bp", "Bl", "El", "Bd", "Ed"}
_HEADING_MACROS = {"SH", "Sh", "SS", "Ss"}
_BLOCK_MACROS = {"de", "de1", "dei", "am", "am1", "ami", "ig"}
_NOFILL_ON = {"nf", "EX", "Vb"}
_NOFILL_OFF = {"fi", "EE", "Ve"}
_MDOC_CALLABLE = re.compile(r"^(Ac|Ad|An|Ao|Ap|Aq|Ar|Bc|Bo|Bq|Brc|Bro|Brq|Bsx|Bx|Cm|Dc|Do|Dq|Dv|Ec|Em|Eo|Er|Ev|Fa|"
                            r"Fc|Fl|Fn|Fo|Fr|Ft|Ic|Li|Lk|Ms|Mt|Nm|No|Ns|Oc|Oo|Op|Pa|Pc|Pf|Po|Pq|Qc|Ql|Qo|Qq|Sc|So|"
                            r"Sq|St|Sx|Sy|Ta|Tn|Ux|Va|Vt|Xc|Xo|Xr)$")


def _mdoc_text(name: str, args: list[str]) -> str:
    """Rough plain text of an mdoc line: callable macro names dropped, .Fl arguments get their dash."""
    words: list[str] = []
    flag = name == "Fl"
    no_space = False
    for a in args:
        if _MDOC_CALLABLE.match(a):
            flag = a == "Fl"
            no_space = a == "Ns"
            if flag:
                words.append("-")
                no_space = True
            continue
        a = roff_inline(a)
        if words and (no_space or a in {",", ".", ";", ":", ")", "]"}):
            words[-1] += a
        else:
            words.append(a)
        no_space = False
        flag = False
    if name == "Fl":
        words = ["-" + words[0]] + words[1:] if words else ["-"]
    text = " ".join(words)
    if name == "Nd":
        text = "- " + text
    if name == "Xr" and len(args) >= 2:
        text = f"{roff_inline(args[0])}({args[1]})" + "".join(roff_inline(a) for a in args[2:])
    return text


def roff_to_text(src: str) -> str:
    """A careful regex/escape-based man page (man, some mdoc) to plain text converter, the fallback when groff is
    missing. Comments dropped; .TH becomes `NAME(SECTION)`; .SH/.SS become a heading line after a blank line;
    .B/.I/.SM keep their text, .BR/.IR/... join their arguments; paragraphs are filled (text lines joined with
    spaces) except between .nf/.fi and .EX/.EE; .TP/.IP tags get their own line; macro definitions (.de ...
    ..), .ig blocks and tbl format lines are dropped; every other request is dropped."""
    out: list[str] = []
    para: list[str] = []
    nofill = False
    block_end: str | None = None
    table = 0            # 0 outside .TS/.TE, 1 in the format section, 2 in the data rows
    tag_next = False     # after .TP: the next text line is a tag on a line of its own
    join_next = False    # the previous text ended with \c
    nm_name = ""         # mdoc: the name given by the first .Nm

    def flush():
        nonlocal para
        if para:
            out.append(" ".join(p for p in para if p))
            para = []

    def emit_text(text: str, raw: str):
        nonlocal tag_next, join_next
        cont = raw.rstrip().endswith("\\c")
        if nofill or table:
            if join_next and out:
                out[-1] += text
            else:
                out.append(text)
        elif tag_next:
            if join_next and out:
                out[-1] += text.strip()
            else:
                out.append(text.strip())
            tag_next = cont
        else:
            t = text.strip()
            if join_next and para:
                para[-1] += t
            elif t:
                para.append(t)
        join_next = cont

    for raw in src.replace("\r\n", "\n").split("\n"):
        if block_end is not None:
            if raw.strip() == block_end or raw.strip().startswith(block_end + " "):
                block_end = None
            continue
        if raw[:1] in (".", "'"):
            body = raw[1:].lstrip(" \t")
            m = re.match(r"(\S*)\s*(.*)", body)
            name, rest = m.group(1), m.group(2)
            if not name or name.startswith(('\\"', "\\#")):
                continue
            args = _split_args(rest)
            if name in _BLOCK_MACROS:   # .de NAME [END] ... ..   /   .ig [END] ... ..
                end_arg = args[0] if name == "ig" and args else args[1] if name != "ig" and len(args) > 1 else ""
                block_end = "." + end_arg if end_arg else ".."
                continue
            if name == "TS":
                flush()
                table = 1
                continue
            if name == "TE":
                table = 0
                continue
            if name == "T&":
                table = 1
                continue
            if name == "TH" or name == "Dt":
                flush()
                if args:
                    out.append(f"{roff_inline(args[0])}({args[1]})" if len(args) > 1 else roff_inline(args[0]))
                    out.append("")
                continue
            if name in _HEADING_MACROS:
                flush()
                out.append("")
                heading = roff_inline(" ".join(args)).strip()
                if heading:
                    out.append(heading)
                else:
                    tag_next = True
                continue
            if name in _PARA_MACROS:
                flush()
                out.append("")
                continue
            if name in ("TP", "TQ", "It"):
                flush()
                if name != "TQ":
                    out.append("")
                if name == "It" and args:
                    out.append(_mdoc_text("It", args))
                else:
                    tag_next = True
                continue
            if name == "IP":
                flush()
                out.append("")
                if args and roff_inline(args[0]).strip():
                    out.append(roff_inline(args[0]).strip())
                continue
            if name == "br":
                flush()
                continue
            if name in _NOFILL_ON:
                flush()
                nofill = True
                continue
            if name in _NOFILL_OFF:
                nofill = False
                continue
            if name in _FONT_MACROS:
                if args:
                    emit_text(roff_inline(" ".join(args)), raw)
                else:
                    pass  # applies to the next line, which is plain text to us
                continue
            if name in _ALT_MACROS:
                emit_text("".join(roff_inline(a) for a in args), raw)
                continue
            if name in ("UE", "ME") and args:
                if para:
                    para[-1] += roff_inline(args[0])
                continue
            if name in ("Nm", "Nd", "Fl", "Ar", "Op", "Xr", "Pa", "Cm", "Ic", "Ev", "Em", "Sy", "Dq", "Sq", "Ql",
                        "Li", "Va", "Fn", "Ft", "Fa", "Dv", "Er", "Ad", "Cd", "Aq", "Pq", "Ns", "No", "Tn", "Lk",
                        "Mt", "An", "Vt"):
                if name == "Nm":     # .Nm NAME sets the page's name; a bare .Nm prints it
                    if args and not _MDOC_CALLABLE.match(args[0]):
                        nm_name = nm_name or args[0]
                    elif nm_name:
                        args = [nm_name] + args
                t = _mdoc_text(name, args)
                if t:
                    emit_text(t, raw)
                continue
            continue        # every other request (.if .ie .ds .nr .so .in .RS .RE .UR .ft .ad .na ...) is dropped
        if table == 1:      # tbl options and format lines end with ";" and "." respectively
            if raw.rstrip().endswith("."):
                table = 2
            continue
        if table == 2:
            if raw.strip() in ("_", "=", "T{", "T}"):
                continue
            raw = raw.replace("T{", "").replace("T}", "")
            cells = [roff_inline(c).strip() for c in raw.split("\t")]
            emit_text("  ".join(c for c in cells if c), raw)
            continue
        text = roff_inline(raw)
        if not nofill and not raw.strip():
            flush()
            out.append("")
            continue
        emit_text(text, raw)
    flush()
    return clean_text("\n".join(out))


_GROFF: str | None | bool = False


def groff_version() -> str | None:
    """First line of `groff --version`, or None when groff is not installed."""
    global _GROFF
    if _GROFF is False:
        _GROFF = None
        if shutil.which("groff"):
            try:
                r = subprocess.run(["groff", "--version"], capture_output=True, text=True, timeout=30)
                _GROFF = r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout else None
            except (OSError, subprocess.SubprocessError):
                _GROFF = None
    return _GROFF


def _groff_input(src: str) -> str:
    """preconv's job (non-ASCII as \\[uXXXX]) plus left adjustment and no hyphenation (as `man --nj --nh`)."""
    src = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in src)
    return ".ad l\n.de ad\n..\n.nh\n.de hy\n..\n" + src


def groff_to_text(src: str) -> str | None:
    first = src.split("\n", 1)[0]
    pre = []
    m = re.match(r"^['.]\\\"\s+([a-z]+)\s*$", first)
    if m:
        pre = [f"-{c}" for c in m.group(1) if c in "tep"]
    if "-t" not in pre:
        pre.append("-t")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "GROFF_SGR": ""}
    try:
        r = subprocess.run(["groff", "-mandoc", "-Tutf8", "-P-cbou", "-rHY=0", *pre],
                           input=_groff_input(src).encode("ascii"), capture_output=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    try:
        return clean_text(r.stdout.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def load_man(path: str, converter: str) -> str | None:
    data = _read_bytes(path)
    if b"\x00" in data:
        return None
    try:
        src = data.decode("utf-8")
    except UnicodeDecodeError:
        src = data.decode("latin-1")
    body = [ln for ln in src.split("\n") if ln.strip() and not ln.startswith((".\\\"", "'\\\"", '.\\"'))]
    if body and body[0].startswith(".so ") and len(body) <= 2:   # a link page: the target is its own document
        return None
    if converter == "groff":
        text = groff_to_text(src)
        if text is not None:
            return text
    return roff_to_text(src)


# ------------------------------------------------------------------------------------------------------------ build

@dataclass
class Doc:
    kind: str
    path: str
    text: str
    source: str


@dataclass
class SourceStats:
    candidates: int = 0
    examined: int = 0
    documents: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    skipped: dict = field(default_factory=dict)


def _load(source: Source, full: str, converter: str) -> str | None:
    """A candidate's clean text, or None when it cannot be read (binary, undecodable, bad gzip, unreadable)."""
    try:
        if source.loader == "man":
            return load_man(full, converter)
        text = load_mo(full) if source.loader == "mo" else load_text(full)
    except (OSError, EOFError, ValueError, struct.error, zlib.error):
        return None
    return None if text is None else clean_text(text)


def _prefetch(fn: Callable, items: Iterable, pool: ThreadPoolExecutor, depth: int) -> Iterator:
    """(item, fn(item)) in the order of items, computing up to `depth` ahead on the pool."""
    it = iter(items)
    pending: deque = deque()
    try:
        for item in it:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= depth:
                break
        while pending:
            item, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(fn, nxt)))
            yield item, fut.result()
    finally:
        for _, fut in pending:
            fut.cancel()


def select_documents(caps: dict[str, int], sources: list[Source], converter: str, jobs: int,
                     log: Callable[[str], None] = lambda s: None) -> tuple[list[Doc], dict[str, SourceStats]]:
    """Per kind, sources fill their budget in recipe order: budget = share * kind cap + what earlier sources of
    the kind left unused (the last source of a kind gets all that is left). Within a source, candidates are taken
    in sha1("select:" + path) order (a fixed pseudo-random order, so a capped source samples all its directories);
    a document is taken if it is not a duplicate (same text as an earlier one), has >= MIN_DOC_BYTES and
    <= max_doc_bytes and fits the remaining budget; the source stops when its budget is spent or after
    MAX_MISFITS documents in a row that did not fit."""
    docs: list[Doc] = []
    stats: dict[str, SourceStats] = {}
    seen: set[bytes] = set()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for kind in KINDS:
            ks = [s for s in sources if s.kind == kind]
            cap = caps[kind]
            used = 0
            planned = 0
            for idx, src in enumerate(ks):
                st = stats[src.name] = SourceStats()
                planned += int(round(src.share * cap))
                budget = cap - used if idx == len(ks) - 1 else max(0, min(planned, cap) - used)
                st.budget_bytes = budget
                cands = list_candidates(src)
                st.candidates = len(cands)
                cands.sort(key=lambda c: selection_key(c[0]))
                misfits = 0
                t0 = time.perf_counter()

                def skip(reason: str):
                    st.skipped[reason] = st.skipped.get(reason, 0) + 1

                if budget > 0:
                    for (path, _full), text in _prefetch(lambda c, s=src: _load(s, c[1], converter), cands, pool,
                                                         4 * max(1, jobs)):
                        st.examined += 1
                        if text is None:
                            skip("unreadable")
                            continue
                        n = len(text.encode("utf-8"))
                        if n < MIN_DOC_BYTES:
                            skip("too_small")
                            continue
                        if n > src.max_doc_bytes:
                            skip("too_large")
                            continue
                        h = hashlib.sha1(text.encode("utf-8")).digest()
                        if h in seen:
                            skip("duplicate")
                            continue
                        if n > budget - st.bytes:
                            skip("over_budget")
                            misfits += 1
                            if misfits >= MAX_MISFITS:
                                break
                            continue
                        misfits = 0
                        seen.add(h)
                        docs.append(Doc(kind, path, text, src.name))
                        st.documents += 1
                        st.bytes += n
                        if budget - st.bytes < MIN_DOC_BYTES:
                            break
                used += st.bytes
                log(f"  {kind:7s} {src.name:12s} {st.documents:6d} docs {st.bytes / MB:8.2f} MB "
                    f"of {budget / MB:.2f} MB budget ({st.candidates} candidates, {time.perf_counter() - t0:.1f} s)")
    order = {k: i for i, k in enumerate(KINDS)}
    docs.sort(key=lambda d: (order[d.kind], d.path))
    return docs, stats


def encode_record(kind: str, path: str, text: str) -> bytes:
    return f"{SEP}{kind}\t{path}\n".encode("utf-8") + text.encode("utf-8")


class _PieceWriter:
    def __init__(self, out_dir: Path, piece_bytes: int):
        self.dir, self.limit = out_dir, piece_bytes
        self.pieces: list[dict] = []
        self._f = None
        self._h = None
        self._n = 0

    def _open(self):
        name = f"{PIECE_PREFIX}{len(self.pieces):03d}"
        self._f = open(self.dir / name, "wb")
        self._h = hashlib.sha256()
        self._n = 0
        self.pieces.append({"name": name})

    def _close(self):
        if self._f is not None:
            self._f.close()
            self.pieces[-1].update(bytes=self._n, sha256=self._h.hexdigest())
            self._f = None

    def write(self, data: bytes):
        while data:
            if self._f is None or self._n >= self.limit:
                self._close()
                self._open()
            take = data[:self.limit - self._n]
            self._f.write(take)
            self._h.update(take)
            self._n += len(take)
            data = data[len(take):]

    def close(self) -> list[dict]:
        self._close()
        return self.pieces


def parse_caps(values: list[str] | None) -> dict[str, float]:
    """--max-mb-per-kind values: `MB` (every kind) or `KIND=MB`, later ones win."""
    caps = dict(DEFAULT_CAPS_MB)
    for v in values or []:
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" in part:
                k, mb = part.split("=", 1)
                if k not in caps:
                    raise ValueError(f"unknown kind {k!r} in --max-mb-per-kind (kinds: {', '.join(KINDS)})")
                caps[k] = float(mb)
            else:
                caps = {k: float(part) for k in caps}
    return caps


def build_corpus(out_dir: str | os.PathLike, caps_mb: dict[str, float] | None = None, *,
                 piece_bytes: int = PIECE_BYTES, held_out_every: int = HELD_OUT_EVERY, roff: str = "auto",
                 jobs: int | None = None, preset: int = 9, sources: list[Source] | None = None,
                 log: Callable[[str], None] = lambda s: None) -> dict:
    """Select, convert, pack and write the corpus into out_dir; returns the recipe (also written as corpus.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    caps_mb = {**DEFAULT_CAPS_MB, **(caps_mb or {})}
    caps = {k: int(round(caps_mb[k] * MB)) for k in KINDS}
    sources = default_sources() if sources is None else sources
    if roff == "auto":
        roff = "groff" if groff_version() else "regex"
    if roff == "groff" and not groff_version():
        raise RuntimeError("--roff groff: groff is not installed")
    jobs = jobs or os.cpu_count() or 1

    docs, stats = select_documents(caps, sources, roff, jobs, log)

    for p in list(out.iterdir()):
        if p.name == RECIPE or (p.name.startswith(PIECE_PREFIX) and p.is_file()):
            p.unlink()
    writer = _PieceWriter(out, piece_bytes)
    comp = lzma.LZMACompressor(format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=preset)
    raw_hash = hashlib.sha256()
    raw_bytes = 0
    per_kind = {k: {"documents": 0, "bytes": 0, "held_out_documents": 0, "held_out_bytes": 0} for k in KINDS}
    for d in docs:
        rec = encode_record(d.kind, d.path, d.text)
        raw_hash.update(rec)
        raw_bytes += len(rec)
        writer.write(comp.compress(rec))
        n = len(d.text.encode("utf-8"))
        pk = per_kind[d.kind]
        pk["documents"] += 1
        pk["bytes"] += n
        if is_held_out(d.path, held_out_every):
            pk["held_out_documents"] += 1
            pk["held_out_bytes"] += n
    writer.write(comp.flush())
    pieces = writer.close()

    kinds = {}
    for k in KINDS:
        kinds[k] = {
            "cap_bytes": caps[k], **per_kind[k],
            "sources": [{
                "name": s.name, "loader": s.loader, "share": s.share,
                "roots": [{"dir": r, "path_prefix": p} for r, p in s.roots],
                "include": list(s.include), "exclude": list(s.exclude), "exclude_name_regex": s.exclude_re,
                "max_doc_bytes": s.max_doc_bytes, "budget_bytes": stats[s.name].budget_bytes,
                "candidates": stats[s.name].candidates, "examined": stats[s.name].examined,
                "documents": stats[s.name].documents, "bytes": stats[s.name].bytes,
                "skipped": dict(sorted(stats[s.name].skipped.items())),
            } for s in sources if s.kind == k],
        }
    recipe = {
        "format": "moepipe-corpus",
        "tool": "tools/build_corpus.py",
        "version": VERSION,
        "python": sys.version.split()[0],
        "roff_converter": f"groff ({groff_version()})" if roff == "groff" else "regex (roff_to_text)",
        "container": {
            "record": "\\x1e{kind}\\t{path}\\n then the document text (UTF-8, ends with \\n, no \\x1e inside)",
            "order": "kinds in the order of `kinds`, then documents by path",
            "compression": f"one xz stream (lzma preset {preset}, CRC64), cut into pieces",
            "piece_limit_bytes": piece_bytes,
        },
        "selection": {
            "cap_unit": "bytes of UTF-8 document text (headers not counted); MB = 1,000,000 bytes",
            "rule": " ".join((select_documents.__doc__ or "").split()),
            "min_doc_bytes": MIN_DOC_BYTES, "max_misfits": MAX_MISFITS,
        },
        "held_out": {"rule": f"int(sha1(path as UTF-8).hexdigest(), 16) % {held_out_every} == 0",
                     "every": held_out_every},
        "kinds": kinds,
        "documents": len(docs),
        "text_bytes": sum(per_kind[k]["bytes"] for k in KINDS),
        "raw_bytes": raw_bytes,
        "raw_sha256": raw_hash.hexdigest(),
        "compressed_bytes": sum(p["bytes"] for p in pieces),
        "pieces": pieces,
    }
    tmp = out / (RECIPE + ".tmp")
    tmp.write_text(json.dumps(recipe, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out / RECIPE)
    return recipe


# ----------------------------------------------------------------------------------------------------------- reader

def load_recipe(corpus_dir: str | os.PathLike) -> dict:
    path = Path(corpus_dir) / RECIPE
    if not path.is_file():
        raise CorpusError(f"{path}: corpus recipe is missing (build it with tools/build_corpus.py)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}: corpus recipe is not valid JSON: {e}") from e


def verify_pieces(corpus_dir: str | os.PathLike, recipe: dict | None = None) -> dict:
    """Check every piece named in the recipe exists with the recorded size and sha256; CorpusError names the
    first bad piece. Returns the recipe."""
    d = Path(corpus_dir)
    recipe = recipe or load_recipe(d)
    for p in recipe["pieces"]:
        f = d / p["name"]
        if not f.is_file():
            raise CorpusError(f"corpus piece {p['name']} is missing from {d} "
                              f"(expected {p['bytes']} bytes, {len(recipe['pieces'])} pieces in all)")
        size = f.stat().st_size
        if size != p["bytes"]:
            raise CorpusError(f"corpus piece {p['name']} in {d} is corrupt: {size} bytes, expected {p['bytes']}"
                              + (" (truncated)" if size < p["bytes"] else ""))
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != p["sha256"]:
            raise CorpusError(f"corpus piece {p['name']} in {d} is corrupt: sha256 {h.hexdigest()} does not match "
                              f"the recipe's {p['sha256']}")
    return recipe


def _raw_chunks(d: Path, recipe: dict) -> Iterator[bytes]:
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    for p in recipe["pieces"]:
        with open(d / p["name"], "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                if dec.eof:
                    raise CorpusError(f"corpus piece {p['name']}: data after the end of the xz stream")
                try:
                    out = dec.decompress(chunk)
                except lzma.LZMAError as e:
                    raise CorpusError(f"corpus piece {p['name']}: xz stream is corrupt: {e}") from e
                if out:
                    yield out
    if not dec.eof:
        raise CorpusError(f"corpus in {d}: the xz stream ends early (a piece is truncated or missing)")


def iter_documents(corpus_dir: str | os.PathLike, verify: bool = True) -> Iterator[tuple[str, str, str, bool]]:
    """(kind, path, text, held_out) for every document, in corpus order, decompressing as it goes. With verify,
    every piece's size and sha256 is checked before the first document (CorpusError names a missing or corrupt
    piece) and the raw stream's sha256 and document count are checked at the end."""
    d = Path(corpus_dir)
    recipe = verify_pieces(d) if verify else load_recipe(d)
    every = recipe["held_out"]["every"]
    raw_hash = hashlib.sha256()
    count = 0
    buf = b""

    def parse(rec: bytes):
        head, sep, body = rec.partition(b"\n")
        if not sep or b"\t" not in head:
            raise CorpusError(f"corpus in {d}: malformed record header {head[:80]!r}")
        kind, path = head.decode("utf-8").split("\t", 1)
        return kind, path, body.decode("utf-8"), is_held_out(path, every)

    for chunk in _raw_chunks(d, recipe):
        raw_hash.update(chunk)
        buf += chunk
        parts = buf.split(SEP.encode())
        buf = parts.pop()
        for rec in parts:
            if rec:         # the text before the first separator is empty
                count += 1
                yield parse(rec)
    if buf:
        count += 1
        yield parse(buf)
    if verify and raw_hash.hexdigest() != recipe["raw_sha256"]:
        raise CorpusError(f"corpus in {d}: raw stream sha256 {raw_hash.hexdigest()} does not match the recipe")
    if verify and count != recipe["documents"]:
        raise CorpusError(f"corpus in {d}: {count} documents, the recipe says {recipe['documents']}")


# -------------------------------------------------------------------------------------------------------------- cli

def _exclude_default_out():
    git = REPO_ROOT / ".git"
    if git.is_dir():
        excl = git / "info" / "exclude"
        excl.parent.mkdir(parents=True, exist_ok=True)
        lines = excl.read_text().splitlines() if excl.exists() else []
        if "/.corpus/" not in lines:
            with open(excl, "a") as f:
                if lines and not excl.read_text().endswith("\n"):
                    f.write("\n")
                f.write("/.corpus/\n")


def format_table(recipe: dict) -> str:
    rows = [f"{'kind':8s} {'documents':>9s} {'MB':>8s} {'held-out docs':>13s} {'held-out MB':>11s}"]
    for k in KINDS:
        r = recipe["kinds"][k]
        rows.append(f"{k:8s} {r['documents']:9d} {r['bytes'] / MB:8.2f} {r['held_out_documents']:13d} "
                    f"{r['held_out_bytes'] / MB:11.3f}")
    rows.append(f"{'total':8s} {recipe['documents']:9d} {recipe['text_bytes'] / MB:8.2f} "
                f"{sum(recipe['kinds'][k]['held_out_documents'] for k in KINDS):13d} "
                f"{sum(recipe['kinds'][k]['held_out_bytes'] for k in KINDS) / MB:11.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT}, git-ignored)")
    ap.add_argument("--max-mb-per-kind", action="append", metavar="MB|KIND=MB",
                    help="cap on document text per kind, MB = 10^6 bytes; `4` for every kind or `code=16,docs=12`; "
                         "repeatable (default " + ",".join(f"{k}={v:g}" for k, v in DEFAULT_CAPS_MB.items()) + ")")
    ap.add_argument("--piece-mib", type=float, default=PIECE_BYTES / 2**20, help="largest piece, MiB (default 16)")
    ap.add_argument("--held-out-every", type=int, default=HELD_OUT_EVERY,
                    help="hold out documents with sha1(path) %% N == 0 (default 50)")
    ap.add_argument("--roff", choices=("auto", "groff", "regex"), default="auto",
                    help="man page converter: groff when installed (auto), or the built-in regex converter")
    ap.add_argument("--jobs", type=int, default=None, help="threads converting documents (default: CPU count)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print per-source progress")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else DEFAULT_OUT
    if a.out is None:
        _exclude_default_out()
    t0 = time.perf_counter()
    recipe = build_corpus(out, parse_caps(a.max_mb_per_kind), piece_bytes=int(a.piece_mib * 2**20),
                          held_out_every=a.held_out_every, roff=a.roff, jobs=a.jobs,
                          log=(lambda s: print(s, file=sys.stderr, flush=True)) if a.verbose else (lambda s: None))
    dt = time.perf_counter() - t0
    print(format_table(recipe))
    print(f"raw {recipe['raw_bytes'] / MB:.2f} MB -> {recipe['compressed_bytes'] / MB:.2f} MB xz in "
          f"{len(recipe['pieces'])} piece(s); roff: {recipe['roff_converter']}; {dt:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
