// `moec plan` and `moec sweep`: the scheduling model of DESIGN §6 from the command line.
//
//   moec plan F.moe [--cluster C] [--policy NAME|all] [--heads N] [--degree RULE]
//                   [--svg out.svg] [--trace out.json] [--json out.json]
//   moec sweep --cluster C [--quick] [--degree RULE] [--seqlens A,B,C] [--dropless-capacity X]
//
// RULE picks fsmoe's pipeline degree: best (default: the fastest in simulation of the three
// answers below), slsqp (Algorithm 1 with SLSQP, the paper's method), model (the case model's
// integer optimum), simulator (the simulator's own best r).
//
// plan reads a model, turns every layer instance into a generalized layer (its attention, if
// any, then its MoE) as one rank sees it, plans it for each policy (sched/sched_solve.c) and
// simulates the stream programs (sched/sched_sim.c). sweep does the same for the paper's
// Table 4 space (1458 stacks of two identical generalized layers) and sets the average
// speedups over tutel beside the paper's Table 5. Both are called with main's argc/argv
// (argv[1] is the command) and return the exit status: 0 success, 1 the input has errors,
// 2 bad command line.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "frontend/fe.h"
#include "ir/ir.h"
#include "sched/sched.h"
#include "cli.h"

void cli_cluster_from_fe(const FeCluster *f, SchedCluster *c) {
  *c = (SchedCluster){.name = f->name, .nodes = (int)f->nodes, .gpus_per_node = (int)f->gpus_per_node,
                      .gemm = {f->gemm.alpha, f->gemm.beta}, .alltoall = {f->alltoall.alpha, f->alltoall.beta},
                      .allgather = {f->allgather.alpha, f->allgather.beta},
                      .reducescatter = {f->reducescatter.alpha, f->reducescatter.beta},
                      .allreduce = {f->allreduce.alpha, f->allreduce.beta}};
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Plans and simulates a stack under every policy.
static bool plan_all(const SchedStack *st, SchedPlan plans[IR_NPOLICIES]) {
  bool ok = true;
  for (int p = 0; p < IR_NPOLICIES; p++) ok &= sched_plan(st, (IrPolicy)p, &plans[p]);
  return ok;
}

static void free_all(SchedPlan plans[IR_NPOLICIES]) {
  for (int p = 0; p < IR_NPOLICIES; p++) sched_plan_free(&plans[p]);
}

static bool need_value(int i, int argc, char **argv) {
  if (i + 1 < argc) return true;
  fprintf(stderr, "moec: error: option '%s' needs a value\n", argv[i]);
  return false;
}

static bool parse_choose(const char *text, SchedChoose *out) {
  for (int i = 0; i < SCHED_NCHOOSE; i++)
    if (strcmp(text, sched_choose_name[i]) == 0) {
      *out = (SchedChoose)i;
      return true;
    }
  fprintf(stderr, "moec: error: --degree takes best, slsqp, model or simulator, not '%s'\n", text);
  return false;
}

static bool parse_positive(const char *opt, const char *text, double *out) {
  char *end;
  double v = strtod(text, &end);
  if (*text == '\0' || *end != '\0' || !(v > 0) || !isfinite(v)) {
    fprintf(stderr, "moec: error: %s takes a positive number, not '%s'\n", opt, text);
    return false;
  }
  *out = v;
  return true;
}

// ---- moec plan ----

typedef struct PlanLayer {
  char name[96];
  SchedLayerSpec spec;
  bool dropless;
  double k, capacity;   // gate's k and capacity factor (capacity: stand-in when dropless)
  int groups;
} PlanLayer;

// Tokens per expert of one routing group: T = ceil(k*f*S/E), S = B*L/mp/groups (DESIGN §2).
static int capacity_tokens(const SchedLayerSpec *s, double k, double capacity, int experts, int groups) {
  double group = s->batch * s->seqlen / s->mp / (groups > 0 ? groups : 1);
  double t = ceil(k * capacity * group / (experts > 0 ? experts : 1));
  return t < 1 ? 1 : t > 1e9 ? 1000000000 : (int)t;
}

static int r_max_of(const SchedLayerSpec *s, double k, double capacity, int experts, int groups) {
  int t = capacity_tokens(s, k, capacity, experts, groups);
  return t < SCHED_R_MAX ? t : SCHED_R_MAX;
}

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; s && *s; s++) {
    if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
    else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", (unsigned char)*s);
    else fputc(*s, f);
  }
  fputc('"', f);
}

// A finite number for JSON (NaN and infinities are not JSON).
static double jnum(double v) { return isfinite(v) ? v : -1; }

typedef struct Bucket {
  double capacity;
  int r_fwd, r_bwd;
} Bucket;

static const double bucket_capacity[] = {1.0, 1.25, 1.5, 2.0, 3.0, 4.0};
enum { NBUCKETS = sizeof bucket_capacity / sizeof bucket_capacity[0] };

