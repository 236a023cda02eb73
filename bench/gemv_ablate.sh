#!/bin/sh
# gemv_ablate.sh - where the W8A16 (MXFP8) MoE GEMV's time goes, without
# hardware counters (the device tool's METHOD.md, outside this repository: time variants that leave one stage out, take
# differences).  For each case (a bench row and a tile) and each variant it
# renders templates/mxfp8.lua with that tile as the e4m3 ring's default and,
# for the ablations, one part of the ring's compute (ring_compute) cut out,
# and times `m3kit bench --only ffn` on that one row with no tuning DB.
#
#   sh gemv_ablate.sh [--rounds N] [--out DIR] [--m3kit PATH] [--templates DIR] [--dry-run | --edit-only]
#
# --out defaults to $OUT/gemv-ablate ($OUT: /tmp/out); --dry-run compiles every
# variant (m3kit gen --compile, NVRTC, no GPU) instead of timing it.  --edit-only
# only makes each variant's template copy (checks that the edits still apply).  Results:
# DIR/ablate.tsv (round, case, variant, tile, median us, GB/s, % of copy).
#
# Variants (VARIANTS="..." picks; default all):
#   full       the case's tile as it is
#   noscale    the E8M0 scales are neither read from the ring nor decoded (1.0)
#   nocvt      the e4m3 bytes go to the mma as they are (no cvt to fp16)
#   nocompute  ring_compute reads one word of its stage and nothing else: the
#              cp.async ring, its waits and the loop alone
#   lean       the case's tile with lean=1 (fewer instructions a block)
#   contig     each warp's ring stage (16 x rpw rows x 32 unroll bytes) is read as
#              one contiguous run: the same bytes, each once, in the order a
#              weight repacked stage by stage would hold them (rows of a full
#              tile only; the scales as they are).  What a repacked layout
#              would gain, before writing one.
#   contiglean contig with lean=1
# The three ablations compute wrong answers: this measures time only.
# Cases: CASES="name:bench row:tile;..." (tile: every tile axis); default: the
# sm_90 seed's MoE down (rpw=2, tpc=4) and gate|up tiles, both pinned at lead=1
# (session 26).
set -u
rounds=1 dry=0 out=${OUT:-/tmp/out}/gemv-ablate m3kit=./m3kit tdir=./templates
me=gemv_ablate.sh
. "$(dirname "$0")/ablate_common.sh"
[ -f "$tdir/mxfp8.lua" ] || { echo "gemv_ablate.sh: no $tdir/mxfp8.lua" >&2; exit 2; }
cases=${CASES:-"down:W8A16 moe down:warps=4,rpw=2,unroll=4,cvt=hw,pipe=3,tpc=4,lead=1,lean=0,ksplit=1;gateup:W8A16 moe gate|up:warps=4,rpw=1,unroll=4,cvt=hw,pipe=3,tpc=1,lead=1,lean=0,ksplit=1"}
variants=${VARIANTS:-"full lean noscale nocvt nocompute contig contiglean"}
check_variants "full lean noscale nocvt nocompute contig contiglean"


