// The fake device: runtime/cuda/rt_cuda.h implemented on host memory, so that the CUDA target's
// programs run in `make test` on machines without a GPU (tests/cuda/host.sh). A CUDA program
// links build/cuda/libfake_cuda.a instead of build/libmoert_cuda.a when moec builds it with
// MOEC_CUDA_FAKE=1 in the environment (a test hook, codegen/link.c).
//
//   memory     the device arena is host memory; copies are memcpy. Every device address a call
//              gets must lie in the arena (a kernel's pointer arguments too) and every host
//              address outside it, so a program that mixes them up fails here as on a GPU.
//   streams    every call runs when it is issued, in the program's order, which is one valid
//              order of its streams: events are checked (a wait for an event never recorded is
//              an error), not needed. Concurrency between the streams is not exercised.
//   kernels    the module image must be NVRTC's (a CUBIN, ELF, or PTX text) and name the kernel
//              looked up; the kernel then runs from the library compiled here as host C++
//              (host_kernels.h), its arguments unpacked from the void ** with the parameter
//              types the kernel declares. Blocks run one after the other; the threads of a block
//              run one after the other, or, for the kernels that call __syncthreads
//              (MK_KERNEL_LIST, from cg_emit_cuda_kernel_list), as fibers that switch at
//              each barrier, which also checks that every thread reaches it.
//   GEMMs      libmoert's rt_matmul / rt_expert_matmul (OpenBLAS, fp32 accumulation). bf16 inputs
//              (RT_CUDA_BF16: the program's operands already rounded to bf16, nearest even, by its
//              mk_compress_bf16 launches) are widened to fp32 exactly first; a product of two bf16
//              values is exact in fp32, so this is cuBLAS's CUBLAS_COMPUTE_32F arithmetic on the
//              same bits, up to the order of the fp32 sums.
//   NCCL       libmoert's MPI collectives (runtime/comm.c) on the same parallel group of the
//              same RtComm: communicators are groups (rt_cuda_nccl_group; rt_cuda_nccl_create
//              over a bare MPI_Comm is refused), so results equal the CPU program's bit for bit.
//   graphs     a capture (rt_cuda_capture_begin .. end) keeps each call as a closure, with its
//              arguments copied, instead of running it; rt_cuda_graph_launch runs them in order.
//              What a GPU refuses is refused here too: reading back or synchronising while
//              capturing, work on a stream that is not in the capture (it would run outside the
//              graph on a GPU), a wait for an event recorded outside the capture (CUDA's
//              STREAM_CAPTURE_ISOLATION) or, outside a capture, for one recorded inside it
//              (CAPTURED_EVENT), and a stream not joined back into the compute stream at the end
//              (STREAM_CAPTURE_UNJOINED). A program that relied on a step's values changing
//              between replays other than through rt_cuda_graph_set computes stale results here.
//   the device "moert fake device", sm_90 (MOERT_FAKE_ARCH=NN in the environment says sm_NN,
//              to exercise the programs' choice between CUBIN and PTX).
// Errors are reported as rt_cuda.c reports them: "moert: error: rank R on HOST: fake device:
// ..." on stderr, and the call returns false.
#include <elf.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <array>
#include <set>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "host_kernels.h"

#define OMPI_SKIP_MPICXX 1   // the C API only
#define MPICH_SKIP_MPICXX 1
#include <cuda.h>
#include <mpi.h>

#define _Noreturn [[noreturn]]
extern "C" {
#include "rt_cuda.h"
#include "rt_mpi.h"
}
#undef _Noreturn
static_assert(MK_WG_SHARED(128) == RT_CUDA_WG_SHARED(128) && MK_WG_SHARED(256) == RT_CUDA_WG_SHARED(256),
              "rt_cuda.h's RT_CUDA_WG_SHARED is not codegen/cuda/ffn.cu's MK_WG_SHARED");

// ---- errors ----

static bool report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool report(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  rt_mpi_vreport("fake device: ", fmt, ap);
  va_end(ap);
  return false;
}

// ---- the device ----

// What is ordered before a point of a stream: the number of calls of each stream (of the
// capture under way), for checking that the streams are joined back at its end.
typedef std::array<size_t, RT_STREAM_COUNT> Seen;

struct RtCuda {
  RtCudaDevice device;
  unsigned char *arena;
  size_t arena_bytes, arena_used;
  std::vector<bool> recorded;          // by event
  std::vector<uint64_t> event_capture; // by event: the capture it was last recorded in, 0: none
  std::vector<Seen> event_seen;        // by event: what its record followed, in that capture
  const unsigned char *image;          // the loaded module, and its size in bytes
  size_t image_bytes;
  RtCudaGraph *capture;                // the graph being captured, or NULL
  uint64_t captures;                   // the id of the last capture begun
  bool in_capture[RT_STREAM_COUNT];
  Seen seen[RT_STREAM_COUNT];          // per stream, during a capture
  std::set<const float *> moec_sites;  // the results of the calls that ran moec's grouped GEMM
  std::set<CUfunction> wg_loaded;      // rt_cuda_load_wg's: the kernels allowed more than 48 KiB of shared memory
  CUfunction wg = nullptr;             // rt_cuda_use_wg's
  bool wg_wrong = false;               // MOERT_FAKE_WG_WRONG=1 (read at rt_cuda_create): see launch
  int wg_n = 0;
};

bool rt_cuda_probe(char *why, size_t why_size) {
  snprintf(why, why_size, "the fake device of tests/cuda/fake_cuda.cpp");
  return true;
}

