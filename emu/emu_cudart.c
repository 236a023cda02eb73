/* emu_cudart.c - the CUDA runtime API subset m3kit uses, on host memory, for
 * the emulator programs (linked instead of libcudart_static).  Every stream
 * is synchronous: work happens when it is enqueued, so events time host work.
 * Graph capture records launches and copies and replays them. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/cuda_driver.h"

static __thread cudaError_t last_err;
static size_t allocated;

static cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) last_err = e;
  return e;
}

cudaError_t cudaMalloc(void **p, size_t n) {
  *p = aligned_alloc(256, (n + 255) & ~(size_t)255);
  if (!*p) return ret(cudaErrorMemoryAllocation);
  allocated += n;
  return cudaSuccess;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
  *total = (size_t)16 << 30;
  *free_b = allocated < *total ? *total - allocated : 0;
  return cudaSuccess;
}

/* ---- graph capture: a list of recorded operations ---- */
/* kind 1 copy, 2 set, 3 launch (cluster_x: blocks per cluster along x, 1 = none) */
typedef struct op { int kind; void *dst; const void *src; size_t n; int val; CUfunction f; unsigned g[3], b[3], smem, cluster_x; void **args; } op;
struct CUgraph_st { op *ops; int n, cap; };
struct CUgraphExec_st { struct CUgraph_st *g; };
static struct CUgraph_st *capturing;

static void record(op o) {
  if (capturing->n == capturing->cap) {
    capturing->cap = capturing->cap ? capturing->cap * 2 : 64;
    capturing->ops = realloc(capturing->ops, sizeof(op) * (size_t)capturing->cap);
  }
  capturing->ops[capturing->n++] = o;
}

cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
  (void)k;
  memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
  (void)k; (void)st;
  if (capturing) record((op){.kind = 1, .dst = d, .src = s, .n = n});
  else memmove(d, s, n);
  return cudaSuccess;
}
/* Pitched copies (the tensor-parallel loader's column slices, the logits
 * all-gather's placement): one row at a time, recorded as plain copies when
 * capturing. */
cudaError_t cudaMemcpy2DAsync(void *d, size_t dpitch, const void *s, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind k, cudaStream_t st) {
  if (width > dpitch || width > spitch) return ret(cudaErrorInvalidPitchValue);
  for (size_t r = 0; r < height; r++) {
    cudaError_t x = cudaMemcpyAsync((char *)d + r * dpitch, (const char *)s + r * spitch, width, k, st);
    if (x != cudaSuccess) return x;
  }
  return cudaSuccess;
}
cudaError_t cudaMemcpy2D(void *d, size_t dpitch, const void *s, size_t spitch, size_t width, size_t height,
                         enum cudaMemcpyKind k) {
  return cudaMemcpy2DAsync(d, dpitch, s, spitch, width, height, k, NULL);
}
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) {
  (void)st;
  if (capturing) record((op){.kind = 2, .dst = d, .val = v, .n = n});
  else memset(d, v, n);
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : ret(cudaErrorInvalidDevice); }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { cudaError_t e = last_err; last_err = cudaSuccess; return e; }
cudaError_t cudaPeekAtLastError(void) { return last_err; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated CUDA runtime error"; }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }

struct CUstream_st { int dummy; };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) { (void)f; *s = calloc(1, sizeof(struct CUstream_st)); return cudaSuccess; }
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) { free(s); return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) { (void)s; (void)e; (void)f; return cudaSuccess; }

struct CUevent_st { double t; };
static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = calloc(1, sizeof(struct CUevent_st)); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) { (void)f; return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)s; e->t = now(); return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) { *ms = (float)((b->t - a->t) * 1e3); return cudaSuccess; }

cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode m) {
  (void)s; (void)m;
  capturing = calloc(1, sizeof *capturing);
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
  (void)s;
  *g = (cudaGraph_t)capturing;
  capturing = NULL;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) {
  (void)s;
  *st = capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long f) {
  (void)f;
  /* The executable owns a copy of the operation list: CUDA lets the graph be
   * destroyed right after instantiation (runtime/harness.c m3_time_graph
   * does), and the exec must survive it.  The recorded argument copies are
   * shared and, like the graphs' own, never freed (emulator, tests only). */
  const struct CUgraph_st *src = (const struct CUgraph_st *)g;
  struct CUgraphExec_st *e = calloc(1, sizeof *e);
  struct CUgraph_st *c = calloc(1, sizeof *c);
  if (!e || !c || (src->n && !(c->ops = malloc(sizeof(op) * (size_t)src->n)))) {
    free(e), free(c);
    return ret(cudaErrorMemoryAllocation);
  }
  if (src->n) memcpy(c->ops, src->ops, sizeof(op) * (size_t)src->n);
  c->n = c->cap = src->n;
  e->g = c;
  *x = (cudaGraphExec_t)e;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s) {
  (void)s;
  struct CUgraph_st *g = ((struct CUgraphExec_st *)x)->g;
  for (int i = 0; i < g->n; i++) {
    op *o = &g->ops[i];
    if (o->kind == 1) memmove(o->dst, o->src, o->n);
    else if (o->kind == 2) memset(o->dst, o->val, o->n);
    else if (o->cluster_x > 1) {
      CUlaunchAttribute at;
      memset(&at, 0, sizeof at);
      at.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      at.value.clusterDim.x = o->cluster_x, at.value.clusterDim.y = 1, at.value.clusterDim.z = 1;
      CUlaunchConfig c;
      memset(&c, 0, sizeof c);
      c.gridDimX = o->g[0], c.gridDimY = o->g[1], c.gridDimZ = o->g[2];
      c.blockDimX = o->b[0], c.blockDimY = o->b[1], c.blockDimZ = o->b[2];
      c.sharedMemBytes = o->smem;
      c.attrs = &at;
      c.numAttrs = 1;
      if (m3_drv.cuLaunchKernelEx(&c, o->f, o->args, NULL)) return ret(cudaErrorLaunchFailure);
    } else if (m3_drv.cuLaunchKernel(o->f, o->g[0], o->g[1], o->g[2], o->b[0], o->b[1], o->b[2], o->smem, NULL, o->args, NULL))
      return ret(cudaErrorLaunchFailure);
  }
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x) {
  struct CUgraphExec_st *e = (struct CUgraphExec_st *)x;
  if (e) free(e->g->ops), free(e->g), free(e);
  return cudaSuccess;
}
/* Nodes: the recorded operations (launches, copies, sets); no node list. */
cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *n) {
  if (nodes || !g || !n) return cudaErrorNotSupported;
  *n = (size_t)((const struct CUgraph_st *)g)->n;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  struct CUgraph_st *gg = (struct CUgraph_st *)g;
  if (gg) free(gg->ops), free(gg);
  return cudaSuccess;
}

/* Kernel launches inside a capture are recorded with a copy of their
 * argument bytes (the caller's locals die) and their cluster size;
 * m3emu_capture_launch is called by the emulated cuLaunchKernel(Ex) when a
 * capture is active, after the launch's checks. */
int m3emu_capturing(void) { return capturing != NULL; }
void m3emu_capture_launch(CUfunction f, const unsigned g[3], const unsigned b[3], unsigned smem, unsigned cluster_x,
                          void **args, int nargs, const size_t *sizes) {
  void **copy = malloc(sizeof(void *) * (size_t)(nargs ? nargs : 1));
  for (int i = 0; i < nargs; i++) {
    copy[i] = malloc(sizes[i]);
    memcpy(copy[i], args[i], sizes[i]);
  }
  record((op){.kind = 3, .f = f, .g = {g[0], g[1], g[2]}, .b = {b[0], b[1], b[2]}, .smem = smem,
              .cluster_x = cluster_x ? cluster_x : 1, .args = copy});
}
