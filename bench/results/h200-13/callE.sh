# call E: issue 18 cold PLE TTFT with the server's mappings paged out (prefetch on, off), then decode at 4k vs 256k
# context with host K/V and the row cache (the "within 5%" bar)
set -x
COLD_RUNS=1 COLD_TIMEOUT=130 STEPS=cold OUT=$OUT/c bash tools/served_speed_run.sh > $OUT/cold.log 2>&1; grep -v "access POST" $OUT/cold.log | tail -16
timeout 110 python3 bench/decode.py --preset full-shape --layers 20 --batch 1,4 --context 4096,262144 --qsa-kv-offload --row-cache-mib 32 --configs all:1 --no-transformers --steps 32 --out $OUT/decode_long.json > $OUT/decode_long.log 2>&1; tail -8 $OUT/decode_long.log
