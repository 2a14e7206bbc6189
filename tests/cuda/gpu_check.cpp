// gpu_check: the CUDA backend on a GPU (make test-gpu; tests/cuda/run.sh runs it too).
//
//   1. The whole kernel library (cg_emit_cuda_library) is compiled by NVRTC for this GPU's
//      architecture, as PTX (JIT-compiled by the driver) and as CUBIN, and each image is loaded.
//   2. Every kernel runs on the GPU on the cases of kernel_cases.h, the ones emu_check runs
//      under emulation, against libmoert's CPU kernels: integers exactly, floats to 1e-5.
//   3. cuBLAS: the expert GEMM (strided batched, every transpose, fp32 and bf16 inputs) and the
//      plain GEMM (with accumulation, and k = 0) against OpenBLAS (rt_expert_matmul /
//      rt_matmul), each element to 1e-4 of sum_k |a||b| (the scale of its rounding error).
//   4. NCCL on one rank, bootstrapped over MPI: AllReduce in place, AllGather, AlltoAll and
//      ReduceScatter chained over the compute, intra and inter streams with events between them.
//
// One line per check: "ok    gpu ..." or "FAIL  gpu ..." (the reason of a failed CUDA call is on
// stderr), then "N checks, F failed"; exit status 1 when one failed. Without a GPU (no driver,
// cuInit or cuDeviceGet fails, no device): the single line "skip  gpu: no GPU (REASON)" and
// exit status 0. Run it as one process: NCCL takes one GPU per rank.
//
// Kernel arguments: the launcher below gets each kernel's parameter types from the library
// compiled as host C++ (host_kernels.h), so a scalar reaches the GPU with the width the kernel
// declares (the literal 42 passed to a u64 seed is 8 bytes, not 4).
#include <array>
#include <functional>
#include <algorithm>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include "host_kernels.h"
#include "kernel_cases.h"

#define OMPI_SKIP_MPICXX 1   // the C API only
#define MPICH_SKIP_MPICXX 1
#include <cuda.h>
#include <mpi.h>

#define _Noreturn [[noreturn]]
extern "C" {
#include "codegen/cg.h"
#include "runtime/cuda/rt_cuda.h"
}
#undef _Noreturn

// ---- device buffers of host vectors ----

template <class T> static T *to_device(RtCuda *cu, RtStream s, const std::vector<T> &v) {
  T *d = (T *)rt_cuda_alloc(cu, v.size() * sizeof(T));
  return d && rt_cuda_to_device(cu, s, d, v.data(), v.size() * sizeof(T)) ? d : nullptr;
}

template <class T> static bool to_host(RtCuda *cu, RtStream s, std::vector<T> &v, const T *d) {
  return rt_cuda_to_host(cu, s, v.data(), d, v.size() * sizeof(T));
}

// ---- the kernel launcher of kernel_cases.h ----

struct GpuLauncher {
  RtCuda *cu;
  Checks &checks;
  std::set<std::string> launched;
  CUfunction wg = nullptr, wg256 = nullptr;   // the wgmma kernels of the sm_90a module (rt_cuda_load_wg), where it loaded

  struct Buffer {   // a vector argument and its copy on the GPU
    void *host, *device;
    size_t bytes;
  };

  // Copies each vector argument to the GPU (once, also when it is passed twice), launches the
  // kernel by name on the compute stream and copies every vector back.
  template <class... P, class... A>
  void launch(const char *name, void (*)(P...), int grid, int block, unsigned shared_bytes, A &&...args) {
    static_assert(sizeof...(P) == sizeof...(A), "the case passes a different number of arguments than the kernel takes");
    launched.insert(name);
    std::vector<Buffer> buffers;
    bool ok = true;
    std::tuple<P...> values{parameter<P>(args, buffers, ok)...};   // braces: evaluated in order
    auto pointers = addresses(values, std::index_sequence_for<P...>{});
    CUfunction f = !ok                                        ? nullptr
                   : strcmp(name, "mk_expert_gemm_wg") == 0    ? wg
                   : strcmp(name, "mk_expert_gemm_wg256") == 0 ? wg256
                                                               : rt_cuda_kernel(cu, name);
    ok = f && rt_cuda_launch(cu, RT_STREAM_COMPUTE, f, grid, block, shared_bytes, pointers.data());
    for (const Buffer &b : buffers)
      ok = ok && rt_cuda_to_host(cu, RT_STREAM_COMPUTE, b.host, b.device, b.bytes);
    ok = rt_cuda_sync(cu, RT_STREAM_COMPUTE) && ok;
    rt_cuda_arena_reset(cu);
    if (!ok) checks.fail("launch %s<<<%d, %d>>>: a CUDA call failed (reported above)", name, grid, block);
  }

