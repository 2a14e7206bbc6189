// The MPI communicators behind the parallel groups of runtime/comm.c, for the runtimes that
// bootstrap their own communicators over them (runtime/cuda: one NCCL communicator per group).
// Apart from moert.h because it needs the MPI headers.
#ifndef RT_MPI_H
#define RT_MPI_H

#include <mpi.h>

#include "moert.h"

// Group g's communicator (world ranks in order, so a rank's index in it is its coordinate);
// MPI_COMM_NULL before rt_comm_init. Owned by comm.c: do not free it.
MPI_Comm rt_comm_mpi(RtGroup g);

#endif
