// Algorithm 1 of the paper (the pipeline degree of one MoE layer and phase) and the planner of
// every policy.
//
// Algorithm 1 minimises each case's closed form over real r >= 1 under that case's predicates.
// A case is a disjunction of conjunctions (Case 1 has four, Case 2 two), and SLSQP takes
// conjunctions of smooth inequalities, so each conjunction is a sub-problem of its own: eight
// one-dimensional SLSQP solves (NLopt NLOPT_LD_SLSQP with analytic gradients; a strict '>' is
// solved as '>='). The integer neighbours of every real optimum are then evaluated with the
// model (the closed form of whichever case holds there) and the best is kept. Because the
// cases partition the truth table, scanning r = 1..32 with the closed forms is exact for the
// model. The case model only approximates how the streams overlap (it assumes AllGather and
// ReduceScatter take about as long), so fsmoe's final degree is the fastest in simulation
// among SLSQP's answer, the model scan's and the simulator's own scan of every r (lang/manual.md §8:
// "use whichever choice is better, and report both"); all three are kept in the plan.
//
// The planner (sched_plan) gives every policy its own way to choose r and to place the dense
// gradients (lang/manual.md §8), builds its stream program and simulates it.
#include <math.h>
#include <nlopt.h>
#include <stdlib.h>
#include <string.h>

#include "sched.h"

// ---- Algorithm 1 ----

typedef struct Pred {
  int q;       // 1..7
  bool want;   // the value the sub-problem requires
} Pred;

typedef struct SubProblem {
  int kase;
  Pred pred[3];
} SubProblem;

// The conjunctions of the four cases (paper §4.2).
static const SubProblem subproblems[] = {
    {1, {{1, true}, {2, false}, {4, true}}},
    {1, {{1, true}, {2, true}, {5, true}}},
    {1, {{1, false}, {3, false}, {6, true}}},
    {1, {{1, false}, {3, true}, {7, true}}},
    {2, {{1, true}, {2, true}, {5, false}}},
    {2, {{1, false}, {3, true}, {7, false}}},
    {3, {{1, true}, {2, false}, {4, false}}},
    {4, {{1, false}, {3, false}, {6, false}}},
};
enum { NSUB = sizeof subproblems / sizeof subproblems[0] };

typedef struct Solve {
  const SchedPhase *p;
  double t_gar;
  int kase;
  Pred pred;
} Solve;

// d/dr of t_x,r, of r * t_x,r and of (r - 1) * t_x,r.
static double dt(const SchedCoef *c, double n, double r) { return -n * c->beta / (r * r); }
static double drt(const SchedCoef *c) { return c->alpha; }
static double drm1t(const SchedCoef *c, double n, double r) { return c->alpha + n * c->beta / (r * r); }

// margin_q(r) > 0 exactly when Qq holds; its derivative in *grad.
static double margin(const SchedPhase *p, int q, double r, double t_gar, double *grad) {
  SchedChunk t = sched_chunk(p, r);
  double da = dt(&p->a2a, p->n_a2a, r), dg = dt(&p->ag, p->n_ag, r), ds = dt(&p->rs, p->n_rs, r);
  double a2a2 = 2 * (r - 1) * t.a2a, d_a2a2 = 2 * drm1t(&p->a2a, p->n_a2a, r);
  double v = 0, g = 0;
  switch (q) {
  case 1: v = t.a2a - t.ag; g = da - dg; break;
  case 2: v = r * t.exp - a2a2; g = drt(&p->exp) - d_a2a2; break;
  case 3:
    v = r * t.exp - (r - 1) * (t.ag + t.rs);
    g = drt(&p->exp) - drm1t(&p->ag, p->n_ag, r) - drm1t(&p->rs, p->n_rs, r);
    break;
  case 4: v = t_gar - t.ag - t.rs; g = -dg - ds; break;
  case 5: v = t_gar - (r * t.exp - a2a2 + t.ag + t.rs); g = -(drt(&p->exp) - d_a2a2 + dg + ds); break;
  case 6: v = t_gar - (r * t.ag + r * t.rs - a2a2); g = -(drt(&p->ag) + drt(&p->rs) - d_a2a2); break;
  case 7: v = t_gar - (t.ag + t.rs + r * t.exp - a2a2); g = -(dg + ds + drt(&p->exp) - d_a2a2); break;
  }
  if (grad) *grad = g;
  return v;
}

