// `moec tune` inside (cli/tune.c): what the engine-independent part (the sweeps, the fits, the
// profile) shares with the engines that run the timed calls, each a TuneEngine like the codegen
// targets (codegen/cg.h CgTarget):
//
//   cli/tune_cpu.c    OpenBLAS GEMMs and MPI collectives: `moec tune` itself (cli_tune)
//   cli/tune_cuda.c   cuBLAS GEMMs and NCCL collectives: build/cuda/moec-tune-cuda and
//                     moec-tune-fake (its main), linked only into the CUDA programs
//
// n (t(n) = alpha + beta * n) counts floats each rank sends/receives for the collectives and
// multiply-accumulates for the GEMMs; see cli/tune.c's opening comment.
#ifndef CLI_TUNE_H
#define CLI_TUNE_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "runtime/moert.h"
#include "sched/fit.h"

enum {
  RUNS = 5,                 // timed runs per size (after one warm-up)
  QUICK_SIZES = 4,          // sizes per sweep with --quick
  COMM_SIZES = 24,          // n = k * 2^18 floats, k = 1..24
  GEMM_SIZES = 12,          // GEMM sizes k = 1..12 (the engine's tokens_for says how many tokens)
  SMALL_SIZES = 3,          // communication: 2^8, 2^11, 2^14 floats, for the fixed cost alpha
  ELEM_SIZES = 8,           // element-wise kernels: 2^16 .. 2^23 floats
  ATTN_SIZES = 4,           // attention: 1, 2, 4, 8 windows, forward and backward
  HANDOFF_RUNS = 200,       // stream hand-offs timed (the median is kept)
  MAX_SHAPES = 32,
};
#define COMM_UNIT 262144.0  // 2^18

typedef struct TuneOptions {
  const char *output, *model;
  const char *target, *dtype;   // "cpu" / "cuda", "fp32" / "bf16" (NULL: cpu, fp32)
  bool quick, verbose;
  int gpus_per_node;            // 0: the default
} TuneOptions;

// The attention the `attention` fit times: the model's first attention layer (--model), or 8
// heads of 64 over windows of 256 tokens.
typedef struct AttnShape {
  int heads, kv, d, seq;
} AttnShape;

// One GEMM shape of an expert: C [m, n] = A [m, k] x B [k, n], m tokens.
typedef struct GemmShape {
  int k, n;
  char what[48];            // "up (x W1, W3)", ...
} GemmShape;

typedef enum BenchOp { OP_GEMM, OP_ALLTOALL, OP_ALLGATHER, OP_REDUCESCATTER, OP_ALLREDUCE, OP_ELEMENTWISE, OP_ATTENTION,
                       OP_MATH, OP_ADAMW, OP_SGD, OP_P2P } BenchOp;

// One fitted model: its points and its line.
typedef struct Series {
  const char *name;         // the .cluster field it feeds
  const char *where;        // "each-rank", "intra-node", "inter-node"
  BenchOp op;
  RtGroup group;
  int group_size;
  double x[MAX_SHAPES * GEMM_SIZES + COMM_SIZES + SMALL_SIZES], t[MAX_SHAPES * GEMM_SIZES + COMM_SIZES + SMALL_SIZES];
  int points;
  FitLine fit;
  bool ok;
  bool skipped;             // not measured: a GPU profile of one rank has no collectives
  char err[200];
} Series;

// S_A2A_INTRA .. S_P2P_INTER are the collectives and the point-to-point messages (measure_all runs
// them in that order). S_ELEM and after: kernels each rank times alone.
enum { S_GEMM, S_A2A_INTRA, S_AG_INTRA, S_RS_INTRA, S_AR_INTRA, S_A2A_INTER, S_AR_INTER, S_P2P_INTRA, S_P2P_INTER, S_ELEM,
       S_ATTN, S_ATTN_GRAD, S_MATH, S_ADAMW, S_SGD, NSERIES };
enum { NCOLLECTIVES = S_P2P_INTER - S_A2A_INTRA + 1 };

// One timed call.
typedef struct Call {
  BenchOp op;
  RtComm *comm;
  RtGroup group;
  int64_t count;            // communication: floats per member (alltoall, allgather, reducescatter) or in all
                            // (allreduce, a point-to-point message)
  int to, from;             // a point-to-point message: the world ranks it goes to and comes from
  int m, k, n;              // GEMM
  int ring;                 // GEMM: the operand sets at a, b, c a CPU call cycles through (0: GEMM_RING)
  const void *a, *b;        // fp32 (bf16 with --dtype bf16 on a GPU)
  float *c;
  float *send, *recv;
  float *attn_stats, *attn_grad;   // attention's backward; AdamW's moments (OP_ADAMW)
  const AttnShape *attn;           // attention's shape
} Call;

// What a run measures besides the series, and what the profile says of it.
typedef struct Tune {
  int rank;
  AttnShape attn;
  char gemm_engine[400];       // what computes the GEMMs, for the printed and written metadata
  int64_t memory_bytes;        // `memory`: bytes one rank may use (0: not known, no line)
  char memory_note[320];       // how it was derived (the line's comment, or why there is no line)
  char memory_host_note[400];  // a caveat for the header ("" when none)
  double handoff_ms;           // the stream hand-off round trip; -1: not measured
  double slow_compute, slow_comm;   // the overlap probe's slowdowns; -1: not measured
  double grid_macs;            // the GEMM grid's largest shape in multiply-accumulates (0: TUNE_GRID_MACS)
  // The kernels' sizes against the CPU's (the engine's open sets them): element-wise and update
  // sweeps of 2^(16+elem_shift) .. 2^(23+elem_shift) floats, attention over 2^attn_shift times
  // 1, 2, 4, 8 windows.
  int elem_shift, attn_shift;
  char kernels_note[240];      // why the element-wise, attention and update series are skipped ("" when timed)
  char p2p_note[240];          // why the point-to-point series are skipped where the collectives are not ("" when timed)
  double expert_scale;         // `expert_gemm_scale` (engine->expert_gemm against the GEMM fits); -1: not measured
  char expert_note[400];       // what it measured
} Tune;

