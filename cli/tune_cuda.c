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
// GRID_MACS_FAKE. The element-wise, attention and update kernels are the CUDA programs' own
// (codegen/cuda/*.cu, the library every program's kernel unit holds), compiled by NVRTC for the
// rank's GPU when the engine opens (through moec's build cache) and launched as a program
// launches them (MK_BLOCK threads a block, its grids): the copy and the add (`elementwise`), the
// GELU (`elementwise_math`), AdamW and SGD (with --dtype bf16 the kernels that also write the
// parameters' bf16 copy, as a bf16 program's update does) over 2^19 .. 2^26 floats (the CPU's
// sizes times 8: below, a GPU's kernels are launch-bound), and the causal attention's forward and
// backward over 8, 16, 32, 64 windows (with --dtype bf16 and heads a multiple of 16 up to 128, the
// tensor-core kernels mk_attn_tc_*, as a bf16 program runs them). On the fake device, whose kernels run emulated on the host,
// the sizes are 2^9 .. 2^16 floats and the attention 2 heads of 8 (bf16: 16) over windows of 16 tokens.
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
#include "codegen/cg.h"
#include "runtime/cuda/rt_cuda.h"
#include "runtime/moert.h"

#define GEMM_UNIT 134217728.0   // 2^27: the engine's GEMM size step, multiply-accumulates
// The size step this run uses: GEMM_UNIT times 8 (fp32) or 32 (bf16) on a GPU (open_gpu).
static double unit = GEMM_UNIT;
static const char *unit_text = "2^27";
static int elem_shift;          // Tune.elem_shift of this run (open_gpu), for the printed sizes
enum { GPU_REPS = 10 };         // GEMMs / collectives back to back in one timed run
#define GRID_MACS_FAKE 1048576.0  // 2^20: the grid's largest shape on the fake device (its GEMMs are the CPU's)

enum { KERNEL_BLOCK = 256 };    // MK_BLOCK: the threads of every block the CUDA programs launch
enum { GPU_ELEM_SHIFT = 3, GPU_ATTN_SHIFT = 3, FAKE_ELEM_SHIFT = -7 };   // Tune.elem_shift, attn_shift
enum { ATTN_ROWS_MOST = 16384 };   // the attention sweep's most rows on a GPU (fewer windows for long ones)

// The GPU of this rank, the GEMMs' input type, and the NCCL communicators of the groups timed.
static RtCuda *gpu;
static RtCudaType gemm_type;
static RtNccl *nccl[RT_GROUP_COUNT];

// The library's kernels the sweeps launch (NULL until the library is loaded), and the bf16
// parameter copy the bf16 updates write (in the arena with the sweep's buffers).
enum { K_COPY, K_ADD, K_GELU, K_ADAMW, K_SGD, K_ATTN_FWD, K_ATTN_STATS, K_ATTN_GRAD_Q, K_ATTN_GRAD_KV, NKERNELS };
static CUfunction kernel[NKERNELS];
static uint16_t *param16;
static void *module_image;   // the loaded CUBIN (the fake device reads it while the module lives)
static bool attn_tc;         // --dtype bf16 with heads a multiple of 16 up to 128: mk_attn_tc_* (as a bf16 program)
static CUfunction gemm_tc;   // --dtype bf16: moec's grouped GEMM (mk_expert_gemm_tc), as a bf16 program hands it over
static bool gemm_wg;           // on sm_90: the wgmma kernel runs in gemm_tc's place (rt_cuda_wg_start)
static char gemm_wg_why[256];  // gemm_wg: which kernel; else why not
static CUfunction gemm_counts;   // mk_expert_counts (_bf16 for --dtype bf16): what counts the rows before it
static char kernels_line[400];   // what the kernel sweeps launch, for rank 0's preamble

static bool launch(int k, int64_t threads, void **args) {
  return rt_cuda_launch(gpu, RT_STREAM_COMPUTE, kernel[k], rt_cuda_grid(threads, KERNEL_BLOCK), KERNEL_BLOCK, 0, args);
}

#define PTR(x) &(void *){(void *)(x)}
#define I32(x) &(int){x}
#define I64(x) &(long long){x}
#define F32(x) &(float){x}

