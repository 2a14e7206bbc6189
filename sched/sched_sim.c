// Stream programs of the six policies and the discrete-event simulator that judges them.
//
// A program is a list of ops in issue order. Each op sits on a stream (an in-order queue, as a
// CUDA stream: it starts after the stream's previous op has finished) and occupies one
// resource while it runs: the GPU (attention, experts), the intra-node link (ESP AllGather /
// ReduceScatter) or the inter-node link (AlltoAll and the gradient AllReduce, which therefore
// contend). An op starts when its dependencies have finished, its stream is free and its
// resource is free; when several streams want one resource, the lower priority value wins
// (AlltoAll before AllReduce, Lina's rule), then the op that was ready first, then issue order.
// Ops are never preempted. Everything is deterministic.
//
// The MoE layer of a phase, cut into r chunks (D dispatch AlltoAll, G AllGather, E experts,
// S ReduceScatter, C combine AlltoAll; chunk j: D_j -> G_j -> E_j -> S_j -> C_j):
//   fsmoe          inter: D1..Dr [AR] C1..Cr   intra: G1..Gr S1..Sr   compute: E1..Er
//   one comm stream (tutel, tutel-improved, pipemoe-lina, fsmoe-no-iio):
//                  comm: D1 G1 .. Dr Gr [AR] S1 C1 .. Sr Cr           compute: E1..Er
//   sequential     everything on one stream (r = 1)
// [AR] is the gradient AllReduce that rides inside the MoE layer (fsmoe and fsmoe-no-iio
// backward: "Gradient-AllReduce follows the AlltoAll dispatch of the last chunk", paper §4).
// Layers run in order (attention, MoE); backward visits them last to first (MoE, attention).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sched.h"

const char *const sched_op_name[SCHED_NOPKINDS] = {
    [SCHED_OP_ATTENTION] = "attention", [SCHED_OP_DISPATCH] = "dispatch",
    [SCHED_OP_ALLGATHER] = "allgather", [SCHED_OP_EXPERT] = "experts",
    [SCHED_OP_REDUCESCATTER] = "reducescatter", [SCHED_OP_COMBINE] = "combine",
    [SCHED_OP_ALLREDUCE] = "allreduce"};

const char *const sched_resource_name[SCHED_NRES] = {"compute", "intra", "inter"};

enum { PRIO_ALLTOALL = 0, PRIO_ALLREDUCE = 1 };

// The stream of each role under a policy.
typedef struct Streams {
  int compute, intra, inter, allreduce;
} Streams;

static Streams streams_of(IrPolicy pol, SchedProgram *g) {
  Streams s;
  switch (pol) {
  case IR_POLICY_SEQUENTIAL:
    g->nstreams = 1;
    g->stream_name[0] = "main";
    s = (Streams){0, 0, 0, 0};
    break;
  case IR_POLICY_FSMOE:
    g->nstreams = 3;
    g->stream_name[0] = "compute";
    g->stream_name[1] = "intra";
    g->stream_name[2] = "inter";
    s = (Streams){0, 1, 2, 2};
    break;
  case IR_POLICY_PIPEMOE_LINA:
    g->nstreams = 3;
    g->stream_name[0] = "compute";
    g->stream_name[1] = "comm";
    g->stream_name[2] = "allreduce";
    s = (Streams){0, 1, 1, 2};
    break;
  default:   // tutel, tutel-improved, fsmoe-no-iio
    g->nstreams = 2;
    g->stream_name[0] = "compute";
    g->stream_name[1] = "comm";
    s = (Streams){0, 1, 1, 1};
    break;
  }
  return s;
}

