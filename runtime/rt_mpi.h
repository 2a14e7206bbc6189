// The MPI communicators behind the parallel groups of runtime/comm.c, for the runtimes that
// bootstrap their own communicators over them (runtime/cuda: one NCCL communicator per group).
// Apart from moert.h because it needs the MPI headers.
#ifndef RT_MPI_H
#define RT_MPI_H

#include <mpi.h>
#include <stdarg.h>

#include "moert.h"

// Group g's communicator in c (world ranks in order, so a rank's index in it is its
// coordinate); MPI_COMM_NULL when c is NULL. Owned by c: do not free it.
MPI_Comm rt_comm_mpi(const RtComm *c, RtGroup g);
// Ends the job through rt_comm_abort when err is not MPI_SUCCESS, naming the call, the MPI error
// and file:line (the runtime's communicators return their errors).
void rt_mpi_check(int err, const char *call, const char *file, int line);
// MPI_CHECK(MPI_Send(...)): the call, checked by rt_mpi_check with its text and place.
#define MPI_CHECK(call) rt_mpi_check((call), #call, __FILE__, __LINE__)
// "moert: error: rank R on HOST: PREFIXMESSAGE" on stderr, flushed (MESSAGE: fmt with ap; R:
// MPI_COMM_WORLD's rank while MPI runs, else 0): what rt_comm_abort prints before it ends the
// job, and how the device runtimes (runtime/cuda, the fake device) report the errors they return.
void rt_mpi_vreport(const char *prefix, const char *fmt, va_list ap);

#endif
