# Session 33's first device call (copy into .dev/ after bench/pack-device.sh; cd .dev && sh s33a.sh):
#  1. tune the qk-norm records at 256/1024/8192 tokens (the three the seed lacks, and their siblings);
#  2. the qk-norm bench with those records (the 80% target);
#  3. on an H200 only, the TPOT curve at 8K and 128K in what time is left (not measured on an H200
#     since session 24).
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
T=${S33_T:-570}
nvidia-smi -L > $OUT/gpu.txt; cat $OUT/gpu.txt
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
timeout 280 ./m3kit tune --only qknorm_rope --shapes tokens=256,1024,8192 --budget 230 > $OUT/tune.log 2>&1
echo "tune rc=$? at $(el) s"; tail -3 $OUT/tune.log
cp /tmp/cn/tuning/sm_90.json $OUT/qk.json
timeout 100 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk bench rc=$? at $(el) s"
grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | cut -c1-140
grep -q H200 $OUT/gpu.txt || exit 0
left=$(( T - $(el) ))
sh ./tpot_curve.sh --budget $left --no-torch --contexts 8192,131072 --m3kit ./m3kit --breakdown \
  --m3kit-args "--synthetic-cache" --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; grep -E '^\| [0-9]' $OUT/tpot/tpot_curve.md | cut -c1-200
rm -f $OUT/tpot/tpot_curve.png
cd $OUT/tpot && tar czf ../tpot-logs.tgz tpot-logs && rm -rf tpot-logs
