/* tp_comm.h - NCCL for tensor parallelism (issue 7), loaded at run time.
 *
 * libnccl.so.2 is dlopen()ed, as libcuda is (runtime/cuda_driver.h), so one
 * m3kit binary runs on machines without NCCL; only the tensor-parallel path
 * needs it.  Search order: $M3KIT_NCCL_LIB, the loader's paths
 * ("libnccl.so.2"), then the CUDA toolkit m3kit was built against.  One
 * process drives all ranks of a host (ncclCommInitAll: one thread, one
 * communicator per GPU); NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is
 * set unless the caller set it), as the lent machines require.
 */
#ifndef M3_TP_COMM_H
#define M3_TP_COMM_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#include "runtime/status.h"

typedef struct m3_tp_comm {
  int n_ranks;
  int version;                 /* NCCL_VERSION_CODE of the loaded library, e.g. 22805 */
  char lib[512];               /* the path that loaded */
  void *comms[8];              /* ncclComm_t per rank (n_ranks <= 8: one host) */
} m3_tp_comm;

/* Load NCCL and read its version; no GPU needed.  Errors: M3_UNSUPPORTED
 * (built without nccl.h, or no libnccl.so.2 on any searched path: the
 * message lists them). */
m3_status m3_tp_comm_load(m3_tp_comm *c, m3_err *e);

/* One communicator per device 0 .. n_ranks-1 of this host (after
 * m3_tp_comm_load).  Errors: M3_INVAL (n_ranks outside 1..8), M3_CUDA (fewer
 * GPUs than ranks, or an NCCL error, named). */
m3_status m3_tp_comm_init(m3_tp_comm *c, int n_ranks, m3_err *e);

/* In-place sum all-reduce of n fp32 values: buf[r] on device r, stream[r].
 * Errors: M3_CUDA (NCCL's message). */
m3_status m3_tp_allreduce_f32(m3_tp_comm *c, float *const *buf, size_t n, cudaStream_t const *stream, m3_err *e);

void m3_tp_comm_free(m3_tp_comm *c);

#endif
