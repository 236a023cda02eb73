# Session 33's H200 attempt: on an H200 only, the qk-norm bench (the seed's new records) and the whole-model
# TPOT curve at 8K and 128K (not measured on an H200 since session 24); on any other card check_attention_gpu's
# kernel case (its new cluster_plan_fits_the_part: the cluster width the driver places on this part).
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
T=${S33_T:-560}
nvidia-smi -L > $OUT/gpu.txt; cat $OUT/gpu.txt
if ! grep -q H200 $OUT/gpu.txt; then
  CK_RUN_CASE=kernel CK_VERBOSITY=verbose timeout 300 ./check_attention_gpu > $OUT/t-kernel.log 2>&1
  echo "check_attention_gpu kernel rc=$? at $(el) s"; grep -E "Checks|Failure|Error|cluster_plan" $OUT/t-kernel.log | head -6
  exit 0
fi
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
timeout 100 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk bench rc=$? at $(el) s"
grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | grep -E '\| (1|64|8192) ' | cut -c1-140
left=$(( T - $(el) ))
sh ./tpot_curve.sh --budget $left --no-torch --contexts 8192,131072 --m3kit ./m3kit --breakdown \
  --m3kit-args "--synthetic-cache" --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; grep -E '^\| [0-9]' $OUT/tpot/tpot_curve.md | cut -c1-200
rm -f $OUT/tpot/tpot_curve.png
cd $OUT/tpot && tar czf ../tpot-logs.tgz tpot-logs && rm -rf tpot-logs
