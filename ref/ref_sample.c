/* ref_sample.c - token choice from logits: greedy argmax and temperature +
 * top-p with a stateless counter-based generator.  The generator is keyed by
 * (seed, step, row) so a GPU thread can reproduce any row's draw on its own,
 * and every order (sort, sums) is spelled out in ref.h so a kernel that
 * follows it matches bit for bit. */
#include "ref/ref.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

static float logit_at(const void *l, int bf16, int64_t i) {
  return bf16 ? m3_bf16_to_f32(((const m3_bf16 *)l)[i]) : ((const float *)l)[i];
}

m3_status m3_ref_greedy(int64_t n_rows, int64_t vocab, const void *logits,
                        int logits_bf16, int32_t *out, m3_err *e) {
  if (n_rows < 0 || vocab <= 0 || vocab > INT32_MAX)
    return m3_errf(e, M3_INVAL, "greedy: vocab %" PRId64 " out of range", vocab);
  for (int64_t r = 0; r < n_rows; r++) {
    int64_t best = -1;
    float bv = 0.0f;
    for (int64_t i = 0; i < vocab; i++) {
      float v = logit_at(logits, logits_bf16, r * vocab + i);
      if (isnan(v)) continue;
      if (best < 0 || v > bv) { /* strict: ties keep the lower id */
        best = i;
        bv = v;
      }
    }
    if (best < 0)
      return m3_errf(e, M3_NUMERICS, "greedy: row %" PRId64 " is all NaN", r);
    out[r] = (int32_t)best;
  }
  return M3_OK;
}

static uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t m3_rng_u64(uint64_t seed, uint64_t step, uint64_t row) {
  return mix(mix(mix(seed) ^ step) ^ row);
}

float m3_rng_uniform(uint64_t seed, uint64_t step, uint64_t row) {
  return (float)(m3_rng_u64(seed, step, row) >> 40) * 0x1p-24f;
}

typedef struct { float x; int32_t id; } cand;

static int cand_cmp(const void *pa, const void *pb) {
  const cand *a = pa, *b = pb;
  if (a->x != b->x) return a->x > b->x ? -1 : 1;
  return (a->id > b->id) - (a->id < b->id);
}

m3_status m3_ref_sample_top_p(const m3_sample_args *a, const void *logits,
                              int32_t *out, m3_err *e) {
  if (!a || a->n_rows < 0 || a->vocab <= 0 || a->vocab > INT32_MAX)
    return m3_errf(e, M3_INVAL, "top-p: bad arguments");
  if (!(a->temperature > 0.0f) || !(a->top_p > 0.0f))
    return m3_ref_greedy(a->n_rows, a->vocab, logits, a->logits_bf16, out, e);
  cand *c = malloc((size_t)a->vocab * sizeof *c);
  if (!c) return m3_errf(e, M3_NOMEM, "top-p: scratch for %" PRId64 " ids", a->vocab);
  for (int64_t r = 0; r < a->n_rows; r++) {
    int64_t n = 0;
    for (int64_t i = 0; i < a->vocab; i++) {
      float v = logit_at(logits, a->logits_bf16, r * a->vocab + i) / a->temperature;
      if (isnan(v)) continue;
      c[n].x = v;
      c[n++].id = (int32_t)i;
    }
    if (!n) {
      free(c);
      return m3_errf(e, M3_NUMERICS, "top-p: row %" PRId64 " is all NaN", r);
    }
    qsort(c, (size_t)n, sizeof *c, cand_cmp);
    float mx = c[0].x, z = 0.0f;
    if (isinf(mx) && mx > 0) { /* +inf logits: they share all the mass */
      for (int64_t i = 0; i < n; i++) c[i].x = c[i].x == mx ? 1.0f : 0.0f;
    } else {
      for (int64_t i = 0; i < n; i++) c[i].x = expf(c[i].x - mx);
    }
    for (int64_t i = 0; i < n; i++) z += c[i].x;
    /* c[i].x becomes the cumulative probability c_i. */
    float cum = 0.0f;
    int64_t kept = n;
    for (int64_t i = 0; i < n; i++) {
      cum += c[i].x / z;
      c[i].x = cum;
      if (cum >= a->top_p) {
        kept = i + 1;
        break;
      }
    }
    float u = m3_rng_uniform(a->seed, a->step, (uint64_t)r);
    float thr = u * c[kept - 1].x;
    int64_t pick = kept - 1;
    for (int64_t i = 0; i < kept; i++)
      if (c[i].x > thr) {
        pick = i;
        break;
      }
    out[r] = c[pick].id;
  }
  free(c);
  return M3_OK;
}
