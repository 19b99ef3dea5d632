#!/usr/bin/env bash
# Issue 14's measurement in one device call (carry .whl-lean):
#   bash tools/gpu_session.sh 'bash tools/served_speed_run.sh [steps] '
# Steps (default: sampler fs): greedyrows (the small preset's greedy tokens with the PLE stage gathering its
# own decode rows and with the service's rows, compared), check (the GPU test of a PLE stage replaying graphs with its host table), prefill
# (the grouped MoE prefill kernels' GPU test: agreement and timings at the full shape), greedy
# (greedy tokens and logprobs of the small preset served on one stage with ple_graph on and off, compared),
# sampler (bench/sampler.py on the GPU), fs (full-shape cut to 20 layers, PLE on stage 0), q3n (qwen3-next-shape,
# 32 layers, no PLE), one / two (full-shape on one stage process / two sharing the GPU, 4 streams, $TWO_LAYERS layers
# (20; 12 fit an H100), two once per setting in $TWO_AB (SERVE_VERBOSE=1: the components log at INFO, for a slow start):
# TWO_AB="base noipc" compares the CUDA IPC handoff (on by default) with the activations through the host), offload and vram24
# (issue 16: bench/expert_offload.py; --vram-limit 24 serving full-shape cut to 8 layers), vram_int4 (the whole
# 48-layer full shape with INT4 experts served under --vram-limit 24 and 32, --cold-experts auto), offload_int4 (issues
# 16 + 17: the GPU test of INT4 expert tables, bench/expert_offload.py --quant int4-experts), int4prefill (issue 17:
# the INT4 prefill kernels' GPU tests and bench/moe_int4_prefill.py; VRAM_AB="base noint4prefill" makes vram_int4 an
# A/B of TTFT with the per-expert loop), cold (issue 18: cold PLE
# time to first token on unseen 32k-token prompts, the table a 12.8 GB file, MOEPIPE_PLE_PREFETCH 1 and 0; COLD_PREFETCH
# "1:4:fadvise 1:4:pread:64" A/Bs the prefetch methods, COLD_IO=1 first times them on the table file with
# bench/ple_prefetch_io.py), long4 (issue 18:
# four ~250k-token requests resident at once with --qsa-kv-offload, full shape cut to 8 layers). For a model: the
# in-process decode step (bench/decode.py,
# kernels + graphs, batch 1/4/16) and, in the same call, the served TPOT and tokens/s from the client
# (bench/serve.py, one stage, 1/4/16 streams, $SERVE_MAX_TOKENS (256) tokens out, $SERVE_RUNS (3) runs: long enough that
# the streams' prompt prefill is a small share of the decode) once per A/B setting in $AB (default: "base" and every switch off).
# Everything lands in $OUT as one archive, results.tgz (an earlier run's archive in the same call inside it as earlier_*.tgz; the device returns at most 8 files: one run's JSON and logs
# are more); unpack with `tar xzf results.tgz`. Each step has its own timeout so a hang costs only that step.
set -uo pipefail
steps=" ${STEPS:-${*:-sampler fs}} "
want() { [[ $steps == *" $1 "* ]]; }
out=${OUT:-/tmp/out}
mkdir -p "$out"
# a second run in the same device call keeps the first one's archive (its last step empties $out): h100-31 call 2
# lost its first half's logs this way
[[ -f $out/results.tgz ]] && mv "$out/results.tgz" "$out/earlier_$(date +%H%M%S).tgz"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# the host's NUMA layout and the GPU's affinity: pinned host memory on the far node makes every host read slower
# (issue 16's run-to-run spread of the 10% row, h200-21)
{ lscpu | grep -i numa; nvidia-smi topo -m; } > "$out/topology.txt" 2>&1
# name=env settings for one served run; "base" is the build's defaults
declare -A AB_ENV=([base]="" [nosampling]="MOEPIPE_DEVICE_SAMPLING=0" [sampling]="MOEPIPE_DEVICE_SAMPLING=1"
                   [nographs]="MOEPIPE_CUDA_GRAPHS=0" [noplegraph]="MOEPIPE_PLE_GRAPH=0"
                   [noasync]="MOEPIPE_ASYNC_SCHEDULING=0" [noservice]="" [profile]="MOEPIPE_PROFILE_STEPS=300:40"
                   [noprefillkernel]="MOEPIPE_KERNELS=-moe_prefill" [plethreads0]="MOEPIPE_PLE_THREADS=0"
                   [nolaunchahead]="MOEPIPE_LAUNCH_AHEAD=0" [noskippad]="MOEPIPE_GRAPH_SKIP_PADDING=0"
                   [nostagerows]="MOEPIPE_PLE_DECODE_IN_STAGE=0" [mb1]="MOEPIPE_MICROBATCHES=1"
                   [noint4prefill]="MOEPIPE_KERNELS=-moe_int4_prefill" [norace]="MOEPIPE_KERNELS=-sample_race"
                   [nospin]="MOEPIPE_STAGE_SPIN_WAIT=0" [svcrows2]="MOEPIPE_PLE_DECODE_IN_STAGE_MAX_SEQS=2"
                   [noipc]="MOEPIPE_CUDA_IPC_ACTIVATIONS=0" [gil5]="MOEPIPE_GIL_SWITCH_INTERVAL_MS=0"
                   [nopdl]="MOEPIPE_KERNELS=all,-pdl" [noqkv]="MOEPIPE_PACKED_QKV=0"
                   [pla]="MOEPIPE_PLE_LAUNCH_AHEAD=1" [noragged]="MOEPIPE_BATCHED_PREFILL=0"
                   [inplace]="MOEPIPE_EXPERT_MOVE_ASYNC=0" [pla2]="MOEPIPE_PLE_LAUNCH_AHEAD_ACROSS_STAGES=1"
                   [mb2]="MOEPIPE_MICROBATCHES=2"
                   [chunk512]="MOEPIPE_MAX_NUM_BATCHED_TOKENS=512")
