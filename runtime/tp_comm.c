/* tp_comm.c - the collectives of tensor parallelism (tp_comm.h): NCCL loaded
 * at run time, and the local backend for ranks that share a device. */
#include "runtime/tp_comm.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m3config.h"
#include "ref/numerics.h"
#include "runtime/check.h"

/* ------------------------------------------------------------------------ */
/* NCCL                                                                     */
/* ------------------------------------------------------------------------ */

#ifdef M3_HAVE_NCCL_H
#include <nccl.h>

static struct {
  void *h;
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  const char *(*GetErrorString)(ncclResult_t);
} N;

static const char *nccl_err(ncclResult_t r) { return N.GetErrorString ? N.GetErrorString(r) : "unknown NCCL error"; }

m3_status m3_tp_comm_load(m3_tp_comm *c, m3_err *e) {
  memset(c, 0, sizeof *c);
  if (!N.h) {
    const char *env = getenv("M3KIT_NCCL_LIB");
    char toolkit[400];
    snprintf(toolkit, sizeof toolkit, "%s/libnccl.so.2", M3_CUDA_LIBDIR);
    const char *paths[] = {env && *env ? env : NULL, "libnccl.so.2", toolkit};
    char tried[1024] = "";
    for (size_t i = 0; i < sizeof paths / sizeof *paths && !N.h; i++) {
      if (!paths[i]) continue;
      void *h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        size_t l = strlen(tried);
        snprintf(tried + l, sizeof tried - l, "%s%s", l ? ", " : "", paths[i]);
        continue;
      }
      int ok = 1;
#define SYM(f) ok &= (*(void **)&N.f = dlsym(h, "nccl" #f)) != NULL;
      SYM(GetVersion) SYM(CommInitAll) SYM(AllReduce) SYM(AllGather) SYM(GroupStart) SYM(GroupEnd) SYM(CommDestroy)
      SYM(CommAbort) SYM(GetErrorString)
#undef SYM
      if (!ok) {
        dlclose(h);
        return m3_errf(e, M3_UNSUPPORTED, "NCCL: %s lacks a symbol m3kit needs (NCCL >= 2.x)", paths[i]);
      }
      N.h = h;
      snprintf(c->lib, sizeof c->lib, "%s", paths[i]);
    }
    if (!N.h) return m3_errf(e, M3_UNSUPPORTED, "NCCL: no libnccl.so.2 (tried %s; set M3KIT_NCCL_LIB)", tried);
  }
  ncclResult_t r = N.GetVersion(&c->version);
  if (r != ncclSuccess) return m3_errf(e, M3_CUDA, "ncclGetVersion: %s", nccl_err(r));
  return M3_OK;
}

m3_status m3_tp_comm_init(m3_tp_comm *c, int n_ranks, m3_err *e) {
  if (!N.h) return m3_errf(e, M3_INVAL, "tensor parallel: m3_tp_comm_load first");
  if (n_ranks < 1 || n_ranks > M3_TP_COMM_MAX)
    return m3_errf(e, M3_INVAL, "tensor parallel: %d ranks on one host (1..%d)", n_ranks, M3_TP_COMM_MAX);
  int have = 0;
  cudaError_t ce = cudaGetDeviceCount(&have);
  if (ce != cudaSuccess || have < n_ranks)
    return m3_errf(e, M3_CUDA, "tensor parallel over %d GPUs: this machine has %d (%s)", n_ranks,
                   ce == cudaSuccess ? have : 0, ce == cudaSuccess ? "cudaGetDeviceCount" : cudaGetErrorString(ce));
  setenv("NCCL_NVLS_ENABLE", "0", 0); /* multicast off unless the caller chose otherwise */
  /* Connections made at init, not inside a rank's first collective: an
   * enqueue then never blocks on a peer while holding its enq lock, so an
   * abort can always take the locks. */
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  int devs[M3_TP_COMM_MAX];
  for (int i = 0; i < n_ranks; i++) devs[i] = i;
  ncclComm_t comms[M3_TP_COMM_MAX];
  ncclResult_t r = N.CommInitAll(comms, n_ranks, devs);
  if (r != ncclSuccess) return m3_errf(e, M3_CUDA, "ncclCommInitAll(%d ranks): %s", n_ranks, nccl_err(r));
  for (int i = 0; i < n_ranks; i++) c->comms[i] = comms[i];
  c->n_ranks = n_ranks;
  c->aborted = 0;
  for (; c->n_enq < n_ranks; c->n_enq++)
    if (pthread_mutex_init(&c->enq[c->n_enq], NULL)) {
      m3_tp_comm_free(c);
      return m3_errf(e, M3_NOMEM, "tensor parallel: pthread_mutex_init");
    }
  return M3_OK;
}

