// The `pipeline` pass (lang/manual.md §8 and §14): the pipeline degree r of every MoE layer and
// phase, written on the layer's functions as attribute r (the schedule pass chunks by it).
//
// `schedule { pipeline { forward N; backward M; } }` gives every layer N and M. With
// `pipeline auto` the planner chooses per layer and phase, for the model's policy, from the
// costs the `cost` pass put on the ops (so a cluster profile is needed), taken as the stack
// pass_stack builds (passes/cost.c; `moec plan` plans the same stack): sched_plan runs the
// policy's rule (fsmoe: Algorithm 1 by SLSQP, the case model at every integer r and the
// simulator's own judgement, the fastest in simulation kept; fsmoe-no-iio: its one-stream
// model; tutel and its variants: PipeMoE's forward r reused backward; sequential: 1) together
// with the gradient partition, and simulates the stack. r is searched in 1..min(C, 32), C the
// slots per expert of the layer's expert region. What the plan decided goes on the functions:
//   forward:  r, case (fsmoe), t_model (ms, the policy's model of the MoE part at r)
//   backward: the same, grad_moe and grad_dense (gradient elements all-reduced in the layer's
//             MoE and dense overlap slots; the gradpart pass places them)
// and on the module: grad_tail (elements left for after the backward pass), partition (how
// the gradients were placed) and the simulated t_fwd_pred, t_bwd_pred, t_iter_pred (ms).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pass.h"

static void set_r(IrFunc *f, int64_t r) {
  if (f) ir_attrs_set_int(f->attrs, &f->nattrs, "r", r);
}

static void report(FILE *log, const PassLayer *l, int n, const SchedPlan *plan, const SchedCluster *c, double ms);

// Explicit degrees with a cluster profile: the plan those degrees make, priced and simulated as
// `pipeline auto` prices its own (the predicted step of a model written by hand: t_iter_pred on the
// module, which moec build's memory choices compare: ctx->plan_step; the report with -v).
static void price_explicit(IrModule *m, PassCtx *ctx, int64_t r_fwd, int64_t r_bwd) {
  IrPolicy pol;
  if (!(ctx->verbose || ctx->plan_step) || !ctx->cluster || !ir_policy_parse(ir_mod_str(m, "policy", "sequential"), &pol)) return;
  PassStack s;
  if (!pass_stack(m, ctx->cluster, &s)) return;
  SchedPlan plan = {0};
  SchedStack st = {.n = s.n, .cost = s.cost, .r_max = s.r_max, .choose = SCHED_CHOOSE_BEST,
                   .t_fwd_other = s.t_fwd_other, .t_bwd_other = s.t_bwd_other,
                   .slow_compute = ctx->cluster->overlap_compute, .slow_comm = ctx->cluster->overlap_comm,
                   .r_fix = {(int)r_fwd, (int)r_bwd}};
  if (s.n > 0 && sched_plan(&st, pol, &plan)) {
    ir_attrs_set_float(m->attrs, &m->nattrs, "t_fwd_pred", plan.t_fwd);
    ir_attrs_set_float(m->attrs, &m->nattrs, "t_iter_pred", plan.t_iter);
    if (ctx->verbose) report(ctx->log ? ctx->log : stderr, s.layer, s.n, &plan, ctx->cluster, 0);
  }
  sched_plan_free(&plan);
  pass_stack_free(&s);
}

static bool explicit_degrees(IrModule *m, PassCtx *ctx) {
  int64_t r_fwd = ir_mod_int(m, "r_fwd", 1), r_bwd = ir_mod_int(m, "r_bwd", 1);
  price_explicit(m, ctx, r_fwd, r_bwd);
  if (r_fwd == 1 && r_bwd == 1) return true;
  PassLayer *l;
  int n = pass_find_layers(m, &l);
  if (n < 0) return ir_oom(ctx->d);
  for (int i = 0; i < n; i++) {
    set_r(l[i].fwd, r_fwd);
    set_r(l[i].bwd, r_bwd);
  }
  free(l);
  return true;
}