# pla: a PLE stage launches decode steps ahead, its graph waiting on the device for the rows (ple_launch_ahead);
# noragged: prefill steps loop over their sequences in DeltaNet, attention and PLE (batched_prefill off)
# pla2: with several stages, stage 0 launches decode steps ahead too, its graph waiting on the device for the ids
# and rows the last stage's Sampled brings (ple_launch_ahead_across_stages; e.g. STEPS=two TWO_AB="base pla2")
# mb2: two micro-batches (stages sharing a GPU count once by default: time-sliced, two lost; under CUDA MPS, removed
# after h200-27, 584.4 against one micro-batch's 507.1 and no MPS 586.3)
# inplace: expert moves in place instead of on read (expert_move_async off; e.g. VRAM_AB="base inplace")
# chunk512: 512-token prefill chunks instead of a GPU's default 2048 (GPU_MAX_NUM_BATCHED_TOKENS)
# svcrows2: decode steps of more than 2 sequences take the PLE service's rows (the default before issue 14's
# h200-16 finding: a round trip after every token at 4 and 16 streams)
# settings that are bench/serve.py flags rather than switches: noservice (stages gather their PLE rows themselves);
# profile writes torch.profiler tables of 40 served steps (inside the 1-stream runs) to $out/profile_<model>/
declare -A AB_ARGS=([noservice]="--no-ple-service")
ab=${AB:-base nosampling}
model() {  # tag, preset, layers, decode batches, stream counts
  local tag=$1 preset=$2 layers=$3 batches=$4 streams=$5
  moepipe make-model --preset "$preset" --layers "$layers" --out "/tmp/$tag" > /dev/null || return
  [[ -n ${NO_DECODE:-} ]] || timeout "${DECODE_TIMEOUT:-240}" python3 bench/decode.py --preset "$preset" --layers "$layers" --batch "$batches" \
    --configs all:1 --no-transformers --steps 32 --out "$out/decode_$tag.json" > "$out/decode_$tag.log" 2>&1
  tail -8 "$out/decode_$tag.log"
  for name in $ab; do
    local prof=""
    [[ $name == profile ]] && prof="MOEPIPE_PROFILE=$out/profile_$tag"
    env ${AB_ENV[$name]} $prof timeout "${SERVE_TIMEOUT:-200}" python3 bench/serve.py --model "/tmp/$tag" \
      ${AB_ARGS[$name]:-} ${SERVE_VERBOSE:+--verbose} --load-format dummy --device cuda --stages "${STAGES:-1}" --streams "$streams" \
      --max-tokens "${SERVE_MAX_TOKENS:-256}" --runs "${SERVE_RUNS:-3}" \
      --out "$out/serve_${tag}_$name.json" > "$out/serve_${tag}_$name.log" 2>&1
    echo "== served $tag $name (${AB_ENV[$name]:-defaults})"; tail -6 "$out/serve_${tag}_$name.log"
  done
}
if want check; then
  timeout 180 python3 -c "