// Case c's closed form and its derivative.
static double case_fn(const SchedPhase *p, int c, double r, double t_gar, double *grad) {
  double da = dt(&p->a2a, p->n_a2a, r), dg = dt(&p->ag, p->n_ag, r), ds = dt(&p->rs, p->n_rs, r);
  double g = 0;
  switch (c) {
  case 1: g = 2 * drt(&p->a2a); break;
  case 2: g = 2 * da + dg + ds + drt(&p->exp); break;
  case 3: g = 2 * drt(&p->a2a) + dg + ds; break;
  case 4: g = 2 * da + drt(&p->ag) + drt(&p->rs); break;
  }
  g += p->t_sum + p->t_level / (r * M_LN2);   // sched_assembly's derivative
  if (grad) *grad = g;
  return sched_case_time(p, c, r, t_gar);
}

static double objective(unsigned n, const double *x, double *grad, void *data) {
  const Solve *s = data;
  return case_fn(s->p, s->kase, x[0], s->t_gar, grad);
}

// NLopt constraints are c(x) <= 0: -margin for a predicate that must hold, margin otherwise.
static double constraint(unsigned n, const double *x, double *grad, void *data) {
  const Solve *s = data;
  double v = margin(s->p, s->pred.q, x[0], s->t_gar, grad);
  if (s->pred.want) {
    v = -v;
    if (grad) grad[0] = -grad[0];
  }
  return v;
}

// The unconstrained minimiser of case c over r > 0 (each closed form is a*r + b/r + const).
static double unconstrained_min(const SchedPhase *p, int c) {
  double lin = 0, inv = 0;
  switch (c) {
  case 1: return 1;
  case 2: lin = p->exp.alpha + p->t_sum; inv = 2 * p->n_a2a * p->a2a.beta + p->n_ag * p->ag.beta + p->n_rs * p->rs.beta; break;
  case 3: lin = 2 * p->a2a.alpha + p->t_sum; inv = p->n_ag * p->ag.beta + p->n_rs * p->rs.beta; break;
  case 4: lin = p->ag.alpha + p->rs.alpha + p->t_sum; inv = 2 * p->n_a2a * p->a2a.beta; break;
  }
  if (lin <= 0) return INFINITY;
  return sqrt(inv / lin);
}

static bool feasible(const SchedPhase *p, const SubProblem *sp, double r, double t_gar) {
  for (int k = 0; k < 3; k++) {
    double m = margin(p, sp->pred[k].q, r, t_gar, NULL);
    double tol = 1e-9 * (1 + fabs(t_gar) + sched_case_time(p, 2, r, 0));
    if (sp->pred[k].want ? m < -tol : m > tol) return false;
  }
  return true;
}

// One SLSQP solve of a sub-problem from x0; true with *r_out when it ends feasible.
static bool slsqp(const SchedPhase *p, const SubProblem *sp, double t_gar, double r_max, double x0,
                  double *r_out) {
  nlopt_opt o = nlopt_create(NLOPT_LD_SLSQP, 1);
  if (!o) return false;
  Solve obj = {p, t_gar, sp->kase, {0, false}};
  Solve cons[3];
  double lo = 1, hi = r_max;
  nlopt_set_lower_bounds(o, &lo);
  nlopt_set_upper_bounds(o, &hi);
  nlopt_set_min_objective(o, objective, &obj);
  for (int k = 0; k < 3; k++) {
    cons[k] = (Solve){p, t_gar, sp->kase, sp->pred[k]};
    nlopt_add_inequality_constraint(o, constraint, &cons[k], 1e-12);
  }
  nlopt_set_xtol_rel(o, 1e-6);   // r is rounded to an integer afterwards
  nlopt_set_ftol_rel(o, 1e-10);
  nlopt_set_maxeval(o, 200);
  double x = fmin(fmax(x0, lo), hi), f;
  nlopt_result res = nlopt_optimize(o, &x, &f);
  nlopt_destroy(o);
  if (res < 0 && res != NLOPT_ROUNDOFF_LIMITED) return false;
  if (!isfinite(x) || !feasible(p, sp, x, t_gar)) return false;
  *r_out = x;
  return true;
}

