/* ckpt_write.c - deterministic random checkpoints (see ckpt_write.h).  Kept
 * out of the reader so that nothing on the load path links a writer's
 * assumptions. */
#include "runtime/ckpt_write.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store.h"
#include "ref/numerics.h"
#include "runtime/ckpt_names.h"
#include "runtime/safetensors.h"

#define VL_PREFIX "language_model."
#define INIT_STD 0.02f

/* ---- values ------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

void m3_ckpt_random_values(uint64_t seed, const char *name, float stddev, float *v, size_t n) {
  uint64_t st = seed ^ fnv1a(name);
  /* sum of four 16-bit uniforms: mean 4·32767.5, variance 4·(65536²−1)/12. */
  const float mean = 4.0f * 32767.5f;
  const float scale = stddev / (65536.0f / sqrtf(3.0f)); /* 1/sd of the sum = sqrt(3)/65536 */
  for (size_t i = 0; i < n; i++) {
    uint64_t r = splitmix64(&st);
    uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                   (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
    v[i] = ((float)sum - mean) * scale;
  }
}

/* f32 -> e4m3 (RNE, saturating to ±448, NaN -> 0x7F), bit-identical to
 * m3_f32_to_e4m3 (ref/numerics.h; the round-trip test compares them) but
 * ~10x faster, which matters at 10^8 weights: rounding is done by integer
 * carry on the f32 bits for normals and by the 2^14 add trick for the
 * subnormal range, instead of frexpf/ldexpf/nearbyintf. */
static uint8_t e4m3_fast(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (a < 0x3c800000u) { /* |f| < 2^-6: e4m3 subnormal, quantum 2^-9 */
    float af, r;
    memcpy(&af, &a, 4);
    r = (af + 16384.0f) - 16384.0f; /* RNE at 2^-9 (2^14 has ulp 2^-9) */
    return sign | (uint8_t)(r * 512.0f); /* 0..8; 8 = 2^-6 is the first normal */
  }
  a += 0x7ffffu + ((a >> 20) & 1u); /* RNE to 3 mantissa bits */
  a &= 0xfff00000u;
  if (a > 0x43e00000u) return sign | 0x7e; /* > 448 (incl. inf) saturates */
  uint32_t e = (a >> 23) - 127 + 7, m = (a >> 20) & 7u;
  return sign | (uint8_t)(e << 3) | (uint8_t)m;
}

