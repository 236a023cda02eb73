/* tuning_lookup.c - TEMPORARY until cache/tunedb lands: no records. */
#include "runtime/tuning_lookup.h"

struct m3_tunedb *m3_tuning_open(const char *cache_root, const m3_device *dev, m3_lua *lua) {
  (void)cache_root; (void)dev; (void)lua;
  return NULL;
}
void m3_tuning_close(struct m3_tunedb *db) { (void)db; }
int m3_tuning_lookup(struct m3_tunedb *db, const m3_variant *key, const struct m3_bucket *b, char *tile, size_t n) {
  (void)db; (void)key; (void)b; (void)tile; (void)n;
  return 0;
}
