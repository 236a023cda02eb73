-- templates/sample.lua - the next token from a logits row, one CTA per row:
--   greedy  argmax, ties -> lower id, NaN never chosen (m3_ref_greedy);
--   top_p   temperature + top-p exactly as m3_ref_sample_top_p, drawing with
--           the same counter-based generator (m3_rng_uniform(seed, step, row)),
--           so GPU and CPU pick the same token.
-- Exactness of top-p: the reference sums e_i = expf(x_i - max) sequentially
-- in (x desc, id asc) order, and accumulates p_i = e_i / Z the same way.  The
-- kernel reproduces those fp32 sums term for term over the candidate set
-- S = {e_i >= 2^-27}, sorted in shared memory: every later term provably
-- leaves both sums unchanged (Z >= 1, so a term < 2^-27 is below half an ulp
-- of Z; the cumulative sum is >= 0.5 by then and p_i <= e_i), so skipping
-- them is exact, not an approximation.  expf is lib/ffn's bit-exact port of
-- the host's.  A row whose S exceeds the `cap` tile (nearly flat logits) is
-- marked -2 and the launcher resolves it with the reference itself; an
-- all-NaN row is marked -1 (M3_NUMERICS).  `cap` therefore never changes a
-- result, only which rows take the host path.
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")
local R = m3.include("lib/route")

local T = {}
T.name = "sample"
T.axes = {
  {"mode", {"greedy", "top_p"}},
  {"logits", {"f32", "bf16"}},
  {"vocab", "int"},
}
T.tiles = {
  {"threads", {256, 512, 1024}},
  {"cap", {1024, 4096, 8192}},   -- top-p candidates sorted in shared memory
}

local function smem_limit(arch)
  local sm = m3.sm(arch)
  if sm >= 120 then return 101376 end
  if sm >= 90 then return 232448 end
  if sm == 80 or sm == 87 then return 166912 end
  return 101376
end
local STATIC = 1024   -- reduction scratch (bytes, generous)

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+" end
  if k.vocab < 1 then return false, "vocab must be positive" end
  if k.mode == "greedy" and t.cap ~= 4096 then
    return false, "cap is top-p's candidate capacity; greedy takes the default (4096)"
  end
  if k.mode == "top_p" and 12 * t.cap + STATIC > smem_limit(arch) then
    return false, string.format("cap %d needs %d B of shared memory > %d on %s", t.cap, 12 * t.cap, smem_limit(arch), arch)
  end
  return true
end

function T.default_tile(k, arch) return {threads = 1024, cap = 4096} end

function T.variants(c)
  if not c.vocab or c.vocab < 1 then return {} end
  return {{mode = "greedy", logits = "f32", vocab = c.vocab}, {mode = "top_p", logits = "f32", vocab = c.vocab}}
end

local body = [==[
#define V $vocab
#define THREADS $threads
#define NW (THREADS / 32)
#define CAP $cap
#define TOPP $topp
#define LBF16 $lbf16
#define VECN (LBF16 ? 8 : 4)
#define VEC_OK (V % VECN == 0)
#define FULL 0xffffffffu

/* The greedy choice's order is the router's (lib/route.lua beats). */
$beats
/* Visit the row's elements (id, value) in chunks of 16 bytes when aligned. */
#define FOR_ROW(row_ptr, BODY)                                                   \
  if (VEC_OK) {                                                                  \
    for (int c_ = threadIdx.x; c_ < V / VECN; c_ += THREADS) {                   \
      const uint4 u_ = ld16((const char *)(row_ptr) + (long long)c_ * 16);       \
      const u32 w_[4] = {u_.x, u_.y, u_.z, u_.w};                                \
      _Pragma("unroll") for (int j_ = 0; j_ < VECN; j_++) {                      \
        const int id = c_ * VECN + j_;                                           \
        const float raw = LBF16 ? (j_ & 1 ? bf16hi(w_[j_ >> 1]) : bf16lo(w_[j_ >> 1])) \
                                : __uint_as_float(w_[j_]);                       \
        BODY                                                                     \
      }                                                                          \
    }                                                                            \
  } else {                                                                       \
    for (int id = threadIdx.x; id < V; id += THREADS) {                          \
      const float raw = LBF16 ? bf16_to_f32(((const bf16_t *)(row_ptr))[id]) : ((const float *)(row_ptr))[id]; \
      BODY                                                                       \
    }                                                                            \
  }

/* Block-wide best under beats(); result on every thread. */
M3_DEV void block_best(float &v, int &i, float *rv, int *ri) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL, v, o);
    const int oi = __shfl_xor_sync(FULL, i, o);
    if (beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) { rv[w] = v; ri[w] = i; }
  __syncthreads();
  v = l < NW ? rv[l] : 0.0f;
  i = l < NW ? ri[l] : -1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL, v, o);
    const int oi = __shfl_xor_sync(FULL, i, o);
    if (beats(ov, oi, v, i)) { v = ov; i = oi; }
  }
  __syncthreads();   /* rv/ri may be reused */
}

