/* check_prefetch.c - the L2 prefetch's plan (runtime/op_prefetch.h) without a
 * GPU: over many region sizes, wants and chunks, the items stay inside the
 * region, start on 16-byte boundaries, cover what was asked (and less than
 * one chunk more), and are spread over the whole region rather than packed
 * at its start (the GEMV's CTAs each own rows all over it); the default
 * bytes a phase; the values M3KIT_L2_PREFETCH takes.  The kernel's
 * effect on values (none) is checked on the GPU and the emulator by
 * check_forward_gpu's case l2_prefetch. */
#include <check.h>
#include <stdint.h>
#include <string.h>

#include "runtime/op_prefetch.h"

/* bytes the kernel touches: item i is [i*stride, i*stride + chunk) clipped to T */
static int64_t covered(const m3_prefetch_plan *p, int64_t T) {
  int64_t sum = 0;
  for (int64_t i = 0; i < p->n; i++) {
    const int64_t off = i * p->stride, len = off + p->chunk <= T ? p->chunk : T - off;
    ck_assert_msg(off < T && len > 0, "item %lld at %lld is outside the %lld-byte region", (long long)i,
                  (long long)off, (long long)T);
    sum += len;
  }
  return sum;
}

START_TEST(plan_covers_and_spreads) {
  static const int64_t totals[] = {0, 15, 16, 1000, 4096, 65536, 65552, 1 << 20, 50331648, 56623104, 2458386432LL};
  static const int64_t wants[] = {0, 1, 16, 17, 40000, 65536, 1 << 20, 8 << 20, 16 << 20, 24 << 20, 1LL << 40};
  static const int64_t chunks[] = {16, 4096, 65536, 1 << 30};
  int planned = 0;
  for (size_t a = 0; a < sizeof totals / sizeof *totals; a++)
    for (size_t b = 0; b < sizeof wants / sizeof *wants; b++)
      for (size_t c = 0; c < sizeof chunks / sizeof *chunks; c++) {
        m3_prefetch_plan p;
        m3_err e = {0};
        const int64_t total = totals[a], want = wants[b], T = total / 16 * 16;
        if ((want < T ? want : T) / chunks[c] > (1 << 16)) continue; /* more items than a test should walk */
        ck_assert_msg(m3_prefetch_plan_for(total, want, chunks[c], &p, &e) == M3_OK, "%s", e.msg);
        if (!T || !want) {
          ck_assert_int_eq(p.n, 0);
          continue;
        }
        planned++;
        ck_assert(p.n > 0 && p.chunk > 0 && p.chunk % 16 == 0 && p.stride % 16 == 0 && p.chunk <= chunks[c]);
        ck_assert(p.n == 1 || p.stride >= p.chunk); /* no byte twice */
        const int64_t got = covered(&p, T), need = want < T ? want : T;
        ck_assert_msg(got >= need && got < need + p.chunk, "total %lld want %lld chunk %lld: covers %lld",
                      (long long)total, (long long)want, (long long)chunks[c], (long long)got);
        /* spread: the last item ends in the region's last stride (less the
         * stride's rounding down to 16 bytes, n - 1 times), so no part of the
         * region is farther from an item than another */
        if (p.n > 1) {
          const int64_t end = (p.n - 1) * p.stride + p.chunk;
          ck_assert_msg(end > T - p.stride - 16 * (p.n - 1) || p.stride == p.chunk, "total %lld want %lld: items end at %lld",
                        (long long)total, (long long)want, (long long)end);
        }
      }
  ck_assert_int_gt(planned, 100);
}
END_TEST

START_TEST(plan_refuses_bad_arguments) {
  static const int64_t bad[][3] = {{-1, 16, 16}, {16, -1, 16}, {16, 16, 0}, {16, 16, 8}, {16, 16, 24},
                                   {16, 16, (1LL << 30) + 16}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    m3_prefetch_plan p = {1, 1, 1};
    m3_err e = {0};
    ck_assert_int_eq(m3_prefetch_plan_for(bad[i][0], bad[i][1], bad[i][2], &p, &e), M3_INVAL);
    ck_assert_int_eq(p.n, 0);
    ck_assert_ptr_nonnull(strstr(e.msg, "l2 prefetch"));
  }
}
END_TEST

