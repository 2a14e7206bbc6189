// `moec plan`: the scheduling model of lang/manual.md §8 from the command line (`moec sweep`, the
// paper's Table 4 space, is cli/sweep.c; what both use is cli/plan.h, defined here).
//
//   moec plan F.moe [--cluster C] [--policy NAME|all] [--heads N] [--degree RULE]
//                   [--svg out.svg] [--trace out.json] [--json out.json]
//
// RULE picks fsmoe's pipeline degree: best (default: the fastest in simulation of the three
// answers below), slsqp (Algorithm 1 with SLSQP, the paper's method), model (the case model's
// integer optimum), simulator (the simulator's own best r).
//
// plan prices a model the way `moec build` does: it lowers the program to IR, runs the build's
// passes up to `cost` (which prices every GEMM and collective with the cluster profile) and
// takes the layers' costs from pass_stack (passes/cost.c), the stack the pipeline pass plans.
// It then plans that stack for every policy (sched/sched_solve.c, the planner the pipeline pass
// calls) and simulates the stream programs (sched/sched_sim.c), so its degrees and predicted
// times for a policy are the build's with `schedule { policy P; pipeline auto; }`
// (tests/plan_build.sh checks it). A language model's attention is in the IR and priced there;
// with --heads, the layers of a MoE stack get a dense attention part modelled by lang/manual.md §8's
// formulas (sched_attention) on top of what the IR prices. cli_plan is called with main's
// argc/argv (argv[1] is the command) and returns the exit status: 0 success, 1 the input has
// errors, 2 bad command line.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "frontend/fe.h"
#include "ir/ir.h"
#include "passes/pass.h"
#include "sched/sched.h"
#include "cli/cli.h"
#include "cli/plan.h"

double cli_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool cli_plan_all(const SchedStack *st, SchedPlan plans[IR_NPOLICIES]) {
  bool ok = true;
  for (int p = 0; p < IR_NPOLICIES; p++) ok &= sched_plan(st, (IrPolicy)p, &plans[p]);
  return ok;
}

void cli_plans_free(SchedPlan plans[IR_NPOLICIES]) {
  for (int p = 0; p < IR_NPOLICIES; p++) sched_plan_free(&plans[p]);
}

// The policies of ir/'s table (ir_policy_name), joined by ", ".
static void print_policy_names(FILE *out) {
  for (int p = 0; p < IR_NPOLICIES; p++) fprintf(out, "%s%s", p ? ", " : "", ir_policy_name[p]);
}

bool cli_opt_degree(const CliArgs *a, const char *opt, const char *value, void *dest) {
  for (int i = 0; i < SCHED_NCHOOSE; i++)
    if (strcmp(value, sched_choose_name[i]) == 0) {
      *(SchedChoose *)dest = (SchedChoose)i;
      return true;
    }
  return cli_args_error(a, "--degree takes best, slsqp, model or simulator, not '%s'", value);
}

// ---- moec plan: the command line ----

typedef struct PlanOptions {
  const char *input, *cluster, *svg, *trace, *json;
  const char *layout;    // --layout D,M,E,S[,ALGO]: plan this layout
  bool layouts;          // --layouts: the layout search's table (and its JSON with --json)
  double heads;          // --heads: attention heads in front of layers without attention (0: none)
  SchedChoose choose;    // --degree
  IrPolicy shown;        // --policy: the policy whose per-layer plan is printed
  bool all;              // --policy all: every policy in the summary (else shown, tutel, sequential)
  bool verbose;          // -v: the sequential step per class of work (pass_class_times)
} PlanOptions;

