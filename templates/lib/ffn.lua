-- templates/lib/ffn.lua - device helpers shared by the FFN-side templates
-- (rmsnorm, embed, moe_route, swiglu, moe_combine, mxfp8, sample), kept out
-- of lib/prelude.lua so that those blocks can change without touching the
-- attention templates' text.  Pasted after P.all(arch).
local F = {}

-- $name substitution with a loud failure on a missing value, so a typo in a
-- template is a render error and never silently emitted text.
function F.subst(who, text, v)
  return (text:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error(who .. ": no value for $" .. n) end
    return tostring(v[n])
  end))
end

-- Exact float text for a value carried by the key in millionths (alpha_e6 =
-- 1702000 -> "1.702000f"): the compiler rounds the decimal once, exactly as
-- the launcher's strtof of the same text does, so host and device agree on
-- the constant bit for bit.
function F.e6_literal(u)
  local sign = u < 0 and "-" or ""
  u = math.abs(u)
  return string.format("%s%d.%06df", sign, u // 1000000, u % 1000000)
end

F.base = [==[
/* ---- lib/ffn.lua ---- */
#define M3_INT_MAX 0x7fffffff
typedef unsigned int u32;
typedef unsigned long long u64;

/* IEEE single-rounding arithmetic pinned against --fmad contraction (the
 * references round after every operation); the CPU emulator (emu/, g++ in ISO
 * mode, which never contracts) gets the plain operators. */
#ifdef __CUDA_ARCH__
M3_DEV float fadd_rn(float a, float b) { return __fadd_rn(a, b); }
M3_DEV float fsub_rn(float a, float b) { return __fsub_rn(a, b); }
M3_DEV float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
M3_DEV float fdiv_rn(float a, float b) { return __fdiv_rn(a, b); }
M3_DEV float fsqrt_rn(float a) { return __fsqrt_rn(a); }
M3_DEV float ffma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
M3_DEV double dfma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
M3_DEV double dmul_rn(double a, double b) { return __dmul_rn(a, b); }
M3_DEV double dsub_rn(double a, double b) { return __dsub_rn(a, b); }
M3_DEV float d2f_rn(double a) { return __double2float_rn(a); }
M3_DEV float u2f_rn(unsigned long long a) { return __ull2float_rn(a); }
#else
M3_DEV float fadd_rn(float a, float b) { return a + b; }
M3_DEV float fsub_rn(float a, float b) { return a - b; }
M3_DEV float fmul_rn(float a, float b) { return a * b; }
M3_DEV float fdiv_rn(float a, float b) { return a / b; }
M3_DEV float fsqrt_rn(float a) { return sqrtf(a); }
M3_DEV float ffma_rn(float a, float b, float c) { return fmaf(a, b, c); }
M3_DEV double dfma_rn(double a, double b, double c) { return fma(a, b, c); }
M3_DEV double dmul_rn(double a, double b) { return a * b; }
M3_DEV double dsub_rn(double a, double b) { return a - b; }
M3_DEV float d2f_rn(double a) { return (float)a; }
M3_DEV float u2f_rn(unsigned long long a) { return (float)a; }
#endif

/* 16-byte loads.  The streaming form (weights read once per call) skips L1 so
 * it does not evict what is reused (activations, scales). */
M3_DEV uint4 ld16(const void *p) { return *(const uint4 *)p; }
M3_DEV uint4 ld16_stream(const void *p) {
#ifdef __CUDA_ARCH__
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
#else
  return *(const uint4 *)p;
#endif
}

/* Dynamic shared memory: the emulator has one static buffer per kernel. */
#ifdef __CUDA_ARCH__
#define DYN_SMEM(type, name) extern __shared__ __align__(16) type name[]
#else
#define DYN_SMEM(type, name) type *name = (type *)m3emu_dyn_smem_buf
#endif
M3_DEV void st16(void *p, uint4 v) { *(uint4 *)p = v; }

/* bf16 pairs: element 0 is the low half (little-endian storage order). */
M3_DEV float bf16lo(u32 v) { return __uint_as_float(v << 16); }
M3_DEV float bf16hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
M3_DEV u32 pack_bf16(float lo, float hi) {
  return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}
M3_DEV float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Sum over the CTA (blockDim.x a multiple of 32, <= 1024); every thread gets
 * the total.  Fixed tree, so the result is deterministic.  `red` holds 32
 * floats; one call per kernel (no barrier protects a second use). */
M3_DEV float block_sum_once(float v, float *red) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) red[w] = v;
  __syncthreads();
  v = l < (int)(blockDim.x >> 5) ? red[l] : 0.0f;
  return warp_sum(v);
}

/* The error word of kernels that meet bad input (embed ids, expert ids): 0
 * means none; otherwise INT_MAX - (index of the smallest bad item), so
 * atomicMax keeps the first offender whatever the schedule. */
M3_DEV void flag_bad(int *err, long long index) {
  if (err) atomicMax(err, M3_INT_MAX - (int)index);
}

/* expf, bit-identical to glibc's (2.28+, sysdeps/ieee754/flt-32/e_expf.c, the
 * FMA build x86-64 selects on every CPU with FMA; the same algorithm as Arm's
 * optimized-routines).  The references call the host expf, so routing,
 * SwiGLU and top-p sampling reproduce them bit for bit only with this port
 * (CUDA's expf is within 2 ulp, not equal).  Checked exhaustively against the
 * host expf over every float in [-104, 88.7]: 0 differences.  The rounding
 * points are pinned with explicit intrinsics so --fmad cannot move them. */
static __device__ const u64 m3_exp2f_tab[32] = {
    0x3ff0000000000000ULL, 0x3fefd9b0d3158574ULL, 0x3fefb5586cf9890fULL, 0x3fef9301d0125b51ULL,
    0x3fef72b83c7d517bULL, 0x3fef54873168b9aaULL, 0x3fef387a6e756238ULL, 0x3fef1e9df51fdee1ULL,
    0x3fef06fe0a31b715ULL, 0x3feef1a7373aa9cbULL, 0x3feedea64c123422ULL, 0x3feece086061892dULL,
    0x3feebfdad5362a27ULL, 0x3feeb42b569d4f82ULL, 0x3feeab07dd485429ULL, 0x3feea47eb03a5585ULL,
    0x3feea09e667f3bcdULL, 0x3fee9f75e8ec5f74ULL, 0x3feea11473eb0187ULL, 0x3feea589994cce13ULL,
    0x3feeace5422aa0dbULL, 0x3feeb737b0cdc5e5ULL, 0x3feec49182a3f090ULL, 0x3feed503b23e255dULL,
    0x3feee89f995ad3adULL, 0x3feeff76f2fb5e47ULL, 0x3fef199bdd85529cULL, 0x3fef3720dcef9069ULL,
    0x3fef5818dcfba487ULL, 0x3fef7c97337b9b5fULL, 0x3fefa4afa2a490daULL, 0x3fefd0765b6e4540ULL};

M3_DEV float expf_ref(float x) {
  const u32 ux = __float_as_uint(x);
  const u32 abstop = (ux >> 20) & 0x7ffu;
  if (abstop >= 0x42bu) {                       /* |x| >= 88 or x is NaN */
    if (ux == 0xff800000u) return 0.0f;         /* -inf */
    if (abstop >= 0x7f8u) return x + x;         /* +inf, NaN */
    if (x > 0x1.62e42ep6f) return __uint_as_float(0x7f800000u);
    if (x < -0x1.9fe368p6f) return 0.0f;
  }
  const double InvLn2N = 0x1.71547652b82fep+0 * 32.0, Shift = 0x1.8p+52;
  const double C0 = 0x1.c6af84b912394p-5 / 32768.0, C1 = 0x1.ebfce50fac4f3p-3 / 1024.0,
               C2 = 0x1.62e42ff0c52d6p-1 / 32.0;
  const double xd = (double)x;
  double kd = dfma_rn(InvLn2N, xd, Shift);
  const u64 ki = (u64)__double_as_longlong(kd);
  kd = dsub_rn(kd, Shift);
  const double r = dfma_rn(InvLn2N, xd, -kd);
  const u64 t = m3_exp2f_tab[ki % 32] + (ki << 47);
  const double s = __longlong_as_double((long long)t);
  const double z = dfma_rn(C0, r, C1);
  const double r2 = dmul_rn(r, r);
  double y = dfma_rn(C2, r, 1.0);
  y = dfma_rn(z, r2, y);
  y = dmul_rn(y, s);
  return d2f_rn(y);
}

/* The references' logistic, 1 / (1 + expf(-x)), with their roundings. */
M3_DEV float sigmoid_ref(float x) { return fdiv_rn(1.0f, fadd_rn(1.0f, expf_ref(-x))); }
]==]

-- SwiGLU-OAI of one (gate, up) pair (spec §7.3) on the key's constants,
-- defined by the includer as ALPHA, LIMIT, BETA: swiglu.lua's kernel and the
-- W8A16 GEMV's act=swiglu staging (mxfp8.lua) paste this one text, so both
-- are m3_ref_swiglu_oai bit for bit.
F.swiglu_oai = [==[
M3_DEV float swiglu_oai(float g, float u) {
  g = g > LIMIT ? LIMIT : g;                           /* upper clamp only */
  u = u > LIMIT ? LIMIT : (u < -LIMIT ? -LIMIT : u);   /* both sides */
  return fmul_rn(fmul_rn(g, sigmoid_ref(fmul_rn(ALPHA, g))), fadd_rn(u, BETA));
}
]==]

return F
