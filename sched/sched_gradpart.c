// The dense-gradient partition of FSMoE (paper §5, lang/manual.md §8).
//
// The backward pass visits the generalized layers last to first: layer i's MoE, then its
// attention, whose weight gradients (n_grad[i] elements) are then ready for the DP AllReduce.
// They can ride in two overlap slots of each layer j < i, visited after i: the inter-node
// idle time inside j's backward MoE (t_olp,moe of Case 2/3/4) and j's dense backward. The
// gradients of layer 0 come last and have no slot left. Gradient is consumed first-in
// first-out, so a slot only ever holds gradient that already exists (the causality constraint
// of eq. (5)). Besides the paper's steps, DENSE_FIRST and NONE are variants the planner also
// simulates, keeping the fastest.
//
// Step 1 (eqs. (3)-(4)): fill each slot in visiting order with as much pending gradient as its
// overlappable time carries, n = g_inv(min(t_grad(pending), t_olp)); the rest stays pending.
// Step 2: what is still pending would be all-reduced after the backward pass, fully exposed.
// Some of it can instead go into MoE slots, making those layers slower (Algorithm 1 re-run with
// the larger t_gar, f_moe) but hiding the rest. Variable u_i in [0, 1] is the share of the
// gradient left pending at layer i's MoE slot that is put there on top of step 1; a global
// optimiser (NLopt GN_ISRES, fixed seed: deterministic) minimises the modelled backward time
//   sum_i [ f_moe_i(t_grad(x_moe_i)) + max(t_att_bwd_i, t_grad(x_dense_i)) ] + t_grad(tail).
// The [0,1] parametrisation keeps every point causal, so only bound constraints remain. The
// step-1 point (u = 0) and u = 1 are always evaluated too; the best of all is kept.
#include <math.h>
#include <nlopt.h>
#include <stdlib.h>

#include "sched.h"

#define STEP2_SEED 20250401u
#define STEP2_EVALS_PER_DIM 60

static double fill(const SchedCoef *ar, double pending, double t) {
  if (pending <= 0) return 0;
  return fmin(pending, sched_ar_elems(ar, t));
}

// Runs the visiting order with extra MoE shares u (NULL: none); writes moe/dense/tail.
static void distribute(const SchedStack *st, const double *olp, SchedGradMode mode, const double *u,
                       double *moe, double *dense, double *tail) {
  double pending = 0;
  for (int i = st->n - 1; i >= 0; i--) {
    const SchedLayerCost *c = &st->cost[i];
    double t_dense = c->phase[SCHED_BWD].t_att;
    moe[i] = dense[i] = 0;
    if (mode == SCHED_GRAD_DENSE_FIRST) {
      dense[i] = fill(&c->ar, pending, t_dense);
      moe[i] = fill(&c->ar, pending - dense[i], olp[i]);
      pending -= dense[i] + moe[i];
    } else if (mode != SCHED_GRAD_NONE) {
      moe[i] = fill(&c->ar, pending, olp[i]);
      if (u) moe[i] += u[i] * (pending - moe[i]);
      pending -= moe[i];
      dense[i] = fill(&c->ar, pending, t_dense);
      pending -= dense[i];
    }
    pending += c->n_grad;
  }
  *tail = pending;
}

double sched_gradpart_time(const SchedStack *st, SchedMoeFn f_moe, const double *moe, const double *dense,
                           double tail) {
  double t = 0;
  for (int i = 0; i < st->n; i++) {
    const SchedLayerCost *c = &st->cost[i];
    t += f_moe(c, st->r_max[i], sched_ar_time(&c->ar, moe[i]));
    t += fmax(c->phase[SCHED_BWD].t_att, sched_ar_time(&c->ar, dense[i]));
  }
  // The tail is one AllReduce after the backward pass (all layers' AllReduce fits are equal).
  if (st->n > 0) t += sched_ar_time(&st->cost[0].ar, tail);
  return t;
}

typedef struct Step2 {
  const SchedStack *st;
  SchedMoeFn f_moe;
  const double *olp;
  double *u, *moe, *dense;   // scratch
  const int *var;            // variable k -> layer
  int nvar;
} Step2;

