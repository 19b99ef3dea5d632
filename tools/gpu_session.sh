#!/usr/bin/env bash
# Everything one device call needs: install the carried wheels (.whl, .whl-lean or .whl-gpu: tools/build_wheels.sh), then run
# the given command.
# Usage on the device machine:  bash tools/gpu_session.sh 'python tools/gpu_smoke.py /tmp/tiny'
# Triton's autotune results travel between calls: a carried .triton-autotune/ (tools/keep_autotune.sh unpacks a
# call's $OUT/triton_autotune.tgz into it) is put into Triton's cache first, so flash-linear-attention's autotuned
# prefill kernels (48 configs for one of them, each compiled and timed) compile only their winner; the call's own
# results go back as $OUT/triton_autotune.tgz (one of the 8 files a call returns). A fresh machine spent 60-90 s of
# each server start "running the prefill path once" (h100-31).
set -uo pipefail
# A server an earlier call left running on this warm machine holds the GPU's memory (h100-34: a stage worker whose
# launcher the call's end had killed still held 63 GiB, and the next call's benchmark ran out of memory): end every
# moepipe process before the command and after it. The launcher runs as `python3 -m gateway.cli serve`.
leftovers() { pkill -9 -f '[g]ateway.cli serve|[s]tage_worker --config|[p]le_service --config|[g]ateway --config' 2>/dev/null; sleep 1; }
leftovers
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$(ls -d .whl .whl-lean .whl-gpu 2>/dev/null | head -1)"/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m shared.cli "$@"\n' > /tmp/bin/moepipe && chmod +x /tmp/bin/moepipe
export PATH=/tmp/bin:$PATH
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
[[ -d .triton-autotune ]] && mkdir -p "$cache" && cp -r .triton-autotune/. "$cache/"
eval "$1"
rc=$?
leftovers
if [[ -n ${OUT:-} && -d $cache ]]; then
  (cd "$cache" && find . -name '*.autotune.json' | tar czf "$OUT/triton_autotune.tgz" -T - 2>/dev/null)
fi
exit $rc
