-- templates/index_decode.lua - the lightning indexer for decode (spec §5.5):
-- block scores, forcing and top-k of every query token in ONE launch, with no
-- score tensor in memory.
--
-- Work split.  Token t sees nb = ceil(L/bs) blocks (L = its visible length).
-- Its blocks are cut into splits of `bpc` consecutive blocks (derived at
-- launch from the context, the SM count, the kernel's occupancy and the tile:
-- runtime/op_indexer.c); grid = n_tokens x max_splits, token-major, and CTAs
-- past a token's last split exit at once.  The hardware's in-order CTA
-- dispatch balances uneven sequences; forced blocks (init/local) are never
-- read.  One CTA = one split of one token = bpc x 32 KiB of bf16 keys (16 KiB
-- e4m3): on an H200 1 block per split at 8K, 2 at 128K, 16 at 1M.
-- Its computed blocks are cut into 16-token groups, contiguous ranges of
-- which go to its warps (a block may be shared by warps when splits are
-- short, a warp may cover several blocks when they are long).  A group is one
-- mma.sync.m16n8k16 chain: A = 16 index-K rows loaded straight from the cache
-- into operand registers (16-byte streaming loads, each quad of lanes reads
-- 64 contiguous bytes of a row), B = the query's heads (the mma's 8 columns,
-- loaded once), so each K byte is read once and dotted with every index head.
-- `depth` groups per warp are in flight (4 KiB each in bf16): with <= 128
-- registers 16 warps an SM keep 128 KiB in flight, several times what 1/132
-- of 4.3 TB/s needs at DRAM latency.  Per 16 keys a warp issues 8 LDG.128 +
-- 8 HMMA + ~100 integer ops (the non-finite check) in bf16, 4 + 8 + ~180 in
-- e4m3 (decode to fp16 too): well under the SM's issue rate at full
-- bandwidth.  A warp's partial block max (NaN-sticky) goes to shared memory by
-- atomicMax on order-preserving u32 keys; groups holding non-finite values
-- are recomputed exactly after the streaming loop (a call inside it would
-- cost the loop its registers).  Then each head's block scores are forced
-- and ranked, and the split's sorted top-k (64-bit keys, lib/indexer.lua)
-- goes to a small workspace.  The last CTA of the token to finish (atomic
-- counter, fences) merges: the k-th largest of 32 lane-wise maxima of the
-- splits' heads is a threshold no top-k member can be below, the splits whose
-- head reaches it are listed by ballot and all their lists fetched at once,
-- the few candidates at or above it are ranked exactly in shared memory (an exact
-- slow fallback covers the degenerate case of too many), and the counter is
-- reset, so the workspace needs zeroing once only.  With one split the CTA
-- writes the answer directly.  Latency outside the stream: three dependent
-- loads before it (token/position, block table, keys) and three after it
-- (counter, split maxima, survivors' lists); tile lead=1 moves the first two
-- and an L2 prefetch of the first keys ahead of the grid wait (lib/lead.lua),
-- lead=2 also requests the first keys before the query.  The merge is most
-- of what a launch costs beyond its stream (2.9-4.9 us of it on an H100 at
-- 8K to 1M, device run 48's ablation): tile merge=acqrel hands over with one
-- acq_rel atomic instead of seq_cst fences, takes one-block splits' candidates
-- straight from their heads (no list fetch), compacts candidates by ballot
-- and ranks the usual few by shuffles; merge=fence is the older code, kept
-- byte for byte so the tuning records that timed it stay valid.
local P = m3.include("lib/prelude")
local I = m3.include("lib/indexer")
local LEAD = m3.include("lib/lead")

local T = {}
T.name = "index_decode"
T.axes = {
  {"idxk", {"bf16", "e4m3"}},   -- index-q and index-K cache dtype
  {"heads", "int"}, {"hd", "int"}, {"bs", "int"},
  {"topk", "int"}, {"init", "int"}, {"local", "int"},
}
T.tiles = {
  {"warps", {4, 8}},            -- warps per CTA
  {"depth", {2, 4}},            -- 16-token groups in flight per warp
  {"waves", {1, 2}},            -- split rule: CTAs = waves x resident CTAs per SM x SMs
  {"chunk", {8, 16, 32}},       -- most blocks per split (bounds a CTA's duration)
  {"cvt", {"alu", "hw"}},       -- e4m3 -> fp16: bit moves, or cvt.rn.f16x2.e4m3x2
  {"lead", {0, 1, 2}},          -- 1: metadata, block table and an L2 prefetch of the first keys before the grid wait;
                                --   2: as 1, and the first keys are requested before the query, in one round trip
  {"merge", {"fence", "acqrel"}}, -- how a split hands over: __threadfence x2 + atomicAdd, or one acq_rel atomic
                                --   (and, with one block a split, the merge takes its candidates from the split heads)
  {"nf", {"scan", "acc"}},      -- how a group's non-finite keys are found: scan every key word (3 integer ops a
                                --   word), or test the group's accumulators (NF_CHECK below)
}

function T.valid(k, t, arch)
  local sm = m3.sm(arch)
  if sm < 80 then return false, "needs sm_80+ (mma.sync with bf16/f16 operands)" end
  if k.hd ~= 128 then return false, "head_dim must be 128 (8 mma k-steps of 16 dims)" end
  if k.heads < 1 or k.heads > 8 then return false, "heads must be 1..8 (the 8 mma columns hold the index heads)" end
  if k.bs < 16 or k.bs > 1024 or k.bs % 16 ~= 0 then
    return false, "block size must be a multiple of 16 in [16, 1024] (16-token mma row groups)"
  end
  if k.topk < 1 or k.topk > 32 then return false, "topk must be 1..32 (one lane per output slot)" end
  if k.init < 0 or k["local"] < 0 then return false, "init and local block counts must be >= 0" end
  if t.cvt == "hw" and k.idxk ~= "e4m3" then return false, "cvt=hw converts e4m3 only: bf16 keys need no conversion (cvt=alu)" end
  if t.cvt == "hw" and sm < 89 then return false, "cvt.rn.f16x2.e4m3x2 needs sm_89+" end
  if t.nf == "acc" and k.idxk == "e4m3" and t.cvt ~= "hw" then
    return false, "nf=acc needs cvt=hw with e4m3 keys (cvt=alu's bit moves turn an e4m3 NaN into a finite fp16)"
  end
  if t.lead >= 1 and sm < 90 then return false, "lead=" .. t.lead .. " overlaps the previous kernel through programmatic dependent launch (sm_90+)" end
  return true
end

function T.default_tile(k, arch)
  return {warps = 4, depth = k.idxk == "e4m3" and 4 or 2, waves = 1, chunk = 16, cvt = "alu", lead = 0, merge = "fence", nf = "scan"}
end

function T.variants(c)
  local out = {}
  if c.has_sparse ~= 0 then
    for _, ix in ipairs({"bf16", "e4m3"}) do
      out[#out + 1] = {idxk = ix, heads = c.niq, hd = c.hd, bs = c.bs, topk = c.topk, init = c.init,
                       ["local"] = c["local"]}
    end
  end
  return out
end

local body = [[
#define H $heads
#define HD 128
#define BS $bs
#define TOPK $topk
#define INIT $init
#define LOCAL $local
#define E4M3 $e4m3
#define NW $warps
#define DEPTH $depth
#define MAXB 64                  /* most blocks per split (the launcher clamps bpc) */
#define CAP 256                  /* merge survivors per head held in shared memory */
#define RH 16                    /* split heads per lane kept in registers by the merge (512 splits) */
#define SVCAP 256                /* surviving splits per head listed in shared memory by the merge */
#define MG 16                    /* survivor keys per lane in flight in the merge */
#define GPB (BS / 16)            /* 16-token groups per block */
#if E4M3
#define ROWB HD                  /* bytes per index-K row */
#define NF_MASK 0x80808080u
#else
#define ROWB (2 * HD)
#define NF_MASK 0x80008000u
#endif
#define CPR (ROWB / 64)          /* 16-byte chunks of a row per lane (quad lane tq owns bytes 16tq + 64j) */
#define CH (2 * CPR)             /* chunks per lane per group: rows g and g+8 */
/* 64 registers of loads in flight or fewer: 128 registers a thread, 2048
 * threads an SM (4 CTAs of 4 warps); more buffers get the registers they need. */
#define MINB (DEPTH * CH <= 16 ? 16 / NW : 8 / NW)

/* Non-finite detector folded into an accumulator: after masking with NF_MASK
 * a bit is set iff some value had an all-ones exponent (bf16 Inf/NaN) or was
 * an e4m3 NaN code (0x7f/0xff).  No carries cross the bf16 halves or bytes. */
M3_DEV unsigned nf_acc(unsigned acc, unsigned w) {
#if E4M3
  return acc | ((w & 0x7f7f7f7fu) + 0x01010101u);
#else
  return acc | ((w & 0x7f807f80u) + 0x00800080u);
#endif
}
M3_DEV unsigned nf_acc4(unsigned acc, const uint4 &v) { return nf_acc(nf_acc(nf_acc(nf_acc(acc, v.x), v.y), v.z), v.w); }

/* The query as the mma's B operand: column n = index head n (zero when n >= H);
 * per k-step two registers.  The dim order within a lane is the same as the
 * index-K rows' (A operand), which is all a dot product needs. */
struct qfrag { unsigned b[8][2]; };

M3_DEV void load_q(qfrag &q, const unsigned char *iq_row, int g, int tq, unsigned &nf) {
#pragma unroll
  for (int s = 0; s < 8; s++) q.b[s][0] = q.b[s][1] = 0u;
  if (g >= H) return;
  const unsigned char *p = iq_row + (i64)g * ROWB + 16 * tq;
#pragma unroll
  for (int j = 0; j < CPR; j++) {
    const uint4 v = *(const uint4 *)(p + 64 * j);
    nf = nf_acc4(nf, v);
#if E4M3
    unsigned d[8];
    e4m3_word_f16(v.x, d[0], d[1]); e4m3_word_f16(v.y, d[2], d[3]);
    e4m3_word_f16(v.z, d[4], d[5]); e4m3_word_f16(v.w, d[6], d[7]);
#pragma unroll
    for (int qq = 0; qq < 4; qq++) q.b[4 * j + qq][0] = d[2 * qq], q.b[4 * j + qq][1] = d[2 * qq + 1];
#else
    q.b[2 * j][0] = v.x, q.b[2 * j][1] = v.y, q.b[2 * j + 1][0] = v.z, q.b[2 * j + 1][1] = v.w;
#endif
  }
}

/* One 16-token group x all heads: c[0], c[1] = rows g (heads 2tq, 2tq+1),
 * c[2], c[3] = row g+8. */
M3_DEV void group_dot(float (&c)[4], const uint4 (&v)[CH], const qfrag &q) {
  c[0] = c[1] = c[2] = c[3] = 0.0f;
#pragma unroll
  for (int j = 0; j < CPR; j++) {
#if E4M3
    unsigned da[8], db[8];
    e4m3_word_f16(v[j].x, da[0], da[1]); e4m3_word_f16(v[j].y, da[2], da[3]);
    e4m3_word_f16(v[j].z, da[4], da[5]); e4m3_word_f16(v[j].w, da[6], da[7]);
    e4m3_word_f16(v[CPR + j].x, db[0], db[1]); e4m3_word_f16(v[CPR + j].y, db[2], db[3]);
    e4m3_word_f16(v[CPR + j].z, db[4], db[5]); e4m3_word_f16(v[CPR + j].w, db[6], db[7]);
#pragma unroll
    for (int qq = 0; qq < 4; qq++)
      mma16816(c, da[2 * qq], db[2 * qq], da[2 * qq + 1], db[2 * qq + 1], q.b[4 * j + qq][0], q.b[4 * j + qq][1]);
#else
    mma16816(c, v[j].x, v[CPR + j].x, v[j].y, v[CPR + j].y, q.b[2 * j][0], q.b[2 * j][1]);
    mma16816(c, v[j].z, v[CPR + j].z, v[j].w, v[CPR + j].w, q.b[2 * j + 1][0], q.b[2 * j + 1][1]);
#endif
  }
#if E4M3
  c[0] *= E4M3_PROD_SCALE, c[1] *= E4M3_PROD_SCALE, c[2] *= E4M3_PROD_SCALE, c[3] *= E4M3_PROD_SCALE;
#endif
}

/* The exact path for rows [r0, r1) of one block (non-finite values in them
 * or in the query): each visible row's score is m3_ref_dot_f32 op for op (8
 * interleaved fp32 sums, no FMA), the max is NaN-sticky, and the per-head
 * maxima join the block's shared max.  bm points at head 0's entry (stride
 * MAXB).  The whole warp calls it. */
__noinline__ M3_DEV void slow_rows(const unsigned char *cache, i64 page, int r0, int r1, i64 jbase, i64 L,
                                   const float *sq, unsigned *bm) {
  const int lane = threadIdx.x & 31;
  float mx[H];
  for (int h = 0; h < H; h++) mx[h] = f_ninf();
  for (int r = r0 + lane; r < r1; r += 32) {
    if (jbase + r >= L) continue;
    const unsigned char *row = cache + (page * BS + r) * (i64)ROWB;
    float acc[H][8];
    for (int h = 0; h < H; h++)
      for (int u = 0; u < 8; u++) acc[h][u] = 0.0f;
    for (int k = 0; k < HD; k += 8) {
      float kf[8];
#if E4M3
      for (int u = 0; u < 8; u++) kf[u] = e4m3_to_f32(row[k + u]);
#else
      for (int u = 0; u < 8; u++) kf[u] = bf16_to_f32(((const bf16_t *)row)[k + u]);
#endif
      for (int h = 0; h < H; h++)
        for (int u = 0; u < 8; u++) acc[h][u] = __fadd_rn(acc[h][u], __fmul_rn(sq[h * HD + k + u], kf[u]));
    }
    for (int h = 0; h < H; h++) {
      const float *a = acc[h];
      float s = __fadd_rn(__fadd_rn(__fadd_rn(a[0], a[1]), __fadd_rn(a[2], a[3])),
                          __fadd_rn(__fadd_rn(a[4], a[5]), __fadd_rn(a[6], a[7])));
      mx[h] = fmax_nan(mx[h], s);
    }
  }
  for (int h = 0; h < H; h++) {
    float m = mx[h];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmax_nan(m, __shfl_xor_sync(FULL, m, o));
    if (lane == 0) atomicMax(bm + h * MAXB, mono32(m));
  }
}

$lead_defs
extern "C" __global__ void __launch_bounds__(NW * 32, MINB)
$sym(const unsigned char *__restrict__ iq,     /* [n_tokens, H, HD] bf16 | e4m3, 16-byte aligned */
     const unsigned char *__restrict__ cache,  /* [num_pages * BS, HD] bf16 | e4m3 */
     i64 num_pages,
     const int *__restrict__ block_table, i64 bt_stride,
     int n_seqs, const int *__restrict__ token_seq, const i64 *__restrict__ positions,
     int *__restrict__ out,                    /* [H, n_tokens, TOPK] */
     unsigned *__restrict__ counters,          /* [n_tokens], zero between launches */
     u64 *__restrict__ heads,                  /* [n_tokens, H, max_splits] */
     u64 *__restrict__ lists,                  /* [n_tokens, max_splits, H, TOPK] */
     int n_tokens, int max_splits, int bpc, int max_blocks) {
$prologue$opening    for (int base = u0; base < u1; base += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; d++) {
        const int u = base + d;
        if (u < u1) {
          const int bl = u / GPB;
          if (bl != cur) {
            if (cur >= 0) flush(cur, pstart, u);
            cur = bl, pstart = u, m0 = m1 = f_ninf(), bad = 0u;
          }
          float c[4];
          group_dot(c, buf[d], qf);
          unsigned na = 0, nb8 = 0;
$nf_check          const i64 row0 = (i64)(c0 + bl) * BS + (u - bl * GPB) * 16;
          if (row0 + 16 > L) { /* the group holds rows past the query: masked (causal, j <= position) */
            if (row0 + g >= L) c[0] = c[1] = f_ninf(), na = 0u;
            if (row0 + g + 8 >= L) c[2] = c[3] = f_ninf(), nb8 = 0u;
          }
          m0 = fmax_nan(m0, fmax_nan(c[0], c[2]));
          m1 = fmax_nan(m1, fmax_nan(c[1], c[3]));
          bad |= (na | nb8) & NF_MASK;
          if (u + DEPTH < u1) load(buf[d], u + DEPTH);
        }
      }
    }
    if (cur >= 0) flush(cur, pstart, u1);
    __syncwarp();
    for (int i = 0; i < nslow; i++) {
      const int sv = s_slow[w][i], bl = sv >> 16, bg = c0 + bl;
      slow_rows(cache, s_page[bl], ((sv >> 8) & 0xff) * 16, (sv & 0xff) * 16, (i64)bg * BS, L, s_q, &s_bmax[0][bg - b0]);
    }
  }
  __syncthreads();
  pdl_launch_dependents();

  /* ---- this split's forced, ranked block scores ---- */
  for (int h = w; h < H; h += NW) {
    u64 *kk = s_keys[w];
    for (int i = lane; i < n_local; i += 32) {
      const int bg = b0 + i;
      float v = 0.0f; /* forced blocks: the value is irrelevant */
      if (bg >= c0 && bg < c1) {
        const unsigned m = s_bmax[h][i];
        v = (m == POISON || m == 0u) ? __uint_as_float(0x7fc00000u) : unmono32(m);
      }
      kk[i] = make_key(force_block(v, bg, nb, INIT, LOCAL), bg);
    }
    s_lk[w][lane] = 0ull;
    __syncwarp();
    for (int i = lane; i < n_local; i += 32) {
      const u64 ki = kk[i];
      int r = 0;
      for (int j = 0; j < n_local; j++) r += kk[j] > ki;
      if (r < TOPK) s_lk[w][r] = ki;
    }
    __syncwarp();
    if (n_splits == 1) {
      if (lane < TOPK) out[((i64)h * n_tokens + t) * TOPK + lane] = s_lk[w][lane] ? key_id(s_lk[w][lane]) : -1;
    } else {
      if (lane < TOPK) lists[(((i64)t * max_splits + sp) * H + h) * TOPK + lane] = s_lk[w][lane];
      if (lane == 0) heads[((i64)t * H + h) * max_splits + sp] = s_lk[w][0];
    }
    __syncwarp();
  }
  if (n_splits == 1) return;

  /* ---- the last split of the token to finish merges ---- */
$publish  for (int h = w; h < H; h += NW) {
    const u64 *hp = heads + ((i64)t * H + h) * max_splits;
    const u64 *lp0 = lists + ((i64)t * max_splits * H + h) * TOPK; /* split s at lp0 + s * H * TOPK */
    u64 hr[RH], mx = 0ull;
#pragma unroll
    for (int r = 0; r < RH; r++) {
      const int s2 = lane + 32 * r;
      hr[r] = s2 < n_splits ? ldcg64(hp + s2) : 0ull;
      mx = hr[r] > mx ? hr[r] : mx;
    }
    for (int s2 = lane + 32 * RH; s2 < n_splits; s2 += 32) {
      const u64 x = ldcg64(hp + s2);
      mx = x > mx ? x : mx;
    }
    const u64 thr = warp_kth_largest(mx, TOPK);
$h1_open    /* The splits whose best key reaches the threshold, compacted into shared
     * memory by ballot, so that all their lists are then fetched in one
     * round trip (a conditional fetch per register would be RH dependent
     * round trips: ncu on the H200 found the SMs idle for 73% of a 128K launch,
     * waiting on that serial merge). */
    int nsv = 0;
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll
    for (int r = 0; r < RH; r++) {
      const int p = hr[r] != 0ull && hr[r] >= thr;
      const unsigned m = __ballot_sync(FULL, p);
      const int at = nsv + __popc(m & lt);
      if (p && at < SVCAP) s_sv[w][at] = lane + 32 * r;
      nsv += __popc(m);
    }
    for (int b2 = 32 * RH; b2 < n_splits; b2 += 32) {
      const int s2 = b2 + lane;
      const u64 x = s2 < n_splits ? ldcg64(hp + s2) : 0ull;
      const int p = x != 0ull && x >= thr;
      const unsigned m = __ballot_sync(FULL, p);
      const int at = nsv + __popc(m & lt);
      if (p && at < SVCAP) s_sv[w][at] = s2;
      nsv += __popc(m);
    }
$count_init    if (nsv <= SVCAP) {
      const int nk = nsv * TOPK;
      for (int b2 = 0; b2 < nk; b2 += 32 * MG) {
        u64 x[MG];
#pragma unroll
        for (int j = 0; j < MG; j++) {
          const int i = b2 + 32 * j + lane;
          x[j] = i < nk ? ldcg64(lp0 + (i64)s_sv[w][i / TOPK] * H * TOPK + i % TOPK) : 0ull;
        }
$push      }
    }
$count_done$h1_close    __syncwarp();
    const int n = s_cnt[w];
    if (n <= CAP) {
$rank    } else { /* degenerate (mass ties): exact selection, one rank per pass */
      u64 prev = ~0ull;
      for (int r = 0; r < TOPK; r++) {
        u64 best = 0ull;
        for (int s2 = lane; s2 < n_splits; s2 += 32)
          for (int e = 0; e < TOPK; e++) {
            const u64 x = ldcg64(lp0 + (i64)s2 * H * TOPK + e);
            if (x < prev && x > best) best = x;
          }
        best = warp_max64(best);
        if (lane == 0) s_out[w][r] = best ? key_id(best) : -1;
        prev = best;
      }
      __syncwarp();
    }
    if (lane < TOPK) out[((i64)h * n_tokens + t) * TOPK + lane] = s_out[w][lane];
    __syncwarp();
  }
  if (tid == 0) counters[t] = 0u; /* ready for the next launch */
}
]]

