"""tunedb_file.py - how the tools that edit a tuning DB (rekey.py, seed_pin.py, seed_arm.py) open and
write it, as m3kit's cache/store.c does: a symlinked DB is edited at its target and locked there
(`<target>.lock`, the tuners' flock), and written whole through a temporary file in the same
directory (the DB's mode kept, fsync'ed) renamed over it, in the seed's layout (seed_merge.py).

Every tool reads a DB through load() (open_locked() is load() under the lock), which refuses - one
line naming the file, exit status 1, the file left as it was - what m3kit would not rewrite either: a
file that is not JSON or not a tuning DB, one of a newer format version than VERSION (m3kit's
M3_TUNEDB_VERSION), and one with a record of the wrong shape ('PATH: record N: field F: why')."""
import fcntl, json, os, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


# What m3kit itself reads and writes (cache/tunedb.h M3_TUNEDB_FORMAT, M3_TUNEDB_VERSION): a file of
# another format version is not these tools' to edit.  Bump with M3_TUNEDB_VERSION.
FORMAT = 'm3kit-tunedb'
VERSION = 1

# The field types of format version 1 (docs/tuning-db.md, cache/tunedb.c parse_record): 'str', 'num'
# (an integer or a real), 'int' (non-negative), 'obj'; a name marked required must be present and
# not null, the others may be absent or null ("not recorded").  Unknown fields are not checked: m3kit
# tolerates and keeps them, and so do the tools.
REQUIRED = ('key', 'bucket', 'arch', 'tile')
RECORD = {'key': 'str', 'bucket': 'str', 'arch': 'str', 'tile': 'str', 'pinned': 'str', 'default_tile': 'str',
          'default_us': 'num', 'tuned_us': 'num', 'provenance': 'obj', 'metric': 'obj', 'carried': 'str'}
PROVENANCE = {'gpu': 'str', 'sm_count': 'int', 'driver_version': 'str', 'nvrtc_version': 'str',
              'cublas_version': 'str', 'template_hash': 'str', 'm3kit_version': 'str', 'date': 'str',
              'command': 'str', 'code_hash': 'str'}
METRIC = {'unit': 'str', 'achieved': 'num', 'ceiling': 'num', 'pct_of_ceiling': 'num'}
CANDIDATE = {'tile': 'str', 'disposition': 'str', 'reason': 'str', 'median_us': 'num', 'p20_us': 'num',
             'p80_us': 'num', 'n': 'int'}
WANT = {'str': 'a string', 'num': 'a number', 'int': 'a non-negative integer', 'obj': 'an object'}


class BadDB(Exception):
    """What is wrong with a DB, as 'PATH: ...' (load, check)."""


def _kind(v):
    """JSON's name for a Python value from json.load."""
    if v is None:
        return 'null'
    if isinstance(v, bool):
        return 'a boolean'
    if isinstance(v, (int, float)):
        return 'a number'
    return {str: 'a string', list: 'an array', dict: 'an object'}.get(type(v), type(v).__name__)


def _fits(v, t):
    if t == 'str':
        return isinstance(v, str)
    if t == 'obj':
        return isinstance(v, dict)
    if isinstance(v, bool):  # a Python bool is an int; JSON's true is not a number
        return False
    if t == 'num':
        return isinstance(v, (int, float))
    return isinstance(v, int) and 0 <= v <= 2**31 - 1  # 'int', m3kit's get_int


def _fields(o, types, required, where, path, i):
    for name, t in types.items():
        v = o.get(name)
        f = where + name
        if v is None:
            if name in required:
                raise BadDB('%s: record %d: field %s: missing' % (path, i, f))
        elif not _fits(v, t):
            raise BadDB('%s: record %d: field %s: %s, not %s' % (path, i, f, _kind(v), WANT[t]))
        elif name in required and not v and name != 'bucket':  # "" is the bucket of no dimensions
            raise BadDB('%s: record %d: field %s: empty' % (path, i, f))


