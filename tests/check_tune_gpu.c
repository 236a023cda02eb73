/* check_tune_gpu.c - the tuner's honesty on the GPU (known-faults #32, #34):
 * a deliberately broken candidate (one CTA short, via M3KIT_TUNE_TEST_HOOK) is
 * rejected as INCORRECT and never chosen; a deliberately slow one never wins;
 * recorded times exclude compilation; the DB written is readable and the
 * runtime's lookup returns a tile that passes valid(). */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "autotune/op.h"
#include "autotune/tune.h"
#include "cache/tunedb.h"
#include "gen/render.h"
#include "runtime/model_dims.h"
#include "runtime/tuning_lookup.h"
#include "tests/gpu_main.h"

GPU_TEST_GLOBALS

static char dbfile[256];

static void run_tune(const char *hook, m3_tune_result *res) {
  if (hook) setenv("M3KIT_TUNE_TEST_HOOK", hook, 1);
  else unsetenv("M3KIT_TUNE_TEST_HOOK");
  /* The CPU emulator runs every fiber of every launch: there a small bucket,
   * one variant and three tiles (the default, the broken and the slow one:
   * every candidate is fully timed and graph-timed, minutes each). */
  const int emu = m3_test_emulated();
  m3_tune_opts o = {.preset = "minimax-m3", .only = "qknorm_rope", .shapes = emu ? "tokens=4" : "tokens=64",
                    .variant = emu ? "attn=sparse,insert=1,kv=bf16" : NULL,
                    .tiles = emu ? "warps=4,hpw=1,lph=32,rope=pair;warps=8,hpw=1,lph=32,rope=pair;warps=4,hpw=2,lph=32,rope=pair" : NULL, .reps = 20, .db_path = dbfile};
  m3_err e;
  ck_assert_msg(m3_tune_run(&g_rt, &o, res, &e) == M3_OK, "%s", e.msg);
  unsetenv("M3KIT_TUNE_TEST_HOOK");
  ck_assert_int_gt(res->n_rows, 0);
}

