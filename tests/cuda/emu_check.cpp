// emu_check: the CUDA kernels of the CUDA target (nvrtc_check --print-library), compiled as host
// C++ (host_kernels.h) and run under a small emulation of the CUDA execution model (one
// std::thread per CUDA thread, a barrier for __syncthreads, blocks one at a time so __shared__
// can be static) on the cases of kernel_cases.h, against libmoert's CPU kernels: integers
// exactly, floats to 1e-5 relative. It checks the kernels' semantics (indexing, groups,
// reductions, the fused gate) without a GPU; it says nothing about GPU arithmetic (exp/log/tanh
// differ in the last ulps there) or performance: tests/cuda/gpu_check.cpp runs the same cases on
// a GPU.
//
// Built by tests/cuda/run.sh: g++ -std=c++20 -DMK_LIBRARY='"LIB.cu"' ... (see there).
#include <fstream>
#include <sstream>
#include <thread>

#include "host_kernels.h"
#include "kernel_cases.h"

struct EmuLauncher {
  std::set<std::string> launched;
  bool wg = true;   // mk_expert_gemm_wg and _wg256 run here (their emulation)

  // Runs kernel on grid blocks of block threads, one block after the other. The dynamic shared
  // memory is host_kernels.h's static buffer, whatever shared_bytes says.
  template <class... P, class... A>
  void launch(const char *name, void (*kernel)(P...), int grid, int block, unsigned shared_bytes, A &&...args) {
    static_assert(sizeof...(P) == sizeof...(A), "the case passes a different number of arguments than the kernel takes");
    launched.insert(name);
    gridDim.x = grid;
    blockDim.x = block;
    for (int b = 0; b < grid; b++) {
      std::barrier<> bar(block);
      emu_barrier = &bar;
      std::vector<std::thread> threads;
      for (int t = 0; t < block; t++)
        threads.emplace_back([&, b, t] {
          blockIdx.x = b;
          threadIdx.x = t;
          kernel(argument<P>(args)...);
        });
      for (auto &th : threads) th.join();
    }
  }

  template <class P, class A> static P argument(A &a) {
    if constexpr (is_vector<std::remove_cv_t<A>>::value)
      return kernel_pointer<P>(a.data());
    else
      return kernel_scalar<P>(a);
  }
};

int main() {
  Checks checks{"cuda emu"};
  EmuLauncher launcher;
  run_kernel_cases(launcher, checks);
  std::ifstream library(MK_LIBRARY);
  std::stringstream src;
  src << library.rdbuf();
  check_coverage(checks, src.str(), launcher.launched);
  printf("%d checks, %d failed\n", checks.checks, checks.failures);
  return checks.failures ? 1 : 0;
}
