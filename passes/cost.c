// The `cost` pass (lang/manual.md §8 and §14) and the layer view the planner passes share.
//
// cost: with a cluster profile (the model's `cluster` statement or `moec build --cluster`),
// every op the scheduling model prices gets two attributes: cost_n, its size n, and cost_t =
// alpha + beta * n in ms from the profile's fit of its kind:
//   matmul, expert.matmul     n = multiply-accumulates (gemm; expert.matmul is one GEMM call per
//                             expert, so E times alpha)
//   comm.alltoall             n = elements this rank sends (its operand) (alltoall)
//   comm.allgather            n = elements of the gathered result (allgather)
//   comm.reducescatter        n = elements of the operand it reduces (reducescatter)
//   comm.allreduce(_grad)     n = elements summed (allreduce)
//   attn.causal               n = multiply-accumulates of q·kᵀ and p·v under the causal mask,
//                             S·(heads·d)·(L+1) for S tokens in windows of L (the profile's
//                             attention fit, else gemm; one kernel); with a sliding window W < L,
//                             S·(heads·d)·(W(W+1) + 2(L−W)W)/L
//   attn.causal.grad          twice the forward's: dp, dv, dq and dk (the same fit)
//   opt.adamw, opt.sgd        n = the parameters it updates (update_adamw, update_sgd, when the
//                             profile has them); a sharded AdamW adds the AllGather of its rows
//   exp/tanh/erf ops          n = the most elements it reads or writes (elementwise_math, when
//                             the profile has it: evaluates_math below)
//   every other op (element-wise kernels, layouts, the gate)
//                             n = floats it reads and writes (elementwise), only when the profile
//                             has an `elementwise` fit; without one they carry no cost
// The program that runs is priced, not its ops one by one (with ctx->fuse and an elementwise fit):
//   - the groups the fuse pass will make (pass_fuse_plan, the target's rule: ctx->fuse_cpu) are
//     one kernel each: elementwise alpha + beta * the floats the kernel moves (its operands from
//     outside the group and its results read outside it), plus what each exp/tanh/erf member
//     costs beyond its own floats, on the group's last member (cost_n the kernel's floats); the
//     other members cost 0; every member gets cost_fused=G (G numbers the planned kernels), so
//     dump-ir shows why. Streams and events are not assigned at cost time: every op groups as if
//     on the compute stream, and nothing moves (the fuse pass's sinking of column sums is not
//     priced). The schedule pass re-prices its chunks the same way.
//   - CUDA (fuse without fuse_cpu): the optimizer ops of one run share one launch
//     (passes/fuse.c's update groups): every op after a run's first pays no alpha.
// moec build --no-fuse (ctx->fuse false) prices every op on its own.
// Without a profile the pass does nothing (and -v says so).
//
// The layer view: one entry per MoE layer, its forward and backward functions, and per phase
// the summed costs of its expert region in the form of the scheduling model (SchedPhase):
// t_a2a of one AlltoAll (the phase has two, dispatch and combine, of equal size), the
// AllGather and ReduceScatter of the ESP group, the expert GEMMs (one alpha per GEMM per
// chunk), and the phase's other GEMMs, a language model's attention and its MP AllReduces as
// its dense time. Sizes come from the IR itself, so the plan prices exactly the program that is
// compiled. The dense gradient of a layer is what its backward all-reduces over the world or
// over DP (the gate: parallelize marks it grad_reduce="world"; a language model's attention,
// norms and mlp: "dp"); in a language model, the gradients of the backward functions without an
// expert region (the head's, an mlp layer's) count with the next MoE layer's backward, the
// first whose slots can hold them, and the embedding's, computed last, with none.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pass.h"


static int64_t numel_of(const IrOperand *a) {
  return ir_type_numel(a->param ? &a->param->type : &a->value->type);
}

// Multiply-accumulates of [m,k]x[k,n] (E batches for expert.matmul): sqrt(|A|*|B|*|Y| / E).
static double macs(const IrOp *op) {
  double a = (double)numel_of(&op->args[0]), b = (double)numel_of(&op->args[1]);
  double y = (double)ir_type_numel(&op->result->type);
  double e = op->kind == IR_OP_EXPERT_MATMUL ? (double)op->result->type.dim[0] : 1;
  return sqrt(a * b * y / e);
}

double pass_op_macs(const IrOp *op) {
  switch (op->kind) {
  case IR_OP_MATMUL:
  case IR_OP_EXPERT_MATMUL: return macs(op);
  case IR_OP_ATTN_CAUSAL:
  case IR_OP_ATTN_SINK:
  case IR_OP_ATTN_CAUSAL_GRAD: {
    bool fwd = op->kind != IR_OP_ATTN_CAUSAL_GRAD;
    const IrType *q = &op->args[fwd ? 0 : 1].value->type;
    int64_t L = ir_op_int(op, "seq", 1), W = ir_op_int(op, "window", 0);
    double f = fwd ? 1.0 : 2.0;
    if (W > 0 && W < L)   // a window: 2 * (W(W+1)/2 + (L-W)W) / L keys a row on average instead of L + 1
      return f * (double)q->dim[0] * (double)q->dim[1] * (double)(W * (W + 1) + 2 * (L - W) * W) / (double)L;
    return f * (double)q->dim[0] * (double)q->dim[1] * (double)(L + 1);
  }
  default: return 0;
  }
}

// The groups of the module's layout (lang/manual.md §6): the collectives of a group are priced for its
// shape (sched_group_fit) when the module says where its ranks sit (gpus_per_node, set with a
// cluster profile for more than one rank); otherwise by the profile's fits as they are.
typedef struct Groups {
  bool on;
  SchedGroup world, dp, mp, ep, esp;
} Groups;

