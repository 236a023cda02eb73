/* check_kv_cache.c - the KV cache's planning, admission and page
 * bookkeeping without a GPU (host_only): the §9.3 byte counts, the page size
 * == sparse_block_size rule (known-faults #10), admission past
 * max_position_embeddings (#24), M3_CAPACITY messages naming the numbers,
 * and slot arithmetic over scrambled pages. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/kv_cache.h"

static m3_config real, tiny;

static void setup(void) {
  m3_err e;
  ck_assert_int_eq(m3_config_preset("minimax-m3", &real, &e), M3_OK);
  ck_assert_int_eq(m3_config_preset("tiny", &tiny, &e), M3_OK);
}

START_TEST(bytes_per_token_match_spec) {
  m3_err e;
  m3_kv_plan p;
  m3_kv_opts o = {.max_seqs = 1, .max_ctx = 1 << 20};
  ck_assert_int_eq(m3_kv_plan_make(&real, &o, UINT64_MAX, &p, &e), M3_OK);
  ck_assert_uint_eq(p.bytes_per_token, 137472); /* §9.3: 60 main + 57 index, bf16 */
  ck_assert_uint_eq(p.bytes, 137472ull * 1048576ull);
  ck_assert_int_eq(p.pages_per_seq, 8192);
  o.kv_e4m3 = o.idx_e4m3 = 1;
  ck_assert_int_eq(m3_kv_plan_make(&real, &o, UINT64_MAX, &p, &e), M3_OK);
  ck_assert_uint_eq(p.bytes_per_token, 68736);
}
END_TEST

START_TEST(page_size_must_equal_block_size) {
  m3_err e;
  m3_kv_plan p;
  int bad[] = {64, 256};
  for (int i = 0; i < 2; i++) {
    m3_kv_opts o = {.max_seqs = 1, .max_ctx = 4096, .page_size = bad[i]};
    ck_assert_int_eq(m3_kv_plan_make(&real, &o, UINT64_MAX, &p, &e), M3_CONFIG);
    char want[32];
    snprintf(want, sizeof want, "page size %d", bad[i]);
    ck_assert_ptr_nonnull(strstr(e.msg, want));
    ck_assert_ptr_nonnull(strstr(e.msg, "sparse_block_size 128"));
  }
  m3_kv_opts ok = {.max_seqs = 1, .max_ctx = 4096, .page_size = 128};
  ck_assert_int_eq(m3_kv_plan_make(&real, &ok, UINT64_MAX, &p, &e), M3_OK);
  ck_assert_int_eq(p.page_size, 128);
}
END_TEST

START_TEST(context_beyond_max_position_rejected) {
  m3_err e;
  m3_kv_plan p;
  m3_kv_opts o = {.max_seqs = 1, .max_ctx = (1 << 20) + 1};
  ck_assert_int_eq(m3_kv_plan_make(&real, &o, UINT64_MAX, &p, &e), M3_RANGE);
  ck_assert_ptr_nonnull(strstr(e.msg, "max_position_embeddings 1048576"));
}
END_TEST

START_TEST(capacity_error_names_the_numbers) {
  m3_err e;
  m3_kv_plan p;
  m3_kv_opts o = {.max_seqs = 2, .max_ctx = 1 << 20, .reserve_bytes = 1000};
  ck_assert_int_eq(m3_kv_plan_make(&real, &o, 100000000000ull, &p, &e), M3_CAPACITY);
  ck_assert_ptr_nonnull(strstr(e.msg, "1048576 tokens x 2 sequences"));
  ck_assert_ptr_nonnull(strstr(e.msg, "137472 bytes per token"));
  ck_assert_ptr_nonnull(strstr(e.msg, "100000000000 bytes"));
  ck_assert_ptr_nonnull(strstr(e.msg, "at most 727420 tokens fit")); /* (1e11 - 1000) / 137472 */
}
END_TEST

