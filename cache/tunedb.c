/* tunedb.c - the tuning database: JSON <-> records, staleness filtering,
 * lock + re-read + merge on save, nearest-bucket lookup, table and plot output.
 * The format and every rule are documented in tunedb.h and docs/tuning-db.md;
 * the comments here say why the code is shaped the way it is.
 *
 * Layering: crash safety (temp + fsync + rename, flock) is store.c's job and
 * is only *used* here, so there is one audited implementation of it.  JSON is
 * jansson's job: this file never scans JSON text by hand, and even the
 * one-field-per-line layout below is assembled from jansson-encoded pieces
 * and re-parsed by jansson before it is published.
 */
#include "cache/tunedb.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cache/store.h"

/* Reals keep 10 significant digits: plenty for µs and GB/s, and any value that
 * was itself read from a ≤10-digit decimal round-trips bit-exactly, which is
 * what makes load(save(x)) == x testable with ==. */
#define REAL_FLAGS (JSON_ENCODE_ANY | JSON_REAL_PRECISION(10))

/* Bounded copy/append of messages (truncation is acceptable for diagnostics;
 * snprintf("%s") would be too, but trips -Wformat-truncation). */
static void scopy(char *d, size_t n, const char *s) {
  if (!n) return;
  size_t l = strlen(s);
  if (l >= n) l = n - 1;
  memcpy(d, s, l);
  d[l] = 0;
}

static void sappend(char *d, size_t n, const char *s) {
  size_t l = strlen(d);
  if (l < n) scopy(d + l, n - l, s);
}

/* ========================================================================= */
/* Buckets                                                                   */
/* ========================================================================= */

/* Dimension names are identifiers so that the canonical text needs no
 * escaping and can be used verbatim in plot file names and CLI arguments.
 * The bucket struct is fixed-size (no allocation) because buckets are built
 * on the stack in hot-ish runtime paths (one per kernel lookup). */
static int name_ok(const char *s, size_t len) {
  if (len == 0 || len >= M3_BUCKET_NAME_MAX || !(s[0] >= 'a' && s[0] <= 'z')) return 0;
  for (size_t i = 1; i < len; i++)
    if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_')) return 0;
  return 1;
}

m3_status m3_bucket_add(m3_bucket *b, const char *name, int64_t value, m3_err *e) {
  if (!b || !name || !name_ok(name, strlen(name)))
    return m3_errf(e, M3_INVAL, "bucket dimension name '%s' must match [a-z][a-z0-9_]{0,14}",
                   name ? name : "(null)");
  if (value < 0) return m3_errf(e, M3_INVAL, "bucket dimension %s=%lld is negative", name, (long long)value);
  if (m3_bucket_get(b, name) >= 0) return m3_errf(e, M3_INVAL, "bucket dimension '%s' given twice", name);
  if (b->ndims >= M3_BUCKET_MAX_DIMS)
    return m3_errf(e, M3_RANGE, "bucket has more than %d dimensions (adding '%s')", M3_BUCKET_MAX_DIMS, name);
  snprintf(b->dims[b->ndims].name, M3_BUCKET_NAME_MAX, "%s", name);
  b->dims[b->ndims].value = value;
  b->ndims++;
  return M3_OK;
}

m3_status m3_bucket_parse(const char *s, m3_bucket *b, m3_err *e) {
  memset(b, 0, sizeof *b);
  if (!s) return m3_errf(e, M3_FORMAT, "bucket: missing text");
  const char *p = s;
  if (!*p) return M3_OK; /* a shape-independent kernel: no dimensions */
  /* One "name=value" part per iteration; p is the start of the part, end its
   * terminating ',' or NUL.  An empty part ("a=1,,b=2", a trailing ',') has
   * no '=' before its end and is rejected like any other malformed part. */
  for (;;) {
    const char *eq = strchr(p, '=');
    const char *end = strchr(p, ',');
    if (!end) end = p + strlen(p);
    if (!eq || eq > end)
      return m3_errf(e, M3_FORMAT, "bucket '%s': part '%.*s' is not name=value", s, (int)(end - p), p);
    if (!name_ok(p, (size_t)(eq - p)))
      return m3_errf(e, M3_FORMAT, "bucket '%s': bad dimension name '%.*s'", s, (int)(eq - p), p);
    /* Canonical decimals only (no sign, no leading zeros, no spaces), so that
     * parse-then-format is the identity and two spellings never name one bucket. */
    const char *v = eq + 1;
    size_t vlen = (size_t)(end - v);
    int digits = vlen > 0 && vlen <= 18 && !(vlen > 1 && v[0] == '0');
    for (size_t i = 0; digits && i < vlen; i++) digits = v[i] >= '0' && v[i] <= '9';
    if (!digits)
      return m3_errf(e, M3_FORMAT, "bucket '%s': value '%.*s' of '%.*s' is not a canonical decimal", s,
                     (int)vlen, v, (int)(eq - p), p);
    /* 18 digits always fit int64_t, so strtoll cannot overflow here; the
     * duplicate-name and dimension-count checks live in m3_bucket_add. */
    char name[M3_BUCKET_NAME_MAX];
    snprintf(name, sizeof name, "%.*s", (int)(eq - p), p);
    m3_err sub;
    if (m3_bucket_add(b, name, strtoll(v, NULL, 10), &sub) != M3_OK)
      return m3_errf(e, M3_FORMAT, "bucket '%s': %s", s, sub.msg);
    if (!*end) return M3_OK;
    p = end + 1;
  }
}

/* snprintf semantics (returns the length needed, truncates safely) so that a
 * caller with a small buffer can detect it; M3_BUCKET_STR_MAX always fits. */
int m3_bucket_format(const m3_bucket *b, char *buf, size_t n) {
  size_t used = 0;
  if (n) buf[0] = 0;
  for (int i = 0; i < b->ndims; i++) {
    int w = snprintf(used < n ? buf + used : NULL, used < n ? n - used : 0, "%s%s=%lld", i ? "," : "",
                     b->dims[i].name, (long long)b->dims[i].value);
    if (w > 0) used += (size_t)w;
  }
  return (int)used;
}

int64_t m3_bucket_get(const m3_bucket *b, const char *name) {
  for (int i = 0; i < b->ndims; i++)
    if (!strcmp(b->dims[i].name, name)) return b->dims[i].value;
  return -1;
}

/* Same names (any order); with `values` also the same values.  Name-based
 * rather than positional, because the op declaring the dimensions and the
 * tuner printing them could disagree on order, and a record must not become
 * unreachable over a cosmetic difference. */
static int same_dims(const m3_bucket *a, const m3_bucket *b, int values) {
  if (a->ndims != b->ndims) return 0;
  for (int i = 0; i < a->ndims; i++) {
    int64_t v = m3_bucket_get(b, a->dims[i].name);
    if (v < 0 || (values && v != a->dims[i].value)) return 0;
  }
  return 1;
}

int m3_bucket_equal(const m3_bucket *a, const m3_bucket *b) { return same_dims(a, b, 1); }

/* The lookup scale.  0 sits one octave below 1 so that a zero-length dimension
 * (e.g. ctx=0, prefill without history) still has a finite distance. */
static double lg(int64_t v) { return v > 0 ? log2((double)v) : -1.0; }

/* ========================================================================= */
/* Dispositions and records                                                  */
/* ========================================================================= */

static const char *const disp_names[] = {
#define M3_X_DISP_NAME(name) #name,
    M3_DISPOSITION_MAP(M3_X_DISP_NAME)
#undef M3_X_DISP_NAME
};
_Static_assert(sizeof disp_names / sizeof *disp_names == M3_DISP_COUNT, "disposition table");

const char *m3_disposition_name(m3_disposition d) {
  return (unsigned)d < M3_DISP_COUNT ? disp_names[d] : "UNKNOWN";
}

m3_status m3_disposition_parse(const char *s, m3_disposition *d, m3_err *e) {
  for (int i = 0; s && i < M3_DISP_COUNT; i++)
    if (!strcmp(s, disp_names[i])) {
      *d = (m3_disposition)i;
      return M3_OK;
    }
  return m3_errf(e, M3_FORMAT, "unknown disposition '%s'", s ? s : "(null)");
}

m3_tune_record m3_tune_record_empty(void) {
  m3_tune_record r;
  memset(&r, 0, sizeof r);
  r.default_us = r.tuned_us = NAN;
  r.metric.achieved = r.metric.ceiling = r.metric.pct_of_ceiling = NAN;
  return r;
}

/* Text jansson can encode (valid UTF-8): checked up front so that a record
 * accepted by put can always be saved. */
static int text_ok(const char *s) {
  if (!s) return 1;
  json_t *j = json_string(s);
  json_decref(j);
  return j != NULL;
}

/* Tiles go into whitespace-separated .dat files and are compared as strings,
 * so they must be single words; canonical tile strings always are. */
static int tile_ok(const char *s) {
  if (!s || !*s || !text_ok(s)) return 0;
  for (; *s; s++)
    if ((unsigned char)*s <= ' ') return 0;
  return 1;
}

static int arch_ok(const char *s) {
  if (!s || !*s || strlen(s) > 31) return 0;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_')) return 0;
  return 1;
}