-- The score loop's opening.  lead 0 and 1: the query, a barrier, then the
-- first DEPTH groups of keys, two round trips after the grid wait.  lead 2
-- requests those keys first and reads the query while they are in flight:
-- one round trip (the keys are in L2 by then, prefetched before the wait).
local OPEN = {
  Q = [[
  for (int i = tid; i < H * MAXB; i += NW * 32) (&s_bmax[0][0])[i] = 0u;
  const unsigned char *iq_row = iq + (i64)t * H * ROWB;
  for (int i = tid; i < H * HD; i += NW * 32) {
#if E4M3
    s_q[i] = e4m3_to_f32(iq_row[i]);
#else
    s_q[i] = bf16_to_f32(((const bf16_t *)iq_row)[i]);
#endif
  }
  qfrag qf;
  unsigned qnf = 0;
  load_q(qf, iq_row, g, tq, qnf);
  const int qbad = __any_sync(FULL, (qnf & NF_MASK) != 0u);
  __syncthreads();
]],
  S_OPEN = [[

  /* ---- score: this warp's contiguous range of 16-token groups ---- */
  {
    const int U = n_c * GPB;
    const int u0 = (int)(((i64)w * U) / NW), u1 = (int)(((i64)(w + 1) * U) / NW);
    uint4 buf[DEPTH][CH];
    auto load = [&](uint4 (&v)[CH], int u) {
      const int bl = u / GPB, grp = u - bl * GPB, page = s_page[bl];
      if (page < 0) {
#pragma unroll
        for (int j = 0; j < CH; j++) v[j] = make_uint4(0u, 0u, 0u, 0u);
        return;
      }
      const unsigned char *p0 = cache + ((i64)page * BS + grp * 16 + g) * (i64)ROWB + 16 * tq;
#pragma unroll
      for (int j = 0; j < CPR; j++) {
        v[j] = ld_stream16(p0 + 64 * j);
        v[CPR + j] = ld_stream16(p0 + 8 * ROWB + 64 * j);
      }
    };
]],
  S_FLUSH = [[
    float m0 = f_ninf(), m1 = f_ninf();
    unsigned bad = 0;
    int cur = -1, pstart = u0, nslow = 0;
    auto flush = [&](int bl, int ua, int ub) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        m0 = fmax_nan(m0, __shfl_xor_sync(FULL, m0, o));
        m1 = fmax_nan(m1, __shfl_xor_sync(FULL, m1, o));
      }
      const int anybad = __any_sync(FULL, bad != 0u);
      const int slow = qbad | anybad;
      const int bg = c0 + bl, idx = bg - b0, page = s_page[bl];
      if (page < 0) { /* a block-table entry outside the cache: poisoned, never chosen ahead of a finite block */
        if (lane < H) atomicMax(&s_bmax[lane][idx], POISON);
      } else if (slow) { /* after the loop: a call here would cost the loop its registers */
        if (lane == 0) s_slow[w][nslow] = (bl << 16) | ((ua - bl * GPB) << 8) | (ub - bl * GPB);
        nslow++;
      } else if (lane < 4) {
        if (2 * lane < H) atomicMax(&s_bmax[2 * lane][idx], mono32(m0));
        if (2 * lane + 1 < H) atomicMax(&s_bmax[2 * lane + 1][idx], mono32(m1));
      }
    };
]],
  S_PRE = [[
#pragma unroll
    for (int d = 0; d < DEPTH; d++)
      if (u0 + d < u1) load(buf[d], u0 + d);
]],
}