// fsmoe's degrees for a dropless layer at each capacity bucket (the plan's gradient load kept).
static void dropless_buckets(const PlanLayer *pl, const SchedCluster *c, const SchedLayerPlan *lp, SchedChoose choose,
                             Bucket out[NBUCKETS]) {
  for (int b = 0; b < NBUCKETS; b++) {
    SchedLayerSpec s = pl->spec;
    s.f = pl->k * bucket_capacity[b];
    s.r_max = r_max_of(&s, pl->k, bucket_capacity[b], s.experts, pl->groups);
    SchedLayerCost cost;
    sched_layer_cost(&s, c, &cost);
    SchedLayerPlan bp = {0};
    sched_fsmoe_degree(&cost, s.r_max, SCHED_FWD, 0, choose, &bp);
    sched_fsmoe_degree(&cost, s.r_max, SCHED_BWD, lp->grad_moe, choose, &bp);
    out[b] = (Bucket){bucket_capacity[b], bp.r[SCHED_FWD], bp.r[SCHED_BWD]};
  }
}

static bool write_json(const char *path, const char *model, const char *cluster_path, const SchedCluster *c,
                       const FeParallel *par, const PlanLayer *layers, const SchedStack *st,
                       const SchedPlan plans[IR_NPOLICIES], double lb, SchedResource busiest,
                       const double lb_total[SCHED_NRES]) {
  FILE *f = fopen(path, "w");
  if (!f) return false;
  const SchedPlan *tutel = &plans[IR_POLICY_TUTEL], *seq = &plans[IR_POLICY_SEQUENTIAL];
  fprintf(f, "{\n  \"format\": \"moec-plan-1\",\n  \"model\": ");
  json_str(f, model);
  fprintf(f, ",\n  \"cluster\": {\"name\": ");
  json_str(f, c->name);
  fprintf(f, ", \"path\": ");
  json_str(f, cluster_path);
  fprintf(f, ", \"nodes\": %d, \"gpus_per_node\": %d},\n", c->nodes, c->gpus_per_node);
  fprintf(f, "  \"parallel\": {\"dp\": %lld, \"mp\": %lld, \"ep\": %lld, \"esp\": %lld},\n", (long long)par->dp,
          (long long)par->mp, (long long)par->ep, (long long)par->esp);
  fprintf(f, "  \"units\": {\"time\": \"ms\", \"gradient\": \"elements (fp32, %g bytes each)\"},\n", SCHED_GRAD_BYTES);
  fprintf(f, "  \"lower_bound_ms\": %.9g, \"busiest_resource\": \"%s\",\n", lb, sched_resource_name[busiest]);
  fprintf(f, "  \"resource_totals_ms\": {\"compute\": %.9g, \"intra\": %.9g, \"inter\": %.9g},\n",
          lb_total[SCHED_RES_COMPUTE], lb_total[SCHED_RES_INTRA], lb_total[SCHED_RES_INTER]);
  fprintf(f, "  \"layers\": [");
  for (int i = 0; i < st->n; i++) {
    const SchedLayerCost *cost = &st->cost[i];
    fprintf(f, "%s\n    {\"index\": %d, \"name\": ", i ? "," : "", i);
    json_str(f, layers[i].name);
    fprintf(f, ", \"f\": %.9g, \"dropless\": %s, \"r_max\": %d, \"dense_gradient_elements\": %.0f,",
            layers[i].spec.f, layers[i].dropless ? "true" : "false", st->r_max[i], cost->n_grad);
    fprintf(f, " \"t_attention_ms\": [%.9g, %.9g]}", cost->phase[0].t_att, cost->phase[1].t_att);
  }
  fprintf(f, "\n  ],\n  \"policies\": [");
  for (int p = 0; p < IR_NPOLICIES; p++) {
    const SchedPlan *pl = &plans[p];
    fprintf(f, "%s\n    {\"name\": \"%s\", \"forward_ms\": %.9g, \"backward_ms\": %.9g, \"iteration_ms\": %.9g,",
            p ? "," : "", ir_policy_name[p], pl->t_fwd, pl->t_bwd, pl->t_iter);
    fprintf(f, " \"speedup_vs_tutel\": %.9g, \"speedup_vs_sequential\": %.9g, \"gap_to_lower_bound\": %.9g,",
            jnum(tutel->t_iter / pl->t_iter), jnum(seq->t_iter / pl->t_iter), jnum(pl->t_iter / lb - 1));
    fprintf(f, "\n     \"gradient_partition\": ");
    json_str(f, pl->partition);
    fprintf(f, ", \"tail_gradient_elements\": %.0f,\n     \"layers\": [", pl->grad_tail);
    for (int i = 0; i < st->n; i++) {
      const SchedLayerPlan *lp = &pl->layer[i];
      fprintf(f, "%s\n       {\"index\": %d", i ? "," : "", i);
      for (int ph = 0; ph < 2; ph++) {
        fprintf(f, ", \"%s\": {\"r\": %d, \"model_ms\": %.9g", ph ? "backward" : "forward", lp->r[ph],
                jnum(lp->t_model[ph]));
        if (p == IR_POLICY_FSMOE)
          fprintf(f,
                  ", \"chosen_by\": \"%s\", \"case\": %d, \"r_slsqp\": %d, \"r_exhaustive\": %d, \"r_simulator\": %d,"
                  " \"sim_ms_slsqp\": %.9g, \"sim_ms_exhaustive\": %.9g, \"sim_ms_simulator\": %.9g",
                  lp->chosen_by[ph], lp->kase[ph], lp->r_slsqp[ph], lp->r_exhaustive[ph], lp->r_sim[ph],
                  jnum(lp->t_sim_slsqp[ph]), jnum(lp->t_sim_exhaustive[ph]), jnum(lp->t_sim_sim[ph]));
        if (ph == SCHED_BWD)
          fprintf(f, ", \"t_gar_ms\": %.9g, \"gradient_elements\": {\"moe_slot\": %.0f, \"dense_slot\": %.0f}",
                  lp->t_gar, lp->grad_moe, lp->grad_dense);
        fputc('}', f);
      }
      if (p == IR_POLICY_FSMOE && layers[i].dropless) {
        Bucket b[NBUCKETS];
        dropless_buckets(&layers[i], c, lp, st->choose, b);
        fprintf(f, ", \"dropless_buckets\": [");
        for (int k = 0; k < NBUCKETS; k++)
          fprintf(f, "%s{\"capacity_at_most\": %g, \"r_fwd\": %d, \"r_bwd\": %d}", k ? ", " : "", b[k].capacity,
                  b[k].r_fwd, b[k].r_bwd);
        fputc(']', f);
      }
      fputc('}', f);
    }
    fprintf(f, "\n     ]}");
  }
  fprintf(f, "\n  ]\n}\n");
  return fclose(f) == 0;
}

