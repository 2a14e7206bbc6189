// libFuzzer harness for the front end: arbitrary bytes as a .moe file through fe_load (lexer,
// parser, checker) and, for a program that checks, the layout rules of `parallel auto;`; a
// program of at most 8 layer instances that names no file (cluster, hf_config) is then lowered
// for the CPU or the CUDA target (the input's first byte says which) and goes through every pass
// (pass_run_pipeline: autodiff, parallelize, the planner, fuse, memplan, ...), which must verify
// or refuse it with a diagnostic. It must never crash, hang or leak, whatever the input;
// diagnostics go to /dev/null. Seeds: tests/fuzz/corpus_moe/ (valid models and the diagnostics
// cases).
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fe.h"
#include "passes/pass.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static FILE *devnull;
  if (!devnull && !(devnull = fopen("/dev/null", "w")))
    return 0;
  IrSource *src = ir_source_from_buffer("fuzz.moe", (const char *)data, size);
  if (!src)
    return 0;
  IrDiag d;
  ir_diag_init(&d, devnull);
  FeProgram *p = fe_load(&d, src);
  // The layout search's rules (parallel auto) on every layout of 4 ranks.
  for (int mp = 1; p && mp <= 4; mp *= 2)
    for (int esp = 1; esp <= 4; esp *= 2) {
      char why[240];
      FeParallel par = {.dp = 4 / mp, .mp = mp, .ep = 4 / esp, .esp = esp};
      fe_layout_refusal(p, &par, why, sizeof why);
    }
  int64_t instances = 0;
  for (int i = 0; p && i < p->nlayers; i++) instances += p->layers[i].repeat;
  if (p && instances <= 8 && !p->cluster_path && !p->hf_config_path) {
    bool cuda = size > 0 && (data[0] & 1);
    FeTargetCaps caps = {.name = cuda ? "cuda" : "cpu", .bf16 = cuda, .shard_optimizer = !cuda, .lora = true};
    IrModule *m = fe_lower(&d, p, &caps);
    if (m) {
      PassCtx ctx = {.d = &d, .log = devnull, .fuse = true, .fuse_cpu = !cuda};
      pass_run_pipeline(m, &ctx);
      pass_ctx_free(&ctx);
      ir_module_free(m);
    }
  }
  fe_program_free(p);
  ir_source_free(src);
  return 0;
}
