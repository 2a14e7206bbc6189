// `moec tune`: profile the machine it runs on, fit the performance models, write a .cluster.
//
//   mpirun -np P moec tune [-o F.cluster] [--quick] [--model F.moe] [--gpus-per-node G] [-v]
//
// The idea is the paper's §6.2: time the runtime's own GEMM and collectives over a range of
// sizes and fit t(n) = alpha + beta * n to each (t in ms; n in elements each rank
// sends/receives, or multiply-accumulates for a GEMM; lang/manual.md §10 and §8). The world is cut
// into nodes of G consecutive ranks (the runtime's layout with mp = esp = G), which gives the
// two groups the FSMoE schedule runs collectives on: the intra-node group (the G ranks of a
// node, the ESP group) and the inter-node group (the ranks with the same local index on every
// node, the EP group). Nine fits (the .cluster field each one is written as in brackets):
//
//   gemm                  rt_matmul in the expert shapes, [m, K] x [K, N], n = m*K*N   [gemm]
//   alltoall      intra   rt_alltoall (flat), n = floats each rank sends (and receives)  [alltoall_intra]
//   allgather     intra   rt_allgather, n = floats each rank receives (the gathered buffer)  [allgather]
//   reducescatter intra   rt_reducescatter, n = floats each rank sends (the buffer reduced)  [reducescatter]
//   allreduce     intra   rt_allreduce, n = the buffer                                  [allreduce_intra]
//   alltoall      inter   the scheduler's t_a2a                                         [alltoall]
//   allreduce     inter   rt_allreduce, n = the buffer                                  [allreduce]
//   p2p           intra   MPI_Isend to the next rank of the node while one comes from the one
//                         before, every rank at once, n = the message's floats          [p2p_intra]
//   p2p           inter   the same to the rank of this local index on the next node: what
//                         pipeline stages send each other (runtime/pipeline.c)          [p2p]
//
// Besides the fits, each engine times a grid of GEMM shapes (run_gemm_grid), written as the
// profile's `gemm_at M K N MS` lines, from which the planner prices a model's GEMMs by shape
// (sched/sched_gemm.c); `gemm` stays for profiles without them. With --model there is no grid:
// the `gemm` line measured at that model's own shapes prices it.
//
// With one rank per node there is no intra-node group: the intra-node series run on all ranks,
// allgather and reducescatter (required fields) are written from them, alltoall_intra,
// allreduce_intra and p2p_intra are not (they would not describe a node). `memory` is what one rank may use:
// on the CPU the smallest MemTotal (/proc/meminfo) of the ranks' hosts divided by the ranks per
// node (gpus_per_node), on a GPU the smallest total memory of the ranks' GPUs (cuDeviceTotalMem).
//
// n sweeps 2^18 .. 24*2^18 floats (step 2^18) for communication and 2^19 .. 12*2^19
// multiply-accumulates for GEMMs; --quick keeps 4 sizes of each sweep (ends included). Every
// size runs once to warm up, then 5 times; a run is timed between a barrier and a max-reduce,
// so it is the slowest rank's time, and the median of the 5 is the point. Every rank computes
// its GEMMs at the same time, as in a training step. Fits are LAPACK least squares
// (sched/fit.c). Rank 0 prints '#' metadata, a fixed-width table and an OK/FAILED footer, and
// writes the profile atomically; a progress bar goes to stderr when a person is watching.
//
// The engine that runs the timed calls is a TuneEngine (cli/tune.h): cli/tune_cpu.c (OpenBLAS
// GEMMs, MPI collectives; `moec tune` itself) or, with `--target cuda`, cli/tune_cuda.c (cuBLAS
// GEMMs, NCCL collectives, one GPU per rank), which only the programs build/cuda/moec-tune-cuda
// and moec-tune-fake (the fake device, MOEC_CUDA_FAKE=1) link; moec tune --target cuda runs the
// first in its own place (execv, before MPI starts). This file is the rest, the same for both:
// the options, the GEMM shapes, the sweeps and their timing, the fits, the table and the profile.
#include <mpi.h>

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "frontend/fe.h"
#include "ir/ir.h"
#include "sched/fit.h"
#include "sched/sched.h"
#include "runtime/moert.h"
#include "cli/cli.h"
#include "cli/options.h"
#include "cli/tune.h"

// Whether series i is measured on a real intra-node group (a node's ranks): the alltoall_intra and
// allreduce_intra lines are written only then.
static bool on_a_node(const Series *s, int i) { return !s[i].skipped && s[i].group == RT_GROUP_ESP; }

typedef struct Progress {
  bool on;
  int done, total;
} Progress;

// The engine of this run, and what it measures besides the series (T.gemm_engine: what computes
// the GEMMs, "rt_matmul (OpenBLAS)" unless the engine's open says otherwise).
static const TuneEngine *engine;
static Tune T = {.attn = {8, 8, 64, 256}, .gemm_engine = "rt_matmul (OpenBLAS)", .handoff_ms = -1, .slow_compute = -1,
                 .slow_comm = -1, .expert_scale = -1};

