# Session 36, any sm_90 card: rmsnorm's new tile axis cluster (a row over a thread-block cluster).  GPU test
# of the norm kernels (every tile), the tuner on rmsnorm at batch 1 (the combine=4 variant included:
# M3KIT_MOE_FUSE=norm), then a whole-step A/B at 8K and 128K: the seed, the tuned DB, and M3KIT_MOE_FUSE=norm
# with either, and a breakdown of the tuned fused arm.
set -u
pack() { cd $OUT && tar czf /tmp/all.tgz --exclude=gpu.txt . ; find . -mindepth 1 ! -name gpu.txt -exec rm -rf {} + 2>/dev/null; mv /tmp/all.tgz $OUT/; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
M3KIT_MOE_FUSE=norm ./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
CK_RUN_CASE=norm timeout 120 ./check_ffn_gpu > $OUT/t-norm.log 2>&1
echo "ffn norm rc=$? at $(el) s: $(grep -E '^[0-9]+%: Checks' $OUT/t-norm.log | tail -1)"; grep -E ":[FE]:" $OUT/t-norm.log | head -3 | cut -c1-300
M3KIT_MOE_FUSE=norm timeout 150 ./m3kit tune --only rmsnorm --shapes tokens=1 --budget 120 > $OUT/tune.log 2>&1
echo "tune rc=$? at $(el) s"; cp /tmp/cn/tuning/sm_90.json $OUT/db.json 2>/dev/null
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/db.json"))
for r in d["records"]:
    if not r["key"].startswith("rmsnorm"): continue
    c = [x for x in r["candidates"] if x.get("median_us")]
    b1 = min((x["median_us"], x["tile"]) for x in c if "cluster=1" in x["tile"])
    bc = min(((x["median_us"], x["tile"]) for x in c if "cluster=1" not in x["tile"]), default=(0, "-"))
    print(r["key"][8:42], r["bucket"], "win", r["tile"], "%.2f" % r["tuned_us"], "| best c1 %.2f %s | best c>1 %.2f %s" % (b1[0], b1[1], bc[0], bc[1]))
PY
mkdir -p $OUT/ab
AB="seed:M3KIT_CACHE_DIR=/tmp/abseed;tuned:M3KIT_CACHE_DIR=/tmp/cn;fuse-seed:M3KIT_CACHE_DIR=/tmp/abseed M3KIT_MOE_FUSE=norm;fuse-tuned:M3KIT_CACHE_DIR=/tmp/cn M3KIT_MOE_FUSE=norm" \
  AB_CONTEXTS=8192,131072 AB_ROUNDS=2 M3KIT_CACHE_DIR=/tmp/abseed OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
M3KIT_MOE_FUSE=norm timeout 60 ./m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens 24 --context 8192 \
  --graph-breakdown --synthetic-cache > $OUT/bd-fuse-tuned.log 2>&1
echo "breakdown rc=$? at $(el) s"; grep -E "^  (input_norm|post_norm|moe|moe/combine|whole)|^TPOT" $OUT/bd-fuse-tuned.log
