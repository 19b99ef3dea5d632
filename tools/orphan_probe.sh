# Everything also goes to $OUT/probe.log, so a call cut off by its timeout still brings the output back (h100-34:
# the first try ran out of its 150 s after the first round, and its stdout was lost).
exec > >(tee -a "$OUT/probe.log") 2>&1
moepipe make-model --preset full-shape --layers 8 --out /tmp/fs2 >/dev/null
(MOEPIPE_STARTUP_WARMUP=0 moepipe serve --model /tmp/fs2 --load-format dummy --device cuda --port 8011 > $OUT/serve.log 2>&1 &)
timeout 200 sh -c "until curl -sf http://127.0.0.1:8011/health >/dev/null; do sleep 2; done"
timeout 60 python3 tools/end_of_stream_repro.py --url http://127.0.0.1:8011 --rounds 1 --stall 60 > $OUT/repro.log 2>&1; tail -2 $OUT/repro.log
ps -eo pid,ppid,sid,stat,cmd | grep "[p]ython" | cut -c1-160
L=$(pgrep -f "[g]ateway.cli serve"); echo "launcher $L"; kill -9 $L
for t in $(seq 1 15); do sleep 1; echo "t=$t: $(pgrep -f '[s]tage_worker|[p]le_service|[g]ateway --config' | tr '\n' ' ')"; done
for p in $(pgrep -f "[s]tage_worker|[p]le_service|[g]ateway --config"); do echo "== $p"; tr '\0' ' ' < /proc/$p/cmdline | cut -c1-100; echo; grep -E "State|SigPnd|ShdPnd|SigBlk|SigCgt|Threads" /proc/$p/status; cat /proc/$p/wchan; echo; for t in /proc/$p/task/*; do echo "$(cat $t/comm) $(cat $t/wchan) $(grep SigBlk $t/status)"; done | sort | uniq -c | head -20; kill -USR2 $p; done
sleep 3; grep -v "^\s*$" $OUT/serve.log | tail -90 | cut -c1-200
for p in $(pgrep -f "[s]tage_worker|[p]le_service|[g]ateway --config"); do kill -9 $p; done
