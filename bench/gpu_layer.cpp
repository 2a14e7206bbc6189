// gpu_layer: make bench-gpu's moec side (issue 7). One single-GPU MoE layer, forward and
// backward, built from moec's CUDA kernel library (codegen/emit_cuda.c, compiled by NVRTC for
// this GPU) and cuBLAS through the CUDA runtime (runtime/cuda/rt_cuda.h), beside the expert
// GEMMs alone: the layer's roofline.
//
// The layer is what `moec build --target cuda` runs for
//
//   layer block { moe {
//     experts 8 { ffn gpt { hidden H; act gelu; bias true; } }      (or: ffn mixtral { hidden H; })
//     gate gshard { k 2; capacity 1.2; aux_loss 0.01; }
//     order tutel;
//   } }
//
// on B x L tokens of width M (DESIGN.md §6, Table 4: B {1,2,4}, L {512,1024,2048}, M {1024,
// 2048,4096}, H = hscale*M with hscale {2,3,4}; E = 8 experts on one GPU, so every shape fits):
// the launch plan that `moec build --emit cuda` prints for it, op for op and in program order
// (gate matmul; the fused gate mk_gate_softmax_topk_gather; locations; aux and z statistics;
// encode; expert GEMMs with bias and gelu, or SwiGLU; decode; residual add; then the backward
// of each, the aux loss's gradient and the gate's). Gradients are written where the
// parameters' gradients live (the plan's param.grad copies are then not needed).
//
// Measured, per shape and ffn (fp32 everywhere, no TF32, as the CPU backend; with --dtype bf16 as
// the CUDA target's `dtype bf16`: every GEMM, the gate's too, reads bf16 copies of its operands,
// the weights' rounded once per run with mk_compress_bf16 (the program's P16), the other operand
// rounded into a scratch slot unless the previous GEMM left its copy there; cuBLAS multiplies them
// with fp32 accumulation and output; everything else stays fp32):
//   layer ms    forward + backward of the layer
//   gemm ms     the expert GEMMs alone (forward and backward set, the layer's own
//               rt_cuda_expert_gemm calls on its own buffers; bf16: on bf16 operands, without
//               the roundings): what the layer would cost if everything but those GEMMs took
//               no time
//   gemm/layer  gemm ms / layer ms: 1.0 is the roofline
//   gate us     the fused gate kernel alone (softmax -> top-k -> gather)
//   route us    the whole routing: gate matmul + fused gate + locations
//   TF/s        FLOPs / time: the layer's (expert GEMMs over the capacity slots + gate GEMMs)
//               over layer ms, the expert GEMMs' over gemm ms
//   drop %      choices over capacity, from mk_gate_locations' statistics
// Times are medians of --runs runs after --warmup runs. Each run is bracketed by two GPU
// timestamps taken in stream order on the compute stream (bench_stamp below, %globaltimer in
// ns), which is what a CUDA event pair measures: rt_cuda's events have no timing and its
// streams are its own, so events cannot be recorded on them from here. The gate and the
// routing are timed over 100 back-to-back launches per run.
//
// Before timing, the layer runs once on a small shape against libmoert's CPU kernels
// (the CPU backend's twin of every op): routing exactly, outputs and gradients to 1e-4 of
// the largest value. A mismatch or a failed CUDA or cuBLAS call (explained on stderr by
// rt_cuda) ends the run with FAILED and exit status 1.
//
// Without a GPU: one line "skip  bench-gpu: no GPU (REASON)" and exit status 0.
//
//   build/bench/gpu_layer [--quick | --all | --shapes SPEC] [--dtype fp32|bf16] [--runs N] [--warmup N]
//                         [--list-shapes]
// The check against the CPU kernels runs in fp32 either way (bf16 changes the routing of close
// scores; tests/cuda/gpu.sh checks bf16 training against fp32).
//   SPEC: comma-separated FFN:BxLxMxHSCALE, e.g. gpt:4x2048x4096x4,mixtral:1x512x1024x2
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <tuple>
#include <unordered_map>
#include <thread>
#include <utility>
#include <vector>

#include "tests/cuda/host_kernels.h"   // the kernel library as host C++: each kernel's parameter types

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

enum {
  EXPERTS = 8,
  CHOICES = 2,           // k
  GATE_REPS = 100,       // launches per timed run of the gate and of the routing
  MAX_RUNS = 1000,
};
static const double CAPACITY_FACTOR = 1.2;
static const float AUX_COEF = 0.01f;
static const double MAX_REL_ERR = 1e-4;
static const uint64_t SEED = 42;

// --dtype bf16: the layers carry the bf16 scratch (want_bf16), and once the fp32 checks are done
// their GEMMs run on bf16 operands (bf16).
static bool want_bf16 = false, bf16 = false;

// The benchmark's own kernels, compiled with the library (they use its prelude: u64, i64,
// MK_FOR, mk_normal).
static const char bench_kernels_src[] =
    "// ---- bench/gpu_layer.cpp's kernels ----\n"
    "// The GPU's nanosecond clock into t[i], in stream order: a timestamp like a CUDA event's.\n"
    "extern \"C\" __global__ void bench_stamp(u64 *t, int i) {\n"
    "  u64 now;\n"
    "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(now));\n"
    "  if (blockIdx.x == 0 && threadIdx.x == 0) t[i] = now;\n"
    "}\n"
    "// y[i] = scale * N(0,1): runtime/rng.c's rt_normal(key, i).\n"
    "extern \"C\" __global__ void bench_randn(float *y, i64 n, float scale, u64 key) {\n"
    "  MK_FOR(i, n) y[i] = (float)(scale * mk_normal(key, (u64)i));\n"
    "}\n";

// Host declarations of those kernels, for their parameter types as host_kernels.h gives the
// library's (LAUNCH converts each argument to them); never called.
static void bench_stamp(u64 *, int) {}
static void bench_randn(float *, i64, float, u64) {}

// ---- shapes ----

typedef enum Ffn { FFN_GPT, FFN_MIXTRAL } Ffn;

static const char *ffn_name(Ffn f) { return f == FFN_GPT ? "gpt" : "mixtral"; }

struct Shape {
  Ffn ffn;
  int batch, seqlen, model, hscale;
};

// A representative subset of Table 4: every value of B, L, M and hscale appears, tokens
// B*L from 512 to 8192, the largest shape last; each with both ffns.
static const int default_shapes[][4] = {
    {1, 512, 1024, 2}, {2, 1024, 1024, 4}, {4, 2048, 1024, 3}, {1, 2048, 2048, 3}, {4, 512, 2048, 2},
    {2, 2048, 2048, 4}, {1, 1024, 4096, 4}, {4, 1024, 4096, 2}, {4, 2048, 4096, 4},
};

