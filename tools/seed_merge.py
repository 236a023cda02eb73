#!/usr/bin/env python3
"""seed_merge.py SEED [NEW_DB ...] [--replace PREFIX,...] - merge tuning DB records into the seed
(a record of NEW_DB replaces the seed's record of the same (key, bucket, arch), or is appended; with
--replace only the keys starting with a PREFIX are taken, and the seed's own records of those keys are
dropped first) and write the seed back in its layout (candidates one a line, NOT_SUPPORTED ones left
out).  With no NEW_DB it only re-formats SEED."""
import json, sys
args = sys.argv[1:]
rep = []
if '--replace' in args:
    i = args.index('--replace'); rep = args[i + 1].split(','); del args[i:i + 2]
seed, news = args[0], args[1:]
d = json.load(open(seed))
recs = [r for r in d['records'] if not any(r['key'].startswith(p) for p in rep)]
idx = {(r['key'], r['bucket'], r['arch']): i for i, r in enumerate(recs)}
for f in news:
    for r in json.load(open(f))['records']:
        if rep and not any(r['key'].startswith(p) for p in rep): continue
        r['candidates'] = [c for c in r.get('candidates', []) if c.get('disposition') != 'NOT_SUPPORTED']
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
        elif k == 'candidates':
            lines.append('      "candidates": [\n' + ',\n'.join('        ' + one(c) for c in v) + '\n      ]')
        else:
            lines.append('      %s: %s' % (one(k), one(v)))
    out.append('    {\n' + ',\n'.join(lines) + '\n    }' + (',' if j < len(recs) - 1 else ''))
out += ['  ]', '}']
open(seed, 'w').write('\n'.join(out) + '\n')
