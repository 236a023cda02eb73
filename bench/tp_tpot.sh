#!/bin/sh
# tp_tpot.sh - tensor-parallel decode TPOT of MiniMax-M3 (issue 7): for each rank count N, batch
# and context, `m3kit run --preset minimax-m3 --tp N --resident-experts R --synthetic-cache`
# (TPOT: the mean graph-replayed decode step after the first, as the single-GPU run reports it),
# then a `--timing` run of the same point for the collectives' share of the step; writes
# tp_tpot.dat and tp_tpot.md (a table, and every command line run) to --out.
#
#   sh bench/tp_tpot.sh [options] [BUDGET_SECONDS]
#     --tp LIST          rank counts (default "2 4 8"), capped at the GPUs present (NCCL: one GPU a
#                        rank); commas or spaces
#     --contexts LIST    default "8192 131072 393216 1048544" (a context + --steps beyond
#                        max_position_embeddings is cut to end there)
#     --batches LIST     default "1 32"
#     --steps N          --max-new-tokens of the TPOT runs (default 32; >= 3: the first step is apart)
#     --timing-steps N   --max-new-tokens of the --timing runs (default 8)
#     --no-timing        TPOT runs only;  --timing-only: --timing runs only (merge with --append)
#     --resident R       routed experts resident per MoE layer (default: auto, below)
#     --cache C          auto|bf16|e4m3 (default auto, below)
#     --budget S         wall-clock budget of the whole script (default 540: one device call is at
#                        most 600 s); a run that cannot start with >= 30 s left is skipped (the row
#                        says so), every run is cut (timeout) at what is left
#     --preset P         default minimax-m3 (tiny: for trying the script, e.g. on the emulator)
#     --backend B        nccl (default; one GPU a rank) | local (ranks share the GPUs: no speedup)
#     --m3kit PATH       default: $M3KIT, ./m3kit, .dev/m3kit, build/m3kit, then PATH
#     --m3kit-args "A"   more arguments for every m3kit run
#     --gpus N           GPUs to plan for (default: nvidia-smi's count; --dry-run: the largest N)
#     --gpu-bytes B      memory per GPU (default: nvidia-smi's memory.total; else 150.7e9, an H200)
#     --out DIR          default: $OUT if set (device tool), else bench/results
#     --append           merge into DIR/tp_tpot.dat: a point measured now replaces the old row's
#                        fields it measured (split the sweep over several device calls)
#     --dry-run          print every choice and command line, run nothing but `m3kit tp-plan`
#                        (no GPU needed); the .md says DRY RUN
#
# Resident experts (auto): R = 128 (E) when a rank holds every expert, i.e. when, by
# `m3kit tp-plan --tp N --tsv`, the largest rank's weights + the e4m3 caches of the largest context
# at batch 1 + 6 GB of workspace fit in the GPU's memory; else the most that fit so (at least
# num_experts_per_tok = 4: else N is skipped).  One R per N, so its contexts are comparable.
# Caches (auto), the rule of bench/tpot_curve.sh per rank: bf16 KV and index-K caches where the
# rank's weights + batch x (context + steps) x the rank's bf16 bytes per token + 6 GB fit, else e4m3
# for both where that fits, else the point is skipped as not fitting; a bf16 run m3kit refuses for
# capacity is rerun e4m3.  Where a context of the list does not fit at a batch, the longest that
# does (a multiple of 4096) is added as one more point of that batch.
# Order: every TPOT run first (N ascending), then the --timing runs, so a cut budget loses the
# all-reduce shares before it loses TPOT.  The timing run's numbers are CUDA-event times of eager
# steps (no graphs): each collective's row is the max over the ranks of its time a step, which
# includes waiting for the slowest rank, and its share of that rank's summed op time.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
tps="2 4 8" contexts="8192 131072 393216 1048544" batches="1 32" steps=32 tsteps=8 do_tpot=1 do_timing=1
resident='' cache=auto budget=540 preset=minimax-m3 backend=nccl m3kit=${M3KIT:-} m3args='' gpus='' gpu_bytes=''
out=${OUT:-} append=0 dry=0
while [ $# -gt 0 ]; do
  case $1 in
    --tp) tps=$2; shift ;;
    --contexts) contexts=$2; shift ;;
    --batches) batches=$2; shift ;;
    --steps) steps=$2; shift ;;
    --timing-steps) tsteps=$2; shift ;;
    --no-timing) do_timing=0 ;;
    --timing-only) do_tpot=0 ;;
    --resident) resident=$2; shift ;;
    --cache) cache=$2; shift ;;
    --budget) budget=$2; shift ;;
    --preset) preset=$2; shift ;;
    --backend) backend=$2; shift ;;
    --m3kit) m3kit=$2; shift ;;
    --m3kit-args) m3args=$2; shift ;;
    --gpus) gpus=$2; shift ;;
    --gpu-bytes) gpu_bytes=$2; shift ;;
    --out) out=$2; shift ;;
    --append) append=1 ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
    [0-9]*) budget=$1 ;;
    *) echo "tp_tpot.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
