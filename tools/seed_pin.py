#!/usr/bin/env python3
"""seed_pin.py DB KEY BUCKET TILE --why TEXT [--m3kit PATH] - make another of a record's timed
candidates its winner, where a measurement outside the tuner ranks them otherwise.

The tuner times each candidate alone (or as a graph of 16 launches of itself); the decode step runs
it between other kernels.  Where whole-step A/B runs (`device-run.sh ab`, one seed per tile) show
the tuner's pick losing to another candidate, this sets the record of (KEY, BUCKET) to TILE, which
must be one of its PASSED candidates: tile, tuned_us and the metric from that candidate's own
timing (the tuner's numbers stay the tuner's), code_hash of TILE's rendering (`m3kit gen --emit`),
and TEXT (the A/B and where its logs are) as the record's `pinned` field and appended to
provenance.command, so that the file says why its winner is not the fastest candidate; a later
`m3kit tune` keeps a pinned tile while it times within 3% of the tuner's own pick.  DB is rewritten in the seed's layout
(tools/seed_merge.py) through a temporary file and a rename, under the tuners' lock."""
import fcntl, json, os, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    args = sys.argv[1:]
    m3kit, why = 'm3kit', None
    for opt in ('--m3kit', '--why'):
        if opt in args:
            i = args.index(opt)
            if i + 1 >= len(args):
                sys.exit('seed_pin.py: %s needs a value' % opt)
            if opt == '--m3kit':
                m3kit = args[i + 1]
            else:
                why = args[i + 1]
            del args[i:i + 2]
    if len(args) != 4 or not why:
        sys.exit(__doc__)
    db_path, key, bucket, tile = args
    # A symlinked DB is edited (and locked, as m3kit's m3_lock does) at its target.
    db_path = os.path.realpath(db_path)
    try:
        os.stat(db_path)  # before the lock file is made beside it
        lock = open(db_path + '.lock', 'a')
        fcntl.flock(lock, fcntl.LOCK_EX)
        mode = os.stat(db_path).st_mode & 0o7777
        d = json.load(open(db_path))
    except (OSError, ValueError) as ex:
        sys.exit('seed_pin.py: %s: %s' % (db_path, ex))
    recs = [r for r in d['records'] if r['key'] == key and r['bucket'] == bucket]
    if len(recs) != 1:
        sys.exit('seed_pin.py: %s: %d records of %s at %s' % (db_path, len(recs), key, bucket))
    r = recs[0]
    cand = [c for c in r.get('candidates', []) if c['tile'] == tile and c.get('disposition') == 'PASSED']
    if not cand:
        sys.exit('seed_pin.py: %s at %s: no PASSED candidate [%s]' % (key, bucket, tile))
    full = '%s[%s]@%s' % (key, tile, r['arch'])
    env = dict(os.environ, M3KIT_CACHE_DIR=os.path.join(tempfile.gettempdir(), 'm3kit-pin-cache'))
    try:
        p = subprocess.run([m3kit, 'gen', '--emit', full], env=env, capture_output=True, text=True)
    except OSError as ex:
        sys.exit('seed_pin.py: cannot run %s: %s' % (m3kit, ex))
    head = p.stdout.split('\n', 2)
    if p.returncode or len(head) < 2 or 'code hash ' not in head[0] or 'template hash ' not in head[1]:
        sys.exit('seed_pin.py: m3kit gen --emit %s: %s' % (full, (p.stderr or p.stdout[:200]).strip()))
    code = head[0].split('code hash ', 1)[1].split()[0]
    # The record's timings are of the code its template rendered then: only where the template the
    # m3kit renders today is that one is TILE's rendering the code its candidate timing measured.
    now = head[1].split('template hash ', 1)[1].split(')')[0]
    if now != r['provenance'].get('template_hash'):
        sys.exit('seed_pin.py: %s: the record was tuned with template hash %s, %s renders %s: carry it over '
                 'first (m3kit tune --rehash, tools/rekey.py) or re-tune it' %
                 (key, r['provenance'].get('template_hash'), m3kit, now))
    old_tile, old_us, us = r['tile'], r['tuned_us'], cand[0]['median_us']
    r['tile'], r['tuned_us'] = tile, us
    m = r.get('metric')
    if m and m.get('achieved'):  # bytes (or FLOPs) over time: the same work in the pinned tile's time
        m['achieved'] = m['achieved'] * old_us / us
        if m.get('ceiling'):
            m['pct_of_ceiling'] = 100.0 * m['achieved'] / m['ceiling']
    # "pinned" (after "tile", as m3kit writes it): a later `m3kit tune` keeps this tile while it times
    # within 3% of the tuner's own pick (autotune/tune.c)
    items = list(r.items())
    r.clear()
    for k, v in items:
        if k != 'pinned':
            r[k] = v
        if k == 'tile':
            r['pinned'] = why
    prov = r['provenance']
    prov['code_hash'] = code
    prov['command'] = prov.get('command', '') + ' (winner pinned by tools/seed_pin.py: [%s], tuner %.2f us, over [%s], ' \
        'tuner %.2f us: %s)' % (tile, us, old_tile, old_us, why)
    fd, t = tempfile.mkstemp(dir=os.path.dirname(db_path), prefix='.pin.')
    with os.fdopen(fd, 'w') as f:
        json.dump(d, f)
    subprocess.run([sys.executable, os.path.join(HERE, 'seed_merge.py'), t], check=True)
    os.chmod(t, mode)  # mkstemp made it 0600
    with open(t, 'rb') as f:
        os.fsync(f.fileno())
    os.replace(t, db_path)
    print('%s: %s at %s -> [%s] (was [%s])' % (db_path, key, bucket, tile, old_tile))


if __name__ == '__main__':
    main()
