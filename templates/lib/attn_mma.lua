-- templates/lib/attn_mma.lua - the attention engine shared by attn_sparse.lua
-- and attn_dense.lua (spec §6): GQA over the paged KV cache with tensor-core
-- mma.sync.m16n8k16, one query token's whole GQA group per warp.
--
-- Why this shape.  The 16 query heads of a KV head read the same keys, so the
-- mma's M = 16 rows are those heads (rows >= nq/nkv are zero padding): every
-- K/V element fetched is used by the whole group, and decode is bound by the
-- KV bytes alone.  Fragments are loaded from global memory straight into mma
-- operand registers, with no shared-memory staging:
--   * S = Q·Kᵀ contracts over head dims, so dims may be permuted as long as Q
--     and K use the same permutation: each lane's 4 dims of a k-step are
--     chosen contiguous, and one 16-byte load feeds 2 (bf16) or 4 (e4m3)
--     k-steps.  Per instruction the warp reads 8 keys x 64 contiguous bytes.
--   * O = P·V contracts over keys; the S accumulators are the P operand as is
--     (the FlashAttention-2 register layout).  The V operand pairs two keys
--     per register, built with prmt from 16-byte loads; the output columns
--     are permuted (out_dim() below) so that each lane's V loads are
--     contiguous and the warp reads whole 128-byte rows.  The permutation is
--     undone at the store.
-- e4m3 caches are decoded to fp16 (exact, subnormals included, by a bit move
-- and one multiply by 2^8) and run the fp16 mma: K and V are exact in fp16,
-- q (bf16, |q| << 65504) is exact in fp16 except below 2^-14 (error < 2^-25),
-- and P is rounded to bf16 first and then converted, so P carries exactly the
-- bf16 rounding vLLM applies (values below 2^-14 aside).  bf16 caches run the
-- bf16 mma with no conversion.  Softmax is base 2 with scale*log2(e) folded
-- into one multiply, fp32 running max/sum per row, P rounded to bf16 before
-- P·V, fp32 accumulation, the output rounded to bf16 once (§6.2, §10.8).
--
-- Schedules (the `mode` axis; both compute the same function):
--   decode  - grid (splits, nkv, tokens): split-K over the token's keys (dense:
--             its history; sparse: its selected blocks), the CTA's warps take
--             interleaved 16-key tiles, merge through shared memory, and the
--             last CTA of a (token, KV head) to finish merges the splits' fp32
--             partials (log-sum-exp) - one kernel, no second launch.  With
--             tile merge=cluster (sm_90) the splits (at most 16) are one
--             thread-block cluster instead: each keeps its partial in shared
--             memory and, after a cluster barrier, merges 1/nsplit of the
--             output from all of them through distributed shared memory.
--   prefill - grid (token groups, nkv): each warp owns one query token and
--             walks all its keys; the CTA's warps are consecutive tokens, so
--             they read the same K/V tiles and mostly hit L1.
local LEAD = m3.include("lib/lead")
local CLUSTER = m3.include("lib/cluster")
local A = {}

