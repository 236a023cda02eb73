#!/bin/sh
# template_ab.sh - A/B of template trees on this GPU, in one call: each arm
# NAME=DIR (DIR a copy of templates/, "-" for the ones built into m3kit) gets
# a cubin cache and tuning DB of its own, tunes FAMILY at SHAPES once (a
# changed template has no seed record, so its untuned tile would be the
# default: the tuner's pick is the fair comparison), then `m3kit bench`
# times it; bench rounds are interleaved so that drift hits every arm alike.
#
#   sh template_ab.sh --family qknorm_rope --shapes tokens=8192 --bench qknorm_rope \
#     --case tokens=8192 --budget 100 --rounds 2 --out DIR old=tpl-old new=-
#
# Writes DIR/NAME-tune.log, DIR/NAME-ROUND.md (the bench's tables) and
# DIR/ab.md (every arm's rows side by side, round by round).
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
    -h|--help) sed -n '2,14p' "$0"; exit 0;;
    --*) echo "template_ab.sh: unknown option $1" >&2; exit 2;;
    *) break;;
  esac
done
[ -n "$fam" ] && [ -n "$bench" ] && [ -n "$out" ] && [ $# -ge 1 ] || {
  echo "template_ab.sh: needs --family, --bench, --out and at least one NAME=DIR arm (--help)" >&2; exit 2; }
for a in "$@"; do
  case $a in *=*) ;; *) echo "template_ab.sh: arm '$a' is not NAME=DIR" >&2; exit 2;; esac
  d=${a#*=}
  [ "$d" = - ] || [ -f "$d/$fam.lua" ] || { echo "template_ab.sh: $d/$fam.lua not found (arm ${a%%=*})" >&2; exit 2; }
done
mkdir -p "$out"
base=${TMPDIR:-/tmp}/template-ab.$$
arm_env() { # NAME DIR -> the environment of that arm
  d=$2; [ "$d" = - ] || case $d in /*) ;; *) d=$PWD/$d;; esac
  if [ "$2" = - ]; then echo "M3KIT_CACHE_DIR=$base/$1"; else echo "M3KIT_CACHE_DIR=$base/$1 M3KIT_TEMPLATE_DIR=$d"; fi
}
for a in "$@"; do
  n=${a%%=*}
  # shellcheck disable=SC2046
  env $(arm_env "$n" "${a#*=}") timeout $((budget + 60)) "$m3kit" tune --only "$fam" ${shapes:+--shapes "$shapes"} \
    --budget "$budget" > "$out/$n-tune.log" 2>&1
  echo "tune $n rc=$?"
done
r=1
while [ "$r" -le "$rounds" ]; do
  for a in "$@"; do
    n=${a%%=*}
    # shellcheck disable=SC2046
    env $(arm_env "$n" "${a#*=}") M3KIT_BENCH_CASE="$case" "$m3kit" bench --only "$bench" --out "$out/$n-$r.md" \
      > "$out/$n-$r.log" 2>&1
    echo "bench $n round $r rc=$?"
  done
  r=$((r + 1))
done
{
  echo "# template A/B: $fam at ${shapes:-every shape}, bench $bench${case:+ (case $case)}, $rounds round(s)"
  echo
  for a in "$@"; do echo "- arm ${a%%=*}: templates ${a#*=}"; done
  r=1
  while [ "$r" -le "$rounds" ]; do
    for a in "$@"; do
      n=${a%%=*}
      echo; echo "## $n, round $r"; echo
      grep -E '^\| ' "$out/$n-$r.md" 2>/dev/null | grep -vE '^\|---' || echo "(no rows: see $n-$r.log)"
    done
    r=$((r + 1))
  done
} > "$out/ab.md"
rm -rf "$base"
echo "template_ab.sh: wrote $out/ab.md"