static Groups groups_of(const IrModule *m) {
  int dp = (int)ir_mod_int(m, "dp", 1), mp = (int)ir_mod_int(m, "mp", 1), ep = (int)ir_mod_int(m, "ep", 1),
      esp = (int)ir_mod_int(m, "esp", 1), G = (int)ir_mod_int(m, "gpus_per_node", 0);
  Groups g = {.on = G > 0 && dp * mp > 1};
  if (!g.on) return g;
  g.world = sched_group_of(dp * mp, 1, G);
  g.dp = sched_group_of(dp, mp, G);
  g.mp = sched_group_of(mp, 1, G);
  g.ep = sched_group_of(ep, esp, G);
  g.esp = sched_group_of(esp, 1, G);
  return g;
}

// The fit of collective op (kind k) on its group: the group's (sched_group_fit) or the profile's.
static SchedCoef group_fit(const IrOp *op, const SchedCluster *c, const Groups *gs, SchedColl k) {
  SchedCoef plain = k == SCHED_ALLTOALL ? c->alltoall : k == SCHED_ALLGATHER ? c->allgather
                    : k == SCHED_REDUCESCATTER ? c->reducescatter : c->allreduce;
  if (!gs || !gs->on) return plain;
  const char *group = ir_op_str(op, "group", "");
  const SchedGroup *g = strcmp(group, "world") == 0 ? &gs->world : strcmp(group, "dp") == 0 ? &gs->dp
                        : strcmp(group, "mp") == 0 ? &gs->mp : strcmp(group, "ep") == 0 ? &gs->ep
                        : strcmp(group, "esp") == 0 ? &gs->esp : NULL;
  if (!g) return plain;
  const char *algo = ir_op_str(op, "algo", "nccl");
  SchedA2a a = strcmp(algo, "1dh") == 0 ? SCHED_A2A_1DH : strcmp(algo, "2dh") == 0 ? SCHED_A2A_2DH : SCHED_A2A_FLAT;
  return sched_group_fit(c, k, *g, a);
}

// The GEMM shape of a matmul ([m, k] x [k, n], its result's rows and columns) or of each of the
// `count` GEMMs of an expert.matmul ([E, C, n]: m = C).
static void gemm_shape(const IrOp *op, double *count, double *m, double *k, double *n) {
  const IrType *y = &op->result->type;
  *count = op->kind == IR_OP_EXPERT_MATMUL ? (double)y->dim[0] : 1;
  *n = y->rank > 0 ? (double)y->dim[y->rank - 1] : 1;
  *m = (double)ir_type_numel(y) / (*count * (*n > 0 ? *n : 1));
  *k = *m > 0 && *n > 0 ? macs(op) / (*count * *m * *n) : 0;
}

// A GEMM's price: by its shape (the profile's gemm_at grid) as a slope over its multiply-
// accumulates, else the gemm fit (one alpha per GEMM call).
static SchedCoef gemm_price(const IrOp *op, const SchedCluster *c) {
  double count, m, k, n;
  gemm_shape(op, &count, &m, &k, &n);
  if (c->ngemm_at <= 0 || m * k * n <= 0) return (SchedCoef){c->gemm.alpha * count, c->gemm.beta};
  return (SchedCoef){0, sched_gemm_ms(c, m, k, n) / (m * k * n)};
}

// The members of the op's group (its `group` attribute: a sharded optimizer's), 1 without one.
static double group_members(const IrModule *m, const IrOp *op) {
  const char *g = ir_op_str(op, "group", NULL);
  if (!g) return 1;
  double dp = (double)ir_mod_int(m, "dp", 1), mp = (double)ir_mod_int(m, "mp", 1);
  double size = strcmp(g, "world") == 0 ? dp * mp : strcmp(g, "dp") == 0 ? dp : strcmp(g, "mp") == 0 ? mp
                : strcmp(g, "ep") == 0 ? (double)ir_mod_int(m, "ep", 1) : strcmp(g, "esp") == 0 ? (double)ir_mod_int(m, "esp", 1) : 1;
  return size > 1 ? size : 1;
}

static bool has(SchedCoef f) { return f.alpha > 0 || f.beta > 0; }

// The element-wise and row-wise ops that evaluate exp, tanh, erf or log per element (the
// profile's elementwise_math prices them per element): the activations with a curve, the gates'
// softmax and sigmoid, the noise's normals, the cross-entropy over the logits.
static bool evaluates_math(IrOpKind k) {
  const IrActInfo *act = ir_act_of(k);   // the activations of ir/activations.def: their MATH
  if (act) return act->math;
  switch (k) {
  case IR_OP_ACT_OSS:
  case IR_OP_ACT_OSS_GRAD_GATE:
  case IR_OP_ACT_OSS_GRAD_UP:
  case IR_OP_GATE_NOISE:
  case IR_OP_GATE_SOFTMAX:
  case IR_OP_GATE_SIGMOID:
  case IR_OP_GATE_SOFTMAX_TOKENS:
  case IR_OP_LOSS_XENT:
  case IR_OP_LOSS_XENT_GRAD:
  case IR_OP_LOSS_XENT_STATS:
  case IR_OP_LOSS_XENT_VP:
  case IR_OP_LOSS_XENT_VP_GRAD: return true;
  default: return false;
  }
}

// The most elements an op reads or writes.
static double elements_of(const IrOp *op) {
  double n = op->result ? (double)ir_type_numel(&op->result->type) : 0;
  for (int a = 0; a < op->nargs; a++)
    if ((double)numel_of(&op->args[a]) > n) n = (double)numel_of(&op->args[a]);
  return n;
}

