"""A checkpoint directory's safetensors files, its on-disk tensor names, and the error that names them.

In `shared` because two services read the same checkpoint: a stage's loader (`stage_worker/checkpoint/loader.py`)
streams its tensors, and the PLE service scans its headers for the PLE tables (`shared/ple_files.py`). Both must list
the same files, read the same names and raise the same `CheckpointError` (callers catch it, or a ValueError).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["CheckpointError", "checkpoint_files", "normalise", "open_safetensors", "readable_as_umask_allows",
           "tensor_headers"]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor and its file."""


def readable_as_umask_allows(path: str | Path) -> None:
    """Give a file moepipe wrote the mode the umask allows (644 under the usual 022): safetensors writes its files
    600, so a checkpoint made by root (`make-model`, `quantize`) could not be read by the service user that serves
    it, and the loader said "No such file or directory"."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files, sorted: those the index lists (one missing is an error, not a silently smaller model),
    else every `*.safetensors` in the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({model_dir / f for f in weight_map.values()})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object whose weight_map maps tensor "
                                  f"names to files): {type(exc).__name__}: {exc}") from None
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {missing[0].name}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = sorted(f.name for f in model_dir.glob("*.bin") if f.name.startswith("pytorch_model"))
        if pickled or (model_dir / "pytorch_model.bin.index.json").is_file():
            # transformers still reads these (torch.load); moepipe maps safetensors files and never unpickles
            raise CheckpointError(f"{model_dir}: the weights are PyTorch pickles ({', '.join(pickled) or 'an index'}"
                                  f"), which moepipe does not read: it loads *.safetensors only. Convert them once "
                                  f"(transformers: from_pretrained, then save_pretrained writes safetensors)")
        raise CheckpointError(f"{model_dir}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def normalise(name: str) -> str:
    """Map released-checkpoint prefixes onto the plain causal-LM layout."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    return name


def open_safetensors(path: Path):
    """`safe_open` on the CPU; a file it cannot read (truncated, not safetensors) is a CheckpointError naming it.
    The loader, `tensor_headers` and the PLE shard scan open them through this, so a broken file is one line naming
    it in whichever process reads it first, not a traceback (`moepipe quantize` reads its source's headers through
    `tensor_headers` before it writes anything); a GPTQ checkpoint's files read as compressed-tensors'
    (`shared/gptq_files.py`)."""
    from safetensors import safe_open

    try:
        open(path, "rb").close()      # safetensors words a permission error "No such file or directory"
    except OSError as exc:
        hint = "; make the checkpoint readable by this user (e.g. chmod a+r: safetensors writes its files mode " \
            "600)" if isinstance(exc, PermissionError) else ""
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc}){hint}") from None
    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception as exc:       # safetensors' SafetensorError, or an OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    from shared.gptq_files import GptqView, plan_for

    plan = plan_for(Path(path).parent)        # a GPTQ checkpoint: its parts shown as compressed-tensors'
    return f if plan is None else GptqView(f, plan, Path(path))


def tensor_headers(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """On-disk name (as written, not `normalise`d) -> (shape, safetensors dtype) of every tensor in the weight files
    (`checkpoint_files`), from their headers alone. A stage's load reads them once and hands them to what checks
    the files before streaming them (the quantization check, the packed and float8 layer specs, a tied lm_head);
    the quantization check `moepipe serve` runs, the packed-expert scan and `moepipe quantize`'s plan read them
    through this too."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in checkpoint_files(Path(model_dir)):
        with open_safetensors(path) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return out