// Printed by rank 0 only (every rank reaches the same errors, since all parse the same argv).
static void say(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(FILE *f, const char *fmt, ...) {
  if (T.rank != 0) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
}

void cli_tune_usage(FILE *out) {
  fprintf(out,
          "usage: mpirun -np P moec tune [-o F.cluster] [--quick] [--model F.moe] [--gpus-per-node G] [-v]\n"
          "                              [--target cpu|cuda] [--dtype fp32|bf16]\n"
          "\n"
          "Profiles GEMMs and collectives on the P >= 2 ranks it runs on, fits t(n) = alpha + beta*n\n"
          "(t in ms, n in elements) to each and writes the cluster profile (lang/manual.md section 10).\n"
          "\n"
          "  --target cuda        profile GPUs, one per rank: cuBLAS GEMMs and NCCL collectives (runs\n"
          "                       build/cuda/moec-tune-cuda); P = 1 (one GPU) times the GEMMs only\n"
          "  --dtype bf16         (cuda) GEMMs with bf16 inputs and fp32 accumulation, as a model with\n"
          "                       'dtype bf16' runs them (default fp32)\n"
          "  -o F.cluster         write the profile there (atomically); without it nothing is written\n"
          "  --quick              4 sizes per sweep instead of 24 (communication) and 12 (GEMM)\n"
          "  --model F.moe        time the GEMMs in that model's expert shapes (default: M 1024, H 4096\n"
          "                       scaled down to fit the GEMM sizes)\n"
          "  --gpus-per-node G    ranks per node (default P/2 when P >= 4 and even, else P): the\n"
          "                       intra-node group is a node's ranks, the inter-node group the ranks\n"
          "                       with the same local index on every node\n"
          "  -v                   also print every measured point\n");
}

// --gpus-per-node: a positive whole number (a CliOpt check).
static bool opt_count(const CliArgs *a, const char *opt, const char *value, void *dest) {
  char *end;
  errno = 0;
  long v = strtol(value, &end, 10);
  if (*value == '\0' || *end != '\0' || errno || v < 1 || v > 1 << 20)
    return cli_args_error(a, "%s takes a positive whole number, not '%s'", opt, value);
  *(int *)dest = (int)v;
  return true;
}

// Every rank parses argv; rank 0 alone reports (every rank reaches the same errors).
static bool parse_options(int argc, char **argv, TuneOptions *o) {
  const CliOpt opts[] = {
      {"-o", NULL, false, &o->output},
      {"--model", NULL, false, &o->model},
      {"--target", NULL, false, &o->target},
      {"--dtype", NULL, false, &o->dtype},
      {"--gpus-per-node", NULL, false, &o->gpus_per_node, opt_count},
      {"--quick", NULL, true, &o->quick},
      {"-v", "--verbose", true, &o->verbose},
  };
  CliArgs args = {.quiet = T.rank != 0, .for_what = "tune", .help = "moec tune",
                  .stray = "unexpected argument", .opts = opts, .nopts = sizeof opts / sizeof opts[0]};
  if (!cli_parse_args(&args, argc, argv)) return false;
  if (o->target && strcmp(o->target, "cpu") != 0 && strcmp(o->target, "cuda") != 0) {
    say(stderr, "moec: error: --target takes cpu or cuda, not '%s'\n", o->target);
    return false;
  }
  if (o->dtype && strcmp(o->dtype, "fp32") != 0 && strcmp(o->dtype, "bf16") != 0) {
    say(stderr, "moec: error: --dtype takes fp32 or bf16, not '%s'\n", o->dtype);
    return false;
  }
  if (o->dtype && strcmp(o->dtype, "bf16") == 0 && !(o->target && strcmp(o->target, "cuda") == 0)) {
    say(stderr, "moec: error: --dtype bf16 profiles GPU GEMMs: it needs --target cuda (the CPU runtime "
                "computes in fp32)\n");
    return false;
  }
  return true;
}

// ---- the GEMM shapes ----

static void add_shape(GemmShape *shapes, int *n, int k, int cols, const char *what) {
  for (int i = 0; i < *n; i++)
    if (shapes[i].k == k && shapes[i].n == cols) return;
  if (*n >= MAX_SHAPES) return;
  shapes[*n] = (GemmShape){k, cols, ""};
  snprintf(shapes[*n].what, sizeof shapes[*n].what, "%s", what);
  (*n)++;
}

// The expert GEMMs of every layer of the model: x [m, M] times W1 (and W3) [M, H'] and the
// hidden [m, H'] times W2 [H', M], H' = hidden / esp (ESP splits the hidden dimension).
// Rank 0 only; diagnostics on stderr. Returns the number of shapes, -1 on error.
static int model_shapes(const char *path, GemmShape *shapes, char *desc, size_t desc_size) {
  IrDiag d;
  ir_diag_init(&d, stderr);
  IrSource *src = ir_source_read(&d, path);
  FeProgram *p = src ? fe_load(&d, src) : NULL;
  if (!p) {
    ir_source_free(src);
    return -1;
  }
  int n = 0;
  size_t used = snprintf(desc, desc_size, "expert shapes of %s (M = embed %lld, esp %lld):", path,
                         (long long)p->model.embed, (long long)p->parallel.esp);
  for (int l = p->nlayers - 1; l >= 0; l--)
    if (p->layers[l].has_attention && p->layers[l].heads > 0) {
      int heads = (int)p->layers[l].heads, kv = p->layers[l].kv_heads > 0 ? (int)p->layers[l].kv_heads : heads;
      int d = p->layers[l].head_dim > 0 ? (int)p->layers[l].head_dim : (int)(p->model.embed / heads);
      T.attn = (AttnShape){heads, kv, d, (int)p->model.seqlen};
    }
  for (int l = 0; l < p->nlayers; l++) {
    const FeExperts *e = &p->layers[l].moe.experts;
    int m_dim = (int)p->model.embed, h = (int)(e->hidden / (p->parallel.esp > 0 ? p->parallel.esp : 1));
    bool swiglu = sched_ffn_gemms(sched_ffn_of(e->kind)) == 3;   // mixtral, oss: W1 and W3
    int before = n;
    add_shape(shapes, &n, m_dim, h, swiglu ? "up (x W1, x W3)" : "up (x W1)");
    add_shape(shapes, &n, h, m_dim, "down (x W2)");
    if (n > before && used < desc_size)
      used += snprintf(desc + used, desc_size - used, " layer %s: ffn %s, H = hidden %lld / esp = %d;",
                       p->layers[l].name, e->kind ? e->kind : "gpt", (long long)e->hidden, h);
  }
  if (used > 0 && used < desc_size && desc[used - 1] == ';') desc[used - 1] = '\0';
  if (n == MAX_SHAPES && used < desc_size)
    snprintf(desc + strlen(desc), desc_size - strlen(desc), " (only the first %d distinct shapes are timed)", MAX_SHAPES);
  fe_program_free(p);
  ir_source_free(src);
  return n;
}

// Without a model: the paper's large expert, M = 1024 and H = 4096, halved in both dimensions
// until the smallest GEMM (2^19 multiply-accumulates) has at least 32 tokens; at full size a
// single token is already 2^22 multiply-accumulates, beyond the whole sweep.
static int default_shapes(GemmShape *shapes, char *desc, size_t desc_size) {
  int m_dim = 1024, h = 4096, halvings = 0;
  while ((double)m_dim * h * 32 > engine->gemm_unit) m_dim /= 2, h /= 2, halvings++;
  int n = 0;
  add_shape(shapes, &n, m_dim, h, "up (x W1)");
  add_shape(shapes, &n, h, m_dim, "down (x W2)");
  if (halvings == 0)
    snprintf(desc, desc_size, "no --model: the expert M = 1024, H = 4096 (H = 4M); one token is 2^22 "
                              "multiply-accumulates, so %s is m = %d tokens", engine->gemm_unit_text,
             (int)(engine->gemm_unit / 4194304.0));
  else
    snprintf(desc, desc_size,
             "no --model: the expert M = 1024, H = 4096 (H = 4M) scaled down by %d to M = %d, H = %d "
             "(at full size one token is 2^22 multiply-accumulates, beyond the sweep; here 2^19 is m = 32 tokens)",
             1 << halvings, m_dim, h);
  return n;
}

// ---- sizes ----

// The size indices (1-based, of 1..count) a sweep visits: all, or with --quick `keep` of them
// spread evenly with both ends.
static int sweep_keep(int count, int keep, bool quick, int *idx) {
  if (!quick || count <= keep) {
    for (int i = 0; i < count; i++) idx[i] = i + 1;
    return count;
  }
  for (int j = 0; j < keep; j++)
    idx[j] = 1 + (j * (count - 1) + (keep - 1) / 2) / (keep - 1);
  return keep;
}

static int sweep(int count, bool quick, int *idx) { return sweep_keep(count, QUICK_SIZES, quick, idx); }

static int gemm_sweep(bool quick, int *idx) { return sweep_keep(GEMM_SIZES, engine->quick_gemm_sizes, quick, idx); }

// ---- timing ----

int tune_compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

// One run of reps calls at once on every rank: the slowest rank's milliseconds per call.
static double time_run(const Call *c, int reps) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  for (int i = 0; i < reps; i++) engine->call(c);
  double ms = (MPI_Wtime() - t0) * 1e3 / (engine->call_reps * reps), slowest;
  MPI_Allreduce(&ms, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

// Milliseconds: one warm-up, then the median of RUNS runs, each the slowest rank's time.
static double measure(const Call *c) {
  double runs[RUNS];
  time_run(c, 1);
  for (int r = 0; r < RUNS; r++) runs[r] = time_run(c, 1);
  qsort(runs, RUNS, sizeof runs[0], tune_compare_doubles);
  return runs[RUNS / 2];
}

// ---- progress ----

// Whether a person watches stderr: ours is a terminal, or, under mpirun (which hands the ranks
// pipes), the launcher's is (Linux /proc).
static bool watched(void) {
  if (isatty(STDERR_FILENO)) return true;
  char link[64], target[256];
  snprintf(link, sizeof link, "/proc/%ld/fd/2", (long)getppid());
  ssize_t len = readlink(link, target, sizeof target - 1);
  if (len <= 0) return false;
  target[len] = '\0';
  return strncmp(target, "/dev/pts/", 9) == 0 || strncmp(target, "/dev/tty", 8) == 0;
}

static void progress_step(Progress *p, const char *what, double n) {
  p->done++;
  if (!p->on) return;
  enum { WIDTH = 30 };
  int fill = p->total ? WIDTH * p->done / p->total : WIDTH;
  fprintf(stderr, "\r[%.*s%*s] %3d%%  %-26s n %-10.0f", fill, "##############################", WIDTH - fill, "",
          p->total ? 100 * p->done / p->total : 100, what, n);
  fflush(stderr);
}

static void progress_end(Progress *p) {
  if (!p->on) return;
  fprintf(stderr, "\r%*s\r", 84, "");
  fflush(stderr);
}

// ---- the sweeps ----

void *tune_xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) rt_comm_abort("moec tune: out of memory (%zu bytes)", bytes);
  return p;
}

static void run_gemms(Series *s, const GemmShape *shapes, int nshapes, bool quick, Progress *pr) {
  int idx[GEMM_SIZES], nsizes = gemm_sweep(quick, idx);
  for (int i = 0; i < nshapes; i++) {
    const GemmShape *g = &shapes[i];
    int m_max = engine->tokens_for(g, GEMM_SIZES), ring = engine->gemm_ring;
    size_t na = (size_t)m_max * g->k * ring, nb = (size_t)g->k * g->n * ring;
    float *a = tune_xmalloc(sizeof(float) * na), *b = tune_xmalloc(sizeof(float) * nb);
    float *c = tune_xmalloc(sizeof(float) * (size_t)m_max * g->n * ring);
    for (size_t e = 0; e < na; e++) a[e] = (float)((int)(e % 17) - 8) / 64;
    for (size_t e = 0; e < nb; e++) b[e] = (float)((int)(e % 13) - 6) / 64;
    // Each size's runs on the host operands (the CPU's ring of them: the engine's call takes the
    // next), or where the engine puts them (a GPU's memory).
    Call ops = {.a = a, .b = b, .c = c};
    if (engine->gemm_operands)
      engine->gemm_operands(&ops, a, (size_t)m_max * g->k, b, (size_t)g->k * g->n, c, (size_t)m_max * g->n);
    for (int j = 0; j < nsizes; j++) {
      Call cl = {.op = OP_GEMM, .m = engine->tokens_for(g, idx[j]), .k = g->k, .n = g->n, .a = ops.a, .b = ops.b,
                 .c = ops.c};
      double macs = (double)cl.m * cl.k * cl.n;
      s->x[s->points] = macs;
      s->t[s->points++] = measure(&cl);
      progress_step(pr, "gemm", macs);
    }
    free(a);
    free(b);
    free(c);
  }
}

