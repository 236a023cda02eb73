/* check_qknorm_gpu.c - the fused qk-norm + RoPE (+ insert) kernel against
 * m3_ref_qknorm_rope: every variant the real config needs x T in {1, 7, 128,
 * 4096}, every valid tile, positions up to 1,048,575, padding rows, NeoX
 * pairing (known-faults #2, #3), short metadata (#5), caches past 2 GiB (#15)
 * and positions outside the table (#24).  Tolerances: bf16 stores <= 2 ulp of
 * the reference or <= 1e-5 absolute (same rounding contract; rsqrtf and FMA
 * differ in the last fp32 bits), e4m3 stores <= 1 code step; poisoned (never written) bytes must stay
 * poisoned; any NaN where the reference is finite fails. */
#include <math.h>
#include <string.h>

#include "runtime/ops.h"
#include "tests/gpu_main.h"

GPU_TEST_GLOBALS

#define MAXPOS (1 << 20)
static m3_bf16 *h_tab, *h_toy;
static void *d_tab, *d_toy;

static m3_qkr_args base_args(int sparse, int insert, int kv8, int idx8, int n) {
  m3_qkr_args a = {.n_tokens = n, .nq = 64, .nkv = 4, .niq = sparse ? 4 : 0, .head_dim = 128, .rotary_dim = 64,
                   .block_size = 128, .eps = 1e-6f, .insert = insert, .kv_e4m3 = kv8, .idx_e4m3 = idx8};
  return a;
}

/* The 9 variants of the real config (templates/qknorm_rope.lua variants()). */
static m3_qkr_args variant_args(int i, int n) {
  static const int v[9][4] = {{0, 0, 0, 0}, {0, 1, 0, 0}, {0, 1, 1, 0}, {1, 0, 0, 0}, {1, 1, 0, 0},
                              {1, 1, 1, 0}, {1, 0, 0, 1}, {1, 1, 0, 1}, {1, 1, 1, 1}};
  return base_args(v[i][0], v[i][1], v[i][2], v[i][3], n);
}

static size_t row_of(const m3_qkr_args *a) {
  return (size_t)(a->nq + 2 * a->nkv + (a->niq ? a->niq + 1 : 0)) * a->head_dim;
}

typedef struct {
  int pad_every;        /* insert: every k-th row is padding (slot -1); 0 none */
  int q_out, iq_out;    /* give the contiguous outputs */
  int64_t page_base;    /* first page used (large: >2 GiB offsets) */
  const char *tile;     /* NULL: default */
  int toy;              /* theta 10000 table, caller-filled input */
  const m3_bf16 *qkv_in;/* optional fixed input [N,row] */
  const int64_t *pos_in;/* optional fixed positions */
  m3_bf16 *q_result;    /* optional: receives GPU q (q_out or in place) */
} opts_t;

static void compare(const char *what, const void *out, const void *ref, size_t n, int e4m3, const char *ctx) {
  /* atol 1e-5: head vectors are unit-RMS after the norm; an FMA where x*c and
   * y*s nearly cancel moves the fp32 result by ~1 fp32 ulp of the products. */
  m3_cmp c = e4m3 ? m3_cmp_e4m3_steps(out, ref, n, 1) : m3_cmp_bf16_tol(out, ref, n, 2.0, 1e-5);
  char s[256];
  m3_cmp_str(&c, s, sizeof s);
  ck_assert_msg(c.bad == 0, "%s: %s: %s", ctx, what, s);
}

/* Offset of the first byte that is not poison (0xff), or n. */
static size_t first_written(const uint8_t *p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, p + i, 8);
    if (w != ~(uint64_t)0) break;
  }
  for (; i < n; i++)
    if (p[i] != 0xff) return i;
  return n;
}

/* The same over device memory, downloaded in 256 MB pieces. */
static size_t dev_first_written(const void *d, size_t n) {
  const size_t piece = (size_t)256 << 20;
  uint8_t *h = malloc(n < piece ? (n ? n : 1) : piece);
  size_t at = n;
  for (size_t i = 0; i < n && at == n; i += piece) {
    size_t len = n - i < piece ? n - i : piece;
    GPU_CHECK(m3_dev_download(h, (const uint8_t *)d + i, len, &e_));
    size_t f = first_written(h, len);
    if (f < len) at = i + f;
  }
  free(h);
  return at;
}