static bool write_timeline(const char *path, const SchedStack *st, const SchedPlan *plan, bool svg,
                           const char *title) {
  SchedProgram g = {0};
  if (!sched_build_program(st, plan, &g) || !sched_simulate(&g)) {
    sched_program_free(&g);
    return false;
  }
  FILE *f = fopen(path, "w");
  bool ok = f && (svg ? sched_write_svg(f, &g, title) : sched_write_trace(f, &g, title));
  if (f && fclose(f) != 0) ok = false;
  sched_program_free(&g);
  return ok;
}

void cli_plan_usage(FILE *out) {
  fprintf(out,
          "usage: moec plan F.moe [--cluster C] [--policy NAME|all] [--heads N] [--degree RULE]\n"
          "                 [--svg F.svg] [--trace F.json] [--json F.json]\n"
          "\n"
          "Plans the model's MoE stack with the FSMoE scheduling model (DESIGN section 6): for each\n"
          "policy the pipeline degree r per layer and phase, the partition of the dense gradients and\n"
          "the predicted step time, with the simulated timeline.\n"
          "\n"
          "  --cluster C       cluster profile (default: the model's 'cluster' statement)\n"
          "  --policy P        fsmoe, fsmoe-no-iio, tutel, tutel-improved, pipemoe-lina, sequential\n"
          "                    or all (default: all, side by side)\n"
          "  --heads N         attention heads of a dense part for layers without attention\n"
          "  --degree RULE     how fsmoe picks r: best (default: fastest in simulation), slsqp\n"
          "                    (Algorithm 1), model (the case model's integer optimum), simulator\n"
          "  --svg F.svg       the timeline of the shown policy as SVG\n"
          "  --trace F.json    ... as a Chrome trace (chrome://tracing, Perfetto)\n"
          "  --json F.json     the whole plan as JSON\n");
}

void cli_sweep_usage(FILE *out) {
  fprintf(out,
          "usage: moec sweep --cluster C [--quick] [--degree RULE] [--seqlens A,B,C]\n"
          "                  [--dropless-capacity X]\n"
          "\n"
          "Plans every policy over the paper's Table 4 space (1458 stacks of two generalized layers)\n"
          "and prints the average speed-ups over tutel beside the paper's Table 5.\n"
          "\n"
          "  --cluster C             cluster profile (required), e.g. lang/clusters/testbed-a.cluster\n"
          "  --quick                 a sample of the space instead of all of it\n"
          "  --degree RULE           best (default), slsqp, model or simulator (see 'moec plan --help')\n"
          "  --seqlens A,B,C         the three sequence lengths (default: the cluster's Table 4 ones)\n"
          "  --dropless-capacity X   the capacity factor a dropless layer is planned at\n");
}

