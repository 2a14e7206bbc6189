// `moec tune --target cuda`'s engine (cli/tune.h): GPUs, one per rank. The GEMMs are
// rt_cuda_gemm (cuBLAS, fp32 or with --dtype bf16 bf16 inputs, fp32 accumulation) on device
// memory, 2^30 multiply-accumulates a size step in fp32 and 2^32 in bf16 on a GPU (2^27 on the
// tests' fake device; the paper's expert M = 1024, H = 4096 unscaled: 256..3072 and 1024..12288
// tokens; at 2^27, 32..384 tokens, an H200's GEMMs were launch-bound and the bf16 fit was a
// constant, r2 0.01, predicting a step 75x too short), each run GPU_REPS GEMMs back to back on
// the compute stream and a synchronisation, divided by GPU_REPS; the collectives are NCCL's on the intra-node and
// inter-node groups, timed the same way. One rank (one GPU) is allowed: it times the GEMMs only
// (the collectives are skipped). The grid of GEMM shapes (the profile's gemm_at lines, cli/tune.c)
// is timed as on the CPU, GPU_REPS GEMMs a call, on one operand set (a GPU has no cache to keep
// them out of that matters at these sizes); on the fake device only its shapes up to
// GRID_MACS_FAKE. The element-wise, attention and update kernels are not timed on a GPU yet.
// `memory` is the smallest total memory of the ranks' GPUs (cuDeviceTotalMem).
//
// Built only into the CUDA programs (the Makefile): build/cuda/moec-tune-cuda, linked with the
// GPU runtime, cuBLAS and NCCL (which moec itself does not load; moec tune --target cuda runs it
// in its own place), and build/cuda/moec-tune-fake, the same program on the fake device
// (MOEC_CUDA_FAKE=1, tests/tune.sh). Its main runs the sweep of cli/tune.c with this engine.
#include <mpi.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/tune.h"
#include "runtime/cuda/rt_cuda.h"
#include "runtime/moert.h"

#define GEMM_UNIT 134217728.0   // 2^27: the engine's GEMM size step, multiply-accumulates
// The size step this run uses: GEMM_UNIT times 8 (fp32) or 32 (bf16) on a GPU (open_gpu).
static double unit = GEMM_UNIT;
static const char *unit_text = "2^27";
enum { GPU_REPS = 10 };         // GEMMs / collectives back to back in one timed run
#define GRID_MACS_FAKE 1048576.0  // 2^20: the grid's largest shape on the fake device (its GEMMs are the CPU's)

// The GPU of this rank, the GEMMs' input type, and the NCCL communicators of the groups timed.
static RtCuda *gpu;
static RtCudaType gemm_type;
static RtNccl *nccl[RT_GROUP_COUNT];

// GPU_REPS of the call back to back on the compute stream, then a synchronisation.
static void call(const Call *c) {
  bool ok = true;
  for (int r = 0; r < GPU_REPS && ok; r++) {
    switch (c->op) {
    case OP_GEMM:
      ok = rt_cuda_gemm(gpu, RT_STREAM_COMPUTE, gemm_type, c->a, c->b, c->c, c->m, c->n, c->k, false, false, false);
      break;
    case OP_ALLTOALL: ok = rt_cuda_alltoall(gpu, nccl[c->group], RT_STREAM_COMPUTE, c->send, c->recv, c->count); break;
    case OP_ALLGATHER: ok = rt_cuda_allgather(gpu, nccl[c->group], RT_STREAM_COMPUTE, c->send, c->recv, c->count); break;
    case OP_REDUCESCATTER:
      ok = rt_cuda_reducescatter(gpu, nccl[c->group], RT_STREAM_COMPUTE, c->send, c->recv, c->count);
      break;
    case OP_ALLREDUCE: ok = rt_cuda_allreduce(gpu, nccl[c->group], RT_STREAM_COMPUTE, c->send, c->send, c->count); break;
    case OP_ELEMENTWISE:
    case OP_ATTENTION:
    case OP_MATH:
    case OP_ADAMW:
    case OP_SGD: break;   // not timed on a GPU (open_gpu skips them)
    }
  }
  if (!ok || !rt_cuda_sync(gpu, RT_STREAM_COMPUTE)) rt_comm_abort("moec tune: a GPU call failed (the error is above)");
}

// Tokens for GEMM size k * unit (k = 1..12): m*K*N as close to it as whole tokens allow, and at
// least k tokens so that the sizes stay distinct when one token is already bigger than the unit.
static int tokens_for(const GemmShape *s, int k) {
  double per_token = (double)s->k * s->n;
  long m = lround(k * unit / per_token);
  return (int)(m < k ? k : m);
}