static void run(m3_qkr_args a, opts_t o) {
  m3_err e;
  const int N = a.n_tokens, hd = a.head_dim, bs = a.block_size;
  const size_t row = row_of(&a), kvb = a.kv_e4m3 ? 1 : 2, ixb = a.idx_e4m3 ? 1 : 2;
  m3_rng r = {g_seed ^ (uint64_t)N * 7919 ^ (uint64_t)a.niq * 31 ^ (uint64_t)a.insert * 131 ^ (uint64_t)a.kv_e4m3 * 17 ^ (uint64_t)a.idx_e4m3};
  const int64_t pages = (N + bs - 1) / bs + 2, npages_alloc = o.page_base + pages;
  const size_t kv_elems = (size_t)npages_alloc * a.nkv * bs * 2 * hd, ix_elems = (size_t)npages_alloc * bs * hd;
  /* The host holds only the window of pages the slots map into: a cache
   * placed past 2 GiB (#15) is 18 GB on the device, not on the host too. */
  const size_t kv_off = (size_t)o.page_base * a.nkv * bs * 2 * hd, ix_off = (size_t)o.page_base * bs * hd;
  const size_t kv_win = kv_elems - kv_off, ix_win = ix_elems - ix_off;

  m3_bf16 *qkv = malloc(sizeof *qkv * N * row), *qkv_ref = malloc(sizeof *qkv * N * row);
  m3_bf16 w[4][128];
  int64_t *pos = malloc(sizeof *pos * N), *slot = malloc(sizeof *slot * N), *islot = malloc(sizeof *islot * N);
  if (o.qkv_in) memcpy(qkv, o.qkv_in, sizeof *qkv * N * row);
  else m3_fill_bf16(&r, qkv, (size_t)N * row, 1.0f);
  for (int i = 0; i < 4; i++) {
    if (o.toy) memset(w[i], 0, sizeof w[i]);
    else m3_fill_bf16(&r, w[i], 128, 0.2f);
  }
  const int64_t maxpos = o.toy ? 4096 : MAXPOS;
  for (int t = 0; t < N; t++) pos[t] = o.pos_in ? o.pos_in[t] : (int64_t)(m3_rng_next(&r) % (uint64_t)maxpos);
  if (!o.pos_in && N > 1) pos[0] = maxpos - 1, pos[1] = 0;
  /* Distinct random slots inside pages [page_base, page_base + pages). */
  int64_t nslots = pages * bs;
  int64_t *perm = malloc(sizeof *perm * nslots), *perm2 = malloc(sizeof *perm2 * nslots);
  for (int64_t i = 0; i < nslots; i++) perm[i] = perm2[i] = o.page_base * bs + i;
  for (int64_t i = nslots - 1; i > 0; i--) {
    int64_t j = (int64_t)(m3_rng_next(&r) % (uint64_t)(i + 1)), t = perm[i];
    perm[i] = perm[j], perm[j] = t;
    j = (int64_t)(m3_rng_next(&r) % (uint64_t)(i + 1)), t = perm2[i];
    perm2[i] = perm2[j], perm2[j] = t;
  }
  for (int t = 0; t < N; t++) {
    slot[t] = perm[t];
    islot[t] = perm2[t];
    if (a.insert && o.pad_every && t % o.pad_every == o.pad_every - 1) slot[t] = islot[t] = -1;
  }
  memcpy(qkv_ref, qkv, sizeof *qkv * N * row);

  uint8_t *kv_ref = malloc(kv_win * kvb), *ix_ref = malloc(ix_win * ixb);
  memset(kv_ref, 0xff, kv_win * kvb);
  memset(ix_ref, 0xff, ix_win * ixb);
  int64_t *slot_ref = malloc(sizeof *slot_ref * N), *islot_ref = malloc(sizeof *islot_ref * N);
  for (int t = 0; t < N; t++) {
    slot_ref[t] = slot[t] < 0 ? -1 : slot[t] - o.page_base * bs;
    islot_ref[t] = islot[t] < 0 ? -1 : islot[t] - o.page_base * bs;
  }
  m3_bf16 *qo_ref = malloc(sizeof(m3_bf16) * N * a.nq * hd);
  uint8_t *iqo_ref = malloc((size_t)N * (a.niq ? a.niq : 1) * hd * ixb);
  memset(qo_ref, 0xff, sizeof(m3_bf16) * N * a.nq * hd);
  memset(iqo_ref, 0xff, (size_t)N * (a.niq ? a.niq : 1) * hd * ixb);

  /* The reference reads the table for every row; a padding row's position
   * may be anything (2^31-1 in #5), and its results are discarded below. */
  int64_t *ref_pos = malloc(sizeof *ref_pos * N);
  for (int t = 0; t < N; t++) ref_pos[t] = (a.insert && slot[t] < 0) || pos[t] < 0 || pos[t] >= maxpos ? 0 : pos[t];
  m3_ref_qknorm_rope(&a, qkv_ref, w[0], w[1], a.niq ? w[2] : NULL, a.niq ? w[3] : NULL, o.toy ? h_toy : h_tab, ref_pos,
                     a.insert ? slot_ref : NULL, a.insert ? islot_ref : NULL, kv_ref, ix_ref, o.q_out ? qo_ref : NULL,
                     o.iq_out ? iqo_ref : NULL);
  /* The kernel's contract differs from the reference's on purpose (ops.h):
   * with q_out, qkv's q stays raw; with index_q_out, qkv's iq stays raw;
   * padding rows are skipped entirely. */
  for (int t = 0; t < N; t++) {
    m3_bf16 *rr = qkv_ref + (size_t)t * row, *orig = qkv + (size_t)t * row;
    int pad = a.insert && slot[t] < 0;
    if (pad) {
      memcpy(rr, orig, sizeof *rr * row);
      memset(qo_ref + (size_t)t * a.nq * hd, 0xff, sizeof(m3_bf16) * a.nq * hd);
      if (a.niq) memset(iqo_ref + (size_t)t * a.niq * hd * ixb, 0xff, (size_t)a.niq * hd * ixb);
      continue;
    }
    if (o.q_out) memcpy(rr, orig, sizeof *rr * a.nq * hd);
    if (a.niq && o.iq_out) {
      size_t off = (size_t)(a.nq + 2 * a.nkv) * hd;
      memcpy(rr + off, orig + off, sizeof *rr * a.niq * hd);
    }
  }

  void *d_qkv, *d_w, *d_pos, *d_slot, *d_islot, *d_kv, *d_ix, *d_qo, *d_iqo;
  GPU_CHECK(m3_dev_alloc(&d_qkv, sizeof(m3_bf16) * N * row, &e_));
  GPU_CHECK(m3_dev_alloc(&d_w, sizeof w, &e_));
  GPU_CHECK(m3_dev_alloc(&d_pos, sizeof *pos * N, &e_));
  GPU_CHECK(m3_dev_alloc(&d_slot, sizeof *slot * N, &e_));
  GPU_CHECK(m3_dev_alloc(&d_islot, sizeof *islot * N, &e_));
  GPU_CHECK(m3_dev_alloc(&d_kv, kv_elems * kvb, &e_));
  GPU_CHECK(m3_dev_alloc(&d_ix, ix_elems * ixb, &e_));
  GPU_CHECK(m3_dev_alloc(&d_qo, sizeof(m3_bf16) * N * a.nq * hd, &e_));
  GPU_CHECK(m3_dev_alloc(&d_iqo, (size_t)N * (a.niq ? a.niq : 1) * hd * ixb, &e_));
  GPU_CHECK(m3_dev_upload(d_qkv, qkv, sizeof(m3_bf16) * N * row, &e_));
  GPU_CHECK(m3_dev_upload(d_w, w, sizeof w, &e_));
  GPU_CHECK(m3_dev_upload(d_pos, pos, sizeof *pos * N, &e_));
  GPU_CHECK(m3_dev_upload(d_slot, slot, sizeof *slot * N, &e_));
  GPU_CHECK(m3_dev_upload(d_islot, islot, sizeof *islot * N, &e_));
  GPU_CHECK(m3_dev_poison(d_kv, kv_elems * kvb, &e_));
  GPU_CHECK(m3_dev_poison(d_ix, ix_elems * ixb, &e_));
  GPU_CHECK(m3_dev_poison(d_qo, sizeof(m3_bf16) * N * a.nq * hd, &e_));
  GPU_CHECK(m3_dev_poison(d_iqo, (size_t)N * (a.niq ? a.niq : 1) * hd * ixb, &e_));

  m3_variant v;
  ck_assert_int_eq(m3_qknorm_key(&a, &v, &e), M3_OK);
  if (o.tile) ck_assert_int_eq(m3_variant_parse_tile(&v, o.tile, &e), M3_OK);
  m3_kernel *k;
  GPU_CHECK(m3_rt_kernel(&g_rt, &v, NULL, &k, &e_));
  char ctx[1200];
  m3_variant_print(&k->key, ctx, sizeof ctx);
  snprintf(ctx + strlen(ctx), sizeof ctx - strlen(ctx), " T=%d seed=%llu", N, (unsigned long long)g_seed);
  m3_bf16 *dw = d_w;
  GPU_CHECK(m3_launch_qknorm_rope(k, &a, d_qkv, dw, dw + 128, a.niq ? dw + 256 : NULL, a.niq ? dw + 384 : NULL,
                                  o.toy ? d_toy : d_tab, maxpos, d_pos, a.insert ? d_slot : NULL,
                                  a.insert ? d_islot : NULL, d_kv, d_ix, o.q_out ? d_qo : NULL,
                                  o.iq_out ? d_iqo : NULL, g_rt.stream, &e_));
  ck_assert_int_eq(cudaStreamSynchronize(g_rt.stream), cudaSuccess);

  m3_bf16 *g_qkv = malloc(sizeof *g_qkv * N * row), *g_qo = malloc(sizeof(m3_bf16) * N * a.nq * hd);
  uint8_t *g_kv = malloc(kv_win * kvb), *g_ix = malloc(ix_win * ixb),
          *g_iqo = malloc((size_t)N * (a.niq ? a.niq : 1) * hd * ixb);
  GPU_CHECK(m3_dev_download(g_qkv, d_qkv, sizeof *g_qkv * N * row, &e_));
  GPU_CHECK(m3_dev_download(g_qo, d_qo, sizeof(m3_bf16) * N * a.nq * hd, &e_));
  GPU_CHECK(m3_dev_download(g_kv, (uint8_t *)d_kv + kv_off * kvb, kv_win * kvb, &e_));
  GPU_CHECK(m3_dev_download(g_ix, (uint8_t *)d_ix + ix_off * ixb, ix_win * ixb, &e_));
  GPU_CHECK(m3_dev_download(g_iqo, d_iqo, (size_t)N * (a.niq ? a.niq : 1) * hd * ixb, &e_));

  compare("qkv (in place parts, untouched parts)", g_qkv, qkv_ref, (size_t)N * row, 0, ctx);
  if (o.q_out) compare("q_out", g_qo, qo_ref, (size_t)N * a.nq * hd, 0, ctx);
  if (a.niq && o.iq_out) compare("index_q_out", g_iqo, iqo_ref, (size_t)N * a.niq * hd, a.idx_e4m3, ctx);
  if (a.insert) {
    compare("kv_cache", g_kv, kv_ref, kv_win, a.kv_e4m3, ctx);
    if (a.niq) compare("index_cache", g_ix, ix_ref, ix_win, a.idx_e4m3, ctx);
  } else {
    ck_assert_msg(first_written(g_kv, kv_win * kvb) == kv_win * kvb, "%s: kv_cache written without insert", ctx);
    ck_assert_msg(first_written(g_ix, ix_win * ixb) == ix_win * ixb, "%s: index_cache written without insert", ctx);
  }
  /* Nothing at all below page_base (a 32-bit offset would wrap there). */
  size_t at = dev_first_written(d_kv, kv_off * kvb);
  ck_assert_msg(at == kv_off * kvb, "%s: kv_cache byte %zu written outside the mapped pages", ctx, at);
  at = dev_first_written(d_ix, ix_off * ixb);
  ck_assert_msg(at == ix_off * ixb, "%s: index_cache byte %zu written outside the mapped pages", ctx, at);
  if (o.q_result) {
    for (int t = 0; t < N; t++)
      memcpy(o.q_result + (size_t)t * row, o.q_out ? g_qo + (size_t)t * a.nq * hd : g_qkv + (size_t)t * row,
             sizeof(m3_bf16) * a.nq * hd);
    for (int t = 0; t < N; t++)
      memcpy(o.q_result + (size_t)t * row + a.nq * hd, g_qkv + (size_t)t * row + a.nq * hd,
             sizeof(m3_bf16) * (row - (size_t)a.nq * hd));
  }

  m3_dev_free(d_qkv); m3_dev_free(d_w); m3_dev_free(d_pos); m3_dev_free(d_slot); m3_dev_free(d_islot);
  m3_dev_free(d_kv); m3_dev_free(d_ix); m3_dev_free(d_qo); m3_dev_free(d_iqo);
  free(qkv); free(qkv_ref); free(pos); free(ref_pos); free(slot); free(islot); free(perm); free(perm2);
  free(kv_ref); free(ix_ref); free(slot_ref); free(islot_ref); free(qo_ref); free(iqo_ref);
  free(g_qkv); free(g_qo); free(g_kv); free(g_ix); free(g_iqo);
}

