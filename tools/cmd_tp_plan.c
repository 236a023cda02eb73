/* cmd_tp_plan.c - `m3kit tp-plan`: how a model is cut across N GPUs of a
 * tensor-parallel group (runtime/tp_plan.h), what each rank stores, and the
 * largest context per rank's memory.  No GPU needed: it plans. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "runtime/config.h"
#include "runtime/tp_comm.h"
#include "runtime/tp_plan.h"
#include "tools/cli.h"

static void help(void) {
  printf("usage: m3kit tp-plan [--preset NAME | --model DIR] [--tp N] [--weights bf16|mxfp8] [--gpu-gb G]\n"
         "                     [--resident-experts R] [--tsv]\n\n"
         "Prints the tensor-parallel cut of the model over N ranks: each rank's query heads, KV heads\n"
         "(replicated when N exceeds them), intermediate slices of the dense MLP, of every routed expert and\n"
         "of the shared expert, lm_head rows, its weight bytes, its KV + index-K cache bytes per token (bf16\n"
         "and e4m3 caches) and the context that fits G GB per GPU after its weights and 4 GB of workspace\n"
         "(at most max_position_embeddings: such rows say so; 'no fit' where the weights and workspace alone\n"
         "exceed G).\n"
         "  --preset NAME   minimax-m3 (default), tiny;  --model DIR reads DIR/config.json\n"
         "  --tp N          ranks (1..64; default: the plans for 1, 2, 4 and 8)\n"
         "  --weights W     storage of the linear weights (default as m3kit run: MXFP8 for models with\n"
         "                  hidden_size >= 4096, else bf16; with --model, the config's quantization_config)\n"
         "  --gpu-gb G      memory per GPU in 1e9 bytes (default 141)\n"
         "  --resident-experts R  weights of a synthetic model with R routed experts a MoE layer resident\n"
         "                  (m3kit run --resident-experts R; default: all)\n"
         "  --tsv           for scripts (bench/tp_tpot.sh): one line a rank, tab-separated, after a '#' header:\n"
         "                  tp rank weight_bytes (at R) expert_bytes (one expert's slice, every MoE layer)\n"
         "                  experts (E) kv_bf16 kv_e4m3 (cache bytes a token) max_position\n"
         "It also says whether NCCL (runtime/tp_comm.h) loads here.  To run the cut:\n"
         "m3kit run --tp N (NCCL, one GPU a rank), or m3kit run --tp N --tp-backend local (the ranks share\n"
         "the GPUs there are: checks the path on one GPU).\n");
}

/* A rank's weights with `resident` routed experts a MoE layer (0: all). */
static uint64_t weights_at(const m3_config *c, const m3_tp_rank *p, int resident) {
  const int E = c->num_local_experts;
  return resident > 0 && resident < E ? p->weight_bytes - (uint64_t)(E - resident) * p->expert_bytes
                                      : p->weight_bytes;
}

static void print_tsv(const m3_config *c, int tp, int resident) {
  m3_err e;
  const uint64_t kv16 = m3_tp_kv_bytes_per_token(c, tp, 2, 2), kv8 = m3_tp_kv_bytes_per_token(c, tp, 1, 1);
  for (int r = 0; r < tp; r++) {
    m3_tp_rank p;
    if (m3_tp_plan(c, tp, r, &p, &e) != M3_OK) {
      printf("# tp %d: %s\n", tp, e.msg);
      return;
    }
    printf("%d\t%d\t%llu\t%llu\t%d\t%llu\t%llu\t%d\n", tp, r, (unsigned long long)weights_at(c, &p, resident),
           (unsigned long long)p.expert_bytes, c->num_local_experts, (unsigned long long)kv16,
           (unsigned long long)kv8, c->max_position_embeddings);
  }
}

static void print_plan(const m3_config *c, int tp, double gpu_gb, int resident) {
  m3_err e;
  m3_tp_rank r0;
  if (m3_tp_plan(c, tp, 0, &r0, &e) != M3_OK) {
    printf("tp %d: %s\n", tp, e.msg);
    return;
  }
  const uint64_t kv16 = m3_tp_kv_bytes_per_token(c, tp, 2, 2), kv8 = m3_tp_kv_bytes_per_token(c, tp, 1, 1);
  printf("tp %d: %d all-reduces a layer; KV + index-K per token and rank %llu B (bf16), %llu B (e4m3)\n", tp,
         r0.allreduce_per_layer, (unsigned long long)kv16, (unsigned long long)kv8);
  printf("  %-4s %-9s %-11s %-13s %-13s %-13s %-17s %9s %13s %13s\n", "rank", "q heads", "kv heads", "dense MLP",
         "expert rows", "shared rows", "lm_head rows", "weights", "ctx bf16", "ctx e4m3");
  for (int r = 0; r < tp; r++) {
    m3_tp_rank p;
    if (m3_tp_plan(c, tp, r, &p, &e) != M3_OK) return;
    char q[24], kv[24], d[24], x[24], s[24], v[32];
    snprintf(q, sizeof q, "%d-%d", p.q_head0, p.q_head0 + p.n_q_heads - 1);
    snprintf(kv, sizeof kv, "%d-%d%s", p.kv_head0, p.kv_head0 + p.n_kv_heads - 1, p.kv_replicas > 1 ? " (rep)" : "");
    snprintf(d, sizeof d, "%d+%d", p.dense_i0, p.dense_n);
    snprintf(x, sizeof x, "%d+%d", p.moe_i0, p.moe_n);
    snprintf(s, sizeof s, "%d+%d", p.shared_i0, p.shared_n);
    snprintf(v, sizeof v, "%d+%d", p.vocab0, p.vocab_n);
    const double w = (double)weights_at(c, &p, resident);
    const double free_b = gpu_gb * 1e9 - w - 4e9, mp = c->max_position_embeddings;
    double c16 = free_b > 0 ? free_b / (double)kv16 : 0, c8 = free_b > 0 ? free_b / (double)kv8 : 0;
    char t16[24], t8[24];
    snprintf(t16, sizeof t16, c16 >= mp ? "%.0f (max)" : "%.0f", c16 >= mp ? mp : c16);
    snprintf(t8, sizeof t8, c8 >= mp ? "%.0f (max)" : "%.0f", c8 >= mp ? mp : c8);
    /* not one token's cache beside the weights and workspace: no fit, not a context of 0 */
    if (c16 < 1) snprintf(t16, sizeof t16, "no fit");
    if (c8 < 1) snprintf(t8, sizeof t8, "no fit");
    printf("  %-4d %-9s %-11s %-13s %-13s %-13s %-17s %7.1f GB %13s %13s\n", r, q, kv, d, x, s, v, w / 1e9, t16,
           t8);
  }
}

