-- templates/index_prefill.lua - the lightning indexer for prefill chunks
-- (spec §5.5): stage=score writes the raw block scores S_g(t, b) (max over
-- the causally visible tokens of block b, no forcing) to an fp32 buffer
-- [heads, n_tokens, max_blocks]; stage=topk applies the forcing and selects
-- the top-k blocks of every (head, token) row.  Two kernels because a chunk's
-- score rows are wide (up to 8192 blocks at 1M context) and the top-k of one
-- row needs all of them; the score buffer is 1/bs of the token scores.
--
-- score: grid (block, token tile).  A warp owns one mma m-tile = 16 rows =
-- 16/heads query tokens x all heads (row r = token r/heads, head r%heads),
-- the query loaded once into A registers; it walks the block's keys 8 at a
-- time as the B operand (index-K rows straight from the cache, same dim order
-- as the query) and keeps per-row maxima of the causally visible keys
-- (j <= position).  The CTA's warps are consecutive token tiles reading the
-- same keys, so the key bytes mostly come from L1.  Non-finite values in the
-- block or the query divert the warp to the exact scalar path (see
-- lib/indexer.lua).  A warp's tokens must belong to one sequence (a prefill
-- chunk is one sequence): rows of another sequence are left unwritten.
-- topk: one warp per row; pass 1 takes the k-th largest of 32 lane maxima (a
-- threshold no member of the top-k is below), pass 2 collects the keys at or
-- above it (ballot compaction) and ranks them exactly in shared memory; an
-- exact slow fallback handles more than CAP survivors (mass ties).
local P = m3.include("lib/prelude")
local I = m3.include("lib/indexer")

local T = {}
T.name = "index_prefill"
T.axes = {
  {"stage", {"score", "topk"}},
  {"idxk", {"bf16", "e4m3"}},   -- index-q and index-K cache dtype
  {"heads", "int"}, {"hd", "int"}, {"bs", "int"},
  {"topk", "int"}, {"init", "int"}, {"local", "int"},
}
T.tiles = {
  {"warps", {2, 4, 8}},         -- score: token tiles per CTA; topk: rows per CTA
}

function T.valid(k, t, arch)
  if m3.sm(arch) < 80 then return false, "needs sm_80+ (mma.sync with bf16/f16 operands)" end
  if k.hd ~= 128 then return false, "head_dim must be 128 (8 mma k-steps of 16 dims)" end
  if k.heads ~= 1 and k.heads ~= 2 and k.heads ~= 4 and k.heads ~= 8 then
    return false, "heads must be 1, 2, 4 or 8 (16 mma rows = 16/heads tokens x heads)"
  end
  if k.bs < 16 or k.bs > 1024 or k.bs % 16 ~= 0 then
    return false, "block size must be a multiple of 16 in [16, 1024]"
  end
  if k.topk < 1 or k.topk > 32 then return false, "topk must be 1..32 (one lane per output slot)" end
  if k.init < 0 or k["local"] < 0 then return false, "init and local block counts must be >= 0" end
  return true
end

function T.default_tile(k, arch) return {warps = 4} end

function T.variants(c)
  local out = {}
  if c.has_sparse ~= 0 then
    for _, st in ipairs({"score", "topk"}) do
      for _, ix in ipairs({"bf16", "e4m3"}) do
        out[#out + 1] = {stage = st, idxk = ix, heads = c.niq, hd = c.hd, bs = c.bs, topk = c.topk,
                         init = c.init, ["local"] = c["local"]}
      end
    end
  end
  return out
end

local common = [[
#define H $heads
#define HD 128
#define BS $bs
#define TOPK $topk
#define INIT $init
#define LOCAL $local
#define E4M3 $e4m3
#define NW $warps
#define CAP 256                  /* survivors per row held in shared memory */
#if E4M3
#define ROWB HD
#define NF_MASK 0x80808080u
#else
#define ROWB (2 * HD)
#define NF_MASK 0x80008000u
#endif
#define CPR (ROWB / 64)

/* Visible length of token t (0 when it belongs to no valid sequence or not
 * to `seq` when seq >= 0), clamped so that no input makes a kernel read
 * outside its arrays; positions[t] < seq_lens[seq] is trusted, as in the
 * decode kernel. */
M3_DEV i64 vis_len(int t, int n_tokens, int seq, int n_seqs, const int *token_seq, const i64 *positions,
                   i64 bt_stride, int max_blocks) {
  if (t >= n_tokens) return 0;
  const int s = token_seq[t];
  if (s < 0 || s >= n_seqs || (seq >= 0 && s != seq)) return 0;
  i64 L = positions[t] + 1;
  if (L > bt_stride * BS) L = bt_stride * BS;
  if (L > (i64)max_blocks * BS) L = (i64)max_blocks * BS;
  return L < 0 ? 0 : L;
}
]]

