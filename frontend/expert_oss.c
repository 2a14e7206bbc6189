// experts ffn oss (gpt-oss's clamped SwiGLU, transformers' GptOssExperts): g = x·W1 + b1 (the
// gate), u = x·W3 + b3 (the up projection), FFN(x) = ((clamp(u, -7, 7) + 1) · g' · sigmoid(1.702
// g'))·W2 + b2 with g' = min(g, 7); biases always; batched over the experts.
#include <math.h>

#include "fe_lower.h"

IrValue *fe_expert_oss(FeLower *L, IrValue *disp) {
  IrParam *w1 = fe_expert_param(L, "moe.experts.w1", ir_type3(IR_F32, L->E, L->M, L->H), "normal", 1.0 / sqrt((double)L->M), 2);
  IrParam *b1 = fe_expert_param(L, "moe.experts.b1", ir_type2(IR_F32, L->E, L->H), "zeros", 0, 1);
  IrParam *w3 = fe_expert_param(L, "moe.experts.w3", ir_type3(IR_F32, L->E, L->M, L->H), "normal", 1.0 / sqrt((double)L->M), 2);
  IrParam *b3 = fe_expert_param(L, "moe.experts.b3", ir_type2(IR_F32, L->E, L->H), "zeros", 0, 1);
  IrParam *w2 = fe_expert_param(L, "moe.experts.w2", ir_type3(IR_F32, L->E, L->H, L->M), "normal", 1.0 / sqrt((double)L->H), 1);
  IrParam *b2 = fe_expert_param(L, "moe.experts.b2", ir_type2(IR_F32, L->E, L->M), "zeros", 0, -1);
  IrValue *g = fe_expert_linear(L, "h1", disp, w1);
  g = fe_op2(L, IR_OP_EXPERT_BIAS, "h1b", FE_V(g), FE_P(b1));
  IrValue *u = fe_expert_linear(L, "h3", disp, w3);
  u = fe_op2(L, IR_OP_EXPERT_BIAS, "h3b", FE_V(u), FE_P(b3));
  IrValue *a = fe_op2(L, IR_OP_ACT_OSS, "act", FE_V(g), FE_V(u));
  IrValue *y = fe_expert_linear(L, "y", a, w2);
  return fe_op2(L, IR_OP_EXPERT_BIAS, "yb", FE_V(y), FE_P(b2));
}
