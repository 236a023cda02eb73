/* check_tunedb.c - the tuning DB's contracts (cache/tunedb.h): lossless round
 * trips, merges that survive concurrent tuners and killed writers, clear
 * M3_FORMAT errors for damaged files (and a kept .corrupt copy), stale-record
 * rejection with one summary line, soft unknown fields, refusal of newer
 * versions, and the nearest-bucket lookup rules including the fault-33
 * contract (a tuned tile that fails valid() at the actual shape is never
 * returned).  No GPU: every test runs on plain files in mkdtemp directories.
 */
#include <check.h>
#include <dirent.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache/store.h"
#include "cache/tunedb.h"
#include "runtime/bench.h"
#include "autotune/tune.h"
#include "m3config.h"
#include "runtime/tuning_lookup.h"

/* ------------------------------------------------------------------------- */
/* helpers                                                                   */
/* ------------------------------------------------------------------------- */

static char *tmpdir(void) {
  const char *base = getenv("TMPDIR");
  char tmpl[512];
  snprintf(tmpl, sizeof tmpl, "%s/m3tunedb.XXXXXX", base && *base ? base : "/tmp");
  char *d = mkdtemp(tmpl);
  ck_assert_msg(d != NULL, "mkdtemp failed");
  return strdup(d);
}

static int rm_one(const char *p, const struct stat *st, int type, struct FTW *ftw) {
  (void)st, (void)type, (void)ftw;
  return remove(p);
}

/* Called at the end of a passing test; a failing one leaves its files for
 * inspection (the assertion message names them). */
static void rm_tree(char *dir) {
  nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  free(dir);
}

static void write_text(const char *path, const char *text, size_t len) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fwrite(text, 1, len, f), len);
  fclose(f);
}

static char *read_text(const char *path, size_t *len) {
  uint8_t *d;
  size_t n;
  m3_err e;
  ck_assert_msg(m3_read_file(path, &d, &n, &e) == M3_OK, "%s", e.msg);
  if (len) *len = n;
  return (char *)d;
}

/* Count entries of dir whose names contain `part`; the first one into first. */
static int count_named(const char *dir, const char *part, char *first, size_t n) {
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  int c = 0;
  struct dirent *de;
  while ((de = readdir(d)))
    if (strstr(de->d_name, part)) {
      if (!c && first) snprintf(first, n, "%s/%s", dir, de->d_name);
      c++;
    }
  closedir(d);
  return c;
}

static m3_bucket B(const char *s) {
  m3_bucket b;
  m3_err e;
  ck_assert_msg(m3_bucket_parse(s, &b, &e) == M3_OK, "%s", e.msg);
  return b;
}

/* A complete record with three candidates of different dispositions. */
typedef struct recbuf {
  m3_tune_record r;
  m3_tune_candidate c[3];
} recbuf;

static void fill(recbuf *b, const char *key, const char *bucket, const char *tile) {
  b->r = m3_tune_record_empty();
  b->r.key = key;
  b->r.bucket = B(bucket);
  b->r.arch = "sm_90";
  b->r.tile = tile;
  b->r.default_tile = "warps=4,tok=1";
  b->r.default_us = 20.5;
  b->r.tuned_us = 12.25;
  b->r.prov = (m3_tune_provenance){.gpu = "NVIDIA H200",
                                   .sm_count = 132,
                                   .driver_version = "550.54.15",
                                   .nvrtc_version = "12.4",
                                   .cublas_version = "12.4.5",
                                   .template_hash = "abc123",
                                   .m3kit_version = "0.1.0",
                                   .date = "2025-01-31T12:34:56Z",
                                   .command = "m3kit tune --op qknorm_rope \"--shape=tokens=1\"",
                                   .code_hash = "0123456789abcdef"};
  b->r.metric = (m3_tune_metric){.unit = "GB/s", .achieved = 3210.5, .ceiling = 4020, .pct_of_ceiling = 79.86};
  b->c[0] = (m3_tune_candidate){.tile = tile, .disposition = M3_DISP_PASSED, .median_us = 12.25,
                                .p20_us = 12.125, .p80_us = 12.5, .n_runs = 50};
  b->c[1] = (m3_tune_candidate){.tile = "warps=8,tok=1", .disposition = M3_DISP_INCORRECT,
                                .reason = "NMSE 3.2e-02 > 1e-05 at row 17", .median_us = NAN, .p20_us = NAN,
                                .p80_us = NAN};
  b->c[2] = (m3_tune_candidate){.tile = "warps=16,tok=4", .disposition = M3_DISP_SKIPPED_SLOWER,
                                .reason = "p20 31.0 us > 1.5 x best", .median_us = 31.75, .p20_us = 31,
                                .p80_us = 33.5, .n_runs = 3};
  b->r.candidates = b->c;
  b->r.n_candidates = 3;
}

static void put_ok(m3_tunedb *db, const m3_tune_record *r) {
  m3_err e;
  ck_assert_msg(m3_tunedb_put(db, r, &e) == M3_OK, "%s", e.msg);
}

static void put_simple(m3_tunedb *db, const char *key, const char *bucket, const char *tile) {
  recbuf b;
  fill(&b, key, bucket, tile);
  put_ok(db, &b.r);
}

static void save_ok(const char *path, const m3_tunedb *db) {
  m3_err e;
  ck_assert_msg(m3_tunedb_save_merge(path, db, NULL, &e) == M3_OK, "%s", e.msg);
}

static m3_tunedb *load_ok(const char *path, const m3_tunedb_filter *f, m3_tunedb_report *rep) {
  m3_tunedb *db = m3_tunedb_new();
  m3_err e;
  ck_assert_msg(m3_tunedb_load(db, path, NULL, f, rep, &e) == M3_OK, "%s", e.msg);
  return db;
}

static int str_same(const char *a, const char *b) { return (!a && !b) || (a && b && !strcmp(a, b)); }
static int num_same(double a, double b) { return (isnan(a) && isnan(b)) || a == b; }

static void assert_same_record(const m3_tune_record *a, const m3_tune_record *b) {
  ck_assert(str_same(a->key, b->key));
  ck_assert(m3_bucket_equal(&a->bucket, &b->bucket));
  ck_assert(str_same(a->arch, b->arch));
  ck_assert(str_same(a->tile, b->tile));
  ck_assert(str_same(a->pinned, b->pinned));
  ck_assert(str_same(a->default_tile, b->default_tile));
  ck_assert(num_same(a->default_us, b->default_us));
  ck_assert(num_same(a->tuned_us, b->tuned_us));
  ck_assert(str_same(a->prov.gpu, b->prov.gpu));
  ck_assert_int_eq(a->prov.sm_count, b->prov.sm_count);
  ck_assert(str_same(a->prov.driver_version, b->prov.driver_version));
  ck_assert(str_same(a->prov.nvrtc_version, b->prov.nvrtc_version));
  ck_assert(str_same(a->prov.cublas_version, b->prov.cublas_version));
  ck_assert(str_same(a->prov.template_hash, b->prov.template_hash));
  ck_assert(str_same(a->prov.m3kit_version, b->prov.m3kit_version));
  ck_assert(str_same(a->prov.date, b->prov.date));
  ck_assert(str_same(a->prov.command, b->prov.command));
  ck_assert(str_same(a->prov.code_hash, b->prov.code_hash));
  ck_assert(str_same(a->metric.unit, b->metric.unit));
  ck_assert(num_same(a->metric.achieved, b->metric.achieved));
  ck_assert(num_same(a->metric.ceiling, b->metric.ceiling));
  ck_assert(num_same(a->metric.pct_of_ceiling, b->metric.pct_of_ceiling));
  ck_assert_uint_eq(a->n_candidates, b->n_candidates);
  for (size_t i = 0; i < a->n_candidates; i++) {
    const m3_tune_candidate *x = &a->candidates[i], *y = &b->candidates[i];
    ck_assert(str_same(x->tile, y->tile));
    ck_assert_int_eq(x->disposition, y->disposition);
    ck_assert(str_same(x->reason, y->reason));
    ck_assert(num_same(x->median_us, y->median_us));
    ck_assert(num_same(x->p20_us, y->p20_us));
    ck_assert(num_same(x->p80_us, y->p80_us));
    ck_assert_int_eq(x->n_runs, y->n_runs);
  }
}

/* The template hashes of "this build". */
static const char *hash_of(void *ctx, const char *name) {
  (void)ctx;
  if (!strcmp(name, "qknorm_rope")) return "abc123";
  if (!strcmp(name, "index_topk")) return "def456";
  return NULL;
}

