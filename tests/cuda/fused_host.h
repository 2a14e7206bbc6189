// The fused kernels of one CUDA program as host C++ for the fake device (tests/cuda/fake_cuda.cpp).
// Under MOEC_CUDA_FAKE=1 moec writes PROGRAM.fused.cpp (codegen/emit_cuda.c's
// cg_emit_cuda_fused_host): this header, the kernel prelude and the program's fused kernels in
// an unnamed namespace (the prelude's helpers are also in the fake device's library), then a
// table of MkFusedKernel that it registers with the fake device before main (mk_fused_register);
// its link step compiles it into the program (codegen/target_cuda.c), one per pipeline stage of a
// model of several. The fake device finds a kernel there when the library has none of its name,
// and runs it as it runs the library's (threads as fibers where it has barriers); the thread
// indices are shared with it (host_kernels.h).
#ifndef FUSED_HOST_H
#define FUSED_HOST_H

#include <cstring>

#include "host_kernels.h"

#define MK_FUSED static

// count kernels of table (fake_cuda.cpp), before main: the tables of every stage of a model.
extern "C" void mk_fused_register(const MkFusedKernel *table, int count);

// The pointer the launch's argument holds, as the kernel's parameter type (float *, u16 *).
struct MkPtr {
  void *p;
  template <class T> operator T *() const { return (T *)p; }
};
static inline MkPtr mk_ptr(void *arg) {
  MkPtr p;
  memcpy(&p.p, arg, sizeof p.p);
  return p;
}

#endif
