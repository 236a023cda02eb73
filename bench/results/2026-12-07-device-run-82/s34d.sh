# Session 34, last call.  On an H200: the FFN bench graph-timed (MoE), the qk-norm and indexer benches, the
# decode attention rows, then the TPOT curve at 8K and 128K with the per-op breakdown, all with current main
# and its seed.  On any other card: the decode attention rows and the TPOT curve at 8K, 128K and 384K
# (e4m3 where bf16 does not fit) with the breakdown.
set -u
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
if grep -q H200 $OUT/gpu.txt; then
  timeout 100 ./m3kit bench --only ffn --out $OUT/ffn.md > $OUT/ffn.log 2>&1; echo "ffn rc=$? at $(el) s"
  grep -E "^ffn  (W8A16 moe|W16A16 moe|W8A16 gemv [0-9]+x[0-9]+, n=1)" $OUT/ffn.md | sed -e 's/ffn  //' -e 's/, [0-9]* rotating//' | cut -c1-200
  timeout 90 ./m3kit bench --only indexer --out $OUT/idx.md > $OUT/idx.log 2>&1; echo "indexer rc=$? at $(el) s"
  grep -E '^\| batch' $OUT/idx.md | awk -F'|' '{print $2 "|" $3 "|" $10 "|" $13}'
  timeout 80 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk rc=$? at $(el) s"
  grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | grep -E '\| (1|64|8192) ' | cut -c1-140
  CTX=8192,131072
else
  CTX=8192,131072,393216
fi
M3KIT_BENCH_CASE=decode timeout 90 ./m3kit bench --only attention --out $OUT/att.md > $OUT/att.log 2>&1; echo "attention decode rc=$? at $(el) s"
grep -E '^\| (sparse|dense) decode' $OUT/att.md | awk -F'|' '{print $2 "|" $4 "|" $8 "|" $11}' | cut -c1-170
left=$(( 500 - $(el) ))
sh ./tpot_curve.sh --budget $left --no-torch --contexts $CTX --m3kit ./m3kit --breakdown \
  --m3kit-args "--synthetic-cache" --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; grep -E '^\| [0-9]' $OUT/tpot/tpot_curve.md | cut -c1-120
for f in $OUT/tpot/tpot-logs/m3kit-*.log; do echo "$f"; grep -E "^  (indexer|attn_sparse|attn_dense|moe |qkv_proj|o_proj|lm_head|whole)" "$f"; done
rm -f $OUT/tpot/tpot_curve.png
cd $OUT/tpot && tar czf ../tpot-logs.tgz tpot-logs && rm -rf tpot-logs
