# device call: qknorm_rope template change (BAL, 32-bit slots, V skip): GPU test, full tune of the new template, A/B at 8192
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json
nvidia-smi -L > $OUT/gpu.txt
s=$(date +%s)
(time timeout 150 ./check_qknorm_gpu) > $OUT/qktest.log 2>&1; echo "qk test rc=$? $(grep -E '^[0-9]+%' $OUT/qktest.log | tail -1) $(( $(date +%s) - s )) s"
(time M3KIT_CACHE_DIR=/tmp/cnew timeout 300 ./m3kit tune --only qknorm_rope --budget ${T_FULL:-230}) > $OUT/tune-new-full.log 2>&1; echo "full tune rc=$? $(( $(date +%s) - s )) s"
cp /tmp/cnew/tuning/sm_90.json $OUT/tuning-new-sm_90.json
M3KIT_CACHE_DIR=/tmp/cnew ./m3kit tune --show > $OUT/tune-new-show.txt 2>&1
sh template_ab.sh --family qknorm_rope --shapes tokens=8192 --bench qknorm_rope --case tokens=8192 --budget 60 --rounds 2 --out /tmp/qk old=tpl-old new=-
echo "ab done $(( $(date +%s) - s )) s"
cat /tmp/qk/ab.md
(cd /tmp && tar czf $OUT/qk.tgz qk)
