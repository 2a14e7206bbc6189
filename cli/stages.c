// Pipeline stages in `moec build`, `moec plan --layouts` and `parallel auto;` (lang/manual.md §6):
// what each layer instance of a model costs a microbatch, the split of the instances over the
// stages that the cost model finds fastest, and the planned pipeline of the stages' builds.
//
// An instance's cost comes from one lowering of the whole model (one stage, with its layout and
// its microbatches' batch) through the build's passes with the cluster profile. Its MoE stack is
// planned for the model's policy as the pipeline pass plans it and simulated, with its gradients'
// reductions and without them (the runtime reduces a step's gradients in its last microbatch
// only); each layer's share of the simulated step (sched_layer_times) is its time, and the
// functions outside the stack (an mlp layer, the embedding, the head and the loss) are their
// priced ops. Its memory: its parameters with their gradients and optimizer state, and a share of
// the activations arena by the bytes its backward reads of its forward. A group of layers written
// `x N` with N > 4 is lowered with 4 copies (its first, two inner ones and its last; cli/layout.c
// does the same with 3 and 4): every inner instance costs what the first inner copy costs, and the
// stack the planner simulates holds all N. So a 61-layer model prices its split from one lowering
// of a handful of layers and two simulations; the split is a dynamic program over the instances'
// times (sched_pipe_split), then refined with each stage's own stack planned alone (a stage cannot
// hide its gradients in another stage's backward), a few plans more, never a build per candidate.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/plan.h"
#include "ir/ir.h"
#include "passes/pass.h"

enum { CAP_REPEATS = 4 };

// Where the functions and parameters of the lowered (capped) program go: capped instance k (its
// layer item's repeats capped at CAP_REPEATS), or the embedding's part (FIRST) or the head's and
// loss's (LAST).
enum { FIRST = -1, LAST = -2, NONE = -3 };

typedef struct Capped {
  const FeProgram *p;
  const SchedCluster *sc;
  IrPolicy policy;
  int r_fix[2];
  bool quick;                 // the stack planned without fsmoe's global optimiser (SchedStack.quick)
  int n;                      // capped instances
  char (*name)[80];           // [n] "block0", ...: their parameters' prefix
  int *item;                  // [n] the layer item
  int *first;                 // [nlayers] the first capped instance of each item
  // What the `cost` hook takes (per capped instance, then first and last at n and n + 1):
  double *t_other;            // the priced ops of its functions outside the stack
  double *t_red;              // ... of those that reduce gradients (cli_reduces)
  double *params, *saved;     // parameter bytes; bytes its backward reads of its forward
  double t_update;
  SchedLayerCost *cost;       // the stack's layers and the capped instance of each
  int *r_max, *inst, nstack;
  bool grabbed;
} Capped;

static void capped_free(Capped *c) {
  free(c->name), free(c->item), free(c->first), free(c->t_other), free(c->t_red), free(c->params), free(c->saved);
  free(c->cost), free(c->r_max), free(c->inst);
}

// The capped instance of forward function f (its item and repeat attributes), or FIRST / LAST for
// one without them (before the first layer: the embedding; after: the head).
static int instance_of(const Capped *c, const IrFunc *f, bool seen_layer) {
  int64_t item = ir_func_int(f, "item", -1), repeat = ir_func_int(f, "repeat", -1);
  if (item < 0 || item >= c->p->nlayers || repeat < 0) return seen_layer ? LAST : FIRST;
  return c->first[item] + (int)repeat;
}

static int slot(const Capped *c, int k) { return k >= 0 ? k : k == FIRST ? c->n : c->n + 1; }

// The class of every function of m: its capped instance, FIRST, LAST or NONE (the optimizer).
static int *classify(const Capped *c, const IrModule *m) {
  int *cls = malloc((size_t)(m->nfuncs > 0 ? m->nfuncs : 1) * sizeof *cls);
  if (!cls) return NULL;
  bool seen = false;
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    if (f->role == IR_ROLE_OPTIMIZER) cls[i] = NONE;
    else if (f->role == IR_ROLE_LOSS_FWD || f->role == IR_ROLE_LOSS_BWD) cls[i] = LAST;
    else if (f->saves) cls[i] = cls[f->saves->index];
    else cls[i] = instance_of(c, f, seen);
    seen |= cls[i] >= 0;
  }
  return cls;
}

// The parameters' bytes by owner: an instance by its name's prefix, the embedding's table (also the
// last stage's when tied), the rest the head's.
static void param_owners(Capped *c, const IrModule *m) {
  for (int i = 0; i < m->nparams; i++) {
    const IrParam *q = m->params[i];
    double bytes = (double)ir_type_bytes(&q->type);
    int k = 0;
    while (k < c->n && !(strncmp(q->name, c->name[k], strlen(c->name[k])) == 0 && q->name[strlen(c->name[k])] == '.')) k++;
    if (k < c->n) c->params[k] += bytes;
    else if (strncmp(q->name, "embed.", 6) == 0) {
      c->params[c->n] += bytes;
      if (c->p->model.has_vocab && c->p->model.tie_embeddings && strcmp(q->name, "embed.wte") == 0) c->params[c->n + 1] += bytes;
    } else c->params[c->n + 1] += bytes;
  }
}