A.body = [[
#define NQ $nq
#define NKV $nkv
#define GQ (NQ / NKV)              /* query heads per KV head (the GQA group), <= 16 */
#define HD 128
#define BS $bs
#define TOPK $topk
#define SPARSE $sparse
#define DECODE $decode
#define KV_E4M3 $kv_e4m3
#define NW $warps
#define ROW (2 * HD)               /* cache elements per token of one KV head: K | V */
#define FULL 0xffffffffu

#if KV_E4M3
typedef e4m3_t kv_t;
#define MMA_AB "f16"
#else
typedef bf16_t kv_t;
#define MMA_AB "bf16"
#endif

M3_DEV float neg_inf() { return __uint_as_float(0xff800000u); }
#ifdef __CUDA_ARCH__
/* ---- PTX helpers (the only inline assembly) ---- */
M3_DEV unsigned prmt(unsigned a, unsigned b, unsigned s) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}
/* 2^x; ex2(-inf) = 0.  The approximation's ~2 ulp error is far below bf16 P. */
M3_DEV float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
M3_DEV unsigned pack_bf16(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
M3_DEV unsigned pack_f16(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
M3_DEV unsigned hmul2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
M3_DEV float2 ldcg2(const float *p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
  return v;
}
M3_DEV float4 ldcg4(const float *p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}
M3_DEV void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#else /* C twins for the CPU emulator (emu/): same results, lane exchange for mma */
M3_DEV unsigned prmt(unsigned a, unsigned b, unsigned s) {
  unsigned char src[8];
  for (int i = 0; i < 4; i++) src[i] = (unsigned char)(a >> (8 * i)), src[4 + i] = (unsigned char)(b >> (8 * i));
  unsigned d = 0;
  for (int i = 0; i < 4; i++) {
    unsigned nib = (s >> (4 * i)) & 0xfu, byte = src[nib & 7u];
    if (nib & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    d |= byte << (8 * i);
  }
  return d;
}
M3_DEV float ex2(float x) { float r = exp2f(x); return r < 0x1p-126f ? 0.0f : r; } /* .ftz */
M3_DEV unsigned short emu_f2h(float f) { /* round to nearest even, IEEE half */
  unsigned u = __float_as_uint(f), s = (u >> 16) & 0x8000u;
  float a = fabsf(f);
  if (a != a) return (unsigned short)(s | 0x7e00u);
  if (a >= 65520.0f) return (unsigned short)(s | 0x7c00u);
  if (a < 0x1p-14f) return (unsigned short)(s | (unsigned)rintf(a * 0x1p24f)); /* subnormal (and 2^-14 exactly) */
  unsigned b = __float_as_uint(a);
  unsigned m = b & 0x7fffffu, e = (b >> 23) - 127 + 15;
  unsigned r = (e << 10) | (m >> 13), rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (unsigned short)(s | r);
}
M3_DEV float emu_h2f(unsigned short h) {
  unsigned s = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 31u) return __uint_as_float(s | 0x7f800000u | (m << 13));
  if (e == 0u) return (s ? -1.0f : 1.0f) * (float)m * 0x1p-24f;
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}
M3_DEV unsigned pack_bf16(float lo, float hi) { return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16); }
M3_DEV unsigned pack_f16(float lo, float hi) { return (unsigned)emu_f2h(lo) | ((unsigned)emu_f2h(hi) << 16); }
M3_DEV unsigned hmul2(unsigned a, unsigned b) {
  return (unsigned)emu_f2h(emu_h2f((unsigned short)(a & 0xffffu)) * emu_h2f((unsigned short)(b & 0xffffu))) |
         ((unsigned)emu_f2h(emu_h2f((unsigned short)(a >> 16)) * emu_h2f((unsigned short)(b >> 16))) << 16);
}
M3_DEV float2 ldcg2(const float *p) { return *(const float2 *)p; }
M3_DEV float4 ldcg4(const float *p) { return *(const float4 *)p; }
M3_DEV float mma_dec(unsigned w, int hi) {
  unsigned short h = (unsigned short)(hi ? w >> 16 : w & 0xffffu);
#if KV_E4M3
  return emu_h2f(h);
#else
  return bf16_to_f32(h);
#endif
}
/* PTX ISA fragment layout of m16n8k16: A reg0 (row g, k 2t..2t+1), reg1 (row
 * g+8), reg2 (row g, k+8), reg3 (row g+8, k+8); B reg0 (k 2t..2t+1, col g),
 * reg1 (k+8); C c0,c1 (row g, col 2t, 2t+1), c2,c3 (row g+8). */
M3_DEV void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float ar[2][16], bc[2][16];
  for (int q = 0; q < 4; q++) {
    unsigned x0 = __shfl_sync(0xffffffffu, a0, 4 * g + q), x1 = __shfl_sync(0xffffffffu, a1, 4 * g + q);
    unsigned x2 = __shfl_sync(0xffffffffu, a2, 4 * g + q), x3 = __shfl_sync(0xffffffffu, a3, 4 * g + q);
    unsigned y0 = __shfl_sync(0xffffffffu, b0, 8 * t + q), y1 = __shfl_sync(0xffffffffu, b1, 8 * t + q);
    unsigned z0 = __shfl_sync(0xffffffffu, b0, 8 * t + 4 + q), z1 = __shfl_sync(0xffffffffu, b1, 8 * t + 4 + q);
    for (int h = 0; h < 2; h++) {
      ar[0][2 * q + h] = mma_dec(x0, h), ar[0][2 * q + 8 + h] = mma_dec(x2, h);
      ar[1][2 * q + h] = mma_dec(x1, h), ar[1][2 * q + 8 + h] = mma_dec(x3, h);
      bc[0][2 * q + h] = mma_dec(y0, h), bc[0][2 * q + 8 + h] = mma_dec(y1, h);
      bc[1][2 * q + h] = mma_dec(z0, h), bc[1][2 * q + 8 + h] = mma_dec(z1, h);
    }
  }
  for (int k = 0; k < 16; k++) {
    c[0] += ar[0][k] * bc[0][k];
    c[1] += ar[0][k] * bc[1][k];
    c[2] += ar[1][k] * bc[0][k];
    c[3] += ar[1][k] * bc[1][k];
  }
}
#endif
/* ---- end of PTX helpers ---- */
/* Two e4m3 codes in bytes 1 and 3 of x (bytes 0 and 2 are ignored) -> f16x2.
 * (b & 0x7f) << 7 is the f16 with the e4m3 exponent and mantissa bits, worth
 * 2^-8 times the e4m3 value for normals and subnormals alike; x 2^8 is exact
 * (fp16 arithmetic keeps subnormals).  The NaN codes 0x7f/0xff, which the
 * saturating cache insert never writes, decode as +-480. */
M3_DEV unsigned e4m3x2_f16(unsigned x) {
  return hmul2((x & 0x80008000u) | ((x >> 1) & 0x3f803f80u), 0x5c005c00u);
}
/* bf16x2 -> f16x2 of the same values (exact for the magnitudes q takes). */
M3_DEV unsigned bf2_f16(unsigned w) {
  return pack_f16(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
/* P pair -> the mma's A operand: bf16-rounded (vLLM's rounding of P), and for
 * the fp16 mma then re-expressed in fp16. */
M3_DEV unsigned pack_p(float lo, float hi) {
  unsigned b = pack_bf16(lo, hi);
#if KV_E4M3
  return pack_f16(__uint_as_float(b << 16), __uint_as_float(b & 0xffff0000u));
#else
  return b;
#endif
}
M3_DEV unsigned w4(const uint4 &v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
M3_DEV uint4 ld16(const kv_t *p) { return *(const uint4 *)p; }
/* Head dim of output column n of PV n-tile j (see the header: V loads
 * contiguous per lane).  bf16: lane group n reads dims [8n, 8n+8) and
 * [64+8n, 64+8n+8); e4m3: dims [16n, 16n+16). */
M3_DEV int out_dim(int j, int n) {
#if KV_E4M3
  return 16 * n + j;
#else
  return 64 * (j >> 3) + 8 * n + (j & 7);
#endif
}

/* The warps' fp32 outputs in shared memory for the CTA's merge: rows of SO
 * floats, float4 columns swizzled.  A quarter-warp's float4 stores are 2 rows
 * (gl, gl+1) x the 4 tq lanes; unswizzled, the tq lanes' columns 32 or 64
 * apart shared banks (ncu, device run 18: 14.8-way conflicts on 93% of the
 * shared-store wavefronts, ~8K cycles a CTA).  The pad puts row gl+1 8 banks
 * on, and flipping column bits 2 and 4 by bits 5 and 6 spreads the 4 tq lanes
 * over distinct 4-bank groups for both cache dtypes' out_dim(); the merge's
 * reads (8 consecutive float4 of a row) stay conflict-free, since bits 5-6
 * are fixed within them. */
#define SO (HD + 8)
M3_DEV int so_col(int c) { return c ^ (((c >> 5) & 1) << 2) ^ (((c >> 6) & 1) << 4); }

/* Split merge: float4 columns per thread, and splits loaded per step. */
#define MERGE_E ((GQ * HD / 4 + NW * 32 - 1) / (NW * 32))
#define MERGE_U (MERGE_E >= 16 ? 1 : MERGE_E >= 8 ? 16 / MERGE_E : 32 / MERGE_E)

#if KV_E4M3
#define KVEC 2                     /* 16-byte K loads per key per lane */
#define VVEC 1
#else
#define KVEC 4
#define VVEC 2
#endif

/* One query token's view of the cache for one KV head. */
struct kv_ctx {
  const kv_t *kv;                  /* cache base */
  const int *bt_row;               /* the sequence's block-table row */
  i64 num_pages;
  i64 L;                           /* visible keys: j < L */
  int g;                           /* KV head */
  unsigned vmask;                  /* sparse: selection entries to visit */
  int lb_lane;                     /* sparse: entry `lane` of the selection */
};

/* Sets up c for token t: L = min(positions[t] + 1, seq_len, the block-table
 * row's reach), so a position outside its sequence never reads past the row.
 * Sparse: entry k is visited iff 0 <= sel[k] < nb(t) and no earlier entry has
 * the same id (the reference's set semantics; fault 6: -1 and ids beyond the
 * causal block count never index the block table). */
M3_DEV void token_ctx(kv_ctx &c, const kv_t *kv, const int *block_table, i64 bt_stride, i64 num_pages, int n_seqs,
                      const int *seq_lens, const int *token_seq, const i64 *positions, const int *sel, int n_tokens,
                      i64 t, int g, int lane) {
  const int sq = token_seq[t];
  i64 L = 0;
  if (sq >= 0 && sq < n_seqs) {
    L = positions[t] + 1;
    const i64 T = seq_lens[sq];
    if (L > T) L = T;
    if (L > bt_stride * BS) L = bt_stride * BS;
    if (L < 0) L = 0;
  }
  c.kv = kv;
  c.bt_row = block_table + (sq >= 0 && sq < n_seqs ? (i64)sq * bt_stride : 0);
  c.num_pages = num_pages;
  c.L = L;
  c.g = g;
  c.vmask = 0;
  c.lb_lane = -1;
#if SPARSE
  const i64 nb = (L + BS - 1) / BS;
  int lb = -1;
  if (lane < TOPK) lb = sel[((i64)g * n_tokens + t) * TOPK + lane];
  bool ok = lane < TOPK && lb >= 0 && lb < nb;
#pragma unroll
  for (int k = 0; k < TOPK; k++) {
    int o = __shfl_sync(FULL, lb, k);
    if (k < lane && o == lb) ok = false;
  }
  c.vmask = __ballot_sync(FULL, ok);
  c.lb_lane = lb;
#endif
}

/* The next 16-key tile at or after flattened index f (step `step`, below
 * fend) with at least one visible key: base = its first key's cache row,
 * nvalid = visible keys in it (1..16).  Flattened index: dense - the key
 * position; sparse - entry * BS + offset within the entry's block.  Tiles
 * never straddle a page (BS % 16 == 0, f % 16 == 0).  Warp-uniform. */
M3_DEV bool next_tile(const kv_ctx &c, i64 &f, i64 fend, int step, const kv_t *&base, int &nvalid) {
  for (; f < fend; f += step) {
#if SPARSE
    const int k = (int)(f / BS);
    const int lb = __shfl_sync(FULL, c.lb_lane, k & 31);
    if (!((c.vmask >> k) & 1u)) continue;
    const i64 j0 = (i64)lb * BS + f % BS, lim = c.L;
#else
    const i64 j0 = f, lim = fend < c.L ? fend : c.L;
    const i64 lb = f / BS;
#endif
    if (j0 >= lim) continue;
    const i64 page = c.bt_row[lb];
    if (page < 0 || page >= c.num_pages) continue; /* a corrupt table reads nothing */
    base = c.kv + ((page * NKV + c.g) * BS + j0 % BS) * ROW;
    nvalid = lim - j0 < 16 ? (int)(lim - j0) : 16;
    return true;
  }
  return false;
}

/* K operand of both 8-key n-tiles: lane (gl, tq) loads key 8nt + gl (clamped
 * to the last visible key, whose S is masked anyway), dims [32c + 8tq, +8)
 * (bf16) or [64c + 16tq, +16) (e4m3). */
M3_DEV void load_k(uint4 (&kr)[2][KVEC], const kv_t *base, int nv, int gl, int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; nt++) {
    int n = 8 * nt + gl;
    n = n < nv ? n : nv - 1;
    const kv_t *p = base + (i64)n * ROW;
#pragma unroll
    for (int c = 0; c < KVEC; c++)
#if KV_E4M3
      kr[nt][c] = ld16(p + 64 * c + 16 * tq);
#else
      kr[nt][c] = ld16(p + 32 * c + 8 * tq);
#endif
  }
}

/* V operand: lane (gl, tq) loads keys 2tq, 2tq+1, 8+2tq, 9+2tq (slots a = 0..3)
 * at dims [8gl, +8) and [64 + 8gl, +8) (bf16) or [16gl, +16) (e4m3). */
M3_DEV void load_v(uint4 (&vr)[4][VVEC], const kv_t *base, int nv, int gl, int tq) {
#pragma unroll
  for (int a = 0; a < 4; a++) {
    int n = 2 * tq + (a & 1) + 8 * (a >> 1);
    n = n < nv ? n : nv - 1;
    const kv_t *p = base + (i64)n * ROW + HD;
#if KV_E4M3
    vr[a][0] = ld16(p + 16 * gl);
#else
    vr[a][0] = ld16(p + 8 * gl);
    vr[a][1] = ld16(p + 64 + 8 * gl);
#endif
  }
}

/* Q as the A operand of the 8 k-steps, with the dim permutation of load_k:
 * k-step ks, A columns 2tq..2tq+1 / 2tq+8..2tq+9 <-> dims p..p+1 / p+2..p+3,
 * p = 32(ks>>1) + 8tq + 4(ks&1) (bf16) or 64(ks>>2) + 16tq + 4(ks&3) (e4m3).
 * Rows gl and gl+8 of the group; rows >= GQ are zero. */
M3_DEV void load_q(unsigned (&qa)[8][4], const bf16_t *q, i64 t, int g, int gl, int tq) {
  const uint4 z = make_uint4(0, 0, 0, 0);
  const bf16_t *r0 = q + (t * NQ + g * GQ + gl) * HD, *r1 = r0 + 8 * HD;
  const bool h0 = gl < GQ, h1 = gl + 8 < GQ;
#if KV_E4M3
#pragma unroll
  for (int c = 0; c < 2; c++) {
    uint4 a[2], b[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
      a[u] = h0 ? *(const uint4 *)(r0 + 64 * c + 16 * tq + 8 * u) : z;
      b[u] = h1 ? *(const uint4 *)(r1 + 64 * c + 16 * tq + 8 * u) : z;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
      qa[4 * c + j][0] = bf2_f16(w4(a[j >> 1], 2 * (j & 1)));
      qa[4 * c + j][2] = bf2_f16(w4(a[j >> 1], 2 * (j & 1) + 1));
      qa[4 * c + j][1] = bf2_f16(w4(b[j >> 1], 2 * (j & 1)));
      qa[4 * c + j][3] = bf2_f16(w4(b[j >> 1], 2 * (j & 1) + 1));
    }
  }
#else
#pragma unroll
  for (int c = 0; c < 4; c++) {
    uint4 a = h0 ? *(const uint4 *)(r0 + 32 * c + 8 * tq) : z;
    uint4 b = h1 ? *(const uint4 *)(r1 + 32 * c + 8 * tq) : z;
    qa[2 * c][0] = a.x; qa[2 * c][2] = a.y; qa[2 * c + 1][0] = a.z; qa[2 * c + 1][2] = a.w;
    qa[2 * c][1] = b.x; qa[2 * c][3] = b.y; qa[2 * c + 1][1] = b.z; qa[2 * c + 1][3] = b.w;
  }
#endif
}

$attend_fns
M3_DEV void st_bf16x4(bf16_t *p, float a, float b, float c, float d) {
  uint2 u;
  u.x = pack_bf16(a, b);
  u.y = pack_bf16(c, d);
  *(uint2 *)p = u;
}

$lead_defs$merge_defs
extern "C" __global__ void __launch_bounds__(NW * 32)
$sym(const bf16_t *__restrict__ q,          /* [N, NQ, HD] */
     const kv_t *__restrict__ kv,            /* [num_pages, NKV, BS, 2*HD] */
     const int *__restrict__ block_table,    /* [n_seqs, bt_stride] logical block -> page */
     i64 bt_stride, i64 num_pages, int n_seqs,
     const int *__restrict__ seq_lens,       /* [n_seqs] */
     const int *__restrict__ token_seq,      /* [N] */
     const i64 *__restrict__ positions,      /* [N] */
     const int *__restrict__ sel,            /* [NKV, N, TOPK] logical block ids (sparse) */
     bf16_t *__restrict__ out,               /* [N, NQ, HD] */
     int *__restrict__ counters,             /* decode: [N, NKV] arrivals, zero between launches */
     float *__restrict__ part_o,             /* decode: [N, NKV, splits, GQ, HD] */
     float *__restrict__ part_ml,            /* decode: [N, NKV, splits, GQ, 2] (max, sum) */
     int chunk, int n_tokens, float scale2) {
$wait_top
  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gl = lane >> 2, tq = lane & 3;
  const int g = blockIdx.y;
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0, 0}, o[16][4];
#pragma unroll
  for (int j = 0; j < 16; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0;
  unsigned qa[8][4];
  kv_ctx c;
#if DECODE
  const int s = blockIdx.x;
  const i64 t = blockIdx.z;
  token_ctx(c, kv, block_table, bt_stride, num_pages, n_seqs, seq_lens, token_seq, positions, sel, n_tokens, t, g,
            lane);
#if SPARSE
  const i64 total = (i64)TOPK * BS;
#else
  const i64 total = c.L;
#endif
  /* Splits of this token; the last one takes any remainder, so a token longer
   * than the launch planned for is still complete (just slower). */
  i64 ns = total > 0 ? (total + chunk - 1) / chunk : 1;
  if (ns > (i64)gridDim.x) ns = gridDim.x;
  const int nsplit = (int)ns;
  if (s >= nsplit) return;                      /* whole CTA: no barrier skipped */
  const i64 cstart = (i64)s * chunk;
  const i64 cend = s == nsplit - 1 ? total : cstart + chunk;
$wait_late
  load_q(qa, q, t, g, gl, tq);
  $attend(c, cstart + 16 * warp, cend, 16 * NW, qa, scale2, m, l, o, lane);

  /* Merge the CTA's warps (fixed order: deterministic). */
  float *so = (float *)smem_raw;                /* [NW][16][SO], columns swizzled (so_col) */
  float *sm_m = so + NW * 16 * SO, *sm_l = sm_m + NW * 16, *sf = sm_l + NW * 16;
  float *sM = sf + NW * 16, *sL = sM + 16;
  int *sflag = (int *)(sL + 16);
#pragma unroll
  for (int r = 0; r < 2; r++) {
    l[r] += __shfl_xor_sync(FULL, l[r], 1);
    l[r] += __shfl_xor_sync(FULL, l[r], 2);
  }
  if (tq == 0) {
    sm_m[warp * 16 + gl] = m[0]; sm_m[warp * 16 + gl + 8] = m[1];
    sm_l[warp * 16 + gl] = l[0]; sm_l[warp * 16 + gl + 8] = l[1];
  }
  float *sw = so + warp * 16 * SO;
#pragma unroll
  for (int j = 0; j < 16; j += 4)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int c = out_dim(j, 2 * tq + (i & 1));   /* j..j+3 are columns c..c+3 */
      *(float4 *)(sw + (gl + 8 * (i >> 1)) * SO + so_col(c)) = make_float4(o[j][i], o[j + 1][i], o[j + 2][i], o[j + 3][i]);
    }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int r = threadIdx.x;
    float M = neg_inf(), Ls = 0;
    for (int w = 0; w < NW; w++) M = fmaxf(M, sm_m[w * 16 + r]);
    for (int w = 0; w < NW; w++) {
      const float mw = sm_m[w * 16 + r];
      const float fw = mw == neg_inf() ? 0.0f : ex2(mw - M);
      sf[w * 16 + r] = fw;
      Ls += fw * sm_l[w * 16 + r];
    }
    sM[r] = M;
    sL[r] = Ls;
  }
  __syncthreads();
  const i64 pair = t * NKV + g;
  float *po = part_o + (pair * gridDim.x + s) * (GQ * HD);
  for (int e4 = threadIdx.x; e4 < GQ * HD / 4; e4 += NW * 32) {
    const int r = e4 / (HD / 4), d = 4 * (e4 % (HD / 4));
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int w = 0; w < NW; w++) {
      const float fw = sf[w * 16 + r];
      const float4 v = *(const float4 *)(so + (w * 16 + r) * SO + so_col(d));
      a0 += fw * v.x; a1 += fw * v.y; a2 += fw * v.z; a3 += fw * v.w;
    }
    if (nsplit == 1) {
      const float inv = sL[r] > 0 ? 1.0f / sL[r] : 0.0f;
      st_bf16x4(out + (t * NQ + g * GQ + r) * HD + d, a0 * inv, a1 * inv, a2 * inv, a3 * inv);
    } else {
      $partial_store
    }
  }
  if (nsplit == 1) return;
$cluster_merge  if (threadIdx.x < GQ) {
    float *pm = part_ml + ((pair * gridDim.x + s) * GQ + threadIdx.x) * 2;
    pm[0] = sM[threadIdx.x];
    pm[1] = sL[threadIdx.x];
  }
$publish  /* Factors 2^(m_k - M) per (split, row) and the partial sums, staged in
   * the (now free) warp-output area: 2 * nsplit * 16 <= NW * 16 * HD floats,
   * hence the launcher's cap of NW * HD / 2 splits.  One L2 round trip for
   * (m, l); the second pass reads shared memory only. */
  float *fs = so, *ls = so + nsplit * 16;
  const float *pml = part_ml + pair * gridDim.x * GQ * 2;
  for (int r = warp; r < GQ; r += NW) {
    float M = neg_inf();
    for (int k = lane; k < nsplit; k += 32) {
      const float2 ml = ldcg2(pml + (k * GQ + r) * 2);
      fs[k * 16 + r] = ml.x;
      ls[k * 16 + r] = ml.y;
      M = fmaxf(M, ml.x);
    }
    M = warp_max(M);
    float Ls = 0;
    for (int k = lane; k < nsplit; k += 32) {   /* the same lane's entries: no barrier */
      const float mk = fs[k * 16 + r];
      const float fk = mk == neg_inf() ? 0.0f : ex2(mk - M);
      fs[k * 16 + r] = fk;
      Ls += fk * ls[k * 16 + r];
    }
    Ls = warp_sum(Ls);
    if (lane == 0) sL[r] = Ls;
  }
  __syncthreads();
  /* Each thread owns MERGE_E float4 columns of the [GQ, HD] output and keeps
   * MERGE_E * MERGE_U loads in flight (32; 16 with 1-2 warps, whose threads
   * own 8-16 columns each), using registers the attention no longer needs,
   * so the merging CTA streams the partials from L2 instead of waiting on
   * one load at a time. */
  const float *pbase = part_o + pair * gridDim.x * (GQ * HD);
  float4 acc[MERGE_E];
#pragma unroll
  for (int i = 0; i < MERGE_E; i++) acc[i] = make_float4(0, 0, 0, 0);
  int k = 0;
  for (; k + MERGE_U <= nsplit; k += MERGE_U) {
    float4 v[MERGE_U][MERGE_E];
#pragma unroll
    for (int u = 0; u < MERGE_U; u++)
#pragma unroll
      for (int i = 0; i < MERGE_E; i++) {
        const int e4 = threadIdx.x + i * NW * 32;
        v[u][i] = e4 < GQ * HD / 4 ? ldcg4(pbase + (k + u) * (GQ * HD) + 4 * e4) : make_float4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < MERGE_U; u++)
#pragma unroll
      for (int i = 0; i < MERGE_E; i++) {
        const int e4 = threadIdx.x + i * NW * 32;
        const float fk = e4 < GQ * HD / 4 ? fs[(k + u) * 16 + e4 / (HD / 4)] : 0.0f;
        acc[i].x += fk * v[u][i].x; acc[i].y += fk * v[u][i].y;
        acc[i].z += fk * v[u][i].z; acc[i].w += fk * v[u][i].w;
      }
  }
  for (; k < nsplit; k++)
#pragma unroll
    for (int i = 0; i < MERGE_E; i++) {
      const int e4 = threadIdx.x + i * NW * 32;
      if (e4 >= GQ * HD / 4) continue;
      const float fk = fs[k * 16 + e4 / (HD / 4)];
      const float4 v = ldcg4(pbase + k * (GQ * HD) + 4 * e4);
      acc[i].x += fk * v.x; acc[i].y += fk * v.y; acc[i].z += fk * v.z; acc[i].w += fk * v.w;
    }
#pragma unroll
  for (int i = 0; i < MERGE_E; i++) {
    const int e4 = threadIdx.x + i * NW * 32;
    if (e4 >= GQ * HD / 4) continue;
    const int r = e4 / (HD / 4), d = 4 * (e4 % (HD / 4));
    const float inv = sL[r] > 0 ? 1.0f / sL[r] : 0.0f;
    st_bf16x4(out + (t * NQ + g * GQ + r) * HD + d, acc[i].x * inv, acc[i].y * inv, acc[i].z * inv, acc[i].w * inv);
  }
#else /* prefill: one warp per query token, heaviest (latest) token groups first */
  const i64 t = (i64)(gridDim.x - 1 - blockIdx.x) * NW + warp;
  if (t >= n_tokens) return;                    /* warp-level: no CTA barrier below */
  token_ctx(c, kv, block_table, bt_stride, num_pages, n_seqs, seq_lens, token_seq, positions, sel, n_tokens, t, g,
            lane);
#if SPARSE
  const i64 total = (i64)TOPK * BS;
#else
  const i64 total = c.L;
#endif
  load_q(qa, q, t, g, gl, tq);
  attend(c, 0, total, 16, qa, scale2, m, l, o, lane);
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    l[r] += __shfl_xor_sync(FULL, l[r], 1);
    l[r] += __shfl_xor_sync(FULL, l[r], 2);
    inv[r] = l[r] > 0 ? 1.0f / l[r] : 0.0f;
  }
  bf16_t *st = (bf16_t *)smem_raw + warp * 16 * HD;   /* [16][HD] staging */
