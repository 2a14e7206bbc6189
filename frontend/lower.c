// Lowering: the checked program -> the forward IR module.
//
// Each MoE layer instance (`layer block x 2` gives block0, block1) becomes one forward
// function that takes the layer input %x [S, M] (S = batch*seqlen tokens) and returns
// (%out, %aux, %z): the gate chain, the sparse encode, the expert FFN batched over experts, the
// decode and the residual. `@loss.fwd` compares the last output with the target. Backward
// functions and the optimizer come from the autodiff pass.
//
// Constructs that parse and check but have no backend yet are refused here, one diagnostic
// each, naming the construct and where it was written — never silently ignored.
#include <math.h>
#include <string.h>

#include "fe.h"

typedef struct Lower {
  IrDiag *d;
  IrModule *m;
  IrFunc *f;
} Lower;

// Appends op `kind` with operands (values, or params where vals[i] is NULL) and gives its
// result the type shape inference derives from them.
static IrValue *emit(Lower *L, IrOpKind kind, const char *name, int nargs, IrValue **vals,
                     IrParam **params, void (*set_attrs)(IrOp *, const void *), const void *cfg) {
  IrOp *op = ir_add_op(L->f, L->m, kind, name, (IrType){0});
  for (int i = 0; i < nargs; i++) {
    if (vals[i])
      ir_op_arg(op, vals[i]);
    else
      ir_op_param(op, params[i]);
  }
  if (set_attrs) set_attrs(op, cfg);
  if (!name) return NULL;
  if (!ir_infer_type(L->d, op, &op->result->type)) UNREACHABLE();  // lowering builds well-typed ops
  return op->result;
}

typedef struct GateCfg {
  int64_t k, experts, groups, capacity, layer;
  double sigma, aux_coef, z_coef;
} GateCfg;

static void attrs_noise(IrOp *op, const void *c) {
  const GateCfg *g = c;
  ir_op_set_float(op, "sigma", g->sigma);
  ir_op_set_int(op, "layer", g->layer);
}
static void attrs_topk(IrOp *op, const void *c) { ir_op_set_int(op, "k", ((const GateCfg *)c)->k); }
static void attrs_gather(IrOp *op, const void *c) {
  ir_op_set_int(op, "renorm", ((const GateCfg *)c)->k > 1);
}
static void attrs_route(IrOp *op, const void *c) {
  const GateCfg *g = c;
  ir_op_set_int(op, "experts", g->experts);
  ir_op_set_int(op, "groups", g->groups);
  ir_op_set_int(op, "capacity", g->capacity);
}
static void attrs_aux(IrOp *op, const void *c) {
  ir_op_set_int(op, "groups", ((const GateCfg *)c)->groups);
  ir_op_set_float(op, "coef", ((const GateCfg *)c)->aux_coef);
}
static void attrs_z(IrOp *op, const void *c) {
  ir_op_set_int(op, "groups", ((const GateCfg *)c)->groups);
  ir_op_set_float(op, "coef", ((const GateCfg *)c)->z_coef);
}

static IrValue *op1(Lower *L, IrOpKind k, const char *name, IrValue *a) {
  return emit(L, k, name, 1, (IrValue *[]){a}, NULL, NULL, NULL);
}
static IrValue *op2(Lower *L, IrOpKind k, const char *name, IrValue *a, IrValue *b) {
  return emit(L, k, name, 2, (IrValue *[]){a, b}, NULL, NULL, NULL);
}
static IrValue *op_vp(Lower *L, IrOpKind k, const char *name, IrValue *a, IrParam *p) {
  return emit(L, k, name, 2, (IrValue *[]){a, NULL}, (IrParam *[]){NULL, p}, NULL, NULL);
}

static IrParam *param(Lower *L, const char *layer, const char *suffix, IrType t, const char *init,
                      double std) {
  IrParam *p = ir_add_param(L->m, ir_strfmt(L->m, "%s.%s", layer, suffix), t);
  ir_attrs_set_str(L->m, p->attrs, &p->nattrs, "init", init);
  if (strcmp(init, "normal") == 0) ir_attrs_set_float(p->attrs, &p->nattrs, "std", std);
  return p;
}

