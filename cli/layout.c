// The layout search of `parallel auto;` and `moec plan --layouts` (lang/manual.md §6).
//
// For a cluster of P = nodes x gpus_per_node ranks the candidates are every (dp, mp, ep, esp)
// with dp*mp = ep*esp = P, mp and esp dividing gpus_per_node (their groups are consecutive
// ranks inside a node), times the AlltoAll algorithms where they differ (nccl, 1dh, 2dh: only
// when an EP group has several ranks on each of several nodes; layers that name their
// `dispatch { algo ...; }` keep it). Each candidate is
//   refused   when the model's rules that read the layout break (fe_layout_refusal) or its
//             lowering or a pass refuses it: the sentence says which;
//   priced    by the build's own passes: lowered for that layout (fe_lower), run through the
//             pass pipeline with the cluster profile, its MoE stack (pass_stack) planned for the
//             model's policy (sched_plan, as the pipeline pass plans it): the simulated step;
//             and the memory plan's peak per rank (activations arena + parameters + gradients
//             + optimizer state, as `moec build -v` prints it);
//   fits      when that peak is within the cluster's `memory` (no `memory`: every priced one).
// chosen: the fastest that fits; a tie (within 1e-9 relative) goes to fewer collectives (fewer
// groups of more than one rank, then the flat AlltoAll).
//
// Layers written `x N` repeat one block. Lowering and planning a 64-layer program per
// candidate would take seconds, so a group of more than 3 repeats is lowered with 3 (its first,
// one inner and its last instance) and once more with 4: the inner instance's costs fill the
// stack up to N layers (the planner plans all N), and the time outside the stack and the peak
// grow by the difference between 4 and 3 for every repeat beyond 3. For a regular stack this is
// what lowering all N gives for the time; the peak can be off by a few hundred bytes (the
// arena's packing), so the chosen layout's peak is the whole program's (tests/layout_search.sh
// holds both against `moec build`).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "cli/plan.h"
#include "ir/ir.h"
#include "passes/pass.h"

enum { BASE_REPEATS = 3 };

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// ---- one lowering, priced ----

// What one lowering of the program gives: its stack (costs copied) and the layer group of
// each stack layer, the time outside the stack, and the memory plan's peak.
typedef struct Eval {
  int n;
  SchedLayerCost *cost;
  int *r_max;
  int *group, *instance;   // the FeLayer index and the repeat index of stack layer i
  double t_fwd_other, t_bwd_other;
  double peak, act;   // the memory plan's peak per rank, and its activations' part
} Eval;

static void eval_free(Eval *e) {
  free(e->cost);
  free(e->r_max);
  free(e->group);
  free(e->instance);
  *e = (Eval){0};
}

// The layer item of p and the repeat that forward function f lowers (its attributes `item` and
// `repeat`, frontend/lower_ops.c fe_layer_func).
static bool layer_of(const FeProgram *p, const IrFunc *f, int *group, int *instance) {
  int64_t item = ir_func_int(f, "item", -1), repeat = ir_func_int(f, "repeat", -1);
  if (item < 0 || item >= p->nlayers || repeat < 0 || repeat >= p->layers[item].repeat) return false;
  *group = (int)item, *instance = (int)repeat;
  return true;
}

// The first error's sentence of a diagnostics text ("F:1:2: error: SENTENCE\n...").
static void first_error(const char *text, char *why, size_t n) {
  const char *e = text ? strstr(text, "error: ") : NULL;
  if (!e) {
    snprintf(why, n, "refused by the compiler");
    return;
  }
  e += 7;
  size_t len = strcspn(e, "\n");
  snprintf(why, n, "%.*s", (int)len, e);
}

// What the pipeline hands the layout search after the `cost` pass: the priced stack, copied.
typedef struct Grab {
  const FeProgram *p;
  const SchedCluster *sc;
  Eval *out;
} Grab;

static bool grab_stack(IrModule *m, const char *pass, void *arg) {
  if (strcmp(pass, "cost") != 0) return true;
  Grab *g = arg;
  Eval *out = g->out;
  PassStack s;
  if (!pass_stack(m, g->sc, &s)) return false;
  out->n = s.n;
  size_t n = (size_t)(s.n > 0 ? s.n : 1);
  out->cost = malloc(n * sizeof *out->cost);
  out->r_max = malloc(n * sizeof *out->r_max);
  out->group = malloc(n * sizeof *out->group);
  out->instance = malloc(n * sizeof *out->instance);
  bool ok = out->cost && out->r_max && out->group && out->instance;
  for (int k = 0; ok && k < s.n; k++) {
    out->cost[k] = s.cost[k];
    out->r_max[k] = s.r_max[k];
    ok = layer_of(g->p, s.layer[k].fwd, &out->group[k], &out->instance[k]);
  }
  out->t_fwd_other = s.t_fwd_other, out->t_bwd_other = s.t_bwd_other;
  pass_stack_free(&s);
  return ok;
}

