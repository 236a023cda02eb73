# Session 35, call 3 (any card): where the L2 prefetch branches gain and lose (run 83: o_proj -0.19 and the
# MoE -0.58 ms in the step, but the step +0.4 ms).  A/B at 8K, 3 rounds interleaved: off; o_proj + FFN phases
# (16,16,0) with the bulk kernel on 4 / 16 / 32 CTAs and with per-line prefetches (tpl-lines: a warp an item,
# 16 CTAs); each phase alone (bulk, 4 CTAs); all three with lines.  Then the breakdown, off and lines 16,16,0.
set -u
pack() { cd $OUT && tar czf /tmp/all.tgz --exclude=gpu.txt . ; find . -mindepth 1 ! -name gpu.txt -exec rm -rf {} + 2>/dev/null; mv /tmp/all.tgz $OUT/; }
trap pack EXIT
nvidia-smi -L | tee $OUT/gpu.txt
s=$(date +%s); el() { echo $(( $(date +%s) - s )); }
export M3KIT_SEED_DB=$PWD/seed-sm_90.json M3KIT_CACHE_DIR=/tmp/cn
./m3kit gen --all -j 16 > /tmp/genall.log 2>&1; echo "gen --all rc=$? at $(el) s"
CK_RUN_CASE=l2_prefetch timeout 60 ./check_forward_gpu > $OUT/test.log 2>&1; echo "check_forward_gpu l2_prefetch rc=$? at $(el) s"
mkdir -p $OUT/ab
P=M3KIT_L2_PREFETCH T=M3KIT_TEMPLATE_DIR=$PWD
AB="off:$P=0;ab4:$P=16,16,0;a24b16:$P=24,16,0" \
  AB_CONTEXTS=131072,8192 AB_ROUNDS=3 OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
for arm in "off:$P=0" "ab4:$P=16,16,0"; do
  nm=${arm%%:*}; env ${arm#*:} timeout 100 ./m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens 32 --context 8192 \
    --synthetic-cache --graph-breakdown > $OUT/bd-$nm.log 2>&1; echo "breakdown $nm rc=$? at $(el) s"
done
for nm in off ab4; do echo "== $nm"; grep -E "^  (qkv_proj|qknorm_rope|indexer|attn_sparse|o_proj|post_norm|moe|l2_prefetch|whole)" $OUT/bd-$nm.log | grep -v "moe/"; done
