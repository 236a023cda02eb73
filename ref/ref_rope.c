/* ref_rope.c - the RoPE cos/sin table and the fused qk-norm + RoPE (+ insert)
 * reference (§3.3, §3.4, §4, §10.4, §10.5).  The table and the fused kernel
 * live together because the kernel's bits are decided by how the table was
 * built: bf16 cos/sin from a single fp32 angle product. */
#include "ref/ref.h"

#include <math.h>
#include <stddef.h>

void m3_rope_inv_freq(float theta, int rotary_dim, float *inv_freq) {
  /* Op by op as torch builds it in fp32 (spec §10.5): exponent = fp32 divide,
   * pow in fp32, fp32 reciprocal. */
  for (int m = 0; m < rotary_dim / 2; m++) {
    float ex = (float)(2 * m) / (float)rotary_dim;
    inv_freq[m] = 1.0f / powf(theta, ex);
  }
}

void m3_rope_table(float theta, int rotary_dim, int64_t max_pos, m3_bf16 *table) {
  int half = rotary_dim / 2;
  float inv[512];
  if (half > 512) half = 512; /* rotary_dim <= head_dim <= 1024; never hit */
  m3_rope_inv_freq(theta, 2 * half, inv);
  for (int64_t p = 0; p < max_pos; p++) {
    m3_bf16 *row = table + p * (int64_t)rotary_dim;
    float fp = (float)p; /* exact up to 2^24, far beyond max_position */
    for (int m = 0; m < half; m++) {
      float ang = fp * inv[m]; /* the single fp32 multiply of the spec */
      float s, c;
      sincosf(ang, &s, &c);
      row[m] = m3_f32_to_bf16(c);
      row[half + m] = m3_f32_to_bf16(s);
    }
  }
}

/* Norm + RoPE of one head: x [hd] fp32 in/out, cs = the table row. */
static void norm_rope(int hd, int rd, float *x, const m3_bf16 *w, float eps,
                      const m3_bf16 *cs) {
  m3_ref_gemma_norm_f32(hd, x, w, eps, x);
  int half = rd / 2;
  for (int m = 0; m < half; m++) {
    float c = m3_bf16_to_f32(cs[m]), s = m3_bf16_to_f32(cs[half + m]);
    float a = x[m], b = x[m + half];
    x[m] = a * c - b * s;
    x[m + half] = b * c + a * s;
  }
}

static void load(int hd, const m3_bf16 *src, float *x) {
  for (int d = 0; d < hd; d++) x[d] = m3_bf16_to_f32(src[d]);
}

static void store_bf16(int hd, const float *x, m3_bf16 *dst) {
  for (int d = 0; d < hd; d++) dst[d] = m3_f32_to_bf16(x[d]);
}

static void store_e4m3(int hd, const float *x, m3_e4m3 *dst) {
  for (int d = 0; d < hd; d++) dst[d] = m3_f32_to_e4m3(x[d]);
}