// Lowers p as it stands (its layout, repeats and algorithms) and runs the build's pass pipeline
// (with its verifier) with the cluster profile: false with why when the compiler refuses it.
static bool eval_program(const FeProgram *p, const FeCluster *fc, const SchedCluster *sc, Eval *out, char *why,
                         size_t nwhy) {
  *out = (Eval){0};
  char *text = NULL;
  size_t len = 0;
  FILE *log = open_memstream(&text, &len);
  if (!log) {
    snprintf(why, nwhy, "out of memory");
    return false;
  }
  IrDiag d;
  ir_diag_init(&d, log);
  d.max_errors = 1;
  IrModule *m = fe_lower(&d, p, NULL);
  bool ok = m != NULL;
  if (ok && p->parallel.dp * p->parallel.mp > 1) {
    ir_attrs_set_int(m->attrs, &m->nattrs, "gpus_per_node", fc->gpus_per_node);
    ir_attrs_set_int(m->attrs, &m->nattrs, "nodes", fc->nodes);
  }
  Grab grab = {.p = p, .sc = sc, .out = out};
  PassCtx ctx = {.d = &d, .log = log, .cluster = sc, .fuse = true, .fuse_cpu = true,   // the CPU build's plan
                 .after_pass = grab_stack, .after_arg = &grab};
  ok = ok && pass_run_pipeline(m, &ctx) && d.errors == 0;
  if (ok && ctx.memplan) {
    const PassMemPlan *mp = ctx.memplan;
    out->peak = (double)pass_mem_peak(mp);
    out->act = (double)mp->arena_bytes;
  }
  pass_ctx_free(&ctx);
  ir_module_free(m);
  fclose(log);
  if (!ok) {
    first_error(text, why, nwhy);
    eval_free(out);
  }
  free(text);
  return ok;
}

// ---- one candidate ----

typedef struct Search {
  FeProgram *p;
  const FeCluster *fc;
  SchedCluster sc;
  IrPolicy policy;
  int r_fix[2];
  bool algo_fixed;   // some layer names its dispatch algorithm: the search keeps every layer's
  double best_fit;   // the fastest step of a layout that fits so far (the stages' candidates come after)
} Search;

// A candidate of several stages or microbatches (its layout set on the program): its pipeline as
// cli_pipe_estimate prices it from one lowering of the whole model (cli/stages.c): the split of
// the layers, the stages' schedule simulated with their microbatches and messages, the update; the peak
// the largest stage's, with its microbatches in flight.
static void price_pipeline(Search *s, CliLayout *l) {
  CliPipeEstimate e;
  if (!cli_pipe_estimate(s->p, s->fc, &s->sc, &e, l->why, sizeof l->why)) return;
  l->step_ms = e.plan.t_step;
  l->peak_bytes = (int64_t)llround(e.peak);
  l->act_bytes = (int64_t)llround(e.act);
  size_t u = 0;
  l->split[0] = '\0';
  for (int k = 0; l->pp > 1 && k < l->pp && u < sizeof l->split; k++)
    u += (size_t)snprintf(l->split + u, sizeof l->split - u, "%s%lld", k ? " " : "", (long long)e.counts[k]);
}

// Prices the candidate l (its layout set on the program): step_ms and peak_bytes, or why not.
static void price(Search *s, CliLayout *l) {
  if (l->pp > 1 || l->microbatches > 1) {
    price_pipeline(s, l);
    return;
  }
  FeProgram *p = s->p;
  int n = p->nlayers;
  int64_t *repeat = malloc((size_t)n * sizeof *repeat);
  Eval base = {0}, *more = calloc((size_t)n, sizeof *more);
  SchedLayerCost *cost = NULL;
  int *r_max = NULL;
  if (!repeat || !more) {
    snprintf(l->why, sizeof l->why, "out of memory");
    goto done;
  }
  for (int i = 0; i < n; i++) {
    repeat[i] = p->layers[i].repeat;
    if (repeat[i] > BASE_REPEATS) p->layers[i].repeat = BASE_REPEATS;
  }
  if (!eval_program(p, s->fc, &s->sc, &base, l->why, sizeof l->why)) goto done;
  double t_fwd = base.t_fwd_other, t_bwd = base.t_bwd_other, peak = base.peak, act = base.act;
  int total = 0;
  for (int i = 0; i < n; i++) {
    if (repeat[i] <= BASE_REPEATS) continue;
    p->layers[i].repeat = BASE_REPEATS + 1;
    bool ok = eval_program(p, s->fc, &s->sc, &more[i], l->why, sizeof l->why);
    p->layers[i].repeat = BASE_REPEATS;
    if (!ok) goto done;
    double extra = (double)(repeat[i] - BASE_REPEATS);
    t_fwd += extra * (more[i].t_fwd_other - base.t_fwd_other);
    t_bwd += extra * (more[i].t_bwd_other - base.t_bwd_other);
    peak += extra * (more[i].peak - base.peak);
    act += extra * (more[i].act - base.act);
  }
  // The whole stack: a long group's inner instance (repeat index 1) stands for all its inner ones.
  for (int k = 0; k < base.n; k++) {
    int g = base.group[k];
    total += repeat[g] > BASE_REPEATS && base.instance[k] == 1 ? (int)(repeat[g] - 2) : 1;
  }
  cost = malloc((size_t)(total > 0 ? total : 1) * sizeof *cost);
  r_max = malloc((size_t)(total > 0 ? total : 1) * sizeof *r_max);
  if (!cost || !r_max) {
    snprintf(l->why, sizeof l->why, "out of memory");
    goto done;
  }
  int at = 0;
  for (int k = 0; k < base.n; k++) {
    int g = base.group[k];
    int copies = repeat[g] > BASE_REPEATS && base.instance[k] == 1 ? (int)(repeat[g] - 2) : 1;
    for (int c = 0; c < copies; c++) cost[at] = base.cost[k], r_max[at] = base.r_max[k], at++;
  }
  l->peak_bytes = (int64_t)llround(peak);
  l->act_bytes = (int64_t)llround(act);
  if (total == 0) {   // no MoE layer: the step is the time outside a stack
    l->step_ms = t_fwd + t_bwd;
  } else {
    SchedStack st = {.n = total, .cost = cost, .r_max = r_max, .choose = SCHED_CHOOSE_BEST, .t_fwd_other = t_fwd,
                     .t_bwd_other = t_bwd, .slow_compute = s->sc.overlap_compute, .slow_comm = s->sc.overlap_comm,
                     .r_fix = {s->r_fix[0], s->r_fix[1]}};
    SchedPlan plan = {0};
    if (sched_plan(&st, s->policy, &plan)) l->step_ms = plan.t_iter;
    else snprintf(l->why, sizeof l->why, "the planner failed (an internal error)");
    sched_plan_free(&plan);
  }
done:
  for (int i = 0; i < n; i++) {
    if (repeat) p->layers[i].repeat = repeat[i];
    if (more) eval_free(&more[i]);
  }
  eval_free(&base);
  free(more);
  free(repeat);
  free(cost);
  free(r_max);
}