import sys; sys.path[:0] = ['tests']
from stage_worker.checkpoint.make_model import make_model
from test_gpu_model import test_a_ple_stage_replays_graphs_with_its_host_table as t
t(make_model('tiny', '/tmp/tiny-check', seed=0)); print('PLE stage graphs with a host table: OK')" 2>&1 | tail -5
fi
if want greedy; then
  moepipe make-model --preset small --out /tmp/small > /dev/null
  for g in 1 0; do
    MOEPIPE_PLE_GRAPH=$g timeout 150 python3 tools/greedy_transcript.py record --model /tmp/small --stages 1 \
      --device cuda --out "$out/greedy_plegraph$g.json" > "$out/greedy_plegraph$g.log" 2>&1 \
      || tail -5 "$out/greedy_plegraph$g.log"
  done
  python3 tools/greedy_transcript.py compare "$out/greedy_plegraph1.json" "$out/greedy_plegraph0.json" | tail -4
fi
if want greedyrows; then   # issue 14: decode rows gathered by the PLE stage itself vs the PLE service's ring
  [ -d /tmp/small ] || moepipe make-model --preset small --out /tmp/small > /dev/null
  for g in 1 0; do
    MOEPIPE_PLE_DECODE_IN_STAGE=$g timeout 150 python3 tools/greedy_transcript.py record --model /tmp/small \
      --stages 1 --device cuda --out "$out/greedy_stagerows$g.json" > "$out/greedy_stagerows$g.log" 2>&1 \
      || tail -5 "$out/greedy_stagerows$g.log"
  done
  python3 tools/greedy_transcript.py compare "$out/greedy_stagerows1.json" "$out/greedy_stagerows0.json" | tail -4
fi
if want prefill; then   # the grouped MoE prefill kernels at the full shape: agreement with the loop, and timings
  timeout 240 python3 -c "
import sys; sys.path[:0] = ['tests']
import test_kernel_moe_prefill as t
for n in (64, 512, 4096): t.test_real_shapes_on_gpu(n)
print('grouped MoE prefill kernels at the full shape: OK')" 2>&1 | tail -6
fi
if want sampler; then
  timeout 120 python3 bench/sampler.py --device cuda --runs 20 --out "$out/sampler-h200.json" 2>&1 | tail -8
fi
if want offload; then   # issue 16: one host read's cost; decode with 0/10/25/50% of expert bytes in host RAM
  timeout 180 python3 -c "
import sys, traceback; sys.path[:0] = ['tests']
from pathlib import Path
import test_expert_table as t, test_host_memory as h
from stage_worker.checkpoint.make_model import make_model
checks = [(f'host rows {a}', lambda a=a: t.test_kernels_read_host_rows_as_if_one_table(*a))
          for a in [(1, 14, False), (5, 8, True), (70, 4, False), (70, 10, True)]]
checks += [(f'router counts {n}', lambda n=n: t.test_router_counts_selections_and_host_reads(n)) for n in (1, 6)]
checks += [('decide', t.test_decide_moves_only_a_clear_winner), ('swap kernel', t.test_swap_kernel_matches_the_reference),
           ('registered host memory', t.test_registered_host_memory_is_read_by_the_kernels_on_the_gpu),
           ('gpu stage greedy with moves', lambda: t.test_gpu_stage_with_host_experts_graphs_and_moves_serves_the_same_greedy_tokens(make_model('tiny', Path('/tmp/tiny0'), seed=0))),
           ('pinned buffers again', lambda: h.test_pinned_buffers_dropped_and_made_again_register_each_time(Path('/tmp')))]
for name, fn in checks:
    try:
        fn(); print('OK  ', name)
    except Exception as exc:
        print('FAIL', name, repr(exc)[:300]); traceback.print_exc(limit=3)
