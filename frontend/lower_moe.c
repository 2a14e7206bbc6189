// One MoE block lowered (fe_lower_moe): the gate (a registry entry, frontend/gate_*.c) routes the
// tokens, the order packs them per expert, the experts (frontend/expert_*.c) run batched over
// experts, the order unpacks and weights their outputs, a shared expert (when written) adds its
// output; hooks sit at their six points. Above the registry and lower_ops.c; below lower.c (an
// MoE stack's layers) and lower_lm.c (a language model's blocks).
#include <math.h>
#include <string.h>

#include "fe_lower.h"

// ---- hooks ----
static const FeHook *find_hook(const FeLower *L, const char *point, const char *action) {
  const FeMoe *moe = &L->layer->moe;
  for (int i = 0; i < moe->nhooks; i++)
    if (strcmp(moe->hooks[i].point, point) == 0 && strcmp(moe->hooks[i].action, action) == 0)
      return &moe->hooks[i];
  return NULL;
}

static void record(FeLower *L, const char *point, IrValue *v) {
  if (!find_hook(L, point, "record")) return;
  fe_emit(L, IR_OP_HOOK_RECORD, NULL, 1, (IrOperand[]){FE_V(v)}, 2,
          (IrAttr[]){{.key = "point", .kind = IR_ATTR_STR, .s = point}, FE_I("layer", L->layer_index)});
}

// A tensor about to cross the network at `before` (before_dispatch, before_combine): record
// it, compress it when asked; the matching after-point decompresses and may record again.
static IrValue *hook_pair(FeLower *L, const char *before, const char *after, IrValue *v, const char *name) {
  record(L, before, v);
  const FeHook *c = find_hook(L, before, "compress");
  if (c) {
    if (strcmp(c->arg, "int8") == 0) {
      IrValue *scales = fe_op1(L, IR_OP_HOOK_SCALES, ir_strfmt(L->m, "%s.scales", name), FE_V(v));
      IrValue *q = fe_op2(L, IR_OP_HOOK_COMPRESS_INT8, ir_strfmt(L->m, "%s.q", name), FE_V(v), FE_V(scales));
      v = fe_op2(L, IR_OP_HOOK_DECOMPRESS_INT8, ir_strfmt(L->m, "%s.dq", name), FE_V(q), FE_V(scales));
    } else {
      IrValue *q = fe_emit(L, IR_OP_HOOK_COMPRESS, ir_strfmt(L->m, "%s.q", name), 1, (IrOperand[]){FE_V(v)}, 1,
                           (IrAttr[]){{.key = "format", .kind = IR_ATTR_STR, .s = c->arg}});
      v = fe_op1(L, IR_OP_HOOK_DECOMPRESS, ir_strfmt(L->m, "%s.dq", name), FE_V(q));
    }
  }
  record(L, after, v);
  return v;
}

// ---- orders ----
static IrValue *reshape(FeLower *L, const char *name, IrValue *v, int rank, int64_t d0, int64_t d1, int64_t d2) {
  IrAttr a[4] = {FE_I("rank", rank), FE_I("d0", d0), FE_I("d1", d1), FE_I("d2", d2)};
  return fe_emit(L, IR_OP_RESHAPE, name, 1, (IrOperand[]){FE_V(v)}, rank + 1, a);
}

// ---- the shared expert ----
// `shared { ffn mixtral { hidden Hs; } gate sigmoid; }`: every token also goes through one SwiGLU
// expert, s = (silu(x·W1) ⊙ (x·W3))·W2, scaled by sigmoid(x·wg) per token when gated (Qwen2-MoE's
// shared_expert and shared_expert_gate), and s is added to the routed output. Its parameters are
// dense, not expert parameters: parallelize replicates them on every rank, which computes the
// shared expert of its own tokens (after the MP split), and reduces their gradients over the
// world, as the gate's.
static IrValue *shared_expert(FeLower *L, IrValue *x) {
  const FeMoe *moe = &L->layer->moe;
  int64_t M = L->M, Hs = moe->shared.hidden;
  double in_std = 1.0 / sqrt((double)M);
  IrParam *w1 = fe_param(L, "moe.shared.w1", ir_type2(IR_F32, M, Hs), "normal", in_std);
  IrParam *w3 = fe_param(L, "moe.shared.w3", ir_type2(IR_F32, M, Hs), "normal", in_std);
  IrParam *w2 = fe_param(L, "moe.shared.w2", ir_type2(IR_F32, Hs, M), "normal", 1.0 / sqrt((double)Hs));
  bool lora = L->p->model.has_lora && L->p->model.lora.shared;
  IrValue *h1 = fe_op2(L, IR_OP_MATMUL, "shared.h1", FE_V(x), FE_P(w1));
  if (lora) h1 = fe_lora(L, x, h1, w1, "shared.h1", -1, -1);
  IrValue *h3 = fe_op2(L, IR_OP_MATMUL, "shared.h3", FE_V(x), FE_P(w3));
  if (lora) h3 = fe_lora(L, x, h3, w3, "shared.h3", -1, -1);
  IrValue *a = fe_op1(L, IR_OP_ACT_SILU, "shared.act", FE_V(h1));
  IrValue *glu = fe_op2(L, IR_OP_MUL, "shared.glu", FE_V(a), FE_V(h3));
  const char *yname = moe->shared_gated ? "shared.y" : "shared";
  IrValue *y = fe_op2(L, IR_OP_MATMUL, lora ? "shared.y0" : yname, FE_V(glu), FE_P(w2));
  if (lora) y = fe_lora(L, glu, y, w2, yname, -1, -1);
  if (!moe->shared_gated) return y;
  IrParam *wg = fe_param(L, "moe.shared.gate", ir_type2(IR_F32, M, 1), "normal", in_std);
  IrValue *logit = fe_op2(L, IR_OP_MATMUL, "shared.logit", FE_V(x), FE_P(wg));
  IrValue *g = fe_op1(L, IR_OP_GATE_SIGMOID, "shared.g", FE_V(logit));
  return fe_op2(L, IR_OP_SCALE_ROWS, "shared", FE_V(y), FE_V(g));
}

