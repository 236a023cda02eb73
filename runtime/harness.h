/* harness.h - what the GPU tests, the autotuner's correctness gate and the
 * benchmarks share: seeded random inputs, NaN poisoning, device buffers,
 * comparison against a reference with stated tolerances, and event timing.
 * Tolerances follow METHOD.md: elementwise bf16 ulps where the reference has
 * the same rounding contract; ||out-ref||/||ref|| where bf16 operands are
 * summed in another order.  A NaN or Inf in an output fails wherever the
 * reference is finite; where the reference itself is non-finite (NaN codes
 * that must propagate, e.g. MXFP8 dequantisation) the output must be the same
 * class: NaN for NaN, the same infinity for an infinity. */
#ifndef M3_HARNESS_H
#define M3_HARNESS_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "ref/numerics.h"
#include "runtime/status.h"

/* splitmix64 stream. */
typedef struct m3_rng { uint64_t s; } m3_rng;
uint64_t m3_rng_next(m3_rng *r);
float m3_rng_normal(m3_rng *r);           /* N(0,1), Box-Muller */
float m3_rng_unif(m3_rng *r);             /* [0,1) */
void m3_fill_bf16(m3_rng *r, m3_bf16 *x, size_t n, float sigma);
void m3_fill_f32(m3_rng *r, float *x, size_t n, float sigma);

/* The seed of a test run: $M3KIT_SEED if set, else time-based; tests print it. */
uint64_t m3_test_seed(void);

/* Device buffers (cudaMalloc): NULL-safe free, upload/download, poison. */
m3_status m3_dev_alloc(void **p, size_t bytes, m3_err *e);
void m3_dev_free(void *p);
m3_status m3_dev_upload(void *dst, const void *src, size_t bytes, m3_err *e);
m3_status m3_dev_download(void *dst, const void *src, size_t bytes, m3_err *e);
/* Fill with a byte pattern (0xFF: bf16 NaN 0xFFFF, e4m3 NaN 0xFF, f32 NaN). */
m3_status m3_dev_poison(void *p, size_t bytes, m3_err *e);

typedef struct m3_cmp {
  size_t n, bad, nonfinite;
  double max_abs, max_ulp, rel_l2;   /* rel_l2 = ||out-ref|| / ||ref|| */
  size_t worst;                      /* index of the worst element */
} m3_cmp;

/* Elementwise in bf16 ulps of the reference value (ulp of bf16 at |ref|,
 * at least 2^-133); bad counts elements above max_ulp or non-finite where the
 * reference is finite. */
m3_cmp m3_cmp_bf16_ulp(const m3_bf16 *out, const m3_bf16 *ref, size_t n, double max_ulp);
/* Elementwise atol + ulps: an element passes when within max_ulp ulps OR
 * within atol absolutely (the floor that fused multiply-adds need where a
 * result nearly cancels). */
m3_cmp m3_cmp_bf16_tol(const m3_bf16 *out, const m3_bf16 *ref, size_t n, double max_ulp, double atol);
/* Same for e4m3 bytes in e4m3 steps (adjacent codes differ by 1 step). */
m3_cmp m3_cmp_e4m3_steps(const m3_e4m3 *out, const m3_e4m3 *ref, size_t n, int max_steps);
/* Normwise: bad = 1 if rel_l2 > tol or any element is non-finite. */
m3_cmp m3_cmp_bf16_rel(const m3_bf16 *out, const m3_bf16 *ref, size_t n, double tol);
m3_cmp m3_cmp_f32_rel(const float *out, const float *ref, size_t n, double tol);
/* One line describing a comparison ("n=.. bad=.. max_ulp=.. rel_l2=.."). */
void m3_cmp_str(const m3_cmp *c, char *buf, size_t n);

/* Time `fn(arg)` on `stream` with CUDA events: `warmup` untimed calls, then
 * `reps` timed calls one by one; fills median/p20/p80 in microseconds.
 * Errors: M3_CUDA, or whatever fn returns. */
typedef m3_status (*m3_timed_fn)(void *arg, int rep, m3_err *e);
typedef struct m3_timing { double median_us, p20_us, p80_us; int reps; } m3_timing;
m3_status m3_time_events(m3_timed_fn fn, void *arg, cudaStream_t stream, int warmup, int reps,
                         m3_timing *t, m3_err *e);

/* Per-launch time of a CUDA graph: fn(arg, 0..n-1) captured once on `stream`
 * (n launches back to back, e.g. one per rotating input set or per layer),
 * replayed 3 times untimed, then `reps` timed replays; times are per replay
 * divided by `per` (the number of units the caller counts in one replay).
 * This is how the decode step runs (forward.c captures it as a graph), so it
 * excludes the per-launch CPU overhead events include.  Errors: M3_CUDA
 * (capture, instantiate, replay), M3_NOMEM, or whatever fn returns. */
m3_status m3_time_graph(m3_timed_fn fn, void *arg, int n, double per, cudaStream_t stream, int reps, m3_timing *t,
                        m3_err *e);

/* A buffer larger than L2 to evict it between timed runs. */
m3_status m3_l2_flush(cudaStream_t stream, m3_err *e);

#endif
