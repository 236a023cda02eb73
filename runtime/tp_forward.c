/* tp_forward.c - the tensor-parallel driver (tp_forward.h): rank threads, a
 * command slot they all execute, and the checks that tie their answers
 * together.
 *
 * Protocol: the caller's thread writes a command into the group and bumps
 * cmd_gen under mu; every rank thread runs it and counts itself done; the
 * caller waits for all.  With the local backend a rank thread holds mu for
 * as long as it works (mu is the local collectives' "turn": a rank gives it
 * up only while it waits in a collective or for the next command), so CUDA
 * sees one thread at a time.  With NCCL the ranks release mu while they
 * work and run concurrently. */
#include "runtime/tp_forward.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/gpu.h"
#include "runtime/kernels.h"
#include "runtime/op_ffn.h"

enum { CMD_NONE, CMD_OPEN, CMD_PREFILL, CMD_DECODE, CMD_FILL, CMD_TIMING, CMD_QUIT };

typedef struct rank {
  struct m3_tp_group *g;
  int r, device;
  pthread_t th;
  int started;
  m3_rt rt;
  int rt_open;
  m3_model *m;
  m3_kv_cache kv;
  int kv_open;
  m3_forward *f;
  m3_tp_link link;
  m3_status st;                /* of the last command */
  m3_err err;
  int gave_up;                 /* the last command failed only because another rank did */
  int32_t *next;               /* [max_batch] its tokens of the last step */
  float *logits;               /* [max_batch, V] host (ranks > 0, when logits are asked for) */
  double load_s;
  int32_t *sel_cap, *sel_ovr;  /* m3_tp_debug_selection in the rank's layout [L][nkv_r][n][topk] */
  m3_fwd_op_time *tm;          /* CMD_TIMING: where this rank writes its table (max rows) */
  int *tm_n;
} rank;

