# ablate_common.sh - what indexer_ablate.sh, gemv_ablate.sh and attn_ablate.sh
# share: their options, the tile-to-Lua conversion and the failure record.  Sourced (. ablate_common.sh)
# after the script sets me (its name) and the defaults of rounds, dry, out,
# m3kit and tdir, which the options then override.
need() { [ $# -ge 2 ] || { echo "$me: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) need "$@"; rounds=$2; shift 2;;
    --out) need "$@"; out=$2; shift 2;;
    --m3kit) need "$@"; m3kit=$2; shift 2;;
    --templates) need "$@"; tdir=$2; shift 2;;
    --dry-run) dry=1; shift;;
    --edit-only) dry=2; shift;;
    -h|--help) sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    *) echo "$me: unknown option $1" >&2; exit 2;;
  esac
done

# A tile as a Lua table literal: warps=8,cvt=alu -> warps = 8, cvt = "alu"
lua_tile() { echo "$1" | tr ',' '\n' | sed -E 's/^([a-z]+)=([0-9]+)$/\1 = \2/; s/^([a-z]+)=([a-z0-9]+)$/\1 = "\2"/' | paste -sd, - | sed 's/,/, /g'; }
mkdir -p "$out" && rm -f "$out/.edit-failed"
[ "$dry" = 2 ] || command -v "$m3kit" > /dev/null 2>&1 || { echo "$me: no m3kit at $m3kit (give it with --m3kit PATH)" >&2; exit 2; }
# check_variants KNOWN: every name in $variants is one of KNOWN, before anything
# runs (inside the sweep's pipeline an exit would only end a subshell).
check_variants() {
  for v in $variants; do
    case " $1 " in *" $v "*) ;; *) echo "$me: unknown variant $v (known: $1)" >&2; exit 2;; esac
  done
}

# A variant whose template edit failed (the template moved on and the script's
# pattern no longer matches) is a row saying so in ablate.tsv and makes the
# script exit 1 at the end (ablate_done): a sweep of nothing must not look done.
edit_failed() { # ROUND CASE... VARIANT TILE: the row's leading fields
  { printf '%s\t' "$@"; printf 'template edit failed: this script no longer matches the template\n'; } | tee -a "$res"
  : > "$out/.edit-failed"
}
edited() { # ROUND CASE... VARIANT TILE (--edit-only: the template copy was made, nothing compiled)
  { printf '%s\t' "$@"; printf 'template edited\n'; } | tee -a "$res"
}
ablate_done() {
  if [ -f "$out/.edit-failed" ]; then
    echo "$me: some variants were not built (template edit failed; rows in $res)" >&2
    exit 1
  fi
}