# make_dir NAME TILE ABLATION: a templates copy whose e4m3 ring default is TILE, with the ablation applied
make_dir() {
  d=$out/tpl-$1
  rm -rf "$d" && cp -r "$tdir" "$d"
  python3 - "$d/mxfp8.lua" "$(lua_tile "$2")" "$3" <<'PY' || return 1
import re, sys
p, tile, abl = sys.argv[1:4]
s = open(p).read()
def sub(pat, rep, txt, what):
    t, n = re.subn(pat, rep, txt)
    if n == 0: sys.exit("gemv_ablate.sh: %s not found in %s" % (what, p))
    return t
s = sub(r'      return \{warps = 4, rpw = 1, unroll = 4, cvt = m3\.sm\(arch\) >= 89 and "hw" or "alu", pipe = 3, tpc = 1, lead = 0, lean = 0,\s*ksplit = 1\}',
        '      return {%s}' % tile, s, "the e4m3 ring's default_tile")
# lean=0's ring compute: RING_COMPUTE, header text .. ring_step(decoder, scale lines) .. "}"
a = s.index("local RING_COMPUTE = [==[")
b = s.index(']==]) .. "}\\n"\n', a) + len(']==]) .. "}\\n"\n')
f = s[a:b]
if abl == "noscale":
    f = sub(r"const float (s[01]) = e8m0_to_f32\([^;]*;", r"const float \1 = 1.0f;", f, "the scales")
elif abl == "nocvt":
    f = sub(r'ring_step\("e4m3_word_f16", ', 'ring_step("E4M3_RAW", ', f, "the decoder")
    f = f.replace("local RING_COMPUTE = [==[\n", "local RING_COMPUTE = [==[\n#define E4M3_RAW(w, x, y) ((x) = (w), (y) = (w) >> 8)\n", 1)
elif abl == "nocompute":
    f = ("local RING_COMPUTE = [==[\n"
         "M3_DEV void ring_compute(float (&acc)[RPW][4], const unsigned char *st, const uint4 *xs4, int b0, int g, int tq,\n"
         "                         int ntok) {\n"
         "  (void)xs4; (void)b0; (void)g; (void)tq; (void)ntok;\n"
         "  acc[0][0] += __uint_as_float(*(const u32 *)(st + 4 * (threadIdx.x & 31)) & 0x3fffffffu);\n"
         "}\n]==]\n")
s = s[:a] + f + s[b:]
if abl in ("contig", "contiglean"):
    s = sub(re.escape("const unsigned char *src = wb + (long long)(row0 + rl) * COLS + 32 * b0 + 16 * cc;"),
            "const unsigned char *src = wb + (long long)row0 * COLS + (long long)b0 * 32 * 16 * RPW + rl * (UNR * 32) + 16 * cc;",
            s, "ring_issue's full-tile address")
    s = sub(re.escape("src + (long long)i * RSTEP * COLS, 16);"), "src + (long long)i * RSTEP * (UNR * 32), 16);", s,
            "ring_issue's row step")
open(p, "w").write(s)
PY
  echo "$d"
}

res=$out/ablate.tsv
printf 'round\tcase\tvariant\ttile\tmedian_us\tGB/s\tpct_copy\n' > "$res"
for r in $(seq 1 "$rounds"); do
  echo "$cases" | tr ';' '\n' | while IFS=: read -r nm row tile; do
    [ -n "$nm" ] || continue
    for v in $variants; do
      case $v in full|noscale|nocvt|nocompute|contig) t=$tile;; lean|contiglean) t=$(echo "$tile" | sed 's/lean=0/lean=1/');; esac
      d=$(make_dir "$v-$nm" "$t" "$v") || { edit_failed "$r" "$nm" "$v" "$t"; continue; }
      [ "$dry" = 2 ] && { edited "$r" "$nm" "$v" "$t"; continue; }
      log=$out/bench-$v-$nm-$r.log
      if [ "$dry" = 1 ]; then
        cols=6144 settled=0; [ "$nm" = down ] && cols=3072 settled=1
        M3KIT_TEMPLATE_DIR=$d "$m3kit" gen --compile \
          "mxfp8(op=gemv,w=e4m3,out=bf16,cols=$cols,nmax=1,moe=1,act=none,alpha_e6=0,limit_e6=0,beta_e6=0,combine=0,settled=$settled,route_e=0,route_k=0,route_renorm=0)[$t]@sm_90" \
          > "$log" 2>&1
        printf '%s\t%s\t%s\t%s\tcompile rc=%s\t\t\n' "$r" "$nm" "$v" "$t" "$?" | tee -a "$res"
        continue
      fi
      M3KIT_TEMPLATE_DIR=$d M3KIT_SEED_DB=/nonexistent M3KIT_CACHE_DIR=${M3KIT_CACHE_DIR:-/tmp/m3kit-cache}-gemv-ablate \
        M3KIT_BENCH_CASE="$row" timeout 120 "$m3kit" bench --only ffn > "$log" 2>&1
      rc=$?
      line=$(grep -F "ffn  $row, " "$log" | head -n 1)
      med=$(echo "$line" | sed -nE 's/.* median +([0-9.]+) us.*/\1/p')
      gbs=$(echo "$line" | sed -nE 's/.*\) +([0-9]+) GB\/s.*/\1/p')
      pct=$(echo "$line" | sed -nE 's/.* ([0-9.]+)% of .*/\1/p')
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$nm" "$v" "$t" "${med:-no row (bench rc=$rc, see $log)}" "${gbs:-}" \
        "${pct:-}" | tee -a "$res"
    done
  done
done
ablate_done
