/* ckpt_names.c - expected tensor inventory and (layer, role) binding (see
 * ckpt_names.h).  Separate from safetensors.c so that the reader stays
 * model-agnostic and from ckpt_write.c so that the writer and the checker
 * share this single list of names and shapes. */
#include "runtime/ckpt_names.h"

#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
  const char *fmt;
  char scope; /* 'G', 'L', 'E' */
  m3_wkind kind;
  const char *short_name;
} roles[] = {
#define M3_X_ROLE(id, name, scope, kind) {name, #scope[0], M3_WK_##kind, #id},
    M3_ROLE_MAP(M3_X_ROLE)
#undef M3_X_ROLE
};
_Static_assert(sizeof roles / sizeof *roles == M3_ROLE_COUNT, "role table");

/* Lower-case short names, built once from the table (pthread_once: callers
 * may be on several threads). */
static char role_lower[M3_ROLE_COUNT][32];
static pthread_once_t role_once = PTHREAD_ONCE_INIT;

static void role_names_init(void) {
  for (int r = 0; r < M3_ROLE_COUNT; r++) {
    const char *s = roles[r].short_name;
    size_t i = 0;
    for (; s[i] && i + 1 < sizeof role_lower[r]; i++)
      role_lower[r][i] = (char)tolower((unsigned char)s[i]);
    role_lower[r][i] = 0;
  }
}

const char *m3_role_name(m3_role r) {
  if ((unsigned)r >= M3_ROLE_COUNT) return "?";
  pthread_once(&role_once, role_names_init);
  return role_lower[r];
}

/* ---- expected inventory --------------------------------------------------------- */

static void shape_of(const m3_config *c, m3_role r, int64_t *shape, int *ndim) {
  int64_t H = c->hidden_size, D = c->head_dim, ID = c->sparse_index_dim;
  int64_t q = (int64_t)c->num_attention_heads * D, kv = (int64_t)c->num_key_value_heads * D;
  int64_t iq = (int64_t)c->sparse_num_index_heads * ID, F = c->dense_intermediate_size,
          I = c->intermediate_size, S = m3_config_shared_width(c), E = c->num_local_experts;
  int64_t out = 0, in = 0;
  switch (r) {
  case M3_ROLE_EMBED: case M3_ROLE_LM_HEAD: out = c->vocab_size; in = H; break;
  case M3_ROLE_FINAL_NORM: case M3_ROLE_INPUT_NORM: case M3_ROLE_POST_NORM: out = H; break;
  case M3_ROLE_Q_NORM: case M3_ROLE_K_NORM: out = D; break;
  case M3_ROLE_INDEX_Q_NORM: case M3_ROLE_INDEX_K_NORM: out = ID; break;
  case M3_ROLE_Q_PROJ: out = q; in = H; break;
  case M3_ROLE_K_PROJ: case M3_ROLE_V_PROJ: out = kv; in = H; break;
  case M3_ROLE_O_PROJ: out = H; in = q; break;
  case M3_ROLE_INDEX_Q_PROJ: out = iq; in = H; break;
  case M3_ROLE_INDEX_K_PROJ: out = ID; in = H; break; /* one shared index-K head */
  case M3_ROLE_MLP_GATE: case M3_ROLE_MLP_UP: out = F; in = H; break;
  case M3_ROLE_MLP_DOWN: out = H; in = F; break;
  case M3_ROLE_MOE_ROUTER: out = E; in = H; break;
  case M3_ROLE_MOE_BIAS: out = E; break;
  case M3_ROLE_EXPERT_W1: case M3_ROLE_EXPERT_W3: out = I; in = H; break;
  case M3_ROLE_EXPERT_W2: out = H; in = I; break;
  case M3_ROLE_SHARED_GATE: case M3_ROLE_SHARED_UP: out = S; in = H; break;
  case M3_ROLE_SHARED_DOWN: out = H; in = S; break;
  default: break;
  }
  shape[0] = out;
  shape[1] = in;
  *ndim = in ? 2 : 1;
}

