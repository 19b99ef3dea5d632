"""The `moepipe` command: a dispatcher. Each subcommand's work lives in a service package, which has its own
command module (`stage_worker/cli.py`: make-model, quantize, generate, route-stats, cold-set; `gateway/cli.py`:
serve, keys); `moepipe <subcommand> ...` runs `python -m <that module> <subcommand> ...` as a process, the same
boundary the launcher uses for stage workers, so shared/ imports no service (imports run gateway -> shared and
stage_worker -> shared, never back). The table below is static, so `moepipe --help` lists the subcommands without
importing anything. Also here, for every package: the built-in model (`ensure_builtin_model`) and the parser and
error handling the service command modules share (`command_parser`, `run_command`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


BUNDLED_MODEL = Path(__file__).resolve().parent / "demo_model"    # the trained demo checkpoint (issue 6)


def _bundled_files() -> list[Path]:
    """The demo checkpoint's own files: not an expanded PLE table that loading the package directory in place wrote
    beside them (derived data, git-ignored), which would change the copy's name and be copied along."""
    return sorted(p for p in BUNDLED_MODEL.iterdir() if p.is_file() and not p.name.startswith("ple_table."))


def moepipe_home() -> Path:
    """moepipe's own directory (MOEPIPE_HOME, default ~/.cache/moepipe): the built-in model's copy, chat templates
    given inline, PLE tables of read-only checkpoints."""
    return Path(os.environ.get("MOEPIPE_HOME", Path.home() / ".cache" / "moepipe"))


def moepipe_home_in_words() -> str:
    """`moepipe_home()` as an error message names it: the variable's value, or the default and that it is unset."""
    return f"MOEPIPE_HOME={os.environ['MOEPIPE_HOME']}" if "MOEPIPE_HOME" in os.environ else \
        f"{moepipe_home()} (MOEPIPE_HOME unset)"


def builtin_model_dir() -> Path:
    """Where the built-in model is served from: a copy of the bundled demo checkpoint under MOEPIPE_HOME, named
    by the hash of every bundled file (a changed config or tokenizer, not only new weights, must not reuse an old
    copy). A copy because loading writes the expanded PLE table beside the checkpoint, and the installed package
    may be read-only (or a git checkout that should stay clean)."""
    base = moepipe_home()
    if not (BUNDLED_MODEL / "model.safetensors").is_file():
        return base / "models" / "tiny"
    import hashlib

    digest = hashlib.sha256()
    for f in _bundled_files():
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode() + f.read_bytes())
    return base / "models" / f"demo-{digest.hexdigest()[:12]}"


def ensure_builtin_model() -> Path:
    """The built-in model's directory, copied there first if it is not yet; a MOEPIPE_HOME that cannot hold it
    (a file, no permission) is a ValueError naming it."""
    try:
        return _ensure_builtin_model()
    except OSError as exc:
        raise ValueError(f"cannot write the built-in model under {moepipe_home_in_words()}: "
                         f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}; set MOEPIPE_HOME to a "
                         f"writable directory or pass a model") from None


def model_arg(value: str | None, flag: str = "--model") -> Path:
    """A command's model directory: the built-in model when none was given; an empty path, or one that does not
    exist (a Hugging Face id such as Qwen/Qwen3-Next-80B-A3B-Instruct: moepipe does not download), is a ValueError
    naming it."""
    if value is None:
        return ensure_builtin_model()
    if not value.strip():
        raise ValueError(f"{flag}: empty model path (leave it out for the built-in model)")
    path = Path(value)
    if not path.exists():
        if value.startswith(("/", ".", "~")) or value.count("/") != 1:      # a path, not a Hub id (owner/name)
            raise ValueError(f"{value}: no such directory")
        raise ValueError(f"{value}: no such directory; moepipe serves local checkpoint directories only (it does not "
                         f"download models): download it first (e.g. `huggingface-cli download {value} --local-dir "
                         f"DIR`) and pass DIR")
    if not path.is_dir():
        raise ValueError(f"{value}: not a directory; a model is a checkpoint directory (config.json, *.safetensors, "
                         f"tokenizer.json)")
    return path


def _ensure_builtin_model() -> Path:
    path = builtin_model_dir()
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if (BUNDLED_MODEL / "model.safetensors").is_file():
        import shutil
        import tempfile

        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".copy-"))
        for f in _bundled_files():
            shutil.copyfile(f, tmp / f.name)
        try:
            tmp.rename(path)              # atomic: a concurrent first start sees a whole checkpoint or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / "model.safetensors").is_file():
                raise
        return path
    cmd = [sys.executable, "-m", "stage_worker.cli", "make-model", "--preset", "tiny", "--seed", "0",
           "--out", str(path)]
    print(f"moepipe: no bundled demo model ({BUNDLED_MODEL}); writing the random-weight tiny model to {path} (once)",
          file=sys.stderr)
    code = subprocess.call(cmd, stdout=subprocess.DEVNULL)     # it prints the path: not into the caller's output
    if code != 0:
        raise RuntimeError(f"moepipe: {' '.join(cmd)} failed (exit {code})")
    return path