int cli_plan(int argc, char **argv) {
  const char *input = NULL, *cluster_opt = NULL, *policy = "all", *svg = NULL, *trace = NULL, *json = NULL;
  double heads_opt = 0;
  SchedChoose choose = SCHED_CHOOSE_BEST;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--cluster") == 0 || strcmp(a, "--policy") == 0 || strcmp(a, "--svg") == 0 ||
        strcmp(a, "--trace") == 0 || strcmp(a, "--json") == 0 || strcmp(a, "--heads") == 0 ||
        strcmp(a, "--degree") == 0) {
      if (!need_value(i, argc, argv)) return 2;
      const char *v = argv[++i];
      if (strcmp(a, "--degree") == 0) {
        if (!parse_choose(v, &choose)) return 2;
      } else if (strcmp(a, "--cluster") == 0) cluster_opt = v;
      else if (strcmp(a, "--policy") == 0) policy = v;
      else if (strcmp(a, "--svg") == 0) svg = v;
      else if (strcmp(a, "--trace") == 0) trace = v;
      else if (strcmp(a, "--json") == 0) json = v;
      else if (!parse_positive("--heads", v, &heads_opt)) return 2;
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "moec: error: unknown option '%s' for 'moec plan' (see 'moec plan --help')\n", a);
      return 2;
    } else if (!input) {
      input = a;
    } else {
      fprintf(stderr, "moec: error: more than one input file ('%s' and '%s')\n", input, a);
      return 2;
    }
  }
  if (!input) {
    fprintf(stderr, "moec: error: no input file (usage: moec plan F.moe [--cluster C] [--policy NAME|all])\n");
    return 2;
  }
  IrPolicy shown = IR_POLICY_FSMOE;
  bool all = strcmp(policy, "all") == 0;
  if (!all && !ir_policy_parse(policy, &shown)) {
    const char *near = ir_closest(policy, ir_policy_name, IR_NPOLICIES);
    fprintf(stderr, "moec: error: unknown policy '%s'%s%s%s (fsmoe, fsmoe-no-iio, tutel, tutel-improved, "
                    "pipemoe-lina, sequential, all)\n",
            policy, near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
    return 2;
  }

  IrDiag d;
  ir_diag_init(&d, stderr);
  IrSource *src = ir_source_read(&d, input);
  FeProgram *p = src ? fe_load(&d, src) : NULL;
  if (!p) {
    ir_source_free(src);
    return 1;
  }
  int status = 1;
  FeCluster fc;
  const char *cluster_path = cluster_opt ? cluster_opt : p->cluster_path;
  PlanLayer *layers = NULL;
  SchedLayerCost *costs = NULL;
  int *r_max = NULL;
  SchedPlan plans[IR_NPOLICIES] = {0};
  if (!cluster_path) {
    ir_error(&d, "no cluster profile: pass --cluster C or add a 'cluster \"F\";' statement to %s", input);
    goto done;
  }
  if (!fe_load_cluster(&d, cluster_path, cluster_opt ? (SrcLoc){0} : p->cluster_loc, &fc)) goto done;
  SchedCluster cluster;
  cli_cluster_from_fe(&fc, &cluster);

  int n = 0;
  for (int i = 0; i < p->nlayers; i++) n += (int)p->layers[i].repeat;
  layers = calloc((size_t)(n > 0 ? n : 1), sizeof *layers);
  costs = calloc((size_t)(n > 0 ? n : 1), sizeof *costs);
  r_max = calloc((size_t)(n > 0 ? n : 1), sizeof *r_max);
  if (!layers || !costs || !r_max) {
    ir_error(&d, "out of memory");
    goto done;
  }
  const FeParallel *par = &p->parallel;
  bool any_attention = false, any_dropless = false;
  int k = 0;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *L = &p->layers[i];
    for (int rep = 0; rep < L->repeat; rep++, k++) {
      PlanLayer *pl = &layers[k];
      snprintf(pl->name, sizeof pl->name, "%s%d", L->name, rep);
      const FeGate *gate = &L->moe.gate;
      pl->k = (double)gate->k;
      pl->dropless = gate->dropless;
      pl->capacity = gate->dropless ? SCHED_DROPLESS_CAPACITY : gate->capacity;
      pl->groups = (int)gate->groups;
      int heads = L->has_attention ? (int)L->heads : (int)heads_opt;
      any_attention |= heads > 0;
      any_dropless |= gate->dropless;
      pl->spec = (SchedLayerSpec){
          .batch = (double)p->model.batch, .seqlen = (double)p->model.seqlen, .embed = (double)p->model.embed,
          .hidden = (double)L->moe.experts.hidden, .f = pl->k * pl->capacity, .experts = (int)L->moe.experts.count,
          .heads = heads, .ffn = strcmp(L->moe.experts.kind, "mixtral") == 0 ? SCHED_FFN_MIXTRAL : SCHED_FFN_GPT,
          .dp = (int)par->dp, .mp = (int)par->mp, .ep = (int)par->ep, .esp = (int)par->esp};
      pl->spec.r_max = r_max_of(&pl->spec, pl->k, pl->capacity, pl->spec.experts, pl->groups);
      r_max[k] = pl->spec.r_max;
      sched_layer_cost(&pl->spec, &cluster, &costs[k]);
    }
  }
  SchedStack st = {n, costs, r_max, choose};
  double t0 = now_s();
  if (!plan_all(&st, plans)) {
    ir_error(&d, "planning failed (an internal error)");
    goto done;
  }
  double plan_s = now_s() - t0;
  SchedResource busiest;
  double lb_total[SCHED_NRES];
  double lb = sched_lower_bound(&st, &busiest, lb_total);

  // ---- report ----
  const SchedPlan *main_plan = &plans[shown];
  printf("# moec plan %s\n", input);
  printf("# model %s: B %lld, L %lld, M %lld; %d generalized layer%s\n", p->model.name, (long long)p->model.batch,
         (long long)p->model.seqlen, (long long)p->model.embed, n, n == 1 ? "" : "s");
  printf("# parallel: dp %lld, mp %lld, ep %lld, esp %lld (P = %lld)\n", (long long)par->dp, (long long)par->mp,
         (long long)par->ep, (long long)par->esp, (long long)(par->dp * par->mp));
  printf("# cluster %s (%s): %d nodes x %d GPUs\n", cluster.name, cluster_path, cluster.nodes, cluster.gpus_per_node);
  if (!any_attention) printf("# no attention in the model (and no --heads): dense time and dense gradients are 0\n");
  if (any_dropless)
    printf("# dropless layers planned at capacity %.2f; per-bucket degrees follow the layer table\n",
           SCHED_DROPLESS_CAPACITY);
  printf("# times in ms (predicted by the cluster profile's fits); gradients in elements, MB at %g bytes each\n",
         SCHED_GRAD_BYTES);
  printf("# a chunk is 1/r of the capacity (T tokens per expert, split as evenly as integers allow); r <= min(%d, T)\n",
         SCHED_R_MAX);
  bool fsmoe_shown = shown == IR_POLICY_FSMOE;
  printf("# per-layer plan of %s (r: pipeline degree per phase, forward/backward", ir_policy_name[shown]);
  if (fsmoe_shown)
    printf(";\n#   slsqp / model / sim: Algorithm 1 by SLSQP, by scanning the case model, and the simulator's\n"
           "#   own best r; used (--degree %s): %s; 'by' says which; case: of the chosen r",
           sched_choose_name[choose], choose == SCHED_CHOOSE_BEST ? "the fastest in simulation" : "as asked");
  printf(";\n#   grad moe/dense: gradient elements all-reduced inside the backward MoE / during the dense backward)\n");
  printf("%-16s %5s %5s", "layer", "r_fwd", "r_bwd");
  if (fsmoe_shown) printf(" %7s %7s %7s %-21s %5s", "slsqp", "model", "sim", "by fwd/bwd", "case");
  printf(" %9s %12s %12s %9s\n", "t_gar_ms", "grad_moe", "grad_dense", "grad_MB");
  for (int i = 0; i < n; i++) {
    const SchedLayerPlan *lp = &main_plan->layer[i];
    printf("%-16s %5d %5d", layers[i].name, lp->r[0], lp->r[1]);
    if (fsmoe_shown) {
      char sl[16], ex[16], sm[16], by[32], cs[16];
      snprintf(sl, sizeof sl, "%d/%d", lp->r_slsqp[0], lp->r_slsqp[1]);
      snprintf(ex, sizeof ex, "%d/%d", lp->r_exhaustive[0], lp->r_exhaustive[1]);
      snprintf(sm, sizeof sm, "%d/%d", lp->r_sim[0], lp->r_sim[1]);
      snprintf(by, sizeof by, "%s/%s", lp->chosen_by[0], lp->chosen_by[1]);
      snprintf(cs, sizeof cs, "%d/%d", lp->kase[0], lp->kase[1]);
      printf(" %7s %7s %7s %-21s %5s", sl, ex, sm, by, cs);
    }
    printf(" %9.3f %12.0f %12.0f %9.2f\n", lp->t_gar, lp->grad_moe, lp->grad_dense,
           (lp->grad_moe + lp->grad_dense) * SCHED_GRAD_BYTES / 1e6);
  }
  double total_grad = 0;
  for (int i = 0; i < n; i++) total_grad += costs[i].n_grad;
  printf("# dense gradient %.0f elements (%.2f MB); after the backward pass: %.0f (%.2f MB); placement: %s\n",
         total_grad, total_grad * SCHED_GRAD_BYTES / 1e6, main_plan->grad_tail,
         main_plan->grad_tail * SCHED_GRAD_BYTES / 1e6,
         total_grad <= 0 ? "nothing to all-reduce" : main_plan->partition ? main_plan->partition : "-");
  if (shown == IR_POLICY_FSMOE)
    for (int i = 0; i < n; i++) {
      if (!layers[i].dropless) continue;
      Bucket b[NBUCKETS];
      dropless_buckets(&layers[i], &cluster, &main_plan->layer[i], choose, b);
      printf("# dropless %s: capacity bucket -> r_fwd/r_bwd:", layers[i].name);
      for (int j = 0; j < NBUCKETS; j++) printf("  <=%g: %d/%d", b[j].capacity, b[j].r_fwd, b[j].r_bwd);
      printf("\n");
    }
  printf("#\n%-16s %10s %10s %10s %9s %9s %9s\n", "policy", "fwd_ms", "bwd_ms", "iter_ms", "vs_tutel", "vs_seq",
         "gap_lb");
  for (int q = 0; q < IR_NPOLICIES; q++) {
    if (!all && q != (int)shown && q != IR_POLICY_TUTEL && q != IR_POLICY_SEQUENTIAL) continue;
    const SchedPlan *pl = &plans[q];
    printf("%-16s %10.3f %10.3f %10.3f %8.3fx %8.3fx %8.1f%%\n", ir_policy_name[q], pl->t_fwd, pl->t_bwd,
           pl->t_iter, plans[IR_POLICY_TUTEL].t_iter / pl->t_iter, plans[IR_POLICY_SEQUENTIAL].t_iter / pl->t_iter,
           100 * (pl->t_iter / lb - 1));
  }
  printf("# lower bound %.3f ms: busiest resource %s (compute %.3f, intra %.3f, inter %.3f ms at r = 1)\n", lb,
         sched_resource_name[busiest], lb_total[SCHED_RES_COMPUTE], lb_total[SCHED_RES_INTRA],
         lb_total[SCHED_RES_INTER]);
  printf("# planned %d policies in %.3f ms\n", IR_NPOLICIES, plan_s * 1e3);

  char title[256];
  snprintf(title, sizeof title, "%s on %s: %s", p->model.name, cluster.name, ir_policy_name[shown]);
  bool ok = true;
  if (svg && !write_timeline(svg, &st, main_plan, true, title)) ok = ir_error(&d, "cannot write '%s'", svg);
  if (trace && !write_timeline(trace, &st, main_plan, false, title)) ok = ir_error(&d, "cannot write '%s'", trace);
  if (json && !write_json(json, p->model.name, cluster_path, &cluster, par, layers, &st, plans, lb, busiest, lb_total))
    ok = ir_error(&d, "cannot write '%s'", json);
  if (svg && ok) printf("# wrote %s\n", svg);
  if (trace && ok) printf("# wrote %s\n", trace);
  if (json && ok) printf("# wrote %s\n", json);
  printf(ok ? "OK\n" : "FAILED\n");
  status = ok ? 0 : 1;
