// The fused kernels of one CUDA program as host C++ for the fake device (tests/cuda/fake_cuda.cpp).
// Under MOEC_CUDA_FAKE=1 moec writes PROGRAM.fused.cpp (codegen/emit_cuda.c's
// cg_emit_cuda_fused_host): this header, the kernel prelude and the program's fused kernels in
// an unnamed namespace (the prelude's helpers are also in the fake device's library), then the
// table mk_fused_kernels[mk_fused_count] of MkFusedKernel; its link step compiles it into the
// program (codegen/target_cuda.c). The fake device finds a kernel there when the library has
// none of its name, and runs it as it runs the library's (threads as fibers where it has
// barriers); the thread indices are shared with it (host_kernels.h).
#ifndef FUSED_HOST_H
#define FUSED_HOST_H

#include <cstring>

#include "host_kernels.h"

#define MK_FUSED static

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
