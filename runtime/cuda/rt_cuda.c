// The CUDA backend's runtime over the driver API, cuBLAS and NCCL (rt_cuda.h says what it offers).
//
// The driver is a table of function pointers filled from libcuda.so.1 with dlopen/dlsym: linking
// -lcuda would make libcuda.so.1 a dependency the loader resolves before main, so a binary
// could not even start (let alone say "no GPU") where no NVIDIA driver is installed. The table's
// fields are declared with cuda.h's own prototypes (__typeof__), and each is looked up under
// the versioned name that cuda.h's macros give the call (cuMemAlloc is cuMemAlloc_v2), which
// is the symbol a link against the driver would have bound: calls read drv.cuMemAlloc(...) and
// mean exactly what cuMemAlloc(...) means in CUDA's documentation.
//
// Row-major GEMMs on column-major cuBLAS: C = op(A) op(B) stored row-major is C^T = op(B)^T
// op(A)^T column-major, and a row-major matrix read column-major is its transpose; so cuBLAS
// gets B before A with the same transpose flags and the sizes n, m.
#include "rt_cuda.h"
#include "rt_internal.h"
#include "rt_mpi.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// ---- the driver, loaded at run time ----

#define DRIVER_LIBRARY "libcuda.so.1"

// The calls this file makes. X(f) sees f after cuda.h's macros: cuMemAlloc arrives as cuMemAlloc_v2.
#define DRIVER_CALLS(X)                                                                              \
  X(cuGetErrorName) X(cuGetErrorString) X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount)        \
  X(cuDeviceGet) X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDeviceTotalMem)                      \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxSynchronize)   \
  X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamWaitEvent) X(cuEventCreate)  \
  X(cuEventDestroy) X(cuEventRecord) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoDAsync)                  \
  X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuMemsetD8Async) X(cuModuleLoadDataEx) X(cuModuleUnload)                     \
  X(cuModuleGetFunction) X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuMemHostRegister) X(cuMemHostUnregister)                \
  X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuStreamGetCaptureInfo) X(cuGraphInstantiate)      \
  X(cuGraphLaunch) X(cuGraphExecKernelNodeSetParams) X(cuGraphDestroy) X(cuGraphExecDestroy)

#define DRIVER_FIELD(f) __typeof__(f) *f;
static struct {
  DRIVER_CALLS(DRIVER_FIELD)
} drv;
static void *driver_library;

#define SYMBOL_NAME(f) SYMBOL_NAME_(f)   // the name after macro expansion: "cuMemAlloc_v2"
#define SYMBOL_NAME_(f) #f

// Fills drv from libcuda.so.1 (once); false with the reason in why.
static bool load_driver(char *why, size_t why_size) {
  if (driver_library)
    return true;
  void *lib = dlopen(DRIVER_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, why_size, "no NVIDIA driver: %s", dlerror());
    return false;
  }
#define DRIVER_LOAD(f)                                                                               \
  if (!(drv.f = (__typeof__(f) *)dlsym(lib, SYMBOL_NAME(f)))) {                                      \
    snprintf(why, why_size, "the driver's %s has no %s (older than CUDA %d)", DRIVER_LIBRARY,        \
             SYMBOL_NAME(f), CUDA_VERSION);                                                          \
    dlclose(lib);                                                                                    \
    return false;                                                                                    \
  }
  DRIVER_CALLS(DRIVER_LOAD)
#undef DRIVER_LOAD
  driver_library = lib;
  return true;
}

// ---- errors ----

// "moert: error: rank R on HOST: MESSAGE" on stderr; the rank is MPI_COMM_WORLD's when MPI runs.
static bool report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool report(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  rt_mpi_vreport("", fmt, ap);
  va_end(ap);
  return false;
}

// The call as written, without the "drv." of the driver table and the arguments: "cuMemAlloc".
static const char *call_name(const char *call, char *buf, size_t size) {
  if (strncmp(call, "drv.", 4) == 0)
    call += 4;
  snprintf(buf, size, "%.*s", (int)strcspn(call, "("), call);
  return buf;
}

// Each check is true when the call succeeded; otherwise it reports and is false. MPI calls use
// rt_mpi.h's MPI_CHECK: a failed one ends the job (rt_comm_abort), as in comm.c.
#define CUDA_CHECK(call) cuda_ok((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) cublas_ok((call), #call, __FILE__, __LINE__)
#define NCCL_CHECK(call) nccl_ok((call), #call, __FILE__, __LINE__)

// "NAME (description)" of a driver error.
static const char *cuda_error_text(CUresult rc, char *buf, size_t size) {
  const char *name = NULL, *text = NULL;
  if (rc == CUDA_ERROR_STUB_LIBRARY)   // the stub names no error: it fails every call
    snprintf(buf, size, "CUDA_ERROR_STUB_LIBRARY (the toolkit's stub libcuda was loaded, not the NVIDIA driver)");
  else if (drv.cuGetErrorName(rc, &name) == CUDA_SUCCESS && drv.cuGetErrorString(rc, &text) == CUDA_SUCCESS)
    snprintf(buf, size, "%s (%s)", name, text);
  else
    snprintf(buf, size, "CUDA error %d", (int)rc);
  return buf;
}

static bool cuda_ok(CUresult rc, const char *call, const char *file, int line) {
  if (rc == CUDA_SUCCESS)
    return true;
  char name[128], text[256];
  return report("%s failed: %s at %s:%d", call_name(call, name, sizeof name), cuda_error_text(rc, text, sizeof text),
                file, line);
}

static bool cublas_ok(cublasStatus_t rc, const char *call, const char *file, int line) {
  if (rc == CUBLAS_STATUS_SUCCESS)
    return true;
  char buf[128];
  return report("%s failed: %s (%s) at %s:%d", call_name(call, buf, sizeof buf), cublasGetStatusName(rc),
                cublasGetStatusString(rc), file, line);
}