START_TEST(admission_and_slots) {
  m3_err e;
  m3_kv_cache kv;
  m3_kv_opts o = {.max_seqs = 3, .max_ctx = 100, .host_only = 1};
  ck_assert_int_eq(m3_kv_init_with(&kv, &tiny, &o, UINT64_MAX, &e), M3_OK);
  const int bs = tiny.sparse_block_size; /* 16 */
  ck_assert_int_eq(kv.plan.pages_per_seq, 7);
  ck_assert_int_eq(kv.plan.num_pages, 21);
  int a, b, c, d;
  ck_assert_int_eq(m3_kv_admit(&kv, 101, &a, &e), M3_CAPACITY);
  ck_assert_int_eq(m3_kv_admit(&kv, 0, &a, &e), M3_RANGE);
  ck_assert_int_eq(m3_kv_admit(&kv, 100, &a, &e), M3_OK);
  ck_assert_int_eq(m3_kv_admit(&kv, 17, &b, &e), M3_OK);
  ck_assert_int_eq(m3_kv_admit(&kv, 50, &c, &e), M3_OK);
  ck_assert_int_eq(m3_kv_admit(&kv, 1, &d, &e), M3_CAPACITY); /* slots full */
  ck_assert_int_eq(kv.n_free, 21 - 7 - 2 - 4);
  /* pages are distinct across sequences */
  int seen[21] = {0};
  for (int s = 0; s < 3; s++)
    for (int i = 0; i < 7; i++) {
      int32_t pg = kv.block_table[s * 7 + i];
      if (pg < 0) continue;
      ck_assert_int_lt(pg, 21);
      ck_assert_int_eq(seen[pg]++, 0);
    }
  int64_t pos[40], slot[40];
  ck_assert_int_eq(m3_kv_append(&kv, b, 17, pos, slot, &e), M3_OK);
  for (int i = 0; i < 17; i++) {
    ck_assert_int_eq(pos[i], i);
    ck_assert_int_eq(slot[i], (int64_t)kv.block_table[b * 7 + i / bs] * bs + i % bs);
  }
  ck_assert_int_eq(m3_kv_append(&kv, b, 1, pos, slot, &e), M3_CAPACITY);
  ck_assert_int_eq(kv.seq_lens[b], 17);
  m3_kv_release(&kv, b);
  ck_assert_int_eq(kv.n_free, 21 - 7 - 4);
  ck_assert_int_eq(m3_kv_append(&kv, b, 1, pos, slot, &e), M3_INVAL);
  ck_assert_int_eq(m3_kv_admit(&kv, 100, &d, &e), M3_OK);
  ck_assert_int_eq(d, b);
  m3_kv_free(&kv);
}
END_TEST

START_TEST(shared_pool_runs_out_of_pages) {
  m3_err e;
  m3_kv_cache kv;
  m3_kv_opts o = {.max_seqs = 4, .max_ctx = 64, .num_pages = 6, .host_only = 1};
  ck_assert_int_eq(m3_kv_init_with(&kv, &tiny, &o, UINT64_MAX, &e), M3_OK);
  int a, b;
  ck_assert_int_eq(m3_kv_admit(&kv, 64, &a, &e), M3_OK); /* 4 pages */
  ck_assert_int_eq(m3_kv_admit(&kv, 48, &b, &e), M3_CAPACITY);
  ck_assert_ptr_nonnull(strstr(e.msg, "needs 3 pages, 2 of 6 are free"));
  ck_assert_int_eq(m3_kv_admit(&kv, 32, &b, &e), M3_OK);
  m3_kv_free(&kv);
}
END_TEST

int main(void) {
  Suite *s = suite_create("kv_cache");
  TCase *t = tcase_create("plan");
  tcase_add_unchecked_fixture(t, setup, NULL);
  tcase_add_test(t, bytes_per_token_match_spec);
  tcase_add_test(t, page_size_must_equal_block_size);
  tcase_add_test(t, context_beyond_max_position_rejected);
  tcase_add_test(t, capacity_error_names_the_numbers);
  tcase_add_test(t, admission_and_slots);
  tcase_add_test(t, shared_pool_runs_out_of_pages);
  suite_add_tcase(s, t);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
