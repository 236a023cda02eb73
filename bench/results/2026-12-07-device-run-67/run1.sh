# device call (session 31): tune the branch's qknorm_rope template for the seed (big buckets first), then
# check_qknorm_gpu and the attention-merge / ffn-route sanitizers side by side in what is left
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cnew
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
nvidia-smi -L > $OUT/gpu.txt
timeout 175 ./m3kit tune --only qknorm_rope --shapes tokens=256,1024,8192 --budget 150 > $OUT/tune-a.log 2>&1
echo "tune a rc=$? at $(el) s"; cp /tmp/cnew/tuning/sm_90.json $OUT/tuning-sm_90.json
timeout 100 ./m3kit tune --only qknorm_rope --shapes tokens=1,4,16,64 --budget 85 > $OUT/tune-b.log 2>&1
echo "tune b rc=$? at $(el) s"; cp /tmp/cnew/tuning/sm_90.json $OUT/tuning-sm_90.json
grep -h "^qknorm_rope" $OUT/tune-a.log $OUT/tune-b.log | cut -c1-40,100-260 | head -40
left=$(( ${T_ALL:-560} - $(el) ))
(timeout $left ./check_qknorm_gpu > $OUT/check_qknorm_gpu.log 2>&1; echo "check_qknorm_gpu rc=$? at $(el) s") &
for t in racecheck synccheck; do
  (M3KIT_SMALL=1 CK_RUN_CASE=merge timeout $left compute-sanitizer --tool $t --error-exitcode 9 ./check_attention_gpu > $OUT/san-att-merge-$t.log 2>&1; echo "san att merge $t rc=$? at $(el) s") &
done
(M3KIT_SMALL=1 CK_RUN_CASE=route timeout $left compute-sanitizer --tool racecheck --error-exitcode 9 ./check_ffn_gpu > $OUT/san-ffn-route-racecheck.log 2>&1; echo "san ffn route racecheck rc=$? at $(el) s") &
wait
tail -n 3 $OUT/check_qknorm_gpu.log; grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|^[0-9]*%: Checks" $OUT/san-*.log
echo "done at $(el) s"
