// libFuzzer harness for the IR parser, verifier and printer: any input must give diagnostics or
// a module, never a crash, and a module that parsed must round-trip exactly —
// print(parse(print(m))) == print(m) — or the harness aborts so the fuzzer keeps the input. A
// module that verifies goes through the fuse pass first (passes/fuse.c; the CPU target's groups
// when the input's first byte is odd, else the CUDA target's), which must leave it verifying,
// and its groups must round-trip too.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"
#include "passes/pass.h"

static FILE *devnull;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!devnull) devnull = fopen("/dev/null", "w");
  IrDiag d;
  ir_diag_init(&d, devnull);
  IrSource *src = ir_source_from_buffer("fuzz.ir", (const char *)data, size);
  if (!src) return 0;
  IrModule *m = ir_parse(&d, src);
  if (m) {
    if (ir_verify(&d, m)) {
      PassCtx ctx = {.d = &d, .log = devnull, .fuse = true, .fuse_cpu = size > 0 && (data[0] & 1)};   // either target's groups
      if (pass_fuse(m, &ctx) && !ir_verify(&d, m)) {
        fprintf(stderr, "the module does not verify after the fuse pass\n");
        abort();
      }
    }
    char *first = ir_print_to_string(m);
    if (!first) abort();
    IrDiag d2;
    ir_diag_init(&d2, devnull);
    IrSource *src2 = ir_source_from_buffer("printed.ir", first, strlen(first));
    IrModule *m2 = ir_parse(&d2, src2);
    if (!m2) {
      fprintf(stderr, "the printed module does not parse:\n%s\n", first);
      abort();
    }
    char *second = ir_print_to_string(m2);
    if (!second || strcmp(first, second) != 0) {
      fprintf(stderr, "round trip differs:\n--- first\n%s\n--- second\n%s\n", first, second ? second : "");
      abort();
    }
    free(second);
    ir_module_free(m2);
    ir_source_free(src2);
    free(first);
    ir_module_free(m);
  }
  ir_source_free(src);
  return 0;
}