#pragma unroll
  for (int j = 0; j < 16; j++)
#pragma unroll
    for (int i = 0; i < 4; i++)
      st[(gl + 8 * (i >> 1)) * HD + out_dim(j, 2 * tq + (i & 1))] = f32_to_bf16(o[j][i] * inv[i >> 1]);
  __syncwarp();
  for (int idx = lane; idx < GQ * (HD / 8); idx += 32) {
    const int r = idx / (HD / 8), cc = idx % (HD / 8);
    *(uint4 *)(out + (t * NQ + g * GQ + r) * HD + 8 * cc) = *(const uint4 *)(st + r * HD + 8 * cc);
  }
#endif
}
]]

-- The online-softmax step over one 16-key tile (S = Q·Kᵀ, the next tile's K
-- loads, softmax, O += P·V, the next tile's V loads), written once and emitted
-- into both pipelines below with their buffer names: attend() (one buffer:
-- depth=1, the kernel the tuning records before the depth axis timed, kept
-- byte for byte) and attend_ring<D>() (a ring of D: depth=2).
A.tile_step = [[
    float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
    for (int ks = 0; ks < 8; ks++) {
#pragma unroll
      for (int nt = 0; nt < 2; nt++) {
#if KV_E4M3
        const unsigned w = w4($KR[nt][ks >> 2], ks & 3);
        mma(s[nt], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], $KLO,
            $KHI);
#else
        mma(s[nt], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], w4($KR[nt][ks >> 1], 2 * (ks & 1)),
            w4($KR[nt][ks >> 1], 2 * (ks & 1) + 1));
#endif
      }
    }
    const int nv_cur = $NV;
    f += step;
    $HAVE = next_tile(c, f, fend, step, $BASE, $NV);
    if ($HAVE) load_k($KR, $BASE, $NV, gl, tq);

    /* s[nt][i]: row gl (i < 2) or gl+8, key 8nt + 2tq + (i & 1) of the tile. */
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int n = 8 * nt + 2 * tq + (i & 1);
        float x = s[nt][i] * scale2;
        x = n < nv_cur ? x : neg_inf();
        s[nt][i] = x;
        mx[i >> 1] = fmaxf(mx[i >> 1], x);
      }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL, mx[r], 2));
      const float mn = fmaxf(m[r], mx[r]);
      const float mu = mn == neg_inf() ? 0.0f : mn;   /* no key yet: keep exp2 finite */
      corr[r] = ex2(m[r] - mu);
      m[r] = mn;
      mx[r] = mu;
    }
    float ps[2] = {0, 0};
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float p = ex2(s[nt][i] - mx[i >> 1]);
        s[nt][i] = p;
        ps[i >> 1] += p;
      }
