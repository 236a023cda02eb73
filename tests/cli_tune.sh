#!/bin/sh
# cli_tune.sh - `m3kit tune --show/--plot` without a GPU (tools/cmd_tune.c):
# a seed whose records carry tiles this m3kit refuses is not counted as used
# (the runtime's lookup re-checks every tile); --only with --show is refused,
# not ignored; --plot on an untuned machine plots the seed, as --show lists it;
# --tiles restricts the candidates (on the emulator) and refuses a list naming no tile.
set -eu
m3kit=${M3KIT_BIN:-./m3kit} # make check exports M3KIT_BIN (Makefile.am)
fail() { echo "cli_tune.sh: $*" >&2; exit 1; }
command -v python3 > /dev/null || { echo "cli_tune.sh: no python3"; exit 77; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
seed=$(dirname "$0")/../cache/seed/sm_90.json
python3 - "$seed" "$dir/seed.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d['records'][0]['tile'] = 'threads=99999'
d['records'][1]['tile'] = 'foo=1'
json.dump(d, open(sys.argv[2], 'w'))
PY
n=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['records']))" "$seed")
out=$(M3KIT_CACHE_DIR="$dir/c" M3KIT_SEED_DB="$dir/seed.json" "$m3kit" tune --show --arch sm_90 2>&1)
printf '%s\n' "$out" | grep -q "would use $((n - 2)) of them" || fail "--show counted refused tiles as used: $(printf '%s\n' "$out" | head -4)"
printf '%s\n' "$out" | grep -q "2 more have a key or tile this m3kit refuses.*threads=99999" || fail "no line for the refused tiles"
rc=0
"$m3kit" tune --show --only embed > /dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "--show --only: exit $rc, want 2"
out=$(M3KIT_CACHE_DIR="$dir/c" "$m3kit" tune --plot "$dir/plots" --arch sm_90 2>&1) || fail "--plot: $out"
printf '%s\n' "$out" | grep -q "plotting the seed DB" || fail "--plot on an untuned machine did not plot the seed: $out"
[ -f "$dir/plots/all.gp" ] || fail "--plot wrote no all.gp"
printf '%s\n' "$out" | grep -q "not there yet" || fail "--plot with no tuning DB did not say it is not there: $out"
rc=0
"$m3kit" tune --show --model "$dir/nonexistent" > /dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "--show --model: exit $rc, want 2 (--model selects what to tune)"
# what to tune is checked before the GPU is looked for (exit 2 here, not "no GPU")
for a in "--shapes=tokens=abc" "--shapes=tokens=" "--shapes==1" "--shapes=tokens=1,,2" "--shapes=tokns=1" "--only="; do
  rc=0
  out=$("$m3kit" tune "$a" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "tune $a: exit $rc, want 2: $out"
  printf '%s\n' "$out" | grep -q "is empty\|--shapes '" || fail "tune $a: $out"
done
rc=0
out=$(M3KIT_CACHE_DIR="$dir/none" "$m3kit" tune --rehash --arch sm_90 2>&1) || rc=$?
[ "$rc" = 1 ] || fail "--rehash with no tuning DB: exit $rc, want 1"
printf '%s\n' "$out" | grep -q "no tuning DB at $dir/none/tuning/sm_90.json, nothing to rehash" || fail "--rehash, no DB: $out"
[ ! -e "$dir/none" ] || fail "--rehash with no tuning DB created $dir/none"
rc=0
out=$("$m3kit" tune --show --tiles "threads=256" 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "--show --tiles: exit $rc, want 2: $out"
rc=0
out=$("$m3kit" tune --tiles= 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "tune --tiles=: exit $rc, want 2: $out"
# --tiles on the CPU emulator (its m3kit, where the build has one): only the tiles named are timed, and a
# list that names no tile of the selection is an error, not an empty tune
emu=${M3KIT_EMU_BIN:-}
if [ -n "$emu" ] && [ -x "$emu" ]; then
  out=$(M3KIT_CACHE_DIR="$dir/e" "$emu" tune --only embed --shapes tokens=1 --tiles "[threads=256]; [threads=64]" \
        --db "$dir/t.json" 2>&1) || fail "emulator tune --tiles: $out"
  printf '%s\n' "$out" | grep -Eq '^embed .*tokens=1 .*\(2/0/0 of 2\)' || fail "tune --tiles: not 2 candidates: $out"
  rc=0
  out=$(M3KIT_CACHE_DIR="$dir/e" "$emu" tune --only embed --tiles "threads=7" --db "$dir/t.json" 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "tune --tiles naming no tile: exit $rc, want 1: $out"
  printf '%s\n' "$out" | grep -q "none of the tiles 'threads=7'" || fail "tune --tiles naming no tile: $out"
fi
echo "cli_tune.sh: --show counts, --only refusal and the seed's plots as expected"
