#!/usr/bin/env bash
# Build the wheel folder an offline GPU machine needs (the lent H200s: Python 3.12, torch 2.11, triton 3.6,
# msgpack, numpy, tokenizers, safetensors, httpx, prometheus-client already there; transformers there is 5.17,
# older than our oracle). One command:  tools/build_wheels.sh [DIR]   (default .whl, git-ignored)
#   tools/build_wheels.sh .whl-lean --lean   leaves out transformers (13.5 MB): serving, benchmarks and training
#   need no oracle, and the tracked tree plus the full folder is near the 64 MiB a device call may carry.
#   tools/build_wheels.sh .whl-gpu --gpu-tests   keeps transformers but leaves out the openai client (3 MB): the
#   GPU tests need the oracle, and their one server test talks through httpx, which the image has. With it the
#   tracked tree (~48 MB, 14 of them bench/traces/demo-model/route_trace.npz) is over the 64 MiB: a call carrying
#   .whl-gpu first moves that trace out of the working tree (no GPU test reads it) and puts it back after.
# On the GPU machine:  python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#                      export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dir="${1:-.whl}"
lean="${2:-}"
mkdir -p "$dir"
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
pkgs=(
  # the server
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
  opentelemetry-api pyzmq
  # test clients and the reference implementation
  openai distro jiter sniffio httpx2 httpcore2 truststore idna "transformers>=5.24"
  # what transformers 5.2x checks at import and the image has too old (h200-16: huggingface-hub 1.33 refused)
  "huggingface-hub>=2.4,<3" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" click typer
  # GPU kernels: flash-linear-attention's Gated DeltaNet kernels
  flash-linear-attention fla-core einops
  # quantized checkpoints: the GPU tests write theirs with `moepipe quantize` (the image has torch, transformers and
  # psutil, which compressed-tensors also needs)
  compressed-tensors loguru
)
for p in "${pkgs[@]}"; do
  [ "$lean" = --lean ] && [[ $p =~ ^(transformers|huggingface-hub|tokenizers|safetensors|click|typer) ]] && continue
  [ "$lean" = --gpu-tests ] && [[ $p =~ ^(openai|distro|jiter|sniffio)$ ]] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" "$p"
done
ls -1 "$dir"
du -sh "$dir"