struct m3_tp_group {
  m3_tp_opts o;
  int tp;
  pthread_mutex_t mu;
  pthread_cond_t cmd_cv, done_cv;
  uint64_t cmd_gen;
  int n_done;
  /* the command */
  int cmd, seq, n;
  const int *seqs;
  const int32_t *ids;
  const m3_sampling *smp;
  float *logits;               /* the caller's (rank 0 writes it) */
  int fill_n;                  /* CMD_FILL: tokens per sequence */
  uint64_t fill_seed;
  int tm_max;                  /* CMD_TIMING: rows per rank */
  /* backends */
  m3_tp_comm nccl;
  int nccl_init, nccl_aborted;
  m3_tp_local *local;
  int broken;
  char broken_why[256];
  m3_config whole;
  int32_t *dbg_cap;            /* m3_tp_debug_selection, whole layout */
  const int32_t *dbg_ovr;
  rank ranks[M3_TP_COMM_MAX];
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- what a rank does --------------------------------------------------- */

static m3_status rank_open(m3_tp_group *g, rank *k, m3_err *e) {
  const double t0 = now_s();
  M3_TRY(m3_rt_open(&k->rt, k->device, e));
  k->rt_open = 1;
  m3_model_opts mo = g->o.model;
  mo.tp = g->tp;
  mo.rank = k->r;
  M3_TRY(m3_model_load(&k->rt, &mo, &k->m, e));
  M3_TRY(m3_kv_init(&k->kv, &k->m->cfg, &g->o.kv, e)); /* the rank's KV heads (its config) */
  k->kv_open = 1;
  m3_fwd_opts fo = g->o.fwd;
  fo.tp = g->tp > 1 ? &k->link : NULL;
  M3_TRY(m3_forward_create(&k->rt, k->m, &k->kv, &fo, &k->f, e));
  const int B = fo.max_batch > 0 ? fo.max_batch : 1;
  k->next = calloc((size_t)B, sizeof *k->next);
  if (k->r > 0) k->logits = malloc(sizeof *k->logits * (size_t)B * (size_t)k->m->cfg.vocab_size);
  if (!k->next || (k->r > 0 && !k->logits)) return m3_errf(e, M3_NOMEM, "tensor parallel: rank buffers");
  k->load_s = now_s() - t0;
  return M3_OK;
}

static void rank_free(rank *k) {
  m3_forward_free(k->f);
  k->f = NULL;
  if (k->kv_open) m3_kv_free(&k->kv);
  k->kv_open = 0;
  m3_model_free(k->m);
  k->m = NULL;
  if (k->rt_open) m3_rt_close(&k->rt);
  k->rt_open = 0;
  free(k->next);
  free(k->logits);
  free(k->sel_cap);
  free(k->sel_ovr);
  k->next = NULL;
  k->logits = NULL;
  k->sel_cap = k->sel_ovr = NULL;
}

static m3_status rank_run(m3_tp_group *g, rank *k, int cmd, m3_err *e) {
  float *lg = !g->logits ? NULL : k->r == 0 ? g->logits : k->logits;
  switch (cmd) {
    case CMD_OPEN: return rank_open(g, k, e);
    case CMD_PREFILL: return m3_forward_prefill(k->f, g->seq, g->n, g->ids, g->smp, k->next, lg, e);
    case CMD_DECODE: return m3_forward_decode(k->f, g->n, g->seqs, g->ids, g->smp, k->next, lg, e);
    /* the rank's own stream and device: the fill and the event read-back
     * are CUDA calls, which only the rank's thread makes */
    case CMD_FILL: return m3_kv_fill_synthetic(&k->rt, &k->kv, g->seqs, g->n, g->fill_n, g->fill_seed, e);
    case CMD_TIMING: return m3_forward_timing(k->f, k->tm, g->tm_max, k->tm_n, e);
    case CMD_QUIT: rank_free(k); return M3_OK;
    default: return M3_OK;
  }
}

static void *rank_main(void *arg) {
  rank *k = arg;
  m3_tp_group *g = k->g;
  const int serial = g->o.backend == M3_TP_LOCAL;
  uint64_t seen = 0;
  pthread_mutex_lock(&g->mu);
  for (;;) {
    while (g->cmd_gen == seen) pthread_cond_wait(&g->cmd_cv, &g->mu);
    seen = g->cmd_gen;
    const int cmd = g->cmd;
    if (!serial) pthread_mutex_unlock(&g->mu);
    k->link.gave_up = 0;
    m3_err_clear(&k->err); /* the caller reads err only once every rank is done */
    const m3_status st = rank_run(g, k, cmd, &k->err);
    if (!serial) pthread_mutex_lock(&g->mu);
    k->st = st; /* under mu: the caller polls it while other ranks still run */
    k->gave_up = k->link.gave_up;
    /* A rank that failed on its own may leave the others waiting in a
     * collective it will never join: wake them (NCCL: the caller aborts). */
    if (k->st != M3_OK && !k->gave_up && g->local) m3_tp_local_abort(g->local);
    g->n_done++;
    pthread_cond_broadcast(&g->done_cv);
    if (cmd == CMD_QUIT) break;
  }
  pthread_mutex_unlock(&g->mu);
  return NULL;
}

/* ---- the caller's side -------------------------------------------------- */

/* Run the posted command on the n_threads ranks and wait for them; the root
 * cause of a failure (a rank that failed on its own, not one that gave up
 * because of it) into e.  Caller holds mu. */
static m3_status dispatch(m3_tp_group *g, int cmd, int n_threads, m3_err *e) {
  g->cmd = cmd;
  g->n_done = 0;
  for (int r = 0; r < n_threads; r++) g->ranks[r].st = M3_OK, g->ranks[r].gave_up = 0; /* idle: ours to write */
  g->cmd_gen++;
  pthread_cond_broadcast(&g->cmd_cv);
  while (g->n_done < n_threads) {
    pthread_cond_wait(&g->done_cv, &g->mu);
    /* NCCL: a rank that failed on its own may leave the others blocked in a
     * collective it never issued; aborting the communicators releases them
     * (the local backend's failing rank wakes its peers itself). */
    if (g->nccl_init && !g->nccl_aborted && g->n_done < n_threads)
      for (int r = 0; r < n_threads; r++)
        if (g->ranks[r].st != M3_OK) {
          m3_tp_comm_abort(&g->nccl);
          g->nccl_aborted = 1;
          break;
        }
  }
  int ok = 0, root = -1;
  for (int r = 0; r < n_threads; r++) {
    if (g->ranks[r].st == M3_OK) ok++;
    else if (root < 0 || (g->ranks[root].gave_up && !g->ranks[r].gave_up)) root = r;
  }
  if (root < 0) return M3_OK;
  if (g->local) m3_tp_local_reset(g->local); /* every rank has returned: no collective is half done */
  if (cmd != CMD_QUIT && (ok || g->nccl_aborted)) {
    g->broken = 1;
    snprintf(g->broken_why, sizeof g->broken_why, "rank %d failed%s", root,
             g->nccl_aborted ? " and the NCCL communicators were aborted" : " a step that other ranks completed");
  }
  const m3_status s = g->ranks[root].st;
  m3_errf(e, s, "rank %d: %s", root, g->ranks[root].err.msg);
  return s;
}

static m3_status run_all(m3_tp_group *g, int cmd, m3_err *e) {
  int n = 0;
  while (n < g->tp && g->ranks[n].started) n++;
  return dispatch(g, cmd, n, e);
}

void m3_tp_close(m3_tp_group *g) {
  if (!g) return;
  pthread_mutex_lock(&g->mu);
  m3_err e;
  run_all(g, CMD_QUIT, &e);
  pthread_mutex_unlock(&g->mu);
  for (int r = 0; r < g->tp; r++)
    if (g->ranks[r].started) pthread_join(g->ranks[r].th, NULL);
  if (g->nccl_init && !g->nccl_aborted) m3_tp_comm_free(&g->nccl);
  m3_tp_local_free(g->local);
  pthread_cond_destroy(&g->cmd_cv);
  pthread_cond_destroy(&g->done_cv);
  pthread_mutex_destroy(&g->mu);
  free(g);
}

m3_status m3_tp_open(const m3_tp_opts *o, m3_tp_group **out, m3_err *e) {
  *out = NULL;
  if (o->tp < 1 || o->tp > M3_TP_COMM_MAX)
    return m3_errf(e, M3_INVAL, "tensor parallel: %d ranks (1..%d on one host)", o->tp, M3_TP_COMM_MAX);
  if (o->backend != M3_TP_NCCL && o->backend != M3_TP_LOCAL)
    return m3_errf(e, M3_INVAL, "tensor parallel: backend %d (M3_TP_NCCL or M3_TP_LOCAL)", (int)o->backend);
  const int have = m3_gpu_count();
  if (have < 1) return m3_errf(e, M3_NOGPU, "tensor parallel: no CUDA GPU");
  m3_tp_group *g = calloc(1, sizeof *g);
  if (!g) return m3_errf(e, M3_NOMEM, "tensor parallel: group");
  g->o = *o;
  g->tp = o->tp;
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cmd_cv, NULL);
  pthread_cond_init(&g->done_cv, NULL);
  m3_status s = M3_OK;
  const int local = o->backend == M3_TP_LOCAL || g->tp == 1;
  if (local) g->o.backend = M3_TP_LOCAL; /* one rank: nothing to communicate, no NCCL needed */
  const int ndev = o->n_devices > 0 ? (o->n_devices < have ? o->n_devices : have) : have;
  if (!local) {
    if (have < g->tp)
      s = m3_errf(e, M3_CUDA, "tensor parallel over NCCL: %d ranks need %d GPUs, this machine has %d (the local "
                  "backend shares GPUs)", g->tp, g->tp, have);
    if (s == M3_OK) s = m3_tp_comm_load(&g->nccl, e);
    if (s == M3_OK && (s = m3_tp_comm_init(&g->nccl, g->tp, e)) == M3_OK) g->nccl_init = 1;
    for (int r = 0; r < g->tp && s == M3_OK; r++) s = m3_tp_link_nccl(&g->nccl, r, &g->ranks[r].link, e);
  } else if (g->tp > 1) {
    s = m3_tp_local_create(g->tp, &g->mu, &g->local, e);
    for (int r = 0; r < g->tp && s == M3_OK; r++) m3_tp_link_local(g->local, r, &g->ranks[r].link);
  }
  for (int r = 0; r < g->tp && s == M3_OK; r++) {
    rank *k = &g->ranks[r];
    k->g = g;
    k->r = r;
    k->device = local ? r % ndev : r;
    if (pthread_create(&k->th, NULL, rank_main, k)) s = m3_errf(e, M3_NOMEM, "tensor parallel: thread of rank %d", r);
    else k->started = 1;
  }
  if (s == M3_OK) {
    pthread_mutex_lock(&g->mu);
    s = run_all(g, CMD_OPEN, e);
    if (s == M3_OK) g->whole = g->ranks[0].m->whole;
    pthread_mutex_unlock(&g->mu);
  }
  if (s != M3_OK) {
    m3_tp_close(g);
    return s;
  }
  *out = g;
  return M3_OK;
}

