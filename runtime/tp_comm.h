/* tp_comm.h - the collectives of tensor parallelism (issue 7): one small
 * interface, two backends.
 *
 * A rank's forward (runtime/forward.h) sees only an m3_tp_link, its endpoint
 * in the group, and calls two collectives on its own stream:
 *   m3_tp_allreduce_bf16  in-place sum of a bf16 [tokens, hidden] block: the
 *                         o_proj and MLP/MoE partial sums (spec §3.2's
 *                         row-parallel o_proj and down projections);
 *   m3_tp_allgather_f32   every rank's fp32 block concatenated in rank order:
 *                         the lm_head's vocabulary slices.
 * Every rank of a group must issue the same collectives in the same order
 * with the same counts (the forward does: the model's op sequence).
 *
 * Backends:
 *   NCCL   ranks on distinct GPUs of one host.  libnccl.so.2 is dlopen()ed,
 *          as libcuda is (runtime/cuda_driver.h), so one m3kit binary runs on
 *          machines without NCCL.  Search order: $M3KIT_NCCL_LIB, the
 *          loader's paths ("libnccl.so.2"), then the CUDA toolkit m3kit was
 *          built against.  One process drives all ranks (ncclCommInitAll, one
 *          communicator per GPU; each rank's thread then calls its own
 *          communicator: no group calls needed).  NVLink multicast stays off
 *          (NCCL_NVLS_ENABLE=0 unless the caller set it), as the lent
 *          machines require.  The collectives are asynchronous on the stream
 *          and capturable into CUDA graphs (NCCL >= 2.9), so decode graphs
 *          stay on.  bf16 needs NCCL >= 2.10 (ncclBfloat16).
 *   local  ranks sharing a device or a process (tests; the CPU emulator has
 *          one device and is not thread-safe).  The rank threads take turns
 *          under one mutex the caller owns (`turn`): a rank holds it while it
 *          touches CUDA and gives it up only while it waits in a collective.
 *          A contribution goes to host memory after a stream sync; the last
 *          rank to arrive reduces in rank order, in fp32, rounding once, so
 *          every rank gets bit-identical sums; each rank copies the result
 *          back and syncs.  Host synchronisation inside: not capturable
 *          (the forward turns decode graphs off for it).
 *
 * Failure: a rank that fails between collectives would leave the others
 * waiting for it.  The owner of the group (runtime/tp_forward.c) then aborts
 * it: m3_tp_local_abort wakes the waiting ranks with an error,
 * m3_tp_comm_abort aborts the NCCL communicators (ncclCommAbort).
 */
#ifndef M3_TP_COMM_H
#define M3_TP_COMM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "runtime/status.h"

#define M3_TP_COMM_MAX 8 /* ranks of one host */

/* ---- NCCL: the host's communicators ------------------------------------ */

typedef struct m3_tp_comm {
  int n_ranks;
  int version;                   /* NCCL_VERSION_CODE of the loaded library, e.g. 22805 */
  char lib[512];                 /* the path that loaded */
  void *comms[M3_TP_COMM_MAX];   /* ncclComm_t per rank */
  /* Abort safety: a rank enqueues on its communicator only under enq[rank]
   * and only while `aborted` is 0; m3_tp_comm_abort sets it and takes every
   * enq[] before ncclCommAbort, so no rank ever calls into a communicator
   * that is being (or has been) aborted, and NCCL never sees one
   * communicator used from two threads at once. */
  int aborted;
  int n_enq;                     /* enq[0 .. n_enq) initialised */
  pthread_mutex_t enq[M3_TP_COMM_MAX];
} m3_tp_comm;

/* Load NCCL and read its version; no GPU needed.  Errors: M3_UNSUPPORTED
 * (built without nccl.h, or no libnccl.so.2 on any searched path: the
 * message lists them). */
m3_status m3_tp_comm_load(m3_tp_comm *c, m3_err *e);

/* One communicator per device 0 .. n_ranks-1 of this host (after
 * m3_tp_comm_load).  Errors: M3_INVAL (n_ranks outside 1..8), M3_CUDA (fewer
 * GPUs than ranks, or an NCCL error, named). */
m3_status m3_tp_comm_init(m3_tp_comm *c, int n_ranks, m3_err *e);