done:
  free_all(plans);
  free(layers);
  free(costs);
  free(r_max);
  fe_program_free(p);
  ir_source_free(src);
  return status;
}

// ---- moec sweep ----

// The paper's Table 5 (average speedup over tutel) on Testbed A and B.
static double paper_speedup(IrPolicy p, int testbed) {
  static const double a[IR_NPOLICIES] = {[IR_POLICY_FSMOE] = 1.18, [IR_POLICY_FSMOE_NO_IIO] = 1.12, [IR_POLICY_TUTEL] = 1.00,
                                            [IR_POLICY_TUTEL_IMPROVED] = 1.09};
  static const double b[IR_NPOLICIES] = {[IR_POLICY_FSMOE] = 1.22, [IR_POLICY_FSMOE_NO_IIO] = 1.16, [IR_POLICY_TUTEL] = 1.00,
                                            [IR_POLICY_TUTEL_IMPROVED] = 1.08};
  if (testbed == 'a') return a[p];
  if (testbed == 'b') return b[p];
  return 0;
}

static bool parse_seqlens(const char *text, double out[3]) {
  char *end;
  const char *s = text;
  for (int i = 0; i < 3; i++) {
    double v = strtod(s, &end);
    if (end == s || !(v >= 1) || v != floor(v)) return false;
    out[i] = v;
    s = end;
    if (i < 2) {
      if (*s != ',') return false;
      s++;
    }
  }
  return *s == '\0';
}