m3_status m3_tune_record_check(const m3_tune_record *r, m3_err *e) {
  if (!r) return m3_errf(e, M3_INVAL, "record: NULL");
  if (!r->key || !*r->key || !text_ok(r->key)) return m3_errf(e, M3_INVAL, "record: missing or invalid 'key'");
  for (const char *p = r->key; *p; p++)
    if ((unsigned char)*p < ' ') return m3_errf(e, M3_INVAL, "record '%s': control character in 'key'", r->key);
  if (!arch_ok(r->arch))
    return m3_errf(e, M3_INVAL, "record '%s': missing or invalid 'arch' (want e.g. sm_90)", r->key);
  if (!tile_ok(r->tile)) return m3_errf(e, M3_INVAL, "record '%s': missing or invalid 'tile'", r->key);
  if (r->default_tile && !tile_ok(r->default_tile))
    return m3_errf(e, M3_INVAL, "record '%s': invalid 'default_tile'", r->key);
  if (!r->prov.template_hash || !*r->prov.template_hash)
    return m3_errf(e, M3_INVAL, "record '%s': missing 'provenance.template_hash' (needed to detect stale records)",
                   r->key);
  const char *texts[] = {r->prov.gpu,           r->prov.driver_version, r->prov.nvrtc_version,
                         r->prov.cublas_version, r->prov.template_hash,  r->prov.m3kit_version,
                         r->prov.date,           r->prov.command,        r->metric.unit,
                         r->prov.code_hash,      r->pinned};
  for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
    if (!text_ok(texts[i]))
      return m3_errf(e, M3_INVAL, "record '%s': a provenance/metric/pinned string is not UTF-8", r->key);
  for (int i = 0; i < r->bucket.ndims; i++)
    if (!name_ok(r->bucket.dims[i].name, strlen(r->bucket.dims[i].name)) || r->bucket.dims[i].value < 0)
      return m3_errf(e, M3_INVAL, "record '%s': bad bucket dimension %d", r->key, i);
  if (r->n_candidates && !r->candidates)
    return m3_errf(e, M3_INVAL, "record '%s': n_candidates=%zu but no array", r->key, r->n_candidates);
  /* Fault 32: a tile that failed verification must never become the answer.
   * The chosen tile may be absent from the list (a hand-written seed, or the
   * default when nothing passed), but where it is listed it must have PASSED,
   * every time: one INCORRECT run condemns the tile whatever else passed. */
  int failed = 0;
  for (size_t i = 0; i < r->n_candidates; i++) {
    const m3_tune_candidate *c = &r->candidates[i];
    if (!tile_ok(c->tile)) return m3_errf(e, M3_INVAL, "record '%s': candidate %zu: missing or invalid 'tile'", r->key, i);
    if ((unsigned)c->disposition >= M3_DISP_COUNT)
      return m3_errf(e, M3_INVAL, "record '%s': candidate %zu: bad disposition", r->key, i);
    if (!text_ok(c->reason)) return m3_errf(e, M3_INVAL, "record '%s': candidate %zu: reason is not UTF-8", r->key, i);
    failed |= !strcmp(c->tile, r->tile) && c->disposition != M3_DISP_PASSED;
  }
  if (failed)
    return m3_errf(e, M3_INVAL, "record '%s': chosen tile '%s' is listed as a candidate that did not PASS verification", r->key, r->tile);
  return M3_OK;
}

/* --- deep copies ---------------------------------------------------------- */

static char *dup_or_null(const char *s, int *oom) {
  if (!s) return NULL;
  char *d = strdup(s);
  if (!d) *oom = 1;
  return d;
}

/* The record struct is const-qualified for its callers (a DB-owned record
 * must not be modified in place: its identity indexes the handle), so the
 * owner casts the const away only here, at free time. */
static void record_free(m3_tune_record *r) {
  free((char *)r->key);
  free((char *)r->arch);
  free((char *)r->tile);
  free((char *)r->pinned);
  free((char *)r->default_tile);
  const char *p[] = {r->prov.gpu,          r->prov.driver_version, r->prov.nvrtc_version,
                     r->prov.cublas_version, r->prov.template_hash, r->prov.m3kit_version,
                     r->prov.date,         r->prov.command,        r->metric.unit,
                     r->prov.code_hash};
  for (size_t i = 0; i < sizeof p / sizeof *p; i++) free((char *)p[i]);
  for (size_t i = 0; i < r->n_candidates; i++) {
    free((char *)r->candidates[i].tile);
    free((char *)r->candidates[i].reason);
  }
  free((void *)r->candidates);
  memset(r, 0, sizeof *r);
}

/* Deep copy: put() borrows everything from the caller (the tuner builds the
 * record from stack buffers), and load borrows from a jansson tree that is
 * freed right after, so the handle must own every byte it keeps.  On OOM the
 * partial copy is freed and nothing is inserted. */
static m3_status record_copy(m3_tune_record *d, const m3_tune_record *s, m3_err *e) {
  int oom = 0;
  *d = *s; /* numbers, bucket, then replace every pointer */
  d->key = dup_or_null(s->key, &oom);
  d->arch = dup_or_null(s->arch, &oom);
  d->tile = dup_or_null(s->tile, &oom);
  d->pinned = dup_or_null(s->pinned, &oom);
  d->default_tile = dup_or_null(s->default_tile, &oom);
  d->prov.gpu = dup_or_null(s->prov.gpu, &oom);
  d->prov.driver_version = dup_or_null(s->prov.driver_version, &oom);
  d->prov.nvrtc_version = dup_or_null(s->prov.nvrtc_version, &oom);
  d->prov.cublas_version = dup_or_null(s->prov.cublas_version, &oom);
  d->prov.template_hash = dup_or_null(s->prov.template_hash, &oom);
  d->prov.m3kit_version = dup_or_null(s->prov.m3kit_version, &oom);
  d->prov.date = dup_or_null(s->prov.date, &oom);
  d->prov.command = dup_or_null(s->prov.command, &oom);
  d->prov.code_hash = dup_or_null(s->prov.code_hash, &oom);
  d->metric.unit = dup_or_null(s->metric.unit, &oom);
  d->candidates = NULL;
  d->n_candidates = 0;
  if (s->n_candidates) {
    m3_tune_candidate *c = calloc(s->n_candidates, sizeof *c);
    if (!c) oom = 1;
    for (size_t i = 0; c && i < s->n_candidates; i++) {
      c[i] = s->candidates[i];
      c[i].tile = dup_or_null(s->candidates[i].tile, &oom);
      c[i].reason = dup_or_null(s->candidates[i].reason, &oom);
    }
    d->candidates = c;
    d->n_candidates = c ? s->n_candidates : 0;
  }
  if (oom) {
    record_free(d);
    return m3_errf(e, M3_NOMEM, "tuning DB: out of memory copying record '%s'", s->key);
  }
  return M3_OK;
}

/* ========================================================================= */
/* The handle                                                                */
/* ========================================================================= */

/* Where an entry came from.  Only ORIGIN_PUT entries are written by
 * save_merge: re-writing what we merely loaded could clobber a newer result
 * that another tuner published after our load. */
enum { ORIGIN_SEED, ORIGIN_FILE, ORIGIN_PUT };

typedef struct entry {
  m3_tune_record r; /* owned deep copy */
  int origin;
} entry;

/* A flat array: DBs hold hundreds of records, lookups happen at model load
 * (kernels are memoised by the runtime), so linear scans are the right size. */
struct m3_tunedb {
  entry *v;
  size_t n, cap;
};

m3_tunedb *m3_tunedb_new(void) { return calloc(1, sizeof(m3_tunedb)); }

void m3_tunedb_free(m3_tunedb *db) {
  if (!db) return;
  for (size_t i = 0; i < db->n; i++) record_free(&db->v[i].r);
  free(db->v);
  free(db);
}

size_t m3_tunedb_count(const m3_tunedb *db) { return db ? db->n : 0; }

const m3_tune_record *m3_tunedb_get(const m3_tunedb *db, size_t i) {
  return db && i < db->n ? &db->v[i].r : NULL;
}

static int same_identity(const m3_tune_record *r, const char *key, const m3_bucket *b, const char *arch) {
  return !strcmp(r->key, key) && !strcmp(r->arch, arch) && m3_bucket_equal(&r->bucket, b);
}

static entry *find_entry(const m3_tunedb *db, const char *key, const m3_bucket *b, const char *arch) {
  for (size_t i = 0; i < db->n; i++)
    if (same_identity(&db->v[i].r, key, b, arch)) return &db->v[i];
  return NULL;
}

const m3_tune_record *m3_tunedb_find(const m3_tunedb *db, const char *key, const m3_bucket *bucket,
                                     const char *arch) {
  if (!db || !key || !bucket || !arch) return NULL;
  entry *en = find_entry(db, key, bucket, arch);
  return en ? &en->r : NULL;
}

/* Insert or replace in place (keeps insertion order stable for printing).
 * *prev_origin receives the replaced entry's origin, or -1. */
static m3_status db_insert(m3_tunedb *db, const m3_tune_record *r, int origin, int *prev_origin, m3_err *e) {
  m3_tune_record copy;
  M3_TRY(record_copy(&copy, r, e));
  entry *en = find_entry(db, r->key, &r->bucket, r->arch);
  if (prev_origin) *prev_origin = en ? en->origin : -1;
  if (en) {
    record_free(&en->r);
  } else {
    if (db->n == db->cap) {
      size_t cap = db->cap ? db->cap * 2 : 16;
      entry *v = realloc(db->v, cap * sizeof *v);
      if (!v) {
        record_free(&copy);
        return m3_errf(e, M3_NOMEM, "tuning DB: out of memory growing to %zu records", cap);
      }
      db->v = v;
      db->cap = cap;
    }
    en = &db->v[db->n++];
  }
  en->r = copy;
  en->origin = origin;
  return M3_OK;
}

m3_status m3_tunedb_put(m3_tunedb *db, const m3_tune_record *r, m3_err *e) {
  if (!db) return m3_errf(e, M3_INVAL, "m3_tunedb_put: NULL db");
  M3_TRY(m3_tune_record_check(r, e));
  return db_insert(db, r, ORIGIN_PUT, NULL, e);
}

m3_status m3_tunedb_path(const char *arch, char *buf, size_t n, m3_err *e) {
  /* The arch becomes a file name: restricting it also rules out "../". */
  if (!arch_ok(arch)) return m3_errf(e, M3_INVAL, "tuning DB: bad arch name '%s'", arch ? arch : "(null)");
  char root[4096];
  M3_TRY(m3_cache_root(root, sizeof root, e));
  if ((size_t)snprintf(buf, n, "%s/tuning/%s.json", root, arch) >= n)
    return m3_errf(e, M3_RANGE, "tuning DB path under '%s' is too long", root);
  return M3_OK;
}

