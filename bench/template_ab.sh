#!/bin/sh
# template_ab.sh - A/B of template trees on this GPU, in one call: each arm
# NAME=DIR (DIR a copy of templates/, "-" for the ones built into m3kit) gets
# a cubin cache and tuning DB of its own and no seed DB (a seed record would
# serve an arm whose template it matches and not the other), tunes FAMILY at
# SHAPES from empty, then `m3kit bench` times it; bench rounds are
# interleaved so that drift hits every arm alike.  A shape the tune's budget
# cut runs the default tile in that arm: ab.md says how many were tuned.
#
#   sh template_ab.sh --family qknorm_rope --shapes tokens=8192 --bench qknorm_rope \
#     --case tokens=8192 --budget 150 --rounds 2 --out DIR [--m3kit PATH] old=tpl-old new=-
#
# --family: the tune's kernel family (m3kit tune --help); --bench: the bench's
# (m3kit bench --help); --case: M3KIT_BENCH_CASE for the bench; --m3kit: the
# binary (default ./m3kit, as in .dev/ on the GPU machine; a name without a
# slash is looked up in PATH).  A GPU is needed (refused at once where
# nvidia-smi, or without it /dev/nvidia*, says there is none).
#
# Writes DIR/NAME-tune.log, DIR/NAME-ROUND.md and .log (the bench's), and
# DIR/ab.md (a summary: each arm's mean time a row and its ratio to the first arm; then each
# round's tables, arm after arm, with every exit status).
# Exit status 1 if any tune or bench failed (ab.md is written all the same),
# 2 for bad options, no m3kit binary or no GPU (nothing run).
set -u
fam= shapes= bench= case= budget=120 rounds=2 out= m3kit=./m3kit
while [ $# -gt 0 ]; do
  case $1 in
    --family) fam=$2; shift 2;;
    --shapes) shapes=$2; shift 2;;
    --bench) bench=$2; shift 2;;
    --case) case=$2; shift 2;;
    --budget) budget=$2; shift 2;;
    --rounds) rounds=$2; shift 2;;
    --out) out=$2; shift 2;;
    --m3kit) m3kit=$2; shift 2;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    --*) echo "template_ab.sh: unknown option $1" >&2; exit 2;;
    *) break;;
  esac
done
[ -n "$fam" ] && [ -n "$bench" ] && [ -n "$out" ] && [ $# -ge 1 ] || {
  echo "template_ab.sh: needs --family, --bench, --out and at least one NAME=DIR arm (--help)" >&2; exit 2; }