// Why another policy beat fsmoe on a case: which phase, and what differed there.
static void explain(const SchedPlan *fs, const SchedPlan *other, char *buf, size_t n) {
  double dfwd = fs->t_fwd - other->t_fwd, dbwd = fs->t_bwd - other->t_bwd;
  if (dfwd > 0 && dfwd >= dbwd) {
    snprintf(buf, n, "forward %.3f ms slower: r_fwd %d (Algorithm 1) vs %d; the case model misjudges the %s overlap",
             dfwd, fs->layer[0].r[SCHED_FWD], other->layer[0].r[SCHED_FWD],
             other->policy == IR_POLICY_SEQUENTIAL ? "pipelining" : "stream");
  } else {
    snprintf(buf, n,
             "backward %.3f ms slower: r_bwd %d/%d vs %d/%d, gradient in MoE %.0f, dense %.0f, tail %.0f (%s) vs %s",
             dbwd, fs->layer[0].r[SCHED_BWD], fs->nlayers > 1 ? fs->layer[1].r[SCHED_BWD] : 0,
             other->layer[0].r[SCHED_BWD], other->nlayers > 1 ? other->layer[1].r[SCHED_BWD] : 0,
             fs->layer[0].grad_moe, fs->layer[0].grad_dense, fs->grad_tail, fs->partition, other->partition);
  }
}

