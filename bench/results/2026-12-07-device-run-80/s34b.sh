# Session 34, call 2 (any card): the FFN bench with its new graph timing (MoE W8A16 / W16A16 and the dense
# GEMVs), a re-tune of the sparse batch-1 attention buckets with the one-clock tuner, and a whole-step A/B at
# 8K of the seed before this session (acqrel at batch 1) against now (merge=cluster with batched loads).
set -u
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_CACHE_DIR=/tmp/cn M3KIT_SEED_DB=$PWD/seed-sm_90.json
./m3kit gen --all -j 16 > /tmp/g.log 2>&1; echo "gen rc=$? at $(el) s"
timeout 170 ./m3kit bench --only ffn --out $OUT/ffn.md > $OUT/ffn.log 2>&1; echo "ffn bench rc=$? at $(el) s"
grep -E "^ffn  (W8A16|W16A16|fp32)" $OUT/ffn.md | sed -e 's/ffn  //' -e 's/, [0-9]* rotating//' | cut -c1-230
timeout 110 ./m3kit tune --only attn_sparse --shapes tokens=1 --budget 80 > $OUT/tune.log 2>&1; echo "tune rc=$? at $(el) s"
grep -E "^attn_sparse" $OUT/tune.log | cut -c1-60,100-135,170-260; cp /tmp/cn/tuning/sm_90.json $OUT/db.json
unset M3KIT_SEED_DB
mkdir -p $OUT/ab
AB="old:M3KIT_SEED_DB=$PWD/seed-before.json;new:M3KIT_SEED_DB=$PWD/seed-sm_90.json" AB_CONTEXTS=8192 AB_ROUNDS=3 \
  M3KIT_CACHE_DIR=/tmp/abc OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed 's/(mean of 30.*//'
