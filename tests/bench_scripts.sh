#!/bin/sh
# bench_scripts.sh - the benchmark scripts a GPU session relies on still work, no GPU:
#  * each ablation script (bench/indexer_ablate.sh, gemv_ablate.sh, attn_ablate.sh) applies every
#    default variant's edit to the current templates (--edit-only): an edit that no longer matches
#    a template is a "template edit failed" row and exit 1 (gemv_ablate.sh once built nothing for
#    every variant and exited 0), and a template copy with a pattern broken on purpose must fail;
#    an unknown variant is exit 2 before anything runs (python3 needed: skipped without it);
#  * bench/tpot_curve.sh --fake renders its table, --append merges without a second row for a
#    context (the 1M point runs as 1048536 tokens), and --plot-only / --append want --out;
#  * bench/template_ab.sh stops with exit 2 before it makes anything when it has no m3kit binary,
#    or (on a machine without one: nvidia-smi -L, or /dev/nvidia*) no GPU: it used to run every step into rc 127 and
#    write an empty ab.md.
set -eu
m3kit=${M3KIT_BIN:-./m3kit} # make check exports M3KIT_BIN (Makefile.am)
fail() { echo "bench_scripts.sh: $*" >&2; exit 1; }
top=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$m3kit" ] || fail "no m3kit binary at $m3kit (set M3KIT_BIN)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ablate() { s=$1; shift; sh "$top/bench/${s}_ablate.sh" --m3kit "$m3kit" "$@"; }
tc() { sh "$top/bench/tpot_curve.sh" "$@"; }
ab() { sh "$top/bench/template_ab.sh" --family qknorm_rope --bench qknorm_rope "$@"; }

if command -v python3 > /dev/null 2>&1; then
  for s in indexer gemv attn; do
    rc=0
    ablate "$s" --edit-only --templates "$top/templates" --out "$tmp/$s" > "$tmp/$s.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || fail "${s}_ablate.sh --edit-only: exit $rc: $(grep -v 'template edited' "$tmp/$s.log" | head -3)"
    n=$(grep -c 'template edited$' "$tmp/$s/ablate.tsv" || true)
    [ "$n" -ge 4 ] || fail "${s}_ablate.sh --edit-only: $n variants edited"
    rc=0; VARIANTS="full nosuchvariant" ablate "$s" --edit-only --templates "$top/templates" --out "$tmp/v$s" > /dev/null 2>&1 || rc=$?
    [ "$rc" = 2 ] && [ ! -e "$tmp/v$s/ablate.tsv" ] || fail "${s}_ablate.sh with an unknown variant: exit $rc, want 2 before any row"
  done

  # a template the gemv script's default-tile pattern does not match: every variant fails, exit 1
  cp -r "$top/templates" "$tmp/tpl"
  sed -i 's/pipe = 3, tpc = 1, lead = 0, lean = 0,$/pipe = 3, tpc = 1, lead = 0, lean=0,/' "$tmp/tpl/mxfp8.lua"
  ! cmp -s "$tmp/tpl/mxfp8.lua" "$top/templates/mxfp8.lua" || fail "the test's template edit changed nothing (mxfp8.lua moved on)"
  rc=0
  VARIANTS=full ablate gemv --edit-only --templates "$tmp/tpl" --out "$tmp/bad" > "$tmp/bad.log" 2>&1 || rc=$?
  [ "$rc" = 1 ] || fail "gemv_ablate.sh with a template it cannot edit: exit $rc, want 1"
  grep -q 'template edit failed' "$tmp/bad/ablate.tsv" || fail "gemv_ablate.sh: no 'template edit failed' row"
else
  echo "bench_scripts.sh: no python3 (the ablation scripts edit templates with it): their checks skipped"
fi

tc --fake --out "$tmp/tc" > /dev/null 2>&1 || fail "tpot_curve.sh --fake failed"
grep -q 'FAKE DATA' "$tmp/tc/tpot_curve.md" || fail "tpot_curve.sh --fake: the table does not say FAKE"
[ "$(grep -c '^| [0-9]' "$tmp/tc/tpot_curve.md")" = 6 ] || fail "tpot_curve.sh --fake: not 6 rows"
tc --fake --append --contexts 1048576,8192 --out "$tmp/tc" > /dev/null 2>&1 || fail "tpot_curve.sh --fake --append failed"
# one ceiling a table: --append keeps the earlier call's and refuses another; real rows never join made-up ones
rc=0; tc --fake --append --ceiling 2139 --contexts 8192 --out "$tmp/tc" > /dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "tpot_curve.sh --append with another --ceiling: exit $rc, want 2"
grep -q '^Roofline = bytes the step must read / 4278 GB/s' "$tmp/tc/tpot_curve.md" || fail "tpot_curve.sh: the table does not name its ceiling"
rc=0; tc --append --no-torch --contexts 8192 --m3kit /bin/false --out "$tmp/tc" > /dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "tpot_curve.sh: real rows appended to a --fake folder: exit $rc, want 2"
for v in 0 3.35 abc ''; do
  rc=0; tc --fake --ceiling "$v" --out "$tmp/tc2" > /dev/null 2>&1 || rc=$?
  [ "$rc" = 2 ] || fail "tpot_curve.sh --ceiling '$v': exit $rc, want 2"
done
[ "$(grep -c . "$tmp/tc/tpot_curve.dat")" = 6 ] || fail "tpot_curve.sh --append: $(grep -c . "$tmp/tc/tpot_curve.dat") rows, want 6 (a context twice?)"
for o in --plot-only --append; do
  rc=0; (cd "$tmp" && OUT='' tc $o > /dev/null 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "tpot_curve.sh $o without --out: exit $rc, want 2"
done

rc=0; (cd "$tmp" && ab --out "$tmp/ab1" a=- > /dev/null 2>&1) || rc=$?
[ "$rc" = 2 ] && [ ! -e "$tmp/ab1" ] || fail "template_ab.sh without ./m3kit: exit $rc (want 2), or it made $tmp/ab1"
if command -v nvidia-smi > /dev/null 2>&1; then nvidia-smi -L > /dev/null 2>&1 && gpu=1 || gpu=0
else ls /dev/nvidia[0-9]* > /dev/null 2>&1 && gpu=1 || gpu=0; fi
if [ "$gpu" = 0 ]; then
  rc=0; ab --m3kit "$m3kit" --out "$tmp/ab2" a=- > /dev/null 2>&1 || rc=$?
  [ "$rc" = 2 ] && [ ! -e "$tmp/ab2" ] || fail "template_ab.sh without a GPU: exit $rc (want 2), or it made $tmp/ab2"
fi
echo "bench_scripts.sh: ablation edits apply (a broken one fails, an unknown variant is refused); tpot_curve.sh fake/append/plot-only and template_ab.sh's refusals as expected"
