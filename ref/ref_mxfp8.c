/* ref_mxfp8.c - linear layers (§8, §10.1): the fixed-order fp32 dot product
 * every reference shares, the e4m3 encode entry point, MXFP8 dequantisation,
 * and bf16 / W8A16 GEMMs.  One file because W8A16 is defined as "the bf16
 * GEMM over the dequantised weight" and must share its accumulation order.
 *
 * The GEMMs run tokens in chunks of GEMM_TILE: each chunk's activations are
 * upcast once, and each weight row is decoded once per chunk, so scratch is
 * (GEMM_TILE + 1) * cols floats whatever n is. */
#include "ref/ref.h"

#include <inttypes.h>
#include <stdlib.h>

#define GEMM_TILE 16

float m3_ref_dot_f32(const float *a, const float *b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int u = 0; u < 8; u++) acc[u] += a[k + u] * b[k + u];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
            ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; k++) s += a[k] * b[k];
  return s;
}

void m3_ref_e4m3_encode(int64_t n, const float *x, m3_e4m3 *q) {
  for (int64_t i = 0; i < n; i++) q[i] = m3_f32_to_e4m3(x[i]);
}

/* Dequantised MXFP8 row as fp32 (each value is exactly a bf16; rounding to
 * bf16 is kept so an out-of-range scale behaves like the bf16 dequant). */
static void dequant_row(int64_t cols, const m3_e4m3 *q, const uint8_t *scale,
                        float *w) {
  for (int64_t c0 = 0; c0 < cols; c0 += 32) {
    float s = m3_e8m0_to_f32(scale[c0 / 32]);
    for (int64_t c = c0; c < c0 + 32; c++)
      w[c] = m3_round_bf16(m3_e4m3_to_f32(q[c]) * s);
  }
}

m3_status m3_ref_mxfp8_dequant(int64_t rows, int64_t cols, const m3_e4m3 *q,
                               const uint8_t *scale, m3_bf16 *out, m3_err *e) {
  if (rows < 0 || cols <= 0 || cols % 32)
    return m3_errf(e, M3_INVAL, "mxfp8 dequant: [%" PRId64 ", %" PRId64 "]: cols "
                   "must be a positive multiple of 32", rows, cols);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      float s = m3_e8m0_to_f32(scale[r * (cols / 32) + c / 32]);
      out[r * cols + c] = m3_f32_to_bf16(m3_e4m3_to_f32(q[r * cols + c]) * s);
    }
  return M3_OK;
}

/* The shared GEMM: weight row r is produced into wrow by either format. */
static m3_status gemm(int64_t n, int64_t rows, int64_t cols, const m3_bf16 *x,
                      const m3_bf16 *wb, const m3_e4m3 *wq, const uint8_t *ws,
                      m3_bf16 *y, const char *what, m3_err *e) {
  if (n < 0 || rows < 0 || cols <= 0)
    return m3_errf(e, M3_INVAL, "%s: bad shape n %" PRId64 ", [%" PRId64 ", %"
                   PRId64 "]", what, n, rows, cols);
  if (wq && cols % 32)
    return m3_errf(e, M3_INVAL, "%s: cols %" PRId64 " is not a multiple of 32",
                   what, cols);
  float *xf = malloc((size_t)(GEMM_TILE + 1) * (size_t)cols * sizeof *xf);
  if (!xf) return m3_errf(e, M3_NOMEM, "%s: scratch for %" PRId64 " cols", what, cols);
  float *wrow = xf + (size_t)GEMM_TILE * cols;
  for (int64_t t0 = 0; t0 < n; t0 += GEMM_TILE) {
    int64_t nt = n - t0 < GEMM_TILE ? n - t0 : GEMM_TILE;
    for (int64_t i = 0; i < nt * cols; i++) xf[i] = m3_bf16_to_f32(x[t0 * cols + i]);
    for (int64_t r = 0; r < rows; r++) {
      if (wq) {
        dequant_row(cols, wq + r * cols, ws + r * (cols / 32), wrow);
      } else {
        const m3_bf16 *w = wb + r * cols;
        for (int64_t c = 0; c < cols; c++) wrow[c] = m3_bf16_to_f32(w[c]);
      }
      for (int64_t t = 0; t < nt; t++)
        y[(t0 + t) * rows + r] = m3_f32_to_bf16(m3_ref_dot_f32(xf + t * cols, wrow, cols));
    }
  }
  free(xf);
  return M3_OK;
}

m3_status m3_ref_gemm_bf16(int64_t n, int64_t rows, int64_t cols,
                           const m3_bf16 *x, const m3_bf16 *w, m3_bf16 *y,
                           m3_err *e) {
  return gemm(n, rows, cols, x, w, NULL, NULL, y, "bf16 gemm", e);
}

m3_status m3_ref_gemm_w8a16(int64_t n, int64_t rows, int64_t cols,
                            const m3_bf16 *x, const m3_e4m3 *q,
                            const uint8_t *scale, m3_bf16 *y, m3_err *e) {
  if (!q || !scale) return m3_errf(e, M3_INVAL, "w8a16 gemm: no weight or scale");
  return gemm(n, rows, cols, x, NULL, q, scale, y, "w8a16 gemm", e);
}

m3_status m3_ref_linear(int64_t n, const m3_bf16 *x, const m3_ref_weight *w,
                        m3_bf16 *y, m3_err *e) {
  if (!w || !w->bf16 == !w->q)
    return m3_errf(e, M3_INVAL, "linear: the weight must be exactly one of bf16 "
                   "or MXFP8");
  if (w->bf16) return m3_ref_gemm_bf16(n, w->rows, w->cols, x, w->bf16, y, e);
  return m3_ref_gemm_w8a16(n, w->rows, w->cols, x, w->q, w->scale, y, e);
}
