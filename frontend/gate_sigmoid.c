// gate sigmoid (BASE/StableMoE-style): scores = sigmoid(x·Wg (+ bg) + noise), independent per expert;
// the top k experts by score; each output is scaled by its own score, or with `renormalize true`
// by the k chosen scores scaled to sum 1 (DeepSeek-V3's norm_topk_prob).
#include "fe_lower.h"

bool fe_gate_sigmoid(FeLower *L, IrValue *x, FeRouting *out) {
  IrValue *logits = fe_noise(L, fe_router_logits(L, x));
  IrValue *scores = fe_op1(L, IR_OP_GATE_SIGMOID, "scores", FE_V(logits));
  fe_token_choice(L, logits, scores, L->layer->moe.gate.renormalize, out);
  return true;
}
