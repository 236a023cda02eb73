/* op_util.c - shared pieces of the tuner adapters (see op_util.h). */
#include "autotune/op_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/check.h"

int m3_tune_sets(size_t per_set) {
  if (!per_set) return 1;
  size_t n = (M3_TUNE_ROT_BYTES + per_set - 1) / per_set;
  return n < 1 ? 1 : n > M3_TUNE_MAX_SETS ? M3_TUNE_MAX_SETS : (int)n;
}

int m3_tune_bucket_list(const char *const names[2], const int64_t (*vals)[2], int n, m3_bucket *out, int max) {
  int k = 0;
  for (int i = 0; i < n && k < max; i++, k++) {
    memset(&out[k], 0, sizeof out[k]);
    m3_bucket_add(&out[k], names[0], vals[i][0], NULL);
    if (names[1]) m3_bucket_add(&out[k], names[1], vals[i][1], NULL);
  }
  return k;
}

const int64_t m3_tune_steps[M3_TUNE_N_STEPS] = {1, 8, 256, 4096};

int64_t m3_tune_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

int m3_tune_rows_buckets(const int64_t *rows, int n, m3_bucket *out, int max) {
  int64_t v[64];
  int k = 0;
  for (int i = 0; i < n && k < 64; i++) {
    const int64_t p = m3_tune_pow2(rows[i]);
    int j = 0;
    while (j < k && v[j] != p) j++;
    if (j == k) v[k++] = p;
  }
  for (int i = 1; i < k; i++) /* insertion sort: a handful of values */
    for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
      const int64_t t = v[j];
      v[j] = v[j - 1], v[j - 1] = t;
    }
  static const char *const names[2] = {"tokens", NULL};
  int64_t vals[64][2];
  for (int i = 0; i < k; i++) vals[i][0] = v[i], vals[i][1] = 0;
  return m3_tune_bucket_list(names, (const int64_t(*)[2])vals, k, out, max);
}

/* Bytes [0, set_bytes) of base copied to set_bytes * r for r in [1, sets). */
static m3_status replicate(void *base, size_t set_bytes, int sets, cudaStream_t stream, m3_err *e) {
  for (int r = 1; r < sets; r++)
    M3_CUDA(e, cudaMemcpyAsync((char *)base + (size_t)r * set_bytes, base, set_bytes, cudaMemcpyDeviceToDevice, stream));
  return M3_OK;
}

m3_status m3_tune_upload_sets(void **dev, const void *host, size_t set_bytes, int sets, cudaStream_t stream,
                              m3_err *e) {
  M3_TRY(m3_dev_alloc(dev, set_bytes * (size_t)sets, e));
  M3_TRY(m3_dev_upload(*dev, host, set_bytes, e));
  return replicate(*dev, set_bytes, sets, stream, e);
}

static m3_status upload_new(void **d, const void *h, size_t bytes, m3_err *e) {
  M3_TRY(m3_dev_alloc(d, bytes, e));
  return m3_dev_upload(*d, h, bytes, e);
}

