/* check_tp_comm.c - NCCL for tensor parallelism (runtime/tp_comm.h): the
 * library loads from the CUDA toolkit and reports a 2.x version (no GPU
 * needed); with a GPU, a one-rank communicator all-reduces in place and
 * leaves the values bit for bit (a sum over one rank), and with two GPUs the
 * ranks' buffers sum.  The GPU parts print why they are skipped. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "m3config.h"
#include "runtime/tp_comm.h"

START_TEST(nccl_loads) {
  m3_tp_comm c;
  m3_err e;
  m3_status s = m3_tp_comm_load(&c, &e);
  ck_assert_msg(s == M3_OK, "%s", e.msg);
  printf("NCCL %d.%d.%d from %s\n", c.version / 10000, c.version / 100 % 100, c.version % 100, c.lib);
  ck_assert_int_ge(c.version, 20000);
}
END_TEST

static int gpus(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

START_TEST(allreduce_ranks) {
  const int want = _i + 1, have = gpus();
  if (have < want) {
    printf("all-reduce over %d rank(s): skipped, %d GPU(s)\n", want, have);
    return;
  }
  m3_tp_comm c;
  m3_err e;
  ck_assert_msg(m3_tp_comm_load(&c, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_tp_comm_init(&c, want, &e) == M3_OK, "%s", e.msg);
  const size_t n = (size_t)1 << 20;
  float *h = malloc(sizeof *h * n), *got = malloc(sizeof *got * n), *d[8];
  cudaStream_t st[8];
  for (size_t i = 0; i < n; i++) h[i] = (float)((i * 2654435761u) % 1000) / 64.0f - 7.0f; /* exact in fp32 sums */
  for (int r = 0; r < want; r++) {
    ck_assert_int_eq(cudaSetDevice(r), cudaSuccess);
    ck_assert_int_eq(cudaStreamCreate(&st[r]), cudaSuccess);
    ck_assert_int_eq(cudaMalloc((void **)&d[r], sizeof(float) * n), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(d[r], h, sizeof(float) * n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ck_assert_msg(m3_tp_allreduce_f32(&c, d, n, st, &e) == M3_OK, "%s", e.msg);
  for (int r = 0; r < want; r++) {
    ck_assert_int_eq(cudaSetDevice(r), cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(st[r]), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(got, d[r], sizeof(float) * n, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < n; i++)
      ck_assert_msg(got[i] == (float)want * h[i], "rank %d of %d: element %zu is %g, want %g", r, want, i,
                    (double)got[i], (double)want * h[i]);
    cudaFree(d[r]);
    cudaStreamDestroy(st[r]);
  }
  m3_tp_comm_free(&c);
  free(h);
  free(got);
}
END_TEST

START_TEST(refusals) {
  m3_tp_comm c;
  m3_err e;
  memset(&c, 0, sizeof c);
  ck_assert_int_eq(m3_tp_allreduce_f32(&c, NULL, 1, NULL, &e), M3_INVAL);
  ck_assert_msg(m3_tp_comm_load(&c, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(m3_tp_comm_init(&c, 0, &e), M3_INVAL);
  ck_assert_int_eq(m3_tp_comm_init(&c, 9, &e), M3_INVAL);
  if (gpus() < 8) ck_assert_int_eq(m3_tp_comm_init(&c, 8, &e), M3_CUDA); /* names the GPU count */
}
END_TEST

int main(void) {
#ifndef M3_HAVE_NCCL_H
  printf("check_tp_comm: built without nccl.h: skipped\n");
  return 77;
#endif
  Suite *s = suite_create("tp_comm");
  TCase *tc = tcase_create("tp_comm");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, nccl_loads);
  tcase_add_loop_test(tc, allreduce_ranks, 0, 2);
  tcase_add_test(tc, refusals);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
