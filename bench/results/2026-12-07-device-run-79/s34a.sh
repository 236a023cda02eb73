# Session 34, first call: on an H200 the qk-norm bench and the TPOT curve at 8K/128K with main (s33c.sh);
# on any other card the batched-load cluster merge (p/: main + cluster-batched-loads.patch) instead.
set -u
nvidia-smi -L | tee $OUT/gpu0.txt
if grep -q H200 $OUT/gpu0.txt; then S33_T=540 sh s33c.sh; else mkdir -p $OUT/p; cd p && OUT=$OUT/p sh s33d.sh; fi
