/* check_tune_gpu.c - the tuner's honesty on the GPU (known-faults #32, #34):
 * a deliberately broken candidate (one CTA short, via M3KIT_TUNE_TEST_HOOK) is
 * rejected as INCORRECT and never chosen; a deliberately slow one never wins;
 * recorded times exclude compilation; the DB written is readable and the
 * runtime's lookup returns a tile that passes valid(). */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "autotune/tune.h"
#include "cache/tunedb.h"
#include "runtime/tuning_lookup.h"
#include "tests/gpu_main.h"

GPU_TEST_GLOBALS

static char dbfile[256];

static void run_tune(const char *hook, m3_tune_result *res) {
  if (hook) setenv("M3KIT_TUNE_TEST_HOOK", hook, 1);
  else unsetenv("M3KIT_TUNE_TEST_HOOK");
  /* The CPU emulator runs every fiber of every launch: a small bucket there. */
  m3_tune_opts o = {.preset = "minimax-m3", .only = "qknorm_rope", .shapes = m3_test_emulated() ? "tokens=4" : "tokens=64",
                    .reps = 20, .db_path = dbfile};
  m3_err e;
  ck_assert_msg(m3_tune_run(&g_rt, &o, res, &e) == M3_OK, "%s", e.msg);
  unsetenv("M3KIT_TUNE_TEST_HOOK");
  ck_assert_int_gt(res->n_rows, 0);
}

START_TEST(broken_candidate_rejected) {
  m3_tune_result res;
  run_tune("broken=warps=8,hpw=1", &res);
  for (int i = 0; i < res.n_rows; i++) {
    ck_assert_str_ne(res.rows[i].tile, "warps=8,hpw=1");
    ck_assert_int_ge(res.rows[i].n_incorrect, 1);
  }
  m3_tune_result_free(&res);
  /* The DB never names the broken tile as a choice, and it was recorded INCORRECT. */
  m3_tunedb *db = m3_tunedb_new();
  m3_tunedb_report rep;
  m3_err e;
  ck_assert_int_eq(m3_tunedb_load(db, dbfile, NULL, NULL, &rep, &e), M3_OK);
  ck_assert_uint_gt(m3_tunedb_count(db), 0);
  for (size_t i = 0; i < m3_tunedb_count(db); i++) {
    const m3_tune_record *r = m3_tunedb_get(db, i);
    ck_assert_str_ne(r->tile, "warps=8,hpw=1");
    int seen = 0;
    for (size_t c = 0; c < r->n_candidates; c++)
      if (!strcmp(r->candidates[c].tile, "warps=8,hpw=1")) {
        ck_assert_int_eq(r->candidates[c].disposition, M3_DISP_INCORRECT);
        seen = 1;
      }
    ck_assert(seen);
  }
  m3_tunedb_free(db);
}
END_TEST

START_TEST(slow_candidate_never_wins_and_times_exclude_compiles) {
  for (int round = 0; round < (m3_test_emulated() ? 1 : 3); round++) {
    m3_tune_result res;
    run_tune("slow=warps=4,hpw=2", &res);
    for (int i = 0; i < res.n_rows; i++) {
      ck_assert_str_ne(res.rows[i].tile, "warps=4,hpw=2");
      /* A ~tens-of-microseconds kernel; NVRTC takes ~100 ms: no recorded time
       * can contain a compile.  (Emulated times are CPU times: no bound.) */
      if (!m3_test_emulated()) ck_assert_msg(res.rows[i].tuned_us < 1000.0, "tuned %g us", res.rows[i].tuned_us);
    }
    m3_tune_result_free(&res);
  }
}
END_TEST

START_TEST(runtime_reads_what_the_tuner_wrote) {
  m3_tune_result res;
  run_tune(NULL, &res);
  m3_tune_result_free(&res);
  m3_tunedb *db = m3_tunedb_new();
  m3_tunedb_report rep;
  m3_err e;
  ck_assert_int_eq(m3_tunedb_load(db, dbfile, NULL, NULL, &rep, &e), M3_OK);
  const m3_tune_record *r = m3_tunedb_get(db, 0);
  ck_assert_ptr_nonnull(r);
  m3_variant v;
  ck_assert_int_eq(m3_variant_parse(r->key, &v, &e), M3_OK);
  snprintf(v.arch, sizeof v.arch, "%s", g_rt.dev.arch);
  char tile[256];
  m3_bucket b = {0};
  m3_bucket_add(&b, "tokens", m3_test_emulated() ? 5 : 50, NULL); /* nearest bucket: the tuned one */
  ck_assert(m3_tuning_lookup_checked(db, g_rt.jit.lua, &v, &b, tile, sizeof tile));
  ck_assert_str_eq(tile, r->tile);
  m3_tunedb_free(db);
}
END_TEST

static Suite *make(void) {
  Suite *s = suite_create("tune_gpu");
  TCase *tc = tcase_create("tuner");
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, broken_candidate_rejected);
  tcase_add_test(tc, slow_candidate_never_wins_and_times_exclude_compiles);
  tcase_add_test(tc, runtime_reads_what_the_tuner_wrote);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  snprintf(dbfile, sizeof dbfile, "/tmp/m3tune-%d.json", (int)getpid());
  return gpu_test_main("check_tune_gpu", make);
}
