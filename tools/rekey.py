#!/usr/bin/env python3
"""rekey.py DB OLD_TEMPLATE_DIR [--m3kit PATH] [--dry-run] [--carry-fix WHY] - carry tuning records across a template
edit that did not change the machine code they timed.

A record is kept by the runtime while the code hash of its tile matches (docs/tuning-db.md).  Some
edits change the source of a tile without changing what it compiles to: a refactor, or a new tile
axis whose first value emits the old code.  For every record of DB that was current under
OLD_TEMPLATE_DIR (a copy of templates/ before the edit, e.g. `git worktree add /tmp/old HEAD~1`) and
is stale under the templates m3kit embeds now (its key completed with the key axes the edit added:
the completion `m3kit gen --list` holds, else their first values), this renders the same tile - completed with each
combination of values of the tile axes the edit added - with the new templates; where its code hash
is the record's (the same source but for comments, blanks and the kernel's name), or else where
the two compile (NVRTC, no GPU) to cubins that are byte for byte the same apart from
the kernel's name (every ELF section but the symbol and name tables: instructions, register and
parameter metadata, constants, relocations) re-keys the record: tile (and its candidates'
and default's) completed, template_hash and code_hash of the new rendering, a note appended to
provenance.command.  Records whose code did change are left stale: they need `m3kit tune`.

--carry-fix WHY also keeps those, for an edit that must land before a GPU of that kind can re-time
them and cannot change their ranking (a correctness fix of one instruction in a path every
candidate shares): each gets the new hashes, WHY in a `carried` field (the runtime ignores it; `m3kit
tune` replaces the record) and a note in provenance.command.  Its timings are then the old code's.
It carries every record whose code changed, in every template: run it only where the old templates
differ from the new ones by that fix, and look at --dry-run's list first.
DB is rewritten as tools/tunedb_file.py writes it (the seed's layout; at a symlink's target, under the
tuners' lock, through a temporary file and a rename).
"""
import itertools, os, re, struct, subprocess, sys, tempfile

import tunedb_file

SCHEME = None  # of the code hashes this m3kit computes (gen/code_hash.h), set in main()


def run(cmd, env=None):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError('%s: %s' % (' '.join(cmd), (p.stderr or p.stdout).strip()))
    return p.stdout


def schemas(m3kit, env):
    """{template: (template hash, [(tile axis, [values])], [(key axis, [values] or ['<int>'])])} from
    `m3kit gen --templates`."""
    out, cur = {}, None
    for line in run([m3kit, 'gen', '--templates'], env).splitlines():
        m = re.match(r'(\w+)\s+\(template hash ([0-9a-f]+)\)', line)
        if m:
            cur = m.group(1)
            out[cur] = (m.group(2), [], [])
        elif cur and line.strip().split(':')[0] in ('tiles', 'axes'):
            for f in line.split()[1:]:
                name, vals = f.split('=', 1)
                out[cur][1 if line.strip().startswith('tiles:') else 2].append((name, vals.split('|')))
    return out


def completed_key(key, key_axes, listed=()):
    """key with the key axes an edit added: of the completions (each added axis at any of its values, an
    int axis at 0), the one the model's variant list (`m3kit gen --list`) holds when exactly one is there
    (a new axis that sorts launches, e.g. session 26's `settled`: the MoE down GEMV's key has 1), else each
    at its first value; key itself when none is missing.  Either way the record is re-keyed only where the
    tile's code is the same (main)."""
    name, _, body = key.partition('(')
    have = dict(f.split('=', 1) for f in body.rstrip(')').split(',') if f)
    if all(a in have for a, _ in key_axes) and len(have) == len(key_axes):
        return key
    if any(a not in dict(key_axes) for a in have):
        return None  # an axis was removed
    added = [(a, ['0'] if v == ['<int>'] else v) for a, v in key_axes if a not in have]
    cands = []
    for vals in itertools.product(*[v for _, v in added]):
        full = dict(have, **dict(zip([a for a, _ in added], vals)))
        cands.append('%s(%s)' % (name, ','.join('%s=%s' % (a, full[a]) for a, _ in key_axes)))
    hits = [c for c in cands if c in listed]
    return hits[0] if len(hits) == 1 else cands[0]


def tile_dict(tile):
    return dict(f.split('=', 1) for f in tile.split(',') if f)


def tile_text(d, axes):
    return ','.join('%s=%s' % (a, d[a]) for a, _ in axes)


