// experts ffn gpt: FFN(x) = act(x·W1 + b1)·W2 + b2, act one of ir/activations.def (gelu, the tanh
// form, by default), biases optional; batched over the experts.
#include <math.h>

#include "fe_lower.h"

IrValue *fe_expert_gpt(FeLower *L, IrValue *disp) {
  const FeExperts *x = &L->layer->moe.experts;
  IrParam *w1 = fe_expert_param(L, "moe.experts.w1", ir_type3(IR_F32, L->E, L->M, L->H), "normal", 1.0 / sqrt((double)L->M), 2);
  IrParam *b1 = x->bias ? fe_expert_param(L, "moe.experts.b1", ir_type2(IR_F32, L->E, L->H), "zeros", 0, 1) : NULL;
  IrParam *w2 = fe_expert_param(L, "moe.experts.w2", ir_type3(IR_F32, L->E, L->H, L->M), "normal", 1.0 / sqrt((double)L->H), 1);
  IrParam *b2 = x->bias ? fe_expert_param(L, "moe.experts.b2", ir_type2(IR_F32, L->E, L->M), "zeros", 0, -1) : NULL;
  IrValue *h = fe_expert_linear(L, "h", disp, w1);
  if (b1) h = fe_op2(L, IR_OP_EXPERT_BIAS, "hb", FE_V(h), FE_P(b1));
  h = fe_act(L, x->act, "act", h);
  IrValue *y = fe_expert_linear(L, "y", h, w2);
  if (b2) y = fe_op2(L, IR_OP_EXPERT_BIAS, "yb", FE_V(y), FE_P(b2));
  return y;
}
