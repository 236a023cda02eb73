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
AB="off:$P=0;ab4:$P=16,16,0;ab16:$P=16,16,0 ${T}/tpl-c16;ab32:$P=16,16,0 ${T}/tpl-c32;abL:$P=16,16,0 ${T}/tpl-lines;a4:$P=16,0,0;b4:$P=0,16,0;d4:$P=0,0,16;abdL:$P=16,16,16 ${T}/tpl-lines;abLnp:$P=16,16,0 ${T}/tpl-linesnp;ab24L:$P=24,24,0 ${T}/tpl-lines" \
  AB_CONTEXTS=8192 AB_ROUNDS=3 OUT=$OUT/ab sh device-run.sh ab > /dev/null 2>&1
echo "ab rc=$? at $(el) s"; grep "^== ab" $OUT/ab/summary.txt | sed -e 's/(mean of 30.*//' -e 's/^== ab //' -e 's/ rc=0//'
for arm in "off:$P=0" "abL:$P=16,16,0 ${T}/tpl-lines"; do
  nm=${arm%%:*}; env ${arm#*:} timeout 100 ./m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens 32 --context 8192 \
    --synthetic-cache --graph-breakdown > $OUT/bd-$nm.log 2>&1; echo "breakdown $nm rc=$? at $(el) s"
done
paste <(sed -n '/^  op  /,$p' $OUT/bd-off.log | cut -c1-50) <(sed -n '/^  op  /,$p' $OUT/bd-abL.log | cut -c19-50)
