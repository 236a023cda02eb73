#!/bin/sh
# cli_gen.sh - `m3kit gen --tiles` and its --valid-only filter (tools/cmd_gen.c),
# no GPU: the filtered list is exactly the VALID rows of the full one, with the
# same count line; --valid-only without --tiles is refused (exit 2); and the
# verdicts carry valid()'s reasons (merge=acqrel is decode-only); a valid()
# that fails is reported as the template error it is.
set -eu
m3kit=${M3KIT_BIN:-./m3kit} # make check exports M3KIT_BIN (Makefile.am)
fail() { echo "cli_gen.sh: $*" >&2; exit 1; }
dec='attn_sparse(mode=decode,kv=e4m3,nq=64,nkv=4,hd=128,bs=128,topk=16)'
pre='attn_sparse(mode=prefill,kv=e4m3,nq=64,nkv=4,hd=128,bs=128,topk=16)'
all=$("$m3kit" gen --tiles "$dec")
only=$("$m3kit" gen --tiles "$dec" --valid-only)
[ "$(printf '%s\n' "$all" | grep '  VALID')" = "$(printf '%s\n' "$only" | grep '^  \[')" ] ||
  fail "--valid-only rows are not the full list's VALID rows"
printf '%s\n' "$only" | grep -q INVALID && fail "--valid-only listed an INVALID tile"
[ "$(printf '%s\n' "$all" | tail -n 1)" = "$(printf '%s\n' "$only" | tail -n 1)" ] || fail "the count lines differ"
n=$(printf '%s\n' "$only" | grep -c '^  \[')
[ "$n" -gt 1 ] || fail "only $n valid decode tiles"
printf '%s\n' "$only" | grep -q 'merge=acqrel' || fail "no valid merge=acqrel decode tile"
printf '%s\n' "$only" | grep -q 'merge=acqrel.*(default)' || fail "the decode default is not merge=acqrel"
pa=$("$m3kit" gen --tiles "$pre" | grep 'merge=acqrel') || fail "no prefill merge=acqrel tile listed"
printf '%s\n' "$pa" | grep -q '  VALID' && fail "a prefill merge=acqrel tile is valid"
printf '%s\n' "$pa" | grep -q 'INVALID: merge (the split-K hand-over) applies to decode only' ||
  fail "no prefill merge=acqrel tile gives valid()'s reason"
rc=0
"$m3kit" gen --valid-only > /dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "--valid-only without --tiles: exit $rc, want 2"
# a valid() that fails (a template error) is an error, not an INVALID verdict
tpl=$(mktemp -d)
trap 'rm -rf "$tpl"' EXIT
cat > "$tpl/vbad.lua" <<'LUA'
return {axes = {{'a', {1}}}, tiles = {{'t', {1, 2}}},
  valid = function(k, t) if t.t == 2 then error('boom') end return true end,
  default_tile = function() return {t = 1} end,
  render = function() return {source = 'x', threads = 32, smem = 0} end}
LUA
rc=0
out=$(M3KIT_TEMPLATE_DIR="$tpl" "$m3kit" gen --tiles 'vbad(a=1)@sm_90' 2>&1) || rc=$?
[ "$rc" = 1 ] || fail "--tiles over a failing valid(): exit $rc, want 1: $out"
printf '%s\n' "$out" | grep -q 'M3_TEMPLATE: vbad.valid: .*vbad.lua:2: boom' || fail "--tiles hid valid()'s error: $out"
# An arch NVRTC does not know: an error naming it, and no cache folder made for it.
for a in sm_999:"does not compile for it" sm_80a:"no 'a' target below sm_90" sm_90f:"no 'f' target below sm_100"; do
  rc=0
  out=$(M3KIT_CACHE_DIR="$tpl/c999" "$m3kit" gen --compile 'embed(hidden=256)' --arch "${a%%:*}" 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "--compile --arch ${a%%:*}: exit $rc, want 1: $out"
  printf '%s\n' "$out" | grep -q "SM arch ${a%%:*}: .*${a#*:}" || fail "--arch ${a%%:*}: $out"
  [ ! -e "$tpl/c999/cubin/${a%%:*}" ] || fail "--arch ${a%%:*} left a cubin folder for it"
done
# --tiles of a key that names a tile, and an --arch list with a repeat: option errors
for a in "--tiles embed(hidden=256)[threads=512]" "--all --arch sm_90,sm_80,sm_90"; do
  rc=0
  "$m3kit" gen $a > /dev/null 2>&1 || rc=$?
  [ "$rc" = 2 ] || fail "gen $a: exit $rc, want 2"
done
echo "cli_gen.sh: $n valid decode tiles listed alike"