static const int Ts[] = {1, 7, 128, 4096};

START_TEST(every_variant_every_T) {
  int vi = _i / 4, T = Ts[_i % 4];
  if (m3_test_emulated() && T > 128) return; /* the CPU emulator: small shapes */
  run(variant_args(vi, T), (opts_t){.pad_every = 7, .q_out = 1, .iq_out = 1});
  /* Several heads a warp (lane groups of 8 or 16) take another code path,
   * and lph=8 two lane layouts (rope): every one at every T. */
  static const char *const groupings[] = {"warps=4,hpw=1,lph=8,rope=pair", "warps=4,hpw=2,lph=16,rope=pair",
                                          "warps=2,hpw=2,lph=8,rope=pair", "warps=2,hpw=2,lph=8,rope=bal",
                                          "warps=4,hpw=1,lph=8,rope=bal"};
  for (int g = 0; g < 5; g++)
    run(variant_args(vi, T), (opts_t){.pad_every = 7, .q_out = 1, .iq_out = 1, .tile = groupings[g]});
}
END_TEST

START_TEST(in_place_outputs) {
  /* No q_out / index_q_out: q and (bf16) index-q are written in place. */
  m3_qkr_args a = variant_args(_i == 0 ? 1 : 4, 77);
  run(a, (opts_t){.pad_every = 5});
}
END_TEST

