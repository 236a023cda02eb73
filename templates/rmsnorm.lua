-- templates/rmsnorm.lua - Gemma RMSNorm over a hidden-sized row (spec §2.2,
-- §2.3), alone (input_layernorm of layer 0, the final norm after an explicit
-- add) or fused with the residual add (vLLM's gemma_fused_add_rmsnorm, §10.2).
-- One CTA per row (tile cluster=C: C CTAs, below); the row stays in registers
-- between the sum of squares and the scaling, so x (and the residual) are read
-- once and written once.
-- Matches m3_ref_rmsnorm / m3_ref_add_rmsnorm: the add is rounded to bf16 and
-- the norm reads that ROUNDED residual; r = 1/sqrtf(ss/n + eps) and
-- x*r*(1+w) with the references' roundings (only the fp32 sum of squares is
-- ordered differently, so outputs agree to within 1 bf16 ulp).
-- combine = K > 0 (add=1 only): x is not read but formed from the decode MoE
-- layer's expert outputs exactly as templates/moe_combine.lua (shared=1,
-- rowmap=0) forms it, x = bf16(sum_k w[t,k] y[t*K+k] + shared[t]), so the
-- combine launch and the write and re-read of x are saved (runtime/forward.c:
-- the next layer's input norm, or the final norm).  Same operations in the
-- same order, so r and y are the two launches' bit for bit.  combine=0
-- renders the plain kernel's text unchanged (its tuning records stay valid).
-- Tile cluster = C > 1 (sm_90): a row's columns are cut into C parts, one CTA
-- each, forming one thread-block cluster; each CTA's part of the sum of
-- squares goes to its shared memory, and after a cluster barrier every CTA
-- adds the C parts in rank order (the same bits in each) through distributed
-- shared memory.  At batch 1 one CTA a row reads the whole row alone (combine=4:
-- six rows, 74 KB, on one SM); C CTAs share that.  Only the order of the fp32
-- sum of squares changes with C (y within 1 bf16 ulp of the reference, as for
-- any tile); cluster=1 renders the kernel as before the axis existed.
local P = m3.include("lib/prelude")
local F = m3.include("lib/ffn")
local CLUSTER = m3.include("lib/cluster")

local T = {}
T.name = "rmsnorm"
T.axes = {
  {"add", {0, 1}},        -- 1: residual = bf16(x + residual), then normalise it
  {"f32copy", {0, 1}},    -- 1: also write float(y) for the fp32 router GEMM (§7.2)
  {"combine", "int"},     -- K > 0: x = the MoE combine of K routed rows + the shared expert's (§12.6)
  {"n", "int"},           -- row length (hidden size)
}
T.tiles = {
  {"threads", {64, 128, 256, 512, 768, 1024}},
  {"cluster", {1, 2, 4, 8}},    -- CTAs a row is cut over, one thread-block cluster (sm_90 for > 1)
}

-- 16-byte vectors when the row allows it, else one element per access.
local function vec(k) return (k.n % 8 == 0) and 8 or 1 end
local MAX_REG = 64  -- fp32 row values held per thread (register budget)

local function per_thread(k, t)
  local chunks = k.n // vec(k) // (t.cluster or 1)
  return (chunks + t.threads - 1) // t.threads
end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (bf16 cvt)" end
  if k.n < 1 then return false, "row length n must be positive" end
  if k.n >= (1 << 24) then return false, "n must be < 2^24 (exact as a float divisor)" end
  if k.combine < 0 or k.combine > 16 then
    return false, "combine is a top-k in [1, 16] (as moe_combine's), or 0 for a plain x"
  end
  if k.combine > 0 and k.add == 0 then
    return false, "combine needs add=1: the combined MoE output is a sublayer output, added to the residual"
  end
  local cl = t.cluster or 1
  if cl > 1 and m3.sm(arch) < 90 then return false, "cluster > 1 cuts a row over a thread-block cluster (sm_90+)" end
  if cl > 1 and (k.n // vec(k)) % cl ~= 0 then
    return false, string.format("a row of %d is %d vectors of %d elements, not a multiple of cluster=%d", k.n,
                                k.n // vec(k), vec(k), cl)
  end
  if cl > 1 and t.threads >= 2 * (k.n // vec(k) // cl) and t.threads > 64 then
    return false, string.format("cluster=%d leaves a CTA %d vectors of the row: half or more of %d threads would idle",
                                cl, k.n // vec(k) // cl, t.threads)
  end
  if per_thread(k, t) * vec(k) > MAX_REG then
    return false, string.format("a row of %d needs %d values per thread at %d threads (max %d in registers)",
                                k.n, per_thread(k, t) * vec(k), t.threads, MAX_REG)
  end
  return true
end

function T.default_tile(k, arch)
  for _, th in ipairs({256, 512, 1024, 128, 768, 64}) do
    if T.valid(k, {threads = th, cluster = 1}, arch) then return {threads = th, cluster = 1} end
  end
  return {threads = 256, cluster = 1}
end

function T.variants(c)
  local out = {}
  if c.hidden and c.hidden > 0 then
    out[#out + 1] = {add = 0, f32copy = 0, combine = 0, n = c.hidden}   -- layer 0 input norm
    out[#out + 1] = {add = 1, f32copy = 0, combine = 0, n = c.hidden}   -- input norms, final norm
    if c.has_moe ~= 0 then
      out[#out + 1] = {add = 1, f32copy = 1, combine = 0, n = c.hidden} -- post-attention norm of MoE layers
      -- The input norm after a decode MoE layer that left its combine to it
      -- (M3KIT_MOE_FUSE=norm: the dims' moe_fuse bit 8, runtime/op_ffn.h
      -- M3_MOE_FUSE_NORM), where the shared expert rides along in the routed
      -- GEMVs (as wide as a routed one): its rows follow the routed pairs'.
      if (c.moe_fuse or 0) & 8 ~= 0 and c.shared_inter == c.inter and (c.topk_experts or 0) > 0 then
        out[#out + 1] = {add = 1, f32copy = 0, combine = c.topk_experts, n = c.hidden}
      end
    end
  end
  return out
end

local body = [==[
#define N $n
#define VEC $vec
#define CHUNKS (N / VEC)
#define THREADS $threads
#define PER ((CHUNKS + THREADS - 1) / THREADS)
#define ADD $add
#define F32COPY $f32copy$cdefs

M3_DEV void load_vec(const bf16_t *p, float *v) {
#if VEC == 8
  uint4 u = ld16(p);
  v[0] = bf16lo(u.x); v[1] = bf16hi(u.x); v[2] = bf16lo(u.y); v[3] = bf16hi(u.y);
  v[4] = bf16lo(u.z); v[5] = bf16hi(u.z); v[6] = bf16lo(u.w); v[7] = bf16hi(u.w);
#else
  v[0] = bf16_to_f32(*p);
#endif
}
M3_DEV void store_vec(bf16_t *p, const float *v) {
#if VEC == 8
  uint4 u;
  u.x = pack_bf16(v[0], v[1]); u.y = pack_bf16(v[2], v[3]);
  u.z = pack_bf16(v[4], v[5]); u.w = pack_bf16(v[6], v[7]);
  st16(p, u);
#else
  *p = f32_to_bf16(v[0]);
#endif
}

/* x [rows, N] bf16 (may alias y); residual [rows, N] bf16 in/out (add=1);
 * w [N] bf16 Gemma offset; y [rows, N] bf16; y32 [rows, N] fp32 (f32copy=1). */
extern "C" __global__ void __launch_bounds__(THREADS)
$sym(const bf16_t *x, bf16_t *__restrict__ residual, const bf16_t *__restrict__ w, bf16_t *y,
     float *__restrict__ y32, long long n_rows, float eps$cparams) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  __shared__ float red[32];
  const long long row = blockIdx.x;
  if (row >= n_rows) return;
$xrow
  float v[PER][VEC];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; i++) {
    const int c = threadIdx.x + i * THREADS;
#pragma unroll
    for (int j = 0; j < VEC; j++) v[i][j] = 0.0f;
    if (c < CHUNKS) {
$xload
#if ADD
      /* The new residual stream, rounded once; the norm reads this rounded
       * value (m3_ref_add_rmsnorm, §12.10 choice). */
      bf16_t *rr = residual + row * N + c * VEC;
      float r[VEC];
      load_vec(rr, r);
#pragma unroll
      for (int j = 0; j < VEC; j++) v[i][j] = round_bf16(fadd_rn(v[i][j], r[j]));
      store_vec(rr, v[i]);
#endif
#pragma unroll
      for (int j = 0; j < VEC; j++) ss = ffma_rn(v[i][j], v[i][j], ss);
    }
  }
  ss = block_sum_once(ss, red);
  const float rs = fdiv_rn(1.0f, fsqrt_rn(fadd_rn(fdiv_rn(ss, (float)N), eps)));
#pragma unroll
  for (int i = 0; i < PER; i++) {
    const int c = threadIdx.x + i * THREADS;
    if (c < CHUNKS) {
      float wv[VEC], o[VEC];
      load_vec(w + c * VEC, wv);
#pragma unroll
      for (int j = 0; j < VEC; j++) o[j] = fmul_rn(fmul_rn(v[i][j], rs), fadd_rn(1.0f, wv[j]));
      store_vec(y + row * N + c * VEC, o);
#if F32COPY
      float *o32 = y32 + row * N + c * VEC;
#if VEC == 8
      float4 a, b;
      a.x = round_bf16(o[0]); a.y = round_bf16(o[1]); a.z = round_bf16(o[2]); a.w = round_bf16(o[3]);
      b.x = round_bf16(o[4]); b.y = round_bf16(o[5]); b.z = round_bf16(o[6]); b.w = round_bf16(o[7]);
      ((float4 *)o32)[0] = a;
      ((float4 *)o32)[1] = b;
#else
      o32[0] = round_bf16(o[0]);
#endif
#endif
    }
  }
}
]==]

-- combine = 0: the plain kernel's own lines (byte for byte the text before
-- the axis existed).  combine = K: x formed as moe_combine.lua forms it -
-- acc from 0, acc = acc + w_k * y_k in top-k order, + shared, every step
-- pinned (fmul_rn / fadd_rn), one rounding to bf16 (round_bf16 is the
-- float of the bf16 moe_combine stores) - then the plain add and norm.
local plain = {
  cparams = "",
  xrow = "  const bf16_t *xr = x + row * N;",
  xload = "      load_vec(xr + c * VEC, v[i]);",
}
local combined = {
  cparams = ",\n     const bf16_t *__restrict__ ey, const float *__restrict__ ew, const bf16_t *__restrict__ esh",
  xrow = [==[
  /* x is not read: ey [n_rows * TOPK, N] bf16 expert outputs in pair order
   * (row t*TOPK + k), ew [n_rows, TOPK] fp32 routing weights, esh [n_rows, N]
   * bf16 the shared expert's output (the decode layout of m3_moe_forward). */
  float wk[TOPK];
#pragma unroll
  for (int k = 0; k < TOPK; k++) wk[k] = ew[row * TOPK + k];]==],
  xload = [==[
      {
        float t[VEC]; /* v[i] starts at 0.0f: moe_combine's acc */
#pragma unroll
        for (int k = 0; k < TOPK; k++) {
          load_vec(ey + (row * TOPK + k) * N + c * VEC, t);
#pragma unroll
          for (int j = 0; j < VEC; j++) v[i][j] = fadd_rn(v[i][j], fmul_rn(wk[k], t[j]));
        }
        load_vec(esh + row * N + c * VEC, t);
#pragma unroll
        for (int j = 0; j < VEC; j++) v[i][j] = round_bf16(fadd_rn(v[i][j], t[j]));
      }]==],
}

-- cluster > 1: the edits of the rendered kernel, each found exactly as often
-- as counted (nil: at least once; -1: any number, x is not read with combine).
local CLUSTER_EDITS = {
  {"#define CHUNKS %(N / VEC%)", "#define CHUNKS (N / VEC / CL) /* this CTA's part of the row */", 1},
  {"  __shared__ float red%[32%];\n  const long long row = blockIdx.x;\n", [==[
  /* Tile cluster=CL: the CL CTAs of a cluster share row blockIdx.x / CL, the
   * rank's part from column col0 (dynamic shared memory: the emulator runs
   * cluster kernels with no static __shared__). */
  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  float *red = (float *)smem_raw; /* [32] the block sum's, [32] this CTA's part of the row's */
  const long long row = blockIdx.x / CL;
  const int col0 = (int)(blockIdx.x % CL) * (N / CL);
]==], 1},
  {"  ss = block_sum_once%(ss, red%);\n", [==[
  ss = block_sum_once(ss, red);
  /* The row's sum of squares: every CTA adds the CL parts in rank order. */
  if (threadIdx.x == 0) red[32] = ss;
  cluster_sync();
  {
    float part[CL];
#pragma unroll
    for (int q = 0; q < CL; q++) part[q] = ld_dsmem(red + 32, (unsigned)q); /* in flight together */
    ss = 0.0f;
#pragma unroll
    for (int q = 0; q < CL; q++) ss = fadd_rn(ss, part[q]);
  }
]==], 1},
  {"%* N %+ c %* VEC", "* N + col0 + c * VEC", nil},  -- residual, y, y32 (and ey, esh with combine)
  {"xr %+ c %* VEC", "xr + col0 + c * VEC", -1},
  {"load_vec%(w %+ c %* VEC", "load_vec(w + col0 + c * VEC", 1},
  {"\n  }\n}\n$", "\n  }\n  cluster_sync(); /* no CTA leaves while another may still read its part */\n}\n", 1},
}

function T.render(k, t, arch, sym)
  local parts = k.combine > 0 and combined or plain
  local cl = t.cluster or 1
  local src = F.subst("rmsnorm", body, {
    n = k.n, vec = vec(k), threads = t.threads, add = k.add, f32copy = k.f32copy, sym = sym,
    cdefs = k.combine > 0 and ("\n#define TOPK " .. k.combine) or "", cparams = parts.cparams,
    xrow = parts.xrow, xload = parts.xload,
  })
  if cl > 1 then
    for _, ed in ipairs(CLUSTER_EDITS) do
      local n
      src, n = src:gsub(ed[1], (ed[2]:gsub("%%", "%%%%")))
      if (ed[3] and ed[3] >= 0 and n ~= ed[3]) or (not ed[3] and n == 0) then error("rmsnorm: cluster edit '" .. ed[1] .. "' matched " .. n .. " times") end
    end
    src = "#define CL " .. cl .. "\n" .. src
  end
  return {source = P.all(arch) .. F.base .. (cl > 1 and CLUSTER.defs or "") .. src, threads = t.threads,
          smem = cl > 1 and 144 or 0}
end

return T
