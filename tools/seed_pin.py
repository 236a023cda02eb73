#!/usr/bin/env python3
"""seed_pin.py DB KEY BUCKET TILE --why TEXT [--m3kit PATH] [--untimed] - make another of a record's
timed candidates its winner, where a measurement outside the tuner ranks them otherwise.

The tuner times each candidate alone (or as a graph of 16 launches of itself); the decode step runs
it between other kernels.  Where whole-step A/B runs (`device-run.sh ab`, one seed per tile) show
the tuner's pick losing to another candidate, this sets the record of (KEY, BUCKET) to TILE, which
must be one of its PASSED candidates: tile, tuned_us and the metric from that candidate's own
timing (the tuner's numbers stay the tuner's), code_hash of TILE's rendering (`m3kit gen --emit`),
and TEXT (the A/B and where its logs are) as the record's `pinned` field (provenance.command
notes the change), so that the file says why its winner is not the fastest candidate; a later
`m3kit tune` keeps a pinned tile while it times within 3% of the tuner's own pick.  DB is rewritten
as tools/tunedb_file.py writes it (at a symlink's target, under the tuners' lock, through a
temporary file and a rename).

--untimed: TILE need not be one of the record's timed candidates, for a tile axis that an isolated
timing cannot rank because it only changes how a launch overlaps the one before it (a lead-in, e.g.
session 26's `lead=1` on the MoE GEMVs: the same kernel body, statements moved ahead of the grid
wait).  TILE must render (`m3kit gen --emit`); tuned_us and the metric stay the record's (its tile's
timing, the body both share), and TEXT must say what measured the pin (the whole-step A/B, on
which GPU)."""
import os, sys, tempfile

import tunedb_file


def main():
    args = sys.argv[1:]
    m3kit, why = 'm3kit', None
    untimed = '--untimed' in args
    if untimed:
        args.remove('--untimed')
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
    if len(args) != 4:
        sys.exit(__doc__)
    if not why:
        sys.exit('seed_pin.py: --why TEXT is required: the A/B that chose the tile, and where its logs are')
    db_path, key, bucket, tile = args
    db_path, lock, mode, d = tunedb_file.open_locked(db_path, 'seed_pin.py')
    recs = [r for r in d['records'] if r['key'] == key and r['bucket'] == bucket]
    if len(recs) != 1:
        sys.exit('seed_pin.py: %s: %d records of %s at %s' % (db_path, len(recs), key, bucket))
    r = recs[0]
    # TILE in the record's axis order: candidates and a later tune's pin lookup compare whole strings
    want = dict(f.split('=', 1) for f in tile.split(',') if '=' in f)
    have = [f.split('=', 1)[0] for f in r['tile'].split(',')]
    if sorted(want) != sorted(have) or len(want) != len(tile.split(',')):
        sys.exit('seed_pin.py: [%s]: the tile axes of %s are %s' % (tile, key, ','.join(have)))
    tile = ','.join('%s=%s' % (a, want[a]) for a in have)
    cand = [c for c in r.get('candidates') or [] if c['tile'] == tile and c.get('disposition') == 'PASSED']
    if not cand and not untimed:
        sys.exit('seed_pin.py: %s at %s: no PASSED candidate [%s] (--untimed: a tile the tuner cannot rank)' %
                 (key, bucket, tile))
    full = '%s[%s]@%s' % (key, tile, r['arch'])
    env = dict(os.environ, M3KIT_CACHE_DIR=os.path.join(tempfile.gettempdir(), 'm3kit-pin-cache'))
    try:
        code, now = tunedb_file.emit_hashes(m3kit, full, env)
    except RuntimeError as ex:
        sys.exit('seed_pin.py: %s' % ex)
    # The record's timings are of the code its template rendered then: only where the template the
    # m3kit renders today is that one is TILE's rendering the code its candidate timing measured.
    if now != r['provenance'].get('template_hash'):
        sys.exit('seed_pin.py: %s: the record was tuned with template hash %s, %s renders %s: carry it over '
                 'first (m3kit tune --rehash, tools/rekey.py) or re-tune it' %
                 (key, r['provenance'].get('template_hash'), m3kit, now))
    old_tile, old_us = r['tile'], r.get('tuned_us')  # optional, null where not measured
    us = cand[0].get('median_us') if cand else old_us  # --untimed: the body's timing, the record's
    r['tile'], r['tuned_us'] = tile, us
    m = r.get('metric')
    if m and m.get('achieved') and old_us and us:  # bytes (or FLOPs) over time: the same work in the pinned tile's time
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

    def t(v):
        return '%.2f us' % v if v is not None else 'untimed'
    if cand:
        prov['command'] = (prov.get('command') or '') + ' (winner pinned by tools/seed_pin.py: [%s], tuner %s, ' \
            'over the tuner\'s [%s], %s; why: "pinned")' % (tile, t(us), old_tile, t(old_us))
    else:
        prov['command'] = (prov.get('command') or '') + ' (pinned by tools/seed_pin.py --untimed: [%s], not a timed ' \
            'candidate, over [%s], whose %s it keeps; why: "pinned")' % (tile, old_tile, t(old_us))
    tunedb_file.write(db_path, mode, d)
    print('%s: %s at %s -> [%s] (was [%s])' % (db_path, key, bucket, tile, old_tile))


if __name__ == '__main__':
    main()