// The fit and the size of an op the model prices; false for the others.
static bool price(const IrModule *m, const IrOp *op, const SchedCluster *c, const Groups *gs, SchedCoef *coef, double *n) {
  switch (op->kind) {
  case IR_OP_MATMUL:
  case IR_OP_EXPERT_MATMUL:   // one GEMM call per expert: E fixed costs
    *coef = gemm_price(op, c);
    *n = macs(op);
    return true;
  case IR_OP_COMM_ALLTOALL: *coef = group_fit(op, c, gs, SCHED_ALLTOALL); *n = (double)numel_of(&op->args[0]); return true;
  case IR_OP_COMM_ALLGATHER:
    *coef = group_fit(op, c, gs, SCHED_ALLGATHER);
    *n = (double)ir_type_numel(&op->result->type);
    return true;
  case IR_OP_COMM_REDUCESCATTER:
    *coef = group_fit(op, c, gs, SCHED_REDUCESCATTER);
    *n = (double)numel_of(&op->args[0]);
    return true;
  // A sharded optimizer's gradient (attribute shard, autodiff) is reduce-scattered: each member
  // gets the sums of its rows.
  case IR_OP_COMM_ALLREDUCE:
    *coef = group_fit(op, c, gs, ir_op_int(op, "shard", 0) ? SCHED_REDUCESCATTER : SCHED_ALLREDUCE);
    *n = (double)numel_of(&op->args[0]);
    return true;
  case IR_OP_COMM_ALLREDUCE_GRAD:
    *coef = group_fit(op, c, gs, ir_op_int(op, "shard", 0) ? SCHED_REDUCESCATTER : SCHED_ALLREDUCE);
    *n = (double)ir_op_int(op, "count", 0);
    return true;
  case IR_OP_ATTN_CAUSAL:
  case IR_OP_ATTN_SINK:
  case IR_OP_ATTN_CAUSAL_GRAD:
    *coef = op->kind == IR_OP_ATTN_CAUSAL_GRAD && has(c->attention_grad) ? c->attention_grad
            : has(c->attention)                                         ? c->attention
                                                                        : c->gemm;
    *n = pass_op_macs(op);
    return true;
  case IR_OP_ATTN_CAUSAL_STATS:   // timed with the gradient's kernels in attention_grad
  case IR_OP_ATTN_SINK_STATS:
    if (!has(c->attention_grad)) break;
    *coef = (SchedCoef){0, 0};
    *n = 0;
    return true;
  case IR_OP_OPT_ADAMW:
  case IR_OP_OPT_SGD: {
    SchedCoef u = op->kind == IR_OP_OPT_ADAMW ? c->update_adamw : c->update_sgd;
    if (!has(u)) break;
    *coef = u;
    *n = (double)numel_of(&op->args[0]) / group_members(m, op);   // a sharded optimizer's rows of this rank
    return true;
  }
  default:
    if (evaluates_math(op->kind) && has(c->elementwise_math)) {
      *coef = c->elementwise_math;
      *n = elements_of(op);
      return true;
    }
    break;
  }
  if (!has(c->elementwise)) return false;   // the rest: floats read and written
  *coef = c->elementwise;
  *n = op->result ? (double)ir_type_numel(&op->result->type) : 0;
  for (int a = 0; a < op->nargs; a++) *n += (double)numel_of(&op->args[a]);
  return true;
}

bool pass_cost(IrModule *m, PassCtx *ctx) {
  const SchedCluster *c = ctx->cluster;
  if (!c) {
    if (ctx->verbose) fprintf(ctx->log ? ctx->log : stderr, "# cost: no cluster profile, ops are not priced\n");
    return true;
  }
  int priced = pass_price(m, c, ctx);
  if (priced < 0) return ir_oom(ctx->d);
  if (ctx->verbose) fprintf(ctx->log ? ctx->log : stderr, "# cost: %d ops priced with cluster '%s'\n", priced, c->name);
  return true;
}

// Op's size and time on its own (without its launch's alpha when it shares the launch of the op
// before it: shared); false when the model does not price it.
static bool price_op(const IrModule *m, const IrOp *op, const SchedCluster *c, const Groups *gs, bool shared, double *n,
                     double *t, double *beta) {
  SchedCoef coef = {0};
  *n = 0, *t = 0;
  bool priced_op = price(m, op, c, gs, &coef, n);
  if (priced_op) *t = (shared ? 0 : coef.alpha) + coef.beta * *n;
  *beta = priced_op ? coef.beta : 0;
  if (op->kind == IR_OP_OPT_ADAMW && ir_op_str(op, "group", NULL)) {   // then the members' rows gathered
    SchedCoef ag = group_fit(op, c, gs, SCHED_ALLGATHER);
    *t += ag.alpha + ag.beta * (double)ir_type_numel(&op->args[0].param->type);
    priced_op = true;
  }
  return priced_op;
}

// What a member evaluating exp, tanh or erf adds to its kernel beyond moving its floats: its
// price per element less the elementwise price of its own floats (the kernel's floats are
// priced once for the group).
static double math_beyond_memory(const IrOp *op, const SchedCluster *c) {
  if (!evaluates_math(op->kind) || !has(c->elementwise_math)) return 0;
  double own = op->result ? (double)ir_type_numel(&op->result->type) : 0;
  for (int a = 0; a < op->nargs; a++) own += (double)numel_of(&op->args[a]);
  double extra = c->elementwise_math.beta * elements_of(op) - c->elementwise.beta * own;
  return extra > 0 ? extra : 0;
}

