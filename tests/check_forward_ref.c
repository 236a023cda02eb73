/* check_forward_ref.c - the whole-model CPU reference (ref/ref_forward.h) on
 * a 4-layer config (1 dense + 3 sparse/MoE, hidden 256, 8 q heads, block 16,
 * top-k 4 blocks, 8 experts), random checkpoint from m3_ckpt_write:
 *   (a) prefill N then decode token N == prefill N+1 (bit for bit: every op
 *       is row-wise, see ref_forward.h), below and above 64 = topk x block;
 *   (b) chunked prefill == unchunked, every token's logits;
 *   (c) context <= topk x block: sparse layers == dense attention layers and
 *       no block is dropped;
 *   (d) e4m3 KV and index caches stay close to bf16;
 *   (e) longer contexts really drop blocks, and then sparse != dense;
 *   plus a batched decode of sequences of different lengths == each alone,
 *   MXFP8 weights, and the admission errors (id >= vocab, position >=
 *   max_position_embeddings, state capacity).  No GPU needed. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>

#include "ref/ref_forward.h"
#include "tests/forward_cfg.h"

#define MAXPOS 512

static m3_config cfg;
static fwd_ckpt ck_bf16, ck_fp8;
static m3_ref_model *model, *model_fp8;
static int32_t prompt[MAXPOS];

#define OK(expr)                                                                  \
  do {                                                                            \
    m3_err err_ = {0};                                                            \
    m3_status s_ = (expr);                                                        \
    ck_assert_msg(s_ == M3_OK, "%s: %s %s", #expr, m3_status_name(s_), err_.msg); \
  } while (0)

static void setup(void) {
  m3_err e = {0};
  m3_status s = fwd_small_config(&cfg, 4, 1, MAXPOS, 0, &e);
  ck_assert_msg(s == M3_OK, "%s", e.msg);
  ck_assert_msg((s = fwd_ckpt_make(&cfg, 0, 1234, &ck_bf16, &e)) == M3_OK, "%s", e.msg);
  ck_assert_msg((s = m3_ref_model_load(&cfg, ck_bf16.k, &model, &e)) == M3_OK, "%s", e.msg);
  uint64_t r = 99;
  for (int i = 0; i < MAXPOS; i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    prompt[i] = (int32_t)((r >> 33) % (uint64_t)cfg.vocab_size);
  }
}

static void teardown(void) {
  m3_ref_model_free(model);
  m3_ref_model_free(model_fp8);
  model = model_fp8 = NULL;
  fwd_ckpt_close(&ck_bf16);
  fwd_ckpt_close(&ck_fp8);
}

static float *logits_buf(int n) { return malloc(sizeof(float) * (size_t)n * (size_t)cfg.vocab_size); }

static m3_ref_state *state(const m3_ref_model *m, int n_seqs, int64_t ctx, int kv8, int ix8) {
  m3_ref_state *s;
  m3_err e = {0};
  m3_status st = m3_ref_state_create(m, n_seqs, ctx, kv8, ix8, &s, &e);
  ck_assert_msg(st == M3_OK, "%s", e.msg);
  return s;
}

/* (a) */
static void prefill_then_decode(int N) {
  const int V = cfg.vocab_size;
  float *a = logits_buf(1), *b = logits_buf(1);
  m3_ref_state *s1 = state(model, 1, MAXPOS, 0, 0), *s2 = state(model, 1, MAXPOS, 0, 0);
  OK(m3_ref_prefill(s1, 0, N, prompt, 0, NULL, NULL, &err_));
  int32_t z = 0;
  OK(m3_ref_step(s1, 1, &z, prompt + N, a, &err_));
  OK(m3_ref_prefill(s2, 0, N + 1, prompt, 0, b, NULL, &err_));
  double d = fwd_max_abs(a, b, (size_t)V);
  ck_assert_msg(d == 0.0, "N=%d: decode vs prefill max |diff| %g (expected bit-identical)", N, d);
  ck_assert_int_eq(s1->seq_lens[0], N + 1);
  m3_ref_state_free(s1);
  m3_ref_state_free(s2);
  free(a);
  free(b);
}

START_TEST(decode_equals_prefill) {
  prefill_then_decode(40);   /* every block selected */
  prefill_then_decode(100);  /* 7 blocks visible, 4 chosen */
}
END_TEST

/* (b) */
START_TEST(chunked_equals_unchunked) {
  const int N = 90, V = cfg.vocab_size;
  float *ref = logits_buf(N), *got = logits_buf(N);
  m3_ref_state *s = state(model, 1, MAXPOS, 0, 0);
  OK(m3_ref_prefill(s, 0, N, prompt, 0, NULL, ref, &err_));
  const int chunks[] = {16, 7, 33, 1};
  for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++) {
    m3_ref_state_reset(s);
    OK(m3_ref_prefill(s, 0, N, prompt, chunks[i], NULL, got, &err_));
    double d = fwd_max_abs(got, ref, (size_t)N * V);
    ck_assert_msg(d == 0.0, "chunk %d: max |diff| %g", chunks[i], d);
  }
  m3_ref_state_free(s);
  free(ref);
  free(got);
}
END_TEST