// Round to nearest even on the bits, as the CUDA target's mk_compress_bf16.
static uint16_t to_bf16(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   // NaN stays NaN
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// n floats of host memory as a GEMM operand in device memory (of the GEMMs' input type).
static void *operand(const float *host, size_t n) {
  size_t width = gemm_type == RT_CUDA_BF16 ? 2 : 4;
  void *staged = (void *)host, *dev = rt_cuda_alloc(gpu, n * width);
  if (!dev) rt_comm_abort("moec tune: the GPU arena cannot hold a GEMM operand of %zu elements", n);
  if (gemm_type == RT_CUDA_BF16) {
    uint16_t *h = tune_xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = to_bf16(host[i]);
    staged = h;
  }
  if (!rt_cuda_to_device(gpu, RT_STREAM_COMPUTE, dev, staged, n * width) || !rt_cuda_sync(gpu, RT_STREAM_COMPUTE))
    rt_comm_abort("moec tune: copying a GEMM operand to the GPU failed (the error is above)");
  if (staged != host) free(staged);
  return dev;
}

static float *device_floats(size_t n) {
  float *dev = rt_cuda_alloc(gpu, n * sizeof(float));
  if (!dev || !rt_cuda_zero(gpu, RT_STREAM_COMPUTE, dev, n * sizeof(float)) || !rt_cuda_sync(gpu, RT_STREAM_COMPUTE))
    rt_comm_abort("moec tune: %zu floats of GPU memory could not be had (the error is above)", n);
  return dev;
}

// The GEMM operands in device memory (the arena, reset before): A and B of the input type, C.
static void gemm_operands(Call *cl, const float *a, size_t na, const float *b, size_t nb, float *c, size_t nc) {
  (void)c;
  rt_cuda_arena_reset(gpu);
  cl->a = operand(a, na);
  cl->b = operand(b, nb);
  cl->c = device_floats(nc);
}

// The collectives' buffers in device memory (the arena: the GEMMs' operands are done with).
static void comm_buffers(size_t n, float **send, float **recv) {
  rt_cuda_arena_reset(gpu);
  *send = device_floats(n);
  *recv = device_floats(n);
}

static void free_comm_buffers(float *send, float *recv) { (void)send, (void)recv; }   // the arena's

// `memory`: the smallest total memory of the ranks' GPUs (cuDeviceTotalMem, one GPU per rank).
static void memory(Tune *t, const TuneRun *r) {
  long long mine = gpu ? (long long)rt_cuda_device(gpu)->memory_bytes : -1, least;
  MPI_Allreduce(&mine, &least, 1, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  t->memory_host_note[0] = '\0';
  if (least <= 0) {
    t->memory_bytes = 0;
    snprintf(t->memory_note, sizeof t->memory_note, "a rank's GPU reports no total memory");
    return;
  }
  t->memory_bytes = least;
  snprintf(t->memory_note, sizeof t->memory_note,
           "the GPU's total memory (cuDeviceTotalMem), %.2f GiB%s (rank 0's: %.200s)", least / 1073741824.0,
           r->world > 1 ? ", the smallest of the ranks' GPUs" : "", rt_cuda_device(gpu)->name);
}

static void print_device(void) {
  const RtCudaDevice *dev = rt_cuda_device(gpu);
  printf("# GPU of rank 0: %s, sm_%d, %d multiprocessors, %.1f GiB, driver %d\n", dev->name, dev->arch,
         dev->multiprocessors, dev->memory_bytes / 1073741824.0, dev->driver_version);
}

static void print_sizes(bool quick) {
  printf("# sizes: communication 2^8, 2^11, 2^14 and %s of 2^18 .. 24*2^18 floats, gemm %s of %s .. 12*%s"
         " multiply-accumulates%s\n",
         quick ? "4" : "all 24", quick ? "4" : "all 12", unit_text, unit_text, quick ? " (--quick)" : "");
}

static size_t header_sizes(char *h, size_t u, size_t size, bool quick) {
  return u + snprintf(h + u, size - u,
                      "# Sizes: communication 2^8, 2^11, 2^14 and %s x 2^18 floats, gemm %s x %s multiply-accumulates;\n",
                      quick ? "4 of 1..24" : "1..24", quick ? "4 of 1..12" : "1..12", unit_text);
}

// Device memory for the largest GEMM (A, B of the input type, C fp32) or the two collective
// buffers, whichever is larger.
static size_t arena_bytes(const GemmShape *shapes, int nshapes, bool collectives) {
  size_t w = gemm_type == RT_CUDA_BF16 ? 2 : 4, most = 0;
  for (int i = 0; i < nshapes; i++) {
    size_t m = (size_t)tokens_for(&shapes[i], GEMM_SIZES), k = (size_t)shapes[i].k, n = (size_t)shapes[i].n;
    size_t bytes = (m * k + k * n) * w + m * n * 4 + 3 * 256;
    if (bytes > most) most = bytes;
  }
  size_t grid = (size_t)TUNE_GRID_FLOATS * (2 * w + 4) + 3 * 256;   // the grid's operands (run_gemm_grid)
  if (grid > most) most = grid;
  size_t comm = 2 * (size_t)(COMM_SIZES * COMM_UNIT) * 4 + 2 * 256;
  return collectives && comm > most ? comm : most;
}

// This rank's GPU, its NCCL communicators for the timed groups, the GEMM engine's description;
// false (reported) when a rank has none.
static bool open_gpu(Tune *t, const TuneOptions *o, RtComm *comm, Series *s, const GemmShape *shapes, int nshapes,
                     int world) {
  char why[512] = "";
  int ok = rt_cuda_probe(why, sizeof why), all;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    if (!ok) fprintf(stderr, "moec: error: tune --target cuda: rank %d has no GPU: %s\n", t->rank, why);
    return false;
  }
  gemm_type = o->dtype && strcmp(o->dtype, "bf16") == 0 ? RT_CUDA_BF16 : RT_CUDA_F32;
  for (int i = S_ELEM; i < NSERIES; i++)   // the GPU's element-wise, attention and update kernels
    s[i].skipped = true;                   // are not timed yet: no line in the profile
  if (world == 1)
    for (int i = S_A2A_INTRA; i < NSERIES; i++) s[i].skipped = true;
  gpu = rt_cuda_create(arena_bytes(shapes, nshapes, world > 1), 1);
  if (gpu && !rt_cuda_device(gpu)->emulated) {   // a GPU: sizes past the launch overhead, a new arena
    unit = GEMM_UNIT * (gemm_type == RT_CUDA_BF16 ? 32 : 8);
    unit_text = gemm_type == RT_CUDA_BF16 ? "2^32" : "2^30";
    rt_cuda_destroy(gpu);
    gpu = rt_cuda_create(arena_bytes(shapes, nshapes, world > 1), 1);
  }
  ok = gpu != NULL;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) return false;
  const RtCudaDevice *dev = rt_cuda_device(gpu);
  if (dev->emulated) t->grid_macs = GRID_MACS_FAKE;
  snprintf(t->gemm_engine, sizeof t->gemm_engine, "cuBLAS (rt_cuda_gemm: %s inputs, fp32 accumulation, no TF32) on %s (sm_%d)",
           gemm_type == RT_CUDA_BF16 ? "bf16" : "fp32", dev->name, dev->arch);
  for (int i = S_A2A_INTRA; i < NSERIES && world > 1; i++)
    if (!nccl[s[i].group] && !(nccl[s[i].group] = rt_cuda_nccl_group(comm, s[i].group)))
      rt_comm_abort("moec tune: no NCCL communicator for the %s group (the error is above)", s[i].where);
  return true;
}

