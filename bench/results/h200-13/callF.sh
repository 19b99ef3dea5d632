# call F (device time nearly spent): decode at 4k vs 256k context with host K/V and the row cache (issue 18's 5% bar)
timeout 120 python3 bench/decode.py --preset full-shape --layers 20 --batch 1,4 --context 4096,262144 --qsa-kv-offload --row-cache-mib 32 --configs all:1 --no-transformers --steps 32 --out $OUT/decode_long.json > $OUT/decode_long.log 2>&1; tail -8 $OUT/decode_long.log
