/* tunedb.h - the on-disk tuning database: what `m3kit tune` measured, and the
 * lookup the runtime uses to pick a tile for a kernel variant at a shape.
 *
 * Owns: the record model, the JSON file format, load-time staleness filtering,
 * lock-protected merge-on-save, nearest-bucket lookup, and the readable/plot
 * outputs of `m3kit tune --show/--plot`.  It is plain C file I/O (no CUDA, no
 * Lua): the cache layer sits below the runtime, so the template's valid() is
 * reached through a callback (see m3_tunedb_lookup).  Implements style.md
 * practice 7 (provenance, stale rejection, default fallback) and carries the
 * data of practice 8 (every candidate's disposition and timing quantiles).
 *
 * ---------------------------------------------------------------------------
 * FILE FORMAT (version 1; full prose and an example in docs/tuning-db.md)
 * ---------------------------------------------------------------------------
 * Location: <cache root>/tuning/<arch>.json (m3_tunedb_path), one file per SM
 * arch, plus an optional read-only seed file (cache/seed/<arch>.json, committed
 * H200 measurements).  The file is UTF-8 JSON, written by jansson, one field
 * per line and one candidate per line so that diffs of the seed stay readable:
 *
 *   {
 *     "format": "m3kit-tunedb",          required, exactly this string
 *     "version": 1,                      required; > 1: file ignored on load,
 *                                        never overwritten by save
 *     "records": [ RECORD, ... ]         required array
 *   }
 *
 *   RECORD (identity = key + bucket + arch):
 *     "key"          string  required  canonical variant key, e.g.
 *                                      "qknorm_rope(attn=sparse,insert=1,kv=bf16,idxk=e4m3)";
 *                                      the template name is the text before '('
 *     "bucket"       string  required  shape it was tuned at, "tokens=1,ctx=131072"
 *     "arch"         string  required  "sm_90"
 *     "tile"         string  required  the chosen tile, "warps=4,tok=2"
 *     "default_tile" string            the template's default_tile() then
 *     "default_us"   number            median of the default tile, µs
 *     "tuned_us"     number            median of the chosen tile, µs
 *     "provenance"   object            gpu, sm_count, driver_version,
 *                                      nvrtc_version, cublas_version,
 *                                      template_hash (REQUIRED), m3kit_version,
 *                                      date (ISO 8601 UTC), command
 *     "metric"       object            unit ("GB/s" | "TFLOP/s"), achieved,
 *                                      ceiling, pct_of_ceiling (0..100)
 *     "candidates"   array             EVERY candidate tried: tile, disposition,
 *                                      reason, median_us, p20_us, p80_us, n
 *   Numbers that were not measured are written as null.  Reals keep 10
 *   significant digits.  Unknown fields anywhere are tolerated (counted as
 *   warnings) and preserved on disk by save_merge.
 *
 * Load rules: a record for another arch, another template hash (or a template
 * this build does not have), or - user records only - another driver is
 * STALE: ignored and counted, and the caller prints ONE summary line
 * (m3_tunedb_report.summary).
 * A record missing a required field, with an ill-typed known field, or whose
 * chosen tile is a non-PASSED candidate (fault 32) is skipped and counted.
 * A truncated/garbled file gives M3_FORMAT naming the file, line and column;
 * the handle keeps what else loaded (the seed), so the caller runs on.
 *
 * Threads: a handle is not locked; concurrent lookups on an unchanging handle
 * are safe.  Processes: writers serialise on "<path>.lock" (m3_lock) and
 * publish with m3_write_atomic, so readers need no lock.
 */
#ifndef M3_TUNEDB_H
#define M3_TUNEDB_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/status.h"

#define M3_TUNEDB_FORMAT "m3kit-tunedb"
#define M3_TUNEDB_VERSION 1

/* ------------------------------------------------------------------------- */
/* Shape buckets                                                             */
/* ------------------------------------------------------------------------- */

/* A shape bucket: up to 4 named non-negative integer dimensions in the order
 * the op declares them (e.g. tokens, ctx).  Canonical text: "tokens=1,ctx=131072"
 * (decimal, no spaces, no leading zeros; zero dims print as "").  Equality and
 * lookup match dimensions by NAME, so order only affects printing. */
#define M3_BUCKET_MAX_DIMS 4
#define M3_BUCKET_NAME_MAX 16 /* including the NUL: names up to 15 chars */
#define M3_BUCKET_STR_MAX 160 /* enough for 4 × (15 + '=' + 20 digits + ',') */

