-- templates/qknorm_rope.lua - fused per-head Gemma RMSNorm + partial NeoX RoPE,
-- optionally scattering K/V into the paged KV cache and index-K into the index
-- cache (spec §3.3, §3.4, §4).  A group of `lph` lanes per (token, head
-- slot), each lane owning hd/lph contiguous dims; all math in fp32, one
-- rounding at each store.  lph = 32 (one warp a head, 4 dims a lane) has the
-- least latency per head, what 1-64-token decode launches need; at an
-- 8192-token prefill chunk that form is issue-bound (ncu: 225 instructions a
-- head, IPC 3.2, 46% of copy), since each lane repeats the head's scalar work
-- (metadata, index math, sqrt, reciprocal) for 4 dims only: lph = 8 or 16
-- shares it over 16 or 8 dims and runs 4 or 2 heads a warp.
local P = m3.include("lib/prelude")

local T = {}
T.name = "qknorm_rope"
T.axes = {
  {"attn", {"dense", "sparse"}},
  {"insert", {0, 1}},
  {"kv", {"bf16", "e4m3"}},     -- main KV cache dtype (identity scale)
  {"idxk", {"bf16", "e4m3"}},   -- index_q output and index-K cache dtype
  {"nq", "int"}, {"nkv", "int"}, {"niq", "int"},
  {"hd", "int"}, {"rot", "int"}, {"bs", "int"},
}
T.tiles = {
  {"warps", {2, 4, 8, 16}},     -- warps (head slots) per CTA
  {"hpw", {1, 2, 4}},           -- head slots per lane group (more loads in flight)
  {"lph", {32, 16, 8}},         -- lanes per head slot (hd/lph dims a lane)
  {"rope", {"pair", "bal"}},    -- lph = 8: NeoX partners in one lane, the rotation on half the lanes (pair)
                                --   or spread over all 8 (bal: rotary_dim 64; three loads a vector, not two)
}

local function slots(k)
  local n = k.nq + k.nkv
  if k.insert == 1 then n = n + k.nkv end
  if k.attn == "sparse" then n = n + k.niq + 1 end
  return n
