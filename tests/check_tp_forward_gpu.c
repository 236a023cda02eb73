/* check_tp_forward_gpu.c - tensor parallelism (issue 7) on ONE device: the
 * driver (runtime/tp_forward.h) runs 1, 2 and 4 ranks of a small random
 * checkpoint with the local backend (runtime/tp_comm.h) and its logits are
 * compared with the plain single-GPU m3_forward of the same checkpoint.
 *
 * Config: tests/forward_cfg.h's small M3 (hidden 256, 8 q heads, 4 KV heads,
 * head_dim 128, block 16, top-k 4 blocks, 8 experts) with 1 dense + 2
 * sparse/MoE layers, intermediate and shared widths 128 and the dense MLP
 * 256 (multiples of 32 x 4: whole MXFP8 blocks on 4 ranks), all 8 experts
 * routed (as the whole-model test: expert choice has chaotic near-ties, and
 * routing is replicated, so it cannot differ between ranks anyway).
 *
 * Runs: a prompt of PROMPT tokens (> top-k x block, so the sparse layers
 * drop blocks) in CHUNK-token prefill calls, then greedy decode steps,
 * teacher-forced with the plain run's tokens.
 *   plain   m3_forward on the test's context, capturing its selection;
 *   tp 1    through the driver (its own thread and context, no link, decode
 *           graphs on): logits and tokens bit-identical to plain;
 *   tp 2, 4 local backend, attending over the plain run's selection
 *           (m3_tp_debug_selection: a top-k flip on a near-tie of index
 *           scores would otherwise move logits ~10% and hide everything
 *           else, as in check_forward_gpu): logits rel L2 <= 2e-2 (the
 *           whole-model test's bound; NaN fails it), the greedy token equal
 *           where plain's top-1/top-2 margin exceeds 2 max|diff| (near-ties
 *           counted and printed), every rank's token the same (the driver
 *           checks it each call, the test again from m3_tp_rank_tokens), the
 *           ranks' own indexer output equal to plain's on >= 97% of rows (a
 *           wrong index_q slice would agree on few), per-rank KV bytes per
 *           token = m3_tp_kv_bytes_per_token (§9.3), and the collective count
 *           2 a layer a call + 1 logits all-gather a call.
 * Sliced weights: a rank's model equals the right rows / columns of the
 * whole model's tensors (spec §3.2's 5 QKV row ranges, o_proj and down
 * columns, gate/up row pairs, lm_head rows, replicated norms and router),
 * bf16 and MXFP8 checkpoints (values and E8M0 scales), and synthetic MXFP8
 * weights with 2 KV heads over 4 ranks (each KV head replicated on 2).
 * NCCL (one GPU a rank, decode graphs on): TP=2, and TP=4 with >= 4 GPUs, run
 * the same teacher-forced calls with the same checks; then a "free" run, a
 * prompt of PROMPT_FREE tokens short enough that every sparse layer selects
 * every block (context <= top-k x block), so no selection is overridden and
 * decode steps replay CUDA graphs (asserted), against a plain run of the
 * same prompt with the same checks but the indexer agreement.  With fewer
 * GPUs, or no loadable libnccl, the case prints "SKIPPED (why)" and passes
 * without checking (check has no per-test skip), so the program still runs
 * on one GPU and on the emulator, where the free run goes through the local
 * backend instead (graphs off there: asserted too).
 * Synthetic cache (m3_tp_fill_synthetic, `m3kit run --tp --synthetic-cache`):
 * refusals change no rank; two sequences filled on 2 ranks decode together
 * with finite logits that differ between them (their caches are read), and
 * every rank's timing table (m3_tp_timing) counts its collectives.
 * Refusals: a rank count the config cannot cut names the field; a bad token
 * id is M3_RANGE before any rank runs and the group stays usable.  Failure:
 * a rank failing mid-step (a NaN only it holds, numerics check on) wakes the
 * rank waiting in the all-reduce, and the call reports the failing rank.
 * Exit 77 without a GPU; the emu_ build runs it on the CPU emulator. */
#include <math.h>
#include <string.h>

#include "runtime/forward.h"
#include "runtime/tp_forward.h"
#include "runtime/tp_plan.h"
#include "tests/forward_cfg.h"
#include "tests/gpu_main.h"

GPU_TEST_GLOBALS

#define MAXPOS 128
#define PROMPT 80
#define CHUNK 32
#define NCHUNK ((PROMPT + CHUNK - 1) / CHUNK)
#define MAXSTEPS 8
/* decode steps: 8 on a GPU, 3 on the CPU emulator */
static int n_steps(void) { return m3_test_emulated() ? 3 : MAXSTEPS; }
#define NCALLS (NCHUNK + MAXSTEPS) /* prefill calls, then decode steps */
/* The free run's prompt: with the decode steps it stays within top-k x block
 * (4 x 16 = 64) tokens, so every block is selected and no override is needed. */
#define PROMPT_FREE 48
#define NCHUNK_FREE ((PROMPT_FREE + CHUNK - 1) / CHUNK)

static m3_config cfg;
static fwd_ckpt ck;
static int32_t prompt[MAXPOS];
/* The plain single-GPU run, per call: last-token logits, greedy token,
 * indexer selection [L][nkv][CHUNK][topk] (first n rows used). */