// Every construct the CPU backend cannot run yet gets one diagnostic naming it.
static void refuse_unsupported(IrDiag *d, const FeProgram *p) {
  const char *why = "the CPU backend does not run it yet";
  if (strcmp(p->model.dtype, "fp32") != 0)
    ir_error_at(d, p->model.dtype_loc, "dtype '%s' needs the CUDA backend; %s", p->model.dtype, why);
  const FeParallel *par = &p->parallel;
  if (par->dp * par->mp > 1 || par->ep * par->esp > 1)
    ir_error_at(d, par->loc,
                "parallel layouts over more than one rank (dp %lld, mp %lld, ep %lld, esp %lld) "
                "are not supported yet; remove the 'parallel' block to train on one rank",
                (long long)par->dp, (long long)par->mp, (long long)par->ep, (long long)par->esp);
  const FeSchedule *s = &p->schedule;
  if (strcmp(s->policy, "sequential") != 0)
    ir_error_at(d, s->policy_loc, "schedule policy '%s' is not supported yet (only 'sequential')",
                s->policy);
  if (s->pipeline_auto || s->pipeline_fwd != 1 || s->pipeline_bwd != 1)
    ir_error_at(d, s->pipeline_loc,
                "pipelined MoE layers are not supported yet (only pipeline degree 1)");
  if (strcmp(s->grad_partition, "none") != 0)
    ir_error_at(d, s->grad_partition_loc,
                "grad_partition '%s' is not supported yet (only 'none')", s->grad_partition);
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    const FeMoe *moe = &l->moe;
    if (l->has_attention)
      ir_error_at(d, l->attention_loc, "'attention' is not supported yet; %s", why);
    if (strcmp(moe->gate.name, "gshard") != 0)
      ir_error_at(d, moe->gate.loc, "gate '%s' is not supported yet (only 'gshard')",
                  moe->gate.name);
    if (moe->gate.dropless)
      ir_error_at(d, moe->gate.field_loc[FE_GATE_F_CAPACITY],
                  "dropless capacity ('capacity *') is not supported yet");
    if (strcmp(moe->order, "tutel") != 0)
      ir_error_at(d, moe->order_loc, "order '%s' is not supported yet (only 'tutel')", moe->order);
    if (strcmp(moe->experts.kind, "gpt") != 0)
      ir_error_at(d, moe->experts.kind_loc, "experts 'ffn %s' are not supported yet (only 'ffn gpt')",
                  moe->experts.kind);
    for (int h = 0; h < moe->nhooks; h++)
      ir_error_at(d, moe->hooks[h].loc, "hook '%s %s' is not supported yet", moe->hooks[h].point,
                  moe->hooks[h].action);
  }
}