" > "$out/offload_checks.log" 2>&1
  grep -E "^(OK|FAIL)" "$out/offload_checks.log"
  timeout "${OFFLOAD_TIMEOUT:-480}" python3 bench/expert_offload.py --layers "${OFFLOAD_LAYERS:-16}" \
    --shares "${OFFLOAD_SHARES:-0,0.1,0.25,0.5}" --policies "${OFFLOAD_POLICIES:-8:512:2}" --batch 1,4 \
    --out "$out/expert_offload.json" \
    > "$out/expert_offload.log" 2>&1
  tail -16 "$out/expert_offload.log"
fi
if want offload_int4; then   # issues 16 + 17: INT4 experts kept packed in expert tables (host slots at the packed size)
  # the GPU test (INT4 decode kernel reading registered host memory in CUDA graphs, moves, the all-in-VRAM greedy
  # tokens), then decode with 0/10/25% of the packed expert bytes in host RAM, moves off and at the default policy
  timeout 240 python3 -m pytest -q -p no:cacheprovider -n0 tests/test_packed_cold_experts.py -k gpu_stage \
    > "$out/offload_int4_checks.log" 2>&1
  echo "== INT4 expert tables, GPU test (rc $?):"; tail -4 "$out/offload_int4_checks.log"
  timeout "${OFFLOAD_TIMEOUT:-480}" python3 bench/expert_offload.py --quant int4-experts \
    --layers "${OFFLOAD_LAYERS:-16}" --shares "${OFFLOAD_INT4_SHARES:-0,0.1,0.25}" \
    --policies "${OFFLOAD_INT4_POLICIES:-1:128:0.5}" --batch 1,4 --out "$out/expert_offload_int4.json" \
    --warmup "${OFFLOAD_WARMUP:-128}" --steps "${OFFLOAD_STEPS:-384}" \
    ${OFFLOAD_PROFILE:+--profile "$out/offload_prof"} > "$out/expert_offload_int4.log" 2>&1
  tail -14 "$out/expert_offload_int4.log"
fi
if want vram_int4; then   # issues 16 + 17: the whole full shape (48 layers) with INT4 experts under --vram-limit
  moepipe make-model --preset full-shape --out /tmp/fs48 > /dev/null
  # VRAM_AB: A/B settings of $AB_ENV per limit (noint4prefill: INT4 prefill by the per-expert loop, for TTFT)
  for lim in ${VRAM_LIMITS:-24 32}; do for name in ${VRAM_AB:-base}; do
    tag="vram$lim"; [[ $name == base ]] || tag="vram${lim}_$name"
    env ${AB_ENV[$name]} timeout "${VRAM_TIMEOUT:-240}" python3 bench/serve.py --model /tmp/fs48 --load-format dummy \
      --device cuda --stages 1 --streams 1,4 --max-tokens 64 --runs 2 --set dummy_quant=int4-experts \
      --set vram_limit=$lim --set cold_experts=auto --set max_model_len=8192 --out "$out/serve_fs48_int4_$tag.json" \
      > "$out/serve_fs48_int4_$tag.log" 2>&1
    echo "== full shape, 48 layers, INT4 experts, --vram-limit $lim, --cold-experts auto, $name (rc $?):"
    grep -A3 "GiB;" "$out/serve_fs48_int4_$tag.log" | head -4; tail -5 "$out/serve_fs48_int4_$tag.log"
  done; done
fi
if want cold; then   # issue 18: cold PLE time to first token, the PLE table a file on disk, prefetch on and off
  # full shape cut to $COLD_LAYERS layers; the table scaled to the disk: ngram_vocab_size_base $COLD_BASE rows a head
  # (2.5M: 40M rows of 160 bf16, 12.8 GB; the reports' 20M is 102 GB), written once before the servers start
  moepipe make-model --preset full-shape --layers "${COLD_LAYERS:-8}" --out /tmp/fscold > /dev/null
  python3 - <<PY
import json, time, torch
from pathlib import Path
from ple_service.tables import open_tables
from shared.model_config import load_config
p = Path("/tmp/fscold/config.json"); c = json.loads(p.read_text()); c["ngram_vocab_size_base"] = ${COLD_BASE:-2500000}
p.write_text(json.dumps(c, indent=1)); t0 = time.perf_counter()
tables = open_tables("/tmp/fscold", load_config("/tmp/fscold"), load_format="dummy", dummy_file=True)
print("PLE table files:", [f"{t.path.name} {t.path.stat().st_size / 2**30:.1f} GiB" for t in tables.values()],
      f"written in {time.perf_counter() - t0:.0f} s")