local score_body = [[
#define TPT (16 / H)             /* query tokens per mma m-tile */

M3_DEV unsigned nf_acc(unsigned acc, unsigned w) {
#if E4M3
  return acc | ((w & 0x7f7f7f7fu) + 0x01010101u);
#else
  return acc | ((w & 0x7f807f80u) + 0x00800080u);
#endif
}
M3_DEV unsigned nf_acc4(unsigned acc, const uint4 &v) { return nf_acc(nf_acc(nf_acc(nf_acc(acc, v.x), v.y), v.z), v.w); }

/* 16 bytes of a row -> the registers of 2 (bf16) or 4 (e4m3) k-steps, in the
 * order shared by the query (A) and the keys (B). */
M3_DEV void chunk_regs(const uint4 &v, unsigned (&r)[8]) {
#if E4M3
  e4m3_word_f16(v.x, r[0], r[1]); e4m3_word_f16(v.y, r[2], r[3]);
  e4m3_word_f16(v.z, r[4], r[5]); e4m3_word_f16(v.w, r[6], r[7]);
#else
  r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
#endif
}
#define KSTEPS_PER_CHUNK (8 / CPR) /* bf16: 2, e4m3: 4 */

/* Exact per-row maxima (m3_ref_dot_f32 op for op) of the 16 rows over the
 * block's visible keys; lanes take keys, then reduce.  Returns rows g and
 * g+8 to each lane. */
__noinline__ M3_DEV void slow_block(const unsigned char *iq, const unsigned char *keys /* block's first row */,
                                    i64 jbase, const int (&tok)[16], const int (&hd_)[16], const i64 (&Lr)[16],
                                    float &ma, float &mb) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  float mr[16];
  for (int r = 0; r < 16; r++) mr[r] = f_ninf();
  for (int kk = lane; kk < BS; kk += 32) {
    const unsigned char *krow = keys + (i64)kk * ROWB;
    float kf[HD];
#if E4M3
    for (int d = 0; d < HD; d++) kf[d] = e4m3_to_f32(krow[d]);
#else
    for (int d = 0; d < HD; d++) kf[d] = bf16_to_f32(((const bf16_t *)krow)[d]);
#endif
    for (int r = 0; r < 16; r++) {
      if (jbase + kk >= Lr[r]) continue;
      const unsigned char *qrow = iq + ((i64)tok[r] * H + hd_[r]) * ROWB;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < HD; k += 8)
        for (int u = 0; u < 8; u++) {
#if E4M3
          const float q = e4m3_to_f32(qrow[k + u]);
#else
          const float q = bf16_to_f32(((const bf16_t *)qrow)[k + u]);
#endif
          acc[u] = __fadd_rn(acc[u], __fmul_rn(q, kf[k + u]));
        }
      const float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3])),
                                __fadd_rn(__fadd_rn(acc[4], acc[5]), __fadd_rn(acc[6], acc[7])));
      mr[r] = fmax_nan(mr[r], s);
    }
  }
  for (int r = 0; r < 16; r++) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mr[r] = fmax_nan(mr[r], __shfl_xor_sync(FULL, mr[r], o));
  }
  ma = mr[g];
  mb = mr[g + 8];
}