// One call of a kernel sweep (cli/tune.c's Call, as tune_cpu.c's call reads it).
static bool call_kernels(const Call *c) {
  long long n = c->count;
  switch (c->op) {
  case OP_ELEMENTWISE:   // a copy and an add: 5 floats moved per element
    return launch(K_COPY, n, (void *[]){PTR(c->send), PTR(c->c), I64(n)}) &&
           launch(K_ADD, n, (void *[]){PTR(c->c), PTR(c->recv), PTR(c->send), I64(n)});
  case OP_MATH: return launch(K_GELU, n, (void *[]){PTR(c->send), PTR(c->c), I64(n), I64(1024)});
  // The parameters at c, the gradient at send, AdamW's moments at attn_stats and attn_grad; the
  // last argument, the bf16 copy, is read by the bf16 kernels only (a kernel takes the
  // parameters it declares).
  case OP_ADAMW:
    return launch(K_ADAMW, n, (void *[]){PTR(c->c), PTR(c->send), PTR(c->attn_stats), PTR(c->attn_grad), I64(n),
                                         F32(1e-3f), F32(0.9f), F32(0.999f), F32(1e-8f), F32(0.1f), I64(10), F32(1.0f),
                                         F32(1.0f), PTR(param16)});
  case OP_SGD:
    return launch(K_SGD, n, (void *[]){PTR(c->c), PTR(c->send), I64(n), F32(1e-3f), F32(0.1f), F32(1.0f), F32(1.0f),
                                       PTR(param16)});
  case OP_ATTENTION: {   // q a, k b, v send, o c, dy recv; m rows; n 0 forward, 1 backward
    const AttnShape *s = c->attn;
    int rows = c->m, qc = s->heads * s->d;
    int64_t threads = (int64_t)rows * s->heads * 8, kv_threads = (int64_t)rows * s->kv * 8;
    if (attn_tc) {   // a block per 128 rows of a sample and head (codegen/lower.c's attn_tc)
      int64_t tiles = (int64_t)(rows / s->seq) * ((s->seq + KERNEL_BLOCK / 2 - 1) / (KERNEL_BLOCK / 2));
      threads = tiles * s->heads * KERNEL_BLOCK, kv_threads = tiles * s->kv * KERNEL_BLOCK;
    }
    if (!c->n)
      return launch(K_ATTN_FWD, threads, (void *[]){PTR(c->a), PTR(c->b), PTR(c->send), PTR(c->c), I32(rows),
                                                     I32(s->seq), I32(s->heads), I32(s->kv), I32(qc), I32(0), F32(0.0f)});
    return launch(K_ATTN_STATS, threads, (void *[]){PTR(c->recv), PTR(c->a), PTR(c->b), PTR(c->c), PTR(c->attn_stats),
                                                     I32(rows), I32(s->seq), I32(s->heads), I32(s->kv), I32(qc), I32(0),
                                                     F32(0.0f)}) &&
           launch(K_ATTN_GRAD_Q, threads, (void *[]){PTR(c->recv), PTR(c->a), PTR(c->b), PTR(c->send),
                                                      PTR(c->attn_stats), PTR(c->attn_grad), I32(rows), I32(s->seq),
                                                      I32(s->heads), I32(s->kv), I32(qc), I32(0), F32(0.0f)}) &&
           launch(K_ATTN_GRAD_KV, kv_threads, (void *[]){PTR(c->recv), PTR(c->a), PTR(c->b), PTR(c->send),
                                                          PTR(c->attn_stats), PTR(c->attn_grad), I32(rows), I32(s->seq),
                                                          I32(s->heads), I32(s->kv), I32(qc), I32(0), F32(0.0f)});
  }
  default: return false;
  }
}

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
    case OP_SGD: ok = call_kernels(c); break;
    case OP_P2P: ok = false; break;   // skipped (open_gpu): never called
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

// The kernel sweeps' buffers in device memory (the arena, reset: the sweep before is done), and
// the bf16 parameter copy as long as the longest.
static void kernel_buffers(float *const *host, const size_t *n, int count, float **dev) {
  rt_cuda_arena_reset(gpu);
  size_t most = 0;
  for (int i = 0; i < count; i++) {
    if (!(dev[i] = rt_cuda_alloc(gpu, n[i] * sizeof(float))) ||
        !rt_cuda_to_device(gpu, RT_STREAM_COMPUTE, dev[i], host[i], n[i] * sizeof(float)))
      rt_comm_abort("moec tune: %zu floats of a kernel's operand could not be had on the GPU (the error is above)", n[i]);
    if (n[i] > most) most = n[i];
  }
  if (!(param16 = rt_cuda_alloc(gpu, most * sizeof(uint16_t))) || !rt_cuda_sync(gpu, RT_STREAM_COMPUTE))
    rt_comm_abort("moec tune: the GPU arena cannot hold the bf16 copy of %zu parameters", most);
}