end

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (bf16 cvt)" end
  if k.hd ~= 128 then return false, "head_dim must be 128 (lane groups of 8, 16 or 32 split it evenly)" end
  if k.rot < 8 or k.rot > k.hd or k.rot % 8 ~= 0 then
    return false, "rotary_dim must be a multiple of 8 in [8, head_dim]"
  end
  if k.nq < 1 or k.nkv < 1 then return false, "nq and nkv must be >= 1" end
  if k.nq % k.nkv ~= 0 then return false, "nkv must divide nq" end
  if k.attn == "dense" and k.niq ~= 0 then return false, "dense layers have no index heads: niq must be 0" end
  if k.attn == "dense" and k.idxk ~= "bf16" then return false, "dense layers have no index side: idxk must be bf16" end
  if k.attn == "sparse" and k.niq < 1 then return false, "sparse layers need niq >= 1" end
  if k.insert == 0 and k.kv ~= "bf16" then return false, "kv dtype matters only with insert=1: use kv=bf16" end
  if k.bs < 1 then return false, "block size must be positive" end
  local dpl = k.hd // t.lph
  if t.lph < 32 and k.rot % (2 * dpl) ~= 0 then
    return false, "lph < 32 needs rotary_dim a multiple of 2 x hd/lph (a rotation partner one lane group away)"
  end
  if t.hpw * dpl > 32 then return false, "hpw x hd/lph > 32 dims a lane: the registers would spill" end
  if t.rope == "bal" and (t.lph ~= 8 or k.rot ~= 64) then
    return false, "rope=bal spreads 32 rotation pairs over 8 lanes: needs lph=8 and rotary_dim 64"
  end
  if t.warps * t.hpw * (32 // t.lph) > slots(k) * 64 then
    return false, "CTA covers more head slots than 64 tokens hold"
  end
  return true
end

-- The default (a shape the tuning DB lacks): lph = 8 where rotary_dim lets
-- it.  Device run 67 (H100) tuned 60 (variant, token count) records: lph = 8
-- won every one from 64 tokens up, where lph = 32 ran 1.27-1.76x slower; at
-- 1-16 tokens lph = 32 won 16 of 36, and this tile is at most 8.4% (0.13 us)
-- behind the best there.
function T.default_tile(k, arch)
  if k.rot == 64 then return {warps = 4, hpw = 1, lph = 8, rope = "bal"} end
  if k.rot % 32 == 0 then return {warps = 4, hpw = 1, lph = 8, rope = "pair"} end
  return {warps = 4, hpw = 1, lph = 32, rope = "pair"}
end

function T.variants(c)
  local out = {}
  local function add(attn, insert, kv, idxk)
    out[#out + 1] = {attn = attn, insert = insert, kv = kv, idxk = idxk, nq = c.nq, nkv = c.nkv,
                     niq = attn == "sparse" and c.niq or 0, hd = c.hd, rot = c.rot, bs = c.bs}
  end
  if c.has_dense ~= 0 then
    add("dense", 0, "bf16", "bf16")
    for _, kv in ipairs({"bf16", "e4m3"}) do add("dense", 1, kv, "bf16") end
  end
  if c.has_sparse ~= 0 then
    for _, ix in ipairs({"bf16", "e4m3"}) do
      add("sparse", 0, "bf16", ix)
      for _, kv in ipairs({"bf16", "e4m3"}) do add("sparse", 1, kv, ix) end
    end
  end
  return out
end

local body = [[
#define NQ $nq
#define NKV $nkv
#define NIQ $niq
#define HD 128
#define ROT $rot
#define BS $bs
#define SPARSE $sparse
#define INSERT $insert
#define KV_E4M3 $kv_e4m3
#define IDX_E4M3 $idx_e4m3
#define WARPS $warps
#define HPW $hpw
#define ROW ((NQ + 2 * NKV + (SPARSE ? NIQ + 1 : 0)) * HD)
#define SLOTS (NQ + NKV + (INSERT ? NKV : 0) + (SPARSE ? NIQ + 1 : 0))

#define LPH $lph                /* lanes per head slot */
#define DPL (HD / LPH)          /* dims per lane: 4, 8 or 16 */
#define GPW (32 / LPH)          /* head slots a warp works on at once */

/* PAIRED (lph = 8, ROT in {32, 64, 128}): a lane's 16 dims are two 8-dim
 * pieces ROT/2 apart, m and m + ROT/2, so that NeoX partners sit in one
 * lane and the rotation needs no shuffle (ncu, 8192 tokens: issue-bound,
 * 78% of issue slots busy, and the 16 partner shuffles a lane were a head's
 * largest instruction block).  Lane j's pieces are chunks (16 bytes) b and
 * b + R of the head, b = (j / R) 2R + j % R, R = ROT/16: lanes j < R hold the
 * rotary dims, the others the rest, and each 16-byte load instruction of the
 * group still covers whole 32-byte sectors. */
#define PR (ROT / 16)
/* BAL (tile rope=bal: lph = 8, ROT = 64, minimax-m3's partial rotary): the
 * rotation's work spread over all 8 lanes instead of PAIRED's 4 (whose other
 * 4 lanes issue the same rotation instructions, predicated off, where the
 * insert variants are issue-bound), for a third load instruction a vector.
 * Lane j holds three pieces: dims 4j..4j+3 (elements 0-3), their NeoX
 * partners 32+4j.. (4-7) and the unrotated 64+8j.. (8-15); each of the three
 * load instructions of a group covers 64, 64 and 128 contiguous bytes. */
#define BAL $bal
#define PAIRED (!BAL && DPL == 16 && ROT % 16 == 0 && 16 % (2 * PR) == 0)
/* Dim offset of the lane's piece c (of DPL / 8) from j * DPL, the base
 * every caller passes. */
M3_DEV int piece(int c) {
#if PAIRED
  const int j = (threadIdx.x & 31) % LPH, b = (j / PR) * 2 * PR + j % PR;
  return (b + c * PR) * 8 - j * DPL;
#else
  return 8 * c;
#endif
}

struct f4 { float v[DPL]; };
/* DPL bf16 as loaded (pairs in 32-bit words), widened one element at a time
 * where it is used: the head vector, its norm weight and cos/sin stay packed
 * while loads are in flight and during the math, which halves their
 * registers (lph = 8: 90 -> ~60), and registers bound the warps an SM holds,
 * i.e. the bytes it has in flight (the 8192-token launch is latency-bound). */
struct pk { unsigned u[DPL / 2]; };
M3_DEV float pk_at(const pk &p, int i) {
  return bf16_to_f32((bf16_t)((i & 1) ? (p.u[i >> 1] >> 16) : (p.u[i >> 1] & 0xffff)));
}

M3_DEV unsigned pack2(float a, float b) {
  return (unsigned)f32_to_bf16(a) | ((unsigned)f32_to_bf16(b) << 16);
}
#if BAL
/* The lane's index in its group.  The BAL helpers take p = the head's start
 * + j * DPL, as every caller passes, and step back to the head's start. */
M3_DEV int bal_j() { return (threadIdx.x & 31) % LPH; }
#endif
/* DPL bf16 at p, DPL*2-byte aligned: one 8-byte load at DPL 4, BAL's three
 * (8, 8, 16 bytes), else 16-byte ones. */
M3_DEV pk loadpk(const bf16_t *p) {
  pk r;
#if BAL
  const int j = bal_j();
  const bf16_t *h = p - j * DPL;
  const uint2 a = *(const uint2 *)(h + 4 * j), b = *(const uint2 *)(h + ROT / 2 + 4 * j);
  const uint4 c = *(const uint4 *)(h + ROT + 8 * j);
  r.u[0] = a.x; r.u[1] = a.y; r.u[2] = b.x; r.u[3] = b.y;
  r.u[4] = c.x; r.u[5] = c.y; r.u[6] = c.z; r.u[7] = c.w;
#elif DPL == 4
  uint2 u = *(const uint2 *)p;
  r.u[0] = u.x; r.u[1] = u.y;
#else
#pragma unroll
  for (int c = 0; c < DPL / 8; c++) {
    uint4 u = *(const uint4 *)(p + piece(c));
    r.u[4 * c] = u.x; r.u[4 * c + 1] = u.y; r.u[4 * c + 2] = u.z; r.u[4 * c + 3] = u.w;
  }
#endif
  return r;
}
M3_DEV void storepk(bf16_t *p, const pk &x) {
#if BAL
  const int j = bal_j();
  bf16_t *h = p - j * DPL;
  *(uint2 *)(h + 4 * j) = make_uint2(x.u[0], x.u[1]);
  *(uint2 *)(h + ROT / 2 + 4 * j) = make_uint2(x.u[2], x.u[3]);
  *(uint4 *)(h + ROT + 8 * j) = make_uint4(x.u[4], x.u[5], x.u[6], x.u[7]);
#elif DPL == 4
  *(uint2 *)p = make_uint2(x.u[0], x.u[1]);
#else
#pragma unroll
  for (int c = 0; c < DPL / 8; c++)
    *(uint4 *)(p + piece(c)) = make_uint4(x.u[4 * c], x.u[4 * c + 1], x.u[4 * c + 2], x.u[4 * c + 3]);
#endif
}
M3_DEV f4 unpack4(const pk &x) {
  f4 r;
  for (int i = 0; i < DPL; i++) r.v[i] = pk_at(x, i);
  return r;
}
M3_DEV pk zeropk() {
  pk r;
  for (int i = 0; i < DPL / 2; i++) r.u[i] = 0u;
  return r;
}
M3_DEV void store4_bf16(bf16_t *p, const f4 &x) {
#if BAL
  const int j = bal_j();
  bf16_t *h = p - j * DPL;
  const float *v = x.v;
  *(uint2 *)(h + 4 * j) = make_uint2(pack2(v[0], v[1]), pack2(v[2], v[3]));
  *(uint2 *)(h + ROT / 2 + 4 * j) = make_uint2(pack2(v[4], v[5]), pack2(v[6], v[7]));
  *(uint4 *)(h + ROT + 8 * j) = make_uint4(pack2(v[8], v[9]), pack2(v[10], v[11]), pack2(v[12], v[13]), pack2(v[14], v[15]));
#elif DPL == 4
  *(uint2 *)p = make_uint2(pack2(x.v[0], x.v[1]), pack2(x.v[2], x.v[3]));
#else
#pragma unroll
  for (int c = 0; c < DPL / 8; c++) {
    const float *v = x.v + 8 * c;
    *(uint4 *)(p + piece(c)) = make_uint4(pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7]));
  }
#endif
}
M3_DEV unsigned pack4_e4m3(const float *v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  /* two values a cvt (f32_to_e4m3 converts one and masks): the same bytes */
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[1]), "f"(v[0]));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[3]), "f"(v[2]));
  return (unsigned)lo | ((unsigned)hi << 16);
