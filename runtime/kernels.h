/* kernels.h - the runtime's kernel context: device + JIT + tuning DB, and the
 * get-or-build of a launchable kernel for a variant at a shape bucket.
 *
 *   m3_rt_kernel(rt, key, bucket):
 *     key has a tile   -> that tile (tests, the tuner)
 *     key has no tile  -> tuning DB record for (key, bucket, arch), re-checked
 *                         with the template's valid(); else the declared default
 *     -> render -> cubin cache (or NVRTC) -> cuModuleLoadData, memoised in
 *        process by the full key, so every later launch is a table lookup.
 * The runtime therefore always works untuned; a tuned DB only makes it faster.
 */
#ifndef M3_KERNELS_H
#define M3_KERNELS_H

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "runtime/gpu.h"
#include "runtime/jit.h"

#include "cache/tunedb.h" /* m3_bucket: the shape bucket of a launch */

typedef struct m3_kernel {
  m3_variant key;         /* full key actually built (tile + arch) */
  m3_module mod;
  int from_tuning;        /* tile came from the tuning DB */
  int sm_count;           /* SMs of the device it was loaded on */
  int resident;           /* its CTAs one SM holds (m3_module_resident_ctas; 0: unknown, the emulator) */
} m3_kernel;

/* Where a process's start-up time goes (warm start: issue 6 item 9), seconds
 * of wall time.  open_s: m3_rt_open (driver init, primary context, the JIT's
 * Lua state, the tuning DB).  Per kernel resolved (each distinct full key,
 * once a process): build_s is m3_jit_build, a cubin cache read for `cached`,
 * NVRTC for `compiled`; load_s is cuModuleLoadData. */
typedef struct m3_rt_stats {
  double open_s, build_s, load_s;
  int cached, compiled;
} m3_rt_stats;

typedef struct m3_rt {
  m3_device dev;
  m3_rt_stats stats;
  m3_jit jit;
  struct m3_tunedb *db;   /* may be NULL: defaults only */
  cudaStream_t stream;
  int n_kernels, cap_kernels;
  m3_kernel **kernels;    /* memo, by full key */
  /* Front memo: (requested key, bucket) -> kernel, checked before the Lua
   * canonicalisation, tuning lookup and key scan a resolution costs (~10-40
   * us; the MoE layer resolves 5 kernels per layer per prefill chunk).  A
   * pure cache: the answer for a (key, bucket) cannot change while rt is
   * open (the DB is read once, at open). */
  struct m3_rt_front *front; /* [M3_RT_FRONT] open addressing, NULL until first use */
} m3_rt;

/* Open GPU `ordinal`, the JIT and (when present) the tuning DB of this arch
 * under the cache root, plus the seed DB.  Errors: M3_NOGPU, M3_CUDA, ... */
m3_status m3_rt_open(m3_rt *rt, int ordinal, m3_err *e);
void m3_rt_close(m3_rt *rt);

/* See the header comment.  *k stays owned by rt.  Errors: M3_KEY, M3_TILE,
 * M3_NVRTC, M3_NOJIT, M3_CUDA. */
m3_status m3_rt_kernel(m3_rt *rt, const m3_variant *key, const m3_bucket *bucket, m3_kernel **k,
                       m3_err *e);

/* Same, from key text. */
m3_status m3_rt_kernel_text(m3_rt *rt, const char *key, const m3_bucket *bucket, m3_kernel **k,
                            m3_err *e);

#endif
