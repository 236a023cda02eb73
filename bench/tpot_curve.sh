#!/bin/sh
# tpot_curve.sh - whole-model batch-1 decode TPOT against context (issue 6, targets 6 and 7):
# `m3kit run --preset minimax-m3 --resident-experts 8` at each context, the step's roofline, and
# the PyTorch eager baseline (bench/baseline_torch.py) at the same contexts when python3 + torch
# + a GPU are there; writes tpot_curve.dat, tpot_curve.md and tpot_curve.png (gnuplot).
#
#   sh bench/tpot_curve.sh [options] [BUDGET_SECONDS]
#     --budget S         wall-clock budget of the whole script (default 540: one device call is
#                        at most 600 s); a context that cannot start with >= 30 s left is skipped,
#                        and every run is cut (timeout) at what is left
#     --contexts LIST    default 8192,32768,131072,393216,769000,1048576 (8K .. 1M)
#     --steps N          --max-new-tokens of m3kit and timed steps of the baseline (default 32)
#     --breakdown        `m3kit run --graph-breakdown` per context: each op's launches replayed as a
#                        graph of their own after the timed steps; the .dat keeps their sum
#                        (--timing: the same, the old name)
#     --weights W        bf16|mxfp8, passed to m3kit (default: m3kit's own, MXFP8 for minimax-m3)
#     --cache C          auto|bf16|e4m3 (default auto: bf16 KV + index-K caches where they fit,
#                        else e4m3 for both; a bf16 run that m3kit refuses for capacity is rerun e4m3)
#     --no-torch         skip the baseline;  --torch-budget S  its share (default budget/3)
#     --m3kit PATH       default: $M3KIT, ./m3kit, .dev/m3kit, build/m3kit, then PATH
#     --m3kit-args "A"   more arguments for m3kit run (e.g. "--chunk 2048")
#     --out DIR          default: $OUT if set (device tool), else a new folder
#                        bench/results/tpot-YYYYMMDD-HHMMSS (never the reference curve's files in
#                        bench/results, which carry hand-written notes: copy a new curve there by hand)
#     --append           keep the rows of DIR/tpot_curve.dat for contexts not rerun (curves over
#                        several device calls; needs --out or $OUT)
#     --plot-only        only rebuild .md and .png from DIR/tpot_curve.dat (needs --out or $OUT)
#     --ceiling GBPS     the copy ceiling the roofline divides by, GB/s, 10 to 100000 (read + write, as
#                        m3kit bench counts it).  Default: measured in this call (m3kit bench's copy,
#                        ~10 s), so that the ratio is against the card that ran; 4278 (the H200's, the
#                        issue's figure) only with --fake or where it cannot be measured, and the table
#                        says so.  --append keeps the earlier call's (one ceiling a table)
#     --fake             fill the .dat with made-up numbers (tests the table and the plot; says so;
#                        without --out or $OUT it writes under ${TMPDIR:-/tmp}/tpot-fake)
#
# Roofline (m3kit prints no byte count, so it is computed here from the spec, §9.2-§9.4):
#   TPOT_roof = (W + KV(T)) / copy ceiling, T = context + steps/2 (the mean decode position)
#   W   = 3 dense layers x (qkv 9216x6144 + o 6144x8192 + MLP 3x12288x6144)
#       + 57 sparse layers x (qkv+index 9856x6144 + o 6144x8192 + 5 experts (4 routed + shared)
#                              x 3x3072x6144) + 57 fp32 routers 128x6144x4 B + lm_head 200064x6144x2 B
#     at 2 B per weight (bf16) or 1 + 1/32 B (MXFP8: e4m3 + one E8M0 scale per 32);
#   KV(T) = 3 x T x 4 heads x 2 x 128 x kv_B            (dense layers read the whole history)
#         + 57 x (4 x min(T, 2048) x 2 x 128 x kv_B     (16 selected blocks of 128 per KV head)
#                 + T x 128 x idx_B)                    (index-K scan of every cached token)
#   kv_B, idx_B = 2 (bf16) or 1 (e4m3).  Writes (one token of KV, logits) are left out (< 1 MB).
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
budget=540 contexts=8192,32768,131072,393216,769000,1048576 steps=32 timing=0 weights='' cache=auto
torch=1 torch_budget='' m3kit=${M3KIT:-} m3args='' out=${OUT:-} append=0 plot_only=0 fake=0 ceiling=
ceiling_set=0
while [ $# -gt 0 ]; do
  case $1 in
    --budget|--contexts|--steps|--weights|--cache|--torch-budget|--m3kit|--m3kit-args|--out|--ceiling)
      [ $# -ge 2 ] || { echo "tpot_curve.sh: $1 needs a value (--help)" >&2; exit 2; } ;;
  esac
  case $1 in
    --budget) budget=$2; shift ;;
    --contexts) contexts=$2; shift ;;
    --steps) steps=$2; shift ;;
    --timing|--breakdown) timing=1 ;;
    --weights) weights=$2; shift ;;
    --cache) cache=$2; shift ;;
    --no-torch) torch=0 ;;
    --torch-budget) torch_budget=$2; shift ;;
    --m3kit) m3kit=$2; shift ;;
    --m3kit-args) m3args=$2; shift ;;
    --out) out=$2; shift ;;
    --append) append=1 ;;
    --plot-only) plot_only=1 ;;
    --fake) fake=1 ;;
    --ceiling) ceiling=$2; ceiling_set=1; shift ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    [0-9]*) budget=$1 ;;
    *) echo "tpot_curve.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