static void close_gpu(void) {
  for (int g = 0; g < RT_GROUP_COUNT; g++) rt_cuda_nccl_destroy(nccl[g]);
  if (gpu) rt_cuda_destroy(gpu);
}

// GEMM sizes of 2^27 multiply-accumulates (the shapes' scale; a GPU's sweep uses the larger unit),
// the grid of GEMM shapes, GPU_REPS calls a run on device memory, 4 GEMM sizes
// with --quick, one rank allowed (its GEMMs alone); no probes (the stream hand-off and the
// overlap are the CPU runtime's).
const TuneEngine tune_cuda_engine = {
    .name = "cuda", .gemm_unit = GEMM_UNIT, .gemm_unit_text = "2^27", .call_reps = GPU_REPS, .gemm_ring = 1,
    .quick_gemm_sizes = QUICK_SIZES, .gemm_grid = true, .min_ranks = 1,
    .tokens_for = tokens_for, .call = call, .open = open_gpu, .close = close_gpu, .gemm_operands = gemm_operands,
    .comm_buffers = comm_buffers, .free_comm_buffers = free_comm_buffers, .probes = NULL, .memory = memory,
    .print_device = print_device, .print_sizes = print_sizes, .header_sizes = header_sizes,
};

// build/cuda/moec-tune-cuda: what `moec tune --target cuda` runs (argv as moec's: "tune" first).
int main(int argc, char **argv) { return tune_main(&tune_cuda_engine, argc, argv); }