const m3_config *m3_tp_config(const m3_tp_group *g) { return &g->whole; }
int m3_tp_ranks(const m3_tp_group *g) { return g->tp; }

static m3_status usable(const m3_tp_group *g, m3_err *e) {
  if (g->broken)
    return m3_errf(e, M3_INVAL, "tensor parallel: the group is unusable (%s): close it", g->broken_why);
  return M3_OK;
}

m3_status m3_tp_admit(m3_tp_group *g, int64_t total_tokens, int *seq, m3_err *e) {
  M3_TRY(usable(g, e));
  pthread_mutex_lock(&g->mu); /* the ranks wait for a command: their host tables are ours */
  m3_status s = M3_OK;
  int first = -1, held = 0; /* ranks 0 .. held-1 hold sequence `first` */
  for (int r = 0; r < g->tp && s == M3_OK; r++) {
    int q = -1;
    if ((s = m3_kv_admit(&g->ranks[r].kv, total_tokens, &q, e)) != M3_OK) {
      m3_err_prefix(e, "rank %d: ", r);
      break;
    }
    if (r == 0) first = q;
    else if (q != first) {
      /* The ranks' caches have admitted differently before: they no longer
       * agree on what a sequence id means. */
      m3_kv_release(&g->ranks[r].kv, q);
      s = m3_errf(e, M3_INVAL, "tensor parallel: rank %d admitted sequence %d, rank 0 sequence %d", r, q, first);
      g->broken = 1;
      snprintf(g->broken_why, sizeof g->broken_why, "the ranks' KV caches disagree on sequence ids");
      break;
    }
    held = r + 1;
  }
  if (s != M3_OK) {
    for (int i = 0; i < held; i++) m3_kv_release(&g->ranks[i].kv, first);
    *seq = -1;
  } else {
    *seq = first;
  }
  pthread_mutex_unlock(&g->mu);
  return s;
}

