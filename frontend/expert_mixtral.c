// experts ffn mixtral (SwiGLU): FFN(x) = (silu(x·W1) ⊙ (x·W3))·W2, no biases; batched over the
// experts.
#include <math.h>

#include "fe_lower.h"

IrValue *fe_expert_mixtral(FeLower *L, IrValue *disp) {
  IrParam *w1 = fe_expert_param(L, "moe.experts.w1", ir_type3(IR_F32, L->E, L->M, L->H), "normal", 1.0 / sqrt((double)L->M), 2);
  IrParam *w3 = fe_expert_param(L, "moe.experts.w3", ir_type3(IR_F32, L->E, L->M, L->H), "normal", 1.0 / sqrt((double)L->M), 2);
  IrParam *w2 = fe_expert_param(L, "moe.experts.w2", ir_type3(IR_F32, L->E, L->H, L->M), "normal", 1.0 / sqrt((double)L->H), 1);
  IrValue *h1 = fe_expert_linear(L, "h1", disp, w1);
  IrValue *h3 = fe_expert_linear(L, "h3", disp, w3);
  IrValue *a = fe_op1(L, IR_OP_ACT_SILU, "act", FE_V(h1));
  IrValue *p = fe_op2(L, IR_OP_MUL, "glu", FE_V(a), FE_V(h3));
  return fe_expert_linear(L, "y", p, w2);
}
