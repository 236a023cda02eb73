#!/bin/sh
# pack-device.sh [BUILD_DIR] - copy the programs a GPU session needs into .dev/
# (git-ignored; name it in the device tool's `carry`).  Everything m3kit links
# statically except the CUDA toolkit libraries, which the GPU machine has, and
# libcuda, which is loaded at run time; so binaries built here run there.
set -eu
cd "$(dirname "$0")/.."
b=${1:-build}
mkdir -p .dev
# `make check` with no tests builds m3kit (check depends on all) and the GPU
# tests (check programs) before anything is copied: a copy of a build older
# than the sources would run old kernels (the templates are embedded).
make -C "$b" -s check TESTS= > /dev/null
cp "$b/m3kit" .dev/
n=0
for t in "$b"/tests/check_*_gpu; do
  [ -x "$t" ] && cp "$t" .dev/ && n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "pack-device.sh: no GPU test programs under $b/tests" >&2; exit 1; }
echo "pack-device.sh: m3kit and $n GPU test programs"
cp bench/device-run.sh .dev/
cp cache/seed/sm_90.json .dev/seed-sm_90.json   # the seed tuning DB (device-run.sh points M3KIT_SEED_DB at it)
for f in bench/baseline_torch.py bench/tpot_curve.sh bench/tp_tpot.sh bench/indexer_ablate.sh bench/gemv_ablate.sh bench/attn_ablate.sh bench/ablate_common.sh bench/template_ab.sh; do [ -f "$f" ] && cp "$f" .dev/; done
rm -rf .dev/templates && cp -r templates .dev/templates   # indexer_ablate.sh, gemv_ablate.sh render edited copies of them
du -sh .dev
