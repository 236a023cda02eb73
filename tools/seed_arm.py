#!/usr/bin/env python3
"""seed_arm.py SRC DST --set AXIS=VALUE [--set ...] [--template NAME] [--key AXIS=VALUE ...]
[--tile AXIS=VALUE ...] [--m3kit PATH] - write DST: a copy of the tuning DB SRC with tile axes set in
some records, for one arm of a whole-step A/B (`device-run.sh ab`, M3KIT_SEED_DB=DST): a tile the
tuner never timed, or one it ranked lower, run in the decode step against the seed's own.

A record is changed where its template is NAME (if given), each --key AXIS=VALUE is a field of its
key and each --tile AXIS=VALUE one of its tile (exact fields, not substrings), and a --set changes
its tile; each --set AXIS=VALUE replaces that tile axis's value.  The changed tile must render and
pass the template's valid() (`m3kit gen --emit`, no GPU): its code hash goes into the record, so
that the runtime keeps it whatever template hash the record has.  A changed record loses its
`pinned` reason (an arm is not the pin), and provenance.command says what the arm set; its timings
stay those of the tile it had.  Nothing changed is an error (a mistyped filter would make an arm
equal to its base).  DST is an A/B arm, never the seed itself (SRC and DST must differ; the seed
keeps the tuner's timings: `tools/seed_pin.py` pins an A/B winner), written in the seed's layout
through a temporary file and a rename.  Prints each change.

Session 26's arms (bench/README.md, "as of session 26"): the MoE GEMVs back at lead=0 (--key moe=1
--key act=none --set lead=0), the W8A16 ring at lean=1 (--key op=gemv --key w=e4m3 --tile pipe=3
--set lean=1, and again with pipe=4)."""
import os, sys

import tunedb_file


def fields(text):
    return dict(f.split('=', 1) for f in text.split(',') if '=' in f)


def pairs(opt, values):
    out = []
    for v in values:
        if '=' not in v or not v.split('=', 1)[0]:
            sys.exit('seed_arm.py: %s %s: not AXIS=VALUE' % (opt, v))
        out.append(tuple(v.split('=', 1)))
    return out


def main():
    args = sys.argv[1:]
    if not args or '-h' in args or '--help' in args:
        print(__doc__)
        return 0 if args else 2
    m3kit, template, opts, pos = 'm3kit', None, {'--set': [], '--key': [], '--tile': []}, []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ('--set', '--key', '--tile', '--m3kit', '--template'):
            if i + 1 >= len(args):
                sys.exit('seed_arm.py: %s needs a value' % a)
            if a == '--m3kit':
                m3kit = args[i + 1]
            elif a == '--template':
                template = args[i + 1]
            else:
                opts[a].append(args[i + 1])
            i += 2
        elif a.startswith('--'):
            sys.exit('seed_arm.py: unknown option %s (--help)' % a)
        else:
            pos.append(a)
            i += 1
    if len(pos) != 2:
        sys.exit('seed_arm.py: SRC and DST, the tuning DB and the arm to write (--help)')
    sets, keys, tiles = pairs('--set', opts['--set']), pairs('--key', opts['--key']), pairs('--tile', opts['--tile'])
    if not sets:
        sys.exit('seed_arm.py: nothing to set (--set AXIS=VALUE)')
    src, dst = pos
    if os.path.exists(dst) and os.path.samefile(src, dst):
        sys.exit('seed_arm.py: %s: DST is SRC; an arm is a copy (the seed keeps the tuner\'s timings)' % dst)
    _, lock, _, d = tunedb_file.open_locked(src, 'seed_arm.py')  # a one-line error for a missing or bad SRC
    lock.close()
    n = 0
    for r in d['records']:
        name, _, body = r['key'].partition('(')
        kf, tile = fields(body.rstrip(')')), fields(r['tile'])
        if template and name != template:
            continue
        if any(kf.get(a) != v for a, v in keys) or any(tile.get(a) != v for a, v in tiles):
            continue
        for axis, value in sets:
            if axis not in tile:
                sys.exit('seed_arm.py: %s [%s]: no tile axis %s' % (r['key'], r['tile'], axis))
            tile[axis] = value
        new = ','.join('%s=%s' % kv for kv in tile.items())
        if new == r['tile']:
            continue
        full = '%s[%s]@%s' % (r['key'], new, r['arch'])
        try:
            code = tunedb_file.emit_hashes(m3kit, full)[0]
        except RuntimeError as ex:
            sys.exit('seed_arm.py: %s' % ex)
        print('%s %s: [%s] -> [%s]' % (r['key'], r['bucket'], r['tile'], new))
        prov = r['provenance']  # required: tunedb_file checked it
        prov['code_hash'] = code
        prov['command'] = (prov.get('command') or '') + ' (A/B arm by tools/seed_arm.py: [%s] -> [%s], timings the ' \
            'old tile\'s%s)' % (r['tile'], new, '; its pin dropped' if 'pinned' in r else '')
        r['tile'] = new
        r.pop('pinned', None)
        n += 1
    if not n:
        sys.exit('seed_arm.py: %s: no record changed (filters %s, sets %s); DST not written' %
                 (src, ' '.join('%s=%s' % kv for kv in keys + tiles) or 'none', ' '.join('%s=%s' % kv for kv in sets)))
    try:
        tunedb_file.write(os.path.abspath(dst), 0o644, d)
    except OSError as ex:
        sys.exit('seed_arm.py: %s: %s' % (dst, ex))
    print('%s: %d records changed' % (dst, n))
    return 0


if __name__ == '__main__':
    sys.exit(main())