case $rounds$budget in *[!0-9]*|'') echo "template_ab.sh: --rounds and --budget take whole numbers" >&2; exit 2;; esac
for a in "$@"; do
  case ${a%%=*} in ''|*[!A-Za-z0-9_.-]*) echo "template_ab.sh: arm '$a' is not NAME=DIR (NAME: letters, digits, . _ -)" >&2; exit 2;; esac
  case $a in *=*) ;; *) echo "template_ab.sh: arm '$a' is not NAME=DIR" >&2; exit 2;; esac
  d=${a#*=}
  [ "$d" = - ] || [ -f "$d/$fam.lua" ] || { echo "template_ab.sh: $d/$fam.lua not found (arm ${a%%=*})" >&2; exit 2; }
done
# A name without a slash is looked up in PATH, as the shell would run it.
command -v "$m3kit" > /dev/null 2>&1 || { echo "template_ab.sh: no m3kit binary at $m3kit (--m3kit PATH)" >&2; exit 2; }
# Whether there is a GPU: nvidia-smi's list where it is installed, else a
# /dev/nvidia<N> device (without one every arm's m3kit tune would exit 3).
if command -v nvidia-smi > /dev/null 2>&1; then nvidia-smi -L > /dev/null 2>&1; else ls /dev/nvidia[0-9]* > /dev/null 2>&1; fi ||
  { echo "template_ab.sh: no GPU here (nvidia-smi -L, /dev/nvidia*): an A/B needs one" >&2; exit 2; }
mkdir -p "$out" || exit 2
base=$(mktemp -d "${TMPDIR:-/tmp}/template-ab.XXXXXX") || exit 2
trap 'rm -rf "$base"' EXIT
trap 'exit 130' INT TERM
status="$out/.status"
: > "$status"
# Runs "$@" in arm NAME's environment (DIR: its templates, or - for m3kit's own).
in_arm() {
  n=$1 d=$2; shift 2
  if [ "$d" = - ]; then
    env -u M3KIT_TEMPLATE_DIR M3KIT_CACHE_DIR="$base/$n" M3KIT_SEED_DB=/nonexistent "$@"
  else
    case $d in /*) ;; *) d=$PWD/$d;; esac
    env M3KIT_TEMPLATE_DIR="$d" M3KIT_CACHE_DIR="$base/$n" M3KIT_SEED_DB=/nonexistent "$@"
  fi
}
fail=0
for a in "$@"; do
  n=${a%%=*}
  in_arm "$n" "${a#*=}" timeout $((budget + 60)) "$m3kit" tune --only "$fam" ${shapes:+--shapes "$shapes"} \
    --budget "$budget" > "$out/$n-tune.log" 2>&1
  rc=$?
  cut=$(grep -oE '[0-9]+ of [0-9]+ shapes tuned' "$out/$n-tune.log" | tail -n 1)
  echo "tune $n rc=$rc${cut:+ (budget reached: $cut)}" | tee -a "$status"
  [ $rc = 0 ] || fail=1
done
r=1
while [ "$r" -le "$rounds" ]; do
  for a in "$@"; do
    n=${a%%=*}
    in_arm "$n" "${a#*=}" env M3KIT_BENCH_CASE="$case" "$m3kit" bench --only "$bench" --out "$out/$n-$r.md" \
      > "$out/$n-$r.log" 2>&1
    rc=$?
    echo "bench $n round $r rc=$rc" | tee -a "$status"
    [ $rc = 0 ] || fail=1
  done
  r=$((r + 1))
done
{
  echo "# template A/B: $fam at ${shapes:-every shape}, bench $bench${case:+ (case $case)}, $rounds round(s)"
  echo
  for a in "$@"; do echo "- arm ${a%%=*}: templates ${a#*=}"; done
  echo
  sed 's/^/    /' "$status"
  # Per row: each arm's mean over the rounds of the graph time (else the
  # median), and each arm against the first.  Rows are matched by their first
  # two cells (the case or key, and the shape or key), never by tile.
  echo; echo "## Summary: mean over the rounds, us (graph us/launch where the bench gives it, else the median)"; echo
  for a in "$@"; do
    n=${a%%=*} r=1
    while [ "$r" -le "$rounds" ]; do
      [ -f "$out/$n-$r.md" ] && sed "s/^/$n\t/" "$out/$n-$r.md"
      r=$((r + 1))
    done
  done | awk -F'\t' -v arms="$(for a in "$@"; do printf '%s ' "${a%%=*}"; done)" '
    { arm = $1; line = substr($0, length(arm) + 2) }
    line !~ /^\|/ { next }
    { nf = split(line, c, "|"); for (i = 1; i <= nf; i++) gsub(/^ +| +$/, "", c[i]) }
    c[2] == "variant" || c[2] == "case" || c[2] ~ /^-+$/ || c[4] == "tile" {   # a header (or its rule): find the time column
      if (c[2] !~ /^-+$/) { col = 0; for (i = 1; i <= nf; i++) if (c[i] ~ /^graph us/) col = i
        if (!col) for (i = 1; i <= nf; i++) if (c[i] ~ /^median/) col = i }
      next }
    col && c[col] ~ /^[0-9.]+$/ { k = c[2] " | " c[3]; if (!(k in seen)) { seen[k] = 1; order[++nk] = k }
      sum[k, arm] += c[col]; cnt[k, arm]++ }
    END {
      na = split(arms, A, " ")
      printf "| row | |"; for (a = 1; a <= na; a++) printf " %s |", A[a]
      for (a = 2; a <= na; a++) printf " %s/%s |", A[a], A[1]; printf "\n|---|---|"
      for (a = 1; a < 2 * na; a++) printf "---|"; printf "\n"
      for (i = 1; i <= nk; i++) { k = order[i]; printf "| %s |", k
        for (a = 1; a <= na; a++) if (cnt[k, A[a]]) printf " %.2f |", sum[k, A[a]] / cnt[k, A[a]]; else printf " - |"
        for (a = 2; a <= na; a++)
          if (cnt[k, A[a]] && cnt[k, A[1]]) printf " %.3f |", (sum[k, A[a]] / cnt[k, A[a]]) / (sum[k, A[1]] / cnt[k, A[1]])
          else printf " - |"
        printf "\n" } }'
  r=1
  while [ "$r" -le "$rounds" ]; do
    for a in "$@"; do
      n=${a%%=*}
      echo; echo "## $n, round $r"; echo
      # the tables as the bench wrote them, and any line saying a case failed
      grep -E '^\||failed' "$out/$n-$r.md" 2>/dev/null || echo "(no rows: see $n-$r.log)"
    done
    r=$((r + 1))
  done
} > "$out/ab.md"
rm -f "$status"
echo "template_ab.sh: wrote $out/ab.md"
exit $fail