RtCuda *rt_cuda_create(size_t arena_bytes, int nevents) {
  RtCuda *cu = new RtCuda{};
  snprintf(cu->device.name, sizeof cu->device.name, "moert fake device (host memory, kernels emulated)");
  const char *arch = getenv("MOERT_FAKE_ARCH");
  cu->device.arch = arch && atoi(arch) >= 10 ? atoi(arch) : 90;
  cu->device.driver_version = CUDA_VERSION;
  cu->device.multiprocessors = 1;
  cu->device.emulated = true;
  const char *wrong = getenv("MOERT_FAKE_WG_WRONG");
  cu->wg_wrong = wrong && strcmp(wrong, "1") == 0;
  cu->device.memory_bytes = arena_bytes;
  cu->arena_bytes = arena_bytes;
  cu->recorded.assign(nevents > 0 ? (size_t)nevents : 0, false);
  cu->event_capture.assign(cu->recorded.size(), 0);
  cu->event_seen.assign(cu->recorded.size(), Seen{});
  if (arena_bytes > 0 && !(cu->arena = (unsigned char *)aligned_alloc(256, (arena_bytes + 255) / 256 * 256))) {
    report("out of memory for an arena of %zu bytes", arena_bytes);
    delete cu;
    return nullptr;
  }
  return cu;
}

bool rt_cuda_destroy(RtCuda *cu) {
  if (!cu) return true;
  free(cu->arena);
  delete cu;
  return true;
}

const RtCudaDevice *rt_cuda_device(const RtCuda *cu) { return &cu->device; }

// ---- memory ----

static bool in_arena(const RtCuda *cu, const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)cu->arena, q = (uintptr_t)p;
  return cu->arena && q >= a && q - a <= cu->arena_bytes && bytes <= cu->arena_bytes - (q - a);
}

static bool overlaps_arena(const RtCuda *cu, const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)cu->arena, q = (uintptr_t)p;
  return cu->arena && bytes > 0 && q < a + cu->arena_bytes && a < q + bytes;
}

static bool device_range(const RtCuda *cu, const char *call, const char *what, const void *p, size_t bytes) {
  if (bytes == 0 || in_arena(cu, p, bytes)) return true;
  return report("%s: the %s %p (+%zu bytes) is not device memory (the arena is %p, %zu bytes)", call, what, p, bytes,
                (void *)cu->arena, cu->arena_bytes);
}

static bool host_range(const RtCuda *cu, const char *call, const char *what, const void *p, size_t bytes) {
  if (!overlaps_arena(cu, p, bytes)) return true;
  return report("%s: the %s %p (+%zu bytes) is device memory, not host memory", call, what, p, bytes);
}

void *rt_cuda_alloc(RtCuda *cu, size_t bytes) {
  size_t start = (cu->arena_used + 255) & ~(size_t)255;
  if (start > cu->arena_bytes || bytes > cu->arena_bytes - start) {
    report("the device arena of %zu bytes cannot hold %zu more bytes (%zu in use)", cu->arena_bytes, bytes, cu->arena_used);
    return nullptr;
  }
  cu->arena_used = start + bytes;
  return cu->arena + start;
}

void rt_cuda_arena_reset(RtCuda *cu) { cu->arena_used = 0; }

static bool stream_ok(RtStream s, const char *call) {
  if ((int)s >= 0 && s < RT_STREAM_COUNT) return true;
  return report("%s on stream %d, which does not exist", call, (int)s);
}

// ---- the capture of a graph: calls kept as closures ----

struct FakeLaunch;
struct RtCudaGraph {
  std::vector<std::function<bool()>> calls;
  std::vector<std::shared_ptr<FakeLaunch>> step_nodes;   // rt_cuda_launch_step's, in order
};

// Runs the call now, or, while a graph is captured, keeps it for the graph's launches.
static bool issue(RtCuda *cu, RtStream s, const char *call, std::function<bool()> run) {
  if (!cu->capture) return run();
  if (!cu->in_capture[s])
    return report("%s on stream %d while the compute stream captures a graph: the stream waited for no event "
                  "recorded in the capture, so on a GPU it would run now, outside the graph",
                  call, (int)s);
  cu->capture->calls.push_back(std::move(run));
  cu->seen[s][s]++;
  return true;
}

static bool not_capturing(const RtCuda *cu, const char *call) {
  if (!cu->capture) return true;
  return report("%s while a graph is captured: nothing can be copied to or from the host or waited for "
                "until the capture ends (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)", call);
}

bool rt_cuda_to_device(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes) {
  if (!stream_ok(s, "rt_cuda_to_device") || !not_capturing(cu, "rt_cuda_to_device") || !device_range(cu, "rt_cuda_to_device", "destination", dst, bytes) ||
      !host_range(cu, "rt_cuda_to_device", "source", src, bytes))
    return false;
  if (bytes) memcpy(dst, src, bytes);
  return true;
}

bool rt_cuda_to_host(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes) {
  if (!stream_ok(s, "rt_cuda_to_host") || !not_capturing(cu, "rt_cuda_to_host") || !host_range(cu, "rt_cuda_to_host", "destination", dst, bytes) ||
      !device_range(cu, "rt_cuda_to_host", "source", src, bytes))
    return false;
  if (bytes) memcpy(dst, src, bytes);
  return true;
}

bool rt_cuda_pin(RtCuda *, void *, size_t) { return true; }   // host memory already

void rt_cuda_unpin(RtCuda *, void *) {}

bool rt_cuda_zero(RtCuda *cu, RtStream s, void *dst, size_t bytes) {
  if (!stream_ok(s, "rt_cuda_zero") || !device_range(cu, "rt_cuda_zero", "destination", dst, bytes)) return false;
  return issue(cu, s, "rt_cuda_zero", [=] {
    if (bytes) memset(dst, 0, bytes);
    return true;
  });
}

bool rt_cuda_copy(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes) {
  if (!stream_ok(s, "rt_cuda_copy") || !device_range(cu, "rt_cuda_copy", "destination", dst, bytes) ||
      !device_range(cu, "rt_cuda_copy", "source", src, bytes))
    return false;
  if (bytes && (const unsigned char *)src < (unsigned char *)dst + bytes && (unsigned char *)dst < (const unsigned char *)src + bytes)
    return report("rt_cuda_copy: the ranges overlap");
  return issue(cu, s, "rt_cuda_copy", [=] {
    if (bytes) memcpy(dst, src, bytes);
    return true;
  });
}

