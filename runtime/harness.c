/* harness.c - random inputs, poisoning, comparisons and timing (harness.h). */
#include "runtime/harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/check.h"

uint64_t m3_rng_next(m3_rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

float m3_rng_unif(m3_rng *r) { return (float)((m3_rng_next(r) >> 40) * (1.0 / 16777216.0)); }

float m3_rng_normal(m3_rng *r) {
  double u1 = ((m3_rng_next(r) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
  double u2 = (m3_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void m3_fill_bf16(m3_rng *r, m3_bf16 *x, size_t n, float sigma) {
  for (size_t i = 0; i < n; i++) x[i] = m3_f32_to_bf16(sigma * m3_rng_normal(r));
}

void m3_fill_f32(m3_rng *r, float *x, size_t n, float sigma) {
  for (size_t i = 0; i < n; i++) x[i] = sigma * m3_rng_normal(r);
}

uint64_t m3_test_seed(void) {
  const char *s = getenv("M3KIT_SEED");
  if (s && *s) return strtoull(s, NULL, 0);
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (uint64_t)t.tv_sec * 1000003ULL ^ (uint64_t)t.tv_nsec;
}

m3_status m3_dev_alloc(void **p, size_t bytes, m3_err *e) {
  *p = NULL;
  M3_CUDA(e, cudaMalloc(p, bytes ? bytes : 16));
  return M3_OK;
}
void m3_dev_free(void *p) {
  if (p) cudaFree(p);
}
m3_status m3_dev_upload(void *dst, const void *src, size_t bytes, m3_err *e) {
  M3_CUDA(e, cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return M3_OK;
}
m3_status m3_dev_download(void *dst, const void *src, size_t bytes, m3_err *e) {
  M3_CUDA(e, cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return M3_OK;
}
m3_status m3_dev_poison(void *p, size_t bytes, m3_err *e) {
  M3_CUDA(e, cudaMemset(p, 0xff, bytes));
  /* cudaMemset runs on the legacy stream, which does not order against the
   * non-blocking streams kernels run on: finish it before anything launches. */
  M3_CUDA(e, cudaDeviceSynchronize());
  return M3_OK;
}

/* 2^(exponent - 7): 8 significant bits.  From the exponent field rather
 * than frexp/ldexp, which dominated the tuner's verification of 10^8-element
 * outputs. */
static double bf16_ulp(float ref) {
  float a = fabsf(ref);
  if (a < 0x1p-126f) return 0x1p-133;
  uint32_t u;
  memcpy(&u, &a, 4);
  const int ex = (int)(u >> 23); /* biased; 255 (Inf/NaN) as before: 2^121 */
  const uint64_t d = (uint64_t)(ex - 134 + 1023) << 52;
  double r;
  memcpy(&r, &d, 8);
  return r;
}

m3_cmp m3_cmp_bf16_ulp(const m3_bf16 *out, const m3_bf16 *ref, size_t n, double max_ulp) {
  return m3_cmp_bf16_tol(out, ref, n, max_ulp, 0.0);
}

m3_cmp m3_cmp_bf16_tol(const m3_bf16 *out, const m3_bf16 *ref, size_t n, double max_ulp, double atol) {
  m3_cmp c = {.n = n};
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    float o = m3_bf16_to_f32(out[i]), r = m3_bf16_to_f32(ref[i]);
    if (out[i] == ref[i] && isfinite(o)) { /* the common case: bit-identical, error 0 */
      den += (double)r * r;
      continue;
    }
    if (!isfinite(o)) {
      c.nonfinite++;
      if (isfinite(r) || !isnan(r) != !isnan(o) || (!isnan(o) && o != r)) c.bad++; /* +Inf for -Inf too */
      continue;
    }
    double d = fabs((double)o - r), u = d / bf16_ulp(r);
    num += d * d;
    den += (double)r * r;
    if (u > c.max_ulp) {
      c.max_ulp = u;
      c.worst = i;
    }
    if (d > c.max_abs) c.max_abs = d;
    if (u > max_ulp && d > atol) c.bad++;
  }
  c.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
  return c;
}

static int e4m3_index(m3_e4m3 b) { return (b & 0x80) ? -(int)(b & 0x7f) : (int)b; }

m3_cmp m3_cmp_e4m3_steps(const m3_e4m3 *out, const m3_e4m3 *ref, size_t n, int max_steps) {
  m3_cmp c = {.n = n};
  for (size_t i = 0; i < n; i++) {
    if ((out[i] & 0x7f) == 0x7f) {
      c.nonfinite++;
      if ((ref[i] & 0x7f) != 0x7f) c.bad++;
      continue;
    }
    int d = abs(e4m3_index(out[i]) - e4m3_index(ref[i]));
    if (d > c.max_ulp) {
      c.max_ulp = d;
      c.worst = i;
    }
    if (d > max_steps) c.bad++;
  }
  return c;
}

m3_cmp m3_cmp_bf16_rel(const m3_bf16 *out, const m3_bf16 *ref, size_t n, double tol) {
  m3_cmp c = {.n = n};
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    float o = m3_bf16_to_f32(out[i]), r = m3_bf16_to_f32(ref[i]);
    if (out[i] == ref[i] && isfinite(o)) { /* the common case: bit-identical, error 0 */
      den += (double)r * r;
      continue;
    }
    if (!isfinite(o)) {
      c.nonfinite++;
      continue;
    }
    double d = fabs((double)o - r);
    if (d > c.max_abs) {
      c.max_abs = d;
      c.worst = i;
    }
    num += d * d;
    den += (double)r * r;
  }
  c.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
  c.bad = (c.nonfinite || c.rel_l2 > tol) ? 1 : 0;
  return c;
}

m3_cmp m3_cmp_f32_rel(const float *out, const float *ref, size_t n, double tol) {
  m3_cmp c = {.n = n};
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(out[i])) {
      c.nonfinite++;
      continue;
    }
    double d = fabs((double)out[i] - ref[i]);
    if (d > c.max_abs) {
      c.max_abs = d;
      c.worst = i;
    }
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  c.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
  c.bad = (c.nonfinite || c.rel_l2 > tol) ? 1 : 0;
  return c;
}

void m3_cmp_str(const m3_cmp *c, char *buf, size_t n) {
  snprintf(buf, n, "n=%zu bad=%zu nonfinite=%zu max_ulp=%.2f max_abs=%.3g rel_l2=%.3g worst=%zu", c->n, c->bad,
           c->nonfinite, c->max_ulp, c->max_abs, c->rel_l2, c->worst);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

m3_status m3_time_events(m3_timed_fn fn, void *arg, cudaStream_t stream, int warmup, int reps,
                         m3_timing *t, m3_err *e) {
  for (int i = 0; i < warmup; i++) M3_TRY(fn(arg, i, e));
  if (reps < 1) reps = 1;
  double *ms = malloc(sizeof *ms * (size_t)reps);
  cudaEvent_t *ev = malloc(sizeof *ev * (size_t)(2 * reps));
  if (!ms || !ev) {
    free(ms);
    free(ev);
    return m3_errf(e, M3_NOMEM, "timing");
  }
  m3_status s = M3_OK;
  int made = 0;
  for (; made < 2 * reps; made++)
    if (cudaEventCreate(&ev[made]) != cudaSuccess) {
      s = m3_errf(e, M3_CUDA, "cudaEventCreate");
      break;
    }
  for (int i = 0; i < reps && s == M3_OK; i++) {
    if (cudaEventRecord(ev[2 * i], stream) != cudaSuccess) s = m3_errf(e, M3_CUDA, "cudaEventRecord");
    if (s == M3_OK) s = fn(arg, warmup + i, e);
    if (s == M3_OK && cudaEventRecord(ev[2 * i + 1], stream) != cudaSuccess) s = m3_errf(e, M3_CUDA, "cudaEventRecord");
  }
  if (s == M3_OK && cudaStreamSynchronize(stream) != cudaSuccess)
    s = m3_errf(e, M3_CUDA, "timed kernel failed: %s", cudaGetErrorString(cudaGetLastError()));
  for (int i = 0; i < reps && s == M3_OK; i++) {
    float f = 0;
    cudaEventElapsedTime(&f, ev[2 * i], ev[2 * i + 1]);
    ms[i] = f * 1000.0;
  }
  if (s == M3_OK) {
    qsort(ms, (size_t)reps, sizeof *ms, cmp_double);
    t->reps = reps;
    t->median_us = ms[reps / 2];
    t->p20_us = ms[(reps * 2) / 10];
    t->p80_us = ms[(reps * 8) / 10 < reps ? (reps * 8) / 10 : reps - 1];
  }
  for (int i = 0; i < made; i++) cudaEventDestroy(ev[i]);
  free(ms);
  free(ev);
  return s;
}

m3_status m3_l2_flush(cudaStream_t stream, m3_err *e) {
  static void *buf;
  const size_t bytes = 256u << 20;
  if (!buf) M3_CUDA(e, cudaMalloc(&buf, bytes));
  M3_CUDA(e, cudaMemsetAsync(buf, 0, bytes, stream));
  return M3_OK;
}

m3_status m3_time_graph(m3_timed_fn fn, void *arg, int n, double per, cudaStream_t stream, int reps, m3_timing *t,
                        m3_err *e) {
  cudaGraph_t g;
  cudaGraphExec_t x;
  if (reps < 1) reps = 1;
  cudaError_t ce = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (ce != cudaSuccess) return m3_errf(e, M3_CUDA, "cudaStreamBeginCapture: %s", cudaGetErrorString(ce));
  m3_status s = M3_OK;
  for (int i = 0; i < n && s == M3_OK; i++) s = fn(arg, i, e);
  ce = cudaStreamEndCapture(stream, &g);
  if (s != M3_OK) {
    if (ce == cudaSuccess) cudaGraphDestroy(g);
    return s;
  }
  if (ce != cudaSuccess) return m3_errf(e, M3_CUDA, "cudaStreamEndCapture: %s", cudaGetErrorString(ce));
  ce = cudaGraphInstantiate(&x, g, 0);
  cudaGraphDestroy(g);
  if (ce != cudaSuccess) return m3_errf(e, M3_CUDA, "cudaGraphInstantiate: %s", cudaGetErrorString(ce));
  double *us = malloc(sizeof *us * (size_t)reps);
  cudaEvent_t a = NULL, b = NULL;
  if (!us) s = m3_errf(e, M3_NOMEM, "timing");
  if (s == M3_OK && (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess))
    s = m3_errf(e, M3_CUDA, "cudaEventCreate");
  for (int i = 0; i < 3 && s == M3_OK; i++)
    if ((ce = cudaGraphLaunch(x, stream)) != cudaSuccess) s = m3_errf(e, M3_CUDA, "cudaGraphLaunch: %s", cudaGetErrorString(ce));
  for (int i = 0; i < reps && s == M3_OK; i++) {
    float ms = 0;
    cudaEventRecord(a, stream);
    if ((ce = cudaGraphLaunch(x, stream)) != cudaSuccess) s = m3_errf(e, M3_CUDA, "cudaGraphLaunch: %s", cudaGetErrorString(ce));
    cudaEventRecord(b, stream);
    if (s == M3_OK && (ce = cudaEventSynchronize(b)) != cudaSuccess)
      s = m3_errf(e, M3_CUDA, "graph replay failed: %s", cudaGetErrorString(ce));
    if (s == M3_OK) cudaEventElapsedTime(&ms, a, b);
    us[i] = 1000.0 * ms / per;
  }
  if (s == M3_OK) {
    qsort(us, (size_t)reps, sizeof *us, cmp_double);
    t->reps = reps;
    t->median_us = us[reps / 2];
    t->p20_us = us[(reps * 2) / 10];
    t->p80_us = us[(reps * 8) / 10 < reps ? (reps * 8) / 10 : reps - 1];
  }
  if (a) cudaEventDestroy(a);
  if (b) cudaEventDestroy(b);
  cudaGraphExecDestroy(x);
  free(us);
  return s;
}
