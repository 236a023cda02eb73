/* check_ref.c - CPU tests of the plain-C references (ref/ref.h).  They pin the
 * references to the spec and to the numbers of shared/cases/known-faults.md
 * (faults 2, 3, 6, 8, 14, 17, 18, 20-24), so the GPU kernels, the autotuner
 * and the whole-model test inherit a checked truth.  No GPU needed. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ref.h"

/* ---- helpers -------------------------------------------------------------- */

static float bf16_ulp(float x) {
  int ex;
  frexpf(fabsf(x), &ex);
  return ldexpf(1.0f, ex - 1 - 7);
}

#define ASSERT_ULP(got, want, n)                                                \
  ck_assert_msg(fabsf((got) - (want)) <= (n) * bf16_ulp(want),                  \
                "%s = %.6f, want %.6f (+-%d bf16 ulp)", #got, (double)(got),    \
                (double)(want), (n))

#define ASSERT_OK(expr)                                                         \
  do {                                                                         \
    m3_err err_ = {0};                                                         \
    m3_status s_ = (expr);                                                     \
    ck_assert_msg(s_ == M3_OK, "%s: %s %s", #expr, m3_status_name(s_), err_.msg); \
  } while (0)

static uint64_t rng_state = 0x1234;
static float frand(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng_state >> 40) * 0x1p-24) * 2.0f - 1.0f;
}

static float bf(m3_bf16 h) { return m3_bf16_to_f32(h); }
static m3_bf16 hb(float f) { return m3_f32_to_bf16(f); }

/* ---- RoPE + qk-norm (faults 2, 3, 23, 24) -------------------------------- */

enum { HD = 128, RD = 64 };

/* One Q head, dense, no insert: the fault-2 setup. */
static void rope_one(const m3_bf16 *table, int64_t pos, const m3_bf16 *in,
                     m3_bf16 *out) {
  m3_qkr_args a = {.n_tokens = 1, .nq = 1, .nkv = 1, .niq = 0, .head_dim = HD,
                   .rotary_dim = RD, .block_size = 128, .eps = 1e-6f};
  m3_bf16 qkv[3 * HD], w[HD] = {0};
  memcpy(qkv, in, sizeof(m3_bf16) * HD);
  for (int d = HD; d < 3 * HD; d++) qkv[d] = hb(0.5f);
  m3_ref_qknorm_rope(&a, qkv, w, w, NULL, NULL, table, &pos, NULL, NULL, NULL,
                     NULL, out, NULL);
  for (int d = 0; d < HD; d++) ck_assert_uint_eq(qkv[d], out[d]); /* in place too */
}

START_TEST(fault2_partial_rope_uses_rotary_dim) {
  m3_bf16 *table = malloc(sizeof(m3_bf16) * 2356 * RD);
  m3_rope_table(10000.0f, RD, 2356, table);
  m3_bf16 in[HD], out[HD];
  for (int d = 0; d < HD; d++) in[d] = hb(1.0f);
  rope_one(table, 1000, in, out);
  ASSERT_ULP(bf(out[0]), -0.26450f, 1);
  ASSERT_ULP(bf(out[32]), 1.38926f, 1);
  ASSERT_ULP(bf(out[1]), -1.39592f, 1);
  ASSERT_ULP(bf(out[33]), 0.22676f, 1);
  ASSERT_ULP(bf(out[31]), 0.85816f, 1);
  ASSERT_ULP(bf(out[63]), 1.12408f, 1);
  ck_assert(fabsf(bf(out[1]) - 1.33798f) > 1.0f); /* the head_dim convention */
  for (int d = 64; d < HD; d++) ck_assert_float_eq(bf(out[d]), 1.0f);
  const int64_t pos[] = {0, 700, 1000, 2355};
  for (int p = 0; p < 4; p++) {
    rope_one(table, pos[p], in, out);
    for (int i = 0; i < 32; i++) {
      double ang = (double)pos[p] * pow(10000.0, -2.0 * i / 64.0);
      double c = cos(ang), s = sin(ang);
      /* 1 ulp of the result plus the bf16 rounding of the table entries. */
      float tol0 = bf16_ulp((float)(c - s)) + 2 * 0x1p-9f;
      float tol1 = bf16_ulp((float)(s + c)) + 2 * 0x1p-9f;
      ck_assert_msg(fabs(bf(out[i]) - (c - s)) <= tol0, "pos %lld i %d", (long long)pos[p], i);
      ck_assert_msg(fabs(bf(out[i + 32]) - (s + c)) <= tol1, "pos %lld i %d", (long long)pos[p], i);
    }
    for (int d = 64; d < HD; d++) ck_assert_float_eq(bf(out[d]), 1.0f);
  }
  free(table);
}
END_TEST

/* Fault 3 on every head kind of every variant: q (in place and q_out), k (in
 * place and cache), iq (in place and index_q_out), ik (in place and cache). */
START_TEST(fault3_neox_pairing_every_variant) {
  m3_bf16 table[2 * RD];
  m3_rope_table(10000.0f, RD, 2, table);
  const float want[4] = {-4.09836f, -2.60827f, 5.08627f, 8.86173f};
  const int dims[4] = {0, 1, 32, 33};
  for (int sparse = 0; sparse < 2; sparse++)
    for (int insert = 0; insert < 2; insert++) {
      m3_qkr_args a = {.n_tokens = 1, .nq = 2, .nkv = 1, .niq = sparse ? 1 : 0,
                       .head_dim = HD, .rotary_dim = RD, .block_size = 4,
                       .eps = 1e-6f, .insert = insert};
      int heads = a.nq + 2 * a.nkv + (sparse ? a.niq + 1 : 0);
      m3_bf16 qkv[6 * HD] = {0}, w[HD] = {0}, q_out[2 * HD], iq_out[HD];
      m3_bf16 kv[2 * 4 * 2 * HD], icache[2 * 4 * HD];
      memset(kv, 0, sizeof kv);
      memset(icache, 0, sizeof icache);
      for (int h = 0; h < heads; h++) {
        qkv[h * HD + 0] = hb(1);
        qkv[h * HD + 1] = hb(2);
        qkv[h * HD + 32] = hb(3);
        qkv[h * HD + 33] = hb(4);
      }
      int64_t pos = 1, slot = 6; /* page 1, offset 2 */
      m3_ref_qknorm_rope(&a, qkv, w, w, w, w, table, &pos, &slot, NULL, kv,
                         icache, q_out, sparse ? iq_out : NULL);
      for (int k = 0; k < 4; k++) {
        int d = dims[k];
        ASSERT_ULP(bf(q_out[d]), want[k], 1);
        ASSERT_ULP(bf(q_out[HD + d]), want[k], 1);
        ASSERT_ULP(bf(qkv[d]), want[k], 1);
        ASSERT_ULP(bf(qkv[2 * HD + d]), want[k], 1); /* k in place */
        if (insert) ASSERT_ULP(bf(kv[((1 * 1 + 0) * 4 + 2) * 2 * HD + d]), want[k], 1);
        if (sparse) {
          ASSERT_ULP(bf(iq_out[d]), want[k], 1);
          ASSERT_ULP(bf(qkv[4 * HD + d]), want[k], 1);
          ASSERT_ULP(bf(qkv[5 * HD + d]), want[k], 1);
          if (insert) ASSERT_ULP(bf(icache[6 * HD + d]), want[k], 1);
        }
      }
      /* V is copied raw into the cache, never normed. */
      if (insert) ck_assert_uint_eq(kv[((1 * 1 + 0) * 4 + 2) * 2 * HD + HD + 1], hb(2));
      ck_assert_uint_eq(qkv[3 * HD + 1], hb(2));
      if (!insert) {
        for (size_t i = 0; i < sizeof kv / sizeof *kv; i++) ck_assert_uint_eq(kv[i], 0);
      }
    }
}
END_TEST

