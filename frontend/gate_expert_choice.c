// gate expert_choice: experts choose tokens. scores = softmax of the logits x·Wg (+ noise) over
// the tokens of each routing group, per expert (the transposed logits); every expert takes its
// T = ceil(k·capacity·S_g/E) highest-scoring tokens of each group, and the token's output from
// that expert is weighted by the score. A token may be taken by several experts or by none.
// Balanced by construction: no aux loss; z loss over the logits applies.
#include "fe_lower.h"

bool fe_gate_expert_choice(FeLower *L, IrValue *x, FeRouting *out) {
  const FeGate *g = &L->layer->moe.gate;
  IrValue *logits = fe_noise(L, fe_router_logits(L, x));   // no bias: the checker refuses it here
  IrValue *scores = fe_emit(L, IR_OP_GATE_SOFTMAX_TOKENS, "scores", 1, (IrOperand[]){FE_V(logits)}, 1,
                            (IrAttr[]){FE_I("groups", L->G)});
  out->capacity = fe_capacity(L, g->k);
  if (out->capacity > L->S / L->G) out->capacity = L->S / L->G;
  out->loc = fe_emit(L, IR_OP_GATE_EXPERT_CHOICE, "loc", 1, (IrOperand[]){FE_V(scores)}, 3,
                     (IrAttr[]){FE_I("experts", L->E), FE_I("groups", L->G), FE_I("capacity", out->capacity)});
  out->idx = fe_op1(L, IR_OP_GATE_IOTA, "idx", FE_V(scores));
  out->gates = scores;
  out->z = fe_emit(L, IR_OP_GATE_Z_LOSS, "z", 1, (IrOperand[]){FE_V(logits)}, 2,
                   (IrAttr[]){FE_I("groups", L->G), FE_F("coef", g->z_loss)});
  return true;
}