void m3_tunedb_now_iso(char *buf, size_t n) {
  time_t t = time(NULL);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(buf, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

/* ========================================================================= */
/* JSON -> record                                                            */
/* ========================================================================= */

/* The field names of format version 1.  Anything else is "unknown": counted
 * (a soft mismatch, practice 7) and left on disk, because a newer m3kit that
 * adds an optional field without bumping the version must not lose data when
 * an older one merges into the same file. */
static const char *const top_fields[] = {"format", "version", "records", "comment", NULL};
/* "carried": tools/rekey.py --carry-fix's reason (docs/tuning-db.md); read by people, not by the runtime */
static const char *const rec_fields[] = {"key",        "bucket",   "arch",       "tile",       "pinned",  "default_tile",
                                         "default_us", "tuned_us", "provenance", "metric",     "carried", "candidates",
                                         NULL};
static const char *const prov_fields[] = {"gpu",           "sm_count",      "driver_version",
                                          "nvrtc_version", "cublas_version", "template_hash",
                                          "m3kit_version", "date",          "command",
                                          "code_hash",     NULL};
static const char *const metric_fields[] = {"unit", "achieved", "ceiling", "pct_of_ceiling", NULL};
static const char *const cand_fields[] = {"tile", "disposition", "reason", "median_us",
                                          "p20_us", "p80_us",    "n",      NULL};

/* Linear scan of a ~10-entry table per field: trivial next to the I/O. */
static int count_unknown(json_t *o, const char *const *known) {
  int n = 0;
  const char *k;
  json_t *v;
  json_object_foreach(o, k, v) {
    int hit = 0;
    for (const char *const *p = known; *p && !hit; p++) hit = !strcmp(*p, k);
    n += !hit;
  }
  return n;
}

/* Typed getters.  Absent and null both mean "not recorded"; a present value of
 * the wrong type means a broken writer, so the record is rejected (returns -1
 * with the reason in why). */
static int get_str(json_t *o, const char *name, int required, const char **out, char *why, size_t wn) {
  json_t *v = json_object_get(o, name);
  *out = NULL;
  if (!v || json_is_null(v)) {
    if (required) snprintf(why, wn, "missing '%s'", name);
    return required ? -1 : 0;
  }
  if (!json_is_string(v)) {
    snprintf(why, wn, "'%s' is not a string", name);
    return -1;
  }
  *out = json_string_value(v);
  return 0;
}

static int get_num(json_t *o, const char *name, double *out, char *why, size_t wn) {
  json_t *v = json_object_get(o, name);
  *out = NAN;
  if (!v || json_is_null(v)) return 0;
  if (!json_is_number(v)) {
    snprintf(why, wn, "'%s' is not a number", name);
    return -1;
  }
  *out = json_number_value(v);
  return 0;
}

static int get_int(json_t *o, const char *name, int *out, char *why, size_t wn) {
  json_t *v = json_object_get(o, name);
  *out = 0;
  if (!v || json_is_null(v)) return 0;
  if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT_MAX) {
    snprintf(why, wn, "'%s' is not a non-negative integer", name);
    return -1;
  }
  *out = (int)json_integer_value(v);
  return 0;
}

static int get_obj(json_t *o, const char *name, json_t **out, char *why, size_t wn) {
  json_t *v = json_object_get(o, name);
  *out = NULL;
  if (!v || json_is_null(v)) return 0;
  if (!json_is_object(v)) {
    snprintf(why, wn, "'%s' is not an object", name);
    return -1;
  }
  *out = v;
  return 0;
}

/* Fill *r with pointers BORROWED from `o` (valid while o lives); the candidate
 * array is malloc'd into *cands (caller frees).  Returns 0, or -1 with why. */
static int parse_record(json_t *o, m3_tune_record *r, m3_tune_candidate **cands, int *unknown, char *why,
                        size_t wn) {
  *r = m3_tune_record_empty();
  *cands = NULL;
  if (!json_is_object(o)) {
    snprintf(why, wn, "not an object");
    return -1;
  }
  *unknown += count_unknown(o, rec_fields);
  const char *bucket = NULL;
  json_t *prov, *metric;
  if (get_str(o, "key", 1, &r->key, why, wn) || get_str(o, "bucket", 1, &bucket, why, wn) ||
      get_str(o, "arch", 1, &r->arch, why, wn) || get_str(o, "tile", 1, &r->tile, why, wn) ||
      get_str(o, "pinned", 0, &r->pinned, why, wn) ||
      get_str(o, "default_tile", 0, &r->default_tile, why, wn) || get_num(o, "default_us", &r->default_us, why, wn) ||
      get_num(o, "tuned_us", &r->tuned_us, why, wn) || get_obj(o, "provenance", &prov, why, wn) ||
      get_obj(o, "metric", &metric, why, wn))
    return -1;
  m3_err be;
  if (m3_bucket_parse(bucket, &r->bucket, &be) != M3_OK) {
    scopy(why, wn, be.msg);
    return -1;
  }
  if (!prov) {
    snprintf(why, wn, "missing 'provenance'");
    return -1;
  }
  *unknown += count_unknown(prov, prov_fields);
  if (get_str(prov, "gpu", 0, &r->prov.gpu, why, wn) || get_int(prov, "sm_count", &r->prov.sm_count, why, wn) ||
      get_str(prov, "driver_version", 0, &r->prov.driver_version, why, wn) ||
      get_str(prov, "nvrtc_version", 0, &r->prov.nvrtc_version, why, wn) ||
      get_str(prov, "cublas_version", 0, &r->prov.cublas_version, why, wn) ||
      get_str(prov, "template_hash", 1, &r->prov.template_hash, why, wn) ||
      get_str(prov, "m3kit_version", 0, &r->prov.m3kit_version, why, wn) ||
      get_str(prov, "date", 0, &r->prov.date, why, wn) || get_str(prov, "command", 0, &r->prov.command, why, wn) ||
      get_str(prov, "code_hash", 0, &r->prov.code_hash, why, wn))
    return -1;
  if (metric) {
    *unknown += count_unknown(metric, metric_fields);
    if (get_str(metric, "unit", 0, &r->metric.unit, why, wn) ||
        get_num(metric, "achieved", &r->metric.achieved, why, wn) ||
        get_num(metric, "ceiling", &r->metric.ceiling, why, wn) ||
        get_num(metric, "pct_of_ceiling", &r->metric.pct_of_ceiling, why, wn))
      return -1;
  }
  json_t *ca = json_object_get(o, "candidates");
  if (ca && !json_is_null(ca) && !json_is_array(ca)) {
    snprintf(why, wn, "'candidates' is not an array");
    return -1;
  }
  size_t n = ca ? json_array_size(ca) : 0;
  if (n) {
    m3_tune_candidate *c = calloc(n, sizeof *c);
    if (!c) {
      snprintf(why, wn, "out of memory");
      return -1;
    }
    *cands = c;
    size_t k = 0, i;
    json_t *co;
    json_array_foreach(ca, i, co) {
      char sub[200] = "";
      const char *disp = NULL;
      m3_tune_candidate *x = &c[k];
      if (!json_is_object(co)) {
        snprintf(why, wn, "candidate %zu is not an object", i);
        return -1;
      }
      *unknown += count_unknown(co, cand_fields);
      if (get_str(co, "tile", 1, &x->tile, sub, sizeof sub) ||
          get_str(co, "disposition", 1, &disp, sub, sizeof sub) ||
          get_str(co, "reason", 0, &x->reason, sub, sizeof sub) ||
          get_num(co, "median_us", &x->median_us, sub, sizeof sub) ||
          get_num(co, "p20_us", &x->p20_us, sub, sizeof sub) || get_num(co, "p80_us", &x->p80_us, sub, sizeof sub) ||
          get_int(co, "n", &x->n_runs, sub, sizeof sub)) {
        snprintf(why, wn, "candidate %zu: %s", i, sub);
        return -1;
      }
      /* A disposition this version does not know (added by a newer m3kit) only
       * loses that candidate's diagnostics, not the record: soft, counted. */
      if (m3_disposition_parse(disp, &x->disposition, NULL) != M3_OK) {
        (*unknown)++;
        continue;
      }
      k++;
    }
    r->candidates = c;
    r->n_candidates = k;
  }
  m3_err ce;
  if (m3_tune_record_check(r, &ce) != M3_OK) {
    scopy(why, wn, ce.msg);
    return -1;
  }
  return 0;
}

/* Parse and check the envelope.  M3_FORMAT (naming path, line, column) for
 * anything that is not a version>=1 m3kit tuning DB.  *version tells the
 * caller whether it may read/replace the records. */
static m3_status parse_doc(const char *path, const uint8_t *data, size_t len, json_t **root, int *version,
                           m3_err *e) {
  *root = NULL;
  *version = 0;
  /* Our own writer never leaves an empty file (rename publishes whole files),
   * but a copy tool, a full disk under another editor, or a hand-truncation
   * can; jansson would report it less clearly than this. */
  if (len == 0) return m3_errf(e, M3_FORMAT, "%s: empty file (a truncated write?)", path);
  /* Duplicate keys mean a hand-merged or garbled file: which value "wins"
   * would be the parser's choice, not a documented rule, so reject it.  The
   * length-bounded load also rejects trailing garbage after the object. */
  json_error_t je;
  json_t *j = json_loadb((const char *)data, len, JSON_REJECT_DUPLICATES, &je);
  if (!j)
    return m3_errf(e, M3_FORMAT, "%s:%d:%d: not valid JSON: %s (truncated or garbled tuning DB)", path, je.line,
                   je.column, je.text);
  /* Valid JSON that is not ours (another tool's file dropped in the tuning
   * directory, a config mistakenly copied over it) is as unusable as garbage
   * and gets the same treatment: M3_FORMAT, and a .corrupt copy on save.
   * "records" is only checked for the version we understand: a newer
   * version may legitimately restructure it. */
  json_t *fmt = json_object_get(j, "format"), *ver = json_object_get(j, "version");
  const char *why = NULL;
  if (!json_is_object(j))
    why = "the top level is not an object";
  else if (!json_is_string(fmt) || strcmp(json_string_value(fmt), M3_TUNEDB_FORMAT))
    why = "\"format\" is not \"" M3_TUNEDB_FORMAT "\"";
  else if (!json_is_integer(ver) || json_integer_value(ver) < 1 || json_integer_value(ver) > INT_MAX)
    why = "\"version\" is not a positive integer";
  else if (json_integer_value(ver) == M3_TUNEDB_VERSION && !json_is_array(json_object_get(j, "records")))
    why = "\"records\" is not an array";
  if (why) {
    json_decref(j);
    return m3_errf(e, M3_FORMAT, "%s: not an m3kit tuning DB: %s", path, why);
  }
  *version = (int)json_integer_value(ver);
  *root = j;
  return M3_OK;
}

/* ========================================================================= */
/* Load                                                                      */
/* ========================================================================= */

/* Accumulates across the seed and the user file; becomes rep->summary. */
typedef struct load_notes {
  m3_tunedb_report *rep;
  char first_invalid[400];
  char first_stale_tpl[160];
  char newer[600];
} load_notes;

/* A code hash of the filter's scheme (hashed by this build's normalisation). */
static int has_scheme(const char *code_hash, const char *scheme) {
  return code_hash && scheme && !strncmp(code_hash, scheme, strlen(scheme));
}

/* The template name is the key's text before '(' (practice 4's key form). */
static void template_name(const char *key, char *buf, size_t n) {
  size_t len = strcspn(key, "(");
  snprintf(buf, n, "%.*s", (int)len, key);
}

/* The tile of a record whose code hash its own tile no longer renders, when
 * f->complete_tile's completion of it does render that code (a tile axis
 * added since the tune, whose first value emits the code as it was): the
 * completed tile in buf, else NULL. */
static const char *completion_keeps(const m3_tunedb_filter *f, const m3_tune_record *r, char *buf, size_t n) {
  if (!f->complete_tile || !f->code_hash) return NULL;
  const char *t = f->complete_tile(f->ctx, r->key, r->tile);
  if (!t || snprintf(buf, n, "%s", t) >= (int)n) return NULL; /* copied: the callbacks may share a buffer */
  const char *c = f->code_hash(f->ctx, r->key, buf, r->arch);
  return c && !strcmp(c, r->prov.code_hash) ? buf : NULL;
}

/* Returns nonzero (and counts it) when the record must be ignored.  Arch and
 * template hash decide whether a tile is even meaningful, so they apply to
 * every record.  The driver only moves timings, and a seed comes from another
 * machine by definition, so the driver check applies to user records only:
 * otherwise no user with a different driver would ever see a seed record. */
static int is_stale(const m3_tune_record *r, int origin, const m3_tunedb_filter *f, load_notes *ln,
                    char *completed, size_t cn) {
  completed[0] = 0; /* kept through a rendering: the chosen tile, completed where it lacked an axis, here */
  if (!f) return 0;
  if (f->arch && strcmp(f->arch, r->arch)) return ++ln->rep->stale_arch;
  if (f->driver_version && origin != ORIGIN_SEED &&
      (!r->prov.driver_version || strcmp(f->driver_version, r->prov.driver_version)))
    return ++ln->rep->stale_driver;
  /* The same template text renders the same code, so a current template
   * hash settles it without rendering anything (the common case: the runtime
   * loads its DB at every start).  Only a record whose template changed is
   * rendered, and kept if its tile's code did not change (its code hash). */
  if (!f->template_hash && !f->code_hash) return 0;
  char name[160];
  template_name(r->key, name, sizeof name);
  const char *h = f->template_hash ? f->template_hash(f->ctx, name) : NULL;
  if (h && !strcmp(h, r->prov.template_hash)) return 0;
  if (f->code_hash && has_scheme(r->prov.code_hash, f->code_scheme)) {
    const char *c = f->code_hash(f->ctx, r->key, r->tile, r->arch);
    if (c && !strcmp(c, r->prov.code_hash)) {
      /* its default and candidates may still lack an axis its tile names (a hand-edited record) */
      if (snprintf(completed, cn, "%s", r->tile) >= (int)cn) completed[0] = 0;
      return 0;
    }
    if (completion_keeps(f, r, completed, cn)) return 0;
    completed[0] = 0;
  }
  if (!ln->first_stale_tpl[0]) snprintf(ln->first_stale_tpl, sizeof ln->first_stale_tpl, "%s", name);
  return ++ln->rep->stale_template;
}

/* Fields of a tile string ("a=1,b=2": 2).  A tile with fewer than the chosen
 * one (which rendered, so names every axis) lacks an axis: only those are
 * handed to f->complete_tile, which renders the template's schema - at every
 * start for a record whose template changed, over ~200 candidates each. */
static int n_fields(const char *tile) {
  int n = 0;
  for (; *tile; tile++) n += *tile == '=';
  return n;
}

/* db_insert of r with its tiles completed: the chosen one is `tile`
 * (completion_keeps, or r's own), the default and the candidates' are
 * completed where they lack an axis, so that the record reads as if tuned
 * with the added axis at its first value (the chosen tile stays the PASSED
 * candidate it was).  *changed: whether any tile changed. */
static m3_status insert_completed(m3_tunedb *db, const m3_tune_record *r, const char *tile, int origin, int *prev,
                                  const m3_tunedb_filter *f, int *changed, m3_err *e) {
  m3_tune_record c = *r;
  char *dflt = NULL;
  m3_tune_candidate *cands = NULL;
  int oom = 0;
  c.tile = tile;
  *changed = strcmp(tile, r->tile) != 0;
  const int nf = n_fields(tile);
  if (r->default_tile && f->complete_tile && n_fields(r->default_tile) < nf) {
    const char *t = f->complete_tile(f->ctx, r->key, r->default_tile);
    if (t && !(dflt = strdup(t))) oom = 1;
    if (dflt) c.default_tile = dflt, *changed = 1;
  }
  if (r->n_candidates && f->complete_tile && !(cands = calloc(r->n_candidates, sizeof *cands))) oom = 1;
  for (size_t i = 0; cands && i < r->n_candidates; i++) {
    cands[i] = r->candidates[i];
    const char *t = n_fields(cands[i].tile) < nf ? f->complete_tile(f->ctx, r->key, cands[i].tile) : NULL;
    if (t && !(cands[i].tile = strdup(t))) oom = 1, cands[i].tile = r->candidates[i].tile;
    if (cands[i].tile != r->candidates[i].tile) *changed = 1;
  }
  if (cands) c.candidates = cands;
  m3_status s = oom ? m3_errf(e, M3_NOMEM, "tuning DB: out of memory completing record '%s'", r->key)
                    : db_insert(db, &c, origin, prev, e);
  for (size_t i = 0; cands && i < r->n_candidates; i++)
    if (cands[i].tile != r->candidates[i].tile) free((char *)cands[i].tile);
  free(cands);
  free(dflt);
  return s;
}

static m3_status load_file(m3_tunedb *db, const char *path, int origin, const m3_tunedb_filter *f,
                           load_notes *ln, m3_err *e) {
  uint8_t *data;
  size_t len;
  M3_TRY(m3_read_file(path, &data, &len, e)); /* M3_NOTFOUND handled by the caller */
  json_t *root;
  int version;
  m3_status s = parse_doc(path, data, len, &root, &version, e);
  free(data);
  if (s != M3_OK) return s;
  if (version > M3_TUNEDB_VERSION) {
    /* Written by a newer m3kit: we cannot know what its records mean, so none
     * is used (the caller runs untuned), and save_merge refuses to touch it. */
    ln->rep->newer_files++;
    snprintf(ln->newer, sizeof ln->newer, "%s has format version %d (this m3kit reads %d): ignored", path, version,
             M3_TUNEDB_VERSION);
    json_decref(root);
    return M3_OK;
  }
  ln->rep->unknown_fields += count_unknown(root, top_fields);
  /* Per record: parse (malformed -> counted, skipped), filter (stale ->
   * counted, ignored), then deep-copy into the handle.  One bad record never
   * fails the load: the rest of the file is still good measurements. */
  json_t *recs = json_object_get(root, "records"), *o;
  size_t i;
  s = M3_OK;
  json_array_foreach(recs, i, o) {
    m3_tune_record r;
    m3_tune_candidate *cands;
    char why[300], completed[512];
    if (parse_record(o, &r, &cands, &ln->rep->unknown_fields, why, sizeof why) != 0) {
      ln->rep->invalid++;
      if (!ln->first_invalid[0])
        snprintf(ln->first_invalid, sizeof ln->first_invalid, "%s record %zu: %s", path, i, why);
    } else if (!is_stale(&r, origin, f, ln, completed, sizeof completed)) {
      int prev, changed = 0;
      s = completed[0] ? insert_completed(db, &r, completed, origin, &prev, f, &changed, e)
                       : db_insert(db, &r, origin, &prev, e);
      if (s == M3_OK) {
        ln->rep->completed += changed;
        ln->rep->loaded++;
        /* User records win over seed records: the seed is only what we knew
         * before this machine was tuned. */
        if (origin == ORIGIN_SEED) ln->rep->from_seed++;
        if (prev == ORIGIN_SEED && origin != ORIGIN_SEED) ln->rep->from_seed--;
        if (prev >= 0) ln->rep->loaded--; /* a replacement, not a new record */
      }
    }
    free(cands);
    if (s != M3_OK) break;
  }
  json_decref(root);
  return s;
}

/* One line: the caller prints it once (not one warning per record, which for
 * a seed after a template edit would be hundreds of lines of noise). */
static void build_summary(load_notes *ln, const char *path, const char *seed) {
  m3_tunedb_report *r = ln->rep;
  char *b = r->summary;
  size_t n = sizeof r->summary, u = 0;
#define ADD(...)                                                                        \
  do {                                                                                  \
    if (u < n) {                                                                        \
      int w_ = snprintf(b + u, n - u, "%s", u ? "; " : "");                             \
      if (w_ > 0) u += (size_t)w_;                                                      \
      if (u < n) {                                                                      \
        w_ = snprintf(b + u, n - u, __VA_ARGS__);                                       \
        if (w_ > 0) u += (size_t)w_;                                                    \
      }                                                                                 \
    }                                                                                   \
  } while (0)
  int stale = r->stale_arch + r->stale_driver + r->stale_template;
  if (!stale && !r->invalid && !r->unknown_fields && !r->newer_files && !r->seed_missing && !r->completed) {
    b[0] = 0;
    return;
  }
  ADD("tuning DB %s%s%s: %d records used (%d from seed)", path ? path : "", path && seed ? " + seed " : "",
      seed ? seed : "", r->loaded, r->from_seed);
  if (stale)
    ADD("%d stale records ignored (%d other arch, %d other driver, %d changed template%s%s%s) - re-run 'm3kit tune' "
        "(after an m3kit upgrade that added a key axis, tools/rekey.py carries the records whose code it left as it "
        "was: docs/tuning-db.md)",
        stale, r->stale_arch, r->stale_driver, r->stale_template, ln->first_stale_tpl[0] ? ", e.g. '" : "",
        ln->first_stale_tpl, ln->first_stale_tpl[0] ? "'" : "");
  if (r->completed)
    ADD("%d records kept with their tiles completed (a tile axis added since their tune renders their code at its "
        "first value; 'm3kit tune --rehash' writes the completion, so that loads need not render them)",
        r->completed);
  if (r->invalid) ADD("%d malformed records skipped (first: %s)", r->invalid, ln->first_invalid);
  if (r->unknown_fields) ADD("%d unknown fields ignored", r->unknown_fields);
  if (r->newer_files) ADD("%s", ln->newer);
  if (r->seed_missing) ADD("seed file %s not found", seed);
#undef ADD
}

m3_status m3_tunedb_load(m3_tunedb *db, const char *path, const char *seed_path, const m3_tunedb_filter *f,
                         m3_tunedb_report *rep, m3_err *e) {
  m3_tunedb_report local;
  if (!rep) rep = &local;
  memset(rep, 0, sizeof *rep);
  if (!db) return m3_errf(e, M3_INVAL, "m3_tunedb_load: NULL db");
  load_notes ln = {.rep = rep};
  m3_status first = M3_OK;
  m3_err err1 = {0}, err2 = {0};
  /* Seed first, so that user records replace seed records. */
  if (seed_path) {
    first = load_file(db, seed_path, ORIGIN_SEED, f, &ln, &err1);
    if (first == M3_NOTFOUND) {
      rep->seed_missing = 1;
      first = M3_OK;
    }
  }
  if (path) {
    m3_status s = load_file(db, path, ORIGIN_FILE, f, &ln, &err2);
    if (s == M3_NOTFOUND) s = M3_OK; /* never tuned here: run on defaults */
    if (s != M3_OK && first == M3_OK) {
      first = s;
      err1 = err2;
    } else if (s != M3_OK) {
      sappend(err1.msg, sizeof err1.msg, "; also ");
      sappend(err1.msg, sizeof err1.msg, err2.msg);
    }
  }
  build_summary(&ln, path, seed_path);
  if (first != M3_OK) return m3_errf(e, first, "%s", err1.msg);
  return M3_OK;
}

/* ========================================================================= */
/* Record -> JSON, and the file layout                                       */
/* ========================================================================= */

/* null for unmeasured: JSON has no NaN, and jansson refuses to encode one. */
static json_t *num_or_null(double d) { return isfinite(d) ? json_real(d) : json_null(); }

static int set_str(json_t *o, const char *k, const char *v) {
  return v ? json_object_set_new(o, k, json_string(v)) : 0;
}

/* Field order here is the order in the file (jansson keeps insertion order):
 * identity first, then the answer, then why we believe it.  Absent strings
 * are omitted rather than written as null so that a hand-written seed and a
 * tuner-written record look alike; unmeasured numbers are null so that every
 * candidate line has the same columns.  Errors from the many set calls are
 * OR-ed together: any failure here is out-of-memory, reported once. */
static json_t *record_to_json(const m3_tune_record *r) {
  char bucket[M3_BUCKET_STR_MAX];
  m3_bucket_format(&r->bucket, bucket, sizeof bucket);
  json_t *o = json_object(), *p = json_object(), *m = NULL, *ca = json_array();
  int bad = !o || !p || !ca;
  bad |= set_str(o, "key", r->key) | set_str(o, "bucket", bucket) | set_str(o, "arch", r->arch) |
         set_str(o, "tile", r->tile) | set_str(o, "pinned", r->pinned) | set_str(o, "default_tile", r->default_tile);
  bad |= json_object_set_new(o, "default_us", num_or_null(r->default_us));
  bad |= json_object_set_new(o, "tuned_us", num_or_null(r->tuned_us));
  bad |= set_str(p, "gpu", r->prov.gpu);
  if (r->prov.sm_count) bad |= json_object_set_new(p, "sm_count", json_integer(r->prov.sm_count));
  bad |= set_str(p, "driver_version", r->prov.driver_version) | set_str(p, "nvrtc_version", r->prov.nvrtc_version) |
         set_str(p, "cublas_version", r->prov.cublas_version) | set_str(p, "template_hash", r->prov.template_hash) |
         set_str(p, "code_hash", r->prov.code_hash) |
         set_str(p, "m3kit_version", r->prov.m3kit_version) | set_str(p, "date", r->prov.date) |
         set_str(p, "command", r->prov.command);
  bad |= json_object_set(o, "provenance", p);
  if (r->metric.unit || isfinite(r->metric.achieved) || isfinite(r->metric.ceiling) ||
      isfinite(r->metric.pct_of_ceiling)) {
    m = json_object();
    bad |= !m || set_str(m, "unit", r->metric.unit);
    bad |= json_object_set_new(m, "achieved", num_or_null(r->metric.achieved));
    bad |= json_object_set_new(m, "ceiling", num_or_null(r->metric.ceiling));
    bad |= json_object_set_new(m, "pct_of_ceiling", num_or_null(r->metric.pct_of_ceiling));
    bad |= json_object_set(o, "metric", m);
  }
  for (size_t i = 0; !bad && i < r->n_candidates; i++) {
    const m3_tune_candidate *c = &r->candidates[i];
    json_t *co = json_object();
    bad |= !co || set_str(co, "tile", c->tile) |
                      set_str(co, "disposition", m3_disposition_name(c->disposition)) |
                      set_str(co, "reason", c->reason);
    bad |= json_object_set_new(co, "median_us", num_or_null(c->median_us));
    bad |= json_object_set_new(co, "p20_us", num_or_null(c->p20_us));
    bad |= json_object_set_new(co, "p80_us", num_or_null(c->p80_us));
    bad |= json_object_set_new(co, "n", json_integer(c->n_runs));
    bad |= json_array_append_new(ca, co);
  }
  bad |= json_object_set(o, "candidates", ca);
  json_decref(p);
  json_decref(m);
  json_decref(ca);
  if (bad) {
    json_decref(o);
    return NULL;
  }
  return o;
}

/* Every value in the file goes through json_dumps: escaping, UTF-8 and
 * number formatting are jansson's, only the line breaks are ours. */
static int put_json(FILE *f, json_t *v) {
  char *s = json_dumps(v, REAL_FLAGS);
  if (!s) return -1;
  fputs(s, f);
  free(s);
  return 0;
}

static int put_key(FILE *f, const char *k) {
  json_t *j = json_string(k);
  int r = j ? put_json(f, j) : -1;
  json_decref(j);
  return r;
}

/* A nested object (provenance): on one line when short, else one field per
 * line so that the command line and versions stay readable. */
static int put_object(FILE *f, json_t *o) {
  char *s = json_dumps(o, REAL_FLAGS);
  if (!s) return -1;
  size_t len = strlen(s);
  free(s);
  /* 100 columns: metric objects stay on one line, provenance (with the
   * command line) does not. */
  if (len <= 100 || !json_object_size(o)) return put_json(f, o);
  int bad = 0;
  size_t i = 0, n = json_object_size(o);
  const char *k;
  json_t *v;
  fputs("{\n", f);
  json_object_foreach(o, k, v) {
    fputs("        ", f);
    bad |= put_key(f, k);
    fputs(": ", f);
    bad |= put_json(f, v);
    fputs(++i < n ? ",\n" : "\n", f);
  }
  fputs("      }", f);
  return bad;
}

/* One record: one field per line, each value on one line, except candidates,
 * one per line.  A diff of the seed then shows exactly which tile moved. */
static int put_record(FILE *f, json_t *rec) {
  if (!json_is_object(rec) || !json_object_size(rec)) return put_json(f, rec);
  int bad = 0;
  size_t i = 0, n = json_object_size(rec);
  const char *k;
  json_t *v;
  fputs("{\n", f);
  json_object_foreach(rec, k, v) {
    fputs("      ", f);
    bad |= put_key(f, k);
    fputs(": ", f);
    if (!strcmp(k, "candidates") && json_is_array(v) && json_array_size(v)) {
      size_t j;
      json_t *c;
      fputs("[\n", f);
      json_array_foreach(v, j, c) {
        fputs("        ", f);
        bad |= put_json(f, c);
        fputs(j + 1 < json_array_size(v) ? ",\n" : "\n", f);
      }
      fputs("      ]", f);
    } else if (json_is_object(v)) {
      bad |= put_object(f, v);
    } else {
      bad |= put_json(f, v);
    }
    fputs(++i < n ? ",\n" : "\n", f);
  }
  fputs("    }", f);
  return bad ? -1 : 0;
}

/* The whole document as text, re-parsed by jansson before anyone sees it: a
 * layout bug must fail this save, not corrupt the DB for the next reader. */
static m3_status dump_doc(const char *path, json_t *root, char **text, size_t *len, m3_err *e) {
  *text = NULL;
  *len = 0;
  FILE *f = open_memstream(text, len);
  if (!f) return m3_errf(e, M3_NOMEM, "%s: cannot allocate the output buffer", path);
  int bad = 0;
  size_t i = 0, n = json_object_size(root);
  const char *k;
  json_t *v;
  fputs("{\n", f);
  json_object_foreach(root, k, v) {
    fputs("  ", f);
    bad |= put_key(f, k);
    fputs(": ", f);
    if (!strcmp(k, "records") && json_is_array(v) && json_array_size(v)) {
      size_t j;
      json_t *r;
      fputs("[\n", f);
      json_array_foreach(v, j, r) {
        fputs("    ", f);
        bad |= put_record(f, r);
        fputs(j + 1 < json_array_size(v) ? ",\n" : "\n", f);
      }
      fputs("  ]", f);
    } else {
      bad |= put_json(f, v);
    }
    fputs(++i < n ? ",\n" : "\n", f);
  }
  fputs("}\n", f);
  bad |= ferror(f) != 0;
  fclose(f);
  json_error_t je;
  json_t *check = bad ? NULL : json_loadb(*text, *len, JSON_REJECT_DUPLICATES, &je);
  if (!check) {
    free(*text);
    *text = NULL;
    return m3_errf(e, bad ? M3_NOMEM : M3_FORMAT, "%s: internal error encoding the tuning DB%s%s", path,
                   bad ? "" : ": ", bad ? "" : je.text);
  }
  json_decref(check);
  return M3_OK;
}

/* ========================================================================= */
/* Save                                                                      */
/* ========================================================================= */

/* Identity of an on-disk record, for merging and sorting.  ok = 0 for records
 * we cannot identify (malformed): they are kept verbatim, at the end. */
typedef struct disk_rec {
  json_t *j;
  const char *key, *arch;
  m3_bucket b;
  int ok;
  size_t idx;
} disk_rec;

static void identify(disk_rec *d, json_t *j, size_t idx) {
  memset(d, 0, sizeof *d);
  d->j = j;
  d->idx = idx;
  json_t *k = json_object_get(j, "key"), *a = json_object_get(j, "arch"), *b = json_object_get(j, "bucket");
  if (!json_is_string(k) || !json_is_string(a) || !json_is_string(b)) return;
  if (m3_bucket_parse(json_string_value(b), &d->b, NULL) != M3_OK) return;
  d->key = json_string_value(k);
  d->arch = json_string_value(a);
  d->ok = 1;
}

/* Sorted by key, arch, then bucket values numerically when the dimension names
 * line up (tokens=2 before tokens=16), so the file order is stable across
 * merges regardless of which tuner wrote last. */
static int cmp_disk(const void *pa, const void *pb) {
  const disk_rec *a = pa, *b = pb;
  if (a->ok != b->ok) return a->ok ? -1 : 1;
  if (a->ok) {
    int c = strcmp(a->key, b->key);
    if (!c) c = strcmp(a->arch, b->arch);
    if (c) return c;
    int aligned = a->b.ndims == b->b.ndims;
    for (int i = 0; aligned && i < a->b.ndims; i++) aligned = !strcmp(a->b.dims[i].name, b->b.dims[i].name);
    if (aligned) {
      for (int i = 0; i < a->b.ndims; i++)
        if (a->b.dims[i].value != b->b.dims[i].value) return a->b.dims[i].value < b->b.dims[i].value ? -1 : 1;
    } else {
      char sa[M3_BUCKET_STR_MAX], sb[M3_BUCKET_STR_MAX];
      m3_bucket_format(&a->b, sa, sizeof sa);
      m3_bucket_format(&b->b, sb, sizeof sb);
      if ((c = strcmp(sa, sb))) return c;
    }
  }
  return a->idx < b->idx ? -1 : a->idx > b->idx;
}

/* "<path>.corrupt.<UTC time>[.N]": never overwrite an earlier copy. */
static void corrupt_name(const char *path, char *buf, size_t n) {
  char ts[32];
  time_t t = time(NULL);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(ts, sizeof ts, "%Y%m%dT%H%M%SZ", &tm);
  snprintf(buf, n, "%s.corrupt.%s", path, ts);
  for (int i = 1; access(buf, F_OK) == 0 && i < 1000; i++) snprintf(buf, n, "%s.corrupt.%s.%d", path, ts, i);
}

/* Test hook (see tunedb.h): leave exactly what m3_write_atomic leaves when its
 * process dies between fsync and rename - a complete temp file with store.c's
 * naming, so m3_store_sweep_tmp recognises it - and die holding the lock. */
static void crash_before_rename_hook(const char *path, const char *text, size_t len) {
  const char *v = getenv(M3_TUNEDB_CRASH_ENV);
  if (!v || !*v) return;
  char tmp[4300];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld.crash", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    for (size_t off = 0; off < len;) {
      ssize_t w = write(fd, text + off, len - off);
      if (w <= 0) break;
      off += (size_t)w;
    }
    fsync(fd);
    close(fd);
  }
  raise(SIGKILL);
}

