/* fuzz_tunedb.c - a tuning DB file through m3_tunedb_load (cache/tunedb.c):
 * the envelope, every record field, buckets, candidates, the staleness
 * filter.  Then what tunedb.h promises about what it accepted:
 *   - every loaded record passes m3_tune_record_check and is found by
 *     identity; lookups at its own bucket return it (exact, distance 0) or
 *     one with the same identity;
 *   - the records re-put into a fresh DB save through m3_tunedb_save_merge
 *     and load back, all of them, with the same identities and tiles;
 *   - a garbled file never loses what the seed contributed.
 * The same bytes are also loaded as the seed, unfiltered, and printed. */
#include <math.h>

#include "cache/tunedb.h"
#include "fuzz/fuzz.h"

static const char *tpl_hash(void *ctx, const char *name) {
  (void)ctx;
  return !strcmp(name, "unknown_template") ? NULL : FUZZ_TPL_HASH;
}

static int accept_all(void *ctx, const char *tile, char *reason, size_t n) {
  (void)ctx;
  /* Reject one spelling so the walk over farther records is exercised. */
  if (strstr(tile, "warps=32")) {
    snprintf(reason, n, "fuzz: warps=32 refused");
    return 0;
  }
  return 1;
}

static void check_db(const m3_tunedb *db) {
  for (size_t i = 0; i < m3_tunedb_count(db); i++) {
    const m3_tune_record *r = m3_tunedb_get(db, i);
    m3_err e;
    FUZZ_CHECK(m3_tune_record_check(r, &e) == M3_OK, "loaded record %zu fails check: %s", i, e.msg);
    FUZZ_CHECK(m3_tunedb_find(db, r->key, &r->bucket, r->arch) == r, "record %zu not found by identity", i);
    char b[M3_BUCKET_STR_MAX];
    int bl = m3_bucket_format(&r->bucket, b, sizeof b);
    FUZZ_CHECK(bl >= 0 && (size_t)bl < sizeof b, "bucket text fits");
    m3_bucket back;
    FUZZ_CHECK(m3_bucket_parse(b, &back, &e) == M3_OK && m3_bucket_equal(&back, &r->bucket),
               "bucket '%s' round trip: %s", b, e.msg);
    char b2[M3_BUCKET_STR_MAX];
    m3_bucket_format(&back, b2, sizeof b2);
    FUZZ_CHECK(!strcmp(b, b2), "bucket text '%s' vs '%s'", b, b2);
    m3_tune_hit hit;
    m3_status s = m3_tunedb_lookup(db, r->key, r->arch, &r->bucket, NULL, NULL, &hit, &e);
    FUZZ_CHECK(s == M3_OK && hit.rec && hit.exact && hit.distance == 0.0 && !strcmp(hit.rec->key, r->key),
               "lookup at its own bucket: %s", m3_status_name(s));
    FUZZ_CHECK(m3_bucket_equal(&hit.rec->bucket, &r->bucket), "an exact hit at another bucket");
    s = m3_tunedb_lookup(db, r->key, r->arch, &r->bucket, accept_all, NULL, &hit, &e);
    FUZZ_CHECK(s == M3_OK || s == M3_NOTFOUND, "checked lookup: %s", m3_status_name(s));
    if (s == M3_OK) FUZZ_CHECK(hit.checked && hit.tile && !strstr(hit.tile, "warps=32"), "checked hit");
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_dir_clear();
  char path[600], out[600], seed[600];
  fuzz_write("sm_90.json", data, size, path, sizeof path);
  /* A valid one-record seed beside it: whatever the user file is, the seed's
   * record must still be there after the load. */
  static const char seed_text[] =
      "{\"format\":\"m3kit-tunedb\",\"version\":1,\"records\":[{\"key\":\"seed_op(a=1)\",\"bucket\":\"tokens=1\","
      "\"arch\":\"sm_90\",\"tile\":\"warps=4\",\"provenance\":{\"template_hash\":\"" FUZZ_TPL_HASH "\"}}]}";
  fuzz_write("seed.json", seed_text, sizeof seed_text - 1, seed, sizeof seed);

  m3_tunedb_filter f = {.arch = "sm_90", .driver_version = "550.54.15", .template_hash = tpl_hash};
  m3_tunedb_report rep;
  m3_err e = {0};
  m3_tunedb *db = m3_tunedb_new();
  if (!db) abort();
  m3_status s = m3_tunedb_load(db, path, seed, &f, &rep, &e);
  fuzz_note("tunedb", s, e.msg);
  FUZZ_CHECK(s == M3_OK || s == M3_FORMAT, "load: %s: %s", m3_status_name(s), e.msg);
  FUZZ_CHECK(s == M3_OK || e.msg[0], "an error without a message");
  FUZZ_CHECK(memchr(rep.summary, 0, sizeof rep.summary) != NULL, "summary terminated");
  m3_bucket one = {0};
  m3_bucket_add(&one, "tokens", 1, NULL);
  const m3_tune_record *sr = m3_tunedb_find(db, "seed_op(a=1)", &one, "sm_90");
  FUZZ_CHECK(sr != NULL, "the seed record was lost (status %s)", m3_status_name(s));
  check_db(db);

  /* Re-publish what was accepted and read it back. */
  m3_tunedb *mine = m3_tunedb_new();
  if (!mine) abort();
  for (size_t i = 0; i < m3_tunedb_count(db); i++) {
    s = m3_tunedb_put(mine, m3_tunedb_get(db, i), &e);
    FUZZ_CHECK(s == M3_OK, "put of a loaded record: %s", e.msg);
  }
  snprintf(out, sizeof out, "%s/out/sm_90.json", fuzz_dir());
  s = m3_tunedb_save_merge(out, mine, NULL, &e);
  FUZZ_CHECK(s == M3_OK, "save_merge of loaded records: %s", e.msg);
  m3_tunedb *back = m3_tunedb_new();
  if (!back) abort();
  /* No driver filter here: the seed's record (exempt from it as a seed) is
   * now a user record without a driver_version. */
  m3_tunedb_filter f2 = {.arch = "sm_90", .template_hash = tpl_hash};
  s = m3_tunedb_load(back, out, NULL, &f2, &rep, &e);
  FUZZ_CHECK(s == M3_OK, "reload of our own file: %s", e.msg);
  FUZZ_CHECK(m3_tunedb_count(back) == m3_tunedb_count(db), "reload kept %zu of %zu records (%s)",
             m3_tunedb_count(back), m3_tunedb_count(db), rep.summary);
  for (size_t i = 0; i < m3_tunedb_count(db); i++) {
    const m3_tune_record *a = m3_tunedb_get(db, i);
    const m3_tune_record *b = m3_tunedb_find(back, a->key, &a->bucket, a->arch);
    FUZZ_CHECK(b && !strcmp(a->tile, b->tile) && a->n_candidates == b->n_candidates,
               "record '%s' changed through save + load", a->key);
  }
  m3_tunedb_free(back);
  m3_tunedb_free(mine);

  /* Unfiltered, as a seed (origin rules differ), and printed. */
  m3_tunedb_free(db);
  db = m3_tunedb_new();
  if (!db) abort();
  s = m3_tunedb_load(db, NULL, path, NULL, &rep, &e);
  FUZZ_CHECK(s == M3_OK || s == M3_FORMAT, "seed load: %s", m3_status_name(s));
  check_db(db);
  FILE *null = fopen("/dev/null", "w");
  if (null) {
    m3_tunedb_print(db, null);
    for (size_t i = 0; i < m3_tunedb_count(db) && i < 4; i++) m3_tunedb_print_record(m3_tunedb_get(db, i), null);
    fclose(null);
  }
  m3_tunedb_free(db);
  return 0;
}