static std::string shape_name(const Shape &s) {
  return std::to_string(s.batch) + "x" + std::to_string(s.seqlen) + "x" + std::to_string(s.model) + "x" +
         std::to_string(s.hscale);
}

// "gpt:4x2048x4096x4,..." -> shapes; false on a malformed spec.
static bool parse_shapes(const char *spec, std::vector<Shape> &out) {
  std::string s = spec;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    std::string item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    Shape sh;
    char ffn[16];
    int used = 0;
    if (sscanf(item.c_str(), "%15[a-z]:%dx%dx%dx%d%n", ffn, &sh.batch, &sh.seqlen, &sh.model, &sh.hscale, &used) != 5 ||
        used != (int)item.size() || sh.batch < 1 || sh.seqlen < 1 || sh.model < 1 || sh.hscale < 1)
      return false;
    if (strcmp(ffn, "gpt") == 0)
      sh.ffn = FFN_GPT;
    else if (strcmp(ffn, "mixtral") == 0)
      sh.ffn = FFN_MIXTRAL;
    else
      return false;
    out.push_back(sh);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return !out.empty();
}

// The layer's sizes: S tokens, M model, H hidden, E experts, K choices, T capacity per expert
// (T = ceil(k*f*S/E - 1e-9), as ir_capacity_slots computes it).
struct Dims {
  int64_t s, m, h, e, k, t;
};

static Dims dims_of(const Shape &sh) {
  Dims d;
  d.s = (int64_t)sh.batch * sh.seqlen;
  d.m = sh.model;
  d.h = (int64_t)sh.hscale * sh.model;
  d.e = EXPERTS;
  d.k = CHOICES;
  d.t = std::max<int64_t>(1, (int64_t)ceil((double)d.k * CAPACITY_FACTOR * (double)d.s / (double)d.e - 1e-9));   // ir_capacity_slots
  return d;
}

// GEMMs per expert: gpt 2 (W1, W2), mixtral 3 (W1, W3, W2); each has two in the backward.
static int gemms_per_expert(Ffn f) { return f == FFN_GPT ? 2 : 3; }

static double expert_flops(const Dims &d, Ffn f) {   // forward + backward, over the capacity slots
  return 3.0 * gemms_per_expert(f) * 2.0 * d.e * d.t * d.m * d.h;
}

static double gate_flops(const Dims &d) { return 3.0 * 2.0 * d.s * d.m * d.e; }

// ---- the GPU: kernels by name, launches with the kernel's own parameter types ----

struct Gpu {
  RtCuda *cu = nullptr;
  bool ok = true;   // false from the first failed call on (rt_cuda reported it); later calls are skipped
  u16 *sa = nullptr, *sb = nullptr;   // bf16: a GEMM's operands rounded (the layer's scratch: two slots)
  const float *in_slot[2] = {nullptr, nullptr};   // whose bf16 copy sa and sb hold now
  bool raw = false;                   // bf16: GEMMs on sa and sb as they are (the GEMMs alone)
  struct Weight {
    const float *w;
    u16 *copy;
    int64_t n;
  };
  std::vector<Weight> weights;        // bf16: the parameters' copies (the CUDA target's P16)
  std::unordered_map<std::string, CUfunction> kernels;

  CUfunction kernel(const char *name) {
    auto it = kernels.find(name);
    if (it != kernels.end()) return it->second;
    CUfunction f = rt_cuda_kernel(cu, name);
    if (f) kernels[name] = f;
    return f;
  }

  void launch_raw(const char *name, int grid, int block, unsigned shared_bytes, void **args) {
    if (!ok) return;
    CUfunction f = kernel(name);
    ok = f && rt_cuda_launch(cu, RT_STREAM_COMPUTE, f, grid, block, shared_bytes, args);
  }

  // Launches the library kernel `name` declared as `decl` (host_kernels.h): every argument is
  // converted to the kernel's parameter type, so it reaches the GPU with the declared width.
  template <class... P, class... A>
  void launch(const char *name, void (*decl)(P...), int grid, int block, unsigned shared_bytes, A... args) {
    static_assert(sizeof...(P) == sizeof...(A), "the launch passes a different number of arguments than the kernel takes");
    (void)decl;
    if (!ok) return;
    std::tuple<P...> values{parameter<P>(args)...};
    std::apply([&](auto &...v) {
      void *pointers[] = {(void *)&v...};
      launch_raw(name, grid, block, shared_bytes, pointers);
    }, values);
  }

  template <class P, class A> P parameter(A a) {
    if constexpr (std::is_integral_v<P> && std::is_integral_v<A>) {
      if (!std::in_range<P>(a)) {
        fprintf(stderr, "gpu_layer: kernel argument %lld does not fit the kernel's parameter type\n", (long long)a);
        ok = false;
      }
    }
    return static_cast<P>(a);
  }

  // bf16, as the CUDA target's host program does (codegen/emit_cuda_host.c): the parameters are
  // rounded once per step into their copies (refresh, at the forward's start), and a GEMM reads
  // a parameter's copy; another operand is rounded into one of the two slots sa, sb unless a slot
  // holds its copy already (the previous GEMM's; forgotten at each function's start: forget).
  void refresh() {
    for (const Weight &w : weights)
      launch("mk_compress_bf16", &mk_compress_bf16, rt_cuda_grid(w.n, MK_BLOCK), MK_BLOCK, 0u, w.w, w.copy, w.n);
  }
  void forget() { in_slot[0] = in_slot[1] = nullptr; }

  // bf16: the bf16 operands of a GEMM on a (na elements) and b (nb); raw: sa and sb as they are.
  std::pair<const void *, const void *> operands(const float *a, int64_t na, const float *b, int64_t nb) {
    if (!bf16) return {a, b};
    if (raw) return {sa, sb};
    const float *src[2] = {a, b};
    int64_t n[2] = {na, nb};
    const void *use[2] = {nullptr, nullptr};
    int slot[2] = {-1, -1};
    for (int k = 0; k < 2; k++) {
      for (const Weight &w : weights)
        if (w.w == src[k]) use[k] = w.copy;
      for (int j = 0; !use[k] && j < 2; j++)
        if (in_slot[j] == src[k]) slot[k] = j;
    }
    for (int k = 0; k < 2; k++) {
      if (use[k]) continue;
      if (slot[k] < 0) {
        slot[k] = slot[1 - k] == 0 ? 1 : 0;
        u16 *dst = slot[k] ? sb : sa;
        launch("mk_compress_bf16", &mk_compress_bf16, rt_cuda_grid(n[k], MK_BLOCK), MK_BLOCK, 0u, src[k], dst, n[k]);
        in_slot[slot[k]] = src[k];
      }
      use[k] = slot[k] ? sb : sa;
    }
    return {use[0], use[1]};
  }