/* Padding rows (slot < 0) write nothing; e4m3 K is rounded once on sparse
 * layers and twice (through bf16) on dense ones; V from its bf16 value. */
START_TEST(qkr_insert_slots_and_e4m3_rounding) {
  enum { N = 64, BS = 16, PAGES = 8 };
  m3_bf16 *table = malloc(sizeof(m3_bf16) * 4096 * RD);
  m3_rope_table(10000.0f, RD, 4096, table);
  m3_bf16 w[HD];
  for (int d = 0; d < HD; d++) w[d] = hb(0.25f * frand());
  int diff_double_rounding = 0;
  for (int sparse = 0; sparse < 2; sparse++) {
    m3_qkr_args a = {.n_tokens = N, .nq = 1, .nkv = 2, .niq = sparse,
                     .head_dim = HD, .rotary_dim = RD, .block_size = BS,
                     .eps = 1e-6f, .insert = 1, .kv_e4m3 = 1, .idx_e4m3 = 1};
    int heads = 1 + 4 + (sparse ? 2 : 0);
    m3_bf16 *qkv = malloc(sizeof(m3_bf16) * N * heads * HD);
    m3_bf16 *orig = malloc(sizeof(m3_bf16) * N * heads * HD);
    for (int i = 0; i < N * heads * HD; i++) orig[i] = qkv[i] = hb(4.0f * frand());
    int64_t pos[N], slot[N];
    for (int t = 0; t < N; t++) {
      pos[t] = 37 * t + 5;
      slot[t] = (t % 5 == 3) ? -1 : (int64_t)(PAGES * BS - 1 - t);
    }
    size_t kvn = (size_t)PAGES * 2 * BS * 2 * HD;
    m3_e4m3 *kv = malloc(kvn), *ic = malloc((size_t)PAGES * BS * HD);
    memset(kv, 0xAB, kvn);
    memset(ic, 0xAB, (size_t)PAGES * BS * HD);
    m3_e4m3 *iq = malloc((size_t)N * HD);
    m3_ref_qknorm_rope(&a, qkv, w, w, w, w, table, pos, slot, NULL, kv, ic, NULL,
                       sparse ? iq : NULL);
    int64_t written = 0;
    for (int64_t s = 0; s < PAGES * BS; s++) {
      int t = (int)(PAGES * BS - 1 - s);
      int valid = t < N && t % 5 != 3;
      for (int g = 0; g < 2; g++) {
        const m3_e4m3 *c = kv + (((s / BS) * 2 + g) * BS + s % BS) * 2 * HD;
        if (!valid) {
          for (int d = 0; d < 2 * HD; d++) ck_assert_uint_eq(c[d], 0xAB);
          continue;
        }
        written++;
        const m3_bf16 *kin = orig + ((int64_t)t * heads + 1 + g) * HD;
        const m3_bf16 *kout = qkv + ((int64_t)t * heads + 1 + g) * HD;
        const m3_bf16 *vin = orig + ((int64_t)t * heads + 3 + g) * HD;
        /* The test's own fp32 norm + RoPE, to check the single rounding. */
        float x[HD];
        for (int d = 0; d < HD; d++) x[d] = bf(kin[d]);
        m3_ref_gemma_norm_f32(HD, x, w, 1e-6f, x);
        const m3_bf16 *cs = table + pos[t] * RD;
        for (int m = 0; m < 32; m++) {
          float c0 = bf(cs[m]), s0 = bf(cs[32 + m]), p = x[m], q = x[m + 32];
          x[m] = p * c0 - q * s0;
          x[m + 32] = q * c0 + p * s0;
        }
        for (int d = 0; d < HD; d++) {
          ck_assert_uint_eq(kout[d], hb(x[d]));
          m3_e4m3 once = m3_f32_to_e4m3(x[d]), twice = m3_f32_to_e4m3(bf(hb(x[d])));
          ck_assert_uint_eq(c[d], sparse ? once : twice);
          diff_double_rounding += once != twice;
          ck_assert_uint_eq(c[HD + d], m3_f32_to_e4m3(bf(vin[d])));
        }
        if (sparse) {
          const m3_bf16 *ikout = qkv + ((int64_t)t * heads + 6) * HD;
          /* index cache e4m3 agrees with the in-place bf16 ik within e4m3 rounding */
          for (int d = 0; d < HD; d++)
            ck_assert(fabsf(m3_e4m3_to_f32(ic[s * HD + d]) - bf(ikout[d])) <=
                      0.0625f * fabsf(bf(ikout[d])) + 0x1p-9f);
        }
      }
      if (!sparse || valid) continue;
      for (int d = 0; d < HD; d++) ck_assert_uint_eq(ic[s * HD + d], 0xAB);
    }
    ck_assert_int_eq(written, 2 * (N - 13)); /* 13 rows of 64 have t % 5 == 3 */
    free(qkv), free(orig), free(kv), free(ic), free(iq);
  }
  ck_assert_int_gt(diff_double_rounding, 0); /* the distinction is exercised */
  free(table);
}
END_TEST

START_TEST(fault23_gemma_norm_every_site) {
  const float base[4] = {0.365148f, 0.730297f, 1.095445f, 1.460593f};
  const float ws[3] = {0.0f, 1.0f, -0.99609375f}, fac[3] = {1.0f, 2.0f, 0.00390625f};
  m3_bf16 x[4] = {hb(1), hb(2), hb(3), hb(4)}, y[4];
  for (int k = 0; k < 3; k++) {
    m3_bf16 w[4];
    for (int i = 0; i < 4; i++) w[i] = hb(ws[k]);
    ck_assert_float_eq(1.0f + bf(w[0]), fac[k]); /* (1 + w) formed in fp32 */
    /* fp32 form: (1 + w) must not be rounded to bf16 (w = 2^-9 would vanish) */
    float xf[4] = {1, 2, 3, 4}, yf[4];
    m3_bf16 ws9[4] = {hb(0x1p-9f), hb(0x1p-9f), hb(0x1p-9f), hb(0x1p-9f)};
    m3_ref_gemma_norm_f32(4, xf, ws9, 1e-6f, yf);
    for (int i = 0; i < 4; i++) ck_assert(fabsf(yf[i] - base[i] * (1 + 0x1p-9f)) < 2e-6f);
    /* layer / final norm */
    m3_ref_rmsnorm(1, 4, x, w, 1e-6f, y);
    for (int i = 0; i < 4; i++) ASSERT_ULP(bf(y[i]), base[i] * fac[k], 1);
    /* fused residual add + norm: 0.5x + 0.5x */
    m3_bf16 half[4], res[4], y2[4];
    for (int i = 0; i < 4; i++) half[i] = res[i] = hb(0.5f * (i + 1));
    m3_ref_add_rmsnorm(1, 4, half, res, w, 1e-6f, y2);
    for (int i = 0; i < 4; i++) {
      ck_assert_uint_eq(res[i], x[i]);
      ck_assert_uint_eq(y2[i], y[i]);
    }
    /* q/k/index norms: qkr with head_dim 4, no rotary part */
    m3_qkr_args a = {.n_tokens = 1, .nq = 1, .nkv = 1, .niq = 1, .head_dim = 4,
                     .rotary_dim = 0, .block_size = 1, .eps = 1e-6f};
    m3_bf16 qkv[20], qo[4], iqo[4], table[1] = {0};
    for (int h = 0; h < 5; h++) memcpy(qkv + 4 * h, x, sizeof x);
    int64_t pos = 0;
    m3_ref_qknorm_rope(&a, qkv, w, w, w, w, table, &pos, NULL, NULL, NULL, NULL,
                       qo, iqo);
    for (int i = 0; i < 4; i++) {
      ASSERT_ULP(bf(qo[i]), base[i] * fac[k], 1);
      ASSERT_ULP(bf(qkv[4 + i]), base[i] * fac[k], 1);  /* k */
      ASSERT_ULP(bf(iqo[i]), base[i] * fac[k], 1);      /* iq */
      ASSERT_ULP(bf(qkv[16 + i]), base[i] * fac[k], 1); /* ik */
      ck_assert_uint_eq(qkv[8 + i], x[i]);              /* v untouched */
    }
  }
}
END_TEST