case $weights in ""|bf16|mxfp8) ;; *) echo "tpot_curve.sh: --weights bf16|mxfp8" >&2; exit 2 ;; esac
case $cache in auto|bf16|e4m3) ;; *) echo "tpot_curve.sh: --cache auto|bf16|e4m3" >&2; exit 2 ;; esac
[ "$steps" -ge 2 ] 2>/dev/null || { echo "tpot_curve.sh: --steps must be >= 2" >&2; exit 2; }
if [ "$ceiling_set" = 1 ]; then
  # GB/s: 10 to 100000 (a figure in TB/s, or one off by 1000, is refused, not plotted)
  awk -v c="$ceiling" 'BEGIN { exit !(c ~ /^[0-9]+([.][0-9]+)?$/ && c + 0 >= 10 && c + 0 <= 100000) }' ||
    { echo "tpot_curve.sh: --ceiling wants the copy ceiling in GB/s, 10 to 100000 (got '$ceiling')" >&2; exit 2; }
  [ "$plot_only" = 1 ] && { echo "tpot_curve.sh: --plot-only re-renders the rows as they were computed: no --ceiling" >&2; exit 2; }
fi
t_start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t_start) )); }
if [ -z "$out" ]; then
  if [ "$plot_only" = 1 ] || [ "$append" = 1 ]; then
    echo "tpot_curve.sh: --plot-only and --append work on an earlier run's folder: give it with --out DIR" >&2; exit 2
  fi
  if [ "$fake" = 1 ]; then out=${TMPDIR:-/tmp}/tpot-fake; else out=$root/bench/results/tpot-$(date +%Y%m%d-%H%M%S); fi
fi
mkdir -p "$out/tpot-logs"
dat=$out/tpot_curve.dat md=$out/tpot_curve.md png=$out/tpot_curve.png
wfmt=${weights:-mxfp8}   # m3kit's default for --preset minimax-m3 (hidden >= 4096 -> MXFP8)
# The contexts as run: prompt + generated tokens must fit
# max_position_embeddings (1M), so the 1M point is a prompt that ends just
# before it (8 spare: the baseline's warm-up steps, so that both run the same
# prompt length).  Every run, baseline and .dat row uses these.
contexts_sp=$(for c in $(echo "$contexts" | tr ',' ' '); do
  if [ $(( c + steps + 8 )) -gt 1048576 ]; then echo $(( 1048576 - steps - 8 )); else echo "$c"; fi; done)