// One expert GEMM over its filled rows as a program runs it: mk_expert_counts counts the filled
// rows of its operand and zeroes the result's rows past them, then rt_cuda_expert_gemm_rows
// (cuBLASLt's grouped GEMM, moec's on tensor cores for bf16, or the padded GEMM; rt_cuda_rows_gemm
// says which) multiplies them: the median of RUNS runs of GPU_REPS calls (1 on the fake device), after one call that sets the
// site up (cuBLASLt's).
static double expert_gemm(int experts, int slots, int filled, int k, int n, char *what, size_t what_size) {
  rt_cuda_arena_reset(gpu);
  size_t na = (size_t)experts * slots * k, nb = (size_t)experts * k * n;
  float *ha = tune_xmalloc(na * sizeof *ha), *hb = tune_xmalloc(nb * sizeof *hb);
  // the values of the GEMM sweeps' operands (cli/tune.c), the slots past `filled` zero
  for (size_t i = 0; i < na; i++) ha[i] = (int)(i / k % slots) < filled ? (float)((int)(i % 17) - 8) / 64 : 0.0f;
  for (size_t i = 0; i < nb; i++) hb[i] = (float)((int)(i % 13) - 6) / 64;
  const void *a = operand(ha, na), *b = operand(hb, nb);
  free(ha), free(hb);
  float *c = device_floats((size_t)experts * slots * n);
  // mk_expert_counts' counts (6 an expert; its own last two zeros between launches)
  int *counts = rt_cuda_alloc(gpu, 6 * (size_t)experts * sizeof *counts);
  if (!counts || !rt_cuda_zero(gpu, RT_STREAM_COMPUTE, counts, 6 * (size_t)experts * sizeof *counts))
    rt_comm_abort("moec tune: the expert GEMM's counts could not be had on the GPU (the error is above)");
  int part = (int)cg_rows_part(k), grid = (int)(experts * (((int64_t)slots + part - 1) / part));
  int cwidth = n;
  void *count_args[] = {(void *)&a, &counts, &c, &experts, &slots, &k, &cwidth, &part};
  CUfunction tc = gemm_type == RT_CUDA_BF16 ? gemm_tc : NULL;
  char why[256];
  RtRowsGemm path = rt_cuda_rows_gemm(gpu, tc != NULL, why, sizeof why);
  char moec_what[400];
  snprintf(moec_what, sizeof moec_what, "moec's grouped GEMM on tensor cores, %s%s", gemm_wg ? "" : "mma.sync, not wgmma: ",
           gemm_wg_why);
  snprintf(what, what_size, "%s", path == RT_ROWS_CUBLASLT ? (why[0] ? why : "cuBLASLt's grouped GEMM")
                                  : path == RT_ROWS_MOEC   ? moec_what : "the padded GEMM");
  double runs[RUNS];
  int reps = rt_cuda_device(gpu)->emulated ? 1 : GPU_REPS;   // the fake device's times say nothing
  for (int r = -1; r < RUNS; r++) {
    double t0 = MPI_Wtime();
    for (int i = 0; i < (r < 0 ? 1 : reps); i++)
      if (!rt_cuda_launch(gpu, RT_STREAM_COMPUTE, gemm_counts, grid < 65535 ? grid : 65535, KERNEL_BLOCK, 0, count_args) ||
          !rt_cuda_expert_gemm_rows(gpu, RT_STREAM_COMPUTE, gemm_type, a, b, c, experts, slots, n, k, false, false,
                                    counts, 1, tc))
        rt_comm_abort("moec tune: an expert GEMM over its filled rows failed (the error is above)");
    if (!rt_cuda_sync(gpu, RT_STREAM_COMPUTE)) rt_comm_abort("moec tune: a GPU call failed (the error is above)");
    if (r >= 0) runs[r] = (MPI_Wtime() - t0) * 1e3 / reps;
  }
  qsort(runs, RUNS, sizeof *runs, tune_compare_doubles);
  rt_cuda_arena_reset(gpu);
  return runs[RUNS / 2];
}

