"""tunedb_file.py - how the tools that edit a tuning DB in place (rekey.py, seed_pin.py) open and
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