// The bytes of f's values that its backward g reads (the saved activations), added to *out.
static void saved_bytes(const IrFunc *g, double *out) {
  const IrFunc *f = g->saves;
  bool *seen = calloc((size_t)(f->nvalues > 0 ? f->nvalues : 1), sizeof *seen);
  if (!seen) return;
  for (int i = 0; i < g->nops; i++)
    for (int a = 0; a < g->ops[i]->nargs; a++) {
      const IrValue *v = g->ops[i]->args[a].value;
      if (v && v->func == f && !seen[v->id]) seen[v->id] = true, *out += (double)ir_type_bytes(&v->type);
    }
  free(seen);
}

bool cli_reduces(const IrOp *op) {
  if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD) return true;
  const char *g = ir_op_str(op, "group", "");
  return op->kind == IR_OP_COMM_ALLREDUCE && (strcmp(g, "dp") == 0 || strcmp(g, "world") == 0 || strcmp(g, "esp") == 0);
}

// The `cost` hook: the stack, the other functions' priced ops, the parameters and saved bytes.
static bool grab(IrModule *m, const char *pass, void *arg) {
  if (strcmp(pass, "cost") != 0) return true;
  Capped *c = arg;
  PassStack s;
  int *cls = classify(c, m);
  if (!cls || !pass_stack(m, c->sc, &s)) return free(cls), false;
  size_t n = (size_t)(s.n > 0 ? s.n : 1);
  c->cost = malloc(n * sizeof *c->cost), c->r_max = malloc(n * sizeof *c->r_max), c->inst = malloc(n * sizeof *c->inst);
  bool ok = c->cost && c->r_max && c->inst;
  c->nstack = s.n;
  for (int k = 0; ok && k < s.n; k++) {
    c->cost[k] = s.cost[k], c->r_max[k] = s.r_max[k], c->inst[k] = cls[s.layer[k].fwd->index];
    ok = c->inst[k] >= 0;
  }
  for (int i = 0; ok && i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    double t = 0, red = 0;
    for (int j = 0; j < f->nops; j++) {
      t += ir_op_float(f->ops[j], "cost_t", 0);
      if (f->role != IR_ROLE_LAYER_FWD && cli_reduces(f->ops[j])) red += ir_op_float(f->ops[j], "cost_t", 0);
    }
    bool in_stack = false;
    for (int k = 0; k < s.n && !in_stack; k++) in_stack = s.layer[k].fwd == f || s.layer[k].bwd == f;
    if (cls[i] == NONE) c->t_update += t;
    else if (!in_stack) c->t_other[slot(c, cls[i])] += t, c->t_red[slot(c, cls[i])] += red;
    if (f->saves && cls[i] != NONE) saved_bytes(f, &c->saved[slot(c, cls[i])]);
  }
  param_owners(c, m);
  pass_stack_free(&s);
  free(cls);
  c->grabbed = ok;
  return ok;
}

// Lowers p (repeats capped) through the pass pipeline; false with why when the compiler refuses it.
static bool lower_capped(Capped *c, FeProgram *p, const FeCluster *fc, double *arena, double *opt_ratio, char *why,
                         size_t nwhy) {
  char *text = NULL;
  size_t len = 0;
  FILE *log = open_memstream(&text, &len);
  if (!log) return snprintf(why, nwhy, "out of memory"), false;
  IrDiag d;
  ir_diag_init(&d, log);
  d.max_errors = 1;
  IrModule *m = fe_lower(&d, p, NULL);
  bool ok = m != NULL;
  if (ok && p->parallel.dp * p->parallel.mp > 1) {
    ir_attrs_set_int(m->attrs, &m->nattrs, "gpus_per_node", fc->gpus_per_node);
    ir_attrs_set_int(m->attrs, &m->nattrs, "nodes", fc->nodes);
  }
  // The times come from the stack as the `cost` pass prices it (grab, stack_times); the rest of the
  // pipeline only gives the memory plan, of the program without chunks (a pipelined one needs
  // about the same, passes/memplan.c), which is cheaper to make.
  if (m) {
    ir_attrs_set_str(m, m->attrs, &m->nattrs, "pipeline", "fixed");
    ir_attrs_set_int(m->attrs, &m->nattrs, "r_fwd", 1);
    ir_attrs_set_int(m->attrs, &m->nattrs, "r_bwd", 1);
    ir_attrs_set_str(m, m->attrs, &m->nattrs, "grad_partition", "none");
  }
  PassCtx ctx = {.d = &d, .log = log, .cluster = c->sc, .fuse = true, .fuse_cpu = true, .after_pass = grab, .after_arg = c};
  ok = ok && pass_run_pipeline(m, &ctx) && d.errors == 0 && c->grabbed && ctx.memplan;
  if (ok) {
    *arena = (double)ctx.memplan->arena_bytes;
    double pb = (double)ctx.memplan->param_bytes;
    // the optimizer's state and the microbatches' second gradient buffer, per parameter byte
    *opt_ratio = pb > 0 ? (double)(ctx.memplan->optimizer_bytes + ctx.memplan->accum_bytes) / pb : 0;
  }
  pass_ctx_free(&ctx);
  ir_module_free(m);
  fclose(log);
  if (!ok) {
    const char *e = text ? strstr(text, "error: ") : NULL;
    snprintf(why, nwhy, "%.*s", e ? (int)strcspn(e + 7, "\n") : 24, e ? e + 7 : "refused by the compiler");
  }
  free(text);
  return ok;
}

// The capped instance that stands for instance r of an item of `repeat` instances.
static int copy_of(int64_t repeat, int64_t r) {
  if (repeat <= CAP_REPEATS || r == 0) return (int)r;
  return r == repeat - 1 ? CAP_REPEATS - 1 : 1;
}