// Device memory the kernel sweeps take at most (kernel_buffers): the update sweep's 4 buffers or
// the attention's 7, each sweep with the bf16 copy as long as its longest buffer (the update's 2^k
// floats, the attention's dq, dk, dv), whichever is larger (with the arena's alignment).
static size_t kernel_bytes(const Tune *t) {
  size_t most = (size_t)1 << (15 + ELEM_SIZES + t->elem_shift);
  size_t sweeps = most * (4 * sizeof(float) + sizeof(uint16_t)) + 5 * 256;
  const AttnShape *a = &t->attn;
  size_t rows = (size_t)a->seq << (ATTN_SIZES - 1 + t->attn_shift), qc = (size_t)a->heads * a->d, kc = (size_t)a->kv * a->d;
  size_t attn = rows * (3 * qc + 2 * kc + 2 * (size_t)a->heads + qc + 2 * kc) * sizeof(float) +
                rows * (qc + 2 * kc) * sizeof(uint16_t) + 8 * 256;
  return sweeps > attn ? sweeps : attn;
}

// The kernel library (codegen/cuda, as every CUDA program's unit holds it) compiled by NVRTC for
// this rank's GPU (through moec's build cache: once per NVRTC version and library), loaded, and
// the kernels the sweeps launch; false with why in t->kernels_note.
static bool load_kernels(Tune *t) {
  static const char *const names[NKERNELS] = {"mk_copy", "mk_add", "mk_gelu", "mk_adamw", "mk_sgd", "mk_attn_fwd",
                                              "mk_attn_stats", "mk_attn_grad_q", "mk_attn_grad_kv"};
  char *src = NULL, *ptx = NULL, arch[16];
  size_t src_size = 0, cubin_size = 0, ptx_size = 0;
  void *cubin = NULL;
  bool cached = false;
  FILE *f = open_memstream(&src, &src_size);
  if (!f) {
    snprintf(t->kernels_note, sizeof t->kernels_note, "not measured: no memory for the kernel library's source");
    return false;
  }
  cg_emit_cuda_library(f);
  fclose(f);
  snprintf(arch, sizeof arch, "sm_%d", rt_cuda_device(gpu)->arch);
  cg_nvrtc_fast(rt_cuda_device(gpu)->emulated);   // the fake device never runs the images
  IrDiag diag;
  ir_diag_init(&diag, stderr);
  bool ok = cg_nvrtc_images_cached(&diag, src, arch, &cubin, &cubin_size, &ptx, &ptx_size, &cached) &&
            rt_cuda_load_module(gpu, cubin);
  free(src), free(ptx);
  module_image = cubin;
  // A bf16 program's attention runs on tensor cores where its heads allow (codegen/lower.c's attn_tc).
  attn_tc = gemm_type == RT_CUDA_BF16 && t->attn.d % 16 == 0 && t->attn.d <= 128;
  for (int k = 0; k < NKERNELS && ok; k++) {
    bool bf16_update = gemm_type == RT_CUDA_BF16 && (k == K_ADAMW || k == K_SGD);
    char name[40];
    if (attn_tc && k >= K_ATTN_FWD) snprintf(name, sizeof name, "mk_attn_tc_%s", names[k] + strlen("mk_attn_"));
    else snprintf(name, sizeof name, "%s%s", names[k], bf16_update ? "_bf16" : "");
    ok = (kernel[k] = rt_cuda_kernel(gpu, name)) != NULL;
  }
  if (!ok) {
    snprintf(t->kernels_note, sizeof t->kernels_note,
             "not measured: the kernel library did not compile or load for %s (the error is above); no line", arch);
    return false;
  }
  if (gemm_type == RT_CUDA_BF16 && !(gemm_tc = rt_cuda_kernel(gpu, "mk_expert_gemm_tc"))) return false;
  // On sm_90 a bf16 program runs moec's grouped GEMM on wgmma once it agreed with gemm_tc
  // (runtime/cuda/session.c's rt_cuda_wg_start): so do the sweeps, after the same check.
  if (gemm_type == RT_CUDA_BF16) {
    void *wcubin = NULL;
    size_t wcubin_size = 0;
    bool wcached = false;
    int wn = 0;
    if (rt_cuda_device(gpu)->arch != 90)   // rt_cuda_wg_start's reason, without compiling the unit
      snprintf(gemm_wg_why, sizeof gemm_wg_why, "wgmma runs on sm_90, not sm_%d", rt_cuda_device(gpu)->arch);
    else if (!cg_nvrtc_wg_cubin(&diag, true, &wcubin, &wcubin_size, &wcached))
      snprintf(gemm_wg_why, sizeof gemm_wg_why, "its unit did not compile for sm_90a (the error is above)");
    else if ((gemm_wg = rt_cuda_wg_start(gpu, wcubin, gemm_tc, 0, &wn, gemm_wg_why, sizeof gemm_wg_why)))
      snprintf(gemm_wg_why, sizeof gemm_wg_why, "%s", wn == 256 ? "wgmma on 128 x 256 tiles" : "wgmma");
    free(wcubin);   // the module loaded from it keeps its own copy
  }
  if (!(gemm_counts = rt_cuda_kernel(gpu, gemm_type == RT_CUDA_BF16 ? "mk_expert_counts_bf16" : "mk_expert_counts")))
    return false;
  const char *u = gemm_type == RT_CUDA_BF16 ? "_bf16" : "", *a = attn_tc ? "_tc" : "";
  snprintf(kernels_line, sizeof kernels_line,
           "# kernels: the CUDA programs' library, NVRTC for %s%s: elementwise mk_copy + mk_add, elementwise_math mk_gelu, "
           "update_adamw mk_adamw%s, update_sgd mk_sgd%s, attention mk_attn%s_fwd, attention_grad mk_attn%s_stats + "
           "mk_attn%s_grad_q + mk_attn%s_grad_kv (%d heads, %d kv heads of %d, windows of %d tokens%s)",
           arch, cached ? " (from the build cache)" : "", u, u, a, a, a, a, t->attn.heads, t->attn.kv, t->attn.d,
           t->attn.seq, attn_tc ? "; on tensor cores, as a bf16 program's" : "");
  return true;
}

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
  if (kernels_line[0]) printf("%s\n", kernels_line);
}

