-- templates/l2_prefetch.lua - send part of a weight matrix toward L2 while
-- the decode step's latency-bound kernels leave HBM idle (runtime/
-- op_prefetch.h).  A decode step alternates between GEMVs that stream their
-- weights at the copy ceiling and chains of small kernels (qk-norm, indexer,
-- attention; norm, router, route) during which DRAM is nearly idle: on an
-- H100 at 8K those chains take ~20 us and ~8 us a layer.  A branch of the
-- step's graph that starts after one GEMV prefetches a slice of the next
-- GEMV's weights, which that GEMV then reads from L2.
--
-- The kernel writes nothing: its only effect is on timing.  It reads no
-- activation, so it needs no input from the previous kernel, but it still
-- passes the grid wait first: a prefetch issued while the previous GEMV
-- streams would compete with it and be evicted by it before use.
--
-- The slice is n chunks of `chunk` bytes at a fixed stride through the
-- matrix (m3_prefetch_plan_for), not its first bytes: every CTA of the GEMV owns
-- rows all over the matrix, and each should find the same share in L2, or
-- the CTAs with hits finish early and leave the rest to stream alone.
local P = m3.include("lib/prelude")

local T = {}
T.name = "l2_prefetch"
T.axes = {}
T.tiles = {
  {"op", {"bulk", "lines"}},    -- bulk: cp.async.bulk.prefetch.L2 a chunk (sm_90+); lines: prefetch.global.L2 a 128-byte line
  {"threads", {32, 64, 128, 256}},
  {"ctas", {1, 2, 4, 8, 16, 32, 64}}, -- the launch's grid (the launcher spreads the chunks over all its threads)
  {"pdl", {1, 0}},              -- 0: launched without programmatic dependent launch (a full graph edge from the
                                -- GEMV it follows, where 1 lets it be scheduled while that GEMV runs)
}

function T.valid(k, t, arch)
  local sm = m3.sm(arch)
  if t.op == "bulk" and sm < 90 then return false, "op=bulk is sm_90+ (cp.async.bulk.prefetch.L2); use op=lines" end
  if sm < 80 then return false, "needs sm_80+" end
  return true
end

function T.default_tile(k, arch)
  -- bulk: one instruction a chunk.  A 4-CTA launch takes ~17 us for 16 MB
  -- (H100), which fits the o_proj phase's window; 16 or 32 CTAs finish
  -- sooner but made the step no faster, and per-line prefetches (op=lines,
  -- 16 CTAs) none faster than no prefetch at all (device run 84).
  if m3.sm(arch) >= 90 then return {op = "bulk", threads = 32, ctas = 4, pdl = 1} end
  return {op = "lines", threads = 256, ctas = 16, pdl = 1}
end

function T.variants(c) return {{}} end

local body = [==[
#define THREADS $threads
#define OP_BULK $bulk

/* base: 16-byte aligned; item i covers [i * stride, i * stride + chunk)
 * clipped to total.  chunk and stride are multiples of 16 (bulk: the PTX
 * rule for the size and address). */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const char *__restrict__ base, i64 total, i64 stride, i64 chunk, i64 n) {
  M3_GRID_WAIT(); /* not during the previous kernel's stream (see the template's header) */
#if OP_BULK /* a thread an item: one instruction moves it */
  const i64 w0 = (i64)blockIdx.x * THREADS + threadIdx.x, nw = (i64)gridDim.x * THREADS;
  const int lane = 0, lanes = 1;
#else /* a warp an item: each instruction sends 32 consecutive lines */
  const i64 w0 = (i64)blockIdx.x * (THREADS / 32) + threadIdx.x / 32, nw = (i64)gridDim.x * (THREADS / 32);
  const int lane = threadIdx.x % 32, lanes = 32;
#endif
  for (i64 i = w0; i < n; i += nw) {
    const i64 off = i * stride;
    const i64 len = off + chunk <= total ? chunk : total - off;
    if (len <= 0) continue;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && OP_BULK
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"((unsigned)len) : "memory");
#elif defined(__CUDA_ARCH__) && !OP_BULK
    for (i64 b = (i64)lane * 128; b < len; b += (i64)lanes * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off + b));
#else /* the CPU emulator has no cache: no effect, as on the GPU */
    (void)base, (void)lane, (void)lanes;
#endif
  }
}
]==]

function T.render(k, t, arch, sym)
  local v = {threads = t.threads, sym = sym, bulk = t.op == "bulk" and 1 or 0}
  local src = body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("l2_prefetch: no value for $" .. n) end
    return tostring(v[n])
  end)
  return {source = P.all(arch) .. src, threads = t.threads, smem = 0}
end

return T