int64_t cli_global_batch(const FeProgram *p) { return p->model.batch * (p->parallel.is_auto ? 1 : p->parallel.dp); }

void cli_layout_apply(FeProgram *p, const CliLayout *l, int64_t global) {
  p->parallel.dp = l->dp, p->parallel.mp = l->mp, p->parallel.ep = l->ep, p->parallel.esp = l->esp;
  if (l->pp > 0) p->parallel.pp = l->pp, p->parallel.npp_layers = 0;
  if (l->microbatches > 0) p->parallel.microbatches = l->microbatches;
  if (!p->parallel.pp_schedule) p->parallel.pp_schedule = "1f1b";
  p->model.batch = global / l->dp;
  for (int i = 0; i < p->nlayers && l->algo; i++) {
    FeMoe *moe = &p->layers[i].moe;
    if (p->layers[i].has_moe && !moe->algo_loc.src) moe->algo = l->algo;
  }
}

// Whether moec build may shard the optimizer to fit the memory (one of its memory choices): adamw,
// not asked for already, several ranks.
static bool shardable(const FeProgram *p) {
  return strcmp(p->model.optimizer.name, "adamw") == 0 && !p->model.optimizer.shard && p->parallel.dp * p->parallel.mp > 1;
}

// The model's own memory settings, while a layout is priced with moec build's choices on top.
typedef struct Written {
  bool shard;
  const char *recompute;
  bool vocab_parallel;
} Written;

static Written with_choices(FeProgram *p, bool shard, const char *recompute, bool vocab_parallel) {
  Written w = {p->model.optimizer.shard, p->model.recompute, p->model.vocab_parallel};
  p->model.optimizer.shard = w.shard || shard;
  if (recompute) p->model.recompute = recompute;
  p->model.vocab_parallel = w.vocab_parallel || vocab_parallel;
  return w;
}

// Whether moec build may split a language model's vocabulary over the mp ranks of layout c to fit
// (its last memory choice, the one that changes the order of float sums).
static bool vocab_splittable(const FeProgram *p, const CliLayout *c) {
  return p->model.has_vocab && !p->model.vocab_parallel && !c->vocab_parallel && c->mp > 1 && p->model.vocab % c->mp == 0;
}

// The recomputation moec build would try next on a layout priced with `recompute` (NULL: none
// chosen yet) for the model that writes `written`: norms, then layers; NULL when none is left.
static const char *next_recompute(const char *written, const char *recompute) {
  static const char *const levels[] = {"none", "activations", "norms", "layers"};
  int have = 0;
  for (int i = 0; i < 4; i++)
    if (strcmp(recompute ? recompute : written ? written : "none", levels[i]) == 0) have = i;
  return have < 2 ? "norms" : have < 3 ? "layers" : NULL;
}

static void restore_choices(FeProgram *p, Written w) {
  p->model.optimizer.shard = w.shard;
  p->model.recompute = w.recompute;
  p->model.vocab_parallel = w.vocab_parallel;
}

// c priced again with the sharded optimizer, the recomputation and the vocabulary split as asked
// (and c's own): kept, with the choices marked, when the compiler prices it.
static void price_with(Search *s, CliLayout *c, bool shard, const char *recompute, bool vocab_parallel) {
  CliLayout again = *c;
  Written w = with_choices(s->p, shard || c->shard, recompute ? recompute : c->recompute, vocab_parallel || c->vocab_parallel);
  price(s, &again);
  restore_choices(s->p, w);
  if (again.step_ms < 0) return;
  *c = again;
  c->shard |= shard;
  if (recompute) c->recompute = recompute;
  c->vocab_parallel |= vocab_parallel;
}

// ", with ..." of a layout priced with moec build's memory choices ("A", "A and B", "A, B and C");
// "" without.
static const char *choices_text(const CliLayout *l) {
  static char text[128], rc[32];
  const char *part[3];
  int n = 0;
  if (l->shard) part[n++] = "the sharded optimizer";
  if (l->recompute) snprintf(rc, sizeof rc, "recompute %s", l->recompute), part[n++] = rc;
  if (l->vocab_parallel) part[n++] = "the vocabulary split over MP";
  text[0] = '\0';
  for (int k = 0; k < n; k++)
    snprintf(text + strlen(text), sizeof text - strlen(text), "%s%s", k == 0 ? " with " : k == n - 1 ? " and " : ", ", part[k]);
  return text;
}