# ---- the spec's byte counts (awk: doubles are exact far beyond these sizes) ----------------------
# roof FMT KVB IDXB T -> "weight_bytes kv_bytes roofline_ms";  model_bytes FMT -> bytes m3kit allocates
roof() {
  awk -v f="$1" -v kvb="$2" -v ib="$3" -v T="$4" -v bw="$bw" 'function lin(r, c) { return f == "bf16" ? 2*r*c : r*c*(1 + 1/32) }
  BEGIN { H = 6144; V = 200064; I = 3072; S = 3072; F = 12288; E = 128; Q = 8192
    w = 3*(lin(9216, H) + lin(H, Q) + lin(2*F, H) + lin(H, F))
    w += 57*(lin(9856, H) + lin(H, Q) + 4*E*H + 4*E + 4*(lin(2*I, H) + lin(H, I)) + lin(2*S, H) + lin(H, S))
    w += 2*V*H + 2*H + 60*4*H
    sel = T < 2048 ? T : 2048
    kv = 3*T*4*2*128*kvb + 57*(4*sel*2*128*kvb + T*128*ib)
    printf "%.0f %.0f %.4f\n", w, kv, (w + kv)/(bw*1e9)*1e3 }'
}
model_bytes() {  # m3_model_bytes(): 8 resident experts per MoE layer, RoPE table, norms
  awk -v f="$1" 'function lin(r, c) { return f == "bf16" ? 2*r*c : r*c + r*(c/32) }
  BEGIN { H = 6144; V = 200064; I = 3072; S = 3072; F = 12288; E = 128; Q = 8192
    b = 2*V*H*2 + 2*H + 2*1048576*64
    b += 3*(4*H + 1024 + lin(9216, H) + lin(H, Q) + lin(2*F, H) + lin(H, F))
    b += 57*(4*H + 1024 + lin(9856, H) + lin(H, Q) + 4*E*H + 4*E + 8*(lin(2*I, H) + lin(H, I)) + lin(2*S, H) + lin(H, S))
    printf "%.0f\n", b }'
}
gpu_bytes=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | awk '{printf "%.0f", $1*1048576}')
[ -n "$gpu_bytes" ] || gpu_bytes=149000000000   # H200: 143771 MiB
pick_cache() {  # context -> bf16|e4m3 for m3kit (weights + caches + 6 GB of workspace and slack)
  [ "$cache" != auto ] && { echo "$cache"; return; }
  awk -v w="$(model_bytes "$wfmt")" -v t="$(( $1 + steps ))" -v g="$gpu_bytes" \
    'BEGIN { print (w + 137472*t + 6e9 <= g) ? "bf16" : "e4m3" }'
}
fmt_ms() { [ -n "$1" ] && [ "$1" != - ] && printf '%.3f' "$1" || printf -- '-'; }