// The grid of GEMM shapes (the profile's `gemm_at` lines): [m, k] x [k, n] for m the tokens a
// GEMM gets, from a pipeline's narrow chunks to whole batches, and k, n the widths of experts,
// attention and heads; each shape at most TUNE_GRID_MACS multiply-accumulates (an engine may ask
// for fewer: the fake device's) and GRID_FLOATS floats an operand (the planner takes a larger one
// at the speed of the largest measured at its k and n: sched/sched_gemm.c). Every rank at once, as the other GEMMs. Each run takes the next of as many
// operand sets as add up to GRID_COLD floats (64 MiB, beyond a CPU's last-level cache): a step's
// GEMMs read operands other work has pushed out of the caches, and a small shape whose few sets
// stayed cached timed up to 1.6x faster than the same shape in a step.
//
// The grid is timed in RUNS passes, one run of every shape a pass, and each shape keeps the median
// of its passes: a shared machine has slow spells of a second or more (other work, a rank moved to
// a busy core), and five runs of a shape in a row fell into the same spell: three profiles of 2
// ranks on 2 cores disagreed by more than 25 % at 51 of 284 shapes and by more than 50 % at 12 with
// runs in a row, at 29 and 1 in passes. Where the ranks' threads outnumber the cores the times were
// also two-valued (the slowest rank's GEMM ran alone or beside another, 2.5e-8 or 5e-8 ms per
// multiply-accumulate, by where it fell in the scheduler's time slices; 98 shapes over 25 % and 48
// over 50 % for three profiles of 4 ranks, in a row or in passes): there a run lasts
// GRID_RUN_SHARED_MS, long enough to hold many slices, so that each rank gets its share of a core as
// in a step (those three profiles, in passes of such runs: 41 shapes over 25 %, 6 over 50 %). A run
// of a short shape is as many calls as take the run's time (at most GRID_REPS), counted at the first
// pass's warm-up.
static const int grid_m[] = {4, 16, 64, 256, 1024, 2048, 4096}, grid_w[] = {64, 128, 256, 512, 1024, 2048, 4096};
enum { GRID_NM = sizeof grid_m / sizeof *grid_m, GRID_NW = sizeof grid_w / sizeof *grid_w, GRID_MAX = GRID_NM * GRID_NW * GRID_NW };
enum { GRID_REPS = 1024 };
#define GRID_FLOATS TUNE_GRID_FLOATS
#define GRID_COLD 16777216.0    // 2^24 floats: the operand sets a shape cycles through, at least
#define GRID_RUN_MS 2.0
#define GRID_RUN_SHARED_MS 20.0
static double grid[GRID_MAX][4];   // m, k, n, ms
static int ngrid;
static double grid_run;            // a run's least length (ms)

static bool grid_keeps(int m, int k, int n) {
  double macs = T.grid_macs > 0 ? T.grid_macs : TUNE_GRID_MACS;
  return (double)m * k * n <= macs && (double)m * k <= GRID_FLOATS && (double)k * n <= GRID_FLOATS &&
         (double)m * n <= GRID_FLOATS;
}

static int grid_points(void) {
  int n = 0;
  for (int i = 0; i < GRID_NM; i++)
    for (int j = 0; j < GRID_NW; j++)
      for (int l = 0; l < GRID_NW; l++) n += grid_keeps(grid_m[i], grid_w[j], grid_w[l]);
  return n;
}

static double grid_ms_per_mac(int i) { return grid[i][3] / (grid[i][0] * grid[i][1] * grid[i][2]); }

// The grid's shapes as calls on the operands ops (the ring of operand sets each takes).
static int grid_calls(const Call *ops, size_t most, Call *calls) {
  int count = 0;
  for (int j = 0; j < GRID_NW; j++)
    for (int l = 0; l < GRID_NW; l++)
      for (int i = 0; i < GRID_NM; i++) {
        int m = grid_m[i], k = grid_w[j], n = grid_w[l];
        if (!grid_keeps(m, k, n)) continue;
        double set = (double)m * k + (double)k * n + (double)m * n;
        double biggest = fmax((double)m * k, fmax((double)k * n, (double)m * n));
        int ring = engine->gemm_ring > 1 ? (int)fmin(floor((double)most / biggest), ceil(GRID_COLD / set)) : 1;
        calls[count++] = (Call){.op = OP_GEMM, .m = m, .k = k, .n = n, .a = ops->a, .b = ops->b, .c = ops->c,
                                .ring = ring};
      }
  return count;
}

static void run_gemm_grid(double run_ms, Progress *pr) {
  grid_run = run_ms;
  size_t most = (size_t)(engine->gemm_ring > 1 ? GRID_COLD : GRID_FLOATS);
  float *a = tune_xmalloc(sizeof(float) * most), *b = tune_xmalloc(sizeof(float) * most);
  float *c = tune_xmalloc(sizeof(float) * most);
  for (size_t e = 0; e < most; e++) a[e] = (float)((int)(e % 17) - 8) / 64, b[e] = (float)((int)(e % 13) - 6) / 64;
  Call ops = {.a = a, .b = b, .c = c};
  if (engine->gemm_operands) engine->gemm_operands(&ops, a, most, b, most, c, most);
  static Call calls[GRID_MAX];
  static double runs[GRID_MAX][RUNS];
  static int reps[GRID_MAX];
  ngrid = grid_calls(&ops, most, calls);
  for (int pass = 0; pass < RUNS; pass++)
    for (int i = 0; i < ngrid; i++) {
      if (pass == 0) {
        double warm = time_run(&calls[i], 1);
        double call_ms = warm * engine->call_reps;   // time_run's is per GEMM
        reps[i] = call_ms > 0 ? (int)fmin(GRID_REPS, fmax(1, ceil(run_ms / call_ms))) : GRID_REPS;
      }
      runs[i][pass] = time_run(&calls[i], reps[i]);
      if (pass == RUNS - 1) progress_step(pr, "gemm grid", (double)calls[i].m * calls[i].k * calls[i].n);
    }
  for (int i = 0; i < ngrid; i++) {
    qsort(runs[i], RUNS, sizeof runs[i][0], tune_compare_doubles);
    grid[i][0] = calls[i].m, grid[i][1] = calls[i].k, grid[i][2] = calls[i].n, grid[i][3] = runs[i][RUNS / 2];
  }
  free(a);
  free(b);
  free(c);
}

// The small sizes first (2^8, 2^11, 2^14 floats: the fixed cost alpha is the smallest one's
// time, a measurement), then the sweep of 2^18 .. 24 * 2^18 for the slope.
static int64_t comm_size(int j, const int *idx) {
  return j < SMALL_SIZES ? (int64_t)256 << (3 * j) : (int64_t)(idx[j - SMALL_SIZES] * COMM_UNIT);
}

// A point-to-point message's peers in s's group (a ring: the next member and the one before), as
// world ranks: the intra-node group's members are consecutive ranks, the inter-node group's a
// node's size apart (the ESP group's), all ranks' consecutive.
static void ring_peers(RtComm *comm, const Series *s, Call *cl) {
  int rank = rt_comm_rank(comm, RT_GROUP_WORLD), me = rt_comm_rank(comm, s->group), size = s->group_size;
  int stride = s->group == RT_GROUP_EP ? rt_comm_size(comm, RT_GROUP_ESP) : 1;
  cl->to = rank + ((me + 1) % size - me) * stride;
  cl->from = rank + ((me + size - 1) % size - me) * stride;
}