def check(doc, path):
    """Raises BadDB unless doc (parsed JSON) is a tuning DB these tools may read and rewrite: m3kit's own
    envelope rule (cache/tunedb.c parse_doc: an object, "format" m3kit-tunedb, "version" an integer >= 1,
    records an array) and format version VERSION exactly (a newer m3kit's file is not touched, as m3kit's
    own save refuses to), then every record an object whose known fields have the documented types (m3kit
    skips such a record; a tool that rewrites the file refuses it).  Records count from 0, as m3kit's
    load summary counts them."""
    if not isinstance(doc, dict):
        raise BadDB('%s: not an m3kit tuning DB: the top level is %s, not an object' % (path, _kind(doc)))
    if doc.get('format') != FORMAT:
        raise BadDB('%s: not an m3kit tuning DB: "format" is not "%s"' % (path, FORMAT))
    ver = doc.get('version')
    if 'version' not in doc:  # m3kit: not a tuning DB at all (M3_FORMAT), whatever the records say
        raise BadDB('%s: not an m3kit tuning DB: "version" is missing' % path)
    if not isinstance(ver, int) or isinstance(ver, bool) or ver < 1:
        raise BadDB('%s: not an m3kit tuning DB: "version" is %s, not a positive integer' %
                    (path, json.dumps(ver) if _kind(ver) == 'a number' else _kind(ver)))
    if ver > VERSION:
        raise BadDB('%s has format version %d, newer than this m3kit\'s %d: not touching it' % (path, ver, VERSION))
    recs = doc.get('records')
    if not isinstance(recs, list):
        raise BadDB('%s: not an m3kit tuning DB: "records" is %s, not an array' %
                    (path, 'missing' if 'records' not in doc else _kind(recs)))
    if doc.get('comment') is not None and not isinstance(doc['comment'], str):
        raise BadDB('%s: field comment: %s, not a string' % (path, _kind(doc['comment'])))
    for i, r in enumerate(recs):
        if not isinstance(r, dict):
            raise BadDB('%s: record %d: %s, not an object' % (path, i, _kind(r)))
        _fields(r, RECORD, REQUIRED + ('provenance',), '', path, i)
        _fields(r['provenance'], PROVENANCE, ('template_hash',), 'provenance.', path, i)
        if r.get('metric') is not None:
            _fields(r['metric'], METRIC, (), 'metric.', path, i)
        cands = r.get('candidates')
        if cands is None:
            continue
        if not isinstance(cands, list):
            raise BadDB('%s: record %d: field candidates: %s, not an array' % (path, i, _kind(cands)))
        for j, c in enumerate(cands):
            if not isinstance(c, dict):
                raise BadDB('%s: record %d: field candidates[%d]: %s, not an object' % (path, i, j, _kind(c)))
            _fields(c, CANDIDATE, ('tile', 'disposition'), 'candidates[%d].' % j, path, i)


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:  # m3kit (jansson, JSON_REJECT_DUPLICATES) refuses them: which one wins is no rule
            raise ValueError('duplicate object key "%s"' % k)
        d[k] = v
    return d


def _no_constant(name):
    raise ValueError('%s is not JSON' % name)  # Python's json reads NaN and Infinity, jansson does not


def load(path):
    """The checked document of the DB at path; raises BadDB ('PATH: why') where it cannot be read, is
    not JSON, or fails check().  Reads only."""
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as ex:
        raise BadDB('%s: %s' % (path, ex.strerror or ex))
    if not data:
        raise BadDB('%s: empty file (a truncated write?)' % path)
    try:
        doc = json.loads(data.decode('utf-8'), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except UnicodeDecodeError as ex:
        raise BadDB('%s: not UTF-8: %s (garbled tuning DB)' % (path, ex))
    except json.JSONDecodeError as ex:
        raise BadDB('%s:%d:%d: not valid JSON: %s (truncated or garbled tuning DB)' % (path, ex.lineno, ex.colno, ex.msg))
    except (ValueError, RecursionError) as ex:
        raise BadDB('%s: not valid JSON: %s' % (path, ex))
    check(doc, path)
    return doc


def load_or_exit(path, who):
    """load(path), or exit (status 1) with the one-line message 'WHO: PATH: why' on stderr."""
    try:
        return load(path)
    except BadDB as ex:
        sys.exit('%s: %s' % (who, ex))


def open_locked(path, who):
    """(real path, lock file, mode, document) of the DB at path, its lock held until the lock file is
    closed (or the process ends); exits (status 1) with a one-line message naming the file on any error:
    unreadable, not JSON, not a tuning DB of format VERSION, or a record of the wrong shape (check()), in
    which case the file is left as it was."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode & 0o7777  # before the lock file is made beside it
        lock = open(real + '.lock', 'a')
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as ex:
        sys.exit('%s: %s: %s' % (who, real, ex))
    return real, lock, mode, load_or_exit(real, who)


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