// ---- streams and events ----

bool rt_cuda_sync(RtCuda *cu, RtStream s) { return stream_ok(s, "rt_cuda_sync") && not_capturing(cu, "rt_cuda_sync"); }

static bool event_ok(const RtCuda *cu, int event, const char *call) {
  if (event >= 0 && (size_t)event < cu->recorded.size()) return true;
  return report("%s: event %d does not exist (%zu events)", call, event, cu->recorded.size());
}

bool rt_cuda_record(RtCuda *cu, RtStream s, int event) {
  if (!stream_ok(s, "rt_cuda_record") || !event_ok(cu, event, "rt_cuda_record")) return false;
  cu->recorded[(size_t)event] = true;
  cu->event_capture[(size_t)event] = 0;
  if (!cu->capture) return true;
  if (!cu->in_capture[s])
    return report("rt_cuda_record of event %d on stream %d, which is not in the capture under way", event, (int)s);
  cu->event_capture[(size_t)event] = cu->captures;
  cu->event_seen[(size_t)event] = cu->seen[s];
  return true;
}

bool rt_cuda_wait(RtCuda *cu, RtStream s, int event) {
  if (!stream_ok(s, "rt_cuda_wait") || !event_ok(cu, event, "rt_cuda_wait")) return false;
  if (!cu->recorded[(size_t)event]) return report("rt_cuda_wait: event %d has never been recorded", event);
  uint64_t in = cu->event_capture[(size_t)event];
  if (!cu->capture && in)
    return report("rt_cuda_wait for event %d, last recorded in a graph's capture (CUDA_ERROR_CAPTURED_EVENT)", event);
  if (!cu->capture) return true;
  if (in != cu->captures)
    return report("rt_cuda_wait on stream %d for event %d, recorded outside the capture under way: a dependency "
                  "across the capture's boundary (CUDA_ERROR_STREAM_CAPTURE_ISOLATION)", (int)s, event);
  cu->in_capture[s] = true;
  for (int t = 0; t < RT_STREAM_COUNT; t++)
    cu->seen[s][t] = std::max(cu->seen[s][t], cu->event_seen[(size_t)event][t]);
  return true;
}

// ---- the module: the image must be NVRTC's and hold the kernels looked up ----

// The size of an ELF image from its headers (the section and program header tables end it).
static size_t elf_size(const unsigned char *image) {
  Elf64_Ehdr h;
  memcpy(&h, image, sizeof h);
  size_t sections = (size_t)h.e_shoff + (size_t)h.e_shnum * h.e_shentsize;
  size_t programs = (size_t)h.e_phoff + (size_t)h.e_phnum * h.e_phentsize;
  return sections > programs ? sections : programs;
}

bool rt_cuda_load_module(RtCuda *cu, const void *image) {
  const unsigned char *p = (const unsigned char *)image;
  cu->image = nullptr;
  if (!p) return report("rt_cuda_load_module: no image");
  if (memcmp(p, ELFMAG, SELFMAG) == 0 && p[EI_CLASS] == ELFCLASS64) {
    cu->image_bytes = elf_size(p);
  } else if (strstr((const char *)p, ".version") && strstr((const char *)p, ".entry")) {
    cu->image_bytes = strlen((const char *)p);   // PTX text
  } else {
    return report("rt_cuda_load_module: the image is neither a CUBIN (ELF) nor PTX text");
  }
  cu->image = p;
  return true;
}

// Whether the loaded image names the kernel: an ELF string table entry ("\0NAME\0" or
// ".text.NAME\0") or a PTX entry (".entry NAME(").
static bool image_has(const RtCuda *cu, const char *name) {
  size_t n = strlen(name);
  const unsigned char *p = cu->image, *end = cu->image + cu->image_bytes;
  bool elf = memcmp(p, ELFMAG, SELFMAG) == 0;
  for (const unsigned char *q = p; q + n < end; q++) {
    q = (const unsigned char *)memmem(q, (size_t)(end - q), name, n);
    if (!q || q + n >= end) return false;
    if (elf && q > p && (q[-1] == '\0' || q[-1] == '.') && q[n] == '\0') return true;
    if (!elf && q - p >= 7 && memcmp(q - 7, ".entry ", 7) == 0 && q[n] == '(') return true;
  }
  return false;
}

// ---- kernels ----

// A kernel of the library: its name, whether it synchronises its threads, and how to run it.
struct FakeKernel {
  const char *name;
  bool syncs;
  bool (*run)(RtCuda *cu, const FakeKernel &k, void **args, int grid, int block);
  void (*arg_sizes)(const FakeKernel &k, std::vector<size_t> &sizes);   // each parameter's bytes
  const MkFusedKernel *fused;   // a program's fused kernel (below), else NULL
};

// Fibers for the threads of one block of a kernel that synchronises. On x86-64 a fiber switch
// is fake_switch below (six callee-saved registers and the stack pointer); glibc's swapcontext
// also saves the signal mask with a system call each time, which made it most of a step's
// time. Elsewhere ucontext does the switching.
enum FiberState { FIBER_RUNNING, FIBER_AT_BARRIER, FIBER_DONE };
// Fiber t's stack begins at t * FIBER_STRIDE: 64 KiB and three cache lines apart, not a power of
// two, so that the stacks' tops (which every switch touches) fall in different cache sets; at
// 64 KiB apart they all fell in the same few sets, and the first load from a resumed fiber's
// stack missed the caches (most of a step's time in gpt_moe_bytes' block reductions).
enum { FIBER_STACK = 64 << 10, FIBER_STRIDE = FIBER_STACK + 3 * 64 };
static struct {
  std::vector<FiberState> state;
  std::vector<char> stacks;
  int current;
  void (*body)(void *);
  void *body_arg;
#if defined(__x86_64__)
  std::vector<void *> sp;   // each fiber's saved stack pointer
  void *scheduler_sp;
#else
  std::vector<ucontext_t> context;
  ucontext_t scheduler;
#endif
} fibers;

