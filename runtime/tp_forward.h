/* tp_forward.h - the tensor-parallel driver (issue 7): N ranks, one host
 * thread each, running one model together (spec §3.2, §9.3).
 *
 * Each rank thread owns its kernel context (m3_rt: stream, JIT, tuning DB)
 * on device rank % device count, its rank's model (runtime/model.h:
 * m3_model_opts.tp / rank), its KV cache (the rank's KV heads; the index-K
 * cache whole) and its forward (runtime/forward.h), joined to the others by
 * a link (runtime/tp_comm.h).  The caller's thread posts every call to all
 * ranks and waits for them; it never touches CUDA itself while ranks run.
 *
 * Backends (runtime/tp_comm.h):
 *   M3_TP_NCCL   rank r on GPU r; the ranks run concurrently; decode graphs
 *                stay on (NCCL's collectives are capturable).
 *   M3_TP_LOCAL  ranks may share a device (rank r on device r % n_devices):
 *                the rank threads take turns under the group's mutex (only
 *                one touches CUDA at a time, which the CPU emulator needs),
 *                meeting in host-memory collectives; decode graphs are off.
 * With tp == 1 there is no link and no collective: the one rank runs the
 * single-GPU forward (graphs included) on its own thread, bit for bit what
 * m3_forward gives.
 *
 * Every rank samples from the same gathered logits row, so each call checks
 * that all ranks chose the same tokens (and, when logits are asked for, got
 * bit-identical rows): M3_MISMATCH otherwise.  Inputs are validated on the
 * host before any rank runs (a bad id is M3_RANGE with every rank's state
 * unchanged).  A rank failing mid-step wakes the others (local: the waiting
 * ranks return; NCCL: the communicators are aborted).  Local backend: if
 * every rank failed the step, each rank has taken it back (forward.h) and the
 * group stays usable; if only some did, their caches differ and the group
 * refuses further calls (close it).  NCCL: an aborted group has no
 * communicators left and always refuses further calls.
 */
#ifndef M3_TP_FORWARD_H
#define M3_TP_FORWARD_H

#include <stdint.h>

#include "runtime/forward.h"
#include "runtime/kv_cache.h"
#include "runtime/model.h"
#include "runtime/tp_comm.h"

typedef struct m3_tp_opts {
  int tp;                  /* ranks, 1 .. M3_TP_COMM_MAX */
  m3_tp_backend backend;   /* M3_TP_NCCL needs tp GPUs; M3_TP_LOCAL shares them */
  int n_devices;           /* local: GPUs to spread the ranks over (0: every GPU of the host) */
  m3_model_opts model;     /* the whole model (tp and rank are set per rank) */
  m3_kv_opts kv;           /* each rank's cache (sized by the rank's config) */
  m3_fwd_opts fwd;         /* tp is set per rank */
} m3_tp_opts;

typedef struct m3_tp_group m3_tp_group;

/* Start the rank threads; each opens its device, loads its slice of the
 * model, its cache and its forward.  NCCL: loads the library and one
 * communicator per GPU first.  Errors: M3_INVAL (tp outside 1..8, a backend
 * that does not exist), M3_UNSUPPORTED / M3_CUDA (NCCL: not loadable, fewer
 * GPUs than ranks, NCCL older than 2.10), M3_NOMEM, and any rank's error of
 * m3_rt_open / m3_model_load / m3_kv_init / m3_forward_create, prefixed
 * "rank R: ". */
m3_status m3_tp_open(const m3_tp_opts *o, m3_tp_group **out, m3_err *e);
/* Stop the threads and free every rank's state.  NULL is a no-op. */
void m3_tp_close(m3_tp_group *g);

/* The whole model's config (rank configs: m3_tp_rank_config). */
const m3_config *m3_tp_config(const m3_tp_group *g);
int m3_tp_ranks(const m3_tp_group *g);

/* Admit / release a sequence on every rank (m3_kv_admit / m3_kv_release;
 * every rank's cache hands out the same id).  Errors: those of m3_kv_admit,
 * M3_INVAL (the group is unusable). */
m3_status m3_tp_admit(m3_tp_group *g, int64_t total_tokens, int *seq, m3_err *e);
void m3_tp_release(m3_tp_group *g, int seq);

