#!/usr/bin/env bash
# Keep a device call's Triton autotune results for the next calls (tools/gpu_session.sh puts them into Triton's
# cache before the command): unpack FILES_AT/triton_autotune.tgz into .triton-autotune/ (git-ignored; name it in
# the run's `carry`). Results of the same kernel, key and configs replace older ones.
# Usage here:  bash tools/keep_autotune.sh /work/.device/N
set -euo pipefail
src=${1:?usage: keep_autotune.sh FILES_AT}
[[ -f $src/triton_autotune.tgz ]] || { echo "no triton_autotune.tgz in $src" >&2; exit 1; }
dst=$(cd "$(dirname "$0")/.." && pwd)/.triton-autotune
mkdir -p "$dst"
tar xzf "$src/triton_autotune.tgz" -C "$dst"
echo "$(find "$dst" -name '*.autotune.json' | wc -l) autotune results in $dst ($(du -sh "$dst" | cut -f1))"
