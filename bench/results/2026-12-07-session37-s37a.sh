# Session 37 (s36d.sh with ARMS and TB, the tune budget, from the environment), any sm_90 card: s36c.sh (rmsnorm cluster tiles: norm test, rmsnorm tune with M3KIT_MOE_FUSE=norm,
# whole-step A/B of seed / tuned / fused arms at 8K and 128K).  On an H200 the A/B also has the L2 prefetch
# off (session 35's default against off, never timed there), and the call ends with session 35's H200 items:
# the FFN bench (MoE graph-timed) and the TPOT curve at 8K and 128K with the breakdown (seed DB).
set -u
pack() { cd $OUT && tar czf /tmp/all.tgz --exclude=gpu.txt . ; find . -mindepth 1 ! -name gpu.txt -exec rm -rf {} + 2>/dev/null; mv /tmp/all.tgz $OUT/; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
h200=0; grep -q H200 $OUT/gpu.txt && h200=1
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
M3KIT_MOE_FUSE=norm ./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
CK_RUN_CASE=norm timeout 120 ./check_ffn_gpu > $OUT/t-norm.log 2>&1
echo "ffn norm rc=$? at $(el) s: $(grep -E '^[0-9]+%: Checks' $OUT/t-norm.log | tail -1)"; grep -E ":[FE]:" $OUT/t-norm.log | head -3 | cut -c1-300
M3KIT_MOE_FUSE=norm timeout 150 ./m3kit tune --only rmsnorm --shapes tokens=1 --budget ${TB:-120} > $OUT/tune.log 2>&1
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
A=${ARMS:-"seed:M3KIT_CACHE_DIR=/tmp/abseed;tuned:M3KIT_CACHE_DIR=/tmp/cn;fuse-seed:M3KIT_CACHE_DIR=/tmp/abseed M3KIT_MOE_FUSE=norm;fuse-tuned:M3KIT_CACHE_DIR=/tmp/cn M3KIT_MOE_FUSE=norm"}
[ $h200 = 1 ] && A="$A;pf-off:M3KIT_CACHE_DIR=/tmp/abseed M3KIT_L2_PREFETCH=0"
AB="$A" AB_CONTEXTS=${ABC:-8192,131072} AB_ROUNDS=${ABR:-2} M3KIT_CACHE_DIR=/tmp/abseed OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
M3KIT_MOE_FUSE=norm timeout 60 ./m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens 24 --context 8192 \
  --graph-breakdown --synthetic-cache > $OUT/bd-fuse-tuned.log 2>&1
echo "breakdown rc=$? at $(el) s"; grep -E "^  (input_norm|post_norm|moe |moe/combine|whole)|^TPOT" $OUT/bd-fuse-tuned.log
[ $h200 = 1 ] && [ $(el) -lt $(( ${DEADLINE:-565} - 120 )) ] || exit 0
export M3KIT_CACHE_DIR=/tmp/abseed
timeout 100 ./m3kit bench --only ffn --out $OUT/ffn.md > $OUT/ffn.log 2>&1; echo "ffn rc=$? at $(el) s"
grep -E "^ffn  (W8A16 moe|W16A16 moe|W8A16 gemv [0-9]+x[0-9]+, n=1)" $OUT/ffn.md | sed -e 's/ffn  //' -e 's/, [0-9]* rotating//' | cut -c1-200
left=$(( ${DEADLINE:-565} - $(el) )); [ $left -gt 60 ] || exit 0
sh ./tpot_curve.sh --budget $left --no-torch --contexts 8192,131072 --m3kit ./m3kit --breakdown \
  --m3kit-args "--synthetic-cache" --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; grep -E '^\| [0-9]' $OUT/tpot/tpot_curve.md | cut -c1-120
for f in $OUT/tpot/tpot-logs/m3kit-*.log; do echo "$f"; grep -E "^  (indexer|attn_sparse|moe |qkv_proj|o_proj|lm_head|l2_prefetch|whole)" "$f"; done
