/* kernels.c - kernel memo, tuning lookup and default-tile fallback (see
 * kernels.h). */
#include "runtime/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <xxhash.h>

#include "runtime/check.h"
#include "runtime/log.h"
#include "runtime/tuning_lookup.h"

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

m3_status m3_rt_open(m3_rt *rt, int ordinal, m3_err *e) {
  const double t0 = mono_s();
  memset(rt, 0, sizeof *rt);
  M3_TRY(m3_device_open(ordinal, &rt->dev, e));
  M3_TRY(m3_jit_open(&rt->jit, e));
  M3_CUDA(e, cudaStreamCreateWithFlags(&rt->stream, cudaStreamNonBlocking));
  rt->db = m3_tuning_open(rt->jit.cache_root, &rt->dev, rt->jit.lua);
  rt->stats.open_s = mono_s() - t0;
  return M3_OK;
}

void m3_rt_close(m3_rt *rt) {
  for (int i = 0; i < rt->n_kernels; i++) {
    m3_module_unload(&rt->kernels[i]->mod);
    free(rt->kernels[i]);
  }
  free(rt->kernels);
  rt->kernels = NULL;
  rt->n_kernels = 0;
  m3_tuning_close(rt->db);
  rt->db = NULL;
  free(rt->front);
  rt->front = NULL;
  if (rt->stream) cudaStreamDestroy(rt->stream);
  rt->stream = NULL;
  m3_jit_close(&rt->jit);
  m3_device_close(&rt->dev);
}

static m3_kernel *memo_find(m3_rt *rt, const m3_variant *v) {
  char a[M3_KEY_MAX], b[M3_KEY_MAX];
  m3_variant_print(v, a, sizeof a);
  for (int i = 0; i < rt->n_kernels; i++) {
    m3_variant_print(&rt->kernels[i]->key, b, sizeof b);
    if (!strcmp(a, b)) return rt->kernels[i];
  }
  return NULL;
}

#define M3_RT_FRONT 1024 /* entries; the model needs ~100 (key, bucket) pairs */
struct m3_rt_front {
  uint64_t h;
  m3_kernel *k;
  char text[M3_KEY_MAX + 128];
};

/* The request as text: the key as given (before canon) and the bucket. */
static uint64_t front_text(const m3_variant *key, const m3_bucket *bucket, char *t, size_t n) {
  size_t l = m3_variant_print(key, t, n);
  if (l < n) {
    t[l++] = '#';
    t[l] = 0;
    if (bucket && bucket->ndims) m3_bucket_format(bucket, t + l, n - l);
  }
  return XXH3_64bits(t, strlen(t));
}

static m3_kernel *front_find(m3_rt *rt, uint64_t h, const char *t) {
  if (!rt->front) return NULL;
  for (unsigned i = 0; i < M3_RT_FRONT; i++) {
    const struct m3_rt_front *f = &rt->front[(h + i) % M3_RT_FRONT];
    if (!f->k) return NULL;
    if (f->h == h && !strcmp(f->text, t)) return f->k;
  }
  return NULL;
}

static void front_put(m3_rt *rt, uint64_t h, const char *t, m3_kernel *k) {
  if (!rt->front && !(rt->front = calloc(M3_RT_FRONT, sizeof *rt->front))) return; /* only a cache */
  for (unsigned i = 0; i < M3_RT_FRONT / 2; i++) { /* a full table just stops caching */
    struct m3_rt_front *f = &rt->front[(h + i) % M3_RT_FRONT];
    if (!f->k) {
      f->h = h, f->k = k;
      snprintf(f->text, sizeof f->text, "%s", t);
      return;
    }
  }
}

static m3_status rt_kernel_resolve(m3_rt *rt, const m3_variant *key, const m3_bucket *bucket, m3_kernel **k,
                                   m3_err *e);

m3_status m3_rt_kernel(m3_rt *rt, const m3_variant *key, const m3_bucket *bucket, m3_kernel **k,
                       m3_err *e) {
  char t[M3_KEY_MAX + 128];
  const uint64_t h = front_text(key, bucket, t, sizeof t);
  m3_kernel *hit = front_find(rt, h, t);
  if (hit) {
    *k = hit;
    return M3_OK;
  }
  M3_TRY(rt_kernel_resolve(rt, key, bucket, k, e));
  front_put(rt, h, t, *k);
  return M3_OK;
}

static m3_status rt_kernel_resolve(m3_rt *rt, const m3_variant *key, const m3_bucket *bucket, m3_kernel **k,
                                   m3_err *e) {
  m3_variant v = *key;
  M3_TRY(m3_render_canon(rt->jit.lua, &v, e));
  if (!v.arch[0]) snprintf(v.arch, sizeof v.arch, "%s", rt->dev.arch);
  int tuned = 0;
  if (!v.n_tile) {
    char tile[512];
    /* A record from a neighbouring bucket is only a suggestion: the lookup
     * re-checks it with valid() for this key and arch (known-faults #33). */
    if (rt->db && m3_tuning_lookup_checked(rt->db, rt->jit.lua, &v, bucket, tile, sizeof tile)) {
      m3_variant t = v;
      m3_err ve;
      if (m3_variant_parse_tile(&t, tile, &ve) == M3_OK && m3_render_canon(rt->jit.lua, &t, &ve) == M3_OK) {
        v = t;
        tuned = 1;
      }
    }
    if (!tuned) M3_TRY(m3_render_default_tile(rt->jit.lua, &v, e));
  }
  m3_kernel *hit = memo_find(rt, &v);
  if (hit) {
    *k = hit;
    return M3_OK;
  }
  m3_cubin cb;
  double t = mono_s();
  M3_TRY(m3_jit_build(&rt->jit, &v, &cb, e));
  rt->stats.build_s += mono_s() - t;
  if (cb.hit) rt->stats.cached++;
  else rt->stats.compiled++;
  m3_kernel *nk = calloc(1, sizeof *nk);
  if (!nk) {
    m3_cubin_free(&cb);
    return m3_errf(e, M3_NOMEM, "kernel");
  }
  t = mono_s();
  m3_status s = m3_module_load(cb.data, cb.size, &cb.meta, &nk->mod, e);
  rt->stats.load_s += mono_s() - t;
  m3_cubin_free(&cb);
  if (s != M3_OK) {
    free(nk);
    return s;
  }
  nk->key = v;
  nk->from_tuning = tuned;
  nk->sm_count = rt->dev.sm_count;
  nk->resident = m3_module_resident_ctas(&nk->mod);
  const char *merge = m3_variant_tilev(&v, "merge");
  if (merge && !strcmp(merge, "cluster")) m3_module_max_cluster(&nk->mod); /* nk->mod.max_cluster */
  if (rt->n_kernels == rt->cap_kernels) {
    int cap = rt->cap_kernels ? rt->cap_kernels * 2 : 64;
    m3_kernel **nn = realloc(rt->kernels, sizeof *nn * (size_t)cap);
    if (!nn) {
      m3_module_unload(&nk->mod);
      free(nk);
      return m3_errf(e, M3_NOMEM, "kernel table");
    }
    rt->kernels = nn;
    rt->cap_kernels = cap;
  }
  rt->kernels[rt->n_kernels++] = nk;
  *k = nk;
  return M3_OK;
}

m3_status m3_rt_kernel_text(m3_rt *rt, const char *key, const m3_bucket *bucket, m3_kernel **k, m3_err *e) {
  m3_variant v;
  M3_TRY(m3_variant_parse(key, &v, e));
  return m3_rt_kernel(rt, &v, bucket, k, e);
}