START_TEST(broken_candidate_rejected) {
  m3_tune_result res;
  run_tune("broken=warps=8,hpw=1,lph=32,rope=pair", &res);
  for (int i = 0; i < res.n_rows; i++) {
    ck_assert_str_ne(res.rows[i].tile, "warps=8,hpw=1,lph=32,rope=pair");
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
    ck_assert_str_ne(r->tile, "warps=8,hpw=1,lph=32,rope=pair");
    int seen = 0;
    for (size_t c = 0; c < r->n_candidates; c++)
      if (!strcmp(r->candidates[c].tile, "warps=8,hpw=1,lph=32,rope=pair")) {
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
    /* Round 0 event-timed where the kernel is long; the others (and the
     * emulator's one) with every candidate re-timed as a CUDA graph. */
    if (round > 0 || m3_test_emulated()) setenv("M3KIT_TUNE_GRAPH_US", "1e12", 1);
    run_tune("slow=warps=4,hpw=2,lph=32,rope=pair", &res);
    unsetenv("M3KIT_TUNE_GRAPH_US");
    for (int i = 0; i < res.n_rows; i++) {
      ck_assert_str_ne(res.rows[i].tile, "warps=4,hpw=2,lph=32,rope=pair");
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
  /* The code hash it wrote (from the source compiled for the sweep) is that
   * of the chosen tile's rendering: what a load checks after a template edit. */
  m3_tuning_hash_ctx hc = {.lua = g_rt.jit.lua};
  const char *code = m3_tuning_code_hash(&hc, r->key, r->tile, r->arch);
  ck_assert_ptr_nonnull(code);
  ck_assert_ptr_nonnull(r->prov.code_hash);
  ck_assert_str_eq(r->prov.code_hash, code);
  m3_tunedb_free(db);
}
END_TEST

static char *read_file_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  rewind(f);
  char *b = malloc((size_t)len + 1);
  ck_assert_ptr_nonnull(b);
  ck_assert_uint_eq(fread(b, 1, (size_t)len, f), (size_t)len);
  fclose(f);
  *n = (size_t)len;
  return b;
}

/* A record pinned by a whole-step A/B (cache/tunedb.h `pinned`,
 * tools/seed_pin.py): a later tune keeps the pinned tile while it times
 * within the slack of the tuner's pick, and carries the reason over; a pinned
 * tile that times slower than the slack or fails verification is dropped
 * for the tuner's pick, and the pin with it; one that is not among the run's
 * candidates leaves the record as it was.  The slack is forced
 * (M3KIT_TUNE_PIN_SLACK) so that the outcome does not depend on which of two
 * close tiles times faster. */
static void tune_rmsnorm_tiles(const char *hook, const char *tiles, m3_tune_result *res) {
  if (hook) setenv("M3KIT_TUNE_TEST_HOOK", hook, 1);
  m3_tune_opts o = {.preset = "minimax-m3", .only = "rmsnorm", .variant = "add=0,f32copy=0", .shapes = "tokens=1",
                    .tiles = tiles, .reps = 20, .db_path = dbfile};
  m3_err e;
  m3_status s = m3_tune_run(&g_rt, &o, res, &e);
  unsetenv("M3KIT_TUNE_TEST_HOOK");
  ck_assert_msg(s == M3_OK, "%s", e.msg);
  ck_assert_int_eq(res->n_rows, 1);
}
static void tune_rmsnorm(const char *hook, m3_tune_result *res) { tune_rmsnorm_tiles(hook, "threads=256,cluster=1;threads=512,cluster=1", res); }
static m3_tunedb *load_dbfile(void) {
  m3_tunedb *db = m3_tunedb_new();
  m3_tunedb_report rep;
  m3_err e;
  ck_assert_int_eq(m3_tunedb_load(db, dbfile, NULL, NULL, &rep, &e), M3_OK);
  ck_assert_uint_eq(m3_tunedb_count(db), 1);
  return db;
}

/* The tune (with `hook`) chose another tile than the pinned `pinned`, in its
 * result and in the DB it wrote, and the record carries no pin. */
static void expect_pin_dropped(const char *hook, const char *pinned) {
  m3_tune_result res;
  tune_rmsnorm(hook, &res);
  ck_assert_str_ne(res.rows[0].tile, pinned);
  m3_tune_result_free(&res);
  m3_tunedb *db = load_dbfile();
  ck_assert_str_ne(m3_tunedb_get(db, 0)->tile, pinned);
  ck_assert_ptr_null(m3_tunedb_get(db, 0)->pinned);
  m3_tunedb_free(db);
}

START_TEST(pinned_tile_kept_within_slack_dropped_when_broken) {
  unlink(dbfile);
  m3_tune_result res;
  tune_rmsnorm(NULL, &res);
  m3_tune_result_free(&res);
  m3_tunedb *first = load_dbfile();
  const m3_tune_record *r = m3_tunedb_get(first, 0);
  ck_assert_ptr_null(r->pinned);
  /* Pin the tile the tuner did not choose (this tune may have cut its
   * timing short as 3x slower: the pinned record lists no candidates; the
   * next tune times a pinned tile in full). */
  const char *other = !strcmp(r->tile, "threads=256,cluster=1") ? "threads=512,cluster=1" : "threads=256,cluster=1";
  m3_tune_record p = *r;
  p.tile = other;
  p.n_candidates = 0;
  p.candidates = NULL;
  p.pinned = "test: a step A/B chose it";
  m3_tunedb *pins = m3_tunedb_new();
  m3_err e;
  ck_assert_msg(m3_tunedb_put(pins, &p, &e) == M3_OK, "%s", e.msg);
  struct m3_tunedb *saved = g_rt.db;
  g_rt.db = pins; /* what the tuner reads as the earlier records (seed + user DB) */

  setenv("M3KIT_TUNE_PIN_SLACK", "1e9", 1);
  tune_rmsnorm(NULL, &res);
  ck_assert_str_eq(res.rows[0].tile, other);
  ck_assert_int_eq(res.rows[0].n_incorrect, 0);
  m3_tune_result_free(&res);
  m3_tunedb *kept = load_dbfile();
  ck_assert_str_eq(m3_tunedb_get(kept, 0)->tile, other);
  ck_assert_ptr_nonnull(m3_tunedb_get(kept, 0)->pinned);
  ck_assert_str_eq(m3_tunedb_get(kept, 0)->pinned, "test: a step A/B chose it");
  m3_tunedb_free(kept);

  /* Slower than the slack allows (forced: no slack at all, and less): the choice wins. */
  setenv("M3KIT_TUNE_PIN_SLACK", "-0.5", 1);
  expect_pin_dropped(NULL, other);
  setenv("M3KIT_TUNE_PIN_SLACK", "1e9", 1);

  /* Not among this run's candidates: the record is left as it was. */
  size_t n0, n1;
  char *before = read_file_all(dbfile, &n0);
  tune_rmsnorm_tiles(NULL, strcmp(other, "threads=256,cluster=1") ? "threads=256,cluster=1" : "threads=512,cluster=1", &res);
  m3_tune_result_free(&res);
  char *after = read_file_all(dbfile, &n1);
  ck_assert(n0 == n1 && !memcmp(before, after, n0));
  free(before);
  free(after);

  char hook[64];
  snprintf(hook, sizeof hook, "broken=%s", other);
  expect_pin_dropped(hook, other);
  unsetenv("M3KIT_TUNE_PIN_SLACK");

  g_rt.db = saved;
  m3_tunedb_free(pins);
  m3_tunedb_free(first);
  unlink(dbfile);
}
END_TEST

/* One adapter at a tiny bucket with two candidate tiles, the first made
 * wrong by the hook: the tuner runs, rejects it as INCORRECT, and chooses
 * the other one (verified against the reference, so PASSED).  `direct`:
 * a family the runtime never looks up by bucket (its adapter lists none),
 * so the tuner has no job for it; the test drives the adapter itself at
 * `shapes` (a bucket) through the same gate.  `fuse`: M3KIT_MOE_FUSE while
 * it runs, for a variant only that fusion lists. */
typedef struct { const char *op, *variant, *shapes, *broken, *good; int emu, direct; const char *fuse; } adapter_case;

static const adapter_case ADAPTERS[] = {
    {"index_decode", "idxk=bf16", "tokens=1;ctx=8192", "warps=8,depth=2,waves=1,chunk=16,cvt=alu,lead=0,merge=fence,nf=scan",
     "warps=4,depth=2,waves=1,chunk=16,cvt=alu,lead=2,merge=acqrel,nf=acc", 1},
    {"index_decode", "idxk=e4m3", "tokens=1;ctx=8192", "warps=4,depth=4,waves=1,chunk=16,cvt=alu,lead=1,merge=acqrel,nf=scan",
     "warps=4,depth=4,waves=1,chunk=16,cvt=hw,lead=0,merge=fence,nf=acc", 1},
    {"index_prefill", "stage=score,idxk=bf16", "tokens=256;ctx=256", "warps=4", "warps=2", 1},
    {"index_prefill", "stage=topk,idxk=e4m3", "tokens=256;ctx=256", "warps=2", "warps=8", 1},
    {"attn_sparse", "mode=decode,kv=bf16", "tokens=1;ctx=8192", "warps=8,ctas=1,depth=1,cvt=alu,merge=fence", "warps=4,ctas=2,depth=1,cvt=alu,merge=acqrel", 1},
    {"attn_sparse", "mode=prefill,kv=e4m3", "tokens=256;ctx=256", "warps=4,ctas=1,depth=1,cvt=alu,merge=fence", "warps=8,ctas=1,depth=1,cvt=hw,merge=fence"},
    {"attn_dense", "mode=decode,kv=e4m3", "tokens=1;ctx=1024", "warps=8,ctas=1,depth=1,cvt=alu,lead=0,merge=acqrel",
     "warps=4,ctas=1,depth=2,cvt=hw,lead=1,merge=fence", 1},
    {"attn_dense", "mode=prefill,kv=bf16", "tokens=256;ctx=256", "warps=4,ctas=1,depth=1,cvt=alu,lead=0,merge=fence",
     "warps=2,ctas=1,depth=1,cvt=alu,lead=0,merge=fence"},
    {"swiglu", "inter=12288", "tokens=8", "threads=256", "threads=128", 1},
    {"mxfp8", "cols=3072,nmax=1,moe=1,act=none,alpha_e6=0,limit_e6=0,beta_e6=0,combine=0,settled=1", "tokens=4",
     "warps=8,rpw=1,unroll=4,cvt=alu,pipe=1,tpc=1,lead=0,lean=0,ksplit=1", "warps=4,rpw=1,unroll=4,cvt=hw,pipe=3,tpc=4,lead=0,lean=0,ksplit=1"},
    {"mxfp8", "cols=8192,nmax=1,moe=0", "tokens=1", "warps=8,rpw=1,unroll=4,cvt=alu,pipe=1,tpc=1,lead=0,lean=0,ksplit=1", "warps=8,rpw=1,unroll=8,cvt=hw,pipe=3,tpc=3,lead=1,lean=0,ksplit=1"},
    {"mxfp8", "w=f32", "tokens=1", "warps=8,rpw=1,unroll=8,cvt=alu,pipe=1,tpc=1,lead=0,lean=0,ksplit=8",
     "warps=4,rpw=1,unroll=4,cvt=alu,pipe=1,tpc=1,lead=0,lean=0,ksplit=1", 1}, /* the router */
    {"swiglu", "inter=3072", "tokens=8", "threads=256", "threads=128", 1}, /* the MoE's: 4 pairs + the shared one */
    {"rmsnorm", "add=0,f32copy=0", "tokens=1", "threads=256,cluster=1", "threads=256,cluster=4", 1},
    {"rmsnorm", "add=1,f32copy=0", "tokens=8", "threads=512,cluster=1", "threads=128,cluster=2", 1},
    {"rmsnorm", "add=1,f32copy=1", "tokens=256", "threads=256,cluster=1", "threads=1024,cluster=1", 1},
    {"rmsnorm", "combine=4", "tokens=1", "threads=256,cluster=1", "threads=128,cluster=8", 1, 0, "norm"}, /* the MoE combine inside */
    {"moe_route", "stage=route", "tokens=8", "warps=4", "warps=2", 1},
    {"moe_route", "stage=group", "tokens=256", "warps=32", "warps=8", 1},
    {"moe_combine", "rowmap=0", "tokens=1", "threads=256", "threads=128", 1},
    {"moe_combine", "rowmap=1", "tokens=256", "threads=256", "threads=512", 1},
    {"embed", "hidden=6144", "tokens=8", "threads=256", "threads=64", 1},
    {"sample", "mode=greedy", "tokens=1", "threads=1024,cap=4096", "threads=256,cap=4096", 1},
    {"sample", "mode=top_p", "tokens=8", "threads=1024,cap=4096", "threads=512,cap=1024", 1},
    {"kv_insert", "kv=e4m3", "tokens=5", "warps=4", "warps=8", 1, 1},
    {"fill", "dtype=bf16", "elems=70000", "threads=256,vec=4", "threads=128,vec=8", 1, 1},
};

/* The minimax-m3 variant of template `name` whose key axes contain `axes`
 * (e.g. "dtype=bf16"), for this GPU's arch, with the model's config. */
static m3_variant model_variant(const char *name, const char *axes, m3_config *cfg) {
  m3_err e;
  ck_assert_msg(m3_config_for("minimax-m3", NULL, cfg, &e) == M3_OK, "%s", e.msg);
  m3_dims dims;
  m3_model_dims(cfg, &dims);
  m3_variant *vs;
  int nv, vi = -1;
  ck_assert_msg(m3_render_variants(g_rt.jit.lua, name, &dims, &vs, &nv, &e) == M3_OK, "%s", e.msg);
  for (int i = 0; i < nv && vi < 0; i++) {
    char kt[M3_KEY_MAX];
    m3_variant_print_axes(&vs[i], kt, sizeof kt);
    if (strstr(kt, axes)) vi = i;
  }
  ck_assert_msg(vi >= 0, "%s: no variant %s", name, axes);
  m3_variant v = vs[vi];
  free(vs);
  snprintf(v.arch, sizeof v.arch, "%s", g_rt.dev.arch);
  return v;
}

/* The tuner's gate (tune.c) by hand, for a `direct` case. */
static void adapter_direct(const adapter_case *c) {
  const m3_tune_op *op = m3_tune_op_find(c->op);
  ck_assert_ptr_nonnull(op);
  m3_config cfg;
  m3_err e;
  m3_variant v = model_variant(c->op, c->variant, &cfg);
  m3_bucket bs[32], b;
  ck_assert_int_eq(op->buckets(&cfg, &v, bs, 32), 0); /* else the tuner case above is the test */
  ck_assert_msg(m3_bucket_parse(c->shapes, &b, &e) == M3_OK, "%s", e.msg);
  void *st = NULL;
  m3_status s = op->setup(&g_rt, &cfg, &v, &b, g_seed, &st, &e);
  ck_assert_msg(s == M3_OK, "%s setup: %s", c->op, e.msg);
  const char *tiles[2] = {c->broken, c->good};
  char hook[160];
  snprintf(hook, sizeof hook, "broken=%s", c->broken);
  setenv("M3KIT_TUNE_TEST_HOOK", hook, 1);
  for (int q = 0; q < 2; q++) {
    m3_variant t = v;
    m3_kernel *k;
    char detail[512] = "";
    ck_assert_msg(m3_variant_parse_tile(&t, tiles[q], &e) == M3_OK, "%s", e.msg);
    GPU_CHECK(m3_rt_kernel(&g_rt, &t, &b, &k, &e_));
    GPU_CHECK(op->prepare(st, 0, &e_));
    GPU_CHECK(op->launch(st, k, 0, &e_));
    s = op->verify(st, detail, sizeof detail, &e);
    printf("  %s %s %s [%s]: %s %s\n", c->op, c->variant, c->shapes, tiles[q], m3_status_name(s), detail);
    if (q == 0) ck_assert_msg(s == M3_MISMATCH, "%s: the broken tile was not rejected (%s)", c->op, m3_status_name(s));
    else ck_assert_msg(s == M3_OK, "%s: the good tile failed: %s %s", c->op, detail, s == M3_MISMATCH ? "" : e.msg);
    for (int rep = 1; rep <= 3; rep++) { /* the timed loop's sets */
      GPU_CHECK(op->prepare(st, rep, &e_));
      GPU_CHECK(op->launch(st, k, rep, &e_));
    }
    ck_assert_int_eq(cudaStreamSynchronize(g_rt.stream), cudaSuccess);
  }
  unsetenv("M3KIT_TUNE_TEST_HOOK");
  ck_assert(op->work(st) > 0);
  op->teardown(st);
}

START_TEST(adapter_rejects_broken_candidate) {
  const adapter_case *c = &ADAPTERS[_i];
  /* Prefill attention at its smallest bucket is ~5e8 multiply-adds a launch:
   * minutes per candidate on the emulator.  The GPU runs it. */
  if (m3_test_emulated() && !c->emu) {
    printf("  %s %s: skipped on the emulator\n", c->op, c->variant);
    return;
  }
  if (c->fuse) setenv("M3KIT_MOE_FUSE", c->fuse, 1); /* the model's variant list (m3_model_dims) */
  if (c->direct) {
    adapter_direct(c);
    unsetenv("M3KIT_MOE_FUSE");
    return;
  }
  char hook[160], tiles[320], db[300];
  snprintf(hook, sizeof hook, "broken=%s", c->broken);
  snprintf(tiles, sizeof tiles, "%s;%s", c->broken, c->good);
  snprintf(db, sizeof db, "%s.%s.%d", dbfile, c->op, _i);
  setenv("M3KIT_TUNE_TEST_HOOK", hook, 1);
  /* Every candidate also timed as a CUDA graph (tune.c): each adapter's
   * launch must be capturable, or this fails.  On a GPU only: replaying
   * 16 launches x 20 times per candidate takes minutes on the emulator,
   * whose graph path the qk-norm case of the test above covers. */
  if (!m3_test_emulated()) setenv("M3KIT_TUNE_GRAPH_US", "1e12", 1);
  m3_tune_opts o = {.preset = "minimax-m3", .only = c->op, .variant = c->variant, .shapes = c->shapes,
                    .tiles = tiles, .reps = 20, .db_path = db};
  m3_tune_result res;
  m3_err e;
  m3_status s = m3_tune_run(&g_rt, &o, &res, &e);
  unsetenv("M3KIT_TUNE_TEST_HOOK");
  unsetenv("M3KIT_TUNE_GRAPH_US");
  unsetenv("M3KIT_MOE_FUSE");
  ck_assert_msg(s == M3_OK, "%s %s: %s", c->op, c->variant, e.msg);
  ck_assert_msg(res.n_rows == 1, "%s %s at %s: %d rows", c->op, c->variant, c->shapes, res.n_rows);
  const m3_tune_row *r = &res.rows[0];
  printf("  %s %s %s: tile %s, %.1f us, %.3g %s (%d passed, %d incorrect, %d failed of %d)\n", c->op, r->key,
         r->bucket, r->tile, r->tuned_us, r->achieved, r->unit, r->n_passed, r->n_incorrect, r->n_failed,
         r->n_candidates);
  ck_assert_int_eq(r->n_candidates, 2);
  ck_assert_msg(r->n_incorrect == 1, "%s: the broken tile was not rejected (%d incorrect)", c->op, r->n_incorrect);
  ck_assert_msg(r->n_passed == 1, "%s: the good tile did not pass (%d passed, %d failed)", c->op, r->n_passed,
                r->n_failed);
  ck_assert_str_eq(r->tile, c->good);
  ck_assert(r->tuned_us > 0 && r->achieved > 0);
  m3_tune_result_free(&res);
  unlink(db);
}
END_TEST

/* One clock per shape (tune.c): asked to (*graph = 1), m3_tune_time_kernel
 * graph-times a kernel whose event median is above the threshold, and says
 * so; told not to (-1), it keeps the event time of one below it; left to the
 * threshold (0), it follows it.  The tuner asks for every
 * candidate of a shape once one was graph-timed: device run 79 compared a
 * tile event-timed at 31 us with ones graph-timed at 8.8 and kept it. */
START_TEST(graph_clock_when_asked) {
  const m3_tune_op *op = m3_tune_op_find("fill");
  ck_assert_ptr_nonnull(op);
  m3_config cfg;
  m3_err e;
  m3_variant v = model_variant("fill", "dtype=bf16", &cfg);
  m3_bucket b;
  ck_assert_msg(m3_bucket_parse("elems=4096", &b, &e) == M3_OK, "%s", e.msg);
  void *st = NULL;
  GPU_CHECK(op->setup(&g_rt, &cfg, &v, &b, g_seed, &st, &e_));
  m3_kernel *k;
  GPU_CHECK(m3_rt_kernel(&g_rt, &v, &b, &k, &e_));
  /* (asked, threshold) -> graph-timed: by the threshold when 0, always when 1, never when -1 */
  static const struct { int ask; const char *below; int want; } cases[] = {
      {0, "1e-6", 0}, {1, "1e-6", 1}, {0, "1e12", 1}, {-1, "1e12", 0}};
  for (int i = 0; i < 4; i++) {
    setenv("M3KIT_TUNE_GRAPH_US", cases[i].below, 1);
    m3_tune_candidate c = {0};
    double ev = 0;
    int g = cases[i].ask;
    GPU_CHECK(m3_tune_time_kernel(&g_rt, op, st, k, 1, 3, 0, &g, &c, &ev, &e_));
    ck_assert_int_eq(c.disposition, M3_DISP_PASSED);
    ck_assert_msg(g == cases[i].want, "asked %d below %s: graph-timed %d", cases[i].ask, cases[i].below, g);
    ck_assert(c.median_us > 0 && ev > 0);
    if (!g) ck_assert(c.median_us == ev); /* the event time stands */
  }
  unsetenv("M3KIT_TUNE_GRAPH_US");
  op->teardown(st);
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
  TCase *clock = tcase_create("clock");
  tcase_set_timeout(clock, 300);
  tcase_add_test(clock, graph_clock_when_asked);
  suite_add_tcase(s, clock);
  TCase *pin = tcase_create("pin");
  tcase_set_timeout(pin, 900);
  tcase_add_test(pin, pinned_tile_kept_within_slack_dropped_when_broken);
  suite_add_tcase(s, pin);
  TCase *ad = tcase_create("adapters");
  tcase_set_timeout(ad, 1800);
  tcase_add_loop_test(ad, adapter_rejects_broken_candidate, 0, (int)(sizeof ADAPTERS / sizeof *ADAPTERS));
  suite_add_tcase(s, ad);
  return s;
}

int main(void) {
  snprintf(dbfile, sizeof dbfile, "/tmp/m3tune-%d.json", (int)getpid());
  return gpu_test_main("check_tune_gpu", make);
}