#else
  return (unsigned)f32_to_e4m3(v[0]) | ((unsigned)f32_to_e4m3(v[1]) << 8) |
         ((unsigned)f32_to_e4m3(v[2]) << 16) | ((unsigned)f32_to_e4m3(v[3]) << 24);
#endif
}
M3_DEV void store4_e4m3(e4m3_t *p, const f4 &x) {
#if BAL
  const int j = bal_j();
  e4m3_t *h = p - j * DPL;
  *(unsigned *)(h + 4 * j) = pack4_e4m3(x.v);
  *(unsigned *)(h + ROT / 2 + 4 * j) = pack4_e4m3(x.v + 4);
  *(uint2 *)(h + ROT + 8 * j) = make_uint2(pack4_e4m3(x.v + 8), pack4_e4m3(x.v + 12));
#elif DPL == 4
  *(unsigned *)p = pack4_e4m3(x.v);
#elif DPL == 8
  *(uint2 *)p = make_uint2(pack4_e4m3(x.v), pack4_e4m3(x.v + 4));
#else
  *(uint2 *)(p + piece(0)) = make_uint2(pack4_e4m3(x.v), pack4_e4m3(x.v + 4));
  *(uint2 *)(p + piece(1)) = make_uint2(pack4_e4m3(x.v + 8), pack4_e4m3(x.v + 12));
#endif
}
M3_DEV f4 round4_bf16(f4 x) {
  for (int i = 0; i < DPL; i++) x.v[i] = bf16_to_f32(f32_to_bf16(x.v[i]));
  return x;
}