#pragma unroll
    for (int r = 0; r < 2; r++) l[r] = l[r] * corr[r] + ps[r];
    const unsigned pa0 = pack_p(s[0][0], s[0][1]), pa1 = pack_p(s[0][2], s[0][3]);
    const unsigned pa2 = pack_p(s[1][0], s[1][1]), pa3 = pack_p(s[1][2], s[1][3]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
      o[j][0] *= corr[0]; o[j][1] *= corr[0];
      o[j][2] *= corr[1]; o[j][3] *= corr[1];
#if KV_E4M3
      const int wi = j >> 2, bi = j & 3;
      const unsigned sl = $VSEL;
      const unsigned b0 = $VCVT(prmt(w4($VR[0][0], wi), w4($VR[1][0], wi), sl));
      const unsigned b1 = $VCVT(prmt(w4($VR[2][0], wi), w4($VR[3][0], wi), sl));
#else
      const int h = j >> 3, wi = (j & 7) >> 1;
      const unsigned sl = (j & 1) ? 0x7632u : 0x5410u;
      const unsigned b0 = prmt(w4($VR[0][h], wi), w4($VR[1][h], wi), sl);
      const unsigned b1 = prmt(w4($VR[2][h], wi), w4($VR[3][h], wi), sl);
#endif
      mma(o[j], pa0, pa1, pa2, pa3, b0, b1);
    }
    if ($HAVE) load_v($VR, $BASE, $NV, gl, tq);
]]

