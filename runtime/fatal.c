// The end of the job: rt_comm_abort prints one sentence naming the rank and host and ends every
// rank (MPI_Abort when MPI runs on several), rt_mpi_check turns a failed MPI call into it. The
// bottom of the runtime: error.c (out of memory), comm.c and every other file call it; it calls
// only MPI and the C library.
#include <mpi.h>

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moert.h"
#include "rt_internal.h"
#include "rt_mpi.h"

void rt_mpi_vreport(const char *prefix, const char *fmt, va_list ap) {
  char msg[4096];
  vsnprintf(msg, sizeof msg, fmt, ap);
  int initialized = 0, finalized = 0, rank = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized)
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char host[256] = "?";
  gethostname(host, sizeof host);
  host[sizeof host - 1] = '\0';
  fprintf(stderr, "moert: error: rank %d on %s: %s%s\n", rank, host, prefix, msg);
  fflush(stderr);
}

_Noreturn void rt_comm_abort(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  rt_mpi_vreport("", fmt, ap);
  va_end(ap);
  fflush(stdout);

  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  bool mpi_up = initialized && !finalized;
  if (mpi_up)
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (mpi_up && size > 1) {
    // MPI_Abort asks mpirun to end the job; should mpirun be out of reach (a cut link), the
    // alarm ends this process anyway.
    alarm(10);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  exit(1);
}

void rt_mpi_check(int err, const char *call, const char *file, int line) {
  if (err == MPI_SUCCESS)
    return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(err, text, &len) != MPI_SUCCESS)
    snprintf(text, sizeof text, "MPI error code %d", err);
  int name_len = (int)strcspn(call, "(");
  rt_comm_abort("%.*s failed at %s:%d: %s", name_len, call, file, line, text);
}