/* In-place sum all-reduce of n fp32 values: buf[r] on device r, stream[r],
 * issued for every rank from one thread (one NCCL group).
 * Errors: M3_INVAL (no communicators), M3_CUDA (NCCL's message). */
m3_status m3_tp_allreduce_f32(m3_tp_comm *c, float *const *buf, size_t n, cudaStream_t const *stream, m3_err *e);

/* Abort every communicator (ncclCommAbort): collectives in flight return
 * and the communicators are gone (n_ranks becomes 0).  For a group whose
 * rank failed mid-step.  From any thread: it sets the group's abort flag,
 * then takes every rank's enqueue lock before aborting, so a rank is never
 * inside an NCCL call on a communicator being aborted, and every later
 * collective of a link returns the abort's error (link.gave_up = 1) without
 * calling NCCL.  (NCCL_RUNTIME_CONNECT=0, set at init, keeps an enqueue from
 * waiting on a peer while it holds its lock.) */
void m3_tp_comm_abort(m3_tp_comm *c);

void m3_tp_comm_free(m3_tp_comm *c);

/* ---- local: ranks that share a device / process ------------------------ */

typedef struct m3_tp_local m3_tp_local;

/* The shared state of n_ranks (1..M3_TP_COMM_MAX) local ranks; `turn` is the
 * mutex the rank threads hold while they run (owned by the caller, outlives
 * the group).  Errors: M3_INVAL (n_ranks), M3_NOMEM. */
m3_status m3_tp_local_create(int n_ranks, pthread_mutex_t *turn, m3_tp_local **out, m3_err *e);
void m3_tp_local_free(m3_tp_local *g);
/* Wake every rank waiting in a collective; they return M3_CUDA "... gave
 * up: another rank failed" until m3_tp_local_reset.  Caller holds turn. */
void m3_tp_local_abort(m3_tp_local *g);
/* Forget a collective left half done by a failure (no rank may be inside
 * one: the owner calls it once every rank has returned).  Caller holds turn. */
void m3_tp_local_reset(m3_tp_local *g);

/* ---- a rank's endpoint ------------------------------------------------- */

typedef enum m3_tp_backend { M3_TP_NCCL = 0, M3_TP_LOCAL = 1 } m3_tp_backend;

typedef struct m3_tp_link {
  m3_tp_backend backend;
  int rank, n_ranks;
  int capturable;       /* 1: the collectives may be captured into CUDA graphs (NCCL) */
  void *nccl;           /* this rank's ncclComm_t (NCCL) */
  m3_tp_comm *comm;     /* its group (NCCL): the abort flag and enqueue lock */
  m3_tp_local *local;   /* (local) */
  int gave_up;          /* a collective returned because the group was aborted */
} m3_tp_link;

/* Rank `rank`'s endpoint of an initialised NCCL group.  Errors: M3_INVAL
 * (rank outside the group), M3_UNSUPPORTED (NCCL older than 2.10: no bf16). */
m3_status m3_tp_link_nccl(m3_tp_comm *c, int rank, m3_tp_link *out, m3_err *e);
/* Rank `rank`'s endpoint of a local group (rank < its n_ranks). */
void m3_tp_link_local(m3_tp_local *g, int rank, m3_tp_link *out);

/* In place: buf [n] bf16 (device, on stream) <- the sum over the ranks of
 * their buf.  NCCL: asynchronous (ncclBfloat16 sum); local: synchronises,
 * sums in fp32 in rank order and rounds to bf16 once (round-to-nearest-even),
 * identical on every rank (NCCL's ring rounds to bf16 at every step: the
 * two backends may differ by a few ulps, within bf16 tolerance).  Errors: M3_INVAL (local: the ranks disagree on
 * the collective or its count), M3_NOMEM, M3_CUDA (a CUDA or NCCL call, or
 * the group was aborted). */
m3_status m3_tp_allreduce_bf16(m3_tp_link *l, void *buf, size_t n, cudaStream_t stream, m3_err *e);

/* recv [n_ranks, n] fp32 (device) <- every rank's send [n] fp32 (device), in
 * rank order; send and recv must not overlap.  Asynchronous on NCCL,
 * synchronising on local.  Errors: as m3_tp_allreduce_bf16. */
m3_status m3_tp_allgather_f32(m3_tp_link *l, const float *send, float *recv, size_t n, cudaStream_t stream,
                              m3_err *e);

#endif
