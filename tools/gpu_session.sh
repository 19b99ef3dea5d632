#!/usr/bin/env bash
# Everything one device call needs: install the carried wheels (.whl, .whl-lean or .whl-gpu: tools/build_wheels.sh), then run
# the given command.
# Usage on the device machine:  bash tools/gpu_session.sh 'python tools/gpu_smoke.py /tmp/tiny'
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$(ls -d .whl .whl-lean .whl-gpu 2>/dev/null | head -1)"/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m shared.cli "$@"\n' > /tmp/bin/moepipe && chmod +x /tmp/bin/moepipe
export PATH=/tmp/bin:$PATH
eval "$1"