// Drops attribute key from op: a re-pricing (the schedule pass's chunks) leaves no stale mark.
static void drop_attr(IrOp *op, const char *key) {
  for (int a = 0; a < op->nattrs; a++)
    if (strcmp(op->attrs[a].key, key) == 0) {
      memmove(&op->attrs[a], &op->attrs[a + 1], (size_t)(op->nattrs - a - 1) * sizeof op->attrs[0]);
      op->nattrs--;
      return;
    }
}

static double fill_of(const IrFunc *f);

// The CUDA program's kernels over a layer's expert slots read and write only the filled rows
// (codegen/launch.c, the kernels over the slots: the counts, from the routing where the order makes
// the operand; the order's own results below those counts, its gathers the routed rows): of op's
// floats (*all), those over the slots (*over, [E, S, ...] with E S = slots) move at the layer's
// fill. (Under `ep` the order's results cross the AlltoAll whole and the counts behind it are the
// data's: the price is the single-rank one.) A GEMM or a collective is priced by its own fit.
static void slot_floats(const IrOp *op, int64_t slots, double *over, double *all) {
  *over = *all = 0;
  if (ir_op_class(op->kind) == IR_CLASS_GEMM || ir_op_is_collective(op->kind)) return;
  for (int a = -1; a < op->nargs; a++) {
    const IrOperand *x = a < 0 ? NULL : &op->args[a];
    const IrType *t = !x ? (op->result ? &op->result->type : NULL) : x->param ? &x->param->type : &x->value->type;
    if (!t) continue;
    double n = (double)ir_type_numel(t);
    *all += n;
    if (t->rank == 3 && t->dim[0] * t->dim[1] == slots) *over += n;
  }
}

// The ops of f priced, the groups the fuse pass will make (plan, group_of) as one kernel each:
// one elementwise alpha and the floats the kernel moves (its operands from outside the group and
// its results read outside it), on the group's last member; the others cost 0. Every member gets
// cost_fused=G (G numbers the module's planned kernels from *next_group). Returns the ops priced.
static int price_func(IrModule *m, IrFunc *f, const SchedCluster *c, const Groups *gs, const int *group_of,
                      const double *floats, bool cuda, int *next_group) {
  int priced = 0, base = *next_group;
  // on one stream the CUDA program updates a run of optimizer ops in one launch (the fuse pass's
  // update groups, ir_update_joins): each op of the run after its first costs no launch
  bool one_stream = cuda && !ir_func_concurrent(f);
  size_t nops = (size_t)(f->nops > 0 ? f->nops : 1);
  double *extra = calloc(nops, sizeof *extra);   // a group's math
  double *over = calloc(nops, sizeof *over), *all = calloc(nops, sizeof *all);   // a group's floats over the slots
  if (!extra || !over || !all) {
    free(extra), free(over), free(all);
    return -1;
  }
  // CUDA: the kernels over the expert slots at the layer's fill (slot_floats)
  double fill = cuda ? fill_of(f) : 1;
  int64_t slots = 0;
  IrValue *entry, *exit;
  if (fill < 1 && pass_expert_region(f, &entry, &exit)) slots = entry->type.dim[0] * entry->type.dim[1];
  for (int j = 0; j < f->nops; j++) {
    IrOp *op = f->ops[j];
    double n, t, beta, o = 0, a = 0;   // on CUDA a run of updates is one launch: its first op's
    if (!price_op(m, op, c, gs, cuda && one_stream && j > 0 && ir_update_joins(f->ops[j - 1], f->ops[j]), &n, &t, &beta))
      continue;
    if (slots > 0) slot_floats(op, slots, &o, &a);
    double share = a > 0 ? 1 - (1 - fill) * o / a : 1;   // of its floats, what it moves
    int g = group_of ? group_of[j] : -1;
    drop_attr(op, "cost_fused");
    if (g < 0 && share < 1) t -= beta * n * (1 - share), n *= share;
    if (g >= 0) {
      extra[g] += math_beyond_memory(op, c);
      over[g] += o, all[g] += a;
      bool last = true;
      for (int k = j + 1; k < f->nops && last; k++) last = group_of[k] != g;
      double gs_share = all[g] > 0 ? 1 - (1 - fill) * over[g] / all[g] : 1;
      n = last ? floats[g] * gs_share : n;
      t = last ? c->elementwise.alpha + (c->elementwise.beta * floats[g] + extra[g]) * gs_share : 0;
      ir_op_set_int(op, "cost_fused", base + g);
      if (base + g + 1 > *next_group) *next_group = base + g + 1;
    }
    ir_op_set_float(op, "cost_n", n);
    ir_op_set_float(op, "cost_t", t);
    priced++;
  }
  free(extra), free(over), free(all);
  return priced;
}

int pass_price(IrModule *m, const SchedCluster *c, const PassCtx *ctx) {
  int priced = 0, next_group = 0;
  Groups gs = groups_of(m);
  // The fuse pass's groups, as it will make them (streams and events are not known yet at cost
  // time: every op counts as on the compute stream), when it runs and elementwise work is priced.
  bool fuse = ctx && ctx->fuse && has(c->elementwise), cuda = ctx && ctx->fuse && !ctx->fuse_cpu;
  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    int *group_of = fuse ? malloc((size_t)(f->nops > 0 ? f->nops : 1) * sizeof *group_of) : NULL;
    double *floats = fuse ? malloc((size_t)(f->nops > 0 ? f->nops : 1) * sizeof *floats) : NULL;
    int n = fuse && group_of && floats ? pass_fuse_plan(m, f, ctx->fuse_cpu, group_of, floats) : 0;
    if (fuse && (!group_of || !floats || n < 0)) n = -1;
    int p = n < 0 ? -1 : price_func(m, f, c, &gs, fuse ? group_of : NULL, floats, cuda, &next_group);
    free(group_of), free(floats);
    if (p < 0) return -1;
    priced += p;
  }
  return priced;
}

