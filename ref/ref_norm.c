/* ref_norm.c - Gemma RMSNorm, the fused residual add + norm, and the
 * embedding gather (§2.2, §2.3, §10.2, §10.3): the row-wise operations of the
 * residual stream.  The per-head norm inside the fused qk-norm kernel calls
 * m3_ref_gemma_norm_f32 from here, so every norm site in the model shares one
 * formula (fault 23). */
#include "ref/ref.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

void m3_ref_gemma_norm_f32(int n, const float *x, const m3_bf16 *w, float eps,
                           float *y) {
  double ss = 0.0; /* fp64 on purpose: see ref.h */
  for (int k = 0; k < n; k++) ss += (double)x[k] * (double)x[k];
  float r = 1.0f / sqrtf((float)ss / (float)n + eps);
  for (int k = 0; k < n; k++) y[k] = x[k] * r * (1.0f + m3_bf16_to_f32(w[k]));
}

/* The bf16 form of m3_ref_gemma_norm_f32, reading bf16 directly so no row
 * buffer is needed; bit-identical to upcast + m3_ref_gemma_norm_f32 + round. */
static void norm_row(int n, const m3_bf16 *x, const m3_bf16 *w, float eps,
                     m3_bf16 *y) {
  double ss = 0.0;
  for (int k = 0; k < n; k++) {
    double v = m3_bf16_to_f32(x[k]);
    ss += v * v;
  }
  float r = 1.0f / sqrtf((float)ss / (float)n + eps);
  for (int k = 0; k < n; k++)
    y[k] = m3_f32_to_bf16(m3_bf16_to_f32(x[k]) * r * (1.0f + m3_bf16_to_f32(w[k])));
}

void m3_ref_rmsnorm(int64_t n_rows, int n, const m3_bf16 *x, const m3_bf16 *w,
                    float eps, m3_bf16 *y) {
  for (int64_t i = 0; i < n_rows; i++) norm_row(n, x + i * n, w, eps, y + i * n);
}

void m3_ref_add_rmsnorm(int64_t n_rows, int n, const m3_bf16 *x,
                        m3_bf16 *residual, const m3_bf16 *w, float eps,
                        m3_bf16 *y) {
  for (int64_t i = 0; i < n_rows; i++) {
    m3_bf16 *r = residual + i * n;
    const m3_bf16 *xi = x + i * n;
    for (int k = 0; k < n; k++)
      r[k] = m3_f32_to_bf16(m3_bf16_to_f32(xi[k]) + m3_bf16_to_f32(r[k]));
    /* Normalise the rounded residual (§12.10 choice, see ref.h). */
    norm_row(n, r, w, eps, y + i * n);
  }
}

m3_status m3_ref_embed(int64_t n_tokens, int hidden, int64_t vocab,
                       const int32_t *ids, const m3_bf16 *table, m3_bf16 *out,
                       m3_err *e) {
  if (hidden <= 0 || vocab <= 0)
    return m3_errf(e, M3_INVAL, "embed: hidden %d, vocab %" PRId64 " must be > 0",
                   hidden, vocab);
  for (int64_t t = 0; t < n_tokens; t++) {
    int32_t id = ids[t];
    if (id < 0 || id >= vocab)
      return m3_errf(e, M3_RANGE,
                     "embed: token %" PRId64 " has id %" PRId32
                     ", outside the vocabulary [0, %" PRId64 ")",
                     t, id, vocab);
    memcpy(out + t * hidden, table + (int64_t)id * hidden,
           (size_t)hidden * sizeof *out);
  }
  return M3_OK;
}
