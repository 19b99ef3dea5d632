# call F: decode at 4k vs 256k context with host K/V and the row cache (issue 18's 5% bar). In h200-13 this printed
# nothing in 120 s (one invocation for batch 1 and 4, the table only at the end); now batch 1 first, each run
# printing a "done:" line as it ends, ~3 minutes a batch size allowed.
timeout 200 python3 bench/decode.py --preset full-shape --layers 20 --batch 1 --context 4096,262144 --qsa-kv-offload --row-cache-mib 32 --configs all:1 --no-transformers --steps 32 --out $OUT/decode_long_b1.json > $OUT/decode_long_b1.log 2>&1; grep -E "done:|FAILED" $OUT/decode_long_b1.log; tail -4 $OUT/decode_long_b1.log
timeout 200 python3 bench/decode.py --preset full-shape --layers 20 --batch 4 --context 4096,262144 --qsa-kv-offload --row-cache-mib 32 --configs all:1 --no-transformers --steps 32 --out $OUT/decode_long_b4.json > $OUT/decode_long_b4.log 2>&1; grep -E "done:|FAILED" $OUT/decode_long_b4.log; tail -4 $OUT/decode_long_b4.log
