#!/bin/sh
# indexer_ablate.sh - where the decode indexer's time goes, without hardware
# counters (the device tool's METHOD.md, outside this repository: time variants that leave one stage out, take
# differences).  For each case (index-K dtype, context, tile) and each variant
# it renders templates/index_decode.lua with that tile as the default and,
# for the ablations, one stage cut out, and times `m3kit bench --only indexer`
# on that one case with no tuning DB (so the default tile is what runs).
#
#   sh indexer_ablate.sh [--rounds N] [--out DIR] [--m3kit PATH] [--templates DIR] [--dry-run | --edit-only]
#
# --out defaults to $OUT/ablate ($OUT: /tmp/out); --dry-run compiles every
# variant (m3kit gen --compile, NVRTC, no GPU) instead of timing it.  --edit-only
# only makes each variant's template copy (checks that the edits still apply).  Results:
# DIR/ablate.tsv (round, dtype, context, variant, tile, event median us, graph
# us a launch), each run's bench table and log beside it.
#
# Variants (VARIANTS="..." picks; default all but lead2 and both, which only
# apply to lead=1 tiles, and the seed's are lead=2 since session 24):
#   fence     the case's tile with merge=fence
#   acqrel    the case's tile with merge=acqrel
#   lead2     lead=2, merge=fence  (cases whose tile has lead=1; skipped, said so, otherwise)
#   both      lead=2, merge=acqrel (likewise)
#   nomerge   every CTA returns after writing its split's list (no handover, no merge)
#   handover  the last CTA returns after the counter (handover, no merge)
#   noscore   no keys are read by the score loop (U = 0; a lead >= 1 tile still prefetches its first keys into L2)
#   empty     the kernel returns right after its opening (launch, metadata, grid wait)
# The four ablations use the case's tile with merge=$MERGE (default acqrel).
# They compute wrong answers: this measures time only, never use their output.
# Cases: CASES="idxk:context:tile;..." (tile without merge); default: the
# sm_90 seed's tiles of bf16 8K, 128K and 1M and e4m3 1M (session 24).
set -u
rounds=1 dry=0 out=${OUT:-/tmp/out}/ablate m3kit=./m3kit tdir=./templates
me=indexer_ablate.sh
. "$(dirname "$0")/ablate_common.sh"
[ -f "$tdir/index_decode.lua" ] || { echo "indexer_ablate.sh: no $tdir/index_decode.lua" >&2; exit 2; }
cases=${CASES:-"bf16:8192:warps=4,depth=2,waves=2,chunk=32,cvt=alu,lead=2;bf16:131072:warps=4,depth=2,waves=1,chunk=8,cvt=alu,lead=2;bf16:1048576:warps=4,depth=2,waves=1,chunk=16,cvt=alu,lead=2;e4m3:1048576:warps=4,depth=2,waves=1,chunk=16,cvt=hw,lead=2"}
merge=${MERGE:-acqrel}
variants=${VARIANTS:-"fence acqrel nomerge handover noscore empty"}
check_variants "fence acqrel lead2 both nomerge handover noscore empty"


# make_dir NAME TILE ABLATION: a templates copy whose index_decode default is TILE, with the ablation applied
make_dir() {
  d=$out/tpl-$1
  rm -rf "$d" && cp -r "$tdir" "$d"
  f=$d/index_decode.lua
  t=$(lua_tile "$2")
  sed -i -E "s|^  return \{warps = 4, depth = k.idxk == \"e4m3\" and 4 or 2, .*\}$|  return {$t}|" "$f"
  grep -q "return {$t}" "$f" || { echo "indexer_ablate.sh: default_tile not replaced in $f" >&2; return 1; }
  cp "$f" "$f.pre"
  case $3 in
    nomerge) sed -i 's|^  if (n_splits == 1) return;$|  return; /* ablation: no handover, no merge */|' "$f";;
    handover) sed -i 's|^  if (!s_last) return;$|  if (tid == 0 \&\& s_last) counters[t] = 0u; return; /* ablation: no merge */|' "$f";;
    noscore) # the score loop's U (the line before its buffers), not the lead-in prefetch's
      python3 - "$f" <<'PY' || return 1