static int add(SchedProgram *g, SchedOpKind kind, int layer, int phase, int chunk, int stream,
               SchedResource res, double dur, double elems, int dep0, int dep1) {
  if (g->nops == g->cap) {
    int cap = g->cap ? 2 * g->cap : 256;
    SchedOp *op = realloc(g->op, (size_t)cap * sizeof *op);
    if (!op) return -1;
    g->op = op;
    g->cap = cap;
  }
  SchedOp *o = &g->op[g->nops];
  *o = (SchedOp){.kind = kind, .layer = layer, .phase = phase, .chunk = chunk, .stream = stream, .res = res,
                 .prio = kind == SCHED_OP_ALLREDUCE ? PRIO_ALLREDUCE : PRIO_ALLTOALL,
                 .dur = dur, .elems = elems, .start = NAN, .end = NAN};
  if (dep0 >= 0) o->deps[o->ndeps++] = dep0;
  if (dep1 >= 0 && dep1 != dep0) o->deps[o->ndeps++] = dep1;
  return g->nops++;
}

// Appends one MoE layer of a phase; returns the index of its last combine (or -1 on no memory).
// grad_elems > 0: an AllReduce after the last dispatch, waiting also for op grad_dep.
static int add_moe(SchedProgram *g, Streams s, const SchedLayerCost *c, int layer, int phase, int r, int dep,
                   double grad_elems, int grad_dep) {
  const SchedPhase *p = &c->phase[phase];
  SchedChunk t = sched_chunk(p, r);
  int *exp = malloc((size_t)r * sizeof *exp);
  if (!exp) return -1;
  int last = -1, ok = 1;
  for (int j = 0; j < r; j++) {
    int d = add(g, SCHED_OP_DISPATCH, layer, phase, j, s.inter, SCHED_RES_INTER, t.a2a, p->n_a2a / r, dep, -1);
    int a = add(g, SCHED_OP_ALLGATHER, layer, phase, j, s.intra, SCHED_RES_INTRA, t.ag, p->n_ag / r, d, -1);
    // The last chunk's experts carry what the chunking adds after them (sums, assembly).
    double dur = t.exp + (j == r - 1 ? sched_assembly(p, r) : 0);
    exp[j] = add(g, SCHED_OP_EXPERT, layer, phase, j, s.compute, SCHED_RES_COMPUTE, dur, p->n_exp / r, a, -1);
    ok &= d >= 0 && a >= 0 && exp[j] >= 0;
  }
  if (grad_elems > 0)
    ok &= add(g, SCHED_OP_ALLREDUCE, layer, phase, 0, s.allreduce, SCHED_RES_INTER, sched_ar_time(&c->ar, grad_elems),
              grad_elems, grad_dep, -1) >= 0;
  for (int j = 0; j < r && ok; j++) {
    int rs = add(g, SCHED_OP_REDUCESCATTER, layer, phase, j, s.intra, SCHED_RES_INTRA, t.rs, p->n_rs / r, exp[j], -1);
    last = add(g, SCHED_OP_COMBINE, layer, phase, j, s.inter, SCHED_RES_INTER, t.a2a, p->n_a2a / r, rs, -1);
    ok &= rs >= 0 && last >= 0;
  }
  free(exp);
  return ok ? last : -1;
}

static int add_allreduce(SchedProgram *g, Streams s, const SchedCoef *ar, int layer, int chunk, double elems,
                         int dep) {
  return add(g, SCHED_OP_ALLREDUCE, layer, SCHED_BWD, chunk, s.allreduce, SCHED_RES_INTER, sched_ar_time(ar, elems),
             elems, dep, -1);
}