// The GEMM grid's bounds (cli/tune.c, run_gemm_grid): a shape's multiply-accumulates and the
// floats of each of its operands.
#define TUNE_GRID_MACS 2147483648.0  // 2^31
#define TUNE_GRID_FLOATS 4194304.0   // 2^22

// Where and how the profile is measured: the nodes, this host, the MPI, the command line.
typedef struct TuneRun {
  int world, gpn, nodes;
  bool assumed;             // no --gpus-per-node: the default node shape
  int local_size;           // ranks that share rank 0's host
  int threads;              // each rank's threads (rt_threads_setup)
  long cores;
  char host[256], date[64], version[MPI_MAX_LIBRARY_VERSION_STRING], nodes_line[512], command[1024];
} TuneRun;

typedef struct TuneEngine {
  const char *name;          // "cpu", "cuda"
  double gemm_unit;          // multiply-accumulates of a GEMM size step (the default shapes' scale)
  const char *gemm_unit_text;  // "2^19"
  int call_reps;             // calls back to back in one timed run (the time is divided by it)
  int gemm_ring;             // GEMM operand sets a size cycles through (host memory is allocated for all)
  int quick_gemm_sizes;      // GEMM sizes kept with --quick
  bool gemm_grid;            // times the grid of GEMM shapes (the profile's gemm_at lines)
  bool on_cores;             // its GEMMs run on the host's cores, which the ranks' threads share
  int min_ranks;             // fewer is refused (the CPU needs 2 to time collectives)
  // Tokens m for GEMM size k (1..GEMM_SIZES) of shape s.
  int (*tokens_for)(const GemmShape *s, int k);
  // Runs c (call_reps times); aborts the run on a failure.
  void (*call)(const Call *c);
  // Opens the engine on every rank (may mark series skipped, sets t->gemm_engine); false
  // (reported) when a rank cannot. close undoes it. NULL: nothing to open or close.
  bool (*open)(Tune *t, const TuneOptions *o, RtComm *comm, Series *s, const GemmShape *shapes, int nshapes,
               int world);
  void (*close)(void);
  // The GEMM operands of cl from host a (na floats), b (nb), c (nc); NULL: the host buffers.
  void (*gemm_operands)(Call *cl, const float *a, size_t na, const float *b, size_t nb, float *c, size_t nc);
  // The kernel sweeps' buffers: dev[i] is where the engine's kernels read and write host[i]
  // (n[i] floats, copied there); the buffers of the sweep before are released. NULL: the host
  // buffers themselves.
  void (*kernel_buffers)(float *const *host, const size_t *n, int count, float **dev);
  // The collectives' send and receive buffers of n floats each, zeros; and their release.
  void (*comm_buffers)(size_t n, float **send, float **recv);
  void (*free_comm_buffers)(float *send, float *recv);
  // What the engine measures beside the series once the GEMMs and kernels are timed, where
  // there are collectives (t->handoff_ms, t->slow_*); NULL: nothing.
  void (*probes)(Tune *t, RtComm *comm, const Series *s, const GemmShape *shapes);
  // `memory` (t->memory_*), on every rank.
  void (*memory)(Tune *t, const TuneRun *r);
  // The ms of one expert GEMM over its filled rows as the engine's programs run it (the CUDA
  // programs' rt_cuda_expert_gemm_rows): [experts, slots, k] x [experts, k, n], the first `filled`
  // slots of each expert filled, the rest zero; into what, which GEMM ran. NULL: none (the CPU
  // programs' expert GEMMs are its GEMMs over the filled rows, as the fits price them).
  double (*expert_gemm)(int experts, int slots, int filled, int k, int n, char *what, size_t what_size);
  // Rank 0's '#' line about its device after the MPI line; NULL: none.
  void (*print_device)(void);
  // The sizes: the preamble's '# sizes:' line, and the profile header's '# Sizes:' lines
  // (appended at h + u, size bytes in all; returns the new length).
  void (*print_sizes)(bool quick);
  size_t (*header_sizes)(char *h, size_t u, size_t size, bool quick);
} TuneEngine;

// The expert GEMM over its filled rows timed for expert_gemm_scale (cli/tune.c), for a shape whose
// GEMM of size GEMM_SIZES / 2 (its mid size) takes m tokens: TUNE_EXPERTS experts, each with an
// eighth of them filled, in slots for capacity 1.2 (rounded up to 8).
enum { TUNE_EXPERTS = 8 };
static inline void tune_expert_rows(int m, int *filled, int *slots) {
  *filled = m / TUNE_EXPERTS > 0 ? m / TUNE_EXPERTS : 1;
  *slots = (*filled + (*filled + 4) / 5 + 7) / 8 * 8;   // at least 1.2 x filled
}

extern const TuneEngine tune_cpu_engine;    // cli/tune_cpu.c
extern const TuneEngine tune_cuda_engine;   // cli/tune_cuda.c (the CUDA programs only)

// The command with engine e (argv as moec's: "tune" first); the exit status.
int tune_main(const TuneEngine *e, int argc, char **argv);

// Helpers of cli/tune.c the engines use.
void *tune_xmalloc(size_t bytes);                       // aborts the run when out of memory
int tune_compare_doubles(const void *a, const void *b);   // qsort, ascending

#endif
