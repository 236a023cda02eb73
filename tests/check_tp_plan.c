/* check_tp_plan.c - the tensor-parallel cut (runtime/tp_plan.h) on the
 * released config and the tiny preset: every query head, KV head,
 * intermediate column and lm_head row lands on the ranks it should (exactly
 * once, or on tp/nkv ranks for a replicated KV head), a rank's query heads
 * map to the KV heads it holds (GQA), the per-rank cache bytes match spec
 * §9.3, the per-rank weights shrink with tp, and configs that cannot be cut
 * are refused naming the field. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/config.h"
#include "runtime/tp_plan.h"

static m3_config m3, tiny;

static void setup(void) {
  m3_err e;
  ck_assert_msg(m3_config_preset("minimax-m3", &m3, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_config_preset("tiny", &tiny, &e) == M3_OK, "%s", e.msg);
}

/* Covering of [0, n) by the ranks' [start, start + width) slices. */
static void covers(const char *what, int tp, const int *start, const int *width, int n, int copies) {
  int *hit = calloc((size_t)n, sizeof *hit);
  for (int r = 0; r < tp; r++)
    for (int i = start[r]; i < start[r] + width[r]; i++) {
      ck_assert_msg(i >= 0 && i < n, "tp %d rank %d: %s index %d outside [0, %d)", tp, r, what, i, n);
      hit[i]++;
    }
  for (int i = 0; i < n; i++)
    ck_assert_msg(hit[i] == copies, "tp %d: %s %d held by %d ranks, want %d", tp, what, i, hit[i], copies);
  free(hit);
}

static void check_cut(const m3_config *c, int tp) {
  m3_tp_rank p[M3_TP_MAX];
  m3_err e;
  int q0[M3_TP_MAX] = {0}, qn[M3_TP_MAX] = {0}, k0[M3_TP_MAX] = {0}, kn[M3_TP_MAX] = {0}, d0[M3_TP_MAX] = {0},
      dn[M3_TP_MAX] = {0}, x0[M3_TP_MAX] = {0}, xn[M3_TP_MAX] = {0}, s0[M3_TP_MAX] = {0}, sn[M3_TP_MAX] = {0},
      v0[M3_TP_MAX] = {0}, vn[M3_TP_MAX] = {0};
  for (int r = 0; r < tp; r++) {
    ck_assert_msg(m3_tp_plan(c, tp, r, &p[r], &e) == M3_OK, "tp %d rank %d: %s", tp, r, e.msg);
    q0[r] = p[r].q_head0, qn[r] = p[r].n_q_heads, k0[r] = p[r].kv_head0, kn[r] = p[r].n_kv_heads;
    d0[r] = p[r].dense_i0, dn[r] = p[r].dense_n, x0[r] = p[r].moe_i0, xn[r] = p[r].moe_n;
    s0[r] = p[r].shared_i0, sn[r] = p[r].shared_n, v0[r] = p[r].vocab0, vn[r] = p[r].vocab_n;
    /* GQA: every query head of the rank reads a KV head the rank holds */
    const int G = c->num_attention_heads / c->num_key_value_heads;
    for (int h = p[r].q_head0; h < p[r].q_head0 + p[r].n_q_heads; h++)
      ck_assert_msg(h / G >= p[r].kv_head0 && h / G < p[r].kv_head0 + p[r].n_kv_heads,
                    "tp %d rank %d: query head %d needs KV head %d, holds %d..%d", tp, r, h, h / G, p[r].kv_head0,
                    p[r].kv_head0 + p[r].n_kv_heads - 1);
    ck_assert_int_eq(p[r].allreduce_per_layer, tp > 1 ? 2 : 0);
    ck_assert_uint_eq(p[r].kv_bytes_per_token, m3_tp_kv_bytes_per_token(c, tp, 2, 2));
  }
  const int reps = tp > c->num_key_value_heads ? tp / c->num_key_value_heads : 1;
  covers("query head", tp, q0, qn, c->num_attention_heads, 1);
  covers("KV head", tp, k0, kn, c->num_key_value_heads, reps);
  covers("dense MLP column", tp, d0, dn, c->dense_intermediate_size, 1);
  covers("expert column", tp, x0, xn, c->intermediate_size, 1);
  covers("shared-expert column", tp, s0, sn, m3_config_shared_width(c), 1);
  covers("lm_head row", tp, v0, vn, c->vocab_size, 1);
  for (int r = 0; r < tp; r++) ck_assert_int_eq(p[r].kv_replicas, reps);
}

START_TEST(every_part_once) {
  static const int tps[] = {1, 2, 4, 8, 16};
  check_cut(&m3, tps[_i]);
  if (tps[_i] <= 2) check_cut(&tiny, tps[_i]); /* tiny: intermediate 64 = 32 x 2 at most */
  m3_tp_rank p;
  m3_err e;
  if (tps[_i] > 2) ck_assert_int_eq(m3_tp_plan(&tiny, tps[_i], 0, &p, &e), M3_INVAL);
}
END_TEST