/* Gemma RMSNorm over the group's 128-vector, then NeoX rotation of dims
 * [0, ROT): dim m pairs with m + ROT/2, so lane j's partner is j +- ROT/(2 DPL)
 * of its group.
 * Bit-exact with m3_ref_qknorm_rope: the sum of squares is exact in fp64
 * (bf16 squares need 16 bits; any order gives the same sum), and every fp32
 * step is one explicitly rounded operation (no FMA contraction, IEEE sqrt and
 * reciprocal) in the reference's order.  Costs nothing here (memory-bound),
 * and it makes the e4m3 index outputs identical to the reference's, which the
 * block selection downstream depends on. */
M3_DEV double group_sum_d(double v) {
#pragma unroll
  for (int o = LPH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/* The lane's norm weights and cos/sin, loaded before the group's sum (after
 * it they were a second dependent round trip per head): the weights with the
 * head vector, cos/sin once the position has been checked. */
struct aux { pk w, c, s; };
M3_DEV void load_cos_sin(aux &a, const bf16_t *cs, int j) {
#if BAL
  /* the 4 angles of the lane's pairs: 4 cos, 4 sin */
  a.c = a.s = zeropk();
  const uint2 c = *(const uint2 *)(cs + 4 * j), s = *(const uint2 *)(cs + ROT / 2 + 4 * j);
  a.c.u[0] = c.x; a.c.u[1] = c.y;
  a.s.u[0] = s.x; a.s.u[1] = s.y;
  return;
#endif
#if PAIRED
  /* both pieces rotate by the same angles: 8 cos and 8 sin */
  a.c = a.s = zeropk();
  if (j < PR) {
    const uint4 c = *(const uint4 *)(cs + 8 * j), s = *(const uint4 *)(cs + ROT / 2 + 8 * j);
    a.c.u[0] = c.x; a.c.u[1] = c.y; a.c.u[2] = c.z; a.c.u[3] = c.w;
    a.s.u[0] = s.x; a.s.u[1] = s.y; a.s.u[2] = s.z; a.s.u[3] = s.w;
  }
  return;
#endif
  const int half_lanes = ROT / (2 * DPL);
  const int m = j < half_lanes ? j * DPL : j * DPL - ROT / 2;
  if (j < 2 * half_lanes) {
    a.c = loadpk(cs + m);
    a.s = loadpk(cs + ROT / 2 + m);
  } else {
    a.c = a.s = zeropk();
  }
}
/* Every lane of the warp must call this together (shuffles with a full mask). */
M3_DEV f4 norm_rope(const pk &xp, const aux &a, float eps, int j) {
  double ss = 0.0;
  for (int i = 0; i < DPL; i++) {
    const float v = pk_at(xp, i);
    ss += (double)v * v;
  }
  ss = group_sum_d(ss);
  float r = __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn((float)ss, 1.0f / HD), eps)));
  f4 x;
