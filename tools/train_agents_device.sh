#!/usr/bin/env bash
# One device call of the agent fine-tune (issue 13, docs/demo-model.md), through tools/gpu_session.sh:
#   bash tools/train_agents_device.sh 6 [train_demo.py options...]   # minutes of training (options override the
#                                                                     # defaults below), the eval, the export
# runs/agent must hold tokenizer/, tokens.npz and agent_sources.json (train_demo.py --prepare --agent-batch 1).
# Times 6 steps first and sets the LR schedule to the steps that fit the minutes.
set -uo pipefail
minutes=${1:-6}
shift
out=${OUT:-/tmp/out}
common=(--init-from shared/demo_model --chat-share 0.2 --agent-batch 24 --aider-batch 4)
train=(--batch 32 --lr 5e-4 --warmup 20 --distill-steps 0 --save-every 100000 "$@")
rm -rf /tmp/timing && mkdir -p /tmp/timing && cp -r runs/agent/tokenizer runs/agent/tokens.npz runs/agent/agent_sources.json /tmp/timing/
python3 tools/train_demo.py --out /tmp/timing "${common[@]}" "${train[@]}" --total-steps 100 --max-steps 6 \
  > "$out/timing.txt" 2>&1 || { tail -n 30 "$out/timing.txt"; exit 1; }
steps=$(python3 -c "
import json, statistics
recs = [json.loads(l) for l in open('/tmp/timing/log.jsonl')][2:]
s = statistics.median(r['seconds'] for r in recs)
print(int($minutes * 60 / s), end=' ')
print(f'({s:.2f} s/step)', flush=True)")
echo "schedule: $steps"
steps=${steps%% *}
python3 tools/train_demo.py --out runs/agent "${common[@]}" "${train[@]}" --total-steps "$steps" --minutes "$minutes" \
  > "$out/train.txt" 2>&1
rc=$?
grep -E "^step=" "$out/train.txt" | awk 'NR % 3 == 1' | cut -c1-160 | tail -n 12
python3 tools/train_demo.py --out runs/agent "${common[@]}" "$@" --eval --export "$out/export" > "$out/eval.txt" 2>&1 || rc=1
cp runs/agent/log.jsonl runs/agent/eval.json "$out/" 2>/dev/null
# At most 16 MiB a file comes back from a device call: the 27 MB export travels as a tar in parts
# (here: cat export.tar.part* | tar -x).
tar -C "$out" -cf - export | split -b 15M -d - "$out/export.tar.part" && rm -rf "$out/export" "$out/timing.txt"
tail -n 12 "$out/eval.txt"
exit $rc