  void gemm(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
    auto [pa, pb] = operands(a, m * k, b, k * n);
    if (ok)
      ok = rt_cuda_gemm(cu, RT_STREAM_COMPUTE, bf16 ? RT_CUDA_BF16 : RT_CUDA_F32, pa, pb, c, (int)m, (int)n, (int)k, ta,
                        tb, false);
  }

  void expert_gemm(const float *a, const float *b, float *c, int64_t e, int64_t m, int64_t n, int64_t k, bool ta,
                   bool tb) {
    auto [pa, pb] = operands(a, e * m * k, b, e * k * n);
    if (ok)
      ok = rt_cuda_expert_gemm(cu, RT_STREAM_COMPUTE, bf16 ? RT_CUDA_BF16 : RT_CUDA_F32, pa, pb, c, (int)e, (int)m,
                               (int)n, (int)k, ta, tb);
  }

  template <class T> void to_host(std::vector<T> &v, const T *d) {
    if (ok) ok = rt_cuda_to_host(cu, RT_STREAM_COMPUTE, v.data(), d, v.size() * sizeof(T));
  }

  void sync() {
    if (ok) ok = rt_cuda_sync(cu, RT_STREAM_COMPUTE);
  }
};

#define LAUNCH(gpu, grid, block, kernel, ...) (gpu).launch(#kernel, &kernel, grid, block, 0u, __VA_ARGS__)
#define LAUNCH_SHARED(gpu, grid, block, shared, kernel, ...) \
  (gpu).launch(#kernel, &kernel, grid, block, (unsigned)(shared), __VA_ARGS__)

static int elementwise_grid(int64_t n) { return rt_cuda_grid(n, MK_BLOCK); }   // grid-stride kernels
static int block_grid(int64_t n) { return (int)std::clamp<int64_t>(n, 1, 65535); }   // a block per row/choice/token
// the bias gradients' grid, as the CUDA target's (cg_cuda_column_tiles)
static int tile_grid(int64_t e, int64_t cols) { return (int)cg_cuda_column_tiles(e, cols); }

// The library (cg_emit_cuda_library) and the bench's kernels through NVRTC as CUBIN for this GPU.
static bool load_kernels(Gpu &gpu) {
  char *text = nullptr;
  size_t size = 0;
  FILE *f = open_memstream(&text, &size);
  if (!f) return false;
  cg_emit_cuda_library(f);
  fclose(f);
  std::string src = std::string(text, size) + bench_kernels_src;
  free(text);
  char arch[16];
  snprintf(arch, sizeof arch, "sm_%d", rt_cuda_device(gpu.cu)->arch);
  IrDiag diag;
  ir_diag_init(&diag, stderr);
  void *cubin = nullptr;
  size_t cubin_size = 0;
  bool ok = cg_nvrtc_compile(&diag, src.c_str(), arch, &cubin, &cubin_size) && rt_cuda_load_module(gpu.cu, cubin);
  free(cubin);
  if (ok)
    printf("# kernels: moec's CUDA library + bench_stamp, bench_randn; NVRTC CUBIN for %s, %zu bytes\n", arch, cubin_size);
  else
    printf("# kernels: NVRTC or the driver failed on the kernel library for %s (reported above)\n", arch);
  return ok;
}

// ---- the layer's buffers ----

struct Layer {
  Ffn ffn;
  Dims d;
  // parameters and their gradients; b1, b2 only for gpt, w3 only for mixtral
  float *wg = nullptr, *w1 = nullptr, *b1 = nullptr, *w2 = nullptr, *b2 = nullptr, *w3 = nullptr;
  float *dwg = nullptr, *dw1 = nullptr, *db1 = nullptr, *dw2 = nullptr, *db2 = nullptr, *dw3 = nullptr;
  float *x = nullptr, *dout = nullptr;
  // forward: gate and order
  float *logits = nullptr, *scores = nullptr, *gates = nullptr, *aux = nullptr, *z = nullptr;
  int *idx = nullptr, *loc = nullptr, *stats = nullptr;
  float *disp = nullptr, *y = nullptr, *moe = nullptr, *out = nullptr;
  // forward: experts. gpt: h = disp W1, hb = h + b1, act = gelu(hb), y = act W2, yb = y + b2.
  // mixtral: h = disp W1, h3 = disp W3, act = silu(h), glu = act * h3, y = glu W2.
  float *h = nullptr, *hb = nullptr, *act = nullptr, *yb = nullptr, *h3 = nullptr, *glu = nullptr;
  // backward
  float *dy = nullptr, *dgates = nullptr, *dact = nullptr, *dhb = nullptr, *dglu = nullptr, *dh = nullptr,
        *dh3 = nullptr, *ddisp = nullptr, *ddisp1 = nullptr, *ddisp2 = nullptr;
  float *dx = nullptr, *dx1 = nullptr, *dx2 = nullptr, *dx3 = nullptr;
  float *daux = nullptr, *dscores = nullptr, *dscores1 = nullptr, *dlogits = nullptr;
};

// f(pointer, elements) for every buffer the layer of this ffn needs.
template <class F> static void each_buffer(Layer &L, F &&f) {
  const Dims &d = L.d;
  int64_t sm = d.s * d.m, se = d.s * d.e, sk = d.s * d.k, etm = d.e * d.t * d.m, eth = d.e * d.t * d.h,
          emh = d.e * d.m * d.h;
  bool gpt = L.ffn == FFN_GPT;
  f(L.x, sm), f(L.dout, sm), f(L.wg, d.m * d.e), f(L.dwg, d.m * d.e);
  f(L.w1, emh), f(L.dw1, emh), f(L.w2, emh), f(L.dw2, emh);
  f(L.logits, se), f(L.scores, se), f(L.gates, sk), f(L.aux, 1), f(L.z, 1);
  f(L.idx, sk), f(L.loc, sk), f(L.stats, d.e * 2);
  f(L.disp, etm), f(L.y, etm), f(L.moe, sm), f(L.out, sm);
  f(L.h, eth), f(L.act, eth);
  f(L.dy, etm), f(L.dgates, sk), f(L.dact, eth), f(L.ddisp, etm);
  f(L.dx, sm), f(L.dx1, sm), f(L.dx2, sm), f(L.dx3, sm);
  f(L.daux, se), f(L.dscores, se), f(L.dscores1, se), f(L.dlogits, se);
  if (gpt) {
    f(L.b1, d.e * d.h), f(L.db1, d.e * d.h), f(L.b2, d.e * d.m), f(L.db2, d.e * d.m);
    f(L.hb, eth), f(L.yb, etm), f(L.dhb, eth);
  } else {
    f(L.w3, emh), f(L.dw3, emh);
    f(L.h3, eth), f(L.glu, eth), f(L.dglu, eth), f(L.dh, eth), f(L.dh3, eth), f(L.ddisp1, etm), f(L.ddisp2, etm);
  }
}

static size_t aligned(size_t bytes) { return (bytes + 255) & ~(size_t)255; }   // rt_cuda_alloc's alignment

// Elements of the largest GEMM operand of the layer (the bf16 scratch holds one such, twice).
static int64_t largest_operand(const Dims &d) {
  return std::max({d.e * d.t * d.h, d.e * d.m * d.h, d.s * d.m, d.s * d.e});
}

// Elements of the parameters the GEMMs read: wg, w1, w2 (and w3 for mixtral).
static std::vector<int64_t> weight_sizes(Ffn ffn, const Dims &d) {
  std::vector<int64_t> n = {d.m * d.e, d.e * d.m * d.h, d.e * d.h * d.m};
  if (ffn == FFN_MIXTRAL) n.push_back(d.e * d.m * d.h);
  return n;
}

static size_t layer_bytes(Ffn ffn, const Dims &d) {
  Layer L;
  L.ffn = ffn, L.d = d;
  size_t bytes = 0;
  each_buffer(L, [&](auto *&, int64_t n) { bytes += aligned((size_t)n * 4); });
  if (want_bf16) {
    bytes += 2 * aligned((size_t)largest_operand(d) * sizeof(u16));
    for (int64_t n : weight_sizes(ffn, d)) bytes += aligned((size_t)n * sizeof(u16));
  }
  return bytes;
}

// Carves the layer out of the (reset) arena and fills x, dout and the parameters with normals.
static bool layer_create(Gpu &gpu, Layer &L, Ffn ffn, const Dims &d) {
  L = Layer();
  L.ffn = ffn, L.d = d;
  bool ok = true;
  each_buffer(L, [&](auto *&p, int64_t n) {
    p = ok ? (std::remove_reference_t<decltype(p)>)rt_cuda_alloc(gpu.cu, (size_t)n * sizeof *p) : nullptr;
    ok = p != nullptr;
  });
  if (ok && want_bf16) {
    size_t n = (size_t)largest_operand(d);
    ok = (gpu.sa = (u16 *)rt_cuda_alloc(gpu.cu, n * sizeof(u16))) && (gpu.sb = (u16 *)rt_cuda_alloc(gpu.cu, n * sizeof(u16)));
    gpu.weights.clear();
    gpu.forget();
    const float *w[] = {L.wg, L.w1, L.w2, L.w3};
    std::vector<int64_t> sizes = weight_sizes(ffn, d);
    for (size_t i = 0; ok && i < sizes.size(); i++) {
      u16 *copy = (u16 *)rt_cuda_alloc(gpu.cu, (size_t)sizes[i] * sizeof(u16));
      ok = copy != nullptr;
      gpu.weights.push_back({w[i], copy, sizes[i]});
    }
  }
  if (!ok) return gpu.ok = false;
  struct Init {
    float *p;
    int64_t n;
    double scale;
  } init[] = {
      {L.x, d.s * d.m, 1.0},
      {L.dout, d.s * d.m, 1.0 / sqrt((double)d.m)},
      {L.wg, d.m * d.e, 1.0 / sqrt((double)d.m)},
      {L.w1, d.e * d.m * d.h, 1.0 / sqrt((double)d.m)},
      {L.w2, d.e * d.h * d.m, 1.0 / sqrt((double)d.h)},
      {L.w3, d.e * d.m * d.h, 1.0 / sqrt((double)d.m)},
      {L.b1, d.e * d.h, 0.02},
      {L.b2, d.e * d.m, 0.02},
  };
  uint64_t stream = 0;
  for (const Init &i : init) {
    stream++;
    if (!i.p) continue;
    LAUNCH(gpu, elementwise_grid(i.n), MK_BLOCK, bench_randn, i.p, i.n, (float)i.scale, rt_key(SEED, stream));
  }
  return gpu.ok;
}

// ---- the layer on the GPU: the launch plan of `moec build --emit cuda`, in program order ----

static void routing(Gpu &g, Layer &L) {
  const Dims &d = L.d;
  g.gemm(L.x, L.wg, L.logits, d.s, d.e, d.m, false, false);
  LAUNCH(g, elementwise_grid(d.s), MK_BLOCK, mk_gate_softmax_topk_gather, L.logits, L.scores, L.idx, L.gates, d.s, d.e,
         d.k, 1);
  LAUNCH(g, d.e, MK_BLOCK, mk_gate_locations, L.idx, L.loc, L.stats, d.s, d.k, d.e, 1, d.t);   // a block per expert
}

static void forward(Gpu &g, Layer &L) {
  const Dims &d = L.d;
  int64_t etm = d.e * d.t * d.m, eth = d.e * d.t * d.h;
  g.forget();
  g.refresh();   // bf16: the parameters' copies, once per step (the program's P16 after an update)
  routing(g, L);
  LAUNCH(g, 1, MK_BLOCK, mk_aux_loss, L.scores, L.idx, L.aux, d.s, d.e, d.k, 1, 1.0f);
  LAUNCH(g, 1, MK_BLOCK, mk_z_loss, L.logits, L.z, d.s, d.e, 1, 1.0f);
  LAUNCH(g, elementwise_grid(etm), MK_BLOCK, mk_zero, L.disp, etm);
  LAUNCH(g, block_grid(d.s * d.k), MK_BLOCK, mk_order_encode, L.x, L.idx, L.loc, L.disp, d.s, d.m, d.k, d.e, 1, d.t);
  g.expert_gemm(L.disp, L.w1, L.h, d.e, d.t, d.h, d.m, false, false);
  const float *expert_out;
  if (L.ffn == FFN_GPT) {
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_expert_bias, L.h, L.b1, L.hb, d.e, d.t, d.h);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_gelu, L.hb, L.act, eth, (i64)d.h);
    g.expert_gemm(L.act, L.w2, L.y, d.e, d.t, d.m, d.h, false, false);
    LAUNCH(g, elementwise_grid(etm), MK_BLOCK, mk_expert_bias, L.y, L.b2, L.yb, d.e, d.t, d.m);
    expert_out = L.yb;
  } else {
    g.expert_gemm(L.disp, L.w3, L.h3, d.e, d.t, d.h, d.m, false, false);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_silu, L.h, L.act, eth);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_mul, L.act, L.h3, L.glu, eth);
    g.expert_gemm(L.glu, L.w2, L.y, d.e, d.t, d.m, d.h, false, false);
    expert_out = L.y;
  }
  LAUNCH(g, block_grid(d.s), MK_BLOCK, mk_order_decode, expert_out, L.idx, L.loc, L.gates, L.moe, d.s, d.m, d.k, d.e, 1,
         d.t);
  LAUNCH(g, elementwise_grid(d.s * d.m), MK_BLOCK, mk_add, L.x, L.moe, L.out, d.s * d.m);
}

