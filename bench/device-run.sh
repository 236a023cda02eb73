#!/bin/sh
# device-run.sh - everything one H200 session should measure, in one call:
#   ./bench/pack-device.sh here, then on the device (carry [".dev"]):
#   cd .dev && sh device-run.sh [tests] [sanitize] [ablate] [gablate] [aablate] [tune] [tune2] [bench] [bench-insert] [run] [ncu] [torch] [run1m] [tpot] [ab] [tp] [all]
# Correctness work (tests, sanitizers) runs concurrently: it only needs
# answers, and a device call is limited to 10 minutes.  Timed work (tune,
# bench, run, tpot) runs alone, one after the other.  Every log is packed
# into $OUT/device-run.tar.gz (the device tool returns a few files only) and
# the one-line results are also in $OUT/summary.txt.
# Time limits (seconds): T_TEST (each test and sanitizer run, default 280),
# TPOT_PDL=1 (the TPOT curve again with M3KIT_PDL=0, PDL off), T_TUNE (480; T_TUNE2 for the second tune; TUNE_ARGS more tune options, e.g. --only mxfp8; TUNE2_ARGS the second tune's, default TUNE_ARGS), T_BENCH (240), T_RUN (150), T_TPOT (300),
# T_TP (520: the whole tp phase, its test and then tp_tpot.sh in what is left; TP_LIST, TP_CONTEXTS,
# TP_BATCHES narrow the sweep, TP_ARGS adds tp_tpot.sh options, e.g. "--append --timing-only", TP_PREV an
# earlier call's tp/ output for --append).  TESTS and SANITIZE
# narrow the test programs (default: every ./check_*_gpu; the five kernel ones); TEST_ENV="VAR=1 ..." is the
# plain tests' environment (e.g. M3KIT_PDL=0), not the sanitizers' or the tune's; a SANITIZE entry
# PROGRAM:CASE sanitizes one test case (CK_RUN_CASE) of it; SAN_TOOLS narrows the tools, PROGRAM[:CASE]@T1+T2
# gives one entry its own; SAN_ARGS adds compute-sanitizer options (e.g. --print-limit 20).
# Never run two device-run.sh at once: each packs and then empties $OUT.
set -u
OUT=${OUT:-/tmp/out}
L=$OUT/logs
mkdir -p "$L"
export M3KIT_CACHE_DIR=${M3KIT_CACHE_DIR:-/tmp/m3kit-cache}
export NCCL_NVLS_ENABLE=0
# The seed tuning DB travels with the binaries (the build's source-tree path does not exist here).
[ -f ./seed-sm_90.json ] && export M3KIT_SEED_DB=${M3KIT_SEED_DB:-$PWD/seed-sm_90.json}
what=${*:-all}
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
has() { case " $what " in *" $1 "*|*" all "*) return 0;; esac; return 1; }
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$L/gpu.txt"
# Warm the cubin cache once, so concurrent tests do not all cold-compile.
rm -rf "$M3KIT_CACHE_DIR"
( time ./m3kit gen --all --arch sm_90 -j 16 ) > "$L/gen-all-cold.log" 2>&1
log "gen --all cold (every minimax-m3 variant, 16 jobs) rc=$? $(grep -E 'real|compiled|variants' "$L/gen-all-cold.log" | tr '\n' ' ')"
( time ./m3kit gen --all --arch sm_90 ) > "$L/gen-all-warm.log" 2>&1
log "gen --all warm rc=$? $(grep -E 'real|compiled|variants' "$L/gen-all-warm.log" | tr '\n' ' ')"

