#!/usr/bin/env python3
"""seed_merge.py SEED [NEW_DB ...] [--replace PREFIX,...] - merge tuning DB records into the seed
(a record of NEW_DB replaces the seed's record of the same (key, bucket, arch), or is appended; with
--replace only the keys starting with a PREFIX are taken, and the seed's own records of those keys are
dropped first) and write the seed back in its layout (candidates one a line, NOT_SUPPORTED ones left
out).  With no NEW_DB it only re-formats SEED.  Every file is read through tools/tunedb_file.py's
load(): one that is not a tuning DB of this format version, or has a record of the wrong shape, stops
it before anything is written (one line naming the file, exit status 1)."""
import json, sys

import tunedb_file

args = sys.argv[1:]
rep = []
if '--replace' in args:
    i = args.index('--replace')
    if i + 1 >= len(args):
        sys.exit('seed_merge.py: --replace needs PREFIX,...')
    rep = args[i + 1].split(','); del args[i:i + 2]
if not args:
    sys.exit(__doc__)
seed, news = args[0], args[1:]
d = tunedb_file.load_or_exit(seed, 'seed_merge.py')
new_docs = [tunedb_file.load_or_exit(f, 'seed_merge.py') for f in news]  # all checked before SEED is written
recs = [r for r in d['records'] if not any(r['key'].startswith(p) for p in rep)]
idx = {(r['key'], r['bucket'], r['arch']): i for i, r in enumerate(recs)}
for nd in new_docs:
    for r in nd['records']:
        if rep and not any(r['key'].startswith(p) for p in rep): continue
        r['candidates'] = [c for c in r.get('candidates') or [] if c.get('disposition') != 'NOT_SUPPORTED']
        k = (r['key'], r['bucket'], r['arch'])
        if k in idx: recs[idx[k]] = r
        else: idx[k] = len(recs); recs.append(r)
def one(v): return json.dumps(v, separators=(', ', ': '))
# other top-level fields (a "comment", a newer m3kit's) are carried, before the records
out = ['{'] + ['  %s: %s,' % (one(k), one(v)) for k, v in d.items() if k != 'records'] + ['  "records": [']
for j, r in enumerate(recs):
    lines = []
    for k, v in r.items():
        if k == 'provenance':
            lines.append('      "provenance": {\n' + ',\n'.join('        %s: %s' % (one(a), one(b)) for a, b in v.items()) + '\n      }')
        elif k == 'candidates' and v is not None:  # null (none recorded) as any other field
            lines.append('      "candidates": [\n' + ',\n'.join('        ' + one(c) for c in v) + '\n      ]')
        else:
            lines.append('      %s: %s' % (one(k), one(v)))
    out.append('    {\n' + ',\n'.join(lines) + '\n    }' + (',' if j < len(recs) - 1 else ''))
out += ['  ]', '}']
open(seed, 'w').write('\n'.join(out) + '\n')