/* A one-record DB file in the v1 format, written by hand (test data). */
#define REC(key, bucket, arch, tile, drv, hash)                                                         \
  "{\"key\": \"" key "\", \"bucket\": \"" bucket "\", \"arch\": \"" arch "\", \"tile\": \"" tile      \
  "\", \"provenance\": {\"driver_version\": \"" drv "\", \"template_hash\": \"" hash "\"}}"
#define DOC(version, ...) "{\"format\": \"m3kit-tunedb\", \"version\": " #version ", \"records\": [" __VA_ARGS__ "]}\n"

/* ------------------------------------------------------------------------- */
/* buckets and records                                                       */
/* ------------------------------------------------------------------------- */

START_TEST(bucket_text) {
  const char *good[] = {"tokens=1,ctx=131072", "tokens=0", "", "a=1,b=2,c=3,d_4=4", "batch=9223372036854775"};
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    m3_bucket b = B(good[i]);
    char out[M3_BUCKET_STR_MAX];
    m3_bucket_format(&b, out, sizeof out);
    ck_assert_str_eq(out, good[i]); /* parse then print is the identity */
  }
  const char *bad[] = {"tokens=01", "tokens=+1", "tokens=-1", "tokens", "tokens=1,", "Tokens=1",
                       "tokens=1,tokens=2", "a=1,b=2,c=3,d=4,e=5", "tokens = 1", "t=1x", "=3",
                       "averyveryverylongname=1"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    m3_bucket b;
    m3_err e;
    ck_assert_msg(m3_bucket_parse(bad[i], &b, &e) == M3_FORMAT, "'%s' accepted", bad[i]);
    ck_assert_ptr_nonnull(strstr(e.msg, "bucket"));
  }
  m3_bucket x = B("tokens=1,ctx=4096"), y = B("ctx=4096,tokens=1"), z = B("tokens=1,ctx=4097");
  ck_assert(m3_bucket_equal(&x, &y));
  ck_assert(!m3_bucket_equal(&x, &z));
  ck_assert_int_eq(m3_bucket_get(&x, "ctx"), 4096);
  ck_assert_int_eq(m3_bucket_get(&x, "batch"), -1);
  m3_bucket w = {0};
  m3_err e;
  ck_assert_int_eq(m3_bucket_add(&w, "tokens", 4, &e), M3_OK);
  ck_assert_int_eq(m3_bucket_add(&w, "tokens", 5, &e), M3_INVAL);
  ck_assert_int_eq(m3_bucket_add(&w, "ctx", -1, &e), M3_INVAL);
  ck_assert_int_eq(m3_bucket_add(&w, "b", 1, &e), M3_OK);
  ck_assert_int_eq(m3_bucket_add(&w, "c", 1, &e), M3_OK);
  ck_assert_int_eq(m3_bucket_add(&w, "d", 1, &e), M3_OK);
  ck_assert_int_eq(m3_bucket_add(&w, "e", 1, &e), M3_RANGE);
  m3_disposition d;
  for (int i = 0; i < M3_DISP_COUNT; i++) {
    ck_assert_int_eq(m3_disposition_parse(m3_disposition_name((m3_disposition)i), &d, &e), M3_OK);
    ck_assert_int_eq(d, i);
  }
  ck_assert_int_eq(m3_disposition_parse("FAST", &d, &e), M3_FORMAT);
}
END_TEST

START_TEST(put_replaces_and_validates) {
  m3_tunedb *db = m3_tunedb_new();
  recbuf b;
  m3_err e;
  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1,ctx=4096", "warps=4,tok=2");
  put_ok(db, &b.r);
  /* Same identity, dimensions spelled in another order: a replacement. */
  fill(&b, "qknorm_rope(attn=sparse)", "ctx=4096,tokens=1", "warps=2,tok=2");
  b.c[0].tile = "warps=2,tok=2";
  put_ok(db, &b.r);
  ck_assert_uint_eq(m3_tunedb_count(db), 1);
  ck_assert_str_eq(m3_tunedb_get(db, 0)->tile, "warps=2,tok=2");
  /* Another arch is another record. */
  b.r.arch = "sm_100";
  put_ok(db, &b.r);
  ck_assert_uint_eq(m3_tunedb_count(db), 2);

  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1", "warps=4,tok=2");
  b.r.tile = NULL;
  ck_assert_int_eq(m3_tunedb_put(db, &b.r, &e), M3_INVAL);
  ck_assert_ptr_nonnull(strstr(e.msg, "'tile'"));
  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1", "warps=4,tok=2");
  b.r.prov.template_hash = NULL;
  ck_assert_int_eq(m3_tunedb_put(db, &b.r, &e), M3_INVAL);
  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1", "warps=4,tok=2");
  b.r.arch = "../etc";
  ck_assert_int_eq(m3_tunedb_put(db, &b.r, &e), M3_INVAL);
  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1", "warps=4,tok=2");
  b.r.tile = "warps=4, tok=2"; /* whitespace would break the .dat columns */
  ck_assert_int_eq(m3_tunedb_put(db, &b.r, &e), M3_INVAL);
  /* Fault 32: the winner may never be a candidate that failed verification. */
  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1", "warps=8,tok=1");
  b.c[0].tile = "warps=2,tok=2"; /* warps=8,tok=1 is listed only as INCORRECT */
  ck_assert_int_eq(m3_tunedb_put(db, &b.r, &e), M3_INVAL);
  ck_assert_ptr_nonnull(strstr(e.msg, "did not PASS"));
  fill(&b, "qknorm_rope(attn=sparse)", "tokens=1", "warps=8,tok=1");
  ck_assert_int_eq(m3_tunedb_put(db, &b.r, &e), M3_INVAL); /* PASSED once, INCORRECT once */
  ck_assert_uint_eq(m3_tunedb_count(db), 2);
  m3_tunedb_free(db);
}
END_TEST

START_TEST(path_under_cache_root) {
  setenv("M3KIT_CACHE_DIR", "/x/cache", 1);
  char p[512];
  m3_err e;
  ck_assert_int_eq(m3_tunedb_path("sm_90", p, sizeof p, &e), M3_OK);
  ck_assert_str_eq(p, "/x/cache/tuning/sm_90.json");
  ck_assert_int_eq(m3_tunedb_path("../sm_90", p, sizeof p, &e), M3_INVAL);
  ck_assert_int_eq(m3_tunedb_path("sm_90", p, 8, &e), M3_RANGE);
}
END_TEST

/* ------------------------------------------------------------------------- */
/* round trip                                                                */
/* ------------------------------------------------------------------------- */

START_TEST(round_trip) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/tuning/sm_90.json", dir); /* parent created by save */
  m3_tunedb *db = m3_tunedb_new();
  recbuf a, b, c;
  fill(&a, "qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3)", "tokens=1,ctx=131072", "warps=4,tok=2");
  fill(&b, "qknorm_rope(attn=dense,insert=0,kv=bf16,idxk=bf16)", "tokens=4096,ctx=4096", "warps=8,tok=1");
  b.c[1].tile = "warps=2,tok=8";
  b.c[0].tile = "warps=8,tok=1";
  b.r.pinned = "a decode-step A/B chose it (\"quoted\", non-ASCII \u00b5s)"; /* tools/seed_pin.py */
  /* Sparse optional data: NULL strings and NaN numbers must come back so. */
  fill(&c, "index_topk(k=16)", "", "threads=256");
  c.r.default_tile = NULL;
  c.r.default_us = NAN;
  c.r.prov = (m3_tune_provenance){.template_hash = "def456"};
  c.r.metric = (m3_tune_metric){.achieved = NAN, .ceiling = NAN, .pct_of_ceiling = NAN};
  c.r.n_candidates = 0;
  c.r.candidates = NULL;
  put_ok(db, &a.r);
  put_ok(db, &b.r);
  put_ok(db, &c.r);
  save_ok(path, db);

  m3_tunedb_report rep;
  m3_tunedb *back = load_ok(path, NULL, &rep);
  ck_assert_int_eq(rep.loaded, 3);
  ck_assert_str_eq(rep.summary, ""); /* nothing to complain about */
  ck_assert_uint_eq(m3_tunedb_count(back), 3);
  const recbuf *src[] = {&a, &b, &c};
  for (int i = 0; i < 3; i++) {
    const m3_tune_record *r = m3_tunedb_find(back, src[i]->r.key, &src[i]->r.bucket, "sm_90");
    ck_assert_ptr_nonnull(r);
    assert_same_record(&src[i]->r, r);
  }
  /* Human-readable: the envelope first, one field per line. */
  size_t len;
  char *text = read_text(path, &len);
  ck_assert_msg(!strncmp(text, "{\n  \"format\": \"m3kit-tunedb\",\n  \"version\": 1,\n", 45), "%.80s", text);
  ck_assert_ptr_nonnull(strstr(text, "\n        {\"tile\": \"warps=8,tok=1\", \"disposition\": \"INCORRECT\""));
  /* Deterministic: saving the same records again gives the same bytes. */
  save_ok(path, db);
  size_t len2;
  char *text2 = read_text(path, &len2);
  ck_assert_uint_eq(len, len2);
  ck_assert(!memcmp(text, text2, len));
  free(text);
  free(text2);
  m3_tunedb_free(back);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* A loaded (not put) record is never re-written: the other tuner's newer
 * result for the same identity survives our save. */
