-- templates/moe_combine.lua - the MoE combine, m3kit's rounding choice for
-- spec §12.6 exactly as m3_ref_moe documents it:
--   out[t] = bf16( (sum_k w[t,k] * float(y_k)  in fp32, top-k order)
--                  + float(shared[t]) )
-- one rounding at the end; w already carries routed_scaling.  Every multiply
-- and add is pinned (fmul_rn / fadd_rn) so --fmad cannot fuse them into
-- FMAs the reference does not have: with the same expert outputs y the result
-- is the reference's bit for bit.  The expert output of pair (t, k) is row
-- rowof[t*K + k] of y (the grouped layout of the prefill path: the inverse
-- permutation of moe_route's group stage), or row t*K + k without a row map
-- (the decode path, where the MoE GEMV writes pair order directly).
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")

local T = {}
T.name = "moe_combine"
T.axes = {
  {"hidden", "int"},
  {"topk", "int"},
  {"shared", {0, 1}},   -- add the shared expert's bf16 output
  {"rowmap", {0, 1}},   -- 1: y rows through rowof[]
}
T.tiles = {
  {"threads", {64, 128, 256, 512}},
}

local function vec(k) return (k.hidden % 8 == 0) and 8 or 1 end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+" end
  if k.hidden < 1 then return false, "hidden must be positive" end
  if k.topk < 1 or k.topk > 16 then return false, "topk must be in [1, 16]" end
  return true
end

function T.default_tile(k, arch) return {threads = 256} end

function T.variants(c)
  if c.has_moe == 0 or not c.hidden then return {} end
  return {{hidden = c.hidden, topk = c.topk_experts, shared = 1, rowmap = 0},
          {hidden = c.hidden, topk = c.topk_experts, shared = 1, rowmap = 1}}
end

local body = [==[
#define H $hidden
#define K $topk
#define VEC $vec
#define CHUNKS (H / VEC)
#define THREADS $threads
#define SHARED $shared
#define ROWMAP $rowmap

M3_DEV void load_vec(const bf16_t *p, float *v) {
#if VEC == 8
  uint4 u = ld16(p);
  v[0] = bf16lo(u.x); v[1] = bf16hi(u.x); v[2] = bf16lo(u.y); v[3] = bf16hi(u.y);
  v[4] = bf16lo(u.z); v[5] = bf16hi(u.z); v[6] = bf16lo(u.w); v[7] = bf16hi(u.w);
#else
  v[0] = bf16_to_f32(*p);
#endif
}

/* y [rows, H] bf16 expert outputs; rowof [n*K] int32 (rowmap=1); w [n, K]
 * fp32; shared [n, H] bf16 (shared=1); out [n, H] bf16 (must not alias y). */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const bf16_t *__restrict__ y, const int *__restrict__ rowof, const float *__restrict__ w,
     const bf16_t *__restrict__ shared, bf16_t *__restrict__ out, long long n_tokens) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const long long t = blockIdx.x;
  if (t >= n_tokens) return;
  float wk[K];
  long long rk[K];
#pragma unroll
  for (int k = 0; k < K; k++) {
    wk[k] = w[t * K + k];
    rk[k] = ROWMAP ? (long long)rowof[t * K + k] : t * K + k;
  }
  for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
    float acc[VEC], v[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      load_vec(y + rk[k] * H + c * VEC, v);
#pragma unroll
      for (int j = 0; j < VEC; j++) acc[j] = fadd_rn(acc[j], fmul_rn(wk[k], v[j]));
    }
#if SHARED
    load_vec(shared + t * H + c * VEC, v);
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = fadd_rn(acc[j], v[j]);
#endif
    bf16_t *o = out + t * H + c * VEC;
#if VEC == 8
    uint4 r;
    r.x = pack_bf16(acc[0], acc[1]); r.y = pack_bf16(acc[2], acc[3]);
    r.z = pack_bf16(acc[4], acc[5]); r.w = pack_bf16(acc[6], acc[7]);
    st16(o, r);
#else
    *o = f32_to_bf16(acc[0]);
#endif
  }
}
]==]

function T.render(k, t, arch, sym)
  local src = F.subst("moe_combine", body, {
    hidden = k.hidden, topk = k.topk, vec = vec(k), threads = t.threads, shared = k.shared,
    rowmap = k.rowmap, sym = sym,
  })
  return {source = P.all(arch) .. F.base .. src, threads = t.threads, smem = 0}
end

return T