static float *plain_lg;
static int32_t plain_tok[NCALLS];
static int32_t *plain_sel;
static size_t sel_per_call;
/* The plain run of the free prompt (PROMPT_FREE tokens), no hooks. */
static float *free_lg;
static int32_t free_tok[NCALLS];

/* The small config with widths every tp in {1, 2, 4} cuts (and nkv KV /
 * index heads), validated through the loader. */
static m3_status tp_config(m3_config *c, int nkv, m3_err *e) {
  m3_config t;
  M3_TRY(fwd_small_config(&t, 3, 1, MAXPOS, 8, e));
  t.intermediate_size = t.shared_intermediate_size = 128;
  t.dense_intermediate_size = 256;
  t.num_key_value_heads = t.sparse_num_index_heads = nkv;
  char *j = m3_config_to_json(&t);
  if (!j) return m3_errf(e, M3_NOMEM, "config json");
  m3_status s = m3_config_load_json_text(j, "tensor-parallel test config", c, e);
  free(j);
  return s;
}

/* A run: its prompt length, its prefill calls of CHUNK tokens, then n_steps() decode steps. */
static int n_chunks(int prompt) { return (prompt + CHUNK - 1) / CHUNK; }
static int n_calls_of(int prompt) { return n_chunks(prompt) + n_steps(); }
static int call_tokens_of(int prompt, int i) {
  return i < n_chunks(prompt) ? (prompt - i * CHUNK < CHUNK ? prompt - i * CHUNK : CHUNK) : 1;
}
static int n_calls(void) { return n_calls_of(PROMPT); }
static int call_tokens(int i) { return call_tokens_of(PROMPT, i); }

static void teardown(void) {
  free(plain_lg);
  free(plain_sel);
  free(free_lg);
  plain_lg = NULL;
  free_lg = NULL;
  fwd_ckpt_close(&ck);
}

/* Once per process: the checkpoint and the plain run every case compares with. */
static void setup(void) {
  if (plain_lg) return;
  atexit(teardown);
  m3_err e = {0};
  ck_assert_msg(tp_config(&cfg, 4, &e) == M3_OK, "%s", e.msg);
  ck_assert_msg(fwd_ckpt_make(&cfg, 0, g_seed, &ck, &e) == M3_OK, "%s", e.msg);
  m3_rng r = {g_seed ^ 0x7e9ull};
  for (int i = 0; i < MAXPOS; i++) prompt[i] = (int32_t)(m3_rng_next(&r) % (uint64_t)cfg.vocab_size);
  const int V = cfg.vocab_size;
  sel_per_call = (size_t)cfg.num_hidden_layers * cfg.num_key_value_heads * CHUNK * cfg.sparse_topk_blocks;
  plain_lg = calloc((size_t)NCALLS * V, sizeof(float));
  plain_sel = calloc(NCALLS * sel_per_call, sizeof(int32_t));
  free_lg = calloc((size_t)NCALLS * V, sizeof(float));
  ck_assert(plain_lg && plain_sel && free_lg);

  m3_model *m;
  m3_model_opts mo = {.dir = ck.dir};
  ck_assert_msg(m3_model_load(&g_rt, &mo, &m, &e) == M3_OK, "%s", e.msg);
  m3_kv_cache kv;
  m3_kv_opts ko = {.max_seqs = 1, .max_ctx = PROMPT + MAXSTEPS + 1};
  ck_assert_msg(m3_kv_init(&kv, &m->cfg, &ko, &e) == M3_OK, "%s", e.msg);
  m3_fwd_opts fo = m3_fwd_defaults();
  fo.max_chunk = CHUNK;
  m3_forward *f;
  ck_assert_msg(m3_forward_create(&g_rt, m, &kv, &fo, &f, &e) == M3_OK, "%s", e.msg);
  int seq;
  ck_assert_msg(m3_kv_admit(&kv, PROMPT + MAXSTEPS + 1, &seq, &e) == M3_OK, "%s", e.msg);
  for (int i = 0; i < n_calls(); i++) {
    const int n = call_tokens(i);
    m3_forward_debug_selection(f, plain_sel + (size_t)i * sel_per_call, NULL);
    m3_status s = i < NCHUNK ? m3_forward_prefill(f, seq, n, prompt + i * CHUNK, NULL, &plain_tok[i],
                                                  plain_lg + (size_t)i * V, &e)
                             : m3_forward_decode(f, 1, &seq, &plain_tok[i - 1], NULL, &plain_tok[i],
                                                 plain_lg + (size_t)i * V, &e);
    ck_assert_msg(s == M3_OK, "plain call %d: %s", i, e.msg);
  }
  /* the free prompt (the same ids' first PROMPT_FREE), without hooks */
  m3_forward_debug_selection(f, NULL, NULL);
  m3_kv_release(&kv, seq);
  ck_assert_msg(m3_kv_admit(&kv, PROMPT_FREE + MAXSTEPS + 1, &seq, &e) == M3_OK, "%s", e.msg);
  for (int i = 0; i < n_calls_of(PROMPT_FREE); i++) {
    const int n = call_tokens_of(PROMPT_FREE, i);
    m3_status s = i < NCHUNK_FREE ? m3_forward_prefill(f, seq, n, prompt + i * CHUNK, NULL, &free_tok[i],
                                                       free_lg + (size_t)i * V, &e)
                                  : m3_forward_decode(f, 1, &seq, &free_tok[i - 1], NULL, &free_tok[i],
                                                      free_lg + (size_t)i * V, &e);
    ck_assert_msg(s == M3_OK, "plain free call %d: %s", i, e.msg);
  }
  m3_forward_free(f);
  m3_kv_free(&kv);
  m3_model_free(m);
}

