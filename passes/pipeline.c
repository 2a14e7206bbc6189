// The pass pipeline, in order (lang/manual.md §14). One readable loop: run a pass, verify the module,
// dump it if asked. `fuse` decides every fusion of both targets (IrGroup: elementwise chains,
// norms, column sums; on CUDA the gate's chain and the update runs; on the CPU the groups in a
// GEMM's pieces).
#include <stdlib.h>
#include <string.h>

#include "pass.h"

const PassInfo pass_list[] = {
    {"verify", pass_verify, "structural checks: arity, attributes, operands, names"},
    {"shapes", pass_shapes, "shape inference: every result type from its operands"},
    {"parallelize", pass_parallelize, "one rank's program: MP split/gather, EP alltoall, ESP gather/reduce-scatter, expert shards"},
    {"autodiff", pass_autodiff, "backward functions with saved activations, the loss gradient, the optimizer"},
    {"recompute", pass_recompute, "saved activations the model or moec build's memory choice names, computed again in the backward (recompute=1)"},
    {"cost", pass_cost, "price the GEMMs and collectives with the cluster profile: cost_n, cost_t (ms)"},
    {"pipeline", pass_pipeline, "per MoE layer and phase the pipeline degree r (Algorithm 1 and the simulator, or the model's explicit degrees)"},
    {"gradpart", pass_gradpart, "place the dense gradients' AllReduces in the overlap slots of later backward layers"},
    {"schedule", pass_schedule, "split expert regions into r chunks along the capacity, assign streams and events per policy"},
    {"fuse", pass_fuse, "fused groups (fused G KIND {...}, inner=1): elementwise chains, norms, column sums; CUDA: gate chains, update runs; CPU: groups in GEMM pieces"},
    {"memplan", pass_memplan, "buffer lifetimes over the whole step, arena offsets with reuse, peak bytes"},
};
const int pass_count = sizeof pass_list / sizeof pass_list[0];

bool pass_known(const char *name) {
  if (strcmp(name, "lower") == 0) return true;
  for (int i = 0; i < pass_count; i++)
    if (strcmp(pass_list[i].name, name) == 0) return true;
  return false;
}

static void dump(IrModule *m, PassCtx *ctx, const char *after) {
  FILE *out = ctx->dump_out ? ctx->dump_out : stdout;
  if (ctx->dump_all) fprintf(out, "# ---- after %s ----\n", after);
  ir_print(out, m);
}

static bool wants_dump(PassCtx *ctx, const char *name) {
  return ctx->dump_all || (ctx->dump_after && strcmp(ctx->dump_after, name) == 0);
}

bool pass_run_pipeline(IrModule *m, PassCtx *ctx) {
  if (wants_dump(ctx, "lower")) dump(m, ctx, "lower");
  if (ctx->stop_after && strcmp(ctx->stop_after, "lower") == 0) return true;
  for (int i = 0; i < pass_count; i++) {
    const PassInfo *p = &pass_list[i];
    int before = ctx->d->errors;
    if (!p->run(m, ctx) || ctx->d->errors > before) return false;
    if (!ir_verify(ctx->d, m)) {
      ir_internal(ctx->d, "the module does not verify after pass '%s'", p->name);
      return false;
    }
    if (wants_dump(ctx, p->name)) dump(m, ctx, p->name);
    if (ctx->after_pass && !ctx->after_pass(m, p->name, ctx->after_arg)) return false;
    if (ctx->stop_after && strcmp(ctx->stop_after, p->name) == 0) break;
  }
  return true;
}