  template <class P, class A> P parameter(A &a, std::vector<Buffer> &buffers, bool &ok) {
    if constexpr (is_vector<std::remove_cv_t<A>>::value) {
      using T = typename std::remove_cv_t<A>::value_type;
      for (const Buffer &b : buffers)
        if (b.host == (void *)a.data()) return kernel_pointer<P>((T *)b.device);
      T *d = ok ? to_device(cu, RT_STREAM_COMPUTE, a) : nullptr;
      ok = d != nullptr;
      buffers.push_back({(void *)a.data(), (void *)d, a.size() * sizeof(T)});
      return kernel_pointer<P>(d);
    } else {
      return kernel_scalar<P>(a);
    }
  }

  template <class Tuple, size_t... I>
  static std::array<void *, sizeof...(I)> addresses(Tuple &values, std::index_sequence<I...>) {
    return {{(void *)&std::get<I>(values)...}};
  }
};

// ---- 1. the library through NVRTC ----

static std::string library_source() {
  char *text = nullptr;
  size_t size = 0;
  FILE *f = open_memstream(&text, &size);
  if (!f) return "";
  cg_emit_cuda_library(f);
  fclose(f);
  std::string src(text, size);
  free(text);
  return src;
}

// Loads the library as PTX, then as CUBIN (the module the kernels run from). False when the
// CUBIN could not be loaded.
static bool load_library(RtCuda *cu, Checks &c, const std::string &src) {
  char arch[16];
  snprintf(arch, sizeof arch, "sm_%d", rt_cuda_device(cu)->arch);
  IrDiag diag;
  ir_diag_init(&diag, stderr);
  char *ptx = nullptr;
  size_t ptx_size = 0;
  if (cg_nvrtc_ptx(&diag, src.c_str(), arch, &ptx, &ptx_size) && rt_cuda_load_module(cu, ptx))
    c.ok("nvrtc library as PTX for compute_%s, JIT-compiled by the driver (%zu bytes)", arch + 3, ptx_size);
  else
    c.fail("nvrtc library as PTX for compute_%s (reported above)", arch + 3);
  free(ptx);
  void *cubin = nullptr;
  size_t cubin_size = 0;
  bool loaded = cg_nvrtc_compile(&diag, src.c_str(), arch, &cubin, &cubin_size) && rt_cuda_load_module(cu, cubin);
  if (loaded)
    c.ok("nvrtc library as CUBIN for %s (%zu bytes)", arch, cubin_size);
  else
    c.fail("nvrtc library as CUBIN for %s (reported above)", arch);
  free(cubin);
  return loaded;
}

// On sm_90: moec's grouped GEMM on wgmma, its unit (cg_emit_cuda_wg) compiled for sm_90a and loaded
// as a program loads it (rt_cuda_load_wg): the kernel of 128-wide tiles, and in *wg256 that of
// 256-wide ones. NULL (elsewhere, or failed).
static CUfunction load_wg(RtCuda *cu, Checks &c, CUfunction *wg256) {
  *wg256 = nullptr;
  if (rt_cuda_device(cu)->arch != 90) {
    printf("# mk_expert_gemm_wg: skipped (wgmma runs on sm_90, this GPU is sm_%d)\n", rt_cuda_device(cu)->arch);
    return nullptr;
  }
  IrDiag diag;
  ir_diag_init(&diag, stderr);
  void *cubin = nullptr;
  size_t cubin_size = 0;
  bool cached = false;   // compiled anew: NVRTC itself is under test
  CUfunction wg = cg_nvrtc_wg_cubin(&diag, false, &cubin, &cubin_size, &cached) ? rt_cuda_load_wg(cu, cubin, 128) : nullptr;
  if (wg) *wg256 = rt_cuda_load_wg(cu, cubin, 256);
  if (wg && *wg256)
    c.ok("nvrtc mk_expert_gemm_wg and _wg256 as CUBIN for sm_90a (%zu bytes), %d and %d bytes of shared memory allowed",
         cubin_size, RT_CUDA_WG_SHARED(128), RT_CUDA_WG_SHARED(256));
  else
    c.fail("nvrtc mk_expert_gemm_wg for sm_90a (reported above)");
  free(cubin);
  return wg;
}