void m3_tp_release(m3_tp_group *g, int seq) {
  pthread_mutex_lock(&g->mu);
  for (int r = 0; r < g->tp; r++) m3_kv_release(&g->ranks[r].kv, seq);
  pthread_mutex_unlock(&g->mu);
}

void m3_tp_debug_selection(m3_tp_group *g, int32_t *capture, const int32_t *override) {
  pthread_mutex_lock(&g->mu); /* the ranks are idle: their forwards' hooks are host fields */
  g->dbg_cap = capture;
  g->dbg_ovr = override;
  for (int r = 0; r < g->tp; r++) {
    rank *k = &g->ranks[r];
    const m3_config *c = &k->m->cfg;
    const size_t n = (size_t)c->num_hidden_layers * (size_t)c->num_key_value_heads *
                     (size_t)g->o.fwd.max_chunk * (size_t)c->sparse_topk_blocks;
    if (capture && !k->sel_cap) k->sel_cap = calloc(n, sizeof(int32_t));
    if (override && !k->sel_ovr) k->sel_ovr = calloc(n, sizeof(int32_t));
    m3_forward_debug_selection(k->f, capture ? k->sel_cap : NULL, override ? k->sel_ovr : NULL);
  }
  pthread_mutex_unlock(&g->mu);
}

/* Between the whole layout [L][nkv][n][topk] and each rank's [L][nkv_r][n][topk]
 * (its KV heads kv_head0 ..): to_rank before a step, back after it. */
static m3_status sel_remap(m3_tp_group *g, int n, int to_rank, m3_err *e) {
  const int32_t *src = to_rank ? g->dbg_ovr : g->dbg_cap;
  if (!src) return M3_OK;
  const m3_config *w = &g->whole;
  if (n > g->o.fwd.max_chunk)
    return m3_errf(e, M3_INVAL, "tensor parallel: a debug selection covers one chunk (%d tokens), not %d",
                   g->o.fwd.max_chunk, n);
  const size_t row = (size_t)n * (size_t)w->sparse_topk_blocks * sizeof(int32_t);
  for (int r = 0; r < g->tp; r++) {
    rank *k = &g->ranks[r];
    const int nkv_r = k->m->cfg.num_key_value_heads, h0 = g->tp > 1 ? k->m->part.kv_head0 : 0;
    int32_t *rk = to_rank ? k->sel_ovr : k->sel_cap;
    if (!rk) return m3_errf(e, M3_NOMEM, "tensor parallel: debug selection buffers");
    for (int l = 0; l < w->num_hidden_layers; l++)
      for (int h = 0; h < nkv_r; h++) {
        char *whole = (char *)(to_rank ? (void *)g->dbg_ovr : (void *)g->dbg_cap) +
                      ((size_t)l * (size_t)w->num_key_value_heads + (size_t)(h0 + h)) * row;
        char *mine = (char *)rk + ((size_t)l * (size_t)nkv_r + (size_t)h) * row;
        if (to_rank) memcpy(mine, whole, row);
        else memcpy(whole, mine, row);
      }
  }
  return M3_OK;
}

