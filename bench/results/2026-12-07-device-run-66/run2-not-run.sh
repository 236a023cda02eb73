# device call: sanitizers over the decode attention's split hand-over and the route kernel, the decode attention bench, ncu of dense decode at 128K and 384K
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/c2
nvidia-smi -L > $OUT/gpu.txt
s=$(date +%s)
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1
for t in racecheck synccheck; do
  (M3KIT_SMALL=1 CK_RUN_CASE=merge timeout ${T_SAN:-200} compute-sanitizer --tool $t --error-exitcode 9 ./check_attention_gpu > $OUT/san-att-$t.log 2>&1; echo "san att merge $t rc=$?") &
done
(M3KIT_SMALL=1 CK_RUN_CASE=route timeout ${T_SAN:-200} compute-sanitizer --tool racecheck --error-exitcode 9 ./check_ffn_gpu > $OUT/san-ffn-route-racecheck.log 2>&1; echo "san ffn route racecheck rc=$?") &
wait
echo "sanitizers done $(( $(date +%s) - s )) s"; grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|^[0-9]*%: Checks" $OUT/san-*.log
M3KIT_BENCH_CASE=decode timeout 150 ./m3kit bench --only attention --out $OUT/att.md > /tmp/att.log 2>&1; echo "bench rc=$? $(( $(date +%s) - s )) s"
grep -E "decode|Ceilings" $OUT/att.md
for c in "dense decode bf16 ctx 131072" "dense decode bf16 ctx 393216"; do
  M3KIT_BENCH_CASE="$c" timeout 90 ncu --clock-control none --set full -k regex:attn_dense --launch-skip 8 --launch-count 1 --page details ./m3kit bench --only attention --out /dev/null > "$OUT/ncu-$(echo $c | tr ' ' _).log" 2>&1
  echo "ncu $c rc=$? $(( $(date +%s) - s )) s"
done
grep -hE "Duration|DRAM Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Waves Per SM|Registers Per|Grid Size" $OUT/ncu-*.log