static bool nccl_ok(ncclResult_t rc, const char *call, const char *file, int line) {
  if (rc == ncclSuccess)
    return true;
  const char *last = ncclGetLastError(NULL);
  char buf[128];
  return report("%s failed: %s%s%s at %s:%d", call_name(call, buf, sizeof buf), ncclGetErrorString(rc),
                last && *last ? ": " : "", last ? last : "", file, line);
}

// ---- the device ----

struct RtCuda {
  RtCudaDevice device;
  CUdevice dev;
  CUcontext ctx;                     // the primary context, retained
  CUstream stream[RT_STREAM_COUNT];
  CUevent *events;
  int nevents;
  cublasHandle_t blas;
  CUmodule module;                   // NULL until rt_cuda_load_module
  CUmodule wg_module;                // rt_cuda_load_wg's (NULL: none)
  CUfunction wg;                     // rt_cuda_use_wg's: launched in mk_expert_gemm_tc's place (NULL: tc)
  int wg_n;                          // its tiles' width
  CUdeviceptr arena;
  size_t arena_bytes, arena_used;
  CUdeviceptr workspace;             // cuBLAS's, WORKSPACE_BYTES per stream (no allocation while capturing)
  RtCudaGraph *capture;              // the graph being captured, or NULL
  // The expert GEMMs over their filled rows (rt_cuda_expert_gemm_rows): whether cuBLASLt's
  // grouped GEMM runs them (0 not asked yet, 1 yes, -1 no: why), and each call site's setup.
  int grouped;
  char grouped_why[200];
  char rows_env;                     // MOERT_CUDA_GROUPED as rows_env reads it (0: not yet)
  cublasLtHandle_t lt;
  struct Grouped *sites;
  int nsites, cap_sites;
  const float *moec_sites[256];   // the results of the calls that ran moec's grouped GEMM (distinct)
  int nmoec;
};

// cuBLAS's workspace per stream: NVIDIA's advice for Hopper (32 MiB). A handle's own workspace
// would be allocated by cuBLAS when it is first needed, which a graph capture cannot record, and
// one workspace shared by GEMMs on two streams at once would be a race.
#define WORKSPACE_BYTES ((size_t)32 << 20)

struct RtCudaGraph {
  CUgraph graph;
  CUgraphExec exec;
  CUgraphNode *nodes;                // the nodes with step arguments, in launch order
  int nnodes, cap;
};

bool rt_cuda_probe(char *why, size_t why_size) {
  if (!load_driver(why, why_size))
    return false;
  int count = 0;
  CUdevice dev;
  const char *call = "cuInit";
  CUresult rc = drv.cuInit(0);
  if (rc == CUDA_SUCCESS) {
    call = "cuDeviceGetCount";
    rc = drv.cuDeviceGetCount(&count);
  }
  if (rc == CUDA_SUCCESS && count < 1) {
    snprintf(why, why_size, "the driver sees no CUDA device");
    return false;
  }
  if (rc == CUDA_SUCCESS) {
    call = "cuDeviceGet";
    rc = drv.cuDeviceGet(&dev, 0);
  }
  if (rc == CUDA_SUCCESS)
    return true;
  char text[256];
  snprintf(why, why_size, "%s: %s", call, cuda_error_text(rc, text, sizeof text));
  return false;
}

static bool device_info(RtCuda *cu) {
  RtCudaDevice *d = &cu->device;
  int major = 0, minor = 0;
  bool ok = CUDA_CHECK(drv.cuDeviceGetName(d->name, (int)sizeof d->name, cu->dev)) &&
            CUDA_CHECK(drv.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cu->dev)) &&
            CUDA_CHECK(drv.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cu->dev)) &&
            CUDA_CHECK(drv.cuDeviceGetAttribute(&d->multiprocessors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                cu->dev)) &&
            CUDA_CHECK(drv.cuDeviceTotalMem(&d->memory_bytes, cu->dev)) &&
            CUDA_CHECK(drv.cuDriverGetVersion(&d->driver_version));
  d->arch = major * 10 + minor;
  return ok;
}

// The launcher's local rank of this process, 0 without one.
static int local_rank(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
    const char *v = getenv(vars[i]);
    if (v && *v)
      return atoi(v) > 0 ? atoi(v) : 0;
  }
  return 0;
}

RtCuda *rt_cuda_create(size_t arena_bytes, int nevents) {
  char why[512];
  if (!rt_cuda_probe(why, sizeof why)) {
    report("no GPU to run on: %s", why);
    return NULL;
  }
  int count = 0;
  if (!CUDA_CHECK(drv.cuDeviceGetCount(&count)))
    return NULL;
  RtCuda *cu = rt_calloc(1, sizeof *cu, "the CUDA runtime's state");
  if (nevents > 0)
    cu->events = rt_calloc((size_t)nevents, sizeof *cu->events, "the CUDA runtime's events");
  bool ok = CUDA_CHECK(drv.cuDeviceGet(&cu->dev, local_rank() % count)) && device_info(cu) &&
            CUDA_CHECK(drv.cuDevicePrimaryCtxRetain(&cu->ctx, cu->dev)) && CUDA_CHECK(drv.cuCtxSetCurrent(cu->ctx));
  for (int s = 0; ok && s < RT_STREAM_COUNT; s++)
    ok = CUDA_CHECK(drv.cuStreamCreate(&cu->stream[s], CU_STREAM_NON_BLOCKING));
  for (; ok && cu->nevents < nevents; cu->nevents++)
    ok = CUDA_CHECK(drv.cuEventCreate(&cu->events[cu->nevents], CU_EVENT_DISABLE_TIMING));
  ok = ok && CUBLAS_CHECK(cublasCreate(&cu->blas));
  if (ok && arena_bytes > 0 && (ok = CUDA_CHECK(drv.cuMemAlloc(&cu->arena, arena_bytes))))
    cu->arena_bytes = arena_bytes;
  ok = ok && CUDA_CHECK(drv.cuMemAlloc(&cu->workspace, WORKSPACE_BYTES * RT_STREAM_COUNT));
  if (!ok) {
    rt_cuda_destroy(cu);
    return NULL;
  }
  return cu;
}