/* m3_forward_prefill / m3_forward_decode on every rank: ids, next and logits
 * ([n, vocab] fp32: the gathered whole rows) as there; next and logits are
 * rank 0's, checked equal on every rank.  Errors: those of the forward
 * (a rank's error prefixed "rank R: "), M3_MISMATCH (ranks disagree),
 * M3_INVAL (the group is unusable after a partial failure). */
m3_status m3_tp_prefill(m3_tp_group *g, int seq, int n, const int32_t *ids, const m3_sampling *smp, int32_t *next,
                        float *logits, m3_err *e);
m3_status m3_tp_decode(m3_tp_group *g, int n, const int *seqs, const int32_t *ids, const m3_sampling *smp,
                       int32_t *next, float *logits, m3_err *e);

/* `m3kit run --tp N --synthetic-cache`: m3_kv_fill_synthetic on every rank's
 * cache, on the rank's own thread and device: each of the batch sequences
 * seqs[] gets n more tokens on every rank (the same lengths and slots
 * everywhere), and every rank fills its KV cache (its KV heads) and its
 * whole index-K cache with the same seed.  The same seed is what keeps the
 * ranks consistent with one model: the fill is counter-based, so the
 * replicated index-K head holds the same bits on every rank, as does a KV
 * head held by several ranks (tp > nkv).  Checked on the host first (the
 * sequences admitted, n more tokens within what each was admitted with), so
 * a bad call changes no rank.  Errors: M3_INVAL (n < 1, a sequence not
 * admitted, the group unusable), M3_CAPACITY, a rank's error of
 * m3_kv_fill_synthetic prefixed "rank R: " (then, if other ranks filled,
 * the group is unusable as after any partial failure). */
m3_status m3_tp_fill_synthetic(m3_tp_group *g, const int *seqs, int batch, int n, uint64_t seed, m3_err *e);

/* Every rank's per-op timing table (opts.fwd.timing; m3_forward_timing),
 * each read back by the rank's own thread: rank r's rows are
 * out[r * max ...], n[r] of them (n has tp entries).  A collective's row on
 * a rank times the rank's wait for the slowest one too (its events bracket
 * the call on the rank's stream), which is what a step pays for it.
 * Errors: M3_INVAL (the group is unusable), a rank's M3_CUDA. */
m3_status m3_tp_timing(m3_tp_group *g, m3_fwd_op_time *out, int max, int *n, m3_err *e);
/* Zero every rank's timing table (m3_forward_reset_timing), e.g. between
 * the prefill and the decode steps.  Errors: none. */
void m3_tp_reset_timing(m3_tp_group *g);

/* Test hook: m3_forward_debug_selection on every rank, in the WHOLE model's
 * layout, host [L][nkv][n][topk] int32 for a call of n tokens (forward.h):
 *   override  each rank attends over its KV heads' rows of it;
 *   capture   receives each rank's indexer output in its KV heads' rows (a
 *             head replicated on several ranks: the highest rank's, which
 *             must equal the others' since their inputs are the same bits).
 * Until called again with NULLs; a prefill must then be one chunk (n <=
 * max_chunk), else M3_INVAL.  Errors: none here. */
void m3_tp_debug_selection(m3_tp_group *g, int32_t *capture, const int32_t *override);

/* What one rank holds and has done. */
typedef struct m3_tp_rank_info {
  int device;                  /* CUDA ordinal */
  uint64_t weight_bytes;       /* device bytes of its weights (m3_model.weight_bytes) */
  uint64_t peak_bytes;         /* most held while loading (its slice + one whole tensor) */
  uint64_t kv_bytes;           /* its KV + index-K caches */
  uint64_t kv_bytes_per_token; /* its caches per token (§9.3 under TP) */
  uint64_t allreduces, allgathers; /* collectives executed so far (m3_forward_tp_counts) */
  uint64_t graph_replays;      /* decode steps replayed from CUDA graphs (m3_forward_graph_replays) */
  double load_s;               /* time to open its device, model, cache and forward */
  char source[160];            /* its model's m3_model.source */
} m3_tp_rank_info;

/* Errors: M3_INVAL (rank outside the group). */
m3_status m3_tp_info(const m3_tp_group *g, int rank, m3_tp_rank_info *out, m3_err *e);

/* The tokens rank `rank` chose in the last prefill / decode ([n] of that
 * call; tests assert every rank's equal).  NULL for a rank outside. */
const int32_t *m3_tp_rank_tokens(const m3_tp_group *g, int rank);

#endif