// The whole stack (every instance) planned and simulated, with its gradients' reductions and
// without (a microbatch before the last: runtime/pipeline.c): each stack layer's share into t[] and
// t_local[] of its instance (full numbering).
static bool stack_times(const Capped *c, const int *capped_of, int total, double *t, double *t_local) {
  int n = 0;
  for (int k = 0; k < total; k++)
    for (int j = 0; j < c->nstack; j++) n += c->inst[j] == capped_of[k];
  SchedLayerCost *cost = malloc((size_t)(n > 0 ? n : 1) * sizeof *cost);
  int *r_max = malloc((size_t)(n > 0 ? n : 1) * sizeof *r_max), *at = malloc((size_t)(n > 0 ? n : 1) * sizeof *at);
  double *lt = malloc((size_t)(n > 0 ? n : 1) * sizeof *lt);
  bool ok = cost && r_max && at && lt;
  int used = 0;
  for (int k = 0; ok && k < total; k++)
    for (int j = 0; j < c->nstack; j++)
      if (c->inst[j] == capped_of[k]) cost[used] = c->cost[j], r_max[used] = c->r_max[j], at[used++] = k;
  for (int local = 0; ok && n > 0 && local < 2; local++) {
    if (local)
      for (int j = 0; j < n; j++) cost[j].n_grad = 0;
    SchedStack st = {.n = n, .cost = cost, .r_max = r_max, .choose = SCHED_CHOOSE_BEST,
                     .slow_compute = c->sc->overlap_compute, .slow_comm = c->sc->overlap_comm,
                     .r_fix = {c->r_fix[0], c->r_fix[1]}, .quick = c->quick};
    SchedPlan plan = {0};
    ok = sched_plan(&st, c->policy, &plan) && sched_layer_times(&st, &plan, lt);
    sched_plan_free(&plan);
    for (int j = 0; ok && j < n; j++) (local ? t_local : t)[at[j]] += lt[j];
  }
  free(cost), free(r_max), free(at), free(lt);
  return ok;
}

// The capped program's layout of instances (names, items) for p with its repeats capped.
static bool capped_layout(Capped *c, const FeProgram *p) {
  c->n = 0;
  for (int i = 0; i < p->nlayers; i++) c->n += (int)(p->layers[i].repeat < CAP_REPEATS ? p->layers[i].repeat : CAP_REPEATS);
  size_t n = (size_t)c->n + 2;
  c->name = calloc(n, sizeof *c->name), c->item = calloc(n, sizeof *c->item);
  c->first = calloc((size_t)(p->nlayers > 0 ? p->nlayers : 1), sizeof *c->first);
  c->t_other = calloc(n, sizeof *c->t_other), c->params = calloc(n, sizeof *c->params), c->saved = calloc(n, sizeof *c->saved);
  c->t_red = calloc(n, sizeof *c->t_red);
  if (!c->name || !c->item || !c->first || !c->t_other || !c->t_red || !c->params || !c->saved) return false;
  for (int i = 0, k = 0; i < p->nlayers; i++) {
    c->first[i] = k;
    for (int64_t r = 0; r < p->layers[i].repeat && r < CAP_REPEATS; r++, k++) {
      c->item[k] = i;
      snprintf(c->name[k], sizeof c->name[k], "%s%lld", p->layers[i].name, (long long)r);
    }
  }
  return true;
}

void cli_instances_free(CliInstances *x) {
  free(x->t), free(x->t_local), free(x->bytes), free(x->act), free(x->params);
  free(x->stacked), free(x->cost), free(x->r_max), free(x->t_other), free(x->t_red);
  *x = (CliInstances){0};
}

// Fills out from the capped program's figures (full numbering: capped_of[k] for instance k).
static bool expand(const Capped *c, const int *capped_of, double arena, double opt_ratio, CliInstances *out) {
  int total = out->n;
  double saved = 0;
  for (int k = 0; k < c->n + 2; k++) saved += c->saved[k];
  double fixed = 2 + opt_ratio;   // parameters, their gradients, the optimizer's state (and accumulation) per byte
  for (int k = 0; k < total; k++) {
    int j = capped_of[k];
    for (int l = 0; l < c->nstack; l++)
      if (c->inst[l] == j) out->stacked[k] = true, out->cost[k] = c->cost[l], out->r_max[k] = c->r_max[l];
    out->t_other[k] = c->t_other[j], out->t_red[k] = c->t_red[j];
    out->t[k] += c->t_other[j];
    out->t_local[k] += c->t_other[j] - c->t_red[j];
    out->params[k] = c->params[j];
    out->bytes[k] = fixed * c->params[j];
    out->act[k] = saved > 0 ? arena * c->saved[j] / saved : arena / (c->n + 2);
  }
  out->t_first = c->t_other[c->n], out->t_last = c->t_other[c->n + 1];
  out->red_first = c->t_red[c->n], out->red_last = c->t_red[c->n + 1];
  out->params_first = c->params[c->n], out->params_last = c->params[c->n + 1];
  out->bytes_first = fixed * c->params[c->n], out->bytes_last = fixed * c->params[c->n + 1];
  out->act_first = saved > 0 ? arena * c->saved[c->n] / saved : arena / (c->n + 2);
  out->act_last = saved > 0 ? arena * c->saved[c->n + 1] / saved : arena / (c->n + 2);
  out->t_update = c->t_update;
  // The capped program's update, grown to every instance by their parameters.
  double capped = c->params[c->n] + c->params[c->n + 1], all = out->params_first + out->params_last;
  for (int k = 0; k < c->n; k++) capped += c->params[k];
  for (int k = 0; k < total; k++) all += out->params[k];
  if (capped > 0) out->t_update *= all / capped;
  return true;
}

