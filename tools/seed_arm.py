#!/usr/bin/env python3
"""seed_arm.py SRC DST --set AXIS=VALUE [--set ...] [--key TEXT ...] [--tile TEXT ...] [--m3kit PATH] -
write DST: a copy of the tuning DB SRC with a tile axis set in some records, for one arm of a
whole-step A/B (`device-run.sh ab`, M3KIT_SEED_DB=DST): a tile the tuner never timed, or one it
ranked lower, run in the decode step against the seed's own.

A record is changed where its key contains every --key TEXT and its tile every --tile TEXT (none
given: all records); each --set AXIS=VALUE replaces that tile axis's value.  The changed tile must
render and pass the template's valid() (`m3kit gen --emit`, no GPU): its code hash goes into the
record, so that the runtime keeps it whatever template hash the record has.  Nothing else of the
record changes: its timings stay those of the tile it had.  DST is an A/B arm, not a seed to commit
(the tuner never timed its tiles; `tools/seed_pin.py` pins a timed candidate).  Prints each change.

Session 26's arms: the MoE down GEMV at lead=1 (--key settled=1 --set lead=1), the gate|up one too
(--key moe=1 --key act=none --tile tpc=1 --set lead=1 on that), the W8A16 ring at lean=1 (--key
w=e4m3 --key op=gemv --tile pipe=3 --set lean=1, and again with pipe=4)."""
import json, re, subprocess, sys


def main():
    args = sys.argv[1:]
    if not args or '-h' in args or '--help' in args:
        print(__doc__)
        return 0 if args else 2
    m3kit, sets, keys, tiles, pos = 'm3kit', [], [], [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ('--set', '--key', '--tile', '--m3kit'):
            if i + 1 >= len(args):
                sys.exit('seed_arm.py: %s needs a value' % a)
            v = args[i + 1]
            if a == '--set':
                if '=' not in v:
                    sys.exit('seed_arm.py: --set %s: not AXIS=VALUE' % v)
                sets.append(v.split('=', 1))
            elif a == '--key':
                keys.append(v)
            elif a == '--tile':
                tiles.append(v)
            else:
                m3kit = v
            i += 2
        else:
            pos.append(a)
            i += 1
    if len(pos) != 2 or not sets:
        sys.exit(__doc__)
    src, dst = pos
    with open(src) as f:
        d = json.load(f)
    n = 0
    for r in d.get('records', []):
        if not all(k in r['key'] for k in keys) or not all(t in r['tile'] for t in tiles):
            continue
        tile = dict(f.split('=', 1) for f in r['tile'].split(','))
        for axis, value in sets:
            if axis not in tile:
                sys.exit('seed_arm.py: %s [%s]: no tile axis %s' % (r['key'], r['tile'], axis))
            tile[axis] = value
        new = ','.join('%s=%s' % kv for kv in tile.items())
        if new == r['tile']:
            continue
        p = subprocess.run([m3kit, 'gen', '--emit', '%s[%s]@%s' % (r['key'], new, r['arch'])],
                           capture_output=True, text=True)
        m = re.search(r'code hash (\S+)', p.stdout.split('\n', 1)[0]) if p.returncode == 0 else None
        if not m:
            sys.exit('seed_arm.py: %s [%s] does not render: %s' % (r['key'], new, (p.stderr or p.stdout).strip()))
        print('%s %s: [%s] -> [%s]' % (r['key'], r['bucket'], r['tile'], new))
        r['tile'] = new
        r.setdefault('provenance', {})['code_hash'] = m.group(1)
        n += 1
    with open(dst, 'w') as f:
        json.dump(d, f, indent=1)
        f.write('\n')
    print('%s: %d records changed' % (dst, n))
    return 0


if __name__ == '__main__':
    sys.exit(main())