static void lower_layer(Lower *L, const FeProgram *p, const FeLayer *l, const char *inst,
                        int64_t layer_index) {
  int64_t S = p->model.batch * p->model.seqlen, M = p->model.embed;
  const FeMoe *moe = &l->moe;
  int64_t E = moe->experts.count, H = moe->experts.hidden, G = moe->gate.groups;
  GateCfg g = {
      .k = moe->gate.k,
      .experts = E,
      .groups = G,
      .capacity = (int64_t)ceil((double)moe->gate.k * moe->gate.capacity * (double)(S / G) / (double)E),
      .layer = layer_index,
      .sigma = moe->gate.noise,
      .aux_coef = moe->gate.aux_loss,
      .z_coef = moe->gate.z_loss,
  };
  if (g.capacity < 1) g.capacity = 1;

  IrParam *wg = param(L, inst, "moe.gate.wg", ir_type2(IR_F32, M, E), "normal", 1.0 / sqrt((double)M));
  IrParam *w1 = param(L, inst, "moe.experts.w1", ir_type3(IR_F32, E, M, H), "normal", 1.0 / sqrt((double)M));
  IrParam *b1 = moe->experts.bias ? param(L, inst, "moe.experts.b1", ir_type2(IR_F32, E, H), "zeros", 0) : NULL;
  IrParam *w2 = param(L, inst, "moe.experts.w2", ir_type3(IR_F32, E, H, M), "normal", 1.0 / sqrt((double)H));
  IrParam *b2 = moe->experts.bias ? param(L, inst, "moe.experts.b2", ir_type2(IR_F32, E, M), "zeros", 0) : NULL;

  L->f = ir_add_func(L->m, ir_strfmt(L->m, "%s.fwd", inst));
  L->f->loc = l->loc;
  IrValue *x = ir_add_arg(L->f, L->m, "x", ir_type2(IR_F32, S, M));
  IrValue *logits = op_vp(L, IR_OP_MATMUL, "logits", x, wg);
  if (g.sigma > 0)
    logits = emit(L, IR_OP_GATE_NOISE, "noisy", 1, (IrValue *[]){logits}, NULL, attrs_noise, &g);
  IrValue *scores = op1(L, IR_OP_GATE_SOFTMAX, "scores", logits);
  IrValue *idx = emit(L, IR_OP_GATE_TOPK, "idx", 1, (IrValue *[]){scores}, NULL, attrs_topk, &g);
  IrValue *gates = emit(L, IR_OP_GATE_GATHER, "gates", 2, (IrValue *[]){scores, idx}, NULL, attrs_gather, &g);
  IrValue *loc = emit(L, IR_OP_GATE_LOCATIONS, "loc", 1, (IrValue *[]){idx}, NULL, attrs_route, &g);
  IrValue *aux = emit(L, IR_OP_GATE_AUX_LOSS, "aux", 2, (IrValue *[]){scores, idx}, NULL, attrs_aux, &g);
  IrValue *z = emit(L, IR_OP_GATE_Z_LOSS, "z", 1, (IrValue *[]){logits}, NULL, attrs_z, &g);
  IrValue *disp = emit(L, IR_OP_ORDER_ENCODE, "disp", 3, (IrValue *[]){x, idx, loc}, NULL, attrs_route, &g);
  IrValue *h = op_vp(L, IR_OP_EXPERT_MATMUL, "h", disp, w1);
  if (b1) h = op_vp(L, IR_OP_EXPERT_BIAS, "hb", h, b1);
  h = op1(L, strcmp(moe->experts.act, "relu") == 0 ? IR_OP_ACT_RELU : IR_OP_ACT_GELU, "act", h);
  IrValue *y = op_vp(L, IR_OP_EXPERT_MATMUL, "y", h, w2);
  if (b2) y = op_vp(L, IR_OP_EXPERT_BIAS, "yb", y, b2);
  IrValue *combined = emit(L, IR_OP_ORDER_DECODE, "moe", 4, (IrValue *[]){y, idx, loc, gates}, NULL, attrs_route, &g);
  IrValue *out = op2(L, IR_OP_ADD, "out", x, combined);
  ir_add_ret(L->f, L->m, out);
  ir_add_ret(L->f, L->m, aux);
  ir_add_ret(L->f, L->m, z);
}

IrModule *fe_lower(IrDiag *d, const FeProgram *p) {
  int before = d->errors;
  refuse_unsupported(d, p);
  if (d->errors > before) return NULL;

  Lower L = {.d = d, .m = ir_module_new(p->model.name)};
  IrModule *m = L.m;
  ir_attrs_set_int(m->attrs, &m->nattrs, "batch", p->model.batch);
  ir_attrs_set_int(m->attrs, &m->nattrs, "seqlen", p->model.seqlen);
  ir_attrs_set_int(m->attrs, &m->nattrs, "embed", p->model.embed);
  ir_attrs_set_int(m->attrs, &m->nattrs, "seed", p->model.seed);
  ir_attrs_set_str(m, m->attrs, &m->nattrs, "dtype", p->model.dtype);
  const FeOptimizer *o = &p->model.optimizer;
  ir_attrs_set_str(m, m->attrs, &m->nattrs, "optimizer", o->name);
  ir_attrs_set_float(m->attrs, &m->nattrs, "lr", o->lr);
  if (strcmp(o->name, "adamw") == 0) {
    ir_attrs_set_float(m->attrs, &m->nattrs, "beta1", o->beta1);
    ir_attrs_set_float(m->attrs, &m->nattrs, "beta2", o->beta2);
    ir_attrs_set_float(m->attrs, &m->nattrs, "eps", o->eps);
  }
  ir_attrs_set_float(m->attrs, &m->nattrs, "weight_decay", o->weight_decay);

  int64_t layer_index = 0;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    for (int64_t r = 0; r < l->repeat; r++, layer_index++)
      lower_layer(&L, p, l, ir_strfmt(m, "%s%lld", l->name, (long long)r), layer_index);
  }

  int64_t S = p->model.batch * p->model.seqlen, M = p->model.embed;
  L.f = ir_add_func(m, "loss.fwd");
  IrValue *out = ir_add_arg(L.f, m, "out", ir_type2(IR_F32, S, M));
  IrValue *target = ir_add_arg(L.f, m, "target", ir_type2(IR_F32, S, M));
  ir_add_ret(L.f, m, op2(&L, IR_OP_LOSS_MSE, "loss", out, target));
  return m;
}