IrValue *fe_lower_moe(FeLower *L, IrValue *x, IrValue **aux, IrValue **z) {
  const FeMoe *moe = &L->layer->moe;
  const FeGateDef *gate = fe_gate_find(moe->gate.name);
  const FeExpertDef *expert = fe_expert_find(moe->experts.kind);
  if (!gate || !expert) UNREACHABLE();  // the checker accepts registered names only
  record(L, "before_moe_start", x);

  FeRouting r = {0};
  gate->lower(L, x, &r);
  bool dense = r.soft || strcmp(moe->order, "gshard") == 0;
  int64_t C = r.soft ? r.slots : L->G * r.capacity;
  IrAttr route[3] = {FE_I("experts", L->E), FE_I("groups", L->G), FE_I("capacity", r.capacity)};
  IrValue *disp, *mask = NULL;
  if (r.soft) {
    disp = fe_emit(L, IR_OP_MATMUL, "disp2", 2, (IrOperand[]){FE_V(r.dispatch), FE_V(x)}, 1, (IrAttr[]){FE_I("ta", 1)});
    disp = reshape(L, "disp", disp, 3, L->E, C, L->M);
  } else if (dense) {
    mask = fe_emit(L, IR_OP_ORDER_DISPATCH_MASK, "mask", 2, (IrOperand[]){FE_V(r.idx), FE_V(r.loc)}, 3, route);
    disp = fe_emit(L, IR_OP_MATMUL, "disp2", 2, (IrOperand[]){FE_V(mask), FE_V(x)}, 1, (IrAttr[]){FE_I("ta", 1)});
    disp = reshape(L, "disp", disp, 3, L->E, C, L->M);
    // MP splits the tokens (passes/parallelize.c): the capacity slots of dimension 1 shrink with them
    if (L->p->parallel.mp > 1) ir_op_set_int(disp->def, "mp_tokens", 1);
  } else {
    disp = fe_emit(L, IR_OP_ORDER_ENCODE, "disp", 3, (IrOperand[]){FE_V(x), FE_V(r.idx), FE_V(r.loc)}, 3, route);
  }
  disp = hook_pair(L, "before_dispatch", "after_dispatch", disp, "disp");
  int before = L->m->nparams;
  IrValue *y = expert->lower(L, disp);
  for (int i = before; L->p->parallel.dp * L->p->parallel.mp > 1 && i < L->m->nparams; i++) {
    // the layer's dispatch algorithm, for parallelize
    IrParam *p = L->m->params[i];
    ir_attrs_set_str(L->m, p->attrs, &p->nattrs, "dispatch", moe->algo);
  }
  y = hook_pair(L, "before_combine", "after_combine", y, "y");
  IrValue *combined;
  if (dense) {
    IrValue *y2 = reshape(L, "y2", y, 2, L->E * C, L->M, 0);
    if (!r.soft && L->p->parallel.mp > 1) ir_op_set_int(y2->def, "mp_tokens", 0);
    IrValue *cw = r.soft ? r.combine
                         : fe_emit(L, IR_OP_ORDER_COMBINE_WEIGHTS, "cw", 3,
                                   (IrOperand[]){FE_V(r.idx), FE_V(r.loc), FE_V(r.gates)}, 3, route);
    combined = fe_op2(L, IR_OP_MATMUL, "moe", FE_V(cw), FE_V(y2));
  } else {
    combined = fe_emit(L, IR_OP_ORDER_DECODE, "moe", 4,
                       (IrOperand[]){FE_V(y), FE_V(r.idx), FE_V(r.loc), FE_V(r.gates)}, 3, route);
  }
  if (moe->has_shared)
    combined = fe_op2(L, IR_OP_ADD, "moe.total", FE_V(combined), FE_V(shared_expert(L, x)));
  record(L, "before_moe_end", combined);
  *aux = r.aux;
  *z = r.z;
  return combined;
}
