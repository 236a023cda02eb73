# Session 37, any sm_90 card: (1) index_decode tile nf=acc (non-finite keys found from the mma accumulators
# instead of a scan of every key word): the GPU non-finite test, then a tune of every seed index_decode tile
# against itself with nf=acc at every batch-1 bucket; (2) s36d's rmsnorm cluster part, shortened (tune, A/B
# of seed / tuned / fused-tuned at 8K and 128K).
set -u
pack() { cd $OUT && tar czf /tmp/all.tgz --exclude=gpu.txt . ; find . -mindepth 1 ! -name gpu.txt -exec rm -rf {} + 2>/dev/null; mv /tmp/all.tgz $OUT/; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
CK_RUN_CASE=decode_nonfinite timeout 90 ./check_indexer_gpu > $OUT/t-nonfinite.log 2>&1
echo "nonfinite rc=$? at $(el) s: $(grep -E '^[0-9]+%: Checks' $OUT/t-nonfinite.log | tail -1)"; grep -E ":[FE]:" $OUT/t-nonfinite.log | head -3 | cut -c1-300
TILES=$(python3 - <<'PY'
import json, os
d = json.load(open("seed-sm_90.json"))
ts = []
for r in d["records"]:
    if r["key"].startswith("index_decode") and r["tile"] not in ts: ts.append(r["tile"])
out = []
for t in ts:
    out.append(t)
    a = t.replace("nf=scan", "nf=acc")
    out.append(a)
print(";".join(dict.fromkeys(out)))
PY
)
echo "$TILES" | tr ';' '\n' > $OUT/tiles.txt; echo "tiles: $(wc -l < $OUT/tiles.txt)"
timeout ${TI:-200} ./m3kit tune --only index_decode --shapes tokens=1 --tiles "$TILES" --budget ${TIB:-170} > $OUT/tune-idx.log 2>&1
echo "index tune rc=$? at $(el) s"; cp /tmp/cn/tuning/sm_90.json $OUT/db-idx.json 2>/dev/null
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/db-idx.json"))
for r in d["records"]:
    if not r["key"].startswith("index_decode"): continue
    c = [x for x in r["candidates"] if x.get("median_us")]
    def best(f): return min(((x["median_us"], x["tile"]) for x in c if f(x["tile"])), default=(0, "-"))
    s1, a1 = best(lambda t: "nf=scan" in t), best(lambda t: "nf=acc" in t)
    print(r["key"][13:23], r["bucket"], "| scan %.2f | acc %.2f | %s" % (s1[0], a1[0], a1[1]))
PY
rm -rf /tmp/cn
[ "${SKIP_NORM:-0}" = 1 ] && exit 0
M3KIT_MOE_FUSE=norm timeout 100 ./m3kit tune --only rmsnorm --shapes tokens=1 --budget ${TB:-80} > $OUT/tune.log 2>&1
echo "rms tune rc=$? at $(el) s"; cp /tmp/cn/tuning/sm_90.json $OUT/db.json 2>/dev/null
mkdir -p $OUT/ab
A="seed:M3KIT_CACHE_DIR=/tmp/abseed;tuned:M3KIT_CACHE_DIR=/tmp/cn;fuse-tuned:M3KIT_CACHE_DIR=/tmp/cn M3KIT_MOE_FUSE=norm;fuse-seed:M3KIT_CACHE_DIR=/tmp/abseed M3KIT_MOE_FUSE=norm"
AB="$A" AB_CONTEXTS=8192,131072 AB_ROUNDS=${ABR:-3} M3KIT_CACHE_DIR=/tmp/abseed OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
