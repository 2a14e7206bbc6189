// The CUDA backend's runtime (issue 7): one GPU per process (the local rank's), through the
// driver API; GEMMs through cuBLAS; collectives through NCCL with communicators bootstrapped
// over MPI.
//
// RtCuda holds what a training step on the GPU needs: the device's primary context, three
// streams (RtStream of moert.h: compute, intra, inter), events between them by index as the
// scheduler numbers them, one arena of device memory that buffers are carved from, the module
// of the model's kernels (NVRTC's CUBIN or PTX, codegen/nvrtc.c) and a cuBLAS handle.
//
// Device pointers are void * (what cuBLAS and NCCL take). Copies, launches, GEMMs and
// collectives are asynchronous on the stream they are given; rt_cuda_sync waits for one.
//
// The driver, libcuda.so.1, is loaded at run time (dlopen), not linked: a binary built with
// this runtime starts on a machine without an NVIDIA driver, where rt_cuda_probe says why no GPU
// can be used. cuBLAS, NCCL and MPI are linked as usual.
//
// Errors: every CUDA, cuBLAS, NCCL and MPI call is checked. A failure is reported on stderr as
// "moert: error: rank R on HOST: CALL failed: NAME (DESCRIPTION) at FILE:LINE" and the function
// returns false (NULL); nothing is retried or ignored. Host memory running out ends the job, as
// everywhere in the runtime (rt_alloc). Not thread-safe: one host thread drives an RtCuda (the
// streams give the concurrency).
#ifndef RT_CUDA_H
#define RT_CUDA_H

#include <cuda.h>
#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert.h"

typedef struct RtCuda RtCuda;
typedef struct RtNccl RtNccl;   // an NCCL communicator

typedef struct RtCudaDevice {
  char name[256];            // "NVIDIA H100 80GB HBM3"
  int arch;                  // compute capability major*10 + minor: 90 for sm_90
  int driver_version;        // cuDriverGetVersion: 13000 for CUDA 13.0
  int multiprocessors;
  size_t memory_bytes;
  bool emulated;             // the fake device of the tests (tests/cuda/fake_cuda.cpp): host memory
} RtCudaDevice;

// Element type of GEMM inputs (the output and the accumulation are fp32).
typedef enum RtCudaType { RT_CUDA_F32, RT_CUDA_BF16 } RtCudaType;

// ---- the device ----
// Whether a GPU can be used: the driver loads, cuInit succeeds and device 0 exists. False with
// the reason in why (the driver's error, or "libcuda.so.1: cannot open shared object file ...").
// Nothing is printed: no GPU is a normal outcome for the caller to report.
bool rt_cuda_probe(char *why, size_t why_size);
// The primary context of this process's device, made current on this thread; the three
// streams, nevents events, a cuBLAS handle and an arena of arena_bytes of device memory. The
// device is the local rank's (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID,
// modulo the devices visible; 0 for a process started without a launcher), so that the ranks
// of a node take one GPU each. NULL (reported) on failure, no GPU included: a caller that
// treats no GPU as normal asks rt_cuda_probe first.
RtCuda *rt_cuda_create(size_t arena_bytes, int nevents);
// Releases everything rt_cuda_create made and the loaded module. False when a release failed
// (reported; the rest is still released).
bool rt_cuda_destroy(RtCuda *cu);
const RtCudaDevice *rt_cuda_device(const RtCuda *cu);

// ---- device memory: one arena, bump allocation ----
// bytes of the arena, 256-byte aligned; NULL (reported) when the arena cannot hold them.
void *rt_cuda_alloc(RtCuda *cu, size_t bytes);
// Every allocation made since rt_cuda_create (or the last reset) is free again.
void rt_cuda_arena_reset(RtCuda *cu);
// Page-locks host memory that is copied every step (the step's input and target), so that
// rt_cuda_to_device moves it at the bus's speed; false when the driver refuses (the copies then
// go from pageable memory, as before). host is page-aligned and owns the pages that bytes, rounded
// up to whole pages, reaches. rt_cuda_unpin undoes it before the memory is freed.
bool rt_cuda_pin(RtCuda *cu, void *host, size_t bytes);
void rt_cuda_unpin(RtCuda *cu, void *host);
bool rt_cuda_to_device(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes);
bool rt_cuda_to_host(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes);
bool rt_cuda_zero(RtCuda *cu, RtStream s, void *dst, size_t bytes);
// Device to device; the two ranges must not overlap.
bool rt_cuda_copy(RtCuda *cu, RtStream s, void *dst, const void *src, size_t bytes);