START_TEST(loaded_records_do_not_clobber) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  m3_tunedb *w = m3_tunedb_new();
  put_simple(w, "qknorm_rope(x=1)", "tokens=1", "warps=1,tok=1");
  save_ok(path, w);
  m3_tunedb *mine = load_ok(path, NULL, NULL); /* holds v1 of x=1 */
  m3_tunedb_free(w);
  w = m3_tunedb_new();
  put_simple(w, "qknorm_rope(x=1)", "tokens=1", "warps=2,tok=1"); /* another tuner: v2 */
  save_ok(path, w);
  put_simple(mine, "qknorm_rope(x=2)", "tokens=1", "warps=4,tok=1");
  save_ok(path, mine);
  m3_tunedb *back = load_ok(path, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(back), 2);
  m3_bucket t1 = B("tokens=1");
  ck_assert_str_eq(m3_tunedb_find(back, "qknorm_rope(x=1)", &t1, "sm_90")->tile, "warps=2,tok=1");
  m3_tunedb_free(back);
  m3_tunedb_free(mine);
  m3_tunedb_free(w);
  rm_tree(dir);
}
END_TEST

/* ------------------------------------------------------------------------- */
/* concurrency and crashes                                                   */
/* ------------------------------------------------------------------------- */

enum { WRITERS = 8, ITERS = 12 };

START_TEST(concurrent_writers) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/tuning/sm_90.json", dir);
  pid_t pid[WRITERS];
  for (int w = 0; w < WRITERS; w++) {
    pid[w] = fork();
    ck_assert_int_ge(pid[w], 0);
    if (pid[w] == 0) {
      /* Child: its own kernel, a growing set of buckets, and one record that
       * it re-tunes every round (must end at the last round's tile). */
      m3_tunedb *db = m3_tunedb_new();
      char key[64], tile[64], bucket[64], latest[64];
      snprintf(key, sizeof key, "qknorm_rope(writer=%d)", w);
      for (int i = 0; i < ITERS; i++) {
        recbuf b;
        snprintf(bucket, sizeof bucket, "tokens=%d", 1 << i);
        snprintf(tile, sizeof tile, "writer=%d,round=%d", w, i);
        fill(&b, key, bucket, tile);
        m3_err e;
        if (m3_tunedb_put(db, &b.r, &e) != M3_OK) _exit(1);
        snprintf(latest, sizeof latest, "warps=99,tok=%d", i);
        fill(&b, key, "tokens=0,ctx=1", latest);
        if (m3_tunedb_put(db, &b.r, &e) != M3_OK) _exit(2);
        if (m3_tunedb_save_merge(path, db, NULL, &e) != M3_OK) {
          fprintf(stderr, "writer %d: %s\n", w, e.msg);
          _exit(3);
        }
      }
      m3_tunedb_free(db);
      _exit(0);
    }
  }
  for (int w = 0; w < WRITERS; w++) {
    int st;
    ck_assert_int_eq(waitpid(pid[w], &st, 0), pid[w]);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "writer %d failed (status %d)", w, st);
  }
  m3_tunedb_report rep;
  m3_tunedb *db = load_ok(path, NULL, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), WRITERS * (ITERS + 1));
  for (int w = 0; w < WRITERS; w++) {
    char key[64], tile[64], bucket[64];
    snprintf(key, sizeof key, "qknorm_rope(writer=%d)", w);
    for (int i = 0; i < ITERS; i++) {
      snprintf(bucket, sizeof bucket, "tokens=%d", 1 << i);
      snprintf(tile, sizeof tile, "writer=%d,round=%d", w, i);
      m3_bucket b = B(bucket);
      const m3_tune_record *r = m3_tunedb_find(db, key, &b, "sm_90");
      ck_assert_msg(r != NULL, "lost %s %s", key, bucket);
      ck_assert_str_eq(r->tile, tile);
    }
    m3_bucket lb = B("tokens=0,ctx=1");
    snprintf(tile, sizeof tile, "warps=99,tok=%d", ITERS - 1);
    ck_assert_str_eq(m3_tunedb_find(db, key, &lb, "sm_90")->tile, tile);
  }
  char sub[700];
  snprintf(sub, sizeof sub, "%s/tuning", dir);
  ck_assert_int_eq(count_named(sub, ".tmp.", NULL, 0), 0); /* no stray temp files */
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

START_TEST(killed_writer_leaves_db_intact) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  m3_tunedb *db = m3_tunedb_new();
  put_simple(db, "qknorm_rope(a=1)", "tokens=1", "warps=4,tok=2");
  save_ok(path, db);
  size_t len0;
  char *before = read_text(path, &len0);

  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    setenv(M3_TUNEDB_CRASH_ENV, "1", 1);
    m3_tunedb *c = m3_tunedb_new();
    recbuf b;
    fill(&b, "qknorm_rope(a=2)", "tokens=1", "warps=8,tok=2");
    b.c[0].tile = "warps=8,tok=2";
    m3_err e;
    if (m3_tunedb_put(c, &b.r, &e) != M3_OK) _exit(1);
    m3_tunedb_save_merge(path, c, NULL, &e);
    _exit(2); /* the hook should have killed us */
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "child status %d", st);

  /* The published file is byte-identical and loads; the temp file is a stray. */
  size_t len1;
  char *after = read_text(path, &len1);
  ck_assert_uint_eq(len0, len1);
  ck_assert(!memcmp(before, after, len0));
  m3_tunedb *back = load_ok(path, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(back), 1);
  ck_assert_int_eq(count_named(dir, ".tmp.", NULL, 0), 1);
  /* The dead writer's lock died with it: the next save does not block. */
  put_simple(db, "qknorm_rope(a=3)", "tokens=1", "warps=4,tok=2");
  save_ok(path, db);
  m3_tunedb_free(back);
  back = load_ok(path, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(back), 2);
  ck_assert_int_eq(m3_store_sweep_tmp(dir, 0), 1);
  ck_assert_int_eq(count_named(dir, ".tmp.", NULL, 0), 0);
  free(before);
  free(after);
  m3_tunedb_free(back);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* ------------------------------------------------------------------------- */
/* damaged files                                                             */
/* ------------------------------------------------------------------------- */

/* Load must say M3_FORMAT naming the file; save must keep a .corrupt copy
 * byte-identical to the damaged file and then write a loadable one. */
static void expect_format_then_recover(const char *dir, const char *path, const char *bad, size_t n,
                                       int want_position) {
  write_text(path, bad, n);
  m3_tunedb *db = m3_tunedb_new();
  m3_err e;
  ck_assert_int_eq(m3_tunedb_load(db, path, NULL, NULL, NULL, &e), M3_FORMAT);
  ck_assert_msg(strstr(e.msg, path) != NULL, "message does not name the file: %s", e.msg);
  if (want_position) {
    char pat[700];
    snprintf(pat, sizeof pat, "%s:", path); /* "path:line:col: ..." */
    ck_assert_msg(!strncmp(e.msg, pat, strlen(pat)) && strchr(e.msg + strlen(pat), ':'), "no line:col: %s", e.msg);
  }
  ck_assert_uint_eq(m3_tunedb_count(db), 0); /* the caller continues untuned */

  put_simple(db, "qknorm_rope(r=1)", "tokens=1", "warps=4,tok=2");
  m3_tunedb_report rep;
  ck_assert_msg(m3_tunedb_save_merge(path, db, &rep, &e) == M3_OK, "%s", e.msg);
  ck_assert_ptr_nonnull(strstr(rep.corrupt_copy, ".corrupt."));
  ck_assert_ptr_nonnull(strstr(rep.summary, rep.corrupt_copy));
  size_t cl;
  char *copy = read_text(rep.corrupt_copy, &cl);
  ck_assert_uint_eq(cl, n);
  ck_assert(!memcmp(copy, bad, n));
  free(copy);
  m3_tunedb *back = load_ok(path, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(back), 1);
  m3_tunedb_free(back);
  m3_tunedb_free(db);
  ck_assert_int_ge(count_named(dir, ".corrupt.", NULL, 0), 1);
}