tps=$(echo "$tps" | tr ',' ' ') contexts=$(echo "$contexts" | tr ',' ' ') batches=$(echo "$batches" | tr ',' ' ')
case $cache in auto|bf16|e4m3) ;; *) echo "tp_tpot.sh: --cache auto|bf16|e4m3" >&2; exit 2 ;; esac
case $backend in nccl|local) ;; *) echo "tp_tpot.sh: --backend nccl|local" >&2; exit 2 ;; esac
[ "$steps" -ge 3 ] 2>/dev/null || { echo "tp_tpot.sh: --steps must be >= 3 (the first step is timed apart)" >&2; exit 2; }
[ "$tsteps" -ge 2 ] 2>/dev/null || { echo "tp_tpot.sh: --timing-steps must be >= 2" >&2; exit 2; }
for v in $tps $contexts $batches $budget ${resident:-1}; do
  case $v in ''|*[!0-9]*) echo "tp_tpot.sh: '$v' is not a positive integer" >&2; exit 2 ;; esac
done
t_start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t_start) )); }
out=${out:-$root/bench/results}
logs=$out/tp-logs
mkdir -p "$logs"
dat=$out/tp_tpot.dat md=$out/tp_tpot.md cmds=$logs/commands.txt

if [ -z "$m3kit" ]; then
  for p in ./m3kit "$root/.dev/m3kit" "$root/build/m3kit" "$(command -v m3kit 2>/dev/null)"; do
    [ -n "$p" ] && [ -x "$p" ] && { m3kit=$p; break; }
  done
fi
[ -n "$m3kit" ] && [ -x "$m3kit" ] || { echo "tp_tpot.sh: no m3kit binary (--m3kit PATH)" >&2; exit 1; }

max_n=0; for n in $tps; do [ "$n" -gt "$max_n" ] && max_n=$n; done
if [ -z "$gpus" ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$dry" = 1 ] && [ "$gpus" = 0 ] && gpus=$max_n
fi
if [ -z "$gpu_bytes" ]; then
  gpu_bytes=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 |
              awk '{ printf "%.0f", $1 * 1048576 }')
  [ -n "$gpu_bytes" ] || gpu_bytes=150700000000   # H200: 143771 MiB
fi
slack=6000000000   # workspace, activations, RoPE table, allocator slack (bench/tpot_curve.sh's 6 GB)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
[ -n "$gpu_name" ] || gpu_name="no GPU"
echo "tp_tpot.sh: $gpus GPU(s) ($gpu_name), $(awk -v b="$gpu_bytes" 'BEGIN { printf "%.1f", b / 1e9 }') GB each;" \
  "N: $tps; contexts: $contexts; batches: $batches; budget $budget s$( [ "$dry" = 1 ] && echo '; DRY RUN')"