-- How the score loop finds the 16-token groups that hold non-finite keys,
-- which the exact path recomputes (tile nf).  scan: every key word through
-- nf_acc4, 3 integer ops a word - in the loop's SASS (sm_90, the seed's
-- 1M tiles) 192 of bf16's 651 instructions an iteration, 96 of e4m3's 537.
-- acc: the row's mma accumulators instead, 2 tests a row: a non-finite key
-- (bf16 Inf or NaN, e4m3 NaN) makes every column of its row non-finite
-- (Inf x 0 and NaN x anything are NaN, Inf + finite is Inf, a NaN stays),
-- the query being finite (a non-finite query sends every group to the exact
-- path, qbad), so every group scan flags is flagged; acc also flags finite
-- keys whose fp32 sums overflow, which the exact path then computes as the
-- reference does.  Masked rows are cleared after, as for scan.
local NF_CHECK = {
  scan = [[
#pragma unroll
          for (int j = 0; j < CPR; j++) na = nf_acc4(na, buf[d][j]), nb8 = nf_acc4(nb8, buf[d][CPR + j]);
]],
  acc = [[
          if (!(fabsf(c[0]) <= 3.40282347e38f && fabsf(c[1]) <= 3.40282347e38f)) na = NF_MASK; /* NaN fails <= */
          if (!(fabsf(c[2]) <= 3.40282347e38f && fabsf(c[3]) <= 3.40282347e38f)) nb8 = NF_MASK;
]],
}