bool sched_build_program(const SchedStack *st, const SchedPlan *plan, SchedProgram *out) {
  *out = (SchedProgram){0};
  IrPolicy pol = plan->policy;
  Streams s = streams_of(pol, out);
  int n = st->n, prev = -1;
  bool partitioned = pol == IR_POLICY_FSMOE || pol == IR_POLICY_FSMOE_NO_IIO;
  int *att_bwd = calloc((size_t)(n > 0 ? n : 1), sizeof *att_bwd);
  if (!att_bwd) return false;
  bool ok = true;
  for (int i = 0; i < n && ok; i++) {
    const SchedLayerCost *c = &st->cost[i];
    int att = add(out, SCHED_OP_ATTENTION, i, SCHED_FWD, 0, s.compute, SCHED_RES_COMPUTE, c->phase[SCHED_FWD].t_att,
                  0, prev, -1);
    prev = add_moe(out, s, c, i, SCHED_FWD, plan->layer[i].r[SCHED_FWD], att, 0, -1);
    ok = att >= 0 && prev >= 0;
  }
  for (int i = n - 1; i >= 0 && ok; i--) {
    const SchedLayerCost *c = &st->cost[i];
    const SchedLayerPlan *lp = &plan->layer[i];
    int grad_dep = i + 1 < n ? att_bwd[i + 1] : -1;   // gradients of the layers visited before
    int last = add_moe(out, s, c, i, SCHED_BWD, lp->r[SCHED_BWD], prev, partitioned ? lp->grad_moe : 0, grad_dep);
    att_bwd[i] = add(out, SCHED_OP_ATTENTION, i, SCHED_BWD, 0, s.compute, SCHED_RES_COMPUTE,
                     c->phase[SCHED_BWD].t_att, 0, last, -1);
    ok = last >= 0 && att_bwd[i] >= 0;
    if (partitioned && lp->grad_dense > 0)
      ok &= add_allreduce(out, s, &c->ar, i, 1, lp->grad_dense, grad_dep) >= 0;
    if (pol == IR_POLICY_TUTEL_IMPROVED && i + 1 < n && st->cost[i + 1].n_grad > 0)
      ok &= add_allreduce(out, s, &st->cost[i + 1].ar, i + 1, 0, st->cost[i + 1].n_grad, att_bwd[i + 1]) >= 0;
    if (pol == IR_POLICY_PIPEMOE_LINA && c->n_grad > 0) {
      double chunk = SCHED_LINA_CHUNK_BYTES / SCHED_GRAD_BYTES;
      int k = 0;
      for (double left = c->n_grad; left > 0 && ok; left -= chunk, k++)
        ok &= add_allreduce(out, s, &c->ar, i, k, fmin(left, chunk), att_bwd[i]) >= 0;
    }
    prev = att_bwd[i];
  }
  // What is left is all-reduced after the backward pass.
  if (ok && (pol == IR_POLICY_SEQUENTIAL || pol == IR_POLICY_TUTEL)) {
    for (int i = n - 1; i >= 0 && ok; i--)
      if (st->cost[i].n_grad > 0) ok &= (prev = add_allreduce(out, s, &st->cost[i].ar, i, 0, st->cost[i].n_grad, prev)) >= 0;
  } else if (ok && pol == IR_POLICY_TUTEL_IMPROVED && n > 0 && st->cost[0].n_grad > 0) {
    ok &= add_allreduce(out, s, &st->cost[0].ar, 0, 0, st->cost[0].n_grad, prev) >= 0;
  } else if (ok && partitioned && plan->grad_tail > 0 && n > 0) {
    ok &= add_allreduce(out, s, &st->cost[0].ar, 0, 2, plan->grad_tail, prev) >= 0;
  }
  free(att_bwd);
  if (!ok) sched_program_free(out);
  return ok;
}

void sched_program_free(SchedProgram *g) {
  free(g->op);
  g->op = NULL;
  g->nops = g->cap = 0;
}

