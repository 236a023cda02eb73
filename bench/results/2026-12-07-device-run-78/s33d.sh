# Session 33: merge=cluster with its DSMEM loads batched (all splits' (m, l) and partials issued before any
# is used: two round trips where the first version's loads sat in a branch per split, 32 dependent ones).
# The tuner's candidates side by side again (acqrel, fence, cluster), and the new cluster records.
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
nvidia-smi -L > $OUT/gpu.txt; cat $OUT/gpu.txt
CK_RUN_CASE=merge timeout 60 ./check_attention_gpu > $OUT/t-merge.log 2>&1; echo "merge rc=$?"; grep Checks $OUT/t-merge.log | tail -1
timeout 200 ./m3kit tune --only attn_sparse,attn_dense --shapes tokens=1,8,32 --budget 150 > $OUT/tune.log 2>&1
echo "tune rc=$?"; tail -2 $OUT/tune.log
cp /tmp/cn/tuning/sm_90.json $OUT/db.json
python3 - $OUT/db.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['records']:
    if 'mode=decode' not in r['key']: continue
    best = {}
    for c in r.get('candidates') or []:
        if c.get('disposition') != 'PASSED': continue
        m = c['tile'].split('merge=')[1]
        if m not in best or c['median_us'] < best[m][0]: best[m] = (c['median_us'], c['tile'])
    w8 = [c['median_us'] for c in r.get('candidates') or [] if c.get('disposition') == 'PASSED' and c['tile'].startswith('warps=8,ctas=1,') and 'merge=cluster' in c['tile']]
    print(r['key'][:11], 'e4m3' if 'kv=e4m3' in r['key'] else 'bf16', r['bucket'], 'chosen', r['tile'].split('merge=')[1], '|',
          '  '.join('%s %.2f' % (m, t) for m, (t, tl) in sorted(best.items())), '| cluster w8 %.2f' % min(w8) if w8 else '')
PY