extern "C" __global__ void __launch_bounds__(NW * 32)
$sym(const unsigned char *__restrict__ iq,     /* [n_tokens, H, HD] bf16 | e4m3, 16-byte aligned */
     const unsigned char *__restrict__ cache,  /* [num_pages * BS, HD] */
     i64 num_pages,
     const int *__restrict__ block_table, i64 bt_stride,
     int n_seqs, const int *__restrict__ token_seq, const i64 *__restrict__ positions,
     float *__restrict__ scores,               /* [H, n_tokens, max_blocks] */
     int n_tokens, int max_blocks) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const int b = (int)blockIdx.x;
  const int t0 = ((int)blockIdx.y * NW + w) * TPT;
  pdl_wait();
  if (t0 >= n_tokens) return; /* whole warp; this kernel has no block barrier */
  const int seq = token_seq[t0];
  if (seq < 0 || seq >= n_seqs) return;
  const int ta = t0 + g / H, tb = t0 + (g + 8) / H, ha = g % H, hb = (g + 8) % H;
  const i64 La = vis_len(ta, n_tokens, seq, n_seqs, token_seq, positions, bt_stride, max_blocks);
  const i64 Lb = vis_len(tb, n_tokens, seq, n_seqs, token_seq, positions, bt_stride, max_blocks);
  i64 Lm = La > Lb ? La : Lb;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const i64 x = __shfl_xor_sync(FULL, Lm, o);
    Lm = x > Lm ? x : Lm;
  }
  const i64 jbase = (i64)b * BS;
  if (jbase >= Lm) return; /* block b is visible to none of the warp's rows: its table entry is not read */
  const int page = block_table[(i64)seq * bt_stride + b];
  const int page_ok = page >= 0 && (i64)page < num_pages;

  /* The query rows as A fragments: afr[s] = {a0, a1, a2, a3} of k-step s. */
  unsigned afr[8][4];
  unsigned qnf = 0;
  {
    const int okA = ta < n_tokens, okB = tb < n_tokens;
    const unsigned char *qa = iq + ((i64)(okA ? ta : 0) * H + ha) * ROWB + 16 * tq;
    const unsigned char *qb = iq + ((i64)(okB ? tb : 0) * H + hb) * ROWB + 16 * tq;
#pragma unroll
    for (int j = 0; j < CPR; j++) {
      uint4 va = okA ? *(const uint4 *)(qa + 64 * j) : make_uint4(0u, 0u, 0u, 0u);
      uint4 vb = okB ? *(const uint4 *)(qb + 64 * j) : make_uint4(0u, 0u, 0u, 0u);
      qnf = nf_acc4(nf_acc4(qnf, va), vb);
      unsigned ra[8], rb[8];
      chunk_regs(va, ra);
      chunk_regs(vb, rb);
#pragma unroll
      for (int q = 0; q < KSTEPS_PER_CHUNK; q++) {
        const int s = KSTEPS_PER_CHUNK * j + q;
        afr[s][0] = ra[2 * q], afr[s][1] = rb[2 * q], afr[s][2] = ra[2 * q + 1], afr[s][3] = rb[2 * q + 1];
      }
    }
  }
  const int qbad = __any_sync(FULL, (qnf & NF_MASK) != 0u);

  float ma = f_ninf(), mb = f_ninf();
  unsigned knf = 0;
  const unsigned char *keys = cache + (page_ok ? (i64)page * BS : 0) * (i64)ROWB;
  if (page_ok) {
    uint4 cur[CPR], nxt[CPR];
    const unsigned char *p = keys + (i64)g * ROWB + 16 * tq;
#pragma unroll
    for (int j = 0; j < CPR; j++) cur[j] = *(const uint4 *)(p + 64 * j);
    for (int nt = 0; nt < BS / 8; nt++) {
      if (nt + 1 < BS / 8) {
#pragma unroll
        for (int j = 0; j < CPR; j++) nxt[j] = *(const uint4 *)(p + (i64)(nt + 1) * 8 * ROWB + 64 * j);
      }
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < CPR; j++) {
        knf = nf_acc4(knf, cur[j]);
        unsigned rk[8];
        chunk_regs(cur[j], rk);
#pragma unroll
        for (int q = 0; q < KSTEPS_PER_CHUNK; q++) {
          const int s = KSTEPS_PER_CHUNK * j + q;
          mma16816(c, afr[s][0], afr[s][1], afr[s][2], afr[s][3], rk[2 * q], rk[2 * q + 1]);
        }
      }
#if E4M3
      c[0] *= E4M3_PROD_SCALE, c[1] *= E4M3_PROD_SCALE, c[2] *= E4M3_PROD_SCALE, c[3] *= E4M3_PROD_SCALE;
#endif
      const i64 j0 = jbase + nt * 8 + 2 * tq; /* keys of c[0]/c[2] and (j0 + 1) of c[1]/c[3] */
      if (j0 >= La) c[0] = f_ninf();
      if (j0 + 1 >= La) c[1] = f_ninf();
      if (j0 >= Lb) c[2] = f_ninf();
      if (j0 + 1 >= Lb) c[3] = f_ninf();
      ma = fmax_nan(ma, fmax_nan(c[0], c[1]));
      mb = fmax_nan(mb, fmax_nan(c[2], c[3]));
#pragma unroll
      for (int j = 0; j < CPR; j++) cur[j] = nxt[j];
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      ma = fmax_nan(ma, __shfl_xor_sync(FULL, ma, o));
      mb = fmax_nan(mb, __shfl_xor_sync(FULL, mb, o));
    }
  }
  const int kbad = __any_sync(FULL, (knf & NF_MASK) != 0u);
  if (!page_ok) {
    ma = mb = __uint_as_float(0x7fc00000u); /* a table entry outside the cache: poisoned (NaN -> -1e30 at top-k) */
  } else if (qbad | kbad) {
    int tok[16], hh[16];
    i64 Lr[16];
    for (int r = 0; r < 16; r++) {
      const int tr = t0 + r / H;
      tok[r] = tr < n_tokens ? tr : 0;
      hh[r] = r % H;
      Lr[r] = vis_len(tr, n_tokens, seq, n_seqs, token_seq, positions, bt_stride, max_blocks);
    }
    slow_block(iq, keys, jbase, tok, hh, Lr, ma, mb);
  }
  if (tq == 0) {
    if (jbase < La) scores[((i64)ha * n_tokens + ta) * max_blocks + b] = ma;
    if (jbase < Lb) scores[((i64)hb * n_tokens + tb) * max_blocks + b] = mb;
  }
}
]]

