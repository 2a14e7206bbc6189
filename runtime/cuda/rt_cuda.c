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
  X(cuModuleGetFunction) X(cuLaunchKernel) X(cuMemHostRegister) X(cuMemHostUnregister)                \
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
  CUdeviceptr arena;
  size_t arena_bytes, arena_used;
  CUdeviceptr workspace;             // cuBLAS's, WORKSPACE_BYTES per stream (no allocation while capturing)
  RtCudaGraph *capture;              // the graph being captured, or NULL
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

bool rt_cuda_destroy(RtCuda *cu) {
  if (!cu)
    return true;
  bool ok = !cu->ctx || CUDA_CHECK(drv.cuCtxSynchronize());
  if (cu->module && !CUDA_CHECK(drv.cuModuleUnload(cu->module)))
    ok = false;
  if (cu->arena && !CUDA_CHECK(drv.cuMemFree(cu->arena)))
    ok = false;
  if (cu->workspace && !CUDA_CHECK(drv.cuMemFree(cu->workspace)))
    ok = false;
  if (cu->blas && !CUBLAS_CHECK(cublasDestroy(cu->blas)))
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