START_TEST(truncated_db) {
  char *dir = tmpdir(), good[600], path[600];
  snprintf(good, sizeof good, "%s/good.json", dir);
  m3_tunedb *db = m3_tunedb_new();
  put_simple(db, "qknorm_rope(a=1)", "tokens=1,ctx=4096", "warps=4,tok=2");
  put_simple(db, "qknorm_rope(a=2)", "tokens=1,ctx=4096", "warps=4,tok=2");
  save_ok(good, db);
  m3_tunedb_free(db);
  size_t len;
  char *full = read_text(good, &len);
  size_t last = (size_t)(strrchr(full, '}') - full); /* cut here drops the final brace */
  size_t cuts[] = {0, 1, 2, 17, 40, len / 3, len / 2, (2 * len) / 3, last - 1, last};
  for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
    snprintf(path, sizeof path, "%s/cut%zu.json", dir, i);
    expect_format_then_recover(dir, path, full, cuts[i], cuts[i] > 0);
  }
  free(full);
  rm_tree(dir);
}
END_TEST

START_TEST(garbled_db) {
  char *dir = tmpdir(), path[600];
  const char *docs[] = {
      "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"records\": [ @@@garbage ]}",
      "\x89PNG\r\n\x1a\n binary junk",
      "[1, 2, 3]",
      "{\"format\": \"something-else\", \"version\": 1, \"records\": []}",
      "{\"format\": \"m3kit-tunedb\", \"records\": []}",
      "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"records\": {}}",
      "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"version\": 1, \"records\": []}",
      "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"records\": []} trailing",
  };
  for (size_t i = 0; i < sizeof docs / sizeof *docs; i++) {
    snprintf(path, sizeof path, "%s/g%zu.json", dir, i);
    expect_format_then_recover(dir, path, docs[i], strlen(docs[i]), 0);
  }
  rm_tree(dir);
}
END_TEST

/* A damaged user file must not take the seed down with it. */
START_TEST(garbled_user_keeps_seed) {
  char *dir = tmpdir(), path[600], seed[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  snprintf(seed, sizeof seed, "%s/seed.json", dir);
  const char *s = DOC(1, REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "warps=2", "550.54.15", "abc123"));
  write_text(seed, s, strlen(s));
  write_text(path, "{\"format\": \"m3kit-tu", 20);
  m3_tunedb *db = m3_tunedb_new();
  m3_err e;
  m3_tunedb_report rep;
  ck_assert_int_eq(m3_tunedb_load(db, path, seed, NULL, &rep, &e), M3_FORMAT);
  ck_assert_ptr_nonnull(strstr(e.msg, path));
  ck_assert_uint_eq(m3_tunedb_count(db), 1);
  ck_assert_int_eq(rep.from_seed, 1);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* ------------------------------------------------------------------------- */
/* staleness, soft fields, versions                                          */
/* ------------------------------------------------------------------------- */

START_TEST(stale_records_ignored_with_one_message) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  const char *doc = DOC(1, REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "warps=2", "550.54.15", "abc123") ","
                           REC("qknorm_rope(a=2)", "tokens=1", "sm_80", "warps=2", "550.54.15", "abc123") ","
                           REC("qknorm_rope(a=3)", "tokens=1", "sm_90", "warps=2", "535.00.01", "abc123") ","
                           REC("qknorm_rope(a=4)", "tokens=1", "sm_90", "warps=2", "550.54.15", "0ld0ld") ","
                           REC("index_topk(k=16)", "tokens=1", "sm_90", "warps=2", "550.54.15", "0ld0ld") ","
                           REC("gone_kernel(x=1)", "tokens=1", "sm_90", "warps=2", "550.54.15", "abc123"));
  write_text(path, doc, strlen(doc));
  m3_tunedb_filter f = {.arch = "sm_90", .driver_version = "550.54.15", .template_hash = hash_of};
  m3_tunedb_report rep;
  m3_tunedb *db = load_ok(path, &f, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), 1);
  ck_assert_str_eq(m3_tunedb_get(db, 0)->key, "qknorm_rope(a=1)");
  ck_assert_int_eq(rep.loaded, 1);
  ck_assert_int_eq(rep.stale_arch, 1);
  ck_assert_int_eq(rep.stale_driver, 1);
  ck_assert_int_eq(rep.stale_template, 3);
  /* ONE line for the caller to print, naming the file and the remedy. */
  ck_assert_ptr_null(strchr(rep.summary, '\n'));
  ck_assert_ptr_nonnull(strstr(rep.summary, path));
  ck_assert_ptr_nonnull(strstr(rep.summary, "5 stale"));
  ck_assert_ptr_nonnull(strstr(rep.summary, "m3kit tune"));
  /* Without a filter nothing is stale (tune --show shows everything). */
  m3_tunedb *all = load_ok(path, NULL, &rep);
  ck_assert_uint_eq(m3_tunedb_count(all), 6);
  ck_assert_str_eq(rep.summary, "");
  /* Stale records are not ours to delete: a merge keeps them on disk. */
  put_simple(db, "qknorm_rope(a=9)", "tokens=1", "warps=4,tok=2");
  save_ok(path, db);
  m3_tunedb_free(all);
  all = load_ok(path, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(all), 7);
  m3_tunedb_free(all);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* The code hashes of "this build": tile warps=2 of qknorm_rope renders to
 * code c0de02, warps=4 to c0de04; other tiles no longer render. */
static int code_renders; /* calls of code_of: each is a rendering in the runtime */
static const char *code_of(void *ctx, const char *key, const char *tile, const char *arch) {
  (void)ctx, (void)arch;
  code_renders++;
  if (strncmp(key, "qknorm_rope(", 12)) return NULL;
  if (!strcmp(tile, "warps=2")) return "c1:c0de02";
  if (!strcmp(tile, "warps=4")) return "c1:c0de04";
  return NULL;
}
#define REC_CODE(key, tile, hash, code)                                                                    \
  "{\"key\": \"" key "\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": \"" tile              \
  "\", \"provenance\": {\"template_hash\": \"" hash "\", \"code_hash\": \"" code "\"}}"

/* A current template hash keeps a record without rendering anything (the
 * same template text renders the same code); where the template changed, a
 * record's code hash keeps it if its tile's code is the same, and stales it
 * if the code changed or no longer renders; records without one, or with
 * another scheme's, keep the template-hash rule. */
START_TEST(code_hash_decides_where_present) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  const char *doc = DOC(1, REC_CODE("qknorm_rope(a=1)", "warps=2", "0ld0ld", "c1:c0de02") ","  /* kept: same code */
                           REC_CODE("qknorm_rope(a=2)", "warps=4", "0ld0ld", "c1:c0de02") ","  /* stale: its code changed */
                           REC_CODE("qknorm_rope(a=3)", "warps=8", "0ld0ld", "c1:c0de08") ","  /* stale: no longer renders */
                           REC("qknorm_rope(a=4)", "tokens=1", "sm_90", "warps=2", "550.54.15", "abc123") ","
                           REC("qknorm_rope(a=5)", "tokens=1", "sm_90", "warps=2", "550.54.15", "0ld0ld") ","
                           /* another scheme's hash: the template rule (current here) */
                           REC_CODE("qknorm_rope(a=6)", "warps=2", "abc123", "c0:0123") ","
                           REC_CODE("qknorm_rope(a=7)", "warps=2", "0ld0ld", "c0:0123") ","
                           /* a current template: kept, and its code never rendered */
                           REC_CODE("qknorm_rope(a=8)", "warps=4", "abc123", "c1:c0de04"));
  write_text(path, doc, strlen(doc));
  m3_tunedb_filter f = {.arch = "sm_90", .template_hash = hash_of, .code_hash = code_of, .code_scheme = "c1:"};
  m3_tunedb_report rep;
  code_renders = 0;
  m3_tunedb *db = load_ok(path, &f, &rep);
  const m3_bucket t1 = B("tokens=1");
  ck_assert_uint_eq(m3_tunedb_count(db), 4);
  const m3_tune_record *kept = m3_tunedb_find(db, "qknorm_rope(a=1)", &t1, "sm_90");
  ck_assert_ptr_nonnull(kept);
  ck_assert_str_eq(kept->prov.code_hash, "c1:c0de02");
  ck_assert_ptr_nonnull(m3_tunedb_find(db, "qknorm_rope(a=4)", &t1, "sm_90"));
  ck_assert_ptr_nonnull(m3_tunedb_find(db, "qknorm_rope(a=6)", &t1, "sm_90"));
  ck_assert_ptr_nonnull(m3_tunedb_find(db, "qknorm_rope(a=8)", &t1, "sm_90"));
  ck_assert_int_eq(rep.stale_template, 4);
  ck_assert_int_eq(code_renders, 3); /* a=1..3 only: their template changed */
  m3_tunedb_free(db);
  /* A reader without the code check (an older m3kit) applies the template rule to all. */
  f.code_hash = NULL;
  db = load_ok(path, &f, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), 3);
  ck_assert_int_eq(rep.stale_template, 5);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* A DB reached through a symlink (e.g. a shared tuning file) is updated at
 * its target: the link stays a link, and the lock is the target's. */