typedef struct m3_bucket {
  int ndims;
  struct {
    char name[M3_BUCKET_NAME_MAX]; /* [a-z][a-z0-9_]* */
    int64_t value;                 /* >= 0 */
  } dims[M3_BUCKET_MAX_DIMS];
} m3_bucket;

/* Append dimension `name` = `value` (start from `m3_bucket b = {0};`).  Errors: M3_INVAL (bad or duplicate name,
 * negative value), M3_RANGE (more than M3_BUCKET_MAX_DIMS). */
m3_status m3_bucket_add(m3_bucket *b, const char *name, int64_t value, m3_err *e);
/* Parse canonical text; parse-then-format returns the identical string.
 * Errors: M3_FORMAT naming the offending part. */
m3_status m3_bucket_parse(const char *s, m3_bucket *b, m3_err *e);
/* Canonical text into buf; returns the length it needed (snprintf style). */
int m3_bucket_format(const m3_bucket *b, char *buf, size_t n);
/* Same set of names with the same values (order-insensitive). */
int m3_bucket_equal(const m3_bucket *a, const m3_bucket *b);
/* The value of dimension `name`, or -1 when absent. */
int64_t m3_bucket_get(const m3_bucket *b, const char *name);

/* ------------------------------------------------------------------------- */
/* Records                                                                   */
/* ------------------------------------------------------------------------- */

/* What happened to one candidate tile (CUTLASS Disposition, practice 8). */
#define M3_DISPOSITION_MAP(X)                                                  \
  X(PASSED)          /* verified against ref/, then timed */                   \
  X(INCORRECT)       /* ran, disagreed with the reference: never chosen */     \
  X(NOT_SUPPORTED)   /* valid() refused it, or the device cannot run it */     \
  X(COMPILE_ERROR)   /* NVRTC failed */                                        \
  X(COMPILE_TIMEOUT) /* NVRTC ran past the tuner's limit */                    \
  X(LAUNCH_ERROR)    /* launch or execution failed */                          \
  X(SKIPPED_SLOWER)  /* early stop: clearly slower than the best so far */

typedef enum {
#define M3_X_DISP(name) M3_DISP_##name,
  M3_DISPOSITION_MAP(M3_X_DISP)
#undef M3_X_DISP
  M3_DISP_COUNT
} m3_disposition;

/* "PASSED", ... (the spelling in the file). */
const char *m3_disposition_name(m3_disposition d);
/* Errors: M3_FORMAT for an unknown spelling. */
m3_status m3_disposition_parse(const char *s, m3_disposition *d, m3_err *e);

/* Strings below are NUL-terminated; optional ones may be NULL (= absent in the
 * file).  Times are µs; unmeasured numbers are NAN (null in the file).  In a
 * record passed to m3_tunedb_put everything is borrowed and deep-copied; a
 * record returned by the DB is owned by it and lives until the next put/load
 * or m3_tunedb_free. */
typedef struct m3_tune_candidate {
  const char *tile;      /* required: canonical tile string */
  m3_disposition disposition;
  const char *reason;    /* why not PASSED (NVRTC excerpt, valid() reason), or NULL */
  double median_us;      /* µs; NAN when not timed */
  double p20_us, p80_us; /* µs quantiles; NAN when not timed */
  int n_runs;            /* timed repetitions (0 when not timed) */
} m3_tune_candidate;

typedef struct m3_tune_provenance {
  const char *gpu;            /* "NVIDIA H200" */
  int sm_count;               /* 132; 0 = unknown */
  const char *driver_version; /* as the filter compares it, e.g. "550.54.15" */
  const char *nvrtc_version;  /* "12.4" */
  const char *cublas_version; /* "12.4.5" */
  const char *template_hash;  /* REQUIRED: hash of the template text (hex) */
  const char *m3kit_version;  /* PACKAGE_VERSION of the tuner */
  const char *date;           /* ISO 8601 UTC, "2025-01-31T12:34:56Z" */
  const char *command;        /* the command line that produced it */
  const char *code_hash;      /* optional: m3_code_hash (gen/code_hash.h) of the chosen tile's rendered
                               * code, hex; where present it, not template_hash, decides staleness */
} m3_tune_provenance;

typedef struct m3_tune_metric {
  const char *unit;      /* "GB/s" or "TFLOP/s" */
  double achieved;       /* of the chosen tile, in `unit` */
  double ceiling;        /* the measured ceiling, in `unit` */
  double pct_of_ceiling; /* 100 * achieved / ceiling */
} m3_tune_metric;