bool sched_simulate(SchedProgram *g) {
  int n = g->nops, ns = g->nstreams;
  g->t_fwd = g->makespan = 0;
  if (n == 0) return true;
  int *list = malloc((size_t)n * sizeof *list);   // ops grouped by stream, in issue order
  bool *done = calloc((size_t)n, sizeof *done);
  if (!list || !done) {
    free(list);
    free(done);
    return false;
  }
  int first[SCHED_MAX_STREAMS + 1] = {0}, pos[SCHED_MAX_STREAMS], fill[SCHED_MAX_STREAMS];
  int running[SCHED_MAX_STREAMS];   // op running on each stream, -1: none
  int holder[SCHED_NRES];           // op holding each resource, -1: none
  for (int i = 0; i < n; i++) first[g->op[i].stream + 1]++;
  for (int k = 0; k < ns; k++) first[k + 1] += first[k];
  for (int k = 0; k < ns; k++) {
    pos[k] = fill[k] = first[k];
    running[k] = -1;
  }
  for (int i = 0; i < n; i++) {
    list[fill[g->op[i].stream]++] = i;
    g->op[i].start = g->op[i].end = NAN;
  }
  for (int r = 0; r < SCHED_NRES; r++) holder[r] = -1;
  double now = 0, stream_free_at[SCHED_MAX_STREAMS] = {0};
  int ndone = 0;
  bool ok = true;
  while (ndone < n) {
    // Start what can start now, resource by resource, until nothing more does.
    for (bool started = true; started;) {
      started = false;
      for (int r = 0; r < SCHED_NRES; r++) {
        if (holder[r] >= 0) continue;
        int best = -1;
        double best_ready = 0;
        for (int k = 0; k < ns; k++) {
          if (running[k] >= 0 || pos[k] == first[k + 1]) continue;
          int i = list[pos[k]];
          SchedOp *o = &g->op[i];
          if ((int)o->res != r) continue;
          double ready = stream_free_at[k];
          bool deps_done = true;
          for (int d = 0; d < o->ndeps; d++) {
            if (!done[o->deps[d]]) deps_done = false;
            else ready = fmax(ready, g->op[o->deps[d]].end);
          }
          if (!deps_done) continue;
          if (best < 0 || o->prio < g->op[best].prio ||
              (o->prio == g->op[best].prio && (ready < best_ready || (ready == best_ready && i < best)))) {
            best = i;
            best_ready = ready;
          }
        }
        if (best < 0) continue;
        SchedOp *o = &g->op[best];
        o->start = now;
        o->end = now + o->dur;
        holder[r] = best;
        running[o->stream] = best;
        started = true;
      }
    }
    // Advance to the next completion and retire everything that ends then.
    double next = INFINITY;
    for (int k = 0; k < ns; k++)
      if (running[k] >= 0) next = fmin(next, g->op[running[k]].end);
    if (!isfinite(next)) {   // nothing runs and nothing can start: a cycle in the program
      ok = false;
      break;
    }
    now = next;
    for (int k = 0; k < ns; k++) {
      int i = running[k];
      if (i < 0 || g->op[i].end > now) continue;
      done[i] = true;
      ndone++;
      running[k] = -1;
      holder[g->op[i].res] = -1;
      stream_free_at[k] = g->op[i].end;
      pos[k]++;
    }
  }
  for (int i = 0; i < n && ok; i++) {
    g->makespan = fmax(g->makespan, g->op[i].end);
    if (g->op[i].phase == SCHED_FWD) g->t_fwd = fmax(g->t_fwd, g->op[i].end);
  }
  free(list);
  free(done);
  return ok;
}

double sched_sim_moe(IrPolicy pol, const SchedLayerCost *c, int phase, int r, double grad_elems) {
  SchedProgram g = {0};
  Streams s = streams_of(pol, &g);
  if (pol != IR_POLICY_FSMOE && pol != IR_POLICY_FSMOE_NO_IIO) grad_elems = 0;
  double t = NAN;
  if (add_moe(&g, s, c, 0, phase, r, -1, grad_elems, -1) >= 0 && sched_simulate(&g)) t = g.makespan;
  sched_program_free(&g);
  return t;
}

double sched_lower_bound(const SchedStack *st, SchedResource *busiest, double total[SCHED_NRES]) {
  double t[SCHED_NRES] = {0}, grad = 0;
  for (int i = 0; i < st->n; i++) {
    const SchedLayerCost *c = &st->cost[i];
    for (int ph = 0; ph < 2; ph++) {
      const SchedPhase *p = &c->phase[ph];
      SchedChunk one = sched_chunk(p, 1);
      t[SCHED_RES_COMPUTE] += p->t_att + one.exp;
      t[SCHED_RES_INTRA] += one.ag + one.rs;
      t[SCHED_RES_INTER] += 2 * one.a2a;
    }
    grad += c->n_grad;
  }
  if (st->n > 0) t[SCHED_RES_INTER] += sched_ar_time(&st->cost[0].ar, grad);
  int b = 0;
  for (int r = 1; r < SCHED_NRES; r++)
    if (t[r] > t[b]) b = r;
  if (busiest) *busiest = (SchedResource)b;
  if (total) memcpy(total, t, sizeof t);
  return t[b];
}
