#!/usr/bin/env bash
# One device call of demo-model training (issue 6), run through tools/gpu_session.sh on the lent H200.
#   first call:  bash tools/train_device.sh plan 575    # time 30 steps, fix the LR schedule length, train
#   next calls:  bash tools/train_device.sh resume 575  # resume runs/demo (kept on the machine between calls)
# runs/demo must hold tokenizer/ and tokens.npz: python tools/train_demo.py --prepare makes them (30 s, CPU).
# TRAIN_SECONDS is the training time the whole schedule gets over all calls.
set -uo pipefail
mode=$1; budget=$2
out=${OUT:-/tmp/out}
if [ "$mode" = plan ]; then
  # Time 20 steps at batch 16 and at 32; keep the batch with more tokens/s, and as many steps as the time allows
  # (capped at ~8 passes over the 13.5M training tokens).
  for b in 16 32; do
    rm -rf /tmp/timing$b && mkdir -p /tmp/timing$b && cp -r runs/demo/tokenizer runs/demo/tokens.npz /tmp/timing$b/
    timeout 150 python3 tools/train_demo.py --out /tmp/timing$b --batch $b --max-steps 20 --save-every 100000 \
      > "$out/timing$b.txt" 2>&1 || { tail -40 "$out/timing$b.txt"; exit 1; }
  done
  python3 - "${TRAIN_SECONDS:-1040}" > runs/demo/plan.txt <<'PY'
import json, statistics, sys
best = None
for b in (16, 32):
    recs = [json.loads(l) for l in open(f"/tmp/timing{b}/log.jsonl")][8:]
    step_s = statistics.median(r["seconds"] for r in recs)
    print(f"batch {b}: {step_s * 1000:.1f} ms/step, {b * 512 / step_s:.0f} tokens/s", file=sys.stderr)
    if best is None or b / step_s > best[0] / best[1]:
        best = (b, step_s)
b, step_s = best
print(min(int(float(sys.argv[1]) / step_s), int(110e6 / (b * 512))), b)
PY
fi
read -r steps batch < runs/demo/plan.txt
minutes=$(python3 -c "print(round(($budget - $SECONDS) / 60, 2))")
echo "schedule: $steps steps of batch $batch; this call trains for $minutes min"
timeout $((budget - SECONDS + 20)) python3 tools/train_demo.py --out runs/demo --total-steps "$steps" --batch "$batch" \
  --minutes "$minutes" --save-every 1000 --snapshot "$out/snap" > "$out/train_$mode.txt" 2>&1
rc=$?
cp runs/demo/log.jsonl runs/demo/plan.txt "$out/"
tail -4 "$out/train_$mode.txt"
exit $rc