static void run_comm(RtComm *comm, Series *s, float *send, float *recv, bool quick, Progress *pr) {
  int idx[COMM_SIZES], nsizes = SMALL_SIZES + sweep(COMM_SIZES, quick, idx);
  char label[40];
  snprintf(label, sizeof label, "%s (%s)", s->name, s->where);
  for (int j = 0; j < nsizes; j++) {
    int64_t n = comm_size(j, idx);
    Call cl = {.op = s->op, .comm = comm, .group = s->group, .send = send, .recv = recv};
    if (s->op == OP_P2P) ring_peers(comm, s, &cl);
    // n is what each rank sends/receives in all; per-member counts round down to whole floats.
    bool whole = s->op == OP_ALLREDUCE || s->op == OP_P2P;
    cl.count = whole ? n : n / s->group_size > 0 ? n / s->group_size : 1;
    double elements = whole ? (double)cl.count : (double)cl.count * s->group_size;
    s->x[s->points] = elements;
    s->t[s->points++] = measure(&cl);
    progress_step(pr, label, elements);
  }
}

// The kernel sweeps' buffers where the engine's kernels use them (TuneEngine.kernel_buffers).
static void place(float *const *host, const size_t *n, int count, float **dev) {
  for (int i = 0; i < count; i++) dev[i] = host[i];
  if (engine->kernel_buffers) engine->kernel_buffers(host, n, count, dev);
}

// Size j of the element-wise and update sweeps: 2^(15 + idx[j] + T.elem_shift) floats.
static int64_t elem_count(int j, const int *idx) { return (int64_t)1 << (15 + idx[j] + T.elem_shift); }

// Element-wise kernels (a copy and an add over n floats, 5n floats moved) for the `elementwise`
// fit that prices the ops without a GEMM or a collective: 2^16 .. 2^23 floats on a CPU (a GPU:
// 2^19 .. 2^26, T.elem_shift), mostly beyond the caches, as a training step's activations are.
static void run_elementwise(Series *s, bool quick, Progress *pr) {
  int idx[ELEM_SIZES], nsizes = sweep(ELEM_SIZES, quick, idx);
  size_t most = (size_t)1 << (15 + ELEM_SIZES + T.elem_shift);
  float *host[3], *dev[3];
  size_t n[3] = {most, most, most};
  for (int i = 0; i < 3; i++) host[i] = tune_xmalloc(sizeof(float) * most);
  uint32_t state = 12345;
  for (size_t e = 0; e < most; e++) {
    state = state * 1664525u + 1013904223u;
    host[0][e] = (float)(state >> 8) / 16777216.0f - 0.5f;
    host[1][e] = (float)(e % 29) / 32.0f;
    host[2][e] = 0.0f;
  }
  place(host, n, 3, dev);
  for (int j = 0; j < nsizes; j++) {
    Call cl = {.op = OP_ELEMENTWISE, .count = elem_count(j, idx), .send = dev[0], .recv = dev[1], .c = dev[2]};
    s->x[s->points] = 5.0 * (double)cl.count;
    s->t[s->points++] = measure(&cl);
    progress_step(pr, "elementwise", 5.0 * (double)cl.count);
  }
  for (int i = 0; i < 3; i++) free(host[i]);
}

// The kernels the planner prices apart from the plain element-wise ones, over the sizes of
// run_elementwise: `elementwise_math` (GELU, tanh and its arithmetic per element: the
// activations, softmaxes and losses that evaluate exp, tanh or erf per element), `update_adamw`
// and `update_sgd` (the optimizer over n parameters: AdamW reads and writes the parameter and two
// moments and reads the gradient).
static void run_kernel_sweeps(Series *series, bool quick, Progress *pr) {
  int idx[ELEM_SIZES], nsizes = sweep(ELEM_SIZES, quick, idx);
  size_t most = (size_t)1 << (15 + ELEM_SIZES + T.elem_shift);
  float *host[4], *dev[4];   // x, y, m, v
  size_t n[4] = {most, most, most, most};
  for (int i = 0; i < 4; i++) host[i] = tune_xmalloc(sizeof(float) * most);
  uint32_t state = 4242;
  for (size_t e = 0; e < most; e++) {
    state = state * 1664525u + 1013904223u;
    host[0][e] = (float)(state >> 8) / 4194304.0f - 2.0f;
    host[1][e] = (float)(e % 31) / 64.0f, host[2][e] = 0.0f, host[3][e] = 0.0f;
  }
  place(host, n, 4, dev);
  static const int which[] = {S_MATH, S_ADAMW, S_SGD};
  static const char *const what[] = {"elementwise_math", "update_adamw", "update_sgd"};
  for (int w = 0; w < 3; w++)
    for (int j = 0; j < nsizes; j++) {
      Series *s = &series[which[w]];
      Call cl = {.op = s->op, .count = elem_count(j, idx), .send = dev[0], .c = dev[1], .attn_stats = dev[2],
                 .attn_grad = dev[3]};
      s->x[s->points] = (double)cl.count;
      s->t[s->points++] = measure(&cl);
      progress_step(pr, what[w], (double)cl.count);
    }
  for (int i = 0; i < 4; i++) free(host[i]);
}

// Causal attention (runtime/kernels/attn.c, the GPU's codegen/cuda/attn.cu) in the model's shape
// over 1, 2, 4, 8 windows (times 2^T.attn_shift): the forward (n = rows * heads*d * (seq + 1)
// multiply-accumulates, as the cost pass counts them) and the backward (stats, dq, dk and dv:
// twice that n), a fit each (`attention`, `attention_grad`), relative: the backward's kernels
// take several times the forward's.
static void run_attention(Series *series, bool quick, Progress *pr) {
  AttnShape a = T.attn;
  int idx[ATTN_SIZES], nsizes = sweep(ATTN_SIZES, quick, idx);
  size_t most = (size_t)a.seq << (ATTN_SIZES - 1 + T.attn_shift), qc = (size_t)a.heads * a.d, kc = (size_t)a.kv * a.d;
  enum { Q, K, V, O, DY, ST, DQKV, NBUF };
  size_t n[NBUF] = {most * qc, most * kc, most * kc, most * qc, most * qc, most * 2 * a.heads, most * (qc + 2 * kc)};
  float *host[NBUF], *dev[NBUF];
  for (int b = 0; b < NBUF; b++) host[b] = tune_xmalloc(sizeof(float) * n[b]);
  uint32_t state = 777;
  for (int b = 0; b < NBUF; b++)
    for (size_t e = 0; e < n[b]; e++) {
      state = state * 1664525u + 1013904223u;
      host[b][e] = b <= V || b == DY ? (float)(state >> 8) / 16777216.0f - 0.5f : 0.0f;
    }
  place(host, n, NBUF, dev);
  for (int j = 0; j < nsizes; j++) {
    int rows = a.seq << (idx[j] - 1 + T.attn_shift);
    double macs = (double)rows * (double)qc * (a.seq + 1);
    for (int backward = 0; backward < 2; backward++) {
      Call cl = {.op = OP_ATTENTION, .m = rows, .n = backward, .a = dev[Q], .b = dev[K], .c = dev[O], .send = dev[V],
                 .recv = dev[DY], .attn_stats = dev[ST], .attn_grad = dev[DQKV], .attn = &a};
      Series *s = &series[backward ? S_ATTN_GRAD : S_ATTN];
      s->x[s->points] = backward ? 2 * macs : macs;
      s->t[s->points++] = measure(&cl);
      progress_step(pr, "attention", backward ? 2 * macs : macs);
    }
  }
  for (int b = 0; b < NBUF; b++) free(host[b]);
}

// ---- the profile ----

// The cluster's name: the output file's base name without .cluster, as an identifier.
static void cluster_name(const char *output, char *name, size_t size) {
  const char *base = output ? strrchr(output, '/') : NULL;
  base = base ? base + 1 : output ? output : "tuned";
  size_t len = strlen(base);
  if (len > 8 && strcmp(base + len - 8, ".cluster") == 0) len -= 8;
  size_t o = 0;
  if (len == 0 || !((base[0] >= 'A' && base[0] <= 'Z') || (base[0] >= 'a' && base[0] <= 'z') || base[0] == '_'))
    o += snprintf(name, size, "c_");
  for (size_t i = 0; i < len && o + 1 < size; i++) {
    char ch = base[i];
    bool word = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
    name[o++] = word ? ch : '_';
  }
  name[o] = '\0';
}

