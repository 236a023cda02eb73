/* op_norm.c - tuning adapter of templates/rmsnorm.lua.  The forward pass looks
 * its kernels up by the step's token count rounded up to a power of two
 * (runtime/forward.c: the layer-0 input norm add=0; the fused add + norm of
 * every other input norm, post-attention norm and the final norm add=1; the
 * MoE layers' post-attention norm with f32copy=1 when the step takes the
 * prefill path, > 8 rows, where the router GEMM reads its fp32 copy).  So
 * the buckets are tokens = 1, 8, 256, 4096 (decode batches, prefill chunks);
 * f32copy=1: 256, 4096 only.  combine=K (M3KIT_MOE_FUSE=norm: the input
 * norm after a decode MoE layer forms the layer's combine itself): decode
 * steps only, 1 and 8, and only the config's top-k with a shared expert as
 * wide as the routed ones (the layout m3_moe_forward_pending hands over).
 * Variants of another row length than the config's hidden size are never
 * launched: no buckets.
 * Inputs: x and the residual N(0,1) bf16, w N(0,0.2^2), rotating sets; for
 * combine=K instead of x the expert outputs [rows*K + rows, n] N(0,1) bf16
 * (the shared expert's rows after the routed pairs') and the weights
 * [rows, K] uniform in [0, 2); the add variant rewrites its residual, which
 * prepare restores from a pristine copy (then flushes L2, which that copy
 * filled); y and y32 poisoned.
 * Verification (tests/check_ffn_gpu.c's contract): y within 1 bf16 ulp of
 * m3_ref_rmsnorm / m3_ref_add_rmsnorm (the fp32 sum of squares is ordered
 * differently; combine=K: of m3_ref_moe's combine loop's x), the new residual
 * bit-exact, y32 exactly float(y); a NaN or Inf fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autotune/op.h"
#include "autotune/op_util.h"
#include "runtime/check.h"
#include "runtime/op_ffn.h"

typedef struct {
  m3_rt *rt;
  int add, f32copy, combine, n, sets;
  int64_t rows;
  float eps;
  size_t xb, y32b;          /* one set: residual and y are xb each */
  size_t inb, o_w;          /* one set's input: x (xb), or combine's expert rows then weights at o_w */
  /* [sets + 1] of each: the last set is the slow hook's scratch */
  void *d_x, *d_res, *d_y, *d_y32;  /* d_x: the inputs, inb a set */
  void *d_pristine, *d_w;   /* the residual every set starts from; w [n] */
  m3_bf16 *ref_y, *ref_res; /* set 0 */
} nm_state;

static int buckets(const m3_config *c, const m3_variant *v, m3_bucket *out, int max) {
  if (m3_variant_axis_int(v, "n", 0) != c->hidden_size) return 0;
  const int f32copy = m3_variant_axis_int(v, "f32copy", 0) != 0;
  const long combine = m3_variant_axis_int(v, "combine", 0);
  if (combine && (f32copy || combine != c->num_experts_per_tok || !m3_config_n_moe_layers(c) ||
                  m3_config_shared_width(c) != c->intermediate_size))
    return 0; /* runtime/forward.c launches none of these */
  int64_t rows[M3_TUNE_N_STEPS];
  int n = 0;
  for (int i = 0; i < M3_TUNE_N_STEPS; i++)
    if (combine ? m3_tune_steps[i] <= M3_TUNE_DECODE_ROWS : !f32copy || m3_tune_steps[i] > M3_TUNE_DECODE_ROWS)
      rows[n++] = m3_tune_steps[i];
  return m3_tune_rows_buckets(rows, n, out, max);
}

static void teardown(void *x) {
  nm_state *s = x;
  if (!s) return;
  m3_dev_free(s->d_x); m3_dev_free(s->d_res); m3_dev_free(s->d_y); m3_dev_free(s->d_y32);
  m3_dev_free(s->d_pristine); m3_dev_free(s->d_w);
  free(s->ref_y); free(s->ref_res);
  free(s);
}

static size_t per_set(const nm_state *s) { return s->inb + s->xb * (s->add ? 2 : 1) + s->y32b; }

