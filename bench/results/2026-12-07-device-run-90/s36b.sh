# Session 36, any sm_90 card: the indexer's new tile merge=cluster.  GPU tests of it, then the tuner times
# cluster tiles against each batch-1 bucket's current (seed) tile, then a whole-step A/B at 8K and 128K of
# the seed against the tuned DB, then the every-tile test in what time is left.
set -u
pack() { cd $OUT && tar czf /tmp/all.tgz --exclude=gpu.txt . ; find . -mindepth 1 ! -name gpu.txt -exec rm -rf {} + 2>/dev/null; mv /tmp/all.tgz $OUT/; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
CK_RUN_CASE=decode_cluster timeout 150 ./check_indexer_gpu > $OUT/t-cluster.log 2>&1
echo "decode_cluster rc=$? at $(el) s: $(grep -E '^[0-9]+%: Checks' $OUT/t-cluster.log | tail -1)"; grep -E ":[FE]:" $OUT/t-cluster.log | head -3 | cut -c1-400
T=""
for c in alu hw; do for w in 4 8; do for d in 2 4; do for ch in 8 16 32; do for l in 1 2; do
  T="$T;warps=$w,depth=$d,waves=1,chunk=$ch,cvt=$c,lead=$l,merge=cluster"; done; done; done; done; done
timeout 260 ./m3kit tune --only index_decode --shapes tokens=1 --budget 230 --tiles "${T#;}" > $OUT/tune.log 2>&1
echo "tune rc=$? at $(el) s"; cp /tmp/cn/tuning/sm_90.json $OUT/db.json 2>/dev/null
./m3kit tune --show 2>/dev/null | grep -E "index_decode" | cut -c1-250
mkdir -p $OUT/ab
AB="seed:M3KIT_CACHE_DIR=/tmp/abseed;tuned:M3KIT_CACHE_DIR=/tmp/cn" AB_CONTEXTS=8192,131072 AB_ROUNDS=2 \
  M3KIT_CACHE_DIR=/tmp/abseed OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
left=$(( 560 - $(el) )); [ $left -gt 30 ] || exit 0
CK_RUN_CASE=decode_tiles timeout $left ./check_indexer_gpu > $OUT/t-tiles.log 2>&1
echo "decode_tiles rc=$? at $(el) s: $(grep -E '^[0-9]+%: Checks' $OUT/t-tiles.log | tail -1)"; grep -E ":[FE]:" $OUT/t-tiles.log | head -3 | cut -c1-400
