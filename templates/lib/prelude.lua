-- templates/lib/prelude.lua - device helpers pasted into every generated source.
-- The generated source includes no headers at all (not even CUDA's), so the
-- rendered text alone identifies the cubin.  Every inline-PTX helper has a
-- plain C twin under #ifndef __CUDA_ARCH__: the CPU emulator (emu/) compiles
-- the same source with g++ so that CI runs every kernel against its reference.  bf16 travels as its 16-bit
-- pattern (unsigned short), e4m3 as a byte; conversions follow the spec's
-- rounding contract: round-to-nearest-even, e4m3 saturating at +-448 (§10.7).
local P = {}

P.base = [[
typedef unsigned short bf16_t;
typedef unsigned char e4m3_t;
typedef long long i64;
#define M3_DEV static __device__ __forceinline__
/* Programmatic dependent launch (sm_90+; m3_launch uses it unless
 * M3KIT_PDL=0): a kernel may be scheduled while the previous one in its
 * stream drains, and waits here, as the first statement of every kernel, for
 * that grid's completion and memory - so stream order holds exactly.  Right
 * after the wait it lets its own successor be scheduled: that grid's CTAs then
 * take the SM room this one leaves and sit at their own wait, so the launch
 * latency and block scheduling of the next kernel overlap this one's run.
 * (The trigger fires once every CTA of this grid has run it, i.e. all are
 * resident: a waiting successor never keeps one of them off an SM.)  Without
 * the launch attribute both return at once; the CPU emulator runs launches
 * in order (no-op). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define M3_GRID_WAIT() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define M3_GRID_WAIT() ((void)0)
#endif

M3_DEV float bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }
M3_DEV bf16_t f32_to_bf16(float f) {
#ifdef __CUDA_ARCH__
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#else /* the CPU emulator (emu/): round to nearest even, quiet NaN */
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
  return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
M3_DEV float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
M3_DEV float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
]]

-- e4m3 conversions.  sm_89+ has hardware cvt with .satfinite; older targets
-- get an exact software path with the same results (tested against the host
-- table of known-faults #17).
P.e4m3_hw = [[
M3_DEV e4m3_t f32_to_e4m3(float f) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return (e4m3_t)(r & 0xff);
}
M3_DEV float e4m3_to_f32(e4m3_t b) {
  unsigned short h2;
  unsigned short in = b;
  asm("{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, %1; mov.b32 {%0, _}, t; }" : "=h"(h2) : "h"(in));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h2));
  return f;
}
]]

P.e4m3_sw = [[
M3_DEV e4m3_t f32_to_e4m3(float f) {
  if (f != f) return 0x7f;
  unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
  float a = fabsf(f);
  if (a >= 448.0f) return (e4m3_t)(sign | 0x7eu);
  int ex = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
  if (ex < -6) ex = -6;
  float q = __uint_as_float((unsigned)(ex - 3 + 127) << 23);
  float r = rintf(a / q) * q;
  if (r == 0.0f) return (e4m3_t)sign;
  if (r < 0.015625f) return (e4m3_t)(sign | (unsigned)(r * 512.0f));
  unsigned bits = __float_as_uint(r);
  unsigned e = (bits >> 23) - 127 + 7, m = (bits >> 20) & 7u;
  return (e4m3_t)(sign | (e << 3) | m);
}
M3_DEV float e4m3_to_f32(e4m3_t b) {
  unsigned s = (b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
  if (e == 0u) return __uint_as_float(s) + (s ? -1.0f : 1.0f) * (float)m * 0.001953125f;
  return __uint_as_float(s | ((e + 120u) << 23) | (m << 20));
}
]]

-- The e4m3 block suited to an arch.  The hardware path is compiled only by
-- NVRTC (__CUDA_ARCH__); the CPU emulator always takes the software path,
-- which gives the same bits (known-faults #17 table).
function P.e4m3(arch)
  if m3.sm(arch) >= 89 then
    return "#ifdef __CUDA_ARCH__\n" .. P.e4m3_hw .. "#else\n" .. P.e4m3_sw .. "#endif\n"
  end
  return P.e4m3_sw
end

-- cp.async (sm_80+) for the shared-memory rings of the W8A16 GEMV
-- (mxfp8.lua) and the decode indexer (index_decode.lua): 16 bytes .cg (L2
-- only: streamed once) or 4 bytes .ca, src_n = 0 filling zeros; commit; and
-- the wait for all of a thread's groups but the newest wait_n.  u32 must be
-- defined.  The emulator copies at once, which is what a wait_group makes
-- visible anyway.
function P.cp_async(wait_n)
  return [[
/* cp.async: the ring's copies (lib/prelude.lua P.cp_async) */
M3_DEV void cpa16(void *dst, const void *src, int src_n) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src),
               "r"(src_n));
#else
  if (src_n) memcpy(dst, src, 16); else memset(dst, 0, 16);
#endif
}
M3_DEV void cpa4(void *dst, const void *src, int src_n) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src),
               "r"(src_n));
#else
  if (src_n) memcpy(dst, src, 4); else memset(dst, 0, 4);
#endif
}
M3_DEV void cpa_commit(void) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
/* All of this thread's copy groups but the newest ]] .. wait_n .. [[ have landed. */
M3_DEV void cpa_wait_ring(void) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(]] .. wait_n .. [[) : "memory");
#endif
}
]]
end

-- Standard prelude for an arch.
function P.all(arch)
  return P.base .. P.e4m3(arch)
end

return P
