# Second call while warm (session 32): ncu of the decode indexer at 1M, e4m3 against bf16 - is the
# e4m3 stream (3.65 TB/s against bf16's 4.13 past the fixed cost, h200.md) issue-bound (decode to fp16)?
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
s=$(date +%s)
nvidia-smi -L > $OUT/gpu2.txt; cat $OUT/gpu2.txt
[ -d /tmp/cn ] || { ./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$?"; }
for ix in e4m3 bf16; do
  M3KIT_BENCH_CASE="batch 1, 1048576 $ix" timeout 110 ncu --clock-control none --set full -k regex:index_decode \
    --launch-skip 8 --launch-count 1 --page details ./m3kit bench --only indexer --out /dev/null > $OUT/ncu-idx-$ix-1m.log 2>&1
  echo "== $ix rc=$? at $(( $(date +%s) - s )) s"
  grep -hE "  (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|SM Busy|Registers Per Thread|Achieved Occupancy|No Eligible|Issued Warp Per Scheduler|Block Limit Registers|Waves Per SM|Grid Size)" $OUT/ncu-idx-$ix-1m.log
  grep -hiE "pipe|bound|stall" $OUT/ncu-idx-$ix-1m.log | grep -v "^\s*$" | head -12 | cut -c1-220
done
