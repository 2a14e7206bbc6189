// The CUDA kernel library (nvrtc_check --print-library, the file named by MK_LIBRARY) compiled as
// host C++: the CUDA qualifiers and intrinsics it uses, defined for the host, then the library.
// emu_check.cpp runs these functions under its emulation of threads and blocks (threadIdx,
// blockIdx, the barrier behind __syncthreads: one std::thread per CUDA thread, blocks one at a
// time so __shared__ can be static); fake_cuda.cpp under its own (one fiber per CUDA thread,
// switched at __syncthreads through emu_sync). gpu_check.cpp only takes their parameter types,
// to pass each argument to the GPU with the exact type the kernel declares. Without MK_LIBRARY
// only the definitions (tests/cuda/fused_host.h).
#ifndef HOST_KERNELS_H
#define HOST_KERNELS_H

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// inline: one of each in a program, so that a program's fused kernels (tests/cuda/fused_host.h,
// another translation unit) see the indices fake_cuda.cpp sets, across its fibers' switches too.
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<> *emu_barrier;   // set by emu_check's launcher; inline, not static: gpu_check never sets it
inline void (*emu_sync)();            // when set (fake_cuda), __syncthreads calls it instead of the barrier
static double emu_dyn_shared[1 << 16];
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define MK_DYN_SHARED(T, name) T *name = (T *)emu_dyn_shared
static inline void __syncthreads() {
  if (emu_sync)
    emu_sync();
  else
    emu_barrier->arrive_and_wait();
}
// The device-wide atomics and fence (mk_expert_counts). The blocks run one after another here and
// only thread 0 calls them, but emu_check's threads are threads: atomic all the same.
static inline int atomicAdd(int *p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
static inline int atomicExch(int *p, int v) { return std::atomic_ref<int>(*p).exchange(v); }
static inline int atomicMax(int *p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
  return old;
}
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }

// A fused group's kernel (codegen/fused.c), generated per program: moec compiles a program's
// fused kernels as host C++ for the fake device (tests/cuda/fused_host.h), with a table of these
// that fake_cuda.cpp looks kernels up in after the library's and runs as it runs the library's.
struct MkFusedKernel {
  const char *name;
  int nptrs;    // its parameters: pointers, all of them
  bool syncs;   // it calls __syncthreads (a group with a norm: one block per row)
  void (*thread)(void **args);   // one thread of it, at the threadIdx and blockIdx set
};

#ifdef MK_LIBRARY
#include MK_LIBRARY
#endif

#endif
