-- templates/kv_insert.lua - the unfused KV-cache insert of a dense layer:
-- K (already normed and rotated in place by qknorm_rope with insert=0) and V
-- copied from the qkv rows into the paged KV cache (spec §3.4, §4).  m3kit
-- fuses this into qknorm_rope; this kernel exists to measure what the fusion
-- is worth (bench: fused vs norm+RoPE then insert) and as the "insert not
-- fused" value of that axis.  Bit-identical to the fused insert on dense
-- layers: both store e4m3(bf16(k')) (ref/ref.h, m3_ref_qknorm_rope).
-- One warp per (token, kv head, K|V), 4 dims per lane.
local P = m3.include("lib/prelude")

local T = {}
T.name = "kv_insert"
T.axes = {
  {"kv", {"bf16", "e4m3"}},      -- main KV cache dtype (identity scale)
  {"nq", "int"}, {"nkv", "int"}, {"hd", "int"}, {"bs", "int"},
}
T.tiles = {
  {"warps", {2, 4, 8, 16}},      -- warps (cache rows) per CTA
}

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (bf16 cvt)" end
  if k.hd ~= 128 then return false, "head_dim must be 128 (4 dims per lane of one warp)" end
  if k.nq < 1 or k.nkv < 1 then return false, "nq and nkv must be >= 1" end
  if k.nq % k.nkv ~= 0 then return false, "nkv must divide nq" end
  if k.bs < 1 then return false, "block size must be positive" end
  return true
end

function T.default_tile(k, arch) return {warps = 4} end

function T.variants(c)
  if c.has_dense == 0 then return {} end
  local out = {}
  for _, kv in ipairs({"bf16", "e4m3"}) do
    out[#out + 1] = {kv = kv, nq = c.nq, nkv = c.nkv, hd = c.hd, bs = c.bs}
  end
  return out
end

local body = [[
#define NQ $nq
#define NKV $nkv
#define HD 128
#define BS $bs
#define KV_E4M3 $kv_e4m3
#define WARPS $warps
#define ROW ((NQ + 2 * NKV) * HD)

extern "C" __global__ void __launch_bounds__(WARPS * 32)
$sym(const bf16_t *__restrict__ qkv,          /* [N, ROW] (dense rows: q | k | v) */
     const i64 *__restrict__ slot_mapping,    /* [N]; < 0: padding, nothing written */
     void *__restrict__ kv_cache,             /* [blocks, NKV, BS, 2*HD] */
     int n_tokens) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const int lane = threadIdx.x & 31;
  const i64 item = (i64)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (item >= (i64)n_tokens * NKV * 2) return;
  const i64 t = item / (NKV * 2);
  const int r = (int)(item - t * NKV * 2), h = r >> 1, is_v = r & 1;
  const i64 slot = slot_mapping[t];
  if (slot < 0) return;
  const uint2 u = *(const uint2 *)(qkv + t * (i64)ROW + (NQ + (is_v ? NKV : 0) + h) * HD + lane * 4);
  const i64 at = ((slot / BS * NKV + h) * BS + slot % BS) * (2 * HD) + (is_v ? HD : 0) + lane * 4;
#if KV_E4M3
  unsigned o = 0;
  for (int i = 0; i < 4; i++) {
    unsigned b = (i < 2 ? u.x >> (16 * i) : u.y >> (16 * (i - 2))) & 0xffff;
    o |= (unsigned)f32_to_e4m3(bf16_to_f32((bf16_t)b)) << (8 * i);
  }
  *(unsigned *)((e4m3_t *)kv_cache + at) = o;
#else
  *(uint2 *)((bf16_t *)kv_cache + at) = u;
#endif
}
]]

function T.render(k, t, arch, sym)
  local v = {nq = k.nq, nkv = k.nkv, bs = k.bs, kv_e4m3 = k.kv == "e4m3" and 1 or 0, warps = t.warps, sym = sym}
  local src = body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("kv_insert: no value for $" .. n) end
    return tostring(v[n])
  end)
  return {source = P.all(arch) .. src, threads = t.warps * 32, smem = 0}
end

return T