# ---- the table and the plot from the .dat --------------------------------------------------------
# columns: context m3_cache m3_tpot_ms roof_ms torch_tpot_ms torch_cache torch_roof_ms kernels_ms peak_gb
render() {
  {
    echo "# Decode TPOT against context, batch 1 (\`m3kit run --preset minimax-m3 --resident-experts 8\`)"
    echo
    [ -f "$out/tpot-logs/fake" ] && echo "**FAKE DATA (tpot_curve.sh --fake): made-up numbers that test the table and the plot.**" && echo
    echo "Made by \`bench/tpot_curve.sh $(awk 'NR > 1 { printf "` + `bench/tpot_curve.sh --append " } { printf "%s", $0 }' "$out/tpot-logs/args" 2>/dev/null)\` on $(cat "$out/tpot-logs/gpu" 2>/dev/null || echo '?');"
    echo "m3kit weights: $(cat "$out/tpot-logs/wfmt" 2>/dev/null || echo "$wfmt"); the PyTorch eager baseline (bench/baseline_torch.py) uses bf16 weights."
    echo "TPOT: m3kit's mean decode step (CUDA graph); torch: median of CUDA-event-timed eager steps."
    echo "Roofline = bytes the step must read / $(cat "$out/tpot-logs/ceiling" 2>/dev/null || echo '4278 GB/s (the H200 copy ceiling; not measured)') (weights used: 4 routed + 1 shared expert, MXFP8 = 1 + 1/32 B"
    echo "or bf16 = 2 B per weight, fp32 routers, bf16 lm_head; + dense-layer KV of the whole history + 16 selected"
    echo "blocks x 4 KV heads per sparse layer + the index-K scan; formula in bench/tpot_curve.sh). Target: TPOT <= 1.15 x roofline."
    echo
    echo "| context | caches | m3kit TPOT ms | roofline ms | m3kit / roofline | torch TPOT ms | torch caches | torch roofline ms (bf16 w) | torch / m3kit | sum of per-op graphs ms/step (--graph-breakdown) | peak GPU GB |"
    echo "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"
    sort -n "$dat" | awk '$1 !~ /^#/ {
      r = ($3 != "-" && $4 != "-") ? sprintf("%.2f", $3/$4) : "-"
      q = ($3 != "-" && $5 != "-") ? sprintf("%.2f", $5/$3) : "-"
      printf "| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, r, $5, $6, $7, q, $8, $9 }'
    echo
    echo "Plot: tpot_curve.png. Logs: tpot-logs/."
  } > "$md"
  command -v gnuplot >/dev/null 2>&1 || { echo "tpot_curve.sh: no gnuplot: $md written, no plot" >&2; return 0; }
  sort -n "$dat" | grep -v '^#' > "$out/tpot-logs/plot.dat"
  gnuplot <<EOF
set terminal pngcairo size 1100,700 font ",11"
set output "$png"
set datafile missing "-"
set title "MiniMax-M3 batch-1 decode TPOT vs context ($(cat "$out/tpot-logs/gpu" 2>/dev/null | sed 's/"//g'))$( [ -f "$out/tpot-logs/fake" ] && echo ' -- FAKE DATA')"
set xlabel "context (tokens)"
set ylabel "TPOT (ms)"
set logscale x 2
set xtics ("8K" 8192, "32K" 32768, "128K" 131072, "384K" 393216, "769K" 769000, "1M" 1048576)
set grid
set key top left
plot "$out/tpot-logs/plot.dat" using 1:3 with linespoints lw 2 pt 7 title "m3kit run ($(cat "$out/tpot-logs/wfmt" 2>/dev/null || echo "$wfmt") weights)", \
     "" using 1:4 with lines lw 2 dt 2 lc rgb "black" title "roofline (bytes read / copy ceiling)", \
     "" using 1:(\$4*1.15) with lines lw 1 dt 3 lc rgb "gray40" title "1.15 x roofline (target)", \
     "" using 1:5 with linespoints lw 2 pt 5 title "PyTorch eager (bf16 weights)", \
     "" using 1:7 with lines lw 1 dt 4 title "roofline, bf16 weights (torch)"
EOF
  echo "tpot_curve.sh: wrote $md and $png"
}

if [ "$plot_only" = 1 ]; then
  [ -f "$dat" ] || { echo "tpot_curve.sh: no $dat" >&2; exit 1; }
  render; exit 0
fi
if [ "$append" = 1 ] && [ "$fake" = 0 ] && [ -f "$out/tpot-logs/fake" ] && [ -f "$dat" ]; then
  echo "tpot_curve.sh: $out holds made-up rows (--fake): append real ones to a folder of their own" >&2; exit 2
fi

# ---- the copy ceiling of this card, this call --------------------------------------------------
find_m3kit() {
  if [ -z "$m3kit" ]; then
    for p in ./m3kit "$root/.dev/m3kit" "$root/build/m3kit" "$(command -v m3kit 2>/dev/null)"; do
      [ -n "$p" ] && [ -x "$p" ] && { m3kit=$p; break; }
    done
  fi
}
find_m3kit
how="given with --ceiling"
ceil_opt=${ceiling:+ --ceiling $ceiling}
# --append keeps the earlier call's ceiling, so that every row of the table is against one figure
prev=$( [ "$append" = 1 ] && [ -f "$dat" ] && sed -n 's/^\([0-9][0-9.]*\) GB\/s.*/\1/p' "$out/tpot-logs/ceiling" 2>/dev/null | head -n 1)
if [ -n "$prev" ]; then
  if [ -n "$ceiling" ] && [ "$ceiling" != "$prev" ]; then
    echo "tpot_curve.sh: --ceiling $ceiling, but the rows in $out are against $prev GB/s: --append keeps one ceiling" >&2; exit 2
  fi
  ceiling=$prev how=$(sed -n 's/^[0-9][0-9.]* GB\/s, //p' "$out/tpot-logs/ceiling" | head -n 1)
  case $how in *"(kept by --append)") ;; *) how="$how (kept by --append)";; esac