-- e4m3 -> f16 of the K and V pairs (e4m3 caches; bf16 ignores them): cvt=alu
-- pairs the codes in bytes 1 and 3 with a prmt and decodes them by bit moves
-- (e4m3x2_f16); cvt=hw takes a pair from a 16-bit half as it lies and runs
-- cvt.rn.f16x2.e4m3x2 (sm_89+), one instruction a pair where alu needs five.
-- Both are exact, so they give the same results bit for bit (only the NaN
-- codes, which the saturating insert never writes, decode differently).
local CVT = {
  alu = {KLO = "e4m3x2_f16(prmt(w, w, 0x1000u))", KHI = "e4m3x2_f16(prmt(w, w, 0x3020u))",
         VSEL = "(unsigned)(bi | bi << 4 | (4 + bi) << 8 | (4 + bi) << 12)", VCVT = "e4m3x2_f16"},
  hw = {KLO = "e4m3x2_hw<0>(w)", KHI = "e4m3x2_hw<1>(w)", VSEL = "(unsigned)(bi | (4 + bi) << 4)",
        VCVT = "e4m3x2_hw<0>"},
}
A.cvt_hw = [[
/* The two e4m3 codes of half H of x (0: bits 0..15, 1: bits 16..31), the
 * higher byte into the high half, as f16x2: exact (e4m3 is a subset of fp16). */
template <int H>
M3_DEV unsigned e4m3x2_hw(unsigned x) {
#ifdef __CUDA_ARCH__
  unsigned d;
  if (H) asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(d) : "r"(x));
  else asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(d) : "r"(x));
  return d;
#else
  x >>= 16 * H;
  return (unsigned)emu_f2h(e4m3_to_f32((e4m3_t)(x & 0xffu))) |
         ((unsigned)emu_f2h(e4m3_to_f32((e4m3_t)((x >> 8) & 0xffu))) << 16);
#endif
}
]]