/* The default (M3KIT_L2_PREFETCH unset), as measured in device runs 84-88:
 * nothing before sm_90; o_proj 24 MB up to 320K tokens and none beyond
 * (the indexer in its window keeps DRAM busy at 384K); the FFN 16 MB at
 * every context; never the qkv phase (its window is one norm long). */
START_TEST(default_bytes_follow_the_measurements) {
  const int64_t MB = 1 << 20;
  static const int64_t ctxs[] = {0, 8320, 131200, 262272, 327680, 327681, 393344, 1048704};
  for (size_t i = 0; i < sizeof ctxs / sizeof *ctxs; i++) {
    const int64_t c = ctxs[i];
    for (int ph = 0; ph < M3_PF_PHASES; ph++) {
      ck_assert_int_eq(m3_prefetch_default_bytes(80, ph, c), 0);
      ck_assert_int_eq(m3_prefetch_default_bytes(89, ph, c), 0);
    }
    ck_assert_int_eq(m3_prefetch_default_bytes(90, M3_PF_OPROJ, c), c <= 327680 ? 24 * MB : 0);
    ck_assert_int_eq(m3_prefetch_default_bytes(90, M3_PF_FFN, c), 16 * MB);
    ck_assert_int_eq(m3_prefetch_default_bytes(90, M3_PF_QKV, c), 0);
    ck_assert_int_eq(m3_prefetch_default_bytes(100, M3_PF_FFN, c), 16 * MB);
  }
}
END_TEST

/* M3KIT_L2_PREFETCH's values (m3_prefetch_parse): MiB, one or three
 * decimal integers in [0, 256]; nothing else passes (m3kit refuses a bad
 * value before any command, the forward when it is created). */
START_TEST(parse_values) {
  const int64_t MB = 1 << 20;
  static const struct { const char *v; int64_t o, f, q; } good[] = {
      {"0", 0, 0, 0}, {"256", 256, 256, 256}, {"24,16,0", 24, 16, 0}, {"0,0,7", 0, 0, 7}, {"08", 8, 8, 8},
      {"000000000000000000000000000005", 5, 5, 5}};
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    int64_t out[M3_PF_PHASES] = {-1, -1, -1};
    int dflt = -1;
    m3_err e = {0};
    ck_assert_msg(m3_prefetch_parse(good[i].v, out, &dflt, &e) == M3_OK, "'%s': %s", good[i].v, e.msg);
    ck_assert_int_eq(dflt, 0);
    ck_assert_int_eq(out[M3_PF_OPROJ], good[i].o * MB);
    ck_assert_int_eq(out[M3_PF_FFN], good[i].f * MB);
    ck_assert_int_eq(out[M3_PF_QKV], good[i].q * MB);
  }
  static const char *bad[] = {"257", "-1", "-0", "+5", " 5", "5 ", "0x10", "1.5", "abc", "1,2", "1,2,3,",
                              "1,2,3,4", ",1,2", "1,,2", "99999999999999999999999", "24;16;0"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    int64_t out[M3_PF_PHASES];
    int dflt = -1;
    m3_err e = {0};
    ck_assert_msg(m3_prefetch_parse(bad[i], out, &dflt, &e) == M3_INVAL, "'%s' was accepted", bad[i]);
    ck_assert_msg(strstr(e.msg, "M3KIT_L2_PREFETCH") && strstr(e.msg, bad[i]), "'%s': %s", bad[i], e.msg);
  }
  for (int i = 0; i < 2; i++) {
    int64_t out[M3_PF_PHASES] = {-1, -1, -1};
    int dflt = 0;
    m3_err e = {0};
    ck_assert_int_eq(m3_prefetch_parse(i ? "" : NULL, out, &dflt, &e), M3_OK);
    ck_assert_int_eq(dflt, 1);
    ck_assert(out[0] == 0 && out[1] == 0 && out[2] == 0);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("prefetch");
  TCase *tc = tcase_create("plan");
  tcase_add_test(tc, plan_covers_and_spreads);
  tcase_add_test(tc, plan_refuses_bad_arguments);
  tcase_add_test(tc, default_bytes_follow_the_measurements);
  tcase_add_test(tc, parse_values);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
