// `moec sweep`: every policy of the scheduling model (lang/manual.md §8) over the paper's Table 4 space.
//
//   moec sweep --cluster C [--quick] [--degree RULE] [--seqlens A,B,C] [--dropless-capacity X]
//
// sweep has no program: it plans the paper's Table 4 space (1458 stacks of two identical
// generalized layers) from lang/manual.md §8's formulas (sched_layer_cost), plans and simulates each
// under every policy (cli/plan.h: the planner `moec plan` runs), and sets the average speedups
// over tutel beside the paper's Table 5. RULE picks fsmoe's pipeline degree as for `moec plan`.
// Called with main's argc/argv (argv[1] is the command); returns the exit status: 0 success,
// 1 the input has errors, 2 bad command line.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "frontend/fe.h"
#include "ir/ir.h"
#include "sched/sched.h"
#include "cli/cli.h"
#include "cli/plan.h"

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

// --seqlens A,B,C (a CliOpt check).
static bool opt_seqlens(const CliArgs *a, const char *opt, const char *value, void *dest) {
  if (parse_seqlens(value, dest)) return true;
  return cli_args_error(a, "--seqlens takes three sequence lengths, e.g. 512,1024,2048");
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

typedef struct SweepOptions {
  const char *cluster_path;
  bool quick;
  double seqlens[3];          // all 0: the cluster's Table 4 ones
  double dropless_capacity;
  SchedChoose choose;
} SweepOptions;

// Options of `moec sweep`; 0, or 2 on a usage error (already reported).
static int parse_sweep_options(int argc, char **argv, SweepOptions *o) {
  *o = (SweepOptions){.dropless_capacity = SCHED_DROPLESS_CAPACITY, .choose = SCHED_CHOOSE_BEST};
  const CliOpt opts[] = {
      {"--degree", NULL, false, &o->choose, cli_opt_degree},
      {"--cluster", NULL, false, &o->cluster_path},
      {"--quick", NULL, true, &o->quick},
      {"--seqlens", NULL, false, o->seqlens, opt_seqlens},
      {"--dropless-capacity", NULL, false, &o->dropless_capacity, cli_opt_positive},
  };
  CliArgs args = {.for_what = "'moec sweep'", .help = "moec sweep", .stray = "unknown argument", .opts = opts,
                  .nopts = sizeof opts / sizeof opts[0]};
  if (!cli_parse_args(&args, argc, argv)) return 2;
  if (!o->cluster_path) {
    fprintf(stderr, "moec: error: moec sweep needs --cluster C (e.g. lang/clusters/testbed-a.cluster)\n");
    return 2;
  }
  return 0;
}

static void print_sweep_header(const SweepOptions *o, const SchedCluster *c) {
  int gpn = c->gpus_per_node, world = c->nodes * c->gpus_per_node;
  printf("# moec sweep: Table 4 of the FSMoE paper, each case a stack of 2 identical generalized layers,\n"
         "#   forward + backward, every policy planned and simulated\n");
  printf("# cluster %s (%s): %d nodes x %d GPUs; mp = esp = %d, ep = dp = experts = %d (P = %d)\n", c->name,
         o->cluster_path, c->nodes, gpn, gpn, c->nodes, world);
  printf("# B {1,2,4}, heads {8,16,32}, L {%g,%g,%g}, M {1024,2048,4096}, H = hscale*M {2,3,4}, "
         "f {1.2, 2.4, *}, ffn {gpt, mixtral}\n",
         o->seqlens[0], o->seqlens[1], o->seqlens[2]);
  printf("# f = * (dropless) is modelled as top-2 at capacity %.2f: f = %.2f\n", o->dropless_capacity,
         2 * o->dropless_capacity);
  printf("# fsmoe's degree: %s\n", o->choose == SCHED_CHOOSE_BEST ? "the fastest in simulation of SLSQP's, the model's "
                                                                     "and the simulator's answers"
                                    : o->choose == SCHED_CHOOSE_SLSQP ? "Algorithm 1 with SLSQP (the paper's method)"
                                    : o->choose == SCHED_CHOOSE_MODEL ? "the case model's integer optimum"
                                                                      : "the simulator's own best r");
  printf("# iteration times in ms; speedup = tutel / fsmoe; r_b: backward degree of layer 1 / layer 0\n");
  if (!o->quick)
    printf("%5s %2s %5s %5s %5s %2s %4s %-7s %3s %5s %10s %10s %10s %10s %10s %10s %8s\n", "case", "B", "heads", "L",
           "M", "hs", "f", "ffn", "r_f", "r_b", "sequential", "tutel", "tutel-imp", "lina", "no-iio", "fsmoe",
           "speedup");
}

// What the sweep adds up over the cases.
typedef struct SweepTotals {
  double sum_speedup[IR_NPOLICIES], sum_vs_seq[IR_NPOLICIES];
  int wins[IR_NPOLICIES];
  int rdiff;              // cases where fsmoe's r_fwd != r_bwd in some layer
  int ncases, nexc;
  char (*exc)[400];       // [nexc]: the cases fsmoe is not the fastest on, with why
} SweepTotals;

// Plans and simulates Table 4 case `id` under every policy, adds it to the totals and (without
// --quick) prints its row. False when the planner failed (an internal error).
static bool sweep_case(int id, const SweepOptions *o, const SchedCluster *cluster, SweepTotals *t) {
  SchedTable4Case tc;
  SchedLayerSpec spec;
  sched_table4_case(id, cluster, o->seqlens, o->dropless_capacity, &tc, &spec);
  SchedLayerCost cost[2];
  sched_layer_cost(&spec, cluster, &cost[0]);
  cost[1] = cost[0];
  int rm[2] = {spec.r_max, spec.r_max};
  SchedStack st = {2, cost, rm, o->choose};
  SchedPlan plans[IR_NPOLICIES];
  if (!cli_plan_all(&st, plans)) {
    cli_plans_free(plans);
    return false;
  }
  const SchedPlan *f = &plans[IR_POLICY_FSMOE];
  double tt = plans[IR_POLICY_TUTEL].t_iter, ts = plans[IR_POLICY_SEQUENTIAL].t_iter;
  int fastest = 0;   // ties (within rounding) go to the lower policy index, fsmoe first
  for (int q = 0; q < IR_NPOLICIES; q++) {
    t->sum_speedup[q] += tt / plans[q].t_iter;
    t->sum_vs_seq[q] += ts / plans[q].t_iter;
    if (plans[q].t_iter < plans[fastest].t_iter * (1 - 1e-9)) fastest = q;
  }
  t->wins[fastest]++;
  bool differ = false;
  for (int i = 0; i < 2; i++) differ |= f->layer[i].r[SCHED_FWD] != f->layer[i].r[SCHED_BWD];
  t->rdiff += differ;
  if (fastest != IR_POLICY_FSMOE) {
    char why[300];
    explain(f, &plans[fastest], why, sizeof why);
    snprintf(t->exc[t->nexc++], sizeof t->exc[0], "%5d %-14s %6.2f%% faster: %s", id, ir_policy_name[fastest],
             100 * (f->t_iter / plans[fastest].t_iter - 1), why);
  }
  if (!o->quick) {
    char rb[16];
    snprintf(rb, sizeof rb, "%d/%d", f->layer[1].r[SCHED_BWD], f->layer[0].r[SCHED_BWD]);
    printf("%5d %2g %5d %5g %5g %2g %4s %-7s %3d %5s %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f %7.3fx\n", id,
           tc.batch, tc.heads, tc.seqlen, tc.embed, tc.hscale, tc.dropless ? "*" : tc.f < 2 ? "1.2" : "2.4",
           tc.ffn == SCHED_FFN_MIXTRAL ? "mixtral" : tc.ffn == SCHED_FFN_OSS ? "oss" : "gpt", f->layer[0].r[SCHED_FWD], rb, ts, tt,
           plans[IR_POLICY_TUTEL_IMPROVED].t_iter, plans[IR_POLICY_PIPEMOE_LINA].t_iter,
           plans[IR_POLICY_FSMOE_NO_IIO].t_iter, f->t_iter, tt / f->t_iter);
  }
  cli_plans_free(plans);
  t->ncases++;
  return true;
}

// The averages beside the paper's Table 5, and the cases fsmoe did not win.
static void print_sweep_summary(const SweepTotals *t, int testbed, double elapsed) {
  printf("#\n# average speedup over tutel, %d cases (paper: Table 5, %s)\n", t->ncases,
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
    printf("%-16s %8.3fx %9s %9d %11.3fx\n", ir_policy_name[q], t->sum_speedup[q] / t->ncases, paper, t->wins[q],
           t->sum_vs_seq[q] / t->ncases);
  }
  printf("# fsmoe cases with r_fwd != r_bwd in some layer: %d of %d (paper: 912 of 1458)\n", t->rdiff, t->ncases);
  printf("# cases where fsmoe is not the fastest policy: %d\n", t->nexc);
  for (int i = 0; i < t->nexc; i++) printf("#   %s\n", t->exc[i]);
  printf("# %d cases x %d policies planned and simulated in %.2f s\n", t->ncases, IR_NPOLICIES, elapsed);
  printf("OK\n");
}

int cli_sweep(int argc, char **argv) {
  SweepOptions o;
  int usage = parse_sweep_options(argc, argv, &o);
  if (usage) return usage;
  IrDiag d;
  ir_diag_init(&d, stderr);
  FeCluster fc;
  if (!fe_load_cluster(&d, o.cluster_path, (SrcLoc){0}, &fc)) return 1;
  SchedCluster cluster;
  cli_cluster_from_fe(&fc, &cluster);
  int testbed = strncmp(cluster.name, "testbed_a", 9) == 0 ? 'a' : strncmp(cluster.name, "testbed_b", 9) == 0 ? 'b' : 0;
  if (o.seqlens[0] == 0) sched_table4_seqlens(&cluster, o.seqlens);
  print_sweep_header(&o, &cluster);

  SweepTotals t = {.exc = calloc(SCHED_TABLE4_CASES, sizeof *t.exc)};
  if (!t.exc) return 1;
  bool progress = isatty(STDOUT_FILENO) && isatty(STDERR_FILENO);
  bool ok = true;
  double t0 = cli_now_s();
  for (int id = 0; id < SCHED_TABLE4_CASES && ok; id++) {
    ok = sweep_case(id, &o, &cluster, &t);
    if (ok && progress && (t.ncases % 18 == 0 || t.ncases == SCHED_TABLE4_CASES)) {
      int w = 40, filled = t.ncases * w / SCHED_TABLE4_CASES;
      fprintf(stderr, "\r[%.*s%*s] %4d/%d", filled, "========================================", w - filled, "",
              t.ncases, SCHED_TABLE4_CASES);
      if (t.ncases == SCHED_TABLE4_CASES) fputc('\n', stderr);
    }
  }
  double elapsed = cli_now_s() - t0;
  if (ok) print_sweep_summary(&t, testbed, elapsed);
  else {
    ir_error(&d, "planning failed (an internal error)");
    printf("FAILED\n");
  }
  free(t.exc);
  return ok ? 0 : 1;
}