local function step_text(cvt, kr, vr, nv, have, base)
  local sub = {KR = kr, VR = vr, NV = nv, HAVE = have, BASE = base}
  for k, v in pairs(CVT[cvt]) do sub[k] = v end
  return (A.tile_step:gsub("%$(%u+)", sub))
end

local ATTEND_HEAD = [[
/* Online softmax over the tiles of one warp: m (running max, log2 units), l
 * (this lane's share of the running sum; the quad's 4 lanes add up at the
 * end) for rows gl and gl+8, o the unnormalised output fragments.  Loads of
 * the next tile's K are issued right after this tile's S is formed and its V
 * after this tile's P·V, so a tile's worth of loads is always in flight. */
M3_DEV void attend(const kv_ctx &c, i64 f, i64 fend, int step, const unsigned (&qa)[8][4], float scale2,
                   float (&m)[2], float (&l)[2], float (&o)[16][4], int lane) {
  const int gl = lane >> 2, tq = lane & 3;
  const kv_t *base = 0;
  int nv = 0;
  uint4 kr[2][KVEC], vr[4][VVEC];
  bool have = next_tile(c, f, fend, step, base, nv);
  if (have) {
    load_k(kr, base, nv, gl, tq);
    load_v(vr, base, nv, gl, tq);
  }
  while (have) {
]]
local ATTEND_TAIL = [[
  }
}

]]
local RING_HEAD = [[
/* The same tiles in the same order with the same arithmetic as attend() (one
 * tile step, emitted into both), so its result is attend()'s, bit for bit;
 * only the loads run further ahead.  D K/V buffers form a ring: slot d holds
 * tiles d, d + D, ...; while a tile is computed the loads of the D - 1 tiles
 * after it are in flight, and its buffer is refilled with the tile D ahead
 * (K right after S, V after P·V).  The first empty slot is the end.  D = 2
 * doubles the bytes a warp has in flight, which the e4m3 cache needs: its
 * 16-key tile is half the bytes of bf16's. */
template <int D>
M3_DEV void attend_ring(const kv_ctx &c, i64 f, i64 fend, int step, const unsigned (&qa)[8][4], float scale2,
                        float (&m)[2], float (&l)[2], float (&o)[16][4], int lane) {
  const int gl = lane >> 2, tq = lane & 3;
  const kv_t *base[D];
  int nv[D];
  bool have[D];
  uint4 kr[D][2][KVEC], vr[D][4][VVEC];
#pragma unroll
  for (int d = 0; d < D; d++) {
    if (d) f += step;
    have[d] = next_tile(c, f, fend, step, base[d], nv[d]);
    if (have[d]) {
      load_k(kr[d], base[d], nv[d], gl, tq);
      load_v(vr[d], base[d], nv[d], gl, tq);
    }
  }
  for (;;) {
#pragma unroll
    for (int d = 0; d < D; d++) {
    if (!have[d]) return;
]]
local RING_TAIL = [[
    }
  }
}
]]