static void print_sizes(bool quick) {
  printf("# sizes: communication 2^8, 2^11, 2^14 and %s of 2^18 .. 24*2^18 floats, gemm %s of %s .. 12*%s"
         " multiply-accumulates, element-wise %s of 2^%d .. 2^%d floats%s\n",
         quick ? "4" : "all 24", quick ? "4" : "all 12", unit_text, unit_text, quick ? "4" : "all 8",
         16 + elem_shift, 23 + elem_shift, quick ? " (--quick)" : "");
}

static size_t header_sizes(char *h, size_t u, size_t size, bool quick) {
  return u + snprintf(h + u, size - u,
                      "# Sizes: communication 2^8, 2^11, 2^14 and %s x 2^18 floats, gemm %s x %s multiply-accumulates,\n"
                      "# element-wise %s 2^%d..2^%d floats;\n",
                      quick ? "4 of 1..24" : "1..24", quick ? "4 of 1..12" : "1..12", unit_text, quick ? "4 of" : "",
                      16 + elem_shift, 23 + elem_shift);
}

// Device memory for the largest GEMM (A, B of the input type, C fp32) or the two collective
// buffers, whichever is larger.
static size_t arena_bytes(const GemmShape *shapes, int nshapes, bool collectives) {
  size_t w = gemm_type == RT_CUDA_BF16 ? 2 : 4, most = 0;
  for (int i = 0; i < nshapes; i++) {
    size_t m = (size_t)tokens_for(&shapes[i], GEMM_SIZES), k = (size_t)shapes[i].k, n = (size_t)shapes[i].n;
    size_t bytes = (m * k + k * n) * w + m * n * 4 + 3 * 256;
    if (bytes > most) most = bytes;
    int filled, slots;   // the expert GEMM of expert_gemm_scale (cli/tune.c)
    tune_expert_rows(tokens_for(&shapes[i], GEMM_SIZES / 2), &filled, &slots);
    size_t e = TUNE_EXPERTS, rows = e * (size_t)slots;
    bytes = (rows * k + e * k * n) * w + rows * n * 4 + 6 * e * sizeof(int) + 4 * 256;
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
  if (world == 1)
    for (int i = S_A2A_INTRA; i <= S_AR_INTER; i++) s[i].skipped = true;
  // The GPU runtime sends its stages' messages through host memory, with no NCCL send of its own
  // yet: the profile has no p2p lines, and the planner derives them from the AlltoAll fits (manual
  // §10).
  s[S_P2P_INTRA].skipped = s[S_P2P_INTER].skipped = true;
  if (world > 1)
    snprintf(t->p2p_note, sizeof t->p2p_note, "the GPU engine does not time point-to-point messages yet (the GPU "
             "runtime's stages send theirs through host memory); the planner derives them from the alltoall fits");
  gpu = rt_cuda_create(arena_bytes(shapes, nshapes, world > 1), 1);
  if (gpu) {   // the sizes for this device, then an arena that holds them
    bool fake = rt_cuda_device(gpu)->emulated;
    if (!fake) {   // a GPU: GEMM sizes past the launch overhead
      unit = GEMM_UNIT * (gemm_type == RT_CUDA_BF16 ? 32 : 8);
      unit_text = gemm_type == RT_CUDA_BF16 ? "2^32" : "2^30";
    } else {       // emulated kernels: small sizes (their times say nothing)
      t->grid_macs = GRID_MACS_FAKE;
      t->attn = (AttnShape){2, 1, gemm_type == RT_CUDA_BF16 ? 16 : 8, 16};   // bf16: heads of 16, on tensor cores
    }
    t->elem_shift = elem_shift = fake ? FAKE_ELEM_SHIFT : GPU_ELEM_SHIFT;
    t->attn_shift = fake ? 0 : GPU_ATTN_SHIFT;
    while (t->attn_shift > 0 && ((int64_t)t->attn.seq << (ATTN_SIZES - 1 + t->attn_shift)) > ATTN_ROWS_MOST) t->attn_shift--;
    size_t gemm = arena_bytes(shapes, nshapes, world > 1), kernels = kernel_bytes(t);
    rt_cuda_destroy(gpu);
    size_t most = gemm > kernels ? gemm : kernels;   // and the wgmma kernel's check (load_kernels)
    gpu = rt_cuda_create(most > RT_CUDA_WG_CHECK_BYTES ? most : RT_CUDA_WG_CHECK_BYTES, 1);
  }
  ok = gpu != NULL;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) return false;
  ok = load_kernels(t);   // the element-wise, attention and update kernels, else their series skipped
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    for (int i = S_ELEM; i < NSERIES; i++) s[i].skipped = true;
    kernels_line[0] = '\0';
    if (ok) snprintf(t->kernels_note, sizeof t->kernels_note, "not measured: another rank's kernel library did not load; no line");
  }
  const RtCudaDevice *dev = rt_cuda_device(gpu);
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
  free(module_image);
}