// Collectives a layout runs: groups of more than one rank, then a hierarchical AlltoAll.
static int collectives(const CliLayout *l) {
  return (l->dp > 1) + (l->mp > 1) + (l->ep > 1) + (l->esp > 1);
}

static int algo_rank(const char *algo) {
  return !algo || strcmp(algo, "nccl") == 0 ? 0 : strcmp(algo, "2dh") == 0 ? 1 : 2;
}

// Fitting first by step (ties: fewer collectives, the flat AlltoAll), then priced ones that do
// not fit by step, then the refused in enumeration order.
static int rank_of(const CliLayout *l) { return l->fits ? 0 : l->step_ms >= 0 ? 1 : 2; }

static int by_rank(const void *a, const void *b) {
  const CliLayout *x = a, *y = b;
  int rx = rank_of(x), ry = rank_of(y);
  if (rx != ry) return rx - ry;
  if (rx == 2) return x->order - y->order;
  double tol = 1e-9 * fmax(fabs(x->step_ms), fabs(y->step_ms));
  if (fabs(x->step_ms - y->step_ms) > tol) return x->step_ms < y->step_ms ? -1 : 1;
  if (collectives(x) != collectives(y)) return collectives(x) - collectives(y);
  if (algo_rank(x->algo) != algo_rank(y->algo)) return algo_rank(x->algo) - algo_rank(y->algo);
  if (x->pp != y->pp) return x->pp - y->pp;   // then the fewer stages and microbatches
  if (x->microbatches != y->microbatches) return x->microbatches - y->microbatches;
  return x->order - y->order;
}

static int push(CliLayouts *out, int *cap, CliLayout l) {
  if (out->n == *cap) {
    int ncap = *cap ? 2 * *cap : 16;
    CliLayout *a = realloc(out->all, (size_t)ncap * sizeof *a);
    if (!a) return -1;
    out->all = a, *cap = ncap;
  }
  l.order = out->n;
  out->all[out->n++] = l;
  return 0;
}

// What moec build would do to fit the memory (cli/build.c), priced on candidate c (its layout set on
// the program): the sharded optimizer, then recomputation (norms, then layers: all of them, where
// the build recomputes the fewest that fit), then the vocabulary split over MP.
static void fit_choices(Search *s, CliLayout *c) {
  FeProgram *p = s->p;
  int64_t memory = s->fc->memory;
  if (shardable(p)) price_with(s, c, true, NULL, false);
  c->fits = c->peak_bytes <= memory;
  for (const char *r; !c->fits && (r = next_recompute(p->model.recompute, c->recompute));) {
    const char *had = c->recompute;
    price_with(s, c, false, r, false);
    c->fits = c->peak_bytes <= memory;
    if (c->recompute == had) break;   // not priced
  }
  if (!c->fits && vocab_splittable(p, c)) price_with(s, c, false, NULL, true);
  c->fits = c->peak_bytes <= memory;
}

// Why legal candidate c does not fit (more: what was not tried, "" when everything was).
static void over_memory(const Search *s, CliLayout *c, const char *more) {
  char need[32], have[32];
  snprintf(c->why, sizeof c->why, "peak %s per rank is more than the cluster's memory %s%s",
           cli_bytes(need, sizeof need, (double)c->peak_bytes), cli_bytes(have, sizeof have, (double)s->fc->memory), more);
}

// Candidate c (its layout not refused) priced, with the memory choices where it does not fit and
// `choices` (the candidates of several stages get them afterwards, stage_choices). *plain: its step
// without them (-1: not priced).
static void consider(Search *s, CliLayout *c, int64_t global, const char **algos, bool choices, double *plain) {
  FeProgram *p = s->p;
  cli_layout_apply(p, c, global);
  price(s, c);
  *plain = c->step_ms;
  c->legal = c->step_ms >= 0;
  c->fits = c->legal && (s->fc->memory <= 0 || c->peak_bytes <= s->fc->memory);
  if (choices && c->legal && !c->fits) fit_choices(s, c);
  for (int i = 0; i < p->nlayers; i++) p->layers[i].moe.algo = algos[i];
  if (c->fits && c->step_ms < s->best_fit) s->best_fit = c->step_ms;
  if (c->legal && !c->fits) over_memory(s, c, choices ? "" : " (not priced with the memory choices)");
}

// The memory choices for the candidates of several stages [from, n) that do not fit: they only slow
// a step down, so they are priced for the STAGE_CHOICES fastest of them only, and not for one already
// slower than a layout that fits (the search of a 2,048-rank model would otherwise price hundreds of
// candidates several times each).
enum { STAGE_CHOICES = 2 };
static void stage_choices(Search *s, CliLayouts *out, int from, int64_t global, const char **algos) {
  for (int done = 0; done < STAGE_CHOICES; done++) {
    CliLayout *c = NULL;
    for (int k = from; k < out->n; k++) {
      CliLayout *x = &out->all[k];
      if (x->legal && !x->fits && !x->shard && !x->recompute && !x->vocab_parallel && strstr(x->why, "not priced") &&
          x->step_ms < s->best_fit && (!c || x->step_ms < c->step_ms))
        c = x;
    }
    if (!c) return;
    cli_layout_apply(s->p, c, global);
    fit_choices(s, c);
    for (int i = 0; i < s->p->nlayers; i++) s->p->layers[i].moe.algo = algos[i];
    if (c->fits && c->step_ms < s->best_fit) s->best_fit = c->step_ms;
    if (c->fits) c->why[0] = '\0';
    else over_memory(s, c, "");
  }
}

