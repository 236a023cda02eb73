-- templates/lib/indexer.lua - device code shared by the lightning indexer's
-- templates (index_decode.lua, index_prefill.lua; spec §5): the tensor-core
-- dot products, the exact fp32 fallback, the order keys and the warp-level
-- top-k selection.  Kept apart from lib/prelude.lua because only the indexer
-- needs it and because every helper that is inline PTX here has a plain C
-- twin under #ifndef __CUDA_ARCH__ for the CPU emulator (emu/).
--
-- Numerics (why the fast path may differ from m3_ref_dot_f32, and where it
-- may not):
--   * The 128-term dot runs on mma.sync.m16n8k16 with fp32 accumulation: bf16
--     operands as stored, e4m3 operands decoded exactly to fp16 (bit move,
--     x 2^-8; the 2^-16 on the product is undone in fp32, exactly).  Products
--     are exact, only the summation order differs from the reference, so a
--     score moves by a few fp32 ulps of its terms and only near-tied blocks
--     can swap (tests allow a swap where the reference scores of the two
--     blocks differ by < 1e-5 relative and count them).
--   * Any 16-token group holding a non-finite index-K value (bf16 exponent
--     all ones, e4m3 code 0x7f/0xff), and every group when the query holds
--     one, is recomputed by a scalar path that is m3_ref_dot_f32 operation for
--     operation (8 lanes, no FMA), so NaN and +-Inf behave exactly as in the
--     reference whatever the tensor cores do with them.
--   * Block max is NaN-sticky (max.NaN), so one NaN token poisons its block,
--     which the forcing step turns into -1e30 (ref_indexer.c's contract).
-- Order keys: a block becomes one 64-bit key, (monotone fp32 bits << 32) |
-- (0xffffffff - block id), so "larger key" is exactly the reference's order:
-- higher score first, equal scores -> lower block id; -0 is folded into +0
-- first because the reference's comparisons treat them as equal.  Key 0 means
-- "no candidate" (every real key is > 0).
local L = {}

L.common = [[
typedef unsigned long long u64;
#define FULL 0xffffffffu
#define POISON 0xffffffffu        /* mono32 of a NaN block max: above everything */

M3_DEV float f_ninf() { return __uint_as_float(0xff800000u); }

/* max that returns NaN when either input is NaN (fmaxf drops NaN). */
M3_DEV float fmax_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
#endif
}

/* 16 bytes that are read once: streaming (evict-first) load. */
M3_DEV uint4 ld_stream16(const unsigned char *p) {
#ifdef __CUDA_ARCH__
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  uint4 v;
  memcpy(&v, p, 16);
  return v;
#endif
}
/* Workspace written by other CTAs of this launch: bypass L1. */
M3_DEV u64 ldcg64(const u64 *p) {
#ifdef __CUDA_ARCH__
  u64 v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return *(const volatile u64 *)p;
#endif
}

/* Programmatic dependent launch hooks (no-ops unless launched with PDL). */
M3_DEV void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
M3_DEV void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* ---- order keys ---- */
/* fp32 -> u32 with the same order; NaN above +Inf (poison); -0 -> +0. */
M3_DEV unsigned mono32(float f) {
  if (f != f) return POISON;
  if (f == 0.0f) f = 0.0f;
  unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
M3_DEV float unmono32(unsigned m) {
  return __uint_as_float((m & 0x80000000u) ? (m & 0x7fffffffu) : ~m);
}
/* The forcing step of §5.3 on one visible block (ref_indexer.c forced()):
 * NaN -> -1e30, then init -> 1e30, then local -> 1e29 (local wins). */
M3_DEV float force_block(float v, long long b, long long nb, int init, int local) {
  if (v != v) v = -1e30f;
  if (b < init) v = 1e30f;
  if (b >= nb - local) v = 1e29f;
  return v;
}
/* v must not be NaN (forced first). */
M3_DEV u64 make_key(float v, int id) {
  return ((u64)mono32(v) << 32) | (u64)(0xffffffffu - (unsigned)id);
}
M3_DEV int key_id(u64 k) { return (int)(0xffffffffu - (unsigned)(k & 0xffffffffull)); }

/* ---- warp-level selection ---- */
M3_DEV u64 warp_max64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u64 x = __shfl_xor_sync(FULL, v, o);
    v = x > v ? x : v;
  }
  return v;
}
/* The K-th largest of the 32 lanes' keys (K <= 32), or 0 when fewer than K
 * lanes hold a non-zero key.  Lane maxima of disjoint candidate subsets are K
 * distinct candidates >= this value, so it never exceeds the K-th largest
 * candidate overall: a safe threshold for the survivors pass. */
M3_DEV u64 warp_kth_largest(u64 v, int K) {
  int r = 0;
#pragma unroll 8
  for (int j = 0; j < 32; j++) {
    u64 o = __shfl_sync(FULL, v, j);
    r += o > v;
  }
  return warp_max64(r >= K - 1 ? v : 0ull);
}
/* Ranks n distinct keys (shared memory) and writes the top K ids in order to
 * out_s[0..K) (-1 where fewer than K).  The whole warp calls it. */
M3_DEV void warp_rank_top(const u64 *cand, int n, int K, int *out_s) {
  const int lane = threadIdx.x & 31;
  if (lane < K) out_s[lane] = -1;
  __syncwarp();
  for (int i = lane; i < n; i += 32) {
    const u64 ki = cand[i];
    int r = 0;
    for (int j = 0; j < n; j++) r += cand[j] > ki;
    if (r < K) out_s[r] = key_id(ki);
  }
  __syncwarp();
}
]]