/* Every rank's tokens (and logits, when asked for) equal rank 0's. */
static m3_status agree(m3_tp_group *g, int n, int want_logits, m3_err *e) {
  const size_t V = (size_t)g->whole.vocab_size;
  for (int r = 1; r < g->tp; r++) {
    for (int i = 0; i < n; i++)
      if (g->ranks[r].next[i] != g->ranks[0].next[i])
        return m3_errf(e, M3_MISMATCH, "tensor parallel: row %d: rank %d chose token %d, rank 0 token %d", i, r,
                       g->ranks[r].next[i], g->ranks[0].next[i]);
    if (want_logits && memcmp(g->ranks[r].logits, g->logits, sizeof(float) * V * (size_t)n))
      return m3_errf(e, M3_MISMATCH, "tensor parallel: rank %d's gathered logits differ from rank 0's", r);
  }
  return M3_OK;
}

/* The host-side checks the forward makes before running, made here once so
 * that a bad input fails on no rank rather than on all of them. */
static m3_status check_step(m3_tp_group *g, int n, const int *seqs, int single, const int32_t *ids, m3_err *e) {
  const m3_kv_cache *kv = &g->ranks[0].kv;
  M3_TRY(m3_embed_check_host(n, g->whole.vocab_size, ids, e));
  for (int i = 0; i < (single ? 1 : n); i++) {
    const int q = seqs[i];
    if (q < 0 || q >= kv->plan.max_seqs || !kv->admitted[q])
      return m3_errf(e, M3_INVAL, "tensor parallel: sequence %d is not admitted", q);
    if (kv->seq_lens[q] + (single ? n : 1) > kv->admitted[q])
      return m3_errf(e, M3_CAPACITY, "tensor parallel: sequence %d holds %d tokens, %d more exceed the %lld it was "
                     "admitted with", q, kv->seq_lens[q], single ? n : 1, (long long)kv->admitted[q]);
  }
  return M3_OK;
}

m3_status m3_tp_prefill(m3_tp_group *g, int seq, int n, const int32_t *ids, const m3_sampling *smp, int32_t *next,
                        float *logits, m3_err *e) {
  M3_TRY(usable(g, e));
  if (n <= 0 || !ids) return m3_errf(e, M3_INVAL, "tensor parallel: prefill of %d tokens", n);
  pthread_mutex_lock(&g->mu);
  m3_status s = check_step(g, n, &seq, 1, ids, e);
  if (s == M3_OK) s = sel_remap(g, n, 1, e);
  if (s == M3_OK) {
    g->seq = seq, g->n = n, g->ids = ids, g->smp = smp, g->logits = logits;
    s = run_all(g, CMD_PREFILL, e);
    if (s == M3_OK) s = sel_remap(g, n, 0, e);
    if (s == M3_OK) s = agree(g, 1, logits != NULL, e);
    if (s == M3_OK && next) *next = g->ranks[0].next[0];
  }
  g->logits = NULL;
  pthread_mutex_unlock(&g->mu);
  return s;
}

m3_status m3_tp_decode(m3_tp_group *g, int n, const int *seqs, const int32_t *ids, const m3_sampling *smp,
                       int32_t *next, float *logits, m3_err *e) {
  M3_TRY(usable(g, e));
  if (n <= 0 || n > g->o.fwd.max_batch || !seqs || !ids)
    return m3_errf(e, M3_INVAL, "tensor parallel: decode of %d sequences (max_batch %d)", n, g->o.fwd.max_batch);
  pthread_mutex_lock(&g->mu);
  m3_status s = check_step(g, n, seqs, 0, ids, e);
  if (s == M3_OK) s = sel_remap(g, n, 1, e);
  if (s == M3_OK) {
    g->seqs = seqs, g->n = n, g->ids = ids, g->smp = smp, g->logits = logits;
    s = run_all(g, CMD_DECODE, e);
    if (s == M3_OK) s = sel_remap(g, n, 0, e);
    if (s == M3_OK) s = agree(g, n, logits != NULL, e);
    if (s == M3_OK && next) memcpy(next, g->ranks[0].next, sizeof *next * (size_t)n);
  }
  g->logits = NULL;
  pthread_mutex_unlock(&g->mu);
  return s;
}