static void backward(Gpu &g, Layer &L) {
  const Dims &d = L.d;
  int64_t etm = d.e * d.t * d.m, eth = d.e * d.t * d.h, sm = d.s * d.m, se = d.s * d.e;
  const float *expert_out = L.ffn == FFN_GPT ? L.yb : L.y;
  g.forget();
  LAUNCH(g, elementwise_grid(etm), MK_BLOCK, mk_zero, L.dy, etm);
  LAUNCH(g, block_grid(d.s * d.k), MK_BLOCK, mk_order_decode_grad_y, L.dout, L.idx, L.loc, L.gates, L.dy, d.s, d.m,
         d.k, d.e, 1, d.t);
  LAUNCH(g, block_grid(d.s * d.k), MK_BLOCK, mk_order_decode_grad_gates, L.dout, expert_out, L.idx, L.loc, L.dgates,
         d.s, d.m, d.k, d.e, 1, d.t);
  const float *ddisp;   // the gradient of disp: one GEMM's for gpt, the sum of two for mixtral
  if (L.ffn == FFN_GPT) {
    LAUNCH(g, tile_grid(d.e, d.m), MK_BLOCK, mk_expert_bias_grad, L.dy, L.db2, d.e, d.t, d.m);
    g.expert_gemm(L.dy, L.w2, L.dact, d.e, d.t, d.h, d.m, false, true);
    g.expert_gemm(L.act, L.dy, L.dw2, d.e, d.h, d.m, d.t, true, false);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_gelu_grad, L.dact, L.hb, L.dhb, eth);
    LAUNCH(g, tile_grid(d.e, d.h), MK_BLOCK, mk_expert_bias_grad, L.dhb, L.db1, d.e, d.t, d.h);
    g.expert_gemm(L.dhb, L.w1, L.ddisp, d.e, d.t, d.m, d.h, false, true);
    g.expert_gemm(L.disp, L.dhb, L.dw1, d.e, d.m, d.h, d.t, true, false);
    ddisp = L.ddisp;
  } else {
    g.expert_gemm(L.dy, L.w2, L.dglu, d.e, d.t, d.h, d.m, false, true);
    g.expert_gemm(L.glu, L.dy, L.dw2, d.e, d.h, d.m, d.t, true, false);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_mul, L.dglu, L.h3, L.dact, eth);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_mul, L.dglu, L.act, L.dh3, eth);
    LAUNCH(g, elementwise_grid(eth), MK_BLOCK, mk_silu_grad, L.dact, L.h, L.dh, eth);
    g.expert_gemm(L.dh3, L.w3, L.ddisp, d.e, d.t, d.m, d.h, false, true);
    g.expert_gemm(L.disp, L.dh3, L.dw3, d.e, d.m, d.h, d.t, true, false);
    g.expert_gemm(L.dh, L.w1, L.ddisp1, d.e, d.t, d.m, d.h, false, true);
    LAUNCH(g, elementwise_grid(etm), MK_BLOCK, mk_add, L.ddisp, L.ddisp1, L.ddisp2, etm);
    g.expert_gemm(L.disp, L.dh, L.dw1, d.e, d.m, d.h, d.t, true, false);
    ddisp = L.ddisp2;
  }
  LAUNCH(g, block_grid(d.s), MK_BLOCK, mk_order_encode_grad, ddisp, L.idx, L.loc, L.dx, d.s, d.m, d.k, d.e, 1, d.t);
  LAUNCH(g, elementwise_grid(sm), MK_BLOCK, mk_add, L.dout, L.dx, L.dx1, sm);
  LAUNCH_SHARED(g, 1, MK_BLOCK, d.e * sizeof(double), mk_aux_loss_grad, L.scores, L.idx, L.daux, d.s, d.e, d.k, 1,
                AUX_COEF);
  LAUNCH(g, elementwise_grid(d.s), MK_BLOCK, mk_gate_gather_grad, L.dgates, L.scores, L.idx, L.dscores, d.s, d.e, d.k,
         1, 1.0f);
  LAUNCH(g, elementwise_grid(se), MK_BLOCK, mk_add, L.daux, L.dscores, L.dscores1, se);
  LAUNCH(g, elementwise_grid(d.s), MK_BLOCK, mk_softmax_grad, L.dscores1, L.scores, L.dlogits, d.s, d.e);
  g.gemm(L.dlogits, L.wg, L.dx2, d.s, d.m, d.e, false, true);
  LAUNCH(g, elementwise_grid(sm), MK_BLOCK, mk_add, L.dx1, L.dx2, L.dx3, sm);
  g.gemm(L.x, L.dlogits, L.dwg, d.m, d.e, d.s, true, false);
}