static void consider(const SchedPhase *p, double t_gar, int r, double r_real, SchedDegree *best) {
  double t = sched_model_time(p, r, t_gar);
  if (t < best->t || (t == best->t && r < best->r)) {
    best->r = r;
    best->t = t;
    best->r_real = r_real;
  }
}

SchedDegree sched_find_degree(const SchedPhase *p, double t_gar, int r_max, SchedMethod m) {
  if (r_max < 1) r_max = 1;
  if (r_max > SCHED_R_MAX) r_max = SCHED_R_MAX;
  SchedDegree best = {.r = 1, .t = INFINITY, .r_real = 1};
  if (m == SCHED_METHOD_EXHAUSTIVE || r_max == 1) {
    for (int r = 1; r <= r_max; r++) consider(p, t_gar, r, r, &best);
  } else {
    for (int i = 0; i < NSUB; i++) {
      const SubProblem *sp = &subproblems[i];
      // Presolve on the integer grid: skip a sub-problem with no feasible integer (its integer
      // neighbours would belong to other cases anyway) and start SLSQP from the feasible grid
      // point nearest the case's unconstrained optimum, so it converges in a few iterations.
      double target = fmin(fmax(unconstrained_min(p, sp->kase), 1), r_max);
      int start = 0;
      for (int r = 1; r <= r_max; r++)
        if (feasible(p, sp, r, t_gar) && (start == 0 || fabs(r - target) < fabs(start - target))) start = r;
      if (start == 0) continue;
      double r = start;
      if (!slsqp(p, sp, t_gar, r_max, start, &r)) r = start;
      int lo = (int)floor(r), hi = (int)ceil(r);
      if (lo < 1) lo = 1;
      if (hi > r_max) hi = r_max;
      consider(p, t_gar, lo, r, &best);
      consider(p, t_gar, hi, r, &best);
    }
    if (!isfinite(best.t)) consider(p, t_gar, 1, 1, &best);   // no sub-problem was feasible
  }
  best.kase = sched_case(p, best.r, t_gar);
  return best;
}

int sched_argmin_degree(double (*model)(const SchedPhase *, double, double), const SchedPhase *p,
                        double t_gar, int r_max) {
  int best = 1;
  double best_t = INFINITY;
  if (r_max > SCHED_R_MAX) r_max = SCHED_R_MAX;
  for (int r = 1; r <= r_max; r++) {
    double t = model(p, r, t_gar);
    if (t < best_t) {
      best_t = t;
      best = r;
    }
  }
  return best;
}

// ---- the planner ----

static double tutel_model(const SchedPhase *p, double r, double t_gar) { return sched_tutel_model(p, r); }

static double fsmoe_fmoe(const SchedLayerCost *c, int r_max, double t_gar) {
  return sched_find_degree(&c->phase[SCHED_BWD], t_gar, r_max, SCHED_METHOD_EXHAUSTIVE).t;
}

static double noiio_fmoe(const SchedLayerCost *c, int r_max, double t_gar) {
  const SchedPhase *p = &c->phase[SCHED_BWD];
  return sched_noiio_model(p, sched_argmin_degree(sched_noiio_model, p, t_gar, r_max), t_gar);
}

const char *const sched_choose_name[SCHED_NCHOOSE] = {"best", "slsqp", "model", "simulator"};