/* Roles of one layer in forward order. */
static size_t layer_roles(const m3_config *c, int l, m3_role *out) {
  size_t n = 0;
  out[n++] = M3_ROLE_INPUT_NORM;
  out[n++] = M3_ROLE_Q_PROJ;
  out[n++] = M3_ROLE_K_PROJ;
  out[n++] = M3_ROLE_V_PROJ;
  out[n++] = M3_ROLE_Q_NORM;
  out[n++] = M3_ROLE_K_NORM;
  if (c->is_sparse[l]) {
    out[n++] = M3_ROLE_INDEX_Q_PROJ;
    out[n++] = M3_ROLE_INDEX_K_PROJ;
    out[n++] = M3_ROLE_INDEX_Q_NORM;
    out[n++] = M3_ROLE_INDEX_K_NORM;
  }
  out[n++] = M3_ROLE_O_PROJ;
  out[n++] = M3_ROLE_POST_NORM;
  if (c->is_moe[l]) {
    out[n++] = M3_ROLE_MOE_ROUTER;
    if (c->use_routing_bias) out[n++] = M3_ROLE_MOE_BIAS;
    out[n++] = M3_ROLE_EXPERT_W1; /* stands for all experts, expanded by the caller */
    if (c->n_shared_experts) {
      out[n++] = M3_ROLE_SHARED_GATE;
      out[n++] = M3_ROLE_SHARED_UP;
      out[n++] = M3_ROLE_SHARED_DOWN;
    }
  } else {
    out[n++] = M3_ROLE_MLP_GATE;
    out[n++] = M3_ROLE_MLP_UP;
    out[n++] = M3_ROLE_MLP_DOWN;
  }
  return n;
}

