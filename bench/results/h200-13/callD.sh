# call D: eviction probe, issue 16's 10% bar with INT4 tables, one cold PLE run that records mapped pages
set -x
python3 bench/results/h200-13/evict_probe.py /tmp > $OUT/evict_probe.log 2>&1; cat $OUT/evict_probe.log
OFFLOAD_INT4_SHARES=0,0.1 OFFLOAD_TIMEOUT=260 STEPS=offload_int4 OUT=$OUT/o bash tools/served_speed_run.sh > $OUT/offload.log 2>&1; tail -20 $OUT/offload.log
COLD_PREFETCH=1 COLD_RUNS=1 STEPS=cold OUT=$OUT/c bash tools/served_speed_run.sh > $OUT/cold.log 2>&1; grep -v "access POST" $OUT/cold.log | tail -12