#if defined(__x86_64__)
// fake_switch(save, to): pushes the callee-saved registers, stores the stack pointer in *save,
// switches to the stack `to` and pops its registers: returns where that stack's fiber last
// called fake_switch (or starts it, see fiber_init).
extern "C" void fake_switch(void **save, void *to);
asm(".text\n"
    ".globl fake_switch\n"
    ".type fake_switch, @function\n"
    "fake_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size fake_switch, .-fake_switch\n");

[[noreturn]] static void fiber_start() {
  fibers.body(fibers.body_arg);
  int me = fibers.current;
  fibers.state[(size_t)me] = FIBER_DONE;
  fake_switch(&fibers.sp[(size_t)me], fibers.scheduler_sp);
  __builtin_unreachable();
}

// A fresh stack for fiber t that fake_switch "returns" into fiber_start from: six zero
// registers, then fiber_start's address, then a zero return address for it (so that it starts
// with the stack aligned as after a call).
static void fiber_init(int t) {
  uintptr_t top = ((uintptr_t)(fibers.stacks.data() + (size_t)t * FIBER_STRIDE + FIBER_STACK)) & ~(uintptr_t)15;
  void **frame = (void **)(top - 8 * sizeof(void *));
  for (int r = 0; r < 6; r++) frame[r] = nullptr;
  frame[6] = (void *)&fiber_start;
  frame[7] = nullptr;
  fibers.sp[(size_t)t] = frame;
}

static void fiber_resume(int t) { fake_switch(&fibers.scheduler_sp, fibers.sp[(size_t)t]); }
static void fiber_suspend(int t) { fake_switch(&fibers.sp[(size_t)t], fibers.scheduler_sp); }
static void fibers_resize(int block) { fibers.sp.resize((size_t)block); }
#else
static void fiber_entry() {
  fibers.body(fibers.body_arg);
  fibers.state[(size_t)fibers.current] = FIBER_DONE;   // returning resumes the scheduler (uc_link)
}

static void fiber_init(int t) {
  ucontext_t *c = &fibers.context[(size_t)t];
  getcontext(c);
  c->uc_stack.ss_sp = fibers.stacks.data() + (size_t)t * FIBER_STRIDE;
  c->uc_stack.ss_size = FIBER_STACK;
  c->uc_link = &fibers.scheduler;
  makecontext(c, fiber_entry, 0);
}

static void fiber_resume(int t) { swapcontext(&fibers.scheduler, &fibers.context[(size_t)t]); }
static void fiber_suspend(int t) { swapcontext(&fibers.context[(size_t)t], &fibers.scheduler); }
static void fibers_resize(int block) { fibers.context.resize((size_t)block); }
#endif

static void fiber_barrier() {
  int me = fibers.current;
  fibers.state[(size_t)me] = FIBER_AT_BARRIER;
  fiber_suspend(me);
}

static const char *running_kernel;

static void barrier_outside_fibers() {
  rt_comm_abort("fake device: kernel %s called __syncthreads, but the kernel list (cg_emit_cuda_kernel_list) "
                "says it does not synchronise", running_kernel);
}

// Runs body(arg) as every thread of block b: one after the other, or as fibers round by round,
// each round taking every thread to its next barrier. False when the threads disagree about a
// barrier (some finished while others wait).
static bool run_block(const FakeKernel &k, int b, int block, void (*body)(void *), void *arg) {
  blockIdx.x = (unsigned)b;
  if (!k.syncs) {
    emu_sync = barrier_outside_fibers;
    for (int t = 0; t < block; t++) {
      threadIdx.x = (unsigned)t;
      body(arg);
    }
    return true;
  }
  fibers_resize(block);
  fibers.state.assign((size_t)block, FIBER_RUNNING);
  if (fibers.stacks.size() < (size_t)block * FIBER_STRIDE) fibers.stacks.resize((size_t)block * FIBER_STRIDE);
  fibers.body = body;
  fibers.body_arg = arg;
  for (int t = 0; t < block; t++) fiber_init(t);
  emu_sync = fiber_barrier;
  for (;;) {
    int done = 0, waiting = 0;
    for (int t = 0; t < block; t++) {
      if (fibers.state[(size_t)t] == FIBER_DONE) continue;
      fibers.current = t;
      fibers.state[(size_t)t] = FIBER_RUNNING;
      threadIdx.x = (unsigned)t;
      fiber_resume(t);
    }
    for (int t = 0; t < block; t++) {
      done += fibers.state[(size_t)t] == FIBER_DONE;
      waiting += fibers.state[(size_t)t] == FIBER_AT_BARRIER;
    }
    if (done == block) return true;
    if (done > 0) return report("kernel %s: block %d: %d threads wait at __syncthreads that %d others never reach", k.name, b,
                                waiting, done);
  }
}

// The kernel with its arguments unpacked, as one thread's body.
template <class... P> struct Call {
  void (*kernel)(P...);
  std::tuple<P...> values;
  static void body(void *self) {
    Call *c = (Call *)self;
    std::apply(c->kernel, c->values);
  }
};

template <class T> static T unpack(void *arg) {
  T v;
  memcpy(&v, arg, sizeof v);
  return v;
}

template <class... P, size_t... I>
static bool run_kernel(RtCuda *cu, const FakeKernel &k, void (*kernel)(P...), void **args, int grid, int block,
                       std::index_sequence<I...>) {
  Call<P...> call{kernel, std::tuple<P...>{unpack<P>(args[I])...}};
  // Every pointer argument must be device memory (or NULL).
  bool ok = true;
  int index = 0;
  auto check = [&](const auto &v) {
    if constexpr (std::is_pointer_v<std::decay_t<decltype(v)>>)
      if (v && !in_arena(cu, (const void *)v, 1))
        ok = report("kernel %s: argument %d (%p) is not device memory", k.name, index, (const void *)v);
    index++;
  };
  (check(std::get<I>(call.values)), ...);
  if (!ok) return false;
  gridDim.x = (unsigned)grid;
  blockDim.x = (unsigned)block;
  running_kernel = k.name;
  for (int b = 0; b < grid && ok; b++) ok = run_block(k, b, block, &Call<P...>::body, &call);
  emu_sync = nullptr;
  return ok;
}

