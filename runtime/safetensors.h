/* safetensors.h - read-only, memory-mapped reader for safetensors checkpoints,
 * single-file or sharded.  This is the only code that trusts nothing about a
 * weight file; everything downstream (inventory check, weight upload) gets
 * tensors whose bytes are known to exist.  Known faults 36-38.
 *
 * THE FORMAT (the subset we accept is the whole format):
 *
 *   [0, 8)          N: header length, uint64 little-endian
 *   [8, 8+N)        header: a UTF-8 JSON object (may be padded with trailing
 *                   spaces).  Keys are tensor names, except "__metadata__"
 *                   (an object of string -> string).  Each tensor entry:
 *                     { "dtype": "BF16", "shape": [d0, d1, ...],
 *                       "data_offsets": [begin, end] }
 *   [8+N, EOF)      the data section; offsets are relative to its start.
 *
 * Checks, each failing with M3_FORMAT and a message naming the file and, where
 * there is one, the tensor and field:
 *   - file at least 8 bytes; N <= file size - 8; N <= 100 MiB (M3_ST_MAX_HEADER);
 *   - header is valid UTF-8 JSON (jansson validates UTF-8), an object, no
 *     duplicate keys; "__metadata__" values are strings;
 *   - dtype is one of m3_dtype (unknown -> error naming tensor and dtype; never
 *     skipped); shape has <= 8 non-negative dims; data_offsets are two
 *     non-negative integers with begin <= end;
 *   - end <= data section size (else "file truncated");
 *   - numel(shape) x dtype size == end - begin;
 *   - no two non-empty tensors overlap.
 * POLICY for data bytes covered by no tensor (alignment padding, stale data):
 * a WARNING, recorded on the handle (m3_st_warning), not an error.  Nothing is
 * read from those bytes, so they cannot corrupt a weight; the official Rust
 * implementation is stricter, which the cross-check test relies on for files
 * we write (ours never have gaps).
 *
 * Zero-sized tensors (a 0 in the shape, offsets [n, n]) are valid.
 *
 * ALIGNMENT: the data section starts at 8 + N, which the format does not
 * require to be a multiple of anything, so `m3_st_tensor.data` may be
 * unaligned for its dtype.  Consumers must not dereference it as a typed
 * pointer (no `((const float *)t->data)[i]`): use memcpy, m3_st_copy or
 * m3_st_to_f32, or upload the bytes to the GPU as a blob.
 *
 * SHARDED checkpoints ("model.safetensors.index.json":
 *   { "metadata": {...}, "weight_map": { tensor name: shard file name } }):
 *   - a shard named by the index but absent on disk -> error naming the file;
 *   - shard names must be plain file names in the index's directory;
 *   - every tensor in weight_map must exist in the shard it names -> else error;
 *   - a tensor present in a shard but not in weight_map -> ERROR (policy: the
 *     index is stale or the shard is from another checkpoint; either way the
 *     set of weights is not the one the index describes);
 *   - the same tensor name in two shards -> error naming both files.
 * On any error nothing is returned (*out stays NULL): no partial checkpoint.
 */
#ifndef M3_SAFETENSORS_H
#define M3_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/status.h"

#define M3_ST_MAX_DIMS 8
#define M3_ST_MAX_HEADER (100u << 20) /* 100 MiB, as the official implementation */

/* dtype names exactly as the format spells them. */
#define M3_DTYPE_MAP(X)    \
  X(BOOL, "BOOL", 1)       \
  X(U8, "U8", 1)           \
  X(I8, "I8", 1)           \
  X(F8_E4M3, "F8_E4M3", 1) \
  X(F8_E5M2, "F8_E5M2", 1) \
  X(I16, "I16", 2)         \
  X(U16, "U16", 2)         \
  X(F16, "F16", 2)         \
  X(BF16, "BF16", 2)       \
  X(I32, "I32", 4)         \
  X(U32, "U32", 4)         \
  X(F32, "F32", 4)         \
  X(I64, "I64", 8)         \
  X(U64, "U64", 8)         \
  X(F64, "F64", 8)