// A coefficient as the file holds it: the fit, or 0 (with a note) when noise made it negative.
static void write_coef(FILE *f, const char *field, const Series *s) {
  if (s->skipped) {
    fprintf(f, "  %-15s { alpha 0; beta 0; }  # not measured: one GPU runs no collectives\n", field);
    return;
  }
  double a = s->fit.alpha, b = s->fit.beta;
  fprintf(f, "  %-15s { alpha %.6g; beta %.6g; }", field, a < 0 ? 0.0 : a, b < 0 ? 0.0 : b);
  if (a < 0 || b < 0) {
    fprintf(f, "  # fitted");
    if (a < 0) fprintf(f, " alpha %.6g", a);
    if (b < 0) fprintf(f, "%s beta %.6g", a < 0 ? "," : "", b);
    fprintf(f, ", clamped to 0 (a profile needs alpha, beta >= 0)");
  }
  fputc('\n', f);
}

static void write_profile(FILE *f, const char *header, const char *name, int nodes, int gpus_per_node,
                          const Series *s) {
  fputs(header, f);
  fprintf(f, "cluster %s {\n  nodes %d;\n  gpus_per_node %d;\n", name, nodes, gpus_per_node);
  if (T.memory_bytes > 0) fprintf(f, "  memory %lld;  # %s\n", (long long)T.memory_bytes, T.memory_note);
  else fprintf(f, "  # no memory line: %s\n", T.memory_note);
  write_coef(f, "gemm", &s[S_GEMM]);
  write_coef(f, "alltoall", &s[S_A2A_INTER]);
  write_coef(f, "allgather", &s[S_AG_INTRA]);
  write_coef(f, "reducescatter", &s[S_RS_INTRA]);
  write_coef(f, "allreduce", &s[S_AR_INTER]);
  if (on_a_node(s, S_A2A_INTRA)) write_coef(f, "alltoall_intra", &s[S_A2A_INTRA]);
  if (on_a_node(s, S_AR_INTRA)) write_coef(f, "allreduce_intra", &s[S_AR_INTRA]);
  // A pipeline's messages (lang/manual.md §10): where not measured, the planner derives them.
  if (!s[S_P2P_INTER].skipped) write_coef(f, "p2p", &s[S_P2P_INTER]);
  if (on_a_node(s, S_P2P_INTRA)) write_coef(f, "p2p_intra", &s[S_P2P_INTRA]);
  if (s[S_P2P_INTER].skipped && T.p2p_note[0]) fprintf(f, "  # no p2p, p2p_intra: %s\n", T.p2p_note);
  if (!s[S_P2P_INTER].skipped && !on_a_node(s, S_P2P_INTRA))
    fprintf(f, "  # no p2p_intra: one rank per node, so no intra-node group\n");
  if (!on_a_node(s, S_A2A_INTRA) || !on_a_node(s, S_AR_INTRA))
    fprintf(f, "  # no alltoall_intra, allreduce_intra: %s\n",
            s[S_A2A_INTRA].skipped ? "one GPU runs no collectives"
                                   : "one rank per node, so no intra-node group (measured on all ranks, they "
                                     "would not describe a node)");
  if (!s[S_ELEM].skipped) write_coef(f, "elementwise", &s[S_ELEM]);
  for (int i = S_ATTN; i < NSERIES; i++)
    if (!s[i].skipped) write_coef(f, s[i].name, &s[i]);
  if (T.handoff_ms >= 0) fprintf(f, "  handoff %.6g;\n", T.handoff_ms);
  if (T.expert_scale > 0) fprintf(f, "  expert_gemm_scale %.4f;  # %s\n", T.expert_scale, T.expert_note);
  if (T.slow_compute >= 0) fprintf(f, "  overlap { compute %.4f; comm %.4f; }\n", T.slow_compute, T.slow_comm);
  if (ngrid > 0)
    fprintf(f, "  # GEMMs by shape: gemm_at M K N MS, [M, K] x [K, N] in MS ms; the planner prices a model's GEMMs\n"
               "  # from these (interpolated), `gemm` above only where there are none\n");
  for (int i = 0; i < ngrid; i++)
    fprintf(f, "  gemm_at %d %d %d %.6g;\n", (int)grid[i][0], (int)grid[i][1], (int)grid[i][2], grid[i][3]);
  fprintf(f, "}\n");
}

// Temp file in the same directory, fsync, rename: readers see the old file or the whole new one.
static bool write_atomically(const char *path, const char *header, const char *name, int nodes,
                             int gpus_per_node, const Series *s) {
  size_t len = strlen(path);
  char *tmp = tune_xmalloc(len + 16);
  snprintf(tmp, len + 16, "%s.tmp-XXXXXX", path);
  int fd = mkstemp(tmp);
  FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
  bool ok = f != NULL;
  if (ok) {
    write_profile(f, header, name, nodes, gpus_per_node, s);
    ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    ok = ok && rename(tmp, path) == 0;
  } else if (fd >= 0) {
    close(fd);
  }
  int saved = errno;
  if (!ok && fd >= 0) unlink(tmp);
  free(tmp);
  errno = saved;
  return ok;
}

// Appends text as '# ' comment lines of at most about 100 columns, broken at spaces.
static size_t append_wrapped(char *h, size_t u, size_t size, const char *text) {
  enum { WIDTH = 96 };
  while (*text && u < size) {
    size_t len = strlen(text);
    if (len > WIDTH) {
      len = WIDTH;
      while (len > 0 && text[len] != ' ') len--;
      if (len == 0) len = strcspn(text, " ");
    }
    u += snprintf(h + u, size - u, "# %.*s\n", (int)len, text);
    text += len;
    while (*text == ' ') text++;
  }
  return u;
}

// The '#' lines that open the profile: how it was measured and every fit's r^2.
static char *profile_header(const char *command, const char *date, const char *host, long cores, int world,
                            const char *nodes_line, const char *gemm_desc, const GemmShape *shapes, int nshapes,
                            bool quick, const Series *s) {
  size_t size = 8192;
  char *h = tune_xmalloc(size);
  size_t u = 0;
  u += snprintf(h + u, size - u, "# Measured by `moec tune` on %s (%ld cores), %s:\n#   %s\n", host, cores, date, command);
  u += snprintf(h + u, size - u, "# %d ranks; %s\n", world, nodes_line);
  char gemm_line[1200];
  snprintf(gemm_line, sizeof gemm_line, "gemm: %s on every rank at once, %s", T.gemm_engine, gemm_desc);
  u = append_wrapped(h, u, size, gemm_line);
  u += snprintf(h + u, size - u, "#   shapes:");
  for (int i = 0; i < nshapes; i++)
    u += snprintf(h + u, size - u, "%s [m, %d] x [%d, %d]", i ? "," : "", shapes[i].k, shapes[i].k, shapes[i].n);
  u += snprintf(h + u, size - u, "\n");
  u = engine->header_sizes(h, u, size, quick);
  u += snprintf(h + u, size - u,
                "# each point the median of %d runs after 1 warm-up, timed on the slowest rank. t(n) = alpha + beta * n,\n"
                "# t in ms, n in elements each rank sends/receives (gemm: multiply-accumulates; elementwise: floats read and\n"
                "# written). Collectives: alpha is the time at 2^8 floats, beta the least-squares slope from 2^18 on; gemm:\n"
                "# least squares of the relative error; elementwise: alpha the smallest size's time, beta the slope from\n"
                "# 2^20 floats on. handoff: the stream hand-off round trip (ms); overlap: how much slower GEMMs and an\n"
                "# AlltoAll run when they run at once (relative). Fits:\n",
                RUNS);
  if (engine->call_reps > 1)
    u += snprintf(h + u, size - u, "# (a run: %d calls back to back on the GPU's compute stream, a synchronisation, / %d)\n",
                  engine->call_reps, engine->call_reps);
  for (int i = 0; i < NSERIES; i++)
    if (s[i].skipped && i >= S_ELEM)
      continue;
    else if (s[i].skipped && (i == S_P2P_INTRA || i == S_P2P_INTER) && T.p2p_note[0])
      u += snprintf(h + u, size - u, "#   %-13s %-10s %s\n", s[i].name, s[i].where, T.p2p_note);
    else if (s[i].skipped)
      u += snprintf(h + u, size - u, "#   %-13s %-10s not measured: one rank (one GPU) runs no collectives\n", s[i].name,
                    s[i].where);
    else
      u += snprintf(h + u, size - u, "#   %-13s %-10s alpha %11.4e  beta %11.4e  r2 %.6f  (%d points)\n", s[i].name,
                    s[i].where, s[i].fit.alpha, s[i].fit.beta, s[i].fit.r2, s[i].fit.points);
  if (s[S_A2A_INTRA].skipped)
    u += snprintf(h + u, size - u,
                  "# The collectives are 0: this profile is 1 node x 1 GPU, so the planner refuses a layout of more\n"
                  "# ranks, and a model on one rank runs none.\n");
  else {
    char text[800];
    const char *inter = s[S_A2A_INTER].group == RT_GROUP_EP ? "inter-node" : "all-ranks (one node: no inter-node group)";
    if (on_a_node(s, S_A2A_INTRA))
      snprintf(text, sizeof text,
               "`alltoall` and `allreduce` below are the %s fits (`alltoall` is the scheduler's t_a2a); "
               "allgather, reducescatter, alltoall_intra and allreduce_intra the intra-node ones.", inter);
    else
      snprintf(text, sizeof text,
               "`alltoall` and `allreduce` below are the %s fits (`alltoall` is the scheduler's t_a2a). One rank "
               "per node: there is no intra-node group, so allgather and reducescatter were measured on all ranks, "
               "and alltoall_intra and allreduce_intra are left out (they would not describe a node; on all ranks "
               "the AlltoAll fit was alpha %.6g, beta %.6g, the AllReduce fit alpha %.6g, beta %.6g).",
               inter, s[S_A2A_INTRA].fit.alpha, s[S_A2A_INTRA].fit.beta, s[S_AR_INTRA].fit.alpha, s[S_AR_INTRA].fit.beta);
    u = append_wrapped(h, u, size, text);
    if (!s[S_P2P_INTER].skipped) {
      snprintf(text, sizeof text, "`p2p` is the %s point-to-point fit (a message to the rank of the same place on the "
               "next node, every rank at once: a pipeline's activations between stages)%s.", inter,
               on_a_node(s, S_P2P_INTRA) ? ", `p2p_intra` the intra-node one (to the next rank of the node)" : "");
      u = append_wrapped(h, u, size, text);
    }
  }
  if (T.memory_bytes > 0 && T.memory_host_note[0]) u = append_wrapped(h, u, size, T.memory_host_note);
  return h;
}

