// gate gshard: logits = x·Wg; training noise; scores = softmax(logits); the top k experts by
// score; gates renormalised to sum 1 with `renormalize` (default: when k > 1; with k 1 the gate is
// then 1); capacity locations; aux and z losses.
#include <math.h>

#include "fe_lower.h"

bool fe_gate_gshard(FeLower *L, IrValue *x, FeRouting *out) {
  IrParam *wg = fe_param(L, "moe.gate.wg", ir_type2(IR_F32, L->M, L->E), "normal", 1.0 / sqrt((double)L->M));
  IrValue *logits = fe_noise(L, fe_op2(L, IR_OP_MATMUL, "logits", FE_V(x), FE_P(wg)));
  IrValue *scores = fe_op1(L, IR_OP_GATE_SOFTMAX, "scores", FE_V(logits));
  fe_token_choice(L, logits, scores, L->layer->moe.gate.renormalize, out);
  return true;
}
