-- templates/moe_route.lua - the MoE router's selection step and the token ->
-- expert grouping (spec §7.2, §10.9), three stages of one contract:
--   route  one warp per token: s = sigmoid(logit), choice = s + bias, top-k
--          of choice, weights from the UNBIASED s kept aside (fault 20),
--          renormalised if asked, x routed_scaling (m3_ref_route);
--   group  one CTA: counts, offsets, a STABLE permutation and its inverse
--          (m3_ref_moe_group, claimed stable, so perm is compared exactly);
--   fused  route then group in one CTA, for decode where the launch is the
--          cost (a handful of tokens).
-- Bit-exact with the references: sigmoid uses lib/ffn's glibc expf port, and
-- the top-k is a comparison scan without sentinel values (fault 21): a number
-- beats NaN, larger beats smaller, ties go to the lower expert id.
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")
local R = m3.include("lib/route")

local T = {}
T.name = "moe_route"
T.axes = {
  {"stage", {"route", "group", "fused"}},
  {"logits", {"f32", "bf16"}},   -- router logits dtype (fp32 in M3)
  {"experts", "int"},
  {"topk", "int"},
  {"renorm", {0, 1}},            -- 1: w = s / sum(s over the chosen) (M3)
}
T.tiles = {
  {"warps", {1, 2, 4, 8, 16, 32}},
}

local SMEM_STATIC = 48 * 1024
local function group_smem(k, t) return k.experts * (t.warps + 2) * 4 end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (__match_any_sync, bf16)" end
  if k.experts < 1 or k.experts > 1024 then return false, "experts must be in [1, 1024] (32 per lane)" end
  if k.topk < 1 or k.topk > k.experts or k.topk > 16 then
    return false, "topk must be in [1, min(experts, 16)]"
  end
  if k.stage == "group" and (k.logits ~= "f32" or k.renorm ~= 0) then
    return false, "the group stage reads expert ids only: use logits=f32, renorm=0"
  end
  if k.stage ~= "route" and group_smem(k, t) > SMEM_STATIC then
    return false, string.format("grouping needs %d B of shared memory (experts x (warps + 2) ints) > 48 KiB",
                                group_smem(k, t))
  end
  return true
end

function T.default_tile(k, arch)
  local w = ({route = 4, group = 32, fused = 8})[k.stage]
  while w > 1 and not T.valid(k, {warps = w}, arch) do w = w // 2 end
  return {warps = w}
end

function T.variants(c)
  if c.has_moe == 0 or not c.experts or c.experts < 1 then return {} end
  local out = {}
  for _, st in ipairs({"route", "group", "fused"}) do
    out[#out + 1] = {stage = st, logits = "f32", experts = c.experts, topk = c.topk_experts,
                     renorm = st == "group" and 0 or 1}
  end
  return out
end

local body = [==[
#define E $experts
#define K $topk
#define EPL ((E + 31) / 32)
#define WARPS $warps
#define STAGE $stage   /* 0 route, 1 group, 2 fused */
#define RENORM $renorm
#define LOGITS_BF16 $lbf16
#define FULL 0xffffffffu

$beats#if STAGE != 1
$route_token#endif

#if STAGE != 0
/* Stable grouping of the P = n*K pairs by expert, one CTA.  Chunks of
 * blockDim pairs keep ascending pair order: inside a warp the rank comes from
 * __match_any_sync, across warps from per-warp counts, across chunks from a
 * running cursor per expert.  sh: E * (WARPS + 2) ints. */
M3_DEV void group_pairs(long long P, const int *ids, int *counts, int *offsets, int *perm, int *inv,
                        int *tok, int *err, int *sh) {
  int *cnt = sh, *cursor = sh + E, *wcnt = sh + 2 * E;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, NT = WARPS * 32;
  for (int e = tid; e < E; e += NT) cnt[e] = 0;
  __syncthreads();
  for (long long p = tid; p < P; p += NT) {
    const int x = ids[p];
    if (x >= 0 && x < E) atomicAdd(&cnt[x], 1);
    else flag_bad(err, p);
  }
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int e = 0; e < E; e++) {
      offsets[e] = run;
      cursor[e] = run;
      counts[e] = cnt[e];
      run += cnt[e];
    }
    offsets[E] = run;
  }
  __syncthreads();
  for (long long base = 0; base < P; base += NT) {
    for (int i = tid; i < WARPS * E; i += NT) wcnt[i] = 0;
    __syncthreads();
    const long long p = base + tid;
    int x = p < P ? ids[p] : -1;
    if (x >= E) x = -1;
    if (x < 0) x = -1;
#ifdef __CUDA_ARCH__
    const u32 peers = __match_any_sync(FULL, x);
#else /* the CPU emulator has no match: the same mask from 32 shuffles */
    u32 peers = 0;
    for (int l = 0; l < 32; l++) peers |= (u32)(__shfl_sync(FULL, x, l) == x) << l;
#endif
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (x >= 0 && rank == 0) wcnt[warp * E + x] = __popc(peers);
    __syncthreads();
    if (x >= 0) {
      int pos = cursor[x] + rank;
      for (int w2 = 0; w2 < warp; w2++) pos += wcnt[w2 * E + x];
      perm[pos] = (int)p;
      if (inv) inv[p] = pos;
      if (tok) tok[pos] = (int)(p / K);
    }
    __syncthreads();
    for (int e = tid; e < E; e += NT) {
      int add = 0;
      for (int w2 = 0; w2 < WARPS; w2++) add += wcnt[w2 * E + e];
      cursor[e] += add;
    }
    __syncthreads();
  }
}
#endif

/* logits [n, E] fp32|bf16; bias [E] fp32 or NULL; ids, w [n, K] (written by
 * route/fused, read by group); counts [E], offsets [E+1], perm [n*K];
 * inv [n*K] (inv[perm[i]] = i) and tok [n*K] (tok[i] = perm[i] / K), each
 * may be NULL; err: error word for expert ids outside [0, E). */
extern "C" __global__ void __launch_bounds__(WARPS * 32)
$sym(const void *__restrict__ logits, const float *__restrict__ bias, int *ids, float *w, int *counts,
     int *offsets, int *perm, int *inv, int *tok, int *err, long long n_tokens, float scaling) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#if STAGE == 0
  const long long t = (long long)blockIdx.x * WARPS + warp;
  if (t < n_tokens) route_token(t, logits, bias, ids, w, scaling, lane);
#else
  __shared__ int sh[E * (WARPS + 2)];
#if STAGE == 2
  for (long long t = warp; t < n_tokens; t += WARPS) route_token(t, logits, bias, ids, w, scaling, lane);
  __syncthreads();   /* this CTA's global writes of ids are visible to it after the barrier */
#endif
  group_pairs(n_tokens * K, ids, counts, offsets, perm, inv, tok, err, sh);
#endif
}
]==]

function T.render(k, t, arch, sym)
  local src = F.subst("moe_route", body, {
    experts = k.experts, topk = k.topk, warps = t.warps, renorm = k.renorm,
    stage = ({route = 0, group = 1, fused = 2})[k.stage], lbf16 = k.logits == "bf16" and 1 or 0, sym = sym,
    beats = R.beats, route_token = R.route_token,
  })
  return {source = P.all(arch) .. F.base .. src, threads = t.warps * 32, smem = 0}
end

return T
