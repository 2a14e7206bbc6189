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
// `repeat`, frontend/lower.c fe_layer_func).
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
} Search;

// Prices the candidate l (its layout set on the program): step_ms and peak_bytes, or why not.
static void price(Search *s, CliLayout *l) {
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

bool cli_layout_search(IrDiag *d, FeProgram *p, const FeCluster *fc, CliLayouts *out) {
  *out = (CliLayouts){.chosen = -1, .memory = fc->memory};
  double t0 = now_s();
  Search s = {.p = p, .fc = fc};
  cli_cluster_from_fe(fc, &s.sc);
  if (!ir_policy_parse(p->schedule.policy ? p->schedule.policy : "sequential", &s.policy))
    return ir_error(d, "unknown policy '%s'", p->schedule.policy);
  out->policy = ir_policy_name[s.policy];
  if (!p->schedule.pipeline_auto) s.r_fix[0] = (int)p->schedule.pipeline_fwd, s.r_fix[1] = (int)p->schedule.pipeline_bwd;
  for (int i = 0; i < p->nlayers; i++) s.algo_fixed |= p->layers[i].has_moe && p->layers[i].moe.algo_loc.src;
  FeParallel saved = p->parallel;
  int64_t global = cli_global_batch(p), batch = p->model.batch;
  out->global_batch = global;
  const char **algos = calloc((size_t)(p->nlayers > 0 ? p->nlayers : 1), sizeof *algos);
  if (!algos) return ir_error(d, "out of memory");
  for (int i = 0; i < p->nlayers; i++) algos[i] = p->layers[i].moe.algo;
  int G = (int)fc->gpus_per_node, P = (int)(fc->nodes * fc->gpus_per_node), cap = 0;
  bool ok = true;
  for (int mp = 1; ok && mp <= G; mp++) {
    if (G % mp != 0 || P % mp != 0) continue;
    for (int esp = 1; ok && esp <= G; esp++) {
      if (G % esp != 0 || P % esp != 0) continue;
      CliLayout l = {.dp = P / mp, .mp = mp, .ep = P / esp, .esp = esp, .step_ms = -1, .peak_bytes = -1};
      FeParallel par = {.dp = l.dp, .mp = mp, .ep = l.ep, .esp = esp};
      // The global batch is the model's in every layout: each DP rank holds global/dp samples.
      bool refused = global % l.dp != 0;
      if (refused) snprintf(l.why, sizeof l.why, "dp %d does not divide the global batch of %lld samples", l.dp,
                            (long long)global);
      p->model.batch = refused ? batch : global / l.dp;
      refused = refused || fe_layout_refusal(p, &par, l.why, sizeof l.why);
      // The hierarchical AlltoAlls differ from the flat one where an EP group has several
      // ranks on each of several nodes (runtime/comm.c runs them flat otherwise).
      SchedGroup ep = sched_group_of(l.ep, esp, G);
      int nalgo = !s.algo_fixed && ep.nodes > 1 && ep.per_node > 1 ? 3 : 1;
      for (int a = 0; ok && a < nalgo; a++) {
        CliLayout c = l;
        c.algo = s.algo_fixed ? NULL : sched_a2a_name[a];
        if (!refused) {
          cli_layout_apply(p, &c, global);
          price(&s, &c);
          c.legal = c.step_ms >= 0;
          c.fits = c.legal && (fc->memory <= 0 || c.peak_bytes <= fc->memory);
          // What moec build would do to fit (cli/build.c): the sharded optimizer, then recomputation
          // (norms, then layers: all of them, where the build recomputes the fewest that fit), then
          // the vocabulary split over MP.
          if (c.legal && !c.fits && shardable(p)) price_with(&s, &c, true, NULL, false);
          c.fits = c.legal && (fc->memory <= 0 || c.peak_bytes <= fc->memory);
          for (const char *r; c.legal && !c.fits && (r = next_recompute(p->model.recompute, c.recompute));) {
            const char *had = c.recompute;
            price_with(&s, &c, false, r, false);
            c.fits = c.legal && (fc->memory <= 0 || c.peak_bytes <= fc->memory);
            if (c.recompute == had) break;   // not priced
          }
          if (c.legal && !c.fits && vocab_splittable(p, &c)) price_with(&s, &c, false, NULL, true);
          c.fits = c.legal && (fc->memory <= 0 || c.peak_bytes <= fc->memory);
          for (int i = 0; i < p->nlayers; i++) p->layers[i].moe.algo = algos[i];
          if (c.legal && !c.fits) {
            char need[32], have[32];
            snprintf(c.why, sizeof c.why, "peak %s per rank is more than the cluster's memory %s",
                     cli_bytes(need, sizeof need, (double)c.peak_bytes), cli_bytes(have, sizeof have, (double)fc->memory));
          }
        }
        ok = push(out, &cap, c) == 0;
      }
    }
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
    if (long_stack) {
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
  snprintf(buf, n, "dp %d, mp %d, ep %d, esp %d%s%s", l->dp, l->mp, l->ep, l->esp, l->algo ? ", alltoall " : "",
           l->algo ? l->algo : "");
  return buf;
}

void cli_layouts_print(FILE *out, const CliLayouts *ls, const char *cluster) {
  char mem[32];
  fprintf(out, "# layouts for cluster '%s', policy %s, %lld samples a step, memory per rank %s: %d candidates, "
          "searched in %.3f s\n", cluster, ls->policy, (long long)ls->global_batch,
          ls->memory > 0 ? cli_bytes(mem, sizeof mem, (double)ls->memory) : "not given", ls->n, ls->seconds);
  fprintf(out, "%4s %5s %4s %5s %4s %5s %12s %12s  %s\n", "rank", "dp", "mp", "ep", "esp", "algo", "step ms",
          "peak", "");
  for (int i = 0; i < ls->n; i++) {
    const CliLayout *l = &ls->all[i];
    char step[32] = "-", peak[32] = "-";
    if (l->step_ms >= 0) snprintf(step, sizeof step, "%.3f", l->step_ms);
    if (l->peak_bytes >= 0) cli_bytes(peak, sizeof peak, (double)l->peak_bytes);
    fprintf(out, "%4d %5d %4d %5d %4d %5s %12s %12s  %s%s%s\n", i + 1, l->dp, l->mp, l->ep, l->esp,
            l->algo ? l->algo : "as-is", step, peak, i == ls->chosen ? "chosen" : l->fits ? "fits" : "",
            l->fits && *choices_text(l) ? "," : "", l->fits ? choices_text(l) : l->why);
  }
}

static void json_layout(FILE *f, const CliLayout *l, const char *policy) {
  fprintf(f, "{\"dp\": %d, \"mp\": %d, \"ep\": %d, \"esp\": %d, \"algo\": ", l->dp, l->mp, l->ep, l->esp);
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

// "DP,MP,EP,ESP[,ALGO]" into l; false when malformed.
static bool parse_layout(const char *text, CliLayout *l) {
  int v[4], used = 0;
  char algo[8] = "";
  int got = sscanf(text, "%d,%d,%d,%d%n,%7s", &v[0], &v[1], &v[2], &v[3], &used, algo);
  if (got < 4 || (got == 4 && text[used] != '\0')) return false;
  for (int i = 0; i < 4; i++)
    if (v[i] < 1) return false;
  *l = (CliLayout){.dp = v[0], .mp = v[1], .ep = v[2], .esp = v[3]};
  if (!algo[0]) return true;
  for (int a = 0; a < 3; a++)
    if (strcmp(algo, sched_a2a_name[a]) == 0) l->algo = sched_a2a_name[a];
  return l->algo != NULL;
}

bool cli_resolve_layout(IrDiag *d, FeProgram *p, const FeCluster *fc, const char *forced, bool verbose, char *note,
                        size_t nnote, char *spec, size_t nspec) {
  if (note && nnote) note[0] = '\0';
  if (spec && nspec) spec[0] = '\0';
  if (forced) {
    CliLayout l;
    if (!parse_layout(forced, &l))
      return ir_error(d, "--layout takes DP,MP,EP,ESP or DP,MP,EP,ESP,ALGO (ALGO: nccl, 1dh or 2dh), not '%s'", forced);
    FeParallel par = {.dp = l.dp, .mp = l.mp, .ep = l.ep, .esp = l.esp};
    char why[240];
    int64_t global = cli_global_batch(p);
    if (global % l.dp != 0)
      return ir_error(d, "--layout %s: dp %d does not divide the global batch of %lld samples", forced, l.dp,
                      (long long)global);
    int64_t batch = p->model.batch;
    p->model.batch = global / l.dp;
    bool refused = fe_layout_refusal(p, &par, why, sizeof why);
    p->model.batch = batch;
    if (refused) return ir_error(d, "--layout %s: %s", forced, why);
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
  if (spec) snprintf(spec, nspec, "%d,%d,%d,%d%s%s", c->dp, c->mp, c->ep, c->esp, c->algo ? "," : "", c->algo ? c->algo : "");
  cli_layout_apply(p, c, ls.global_batch);
  cli_layouts_free(&ls);
  return true;
}
