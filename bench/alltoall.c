// alltoall: the three AlltoAll algorithms of runtime/comm.c, flat (one MPI_Alltoall), 1dh
// (HetuMoE: gather to a node leader, leaders exchange, scatter) and 2dh (Tutel/DeepSpeed:
// intra-node AlltoAll, stride transform, inter-node AlltoAll), on the EP group of the CPU
// backend, over message sizes.
//
// The layout is dp = P, mp = 1, ep = P / esp (esp 1 by default), gpus_per_node ranks per node
// (P / 2 by default: two nodes, so that the hierarchical algorithms have an inter-node step).
// Sizes are floats each rank sends to each EP peer, 2^min ... 2^max doubling. For each size the
// three algorithms first run once on the same data and must deliver identical bytes, equal to
// the blocks each peer sent (checked on every rank); then each runs once to warm up and
// `runs` times interleaved (flat, 1dh, 2dh, flat, ...), each run between barriers and timed by
// its slowest rank; the median is reported in milliseconds. Rank 0 prints '#' metadata, a
// fixed-width table and an OK footer when every size verified (else FAILED, exit 1).
//
// Build from the repository root after `make` (build/libmoert.a with comm.c); one line:
//   mkdir -p build/bench
//   mpicc -O2 -std=c11 -D_GNU_SOURCE -Iruntime bench/alltoall.c build/libmoert.a
//         -lopenblas -lcjson -lm -o build/bench/alltoall
//   mpirun --oversubscribe -np 8 build/bench/alltoall [--gpus-per-node G] [--esp S]
//          [--min 10] [--max 20] [--runs 5]
// (as root add --allow-run-as-root). On a machine with fewer cores than ranks the ranks share
// cores, so the numbers compare the algorithms' data movement, not a real network.
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moert.h"
#include "rt_internal.h"

enum { NALGOS = 3 };
static const RtA2aAlgo algos[NALGOS] = {RT_A2A_FLAT, RT_A2A_1DH, RT_A2A_2DH};

typedef struct Options {
  int gpus_per_node, esp, min_pow, max_pow, runs;
} Options;

static uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Element e of the block world rank src sends to world rank dst: arbitrary bits.
static float pattern(int src, int dst, int64_t e) {
  uint32_t bits = (uint32_t)mix(((uint64_t)src << 48) ^ ((uint64_t)dst << 32) ^ (uint64_t)e);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p)
    rt_comm_abort("alltoall bench: out of memory (%zu bytes)", bytes);
  return p;
}

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

