/* ref_moe.c - the FFN side (§7, §10.9): SwiGLU-OAI, the fp32 sigmoid router
 * with bias-for-choice-only, the SwiGLU-OAI MLP (routed expert, shared expert,
 * dense MLP), the MoE combine and the token -> expert grouping.
 *
 * The MoE layer works on chunks of MOE_TILE tokens grouped by expert, so each
 * expert's weights are decoded once per chunk instead of once per token, while
 * the combine still runs per token in top-k order (the order fixes the fp32
 * sum).  Scratch is bounded by MOE_TILE, not by the number of tokens. */
#include "ref/ref.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MOE_TILE 32

float m3_swiglu_oai_f32(float gate, float up, float alpha, float limit,
                        float beta) {
  float g = gate > limit ? limit : gate;                        /* upper only */
  float u = up > limit ? limit : (up < -limit ? -limit : up);   /* both sides */
  return g * (1.0f / (1.0f + expf(-alpha * g))) * (u + beta);
}

void m3_ref_swiglu_oai(int64_t n, const m3_bf16 *gate, const m3_bf16 *up,
                       float alpha, float limit, float beta, m3_bf16 *out) {
  for (int64_t i = 0; i < n; i++)
    out[i] = m3_f32_to_bf16(m3_swiglu_oai_f32(m3_bf16_to_f32(gate[i]),
                                              m3_bf16_to_f32(up[i]), alpha,
                                              limit, beta));
}

/* a is better than b: a number beats NaN, then larger wins.  Equal values are
 * not "better", so a scan in ascending id keeps the lower id on ties. */
static int better(float x, float y) { return !isnan(x) && (isnan(y) || x > y); }

m3_status m3_ref_route(const m3_route_args *a, const void *logits,
                       const float *bias, int32_t *ids, float *w, m3_err *e) {
  if (!a || a->n_tokens < 0 || a->n_experts <= 0 || a->n_experts > 4096 ||
      a->topk < 1 || a->topk > a->n_experts)
    return m3_errf(e, M3_INVAL, "route: topk %d must be in [1, n_experts %d], "
                   "n_experts <= 4096", a ? a->topk : 0, a ? a->n_experts : 0);
  const int E = a->n_experts, K = a->topk;
  float s[4096], c[4096];
  unsigned char taken[4096];
  for (int64_t t = 0; t < a->n_tokens; t++) {
    for (int x = 0; x < E; x++) {
      float l = a->logits_bf16 ? m3_bf16_to_f32(((const m3_bf16 *)logits)[t * E + x])
                               : ((const float *)logits)[t * E + x];
      s[x] = 1.0f / (1.0f + expf(-l));
      c[x] = s[x] + (bias ? bias[x] : 0.0f); /* for choosing only */
      taken[x] = 0;
    }
    int32_t *id = ids + t * K;
    float *wt = w + t * K, sum = 0.0f;
    for (int k = 0; k < K; k++) {
      int best = -1; /* no sentinel value: the first free expert seeds it */
      for (int x = 0; x < E; x++)
        if (!taken[x] && (best < 0 || better(c[x], c[best]))) best = x;
      taken[best] = 1;
      id[k] = best;
      wt[k] = s[best]; /* the unbiased score, kept (fault 20) */
      sum += s[best];
    }
    for (int k = 0; k < K; k++)
      wt[k] = (a->renormalize ? wt[k] / sum : wt[k]) * a->routed_scaling;
  }
  return M3_OK;
}

/* m3_ref_dot_f32's order with the bf16 activation upcast on the fly, so any
 * hidden size works without a row buffer. */
static float dot_bf16_f32(const m3_bf16 *x, const float *w, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int u = 0; u < 8; u++) acc[u] += m3_bf16_to_f32(x[k + u]) * w[k + u];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
            ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; k++) s += m3_bf16_to_f32(x[k]) * w[k];
  return s;
}