PY
  df -h /tmp | tail -1
  if [[ -n ${COLD_IO:-} ]]; then   # the prefetch methods' raw page rate on this table file and drive, no server
    table=$(ls /tmp/fscold/ple_table.*.bin | head -1)
    timeout "${COLD_IO_TIMEOUT:-150}" python3 bench/ple_prefetch_io.py --file "$table" --methods \
      "${COLD_IO_METHODS:-process_madvise:1 process_madvise:4 fadvise:1 fadvise:4 pread:32 pread:64}" \
      --out "$out/ple_prefetch_io.json" > "$out/ple_prefetch_io.log" 2>&1
    echo "== bench/ple_prefetch_io.py on $table (rc $?):"; tail -12 "$out/ple_prefetch_io.log"
  fi
  # COLD_PREFETCH items PF[:T[:METHOD[:DEPTH]]]: 1 (prefetch on, defaults), 0 (off), 1:T (T prefetch threads),
  # 1:T:METHOD (ple_prefetch_method madvise, fadvise or pread; T may be empty: 1::fadvise), 1:T:pread:D (D reads in
  # flight, ple_prefetch_depth); each side reads its own unseen text (text seed = its place in the list); COLD_TEXT
  # code: real code (the standard library's sources; ~142000 characters are ~32k tokens) instead of random words
  seed=0
  for item in ${COLD_PREFETCH:-1 0}; do
    seed=$((seed + 1)); IFS=: read -r pf th meth depth <<< "$item"; tag=$pf
    [[ -n $th ]] && tag="${tag}t$th"; [[ -n $meth ]] && tag="${tag}_$meth"; [[ -n $depth ]] && tag="${tag}_d$depth"
    env MOEPIPE_PLE_PREFETCH=$pf ${th:+MOEPIPE_PLE_PREFETCH_THREADS=$th} ${meth:+MOEPIPE_PLE_PREFETCH_METHOD=$meth} \
      ${depth:+MOEPIPE_PLE_PREFETCH_DEPTH=$depth} timeout "${COLD_TIMEOUT:-300}" \
      python3 bench/serve.py --model /tmp/fscold \
      --load-format dummy --device cuda --stages 1 --set dummy_ple_file=true --cold \
      --prompt-chars "${COLD_CHARS:-54500}" --runs "${COLD_RUNS:-2}" --text-seed $seed --cold-text "${COLD_TEXT:-words}" \
      --out "$out/cold_prefetch$tag.json" > "$out/cold_prefetch$tag.log" 2>&1
    echo "== cold PLE TTFT, MOEPIPE_PLE_PREFETCH=$pf${th:+ MOEPIPE_PLE_PREFETCH_THREADS=$th}${meth:+ MOEPIPE_PLE_PREFETCH_METHOD=$meth}${depth:+ MOEPIPE_PLE_PREFETCH_DEPTH=$depth}"
    tail -7 "$out/cold_prefetch$tag.log"
  done
fi
if want long4; then   # issue 18: four ~250k-token requests resident at once with host K/V, no preemption
  # full shape cut to $LONG4_LAYERS (8: 2 QSA layers) layers; --max-num-seqs 4 --max-model-len 262144
  # --qsa-kv-offload; 4 streams of 850,000 characters (248.5k tokens with this tokenizer) and 2,048 tokens out (the
  # first stream still decodes while the other three prefill: ~1,460 steps), a short warm-up; the plan's table
  # (pool for 4 full sequences, host K/V, the reserve's long-context part) and, per run, the most requests running
  # and KV blocks used at once, TTFT, TPOT and preemptions
  moepipe make-model --preset full-shape --layers "${LONG4_LAYERS:-8}" --out /tmp/fslong > /dev/null
  timeout "${LONG4_TIMEOUT:-500}" python3 bench/serve.py --model /tmp/fslong --load-format dummy --device cuda \
    --stages 1 --streams 4 --prompt-chars "${LONG4_CHARS:-850000}" --max-tokens "${LONG4_TOKENS:-2048}" --runs 1 \
    --warmup-chars 20000 --set max_num_seqs=4 --set max_model_len=262144 --set qsa_kv_offload=true \
    ${LONG4_SET:-} --out "$out/long4.json" > "$out/long4.log" 2>&1
  echo "== long4: 4 x ~250k tokens, host K/V (rc $?):"; grep -A3 "GiB;" "$out/long4.log" | head -4
  grep -E "reserve:|KV pool holds" "$out/long4.log" | head -4; tail -6 "$out/long4.log"
