// gate sigmoid (BASE/StableMoE-style): scores = sigmoid(x·Wg + noise), independent per expert;
// the top k experts by score; each output is scaled by its own score (no renormalisation).
#include <math.h>

#include "fe_lower.h"

bool fe_gate_sigmoid(FeLower *L, IrValue *x, FeRouting *out) {
  IrParam *wg = fe_param(L, "moe.gate.wg", ir_type2(IR_F32, L->M, L->E), "normal", 1.0 / sqrt((double)L->M));
  IrValue *logits = fe_noise(L, fe_op2(L, IR_OP_MATMUL, "logits", FE_V(x), FE_P(wg)));
  IrValue *scores = fe_op1(L, IR_OP_GATE_SIGMOID, "scores", FE_V(logits));
  fe_token_choice(L, logits, scores, false, out);
  return true;
}