START_TEST(fault24_rope_table_long_positions) {
  const float theta = 5e6f;
  float inv[32];
  m3_rope_inv_freq(theta, RD, inv);
  for (int m = 0; m < 32; m++)
    ck_assert(fabs(inv[m] - pow(5e6, -2.0 * m / 64.0)) <= 2e-7 * pow(5e6, -2.0 * m / 64.0));
  m3_bf16 *t = malloc(sizeof(m3_bf16) * 8192 * RD);
  m3_rope_table(theta, RD, 8192, t);
  for (int64_t p = 8190; p < 8192; p++)
    for (int m = 0; m < 32; m++) {
      double ang = (double)((float)p * inv[m]); /* the spec's fp32 angle */
      ASSERT_ULP(bf(t[p * RD + m]), (float)cos(ang), 1);
      ASSERT_ULP(bf(t[p * RD + 32 + m]), (float)sin(ang), 1);
      /* and the exact angle, up to the fp32 product's rounding */
      double exact = (double)p * pow(5e6, -2.0 * m / 64.0);
      ck_assert(fabs(bf(t[p * RD + m]) - cos(exact)) <= 0x1p-8 + fabs(ang - exact) + 1e-6);
    }
  free(t);
  /* The full 1M-position table (128 MiB) must be cheap enough to build. */
  int64_t big = 1048576;
  m3_bf16 *tb = malloc(sizeof(m3_bf16) * big * RD);
  ck_assert_ptr_nonnull(tb);
  m3_rope_table(theta, RD, big, tb);
  for (int m = 0; m < 32; m++) {
    float c = bf(tb[(big - 1) * RD + m]), s = bf(tb[(big - 1) * RD + 32 + m]);
    ck_assert(fabsf(c * c + s * s - 1.0f) < 0.02f);
  }
  free(tb);
}
END_TEST

/* ---- e4m3 (fault 17) ----------------------------------------------------- */

START_TEST(fault17_e4m3_encode) {
  const float in[] = {255, 256, 300, 448, 464, 465, 480, 1000, -1000,
                      0x1p-10f, 3 * 0x1p-10f, 0x1p-9f, 17, 19};
  const float want[] = {256, 256, 288, 448, 448, 448, 448, 448, -448,
                        0, 0x1p-8f, 0x1p-9f, 16, 20};
  m3_e4m3 q[14];
  m3_ref_e4m3_encode(14, in, q);
  for (int i = 0; i < 14; i++)
    ck_assert_msg(m3_e4m3_to_f32(q[i]) == want[i], "%g -> %g", in[i], m3_e4m3_to_f32(q[i]));
  ck_assert_uint_eq(q[3], 0x7E);
  ck_assert_uint_eq(q[8], 0xFE);
  ck_assert_uint_eq(q[11], 0x01);
  float nan = NAN;
  m3_ref_e4m3_encode(1, &nan, q);
  ck_assert_uint_eq(q[0], 0x7F);
  /* No finite input encodes to a NaN byte. */
  for (uint32_t u = 0; u < 0x7f800000u; u += 0x1001) {
    float f;
    memcpy(&f, &u, 4);
    float v[2] = {f, -f};
    m3_ref_e4m3_encode(2, v, q);
    ck_assert((q[0] & 0x7f) != 0x7f && (q[1] & 0x7f) != 0x7f);
  }
}
END_TEST

/* ---- indexer (faults 8, 14, 18; ties; NaN) ------------------------------- */

/* A one-sequence batch whose logical block lb lives in page (lb*11+3) % pages
 * (a permutation for the page counts used here: no two blocks alias). */
typedef struct {
  m3_seq_batch b;
  int32_t seq_len, bt[64], seq[8];
  int64_t pos[8];
} one_seq;

static void one_seq_init(one_seq *o, int32_t seq_len, int n_tok, int pages) {
  memset(o, 0, sizeof *o);
  o->seq_len = seq_len;
  for (int lb = 0; lb < 64; lb++) o->bt[lb] = (lb * 11 + 3) % pages;
  for (int t = 0; t < n_tok; t++) o->pos[t] = seq_len - n_tok + t;
  o->b = (m3_seq_batch){.n_seqs = 1, .seq_lens = &o->seq_len, .block_table = o->bt,
                        .bt_stride = 64, .num_pages = pages, .token_seq = o->seq,
                        .positions = o->pos};
}

