/* emu_cublas.c - the cuBLAS subset m3kit uses, as plain loops, for the
 * emulator programs (linked instead of libcublas).  Column-major, as cuBLAS:
 * C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C; bf16/fp32 operands,
 * fp32 accumulation, one rounding at the store. */
#include <cublas_v2.h>
#include <stdlib.h>
#include <string.h>

#include "ref/numerics.h"

struct cublasContext { cudaStream_t s; };

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) { *h = calloc(1, sizeof(struct cublasContext)); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) { free(h); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) { h->s = s; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m) { (void)h; (void)m; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *w, size_t n) { (void)h; (void)w; (void)n; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t m) { (void)h; (void)m; return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "emulated cuBLAS error"; }
size_t cublasGetCudartVersion(void) { return 13000; }
cublasStatus_t cublasGetVersion_v2(cublasHandle_t h, int *v) { (void)h; *v = 130000; return CUBLAS_STATUS_SUCCESS; }

static float load(const void *p, cudaDataType t, size_t i) {
  return t == CUDA_R_16BF ? m3_bf16_to_f32(((const m3_bf16 *)p)[i]) : ((const float *)p)[i];
}
static void store(void *p, cudaDataType t, size_t i, float v) {
  if (t == CUDA_R_16BF) ((m3_bf16 *)p)[i] = m3_f32_to_bf16(v);
  else ((float *)p)[i] = v;
}

static cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float *alpha,
                           const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt, int ldb,
                           const float *beta, void *C, cudaDataType ct, int ldc) {
  if ((at != CUDA_R_16BF && at != CUDA_R_32F) || (bt != CUDA_R_16BF && bt != CUDA_R_32F) ||
      (ct != CUDA_R_16BF && ct != CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      float acc = 0;
      for (int l = 0; l < k; l++) {
        float a = ta == CUBLAS_OP_N ? load(A, at, (size_t)i + (size_t)l * lda) : load(A, at, (size_t)l + (size_t)i * lda);
        float b = tb == CUBLAS_OP_N ? load(B, bt, (size_t)l + (size_t)j * ldb) : load(B, bt, (size_t)j + (size_t)l * ldb);
        acc += a * b;
      }
      size_t ci = (size_t)i + (size_t)j * ldc;
      float old = *beta != 0 ? load(C, ct, ci) : 0;
      store(C, ct, ci, *alpha * acc + *beta * old);
    }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t ctype,
                            cublasGemmAlgo_t algo) {
  (void)h; (void)algo;
  if (ctype != CUBLAS_COMPUTE_32F && ctype != CUBLAS_COMPUTE_32F_FAST_TF32) return CUBLAS_STATUS_NOT_SUPPORTED;
  return gemm(ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType at, int lda,
                                          long long sa, const void *B, cudaDataType bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t ctype, cublasGemmAlgo_t algo) {
  (void)h; (void)algo; (void)ctype;
  size_t ea = at == CUDA_R_16BF ? 2 : 4, eb = bt == CUDA_R_16BF ? 2 : 4, ec = ct == CUDA_R_16BF ? 2 : 4;
  for (int b = 0; b < batch; b++) {
    cublasStatus_t s = gemm(ta, tb, m, n, k, alpha, (const char *)A + (size_t)b * sa * ea, at, lda,
                            (const char *)B + (size_t)b * sb * eb, bt, ldb, beta, (char *)C + (size_t)b * sc * ec, ct, ldc);
    if (s) return s;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                              const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                              float *C, int ldc) {
  (void)h;
  return gemm(ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C, CUDA_R_32F, ldc);
}