m3_status m3_tune_batch_make(m3_tune_batch *p, int n_seqs, const int64_t *lens, const int *qlen, int bs, int64_t cap,
                             int sets, m3_rng *r, m3_err *e) {
  memset(p, 0, sizeof *p);
  p->n_seqs = n_seqs, p->bs = bs, p->sets = sets;
  for (int s = 0; s < n_seqs; s++) {
    const int64_t nb = (lens[s] + bs - 1) / bs;
    p->n_tokens += qlen ? qlen[s] : 1;
    p->pages += cap > 0 && nb > cap ? cap : nb;
    if (nb > p->bt_stride) p->bt_stride = nb;
    if (lens[s] > p->max_kv) p->max_kv = lens[s];
  }
  p->max_blocks = p->bt_stride;
  p->seq_lens = malloc(sizeof *p->seq_lens * (size_t)n_seqs);
  p->token_seq = malloc(sizeof *p->token_seq * (size_t)p->n_tokens);
  p->pos = malloc(sizeof *p->pos * (size_t)p->n_tokens);
  p->bt = malloc(sizeof *p->bt * (size_t)(sets * n_seqs * p->bt_stride));
  int64_t *perm = malloc(sizeof *perm * (size_t)p->pages);
  if (!p->seq_lens || !p->token_seq || !p->pos || !p->bt || !perm) {
    free(perm);
    return m3_errf(e, M3_NOMEM, "tune: batch tables");
  }
  for (int64_t i = 0; i < p->pages; i++) perm[i] = i;
  for (int64_t i = p->pages - 1; i > 0; i--) {
    int64_t j = (int64_t)(m3_rng_next(r) % (uint64_t)(i + 1)), x = perm[i];
    perm[i] = perm[j], perm[j] = x;
  }
  int64_t used = 0;
  int t = 0;
  for (int s = 0; s < n_seqs; s++) {
    const int64_t nb = (lens[s] + bs - 1) / bs, own = cap > 0 && nb > cap ? cap : nb;
    p->seq_lens[s] = (int32_t)lens[s];
    for (int64_t b = 0; b < p->bt_stride; b++) {
      const int32_t pg = b < nb ? (int32_t)perm[used + b % own] : -1;
      for (int q = 0; q < sets; q++)
        p->bt[((int64_t)q * n_seqs + s) * p->bt_stride + b] = pg < 0 ? -1 : (int32_t)(pg + q * p->pages);
    }
    used += own;
    const int nq = qlen ? qlen[s] : 1;
    for (int i = 0; i < nq; i++, t++) {
      p->token_seq[t] = s;
      p->pos[t] = lens[s] - nq + i;
      p->visible += p->pos[t] + 1;
    }
  }
  free(perm);
  M3_TRY(upload_new(&p->d_lens, p->seq_lens, sizeof *p->seq_lens * (size_t)n_seqs, e));
  M3_TRY(upload_new(&p->d_seq, p->token_seq, sizeof *p->token_seq * (size_t)p->n_tokens, e));
  M3_TRY(upload_new(&p->d_pos, p->pos, sizeof *p->pos * (size_t)p->n_tokens, e));
  return upload_new(&p->d_bt, p->bt, sizeof *p->bt * (size_t)(sets * n_seqs * p->bt_stride), e);
}

m3_seq_batch m3_tune_batch_host(const m3_tune_batch *p) {
  return (m3_seq_batch){p->n_seqs, p->seq_lens, p->bt, p->bt_stride, p->pages, p->token_seq, p->pos};
}

m3_seq_batch m3_tune_batch_dev(const m3_tune_batch *p, int set) {
  return (m3_seq_batch){p->n_seqs, p->d_lens, (const int32_t *)p->d_bt + (int64_t)set * p->n_seqs * p->bt_stride,
                        p->bt_stride, p->pages * p->sets, p->d_seq, p->d_pos};
}

void m3_tune_batch_free(m3_tune_batch *p) {
  m3_dev_free(p->d_lens); m3_dev_free(p->d_seq); m3_dev_free(p->d_pos); m3_dev_free(p->d_bt);
  free(p->seq_lens); free(p->token_seq); free(p->pos); free(p->bt);
  memset(p, 0, sizeof *p);
}

m3_status m3_tune_sample_make(m3_tune_sample *s, const m3_tune_batch *p, int max, m3_err *e) {
  memset(s, 0, sizeof *s);
  s->n = p->n_tokens < max ? p->n_tokens : max;
  s->tok = malloc(sizeof *s->tok * (size_t)s->n);
  s->seq = malloc(sizeof *s->seq * (size_t)s->n);
  s->pos = malloc(sizeof *s->pos * (size_t)s->n);
  if (!s->tok || !s->seq || !s->pos) return m3_errf(e, M3_NOMEM, "tune: token sample");
  for (int i = 0; i < s->n; i++) {
    const int t = s->n == 1 ? p->n_tokens - 1 : (int)((int64_t)i * (p->n_tokens - 1) / (s->n - 1));
    s->tok[i] = t, s->seq[i] = p->token_seq[t], s->pos[i] = p->pos[t];
  }
  return M3_OK;
}