// ---- 3. cuBLAS ----

// Every element of got within 1e-4 of want, relative to ref = sum_k |a||b| (+ |c| accumulated).
static void gemm_same(Checks &c, const std::string &name, const std::vector<float> &want,
                      const std::vector<float> &got, const std::vector<float> &ref) {
  for (size_t i = 0; i < want.size(); i++)
    if (!(fabs(got[i] - want[i]) <= 1e-4 * ref[i] + 1e-30)) {
      c.fail("%s: element %zu: cblas %.9g, cuBLAS %.9g (scale %.3g)", name.c_str(), i, want[i], got[i], ref[i]);
      return;
    }
  c.ok("%s (%zu elements)", name.c_str(), want.size());
}

static std::vector<float> absolute(std::vector<float> v) {
  for (float &x : v) x = fabsf(x);
  return v;
}

// v as bf16 on the GPU: the codes the library's mk_compress_bf16 makes of it (bf16_rounded is
// the same rounding on the host, back in fp32).
static void *bf16_on_device(RtCuda *cu, const std::vector<float> &v) {
  float *x = to_device(cu, RT_STREAM_COMPUTE, v);
  void *q = rt_cuda_alloc(cu, v.size() * sizeof(uint16_t));
  long long n = (long long)v.size();
  void *args[] = {&x, &q, &n};
  CUfunction f = x && q ? rt_cuda_kernel(cu, "mk_compress_bf16") : nullptr;
  return f && rt_cuda_launch(cu, RT_STREAM_COMPUTE, f, rt_cuda_grid(n, 256), 256, 0, args) ? q : nullptr;
}

static std::vector<float> bf16_rounded(const std::vector<float> &v) {
  std::vector<uint16_t> q(v.size());
  std::vector<float> r(v.size());
  rt_compress_bf16(v.data(), q.data(), (int64_t)v.size());
  rt_decompress_bf16(q.data(), r.data(), (int64_t)v.size());
  return r;
}

static void cublas_checks(RtCuda *cu, Checks &c, bool have_kernels) {
  const int e = 4, m = 33, n = 40, k = 24;
  auto a = randn((size_t)e * m * k), b = randn((size_t)e * k * n);
  for (RtCudaType type : {RT_CUDA_F32, RT_CUDA_BF16}) {
    if (type == RT_CUDA_BF16 && !have_kernels) {
      c.fail("cublas expert gemm bf16: needs the library's mk_compress_bf16, which did not load");
      continue;
    }
    auto a_in = type == RT_CUDA_BF16 ? bf16_rounded(a) : a, b_in = type == RT_CUDA_BF16 ? bf16_rounded(b) : b;
    for (int t = 0; t < 4; t++) {
      bool ta = t & 1, tb = t & 2;
      std::string name = std::string("cublas expert gemm ") + (type == RT_CUDA_BF16 ? "bf16" : "fp32") +
                         " [" + std::to_string(e) + "," + std::to_string(m) + "," + std::to_string(k) + "]x[" +
                         std::to_string(e) + "," + std::to_string(k) + "," + std::to_string(n) + "]" +
                         (ta ? " ta" : "") + (tb ? " tb" : "");
      std::vector<float> want((size_t)e * m * n), ref(want.size()), got(want.size());
      rt_expert_matmul(a_in.data(), b_in.data(), want.data(), e, m, n, k, ta, tb);
      rt_expert_matmul(absolute(a_in).data(), absolute(b_in).data(), ref.data(), e, m, n, k, ta, tb);
      const void *da = type == RT_CUDA_BF16 ? bf16_on_device(cu, a) : to_device(cu, RT_STREAM_COMPUTE, a);
      const void *db = type == RT_CUDA_BF16 ? bf16_on_device(cu, b) : to_device(cu, RT_STREAM_COMPUTE, b);
      float *dc = (float *)rt_cuda_alloc(cu, got.size() * sizeof(float));
      bool ok = da && db && dc && rt_cuda_expert_gemm(cu, RT_STREAM_COMPUTE, type, da, db, dc, e, m, n, k, ta, tb) &&
                to_host(cu, RT_STREAM_COMPUTE, got, dc) && rt_cuda_sync(cu, RT_STREAM_COMPUTE);
      rt_cuda_arena_reset(cu);
      if (ok)
        gemm_same(c, name, want, got, ref);
      else
        c.fail("%s: a CUDA or cuBLAS call failed (reported above)", name.c_str());
    }
  }
  // The plain GEMM accumulating into c, every transpose; then k = 0, which must write zeros.
  const int pm = 37, pn = 29, pk = 50;
  auto pa = randn((size_t)pm * pk), pb = randn((size_t)pk * pn), c0 = randn((size_t)pm * pn);
  for (int t = 0; t < 5; t++) {
    bool ta = t & 1, tb = t & 2, empty = t == 4;
    int kk = empty ? 0 : pk;
    std::string name = empty ? "cublas gemm k = 0 writes zeros"
                             : std::string("cublas gemm fp32 accumulate [37,50]x[50,29]") + (ta ? " ta" : "") +
                                   (tb ? " tb" : "");
    std::vector<float> want = c0, ref = absolute(c0), got(c0.size());
    rt_matmul(pa.data(), pb.data(), want.data(), pm, pn, kk, ta, tb, !empty);
    rt_matmul(absolute(pa).data(), absolute(pb).data(), ref.data(), pm, pn, kk, ta, tb, !empty);
    float *da = to_device(cu, RT_STREAM_COMPUTE, pa), *db = to_device(cu, RT_STREAM_COMPUTE, pb);
    float *dc = to_device(cu, RT_STREAM_COMPUTE, c0);
    bool ok = da && db && dc && rt_cuda_gemm(cu, RT_STREAM_COMPUTE, RT_CUDA_F32, da, db, dc, pm, pn, kk, ta, tb, !empty) &&
              to_host(cu, RT_STREAM_COMPUTE, got, dc) && rt_cuda_sync(cu, RT_STREAM_COMPUTE);
    rt_cuda_arena_reset(cu);
    if (ok)
      gemm_same(c, name, want, got, ref);
    else
      c.fail("%s: a CUDA or cuBLAS call failed (reported above)", name.c_str());
  }
}

