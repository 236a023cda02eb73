#!/bin/sh
# cli_run_emu.sh - `m3kit run` on the CPU emulator (tests/emu_m3kit,
# docs/emulator.md), tiny preset: sampling at temperature 1 over the tiny
# model's nearly flat logits gives the two sequences of a batch different
# first tokens.  Each sequence is prefilled on its own and sampled as row 0;
# keyed alike, both once drew the same uniform (tools/cmd_run.c prefill_step):
# the same first token for every seed.  Also `m3kit bench` there: a
# M3KIT_BENCH_CASE that matches no case is exit 1 with a message (it used to
# be an empty report and exit 0), and each section has one heading; `m3kit tune`
# there records the command as typed.
set -eu
emu=${M3KIT_EMU_BIN:-./tests/emu_m3kit} # make check exports M3KIT_EMU_BIN (Makefile.am)
fail() { echo "cli_run_emu.sh: $*" >&2; exit 1; }
[ -x "$emu" ] || { echo "cli_run_emu.sh: no $emu (make tests/emu_m3kit): skipping"; exit 77; }
if ldd "$emu" 2> /dev/null | grep -q libasan; then
  echo "cli_run_emu.sh: the CPU emulator's fiber stacks are not AddressSanitizer-clean: skipping"
  exit 77
fi
out=$("$emu" run --prompt-ids 5 --max-new-tokens 1 --batch 2 --temperature 1 --seed 1 2>&1) || fail "run: $out"
t0=$(printf '%s\n' "$out" | sed -n 's/^sequence 0: //p')
t1=$(printf '%s\n' "$out" | sed -n 's/^sequence 1: //p')
[ -n "$t0" ] && [ -n "$t1" ] || fail "no tokens printed: $out"
[ "$t0" != "$t1" ] || fail "both sequences drew the same first token ($t0): one random draw shared"
echo "cli_run_emu.sh: first tokens $t0 and $t1 at temperature 1, seed 1"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
rep=$scratch/bench.md
rc=0
M3KIT_BENCH_CASE="no such case" "$emu" bench --only insert,indexer --out "$rep" > "$scratch/bench.err" 2>&1 || rc=$?
err=$(cat "$scratch/bench.err")
[ "$rc" = 1 ] || fail "bench with a case filter that matches nothing: exit $rc, want 1: $err"
printf '%s\n' "$err" | grep -q 'matched no case' || fail "bench: no 'matched no case' message: $err"
[ "$(grep -ci '^## .*indexer' "$rep")" = 1 ] || fail "bench: the indexer section's heading is not there once: $(grep '^## ' "$rep")"
grep -q '^Command: `m3kit bench --only insert,indexer --out ' "$rep" || fail "bench: the report's command line: $(grep '^Command' "$rep")"
echo "cli_run_emu.sh: bench refuses a case filter that matches nothing"

# The command a tuning record keeps is the one typed (it once read "m3kit m3kit tune ..."): the tiny preset, one shape.
c=$scratch/cache
M3KIT_CACHE_DIR=$c "$emu" tune --preset tiny --only embed --shapes tokens=1 > "$scratch/tune.log" 2>&1 ||
  { cat "$scratch/tune.log" >&2; fail "tune on the emulator failed"; }
grep -q '"command": "m3kit tune --preset tiny --only embed --shapes tokens=1"' "$c"/tuning/*.json ||
  { grep -h '"command"' "$c"/tuning/*.json >&2; fail "the tuning record's command is not the one typed"; }
echo "cli_run_emu.sh: a tuning record keeps the command as typed"
