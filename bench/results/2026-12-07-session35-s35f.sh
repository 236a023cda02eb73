# Session 35, H200 call: on an H200 only (any other card stops at once; runs 83-86 have the H100's figures):
# the L2 prefetch default (24,16,0) against off at 8K and 128K, 2 rounds; the FFN / indexer / qk-norm /
# decode attention benches; the TPOT curve at 8K and 128K with the breakdown (prefetch default on).
set -u
pack() { cd $OUT && tar czf /tmp/all.tgz --exclude=gpu.txt . ; find . -mindepth 1 ! -name gpu.txt -exec rm -rf {} + 2>/dev/null; mv /tmp/all.tgz $OUT/; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
grep -q H200 $OUT/gpu.txt || { echo "not an H200: nothing to run"; exit 0; }
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
mkdir -p $OUT/ab
AB="off:M3KIT_L2_PREFETCH=0;dflt:" AB_CONTEXTS=8192,131072 AB_ROUNDS=2 OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
if true; then
  timeout 100 ./m3kit bench --only ffn --out $OUT/ffn.md > $OUT/ffn.log 2>&1; echo "ffn rc=$? at $(el) s"
  grep -E "^ffn  (W8A16 moe|W16A16 moe|W8A16 gemv [0-9]+x[0-9]+, n=1)" $OUT/ffn.md | sed -e 's/ffn  //' -e 's/, [0-9]* rotating//' | cut -c1-200
  timeout 90 ./m3kit bench --only indexer --out $OUT/idx.md > $OUT/idx.log 2>&1; echo "indexer rc=$? at $(el) s"
  grep -E '^\| batch' $OUT/idx.md | awk -F'|' '{print $2 "|" $3 "|" $10 "|" $13}'
  timeout 80 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk rc=$? at $(el) s"
  grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | grep -E '\| (1|64|8192) ' | cut -c1-140
  CTX=8192,131072
fi
M3KIT_BENCH_CASE=decode timeout 90 ./m3kit bench --only attention --out $OUT/att.md > $OUT/att.log 2>&1; echo "attention decode rc=$? at $(el) s"
grep -E '^\| (sparse|dense) decode' $OUT/att.md | awk -F'|' '{print $2 "|" $4 "|" $8 "|" $11}' | cut -c1-170
left=$(( 470 - $(el) ))
sh ./tpot_curve.sh --budget $left --no-torch --contexts $CTX --m3kit ./m3kit --breakdown \
  --m3kit-args "--synthetic-cache" --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; grep -E '^\| [0-9]' $OUT/tpot/tpot_curve.md | cut -c1-120
for f in $OUT/tpot/tpot-logs/m3kit-*.log; do echo "$f"; grep -E "^  (indexer|attn_sparse|attn_dense|moe |qkv_proj|o_proj|lm_head|whole)" "$f"; done
