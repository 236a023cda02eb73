# Session 33's second device call: the decode attention's merge=cluster tile (thread-block cluster,
# partials through distributed shared memory) on a GPU for the first time.
#  1. check_attention_gpu's merge case (fence, acqrel and cluster over many splits, against the reference);
#  2. tune attn_sparse decode at batch 1 and 32: every tile, cluster among them, timed side by side;
#  3. check_attention_gpu's tiles case (every valid tile, cluster ones included) in the time left.
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
T=${S33_T:-570}
nvidia-smi -L > $OUT/gpu.txt; cat $OUT/gpu.txt
CK_RUN_CASE=merge timeout 120 ./check_attention_gpu > $OUT/t-merge.log 2>&1
echo "check_attention_gpu merge rc=$? at $(el) s"; grep -E "Checks|Failure|Error" $OUT/t-merge.log | head -5
timeout 230 ./m3kit tune --only attn_sparse --shapes tokens=1,32 --budget ${S33_TUNE:-170} > $OUT/tune-as.log 2>&1
echo "tune attn_sparse rc=$? at $(el) s"; tail -2 $OUT/tune-as.log
cp /tmp/cn/tuning/sm_90.json $OUT/as.json
python3 - $OUT/as.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['records']:
    if not r['key'].startswith('attn_sparse(mode=decode'): continue
    best = {}
    for c in r.get('candidates') or []:
        if c.get('disposition') != 'PASSED': continue
        m = c['tile'].split('merge=')[1]
        if m not in best or c['median_us'] < best[m][0]: best[m] = (c['median_us'], c['tile'])
    kv = 'e4m3' if 'kv=e4m3' in r['key'] else 'bf16'
    print(kv, r['bucket'], 'chosen', r['tile'], '|', '  '.join('%s %.2f us (%s)' % (m, t, tl) for m, (t, tl) in sorted(best.items())))
PY
left=$(( T - $(el) ))
CK_RUN_CASE=tiles timeout $left ./check_attention_gpu > $OUT/t-tiles.log 2>&1
echo "check_attention_gpu tiles rc=$? at $(el) s"; grep -E "Checks|Failure|Error" $OUT/t-tiles.log | head -5