template <class... P>
static bool run_kernel(RtCuda *cu, const FakeKernel &k, void (*kernel)(P...), void **args, int grid, int block) {
  return run_kernel(cu, k, kernel, args, grid, block, std::index_sequence_for<P...>{});
}

template <class... P> static void param_sizes(void (*)(P...), std::vector<size_t> &sizes) { sizes = {sizeof(P)...}; }

#define MK_KERNEL(name, syncs)                                                                   \
  {#name, syncs,                                                                                 \
   [](RtCuda *cu, const FakeKernel &k, void **args, int grid, int block) {                       \
     return run_kernel(cu, k, &name, args, grid, block);                                          \
   },                                                                                            \
   [](const FakeKernel &, std::vector<size_t> &sizes) { param_sizes(&name, sizes); }, nullptr},
static const FakeKernel kernel_table[] = {
#include MK_KERNEL_LIST
};
#undef MK_KERNEL

// A program's fused kernels (codegen/fused.c): generated per program and compiled into it as host
// C++ (tests/cuda/fused_host.h), whose tables register here before main (one per pipeline stage
// of a model of several; none in a program without any). Each takes pointers only, checked like a
// library kernel's.
static std::vector<std::pair<const MkFusedKernel *, int>> &fused_tables() {
  static std::vector<std::pair<const MkFusedKernel *, int>> tables;   // whichever file's initialiser runs first
  return tables;
}

extern "C" void mk_fused_register(const MkFusedKernel *table, int count) { fused_tables().push_back({table, count}); }

static std::vector<FakeKernel> fused_table;

static void fused_thread(void *self) {
  const FakeKernel *k = (const FakeKernel *)((void **)self)[0];
  k->fused->thread((void **)((void **)self)[1]);
}

static bool run_fused(RtCuda *cu, const FakeKernel &k, void **args, int grid, int block) {
  for (int a = 0; a < k.fused->nptrs; a++) {
    void *p;
    memcpy(&p, args[a], sizeof p);
    if (p && !in_arena(cu, p, 1)) return report("kernel %s: argument %d (%p) is not device memory", k.name, a, p);
  }
  gridDim.x = (unsigned)grid;
  blockDim.x = (unsigned)block;
  running_kernel = k.name;
  void *self[2] = {(void *)&k, (void *)args};
  bool ok = true;
  for (int b = 0; b < grid && ok; b++) ok = run_block(k, b, block, fused_thread, self);
  emu_sync = nullptr;
  return ok;
}

static void fused_sizes(const FakeKernel &k, std::vector<size_t> &sizes) {
  sizes.assign((size_t)k.fused->nptrs, sizeof(void *));
}

static const FakeKernel *fused_kernel(const char *name) {
  if (fused_table.empty() && !fused_tables().empty()) {
    size_t count = 0;
    for (const auto &t : fused_tables()) count += (size_t)t.second;
    fused_table.reserve(count);   // never grows after: its addresses are CUfunctions
    for (const auto &t : fused_tables())
      for (int i = 0; i < t.second; i++)
        fused_table.push_back({t.first[i].name, t.first[i].syncs, run_fused, fused_sizes, &t.first[i]});
  }
  for (const FakeKernel &k : fused_table)
    if (strcmp(k.name, name) == 0) return &k;
  return nullptr;
}

static bool is_kernel(const FakeKernel *k) {
  if (k >= kernel_table && k < kernel_table + sizeof kernel_table / sizeof *kernel_table) return true;
  return !fused_table.empty() && k >= fused_table.data() && k < fused_table.data() + fused_table.size();
}

// mk_expert_gemm_wg (n 128) or _wg256 of the library the fake device was built with (the image, a
// CUBIN for sm_90a, is not read), allowed RT_CUDA_WG_SHARED(n) bytes of shared memory as the GPU's
// runtime allows it: launches of more than 48 KiB fail for every other kernel, as on a GPU.
CUfunction rt_cuda_load_wg(RtCuda *cu, const void *image, int n) {
  if (!image || (n != 128 && n != 256)) {
    report("rt_cuda_load_wg: no image, or no kernel of tiles %d wide", n);
    return nullptr;
  }
  const char *name = n == 256 ? "mk_expert_gemm_wg256" : "mk_expert_gemm_wg";
  for (const FakeKernel &k : kernel_table)
    if (strcmp(k.name, name) == 0) {
      CUfunction f = (CUfunction)(uintptr_t)&k;
      cu->wg_loaded.insert(f);
      return f;
    }
  report("rt_cuda_load_wg: the library the fake device was built with has no %s", name);
  return nullptr;
}

void rt_cuda_use_wg(RtCuda *cu, CUfunction wg, int n) { cu->wg = wg, cu->wg_n = n; }

CUfunction rt_cuda_kernel(RtCuda *cu, const char *name) {
  if (!cu->image) {
    report("no kernel module is loaded (looking for kernel '%s')", name);
    return nullptr;
  }
  if (!image_has(cu, name)) {
    report("the loaded kernel module has no kernel '%s'", name);
    return nullptr;
  }
  for (const FakeKernel &k : kernel_table)
    if (strcmp(k.name, name) == 0) return (CUfunction)(uintptr_t)&k;
  if (const FakeKernel *k = fused_kernel(name)) return (CUfunction)(uintptr_t)k;
  report("kernel '%s' is in the module but not in the library the fake device was built with", name);
  return nullptr;
}

