/* check_forward_gpu.c - the whole GPU forward (runtime/forward.h) against the
 * whole-model CPU reference (ref/ref_forward.h) on a random checkpoint from
 * m3_ckpt_write: a 4-layer config (1 dense + 3 sparse/MoE, hidden 256, 8 q
 * heads, block 16, top-k 4 blocks, 8 experts all routed), a prompt of 80 tokens
 * (> 64 = top-k x block, so the sparse layers really drop blocks), prefilled
 * in chunks of 32, then 8 greedy decode steps, for bf16 and e4m3 index caches
 * (and an e4m3 KV cache), bf16 and MXFP8 weights.
 *
 * Tolerances: logits ||gpu - ref|| / ||ref|| <= 2e-2 at every step (the GPU
 * sums in other orders and rounds P to bf16 before P·V; every op's own test
 * holds it to ~1e-2).  Tokens: the decode is teacher-forced with the
 * reference's greedy tokens (one flip must not derail the rest), and the
 * GPU's greedy token must equal the reference's at every step where the
 * reference's top-1/top-2 margin exceeds 2 max|gpu - ref| - below that the
 * order is not determined by the model (a GPU argmax with a larger margin
 * can only be a bug).  Random weights give flat logits, so near-ties are
 * common; they are counted and printed.
 *
 * Selection: with random weights the block scores of the sparse layers are
 * close together, and an e4m3 index value changes code when its bf16 input
 * differs by one rounding (different summation order in the projection), so
 * the top-k can flip on a near-tie; one flip changes that token's attention
 * and, through the caches, everything after it (logits move by ~10%).  So
 * each mode runs twice:
 *   forced-selection - the GPU attends over the reference's selection
 *                      (m3_forward_debug_selection), so the logits check
 *                      covers every other op whatever the indexer does;
 *   free-running     - the GPU uses its own selection; logits are asserted
 *                      for as long as every selection equals the reference's.
 * and the GPU indexer's own output must equal the reference's on >= 99% of
 * (layer, head, token) rows with a bf16 index cache (97% free-running, where
 * one differing selection changes every later query), >= 95% with e4m3.
 * block128_top16_long_context runs the released geometry (128-token blocks,
 * top-16) over 2400 tokens the same way, on a GPU only.
 * Expert choice has the same chaotic near-ties (sigmoid + bias of 8 random
 * experts, inputs differing by a bf16 rounding), and m3_moe_forward has no
 * routing override, so the comparison config routes every token to all 8
 * experts (num_experts_per_tok = 8): every MoE kernel still runs (router GEMV,
 * route, group, expert GEMVs/GEMMs, combine with renormalised weights, which
 * are continuous), only the choice is not exercised here - the FFN op test
 * and the CPU reference test (top-4 of 8) cover it, and synthetic_model
 * below runs top-4 of 6 resident experts.
 *
 * Also: decode replayed from a CUDA graph equals eager decode bit for bit, and
 * so does decode with M3KIT_MOE_FUSE=norm (the MoE combine inside the next
 * add+norm launch) equal decode without it; a
 * synthetic model's weights equal m3_synth_value; bad inputs: a token id >=
 * vocab is M3_RANGE (prefill and decode), a context beyond
 * max_position_embeddings is rejected at admission and at cache init, a cache
 * beyond the GPU's memory is M3_CAPACITY, a page size other than the sparse
 * block size fails naming both.  Exit 77 without a GPU. */
#include <math.h>
#include <string.h>

#include "ref/ref_forward.h"
#include "runtime/forward.h"
#include "runtime/op_prefetch.h"
#include "tests/forward_cfg.h"
#include "tests/gpu_main.h"

GPU_TEST_GLOBALS

#define MAXPOS 512
#define PROMPT 80
#define CHUNK 32
#define STEPS 8
/* decode steps of compare_run: 8 on a GPU, 3 on the CPU emulator (each
 * emulated step runs every kernel thread by thread) */
static int n_steps(void) { return m3_test_emulated() ? 3 : STEPS; }

static m3_config cfg, cfg4; /* 8 experts: all routed (comparisons) / top-4 (synthetic_model) */
/* What compare_run and gpu_open run: the small config's prompt of PROMPT
 * tokens in CHUNK-token steps (default), or the block-128 test's. */
typedef struct run_shape {
  const m3_config *c;
  int prompt_len, chunk, maxpos;
  const int32_t *prompt;
} run_shape;
static run_shape S;
static fwd_ckpt ck;
static m3_ref_model *ref;
static m3_model *gm;
static int32_t prompt[MAXPOS];

static void teardown(void);
/* Once per process, however many TCases run: the checkpoint, its reference
 * load and the GPU model are shared by every case. */