// ---- the layer view ----

// The expert parameters (attribute shard_expert, passes/parallelize.c), and with them an expert's
// LoRA adapter's ops (attribute expert_lora, frontend/lower_ops.c: the adapter's sum with the expert's
// product can be the region's last op).
bool pass_op_of_experts(const IrOp *op) {
  if (op->kind == IR_OP_PARAM_GRAD) return false;
  if (ir_op_int(op, "expert_lora", 0)) return true;
  for (int a = 0; a < op->nargs; a++) {
    const IrParam *p = op->args[a].param;
    if (p && ir_attrs_get(p->attrs, p->nattrs, "shard_expert")) return true;
  }
  return false;
}

static bool is_transport(IrOpKind k) {
  return k == IR_OP_COMM_ALLTOALL || k == IR_OP_COMM_ALLGATHER || k == IR_OP_COMM_REDUCESCATTER ||
         k == IR_OP_LAYOUT_EXPERT_MAJOR || k == IR_OP_LAYOUT_RANK_MAJOR;
}

// The op of f that reads v, when exactly one op does (NULL otherwise).
static IrOp *only_user(const IrFunc *f, const IrValue *v) {
  IrOp *user = NULL;
  for (int i = 0; i < f->nops; i++)
    for (int a = 0; a < f->ops[i]->nargs; a++)
      if (f->ops[i]->args[a].value == v) {
        if (user) return NULL;
        user = f->ops[i];
        break;
      }
  return user;
}

bool pass_expert_region(const IrFunc *f, IrValue **entry, IrValue **exit) {
  int first = -1, last = -1;
  for (int i = 0; i < f->nops; i++)
    if (pass_op_of_experts(f->ops[i])) {
      if (first < 0) first = i;
      last = i;
    }
  if (first < 0) return false;
  // Entry: back from the first expert op through the dispatch collectives and layouts.
  IrValue *in = f->ops[first]->args[0].value;
  while (in && in->def && in->func == f && is_transport(in->def->kind)) in = in->def->args[0].value;
  // Exit: on from the last expert op through the combine layouts, collectives and bias.
  IrValue *out = f->ops[last]->result;
  for (IrOp *u; out && (u = only_user(f, out)) && (is_transport(u->kind) || u->kind == IR_OP_EXPERT_BIAS);)
    out = u->result;
  if (!in || in->func != f || in->type.rank != 3 || !out || out->type.rank != 3) return false;
  *entry = in;
  *exit = out;
  return true;
}

int64_t pass_region_capacity(const IrFunc *f) {
  IrValue *entry, *exit;
  return pass_expert_region(f, &entry, &exit) ? entry->type.dim[1] : 0;
}

static double attr_n(const IrOp *op) { return ir_op_float(op, "cost_n", 0); }

// An expert.matmul over the filled share `fill` of its slots (the CPU computes those), as the
// scheduling model takes it: the line through its whole and chunked times (sched_gemm_chunks),
// times the profile's expert_gemm_scale (what the GEMM the programs run over the filled rows takes
// against the GEMM fits: moec tune --target cuda measures it); *t its time at r = 1.
static SchedCoef expert_gemm(const IrOp *op, double fill, const SchedCluster *c, double *t) {
  double count, m, k, n;
  gemm_shape(op, &count, &m, &k, &n);
  SchedCoef e = sched_gemm_chunks(c, count, fill * m, k, n);
  e.alpha *= sched_expert_scale(c), e.beta *= sched_expert_scale(c);
  *t = e.alpha + e.beta * fill * attr_n(op);
  return e;
}

static bool in_group(const IrOp *op, const char *group) { return strcmp(ir_op_str(op, "group", ""), group) == 0; }

bool pass_sums_slots(const IrOp *op) {
  return op->kind == IR_OP_EXPERT_BIAS_GRAD || (op->kind == IR_OP_EXPERT_MATMUL && ir_op_int(op, "ta", 0));
}

// v is read outside f's ops [lo, hi]: by f's other ops, as a result of f, or by `reader` (the
// backward that reads a forward's saved values).
static bool read_after(const IrFunc *f, const IrFunc *reader, int lo, int hi, const IrValue *v) {
  for (int i = 0; i < f->nrets; i++)
    if (f->rets[i] == v) return true;
  for (int pass = 0; pass < 2; pass++) {
    const IrFunc *g = pass ? reader : f;
    for (int i = 0; g && i < g->nops; i++) {
      if (g == f && i >= lo && i <= hi) continue;
      for (int a = 0; a < g->ops[i]->nargs; a++)
        if (g->ops[i]->args[a].value == v) return true;
    }
  }
  return false;
}

// Every read of v by g is inside g's ops [lo, hi] (its expert region, where the schedule pass
// chunks it); false when g has no region (lo > hi).
static bool read_in_region_only(const IrFunc *g, int lo, int hi, const IrValue *v) {
  if (lo > hi) return false;
  for (int i = 0; i < g->nops; i++)
    for (int a = 0; a < g->ops[i]->nargs; a++)
      if (g->ops[i]->args[a].value == v && (i < lo || i > hi)) return false;
  return true;
}