int rt_cuda_grid(int64_t n, int block) {
  int64_t grid = block > 0 ? (n + block - 1) / block : 1;
  return grid < 1 ? 1 : grid > 65535 ? 65535 : (int)grid;
}

// A launch kept by a capture: the kernel and a copy of its arguments' values.
struct FakeLaunch {
  const FakeKernel *k;
  int grid, block;
  unsigned shared_bytes;
  std::vector<size_t> sizes;
  std::vector<unsigned char> values;   // the arguments one after the other

  void set(void **args) {
    values.clear();
    for (size_t i = 0; i < sizes.size(); i++)
      values.insert(values.end(), (const unsigned char *)args[i], (const unsigned char *)args[i] + sizes[i]);
  }
  bool run(RtCuda *cu) {
    std::vector<void *> args(sizes.size());
    for (size_t i = 0, at = 0; i < sizes.size(); at += sizes[i++]) args[i] = values.data() + at;
    return k->run(cu, *k, args.data(), grid, block);
  }
};

static const FakeKernel *launch_check(CUfunction f, int grid, int block, unsigned shared_bytes) {
  const FakeKernel *k = (const FakeKernel *)(uintptr_t)f;
  if (!f || !is_kernel(k)) {
    report("rt_cuda_launch: not a kernel of rt_cuda_kernel");
    return nullptr;
  }
  if (grid < 1 || grid > 65535 || block < 1 || block > 1024) {
    report("kernel %s: launch <<<%d, %d>>> out of range", k->name, grid, block);
    return nullptr;
  }
  if (shared_bytes > sizeof emu_dyn_shared) {
    report("kernel %s: %u bytes of dynamic shared memory, the fake device has %zu", k->name, shared_bytes,
           sizeof emu_dyn_shared);
    return nullptr;
  }
  return k;
}

// A launch: run now, or kept by the capture under way (and, with step arguments, remembered as
// the graph's next node that rt_cuda_graph_set may update).
static bool launch(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes, void **args,
                   bool step) {
  if (!stream_ok(s, "rt_cuda_launch")) return false;
  const FakeKernel *k = launch_check(f, grid, block, shared_bytes);
  if (k && shared_bytes > 48 * 1024 && !cu->wg_loaded.count(f))
    return report("kernel %s: %u bytes of dynamic shared memory, more than 48 KiB, and its function was never "
                  "allowed them (cuFuncSetAttribute: only rt_cuda_load_wg's kernels are)", k->name, shared_bytes);
  if (!k) return false;
  // MOERT_FAKE_WG_WRONG=1: every launch of rt_cuda_load_wg's kernels outside a capture adds 1 to the
  // first element of its result, as a kernel would that reads one wrong value (the tests' proof that
  // the session's check at the start turns it down).
  if (cu->wg_wrong && cu->wg_loaded.count(f) && !cu->capture) {
    if (!k->run(cu, *k, args, grid, block)) return false;
    float *c = *(float **)args[2];
    c[0] += 1.0f;
    return true;
  }
  if (!cu->capture) return k->run(cu, *k, args, grid, block);
  auto l = std::make_shared<FakeLaunch>();
  *l = FakeLaunch{k, grid, block, shared_bytes, {}, {}};
  k->arg_sizes(*k, l->sizes);
  l->set(args);
  if (!issue(cu, s, "rt_cuda_launch", [cu, l] { return l->run(cu); })) return false;
  if (step) cu->capture->step_nodes.push_back(l);
  return true;
}

bool rt_cuda_launch(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes, void **args) {
  return launch(cu, s, f, grid, block, shared_bytes, args, false);
}

// ---- graphs ----

bool rt_cuda_capture_begin(RtCuda *cu) {
  if (cu->capture) return report("rt_cuda_capture_begin: a capture is already under way");
  cu->capture = new RtCudaGraph{};
  cu->captures++;
  for (int t = 0; t < RT_STREAM_COUNT; t++) {
    cu->in_capture[t] = t == RT_STREAM_COMPUTE;
    cu->seen[t] = Seen{};
  }
  return true;
}

RtCudaGraph *rt_cuda_capture_end(RtCuda *cu) {
  RtCudaGraph *g = cu->capture;
  if (!g) {
    report("rt_cuda_capture_end: no capture is under way");
    return nullptr;
  }
  cu->capture = nullptr;
  bool ok = true;
  for (int t = 0; t < RT_STREAM_COUNT; t++) {
    if (t != RT_STREAM_COMPUTE && cu->in_capture[t] && cu->seen[RT_STREAM_COMPUTE][t] != cu->seen[t][t])
      ok = report("rt_cuda_capture_end: %zu calls on stream %d after its last join into the compute stream "
                  "(CUDA_ERROR_STREAM_CAPTURE_UNJOINED)", cu->seen[t][t] - cu->seen[RT_STREAM_COMPUTE][t], t);
    cu->in_capture[t] = false;
  }
  if (ok) return g;
  delete g;
  return nullptr;
}

bool rt_cuda_launch_step(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes,
                         void **args) {
  return launch(cu, s, f, grid, block, shared_bytes, args, true);
}

int rt_cuda_graph_step_nodes(const RtCudaGraph *g) { return (int)g->step_nodes.size(); }

bool rt_cuda_graph_set(RtCuda *cu, RtCudaGraph *g, int node, CUfunction f, int grid, int block, unsigned shared_bytes,
                       void **args) {
  if (!not_capturing(cu, "rt_cuda_graph_set")) return false;
  if (node < 0 || (size_t)node >= g->step_nodes.size())
    return report("rt_cuda_graph_set: node %d of a graph with %zu nodes of step arguments", node, g->step_nodes.size());
  FakeLaunch &l = *g->step_nodes[(size_t)node];
  if ((const FakeKernel *)(uintptr_t)f != l.k || grid != l.grid || block != l.block || shared_bytes != l.shared_bytes)
    return report("rt_cuda_graph_set: node %d launches kernel %s <<<%d, %d>>>, not the kernel and grid it was captured "
                  "with (%s <<<%d, %d>>>)", node, f ? ((const FakeKernel *)(uintptr_t)f)->name : "NULL", grid, block,
                  l.k->name, l.grid, l.block);
  l.set(args);
  return true;
}

