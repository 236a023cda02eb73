/* gemm.h - cuBLAS GEMMs for the linear layers that are compute-bound
 * (prefill: qkv, o_proj, MLP and grouped expert GEMMs, lm_head) and the fp32
 * router (spec §10.1).  Decode-sized GEMMs (n <= 8 tokens) go through the
 * GEMV kernels of templates/mxfp8.lua instead (runtime/op_ffn.h).
 *
 * Conventions: weights are stored PyTorch-style W [rows, cols] row-major
 * (out_features x in_features) and applied as y = x · Wᵀ, x [n, cols],
 * y [n, rows], all row-major with leading dimensions in elements (ld >= the
 * row length).  In cuBLAS's column-major terms that is the "TN" GEMM
 * Yᵀ = W · Xᵀ, the layout cuBLAS runs fastest.
 *
 * Numerics: bf16 operands with CUBLAS_COMPUTE_32F (fp32 accumulation) and
 * CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, so split-K partial sums
 * stay fp32 too and the only bf16 rounding is the final store, as m3_ref_gemm_
 * bf16; the fp32 GEMM uses CUBLAS_COMPUTE_32F without TF32 (the router is
 * fully fp32, §7.2).  Summation order differs from the references: compare
 * with ||y - ref|| / ||ref|| (tests use 1e-2).
 */
#ifndef M3_GEMM_H
#define M3_GEMM_H

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "runtime/status.h"

/* A cuBLAS handle bound to one stream, with its own workspace (set
 * explicitly so cuBLAS never allocates inside a captured graph). */
typedef struct m3_gemm {
  cublasHandle_t h;
  cudaStream_t stream;
  void *workspace;         /* device, ws_bytes */
  size_t ws_bytes;
} m3_gemm;

/* Create the handle on the current device and bind it to `stream`.
 * Errors: M3_CUBLAS (cublasCreate etc., with cuBLAS's status string),
 * M3_CUDA (workspace allocation). */
m3_status m3_gemm_open(m3_gemm *g, cudaStream_t stream, m3_err *e);
void m3_gemm_close(m3_gemm *g);

/* Rebind to another stream.  Errors: M3_CUBLAS. */
m3_status m3_gemm_set_stream(m3_gemm *g, cudaStream_t stream, m3_err *e);

/* y [n, rows] bf16 = x [n, cols] bf16 · w [rows, cols]ᵀ bf16, fp32
 * accumulation, one rounding.  ldx, ldw, ldy: row pitches in elements (pass 0
 * for contiguous: cols, cols, rows).  n == 0 does nothing.  y must not alias
 * x or w.  Asynchronous on the handle's stream.
 * Errors: M3_INVAL (negative sizes, a dimension or pitch above INT_MAX,
 * pitch below the row length), M3_CUBLAS. */
m3_status m3_gemm_bf16(m3_gemm *g, int64_t n, int64_t rows, int64_t cols, const void *x, int64_t ldx,
                       const void *w, int64_t ldw, void *y, int64_t ldy, m3_err *e);

/* y [n, rows] fp32 = x [n, cols] fp32 · w [rows, cols]ᵀ fp32 (the router:
 * x is float(m), e.g. rmsnorm's f32copy output; w the fp32 gate weight).
 * Same pitch rules and errors as m3_gemm_bf16. */
m3_status m3_gemm_f32(m3_gemm *g, int64_t n, int64_t rows, int64_t cols, const float *x, int64_t ldx,
                      const float *w, int64_t ldw, float *y, int64_t ldy, m3_err *e);

#endif
