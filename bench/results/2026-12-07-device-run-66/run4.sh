# device call (last of session 30's budget): tune the new qknorm_rope template for the seed, big buckets first
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cnew
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
nvidia-smi -L > $OUT/gpu.txt
timeout 175 ./m3kit tune --only qknorm_rope --shapes tokens=256,1024,8192 --budget 150 > $OUT/tune-a.log 2>&1
echo "tune a rc=$? at $(el) s"; cp /tmp/cnew/tuning/sm_90.json $OUT/tuning-sm_90.json
left=$(( ${T_ALL:-255} - $(el) ))
if [ $left -gt 30 ]; then
  timeout $left ./m3kit tune --only qknorm_rope --shapes tokens=1,4,16,64 --budget $(( left - 15 )) > $OUT/tune-b.log 2>&1
  echo "tune b rc=$? at $(el) s"; cp /tmp/cnew/tuning/sm_90.json $OUT/tuning-sm_90.json
fi
./m3kit tune --show > $OUT/tune-show.txt 2>&1
grep -h "^qknorm_rope" $OUT/tune-a.log $OUT/tune-b.log | cut -c1-40,100-260