bool rt_cuda_graph_launch(RtCuda *cu, RtCudaGraph *g, RtStream s) {
  if (!stream_ok(s, "rt_cuda_graph_launch") || !not_capturing(cu, "rt_cuda_graph_launch")) return false;
  for (auto &call : g->calls)
    if (!call()) return false;
  return true;
}

bool rt_cuda_graph_destroy(RtCudaGraph *g) {
  delete g;
  return true;
}

// ---- GEMMs: libmoert's, on the arena ----

static bool gemm_ranges(RtCuda *cu, RtCudaType in, const void *a, const void *b, const float *c, size_t batch, int m,
                        int n, int k) {
  size_t elem = in == RT_CUDA_BF16 ? 2 : 4;
  return device_range(cu, "gemm", "A", a, batch * m * k * elem) && device_range(cu, "gemm", "B", b, batch * k * n * elem) &&
         device_range(cu, "gemm", "C", c, batch * m * n * sizeof(float));
}

// a as fp32 (bf16 widened into store, exactly: the bf16 bits are the top half of a binary32),
// count elements.
static const float *as_f32(RtCudaType in, const void *a, size_t count, std::vector<float> &store) {
  if (in == RT_CUDA_F32) return (const float *)a;
  store.resize(count);
  rt_decompress_bf16((const uint16_t *)a, store.data(), (int64_t)count);
  return store.data();
}

bool rt_cuda_gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c, int m, int n, int k,
                  bool ta, bool tb, bool accumulate) {
  if (!stream_ok(s, "rt_cuda_gemm") || !gemm_ranges(cu, in, a, b, c, 1, m, n, k)) return false;
  return issue(cu, s, "rt_cuda_gemm", [=] {
    if (m <= 0 || n <= 0) return true;
    std::vector<float> wa, wb;
    rt_matmul(as_f32(in, a, (size_t)m * k, wa), as_f32(in, b, (size_t)k * n, wb), c, m, n, k, ta, tb, accumulate);
    return true;
  });
}

bool rt_cuda_expert_gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c, int e, int m,
                         int n, int k, bool ta, bool tb) {
  if (!stream_ok(s, "rt_cuda_expert_gemm") || !gemm_ranges(cu, in, a, b, c, e > 0 ? (size_t)e : 0, m, n, k)) return false;
  return issue(cu, s, "rt_cuda_expert_gemm", [=] {
    if (e <= 0 || m <= 0 || n <= 0) return true;
    std::vector<float> wa, wb;
    rt_expert_matmul(as_f32(in, a, (size_t)e * m * k, wa), as_f32(in, b, (size_t)e * k * n, wb), c, e, m, n, k, ta, tb);
    return true;
  });
}

// The filled rows, as cuBLASLt's grouped GEMM takes them: each block's count read from the arena
// and checked (and the clamped counts after them, a weight gradient's K), every slot row past it
// zeroed in the operands that hold slot rows (a when !ta; a and b when ta), the padded GEMM run on
// those, and with !ta only the counted rows of c written: the others keep what the program left
// there (its mk_expert_counts zeroed them), as on a GPU, but for rows holding anything but zeros,
// which become NaN (below). MOERT_FAKE_SHORT_ROWS=1 takes one row off
// the first count that is not 0: the tests' proof that a count too small shows.
bool rt_cuda_expert_gemm_rows(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c, int e,
                              int m, int n, int k, bool ta, bool tb, const int *rows, int blocks, CUfunction tc) {
  const char *call = "rt_cuda_expert_gemm_rows";
  if (!stream_ok(s, call) || !gemm_ranges(cu, in, a, b, c, e > 0 ? (size_t)e : 0, m, n, k)) return false;
  int slots = ta ? k : m;
  if (blocks < 1 || slots % blocks) return report("%s: %d slots in %d blocks", call, slots, blocks);
  if (ta && tb) return report("%s: no slot rows in a GEMM with ta and tb", call);
  if (!device_range(cu, call, "rows", rows, 2 * (size_t)(e > 0 ? e : 0) * blocks * sizeof *rows)) return false;
  // moec's grouped GEMM, as rt_cuda.c launches it (on the operands it takes: rt_cuda_tc_fits), when
  // MOERT_CUDA_GROUPED=moec asks for it.
  if (e > 0 && rt_cuda_rows_gemm(cu, tc && in == RT_CUDA_BF16, nullptr, 0) == RT_ROWS_MOEC &&
      rt_cuda_tc_fits(in, a, b, m, n, k, ta, tb)) {
    cu->moec_sites.insert(c);
    return rt_cuda_launch_grouped(cu, s, cu->wg ? cu->wg : tc, cu->wg ? cu->wg_n : 0, a, b, c, rows, e, m, n, k, ta,
                                  tb, blocks);
  }
  const char *short_rows = getenv("MOERT_FAKE_SHORT_ROWS");
  bool shorten = short_rows && strcmp(short_rows, "1") == 0;
  return issue(cu, s, call, [=] {
    if (e <= 0 || m <= 0 || n <= 0) return true;
    int per = slots / blocks, groups = e * blocks;
    std::vector<int> count(rows, rows + groups);
    for (int g = 0; g < groups; g++)
      if (count[(size_t)g] < 0 || count[(size_t)g] > per || rows[groups + g] != std::max(count[(size_t)g], 1))
        return report("%s: block %d counts %d filled rows of %d (clamped: %d)", call, g, count[(size_t)g], per,
                      rows[groups + g]);
    for (int g = 0; shorten && g < groups; g++)
      if (count[(size_t)g] > 0) {
        count[(size_t)g]--;
        break;
      }
    std::vector<float> wa, wb;
    const float *fa = as_f32(in, a, (size_t)e * m * k, wa), *fb = as_f32(in, b, (size_t)e * k * n, wb);
    // The slot rows of an operand ([e, slots, width]) with the rows past the counts zeroed; a weight
    // gradient's past the clamped counts, as the GPU's GEMMs read them (an empty block's row 0, which
    // the program keeps: codegen/launch.c's filled rows).
    auto masked = [&](const float *x, int width, std::vector<float> &store) {
      store.assign(x, x + (size_t)e * slots * width);
      for (int g = 0; g < groups; g++)
        for (int r = ta ? std::max(count[(size_t)g], 1) : count[(size_t)g]; r < per; r++)
          std::fill_n(store.begin() + ((size_t)g * per + r) * width, width, 0.0f);
      return (const float *)store.data();
    };
    std::vector<float> ma, mb;
    fa = masked(fa, ta ? m : k, ma);
    if (ta) {   // the whole weight gradient, a sum over the counted slots
      fb = masked(fb, n, mb);
      rt_expert_matmul(fa, fb, c, e, m, n, k, ta, tb);
      return true;
    }
    std::vector<float> out((size_t)e * m * n);
    rt_expert_matmul(fa, fb, out.data(), e, m, n, k, ta, tb);
    for (int g = 0; g < groups; g++) {
      std::copy_n(out.begin() + (size_t)g * per * n, (size_t)count[(size_t)g] * n, c + (size_t)g * per * n);
      // A row past the count that the program did not zero (its count kernel zeroes them before,
      // mk_expert_rows_zero or _fill after) becomes NaN: what a GPU leaves there is whatever was
      // there, so a program that reads it without writing it first shows (codegen/launch.c).
      for (int r = count[(size_t)g]; r < per; r++) {
        float *row = c + ((size_t)g * per + r) * n;
        if (std::any_of(row, row + n, [](float v) { return v != 0.0f; })) std::fill_n(row, n, NAN);
      }
    }
    return true;
  });
}

