/* tuning_lookup.c - the runtime's read side of the tuning DB (see
 * tuning_lookup.h): user records for this arch and driver from
 * <cache>/tuning/<arch>.json over the committed seed records, template hashes
 * checked against the templates this build embeds, and a lookup whose tile is
 * re-checked with the template's valid() before the caller uses it. */
#include "runtime/tuning_lookup.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/tunedb.h"
#include "m3config.h"
#include "gen/code_hash.h"
#include "gen/render.h"
#include "runtime/log.h"

const char *m3_tuning_template_hash(void *ctx, const char *name) {
  m3_tuning_hash_ctx *h = ctx;
  m3_schema s;
  m3_err e;
  if (m3_render_schema(h->lua, name, &s, &e) != M3_OK) return NULL;
  snprintf(h->buf, sizeof h->buf, "%016llx", (unsigned long long)s.hash);
  return h->buf;
}

const char *m3_tuning_code_hash(void *ctx, const char *key, const char *tile, const char *arch) {
  m3_tuning_hash_ctx *h = ctx;
  char full[M3_KEY_MAX + 320];
  if (snprintf(full, sizeof full, "%s[%s]@%s", key, tile, arch) >= (int)sizeof full) return NULL;
  m3_variant v;
  m3_err e;
  uint64_t c;
  if (m3_render_parse_key(h->lua, full, &v, &e) != M3_OK || m3_render_code_hash(h->lua, &v, &c, &e) != M3_OK)
    return NULL;
  m3_code_hash_text(c, h->buf, sizeof h->buf);
  return h->buf;
}

const char *m3_tuning_complete_tile(void *ctx, const char *key, const char *tile) {
  m3_tuning_hash_ctx *h = ctx;
  m3_variant v;
  m3_schema sc;
  m3_err e;
  if (m3_variant_parse(key, &v, &e) != M3_OK || m3_variant_parse_tile(&v, tile, &e) != M3_OK ||
      m3_render_schema(h->lua, v.op, &sc, &e) != M3_OK)
    return NULL;
  int added = 0;
  for (int i = 0; i < sc.n_tiles; i++)
    if (!m3_variant_tilev(&v, sc.tiles[i].name)) {
      /* a free integer axis has no first value to stand for "as before" */
      if (sc.tiles[i].is_int || sc.tiles[i].n_values < 1) return NULL;
      if (m3_variant_set_tile(&v, sc.tiles[i].name, sc.tiles[i].values[0], &e) != M3_OK) return NULL;
      added++;
    }
  /* canon puts the fields in the template's order and refuses a field the
   * template does not declare (an axis removed since: nothing to complete) */
  if (!added || m3_render_canon(h->lua, &v, &e) != M3_OK) return NULL;
  if (m3_variant_print_tile(&v, h->tbuf, sizeof h->tbuf) >= sizeof h->tbuf) return NULL;
  return h->tbuf;
}

void m3_tuning_filter_init(m3_tunedb_filter *f, m3_tuning_hash_ctx *hc, const char *arch, const char *driver_version) {
  *f = (m3_tunedb_filter){.arch = arch, .driver_version = driver_version, .template_hash = m3_tuning_template_hash,
                          .code_hash = m3_tuning_code_hash, .complete_tile = m3_tuning_complete_tile,
                          .code_scheme = M3_CODE_HASH_SCHEME, .ctx = hc};
}

/* The seed DB: $M3KIT_SEED_DB, else the installed copy, else the source tree's. */
const char *m3_tuning_seed_path(const char *arch, char *buf, size_t n) {
  const char *env = getenv("M3KIT_SEED_DB");
  if (env && *env) return env;
  const char *dirs[] = {M3_SEED_DIR, M3_SRC_SEED_DIR};
  for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
    snprintf(buf, n, "%s/%s.json", dirs[i], arch);
    FILE *f = fopen(buf, "r");
    if (f) {
      fclose(f);
      return buf;
    }
  }
  return NULL;
}

/* driver NULL: records of any driver (what a GPU of `arch` would read, its
 * driver unknown here). */
static struct m3_tunedb *open_db(const char *cache_root, const char *arch, const char *drv, m3_lua *lua) {
  m3_tunedb *db = m3_tunedb_new();
  if (!db) return NULL;
  char user[4200], seed[4200];
  snprintf(user, sizeof user, "%s/tuning/%s.json", cache_root, arch);
  m3_tuning_hash_ctx hc = {.lua = lua};
  m3_tunedb_filter f;
  m3_tuning_filter_init(&f, &hc, arch, drv);
  m3_tunedb_report rep;
  m3_err e;
  memset(&rep, 0, sizeof rep);
  m3_status s = m3_tunedb_load(db, user, m3_tuning_seed_path(arch, seed, sizeof seed), &f, &rep, &e);
  if (s != M3_OK) m3_warn_once("tuning DB not used (%s); kernels run with their default tiles", e.msg);
  else if (rep.summary[0] && (rep.stale_arch || rep.stale_driver || rep.stale_template || rep.invalid))
    m3_warn_once("%s", rep.summary);
  else if (rep.summary[0]) m3_info("%s", rep.summary);
  return db;
}

struct m3_tunedb *m3_tuning_open(const char *cache_root, const m3_device *dev, m3_lua *lua) {
  char drv[32];
  snprintf(drv, sizeof drv, "%d", dev->driver_version);
  return open_db(cache_root, dev->arch, drv, lua);
}

struct m3_tunedb *m3_tuning_open_arch(const char *cache_root, const char *arch, m3_lua *lua) {
  return open_db(cache_root, arch, NULL, lua);
}

void m3_tuning_close(struct m3_tunedb *db) {
  if (db) m3_tunedb_free(db);
}

typedef struct { m3_lua *lua; const m3_variant *key; } check_ctx;

int m3_tuning_tile_ok(m3_lua *lua, const m3_variant *key, const char *tile, char *reason, size_t n) {
  m3_variant v = *key;
  m3_err e;
  if (m3_variant_parse_tile(&v, tile, &e) != M3_OK || m3_render_canon(lua, &v, &e) != M3_OK) {
    snprintf(reason, n, "%s", e.msg);
    return 0;
  }
  if (m3_render_valid(lua, &v, reason, n, &e) == M3_OK) return 1;
  if (!reason[0]) snprintf(reason, n, "%s", e.msg); /* valid() itself failed */
  return 0;
}

static int check_tile(void *ctx, const char *tile, char *reason, size_t n) {
  check_ctx *c = ctx;
  return m3_tuning_tile_ok(c->lua, c->key, tile, reason, n);
}

int m3_tuning_lookup_checked(struct m3_tunedb *db, m3_lua *lua, const m3_variant *key, const struct m3_bucket *b,
                             char *tile, size_t n) {
  if (!db || !b) return 0;
  char k[M3_KEY_MAX];
  m3_variant_print_axes(key, k, sizeof k);
  check_ctx cc = {lua, key};
  m3_tune_hit hit;
  m3_err e;
  if (m3_tunedb_lookup(db, k, key->arch, b, check_tile, &cc, &hit, &e) != M3_OK) return 0;
  snprintf(tile, n, "%s", hit.tile);
  return 1;
}