// Options of `moec plan`; 0, or 2 on a usage error (already reported).
static int parse_plan_options(int argc, char **argv, PlanOptions *o) {
  *o = (PlanOptions){.choose = SCHED_CHOOSE_BEST, .shown = IR_POLICY_FSMOE};
  const char *policy = "all";
  const CliOpt opts[] = {
      {"--cluster", NULL, false, &o->cluster}, {"--policy", NULL, false, &policy},
      {"--svg", NULL, false, &o->svg},         {"--trace", NULL, false, &o->trace},
      {"--json", NULL, false, &o->json},       {"--layout", NULL, false, &o->layout},
      {"--layouts", NULL, true, &o->layouts},  {"--heads", NULL, false, &o->heads, cli_opt_positive},
      {"--degree", NULL, false, &o->choose, cli_opt_degree},
      {"-v", "--verbose", true, &o->verbose},
  };
  CliArgs args = {.for_what = "'moec plan'", .help = "moec plan", .positional = &o->input,
                  .second = "more than one input file", .dash_is_positional = true, .opts = opts,
                  .nopts = sizeof opts / sizeof opts[0]};
  if (!cli_parse_args(&args, argc, argv)) return 2;
  if (!o->input) {
    fprintf(stderr, "moec: error: no input file (usage: moec plan F.moe [--cluster C] [--policy NAME|all])\n");
    return 2;
  }
  o->all = strcmp(policy, "all") == 0;
  if (!o->all && !ir_policy_parse(policy, &o->shown)) {
    const char *near = ir_closest(policy, ir_policy_name, IR_NPOLICIES);
    fprintf(stderr, "moec: error: unknown policy '%s'%s%s%s (", policy, near ? "; did you mean '" : "",
            near ? near : "", near ? "'?" : "");
    print_policy_names(stderr);
    fprintf(stderr, ", all)\n");
    return 2;
  }
  return 0;
}

void cli_plan_usage(FILE *out) {
  fprintf(out,
          "usage: moec plan F.moe [--cluster C] [--policy NAME|all] [--heads N] [--degree RULE]\n"
          "                 [--svg F.svg] [--trace F.json] [--json F.json] [--layouts] [--layout D,M,E,S[,...]] [-v]\n"
          "\n"
          "Plans the model's MoE stack with the FSMoE scheduling model (lang/manual.md section 8): for each\n"
          "policy the pipeline degree r per layer and phase, the partition of the dense gradients and\n"
          "the predicted step time, with the simulated timeline.\n"
          "\n"
          "  --cluster C       cluster profile (default: the model's 'cluster' statement)\n"
          "  --policy P        ");
  print_policy_names(out);
  fprintf(out,
          "\n"
          "                    or all (default: all, side by side)\n"
          "  --heads N         attention heads of a dense part for layers without attention\n"
          "  --degree RULE     how fsmoe picks r: best (default: fastest in simulation), slsqp\n"
          "                    (Algorithm 1), model (the case model's integer optimum), simulator\n"
          "  --svg F.svg       the timeline of the shown policy as SVG\n"
          "  --trace F.json    ... as a Chrome trace (chrome://tracing, Perfetto)\n"
          "  --json F.json     the whole plan as JSON (with --layouts: the layouts)\n"
          "  --layouts         every parallel layout of the cluster's ranks, priced and ranked\n"
          "                    (manual 6); the model's 'parallel auto;' picks the first that fits\n"
          "  --layout D,M,E,S[,ALGO][,pp=P][,microbatches=M]  plan this layout (dp, mp, ep, esp, EP\n"
          "                    AlltoAll algorithm, stages, microbatches)\n"
          "  -v, --verbose     the sequential step per class of work (GEMM, attention, update, each\n"
          "                    collective, the rest), as the binary's --profile measures them\n");
}

// ---- moec plan: the model, priced from its IR ----

// One MoE layer of the plan, as the report shows it.
typedef struct PlanLayer {
  char name[96];   // its forward function's name without ".fwd" (block0, block1, ...)
  int heads;       // attention modelled in front of it (0: none)
  bool dropless;   // `capacity *`: compiled for the worst case, every token at one expert
  double f;        // routed slots per token the program computes over, E * C / S (k * capacity factor)
} PlanLayer;

typedef struct Plan {
  IrSource *src;
  FeProgram *p;
  IrModule *m;
  const char *cluster_path;
  SchedCluster cluster;
  PassStack stack;              // the pipeline pass's stack (pass_stack), modelled attention added
  PlanLayer *layers;            // [stack.n]
  SchedStack st;
  SchedPlan plans[IR_NPOLICIES];
  double plan_s;                // seconds the planner took for every policy
  double lb, lb_total[SCHED_NRES];
  SchedResource busiest;
} Plan;