-- The device functions a tile's kernel calls: attend() always (prefill and
-- depth=1 decode), attend_ring<D>() too for depth > 1, and for cvt=hw the
-- conversion helpers in front of them.
function A.attend_fns(depth, cvt)
  local t = ATTEND_HEAD .. step_text(cvt, "kr", "vr", "nv", "have", "base") .. ATTEND_TAIL
  if depth > 1 then t = t .. RING_HEAD .. step_text(cvt, "kr[d]", "vr[d]", "nv[d]", "have[d]", "base[d]") .. RING_TAIL end
  if cvt == "hw" then t = A.cvt_hw .. t end
  return t
end

-- The grid wait (lib/prelude.lua): first for lead=0; for lead=1 (dense
-- decode, lib/lead.lua) after the token's view of the cache (its position,
-- visible length and split: token_seq, positions, seq_lens) and an L2
-- prefetch of each warp's first two tiles (block table, then K | V rows of 16
-- keys, contiguous in a page), so that those dependent round trips overlap
-- the previous kernel (qk-norm + RoPE, which writes q and the new K/V rows).
local WAIT = "  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */"
local LEAD_IN = "  M3_LEAD_IN; /* launch inputs only until the wait (lib/lead.lua) */"
local LEAD_WAIT = [[
  { /* each warp's first two tiles into L2 */
    i64 f = cstart + 16 * warp;
    const kv_t *pb = 0;
    int pn = 0;
    for (int d = 0; d < 2 && next_tile(c, f, cend, 16 * NW, pb, pn); d++, f += 16 * NW)
      if (lane == 0) prefetch_l2(pb, (unsigned)(16 * ROW * sizeof(kv_t)));
  }
  M3_GRID_WAIT(); /* q and the keys after it */]]

-- How a decode split hands over to the merge (tile merge), as in
-- index_decode.lua.  fence: every thread fences (seq_cst, gpu scope) before
-- thread 0's atomicAdd, and thread 0 fences again after it.  acqrel: one
-- atom.acq_rel.gpu by thread 0 between two barriers (its release covers the
-- other threads' stores, which the barrier ordered before it, and its
-- acquire the other threads' later loads, as in CUTLASS's semaphore): one
-- fence round trip less on every split's way out, 0.4-0.6 us a launch and
-- 0.03 ms a decode step at 8K and 128K on an H100 (device runs 60, 61).  Both sum
-- the same partials in the same order: the same bits.  (Requesting the
-- merging CTA's first partials together with (m, l), one L2 round trip
-- less, measured slower in those runs: its registers cost the e4m3 tiles
-- an SM's third CTA and its predicated loads more issue than they saved.)

-- merge=cluster's merge, after the CTA's own (the global path below it is
-- then dead code); its partial stays in shared memory (MERGE.cluster.store).
local CLUSTER_MERGE = [[
  /* Tile merge=cluster: this (token, KV head)'s splits are the CTAs of one
   * thread-block cluster (the launcher makes the cluster gridDim.x wide).
   * After one cluster barrier every split's partial, sM and sL are read
   * through distributed shared memory, and each split merges its own
   * 1/nsplit of the [GQ, HD] output: no workspace, no hand-over atomic, no
   * L2 round trips (the global merge below has three after the last split). */
  if (cluster_nctarank() != gridDim.x) __trap(); /* launched without the cluster: DSMEM below would be wrong */
  cluster_sync();
  {
    const int G4 = GQ * HD / 4, per = (G4 + nsplit - 1) / nsplit;
    const int hi = (s + 1) * per < G4 ? (s + 1) * per : G4;
    for (int e4 = s * per + threadIdx.x; e4 < hi; e4 += NW * 32) {
      const int r = e4 / (HD / 4), d = 4 * (e4 % (HD / 4));
      /* Every split's (m, l) and partial are loaded before any is used, so
       * that the 48 loads are in flight together: one DSMEM round trip (in
       * a branch per split they were 32 dependent ones).  Ranks past the
       * splits re-read the last split and weigh nothing. */
      float mk[CLUSTER_MAX], lk[CLUSTER_MAX];
      float4 vk[CLUSTER_MAX];
#pragma unroll
      for (int k = 0; k < CLUSTER_MAX; k++) {
        const unsigned rk = (unsigned)(k < nsplit ? k : nsplit - 1);
        mk[k] = ld_dsmem(sM + r, rk);
        lk[k] = ld_dsmem(sL + r, rk);
        vk[k] = ld_dsmem4(so + r * SO + so_col(d), rk);
      }
      float M = neg_inf();
#pragma unroll
      for (int k = 0; k < CLUSTER_MAX; k++) M = fmaxf(M, k < nsplit ? mk[k] : neg_inf());
      float L = 0, a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma unroll
      for (int k = 0; k < CLUSTER_MAX; k++) {
        const float fk = k >= nsplit || mk[k] == neg_inf() ? 0.0f : ex2(mk[k] - M);
        L += fk * lk[k];
        a0 += fk * vk[k].x; a1 += fk * vk[k].y; a2 += fk * vk[k].z; a3 += fk * vk[k].w;
      }
      const float inv = L > 0 ? 1.0f / L : 0.0f;
      st_bf16x4(out + (t * NQ + g * GQ + r) * HD + d, a0 * inv, a1 * inv, a2 * inv, a3 * inv);
    }
  }
  cluster_sync(); /* no CTA leaves while another may still read its shared memory */
  return;
]]

local GLOBAL_STORE = "*(float4 *)(po + r * HD + d) = make_float4(a0, a1, a2, a3);"

local MERGE = {
  fence = {defs = "", publish = [[
  /* Last CTA of this (token, KV head) merges: partials are published before
   * the ticket (fence, then atomic), read after it through L2 (.cg). */
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counters + pair, 1);
    const int last = prev == nsplit - 1;
    if (last) counters[pair] = 0;               /* ready for the next launch */
    *sflag = last;
    __threadfence();
  }
  __syncthreads();
  if (!*sflag) return;
]]},
  acqrel = {defs = [[
/* atomicAdd with release (earlier stores, the barrier's included, are seen
 * first) and acquire (later loads see what the releases published). */
M3_DEV int atom_add_acq_rel(int *p, int v) {
#ifdef __CUDA_ARCH__
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}
]], publish = [[
  /* Last CTA of this (token, KV head) merges (tile merge=acqrel). */
  __syncthreads(); /* every thread's partial stores come before thread 0's release */
  if (threadIdx.x == 0) {
    const int last = atom_add_acq_rel(counters + pair, 1) == nsplit - 1;
    if (last) counters[pair] = 0;               /* ready for the next launch */
    *sflag = last;
  }
  __syncthreads(); /* and thread 0's acquire before every thread's reads of the other splits' */
  if (!*sflag) return;
]]},
  cluster = {defs = CLUSTER.defs, publish = "", merge = CLUSTER_MERGE,
             store = "*(float4 *)(so + r * SO + so_col(d)) = make_float4(a0, a1, a2, a3); /* warp 0's row r: only this thread read it */"},
}

