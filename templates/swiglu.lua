-- templates/swiglu.lua - SwiGLU-OAI between an expert's (or the dense MLP's)
-- gate|up GEMM and its down GEMM (spec §7.3): on gu [N, 2I] (gate = columns
-- [0, I), up = [I, 2I): the uninterleaved packing of [w1; w3]),
--   out = g' * sigmoid(alpha g') * (u' + beta),  g' = min(g, limit) (upper
--   clamp only), u' = clamp(u, -limit, limit),
-- fp32 math from bf16 inputs, one bf16 rounding: m3_ref_swiglu_oai bit for bit
-- (lib/ffn's glibc expf, the references' operation order, comparisons rather
-- than fminf so a NaN stays NaN).  alpha, limit and beta are part of the key
-- (in millionths: alpha_e6 = 1702000 is 1.702), so a model's constants can
-- never be dropped or defaulted between the config and the kernel (fault 22).
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")

local T = {}
T.name = "swiglu"
T.axes = {
  {"inter", "int"},      -- I: width of the activation
  {"alpha_e6", "int"},   -- alpha x 10^6
  {"limit_e6", "int"},   -- clamp limit x 10^6
  {"beta_e6", "int"},    -- beta x 10^6 (M3: 1, the "+1" on up)
}
T.tiles = {
  {"threads", {64, 128, 256, 512}},
}

local function vec(k) return (k.inter % 8 == 0) and 8 or 1 end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+" end
  if k.inter < 1 then return false, "inter must be positive" end
  if k.limit_e6 < 0 then return false, "the clamp limit must be >= 0" end
  return true
end

function T.default_tile(k, arch) return {threads = 256} end

function T.variants(c)
  -- The config's constants reach the launcher's keys; model_dims does not
  -- export them yet, so precompilation assumes M3's (1.702, 7, 1).  A model
  -- with others still gets exact kernels, compiled at first use.
  local a, l, b = c.swiglu_alpha_e6 or 1702000, c.swiglu_limit_e6 or 7000000, c.swiglu_beta_e6 or 1000000
  local out, seen = {}, {}
  local widths = {}
  if c.has_moe ~= 0 then widths[#widths + 1] = c.inter; widths[#widths + 1] = c.shared_inter end
  if c.has_dense_mlp ~= 0 then widths[#widths + 1] = c.dense_inter end
  for _, i in ipairs(widths) do
    if i and i > 0 and not seen[i] then
      seen[i] = true
      out[#out + 1] = {inter = i, alpha_e6 = a, limit_e6 = l, beta_e6 = b}
    end
  end
  return out
end

local body = [==[
#define I $inter
#define VEC $vec
#define VPR (I / VEC)            /* vectors per row */
#define THREADS $threads
#define ALPHA $alpha
#define LIMIT $limit
#define BETA $beta

$swiglu_fn
/* gu [n_rows, 2I] bf16 (gate | up); out [n_rows, I] bf16 (must not alias gu). */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const bf16_t *__restrict__ gu, bf16_t *__restrict__ out, long long n_rows) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const long long v = (long long)blockIdx.x * THREADS + threadIdx.x;
  if (v >= n_rows * VPR) return;
  const long long row = v / VPR;
  const int c = (int)(v - row * VPR) * VEC;
  const bf16_t *g = gu + row * (2 * I) + c, *u = g + I;
  bf16_t *o = out + row * I + c;
#if VEC == 8
  const uint4 gv = ld16(g), uv = ld16(u);
  uint4 r;
  r.x = pack_bf16(swiglu_oai(bf16lo(gv.x), bf16lo(uv.x)), swiglu_oai(bf16hi(gv.x), bf16hi(uv.x)));
  r.y = pack_bf16(swiglu_oai(bf16lo(gv.y), bf16lo(uv.y)), swiglu_oai(bf16hi(gv.y), bf16hi(uv.y)));
  r.z = pack_bf16(swiglu_oai(bf16lo(gv.z), bf16lo(uv.z)), swiglu_oai(bf16hi(gv.z), bf16hi(uv.z)));
  r.w = pack_bf16(swiglu_oai(bf16lo(gv.w), bf16lo(uv.w)), swiglu_oai(bf16hi(gv.w), bf16hi(uv.w)));
  st16(o, r);
#else
  *o = f32_to_bf16(swiglu_oai(bf16_to_f32(*g), bf16_to_f32(*u)));
#endif
}
]==]

function T.render(k, t, arch, sym)
  local src = F.subst("swiglu", body, {
    inter = k.inter, vec = vec(k), threads = t.threads, sym = sym, swiglu_fn = F.swiglu_oai,
    alpha = "(" .. F.e6_literal(k.alpha_e6) .. ")", limit = "(" .. F.e6_literal(k.limit_e6) .. ")",
    beta = "(" .. F.e6_literal(k.beta_e6) .. ")",
  })
  return {source = P.all(arch) .. F.base .. src, threads = t.threads, smem = 0}
end

return T