m3_status m3_tp_allreduce_f32(m3_tp_comm *c, float *const *buf, size_t n, cudaStream_t const *stream, m3_err *e) {
  if (!c->n_ranks) return m3_errf(e, M3_INVAL, "tensor parallel: all-reduce before m3_tp_comm_init");
  ncclResult_t r = N.GroupStart();
  for (int i = 0; i < c->n_ranks && r == ncclSuccess; i++)
    r = N.AllReduce(buf[i], buf[i], n, ncclFloat32, ncclSum, (ncclComm_t)c->comms[i], stream[i]);
  ncclResult_t r2 = N.GroupEnd();
  if (r == ncclSuccess) r = r2;
  if (r != ncclSuccess) return m3_errf(e, M3_CUDA, "ncclAllReduce of %zu floats over %d ranks: %s", n, c->n_ranks,
                                       nccl_err(r));
  return M3_OK;
}

void m3_tp_comm_abort(m3_tp_comm *c) {
  __atomic_store_n(&c->aborted, 1, __ATOMIC_RELEASE);
  for (int i = 0; i < c->n_enq; i++) pthread_mutex_lock(&c->enq[i]);
  for (int i = 0; i < c->n_ranks; i++)
    if (c->comms[i] && N.CommAbort) N.CommAbort((ncclComm_t)c->comms[i]);
  memset(c->comms, 0, sizeof c->comms);
  c->n_ranks = 0;
  for (int i = 0; i < c->n_enq; i++) pthread_mutex_unlock(&c->enq[i]);
}

void m3_tp_comm_free(m3_tp_comm *c) {
  for (int i = 0; i < c->n_ranks; i++)
    if (c->comms[i] && N.CommDestroy) N.CommDestroy((ncclComm_t)c->comms[i]);
  c->n_ranks = 0;
  for (int i = 0; i < c->n_enq; i++) pthread_mutex_destroy(&c->enq[i]);
  c->n_enq = 0;
}

/* Enter / leave rank r's enqueue section; 0 when the group was aborted (the
 * link gives up with the abort's error instead of touching NCCL). */
static int enq_begin(m3_tp_link *l) {
  pthread_mutex_lock(&l->comm->enq[l->rank]);
  if (!__atomic_load_n(&l->comm->aborted, __ATOMIC_ACQUIRE)) return 1;
  pthread_mutex_unlock(&l->comm->enq[l->rank]);
  l->gave_up = 1;
  return 0;
}
static void enq_end(m3_tp_link *l, ncclResult_t r) {
  pthread_mutex_unlock(&l->comm->enq[l->rank]);
  /* An error once the group is aborted is the abort's, not this rank's. */
  if (r != ncclSuccess && __atomic_load_n(&l->comm->aborted, __ATOMIC_ACQUIRE)) l->gave_up = 1;
}

m3_status m3_tp_link_nccl(m3_tp_comm *c, int rank, m3_tp_link *out, m3_err *e) {
  memset(out, 0, sizeof *out);
  if (rank < 0 || rank >= c->n_ranks)
    return m3_errf(e, M3_INVAL, "tensor parallel: rank %d outside the NCCL group of %d", rank, c->n_ranks);
  if (c->version < 21000) /* ncclBfloat16 arrived in 2.10 */
    return m3_errf(e, M3_UNSUPPORTED, "NCCL %d.%d.%d (%s) has no bf16 all-reduce: NCCL >= 2.10 needed",
                   c->version / 10000, c->version / 100 % 100, c->version % 100, c->lib);
  *out = (m3_tp_link){.backend = M3_TP_NCCL, .rank = rank, .n_ranks = c->n_ranks, .capturable = 1,
                      .nccl = c->comms[rank], .comm = c};
  return M3_OK;
}

static m3_status nccl_allreduce_bf16(m3_tp_link *l, void *buf, size_t n, cudaStream_t s, m3_err *e) {
  if (!enq_begin(l)) return m3_errf(e, M3_CUDA, "rank %d: the group was aborted (another rank failed)", l->rank);
  ncclResult_t r = N.AllReduce(buf, buf, n, ncclBfloat16, ncclSum, (ncclComm_t)l->nccl, s);
  enq_end(l, r);
  if (r != ncclSuccess)
    return m3_errf(e, M3_CUDA, "rank %d: ncclAllReduce of %zu bf16: %s", l->rank, n, nccl_err(r));
  return M3_OK;
}

static m3_status nccl_allgather_f32(m3_tp_link *l, const float *send, float *recv, size_t n, cudaStream_t s,
                                    m3_err *e) {
  if (!enq_begin(l)) return m3_errf(e, M3_CUDA, "rank %d: the group was aborted (another rank failed)", l->rank);
  ncclResult_t r = N.AllGather(send, recv, n, ncclFloat32, (ncclComm_t)l->nccl, s);
  enq_end(l, r);
  if (r != ncclSuccess)
    return m3_errf(e, M3_CUDA, "rank %d: ncclAllGather of %zu floats: %s", l->rank, n, nccl_err(r));
  return M3_OK;
}