/* 2^k as a float, exactly, for k in [-126, 127]. */
static float pow2f(int k) {
  uint32_t u = (uint32_t)(k + 127) << 23;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

void m3_mxfp8_quantize_row(const float *x, size_t n, uint8_t *q, uint8_t *s) {
  for (size_t b = 0; b * 32 < n; b++) {
    size_t lo = b * 32, hi = lo + 32 < n ? lo + 32 : n;
    float amax = 0;
    for (size_t i = lo; i < hi; i++) amax = fmaxf(amax, fabsf(x[i]));
    int k = 0;
    if (amax > 0) {
      int ex;
      frexpf(amax, &ex);          /* amax = f·2^ex, f in [0.5, 1): floor(log2 amax) = ex − 1 */
      k = ex - 1 - 8;              /* 8 = e4m3's max exponent (448 = 1.75·2^8) */
      if (ldexpf(amax, -k) > 448.0f) k++;
      if (k < -127) k = -127;
      if (k > 127) k = 127;
    }
    s[b] = (uint8_t)(k + 127);
    if (k > -127 && k < 127) {
      float inv = pow2f(-k); /* exact: w / 2^k == w · 2^-k */
      for (size_t i = lo; i < hi; i++) q[i] = e4m3_fast(x[i] * inv);
    } else {
      for (size_t i = lo; i < hi; i++) q[i] = m3_f32_to_e4m3(ldexpf(x[i], -k));
    }
  }
}

/* ---- layout ------------------------------------------------------------------- */

typedef struct {
  char name[200];
  m3_dtype dtype;
  int ndim;
  int64_t shape[2];
  uint64_t nbytes, offset; /* within the shard's data section */
  const m3_tensor_spec *spec;
  int is_scale;            /* the weight_scale_inv of spec */
} out_tensor;

static uint64_t numel(const out_tensor *t) {
  uint64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
  return n;
}

static void put_le16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put_le32f(uint8_t *p, float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(u >> (8 * i));
}

/* Fill one weight's bytes; for an F8_E4M3 weight also its E8M0 scales at
 * `scale_dst` (the scale entry follows its weight in the shard). */
static m3_status fill(const out_tensor *t, uint8_t *dst, uint8_t *scale_dst, uint64_t seed,
                      m3_err *e) {
  const m3_tensor_spec *sp = t->spec;
  uint64_t n = numel(t);
  size_t rows = (size_t)sp->shape[0], cols = sp->ndim == 2 ? (size_t)sp->shape[1] : 1;
  /* One stream per tensor (bounded by the largest tensor, the embedding). */
  float *v = malloc((n ? n : 1) * sizeof *v);
  if (!v)
    return m3_errf(e, M3_NOMEM, "tensor '%s': out of memory for %llu values", t->name,
                   (unsigned long long)n);
  m3_ckpt_random_values(seed, t->name, INIT_STD, v, n);
  if (t->dtype == M3_DT_F8_E4M3) {
    size_t nb = (cols + 31) / 32;
    for (size_t r = 0; r < rows; r++)
      m3_mxfp8_quantize_row(v + r * cols, cols, dst + r * cols, scale_dst + r * nb);
  } else if (t->dtype == M3_DT_F32) {
    for (uint64_t i = 0; i < n; i++) put_le32f(dst + 4 * i, v[i]);
  } else { /* BF16, little-endian on any host */
    for (uint64_t i = 0; i < n; i++) put_le16(dst + 2 * i, m3_f32_to_bf16(v[i]));
  }
  free(v);
  return M3_OK;
}

static m3_dtype dtype_for(const m3_tensor_spec *sp, int mxfp8) {
  switch (sp->kind) {
  case M3_WK_LINEAR: return mxfp8 ? M3_DT_F8_E4M3 : M3_DT_BF16;
  case M3_WK_ROUTER: case M3_WK_BIAS: return M3_DT_F32; /* the router runs in fp32 (§7.2) */
  default: return M3_DT_BF16;
  }
}

static m3_status write_shard(const char *path, out_tensor *t, size_t n, uint64_t seed, m3_err *e) {
  json_t *h = json_object();
  json_t *meta = json_object();
  json_object_set_new(meta, "format", json_string("pt"));
  json_object_set_new(h, "__metadata__", meta);
  uint64_t data = 0;
  for (size_t i = 0; i < n; i++) {
    json_t *o = json_object(), *sh = json_array(), *of = json_array();
    json_object_set_new(o, "dtype", json_string(m3_dtype_name(t[i].dtype)));
    for (int d = 0; d < t[i].ndim; d++) json_array_append_new(sh, json_integer(t[i].shape[d]));
    json_object_set_new(o, "shape", sh);
    t[i].offset = data;
    json_array_append_new(of, json_integer((json_int_t)data));
    json_array_append_new(of, json_integer((json_int_t)(data + t[i].nbytes)));
    json_object_set_new(o, "data_offsets", of);
    json_object_set_new(h, t[i].name, o);
    data += t[i].nbytes;
  }
  char *hs = json_dumps(h, JSON_COMPACT);
  json_decref(h);
  if (!hs) return m3_errf(e, M3_NOMEM, "%s: out of memory for the header", path);
  size_t hl = strlen(hs), pad = (8 - (8 + hl) % 8) % 8; /* data section 8-aligned */
  size_t total = 8 + hl + pad + (size_t)data;
  uint8_t *buf = malloc(total);
  if (!buf) {
    free(hs);
    return m3_errf(e, M3_NOMEM, "%s: cannot allocate %zu bytes", path, total);
  }
  uint64_t N = hl + pad;
  for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(N >> (8 * i));
  memcpy(buf + 8, hs, hl);
  memset(buf + 8 + hl, ' ', pad);
  free(hs);
  uint8_t *d0 = buf + 8 + N;
  m3_status s = M3_OK;
  for (size_t i = 0; i < n && s == M3_OK; i++) {
    if (t[i].is_scale) continue; /* written with its weight, which precedes it */
    uint8_t *sc = (i + 1 < n && t[i + 1].is_scale) ? d0 + t[i + 1].offset : NULL;
    s = fill(&t[i], d0 + t[i].offset, sc, seed, e);
  }
  if (s == M3_OK) s = m3_write_atomic(path, buf, total, e);
  free(buf);
  return s;
}

m3_status m3_ckpt_write(const m3_config *c, const char *dir, int n_shards, int mxfp8,
                        uint64_t seed, m3_err *e) {
  m3_tensor_spec *specs;
  size_t nspec;
  M3_TRY(m3_ckpt_expected(c, &specs, &nspec, e));
  if (n_shards < 1 || (size_t)n_shards > nspec) {
    free(specs);
    return m3_errf(e, M3_INVAL, "n_shards %d: must be in [1, %zu] (the number of weights)",
                   n_shards, nspec);
  }
  m3_status s = m3_mkdirs(dir, e);
  out_tensor *t = NULL;
  int *shard_of = NULL;
  json_t *wm = NULL;
  if (s != M3_OK) goto done;
  t = calloc(2 * nspec, sizeof *t);
  shard_of = calloc(2 * nspec, sizeof *shard_of);
  if (!t || !shard_of) {
    s = m3_errf(e, M3_NOMEM, "out of memory");
    goto done;
  }
  size_t nt = 0;
  uint64_t total = 0;
  for (size_t i = 0; i < nspec; i++) {
    const m3_tensor_spec *sp = &specs[i];
    out_tensor *w = &t[nt++];
    snprintf(w->name, sizeof w->name, VL_PREFIX "%s", sp->name);
    w->spec = sp;
    w->dtype = dtype_for(sp, mxfp8);
    w->ndim = sp->ndim;
    memcpy(w->shape, sp->shape, sizeof w->shape);
    w->nbytes = numel(w) * m3_dtype_size(w->dtype);
    total += w->nbytes;
    if (w->dtype == M3_DT_F8_E4M3) {
      out_tensor *q = &t[nt++];
      snprintf(q->name, sizeof q->name, VL_PREFIX "%s_scale_inv", sp->name);
      q->spec = sp;
      q->is_scale = 1;
      q->dtype = M3_DT_U8;
      q->ndim = 2;
      q->shape[0] = sp->shape[0];
      q->shape[1] = (sp->shape[1] + 31) / 32;
      q->nbytes = numel(q);
      total += q->nbytes;
    }
  }
  /* Split by bytes: shard k ends once the running total passes (k+1)/N of it,
   * keeping a weight with its scale and leaving every shard non-empty. */
  {
    int k = 0;
    uint64_t run = 0;
    size_t left_weights = nspec;
    for (size_t i = 0; i < nt; i++) {
      shard_of[i] = k;
      run += t[i].nbytes;
      int next_is_scale = i + 1 < nt && t[i + 1].is_scale;
      if (!t[i].is_scale) left_weights--;
      if (next_is_scale || k == n_shards - 1) continue;
      size_t shards_after = (size_t)(n_shards - 1 - k);
      int full = (long double)run >= (long double)total * (k + 1) / n_shards;
      if (full || left_weights <= shards_after) k++;
    }
  }
  wm = json_object();
  char path[8192], fname[64];
  for (int k = 0; k < n_shards && s == M3_OK; k++) {
    size_t lo = 0, hi;
    while (lo < nt && shard_of[lo] != k) lo++;
    for (hi = lo; hi < nt && shard_of[hi] == k; hi++)
      ;
    snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", k + 1, n_shards);
    snprintf(path, sizeof path, "%s/%s", dir, fname);
    for (size_t i = lo; i < hi; i++) json_object_set_new(wm, t[i].name, json_string(fname));
    s = write_shard(path, t + lo, hi - lo, seed, e);
  }
  if (s != M3_OK) goto done;
  {
    json_t *idx = json_object(), *md = json_object();
    json_object_set_new(md, "total_size", json_integer((json_int_t)total));
    json_object_set_new(idx, "metadata", md);
    json_object_set(idx, "weight_map", wm);
    char *txt = json_dumps(idx, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(idx);
    if (!txt) {
      s = m3_errf(e, M3_NOMEM, "out of memory for the index");
      goto done;
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    s = m3_write_atomic(path, txt, strlen(txt), e);
    free(txt);
    if (s != M3_OK) goto done;
  }
  {
    m3_config cc = *c;
    snprintf(cc.quant_method, sizeof cc.quant_method, "%s", mxfp8 ? "mxfp8" : "");
    char *txt = m3_config_to_json_vl(&cc);
    if (!txt) {
      s = m3_errf(e, M3_NOMEM, "out of memory for config.json");
      goto done;
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    s = m3_write_atomic(path, txt, strlen(txt), e);
    free(txt);
  }
done:
  json_decref(wm);
  free(shard_of);
  free(t);
  free(specs);
  return s;
}