// Whether layout l (its stages and microbatches) breaks a rule of the model: the layout's rules at
// a microbatch's batch (per_dp / microbatches samples), and `aux pooled` on one stage only.
static bool refusal(FeProgram *p, const CliLayout *l, int64_t per_dp, char *why, size_t n) {
  FeParallel par = {.dp = l->dp, .mp = l->mp, .ep = l->ep, .esp = l->esp, .pp = l->pp > 1 ? l->pp : 1};
  int64_t batch = p->model.batch;
  p->model.batch = per_dp / l->microbatches;
  bool refused = fe_layout_refusal(p, &par, why, n);
  p->model.batch = batch;
  for (int i = 0; !refused && l->pp > 1 && i < p->nlayers; i++) {
    const char *form = p->layers[i].has_moe ? p->layers[i].moe.gate.aux_form : NULL;
    if (form && strcmp(form, "pooled") == 0)
      refused = true, snprintf(why, n, "layer %s: 'aux pooled' sums every layer's routing at once: pp 1 only", p->layers[i].name);
  }
  return refused;
}

// Candidate l with microbatches M (or its refusal, listed for M = 1 only) and AlltoAll algorithm a
// pushed; *plain its step without memory choices (-1: refused or not priced). False when out of memory.
static bool one_candidate(Search *s, CliLayouts *out, int *cap, CliLayout l, int64_t M, int a, int64_t per_dp,
                          int64_t global, const char **algos, CliLayout *got, double *plain) {
  l.microbatches = (int)M;
  l.algo = s->algo_fixed ? NULL : sched_a2a_name[a];
  *plain = -1;
  bool refused = refusal(s->p, &l, per_dp, l.why, sizeof l.why);
  if (refused && M > 1) return *got = l, true;   // the table lists a layout's refusal once
  if (!refused) consider(s, &l, global, algos, l.pp <= 1, plain);
  *got = l;
  return push(out, cap, l) == 0;
}

// The candidates of pp stages of `ranks` ranks with mp and esp, times the AlltoAll algorithms where
// they differ (nccl, 1dh, 2dh: only when an EP group has several ranks on each of several nodes;
// layers that name their own keep it) and microbatch counts M that divide a DP rank's samples. On one
// stage M ascends only as far as it takes to fit (more microbatches only add their fixed costs, and
// do nothing where the parameters alone are over the memory). On several the M that shape the bubble,
// P, 2P and 4P (or, where none divides, one microbatch per sample), on the flat AlltoAll until the
// step grows again (the bubble shrinks with M, each microbatch's fixed costs add up), the other
// algorithms at the fastest M. False when out of memory.
static bool candidates(Search *s, CliLayouts *out, int *cap, int pp, int ranks, int mp, int esp, int64_t global,
                       const char **algos) {
  CliLayout l = {.dp = ranks / mp, .mp = mp, .ep = ranks / esp, .esp = esp, .pp = pp, .microbatches = 1,
                 .step_ms = -1, .peak_bytes = -1}, c;
  if (global % l.dp != 0) {   // the global batch is the model's in every layout
    snprintf(l.why, sizeof l.why, "dp %d does not divide the global batch of %lld samples", l.dp, (long long)global);
    return push(out, cap, l) == 0;
  }
  int64_t per_dp = global / l.dp;
  SchedGroup ep = sched_group_of(l.ep, esp, (int)s->fc->gpus_per_node);
  int nalgo = !s->algo_fixed && ep.nodes > 1 && ep.per_node > 1 ? 3 : 1;
  double plain;
  if (pp == 1) {
    for (int64_t M = 1; M <= per_dp; M++) {
      if (per_dp % M != 0) continue;
      bool fits = false, legal = false, params_over = false;
      for (int a = 0; a < nalgo; a++) {
        if (!one_candidate(s, out, cap, l, M, a, per_dp, global, algos, &c, &plain)) return false;
        fits |= c.fits, legal |= c.legal;
        params_over |= c.legal && s->fc->memory > 0 && c.peak_bytes - c.act_bytes > s->fc->memory;
      }
      if (fits || !legal || params_over) break;
    }
    return true;
  }
  // (M = 1 leaves P - 1 of every P stage-times idle; it is tried only where no M of those divides.)
  int64_t tries[4] = {pp, 2 * (int64_t)pp, 4 * (int64_t)pp, per_dp}, best_m = 0;
  bool any = false;
  for (int k = 0; k < 3; k++) any |= tries[k] <= per_dp && per_dp % tries[k] == 0;
  double best = INFINITY, before = INFINITY;
  for (int k = any ? 0 : 3; k < 4; k++) {
    int64_t M = tries[k];
    if (M > per_dp || per_dp % M != 0 || (k == 3 && any)) continue;
    if (!one_candidate(s, out, cap, l, M, 0, per_dp, global, algos, &c, &plain)) return false;
    if (plain < 0) break;   // refused or not priced: so is every M
    if (plain < best) best = plain, best_m = M;
    if (plain > before) break;
    before = plain;
  }
  for (int a = 1; a < nalgo && best_m > 0; a++)
    if (!one_candidate(s, out, cap, l, best_m, a, per_dp, global, algos, &c, &plain)) return false;
  return true;
}