static void setup(void) {
  if (gm) return;
  atexit(teardown);
  m3_err e = {0};
  ck_assert_msg(fwd_small_config(&cfg, 4, 1, MAXPOS, 8, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(fwd_small_config(&cfg4, 4, 1, MAXPOS, 4, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(fwd_ckpt_make(&cfg, 0, g_seed, &ck, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_ref_model_load(&cfg, ck.k, &ref, &e) == M3_OK, "%s", e.msg);
  m3_model_opts mo = {.dir = ck.dir};
  ck_assert_msg(m3_model_load(&g_rt, &mo, &gm, &e) == M3_OK, "%s", e.msg);
  m3_rng r = {g_seed ^ 0xabcdull};
  for (int i = 0; i < MAXPOS; i++) prompt[i] = (int32_t)(m3_rng_next(&r) % (uint64_t)cfg.vocab_size);
  S = (run_shape){.c = &cfg, .prompt_len = PROMPT, .chunk = CHUNK, .maxpos = MAXPOS, .prompt = prompt};
}

static void teardown(void) {
  m3_model_free(gm);
  m3_ref_model_free(ref);
  gm = NULL;
  ref = NULL;
  fwd_ckpt_close(&ck);
}

typedef struct gpu_run {
  m3_kv_cache kv;
  m3_forward *f;
  int seq;
} gpu_run;

static void gpu_open_model(gpu_run *g, const m3_model *m, int kv8, int ix8, int batch, int graph) {
  m3_err e = {0};
  m3_kv_opts ko = {.kv_e4m3 = kv8, .idx_e4m3 = ix8, .max_seqs = batch, .max_ctx = S.prompt_len + STEPS + 8};
  ck_assert_msg(m3_kv_init(&g->kv, S.c, &ko, &e) == M3_OK, "%s", e.msg);
  m3_fwd_opts fo = m3_fwd_defaults();
  fo.max_batch = batch;
  fo.max_chunk = S.chunk;
  fo.use_graph = graph;
  ck_assert_msg(m3_forward_create(&g_rt, m, &g->kv, &fo, &g->f, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_kv_admit(&g->kv, S.prompt_len + STEPS + 1, &g->seq, &e) == M3_OK, "%s", e.msg);
}

static void gpu_open(gpu_run *g, int kv8, int ix8, int batch, int graph) { gpu_open_model(g, gm, kv8, ix8, batch, graph); }

static void gpu_close(gpu_run *g) {
  m3_forward_free(g->f);
  m3_kv_free(&g->kv);
}

/* m3_forward_graph_breakdown's report as text (free() it); *st its status. */
static char *breakdown_text(m3_forward *f, int reps, m3_status *st, m3_err *e) {
  char *txt = NULL;
  size_t txt_n = 0;
  FILE *mem = open_memstream(&txt, &txt_n);
  ck_assert_ptr_nonnull(mem);
  *st = m3_forward_graph_breakdown(f, reps, mem, e);
  fclose(mem);
  return txt;
}

static double margin_top2(const float *x, int64_t n, int *top) {
  int a = fwd_argmax(x, n), b = a == 0 ? 1 : 0;
  for (int64_t i = 0; i < n; i++)
    if (i != a && x[i] > x[b]) b = (int)i;
  *top = a;
  return (double)x[a] - x[b];
}

/* Sets of selected blocks per (sparse layer, kv head, token) of one step:
 * rows compared and rows equal (as sets: both lists are in score order, a
 * near-tie may swap two entries without changing the set). */
static void sel_agree(const int32_t *a, const int32_t *b, int n, int64_t *rows, int64_t *same) {
  const m3_config *c = S.c;
  const int nkv = c->num_key_value_heads, K = c->sparse_topk_blocks;
  for (int l = 0; l < c->num_hidden_layers; l++) {
    if (!c->is_sparse[l]) continue;
    for (int r = 0; r < nkv * n; r++) {
      const int32_t *x = a + ((size_t)l * nkv * n + r) * K, *y = b + ((size_t)l * nkv * n + r) * K;
      int eq = 1;
      for (int i = 0; i < K && eq; i++) {
        int found = 0;
        for (int j = 0; j < K; j++) found |= x[i] == y[j];
        eq = found;
      }
      (*rows)++;
      *same += eq;
    }
  }
}

/* Prefill (in CHUNK-token calls, one forward step each on both sides) then
 * teacher-forced greedy decode steps, GPU against the reference.
 * force_sel: the GPU attends over the reference's selection (its own
 * indexer output is still captured and compared), so the logits check covers
 * every other op even when a quantised index score makes top-k flip.
 * Without it (free-running), the logits are checked strictly as long as the
 * GPU's selections equal the reference's; after a flip the run only reports. */
static void compare_run(const m3_ref_model *rmod, const m3_model *gmod, int kv8, int ix8, int force_sel) {
  const m3_config *cf = S.c;
  const int V = cf->vocab_size, L = cf->num_hidden_layers, nkv = cf->num_key_value_heads, K = cf->sparse_topk_blocks;
  const int PL = S.prompt_len, CH = S.chunk;
  m3_err e = {0};
  const size_t sel_n = (size_t)L * nkv * CH * K;
  int32_t *rsel = calloc(sel_n, 4), *gsel = calloc(sel_n, 4), *zeros = calloc((size_t)CH, 4);
  float *lr = malloc(sizeof(float) * V * CH), *lg = malloc(sizeof(float) * V);
  m3_ref_state *rs;
  ck_assert_msg(m3_ref_state_create(rmod, 1, S.maxpos, kv8, ix8, &rs, &e) == M3_OK, "%s", e.msg);
  rs->sel_out = rsel;
  gpu_run g;
  gpu_open_model(&g, gmod, kv8, ix8, 1, 1);
  m3_forward_debug_selection(g.f, gsel, force_sel ? rsel : NULL);
  int decided = 0, ties = 0, identical = 1, checked = 0;
  int64_t rows = 0, same = 0, dropped = 0;
  int32_t tok = -1, gtok = -1;
  const int steps = n_steps();
  for (int t0 = 0; t0 < PL; t0 += CH) { /* prefill */
    const int n = PL - t0 < CH ? PL - t0 : CH, last = t0 + n == PL;
    ck_assert_msg(m3_ref_step(rs, n, zeros, S.prompt + t0, lr, &e) == M3_OK, "%s", e.msg);
    dropped += rs->stat_dropped_blocks;
    m3_status s = m3_forward_prefill(g.f, g.seq, n, S.prompt + t0, NULL, &gtok, lg, &e);
    ck_assert_msg(s == M3_OK, "prefill [%d, %d): %s", t0, t0 + n, e.msg);
    int64_t r0 = same;
    sel_agree(gsel, rsel, n, &rows, &same);
    identical &= same - r0 == (int64_t)m3_config_n_sparse_layers(cf) * nkv * n;
    if (last) memmove(lr, lr + (size_t)(n - 1) * V, sizeof(float) * V);
  }
  ck_assert_int_gt(dropped, 0); /* the selection really dropped blocks */
  for (int step = 0; step <= steps; step++) {
    if (step > 0) {
      ck_assert_msg(m3_ref_step(rs, 1, zeros, &tok, lr, &e) == M3_OK, "%s", e.msg);
      m3_status s = m3_forward_decode(g.f, 1, &g.seq, &tok, NULL, &gtok, lg, &e);
      ck_assert_msg(s == M3_OK, "decode step %d: %s", step, e.msg);
      int64_t r0 = same;
      sel_agree(gsel, rsel, 1, &rows, &same);
      identical &= same - r0 == (int64_t)m3_config_n_sparse_layers(cf) * nkv;
    }
    double rel = fwd_rel_l2(lg, lr, (size_t)V), dmax = fwd_max_abs(lg, lr, (size_t)V);
    int rtop;
    double margin = margin_top2(lr, V, &rtop);
    const int strict = force_sel || identical;
    printf("kv %d idx %d %s step %d: rel %.2e, max|d| %.2e, token ref %d gpu %d, margin %.3g%s%s\n", kv8, ix8,
           force_sel ? "forced-selection" : "free-running", step, rel, dmax, rtop, gtok, margin,
           margin > 2 * dmax ? "" : " (near-tie)", strict ? "" : " (selection differs: not asserted)");
    if (strict) {
      checked++;
      ck_assert_msg(rel <= 2e-2, "kv %d idx %d step %d: logits rel L2 %g > 2e-2 (max |diff| %g)", kv8, ix8, step, rel,
                    dmax);
      if (margin > 2 * dmax) {
        decided++;
        ck_assert_msg(gtok == rtop, "kv %d idx %d step %d: GPU token %d, reference %d with margin %g > 2 x %g", kv8,
                      ix8, step, gtok, rtop, margin, dmax);
      } else {
        ties++;
      }
    }
    tok = rtop; /* teacher forcing with the reference's token */
  }
  /* The GPU indexer against the reference's, row by row: a bf16 index path
   * differs only on near-ties of fp32 scores; e4m3 index values can change
   * code when their bf16 inputs differ by one rounding, moving scores by ~1%
   * of a product, which reorders blocks whose scores are that close.
   * Free-running, a differing selection changes the attention output and so
   * every later layer's and step's index queries: the differences compound
   * (seed 1796182084708357: 99.34% forced, 98.77% free on the H200, the same
   * with the earlier merge of index_decode on the emulator), hence 97%. */
  const double agree = rows ? (double)same / rows : 1.0, need = ix8 ? 0.95 : force_sel ? 0.99 : 0.97;
  printf("kv %d idx %d %s: %lld of %lld selections identical (%.2f%%)\n", kv8, ix8,
         force_sel ? "forced-selection" : "free-running", (long long)same, (long long)rows, 100 * agree);
  ck_assert_msg(agree >= need, "kv %d idx %d: the GPU indexer agrees with the reference on %.2f%% < %.0f%% of rows", kv8,
                ix8, 100 * agree, 100 * need);
  /* Random weights give flat logits (top-2 margins of ~1e-2), so near-ties
   * are common; they are reported, and every decided step was asserted. */
  printf("kv %d idx %d %s: %d steps checked, %d decided by margin, %d near-ties\n", kv8, ix8,
         force_sel ? "forced-selection" : "free-running", checked, decided, ties);
  m3_forward_debug_selection(g.f, NULL, NULL);
  gpu_close(&g);
  m3_ref_state_free(rs);
  free(rsel);
  free(gsel);
  free(zeros);
  free(lr);
  free(lg);
}

START_TEST(forward_matches_reference) {
  static const int modes[3][2] = {{0, 0}, {0, 1}, {1, 1}}; /* (kv e4m3, index e4m3) */
  compare_run(ref, gm, modes[_i][0], modes[_i][1], 1);
  if (_i == 0 || !m3_test_emulated()) compare_run(ref, gm, modes[_i][0], modes[_i][1], 0);
}
END_TEST

/* MXFP8 checkpoint: W8A16 GEMVs at decode, dequantise + cuBLAS at prefill. */
START_TEST(mxfp8_checkpoint) {
  m3_err e = {0};
  fwd_ckpt c8;
  m3_ref_model *r8;
  m3_model *g8;
  ck_assert_msg(fwd_ckpt_make(&cfg, 1, g_seed, &c8, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_ref_model_load(&cfg, c8.k, &r8, &e) == M3_OK, "%s", e.msg);
  m3_model_opts mo = {.dir = c8.dir};
  ck_assert_msg(m3_model_load(&g_rt, &mo, &g8, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(g8->mxfp8, 1);
  ck_assert_int_eq(g8->layers[1].w13.mxfp8, 1);
  compare_run(r8, g8, 0, 1, 1);
  if (!m3_test_emulated()) compare_run(r8, g8, 0, 1, 0);
  m3_model_free(g8);
  m3_ref_model_free(r8);
  fwd_ckpt_close(&c8);
}
END_TEST

/* The uploaded, fused weights are the reference's bytes: [q;k;v;iq;ik] and
 * [gate;up] row order (§3.2, §7.2), expert stacking. */
START_TEST(fused_weights_match_reference) {
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    const m3_dlinear *w = &gm->layers[l].qkv;
    const m3_ref_weight *rw = &ref->layers[l].qkv;
    ck_assert_int_eq(w->rows, rw->rows);
    size_t n = (size_t)(w->rows * w->cols);
    m3_bf16 *h = malloc(n * 2);
    ck_assert_int_eq(cudaMemcpy(h, w->w, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ck_assert_msg(memcmp(h, rw->bf16, n * 2) == 0, "layer %d: fused QKV differs from the reference's", l);
    free(h);
    if (!gm->layers[l].moe) continue;
    const int x = 5, I = cfg.intermediate_size, H = cfg.hidden_size;
    m3_bf16 *g = malloc((size_t)2 * I * H * 2);
    ck_assert_int_eq(cudaMemcpy(g, m3_dlinear_at(&gm->layers[l].w13, x), (size_t)2 * I * H * 2, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    ck_assert(memcmp(g, ref->layers[l].w1[x].bf16, (size_t)I * H * 2) == 0);
    ck_assert(memcmp(g + (size_t)I * H, ref->layers[l].w3[x].bf16, (size_t)I * H * 2) == 0);
    free(g);
  }
}
END_TEST

START_TEST(graph_replay_equals_eager) {
  const int V = cfg.vocab_size;
  float *a = malloc(sizeof(float) * V * STEPS), *b = malloc(sizeof(float) * V * STEPS);
  int32_t ta[STEPS], tb[STEPS];
  for (int graph = 0; graph < 2; graph++) {
    gpu_run g;
    gpu_open(&g, 0, 0, 1, graph);
    m3_err e = {0};
    int32_t tok;
    ck_assert_msg(m3_forward_prefill(g.f, g.seq, 40, prompt, NULL, &tok, NULL, &e) == M3_OK, "%s", e.msg);
    for (int s = 0; s < STEPS; s++) {
      int32_t in = tok;
      ck_assert_msg(m3_forward_decode(g.f, 1, &g.seq, &in, NULL, &tok, (graph ? b : a) + (size_t)s * V, &e) == M3_OK,
                    "%s", e.msg);
      (graph ? tb : ta)[s] = tok;
    }
    /* The op breakdown of the replayed step (runtime/forward.h): refused
     * without a graph; with one, a row per op kind of the model and the sum. */
    m3_status bs;
    char *txt = breakdown_text(g.f, 3, &bs, &e);
    if (!graph) {
      ck_assert_int_eq(bs, M3_INVAL);
    } else {
      ck_assert_msg(bs == M3_OK, "%s", e.msg);
      static const char *rows[] = {"qkv_proj", "qknorm_rope", "indexer", "attn_sparse", "attn_dense", "o_proj", "moe",
                                   "moe/router", "moe/route", "moe/gate_up", "moe/swiglu", "moe/down", "moe/combine",
                                   "lm_head", "sum of ops", "whole step", "in the step"};
      for (size_t r = 0; r < sizeof rows / sizeof *rows; r++)
        ck_assert_msg(strstr(txt, rows[r]), "breakdown lacks a %s row:\n%s", rows[r], txt);
      if (getenv("M3KIT_TEST_VERBOSE")) fputs(txt, stdout);
    }
    free(txt);
    gpu_close(&g);
  }
  ck_assert_int_eq(memcmp(ta, tb, sizeof ta), 0);
  ck_assert_msg(memcmp(a, b, sizeof(float) * V * STEPS) == 0, "graph replay differs from eager launches");
  free(a);
  free(b);
}
END_TEST

/* M3KIT_MOE_FUSE=norm: each decode step's MoE layers leave their combine to
 * the add + norm after them (runtime/forward.c moe(), add_norm), whose launch
 * forms it (rmsnorm combine=K, here K = 8): the fused kernel ran, and every
 * step's logits equal the unfused run's bit for bit (the fused launch is the
 * combine + add_rmsnorm launches' bit for bit), the first step eager, the
 * rest replayed from the graph captured with it; the prefill chunks (not
 * fused) in both.  The per-op graph breakdown still runs: its "input_norm"
 * capture builds the fused launch with the MoE layer left out. */
START_TEST(moe_fuse_norm) {
  const int V = cfg.vocab_size, steps = n_steps();
  float *lg[2] = {malloc(sizeof(float) * V * steps), malloc(sizeof(float) * V * steps)};
  char want[M3_KEY_MAX];
  snprintf(want, sizeof want, "rmsnorm(add=1,f32copy=0,combine=%d,n=%d)", cfg.num_experts_per_tok, cfg.hidden_size);
  for (int fuse = 0; fuse < 2; fuse++) {
    /* read when the forward allocates its MoE workspace */
    if (fuse) ck_assert_int_eq(setenv("M3KIT_MOE_FUSE", "norm", 1), 0);
    gpu_run g;
    gpu_open(&g, 0, 0, 1, 1);
    ck_assert_int_eq(unsetenv("M3KIT_MOE_FUSE"), 0);
    m3_err e = {0};
    int32_t tok;
    ck_assert_msg(m3_forward_prefill(g.f, g.seq, 40, prompt, NULL, &tok, NULL, &e) == M3_OK, "%s", e.msg);
    for (int s = 0; s < steps; s++) { /* the same inputs for both runs */
      int32_t in = prompt[40 + s];
      ck_assert_msg(m3_forward_decode(g.f, 1, &g.seq, &in, NULL, &tok, lg[fuse] + (size_t)s * V, &e) == M3_OK,
                    "fuse %d step %d: %s", fuse, s, e.msg);
    }
    int ran = 0;
    for (int i = 0; i < g_rt.n_kernels; i++) {
      char key[M3_KEY_MAX];
      m3_variant_print_axes(&g_rt.kernels[i]->key, key, sizeof key);
      ran |= !strcmp(key, want);
    }
    ck_assert_msg(ran == fuse, "M3KIT_MOE_FUSE=%s: %s %s", fuse ? "norm" : "(unset)", want, ran ? "ran" : "did not run");
    if (fuse) {
      m3_status bs;
      char *txt = breakdown_text(g.f, 2, &bs, &e);
      ck_assert_msg(bs == M3_OK, "%s", e.msg);
      ck_assert_msg(strstr(txt, "input_norm") && strstr(txt, "moe") && strstr(txt, "whole step"), "%s", txt);
      ck_assert_msg(!strstr(txt, "moe/combine"), "a row for the combine launch that norm removed:\n%s", txt);
      free(txt);
    }
    gpu_close(&g);
  }
  for (int s = 0; s < steps; s++)
    ck_assert_msg(!memcmp(lg[0] + (size_t)s * V, lg[1] + (size_t)s * V, sizeof(float) * V),
                  "decode step %d: logits with M3KIT_MOE_FUSE=norm differ from the unfused run's", s);
  free(lg[0]);
  free(lg[1]);
}
END_TEST

/* M3KIT_L2_PREFETCH (runtime/forward.c prefetch()): the branches that send
 * the next GEMV's weights toward L2 change no value - every decode step's
 * logits with them equal the run's without them ("0") bit for bit, eager and
 * replayed - and they did run (the kernel was built, the breakdown has their
 * row), with "1" (the small model's matrices are under 1 MB: each whole) and
 * unset (the default: on for sm_90+, off before).  A value that is not one
 * or three MB counts in [0, 256] fails the create, naming the variable. */
START_TEST(l2_prefetch) {
  const int V = cfg.vocab_size, steps = n_steps();
  float *lg[3] = {malloc(sizeof(float) * V * steps), malloc(sizeof(float) * V * steps),
                  malloc(sizeof(float) * V * steps)};
  const int sm = 10 * g_rt.dev.cc_major + g_rt.dev.cc_minor;
  for (int arm = 0; arm < 3; arm++) { /* "0", "1", unset */
    const int on = arm == 1 || (arm == 2 && sm >= 90);
    if (arm < 2) ck_assert_int_eq(setenv("M3KIT_L2_PREFETCH", arm ? "1" : "0", 1), 0); /* read by m3_forward_create */
    gpu_run g;
    gpu_open(&g, 0, 0, 1, 1);
    ck_assert_int_eq(unsetenv("M3KIT_L2_PREFETCH"), 0);
    /* the bytes in effect (m3_forward_l2_prefetch): "0" none, "1" 1 MiB a phase, unset the default */
    for (int64_t ctx = 8192; ctx <= 524288; ctx *= 64) {
      int64_t pf[3];
      m3_forward_l2_prefetch(g.f, ctx, pf);
      for (int ph = 0; ph < 3; ph++) {
        const int64_t asked = arm == 0 ? 0 : arm == 1 ? 1 << 20 : m3_prefetch_default_bytes(sm, ph, ctx),
                      l2 = g_rt.dev.l2_bytes > 0 ? g_rt.dev.l2_bytes : INT64_MAX, want = asked < l2 ? asked : l2;
        ck_assert_msg(pf[ph] == want, "arm %d ctx %lld phase %d: %lld bytes, want %lld", arm, (long long)ctx, ph,
                      (long long)pf[ph], (long long)want);
      }
    }
    m3_err e = {0};
    int32_t tok;
    ck_assert_msg(m3_forward_prefill(g.f, g.seq, 40, prompt, NULL, &tok, NULL, &e) == M3_OK, "%s", e.msg);
    for (int s = 0; s < steps; s++) {
      int32_t in = prompt[40 + s];
      ck_assert_msg(m3_forward_decode(g.f, 1, &g.seq, &in, NULL, &tok, lg[arm] + (size_t)s * V, &e) == M3_OK,
                    "prefetch arm %d step %d: %s", arm, s, e.msg);
    }
    int ran = 0;
    for (int i = 0; i < g_rt.n_kernels; i++) ran |= !strcmp(g_rt.kernels[i]->key.op, "l2_prefetch");
    if (on) ck_assert_msg(ran, "prefetch arm %d: no l2_prefetch kernel was built", arm);
    m3_status bs;
    char *txt = breakdown_text(g.f, 2, &bs, &e);
    ck_assert_msg(bs == M3_OK, "%s", e.msg);
    ck_assert_msg(!strstr(txt, "l2_prefetch") == !on, "prefetch arm %d (sm_%d): the breakdown %s an l2_prefetch row:\n%s",
                  arm, sm, on ? "lacks" : "has", txt);
    free(txt);
    gpu_close(&g);
  }
  for (int arm = 1; arm < 3; arm++)
    for (int s = 0; s < steps; s++)
      ck_assert_msg(!memcmp(lg[0] + (size_t)s * V, lg[arm] + (size_t)s * V, sizeof(float) * V),
                    "decode step %d: logits with M3KIT_L2_PREFETCH %s differ from the run's with 0", s,
                    arm == 1 ? "=1" : "unset");
  for (int i = 0; i < 3; i++) free(lg[i]);
  static const char *bad[] = {"-1", "257", "1,2", "1,2,3,4", "x", "4MB", "1,,2"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    m3_kv_cache kv;
    m3_err e = {0};
    m3_kv_opts ko = {.max_seqs = 1, .max_ctx = 64};
    ck_assert_msg(m3_kv_init(&kv, S.c, &ko, &e) == M3_OK, "%s", e.msg);
    m3_fwd_opts fo = m3_fwd_defaults();
    m3_forward *f = NULL;
    ck_assert_int_eq(setenv("M3KIT_L2_PREFETCH", bad[i], 1), 0);
    m3_status st = m3_forward_create(&g_rt, gm, &kv, &fo, &f, &e);
    ck_assert_int_eq(unsetenv("M3KIT_L2_PREFETCH"), 0);
    ck_assert_msg(st == M3_INVAL && !f && strstr(e.msg, "M3KIT_L2_PREFETCH"), "M3KIT_L2_PREFETCH='%s': status %d, %s",
                  bad[i], st, e.msg);
    m3_kv_free(&kv);
  }
}
END_TEST

/* The model's real sparse geometry, 128-token blocks and top-16, over a
 * prompt of 2400 tokens: 19 blocks, more than the 16 x 128 = 2048 tokens the
 * selection keeps, so blocks are dropped at the block size the released model
 * uses (the small config's 16-token blocks cover the same code at a
 * different shape).  1 dense + 2 sparse layers, chunks of 256, both index
 * dtypes, teacher-forced selection.  GPU only: the emulator would take
 * hours over 2400 tokens. */
START_TEST(block128_top16_long_context) {
  if (m3_test_emulated()) {
    printf("block128_top16_long_context: skipped on the emulator\n");
    return;
  }
  enum { LEN = 2400, MAXP = 4096 };
  m3_err e = {0};
  m3_config t, cb;
  ck_assert_msg(m3_config_preset("tiny", &t, &e) == M3_OK, "%s", e.msg);
  t.num_hidden_layers = 3;
  for (int l = 0; l < 3; l++) t.is_sparse[l] = t.is_moe[l] = t.disable_index_value[l] = l >= 1;
  t.num_experts_per_tok = cfg.num_experts_per_tok; /* all routed: routing cannot flip on a near-tie */
  t.sparse_block_size = 128;
  t.sparse_topk_blocks = 16;
  t.max_position_embeddings = MAXP;
  char *j = m3_config_to_json(&t);
  ck_assert_ptr_nonnull(j);
  ck_assert_msg(m3_config_load_json_text(j, "block-128 test config", &cb, &e) == M3_OK, "%s", e.msg);
  free(j);
  fwd_ckpt c128;
  m3_ref_model *r128;
  m3_model *g128;
  ck_assert_msg(fwd_ckpt_make(&cb, 0, g_seed ^ 0x128ull, &c128, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_ref_model_load(&cb, c128.k, &r128, &e) == M3_OK, "%s", e.msg);
  m3_model_opts mo = {.dir = c128.dir};
  ck_assert_msg(m3_model_load(&g_rt, &mo, &g128, &e) == M3_OK, "%s", e.msg);
  int32_t *pr = malloc(sizeof *pr * MAXP);
  m3_rng r = {g_seed ^ 0x128128ull};
  for (int i = 0; i < MAXP; i++) pr[i] = (int32_t)(m3_rng_next(&r) % (uint64_t)cb.vocab_size);
  const run_shape saved = S;
  S = (run_shape){.c = &cb, .prompt_len = LEN, .chunk = 256, .maxpos = MAXP, .prompt = pr};
  compare_run(r128, g128, 0, 0, 1);
  compare_run(r128, g128, 0, 1, 1);
  S = saved;
  free(pr);
  m3_model_free(g128);
  m3_ref_model_free(r128);
  fwd_ckpt_close(&c128);
}
END_TEST

/* Two sequences of different lengths in one decode step, against the
 * reference's batched step.  Both stay within top-k x block tokens, so every
 * visible block is selected and no near-tie of the selection can move the
 * comparison (the dropping case is compare_run's). */
START_TEST(batched_decode) {
  /* (The emulator failure once seen here - row 0 off by rel 6e-2 - came with
   * 70 tokens and top-4 routing, i.e. a selection or routing near-tie; with
   * these lengths and all experts routed it does not reproduce over 16 seeds,
   * and the batched row equals the sequence decoded alone bit for bit on the
   * emulator.) */
  const int V = cfg.vocab_size;
  m3_err e = {0};
  gpu_run g;
  gpu_open(&g, 0, 1, 2, 1); /* e4m3 index cache: exercised, never decisive here */
  int s2;
  ck_assert_msg(m3_kv_admit(&g.kv, 40, &s2, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_forward_prefill(g.f, g.seq, 60, prompt, NULL, NULL, NULL, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_forward_prefill(g.f, s2, 21, prompt + 100, NULL, NULL, NULL, &e) == M3_OK, "%s", e.msg);
  int seqs[2] = {s2, g.seq};
  int32_t ids[2] = {prompt[300], prompt[301]};
  float *lg = malloc(sizeof(float) * 2 * V), *lr = malloc(sizeof(float) * 2 * V);
  ck_assert_msg(m3_forward_decode(g.f, 2, seqs, ids, NULL, NULL, lg, &e) == M3_OK, "%s", e.msg);
  m3_ref_state *rs;
  ck_assert_int_eq(m3_ref_state_create(ref, 2, MAXPOS, 0, 1, &rs, &e), M3_OK);
  ck_assert_int_eq(m3_ref_prefill(rs, 0, 21, prompt + 100, 0, NULL, NULL, &e), M3_OK);
  ck_assert_int_eq(m3_ref_prefill(rs, 1, 60, prompt, 0, NULL, NULL, &e), M3_OK);
  int32_t rseq[2] = {0, 1};
  ck_assert_int_eq(m3_ref_step(rs, 2, rseq, ids, lr, &e), M3_OK);
  for (int i = 0; i < 2; i++) {
    double rel = fwd_rel_l2(lg + (size_t)i * V, lr + (size_t)i * V, (size_t)V);
    ck_assert_msg(rel <= 2e-2, "row %d: rel %g", i, rel);
  }
  /* Row 0 against the same sequence decoded alone on the GPU: batching must
   * not change a row (per-row math; only a schedule choice such as the GEMV's
   * rows-per-launch could reorder fp32 sums, hence 1e-3 and not 0). */
  gpu_run one;
  gpu_open(&one, 0, 1, 1, 1);
  float *l1 = malloc(sizeof(float) * V);
  ck_assert_msg(m3_forward_prefill(one.f, one.seq, 21, prompt + 100, NULL, NULL, NULL, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(m3_forward_decode(one.f, 1, &one.seq, &ids[0], NULL, NULL, l1, &e) == M3_OK, "%s", e.msg);
  double rb = fwd_rel_l2(lg, l1, (size_t)V);
  ck_assert_msg(rb <= 1e-3, "a batched row differs from the same sequence decoded alone: rel %g", rb);
  gpu_close(&one);
  free(l1);
  m3_ref_state_free(rs);
  gpu_close(&g);
  free(lg);
  free(lr);
}
END_TEST

START_TEST(bad_inputs) {
  m3_err e = {0};
  gpu_run g;
  gpu_open(&g, 0, 0, 1, 1);
  int32_t bad[3] = {1, cfg.vocab_size, 2};
  ck_assert_int_eq(m3_forward_prefill(g.f, g.seq, 3, bad, NULL, NULL, NULL, &e), M3_RANGE);
  ck_assert_ptr_nonnull(strstr(e.msg, "2048"));
  ck_assert_int_eq(g.kv.seq_lens[g.seq], 0); /* nothing was appended */
  ck_assert_int_eq(m3_forward_prefill(g.f, g.seq, 4, prompt, NULL, NULL, NULL, &e), M3_OK);
  int32_t neg = -1;
  ck_assert_int_eq(m3_forward_decode(g.f, 1, &g.seq, &neg, NULL, NULL, NULL, &e), M3_RANGE);
  /* admission past max_position_embeddings (known-faults #24) */
  int s;
  m3_kv_release(&g.kv, g.seq);
  ck_assert_int_eq(m3_kv_admit(&g.kv, MAXPOS + 1, &s, &e), M3_RANGE);
  ck_assert_ptr_nonnull(strstr(e.msg, "max_position_embeddings"));
  gpu_close(&g);
  m3_kv_cache kv;
  m3_kv_opts far = {.max_seqs = 1, .max_ctx = MAXPOS + 1};
  ck_assert_int_eq(m3_kv_init(&kv, &cfg, &far, &e), M3_RANGE);
  /* beyond the GPU's memory */
  m3_kv_opts huge = {.max_seqs = 1 << 22, .max_ctx = MAXPOS};
  ck_assert_int_eq(m3_kv_init(&kv, &cfg, &huge, &e), M3_CAPACITY);
  ck_assert_ptr_nonnull(strstr(e.msg, "bytes per token"));
  /* page size must be the sparse block size (known-faults #10) */
  m3_kv_opts page = {.max_seqs = 1, .max_ctx = 64, .page_size = 32};
  ck_assert_int_eq(m3_kv_init(&kv, &cfg, &page, &e), M3_CONFIG);
  ck_assert_ptr_nonnull(strstr(e.msg, "page size 32"));
  ck_assert_ptr_nonnull(strstr(e.msg, "sparse_block_size 16"));
  /* resident experts outside [top-k, E] */
  m3_model *m;
  m3_model_opts mo = {.config = &cfg4, .resident_experts = cfg4.num_experts_per_tok - 1};
  ck_assert_int_eq(m3_model_load(&g_rt, &mo, &m, &e), M3_INVAL);
}
END_TEST

/* Synthetic weights: generated on the GPU, equal to the host generator; and
 * a restricted-routing model runs (finite logits). */
START_TEST(synthetic_model) {
  m3_err e = {0};
  m3_model *m;
  m3_model_opts mo = {.config = &cfg4, .resident_experts = 6, .seed = 7};
  ck_assert_msg(m3_model_load(&g_rt, &mo, &m, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(m->n_resident, 6);
  m3_bf16 got[64];
  ck_assert_int_eq(cudaMemcpy(got, m->embed, sizeof got, cudaMemcpyDeviceToHost), cudaSuccess);
  uint64_t sd = m3_synth_seed(7, "embed_tokens");
  for (int i = 0; i < 64; i++) ck_assert_uint_eq(got[i], m3_f32_to_bf16(m3_synth_value(sd, i, 0.02f)));
  float bias[8];
  ck_assert_int_eq(cudaMemcpy(bias, m->layers[1].bias, sizeof bias, cudaMemcpyDeviceToHost), cudaSuccess);
  ck_assert(isinf(bias[6]) && bias[6] < 0 && isinf(bias[7]) && isfinite(bias[5])); /* the routing mask */
  m3_kv_cache kv;
  m3_kv_opts ko = {.max_seqs = 1, .max_ctx = 64};
  ck_assert_msg(m3_kv_init(&kv, &cfg4, &ko, &e) == M3_OK, "%s", e.msg);
  m3_fwd_opts fo = m3_fwd_defaults();
  fo.max_chunk = 16;
  m3_forward *f;
  ck_assert_msg(m3_forward_create(&g_rt, m, &kv, &fo, &f, &e) == M3_OK, "%s", e.msg);
  int s;
  ck_assert_int_eq(m3_kv_admit(&kv, 40, &s, &e), M3_OK);
  float *lg = malloc(sizeof(float) * cfg4.vocab_size);
  int32_t tok;
  ck_assert_msg(m3_forward_prefill(f, s, 20, prompt, NULL, &tok, lg, &e) == M3_OK, "%s", e.msg);
  for (int i = 0; i < 4; i++) {
    int32_t in = tok;
    ck_assert_msg(m3_forward_decode(f, 1, &s, &in, NULL, &tok, lg, &e) == M3_OK, "%s", e.msg);
  }
  for (int v = 0; v < cfg4.vocab_size; v++) ck_assert(isfinite(lg[v]));
  free(lg);
  m3_forward_free(f);
  m3_kv_free(&kv);
  m3_model_free(m);
}
END_TEST


/* M3KIT_CHECK_NUMERICS (issue "Hardening" 5): a NaN planted in a weight is
 * reported by the first op whose output it reaches: layer 2's post-attention
 * norm at layer 2; layer 0's input norm by op input_norm (its output was once
 * not scanned, so qkv_proj took the blame); the embedding row of the prompt's
 * first token by op embed.  With the check off the first run "succeeds" with
 * NaN logits (the hazard the check exists for), and the check is off by
 * default. */
START_TEST(numerics_check_names_layer) {
  const int V = cfg.vocab_size, H = cfg.hidden_size;
  struct {
    m3_bf16 *w;
    const char *want;
  } fault[] = {
      {gm->layers[2].post_norm, "layer 2,"},
      {gm->layers[0].input_norm, "layer 0, op input_norm:"},
      {gm->embed + (size_t)prompt[0] * H, "op embed:"},
  };
  m3_err e = {0};
  float *lg = malloc(sizeof(float) * V);
  for (int fi = 0; fi < 3; fi++) {
    m3_bf16 saved, nan = 0x7fc0;
    m3_bf16 *w = fault[fi].w;
    GPU_CHECK(m3_dev_download(&saved, w, sizeof saved, &e_));
    GPU_CHECK(m3_dev_upload(w, &nan, sizeof nan, &e_));
    for (int on = fi > 0; on < 2; on++) {
      m3_kv_cache kv;
      m3_kv_opts ko = {.max_seqs = 1, .max_ctx = 64};
      ck_assert_msg(m3_kv_init(&kv, &cfg, &ko, &e) == M3_OK, "%s", e.msg);
      m3_fwd_opts fo = m3_fwd_defaults();
      ck_assert_int_eq(fo.check_numerics, -1); /* default: $M3KIT_CHECK_NUMERICS, unset = off */
      fo.check_numerics = on;
      m3_forward *f;
      int seq;
      ck_assert_msg(m3_forward_create(&g_rt, gm, &kv, &fo, &f, &e) == M3_OK, "%s", e.msg);
      ck_assert_msg(m3_kv_admit(&kv, 40, &seq, &e) == M3_OK, "%s", e.msg);
      m3_status st = m3_forward_prefill(f, seq, 20, prompt, NULL, NULL, lg, &e);
      if (on) {
        ck_assert_msg(st == M3_NUMERICS, "check on: %s (%s)", m3_status_name(st), e.msg);
        ck_assert_msg(strstr(e.msg, fault[fi].want) != NULL, "the report does not name '%s': %s", fault[fi].want,
                      e.msg);
        printf("numerics check: %s\n", e.msg);
      } else {
        ck_assert_msg(st == M3_OK, "check off: %s", e.msg);
        int nans = 0;
        for (int v = 0; v < V; v++) nans += !isfinite(lg[v]);
        ck_assert_msg(nans > 0, "a NaN weight did not reach the logits: the planted fault is no fault");
      }
      m3_forward_free(f);
      m3_kv_free(&kv);
    }
    GPU_CHECK(m3_dev_upload(w, &saved, sizeof saved, &e_));
  }
  free(lg);
}
END_TEST

/* m3kit run --synthetic-cache: PROMPT-1 tokens of random cache entries, the
 * last prompt token prefilled, then decode.  Lengths advance, logits are
 * finite, and they depend on the synthetic entries (two fill seeds, two
 * answers): the decode really reads what was filled. */
START_TEST(synthetic_cache_decode) {
  const int V = cfg.vocab_size;
  m3_err e = {0};
  float *lg[2];
  for (int k = 0; k < 2; k++) {
    gpu_run g;
    gpu_open(&g, 0, 0, 1, 1);
    ck_assert_msg(m3_kv_fill_synthetic(&g_rt, &g.kv, &g.seq, 1, PROMPT - 1, 11 + 7 * (uint64_t)k, &e) == M3_OK, "%s", e.msg);
    ck_assert_int_eq(g.kv.seq_lens[g.seq], PROMPT - 1);
    int32_t next;
    lg[k] = malloc(sizeof(float) * V);
    ck_assert_msg(m3_forward_prefill(g.f, g.seq, 1, prompt + PROMPT - 1, NULL, &next, NULL, &e) == M3_OK, "%s", e.msg);
    ck_assert_msg(m3_forward_decode(g.f, 1, &g.seq, &next, NULL, NULL, lg[k], &e) == M3_OK, "%s", e.msg);
    ck_assert_int_eq(g.kv.seq_lens[g.seq], PROMPT + 1);
    for (int v = 0; v < V; v++) ck_assert_msg(isfinite(lg[k][v]), "logit %d is %g", v, lg[k][v]);
    gpu_close(&g);
  }
  double rel = fwd_rel_l2(lg[0], lg[1], (size_t)V);
  ck_assert_msg(rel > 1e-3, "logits do not depend on the synthetic cache (rel %g)", rel);
  free(lg[0]);
  free(lg[1]);
}
END_TEST

static Suite *make(void) {
  Suite *s = suite_create("forward_gpu");
  gpu_add_case(s, "fused_weights", setup, fused_weights_match_reference, 0);
  gpu_add_case(s, "reference", setup, forward_matches_reference, 3);
  gpu_add_case(s, "mxfp8", setup, mxfp8_checkpoint, 0);
  gpu_add_case(s, "graph", setup, graph_replay_equals_eager, 0);
  gpu_add_case(s, "moe_fuse_norm", setup, moe_fuse_norm, 0);
  gpu_add_case(s, "l2_prefetch", setup, l2_prefetch, 0);
  gpu_add_case(s, "block128", setup, block128_top16_long_context, 0);
  gpu_add_case(s, "batched", setup, batched_decode, 0);
  gpu_add_case(s, "bad_inputs", setup, bad_inputs, 0);
  gpu_add_case(s, "synthetic_model", setup, synthetic_model, 0);
  gpu_add_case(s, "numerics", setup, numerics_check_names_layer, 0);
  gpu_add_case(s, "synthetic_cache", setup, synthetic_cache_decode, 0);
  return s;
}

int main(void) { return gpu_test_main("check_forward_gpu", make); }
