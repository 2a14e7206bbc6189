// gate xmoe (X-MoE): routing in a low-rank space. h = x·Wp [S, proj]; logits = cos(h, e_j) / tau
// where e_j are learned expert embeddings [E, proj], both L2-normalised, and tau a learned
// temperature (initialised to 0.07); then noise, softmax, top-k and `renormalize` as gshard.
#include <math.h>

#include "fe_lower.h"

bool fe_gate_xmoe(FeLower *L, IrValue *x, FeRouting *out) {
  int64_t D = L->layer->moe.gate.proj;
  IrParam *wp = fe_param(L, "moe.gate.proj", ir_type2(IR_F32, L->M, D), "normal", 1.0 / sqrt((double)L->M));
  IrParam *emb = fe_param(L, "moe.gate.expert_emb", ir_type2(IR_F32, L->E, D), "normal", 1.0);
  IrParam *temp = fe_param(L, "moe.gate.temperature", ir_type0(IR_F32), "const", 0.07);
  IrValue *h = fe_op1(L, IR_OP_L2NORM, "hn", FE_V(fe_op2(L, IR_OP_MATMUL, "h", FE_V(x), FE_P(wp))));
  IrValue *e = fe_op1(L, IR_OP_L2NORM, "en", FE_P(emb));
  IrValue *cos = fe_emit(L, IR_OP_MATMUL, "cos", 2, (IrOperand[]){FE_V(h), FE_V(e)}, 1, (IrAttr[]){FE_I("tb", 1)});
  IrValue *logits = fe_noise(L, fe_op2(L, IR_OP_DIV_SCALAR, "logits", FE_V(cos), FE_P(temp)));
  IrValue *scores = fe_op1(L, IR_OP_GATE_SOFTMAX, "scores", FE_V(logits));
  fe_token_choice(L, logits, scores, L->layer->moe.gate.renormalize, out);
  return true;
}