// The fake device runs every rt_cuda_expert_gemm_rows over the counted rows (above), with
// libmoert's GEMM in place of cuBLASLt's grouped one, or with moec's (MOERT_CUDA_GROUPED=moec).
bool rt_cuda_grouped_gemms(RtCuda *, char *why, size_t why_size) {
  if (why && why_size) snprintf(why, why_size, "the fake device's GEMM over the counted rows");
  return true;
}

RtRowsGemm rt_cuda_rows_gemm(RtCuda *cu, bool tc, char *why, size_t why_size) {
  const char *env = getenv("MOERT_CUDA_GROUPED");
  rt_cuda_grouped_gemms(cu, why, why_size);
  if (tc && env && strcmp(env, "moec") == 0) {
    if (why && why_size) snprintf(why, why_size, "MOERT_CUDA_GROUPED=moec");
    return RT_ROWS_MOEC;
  }
  return RT_ROWS_CUBLASLT;
}

int rt_cuda_grouped_sites(const RtCuda *cu, int *padded, int *moec) {
  if (padded) *padded = 0;
  if (moec) *moec = (int)cu->moec_sites.size();
  return 0;
}

// ---- NCCL: the runtime's MPI collectives on the same group ----

struct RtNccl {
  RtComm *comm;   // the group's communicators; the fake's collectives are theirs
  RtGroup group;
  int ranks;
};

RtNccl *rt_cuda_nccl_group(RtComm *comm, RtGroup g) {
  if ((int)g < 0 || g >= RT_GROUP_COUNT || rt_comm_mpi(comm, g) == MPI_COMM_NULL) {
    report("no communicator for parallel group %d: the program made no communicators (rt_comm_create)", (int)g);
    return nullptr;
  }
  return new RtNccl{comm, g, rt_comm_size(comm, g)};
}

RtNccl *rt_cuda_nccl_create(MPI_Comm comm) {
  (void)comm;
  report("the fake device runs NCCL as runtime/comm.c's collectives: make its communicators with "
         "rt_cuda_nccl_group, over a parallel group");
  return nullptr;
}

bool rt_cuda_nccl_destroy(RtNccl *nc) {
  delete nc;
  return true;
}

static bool collective_ranges(RtCuda *cu, const char *call, RtStream s, const float *send, size_t send_count,
                              const float *recv, size_t recv_count) {
  return stream_ok(s, call) && device_range(cu, call, "send buffer", send, send_count * sizeof(float)) &&
         device_range(cu, call, "receive buffer", recv, recv_count * sizeof(float));
}

bool rt_cuda_allreduce(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  if (!collective_ranges(cu, "rt_cuda_allreduce", s, send, count, recv, count)) return false;
  return issue(cu, s, "rt_cuda_allreduce", [=] {
    if (send != recv) memcpy(recv, send, count * sizeof(float));
    rt_allreduce(nc->comm, nc->group, recv, (int64_t)count);
    return true;
  });
}

bool rt_cuda_allgather(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  if (!collective_ranges(cu, "rt_cuda_allgather", s, send, count, recv, count * (size_t)nc->ranks)) return false;
  return issue(cu, s, "rt_cuda_allgather", [=] {
    rt_allgather(nc->comm, nc->group, send, recv, (int64_t)count);
    return true;
  });
}

bool rt_cuda_reducescatter(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  if (!collective_ranges(cu, "rt_cuda_reducescatter", s, send, count * (size_t)nc->ranks, recv, count)) return false;
  return issue(cu, s, "rt_cuda_reducescatter", [=] {
    rt_reducescatter(nc->comm, nc->group, send, recv, (int64_t)count);
    return true;
  });
}

bool rt_cuda_alltoall(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  size_t total = count * (size_t)nc->ranks;
  if (!collective_ranges(cu, "rt_cuda_alltoall", s, send, total, recv, total)) return false;
  return issue(cu, s, "rt_cuda_alltoall", [=] {
    rt_alltoall(nc->comm, nc->group, RT_A2A_FLAT, send, recv, (int64_t)count);
    return true;
  });
}
