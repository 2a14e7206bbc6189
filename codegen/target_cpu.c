// Layer 8 of codegen/ (a target, the top): it may call the emitters and link.c.
//
// The CPU target: the host program calls libmoert's C kernels, OpenBLAS for GEMMs and MPI for
// collectives (codegen/emit_c.c); it builds wherever moec does and needs no device.
#include "cg.h"

static bool cpu_available(char *why, size_t size) {
  (void)why, (void)size;
  return true;
}

static bool cpu_emit(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o) {
  return cg_emit_c(d, out, m, plan, o);
}

static bool cpu_link(IrDiag *d, const char *c_path, const char *out_path, bool verbose) {
  return cg_link_program(d, c_path, out_path, NULL, verbose);
}

const CgTarget cg_target_cpu = {
    .name = "cpu",
    .bf16 = false,
    .shard_optimizer = true,
    .lora = true,
    .takes_arch = false,
    .probe = NULL,
    .available = cpu_available,
    .emit = cpu_emit,
    .link = cpu_link,
};
