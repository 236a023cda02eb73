-- templates/embed.lua - embedding gather, out[t] = table[ids[t]] as a bit copy
-- (spec §2.3: no scaling).  One CTA per token, 16-byte copies.  An id outside
-- [0, vocab) must never fault: the kernel leaves that token's row untouched
-- and records the smallest such token in an error word (lib/ffn flag_bad),
-- which the launcher turns into M3_RANGE naming the token (m3_ref_embed).
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")

local T = {}
T.name = "embed"
T.axes = {
  {"hidden", "int"},   -- row length; the vocabulary size is a run-time argument
}
T.tiles = {
  {"threads", {64, 128, 256, 512}},
}

local function vec(k) return (k.hidden % 8 == 0) and 8 or 1 end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+" end
  if k.hidden < 1 then return false, "hidden must be positive" end
  return true
end

function T.default_tile(k, arch) return {threads = 256} end

function T.variants(c)
  if not c.hidden or c.hidden < 1 then return {} end
  return {{hidden = c.hidden}}
end

local body = [==[
#define H $hidden
#define VEC $vec
#define CHUNKS (H / VEC)
#define THREADS $threads

/* ids [n] int32; table [vocab, H] bf16; out [n, H] bf16; err: error word. */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const int *__restrict__ ids, const bf16_t *__restrict__ table, bf16_t *__restrict__ out,
     int *__restrict__ err, long long n_tokens, long long vocab) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const long long t = blockIdx.x;
  if (t >= n_tokens) return;
  const int id = ids[t];
  if (id < 0 || (long long)id >= vocab) {
    if (threadIdx.x == 0) flag_bad(err, t);
    return;
  }
  const bf16_t *src = table + (long long)id * H;
  bf16_t *dst = out + t * H;
  for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
#if VEC == 8
    st16(dst + c * 8, ld16(src + c * 8));
#else
    dst[c] = src[c];
#endif
  }
}
]==]

function T.render(k, t, arch, sym)
  local src = F.subst("embed", body, {hidden = k.hidden, vec = vec(k), threads = t.threads, sym = sym})
  return {source = P.all(arch) .. F.base .. src, threads = t.threads, smem = 0}
end

return T
