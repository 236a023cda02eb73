#!/bin/sh
# cli_env.sh - on/off environment flags and inputs that are not files, through
# the CLI, no GPU: M3KIT_NO_JIT= and =0 are off (a cold cache compiles), =1 is
# on (a miss is an error naming the key); a FIFO or a directory given as
# config.json is refused by name without blocking (cache/store.c); run and
# tp-plan refuse --resident-experts below top-k before the no-GPU branch;
# --prompt-ids are bare digits with no trailing comma; a --tp the model cannot
# be cut into is an option error (exit 2); make-checkpoint refuses an --out
# that holds a config.json; run with no GPU builds the tuning DB's tiles too;
# getopt errors say "m3kit CMD:"; a bad M3KIT_L2_PREFETCH stops every command (exit 2).
set -eu
m3kit=${M3KIT_BIN:-./m3kit} # make check exports M3KIT_BIN (Makefile.am)
fail() { echo "cli_env.sh: $*" >&2; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
key='embed(hidden=256)'
for v in '' 0; do
  M3KIT_CACHE_DIR="$dir/c$v" M3KIT_NO_JIT="$v" "$m3kit" gen --compile "$key" > /dev/null 2>&1 ||
    fail "M3KIT_NO_JIT='$v' refused a cold compile"
done
out=$(M3KIT_CACHE_DIR="$dir/c1" M3KIT_NO_JIT=1 "$m3kit" gen --compile "$key" 2>&1) && fail "M3KIT_NO_JIT=1 compiled"
printf '%s\n' "$out" | grep -q "M3_NOJIT.*$key" || fail "M3KIT_NO_JIT=1: no error naming the key: $out"
mkdir "$dir/fifo" "$dir/isdir" "$dir/isdir/config.json"
mkfifo "$dir/fifo/config.json"
out=$(timeout 20 "$m3kit" gen --list --model "$dir/fifo" 2>&1) && fail "a FIFO config.json was accepted"
printf '%s\n' "$out" | grep -q "fifo/config.json: not a regular file" || fail "FIFO config.json: $out"
out=$("$m3kit" gen --list --model "$dir/isdir" 2>&1) && fail "a directory config.json was accepted"
printf '%s\n' "$out" | grep -q "isdir/config.json: is a directory" || fail "directory config.json: $out"
for cmd in "run" "tp-plan --preset tiny"; do
  rc=0
  out=$("$m3kit" $cmd --resident-experts 2 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "$cmd --resident-experts 2 (top-k 4): exit $rc, want 2"
  printf '%s\n' "$out" | grep -q "num_experts_per_tok 4" || fail "$cmd --resident-experts 2: $out"
done
for ids in "1," " 7" "+7"; do
  rc=0
  "$m3kit" run --prompt-ids "$ids" > /dev/null 2>&1 || rc=$?
  [ "$rc" = 2 ] || fail "run --prompt-ids '$ids': exit $rc, want 2"
done
# make-checkpoint never replaces a config.json in --out (helper-19's data loss): the
# user's file, even the --config given, is refused by name and left as it was.
mkdir "$dir/ck"
printf '{"model_type": "minimax_m3", "my_note": 1}\n' > "$dir/ck/config.json"
cp "$dir/ck/config.json" "$dir/ck.orig"
rc=0
out=$("$m3kit" make-checkpoint --config "$dir/ck/config.json" --out "$dir/ck" 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "make-checkpoint into a folder holding config.json: exit $rc, want 2"
printf '%s\n' "$out" | grep -q "ck already holds a model config (config.json)" || fail "make-checkpoint over config.json: $out"
cmp -s "$dir/ck/config.json" "$dir/ck.orig" || fail "make-checkpoint changed the config.json it refused"
# run with no GPU compiles the tiles a GPU of --arch would take from the tuning DB
# (user + seed), not only the defaults, so that a tile which no longer builds shows
# without a GPU: a seed record for the tiny model's embed at threads=512 (default 256).
th=$("$m3kit" gen --templates | sed -n 's/^embed  (template hash \([0-9a-f]*\)).*/\1/p')
[ -n "$th" ] || fail "no template hash for embed in gen --templates"
# The same tile spelled another way (a second bucket) is built once.
printf '{"format": "m3kit-tunedb", "version": 1, "records": [{"key": "embed(hidden=256)", "bucket": "tokens=1", "arch": "sm_90", "tile": "threads=512", "provenance": {"template_hash": "%s"}}, {"key": "embed(hidden=256)", "bucket": "tokens=8", "arch": "sm_90", "tile": "threads=0512", "provenance": {"template_hash": "%s"}}]}\n' \
  "$th" "$th" > "$dir/seed.json"
out=$(M3KIT_SEED_DB="$dir/seed.json" M3KIT_CACHE_DIR="$dir/cr" M3KIT_VERBOSE=1 "$m3kit" run 2>&1) || fail "run: $out"
if printf '%s\n' "$out" | grep -q "no CUDA GPU on this machine"; then   # (a GPU runs the model instead)
  printf '%s\n' "$out" | grep -q "built  embed(hidden=256)\[threads=512\]@sm_90" || fail "run (no GPU) did not build the seed's tile: $out"
  printf '%s\n' "$out" | grep -q "and 1 tuned tiles from the tuning DB" || fail "run (no GPU): tuned tile count: $out"
fi
# M3KIT_DUMP_DIR keeps one file pair an arch (the entry symbol is the same for all)
for a in sm_90 sm_80; do
  M3KIT_CACHE_DIR="$dir/cd" M3KIT_DUMP_DIR="$dir/dump" "$m3kit" gen --compile "$key" --arch $a > /dev/null 2>&1 ||
    fail "gen --compile with M3KIT_DUMP_DIR at $a"
done
[ "$(ls "$dir/dump" | grep -c '\.sm_[89]0\.cu$')" = 2 ] || fail "M3KIT_DUMP_DIR: want one .cu per arch: $(ls "$dir/dump")"
for c in run gen tp-plan tune; do
  rc=0
  out=$("$m3kit" $c --model '' 2>&1) || rc=$?
  [ "$rc" = 2 ] && printf '%s\n' "$out" | grep -q -- "--model: an empty path" || fail "$c --model '': exit $rc: $out"
done
out=$("$m3kit" tp-plan --preset minimax-m3 --tp 1) || fail "tp-plan --tp 1: $out"
printf '%s\n' "$out" | grep -q "GB  *no fit  *no fit" || fail "tp-plan --tp 1 (442 GB of weights on 141 GB): $out"
# --dump-logits: written (a GPU), or exit 3 and no file (none): never exit 0 without it
rc=0
M3KIT_CACHE_DIR="$dir/cr" "$m3kit" run --dump-logits "$dir/l.npy" > /dev/null 2>&1 || rc=$?
if [ "$rc" = 0 ]; then [ -s "$dir/l.npy" ] || fail "run --dump-logits: exit 0 and no file"
else [ "$rc" = 3 ] && [ ! -e "$dir/l.npy" ] || fail "run --dump-logits with no GPU: exit $rc, want 3 and no file"; fi
rc=0
"$m3kit" run --tp 4 > /dev/null 2>&1 || rc=$? # the embedded tiny model splits over 2 ranks at most
[ "$rc" = 2 ] || fail "run --tp 4 on the tiny model: exit $rc, want 2 (an option error)"
echo "cli_env.sh: flags, non-files, --resident-experts, --prompt-ids and --tp checks as expected"

# getopt's own errors name the command as the user typed it ("m3kit tune: ..."; they said "tune: ...")
for c in tune bench run gen; do
  rc=0; out=$("$m3kit" "$c" --no-such-option 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "$c --no-such-option: exit $rc, want 2"
  printf '%s\n' "$out" | head -n 1 | grep -q "^m3kit $c: unrecognized option" || fail "$c --no-such-option: $(printf '%s\n' "$out" | head -n 1)"
done
echo "cli_env.sh: option errors name the command"

# M3KIT_L2_PREFETCH is read when a forward is created, after the model has loaded; a bad value stops every
# command at once (exit 2, naming the variable), also run with no GPU, where no forward is created
for c in "gen --list" "run --preset tiny --max-new-tokens 2"; do
  for v in 257 1,2 ' 5' 0x10; do
    rc=0; out=$(M3KIT_CACHE_DIR="$dir/cp" M3KIT_L2_PREFETCH="$v" "$m3kit" $c 2>&1) || rc=$?
    [ "$rc" = 2 ] || fail "M3KIT_L2_PREFETCH='$v' $c: exit $rc, want 2"
    printf '%s\n' "$out" | grep -q "M3KIT_L2_PREFETCH='$v'" || fail "M3KIT_L2_PREFETCH='$v' $c: $out"
  done
done
M3KIT_L2_PREFETCH=24,16,0 "$m3kit" gen --list > /dev/null 2>&1 || fail "M3KIT_L2_PREFETCH=24,16,0 refused"
echo "cli_env.sh: M3KIT_L2_PREFETCH's bad values stop every command"
