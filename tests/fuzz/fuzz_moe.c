// libFuzzer harness for the front end: arbitrary bytes as a .moe file through fe_load (lexer,
// parser, checker). It must never crash, hang or leak, whatever the input; diagnostics go to
// /dev/null. Seeds: tests/fuzz/corpus_moe/ (valid models and the diagnostics cases).
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fe.h"

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
  fe_program_free(p);
  ir_source_free(src);
  return 0;
}
