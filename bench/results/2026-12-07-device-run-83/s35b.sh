# Session 35, call 2 (any card).  1) check_forward_gpu's l2_prefetch case on the GPU (the branches change no
# value);  2) a whole-step A/B of M3KIT_L2_PREFETCH (off / 8 / 16 / 24 MB a phase) at 8K and 128K, 3 rounds
# interleaved;  3) the graph breakdown at 8K with 16 MB (its l2_prefetch row: what the branches save);
# 4) on an H200 only: the FFN / indexer / qk-norm / decode-attention benches and the TPOT curve (s35a.sh).
set -u
# $OUT brings back at most 8 files: everything but gpu.txt goes into one archive at exit
pack() { cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=gpu.txt . && find . -mindepth 1 ! -name all.tgz ! -name gpu.txt -exec rm -rf {} + ; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
CK_RUN_CASE=l2_prefetch timeout 120 ./check_forward_gpu > $OUT/test.log 2>&1; echo "check_forward_gpu l2_prefetch rc=$? at $(el) s"; tail -2 $OUT/test.log
mkdir -p $OUT/ab
AB="off:M3KIT_L2_PREFETCH=0;p8:M3KIT_L2_PREFETCH=8;p16:M3KIT_L2_PREFETCH=16;p24:M3KIT_L2_PREFETCH=24" \
  AB_CONTEXTS=8192,131072 AB_ROUNDS=3 OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //'
M3KIT_L2_PREFETCH=16 timeout 150 ./m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens 32 --context 8192 \
  --synthetic-cache --graph-breakdown > $OUT/bd16.log 2>&1; echo "breakdown rc=$? at $(el) s"
grep -E "^TPOT|^  (qkv_proj|o_proj|moe |moe/gate_up|lm_head|l2_prefetch|indexer|attn_sparse|whole)" $OUT/bd16.log
grep -q H200 $OUT/gpu.txt || exit 0
if true; then
  timeout 100 ./m3kit bench --only ffn --out $OUT/ffn.md > $OUT/ffn.log 2>&1; echo "ffn rc=$? at $(el) s"
  grep -E "^ffn  (W8A16 moe|W16A16 moe|W8A16 gemv [0-9]+x[0-9]+, n=1)" $OUT/ffn.md | sed -e 's/ffn  //' -e 's/, [0-9]* rotating//' | cut -c1-200
  timeout 90 ./m3kit bench --only indexer --out $OUT/idx.md > $OUT/idx.log 2>&1; echo "indexer rc=$? at $(el) s"
  grep -E '^\| batch' $OUT/idx.md | awk -F'|' '{print $2 "|" $3 "|" $10 "|" $13}'
  timeout 80 ./m3kit bench --only qknorm_rope --out $OUT/qk.md > $OUT/qk.log 2>&1; echo "qk rc=$? at $(el) s"
  grep -E '^\| `' $OUT/qk.md | awk -F'|' '{print $2 "|" $3 "|" $8 "|" $11}' | sed 's/qknorm_rope//' | grep -E '\| (1|64|8192) ' | cut -c1-140
  CTX=8192,131072
fi
M3KIT_BENCH_CASE=decode timeout 90 ./m3kit bench --only attention --out $OUT/att.md > $OUT/att.log 2>&1; echo "attention decode rc=$? at $(el) s"
grep -E '^\| (sparse|dense) decode' $OUT/att.md | awk -F'|' '{print $2 "|" $4 "|" $8 "|" $11}' | cut -c1-170
left=$(( 560 - $(el) ))
sh ./tpot_curve.sh --budget $left --no-torch --contexts $CTX --m3kit ./m3kit --breakdown \
  --m3kit-args "--synthetic-cache" --out $OUT/tpot > $OUT/tpot.log 2>&1
echo "tpot rc=$? at $(el) s"; grep -E '^\| [0-9]' $OUT/tpot/tpot_curve.md | cut -c1-120
for f in $OUT/tpot/tpot-logs/m3kit-*.log; do echo "$f"; grep -E "^  (indexer|attn_sparse|attn_dense|moe |qkv_proj|o_proj|lm_head|whole)" "$f"; done
