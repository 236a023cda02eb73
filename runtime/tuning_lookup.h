/* tuning_lookup.h - the runtime's read side of the tuning DB: load the user's
 * records for this GPU plus the committed seed records, and answer "which tile
 * for (key, bucket)".  Kept apart from cache/tunedb.c so that the kernel
 * context depends on three calls, not on the DB's format. */
#ifndef M3_TUNING_LOOKUP_H
#define M3_TUNING_LOOKUP_H

#include <stddef.h>

#include "gen/lua_host.h"
#include "gen/variant.h"
#include "runtime/gpu.h"

struct m3_tunedb;
struct m3_tunedb_filter;
struct m3_bucket;

/* The seed DB (committed records, tuned on an H200) read under the user's
 * for `arch`: $M3KIT_SEED_DB, else the installed copy, else the source
 * tree's; its path in buf, or NULL when there is none. */
const char *m3_tuning_seed_path(const char *arch, char *buf, size_t n);

/* The template-hash check of a tuning DB load (m3_tunedb_filter.template_hash)
 * as the runtime applies it: ctx is an m3_tuning_hash_ctx whose lua renders
 * the templates this build embeds (or $M3KIT_TEMPLATE_DIR's); the template's
 * hash as 16 hex digits in ctx->buf, or NULL when `name` is no template. */
typedef struct m3_tuning_hash_ctx { m3_lua *lua; char buf[32]; char tbuf[512]; } m3_tuning_hash_ctx;
const char *m3_tuning_template_hash(void *ctx, const char *name);
/* The code-hash check (m3_tunedb_filter.code_hash), same ctx: the code hash
 * (gen/render.h m3_render_code_hash) of `key` (axes only, as a record has it)
 * with `tile` at `arch`, as 16 hex digits in ctx->buf, or NULL when that
 * cannot be rendered any more (no such template, axis or tile value, or a
 * tile valid() now refuses). */
const char *m3_tuning_code_hash(void *ctx, const char *key, const char *tile, const char *arch);
/* The tile completion (m3_tunedb_filter.complete_tile), same ctx: `tile`
 * with the tile axes of key's template that it lacks, each at its first
 * declared value, every field in the template's order, in ctx->tbuf; NULL
 * when it lacks none, or when it cannot be completed (no such template, a
 * field the template no longer declares, a missing free-integer axis). */
const char *m3_tuning_complete_tile(void *ctx, const char *key, const char *tile);
/* All three checks, as every reader of a tuning DB applies them. */
void m3_tuning_filter_init(struct m3_tunedb_filter *f, m3_tuning_hash_ctx *hc, const char *arch,
                           const char *driver_version);

/* Never fails: an unreadable or stale DB is reported once and ignored. */
struct m3_tunedb *m3_tuning_open(const char *cache_root, const m3_device *dev, m3_lua *lua);
/* The same DB as a GPU of `arch` would read, without one (its driver not
 * checked): the tiles `m3kit run` compiles on a machine with no GPU, to show
 * each one still builds.  Never fails either. */
struct m3_tunedb *m3_tuning_open_arch(const char *cache_root, const char *arch, m3_lua *lua);
void m3_tuning_close(struct m3_tunedb *db);
/* 1 and the tile text ("warps=4,hpw=1") when a record applies to `key` (with
 * its arch) at shape `b`: exact bucket, else the nearest bucket whose tile
 * still passes the template's valid() for this key (cache/tunedb.h rule);
 * 0 means "use the template's default tile". */
/* 1 when `tile` parses for `key` (whose arch is set) and passes its
 * template's valid(): the check every lookup makes of a record's tile; else 0
 * and why in reason[n] (a parse error, valid()'s reason or its failure). */
int m3_tuning_tile_ok(m3_lua *lua, const m3_variant *key, const char *tile, char *reason, size_t n);
int m3_tuning_lookup_checked(struct m3_tunedb *db, m3_lua *lua, const m3_variant *key, const struct m3_bucket *b,
                             char *tile, size_t n);

#endif