// ---- streams and events ----
bool rt_cuda_sync(RtCuda *cu, RtStream s);                  // waits for everything queued on s
bool rt_cuda_record(RtCuda *cu, RtStream s, int event);     // event: 0 .. nevents-1
bool rt_cuda_wait(RtCuda *cu, RtStream s, int event);       // later work on s waits for the event

// ---- kernels ----
// Loads a CUBIN or PTX image (PTX is compiled for this GPU by the driver) as the module that
// rt_cuda_kernel looks kernels up in, replacing the module loaded before. The driver's JIT log
// is part of the report when loading fails.
bool rt_cuda_load_module(RtCuda *cu, const void *image);
// The kernel `name` (extern "C") of the module; NULL (reported) when there is none.
CUfunction rt_cuda_kernel(RtCuda *cu, const char *name);
// The grid for n work items of block threads each: ceil(n / block), between 1 and 65535
// (the kernels' grid-stride loops cover the rest).
int rt_cuda_grid(int64_t n, int block);
// cuLaunchKernel of f on s: args points to each parameter's value, in order; shared_bytes of
// dynamic shared memory.
bool rt_cuda_launch(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes,
                    void **args);

// ---- CUDA graphs: a step function captured once, replayed at every later step ----
// What the host issues on the compute stream between rt_cuda_capture_begin and
// rt_cuda_capture_end is recorded into a graph instead of run (relaxed capture mode): kernels,
// GEMMs, copies, collectives, and the work of the intra and inter streams that wait for an event
// recorded in the capture (they must be joined back into the compute stream, by an event it waits
// for, before the end). Nothing may be read back or waited for on the host while capturing, and
// a stream may wait only for events recorded in the same capture. The graph runs, as one launch,
// at each rt_cuda_graph_launch; the nodes of rt_cuda_launch_step calls are the ones whose
// arguments change from step to step (the step, the learning rate): rt_cuda_graph_set gives the
// i-th of them new arguments for the launches that follow.
typedef struct RtCudaGraph RtCudaGraph;
bool rt_cuda_capture_begin(RtCuda *cu);
// The instantiated graph; NULL (reported) when the capture failed (a stream left unjoined, an
// operation a capture does not allow). The capture ends either way.
RtCudaGraph *rt_cuda_capture_end(RtCuda *cu);
// rt_cuda_launch; while capturing, the node it adds is remembered as the graph's next node
// with step arguments.
bool rt_cuda_launch_step(RtCuda *cu, RtStream s, CUfunction f, int grid, int block, unsigned shared_bytes,
                         void **args);
// The number of nodes with step arguments.
int rt_cuda_graph_step_nodes(const RtCudaGraph *g);
// Node `node` (0 .. rt_cuda_graph_step_nodes - 1) launches f again with these arguments (the same
// kernel and grid it was captured with).
bool rt_cuda_graph_set(RtCuda *cu, RtCudaGraph *g, int node, CUfunction f, int grid, int block, unsigned shared_bytes,
                       void **args);
bool rt_cuda_graph_launch(RtCuda *cu, RtCudaGraph *g, RtStream s);
bool rt_cuda_graph_destroy(RtCudaGraph *g);   // NULL: nothing
// Whether the programs capture their step functions (true unless MOERT_CUDA_GRAPH=0 is set).
bool rt_cuda_graphs_wanted(void);

// ---- GEMMs (cuBLAS), row-major as the CPU runtime's rt_matmul / rt_expert_matmul ----
// c [m, n] = op(a) [m, k] * op(b) [k, n] (+ c when accumulate); ta / tb: the operand is stored
// transposed (a as [k, m], b as [n, k]). a and b are of type in, c is fp32, accumulation fp32
// (no TF32).
bool rt_cuda_gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c, int m,
                  int n, int k, bool ta, bool tb, bool accumulate);
// The same for each of e experts at once (strided batched): a holds e blocks of m*k, b e blocks
// of k*n, c [e, m, n]; c is overwritten.
bool rt_cuda_expert_gemm(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c,
                         int e, int m, int n, int k, bool ta, bool tb);