fi
rm -f "$out/tpot-logs/ceiling.md"
if [ -z "$ceiling" ] && [ "$fake" = 0 ] && [ -n "$m3kit" ] && [ -x "$m3kit" ]; then
  # m3kit bench measures the copy first; one small case keeps the rest short
  M3KIT_BENCH_CASE="fp32 router" timeout 120 "$m3kit" bench --only ffn --out "$out/tpot-logs/ceiling.md" \
    > "$out/tpot-logs/ceiling.log" 2>&1
  ceiling=$(sed -n 's/.*device-to-device copy \([0-9][0-9.]*\) GB\/s.*/\1/p' "$out/tpot-logs/ceiling.md" 2>/dev/null | head -n 1)
  how="measured in this call (m3kit bench's device-to-device copy, read + write)"
  [ -n "$ceiling" ] || echo "tpot_curve.sh: the copy ceiling could not be measured ($out/tpot-logs/ceiling.log): using 4278 GB/s" >&2
fi
if [ -z "$ceiling" ]; then ceiling=4278; how="the H200 copy ceiling (shared/spec/h200-anchors.md), not measured here"; fi
bw=$ceiling
echo "$ceiling GB/s, $how" > "$out/tpot-logs/ceiling"
echo "== copy ceiling for the roofline: $(cat "$out/tpot-logs/ceiling")"

[ "$append" = 1 ] || : > "$out/tpot-logs/args"
printf '%s\n' "--budget $budget --contexts $contexts --steps $steps$( [ $timing = 1 ] && echo ' --breakdown')${weights:+ --weights $weights} --cache $cache$ceil_opt${m3args:+ --m3kit-args \"$m3args\"}" >> "$out/tpot-logs/args"
echo "$wfmt" > "$out/tpot-logs/wfmt"
rm -f "$out/tpot-logs/fake"
(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep . || echo "no GPU") > "$out/tpot-logs/gpu"

# rows kept from an earlier call (--append), minus the contexts rerun now
tmp=$out/tpot-logs/new.dat
: > "$tmp"
if [ "$append" = 1 ] && [ -f "$dat" ]; then
  awk -v L=",$(echo $contexts_sp | tr ' ' ',')," '$1 ~ /^#/ || index(L, "," $1 ",") == 0' "$dat" > "$tmp"
fi

if [ "$fake" = 1 ]; then
  : > "$out/tpot-logs/fake"
  for c in $contexts_sp; do
    k=$(pick_cache "$c"); b=$([ "$k" = bf16 ] && echo 2 || echo 1)
    set -- $(roof "$wfmt" $b $b $(( c + steps / 2 ))); r=$3
    set -- $(roof bf16 $b $b $(( c + steps / 2 ))); rt=$3
    awk -v c="$c" -v k="$k" -v r="$r" -v rt="$rt" 'BEGIN { srand(c); printf "%d %s %.3f %.3f %.3f %s %.3f %.3f %.1f\n",
      c, k, r*(1.08 + 0.1*rand()), r, rt*(2.2 + rand()), k, rt, r*1.05, 60 + c*137472/1e9*(k == "bf16" ? 1 : 0.5) }' >> "$tmp"
  done
  mv "$tmp" "$dat"; render; exit 0
fi

# ---- the PyTorch eager baseline, one process for every context ------------------------------------
tres=$out/tpot-logs/torch.log
: > "$tres"
py=${PYTHON:-python3}
if [ "$torch" = 1 ] && [ -f "$here/baseline_torch.py" ] && "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  dts=
  for c in $contexts_sp; do dts="$dts${dts:+,}$(pick_cache "$c")"; done
  tb=${torch_budget:-$(( budget / 3 ))}
  [ "$tb" -gt "$(( $(left) - 60 ))" ] && tb=$(( $(left) - 60 ))
  if [ "$tb" -ge 30 ]; then
    echo "== torch baseline: contexts $contexts, caches $dts, at most $tb s"
    # the same prompt lengths as m3kit's: prompt + steps within max_position_embeddings (1M)
    tctx=$(echo $contexts_sp | tr ' ' ',')
    timeout "$tb" "$py" "$here/baseline_torch.py" --contexts "$tctx" --cache-dtype "$dts" --steps "$steps" --ceiling-gbps "$bw" \
      --json "$out/tpot-logs/torch.json" > "$tres" 2>&1
    echo "   rc=$? $(grep -c '^RESULT' "$tres") contexts measured ($tres)"
  fi
