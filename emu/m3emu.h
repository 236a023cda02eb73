/* m3emu.h - force-included by the CPU emulator's g++ build of a generated
 * kernel source.  It maps the CUDA built-ins the templates use onto the
 * emulator: blocks run one after another (the blocks of a thread-block
 * cluster together), the threads are fibers that switch only at barriers and
 * warp exchanges, so atomics are plain read-modify-writes and fences are
 * no-ops.  Dynamic shared memory (`extern __shared__ T x[];`, which the
 * emulator's compiler rewrites into a pointer at m3emu_dyn_smem_buf) is each
 * block's own buffer; a static __shared__ variable is one copy per kernel
 * image (fine when blocks run one at a time), kept in the section
 * "m3emu_shared" so that the emulator can refuse a cluster launch of a kernel
 * that has any.  The m3emu_cluster_* and m3emu_map_shared helpers are the C
 * twins of barrier.cluster, %cluster_ctarank, %cluster_nctarank and mapa
 * (DSMEM) for sm_90 clusters (x only).  Anything a template uses that is not
 * here fails to compile in the emulator, which is the point: the list below is
 * what the templates may use. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "emu_api.h"

extern "C" const m3emu_api *m3emu_api_ptr;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
/* Section name known to emu_driver.c (the image exports its size). */
#define __shared__ static __attribute__((section("m3emu_shared")))
#define __constant__ static
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

typedef m3emu_dim3 dim3;
#define threadIdx ((*m3emu_api_ptr->cur)->threadIdx)
#define blockIdx ((*m3emu_api_ptr->cur)->blockIdx)
#define blockDim ((*m3emu_api_ptr->cur)->blockDim)
#define gridDim ((*m3emu_api_ptr->cur)->gridDim)
#define warpSize 32

/* The running thread's block's dynamic shared memory (256-byte aligned;
 * poisoned with 0xA5 bytes when the block starts, as GPU shared memory is
 * not initialised). */
#define m3emu_dyn_smem_buf ((unsigned char *)m3emu_api_ptr->dyn_smem())

static inline void __syncthreads(void) { m3emu_api_ptr->syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; m3emu_api_ptr->syncwarp(); }
static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}
static inline void __trap(void) { m3emu_api_ptr->trap("__trap()"); }

/* ---- thread-block clusters (sm_90, x only) ---- */
/* barrier.cluster.arrive.release + barrier.cluster.wait.acquire (all threads
 * of all blocks of the cluster; a block barrier without a cluster). */
static inline void m3emu_cluster_sync(void) { m3emu_api_ptr->cluster_sync(); }
/* mapa: p (into this block's dynamic shared memory) in block `rank`'s. */
template <class T> static inline T *m3emu_map_shared(T *p, unsigned rank) {
  return static_cast<T *>(m3emu_api_ptr->map_shared((const void *)p, rank));
}
template <class T> static inline const T *m3emu_map_shared(const T *p, unsigned rank) {
  return static_cast<const T *>(m3emu_api_ptr->map_shared((const void *)p, rank));
}
static inline unsigned m3emu_cluster_ctarank(void) { return m3emu_api_ptr->cluster_rank(); }
static inline unsigned m3emu_cluster_nctarank(void) { return m3emu_api_ptr->cluster_size(); }

/* ---- bit casts and intrinsics ---- */
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline long long __double_as_longlong(double d) { long long u; memcpy(&u, &d, 8); return u; }
static inline double __longlong_as_double(long long u) { double d; memcpy(&d, &u, 8); return d; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __saturatef(float x) { return x < 0 ? 0 : x > 1 ? 1 : x; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
template <class T> static inline T __ldg(const T *p) { return *p; }
template <class T> static inline T __ldcs(const T *p) { return *p; }
template <class T> static inline T __ldcg(const T *p) { return *p; }
template <class T> static inline void __stcs(T *p, T v) { *p = v; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline unsigned long long clock64(void) { return 0; }

/* ---- vector types ---- */
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(4) ushort2 { unsigned short x, y; };
struct alignas(16) longlong2 { long long x, y; };
static inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
static inline int2 make_int2(int x, int y) { return {x, y}; }
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

/* ---- warp exchange ---- */
template <class T> static inline T m3emu_shfl_t(T v, int src) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffle of 4 or 8 bytes");
  if (sizeof(T) == 4) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = m3emu_api_ptr->shfl(u, src);
    memcpy(&v, &u, 4);
  } else {
    uint32_t u[2];
    memcpy(u, &v, 8);
    u[0] = m3emu_api_ptr->shfl(u[0], src);
    u[1] = m3emu_api_ptr->shfl(u[1], src);
    memcpy(&v, u, 8);
  }
  return v;
}
static inline int m3emu_lane(void) {
  return (int)((threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u);
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  (void)mask;
  int lane = m3emu_lane();
  return m3emu_shfl_t(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  (void)mask;
  int lane = m3emu_lane();
  int src = lane ^ m;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return m3emu_shfl_t(v, src);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  (void)mask;
  int lane = m3emu_lane(), src = lane + (int)d;
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return m3emu_shfl_t(v, src);
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  (void)mask;
  int lane = m3emu_lane(), src = lane - (int)d;
  if (src < 0 || (src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return m3emu_shfl_t(v, src);
}
static inline unsigned __ballot_sync(unsigned mask, int p) { (void)mask; return m3emu_api_ptr->ballot(p); }
static inline int __any_sync(unsigned mask, int p) { (void)mask; return m3emu_api_ptr->ballot(p) != 0; }
static inline int __all_sync(unsigned mask, int p) { (void)mask; return m3emu_api_ptr->ballot(p) == 0xffffffffu; }
static inline unsigned __activemask(void) { return 0xffffffffu; }

/* ---- atomics: fibers switch only at barriers, so these are atomic ---- */
template <class T> static inline T atomicAdd(T *p, T v) { T o = *p; *p = o + v; return o; }
template <class T> static inline T atomicSub(T *p, T v) { T o = *p; *p = o - v; return o; }
template <class T> static inline T atomicMax(T *p, T v) { T o = *p; if (v > o) *p = v; return o; }
template <class T> static inline T atomicMin(T *p, T v) { T o = *p; if (v < o) *p = v; return o; }
template <class T> static inline T atomicExch(T *p, T v) { T o = *p; *p = v; return o; }
template <class T> static inline T atomicCAS(T *p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }
template <class T> static inline T atomicOr(T *p, T v) { T o = *p; *p = o | v; return o; }
template <class T> static inline T atomicAnd(T *p, T v) { T o = *p; *p = o & v; return o; }
static inline unsigned atomicInc(unsigned *p, unsigned lim) { unsigned o = *p; *p = o >= lim ? 0 : o + 1; return o; }