static void set_phase(IrModule *m, IrFunc *f, const SchedLayerPlan *lp, int ph, bool fsmoe) {
  if (!f) return;
  set_r(f, lp->r[ph]);
  if (fsmoe) {
    ir_attrs_set_int(f->attrs, &f->nattrs, "case", lp->kase[ph]);
    ir_attrs_set_str(m, f->attrs, &f->nattrs, "chosen_by", lp->chosen_by[ph] ? lp->chosen_by[ph] : "model");
  }
  ir_attrs_set_float(f->attrs, &f->nattrs, "t_model", lp->t_model[ph]);
  if (ph == SCHED_BWD) {
    if (lp->grad_moe > 0) ir_attrs_set_int(f->attrs, &f->nattrs, "grad_moe", llround(lp->grad_moe));
    if (lp->grad_dense > 0) ir_attrs_set_int(f->attrs, &f->nattrs, "grad_dense", llround(lp->grad_dense));
  }
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void report(FILE *log, const PassLayer *l, int n, const SchedPlan *plan, const SchedCluster *c, double ms) {
  fprintf(log, "# pipeline: policy %s on cluster '%s' (%d x %d), planned in %.2f ms\n", ir_policy_name[plan->policy],
          c->name, c->nodes, c->gpus_per_node, ms);
  fprintf(log, "#   %-20s %6s %6s %6s %10s %10s %12s %12s\n", "layer", "C", "r_fwd", "r_bwd", "t_fwd ms", "t_bwd ms",
          "grad_moe", "grad_dense");
  for (int i = 0; i < n; i++) {
    const SchedLayerPlan *lp = &plan->layer[i];
    int len = (int)strlen(l[i].name) - 4;   // without ".fwd"
    fprintf(log, "#   %-20.*s %6lld %6d %6d %10.4f %10.4f %12.0f %12.0f\n", len, l[i].name, (long long)l[i].capacity,
            lp->r[SCHED_FWD], lp->r[SCHED_BWD], lp->t_model[SCHED_FWD], lp->t_model[SCHED_BWD], lp->grad_moe,
            lp->grad_dense);
  }
  fprintf(log, "#   the layers' gradients after the backward pass: %.0f elements; partition: %s\n", plan->grad_tail,
          plan->partition ? plan->partition : "-");
  fprintf(log, "#   simulated step: forward %.4f ms, backward %.4f ms, iteration %.4f ms\n", plan->t_fwd, plan->t_bwd,
          plan->t_iter);
  // The same, machine-readable (tests/plan_build.sh holds it against `moec plan --json`).
  const char *pol = ir_policy_name[plan->policy];
  for (int i = 0; i < n; i++) {
    const SchedLayerPlan *lp = &plan->layer[i];
    fprintf(log, "# pipeline-plan %s layer %.*s r %d %d t_model %.9g %.9g grad %.0f %.0f\n", pol,
            (int)strlen(l[i].name) - 4, l[i].name, lp->r[SCHED_FWD], lp->r[SCHED_BWD], lp->t_model[SCHED_FWD],
            lp->t_model[SCHED_BWD], lp->grad_moe, lp->grad_dense);
  }
  fprintf(log, "# pipeline-plan %s step %.9g %.9g %.9g tail %.0f partition %s\n", pol, plan->t_fwd, plan->t_bwd,
          plan->t_iter, plan->grad_tail, plan->partition ? plan->partition : "-");
}

bool pass_pipeline(IrModule *m, PassCtx *ctx) {
  if (strcmp(ir_mod_str(m, "pipeline", ""), "auto") != 0) return explicit_degrees(m, ctx);
  const SchedCluster *c = ctx->cluster;
  if (!c)
    return ir_error(ctx->d, "pipeline auto plans with a cluster profile: add 'cluster \"FILE\";' to the model or "
                            "pass --cluster FILE");
  IrPolicy pol;
  if (!ir_policy_parse(ir_mod_str(m, "policy", "sequential"), &pol))
    return ir_error(ctx->d, "pipeline: unknown policy '%s'", ir_mod_str(m, "policy", "sequential"));
  PassStack s;
  if (!pass_stack(m, c, &s)) return ir_oom(ctx->d);
  bool ok = true;
  SchedPlan plan = {0};
  double t0 = 0;
  if (s.n > 0) {
    SchedStack st = {.n = s.n, .cost = s.cost, .r_max = s.r_max, .choose = SCHED_CHOOSE_BEST,
                     .t_fwd_other = s.t_fwd_other, .t_bwd_other = s.t_bwd_other,
                     .slow_compute = c->overlap_compute, .slow_comm = c->overlap_comm};
    t0 = now_ms();
    ok = sched_plan(&st, pol, &plan);
    t0 = now_ms() - t0;
    if (!ok) ir_internal(ctx->d, "pipeline: the planner failed");
  }
  if (ok && s.n > 0) {
    bool fsmoe = pol == IR_POLICY_FSMOE;
    for (int i = 0; i < s.n; i++) {
      set_phase(m, s.layer[i].fwd, &plan.layer[i], SCHED_FWD, fsmoe);
      set_phase(m, s.layer[i].bwd, &plan.layer[i], SCHED_BWD, fsmoe);
    }
    ir_attrs_set_int(m->attrs, &m->nattrs, "grad_tail", llround(plan.grad_tail));
    ir_attrs_set_str(m, m->attrs, &m->nattrs, "partition", plan.partition ? plan.partition : "after backward");
    ir_attrs_set_float(m->attrs, &m->nattrs, "t_fwd_pred", plan.t_fwd);
    ir_attrs_set_float(m->attrs, &m->nattrs, "t_bwd_pred", plan.t_bwd);
    ir_attrs_set_float(m->attrs, &m->nattrs, "t_iter_pred", plan.t_iter);
    if (ctx->verbose) report(ctx->log ? ctx->log : stderr, s.layer, s.n, &plan, c, t0);
  }
  sched_plan_free(&plan);
  pass_stack_free(&s);
  return ok;
}