bool cli_layout_search(IrDiag *d, FeProgram *p, const FeCluster *fc, CliLayouts *out) {
  *out = (CliLayouts){.chosen = -1, .memory = fc->memory};
  double t0 = now_s();
  Search s = {.p = p, .fc = fc, .best_fit = INFINITY};
  cli_cluster_from_fe(fc, &s.sc);
  if (!ir_policy_parse(p->schedule.policy ? p->schedule.policy : "sequential", &s.policy))
    return ir_error(d, "unknown policy '%s'", p->schedule.policy);
  out->policy = ir_policy_name[s.policy];
  if (!p->schedule.pipeline_auto) s.r_fix[0] = (int)p->schedule.pipeline_fwd, s.r_fix[1] = (int)p->schedule.pipeline_bwd;
  for (int i = 0; i < p->nlayers; i++) s.algo_fixed |= p->layers[i].has_moe && p->layers[i].moe.algo_loc.src;
  FeParallel saved = p->parallel;
  int64_t global = cli_global_batch(p), batch = p->model.batch, instances = 0;
  out->global_batch = global;
  const char **algos = calloc((size_t)(p->nlayers > 0 ? p->nlayers : 1), sizeof *algos);
  if (!algos) return ir_error(d, "out of memory");
  for (int i = 0; i < p->nlayers; i++) algos[i] = p->layers[i].moe.algo, instances += p->layers[i].repeat;
  int G = (int)fc->gpus_per_node, P = (int)(fc->nodes * fc->gpus_per_node), cap = 0;
  bool ok = true;
  // pp stages of P / pp ranks each (at least one layer a stage); in a stage, dp*mp = ep*esp with
  // mp and esp dividing gpus_per_node.
  for (int pp = 1; ok && pp <= P && pp <= instances && pp <= FE_MAX_STAGES; pp++) {
    if (P % pp != 0) continue;
    int R = P / pp;
    int from = out->n;
    for (int mp = 1; ok && mp <= G; mp++)
      for (int esp = 1; ok && esp <= G && G % mp == 0 && R % mp == 0; esp++)
        if (G % esp == 0 && R % esp == 0) ok = candidates(&s, out, &cap, pp, R, mp, esp, global, algos);
    if (ok && pp > 1 && fc->memory > 0) stage_choices(&s, out, from, global, algos);
  }
  if (ok) qsort(out->all, (size_t)out->n, sizeof *out->all, by_rank);
  // The peak of a long stack grown from 3 and 4 copies is close to the whole program's, not
  // always equal to it (the arena's packing of the fused program's buffers is not linear in the
  // copies to the byte): the chosen layout's is the whole program's, and the next fitting one
  // is chosen when it does not fit.
  bool long_stack = false;
  for (int i = 0; i < p->nlayers; i++) long_stack |= p->layers[i].repeat > BASE_REPEATS;
  for (int k = 0; ok && k < out->n && out->chosen < 0; k++) {
    CliLayout *c = &out->all[k];
    if (!c->fits) continue;
    if (long_stack && c->pp <= 1) {   // (several stages: the estimate is all there is before their builds)
      Eval whole = {0};
      cli_layout_apply(p, c, global);
      Written w = with_choices(p, c->shard, c->recompute, c->vocab_parallel);
      bool priced = eval_program(p, fc, &s.sc, &whole, c->why, sizeof c->why);
      restore_choices(p, w);
      for (int i = 0; i < p->nlayers; i++) p->layers[i].moe.algo = algos[i];
      if (priced) c->peak_bytes = (int64_t)llround(whole.peak), c->act_bytes = (int64_t)llround(whole.act);
      eval_free(&whole);
      c->fits = priced && (fc->memory <= 0 || c->peak_bytes <= fc->memory);
      if (priced && !c->fits) {
        char need[32], have[32];
        snprintf(c->why, sizeof c->why, "peak %s per rank is more than the cluster's memory %s",
                 cli_bytes(need, sizeof need, (double)c->peak_bytes), cli_bytes(have, sizeof have, (double)fc->memory));
      }
      if (!c->fits) continue;
    }
    out->chosen = k;
  }
  p->parallel = saved;
  p->model.batch = batch;
  free(algos);
  if (!ok) return ir_error(d, "out of memory");
  out->seconds = now_s() - t0;
  return true;
}

void cli_layouts_free(CliLayouts *l) {
  free(l->all);
  *l = (CliLayouts){0};
}

char *cli_bytes(char *buf, size_t n, double bytes) { return ir_bytes(buf, n, bytes); }

const char *cli_layout_name(char *buf, size_t n, const CliLayout *l) {
  int u = snprintf(buf, n, "dp %d, mp %d, ep %d, esp %d%s%s", l->dp, l->mp, l->ep, l->esp, l->algo ? ", alltoall " : "",
                   l->algo ? l->algo : "");
  if ((l->pp > 1 || l->microbatches > 1) && u >= 0 && (size_t)u < n)
    snprintf(buf + u, n - (size_t)u, ", pp %d, microbatches %d", l->pp > 1 ? l->pp : 1, l->microbatches > 1 ? l->microbatches : 1);
  return buf;
}