// What chunking adds after the chunks (SchedPhase.t_sum, t_level), priced with the elementwise
// fit: an add of each partial sum per chunk after the first (reads two, writes one), and per
// level of the concat tree a copy of every chunked value read after the region (reads and
// writes it).
static void assembly_of(const IrFunc *f, const IrFunc *reader, int lo, int hi, const SchedCluster *c,
                        SchedPhase *p) {
  const SchedCoef *e = &c->elementwise;
  int rlo = 1, rhi = 0;   // the reader's expert region (empty: none)
  IrValue *entry, *exit;
  if (reader && pass_expert_region(reader, &entry, &exit))
    rlo = entry->def ? entry->def->index + 1 : 0, rhi = exit->def->index;
  for (int i = lo; i <= hi && i < f->nops; i++) {
    const IrOp *op = f->ops[i];
    if (!op->result) continue;
    double n = (double)ir_type_numel(&op->result->type);
    if (pass_sums_slots(op)) {
      p->t_sum += e->alpha + e->beta * 3 * n;
      continue;
    }
    bool from_sum = false;
    for (int a = 0; a < op->nargs; a++)
      from_sum |= op->args[a].value && op->args[a].value->def && pass_sums_slots(op->args[a].value->def);
    if (from_sum || !read_after(f, reader, lo, hi, op->result)) continue;
    p->t_level += e->alpha + e->beta * 2 * n;
    if (reader && !read_after(f, NULL, lo, hi, op->result) && read_in_region_only(reader, rlo, rhi, op->result))
      p->t_level_shared += e->alpha + e->beta * 2 * n;
  }
}

// The share of a layer's expert slots that tokens fill when the gate balances them: k choices of
// S tokens over E experts x capacity x groups slots (at most 1). The CPU runtime computes the
// expert GEMMs over the filled slots only (runtime/kernels/ffn.c), and so does the CUDA program
// where cuBLASLt's grouped GEMM or, in bf16, moec's own runs (rt_cuda_expert_gemm_rows; its
// forward's second GEMM one row more per block of slots; an fp32 program on a cuBLAS without the
// grouped mode runs padded), so the plan prices that share of them. A dropless layer (`capacity *`) fills exactly S·k of its slots, however the gate spreads
// the tokens: its buffers hold every token for every expert, its GEMMs compute the k·S routed
// ones. 1 for the other gates (expert choice fills every slot).
static double slot_fill(const IrFunc *fwd) {
  for (int i = 0; i < fwd->nops; i++) {
    const IrOp *op = fwd->ops[i];
    if (op->kind != IR_OP_GATE_LOCATIONS || !op->args[0].value) continue;
    const IrType *idx = &op->args[0].value->type;   // [S, k]
    double slots = (double)ir_op_int(op, "experts", 1) * (double)ir_op_int(op, "capacity", 1) *
                   (double)ir_op_int(op, "groups", 1);
    double fill = slots > 0 ? (double)idx->dim[0] * (double)idx->dim[1] / slots : 1;
    return fill < 1 ? fill : 1;
  }
  return 1;
}

// The phase costs of f's ops (priced by pass_cost) in the model's form. Its collectives are the
// expert region's: the EP AlltoAlls and the ESP AllGather and ReduceScatter. The MP AllGather
// after the layer (Fig. 2) is none of them: the schedule pass does not chunk it and lang/manual.md §8's
// workloads have no term for it.
// The other ops (priced by the profile's `elementwise` fit): inside the expert region they run
// once per chunk on 1/r of the slots, so they join the experts' term (their alphas to its alpha,
// their per-slot time to its beta); outside it, the dense time. A chunked collective also pays
// the stream hand-offs (the profile's `handoff`) with its alpha.
static void phase_of(const IrFunc *f, const IrFunc *reader, double fill, const SchedCluster *c, const Groups *gs,
                     SchedPhase *p) {
  *p = (SchedPhase){0};
  const IrOp *a2a = NULL, *ag = NULL, *rs = NULL;   // one of each of the region's collectives (their fits)
  int n_a2a = 0, n_ag = 0, n_rs = 0, n_exp = 0;
  IrValue *entry, *exit;
  int lo = f->nops, hi = -1;
  if (pass_expert_region(f, &entry, &exit)) {
    lo = entry->def ? entry->def->index + 1 : 0;
    hi = exit->def->index;
  }
  double elem_alpha = 0, elem_t = 0;   // the region's element-wise ops at r = 1
  double exp_alpha = 0, exp_t = 0;     // the expert GEMMs, chunked (sched_gemm_chunks), at r = 1
  for (int i = 0; i < f->nops; i++) {
    const IrOp *op = f->ops[i];
    if (ir_op_class(op->kind) != IR_CLASS_GEMM && !ir_op_is_collective(op->kind) && op->kind != IR_OP_ATTN_CAUSAL &&
        op->kind != IR_OP_ATTN_SINK && op->kind != IR_OP_ATTN_CAUSAL_GRAD && ir_attrs_get(op->attrs, op->nattrs, "cost_t")) {
      double t = ir_op_float(op, "cost_t", 0);
      if (i >= lo && i <= hi) elem_alpha += c->elementwise.alpha, elem_t += t;
      else p->t_att += t;
      continue;
    }
    switch (op->kind) {
    case IR_OP_COMM_ALLTOALL:
      if (in_group(op, "ep")) p->n_a2a += attr_n(op), n_a2a++, a2a = op;
      break;
    case IR_OP_COMM_ALLGATHER:
      if (in_group(op, "esp")) p->n_ag += attr_n(op), n_ag++, ag = op;
      break;
    case IR_OP_COMM_REDUCESCATTER:
      if (in_group(op, "esp")) p->n_rs += attr_n(op), n_rs++, rs = op;
      break;
    case IR_OP_EXPERT_MATMUL: {   // the filled share of each expert's slots, as the CPU computes them
      double t;
      exp_alpha += expert_gemm(op, fill, c, &t).alpha;
      exp_t += t;
      p->n_exp += fill * attr_n(op);
      n_exp += (int)op->result->type.dim[0];
      break;
    }
    case IR_OP_MATMUL:
    case IR_OP_ATTN_CAUSAL:
    case IR_OP_ATTN_SINK:
    case IR_OP_ATTN_CAUSAL_GRAD: p->t_att += ir_op_float(op, "cost_t", 0); break;
    case IR_OP_COMM_ALLREDUCE:
      if (in_group(op, "mp")) p->t_att += ir_op_float(op, "cost_t", 0);
      break;
    default: break;
    }
  }
  // Two AlltoAlls per phase in the model (dispatch and combine): t_a2a is one of them.
  if (n_a2a > 0) p->a2a = group_fit(a2a, c, gs, SCHED_ALLTOALL), p->n_a2a /= n_a2a;
  if (n_ag > 0) p->ag = group_fit(ag, c, gs, SCHED_ALLGATHER);
  if (n_rs > 0) p->rs = group_fit(rs, c, gs, SCHED_REDUCESCATTER);
  if (n_exp > 0 && c->ngemm_at <= 0)
    p->exp = (SchedCoef){c->gemm.alpha * n_exp * sched_expert_scale(c), c->gemm.beta * sched_expert_scale(c)};
  else if (n_exp > 0 && p->n_exp > 0) p->exp = (SchedCoef){exp_alpha, (exp_t - exp_alpha) / p->n_exp};
  if (n_exp > 0 && p->n_exp > 0 && elem_t > 0) {
    p->exp.alpha += elem_alpha;
    p->exp.beta += (elem_t - elem_alpha) / p->n_exp;
  }
  if (hi >= 0 && hi < f->nops) assembly_of(f, reader, lo, hi, c, p);
  if (n_a2a > 0) p->a2a.alpha += c->handoff;
  if (n_ag > 0) p->ag.alpha += c->handoff;
  if (n_rs > 0) p->rs.alpha += c->handoff;
}

