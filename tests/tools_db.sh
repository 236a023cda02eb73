#!/bin/sh
# tools_db.sh - the Python tools that edit a tuning DB (tools/seed_pin.py, seed_arm.py, rekey.py,
# seed_merge.py, all reading through tools/tunedb_file.py's loader) refuse what m3kit would not
# rewrite either, no GPU: a DB of a newer format version (m3kit: "newer than this m3kit's 1: not
# touching it"), one without a version, and malformed ones (an array at the top level, a record that
# is not an object, "candidates" given as a string, ...).  Each tool must exit nonzero with one line
# naming the file (never a Python traceback) and leave the file byte-identical.  A good DB (a copy
# of cache/seed/sm_90.json) still loads, and seed_pin.py still pins one of its records.
set -eu
m3kit=${M3KIT_BIN:-./m3kit} # make check exports M3KIT_BIN (Makefile.am)
fail() { echo "tools_db.sh: $*" >&2; exit 1; }
top=$(cd "$(dirname "$0")/.." && pwd)
tools=${TOOLS_DB_TOOLS:-$top/tools} # another copy of tools/ (to show what this test catches)
seed=$top/cache/seed/sm_90.json
py=${PYTHON:-python3}
command -v "$py" > /dev/null 2>&1 || { echo "tools_db.sh: no $py: skipped"; exit 77; }
[ -x "$m3kit" ] || fail "no m3kit binary at $m3kit (set M3KIT_BIN)"
tmp=$(mktemp -d)
tmp=$(cd "$tmp" && pwd -P) # the tools name a DB by its real path
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/t"
TMPDIR=$tmp/t # the tools' private m3kit caches (seed_pin.py, rekey.py)
PYTHONDONTWRITEBYTECODE=1 # nothing written beside the tools (srcdir is read-only under distcheck)
export TMPDIR PYTHONDONTWRITEBYTECODE