static m3_status setup(m3_rt *rt, const m3_config *cfg, const m3_variant *v, const m3_bucket *b, uint64_t seed,
                      void **out, m3_err *e) {
  nm_state *s = calloc(1, sizeof *s);
  if (!s) return m3_errf(e, M3_NOMEM, "tune state");
  *out = s;
  s->rt = rt;
  s->add = m3_variant_axis_int(v, "add", 0) != 0;
  s->f32copy = m3_variant_axis_int(v, "f32copy", 0) != 0;
  s->combine = (int)m3_variant_axis_int(v, "combine", 0);
  s->n = (int)m3_variant_axis_int(v, "n", 0);
  s->rows = m3_bucket_get(b, "tokens");
  s->eps = (float)cfg->rms_norm_eps;
  if (s->n < 1 || s->rows < 1 || s->combine < 0 || (s->combine && !s->add))
    return m3_errf(e, M3_KEY, "not an rmsnorm key/bucket");
  const size_t N = (size_t)s->rows * (size_t)s->n, K = (size_t)s->combine, P = (size_t)s->rows * K;
  s->xb = N * 2;
  s->y32b = s->f32copy ? N * 4 : 0;
  /* combine: [P + rows, n] expert rows (the shared expert's last), then [rows, K] weights */
  s->o_w = K ? m3_tune_up256((P + (size_t)s->rows) * (size_t)s->n * 2) : 0;
  s->inb = K ? s->o_w + m3_tune_up256(P * 4) : s->xb;
  s->sets = m3_tune_sets(per_set(s));
  char *in = calloc(1, s->inb);
  m3_bf16 *x = K ? malloc(s->xb) : (m3_bf16 *)in, *res = malloc(s->xb), *w = malloc(sizeof *w * (size_t)s->n);
  s->ref_y = malloc(s->xb);
  s->ref_res = malloc(s->xb);
  m3_status st = in && x && res && w && s->ref_y && s->ref_res ? M3_OK : m3_errf(e, M3_NOMEM, "tune: rmsnorm inputs");
  if (!st) {
    m3_rng r = {seed};
    if (K) {
      const m3_bf16 *ey = (const m3_bf16 *)in, *sh = ey + P * (size_t)s->n;
      float *ew = (float *)(in + s->o_w);
      m3_fill_bf16(&r, (m3_bf16 *)in, (P + (size_t)s->rows) * (size_t)s->n, 1.0f);
      for (size_t p = 0; p < P; p++) ew[p] = 2.0f * m3_rng_unif(&r);
      for (size_t t = 0; t < (size_t)s->rows; t++) /* m3_ref_moe's combine loop */
        for (size_t d = 0; d < (size_t)s->n; d++) {
          float acc = 0.0f;
          for (size_t k = 0; k < K; k++) acc += ew[t * K + k] * m3_bf16_to_f32(ey[(t * K + k) * (size_t)s->n + d]);
          acc += m3_bf16_to_f32(sh[t * (size_t)s->n + d]);
          x[t * (size_t)s->n + d] = m3_f32_to_bf16(acc);
        }
    } else {
      m3_fill_bf16(&r, x, N, 1.0f);
    }
    m3_fill_bf16(&r, res, N, 1.0f);
    m3_fill_bf16(&r, w, (size_t)s->n, 0.2f);
    memcpy(s->ref_res, res, s->xb);
    if (s->add) m3_ref_add_rmsnorm(s->rows, s->n, x, s->ref_res, w, s->eps, s->ref_y);
    else m3_ref_rmsnorm(s->rows, s->n, x, w, s->eps, s->ref_y);
  }
  const int all = s->sets + 1;
  if (!st) st = m3_tune_upload_sets(&s->d_x, in, s->inb, all, rt->stream, e);
  if (!st) st = m3_dev_alloc(&s->d_y, s->xb * all, e);
  if (!st && s->f32copy) st = m3_dev_alloc(&s->d_y32, s->y32b * all, e);
  if (!st && s->add) {
    st = m3_dev_alloc(&s->d_res, s->xb * all, e);
    if (!st) st = m3_dev_alloc(&s->d_pristine, s->xb, e);
    if (!st) st = m3_dev_upload(s->d_pristine, res, s->xb, e);
    if (!st) st = m3_dev_upload((char *)s->d_res + (size_t)s->sets * s->xb, res, s->xb, e); /* the scratch set's */
  }
  if (!st) st = m3_dev_alloc(&s->d_w, sizeof *w * (size_t)s->n, e);
  if (!st) st = m3_dev_upload(s->d_w, w, sizeof *w * (size_t)s->n, e);
  if (K) free(x);
  free(in); free(res); free(w);
  return st;
}