static void save_summary(m3_tunedb_report *rep, const char *path, const char *why) {
  if (rep->corrupt_copy[0])
    snprintf(rep->summary, sizeof rep->summary, "tuning DB %.600s was unreadable (%.600s); kept it as %.700s and wrote a new one",
             path, why, rep->corrupt_copy);
}

m3_status m3_tunedb_save_merge(const char *path, const m3_tunedb *db, m3_tunedb_report *rep, m3_err *e) {
  m3_tunedb_report local;
  if (!rep) rep = &local;
  memset(rep, 0, sizeof *rep);
  if (!path || !db) return m3_errf(e, M3_INVAL, "m3_tunedb_save_merge: NULL argument");
  /* Nothing measured, nothing to publish: in particular a tuner that only
   * loaded must not "touch" the file (nor judge a garbled one, whose fate is
   * decided by the next save that has something to put in its place). */
  size_t ours = 0;
  for (size_t i = 0; i < db->n; i++) ours += db->v[i].origin == ORIGIN_PUT;
  if (!ours) return M3_OK;

  char dir[4200];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash && slash != dir) {
    *slash = 0;
    M3_TRY(m3_mkdirs(dir, e));
  }

  /* Everything from the re-read to the rename happens under the lock: two
   * tuners of different kernels then each merge over the other's result
   * instead of racing read-modify-write and losing one (lost update). */
  int lock;
  M3_TRY(m3_lock(path, &lock, e));
  m3_status s;
  uint8_t *data = NULL;
  size_t len = 0;
  json_t *disk = NULL, *root = NULL, *recs = NULL;
  disk_rec *all = NULL;
  char *text = NULL;
  char why[600] = "";

  /* Re-read under the lock even though the caller may have loaded the file
   * moments ago: what matters is the state the previous lock holder left. */
  s = m3_read_file(path, &data, &len, e);
  if (s == M3_NOTFOUND) {
    s = M3_OK; /* first tuning on this machine */
  } else if (s == M3_OK) {
    int version;
    m3_err pe;
    s = parse_doc(path, data, len, &disk, &version, &pe);
    if (s == M3_FORMAT) {
      /* Garbled: we cannot merge it, but it may hold hours of measurements a
       * human can salvage, so it is copied aside before it is replaced. */
      scopy(why, sizeof why, pe.msg);
      corrupt_name(path, rep->corrupt_copy, sizeof rep->corrupt_copy);
      s = m3_write_atomic(rep->corrupt_copy, data, len, e);
      if (s != M3_OK) {
        m3_err_prefix(e, "%s is garbled and could not be copied aside (not replaced): ", path);
        rep->corrupt_copy[0] = 0;
      }
    } else if (s != M3_OK) {
      m3_errf(e, s, "%s", pe.msg);
    } else if (version > M3_TUNEDB_VERSION) {
      /* Replacing a newer file with a v1 one would silently drop whatever the
       * newer format carries; the user must use the newer m3kit or move the
       * file away, and the message says which file. */
      s = m3_errf(e, M3_UNSUPPORTED, "%s has format version %d, newer than this m3kit's %d: not overwriting it",
                  path, version, M3_TUNEDB_VERSION);
    }
  }
  free(data);
  if (s != M3_OK) goto out;

  /* The new document: our envelope, then any unknown top-level fields of the
   * old one (preserved, see top_fields), then the merged records. */
  root = json_object();
  recs = json_array();
  if (!root || !recs || json_object_set_new(root, "format", json_string(M3_TUNEDB_FORMAT)) ||
      json_object_set_new(root, "version", json_integer(M3_TUNEDB_VERSION))) {
    s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
    goto out;
  }
  size_t ndisk = disk ? json_array_size(json_object_get(disk, "records")) : 0;
  if (disk) {
    const char *k;
    json_t *v;
    json_object_foreach(disk, k, v) {
      if (strcmp(k, "format") && strcmp(k, "version") && strcmp(k, "records")) json_object_set(root, k, v);
    }
  }
  /* all[] collects borrowed references (disk records owned by `disk`, ours by
   * `recs`) only to sort them; `sorted` then takes its own references. */
  all = calloc(ndisk + ours + 1, sizeof *all);
  if (!all) {
    s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
    goto out;
  }
  size_t n = 0;
  /* On-disk records survive unless we re-measured the same identity.  They are
   * kept as raw JSON, never round-tripped through our struct: that is what
   * preserves unknown fields, stale records and malformed ones verbatim.
   * O(disk × ours) comparisons: a few hundred squared at most. */
  for (size_t i = 0; i < ndisk; i++) {
    disk_rec d;
    identify(&d, json_array_get(json_object_get(disk, "records"), i), i);
    int replaced = 0;
    for (size_t k = 0; d.ok && !replaced && k < db->n; k++)
      replaced = db->v[k].origin == ORIGIN_PUT && same_identity(&db->v[k].r, d.key, &d.b, d.arch);
    if (!replaced) all[n++] = d;
  }
  for (size_t k = 0; k < db->n; k++) {
    if (db->v[k].origin != ORIGIN_PUT) continue;
    json_t *j = record_to_json(&db->v[k].r);
    if (!j || json_array_append_new(recs, j)) { /* recs owns ours; disk owns theirs */
      s = m3_errf(e, M3_NOMEM, "%s: out of memory encoding '%s'", path, db->v[k].r.key);
      goto out;
    }
    identify(&all[n], j, ndisk + k);
    n++;
  }
  qsort(all, n, sizeof *all, cmp_disk);
  json_t *sorted = json_array();
  for (size_t i = 0; sorted && i < n; i++)
    if (json_array_append(sorted, all[i].j)) {
      json_decref(sorted);
      sorted = NULL;
    }
  if (!sorted || json_object_set_new(root, "records", sorted)) {
    s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
    goto out;
  }

  /* Encode, self-check, publish.  The lock is still held so the next writer
   * re-reads exactly this text. */
  size_t tlen;
  s = dump_doc(path, root, &text, &tlen, e);
  if (s != M3_OK) goto out;
  crash_before_rename_hook(path, text, tlen);
  s = m3_write_atomic(path, text, tlen, e);
  if (s == M3_OK) save_summary(rep, path, why);

