#!/usr/bin/env bash
# Issue 7 in one device call on the two-GPU kind (run it with kind nvidia-h200-x2, carry .whl):
#   bash tools/gpu_session.sh 'bash tools/two_gpu_run.sh'
# 1. The same greedy tokens and logprobs with two stages on one GPU and with one stage per GPU (small preset).
# 2. A preset that needs both cards' memory (full-shape cut to 30 layers, about 159 GB in bf16, dummy weights),
#    served with one stage per GPU: TTFT, ITL median/p90, tokens/s at 1, 2 and 4 streams, the time activations spend
#    between the stages per prefill chunk and per decode step, each stage's busy fraction (bench/serve.py).
# Everything lands in $OUT (JSON and logs). Each step has its own timeout so a hang costs only that step.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
moepipe make-model --preset small --out /tmp/small > /dev/null
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 tools/greedy_transcript.py record --model /tmp/small --stages 2 \
  --device cuda --out "$out/one_gpu.json" > "$out/record_one.log" 2>&1 || tail -20 "$out/record_one.log"
timeout 170 python3 tools/greedy_transcript.py record --model /tmp/small --stages 2 --device cuda \
  --out "$out/two_gpus.json" > "$out/record_two.log" 2>&1 || tail -20 "$out/record_two.log"
python3 tools/greedy_transcript.py compare "$out/one_gpu.json" "$out/two_gpus.json" | tee "$out/compare.txt"
moepipe make-model --preset full-shape --layers 30 --out /tmp/fs30 > /dev/null
timeout "${SERVE_TIMEOUT:-330}" python3 bench/serve.py --model /tmp/fs30 --load-format dummy --stages 2 --device cuda \
  --streams 1,2,4 --max-tokens 64 --runs 3 --out "$out/serve_full-shape30_2gpu.json" 2>&1 | tee "$out/serve.log" | tail -8