local topk_body = [[
extern "C" __global__ void __launch_bounds__(NW * 32)
$sym(const float *__restrict__ scores,         /* [H, n_tokens, max_blocks], raw */
     i64 bt_stride, int n_seqs, const int *__restrict__ token_seq, const i64 *__restrict__ positions,
     int *__restrict__ out,                    /* [H, n_tokens, TOPK] */
     int n_tokens, int max_blocks) {
  M3_GRID_WAIT(); /* before any global access (lib/prelude.lua) */
  __shared__ u64 s_keys[NW][CAP];
  __shared__ int s_out[NW][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const i64 row = (i64)blockIdx.x * NW + w;
  pdl_wait();
  if (row >= (i64)H * n_tokens) return; /* whole warp; no block barrier */
  const int t = (int)(row % n_tokens);
  const i64 L = vis_len(t, n_tokens, -1, n_seqs, token_seq, positions, bt_stride, max_blocks);
  const int nb = (int)((L + BS - 1) / BS);
  const float *sc = scores + row * max_blocks;
  /* Forced blocks are not read (the score kernel may leave them anything). */
  auto key_of = [&](int b) -> u64 {
    const int forced = b < INIT || b >= nb - LOCAL;
    return make_key(force_block(forced ? 0.0f : sc[b], b, nb, INIT, LOCAL), b);
  };
  u64 mx = 0ull;
  for (int b = lane; b < nb; b += 32) {
    const u64 k = key_of(b);
    mx = k > mx ? k : mx;
  }
  const u64 thr = warp_kth_largest(mx, TOPK);
  int cnt = 0;
  for (int base = 0; base < nb; base += 32) {
    const int b = base + lane;
    const u64 k = b < nb ? key_of(b) : 0ull;
    const int take = k != 0ull && k >= thr;
    const unsigned m = __ballot_sync(FULL, take);
    if (take) {
      const int at = cnt + __popc(m & ((1u << lane) - 1u));
      if (at < CAP) s_keys[w][at] = k;
    }
    cnt += __popc(m);
  }
  __syncwarp();
  if (cnt <= CAP) {
    warp_rank_top(s_keys[w], cnt, TOPK, s_out[w]);
  } else { /* degenerate (mass ties): exact selection, one rank per pass */
    u64 prev = ~0ull;
    for (int r = 0; r < TOPK; r++) {
      u64 best = 0ull;
      for (int b = lane; b < nb; b += 32) {
        const u64 k = key_of(b);
        if (k < prev && k > best) best = k;
      }
      best = warp_max64(best);
      if (lane == 0) s_out[w][r] = best ? key_id(best) : -1;
      prev = best;
    }
    __syncwarp();
  }
  if (lane < TOPK) out[row * TOPK + lane] = s_out[w][lane];
}
]]

function T.render(k, t, arch, sym)
  local e4 = k.idxk == "e4m3"
  local v = {
    heads = k.heads, bs = k.bs, topk = k.topk, init = k.init, ["local"] = k["local"],
    e4m3 = e4 and 1 or 0, warps = t.warps, sym = sym,
  }
  local body = common .. (k.stage == "score" and score_body or topk_body)
  local src = body:gsub("%$([%w_]+)", function(n)
    if v[n] == nil then error("index_prefill: no value for $" .. n) end
    return tostring(v[n])
  end)
  local lib = I.common
  if k.stage == "score" then lib = lib .. I.mma(e4 and "f16" or "bf16") .. (e4 and I.e4m3_decode("alu") or "") end
  return {source = P.all(arch) .. lib .. src, threads = t.warps * 32, smem = 0}
end

return T