out:
  free(text);
  free(all);
  json_decref(recs);
  json_decref(root);
  json_decref(disk);
  m3_unlock(lock);
  return s;
}

/* A record's tiles in its JSON object, completed as insert_completed does
 * (chosen: `tile`; default and candidates by f->complete_tile where they lack
 * an axis).  *changed: whether any tile changed.  Nonzero on OOM. */
static int complete_tiles_json(json_t *r, const char *key, const char *tile, const m3_tunedb_filter *f, int *changed) {
  json_t *own = json_object_get(r, "tile");
  *changed = !json_is_string(own) || strcmp(json_string_value(own), tile) != 0;
  int bad = *changed && json_object_set_new(r, "tile", json_string(tile));
  if (!f->complete_tile) return bad;
  json_t *d = json_object_get(r, "default_tile"), *ca = json_object_get(r, "candidates"), *c;
  const char *t;
  const int nf = n_fields(tile);
  if (json_is_string(d) && n_fields(json_string_value(d)) < nf &&
      (t = f->complete_tile(f->ctx, key, json_string_value(d))))
    bad |= json_object_set_new(r, "default_tile", json_string(t)), *changed = 1;
  size_t i;
  json_array_foreach(ca, i, c) {
    json_t *ct = json_object_get(c, "tile");
    if (json_is_string(ct) && n_fields(json_string_value(ct)) < nf &&
        (t = f->complete_tile(f->ctx, key, json_string_value(ct))))
      bad |= json_object_set_new(c, "tile", json_string(t)), *changed = 1;
  }
  return bad;
}

