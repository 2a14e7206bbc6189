// Code generation: the scheduled, memory-planned IR module -> a C host program for the
// training step, linked with libmoert into the model binary.
#ifndef CG_H
#define CG_H

#include <stdbool.h>
#include <stdio.h>

#include "../ir/ir.h"
#include "../passes/pass.h"

// Writes the C program of module m (plan from the memplan pass) to out. source_name goes into
// the header comment. False (with a diagnostic) on an op the CPU target cannot emit.
bool cg_emit_c(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan,
               const char *source_name);

// Compiles and links the C file at c_path with libmoert into the executable out_path using
// the system C compiler ($CC, default cc). The compiler's output goes to stderr; false with a
// diagnostic when it fails.
bool cg_link(IrDiag *d, const char *c_path, const char *out_path, bool verbose);

#endif