pids=""
if has tests; then
  for t in ${TESTS:-./check_*_gpu}; do
    [ -x "$t" ] || { log "$t: not packed (bench/pack-device.sh builds and copies the GPU tests): not run"; continue; }
    # The FFN side's nine kernel families and the indexer's test cases run as
    # separate processes (CK_RUN_CASE); FFN_CASES / INDEXER_CASES narrow them.
    cases=-
    [ "$t" = ./check_ffn_gpu ] && cases=${FFN_CASES:-"norm embed route swiglu combine mxfp8 gemv gemv_tiles gemv_ring gemv_epi gemv_lead moe sample"}
    [ "$t" = ./check_indexer_gpu ] && cases=${INDEXER_CASES:-"decode_mixed decode_spec decode_splits decode_ties decode_nonfinite decode_1m decode_2gib decode_tiles prefill faults"}
    for c in $cases; do
      n=$(basename "$t"); [ "$c" = - ] || n=$n-$c
      ( s=$(date +%s)
        if [ "$c" = - ]; then env ${TEST_ENV:-} timeout "${T_TEST:-280}" "$t"; else env ${TEST_ENV:-} CK_RUN_CASE=$c timeout "${T_TEST:-280}" "$t"; fi > "$L/$n.log" 2>&1
        rc=$?
        log "$n rc=$rc $(grep -E '^[0-9]+%: Checks' "$L/$n.log" | tail -n 1) ($(( $(date +%s) - s )) s)" ) &
      pids="$pids $!"
    done
  done