START_TEST(every_valid_tile_same_answer) {
  m3_qkr_args a = variant_args(_i, 37);
  m3_variant v, *tiles;
  int n;
  m3_err e;
  ck_assert_int_eq(m3_qknorm_key(&a, &v, &e), M3_OK);
  snprintf(v.arch, sizeof v.arch, "%s", g_rt.dev.arch);
  ck_assert_int_eq(m3_render_tiles(g_rt.jit.lua, &v, &tiles, &n, &e), M3_OK);
  int ran = 0;
  if (m3_test_emulated()) a.n_tokens = 9;
  for (int i = 0; i < n; i++) {
    if (m3_render_valid(g_rt.jit.lua, &tiles[i], NULL, 0, &e) != M3_OK) continue;
    char t[256];
    m3_variant_print_tile(&tiles[i], t, sizeof t);
    run(a, (opts_t){.pad_every = 3, .q_out = 1, .iq_out = 1, .tile = t});
    ran++;
  }
  ck_assert_int_gt(ran, 1);
  free(tiles);
}
END_TEST

/* known-faults #3: NeoX pairing (m, m+32), theta 10000, position 1, in every
 * variant and every head slot; #2: rotary_dim (not head_dim) convention at
 * positions 0, 700, 1000, 2355 with an all-ones input. */
