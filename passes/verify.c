// The `verify` and `shapes` passes: the first checks the module's structure, the second
// re-derives every result type from its operands (ir_infer_type) and stores it, so a module
// read from IR text with a stale or hand-edited type is caught with the op's location.
#include "pass.h"

bool pass_verify(IrModule *m, PassCtx *ctx) { return ir_verify(ctx->d, m); }

bool pass_shapes(IrModule *m, PassCtx *ctx) {
  bool ok = true;
  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    for (int j = 0; j < f->nops; j++) {
      IrOp *op = f->ops[j];
      if (!op->result) continue;
      IrType t;
      if (!ir_infer_type(ctx->d, op, &t)) {
        ok = false;
        continue;
      }
      op->result->type = t;
    }
  }
  return ok;
}