static bool grouped_destroy(RtCuda *cu);

bool rt_cuda_destroy(RtCuda *cu) {
  if (!cu)
    return true;
  bool ok = !cu->ctx || CUDA_CHECK(drv.cuCtxSynchronize());
  if (cu->module && !CUDA_CHECK(drv.cuModuleUnload(cu->module)))
    ok = false;
  if (cu->wg_module && !CUDA_CHECK(drv.cuModuleUnload(cu->wg_module)))
    ok = false;
  if (cu->arena && !CUDA_CHECK(drv.cuMemFree(cu->arena)))
    ok = false;
  if (cu->workspace && !CUDA_CHECK(drv.cuMemFree(cu->workspace)))
    ok = false;
  if (cu->blas && !CUBLAS_CHECK(cublasDestroy(cu->blas)))
    ok = false;
  if (!grouped_destroy(cu))
    ok = false;
  for (int i = 0; i < cu->nevents; i++)
    if (cu->events[i] && !CUDA_CHECK(drv.cuEventDestroy(cu->events[i])))
      ok = false;
  for (int s = 0; s < RT_STREAM_COUNT; s++)
    if (cu->stream[s] && !CUDA_CHECK(drv.cuStreamDestroy(cu->stream[s])))
      ok = false;
  if (cu->ctx && !CUDA_CHECK(drv.cuDevicePrimaryCtxRelease(cu->dev)))
    ok = false;
  free(cu->events);
  free(cu);
  return ok;
}

const RtCudaDevice *rt_cuda_device(const RtCuda *cu) { return &cu->device; }

// ---- device memory ----

void *rt_cuda_alloc(RtCuda *cu, size_t bytes) {
  size_t start = (cu->arena_used + 255) & ~(size_t)255;
  if (start > cu->arena_bytes || bytes > cu->arena_bytes - start) {
    report("the device arena of %zu bytes cannot hold %zu more bytes (%zu in use)", cu->arena_bytes, bytes,
           cu->arena_used);
    return NULL;
  }
  cu->arena_used = start + bytes;
  return (void *)(uintptr_t)(cu->arena + start);
}

void rt_cuda_arena_reset(RtCuda *cu) { cu->arena_used = 0; }

bool rt_cuda_to_device(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes) {
  return CUDA_CHECK(drv.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, cu->stream[s]));
}

bool rt_cuda_pin(RtCuda *cu, void *host, size_t bytes) {
  (void)cu;
  bytes = (bytes + 4095) & ~(size_t)4095;   // whole pages (the caller's memory is)
  return bytes > 0 && drv.cuMemHostRegister(host, bytes, 0) == CUDA_SUCCESS;   // refused: stays pageable
}

void rt_cuda_unpin(RtCuda *cu, void *host) {
  (void)cu;
  drv.cuMemHostUnregister(host);
}

bool rt_cuda_to_host(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes) {
  return CUDA_CHECK(drv.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, cu->stream[s]));
}

bool rt_cuda_zero(RtCuda *cu, RtStream s, void *dst, size_t bytes) {
  return CUDA_CHECK(drv.cuMemsetD8Async((CUdeviceptr)(uintptr_t)dst, 0, bytes, cu->stream[s]));
}

bool rt_cuda_copy(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes) {
  return CUDA_CHECK(drv.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes,
                                          cu->stream[s]));
}

// ---- streams and events ----

bool rt_cuda_sync(RtCuda *cu, RtStream s) { return CUDA_CHECK(drv.cuStreamSynchronize(cu->stream[s])); }

static bool event_index_ok(const RtCuda *cu, int event) {
  if (event >= 0 && event < cu->nevents)
    return true;
  return report("event %d does not exist (%d events)", event, cu->nevents);
}

bool rt_cuda_record(RtCuda *cu, RtStream s, int event) {
  return event_index_ok(cu, event) && CUDA_CHECK(drv.cuEventRecord(cu->events[event], cu->stream[s]));
}

bool rt_cuda_wait(RtCuda *cu, RtStream s, int event) {
  return event_index_ok(cu, event) && CUDA_CHECK(drv.cuStreamWaitEvent(cu->stream[s], cu->events[event], 0));
}

// ---- kernels ----

bool rt_cuda_load_module(RtCuda *cu, const void *image) {
  if (cu->module) {
    CUmodule old = cu->module;
    cu->module = NULL;
    if (!CUDA_CHECK(drv.cuModuleUnload(old)))
      return false;
  }
  char log[8192] = "";
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *values[] = {log, (void *)(uintptr_t)sizeof log};
  CUresult rc = drv.cuModuleLoadDataEx(&cu->module, image, 2, options, values);
  if (rc == CUDA_SUCCESS)
    return true;
  cu->module = NULL;
  cuda_ok(rc, "cuModuleLoadDataEx", __FILE__, __LINE__);
  if (log[0])
    report("the driver's JIT log:\n%s", log);
  return false;
}

CUfunction rt_cuda_load_wg(RtCuda *cu, const void *image, int n) {
  if (n != 128 && n != 256) {
    report("rt_cuda_load_wg: no wgmma kernel of tiles %d wide (128 or 256)", n);
    return NULL;
  }
  if (!cu->wg_module) {
    char log[8192] = "";
    CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *values[] = {log, (void *)(uintptr_t)sizeof log};
    CUresult rc = drv.cuModuleLoadDataEx(&cu->wg_module, image, 2, options, values);
    if (rc != CUDA_SUCCESS) {
      cu->wg_module = NULL;
      cuda_ok(rc, "cuModuleLoadDataEx (mk_expert_gemm_wg's module)", __FILE__, __LINE__);
      if (log[0])
        report("the JIT log: %s", log);
      return NULL;
    }
  }
  CUfunction f = NULL;
  if (!CUDA_CHECK(drv.cuModuleGetFunction(&f, cu->wg_module, n == 256 ? "mk_expert_gemm_wg256" : "mk_expert_gemm_wg")) ||
      !CUDA_CHECK(drv.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, RT_CUDA_WG_SHARED(n))))
    return NULL;
  return f;
}

