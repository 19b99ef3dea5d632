# call B: section-attention-1 then quant-gemv-2 (see their next.txt)
set -x
timeout 80 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_section_attention.py > $OUT/sa_pytest.log 2>&1
timeout 50 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_qsa_kv_offload.py -k "layer_over_host or peak_memory or replays" >> $OUT/sa_pytest.log 2>&1
grep -E "ctx |host K/V|passed|failed|Error" $OUT/sa_pytest.log | tail -20
timeout 30 python3 bench/qsa_kv_offload.py --tiers host --contexts 4096,262144 --batch 1 --row-cache-mib 0 --reps 10 --out $OUT/fused.json > $OUT/sa_bench.log 2>&1; tail -4 $OUT/sa_bench.log
timeout 20 python3 bench/qsa_kv_offload.py --tiers host --contexts 262144 --batch 1 --row-cache-mib 0 --reps 10 --kernels all,-section_attention --out $OUT/loop.json >> $OUT/sa_bench.log 2>&1; tail -2 $OUT/sa_bench.log
timeout 170 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_quant_gemv.py -k "full_shape or swiglu" > $OUT/qg_pytest.log 2>&1
grep -E "int4|int6|int8|passed|failed|Error" $OUT/qg_pytest.log | tail -60