START_TEST(fault14_18_index_k_insert_then_score) {
  enum { T = 128 };
  m3_bf16 table[T * RD];
  m3_rope_table(10000.0f, RD, T, table);
  for (int e4 = 0; e4 < 2; e4++)
    for (int zero5 = 0; zero5 < 2; zero5++) {
      m3_qkr_args a = {.n_tokens = T, .nq = 1, .nkv = 1, .niq = 1, .head_dim = HD,
                       .rotary_dim = RD, .block_size = 128, .eps = 1e-6f,
                       .insert = 1, .idx_e4m3 = e4};
      m3_bf16 *qkv = calloc((size_t)T * 5 * HD, sizeof *qkv), w[HD] = {0};
      int64_t pos[T], slot[T], islot[T];
      for (int t = 0; t < T; t++) {
        pos[t] = t;
        slot[t] = -1; /* main cache not under test */
        islot[t] = 2 * 128 + t;
        if (!(zero5 && t == 5)) qkv[((size_t)t * 5 + 4) * HD + 64 + t % 64] = hb(1.0f);
      }
      size_t esz = e4 ? 1 : 2;
      unsigned char *ic = malloc(4 * 128 * HD * esz);
      memset(ic, 0x5A, 4 * 128 * HD * esz);
      m3_ref_qknorm_rope(&a, qkv, w, w, w, w, table, pos, slot, islot, NULL, ic,
                         NULL, NULL);
      /* Fault 18: the zero key is stored as zeros.  RoPE's 0*c + 0*s can give
       * -0 where c, s < 0 (IEEE, the GPU does the same), so the sign bit is
       * free; the magnitude bits must be zero and there is no scale to be 0. */
      if (zero5)
        for (size_t d = 0; d < HD; d++) {
          if (e4) ck_assert_uint_eq(ic[(2 * 128 + 5) * HD + d] & 0x7f, 0);
          else ck_assert_uint_eq(((m3_bf16 *)ic)[(2 * 128 + 5) * HD + d] & 0x7fff, 0);
        }
      for (size_t i = 0; i < 2 * 128 * HD * esz; i++) ck_assert_uint_eq(ic[i], 0x5A);
      /* Score with q = e_{64+j}, j = 0, 1, 63, from the last position. */
      one_seq o;
      one_seq_init(&o, T, 3, 4);
      for (int lb = 0; lb < 64; lb++) o.bt[lb] = 2;
      const int js[3] = {0, 1, 63};
      m3_bf16 iqb[3 * HD] = {0};
      m3_e4m3 iq8[3 * HD] = {0};
      for (int k = 0; k < 3; k++) {
        o.pos[k] = T - 1;
        iq8[k * HD + 64 + js[k]] = m3_f32_to_e4m3(1.0f);
        iqb[k * HD + 64 + js[k]] = hb(1.0f);
      }
      const void *iq = e4 ? (const void *)iq8 : (const void *)iqb;
      m3_idx_args ia = {.n_tokens = 3, .n_heads = 1, .head_dim = HD, .block_size = 128,
                        .topk = 16, .local_blocks = 1, .idx_e4m3 = e4, .max_blocks = 1};
      float s[3 * T];
      ASSERT_OK(m3_ref_index_token_scores(&ia, &o.b, iq, ic, s, T, &err_));
      for (int k = 0; k < 3; k++)
        for (int t = 0; t < T; t++) {
          float v = s[k * T + t];
          if (t % 64 == js[k] && !(zero5 && t == 5))
            ck_assert_msg(fabsf(v - 11.3137f) <= 0.05f * 11.3137f, "t %d j %d: %g", t, js[k], v);
          else
            ck_assert_msg(v == 0.0f, "t %d j %d: %g", t, js[k], v);
        }
      /* Block scores and selection are unaffected by the zero key. */
      float bsc[3];
      int32_t sel[3 * 16];
      ASSERT_OK(m3_ref_index_scores(&ia, &o.b, iq, ic, bsc, &err_));
      ASSERT_OK(m3_ref_indexer(&ia, &o.b, iq, ic, sel, &err_));
      for (int k = 0; k < 3; k++) {
        ck_assert(fabsf(bsc[k] - 11.3137f) <= 0.05f * 11.3137f);
        ck_assert_int_eq(sel[k * 16], 0);
        for (int r = 1; r < 16; r++) ck_assert_int_eq(sel[k * 16 + r], -1);
      }
      free(qkv), free(ic);
    }
}
END_TEST

/* Random paged index cache + KV cache for one sequence of up to 64 blocks. */
enum { PAGES = 70, BS = 128, NKV = 2, NQ = 4 };

static void fill_caches(m3_bf16 *ic, m3_bf16 *kv) {
  for (size_t i = 0; i < (size_t)PAGES * BS * HD; i++) ic[i] = hb(frand());
  for (size_t i = 0; i < (size_t)PAGES * NKV * BS * 2 * HD; i++) kv[i] = hb(frand());
}

static int close_rel(const m3_bf16 *x, const m3_bf16 *y, size_t n, float rel) {
  float mx = 0, d = 0;
  for (size_t i = 0; i < n; i++) {
    mx = fmaxf(mx, fabsf(bf(y[i])));
    d = fmaxf(d, fabsf(bf(x[i]) - bf(y[i])));
  }
  return d <= rel * mx + 1e-6f;
}

START_TEST(fault8_short_contexts) {
  m3_bf16 *ic = malloc(sizeof(m3_bf16) * PAGES * BS * HD);
  m3_bf16 *kv = malloc(sizeof(m3_bf16) * PAGES * NKV * BS * 2 * HD);
  fill_caches(ic, kv);
  const int32_t lens[] = {1, 127, 128, 129, 2047, 2048, 2049};
  for (int li = 0; li < 7; li++) {
    one_seq o;
    one_seq_init(&o, lens[li], 1, PAGES);
    int64_t nb = (lens[li] + BS - 1) / BS, want = nb < 16 ? nb : 16;
    m3_bf16 iq[NKV * HD], q[NQ * HD], o_sp[NQ * HD], o_de[NQ * HD];
    for (int i = 0; i < NKV * HD; i++) iq[i] = hb(frand());
    for (int i = 0; i < NQ * HD; i++) q[i] = hb(2 * frand());
    m3_idx_args ia = {.n_tokens = 1, .n_heads = NKV, .head_dim = HD, .block_size = BS,
                      .topk = 16, .local_blocks = 1, .max_blocks = 64};
    int32_t sel[NKV * 16];
    ASSERT_OK(m3_ref_indexer(&ia, &o.b, iq, ic, sel, &err_));
    for (int g = 0; g < NKV; g++) {
      const int32_t *r = sel + g * 16;
      ck_assert_int_eq(r[0], nb - 1); /* the local block leads */
      for (int k = 0; k < 16; k++) {
        if (k >= want) {
          ck_assert_int_eq(r[k], -1);
          continue;
        }
        ck_assert(r[k] >= 0 && r[k] < nb);
        for (int k2 = 0; k2 < k; k2++) ck_assert_int_ne(r[k], r[k2]);
      }
    }
    m3_attn_args aa = {.n_tokens = 1, .nq = NQ, .nkv = NKV, .head_dim = HD,
                       .block_size = BS, .topk = 16};
    ASSERT_OK(m3_ref_sparse_attention(&aa, &o.b, q, kv, sel, o_sp, &err_));
    ASSERT_OK(m3_ref_dense_attention(&aa, &o.b, q, kv, o_de, &err_));
    if (lens[li] <= 2048) ck_assert_msg(close_rel(o_sp, o_de, NQ * HD, 1e-2f), "len %d", lens[li]);
    else ck_assert(!close_rel(o_sp, o_de, NQ * HD, 1e-3f)); /* one block dropped */
  }
  /* Step-by-step prefill chunk == decode: 3 query tokens of one sequence. */
  one_seq o;
  one_seq_init(&o, 1500, 3, PAGES);
  m3_bf16 q[3 * NQ * HD], a3[3 * NQ * HD], a1[NQ * HD];
  for (int i = 0; i < 3 * NQ * HD; i++) q[i] = hb(frand());
  m3_attn_args aa = {.n_tokens = 3, .nq = NQ, .nkv = NKV, .head_dim = HD, .block_size = BS};
  ASSERT_OK(m3_ref_dense_attention(&aa, &o.b, q, kv, a3, &err_));
  for (int t = 0; t < 3; t++) {
    one_seq d;
    one_seq_init(&d, (int32_t)o.pos[t] + 1, 1, PAGES);
    aa.n_tokens = 1;
    ASSERT_OK(m3_ref_dense_attention(&aa, &d.b, q + t * NQ * HD, kv, a1, &err_));
    ck_assert(memcmp(a1, a3 + t * NQ * HD, sizeof a1) == 0);
  }
  free(ic), free(kv);
}
END_TEST