static void set_spec(const m3_config *c, m3_tensor_spec *s, m3_role r, int layer, int expert) {
  memset(s, 0, sizeof *s);
  s->role = r;
  s->kind = roles[r].kind;
  s->layer = layer;
  s->expert = expert;
  shape_of(c, r, s->shape, &s->ndim);
  if (roles[r].scope == 'G') {
    snprintf(s->name, sizeof s->name, "%s", roles[r].fmt);
  } else {
    char suffix[96];
    /* The only format directive in the table is the expert index. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    snprintf(suffix, sizeof suffix, roles[r].fmt, expert);
#pragma GCC diagnostic pop
    snprintf(s->name, sizeof s->name, "model.layers.%d.%s", layer, suffix);
  }
}

m3_status m3_ckpt_expected(const m3_config *c, m3_tensor_spec **specs, size_t *n, m3_err *e) {
  *specs = NULL;
  *n = 0;
  size_t cap = 3;
  m3_role lr[32];
  for (int l = 0; l < c->num_hidden_layers; l++) {
    cap += layer_roles(c, l, lr);
    if (c->is_moe[l]) cap += 3 * (size_t)c->num_local_experts;
  }
  m3_tensor_spec *v = malloc(cap * sizeof *v);
  if (!v) return m3_errf(e, M3_NOMEM, "out of memory for %zu tensor specs", cap);
  size_t k = 0;
  set_spec(c, &v[k++], M3_ROLE_EMBED, -1, -1);
  for (int l = 0; l < c->num_hidden_layers; l++) {
    size_t nr = layer_roles(c, l, lr);
    for (size_t i = 0; i < nr; i++) {
      if (lr[i] != M3_ROLE_EXPERT_W1) {
        set_spec(c, &v[k++], lr[i], l, -1);
        continue;
      }
      for (int x = 0; x < c->num_local_experts; x++) {
        set_spec(c, &v[k++], M3_ROLE_EXPERT_W1, l, x);
        set_spec(c, &v[k++], M3_ROLE_EXPERT_W3, l, x);
        set_spec(c, &v[k++], M3_ROLE_EXPERT_W2, l, x);
      }
    }
  }
  set_spec(c, &v[k++], M3_ROLE_FINAL_NORM, -1, -1);
  if (!c->tie_word_embeddings) set_spec(c, &v[k++], M3_ROLE_LM_HEAD, -1, -1);
  *specs = v;
  *n = k;
  return M3_OK;
}

/* ---- binding ------------------------------------------------------------------- */

struct m3_ckpt {
  int L, E;
  char prefix[32];
  m3_quant quant;
  m3_tensor_spec *specs;
  m3_weight *w;        /* [nspecs], same order as specs */
  size_t nspecs;
  int32_t *slot;       /* [L][ROLE_COUNT] -> index into w, -1 if none */
  int32_t *eslot;      /* [L][E][3] for EXPERT_W1/W3/W2 */
  int32_t gslot[M3_ROLE_COUNT];
  char **notes;
  size_t nnotes;
};

void m3_ckpt_free(m3_ckpt *k) {
  if (!k) return;
  for (size_t i = 0; i < k->nnotes; i++) free(k->notes[i]);
  free(k->notes);
  free(k->specs);
  free(k->w);
  free(k->slot);
  free(k->eslot);
  free(k);
}

static int add_note(m3_ckpt *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int add_note(m3_ckpt *k, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  char **n = realloc(k->notes, (k->nnotes + 1) * sizeof *n);
  if (!n) return -1;
  k->notes = n;
  if (!(n[k->nnotes] = strdup(buf))) return -1;
  k->nnotes++;
  return 0;
}

static int starts_with(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
  buf[0] = 0;
  for (int i = 0; i < ndim; i++)
    snprintf(buf + strlen(buf), n - strlen(buf), "%s%lld", i ? ", " : "", (long long)shape[i]);
}

static int shape_eq(const m3_st_tensor *t, int ndim, const int64_t *shape) {
  if (t->ndim != ndim) return 0;
  for (int i = 0; i < ndim; i++)
    if (t->shape[i] != shape[i]) return 0;
  return 1;
}

/* First problem wins the message; the rest are counted. */
typedef struct {
  m3_err *e;
  m3_status code;
  size_t count;
} problems;

static void problem(problems *p, m3_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void problem(problems *p, m3_status code, const char *fmt, ...) {
  if (p->count++ == 0) {
    va_list ap;
    va_start(ap, fmt);
    m3_verrf(p->e, code, fmt, ap);
    va_end(ap);
    p->code = code;
  }
}

static const char *where(const m3_tensor_spec *s, char *buf, size_t n) {
  if (s->layer < 0) snprintf(buf, n, "global, %s", m3_role_name(s->role));
  else if (s->expert < 0) snprintf(buf, n, "layer %d, %s", s->layer, m3_role_name(s->role));
  else snprintf(buf, n, "layer %d, expert %d, %s", s->layer, s->expert, m3_role_name(s->role));
  return buf;
}

static int dtype_ok(m3_wkind k, m3_dtype d) {
  switch (k) {
  case M3_WK_EMBED: return d == M3_DT_BF16;
  case M3_WK_NORM: return d == M3_DT_BF16 || d == M3_DT_F32;
  case M3_WK_LINEAR: return d == M3_DT_BF16 || d == M3_DT_F8_E4M3;
  case M3_WK_ROUTER: case M3_WK_BIAS: return d == M3_DT_F32 || d == M3_DT_BF16;
  }
  return 0;
}

static const char *dtype_list(m3_wkind k) {
  switch (k) {
  case M3_WK_EMBED: return "BF16";
  case M3_WK_NORM: return "BF16 or F32";
  case M3_WK_LINEAR: return "BF16, or F8_E4M3 with a U8 weight_scale_inv (MXFP8)";
  default: return "F32 or BF16";
  }
}

m3_status m3_ckpt_bind(const m3_config *c, const m3_st *st, const char *name_for_errors,
                       m3_ckpt **out, m3_err *e) {
  *out = NULL;
  const char *nm = name_for_errors ? name_for_errors : "checkpoint";
  m3_ckpt *k = calloc(1, sizeof *k);
  if (!k) return m3_errf(e, M3_NOMEM, "out of memory");
  m3_status s = m3_ckpt_expected(c, &k->specs, &k->nspecs, e);
  if (s != M3_OK) {
    m3_ckpt_free(k);
    return s;
  }
  k->L = c->num_hidden_layers;
  k->E = c->num_local_experts;
  size_t nst = m3_st_count(st);
  uint8_t *used = calloc(nst ? nst : 1, 1);
  k->w = calloc(k->nspecs, sizeof *k->w);
  k->slot = malloc((size_t)k->L * M3_ROLE_COUNT * sizeof *k->slot);
  k->eslot = malloc((size_t)k->L * (size_t)k->E * 3 * sizeof *k->eslot);
  if (!used || !k->w || !k->slot || !k->eslot) {
    free(used);
    m3_ckpt_free(k);
    return m3_errf(e, M3_NOMEM, "out of memory binding %zu tensors", k->nspecs);
  }
  memset(k->slot, 0xff, (size_t)k->L * M3_ROLE_COUNT * sizeof *k->slot);
  memset(k->eslot, 0xff, (size_t)k->L * (size_t)k->E * 3 * sizeof *k->eslot);
  memset(k->gslot, 0xff, sizeof k->gslot);

  /* Layout: VL ("language_model.model...") or plain ("model...").  Decided by
   * the embedding if present, else by whether any name has the VL prefix (so
   * a VL checkpoint missing its embedding still reports the VL name). */
  const char *vl = "language_model.";
  int is_vl = 0;
  if (m3_st_find(st, "language_model.model.embed_tokens.weight")) is_vl = 1;
  else if (!m3_st_find(st, "model.embed_tokens.weight"))
    for (size_t i = 0; i < nst && !is_vl; i++) is_vl = starts_with(m3_st_at(st, i)->name, vl);
  snprintf(k->prefix, sizeof k->prefix, "%s", is_vl ? vl : "");

  problems pr = {e, M3_OK, 0};
  size_t n_f8 = 0, n_bf16 = 0;
  char full[192], wb[96], sa[160], sb[160];
  const m3_st_tensor *base = nst ? m3_st_at(st, 0) : NULL;
  for (size_t i = 0; i < k->nspecs; i++) {
    const m3_tensor_spec *sp = &k->specs[i];
    m3_weight *w = &k->w[i];
    w->spec = sp;
    snprintf(full, sizeof full, "%s%s", k->prefix, sp->name);
    const m3_st_tensor *t = m3_st_find(st, full);
    if (!t) {
      problem(&pr, M3_NOTFOUND, "%s: tensor '%s' (%s) is missing", nm, full,
              where(sp, wb, sizeof wb));
      continue;
    }
    used[t - base] = 1;
    w->w = t;
    shape_str(sa, sizeof sa, sp->ndim, sp->shape);
    if (!shape_eq(t, sp->ndim, sp->shape)) {
      shape_str(sb, sizeof sb, t->ndim, t->shape);
      problem(&pr, M3_FORMAT, "%s: %s: tensor '%s' (%s): shape [%s], expected [%s]", nm, t->file,
              full, where(sp, wb, sizeof wb), sb, sa);
      continue;
    }
    if (!dtype_ok(sp->kind, t->dtype)) {
      problem(&pr, M3_FORMAT, "%s: %s: tensor '%s' (%s): dtype %s, expected %s", nm, t->file,
              full, where(sp, wb, sizeof wb), m3_dtype_name(t->dtype), dtype_list(sp->kind));
      continue;
    }
    if (sp->kind != M3_WK_LINEAR) continue;
    char sname[sizeof full + 16];
    snprintf(sname, sizeof sname, "%s_scale_inv", full); /* "...weight" -> "...weight_scale_inv" */
    const m3_st_tensor *sc = m3_st_find(st, sname);
    if (sc) used[sc - base] = 1;
    if (t->dtype == M3_DT_BF16) {
      n_bf16++;
      if (sc)
        problem(&pr, M3_FORMAT, "%s: %s: tensor '%s' exists but its weight is BF16, not F8_E4M3 "
                "(half-converted checkpoint?)", nm, sc->file, sname);
      continue;
    }
    n_f8++;
    if (!sc) {
      problem(&pr, M3_NOTFOUND, "%s: tensor '%s' (MXFP8 scale of %s, %s) is missing", nm, sname,
              full, where(sp, wb, sizeof wb));
      continue;
    }
    int64_t want[2] = {sp->shape[0], (sp->shape[1] + 31) / 32};
    if (sc->dtype != M3_DT_U8 || !shape_eq(sc, 2, want)) {
      shape_str(sa, sizeof sa, 2, want);
      shape_str(sb, sizeof sb, sc->ndim, sc->shape);
      problem(&pr, M3_FORMAT, "%s: %s: tensor '%s': %s [%s], expected U8 [%s] (E8M0 per 1x32 block)",
              nm, sc->file, sname, m3_dtype_name(sc->dtype), sb, sa);
      continue;
    }
    w->scale = sc;
  }
  if (pr.count > 1 && e) {
    size_t l = strlen(e->msg);
    snprintf(e->msg + l, sizeof e->msg - l, " (and %zu more problems)", pr.count - 1);
  }

  /* Notes for everything not bound. */
  size_t n_vision = 0, n_mtp = 0, n_extra = 0;
  int note_fail = 0;
  for (size_t i = 0; i < nst; i++) {
    if (used[i]) continue;
    const char *n = m3_st_at(st, i)->name;
    const char *r = starts_with(n, vl) ? n + strlen(vl) : n;
    const char *r2 = starts_with(r, "model.") ? r + 6 : r;
    if (starts_with(r2, "vision_tower.") || starts_with(r2, "multi_modal_projector.") ||
        starts_with(r2, "patch_merge_mlp."))
      n_vision++;
    else if (starts_with(r, "model.mtp.") || starts_with(r2, "mtp."))
      n_mtp++;
    else if (++n_extra <= 64)
      note_fail |= add_note(k, "extra tensor '%s' (%s) is not used by the text model; ignored", n,
                            m3_st_at(st, i)->file);
  }
  if (n_extra > 64) note_fail |= add_note(k, "... and %zu more extra tensors ignored", n_extra - 64);
  if (n_vision)
    note_fail |= add_note(k, "skipped %zu vision-tower tensors (vision_tower., multi_modal_projector., "
                          "patch_merge_mlp.)", n_vision);
  if (n_mtp) note_fail |= add_note(k, "skipped %zu MTP tensors (model.mtp., not run)", n_mtp);
  free(used);
  if (pr.count) {
    m3_ckpt_free(k);
    return pr.code;
  }
  if (note_fail) {
    m3_ckpt_free(k);
    return m3_errf(e, M3_NOMEM, "out of memory recording notes");
  }
  k->quant = n_f8 == 0 ? M3_QUANT_BF16 : n_bf16 == 0 ? M3_QUANT_MXFP8 : M3_QUANT_MIXED;

  for (size_t i = 0; i < k->nspecs; i++) {
    const m3_tensor_spec *sp = &k->specs[i];
    if (sp->layer < 0) k->gslot[sp->role] = (int32_t)i;
    else if (sp->expert < 0) k->slot[(size_t)sp->layer * M3_ROLE_COUNT + sp->role] = (int32_t)i;
    else
      k->eslot[((size_t)sp->layer * (size_t)k->E + (size_t)sp->expert) * 3 +
               (size_t)(sp->role - M3_ROLE_EXPERT_W1)] = (int32_t)i;
  }
  if (c->tie_word_embeddings) k->gslot[M3_ROLE_LM_HEAD] = k->gslot[M3_ROLE_EMBED];
  *out = k;
  return M3_OK;
}

const m3_weight *m3_ckpt_get(const m3_ckpt *k, int layer, m3_role role, int expert) {
  if ((unsigned)role >= M3_ROLE_COUNT) return NULL;
  int32_t i;
  if (roles[role].scope == 'G') {
    i = k->gslot[role];
  } else {
    if (layer < 0 || layer >= k->L) return NULL;
    if (roles[role].scope == 'E') {
      if (expert < 0 || expert >= k->E) return NULL;
      i = k->eslot[((size_t)layer * (size_t)k->E + (size_t)expert) * 3 +
                   (size_t)(role - M3_ROLE_EXPERT_W1)];
    } else {
      i = k->slot[(size_t)layer * M3_ROLE_COUNT + role];
    }
  }
  return i < 0 ? NULL : &k->w[i];
}

const char *m3_ckpt_prefix(const m3_ckpt *k) { return k->prefix; }
m3_quant m3_ckpt_quant(const m3_ckpt *k) { return k->quant; }
size_t m3_ckpt_n_notes(const m3_ckpt *k) { return k->nnotes; }
const char *m3_ckpt_note(const m3_ckpt *k, size_t i) { return i < k->nnotes ? k->notes[i] : NULL; }