// The expert GEMMs over their filled rows (rt_cuda_expert_gemm_rows): cuBLASLt's grouped GEMM
// where this GPU's cuBLASLt has it, else the padded GEMM, against libmoert's padded GEMM on the
// same zero-padded operands: groups of 48 slots (an expert's, or a block of 2 an expert), filled
// 0, 48, 17, 5, 1, ... rows; C's rows past the counts zeroed first, as mk_expert_counts does. Then
// the weight gradient's form (ta: the sum over an expert's filled slots, one expert with none).
// bf16 once more with moec's grouped GEMM on tensor cores (mk_expert_gemm_tc,
// MOERT_CUDA_GROUPED=moec: before cuBLASLt's), and on sm_90 with mk_expert_gemm_wg in its place.
static void grouped_checks(RtCuda *cu, Checks &c, bool have_kernels, CUfunction wg, CUfunction wg256) {
  char why[256];
  bool grouped = rt_cuda_grouped_gemms(cu, why, sizeof why);
  printf("# expert GEMMs over their filled rows: %s%s\n", grouped ? "cuBLASLt's grouped GEMM" : "the padded GEMM: ", why);
  const int e = 4, per = 48, m = 40, n = 40, k = 32;
  const int fill[] = {0, per, 17, 5, 1, 33, 48, 2};
  CUfunction tc = have_kernels ? rt_cuda_kernel(cu, "mk_expert_gemm_tc") : nullptr;
  for (int run = 0; run < (wg ? 5 : 3); run++) {   // fp32, bf16, bf16 on moec's kernel, on wgmma (128, 256 wide)
    RtCudaType type = run ? RT_CUDA_BF16 : RT_CUDA_F32;
    bool moec = run >= 2;
    rt_cuda_use_wg(cu, run == 3 ? wg : run == 4 ? wg256 : nullptr, run == 4 ? 256 : 128);
    if (type == RT_CUDA_BF16 && !have_kernels) {
      c.fail("grouped expert gemm bf16%s: needs the library's mk_compress_bf16, which did not load", moec ? " (moec's)" : "");
      continue;
    }
    if (moec && !tc) {
      c.fail("grouped expert gemm on moec's kernel: the library has no mk_expert_gemm_tc");
      continue;
    }
    if (moec) setenv("MOERT_CUDA_GROUPED", "moec", 1);
    for (int form = 0; form < 4; form++) {   // 0: blocks 1, 1: blocks 2, 2: blocks 1 tb, 3: ta (a weight gradient)
      bool ta = form == 3, tb = form == 2;
      int blocks = form == 1 ? 2 : 1, groups = e * blocks, slots = per * blocks;
      int rows_m = ta ? m : slots, kk = ta ? slots : k;   // [e, rows_m, n] = op(a) [e, rows_m, kk] x op(b) [e, kk, n]
      std::vector<int> counts(2 * (size_t)groups);
      for (int g = 0; g < groups; g++) counts[(size_t)g] = fill[g % 8], counts[(size_t)(groups + g)] = std::max(fill[g % 8], 1);
      auto a = randn((size_t)e * rows_m * kk), b = randn((size_t)e * kk * n);
      // the counted operand's rows past the counts zero: a's slot rows (!ta), b's (ta)
      std::vector<float> &x = ta ? b : a;
      int width = ta ? n : k;
      for (int g = 0; g < groups; g++)
        std::fill(x.begin() + ((size_t)g * per + counts[(size_t)g]) * width, x.begin() + (size_t)(g + 1) * per * width, 0.0f);
      auto a_in = type == RT_CUDA_BF16 ? bf16_rounded(a) : a, b_in = type == RT_CUDA_BF16 ? bf16_rounded(b) : b;
      std::string name = std::string("grouped expert gemm ") + (type == RT_CUDA_BF16 ? "bf16" : "fp32") +
                         (ta ? " weight gradient (ta)" : tb ? " tb" : "") + ", " + std::to_string(groups) + " groups" +
                         (run == 4 ? ", moec's kernel on wgmma (128 x 256 tiles)" : run == 3 ? ", moec's kernel on wgmma"
                          : moec ? ", moec's kernel on tensor cores" : "");
      std::vector<float> want((size_t)e * rows_m * n), ref(want.size()), got(want.size());
      rt_expert_matmul(a_in.data(), b_in.data(), want.data(), e, rows_m, n, kk, ta, tb);
      rt_expert_matmul(absolute(a_in).data(), absolute(b_in).data(), ref.data(), e, rows_m, n, kk, ta, tb);
      const void *da = type == RT_CUDA_BF16 ? bf16_on_device(cu, a) : to_device(cu, RT_STREAM_COMPUTE, a);
      const void *db = type == RT_CUDA_BF16 ? bf16_on_device(cu, b) : to_device(cu, RT_STREAM_COMPUTE, b);
      const int *dn = to_device(cu, RT_STREAM_COMPUTE, counts);
      float *dc = to_device(cu, RT_STREAM_COMPUTE, std::vector<float>(got.size(), 0.0f));
      CUfunction f = moec ? tc : nullptr;
      bool ok = da && db && dn && dc &&
                rt_cuda_expert_gemm_rows(cu, RT_STREAM_COMPUTE, type, da, db, dc, e, rows_m, n, kk, ta, tb, dn, blocks, f) &&
                to_host(cu, RT_STREAM_COMPUTE, got, dc) && rt_cuda_sync(cu, RT_STREAM_COMPUTE);
      if (ok) {   // the second call: the site's setup made, the grouped call alone
        std::fill(got.begin(), got.end(), 0.0f);
        ok = rt_cuda_zero(cu, RT_STREAM_COMPUTE, dc, got.size() * sizeof(float)) &&
             rt_cuda_expert_gemm_rows(cu, RT_STREAM_COMPUTE, type, da, db, dc, e, rows_m, n, kk, ta, tb, dn, blocks, f) &&
             to_host(cu, RT_STREAM_COMPUTE, got, dc) && rt_cuda_sync(cu, RT_STREAM_COMPUTE);
      }
      rt_cuda_arena_reset(cu);
      if (ok)
        gemm_same(c, name, want, got, ref);
      else
        c.fail("%s: a CUDA or cuBLAS call failed (reported above)", name.c_str());
    }
    if (moec) unsetenv("MOERT_CUDA_GROUPED");
  }
  rt_cuda_use_wg(cu, nullptr, 0);
  int padded = 0, moec = 0, sites = rt_cuda_grouped_sites(cu, &padded, &moec);
  printf("# grouped expert gemm: %d call sites ran cuBLASLt's grouped GEMM, %d padded (no algorithm or alignment), "
         "%d moec's\n", sites, padded, moec);
}