# ---- per N: the plan (m3kit tp-plan --tsv), R and the bytes a point needs ------------------------
# plan N -> "W_all xb E kv16 kv8 maxpos" for the largest rank (W_all: every expert resident)
plan() {
  "$m3kit" tp-plan --preset "$preset" --tp "$1" --tsv 2>/dev/null |
    awk -F '\t' '$1 !~ /^#/ && NF >= 8 { if ($3 > w) { w = $3; x = $4 }; e = $5; k16 = $6; k8 = $7; mp = $8 }
      END { if (w) printf "%.0f %.0f %d %d %d %d\n", w, x, e, k16, k8, mp }'
}
max_ctx=0; for c in $contexts; do [ "$c" -gt "$max_ctx" ] && max_ctx=$c; done
# pick_r W_all xb E kv8 -> R (0: nothing fits)
pick_r() {
  [ -n "$resident" ] && { echo "$resident"; return; }
  awk -v w="$1" -v x="$2" -v e="$3" -v k8="$4" -v t="$(( max_ctx + steps ))" -v g="$gpu_bytes" -v s="$slack" \
    'BEGIN { r = int((g - s - (w - e * x) - k8 * t) / x); if (r > e) r = e; if (r < 4) r = 0; print r }'
}
# pick_cache W_R kv16 kv8 batch tokens -> bf16|e4m3|none
pick_cache() {
  awk -v w="$1" -v k16="$2" -v k8="$3" -v b="$4" -v t="$5" -v g="$gpu_bytes" -v s="$slack" -v c="$cache" \
    'BEGIN { if (c != "auto") { print c; exit }
             if (w + k16 * b * t + s <= g) print "bf16"; else if (w + k8 * b * t + s <= g) print "e4m3"; else print "none" }'
}
gb() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1e9 }'; }

# .dat: one line a point; '-' where not measured
#   n batch ctx cache R tpot_ms first_ms ar_ms ar_pct ag_ms coll_ms coll_pct weight_gb note
new=$logs/new.dat
: > "$new"
[ "$append" = 1 ] || : > "$cmds"
[ "$dry" = 1 ] && : > "$logs/dry-run" || rm -f "$logs/dry-run"
echo "$gpu_name" > "$logs/gpu"
printf '%s\n' "tp_tpot.sh --tp \"$tps\" --contexts \"$contexts\" --batches \"$batches\" --steps $steps --budget $budget$( [ $do_timing = 0 ] && echo ' --no-timing')$( [ $do_tpot = 0 ] && echo ' --timing-only')${resident:+ --resident $resident} --cache $cache --backend $backend${m3args:+ --m3kit-args \"$m3args\"}" >> "$logs/args"

# run_point TAG N batch ctx cache R steps extra -> rc; the log is $logs/TAG.log
run_point() {
  tag=$1 n=$2 b=$3 c=$4 k=$5 r=$6 st=$7 x=$8
  log=$logs/$tag.log
  kv=; [ "$k" = e4m3 ] && kv=" --kv-dtype e4m3 --index-dtype e4m3"
  cmd="$m3kit run --preset $preset --tp $n --tp-backend $backend --resident-experts $r --synthetic-cache --context $c --batch $b --max-new-tokens $st$kv$x${m3args:+ $m3args}"
  echo "$cmd" >> "$cmds"
  if [ "$dry" = 1 ]; then echo "   (dry run) $cmd"; return 0; fi  # no log: an earlier call's stays
  echo "\$ $cmd" > "$log"
  t=$(( $(left) - 10 ))
  [ "$t" -lt 30 ] && { echo "skipped: budget spent" >> "$log"; echo "   skipped: budget spent"; return 124; }
  # shellcheck disable=SC2086
  timeout "$t" $cmd >> "$log" 2>&1
}

