# One device call (run tool timeout_s 560, carry [".whl-lean"]): the GPU tests and timing tables of the four kernels
# built GPU-unverified on 2026-12-02 (plan.txt items 2, 3, 9, 10), each with its own timeout so a hang costs only
# that one; logs in $OUT, read them against each one's next.txt.
set -x
timeout 130 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_moe_int4.py > $OUT/moe_int4.log 2>&1
grep -E "split|rows|^ +(1|4|16) |passed|failed|Error" $OUT/moe_int4.log | tail -25
timeout 130 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_quant_gemv.py -k "full_shape or swiglu" > $OUT/quant_gemv.log 2>&1
grep -E "int4|int6|int8|weight |passed|failed|Error" $OUT/quant_gemv.log | tail -45
timeout 110 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_section_attention.py > $OUT/section.log 2>&1
timeout 40 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_qsa_kv_offload.py -k "layer_over_host or replays or peak_memory or bit_identical" >> $OUT/section.log 2>&1
grep -E "^pool|host K/V prefill|passed|failed|Error|assert" $OUT/section.log | tail -20
timeout 110 python3 -m pytest -q -s -p no:cacheprovider -n 0 -m gpu tests/test_kernel_qsa.py > $OUT/qsa.log 2>&1
grep -E "qsa_select|passed|failed|Error" $OUT/qsa.log | tail -12