/* (c) */
START_TEST(short_context_sparse_equals_dense) {
  const int N = 64, V = cfg.vocab_size; /* = topk 4 x block 16 */
  float *sp = logits_buf(N), *de = logits_buf(N);
  m3_ref_state *s = state(model, 1, MAXPOS, 0, 0);
  OK(m3_ref_prefill(s, 0, N, prompt, 0, NULL, sp, &err_));
  /* The last step saw all N tokens: none dropped. */
  ck_assert_int_gt(s->stat_visible_blocks, 0);
  ck_assert_int_eq(s->stat_dropped_blocks, 0);
  m3_ref_state_reset(s);
  s->force_dense = 1;
  OK(m3_ref_prefill(s, 0, N, prompt, 0, NULL, de, &err_));
  /* Same keys; only the order blocks are visited in differs (fp64 softmax
   * sums), so at most a rare last-bit flip of a bf16 attention output. */
  double r = fwd_rel_l2(sp, de, (size_t)N * V);
  ck_assert_msg(r <= 1e-3, "sparse vs dense at <= topk x block: rel %g", r);
  m3_ref_state_free(s);
  free(sp);
  free(de);
}
END_TEST

/* (e) */
START_TEST(long_context_drops_blocks) {
  const int N = 200, V = cfg.vocab_size;
  float *sp = logits_buf(1), *de = logits_buf(1);
  m3_ref_state *s = state(model, 1, MAXPOS, 0, 0);
  OK(m3_ref_prefill(s, 0, N, prompt, 50, sp, NULL, &err_));
  /* Last chunk: positions 150..199 see 10..13 blocks, 4 are kept. */
  ck_assert_int_gt(s->stat_dropped_blocks, s->stat_visible_blocks / 2);
  int32_t z = 0;
  OK(m3_ref_step(s, 1, &z, prompt + N, sp, &err_));
  /* one token, 3 sparse layers, 4 kv heads: 13 visible, 9 dropped each */
  ck_assert_int_eq(s->stat_visible_blocks, 3 * 4 * 13);
  ck_assert_int_eq(s->stat_dropped_blocks, 3 * 4 * 9);
  m3_ref_state_reset(s);
  s->force_dense = 1;
  OK(m3_ref_prefill(s, 0, N + 1, prompt, 50, de, NULL, &err_));
  double r = fwd_rel_l2(sp, de, (size_t)V);
  ck_assert_msg(r > 1e-3, "dropping 9 of 13 blocks changed nothing (rel %g)", r);
  ck_assert_msg(r < 1.0, "sparse and dense differ wildly (rel %g)", r);
  m3_ref_state_free(s);
  free(sp);
  free(de);
}
END_TEST

/* (d) */
START_TEST(e4m3_caches_close_to_bf16) {
  const int N = 120, V = cfg.vocab_size;
  float *b = logits_buf(1), *q = logits_buf(1);
  m3_ref_state *sb = state(model, 1, MAXPOS, 0, 0);
  OK(m3_ref_prefill(sb, 0, N, prompt, 40, b, NULL, &err_));
  const int modes[3][2] = {{0, 1}, {1, 0}, {1, 1}};
  for (int i = 0; i < 3; i++) {
    m3_ref_state *sq = state(model, 1, MAXPOS, modes[i][0], modes[i][1]);
    OK(m3_ref_prefill(sq, 0, N, prompt, 40, q, NULL, &err_));
    double r = fwd_rel_l2(q, b, (size_t)V);
    /* e4m3 keeps 3 mantissa bits (relative step 1/8, rms error ~2%); the
     * index cache alone only perturbs the selection. */
    printf("e4m3 kv=%d idx=%d: logits rel %.4f\n", modes[i][0], modes[i][1], r);
    ck_assert_msg(r < 0.15, "kv e4m3 %d, idx e4m3 %d: logits rel %g", modes[i][0], modes[i][1], r);
    m3_ref_state_free(sq);
  }
  m3_ref_state_free(sb);
  free(b);
  free(q);
}
END_TEST

