/* op_prefetch.h - L2 prefetch of the next GEMV's weights during the decode
 * step's latency-bound stretches (templates/l2_prefetch.lua).
 *
 * Not a spec operation: it changes no value anywhere (the kernel writes
 * nothing), only where the next GEMV finds part of its weights.  The decode
 * step (runtime/forward.c) launches it on a side branch of its graph; see the
 * template's header for why and where. */
#ifndef M3_OP_PREFETCH_H
#define M3_OP_PREFETCH_H

#include <stdint.h>

#include "runtime/kernels.h"
#include "runtime/status.h"

/* The slice of a region the kernel sends toward L2: n items, item i at byte
 * offset i * stride, chunk bytes long (the last one clipped to the region). */
typedef struct m3_prefetch_plan {
  int64_t stride, chunk, n;
} m3_prefetch_plan;

/* Plan the prefetch of `want` of `total` bytes of a region, as n chunks of
 * `chunk` bytes spread evenly over it (every CTA of the GEMV that reads the
 * region finds the same share in L2).  total, want >= 0 bytes; chunk a
 * multiple of 16 in [16, 2^30].  The region is taken as its first T = total
 * rounded down to 16 bytes (a bulk prefetch's size is a multiple of 16).
 * want >= T: all of it, back to back.  Items start at multiples of 16 inside
 * [0, T) and are clipped to it (the kernel clips the last); together they
 * cover at least min(want, T) bytes and less than that plus one chunk.
 * want == 0 or T == 0: n = 0.  Errors: M3_INVAL (negative sizes, a bad
 * chunk). */
m3_status m3_prefetch_plan_for(int64_t total, int64_t want, int64_t chunk, m3_prefetch_plan *p, m3_err *e);

/* The decode step's phases: what the branch forked after each GEMV sends
 * toward L2 for the next one (runtime/forward.c prefetch()). */
enum { M3_PF_OPROJ, M3_PF_FFN, M3_PF_QKV, M3_PF_PHASES };

/* The default bytes of a phase (M3KIT_L2_PREFETCH unset or empty) for a decode step
 * on SM arch sm (e.g. 90) whose context bucket is ctx tokens: 24 MiB for
 * o_proj up to 320K tokens, 16 MiB for the FFN's first GEMV, none for qkv_proj;
 * nothing before sm_90, where it was never measured.  Evidence (H100, whole
 * steps, device runs 84-88): 24,16,0 -0.14 ms at 8K, -0.11 ms at 128K; the
 * qkv phase, whose window is one norm long, +0.6 ms (its branch still
 * streams when the qkv GEMV starts); the o_proj phase -0.09 ms at 256K but
 * +0.14 ms at 384K, where the indexer in its window keeps DRAM busy itself. */
int64_t m3_prefetch_default_bytes(int sm, int phase, int64_t ctx);

/* Parse a value of M3KIT_L2_PREFETCH: MiB (2^20 bytes) a phase, one integer
 * in [0, 256] for all three phases or three separated by commas (o_proj,
 * the FFN's first GEMV, qkv_proj), written in decimal digits alone.  out
 * [M3_PF_PHASES] receives bytes.  v NULL or "": *is_default = 1 and out all
 * 0 (the caller uses m3_prefetch_default_bytes); else *is_default = 0.
 * Errors: M3_INVAL naming the variable and the value. */
m3_status m3_prefetch_parse(const char *v, int64_t out[M3_PF_PHASES], int *is_default, m3_err *e);

/* The kernel's key, "l2_prefetch()" (its default tile: op=bulk on sm_90+,
 * op=lines before). */
m3_status m3_prefetch_key(m3_variant *v, m3_err *e);

/* Launch the prefetch of plan p over the region at base (16-byte aligned) of
 * total bytes on stream.  No effect on any value; an empty plan launches
 * nothing.  Errors: M3_INVAL (misaligned base, a plan outside the region),
 * the launch's. */
m3_status m3_launch_prefetch(const m3_kernel *k, const void *base, int64_t total, const m3_prefetch_plan *p,
                             cudaStream_t stream, m3_err *e);

#endif
