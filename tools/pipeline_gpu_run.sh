#!/usr/bin/env bash
# Issue 7 on a lent machine, in one device call (carry .whl or .whl-lean):
#   bash tools/gpu_session.sh 'bash tools/pipeline_gpu_run.sh'
# It adapts to the GPUs it sees.
# Two or more GPUs (kind nvidia-h200-x2):
#   1. greedy tokens and logprobs of the small preset, two stages on one GPU (CUDA_VISIBLE_DEVICES=0) vs one stage
#      per GPU (tools/greedy_transcript.py compare);
#   2. full-shape cut to 30 layers (about 159 GB in bf16, more than one 139 GiB card, dummy weights) served with one
#      stage per GPU: TTFT, ITL median/p90, tokens/s at 1, 2 and 4 streams, short and long prompts, the time
#      activations spend between stages per prefill chunk and decode step, each stage's busy fraction (bench/serve.py).
# One GPU (kind nvidia-h200): what one card allows.
#   1. the same greedy comparison, one stage vs two stage processes on the one GPU;
#   2. full-shape cut to 20 layers (105.9 GB) served by two stage processes sharing the GPU, same measurements;
#   3. the A/B: the same model from one stage process.
#   profile (not in the default): short served runs with MOEPIPE_PROFILE, one profile table per stage process, for
#   two stages and for one (stage_worker/profiling.py): where a served step's time goes.
# Arguments pick steps (default greedy pipeline ab); e.g. `... pipeline_gpu_run.sh profile`.
# Everything lands in $OUT (JSON and logs). Each step has its own timeout so a hang costs only that step.
set -uo pipefail
steps=" ${*:-greedy pipeline ab} "
want() { [[ $steps == *" $1 "* ]]; }
out=${OUT:-/tmp/out}
mkdir -p "$out"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
bench() {  # name, timeout, bench/serve.py arguments...
  local name=$1 limit=$2; shift 2
  # 2048 KV blocks (32k tokens): four 8,000-character prompts must not preempt each other
  timeout "$limit" python3 bench/serve.py --load-format dummy --device cuda --max-tokens 64 --runs 3 \
    --set num_blocks=2048 \
    --out "$out/serve_$name.json" "$@" > "$out/serve_$name.log" 2>&1
  tail -16 "$out/serve_$name.log"
}
record() {  # name, stages, timeout, [env...]: greedy tokens and logprobs of the small preset
  local name=$1 stages=$2 limit=$3; shift 3
  env "$@" timeout "$limit" python3 tools/greedy_transcript.py record --model /tmp/small --stages "$stages" \
    --device cuda --out "$out/greedy_$name.json" > "$out/record_$name.log" 2>&1 || tail -20 "$out/record_$name.log"
}
if [ "$gpus" -ge 2 ]; then layers=30 name=full-shape30_2gpu; else layers=20 name=full-shape20_1gpu; fi
if want greedy; then
  moepipe make-model --preset small --out /tmp/small > /dev/null
  if [ "$gpus" -ge 2 ]; then     # two stages on one GPU vs one stage per GPU
    record a 2 170 CUDA_VISIBLE_DEVICES=0
    record b 2 170
  else                           # one stage vs two stage processes on the GPU
    record a 1 120
    record b 2 120
  fi
  python3 tools/greedy_transcript.py compare "$out/greedy_a.json" "$out/greedy_b.json" | tee "$out/compare.txt"
fi
if want pipeline || want ab || want profile; then
  moepipe make-model --preset full-shape --layers $layers --out /tmp/fs > /dev/null
fi
want pipeline && bench "${name}_2stages" "${SERVE_TIMEOUT:-330}" --model /tmp/fs --stages 2 --streams 1,2,4 \
  --prompt-chars 0,8000
if want profile; then
  for n in 2 1; do
    MOEPIPE_PROFILE=$out/prof$n MOEPIPE_PROFILE_STEPS=20:30 bench "${name}_profile_${n}stages" 240 --model /tmp/fs \
      --stages $n --streams 1 --prompt-chars 0 --runs 2
  done
fi
if want ab && [ "$gpus" -lt 2 ]; then
  bench "${name}_1stage" "${SERVE_TIMEOUT_AB:-200}" --model /tmp/fs --stages 1 --streams 1,4 --prompt-chars 0,8000
fi
