/* cases_insert.c - what fusing the KV insert into qk-norm + RoPE is worth
 * (see cases_insert.h).  Bytes counted per layer: read q,k,v rows (bf16),
 * write q,k back (bf16), write K,V into the cache (bf16 or e4m3); the unfused
 * path moves k,v once more (write then read) and pays a second launch. */
#include "bench/cases_insert.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/bench.h"
#include "runtime/harness.h"
#include "runtime/ops.h"

#define NQ 64
#define NKV 4
#define HD 128
#define BS 128
#define MAXPOS 4096
#define MAXR 57
#define POOL ((size_t)1 << 30)     /* rotating sets: > 2x L2 at every T */

typedef struct iset {
  void *qkv, *pos, *slot, *kv;
} iset;

typedef struct ibench {
  m3_qkr_args fused, plain, ins;
  m3_kernel *kf, *kp, *ki;
  iset s[MAXR];
  int R;
  const void *w, *tab;
  cudaStream_t st;
} ibench;

static m3_status run_fused(void *p, int i, m3_err *e) {
  ibench *b = p;
  iset *s = &b->s[i % b->R];
  const m3_bf16 *w = b->w;
  return m3_launch_qknorm_rope(b->kf, &b->fused, s->qkv, w, w + HD, NULL, NULL, b->tab, MAXPOS, s->pos, s->slot, NULL,
                               s->kv, NULL, NULL, NULL, b->st, e);
}
static m3_status run_plain(void *p, int i, m3_err *e) {
  ibench *b = p;
  iset *s = &b->s[i % b->R];
  const m3_bf16 *w = b->w;
  return m3_launch_qknorm_rope(b->kp, &b->plain, s->qkv, w, w + HD, NULL, NULL, b->tab, MAXPOS, s->pos, NULL, NULL,
                               NULL, NULL, NULL, NULL, b->st, e);
}
static m3_status run_insert(void *p, int i, m3_err *e) {
  ibench *b = p;
  iset *s = &b->s[i % b->R];
  return m3_launch_kv_insert(b->ki, &b->ins, s->qkv, s->slot, s->kv, b->st, e);
}
static m3_status run_unfused(void *p, int i, m3_err *e) {
  M3_TRY(run_plain(p, i, e));
  return run_insert(p, i, e);
}

static void free_sets(ibench *b) {
  for (int r = 0; r < b->R; r++) {
    m3_dev_free(b->s[r].qkv);
    m3_dev_free(b->s[r].pos);
    m3_dev_free(b->s[r].slot);
    m3_dev_free(b->s[r].kv);
  }
  b->R = 0;
}

static m3_status make_sets(ibench *b, int N, int kv8, m3_err *e) {
  const size_t row = (size_t)(NQ + 2 * NKV) * HD, qb = sizeof(m3_bf16) * N * row;
  const int64_t pages = (N + BS - 1) / BS;
  const size_t kvb = (size_t)pages * NKV * BS * 2 * HD * (kv8 ? 1 : 2), per = qb + kvb;
  int R = (int)(POOL / per);
  b->R = 0;
  if (R > MAXR) R = MAXR;
  if (R < 1) R = 1;
  m3_rng r = {0x1b5e47ull ^ (uint64_t)N};
  m3_bf16 *q = malloc(qb);
  int64_t *pos = malloc(sizeof *pos * N), *slot = malloc(sizeof *slot * N);
  if (!q || !pos || !slot) {
    free(q), free(pos), free(slot);
    return m3_errf(e, M3_NOMEM, "insert bench inputs");
  }
  m3_status s = M3_OK;
  /* One random set uploaded into every rotation: the bytes moved, not
   * their values, set the time, and a host fill per set would take longer
   * than the measurement. */
  m3_fill_bf16(&r, q, (size_t)N * row, 1.0f);
  for (int t = 0; t < N; t++) pos[t] = (int64_t)(m3_rng_next(&r) % MAXPOS), slot[t] = t;
  for (int i = 0; i < R && s == M3_OK; i++) {
    iset *z = &b->s[i];
    memset(z, 0, sizeof *z);
    b->R = i + 1;
    if ((s = m3_dev_alloc(&z->qkv, qb, e)) || (s = m3_dev_alloc(&z->pos, sizeof *pos * N, e)) ||
        (s = m3_dev_alloc(&z->slot, sizeof *slot * N, e)) || (s = m3_dev_alloc(&z->kv, kvb, e)) ||
        (s = m3_dev_upload(z->qkv, q, qb, e)) || (s = m3_dev_upload(z->pos, pos, sizeof *pos * N, e)) ||
        (s = m3_dev_upload(z->slot, slot, sizeof *slot * N, e)))
      break;
  }
  free(q), free(pos), free(slot);
  return s;
}