// The dense gradient elements bwd all-reduces over a replica group (world or dp).
static double dense_grad_elems(const IrFunc *bwd) {
  double n = 0;
  for (int i = 0; i < bwd->nops; i++) {
    const IrOp *op = bwd->ops[i];
    bool replicas = in_group(op, "world") || in_group(op, "dp");
    if (op->kind == IR_OP_COMM_ALLREDUCE && replicas) n += (double)ir_type_numel(&op->args[0].value->type);
    if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD && replicas) n += (double)ir_op_int(op, "count", 0);
  }
  return n;
}

const char *const pass_class_names[PASS_CLASSES] = {"GEMM", "attention", "update", "AlltoAll", "AllGather",
                                                    "ReduceScatter", "AllReduce", "the rest"};

// The filled share of the slots the expert GEMMs of f compute: its layer's (f a layer's forward,
// or the backward that reads one), 1 elsewhere.
static double fill_of(const IrFunc *f) {
  if (f->role == IR_ROLE_LAYER_FWD) return slot_fill(f);
  if (f->role == IR_ROLE_LAYER_BWD && f->saves) return slot_fill(f->saves);
  return 1;
}

void pass_class_times(const IrModule *m, const SchedCluster *c, double t[PASS_CLASSES]) {
  for (int k = 0; k < PASS_CLASSES; k++) t[k] = 0;
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    double fill = fill_of(f);
    for (int j = 0; j < f->nops; j++) {
      const IrOp *op = f->ops[j];
      if (!ir_attrs_get(op->attrs, op->nattrs, "cost_t")) continue;
      double cost = ir_op_float(op, "cost_t", 0);
      PassClass k = PASS_CLASS_REST;
      if (f->role == IR_ROLE_OPTIMIZER) k = PASS_CLASS_UPDATE;
      else if (op->kind == IR_OP_EXPERT_MATMUL) {
        expert_gemm(op, fill, c, &cost);
        k = PASS_CLASS_GEMM;
      } else if (op->kind == IR_OP_MATMUL) k = PASS_CLASS_GEMM;
      else if (op->kind == IR_OP_ATTN_CAUSAL || op->kind == IR_OP_ATTN_SINK || op->kind == IR_OP_ATTN_CAUSAL_GRAD)
        k = PASS_CLASS_ATTN;
      else if (op->kind == IR_OP_COMM_ALLTOALL) k = PASS_CLASS_ALLTOALL;
      else if (op->kind == IR_OP_COMM_ALLGATHER) k = PASS_CLASS_ALLGATHER;
      else if (op->kind == IR_OP_COMM_REDUCESCATTER) k = PASS_CLASS_REDUCESCATTER;
      else if (op->kind == IR_OP_COMM_ALLREDUCE || op->kind == IR_OP_COMM_ALLREDUCE_GRAD)
        k = ir_op_int(op, "shard", 0) ? PASS_CLASS_REDUCESCATTER : PASS_CLASS_ALLREDUCE;
      t[k] += cost;
    }
  }
}

int pass_find_layers(IrModule *m, PassLayer **out) {
  int n = 0;
  PassLayer *l = calloc((size_t)(m->nfuncs > 0 ? m->nfuncs : 1), sizeof *l);
  if (!l) return -1;
  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    if (f->role != IR_ROLE_LAYER_FWD) continue;
    IrFunc *bwd = NULL;   // the backward that reads this forward's values
    for (int j = 0; j < m->nfuncs && !bwd; j++)
      if (m->funcs[j]->role == IR_ROLE_LAYER_BWD && m->funcs[j]->saves == f) bwd = m->funcs[j];
    l[n] = (PassLayer){.name = f->name, .fwd = f, .bwd = bwd};
    l[n].capacity = pass_region_capacity(f);
    if (l[n].capacity > 0) n++;
  }
  *out = l;
  return n;
}