// fsmoe: Algorithm 1 both ways and the simulator's own scan; the simulator judges (lang/manual.md §8).
void sched_fsmoe_degree(const SchedLayerCost *c, int r_max, int ph, double grad_elems, SchedChoose choose,
                        SchedLayerPlan *lp) {
  const SchedPhase *p = &c->phase[ph];
  double t_gar = sched_ar_time(&c->ar, grad_elems);
  if (r_max > SCHED_R_MAX) r_max = SCHED_R_MAX;
  if (r_max < 1) r_max = 1;
  SchedDegree s = sched_find_degree(p, t_gar, r_max, SCHED_METHOD_SLSQP);
  SchedDegree e = sched_find_degree(p, t_gar, r_max, SCHED_METHOD_EXHAUSTIVE);
  double sim[SCHED_R_MAX + 1];
  int best = 1;
  for (int r = 1; r <= r_max; r++) {
    sim[r] = sched_sim_moe(IR_POLICY_FSMOE, c, ph, r, grad_elems);
    if (sim[r] < sim[best]) best = r;
  }
  lp->r_slsqp[ph] = s.r;
  lp->r_exhaustive[ph] = e.r;
  lp->r_sim[ph] = best;
  lp->t_sim_slsqp[ph] = sim[s.r];
  lp->t_sim_exhaustive[ph] = sim[e.r];
  lp->t_sim_sim[ph] = sim[best];
  int r = s.r;   // the paper's answer unless the rule or the simulator says otherwise
  lp->chosen_by[ph] = "slsqp";
  if (choose == SCHED_CHOOSE_MODEL || (choose == SCHED_CHOOSE_BEST && sim[e.r] < sim[r])) {
    r = e.r;
    lp->chosen_by[ph] = "model";
  }
  if (choose == SCHED_CHOOSE_SIMULATOR || (choose == SCHED_CHOOSE_BEST && sim[best] < sim[r])) {
    r = best;
    lp->chosen_by[ph] = "simulator";
  }
  lp->r[ph] = r;
  lp->kase[ph] = sched_case(p, r, t_gar);
  lp->t_model[ph] = sched_model_time(p, r, t_gar);
}

static void noiio_degree(const SchedLayerCost *c, int r_max, int ph, double grad_elems, SchedLayerPlan *lp) {
  const SchedPhase *p = &c->phase[ph];
  double t_gar = sched_ar_time(&c->ar, grad_elems);
  int r = sched_argmin_degree(sched_noiio_model, p, t_gar, r_max);
  lp->r[ph] = lp->r_slsqp[ph] = lp->r_exhaustive[ph] = r;
  lp->kase[ph] = 0;
  lp->t_model[ph] = sched_noiio_model(p, r, t_gar);
}

static const char *const grad_mode_name[] = {
    [SCHED_GRAD_STEP1] = "step1", [SCHED_GRAD_STEP12] = "step1+2",
    [SCHED_GRAD_DENSE_FIRST] = "dense-first", [SCHED_GRAD_NONE] = "none"};

// An explicit degree (st->r_fix) replaces the chosen one of phase ph, with the policy's model time.
static void fix_degree(const SchedStack *st, int i, int ph, IrPolicy pol, double t_gar, SchedLayerPlan *lp) {
  if (st->r_fix[ph] <= 0) return;
  int r = st->r_fix[ph] < st->r_max[i] ? st->r_fix[ph] : st->r_max[i];
  if (r < 1 || pol == IR_POLICY_SEQUENTIAL) r = 1;
  const SchedPhase *p = &st->cost[i].phase[ph];
  lp->r[ph] = r;
  lp->t_model[ph] = pol == IR_POLICY_FSMOE ? sched_model_time(p, r, t_gar)
                    : pol == IR_POLICY_FSMOE_NO_IIO ? sched_noiio_model(p, r, t_gar)
                    : pol == IR_POLICY_SEQUENTIAL ? sched_model_time(p, 1, 0)
                                                  : sched_tutel_model(p, r);
  if (pol == IR_POLICY_FSMOE) lp->kase[ph] = sched_case(p, r, t_gar);
  lp->chosen_by[ph] = "explicit";
}

// Simulates a plan in place; false on an internal error.
static bool simulate_plan(const SchedStack *st, SchedPlan *plan) {
  SchedProgram g = {0};
  bool ok = sched_build_program(st, plan, &g) && sched_simulate(&g);
  if (ok) {
    plan->t_fwd = g.t_fwd + st->t_fwd_other;
    plan->t_iter = g.makespan + st->t_fwd_other + st->t_bwd_other;
    plan->t_bwd = plan->t_iter - plan->t_fwd;
  }
  sched_program_free(&g);
  return ok;
}

// Remembers fsmoe degrees within one plan: identical layers with the same gradient load get the
// same answer, and the partition variants below ask again and again.
typedef struct Memo {
  const SchedLayerCost *c;
  int r_max, ph;
  SchedChoose choose;
  double grad;
  SchedLayerPlan lp;
} Memo;