// The layer's expert GEMMs and nothing else: the same calls on the same buffers (bf16: on the
// scratch's bf16 operands, without rounding them first).
static void expert_gemms(Gpu &g, Layer &L) {
  const Dims &d = L.d;
  struct Raw {
    Gpu &g;
    Raw(Gpu &gpu) : g(gpu) { g.raw = true; }
    ~Raw() { g.raw = false; }
  } raw(g);
  g.expert_gemm(L.disp, L.w1, L.h, d.e, d.t, d.h, d.m, false, false);
  if (L.ffn == FFN_GPT) {
    g.expert_gemm(L.act, L.w2, L.y, d.e, d.t, d.m, d.h, false, false);
    g.expert_gemm(L.dy, L.w2, L.dact, d.e, d.t, d.h, d.m, false, true);
    g.expert_gemm(L.act, L.dy, L.dw2, d.e, d.h, d.m, d.t, true, false);
    g.expert_gemm(L.dhb, L.w1, L.ddisp, d.e, d.t, d.m, d.h, false, true);
    g.expert_gemm(L.disp, L.dhb, L.dw1, d.e, d.m, d.h, d.t, true, false);
  } else {
    g.expert_gemm(L.disp, L.w3, L.h3, d.e, d.t, d.h, d.m, false, false);
    g.expert_gemm(L.glu, L.w2, L.y, d.e, d.t, d.m, d.h, false, false);
    g.expert_gemm(L.dy, L.w2, L.dglu, d.e, d.t, d.h, d.m, false, true);
    g.expert_gemm(L.glu, L.dy, L.dw2, d.e, d.h, d.m, d.t, true, false);
    g.expert_gemm(L.dh3, L.w3, L.ddisp, d.e, d.t, d.m, d.h, false, true);
    g.expert_gemm(L.disp, L.dh3, L.dw3, d.e, d.m, d.h, d.t, true, false);
    g.expert_gemm(L.dh, L.w1, L.ddisp1, d.e, d.t, d.m, d.h, false, true);
    g.expert_gemm(L.disp, L.dh, L.dw1, d.e, d.m, d.h, d.t, true, false);
  }
}

// ---- timing: GPU timestamps in stream order ----

struct Timer {
  Gpu &gpu;
  unsigned long long *stamps;   // device, 2 per run
  int next = 0;