START_TEST(neox_pairing_every_variant) {
  m3_qkr_args a = variant_args(_i % 9, 1);
  /* lph=32 (partner 2 lanes away), then lph=8 with the partner in the same
   * lane (pair) or all 8 lanes rotating (bal: the default tile) */
  static const char *const tiles[] = {"warps=4,hpw=1,lph=32,rope=pair", "warps=4,hpw=1,lph=8,rope=pair",
                                      "warps=4,hpw=1,lph=8,rope=bal"};
  const char *tile = tiles[_i / 9];
  size_t row = row_of(&a);
  m3_bf16 *in = calloc(row, sizeof *in), *got = calloc(row, sizeof *got);
  for (size_t h = 0; h < row / 128; h++) {
    in[h * 128 + 0] = m3_f32_to_bf16(1), in[h * 128 + 1] = m3_f32_to_bf16(2);
    in[h * 128 + 32] = m3_f32_to_bf16(3), in[h * 128 + 33] = m3_f32_to_bf16(4);
  }
  int64_t p1 = 1;
  run(a, (opts_t){.toy = 1, .qkv_in = in, .pos_in = &p1, .q_out = 1, .iq_out = 0, .q_result = got, .tile = tile});
  const float want[4] = {-4.09836f, -2.60827f, 5.08627f, 8.86173f};
  const int dims[4] = {0, 1, 32, 33};
  int v_first = a.nq + a.nkv, v_end = a.nq + 2 * a.nkv; /* V heads are not rotated */
  for (size_t h = 0; h < row / 128; h++) {
    if ((int)h >= v_first && (int)h < v_end) continue;
    if (a.niq && (int)h >= v_end && (int)h < v_end + a.niq) continue; /* index-q went to in-place? only if no iq_out */
    for (int i = 0; i < 4; i++) {
      float g = m3_bf16_to_f32(got[h * 128 + dims[i]]);
      ck_assert_msg(fabsf(g - want[i]) <= fabsf(want[i]) * 0x1p-7f, "head %zu dim %d: %f, NeoX wants %f", h, dims[i], g, want[i]);
    }
  }
  free(in);
  free(got);
  /* #2 */
  const int64_t ps[4] = {0, 700, 1000, 2355};
  for (int p = 0; p < 4; p++) {
    m3_bf16 *ones = malloc(row * sizeof *ones), *out = calloc(row, sizeof *out);
    for (size_t i = 0; i < row; i++) ones[i] = m3_f32_to_bf16(1.0f);
    run(a, (opts_t){.toy = 1, .qkv_in = ones, .pos_in = &ps[p], .q_out = 1, .q_result = out, .tile = tile});
    if (ps[p] == 1000) {
      const float exp_[3][3] = {{0, -0.26450f, 1.38926f}, {1, -1.39592f, 0.22676f}, {31, 0.85816f, 1.12408f}};
      for (int i = 0; i < 3; i++) {
        int d = (int)exp_[i][0];
        ck_assert_msg(fabsf(m3_bf16_to_f32(out[d]) - exp_[i][1]) <= 0.0079f, "pos 1000 dim %d: %f want %f", d, m3_bf16_to_f32(out[d]), exp_[i][1]);
        ck_assert_msg(fabsf(m3_bf16_to_f32(out[d + 32]) - exp_[i][2]) <= 0.0079f, "pos 1000 dim %d: %f", d + 32, m3_bf16_to_f32(out[d + 32]));
      }
      for (int d = 64; d < 128; d++) ck_assert_msg(fabsf(m3_bf16_to_f32(out[d]) - 1.0f) < 0.004f, "dim %d not passed through", d);
    }
    free(ones);
    free(out);
  }
}
END_TEST