/* ---- the forward through the driver ----------------------------------- */

static double margin_top2(const float *x, int64_t n) {
  int a = fwd_argmax(x, n), b = a == 0 ? 1 : 0;
  for (int64_t i = 0; i < n; i++)
    if (i != a && x[i] > x[b]) b = (int)i;
  return (double)x[a] - x[b];
}

/* Rows (sparse layer, KV head, token) whose selected blocks equal plain's as
 * sets (both lists are in score order; a near-tie may swap two). */
static void sel_agree(const int32_t *a, const int32_t *b, int n, int64_t *rows, int64_t *same) {
  const int nkv = cfg.num_key_value_heads, K = cfg.sparse_topk_blocks;
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    if (!cfg.is_sparse[l]) continue;
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

/* One run through the driver.  forced: the long prompt on the plain run's
 * selection (graphs off: the hook synchronises); else the free prompt, no
 * hooks, decode graphs on where the backend can capture them. */
static void tp_run(int tp, m3_tp_backend be, int forced_sel) {
  const int V = cfg.vocab_size, L = cfg.num_hidden_layers;
  const int P = forced_sel ? PROMPT : PROMPT_FREE, nch = n_chunks(P), calls = n_calls_of(P);
  const char *bn = be == M3_TP_NCCL ? "nccl" : "local";
  const float *ref_lg = forced_sel ? plain_lg : free_lg;
  const int32_t *ref_tok = forced_sel ? plain_tok : free_tok;
  m3_err e = {0};
  m3_tp_opts o = {.tp = tp, .backend = be, .model = {.dir = ck.dir},
                  .kv = {.max_seqs = 1, .max_ctx = PROMPT + MAXSTEPS + 1}, .fwd = m3_fwd_defaults()};
  o.fwd.max_chunk = CHUNK;
  m3_tp_group *g;
  ck_assert_msg(m3_tp_open(&o, &g, &e) == M3_OK, "tp %d %s: %s", tp, bn, e.msg);
  ck_assert_int_eq(m3_tp_ranks(g), tp);
  for (int r = 0; r < tp; r++) {
    m3_tp_rank_info ri;
    ck_assert_int_eq(m3_tp_info(g, r, &ri, &e), M3_OK);
    ck_assert_uint_eq(ri.kv_bytes_per_token, m3_tp_kv_bytes_per_token(&cfg, tp, 2, 2));
    if (be == M3_TP_NCCL) ck_assert_int_eq(ri.device, r); /* one GPU a rank */
    printf("tp %d %s rank %d: device %d, %llu weight bytes (peak %llu while loading), %llu B/token of cache\n", tp,
           bn, r, ri.device, (unsigned long long)ri.weight_bytes, (unsigned long long)ri.peak_bytes,
           (unsigned long long)ri.kv_bytes_per_token);
  }
  int seq;
  ck_assert_msg(m3_tp_admit(g, PROMPT + MAXSTEPS + 1, &seq, &e) == M3_OK, "%s", e.msg);
  /* a bad id fails on the host before any rank runs; the group stays usable */
  int32_t bad[2] = {1, cfg.vocab_size};
  ck_assert_int_eq(m3_tp_prefill(g, seq, 2, bad, NULL, NULL, NULL, &e), M3_RANGE);

  const int forced = tp > 1 && forced_sel;
  int32_t *cap = calloc(sel_per_call, sizeof(int32_t));
  float *lg = malloc(sizeof(float) * V);
  int decided = 0, ties = 0;
  int64_t rows = 0, same = 0;
  for (int i = 0; i < calls; i++) {
    const int n = call_tokens_of(P, i);
    const int32_t *ovr = plain_sel + (size_t)i * sel_per_call;
    if (forced) m3_tp_debug_selection(g, cap, ovr);
    int32_t tok = -1;
    m3_status s = i < nch ? m3_tp_prefill(g, seq, n, prompt + i * CHUNK, NULL, &tok, lg, &e)
                          : m3_tp_decode(g, 1, &seq, &ref_tok[i - 1], NULL, &tok, lg, &e);
    ck_assert_msg(s == M3_OK, "tp %d %s call %d: %s", tp, bn, i, e.msg);
    for (int r = 0; r < tp; r++)
      ck_assert_msg(m3_tp_rank_tokens(g, r)[0] == tok, "tp %d %s call %d: rank %d chose %d, rank 0 %d", tp, bn, i, r,
                    m3_tp_rank_tokens(g, r)[0], tok);
    const float *ref = ref_lg + (size_t)i * V;
    const double rel = fwd_rel_l2(lg, ref, (size_t)V), dmax = fwd_max_abs(lg, ref, (size_t)V);
    const double margin = margin_top2(ref, V);
    if (forced) sel_agree(cap, ovr, n, &rows, &same);
    printf("tp %d %s%s %s %d: rel %.2e, max|d| %.2e, token plain %d tp %d, margin %.3g%s\n", tp, bn,
           forced_sel ? "" : " free", i < nch ? "prefill chunk" : "decode step", i < nch ? i : i - nch + 1, rel, dmax,
           ref_tok[i], tok, margin, margin > 2 * dmax ? "" : " (near-tie)");
    if (tp == 1) { /* the same kernels on the same bits, on another thread and context */
      ck_assert_msg(memcmp(lg, ref, sizeof(float) * V) == 0, "tp 1 call %d: logits differ from plain m3_forward "
                    "(rel %g)", i, rel);
      ck_assert_int_eq(tok, ref_tok[i]);
      continue;
    }
    ck_assert_msg(rel <= 2e-2, "tp %d %s call %d: logits rel L2 %g > 2e-2 (max |diff| %g)", tp, bn, i, rel, dmax);
    if (margin > 2 * dmax) {
      decided++;
      ck_assert_msg(tok == ref_tok[i], "tp %d %s call %d: token %d, plain %d with margin %g > 2 x %g", tp, bn, i, tok,
                    ref_tok[i], margin, dmax);
    } else {
      ties++;
    }
  }
  if (forced) {
    m3_tp_debug_selection(g, NULL, NULL);
    const double agree = rows ? (double)same / rows : 1.0;
    printf("tp %d %s: %d calls, %d decided by margin, %d near-ties; the ranks' indexers agree with plain on %lld of "
           "%lld rows (%.2f%%)\n", tp, bn, calls, decided, ties, (long long)same, (long long)rows, 100 * agree);
    ck_assert_msg(agree >= 0.97, "tp %d %s: the ranks' indexers agree with plain on %.2f%% < 97%% of rows", tp, bn,
                  100 * agree);
  } else if (tp > 1) {
    printf("tp %d %s free: %d calls, %d decided by margin, %d near-ties\n", tp, bn, calls, decided, ties);
  }
  /* 2 all-reduces a layer and 1 logits all-gather per call, on every rank
   * (graph replays included); decode graphs replayed exactly where the link
   * can capture them (NCCL) and nothing overrides the selection: every
   * decode step after the first (which runs eagerly and captures) */
  for (int r = 0; r < tp; r++) {
    m3_tp_rank_info ri;
    ck_assert_int_eq(m3_tp_info(g, r, &ri, &e), M3_OK);
    const uint64_t want_ar = tp > 1 ? (uint64_t)(2 * L * calls) : 0, want_ag = tp > 1 ? (uint64_t)calls : 0;
    ck_assert_msg(ri.allreduces == want_ar && ri.allgathers == want_ag,
                  "tp %d %s rank %d: %llu all-reduces, %llu all-gathers; want %llu, %llu", tp, bn, r,
                  (unsigned long long)ri.allreduces, (unsigned long long)ri.allgathers, (unsigned long long)want_ar,
                  (unsigned long long)want_ag);
    const int graphed = !forced && (tp == 1 || be == M3_TP_NCCL);
    printf("tp %d %s rank %d: %llu decode steps replayed from graphs\n", tp, bn, r,
           (unsigned long long)ri.graph_replays);
    if (graphed)
      ck_assert_msg(ri.graph_replays >= 1 && ri.graph_replays <= (uint64_t)(n_steps() - 1),
                    "tp %d %s rank %d: %llu of %d decode steps replayed from graphs", tp, bn, r,
                    (unsigned long long)ri.graph_replays, n_steps());
    else
      ck_assert_msg(ri.graph_replays == 0, "tp %d %s rank %d: %llu graph replays with graphs off", tp, bn, r,
                    (unsigned long long)ri.graph_replays);
  }
  free(cap);
  free(lg);
  m3_tp_close(g);
}

START_TEST(tp_matches_single_gpu) {
  static const int tps[3] = {1, 2, 4};
  tp_run(tps[_i], M3_TP_LOCAL, 1);
}
END_TEST

/* The free prompt through 2 local ranks: the free run's checks, which the
 * NCCL case makes with graphs on, here with the local backend's graphs off
 * (it runs on one GPU and on the emulator). */
START_TEST(tp_free_local) { tp_run(2, M3_TP_LOCAL, 0); }
END_TEST

/* NCCL: one GPU a rank.  SKIPPED (printed, passing) without the GPUs or the
 * library: check has no per-test skip, and the program must still pass on
 * one GPU and on the emulator. */
START_TEST(tp_nccl) {
  const int tp = _i == 0 ? 2 : 4, have = m3_gpu_count();
  if (have < tp) {
    printf("nccl tp %d: SKIPPED (%d GPU%s: NCCL puts each rank on its own GPU)\n", tp, have, have == 1 ? "" : "s");
    return;
  }
  m3_tp_comm c;
  m3_err e = {0};
  if (m3_tp_comm_load(&c, &e) != M3_OK) {
    printf("nccl tp %d: SKIPPED (libnccl cannot be loaded: %s)\n", tp, e.msg);
    return;
  }
  printf("nccl tp %d: NCCL %d (%s) over %d of %d GPUs\n", tp, c.version, c.lib, tp, have);
  tp_run(tp, M3_TP_NCCL, 1); /* the local cases' run and checks */
  tp_run(tp, M3_TP_NCCL, 0); /* decode graphs on */
}
END_TEST

/* m3_tp_fill_synthetic: 2 ranks, 2 sequences of SYN tokens each, then decode
 * steps of both together with timing on (`m3kit run --tp 2 --synthetic-cache
 * --timing --batch 2`). */
START_TEST(tp_synthetic_cache) {
  enum { SYN = 40, STEPS = 3 };
  const int V = cfg.vocab_size, L = cfg.num_hidden_layers;
  m3_err e = {0};
  m3_tp_opts o = {.tp = 2, .backend = M3_TP_LOCAL, .model = {.dir = ck.dir},
                  .kv = {.max_seqs = 2, .max_ctx = SYN + STEPS + 1}, .fwd = m3_fwd_defaults()};
  o.fwd.max_chunk = CHUNK;
  o.fwd.max_batch = 2;
  o.fwd.timing = 1;
  m3_tp_group *g;
  ck_assert_msg(m3_tp_open(&o, &g, &e) == M3_OK, "%s", e.msg);
  int seqs[2];
  for (int b = 0; b < 2; b++) ck_assert_msg(m3_tp_admit(g, SYN + STEPS, &seqs[b], &e) == M3_OK, "%s", e.msg);
  /* refusals on the host: no rank appends */
  ck_assert_int_eq(m3_tp_fill_synthetic(g, seqs, 2, SYN + STEPS + 1, 1, &e), M3_CAPACITY);
  const int notadm[2] = {seqs[0], 5}, twice[2] = {seqs[0], seqs[0]};
  ck_assert_int_eq(m3_tp_fill_synthetic(g, notadm, 2, 1, 1, &e), M3_INVAL);
  ck_assert_int_eq(m3_tp_fill_synthetic(g, twice, 2, 1, 1, &e), M3_INVAL);
  ck_assert_int_eq(m3_tp_fill_synthetic(g, seqs, 2, 0, 1, &e), M3_INVAL);
  ck_assert_msg(m3_tp_fill_synthetic(g, seqs, 2, SYN, g_seed, &e) == M3_OK, "%s", e.msg);
  /* exactly SYN + STEPS fit: had a refused call appended, a step would not */
  float *lg = malloc(sizeof(float) * 2 * V);
  ck_assert_ptr_nonnull(lg);
  int32_t ids[2] = {3, 3}, next[2];
  for (int step = 0; step < STEPS; step++) {
    ck_assert_msg(m3_tp_decode(g, 2, seqs, ids, NULL, next, lg, &e) == M3_OK, "step %d: %s", step, e.msg);
    int finite = 1;
    for (int i = 0; i < 2 * V; i++) finite &= isfinite(lg[i]) != 0;
    ck_assert_msg(finite, "step %d: non-finite logits", step);
    /* the same input token over two different synthetic histories */
    ck_assert_msg(memcmp(lg, lg + V, sizeof(float) * V) != 0, "step %d: both sequences' logits are equal: the "
                  "synthetic cache is not read", step);
    printf("synthetic cache tp 2, step %d: tokens %d %d, rel difference of the two rows %.3g\n", step, next[0],
           next[1], fwd_rel_l2(lg, lg + V, (size_t)V));
    ids[0] = next[0], ids[1] = next[1];
    /* the table read, then reset, restarts from zero: it then holds STEPS -
     * 1 steps (a reset once kept every row's calls and ms, so the decode
     * table `run --timing` prints after the prefill's counted the prefill) */
    if (step == 0) {
      m3_fwd_op_time t0[64];
      int n0[2];
      ck_assert_msg(m3_tp_timing(g, t0, 32, n0, &e) == M3_OK, "%s", e.msg);
      ck_assert_int_gt(n0[0], 0);
      m3_tp_reset_timing(g);
    }
  }
  int32_t over[2] = {1, 1};
  ck_assert_int_eq(m3_tp_decode(g, 2, seqs, over, NULL, NULL, NULL, &e), M3_CAPACITY);
  /* every rank's table: 2 all-reduces a layer and one all-gather a step */
  m3_fwd_op_time t[2][64];
  int n[2];
  ck_assert_msg(m3_tp_timing(g, &t[0][0], 64, n, &e) == M3_OK, "%s", e.msg);
  for (int r = 0; r < 2; r++) {
    int ar = -1, ag = -1, qkv = -1;
    for (int i = 0; i < n[r]; i++) {
      if (!strcmp(t[r][i].name, "allreduce")) ar = t[r][i].calls;
      if (!strcmp(t[r][i].name, "allgather")) ag = t[r][i].calls;
      if (!strcmp(t[r][i].name, "qkv_proj")) qkv = t[r][i].calls;
    }
    printf("rank %d: %d timed ops; allreduce %d calls, allgather %d, qkv_proj %d\n", r, n[r], ar, ag, qkv);
    ck_assert_int_eq(ar, 2 * L * (STEPS - 1));
    ck_assert_int_eq(ag, STEPS - 1);
    ck_assert_int_eq(qkv, L * (STEPS - 1));
  }
  m3_tp_reset_timing(g);
  ck_assert_msg(m3_tp_timing(g, &t[0][0], 64, n, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(n[0] + n[1], 0);
  free(lg);
  m3_tp_close(g);
}
END_TEST

/* ---- sliced weights ----------------------------------------------------- */

static void *download(const void *d, size_t bytes) {
  void *h = malloc(bytes ? bytes : 1);
  ck_assert_ptr_nonnull(h);
  ck_assert_int_eq(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

/* part == rows ranges (r0[i], rn[i]) of columns [c0, c0 + cn) of whole, for
 * every stacked element; values and (MXFP8) scales. */
static void expect_cut(const m3_dlinear *whole, const m3_dlinear *part, int n, const int64_t *r0, const int64_t *rn,
                       int64_t c0, int64_t cn, const char *what) {
  int64_t rows = 0;
  for (int i = 0; i < n; i++) rows += rn[i];
  ck_assert_msg(part->rows == rows && part->cols == cn && part->n_stack == whole->n_stack &&
                    part->mxfp8 == whole->mxfp8,
                "%s: the rank holds [%lld, %lld] x %d, expected [%lld, %lld] x %d", what, (long long)part->rows,
                (long long)part->cols, part->n_stack, (long long)rows, (long long)cn, whole->n_stack);
  const size_t el = whole->mxfp8 ? 1 : 2;
  const size_t wb = m3_dlinear_bytes(whole), pb = m3_dlinear_bytes(part);
  const size_t ws = m3_dlinear_scale_bytes(whole), ps = m3_dlinear_scale_bytes(part);
  unsigned char *W = download(whole->w, wb * whole->n_stack), *P = download(part->w, pb * part->n_stack);
  unsigned char *WS = whole->mxfp8 ? download(whole->scale, ws * whole->n_stack) : NULL;
  unsigned char *PS = whole->mxfp8 ? download(part->scale, ps * part->n_stack) : NULL;
  for (int x = 0; x < whole->n_stack; x++) {
    int64_t pr = 0;
    for (int i = 0; i < n; i++)
      for (int64_t j = 0; j < rn[i]; j++, pr++) {
        const int64_t wr = r0[i] + j;
        ck_assert_msg(!memcmp(P + x * pb + (size_t)(pr * cn) * el, W + x * wb + (size_t)(wr * whole->cols + c0) * el,
                              (size_t)cn * el),
                      "%s: expert %d, rank row %lld != whole row %lld, columns [%lld, %lld)", what, x, (long long)pr,
                      (long long)wr, (long long)c0, (long long)(c0 + cn));
        if (WS)
          ck_assert_msg(!memcmp(PS + x * ps + pr * (cn / 32), WS + x * ws + wr * (whole->cols / 32) + c0 / 32,
                                (size_t)(cn / 32)),
                        "%s: expert %d, rank row %lld: E8M0 scales differ from whole row %lld", what, x, (long long)pr,
                        (long long)wr);
      }
  }
  free(W), free(P), free(WS), free(PS);
}

static void expect_same(const void *a, const void *b, size_t bytes, const char *what) {
  void *x = download(a, bytes), *y = download(b, bytes);
  ck_assert_msg(!memcmp(x, y, bytes), "%s: the rank's replicated copy differs", what);
  free(x), free(y);
}

/* Rank r of tp of model w (whole), stated from the plan's numbers and the
 * spec's layout, independently of model.c's cut. */
static void check_rank(const m3_model *w, const m3_model *k, int tp, int r) {
  const m3_config *c = &w->cfg;
  m3_tp_rank p;
  m3_err e = {0};
  ck_assert_msg(m3_tp_plan(c, tp, r, &p, &e) == M3_OK, "%s", e.msg);
  ck_assert_int_eq(k->tp, tp);
  ck_assert_int_eq(k->rank, r);
  ck_assert_int_eq(k->cfg.num_attention_heads, c->num_attention_heads / tp);
  ck_assert_int_eq(k->cfg.num_key_value_heads, p.n_kv_heads);
  const int64_t H = c->hidden_size, hd = c->head_dim, ID = c->sparse_index_dim, nq = c->num_attention_heads,
                nkv = c->num_key_value_heads, F = c->dense_intermediate_size, I = c->intermediate_size,
                S = m3_config_shared_width(c);
  char what[96];
  for (int l = 0; l < c->num_hidden_layers; l++) {
    const m3_dlayer *A = &w->layers[l], *B = &k->layers[l];
    /* §3.2: q [0, nq hd), k [nq hd, (nq+nkv) hd), v, index_q (per KV head), index_k */
    const int64_t r0[5] = {p.q_head0 * hd, nq * hd + p.kv_head0 * hd, (nq + nkv) * hd + p.kv_head0 * hd,
                           (nq + 2 * nkv) * hd + p.kv_head0 * ID, (nq + 2 * nkv) * hd + nkv * ID};
    const int64_t rn[5] = {p.n_q_heads * hd, p.n_kv_heads * hd, p.n_kv_heads * hd, p.n_kv_heads * ID, ID};
    snprintf(what, sizeof what, "tp %d rank %d layer %d qkv", tp, r, l);
    expect_cut(&A->qkv, &B->qkv, A->sparse ? 5 : 3, r0, rn, 0, H, what);
    const int64_t all0[1] = {0}, allH[1] = {H};
    snprintf(what, sizeof what, "tp %d rank %d layer %d o_proj", tp, r, l);
    expect_cut(&A->o, &B->o, 1, all0, allH, p.q_head0 * hd, p.n_q_heads * hd, what);
    expect_same(A->input_norm, B->input_norm, (size_t)H * 2, "input norm");
    expect_same(A->q_norm, B->q_norm, (size_t)hd * 2, "q norm");
    if (A->sparse) expect_same(A->ik_norm, B->ik_norm, (size_t)ID * 2, "index_k norm");
    if (!A->moe) {
      const int64_t g0[2] = {p.dense_i0, F + p.dense_i0}, gn[2] = {p.dense_n, p.dense_n};
      snprintf(what, sizeof what, "tp %d rank %d layer %d mlp gate/up", tp, r, l);
      expect_cut(&A->mlp_gu, &B->mlp_gu, 2, g0, gn, 0, H, what);
      snprintf(what, sizeof what, "tp %d rank %d layer %d mlp down", tp, r, l);
      expect_cut(&A->mlp_down, &B->mlp_down, 1, all0, allH, p.dense_i0, p.dense_n, what);
      continue;
    }
    const int64_t e0[2] = {p.moe_i0, I + p.moe_i0}, en[2] = {p.moe_n, p.moe_n};
    snprintf(what, sizeof what, "tp %d rank %d layer %d experts w1/w3", tp, r, l);
    expect_cut(&A->w13, &B->w13, 2, e0, en, 0, H, what);
    snprintf(what, sizeof what, "tp %d rank %d layer %d experts w2", tp, r, l);
    expect_cut(&A->w2, &B->w2, 1, all0, allH, p.moe_i0, p.moe_n, what);
    const int64_t s0[2] = {p.shared_i0, S + p.shared_i0}, sn[2] = {p.shared_n, p.shared_n};
    snprintf(what, sizeof what, "tp %d rank %d layer %d shared gate/up", tp, r, l);
    expect_cut(&A->sh_gu, &B->sh_gu, 2, s0, sn, 0, H, what);
    snprintf(what, sizeof what, "tp %d rank %d layer %d shared down", tp, r, l);
    expect_cut(&A->sh_down, &B->sh_down, 1, all0, allH, p.shared_i0, p.shared_n, what);
    expect_same(A->router, B->router, (size_t)c->num_local_experts * H * 4, "router");
    expect_same(A->bias, B->bias, (size_t)c->num_local_experts * 4, "routing bias");
  }
  expect_same(w->embed, k->embed, (size_t)c->vocab_size * H * 2, "embedding");
  ck_assert_int_eq(k->vocab0, p.vocab0);
  ck_assert_int_eq(k->vocab_n, p.vocab_n);
  expect_same(w->lm_head + (size_t)p.vocab0 * H, k->lm_head, (size_t)p.vocab_n * H * 2, "lm_head rows");
  /* Peak: the rank's weights plus one whole tensor (here the embedding-sized
   * lm_head is the largest). */
  ck_assert_msg(k->peak_bytes <= k->weight_bytes + (size_t)c->vocab_size * H * 2,
                "tp %d rank %d: peak %zu bytes while loading > %zu held + one whole [V, H] tensor", tp, r, k->peak_bytes,
                k->weight_bytes);
  ck_assert_msg(k->weight_bytes < w->weight_bytes, "tp %d rank %d holds %zu bytes, the whole model %zu", tp, r,
                k->weight_bytes, w->weight_bytes);
  printf("tp %d rank %d: %zu of the whole model's %zu weight bytes, peak %zu while loading\n", tp, r, k->weight_bytes,
         w->weight_bytes, k->peak_bytes);
}

static void check_source(const m3_model_opts *base, const int (*pairs)[2], int n_pairs) {
  m3_err e = {0};
  m3_model *w;
  ck_assert_msg(m3_model_load(&g_rt, base, &w, &e) == M3_OK, "%s", e.msg);
  for (int i = 0; i < n_pairs; i++) {
    m3_model_opts o = *base;
    o.tp = pairs[i][0];
    o.rank = pairs[i][1];
    m3_model *k;
    ck_assert_msg(m3_model_load(&g_rt, &o, &k, &e) == M3_OK, "tp %d rank %d: %s", o.tp, o.rank, e.msg);
    check_rank(w, k, o.tp, o.rank);
    m3_model_free(k);
  }
  m3_model_free(w);
}

START_TEST(sliced_weights) {
  static const int pairs[3][2] = {{2, 1}, {4, 2}, {4, 3}};
  m3_err e = {0};
  /* bf16 checkpoint (the forward cases' own) */
  m3_model_opts bo = {.dir = ck.dir};
  check_source(&bo, pairs, 3);
  /* MXFP8 checkpoint: values and E8M0 scale columns (/32) */
  fwd_ckpt c8;
  ck_assert_msg(fwd_ckpt_make(&cfg, 1, g_seed ^ 0x8ull, &c8, &e) == M3_OK, "%s", e.msg);
  m3_model_opts mo = {.dir = c8.dir};
  check_source(&mo, pairs, 3);
  fwd_ckpt_close(&c8);
  /* synthetic MXFP8, 2 KV heads over 4 ranks: each KV head (and its index_q
   * head) on 2 ranks */
  m3_config c2;
  ck_assert_msg(tp_config(&c2, 2, &e) == M3_OK, "%s", e.msg);
  m3_model_opts so = {.config = &c2, .mxfp8 = 1, .seed = 5};
  check_source(&so, pairs, 3);
}
END_TEST

START_TEST(refusals) {
  m3_err e = {0};
  m3_model *k;
  /* 8 q heads do not split over 3 ranks: named before any tensor is read */
  m3_model_opts o = {.dir = ck.dir, .tp = 3, .rank = 0};
  ck_assert_int_eq(m3_model_load(&g_rt, &o, &k, &e), M3_INVAL);
  ck_assert_msg(strstr(e.msg, "num_attention_heads"), "%s", e.msg);
  o.tp = 2, o.rank = 2;
  ck_assert_int_eq(m3_model_load(&g_rt, &o, &k, &e), M3_INVAL);
  /* the tiny preset's intermediate_size 64 is not a multiple of 32 x 4 */
  m3_model_opts t = {.preset = "tiny", .tp = 4, .rank = 1};
  ck_assert_int_eq(m3_model_load(&g_rt, &t, &k, &e), M3_INVAL);
  ck_assert_msg(strstr(e.msg, "intermediate_size"), "%s", e.msg);
  /* a rank's model without a link (or a link that does not match) */
  m3_model_opts r1 = {.dir = ck.dir, .tp = 2, .rank = 1};
  ck_assert_msg(m3_model_load(&g_rt, &r1, &k, &e) == M3_OK, "%s", e.msg);
  m3_kv_cache kv;
  m3_kv_opts ko = {.max_seqs = 1, .max_ctx = 32};
  ck_assert_msg(m3_kv_init(&kv, &k->cfg, &ko, &e) == M3_OK, "%s", e.msg);
  m3_fwd_opts fo = m3_fwd_defaults();
  m3_forward *f;
  ck_assert_int_eq(m3_forward_create(&g_rt, k, &kv, &fo, &f, &e), M3_INVAL);
  ck_assert_msg(strstr(e.msg, "rank 1 of 2"), "%s", e.msg);
  m3_kv_free(&kv);
  m3_model_free(k);
  /* the driver: a group the config cannot cut fails to open, naming the field */
  m3_tp_opts to = {.tp = 3, .backend = M3_TP_LOCAL, .model = {.dir = ck.dir}, .kv = {.max_seqs = 1, .max_ctx = 32},
                   .fwd = m3_fwd_defaults()};
  m3_tp_group *g;
  ck_assert_int_ne(m3_tp_open(&to, &g, &e), M3_OK);
  ck_assert_msg(strstr(e.msg, "num_attention_heads"), "%s", e.msg);
  to.tp = 9;
  ck_assert_int_eq(m3_tp_open(&to, &g, &e), M3_INVAL);
}
END_TEST

/* A rank that fails mid-step must not leave the others waiting: a NaN in
 * layer 0's o_proj at a column only rank `bad` of 2 holds, with the numerics
 * check on, makes that rank fail at its o_proj output while the other
 * (finite partial sum) waits in the all-reduce or arrives there after the
 * abort - which one depends on the order the threads run in, so both ranks
 * take the bad role in turn and both paths run; the call returns the bad
 * rank's error (the root cause, not the other's "gave up"), and since every
 * rank failed the step the group stays usable: the next call fails the same
 * way, and does not hang or report a broken group. */
START_TEST(rank_failure_wakes_the_others) {
  m3_err e = {0};
  fwd_ckpt cf;
  ck_assert_msg(fwd_ckpt_make(&cfg, 0, g_seed ^ 0xbadull, &cf, &e) == M3_OK, "%s", e.msg);
  const m3_weight *w = m3_ckpt_get(cf.k, 0, M3_ROLE_O_PROJ, -1);
  ck_assert(w && w->w && w->w->dtype == M3_DT_BF16);
  const int bad = _i;
  const int64_t col = (int64_t)bad * (cfg.num_attention_heads / 2) * cfg.head_dim; /* its first q column */
  const uint16_t nan = 0x7fc0;
  FILE *fp = fopen(w->w->file, "r+b");
  ck_assert_ptr_nonnull(fp);
  ck_assert_int_eq(fseek(fp, (long)(w->w->file_offset + (uint64_t)col * 2), SEEK_SET), 0);
  ck_assert_int_eq(fwrite(&nan, 2, 1, fp), 1);
  ck_assert_int_eq(fclose(fp), 0);
  m3_tp_opts o = {.tp = 2, .backend = M3_TP_LOCAL, .model = {.dir = cf.dir}, .kv = {.max_seqs = 1, .max_ctx = 32},
                  .fwd = m3_fwd_defaults()};
  o.fwd.max_chunk = 16;
  o.fwd.check_numerics = 1;
  m3_tp_group *g;
  ck_assert_msg(m3_tp_open(&o, &g, &e) == M3_OK, "%s", e.msg);
  int seq;
  ck_assert_msg(m3_tp_admit(g, 20, &seq, &e) == M3_OK, "%s", e.msg);
  for (int attempt = 0; attempt < 2; attempt++) {
    m3_status s = m3_tp_prefill(g, seq, 8, prompt, NULL, NULL, NULL, &e);
    printf("attempt %d: %s: %s\n", attempt, m3_status_name(s), e.msg);
    ck_assert_int_eq(s, M3_NUMERICS);
    char want[16];
    snprintf(want, sizeof want, "rank %d: ", bad);
    ck_assert_msg(strstr(e.msg, want) == e.msg && strstr(e.msg, "o_proj"), "not rank %d's own error: %s", bad, e.msg);
  }
  m3_tp_close(g);
  fwd_ckpt_close(&cf);
}
END_TEST

static Suite *make(void) {
  Suite *s = suite_create("tp_forward_gpu");
  gpu_add_case(s, "sliced_weights", setup, sliced_weights, 0);
  gpu_add_case(s, "refusals", setup, refusals, 0);
  gpu_add_case(s, "rank_failure", setup, rank_failure_wakes_the_others, 2);
  gpu_add_case(s, "forward", setup, tp_matches_single_gpu, 3);
  gpu_add_case(s, "free_local", setup, tp_free_local, 0);
  gpu_add_case(s, "synthetic_cache", setup, tp_synthetic_cache, 0);
  gpu_add_case(s, "nccl", setup, tp_nccl, 2);
  return s;
}

int main(void) { return gpu_test_main("check_tp_forward_gpu", make); }