m3_status m3_tunedb_add_code_hashes(const char *path, const m3_tunedb_filter *f, m3_rehash_report *rep, m3_err *e) {
  m3_rehash_report local, cnt = {.first_malformed = -1};
  if (!rep) rep = &local;
  *rep = cnt;
  if (!path || !f || !f->template_hash || !f->code_hash || !f->code_scheme)
    return m3_errf(e, M3_INVAL, "m3_tunedb_add_code_hashes: NULL path, or a filter without hash callbacks");
  int lock;
  M3_TRY(m3_lock(path, &lock, e));
  uint8_t *data = NULL;
  size_t len = 0, tlen;
  json_t *doc = NULL;
  char *text = NULL;
  int version;
  m3_status s = m3_read_file(path, &data, &len, e);
  if (s == M3_OK) s = parse_doc(path, data, len, &doc, &version, e);
  if (s == M3_OK && version > M3_TUNEDB_VERSION)
    s = m3_errf(e, M3_UNSUPPORTED, "%s has format version %d, newer than this m3kit's %d: not touching it", path,
                version, M3_TUNEDB_VERSION);
  json_t *recs = s == M3_OK ? json_object_get(doc, "records") : NULL;
  for (size_t i = 0; s == M3_OK && i < json_array_size(recs); i++) {
    json_t *r = json_array_get(recs, i), *prov = json_object_get(r, "provenance");
    /* Malformed by the loader's own test (a missing key, a bad bucket, a field
     * of the wrong type, ...): the loader's business, kept as it is.  The
     * record's strings are borrowed from r. */
    m3_tune_record pr;
    m3_tune_candidate *pc;
    char why[300];
    int unk = 0;
    const int bad = parse_record(r, &pr, &pc, &unk, why, sizeof why) != 0;
    free(pc);
    if (bad) {
      if (cnt.first_malformed < 0) cnt.first_malformed = (int)i;
      cnt.malformed++;
      continue;
    }
    const char *key = pr.key, *tile = pr.tile, *arch = pr.arch, *th = pr.prov.template_hash, *ch = pr.prov.code_hash;
    char name[160], cur[64];
    template_name(key, name, sizeof name);
    const char *t = f->template_hash(f->ctx, name);
    snprintf(cur, sizeof cur, "%s", t ? t : ""); /* the callbacks share one buffer */
    const int tpl_current = t && !strcmp(cur, th);
    if (has_scheme(ch, f->code_scheme)) {
      if (tpl_current) {
        cnt.had++;
      } else { /* a template edit since: if it left the tile's code alone, the record's template hash moves on,
                  so that loads settle it again without rendering (is_stale) */
        const char *code = t ? f->code_hash(f->ctx, key, tile, arch) : NULL;
        char done[512];
        int keep = code && !strcmp(code, ch), changed = 0;
        if (keep) snprintf(done, sizeof done, "%s", tile);
        else keep = t && completion_keeps(f, &pr, done, sizeof done); /* a tile axis added since */
        if (keep) { /* its tiles completed where they lack an axis (its default and candidates may) */
          if (complete_tiles_json(r, key, done, f, &changed)) s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
          cnt.completed += changed;
          if (json_object_set_new(prov, "template_hash", json_string(cur)))
            s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
          cnt.refreshed++;
        } else {
          cnt.left++;
        }
      }
      continue;
    }
    const char *code = tpl_current ? f->code_hash(f->ctx, key, tile, arch) : NULL;
    if (!code) {
      cnt.left++;
      continue;
    }
    if (json_object_set_new(prov, "code_hash", json_string(code))) s = m3_errf(e, M3_NOMEM, "%s: out of memory", path);
    cnt.given++;
  }
  const int changed = cnt.given + cnt.refreshed;
  if (s == M3_OK && changed) s = dump_doc(path, doc, &text, &tlen, e);
  if (s == M3_OK && changed) s = m3_write_atomic(path, text, tlen, e);
  free(text);
  free(data);
  json_decref(doc);
  m3_unlock(lock);
  if (s == M3_OK) *rep = cnt;
  return s;
}