START_TEST(symlinked_db_updated_at_its_target) {
  char *dir = tmpdir(), target[600], link[600];
  snprintf(target, sizeof target, "%s/shared.json", dir);
  snprintf(link, sizeof link, "%s/sm_90.json", dir);
  m3_tunedb *db = m3_tunedb_new();
  put_simple(db, "qknorm_rope(a=1)", "tokens=1", "warps=2");
  save_ok(target, db);
  ck_assert_int_eq(symlink("shared.json", link), 0);
  m3_tunedb_free(db);
  db = m3_tunedb_new();
  put_simple(db, "qknorm_rope(a=2)", "tokens=1", "warps=4");
  save_ok(link, db);
  struct stat st;
  ck_assert_int_eq(lstat(link, &st), 0);
  ck_assert(S_ISLNK(st.st_mode));
  m3_tunedb *back = load_ok(target, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(back), 2);
  m3_tunedb_free(back);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* A rewritten DB keeps its permission bits (a user's private 0600 file
 * stays private; the atomic write's temp file was once always 0644), and the
 * reader refuses a FIFO without blocking on it, and a directory by name. */
START_TEST(rewrite_keeps_mode_and_reader_refuses_non_files) {
  char *dir = tmpdir(), path[600], fifo[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  m3_tunedb *db = m3_tunedb_new();
  put_simple(db, "qknorm_rope(a=1)", "tokens=1", "warps=2");
  save_ok(path, db);
  ck_assert_int_eq(chmod(path, 0600), 0);
  put_simple(db, "qknorm_rope(a=2)", "tokens=1", "warps=4");
  save_ok(path, db);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_msg((st.st_mode & 07777) == 0600, "mode %o after a rewrite, was 0600", st.st_mode & 07777);
  m3_tunedb_free(db);

  snprintf(fifo, sizeof fifo, "%s/fifo.json", dir);
  ck_assert_int_eq(mkfifo(fifo, 0600), 0);
  uint8_t *data;
  size_t len;
  m3_err e = {0};
  alarm(20); /* a blocking open would hang here: fail instead */
  ck_assert_int_eq(m3_read_file(fifo, &data, &len, &e), M3_IO);
  alarm(0);
  ck_assert_msg(strstr(e.msg, fifo) && strstr(e.msg, "not a regular file"), "%s", e.msg);
  ck_assert_int_eq(m3_read_file(dir, &data, &len, &e), M3_IO);
  ck_assert_msg(strstr(e.msg, "is a directory"), "%s", e.msg);
  ck_assert_int_eq(m3_read_file(path, &data, &len, &e), M3_OK);
  free(data);
  unlink(fifo);
  rm_tree(dir);
}
END_TEST

/* --rehash: records with a current template and no hash of this scheme get
 * their tile's; records whose template changed but not their code get the
 * current template hash; the file is edited in place under the lock (order,
 * other records and unknown fields kept); a garbled file is not touched. */
START_TEST(add_code_hashes_in_place) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  const char *doc =
      "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"future_top\": 1, \"records\": ["
      REC("qknorm_rope(a=2)", "tokens=1", "sm_90", "warps=4", "550.54.15", "abc123") ","  /* given c1:c0de04 */
      REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "warps=2", "550.54.15", "0ld0ld") ","  /* changed template: left */
      REC("qknorm_rope(a=3)", "tokens=1", "sm_90", "warps=8", "550.54.15", "abc123") ","  /* tile gone: left */
      REC_CODE("qknorm_rope(a=4)", "warps=2", "0ld0ld", "c1:0ld") ","                      /* code changed: left */
      "{\"key\": \"qknorm_rope(a=5)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": \"warps=2\", "
      "\"future\": [1], \"provenance\": {\"template_hash\": \"abc123\"}}" ","
      REC_CODE("qknorm_rope(a=6)", "warps=2", "0ld0ld", "c1:c0de02") ","                  /* same code: refreshed */
      REC("qknorm_rope(a=7)", "tokens=", "sm_90", "warps=4", "550.54.15", "abc123") "]}\n";  /* bad bucket: malformed */
  write_text(path, doc, strlen(doc));
  m3_tunedb_filter f = {.template_hash = hash_of, .code_hash = code_of, .code_scheme = "c1:"};
  m3_rehash_report rr;
  m3_err e;
  ck_assert_msg(m3_tunedb_add_code_hashes(path, &f, &rr, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(rr.given, 2);
  ck_assert_int_eq(rr.refreshed, 1);
  ck_assert_int_eq(rr.left, 3);
  ck_assert_int_eq(rr.had, 0);
  ck_assert_int_eq(rr.malformed, 1); /* as the loader counts it, not given a hash */
  ck_assert_int_eq(rr.first_malformed, 6);
  m3_tunedb_report rep;
  m3_tunedb *db = load_ok(path, NULL, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), 6);
  ck_assert_str_eq(m3_tunedb_get(db, 0)->key, "qknorm_rope(a=2)"); /* order kept */
  ck_assert_str_eq(m3_tunedb_get(db, 0)->prov.code_hash, "c1:c0de04");
  ck_assert_ptr_null(m3_tunedb_get(db, 1)->prov.code_hash);
  ck_assert_ptr_null(m3_tunedb_get(db, 2)->prov.code_hash);
  ck_assert_str_eq(m3_tunedb_get(db, 3)->prov.code_hash, "c1:0ld");
  ck_assert_str_eq(m3_tunedb_get(db, 4)->prov.code_hash, "c1:c0de02");
  ck_assert_str_eq(m3_tunedb_get(db, 5)->prov.template_hash, "abc123");
  ck_assert_str_eq(m3_tunedb_get(db, 5)->prov.code_hash, "c1:c0de02");
  ck_assert_int_eq(rep.unknown_fields, 2); /* "future_top" and "future" survived */
  ck_assert_int_eq(rep.invalid, 1);
  m3_tunedb_free(db);
  /* Nothing left to give: the file is not rewritten. */
  struct stat st0, st1;
  ck_assert_int_eq(stat(path, &st0), 0);
  ck_assert_int_eq(m3_tunedb_add_code_hashes(path, &f, &rr, &e), M3_OK);
  ck_assert_int_eq(rr.given + rr.refreshed, 0);
  ck_assert_int_eq(rr.had, 3);
  ck_assert_int_eq(rr.left, 3);
  ck_assert_int_eq(stat(path, &st1), 0);
  ck_assert(st0.st_ino == st1.st_ino);
  /* Garbled: an error naming the file, the bytes untouched. */
  write_text(path, "{\"format\": \"m3kit-tunedb\", \"vers", 31);
  ck_assert_int_eq(m3_tunedb_add_code_hashes(path, &f, &rr, &e), M3_FORMAT);
  ck_assert_ptr_nonnull(strstr(e.msg, path));
  rm_tree(dir);
}
END_TEST

START_TEST(unknown_fields_tolerated_and_kept) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  const char *doc =
      "{\"format\": \"m3kit-tunedb\", \"version\": 1, \"comment\": \"seed\", \"future_top\": [1],\n"
      " \"records\": [{\"key\": \"qknorm_rope(a=1)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\",\n"
      "  \"tile\": \"warps=2\", \"future_rec\": {\"x\": 1},\n"
      "  \"provenance\": {\"template_hash\": \"abc123\", \"future_prov\": true},\n"
      "  \"candidates\": [{\"tile\": \"warps=2\", \"disposition\": \"PASSED\", \"median_us\": 3, \"future_c\": 0},\n"
      "                 {\"tile\": \"warps=9\", \"disposition\": \"OUT_OF_MEMORY\"}]}]}\n";
  write_text(path, doc, strlen(doc));
  m3_tunedb_report rep;
  m3_tunedb *db = load_ok(path, NULL, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), 1);
  /* future_top, future_rec, future_prov, future_c, and one unknown disposition */
  ck_assert_int_eq(rep.unknown_fields, 5);
  ck_assert_int_eq(rep.invalid, 0);
  ck_assert_ptr_nonnull(strstr(rep.summary, "5 unknown fields"));
  const m3_tune_record *r = m3_tunedb_get(db, 0);
  ck_assert_uint_eq(r->n_candidates, 1); /* the unknown-disposition one is dropped */
  ck_assert(r->candidates[0].median_us == 3.0);
  ck_assert(isnan(r->default_us));
  /* A merge by an m3kit that does not know those fields keeps them. */
  put_simple(db, "qknorm_rope(a=2)", "tokens=1", "warps=4,tok=2");
  save_ok(path, db);
  char *text = read_text(path, NULL);
  const char *kept[] = {"\"comment\": \"seed\"", "\"future_top\"", "\"future_rec\"", "\"future_prov\"",
                        "\"future_c\"", "OUT_OF_MEMORY"};
  for (size_t i = 0; i < sizeof kept / sizeof *kept; i++)
    ck_assert_msg(strstr(text, kept[i]) != NULL, "%s lost", kept[i]);
  free(text);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

START_TEST(malformed_records_skipped_and_counted) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  const char *doc = DOC(
      1, REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "warps=2", "d", "abc123") ","
         "{\"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": \"w=1\", \"provenance\": {\"template_hash\": \"h\"}},"
         "{\"key\": \"k(a=1)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"provenance\": {\"template_hash\": \"h\"}},"
         "{\"key\": \"k(a=2)\", \"bucket\": \"tokens=01\", \"arch\": \"sm_90\", \"tile\": \"w=1\", \"provenance\": {\"template_hash\": \"h\"}},"
         "{\"key\": \"k(a=3)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": 7, \"provenance\": {\"template_hash\": \"h\"}},"
         "{\"key\": \"k(a=4)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": \"w=1\"},"
         "{\"key\": \"k(a=5)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": \"w=1\", \"provenance\": {\"template_hash\": \"h\"},"
         " \"candidates\": [{\"tile\": \"w=1\", \"disposition\": \"INCORRECT\"}]},"
         "{\"key\": \"k(a=6)\", \"bucket\": \"tokens=1\", \"arch\": \"sm_90\", \"tile\": \"w=1\", \"provenance\": {\"template_hash\": \"h\"},"
         " \"tuned_us\": \"fast\"},"
         "42");
  write_text(path, doc, strlen(doc));
  m3_tunedb_report rep;
  m3_tunedb *db = load_ok(path, NULL, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), 1);
  ck_assert_int_eq(rep.invalid, 8);
  ck_assert_ptr_nonnull(strstr(rep.summary, "8 malformed"));
  ck_assert_ptr_nonnull(strstr(rep.summary, "record 1: missing 'key'"));
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

