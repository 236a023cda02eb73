#!/bin/sh
# device-run.sh - everything one H200 session should measure, in one call:
#   ./bench/pack-device.sh here, then on the device (carry [".dev"]):
#   cd .dev && sh device-run.sh [tests|sanitize|tune|bench|run|all]...
# Logs and results go to $OUT (the device tool brings them back).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export M3KIT_CACHE_DIR=${M3KIT_CACHE_DIR:-/tmp/m3kit-cache}
export NCCL_NVLS_ENABLE=0
what=${*:-all}
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
has() { case " $what " in *" $1 "*|*" all "*) return 0;; esac; return 1; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if has tests; then
  for t in ./check_*_gpu; do
    [ -x "$t" ] || continue
    start=$(date +%s)
    timeout ${T_TEST:-300} "$t" > "$OUT/$(basename "$t").log" 2>&1
    rc=$?
    log "$(basename "$t") rc=$rc $(tail -n 1 "$OUT/$(basename "$t").log" | cut -c1-160) ($(( $(date +%s) - start )) s)"
  done
fi
if has sanitize; then
  for tool in memcheck racecheck initcheck synccheck; do
    M3KIT_SMALL=1 timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 ./check_qknorm_gpu > "$OUT/sanitize-$tool.log" 2>&1
    log "compute-sanitizer $tool qknorm rc=$? $(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitize-$tool.log") clean summaries"
  done
fi
if has tune; then
  timeout 540 ./m3kit tune --budget 480 > "$OUT/tune.log" 2>&1
  log "tune rc=$? $(tail -n 1 "$OUT/tune.log")"
  cp "$M3KIT_CACHE_DIR"/tuning/*.json "$OUT/" 2>/dev/null
fi
if has bench; then
  timeout 540 ./m3kit bench --out "$OUT/h200.md" > "$OUT/bench.log" 2>&1
  log "bench rc=$?"
fi
if has run; then
  (time timeout ${T_RUN:-300} ./m3kit run) > "$OUT/run-default.log" 2>&1
  log "run (embedded) rc=$? $(tail -n 3 "$OUT/run-default.log" | tr '\n' ' ')"
  (time timeout ${T_RUN:-300} ./m3kit run --preset minimax-m3 --context 131072 --max-new-tokens 32) > "$OUT/run-m3-128k.log" 2>&1
  log "run minimax-m3 128K rc=$? $(tail -n 3 "$OUT/run-m3-128k.log" | tr '\n' ' ')"
fi
cat "$OUT/summary.txt"