/* known-faults #5: 512 activation rows, 509 mapped: exactly 509 slots written,
 * the NaN rows 509..511 never reach a cache; and a padding row with position
 * 2^31-1 is skipped (compute-sanitizer proves no table read). */
START_TEST(short_metadata_and_padding) {
  m3_qkr_args a = variant_args(7, 509); /* sparse, insert, bf16 caches, e4m3 index */
  run(a, (opts_t){.q_out = 1, .iq_out = 1});
  int64_t pos[3] = {5, (int64_t)2147483647, 9};
  m3_qkr_args b = variant_args(4, 3);
  opts_t o = {.pad_every = 2, .q_out = 1, .iq_out = 1, .pos_in = pos}; /* row 1 is padding */
  run(b, o);
  /* The same with 4 heads a warp: dropped slots still join the group's shuffles. */
  run(a, (opts_t){.q_out = 1, .iq_out = 1, .tile = "warps=2,hpw=1,lph=8,rope=pair"});
  o.tile = "warps=2,hpw=1,lph=8,rope=pair";
  run(b, o);
  run(a, (opts_t){.q_out = 1, .iq_out = 1, .tile = "warps=2,hpw=1,lph=8,rope=bal"});
  o.tile = "warps=2,hpw=1,lph=8,rope=bal";
  run(b, o);
}
END_TEST

/* known-faults #15: pages past 2 GiB of cache are addressed in 64 bits. */
START_TEST(cache_offsets_past_2GiB) {
  if (m3_test_emulated()) return; /* 18 GB of (emulated) device memory: GPU only */
  m3_qkr_args a = variant_args(_i ? 8 : 4, 130);
  run(a, (opts_t){.q_out = 1, .iq_out = 1, .page_base = 70000});
}
END_TEST


/* The unfused dense-layer insert (templates/kv_insert.lua): qknorm_rope with
 * insert=0 then kv_insert gives bit for bit the cache of the fused kernel,
 * and the reference's (m3_ref_qknorm_rope then m3_ref_kv_insert); padding
 * rows write nothing; every valid kv_insert tile gives the same bytes. */