bool cli_price_instances(FeProgram *p, const FeCluster *fc, const SchedCluster *sc, IrPolicy policy, const int r_fix[2],
                         bool quick, CliInstances *out, char *why, size_t nwhy) {
  *out = (CliInstances){0};
  Capped c = {.p = p, .sc = sc, .policy = policy, .r_fix = {r_fix[0], r_fix[1]}, .quick = quick};
  FeParallel saved_par = p->parallel;
  int saved_stage = p->stage, total = 0;
  int64_t *repeat = malloc((size_t)(p->nlayers > 0 ? p->nlayers : 1) * sizeof *repeat);
  bool ok = repeat && capped_layout(&c, p);
  for (int i = 0; ok && i < p->nlayers; i++) {
    repeat[i] = p->layers[i].repeat, total += (int)repeat[i];
    if (repeat[i] > CAP_REPEATS) p->layers[i].repeat = CAP_REPEATS;
  }
  int *capped_of = ok ? malloc((size_t)(total > 0 ? total : 1) * sizeof *capped_of) : NULL;
  out->n = total;
  out->t = calloc((size_t)total + 1, sizeof *out->t), out->bytes = calloc((size_t)total + 1, sizeof *out->bytes);
  out->t_local = calloc((size_t)total + 1, sizeof *out->t_local), out->t_red = calloc((size_t)total + 1, sizeof *out->t_red);
  out->act = calloc((size_t)total + 1, sizeof *out->act), out->params = calloc((size_t)total + 1, sizeof *out->params);
  out->stacked = calloc((size_t)total + 1, sizeof *out->stacked), out->cost = calloc((size_t)total + 1, sizeof *out->cost);
  out->r_max = calloc((size_t)total + 1, sizeof *out->r_max), out->t_other = calloc((size_t)total + 1, sizeof *out->t_other);
  out->sc = sc, out->policy = policy, out->r_fix[0] = r_fix[0], out->r_fix[1] = r_fix[1];
  ok = ok && capped_of && out->t && out->t_local && out->bytes && out->act && out->params && out->stacked && out->cost &&
       out->r_max && out->t_other && out->t_red;
  if (!ok) snprintf(why, nwhy, "out of memory");
  for (int i = 0, k = 0; ok && i < p->nlayers; i++)
    for (int64_t r = 0; r < repeat[i]; r++) capped_of[k++] = c.first[i] + copy_of(repeat[i], r);
  // The whole model as one stage: every instance, the embedding and the head.
  p->parallel.pp = 1, p->parallel.npp_layers = 0, p->stage = 0;
  double arena = 0, opt_ratio = 0;
  ok = ok && lower_capped(&c, p, fc, &arena, &opt_ratio, why, nwhy);
  if (ok && !stack_times(&c, capped_of, total, out->t, out->t_local))
    ok = false, snprintf(why, nwhy, "the planner failed (an internal error)");
  ok = ok && expand(&c, capped_of, arena, opt_ratio, out);
  for (int i = 0; repeat && i < p->nlayers; i++) p->layers[i].repeat = repeat[i];
  p->parallel = saved_par, p->stage = saved_stage;
  capped_free(&c);
  free(repeat);
  free(capped_of);
  if (!ok) cli_instances_free(out);
  return ok;
}

double cli_stage_time(const CliInstances *x, int s, int stages, int first, int count, double *local) {
  SchedLayerCost *cost = malloc((size_t)(count > 0 ? count : 1) * sizeof *cost);
  int *r_max = malloc((size_t)(count > 0 ? count : 1) * sizeof *r_max), n = 0;
  double t = (s == 0 ? x->t_first : 0) + (s == stages - 1 ? x->t_last : 0), red = 0;
  if (!cost || !r_max) t = -1;
  for (int k = first; t >= 0 && k < first + count; k++) {
    t += x->t_other[k], red += x->t_red[k];
    if (x->stacked[k]) cost[n] = x->cost[k], r_max[n++] = x->r_max[k];
  }
  red += (s == 0 ? x->red_first : 0) + (s == stages - 1 ? x->red_last : 0);
  *local = t - red;
  for (int pass = 0; t >= 0 && n > 0 && pass < 2; pass++) {   // with the reductions, then without
    if (pass)
      for (int k = 0; k < n; k++) cost[k].n_grad = 0;
    SchedStack st = {.n = n, .cost = cost, .r_max = r_max, .choose = SCHED_CHOOSE_BEST,
                     .slow_compute = x->sc->overlap_compute, .slow_comm = x->sc->overlap_comm,
                     .r_fix = {x->r_fix[0], x->r_fix[1]}};
    SchedPlan plan = {0};
    double *to = pass ? local : &t;
    *to = sched_plan(&st, x->policy, &plan) ? *to + plan.t_iter : -1;
    sched_plan_free(&plan);
    if (*to < 0) t = -1;
  }
  free(cost), free(r_max);
  return t;
}

// ---- the split and the pipeline's estimate ----

// The model's policy and its explicit degrees (0: planned), as the pipeline pass takes them.
static bool policy_of(const FeProgram *p, IrPolicy *pol, int r_fix[2]) {
  r_fix[0] = r_fix[1] = 0;
  if (!p->schedule.pipeline_auto) r_fix[0] = (int)p->schedule.pipeline_fwd, r_fix[1] = (int)p->schedule.pipeline_bwd;
  return ir_policy_parse(p->schedule.policy ? p->schedule.policy : "sequential", pol);
}

