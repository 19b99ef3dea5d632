# call A: qsa-select-1 then row-cache-1 (see their next.txt)
set -x
timeout 110 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_qsa.py > $OUT/qsa_pytest.log 2>&1
timeout 40 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/test_qsa_kv_offload.py -k bit_identical >> $OUT/qsa_pytest.log 2>&1
grep -E "qsa_select|passed|failed|Error|us" $OUT/qsa_pytest.log | tail -30
timeout 70 python3 bench/qsa_kv_offload.py --tiers vram --contexts 4096,65536,262144 --batch 1,4 --no-prefill --reps 20 --out $OUT/qsa_select.json > $OUT/qsa_bench.log 2>&1; tail -12 $OUT/qsa_bench.log
timeout 100 python3 -m pytest -q -s -p no:cacheprovider -n 0 tests/test_kv_row_cache.py tests/test_kernel_decode_attention.py > $OUT/rc_pytest.log 2>&1
grep -E "mismatches|hit rate|passed|failed|Error" $OUT/rc_pytest.log | tail -20
timeout 50 python3 bench/qsa_kv_offload.py --tiers rows --contexts 4096,262144,65536 --batch 1,4 --no-prefill --reps 20 --row-cache-mib 32 --out $OUT/row_cache.json > $OUT/rc_bench.log 2>&1; tail -12 $OUT/rc_bench.log