typedef struct m3_tune_record {
  const char *key;  /* required: canonical variant key */
  m3_bucket bucket; /* the shape it was tuned at */
  const char *arch; /* required: "sm_90" ([a-z0-9_]+) */
  const char *tile; /* required: chosen tile */
  const char *pinned; /* optional: why `tile` is not the tuner's pick (a whole decode-step A/B chose
                       * it among the PASSED candidates: tools/seed_pin.py).  A later tune keeps it
                       * while it times within 3% of its own pick (autotune/tune.c). */
  const char *default_tile;
  double default_us; /* µs, median of default_tile; NAN if unknown */
  double tuned_us;   /* µs, median of tile; NAN if unknown */
  m3_tune_provenance prov;
  m3_tune_metric metric;
  size_t n_candidates;
  const m3_tune_candidate *candidates; /* every candidate tried */
} m3_tune_record;

/* A record with every number NAN/0 and every pointer NULL (fill then put). */
m3_tune_record m3_tune_record_empty(void);
/* Validate a record the way load and put do.  Errors: M3_INVAL naming the
 * field: missing key/arch/tile/template_hash, a bad arch name, a tile with
 * whitespace, non-UTF-8 text, a candidate without a tile, or a chosen tile
 * that any candidate entry marks non-PASSED (fault 32). */
m3_status m3_tune_record_check(const m3_tune_record *r, m3_err *e);

/* ------------------------------------------------------------------------- */
/* The database handle                                                       */
/* ------------------------------------------------------------------------- */

typedef struct m3_tunedb m3_tunedb;

/* An empty DB; NULL only when out of memory. */
m3_tunedb *m3_tunedb_new(void);
void m3_tunedb_free(m3_tunedb *db);

/* "<cache root>/tuning/<arch>.json" into buf (the directory is not created).
 * Errors: M3_INVAL (bad arch, no cache root), M3_RANGE (buf too small). */
m3_status m3_tunedb_path(const char *arch, char *buf, size_t n, m3_err *e);

/* What a load is allowed to keep.  NULL fields are not checked. */
typedef struct m3_tunedb_filter {
  const char *arch;           /* the device's arch, "sm_90" */
  const char *driver_version; /* compared with provenance.driver_version of
                               * USER records (a seed is from another machine
                               * by definition; its driver only moved timings) */
  /* The current hash of template `name` (text of the key before '('), or NULL
   * when this build has no such template.  A match keeps the record (the same
   * template text renders the same code); a mismatch makes it stale unless
   * code_hash keeps it. */
  const char *(*template_hash)(void *ctx, const char *name);
  /* The current code hash of (key, tile, arch), or NULL when it cannot be
   * rendered (template gone, tile no longer valid).  Asked only for records
   * whose template hash does not match and that carry provenance.code_hash:
   * a record stays valid through template edits that leave the code of its
   * tile unchanged.  (It renders the tile: the template check first keeps a
   * load free of rendering while the templates are the tuned ones.) */
  const char *(*code_hash)(void *ctx, const char *key, const char *tile, const char *arch);
  /* `tile` with the tile axes key's template declares but `tile` lacks, each
   * at its first declared value, or NULL when it lacks none or cannot be
   * completed.  Asked only for records whose template changed: after an
   * upgrade that added a tile axis whose first value renders the old code,
   * the completed tile's code hash is the record's, and the record is kept
   * with its tiles (chosen, default, candidates) completed; a record kept by
   * its own tile gets its default and candidates completed.  May be NULL. */
  const char *(*complete_tile)(void *ctx, const char *key, const char *tile);
  /* The scheme prefix code_hash returns ("c1:", gen/code_hash.h).  A record
   * whose code hash has another scheme (hashed by another m3kit's
   * normalisation) is judged by its template hash instead. */
  const char *code_scheme;
  void *ctx;
} m3_tunedb_filter;

/* Counters of one load (or save) plus ONE line for the caller to print. */
typedef struct m3_tunedb_report {
  int loaded;         /* records accepted into the handle */
  int from_seed;      /* ... of which came from the seed file */
  int stale_arch;     /* ignored: another arch */
  int stale_driver;   /* ignored: another driver version */
  int stale_template; /* ignored: code (or, without a code hash, template) hash changed or template unknown */
  int completed;      /* kept with their tiles completed by f->complete_tile (a tile axis added since) */
  int invalid;        /* skipped: missing/ill-typed fields */
  int unknown_fields; /* tolerated unknown fields (soft) */
  int newer_files;    /* files ignored because their version > ours */
  int seed_missing;   /* a seed path was given but the file is absent */
  char corrupt_copy[4200]; /* save_merge: where a garbled file was kept, or "" */
  char summary[2048]; /* one line, no newline; "" when there is nothing to say */
} m3_tunedb_report;