/* ========================================================================= */
/* Lookup                                                                    */
/* ========================================================================= */

typedef struct ranked {
  const m3_tune_record *r;
  double dist;   /* rule 1 */
  double logsum; /* rule 2 */
  const m3_bucket *shape;
} ranked;

static int cmp_ranked(const void *pa, const void *pb) {
  const ranked *a = pa, *b = pb;
  /* Distances are sums of a few log2s: compare with a tolerance so that two
   * mathematically equal distances really tie and fall to rules 2-3. */
  const double eps = 1e-9;
  if (a->dist < b->dist - eps) return -1;
  if (a->dist > b->dist + eps) return 1;
  if (a->logsum < b->logsum - eps) return -1;
  if (a->logsum > b->logsum + eps) return 1;
  for (int i = 0; i < a->shape->ndims; i++) {
    int64_t va = m3_bucket_get(&a->r->bucket, a->shape->dims[i].name);
    int64_t vb = m3_bucket_get(&b->r->bucket, a->shape->dims[i].name);
    if (va != vb) return va < vb ? -1 : 1;
  }
  return 0;
}

m3_status m3_tunedb_lookup(const m3_tunedb *db, const char *key, const char *arch, const m3_bucket *shape,
                           m3_tile_check_fn check, void *ctx, m3_tune_hit *hit, m3_err *e) {
  if (!db || !key || !arch || !shape || !hit) return m3_errf(e, M3_INVAL, "m3_tunedb_lookup: NULL argument");
  memset(hit, 0, sizeof *hit);
  char sb[M3_BUCKET_STR_MAX];
  m3_bucket_format(shape, sb, sizeof sb);
  /* Applicable = same key, same arch, same dimension names.  A record with
   * other dimensions belongs to another regime of the op (e.g. decode
   * buckets without a batch dimension) and has no meaningful distance. */
  size_t n = 0;
  for (size_t i = 0; i < db->n; i++) {
    const m3_tune_record *r = &db->v[i].r;
    n += !strcmp(r->key, key) && !strcmp(r->arch, arch) && same_dims(&r->bucket, shape, 0);
  }
  if (!n)
    return m3_errf(e, M3_NOTFOUND, "no tuning record for %s at %s on %s: using the template's default tile", key,
                   sb, arch);
  /* Rank every applicable record (not just the nearest): when the nearest
   * tile fails valid() at this shape the next-nearest one is the best
   * measured fallback, and the default tile only comes after all of them. */
  ranked *v = calloc(n, sizeof *v);
  if (!v) return m3_errf(e, M3_NOMEM, "m3_tunedb_lookup: out of memory");
  size_t k = 0;
  for (size_t i = 0; i < db->n; i++) {
    const m3_tune_record *r = &db->v[i].r;
    if (strcmp(r->key, key) || strcmp(r->arch, arch) || !same_dims(&r->bucket, shape, 0)) continue;
    ranked *x = &v[k++];
    x->r = r;
    x->shape = shape;
    for (int d = 0; d < shape->ndims; d++) {
      int64_t bv = m3_bucket_get(&r->bucket, shape->dims[d].name), sv = shape->dims[d].value;
      x->dist += fabs(lg(sv) - lg(bv));
      x->logsum += lg(bv);
    }
  }
  qsort(v, n, sizeof *v, cmp_ranked);
  m3_status s = M3_NOTFOUND;
  for (size_t i = 0; i < n; i++) {
    char reason[sizeof hit->reject_reason] = "";
    if (check && !check(ctx, v[i].r->tile, reason, sizeof reason)) {
      /* Fault 33: the nearest tuned tile does not fit this shape.  Try the
       * next-nearest record's winner; never launch an invalid tile. */
      if (!hit->rejected++) {
        char rb[M3_BUCKET_STR_MAX];
        m3_bucket_format(&v[i].r->bucket, rb, sizeof rb);
        snprintf(hit->reject_reason, sizeof hit->reject_reason, "tile %.60s (tuned at %.60s): %.110s", v[i].r->tile, rb,
                 reason[0] ? reason : "rejected by valid()");
      }
      continue;
    }
    hit->rec = v[i].r;
    hit->tile = v[i].r->tile;
    hit->distance = v[i].dist;
    hit->exact = v[i].dist == 0.0;
    hit->checked = check != NULL;
    s = M3_OK;
    break;
  }
  free(v);
  if (s != M3_OK)
    return m3_errf(e, M3_NOTFOUND, "%d tuned tiles for %s on %s are invalid at %s (first: %s): using the default tile",
                   hit->rejected, key, arch, sb, hit->reject_reason);
  return M3_OK;
}

/* ========================================================================= */
/* Table and plots                                                           */
/* ========================================================================= */

static const char *origin_name(int o) { return o == ORIGIN_SEED ? "seed" : o == ORIGIN_FILE ? "file" : "new"; }

static void fmt_us(char *b, size_t n, double v) {
  if (isfinite(v))
    snprintf(b, n, "%.2f", v);
  else
    snprintf(b, n, "-");
}

/* Records come grouped by key and arch (the file's order, cmp_disk), so each
 * group opens with its key on a line of its own and its rows are indented
 * below it: a key is 60-150 characters, and a key column padded to the
 * longest one made every row 330 wide.  The key stays whole, since it is what
 * the user copies into the next command.  The tiles (up to 70 characters)
 * come last, unpadded, the default only where the tuned tile differs. */
void m3_tunedb_print(const m3_tunedb *db, FILE *out) {
  if (!db || !out) return;
  int wb = 6;
  for (size_t i = 0; i < db->n; i++) {
    char b[M3_BUCKET_STR_MAX];
    int l = m3_bucket_format(&db->v[i].r.bucket, b, sizeof b);
    if (l > wb) wb = l;
  }
  fprintf(out, "src: file = this DB, seed = the seed DB under it, new = added in this process; untimed = a tile pinned\n"
               "without being a timed candidate (a lead-in: tools/seed_pin.py --untimed), shown with the times of the\n"
               "candidate it replaced, which has the same kernel body.  gpu: the card that timed the record.\n");
  fprintf(out, "key (arch)\n  %-*s  %10s  %10s  %7s  %-28s  %-9s  %-20s  %-6s  %s\n", wb, "bucket", "default_us", "tuned_us",
          "speedup", "metric", "pass/all", "src", "gpu", "tile (default)");
  for (size_t i = 0; i < db->n; i++) {
    const m3_tune_record *r = &db->v[i].r;
    const m3_tune_record *p = i ? &db->v[i - 1].r : NULL;
    if (!p || strcmp(p->key, r->key) || strcmp(p->arch, r->arch)) fprintf(out, "%s (%s)\n", r->key, r->arch);
    char b[M3_BUCKET_STR_MAX], du[32], tu[32], sp[32], met[64], pc[32];
    m3_bucket_format(&r->bucket, b, sizeof b);
    /* A tile pinned without being timed (tools/seed_pin.py --untimed: a
     * lead-in, the same body as the candidate it replaced) keeps that
     * candidate's times; src says so. */
    int untimed = r->pinned && r->n_candidates > 0;
    for (size_t c = 0; untimed && c < r->n_candidates; c++)
      if (r->candidates[c].tile && !strcmp(r->candidates[c].tile, r->tile)) untimed = 0;
    fmt_us(du, sizeof du, r->default_us);
    fmt_us(tu, sizeof tu, r->tuned_us);
    if (isfinite(r->default_us) && isfinite(r->tuned_us) && r->tuned_us > 0)
      snprintf(sp, sizeof sp, "%.2fx", r->default_us / r->tuned_us);
    else
      snprintf(sp, sizeof sp, "-");
    if (r->metric.unit && isfinite(r->metric.achieved))
      snprintf(met, sizeof met, "%.1f %s (%.0f%% of %.0f)", r->metric.achieved, r->metric.unit,
               r->metric.pct_of_ceiling, r->metric.ceiling);
    else
      snprintf(met, sizeof met, "-");
    size_t passed = 0;
    for (size_t c = 0; c < r->n_candidates; c++) passed += r->candidates[c].disposition == M3_DISP_PASSED;
    snprintf(pc, sizeof pc, "%zu/%zu", passed, r->n_candidates);
    char src[32];
    snprintf(src, sizeof src, "%s%s", origin_name(db->v[i].origin),
             untimed ? ",pinned,untimed" : r->pinned ? ",pinned" : "");
    const int same = r->default_tile && !strcmp(r->default_tile, r->tile);
    /* the model only: "NVIDIA H100 80GB HBM3" -> "H100" */
    const char *gpu = r->prov.gpu ? r->prov.gpu : "?";
    if (!strncmp(gpu, "NVIDIA ", 7)) gpu += 7;
    if (!strncmp(gpu, "GeForce ", 8)) gpu += 8;
    const int gl = (int)strcspn(gpu, " ");
    fprintf(out, "  %-*s  %10s  %10s  %7s  %-28s  %-9s  %-20s  %-6.*s  %s%s%s%s\n", wb, b, du, tu, sp, met, pc, src, gl, gpu,
            r->tile,
            same ? " (= default)" : " (", same ? "" : r->default_tile ? r->default_tile : "no default",
            same ? "" : ")");
  }
  fprintf(out, "%zu records\n", db->n);
  /* Why a pinned record's tile is not the tuner's pick (cache/tunedb.h): each
   * reason once (one A/B usually pins a whole family), then its records. */
  for (size_t i = 0; i < db->n; i++) {
    const char *why = db->v[i].r.pinned;
    int first = 1;
    for (size_t j = 0; why && j < i && first; j++)
      if (db->v[j].r.pinned && !strcmp(db->v[j].r.pinned, why)) first = 0;
    if (!why || !first) continue;
    fprintf(out, "pinned: %s\n", why);
    for (size_t j = i; j < db->n; j++) {
      const m3_tune_record *r = &db->v[j].r;
      if (!r->pinned || strcmp(r->pinned, why)) continue;
      char b[M3_BUCKET_STR_MAX];
      m3_bucket_format(&r->bucket, b, sizeof b);
      fprintf(out, "  %s %s [%s]\n", r->key, b, r->tile);
    }
  }
}