void rt_cuda_use_wg(RtCuda *cu, CUfunction wg, int n) { cu->wg = wg, cu->wg_n = n; }

CUfunction rt_cuda_kernel(RtCuda *cu, const char *name) {
  if (!cu->module) {
    report("no kernel module is loaded (looking for kernel '%s')", name);
    return NULL;
  }
  CUfunction f = NULL;
  CUresult rc = drv.cuModuleGetFunction(&f, cu->module, name);
  if (rc == CUDA_ERROR_NOT_FOUND) {
    report("the loaded kernel module has no kernel '%s'", name);
    return NULL;
  }
  return CUDA_CHECK(rc) ? f : NULL;
}

int rt_cuda_grid(int64_t n, int block) {
  int64_t grid = block > 0 ? (n + block - 1) / block : 1;
  return grid < 1 ? 1 : grid > 65535 ? 65535 : (int)grid;
}

bool rt_cuda_launch(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes,
                    void **args) {
  return CUDA_CHECK(drv.cuLaunchKernel(f, (unsigned)grid, 1, 1, (unsigned)block, 1, 1, shared_bytes, cu->stream[s],
                                       args, NULL));
}

// ---- CUDA graphs ----

bool rt_cuda_capture_begin(RtCuda *cu) {
  if (cu->capture)
    return report("rt_cuda_capture_begin: a capture is already under way");
  cu->capture = rt_calloc(1, sizeof *cu->capture, "a CUDA graph");
  if (CUDA_CHECK(drv.cuStreamBeginCapture(cu->stream[RT_STREAM_COMPUTE], CU_STREAM_CAPTURE_MODE_RELAXED)))
    return true;
  free(cu->capture);
  cu->capture = NULL;
  return false;
}

RtCudaGraph *rt_cuda_capture_end(RtCuda *cu) {
  RtCudaGraph *g = cu->capture;
  if (!g) {
    report("rt_cuda_capture_end: no capture is under way");
    return NULL;
  }
  cu->capture = NULL;
  bool ok = CUDA_CHECK(drv.cuStreamEndCapture(cu->stream[RT_STREAM_COMPUTE], &g->graph)) &&
            CUDA_CHECK(drv.cuGraphInstantiate(&g->exec, g->graph, 0));
  if (ok)
    return g;
  rt_cuda_graph_destroy(g);
  return NULL;
}

bool rt_cuda_launch_step(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes,
                         void **args) {
  if (!rt_cuda_launch(cu, s, f, grid, block, shared_bytes, args))
    return false;
  RtCudaGraph *g = cu->capture;
  if (!g)
    return true;
  // The stream's capture dependencies after a launch: the launch's own node, alone.
  CUstreamCaptureStatus status;
  const CUgraphNode *deps = NULL;
  size_t ndeps = 0;
  if (!CUDA_CHECK(drv.cuStreamGetCaptureInfo(cu->stream[s], &status, NULL, NULL, &deps, NULL, &ndeps)))
    return false;
  if (status != CU_STREAM_CAPTURE_STATUS_ACTIVE || ndeps != 1)
    return report("rt_cuda_launch_step: the launch on stream %d is not in the capture (status %d, %zu nodes)", (int)s,
                  (int)status, ndeps);
  if (g->nnodes == g->cap) {
    int cap = g->cap ? 2 * g->cap : 16;
    CUgraphNode *more = realloc(g->nodes, (size_t)cap * sizeof *more);
    if (!more)
      rt_out_of_memory((size_t)cap * sizeof *more, "a CUDA graph's nodes");
    g->nodes = more;
    g->cap = cap;
  }
  g->nodes[g->nnodes++] = deps[0];
  return true;
}

int rt_cuda_graph_step_nodes(const RtCudaGraph *g) { return g->nnodes; }

bool rt_cuda_graph_set(RtCuda *cu, RtCudaGraph *g, int node, CUfunction f, int grid, int block, unsigned shared_bytes,
                       void **args) {
  (void)cu;
  if (node < 0 || node >= g->nnodes)
    return report("rt_cuda_graph_set: node %d of a graph with %d nodes of step arguments", node, g->nnodes);
  CUDA_KERNEL_NODE_PARAMS p = {.func = f, .gridDimX = (unsigned)grid, .gridDimY = 1, .gridDimZ = 1,
                               .blockDimX = (unsigned)block, .blockDimY = 1, .blockDimZ = 1,
                               .sharedMemBytes = shared_bytes, .kernelParams = args};
  return CUDA_CHECK(drv.cuGraphExecKernelNodeSetParams(g->exec, g->nodes[node], &p));
}

bool rt_cuda_graph_launch(RtCuda *cu, RtCudaGraph *g, RtStream s) {
  return CUDA_CHECK(drv.cuGraphLaunch(g->exec, cu->stream[s]));
}

bool rt_cuda_graph_destroy(RtCudaGraph *g) {
  if (!g)
    return true;
  bool ok = true;
  if (g->exec && !CUDA_CHECK(drv.cuGraphExecDestroy(g->exec)))
    ok = false;
  if (g->graph && !CUDA_CHECK(drv.cuGraphDestroy(g->graph)))
    ok = false;
  free(g->nodes);
  free(g);
  return ok;
}

// ---- GEMMs ----