typedef struct MemoTable {
  Memo *m;
  int n, cap;
} MemoTable;

static void copy_phase(SchedLayerPlan *dst, const SchedLayerPlan *src, int ph) {
  dst->r[ph] = src->r[ph];
  dst->r_slsqp[ph] = src->r_slsqp[ph];
  dst->r_exhaustive[ph] = src->r_exhaustive[ph];
  dst->r_sim[ph] = src->r_sim[ph];
  dst->kase[ph] = src->kase[ph];
  dst->chosen_by[ph] = src->chosen_by[ph];
  dst->t_model[ph] = src->t_model[ph];
  dst->t_sim_slsqp[ph] = src->t_sim_slsqp[ph];
  dst->t_sim_exhaustive[ph] = src->t_sim_exhaustive[ph];
  dst->t_sim_sim[ph] = src->t_sim_sim[ph];
}

static void memo_degree(MemoTable *t, const SchedLayerCost *c, int r_max, int ph, double grad, SchedChoose choose,
                        SchedLayerPlan *lp) {
  for (int i = 0; i < t->n; i++) {
    const Memo *m = &t->m[i];
    if (m->r_max == r_max && m->ph == ph && m->grad == grad && m->choose == choose &&
        (m->c == c || memcmp(m->c, c, sizeof *c) == 0)) {
      copy_phase(lp, &m->lp, ph);
      return;
    }
  }
  sched_fsmoe_degree(c, r_max, ph, grad, choose, lp);
  if (t->n == t->cap) {
    int cap = t->cap ? 2 * t->cap : 16;
    Memo *m = realloc(t->m, (size_t)cap * sizeof *m);
    if (!m) return;   // only a cache
    t->m = m;
    t->cap = cap;
  }
  t->m[t->n++] = (Memo){c, r_max, ph, choose, grad, *lp};
}

// fsmoe and fsmoe-no-iio: r per phase, gradient partition; every partition variant is
// simulated and the fastest kept (the simulator is the judge).
static bool plan_partitioned(const SchedStack *st, SchedPlan *plan) {
  MemoTable memo = {0};
  bool iio = plan->policy == IR_POLICY_FSMOE;
  int n = st->n;
  double *olp = calloc((size_t)n, sizeof *olp);
  SchedLayerPlan *best = calloc((size_t)n, sizeof *best);
  if (!olp || !best) {
    free(olp);
    free(best);
    return false;
  }
  for (int i = 0; i < n; i++) {
    const SchedLayerCost *c = &st->cost[i];
    SchedLayerPlan *lp = &plan->layer[i];
    if (iio) memo_degree(&memo, c, st->r_max[i], SCHED_FWD, 0, st->choose, lp);
    else noiio_degree(c, st->r_max[i], SCHED_FWD, 0, lp);
    fix_degree(st, i, SCHED_FWD, plan->policy, 0, lp);
    const SchedPhase *b = &c->phase[SCHED_BWD];
    if (iio) olp[i] = sched_olp_moe(b, sched_find_degree(b, 0, st->r_max[i], SCHED_METHOD_EXHAUSTIVE).r);
    else olp[i] = sched_noiio_olp(b, sched_argmin_degree(sched_noiio_model, b, 0, st->r_max[i]));
  }
  static const SchedGradMode modes[] = {SCHED_GRAD_STEP12, SCHED_GRAD_STEP1, SCHED_GRAD_DENSE_FIRST, SCHED_GRAD_NONE};
  double best_t = INFINITY, best_fwd = 0, best_tail = 0;
  const char *best_mode = NULL;
  bool ok = true;
  for (int m = st->quick ? 1 : 0; m < 4 && ok; m++) {
    SchedGradPart gp = {0};
    if (!sched_gradpart(st, iio ? fsmoe_fmoe : noiio_fmoe, olp, modes[m], &gp)) {
      ok = false;
      break;
    }
    for (int i = 0; i < n; i++) {
      SchedLayerPlan *lp = &plan->layer[i];
      lp->grad_moe = gp.moe[i];
      lp->grad_dense = gp.dense[i];
      lp->t_gar = sched_ar_time(&st->cost[i].ar, gp.moe[i]);
      if (iio) memo_degree(&memo, &st->cost[i], st->r_max[i], SCHED_BWD, gp.moe[i], st->choose, lp);
      else noiio_degree(&st->cost[i], st->r_max[i], SCHED_BWD, gp.moe[i], lp);
      fix_degree(st, i, SCHED_BWD, plan->policy, lp->t_gar, lp);
    }
    plan->grad_tail = gp.tail;
    sched_gradpart_free(&gp);
    if (!simulate_plan(st, plan)) {
      ok = false;
      break;
    }
    if (plan->t_iter < best_t) {
      best_t = plan->t_iter;
      best_fwd = plan->t_fwd;
      best_tail = plan->grad_tail;
      best_mode = grad_mode_name[modes[m]];
      memcpy(best, plan->layer, (size_t)n * sizeof *best);
    }
  }
  if (ok) {
    memcpy(plan->layer, best, (size_t)n * sizeof *best);
    plan->grad_tail = best_tail;
    plan->partition = best_mode;
    plan->t_iter = best_t;
    plan->t_fwd = best_fwd;
    plan->t_bwd = best_t - best_fwd;
  }
  free(olp);
  free(best);
  free(memo.m);
  return ok;
}