// The same over the filled slots only. The slot dimension (m, the rows of a and c, when !ta; k,
// the rows of a and b, when ta: a weight gradient) holds `blocks` blocks of slots an expert, and
// rows (device memory, mk_expert_counts's: e * blocks counts, then e * blocks counts of at least 1)
// says how many of each block's first slots are filled: with !ta only those rows of c are written
// (the caller has zeroed the others: mk_expert_counts does); with ta only they are summed (blocks
// 1). Equal to rt_cuda_expert_gemm where the rows past the counts of the operand they were counted
// from are zero. No synchronisation with the host: the counts are read on the device. Which GEMM
// runs (rt_cuda_rows_gemm): cuBLASLt's grouped GEMM where the cuBLASLt loaded has it; else, for
// bf16 operands, moec's own on tensor cores, tc (the program's mk_expert_gemm_tc; NULL: none),
// where the operands are 16-byte aligned and their contiguous dimensions multiples of 8; else
// rt_cuda_expert_gemm. A site's first call must not be inside a graph capture to run cuBLASLt's
// (it queries the heuristic).
bool rt_cuda_expert_gemm_rows(RtCuda *cu, RtStream s, RtCudaType in, const void *a, const void *b, float *c,
                              int e, int m, int n, int k, bool ta, bool tb, const int *rows, int blocks, CUfunction tc);
// The GEMMs rt_cuda_expert_gemm_rows runs, by MOERT_CUDA_GROUPED (unset: the first that this device
// has of cuBLASLt's grouped GEMM, then moec's for bf16; 0: the padded GEMM; cublaslt: never moec's;
// moec: moec's for bf16, before cuBLASLt's).
typedef enum {
  RT_ROWS_PADDED,     // rt_cuda_expert_gemm over every slot (the rows past the counts are zero rows)
  RT_ROWS_CUBLASLT,   // cuBLASLt's grouped GEMM
  RT_ROWS_MOEC,       // moec's grouped GEMM on tensor cores (mk_expert_gemm_tc)
} RtRowsGemm;
// Which of them runs a call of bf16 operands with moec's kernel (tc true) or any other (tc false);
// into why: why not cuBLASLt's, when it is not (a sentence), else "".
RtRowsGemm rt_cuda_rows_gemm(RtCuda *cu, bool tc, char *why, size_t why_size);
// moec's grouped GEMM (mk_expert_gemm_tc), as rt_cuda_expert_gemm_rows launches it (the fake device
// too): whether it takes these operands (bf16, a and b 16-byte aligned, each one's contiguous
// dimension a multiple of 8: a 16-byte copy is then in its tile or out whole), and its grid of
// 128-thread blocks, one per 128 x 128 tile of c of every group (at most 65535: it strides over
// the rest).
static inline bool rt_cuda_tc_fits(RtCudaType in, const void *a, const void *b, int m, int n, int k, bool ta, bool tb) {
  return in == RT_CUDA_BF16 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0 && (ta ? m : k) % 8 == 0 &&
         (tb ? k : n) % 8 == 0;
}
static inline int rt_cuda_tc_grid(int e, int m, int n, bool ta, int blocks) {
  int64_t groups = ta ? e : (int64_t)e * blocks, per = ta ? m : m / blocks;
  int64_t tiles = groups * ((per + 127) / 128) * ((n + 127) / 128);
  return tiles < 65535 ? (int)tiles : 65535;
}
// moec's grouped GEMM on Hopper's warpgroup MMA (mk_expert_gemm_wg on tiles of 128 x 128,
// mk_expert_gemm_wg256 on 128 x 256: codegen/cuda/ffn.cu): the same parameters, operands and grid
// as mk_expert_gemm_tc, 256 threads and RT_CUDA_WG_SHARED(n) bytes of dynamic shared memory for
// tiles n wide (ffn.cu's MK_WG_SHARED: four steps' buffers of both operands and 1024 bytes to
// align them). rt_cuda_load_wg loads image (a CUBIN for sm_90a that holds them) as a second module
// (once) and returns the kernel of tiles n wide, allowed that much shared memory, or NULL
// (reported). Once rt_cuda_use_wg has set it, rt_cuda_expert_gemm_rows launches it wherever it
// would launch tc (NULL: tc again). The session (session.c) sets it only after it agreed with tc.
#define RT_CUDA_WG_SHARED(n) (4 * (16384 + (n) * 128) + 1024)
CUfunction rt_cuda_load_wg(RtCuda *cu, const void *image, int n);
void rt_cuda_use_wg(RtCuda *cu, CUfunction wg, int n);
// One launch of moec's grouped GEMM f on s with mk_expert_gemm_tc's parameters: wn 0 for tc
// itself (128 threads), else the wgmma kernel of tiles wn wide (256 threads, its shared memory).
// The one place that knows the kernels' launch geometry (rt_cuda.c, the fake device, session.c).
static inline bool rt_cuda_launch_grouped(RtCuda *cu, RtStream s, CUfunction f, int wn, const void *a, const void *b,
                                          float *c, const int *rows, int e, int m, int n, int k, bool ta, bool tb,
                                          int blocks) {
  int ta_i = ta, tb_i = tb;
  void *args[] = {&a, &b, &c, &rows, &e, &m, &n, &k, &ta_i, &tb_i, &blocks};
  return rt_cuda_launch(cu, s, f, rt_cuda_tc_grid(e, m, n, ta, blocks), wn ? 256 : 128,
                        wn ? RT_CUDA_WG_SHARED(wn) : 0, args);
}
// Where moec's grouped GEMM runs (runtime/cuda/session.c): the wgmma kernel of image (a CUBIN of
// cg_nvrtc_wg_cubin) in tc's place, when the GPU is sm_90, MOERT_CUDA_WGMMA is not 0, the kernel of
// MOERT_CUDA_WG_N's tiles (128, unset, or 256) loads and it agrees with tc on random operands in
// the three forms the programs use: rt_cuda_use_wg'd, *wn its width. Else false and tc stays, with
// the reason in why. The check borrows RT_CUDA_WG_CHECK_BYTES of the arena past its first `keep`
// bytes (a program's block), which it leaves where they were; the rest of the arena is reset.
// A program and moec tune --target cuda call it alike, so tune times the kernel programs run.
enum { RT_CUDA_WG_CHECK_BYTES = 1 << 20 };
bool rt_cuda_wg_start(RtCuda *cu, const void *image, CUfunction tc, size_t keep, int *wn, char *why, size_t why_size);
// Whether cuBLASLt's grouped GEMM is there (and not turned off); into why, why not.
bool rt_cuda_grouped_gemms(RtCuda *cu, char *why, size_t why_size);
// The call sites of rt_cuda_expert_gemm_rows met so far that run cuBLASLt's grouped GEMM; *padded: those
// that run the padded GEMM (the heuristic found no algorithm for them, or their operands are not
// 16-byte aligned); *moec: those that run moec's (NULL: not asked).
int rt_cuda_grouped_sites(const RtCuda *cu, int *padded, int *moec);