static bool gpipe_of(const FeProgram *p) { return p->parallel.pp_schedule && strcmp(p->parallel.pp_schedule, "gpipe") == 0; }

// The split problem of x over p's stages, within memory (0: no limit).
// The split problem of x over p's stages, within memory (0: no limit). The split decides the
// stages' part of the step, (M + P - 1) x the slowest microbatch before the last plus what the
// last one adds for its reductions: each instance weighs its microbatch without the reductions and
// 1 / (M + P - 1) of what they add (w[n + 2]: the instances', the embedding's, the head's).
static SchedSplit split_of(const FeProgram *p, const CliInstances *x, double memory, double *w) {
  int P = (int)(p->parallel.pp > 1 ? p->parallel.pp : 1), M = (int)(p->parallel.microbatches > 1 ? p->parallel.microbatches : 1);
  double f = 1.0 / (M + P - 1);
  for (int k = 0; k < x->n; k++) w[k] = x->t_local[k] + f * (x->t[k] - x->t_local[k]);
  w[x->n] = x->t_first - (1 - f) * x->red_first, w[x->n + 1] = x->t_last - (1 - f) * x->red_last;
  return (SchedSplit){.n = x->n, .stages = P, .micro = M, .gpipe = gpipe_of(p), .t = w, .t_first = w[x->n],
                      .t_last = w[x->n + 1], .bytes = x->bytes, .act = x->act, .bytes_first = x->bytes_first,
                      .act_first = x->act_first, .bytes_last = x->bytes_last, .act_last = x->act_last, .memory = memory};
}

static void equal_split(const FeProgram *p, int64_t *counts) {
  FeProgram q = *p;
  q.parallel.npp_layers = 0;
  for (int s = 0; s < p->parallel.pp; s++) {
    int64_t first;
    fe_stage_layers(&q, s, &first, &counts[s]);
  }
}

static void counts_text(char *buf, size_t n, const int64_t *counts, int stages) {
  size_t u = 0;
  buf[0] = '\0';
  for (int s = 0; s < stages && u < n; s++) u += snprintf(buf + u, n - u, "%s%lld", s ? " " : "", (long long)counts[s]);
}

// The stages' part of the planned step (ms): (M + P - 1) x the slowest stage's microbatch before
// the last, plus the most a stage's last microbatch adds for its reductions (sched_pipe_step).
static double objective(int P, int M, const double *t, const double *local) {
  double slowest = 0, extra = 0;
  for (int s = 0; s < P; s++) slowest = fmax(slowest, local[s]), extra = fmax(extra, t[s] - local[s]);
  return (M + P - 1) * slowest + extra;
}

// Each stage of counts planned alone (cli_stage_time) into t[] and local[]; the objective, -1 when
// the planner failed.
static double planned(const CliInstances *x, const int64_t *counts, int P, int M, double *t, double *local) {
  for (int s = 0, at = 0; s < P; at += (int)counts[s], s++)
    if ((t[s] = cli_stage_time(x, s, P, at, (int)counts[s], &local[s])) < 0) return -1;
  return objective(P, M, t, local);
}

// The split refined with each stage planned alone: the instances' additive times miss what a stage
// cannot hide of its gradients' reductions (in the whole stack a later layer's gradients ride in
// an earlier layer's backward), so a boundary moves one layer at a time toward the faster of its
// two stages while that lowers the objective (within the memory where the split was). t[], local[]:
// the stages' times. False when the planner failed.
static bool refine(const CliInstances *x, const SchedSplit *sp, bool within, int64_t *counts, double *t,
                   double *local) {
  int P = sp->stages, M = sp->micro;
  double best = planned(x, counts, P, M, t, local);
  for (int round = 0; best >= 0 && round < 4 * x->n; round++) {
    bool moved = false;
    for (int b = 0, at = 0; b + 1 < P; at += (int)counts[b], b++) {
      int from = local[b] > local[b + 1] ? b : b + 1;
      if (counts[from] <= 1) continue;
      int64_t n0 = counts[b] + (from == b ? -1 : 1), n1 = counts[b + 1] + (from == b ? 1 : -1);
      if (within && (sched_split_peak(sp, b, at, (int)n0) > sp->memory ||
                     sched_split_peak(sp, b + 1, at + (int)n0, (int)n1) > sp->memory))
        continue;
      double tt[FE_MAX_STAGES], ll[FE_MAX_STAGES];
      memcpy(tt, t, (size_t)P * sizeof *t), memcpy(ll, local, (size_t)P * sizeof *local);
      tt[b] = cli_stage_time(x, b, P, at, (int)n0, &ll[b]);
      tt[b + 1] = cli_stage_time(x, b + 1, P, at + (int)n0, (int)n1, &ll[b + 1]);
      if (tt[b] < 0 || tt[b + 1] < 0) return false;
      double o = objective(P, M, tt, ll);
      if (o >= best * (1 - 1e-9)) continue;
      counts[b] = n0, counts[b + 1] = n1, t[b] = tt[b], t[b + 1] = tt[b + 1], local[b] = ll[b], local[b + 1] = ll[b + 1];
      best = o, moved = true;
    }
    if (!moved) break;
  }
  return best >= 0;
}

