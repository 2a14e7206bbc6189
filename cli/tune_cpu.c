// `moec tune`'s CPU engine (cli/tune.h): the runtime's OpenBLAS GEMMs (rt_matmul), its MPI
// collectives and point-to-point messages (MPI_Isend and MPI_Irecv, as its pipeline stages send
// them), its element-wise and attention kernels, and two probes only a CPU rank has: the
// stream hand-off (runtime/streams.c's threads) and the overlap of GEMMs with an AlltoAll on the
// same cores. `memory` is the smallest MemTotal (/proc/meminfo) of the ranks' hosts divided by
// the ranks per node. cli_tune, the command, runs the sweep (cli/tune.c) with it, or for
// --target cuda build/cuda/moec-tune-cuda in its place (cli/tune_cuda.c).
#include <mpi.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/tune.h"
#include "runtime/moert.h"

// GEMM operand sets each size cycles through (the sweep allocates them, call takes the next):
// each run of a size takes the next of the ring (an expert's weights, its tokens, its output), as
// a step's chunks do: the runtime's GEMMs read weights and activations that other work has pushed
// out of the caches since their last use, and an operand that stays cached from run to run would
// time a GEMM faster than any the step runs.
enum { GEMM_RING = 8, QUICK_GEMM_SIZES = 6 };
static int gemm_turn;

// The CPU doubles the tokens from 4 to 8192 (m = 4 * 2^(k-1)): the chunks a pipeline degree r
// cuts an expert's slots into span that range, and a CPU GEMM's speed depends on m.
static int tokens_for(const GemmShape *s, int k) {
  (void)s;
  return 4 << (k - 1);
}

static void call(const Call *c) {
  switch (c->op) {
  case OP_GEMM: {   // the next operand set of the ring (run_gemms)
    size_t turn = (size_t)(gemm_turn++ % (c->ring > 0 ? c->ring : GEMM_RING));
    rt_matmul((const float *)c->a + turn * c->m * c->k, (const float *)c->b + turn * c->k * c->n,
              c->c + turn * c->m * c->n, c->m, c->n, c->k, false, false, false);
    break;
  }
  case OP_ALLTOALL: rt_alltoall(c->comm, c->group, RT_A2A_FLAT, c->send, c->recv, c->count); break;
  case OP_ALLGATHER: rt_allgather(c->comm, c->group, c->send, c->recv, c->count); break;
  case OP_REDUCESCATTER: rt_reducescatter(c->comm, c->group, c->send, c->recv, c->count); break;
  case OP_ALLREDUCE: rt_allreduce(c->comm, c->group, c->send, c->count); break;
  case OP_ELEMENTWISE:   // a copy (the layouts, concats, chunks) and an add: 5 floats moved per element
    rt_copy(c->send, c->c, c->count);
    rt_add(c->c, c->recv, c->send, c->count);
    break;
  case OP_MATH: rt_gelu(c->send, c->c, c->count, 1024); break;   // tanh and its arithmetic per element
  case OP_ADAMW:   // the update of count parameters at c from the gradient send, moments in attn_stats / attn_grad
    rt_adamw(c->c, c->send, c->attn_stats, c->attn_grad, c->count, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 10, 1.0f, 1.0f);
    break;
  case OP_SGD: rt_sgd(c->c, c->send, c->count, 1e-3f, 0.1f, 1.0f, 1.0f); break;
  case OP_P2P: {   // as runtime/pipeline.c sends activations: a nonblocking send while the peer's arrives
    MPI_Request req[2];
    MPI_Irecv(c->recv, (int)c->count, MPI_FLOAT, c->from, 62, MPI_COMM_WORLD, &req[0]);
    MPI_Isend(c->send, (int)c->count, MPI_FLOAT, c->to, 62, MPI_COMM_WORLD, &req[1]);
    MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
    break;
  }
  case OP_ATTENTION: {   // q a, k b, v send, o c, dy recv; m rows; n 0 forward, 1 backward
    const AttnShape *s = c->attn;
    int qc = s->heads * s->d;
    if (!c->n) {
      rt_attn_fwd(c->a, c->b, c->send, c->c, c->m, s->seq, s->heads, s->kv, qc, 0, 0.0f);
    } else {
      rt_attn_stats(c->recv, c->a, c->b, c->c, c->attn_stats, c->m, s->seq, s->heads, s->kv, qc, 0, 0.0f);
      rt_attn_grad_q(c->recv, c->a, c->b, c->send, c->attn_stats, c->attn_grad, c->m, s->seq, s->heads, s->kv, qc, 0, 0.0f);
      rt_attn_grad_kv(c->recv, c->a, c->b, c->send, c->attn_stats, c->attn_grad, c->m, s->seq, s->heads, s->kv, qc, 0, 0.0f);
    }
    break;
  }
  }
}
static void comm_buffers(size_t n, float **send, float **recv) {
  *send = tune_xmalloc(sizeof(float) * n);
  *recv = tune_xmalloc(sizeof(float) * n);
  memset(*send, 0, sizeof(float) * n);
  memset(*recv, 0, sizeof(float) * n);
}

