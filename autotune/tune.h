/* tune.h - `m3kit tune`: search every template's declared tile space for every
 * variant a model needs at the shapes the runtime launches, on the present GPU,
 * and record the winners (with every candidate's timings) in the tuning DB.
 *
 * Honest measurement (style.md practice 8, known-faults #32-#34):
 *   - candidates compile in parallel on all cores before any timing, so no
 *     recorded time contains compilation; compile errors and time-outs are
 *     dropped with their reason;
 *   - each candidate's outputs are poisoned and checked against the C
 *     reference on its first launch: a wrong candidate is INCORRECT, never timed
 *     and never recorded as the choice;
 *   - timing: warm-up, then >= 20 event-timed launches, each on the next of
 *     several input sets larger than L2 together, mutated inputs restored
 *     before every launch outside the timed window; median, p20, p80 kept;
 *   - a candidate replaces the template's default tile only when >= 2% faster.
 */
#ifndef M3_TUNE_H
#define M3_TUNE_H

#include <stdio.h>

#include "runtime/harness.h"
#include "runtime/kernels.h"

typedef struct m3_tune_opts {
  const char *preset;      /* default "minimax-m3" */
  const char *model_dir;   /* DIR/config.json instead of a preset */
  const char *only;        /* template names, comma separated ("mxfp8,attn_sparse"), or NULL for all */
  const char *shapes;      /* "tokens=1,64" style filter of buckets, or NULL */
  const char *variant;     /* only variants whose key contains this text, or NULL */
  const char *tiles;       /* only these tiles, ';'-separated ("warps=4;warps=8"), or NULL */
  double budget_s;         /* stop starting new shapes after this (0: none) */
  int reps;                /* timed launches per candidate (>= 20) */
  int warmup;              /* untimed launches first (>= 2) */
  int compile_timeout_s;   /* per candidate (default 60) */
  int jobs;                /* compile threads (default: online cores) */
  const char *command;     /* recorded as provenance */
  FILE *progress;          /* progress bar + ETA, or NULL */
  const char *db_path;     /* NULL: <cache>/tuning/<arch>.json */
} m3_tune_opts;

typedef struct m3_tune_row {
  char op[32], key[512], bucket[96], tile[128], default_tile[128], unit[8];
  double default_us, tuned_us, achieved, ceiling, pct;
  int n_candidates, n_passed, n_incorrect, n_failed;
  int recorded;            /* 1: the DB got this shape's record; 0: no candidate passed, the DB refused it
                            * (a warning says why), or a pinned record whose tile was not timed was left as
                            * it was (tile: the tuner's pick, if any) */
  double seconds;          /* wall time of this shape: setup, every candidate's check and timing, teardown */
} m3_tune_row;

typedef struct m3_tune_result {
  int n_rows;
  m3_tune_row *rows;       /* malloc'd */
  double copy_gbs;         /* the measured ceiling of this run */
  double seconds;
} m3_tune_result;

/* Errors: M3_CONFIG, M3_CUDA, M3_IO (DB not writable: records are kept in the
 * result and the error names the path). */
m3_status m3_tune_run(m3_rt *rt, const m3_tune_opts *o, m3_tune_result *res, m3_err *e);
void m3_tune_result_free(m3_tune_result *r);

struct m3_tune_op;
struct m3_tune_candidate;
/* Per-launch time of `launches` back-to-back launches of candidate k (input
 * set = launch index, rotating) captured as one CUDA graph, `reps` replays:
 * how a decode step runs it.  Used for short kernels by the tuner and by
 * `m3kit bench`.  Errors: M3_CUDA (capture, replay), the adapter's launch. */
m3_status m3_tune_graph_time(const struct m3_tune_op *op, void *st, const m3_kernel *k, cudaStream_t stream, int launches,
                             int reps, m3_timing *t, m3_err *e);

/* Time kernel k through adapter op on state st: `warmup` untimed launches,
 * then up to `reps` event-timed ones, each after an untimed prepare (restore
 * + rotation); stops early when its first event-timed runs are 3x slower
 * than best_so_far (> 0), which must be an event-timed median too.  Then,
 * by *graph (NULL as 0): 0, short kernels (event median under 30 us, or
 * $M3KIT_TUNE_GRAPH_US) are re-timed as a CUDA graph; 1, every kernel is;
 * -1, none is.  *graph is set to whether that happened (the tuner keeps a
 * shape's candidates on one clock with it).  Fills median/p20/p80 (µs, graph-timed
 * where that applied), n_runs and PASSED or SKIPPED_SLOWER; *event_us (may
 * be NULL): the event-timed median.  Errors: M3_CUDA. */
m3_status m3_tune_time_kernel(m3_rt *rt, const struct m3_tune_op *op, void *st, const m3_kernel *k, int warmup,
                              int reps, double best_so_far, int *graph, struct m3_tune_candidate *c, double *event_us,
                              m3_err *e);

/* Device-to-device copy bandwidth (read + write bytes / time), GB/s. */
m3_status m3_measure_copy_gbs(m3_rt *rt, double *gbs, m3_err *e);

/* 1 if `name` is one of the comma-separated names of `list` (whole names: the
 * --only lists of m3kit tune and m3kit bench). */
int m3_tune_name_in_list(const char *list, const char *name);

#endif
