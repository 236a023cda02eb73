-- templates/fill.lua - deterministic synthetic weights generated on the GPU
-- (runtime/model.c: `--preset minimax-m3` needs ~40 GB of weights; a CPU loop
-- plus a PCIe upload would take minutes, this writes at store bandwidth).
-- Element i of a tensor with seed s is sigma * n(s, i), where n is a
-- counter-based approximately-normal draw: z = splitmix64(s + (i+1)*golden),
-- n = (sum of z's four 16-bit fields - 131070) * sqrt(3) / 65536, i.e.
-- Irwin-Hall(4) at unit variance, bounded at +-3.46.  It needs no state, so
-- any thread computes any element, and runtime/model.h's m3_synth_value
-- reproduces it on the host bit for bit (fp32 math in the same order).
local P = m3.include("lib/prelude")

local T = {}
T.name = "fill"
T.axes = {
  {"dtype", {"bf16", "e4m3", "f32"}},   -- stored element type (e4m3: saturating RNE)
}
T.tiles = {
  {"threads", {128, 256, 512}},
  {"vec", {1, 2, 4, 8}},                -- elements per thread per grid step (loads in flight)
}

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (bf16 cvt)" end
  return true
end

function T.default_tile(k, arch) return {threads = 256, vec = 4} end

function T.variants(c)
  -- bf16: embeddings, norms, bf16 linears; e4m3: MXFP8 linears; f32: routers, biases.
  return {{dtype = "bf16"}, {dtype = "e4m3"}, {dtype = "f32"}}
end

local body = [[
#define THREADS $threads
#define VEC $vec
#define DT_BF16 $is_bf16
#define DT_E4M3 $is_e4m3

typedef unsigned long long u64;

M3_DEV float synth_normal(u64 seed, i64 i) {
  u64 z = seed + ((u64)i + 1ull) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  unsigned s = (unsigned)(z & 0xffffull) + (unsigned)((z >> 16) & 0xffffull) +
               (unsigned)((z >> 32) & 0xffffull) + (unsigned)(z >> 48);
  /* (sum - mean) exactly in fp32 (integers < 2^24), then one multiply. */
  return (float)((int)s - 131070) * 0x1.bb67aep-16f; /* fp32(sqrt(3) / 65536) */
}

extern "C" __global__ void __launch_bounds__(THREADS)
$sym(void *__restrict__ out, i64 n, u64 seed, float sigma) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const i64 per_cta = (i64)THREADS * VEC;
  for (i64 base = (i64)blockIdx.x * per_cta; base < n; base += (i64)gridDim.x * per_cta) {
#pragma unroll
    for (int j = 0; j < VEC; j++) {
      /* lane-consecutive elements: every store instruction is coalesced */
      const i64 i = base + (i64)j * THREADS + threadIdx.x;
      if (i < n) {
        const float v = sigma * synth_normal(seed, i);
#if DT_BF16
        ((bf16_t *)out)[i] = f32_to_bf16(v);
#elif DT_E4M3
        ((e4m3_t *)out)[i] = f32_to_e4m3(v);
#else
        ((float *)out)[i] = v;
#endif
      }
    }
  }
}
]]

function T.render(k, t, arch, sym)
  local v = {threads = t.threads, vec = t.vec, sym = sym,
             is_bf16 = k.dtype == "bf16" and 1 or 0, is_e4m3 = k.dtype == "e4m3" and 1 or 0}
  local src = body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("fill: no value for $" .. n) end
    return tostring(v[n])
  end)
  return {source = P.all(arch) .. src, threads = t.threads, smem = 0}
end

return T