static void plan_free(Plan *pl) {
  cli_plans_free(pl->plans);
  free(pl->layers);
  pass_stack_free(&pl->stack);
  ir_module_free(pl->m);
  fe_program_free(pl->p);
  ir_source_free(pl->src);
}

// Reads the model and its cluster profile and lowers the program as `moec build` does, through
// the build's passes up to `cost`. A MoE stack's layers get --heads heads of attention modelled
// in front of them (0: none); a language model's attention is its own, priced from the IR.
// False on error (reported).
static bool plan_load(IrDiag *d, const PlanOptions *o, Plan *pl) {
  pl->src = ir_source_read(d, o->input);
  pl->p = pl->src ? fe_load(d, pl->src) : NULL;
  if (!pl->p) return false;
  FeProgram *p = pl->p;
  if (p->model.has_vocab && o->heads > 0)
    return ir_error(d, "--heads models attention in front of MoE stacks; the language model %s has its own "
                    "attention, which the IR prices", o->input);
  pl->cluster_path = o->cluster ? o->cluster : p->cluster_path;
  if (!pl->cluster_path)
    return ir_error(d, "no cluster profile: pass --cluster C or add a 'cluster \"F\";' statement to %s", o->input);
  FeCluster fc;
  if (!fe_load_cluster(d, pl->cluster_path, o->cluster ? (SrcLoc){0} : p->cluster_loc, &fc)) return false;
  cli_cluster_from_fe(&fc, &pl->cluster);
  if (!cli_resolve_layout(d, p, &fc, o->layout, false, NULL, 0, NULL, 0)) return false;
  // With pipeline stages the plan is the first stage's (its layers as moec build splits them).
  if (p->parallel.pp > 1 && !cli_stage_split(d, p, &fc, NULL, 0)) return false;
  // A language model's attention is in its IR (passes/cost.c prices it): nothing is modelled.
  for (int i = 0; i < p->nlayers && !p->model.has_vocab; i++) {
    FeLayer *L = &p->layers[i];
    L->heads = (int64_t)o->heads;
  }
  pl->m = fe_lower(d, p, NULL);
  if (!pl->m) return false;
  if (p->parallel.dp * p->parallel.mp > 1) {   // where the ranks sit, as moec build says it
    ir_attrs_set_int(pl->m->attrs, &pl->m->nattrs, "gpus_per_node", fc.gpus_per_node);
    ir_attrs_set_int(pl->m->attrs, &pl->m->nattrs, "nodes", fc.nodes);
  }
  // Priced as the CPU build runs it: its fused kernels one launch each (as moec layout does).
  PassCtx ctx = {.d = d, .log = stderr, .stop_after = "cost", .cluster = &pl->cluster, .fuse = true, .fuse_cpu = true};
  bool ok = pass_run_pipeline(pl->m, &ctx);
  pass_ctx_free(&ctx);
  return ok;
}

// The layer item of the program with the instance whose forward function is fwd_name
// ("block1.fwd"); NULL if none.
static const FeLayer *source_layer(const FeProgram *p, const char *fwd_name) {
  char name[160];
  for (int i = 0; i < p->nlayers; i++)
    for (int rep = 0; rep < p->layers[i].repeat; rep++) {
      snprintf(name, sizeof name, "%s%d.fwd", p->layers[i].name, rep);
      if (strcmp(name, fwd_name) == 0) return &p->layers[i];
    }
  return NULL;
}