int cli_sweep(int argc, char **argv) {
  const char *cluster_path = NULL;
  bool quick = false;
  double seqlens[3] = {0}, dropless_capacity = SCHED_DROPLESS_CAPACITY;
  bool have_seqlens = false;
  SchedChoose choose = SCHED_CHOOSE_BEST;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--degree") == 0) {
      if (!need_value(i, argc, argv) || !parse_choose(argv[++i], &choose)) return 2;
    } else if (strcmp(a, "--cluster") == 0) {
      if (!need_value(i, argc, argv)) return 2;
      cluster_path = argv[++i];
    } else if (strcmp(a, "--quick") == 0) {
      quick = true;
    } else if (strcmp(a, "--seqlens") == 0) {
      if (!need_value(i, argc, argv)) return 2;
      if (!parse_seqlens(argv[++i], seqlens)) {
        fprintf(stderr, "moec: error: --seqlens takes three sequence lengths, e.g. 512,1024,2048\n");
        return 2;
      }
      have_seqlens = true;
    } else if (strcmp(a, "--dropless-capacity") == 0) {
      if (!need_value(i, argc, argv) || !parse_positive(a, argv[++i], &dropless_capacity)) return 2;
    } else {
      fprintf(stderr, "moec: error: unknown %s '%s' for 'moec sweep' (see 'moec sweep --help')\n",
              a[0] == '-' ? "option" : "argument", a);
      return 2;
    }
  }
  if (!cluster_path) {
    fprintf(stderr, "moec: error: moec sweep needs --cluster C (e.g. lang/clusters/testbed-a.cluster)\n");
    return 2;
  }
  IrDiag d;
  ir_diag_init(&d, stderr);
  FeCluster fc;
  if (!fe_load_cluster(&d, cluster_path, (SrcLoc){0}, &fc)) return 1;
  SchedCluster cluster;
  cli_cluster_from_fe(&fc, &cluster);
  int testbed = strncmp(cluster.name, "testbed_a", 9) == 0 ? 'a' : strncmp(cluster.name, "testbed_b", 9) == 0 ? 'b' : 0;
  if (!have_seqlens) sched_table4_seqlens(&cluster, seqlens);
  int gpn = cluster.gpus_per_node, world = cluster.nodes * cluster.gpus_per_node;

  printf("# moec sweep: Table 4 of the FSMoE paper, each case a stack of 2 identical generalized layers,\n"
         "#   forward + backward, every policy planned and simulated\n");
  printf("# cluster %s (%s): %d nodes x %d GPUs; mp = esp = %d, ep = dp = experts = %d (P = %d)\n", cluster.name,
         cluster_path, cluster.nodes, gpn, gpn, cluster.nodes, world);
  printf("# B {1,2,4}, heads {8,16,32}, L {%g,%g,%g}, M {1024,2048,4096}, H = hscale*M {2,3,4}, "
         "f {1.2, 2.4, *}, ffn {gpt, mixtral}\n",
         seqlens[0], seqlens[1], seqlens[2]);
  printf("# f = * (dropless) is modelled as top-2 at capacity %.2f: f = %.2f\n", dropless_capacity,
         2 * dropless_capacity);
  printf("# fsmoe's degree: %s\n", choose == SCHED_CHOOSE_BEST ? "the fastest in simulation of SLSQP's, the model's "
                                                                  "and the simulator's answers"
                                    : choose == SCHED_CHOOSE_SLSQP ? "Algorithm 1 with SLSQP (the paper's method)"
                                    : choose == SCHED_CHOOSE_MODEL ? "the case model's integer optimum"
                                                                   : "the simulator's own best r");
  printf("# iteration times in ms; speedup = tutel / fsmoe; r_b: backward degree of layer 1 / layer 0\n");
  if (!quick)
    printf("%5s %2s %5s %5s %5s %2s %4s %-7s %3s %5s %10s %10s %10s %10s %10s %10s %8s\n", "case", "B", "heads", "L",
           "M", "hs", "f", "ffn", "r_f", "r_b", "sequential", "tutel", "tutel-imp", "lina", "no-iio", "fsmoe",
           "speedup");

  double sum_speedup[IR_NPOLICIES] = {0}, sum_vs_seq[IR_NPOLICIES] = {0};
  int wins[IR_NPOLICIES] = {0}, rdiff = 0, ncases = 0, nexc = 0;
  char (*exc)[400] = calloc(SCHED_TABLE4_CASES, sizeof *exc);
  if (!exc) return 1;
  bool progress = isatty(STDOUT_FILENO) && isatty(STDERR_FILENO);
  bool ok = true;
  double t0 = now_s();
  for (int id = 0; id < SCHED_TABLE4_CASES && ok; id++) {
    SchedTable4Case tc;
    SchedLayerSpec spec;
    sched_table4_case(id, &cluster, seqlens, dropless_capacity, &tc, &spec);
    SchedLayerCost cost[2];
    sched_layer_cost(&spec, &cluster, &cost[0]);
    cost[1] = cost[0];
    int rm[2] = {spec.r_max, spec.r_max};
    SchedStack st = {2, cost, rm, choose};
    SchedPlan plans[IR_NPOLICIES];
    if (!plan_all(&st, plans)) {
      ok = false;
      free_all(plans);
      break;
    }
    const SchedPlan *f = &plans[IR_POLICY_FSMOE];
    double tt = plans[IR_POLICY_TUTEL].t_iter, ts = plans[IR_POLICY_SEQUENTIAL].t_iter;
    int fastest = 0;   // ties (within rounding) go to the lower policy index, fsmoe first
    for (int q = 0; q < IR_NPOLICIES; q++) {
      sum_speedup[q] += tt / plans[q].t_iter;
      sum_vs_seq[q] += ts / plans[q].t_iter;
      if (plans[q].t_iter < plans[fastest].t_iter * (1 - 1e-9)) fastest = q;
    }
    wins[fastest]++;
    bool differ = false;
    for (int i = 0; i < 2; i++) differ |= f->layer[i].r[SCHED_FWD] != f->layer[i].r[SCHED_BWD];
    rdiff += differ;
    if (fastest != IR_POLICY_FSMOE) {
      char why[300];
      explain(f, &plans[fastest], why, sizeof why);
      snprintf(exc[nexc++], sizeof exc[0], "%5d %-14s %6.2f%% faster: %s", id, ir_policy_name[fastest],
               100 * (f->t_iter / plans[fastest].t_iter - 1), why);
    }
    if (!quick) {
      char rb[16];
      snprintf(rb, sizeof rb, "%d/%d", f->layer[1].r[SCHED_BWD], f->layer[0].r[SCHED_BWD]);
      printf("%5d %2g %5d %5g %5g %2g %4s %-7s %3d %5s %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f %7.3fx\n", id,
             tc.batch, tc.heads, tc.seqlen, tc.embed, tc.hscale, tc.dropless ? "*" : tc.f < 2 ? "1.2" : "2.4",
             tc.ffn == SCHED_FFN_MIXTRAL ? "mixtral" : "gpt", f->layer[0].r[SCHED_FWD], rb, ts, tt,
             plans[IR_POLICY_TUTEL_IMPROVED].t_iter, plans[IR_POLICY_PIPEMOE_LINA].t_iter, plans[IR_POLICY_FSMOE_NO_IIO].t_iter,
             f->t_iter, tt / f->t_iter);
    }
    free_all(plans);
    ncases++;
    if (progress && (ncases % 18 == 0 || ncases == SCHED_TABLE4_CASES)) {
      int w = 40, filled = ncases * w / SCHED_TABLE4_CASES;
      fprintf(stderr, "\r[%.*s%*s] %4d/%d", filled, "========================================", w - filled, "", ncases,
              SCHED_TABLE4_CASES);
      if (ncases == SCHED_TABLE4_CASES) fputc('\n', stderr);
    }
  }
  double elapsed = now_s() - t0;
  if (!ok) {
    free(exc);
    ir_error(&d, "planning failed (an internal error)");
    printf("FAILED\n");
    return 1;
  }
  printf("#\n# average speedup over tutel, %d cases (paper: Table 5, %s)\n", ncases,
         testbed == 'a' ? "Testbed A" : testbed == 'b' ? "Testbed B" : "Testbed A / B");
  printf("%-16s %9s %9s %9s %12s\n", "policy", "ours", "paper", "fastest", "vs_sequential");
  static const IrPolicy order[] = {IR_POLICY_TUTEL, IR_POLICY_TUTEL_IMPROVED, IR_POLICY_PIPEMOE_LINA, IR_POLICY_FSMOE_NO_IIO,
                                      IR_POLICY_FSMOE, IR_POLICY_SEQUENTIAL};
  for (int k = 0; k < IR_NPOLICIES; k++) {
    IrPolicy q = order[k];
    char paper[32] = "-";
    if (testbed && paper_speedup(q, testbed) > 0) snprintf(paper, sizeof paper, "%.2fx", paper_speedup(q, testbed));
    else if (!testbed && paper_speedup(q, 'a') > 0)
      snprintf(paper, sizeof paper, "%.2f/%.2f", paper_speedup(q, 'a'), paper_speedup(q, 'b'));
    printf("%-16s %8.3fx %9s %9d %11.3fx\n", ir_policy_name[q], sum_speedup[q] / ncases, paper, wins[q],
           sum_vs_seq[q] / ncases);
  }
  printf("# fsmoe cases with r_fwd != r_bwd in some layer: %d of %d (paper: 912 of 1458)\n", rdiff, ncases);
  printf("# cases where fsmoe is not the fastest policy: %d\n", nexc);
  for (int i = 0; i < nexc; i++) printf("#   %s\n", exc[i]);
  printf("# %d cases x %d policies planned and simulated in %.2f s\n", ncases, IR_NPOLICIES, elapsed);
  printf("OK\n");
  free(exc);
  return 0;
}