void cli_layouts_print(FILE *out, const CliLayouts *ls, const char *cluster) {
  char mem[32];
  fprintf(out, "# layouts for cluster '%s', policy %s, %lld samples a step, memory per rank %s: %d candidates, "
          "searched in %.3f s\n", cluster, ls->policy, (long long)ls->global_batch,
          ls->memory > 0 ? cli_bytes(mem, sizeof mem, (double)ls->memory) : "not given", ls->n, ls->seconds);
  fprintf(out, "%4s %5s %4s %5s %4s %4s %4s %5s %12s %12s  %s\n", "rank", "dp", "mp", "ep", "esp", "pp", "mb", "algo",
          "step ms", "peak", "");
  for (int i = 0; i < ls->n; i++) {
    const CliLayout *l = &ls->all[i];
    char step[32] = "-", peak[32] = "-";
    if (l->step_ms >= 0) snprintf(step, sizeof step, "%.3f", l->step_ms);
    if (l->peak_bytes >= 0) cli_bytes(peak, sizeof peak, (double)l->peak_bytes);
    char stages[128] = "";
    if (l->split[0]) snprintf(stages, sizeof stages, "%sstages of %s layers", l->fits ? ", " : "; ", l->split);
    fprintf(out, "%4d %5d %4d %5d %4d %4d %4d %5s %12s %12s  %s%s%s%s\n", i + 1, l->dp, l->mp, l->ep, l->esp,
            l->pp > 1 ? l->pp : 1, l->microbatches > 1 ? l->microbatches : 1, l->algo ? l->algo : "as-is", step, peak,
            i == ls->chosen ? "chosen" : l->fits ? "fits" : "", l->fits && *choices_text(l) ? "," : "",
            l->fits ? choices_text(l) : l->why, stages);
  }
}

static void json_layout(FILE *f, const CliLayout *l, const char *policy) {
  fprintf(f, "{\"dp\": %d, \"mp\": %d, \"ep\": %d, \"esp\": %d, \"pp\": %d, \"microbatches\": %d, \"algo\": ", l->dp,
          l->mp, l->ep, l->esp, l->pp > 1 ? l->pp : 1, l->microbatches > 1 ? l->microbatches : 1);
  if (l->algo) fprintf(f, "\"%s\"", l->algo);
  else fprintf(f, "null");
  fprintf(f, ", \"policy\": \"%s\", \"step_ms\": ", policy);
  if (l->step_ms >= 0) fprintf(f, "%.9g", l->step_ms);
  else fprintf(f, "null");
  fprintf(f, ", \"peak_bytes\": ");
  if (l->peak_bytes >= 0) fprintf(f, "%lld", (long long)l->peak_bytes);
  else fprintf(f, "null");
  fprintf(f, ", \"fits\": %s, \"shard\": %s, \"recompute\": %s%s%s, \"vocab_parallel\": %s, \"why\": \"",
          l->fits ? "true" : "false", l->shard ? "true" : "false", l->recompute ? "\"" : "", l->recompute ? l->recompute : "null",
          l->recompute ? "\"" : "", l->vocab_parallel ? "true" : "false");
  for (const char *s = l->why; *s; s++) {
    if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
    else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", (unsigned char)*s);
    else fputc(*s, f);
  }
  fprintf(f, "\"}");
}

bool cli_layouts_json(const char *path, const CliLayouts *ls) {
  FILE *f = fopen(path, "w");
  if (!f) return false;
  fprintf(f, "{\"layouts\": [");
  for (int i = 0; i < ls->n; i++) {
    fprintf(f, "%s\n  ", i ? "," : "");
    json_layout(f, &ls->all[i], ls->policy);
  }
  fprintf(f, "\n ],\n \"chosen\": ");
  if (ls->chosen >= 0) json_layout(f, &ls->all[ls->chosen], ls->policy);
  else fprintf(f, "null");
  fprintf(f, ",\n \"global_batch\": %lld, \"search_seconds\": %.6f}\n", (long long)ls->global_batch, ls->seconds);
  return fclose(f) == 0;
}

bool cli_layout_nothing_fits(IrDiag *d, const FeProgram *p, const CliLayouts *ls) {
  const CliLayout *small = NULL;
  for (int i = 0; i < ls->n; i++)
    if (ls->all[i].peak_bytes >= 0 && (!small || ls->all[i].peak_bytes < small->peak_bytes)) small = &ls->all[i];
  SrcLoc at = p->parallel.loc;
  if (!small) {
    ir_error_at(d, at, "no parallel layout of the cluster's ranks can run this model: every one is refused (%s)",
                ls->n > 0 ? ls->all[0].why : "the cluster has no ranks");
    return false;
  }
  char need[32], have[32], name[96], act[32], rest[32];
  ir_error_at(d, at,
              "no parallel layout fits in the cluster's memory of %s per rank: the smallest peak is %s (%s), "
              "activations %s and parameters, gradients and optimizer state %s; a smaller batch lowers the "
              "first, more ranks or a larger esp (each expert's hidden split over more ranks of a node) the second",
              cli_bytes(have, sizeof have, (double)ls->memory), cli_bytes(need, sizeof need, (double)small->peak_bytes),
              cli_layout_name(name, sizeof name, small), cli_bytes(act, sizeof act, (double)small->act_bytes),
              cli_bytes(rest, sizeof rest, (double)(small->peak_bytes - small->act_bytes)));
  return false;
}

// A whole number >= 1 (all of text), into *v.
static bool whole(const char *text, int *v) {
  char *end;
  long x = strtol(text, &end, 10);
  if (end == text || *end || x < 1 || x > 1 << 20) return false;
  *v = (int)x;
  return true;
}