// Adds the dense attention part of L->heads heads to a layer's costs (lang/manual.md §8's formulas).
static void add_attention(const FeProgram *p, const FeLayer *L, const SchedCluster *c, SchedLayerCost *cost) {
  SchedLayerSpec s = {.batch = (double)p->model.batch, .seqlen = (double)p->model.seqlen,
                      .embed = (double)p->model.embed, .heads = (int)L->heads,
                      .ffn = sched_ffn_of(L->moe.experts.kind),
                      .dp = (int)p->parallel.dp, .mp = (int)p->parallel.mp};
  double t_att, n_grad;
  sched_attention(&s, c, &t_att, &n_grad);
  cost->phase[SCHED_FWD].t_att += t_att;
  cost->phase[SCHED_BWD].t_att += 2 * t_att;
  cost->n_grad += n_grad;
}

// E * C / S: the expert region's [E, C, M] slots over the tokens S the layer routes on this
// rank (its input's rows, split over mp).
static double slots_per_token(const IrModule *m, const PassLayer *l) {
  IrValue *entry, *exit;
  const IrFunc *f = l->fwd;
  if (f->nargs < 1 || !pass_expert_region(f, &entry, &exit)) return 0;
  double tokens = (double)f->args[0]->type.dim[0] / (double)ir_mod_int(m, "mp", 1);
  return tokens > 0 ? (double)entry->type.dim[0] * (double)entry->type.dim[1] / tokens : 0;
}

// The build's stack of the module (pass_stack), each layer's modelled attention added, planned
// for every policy. False on error (reported).
static bool plan_stack(IrDiag *d, const PlanOptions *o, Plan *pl) {
  if (!pass_stack(pl->m, &pl->cluster, &pl->stack)) return ir_error(d, "out of memory");
  int n = pl->stack.n;
  if (n == 0)
    return ir_error(d, "%s has no MoE layer: moec plan plans pipeline degrees and gradient slots per MoE layer, so "
                    "there is nothing to plan", o->input);
  pl->layers = calloc((size_t)(n > 0 ? n : 1), sizeof *pl->layers);
  if (!pl->layers) return ir_error(d, "out of memory");
  for (int i = 0; i < n; i++) {
    const PassLayer *l = &pl->stack.layer[i];
    PlanLayer *out = &pl->layers[i];
    snprintf(out->name, sizeof out->name, "%.*s", (int)strlen(l->name) - 4, l->name);
    const FeLayer *L = source_layer(pl->p, l->name);
    if (!L) return ir_error(d, "layer '%s' of the IR is not in the model (an internal error)", out->name);
    out->heads = pl->p->model.has_vocab ? 0 : (int)L->heads;   // modelled heads
    if (out->heads > 0) add_attention(pl->p, L, &pl->cluster, &pl->stack.cost[i]);
    SchedLayerCost unused;
    int r_max;
    out->dropless = pass_dropless_at(&pl->stack, i, 1.0, &unused, &r_max);
    out->f = slots_per_token(pl->m, l);
  }
  pl->st = (SchedStack){n, pl->stack.cost, pl->stack.r_max, o->choose, pl->stack.t_fwd_other, pl->stack.t_bwd_other,
                        pl->cluster.overlap_compute, pl->cluster.overlap_comm, {0, 0}};
  double t0 = cli_now_s();
  if (!cli_plan_all(&pl->st, pl->plans)) return ir_error(d, "planning failed (an internal error)");
  pl->plan_s = cli_now_s() - t0;
  pl->lb = sched_lower_bound(&pl->st, &pl->busiest, pl->lb_total);
  return true;
}

// ---- moec plan: the report ----

typedef struct Bucket {
  double capacity;
  int r_fwd, r_bwd;
} Bucket;

static const double bucket_capacity[] = {1.0, 1.25, 1.5, 2.0, 3.0, 4.0};
enum { NBUCKETS = sizeof bucket_capacity / sizeof bucket_capacity[0] };