static void free_comm_buffers(float *send, float *recv) {
  free(send);
  free(recv);
}

// n floats of host memory, zeros.
static float *host_floats(size_t n) {
  float *p = tune_xmalloc(sizeof(float) * n);
  memset(p, 0, sizeof(float) * n);
  return p;
}

// The stream hand-off (runtime/streams.c): a task of the compute stream records an event, one of
// the inter stream waits for it and records another, the compute stream waits for that: two
// hand-offs between threads, which every chunked collective pays (the compute stream hands it
// its operand and waits for its result). The median of HANDOFF_RUNS calls, in ms; -1 when the
// runtime runs streams in program order (MPI without MPI_THREAD_MULTIPLE).
static void nothing(RtStep *st) { (void)st; }

typedef struct Probe {
  RtComm *comm;
  RtGroup group;
  float *send, *recv;
  int64_t count;
  double ms;
} Probe;

static void *probe_alltoall(void *arg) {
  Probe *p = arg;
  double t0 = MPI_Wtime();
  rt_alltoall(p->comm, p->group, RT_A2A_FLAT, p->send, p->recv, p->count);
  p->ms = (MPI_Wtime() - t0) * 1e3;
  return NULL;
}

static double median3(double a, double b, double c) {
  return a > b ? (b > c ? b : a > c ? c : a) : (a > c ? a : b > c ? c : b);
}

