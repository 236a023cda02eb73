-- templates/lib/route.lua - the MoE router's top-k selection of one token
-- (spec §7.2, m3_ref_route bit for bit): pasted by moe_route.lua's route and
-- fused stages and by the fp32 router GEMV's route epilogue (mxfp8.lua
-- route_e > 0), so that both select exactly alike; its order (beats) also by
-- sample.lua's greedy choice, the references' same scan.  The includer defines E,
-- K, EPL, RENORM, LOGITS_BF16 and FULL and pastes lib/ffn's base first.
local R = {}

R.beats = [==[
/* The references' order on (value, id): id < 0 is "nothing" and loses; a
 * number beats NaN; a larger value wins; equal values (two NaNs included) go
 * to the lower id.  Total on distinct ids, so a butterfly reduction returns
 * the same winner on every lane whatever the order of combination. */
M3_DEV bool beats(float a, int ia, float b, int ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  const bool na = a != a, nb = b != b;
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

]==]

R.route_token = [==[
/* One token, one warp: lane l holds experts l, l+32, ... */
M3_DEV void route_token(long long t, const void *logits, const float *bias, int *ids, float *w,
                        float scaling, int lane) {
  float s[EPL], c[EPL];
  u32 free_mask = 0;
#pragma unroll
  for (int i = 0; i < EPL; i++) {
    const int j = lane + 32 * i;
    s[i] = 0.0f;
    c[i] = 0.0f;
    if (j < E) {
      const long long at = t * E + j;
      const float l = LOGITS_BF16 ? bf16_to_f32(((const bf16_t *)logits)[at]) : ((const float *)logits)[at];
      s[i] = sigmoid_ref(l);
      c[i] = fadd_rn(s[i], bias ? bias[j] : 0.0f);   /* for choosing only */
      free_mask |= 1u << i;
    }
  }
  int ik[K];
  float wk[K];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; k++) {
    float bv = 0.0f, bs = 0.0f;
    int bi = -1;
#pragma unroll
    for (int i = 0; i < EPL; i++)
      if (((free_mask >> i) & 1u) && beats(c[i], lane + 32 * i, bv, bi)) {
        bv = c[i];
        bs = s[i];
        bi = lane + 32 * i;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(FULL, bv, o), os = __shfl_xor_sync(FULL, bs, o);
      const int oi = __shfl_xor_sync(FULL, bi, o);
      if (beats(ov, oi, bv, bi)) {
        bv = ov;
        bs = os;
        bi = oi;
      }
    }
    /* K <= E, so a free expert always exists: bi >= 0 on every lane. */
#pragma unroll
    for (int i = 0; i < EPL; i++)
      if (lane + 32 * i == bi) free_mask &= ~(1u << i);
    ik[k] = bi;
    wk[k] = bs;                      /* the unbiased score, kept (fault 20) */
    sum = fadd_rn(sum, bs);        /* top-k order, as the reference */
  }
#pragma unroll
  for (int k = 0; k < K; k++)
    if (lane == k) {
      ids[t * K + k] = ik[k];
      w[t * K + k] = RENORM ? fmul_rn(fdiv_rn(wk[k], sum), scaling) : fmul_rn(wk[k], scaling);
    }
}
]==]

return R