# the points, in order: "n b c" (context cut to end at max_position_embeddings)
points=$logs/points
: > "$points"
for n in $tps; do
  if [ "$backend" = nccl ] && [ "$n" -gt "$gpus" ]; then
    echo "== N=$n: skipped ($gpus GPU(s): NCCL puts each rank on its own GPU)"
    for b in $batches; do for c in $contexts; do
      echo "$n $b $c - - - - - - - - - - skipped:${gpus}-GPUs" >> "$new"
    done; done
    continue
  fi
  # shellcheck disable=SC2046  # the plan's six numbers as $1..$6
  set -- $(plan "$n")
  if [ $# -lt 6 ]; then
    echo "== N=$n: m3kit tp-plan cannot cut $preset over $n ranks: $("$m3kit" tp-plan --preset "$preset" --tp "$n" 2>&1 | tail -n 1)"
    for b in $batches; do for c in $contexts; do echo "$n $b $c - - - - - - - - - - no-plan" >> "$new"; done; done
    continue
  fi
  w_all=$1 xb=$2 ne=$3 k16=$4 k8=$5 mp=$6
  r=$(pick_r "$w_all" "$xb" "$ne" "$k8")
  w_r=$(awk -v w="$w_all" -v x="$xb" -v e="$ne" -v r="$r" 'BEGIN { printf "%.0f", w - (e - r) * x }')
  echo "== N=$n: a rank holds $(gb "$w_all") GB with all $ne experts; R = $r resident ($(gb "$w_r") GB a rank);" \
    "caches $k16 B (bf16) / $k8 B (e4m3) a token and rank"
  if [ "$r" = 0 ]; then
    for b in $batches; do for c in $contexts; do echo "$n $b $c - - - - - - - - - - weights-do-not-fit" >> "$new"; done; done
    continue
  fi
  for b in $batches; do
    fit_max=0 unfit=0
    for c in $contexts; do
      [ $(( c + steps )) -gt "$mp" ] && c=$(( mp - steps ))
      k=$(pick_cache "$w_r" "$k16" "$k8" "$b" $(( c + steps )))
      if [ "$k" = none ]; then
        need=$(gb $(( k8 * b * (c + steps) )))
        echo "   N=$n batch $b context $c: does not fit (e4m3 caches need $need GB a rank beside $(gb "$w_r") GB of weights)"
        echo "$n $b $c - $r - - - - - - - - does-not-fit:e4m3-caches-${need}GB" >> "$new"
        unfit=1
        continue
      fi
      [ "$c" -gt "$fit_max" ] && fit_max=$c
      echo "$n $b $c $k $r $w_r" >> "$points"
    done
    # A context of the list that does not fit at this batch: one more point at the longest context
    # that does (e4m3 caches, a multiple of 4096), so that the batch has a long-context row too.
    if [ "$unfit" = 1 ]; then
      cf=$(awk -v w="$w_r" -v k8="$k8" -v b="$b" -v st="$steps" -v g="$gpu_bytes" -v s="$slack" \
        'BEGIN { t = int((g - s - w) / (k8 * b)) - st; print (t > 0 ? int(t / 4096) * 4096 : 0) }')
      if [ "$cf" -gt "$fit_max" ] && [ "$cf" -ge 4096 ]; then
        k=$(pick_cache "$w_r" "$k16" "$k8" "$b" $(( cf + steps )))
        echo "   N=$n batch $b: adding context $cf, the longest that fits ($k caches)"
        echo "$n $b $cf $k $r $w_r" >> "$points"
      fi
    fi
  done
done

# ---- pass 1: TPOT --------------------------------------------------------------------------------
# fields of a point's results, filled by the passes: $logs/res-N-b-c holds "key value" lines
while read -r n b c k r w_r; do
  res=$logs/res-$n-$b-$c
  if [ "$do_tpot" = 0 ] && [ -f "$dat" ]; then
    # --timing-only: the caches the earlier TPOT run of this point ended with (a refused bf16 run
    # was rerun e4m3), so that both runs measure the same point
    k=$(awk -v n="$n" -v b="$b" -v c="$c" -v k="$k" '$1 == n && $2 == b && $3 == c && $4 != "-" { k = $4 } END { print k }' "$dat")
  fi
  echo "cache $k" > "$res"; echo "resident $r" >> "$res"; echo "plan_gb $(gb "$w_r")" >> "$res"
  [ "$do_tpot" = 1 ] || continue
  tag=tp$n-b$b-c$c
  echo "== TPOT N=$n batch $b context $c ($k caches, R=$r), $(left) s left"
  run_point "$tag" "$n" "$b" "$c" "$k" "$r" "$steps" ""; rc=$?
  log=$logs/$tag.log
  [ "$dry" = 1 ] && continue
  if [ "$rc" != 0 ] && [ "$k" = bf16 ] && [ "$cache" = auto ] && grep -qi "capacity\|tokens fit\|out of memory" "$log"; then
    echo "   bf16 caches refused: rerun with e4m3"; k=e4m3
    echo "cache e4m3" >> "$res"
    mv "$log" "$logs/$tag-bf16-refused.log"
    run_point "$tag" "$n" "$b" "$c" "$k" "$r" "$steps" ""; rc=$?
  fi
  tpot=$(sed -n 's/^TPOT \([0-9.]*\) ms.*/\1/p' "$log" | tail -n 1)
  first=$(sed -n 's/^first decode step \([0-9.]*\) ms.*/\1/p' "$log" | tail -n 1)
  wgb=$(sed -n 's/^  rank [0-9]* on GPU [0-9]*: .*; \([0-9.]*\) GB of weights.*/\1/p' "$log" | sort -n | tail -n 1)
  echo "   rc=$rc TPOT ${tpot:--} ms, first step ${first:--} ms, ${wgb:--} GB of weights a rank ($log)"
  { echo "tpot ${tpot:--}"; echo "first ${first:--}"; [ -n "$wgb" ] && echo "weight_gb $wgb"
    [ "$dry" = 1 ] || [ "$rc" = 0 ] || echo "note tpot-rc=$rc"; } >> "$res"
done < "$points"

# ---- pass 2: the collectives' share (--timing) ---------------------------------------------------
if [ "$do_timing" = 1 ]; then
  while read -r n b c k r w_r; do
    res=$logs/res-$n-$b-$c
    k=$(awk '$1 == "cache" { v = $2 } END { print v }' "$res")
    tag=tp$n-b$b-c$c-timing
    echo "== --timing N=$n batch $b context $c ($k caches), $(left) s left"
    run_point "$tag" "$n" "$b" "$c" "$k" "$r" "$tsteps" " --timing"; rc=$?
    log=$logs/$tag.log
    [ "$dry" = 1 ] && continue
    # the decode table's lines (the prefill's come first: take the last)
    ar=$(sed -n 's/^  allreduce: max over ranks \([0-9.]*\) ms\/step (rank [0-9]*), \([0-9.]*\)%.*/\1 \2/p' "$log" | tail -n 1)
    ag=$(sed -n 's/^  allgather: max over ranks \([0-9.]*\) ms\/step.*/\1/p' "$log" | tail -n 1)
    co=$(sed -n 's/^  collectives: max over ranks \([0-9.]*\) ms\/step (rank [0-9]*), \([0-9.]*\)%.*/\1 \2/p' "$log" | tail -n 1)
    echo "   rc=$rc all-reduce ${ar:--} (ms/step, %), all-gather ${ag:--} ms/step, both ${co:--} ($log)"
    { [ -n "$ar" ] && echo "ar $ar"; [ -n "$ag" ] && echo "ag $ag"; [ -n "$co" ] && echo "co $co"
      [ "$dry" = 1 ] || [ "$rc" = 0 ] || echo "note timing-rc=$rc"; } >> "$res"
  done < "$points"
fi

# ---- the .dat rows of this call, merged with the old ones (--append) ------------------------------
while read -r n b c k r w_r; do
  awk -v n="$n" -v b="$b" -v c="$c" '
    { v[$1] = $2; if ($1 == "ar" || $1 == "co") v[$1 "2"] = $3; if ($1 == "note") note = note (note ? "," : "") $2 }
    END { d = "-"
      printf "%s %s %s %s %s %s %s %s %s %s %s %s %s %s\n", n, b, c, v["cache"], v["resident"],
        ("tpot" in v) ? v["tpot"] : d, ("first" in v) ? v["first"] : d, ("ar" in v) ? v["ar"] : d,
        ("ar2" in v) ? v["ar2"] : d, ("ag" in v) ? v["ag"] : d, ("co" in v) ? v["co"] : d, ("co2" in v) ? v["co2"] : d,
        ("weight_gb" in v) ? v["weight_gb"] : v["plan_gb"] "(plan)", note ? note : d }' "$logs/res-$n-$b-$c" >> "$new"
done < "$points"
if [ "$append" = 1 ] && [ -f "$dat" ]; then
  # a field measured now ('-' = not; a weight "(plan)" = not run) replaces the old row's; other rows stay
  awk 'FNR == NR { k = $1 " " $2 " " $3; old[k] = $0; order[++m] = k; next }
       { k = $1 " " $2 " " $3
         if (k in old) { split(old[k], o, " ")
           for (i = 4; i <= NF; i++) if (($i == "-" || $i ~ /\(plan\)$/) && o[i] != "" && o[i] != "-") $i = o[i]
           delete old[k] }
         newrow[k] = $0; norder[++q] = k }
       END { for (i = 1; i <= m; i++) if (order[i] in old) print old[order[i]]
             for (i = 1; i <= q; i++) print newrow[norder[i]] }' "$dat" "$new" > "$dat.tmp" && mv "$dat.tmp" "$dat"
else
  mv "$new" "$dat"
fi
rm -f "$new"

# ---- the table -----------------------------------------------------------------------------------
{
  echo "# MiniMax-M3 tensor-parallel decode TPOT (\`m3kit run --preset $preset --tp N --synthetic-cache\`)"
  echo
  [ -f "$logs/dry-run" ] && echo "**DRY RUN (tp_tpot.sh --dry-run): nothing was measured; the commands below are what would run.**" && echo
  echo "Made by \`$(awk 'NR > 1 { printf "` + `" } { printf "%s", $0 }' "$logs/args")\` on $gpu_name, $backend backend."
  echo "TPOT: mean decode step after the first (CUDA graphs at batch <= 8; batch 32 launches eagerly, as on one GPU)."
  echo "All-reduce / collectives: the \`--timing\` run's CUDA-event time a decode step (eager, no graphs), max over the"
  echo "ranks (it includes waiting for the slowest rank), and its share of that rank's summed op time."
  echo "R: routed experts resident per MoE layer (128 = the whole model; fewer where a rank cannot hold them all)."
  echo "Weights: the largest rank's, as m3kit reports it ((plan): m3kit tp-plan's count, not run)."
  echo
  echo "| N | batch | context | caches | R | TPOT ms | first step ms | all-reduce ms/step | all-reduce % | all-gather ms/step | collectives % | weights GB/rank | note |"
  echo "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
  sort -n -k1,1 -k2,2 -k3,3 "$dat" | awk '{ printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
    $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $12, $13, $14 }'
  echo
  echo "Commands (logs in tp-logs/, one per command, named tpN-bB-cC[-timing].log):"
  echo
  echo '```'
  cat "$cmds"
  echo '```'
} > "$md"
echo "tp_tpot.sh: wrote $md ($(( $(date +%s) - t_start )) s of the $budget s budget)"