// The overlap probe: what a rank's computation and its communication cost each other when they
// run at once, as a pipelined schedule runs them (the compute thread's GEMMs beside an AlltoAll
// on a communication thread; on a CPU they share the rank's cores, and the network stack needs
// cycles too). An AlltoAll of 2^21 floats per rank on the inter-node group, alone and beside
// GEMMs of the first expert shape that take as long, three times each; slow_compute and
// slow_comm are the relative slowdowns (medians, the slowest rank's), which the planner applies
// to the overlapped policies' GEMMs and collectives.
static void measure_overlap(Tune *t, RtComm *comm, RtGroup group, int group_size, const GemmShape *g) {
  if (!rt_comm_thread_safe(comm)) return;
  int64_t total = (int64_t)1 << 21, count = total / group_size;
  float *send = host_floats((size_t)total), *recv = host_floats((size_t)total);
  int m = 256;
  float *a = tune_xmalloc(sizeof(float) * (size_t)m * g->k), *b = tune_xmalloc(sizeof(float) * (size_t)g->k * g->n);
  float *c = tune_xmalloc(sizeof(float) * (size_t)m * g->n);
  for (size_t e = 0; e < (size_t)m * g->k; e++) a[e] = (float)((int)(e % 17) - 8) / 64;
  for (size_t e = 0; e < (size_t)g->k * g->n; e++) b[e] = (float)((int)(e % 13) - 6) / 64;
  Probe p = {comm, group, send, recv, count, 0};
  double a2a[3], gemm[3], a2a_ov[3], gemm_ov[3];
  // The GEMMs alone, and how many of them last as long as the AlltoAll.
  MPI_Barrier(MPI_COMM_WORLD);
  probe_alltoall(&p);   // warm-up
  for (int t = 0; t < 3; t++) {
    MPI_Barrier(MPI_COMM_WORLD);
    probe_alltoall(&p);
    a2a[t] = p.ms;
  }
  double t0 = MPI_Wtime();
  rt_matmul(a, b, c, m, g->n, g->k, false, false, false);
  double one = (MPI_Wtime() - t0) * 1e3, longest;
  MPI_Allreduce(&one, &longest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  double a2a_ms = median3(a2a[0], a2a[1], a2a[2]), slowest_a2a;
  MPI_Allreduce(&a2a_ms, &slowest_a2a, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  int reps = longest > 0 ? (int)(slowest_a2a / longest) : 1;
  if (reps < 1) reps = 1;
  if (reps > 10000) reps = 10000;
  for (int t = 0; t < 3; t++) {
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    for (int i = 0; i < reps; i++) rt_matmul(a, b, c, m, g->n, g->k, false, false, false);
    gemm[t] = (MPI_Wtime() - t0) * 1e3;
    MPI_Barrier(MPI_COMM_WORLD);
    pthread_t th;
    if (pthread_create(&th, NULL, probe_alltoall, &p) != 0) rt_comm_abort("moec tune: cannot start a thread");
    t0 = MPI_Wtime();
    for (int i = 0; i < reps; i++) rt_matmul(a, b, c, m, g->n, g->k, false, false, false);
    gemm_ov[t] = (MPI_Wtime() - t0) * 1e3;
    pthread_join(th, NULL);
    a2a_ov[t] = p.ms;
  }
  double mine[2] = {median3(gemm_ov[0], gemm_ov[1], gemm_ov[2]) / median3(gemm[0], gemm[1], gemm[2]) - 1,
                    median3(a2a_ov[0], a2a_ov[1], a2a_ov[2]) / a2a_ms - 1}, worst[2];
  MPI_Allreduce(mine, worst, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  t->slow_compute = worst[0] > 0 ? worst[0] : 0;
  t->slow_comm = worst[1] > 0 ? worst[1] : 0;
  free(a), free(b), free(c);
  free(send);
  free(recv);
}

static double measure_handoff(RtComm *comm) {
  if (!rt_comm_thread_safe(comm)) return -1;
  RtStreams *ex = rt_streams_create(comm);
  RtStep st = {0};
  const RtTask tasks[] = {
      {RT_STREAM_COMPUTE, nothing, 0, {0}, 0},
      {RT_STREAM_INTER, nothing, 1, {0}, 1},
      {RT_STREAM_COMPUTE, nothing, 1, {1}, -1},
  };
  double runs[HANDOFF_RUNS];
  for (int r = -10; r < HANDOFF_RUNS; r++) {
    double t0 = MPI_Wtime();
    rt_run_streams(ex, &st, tasks, 3, 2);
    if (r >= 0) runs[r] = (MPI_Wtime() - t0) * 1e3;
  }
  rt_streams_destroy(ex);
  qsort(runs, HANDOFF_RUNS, sizeof runs[0], tune_compare_doubles);
  double mine = runs[HANDOFF_RUNS / 2], slowest;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}
static void probes(Tune *t, RtComm *comm, const Series *s, const GemmShape *shapes) {
  t->handoff_ms = measure_handoff(comm);
  measure_overlap(t, comm, s[S_A2A_INTER].group, s[S_A2A_INTER].group_size, &shapes[0]);
}

// `memory`: the smallest MemTotal (/proc/meminfo) of the ranks' hosts divided by the ranks of a
// node (gpus_per_node).
static void memory(Tune *t, const TuneRun *r) {
  long long mine = -1, least;
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  long long kib;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemTotal: %lld kB", &kib) == 1 && kib > 0) {
      mine = kib * 1024;
      break;
    }
  if (f) fclose(f);
  MPI_Allreduce(&mine, &least, 1, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  t->memory_host_note[0] = '\0';
  if (least <= 0) {
    t->memory_bytes = 0;
    snprintf(t->memory_note, sizeof t->memory_note, "MemTotal could not be read from /proc/meminfo on every rank");
    return;
  }
  t->memory_bytes = least / r->gpn;
  snprintf(t->memory_note, sizeof t->memory_note, "MemTotal %.2f GiB (/proc/meminfo%s) / %d rank%s on the node",
           least / 1073741824.0, r->local_size < r->world ? ", the smallest of the ranks' hosts" : "", r->gpn,
           r->gpn == 1 ? "" : "s");
  if (r->local_size > r->gpn)
    snprintf(t->memory_host_note, sizeof t->memory_host_note,
             "memory: MemTotal divided by the %d rank%s of a node of this profile; %d ranks shared rank 0's host "
             "while it was measured (%.2f GiB each), so the nodes above are nodes of the layout, not hosts.",
             r->gpn, r->gpn == 1 ? "" : "s", r->local_size, least / 1073741824.0 / r->local_size);
}

static void print_sizes(bool quick) {
  printf("# sizes: communication 2^8, 2^11, 2^14 and %s of 2^18 .. 24*2^18 floats, gemm %s of m = 4 .. 8192 tokens, "
         "element-wise %s of 2^16 .. 2^23 floats%s\n",
         quick ? "4" : "all 24", quick ? "6" : "all 12", quick ? "4" : "all 8", quick ? " (--quick)" : "");
}

static size_t header_sizes(char *h, size_t u, size_t size, bool quick) {
  return u + snprintf(h + u, size - u,
                      "# Sizes: communication 2^8, 2^11, 2^14 and %s x 2^18 floats, gemm m = %s tokens, element-wise\n"
                      "# %s 2^16..2^23 floats;\n",
                      quick ? "4 of 1..24" : "1..24", quick ? "6 of 4, 8, ..., 8192" : "4, 8, ..., 8192",
                      quick ? "4 of" : "");
}

// GEMM sizes of 2^19 multiply-accumulates, one call a run on the host's operands (a ring of 8),
// 6 GEMM sizes with --quick, at least 2 ranks (the collectives are the point).
const TuneEngine tune_cpu_engine = {
    .name = "cpu", .gemm_unit = 524288.0, .gemm_unit_text = "2^19", .call_reps = 1, .gemm_ring = GEMM_RING,
    .quick_gemm_sizes = QUICK_GEMM_SIZES, .gemm_grid = true, .on_cores = true, .min_ranks = 2,
    .tokens_for = tokens_for, .call = call, .open = NULL, .close = NULL, .gemm_operands = NULL,
    .comm_buffers = comm_buffers, .free_comm_buffers = free_comm_buffers, .probes = probes, .memory = memory,
    .print_device = NULL, .print_sizes = print_sizes, .header_sizes = header_sizes,
};

// --target cuda: build/cuda/moec-tune-cuda beside this moec (build/moec), or moec-tune-fake under
// the tests' MOEC_CUDA_FAKE=1, in this process's place with the same arguments. Returns only when
// it cannot run (reported): 1.
static int exec_gpu_tune(char **argv) {
  char path[4096];
  ssize_t len = readlink("/proc/self/exe", path, sizeof path - 64);
  if (len <= 0) len = 0;
  path[len] = '\0';
  char *slash = strrchr(path, '/');
  const char *fake = getenv("MOEC_CUDA_FAKE");
  snprintf(slash ? slash + 1 : path, 64, "cuda/moec-tune-%s", fake && strcmp(fake, "1") == 0 ? "fake" : "cuda");
  execv(path, argv);
  fprintf(stderr, "moec: error: tune --target cuda runs %s, which cannot be run (%s): make builds it where "
                  "the CUDA toolkit, cuBLAS and NCCL are (see its '#' lines)\n", path, strerror(errno));
  return 1;
}
int cli_tune(int argc, char **argv) {
  rt_blas_kernels();
  for (int i = 2; i + 1 < argc; i++)
    if (strcmp(argv[i], "--target") == 0 && strcmp(argv[i + 1], "cuda") == 0) return exec_gpu_tune(argv);
  return tune_main(&tune_cpu_engine, argc, argv);
}