static bool plan_stack(const SchedStack *st, IrPolicy pol, SchedPlan *out);

// The policies that overlap computation with communication plan with both slower by the
// cluster's overlap slowdowns (st->slow_compute, slow_comm: measured by `moec tune`'s overlap
// probe), on the chunks that overlap (SchedPhase.slow_exp, slow_comm); sequential runs one thing
// at a time and keeps the plain costs.
static bool plan_slowed(const SchedStack *st, IrPolicy pol, SchedPlan *out) {
  if (pol == IR_POLICY_SEQUENTIAL || (st->slow_compute <= 0 && st->slow_comm <= 0) || st->n <= 0)
    return plan_stack(st, pol, out);
  SchedLayerCost *slowed = malloc((size_t)st->n * sizeof *slowed);
  if (!slowed) {
    *out = (SchedPlan){.policy = pol};
    return false;
  }
  for (int i = 0; i < st->n; i++) {
    slowed[i] = st->cost[i];
    for (int ph = 0; ph < 2; ph++) {
      // Each slows by the probe's factor times the share of it the other can cover (at r = 1).
      SchedPhase *p = &slowed[i].phase[ph];
      SchedChunk t = sched_chunk(p, 1);
      double compute = t.exp, comm = 2 * t.a2a + t.ag + t.rs;
      p->slow_exp = compute > 0 ? st->slow_compute * fmin(1, comm / compute) : 0;
      p->slow_comm = comm > 0 ? st->slow_comm * fmin(1, compute / comm) : 0;
    }
  }
  SchedStack copy = *st;
  copy.cost = slowed;
  bool ok = plan_stack(&copy, pol, out);
  free(slowed);
  return ok;
}