START_TEST(unfused_insert_equals_fused) {
  static const int Tn[3] = {1, 7, 128};
  const int kv8 = _i & 1, N = Tn[_i >> 1];
  m3_err e;
  m3_qkr_args fused = base_args(0, 1, kv8, 0, N), plain = base_args(0, 0, 0, 0, N), ins = fused;
  const int hd = 128, bs = 128;
  const size_t row = row_of(&fused), kvb = kv8 ? 1 : 2;
  const int64_t pages = (N + bs - 1) / bs + 1;
  const size_t kv_bytes = (size_t)pages * fused.nkv * bs * 2 * hd * kvb;
  m3_rng r = {g_seed ^ 0x1a5e7ull ^ (uint64_t)_i};
  m3_bf16 *qkv = malloc(sizeof *qkv * N * row), w[2][128];
  int64_t *pos = malloc(sizeof *pos * N), *slot = malloc(sizeof *slot * N);
  m3_fill_bf16(&r, qkv, (size_t)N * row, 1.0f);
  m3_fill_bf16(&r, w[0], 128, 0.2f);
  m3_fill_bf16(&r, w[1], 128, 0.2f);
  for (int t = 0; t < N; t++) {
    pos[t] = (int64_t)(m3_rng_next(&r) % MAXPOS);
    slot[t] = t % 5 == 3 ? -1 : (int64_t)((t * 37 + 11) % (pages * bs)); /* 37 odd: distinct slots */
  }
  /* Reference: norm+RoPE in place, then the insert. */
  m3_bf16 *rq = malloc(sizeof *rq * N * row);
  uint8_t *ref = malloc(kv_bytes), *got_f = malloc(kv_bytes), *got_u = malloc(kv_bytes);
  memcpy(rq, qkv, sizeof *rq * N * row);
  memset(ref, 0xff, kv_bytes);
  m3_ref_qknorm_rope(&plain, rq, w[0], w[1], NULL, NULL, h_tab, pos, NULL, NULL, NULL, NULL, NULL, NULL);
  m3_ref_kv_insert(&ins, rq, slot, ref);

  void *d_qkv, *d_w, *d_pos, *d_slot, *d_kv;
  GPU_CHECK(m3_dev_alloc(&d_qkv, sizeof *qkv * N * row, &e_));
  GPU_CHECK(m3_dev_alloc(&d_w, sizeof w, &e_));
  GPU_CHECK(m3_dev_alloc(&d_pos, sizeof *pos * N, &e_));
  GPU_CHECK(m3_dev_alloc(&d_slot, sizeof *slot * N, &e_));
  GPU_CHECK(m3_dev_alloc(&d_kv, kv_bytes, &e_));
  GPU_CHECK(m3_dev_upload(d_w, w, sizeof w, &e_));
  GPU_CHECK(m3_dev_upload(d_pos, pos, sizeof *pos * N, &e_));
  GPU_CHECK(m3_dev_upload(d_slot, slot, sizeof *slot * N, &e_));
  m3_bf16 *dw = d_w;
  m3_variant vf, vp, vi, *tiles;
  m3_kernel *kf, *kp, *ki;
  ck_assert_int_eq(m3_qknorm_key(&fused, &vf, &e), M3_OK);
  ck_assert_int_eq(m3_qknorm_key(&plain, &vp, &e), M3_OK);
  ck_assert_int_eq(m3_kv_insert_key(&ins, &vi, &e), M3_OK);
  GPU_CHECK(m3_rt_kernel(&g_rt, &vf, NULL, &kf, &e_));
  GPU_CHECK(m3_rt_kernel(&g_rt, &vp, NULL, &kp, &e_));
  char ctx[600];
  m3_variant_print(&vi, ctx, sizeof ctx);
  snprintf(ctx + strlen(ctx), sizeof ctx - strlen(ctx), " T=%d seed=%llu", N, (unsigned long long)g_seed);

  /* Fused. */
  GPU_CHECK(m3_dev_upload(d_qkv, qkv, sizeof *qkv * N * row, &e_));
  GPU_CHECK(m3_dev_poison(d_kv, kv_bytes, &e_));
  GPU_CHECK(m3_launch_qknorm_rope(kf, &fused, d_qkv, dw, dw + 128, NULL, NULL, d_tab, MAXPOS, d_pos, d_slot, NULL,
                                  d_kv, NULL, NULL, NULL, g_rt.stream, &e_));
  ck_assert_int_eq(cudaStreamSynchronize(g_rt.stream), cudaSuccess);
  GPU_CHECK(m3_dev_download(got_f, d_kv, kv_bytes, &e_));
  ck_assert_msg(memcmp(got_f, ref, kv_bytes) == 0, "%s: fused insert differs from the reference", ctx);

  /* Unfused, every valid kv_insert tile. */
  snprintf(vi.arch, sizeof vi.arch, "%s", g_rt.dev.arch);
  int nt, ran = 0;
  ck_assert_int_eq(m3_render_tiles(g_rt.jit.lua, &vi, &tiles, &nt, &e), M3_OK);
  for (int i = 0; i < nt; i++) {
    if (m3_render_valid(g_rt.jit.lua, &tiles[i], NULL, 0, &e) != M3_OK) continue;
    GPU_CHECK(m3_dev_upload(d_qkv, qkv, sizeof *qkv * N * row, &e_));
    GPU_CHECK(m3_dev_poison(d_kv, kv_bytes, &e_));
    GPU_CHECK(m3_rt_kernel(&g_rt, &tiles[i], NULL, &ki, &e_));
    GPU_CHECK(m3_launch_qknorm_rope(kp, &plain, d_qkv, dw, dw + 128, NULL, NULL, d_tab, MAXPOS, d_pos, NULL, NULL,
                                    NULL, NULL, NULL, NULL, g_rt.stream, &e_));
    GPU_CHECK(m3_launch_kv_insert(ki, &ins, d_qkv, d_slot, d_kv, g_rt.stream, &e_));
    ck_assert_int_eq(cudaStreamSynchronize(g_rt.stream), cudaSuccess);
    GPU_CHECK(m3_dev_download(got_u, d_kv, kv_bytes, &e_));
    char t[64];
    m3_variant_print_tile(&tiles[i], t, sizeof t);
    ck_assert_msg(memcmp(got_u, got_f, kv_bytes) == 0, "%s [%s]: unfused insert differs from the fused one", ctx, t);
    ran++;
  }
  ck_assert_int_gt(ran, 1);
  free(tiles);
  m3_qkr_args bad = base_args(1, 1, 0, 0, N);
  ck_assert_int_eq(m3_launch_kv_insert(ki, &bad, d_qkv, d_slot, d_kv, g_rt.stream, &e), M3_INVAL);
  m3_dev_free(d_qkv); m3_dev_free(d_w); m3_dev_free(d_pos); m3_dev_free(d_slot); m3_dev_free(d_kv);
  free(qkv); free(pos); free(slot); free(rq); free(ref); free(got_f); free(got_u);
}
END_TEST