fi
if has sanitize; then
  # M3KIT_SMALL=1: the tests' reduced shapes (tests/gpu_main.h).
  for ent in ${SANITIZE:-./check_qknorm_gpu ./check_indexer_gpu ./check_attention_gpu ./check_ffn_gpu ./check_forward_gpu ./check_tune_gpu ./check_tp_forward_gpu}; do
    # PROGRAM[:CASE][@TOOL+TOOL]: one CK_RUN_CASE of it, with its own tools
    tools=${SAN_TOOLS:-memcheck racecheck initcheck synccheck}
    case $ent in *@*) tools=$(echo "${ent#*@}" | tr + ' '); ent=${ent%%@*};; esac
    t=${ent%%:*} cs=; [ "$t" != "$ent" ] && cs=${ent#*:}
    [ -x "$t" ] || { log "$t: not packed: not sanitized"; continue; }
    for tool in $tools; do
      n=sanitize-$tool-$(basename "$t")${cs:+-$cs}
      ( env M3KIT_SMALL=1 ${cs:+CK_RUN_CASE=$cs} timeout "${T_TEST:-280}" compute-sanitizer --tool $tool --error-exitcode 9 ${SAN_ARGS:-} "$t" > "$L/$n.log" 2>&1
        rc=$?
        log "$n rc=$rc $(grep -E 'ERROR SUMMARY' "$L/$n.log" | tail -n 1) $(grep -E '^[0-9]+%: Checks' "$L/$n.log" | tail -n 1)" ) &
      pids="$pids $!"
    done
  done
fi
[ -n "$pids" ] && wait $pids
log "correctness phase done at $(elapsed) s"

if has ablate && [ -f ./indexer_ablate.sh ] && [ -d ./templates ]; then
  # Where the decode indexer's time goes: each case's tile with one stage cut
  # out, and the merge/lead variants (indexer_ablate.sh; ABLATE_ROUNDS,
  # ABLATE_CASES, ABLATE_VARIANTS narrow it).  Its own cubin cache and no
  # tuning DB, so nothing it builds reaches the later steps.
  CASES=${ABLATE_CASES:-} VARIANTS=${ABLATE_VARIANTS:-} timeout "${T_ABLATE:-240}" sh ./indexer_ablate.sh \
    --rounds "${ABLATE_ROUNDS:-1}" --out "$OUT/ablate" --m3kit ./m3kit --templates ./templates > "$L/ablate.log" 2>&1
  log "ablate rc=$? at $(elapsed) s"
  cp "$OUT/ablate/ablate.tsv" "$L/" 2>/dev/null
fi
if has gablate && [ -f ./gemv_ablate.sh ] && [ -d ./templates ]; then
  # Where the W8A16 MoE GEMV's time goes (gemv_ablate.sh: the ring's compute
  # cut down part by part; GABLATE_CASES, GABLATE_VARIANTS, GABLATE_ROUNDS).
  CASES=${GABLATE_CASES:-} VARIANTS=${GABLATE_VARIANTS:-} timeout "${T_GABLATE:-240}" sh ./gemv_ablate.sh \
    --rounds "${GABLATE_ROUNDS:-1}" --out "$OUT/gemv-ablate" --m3kit ./m3kit --templates ./templates > "$L/gablate.log" 2>&1
  log "gablate rc=$? at $(elapsed) s"
  cp "$OUT/gemv-ablate/ablate.tsv" "$L/gemv-ablate.tsv" 2>/dev/null
fi
if has aablate && [ -f ./attn_ablate.sh ] && [ -d ./templates ]; then
  # Where the decode attention's fixed cost goes (attn_ablate.sh: no merge, no
  # KV tiles; AABLATE_CASES, AABLATE_VARIANTS, AABLATE_ROUNDS).
  CASES=${AABLATE_CASES:-} VARIANTS=${AABLATE_VARIANTS:-} timeout "${T_AABLATE:-240}" sh ./attn_ablate.sh \
    --rounds "${AABLATE_ROUNDS:-2}" --out "$OUT/attn-ablate" --m3kit ./m3kit --templates ./templates > "$L/aablate.log" 2>&1
  log "aablate rc=$? at $(elapsed) s"
  cp "$OUT/attn-ablate/ablate.tsv" "$L/attn-ablate.tsv" 2>/dev/null
fi
if has tune; then
  # Twice, the second from an empty tuning DB over the same cubins: how
  # often the two runs choose the same winner is the tuner's stability.
  for run in 1 2; do
    # Both from an empty DB (the tests may have written one); the seed is read separately.
    rm -rf "$M3KIT_CACHE_DIR/tuning"
    [ $run = 2 ] && { has tune2 || break; }
    tt=${T_TUNE:-480}; [ $run = 2 ] && tt=${T_TUNE2:-$tt}
    ta=${TUNE_ARGS:-}; [ $run = 2 ] && ta=${TUNE2_ARGS:-$ta}
    # shellcheck disable=SC2086
    ( time timeout "$tt" ./m3kit tune --preset minimax-m3 --budget $(( tt - 25 )) $ta ) > "$L/tune-$run.log" 2>&1
    log "tune $run rc=$? $(grep -E '^real' "$L/tune-$run.log") at $(elapsed) s"
    mkdir -p "$OUT/tuning-$run" && cp "$M3KIT_CACHE_DIR"/tuning/*.json "$OUT/tuning-$run/" 2>/dev/null
    ./m3kit tune --show > "$L/tune-show-$run.txt" 2>&1
  done
  # The later steps run with the first (longer) tune's DB.
  mkdir -p "$M3KIT_CACHE_DIR/tuning" && cp "$OUT"/tuning-1/*.json "$M3KIT_CACHE_DIR/tuning/" 2>/dev/null
fi
# The report is named after the card (h200.md, h100.md, ...): sessions that got
# an H100 once wrote it as h200.md.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | sed -nE 's/.*\b([A-Z][0-9]{2,4}[A-Z]?)\b.*/\1/p' | tr 'A-Z' 'a-z')
card=${card:-gpu}
if has bench; then
  timeout "${T_BENCH:-240}" ./m3kit bench ${BENCH_ONLY:+--only $BENCH_ONLY} --out "$OUT/$card.md" > "$L/bench.log" 2>&1
  log "bench rc=$? at $(elapsed) s"
fi
if has bench-insert; then
  timeout "${T_BENCH:-240}" ./m3kit bench --only insert,qknorm_rope --out "$OUT/$card-insert-qknorm.md" > "$L/bench-insert.log" 2>&1
  log "bench insert,qknorm_rope rc=$? at $(elapsed) s"
fi
if has run; then
  (time timeout "${T_RUN:-150}" ./m3kit run) > "$L/run-default.log" 2>&1
  log "run (embedded) rc=$? $(grep -E '^(TTFT|TPOT)' "$L/run-default.log" | tr '\n' ' ')"
  if [ "${RUN_M3:-1}" = 1 ]; then
    (time timeout "${T_RUN:-150}" ./m3kit run --preset minimax-m3 --context 131072 --max-new-tokens 32) > "$L/run-m3-128k.log" 2>&1
    log "run minimax-m3 128K rc=$? $(grep -E '^(TTFT|TPOT|peak)' "$L/run-m3-128k.log" | tr '\n' ' ')"
  fi
fi
if has ncu && command -v ncu > /dev/null; then
  # One Nsight Compute report per case (M3KIT_BENCH_CASE narrows the bench to
  # it): NCU_CASES is "family;case;kernel-regex" entries separated by '@'.
  ncu_cases=${NCU_CASES:-"indexer;batch 1, 131072 bf16;index_decode@indexer;batch 1, 8192 bf16;index_decode@ffn;W8A16 moe gate|up;mxfp8@ffn;W8A16 moe down;mxfp8@attention;sparse decode bf16 batch 1;attn_sparse"}
  i=0
  echo "$ncu_cases" | tr '@' '\n' > /tmp/ncu-cases
  while IFS=';' read -r fam case kre; do
    i=$((i + 1))
    M3KIT_BENCH_CASE="$case" timeout "${T_NCU:-90}" ncu --clock-control none --set full -k "regex:$kre" --launch-skip "${NCU_SKIP:-8}" \
      --launch-count 1 --page details ./m3kit bench --only "$fam" --out /dev/null > "$L/ncu-$i.log" 2>&1
    log "ncu $i ($fam: $case) rc=$? $(grep -E 'Duration|DRAM Throughput|Registers Per' "$L/ncu-$i.log" | tr -s ' ' | tr '\n' ' ')"
  done < /tmp/ncu-cases
fi
if has torch && [ -f ./baseline_torch.py ]; then
  timeout "${T_TORCH:-120}" python3 ./baseline_torch.py ${TORCH_ARGS:-} > "$L/torch.log" 2>&1
  log "torch baseline rc=$? $(tail -n 3 "$L/torch.log" | tr '\n' ' ')"
fi
if has run1m; then
  (time timeout "${T_RUN:-150}" ./m3kit run --preset minimax-m3 --context 1048544 --kv-dtype e4m3 --index-dtype e4m3 \
    --synthetic-cache --max-new-tokens 32) > "$L/run-m3-1m.log" 2>&1
  log "run minimax-m3 1M e4m3 rc=$? $(grep -E '^(TTFT|TPOT|peak)' "$L/run-m3-1m.log" | tr '\n' ' ')"
fi
if has tpot && [ -f ./tpot_curve.sh ]; then
  # Synthetic caches: the decode step reads the bytes of a long context
  # without the minutes its prefill would take (m3kit run --help).
  curve() { sh ./tpot_curve.sh --budget "${T_TPOT:-300}" ${TPOT_CONTEXTS:+--contexts $TPOT_CONTEXTS} --m3kit ./m3kit \
    --breakdown --m3kit-args "--synthetic-cache" "$@"; }
  curve ${T_TORCH:+--torch-budget $T_TORCH} --out "$OUT/tpot" > "$L/tpot.log" 2>&1
  log "tpot curve rc=$? at $(elapsed) s: $(tail -n 1 "$L/tpot.log")"
  if [ "${TPOT_PDL:-0}" = 1 ]; then
    # The same curve without programmatic dependent launch (M3KIT_PDL=0), right after, for the ratio.
    ( export M3KIT_PDL=0; curve --no-torch --out "$OUT/tpot-nopdl" ) > "$L/tpot-nopdl.log" 2>&1
    log "tpot curve M3KIT_PDL=0 rc=$? at $(elapsed) s: $(tail -n 1 "$L/tpot-nopdl.log")"
  fi
fi
if has ab; then
  # A/B of whole decode steps in one call: AB is "name:VAR=1 VAR2=x;name2:..." (an
  # empty list after the colon is the plain build), AB_CONTEXTS the contexts
  # (default 8192), AB_ROUNDS how often each (default 2), interleaved so that
  # drift hits every entry alike; AB_ARGS adds m3kit run options.  E.g. template
  # variants: M3KIT_TEMPLATE_DIR=tpl-X (copies of templates/ packed into .dev/).
  echo "${AB:-base:}" | tr ';' '\n' > /tmp/ab-list
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for c in $(echo "${AB_CONTEXTS:-8192}" | tr ',' ' '); do
      while IFS= read -r ent; do
        [ -n "$ent" ] || continue
        nm=${ent%%:*} envs=${ent#*:}
        # shellcheck disable=SC2086
        env $envs timeout "${T_RUN:-150}" ./m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens 32 \
          --context "$c" --synthetic-cache ${AB_ARGS:-} > "$L/ab-$nm-$c-$r.log" 2>&1
        log "ab $nm ctx $c round $r rc=$? $(grep -E '^TPOT' "$L/ab-$nm-$c-$r.log") at $(elapsed) s"
      done < /tmp/ab-list
    done
  done
fi
if has tp; then
  # Tensor parallelism (issue 7) over the GPUs of this host, NCCL with
  # NVLink multicast off (exported above): the TP test first (its NCCL case
  # runs TP=2, and TP=4 with >= 4 GPUs; on one GPU it prints SKIPPED), then
  # bench/tp_tpot.sh for N = 2 4 8 capped at the GPUs present, in the rest of
  # T_TP.  Both alone: the sweep's TPOT and the test's NCCL ranks need every GPU.
  tp_t0=$(date +%s)
  tp_budget=${T_TP:-520}
  # TP_PREV=DIR: an earlier call's tp/ (unpacked from its device-run.tar.gz
  # into .dev/), so that TP_ARGS=--append merges this call's points into it
  # ($OUT starts empty on every call).
  if [ -n "${TP_PREV:-}" ] && [ -d "$TP_PREV" ]; then mkdir -p "$OUT/tp" && cp -r "$TP_PREV"/. "$OUT/tp/"; fi
  tt=${T_TEST:-280}; [ "$tt" -gt $(( tp_budget - 60 )) ] && tt=$(( tp_budget - 60 ))
  if [ -x ./check_tp_forward_gpu ]; then
    timeout "$tt" ./check_tp_forward_gpu > "$L/tp-test.log" 2>&1
    log "check_tp_forward_gpu rc=$? $(grep -E '^[0-9]+%: Checks' "$L/tp-test.log" | tail -n 1) $(grep -E '^nccl tp [0-9]+: (SKIPPED|NCCL)' "$L/tp-test.log" | tr '\n' ' ')($(( $(date +%s) - tp_t0 )) s)"
  fi
  tp_left=$(( tp_budget - ($(date +%s) - tp_t0) ))
  if [ -f ./tp_tpot.sh ] && [ "$tp_left" -ge 60 ]; then
    # shellcheck disable=SC2086
    sh ./tp_tpot.sh --budget "$tp_left" ${TP_LIST:+--tp "$TP_LIST"} ${TP_CONTEXTS:+--contexts "$TP_CONTEXTS"} \
      ${TP_BATCHES:+--batches "$TP_BATCHES"} ${TP_ARGS:-} --m3kit ./m3kit --out "$OUT/tp" > "$L/tp-tpot.log" 2>&1
    log "tp tpot rc=$? at $(elapsed) s: $(tail -n 1 "$L/tp-tpot.log")"
    [ -f "$OUT/tp/tp_tpot.md" ] && cp "$OUT/tp/tp_tpot.md" "$L/"
  else
    log "tp tpot skipped: $tp_left s left of T_TP=$tp_budget"
  fi
fi
cp "$OUT/summary.txt" "$L/" 2>/dev/null
# Everything in one archive (the device tool returns only a few files).
tar -C "$OUT" -czf /tmp/device-run.tar.gz --exclude=./summary.txt . &&
  find "$OUT" -mindepth 1 ! -name summary.txt -exec rm -rf {} + 2>/dev/null
mv /tmp/device-run.tar.gz "$OUT/device-run.tar.gz"
cat "$OUT/summary.txt"
