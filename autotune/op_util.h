/* op_util.h - pieces the tuner adapters share (autotune/op_*.c): bucket
 * lists, how many rotating input sets push the timed reads out of L2, a paged
 * batch (sequences, block tables, one page range per rotating set) for the
 * indexer and attention adapters, a sample of query tokens the C reference
 * checks (a full reference of a 16K-token prefill would take minutes), and
 * the comparison of top-k block lists with the GPU tests' near-tie rule. */
#ifndef M3_TUNE_OP_UTIL_H
#define M3_TUNE_OP_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "ref/ref.h"
#include "runtime/harness.h"
#include "runtime/kernels.h"

/* Bytes one rotation cycle spans: > 4x the H200's 50-60 MB L2, so a timed
 * launch never finds its inputs in L2 from an earlier one. */
#define M3_TUNE_ROT_BYTES ((size_t)256 << 20)
#define M3_TUNE_MAX_SETS 32

/* ceil(M3_TUNE_ROT_BYTES / per_set) clamped to [1, M3_TUNE_MAX_SETS]. */
int m3_tune_sets(size_t per_set);

/* The steps the token-bucketed adapters tune for: decode batches 1 and 8,
 * the default prefill chunk (256) and a 4096-token chunk.  A step of at most
 * M3_TUNE_DECODE_ROWS rows takes the decode path (runtime/forward.c
 * DECODE_ROWS: GEMVs, the MoE layer without grouping), a larger one the
 * prefill path. */
#define M3_TUNE_DECODE_ROWS 8
#define M3_TUNE_N_STEPS 4
extern const int64_t m3_tune_steps[M3_TUNE_N_STEPS];

/* The power of two >= x (>= 1): how runtime/forward.c and the MoE layer
 * bucket a launch's row count. */
int64_t m3_tune_pow2(int64_t x);

/* Buckets "tokens" = m3_tune_pow2(rows[i]) for i < n, ascending, each once
 * (<= max).  Returns the count. */
int m3_tune_rows_buckets(const int64_t *rows, int n, m3_bucket *out, int max);

/* out[i] = {dims[0] = vals[i][0], dims[1] = vals[i][1]} for i < n (<= max);
 * names[1] NULL: one dimension.  Returns the count. */
int m3_tune_bucket_list(const char *const names[2], const int64_t (*vals)[2], int n, m3_bucket *out, int max);

/* The rotating input sets of an adapter: *dev = sets x set_bytes on the
 * device, set 0 uploaded from host, the others copies of it (on stream).
 * Errors: M3_CUDA, M3_CAPACITY (m3_dev_alloc's). */
m3_status m3_tune_upload_sets(void **dev, const void *host, size_t set_bytes, int sets, cudaStream_t stream,
                              m3_err *e);

/* Offsets and sizes inside a set rounded up to 256 bytes: every part stays
 * aligned for 16-byte loads whatever the part before it. */
static inline size_t m3_tune_up256(size_t b) { return (b + 255) & ~(size_t)255; }

/* A paged batch: n_seqs sequences of lengths lens[s], qlen[s] query tokens
 * at each one's last positions (NULL: one, decode), blocks of bs tokens on
 * distinct pages in a random order.  Rotating set r maps the same logical
 * blocks to pages + r * pages, so a cache of sets * pages pages whose set 0
 * is replicated holds `sets` copies that no two consecutive launches share. */
typedef struct m3_tune_batch {
  int n_seqs, n_tokens, bs, sets;
  int64_t pages, bt_stride, max_kv, max_blocks, visible; /* visible: sum of L(t) */
  int32_t *seq_lens, *token_seq, *bt;   /* host; bt: [sets, n_seqs, bt_stride] */
  int64_t *pos;
  void *d_lens, *d_seq, *d_pos, *d_bt;  /* device mirrors */
} m3_tune_batch;

/* cap > 0: a sequence of nb blocks owns min(nb, cap) pages and logical
 * block b lives on its page b mod cap (a kernel that reads only a few chosen
 * blocks, sparse decode, needs no 1M-token cache; choose blocks with
 * distinct residues and no page is read twice).  Errors: M3_NOMEM, M3_CUDA. */
m3_status m3_tune_batch_make(m3_tune_batch *p, int n_seqs, const int64_t *lens, const int *qlen, int bs, int64_t cap,
                             int sets, m3_rng *r, m3_err *e);
/* Host view of set 0 (for the reference: num_pages = pages), or device view
 * of set `set` (num_pages = sets * pages). */
m3_seq_batch m3_tune_batch_host(const m3_tune_batch *p);
m3_seq_batch m3_tune_batch_dev(const m3_tune_batch *p, int set);
void m3_tune_batch_free(m3_tune_batch *p);

/* At most `max` query tokens checked against the reference: all of them, or
 * the first, the last and evenly spread ones between (ascending).  tok[i] is
 * the original token index; seq/pos the host arrays of a batch with only
 * those tokens (the reference's input). */
typedef struct m3_tune_sample {
  int n;
  int *tok;
  int32_t *seq;
  int64_t *pos;
} m3_tune_sample;

m3_status m3_tune_sample_make(m3_tune_sample *s, const m3_tune_batch *p, int max, m3_err *e);
/* The host batch of set 0 restricted to the sample. */
m3_seq_batch m3_tune_sample_batch(const m3_tune_sample *s, const m3_tune_batch *p);
/* dst row i = src row tok[i] of `row_bytes` bytes. */
void m3_tune_sample_rows(const m3_tune_sample *s, const void *src, size_t row_bytes, void *dst);
void m3_tune_sample_free(m3_tune_sample *s);

/* Top-k lists of one token (`k` entries, nb visible blocks) from the GPU
 * against the reference's, with the reference's forced block scores `sc`
 * [>= nb]: the first min(k, nb) entries distinct blocks in [0, nb), the rest
 * -1; where an entry differs from the reference's, the two blocks' scores
 * must differ (an exact tie goes to the lower id) by at most 1e-5 relative (a
 * near-tie swap, counted in *swaps).  Returns 0 and writes why into detail
 * on a failure. */
int m3_tune_topk_row_ok(const int32_t *gpu, const int32_t *ref, const float *sc, int k, int64_t nb, int *swaps,
                        char *detail, size_t n);

/* Bytes that are finite both as e4m3 codes and, read in pairs, as bf16 of
 * magnitude 2^-7..2 (bench/cases_indexer.c's pattern): random inputs for
 * either dtype at memory speed. */
void m3_tune_fill_finite(m3_rng *r, void *p, size_t bytes);

/* Sets * per_set below the rotation span: flush L2 before a launch instead
 * (prepare is untimed). */
m3_status m3_tune_flush_if_small(int sets, size_t per_set, cudaStream_t stream, m3_err *e);

/* The device bytes [0, bytes) of `dev` against `ref`, bit for bit: M3_OK, or
 * M3_MISMATCH with "<what>: element i of n differs (got .. want ..)" (elements
 * of elem_bytes, 1..8, printed in hex) in detail.  Synchronises nothing: the
 * download does.  Errors: M3_CUDA, M3_NOMEM. */
m3_status m3_tune_expect_same(const void *dev, const void *ref, size_t bytes, size_t elem_bytes, const char *what,
                              char *detail, size_t n, m3_err *e);

/* Poison int32 outputs with 0x7e7e7e7e: not a block id, not the -1 padding. */
m3_status m3_tune_poison_ids(void *p, size_t bytes, cudaStream_t stream, m3_err *e);

#endif
