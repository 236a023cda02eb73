# Session 32's first device call: on an H200 the whole-model TPOT curve (not re-measured on an H200 since
# session 24; lead-ins, router ksplit, qk-norm since) and the qk-norm bench with the new template; on an H100
# next-run.sh (qk-norm bench, attention ablation, ncu of dense decode at 128K).
set -u
nvidia-smi -L > $OUT/gpu.txt; cat $OUT/gpu.txt
T=${S32_T:-575}
if ! grep -q H200 $OUT/gpu.txt; then T_ALL=$((T - 15)) sh next-run.sh; exit; fi  # ../2026-12-07-device-run-67/next-run.sh
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
timeout 120 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk bench rc=$? at $(el) s"
grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | cut -c1-140
left=$(( T - $(el) ))
sh ./tpot_curve.sh --budget $left --torch-budget 100 --m3kit ./m3kit --breakdown --m3kit-args "--synthetic-cache" \
  --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; cat $OUT/tpot/tpot_curve.md | grep -E '^\| [0-9]' | cut -c1-200
rm -f $OUT/tpot/tpot_curve.png
cd $OUT/tpot && tar czf ../tpot-logs.tgz tpot-logs && rm -rf tpot-logs