// batch GEMMs of [m, n] = op(a) op(b), row-major, blocks of m*k, k*n and m*n apart; c scaled by
// beta first (0 or 1).
static bool gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c, int batch,
                 int m, int n, int k, bool ta, bool tb, float beta) {
  if (batch <= 0 || m <= 0 || n <= 0)
    return true;
  if (k <= 0)   // no products: c stays (accumulate) or becomes 0; cuBLAS refuses ld = k = 0
    return beta != 0.0f || rt_cuda_zero(cu, s, c, (size_t)batch * m * n * sizeof *c);
  cudaDataType type = in == RT_CUDA_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  int lda = ta ? m : k, ldb = tb ? k : n;
  float alpha = 1.0f;
  return CUBLAS_CHECK(cublasSetStream(cu->blas, cu->stream[s])) &&
         CUBLAS_CHECK(cublasSetWorkspace(cu->blas, (void *)(uintptr_t)(cu->workspace + (size_t)s * WORKSPACE_BYTES),
                                         WORKSPACE_BYTES)) &&
         CUBLAS_CHECK(cublasGemmStridedBatchedEx(
             cu->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, type, ldb,
             (long long)k * n, a, type, lda, (long long)m * k, &beta, c, CUDA_R_32F, n, (long long)m * n, batch,
             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

bool rt_cuda_gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c, int m,
                  int n, int k, bool ta, bool tb, bool accumulate) {
  return gemm(cu, s, in, a, b, c, 1, m, n, k, ta, tb, accumulate ? 1.0f : 0.0f);
}

bool rt_cuda_expert_gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c,
                         int e, int m, int n, int k, bool ta, bool tb) {
  return gemm(cu, s, in, a, b, c, e, m, n, k, ta, tb, 0.0f);
}

// ---- expert GEMMs over their filled rows: cuBLASLt's grouped GEMM ----
// cuBLASLt 13.4 and newer multiply groups of matrices of different sizes in one call whose sizes
// it reads from device memory (CUBLASLT_BATCH_MODE_GROUPED, experimental): each group's A, B and D
// come from device arrays of pointers, and its rows, columns and leading dimension from device
// arrays of int32 (the layout's ROWS, COLS and LD arrays). The counts mk_expert_counts writes are
// such an array, so the GEMM multiplies the filled rows with no synchronisation, inside a CUDA
// graph too. The toolkit this file is built with may be older (cuBLAS 13.1 has none of it): the
// values below are cublasLt.h's of cuBLAS 13.10, and the layout's constructor is looked up in the
// cuBLASLt loaded at run time. Where it is missing, on GPUs other than compute capability 9.0,
// 10.x and 11.0 (what the mode supports), or with MOERT_CUDA_GROUPED=0, a call of bf16 operands
// runs moec's own grouped GEMM on tensor cores (mk_expert_gemm_tc, codegen/cuda/ffn.cu: the
// program hands its kernel over), and any other call, or one the heuristic finds no algorithm
// for, the padded GEMM: the same values, the rows past the counts being zero rows.
enum {
  LT_BATCH_MODE_GROUPED = 2,                                           // cublasLtBatchMode_t
  LT_LAYOUT_ROWS_ARRAY = 9, LT_LAYOUT_COLS_ARRAY = 10, LT_LAYOUT_LD_ARRAY = 11,   // cublasLtMatrixLayoutAttribute_t
  LT_PREF_AVERAGE_K = 13, LT_PREF_AVERAGE_ROWS = 14, LT_PREF_AVERAGE_COLS = 15,  // cublasLtMatmulPreferenceAttributes_t
};
typedef cublasStatus_t GroupedLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType type, int groups,
                                           const void *rows, const void *cols, const void *ld);
static GroupedLayoutCreate *grouped_layout_create;

// One call site of rt_cuda_expert_gemm_rows (a program calls each with the same operands at
// every step): its descriptors, algorithm, workspace and device table, made at its first call.
typedef struct Grouped {
  RtStream s;
  RtCudaType in;
  const void *a, *b;
  float *c;
  const int *rows;
  int e, m, n, k, blocks;
  bool ta, tb;
  bool usable;                       // false: no algorithm (or no alignment); the padded GEMM runs
  int groups;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;   // cuBLAS's A (our b), B (our a) and D = C (our c)
  cublasLtMatmulAlgo_t algo;
  CUdeviceptr table;                 // the groups' pointers (A, B, D), then the sizes that do not change
  CUdeviceptr work;                  // the call's own workspace (cuBLAS 13's advice for grouped calls)
  size_t work_bytes;
} Grouped;

// MOERT_CUDA_GROUPED, read once: 'd' unset (or an unknown value, said on stderr), '0', 'm' moec,
// 'l' cublaslt.
static char rows_env(RtCuda *cu) {
  if (!cu->rows_env) {
    const char *env = getenv("MOERT_CUDA_GROUPED");
    cu->rows_env = !env || !*env ? 'd' : strcmp(env, "0") == 0 ? '0' : strcmp(env, "moec") == 0 ? 'm'
                 : strcmp(env, "cublaslt") == 0 ? 'l' : '?';
    if (cu->rows_env == '?') {
      fprintf(stderr, "moert: MOERT_CUDA_GROUPED=%s is none of 0, moec, cublaslt: the default order runs\n", env);
      cu->rows_env = 'd';
    }
  }
  return cu->rows_env;
}

