# device call (session 31): qknorm_rope A/B at 8192 tokens, old template (main) against the branch's, each
# tuned from empty; then the decode attention bench and ncu of dense decode bf16 at 128K and 8K
set -u
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
nvidia-smi -L > $OUT/gpu.txt
timeout 420 sh template_ab.sh --family qknorm_rope --shapes tokens=8192 --bench qknorm_rope --case tokens=8192 \
  --budget ${AB_BUDGET:-150} --rounds 2 --out $OUT/qk old=tpl-old new=-
echo "ab rc=$? at $(el) s"
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/c2
left=$(( ${T_ALL:-570} - $(el) ))
[ $left -gt 40 ] && { M3KIT_BENCH_CASE=decode timeout $left ./m3kit bench --only attention --out $OUT/att.md > $OUT/att.log 2>&1; echo "bench rc=$? at $(el) s"; grep -E "decode|Ceil|copy" $OUT/att.md | head -30; }
left=$(( ${T_ALL:-570} - $(el) ))
for c in 131072 8192 1048576; do
  left=$(( ${T_ALL:-570} - $(el) ))
  [ $left -gt 40 ] && { M3KIT_BENCH_CASE="dense decode bf16 ctx $c" timeout $left ncu --clock-control none --set full -k regex:attn_dense --launch-skip 8 --launch-count 1 --page details ./m3kit bench --only attention --out /dev/null > $OUT/ncu-dense-$c.log 2>&1; echo "ncu $c rc=$? at $(el) s";
    grep -hE "Duration|DRAM Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Waves Per SM|Registers Per|Grid Size|Block Size" $OUT/ncu-dense-$c.log; }
done
echo "done at $(el) s"