else
  [ "$torch" = 1 ] && echo "== torch baseline skipped: no python3 with torch and a CUDA GPU" | tee "$tres"
fi

# ---- m3kit, one run per context --------------------------------------------------------------------
[ -n "$m3kit" ] && [ -x "$m3kit" ] || { echo "tpot_curve.sh: no m3kit binary (--m3kit PATH)" >&2; exit 1; }
run_m3() {  # context cache extra-args log -> rc (log holds the output); sets c, k, x, log (sh has no locals)
  c=$1 k=$2 x=$3 log=$4
  t=$(( $(left) - 10 ))
  [ "$t" -lt 30 ] && { echo "skipped: budget spent" > "$log"; return 124; }
  kv=; [ "$k" = e4m3 ] && kv="--kv-dtype e4m3 --index-dtype e4m3"
  # shellcheck disable=SC2086
  echo "\$ $m3kit run --preset minimax-m3 --resident-experts 8 --max-new-tokens $steps --context $c $kv${weights:+ --weights $weights} $x $m3args" > "$log"
  # shellcheck disable=SC2086
  timeout "$t" "$m3kit" run --preset minimax-m3 --resident-experts 8 --max-new-tokens "$steps" --context "$c" \
    $kv ${weights:+--weights $weights} $x $m3args >> "$log" 2>&1
}
for c in $contexts_sp; do
  k=$(pick_cache "$c")
  log=$out/tpot-logs/m3kit-$c.log
  echo "== m3kit run --context $c ($k caches), $(left) s left"
  bd=; [ "$timing" = 1 ] && bd=--graph-breakdown
  run_m3 "$c" "$k" "$bd" "$log"; rc=$?
  if [ "$rc" != 0 ] && [ "$k" = bf16 ] && grep -q "tokens fit\|cannot allocate" "$log"; then
    echo "   bf16 caches do not fit: rerun with e4m3"; k=e4m3
    mv "$log" "$out/tpot-logs/m3kit-$c-bf16-refused.log"
    run_m3 "$c" "$k" "$bd" "$log"; rc=$?
  fi
  tpot=$(sed -n 's/^TPOT \([0-9.]*\) ms.*/\1/p' "$log" | tail -n 1)
  peak=$(sed -n 's/^peak GPU memory in use \([0-9.]*\) GB.*/\1/p' "$log" | tail -n 1)
  echo "   rc=$rc TPOT ${tpot:--} ms, peak ${peak:--} GB ($log)"
  kern=-
  if [ "$timing" = 1 ]; then
    kern=$(awk '$1 == "sum" && $2 == "of" && $3 == "ops" { printf "%.3f", $4 }' "$log")
    whole=$(awk '$1 == "whole" && $2 == "step" { printf "%.3f", $3 }' "$log")
    echo "   graph breakdown: ops sum ${kern:--} ms, whole-step replay ${whole:--} ms"
    [ -n "$kern" ] || kern=-
  fi
  b=$([ "$k" = bf16 ] && echo 2 || echo 1)
  set -- $(roof "$wfmt" $b $b $(( c + steps / 2 ))); r=$3
  tr_=$(sed -n "s/^RESULT context=$c cache=\([a-z0-9]*\) tpot_ms=\([0-9.]*\) .*roofline_ms=\([0-9.]*\).*/\2 \1 \3/p" "$tres" | head -n 1)
  [ -n "$tr_" ] || tr_="- - -"
  set -- $tr_
  echo "$c $k ${tpot:--} $(fmt_ms "$r") $1 $2 $3 $kern ${peak:--}" >> "$tmp"
done
mv "$tmp" "$dat"
render
echo "tpot_curve.sh: $(( $(date +%s) - t_start )) s of the $budget s budget"