  void stamp() { LAUNCH(gpu, 1, 32, bench_stamp, stamps, next++); }
};

static double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median over `runs` runs of the GPU time of `reps` calls of work, per call, in ms; `warmup`
// calls first. NaN when a call failed.
template <class F> static double median_ms(Gpu &gpu, int warmup, int runs, int reps, F &&work) {
  for (int i = 0; i < warmup; i++) work();
  Timer timer{gpu, (unsigned long long *)rt_cuda_alloc(gpu.cu, 2 * (size_t)runs * sizeof(unsigned long long))};
  if (!timer.stamps) gpu.ok = false;
  for (int r = 0; r < runs && gpu.ok; r++) {
    timer.stamp();
    for (int i = 0; i < reps; i++) work();
    timer.stamp();
  }
  std::vector<unsigned long long> t(2 * (size_t)runs);
  gpu.to_host(t, timer.stamps);
  gpu.sync();
  if (!gpu.ok) return NAN;
  std::vector<double> ms;
  for (int r = 0; r < runs; r++) ms.push_back((double)(t[2 * r + 1] - t[2 * r]) * 1e-6 / reps);
  return median(ms);
}

// The stamps against the host's clock: two stamps the host puts 20 ms apart (each waited for)
// must read 20 ms, give or take the launch and wake-up latencies. Prints one '#' line.
static bool check_clock(Gpu &g) {
  using Clock = std::chrono::steady_clock;
  rt_cuda_arena_reset(g.cu);
  Timer timer{g, (unsigned long long *)rt_cuda_alloc(g.cu, 2 * sizeof(unsigned long long))};
  if (!timer.stamps) return g.ok = false;
  timer.stamp();
  g.sync();
  Clock::time_point start = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  timer.stamp();
  g.sync();
  double host_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  std::vector<unsigned long long> t(2);
  g.to_host(t, timer.stamps);
  g.sync();
  if (!g.ok) return false;
  double gpu_ms = (double)(t[1] - t[0]) * 1e-6;
  bool ok = fabs(gpu_ms - host_ms) <= 1.0 + 0.05 * host_ms;
  printf("# check clock: stamps the host put %.3f ms apart read %.3f ms apart %s\n", host_ms, gpu_ms,
         ok ? "(agree to 1 ms + 5%)" : "(DIFFER by more than 1 ms + 5%)");
  return ok;
}

// ---- the check against the CPU runtime ----