/* Batched decode: sequences of different lengths in one step == alone. */
START_TEST(batched_decode_equals_single) {
  const int V = cfg.vocab_size, lens[3] = {5, 70, 33};
  m3_ref_state *bat = state(model, 3, MAXPOS, 0, 1);
  for (int q = 0; q < 3; q++) OK(m3_ref_prefill(bat, q, lens[q], prompt + 10 * q, 16, NULL, NULL, &err_));
  int32_t seqs[3] = {2, 0, 1}, ids[3] = {prompt[200], prompt[201], prompt[202]};
  float *lg = logits_buf(3), *one = logits_buf(1);
  OK(m3_ref_step(bat, 3, seqs, ids, lg, &err_));
  for (int t = 0; t < 3; t++) {
    int q = seqs[t];
    m3_ref_state *s = state(model, 1, MAXPOS, 0, 1);
    OK(m3_ref_prefill(s, 0, lens[q], prompt + 10 * q, 0, NULL, NULL, &err_));
    int32_t z = 0;
    OK(m3_ref_step(s, 1, &z, &ids[t], one, &err_));
    double d = fwd_max_abs(lg + (size_t)t * V, one, (size_t)V);
    ck_assert_msg(d == 0.0, "sequence %d in a batch differs from alone by %g", q, d);
    m3_ref_state_free(s);
  }
  ck_assert_int_eq(bat->seq_lens[0], 6);
  ck_assert_int_eq(bat->seq_lens[1], 71);
  ck_assert_int_eq(bat->seq_lens[2], 34);
  m3_ref_state_free(bat);
  free(lg);
  free(one);
}
END_TEST

/* MXFP8 weights: same seed, weights within e4m3 rounding of the bf16 ones. */
START_TEST(mxfp8_weights_close_to_bf16) {
  m3_err e = {0};
  /* Made here, not in the fixture: check forks each test, and the child's
   * scratch directory is removed by this test itself. */
  ck_assert_msg(fwd_ckpt_make(&cfg, 1, 1234, &ck_fp8, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_ref_model_load(&cfg, ck_fp8.k, &model_fp8, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(model_fp8->mxfp8, 1);
  ck_assert_ptr_nonnull(model_fp8->layers[1].qkv.q); /* fused stays MXFP8 */
  const int N = 80, V = cfg.vocab_size;
  float *b = logits_buf(1), *q = logits_buf(1);
  m3_ref_state *sb = state(model, 1, MAXPOS, 0, 0), *sq = state(model_fp8, 1, MAXPOS, 0, 0);
  OK(m3_ref_prefill(sb, 0, N, prompt, 0, b, NULL, &err_));
  OK(m3_ref_prefill(sq, 0, N, prompt, 0, q, NULL, &err_));
  double r = fwd_rel_l2(q, b, (size_t)V);
  printf("mxfp8 weights: logits rel %.4f\n", r);
  ck_assert_msg(r > 0 && r < 0.2, "mxfp8 vs bf16 weights: logits rel %g", r);
  m3_ref_state_free(sb);
  m3_ref_state_free(sq);
  m3_ref_model_free(model_fp8);
  model_fp8 = NULL;
  fwd_ckpt_close(&ck_fp8);
  free(b);
  free(q);
}
END_TEST

START_TEST(admission_errors) {
  m3_err e = {0};
  m3_ref_state *s = state(model, 1, 100, 0, 0);
  int32_t z = 0, bad = cfg.vocab_size;
  ck_assert_int_eq(m3_ref_step(s, 1, &z, &bad, NULL, &e), M3_RANGE);
  ck_assert_ptr_nonnull(strstr(e.msg, "2048"));
  ck_assert_int_eq(s->seq_lens[0], 0);
  OK(m3_ref_prefill(s, 0, 100, prompt, 0, NULL, NULL, &err_));
  ck_assert_int_eq(m3_ref_step(s, 1, &z, prompt, NULL, &e), M3_CAPACITY);
  ck_assert_int_eq(s->seq_lens[0], 100);
  m3_ref_state_free(s);
  /* A state larger than the model's positions: position 512 is rejected. */
  s = state(model, 1, MAXPOS + 16, 0, 0);
  OK(m3_ref_prefill(s, 0, MAXPOS, prompt, 128, NULL, NULL, &err_));
  ck_assert_int_eq(m3_ref_step(s, 1, &z, prompt, NULL, &e), M3_RANGE);
  ck_assert_ptr_nonnull(strstr(e.msg, "max_position_embeddings"));
  m3_ref_state_free(s);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("forward_ref");
  TCase *t = tcase_create("forward");
  tcase_add_unchecked_fixture(t, setup, teardown);
  tcase_set_timeout(t, 600);
  tcase_add_test(t, decode_equals_prefill);
  tcase_add_test(t, chunked_equals_unchunked);
  tcase_add_test(t, short_context_sparse_equals_dense);
  tcase_add_test(t, long_context_drops_blocks);
  tcase_add_test(t, e4m3_caches_close_to_bf16);
  tcase_add_test(t, batched_decode_equals_single);
  tcase_add_test(t, mxfp8_weights_close_to_bf16);
  tcase_add_test(t, admission_errors);
  suite_add_tcase(s, t);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
