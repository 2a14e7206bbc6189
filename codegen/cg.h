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

// Writes the CUDA C translation unit of module m's device kernels (codegen/emit_cuda.c): one
// extern "C" __global__ kernel `mk_<op>` per op kind the module uses other than GEMMs (cuBLAS)
// and collectives (NCCL), fused gate kernels where the gate's ops allow, no host code and no
// #include, ready for NVRTC. False (with a diagnostic) on an op it cannot emit.
bool cg_emit_cuda(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan);
// The same prelude with every kernel the CUDA target has (the test of the whole library).
void cg_emit_cuda_library(FILE *out);

// NVRTC (codegen/nvrtc.c, built only where the CUDA toolkit is found). arch is "sm_80", "sm_90"
// (any "sm_NN"): the CUBIN for that architecture, and the PTX of compute_NN that newer GPUs
// JIT-compile. Results are malloc'd; false with a diagnostic holding NVRTC's program log.
bool cg_nvrtc_compile(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *size);
bool cg_nvrtc_ptx(IrDiag *d, const char *src, const char *arch, char **ptx, size_t *size);

// Compiles and links the C file at c_path with libmoert into the executable out_path using
// the system C compiler ($CC, default cc). The compiler's output goes to stderr; false with a
// diagnostic when it fails.
bool cg_link(IrDiag *d, const char *c_path, const char *out_path, bool verbose);

#endif