// ---- collectives (NCCL), fp32 ----
// A communicator over the ranks of comm, collectively: rank 0 makes the unique id, MPI_Bcast
// hands it out, every rank calls ncclCommInitRank with its rank in comm. The GPU is the current
// context's (this process's device 0: one GPU per rank). NULL (reported) when NCCL fails; a
// failed MPI call ends the job (MPI_CHECK, rt_mpi.h).
RtNccl *rt_cuda_nccl_create(MPI_Comm comm);
// The communicator of parallel group g of comm (runtime/comm.c's, which rt_comm_create made):
// collective over the group's members.
RtNccl *rt_cuda_nccl_group(RtComm *comm, RtGroup g);
bool rt_cuda_nccl_destroy(RtNccl *nc);
// Sum over the ranks; send == recv is in place.
bool rt_cuda_allreduce(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count);
// recv [ranks, count] = every rank's send [count], in rank order.
bool rt_cuda_allgather(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count);
// recv [count] = block `rank` of the sum over ranks of send [ranks, count].
bool rt_cuda_reducescatter(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count);
// Block i of send (count floats) goes to rank i; block i of recv comes from rank i.
bool rt_cuda_alltoall(RtCuda *cu, RtNccl *nc, RtStream s, const float *send, float *recv, size_t count);