import re, sys
p = sys.argv[1]; s = open(p).read()
s2, n = re.subn(r"    const int U = n_c \* GPB;\n(    const int u0 = .*\n    uint4 buf\[DEPTH\]\[CH\];)",
                r"    const int U = 0; /* ablation: no keys read */\n\1", s)
if n != 1: sys.exit("indexer_ablate.sh: the score loop's U found %d times in %s" % (n, p))
open(p, "w").write(s2)
PY
      ;;
    empty) sed -i 's|^\$prologue\$opening|$prologue  if (H) return; /* ablation: nothing after the opening */\n$opening|' "$f";;
  esac
  if [ "$3" != none ] && cmp -s "$f" "$f.pre"; then echo "indexer_ablate.sh: ablation $3 changed nothing in $f" >&2; return 1; fi
  rm -f "$f.pre"
  echo "$d"
}

res=$out/ablate.tsv
printf 'round\tidxk\tcontext\tvariant\ttile\tmedian_us\tgraph_us\n' > "$res"
for r in $(seq 1 "$rounds"); do
  echo "$cases" | tr ';' '\n' | while IFS=: read -r ix ctx tile; do
    [ -n "$ix" ] || continue
    case $tile in *nf=*) ;; *) tile="$tile,nf=scan";; esac # tile axis nf (session 37): scan is the old code
    base=$(echo "$tile" | sed -E 's/,?lead=[0-9]//; s/,?merge=[a-z]+//')
    lead=$(echo "$tile" | sed -nE 's/.*lead=([0-9]).*/\1/p'); lead=${lead:-0}
    for v in $variants; do
      case $v in
        fence) t="$base,lead=$lead,merge=fence" a=none;;
        acqrel) t="$base,lead=$lead,merge=acqrel" a=none;;
        lead2|both)
          if [ "$lead" != 1 ]; then echo "indexer_ablate.sh: $v skipped for $ix $ctx: its tile has lead=$lead" >&2; continue; fi
          m=fence; [ "$v" = both ] && m=acqrel
          t="$base,lead=2,merge=$m" a=none;;
        nomerge|handover|noscore|empty) t="$base,lead=$lead,merge=$merge" a=$v;;
      esac
      d=$(make_dir "$v-$ix-$ctx" "$t" "$a") || { edit_failed "$r" "$ix" "$ctx" "$v" "$t"; continue; }
      [ "$dry" = 2 ] && { edited "$r" "$ix" "$ctx" "$v" "$t"; continue; }
      md=$out/bench-$v-$ix-$ctx-$r.md
      if [ "$dry" = 1 ]; then
        M3KIT_TEMPLATE_DIR=$d "$m3kit" gen --compile "index_decode(idxk=$ix,heads=4,hd=128,bs=128,topk=16,init=0,local=1)[$t]@sm_90" \
          > "$md.log" 2>&1
        printf '%s\t%s\t%s\t%s\t%s\tcompile rc=%s\t\n' "$r" "$ix" "$ctx" "$v" "$t" "$?" | tee -a "$res"
        continue
      fi
      M3KIT_TEMPLATE_DIR=$d M3KIT_SEED_DB=/nonexistent M3KIT_CACHE_DIR=${M3KIT_CACHE_DIR:-/tmp/m3kit-cache}-ablate \
        M3KIT_BENCH_CASE="batch 1, $ctx $ix" timeout 120 "$m3kit" bench --only indexer --out "$md" > "$md.log" 2>&1
      rc=$?
      row=$(grep -E "^\| batch 1, $ctx \| $ix \|" "$md" 2>/dev/null | head -n 1)
      med=$(echo "$row" | awk -F'|' '{gsub(/ /,"",$7); print $7}')
      gr=$(echo "$row" | awk -F'|' '{gsub(/ /,"",$10); print $10}')
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$ix" "$ctx" "$v" "$t" "${med:-no row (bench rc=$rc, see $md.log)}" "${gr:-}" | tee -a "$res"
    done
  done
done
ablate_done