def code_hash(m3kit, env, full):
    """The code hash of a full key, or None when it does not render (no such axis, invalid tile)."""
    try:
        return tunedb_file.emit_hashes(m3kit, full, env)[0]
    except RuntimeError:
        return None


def elf_sections(data):
    """[(name, type, bytes)] of an ELF64 little-endian file (a cubin)."""
    shoff, = struct.unpack_from('<Q', data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3a)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', data, shoff + i * shentsize) for i in range(shnum)]
    strtab = hdrs[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    out = []
    for h in hdrs:
        name = names[h[0]:names.index(b'\0', h[0])].decode()
        body = b'' if h[1] == 8 else data[h[4]:h[4] + h[5]]  # SHT_NOBITS holds no bytes, only its size
        out.append((name, h[1], h[5], body))
    return out


def machine_code(m3kit, env, full, tmp):
    """The key's cubin, section by section, without the symbol and name tables and the debug
    sections (line tables, the PTX text, which name source lines): instructions, kernel
    metadata (registers, parameters, shared memory), constants and relocations, byte for byte, under
    section names with the kernel's own name (which encodes the tile) replaced."""
    out = run([m3kit, 'gen', '--compile', full, '--cubin', tmp], env)
    m = re.search(r'entry (\S+), (\d+) threads, (\d+) B dynamic smem', out)
    entry, launch = m.group(1), (int(m.group(2)), int(m.group(3)))  # the launch is not in the cubin
    with open(tmp, 'rb') as f:
        secs = elf_sections(f.read())
    debug = ('.debug', '.nv_debug', '.rela.debug', '.rela.nv_debug')  # line tables, PTX text: not executed
    return launch, sorted((n.replace(entry, 'ENTRY'), t, size, body) for n, t, size, body in secs
                          if n not in ('.symtab', '.strtab', '.shstrtab', '') and not n.startswith(debug))


def main():
    args = sys.argv[1:]
    if '-h' in args or '--help' in args:
        print(__doc__)
        return
    m3kit, dry = 'm3kit', '--dry-run' in args
    if dry:
        args.remove('--dry-run')
    if '--m3kit' in args:
        i = args.index('--m3kit')
        if i + 1 >= len(args):
            sys.exit('rekey.py: --m3kit needs the path of an m3kit binary')
        m3kit = args[i + 1]; del args[i:i + 2]
    carry = None
    if '--carry-fix' in args:
        i = args.index('--carry-fix')
        if i + 1 >= len(args) or not args[i + 1].strip():
            sys.exit('rekey.py: --carry-fix needs the reason (it is written into every record it carries)')
        carry = args[i + 1]; del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    if not os.path.isdir(os.path.join(args[1], '.')) or not any(f.endswith('.lua') for f in os.listdir(args[1])):
        sys.exit('rekey.py: %s: not a templates directory (the *.lua of templates/ before the edit)' % args[1])
    db_path, old_dir = args
    env_new = {k: v for k, v in os.environ.items() if k != 'M3KIT_TEMPLATE_DIR'}
    env_old = dict(env_new, M3KIT_TEMPLATE_DIR=os.path.abspath(old_dir))
    for e in (env_new, env_old):  # compiles go to a private cubin cache, never the user's
        e['M3KIT_CACHE_DIR'] = os.path.join(tempfile.gettempdir(), 'm3kit-rekey-cache')
    new, old = schemas(m3kit, env_new), schemas(m3kit, env_old)
    listed = set(l.strip() for l in run([m3kit, 'gen', '--list'], env_new).splitlines() if '(' in l)
    global SCHEME
    # the tuners' lock (cache/store.c m3_lock): no tuner merges into DB while it is rewritten
    db_path, lock, mode, d = tunedb_file.open_locked(db_path, 'rekey.py')
    tmpdir = tempfile.TemporaryDirectory(prefix='m3rekey')
    tmp = os.path.join(tmpdir.name, 'k.cubin')
    for r in d['records']:  # the scheme of this m3kit's code hashes, from any record that renders
        h = code_hash(m3kit, env_new, '%s[%s]@%s' % (r['key'], r['tile'], r['arch']))
        if h:
            SCHEME = h.split(':')[0]
            break
    counts = {'current': 0, 'rekeyed': 0, 'carried': 0, 'changed': 0, 'was stale': 0}
    for r in d['records']:
        name = r['key'].split('(', 1)[0]
        full = '%s[%s]@%s' % (r['key'], r['tile'], r['arch'])
        prov = r['provenance']
        key_new = completed_key(r['key'], new[name][2], listed) if name in new else None

        def current(env, schema):  # the runtime's rule (docs/tuning-db.md, cache/tunedb.c is_stale)
            if name not in schema:
                return False
            if prov['template_hash'] == schema[name][0]:
                return True  # the same template text renders the same code
            have_code = prov.get('code_hash')
            return bool(have_code) and have_code.split(':')[0] == SCHEME and code_hash(m3kit, env, full) == have_code
        if key_new == r['key'] and current(env_new, new):
            counts['current'] += 1
            continue
        if name not in new or not current(env_old, old):
            counts['was stale'] += 1
            continue
        if key_new is None:
            counts['changed'] += 1
            print('changed: %s (a key axis is gone)' % r['key'])
            continue
        if key_new != r['key'] and any(o is not r and o['key'] == key_new and o['bucket'] == r['bucket'] and
                                       o['arch'] == r['arch'] for o in d['records']):
            counts['changed'] += 1  # a tune with the new build already wrote that record: it stays the one
            print('changed: %s (a record of the completed key %s exists)' % (r['key'], key_new))
            continue
        have = tile_dict(r['tile'])
        axes = new[name][1]
        missing = [(a, v) for a, v in axes if a not in have]
        if any(a not in dict(axes) for a in have):
            counts['changed'] += 1  # an axis was removed: no tile of the new space is this one
            print('changed: %s [%s] (a tile axis is gone)' % (r['key'], r['tile']))
            continue
        old_code = prov.get('code_hash') or code_hash(m3kit, env_old, full)
        ref = None
        done = False
        compiled = None  # the code hash of this tile's new rendering once it compiled (what --carry-fix carries to)
        for combo in itertools.product(*[v for _, v in missing]):
            add = dict(zip([a for a, _ in missing], combo))
            tile = tile_text(dict(have, **add), axes)
            full_new = '%s[%s]@%s' % (key_new, tile, r['arch'])
            new_code = code_hash(m3kit, env_new, full_new)
            if new_code is None:
                continue
            if new_code != old_code:  # other source: is it other machine code?
                try:
                    ref = ref or machine_code(m3kit, env_old, full, tmp)
                    new_mc = machine_code(m3kit, env_new, full_new, tmp)
                except (RuntimeError, AttributeError):  # failed, or printed no entry line
                    continue
                if full_new == full:
                    compiled = new_code
                if new_mc != ref:
                    continue
            def complete(t):
                return tile_text(dict(tile_dict(t), **{a: v for a, v in add.items() if a not in tile_dict(t)}), axes)
            old_tile, r['tile'] = r['tile'], tile
            old_key, r['key'] = r['key'], key_new
            if r.get('default_tile'):
                r['default_tile'] = complete(r['default_tile'])
            for c in r.get('candidates') or []:
                c['tile'] = complete(c['tile'])
            prov['template_hash'] = new[name][0]
            prov['code_hash'] = new_code
            how = 'same code' if new_code == old_code else 'same machine code'
            note = ' (re-keyed by tools/rekey.py: %s after a template edit)' % how
            if note not in (prov.get('command') or ''):
                prov['command'] = (prov.get('command') or '') + note
            counts['rekeyed'] += 1
            print('re-keyed (%s): %s [%s] -> %s[%s]' % (how, old_key, old_tile, '' if key_new == old_key else key_new, tile))
            done = True
            break
        if not done and carry and compiled:  # the same key and tile, other code that compiles
            prov['template_hash'] = new[name][0]
            prov['code_hash'] = compiled
            r['carried'] = carry
            note = ' (carried by tools/rekey.py --carry-fix across a code change, not re-timed: %s)' % carry
            if note not in (prov.get('command') or ''):
                prov['command'] = (prov.get('command') or '') + note
            counts['carried'] += 1
            print('carried (code changed, not re-timed): %s [%s]' % (r['key'], r['tile']))
            done = True
        if not done:
            counts['changed'] += 1
            print('changed: %s [%s] (its code differs: re-tune it)' % (r['key'], r['tile']))
    print('%s: %s' % (db_path, ', '.join('%d %s' % (n, k) for k, n in counts.items())))
    if dry or not (counts['rekeyed'] or counts['carried']):
        return
    tunedb_file.write(db_path, mode, d)


if __name__ == '__main__':
    try:
        main()
    except FileNotFoundError as ex:  # most often: no m3kit on PATH
        sys.exit('rekey.py: %s (give the binary with --m3kit PATH)' % ex if 'm3kit' in str(ex) else 'rekey.py: %s' % ex)
    except RuntimeError as ex:
        sys.exit('rekey.py: %s' % ex)