// ---- the device of a CUDA target program (session.c) ----
// What a program that moec built for the CUDA target knows of itself; its RtDevice hooks
// (moert.h) forward to rt_cuda_session_*. Device memory is one block: parameters at offset 0
// (param_floats floats), gradients and AdamW moments at their byte offsets; the program carves
// the rest itself.
typedef struct RtCudaProgram {
  const unsigned char *cubin;        // NVRTC's CUBIN for sm_<cubin_arch> (NULL: none, MOEC_CUDA_IMAGES=ptx)
  int cubin_arch;                    // 90 for sm_90
  const char *ptx;                   // the PTX of compute_<cubin_arch>, which newer GPUs compile
  const char *const *kernel_names;   // the kernels the steps launch, in the program's order
  int nkernels;
  size_t device_bytes;               // the whole block
  int events;
  size_t param_floats;
  size_t grad_floats;                // the gradients' and each moment's (the trained parameters')
  size_t off_grads, off_m, off_v;    // bytes; the moments only when moments is true
  bool moments;
  size_t stage_bytes;                // the host twin of the program's statistics staging area
  size_t output_floats;              // the model's output, [batch, seqlen, embed]
  size_t input_bytes;                // the step's input (and its target), copied to the GPU every step
  bool nccl[RT_GROUP_COUNT];         // groups whose collectives cross ranks: a communicator each
  const char *note;                  // ends the device's description (NULL: nothing)
  int row_gemms;                     // expert GEMMs over their filled rows a step (rt_cuda_expert_gemm_rows)
  const unsigned char *wg_cubin;     // mk_expert_gemm_wg compiled for sm_90a (NULL: none; runs on sm_90 only)
} RtCudaProgram;

// What rt_cuda_session_create made; the program's step functions use these.
enum { RT_CUDA_PINNED_MAX = 64 };
typedef struct RtCudaSession {
  const RtCudaProgram *program;
  RtCuda *cu;
  CUfunction *kernels;               // program->nkernels, looked up by kernel_names
  unsigned char *device;             // the block, zeroed
  unsigned char *stage;              // host memory, program->stage_bytes
  float *output;                     // host memory, program->output_floats
  const void *device_output;         // set by the program: where its forward leaves the output
  RtNccl *nccl[RT_GROUP_COUNT];      // made by rt_cuda_session_connect (NULL for other groups)
  char description[1024];            // the GPU, which image of the kernels it runs, its memory
  // Host memory page-locked for the copies of every step: the trainer's inputs and targets (each
  // microbatch slot's), at their first upload or use, and the host buffers the session allocated
  // (host_buffer: owned, freed at destroy).
  void *pinned[RT_CUDA_PINNED_MAX];
  int npinned;
  void *owned[RT_CUDA_PINNED_MAX];
  int nowned;
} RtCudaSession;

// RtDevice.create: claims the GPU (NULL with the reason recorded by rt_fail when there is none
// or it is older than cubin_arch), loads the CUBIN on its own architecture or the PTX on a
// newer one, looks the kernels up, allocates and clears the block. On failure nothing is left.
RtCudaSession *rt_cuda_session_create(const RtCudaProgram *p);
// RtDevice.connect: collective; the NCCL communicators of the program's groups over comm.
int rt_cuda_session_connect(RtCudaSession *s, RtComm *comm);
// RtDevice.upload / download (RtDeviceData bits); 0, or -1 with the reason recorded (rt_fail).
int rt_cuda_session_upload(RtCudaSession *s, const RtStep *st, unsigned what);
int rt_cuda_session_download(RtCudaSession *s, RtStep *st, unsigned what);
void rt_cuda_session_destroy(RtCudaSession *s);    // NULL: nothing
// Microbatches and pipeline stages (RtDevice.use_slot, .grads_part): st->input and st->target
// page-locked when they are not yet (a slot's; beyond RT_CUDA_PINNED_MAX they stay pageable); host
// memory of bytes, page-locked where the driver lets it, that the session frees (a stage's
// messages); st->grads[offset, offset + n) from the device or to it, waited for (0, or -1 with
// the reason recorded).
void rt_cuda_session_pin_data(RtCudaSession *s, const RtStep *st);
float *rt_cuda_session_host_buffer(RtCudaSession *s, size_t bytes);
int rt_cuda_session_grads_part(RtCudaSession *s, RtStep *st, size_t offset, int64_t n, bool to_device);

#endif