/* Load the seed file (may be NULL) and then the user file `path` (may be NULL)
 * into db; a user record replaces a seed record with the same identity.
 * Records failing `f` (may be NULL) are ignored and counted in `rep` (may be
 * NULL; it is zeroed first).  A missing user file is not an error (an untuned
 * machine); a missing seed is counted.  A file with a newer version is
 * ignored with a message in rep->summary.
 * Errors: M3_FORMAT for a truncated/garbled/non-tunedb file, naming the file
 * with jansson's line:column; the other file's records still load, so the
 * caller may print the message and run on.  M3_IO, M3_NOMEM. */
m3_status m3_tunedb_load(m3_tunedb *db, const char *path, const char *seed_path,
                         const m3_tunedb_filter *f, m3_tunedb_report *rep, m3_err *e);

/* Insert a deep copy of r, replacing the record with the same (key, bucket,
 * arch).  Only records put into a handle are written by save_merge.
 * Errors: M3_INVAL (see m3_tune_record_check), M3_NOMEM. */
m3_status m3_tunedb_put(m3_tunedb *db, const m3_tune_record *r, m3_err *e);

/* Merge the records put() into db over the file at `path` and publish it:
 * take m3_lock(path), re-read the file, replace on-disk records with the same
 * identity, keep every other on-disk record untouched (other kernels tuned
 * concurrently, other archs, stale or unknown-field records), write with
 * m3_write_atomic, unlock.  Records db merely loaded are NOT rewritten, so a
 * stale in-memory copy can never overwrite another tuner's newer result.
 * A garbled file is first copied to "<path>.corrupt.<UTC time>" (named in
 * rep->corrupt_copy and rep->summary) and then replaced.  Creates the parent
 * directory.  Nothing to write: returns M3_OK without touching the file.
 * Errors: M3_UNSUPPORTED when the file has a newer version (left untouched),
 * M3_IO, M3_NOMEM.  rep may be NULL. */
m3_status m3_tunedb_save_merge(const char *path, const m3_tunedb *db,
                               m3_tunedb_report *rep, m3_err *e);

/* Iteration, in insertion order (for the CLI and tests). */
/* What m3_tunedb_add_code_hashes did, record by record. */
typedef struct m3_rehash_report {
  int given;     /* given the code hash of their tile */
  int refreshed; /* their template changed but not their tile's code: given the current template hash */
  int completed; /* ... of those, with a tile (chosen, default or candidate) completed with a tile axis added
                  * since, and written so */
  int had;       /* a code hash of this scheme and a current template hash: untouched */
  int left;      /* changed template and code, or a tile that no longer renders: untouched */
  int malformed; /* no key, tile, arch or template hash: untouched (the loader skips them) */
  int first_malformed; /* index of the first of those in the file, or -1 */
} m3_rehash_report;

/* Give the records of the DB file `path` that have no code hash of
 * f->code_scheme and whose template hash is current (f->template_hash) the
 * code hash of their tile (f->code_hash): what that template text renders is
 * the code they timed.  Records with a code hash whose template changed since
 * but whose tile's code did not (also where only f->complete_tile's completion
 * of their tile renders it: their tiles are then written completed) are given
 * the current template hash, so that a load settles them without rendering.
 * Read, edit and publish happen under the file's lock (as save_merge), editing the JSON in place: record order,
 * other records, unknown fields stay as they were; the file is rewritten only
 * when some record changed.  rep may be NULL.  Errors: M3_NOTFOUND (no file),
 * M3_FORMAT (garbled: not touched), M3_UNSUPPORTED (newer version), M3_INVAL
 * (f lacks a callback), M3_IO. */
m3_status m3_tunedb_add_code_hashes(const char *path, const m3_tunedb_filter *f, m3_rehash_report *rep, m3_err *e);

size_t m3_tunedb_count(const m3_tunedb *db);
const m3_tune_record *m3_tunedb_get(const m3_tunedb *db, size_t i);
/* The record with exactly this identity, or NULL. */
const m3_tune_record *m3_tunedb_find(const m3_tunedb *db, const char *key,
                                     const m3_bucket *bucket, const char *arch);