-- Dynamic shared memory of a tile (bytes): decode merges NW warps' fp32
-- outputs (and later reuses the area for the split factors); prefill stages
-- each warp's bf16 output rows.
function A.smem(decode, warps)
  if decode then return warps * 16 * (128 + 8) * 4 + (3 * warps * 16 + 2 * 16) * 4 + 16 end
  return warps * 16 * 128 * 2
end

-- The checks shared by both templates; returns ok, reason.
function A.valid_common(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (mma.sync bf16, cvt bf16x2)" end
  if k.hd ~= 128 then return false, "head_dim must be 128 (8 mma k-steps; fragment layout)" end
  if k.nq < 1 or k.nkv < 1 then return false, "nq and nkv (query and KV heads) must be positive" end
  if k.nq % k.nkv ~= 0 then return false, "nkv must divide nq" end
  if k.nq // k.nkv > 16 then return false, "GQA group nq/nkv must be <= 16 (the mma's M rows)" end
  if k.bs < 16 or k.bs % 16 ~= 0 then return false, "block size must be a positive multiple of 16 (16-key tiles never straddle a page)" end
  if k.mode == "prefill" and t.ctas ~= 1 then
    return false, "ctas (split-K CTAs per SM) applies to decode only: use ctas=1 for prefill"
  end
  if k.mode == "prefill" and t.depth ~= 1 then
    return false, "depth (K/V tiles in flight a warp) applies to decode only: use depth=1 for prefill"
  end
  if t.cvt == "hw" and k.kv ~= "e4m3" then return false, "cvt=hw converts e4m3 only: a bf16 cache needs no conversion (cvt=alu)" end
  if t.cvt == "hw" and m3.sm(arch) < 89 then return false, "cvt.rn.f16x2.e4m3x2 needs sm_89+" end
  if t.merge ~= "fence" and k.mode ~= "decode" then
    return false, "merge (the split-K hand-over) applies to decode only: use merge=fence for prefill"
  end
  if t.merge == "cluster" and m3.sm(arch) < 90 then
    return false, "merge=cluster merges in a thread-block cluster's distributed shared memory (sm_90+)"
  end
  if t.lead == 1 and k.mode ~= "decode" then return false, "lead=1 is for the decode schedule (prefill has no lead-in)" end
  if t.lead == 1 and m3.sm(arch) < 90 then return false, "lead=1 overlaps the previous kernel through programmatic dependent launch (sm_90+)" end
  if t.depth ~= 1 and k.kv ~= "e4m3" then
    return false, "depth=2 is for the e4m3 cache (half the bytes a tile): with bf16 the ring needs over 255 registers a thread (spills)"
  end
  return true
end

function A.render(k, t, arch, sym, sparse, topk)
  local decode = k.mode == "decode"
  local v = {
    nq = k.nq, nkv = k.nkv, bs = k.bs, topk = topk, sparse = sparse and 1 or 0,
    decode = decode and 1 or 0, kv_e4m3 = k.kv == "e4m3" and 1 or 0, warps = t.warps, sym = sym,
    attend_fns = A.attend_fns(t.depth, t.cvt),
    wait_top = t.lead == 1 and LEAD_IN or WAIT, wait_late = t.lead == 1 and LEAD_WAIT or "",
    lead_defs = t.lead == 1 and LEAD.defs or "", -- attn_sparse has no lead axis (t.lead nil): it reads sel first
    merge_defs = MERGE[t.merge].defs, publish = MERGE[t.merge].publish,
    cluster_merge = MERGE[t.merge].merge or "", partial_store = MERGE[t.merge].store or GLOBAL_STORE,
    attend = t.depth > 1 and ("attend_ring<" .. t.depth .. ">") or "attend",
  }
  local src = A.body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("attn_mma: no value for $" .. n) end
    return tostring(v[n])
  end)
  return {source = src, threads = t.warps * 32, smem = A.smem(decode, t.warps)}
end

return A