#if TOPP
/* (x, id) comes after (y, jd) in (x desc, id asc): the order top-p sorts by. */
M3_DEV bool after(float a, int ia, float b, int ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  return a < b || (a == b && ia > ib);
}
M3_DEV bool before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

M3_DEV u64 mix64(u64 z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/* m3_rng_uniform(seed, step, row), exactly: 24 random bits * 2^-24. */
M3_DEV float rng_uniform(u64 seed, u64 step, u64 row) {
  const u64 r = mix64(mix64(mix64(seed) ^ step) ^ row);
  return fmul_rn(u2f_rn(r >> 40), 0x1p-24f);
}
/* e_i of the reference: 1/0 when the max is +inf, else expf(x - max). */
M3_DEV float mass(float x, float mx) {
  if (mx == __uint_as_float(0x7f800000u)) return x == mx ? 1.0f : 0.0f;
  return expf_ref(fsub_rn(x, mx));
}
#endif

/* logits [n_rows, V] fp32|bf16; out [n_rows] int32: the token, -1 for an
 * all-NaN row, -2 (top-p) for a row left to the host reference. */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const void *__restrict__ logits, int *__restrict__ out, long long n_rows, float temperature,
     float top_p, u64 seed, u64 step) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  __shared__ float rv[32];
  __shared__ int ri[32];
  const long long row = blockIdx.x;
  if (row >= n_rows) return;
  const char *lrow = (const char *)logits + row * (long long)V * (LBF16 ? 2 : 4);