// fsmoe's degrees for dropless layer i were its gate at each capacity bucket (pass_dropless_at;
// the plan's gradient load kept).
static void dropless_buckets(const Plan *pl, int i, const SchedLayerPlan *lp, Bucket out[NBUCKETS]) {
  for (int b = 0; b < NBUCKETS; b++) {
    SchedLayerCost cost;
    int r_max;
    pass_dropless_at(&pl->stack, i, bucket_capacity[b], &cost, &r_max);
    SchedLayerPlan bp = {0};
    sched_fsmoe_degree(&cost, r_max, SCHED_FWD, 0, pl->st.choose, &bp);
    sched_fsmoe_degree(&cost, r_max, SCHED_BWD, lp->grad_moe, pl->st.choose, &bp);
    out[b] = (Bucket){bucket_capacity[b], bp.r[SCHED_FWD], bp.r[SCHED_BWD]};
  }
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

// One policy's per-layer plan in the JSON.
static void json_policy_layers(FILE *f, const Plan *pl, int p) {
  for (int i = 0; i < pl->st.n; i++) {
    const SchedLayerPlan *lp = &pl->plans[p].layer[i];
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
    if (p == IR_POLICY_FSMOE && pl->layers[i].dropless) {
      Bucket b[NBUCKETS];
      dropless_buckets(pl, i, lp, b);
      fprintf(f, ", \"dropless_buckets\": [");
      for (int k = 0; k < NBUCKETS; k++)
        fprintf(f, "%s{\"capacity_at_most\": %g, \"r_fwd\": %d, \"r_bwd\": %d}", k ? ", " : "", b[k].capacity,
                b[k].r_fwd, b[k].r_bwd);
      fputc(']', f);
    }
    fputc('}', f);
  }
}

static bool write_json(const char *path, const Plan *pl) {
  FILE *f = fopen(path, "w");
  if (!f) return false;
  const SchedPlan *tutel = &pl->plans[IR_POLICY_TUTEL], *seq = &pl->plans[IR_POLICY_SEQUENTIAL];
  const FeParallel *par = &pl->p->parallel;
  const SchedCluster *c = &pl->cluster;
  fprintf(f, "{\n  \"format\": \"moec-plan-1\",\n  \"model\": ");
  json_str(f, pl->p->model.name);
  fprintf(f, ",\n  \"cluster\": {\"name\": ");
  json_str(f, c->name);
  fprintf(f, ", \"path\": ");
  json_str(f, pl->cluster_path);
  fprintf(f, ", \"nodes\": %d, \"gpus_per_node\": %d},\n", c->nodes, c->gpus_per_node);
  fprintf(f, "  \"parallel\": {\"dp\": %lld, \"mp\": %lld, \"ep\": %lld, \"esp\": %lld},\n", (long long)par->dp,
          (long long)par->mp, (long long)par->ep, (long long)par->esp);
  fprintf(f, "  \"units\": {\"time\": \"ms\", \"gradient\": \"elements (fp32, %g bytes each)\"},\n", SCHED_GRAD_BYTES);
  fprintf(f, "  \"lower_bound_ms\": %.9g, \"busiest_resource\": \"%s\",\n", pl->lb, sched_resource_name[pl->busiest]);
  fprintf(f, "  \"resource_totals_ms\": {\"compute\": %.9g, \"intra\": %.9g, \"inter\": %.9g},\n",
          pl->lb_total[SCHED_RES_COMPUTE], pl->lb_total[SCHED_RES_INTRA], pl->lb_total[SCHED_RES_INTER]);
  fprintf(f, "  \"layers\": [");
  for (int i = 0; i < pl->st.n; i++) {
    const SchedLayerCost *cost = &pl->st.cost[i];
    fprintf(f, "%s\n    {\"index\": %d, \"name\": ", i ? "," : "", i);
    json_str(f, pl->layers[i].name);
    fprintf(f, ", \"f\": %.9g, \"dropless\": %s, \"r_max\": %d, \"dense_gradient_elements\": %.0f,", pl->layers[i].f,
            pl->layers[i].dropless ? "true" : "false", pl->st.r_max[i], cost->n_grad);
    fprintf(f, " \"t_attention_ms\": [%.9g, %.9g]}", cost->phase[0].t_att, cost->phase[1].t_att);
  }
  fprintf(f, "\n  ],\n  \"policies\": [");
  for (int p = 0; p < IR_NPOLICIES; p++) {
    const SchedPlan *plan = &pl->plans[p];
    fprintf(f, "%s\n    {\"name\": \"%s\", \"forward_ms\": %.9g, \"backward_ms\": %.9g, \"iteration_ms\": %.9g,",
            p ? "," : "", ir_policy_name[p], plan->t_fwd, plan->t_bwd, plan->t_iter);
    fprintf(f, " \"speedup_vs_tutel\": %.9g, \"speedup_vs_sequential\": %.9g, \"gap_to_lower_bound\": %.9g,",
            jnum(tutel->t_iter / plan->t_iter), jnum(seq->t_iter / plan->t_iter), jnum(plan->t_iter / pl->lb - 1));
    fprintf(f, "\n     \"gradient_partition\": ");
    json_str(f, plan->partition);
    fprintf(f, ", \"tail_gradient_elements\": %.0f,\n     \"layers\": [", plan->grad_tail);
    json_policy_layers(f, pl, p);
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

// The lines above the layer table: model, layout, cluster and how the numbers were made.
static void print_header(const PlanOptions *o, const Plan *pl) {
  const FeProgram *p = pl->p;
  const FeParallel *par = &p->parallel;
  int n = pl->st.n, attention = 0;
  bool any_dropless = false;
  for (int i = 0; i < n; i++) {
    attention += pl->layers[i].heads > 0;
    any_dropless |= pl->layers[i].dropless;
  }
  printf("# moec plan %s\n", o->input);
  printf("# model %s: B %lld, L %lld, M %lld; %d generalized layer%s\n", p->model.name, (long long)p->model.batch,
         (long long)p->model.seqlen, (long long)p->model.embed, n, n == 1 ? "" : "s");
  printf("# parallel: dp %lld, mp %lld, ep %lld, esp %lld (P = %lld)\n", (long long)par->dp, (long long)par->mp,
         (long long)par->ep, (long long)par->esp, (long long)(par->dp * par->mp));
  if (par->pp > 1 || par->microbatches > 1) {
    char layers[256];
    cli_stage_layers(p, 0, layers, sizeof layers);
    printf("# pipeline: pp %lld, microbatches %lld: this is the plan of one microbatch (B / %lld)%s%s; moec build -v "
           "plans every stage and the step (lang/manual.md section 6.2)\n", (long long)(par->pp > 1 ? par->pp : 1),
           (long long)par->microbatches, (long long)par->microbatches, par->pp > 1 ? " on stage 0, " : "",
           par->pp > 1 ? layers : "");
  }
  printf("# cluster %s (%s): %d nodes x %d GPUs\n", pl->cluster.name, pl->cluster_path, pl->cluster.nodes,
         pl->cluster.gpus_per_node);
  if (p->model.has_vocab)
    printf("# language model (vocab %lld): dense time is each MoE layer's attention (projections, causal attention, "
           "MP AllReduces) and gate as the IR prices them; dense gradient its attention, norms and gate, plus the "
           "head's and mlp layers' before it\n", (long long)p->model.vocab);
  else if (!attention)
    printf("# no attention in the model (and no --heads): dense time is the layers' GEMMs outside the experts "
           "(gate, dense dispatch), dense gradient the gates'\n");
  else
    printf("# attention in front of %d of %d layers (--heads), modelled by the scheduling model's formulas: the compiled "
           "program has none\n", attention, n);
  if (any_dropless)
    printf("# dropless layers planned at the capacity the program computes over (every token at one expert); "
           "per-bucket degrees follow the layer table\n");
  printf("# times in ms (the cluster profile's fits over the program's GEMMs and collectives, priced as moec build "
         "prices them); gradients in elements, MB at %g bytes each\n", SCHED_GRAD_BYTES);
  printf("# a chunk is 1/r of the capacity (T tokens per expert, split as evenly as integers allow); r <= min(%d, T)\n",
         SCHED_R_MAX);
}

// The per-layer plan of the shown policy, then the dropless layers' buckets (fsmoe).
static void print_layer_table(const PlanOptions *o, const Plan *pl) {
  const SchedPlan *main_plan = &pl->plans[o->shown];
  int n = pl->st.n;
  bool fsmoe_shown = o->shown == IR_POLICY_FSMOE;
  printf("# per-layer plan of %s (r: pipeline degree per phase, forward/backward", ir_policy_name[o->shown]);
  if (fsmoe_shown)
    printf(";\n#   slsqp / model / sim: Algorithm 1 by SLSQP, by scanning the case model, and the simulator's\n"
           "#   own best r; used (--degree %s): %s; 'by' says which; case: of the chosen r",
           sched_choose_name[o->choose], o->choose == SCHED_CHOOSE_BEST ? "the fastest in simulation" : "as asked");
  printf(";\n#   grad moe/dense: gradient elements all-reduced inside the backward MoE / during the dense backward)\n");
  printf("%-16s %5s %5s", "layer", "r_fwd", "r_bwd");
  if (fsmoe_shown) printf(" %7s %7s %7s %-21s %5s", "slsqp", "model", "sim", "by fwd/bwd", "case");
  printf(" %9s %12s %12s %9s\n", "t_gar_ms", "grad_moe", "grad_dense", "grad_MB");
  for (int i = 0; i < n; i++) {
    const SchedLayerPlan *lp = &main_plan->layer[i];
    printf("%-16s %5d %5d", pl->layers[i].name, lp->r[0], lp->r[1]);
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
  for (int i = 0; i < n; i++) total_grad += pl->st.cost[i].n_grad;
  printf("# dense gradient %.0f elements (%.2f MB); after the backward pass: %.0f (%.2f MB); placement: %s\n",
         total_grad, total_grad * SCHED_GRAD_BYTES / 1e6, main_plan->grad_tail,
         main_plan->grad_tail * SCHED_GRAD_BYTES / 1e6,
         total_grad <= 0 ? "nothing to all-reduce" : main_plan->partition ? main_plan->partition : "-");
  if (!fsmoe_shown) return;
  for (int i = 0; i < n; i++) {
    if (!pl->layers[i].dropless) continue;
    Bucket b[NBUCKETS];
    dropless_buckets(pl, i, &main_plan->layer[i], b);
    printf("# dropless %s: capacity bucket -> r_fwd/r_bwd:", pl->layers[i].name);
    for (int j = 0; j < NBUCKETS; j++) printf("  <=%g: %d/%d", b[j].capacity, b[j].r_fwd, b[j].r_bwd);
    printf("\n");
  }
}

// Every policy's predicted step (or the shown one beside tutel and sequential) and the lower bound.
static void print_policy_table(const PlanOptions *o, const Plan *pl) {
  const SchedPlan *plans = pl->plans;
  printf("#\n%-16s %10s %10s %10s %9s %9s %9s\n", "policy", "fwd_ms", "bwd_ms", "iter_ms", "vs_tutel", "vs_seq",
         "gap_lb");
  for (int q = 0; q < IR_NPOLICIES; q++) {
    if (!o->all && q != (int)o->shown && q != IR_POLICY_TUTEL && q != IR_POLICY_SEQUENTIAL) continue;
    const SchedPlan *plan = &plans[q];
    printf("%-16s %10.3f %10.3f %10.3f %8.3fx %8.3fx %8.1f%%\n", ir_policy_name[q], plan->t_fwd, plan->t_bwd,
           plan->t_iter, plans[IR_POLICY_TUTEL].t_iter / plan->t_iter,
           plans[IR_POLICY_SEQUENTIAL].t_iter / plan->t_iter, 100 * (plan->t_iter / pl->lb - 1));
  }
  printf("# lower bound %.3f ms: busiest resource %s (compute %.3f, intra %.3f, inter %.3f ms at r = 1)\n", pl->lb,
         sched_resource_name[pl->busiest], pl->lb_total[SCHED_RES_COMPUTE], pl->lb_total[SCHED_RES_INTRA],
         pl->lb_total[SCHED_RES_INTER]);
  printf("# planned %d policies in %.3f ms\n", IR_NPOLICIES, pl->plan_s * 1e3);
}

// -v: the sequential step's time per class of work, the classes a binary's --profile measures.
static void print_classes(const Plan *pl) {
  double t[PASS_CLASSES], sum = 0;
  pass_class_times(pl->m, &pl->cluster, t);
  printf("# per class (ms a step, every op once as the sequential schedule runs them; the binary's --profile "
         "measures the same classes):");
  for (int k = 0; k < PASS_CLASSES; k++) {
    printf("%s %s %.3f", k ? "," : "", pass_class_names[k], t[k]);
    sum += t[k];
  }
  printf("; sum %.3f (sequential %.3f)\n", sum, pl->plans[IR_POLICY_SEQUENTIAL].t_iter);
}

// --svg, --trace and --json; false if one could not be written (reported).
static bool write_outputs(IrDiag *d, const PlanOptions *o, const Plan *pl) {
  const SchedPlan *main_plan = &pl->plans[o->shown];
  // The planned step as the table gives it: the layers' timeline and the time outside the layers.
  char title[384];
  double outside = pl->st.t_fwd_other + pl->st.t_bwd_other;
  snprintf(title, sizeof title, "%s on %s: %s, planned step %.3f ms = the layers' timeline %.3f ms + %.3f ms outside them "
           "(embedding, head, loss)", pl->p->model.name, pl->cluster.name, ir_policy_name[o->shown],
           main_plan->t_iter, main_plan->t_iter - outside, outside);
  bool ok = true;
  if (o->svg && !write_timeline(o->svg, &pl->st, main_plan, true, title)) ok = ir_error(d, "cannot write '%s'", o->svg);
  if (o->trace && !write_timeline(o->trace, &pl->st, main_plan, false, title))
    ok = ir_error(d, "cannot write '%s'", o->trace);
  if (o->json && !write_json(o->json, pl)) ok = ir_error(d, "cannot write '%s'", o->json);
  if (o->svg && ok) printf("# wrote %s\n", o->svg);
  if (o->trace && ok) printf("# wrote %s\n", o->trace);
  if (o->json && ok) printf("# wrote %s\n", o->json);
  return ok;
}

// moec plan --layouts: the search's ranked table, its JSON with --json; 1 when nothing fits.
static int plan_layouts(IrDiag *d, const PlanOptions *o) {
  IrSource *src = ir_source_read(d, o->input);
  FeProgram *p = src ? fe_load(d, src) : NULL;
  int status = 1;
  const char *path = o->cluster ? o->cluster : p ? p->cluster_path : NULL;
  FeCluster fc;
  CliLayouts ls = {0};
  if (p && !path)
    ir_error(d, "no cluster profile: pass --cluster C or add a 'cluster \"F\";' statement to %s", o->input);
  else if (p && fe_load_cluster(d, path, o->cluster ? (SrcLoc){0} : p->cluster_loc, &fc) &&
           cli_layout_search(d, p, &fc, &ls)) {
    cli_layouts_print(stdout, &ls, fc.name ? fc.name : "cluster");
    if (o->json && !cli_layouts_json(o->json, &ls)) ir_error(d, "cannot write '%s'", o->json);
    else if (ls.chosen < 0) cli_layout_nothing_fits(d, p, &ls);
    else status = 0;
  }
  cli_layouts_free(&ls);
  fe_program_free(p);
  ir_source_free(src);
  return status;
}

int cli_plan(int argc, char **argv) {
  IrDiag d;
  ir_diag_init(&d, stderr);
  PlanOptions o;
  int usage = parse_plan_options(argc, argv, &o);
  if (usage) return usage;
  if (o.layouts) return plan_layouts(&d, &o);
  Plan pl = {0};
  int status = 1;
  if (plan_load(&d, &o, &pl) && plan_stack(&d, &o, &pl)) {
    print_header(&o, &pl);
    print_layer_table(&o, &pl);
    print_policy_table(&o, &pl);
    if (o.verbose) print_classes(&pl);
    bool ok = write_outputs(&d, &o, &pl);
    printf(ok ? "OK\n" : "FAILED\n");
    status = ok ? 0 : 1;
  }
  plan_free(&pl);
  return status;
}