bool rt_cuda_grouped_gemms(RtCuda *cu, char *why, size_t why_size) {
  if (cu->grouped == 0) {
    int arch = cu->device.arch;
    cu->grouped = -1;
    if (rows_env(cu) == '0')
      snprintf(cu->grouped_why, sizeof cu->grouped_why, "MOERT_CUDA_GROUPED=0");
    else if (arch != 90 && arch / 10 != 10 && arch != 110)
      snprintf(cu->grouped_why, sizeof cu->grouped_why, "cuBLASLt's grouped GEMM runs on compute capability 9.0, "
               "10.x and 11.0, not on sm_%d", arch);
    else if (!(grouped_layout_create = (GroupedLayoutCreate *)dlsym(RTLD_DEFAULT, "cublasLtGroupedMatrixLayoutCreate")))
      snprintf(cu->grouped_why, sizeof cu->grouped_why, "the cuBLASLt loaded (version %zu) has no grouped GEMM "
               "(cuBLAS 13.4 and newer have)", cublasLtGetVersion());
    else if (cublasLtCreate(&cu->lt) != CUBLAS_STATUS_SUCCESS)
      snprintf(cu->grouped_why, sizeof cu->grouped_why, "cublasLtCreate failed");
    else
      cu->grouped = 1;
  }
  if (why && why_size)
    snprintf(why, why_size, "%s", cu->grouped > 0 ? "" : cu->grouped_why);
  return cu->grouped > 0;
}

static bool grouped_destroy(RtCuda *cu) {
  bool ok = true;
  for (int i = 0; i < cu->nsites; i++) {
    Grouped *g = &cu->sites[i];
    if (g->op) cublasLtMatmulDescDestroy(g->op);
    if (g->la) cublasLtMatrixLayoutDestroy(g->la);
    if (g->lb) cublasLtMatrixLayoutDestroy(g->lb);
    if (g->ld) cublasLtMatrixLayoutDestroy(g->ld);
    if (g->table && !CUDA_CHECK(drv.cuMemFree(g->table)))
      ok = false;
    if (g->work && !CUDA_CHECK(drv.cuMemFree(g->work)))
      ok = false;
  }
  free(cu->sites);
  if (cu->lt && cublasLtDestroy(cu->lt) != CUBLAS_STATUS_SUCCESS)
    ok = false;
  return ok;
}

static bool lt_set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, int32_t v) {
  return CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &v, sizeof v));
}

// The descriptors, table, algorithm and workspace of site g (its call fields set); false when a
// CUDA or cuBLAS call failed (reported). g->usable says whether a grouped call can run.
static bool grouped_setup(RtCuda *cu, Grouped *g) {
  int G = g->groups, per = (g->ta ? g->k : g->m) / g->blocks, m = g->m, n = g->n, k = g->k;
  size_t elem = g->in == RT_CUDA_BF16 ? 2 : 4;
  // Host copies: the pointers of A, B and D, then int32 sizes: A rows, cols, ld, B rows, ld, D rows, ld, cols
  size_t ptr_bytes = 3 * (size_t)G * sizeof(uint64_t), bytes = ptr_bytes + 8 * (size_t)G * sizeof(int32_t);
  unsigned char *host = rt_calloc(1, bytes, "a grouped GEMM's table");
  uint64_t *pa = (uint64_t *)host, *pb = pa + G, *pd = pb + G;
  int32_t *size = (int32_t *)(host + ptr_bytes);
  int32_t *a_rows = size, *a_cols = size + G, *a_ld = size + 2 * G, *b_rows = size + 3 * G, *b_ld = size + 4 * G;
  int32_t *d_rows = size + 5 * G, *d_ld = size + 6 * G, *d_cols = size + 7 * G;
  bool aligned = true;
  for (int x = 0; x < G; x++) {
    int i = g->ta ? x : x / g->blocks;   // the expert
    if (!g->ta) {   // D [n, count] = op(b) [n, k] x a [k, count], each group a block of an expert's slots
      pa[x] = (uint64_t)(uintptr_t)g->b + (uint64_t)i * k * n * elem;
      a_rows[x] = g->tb ? k : n, a_cols[x] = g->tb ? n : k, a_ld[x] = g->tb ? k : n;
      pb[x] = (uint64_t)(uintptr_t)g->a + (uint64_t)x * per * k * elem;
      b_rows[x] = k, b_ld[x] = k;
      pd[x] = (uint64_t)(uintptr_t)g->c + (uint64_t)x * per * n * sizeof(float);
      d_rows[x] = n, d_ld[x] = n;
    } else {        // D [n, m] = b [n, K] x a^T [K, m], K the expert's filled slots
      pa[x] = (uint64_t)(uintptr_t)g->b + (uint64_t)i * k * n * elem;
      a_rows[x] = n, a_ld[x] = n;
      pb[x] = (uint64_t)(uintptr_t)g->a + (uint64_t)i * k * m * elem;
      b_rows[x] = m, b_ld[x] = m;
      pd[x] = (uint64_t)(uintptr_t)g->c + (uint64_t)i * m * n * sizeof(float);
      d_rows[x] = n, d_ld[x] = n, d_cols[x] = m;
    }
    aligned = aligned && pa[x] % 16 == 0 && pb[x] % 16 == 0 && pd[x] % 16 == 0 && a_ld[x] * elem % 16 == 0 &&
              b_ld[x] * elem % 16 == 0 && d_ld[x] * sizeof(float) % 16 == 0;
  }
  g->usable = false;
  bool ok = CUDA_CHECK(drv.cuMemAlloc(&g->table, bytes)) &&
            CUDA_CHECK(drv.cuMemcpyHtoDAsync(g->table, host, bytes, cu->stream[g->s])) &&
            CUDA_CHECK(drv.cuStreamSynchronize(cu->stream[g->s]));
  // The counts (written on this stream before this call): their mean sizes the heuristic's choice.
  int32_t *counts = rt_alloc((size_t)G * sizeof *counts, "a grouped GEMM's counts");
  const int *count = g->ta ? g->rows + G : g->rows;   // ta: the clamped counts (mk_expert_counts)
  ok = ok && CUDA_CHECK(drv.cuMemcpyDtoHAsync(counts, (CUdeviceptr)(uintptr_t)count, (size_t)G * sizeof *counts,
                                              cu->stream[g->s])) &&
       CUDA_CHECK(drv.cuStreamSynchronize(cu->stream[g->s]));
  double mean = 0.0;
  for (int x = 0; ok && x < G; x++) mean += counts[x] / (double)G;
  free(counts);
  free(host);
  if (!ok || !aligned)
    return ok;
  CUdeviceptr t = g->table + ptr_bytes;
  const void *dev_size[8];
  for (int j = 0; j < 8; j++) dev_size[j] = (const void *)(uintptr_t)(t + (size_t)j * G * sizeof(int32_t));
  const void *cnt = (const void *)count;
  cudaDataType type = g->in == RT_CUDA_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  // !ta: B's and D's columns are the counts; ta: A's and B's columns (the K of each group)
  const void *a_cols_dev = g->ta ? cnt : dev_size[1], *b_cols_dev = cnt, *d_cols_dev = g->ta ? dev_size[7] : cnt;
  cublasStatus_t st = grouped_layout_create(&g->la, type, G, dev_size[0], a_cols_dev, dev_size[2]);
  if (st == CUBLAS_STATUS_SUCCESS) st = grouped_layout_create(&g->lb, type, G, dev_size[3], b_cols_dev, dev_size[4]);
  if (st == CUBLAS_STATUS_SUCCESS) st = grouped_layout_create(&g->ld, CUDA_R_32F, G, dev_size[5], d_cols_dev, dev_size[6]);
  if (st != CUBLAS_STATUS_SUCCESS)
    return CUBLAS_CHECK(st);
  cublasLtMatmulPreference_t pref = NULL;
  uint64_t max_work = WORKSPACE_BYTES;
  uint32_t avg_k = (uint32_t)(g->ta ? mean + 0.5 : k), avg_rows = (uint32_t)n, avg_cols = (uint32_t)(g->ta ? m : mean + 0.5);
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  ok = CUBLAS_CHECK(cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) &&
       lt_set(g->op, CUBLASLT_MATMUL_DESC_TRANSA, g->tb ? CUBLAS_OP_T : CUBLAS_OP_N) &&
       lt_set(g->op, CUBLASLT_MATMUL_DESC_TRANSB, g->ta ? CUBLAS_OP_T : CUBLAS_OP_N) &&
       CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref)) &&
       CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_work,
                                                         sizeof max_work));
  // The averages: hints only (a library that does not know them keeps its defaults)
  if (ok) {
    cublasLtMatmulPreferenceSetAttribute(pref, (cublasLtMatmulPreferenceAttributes_t)LT_PREF_AVERAGE_K, &avg_k, sizeof avg_k);
    cublasLtMatmulPreferenceSetAttribute(pref, (cublasLtMatmulPreferenceAttributes_t)LT_PREF_AVERAGE_ROWS, &avg_rows,
                                         sizeof avg_rows);
    cublasLtMatmulPreferenceSetAttribute(pref, (cublasLtMatmulPreferenceAttributes_t)LT_PREF_AVERAGE_COLS, &avg_cols,
                                         sizeof avg_cols);
  }
  if (ok && cublasLtMatmulAlgoGetHeuristic(cu->lt, g->op, g->la, g->lb, g->ld, g->ld, pref, 1, &result, &found) ==
                CUBLAS_STATUS_SUCCESS && found > 0) {
    g->algo = result.algo;
    g->work_bytes = result.workspaceSize;
    g->usable = g->work_bytes == 0 || CUDA_CHECK(drv.cuMemAlloc(&g->work, g->work_bytes));
    ok = g->work_bytes == 0 || g->work;
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  return ok;
}