bool cli_stage_split(IrDiag *d, FeProgram *p, const FeCluster *fc, char *note, size_t nnote) {
  int P = (int)p->parallel.pp;
  if (note && nnote) note[0] = '\0';
  if (P <= 1 || p->parallel.npp_layers == P) return true;
  int64_t equal[FE_MAX_STAGES], counts[FE_MAX_STAGES];
  equal_split(p, equal);
  char eq[256], ch[256], why[240] = "";
  counts_text(eq, sizeof eq, equal, P);
  if (!fc) {
    if (note) snprintf(note, nnote, "the layers split %s over the stages in equal parts (no cluster profile to price them)", eq);
    return true;
  }
  SchedCluster sc;
  cli_cluster_from_fe(fc, &sc);
  IrPolicy pol;
  int r_fix[2];
  CliInstances x;
  if (!policy_of(p, &pol, r_fix)) return ir_error(d, "unknown policy '%s'", p->schedule.policy);
  if (!cli_price_instances(p, fc, &sc, pol, r_fix, false, &x, why, sizeof why)) {
    if (note) snprintf(note, nnote, "the layers split %s in equal parts: pricing the whole model failed (%s)", eq, why);
    return true;
  }
  double *w = malloc(((size_t)x.n + 2) * sizeof *w);
  if (!w) return cli_instances_free(&x), ir_error(d, "out of memory");
  SchedSplit sp = split_of(p, &x, (double)fc->memory, w);
  double t[FE_MAX_STAGES], l[FE_MAX_STAGES], te[FE_MAX_STAGES], le[FE_MAX_STAGES];
  bool within = false, ok = sched_pipe_split(&sp, equal, counts, &within) && refine(&x, &sp, within, counts, t, l);
  double slowest = ok ? objective(P, sp.micro, t, l) : -1, slowest_eq = ok ? planned(&x, equal, P, sp.micro, te, le) : -1;
  bool equal_fits = true;
  for (int s = 0, at = 0; s < P; at += (int)equal[s], s++)
    equal_fits &= !within || sched_split_peak(&sp, s, at, (int)equal[s]) <= sp.memory;
  if (ok && slowest_eq >= 0 && equal_fits && slowest_eq <= slowest * (1 + 1e-12))   // as fast: the split a reader expects
    memcpy(counts, equal, (size_t)P * sizeof *counts), slowest = slowest_eq;
  if (ok) {
    for (int s = 0; s < P; s++) p->parallel.pp_layers[s] = counts[s];
    p->parallel.npp_layers = P;
    counts_text(ch, sizeof ch, counts, P);
    if (note)
      snprintf(note, nnote, "the cost model splits the %d layers %s over the stages: (M + P - 1) x the slowest stage's "
               "microbatch + the last one's reductions = %.3f ms, each stage planned alone (the equal split %s: %.3f ms)%s",
               x.n, ch, slowest, eq, slowest_eq,
               within ? "" : fc->memory > 0 ? "; no split's estimated peaks fit the memory, the fastest split is taken" : "");
  } else if (note) {
    snprintf(note, nnote, "the layers split %s in equal parts: the planner failed on a stage (an internal error)", eq);
  }
  free(w);
  cli_instances_free(&x);
  return true;
}

// The estimate's stage s of instances [at, at + count): its microbatch with the reductions (t) and
// without (local), its update's share (by its parameters), the message to the next stage.
static void stage_estimate(const FeProgram *p, const CliInstances *x, const SchedCluster *sc, int s, int at, int count,
                           double *t, double *local, double *update, double *msg) {
  int P = (int)(p->parallel.pp > 1 ? p->parallel.pp : 1), M = (int)(p->parallel.microbatches > 1 ? p->parallel.microbatches : 1);
  double all = x->params_first + x->params_last, params = (s == 0 ? x->params_first : 0) + (s == P - 1 ? x->params_last : 0);
  for (int k = 0; k < x->n; k++) all += x->params[k];
  *t = (s == 0 ? x->t_first : 0) + (s == P - 1 ? x->t_last : 0);
  *local = *t - (s == 0 ? x->red_first : 0) - (s == P - 1 ? x->red_last : 0);
  for (int k = at; k < at + count; k++) *t += x->t[k], *local += x->t_local[k], params += x->params[k];
  *update = all > 0 ? x->t_update * params / all : x->t_update / P;
  bool across;
  const char *how;
  SchedCoef f = sched_p2p_boundary(sc, (int)(p->parallel.dp * p->parallel.mp), s, &across, &how);
  *msg = f.alpha + f.beta * (double)(p->model.batch / M) * (double)p->model.seqlen * (double)p->model.embed;
}