#if BAL
  for (int i = 0; i < 4; i++) {
    const float v0 = __fmul_rn(__fmul_rn(pk_at(xp, i), r), __fadd_rn(1.0f, pk_at(a.w, i)));
    const float v1 = __fmul_rn(__fmul_rn(pk_at(xp, 4 + i), r), __fadd_rn(1.0f, pk_at(a.w, 4 + i)));
    const float c = pk_at(a.c, i), s = pk_at(a.s, i);
    x.v[i] = __fsub_rn(__fmul_rn(v0, c), __fmul_rn(v1, s));
    x.v[4 + i] = __fadd_rn(__fmul_rn(v1, c), __fmul_rn(v0, s));
  }
  for (int i = 8; i < 16; i++) x.v[i] = __fmul_rn(__fmul_rn(pk_at(xp, i), r), __fadd_rn(1.0f, pk_at(a.w, i)));
  return x;
#endif
#if PAIRED
  const int rot = j < PR;
  for (int i = 0; i < 8; i++) {
    const float v0 = __fmul_rn(__fmul_rn(pk_at(xp, i), r), __fadd_rn(1.0f, pk_at(a.w, i)));
    const float v1 = __fmul_rn(__fmul_rn(pk_at(xp, 8 + i), r), __fadd_rn(1.0f, pk_at(a.w, 8 + i)));
    const float c = pk_at(a.c, i), s = pk_at(a.s, i);
    x.v[i] = rot ? __fsub_rn(__fmul_rn(v0, c), __fmul_rn(v1, s)) : v0;
    x.v[8 + i] = rot ? __fadd_rn(__fmul_rn(v1, c), __fmul_rn(v0, s)) : v1;
  }
  return x;
#endif
  const int half_lanes = ROT / (2 * DPL);
  const int lane = threadIdx.x & 31;
  const int first = j < half_lanes, rotating = j < 2 * half_lanes;
  const int src = rotating ? (first ? lane + half_lanes : lane - half_lanes) : lane;
  /* Element by element: each value's partner is shuffled (every lane at
   * once, so all read the pre-rotation value) and rotated before the next is
   * formed, so no second DPL-float array is live. */
  for (int i = 0; i < DPL; i++) {
    const float v = __fmul_rn(__fmul_rn(pk_at(xp, i), r), __fadd_rn(1.0f, pk_at(a.w, i)));
    const float o = __shfl_sync(0xffffffffu, v, src);
    const float c = pk_at(a.c, i), s = pk_at(a.s, i);
    x.v[i] = !rotating ? v
           : first ? __fsub_rn(__fmul_rn(v, c), __fmul_rn(o, s)) : __fadd_rn(__fmul_rn(v, c), __fmul_rn(o, s));
  }
  return x;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
