/* gpu_main.h - the common start of every GPU test program: exit 77 (automake
 * SKIP) when no GPU is present, open the kernel context once, and run check
 * unforked (CUDA contexts do not survive fork). */
#ifndef M3_GPU_MAIN_H
#define M3_GPU_MAIN_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/sysinfo.h> /* get_nprocs (unistd.h clashes with a test's dup()) */

#include "runtime/cuda_driver.h"
#include "runtime/harness.h"
#include "runtime/kernels.h"
#include "runtime/log.h"

/* 1 for a reduced run: in the tests/emu_* programs (kernels run on the CPU
 * emulator, emu/emu.h), and on a GPU with M3KIT_SMALL=1 (under
 * compute-sanitizer, which slows kernels 10-100x).  Tests then shrink their
 * shapes and skip the cases that need gigabytes. */
static inline int m3_test_emulated(void) {
  return m3_driver_label() != NULL || m3_env_flag("M3KIT_SMALL");
}

extern m3_rt g_rt;
extern uint64_t g_seed;

/* Per-test wall time, printed as each test ends (CK_VERBOSE prints its
 * result next): on the device every call is time-limited, and a log that
 * only reports at the end says nothing about a run that was cut short. */
#include <time.h>
static double gpu_test_t0_;
static inline double gpu_test_now_(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static inline void gpu_test_setup_(void) { gpu_test_t0_ = gpu_test_now_(); }
static inline void gpu_test_teardown_(void) { printf("  (%.2f s)\n", gpu_test_now_() - gpu_test_t0_); }
static inline TCase *gpu_tcase_create_(const char *name) {
  TCase *tc = (tcase_create)(name);
  tcase_add_checked_fixture(tc, gpu_test_setup_, gpu_test_teardown_);
  return tc;
}
/* Every tcase of a GPU test gets the timing fixture without each file
 * having to ask for it. */
#define tcase_create(name) gpu_tcase_create_(name)

/* One TCase per test (loop test when loops > 0) with the file's once-per-
 * process fixture, so that CK_RUN_CASE=name runs just that test: one case
 * per process is what lets compute-sanitizer's racecheck and initcheck of a
 * whole-model test fit a device call (bench/device-run.sh SANITIZE entries
 * PROGRAM:CASE). */
static inline void gpu_add_case(Suite *s, const char *name, void (*setup)(void), const TTest *test, int loops) {
  TCase *t = tcase_create(name);
  tcase_add_unchecked_fixture(t, setup, NULL);
  tcase_set_timeout(t, m3_test_emulated() ? 3600 : 600);
  if (loops) tcase_add_loop_test(t, test, 0, loops);
  else tcase_add_test(t, test);
  suite_add_tcase(s, t);
}

#define GPU_CHECK(call)                                                        \
  do {                                                                         \
    m3_err e_;                                                                 \
    m3_status s_ = (call);                                                     \
    ck_assert_msg(s_ == M3_OK, "%s: %s: %s", #call, m3_status_name(s_), e_.msg); \
  } while (0)

/* `call` may use `e_` as its m3_err*: GPU_CHECK(m3_dev_alloc(&p, n, &e_)). */

static inline int gpu_test_main(const char *name, Suite *(*make)(void)) {
#if defined(__SANITIZE_ADDRESS__)
  if (m3_test_emulated()) {
    printf("%s: the CPU emulator's fiber stacks are not AddressSanitizer-clean: skipping (exit 77)\n", name);
    return 77;
  }
#endif
  if (m3_gpu_count() == 0) {
    printf("%s: no CUDA GPU on this machine: skipping (exit 77)\n", name);
    return 77;
  }
  m3_err e;
  m3_status s = m3_rt_open(&g_rt, 0, &e);
  if (s != M3_OK) {
    fprintf(stderr, "%s: cannot open GPU: %s\n", name, e.msg);
    return 1;
  }
  g_seed = m3_test_seed();
  printf("%s on %s (%s, %d SMs), seed %llu (set M3KIT_SEED to repeat)\n", name, g_rt.dev.name, g_rt.dev.arch,
         g_rt.dev.sm_count, (unsigned long long)g_seed);
  setvbuf(stdout, NULL, _IOLBF, 0);
  SRunner *sr = srunner_create(make());
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_set_log(sr, "-"); /* each result as its test ends */
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  m3_rt_close(&g_rt);
  return failed ? 1 : 0;
}

/* Every valid tile of v0 on this GPU, as tile strings in *out (caller
 * frees); returns how many. */
static inline int gpu_valid_tiles(const m3_variant *v0, char (**out)[256]) {
  m3_variant v = *v0, *tiles;
  int n;
  m3_err e;
  snprintf(v.arch, sizeof v.arch, "%s", g_rt.dev.arch);
  ck_assert_msg(m3_render_tiles(g_rt.jit.lua, &v, &tiles, &n, &e) == M3_OK, "%s", e.msg);
  *out = malloc(sizeof **out * (size_t)(n ? n : 1));
  ck_assert_ptr_nonnull(*out);
  int m = 0;
  for (int i = 0; i < n; i++) {
    if (m3_render_valid(g_rt.jit.lua, &tiles[i], NULL, 0, &e) != M3_OK) continue;
    m3_variant_print_tile(&tiles[i], (*out)[m++], 256);
  }
  free(tiles);
  return m;
}

/* Compile v0 at each of the n tiles into the cubin cache, in parallel
 * (m3_jit_build_many, one compiler a core), so that the launches that follow
 * find them there.  Compiled one at a time by the launches, the W8A16 GEMV's
 * few hundred tiles took over 250 s of a device call (run 20), the attention
 * tiles over 200 s (run 38).  A build that fails here fails again, with its
 * message, where the case launches it. */
static inline void gpu_prewarm_tiles(const m3_variant *v0, char (*tiles)[256], int n) {
  m3_jit_job *jobs = calloc((size_t)(n ? n : 1), sizeof *jobs);
  ck_assert_ptr_nonnull(jobs);
  m3_err e;
  for (int i = 0; i < n; i++) {
    m3_variant v = *v0;
    snprintf(v.arch, sizeof v.arch, "%s", g_rt.dev.arch);
    if (m3_variant_parse_tile(&v, tiles[i], &e) != M3_OK || m3_render_canon(g_rt.jit.lua, &v, &e) != M3_OK ||
        m3_render_source(g_rt.jit.lua, &v, &jobs[i].src, &e) != M3_OK)
      continue;
    jobs[i].v = v;
    jobs[i].rendered = 1;
  }
  const int ncpu = get_nprocs();
  m3_jit_build_many(&g_rt.jit, jobs, n, ncpu > 0 ? ncpu : 2, 120);
  int timed_out = 0;
  for (int i = 0; i < n; i++) {
    if (jobs[i].status == M3_TIMEOUT) timed_out = 1;
    else if (jobs[i].rendered) m3_source_free(&jobs[i].src);
  }
  if (!timed_out) free(jobs); /* else left to the detached builds (jit.h) */
}

#define GPU_TEST_GLOBALS m3_rt g_rt; uint64_t g_seed;

#endif