// GEMM sizes of 2^27 multiply-accumulates (the shapes' scale; a GPU's sweep uses the larger unit),
// the grid of GEMM shapes, GPU_REPS calls a run on device memory, 4 GEMM sizes
// with --quick, one rank allowed (its GEMMs alone); no probes (the stream hand-off and the
// overlap are the CPU runtime's).
const TuneEngine tune_cuda_engine = {
    .name = "cuda", .gemm_unit = GEMM_UNIT, .gemm_unit_text = "2^27", .call_reps = GPU_REPS, .gemm_ring = 1,
    .quick_gemm_sizes = QUICK_SIZES, .gemm_grid = true, .min_ranks = 1,
    .tokens_for = tokens_for, .call = call, .open = open_gpu, .close = close_gpu, .gemm_operands = gemm_operands,
    .kernel_buffers = kernel_buffers, .comm_buffers = comm_buffers, .free_comm_buffers = free_comm_buffers,
    .probes = NULL, .memory = memory, .expert_gemm = expert_gemm,
    .print_device = print_device, .print_sizes = print_sizes, .header_sizes = header_sizes,
};

// build/cuda/moec-tune-cuda: what `moec tune --target cuda` runs (argv as moec's: "tune" first).
int main(int argc, char **argv) { return tune_main(&tune_cuda_engine, argc, argv); }