-- mma.sync m16n8k16 with fp32 accumulation; ab = "bf16" or "f16".  The twin
-- gathers the fragments of the quad/column owners with shuffles and sums the
-- 16 products in k order (any order is a valid emulation of the hardware's).
function L.mma(ab)
  local el
  if ab == "bf16" then
    el = "M3_DEV float mma_el(unsigned w, int hi) { return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16)); }"
  else
    el = [[
M3_DEV float f16_bits_to_f32(unsigned h) {
  unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
  if (e == 31u) return __uint_as_float(s | 0x7f800000u | (m << 13));
  if (e == 0u) {
    float v = (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
    return s ? -v : v;
  }
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}
M3_DEV float mma_el(unsigned w, int hi) { return f16_bits_to_f32(hi ? (w >> 16) : (w & 0xffffu)); }]]
  end
  return [[
#ifndef __CUDA_ARCH__
]] .. el .. [[

#endif
M3_DEV void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
#ifdef __CUDA_ARCH__
  asm("mma.sync.aligned.m16n8k16.row.col.f32.]] .. ab .. "." .. ab .. [[.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  float r0[16], r1[16], k0[16], k1[16]; /* A rows g, g+8; B columns 2tq, 2tq+1 */
  for (int q = 0; q < 4; q++) {
    unsigned x0 = __shfl_sync(FULL, a0, 4 * g + q), x1 = __shfl_sync(FULL, a1, 4 * g + q);
    unsigned x2 = __shfl_sync(FULL, a2, 4 * g + q), x3 = __shfl_sync(FULL, a3, 4 * g + q);
    unsigned y0 = __shfl_sync(FULL, b0, 8 * tq + q), y1 = __shfl_sync(FULL, b1, 8 * tq + q);
    unsigned z0 = __shfl_sync(FULL, b0, 8 * tq + 4 + q), z1 = __shfl_sync(FULL, b1, 8 * tq + 4 + q);
    r0[2 * q] = mma_el(x0, 0), r0[2 * q + 1] = mma_el(x0, 1), r0[2 * q + 8] = mma_el(x2, 0), r0[2 * q + 9] = mma_el(x2, 1);
    r1[2 * q] = mma_el(x1, 0), r1[2 * q + 1] = mma_el(x1, 1), r1[2 * q + 8] = mma_el(x3, 0), r1[2 * q + 9] = mma_el(x3, 1);
    k0[2 * q] = mma_el(y0, 0), k0[2 * q + 1] = mma_el(y0, 1), k0[2 * q + 8] = mma_el(y1, 0), k0[2 * q + 9] = mma_el(y1, 1);
    k1[2 * q] = mma_el(z0, 0), k1[2 * q + 1] = mma_el(z0, 1), k1[2 * q + 8] = mma_el(z1, 0), k1[2 * q + 9] = mma_el(z1, 1);
  }
  for (int k = 0; k < 16; k++) {
    c[0] += r0[k] * k0[k];
    c[1] += r0[k] * k1[k];
    c[2] += r1[k] * k0[k];
    c[3] += r1[k] * k1[k];
  }
#endif
}
]]
end

-- e4m3 -> fp16 pairs.  One 32-bit word (codes b0..b3 of 4 consecutive dims)
-- gives two f16x2 words: (b0, b2) and (b1, b3).  The dims are paired that way
-- because the dot product lets Q and K share any permutation of dims, and it
-- saves a byte shuffle.  alu: the f16 bits (b & 0x7f) << 7 | sign << 15 are
-- exactly 2^-8 times the e4m3 value, normals and subnormals alike (callers
-- undo the 2^-16 on products in fp32); hw (sm_89+): cvt.rn.f16x2.e4m3x2 after
-- a prmt that pairs the same bytes, exact and unscaled.  NaN codes are caught
-- by the callers' non-finite check before these values matter.
function L.e4m3_decode(cvt)
  if cvt == "hw" then
    return [[
#define E4M3_PROD_SCALE 1.0f
M3_DEV void e4m3_word_f16(unsigned w, unsigned &p02, unsigned &p13) {
#ifdef __CUDA_ARCH__
  asm("{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, %2, 0, 0x3120; mov.b32 {lo, hi}, t;"
      " cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
      : "=r"(p02), "=r"(p13) : "r"(w));
#else
  /* the same values as the hardware: exact e4m3 -> f16 (x 2^8 of the alu bits) */
  unsigned b[4];
  for (int i = 0; i < 4; i++) {
    unsigned c = (w >> (8 * i)) & 0xffu, s = (c & 0x80u) << 8, e = (c >> 3) & 15u, m = c & 7u, h;
    if (e == 15u && m == 7u) h = s | 0x7e00u;
    else if (e == 0u && m == 0u) h = s;
    else if (e == 0u) { /* m * 2^-9 = 2^(p-9) * (m / 2^p), p = floor(log2 m) */
      unsigned p = m >= 4u ? 2u : m >= 2u ? 1u : 0u;
      h = s | ((p + 6u) << 10) | ((m - (1u << p)) << (10u - p));
    } else h = s | ((e + 8u) << 10) | (m << 7);
    b[i] = h;
  }
  p02 = b[0] | (b[2] << 16);
  p13 = b[1] | (b[3] << 16);
#endif
}
]]
  end
  return [[
#define E4M3_PROD_SCALE 65536.0f     /* both operands carry 2^-8 */
M3_DEV void e4m3_word_f16(unsigned w, unsigned &p02, unsigned &p13) {
  unsigned x = w << 8; /* codes b0, b2 in bits 15..8 and 31..24 */
  p02 = (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
  p13 = (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);
}
]]
end

return L
