# The next device call (written in session 31, not yet run): on the H200 if one comes.  Pack first
# (sh bench/pack-device.sh), then: cd .dev && sh next-run.sh   (copy this file into .dev/)
#  1. qk-norm + RoPE with the new template and its seed at every token count (the 80% target's card);
#  2. the decode attention's fixed cost split by attn_ablate.sh (dense bf16/e4m3 at 8K and 128K);
#  3. ncu of dense decode bf16 at 128K (on an H200: 76% of copy against the H100's 88%).
set -u
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
s=$(date +%s)
el() { echo $(( $(date +%s) - s )); }
nvidia-smi -L > $OUT/gpu.txt; cat $OUT/gpu.txt
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
timeout 150 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk bench rc=$? at $(el) s"
grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | cut -c1-140
CASES="d8k:attn_dense:dense decode bf16 ctx 8192:warps=8,ctas=1,depth=1,cvt=alu,lead=1,merge=acqrel;d128k:attn_dense:dense decode bf16 ctx 131072:warps=8,ctas=1,depth=1,cvt=alu,lead=0,merge=acqrel;e128k:attn_dense:dense decode e4m3 ctx 131072:warps=8,ctas=1,depth=2,cvt=hw,lead=1,merge=acqrel" \
  timeout 260 sh attn_ablate.sh --rounds 2 --out $OUT/aab --m3kit ./m3kit --templates ./templates > $OUT/aab.log 2>&1
echo "attn_ablate rc=$? at $(el) s"; cut -f1-3,5-8 $OUT/aab/ablate.tsv
left=$(( ${T_ALL:-570} - $(el) ))
[ $left -gt 40 ] && { M3KIT_BENCH_CASE="dense decode bf16 ctx 131072" timeout $left ncu --clock-control none --set full -k regex:attn_dense --launch-skip 8 --launch-count 1 --page details ./m3kit bench --only attention --out /dev/null > $OUT/ncu-dense-131072.log 2>&1; echo "ncu rc=$? at $(el) s";
  grep -hE "Duration|DRAM Throughput|SM Active Cycles|Elapsed Cycles|L2 Hit Rate  " $OUT/ncu-dense-131072.log; }
rm -rf $OUT/aab/tpl-*   # the rendered template copies (the device tool returns a few files only)
echo "done at $(el) s"