START_TEST(fault6_sentinels_and_beyond_causal_ignored) {
  m3_bf16 *ic = malloc(sizeof(m3_bf16) * PAGES * BS * HD);
  m3_bf16 *kv = malloc(sizeof(m3_bf16) * PAGES * NKV * BS * 2 * HD);
  fill_caches(ic, kv);
  /* Row 0 preceded by 4 KiB of 0x7FFFFFFF, its unused tail likewise. */
  enum { PAD = 1024, STRIDE = 48 };
  int32_t *bt_mem = malloc(sizeof(int32_t) * (PAD + 2 * STRIDE));
  for (int i = 0; i < PAD + 2 * STRIDE; i++) bt_mem[i] = 0x7FFFFFFF;
  int32_t *bt = bt_mem + PAD;
  for (int lb = 0; lb < 3; lb++) bt[lb] = 60 + lb;
  for (int lb = 0; lb < 40; lb++) bt[STRIDE + lb] = lb;
  int32_t lens[2] = {300, 5000}, seq[2] = {0, 1};
  int64_t pos[2] = {299, 4999};
  m3_seq_batch b = {.n_seqs = 2, .seq_lens = lens, .block_table = bt, .bt_stride = STRIDE,
                    .num_pages = PAGES, .token_seq = seq, .positions = pos};
  m3_bf16 iq[2 * NKV * HD], q[2 * NQ * HD], o_sp[2 * NQ * HD], o_de[2 * NQ * HD];
  for (int i = 0; i < 2 * NKV * HD; i++) iq[i] = hb(frand());
  for (int i = 0; i < 2 * NQ * HD; i++) q[i] = hb(2 * frand());
  m3_idx_args ia = {.n_tokens = 2, .n_heads = NKV, .head_dim = HD, .block_size = BS,
                    .topk = 16, .local_blocks = 1, .max_blocks = STRIDE};
  int32_t sel[NKV * 2 * 16];
  ASSERT_OK(m3_ref_indexer(&ia, &b, iq, ic, sel, &err_));
  for (int g = 0; g < NKV; g++)
    for (int k = 0; k < 16; k++) ck_assert(sel[(g * 2 + 1) * 16 + k] >= 0);
  m3_attn_args aa = {.n_tokens = 2, .nq = NQ, .nkv = NKV, .head_dim = HD,
                     .block_size = BS, .topk = 16};
  ASSERT_OK(m3_ref_dense_attention(&aa, &b, q, kv, o_de, &err_));
  const int32_t cases[3][16] = {
      {2, 0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
      {2, 0, 1, 3, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
      {3, 2, 17, 0, -7, 1, 1000000, INT32_MIN, INT32_MAX, -1, -1, -1, -1, -1, -1, -1}};
  for (int c = 0; c < 3; c++) {
    for (int g = 0; g < NKV; g++) memcpy(sel + (g * 2 + 0) * 16, cases[c], sizeof cases[c]);
    ASSERT_OK(m3_ref_sparse_attention(&aa, &b, q, kv, sel, o_sp, &err_));
    ck_assert_msg(close_rel(o_sp, o_de, NQ * HD, 1e-2f), "case %d", c);
  }
  free(bt_mem), free(ic), free(kv);
}
END_TEST

START_TEST(topk_ties_lower_id_and_nan_last) {
  /* Identical keys -> identical block scores -> ascending ids after forcing. */
  m3_bf16 *ic = malloc(sizeof(m3_bf16) * PAGES * BS * HD);
  for (size_t i = 0; i < (size_t)PAGES * BS * HD; i++) ic[i] = hb(((i % HD) & 1) ? 0.5f : -0.25f);
  one_seq o;
  one_seq_init(&o, 20 * BS, 1, PAGES);
  m3_bf16 iq[HD];
  for (int d = 0; d < HD; d++) iq[d] = hb(frand());
  m3_idx_args ia = {.n_tokens = 1, .n_heads = 1, .head_dim = HD, .block_size = BS,
                    .topk = 16, .local_blocks = 1, .max_blocks = 64};
  int32_t sel[16];
  ASSERT_OK(m3_ref_indexer(&ia, &o.b, iq, ic, sel, &err_));
  ck_assert_int_eq(sel[0], 19);
  for (int k = 1; k < 16; k++) ck_assert_int_eq(sel[k], k - 1);
  ia.init_blocks = 1; /* init 1e30 ahead of local 1e29 */
  ASSERT_OK(m3_ref_indexer(&ia, &o.b, iq, ic, sel, &err_));
  ck_assert_int_eq(sel[0], 0);
  ck_assert_int_eq(sel[1], 19);
  for (int k = 2; k < 16; k++) ck_assert_int_eq(sel[k], k - 1);
  ia.init_blocks = 0;
  ia.local_blocks = 0; /* nothing forced: a tie must never evict a lower id */
  ASSERT_OK(m3_ref_indexer(&ia, &o.b, iq, ic, sel, &err_));
  for (int k = 0; k < 16; k++) ck_assert_int_eq(sel[k], k);
  ia.local_blocks = 1;

  /* NaN scores (already in the buffer) are never ahead of finite ones. */
  float sc[64];
  for (int k = 0; k < 64; k++) sc[k] = (float)k * 0.01f - 0.3f;
  sc[5] = NAN;
  sc[18] = NAN; /* the local-1 block... */
  ASSERT_OK(m3_ref_index_topk(&ia, &o.b, sc, sel, &err_));
  ck_assert_int_eq(sel[0], 19);
  for (int k = 0; k < 16; k++) ck_assert(sel[k] != 5 && sel[k] != 18);
  ck_assert_int_eq(sel[1], 17); /* then descending score */
  one_seq s10;
  one_seq_init(&s10, 10 * BS, 1, PAGES);
  ASSERT_OK(m3_ref_index_topk(&ia, &s10.b, sc, sel, &err_));
  ck_assert_int_eq(sel[0], 9);
  ck_assert_int_eq(sel[9], 5); /* NaN -> -1e30: selected, but last */
  for (int k = 10; k < 16; k++) ck_assert_int_eq(sel[k], -1);
  /* The forcing step alone, as the decode score kernel folds it in. */
  float f[64];
  memcpy(f, sc, sizeof f);
  ASSERT_OK(m3_ref_index_force(&ia, &s10.b, f, &err_));
  ck_assert_float_eq(f[9], 1e29f);
  ck_assert_float_eq(f[5], -1e30f);
  ck_assert_float_eq(f[3], sc[3]);
  ck_assert(f[10] == sc[10]); /* beyond nb untouched */

  /* A NaN key poisons its block through the scoring path too. */
  ic[((int64_t)o.bt[3] * BS + 17) * HD + 4] = 0x7FC0;
  for (size_t i = 0; i < (size_t)PAGES * BS * HD; i++)
    if (i / HD / BS != (size_t)o.bt[3]) ic[i] = hb(frand());
  float bsc[64];
  ASSERT_OK(m3_ref_index_scores(&ia, &o.b, iq, ic, bsc, &err_));
  ck_assert(isnan(bsc[3]));
  ck_assert(isinf(bsc[20]) && bsc[20] < 0); /* not visible */
  ASSERT_OK(m3_ref_indexer(&ia, &o.b, iq, ic, sel, &err_));
  for (int k = 0; k < 16; k++) ck_assert_int_ne(sel[k], 3);
  free(ic);
}
END_TEST

START_TEST(e4m3_kv_close_to_bf16) {
  m3_bf16 *ic = malloc(sizeof(m3_bf16) * PAGES * BS * HD);
  m3_bf16 *kv = malloc(sizeof(m3_bf16) * PAGES * NKV * BS * 2 * HD);
  fill_caches(ic, kv);
  size_t n = (size_t)PAGES * NKV * BS * 2 * HD;
  m3_e4m3 *kv8 = malloc(n);
  for (size_t i = 0; i < n; i++) kv8[i] = m3_f32_to_e4m3(bf(kv[i]));
  one_seq o;
  one_seq_init(&o, 1000, 2, PAGES);
  m3_bf16 q[2 * NQ * HD], a[2 * NQ * HD], a8[2 * NQ * HD];
  for (int i = 0; i < 2 * NQ * HD; i++) q[i] = hb(3 * frand());
  m3_attn_args aa = {.n_tokens = 2, .nq = NQ, .nkv = NKV, .head_dim = HD, .block_size = BS};
  ASSERT_OK(m3_ref_dense_attention(&aa, &o.b, q, kv, a, &err_));
  aa.kv_e4m3 = 1;
  ASSERT_OK(m3_ref_dense_attention(&aa, &o.b, q, kv8, a8, &err_));
  ck_assert(close_rel(a8, a, 2 * NQ * HD, 0.1f));
  ck_assert(memcmp(a8, a, sizeof a) != 0);
  /* fp8 index scores within 7% of bf16 (fault 16a) on a strong match. */
  m3_bf16 iq[HD];
  m3_e4m3 iq8[HD], *ic8 = malloc((size_t)PAGES * BS * HD);
  for (size_t i = 0; i < (size_t)PAGES * BS * HD; i++) ic8[i] = m3_f32_to_e4m3(bf(ic[i]));
  int64_t slot0 = (int64_t)o.bt[0] * BS;
  for (int d = 0; d < HD; d++) {
    iq[d] = ic[slot0 * HD + d];
    iq8[d] = m3_f32_to_e4m3(bf(iq[d]));
  }
  m3_idx_args ia = {.n_tokens = 1, .n_heads = 1, .head_dim = HD, .block_size = BS,
                    .topk = 16, .local_blocks = 1, .max_blocks = 64};
  float s16[1000], s8[1000];
  ASSERT_OK(m3_ref_index_token_scores(&ia, &o.b, iq, ic, s16, 1000, &err_));
  ia.idx_e4m3 = 1;
  ASSERT_OK(m3_ref_index_token_scores(&ia, &o.b, iq8, ic8, s8, 1000, &err_));
  ck_assert(fabsf(s8[0] - s16[0]) <= 0.07f * s16[0]);
  free(ic), free(kv), free(kv8), free(ic8);
}
END_TEST

START_TEST(batch_validation_errors) {
  one_seq o;
  one_seq_init(&o, 300, 1, 4);
  m3_err e = {0};
  o.pos[0] = 300;
  ck_assert_int_eq(m3_ref_batch_check(&o.b, 1, BS, INT64_MAX, &e), M3_RANGE);
  ck_assert(strstr(e.msg, "position 300") != NULL);
  o.pos[0] = 299;
  o.bt[2] = 4; /* page outside [0, 4) */
  ck_assert_int_eq(m3_ref_batch_check(&o.b, 1, BS, INT64_MAX, &e), M3_RANGE);
  o.bt[2] = 1;
  o.bt[3] = -5; /* not visible: ignored */
  ck_assert_int_eq(m3_ref_batch_check(&o.b, 1, BS, INT64_MAX, &e), M3_OK);
  o.seq[0] = 1;
  ck_assert_int_eq(m3_ref_batch_check(&o.b, 1, BS, INT64_MAX, &e), M3_RANGE);
  o.seq[0] = 0;
  ck_assert_int_eq(m3_ref_batch_check(&o.b, 1, BS, 2, &e), M3_RANGE); /* 3 > max_blocks */
}
END_TEST

/* ---- MoE (faults 20, 21, 22) --------------------------------------------- */

START_TEST(fault20_unbiased_weights_kept) {
  float lg[8] = {-18, -19, -30, -30, -30, -30, -30, -30};
  float bias[8] = {12, 12, 11, 11, 11, 11, 11, 11};
  m3_route_args a = {.n_tokens = 1, .n_experts = 8, .topk = 2, .renormalize = 1,
                     .routed_scaling = 1.0f};
  int32_t id[2];
  float w[2];
  ASSERT_OK(m3_ref_route(&a, lg, bias, id, w, &err_));
  ck_assert((id[0] == 0 && id[1] == 1) || (id[0] == 1 && id[1] == 0));
  float w0 = id[0] == 0 ? w[0] : w[1], w1 = id[0] == 0 ? w[1] : w[0];
  ck_assert(isfinite(w0) && isfinite(w1));
  ck_assert(fabsf(w0 - 0.731059f) <= 1e-3f * 0.731059f);
  ck_assert(fabsf(w1 - 0.268941f) <= 1e-3f * 0.268941f);
  a.routed_scaling = 2.0f;
  ASSERT_OK(m3_ref_route(&a, lg, bias, id, w, &err_));
  ck_assert(fabsf(w[0] + w[1] - 2.0f) < 1e-5f);
}
END_TEST

START_TEST(fault21_negative_choices_flags_dtypes) {
  float lg[8];
  m3_bf16 lgb[8];
  for (int i = 0; i < 8; i++) lg[i] = -10.0f, lgb[i] = hb(-10.0f);
  float bias[8] = {-2, -3, -1.5f, -4, -5, -6, -7, -8};
  for (int bfl = 0; bfl < 2; bfl++)
    for (int ren = 0; ren < 2; ren++) {
      m3_route_args a = {.n_tokens = 1, .n_experts = 8, .topk = 2, .renormalize = ren,
                         .routed_scaling = 1.0f, .logits_bf16 = bfl};
      int32_t id[2];
      float w[2];
      ASSERT_OK(m3_ref_route(&a, bfl ? (const void *)lgb : (const void *)lg, bias, id, w, &err_));
      ck_assert_int_eq(id[0], 2);
      ck_assert_int_eq(id[1], 0);
      float want = ren ? 0.5f : 4.54e-5f;
      for (int k = 0; k < 2; k++) ck_assert(fabsf(w[k] - want) <= 1e-3f * want);
    }
  /* Exact choice ties -> lower expert id; a NaN is never chosen ahead. */
  float t2[8] = {0, 1, 1, NAN, 1, 0, 0, 0};
  m3_route_args a = {.n_tokens = 1, .n_experts = 8, .topk = 3, .renormalize = 1,
                     .routed_scaling = 1.0f};
  int32_t id[3];
  float w[3];
  ASSERT_OK(m3_ref_route(&a, t2, NULL, id, w, &err_));
  ck_assert_int_eq(id[0], 1);
  ck_assert_int_eq(id[1], 2);
  ck_assert_int_eq(id[2], 4);
}
END_TEST

START_TEST(fault22_swiglu_oai) {
  const float A = 1.702f, L = 7.0f;
  const float g[4] = {-1, 0, 1, 10}, u[4] = {-10, 0, 2, 10};
  const float want[4] = {0.925225f, 0.0f, 2.537387f, 55.99963f};
  for (int i = 0; i < 4; i++) {
    float v = m3_swiglu_oai_f32(g[i], u[i], A, L, 1.0f);
    ck_assert_msg(fabsf(v - want[i]) <= 1e-3f * fabsf(want[i]), "%g %g -> %g", g[i], u[i], v);
  }
  ck_assert(fabsf(m3_swiglu_oai_f32(1, 2, A, L, 0.0f) - 1.691592f) < 1e-3f * 1.691592f);
  ck_assert(fabsf(m3_swiglu_oai_f32(10, 10, A, L, 0.0f) - 48.99967f) < 1e-3f * 48.99967f);
  /* No lower clamp on gate: (-10, 1) uses -10, not -7. */
  double lo = -10.0 / (1.0 + exp(17.02)) * 2.0;
  ck_assert(fabs(m3_swiglu_oai_f32(-10, 1, A, L, 1.0f) - lo) <= 1e-3 * fabs(lo));
  ck_assert(isnan(m3_swiglu_oai_f32(NAN, 1, A, L, 1)));
  ck_assert(isnan(m3_swiglu_oai_f32(1, NAN, A, L, 1)));
  /* bf16 vector form == scalar + one rounding */
  m3_bf16 gb[4], ub[4], ob[4];
  for (int i = 0; i < 4; i++) gb[i] = hb(g[i]), ub[i] = hb(u[i]);
  m3_ref_swiglu_oai(4, gb, ub, A, L, 1.0f, ob);
  for (int i = 0; i < 4; i++) ck_assert_uint_eq(ob[i], hb(m3_swiglu_oai_f32(g[i], u[i], A, L, 1)));

  /* Packed [gate; up] weight, gate half = I, up half = 2I: the uninterleaved
   * checkpoint order.  Swapping the halves must change the output. */
  enum { H = 32, I = 32 };
  m3_bf16 w13[2 * I * H] = {0}, w2[H * I] = {0}, x[H], y[H], ys[H];
  for (int i = 0; i < I; i++) {
    w13[i * H + i] = hb(1);
    w13[(I + i) * H + i] = hb(2);
    w2[i * I + i] = hb(1);
  }
  for (int i = 0; i < H; i++) x[i] = hb(3 * frand());
  m3_ref_weight gate = {I, H, w13, NULL, NULL}, up = {I, H, w13 + I * H, NULL, NULL};
  m3_ref_weight down = {H, I, w2, NULL, NULL};
  ASSERT_OK(m3_ref_mlp(1, x, &gate, &up, &down, A, L, 1.0f, y, &err_));
  for (int i = 0; i < H; i++)
    ck_assert_uint_eq(y[i], hb(m3_swiglu_oai_f32(bf(x[i]), 2 * bf(x[i]), A, L, 1)));
  ASSERT_OK(m3_ref_mlp(1, x, &up, &gate, &down, A, L, 1.0f, ys, &err_));
  ck_assert(memcmp(y, ys, sizeof y) != 0);
}
END_TEST

/* A random MXFP8 weight with scales around 2^-3 .. 2^0. */
static void rand_mxfp8(int64_t rows, int64_t cols, m3_e4m3 *q, uint8_t *s) {
  for (int64_t i = 0; i < rows * cols; i++) q[i] = m3_f32_to_e4m3(8 * frand());
  for (int64_t i = 0; i < rows * cols / 32; i++) s[i] = (uint8_t)(124 + (i % 4));
}

START_TEST(mxfp8_dequant_and_w8a16) {
  enum { R = 24, C = 64, N = 19 };
  m3_e4m3 q[R * C];
  uint8_t s[R * C / 32];
  rand_mxfp8(R, C, q, s);
  q[5] = 0x7E;   /* 448 */
  s[0] = 130;    /* x 8 */
  m3_bf16 w[R * C], x[N * C], y1[N * R], y2[N * R];
  ASSERT_OK(m3_ref_mxfp8_dequant(R, C, q, s, w, &err_));
  ck_assert_float_eq(bf(w[5]), 448.0f * 8.0f);
  for (int i = 0; i < R * C; i++)
    ck_assert_float_eq(bf(w[i]), m3_e4m3_to_f32(q[i]) * ldexpf(1, s[i / 32] - 127));
  for (int i = 0; i < N * C; i++) x[i] = hb(frand());
  ASSERT_OK(m3_ref_gemm_bf16(N, R, C, x, w, y1, &err_));
  ASSERT_OK(m3_ref_gemm_w8a16(N, R, C, x, q, s, y2, &err_));
  ck_assert(memcmp(y1, y2, sizeof y1) == 0);
  /* against an fp64 dot: within one bf16 rounding plus fp32 noise */
  for (int t = 0; t < N; t++)
    for (int r = 0; r < R; r++) {
      double acc = 0;
      for (int c = 0; c < C; c++) acc += (double)bf(x[t * C + c]) * bf(w[r * C + c]);
      ck_assert(fabs(bf(y1[t * R + r]) - acc) <= bf16_ulp((float)acc) + 1e-4);
    }
  m3_err e = {0};
  ck_assert_int_eq(m3_ref_mxfp8_dequant(R, 48, q, s, w, &e), M3_INVAL);
  m3_ref_weight both = {R, C, w, q, s};
  ck_assert_int_eq(m3_ref_linear(N, x, &both, y1, &e), M3_INVAL);
}
END_TEST

START_TEST(moe_layer_and_grouping) {
  enum { E = 6, K = 2, H = 32, I = 64, N = 40 };
  static m3_e4m3 q1[E][I * H], q3[E][I * H], q2[E][H * I], sq[3][I * H];
  static uint8_t s1[E][I * H / 32], s3[E][I * H / 32], s2[E][H * I / 32], ss[3][I * H / 32];
  m3_ref_weight w1[E], w3[E], w2[E];
  for (int x = 0; x < E; x++) {
    rand_mxfp8(I, H, q1[x], s1[x]);
    rand_mxfp8(I, H, q3[x], s3[x]);
    rand_mxfp8(H, I, q2[x], s2[x]);
    w1[x] = (m3_ref_weight){I, H, NULL, q1[x], s1[x]};
    w3[x] = (m3_ref_weight){I, H, NULL, q3[x], s3[x]};
    w2[x] = (m3_ref_weight){H, I, NULL, q2[x], s2[x]};
  }
  for (int k = 0; k < 3; k++) rand_mxfp8(k == 2 ? H : I, k == 2 ? I : H, sq[k], ss[k]);
  m3_ref_weight sg = {I, H, NULL, sq[0], ss[0]}, su = {I, H, NULL, sq[1], ss[1]};
  m3_ref_weight sd = {H, I, NULL, sq[2], ss[2]};
  float wg[E * H], bias[E];
  for (int i = 0; i < E * H; i++) wg[i] = frand();
  for (int i = 0; i < E; i++) bias[i] = 0.1f * frand();
  m3_bf16 m[N * H], out[N * H];
  for (int i = 0; i < N * H; i++) m[i] = hb(0.2f * frand());
  m3_moe_args a = {N, H, E, K, 1, 2.0f, 1.702f, 7.0f, 1.0f};
  int32_t ids[N * K];
  float w[N * K];
  ASSERT_OK(m3_ref_moe(&a, m, wg, bias, w1, w3, w2, &sg, &su, &sd, out, ids, w, &err_));
  /* Recompose token by token from the parts. */
  for (int t = 0; t < N; t++) {
    float lg[E];
    int32_t id[K];
    float wt[K];
    m3_ref_router_logits(1, H, E, m + t * H, wg, lg);
    m3_route_args ra = {1, E, K, 1, 2.0f, 0};
    ASSERT_OK(m3_ref_route(&ra, lg, bias, id, wt, &err_));
    ck_assert(fabsf(wt[0] + wt[1] - 2.0f) < 1e-6f);
    m3_bf16 y[K][H], sh[H];
    for (int k = 0; k < K; k++) {
      ck_assert_int_eq(ids[t * K + k], id[k]);
      ck_assert_float_eq(w[t * K + k], wt[k]);
      ASSERT_OK(m3_ref_mlp(1, m + t * H, &w1[id[k]], &w3[id[k]], &w2[id[k]], 1.702f, 7.0f, 1.0f, y[k], &err_));
    }
    ASSERT_OK(m3_ref_mlp(1, m + t * H, &sg, &su, &sd, 1.702f, 7.0f, 1.0f, sh, &err_));
    for (int d = 0; d < H; d++) {
      float acc = 0.0f;
      for (int k = 0; k < K; k++) acc += wt[k] * bf(y[k][d]);
      acc += bf(sh[d]);
      ck_assert_uint_eq(out[t * H + d], hb(acc));
    }
  }
  /* Grouping: counts, offsets, stable permutation. */
  int32_t counts[E], offs[E + 1], perm[N * K];
  ASSERT_OK(m3_ref_moe_group(N, K, E, ids, counts, offs, perm, &err_));
  ck_assert_int_eq(offs[E], N * K);
  for (int x = 0; x < E; x++) {
    ck_assert_int_eq(offs[x + 1] - offs[x], counts[x]);
    for (int r = offs[x]; r < offs[x + 1]; r++) {
      ck_assert_int_eq(ids[perm[r]], x);
      if (r > offs[x]) ck_assert_int_lt(perm[r - 1], perm[r]);
    }
  }
  ids[7] = E;
  m3_err e = {0};
  ck_assert_int_eq(m3_ref_moe_group(N, K, E, ids, counts, offs, perm, &e), M3_RANGE);
}
END_TEST

/* ---- embedding, sampling -------------------------------------------------- */

START_TEST(embed_gather_and_range) {
  m3_bf16 table[5 * 3], out[2 * 3];
  for (int i = 0; i < 15; i++) table[i] = (m3_bf16)(i + 1);
  int32_t ids[2] = {4, 0};
  ASSERT_OK(m3_ref_embed(2, 3, 5, ids, table, out, &err_));
  ck_assert_uint_eq(out[0], 13);
  ck_assert_uint_eq(out[5], 3);
  m3_err e = {0};
  int32_t bad[3] = {1, 5, 0};
  ck_assert_int_eq(m3_ref_embed(3, 3, 5, bad, table, out, &e), M3_RANGE);
  ck_assert(strstr(e.msg, "token 1") && strstr(e.msg, "id 5"));
  bad[1] = -1;
  ck_assert_int_eq(m3_ref_embed(3, 3, 5, bad, table, out, &e), M3_RANGE);
}
END_TEST

START_TEST(sampling_greedy_and_top_p) {
  float l[2 * 6] = {1, 3, NAN, 3, 2, 0, NAN, NAN, NAN, NAN, NAN, NAN};
  int32_t o[2];
  ASSERT_OK(m3_ref_greedy(1, 6, l, 0, o, &err_));
  ck_assert_int_eq(o[0], 1);
  m3_err e = {0};
  ck_assert_int_eq(m3_ref_greedy(2, 6, l, 0, o, &e), M3_NUMERICS);
  m3_bf16 lb[4] = {hb(-1), 0x7FC0, hb(-0.5f), hb(-0.5f)};
  ASSERT_OK(m3_ref_greedy(1, 4, lb, 1, o, &err_));
  ck_assert_int_eq(o[0], 2);

  /* probabilities 0.5 / 0.3 / 0.2, top_p 0.6 keeps {0, 1} */
  float p3[3] = {logf(0.3f), logf(0.5f), logf(0.2f)};
  m3_sample_args a = {.n_rows = 1, .vocab = 3, .temperature = 1.0f, .top_p = 0.6f, .seed = 42};
  int n_top = 0, n_second = 0;
  for (uint64_t step = 0; step < 4000; step++) {
    a.step = step;
    int32_t id, id2;
    ASSERT_OK(m3_ref_sample_top_p(&a, p3, &id, &err_));
    ASSERT_OK(m3_ref_sample_top_p(&a, p3, &id2, &err_));
    ck_assert_int_eq(id, id2); /* deterministic given (seed, step, row) */
    ck_assert(id == 0 || id == 1);
    n_top += id == 1, n_second += id == 0;
  }
  ck_assert_msg(fabs(n_top / 4000.0 - 0.625) < 0.03, "p(top) = %g", n_top / 4000.0);
  ck_assert_int_eq(n_top + n_second, 4000);
  /* top_p tiny -> always the argmax; temperature 0 -> greedy */
  a.top_p = 1e-6f;
  int32_t id;
  ASSERT_OK(m3_ref_sample_top_p(&a, p3, &id, &err_));
  ck_assert_int_eq(id, 1);
  a.top_p = 1.0f;
  a.temperature = 0.0f;
  ASSERT_OK(m3_ref_sample_top_p(&a, p3, &id, &err_));
  ck_assert_int_eq(id, 1);
  /* the generator: fixed values, range, row/step/seed all matter */
  ck_assert_uint_eq(m3_rng_u64(1, 2, 3), m3_rng_u64(1, 2, 3));
  ck_assert(m3_rng_u64(1, 2, 3) != m3_rng_u64(1, 2, 4));
  ck_assert(m3_rng_u64(1, 2, 3) != m3_rng_u64(1, 3, 3));
  ck_assert(m3_rng_u64(1, 2, 3) != m3_rng_u64(2, 2, 3));
  for (uint64_t r = 0; r < 10000; r++) {
    float u = m3_rng_uniform(7, 0, r);
    ck_assert(u >= 0.0f && u < 1.0f);
  }
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("ref");
  TCase *c = tcase_create("ref");
  tcase_set_timeout(c, 120);
  tcase_add_test(c, fault2_partial_rope_uses_rotary_dim);
  tcase_add_test(c, fault3_neox_pairing_every_variant);
  tcase_add_test(c, qkr_insert_slots_and_e4m3_rounding);
  tcase_add_test(c, fault23_gemma_norm_every_site);
  tcase_add_test(c, fault24_rope_table_long_positions);
  tcase_add_test(c, fault17_e4m3_encode);
  tcase_add_test(c, fault14_18_index_k_insert_then_score);
  tcase_add_test(c, fault8_short_contexts);
  tcase_add_test(c, fault6_sentinels_and_beyond_causal_ignored);
  tcase_add_test(c, topk_ties_lower_id_and_nan_last);
  tcase_add_test(c, e4m3_kv_close_to_bf16);
  tcase_add_test(c, batch_validation_errors);
  tcase_add_test(c, fault20_unbiased_weights_kept);
  tcase_add_test(c, fault21_negative_choices_flags_dtypes);
  tcase_add_test(c, fault22_swiglu_oai);
  tcase_add_test(c, mxfp8_dequant_and_w8a16);
  tcase_add_test(c, moe_layer_and_grouping);
  tcase_add_test(c, embed_gather_and_range);
  tcase_add_test(c, sampling_greedy_and_top_p);
  suite_add_tcase(s, c);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