m3_status m3_tp_fill_synthetic(m3_tp_group *g, const int *seqs, int batch, int n, uint64_t seed, m3_err *e) {
  M3_TRY(usable(g, e));
  if (n < 1 || batch < 1 || !seqs)
    return m3_errf(e, M3_INVAL, "tensor parallel: synthetic cache of %d tokens for %d sequences", n, batch);
  pthread_mutex_lock(&g->mu);
  m3_status s = M3_OK;
  /* the checks m3_kv_append makes, once on the host, so that no rank appends
   * when one would refuse (rank 0's tables stand for every rank's: admit
   * keeps them equal) */
  const m3_kv_cache *kv = &g->ranks[0].kv;
  for (int i = 0; i < batch && s == M3_OK; i++) {
    const int q = seqs[i];
    if (q < 0 || q >= kv->plan.max_seqs || !kv->admitted[q])
      s = m3_errf(e, M3_INVAL, "tensor parallel: synthetic cache: sequence %d is not admitted", q);
    else if (kv->seq_lens[q] + (int64_t)n > kv->admitted[q])
      s = m3_errf(e, M3_CAPACITY, "tensor parallel: synthetic cache: sequence %d holds %d tokens, %d more exceed the "
                  "%lld it was admitted with", q, kv->seq_lens[q], n, (long long)kv->admitted[q]);
    for (int j = 0; j < i && s == M3_OK; j++)
      if (seqs[j] == q) s = m3_errf(e, M3_INVAL, "tensor parallel: synthetic cache: sequence %d appears twice", q);
  }
  if (s == M3_OK) {
    g->seqs = seqs, g->n = batch, g->fill_n = n, g->fill_seed = seed;
    s = run_all(g, CMD_FILL, e);
  }
  pthread_mutex_unlock(&g->mu);
  return s;
}

m3_status m3_tp_timing(m3_tp_group *g, m3_fwd_op_time *out, int max, int *n, m3_err *e) {
  M3_TRY(usable(g, e));
  pthread_mutex_lock(&g->mu);
  g->tm_max = max;
  for (int r = 0; r < g->tp; r++) {
    g->ranks[r].tm = out + (size_t)r * (size_t)max;
    g->ranks[r].tm_n = &n[r];
    n[r] = 0;
  }
  const m3_status s = run_all(g, CMD_TIMING, e);
  pthread_mutex_unlock(&g->mu);
  return s;
}

void m3_tp_reset_timing(m3_tp_group *g) {
  pthread_mutex_lock(&g->mu); /* the ranks are idle: the tables are host fields */
  for (int r = 0; r < g->tp; r++) m3_forward_reset_timing(g->ranks[r].f);
  pthread_mutex_unlock(&g->mu);
}

m3_status m3_tp_info(const m3_tp_group *gc, int r, m3_tp_rank_info *out, m3_err *e) {
  m3_tp_group *g = (m3_tp_group *)gc; /* the lock, not the state, is mutated */
  if (r < 0 || r >= g->tp) return m3_errf(e, M3_INVAL, "tensor parallel: rank %d of %d", r, g->tp);
  pthread_mutex_lock(&g->mu);
  const rank *k = &g->ranks[r];
  memset(out, 0, sizeof *out);
  out->device = k->device;
  out->weight_bytes = k->m->weight_bytes;
  out->peak_bytes = k->m->peak_bytes;
  out->kv_bytes = k->kv.plan.bytes;
  out->kv_bytes_per_token = k->kv.plan.bytes_per_token;
  m3_forward_tp_counts(k->f, &out->allreduces, &out->allgathers);
  out->graph_replays = m3_forward_graph_replays(k->f);
  out->load_s = k->load_s;
  snprintf(out->source, sizeof out->source, "%s", k->m->source);
  pthread_mutex_unlock(&g->mu);
  return M3_OK;
}

const int32_t *m3_tp_rank_tokens(const m3_tp_group *g, int r) { return r >= 0 && r < g->tp ? g->ranks[r].next : NULL; }