# The record to pin: the first one whose template hash is the one this m3kit renders, with its own
# tile (a pin may name the tuner's pick), so that only the loader stands between a tool and a rewrite.
"$m3kit" gen --templates > "$tmp/templates.txt"
pick=$("$py" - "$seed" "$tmp/templates.txt" << 'EOF'
import json, re, sys
hashes = dict(re.findall(r'^(\w+)\s+\(template hash ([0-9a-f]+)\)', open(sys.argv[2]).read(), re.M))
for r in json.load(open(sys.argv[1]))['records']:
    if hashes.get(r['key'].split('(')[0]) == r['provenance']['template_hash'] and \
            any(c['tile'] == r['tile'] and c['disposition'] == 'PASSED' for c in r.get('candidates') or []):
        print('%s\t%s\t%s' % (r['key'], r['bucket'], r['tile']))
        break
EOF
)
[ -n "$pick" ] || fail "no record of $seed is current under $m3kit's templates"
tab=$(printf '\t')
key=${pick%%"$tab"*}; rest=${pick#*"$tab"}; bucket=${rest%%"$tab"*}; tile=${rest#*"$tab"}

# bad DBs, each a copy of the seed with one thing broken, and the message the loader must give
"$py" - "$seed" "$tmp" << 'EOF'
import json, sys
seed, out = sys.argv[1], sys.argv[2]
def bad(name, edit):
    d = json.load(open(seed))
    d = edit(d) or d  # an edit returns None, or the whole new document
    with open('%s/%s.json' % (out, name), 'w') as f:
        json.dump(d, f, indent=1)
def rec(i, field, value):
    def edit(d):
        d['records'][i][field] = value
    return edit
bad('v2', lambda d: d.update(version=2))
bad('nover', lambda d: d.__delitem__('version'))
bad('vertrue', lambda d: d.update(version=True))
bad('array', lambda d: d['records'])
bad('recstr', lambda d: d['records'].__setitem__(3, 'oops'))
bad('candstr', rec(5, 'candidates', 'threads=512'))
bad('candnum', lambda d: d['records'][5]['candidates'].__setitem__(1, 7))
bad('tilenum', rec(7, 'tile', 4))
bad('nohash', lambda d: d['records'][2]['provenance'].__delitem__('template_hash'))
EOF
cat > "$tmp/cases" << 'EOF'
v2 has format version 2, newer than this m3kit's 1: not touching it
nover not an m3kit tuning DB: "version" is missing
vertrue not an m3kit tuning DB: "version" is a boolean, not a positive integer
array not an m3kit tuning DB: the top level is an array, not an object
recstr record 3: a string, not an object
candstr record 5: field candidates: a string, not an array
candnum record 5: field candidates[1]: a number, not an object
tilenum record 7: field tile: a number, not a string
nohash record 2: field provenance.template_hash: missing
EOF

cp "$seed" "$tmp/good.json"
# refused NAME WANT TOOL ARGS...: TOOL exits nonzero, its message names $tmp/NAME.json and says WANT, no
# traceback, and neither that file nor the good one changed
refused() {
  name=$1 want=$2 tool=$3
  shift 3
  f=$tmp/$name.json
  cp "$f" "$tmp/before"
  cp "$tmp/good.json" "$tmp/good.before"
  rc=0
  "$py" "$tools/$tool" "$@" > "$tmp/out" 2> "$tmp/err" || rc=$?
  [ "$rc" != 0 ] || fail "$tool on $name.json: exit 0 ($(cat "$tmp/out"))"
  grep -q Traceback "$tmp/err" && fail "$tool on $name.json: a traceback: $(cat "$tmp/err")"
  grep -qF "$f" "$tmp/err" || fail "$tool on $name.json: the message does not name the file: $(cat "$tmp/err")"
  grep -qF "$want" "$tmp/err" || fail "$tool on $name.json: not '$want': $(cat "$tmp/err")"
  cmp -s "$f" "$tmp/before" || fail "$tool changed $name.json"
  cmp -s "$tmp/good.json" "$tmp/good.before" || fail "$tool on $name.json changed the good DB"
  [ ! -e "$tmp/arm.json" ] || fail "$tool on $name.json wrote an arm"
  rm -f "$f.lock"
}
n=0
while read -r name want; do
  f=$tmp/$name.json
  refused "$name" "$want" seed_pin.py "$f" "$key" "$bucket" "$tile" --why test --m3kit "$m3kit"
  refused "$name" "$want" seed_arm.py "$f" "$tmp/arm.json" --set "${tile%%=*}=0" --m3kit "$m3kit"
  refused "$name" "$want" rekey.py "$f" "$top/templates" --m3kit "$m3kit"
  refused "$name" "$want" seed_merge.py "$f"
  refused "$name" "$want" seed_merge.py "$tmp/good.json" "$f"
  n=$((n + 1))
done < "$tmp/cases"
echo "tools_db.sh: $n bad DBs refused by seed_pin.py, seed_arm.py, rekey.py and seed_merge.py, files untouched"

# the good DB still loads, through each tool
good=$tmp/good.json
PYTHONPATH=$tools "$py" -c 'import sys, tunedb_file; d = tunedb_file.load(sys.argv[1]); print(len(d["records"]))' \
  "$good" > "$tmp/out" || fail "the loader refused $seed: $(cat "$tmp/out")"
nrec=$(cat "$tmp/out")
"$py" "$tools/seed_merge.py" "$good" || fail "seed_merge.py refused $seed"
cmp -s "$good" "$seed" || fail "seed_merge.py re-formatted $seed differently"
"$py" "$tools/rekey.py" "$good" "$top/templates" --m3kit "$m3kit" --dry-run > "$tmp/out" ||
  fail "rekey.py --dry-run on $seed: $(cat "$tmp/out")"
grep -q "^$good: [0-9]* current" "$tmp/out" || fail "rekey.py --dry-run on $seed: $(cat "$tmp/out")"
rc=0
"$py" "$tools/seed_arm.py" "$good" "$tmp/arm.json" --template no_such_template --set a=b --m3kit "$m3kit" \
  2> "$tmp/err" || rc=$?
[ "$rc" = 1 ] && grep -q "no record changed" "$tmp/err" || fail "seed_arm.py on $seed: exit $rc: $(cat "$tmp/err")"
"$py" "$tools/seed_pin.py" "$good" "$key" "$bucket" "$tile" --why "tools_db.sh" --m3kit "$m3kit" > "$tmp/out" ||
  fail "seed_pin.py on $seed failed"
PYTHONPATH=$tools "$py" - "$good" "$key" "$bucket" "$tile" "$nrec" << 'EOF' || fail "the pinned DB is not as expected"
import sys, tunedb_file
path, key, bucket, tile, n = sys.argv[1:]
d = tunedb_file.load(path)
r = [r for r in d['records'] if r['key'] == key and r['bucket'] == bucket]
assert len(d['records']) == int(n) and len(r) == 1 and r[0]['tile'] == tile and r[0]['pinned'] == 'tools_db.sh', r
EOF
echo "tools_db.sh: a copy of $(basename "$seed") ($nrec records) loads; seed_pin.py pinned $key at $bucket to [$tile]"
