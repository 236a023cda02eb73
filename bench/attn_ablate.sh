#!/bin/sh
# attn_ablate.sh - where the decode attention's time goes, without hardware
# counters: time variants that leave one stage out, take differences.  Device
# run 67's ncu of dense decode (bf16, H100) found the SMs idle for 8 us of
# 17.8 at 8K, 13 of 102 at 128K and 33 of 708 at 1M: a part that does not grow
# with the context and a part that does.  These variants split the first
# into its stages.  For each case (a bench row, its template and a tile) and
# each variant it renders the templates with that tile as the decode default
# and, for the ablations, one stage cut out, and times `m3kit bench --only
# attention` on that one row with no tuning DB.
#
#   sh attn_ablate.sh [--rounds N] [--out DIR] [--m3kit PATH] [--templates DIR] [--dry-run | --edit-only]
#
# --out defaults to $OUT/attn-ablate ($OUT: /tmp/out); --dry-run compiles every
# variant (m3kit gen --compile, NVRTC, no GPU) instead of timing it.  --edit-only
# only makes each variant's template copy (checks that the edits still apply).  Results:
# DIR/ablate.tsv (round, case, variant, tile, median us, graph us, GB/s, % of copy).
#
# Variants (VARIANTS="..." picks; default all):
#   full      the case's tile as it is
#   nomerge   the last CTA of a (token, KV head) hands over and returns: no
#             cross-split merge (lib/attn_mma.lua MERGE's publish, then return)
#   nokv      the KV tile loop is cut (no K/V bytes read): launch, metadata,
#             the warps' merge, the partials, the hand-over and the merge
#             alone - the fixed cost of a launch at this grid (q, loaded for
#             nothing then, may be dropped by the compiler)
#   nokvmerge nokv and nomerge: launch and the partials alone
# The ablations compute wrong answers: this measures time only.
# Cases: CASES="name:template:bench row:tile;..." (template attn_dense or
# attn_sparse; tile: every tile axis of it); default: dense decode bf16 and
# e4m3 at 8K and 128K, and sparse decode bf16 batch 1, at the sm_90 seed's tiles.
set -u
rounds=1 dry=0 out=${OUT:-/tmp/out}/attn-ablate m3kit=./m3kit tdir=./templates
me=attn_ablate.sh
. "$(dirname "$0")/ablate_common.sh"
[ -f "$tdir/lib/attn_mma.lua" ] || { echo "attn_ablate.sh: no $tdir/lib/attn_mma.lua" >&2; exit 2; }
dbf=warps=8,ctas=1,depth=1,cvt=alu,lead=1,merge=acqrel
d8=warps=8,ctas=1,depth=1,cvt=hw,lead=1,merge=acqrel
d128=warps=8,ctas=1,depth=1,cvt=alu,lead=0,merge=acqrel
e128=warps=8,ctas=1,depth=2,cvt=hw,lead=1,merge=acqrel
cases=${CASES:-"d8k:attn_dense:dense decode bf16 ctx 8192:$dbf;d128k:attn_dense:dense decode bf16 ctx 131072:$d128;e8k:attn_dense:dense decode e4m3 ctx 8192:$d8;e128k:attn_dense:dense decode e4m3 ctx 131072:$e128;s1:attn_sparse:sparse decode bf16 batch 1:warps=8,ctas=1,depth=1,cvt=alu,merge=acqrel"}
variants=${VARIANTS:-"full nomerge nokv nokvmerge"}
check_variants "full nomerge nokv nokvmerge"

# make_dir NAME TEMPLATE TILE ABLATION: a templates copy whose TEMPLATE decode default is TILE, with the ablation applied
make_dir() {
  d=$out/tpl-$1
  rm -rf "$d" && cp -r "$tdir" "$d"
  python3 - "$d" "$2" "$(lua_tile "$3")" "$4" <<'PY' || return 1
import re, sys
d, tpl, tile, abl = sys.argv[1:5]
def edit(path, pat, rep, what, literal=True):
    s = open(path).read()
    t, n = re.subn(re.escape(pat) if literal else pat, lambda m: rep, s)
    if n == 0: sys.exit("attn_ablate.sh: %s not found in %s" % (what, path))
    open(path, "w").write(t)
edit("%s/%s.lua" % (d, tpl), r'if k\.mode == "decode" then return \{[^}]*\} end', 'if k.mode == "decode" then return {%s} end' % tile,
     "the decode default_tile", literal=False)
mma = d + "/lib/attn_mma.lua"
if abl in ("nomerge", "nokvmerge"):   # both MERGE publish forms end in this line
    edit(mma, "  if (!*sflag) return;\n]]", "  return; /* ablation: no merge */\n]]", "MERGE's publish")
if abl in ("nokv", "nokvmerge"):
    edit(mma, "  $attend(c, cstart + 16 * warp, cend, 16 * NW, qa, scale2, m, l, o, lane);",
         "  (void)cend; /* ablation: no KV tiles */", "the decode attend call")
PY
  echo "$d"
}

res=$out/ablate.tsv
printf 'round\tcase\tvariant\ttile\tmedian_us\tgraph_us\tGB/s\tpct_copy\n' > "$res"
for r in $(seq 1 "$rounds"); do
  echo "$cases" | tr ';' '\n' | while IFS=: read -r nm tpl row tile; do
    [ -n "$nm" ] || continue
    for v in $variants; do
      d=$(make_dir "$v-$nm" "$tpl" "$tile" "$v") || { edit_failed "$r" "$nm" "$v" "$tile"; continue; }
      [ "$dry" = 2 ] && { edited "$r" "$nm" "$v" "$tile"; continue; }
      md=$out/bench-$v-$nm-$r.md
      if [ "$dry" = 1 ]; then
        kv=bf16; case $row in *e4m3*) kv=e4m3;; esac
        key="$tpl(mode=decode,kv=$kv,nq=64,nkv=4,hd=128,bs=128)"
        [ "$tpl" = attn_sparse ] && key="$tpl(mode=decode,kv=$kv,nq=64,nkv=4,hd=128,bs=128,topk=16)"
        M3KIT_TEMPLATE_DIR=$d "$m3kit" gen --compile "$key[$tile]@sm_90" > "$md.log" 2>&1
        printf '%s\t%s\t%s\t%s\tcompile rc=%s\t\t\t\n' "$r" "$nm" "$v" "$tile" "$?" | tee -a "$res"
        continue
      fi
      M3KIT_TEMPLATE_DIR=$d M3KIT_SEED_DB=/nonexistent M3KIT_CACHE_DIR=${M3KIT_CACHE_DIR:-/tmp/m3kit-cache}-attn-ablate \
        M3KIT_BENCH_CASE="$row" timeout 120 "$m3kit" bench --only attention --out "$md" > "$md.log" 2>&1
      rc=$?
      line=$(grep -F "| $row" "$md" 2>/dev/null | head -n 1)   # the sparse rows go on: "(16 x 128 x 4)"
      f() { echo "$line" | awk -F'|' -v i="$1" '{gsub(/^ +| +$/, "", $i); print $i}'; }
      med=$(f 5) gr=$(f 8) gbs=$(f 10) pct=$(f 11)
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$nm" "$v" "$tile" "${med:-no row (bench rc=$rc, see $md.log)}" \
        "${gr:-}" "${gbs:-}" "${pct:-}" | tee -a "$res"
    done
  done
done
ablate_done
