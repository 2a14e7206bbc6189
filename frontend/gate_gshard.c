// gate gshard: logits = x·Wg (+ bg with `bias true`); training noise; scores = softmax(logits);
// the top k experts by score; gates renormalised to sum 1 with `renormalize` (default: when k > 1;
// with k 1 the gate is then 1); capacity locations; aux and z losses.
#include "fe_lower.h"

bool fe_gate_gshard(FeLower *L, IrValue *x, FeRouting *out) {
  IrValue *logits = fe_noise(L, fe_router_logits(L, x));
  IrValue *scores = fe_op1(L, IR_OP_GATE_SOFTMAX, "scores", FE_V(logits));
  fe_token_choice(L, logits, scores, L->layer->moe.gate.renormalize, out);
  return true;
}