bool cli_pipe_estimate(FeProgram *p, const FeCluster *fc, const SchedCluster *sc, CliPipeEstimate *out, char *why,
                       size_t nwhy) {
  *out = (CliPipeEstimate){0};
  IrPolicy pol;
  int r_fix[2];
  CliInstances x;
  if (!policy_of(p, &pol, r_fix)) return snprintf(why, nwhy, "unknown policy"), false;
  if (!cli_price_instances(p, fc, sc, pol, r_fix, true, &x, why, nwhy)) return false;
  int P = (int)(p->parallel.pp > 1 ? p->parallel.pp : 1), M = (int)(p->parallel.microbatches > 1 ? p->parallel.microbatches : 1);
  double *w = malloc(((size_t)x.n + 2) * sizeof *w);
  bool ok = w != NULL, within = true;
  SchedSplit sp = ok ? split_of(p, &x, (double)fc->memory, w) : (SchedSplit){0};
  if (ok && P > 1 && p->parallel.npp_layers == P) memcpy(out->counts, p->parallel.pp_layers, (size_t)P * sizeof *out->counts);
  else if (ok && P > 1) ok = sched_pipe_split(&sp, NULL, out->counts, &within);
  else out->counts[0] = x.n;
  double t[FE_MAX_STAGES], local[FE_MAX_STAGES], update[FE_MAX_STAGES], msg[FE_MAX_STAGES];
  for (int s = 0, at = 0; ok && s < P; at += (int)out->counts[s], s++) {
    stage_estimate(p, &x, sc, s, at, (int)out->counts[s], &t[s], &local[s], &update[s], &msg[s]);
    double peak = sched_split_peak(&sp, s, at, (int)out->counts[s]);
    if (peak > out->peak) {
      double fixed = (s == 0 ? sp.bytes_first : 0) + (s == P - 1 ? sp.bytes_last : 0);
      for (int k = at; k < at + out->counts[s]; k++) fixed += x.bytes[k];
      out->peak = peak, out->act = peak - fixed;
    }
  }
  if (ok) {
    bool gpipe = p->parallel.pp_schedule && strcmp(p->parallel.pp_schedule, "gpipe") == 0;
    SchedPipe pipe = {.stages = P, .micro = M, .gpipe = gpipe, .t_micro = local, .t_last = t, .t_update = update,
                      .t_msg = msg};
    sched_pipe_step(&pipe, &out->plan);
    out->within = within;
  } else {
    snprintf(why, nwhy, w ? "%d stages need at least %d layers, the model has %d" : "out of memory", P, P, x.n);
  }
  free(w);
  cli_instances_free(&x);
  return ok;
}

void cli_stage_layers(const FeProgram *p, int stage, char *text, size_t n) {
  int64_t first, count;
  fe_stage_layers(p, stage, &first, &count);
  char a[96] = "", b[96] = "";
  int64_t k = 0;
  for (int i = 0; i < p->nlayers; i++)
    for (int64_t r = 0; r < p->layers[i].repeat; r++, k++) {
      if (k == first) snprintf(a, sizeof a, "%s%lld", p->layers[i].name, (long long)r);
      if (k == first + count - 1) snprintf(b, sizeof b, "%s%lld", p->layers[i].name, (long long)r);
    }
  size_t u = (size_t)snprintf(text, n, "layer %lld (%s)", (long long)first, a);
  if (count > 1)
    u = (size_t)snprintf(text, n, "layers %lld-%lld (%s .. %s)", (long long)first, (long long)(first + count - 1), a, b);
  if (stage == 0 && p->model.has_vocab && u < n) u += (size_t)snprintf(text + u, n - u, " + the embedding");
  if (stage == p->parallel.pp - 1 && u < n)
    snprintf(text + u, n - u, p->model.has_vocab ? " + the head and loss" : " + the loss");
}

// ---- the plan of a build's stages ----

bool cli_local_hook(IrModule *m, const char *pass, void *arg) {
  if (strcmp(pass, "cost") != 0 || !arg) return true;
  const SchedCluster *sc = arg;
  PassStack s;
  IrPolicy pol;
  if (!ir_policy_parse(ir_mod_str(m, "policy", "sequential"), &pol) || !pass_stack(m, sc, &s)) return false;
  double red = 0, upd = 0, all = 0;   // outside the stack: the reductions, the update; everything
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    bool in_stack = false;
    for (int k = 0; k < s.n && !in_stack; k++) in_stack = s.layer[k].fwd == f || s.layer[k].bwd == f;
    for (int j = 0; j < f->nops; j++) {
      double t = ir_op_float(f->ops[j], "cost_t", 0);
      all += t;
      if (in_stack) continue;
      if (f->role == IR_ROLE_OPTIMIZER) upd += t;
      else if (cli_reduces(f->ops[j])) red += t;
    }
  }
  double local = all - red - upd;
  if (s.n > 0) {
    bool planned = strcmp(ir_mod_str(m, "pipeline", ""), "auto") == 0;
    for (int k = 0; k < s.n; k++) s.cost[k].n_grad = 0;
    SchedStack st = {.n = s.n, .cost = s.cost, .r_max = s.r_max, .choose = SCHED_CHOOSE_BEST,
                     .t_fwd_other = s.t_fwd_other, .t_bwd_other = s.t_bwd_other - red - upd,
                     .slow_compute = sc->overlap_compute, .slow_comm = sc->overlap_comm,
                     .r_fix = {planned ? 0 : (int)ir_mod_int(m, "r_fwd", 1), planned ? 0 : (int)ir_mod_int(m, "r_bwd", 1)}};
    SchedPlan plan = {0};
    local = sched_plan(&st, pol, &plan) ? plan.t_iter : 0;
    sched_plan_free(&plan);
  }
  pass_stack_free(&s);
  ir_attrs_set_float(m->attrs, &m->nattrs, "t_local_pred", local);
  return true;
}

void cli_module_times(const IrModule *m, double *t_iter, double *t_update, double *t_local, double *t_fwd) {
  double all = 0;
  bool priced = false;
  *t_update = 0;
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      if (!ir_attrs_get(op->attrs, op->nattrs, "cost_t")) continue;
      double t = ir_op_float(op, "cost_t", 0);
      priced = true, all += t;
      if (m->funcs[i]->role == IR_ROLE_OPTIMIZER) *t_update += t;
    }
  // A stage without an MoE layer has no planned stack: its ops one after another.
  *t_iter = ir_mod_float(m, "t_iter_pred", 0);
  if (*t_iter <= 0 && priced) *t_iter = all;
  *t_local = ir_mod_float(m, "t_local_pred", *t_iter - *t_update);
  *t_fwd = ir_mod_float(m, "t_fwd_pred", 0);
}