m3_seq_batch m3_tune_sample_batch(const m3_tune_sample *s, const m3_tune_batch *p) {
  m3_seq_batch b = m3_tune_batch_host(p);
  b.token_seq = s->seq, b.positions = s->pos;
  return b;
}

void m3_tune_sample_rows(const m3_tune_sample *s, const void *src, size_t row_bytes, void *dst) {
  for (int i = 0; i < s->n; i++)
    memcpy((char *)dst + (size_t)i * row_bytes, (const char *)src + (size_t)s->tok[i] * row_bytes, row_bytes);
}

void m3_tune_sample_free(m3_tune_sample *s) {
  free(s->tok); free(s->seq); free(s->pos);
  memset(s, 0, sizeof *s);
}

int m3_tune_topk_row_ok(const int32_t *gpu, const int32_t *ref, const float *sc, int k, int64_t nb, int *swaps,
                        char *detail, size_t n) {
  const int kk = nb < k ? (int)nb : k;
  for (int i = 0; i < k; i++) {
    if (i >= kk) {
      if (gpu[i] != -1) return snprintf(detail, n, "slot %d of %d visible blocks: %d, want -1", i, (int)nb, gpu[i]), 0;
      continue;
    }
    if (gpu[i] < 0 || gpu[i] >= nb) return snprintf(detail, n, "slot %d: block %d outside [0, %d)", i, gpu[i], (int)nb), 0;
    for (int j = 0; j < i; j++)
      if (gpu[j] == gpu[i]) return snprintf(detail, n, "block %d selected twice", gpu[i]), 0;
    if (gpu[i] == ref[i]) continue;
    const double a = sc[gpu[i]], b = sc[ref[i]], d = fabs(a - b), m = fmax(fabs(a), fabs(b));
    if (a == b || !(d <= 1e-5 * m))
      return snprintf(detail, n, "slot %d: block %d (score %.9g), reference %d (%.9g)", i, gpu[i], a, ref[i], b), 0;
    (*swaps)++;
  }
  return 1;
}

void m3_tune_fill_finite(m3_rng *r, void *p, size_t bytes) {
  uint8_t *b = p;
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const uint64_t v = m3_rng_next(r);
    uint8_t lo = (uint8_t)v;
    if ((lo & 0x7f) == 0x7f) lo ^= 1;
    b[i] = lo;
    b[i + 1] = (uint8_t)(((v >> 8) & 0x80) | (0x3c + ((v >> 16) & 3)));
  }
  if (bytes & 1) b[bytes - 1] = 0x38;
}

m3_status m3_tune_flush_if_small(int sets, size_t per_set, cudaStream_t stream, m3_err *e) {
  return (size_t)sets * per_set < M3_TUNE_ROT_BYTES ? m3_l2_flush(stream, e) : M3_OK;
}

m3_status m3_tune_poison_ids(void *p, size_t bytes, cudaStream_t stream, m3_err *e) {
  M3_CUDA(e, cudaMemsetAsync(p, 0x7e, bytes, stream));
  return M3_OK;
}

m3_status m3_tune_expect_same(const void *dev, const void *ref, size_t bytes, size_t elem_bytes, const char *what,
                              char *detail, size_t n, m3_err *e) {
  uint8_t *g = malloc(bytes ? bytes : 1);
  if (!g) return m3_errf(e, M3_NOMEM, "verify: %zu bytes of %s", bytes, what);
  m3_status st = m3_dev_download(g, dev, bytes, e);
  if (!st && memcmp(g, ref, bytes)) {
    const uint8_t *r = ref;
    size_t i = 0;
    while (g[i] == r[i]) i++;
    i -= i % elem_bytes;
    uint64_t a = 0, b = 0;
    memcpy(&a, g + i, elem_bytes);
    memcpy(&b, r + i, elem_bytes);
    snprintf(detail, n, "%s: element %zu of %zu differs (got 0x%0*llx, want 0x%0*llx)", what, i / elem_bytes,
             bytes / elem_bytes, (int)(2 * elem_bytes), (unsigned long long)a, (int)(2 * elem_bytes),
             (unsigned long long)b);
    st = M3_MISMATCH;
  }
  free(g);
  return st;
}
