// link: is the emulated link faithful to a real one? (tests/cluster/link.sh, docs/cluster.md)
//
// Two ranks on two emulated nodes exchange BYTES in each direction with MPI_Alltoall, three ways:
//   whole   one AlltoAll of BYTES;
//   chunks  CHUNKS back-to-back AlltoAlls of BYTES / CHUNKS (a pipelined dispatch);
//   gaps    CHUNKS AlltoAlls of BYTES / CHUNKS, each after GAP_MS of idle link (chunks that
//           alternate with expert GEMMs).
// A real link moves the bytes at its rate in all three: a shaper whose bucket refills during the
// gaps sends gapped chunks above the rate, and a transport that shakes hands per message makes
// back-to-back chunks slower than one message. Each way runs REPS times after one warm-up; rank
// 0 prints, per way, the median time the bytes were in transfer (the idle gaps excluded) in ms:
//   link whole MS chunks MS gaps MS
// Usage: link BYTES CHUNKS GAP_MS [REPS]
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static void idle_ms(double ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)((ms - 1000 * (time_t)(ms / 1000)) * 1e6)};
  nanosleep(&ts, NULL);
}

// Time of `chunks` AlltoAlls of `per` bytes to each of the 2 ranks, gaps excluded.
static double exchange(char *send, char *recv, long per, int chunks, double gap_ms) {
  MPI_Barrier(MPI_COMM_WORLD);
  double in_transfer = 0;
  for (int c = 0; c < chunks; c++) {
    if (gap_ms > 0) idle_ms(gap_ms);
    double t0 = MPI_Wtime();
    MPI_Alltoall(send, (int)per, MPI_BYTE, recv, (int)per, MPI_BYTE, MPI_COMM_WORLD);
    in_transfer += MPI_Wtime() - t0;
  }
  // The slowest rank's time: the exchange is done when both have their bytes.
  double slowest;
  MPI_Allreduce(&in_transfer, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest * 1e3;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, by_value);
  return v[n / 2];
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 4 || size != 2) {
    if (rank == 0) fprintf(stderr, "usage: mpirun -np 2 link BYTES CHUNKS GAP_MS [REPS]\n");
    MPI_Finalize();
    return 2;
  }
  long bytes = atol(argv[1]);
  int chunks = atoi(argv[2]), reps = argc > 4 ? atoi(argv[4]) : 5;
  double gap_ms = atof(argv[3]);
  if (bytes <= 0 || chunks <= 0 || reps <= 0 || reps > 64 || gap_ms < 0) {
    if (rank == 0) fprintf(stderr, "link: BYTES and CHUNKS must be positive, GAP_MS not negative, REPS 1..64\n");
    MPI_Finalize();
    return 2;
  }
  char *send = calloc((size_t)bytes * 2, 1), *recv = calloc((size_t)bytes * 2, 1);
  if (!send || !recv) MPI_Abort(MPI_COMM_WORLD, 1);
  long per = bytes / chunks;
  double whole[64], back[64], gaps[64];
  exchange(send, recv, bytes, 1, 0);   // warm-up: connections and TCP windows
  for (int i = 0; i < reps; i++) {
    whole[i] = exchange(send, recv, bytes, 1, 0);
    back[i] = exchange(send, recv, per, chunks, 0);
    gaps[i] = exchange(send, recv, per, chunks, gap_ms);
  }
  if (rank == 0)
    printf("link whole %.2f chunks %.2f gaps %.2f\n", median(whole, reps), median(back, reps), median(gaps, reps));
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