void m3_ref_router_logits(int64_t n, int hidden, int n_experts,
                          const m3_bf16 *m, const float *wg, float *logits) {
  for (int64_t t = 0; t < n; t++)
    for (int x = 0; x < n_experts; x++)
      logits[t * n_experts + x] =
          dot_bf16_f32(m + t * hidden, wg + (int64_t)x * hidden, hidden);
}

m3_status m3_ref_mlp(int64_t n, const m3_bf16 *x, const m3_ref_weight *gate,
                     const m3_ref_weight *up, const m3_ref_weight *down,
                     float alpha, float limit, float beta, m3_bf16 *out,
                     m3_err *e) {
  if (!gate || !up || !down || gate->rows != up->rows ||
      gate->cols != up->cols || down->cols != gate->rows ||
      down->rows != gate->cols)
    return m3_errf(e, M3_INVAL, "mlp: gate/up must be [inter, hidden] and down "
                   "[hidden, inter]");
  const int64_t I = gate->rows, H = gate->cols;
  m3_bf16 *buf = malloc((size_t)3 * MOE_TILE * (size_t)I * sizeof *buf);
  if (!buf) return m3_errf(e, M3_NOMEM, "mlp: scratch for width %" PRId64, I);
  m3_bf16 *g = buf, *u = buf + (size_t)MOE_TILE * I, *act = u + (size_t)MOE_TILE * I;
  m3_status st = M3_OK;
  for (int64_t t0 = 0; t0 < n && st == M3_OK; t0 += MOE_TILE) {
    int64_t nt = n - t0 < MOE_TILE ? n - t0 : MOE_TILE;
    st = m3_ref_linear(nt, x + t0 * H, gate, g, e);
    if (st == M3_OK) st = m3_ref_linear(nt, x + t0 * H, up, u, e);
    if (st != M3_OK) break;
    m3_ref_swiglu_oai(nt * I, g, u, alpha, limit, beta, act);
    st = m3_ref_linear(nt, act, down, out + t0 * H, e);
  }
  free(buf);
  return st;
}