#else /* built without nccl.h */

m3_status m3_tp_comm_load(m3_tp_comm *c, m3_err *e) {
  memset(c, 0, sizeof *c);
  return m3_errf(e, M3_UNSUPPORTED, "NCCL: m3kit was built without nccl.h (configure --with-cuda=DIR of a toolkit "
                 "that has it)");
}
m3_status m3_tp_comm_init(m3_tp_comm *c, int n_ranks, m3_err *e) {
  (void)c, (void)n_ranks;
  return m3_errf(e, M3_UNSUPPORTED, "NCCL: not built in");
}
m3_status m3_tp_allreduce_f32(m3_tp_comm *c, float *const *buf, size_t n, cudaStream_t const *stream, m3_err *e) {
  (void)c, (void)buf, (void)n, (void)stream;
  return m3_errf(e, M3_UNSUPPORTED, "NCCL: not built in");
}
void m3_tp_comm_abort(m3_tp_comm *c) { c->n_ranks = 0; }
void m3_tp_comm_free(m3_tp_comm *c) { c->n_ranks = 0; }
m3_status m3_tp_link_nccl(m3_tp_comm *c, int rank, m3_tp_link *out, m3_err *e) {
  (void)c, (void)rank;
  memset(out, 0, sizeof *out);
  return m3_errf(e, M3_UNSUPPORTED, "NCCL: not built in");
}
static m3_status nccl_allreduce_bf16(m3_tp_link *l, void *buf, size_t n, cudaStream_t s, m3_err *e) {
  (void)l, (void)buf, (void)n, (void)s;
  return m3_errf(e, M3_UNSUPPORTED, "NCCL: not built in");
}
static m3_status nccl_allgather_f32(m3_tp_link *l, const float *send, float *recv, size_t n, cudaStream_t s,
                                    m3_err *e) {
  (void)l, (void)send, (void)recv, (void)n, (void)s;
  return m3_errf(e, M3_UNSUPPORTED, "NCCL: not built in");
}

#endif

/* ------------------------------------------------------------------------ */
/* local                                                                    */
/* ------------------------------------------------------------------------ */

/* One collective at a time: ranks arrive (contribution in slot[rank]), the
 * last one to arrive computes `res` and bumps `gen`, which releases the
 * others.  `res` may be overwritten only by the next collective's last
 * arrival, and every rank has copied it out before it can arrive there, so
 * one result buffer suffices; contributions stay in their own slots for the
 * same reason. */
enum { OP_NONE, OP_SUM_BF16, OP_GATHER_F32 };

struct m3_tp_local {
  int n;
  pthread_mutex_t *turn;
  pthread_cond_t cv;
  int arrived, op, aborted;
  size_t count;                     /* elements of the collective in progress */
  uint64_t gen;
  void *slot[M3_TP_COMM_MAX];
  size_t slot_cap[M3_TP_COMM_MAX];
  void *res;
  size_t res_cap;
};

m3_status m3_tp_local_create(int n_ranks, pthread_mutex_t *turn, m3_tp_local **out, m3_err *e) {
  *out = NULL;
  if (n_ranks < 1 || n_ranks > M3_TP_COMM_MAX || !turn)
    return m3_errf(e, M3_INVAL, "tensor parallel (local): %d ranks (1..%d), a turn mutex", n_ranks, M3_TP_COMM_MAX);
  m3_tp_local *g = calloc(1, sizeof *g);
  if (!g) return m3_errf(e, M3_NOMEM, "tensor parallel (local): group");
  g->n = n_ranks;
  g->turn = turn;
  if (pthread_cond_init(&g->cv, NULL)) {
    free(g);
    return m3_errf(e, M3_NOMEM, "tensor parallel (local): pthread_cond_init");
  }
  *out = g;
  return M3_OK;
}

void m3_tp_local_free(m3_tp_local *g) {
  if (!g) return;
  for (int r = 0; r < g->n; r++) free(g->slot[r]);
  free(g->res);
  pthread_cond_destroy(&g->cv);
  free(g);
}

void m3_tp_local_abort(m3_tp_local *g) {
  g->aborted = 1;
  pthread_cond_broadcast(&g->cv);
}

void m3_tp_local_reset(m3_tp_local *g) {
  g->aborted = 0;
  g->arrived = 0;
  g->op = OP_NONE;
  g->gen++;
}

void m3_tp_link_local(m3_tp_local *g, int rank, m3_tp_link *out) {
  *out = (m3_tp_link){.backend = M3_TP_LOCAL, .rank = rank, .n_ranks = g->n, .capturable = 0, .local = g};
}