typedef enum {
#define M3_X_DT(id, name, size) M3_DT_##id,
  M3_DTYPE_MAP(M3_X_DT)
#undef M3_X_DT
  M3_DT_COUNT
} m3_dtype;

/* "BF16"; "?" for an out-of-range value. */
const char *m3_dtype_name(m3_dtype d);
/* Bytes per element (0 for an out-of-range value). */
size_t m3_dtype_size(m3_dtype d);
/* Parse a format dtype name.  Returns 0 and sets *d, or -1 if unknown. */
int m3_dtype_parse(const char *name, m3_dtype *d);

typedef struct m3_st_tensor {
  const char *name;             /* as in the header */
  m3_dtype dtype;
  int ndim;                     /* 0..8 (0 = scalar, numel 1) */
  int64_t shape[M3_ST_MAX_DIMS];/* [ndim] valid */
  uint64_t numel;               /* product of shape (1 for a scalar) */
  const void *data;             /* read-only mapping; MAY BE UNALIGNED (see above) */
  uint64_t nbytes;              /* numel x dtype size == end - begin */
  const char *file;             /* path of the file holding it */
  uint64_t file_offset;         /* absolute byte offset of data in `file` */
} m3_st_tensor;

typedef struct m3_st m3_st;

/* Open a checkpoint.  `path` may be:
 *   - a directory: DIR/model.safetensors.index.json if present, else
 *     DIR/model.safetensors;
 *   - a "*.index.json" file (sharded; shards are looked up beside it);
 *   - a single .safetensors file.
 * Every file is mmap'd read-only and fully validated before return.
 * Errors: M3_NOTFOUND (no checkpoint / missing shard, naming the file),
 * M3_IO (open/mmap), M3_FORMAT (malformed header or index, naming the file and
 * tensor), M3_NOMEM.  On error *out is NULL. */
m3_status m3_st_open(const char *path, m3_st **out, m3_err *e);

/* Unmap and free.  NULL is fine.  Every m3_st_tensor pointer dies with it. */
void m3_st_close(m3_st *st);

/* Tensor lookup by exact name (binary search); NULL if absent. */
const m3_st_tensor *m3_st_find(const m3_st *st, const char *name);

/* Iteration: tensors sorted by name (bytewise), i in [0, m3_st_count). */
size_t m3_st_count(const m3_st *st);
const m3_st_tensor *m3_st_at(const m3_st *st, size_t i);

/* Files that make up the checkpoint (1 for single-file), in index order. */
size_t m3_st_n_files(const m3_st *st);
const char *m3_st_file(const m3_st *st, size_t i);
/* The index path, or NULL for a single file. */
const char *m3_st_index_path(const m3_st *st);

/* Warnings collected while opening (uncovered data bytes); each message names
 * the file and the byte range. */
size_t m3_st_n_warnings(const m3_st *st);
const char *m3_st_warning(const m3_st *st, size_t i);

/* A "__metadata__" string value from the first file that has `key`; NULL if none. */
const char *m3_st_metadata(const m3_st *st, const char *key);

/* Copy a tensor's bytes to `dst` (any alignment).  Errors: M3_RANGE when
 * dst_bytes < t->nbytes (naming the tensor). */
m3_status m3_st_copy(const m3_st_tensor *t, void *dst, size_t dst_bytes, m3_err *e);

/* Convert numel elements to f32 (BF16, F16, F32, F64, F8_E4M3 exact or, for
 * F64, rounded; E8M0 scales are U8 and not converted here).
 * Errors: M3_RANGE (n < numel), M3_UNSUPPORTED (other dtypes), naming the tensor. */
m3_status m3_st_to_f32(const m3_st_tensor *t, float *dst, size_t n, m3_err *e);

#endif