m3_status m3_ref_moe(const m3_moe_args *a, const m3_bf16 *m, const float *wg,
                     const float *bias, const m3_ref_weight *w1,
                     const m3_ref_weight *w3, const m3_ref_weight *w2,
                     const m3_ref_weight *shared_gate,
                     const m3_ref_weight *shared_up,
                     const m3_ref_weight *shared_down, m3_bf16 *out,
                     int32_t *ids, float *w, m3_err *e) {
  if (!a || a->n_tokens < 0 || a->hidden <= 0 || a->n_experts <= 0 ||
      a->topk < 1 || a->topk > a->n_experts || !w1 || !w3 || !w2)
    return m3_errf(e, M3_INVAL, "moe: bad arguments");
  const int H = a->hidden, E = a->n_experts, K = a->topk;
  for (int x = 0; x < E; x++)
    if (w1[x].cols != H || w2[x].rows != H)
      return m3_errf(e, M3_INVAL, "moe: expert %d weights do not match hidden %d", x, H);
  size_t nbf = (size_t)MOE_TILE * H * (2 + K + 1);
  size_t nfl = (size_t)MOE_TILE * (E + K);
  size_t nid = (size_t)MOE_TILE * (K + 1);
  char *mem = malloc(nbf * sizeof(m3_bf16) + nfl * sizeof(float) + nid * sizeof(int32_t));
  if (!mem) return m3_errf(e, M3_NOMEM, "moe: scratch");
  m3_bf16 *xg = (m3_bf16 *)mem, *yg = xg + (size_t)MOE_TILE * H;
  m3_bf16 *y = yg + (size_t)MOE_TILE * H;           /* [TILE, K, H] */
  m3_bf16 *sh = y + (size_t)MOE_TILE * K * H;       /* [TILE, H] */
  float *lg = (float *)(sh + (size_t)MOE_TILE * H); /* [TILE, E] */
  float *tw = lg + (size_t)MOE_TILE * E;            /* [TILE, K] */
  int32_t *tid = (int32_t *)(tw + (size_t)MOE_TILE * K), *who = tid + (size_t)MOE_TILE * K;
  m3_route_args ra = {0, E, K, a->renormalize, a->routed_scaling, 0};
  m3_status st = M3_OK;

  for (int64_t t0 = 0; t0 < a->n_tokens && st == M3_OK; t0 += MOE_TILE) {
    int nt = a->n_tokens - t0 < MOE_TILE ? (int)(a->n_tokens - t0) : MOE_TILE;
    const m3_bf16 *mc = m + t0 * H;
    m3_ref_router_logits(nt, H, E, mc, wg, lg);
    ra.n_tokens = nt;
    if ((st = m3_ref_route(&ra, lg, bias, tid, tw, e)) != M3_OK) break;
    for (int x = 0; x < E && st == M3_OK; x++) {
      int cnt = 0;
      for (int p = 0; p < nt * K; p++)
        if (tid[p] == x) {
          memcpy(xg + (size_t)cnt * H, mc + (int64_t)(p / K) * H, (size_t)H * sizeof *xg);
          who[cnt++] = p;
        }
      if (!cnt) continue;
      st = m3_ref_mlp(cnt, xg, &w1[x], &w3[x], &w2[x], a->alpha, a->limit,
                      a->beta, yg, e);
      for (int r = 0; r < cnt && st == M3_OK; r++)
        memcpy(y + (size_t)who[r] * H, yg + (size_t)r * H, (size_t)H * sizeof *y);
      if (st != M3_OK) m3_err_prefix(e, "moe expert %d: ", x);
    }
    if (st == M3_OK && shared_gate)
      st = m3_ref_mlp(nt, mc, shared_gate, shared_up, shared_down, a->alpha,
                      a->limit, a->beta, sh, e);
    if (st != M3_OK) break;
    for (int t = 0; t < nt; t++)
      for (int d = 0; d < H; d++) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++)
          acc += tw[t * K + k] * m3_bf16_to_f32(y[((size_t)t * K + k) * H + d]);
        if (shared_gate) acc += m3_bf16_to_f32(sh[(size_t)t * H + d]);
        out[(t0 + t) * H + d] = m3_f32_to_bf16(acc);
      }
    if (ids) memcpy(ids + t0 * K, tid, (size_t)nt * K * sizeof *ids);
    if (w) memcpy(w + t0 * K, tw, (size_t)nt * K * sizeof *w);
  }
  free(mem);
  return st;
}

m3_status m3_ref_moe_group(int64_t n_tokens, int topk, int n_experts,
                           const int32_t *ids, int32_t *counts,
                           int32_t *offsets, int32_t *perm, m3_err *e) {
  if (n_tokens < 0 || topk <= 0 || n_experts <= 0)
    return m3_errf(e, M3_INVAL, "moe group: bad arguments");
  const int64_t P = n_tokens * topk;
  memset(counts, 0, (size_t)n_experts * sizeof *counts);
  for (int64_t p = 0; p < P; p++) {
    if (ids[p] < 0 || ids[p] >= n_experts)
      return m3_errf(e, M3_RANGE, "moe group: token %" PRId64 " choice %" PRId64
                     " is expert %" PRId32 ", outside [0, %d)", p / topk,
                     p % topk, ids[p], n_experts);
    counts[ids[p]]++;
  }
  offsets[0] = 0;
  for (int x = 0; x < n_experts; x++) offsets[x + 1] = offsets[x] + counts[x];
  /* Stable placement: a second pass with a running cursor per expert, kept in
   * counts (restored afterwards) so no scratch is needed. */
  for (int x = 0; x < n_experts; x++) counts[x] = 0;
  for (int64_t p = 0; p < P; p++) {
    int32_t x = ids[p];
    perm[offsets[x] + counts[x]++] = (int32_t)p;
  }
  return M3_OK;
}
