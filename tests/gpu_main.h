/* gpu_main.h - the common start of every GPU test program: exit 77 (automake
 * SKIP) when no GPU is present, open the kernel context once, and run check
 * unforked (CUDA contexts do not survive fork). */
#ifndef M3_GPU_MAIN_H
#define M3_GPU_MAIN_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime/cuda_driver.h"
#include "runtime/harness.h"
#include "runtime/kernels.h"

/* 1 in the tests/emu_* programs: kernels run on the CPU emulator (emu/emu.h),
 * so tests shrink their shapes and skip what the emulator cannot model. */
static inline int m3_test_emulated(void) { return m3_driver_label() != NULL; }

extern m3_rt g_rt;
extern uint64_t g_seed;

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
  SRunner *sr = srunner_create(make());
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  m3_rt_close(&g_rt);
  return failed ? 1 : 0;
}

#define GPU_TEST_GLOBALS m3_rt g_rt; uint64_t g_seed;

#endif