void m3_ref_qknorm_rope(const m3_qkr_args *a, m3_bf16 *qkv, const m3_bf16 *q_w,
                        const m3_bf16 *k_w, const m3_bf16 *iq_w,
                        const m3_bf16 *ik_w, const m3_bf16 *cos_sin,
                        const int64_t *positions, const int64_t *slot_mapping,
                        const int64_t *index_slot_mapping, void *kv_cache,
                        void *index_cache, m3_bf16 *q_out, void *index_q_out) {
  const int hd = a->head_dim, rd = a->rotary_dim, nq = a->nq, nkv = a->nkv;
  const int niq = a->niq, sparse = niq > 0;
  const int64_t bs = a->block_size;
  const int64_t row = (int64_t)(nq + 2 * nkv + (sparse ? niq + 1 : 0)) * hd;
  const int64_t *islots = index_slot_mapping ? index_slot_mapping : slot_mapping;
  float x[1024];
  if (hd > 1024) return; /* documented bound: head_dim <= 1024 */

  for (int64_t t = 0; t < a->n_tokens; t++) {
    m3_bf16 *r = qkv + t * row;
    const m3_bf16 *cs = cos_sin + positions[t] * (int64_t)rd;
    int64_t slot = (a->insert && slot_mapping) ? slot_mapping[t] : -1;
    int64_t islot = (a->insert && islots && sparse) ? islots[t] : -1;

    for (int h = 0; h < nq; h++) {
      m3_bf16 *src = r + (int64_t)h * hd;
      load(hd, src, x);
      norm_rope(hd, rd, x, q_w, a->eps, cs);
      store_bf16(hd, x, src);
      if (q_out) store_bf16(hd, x, q_out + (t * nq + h) * (int64_t)hd);
    }
    for (int g = 0; g < nkv; g++) {
      m3_bf16 *ks = r + (int64_t)(nq + g) * hd;
      const m3_bf16 *vs = r + (int64_t)(nq + nkv + g) * hd;
      load(hd, ks, x);
      norm_rope(hd, rd, x, k_w, a->eps, cs);
      store_bf16(hd, x, ks);
      if (slot < 0 || !kv_cache) continue;
      /* 64-bit element offset of (page, g, off, 0) - fault 15. */
      int64_t base = (((slot / bs) * nkv + g) * bs + slot % bs) * 2 * (int64_t)hd;
      if (a->kv_e4m3) {
        m3_e4m3 *c = (m3_e4m3 *)kv_cache + base;
        if (sparse) {
          store_e4m3(hd, x, c); /* from fp32 */
        } else {
          /* Dense layers: vLLM writes the cache from the already-rounded bf16
           * k (reshape_and_cache_flash), so K is rounded twice. */
          for (int d = 0; d < hd; d++) c[d] = m3_f32_to_e4m3(m3_bf16_to_f32(ks[d]));
        }
        for (int d = 0; d < hd; d++) c[hd + d] = m3_f32_to_e4m3(m3_bf16_to_f32(vs[d]));
      } else {
        m3_bf16 *c = (m3_bf16 *)kv_cache + base;
        for (int d = 0; d < hd; d++) c[d] = ks[d]; /* == bf16(x) just stored */
        for (int d = 0; d < hd; d++) c[hd + d] = vs[d];
      }
    }
    if (!sparse) continue;
    for (int g = 0; g < niq; g++) {
      m3_bf16 *src = r + (int64_t)(nq + 2 * nkv + g) * hd;
      load(hd, src, x);
      norm_rope(hd, rd, x, iq_w, a->eps, cs);
      store_bf16(hd, x, src);
      if (!index_q_out) continue;
      int64_t o = (t * niq + g) * (int64_t)hd;
      if (a->idx_e4m3) store_e4m3(hd, x, (m3_e4m3 *)index_q_out + o);
      else store_bf16(hd, x, (m3_bf16 *)index_q_out + o);
    }
    m3_bf16 *iks = r + (int64_t)(nq + 2 * nkv + niq) * hd;
    load(hd, iks, x);
    norm_rope(hd, rd, x, ik_w, a->eps, cs);
    store_bf16(hd, x, iks);
    if (islot >= 0 && index_cache) {
      if (a->idx_e4m3) store_e4m3(hd, x, (m3_e4m3 *)index_cache + islot * hd);
      else store_bf16(hd, x, (m3_bf16 *)index_cache + islot * hd);
    }
  }
}

void m3_ref_kv_insert(const m3_qkr_args *a, const m3_bf16 *qkv, const int64_t *slot_mapping, void *kv_cache) {
  const int hd = a->head_dim, nq = a->nq, nkv = a->nkv;
  const int64_t bs = a->block_size, row = (int64_t)(nq + 2 * nkv) * hd;
  for (int64_t t = 0; t < a->n_tokens; t++) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    for (int g = 0; g < nkv; g++)
      for (int half = 0; half < 2; half++) {
        const m3_bf16 *src = qkv + t * row + (int64_t)(nq + half * nkv + g) * hd;
        int64_t at = (((slot / bs) * nkv + g) * bs + slot % bs) * 2 * (int64_t)hd + half * hd;
        for (int d = 0; d < hd; d++) {
          if (a->kv_e4m3) ((m3_e4m3 *)kv_cache)[at + d] = m3_f32_to_e4m3(m3_bf16_to_f32(src[d]));
          else ((m3_bf16 *)kv_cache)[at + d] = src[d];
        }
      }
  }
}