// A layer's costs in the scheduling model's form, from the cost attributes pass_cost set; its
// dense gradients' AllReduce is priced on their group (the first replica AllReduce of its backward).
static void layer_cost(const PassLayer *l, const SchedCluster *c, const Groups *gs, SchedLayerCost *out) {
  *out = (SchedLayerCost){.ar = c->allreduce};
  double fill = slot_fill(l->fwd);
  phase_of(l->fwd, l->bwd, fill, c, gs, &out->phase[SCHED_FWD]);
  if (l->bwd) {
    for (int i = 0; i < l->bwd->nops; i++) {
      const IrOp *op = l->bwd->ops[i];
      if ((op->kind == IR_OP_COMM_ALLREDUCE || op->kind == IR_OP_COMM_ALLREDUCE_GRAD) &&
          (in_group(op, "world") || in_group(op, "dp"))) {
        out->ar = group_fit(op, c, gs, ir_op_int(op, "shard", 0) ? SCHED_REDUCESCATTER : SCHED_ALLREDUCE);
        break;
      }
    }
    phase_of(l->bwd, NULL, fill, c, gs, &out->phase[SCHED_BWD]);
    out->n_grad = dense_grad_elems(l->bwd);
  }
}

// ---- the stack the planner plans ----

// The largest degree of a layer: the slots per expert of its expert regions, at most SCHED_R_MAX.
static int r_max_of(const PassLayer *l) {
  int64_t cap = l->capacity;
  if (l->bwd) {
    int64_t cb = pass_region_capacity(l->bwd);
    if (cb > 0 && cb < cap) cap = cb;
  }
  return (int)(cap < SCHED_R_MAX ? cap : SCHED_R_MAX);
}

bool pass_stack(IrModule *m, const SchedCluster *c, PassStack *out) {
  *out = (PassStack){0};
  Groups gs = groups_of(m);
  int n = pass_find_layers(m, &out->layer);
  if (n < 0) return false;
  out->n = n;
  out->cost = calloc((size_t)(n > 0 ? n : 1), sizeof *out->cost);
  out->r_max = calloc((size_t)(n > 0 ? n : 1), sizeof *out->r_max);
  if (!out->cost || !out->r_max) {
    pass_stack_free(out);
    return false;
  }
  for (int i = 0; i < n; i++) {
    layer_cost(&out->layer[i], c, &gs, &out->cost[i]);
    out->r_max[i] = r_max_of(&out->layer[i]);
  }
  // Everything outside the stack's layers, priced.
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    bool in_stack = false;
    for (int k = 0; k < n && !in_stack; k++) in_stack = out->layer[k].fwd == f || out->layer[k].bwd == f;
    if (in_stack) continue;
    double t = 0;
    for (int j = 0; j < f->nops; j++) t += ir_op_float(f->ops[j], "cost_t", 0);
    bool fwd = f->role == IR_ROLE_LAYER_FWD || f->role == IR_ROLE_LOSS_FWD;
    *(fwd ? &out->t_fwd_other : &out->t_bwd_other) += t;
  }
  // The backward functions outside the stack (a language model's head and mlp layers): their
  // gradients join the next stack layer's backward in module order.
  double pending = 0;
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    if (f->role != IR_ROLE_LAYER_BWD && f->role != IR_ROLE_LOSS_BWD) continue;
    int k = 0;
    while (k < n && out->layer[k].bwd != f) k++;
    if (k == n) {
      pending += dense_grad_elems(f);
    } else {
      out->cost[k].n_grad += pending;
      pending = 0;
    }
  }
  return true;
}

void pass_stack_free(PassStack *s) {
  free(s->layer);
  free(s->cost);
  free(s->r_max);
  *s = (PassStack){0};
}

// The dropless gate.locations op of f, NULL when its gate drops tokens.
static const IrOp *dropless_gate(const IrFunc *f) {
  for (int i = 0; i < f->nops; i++)
    if (f->ops[i]->kind == IR_OP_GATE_LOCATIONS && ir_op_int(f->ops[i], "dropless", 0)) return f->ops[i];
  return NULL;
}

bool pass_dropless_at(const PassStack *s, int i, double capacity, SchedLayerCost *cost, int *r_max) {
  const PassLayer *l = &s->layer[i];
  const IrOp *loc = dropless_gate(l->fwd);
  if (!loc || l->capacity <= 0) return false;
  // fe_capacity's slots per routing group (ir_capacity_slots), for every group.
  const IrType *idx = &loc->args[0].value->type;   // [S, k]
  int64_t groups = ir_op_int(loc, "groups", 1), experts = ir_op_int(loc, "experts", 1);
  double per_group = (double)ir_capacity_slots(idx->dim[1], capacity, idx->dim[0] / groups, experts);
  double slots = fmin(per_group * (double)groups, (double)l->capacity);
  // The collectives move the buffers, linear in the slots; the expert GEMMs compute the routed
  // tokens (slot_fill), S·k of them while the slots hold them; the dense part does not change.
  double scale = slots / (double)l->capacity, routed = (double)idx->dim[0] * (double)idx->dim[1];
  double kept = routed > 0 ? fmin(1.0, slots * (double)experts / routed) : 1;
  *cost = s->cost[i];
  for (int ph = 0; ph < 2; ph++) {
    SchedPhase *p = &cost->phase[ph];
    p->n_a2a *= scale, p->n_ag *= scale, p->n_rs *= scale, p->n_exp *= kept;
  }
  *r_max = (int)(slots < SCHED_R_MAX ? slots : SCHED_R_MAX);
  return true;
}