$sym(bf16_t *__restrict__ qkv,                 /* [N, ROW] in/out */
     const bf16_t *__restrict__ q_w, const bf16_t *__restrict__ k_w,
     const bf16_t *__restrict__ iq_w, const bf16_t *__restrict__ ik_w, /* [HD] */
     const bf16_t *__restrict__ cos_sin,       /* [max_pos, ROT] */
     const i64 *__restrict__ positions,        /* [N] */
     const i64 *__restrict__ slot_mapping,     /* [N] (insert) */
     const i64 *__restrict__ index_slot_mapping, /* [N] (sparse insert) */
     void *__restrict__ kv_cache,              /* [blocks, NKV, BS, 2*HD] */
     void *__restrict__ index_cache,           /* [blocks*BS, HD] */
     bf16_t *__restrict__ q_out,               /* [N, NQ*HD] or NULL */
     void *__restrict__ index_q_out,           /* [N, NIQ*HD] or NULL */
     int n_tokens, i64 max_pos, float eps) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const int lane = threadIdx.x & 31, j = lane % LPH, g = lane / LPH;
  /* 32-bit slot indices: the launcher refuses n_tokens x SLOTS >= 2^31. */
  const unsigned warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
  /* Three passes over the lane group's HPW head slots (a warp's GPW groups
   * take adjacent slots: adjacent heads of a row, contiguous bytes).  First every load that
   * needs only the token index is issued at once: its slot and position, the
   * 256-byte head vector and the norm weight (a token index < n_tokens is
   * always a readable row).  Then, once the metadata is in, padding rows
   * (slot < 0) and positions outside the RoPE table are dropped before their
   * cos/sin is read (known-faults #5, #24), and the rest issue it.  Last,
   * each is normed, rotated and stored.  So a head costs two dependent
   * round trips, not four (slot, then position, then vector, then cos/sin),
   * and HPW heads per warp (the tile) multiply the bytes in flight that DRAM
   * latency x an SM's share of bandwidth needs. */
  pk xin[HPW];
  aux ax[HPW];
  i64 tok[HPW], slt[HPW], psn[HPW];
  int sl[HPW];
#pragma unroll
  for (int h = 0; h < HPW; h++) {
    const unsigned item = (warp * HPW + h) * GPW + g;
    sl[h] = -1;
#if LPH < 32
    xin[h] = ax[h].w = ax[h].c = ax[h].s = zeropk(); /* dropped slots still join the shuffles */
#endif
    if (item >= (unsigned)n_tokens * SLOTS) continue;
    const unsigned t = item / SLOTS;
    const int s = (int)(item - t * SLOTS);
    slt[h] = INSERT ? slot_mapping[t] : -1;
    psn[h] = positions[t];
    /* Slots enumerate q, k, (v with insert), iq, ik: the row's head order,
     * less the v heads when they are not inserted. */
    const int head = (INSERT || s < NQ + NKV) ? s : s + NKV;
    xin[h] = loadpk(qkv + t * (i64)ROW + head * HD + j * DPL);
    /* the head's norm weight: q, k (v: none, a harmless k load), iq, ik */
    int r = s;
    const bf16_t *w = q_w;
    if (r >= NQ) { r -= NQ; w = k_w; if (r >= NKV) { r -= NKV; if (INSERT && r < NKV) w = k_w;
      else { if (INSERT) r -= NKV; w = r < NIQ ? iq_w : ik_w; } } }
    ax[h].w = loadpk(w + j * DPL);
    tok[h] = t, sl[h] = s;
  }
#pragma unroll
  for (int h = 0; h < HPW; h++) {
    if (sl[h] < 0) continue;
    const i64 pos = psn[h];
    if ((INSERT && slt[h] < 0) || pos < 0 || pos >= max_pos) { sl[h] = -1; continue; }
    load_cos_sin(ax[h], cos_sin + pos * ROT, j);
  }
  /* With one head a warp every branch below is warp-uniform and norm_rope is
   * called where its result is used (the compiler cannot prove that, so each
   * call site costs a WARPSYNC sequence, but the 1-64-token launches measured
   * faster this way).  With several heads a warp the groups of one warp take
   * different branches, so every slot is normed and rotated first, all lanes
   * together (a V head's result and a dropped slot's zeros are unused). */
#if LPH < 32
  f4 xn[HPW];