// The messages of boundary s: their fit and one message's time; the p2p line (once, the first).
static double message_ms(FILE *log, const SchedCluster *sc, int ranks, int s, double floats, bool *said) {
  bool across;
  const char *how;
  SchedCoef f = sched_p2p_boundary(sc, ranks, s, &across, &how);
  double t = f.alpha + f.beta * floats;
  if (!*said) {
    char b[32];
    fprintf(log, "# pipeline: a message between stages %d and %d is %.0f floats (%s, the activations of a microbatch "
            "or their gradient), %s: %.4f ms (p2p alpha %.4g ms, beta %.4g ms per float, %s%s)\n", s, s + 1, floats,
            ir_bytes(b, sizeof b, 4 * floats), across ? "across nodes" : "inside a node", t, f.alpha, f.beta, how,
            strncmp(how, "derived", 7) == 0 ? ": the profile has no such line" : "");
    *said = true;
  }
  return t;
}

void cli_pipe_report(FILE *log, const SchedCluster *sc, const CliStageBuilt *st, int stages, int micro, bool gpipe,
                     int ranks, double floats) {
  char b[32];
  int largest = 0;
  bool priced = sc != NULL;
  for (int s = 0; s < stages; s++) {
    if (st[s].peak > st[largest].peak) largest = s;
    priced &= st[s].t_iter > 0;
  }
  for (int s = 0; s < stages; s++) {
    fprintf(log, "# stage %d: %s: ", s, st[s].layers);
    if (priced)
      fprintf(log, "planned %.3f ms a microbatch (%.3f ms the last, which reduces the gradients; the forward %.3f ms%s; the "
              "update %.3f ms once a step), ", st[s].t_local, st[s].t_iter - st[s].t_update,
              st[s].t_fwd > 0 ? st[s].t_fwd : st[s].t_local / 3, st[s].t_fwd > 0 ? "" : ", a third, not planned",
              st[s].t_update);
    fprintf(log, "%d microbatch%s in flight, peak %s per rank\n", st[s].slots, st[s].slots == 1 ? "" : "es",
            ir_bytes(b, sizeof b, (double)st[s].peak));
  }
  double t_micro[FE_MAX_STAGES], t_last[FE_MAX_STAGES], t_update[FE_MAX_STAGES], t_msg[FE_MAX_STAGES], t_fwd[FE_MAX_STAGES];
  bool said = false;
  for (int s = 0; priced && s < stages; s++) {
    t_micro[s] = st[s].t_local, t_last[s] = st[s].t_iter - st[s].t_update, t_update[s] = st[s].t_update;
    t_fwd[s] = st[s].t_fwd > 0 ? st[s].t_fwd : -1;
    if (s + 1 < stages) t_msg[s] = message_ms(log, sc, ranks, s, floats, &said);
  }
  SchedPipe pipe = {.stages = stages, .micro = micro, .gpipe = gpipe, .t_micro = t_micro, .t_last = t_last,
                    .t_fwd = t_fwd, .t_update = t_update, .t_msg = t_msg};
  SchedPipePlan plan = {0};
  if (priced) sched_pipe_step(&pipe, &plan);
  double bubble = (double)(stages - 1) / (micro + stages - 1);
  fprintf(log, "# pipeline: %d stages, %d microbatch%s, %s: bubble ", stages, micro, micro == 1 ? "" : "es",
          gpipe ? "gpipe" : "1f1b");
  if (priced) {
    fprintf(log, "%.1f %% of the step (the stages' mean wait for the others, simulated:", 100 * plan.bubble);
    for (int s = 0; s < stages; s++) fprintf(log, " %s%d %.1f %%", s ? "" : "stage ", s, 100 * plan.wait[s] / plan.t_step);
    fprintf(log, "; (P - 1) / (M + P - 1) = %.1f %% for equal stages)", 100 * bubble);
  } else {
    fprintf(log, "%.1f %% of the step ((P - 1) / (M + P - 1))", 100 * bubble);
  }
  fprintf(log, ", peak %s per rank (%lld bytes, stage %d's, the largest)\n", ir_bytes(b, sizeof b, (double)st[largest].peak),
          (long long)st[largest].peak, largest);
  if (!priced) return;
  int upd = 0;
  for (int s = 0; s < stages; s++) upd = t_update[s] > t_update[upd] ? s : upd;
  fprintf(log, "# pipeline: planned step %.3f ms: the %s order of %d microbatches simulated over the stages (a forward "
          "and a backward a microbatch each, the last one's reductions %.3f ms at most, a message %.3f ms at most on its "
          "way while the stages compute) ends at %.3f ms, then the updates (%.3f ms, stage %d's, the longest); equal "
          "stages at the slowest's pace would take (%d + %d - 1) x %.3f ms (stage %d's microbatch) + %.3f ms = %.3f ms\n",
          plan.t_step, gpipe ? "gpipe" : "1f1b", micro, plan.t_reduce, stages > 1 ? plan.t_msgs / (2 * (stages - 1)) : 0,
          plan.t_pipe, plan.t_update, upd, micro, stages, t_micro[plan.slowest], plan.slowest, plan.t_reduce, plan.t_fill);
  fprintf(log, "# pipeline-step %.9g pipe %.9g fill %.9g reduce %.9g messages %.9g update %.9g bubble %.6f slowest %d\n",
          plan.t_step, plan.t_pipe, plan.t_fill, plan.t_reduce, plan.t_msgs, plan.t_update, plan.bubble, plan.slowest);
}