// The three GEMMs of the expert rows timed on one shape of a large layer (8 experts of 640 slots,
// k = n = 2048, bf16, filled 400 to 640 rows: 83 % on average, a capacity factor of 1.2; then a
// quarter of that, as a dropless layer's slots of top-2 of 8 experts are filled): the
// padded GEMM (cuBLAS, every slot), moec's grouped GEMM and, where the GPU's cuBLASLt has it,
// cuBLASLt's; the forward's form and the weight gradient's (ta). One '#' line each, milliseconds
// a call (the median of 5 runs of 10 calls) and TFLOP/s over the filled rows: what the next GPU
// session reads first (docs/gpu.md).
static double ms_per_call(RtCuda *cu, const std::function<bool()> &call) {
  std::vector<double> runs;
  for (int r = 0; r < 6; r++) {
    if (!rt_cuda_sync(cu, RT_STREAM_COMPUTE)) return -1.0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 10; i++)
      if (!call()) return -1.0;
    if (!rt_cuda_sync(cu, RT_STREAM_COMPUTE)) return -1.0;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (r > 0) runs.push_back(((double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6) / 10.0);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

static void grouped_timing(RtCuda *cu, bool have_kernels, CUfunction wg, CUfunction wg256, int div) {
  CUfunction tc = have_kernels ? rt_cuda_kernel(cu, "mk_expert_gemm_tc") : nullptr;
  if (!tc) {
    printf("# grouped expert gemm timing: skipped (the library's mk_expert_gemm_tc did not load)\n");
    return;
  }
  const int e = 8, per = 640, k = 2048, n = 2048;
  std::vector<int> counts(2 * e);
  double filled = 0.0;
  for (int x = 0; x < e; x++) {
    counts[(size_t)x] = (400 + (x * 97) % 241) / div;   // 400 .. 640 (div 4: 100 .. 160)
    counts[(size_t)(e + x)] = counts[(size_t)x];
    filled += counts[(size_t)x];
  }
  std::vector<uint16_t> a((size_t)e * per * k), b((size_t)e * k * n);
  std::mt19937 gen(3);
  for (auto *v : {&a, &b})
    for (auto &q : *v) q = (uint16_t)(0x3c00u + gen() % 0x0400u);   // bf16 in [2^-7, 2^-6)
  for (int x = 0; x < e; x++)   // the slots past the counts zero (a's rows, the forward's operand)
    std::fill(a.begin() + ((size_t)x * per + counts[(size_t)x]) * k, a.begin() + (size_t)(x + 1) * per * k, (uint16_t)0);
  const uint16_t *da = to_device(cu, RT_STREAM_COMPUTE, a), *db = to_device(cu, RT_STREAM_COMPUTE, b);
  const int *dn = to_device(cu, RT_STREAM_COMPUTE, counts);
  float *dc = (float *)rt_cuda_alloc(cu, (size_t)e * std::max(per, k) * n * sizeof(float));
  if (!da || !db || !dn || !dc) {
    printf("# grouped expert gemm timing: skipped (device memory)\n");
    rt_cuda_arena_reset(cu);
    return;
  }
  char why[256];
  bool lt = rt_cuda_grouped_gemms(cu, why, sizeof why);
  for (int form = 0; form < 2; form++) {   // 0: c [e, per, n] = a [e, per, k] b [e, k, n]; 1: c [e, k, n] = a^T b (ta, slots summed)
    bool ta = form == 1;
    int m = ta ? k : per, kk = ta ? per : k;
    double flop = 2.0 * filled * k * n;
    auto rows = [&](CUfunction f) {
      return [&, f] { return rt_cuda_expert_gemm_rows(cu, RT_STREAM_COMPUTE, RT_CUDA_BF16, da, db, dc, e, m, n, kk, ta, false, dn, 1, f); };
    };
    auto pad = [&] { return rt_cuda_expert_gemm(cu, RT_STREAM_COMPUTE, RT_CUDA_BF16, da, db, dc, e, m, n, kk, ta, false); };
    double t_pad = ms_per_call(cu, pad);
    setenv("MOERT_CUDA_GROUPED", "moec", 1);
    double t_moec = ms_per_call(cu, rows(tc));
    double t_wg = -1.0, t_wg256 = -1.0;
    if (wg) {   // the same calls with the wgmma kernels in mk_expert_gemm_tc's place
      rt_cuda_use_wg(cu, wg, 128);
      t_wg = ms_per_call(cu, rows(tc));
      rt_cuda_use_wg(cu, wg256, 256);
      t_wg256 = ms_per_call(cu, rows(tc));
      rt_cuda_use_wg(cu, nullptr, 0);
    }
    unsetenv("MOERT_CUDA_GROUPED");
    char wg_text[192] = "wgmma: none here";
    if (wg)
      snprintf(wg_text, sizeof wg_text, "on wgmma %.3f ms (%.0f TFLOP/s, %.2fx the padded), on wgmma 128 x 256 tiles "
               "%.3f ms (%.0f TFLOP/s, %.2fx)", t_wg, flop / t_wg / 1e9, t_pad / t_wg, t_wg256, flop / t_wg256 / 1e9,
               t_pad / t_wg256);
    double t_lt = lt ? ms_per_call(cu, rows(nullptr)) : -1.0;
    char lt_text[96] = "cuBLASLt's grouped GEMM: none here";
    if (lt)
      snprintf(lt_text, sizeof lt_text, "cuBLASLt's grouped GEMM %.3f ms (%.0f TFLOP/s)", t_lt, flop / t_lt / 1e9);
    printf("# grouped expert gemm timing, %s [8 x 640 slots, %.0f %% filled%s] x [2048, 2048] bf16: padded cuBLAS %.3f ms "
           "(%.0f TFLOP/s over the filled rows), moec's on mma.sync %.3f ms (%.0f TFLOP/s, %.2fx the padded), %s, %s\n",
           ta ? "weight gradient (ta)" : "forward", 100.0 * filled / (e * per), div > 1 ? ", as in a dropless layer" : "",
           t_pad, flop / t_pad / 1e9, t_moec,
           flop / t_moec / 1e9, t_pad / t_moec, wg_text, lt_text);
  }
  rt_cuda_arena_reset(cu);
}

// ---- 4. NCCL ----

static void identical(Checks &c, const char *name, const std::vector<float> &want, const std::vector<float> &got) {
  if (memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0)
    c.ok("%s (%zu floats, bit-identical)", name, want.size());
  else
    c.fail("%s: the result differs from the input", name);
}

// compute: y = x + x (mk_add), event 0; intra, after event 0: AllReduce y in place, AllGather
// y -> g, event 1; inter, after event 1: AlltoAll g -> t, ReduceScatter t -> r. On one rank
// every collective is the identity, so each result is exactly 2x.
static void nccl_checks(RtCuda *cu, Checks &c, bool have_kernels) {
  if (!have_kernels) {
    c.fail("nccl: needs the library's mk_add, which did not load");
    return;
  }
  int ranks = 0;
  if (MPI_Init(nullptr, nullptr) != MPI_SUCCESS || MPI_Comm_size(MPI_COMM_WORLD, &ranks) != MPI_SUCCESS) {
    c.fail("nccl: MPI_Init failed");
    return;
  }
  RtNccl *nc = nullptr;
  if (ranks != 1)
    c.fail("nccl: %d MPI ranks; run gpu_check as one process (one GPU)", ranks);
  else if ((nc = rt_cuda_nccl_create(MPI_COMM_WORLD)))
    c.ok("nccl communicator of 1 rank, bootstrapped over MPI");
  else
    c.fail("nccl communicator of 1 rank, bootstrapped over MPI (reported above)");
  if (nc) {
    const size_t n = 4096;
    std::vector<float> x = randn(n), want = x, y(n), g(n), t(n), r(n);
    for (float &v : want) v += v;
    long long count = (long long)n;
    float *dx = to_device(cu, RT_STREAM_COMPUTE, x);
    float *dy = (float *)rt_cuda_alloc(cu, n * sizeof(float)), *dg = (float *)rt_cuda_alloc(cu, n * sizeof(float));
    float *dt = (float *)rt_cuda_alloc(cu, n * sizeof(float)), *dr = (float *)rt_cuda_alloc(cu, n * sizeof(float));
    void *args[] = {&dx, &dx, &dy, &count};
    CUfunction add = dx && dy && dg && dt && dr ? rt_cuda_kernel(cu, "mk_add") : nullptr;
    bool ok = add && rt_cuda_launch(cu, RT_STREAM_COMPUTE, add, rt_cuda_grid(count, 256), 256, 0, args) &&
              rt_cuda_record(cu, RT_STREAM_COMPUTE, 0) &&
              rt_cuda_wait(cu, RT_STREAM_INTRA, 0) && rt_cuda_zero(cu, RT_STREAM_INTRA, dg, n * sizeof(float)) &&
              rt_cuda_allreduce(cu, nc, RT_STREAM_INTRA, dy, dy, n) && rt_cuda_allgather(cu, nc, RT_STREAM_INTRA, dy, dg, n) &&
              rt_cuda_record(cu, RT_STREAM_INTRA, 1) &&
              rt_cuda_wait(cu, RT_STREAM_INTER, 1) && rt_cuda_zero(cu, RT_STREAM_INTER, dt, n * sizeof(float)) &&
              rt_cuda_zero(cu, RT_STREAM_INTER, dr, n * sizeof(float)) &&
              rt_cuda_alltoall(cu, nc, RT_STREAM_INTER, dg, dt, n) && rt_cuda_reducescatter(cu, nc, RT_STREAM_INTER, dt, dr, n) &&
              to_host(cu, RT_STREAM_INTER, y, dy) && to_host(cu, RT_STREAM_INTER, g, dg) &&
              to_host(cu, RT_STREAM_INTER, t, dt) && to_host(cu, RT_STREAM_INTER, r, dr) && rt_cuda_sync(cu, RT_STREAM_INTER);
    rt_cuda_arena_reset(cu);
    if (ok) {
      identical(c, "nccl allreduce in place (intra stream, after an event of compute)", want, y);
      identical(c, "nccl allgather (intra stream)", want, g);
      identical(c, "nccl alltoall by grouped send/recv (inter stream, after an event of intra)", want, t);
      identical(c, "nccl reducescatter (inter stream)", want, r);
    } else {
      c.fail("nccl collectives on the intra and inter streams: a call failed (reported above)");
    }
    if (!rt_cuda_nccl_destroy(nc)) c.fail("nccl communicator destroyed (reported above)");
  }
  if (MPI_Finalize() != MPI_SUCCESS) c.fail("nccl: MPI_Finalize failed");
}

int main() {
  char why[512];
  if (!rt_cuda_probe(why, sizeof why)) {
    printf("skip  gpu: no GPU (%s)\n", why);
    return 0;
  }
  Checks checks{"gpu"}, kernel_checks{"gpu kernel"};
  RtCuda *cu = rt_cuda_create((size_t)256 << 20, 2);
  if (!cu) {
    checks.fail("runtime on device 0: context, streams, events, cuBLAS, arena (reported above)");
    printf("%d checks, %d failed\n", checks.checks, checks.failures);
    return 1;
  }
  const RtCudaDevice *d = rt_cuda_device(cu);
  printf("# device 0: %s, sm_%d, %d SMs, %.1f GiB; driver for CUDA %d.%d\n", d->name, d->arch, d->multiprocessors,
         d->memory_bytes / 1073741824.0, d->driver_version / 1000, d->driver_version % 1000 / 10);
  std::string src = library_source();
  bool have_kernels = load_library(cu, checks, src);
  CUfunction wg256 = nullptr, wg = have_kernels ? load_wg(cu, checks, &wg256) : nullptr;
  if (!wg256) wg = nullptr;
  if (have_kernels) {
    GpuLauncher launcher{cu, kernel_checks, {}, wg, wg256};
    if (!wg) launcher.launched.insert({"mk_expert_gemm_wg", "mk_expert_gemm_wg256"});   // no case runs them here (said above)
    run_kernel_cases(launcher, kernel_checks);
    check_coverage(kernel_checks, src, launcher.launched);
  }
  cublas_checks(cu, checks, have_kernels);
  grouped_checks(cu, checks, have_kernels, wg, wg256);
  grouped_timing(cu, have_kernels, wg, wg256, 1);   // capacity 1.2
  grouped_timing(cu, have_kernels, wg, wg256, 4);   // a quarter of that: top-2 of 8 experts, dropless (every token's slot in each)
  nccl_checks(cu, checks, have_kernels);
  if (!rt_cuda_destroy(cu)) checks.fail("runtime released (reported above)");
  int total = checks.checks + kernel_checks.checks, failed = checks.failures + kernel_checks.failures;
  printf("%d checks, %d failed\n", total, failed);
  return failed ? 1 : 0;
}