// The site of this call: found, or made (NULL: none, a first call while capturing; or failed, reported).
static Grouped *grouped_site(RtCuda *cu, const Grouped *call, bool *failed) {
  for (int i = 0; i < cu->nsites; i++) {
    Grouped *g = &cu->sites[i];
    if (g->s == call->s && g->in == call->in && g->a == call->a && g->b == call->b && g->c == call->c &&
        g->rows == call->rows && g->e == call->e && g->m == call->m && g->n == call->n && g->k == call->k &&
        g->blocks == call->blocks && g->ta == call->ta && g->tb == call->tb)
      return g;
  }
  if (cu->capture)   // no heuristic and no allocation inside a capture: this call runs padded
    return NULL;
  if (cu->nsites == cu->cap_sites) {
    int cap = cu->cap_sites ? 2 * cu->cap_sites : 16;
    Grouped *more = realloc(cu->sites, (size_t)cap * sizeof *more);
    if (!more)
      rt_out_of_memory((size_t)cap * sizeof *more, "the grouped GEMMs' call sites");
    cu->sites = more, cu->cap_sites = cap;
  }
  Grouped *g = &cu->sites[cu->nsites++];
  *g = *call;
  if (grouped_setup(cu, g))
    return g;
  *failed = true;
  return NULL;
}

RtRowsGemm rt_cuda_rows_gemm(RtCuda *cu, bool tc, char *why, size_t why_size) {
  char env = rows_env(cu);
  bool lt = rt_cuda_grouped_gemms(cu, why, why_size);   // false with MOERT_CUDA_GROUPED=0
  if (env == '0')
    return RT_ROWS_PADDED;
  if (tc && env == 'm') {
    if (lt && why && why_size)
      snprintf(why, why_size, "MOERT_CUDA_GROUPED=moec");
    return RT_ROWS_MOEC;
  }
  if (lt)
    return RT_ROWS_CUBLASLT;
  return tc && env != 'l' ? RT_ROWS_MOEC : RT_ROWS_PADDED;
}