// Rank 0's members of a group whose members step by `step`: "0, 2, 4" or "0, 2, ..., 14".
static void format_run(char *buf, size_t size, int step, int count) {
  if (count <= 4) {
    size_t u = 0;
    buf[0] = '\0';
    for (int i = 0; i < count && u < size; i++) u += snprintf(buf + u, size - u, "%s%d", i ? ", " : "", i * step);
  } else {
    snprintf(buf, size, "0, %d, ..., %d", step, (count - 1) * step);
  }
}

// ---- the command ----

// The world's checks of the command line; 0, or 2 (reported).
static int check_world(const TuneOptions *o, int world) {
  if (world < engine->min_ranks) {   // on GPUs one rank is allowed: it times the GEMMs only
    say(stderr, "moec: error: tune needs at least 2 ranks to time collectives: run it as "
                "'mpirun -np P moec tune ...' with P >= 2\n");
    return 2;
  }
  if (o->gpus_per_node && world % o->gpus_per_node != 0) {
    say(stderr, "moec: error: --gpus-per-node %d does not divide the %d ranks into whole nodes\n",
        o->gpus_per_node, world);
    return 2;
  }
  return 0;
}

// The GEMM shapes: rank 0 reads the model (or takes the default ones) and hands them out. The
// number of shapes, <= 0 on error (reported).
static int read_shapes(const TuneOptions *o, GemmShape shapes[MAX_SHAPES], char *desc, size_t desc_size) {
  int nshapes = 0;
  if (T.rank == 0)
    nshapes = o->model ? model_shapes(o->model, shapes, desc, desc_size) : default_shapes(shapes, desc, desc_size);
  MPI_Bcast(&nshapes, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (nshapes == 0) say(stderr, "moec: error: %s has no expert GEMMs to time\n", o->model);
  if (nshapes > 0) MPI_Bcast(shapes, (int)(sizeof shapes[0] * nshapes), MPI_BYTE, 0, MPI_COMM_WORLD);
  return nshapes;
}

static void describe_run(int argc, char **argv, const TuneOptions *o, int world, TuneRun *r) {
  r->world = world;
  r->assumed = o->gpus_per_node == 0;
  r->gpn = o->gpus_per_node ? o->gpus_per_node : world >= 4 && world % 2 == 0 ? world / 2 : world;
  r->nodes = world / r->gpn;
  // Where the ranks really are: ranks that share memory with rank 0.
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  MPI_Comm_size(local, &r->local_size);
  MPI_Comm_free(&local);
  snprintf(r->host, sizeof r->host, "?");
  gethostname(r->host, sizeof r->host);
  r->host[sizeof r->host - 1] = '\0';
  time_t now = time(NULL);
  strftime(r->date, sizeof r->date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
  int vlen;
  MPI_Get_library_version(r->version, &vlen);
  r->version[strcspn(r->version, ",\n")] = '\0';
  r->cores = sysconf(_SC_NPROCESSORS_ONLN);
  size_t cu = snprintf(r->command, sizeof r->command, "mpirun -np %d", world);
  for (int i = 0; i < argc && cu < sizeof r->command; i++)
    cu += snprintf(r->command + cu, sizeof r->command - cu, " %s", argv[i]);
  if (r->assumed)
    snprintf(r->nodes_line, sizeof r->nodes_line, "nodes assumed: %d x %d ranks (gpus_per_node %d, the default %s)",
             r->nodes, r->gpn, r->gpn,
             world >= 4 && world % 2 == 0 ? "world/2" : "one node for fewer than 4 or an odd number of ranks");
  else
    snprintf(r->nodes_line, sizeof r->nodes_line, "nodes: %d x %d ranks (--gpus-per-node %d)", r->nodes, r->gpn,
             r->gpn);
}

// The series on their groups. A group of one has nothing to time; then its fits run on all
// ranks (and the table says so).
static void init_series(RtComm *comm, Series *s) {
  RtGroup intra = rt_comm_size(comm, RT_GROUP_ESP) > 1 ? RT_GROUP_ESP : RT_GROUP_WORLD;
  RtGroup inter = rt_comm_size(comm, RT_GROUP_EP) > 1 ? RT_GROUP_EP : RT_GROUP_WORLD;
  const char *intra_where = intra == RT_GROUP_ESP ? "intra-node" : "all-ranks";
  const char *inter_where = inter == RT_GROUP_EP ? "inter-node" : "all-ranks";
  s[S_GEMM] = (Series){"gemm", "each-rank", OP_GEMM, RT_GROUP_WORLD, 1};
  s[S_A2A_INTRA] = (Series){"alltoall", intra_where, OP_ALLTOALL, intra, rt_comm_size(comm, intra)};
  s[S_AG_INTRA] = (Series){"allgather", intra_where, OP_ALLGATHER, intra, rt_comm_size(comm, intra)};
  s[S_RS_INTRA] = (Series){"reducescatter", intra_where, OP_REDUCESCATTER, intra, rt_comm_size(comm, intra)};
  s[S_AR_INTRA] = (Series){"allreduce", intra_where, OP_ALLREDUCE, intra, rt_comm_size(comm, intra)};
  s[S_A2A_INTER] = (Series){"alltoall", inter_where, OP_ALLTOALL, inter, rt_comm_size(comm, inter)};
  s[S_AR_INTER] = (Series){"allreduce", inter_where, OP_ALLREDUCE, inter, rt_comm_size(comm, inter)};
  s[S_P2P_INTRA] = (Series){"p2p", intra_where, OP_P2P, intra, rt_comm_size(comm, intra)};
  s[S_P2P_INTER] = (Series){"p2p", inter_where, OP_P2P, inter, rt_comm_size(comm, inter)};
  s[S_ELEM] = (Series){"elementwise", "each-rank", OP_ELEMENTWISE, RT_GROUP_WORLD, 1};
  s[S_ATTN] = (Series){"attention", "each-rank", OP_ATTENTION, RT_GROUP_WORLD, 1};
  s[S_ATTN_GRAD] = (Series){"attention_grad", "each-rank", OP_ATTENTION, RT_GROUP_WORLD, 1};
  s[S_MATH] = (Series){"elementwise_math", "each-rank", OP_MATH, RT_GROUP_WORLD, 1};
  s[S_ADAMW] = (Series){"update_adamw", "each-rank", OP_ADAMW, RT_GROUP_WORLD, 1};
  s[S_SGD] = (Series){"update_sgd", "each-rank", OP_SGD, RT_GROUP_WORLD, 1};
}

// A series every rank times alone (the GEMMs, the element-wise, attention and update kernels).
static bool each_rank(int i) { return i == S_GEMM || i >= S_ELEM; }

// Rank 0's '#' lines before the measurements.
static void print_preamble(const TuneOptions *o, const TuneRun *r, const Series *s, const GemmShape *shapes,
                           int nshapes, const char *gemm_desc) {
  printf("# moec tune: t(n) = alpha + beta*n, t in ms, n in elements each rank sends/receives (gemm: multiply-accumulates)\n");
  printf("# %s, %d ranks on %s (%ld cores); %d of them share rank 0's host; threads per rank: %d (GEMMs in %d pieces)\n",
         r->version, r->world, r->host, r->cores, r->local_size, r->threads, rt_gemm_pieces());
  if (engine->print_device) engine->print_device();
  printf("# %s%s\n", r->nodes_line,
         r->local_size == r->world && r->nodes > 1 ? "; every rank runs on this host, so the 'nodes' share its memory"
                                                   : "");
  char intra_members[64], inter_members[64];
  format_run(intra_members, sizeof intra_members, 1, r->gpn);
  format_run(inter_members, sizeof inter_members, r->gpn, r->nodes);
  printf("# intra-node group: the %d consecutive ranks of a node (rank 0's: %s); inter-node group: the %d ranks with "
         "the same local index, one per node (rank 0's: %s)\n", r->gpn, intra_members, r->nodes, inter_members);
  if (s[S_A2A_INTRA].group != RT_GROUP_ESP && !s[S_A2A_INTRA].skipped)
    printf("# one rank per node: no intra-node group, so its fits (alltoall, allgather, reducescatter, allreduce) run "
           "on all ranks; the profile has no alltoall_intra and allreduce_intra\n");
  if (s[S_A2A_INTER].group != RT_GROUP_EP && !s[S_A2A_INTER].skipped)
    printf("# one node: no inter-node group, so its fits (alltoall, allreduce) run on all ranks\n");
  if (T.memory_bytes > 0) printf("# memory per rank: %lld bytes = %s\n", (long long)T.memory_bytes, T.memory_note);
  else printf("# memory per rank: unknown (%s), no memory line in the profile\n", T.memory_note);
  printf("# gemm: %s, C[m,N] = A[m,K] x B[K,N] on every rank at once, n = m*K*N; %s\n", T.gemm_engine, gemm_desc);
  for (int i = 0; i < nshapes; i++)
    printf("#   gemm shape %-16s [m, %d] x [%d, %d]  m %d..%d\n", shapes[i].what, shapes[i].k, shapes[i].k,
           shapes[i].n, engine->tokens_for(&shapes[i], 1), engine->tokens_for(&shapes[i], GEMM_SIZES));
  engine->print_sizes(o->quick);
  printf("# each point: the median of %d runs after 1 warm-up; a run is the slowest rank's time", RUNS);
  if (engine->call_reps > 1)
    printf(" of %d calls back to back on the GPU's compute stream and a synchronisation, / %d", engine->call_reps,
           engine->call_reps);
  printf("\n");
  if (s[S_A2A_INTRA].skipped)
    printf("# one rank, one GPU: the GEMMs only; the profile's collectives are 0 (1 node x 1 GPU)\n");
  fflush(stdout);
}

// Times every series on every rank; the seconds it took. grid_run_ms: the least length of the GEMM
// grid's runs, 0 for no grid (the engine has none, or --model names the shapes).
static double measure_all(RtComm *comm, Series *s, const GemmShape *shapes, int nshapes, bool quick,
                          double grid_run_ms) {
  double t_start = MPI_Wtime();
  int comm_idx[COMM_SIZES], gemm_idx[GEMM_SIZES];
  Progress pr = {.on = T.rank == 0 && watched()};
  bool collectives = !s[S_A2A_INTRA].skipped;
  int elem_idx[ELEM_SIZES];
  pr.total = nshapes * gemm_sweep(quick, gemm_idx) + (collectives ? NCOLLECTIVES : 0) * (SMALL_SIZES + sweep(COMM_SIZES, quick, comm_idx)) +
             (s[S_ELEM].skipped ? 0 : sweep(ELEM_SIZES, quick, elem_idx)) +
             (s[S_ATTN].skipped ? 0 : 2 * sweep(ATTN_SIZES, quick, elem_idx)) +
             (s[S_MATH].skipped ? 0 : 3 * sweep(ELEM_SIZES, quick, elem_idx)) +
             (grid_run_ms > 0 ? grid_points() : 0);
  run_gemms(&s[S_GEMM], shapes, nshapes, quick, &pr);
  if (grid_run_ms > 0) run_gemm_grid(grid_run_ms, &pr);
  if (!s[S_ELEM].skipped) run_elementwise(&s[S_ELEM], quick, &pr);
  if (!s[S_ATTN].skipped) run_attention(s, quick, &pr);
  if (!s[S_MATH].skipped) run_kernel_sweeps(s, quick, &pr);
  if (collectives && engine->probes) engine->probes(&T, comm, s, shapes);
  if (collectives) {
    float *send, *recv;
    engine->comm_buffers((size_t)(COMM_SIZES * COMM_UNIT), &send, &recv);
    for (int i = S_A2A_INTRA; i <= S_P2P_INTER; i++)
      if (!s[i].skipped) run_comm(comm, &s[i], send, recv, quick, &pr);
    engine->free_comm_buffers(send, recv);
  }
  progress_end(&pr);
  return MPI_Wtime() - t_start;
}

// The fit of one series. Collectives: alpha is the time of the smallest size (2^8 floats, a
// measurement of the fixed cost, never a negative intercept), beta the slope above it fitted to
// the sizes from 2^18 on. GEMMs: relative least squares, so that the small sizes a pipeline's
// chunks run at count as much as the large ones. Element-wise kernels: alpha the smallest size's
// time, beta the slope from 2^20 floats on (a GPU's 2^23: T.elem_shift), where a step's
// activations live (beyond the caches).
static bool fit_series(Series *x) {
  if (x->op == OP_GEMM || x->op == OP_ATTENTION)
    return fit_line_relative(x->x, x->t, x->points, &x->fit, x->err, sizeof x->err);
  if (x->op == OP_ELEMENTWISE)   // the slope where the data leaves the caches
    return fit_anchored(x->x, x->t, x->points, x->t[0], 5.0 * ldexp(1, 20 + T.elem_shift), &x->fit, x->err, sizeof x->err);
  if (x->op == OP_MATH || x->op == OP_ADAMW || x->op == OP_SGD)
    return fit_anchored(x->x, x->t, x->points, x->t[0], ldexp(1, 20 + T.elem_shift), &x->fit, x->err, sizeof x->err);
  return fit_anchored(x->x, x->t, x->points, x->t[0], COMM_UNIT, &x->fit, x->err, sizeof x->err);
}

// Rank 0: fits every series and prints the table (with -v every point first); the number of
// fits that failed.
static int fit_and_print(const TuneOptions *o, const TuneRun *r, Series *s) {
  int failed = 0;
  for (int i = 0; i < NSERIES; i++) {
    if (s[i].skipped) continue;
    s[i].ok = fit_series(&s[i]);
    failed += !s[i].ok;
  }
  if (o->verbose) {
    printf("#\n# %-13s %-10s %14s %12s\n", "model", "group", "n", "ms");
    for (int i = 0; i < NSERIES; i++)
      for (int p = 0; p < s[i].points; p++)
        printf("# %-13s %-10s %14.0f %12.5f\n", s[i].name, s[i].where, s[i].x[p], s[i].t[p]);
  }
  printf("#\n# %-13s %-10s %5s %6s %13s %13s %10s  %s\n", "model", "group", "ranks", "points", "alpha_ms",
         "beta_ms", "r2", "in the profile");
  for (int i = 0; i < NSERIES; i++) {
    const Series *x = &s[i];
    const char *use = i == S_A2A_INTRA   ? on_a_node(s, i) ? "yes (alltoall_intra)" : "no (one rank per node)"
                      : i == S_AR_INTRA ? on_a_node(s, i) ? "yes (allreduce_intra)" : "no (one rank per node)"
                      : i == S_P2P_INTRA ? on_a_node(s, i) ? "yes (p2p_intra)" : "no (one rank per node)"
                                        : "yes";
    if (x->skipped) {
      bool p2p = (i == S_P2P_INTRA || i == S_P2P_INTER) && T.p2p_note[0];
      printf("  %-13s %-10s %5d %6d %13s %13s %10s  %s\n", x->name, x->where, 1, 0, "-", "-", "-",
             i >= S_ELEM ? T.kernels_note : p2p ? T.p2p_note
                         : "not measured (one rank: no collectives); 0 in the profile");
      continue;
    }
    if (!x->ok) {
      printf("  %-13s %-10s %5d %6d %13s %13s %10s  %s\n", x->name, x->where, each_rank(i) ? r->world : x->group_size,
             x->points, "-", "-", "-", x->err);
      continue;
    }
    printf("  %-13s %-10s %5d %6d %13.4e %13.4e %10.6f  %s\n", x->name, x->where,
           each_rank(i) ? r->world : x->group_size, x->points, x->fit.alpha, x->fit.beta, x->fit.r2, use);
  }
  if (T.handoff_ms >= 0)
    printf("  %-13s %-10s %5d %6d %13.4e %13s %10s  yes\n", "handoff", "each-rank", r->world, HANDOFF_RUNS, T.handoff_ms,
           "-", "-");
  if (T.slow_compute >= 0)
    printf("# overlap probe: GEMMs %.1f %% slower and the AlltoAll %.1f %% slower when they run at once (in the profile)\n",
           100 * T.slow_compute, 100 * T.slow_comm);
  if (ngrid > 0) {
    int fast = 0, slow = 0;
    for (int i = 1; i < ngrid; i++) {
      if (grid_ms_per_mac(i) < grid_ms_per_mac(fast)) fast = i;
      if (grid_ms_per_mac(i) > grid_ms_per_mac(slow)) slow = i;
    }
    printf("# gemm grid: %d shapes (gemm_at lines), each the median of %d passes of runs of at least %g ms%s; ms per "
           "multiply-accumulate from %.3e ([%d, %d] x [%d, %d]) to %.3e ([%d, %d] x [%d, %d])\n",
           ngrid, RUNS, grid_run, grid_run == GRID_RUN_SHARED_MS ? " (the ranks' threads outnumber the cores)" : "",
           grid_ms_per_mac(fast), (int)grid[fast][0], (int)grid[fast][1], (int)grid[fast][1], (int)grid[fast][2],
           grid_ms_per_mac(slow), (int)grid[slow][0], (int)grid[slow][1], (int)grid[slow][1], (int)grid[slow][2]);
  }
  for (int i = 0; i < NSERIES; i++)
    if (s[i].ok && (s[i].fit.alpha < 0 || s[i].fit.beta < 0) &&
        (on_a_node(s, i) || (i != S_A2A_INTRA && i != S_AR_INTRA && i != S_P2P_INTRA)))
      printf("# warning: %s (%s): fitted %s < 0 (noise, or times the line does not follow near n = 0); "
             "the profile holds 0 instead and says so in a comment\n", s[i].name,
             s[i].where, s[i].fit.alpha < 0 && s[i].fit.beta < 0 ? "alpha and beta" : s[i].fit.alpha < 0 ? "alpha" : "beta");
  return failed;
}

// Rank 0, an engine whose programs run the expert GEMMs over their filled rows with a GEMM of their
// own (engine->expert_gemm: the CUDA programs' rt_cuda_expert_gemm_rows): that GEMM timed against
// what the profile's GEMM fits (the grid where there is one, else `gemm`) give for the same filled
// rows, the ratio of the sums over the shapes into T.expert_scale (the profile's expert_gemm_scale,
// by which the planner multiplies the expert GEMMs); its sizes: tune_expert_rows.
static void measure_expert_scale(const Series *s, const GemmShape *shapes, int nshapes) {
  if (!engine->expert_gemm || !s[S_GEMM].ok) return;
  static SchedCluster c;
  c = (SchedCluster){.gemm = {s[S_GEMM].fit.alpha, s[S_GEMM].fit.beta}};
  for (int i = 0; i < ngrid && i < SCHED_MAX_GEMM_AT; i++)
    c.gemm_at[c.ngemm_at++] = (SchedGemmAt){grid[i][0], grid[i][1], grid[i][2], grid[i][3]};
  const int experts = TUNE_EXPERTS;
  double measured = 0, fitted = 0;
  char what[200] = "", sizes[120] = "";
  size_t u = 0;
  for (int j = 0; j < nshapes; j++) {
    int filled, slots;
    tune_expert_rows(engine->tokens_for(&shapes[j], GEMM_SIZES / 2), &filled, &slots);
    measured += engine->expert_gemm(experts, slots, filled, shapes[j].k, shapes[j].n, what, sizeof what);
    fitted += experts * sched_gemm_ms(&c, filled, shapes[j].k, shapes[j].n);
    if (u < sizeof sizes) u += (size_t)snprintf(sizes + u, sizeof sizes - u, "%s%d of %d", j ? ", " : "", filled, slots);
  }
  if (!(measured > 0) || !(fitted > 0)) return;
  T.expert_scale = measured / fitted;
  snprintf(T.expert_note, sizeof T.expert_note, "%s: %.4g ms for %d experts x %d shapes (rows filled: %s), the GEMM fits "
           "%.4g ms", what, measured, experts, nshapes, sizes, fitted);
  printf("# expert GEMMs over their filled rows (%s): expert_gemm_scale %.4f (in the profile)\n", T.expert_note,
         T.expert_scale);
}

// Rank 0: writes the profile to -o (or shows it); false if it could not be written (reported).
static bool write_or_show(const TuneOptions *o, const TuneRun *r, const Series *s, const GemmShape *shapes,
                          int nshapes, const char *gemm_desc) {
  char name[128];
  cluster_name(o->output, name, sizeof name);
  char *header = profile_header(r->command, r->date, r->host, r->cores, r->world, r->nodes_line, gemm_desc, shapes,
                                nshapes, o->quick, s);
  bool ok = true;
  if (o->output) {
    if (write_atomically(o->output, header, name, r->nodes, r->gpn, s)) {
      printf("# wrote %s (cluster %s)\n", o->output, name);
    } else {
      fprintf(stderr, "moec: error: cannot write '%s': %s\n", o->output, strerror(errno));
      ok = false;
    }
  } else {
    printf("# no -o given, nothing written; the profile would read:\n");
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (mem) {
      write_profile(mem, header, name, r->nodes, r->gpn, s);
      fclose(mem);
      for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) printf("#   | %s\n", line);
    }
    free(text);
  }
  free(header);
  return ok;
}

int tune_main(const TuneEngine *e, int argc, char **argv) {
  engine = e;
  int provided;   // rt_comm_create reuses this MPI
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int world;
  MPI_Comm_rank(MPI_COMM_WORLD, &T.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  TuneOptions o = {0};
  int status = parse_options(argc, argv, &o) ? check_world(&o, world) : 2;
  if (status) {
    MPI_Finalize();
    return status;
  }
  GemmShape shapes[MAX_SHAPES];
  char gemm_desc[1024] = "";
  int nshapes = read_shapes(&o, shapes, gemm_desc, sizeof gemm_desc);
  if (nshapes <= 0) {
    MPI_Finalize();
    return 1;
  }
  TuneRun r = {0};
  describe_run(argc, argv, &o, world, &r);
  r.threads = rt_threads_setup(r.local_size);   // the GEMMs threaded as a training binary's on this node
  RtLayout layout = {r.nodes, r.gpn, r.nodes, r.gpn, r.gpn};   // mp = esp = G: ESP = intra-node, EP = inter-node
  RtComm *comm = rt_comm_create(&layout, r.nodes);
  if (!comm) {
    MPI_Finalize();
    return 1;
  }
  Series *s = calloc(NSERIES, sizeof *s);
  if (!s) rt_comm_abort("moec tune: out of memory");
  init_series(comm, s);
  if (engine->open && !engine->open(&T, &o, comm, s, shapes, nshapes, world)) {
    engine->close();
    free(s);
    rt_comm_destroy(comm);
    MPI_Finalize();
    return 1;
  }
  engine->memory(&T, &r);
  if (T.rank == 0) print_preamble(&o, &r, s, shapes, nshapes, gemm_desc);
  bool shared = engine->on_cores && r.local_size * r.threads > r.cores;
  double grid_run_ms = !engine->gemm_grid || o.model ? 0 : shared ? GRID_RUN_SHARED_MS : GRID_RUN_MS;
  double seconds = measure_all(comm, s, shapes, nshapes, o.quick, grid_run_ms);

  int failed = 0;
  if (T.rank == 0) {
    failed = fit_and_print(&o, &r, s);
    if (!failed) measure_expert_scale(s, shapes, nshapes);
    printf("# measured in %.1f s\n", seconds);
    if (failed) printf("# %d fit%s failed: no profile written\n", failed, failed == 1 ? "" : "s");
    else if (!write_or_show(&o, &r, s, shapes, nshapes, gemm_desc)) failed = 1;
    puts(failed ? "FAILED" : "OK");
    fflush(stdout);
  }
  MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (engine->close) engine->close();
  free(s);
  rt_comm_destroy(comm);
  MPI_Finalize();
  return failed ? 1 : 0;
}