#pragma unroll
  for (int h = 0; h < HPW; h++) {
    /* ... except where no group of the warp needs it: a warp of V heads only
     * (copied as they are) or of dropped slots skips the norm, warp-uniformly
     * so the shuffles stay whole. */
    const int need = sl[h] >= 0 && !(INSERT && sl[h] >= NQ + NKV && sl[h] < NQ + 2 * NKV);
    if (__any_sync(0xffffffffu, need)) xn[h] = norm_rope(xin[h], ax[h], eps, j);
  }
#define NORMED(h) xn[h]
#else
#define NORMED(h) norm_rope(xin[h], ax[h], eps, j)
#endif
#pragma unroll
  for (int h = 0; h < HPW; h++) {
    int s = sl[h];
    if (s < 0) continue;
    const i64 t = tok[h], slot = slt[h];
    bf16_t *row = qkv + t * (i64)ROW;
    const i64 page = slot / BS, off = slot % BS;
    if (s < NQ) {                                   /* Q head */
      f4 x = NORMED(h);
      store4_bf16(q_out ? q_out + t * (i64)(NQ * HD) + s * HD + j * DPL : row + s * HD + j * DPL, x);
      continue;
    }
    s -= NQ;
    if (s < NKV) {                                  /* K head */
      bf16_t *src = row + (NQ + s) * HD + j * DPL;
      f4 x = NORMED(h);
      store4_bf16(src, x);
      if (INSERT) {
        i64 at = ((page * NKV + s) * BS + off) * (2 * HD) + j * DPL;
        if (KV_E4M3) store4_e4m3((e4m3_t *)kv_cache + at, SPARSE ? x : round4_bf16(x));
        else store4_bf16((bf16_t *)kv_cache + at, x);
      }
      continue;
    }
    s -= NKV;
    if (INSERT && s < NKV) {                        /* V head: copied as is */
      i64 at = ((page * NKV + s) * BS + off) * (2 * HD) + HD + j * DPL;
      if (KV_E4M3) store4_e4m3((e4m3_t *)kv_cache + at, unpack4(xin[h]));
      else storepk((bf16_t *)kv_cache + at, xin[h]);
      continue;
    }
    if (INSERT) s -= NKV;
#if SPARSE
    if (s < NIQ) {                                  /* index-Q head */
      bf16_t *src = row + (NQ + 2 * NKV + s) * HD + j * DPL;
      f4 x = NORMED(h);
      if (index_q_out) {
        i64 at = t * (i64)(NIQ * HD) + s * HD + j * DPL;
        if (IDX_E4M3) store4_e4m3((e4m3_t *)index_q_out + at, x);
        else store4_bf16((bf16_t *)index_q_out + at, x);
      } else {
        store4_bf16(src, x);
      }
      continue;
    }
    {                                               /* the single index-K head */
      bf16_t *src = row + (NQ + 2 * NKV + NIQ) * HD + j * DPL;
      f4 x = NORMED(h);
      store4_bf16(src, x);
      if (INSERT) {
        i64 islot = index_slot_mapping ? index_slot_mapping[t] : slot;
        if (islot >= 0) {
          i64 at = islot * HD + j * DPL;
          if (IDX_E4M3) store4_e4m3((e4m3_t *)index_cache + at, x);
          else store4_bf16((bf16_t *)index_cache + at, x);
        }
      }
    }
#endif
  }
}
]]

function T.render(k, t, arch, sym)
  local v = {
    nq = k.nq, nkv = k.nkv, niq = k.niq, rot = k.rot, bs = k.bs,
    sparse = k.attn == "sparse" and 1 or 0, insert = k.insert,
    kv_e4m3 = k.kv == "e4m3" and 1 or 0, idx_e4m3 = k.idxk == "e4m3" and 1 or 0,
    warps = t.warps, hpw = t.hpw, lph = t.lph, bal = t.rope == "bal" and 1 or 0, sym = sym,
  }
  local src = body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("qknorm_rope: no value for $" .. n) end
    return tostring(v[n])
  end)
  return {source = P.all(arch) .. src, threads = t.warps * 32, smem = 0}
end

return T