/* ------------------------------------------------------------------------- */
/* Lookup                                                                    */
/* ------------------------------------------------------------------------- */

/* The template's valid(key, tile, arch) re-run for the ACTUAL shape: return
 * nonzero when `tile` may launch; otherwise 0 with a reason in reason[n]. */
typedef int (*m3_tile_check_fn)(void *ctx, const char *tile, char *reason, size_t n);

typedef struct m3_tune_hit {
  const m3_tune_record *rec; /* the record whose tile was taken */
  const char *tile;          /* == rec->tile */
  int exact;                 /* rec->bucket equals the shape */
  int checked;               /* the tile passed `check` (0 when check was NULL) */
  double distance;           /* Σ |log2 shape_d − log2 bucket_d| (0 = exact) */
  int rejected;              /* nearer records whose tile failed `check` */
  char reject_reason[256];   /* the first such failure, "" if none */
} m3_tune_hit;

/* Pick a tuned tile for (key, arch) at the actual shape `shape`.
 * Candidates are the records with this key and arch whose bucket has the same
 * dimension NAMES as `shape`, ordered by the NEAREST-BUCKET RULE:
 *   1. smaller distance Σ_d |log2 shape_d − log2 bucket_d| (0 counts as 2^-1):
 *      kernel regimes change by factors, not by increments;
 *   2. on a tie, the SMALLER bucket (smaller Σ_d log2 bucket_d; at equal
 *      distance this is the bucket that overshoots the shape by fewer
 *      octaves): tile limits are mostly upper bounds (tile ≤ rows), so a tile
 *      tuned at or below the shape is the likelier to be valid;
 *   3. then smaller values in the shape's dimension order (determinism).
 * Walking that order, the first record whose tile passes check(ctx, tile) wins.
 * CONTRACT (fault 33): a tile tuned at another shape may be invalid at this
 * one (tile > rows, smem over the limit, divisibility), so callers pass the
 * template's valid() for the actual shape as `check`.  With check == NULL the
 * nearest record is returned with hit->checked = 0 and the caller MUST run
 * valid() itself and use default_tile() when it fails.  Returns M3_NOTFOUND
 * (message in e) when no record applies or every tile failed: the caller then
 * uses the template's default_tile() - untuned, never broken.
 * Errors: M3_NOTFOUND, M3_INVAL (NULL arguments), M3_NOMEM. */
m3_status m3_tunedb_lookup(const m3_tunedb *db, const char *key, const char *arch,
                           const m3_bucket *shape, m3_tile_check_fn check, void *ctx,
                           m3_tune_hit *hit, m3_err *e);

/* ------------------------------------------------------------------------- */
/* Output                                                                    */
/* ------------------------------------------------------------------------- */

/* A readable table, one row per record (`m3kit tune --show`): key, bucket,
 * arch, tile vs default, default/tuned µs, speedup, metric, candidate counts. */
void m3_tunedb_print(const m3_tunedb *db, FILE *out);
/* Every candidate of one record, one line each. */
void m3_tunedb_print_record(const m3_tune_record *r, FILE *out);

/* For each record whose key contains `key_substr` (NULL: all): write
 * "<dir>/<name>.dat" (whitespace-separated: index, tile, median_us, p20_us,
 * p80_us, n_runs, disposition; "-" for unmeasured) and "<dir>/<name>.gp", a
 * gnuplot script rendering "<dir>/<name>.png" (absolute paths, so gnuplot may
 * run from any directory); plus "<dir>/all.gp" loading every script.
 * <name> is the sanitised key and bucket plus a hash of the identity.
 * *n_plots (may be NULL) receives the count.  The caller runs M3_GNUPLOT.
 * Errors: M3_IO naming the file, M3_NOMEM. */
m3_status m3_tunedb_write_plot_data(const m3_tunedb *db, const char *dir,
                                    const char *key_substr, int *n_plots, m3_err *e);

/* The current UTC time as ISO 8601 ("2025-01-31T12:34:56Z") for prov.date. */
void m3_tunedb_now_iso(char *buf, size_t n);

/* TEST HOOK: when the environment variable M3KIT_TEST_CRASH_BEFORE_RENAME is
 * set (non-empty), m3_tunedb_save_merge writes the complete temp file under
 * the lock and then SIGKILLs its own process before the rename - a writer
 * killed at the worst moment.  The only place this library may end a process. */
#define M3_TUNEDB_CRASH_ENV "M3KIT_TEST_CRASH_BEFORE_RENAME"

#endif
