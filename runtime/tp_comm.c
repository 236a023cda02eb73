/* tp_comm.c - NCCL loaded at run time (tp_comm.h). */
#include "runtime/tp_comm.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m3config.h"

#ifdef M3_HAVE_NCCL_H
#include <nccl.h>

static struct {
  void *h;
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*CommDestroy)(ncclComm_t);
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
      SYM(GetVersion) SYM(CommInitAll) SYM(AllReduce) SYM(GroupStart) SYM(GroupEnd) SYM(CommDestroy)
      SYM(GetErrorString)
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
  if (n_ranks < 1 || n_ranks > 8) return m3_errf(e, M3_INVAL, "tensor parallel: %d ranks on one host (1..8)", n_ranks);
  int have = 0;
  cudaError_t ce = cudaGetDeviceCount(&have);
  if (ce != cudaSuccess || have < n_ranks)
    return m3_errf(e, M3_CUDA, "tensor parallel over %d GPUs: this machine has %d (%s)", n_ranks,
                   ce == cudaSuccess ? have : 0, ce == cudaSuccess ? "cudaGetDeviceCount" : cudaGetErrorString(ce));
  setenv("NCCL_NVLS_ENABLE", "0", 0); /* multicast off unless the caller chose otherwise */
  int devs[8];
  for (int i = 0; i < n_ranks; i++) devs[i] = i;
  ncclComm_t comms[8];
  ncclResult_t r = N.CommInitAll(comms, n_ranks, devs);
  if (r != ncclSuccess) return m3_errf(e, M3_CUDA, "ncclCommInitAll(%d ranks): %s", n_ranks, nccl_err(r));
  for (int i = 0; i < n_ranks; i++) c->comms[i] = comms[i];
  c->n_ranks = n_ranks;
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

void m3_tp_comm_free(m3_tp_comm *c) {
  for (int i = 0; i < c->n_ranks; i++)
    if (c->comms[i] && N.CommDestroy) N.CommDestroy((ncclComm_t)c->comms[i]);
  c->n_ranks = 0;
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
void m3_tp_comm_free(m3_tp_comm *c) { c->n_ranks = 0; }

#endif
