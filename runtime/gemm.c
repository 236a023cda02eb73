/* gemm.c - the cuBLAS wrappers of gemm.h.  One place owns the row-major ->
 * column-major mapping, the compute type and the math mode, so no caller can
 * get a TF32 router or a bf16 split-K reduction by accident. */
#include "runtime/gemm.h"

#include <inttypes.h>
#include <limits.h>
#include <string.h>

#include "runtime/check.h"

/* 32 MiB: what NVIDIA recommends for Hopper's cuBLAS kernels. */
#define WS_BYTES ((size_t)32 << 20)

m3_status m3_gemm_open(m3_gemm *g, cudaStream_t stream, m3_err *e) {
  memset(g, 0, sizeof *g);
  M3_CUBLAS(e, cublasCreate(&g->h));
  cublasMath_t mode = (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  cudaError_t r = cudaMalloc(&g->workspace, WS_BYTES);
  if (r != cudaSuccess) {
    m3_status s = m3_cuda_fail(e, r, "cudaMalloc(cuBLAS workspace)", __FILE__, __LINE__);
    m3_gemm_close(g);
    return s;
  }
  g->ws_bytes = WS_BYTES;
  cublasStatus_t c = cublasSetMathMode(g->h, mode);
  if (c == CUBLAS_STATUS_SUCCESS) c = cublasSetWorkspace(g->h, g->workspace, g->ws_bytes);
  if (c == CUBLAS_STATUS_SUCCESS) c = cublasSetStream(g->h, stream);
  if (c != CUBLAS_STATUS_SUCCESS) {
    m3_status s = m3_cublas_fail(e, c, "cublasSetMathMode/Workspace/Stream", __FILE__, __LINE__);
    m3_gemm_close(g);
    return s;
  }
  g->stream = stream;
  return M3_OK;
}

void m3_gemm_close(m3_gemm *g) {
  if (g->h) cublasDestroy(g->h);
  if (g->workspace) cudaFree(g->workspace);
  memset(g, 0, sizeof *g);
}

m3_status m3_gemm_set_stream(m3_gemm *g, cudaStream_t stream, m3_err *e) {
  M3_CUBLAS(e, cublasSetStream(g->h, stream));
  g->stream = stream;
  return M3_OK;
}

/* Shapes and pitches fit cuBLAS's int arguments and make sense. */
static m3_status check_shape(const char *what, int64_t n, int64_t rows, int64_t cols, int64_t *ldx,
                             int64_t *ldw, int64_t *ldy, m3_err *e) {
  if (!*ldx) *ldx = cols;
  if (!*ldw) *ldw = cols;
  if (!*ldy) *ldy = rows;
  if (n < 0 || rows < 1 || cols < 1 || n > INT_MAX || rows > INT_MAX || cols > INT_MAX || *ldx < cols ||
      *ldw < cols || *ldy < rows || *ldx > INT_MAX || *ldw > INT_MAX || *ldy > INT_MAX)
    return m3_errf(e, M3_INVAL,
                   "%s: bad shape n %" PRId64 ", w [%" PRId64 ", %" PRId64 "], pitches x %" PRId64 " w %" PRId64
                   " y %" PRId64 " (sizes >= 1 and <= INT_MAX, pitches >= the row length)",
                   what, n, rows, cols, *ldx, *ldw, *ldy);
  return M3_OK;
}

m3_status m3_gemm_bf16(m3_gemm *g, int64_t n, int64_t rows, int64_t cols, const void *x, int64_t ldx,
                       const void *w, int64_t ldw, void *y, int64_t ldy, m3_err *e) {
  M3_TRY(check_shape("gemm bf16", n, rows, cols, &ldx, &ldw, &ldy, e));
  if (!n) return M3_OK;
  const float one = 1.0f, zero = 0.0f;
  /* Column-major view: row-major W [rows, cols] is W' = Wᵀ [cols, rows], so
   * op(W') = OP_T gives W; row-major X [n, cols] is Xᵀ [cols, n] (OP_N);
   * the product W · Xᵀ [rows, n] column-major is row-major Y [n, rows]. */
  M3_CUBLAS(e, cublasGemmEx(g->h, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)n, (int)cols, &one, w,
                            CUDA_R_16BF, (int)ldw, x, CUDA_R_16BF, (int)ldx, &zero, y, CUDA_R_16BF, (int)ldy,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return M3_OK;
}

m3_status m3_gemm_f32(m3_gemm *g, int64_t n, int64_t rows, int64_t cols, const float *x, int64_t ldx,
                      const float *w, int64_t ldw, float *y, int64_t ldy, m3_err *e) {
  M3_TRY(check_shape("gemm f32", n, rows, cols, &ldx, &ldw, &ldy, e));
  if (!n) return M3_OK;
  const float one = 1.0f, zero = 0.0f;
  M3_CUBLAS(e, cublasGemmEx(g->h, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)n, (int)cols, &one, w, CUDA_R_32F,
                            (int)ldw, x, CUDA_R_32F, (int)ldx, &zero, y, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
  return M3_OK;
}