START_TEST(newer_version_ignored_not_overwritten) {
  char *dir = tmpdir(), path[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  const char *doc = DOC(2, REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "warps=2", "d", "abc123"));
  write_text(path, doc, strlen(doc));
  m3_tunedb_report rep;
  m3_tunedb *db = load_ok(path, NULL, &rep);
  ck_assert_uint_eq(m3_tunedb_count(db), 0);
  ck_assert_int_eq(rep.newer_files, 1);
  ck_assert_ptr_nonnull(strstr(rep.summary, "version 2"));
  put_simple(db, "qknorm_rope(a=2)", "tokens=1", "warps=4,tok=2");
  m3_err e;
  ck_assert_int_eq(m3_tunedb_save_merge(path, db, NULL, &e), M3_UNSUPPORTED);
  ck_assert_ptr_nonnull(strstr(e.msg, path));
  char *text = read_text(path, NULL);
  ck_assert_str_eq(text, doc);
  free(text);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

START_TEST(seed_and_user_precedence) {
  char *dir = tmpdir(), path[600], seed[600];
  snprintf(path, sizeof path, "%s/sm_90.json", dir);
  snprintf(seed, sizeof seed, "%s/seed.json", dir);
  const char *s = DOC(1, REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "seed-tile", "d", "abc123") ","
                         REC("qknorm_rope(a=2)", "tokens=1", "sm_90", "seed-tile", "d", "abc123"));
  const char *u = DOC(1, REC("qknorm_rope(a=1)", "tokens=1", "sm_90", "user-tile", "d", "abc123"));
  write_text(seed, s, strlen(s));
  write_text(path, u, strlen(u));
  m3_tunedb *db = m3_tunedb_new();
  m3_tunedb_report rep;
  m3_err e;
  ck_assert_int_eq(m3_tunedb_load(db, path, seed, NULL, &rep, &e), M3_OK);
  ck_assert_uint_eq(m3_tunedb_count(db), 2);
  ck_assert_int_eq(rep.loaded, 2);
  ck_assert_int_eq(rep.from_seed, 1);
  m3_bucket t1 = B("tokens=1");
  ck_assert_str_eq(m3_tunedb_find(db, "qknorm_rope(a=1)", &t1, "sm_90")->tile, "user-tile");
  ck_assert_str_eq(m3_tunedb_find(db, "qknorm_rope(a=2)", &t1, "sm_90")->tile, "seed-tile");
  /* The driver filter applies to user records only: the seed was measured
   * on another machine by definition. */
  m3_tunedb_filter f = {.arch = "sm_90", .driver_version = "999.1", .template_hash = hash_of};
  m3_tunedb *fd = m3_tunedb_new();
  ck_assert_int_eq(m3_tunedb_load(fd, path, seed, &f, &rep, &e), M3_OK);
  ck_assert_int_eq(rep.stale_driver, 1);
  ck_assert_uint_eq(m3_tunedb_count(fd), 2);
  ck_assert_str_eq(m3_tunedb_find(fd, "qknorm_rope(a=1)", &t1, "sm_90")->tile, "seed-tile");
  m3_tunedb_free(fd);
  /* Seed records are never copied into the user file. */
  put_simple(db, "qknorm_rope(a=3)", "tokens=1", "warps=4,tok=2");
  save_ok(path, db);
  m3_tunedb *user = load_ok(path, NULL, NULL);
  ck_assert_uint_eq(m3_tunedb_count(user), 2);
  ck_assert_ptr_null(m3_tunedb_find(user, "qknorm_rope(a=2)", &t1, "sm_90"));
  m3_tunedb_free(user);
  /* A missing seed is reported, not an error. */
  m3_tunedb *d2 = m3_tunedb_new();
  snprintf(seed, sizeof seed, "%s/nope.json", dir);
  ck_assert_int_eq(m3_tunedb_load(d2, path, seed, NULL, &rep, &e), M3_OK);
  ck_assert_int_eq(rep.seed_missing, 1);
  ck_assert_ptr_nonnull(strstr(rep.summary, "not found"));
  m3_tunedb_free(d2);
  /* No files at all: an untuned machine, silently. */
  d2 = m3_tunedb_new();
  snprintf(path, sizeof path, "%s/absent.json", dir);
  ck_assert_int_eq(m3_tunedb_load(d2, path, NULL, NULL, &rep, &e), M3_OK);
  ck_assert_str_eq(rep.summary, "");
  m3_tunedb_free(d2);
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* ------------------------------------------------------------------------- */
/* lookup                                                                    */
/* ------------------------------------------------------------------------- */

static const char *K = "attn_sparse(kv=bf16)";

static m3_tunedb *lookup_db(void) {
  m3_tunedb *db = m3_tunedb_new();
  const char *one[][2] = {{"tokens=1", "tok=1"}, {"tokens=16", "tok=16"}, {"tokens=256", "tok=64"},
                          {"tokens=4096", "tok=128"}};
  for (size_t i = 0; i < 4; i++) put_simple(db, K, one[i][0], one[i][1]);
  const char *two[][2] = {{"tokens=1,ctx=4096", "a"},   {"tokens=1,ctx=131072", "b"}, {"tokens=4096,ctx=4096", "c"},
                          {"tokens=32,ctx=128", "d"},  {"tokens=128,ctx=32", "e"}};
  for (size_t i = 0; i < 5; i++) put_simple(db, "two(d=1)", two[i][0], two[i][1]);
  return db;
}

static const char *look(const m3_tunedb *db, const char *key, const char *shape, m3_tune_hit *hit) {
  m3_bucket s = B(shape);
  m3_err e;
  if (m3_tunedb_lookup(db, key, "sm_90", &s, NULL, NULL, hit, &e) != M3_OK) return NULL;
  ck_assert_int_eq(hit->checked, 0);
  return hit->tile;
}

START_TEST(lookup_nearest_rules) {
  m3_tunedb *db = lookup_db();
  m3_tune_hit h;
  /* exact */
  ck_assert_str_eq(look(db, K, "tokens=16", &h), "tok=16");
  ck_assert(h.exact && h.distance == 0.0);
  /* between, on a log2 scale: 100 is nearer 256 (1.36) than 16 (2.64)... */
  ck_assert_str_eq(look(db, K, "tokens=100", &h), "tok=64");
  ck_assert(!h.exact);
  /* ...and 60 nearer 16 (1.91) than 256 (2.09), though linearly nearer 16 too */
  ck_assert_str_eq(look(db, K, "tokens=60", &h), "tok=16");
  /* ties: 64 is 2 octaves from both 16 and 256, 4 is 2 from both 1 and 16:
   * the smaller bucket wins */
  ck_assert_str_eq(look(db, K, "tokens=64", &h), "tok=16");
  ck_assert_str_eq(look(db, K, "tokens=4", &h), "tok=1");
  ck_assert_str_eq(look(db, K, "tokens=2", &h), "tok=1"); /* 1 octave vs 3 */
  /* below every bucket (0 sits one octave below 1), above every bucket */
  ck_assert_str_eq(look(db, K, "tokens=0", &h), "tok=1");
  ck_assert_str_eq(look(db, K, "tokens=131072", &h), "tok=128");
  ck_assert(fabs(h.distance - 5.0) < 1e-12);
  /* multi-dim: (2, 65536) is 1+1 from (1, 131072), 1+4 from (1, 4096) */
  ck_assert_str_eq(look(db, "two(d=1)", "tokens=2,ctx=65536", &h), "b");
  ck_assert_str_eq(look(db, "two(d=1)", "ctx=65536,tokens=2", &h), "b"); /* order-insensitive */
  ck_assert_str_eq(look(db, "two(d=1)", "tokens=1024,ctx=4096", &h), "c");
  ck_assert_str_eq(look(db, "two(d=1)", "tokens=64,ctx=32", &h), "e"); /* 1 vs 3 */
  /* multi-dim tie: (64,64) is 2 octaves from (32,128) and from (128,32),
   * and both are the same size: the shape's first dimension decides */
  ck_assert_str_eq(look(db, "two(d=1)", "tokens=64,ctx=64", &h), "d");
  /* all rules at once: (64,4096) is 6 octaves from (1,4096), (4096,4096)
   * and (32,128); the size rule drops (4096,4096) (2^24 vs 2^12 for the
   * other two), and the first dimension picks tokens=1 over tokens=32 */
  ck_assert_str_eq(look(db, "two(d=1)", "tokens=64,ctx=4096", &h), "a");
  /* no applicable record */
  ck_assert_ptr_null(look(db, K, "tokens=16,ctx=8", &h));         /* other dimension set */
  ck_assert_ptr_null(look(db, "attn_sparse(kv=e4m3)", "tokens=16", &h)); /* other key */
  m3_bucket s = B("tokens=16");
  m3_err e;
  ck_assert_int_eq(m3_tunedb_lookup(db, K, "sm_100", &s, NULL, NULL, &h, &e), M3_NOTFOUND);
  ck_assert_ptr_nonnull(strstr(e.msg, "default tile"));
  m3_tunedb_free(db);
}
END_TEST

/* valid() stand-in: the tile's tok must not exceed the shape's token count
 * (the "tile > rows" precondition of fault 33). */
static int tok_fits(void *ctx, const char *tile, char *reason, size_t n) {
  long tokens = *(const long *)ctx, tok = strtol(tile + 4, NULL, 10);
  if (tok <= tokens) return 1;
  snprintf(reason, n, "tok=%ld > tokens=%ld", tok, tokens);
  return 0;
}

START_TEST(lookup_rechecks_tile_for_actual_shape) {
  m3_tunedb *db = lookup_db();
  m3_tune_hit h;
  m3_err e;
  long tokens;
  /* 12 tokens: nearest is 16 (tok=16 > 12, invalid) -> next nearest, 1 (tok=1). */
  tokens = 12;
  m3_bucket s = B("tokens=12");
  ck_assert_int_eq(m3_tunedb_lookup(db, K, "sm_90", &s, tok_fits, &tokens, &h, &e), M3_OK);
  ck_assert_str_eq(h.tile, "tok=1");
  ck_assert_int_eq(h.checked, 1);
  ck_assert_int_eq(h.rejected, 1);
  ck_assert_ptr_nonnull(strstr(h.reject_reason, "tok=16 > tokens=12"));
  /* 0 tokens: every tuned tile is invalid -> NOTFOUND, caller uses default. */
  tokens = 0;
  s = B("tokens=0");
  ck_assert_int_eq(m3_tunedb_lookup(db, K, "sm_90", &s, tok_fits, &tokens, &h, &e), M3_NOTFOUND);
  ck_assert_int_eq(h.rejected, 4);
  ck_assert_ptr_null(h.rec);
  ck_assert_ptr_nonnull(strstr(e.msg, "default tile"));
  /* The exact bucket is re-checked as well (a shape inside a bucket may differ). */
  tokens = 4096;
  s = B("tokens=4096");
  ck_assert_int_eq(m3_tunedb_lookup(db, K, "sm_90", &s, tok_fits, &tokens, &h, &e), M3_OK);
  ck_assert(h.exact && h.checked);
  m3_tunedb_free(db);
}
END_TEST

/* ------------------------------------------------------------------------- */
/* output                                                                    */
/* ------------------------------------------------------------------------- */

/* M3KIT_BENCH_CASE (runtime/bench.c): a substring, or anchored at the name's
 * end by a trailing '$'; only matches are counted (a filter that selects no
 * case makes m3kit bench exit 1). */
START_TEST(bench_case_filter) {
  unsetenv("M3KIT_BENCH_CASE");
  const int n0 = m3_bench_cases_matched();
  ck_assert(m3_bench_case_wanted("insert bf16 tokens=16"));
  ck_assert_int_eq(m3_bench_cases_matched(), n0); /* no filter: nothing counted */
  setenv("M3KIT_BENCH_CASE", "tokens=1", 1);
  ck_assert(m3_bench_case_wanted("insert bf16 tokens=16"));
  ck_assert(m3_bench_case_wanted("insert bf16 tokens=1"));
  setenv("M3KIT_BENCH_CASE", "tokens=1$", 1);
  ck_assert(!m3_bench_case_wanted("insert bf16 tokens=16"));
  ck_assert(m3_bench_case_wanted("insert bf16 tokens=1"));
  ck_assert(!m3_bench_case_wanted("s=1"));
  setenv("M3KIT_BENCH_CASE", "$", 1); /* a lone '$' is plain text */
  ck_assert(!m3_bench_case_wanted("tokens=1"));
  ck_assert_int_eq(m3_bench_cases_matched(), n0 + 3);
  unsetenv("M3KIT_BENCH_CASE");
}
END_TEST

START_TEST(print_and_plot) {
  m3_tunedb *db = m3_tunedb_new();
  put_simple(db, "qknorm_rope(attn=sparse)", "tokens=1,ctx=131072", "warps=4,tok=2");
  put_simple(db, "index_topk(k=16)", "tokens=1", "warps=4,tok=2");
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  m3_tunedb_print(db, f);
  m3_tunedb_print_record(m3_tunedb_get(db, 0), f);
  fclose(f);
  /* each key heads its group on a line of its own; its records' rows follow, indented, tile last */
  ck_assert_ptr_nonnull(strstr(buf, "\nqknorm_rope(attn=sparse) (sm_90)\n  tokens=1,ctx=131072 "));
  ck_assert_ptr_nonnull(strstr(buf, "warps=4,tok=2 (warps=4,tok=1)\n"));
  ck_assert_ptr_nonnull(strstr(buf, "1.67x"));   /* 20.5 / 12.25 */
  ck_assert_ptr_nonnull(strstr(buf, "1/3"));     /* passed/all */
  ck_assert_ptr_nonnull(strstr(buf, "INCORRECT"));
  ck_assert_ptr_nonnull(strstr(buf, "2 records"));
  ck_assert_ptr_null(strstr(buf, ",untimed"));
  free(buf);

  /* Two tiles pinned by one A/B, neither among the timed candidates: marked
   * untimed, and the reason printed once. */
  const char *why = "an A/B of the whole step chose it";
  m3_tunedb *pdb = m3_tunedb_new();
  for (int i = 0; i < 2; i++) {
    recbuf pb;
    fill(&pb, "attn_dense(mode=decode)", i ? "tokens=8" : "tokens=1", "warps=8,tok=1");
    pb.r.tile = "warps=8,tok=9"; /* the candidates are warps=8,tok=1 and others */
    pb.r.pinned = why;
    put_ok(pdb, &pb.r);
  }
  f = open_memstream(&buf, &len);
  m3_tunedb_print(pdb, f);
  fclose(f);
  m3_tunedb_free(pdb);
  const char *row = strstr(buf, "\n  tokens=8 ");
  ck_assert_ptr_nonnull(row);
  ck_assert_ptr_nonnull(strstr(row, "new,pinned,untimed")); /* new: m3_tunedb_put in this process */
  ck_assert_ptr_nonnull(strstr(row, " H200 "));              /* "NVIDIA H200": the model only */
  const char *p1 = strstr(buf, why);
  ck_assert_ptr_nonnull(p1);
  ck_assert_ptr_null(strstr(p1 + 1, why));
  ck_assert_ptr_nonnull(strstr(p1, "\n  attn_dense(mode=decode) tokens=8 [warps=8,tok=9]\n"));
  free(buf);

  char *dir = tmpdir(), sub[600], dat[1200];
  snprintf(sub, sizeof sub, "%s/plots", dir);
  int n;
  m3_err e;
  ck_assert_msg(m3_tunedb_write_plot_data(db, sub, "qknorm", &n, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(n, 1);
  ck_assert_int_eq(count_named(sub, ".dat", dat, sizeof dat), 1);
  ck_assert_int_eq(count_named(sub, ".gp", NULL, 0), 2); /* one plot + all.gp */
  char *text = read_text(dat, NULL);
  ck_assert_ptr_nonnull(strstr(text, "\n0 warps=4,tok=2 12.25 12.125 12.5 50 PASSED\n"));
  ck_assert_ptr_nonnull(strstr(text, "\n1 warps=8,tok=1 - - - 0 INCORRECT\n"));
  free(text);
  ck_assert_int_eq(m3_tunedb_write_plot_data(db, sub, NULL, &n, &e), M3_OK);
  ck_assert_int_eq(n, 2);
  /* Render when gnuplot was found by configure (the CLI does the same). */
  if (M3_GNUPLOT[0]) {
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "'%s' '%s/all.gp' 2>/dev/null", M3_GNUPLOT, sub);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_eq(count_named(sub, ".png", NULL, 0), 2);
  }
  m3_tunedb_free(db);
  rm_tree(dir);
}
END_TEST

/* m3kit tune --only takes a comma-separated list of families: whole names
 * only (no prefix matches), any position, no empty entries matching. */
START_TEST(only_list_matches_whole_names) {
  ck_assert(m3_tune_name_in_list("mxfp8", "mxfp8"));
  ck_assert(m3_tune_name_in_list("mxfp8,attn_sparse,attn_dense", "attn_sparse"));
  ck_assert(m3_tune_name_in_list("mxfp8,attn_sparse,attn_dense", "attn_dense"));
  ck_assert(!m3_tune_name_in_list("mxfp8,attn_sparse", "attn"));
  ck_assert(!m3_tune_name_in_list("attn_sparse", "attn_sparse_x"));
  ck_assert(!m3_tune_name_in_list("qknorm_rope,", ""));
  ck_assert(!m3_tune_name_in_list("", "mxfp8"));
}
END_TEST

/* ------------------------------------------------------------------------- */

/* `m3kit tune --show` as a user sees it ($M3KIT_BIN, set by `make check`;
 * skipped when run by hand without it): with no DB of the user's, one line
 * for it and then the seed's records; with one, its records and one line for
 * the seed.  Never "unreadable" for a seed that is there (a dangling else
 * once printed it, with an uninitialised message, for every user with a DB). */
static char *run_show(const char *cache) {
  const char *bin = getenv("M3KIT_BIN");
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "M3KIT_CACHE_DIR='%s' '%s' tune --show --arch sm_90 2>&1", cache, bin);
  FILE *f = popen(cmd, "r");
  ck_assert_ptr_nonnull(f);
  char *out = malloc(1 << 20);
  size_t n = fread(out, 1, (1 << 20) - 1, f);
  out[n] = 0;
  ck_assert_int_eq(pclose(f), 0);
  return out;
}

START_TEST(cli_show_with_and_without_a_db) {
  if (!getenv("M3KIT_BIN")) return;
  char seed[4200];
  if (!m3_tuning_seed_path("sm_90", seed, sizeof seed) || access(seed, R_OK)) return; /* no seed installed */
  char *dir = tmpdir();
  char *out = run_show(dir);
  ck_assert_msg(strstr(out, "not there yet (m3kit tune writes it)"), "no DB:\n%s", out);
  ck_assert_msg(strstr(out, "what the runtime uses until you tune"), "no DB:\n%s", out);
  ck_assert_msg(strstr(out, "\nkey ") && !strstr(out, "unreadable") && !strstr(out, "0 records"), "no DB:\n%s", out);
  free(out);
  /* the seed copied in as the user's DB */
  char tdir[4300], db[4400], cmd[9000];
  snprintf(tdir, sizeof tdir, "%s/tuning", dir);
  ck_assert_int_eq(mkdir(tdir, 0755), 0);
  snprintf(db, sizeof db, "%s/sm_90.json", tdir);
  snprintf(cmd, sizeof cmd, "cp '%s' '%s'", seed, db);
  ck_assert_int_eq(system(cmd), 0);
  out = run_show(dir);
  ck_assert_msg(strstr(out, "this m3kit would use") && strstr(out, "used where the DB above has none"),
                "with a DB:\n%s", out);
  ck_assert_msg(!strstr(out, "unreadable") && !strstr(out, "not there yet"), "with a DB:\n%s", out);
  free(out);
  rm_tree(dir);
}
END_TEST

/* ------------------------------------------------------------------------- */

int main(void) {
  Suite *s = suite_create("tunedb");
  TCase *basic = tcase_create("basic");
  tcase_add_test(basic, bucket_text);
  tcase_add_test(basic, put_replaces_and_validates);
  tcase_add_test(basic, path_under_cache_root);
  tcase_add_test(basic, round_trip);
  tcase_add_test(basic, loaded_records_do_not_clobber);
  suite_add_tcase(s, basic);

  TCase *robust = tcase_create("robustness");
  tcase_set_timeout(robust, 120);
  tcase_add_test(robust, concurrent_writers);
  tcase_add_test(robust, killed_writer_leaves_db_intact);
  tcase_add_test(robust, truncated_db);
  tcase_add_test(robust, garbled_db);
  tcase_add_test(robust, garbled_user_keeps_seed);
  suite_add_tcase(s, robust);

  TCase *load = tcase_create("load");
  tcase_add_test(load, stale_records_ignored_with_one_message);
  tcase_add_test(load, code_hash_decides_where_present);
  tcase_add_test(load, add_code_hashes_in_place);
  tcase_add_test(load, symlinked_db_updated_at_its_target);
  tcase_add_test(load, rewrite_keeps_mode_and_reader_refuses_non_files);
  tcase_add_test(load, unknown_fields_tolerated_and_kept);
  tcase_add_test(load, malformed_records_skipped_and_counted);
  tcase_add_test(load, newer_version_ignored_not_overwritten);
  tcase_add_test(load, seed_and_user_precedence);
  suite_add_tcase(s, load);

  TCase *lookup = tcase_create("lookup");
  tcase_add_test(lookup, lookup_nearest_rules);
  tcase_add_test(lookup, lookup_rechecks_tile_for_actual_shape);
  suite_add_tcase(s, lookup);

  TCase *out = tcase_create("output");
  tcase_set_timeout(out, 60);
  tcase_add_test(out, print_and_plot);
  tcase_add_test(out, bench_case_filter);
  tcase_add_test(out, only_list_matches_whole_names);
  tcase_add_test(out, cli_show_with_and_without_a_db);
  suite_add_tcase(s, out);

  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
