moepipe make-model --preset full-shape --layers 8 --out /tmp/fs2 >/dev/null
python3 bench/serve.py --model /tmp/fs2 --load-format dummy --device cuda --streams 4 --max-tokens 256 --runs 3 --stages 1 --out $OUT/one.json > $OUT/one.log 2>&1 &
B=$!
for i in $(seq 1 75); do sleep 2; grep -q "short x 4" $OUT/one.log && break; if grep -q "access POST" $OUT/one.log; then :; fi; done
if ! grep -q "short x 4" $OUT/one.log; then
  echo HANG-OR-SLOW; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > $OUT/smi.txt
  for p in $(ss -ltnp 2>/dev/null | grep -o ':[0-9]*' | tr -d : | sort -u); do curl -s -m 2 localhost:$p/metrics | grep -E "^moepipe_(requests|stage_steps|stage_skipped|num_|kv|tokens)" >> $OUT/metrics.txt; done
  pkill -USR2 -f "stage_worker" ; sleep 3
fi
kill $B; sleep 3; grep -h "short x 4\|Error\|error\|Traceback" $OUT/one.log | head -20 | cut -c1-250; grep -c "File " $OUT/one.log