fi
if want vram24; then   # issue 16: --vram-limit 24 serves full-shape cut to 8 layers (~45 GB of bf16 weights)
  moepipe make-model --preset full-shape --layers 8 --out /tmp/fs8 > /dev/null
  timeout 120 moepipe serve --model /tmp/fs8 --device cuda --load-format dummy --vram-limit 24 \
    --max-model-len 8192 > "$out/vram24_refused.log" 2>&1
  echo "== without cold experts (rc $?):"; tail -4 "$out/vram24_refused.log"
  python3 -c "
from shared import cold_set
from shared.model_config import load_config
cfg = load_config('/tmp/fs8')
n = int(cfg.num_experts * 0.6)
cold = {l: list(range(cfg.num_experts - n, cfg.num_experts)) for l in range(cfg.num_hidden_layers)}
cold_set.write('/tmp/cold60.json', cfg, '/tmp/fs8', cold, [(0, 8)], cold_set.expert_bytes(cfg), 1 << 40, ['ids'])"
  timeout 300 python3 bench/serve.py --model /tmp/fs8 --load-format dummy --device cuda --stages 1 \
    --streams 1,4 --max-tokens 64 --runs 2 --set vram_limit=24 --set cold_experts='"/tmp/cold60.json"' \
    --set max_model_len=8192 --out "$out/serve_vram24.json" > "$out/serve_vram24.log" 2>&1
  echo "== served with --vram-limit 24, 60% of experts in host RAM:"; grep -A8 "GiB;" "$out/serve_vram24.log" \
    | head -4; tail -5 "$out/serve_vram24.log"
fi
if want int4prefill; then   # issue 17: INT4 expert prefill on the tensor cores (kernels/moe_int4_prefill.py)
  # the GPU tests (full shape against the reference and the loop, no host sync, a GPU stage with cold packed
  # experts against the loop; the bf16 prefill kernels' full-shape test, now also without a host sync), then the
  # full-shape timings with 0% / 78% host slots and the launch-config sweep
  timeout "${INT4P_TEST_TIMEOUT:-80}" python3 -m pytest -q -p no:cacheprovider -n0 -s -m gpu \
    tests/test_kernel_moe_int4_prefill.py tests/test_kernel_moe_prefill.py > "$out/int4_prefill_tests.log" 2>&1
  echo "== INT4 prefill GPU tests (rc $?):"; grep -E "^T=|passed|failed|Error" "$out/int4_prefill_tests.log" | tail -14
  timeout "${INT4P_BENCH_TIMEOUT:-75}" python3 bench/moe_int4_prefill.py ${INT4P_ARGS:---tokens 44,512 --sweep} \
    --out "$out/moe_int4_prefill.json" > "$out/moe_int4_prefill.log" 2>&1
  echo "== bench/moe_int4_prefill.py (rc $?):"; tail -16 "$out/moe_int4_prefill.log"
fi
want fs && model fs full-shape 20 1,4,16 "${STREAMS:-1,4,16}"
want q3n && model q3n qwen3-next-shape 32 1,4,16 "${STREAMS:-1,4,16}"
# two stage processes sharing the one GPU at 4 streams (issue 14: at least the one-stage throughput)
# one: the same model on one stage process, the bar of `two` in the same call. TWO_LAYERS (20): 12 fits an H100.
want one && NO_DECODE=1 ab=base model fs_1stage full-shape "${TWO_LAYERS:-20}" 4 4
want two && STAGES=2 NO_DECODE=1 ab="${TWO_AB:-base}" model fs_2stages full-shape "${TWO_LAYERS:-20}" 4 4
(cd "$out" && tar czf /tmp/results.tgz --exclude results.tgz . && rm -rf -- ./* && mv /tmp/results.tgz .)
ls -l "$out"
true