int cmd_tp_plan(int argc, char **argv) {
  static struct option opts[] = {{"preset", required_argument, 0, 'p'}, {"model", required_argument, 0, 'm'},
                                 {"tp", required_argument, 0, 't'},     {"weights", required_argument, 0, 'w'},
                                 {"gpu-gb", required_argument, 0, 'g'}, {"help", no_argument, 0, 'h'},
                                 {"resident-experts", required_argument, 0, 'r'}, {"tsv", no_argument, 0, 'T'},
                                 {0, 0, 0, 0}};
  const char *preset = NULL, *model = NULL, *weights = NULL;
  int tp = 0, c, resident = 0, tsv = 0;
  double gpu_gb = 141.0;
  int64_t iv;
  optind = 1;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 'p': preset = optarg; break;
      case 'm':
        if (cli_path("tp-plan", "model", optarg)) return 2;
        model = optarg;
        break;
      case 't': if (cli_int("tp-plan", "tp", optarg, 1, M3_TP_MAX, &iv)) return 2; tp = (int)iv; break;
      case 'w':
        if (strcmp(optarg, "bf16") && strcmp(optarg, "mxfp8")) {
          fprintf(stderr, "m3kit tp-plan: --weights takes bf16 or mxfp8\n");
          return 2;
        }
        weights = optarg;
        break;
      case 'g': if (cli_float("tp-plan", "gpu-gb", optarg, 1, 1e6, &gpu_gb)) return 2; break;
      case 'r': if (cli_int("tp-plan", "resident-experts", optarg, 1, 1 << 16, &iv)) return 2; resident = (int)iv; break;
      case 'T': tsv = 1; break;
      case 'h': help(); return 0;
      default: help(); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "m3kit tp-plan: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (model && preset) {
    fprintf(stderr, "m3kit tp-plan: give --model or --preset, not both\n");
    return 2;
  }
  m3_config cfg;
  m3_err e;
  m3_status s = m3_config_for(preset ? preset : "minimax-m3", model, &cfg, &e);
  if (s != M3_OK) return cli_fail("tp-plan", s, &e);
  if (!weights && !model) weights = cfg.hidden_size >= 4096 ? "mxfp8" : "bf16"; /* m3kit run's rule (model.c) */
  if (tp) {
    m3_tp_rank r0;
    if ((s = m3_tp_plan(&cfg, tp, 0, &r0, &e)) != M3_OK) return cli_fail("tp-plan", s, &e);
  }
  if (resident && (resident > cfg.num_local_experts || resident < cfg.num_experts_per_tok)) {
    fprintf(stderr, "m3kit tp-plan: --resident-experts %d: must be in [num_experts_per_tok %d, num_local_experts %d] "
                    "(a token routes to top-k resident experts)\n", resident, cfg.num_experts_per_tok,
            cfg.num_local_experts);
    return 2;
  }
  if (weights) snprintf(cfg.quant_method, sizeof cfg.quant_method, "%s", strcmp(weights, "mxfp8") ? "" : "mxfp8");
  if (tsv) { /* no NCCL probe, no prose: bench/tp_tpot.sh reads it */
    printf("# tp\trank\tweight_bytes\texpert_bytes\texperts\tkv_bf16\tkv_e4m3\tmax_position\n");
    if (tp) print_tsv(&cfg, tp, resident);
    else
      for (int t = 1; t <= 8; t *= 2) print_tsv(&cfg, t, resident);
    return 0;
  }
  char res[64] = "";
  if (resident) snprintf(res, sizeof res, ", %d of %d routed experts resident", resident, cfg.num_local_experts);
  printf("%s, %s linear weights%s, %g GB per GPU\n", model ? model : preset ? preset : "minimax-m3",
         cfg.quant_method[0] ? "MXFP8" : "bf16", res, gpu_gb);
  m3_tp_comm comm;
  m3_err ce;
  if (m3_tp_comm_load(&comm, &ce) == M3_OK)
    printf("NCCL %d.%d.%d (%s): loaded\n", comm.version / 10000, comm.version / 100 % 100, comm.version % 100, comm.lib);
  else
    printf("NCCL: %s\n", ce.msg);
  if (tp) {
    print_plan(&cfg, tp, gpu_gb, resident);
  } else {
    for (int t = 1; t <= 8; t *= 2) print_plan(&cfg, t, gpu_gb, resident);
  }
  return 0;
}