static int grow(void **p, size_t *cap, size_t bytes) {
  if (bytes <= *cap) return 0;
  void *n = realloc(*p, bytes);
  if (!n) return -1;
  *p = n;
  *cap = bytes;
  return 0;
}

/* The last arrival's work: res from every slot, in rank order. */
static void local_combine(m3_tp_local *g) {
  const size_t n = g->count;
  if (g->op == OP_SUM_BF16) {
    m3_bf16 *out = g->res;
    for (size_t i = 0; i < n; i++) {
      float acc = 0.0f; /* fp32, rank 0 first: the same bits on every rank whatever order they arrived in */
      for (int r = 0; r < g->n; r++) acc += m3_bf16_to_f32(((const m3_bf16 *)g->slot[r])[i]);
      out[i] = m3_f32_to_bf16(acc);
    }
  } else {
    for (int r = 0; r < g->n; r++) memcpy((float *)g->res + (size_t)r * n, g->slot[r], n * sizeof(float));
  }
}

/* Contribute `bytes` from device `src`, wait for the others, then copy
 * `out_bytes` of the result to device `dst`.  Called holding *turn. */
static m3_status local_collective(m3_tp_link *l, int op, const void *src, size_t n, size_t bytes, void *dst,
                                  size_t out_bytes, cudaStream_t s, m3_err *e) {
  m3_tp_local *g = l->local;
  const char *what = op == OP_SUM_BF16 ? "all-reduce" : "all-gather";
  if (g->aborted) {
    l->gave_up = 1;
    return m3_errf(e, M3_CUDA, "rank %d: %s gave up: another rank failed", l->rank, what);
  }
  if (g->arrived && (g->op != op || g->count != n))
    return m3_errf(e, M3_INVAL, "rank %d: %s of %zu elements while the other ranks are in a %s of %zu: the ranks "
                   "issue different collectives", l->rank, what, n, g->op == OP_SUM_BF16 ? "all-reduce" : "all-gather",
                   g->count);
  if (grow(&g->slot[l->rank], &g->slot_cap[l->rank], bytes) ||
      (g->arrived + 1 == g->n && grow(&g->res, &g->res_cap, op == OP_SUM_BF16 ? bytes : bytes * (size_t)g->n)))
    return m3_errf(e, M3_NOMEM, "rank %d: %s of %zu bytes: host buffers", l->rank, what, bytes);
  /* the contribution is on the stream: sync so the host copy holds it */
  M3_CUDA(e, cudaMemcpyAsync(g->slot[l->rank], src, bytes, cudaMemcpyDeviceToHost, s));
  M3_CUDA(e, cudaStreamSynchronize(s));
  g->op = op;
  g->count = n;
  const uint64_t gen = g->gen;
  if (++g->arrived == g->n) {
    local_combine(g);
    g->arrived = 0;
    g->op = OP_NONE;
    g->gen++;
    pthread_cond_broadcast(&g->cv);
  } else {
    while (g->gen == gen && !g->aborted) pthread_cond_wait(&g->cv, g->turn);
    if (g->gen == gen) {
      l->gave_up = 1;
      return m3_errf(e, M3_CUDA, "rank %d: %s gave up: another rank failed", l->rank, what);
    }
  }
  M3_CUDA(e, cudaMemcpyAsync(dst, g->res, out_bytes, cudaMemcpyHostToDevice, s));
  M3_CUDA(e, cudaStreamSynchronize(s));
  return M3_OK;
}

/* ------------------------------------------------------------------------ */
/* The interface                                                            */
/* ------------------------------------------------------------------------ */

m3_status m3_tp_allreduce_bf16(m3_tp_link *l, void *buf, size_t n, cudaStream_t stream, m3_err *e) {
  if (l->n_ranks == 1 || !n) return M3_OK; /* a sum over one rank */
  if (l->backend == M3_TP_NCCL) return nccl_allreduce_bf16(l, buf, n, stream, e);
  return local_collective(l, OP_SUM_BF16, buf, n, n * 2, buf, n * 2, stream, e);
}

m3_status m3_tp_allgather_f32(m3_tp_link *l, const float *send, float *recv, size_t n, cudaStream_t stream,
                              m3_err *e) {
  if (!n) return M3_OK;
  if (l->n_ranks == 1) {
    M3_CUDA(e, cudaMemcpyAsync(recv, send, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    return M3_OK;
  }
  if (l->backend == M3_TP_NCCL) return nccl_allgather_f32(l, send, recv, n, stream, e);
  return local_collective(l, OP_GATHER_F32, send, n, n * sizeof(float), recv, n * sizeof(float) * (size_t)l->n_ranks,
                          stream, e);
}