# subcommand -> (the module that runs it, its one-line help); the order is `moepipe --help`'s
COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("stage_worker.cli", "write a random-weight Qwen4-Exp checkpoint"),
    "quantize": ("stage_worker.cli", "write a quantized copy of a checkpoint (compressed-tensors INT4/6/8, "
                                     "NVFP4/MXFP4 or block FP8), with the compressed-tensors library"),
    "generate": ("stage_worker.cli", "generate from a prompt in this process"),
    "serve": ("gateway.cli", "start the whole cluster and serve the OpenAI API"),
    "route-stats": ("stage_worker.cli", "count each MoE layer's expert selections over sample text of several "
                                        "kinds (the input of cold-set)"),
    "cold-set": ("stage_worker.cli", "choose the experts each stage keeps in host RAM from routing counts "
                                     "(tools/route_trace.py's route_usage.json)"),
    "keys": ("gateway.cli", "write the CurveZMQ certificate that authenticates and encrypts the cluster's links "
                            "between hosts (cluster config: link_keys)"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with no abbreviations: not of long options (`--max-model 100` is not --max-model-len) and, unlike
    `allow_abbrev=False` alone, not of multi-letter single-dash ones either (`-p 2` is not -pp, `-t 8` not -tp).
    One-letter options keep their attached values (`-x3`). Subparsers are of this class too (argparse makes them
    of their parent's)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _get_option_tuples(self, option_string: str):
        found = super()._get_option_tuples(option_string)
        return found if self.allow_abbrev else [t for t in found if len(t[1]) == 2]


def command_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `moepipe` parser and its subcommand group, for a service's command module to add its subcommands to."""
    p = ArgumentParser(prog="moepipe", description="Serve huge hybrid MoE models on small GPUs.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser

    def add_subcommand(name: str, **kwargs) -> argparse.ArgumentParser:
        """Each subcommand takes -v too, after its name (`moepipe serve MODEL -v`, as vLLM users type it and as
        serve's --help suggests): it sets the same `verbose` (SUPPRESS: left out, `moepipe -v serve` still counts)."""
        parser = add_parser(name, **kwargs)
        if kwargs.get("add_help", True):    # (the dispatcher's stand-ins parse no flags)
            parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                help="log at INFO level (as `moepipe -v %s`)" % name)
        return parser

    sub.add_parser = add_subcommand
    return p, sub


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse, set up logging and run the chosen subcommand's `func`, with the command's exit codes: its own, 2 for a
    bad value or a missing file (named), 1 for a file that cannot be written or read (named: no permission, a file
    where a directory should be), 130 on Ctrl-C (saying so)."""
    args, extra = parser.parse_known_args(vllm_spelling(sys.argv[1:] if argv is None else list(argv)))
    if extra:   # named by the subcommand's own parser: its usage line lists its flags, not the module's subcommands
        group = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub = group.choices[args.command]
        sub.error(f"unrecognized arguments: {' '.join(_close_flags(sub, extra))}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        if isinstance(exc, FileNotFoundError) and "No usable temporary directory" in str(exc):   # tempfile's words
            exc = f"{exc.strerror or exc}: set TMPDIR to a writable directory"
        print(f"moepipe {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:          # an output path that is a file, read-only, ...: one line naming it
        names = " -> ".join(str(n) for n in (exc.filename, exc.filename2) if n)
        print(f"moepipe {args.command}: {names + ': ' if names else ''}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:       # one line, as the errors above: not a silent exit mid-output
        sys.stdout.flush()
        print(f"\nmoepipe {args.command}: interrupted", file=sys.stderr)
        return 130


def _close_flags(parser: argparse.ArgumentParser, extra: list[str]) -> list[str]:
    """`extra` with `(did you mean --max-model-len?)` after each unknown long option close to one `parser` takes (a
    vLLM user's `--max-model-length`, `--served-model`, a typo). Options are never abbreviated (ArgumentParser), so
    a near miss was only "unrecognized", after a usage text of 60 flags."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    out = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75) if name.startswith("--") else []
        out.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    return out


def vllm_spelling(argv: list[str]) -> list[str]:
    """Long options as vLLM's FlexibleArgumentParser takes them: `--max_model_len 4096` and `--max_model_len=4096`
    are `--max-model-len` (underscores in the name, never in a value); after a bare `--` nothing is changed. A vLLM
    command line written with underscores was refused as unrecognized arguments."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _dispatch_parser() -> argparse.ArgumentParser:
    """The dispatcher's parser: every subcommand with its help, none with its flags (the module it runs parses
    them; `moepipe <subcommand> --help` is passed through to it)."""
    p, sub = command_parser()
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def _call(cmd: list[str]) -> int:
    """Run cmd and return its exit code. While it runs, SIGINT is ignored here so that Ctrl-C (sent to the whole
    foreground process group) is the child's to handle: `serve` stops its cluster, the others exit 130. Ignored only
    after the child has started, since a Python started with SIGINT ignored never raises KeyboardInterrupt."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None
    proc = subprocess.Popen(cmd)
    try:
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return proc.wait()
    except KeyboardInterrupt:             # Ctrl-C came before it was ignored: the child has it too
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    """`moepipe [-v] <subcommand> ...`: runs `python -m <module> [-v] <subcommand> ...` with the arguments as given
    and returns its exit code. As the console script or `python -m shared.cli` (argv None) it replaces this process
    with that command (no extra process between the shell and the service)."""
    args = sys.argv[1:] if argv is None else list(argv)
    known, _ = _dispatch_parser().parse_known_args(args)   # --help, a missing or unknown subcommand: argparse exits
    cmd = [sys.executable, "-m", COMMANDS[known.command][0], *args]
    if argv is None and os.name == "posix":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, cmd)
    return _call(cmd)


if __name__ == "__main__":
    sys.exit(main())