static double max_rel_err(const std::vector<float> &got, const std::vector<float> &want) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); i++) {
    double e = fabs((double)got[i] - want[i]);
    if (!(e <= diff)) diff = e;   // NaN wins
    scale = std::max(scale, (double)fabsf(want[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

template <class T> static std::vector<T> fetch(Gpu &g, const T *d, int64_t n) {
  std::vector<T> v((size_t)n);
  g.to_host(v, d);
  return v;
}

// Runs the layer once on the GPU and the same layer with libmoert's CPU kernels on the GPU's
// inputs; prints one '#' line; false when they differ.
// Small enough for the CPU, large enough that some choices are dropped.
static Shape check_shape(Ffn ffn) { return {ffn, 1, 64, 320, 2}; }

static bool check_layer(Gpu &g, Ffn ffn) {
  Shape sh = check_shape(ffn);
  Dims d = dims_of(sh);
  rt_cuda_arena_reset(g.cu);
  Layer L;
  if (!layer_create(g, L, ffn, d)) return false;
  forward(g, L);
  backward(g, L);
  int64_t sm = d.s * d.m, se = d.s * d.e, sk = d.s * d.k, etm = d.e * d.t * d.m, eth = d.e * d.t * d.h,
          emh = d.e * d.m * d.h;
  bool gpt = ffn == FFN_GPT;
  auto x = fetch(g, L.x, sm), dout = fetch(g, L.dout, sm), wg = fetch(g, L.wg, d.m * d.e);
  auto w1 = fetch(g, L.w1, emh), w2 = fetch(g, L.w2, emh);
  auto w3 = gpt ? std::vector<float>() : fetch(g, L.w3, emh);
  auto b1 = gpt ? fetch(g, L.b1, d.e * d.h) : std::vector<float>(), b2 = gpt ? fetch(g, L.b2, d.e * d.m) : std::vector<float>();
  auto g_idx = fetch(g, L.idx, sk), g_loc = fetch(g, L.loc, sk);
  auto g_out = fetch(g, L.out, sm), g_aux = fetch(g, L.aux, 1), g_z = fetch(g, L.z, 1), g_dx = fetch(g, L.dx3, sm);
  auto g_dwg = fetch(g, L.dwg, d.m * d.e), g_dw1 = fetch(g, L.dw1, emh), g_dw2 = fetch(g, L.dw2, emh);
  auto g_dw3 = gpt ? std::vector<float>() : fetch(g, L.dw3, emh);
  auto g_db1 = gpt ? fetch(g, L.db1, d.e * d.h) : std::vector<float>(), g_db2 = gpt ? fetch(g, L.db2, d.e * d.m) : std::vector<float>();
  g.sync();
  if (!g.ok) {
    printf("# check %s: a CUDA or cuBLAS call failed (reported above)\n", ffn_name(ffn));
    return false;
  }

  // The CPU backend's kernels, op for op (runtime/kernels/*.c).
  int S = (int)d.s, M = (int)d.m, H = (int)d.h, E = (int)d.e, K = (int)d.k, T = (int)d.t;
  std::vector<float> logits(se), scores(se), gates(sk), disp(etm), h(eth), hb(eth), act(eth), h3(eth), glu(eth),
      y(etm), yb(etm), moe(sm), out(sm);
  std::vector<int32_t> idx(sk), loc(sk);
  rt_matmul(x.data(), wg.data(), logits.data(), S, E, M, false, false, false);
  rt_softmax(logits.data(), scores.data(), S, E);
  rt_topk(scores.data(), idx.data(), S, E, K, 1, 1, 0);
  rt_gate_gather(scores.data(), idx.data(), gates.data(), S, E, K, true, 1.0f);
  rt_gate_locations(idx.data(), loc.data(), nullptr, S, K, E, 1, T);
  float aux = rt_aux_loss_value(scores.data(), idx.data(), S, E, K, 1), z = rt_z_loss_value(logits.data(), S, E, 1);
  rt_zero(disp.data(), (int64_t)disp.size());
  rt_order_encode(x.data(), idx.data(), loc.data(), disp.data(), S, M, K, E, 1, T);
  rt_expert_matmul(disp.data(), w1.data(), h.data(), E, T, H, M, false, false);
  if (gpt) {
    rt_expert_bias(h.data(), b1.data(), hb.data(), E, T, H);
    rt_gelu(hb.data(), act.data(), eth, H);
    rt_expert_matmul(act.data(), w2.data(), y.data(), E, T, M, H, false, false);
    rt_expert_bias(y.data(), b2.data(), yb.data(), E, T, M);
  } else {
    rt_expert_matmul(disp.data(), w3.data(), h3.data(), E, T, H, M, false, false);
    rt_silu(h.data(), act.data(), eth);
    rt_mul(act.data(), h3.data(), glu.data(), eth);
    rt_expert_matmul(glu.data(), w2.data(), yb.data(), E, T, M, H, false, false);   // no bias: yb is y
  }
  rt_order_decode(yb.data(), idx.data(), loc.data(), gates.data(), moe.data(), S, M, K, E, 1, T);
  rt_add(x.data(), moe.data(), out.data(), sm);

  std::vector<float> dy(etm), dgates(sk), dact(eth), dh(eth), dh3(eth), dglu(eth), ddisp(etm), ddisp1(etm), dx(sm),
      dx1(sm), dx2(sm), dx3(sm), daux(se), dscores(se), dlogits(se), dwg(d.m * d.e), dw1(emh), dw2(emh), dw3(emh),
      db1(d.e * d.h), db2(d.e * d.m);
  rt_zero(dy.data(), (int64_t)dy.size());
  rt_order_decode_grad_y(dout.data(), idx.data(), loc.data(), gates.data(), dy.data(), S, M, K, E, 1, T);
  rt_order_decode_grad_gates(dout.data(), yb.data(), idx.data(), loc.data(), dgates.data(), S, M, K, E, 1, T);
  if (gpt) {
    rt_expert_bias_grad(dy.data(), db2.data(), E, T, M);
    rt_expert_matmul(dy.data(), w2.data(), dact.data(), E, T, H, M, false, true);
    rt_expert_matmul(act.data(), dy.data(), dw2.data(), E, H, M, T, true, false);
    rt_gelu_grad(dact.data(), hb.data(), dh.data(), eth);
    rt_expert_bias_grad(dh.data(), db1.data(), E, T, H);
    rt_expert_matmul(dh.data(), w1.data(), ddisp.data(), E, T, M, H, false, true);
    rt_expert_matmul(disp.data(), dh.data(), dw1.data(), E, M, H, T, true, false);
  } else {
    rt_expert_matmul(dy.data(), w2.data(), dglu.data(), E, T, H, M, false, true);
    rt_expert_matmul(glu.data(), dy.data(), dw2.data(), E, H, M, T, true, false);
    rt_mul(dglu.data(), h3.data(), dact.data(), eth);
    rt_mul(dglu.data(), act.data(), dh3.data(), eth);
    rt_silu_grad(dact.data(), h.data(), dh.data(), eth);
    rt_expert_matmul(dh3.data(), w3.data(), ddisp.data(), E, T, M, H, false, true);
    rt_expert_matmul(disp.data(), dh3.data(), dw3.data(), E, M, H, T, true, false);
    rt_expert_matmul(dh.data(), w1.data(), ddisp1.data(), E, T, M, H, false, true);
    rt_add(ddisp.data(), ddisp1.data(), ddisp.data(), etm);
    rt_expert_matmul(disp.data(), dh.data(), dw1.data(), E, M, H, T, true, false);
  }
  rt_order_encode_grad(ddisp.data(), idx.data(), loc.data(), dx.data(), S, M, K, E, 1, T);
  rt_add(dout.data(), dx.data(), dx1.data(), sm);
  rt_aux_loss_grad(scores.data(), idx.data(), daux.data(), S, E, K, 1, AUX_COEF);
  rt_gate_gather_grad(dgates.data(), scores.data(), idx.data(), dscores.data(), S, E, K, true, 1.0f);
  rt_add(daux.data(), dscores.data(), dscores.data(), se);
  rt_softmax_grad(dscores.data(), scores.data(), dlogits.data(), S, E);
  rt_matmul(dlogits.data(), wg.data(), dx2.data(), S, M, E, false, true, false);
  rt_add(dx1.data(), dx2.data(), dx3.data(), sm);
  rt_matmul(x.data(), dlogits.data(), dwg.data(), M, E, S, true, false, false);

  int dropped = 0;
  for (int32_t l : loc) dropped += l < 0;
  bool routing_same = g_idx == idx && g_loc == loc;
  struct Compared {
    const char *name;
    double err;
  } compared[] = {
      {"out", max_rel_err(g_out, out)},   {"aux", max_rel_err(g_aux, {aux})}, {"z", max_rel_err(g_z, {z})},
      {"dx", max_rel_err(g_dx, dx3)},     {"dwg", max_rel_err(g_dwg, dwg)},   {"dw1", max_rel_err(g_dw1, dw1)},
      {"dw2", max_rel_err(g_dw2, dw2)},   {"dw3", gpt ? 0.0 : max_rel_err(g_dw3, dw3)},
      {"db1", gpt ? max_rel_err(g_db1, db1) : 0.0}, {"db2", gpt ? max_rel_err(g_db2, db2) : 0.0},
  };
  double worst = 0.0;
  const char *worst_name = "out";
  for (const Compared &c : compared)
    if (!(c.err <= worst)) worst = c.err, worst_name = c.name;
  bool ok = routing_same && worst <= MAX_REL_ERR;
  printf("# check %-7s %s vs libmoert's CPU kernels: routing %s (%d of %lld choices dropped), "
         "largest relative error %.1e (%s) %s %.0e\n",
         ffn_name(ffn), shape_name(sh).c_str(), routing_same ? "identical" : "DIFFERS", dropped, (long long)sk, worst,
         worst_name, worst <= MAX_REL_ERR ? "<=" : ">", MAX_REL_ERR);
  return ok;
}

// ---- one row of the table ----

struct Row {
  double layer_ms, gemm_ms, gate_us, route_us, dropped;
};

static bool bench_shape(Gpu &g, const Shape &sh, int warmup, int runs, Row &row) {
  Dims d = dims_of(sh);
  rt_cuda_arena_reset(g.cu);
  Layer L;
  if (!layer_create(g, L, sh.ffn, d)) return false;
  row.layer_ms = median_ms(g, warmup, runs, 1, [&] { forward(g, L), backward(g, L); });
  row.gemm_ms = median_ms(g, warmup, runs, 1, [&] { expert_gemms(g, L); });
  row.gate_us = 1e3 * median_ms(g, warmup, runs, GATE_REPS, [&] {
    LAUNCH(g, elementwise_grid(d.s), MK_BLOCK, mk_gate_softmax_topk_gather, L.logits, L.scores, L.idx, L.gates, d.s, d.e,
           d.k, 1);
  });
  row.route_us = 1e3 * median_ms(g, warmup, runs, GATE_REPS, [&] { g.forget(), routing(g, L); });
  std::vector<int> stats = fetch(g, L.stats, d.e * 2);   // per expert: kept, wanted
  g.sync();
  long long kept = 0, wanted = 0;
  for (int64_t i = 0; i < d.e; i++) kept += stats[2 * i], wanted += stats[2 * i + 1];
  row.dropped = wanted ? 100.0 * (double)(wanted - kept) / (double)wanted : 0.0;
  return g.ok;
}

// ---- command line ----

static int usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--quick | --all | --shapes SPEC] [--dtype fp32|bf16] [--runs N] [--warmup N] [--list-shapes]\n"
          "  SPEC: comma-separated FFN:BxLxMxHSCALE (FFN gpt or mixtral), e.g. gpt:4x2048x4096x4\n",
          argv0);
  return 2;
}

static bool parse_count(const char *value, int lo, int hi, int *out) {
  char *end;
  long v = value ? strtol(value, &end, 10) : 0;
  if (!value || end == value || *end || v < lo || v > hi) return false;
  *out = (int)v;
  return true;
}

int main(int argc, char **argv) {
  std::vector<Shape> shapes;
  const char *selection = "representative subset of Table 4 (--all: all 162)";
  bool all = false, quick = false, list = false;
  int runs = 10, warmup = 3;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (strcmp(a, "--all") == 0) all = true;
    else if (strcmp(a, "--quick") == 0) quick = true;
    else if (strcmp(a, "--list-shapes") == 0) list = true;
    else if (strcmp(a, "--shapes") == 0 && v && parse_shapes(v, shapes)) i++, selection = "as given (--shapes)";
    else if (strcmp(a, "--runs") == 0 && parse_count(v, 1, MAX_RUNS, &runs)) i++;
    else if (strcmp(a, "--warmup") == 0 && parse_count(v, 0, MAX_RUNS, &warmup)) i++;
    else if (strcmp(a, "--dtype") == 0 && v && (!strcmp(v, "fp32") || !strcmp(v, "bf16"))) want_bf16 = !strcmp(v, "bf16"), i++;
    else return usage(argv[0]);
  }
  if (shapes.empty()) {
    for (Ffn ffn : {FFN_GPT, FFN_MIXTRAL}) {
      if (quick) {
        shapes.push_back({ffn, 1, 128, 256, 2});
      } else if (all) {
        for (int b : {1, 2, 4})
          for (int l : {512, 1024, 2048})
            for (int m : {1024, 2048, 4096})
              for (int hs : {2, 3, 4}) shapes.push_back({ffn, b, l, m, hs});
      } else {
        for (const auto &s : default_shapes) shapes.push_back({ffn, s[0], s[1], s[2], s[3]});
      }
    }
    if (quick) selection = "--quick: tiny shapes, not of Table 4 (a smoke run)";
    if (all) selection = "all of Table 4";
  }
  if (list) {   // the same shapes for bench/torch_ref.py --shapes
    for (size_t i = 0; i < shapes.size(); i++)
      printf("%s%s:%s", i ? "," : "", ffn_name(shapes[i].ffn), shape_name(shapes[i]).c_str());
    printf("\n");
    return 0;
  }

  char why[512];
  if (!rt_cuda_probe(why, sizeof why)) {
    printf("skip  bench-gpu: no GPU (%s)\n", why);
    return 0;
  }
  size_t arena = 0;   // the largest layer, and 1 MiB for the timestamps
  for (Ffn ffn : {FFN_GPT, FFN_MIXTRAL}) arena = std::max(arena, layer_bytes(ffn, dims_of(check_shape(ffn))));
  for (const Shape &s : shapes) arena = std::max(arena, layer_bytes(s.ffn, dims_of(s)));
  arena += (size_t)1 << 20;
  Gpu gpu;
  gpu.cu = rt_cuda_create(arena, 0);
  if (!gpu.cu) {
    printf("# the CUDA runtime could not start with a %.1f GiB arena (reported above)\nFAILED\n", arena / 1073741824.0);
    return 1;
  }
  const RtCudaDevice *dev = rt_cuda_device(gpu.cu);
  printf("# gpu_layer: one MoE layer, forward + backward, moec's CUDA kernels + cuBLAS (%s)\n",
         want_bf16 ? "dtype bf16: bf16 GEMM inputs rounded by mk_compress_bf16, fp32 accumulation; the rest fp32"
                   : "fp32, no TF32");
  printf("# device 0: %s, sm_%d, %d SMs, %.1f GiB; driver for CUDA %d.%d; arena %.1f GiB\n", dev->name, dev->arch,
         dev->multiprocessors, dev->memory_bytes / 1073741824.0, dev->driver_version / 1000,
         dev->driver_version % 1000 / 10, arena / 1073741824.0);
  printf("# layer: E %d experts, top-%d gshard gate, capacity %.1f (T = ceil(k*%.1f*S/E)), aux_loss %g, order tutel\n",
         EXPERTS, CHOICES, CAPACITY_FACTOR, CAPACITY_FACTOR, AUX_COEF);
  printf("# shapes: %s; shape = BxLxMxhscale, S = B*L tokens, H = hscale*M\n", selection);
  printf("# times: median of %d runs after %d warm-up runs, GPU timestamps in stream order; gate and route: "
         "%d launches per run\n",
         runs, warmup, GATE_REPS);
  bool ok = load_kernels(gpu) && check_clock(gpu);
  for (Ffn ffn : {FFN_GPT, FFN_MIXTRAL}) ok = ok && check_layer(gpu, ffn);
  bf16 = want_bf16;   // the checks ran in fp32
  if (ok) {
    printf("%-8s %-15s %6s %5s %10s %10s %10s %9s %9s %10s %9s %7s\n", "ffn", "shape", "S", "T", "layer ms", "gemm ms",
           "gemm/layer", "gate us", "route us", "layer TF/s", "gemm TF/s", "drop %");
    fflush(stdout);
  }
  for (size_t i = 0; ok && i < shapes.size(); i++) {
    const Shape &sh = shapes[i];
    Dims d = dims_of(sh);
    Row r;
    if (!bench_shape(gpu, sh, warmup, runs, r)) {
      printf("# %s %s: a CUDA or cuBLAS call failed (reported above)\n", ffn_name(sh.ffn), shape_name(sh).c_str());
      ok = false;
      break;
    }
    double flops = expert_flops(d, sh.ffn);
    printf("%-8s %-15s %6lld %5lld %10.3f %10.3f %10.2f %9.1f %9.1f %10.1f %9.1f %7.2f\n", ffn_name(sh.ffn),
           shape_name(sh).c_str(), (long long)d.s, (long long)d.t, r.layer_ms, r.gemm_ms, r.gemm_ms / r.layer_ms,
           r.gate_us, r.route_us, (flops + gate_flops(d)) / (r.layer_ms * 1e9), flops / (r.gemm_ms * 1e9), r.dropped);
    fflush(stdout);
  }
  if (!rt_cuda_destroy(gpu.cu)) ok = false;
  printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