static double step2_objective(unsigned n, const double *x, double *grad, void *data) {
  Step2 *s = data;
  for (int i = 0; i < s->st->n; i++) s->u[i] = 0;
  for (int k = 0; k < s->nvar; k++) s->u[s->var[k]] = x[k];
  double tail;
  distribute(s->st, s->olp, SCHED_GRAD_STEP12, s->u, s->moe, s->dense, &tail);
  return sched_gradpart_time(s->st, s->f_moe, s->moe, s->dense, tail);
}

bool sched_gradpart(const SchedStack *st, SchedMoeFn f_moe, const double *olp, SchedGradMode mode,
                    SchedGradPart *out) {
  int n = st->n;
  *out = (SchedGradPart){0};
  out->moe = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
  out->dense = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
  if (!out->moe || !out->dense) return false;
  distribute(st, olp, mode, NULL, out->moe, out->dense, &out->tail);
  out->t_model = sched_gradpart_time(st, f_moe, out->moe, out->dense, out->tail);
  if (mode != SCHED_GRAD_STEP12 || out->tail <= 0) return true;

  // Step 2: variables for the MoE slots that see pending gradient after step 1.
  double *scratch = calloc((size_t)(4 * n + 1), sizeof(double));
  int *var = calloc((size_t)n + 1, sizeof(int));
  if (!scratch || !var) {
    free(scratch);
    free(var);
    return false;
  }
  Step2 s = {st, f_moe, olp, scratch, scratch + n, scratch + 2 * n, var, 0};
  double pending = 0;
  for (int i = n - 1; i >= 0; i--) {
    if (pending - out->moe[i] > 0) var[s.nvar++] = i;
    pending += st->cost[i].n_grad - out->moe[i] - out->dense[i];
  }
  if (s.nvar > 0) {
    double *x = scratch + 3 * n, best_t = out->t_model;
    double *best_u = calloc((size_t)n, sizeof(double));
    if (!best_u) {
      free(scratch);
      free(var);
      return false;
    }
    // u = 1 everywhere: as much as can ride inside the MoE layers.
    for (int k = 0; k < s.nvar; k++) x[k] = 1;
    double t1 = step2_objective((unsigned)s.nvar, x, NULL, &s);
    if (t1 < best_t) {
      best_t = t1;
      for (int k = 0; k < s.nvar; k++) best_u[var[k]] = 1;
    }
    // The optimiser's own result code does not matter: its last point is judged like the others.
    nlopt_srand(STEP2_SEED);
    nlopt_opt o = nlopt_create(NLOPT_GN_ISRES, (unsigned)s.nvar);
    double *lb = calloc((size_t)s.nvar, sizeof(double)), *ub = calloc((size_t)s.nvar, sizeof(double));
    if (o && lb && ub) {
      for (int k = 0; k < s.nvar; k++) {
        ub[k] = 1;
        x[k] = 0;
      }
      nlopt_set_lower_bounds(o, lb);
      nlopt_set_upper_bounds(o, ub);
      nlopt_set_min_objective(o, step2_objective, &s);
      nlopt_set_maxeval(o, STEP2_EVALS_PER_DIM * s.nvar + 40);
      double f;
      nlopt_optimize(o, x, &f);
      for (int k = 0; k < s.nvar; k++) x[k] = fmin(fmax(x[k], 0), 1);
      double t = step2_objective((unsigned)s.nvar, x, NULL, &s);
      if (t < best_t) {
        best_t = t;
        for (int k = 0; k < s.nvar; k++) best_u[var[k]] = x[k];
      }
    }
    free(lb);
    free(ub);
    if (o) nlopt_destroy(o);
    distribute(st, olp, SCHED_GRAD_STEP12, best_u, out->moe, out->dense, &out->tail);
    out->t_model = sched_gradpart_time(st, f_moe, out->moe, out->dense, out->tail);
    free(best_u);
  }
  free(scratch);
  free(var);
  return true;
}

void sched_gradpart_free(SchedGradPart *g) {
  free(g->moe);
  free(g->dense);
  g->moe = g->dense = NULL;
}
