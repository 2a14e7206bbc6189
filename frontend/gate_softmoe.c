// gate softmoe (Soft MoE): every expert has N slots; logits = x·Wg [S, E·N]. Dispatch weights
// are the softmax of each slot's column over the tokens, combine weights the softmax of each
// token's row over all slots; slot inputs are dispatch^T·x, outputs combine·(expert outputs).
// Nothing is dropped; there is no k, capacity, noise or auxiliary loss.
#include <math.h>

#include "fe_lower.h"

bool fe_gate_softmoe(FeLower *L, IrValue *x, FeRouting *out) {
  int64_t N = L->layer->moe.gate.slots;
  IrParam *wg = fe_param(L, "moe.gate.wg", ir_type2(IR_F32, L->M, L->E * N), "normal", 1.0 / sqrt((double)L->M));
  IrValue *logits = fe_op2(L, IR_OP_MATMUL, "logits", FE_V(x), FE_P(wg));
  out->soft = true;
  out->slots = N;
  out->dispatch = fe_emit(L, IR_OP_GATE_SOFTMAX_TOKENS, "dispatch", 1, (IrOperand[]){FE_V(logits)}, 1,
                          (IrAttr[]){FE_I("groups", 1)});
  out->combine = fe_op1(L, IR_OP_GATE_SOFTMAX, "combine", FE_V(logits));
  return true;
}
