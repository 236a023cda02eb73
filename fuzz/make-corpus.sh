#!/bin/sh
# make-corpus.sh - regenerate the fuzz seed corpora from files m3kit itself
# writes: a small checkpoint from tests/st_dump (m3_ckpt_write), the presets,
# DBs from the tunedb API, cubin entries from m3_cubin_store with a fake
# cubin, and variant keys from `m3kit gen --list`.
#
#   fuzz/make-corpus.sh BUILD_DIR [OUT_DIR]     (or: make fuzz-corpus)
#
# OUT_DIR defaults to fuzz/corpus in the source tree.  Seeds are written next
# to what is already there (same names are replaced); regression inputs
# (regress-*) and anything the fuzzer added are left alone.  The committed
# corpus stays small (< 1 MiB in all): only a few seeds per harness.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [OUT_DIR]" >&2; exit 2; }
B=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-$SRC/fuzz/corpus}
make -C "$B" -s all >/dev/null # BUILT_SOURCES first
make -C "$B" -s tests/st_dump fuzz/make_seeds >/dev/null
T=$(mktemp -d "${TMPDIR:-/tmp}/m3corpus.XXXXXX")
trap 'rm -rf "$T"' EXIT
export M3KIT_CACHE_DIR="$T/cache"
for h in safetensors st_index config tunedb cubin variant code_hash; do mkdir -p "$OUT/$h"; done

# Checkpoint: the tiny preset cut to 4 layers (3 dense + 1 sparse/MoE), 2 shards.
"$B/tests/st_dump" write "$T/ckpt" --layers 4 --shards 2 --seed 7
"$B/fuzz/make_seeds" st "$T/ckpt" "$OUT/safetensors" "$OUT/st_index"

# config.json: the presets as shipped, the checkpoint's own (VL wrapper,
# written by m3_config_to_json_vl), and re-serialised forms.
for p in "$SRC"/runtime/presets/*.json; do cp "$p" "$OUT/config/preset-$(basename "$p")"; done
chmod 644 "$OUT"/config/*.json
cp "$T/ckpt/config.json" "$OUT/config/ckpt-config.json"
"$B/fuzz/make_seeds" config "$OUT/config"

"$B/fuzz/make_seeds" tunedb "$OUT/tunedb"
rm -f "$OUT"/tunedb/*.lock # save_merge's lock files are not inputs
"$B/fuzz/make_seeds" cubin "$OUT/cubin"

# Variant keys: what the presets need, one with a tile and an arch, one per arch.
i=0
for preset in minimax-m3 tiny; do
  "$B/m3kit" gen --list --preset "$preset" | grep '(' | head -3 | while read -r k; do
    printf '%s' "$k" > "$OUT/variant/key-$preset-$(printf '%s' "$k" | cksum | cut -d' ' -f1)"
  done
done
k=$("$B/m3kit" gen --list --preset minimax-m3 | grep '^qknorm_rope(' | tail -1)
printf '%s[warps=4,hpw=1,lph=32,rope=pair]@sm_90' "$k" > "$OUT/variant/key-tile-arch"
printf '%s@sm_100a' "$k" > "$OUT/variant/key-arch-only"

# Kernel sources: small rendered templates (the normaliser's real input) and
# the C corners it must lex (splices, raw strings, digit separators).
"$B/m3kit" gen --emit "$k[warps=4,hpw=1,lph=32,rope=pair]@sm_90" | tail -n 60 > "$OUT/code_hash/qknorm-tail.cu"
printf 'auto s = R"x(a" // b\\\n)x"; int n = 1'"'"'000; // c \\\nx = 1;\n#define A 1 /*\n*/ B\n' > "$OUT/code_hash/corners.cu"

du -sh "$OUT"
for h in safetensors st_index config tunedb cubin variant code_hash; do
  printf '%-12s %3d files\n' "$h" "$(ls "$OUT/$h" | wc -l)"
done
