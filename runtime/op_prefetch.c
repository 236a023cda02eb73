/* op_prefetch.c - plan, key and launcher of the L2 prefetch (op_prefetch.h). */
#include <inttypes.h>
#include <stdio.h>

#include "runtime/op_prefetch.h"

m3_status m3_prefetch_plan_for(int64_t total, int64_t want, int64_t chunk, m3_prefetch_plan *p, m3_err *e) {
  *p = (m3_prefetch_plan){0, 0, 0};
  if (total < 0 || want < 0 || chunk <= 0 || chunk % 16 || chunk > (1 << 30))
    return m3_errf(e, M3_INVAL, "l2 prefetch: total %" PRId64 ", want %" PRId64 " must be >= 0 and the chunk %" PRId64
                   " a multiple of 16 in [16, 2^30]", total, want, chunk);
  total = total / 16 * 16; /* a bulk prefetch's size is a multiple of 16: the tail's last bytes stay out */
  if (!total || !want) return M3_OK;
  if (want >= total) { /* all of it: back to back */
    p->chunk = chunk, p->stride = chunk, p->n = (total + chunk - 1) / chunk;
    return M3_OK;
  }
  if (want < chunk) chunk = (want + 15) / 16 * 16; /* one short item */
  const int64_t n = (want + chunk - 1) / chunk;
  /* the widest stride, a multiple of 16, that keeps the last item inside
   * the region: (n - 1) * stride + chunk <= total */
  int64_t stride = n > 1 ? (total - chunk) / (n - 1) / 16 * 16 : 0;
  if (stride < chunk) stride = chunk; /* want close to total: back to back (then the items end before total) */
  p->chunk = chunk, p->stride = stride, p->n = n;
  return M3_OK;
}

int64_t m3_prefetch_default_bytes(int sm, int phase, int64_t ctx) {
  if (sm < 90) return 0;
  switch (phase) {
  case M3_PF_OPROJ: return ctx <= 327680 ? 24ll << 20 : 0; /* between the 256K that gains and the 384K that loses */
  case M3_PF_FFN: return 16ll << 20;
  default: return 0;
  }
}

m3_status m3_prefetch_parse(const char *v, int64_t out[M3_PF_PHASES], int *is_default, m3_err *e) {
  for (int i = 0; i < M3_PF_PHASES; i++) out[i] = 0;
  *is_default = !v || !*v;
  if (*is_default) return M3_OK;
  int64_t mb[M3_PF_PHASES];
  int n = 0;
  for (const char *c = v;;) {
    int64_t x = 0;
    const char *d = c;
    while (*d >= '0' && *d <= '9' && x <= 256) x = 10 * x + (*d++ - '0');
    if (d == c || x > 256 || n == M3_PF_PHASES || (*d && *d != ','))
      return m3_errf(e, M3_INVAL, "M3KIT_L2_PREFETCH='%s': want MiB a phase: one integer in [0, 256] for all three "
                     "phases, or three separated by commas (o_proj, the FFN's first GEMV, qkv_proj), e.g. 24,16,0", v);
    mb[n++] = x;
    if (!*d) break;
    c = d + 1;
  }
  if (n != 1 && n != M3_PF_PHASES)
    return m3_errf(e, M3_INVAL, "M3KIT_L2_PREFETCH='%s': one value or three (o_proj, FFN, qkv_proj), not %d", v, n);
  for (int i = 0; i < M3_PF_PHASES; i++) out[i] = mb[n == 1 ? 0 : i] << 20;
  return M3_OK;
}

m3_status m3_prefetch_key(m3_variant *v, m3_err *e) { return m3_variant_parse("l2_prefetch()", v, e); }

m3_status m3_launch_prefetch(const m3_kernel *k, const void *base, int64_t total, const m3_prefetch_plan *p,
                             cudaStream_t stream, m3_err *e) {
  if (!p->n) return M3_OK;
  if (!base || ((uintptr_t)base & 15u) || p->chunk <= 0 || p->chunk % 16 || p->stride % 16 || p->stride < 0 ||
      p->chunk > (1 << 30) || (p->n - 1) * p->stride >= total / 16 * 16)
    return m3_errf(e, M3_INVAL, "l2 prefetch: base %p (16-byte aligned), %" PRId64 " items of %" PRId64
                   " bytes every %" PRId64 " must start inside the %" PRId64 "-byte region", base, p->n, p->chunk,
                   p->stride, total);
  /* as many CTAs as the tile says, or items: a CTA's copy engine is what
   * limits a bulk prefetch (H100: ~17 us for 16 MB from 4 CTAs, device run 83) */
  long ctas = m3_variant_tile_int(&k->key, "ctas", 4);
  unsigned grid = (unsigned)(p->n < ctas ? p->n : ctas);
  m3_module mod = k->mod;
  if (!m3_variant_tile_int(&k->key, "pdl", 1)) mod.pdl = 0;
  int64_t tot = total / 16 * 16, stride = p->stride, chunk = p->chunk, n = p->n;
  void *args[] = {&base, &tot, &stride, &chunk, &n};
  return m3_launch(&mod, grid, 1, 1, (CUstream)stream, args, e);
}
