# Session 34, call 3: index_decode tile ring=1 (keys in flight in a cp.async ring in shared memory) on the GPU:
# its tests, the seed's batch-1 tiles against ring=1 variants of them (m3kit tune --tiles), the indexer bench
# with what that tune chose, every valid tile, and racecheck of the ring's test case.
set -u
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_CACHE_DIR=/tmp/cn M3KIT_SEED_DB=$PWD/seed-sm_90.json
for c in decode_splits decode_nonfinite; do
  CK_RUN_CASE=$c timeout 120 ./check_indexer_gpu > $OUT/t-$c.log 2>&1
  echo "$c rc=$? $(grep -E '^[0-9]+%: Checks' $OUT/t-$c.log | tail -1) at $(el) s"; grep -E ':F:|:E:' $OUT/t-$c.log | head -3
done
timeout 200 ./m3kit tune --only index_decode --shapes tokens=1 --tiles "$(cat ringtiles.txt)" --budget 170 > $OUT/tune.log 2>&1
echo "tune rc=$? at $(el) s"; cp /tmp/cn/tuning/sm_90.json $OUT/db.json
python3 - $OUT/db.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['records']:
    if not r['key'].startswith('index_decode'): continue
    best = {}
    for c in r.get('candidates') or []:
        if c.get('disposition') != 'PASSED': continue
        g = c['tile'][-6:]
        if g not in best or c['median_us'] < best[g][0]: best[g] = (c['median_us'], c['tile'])
    print(r['key'][13:22], r['bucket'], 'chosen', r['tile'], '|', '  '.join('%s %.2f (%s)' % (g, t, tl.split(',')[0] + ',' + tl.split(',')[1]) for g, (t, tl) in sorted(best.items())))
PY
timeout 150 ./m3kit bench --only indexer --out $OUT/idx.md > $OUT/idx.log 2>&1; echo "indexer bench rc=$? at $(el) s"
grep -E '^\| batch' $OUT/idx.md | awk -F'|' '{print $2 "|" $3 "|" $6 "|" $10 "|" $13}'
left=$(( 560 - $(el) ))
[ $left -gt 60 ] && { CK_RUN_CASE=decode_tiles timeout $(( left / 2 )) ./check_indexer_gpu > $OUT/t-tiles.log 2>&1; echo "decode_tiles rc=$? $(grep -E '^[0-9]+%: Checks' $OUT/t-tiles.log | tail -1) at $(el) s"; }
left=$(( 570 - $(el) ))
[ $left -gt 40 ] && { CK_RUN_CASE=decode_splits timeout $left compute-sanitizer --tool racecheck ./check_indexer_gpu > $OUT/race.log 2>&1; echo "racecheck rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/race.log | tail -1) $(grep -E '^[0-9]+%: Checks' $OUT/race.log | tail -1) at $(el) s"; }
