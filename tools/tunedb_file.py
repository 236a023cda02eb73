"""tunedb_file.py - how the tools that edit a tuning DB (rekey.py, seed_pin.py, seed_arm.py) open and
write it, as m3kit's cache/store.c does: a symlinked DB is edited at its target and locked there
(`<target>.lock`, the tuners' flock), and written whole through a temporary file in the same
directory (the DB's mode kept, fsync'ed) renamed over it, in the seed's layout (seed_merge.py)."""
import fcntl, json, os, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def open_locked(path, who):
    """(real path, lock file, mode, document) of the DB at path, its lock held until the lock file is
    closed (or the process ends); exits with a one-line message naming the file on any error."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode & 0o7777  # before the lock file is made beside it
        lock = open(real + '.lock', 'a')
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(real) as f:
            doc = json.load(f)
    except (OSError, ValueError) as ex:
        sys.exit('%s: %s: %s' % (who, real, ex))
    return real, lock, mode, doc


def write(real, mode, doc):
    """doc over the DB at real (a path from open_locked, whose lock the caller holds)."""
    fd, t = tempfile.mkstemp(dir=os.path.dirname(real), prefix='.' + os.path.basename(real) + '.')
    try:
        with os.fdopen(fd, 'w') as f:
            json.dump(doc, f)
        subprocess.run([sys.executable, os.path.join(HERE, 'seed_merge.py'), t], check=True)
        os.chmod(t, mode)  # mkstemp made it 0600
        with open(t, 'rb') as f:
            os.fsync(f.fileno())
        os.replace(t, real)
    except BaseException:
        if os.path.exists(t):
            os.unlink(t)
        raise


def emit_hashes(m3kit, full, env=None):
    """(code hash, template hash) that `m3kit gen --emit FULL` (KEY[TILE]@ARCH) prints above the source;
    raises RuntimeError with m3kit's own message where it does not render (no such axis, valid()
    refusing the tile) or cannot run."""
    try:
        p = subprocess.run([m3kit, 'gen', '--emit', full], env=env, capture_output=True, text=True)
    except OSError as ex:
        raise RuntimeError('cannot run %s: %s' % (m3kit, ex))
    head = p.stdout.split('\n', 2)
    if p.returncode or len(head) < 2 or 'code hash ' not in head[0] or 'template hash ' not in head[1]:
        raise RuntimeError('m3kit gen --emit %s: %s' % (full, (p.stderr or p.stdout[:200]).strip()))
    return head[0].split('code hash ', 1)[1].split()[0], head[1].split('template hash ', 1)[1].split(')')[0]