-- How a split hands over to the merge (tile merge).  fence: every thread
-- fences (seq_cst, gpu scope) before thread 0's atomicAdd, and the last CTA
-- fences again before it reads.  acqrel: one atom.acq_rel.gpu by thread 0
-- between two barriers - its release covers the other warps' stores, which
-- the barrier ordered before it, and its acquire the other warps' reads, as
-- in CUTLASS's semaphore - so no seq_cst fence is on the path.  With one
-- block a split (bpc 1) a split's list is its head, so the merge takes the
-- candidates from the heads it holds in registers instead of fetching the
-- survivors' lists: one round trip less.  Candidates are compacted by ballot
-- (32 lanes' atomics on one shared counter serialise) and up to 64 are
-- ranked by shuffles.  (Loading every split's list at once where they hold
-- <= 1024 keys was slower: 64 more registers, spilled; device run 49.)
local MERGE = {
  fence = {publish = [[
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&counters[t], 1u) == (unsigned)(n_splits - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
]], defs = "", h1_open = "", h1_close = "", count_done = "",
    count_init = [[
    if (lane == 0) s_cnt[w] = nsv > SVCAP ? CAP + 1 : 0; /* too many survivors: the exact path below */
    __syncwarp();
]],
    push = [[
#pragma unroll
        for (int j = 0; j < MG; j++)
          if (x[j] != 0ull && x[j] >= thr) {
            const int at = atomicAdd(&s_cnt[w], 1);
            if (at < CAP) s_keys[w][at] = x[j];
          }
]],
    rank = [[
      warp_rank_top(s_keys[w], n, TOPK, s_out[w]);
]]},
  acqrel = {
    publish = [[
  __syncthreads(); /* every warp's list and head stores come before thread 0's release */
  if (tid == 0) s_last = atom_add_acq_rel(&counters[t], 1u) == (unsigned)(n_splits - 1);
  __syncthreads(); /* and thread 0's acquire before every warp's reads of the other splits' */
  if (!s_last) return;
]],
    defs = [[
/* atomicAdd with release (earlier stores, the barrier's included, are seen
 * first) and acquire (later loads see what the releases published). */
M3_DEV unsigned atom_add_acq_rel(unsigned *p, unsigned v) {
#ifdef __CUDA_ARCH__
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}
/* warp_rank_top for the usual few candidates: with n <= 64 each lane holds
 * up to two and counts the larger ones over shuffles (independent, so they
 * pipeline) instead of n dependent-latency reads of shared memory a lane. */
M3_DEV void warp_rank_top_shfl(const u64 *cand, int n, int K, int *out_s) {
  if (n > 64) {
    warp_rank_top(cand, n, K, out_s);
    return;
  }
  const int lane = threadIdx.x & 31;
  if (lane < K) out_s[lane] = -1;
  const u64 a = lane < n ? cand[lane] : 0ull, b = lane + 32 < n ? cand[lane + 32] : 0ull;
  int ra = 0, rb = 0;
  if (n <= 32) {
#pragma unroll 8
    for (int j = 0; j < 32; j++) ra += __shfl_sync(FULL, a, j) > a;
  } else {
#pragma unroll 8
    for (int j = 0; j < 32; j++) {
      const u64 x = __shfl_sync(FULL, a, j), y = __shfl_sync(FULL, b, j);
      ra += (x > a) + (y > a), rb += (x > b) + (y > b);
    }
  }
  __syncwarp();
  if (a != 0ull && ra < K) out_s[ra] = key_id(a);
  if (b != 0ull && rb < K) out_s[rb] = key_id(b);
  __syncwarp();
}
]],
    h1_open = [[
    if (bpc == 1) { /* each split's list is its head: the candidates are hr[] and the heads past it */
      const unsigned lt1 = (1u << lane) - 1u;
      int nc = 0;
#pragma unroll
      for (int r = 0; r < RH; r++) {
        const int p = hr[r] != 0ull && hr[r] >= thr;
        const unsigned m = __ballot_sync(FULL, p);
        const int at = nc + __popc(m & lt1);
        if (p && at < CAP) s_keys[w][at] = hr[r];
        nc += __popc(m);
      }
      for (int b2 = 32 * RH; b2 < n_splits; b2 += 32) {
        const int s2 = b2 + lane;
        const u64 x = s2 < n_splits ? ldcg64(hp + s2) : 0ull;
        const int p = x != 0ull && x >= thr;
        const unsigned m = __ballot_sync(FULL, p);
        const int at = nc + __popc(m & lt1);
        if (p && at < CAP) s_keys[w][at] = x;
        nc += __popc(m);
      }
      if (lane == 0) s_cnt[w] = nc;
    } else {
]],
    count_init = [[
    __syncwarp(); /* the lanes' s_sv entries, before other lanes read them (racecheck, device run 53) */
    int nc = nsv > SVCAP ? CAP + 1 : 0; /* too many survivors: the exact path below */
]],
    push = [[
#pragma unroll
        for (int j = 0; j < MG; j++) { /* compacted by ballot, not by atomics on one shared counter */
          const int p = x[j] != 0ull && x[j] >= thr;
          const unsigned m = __ballot_sync(FULL, p);
          const int at = nc + __popc(m & lt);
          if (p && at < CAP) s_keys[w][at] = x[j];
          nc += __popc(m);
        }
]],
    count_done = [[
    if (lane == 0) s_cnt[w] = nc;
]],
    rank = [[
      warp_rank_top_shfl(s_keys[w], n, TOPK, s_out[w]);
]],
    h1_close = [[
    }
]],
  },
}

-- The kernel's opening, in pieces: lead=0 keeps the order the tuning records
-- before the lead axis timed, byte for byte; lead=1 moves what needs no
-- kernel's output in front of the grid wait.
local W = [[
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
]]
local PRE = {
  A = [[
  __shared__ int s_page[MAXB];
  __shared__ unsigned s_bmax[H][MAXB];
  __shared__ float s_q[H * HD];
  __shared__ u64 s_keys[NW][CAP];
  __shared__ u64 s_lk[NW][32];
  __shared__ int s_out[NW][32];
  __shared__ int s_cnt[NW];
  __shared__ int s_sv[NW][SVCAP];
  __shared__ int s_slow[NW][MAXB + 2]; /* portions to recompute exactly: bl << 16 | first group << 8 | end group */
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int t = (int)(blockIdx.x / (unsigned)max_splits);
  const int sp = (int)(blockIdx.x - (unsigned)t * (unsigned)max_splits);
]],
  PW = [[
  pdl_wait();
]],
  B = [[

  /* Visible length, clamped so that no input makes the kernel read outside
   * its arrays.  positions[t] < seq_lens[seq] is trusted (the reference
   * checks it): reading seq_lens here would put one more dependent load in
   * front of the block table and the keys. */
  const int seq = token_seq[t];
  const i64 pos = positions[t];
  i64 L = 0;
  if (seq >= 0 && seq < n_seqs) {
    L = pos + 1;
    if (L > bt_stride * BS) L = bt_stride * BS;
    if (L > (i64)max_blocks * BS) L = (i64)max_blocks * BS;
    if (L < 0) L = 0;
  }
  const int nb = (int)((L + BS - 1) / BS);
  const int n_splits = (nb + bpc - 1) / bpc;
]],
  C = [[
  if (nb == 0) { /* nothing visible: the row is all -1 */
    if (sp == 0)
      for (int i = tid; i < H * TOPK; i += NW * 32) out[((i64)(i / TOPK) * n_tokens + t) * TOPK + i % TOPK] = -1;
    return;
  }
  if (sp >= n_splits) return;
]],
  D = [[
  const int b0 = sp * bpc, b1 = min(nb, b0 + bpc), n_local = b1 - b0;
  const int c0 = max(b0, INIT);
  int c1 = min(b1, nb - LOCAL);
  if (c1 < c0) c1 = c0;
  const int n_c = c1 - c0; /* blocks to score; the rest of [b0, b1) is forced */
]],
  E = [[

  /* Only block-table entries of visible, non-forced blocks are read (fault 6). */
  const int *bt_row = block_table + (i64)seq * bt_stride;
  if (tid < n_c) {
    const int p = bt_row[c0 + tid];
    s_page[tid] = (p >= 0 && (i64)p < num_pages) ? p : -1;
  }
]],
}

-- Lead-in (tile lead=1, lib/lead.lua).  This grid's CTAs are resident while
-- the previous kernel (qk-norm + RoPE, which writes the index query and the
-- new index-K rows) still runs.  So the split's metadata - token, position,
-- visible length, its block-table entries, three dependent round trips - is
-- read before the wait, and the first keys each warp streams are prefetched
-- into L2.  After the wait: the query, the scores.
local LEAD_IN = [[
  M3_LEAD_IN; /* launch inputs only until the wait (lib/lead.lua) */
]]
local LEAD_PREFETCH = [[
  __syncthreads(); /* s_page */
  { /* each warp's first 2 x DEPTH groups (what it loads right after the wait) into L2, a group a lane */
    const int U = n_c * GPB;
    const int u0 = (int)(((i64)w * U) / NW), u1 = (int)(((i64)(w + 1) * U) / NW);
    const int u = u0 + lane, bl = u / GPB;
    if (lane < 2 * DEPTH && u < u1 && s_page[bl] >= 0)
      prefetch_l2(cache + ((i64)s_page[bl] * BS + (u - bl * GPB) * 16) * (i64)ROWB, 16 * ROWB);
  }
  M3_GRID_WAIT(); /* the query and the keys after it */
]]

local function prologue(lead)
  if lead == 0 then return W .. PRE.A .. PRE.PW .. PRE.B .. PRE.C .. PRE.D .. PRE.E end
  return LEAD_IN .. PRE.A .. PRE.B .. PRE.D .. PRE.E .. LEAD_PREFETCH .. PRE.C
end

function T.render(k, t, arch, sym)
  local e4 = k.idxk == "e4m3"
  local M = MERGE[t.merge]
  local v = {
    heads = k.heads, bs = k.bs, topk = k.topk, init = k.init, ["local"] = k["local"],
    e4m3 = e4 and 1 or 0, warps = t.warps, depth = t.depth, sym = sym,
    prologue = prologue(t.lead), lead_defs = (t.lead >= 1 and LEAD.defs or "") .. M.defs,
    opening = t.lead == 2 and OPEN.S_OPEN .. OPEN.S_PRE .. OPEN.Q .. OPEN.S_FLUSH
                           or OPEN.Q .. OPEN.S_OPEN .. OPEN.S_FLUSH .. OPEN.S_PRE,
    publish = M.publish, h1_open = M.h1_open, h1_close = M.h1_close, count_init = M.count_init,
    push = M.push, count_done = M.count_done, rank = M.rank, nf_check = NF_CHECK[t.nf],
  }
  local src = body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("index_decode: no value for $" .. n) end
    return tostring(v[n])
  end)
  local lib = I.common .. I.mma(e4 and "f16" or "bf16") .. (e4 and I.e4m3_decode(t.cvt) or "")
  return {source = P.all(arch) .. lib .. src, threads = t.warps * 32, smem = 0}
end

return T