// mk_expert_gemm_tc's launch (rt_cuda_tc_grid; its tiles past a group's count return at once), or
// mk_expert_gemm_wg's in its place (rt_cuda_use_wg).
static bool tc_gemm(RtCuda *cu, RtStream s, CUfunction tc, const void *a, const void *b, float *c, int e, int m,
                    int n, int k, bool ta, bool tb, const int *rows, int blocks) {
  bool seen = false;
  for (int i = 0; i < cu->nmoec && !seen; i++) seen = cu->moec_sites[i] == c;
  if (!seen && cu->nmoec < (int)(sizeof cu->moec_sites / sizeof *cu->moec_sites))
    cu->moec_sites[cu->nmoec++] = c;
  return rt_cuda_launch_grouped(cu, s, cu->wg ? cu->wg : tc, cu->wg ? cu->wg_n : 0, a, b, c, rows, e, m, n, k, ta,
                                tb, blocks);
}

bool rt_cuda_expert_gemm_rows(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c,
                              int e, int m, int n, int k, bool ta, bool tb, const int *rows, int blocks, CUfunction tc) {
  int slots = ta ? k : m;
  if (e <= 0 || m <= 0 || n <= 0 || k <= 0 || blocks < 1 || slots % blocks || (ta && (tb || blocks != 1)))
    return gemm(cu, s, in, a, b, c, e, m, n, k, ta, tb, 0.0f);
  RtRowsGemm path = rt_cuda_rows_gemm(cu, tc && in == RT_CUDA_BF16, NULL, 0);
  if (path == RT_ROWS_MOEC && rt_cuda_tc_fits(in, a, b, m, n, k, ta, tb))
    return tc_gemm(cu, s, tc, a, b, c, e, m, n, k, ta, tb, rows, blocks);
  if (path == RT_ROWS_PADDED || !rt_cuda_grouped_gemms(cu, NULL, 0))
    return gemm(cu, s, in, a, b, c, e, m, n, k, ta, tb, 0.0f);
  Grouped call = {.s = s, .in = in, .a = a, .b = b, .c = c, .rows = rows, .e = e, .m = m, .n = n, .k = k,
                  .blocks = blocks, .ta = ta, .tb = tb, .groups = ta ? e : e * blocks};
  bool failed = false;
  Grouped *g = grouped_site(cu, &call, &failed);
  if (failed)
    return false;
  if (!g || !g->usable)
    return gemm(cu, s, in, a, b, c, e, m, n, k, ta, tb, 0.0f);
  float alpha = 1.0f, beta = 0.0f;
  int G = g->groups;
  const void *pa = (const void *)(uintptr_t)g->table, *pb = (const void *)(uintptr_t)(g->table + (size_t)G * 8),
             *pd = (const void *)(uintptr_t)(g->table + 2 * (size_t)G * 8);
  return CUBLAS_CHECK(cublasLtMatmul(cu->lt, g->op, &alpha, pa, g->la, pb, g->lb, &beta, pd, g->ld, (void *)pd, g->ld,
                                     &g->algo, (void *)(uintptr_t)g->work, g->work_bytes, cu->stream[s]));
}

int rt_cuda_grouped_sites(const RtCuda *cu, int *padded, int *moec) {
  int n = 0, p = 0;
  for (int i = 0; i < cu->nsites; i++) cu->sites[i].usable ? n++ : p++;
  if (padded)
    *padded = p;
  if (moec)
    *moec = cu->nmoec;
  return n;
}


// ---- collectives ----

struct RtNccl {
  ncclComm_t comm;
  int ranks;
};

RtNccl *rt_cuda_nccl_create(MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  // Rank 0 sends whether it got an id along with it, so that every rank gives up together when
  // it did not (instead of waiting in ncclCommInitRank for a rank 0 that never comes).
  struct {
    int ok;
    ncclUniqueId id;
  } root;
  memset(&root, 0, sizeof root);
  if (rank == 0)
    root.ok = NCCL_CHECK(ncclGetUniqueId(&root.id));
  MPI_CHECK(MPI_Bcast(&root, (int)sizeof root, MPI_BYTE, 0, comm));
  if (!root.ok) {
    if (rank != 0)
      report("rank 0 could not make an NCCL unique id (its error is in its output)");
    return NULL;
  }
  RtNccl *nc = rt_calloc(1, sizeof *nc, "an NCCL communicator");
  nc->ranks = size;
  if (!NCCL_CHECK(ncclCommInitRank(&nc->comm, size, root.id, rank))) {
    free(nc);
    return NULL;
  }
  return nc;
}

RtNccl *rt_cuda_nccl_group(RtComm *c, RtGroup g) {
  MPI_Comm comm = rt_comm_mpi(c, g);
  if (comm == MPI_COMM_NULL) {
    report("no communicator for parallel group %d: the program made no communicators (rt_comm_create)", (int)g);
    return NULL;
  }
  return rt_cuda_nccl_create(comm);
}

bool rt_cuda_nccl_destroy(RtNccl *nc) {
  if (!nc)
    return true;
  bool ok = NCCL_CHECK(ncclCommDestroy(nc->comm));
  free(nc);
  return ok;
}

bool rt_cuda_allreduce(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  return NCCL_CHECK(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, nc->comm, cu->stream[s]));
}

bool rt_cuda_allgather(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  return NCCL_CHECK(ncclAllGather(send, recv, count, ncclFloat, nc->comm, cu->stream[s]));
}

bool rt_cuda_reducescatter(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  return NCCL_CHECK(ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, nc->comm, cu->stream[s]));
}

// One grouped send and receive per peer (NCCL runs a group as one collective).
bool rt_cuda_alltoall(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count) {
  if (!NCCL_CHECK(ncclGroupStart()))
    return false;
  bool ok = true;
  for (int peer = 0; ok && peer < nc->ranks; peer++)
    ok = NCCL_CHECK(ncclSend(send + (size_t)peer * count, count, ncclFloat, peer, nc->comm, cu->stream[s])) &&
         NCCL_CHECK(ncclRecv(recv + (size_t)peer * count, count, ncclFloat, peer, nc->comm, cu->stream[s]));
  return NCCL_CHECK(ncclGroupEnd()) && ok;   // the group is closed even after a failed call
}