// "DP,MP,EP,ESP[,ALGO][,pp=P][,microbatches=M]" into l (pp and microbatches 0 where not named);
// false when malformed.
static bool parse_layout(const char *text, CliLayout *l) {
  char buf[256];
  if (strlen(text) >= sizeof buf) return false;
  snprintf(buf, sizeof buf, "%s", text);
  *l = (CliLayout){0};
  int v[4], k = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save), k++) {
    if (k < 4) {
      if (!whole(tok, &v[k])) return false;
    } else if (strncmp(tok, "pp=", 3) == 0) {
      if (l->pp || !whole(tok + 3, &l->pp)) return false;
    } else if (strncmp(tok, "microbatches=", 13) == 0) {
      if (l->microbatches || !whole(tok + 13, &l->microbatches)) return false;
    } else {
      for (int a = 0; a < 3 && !l->algo && k == 4; a++)
        if (strcmp(tok, sched_a2a_name[a]) == 0) l->algo = sched_a2a_name[a];
      if (!l->algo || k != 4) return false;
    }
  }
  if (k < 4) return false;
  l->dp = v[0], l->mp = v[1], l->ep = v[2], l->esp = v[3];
  return true;
}

bool cli_resolve_layout(IrDiag *d, FeProgram *p, const FeCluster *fc, const char *forced, bool verbose, char *note,
                        size_t nnote, char *spec, size_t nspec) {
  if (note && nnote) note[0] = '\0';
  if (spec && nspec) spec[0] = '\0';
  if (forced) {
    CliLayout l;
    if (!parse_layout(forced, &l))
      return ir_error(d, "--layout takes DP,MP,EP,ESP or DP,MP,EP,ESP,ALGO (ALGO: nccl, 1dh or 2dh), then optionally "
                         ",pp=P and ,microbatches=M, not '%s'", forced);
    char why[240];
    int64_t global = cli_global_batch(p), instances = 0;
    for (int i = 0; i < p->nlayers; i++) instances += p->layers[i].repeat;
    if (global % l.dp != 0)
      return ir_error(d, "--layout %s: dp %d does not divide the global batch of %lld samples", forced, l.dp,
                      (long long)global);
    CliLayout full = l;   // the model's stages and microbatches where --layout names none
    if (!full.pp) full.pp = (int)(p->parallel.pp > 1 ? p->parallel.pp : 1);
    if (!full.microbatches) full.microbatches = (int)(p->parallel.microbatches > 1 ? p->parallel.microbatches : 1);
    if (full.pp > instances || full.pp > FE_MAX_STAGES)
      return ir_error(d, "--layout %s: pp %d: every stage holds at least one of the model's %lld layers (at most %d "
                         "stages)", forced, full.pp, (long long)instances, FE_MAX_STAGES);
    if ((global / l.dp) % full.microbatches != 0)
      return ir_error(d, "--layout %s: microbatches %d does not divide the %lld samples of a DP rank", forced,
                      full.microbatches, (long long)(global / l.dp));
    if (refusal(p, &full, global / l.dp, why, sizeof why)) return ir_error(d, "--layout %s: %s", forced, why);
    cli_layout_apply(p, &l, global);
    p->parallel.is_auto = false;
    if (note) snprintf(note, nnote, "set by --layout %s", forced);
    return true;
  }
  if (!p->parallel.is_auto) return true;
  if (!fc)
    return ir_error_at(d, p->parallel.loc,
                       "'parallel auto' chooses the layout for a cluster: add 'cluster \"FILE\";' to the model or "
                       "pass --cluster FILE (lang/clusters has some)");
  CliLayouts ls;
  if (!cli_layout_search(d, p, fc, &ls)) return false;
  if (verbose) cli_layouts_print(stderr, &ls, fc->name ? fc->name : "cluster");
  if (ls.chosen < 0) {
    cli_layout_nothing_fits(d, p, &ls);
    cli_layouts_free(&ls);
    return false;
  }
  const CliLayout *c = &ls.all[ls.chosen];
  int fitting = 0;
  for (int i = 0; i < ls.n; i++) fitting += ls.all[i].fits;
  char name[96], peak[32], mem[32], line[512];
  snprintf(line, sizeof line,
           "parallel auto: %s for cluster '%s' (%lld nodes x %lld): the fastest of %d fitting layouts (%d "
           "considered), predicted %.3f ms per step of %lld samples with policy %s, peak %s per rank%s%s%s",
           cli_layout_name(name, sizeof name, c), fc->name ? fc->name : "cluster", (long long)fc->nodes,
           (long long)fc->gpus_per_node, fitting, ls.n, c->step_ms, (long long)ls.global_batch, ls.policy, cli_bytes(peak, sizeof peak, (double)c->peak_bytes),
           fc->memory > 0 ? " of " : "", fc->memory > 0 ? cli_bytes(mem, sizeof mem, (double)fc->memory) : "",
           choices_text(c));
  fprintf(stderr, "# %s\n", line);
  if (note) snprintf(note, nnote, "%s", line);
  if (spec) snprintf(spec, nspec, "%d,%d,%d,%d%s%s,pp=%d,microbatches=%d", c->dp, c->mp, c->ep, c->esp, c->algo ? "," : "",
                     c->algo ? c->algo : "", c->pp > 1 ? c->pp : 1, c->microbatches > 1 ? c->microbatches : 1);
  cli_layout_apply(p, c, ls.global_batch);
  cli_layouts_free(&ls);
  return true;
}