#if TOPP
  if (temperature > 0.0f && top_p > 0.0f) {
    DYN_SMEM(float, smem);
    float *sx = smem, *se = smem + 2 * CAP;
    int *sid = (int *)(smem + CAP);
    __shared__ int s_cnt;
    __shared__ float s_mx;
    /* Phase A: max, the last element of the order, and whether any is a number. */
    float mx = __uint_as_float(0xff800000u), lv = 0.0f;
    int li = -1;
    FOR_ROW(lrow, {
      const float x = fdiv_rn(raw, temperature);
      if (x == x) {
        mx = fmaxf(mx, x);
        if (after(x, id, lv, li)) { lv = x; li = id; }
      }
    })
    /* max: reuse block_best on (value, any id): ties are irrelevant here. */
    float bm = mx;
    int bmi = li >= 0 ? 0 : -1;
    block_best(bm, bmi, rv, ri);
    if (bmi < 0) {                      /* no number in the row */
      if (threadIdx.x == 0) out[row] = -1;
      return;
    }
    /* the last element: reduce with after() by flipping it into beats() form */
    float blv = lv;
    int bli = li;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(FULL, blv, o);
      const int oi = __shfl_xor_sync(FULL, bli, o);
      if (after(ov, oi, blv, bli)) { blv = ov; bli = oi; }
    }
    if ((threadIdx.x & 31) == 0) { rv[threadIdx.x >> 5] = blv; ri[threadIdx.x >> 5] = bli; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int j = 1; j < NW; j++)
        if (after(rv[j], ri[j], blv, bli)) { blv = rv[j]; bli = ri[j]; }
      s_mx = bm;
      s_cnt = 0;
      ri[0] = bli;
    }
    __syncthreads();
    mx = s_mx;
    const int last_id = ri[0];
    if (mx == __uint_as_float(0xff800000u)) {
      /* every number is -inf: the reference's masses are expf(NaN) = NaN, so
       * no cumulative sum exceeds its threshold and it takes the last one. */
      if (threadIdx.x == 0) out[row] = last_id;
      return;
    }
    /* Phase B: the candidate set S, unordered.  x - max < -18.8 has mass
     * < 6.8e-9 < 2^-27 (a 9% margin, far above expf's error), so the bulk of
     * the vocabulary skips the expf; with a +inf max, S is the +inf logits. */
    const bool inf_max = mx == __uint_as_float(0x7f800000u);
    FOR_ROW(lrow, {
      const float x = fdiv_rn(raw, temperature);
      if (x == x && (inf_max ? x == mx : (fsub_rn(x, mx) >= -18.8f && mass(x, mx) >= 0x1p-27f))) {
        const int s = atomicAdd(&s_cnt, 1);
        if (s < CAP) { sx[s] = x; sid[s] = id; }
      }
    })
    __syncthreads();
    const int ns = s_cnt;
    if (ns > CAP) {
      if (threadIdx.x == 0) out[row] = -2;
      return;
    }
    /* Phase C: bitonic sort of S by (x desc, id asc), padded with sentinels
     * that sort last (no member of S is -inf). */
    int p2 = 1;
    while (p2 < ns) p2 <<= 1;
    for (int i = ns + threadIdx.x; i < p2; i += THREADS) { sx[i] = __uint_as_float(0xff800000u); sid[i] = M3_INT_MAX; }
    __syncthreads();
    for (int kk = 2; kk <= p2; kk <<= 1)
      for (int j = kk >> 1; j > 0; j >>= 1) {
        for (int i = threadIdx.x; i < p2; i += THREADS) {
          const int ixj = i ^ j;
          if (ixj > i) {
            const float a = sx[i], b = sx[ixj];
            const int ia = sid[i], ib = sid[ixj];
            const bool sw = (i & kk) == 0 ? before(b, ib, a, ia) : before(a, ia, b, ib);
            if (sw) { sx[i] = b; sx[ixj] = a; sid[i] = ib; sid[ixj] = ia; }
          }
        }
        __syncthreads();
      }
    for (int i = threadIdx.x; i < ns; i += THREADS) se[i] = mass(sx[i], mx);
    __syncthreads();
    /* Phase D: the reference's sequential sums, term for term. */
    if (threadIdx.x == 0) {
      float z = 0.0f;
      for (int i = 0; i < ns; i++) z = fadd_rn(z, se[i]);
      float cum = 0.0f;
      int kept = -1;
      for (int i = 0; i < ns; i++) {
        cum = fadd_rn(cum, fdiv_rn(se[i], z));
        se[i] = cum;
        if (cum >= top_p) { kept = i + 1; break; }
      }
      const int lim = kept > 0 ? kept : ns;
      const float thr = fmul_rn(rng_uniform(seed, step, (u64)row), se[lim - 1]);
      int pick = -1;
      for (int i = 0; i < lim; i++)
        if (se[i] > thr) { pick = sid[i]; break; }
      if (pick < 0) pick = kept > 0 ? sid[kept - 1] : last_id;
      out[row] = pick;
    }
    return;
  }
#endif
  /* Greedy (also top-p's temperature <= 0 or top_p <= 0, as the reference). */
  float bv = 0.0f;
  int bi = -1;
  FOR_ROW(lrow, {
    if (beats(raw, id, bv, bi)) { bv = raw; bi = id; }
  })
  block_best(bv, bi, rv, ri);
  if (threadIdx.x == 0) out[row] = (bi < 0 || bv != bv) ? -1 : bi;
}
]==]

function T.render(k, t, arch, sym)
  local topp = k.mode == "top_p"
  local src = F.subst("sample", body, {
    vocab = k.vocab, threads = t.threads, cap = t.cap, topp = topp and 1 or 0,
    lbf16 = k.logits == "bf16" and 1 or 0, sym = sym, beats = R.beats,
  })
  return {source = P.all(arch) .. F.base .. src, threads = t.threads, smem = topp and 12 * t.cap or 0}
end

return T