// Shared chunks: a backward run at its forward's degree reads the forward's chunks of the saved
// activations in place, so the forward does not assemble them (SchedPhase.t_level_shared). The
// plan of the policy's rule is kept unless the same degree in both phases, priced without that
// assembly, simulates faster: every degree the plan chose, and tutel's, is tried in both phases
// of every layer.
// Explicit equal degrees are priced without it.
bool sched_plan(const SchedStack *st, IrPolicy pol, SchedPlan *out) {
  if (!plan_slowed(st, pol, out)) return false;
  bool any = false;
  for (int i = 0; i < st->n; i++) any |= st->cost[i].phase[SCHED_FWD].t_level_shared > 0;
  bool fixed = st->r_fix[0] > 0 || st->r_fix[1] > 0;
  if (pol == IR_POLICY_SEQUENTIAL || !any || (fixed && st->r_fix[0] != st->r_fix[1])) return true;
  SchedLayerCost *shared = malloc((size_t)st->n * sizeof *shared);
  int *tried = calloc((size_t)3 * (size_t)st->n + 1, sizeof *tried);
  if (!shared || !tried) {
    free(shared);
    free(tried);
    return true;   // the plan without shared chunks stands (its price is an upper bound)
  }
  for (int i = 0; i < st->n; i++) {
    shared[i] = st->cost[i];
    SchedPhase *f = &shared[i].phase[SCHED_FWD];
    f->t_level = fmax(0, f->t_level - f->t_level_shared);
  }
  // The candidate degrees: the policy plan's, and the one degree PipeMoE's rule gives each
  // layer (tutel's plan; for tutel itself, the plan's own), so that a policy with more streams
  // is never planned slower than tutel's degrees would run on it.
  SchedPlan tutel = {0};
  bool have_tutel = !fixed && pol != IR_POLICY_TUTEL && plan_slowed(st, IR_POLICY_TUTEL, &tutel);
  int ntried = 0;
  for (int i = 0; i < st->n; i++)
    for (int ph = 0; ph < 3; ph++) {
      if (ph == 2 && !have_tutel) continue;
      int x = fixed ? st->r_fix[0] : ph < 2 ? out->layer[i].r[ph] : tutel.layer[i].r[SCHED_FWD];
      bool seen = x < 2;
      for (int k = 0; k < ntried && !seen; k++) seen = tried[k] == x;
      if (!seen) tried[ntried++] = x;
    }
  sched_plan_free(&tutel);
  bool ok = true;
  for (int k = 0; ok && k < ntried; k++) {
    int x = tried[k];
    SchedStack c = *st;
    c.cost = shared;
    c.r_fix[0] = c.r_fix[1] = x;
    SchedPlan p = {0};
    if (!(ok = plan_slowed(&c, pol, &p))) {
      sched_plan_free(&p);
      break;
    }
    if (fixed || p.t_iter < out->t_iter) {
      for (int l = 0; !fixed && l < p.nlayers; l++)
        p.layer[l].chosen_by[SCHED_FWD] = p.layer[l].chosen_by[SCHED_BWD] = "shared chunks";
      sched_plan_free(out);
      *out = p;
    } else {
      sched_plan_free(&p);
    }
  }
  free(shared);
  free(tried);
  return ok;
}

static bool plan_stack(const SchedStack *st, IrPolicy pol, SchedPlan *out) {
  *out = (SchedPlan){.policy = pol, .nlayers = st->n};
  out->layer = calloc((size_t)(st->n > 0 ? st->n : 1), sizeof *out->layer);
  if (!out->layer) return false;
  if (pol == IR_POLICY_FSMOE || pol == IR_POLICY_FSMOE_NO_IIO) return plan_partitioned(st, out);

  double total_grad = 0;
  for (int i = 0; i < st->n; i++) {
    const SchedLayerCost *c = &st->cost[i];
    SchedLayerPlan *lp = &out->layer[i];
    int r = 1;
    if (pol != IR_POLICY_SEQUENTIAL) r = sched_argmin_degree(tutel_model, &c->phase[SCHED_FWD], 0, st->r_max[i]);
    for (int ph = 0; ph < 2; ph++) {
      lp->r[ph] = lp->r_slsqp[ph] = lp->r_exhaustive[ph] = r;   // tutel reuses the forward r
      lp->t_model[ph] = pol == IR_POLICY_SEQUENTIAL ? sched_model_time(&c->phase[ph], 1, 0)
                                                : sched_tutel_model(&c->phase[ph], r);
      fix_degree(st, i, ph, pol, 0, lp);
    }
    total_grad += c->n_grad;
  }
  // Where the gradients go (for the report; the program builder places them the same way).
  out->grad_tail = total_grad;
  out->partition = "after backward";
  if (pol == IR_POLICY_TUTEL_IMPROVED) {
    out->partition = "next dense backward";
    for (int i = 0; i + 1 < st->n; i++) out->layer[i].grad_dense = st->cost[i + 1].n_grad;
    out->grad_tail = st->n > 0 ? st->cost[0].n_grad : 0;
  } else if (pol == IR_POLICY_PIPEMOE_LINA) {
    out->partition = "30 MB chunks, low priority";
    out->grad_tail = 0;
  }
  return simulate_plan(st, out);
}

void sched_plan_free(SchedPlan *p) {
  free(p->layer);
  p->layer = NULL;
}