void m3_tunedb_print_record(const m3_tune_record *r, FILE *out) {
  if (!r || !out) return;
  char b[M3_BUCKET_STR_MAX];
  m3_bucket_format(&r->bucket, b, sizeof b);
  fprintf(out, "%s  %s  %s\n  chosen %s, default %s; gpu %s (%d SMs), driver %s, nvrtc %s, template %s, code %s, %s\n",
          r->key, b, r->arch, r->tile, r->default_tile ? r->default_tile : "-", r->prov.gpu ? r->prov.gpu : "?",
          r->prov.sm_count, r->prov.driver_version ? r->prov.driver_version : "?",
          r->prov.nvrtc_version ? r->prov.nvrtc_version : "?", r->prov.template_hash,
          r->prov.code_hash ? r->prov.code_hash : "-", r->prov.date ? r->prov.date : "?");
  if (r->prov.command) fprintf(out, "  command: %s\n", r->prov.command);
  if (r->pinned) fprintf(out, "  pinned: %s\n", r->pinned);
  for (size_t i = 0; i < r->n_candidates; i++) {
    const m3_tune_candidate *c = &r->candidates[i];
    char m[32], lo[32], hi[32];
    fmt_us(m, sizeof m, c->median_us);
    fmt_us(lo, sizeof lo, c->p20_us);
    fmt_us(hi, sizeof hi, c->p80_us);
    const char *mark = !strcmp(c->tile, r->tile) ? "*" : (r->default_tile && !strcmp(c->tile, r->default_tile)) ? "d" : " ";
    fprintf(out, "  %s%3zu  %-28s %-15s %10s us  [p20 %s, p80 %s]  n=%d%s%s\n", mark, i, c->tile,
            m3_disposition_name(c->disposition), m, lo, hi, c->n_runs, c->reason ? "  " : "",
            c->reason ? c->reason : "");
  }
}

/* gnuplot single-quoted string: only ' needs escaping (as ''). */
static void gp_quote(FILE *f, const char *s) {
  fputc('\'', f);
  for (; *s; s++) {
    if (*s == '\'') fputc('\'', f);
    fputc(*s, f);
  }
  fputc('\'', f);
}

/* FNV-1a: only to make plot file names unique, not a content hash. */
static uint32_t fnv1a(const char *s, uint32_t h) {
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
  return h;
}

static void plot_name(const m3_tune_record *r, char *buf, size_t n) {
  char b[M3_BUCKET_STR_MAX];
  m3_bucket_format(&r->bucket, b, sizeof b);
  uint32_t h = fnv1a(r->arch, fnv1a("|", fnv1a(b, fnv1a("|", fnv1a(r->key, 2166136261u)))));
  char raw[400];
  snprintf(raw, sizeof raw, "%.120s__%s", r->key, b);
  size_t u = 0;
  for (const char *p = raw; *p && u + 1 < n; p++) {
    char c = *p;
    buf[u++] = ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) ? c
               : c == '='                                                                    ? '-'
                                                                                             : '_';
  }
  buf[u] = 0;
  snprintf(buf + u, n - u, "__%s_%08x", r->arch, h);
}

static m3_status close_checked(FILE *f, const char *p, m3_err *e) {
  int bad = ferror(f);
  if (fclose(f) != 0 || bad) return m3_errf(e, M3_IO, "%s: write failed: %s", p, strerror(errno));
  return M3_OK;
}

/* One plot per record rather than one per kernel: candidates differ per
 * bucket (valid() prunes differently at each shape), so a shared x axis of
 * tiles would be mostly gaps.  The .dat keeps every candidate, measured or
 * not, so the index column matches the record's candidate order. */
m3_status m3_tunedb_write_plot_data(const m3_tunedb *db, const char *dir, const char *key_substr, int *n_plots,
                                    m3_err *e) {
  if (n_plots) *n_plots = 0;
  if (!db || !dir) return m3_errf(e, M3_INVAL, "m3_tunedb_write_plot_data: NULL argument");
  M3_TRY(m3_mkdirs(dir, e));
  /* Absolute paths in the scripts: the CLI may run gnuplot from anywhere. */
  char abs[PATH_MAX], p[PATH_MAX + 600];
  if (!realpath(dir, abs)) return m3_errf(e, M3_IO, "%s: %s", dir, strerror(errno));
  snprintf(p, sizeof p, "%s/all.gp", abs);
  FILE *all = fopen(p, "w");
  if (!all) return m3_errf(e, M3_IO, "%s: %s", p, strerror(errno));
  fprintf(all, "# m3kit tuning plots: run with gnuplot; each script writes one PNG\n");
  int count = 0;
  m3_status s = M3_OK;
  for (size_t i = 0; s == M3_OK && i < db->n; i++) {
    const m3_tune_record *r = &db->v[i].r;
    if (key_substr && !strstr(r->key, key_substr)) continue;
    char name[400], b[M3_BUCKET_STR_MAX];
    plot_name(r, name, sizeof name);
    m3_bucket_format(&r->bucket, b, sizeof b);

    snprintf(p, sizeof p, "%s/%s.dat", abs, name);
    FILE *f = fopen(p, "w");
    if (!f) {
      s = m3_errf(e, M3_IO, "%s: %s", p, strerror(errno));
      break;
    }
    fprintf(f, "# m3kit tuning candidates: %s %s %s\n# chosen %s, default %s\n", r->key, b, r->arch, r->tile,
            r->default_tile ? r->default_tile : "-");
    fprintf(f, "# idx tile median_us p20_us p80_us n_runs disposition   ('-' = not measured)\n");
    for (size_t c = 0; c < r->n_candidates; c++) {
      const m3_tune_candidate *x = &r->candidates[c];
      char m[32], lo[32], hi[32];
      /* Full precision here: the table rounds, the data file should not. */
      snprintf(m, sizeof m, isfinite(x->median_us) ? "%.6g" : "-", x->median_us);
      snprintf(lo, sizeof lo, isfinite(x->p20_us) ? "%.6g" : "-", x->p20_us);
      snprintf(hi, sizeof hi, isfinite(x->p80_us) ? "%.6g" : "-", x->p80_us);
      fprintf(f, "%zu %s %s %s %s %d %s\n", c, x->tile, m, lo, hi, x->n_runs, m3_disposition_name(x->disposition));
    }
    if ((s = close_checked(f, p, e)) != M3_OK) break;

    snprintf(p, sizeof p, "%s/%s.gp", abs, name);
    f = fopen(p, "w");
    if (!f) {
      s = m3_errf(e, M3_IO, "%s: %s", p, strerror(errno));
      break;
    }
    char path2[PATH_MAX + 600];
    fprintf(f, "# gnuplot script written by m3kit (m3_tunedb_write_plot_data)\n");
    fprintf(f, "set terminal png size 1280,720 noenhanced\nset output ");
    snprintf(path2, sizeof path2, "%s/%s.png", abs, name);
    gp_quote(f, path2);
    fprintf(f, "\nset title ");
    char title[1200];
    snprintf(title, sizeof title, "%s  %s  %s  (chosen %s)", r->key, b, r->arch, r->tile);
    gp_quote(f, title);
    fprintf(f, " noenhanced\nset datafile missing '-'\nset ylabel 'time (us): median, p20..p80'\n"
               "set xtics rotate by -60 noenhanced font ',8'\nset xrange [-1:%zu]\nset yrange [0:*]\n"
               "set offsets 0, 0, graph 0.08, 0\nset grid ytics\nset key top left\nset bmargin 10\n",
            r->n_candidates);
    fprintf(f, "plot ");
    snprintf(path2, sizeof path2, "%s/%s.dat", abs, name);
    gp_quote(f, path2);
    fprintf(f, " using 1:3:4:5:xticlabels(2) with yerrorbars pointtype 7 title 'candidate'");
    if (isfinite(r->default_us)) fprintf(f, ", \\\n     %.6g with lines dashtype 2 title 'default tile'", r->default_us);
    if (isfinite(r->tuned_us)) fprintf(f, ", \\\n     %.6g with lines title 'chosen tile'", r->tuned_us);
    fprintf(f, "\nunset output\n");
    if ((s = close_checked(f, p, e)) != M3_OK) break;
    fprintf(all, "load ");
    gp_quote(all, p);
    fprintf(all, "\n");
    count++;
  }
  snprintf(p, sizeof p, "%s/all.gp", abs);
  m3_status s2 = close_checked(all, p, e);
  if (s == M3_OK) s = s2;
  if (n_plots) *n_plots = count;
  return s;
}