static Suite *make(void) {
  Suite *s = suite_create("qknorm_rope_gpu");
  TCase *tc = tcase_create("kernel");
  tcase_set_timeout(tc, 1200);
  tcase_add_loop_test(tc, every_variant_every_T, 0, 9 * 4);
  tcase_add_loop_test(tc, in_place_outputs, 0, 2);
  tcase_add_loop_test(tc, every_valid_tile_same_answer, 0, 9);
  tcase_add_loop_test(tc, neox_pairing_every_variant, 0, 27);
  tcase_add_test(tc, short_metadata_and_padding);
  tcase_add_loop_test(tc, cache_offsets_past_2GiB, 0, 2);
  tcase_add_loop_test(tc, unfused_insert_equals_fused, 0, 6);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  if (m3_gpu_count() == 0) return gpu_test_main("check_qknorm_gpu", make);
  h_tab = malloc(sizeof *h_tab * (size_t)MAXPOS * 64);
  h_toy = malloc(sizeof *h_toy * 4096 * 64);
  m3_rope_table(5e6f, 64, MAXPOS, h_tab);
  m3_rope_table(10000.0f, 64, 4096, h_toy);
  m3_err e;
  if (m3_gpu_count() > 0) {
    cudaSetDevice(0);
    if (m3_dev_alloc(&d_tab, sizeof *h_tab * (size_t)MAXPOS * 64, &e) != M3_OK ||
        m3_dev_upload(d_tab, h_tab, sizeof *h_tab * (size_t)MAXPOS * 64, &e) != M3_OK ||
        m3_dev_alloc(&d_toy, sizeof *h_toy * 4096 * 64, &e) != M3_OK ||
        m3_dev_upload(d_toy, h_toy, sizeof *h_toy * 4096 * 64, &e) != M3_OK) {
      fprintf(stderr, "%s\n", e.msg);
      return 1;
    }
  }
  return gpu_test_main("check_qknorm_gpu", make);
}