/* Spec §9.3: 137,472 B per token on one GPU (bf16), 45,312 B per rank at TP=4
 * (main KV / 4, index-K whole), and e4m3 halves both. */
START_TEST(cache_bytes_per_rank) {
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 1, 2, 2), 137472);
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 1, 1, 1), 68736);
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 4, 2, 2), 60 * 512 + 57 * 256);
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 8, 2, 2), 60 * 512 + 57 * 256); /* KV heads replicated beyond 4 */
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 2, 2, 2), 60 * 1024 + 57 * 256);
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 3, 2, 2), 0);
  ck_assert_uint_eq(m3_tp_kv_bytes_per_token(&m3, 1, 2, 2), m3_config_kv_bytes_per_token_model(&m3, 2, 2));
}
END_TEST

/* Weights: MXFP8 on one GPU is the ~444 GB of the release (427B parameters at
 * 1 + 1/32 B, the bf16 embedding and lm_head); a rank of 4 or 8 holds its
 * share plus the replicated parts, so 4 x H200 (141 GB) fit the model. */
START_TEST(weight_bytes_per_rank) {
  m3_config c = m3;
  snprintf(c.quant_method, sizeof c.quant_method, "mxfp8");
  m3_tp_rank r1, r4, r8;
  m3_err e;
  ck_assert_int_eq(m3_tp_plan(&c, 1, 0, &r1, &e), M3_OK);
  ck_assert_int_eq(m3_tp_plan(&c, 4, 3, &r4, &e), M3_OK);
  ck_assert_int_eq(m3_tp_plan(&c, 8, 7, &r8, &e), M3_OK);
  printf("MXFP8 weights: tp 1 %.1f GB, tp 4 %.1f GB a rank, tp 8 %.1f GB a rank\n", r1.weight_bytes / 1e9,
         r4.weight_bytes / 1e9, r8.weight_bytes / 1e9);
  ck_assert_msg(r1.weight_bytes > 420e9 && r1.weight_bytes < 470e9, "tp 1: %.1f GB", r1.weight_bytes / 1e9);
  ck_assert(r4.weight_bytes > r1.weight_bytes / 4 && r4.weight_bytes < 141e9);
  ck_assert(r8.weight_bytes > r1.weight_bytes / 8 && r8.weight_bytes < r4.weight_bytes);
  /* one routed expert's slice over the 57 MoE layers: w1 + w3 + w2 of
   * 3072 / 4 rows (columns) at 1 + 1/32 B; 128 of them are most of a rank */
  ck_assert_uint_eq(r4.expert_bytes, 57ull * 3 * 6144 * 768 * 33 / 32);
  ck_assert_uint_eq(r8.expert_bytes * 2, r4.expert_bytes);
  ck_assert(128 * r4.expert_bytes < r4.weight_bytes && 128 * r4.expert_bytes > r4.weight_bytes * 9 / 10);
  m3_tp_rank b1;
  ck_assert_int_eq(m3_tp_plan(&m3, 1, 0, &b1, &e), M3_OK); /* the preset itself: bf16 */
  ck_assert(b1.weight_bytes > r1.weight_bytes * 19 / 10);
}
END_TEST

START_TEST(refused_naming_the_field) {
  m3_tp_rank p;
  m3_err e;
  ck_assert_int_eq(m3_tp_plan(&m3, 3, 0, &p, &e), M3_INVAL);
  ck_assert_ptr_nonnull(strstr(e.msg, "num_attention_heads"));
  ck_assert_int_eq(m3_tp_plan(&m3, 64, 0, &p, &e), M3_INVAL); /* 3072 / 64 = 48: not whole blocks of 32 */
  ck_assert_ptr_nonnull(strstr(e.msg, "intermediate_size"));
  ck_assert_int_eq(m3_tp_plan(&m3, 0, 0, &p, &e), M3_INVAL);
  ck_assert_int_eq(m3_tp_plan(&m3, 4, 4, &p, &e), M3_INVAL);
  ck_assert_int_eq(m3_tp_plan(&m3, M3_TP_MAX + 1, 0, &p, &e), M3_INVAL);
  m3_config c = m3;
  c.num_key_value_heads = 8; /* 8 KV heads, 16 ranks: 2 replicas each - fine; 12 ranks: neither */
  ck_assert_int_eq(m3_tp_plan(&c, 16, 0, &p, &e), M3_OK);
  c.num_attention_heads = 96;
  ck_assert_int_eq(m3_tp_plan(&c, 12, 0, &p, &e), M3_INVAL);
  ck_assert_ptr_nonnull(strstr(e.msg, "num_key_value_heads"));
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("tp_plan");
  TCase *tc = tcase_create("tp_plan");
  tcase_add_unchecked_fixture(tc, setup, NULL);
  tcase_add_loop_test(tc, every_part_once, 0, 5);
  tcase_add_test(tc, cache_bytes_per_rank);
  tcase_add_test(tc, weight_bytes_per_rank);
  tcase_add_test(tc, refused_naming_the_field);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