static m3_status prepare(void *x, int rep, m3_err *e) {
  nm_state *s = x;
  const int set = rep % s->sets;
  cudaStream_t str = s->rt->stream;
  if (rep == 0) {
    M3_CUDA(e, cudaMemsetAsync(s->d_y, 0xff, s->xb, str));
    if (s->f32copy) M3_CUDA(e, cudaMemsetAsync(s->d_y32, 0xff, s->y32b, str));
  }
  if (!s->add) return m3_tune_flush_if_small(s->sets, per_set(s), str, e);
  M3_CUDA(e, cudaMemcpyAsync((char *)s->d_res + (size_t)set * s->xb, s->d_pristine, s->xb, cudaMemcpyDeviceToDevice,
                             str));
  return m3_l2_flush(str, e);
}

static m3_status launch_set(nm_state *s, const m3_kernel *k, int set, int64_t rows, m3_err *e) {
  const void *x = (const char *)s->d_x + (size_t)set * s->inb;
  void *y = (char *)s->d_y + (size_t)set * s->xb;
  float *y32 = s->f32copy ? (float *)((char *)s->d_y32 + (size_t)set * s->y32b) : NULL;
  if (!s->add) return m3_launch_rmsnorm(k, rows, s->n, x, s->d_w, s->eps, y, y32, s->rt->stream, e);
  void *res = (char *)s->d_res + (size_t)set * s->xb;
  if (s->combine) /* x holds the expert rows (the shared expert's after s->rows * K pairs), then the weights */
    return m3_launch_add_rmsnorm_combine(k, rows, s->n, s->combine, x, (const float *)((const char *)x + s->o_w),
                                         (const m3_bf16 *)x + (size_t)s->rows * (size_t)s->combine * (size_t)s->n,
                                         res, s->d_w, s->eps, y, y32, s->rt->stream, e);
  return m3_launch_add_rmsnorm(k, rows, s->n, x, res, s->d_w, s->eps, y, y32, s->rt->stream, e);
}

static m3_status launch(void *x, const m3_kernel *k, int rep, m3_err *e) {
  nm_state *s = x;
  const int hook = m3_tune_test_hook(k);
  /* slow: the same launch on the scratch set first (a second add on this
   * set's residual would change the answer, not only the time) */
  if (hook == 2) M3_TRY(launch_set(s, k, s->sets, s->rows, e));
  return launch_set(s, k, rep % s->sets, hook == 1 ? s->rows - 1 : s->rows, e); /* broken: one CTA short */
}

static m3_status verify(void *x, char *detail, size_t n, m3_err *e) {
  nm_state *s = x;
  M3_CUDA(e, cudaStreamSynchronize(s->rt->stream));
  const size_t N = (size_t)s->rows * (size_t)s->n;
  m3_bf16 *y = malloc(s->xb);
  float *y32 = s->f32copy ? malloc(s->y32b) : NULL;
  if (!y || (s->f32copy && !y32)) {
    free(y);
    free(y32);
    return m3_errf(e, M3_NOMEM, "verify");
  }
  m3_status st = m3_dev_download(y, s->d_y, s->xb, e);
  if (!st) {
    m3_cmp c = m3_cmp_bf16_ulp(y, s->ref_y, N, 1.0);
    if (c.bad) {
      char cs[256];
      m3_cmp_str(&c, cs, sizeof cs);
      snprintf(detail, n, "y beyond 1 bf16 ulp: %s", cs);
      st = M3_MISMATCH;
    }
  }
  if (!st && s->add) st = m3_tune_expect_same(s->d_res, s->ref_res, s->xb, 2, "residual", detail, n, e);
  if (!st && s->f32copy) st = m3_dev_download(y32, s->d_y32, s->y32b, e);
  for (size_t i = 0; !st && s->f32copy && i < N; i++)
    if (!isfinite(y32[i]) || y32[i] != m3_bf16_to_f32(y[i])) {
      snprintf(detail, n, "y32[%zu] = %g is not float(y) = %g", i, (double)y32[i], (double)m3_bf16_to_f32(y[i]));
      st = M3_MISMATCH;
    }
  free(y);
  free(y32);
  return st;
}

static double work(void *x) {
  nm_state *s = x;
  /* x (or combine's expert rows and weights), residual in and out, y, y32, w */
  const double in = s->combine ? (double)((size_t)s->rows * (s->combine + 1) * s->n * 2 + (size_t)s->rows * s->combine * 4)
                               : (double)s->xb;
  return in + (double)(s->xb * (s->add ? 3 : 1) + s->y32b) + 2.0 * s->n;
}

const m3_tune_op m3_tune_op_rmsnorm = {"rmsnorm", "GB/s", buckets, setup, prepare, launch, verify, work, teardown,
                                       NULL};
