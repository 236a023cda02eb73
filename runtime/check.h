/* check.h - wrappers that check every CUDA driver / runtime / cuBLAS call and
 * turn a failure into an m3_status with the call text, file:line and the API's
 * own error string, then return from the enclosing function (never abort). */
#ifndef M3_CHECK_H
#define M3_CHECK_H

#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "runtime/status.h"

m3_status m3_cu_fail(m3_err *e, CUresult r, const char *call, const char *file, int line);
m3_status m3_cuda_fail(m3_err *e, cudaError_t r, const char *call, const char *file, int line);
m3_status m3_cublas_fail(m3_err *e, cublasStatus_t r, const char *call, const char *file, int line);

#define M3_CU(e, call)                                                         \
  do {                                                                         \
    CUresult m3_r_ = (call);                                                   \
    if (m3_r_ != CUDA_SUCCESS) return m3_cu_fail((e), m3_r_, #call, __FILE__, __LINE__); \
  } while (0)
#define M3_CUDA(e, call)                                                       \
  do {                                                                         \
    cudaError_t m3_r_ = (call);                                                \
    if (m3_r_ != cudaSuccess) return m3_cuda_fail((e), m3_r_, #call, __FILE__, __LINE__); \
  } while (0)
#define M3_CUBLAS(e, call)                                                     \
  do {                                                                         \
    cublasStatus_t m3_r_ = (call);                                             \
    if (m3_r_ != CUBLAS_STATUS_SUCCESS) return m3_cublas_fail((e), m3_r_, #call, __FILE__, __LINE__); \
  } while (0)

#endif