m3_status m3_bench_insert(m3_rt *rt, double copy_gbs, FILE *out, m3_err *e) {
  static const int Ts[] = {1, 4, 16, 64, 256, 1024, 8192};
  ibench b = {.st = rt->stream};
  void *w = NULL, *tab = NULL;
  m3_bf16 hw[2 * HD], *ht = malloc(sizeof *ht * MAXPOS * 64);
  if (!ht) return m3_errf(e, M3_NOMEM, "rope table");
  m3_rng r = {7};
  m3_fill_bf16(&r, hw, 2 * HD, 0.2f);
  m3_rope_table(5e6f, 64, MAXPOS, ht);
  m3_status s = M3_OK;
  if ((s = m3_dev_alloc(&w, sizeof hw, e)) || (s = m3_dev_upload(w, hw, sizeof hw, e)) ||
      (s = m3_dev_alloc(&tab, sizeof *ht * MAXPOS * 64, e)) || (s = m3_dev_upload(tab, ht, sizeof *ht * MAXPOS * 64, e)))
    goto done;
  b.w = w, b.tab = tab;
  fprintf(out, "\n## KV insert on dense layers: fused into qk-norm + RoPE, or a separate kernel\n\n"
               "Per-layer time as a CUDA graph over R rotating layer buffers (median of 30 replays, p20-p80 in "
               "brackets). Bytes: q,k,v read + q,k written (bf16) + K,V cache writes.\n\n"
               "| KV | tokens | R | fused us | norm+RoPE us | kv_insert us | unfused us | unfused - fused us | fused GB/s | %% of copy |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n");
  double diff1[2] = {NAN, NAN};
  for (int kv8 = 0; kv8 < 2 && s == M3_OK; kv8++)
    for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts && s == M3_OK; ti++) {
      const int N = Ts[ti];
      char nm[64]; /* M3KIT_BENCH_CASE matches "insert KV tokens=N" */
      snprintf(nm, sizeof nm, "insert %s tokens=%d", kv8 ? "e4m3" : "bf16", N);
      if (!m3_bench_case_wanted(nm)) continue;
      m3_qkr_args a = {.n_tokens = N, .nq = NQ, .nkv = NKV, .niq = 0, .head_dim = HD, .rotary_dim = 64,
                       .block_size = BS, .eps = 1e-6f, .insert = 1, .kv_e4m3 = kv8};
      b.fused = a, b.ins = a, b.plain = a;
      b.plain.insert = 0, b.plain.kv_e4m3 = 0;
      m3_variant vf, vp, vi;
      if ((s = m3_qknorm_key(&b.fused, &vf, e)) || (s = m3_qknorm_key(&b.plain, &vp, e)) ||
          (s = m3_kv_insert_key(&b.ins, &vi, e)) || (s = m3_rt_kernel(rt, &vf, NULL, &b.kf, e)) ||
          (s = m3_rt_kernel(rt, &vp, NULL, &b.kp, e)) || (s = m3_rt_kernel(rt, &vi, NULL, &b.ki, e)))
        break;
      if ((s = make_sets(&b, N, kv8, e))) break;
      m3_timing tf, tp, tk, tu;
      const int R = b.R;
      if (!(s = m3_time_graph(run_fused, &b, R, R, rt->stream, 30, &tf, e)) &&
          !(s = m3_time_graph(run_plain, &b, R, R, rt->stream, 30, &tp, e)) &&
          !(s = m3_time_graph(run_insert, &b, R, R, rt->stream, 30, &tk, e)) &&
          !(s = m3_time_graph(run_unfused, &b, R, R, rt->stream, 30, &tu, e))) {
        double bytes = (double)N * HD * 2 * ((NQ + 2 * NKV) + (NQ + NKV)) + (double)N * HD * 2 * NKV * (kv8 ? 1 : 2);
        double gbs = bytes / (tf.median_us * 1e-6) / 1e9;
        fprintf(out, "| %s | %d | %d | %.2f [%.2f-%.2f] | %.2f | %.2f | %.2f [%.2f-%.2f] | %+.2f | %.0f | %.1f%% |\n",
                kv8 ? "e4m3" : "bf16", N, R, tf.median_us, tf.p20_us, tf.p80_us, tp.median_us, tk.median_us,
                tu.median_us, tu.p20_us, tu.p80_us, tu.median_us - tf.median_us, gbs, 100 * gbs / copy_gbs);
        fflush(out);
        if (N == 1) diff1[kv8] = tu.median_us - tf.median_us;
      }
      free_sets(&b);
    }
  if (s == M3_OK)
    for (int kv8 = 0; kv8 < 2; kv8++)
      if (!isnan(diff1[kv8])) /* its 1-token case ran */
        fprintf(out, "\nKV %s, batch-1 decode step: the fusion saves %.2f us per dense layer, %.1f us per step over "
                   "minimax-m3's 3 dense layers (%.1f us if all 60 layers' K/V inserts were unfused).\n",
              kv8 ? "e4m3" : "bf16", diff1[kv8], 3 * diff1[kv8], 60 * diff1[kv8]);
done:
  free_sets(&b);
  m3_dev_free(w);
  m3_dev_free(tab);
  free(ht);
  return s;
}