// Milliseconds of one call, as seen by the slowest rank.
static double timed(RtComm *comm, RtA2aAlgo algo, const float *send, float *recv, int64_t count) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  rt_alltoall(comm, RT_GROUP_EP, algo, send, recv, count);
  double ms = (MPI_Wtime() - t0) * 1e3, slowest;
  MPI_Allreduce(&ms, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

static int parse_int(const char *flag, const char *value, int min) {
  char *end;
  long v = value ? strtol(value, &end, 10) : 0;
  if (!value || *end || end == value || v < min || v > 1 << 20)
    rt_comm_abort("alltoall bench: %s needs a whole number of at least %d", flag, min);
  return (int)v;
}

int main(int argc, char **argv) {
  int provided;   // rt_comm_create reuses this MPI
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Options o = {world > 1 ? world / 2 : 1, 1, 10, 20, 5};
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(f, "--gpus-per-node")) o.gpus_per_node = parse_int(f, v, 1), i++;
    else if (!strcmp(f, "--esp")) o.esp = parse_int(f, v, 1), i++;
    else if (!strcmp(f, "--min")) o.min_pow = parse_int(f, v, 0), i++;
    else if (!strcmp(f, "--max")) o.max_pow = parse_int(f, v, 0), i++;
    else if (!strcmp(f, "--runs")) o.runs = parse_int(f, v, 1), i++;
    else rt_comm_abort("alltoall bench: unknown argument '%s'", f);
  }
  if (o.max_pow < o.min_pow || o.max_pow > 28 || world % o.esp != 0)
    rt_comm_abort("alltoall bench: need min <= max <= 28 and esp dividing %d ranks", world);
  RtLayout layout = {world, 1, world / o.esp, o.esp, o.gpus_per_node};
  RtComm *comm = rt_comm_create(&layout, 0);
  if (!comm) {
    MPI_Finalize();
    return 1;
  }

  int peers = rt_comm_size(comm, RT_GROUP_EP);
  int *members = xmalloc(sizeof(int) * peers);
  {
    float me = (float)rank, *all = xmalloc(sizeof(float) * peers);
    rt_allgather(comm, RT_GROUP_EP, &me, all, 1);
    for (int i = 0; i < peers; i++)
      members[i] = (int)all[i];
    free(all);
  }
  if (rank == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len;
    MPI_Get_library_version(version, &len);
    version[strcspn(version, ",\n")] = '\0';
    printf("# alltoall: flat, 1dh, 2dh on the EP group, CPU backend (%s, %ld cores)\n", version,
           sysconf(_SC_NPROCESSORS_ONLN));
    int nodes, per_node;
    bool regular = rt_comm_hierarchy(comm, RT_GROUP_EP, &nodes, &per_node);
    printf("# %d ranks, gpus_per_node %d, ep %d esp %d; ", world, o.gpus_per_node, layout.ep,
           layout.esp);
    if (regular)
      printf("EP group of rank 0: %d node%s x %d member%s\n", nodes, nodes == 1 ? "" : "s",
             per_node, per_node == 1 ? "" : "s");
    else
      printf("EP group of rank 0 uneven over %d nodes: 1dh and 2dh run flat\n", nodes);
    printf("# size: floats each rank sends to each of its %d EP peers; ms: median of %d runs after "
           "1 warm-up, slowest rank\n", peers, o.runs);
    printf("%10s %12s %10s %10s %10s  %s\n", "size", "bytes/rank", "flat ms", "1dh ms", "2dh ms",
           "identical");
    fflush(stdout);
  }

  bool all_ok = true;
  double *samples = xmalloc(sizeof(double) * NALGOS * o.runs);
  for (int p = o.min_pow; p <= o.max_pow; p++) {
    int64_t count = (int64_t)1 << p, total = count * peers;
    float *send = xmalloc(sizeof(float) * total);
    float *recv[NALGOS];
    for (int a = 0; a < NALGOS; a++)
      recv[a] = xmalloc(sizeof(float) * total);
    for (int i = 0; i < peers; i++)
      for (int64_t e = 0; e < count; e++)
        send[i * count + e] = pattern(rank, members[i], e);

    // Verify before timing: identical bytes across the algorithms, equal to what peers sent.
    for (int a = 0; a < NALGOS; a++) {
      memset(recv[a], 0xCD, sizeof(float) * total);
      rt_alltoall(comm, RT_GROUP_EP, algos[a], send, recv[a], count);
    }
    int wrong = 0;
    for (int a = 1; a < NALGOS; a++)
      wrong += memcmp(recv[0], recv[a], sizeof(float) * total) != 0;
    for (int i = 0; i < peers && !wrong; i++)
      for (int64_t e = 0; e < count; e++) {
        float want = pattern(members[i], rank, e);
        if (memcmp(&recv[0][i * count + e], &want, sizeof want) != 0) {
          wrong = 1;
          break;
        }
      }
    int wrong_anywhere;
    MPI_Allreduce(&wrong, &wrong_anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    bool ok = wrong_anywhere == 0;
    all_ok = all_ok && ok;

    for (int a = 0; a < NALGOS; a++)
      timed(comm, algos[a], send, recv[a], count);
    for (int r = 0; r < o.runs; r++)
      for (int a = 0; a < NALGOS; a++)
        samples[a * o.runs + r] = timed(comm, algos[a], send, recv[a], count);
    if (rank == 0) {
      printf("%10lld %12lld", (long long)count, (long long)(total * (int64_t)sizeof(float)));
      for (int a = 0; a < NALGOS; a++) {
        qsort(samples + a * o.runs, o.runs, sizeof(double), compare_doubles);
        printf(" %10.3f", samples[a * o.runs + o.runs / 2]);
      }
      printf("  %s\n", ok ? "yes" : "NO");
      fflush(stdout);
    }
    free(send);
    for (int a = 0; a < NALGOS; a++)
      free(recv[a]);
  }
  if (rank == 0)
    puts(all_ok ? "OK" : "FAILED");
  free(samples);
  free(members);
  rt_comm_destroy(comm);
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
