# device call: full qknorm_rope tune of the new template (seed records), A/B at 8192 against the old template on the seed, then racecheck/synccheck of the attention split hand-over
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
nvidia-smi -L > $OUT/gpu.txt
M3KIT_CACHE_DIR=/tmp/cnew timeout ${T_FULL:-260} ./m3kit tune --only qknorm_rope --budget $(( ${T_FULL:-260} - 25 )) > $OUT/tune-new-full.log 2>&1
echo "full tune rc=$? at $(el) s"; tail -n 12 $OUT/tune-new-full.log | cut -c1-40,100-250
cp /tmp/cnew/tuning/sm_90.json $OUT/tuning-new-sm_90.json
mkdir -p /tmp/qk
for r in 1 2; do
  M3KIT_CACHE_DIR=/tmp/cold M3KIT_TEMPLATE_DIR=$PWD/tpl-old M3KIT_BENCH_CASE=tokens=8192 ./m3kit bench --only qknorm_rope --out /tmp/qk/old-$r.md > /tmp/qk/old-$r.log 2>&1
  M3KIT_CACHE_DIR=/tmp/cnew M3KIT_BENCH_CASE=tokens=8192 ./m3kit bench --only qknorm_rope --out /tmp/qk/new-$r.md > /tmp/qk/new-$r.log 2>&1
  echo "bench round $r at $(el) s"
done
for f in /tmp/qk/old-1.md /tmp/qk/new-1.md /tmp/qk/old-2.md /tmp/qk/new-2.md; do echo "## $f"; grep -E '^\| `' $f | awk -F'|' '{print $2 "|" $4 "|" $8 "|" $11}'; done
(cd /tmp && tar czf $OUT/qk3.tgz qk)
left=$(( ${T_ALL:-540} - $(el) ))
if [ $left -gt 60 ]; then
  for t in racecheck synccheck; do
    (M3KIT_CACHE_DIR=/tmp/cnew M3KIT_SMALL=1 CK_RUN_CASE=merge timeout $left compute-sanitizer --tool $t --error-exitcode 9 ./check_attention_gpu > $OUT/san-att-merge-$t.log 2>&1; echo "sanitize attention merge $t rc=$? at $(el) s") &
  done
  wait
  grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|^[0-9]*%: Checks" $OUT/san-att-*.log
fi
echo "done at $(el) s"
